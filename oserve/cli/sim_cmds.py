"""`oserve simulate`, `oserve bench e2e`, `bench ceiling` and `bench tune`: every policy on the same
scenarios, side by side, honestly (`oserve.evaluation`)."""

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
from oserve.cli.tables import compact

LOAD_HELP = ("Demand of the 90th-percentile minute (compositions: the mean) as a fraction of the best "
             "homogeneous capacity.")


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                    TimeElapsedColumn(), console=console, transient=True)


def _in_processes(worker, args: list, workers: int, on_done, order: list[int] | None = None) -> None:
    """`worker(args[i])` for every i, in `workers` spawned processes (in this one when `workers` is 1),
    started in `order` (default: as given); `on_done(i, result)` runs here as each finishes. `worker` must be
    a module-level function and its results picklable."""
    order = list(range(len(args))) if order is None else order
    if workers <= 1:
        for i in order:
            on_done(i, worker(args[i]))
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # spawned, not forked: a fork of a process whose libraries run threads (polars) can deadlock
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=spawn) as pool:
        futures = {pool.submit(worker, args[i]): i for i in order}
        for future in as_completed(futures):
            on_done(futures[future], future.result())


def out_console() -> Console:
    """Console for result tables: the terminal's width, or 130 columns when output is piped."""
    console = Console()
    return console if console.is_terminal else Console(width=130)


def _fmt(x: float) -> str:
    return "-" if not math.isfinite(x) else (f"{x:.3f}" if x < 10 else f"{x:.1f}")


def _json_safe(value):
    """JSON has no inf or NaN: they become null."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _missing_servegen(name: str) -> str | None:
    """Why a ServeGen scenario cannot run here (its traces live in ../shared/data, not in the package),
    or None when it can or `name` is no ServeGen scenario."""
    from oserve.errors import ConfigError
    from oserve.servegen import resolve_servegen

    if not name.startswith("servegen-"):
        return None
    try:
        resolve_servegen(name)
    except ConfigError as e:
        return str(e)
    return None


def _order_stats(values: list[float]) -> dict:
    """Median (upper), P90, max and count of `values` (NaN when there are none)."""
    v = sorted(values)
    if not v:
        return {"median": math.nan, "p90": math.nan, "max": math.nan, "count": 0}
    return {"median": v[len(v) // 2], "p90": v[int(0.9 * (len(v) - 1))], "max": v[-1], "count": len(v)}


def _present(names: list[str]) -> tuple[list[str], list[dict]]:
    """(the scenarios that can run, the skipped ones with their reason): a ServeGen scenario whose traces are
    absent is skipped (`_missing_servegen`)."""
    skipped = [{"name": n, "reason": r} for n in names if (r := _missing_servegen(n)) is not None]
    gone = {x["name"] for x in skipped}
    return [n for n in names if n not in gone], skipped


def _built_scenarios(scenarios: str, spec, cluster, load: float, minutes: float | None, skipped: list[dict]):
    """Each named scenario built in turn, (name, scenario); a ServeGen one whose traces are absent is
    appended to `skipped` with its reason instead."""
    from oserve.evaluation.scenarios import build_scenario

    for name in [n.strip() for n in scenarios.split(",") if n.strip()]:
        if (reason := _missing_servegen(name)) is not None:
            skipped.append({"name": name, "reason": reason})
            continue
        yield name, build_scenario(name, spec, cluster, load=load, minutes=minutes)


def _save_report(out: Path, name: str, result: dict, plot) -> None:
    """Write a bench's result as `out/name.json`, draw its plot with `plot(report)` and record the folder."""
    from oserve.observability import report

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(_json_safe(result), indent=2))
    plot(report)
    result["report"] = str(out)


def _table(comparison, scenario) -> Table:
    res = comparison.results
    ref = res.get("oserve")
    t = Table(title=f"{scenario.name}: {len(scenario.window)} requests, {scenario.window.duration_s / 60:.1f} min "
                    f"after {scenario.history_s / 60:g} min of history, mix CV {scenario.cv:.2f}")
    # short headers, so that the table fits 80 columns (tests/test_cli_tables.py); the caption spells them out
    cols = ["policy", "P50", "P90", "P99", "TTFT99", "TBT99", "req/s", "sw", "done", "lost", "P99/OS"]
    for c in cols:
        t.add_column(c, justify="left" if c == "policy" else "right", no_wrap=True)
    t.caption = ("latencies in seconds over admitted requests, unfinished ones counting as infinite ('-'); "
                 "P50, P90, P99: end to end; TTFT99, TBT99: P99 time to first token, between tokens; sw: "
                 "deployment changes; done / lost: requests finished / not finished; P99/OS: the policy's P99 "
                 f"over OServe's (> 1: OServe better). Lower bound on any P99: {_fmt(comparison.bound_p99_s)} s")
    from oserve.evaluation.compare import speedup

    for name, r in res.items():
        s = r.summary()
        ratio = speedup(ref, r) if ref is not None and name != "oserve" else math.nan
        t.add_row(name, _fmt(s["p50_e2e_s"]), _fmt(s["p90_e2e_s"]), _fmt(s["p99_e2e_s"]), _fmt(s["p99_ttft_s"]),
                  _fmt(s["p99_tbt_s"]), f"{s['throughput_rps']:.2f}", str(s["switches"]), str(s["finished"]),
                  str(s["dropped"]), f"{ratio:.2f}x" if math.isfinite(ratio) else "-")
    return t


TRIAL_HELP = ("OServe runs its whole policy on the history beside the static candidates, and serves the one measured "
              "best as static does when it did worse there without switching (`oserve.planner.adaptive`, the "
              "trial on the history). --no-trial: faster, and OServe never defers.")


def _run(scenario_name: str, model: str, gpus: int, policies: tuple[str, ...], load: float, minutes: float | None,
         span_s: float, seed: int, console: Console | None, forecaster: str = "last_value",
         history_minutes: float = 10.0, bound: bool = True, trial: bool = True):
    from oserve.errors import ConfigError
    from oserve.evaluation.compare import EvalConfig, compare
    from oserve.evaluation.registry import policy_spec
    from oserve.evaluation.scenarios import build_scenario
    from oserve.sim.kernel import SimConfig
    from oserve.specs import cluster_for_gpus, model_preset

    if not load > 0:
        raise ConfigError(f"--load must be > 0, got {load}")
    if minutes is not None and not minutes > 0:
        raise ConfigError(f"--minutes must be > 0, got {minutes}")
    if not span_s > 0:
        raise ConfigError(f"--span must be > 0 seconds, got {span_s}")
    for name in policies:
        policy_spec(name)
    spec = model_preset(model)
    cluster = cluster_for_gpus(gpus)
    config = EvalConfig(sim=SimConfig(span_s=span_s), forecaster=forecaster, bound=bound, history_trial=trial)
    scenario = build_scenario(scenario_name, spec, cluster, load=load, minutes=minutes, seed=seed,
                              history_minutes=history_minutes)
    if console is None:  # no progress bars (a worker process of bench e2e)
        return scenario, compare(spec, cluster, scenario, policies, config, timer=time.perf_counter), cluster
    with _progress(console) as bar:
        tasks: dict[str, int] = {}

        def progress(label: str, frac: float) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(f"{scenario.name}: {label}", total=1.0)
            bar.update(tasks[label], completed=frac)

        comparison = compare(spec, cluster, scenario, policies, config, progress=progress, timer=time.perf_counter)
    return scenario, comparison, cluster


def _policies(policy: str) -> tuple[str, ...]:
    from oserve.evaluation.registry import POLICY_NAMES

    return POLICY_NAMES if policy == "all" else tuple(p.strip() for p in policy.split(",") if p.strip())


@app.command("simulate")
def simulate_cmd(
    trace: str = typer.Option("azure-conv", help="A trace file, azure-conv / azure-code, S1-S5, T1-T4, shift "
                                                 "(the demo's workload) or servegen-m-large / servegen-m-mid."),
    model: str = typer.Option("llama2-70b", help="Model preset."),
    gpus: int = typer.Option(16, help="GPUs in the cluster (whole 8-GPU nodes above 8)."),
    policy: str = typer.Option("all", help="all, or a comma-separated list of oserve, vllm-static, vllm-static-rr, "
                                           "vllm-reload, llumnix, dynamo, perfect-forecast."),
    load: float = typer.Option(0.8, help=LOAD_HELP),
    minutes: float = typer.Option(None, help="Length of the window (default: 20 min per composition, 30 min "
                                             "per sequence, the rest of a trace after its history)."),
    history_minutes: float = typer.Option(10.0, "--history-minutes", help="Minutes before the window that every "
                                                                          "policy fits its models on."),
    span: float = typer.Option(60.0, help="Re-planning span in seconds."),
    seed: int = typer.Option(0, help="Seed for scaling and sampling the workload."),
    forecaster: str = typer.Option("last_value", help="Forecaster of oserve and vllm-reload: last_value, "
                                                      "moving_average, holt_winters, lstm, ..."),
    trial: bool = typer.Option(True, help=TRIAL_HELP),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    out: Path = typer.Option(None, help="Write PNG plots and a JSON summary here."),
) -> None:
    """Simulate every policy on the same window and compare latency and throughput."""
    console = Console(stderr=True)
    start = time.perf_counter()
    scenario, comparison, cluster = _run(trace, model, gpus, _policies(policy), load, minutes, span, seed, console,
                                         forecaster, history_minutes, trial=trial)
    elapsed = time.perf_counter() - start
    summary = {"scenario": scenario.name, "model": model, "gpus": gpus, "load": load, "cv": scenario.cv,
               "forecaster": forecaster, "history_minutes": history_minutes,
               "requests": len(scenario.window), "history_requests": len(scenario.history),
               "static_shape": comparison.static_shape, "static_tried_on_history_p99_s": comparison.static_tried,
               "prior_class_accuracy": comparison.prior.accuracy, "class_accuracy": comparison.class_accuracy,
               "bound_p99_s": comparison.bound_p99_s, "seconds": elapsed,
               "policies": {name: r.summary() for name, r in comparison.results.items()}}
    if "oserve" in comparison.results:
        summary["speedup_p99"] = comparison.speedup_p99()
        summary["oserve_trial"] = comparison.results["oserve"].policy_notes.get("trial")
    if out is not None:
        from oserve.observability import report

        out.mkdir(parents=True, exist_ok=True)
        report.latency_cdf(comparison.results, out / "latency_cdf.png", f"{scenario.name}: latency per policy")
        names = comparison.prior.class_names
        for name in ("oserve", "perfect-forecast", "vllm-reload"):
            if name in comparison.results:
                r = comparison.results[name]
                report.deployment_timeline(r.spans, cluster.num_gpus, out / f"deployment_{name}.png",
                                           f"{scenario.name}: {name} deployment over time")
                report.rates_and_forecast(r.spans, r.span_counts(span, len(names)), names, span,
                                          out / f"rates_{name}.png", f"{scenario.name}: per-class rates and "
                                                                     f"{name}'s plan")
        (out / "summary.json").write_text(json.dumps(_json_safe(summary), indent=2))
        summary["report"] = str(out)
    if json_out:
        typer.echo(json.dumps(_json_safe(summary), indent=2))
        return
    from oserve.cli.demo_cmd import trial_words

    show = out_console()
    show.print(compact(_table(comparison, scenario)))
    show.print(f"vllm-static chose {comparison.static_shape} on the history (tried: " +
               ", ".join(f"{k} P99 {_fmt(v)} s" for k, v in comparison.static_tried.items()) +
               ")" + trial_words(summary.get("oserve_trial") or {}) +
               f"; classes right at arrival: {comparison.class_accuracy.get('oserve', math.nan):.0%}; "
               f"simulated in {elapsed:.1f} s" + (f"; report in {out}" if out else ""))


def _rank_correlation(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation of the finite pairs (nan with fewer than 3). Pure."""
    from scipy.stats import spearmanr

    pairs = [(a, b) for a, b in zip(x, y) if math.isfinite(a) and math.isfinite(b)]
    if len(pairs) < 3:
        return math.nan
    rho = spearmanr([a for a, _ in pairs], [b for _, b in pairs]).statistic
    return float(rho) if math.isfinite(rho) else math.nan


def _mean(values: list[float]) -> tuple[float, float]:
    """(arithmetic, geometric) mean of the finite positive values. Pure."""
    vals = [v for v in values if math.isfinite(v) and v > 0]
    if not vals:
        return math.nan, math.nan
    return sum(vals) / len(vals), math.exp(sum(math.log(v) for v in vals) / len(vals))


def _e2e_row(name: str, n_gpus: int, model: str, load: float, minutes: float | None, trial: bool,
             console: Console | None) -> dict:
    """One scenario of bench e2e: every policy's figures and OServe's speedups (a picklable dict)."""
    from oserve.evaluation.noise import p99_ratio_interval
    from oserve.evaluation.registry import POLICY_NAMES

    began = time.perf_counter()
    scenario, comparison, _ = _run(name, model, n_gpus, POLICY_NAMES, load, minutes, 60.0, 0, console, trial=trial)
    res = comparison.results
    spans = [s for s in res["oserve"].spans if math.isfinite(s.get("decide_s", math.nan))]
    ours = res["oserve"]
    # the same requests on both sides (every policy admits the same ones): each ratio's spread over the window's
    # minutes (`oserve.evaluation.noise`), against every other policy
    noise = {k: p99_ratio_interval(ours.arrival_s[ours.admitted], ours.e2e_s[ours.admitted],
                                   r.e2e_s[r.admitted]).as_dict() for k, r in res.items() if k != "oserve"}
    return {"name": f"{scenario.name}@{n_gpus}", "gpus": n_gpus, "cv": scenario.cv, "requests": len(scenario.window),
            "p99": {k: r.percentile("e2e", 99) for k, r in res.items()},
            "p99_ttft": {k: r.percentile("ttft", 99) for k, r in res.items()},
            "finished": {k: int(r.finished.sum()) for k, r in res.items()},
            "unfinished": {k: int(r.dropped.sum()) for k, r in res.items()},
            "refused": int(res["oserve"].refused.sum()),
            "throughput": {k: r.throughput_rps for k, r in res.items()},
            "speedup_p99": comparison.speedup_p99(), "static_shape": comparison.static_shape,
            "noise": noise, "static_noise": noise["vllm-static"],
            "bound_p99_s": comparison.bound_p99_s, "class_accuracy": comparison.class_accuracy.get("oserve"),
            # its trial on the history lost to the deployment measured best there: it served that one as static does
            "oserve_deferred": any(s["label"] == "deferred" for s in spans),
            "oserve_trial": ours.policy_notes.get("trial"),
            "oserve_decide_s": {**_order_stats([s["decide_s"] for s in spans]),
                                "all": [s["decide_s"] for s in spans], "labels": [s["label"] for s in spans]},
            "seconds": time.perf_counter() - began}


def _print_e2e_row(console: Console, row: dict) -> None:
    console.print(f"{row['name']}: " + ", ".join(f"{k} {v:.2f}x" for k, v in row["speedup_p99"].items())
                  + f" ({row['seconds']:.0f} s)")


def _scenario_names(scenario_set: str, scenarios: str | None, jobs: int) -> list[str]:
    """The scenarios a multi-scenario bench runs: `scenarios` (comma-separated) when given, else the named
    set (`oserve.evaluation.tuning`); `jobs` checked on the way."""
    from oserve.errors import ConfigError
    from oserve.evaluation.tuning import TEST_SET, TUNING_SET

    sets = {"test": TEST_SET, "tuning": TUNING_SET, "all": TUNING_SET + TEST_SET}
    if jobs < 0:
        raise ConfigError(f"--jobs must be >= 0, got {jobs}")
    if scenarios:
        return [n.strip() for n in scenarios.split(",") if n.strip()]
    if scenario_set not in sets:
        raise ConfigError(f"--set must be one of {', '.join(sets)}, got {scenario_set!r}")
    return list(sets[scenario_set])


def _e2e_worker(args: tuple) -> dict:
    return _e2e_row(*args, console=None)


@bench_app.command("e2e")
def bench_e2e(
    model: str = typer.Option("llama2-70b", help="Model preset."),
    gpus: int = typer.Option(16, help="GPUs in the cluster."),
    load: float = typer.Option(0.8, help=LOAD_HELP),
    scenario_set: str = typer.Option("test", "--set", help="test (the default: scenarios the thresholds were not "
                                                         "tuned on), tuning, or all."),
    scenarios: str = typer.Option(None, help="Comma-separated scenario names instead of a set."),
    extra_32: bool = typer.Option(True, help="Also run azure-conv on 32 GPUs."),
    minutes: float = typer.Option(None, help="Length of each window (default: 20 min per composition, 30 min per "
                                             "sequence, the rest of a trace after its history)."),
    jobs: int = typer.Option(0, help="Scenarios simulated at once, each in its own process (0: one per CPU)."),
    trial: bool = typer.Option(True, help=TRIAL_HELP),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    out: Path = typer.Option(None, help="Write e2e.json and speedups.png (bars per scenario, speedup vs mix "
                                        "CV) here."),
) -> None:
    """OServe's P99 against each baseline on the test scenarios (thresholds tuned on the others)."""
    import os

    from oserve.evaluation.registry import BASELINES

    names = _scenario_names(scenario_set, scenarios, jobs)
    console = Console(stderr=True)
    runs = [(name, gpus) for name in names]
    if extra_32 and "azure-conv" in names:
        runs.append(("azure-conv", 32))
    skipped = []
    for name, n_gpus in list(runs):
        if (reason := _missing_servegen(name)) is not None:
            skipped.append({"name": name, "reason": reason})
            console.print(f"{name}: skipped ({reason})")
            runs.remove((name, n_gpus))
    workers = min(jobs or (os.cpu_count() or 1), len(runs)) or 1
    start = time.perf_counter()
    # the longest first, so the processes finish together: real traces, then sequences, compositions
    order = sorted(range(len(runs)), key=lambda i: (-runs[i][1], not runs[i][0].startswith(("servegen", "azure")),
                                                   not runs[i][0].startswith("T")))
    found: dict[int, dict] = {}
    with _progress(console) as bar:
        task = bar.add_task(f"bench e2e: {len(runs)} scenarios in {workers} processes", total=len(runs))

        def done(i: int, row: dict) -> None:
            found[i] = row
            bar.update(task, advance=1)
            _print_e2e_row(console, row)
        _in_processes(_e2e_worker, [(name, n_gpus, model, load, minutes, trial) for name, n_gpus in runs], workers,
                      done, order)
    rows = [found[i] for i in range(len(runs))]
    compared = (*BASELINES, "perfect-forecast")
    means = {k: _mean([r["speedup_p99"].get(k, math.nan) for r in rows]) for k in compared}
    decide = _order_stats([t for r in rows for t in r["oserve_decide_s"]["all"]])
    # the decisions that scored deployments on the twin (not a re-route of the deployment in force)
    scoring = _order_stats([t for r in rows for t, label in zip(r["oserve_decide_s"]["all"],
                                                               r["oserve_decide_s"]["labels"])
                             if label not in ("reroute", "deferred")])
    result = {"model": model, "load": load, "set": "custom" if scenarios else scenario_set,
              "scenarios": rows, "skipped": skipped, "seconds": time.perf_counter() - start, "processes": workers,
              "oserve_decide_s": {**decide, "scoring_median": scoring["median"], "scoring_count": scoring["count"]},
              "mean_speedup_p99": {k: v[0] for k, v in means.items()},
              "geomean_speedup_p99": {k: v[1] for k, v in means.items()},
              "max_speedup_p99": {k: max((r["speedup_p99"].get(k, math.nan) for r in rows), default=math.nan)
                                  for k in compared},
              "min_speedup_p99": {k: min((r["speedup_p99"].get(k, math.nan) for r in rows), default=math.nan)
                                  for k in compared},
              # per policy, the scenarios where the whole interval of OServe's ratio to it is above 1 (OServe faster
              # beyond noise) or below 1 (slower beyond noise); the others are ties within noise
              "beyond_noise": {k: {"better": [r["name"] for r in rows if r["noise"][k]["better_beyond_noise"]],
                                   "worse": [r["name"] for r in rows if r["noise"][k]["worse_beyond_noise"]]}
                               for k in compared},
              "cv_rank_correlation": {k: _rank_correlation([r["cv"] for r in rows],
                                                           [r["speedup_p99"].get(k, math.nan) for r in rows])
                                      for k in BASELINES}}
    # OServe slower than vllm-static on the whole of the ratio's bootstrap interval (`static_noise`)
    result["worse_than_static_beyond_noise"] = result["beyond_noise"]["vllm-static"]["worse"]
    if out is not None:
        _save_report(out, "e2e", result,
                     lambda report: report.speedups(rows, out / "speedups.png",
                                                    f"{model} at load {load}: OServe's P99 speedup"))
    if json_out:
        typer.echo(json.dumps(_json_safe(result), indent=2))
        return
    t = Table(title="OServe's P99 end-to-end speedup over each policy (>1: OServe better; perfect-forecast is a "
                    "reference, its column the gap to it)")
    level = rows[0]["static_noise"]["level"] if rows else 0.9
    for c in ("scenario", "CV", *compared, f"vllm-static {level:.0%} interval", "bound/OServe"):
        t.add_column(c, justify="right")
    for r in rows:
        gap = r["bound_p99_s"] / r["p99"]["oserve"] if r["p99"]["oserve"] else math.nan
        n = r["static_noise"]
        t.add_row(r["name"], f"{r['cv']:.2f}", *(_fmt(r["speedup_p99"].get(k, math.nan)) for k in compared),
                  f"{_fmt(n['low'])}-{_fmt(n['high'])}", _fmt(gap))
    t.add_row("mean", "", *(_fmt(result["mean_speedup_p99"][k]) for k in compared), "", "")
    out_console().print(compact(t))
    worse = result["worse_than_static_beyond_noise"]
    out_console().print(f"worse than vllm-static beyond noise (the whole interval below 1; a block bootstrap over "
                        f"the window's minutes): {', '.join(worse) if worse else 'none'}")
    out_console().print(f"beyond noise, of {len(rows)} scenarios: " + "; ".join(
        f"{k} {len(v['better'])} faster, {len(v['worse'])} slower" for k, v in result["beyond_noise"].items()))
    d = result["oserve_decide_s"]
    out_console().print(f"{len(rows)} scenarios in {result['seconds'] / 60:.1f} min ({workers} processes); OServe's "
                        f"decisions: median {_fmt(d['median'])} s, P90 {_fmt(d['p90'])} s, max {_fmt(d['max'])} s; "
                        f"of the {d['scoring_count']} that scored deployments, median {_fmt(d['scoring_median'])} s")


@bench_app.command("ceiling")
def bench_ceiling(
    trace: str = typer.Option("S1", help="A scenario, as for `oserve simulate --trace`."),
    model: str = typer.Option("llama2-70b", help="Model preset."),
    gpus: int = typer.Option(16, help="GPUs in the cluster."),
    load: float = typer.Option(0.8, help=LOAD_HELP),
    minutes: float = typer.Option(10.0, help="Length of the window (every deployment simulates all of it)."),
    max_replicas: int = typer.Option(4, help="Deployments of at most this many replicas are tried."),
    top: int = typer.Option(10, help="Deployments shown in the table."),
    slice_minutes: float = typer.Option(0.0, help="Also bound switching: the best deployment per slice of this "
                                        "many minutes (a shifting workload's phase: 6 for `shift` of 18 "
                                        "minutes); 0: not."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    out: Path = typer.Option(None, help="Write ceiling.json and fixed_deployments.png here."),
) -> None:
    """Every fixed deployment of the cluster, simulated with OServe's routing: the best is what choosing
    one such deployment can reach, with hindsight. Shown beside OServe, vllm-static and the
    perfect-forecast reference. With --slice-minutes, also the most switching among them can win: the
    best deployment per slice, with hindsight, each slice from idle replicas, changes free."""
    from oserve.errors import ConfigError
    from oserve.evaluation.ceiling import fixed_deployment_outcomes, switching_ceiling

    if max_replicas < 1:
        raise ConfigError(f"--max-replicas must be >= 1, got {max_replicas}")
    if slice_minutes < 0:
        raise ConfigError(f"--slice-minutes must be >= 0, got {slice_minutes}")
    if top < 1:
        raise ConfigError(f"--top must be >= 1, got {top}")
    console = Console(stderr=True)
    start = time.perf_counter()
    scenario, comparison, cluster = _run(trace, model, gpus, ("oserve", "vllm-static", "perfect-forecast"), load,
                                         minutes, 60.0, 0, console, bound=False)
    from oserve.specs import model_preset

    spec = model_preset(model)
    with _progress(console) as bar:
        task = bar.add_task(f"{scenario.name}: fixed deployments", total=None)
        outcomes = fixed_deployment_outcomes(spec, cluster, scenario.window, comparison.prior,
                                             max_replicas=max_replicas,
                                             progress=lambda done, total: bar.update(task, completed=done,
                                                                                     total=total))
        switching = None
        if slice_minutes > 0:
            task = bar.add_task(f"{scenario.name}: fixed deployments slice by slice", total=None)
            switching = switching_ceiling(spec, cluster, scenario.window, comparison.prior, slice_minutes * 60.0,
                                          max_replicas=max_replicas,
                                          progress=lambda done, total: bar.update(task, completed=done, total=total))
    refs = {name: r.percentile("e2e", 99) for name, r in comparison.results.items()}
    rows = [{"label": o.label, "replicas": len(o.shapes), "p99_e2e_s": o.p99_e2e_s, "dropped": o.dropped}
            for o in outcomes]
    best = outcomes[0]

    def over_best(p99: float) -> float:
        return p99 / best.p99_e2e_s if 0 < best.p99_e2e_s < math.inf else math.nan

    result = {"scenario": scenario.name, "model": model, "gpus": gpus, "load": load, "minutes": minutes,
              "requests": len(scenario.window), "max_replicas": max_replicas, "deployments": len(rows),
              "best": rows[0], "p99": refs, "static_shape": comparison.static_shape,
              "oserve_over_best": over_best(refs["oserve"]), "static_over_best": over_best(refs["vllm-static"]),
              "seconds": time.perf_counter() - start, "outcomes": rows}
    if switching is not None:
        result["switching"] = {
            "slice_minutes": slice_minutes, "per_slice": list(switching.labels), "p99_e2e_s": switching.p99_e2e_s,
            "constant": switching.constant_label, "constant_p99_e2e_s": switching.constant_p99_e2e_s,
            "gain": switching.gain,
            "static_over_switching": refs["vllm-static"] / switching.p99_e2e_s
            if 0 < switching.p99_e2e_s < math.inf else math.nan,
            "slice_p99_e2e_s": dict(zip(switching.deployment_labels, map(list, switching.slice_p99_e2e_s)))}
    if out is not None:
        def plots(report) -> None:
            report.fixed_deployments(rows, refs, out / "fixed_deployments.png",
                                     f"{scenario.name} on {gpus} GPUs: every fixed deployment's P99")
            if switching is not None:
                report.switching_schedule(
                    dict(zip(switching.deployment_labels, map(list, switching.slice_p99_e2e_s))),
                    list(switching.labels), out / "switching.png",
                    f"{scenario.name} on {gpus} GPUs, {slice_minutes:g}-minute slices: switching wins at most "
                    f"{_fmt(switching.gain)}x")
        _save_report(out, "ceiling", result, plots)
    if json_out:
        typer.echo(json.dumps(_json_safe(result), indent=2))
        return
    t = Table(title=f"{scenario.name}, {len(scenario.window)} requests on {gpus} GPUs: the best of "
                    f"{len(rows)} fixed deployments")
    for c in ("deployment", "P99 (s)", "dropped", "P99 / best"):
        t.add_column(c, justify="left" if c == "deployment" else "right")
    for r in rows[:top]:
        t.add_row(r["label"], _fmt(r["p99_e2e_s"]), str(r["dropped"]), _fmt(over_best(r["p99_e2e_s"])))
    for name, p99 in refs.items():
        t.add_row(f"[bold]{name}[/bold]", _fmt(p99), str(int(comparison.results[name].dropped.sum())),
                  _fmt(over_best(p99)))
    out_console().print(compact(t))
    if switching is not None:
        sw = result["switching"]
        out_console().print(f"switching ceiling ({slice_minutes:g}-minute slices, each from idle replicas, changes "
                            f"free): {' -> '.join(switching.labels)}, P99 {_fmt(switching.p99_e2e_s)} s; the best "
                            f"single deployment run the same way ({switching.constant_label}) "
                            f"{_fmt(switching.constant_p99_e2e_s)} s: switching at the slice boundaries wins at most "
                            f"{_fmt(switching.gain)}x; vllm-static over it {_fmt(sw['static_over_switching'])}x")
    out_console().print(f"vllm-static chose {comparison.static_shape}; {time.perf_counter() - start:.1f} s"
                        + (f"; report in {out}" if out else ""))


@bench_app.command("tune")
def bench_tune(
    model: str = typer.Option("llama2-70b", help="Model preset."),
    gpus: int = typer.Option(16, help="GPUs in the cluster."),
    load: float = typer.Option(0.8, help=LOAD_HELP),
    minutes: float = typer.Option(None, help="Length of each tuning window (default: as in bench e2e)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Tune the planner's thresholds on the tuning scenarios (never the test ones `bench e2e` reports)."""
    from oserve.evaluation.tuning import GRID, TUNING_SET, tune
    from oserve.specs import cluster_for_gpus, model_preset

    console = Console(stderr=True)
    start = time.perf_counter()
    with _progress(console) as bar:
        task = bar.add_task("tuning", total=None)
        result = tune(model_preset(model), cluster_for_gpus(gpus), TUNING_SET, load, minutes,
                      progress=lambda what: bar.update(task, description=f"tuning: {what}"))
    summary = {"model": model, "gpus": gpus, "load": load, "scenarios": list(TUNING_SET),
               "grid": {k: list(v) for k, v in GRID.items()}, "best": result.best, "objective": result.objective,
               "trials": result.trials, "seconds": time.perf_counter() - start}
    if json_out:
        typer.echo(json.dumps(_json_safe(summary), indent=2))
        return
    t = Table(title=f"Thresholds tried on {', '.join(TUNING_SET)} (geometric mean P99 speedup over vllm-static)")
    for c in (*GRID, "objective"):
        t.add_column(c, justify="right")
    for trial in sorted(result.trials, key=lambda x: -x["objective"]):
        t.add_row(*(f"{trial['thresholds'][k]:g}" for k in GRID), f"{trial['objective']:.3f}")
    out_console().print(compact(t))
    out_console().print(f"best: {result.best} ({result.objective:.3f}); {summary['seconds'] / 60:.1f} min")


@bench_app.command("peeking")
def bench_peeking(
    model: str = typer.Option("llama2-70b", help="Model preset."),
    gpus: int = typer.Option(16, help="GPUs in the cluster."),
    load: float = typer.Option(0.8, help=LOAD_HELP),
    scenarios: str = typer.Option("S4,T4,azure-conv,servegen-m-large", help="Comma-separated scenario names."),
    minutes: float = typer.Option(None, help="Length of each window (default: as in bench e2e)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    out: Path = typer.Option(None, help="Write peeking.json and peeking.png here."),
) -> None:
    """What each kind of peeking the old evaluation allowed was worth: OServe's P99 speedup over vllm-static
    from the old evaluation to the honest one, removing one kind at a time (`oserve.evaluation.peeking`)."""
    from oserve.evaluation.peeking import STEPS, ablation
    from oserve.specs import cluster_for_gpus, model_preset

    spec, cluster = model_preset(model), cluster_for_gpus(gpus)
    console = Console(stderr=True)
    start = time.perf_counter()
    rows, skipped = [], []
    with _progress(console) as bar:
        task = bar.add_task("peeking", total=None)
        for name, scenario in _built_scenarios(scenarios, spec, cluster, load, minutes, skipped):
            steps = ablation(spec, cluster, scenario,
                             progress=lambda what, n=name: bar.update(task, description=f"{n}: {what}"))
            rows.append({"scenario": scenario.name, "steps": [
                {"step": r.step, "oserve_p99_s": r.oserve_p99_s, "static_p99_s": r.static_p99_s,
                 "speedup": r.speedup, "static_shape": r.static_shape} for r in steps]})
    result = {"model": model, "gpus": gpus, "load": load, "steps": list(STEPS), "scenarios": rows,
              "skipped": skipped, "seconds": time.perf_counter() - start}
    if out is not None:
        _save_report(out, "peeking", result,
                     lambda report: report.peeking(rows, list(STEPS), out / "peeking.png",
                                                   f"{model} on {gpus} GPUs: OServe's P99 speedup over "
                                                   f"vllm-static as each kind of peeking is removed"))
    if json_out:
        typer.echo(json.dumps(_json_safe(result), indent=2))
        return
    t = Table(title="OServe's P99 speedup over vllm-static, removing one kind of peeking at a time (top: the old "
                    "evaluation; bottom: the honest one)")
    t.add_column("step")
    for r in rows:
        t.add_column(r["scenario"], justify="right")
    for i, step in enumerate(STEPS):
        t.add_row(step, *(f"{_fmt(r['steps'][i]['speedup'])} ({_fmt(r['steps'][i]['oserve_p99_s'])}/"
                          f"{_fmt(r['steps'][i]['static_p99_s'])})" for r in rows))
    out_console().print(compact(t))
    out_console().print("cells: speedup (OServe P99 / vllm-static P99, seconds)")


@bench_app.command("uncertainty")
def bench_uncertainty(
    model: str = typer.Option("llama2-70b", help="Model preset."),
    gpus: int = typer.Option(16, help="GPUs in the cluster."),
    load: float = typer.Option(0.8, help=LOAD_HELP),
    scenarios: str = typer.Option("S4,T4,azure-conv,servegen-m-large", help="Comma-separated scenario names."),
    accuracies: str = typer.Option("1,0.95,0.9,0.8", help="Comma-separated type accuracies in [0, 1]."),
    minutes: float = typer.Option(None, help="Length of each window (default: as in bench e2e)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    out: Path = typer.Option(None, help="Write uncertainty.json and uncertainty.png here."),
) -> None:
    """OServe's P99 speedup over vllm-static when requests are classed right at arrival with a set
    accuracy, and with the estimator OServe really has (`oserve.evaluation.uncertainty`)."""
    from oserve.errors import ConfigError
    from oserve.evaluation.uncertainty import curve
    from oserve.specs import cluster_for_gpus, model_preset

    try:
        levels = tuple(float(a) for a in accuracies.split(",") if a.strip())
    except ValueError:
        raise ConfigError(f"--accuracies must be numbers separated by commas, got {accuracies!r}") from None
    if not levels or any(not 0.0 <= a <= 1.0 for a in levels):
        raise ConfigError(f"--accuracies must each be in [0, 1], got {accuracies!r}")
    spec, cluster = model_preset(model), cluster_for_gpus(gpus)
    num_scenarios = len([n for n in scenarios.split(",") if n.strip()])
    console = Console(stderr=True)
    start = time.perf_counter()
    rows, skipped = [], []
    with _progress(console) as bar:
        task = bar.add_task("uncertainty", total=num_scenarios * (len(levels) + 2))
        for name, scenario in _built_scenarios(scenarios, spec, cluster, load, minutes, skipped):

            def step(what: str, n: str = name) -> None:
                bar.update(task, advance=1, description=f"{n}: {what}")

            c = curve(spec, cluster, scenario, levels, progress=step)
            rows.append({"scenario": c.scenario, "static_p99_s": c.static_p99_s, "static_shape": c.static_shape,
                         "points": [{"label": p.label, "accuracy": p.accuracy, "oserve_p99_s": p.oserve_p99_s,
                                     "speedup": p.speedup} for p in c.points]})
        bar.update(task, completed=num_scenarios * (len(levels) + 2))  # skipped scenarios count as done
    result = {"model": model, "gpus": gpus, "load": load, "accuracies": list(levels), "scenarios": rows,
              "skipped": skipped, "seconds": time.perf_counter() - start}
    if out is not None:
        _save_report(out, "uncertainty", result,
                     lambda report: report.uncertainty(rows, out / "uncertainty.png",
                                                       f"{model} on {gpus} GPUs: OServe's speedup against the "
                                                       f"accuracy of its classes"))
    if json_out:
        typer.echo(json.dumps(_json_safe(result), indent=2))
        return
    t = Table(title="OServe's P99 speedup over vllm-static by the accuracy of its classes at arrival")
    t.add_column("classes")
    for r in rows:
        t.add_column(r["scenario"], justify="right")
    for i, p in enumerate(rows[0]["points"] if rows else []):
        t.add_row(p["label"], *(f"{_fmt(r['points'][i]['speedup'])} ({r['points'][i]['accuracy']:.0%} right)"
                                for r in rows))
    out_console().print(compact(t))
    for s in skipped:
        out_console().print(f"{s['name']}: skipped ({s['reason']})")


def _levers_worker(args: tuple) -> dict:
    """One scenario of `oserve bench levers`, in its own process: its row."""
    from oserve.evaluation.compare import EvalConfig
    from oserve.evaluation.scenarios import build_scenario
    from oserve.evaluation.uncertainty import levers
    from oserve.specs import cluster_for_gpus, model_preset

    name, gpus, model, load, minutes, trial = args
    spec, cluster = model_preset(model), cluster_for_gpus(gpus)
    c = levers(spec, cluster, build_scenario(name, spec, cluster, load=load, minutes=minutes),
               EvalConfig(history_trial=trial))
    return {"scenario": c.scenario, "gpus": gpus, "static_p99_s": c.static_p99_s, "static_shape": c.static_shape,
            "points": [{"label": p.label, "accuracy": p.accuracy, "oserve_p99_s": p.oserve_p99_s,
                        "speedup": p.speedup, "migrations": p.migrations} for p in c.points]}


@bench_app.command("levers")
def bench_levers(
    model: str = typer.Option("llama2-70b", help="Model preset."),
    gpus: int = typer.Option(16, help="GPUs in the cluster."),
    load: float = typer.Option(0.8, help=LOAD_HELP),
    scenario_set: str = typer.Option("test", "--set", help="test, tuning (what the levers' defaults are chosen "
                                                         "on), or all."),
    scenarios: str = typer.Option(None, help="Comma-separated scenario names instead of a set."),
    minutes: float = typer.Option(None, help="Length of each window (default: as in bench e2e)."),
    jobs: int = typer.Option(0, help="Scenarios simulated at once, each in its own process (0: one per CPU)."),
    trial: bool = typer.Option(True, help=TRIAL_HELP + " Each variant runs its own trial."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    out: Path = typer.Option(None, help="Write levers.json and levers.png here."),
) -> None:
    """OServe with the estimator it really has, under each combination of the two levers beyond the
    estimate: how the plan sees a class (what the estimated class holds, or its type) and whether requests
    that outgrow their class move (`oserve.evaluation.uncertainty.levers`); P99 speedup over vllm-static."""
    import os

    from oserve.evaluation.uncertainty import LEVERS

    names, skipped = _present(_scenario_names(scenario_set, scenarios, jobs))
    console = Console(stderr=True)
    workers = min(jobs or (os.cpu_count() or 1), len(names)) or 1
    start = time.perf_counter()
    args = [(name, gpus, model, load, minutes, trial) for name in names]
    found: dict[int, dict] = {}
    with _progress(console) as bar:
        task = bar.add_task(f"bench levers: {len(names)} scenarios in {workers} processes", total=len(names))

        def done(i: int, row: dict) -> None:
            found[i] = row
            bar.update(task, advance=1, description=f"bench levers: {row['scenario']} done")
        _in_processes(_levers_worker, args, workers, done)
    rows = [found[i] for i in range(len(args))]
    labels = [label for label, _, _ in LEVERS]
    geomean = {label: _mean([r["points"][i]["speedup"] for r in rows])[1] for i, label in enumerate(labels)}
    result = {"model": model, "gpus": gpus, "load": load, "set": "custom" if scenarios else scenario_set,
              "levers": [{"label": label, "class_lengths": c, "moves": m} for label, c, m in LEVERS],
              "scenarios": rows, "geomean_speedup_p99": geomean,
              "min_speedup_p99": {label: min((r["points"][i]["speedup"] for r in rows), default=math.nan)
                                  for i, label in enumerate(labels)},
              "skipped": skipped, "seconds": time.perf_counter() - start, "processes": workers}
    if out is not None:
        _save_report(out, "levers", result,
                     lambda report: report.levers(rows, labels, out / "levers.png",
                                                  f"{model} on {gpus} GPUs: OServe with its estimator, by lever"))
    if json_out:
        typer.echo(json.dumps(_json_safe(result), indent=2))
        return
    t = Table(title="OServe's P99 speedup over vllm-static with its estimator: class lengths the plan assumes, "
                    "and whether outgrown requests move (moves in parentheses)")
    t.add_column("scenario")
    for label in labels:
        t.add_column(label, justify="right")
    for r in rows:
        t.add_row(r["scenario"], *(f"{_fmt(p['speedup'])} ({p['migrations']})" for p in r["points"]))
    t.add_row("geomean", *(_fmt(geomean[label]) for label in labels))
    out_console().print(compact(t))
    for s in skipped:
        out_console().print(f"{s['name']}: skipped ({s['reason']})")


def _robustness_worker(args: tuple) -> dict:
    """One (scenario, injected error) of `oserve bench robustness`, in its own process: its row."""
    from oserve.evaluation.compare import EvalConfig
    from oserve.evaluation.robustness import PERTURBATIONS, run_robustness
    from oserve.evaluation.scenarios import build_scenario
    from oserve.specs import cluster_for_gpus, model_preset

    name, p, model, gpus, load, minutes, trial = args
    spec, cluster = model_preset(model), cluster_for_gpus(gpus)
    began = time.perf_counter()
    row = run_robustness(spec, cluster, build_scenario(name, spec, cluster, load=load, minutes=minutes),
                         PERTURBATIONS[p], EvalConfig(bound=False, history_trial=trial))
    return {"scenario": row.scenario, "perturbation": row.perturbation,
            "description": PERTURBATIONS[p].description, "results": row.results,
            "static_noise": row.static_noise, "trial": row.trial, "error_by_time": row.error_by_time,
            "learned_error": row.learned_error, "model_error": row.model_error,
            "pairs": row.pairs, "guard_events": row.guard_events,
            "peak_slowness": None if math.isnan(row.peak_slowness) else row.peak_slowness,
            "table": row.table, "seconds": time.perf_counter() - began}


@bench_app.command("robustness")
def bench_robustness(
    model: str = typer.Option("llama2-70b", help="Model preset."),
    gpus: int = typer.Option(16, help="GPUs in the cluster."),
    load: float = typer.Option(0.8, help=LOAD_HELP),
    scenarios: str = typer.Option("T2,S5,servegen-m-large", help="Comma-separated scenario names."),
    perturbations: str = typer.Option("all", help="Comma-separated injected errors "
                                                  "(`oserve.evaluation.robustness.PERTURBATIONS`), or all."),
    minutes: float = typer.Option(30.0, help="Length of each window."),
    jobs: int = typer.Option(1, help="(scenario, error) pairs simulated at once, each in its own process "
                                     "(0: one per CPU)."),
    trial: bool = typer.Option(True, help=TRIAL_HELP),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    out: Path = typer.Option(None, help="Write robustness.json, robustness.png and learned_capacity.png here."),
) -> None:
    """OServe when the engines are not what its capacity model says: for each injected error, static, OServe
    learning its capacity, OServe trusting the model's table and OServe told the true table, on the same
    window; OServe's P99 speedup over static with its spread over the window's minutes; and how far the
    learned table is from the true one (`oserve.evaluation.robustness`)."""
    import os

    from oserve.errors import UnknownNameError
    from oserve.evaluation.robustness import PERTURBATIONS
    from oserve.specs import cluster_for_gpus, model_preset

    model_preset(model), cluster_for_gpus(gpus)  # a bad name or size is told here, not from inside a worker
    names = list(PERTURBATIONS) if perturbations.strip() == "all" else \
        [p.strip() for p in perturbations.split(",") if p.strip()]
    for p in names:
        if p not in PERTURBATIONS:
            raise UnknownNameError("perturbation", p, tuple(PERTURBATIONS))
    scenario_names, skipped = _present(_scenario_names("test", scenarios, jobs))
    args = [(name, p, model, gpus, load, minutes, trial) for name in scenario_names for p in names]
    workers = min(jobs or (os.cpu_count() or 1), len(args)) or 1
    console = Console(stderr=True)
    start = time.perf_counter()
    found: dict[int, dict] = {}
    with _progress(console) as bar:
        task = bar.add_task(f"bench robustness: {len(args)} runs in {workers} processes", total=len(args))

        def done(i: int, row: dict) -> None:
            found[i] = row
            bar.update(task, advance=1, description=f"robustness: {row['scenario']} / {row['perturbation']} done")
            n, res = row["static_noise"], row["results"]
            console.print(f"{row['scenario']} / {row['perturbation']}: P99 static "
                          f"{_fmt(res['vllm-static']['p99_e2e_s'])} s, OServe {_fmt(res['oserve']['p99_e2e_s'])} s, "
                          f"speedup {_fmt(n['ratio'])} ({_fmt(n['low'])}-{_fmt(n['high'])})"
                          f"{', deferred to the measured best' if (row['trial'] or {}).get('deferred') else ''} "
                          f"({row['seconds']:.0f} s)")
        _in_processes(_robustness_worker, args, workers, done)
    rows = [found[i] for i in range(len(args))]
    never_worse = all(r["results"]["oserve"]["finished"] >= r["results"]["vllm-static"]["finished"] for r in rows)
    result = {"model": model, "gpus": gpus, "load": load, "minutes": minutes, "rows": rows, "skipped": skipped,
              "oserve_finishes_at_least_static": never_worse,
              # the (scenario, error) runs where the whole interval of OServe's speedup over static is below 1
              "worse_than_static_beyond_noise": [f"{r['scenario']}/{r['perturbation']}" for r in rows
                                                 if r["static_noise"]["worse_beyond_noise"]],
              "seconds": time.perf_counter() - start, "processes": workers}
    if out is not None:
        def plots(report) -> None:
            report.robustness(rows, out / "robustness.png", f"{model} on {gpus} GPUs, engines unlike the model")
            report.learned_tables(rows, out / "learned_capacity.png", "OServe's learned capacity against the truth")
        _save_report(out, "robustness", result, plots)
    if json_out:
        typer.echo(json.dumps(_json_safe(result), indent=2))
        return
    t = Table(title="P99 (s) and finished when the engines are not what the model says")
    t.caption = ("learn: OServe learning its capacity; trust: OServe trusting the model's table; true: told the "
                 "true table; err: learned (model) table's mean error on the pairs it has evidence on")
    for col in ("scenario", "error", "static", "learn", "trust", "true", "speedup (90%)", "err"):
        t.add_column(col, justify="left" if col in ("scenario", "error") else "right")
    for r in rows:
        res = r["results"]

        def cell(n: str) -> str:
            v = res[n]
            mark = "" if v["finished"] == v["admitted"] else f" ({v['admitted'] - v['finished']} lost)"
            return f"{_fmt(v['p99_e2e_s'])}{mark}"
        err = "-" if not r["pairs"] else f"{r['learned_error']:.2f} ({r['model_error']:.2f})"
        n = r["static_noise"]
        speedup = f"{_fmt(n['ratio'])} ({_fmt(n['low'])}-{_fmt(n['high'])}){' worse' if n['worse_beyond_noise'] else ''}"
        t.add_row(r["scenario"], r["perturbation"], cell("vllm-static"), cell("oserve"), cell("oserve-trusting"),
                  cell("oserve-true-table"), speedup, err)
    out_console().print(compact(t))
    for s in skipped:
        out_console().print(f"{s['name']}: skipped ({s['reason']})")
