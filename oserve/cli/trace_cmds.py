"""`oserve trace ...` subcommands."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import typer

from oserve.cli import trace_app


@trace_app.command("stats")
def stats(
    path: str = typer.Argument(..., help="Trace file (.csv Azure format, .jsonl) or a bundled name: "
                                         "azure-conv, azure-code."),
    span: float = typer.Option(60.0, "--span", help="Span length in seconds for the type mix over time."),
    k: int = typer.Option(4, "--k", help="Number of workload types (k-means on log lengths)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the k-means initialisation."),
    out: Path = typer.Option(Path("report"), "--out", help="Folder for trace_stats.png."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """Summarise a trace: lengths, workload types and how their mix changes per span; plot the mix."""
    from oserve.errors import ConfigError
    from oserve.workload_types import fit_types
    from oserve.traces import load_trace

    if not (span > 0 and math.isfinite(span)):
        raise ConfigError(f"--span must be a positive number of seconds; got {span}")
    if k < 1:
        raise ConfigError(f"--k must be >= 1; got {k}")
    trace = load_trace(path)
    types = fit_types(trace.input_tokens, trace.output_tokens, k=k, seed=seed)
    summary = trace_summary(trace, types, span)
    plot_path = out / "trace_stats.png"
    _plot(summary, plot_path)
    summary["plot"] = str(plot_path)
    if as_json:
        typer.echo(json.dumps(_json_safe(summary), indent=2))
    else:
        _print_tables(summary)


def trace_summary(trace: Any, types: Any, span_s: float) -> dict[str, Any]:
    """The figures `trace stats` shows, as plain data (counts per span included for the plot). Pure."""
    import numpy as np

    from oserve.workload_types import mix_cv, mix_cv_noise, span_counts

    counts = span_counts(trace, types, span_s)
    cv = mix_cv(counts)
    noise = mix_cv_noise(counts)

    def pcts(x: np.ndarray) -> dict[str, float]:
        p50, p90, p99 = np.percentile(x, [50, 90, 99])  # linear interpolation
        return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(x.mean()),
                "min": int(x.min()), "max": int(x.max())}

    return {
        "trace": trace.name,
        "requests": len(trace),
        "duration_s": trace.duration_s,
        "input_tokens": pcts(trace.input_tokens),
        "output_tokens": pcts(trace.output_tokens),
        "span_s": span_s,
        "num_spans": int(counts.shape[0]),
        "requests_in_spans": int(counts.sum()),
        "k": types.k,
        "types": [
            {"name": name, "share": s.share, "num_requests": s.num_requests,
             "centroid_input_tokens": c_in, "centroid_output_tokens": c_out,
             "mean_input_tokens": s.mean_input_tokens, "mean_output_tokens": s.mean_output_tokens,
             "mix_cv": float(cv[j]), "mix_cv_noise": float(noise[j])}
            for j, (name, s, (c_in, c_out)) in enumerate(zip(types.names, types.stats,
                                                              types.centroids_tokens))
        ],
        "counts": counts.tolist(),  # span -> per-type arrivals
    }


def _json_safe(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary without per-span counts and with NaN as null (JSON has no NaN). Pure."""
    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {key: clean(x) for key, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    return clean({key: v for key, v in summary.items() if key != "counts"})


def _print_tables(summary: dict[str, Any]) -> None:
    """Print the summary as two rich tables (trace, then types)."""
    from rich.console import Console
    from rich.table import Table

    from oserve.cli.tables import compact

    def fmt(v: float, digits: int = 0) -> str:
        return "-" if not math.isfinite(v) else f"{v:,.{digits}f}"

    console = Console()
    head = Table(title=f"trace {summary['trace']}", title_justify="left")
    for col in ("", "value / range", "p50", "p90", "p99", "mean"):
        head.add_column(col, justify="right" if col else "left")
    head.add_row("requests", f"{summary['requests']:,}", "", "", "", "")
    head.add_row("duration", f"{summary['duration_s']:,.1f} s", "", "", "", "")
    for key, label in (("input_tokens", "input tokens"), ("output_tokens", "output tokens")):
        d = summary[key]
        head.add_row(label, f"{d['min']:,}-{d['max']:,}", fmt(d["p50"], 1), fmt(d["p90"], 1),
                     fmt(d["p99"], 1), fmt(d["mean"], 1))
    console.print(compact(head))

    body = Table(title=(f"{summary['k']} workload types; mix over {summary['num_spans']} spans of "
                        f"{summary['span_s']:g} s ({summary['requests_in_spans']:,} requests in full spans)"),
                 title_justify="left")
    for col in ("type", "share", "centroid in", "centroid out", "mean in", "mean out", "mix CV",
                "noise CV"):
        body.add_column(col, justify="left" if col == "type" else "right")
    for t in summary["types"]:
        body.add_row(t["name"], f"{t['share']:.3f}", fmt(t["centroid_input_tokens"]),
                     fmt(t["centroid_output_tokens"]), fmt(t["mean_input_tokens"]),
                     fmt(t["mean_output_tokens"]), fmt(t["mix_cv"], 3), fmt(t["mix_cv_noise"], 3))
    console.print(compact(body))
    console.print("mix CV: std/mean of a type's share across spans with traffic; noise CV: what a "
                  "constant mix would show from sampling alone.", style="dim")
    console.print(f"plot: {summary['plot']}", style="dim")


def _plot(summary: dict[str, Any], path: Path) -> None:
    """Write a PNG of per-type arrivals per span (top) and the type mix per span (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    counts = np.asarray(summary["counts"], dtype=np.float64).reshape(-1, summary["k"])
    span_s = summary["span_s"]
    # step plots over span edges: each span's value is repeated at its right edge
    edges_min = np.arange(len(counts) + 1) * span_s / 60.0
    counts_steps = np.vstack([counts, counts[-1:]]) if len(counts) else np.zeros((1, summary["k"]))
    names = [t["name"] for t in summary["types"]]
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_n, ax_p) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True,
                                     gridspec_kw={"height_ratios": [3, 2]})
    for j, name in enumerate(names):
        ax_n.step(edges_min, counts_steps[:, j], where="post", label=name, linewidth=1.4)
    ax_n.set_ylabel(f"arrivals per {span_s:g} s")
    ax_n.set_title(f"{summary['trace']}: arrivals per workload type "
                   f"({summary['requests']:,} requests, {summary['duration_s'] / 60:.1f} min)")
    ax_n.legend(ncol=min(len(names), 6), fontsize="small", loc="upper right")
    ax_n.grid(alpha=0.3)
    totals = counts_steps.sum(axis=1, keepdims=True)
    share = np.divide(counts_steps, totals, out=np.zeros_like(counts_steps), where=totals > 0)
    ax_p.stackplot(edges_min, *share.T, labels=names, step="post", alpha=0.85)
    ax_p.set_ylim(0, 1)
    ax_p.set_ylabel("share of span")
    ax_p.set_xlabel("minutes from trace start")
    ax_p.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
