"""`oserve demo`: the main job. Until the live pipeline lands it shows what the core can already do."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from oserve.cli import app

NOT_YET = (
    "Not there yet: the live NATS pipeline (gateway, forecaster, scheduler, switch planner, engines), the "
    "trace replay at 60x with a live view, and the report folder. This demo runs the pieces that exist: "
    "the bundled Azure conversation trace, its workload types, and the capacity of each replica shape."
)


@app.command("demo")
def demo(
    model: str = typer.Option("llama2-70b", help="Model preset."),
    max_gpus: int = typer.Option(8, help="Largest replica to list."),
) -> None:
    """Run the main job (today: trace -> workload types -> capacity table; see the note it prints)."""
    from oserve.capacity import CapacityTable
    from oserve.specs import GPUS, model_preset
    from oserve.workload import fit_types, load_trace

    spec = model_preset(model)
    console = Console()
    console.print(f"[yellow]{NOT_YET}[/yellow]")
    trace = load_trace("azure-conv")
    types = fit_types(trace.input_tokens, trace.output_tokens)
    t = Table(title=f"Workload types of {trace.name} ({len(trace)} requests, {trace.duration_s / 60:.1f} min)")
    for col in ("type", "share", "mean input", "mean output"):
        t.add_column(col, justify="right")
    for name, s in zip(types.names, types.stats):
        t.add_row(name, f"{s.share:.1%}", f"{s.mean_input_tokens:.0f}", f"{s.mean_output_tokens:.0f}")
    console.print(t)
    table = CapacityTable(spec, GPUS["h100-80gb"], types)
    c = Table(title=f"Capacity n\\[shape]\\[type] of {spec.name} on H100, req/s at TBT <= {table.target.tbt_s * 1e3:.0f} ms")
    c.add_column("shape")
    c.add_column("GPUs", justify="right")
    for name in types.names:
        c.add_column(name, justify="right")
    for shape in table.shapes(max_gpus):
        c.add_row(str(shape), str(shape.num_gpus), *(f"{table.rate(shape, j):.2f}" for j in range(len(types.names))))
    console.print(c)
