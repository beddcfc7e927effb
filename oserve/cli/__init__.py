"""The `oserve` command line: a typer app whose subcommands live in sibling modules."""

from __future__ import annotations

import logging
import sys

try:
    import numpy  # noqa: F401  (the subcommand modules import numpy and rich at their top, as this does typer)
    import rich  # noqa: F401
    import typer
except ModuleNotFoundError as exc:  # `pip install oserve` is the light client alone: no command line
    if (exc.name or "").partition(".")[0] not in ("typer", "click", "rich", "numpy"):
        raise
    sys.exit("the oserve command needs the server extra: pip install 'oserve[server]'")

from oserve import __version__
from oserve.errors import OServeError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="OServe: serve an LLM on a cluster whose workload keeps changing.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print JSON figures with --json.")
trace_app = typer.Typer(no_args_is_help=True, help="Inspect request traces.")
app.add_typer(bench_app, name="bench")
app.add_typer(trace_app, name="trace")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"oserve {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    pass

# Subcommand modules register themselves on the apps above when imported.
from oserve.cli import (bench_cmds, bus_cmds, chaos_cmd, demo_cmd, fidelity_cmd, forecast_cmds,  # noqa: E402,F401
                        live_cmds, plan_cmds, sim_cmds, switch_cmds, trace_cmds)


class _OneLineErrors(logging.Filter):
    """An error a library logs with its traceback becomes one line: nats-py's read loop logs what it did not expect
    ("nats: encountered error", e.g. asyncio's InvalidStateError when a message lands on a request a drain has
    cancelled) with a traceback through the interpreter's last-resort handler. What a user of the command sees is
    the error's type and message; the connection's own error callback and reconnects handle the rest."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            record.msg, record.args = f"{record.getMessage()}: {type(exc).__name__}: {exc}", ()
            record.exc_info, record.exc_text = None, None
        return True


def main() -> None:
    """Entry point: run the app; an OServeError becomes a one-line message and exit code 2."""
    nats_log = logging.getLogger("nats.aio.client")
    if not any(isinstance(f, _OneLineErrors) for f in nats_log.filters):
        nats_log.addFilter(_OneLineErrors())
    try:
        rv = app(standalone_mode=False)
    except OServeError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    except typer.TyperException as exc:  # typer's bundled click: usage errors in non-standalone mode
        exc.show()
        sys.exit(2)
    if isinstance(rv, int) and rv:
        sys.exit(rv)
