"""Simulated engine: exact single-request timing, KV accounting, conservation, agreement with capacity."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oserve.capacity import CapacityTable, FixedLengths
from oserve.perfmodel import Batch, PerfModel
from oserve.engine_model import SimReplica, SimRequest, TokenHistogram
from oserve.specs import GPUS, EngineConfig, ReplicaShape, kv_capacity_tokens, model_preset

H100 = GPUS["h100-80gb"]
LLAMA = model_preset("llama2-70b")
PERF = PerfModel(LLAMA, H100)


def _replica(shape=ReplicaShape(4), kv_tokens=None, engine=EngineConfig(), block=16):
    kv = kv_capacity_tokens(LLAMA, H100, shape) if kv_tokens is None else kv_tokens
    return SimReplica("r0", shape, PERF.timer(shape), engine, kv, block)


def _used_blocks(rep: SimReplica) -> int:
    """Blocks held: prompts' explicit blocks, plus each decoding request's context, counting the
    token of the step in flight (its block is reserved when the step starts)."""
    used = sum(r.blocks for r in rep.prefilling)
    in_flight = 1 if rep.busy and rep._run_n_dec else 0
    used += sum(-(-(r.offset + rep.step_index + in_flight) // rep.block_tokens) for r in rep._dec.values())
    return used


def _drain(rep: SimReplica, start_s: float = 0.0, check=None) -> list[SimRequest]:
    end = rep.wake(start_s)
    done = []
    while end is not None:
        out = rep.on_step_end(end)
        done.extend(out.finished)
        if check:
            check(rep)
        end = out.next_end_s
    return done


@pytest.mark.parametrize("inp, out", [(1, 1), (100, 1), (512, 40), (3000, 500), (9000, 3)])
def test_one_request_takes_prefill_plus_decode_time(inp, out):
    rep = _replica()
    req = SimRequest(0, 0, 0.0, inp, out)
    rep.add_waiting(req)
    _drain(rep)
    timer = PERF.timer(ReplicaShape(4))
    budget = EngineConfig().max_num_batched_tokens
    expected, done = 0.0, 0
    while done < inp:  # chunked prefill
        chunk = min(budget, inp - done)
        expected += timer.iteration_seconds(Batch.of([(chunk, done)], finishing_prefills=int(done + chunk >= inp)))
        done += chunk
    ttft = expected
    for i in range(1, out):
        expected += timer.iteration_seconds(Batch.of(decode_contexts=[inp + i - 1]))
    assert req.first_token_s == pytest.approx(ttft, rel=1e-12)
    assert req.finish_s == pytest.approx(expected, rel=1e-9)
    assert req.generated == out


@settings(max_examples=25)
@given(lengths=st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 600)), min_size=1, max_size=120),
       kv_blocks=st.integers(200, 1200), max_seqs=st.integers(1, 64), chunked=st.booleans(),
       gaps=st.lists(st.floats(0, 2.0), min_size=120, max_size=120))
def test_conservation_and_kv_never_over_allocated(lengths, kv_blocks, max_seqs, chunked, gaps):
    engine = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max(4096, max_seqs), chunked_prefill=chunked)
    rep = _replica(kv_tokens=kv_blocks * 16, engine=engine)

    def check(r: SimReplica) -> None:
        assert r.free_blocks >= 0
        assert r.free_blocks + _used_blocks(r) == r.total_blocks
        assert r.num_running <= engine.max_num_seqs

    reqs, t, pending = [], 0.0, []
    end = None
    finished = []
    for i, ((inp, out), gap) in enumerate(zip(lengths, gaps)):
        t += gap
        # deliver the steps that end before this arrival
        while end is not None and end <= t:
            o = rep.on_step_end(end)
            finished.extend(o.finished)
            check(rep)
            end = o.next_end_s
        req = SimRequest(i, 0, t, inp, out)
        reqs.append(req)
        new_end = rep.enqueue(req, t)
        if new_end is not None:
            end = new_end
    while end is not None:
        o = rep.on_step_end(end)
        finished.extend(o.finished)
        check(rep)
        end = o.next_end_s
    ids = [r.request_id for r in finished] + [r.request_id for r in rep.rejected]
    assert sorted(ids) == list(range(len(reqs)))  # every request ends exactly once
    for r in finished:
        assert r.generated == r.output_tokens and r.finish_s >= r.first_token_s >= r.arrival_s
    for r in rep.rejected:  # only a request that can never fit the whole cache is rejected
        assert -(-(r.input_tokens + r.output_tokens) // 16) > kv_blocks
    assert rep.free_blocks == rep.total_blocks


def test_preemption_happens_under_kv_pressure_and_loses_nothing():
    rep = _replica(kv_tokens=4000)
    for i in range(40):
        rep.add_waiting(SimRequest(i, 0, 0.0, 200, 400))
    done = _drain(rep)
    assert len(done) == 40
    assert sum(r.num_preemptions for r in done) > 0
    # A request's token gaps add up to its first-to-last-token time, preemptions included: the gap a
    # preemption causes is counted from the last token before it, not from the first token.
    hist = rep.tbt
    total_gaps = sum(c * hist.MIN_S * math.exp((b + 0.5) * hist.LOG_BASE) for b, c in hist.counts.items())
    assert hist.total == sum(r.output_tokens - 1 for r in done)
    assert total_gaps == pytest.approx(sum(r.finish_s - r.first_token_s for r in done), rel=0.01)


def test_decode_runs_are_skipped():
    rep = _replica()
    for i in range(8):
        rep.add_waiting(SimRequest(i, 0, 0.0, 100, 1000))
    _drain(rep)
    assert rep.num_steps >= 1000
    # one event per run, not per step: the number of step-end calls is far below the steps
    rep2 = _replica()
    for i in range(8):
        rep2.add_waiting(SimRequest(i, 0, 0.0, 100, 1000))
    end, calls = rep2.wake(0.0), 0
    while end is not None:
        end = rep2.on_step_end(end).next_end_s
        calls += 1
    assert calls < 20


def test_saturation_throughput_agrees_with_capacity_table():
    """The capacity model and the simulator are two views of one engine: within 25% at saturation."""
    types = FixedLengths(("short", "long"), ((400,) * 4, (1100,) * 4), ((90,) * 4, (400,) * 4))
    table = CapacityTable(LLAMA, H100, types)
    for shape in (ReplicaShape(4), ReplicaShape(2, 2)):
        for j, (inp, out) in enumerate(((400, 90), (1100, 400))):
            rep = _replica(shape)
            for i in range(3000):
                rep.add_waiting(SimRequest(i, j, 0.0, inp, out))
            done = _drain(rep)
            rate = len(done) / max(r.finish_s for r in done)
            assert rate == pytest.approx(table.rate(shape, j), rel=0.25)


def test_token_histogram_quantiles():
    h = TokenHistogram()
    values = np.linspace(0.01, 1.0, 1000)
    for v in values:
        h.add(float(v))
    for q in (0.5, 0.9, 0.99):
        assert h.quantile(q) == pytest.approx(float(np.quantile(values, q)), rel=0.01)
    h2 = TokenHistogram()
    h2.add_linear(0.02, 0.001, 100, 3)
    assert h2.total == 300 and math.isfinite(h2.quantile(0.99))


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 300), st.integers(2, 200)), min_size=1, max_size=12),
       steps=st.integers(0, 40), k=st.integers(1, 70), block=st.sampled_from([1, 4, 16]))
def test_block_crossings_count_every_decoding_request_that_needs_a_new_block(lengths, steps, k, block) -> None:
    """Reference: for each decoding request, count the steps t in [s, s + k) at which its context reaches a
    whole number of blocks (the step that writes its next token needs a fresh block)."""
    rep = _replica(kv_tokens=1_000_000, block=block)
    for i, (inp, out) in enumerate(lengths):
        rep.enqueue(SimRequest(i, 0, 0.0, inp, out), 0.0)
    end = rep.wake(0.0)
    for _ in range(steps):
        if end is None:
            break
        end = rep.on_step_end(end).next_end_s
    if rep.busy:
        rep.cut(rep._run_start_s)  # stop between steps
        rep.on_step_end(rep.step_end_s, start_next=False)
    s = rep.step_index
    reference = sum(1 for r in rep._dec.values() for t in range(s, s + k) if (r.offset + t) % block == 0)
    assert rep._crossings(k) == reference


def _saturation(model, shape, inp: int, out: int, engine: EngineConfig, n: int = 300):
    """(completion rate, preemptions) of a replica given `n` identical requests at once."""
    perf = PerfModel(model, H100)
    rep = SimReplica("r0", shape, perf.timer(shape), engine, kv_capacity_tokens(model, H100, shape), 16)
    for i in range(n):
        rep.add_waiting(SimRequest(i, 0, 0.0, inp, out))
    done = _drain(rep)
    return len(done) / max(r.finish_s for r in done), sum(r.num_preemptions for r in done)


@pytest.mark.parametrize("model_name, shape, inp, out", [
    ("llama3.1-70b", ReplicaShape(8), 16000, 300),
    ("llama3.1-70b", ReplicaShape(8), 60000, 500),
    ("llama3.1-70b", ReplicaShape(4, 2), 30000, 400),
    ("qwen2.5-72b", ReplicaShape(8), 20000, 800),
    ("llama3.1-8b", ReplicaShape(1), 50000, 400),
])
def test_long_context_capacity_agrees_with_the_engine(model_name, shape, inp, out):
    """Long prompts: the capacity table and the simulated engine agree within 25% at saturation, and the
    engine does not thrash (admitting only whole prompts). Admitting a chunk at a time, as vLLM's V1
    scheduler does, it preempts and recomputes long prompts in a loop and serves far less."""
    model = model_preset(model_name)
    table = CapacityTable(model, H100, FixedLengths(("long",), ((inp,),), ((out,),)))
    rate, preemptions = _saturation(model, shape, inp, out, EngineConfig())
    assert rate == pytest.approx(table.rate(shape, 0), rel=0.25)
    assert preemptions <= 0.05 * 300
    if inp >= 50000:
        chunked_rate, chunked_preemptions = _saturation(model, shape, inp, out, EngineConfig(admit_whole_prompt=False))
        assert chunked_preemptions > 300 and chunked_rate < 0.7 * rate
