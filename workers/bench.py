"""The bus benchmark: requests/s and added latency of gateway -> engine versus a bare NATS echo.

Both paths run in one process against the same server, measured in the same run:
- echo: a responder that answers each request with its payload (one hop there, one back);
- routed: gateway (validation, classification, smooth WRR, pending tracking, arrival events) ->
  engine worker with the zero-cost `echo` backend (de-duplication, reply, completion events).
Throughput is measured with `concurrency` requests in flight, in interleaved rounds (best of each);
latency with one request at a time, alternating between the paths.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import nats

from oserve.errors import ConfigError
from oserve.streams.jetstream import ensure_streams
from oserve.streams.schemas import SubmitRequest, encode
from oserve.streams.subjects import Subjects
from oserve.workers.clock import Clock
from oserve.workers.engine import EngineWorker, EngineWorkerConfig
from oserve.workers.gateway import Gateway, GatewayConfig


@dataclass(frozen=True, slots=True)
class BusBenchConfig:
    num_requests: int = 20_000
    """Requests per throughput measurement."""
    num_latency_requests: int = 2_000
    """Sequential requests per latency measurement."""
    concurrency: int = 128
    """Requests in flight during the throughput measurement."""
    num_rounds: int = 3
    """Throughput rounds per path, interleaved; the best round of each counts."""
    journal: bool = True
    """The gateway journals what it owns (`Gateway.js`), as a production gateway does: one more publish per
    request and a `Settled` per batch. False measures the path without it."""

    def __post_init__(self) -> None:
        for name in ("num_requests", "num_latency_requests", "concurrency", "num_rounds"):
            if getattr(self, name) < 1:
                raise ConfigError(f"BusBenchConfig.{name} must be >= 1, got {getattr(self, name)}")


async def _throughput(nc, subject: str, payloads: list[bytes], concurrency: int) -> float:
    it = iter(payloads)

    async def worker() -> None:
        for p in it:
            await nc.request(subject, p, timeout=10)

    start = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(worker())
    return len(payloads) / (time.perf_counter() - start)


async def _latencies_ms(nc, subjects: tuple[str, str], payloads: list[bytes]) -> tuple[list[float], list[float]]:
    """One request at a time, alternating between the two subjects, so a passing disturbance of a shared
    machine hits both paths alike; sorted latencies of each (ms)."""
    out: tuple[list[float], list[float]] = ([], [])
    for p in payloads:
        for k, subject in enumerate(subjects):
            t = time.perf_counter()
            await nc.request(subject, p, timeout=10)
            out[k].append((time.perf_counter() - t) * 1e3)
    return sorted(out[0]), sorted(out[1])


def _pct(sorted_ms: list[float], q: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))]


async def run_bus_bench(url: str, config: BusBenchConfig = BusBenchConfig(),
                        subjects: Subjects = Subjects("bench")) -> dict:
    """Measure both paths on the server at `url`; returns the figures as a dict."""
    # one connection per service, as separate processes would have
    workers_nc = await nats.connect(url)
    engine_nc = await nats.connect(url)
    client_nc = await nats.connect(url, pending_size=64 * 1024 * 1024)
    echo_subject = f"{subjects.prefix}.bench.echo"

    async def echo(msg) -> None:
        await workers_nc.publish(msg.reply, msg.data)

    echo_sub = await workers_nc.subscribe(echo_subject, cb=echo)
    clock = Clock()
    engine = EngineWorker(engine_nc, EngineWorkerConfig("bench-r0", subjects=subjects, backend="echo"), clock)
    js = None
    if config.journal:
        js = workers_nc.jetstream()
        await ensure_streams(js, subjects)
    gateway = Gateway(workers_nc, GatewayConfig(subjects=subjects, gateway_id="bench-gw"), clock, js=js)
    try:
        async with engine, gateway:
            await gateway.wait_for_replicas(1, 10.0)

            def payloads(n: int, tag: str) -> list[bytes]:
                return [encode(SubmitRequest(request_id=f"{tag}{i}", input_tokens=128 + i % 512, max_tokens=64))
                        for i in range(n)]

            warm = payloads(500, "w")
            await _throughput(client_nc, echo_subject, warm, config.concurrency)
            await _throughput(client_nc, subjects.submit(), warm, config.concurrency)
            echo_rates, routed_rates = [], []
            for r in range(config.num_rounds):
                batch = payloads(config.num_requests, f"t{r}-")
                echo_rates.append(await _throughput(client_nc, echo_subject, batch, config.concurrency))
                routed_rates.append(await _throughput(client_nc, subjects.submit(), batch, config.concurrency))
            lat = payloads(config.num_latency_requests, "l")
            echo_ms, routed_ms = await _latencies_ms(client_nc, (echo_subject, subjects.submit()), lat)
            answered = engine.num_answered
    finally:
        await echo_sub.unsubscribe()
        await client_nc.close()
        await workers_nc.close()
        await engine_nc.close()
    echo_per_s, routed_per_s = max(echo_rates), max(routed_rates)
    return {
        "routed_per_s": routed_per_s,
        "echo_per_s": echo_per_s,
        "ratio": routed_per_s / echo_per_s,
        "p99_added_ms": _pct(routed_ms, 0.99) - _pct(echo_ms, 0.99),
        "p50_added_ms": _pct(routed_ms, 0.5) - _pct(echo_ms, 0.5),
        "echo_p99_ms": _pct(echo_ms, 0.99),
        "routed_p99_ms": _pct(routed_ms, 0.99),
        "num_requests": config.num_requests,
        "concurrency": config.concurrency,
        "engine_answered": answered,
        "journal": config.journal,
        "path": "client -> gateway (validate, classify, smooth WRR, track) -> engine (echo backend) -> client",
    }


@dataclass(frozen=True, slots=True)
class OutageBenchConfig:
    """A replay through the client while the nats-server is SIGKILLed and started again on its port."""

    num_requests: int = 2_000
    duration_s: float = 20.0
    """Wall seconds the requests are spread over (evenly)."""
    outage_at_s: float = 5.0
    """Wall seconds into the replay the server is killed ..."""
    outage_s: float = 8.0
    """... and how long it stays down."""
    timeout_s: float = 30.0
    """Each request's wait (sent to the gateway as its deadline)."""
    give_up_after_s: float | None = None
    """The client's `ReconnectPolicy.give_up_after_s` (None: reconnect forever)."""
    num_replicas: int = 2
    speedup: float = 50.0
    """Clock speed of the simulated engines."""
    settle_s: float = 1.0
    """Wall seconds to keep counting answers after the last request (duplicates, late)."""

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.num_replicas < 1 or not self.duration_s > 0 or not self.timeout_s > 0:
            raise ConfigError(f"OutageBenchConfig: num_requests and num_replicas must be >= 1, duration_s and "
                              f"timeout_s > 0, got {self.num_requests}, {self.num_replicas}, {self.duration_s}, "
                              f"{self.timeout_s}")
        if self.outage_at_s < 0 or self.outage_s < 0 or self.settle_s < 0:
            raise ConfigError(f"OutageBenchConfig: outage_at_s, outage_s and settle_s must be >= 0, got "
                              f"{self.outage_at_s}, {self.outage_s}, {self.settle_s}")


class _KillableServer:
    """A `nats-server -js` on a fixed free port that can be SIGKILLed and started again on that port."""

    def __init__(self) -> None:
        import socket
        import tempfile

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._tmp = tempfile.TemporaryDirectory(prefix="oserve-outage-")
        self._proc = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        import socket
        import subprocess

        from oserve.streams.server import find_nats_server

        self._proc = subprocess.Popen([find_nats_server(), "-a", "127.0.0.1", "-p", str(self.port), "-js",
                                       "-sd", self._tmp.name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10.0
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                if time.monotonic() > deadline or self._proc.poll() is not None:
                    raise RuntimeError(f"nats-server did not start on port {self.port}") from None
                time.sleep(0.02)

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()  # SIGKILL: no goodbye to the clients
            self._proc.wait(10)
        self._proc = None

    def close(self) -> None:
        self.kill()
        self._tmp.cleanup()


async def _close_quietly(nc) -> None:
    try:
        await nc.close()
    except OSError:  # nats-py raises closing a connection with buffered publishes on a lost socket
        pass


async def run_outage_bench(config: OutageBenchConfig = OutageBenchConfig(),
                           subjects: Subjects = Subjects("outage")) -> dict:
    """Replay `num_requests` through `OServeClient` (gateway and sim engines on a worker connection that
    reconnects forever) while the server is down for `outage_s`; returns `replay`'s report with the
    outage's figures."""
    import contextlib

    from oserve.streams.client import OServeClient, ReconnectPolicy
    from oserve.traces import Request, Trace
    from oserve.workers.system import connect, replay

    server = _KillableServer()
    server.start()
    n = config.num_requests
    trace = Trace.from_requests([Request(f"o{i}", config.duration_s * i / n, 50 + i % 400, 1 + i % 64)
                                 for i in range(n)], name="outage")
    try:
        async with contextlib.AsyncExitStack() as stack:
            nc = await connect(server.url, "oserve-outage-workers")
            stack.push_async_callback(_close_quietly, nc)  # last: the workers drain through it first
            clock = Clock(config.speedup)
            for k in range(config.num_replicas):
                await stack.enter_async_context(EngineWorker(nc, EngineWorkerConfig(f"o-r{k}", subjects=subjects),
                                                             clock))
            gateway = await stack.enter_async_context(Gateway(nc, GatewayConfig(subjects=subjects), clock))
            await gateway.wait_for_replicas(config.num_replicas, 10.0)
            client = await OServeClient.connect(server.url, subjects=subjects, name="oserve-outage-client",
                                                reconnect=ReconnectPolicy(give_up_after_s=config.give_up_after_s))

            async def outage() -> None:
                await asyncio.sleep(config.outage_at_s)
                server.kill()
                await asyncio.sleep(config.outage_s)
                await asyncio.to_thread(server.start)

            fault = asyncio.create_task(outage())
            try:
                result = await replay(client, trace, 1.0, timeout_s=config.timeout_s, watch_switches=False,
                                      settle_s=config.settle_s)
            finally:
                await fault
                await client.close()
    finally:
        server.close()
    result.update(outage_at_s=config.outage_at_s, outage_s=config.outage_s, timeout_s=config.timeout_s,
                  give_up_after_s=config.give_up_after_s)
    return result
