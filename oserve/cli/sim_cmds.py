"""`oserve simulate` and `oserve bench e2e`: every policy on the same workload, side by side."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from oserve.cli import app, bench_app


LOAD_HELP = ("Demand of the 90th-percentile minute (compositions: the mean) as a fraction of the best "
             "homogeneous capacity.")


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                    TimeElapsedColumn(), console=console, transient=True)


def out_console() -> Console:
    """Console for result tables: the terminal's width, or 130 columns when output is piped."""
    console = Console()
    return console if console.is_terminal else Console(width=130)


def _fmt(x: float) -> str:
    return "-" if not math.isfinite(x) else (f"{x:.3f}" if x < 10 else f"{x:.1f}")


def _table(comparison, scenario) -> Table:
    res = comparison.results
    ref = res.get("oserve")
    t = Table(title=f"{scenario.name}: {len(scenario.workload)} requests, {scenario.workload.duration_s / 60:.1f} min, "
                    f"mix CV {scenario.cv:.2f}")
    cols = ["policy", "e2e P50", "P90", "P99", "TTFT P99", "TBT P99", "req/s", "sw", "drop", "P99/OServe"]
    for c in cols:
        t.add_column(c, justify="left" if c == "policy" else "right", no_wrap=True)
    t.caption = "latencies in seconds; sw: deployments used (1 = never switched); P99/OServe > 1: OServe better"
    for name, r in res.items():
        s = r.summary()
        ratio = s["p99_e2e_s"] / ref.percentile("e2e", 99) if ref is not None else math.nan
        t.add_row(name, _fmt(s["p50_e2e_s"]), _fmt(s["p90_e2e_s"]), _fmt(s["p99_e2e_s"]), _fmt(s["p99_ttft_s"]),
                  _fmt(s["p99_tbt_s"]), f"{s['throughput_rps']:.2f}", str(s["switches"]), str(s["dropped"]),
                  f"{ratio:.2f}x" if math.isfinite(ratio) else "-")
    return t


def _forecaster_factory(name: str, k: int):
    """A factory of fresh forecasters for the simulated policies, by `oserve.forecast` name."""
    from oserve.forecast.evaluate import make_forecasters
    from oserve.sim.policies import OnlineForecaster

    make_forecasters(k, [name])  # fail fast on an unknown name
    return lambda: OnlineForecaster(next(iter(make_forecasters(k, [name]).values())))


def _run(scenario_name: str, model: str, gpus: int, policies: tuple[str, ...], load: float, minutes: float | None,
         span_s: float, seed: int, console: Console, forecaster: str = "last_value"):
    from oserve.errors import ConfigError, UnknownNameError
    from oserve.sim.cluster import SimConfig
    from oserve.sim.evaluate import POLICIES, EvalConfig, build_scenario, compare
    from oserve.specs import cluster_for_gpus, model_preset

    if not load > 0:
        raise ConfigError(f"--load must be > 0, got {load}")
    if minutes is not None and not minutes > 0:
        raise ConfigError(f"--minutes must be > 0, got {minutes}")
    if not span_s > 0:
        raise ConfigError(f"--span must be > 0 seconds, got {span_s}")
    for name in policies:
        if name not in POLICIES:
            raise UnknownNameError("policy", name, POLICIES)
    spec = model_preset(model)
    cluster = cluster_for_gpus(gpus)
    scenario = build_scenario(scenario_name, spec, cluster.gpu, cluster, load=load, minutes=minutes, seed=seed)
    with _progress(console) as bar:
        tasks: dict[str, int] = {}

        def progress(label: str, frac: float) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(f"{scenario.name}: {label}", total=1.0)
            bar.update(tasks[label], completed=frac)

        comparison = compare(spec, cluster.gpu, cluster, scenario.workload, scenario.table, policies,
                             EvalConfig(sim=SimConfig(span_s=span_s)),
                             forecaster_factory=_forecaster_factory(forecaster, len(scenario.table.type_names)),
                             progress=progress)
    return scenario, comparison, cluster


@app.command("simulate")
def simulate_cmd(
    trace: str = typer.Option("azure-conv", help="A trace file, azure-conv / azure-code, S1-S5, T1-T4 or "
                                                 "servegen-m-large / servegen-m-mid."),
    model: str = typer.Option("llama2-70b", help="Model preset."),
    gpus: int = typer.Option(16, help="GPUs in the cluster (whole 8-GPU nodes above 8)."),
    policy: str = typer.Option("all", help="all, or a comma-separated list of oserve, vllm-static, vllm-reload, "
                                           "llumnix, oracle."),
    load: float = typer.Option(0.8, help=LOAD_HELP),
    minutes: float = typer.Option(None, help="Cut a trace to this long (or set a composition's length)."),
    span: float = typer.Option(60.0, help="Re-planning span in seconds."),
    seed: int = typer.Option(0, help="Seed for scaling and sampling the workload."),
    forecaster: str = typer.Option("last_value", help="Forecaster of oserve and vllm-reload: last_value, "
                                                      "moving_average, holt_winters, lstm, ..."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    out: Path = typer.Option(None, help="Write PNG plots and a JSON summary here."),
) -> None:
    """Simulate every policy on the same workload and compare latency and throughput."""
    from oserve.sim.evaluate import POLICIES

    policies = POLICIES if policy == "all" else tuple(p.strip() for p in policy.split(",") if p.strip())
    console = Console(stderr=True)
    start = time.perf_counter()
    scenario, comparison, cluster = _run(trace, model, gpus, policies, load, minutes, span, seed, console, forecaster)
    elapsed = time.perf_counter() - start
    summary = {"scenario": scenario.name, "model": model, "gpus": gpus, "load": load, "cv": scenario.cv,
               "forecaster": forecaster,
               "requests": len(scenario.workload), "static_shape": comparison.static_shape,
               "static_tried_p99_s": comparison.static_tried, "seconds": elapsed,
               "policies": {name: r.summary() for name, r in comparison.results.items()}}
    if "oserve" in comparison.results:
        summary["speedup_p99"] = comparison.speedup_p99()
    if out is not None:
        from oserve.observability import report

        out.mkdir(parents=True, exist_ok=True)
        report.latency_cdf(comparison.results, out / "latency_cdf.png", f"{scenario.name}: latency per policy")
        for name in ("oserve", "oracle", "vllm-reload"):
            if name in comparison.results:
                r = comparison.results[name]
                report.deployment_timeline(r.spans, cluster.num_gpus, out / f"deployment_{name}.png",
                                           f"{scenario.name}: {name} deployment over time")
                report.rates_and_forecast(r.spans, scenario.table.type_names, span, out / f"rates_{name}.png",
                                          f"{scenario.name}: per-type rates and {name}'s plan")
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        summary["report"] = str(out)
    if json_out:
        typer.echo(json.dumps(summary, indent=2))
        return
    show = out_console()
    show.print(_table(comparison, scenario))
    show.print(f"vllm-static chose {comparison.static_shape} (tried: " +
                    ", ".join(f"{k} P99 {_fmt(v)} s" for k, v in comparison.static_tried.items()) +
                    f"); simulated in {elapsed:.1f} s" + (f"; report in {out}" if out else ""))


def _rank_correlation(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation of the finite pairs (nan with fewer than 3). Pure."""
    from scipy.stats import spearmanr

    pairs = [(a, b) for a, b in zip(x, y) if math.isfinite(a) and math.isfinite(b)]
    if len(pairs) < 3:
        return math.nan
    rho = spearmanr([a for a, _ in pairs], [b for _, b in pairs]).statistic
    return float(rho) if math.isfinite(rho) else math.nan


E2E_SCENARIOS = ("S1", "S2", "S3", "S4", "S5", "T1", "T2", "T3", "T4", "azure-conv", "azure-code", "servegen-m-large",
                 "servegen-m-mid")


@bench_app.command("e2e")
def bench_e2e(
    model: str = typer.Option("llama2-70b", help="Model preset."),
    gpus: int = typer.Option(16, help="GPUs in the cluster."),
    load: float = typer.Option(0.8, help=LOAD_HELP),
    scenarios: str = typer.Option(",".join(E2E_SCENARIOS), help="Comma-separated scenario names."),
    extra_32: bool = typer.Option(True, help="Also run azure-conv on 32 GPUs."),
    minutes: float = typer.Option(None, help="Length of each scenario (default: 20 min per composition, "
                                             "30 min per sequence, whole traces)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    out: Path = typer.Option(None, help="Write e2e.json and speedups.png (bars per scenario, speedup vs mix "
                                        "CV) here."),
) -> None:
    """OServe's P99 against each baseline on the paper's scenarios, the Azure traces and ServeGen."""
    from oserve.sim.evaluate import POLICIES

    console = Console(stderr=True)
    runs = [(name, gpus) for name in scenarios.split(",") if name]
    if extra_32:
        runs.append(("azure-conv", 32))
    rows, skipped = [], []
    start = time.perf_counter()
    for name, n_gpus in runs:
        if name.startswith("servegen-"):
            from oserve.errors import ConfigError
            from oserve.sim.servegen import resolve_servegen

            try:
                resolve_servegen(name)
            except ConfigError as e:  # the ServeGen traces live in ../shared/data, not in the package
                skipped.append({"name": name, "reason": str(e)})
                console.print(f"{name}: skipped ({e})")
                continue
        scenario, comparison, _ = _run(name, model, n_gpus, POLICIES, load, minutes, 60.0, 0, console)
        res = comparison.results
        row = {"name": f"{scenario.name}@{n_gpus}", "gpus": n_gpus, "cv": scenario.cv, "requests": len(scenario.workload),
               "p99": {k: r.percentile("e2e", 99) for k, r in res.items()},
               "p99_ttft": {k: r.percentile("ttft", 99) for k, r in res.items()},
               "throughput": {k: r.throughput_rps for k, r in res.items()},
               "speedup_p99": comparison.speedup_p99(), "static_shape": comparison.static_shape}
        rows.append(row)
        console.print(f"{row['name']}: " + ", ".join(f"{k} {v:.2f}x" for k, v in row["speedup_p99"].items()))
    def mean(key: str) -> float:
        vals = [r["speedup_p99"][key] for r in rows if key in r["speedup_p99"]]
        return float(sum(vals) / len(vals)) if vals else math.nan
    result = {"model": model, "load": load, "scenarios": rows, "skipped": skipped,
              "seconds": time.perf_counter() - start,
              "mean_speedup_p99": {k: mean(k) for k in ("vllm-static", "vllm-reload", "llumnix", "oracle")},
              "max_speedup_p99": {k: max((r["speedup_p99"].get(k, math.nan) for r in rows), default=math.nan)
                                  for k in ("vllm-static", "vllm-reload", "llumnix", "oracle")},
              "cv_rank_correlation": {k: _rank_correlation([r["cv"] for r in rows],
                                                           [r["speedup_p99"].get(k, math.nan) for r in rows])
                                      for k in ("vllm-static", "vllm-reload", "llumnix")}}
    if out is not None:
        from oserve.observability import report

        out.mkdir(parents=True, exist_ok=True)
        (out / "e2e.json").write_text(json.dumps(result, indent=2))
        report.speedups(rows, out / "speedups.png", f"{model} at load {load}: OServe's P99 speedup")
        result["report"] = str(out)
    if json_out:
        typer.echo(json.dumps(result, indent=2))
        return
    t = Table(title="OServe's P99 end-to-end speedup over each policy (>1: OServe better)")
    for c in ("scenario", "CV", "vllm-static", "vllm-reload", "llumnix", "oracle"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(r["name"], f"{r['cv']:.2f}", *(f"{r['speedup_p99'].get(k, math.nan):.2f}"
                                                 for k in ("vllm-static", "vllm-reload", "llumnix", "oracle")))
    t.add_row("mean", "", *(f"{result['mean_speedup_p99'][k]:.2f}" for k in ("vllm-static", "vllm-reload", "llumnix", "oracle")))
    out_console().print(t)


@bench_app.command("ceiling")
def bench_ceiling(
    trace: str = typer.Option("S1", help="A scenario, as for `oserve simulate --trace`."),
    model: str = typer.Option("llama2-70b", help="Model preset."),
    gpus: int = typer.Option(16, help="GPUs in the cluster."),
    load: float = typer.Option(0.8, help=LOAD_HELP),
    minutes: float = typer.Option(10.0, help="Length of the workload (every deployment simulates all of it)."),
    max_replicas: int = typer.Option(4, help="Deployments of at most this many replicas are tried."),
    top: int = typer.Option(10, help="Deployments shown in the table."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    out: Path = typer.Option(None, help="Write ceiling.json and fixed_deployments.png here."),
) -> None:
    """Every fixed deployment of the cluster, simulated with OServe's routing: the best is what choosing
    one such deployment can reach. Shown beside OServe, vllm-static and the oracle."""
    from oserve.sim.ceiling import fixed_deployment_outcomes

    from oserve.errors import ConfigError

    if max_replicas < 1:
        raise ConfigError(f"--max-replicas must be >= 1, got {max_replicas}")
    if top < 1:
        raise ConfigError(f"--top must be >= 1, got {top}")
    console = Console(stderr=True)
    start = time.perf_counter()
    scenario, comparison, cluster = _run(trace, model, gpus, ("oserve", "vllm-static", "oracle"), load, minutes,
                                         60.0, 0, console)
    from oserve.specs import model_preset

    spec = model_preset(model)
    with _progress(console) as bar:
        task = bar.add_task(f"{scenario.name}: fixed deployments", total=None)
        outcomes = fixed_deployment_outcomes(spec, cluster.gpu, cluster, scenario.workload, scenario.table,
                                             max_replicas=max_replicas,
                                             progress=lambda done, total: bar.update(task, completed=done,
                                                                                     total=total))
    refs = {name: r.percentile("e2e", 99) for name, r in comparison.results.items()}
    rows = [{"label": o.label, "replicas": len(o.shapes), "p99_e2e_s": o.p99_e2e_s, "dropped": o.dropped}
            for o in outcomes]
    best = outcomes[0]

    def over_best(p99: float) -> float:
        return p99 / best.p99_e2e_s if 0 < best.p99_e2e_s < math.inf else math.nan

    result = {"scenario": scenario.name, "model": model, "gpus": gpus, "load": load, "minutes": minutes,
              "requests": len(scenario.workload), "max_replicas": max_replicas, "deployments": len(rows),
              "best": rows[0], "p99": refs, "static_shape": comparison.static_shape,
              "oserve_over_best": over_best(refs["oserve"]), "static_over_best": over_best(refs["vllm-static"]),
              "seconds": time.perf_counter() - start, "outcomes": rows}
    if out is not None:
        from oserve.observability import report

        out.mkdir(parents=True, exist_ok=True)
        (out / "ceiling.json").write_text(json.dumps(result, indent=2))
        report.fixed_deployments(rows, refs, out / "fixed_deployments.png",
                                 f"{scenario.name} on {gpus} GPUs: every fixed deployment's P99")
        result["report"] = str(out)
    if json_out:
        typer.echo(json.dumps(result, indent=2))
        return
    t = Table(title=f"{scenario.name}, {len(scenario.workload)} requests on {gpus} GPUs: the best of "
                    f"{len(rows)} fixed deployments")
    for c in ("deployment", "P99 (s)", "dropped", "P99 / best"):
        t.add_column(c, justify="left" if c == "deployment" else "right")
    for r in rows[:top]:
        t.add_row(r["label"], _fmt(r["p99_e2e_s"]), str(r["dropped"]), _fmt(over_best(r["p99_e2e_s"])))
    for name, p99 in refs.items():
        t.add_row(f"[bold]{name}[/bold]", _fmt(p99), str(int(comparison.results[name].dropped.sum())),
                  _fmt(over_best(p99)))
    out_console().print(t)
    out_console().print(f"vllm-static chose {comparison.static_shape}; {time.perf_counter() - start:.1f} s"
                        + (f"; report in {out}" if out else ""))
