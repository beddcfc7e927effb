"""`oserve schema` (the bus contract as JSON Schema) and `oserve top` (a running system, read from its streams).

Registered on `oserve.cli.app` when imported; nats and the workers are imported inside the commands.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from oserve.cli import app


@app.command("schema")
def schema_cmd(
    out: Path | None = typer.Option(None, "--out", help="Write the schema here instead of printing it "
                                                        "(the checked-in copy is docs/bus-schema.json)."),
    prefix: str = typer.Option("oserve", help="Subject prefix the subjects are shown with."),
) -> None:
    """JSON Schema (draft 2020-12) of every bus message, grouped by the subject it travels on."""
    from oserve.streams.contract import schema_json
    from oserve.streams.subjects import Subjects

    text = schema_json(Subjects(prefix))
    if out is None:
        typer.echo(text, nl=False)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    typer.echo(f"wrote {out}", err=True)


@app.command("top")
def top_cmd(
    nats_url: str = typer.Option("nats://127.0.0.1:4222", "--nats", envvar="OSERVE_NATS_URL",
                                 help="NATS URL of a running system."),
    prefix: str = typer.Option("oserve", help="Subject prefix."),
    user: str = typer.Option("", help="NATS user (the read-only `telemetry` user of deploy/nats-server.conf)."),
    password: str = typer.Option("", envvar="OSERVE_TELEMETRY_PASSWORD", help="Its password."),
    once: bool = typer.Option(False, "--once", help="Print one snapshot and exit."),
    json_out: bool = typer.Option(False, "--json", help="Print the snapshot as JSON (implies --once)."),
    history_s: float = typer.Option(3600.0, "--history-s", help="Plan events of this many past wall seconds are "
                                                                "read on start (recent switches)."),
    refresh_s: float = typer.Option(1.0, "--refresh-s", help="Seconds between screen updates."),
) -> None:
    """A terminal view of a running system from its telemetry and plans streams: replicas and their load,
    per-type arrivals and forecast, the plan in force, recent switches. Shows the stored state at once."""
    import asyncio

    import nats
    import nats.errors
    import nats.js.errors

    from oserve.errors import ConfigError
    from oserve.observability.top import TopConfig, TelemetryFeed, now_unix_s, snapshot_once
    from oserve.streams.server import redact_url
    from oserve.streams.subjects import Subjects

    subjects = Subjects(prefix)
    config = TopConfig(subjects=subjects, history_wall_s=history_s)
    if not refresh_s > 0:
        raise ConfigError(f"--refresh-s must be > 0, got {refresh_s}")

    async def main() -> None:
        try:
            nc = await nats.connect(nats_url, user=user or None, password=password or None, connect_timeout=5,
                                    inbox_prefix=f"{subjects.reply_prefix()}.{user or 'anon'}",
                                    max_reconnect_attempts=3)
        except (OSError, nats.errors.NoServersError, TimeoutError) as exc:
            raise ConfigError(f"cannot connect to NATS at {redact_url(nats_url)}: {exc}") from None
        try:
            try:
                if once or json_out:
                    view = await snapshot_once(nc, config)
                    if json_out:
                        typer.echo(json.dumps(view.snapshot(now_unix_s()), indent=2))
                    else:
                        from rich.console import Console

                        Console(width=160).print(view.render(now_unix_s()))
                    return
                await live(nc)
            except nats.js.errors.NotFoundError as exc:
                raise ConfigError(f"no telemetry or plans stream under prefix {prefix!r} on "
                                  f"{redact_url(nats_url)}: is a system running there? ({exc})") from None
        finally:
            await nc.close()

    async def live(nc) -> None:
        from rich.console import Console
        from rich.live import Live

        from oserve.observability.live_view import LiveView

        view = LiveView(subjects)
        feed = TelemetryFeed(nc, view, config)
        try:
            await feed.catch_up()
            async with asyncio.TaskGroup() as tg:  # Ctrl-C cancels the follower with the screen loop
                follower = tg.create_task(feed.follow())
                with Live(view.render(now_unix_s()), console=Console(), refresh_per_second=4) as screen:
                    while not follower.done():
                        await asyncio.sleep(refresh_s)
                        screen.update(view.render(now_unix_s()))
        finally:
            await feed.close()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        return
