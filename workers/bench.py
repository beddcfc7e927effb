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
    gateway = Gateway(workers_nc, GatewayConfig(subjects=subjects, gateway_id="bench-gw"), clock)
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
        "path": "client -> gateway (validate, classify, smooth WRR, track) -> engine (echo backend) -> client",
    }
