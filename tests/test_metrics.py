"""Prometheus metrics: vLLM's engine metrics and OServe's own, scraped over HTTP from a live system."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import urllib.request

import nats
import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from oserve.observability.metrics import E2E_BUCKETS_S, TTFT_BUCKETS_S, Metrics, MetricsServer
from oserve.streams.client import OServeClient, RequestRejected
from oserve.streams.testing import ping_until_up, running_server, unique_subjects
from oserve.traces import load_trace
from oserve.workers.system import LiveSystem, SystemConfig, planning_inputs

SPAN_S = 40.0
"""Clock seconds per span: 2 s of wall time at the test's 20x, the margin the gauges are read within."""
NUM_REQUESTS = 12


@pytest.fixture(scope="module")
def server():
    yield from running_server()


def scrape(url: str) -> dict:
    """The families at `url` by name, parsed with prometheus_client's own parser."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(family, suffix: str = "", **labels) -> list[float]:
    """Values of the family's samples named `family.name + suffix` whose labels include `labels`."""
    return [s.value for s in family.samples
            if s.name == family.name + suffix and all(s.labels.get(k) == v for k, v in labels.items())]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_server_serves_its_own_registry_only() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.request_finished("m", "r0", input_tokens=30, output_tokens=5, ttft_s=0.2, e2e_s=1.0,
                             finished_reason="length")
    metrics.deployment_serving([(2, 1), (2, 1), (4, 2)])
    metrics.deployment_serving([(4, 2)])  # the TP2 replicas retired: their shape goes
    metrics.track_inflight("gw", lambda: 7)
    server = MetricsServer(registry, 0, "127.0.0.1")
    try:
        server.start()
        fams = scrape(server.url)
    finally:
        server.stop()
        server.stop()  # idempotent
    assert "python_gc_objects_collected" not in fams  # not the global default registry
    assert fams["vllm:time_to_first_token_seconds"].type == "histogram"
    assert [b for b in (s.labels.get("le") for s in fams["vllm:time_to_first_token_seconds"].samples) if b][:3] == \
        ["0.001", "0.005", "0.01"]
    assert samples(fams["vllm:request_time_per_output_token_seconds"], "_sum") == [pytest.approx(0.2)]  # (1.0 - 0.2) / 4
    assert samples(fams["vllm:request_success"], "_total", finished_reason="length") == [1.0]
    assert samples(fams["oserve_deployment_replicas"]) == [1.0]
    assert samples(fams["oserve_deployment_replicas"], tp="4", pp="2") == [1.0]
    assert samples(fams["oserve_deployment_gpus"]) == [8.0]
    assert samples(fams["oserve_gateway_inflight_requests"], gateway="gw") == [7.0]
    assert len(TTFT_BUCKETS_S) == 22 and E2E_BUCKETS_S[-1] == 7680.0  # vLLM's edges


async def _until(predicate, timeout_s: float) -> None:
    async def wait() -> None:
        while not predicate():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(wait(), timeout_s)


async def test_a_live_system_exposes_vllm_and_oserve_metrics(server) -> None:
    subjects = unique_subjects()
    config = SystemConfig(subjects=subjects, span_s=SPAN_S, speedup=20.0, heartbeat_interval_wall_s=0.1,
                          forecaster="last_value", twin=False)
    inputs = planning_inputs(config, load_trace("azure-conv").slice_time(0.0, 600.0), initial_rps=np.ones(4))
    registry = CollectorRegistry()
    metrics_server = MetricsServer(registry, 0, "127.0.0.1")
    metrics_server.start()

    async def main() -> tuple[list, dict, dict, int]:
        nc = await nats.connect(server.url)
        try:
            async with LiveSystem(nc, config, inputs, metrics=Metrics(registry)) as system:
                await system.wait_serving(20)
                client = OServeClient(nc, subjects)
                # the burst goes out just after a span starts, so one span holds all of it, and the gauges read after
                # that span closes have the whole next span (2 s of wall time) before an empty span replaces them
                await system.clock.sleep_until((system.clock.now_s() // SPAN_S + 1) * SPAN_S)
                replies = await asyncio.gather(*[client.submit(input_tokens=100 + 10 * i, max_tokens=40,
                                                               sim_output_tokens=5 + i, timeout_s=20)
                                                 for i in range(NUM_REQUESTS)])
                with pytest.raises(RequestRejected):  # over the context window: refused at the gateway
                    await client.submit(input_tokens=900_000, max_tokens=10, timeout_s=5)
                await _until(lambda: not system.gateway.pending, 10)  # completions are published in batches
                during = await asyncio.to_thread(scrape, metrics_server.url)
                # a span closes with these arrivals in it: its forecast is observed too (empty spans before the first
                # arrival are not emitted, so the first event is that span's)
                await _until(lambda: system.forecaster.num_events >= 1, 20)
                after = await asyncio.to_thread(scrape, metrics_server.url)
                num_types = system.forecaster.config.num_types
        finally:
            await nc.close()
        return replies, during, after, num_types

    try:
        replies, fams, after, num_types = await asyncio.wait_for(main(), 60)
    finally:
        metrics_server.stop()
    engines = {r.replica_id for r in replies}
    # vLLM's names, types and labels
    for name, kind in (("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                       ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:time_to_first_token_seconds", "histogram"),
                       ("vllm:e2e_request_latency_seconds", "histogram"),
                       ("vllm:request_time_per_output_token_seconds", "histogram"), ("vllm:prompt_tokens", "counter"),
                       ("vllm:generation_tokens", "counter"), ("vllm:request_success", "counter")):
        assert fams[name].type == kind, name
        assert {s.labels["model_name"] for s in fams[name].samples} == {"llama2-7b"}, name
    assert {s.labels["engine"] for s in fams["vllm:num_requests_running"].samples} >= engines
    assert all(0.0 <= v <= 1.0 for v in samples(fams["vllm:kv_cache_usage_perc"]))
    # counts equal the requests answered, histogram counts too
    assert sum(samples(fams["vllm:request_success"], "_total")) == NUM_REQUESTS
    assert sum(samples(fams["vllm:request_success"], "_total", finished_reason="stop")) == NUM_REQUESTS
    assert sum(samples(fams["vllm:time_to_first_token_seconds"], "_count")) == NUM_REQUESTS
    assert sum(samples(fams["vllm:e2e_request_latency_seconds"], "_count")) == NUM_REQUESTS
    assert sum(samples(fams["vllm:request_time_per_output_token_seconds"], "_count")) == NUM_REQUESTS  # all > 1 token
    assert sum(samples(fams["vllm:prompt_tokens"], "_total")) == sum(r.input_tokens for r in replies)
    assert sum(samples(fams["vllm:generation_tokens"], "_total")) == sum(r.output_tokens for r in replies) == \
        sum(5 + i for i in range(NUM_REQUESTS))
    e2e_sum = sum(samples(fams["vllm:e2e_request_latency_seconds"], "_sum"))
    assert e2e_sum == pytest.approx(sum(r.e2e_s for r in replies))  # clock seconds, as the replies say
    assert 0 < sum(samples(fams["vllm:time_to_first_token_seconds"], "_sum")) < e2e_sum
    # the gateway: accepted, rejected by code, in flight
    assert samples(fams["oserve_requests_accepted"], "_total") == [NUM_REQUESTS]
    assert samples(fams["oserve_requests_rejected"], "_total", code="invalid") == [1.0]
    assert samples(fams["oserve_gateway_inflight_requests"], gateway="gateway-0") == [0.0]
    # the deployment serving and how it got there
    replicas = fams["oserve_deployment_replicas"]
    assert sum(samples(replicas)) >= 1 and all({"tp", "pp"} <= set(s.labels) for s in replicas.samples)
    assert samples(fams["oserve_deployment_gpus"])[0] == sum(
        int(s.labels["tp"]) * int(s.labels["pp"]) * s.value for s in replicas.samples) <= 8
    assert samples(fams["oserve_switches"], "_total", outcome="completed")[0] >= 1
    assert fams["oserve_switch_duration_seconds"].type == "histogram"
    assert samples(fams["oserve_switch_duration_seconds"], "_count")[0] >= 1
    assert samples(fams["oserve_strategy_decisions"], "_total", label="initial") == [1.0]
    assert samples(fams["oserve_strategy_decision_seconds"], "_count")[0] >= 1
    # after a span: its observed rates and the next span's forecast, per type; the forecasters' errors
    observed, forecast = after["oserve_observed_requests_per_second"], after["oserve_forecast_requests_per_second"]
    assert observed.type == forecast.type == "gauge"
    assert len(observed.samples) == len(forecast.samples) == num_types
    assert sum(samples(observed)) * SPAN_S == pytest.approx(NUM_REQUESTS)  # per clock second over one span
    assert all(v >= 0 for v in samples(forecast))
    assert samples(after["oserve_forecasts"], "_total", forecaster="last_value")[0] >= 1
    assert 0.0 <= samples(after["oserve_misclassified_ratio"])[0] <= 1.0


async def test_the_metrics_port_option_of_oserve_up(server) -> None:
    subjects = unique_subjects()
    port = free_port()
    launch = "import sys, oserve.cli.live_cmds; from oserve.cli import main; main()"
    proc = subprocess.Popen([sys.executable, "-c", launch, "up", "--nats", server.url, "--prefix", subjects.prefix,
                             "--speedup", "60", "--duration-s", "60", "--metrics-port", str(port), "--http-port", "0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        async def main() -> None:
            client = await OServeClient.connect(server.url, subjects=subjects)
            await ping_until_up(client, 30)
            await asyncio.gather(*[client.submit(input_tokens=100, max_tokens=8, timeout_s=10) for _ in range(3)])
            await client.close()

        await asyncio.wait_for(main(), 40)
        fams = scrape(f"http://127.0.0.1:{port}/metrics")
        assert sum(samples(fams["vllm:request_success"], "_total")) == 3
        assert samples(fams["oserve_requests_accepted"], "_total") == [3.0]
    finally:
        proc.terminate()
        proc.communicate(timeout=20)


def test_a_taken_metrics_port_costs_the_endpoint_not_the_worker(caplog) -> None:
    from oserve.cli.live_cmds import _metrics_server

    assert _metrics_server(0) == (None, None)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        assert _metrics_server(taken.getsockname()[1]) == (None, None)
    assert "no /metrics" in caplog.text


def test_a_retired_engine_leaves_no_series_behind() -> None:
    """Every switch names its replicas afresh, so a retired engine's series must go, or they grow forever."""
    from prometheus_client import generate_latest

    metrics = Metrics(CollectorRegistry())
    for engine in ("s1-r0", "s2-r0"):
        metrics.engine_load("m", engine, num_running=1, num_waiting=2, kv_usage_frac=0.5)
        metrics.request_finished("m", engine, input_tokens=3, output_tokens=4, ttft_s=0.1, e2e_s=0.4,
                                 finished_reason="stop")
        metrics.request_aborted("m", engine)
    metrics.engine_stopped("m", "s1-r0")
    metrics.engine_stopped("m", "never-seen")  # no error for an engine that observed nothing
    text = generate_latest(metrics.registry).decode()
    assert 'engine="s1-r0"' not in text and 'engine="s2-r0"' in text


def test_kv_cache_usage_is_blocks_in_use_while_the_router_load_counts_the_queue() -> None:
    """vLLM's kv_cache_usage_perc is in [0, 1]; the router's load figure adds queued demand and passes 1."""
    from oserve.workers.backends import Job, SimBackend

    backend = SimBackend("r0")
    for seq in range(400):
        backend.add(Job(seq, f"q{seq}", 2000, 512, 0, 0.0), 0.0)
    backend.advance(backend.next_event_s())
    load = backend.load()
    assert load.kv_load_frac > 1.0 and 0.0 < load.kv_usage_frac <= 1.0
