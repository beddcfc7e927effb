"""Report plots (matplotlib, Agg backend): latency CDFs, the deployment over time, per-type rates.

Each function takes plain data (simulation results or their summaries) and writes one PNG.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    """Lay the figure out, write it to `path` as a PNG and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def latency_cdf(results: dict, path: Path, title: str = "") -> Path:
    """CDF of end-to-end latency and TTFT per policy (`results`: name -> SimResult), over the admitted
    requests (a curve that stops below 1 did not finish them all)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        admitted = int(r.admitted.sum())
        for ax, values in ((axes[0], r.e2e_s[r.finished]), (axes[1], r.ttft_s[r.finished])):
            v = np.sort(values)
            if len(v):
                ax.plot(v, np.arange(1, len(v) + 1) / max(admitted, 1), label=name)
    for ax, what in ((axes[0], "end-to-end latency (s)"), (axes[1], "time to first token (s)")):
        ax.set_xscale("log")
        ax.set_xlabel(what)
        ax.set_ylabel("fraction of requests")
        ax.axhline(0.99, color="grey", lw=0.5, ls="--")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title or "Latency CDF per policy")
    return _save(plt, fig, Path(path))


def deployment_timeline(spans: list[dict], num_gpus: int, path: Path, title: str = "") -> Path:
    """GPUs x time, each GPU coloured by the shape of the replica that holds it in each span."""
    plt = _plt()
    shapes = sorted({rep[1] for s in spans for rep in s["deployment"]})
    cmap = plt.get_cmap("tab20", max(len(shapes), 1))
    colour = {shape: cmap(i) for i, shape in enumerate(shapes)}
    fig, ax = plt.subplots(figsize=(11, 4))
    starts = [s["start_s"] / 60 for s in spans]
    ends = starts[1:] + [starts[-1] + (starts[1] - starts[0] if len(starts) > 1 else 1)]
    for s, t0, t1 in zip(spans, starts, ends):
        for _, shape, gpus in s["deployment"]:
            for g in gpus:
                ax.fill_between([t0, t1], g, g + 0.9, color=colour[shape], lw=0)
        if s.get("switched") and s["span_index"] > 0:
            ax.axvline(t0, color="black", lw=0.6, alpha=0.5)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[shape]) for shape in shapes]
    ax.legend(handles, shapes, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_xlabel("time (min); vertical lines: switches")
    ax.set_ylabel("GPU")
    ax.set_ylim(0, num_gpus)
    ax.set_title(title or "Deployment over time")
    return _save(plt, fig, Path(path))


def rates_and_forecast(spans: list[dict], counts: np.ndarray, type_names: tuple[str, ...], span_s: float, path: Path,
                       title: str = "") -> Path:
    """Per-class arrival rate of each span (`counts`: spans x classes, as the gateway classed them), with
    the rate the policy planned for (its forecast)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 4))
    t = np.array([s["start_s"] / 60 for s in spans])
    counts = np.asarray(counts, dtype=float)[:len(spans)] / span_s
    forecast = np.array([s["forecast_rps"] if s["forecast_rps"] else [np.nan] * len(type_names) for s in spans])
    for j, name in enumerate(type_names):
        line, = ax.step(t, counts[:, j], where="post", label=f"{name} actual")
        ax.step(t, forecast[:, j], where="post", ls="--", color=line.get_color(), alpha=0.8, label=f"{name} planned")
    ax.set_xlabel("time (min)")
    ax.set_ylabel("requests/s")
    ax.grid(alpha=0.3)
    ax.legend(ncol=2, fontsize=8)
    ax.set_title(title or "Per-type rates and forecast")
    return _save(plt, fig, Path(path))


def speedups(rows: list[dict], path: Path, title: str = "") -> Path:
    """OServe's P99 speedup over each baseline per scenario (bars), and against the mix's CV (scatter).

    `rows`: `oserve bench e2e` scenario rows (name, cv, speedup_p99: baseline -> ratio).
    """
    plt = _plt()
    baselines = list(dict.fromkeys(b for r in rows for b in r["speedup_p99"]))
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5), gridspec_kw={"width_ratios": [2.2, 1]})
    x = np.arange(len(rows))
    width = 0.8 / max(len(baselines), 1)
    for i, b in enumerate(baselines):
        vals = [r["speedup_p99"].get(b, np.nan) for r in rows]
        axes[0].bar(x + (i - (len(baselines) - 1) / 2) * width, vals, width, label=b)
        axes[1].scatter([r["cv"] for r in rows], vals, label=b, s=22)
    axes[0].axhline(1.0, color="black", lw=0.8)
    axes[0].set_xticks(x, [r["name"] for r in rows], rotation=45, ha="right")
    axes[0].set_ylabel("P99 of baseline / P99 of OServe")
    axes[0].legend(fontsize=8)
    axes[0].grid(axis="y", alpha=0.3)
    axes[1].axhline(1.0, color="black", lw=0.8)
    axes[1].set_xlabel("coefficient of variation of the type mix")
    axes[1].set_ylabel("speedup")
    axes[1].grid(alpha=0.3)
    fig.suptitle(title or "OServe's P99 end-to-end speedup (>1: OServe better)")
    return _save(plt, fig, path)


def peeking(rows: list[dict], steps: list[str], path: Path, title: str = "") -> Path:
    """OServe's speedup over vllm-static per scenario (groups) at each step from the old evaluation to the
    honest one (bars). `rows`: `oserve bench peeking` scenario rows."""
    return _grouped_speedups(rows, "steps", [f"{i + 1}. {step}" for i, step in enumerate(steps)], path,
                             title or "What each kind of peeking was worth")


def levers(rows: list[dict], labels: list[str], path: Path, title: str = "") -> Path:
    """OServe's speedup over vllm-static per scenario (groups) under each combination of levers (bars).
    `rows`: `oserve bench levers` scenario rows."""
    return _grouped_speedups(rows, "points", labels, path, title or "What each lever adds")


def _grouped_speedups(rows: list[dict], key: str, labels: list[str], path: Path, title: str) -> Path:
    """Bars of `row[key][i]["speedup"]` per row (groups) and label i (bars), a line at 1."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(8.0, 2.2 * len(rows) + 3), 4.8))
    x = np.arange(len(rows))
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        vals = [r[key][i]["speedup"] if r[key][i]["speedup"] is not None else np.nan for r in rows]
        ax.bar(x + (i - (len(labels) - 1) / 2) * width, vals, width, label=label)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(x, [r["scenario"] for r in rows])
    ax.set_ylabel("P99 of vllm-static / P99 of OServe")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(title)
    return _save(plt, fig, path)


def uncertainty(rows: list[dict], path: Path, title: str = "") -> Path:
    """OServe's speedup over vllm-static against the accuracy of the classes it routes by, a line per
    scenario, the estimator OServe really has as a marker. `rows`: `oserve bench uncertainty` rows."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for r in rows:
        set_points = [p for p in r["points"] if p["label"] != "estimator"]
        line = ax.plot([p["accuracy"] for p in set_points],
                       [p["speedup"] if p["speedup"] is not None else np.nan for p in set_points],
                       marker="o", label=r["scenario"])[0]
        for p in r["points"]:
            if p["label"] == "estimator" and p["speedup"] is not None:
                ax.scatter([p["accuracy"]], [p["speedup"]], marker="*", s=160, color=line.get_color(),
                           edgecolor="black", zorder=3)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xlabel("fraction of requests classed as their true type at arrival (measured)")
    ax.set_ylabel("P99 of vllm-static / P99 of OServe")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title="star: OServe's own estimator", title_fontsize=8)
    ax.set_title(title or "OServe's speedup against type accuracy", fontsize=10)
    return _save(plt, fig, path)


def fixed_deployments(outcomes: list[dict], references: dict[str, float], path: Path, title: str = "") -> Path:
    """P99 of every fixed deployment, best first (bars), with the policies' P99s as horizontal lines.

    `outcomes`: `oserve bench ceiling` rows (label, p99_e2e_s, dropped); `references`: policy -> P99.
    """
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(8.0, 0.32 * len(outcomes) + 3), 5))
    x = np.arange(len(outcomes))
    vals = [o["p99_e2e_s"] if np.isfinite(o["p99_e2e_s"]) else np.nan for o in outcomes]
    colours = ["tab:red" if o["dropped"] else "tab:blue" for o in outcomes]
    ax.bar(x, vals, 0.8, color=colours)
    styles = ("-", "--", ":", "-.")
    for i, (name, p99) in enumerate(references.items()):
        ax.axhline(p99, color="black", lw=1.0, ls=styles[i % len(styles)], label=f"{name}: {p99:.1f} s")
    ax.set_xticks(x, [o["label"] for o in outcomes], rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("P99 end-to-end latency (s)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(title or "Every fixed deployment (red: some requests dropped)")
    return _save(plt, fig, path)


def switching_schedule(slice_p99: dict[str, list[float]], chosen: list[str], path: Path, title: str = "",
                       most: int = 8) -> Path:
    """Each deployment's P99 slice by slice (`oserve bench ceiling --slice-minutes`: lines, the `most` best over
    the slices, by their worst slice, and every chosen one) with the schedule chosen per slice as black dots.

    `slice_p99`: deployment label -> its P99 on each slice; `chosen`: the label chosen for each slice.
    """
    plt = _plt()
    num_slices = len(chosen)
    x = np.arange(1, num_slices + 1)

    def worst(label: str) -> float:
        vals = [v for v in slice_p99[label] if np.isfinite(v)]
        return max(vals) if len(vals) == num_slices else float("inf")
    shown = sorted(slice_p99, key=worst)[:most]
    shown += [label for label in dict.fromkeys(chosen) if label not in shown]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * num_slices + 4), 4.5))
    for label in shown:
        vals = [v if np.isfinite(v) else np.nan for v in slice_p99[label]]
        ax.plot(x, vals, marker=".", lw=1.0, alpha=0.8, label=label)
    ax.plot(x, [slice_p99[label][i] for i, label in enumerate(chosen)], "ko", ms=9, mfc="none", mew=2,
            label="chosen per slice")
    ax.set_xticks(x, [f"{i}\n{label}" for i, label in zip(x, chosen)], fontsize=7)
    ax.set_xlabel("slice (and the deployment chosen for it)")
    ax.set_ylabel("P99 end-to-end latency on the slice (s)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(title or "Every deployment slice by slice, and the best per slice")
    return _save(plt, fig, path)


def robustness(rows: list[dict], path: Path, title: str = "") -> Path:
    """P99 of each policy per (scenario, injected error), relative to vllm-static (`oserve bench
    robustness`): bars above 1 are slower than the static deployment; an unfinished request shows as a
    hatched bar at the top."""
    plt = _plt()
    policies = ["oserve", "oserve-trusting", "oserve-true-table"]
    labels = [f"{r['scenario']}\n{r['perturbation']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows) + 2), 4))
    width = 0.8 / len(policies)
    top = 4.0
    for i, name in enumerate(policies):
        ratios = []
        for r in rows:
            ref, mine = r["results"]["vllm-static"], r["results"][name]
            ratio = mine["p99_e2e_s"] / ref["p99_e2e_s"] if ref["p99_e2e_s"] and np.isfinite(ref["p99_e2e_s"]) else np.nan
            ratios.append(min(ratio, top) if np.isfinite(ratio) else top)
        x = np.arange(len(rows)) + (i - (len(policies) - 1) / 2) * width
        ax.bar(x, ratios, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(np.arange(len(rows)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("P99 / vllm-static's P99 (capped at 4)")
    ax.set_ylim(0, top * 1.05)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    return _save(plt, fig, path)


def learned_tables(rows: list[dict], path: Path, title: str = "") -> Path:
    """The capacity of every (shape, class) pair OServe's learner has evidence on, model's and learned,
    against the true one (`oserve bench robustness`: one point per pair and run; on the diagonal is right)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 5))
    model_x, model_y, learned_x, learned_y = [], [], [], []
    for r in rows:
        for t in r.get("table", []):
            model_x.append(t["true_rps"])
            model_y.append(t["model_rps"])
            learned_x.append(t["true_rps"])
            learned_y.append(t["learned_rps"])
    ax.scatter(model_x, model_y, s=12, marker="x", label="model (prior)")
    ax.scatter(learned_x, learned_y, s=12, marker="o", facecolors="none", edgecolors="C1", label="learned")
    values = [v for v in model_x + model_y + learned_y if v > 0]
    if values:
        lo, hi = min(values) / 1.5, max(values) * 1.5
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("true capacity (requests/s, the capacity model on the true engine)")
    ax.set_ylabel("believed capacity (requests/s)")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    return _save(plt, fig, path)


def learned_capacity(rows: list[dict], path: Path, title: str = "") -> Path:
    """The live scheduler's capacity per (shape, class): the performance model's and the learned one (bars),
    each learned bar labelled with its time scale u and the estimate's sd (the learned table is the capacity
    model on an engine u times slower; `oserve.planner.learned`). Rows as `CapacityLearner.report` gives them
    (`oserve demo`'s `learned_capacity`)."""
    plt = _plt()
    x = np.arange(len(rows))
    model = np.array([r["model_rps"] for r in rows], dtype=float)
    learned = np.array([r["learned_rps"] for r in rows], dtype=float)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(rows) + 2), 4))
    ax.bar(x - 0.2, model, 0.4, label="model (prior)", color="tab:gray")
    ax.bar(x + 0.2, learned, 0.4, label="learned", color="tab:orange")
    for i, r in enumerate(rows):
        sd = r.get("sd", float("nan"))
        note = f"u {r.get('scale', 1.0):.2f}" + (f"\n\u00b1{sd:.2f}" if np.isfinite(sd) else "")
        ax.annotate(note, (x[i] + 0.2, learned[i]), ha="center", va="bottom", fontsize=6)
    top = float(np.nanmax(np.concatenate([model, learned]))) if len(rows) else 1.0
    ax.set_ylim(0, 1.18 * top if top > 0 else 1.0)  # room for the labels
    ax.set_xticks(x)
    ax.set_xticklabels([f"{r['shape']} {r['class']}" for r in rows], rotation=40, ha="right", fontsize=7)
    ax.set_ylabel("capacity (requests/s at the latency target)")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    return _save(plt, fig, path)


def chaos(phases: list[dict], path: Path, title: str = "") -> Path:
    """Per fault of `oserve bench chaos`: requests answered, refused with an error code, lost and answered
    twice (stacked, of those sent), and the recovery time (dots, right axis)."""
    plt = _plt()
    names = [p["fault"] for p in phases]
    x = np.arange(len(phases))
    answered = np.array([p["answered"] for p in phases], dtype=float)
    errors = np.array([sum(p["errors"].values()) - p["lost"] for p in phases], dtype=float)
    lost = np.array([p["lost"] for p in phases], dtype=float)
    twice = np.array([p["answered_twice"] for p in phases], dtype=float)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(phases) + 2), 4))
    ax.bar(x, answered, 0.6, label="answered", color="tab:green")
    ax.bar(x, errors, 0.6, bottom=answered, label="error code", color="tab:orange")
    ax.bar(x, lost, 0.6, bottom=answered + errors, label="lost", color="tab:red")
    ax.bar(x + 0.32, twice, 0.12, label="answered twice", color="black")
    ax.set_xticks(x)
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("requests")
    right = ax.twinx()
    right.plot(x, [p["recovery_s"] for p in phases], "o", color="tab:blue", label="recovery (s)")
    right.set_ylabel("recovery (s)", color="tab:blue")
    right.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    h2, l2 = right.get_legend_handles_labels()
    ax.legend(handles + h2, labels + l2, fontsize=7, loc="lower left")
    ax.set_title(title, fontsize=9)
    return _save(plt, fig, path)
