"""`oserve demo`: the main job — the whole live pipeline on an embedded NATS, replaying the bundled trace.

It starts a real `nats-server`, every worker (gateway/router, forecaster stage, scheduler, switch
planner, engines with the simulated backend on a clock running `--speedup` times faster than wall
time), fits the planner's models on the bundled Azure conversation trace's first `--history-minutes`,
replays the minutes after them through the client with a live view, then prints a summary and writes
a report folder. `--simulated` instead runs the same method and its baselines in
the offline simulator, side by side.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from oserve.cli import app


@app.command("demo")
def demo(
    model: str = typer.Option("llama2-70b", help="Model preset."),
    gpus: int = typer.Option(16, help="GPUs in the (simulated) cluster."),
    minutes: float = typer.Option(50.0, help="Minutes of the bundled trace to replay, after its history."),
    history_minutes: float = typer.Option(10.0, "--history-minutes", help="Minutes of the bundled trace the "
                                                                          "planner's models are fitted on."),
    speedup: float = typer.Option(60.0, help="Clock speed relative to wall time."),
    out: Path = typer.Option(Path("report/demo"), help="Report folder (PNG plots, summary.json)."),
    view: bool = typer.Option(True, help="Show the live view while replaying."),
    simulated: bool = typer.Option(False, "--simulated", help="Compare OServe with the baselines in the offline "
                                                                "simulator instead of running the live pipeline."),
    load: float = typer.Option(0.8, help="--simulated only: demand as a fraction of the best homogeneous capacity."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON at the end."),
) -> None:
    """Run the main job: the bundled trace through the live OServe pipeline, with a report folder."""
    from oserve.errors import ConfigError
    from oserve.specs import cluster_for_gpus, model_preset

    model_preset(model)  # fail fast on bad input, before any work
    cluster_for_gpus(gpus)
    if not minutes > 0 or not speedup > 0 or not history_minutes > 0:
        raise ConfigError(f"--minutes, --history-minutes and --speedup must be > 0, got {minutes}, "
                          f"{history_minutes} and {speedup}")
    out.mkdir(parents=True, exist_ok=True)
    if simulated:
        summary = _simulated(model, gpus, minutes, history_minutes, load, out, show=not json_out)
    else:
        summary = _live(model, gpus, minutes, history_minutes, speedup, out, view and not json_out,
                        show=not json_out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if json_out:
        typer.echo(json.dumps(summary, indent=2))


def _live(model: str, gpus: int, minutes: float, history_minutes: float, speedup: float, out: Path, view: bool,
          show: bool) -> dict:
    import asyncio

    from oserve.cli.live_cmds import _system_config
    from oserve.errors import ConfigError
    from oserve.cli.sim_cmds import out_console
    from oserve.streams.server import NatsServer
    from oserve.traces import load_trace

    trace = load_trace("azure-conv")
    history_s = history_minutes * 60.0
    part = trace.slice_time(history_s, history_s + minutes * 60.0)
    if not len(part):
        raise ConfigError(f"the bundled trace has no request after its first {history_minutes:g} minutes")
    config = _system_config("oserve", model, gpus, speedup, 60.0, "azure-conv", "none", "",
                            history_minutes=history_minutes)
    console = Console(stderr=True)
    console.print(f"[bold]oserve demo[/bold]: {len(part)} requests of the bundled Azure conversation trace "
                  f"(minutes {history_minutes:g} to {history_minutes + part.duration_s / 60:.0f}, after the "
                  f"{history_minutes:g} the planner is fitted on) through the live pipeline at {speedup:g}x on "
                  f"{gpus} simulated GPUs ({model}); Ctrl-C drains and stops.")
    start = time.perf_counter()
    with NatsServer() as server:
        result, record = asyncio.run(_live_run(server.url, config, part, speedup, view, console))
    result["seconds"] = time.perf_counter() - start
    _live_report(record, config, gpus, out)
    summary = {"mode": "live", "model": model, "gpus": gpus, "minutes": minutes, **result, "report": str(out)}
    if not show:
        return summary
    t = Table(title="oserve demo: live pipeline")
    t.add_column("what")
    t.add_column("value", justify="right")
    for key in ("requests", "answered", "errors", "lost", "switches", "p50_s", "p99_s", "wall_s"):
        v = result[key]
        t.add_row(key, f"{v:.2f}" if isinstance(v, float) else str(v))
    console_out = out_console()
    console_out.print(t)
    console_out.print(f"Latencies are on the pipeline's clock ({speedup:g}x wall time). Report: {out}/ (latency_cdf.png, "
                      f"deployment.png, rates.png, summary.json). For OServe against the baselines: oserve simulate, "
                      f"or oserve demo --simulated.")
    return summary


async def _live_run(url: str, config, part, speedup: float, view: bool, console: Console):
    """Start every worker, replay with the live view, drain; returns (replay result, recorded events)."""
    import asyncio
    import contextlib
    import signal

    from rich.live import Live

    from oserve.streams.client import OServeClient
    from oserve.observability.live_view import LiveView
    from oserve.streams.schemas import Completed, ForecastMade, StrategyChosen, decode
    from oserve.workers.system import LiveSystem, connect, planning_inputs, replay

    subjects = config.subjects
    record: dict[str, list] = {"forecasts": [], "strategies": [], "completions": []}

    async def on_plan(msg) -> None:
        if msg.subject == subjects.plan_event("forecast"):
            record["forecasts"].append(decode(msg.data, ForecastMade))
        elif msg.subject == subjects.plan_event("strategy"):
            record["strategies"].append(decode(msg.data, StrategyChosen))

    async def on_completed(msg) -> None:
        record["completions"].extend(decode(msg.data, Completed).items)

    nc = await connect(url, "oserve-demo")
    subs = [await nc.subscribe(subjects.plan_event("forecast"), cb=on_plan),
            await nc.subscribe(subjects.plan_event("strategy"), cb=on_plan),
            await nc.subscribe(subjects.completions(), cb=on_completed)]
    live_view = LiveView(subjects)
    await live_view.attach(nc)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        inputs = planning_inputs(config)
        record["class_names"] = list(inputs.prior.class_names)
        async with LiveSystem(nc, config, inputs) as system:
            await system.wait_serving(60)
            client = await OServeClient.connect(url, subjects=subjects, default_timeout_s=120.0)
            try:
                with Live(live_view.render(), console=console, refresh_per_second=2) if view \
                        else contextlib.nullcontext() as live:
                    task = asyncio.create_task(replay(client, part, speedup, timeout_s=120.0))
                    while not task.done() and not stop.is_set():
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(stop.wait(), 0.5)
                        if live is not None:
                            live.update(live_view.render())
                    if not task.done():
                        # Ctrl-C: stop publishing; leaving `async with` drains the workers, so every
                        # request the gateway accepted is still answered
                        console.print("oserve demo: interrupted; draining")
                        task.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await task
                        raise typer.Exit(130)
                    result = task.result()
            finally:
                await client.close()
    finally:
        for sub in subs:
            await sub.unsubscribe()
        await nc.drain()
    return result, record


def _live_report(record: dict, config, gpus: int, out: Path) -> None:
    """PNG plots from the recorded events, in the same formats as the simulator's report."""
    import numpy as np

    from oserve.engine_model import TokenHistogram
    from oserve.observability import report
    from oserve.sim.kernel import SimResult
    from oserve.specs import ReplicaShape

    done = record["completions"]
    names = tuple(record.get("class_names", ()))
    if done:
        n = len(done)
        e2e = np.array([c.e2e_s for c in done])
        ttft = np.array([c.ttft_s for c in done])
        none = np.zeros(n, dtype=bool)
        live = SimResult("oserve (live)", np.zeros(n), np.zeros(n, dtype=int), ttft, e2e, e2e, none, none, 0, 0,
                         TokenHistogram(), np.zeros(n), np.zeros(n), np.zeros(n), [])
        report.latency_cdf({"oserve (live)": live}, out / "latency_cdf.png", "Live pipeline: latency (clock seconds)")
    span_s = config.span_s
    strategies = sorted(record["strategies"], key=lambda s: s.span_index)
    if strategies:
        spans, last = [], None
        for s in strategies:
            dep = [(r.replica_id, str(ReplicaShape(r.tp, r.pp)), list(r.gpu_ids)) for r in s.replicas]
            key = sorted((shape, tuple(g)) for _, shape, g in dep)
            spans.append({"start_s": s.span_index * span_s, "span_index": s.span_index, "deployment": dep,
                          "switched": key != last})
            last = key
        report.deployment_timeline(spans, gpus, out / "deployment.png", "Live pipeline: deployment over time")
    forecasts = sorted(record["forecasts"], key=lambda f: f.span_index)
    if forecasts and names:
        planned = {f.span_index + 1: list(f.forecast_rps) for f in forecasts}
        spans = [{"start_s": f.span_start_s, "forecast_rps": planned.get(f.span_index, [])} for f in forecasts]
        counts = np.array([f.observed_counts for f in forecasts])
        report.rates_and_forecast(spans, counts, names, span_s, out / "rates.png",
                                  "Live pipeline: per-class rates and forecast")


def _simulated(model: str, gpus: int, minutes: float, history_minutes: float, load: float, out: Path,
               show: bool) -> dict:
    from oserve.cli.sim_cmds import _json_safe, _run, _table, out_console
    from oserve.evaluation.registry import POLICY_NAMES
    from oserve.observability import report

    console = Console(stderr=True)
    start = time.perf_counter()
    scenario, comparison, cluster = _run("azure-conv", model, gpus, POLICY_NAMES, load, minutes, 60.0, 0, console,
                                         history_minutes=history_minutes)
    report.latency_cdf(comparison.results, out / "latency_cdf.png", "azure-conv: latency per policy")
    oserve = comparison.results["oserve"]
    names = comparison.prior.class_names
    report.deployment_timeline(oserve.spans, cluster.num_gpus, out / "deployment.png", "OServe's deployment over time")
    report.rates_and_forecast(oserve.spans, oserve.span_counts(60.0, len(names)), names, 60.0, out / "rates.png",
                              "Per-class rates and OServe's forecast")
    s = oserve.summary()
    if show:
        out_console().print(_table(comparison, scenario))
    return _json_safe({
        "mode": "simulated", "model": model, "gpus": gpus, "minutes": minutes, "load": load,
        "requests": s["requests"], "answered": s["finished"], "refused": s["refused"], "unfinished": s["dropped"],
        "switches": s["switches"], "p99_s": s["p99_e2e_s"], "p99_ttft_s": s["p99_ttft_s"],
        "speedup_p99": comparison.speedup_p99(), "static_shape": comparison.static_shape,
        "policies": {name: r.summary() for name, r in comparison.results.items()},
        "report": str(out), "seconds": time.perf_counter() - start,
    })
