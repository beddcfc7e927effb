"""`oserve bench chaos`: the live system in separate processes while each of its parts fails in turn.

Registered on `oserve.cli.bench_app` when imported; the workers, nats and asyncio are imported inside
the command, so `oserve --help` stays fast.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from oserve.cli import bench_app
from oserve.cli.sim_cmds import _fmt, _json_safe, _progress, _save_report, out_console
from oserve.cli.tables import compact


@bench_app.command("chaos")
def bench_chaos(
    faults: str = typer.Option("all", help="Comma-separated faults (`oserve.workers.chaos.FAULTS`), or all."),
    rate: float = typer.Option(8.0, help="Requests sent per wall second."),
    phase_s: float = typer.Option(14.0, help="Wall seconds of requests per fault."),
    speedup: float = typer.Option(4.0, help="Clock speed of the workers relative to wall time."),
    gpus: int = typer.Option(8, help="GPUs of the simulated cluster."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    out: Path = typer.Option(None, help="Write chaos.json and chaos.png here."),
) -> None:
    """Requests through the live system (each worker an `oserve worker` process, one JetStream nats-server)
    while, in turn, each worker kind is SIGKILLed and restarted, a switch loses its engine host half-way, and
    nats-server restarts after a short and a long outage: per fault, sent, answered, answered twice, errors
    by code, lost and recovery time (`oserve.workers.chaos`)."""
    import asyncio

    from oserve.errors import UnknownNameError
    from oserve.workers.chaos import FAULTS, ChaosConfig, run_chaos

    names = FAULTS if faults.strip() == "all" else tuple(f.strip() for f in faults.split(",") if f.strip())
    for f in names:
        if f not in FAULTS:
            raise UnknownNameError("fault", f, FAULTS)
    config = ChaosConfig(faults=names, rate_rps=rate, phase_wall_s=phase_s, speedup=speedup, gpus=gpus)
    console = Console(stderr=True)
    start = time.perf_counter()
    with _progress(console) as bar:
        task = bar.add_task("starting the workers", total=len(names) + 1)

        def progress(fault: str, phase: dict) -> None:
            bar.update(task, advance=1, description=f"{fault}: {phase['answered']}/{phase['sent']} answered")
        result = asyncio.run(run_chaos(config, progress=progress))
    result["seconds"] = time.perf_counter() - start
    if out is not None:
        _save_report(out, "chaos", result,
                     lambda report: report.chaos(result["phases"], out / "chaos.png",
                                                 f"{rate:g} req/s through each fault, {gpus} GPUs, speedup {speedup:g}"))
    if json_out:
        typer.echo(json.dumps(_json_safe(result), indent=2))
        return
    t = Table(title="Requests through each fault (workers in separate processes)")
    t.caption = ("twice: requests answered more than once (on the wire, or seen by the client); lost: no answer "
                 "at all; disrupted: sent after the fault and failed or took over twice the fault-free P99; "
                 "recovery: from the fault to the last disrupted request's send; taken back: requests a restarted "
                 "gateway took back from its journal")
    for col in ("fault", "sent", "answered", "twice", "errors", "lost", "disrupted", "recovery s", "P99 wall s",
                "taken back"):
        t.add_column(col, justify="left" if col in ("fault", "errors") else "right")
    for p in result["phases"]:
        errors = ", ".join(f"{code} {n}" for code, n in p["errors"].items()) or "-"
        t.add_row(p["fault"], str(p["sent"]), str(p["answered"]), str(p["answered_twice"]), errors, str(p["lost"]),
                  str(p["disrupted"]), _fmt(p["recovery_s"]), _fmt(p["p99_wall_s"]), str(p.get("gateway_took_back", 0)))
    out_console().print(compact(t))
    verdict = "met" if result["meets_targets"] else "NOT met"
    out_console().print(f"targets (0 lost, 0 answered twice, only documented error codes): {verdict}")
