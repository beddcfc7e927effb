"""`oserve bench ...` subcommands: measured figures, as a table or as JSON with --json."""

from __future__ import annotations

import json
import time

import typer
from rich.console import Console
from rich.table import Table

from pathlib import Path

from oserve.cli import app, bench_app
from oserve.cli.tables import compact


@bench_app.command("perfmodel")
def bench_perfmodel(
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """Accuracy of the performance model on measured H100 points held out from its fit.

    Layers: leave-one-model-out over the three profiled models (fit on two, predict the third).
    Collectives: every fifth measured message size held out of each curve's fit.
    """
    from oserve import calibration as cal
    from oserve.perfmodel import COEFFICIENTS_FILE
    from oserve.data import data_path
    from oserve.specs import GPUS

    gpu = GPUS["h100-80gb"]
    start = time.perf_counter()
    layer_rows, coll_rows = cal.read_compact(data_path(COEFFICIENTS_FILE).parent)
    scores = cal.score(layer_rows, coll_rows, gpu.peak_flops, gpu.hbm_bytes_per_s)
    layers, colls = scores["layers"], scores["collectives"]
    result = {
        "mape": layers["mape"],
        "points": layers["points"],
        "held_out": "leave-one-model-out: fit on two profiled models, predict every (TP, tokens) point of the third",
        "measure": "one layer's non-attention time (GEMMs + element-wise operators), H100, medians",
        "layers": layers,
        "collectives": colls,
        "seconds": time.perf_counter() - start,
    }
    if json_out:
        typer.echo(json.dumps(result, indent=2))
        return
    console = Console()
    table = Table(title="Performance model vs measured H100 profiles (held out)")
    for col in ("what", "held out", "points", "MAPE", "P90 APE"):
        table.add_column(col, justify="right" if col in ("points", "MAPE", "P90 APE") else "left")
    for model, s in layers["per_model"].items():
        table.add_row(f"layer, {model}", "whole model", str(s["points"]), f"{s['mape']:.2%}", f"{s['p90_ape']:.2%}")
    table.add_row("layer, all", "leave-one-model-out", str(layers["points"]), f"{layers['mape']:.2%}",
                  f"{layers['p90_ape']:.2%}", style="bold")
    for key, s in colls["per_key"].items():
        table.add_row(key, "every 5th size", str(s["points"]), f"{s['mape']:.2%}", "")
    console.print(compact(table))


@app.command("calibrate")
def calibrate(
    profiling: Path = typer.Option(..., help="Vidur's profiling folder (holds h100/ and h100_dgx/)."),
    out: Path = typer.Option(None, help="Where to write the compact tables and coefficients; "
                                        "default: the installed package's data folder."),
) -> None:
    """Rebuild the shipped profile extract and fitted coefficients from Vidur's profiling CSVs."""
    from oserve import calibration as cal
    from oserve.perfmodel import COEFFICIENTS_FILE
    from oserve.data import data_path
    from oserve.specs import GPUS

    gpu = GPUS["h100-80gb"]
    target = out or data_path(COEFFICIENTS_FILE).parent
    target.mkdir(parents=True, exist_ok=True)
    layer_rows, coll_rows = cal.extract_profiles(profiling)
    cal.write_compact(layer_rows, coll_rows, target)
    coeffs = cal.fit_all(layer_rows, coll_rows, gpu.peak_flops, gpu.hbm_bytes_per_s)
    with open(target / COEFFICIENTS_FILE, "w") as f:
        json.dump(coeffs, f, indent=1, sort_keys=True)
    typer.echo(f"wrote {len(layer_rows)} layer points, {len(coll_rows)} collective points and "
               f"{COEFFICIENTS_FILE} to {target}")
