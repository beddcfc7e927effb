"""`oserve demo`: the main job. Until the live pipeline lands it runs the whole method in the simulator."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from oserve.cli import app

NOT_YET = (
    "Not there yet: the live NATS pipeline (gateway/router, forecaster stage, scheduler and switch-planner "
    "workers, engine workers), the replay over NATS at 60x with a live view, and tracing to Jaeger. "
    "This demo runs the same method in the simulator: the bundled Azure conversation trace, its workload "
    "types, the capacity table, the scheduler and the switch planner, against vLLM-style baselines."
)


@app.command("demo")
def demo(
    model: str = typer.Option("llama2-70b", help="Model preset."),
    gpus: int = typer.Option(16, help="GPUs in the simulated cluster."),
    minutes: float = typer.Option(20.0, help="Minutes of the bundled trace to replay."),
    load: float = typer.Option(0.8, help="Mean demand as a fraction of the best homogeneous capacity."),
    out: Path = typer.Option(Path("report/demo"), help="Report folder (PNG plots, summary.json)."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON at the end."),
) -> None:
    """Run the main job: the bundled trace through OServe and the baselines, with a report folder."""
    from oserve.cli.sim_cmds import _run, _table, out_console
    from oserve.observability import report
    from oserve.sim.evaluate import POLICIES
    from oserve.specs import model_preset

    model_preset(model)  # fail fast on a bad name, before any work
    console = Console(stderr=True)
    console.print(f"[yellow]{NOT_YET}[/yellow]")
    start = time.perf_counter()
    scenario, comparison, cluster = _run("azure-conv", model, gpus, POLICIES, load, minutes, 60.0, 0, console)
    types = scenario.types
    t = Table(title=f"Workload types of the bundled trace ({len(scenario.workload)} requests after scaling to "
                    f"{load:.0%} of the best homogeneous capacity)")
    for col in ("type", "share", "mean input", "mean output"):
        t.add_column(col, justify="right")
    for name, s in zip(types.names, types.stats):
        t.add_row(name, f"{s.share:.1%}", f"{s.mean_input_tokens:.0f}", f"{s.mean_output_tokens:.0f}")
    out.mkdir(parents=True, exist_ok=True)
    report.latency_cdf(comparison.results, out / "latency_cdf.png", "azure-conv: latency per policy")
    oserve = comparison.results["oserve"]
    report.deployment_timeline(oserve.spans, cluster.num_gpus, out / "deployment.png", "OServe's deployment over time")
    report.rates_and_forecast(oserve.spans, scenario.table.type_names, 60.0, out / "rates.png",
                              "Per-type rates and OServe's forecast")
    s = oserve.summary()
    summary = {
        "mode": "simulated",
        "model": model, "gpus": gpus, "minutes": minutes, "load": load,
        "requests": s["requests"], "answered": s["finished"], "errors": s["dropped"],
        "switches": s["switches"] - 1, "p99_s": s["p99_e2e_s"], "p99_ttft_s": s["p99_ttft_s"],
        "speedup_p99": comparison.speedup_p99(), "static_shape": comparison.static_shape,
        "policies": {name: r.summary() for name, r in comparison.results.items()},
        "report": str(out), "seconds": time.perf_counter() - start,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if json_out:
        typer.echo(json.dumps(summary, indent=2))
        return
    show = out_console()
    show.print(t)
    show.print(_table(comparison, scenario))
    show.print(f"Report: {out}/ (latency_cdf.png, deployment.png, rates.png, summary.json); "
               f"{summary['seconds']:.0f} s")
