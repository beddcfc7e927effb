"""The OpenAI-compatible HTTP front and token streaming on the bus, against a real nats-server.

The front is driven with the official `openai` client; the bus parts (chunk schema, the client's `stream()`,
the sim backend's token counts) are tested on their own too.
"""

from __future__ import annotations

import json
import math
from contextlib import AsyncExitStack, aclosing
from pathlib import Path

try:  # the openai client's HTTP library: httpx2 from openai 3, httpx before
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx  # type: ignore[no-redef]
import nats
import openai
import pytest

from oserve.streams import schemas as sc
from oserve.streams.client import NoGateway, OServeClient, RequestRejected
from oserve.streams.testing import running_server, unique_subjects, wait_until
from oserve.workers.backends import Job, SimBackend, placeholder_text
from oserve.workers.clock import Clock
from oserve.workers.engine import EngineWorker, EngineWorkerConfig
from oserve.workers.gateway import Gateway, GatewayConfig
from oserve.workers.http_front import HTTPFrontConfig, OpenAIFront, chat_prompt, ChatMessage

GOLDEN = Path(__file__).parent / "data" / "bus"
MODEL = "llama2-7b"


@pytest.fixture(scope="module")
def server():
    yield from running_server()


async def start(stack: AsyncExitStack, url: str, backend: str = "echo", speedup: float = 200.0,
                front: bool = True, stream_interval_s: float = 0.02):
    """A gateway, one engine and (with `front`) the HTTP front on a free port, all on one connection."""
    subjects = unique_subjects("h")
    nc = await nats.connect(url)
    stack.push_async_callback(nc.close)
    clock = Clock(speedup=speedup)
    await stack.enter_async_context(EngineWorker(nc, EngineWorkerConfig(
        "r0", subjects=subjects, backend=backend, heartbeat_interval_wall_s=0.05,  # type: ignore[arg-type]
        stream_interval_s=stream_interval_s), clock))
    gw = await stack.enter_async_context(Gateway(nc, GatewayConfig(subjects=subjects, no_replica_wait_wall_s=0),
                                                 clock))
    await gw.wait_for_replicas(1, 5.0)
    client = OServeClient(nc, subjects, default_timeout_s=10.0)
    http = None
    if front:
        http = await stack.enter_async_context(OpenAIFront(nc, HTTPFrontConfig(
            model_name=MODEL, subjects=subjects, port=0, request_timeout_s=10.0)))
    return nc, subjects, client, http


def openai_client(front: OpenAIFront) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=front.url, api_key="x", max_retries=0, timeout=20.0)


# --- the bus: schemas, the sim backend's tokens, the client's stream ------------------------------------


def test_chunk_and_streaming_fields_round_trip_and_validate() -> None:
    chunk = sc.ReplyChunk(request_id="q", replica_id="r0", index=0, offset_tokens=0, num_tokens=3, text="a b c")
    assert sc.decode(sc.encode(chunk), sc.ReplyChunk) == chunk
    assert isinstance(sc.decode_reply(sc.encode(chunk)), sc.ReplyChunk)
    old = sc.decode(b'{"type":"dispatch.v1","request_id":"q","input_tokens":1,"max_tokens":2,"type_index":0,'
                    b'"gateway_id":"g"}', sc.Dispatch)
    assert isinstance(old, sc.Dispatch) and not old.stream and old.temperature is None and old.stop == []
    ok = sc.decode_submit(json.dumps({"type": "submit.v1", "request_id": "q", "prompt": "hi", "stream": True,
                                      "temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": ["\n"]}).encode())
    assert isinstance(ok, sc.SubmitRequest) and ok.stream and ok.stop == ["\n"]
    for bad in ({"temperature": 2.5}, {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5},
                {"stop": ["a", "b", "c", "d", "e"]}, {"stop": [""]}, {"seed": 1 << 64}):
        raw = json.dumps({"type": "submit.v1", "request_id": "q", "input_tokens": 3, **bad}).encode()
        with pytest.raises(sc.SchemaError) as info:
            sc.decode_submit(raw)
        assert info.value.code == sc.ErrorCode.INVALID, bad


def test_golden_streaming_messages_decode() -> None:
    chunk = sc.decode((GOLDEN / "reply_chunk.v1.json").read_bytes(), sc.ReplyChunk)
    assert isinstance(chunk, sc.ReplyChunk) and chunk.num_tokens == 4
    sub = sc.decode_submit((GOLDEN / "submit.v1.stream.json").read_bytes())
    assert isinstance(sub, sc.SubmitRequest) and sub.stream and sub.seed == 7
    d = sc.decode((GOLDEN / "dispatch.v1.stream.json").read_bytes(), sc.Dispatch)
    assert isinstance(d, sc.Dispatch) and d.stream and d.top_p == 0.95


def test_placeholder_text_is_deterministic_and_splits_exactly() -> None:
    whole = placeholder_text(0, 50)
    assert whole == placeholder_text(0, 50) and whole.startswith("This is placeholder text")
    assert placeholder_text(0, 17) + placeholder_text(17, 50) == whole
    assert placeholder_text(5, 5) == "" and placeholder_text(10**7, 10**7 + 5) == ""


def test_sim_backend_counts_tokens_as_the_replica_produces_them() -> None:
    """Between step ends the count grows with the decode steps done, never past the answer, never down."""
    backend = SimBackend("r0")
    job = Job(1, "q", 200, 64, 0, 0.0, 0, stream=True)
    assert backend.add(job, 0.0) == []
    counts, now, finished = [], 0.0, []
    while not finished:
        t = backend.next_event_s()
        assert t is not None
        for frac in (0.25, 0.5, 0.75):  # reads inside the run in progress change nothing
            counts.append(backend.generated_tokens(1, now + (t - now) * frac))
        finished = backend.advance(t)
        now = t
        if not finished:
            counts.append(backend.generated_tokens(1, now))
    assert counts == sorted(counts) and counts[-1] <= 64 and finished[0].output_tokens == 64
    assert len(set(counts)) > 3  # the count moves inside decode runs, not only at the end
    assert backend.generated_tokens(1, now) == 0  # finished: no longer held


async def test_client_stream_yields_chunks_then_the_reply(server) -> None:
    async with AsyncExitStack() as stack:
        _, _, client, _ = await start(stack, server.url, backend="sim", speedup=20.0, front=False)
        parts = [p async for p in client.stream(prompt="x" * 400, max_tokens=40, timeout_s=10, temperature=0.5,
                                                seed=1, stop=["."])]
        *chunks, reply = parts
        assert isinstance(reply, sc.Reply) and reply.output_tokens == 40 and reply.input_tokens == 100
        assert len(chunks) >= 2 and all(isinstance(c, sc.ReplyChunk) for c in chunks)
        assert "".join(c.text for c in chunks) == reply.text == placeholder_text(0, 40)
        assert sum(c.num_tokens for c in chunks) == 40
        assert [c.offset_tokens for c in chunks] == sorted(c.offset_tokens for c in chunks)
        # a non-streamed request still gets one reply, with the same text
        again = await client.submit(prompt="x" * 400, max_tokens=40, timeout_s=10)
        assert again.text == reply.text
        # a prompt given as a token count gets counts only (Dispatch.detokenize), streamed or not
        counted = await client.submit(input_tokens=100, max_tokens=40, timeout_s=10)
        assert counted.output_tokens == 40 and counted.text == ""
        *counted_chunks, counted_reply = [p async for p in client.stream(input_tokens=100, max_tokens=40, timeout_s=10)]
        assert counted_reply.text == "" and sum(c.num_tokens for c in counted_chunks) == 40
        with pytest.raises(RequestRejected) as info:
            async with aclosing(client.stream(input_tokens=10, max_tokens=10**7)) as parts_:
                async for _ in parts_:
                    pass
        assert info.value.code == sc.ErrorCode.INVALID


async def test_client_stream_without_a_gateway_raises_no_gateway(server) -> None:
    nc = await nats.connect(server.url)
    try:
        client = OServeClient(nc, unique_subjects("h"))
        with pytest.raises(NoGateway):
            async for _ in client.stream(prompt="hi", max_tokens=4, timeout_s=2):
                pass
    finally:
        await nc.close()


# --- the HTTP front through the openai client -------------------------------------------------------------


async def test_completions_and_chat_without_streaming(server) -> None:
    async with AsyncExitStack() as stack:
        _, _, _, front = await start(stack, server.url)
        oa = openai_client(front)
        c = await oa.completions.create(model=MODEL, prompt="Say hello", max_tokens=12, temperature=0.2, seed=5)
        assert c.object == "text_completion" and c.model == MODEL and c.id.startswith("cmpl-")
        assert c.choices[0].text == placeholder_text(0, 12) and c.choices[0].finish_reason == "length"
        assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (3, 12, 15)
        chat = await oa.chat.completions.create(model=MODEL, max_tokens=20, extra_body={"sim_output_tokens": 7},
                                                messages=[{"role": "system", "content": "Be brief."},
                                                          {"role": "user", "content": "Hi!"}])
        msg = chat.choices[0]
        assert chat.object == "chat.completion" and msg.message.role == "assistant"
        assert msg.message.content == placeholder_text(0, 7) and msg.finish_reason == "stop"
        prompt = chat_prompt([ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi!")])
        assert prompt == "system: Be brief.\nuser: Hi!\nassistant:"
        assert chat.usage.prompt_tokens == math.ceil(len(prompt.encode()) / sc.BYTES_PER_TOKEN)
        assert chat.usage.completion_tokens == 7


async def test_streaming_completions_and_chat(server) -> None:
    async with AsyncExitStack() as stack:
        _, _, _, front = await start(stack, server.url, backend="sim", speedup=20.0)
        oa = openai_client(front)
        chunks = [c async for c in await oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=48, stream=True,
            stream_options={"include_usage": True})]
        texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert len(texts) >= 2  # tokens arrived in several chunks before the last one
        assert "".join(texts) == placeholder_text(0, 48)
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finals == ["length"] and chunks[0].choices[0].delta.role == "assistant"
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 48 and usage.total_tokens == usage.prompt_tokens + 48
        parts = [c async for c in await oa.completions.create(model=MODEL, prompt="Once", max_tokens=30, stream=True,
                                                              extra_body={"sim_output_tokens": 20})]
        assert "".join(p.choices[0].text for p in parts) == placeholder_text(0, 20)
        assert parts[-1].choices[0].finish_reason == "stop" and len(parts) >= 3


async def test_models_and_health(server) -> None:
    async with AsyncExitStack() as stack:
        _, _, _, front = await start(stack, server.url)
        oa = openai_client(front)
        models = await oa.models.list()
        assert [m.id for m in models.data] == [MODEL]
        assert (await oa.models.retrieve(MODEL)).id == MODEL
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.get(f"http://127.0.0.1:{front.port}/health")
            assert r.status_code == 200 and r.json()["num_replicas"] == 1


async def test_health_is_503_without_a_gateway(server) -> None:
    nc = await nats.connect(server.url)
    try:
        async with OpenAIFront(nc, HTTPFrontConfig(subjects=unique_subjects("h"), port=0, health_timeout_s=0.5)) as front:
            async with httpx.AsyncClient(timeout=10) as http:
                r = await http.get(f"http://127.0.0.1:{front.port}/health")
            assert r.status_code == 503 and set(r.json()["error"]) == {"message", "type", "param", "code"}
            with pytest.raises(openai.InternalServerError) as info:  # 503: no gateway on the bus
                await openai_client(front).completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert info.value.status_code == 503
    finally:
        await nc.close()


async def test_errors_come_in_openai_shape(server) -> None:
    async with AsyncExitStack() as stack:
        _, _, _, front = await start(stack, server.url)
        oa = openai_client(front)
        with pytest.raises(openai.NotFoundError) as nf:
            await oa.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
        assert nf.value.code == "model_not_found" and nf.value.body["param"] == "model"
        with pytest.raises(openai.BadRequestError) as bad:
            await oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
        assert bad.value.body["param"] == "n" and "n > 1" in bad.value.body["message"]
        with pytest.raises(openai.BadRequestError):
            await oa.completions.create(model=MODEL, prompt="hi", temperature=3.0)
        with pytest.raises(openai.BadRequestError) as unknown:
            await oa.completions.create(model=MODEL, prompt="hi", extra_body={"frobnicate": 1})
        assert unknown.value.body["param"] == "frobnicate"
        with pytest.raises(openai.BadRequestError) as long_:
            await oa.completions.create(model=MODEL, prompt="x" * (sc.MAX_MESSAGE_BYTES + 10), max_tokens=2)
        assert long_.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError) as ctx:  # the gateway's context-window rule
            await oa.completions.create(model=MODEL, prompt="hi", max_tokens=10**6)
        assert ctx.value.code == sc.ErrorCode.INVALID
        with pytest.raises(openai.BadRequestError) as in_stream:  # refused before the stream starts: a 400
            await oa.completions.create(model=MODEL, prompt="hi", max_tokens=10**6, stream=True)
        assert in_stream.value.status_code == 400
        async with httpx.AsyncClient(timeout=10) as http:
            base = f"http://127.0.0.1:{front.port}"
            for body in (b"{not json", b"[1, 2]", json.dumps({"model": MODEL}).encode()):
                r = await http.post(f"{base}/v1/completions", content=body,
                                    headers={"content-type": "application/json"})
                assert r.status_code == 400, body
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
            r = await http.get(f"{base}/v1/nothing")
            assert r.status_code == 404 and "error" in r.json()


# --- the front's own span and metrics ---------------------------------------------------------------------


async def test_the_front_traces_each_call_into_the_bus_and_counts_it(server) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from oserve.observability.metrics import Metrics
    from oserve.observability.tracing import TracingConfig, setup_tracing

    setup = setup_tracing(TracingConfig(exporter="memory"))
    metrics = Metrics(CollectorRegistry())
    async with AsyncExitStack() as stack:
        nc, subjects, _, _ = await start(stack, server.url, front=False)
        front = await stack.enter_async_context(OpenAIFront(nc, HTTPFrontConfig(
            model_name=MODEL, subjects=subjects, port=0, request_timeout_s=10.0),
            tracer=setup.tracer_for("http"), metrics=metrics))
        api = openai_client(front)
        await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        stream = await api.completions.create(model=MODEL, prompt="hello", max_tokens=4, stream=True)
        async for _ in stream:
            pass
        with pytest.raises(openai.NotFoundError):
            await api.completions.create(model="gpt-4", prompt="x")
        await api.close()
    spans = setup.exporter.get_finished_spans()
    served = [s for s in spans if s.attributes.get("oserve.step") == "http.serve"]
    assert sorted(s.name for s in served) == ["POST /v1/chat/completions", "POST /v1/completions",
                                              "POST /v1/completions"]
    assert {s.resource.attributes["service.name"] for s in served} == {"oserve-http"}
    chat = next(s for s in served if s.name.endswith("chat/completions"))
    assert chat.attributes["gen_ai.operation.name"] == "chat" and chat.attributes["gen_ai.request.model"] == MODEL
    assert chat.attributes["gen_ai.usage.output_tokens"] == 5 and chat.attributes["gen_ai.request.max_tokens"] == 5
    assert chat.attributes["http.response.status_code"] == 200
    assert list(chat.attributes["gen_ai.response.finish_reasons"]) == ["length"]
    # the front's publish is the HTTP span's child: one trace from HTTP to the bus
    children = [s for s in spans if s.parent is not None and s.parent.span_id == chat.context.span_id]
    assert children and all(c.name == f"publish {subjects.submit()}" for c in children)
    missing = next(s for s in served if s.attributes["http.response.status_code"] == 404)
    assert missing.attributes["error.type"] == "model_not_found" and not missing.status.is_ok
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    counts = {(s.labels["endpoint"], s.labels["status"]): s.value for s in families["oserve_http_requests"].samples
              if s.name == "oserve_http_requests_total"}
    assert counts == {("/v1/chat/completions", "200"): 1, ("/v1/completions", "200"): 1, ("/v1/completions", "404"): 1}
    durations = [s for s in families["oserve_http_request_duration_seconds"].samples if s.name.endswith("_count")]
    assert sum(s.value for s in durations) == 3
    setup.shutdown()


# --- cancellation, re-dispatched streams, authentication ----------------------------------------------


def test_the_sim_backend_frees_a_cancelled_request_mid_run() -> None:
    """A cancel cuts the decode run and the request leaves the replica at the next step end with its KV; a
    waiting one leaves at once; the other request still finishes whole."""
    backend = SimBackend("r0")
    rep = backend.replica
    backend.add(Job(1, "a", 200, 4000, 0, 0.0, 0, stream=True), 0.0)
    backend.add(Job(2, "b", 200, 300, 0, 0.0, 0), 0.0)
    now, t = 0.0, backend.next_event_s()
    while t is not None and t - now < 0.5:  # prefill steps, until both decode in one long run
        assert backend.advance(t) == []
        now, t = t, backend.next_event_s()
    assert t is not None
    middle = (now + t) / 2
    assert backend.generated_tokens(1, middle) > 50
    assert backend.cancel(1, middle) == []
    assert backend.generated_tokens(1, middle) == 0  # no longer held
    t = backend.next_event_s()
    assert t is not None and t - middle < 0.1  # the run was cut at the step in progress
    finished = backend.advance(t)
    # what is left in use is the other request's (its whole context at most)
    assert finished == [] and rep.num_requests == 1
    assert rep.total_blocks - rep.free_blocks <= -(-(200 + 300) // rep.block_tokens)
    while not finished:
        t = backend.next_event_s()
        assert t is not None
        finished = backend.advance(t)
    assert [(f.seq, f.output_tokens) for f in finished] == [(2, 300)] and rep.num_requests == 0
    assert rep.free_blocks == rep.total_blocks  # nothing of the cancelled request is left behind
    # a request cancelled while it waits leaves at once; the echo backend has nothing to cancel
    backend.add(Job(3, "c", 200, 10, 0, t, 0), t)
    backend.add(Job(4, "d", 200, 10, 0, t, 0), t)
    if rep.waiting:
        backend.cancel(4, t)
        assert not rep.waiting
    from oserve.workers.backends import EchoBackend
    assert EchoBackend().cancel(1, 0.0) == []


def test_the_client_splices_overlapping_chunks_by_their_offsets() -> None:
    from oserve.streams.client import new_part

    text = placeholder_text(0, 10)

    def chunk(start: int, stop: int, chars: int | None = -1) -> sc.ReplyChunk:
        return sc.ReplyChunk(request_id="q", replica_id="r1", index=0, offset_tokens=start, num_tokens=stop - start,
                             text=placeholder_text(start, stop),
                             offset_chars=len(placeholder_text(0, start)) if chars == -1 else chars)

    exact = chunk(10, 14)
    assert new_part(exact, 10, text) is exact
    part = new_part(chunk(7, 14), 10, text)  # overlaps: only tokens 10..13 are new
    assert part is not None and (part.offset_tokens, part.num_tokens) == (10, 4)
    assert text + part.text == placeholder_text(0, 14) and part.offset_chars == len(text)
    assert new_part(chunk(3, 9), 10, text) is None  # all of it given already
    assert new_part(chunk(11, 14), 10, text) is None  # a gap before it
    assert new_part(chunk(7, 14, chars=None), 10, text) is None  # an older producer: no offset to slice at
    assert new_part(chunk(7, 14, chars=3), 10, text) is None  # its text disagrees with what was given


async def test_a_client_that_disconnects_mid_stream_stops_the_engine(server) -> None:
    """The HTTP client goes away after a few chunks: the request is cancelled on the bus, the engine frees it
    and sends nothing more, the gateway forgets it, the abort is counted and the call recorded as a 499."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from oserve.observability.metrics import Metrics
    from oserve.observability.tracing import TracingConfig, setup_tracing
    from oserve.workers.gateway import Gateway

    setup = setup_tracing(TracingConfig(exporter="memory"))
    metrics = Metrics(CollectorRegistry())
    async with AsyncExitStack() as stack:
        subjects = unique_subjects("hc")
        nc = await nats.connect(server.url)
        stack.push_async_callback(nc.close)
        tap = await nats.connect(server.url)  # sees every inbox, as a test may
        stack.push_async_callback(tap.close)
        clock = Clock(speedup=5.0)
        engine = await stack.enter_async_context(EngineWorker(nc, EngineWorkerConfig(
            "r0", subjects=subjects, heartbeat_interval_wall_s=0.05, stream_interval_s=0.02), clock, metrics=metrics))
        gw = await stack.enter_async_context(Gateway(nc, GatewayConfig(subjects=subjects), clock))
        await gw.wait_for_replicas(1, 5.0)
        front = await stack.enter_async_context(OpenAIFront(nc, HTTPFrontConfig(
            model_name=MODEL, subjects=subjects, port=0, request_timeout_s=30.0),
            tracer=setup.tracer_for("http"), metrics=metrics))
        seen: list[tuple[str, object]] = []  # (kind, message) to any inbox, in arrival order

        async def on_inbox(msg) -> None:
            seen.append(("inbox", sc.decode_reply(msg.data)))

        async def on_dispatch(msg) -> None:
            seen.append(("engine", sc.decode(msg.data, sc.Dispatch | sc.AbortRequest)))

        await tap.subscribe("_INBOX.>", cb=on_inbox)
        await tap.subscribe(subjects.replica("r0"), cb=on_dispatch)
        await tap.flush()
        max_tokens = 4000  # tens of wall seconds of decoding at this speed
        async with httpx.AsyncClient(timeout=20.0) as http:
            async with http.stream("POST", f"{front.url}/completions", json={
                    "model": MODEL, "prompt": "hello", "max_tokens": max_tokens, "stream": True}) as resp:
                assert resp.status_code == 200
                lines = 0
                async for line in resp.aiter_lines():
                    lines += line.startswith("data: ")
                    if lines >= 3:
                        break  # the client goes away mid-stream
        started = asyncio.get_running_loop().time()
        await wait_until(lambda: engine.num_inflight == 0, 5, "the engine to drop the cancelled request")
        await wait_until(lambda: engine.backend.replica.num_requests == 0, 5, "the replica to free it")
        assert asyncio.get_running_loop().time() - started < 5
        assert not gw.pending and gw.num_cancelled == 1 and engine.num_cancelled == 1
        # a later request's whole answer comes after any chunk the cancelled one could still have sent
        client = OServeClient(nc, subjects, default_timeout_s=10.0)
        assert (await client.submit(prompt="later", max_tokens=20)).output_tokens == 20
        await tap.flush()
        chunks = [m for k, m in seen if isinstance(m, sc.ReplyChunk)]
        rid = chunks[0].request_id
        cancelled = next(i for i, (k, m) in enumerate(seen) if isinstance(m, sc.ErrorReply) and m.request_id == rid)
        assert seen[cancelled][1].code == sc.ErrorCode.CANCELLED
        aborts = [i for i, (k, m) in enumerate(seen) if isinstance(m, sc.AbortRequest)]
        assert len(aborts) == 1 and aborts[0] < cancelled
        assert not [m for _, m in seen[cancelled:] if isinstance(m, sc.ReplyChunk) and m.request_id == rid]
        assert sum(c.num_tokens for c in chunks if c.request_id == rid) < max_tokens / 4
        aborted = metrics.request_success.labels(MODEL, "r0", "abort")._value.get()
        assert aborted == 1
        closed = metrics.http_requests.labels("/v1/completions", "499")._value.get()
        assert closed == 1
    spans = [s for s in setup.exporter.get_finished_spans() if s.attributes.get("oserve.step") == "http.serve"]
    assert len(spans) == 1 and spans[0].attributes["http.response.status_code"] == 499
    assert spans[0].attributes["error.type"] == "client_closed" and not spans[0].status.is_ok
    setup.shutdown()


async def test_the_front_wants_an_api_key_when_given_some(server) -> None:
    async with AsyncExitStack() as stack:
        nc, subjects, _, _ = await start(stack, server.url, front=False)
        front = await stack.enter_async_context(OpenAIFront(nc, HTTPFrontConfig(
            model_name=MODEL, subjects=subjects, port=0, request_timeout_s=10.0, api_keys=("sk-one", "sk-two"))))
        assert "sk-one" not in repr(front.config)
        for key in ("wrong", "sk-one-and-more"):
            api = openai.AsyncOpenAI(base_url=front.url, api_key=key, max_retries=0, timeout=20.0)
            with pytest.raises(openai.AuthenticationError) as info:
                await api.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                await api.models.list()
            await api.close()
        api = openai.AsyncOpenAI(base_url=front.url, api_key="sk-two", max_retries=0, timeout=20.0)
        done = await api.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert done.usage is not None and done.usage.completion_tokens == 2
        assert [m.id async for m in api.models.list()] == [MODEL]
        await api.close()
        async with httpx.AsyncClient(timeout=10.0) as http:
            assert (await http.get(front.url.removesuffix("/v1") + "/health")).status_code == 200  # stays open
            bare = await http.post(f"{front.url}/completions", json={"model": MODEL, "prompt": "x"})
            assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(Exception, match="api_keys"):
        HTTPFrontConfig(api_keys=("",))
