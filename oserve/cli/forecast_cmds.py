"""`oserve forecast` and `oserve bench forecast`: train, test and compare the per-type forecasters."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from oserve.cli import app, bench_app
from oserve.cli.tables import compact
from oserve.errors import ConfigError

DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"
SERVEGEN_MODELS = ("m-large", "m-mid")
AZURE_BENCH_SPAN_S = 10.0
DAY_S = 86400.0


@dataclass(frozen=True)
class _Series:
    name: str
    counts: np.ndarray  # (num_spans, k), NaN = not observed
    span_s: float
    type_names: tuple[str, ...]
    season_spans: int | None  # spans per day where the series is long enough to show a daily cycle
    naive_season_spans: int  # season of the seasonal naive baseline
    note: str
    requests: tuple[np.ndarray, np.ndarray] | None = None  # (input, output) tokens, per-request traces


def _is_servegen(path: Path) -> bool:
    try:
        with open(path) as f:
            header = f.readline()
    except OSError:
        return False
    return "rate_rps" in header and "client_id" in header


def _load_series(trace: str, span_s: float, k: int, seed: int) -> _Series:
    """A per-request trace (Azure CSV, JSONL, bundled name) at `span_s`, or a ServeGen trace CSV (600 s)."""
    from oserve.workload_types import fit_types, span_counts
    from oserve.traces import load_trace

    path = Path(trace)
    if path.suffix == ".csv" and path.is_file() and _is_servegen(path):
        from oserve.forecast.servegen_series import servegen_series

        lengths = path.with_name(path.stem + "_lengths.csv")
        s = servegen_series(path, lengths, k=k, seed=seed)
        return _Series(
            name=s.name, counts=s.counts, span_s=s.span_s, type_names=s.types.names,
            season_spans=int(DAY_S // s.span_s), naive_season_spans=int(DAY_S // s.span_s),
            note=(f"ServeGen: per-client 10-min counts split into types by each client's 6-hour length "
                  f"distributions (input and output independent within a client-window); clients without "
                  f"published lengths ({1 - s.covered_share:.1%} of requests) split by the covered clients' "
                  f"mix in the same 6 hours; {s.gap_spans} collection-gap windows (no request from any "
                  f"client) read as not observed"))
    tr = load_trace(trace)
    types = fit_types(tr.input_tokens, tr.output_tokens, k=k, seed=seed)
    counts = span_counts(tr, types, span_s).astype(np.float64)
    per_day = int(DAY_S // span_s)
    long_enough = len(counts) >= 3 * per_day
    naive = per_day if long_enough else max(1, int(round(60.0 / span_s)))
    return _Series(
        name=tr.name, counts=counts, span_s=span_s, type_names=types.names,
        season_spans=per_day if long_enough else None, naive_season_spans=naive,
        note=(f"types: k-means on log lengths of the whole trace (seed {seed}); " +
              ("daily season" if long_enough else
               f"shorter than 3 days: no daily season; seasonal naive repeats the span "
               f"{naive} spans earlier ({naive * span_s:g} s)")),
        requests=(np.asarray(tr.input_tokens), np.asarray(tr.output_tokens)))


def _run(series: _Series, names: list[str], seed: int, lookback_spans: int):
    """Evaluate the named forecasters on one CPU thread; returns (evaluation, forecasters, lookback used)."""
    import torch

    from oserve.forecast.evaluate import evaluate, fit_lookback
    from oserve.forecast.registry import make_forecasters
    from oserve.forecast.metrics import chronological_split

    n_train = chronological_split(len(series.counts), 0.9)
    lookback = fit_lookback(n_train, lookback_spans)
    fcs = make_forecasters(len(series.type_names), names, seed=seed, season_spans=series.season_spans,
                           naive_season_spans=series.naive_season_spans, lookback_spans=lookback)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ev = evaluate(series.counts, fcs, train_fraction=0.9, timer=time.perf_counter)
    finally:
        torch.set_num_threads(threads)
    return ev, fcs, lookback


def _num(v: float) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else round(float(v), 6)


def _plot(path: Path, series: _Series, ev, names: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = len(series.type_names)
    n_train = ev.n_train
    context = min(n_train, max(20, (len(series.counts) - n_train)))
    x0 = n_train - context
    fig, axes = plt.subplots(k, 1, figsize=(11, 2.4 * k), sharex=True, squeeze=False)
    t = (np.arange(x0, len(series.counts)) * series.span_s) / 60.0
    for j, ax in enumerate(axes[:, 0]):
        ax.plot(t, series.counts[x0:, j], color="black", lw=1.2, label="actual")
        tt = t[context:]
        for name in names:
            sc = ev.scores[name]
            rr = sc.report["per_type"][j]
            ax.plot(tt, sc.rolling.predicted[:, j], lw=1.0, label=f"{name} (RRMSE {rr:.3f})")
        ax.axvline(t[context], color="grey", ls="--", lw=0.8)
        ax.set_ylabel(f"{series.type_names[j]}\nrequests/span")
        ax.legend(fontsize=7, loc="upper left", ncol=3)
    axes[-1, 0].set_xlabel(f"minutes from the start of the trace (span {series.span_s:g} s; dashed: test starts)")
    fig.suptitle(f"{series.name}: one-step forecasts vs actual per type (test = last 10%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@app.command("forecast")
def forecast_cmd(
    trace: str = typer.Option(..., help="Trace: a file (Azure CSV, JSON Lines, or a ServeGen trace CSV "
                                        "with its _lengths.csv beside it) or a bundled name (azure-conv)."),
    span: float = typer.Option(60.0, help="Span in seconds (ServeGen traces are fixed at 600)."),
    model: str = typer.Option("all", help="Forecasters, comma-separated: lstm, last_value (lv), "
                                          "moving_average (ma), seasonal_naive (sn), holt_winters (hw), or all."),
    out: Path = typer.Option(Path("forecast-out"), help="Folder for the PNG (and the model with --save-model)."),
    k: int = typer.Option(4, help="Number of workload types."),
    seed: int = typer.Option(0, help="Seed for the type fit and the LSTM."),
    lookback: int = typer.Option(50, help="LSTM lookback in spans (halved to fit a short trace)."),
    save_model: Path = typer.Option(None, help="Write the LSTM, after the test, to this JSON file."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Train on the first 90% of the spans, forecast the last 10% one step at a time, report RRMSE per
    type and forecaster, and plot forecast vs actual per type."""
    from oserve.forecast.registry import ALIASES, FORECASTER_NAMES

    if not (span > 0 and math.isfinite(span)):
        raise ConfigError(f"--span must be a positive number of seconds; got {span!r}")
    names = list(FORECASTER_NAMES) if model == "all" else [ALIASES.get(m.strip(), m.strip())
                                                          for m in model.split(",") if m.strip()]
    if save_model is not None and "lstm" not in names:
        names.append("lstm")
    series = _load_series(trace, span, k, seed)
    if len(series.counts) < 4:
        raise ConfigError(f"{trace}: {len(series.counts)} spans of {series.span_s:g} s; need at least 4 "
                          f"(try a shorter --span)")
    ev, fcs, used_lookback = _run(series, names, seed, lookback)
    out.mkdir(parents=True, exist_ok=True)
    png = out / f"forecast_{Path(series.name).name}_{series.span_s:g}s.png"
    _plot(png, series, ev, names)
    if save_model is not None:
        lstm = fcs["lstm"]
        lstm.meta = {"trace": series.name, "span_s": series.span_s, "types": list(series.type_names),
                     "trained_on_spans": ev.n_train, "history_spans": len(series.counts),
                     "note": "trained on the first 90% of the spans; history runs to the end of the trace"}
        save_model.parent.mkdir(parents=True, exist_ok=True)
        lstm.save(save_model)
    result = {
        "trace": series.name, "span_s": series.span_s, "spans": len(series.counts), "train_spans": ev.n_train,
        "types": list(series.type_names), "lookback_spans": used_lookback, "note": series.note,
        "rrmse": {n: _num(ev.scores[n].report["overall"]) for n in names},
        "rrmse_per_type": {n: dict(zip(series.type_names, map(_num, ev.scores[n].report["per_type"])))
                           for n in names},
        "noise_floor": _num(ev.noise_floor["overall"]),
        "latency_ms": {n: _num(ev.scores[n].latency_ms_mean) for n in names},
        "png": str(png),
    }
    if json_out:
        typer.echo(json.dumps(result, indent=2))
        return
    console = Console()
    table = Table(title=f"{series.name}: RRMSE on the last 10% ({len(series.counts) - ev.n_train} spans of "
                        f"{series.span_s:g} s), one-step rolling")
    table.add_column("forecaster")
    for tname in series.type_names:
        table.add_column(tname, justify="right")
    table.add_column("overall", justify="right")
    table.add_column("ms/forecast", justify="right")
    for n in names:
        rep = ev.scores[n].report
        table.add_row(n, *[f"{v:.3f}" for v in rep["per_type"]], f"{rep['overall']:.3f}",
                      f"{ev.scores[n].latency_ms_mean:.2f}")
    nf = ev.noise_floor
    table.add_row("noise floor (Poisson)", *[f"{v:.3f}" for v in nf["per_type"]], f"{nf['overall']:.3f}", "",
                  style="dim")
    console.print(compact(table))
    if used_lookback != lookback:
        console.print(f"note: LSTM lookback shortened to {used_lookback} spans to fit {ev.n_train} training spans")
    console.print(f"overall = RRMSE of the total over types. {series.note}")
    console.print(f"wrote {png}" + (f" and {save_model}" if save_model else ""))


def _misclassification(series: _Series, seed: int) -> dict[str, object] | None:
    """Arrival-time misclassification on a per-request trace: types from its first 20% of requests,
    then every request classified at arrival and learned at completion (20 requests later)."""
    if series.requests is None:
        return None
    from oserve.online_types import OnlineTypes, replay_misclassification
    from oserve.workload_types import fit_types

    inp, outp = series.requests
    head = max(len(inp) // 5, 8)
    types = fit_types(inp[:head], outp[:head], k=len(series.type_names), seed=seed)
    res = {}
    for label, learn in (("regressor", True), ("prior", False)):
        rep = replay_misclassification(OnlineTypes(types, learn_regressor=learn, seed=seed), inp, outp,
                                       completion_lag_requests=20)
        res[label] = round(rep.rate, 4)
        if learn:
            res["per_type_regressor"] = {n: _num(v) for n, v in zip(types.names, rep.per_type_rate)}
    res["requests"] = int(len(inp))
    res["note"] = ("types fitted on the first 20% of requests, then River k-means adapts; output estimated at "
                   "arrival from the input length by River's Hoeffding tree ('prior': a constant estimate); "
                   "each request is learned 20 arrivals later")
    return res


@bench_app.command("forecast")
def bench_forecast(
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    data_dir: Path = typer.Option(DEFAULT_DATA_DIR, help="Folder holding servegen_m-large.csv, "
                                                         "servegen_m-mid.csv and their _lengths.csv."),
    azure_span: float = typer.Option(AZURE_BENCH_SPAN_S, help="Span in seconds for the Azure traces."),
    seed: int = typer.Option(0, help="Seed for the type fits and the LSTM."),
) -> None:
    """RRMSE of every forecaster on the ServeGen traces (10-min spans) and the bundled Azure traces
    (short spans), with the Poisson noise floor and forecast latency; chronological 90/10 split."""
    from oserve.forecast.registry import FORECASTER_NAMES

    start = time.perf_counter()
    names = list(FORECASTER_NAMES)
    traces, skipped = [], []
    sources: list[tuple[str, float]] = []
    for m in SERVEGEN_MODELS:
        p = data_dir / f"servegen_{m}.csv"
        if p.is_file() and p.with_name(p.stem + "_lengths.csv").is_file():
            sources.append((str(p), 600.0))
        else:
            skipped.append({"name": f"servegen_{m}", "reason": f"{p} or its _lengths.csv not found "
                                                               f"(pass --data-dir)"})
    sources += [("azure-conv", azure_span), ("azure-code", azure_span)]
    for src, span in sources:
        series = _load_series(src, span, 4, seed)
        ev, _, lookback = _run(series, names, seed, 50)
        sc = ev.scores
        rr = {n: _num(sc[n].report["overall"]) for n in names}
        floor = ev.noise_floor["overall"]
        baselines = [n for n in names if n != "lstm"]
        best = min(baselines, key=lambda n: sc[n].report["overall"])
        lstm = sc["lstm"].report["overall"]
        servegen = series.requests is None
        targets = {"lstm_beats_every_baseline": bool(all(lstm < sc[n].report["overall"] for n in baselines)),
                   "lstm_over_best_baseline": _num(lstm / sc[best].report["overall"]), "best_baseline": best}
        if servegen:
            ratio = lstm / sc["last_value"].report["overall"]
            targets.update({"lstm_over_last_value": _num(ratio), "lstm_over_last_value_target": 0.6,
                            "met": bool(targets["lstm_beats_every_baseline"] and ratio <= 0.6)})
        else:
            ratio = lstm / floor
            targets.update({"lstm_over_noise_floor": _num(ratio), "lstm_over_noise_floor_target": 1.25,
                            "met": bool(targets["lstm_beats_every_baseline"] and ratio <= 1.25)})
        entry = {
            "name": Path(series.name).name if servegen else series.name,
            "span_s": series.span_s, "spans": len(series.counts), "train_spans": ev.n_train,
            "test_spans": len(series.counts) - ev.n_train,
            "unobserved_test_spans": int(np.isnan(series.counts[ev.n_train:]).any(axis=1).sum()),
            "types": list(series.type_names), "lookback_spans": lookback,
            "rrmse": rr,
            "rrmse_pooled": {n: _num(sc[n].report["pooled"]) for n in names},
            "rrmse_per_type": {n: dict(zip(series.type_names, map(_num, sc[n].report["per_type"])))
                               for n in names},
            "noise_floor": _num(floor),
            "noise_floor_pooled": _num(ev.noise_floor["pooled"]),
            "noise_floor_per_type": dict(zip(series.type_names, map(_num, ev.noise_floor["per_type"]))),
            "latency_ms": {n: _num(sc[n].latency_ms_mean) for n in names},
            "latency_ms_p99": {n: _num(sc[n].latency_ms_p99) for n in names},
            "train_s": {n: _num(sc[n].train_s) for n in names},
            "targets": targets,
            "note": series.note,
        }
        mis = _misclassification(series, seed)
        if mis is not None:
            entry["arrival_misclassification"] = mis
        traces.append(entry)
    result = {
        "traces": traces, "skipped": skipped,
        "definitions": {
            "rrmse": "overall: RMSE of the total over types / mean of the actual total, over the test spans; "
                     "rrmse_pooled: over every (span, type) entry; spans not observed are left out",
            "split": "chronological: first 90% of spans to fit, last 10% forecast one step ahead with the "
                     "true history (each forecaster learns each test span after forecasting it)",
            "noise_floor": "1/sqrt(mean count): the RRMSE of a forecaster knowing the true rate, from Poisson "
                           "sampling alone",
            "latency_ms": "mean wall time of one forecast() call, one CPU thread",
        },
        "seconds": round(time.perf_counter() - start, 1),
    }
    if json_out:
        typer.echo(json.dumps(result, indent=2))
        return
    console = Console()
    table = Table(title="Forecasters: overall RRMSE on the last 10% (one-step rolling)")
    table.add_column("trace")
    table.add_column("span", justify="right")
    for n in names:
        table.add_column(n, justify="right")
    table.add_column("noise floor", justify="right")
    table.add_column("LSTM ms", justify="right")
    for t in traces:
        table.add_row(t["name"], f"{t['span_s']:g} s", *[f"{t['rrmse'][n]:.3f}" for n in names],
                      f"{t['noise_floor']:.4f}", f"{t['latency_ms']['lstm']:.2f}")
    console.print(compact(table))
    for s in skipped:
        console.print(f"skipped {s['name']}: {s['reason']}")
