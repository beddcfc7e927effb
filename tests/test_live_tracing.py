"""One trace per request: client -> gateway -> engine, carried as W3C traceparent in NATS headers."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import nats
import pytest
from opentelemetry.trace import SpanKind

from oserve.streams.client import OServeClient, RequestRejected
from oserve.observability.tracing import TracingConfig, extract, inject, setup_tracing, trace_headers
from oserve.streams.testing import running_server, unique_subjects
from oserve.workers.clock import Clock
from oserve.workers.engine import EngineWorker, EngineWorkerConfig
from oserve.workers.gateway import Gateway, GatewayConfig


@pytest.fixture(scope="module")
def server():
    yield from running_server()


def step(span) -> str:
    """The pipeline step a span stands for (`oserve.step`); its name follows the OpenTelemetry conventions."""
    return (span.attributes or {}).get("oserve.step", span.name)


async def traced_gateway(stack: AsyncExitStack, url: str, tracer):
    """A traced gateway and one traced engine on fresh subjects: (connection, subjects, gateway, client)."""
    subjects = unique_subjects()
    nc = await nats.connect(url)
    stack.push_async_callback(nc.close)
    clock = Clock(speedup=50)
    await stack.enter_async_context(EngineWorker(
        nc, EngineWorkerConfig("r0", subjects=subjects, heartbeat_interval_wall_s=0.05), clock, tracer=tracer))
    gw = await stack.enter_async_context(Gateway(nc, GatewayConfig(subjects=subjects), clock, tracer=tracer))
    await gw.wait_for_replicas(1, 5)
    return nc, subjects, gw, OServeClient(nc, subjects, tracer=tracer)


def test_inject_copies_headers_and_round_trips() -> None:
    setup = setup_tracing(TracingConfig(exporter="memory"))
    span = setup.tracer.start_span("x")
    original = {"Nats-Msg-Id": "m1"}
    out = inject(span, original)
    assert original == {"Nats-Msg-Id": "m1"} and out is not original and "traceparent" in out
    ctx = extract(out)
    from opentelemetry import trace
    assert trace.get_current_span(ctx).get_span_context().span_id == span.get_span_context().span_id
    assert trace_headers(out) == {"traceparent": out["traceparent"]}
    assert extract({}) is None and trace_headers(None) is None
    span.end()
    setup.shutdown()


def test_exporter_is_chosen_by_config() -> None:
    assert setup_tracing(TracingConfig()).tracer is None
    otlp = setup_tracing(TracingConfig(exporter="otlp", otlp_endpoint="http://127.0.0.1:9/v1/traces"))
    assert type(otlp.exporter).__name__ == "OTLPSpanExporter"
    with pytest.raises(ValueError):
        TracingConfig(exporter="jaeger-thrift")  # type: ignore[arg-type]


async def test_one_trace_from_client_through_gateway_and_engine(server) -> None:
    setup = setup_tracing(TracingConfig(exporter="memory"))
    tracer = setup.tracer

    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, client = await traced_gateway(stack, server.url, tracer)
            for i in range(3):
                await client.submit(input_tokens=100, max_tokens=10, request_id=f"t{i}", timeout_s=5)
            with pytest.raises(RequestRejected):
                await client.submit_raw(b"{oops", "bad", timeout_s=5)

    await asyncio.wait_for(main(), 30)
    spans = setup.exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    clients = [s for s in spans if step(s) == "client.submit" and s.attributes["oserve.request_id"].startswith("t")]
    assert len(clients) == 3
    for c in clients:
        assert c.kind == SpanKind.CLIENT and c.parent is None
        trace_spans = [s for s in spans if s.context.trace_id == c.context.trace_id]
        assert sorted(step(s) for s in trace_spans) == ["client.submit", "engine.serve", "gateway.route"]
        gw = next(s for s in trace_spans if step(s) == "gateway.route")
        eng = next(s for s in trace_spans if step(s) == "engine.serve")
        assert gw.parent.span_id == c.context.span_id and gw.parent.is_remote
        assert eng.parent.span_id == gw.context.span_id and by_id[eng.parent.span_id] is gw
        assert eng.attributes["oserve.request_id"] == c.attributes["oserve.request_id"]
        assert c.start_time <= gw.start_time <= eng.start_time <= eng.end_time <= c.end_time
    # a refused request is one trace too, its gateway span marked as an error with an event
    bad = next(s for s in spans if step(s) == "client.submit" and s.attributes["oserve.request_id"] == "bad")
    bad_gw = next(s for s in spans if step(s) == "gateway.route" and s.context.trace_id == bad.context.trace_id)
    assert not bad_gw.status.is_ok and bad_gw.events[0].name == "invalid_request"
    setup.shutdown()


async def test_a_request_span_links_to_the_switch_that_put_its_assignment_in_force(server) -> None:
    from oserve.streams.schemas import AssignmentSet, encode

    setup = setup_tracing(TracingConfig(exporter="memory"))
    tracer = setup.tracer

    async def main() -> None:
        async with AsyncExitStack() as stack:
            nc, subjects, gw, client = await traced_gateway(stack, server.url, tracer)
            await client.submit(input_tokens=100, max_tokens=10, request_id="before", timeout_s=5)
            with tracer.start_as_current_span("switch.execute") as switch:
                await nc.publish(subjects.plan_event("assignment"),
                                 encode(AssignmentSet(strategy_id="s7", weights=[{"r0": 1.0}])), headers=inject(switch))
            while gw.strategy_id != "s7":
                await asyncio.sleep(0.01)
            await client.submit(input_tokens=100, max_tokens=10, request_id="after", timeout_s=5)

    await asyncio.wait_for(main(), 30)
    spans = setup.exporter.get_finished_spans()
    switch = next(s for s in spans if step(s) == "switch.execute")
    routed = {s.attributes["oserve.request_id"]: s for s in spans if step(s) == "gateway.route"}
    assert not routed["before"].links  # no strategy in force yet
    (link,) = routed["after"].links
    assert link.context.span_id == switch.context.span_id and link.context.trace_id == switch.context.trace_id
    assert link.attributes["oserve.strategy_id"] == "s7" and routed["after"].attributes["oserve.strategy_id"] == "s7"
    setup.shutdown()


def test_the_file_exporter_writes_otlp_json_lines(tmp_path) -> None:
    import json

    path = tmp_path / "traces.jsonl"
    setup = setup_tracing(TracingConfig(exporter="file", file_path=str(path), service_name="oserve-test"))
    with setup.tracer.start_as_current_span("parent"):
        with setup.tracer.start_as_current_span("child", attributes={"oserve.request_id": "q1"}):
            pass
    setup.shutdown()
    lines = path.read_text().splitlines()
    spans = [sp for line in lines for rs in json.loads(line)["resourceSpans"] for ss in rs["scopeSpans"]
             for sp in ss["spans"]]
    resource = json.loads(lines[0])["resourceSpans"][0]["resource"]["attributes"]
    assert {"key": "service.name", "value": {"stringValue": "oserve-test"}} in resource
    by_name = {sp["name"]: sp for sp in spans}
    assert by_name["child"]["parentSpanId"] == by_name["parent"]["spanId"]  # OTLP JSON: hex ids, camelCase
    assert by_name["child"]["traceId"] == by_name["parent"]["traceId"] and len(by_name["child"]["traceId"]) == 32
    assert by_name["child"]["attributes"] == [{"key": "oserve.request_id", "value": {"stringValue": "q1"}}]
    assert by_name["child"]["kind"] == 1  # SPAN_KIND_INTERNAL, an integer as OTLP/JSON requires


async def test_one_trace_per_replan_from_forecast_through_strategy_to_switch(server) -> None:
    import numpy as np

    from oserve.streams.jetstream import ensure_streams
    from oserve.traces import load_trace
    from oserve.workers.engine_host import EngineHost, EngineHostConfig
    from oserve.workers.forecaster import ForecasterConfig, ForecasterStage
    from oserve.workers.scheduler import SchedulerConfig, SchedulerWorker
    from oserve.workers.switch_planner import SwitchPlannerConfig, SwitchPlannerWorker
    from oserve.workers.system import SystemConfig, planning_inputs

    setup = setup_tracing(TracingConfig(exporter="memory"))
    tracer = setup.tracer
    inputs = planning_inputs(SystemConfig(span_s=60.0), load_trace("azure-conv").slice_time(0.0, 600.0),
                             initial_rps=np.ones(4))

    async def main() -> None:
        subjects = unique_subjects()
        nc = await nats.connect(server.url)
        kv = await ensure_streams(nc.jetstream(), subjects)
        clock = Clock(speedup=100)
        host = EngineHost(nc, EngineHostConfig(subjects=subjects, heartbeat_interval_wall_s=0.05), clock, tracer=tracer)
        switcher = SwitchPlannerWorker(nc, SwitchPlannerConfig(subjects=subjects), clock, tracer=tracer)
        forecaster = ForecasterStage(nc, ForecasterConfig(subjects=subjects, span_s=3600.0), clock, tracer=tracer)
        scheduler = SchedulerWorker(nc, kv, SchedulerConfig(subjects=subjects), clock, inputs.planner,
                                    inputs.initial_rps, tracer=tracer)
        async with host, switcher, forecaster, scheduler:
            async def switched_to(strategy_id: str) -> None:
                while switcher.strategy_id != strategy_id:
                    await asyncio.sleep(0.01)
            await asyncio.wait_for(switched_to("s0"), 10)
            for j, n in enumerate((300, 10, 10, 10)):
                forecaster.observe(j, 1.0, n)
            await forecaster.emit(0)
            await asyncio.wait_for(switched_to("s1"), 10)
        await nc.close()

    await asyncio.wait_for(main(), 30)
    spans = setup.exporter.get_finished_spans()
    forecast = next(s for s in spans if step(s) == "forecast.made")
    same = [s for s in spans if s.context.trace_id == forecast.context.trace_id]
    decide = next(s for s in same if step(s) == "scheduler.decide")
    switch = next(s for s in same if step(s) == "switch.execute")
    assert forecast.parent is None
    assert decide.parent.span_id == forecast.context.span_id
    assert switch.parent.span_id == decide.context.span_id
    assert switch.attributes["oserve.strategy_id"] == "s1"
    setup.shutdown()


def test_live_view_folds_telemetry_and_plan_events() -> None:
    from rich.console import Console

    from oserve.observability.live_view import LiveView
    from oserve.streams.schemas import (ForecastMade, ReplicaSpec, StrategyChosen, SwitchCompleted, SwitchPlanned,
                                        Telemetry, encode)
    from oserve.streams.subjects import Subjects

    s = Subjects("v")
    view = LiveView(s)
    view.apply(s.telemetry("r0"), encode(Telemetry(source_id="r0", at_s=5.0, window_s=5.0, num_requests=10,
                                                   requests_per_s=2.0, p50_e2e_s=1.0, p99_e2e_s=3.0)))
    view.apply(s.plan_event("forecast"), encode(ForecastMade(span_index=0, span_start_s=0.0, span_s=60.0,
                                                             observed_counts=[5, 1], forecast_rps=[0.1, 0.02])))
    view.apply(s.plan_event("strategy"), encode(StrategyChosen(
        strategy_id="s1", span_index=1, replicas=[ReplicaSpec(replica_id="r0", tp=2, pp=1, gpu_ids=[0, 1])],
        weights=[{"r0": 1.0}], switch_s=0.0, forecast_rps=[0.1, 0.02], label="switch")))
    view.apply(s.plan_event("switch"), encode(SwitchPlanned(strategy_id="s1", start_ids=["r0"], retire_ids=[],
                                                            switch_s=1.0)))
    view.apply(s.plan_event("switch"), encode(SwitchCompleted(strategy_id="s1", switch_wall_s=0.1)))
    view.apply(s.plan_event("switch"), b"{garbage")
    assert view.replicas["r0"].requests_per_s == 2.0 and view.serving_strategy_id == "s1"
    assert view.num_ignored == 1 and len(view.switch_log) == 1
    console = Console(record=True, width=160)
    console.print(view.render())
    text = console.export_text()
    assert "r0=TP2xPP1" in text and "serving: s1" in text


async def test_each_worker_is_a_service_and_spans_follow_the_genai_and_messaging_conventions(server) -> None:
    import numpy as np

    from oserve.traces import load_trace
    from oserve.workers.system import LiveSystem, SystemConfig, planning_inputs

    subjects = unique_subjects()
    config = SystemConfig(subjects=subjects, span_s=10.0, speedup=20.0, heartbeat_interval_wall_s=0.1,
                          forecaster="last_value", twin=False, tracing=TracingConfig(exporter="memory"))
    inputs = planning_inputs(config, load_trace("azure-conv").slice_time(0.0, 600.0), initial_rps=np.ones(4))

    async def main():
        nc = await nats.connect(server.url)
        try:
            async with LiveSystem(nc, config, inputs) as system:
                await system.wait_serving(20)
                client = OServeClient(nc, subjects, tracer=system.tracing.tracer)
                for i in range(3):
                    await client.submit(input_tokens=100, max_tokens=40, sim_output_tokens=5 + i,
                                        request_id=f"g{i}", timeout_s=10)
                while system.forecaster.num_events < 1 or len(system.scheduler.strategies) < 2:
                    await asyncio.sleep(0.02)
                return system.tracing.exporter
        finally:
            await nc.close()

    exporter = await asyncio.wait_for(main(), 60)
    spans = exporter.get_finished_spans()
    service = {step(s): s.resource.attributes["service.name"] for s in spans}
    assert service["client.submit"] == "oserve"
    assert service["gateway.route"] == "oserve-gateway" and service["engine.serve"] == "oserve-engine"
    assert service["forecast.made"] == "oserve-forecaster" and service["scheduler.decide"] == "oserve-scheduler"
    assert service["switch.execute"] == "oserve-switch-planner"
    for s in spans:
        res = s.resource.attributes
        assert res["service.namespace"] == "oserve" and res["service.version"] and res["service.instance.id"]
        assert not any("password" in k or "secret" in k for k in s.attributes)  # no secret in an attribute
    ids = {s.resource.attributes["service.name"]: s.resource.attributes["service.instance.id"] for s in spans}
    assert len(set(ids.values())) == len(ids)  # one instance per service
    # one request's trace: a messaging send, a messaging process, the GenAI inference span
    engine = next(s for s in spans if step(s) == "engine.serve" and s.attributes["oserve.request_id"] == "g2")
    same = {step(s): s for s in spans if s.context.trace_id == engine.context.trace_id}
    client, gateway = same["client.submit"], same["gateway.route"]
    submit = subjects.submit()
    assert client.name == f"publish {submit}" and gateway.name == f"process {submit}"
    assert engine.name == "text_completion llama2-7b"
    for s, op in ((client, "send"), (gateway, "process"), (engine, "process")):
        assert s.attributes["messaging.system"] == "nats" and s.attributes["messaging.operation.type"] == op
        assert s.attributes["messaging.message.id"] == "g2" and s.attributes["messaging.message.body.size"] > 0
    assert client.attributes["messaging.destination.name"] == gateway.attributes["messaging.destination.name"] == submit
    assert engine.attributes["messaging.destination.name"].startswith(f"{subjects.prefix}.")
    a = engine.attributes
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.provider.name"] == "oserve"
    assert a["gen_ai.request.model"] == "llama2-7b" and a["gen_ai.request.max_tokens"] == 40
    assert a["gen_ai.usage.input_tokens"] == 100 and a["gen_ai.usage.output_tokens"] == 7
    assert a["gen_ai.response.finish_reasons"] == ("stop",)
    assert gateway.attributes["gen_ai.request.max_tokens"] == 40
    assert client.attributes["gen_ai.usage.output_tokens"] == 7
    # the re-plan's spans are messaging spans of the plan subjects
    forecast = next(s for s in spans if step(s) == "forecast.made")
    assert forecast.name == f"publish {subjects.plan_event('forecast')}"
    assert forecast.attributes["messaging.operation.type"] == "send"
    decide = next(s for s in spans if step(s) == "scheduler.decide" and s.attributes["oserve.span_index"] >= 0)
    assert decide.name == f"process {subjects.plan_event('forecast')}"
    switch = next(s for s in spans if step(s) == "switch.execute")
    assert switch.name == f"process {subjects.plan_event('strategy')}"
    assert switch.attributes["messaging.message.id"] == switch.attributes["oserve.strategy_id"]


def test_the_otel_environment_wins_over_the_cli_defaults_and_a_flag_over_both(monkeypatch) -> None:
    from oserve.cli.live_cmds import _system_config

    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED",
                 "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_SAMPLER",
                 "OTEL_TRACES_SAMPLER_ARG", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    args = ("oserve", "llama2-7b", 8, 1.0, 60.0, "azure-conv")
    plain = _system_config(*args, "", "").tracing
    assert plain.exporter == "none" and plain.otlp_endpoint == "http://127.0.0.1:4318/v1/traces"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "shop-llm")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging,team=ml%20infra")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")
    up = _system_config(*args, "", "").tracing  # an endpoint in the environment turns the otlp exporter on
    assert up.exporter == "otlp" and up.otlp_endpoint == "http://collector:4318/v1/traces"
    assert up.service_name_for("gateway") == "shop-llm-gateway"  # several workers: the stem of each name
    one = _system_config(*args, "", "", ("gateway",)).tracing
    assert one.service_name_for("gateway") == "shop-llm"  # one worker: the name itself
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://jaeger:4318/v1/traces")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    env = _system_config(*args, "", "").tracing
    assert env.exporter == "console" and env.otlp_endpoint == "http://jaeger:4318/v1/traces"
    assert env.sampler == "parentbased_traceidratio" and env.sampler_ratio == 0.25
    flags = _system_config(*args, "otlp", "http://elsewhere:4318/v1/traces").tracing
    assert flags.exporter == "otlp" and flags.otlp_endpoint == "http://elsewhere:4318/v1/traces"
    # what the exporter and the resources get
    setup = setup_tracing(flags)
    try:
        assert setup.exporter._endpoint == "http://elsewhere:4318/v1/traces"
        setup.tracer_for("scheduler")
        res = setup.providers["shop-llm-scheduler"].resource.attributes
        assert res["service.name"] == "shop-llm-scheduler" and res["service.namespace"] == "oserve"
        assert res["deployment.environment"] == "staging" and res["team"] == "ml infra"
        assert "traceidratio" in setup.provider.sampler.get_description().lower()
    finally:
        setup.shutdown()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert _system_config(*args, "", "").tracing.exporter == "none"
    monkeypatch.setenv("OTEL_SDK_DISABLED", "false")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        _system_config(*args, "", "")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert _system_config(*args, "", "").tracing.exporter == "otlp"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")  # refused, not sent to the wrong port
    with pytest.raises(ValueError, match="http/protobuf"):
        _system_config(*args, "", "")
