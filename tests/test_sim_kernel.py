"""The simulator's kernel: conservation through switches, what it shows a policy, the context window."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from oserve.decision import Decision
from oserve.evaluation.scenarios import scale_volume
from oserve.routing import least_loaded
from oserve.sim.kernel import ArrivalInfo, CompletionInfo, SimConfig, SpanView, simulate
from oserve.specs import GPUS, Deployment, Replica, ReplicaShape, cluster_for_gpus, model_preset
from oserve.traces import Trace, context_rule, load_trace

H100 = GPUS["h100-80gb"]
LLAMA = model_preset("llama2-70b")


@pytest.fixture(scope="module")
def conv() -> Trace:
    return load_trace("azure-conv").slice_time(0.0, 600.0)


class Scripted:
    """Switches between given deployments every span; records what it is shown."""

    name = "scripted"

    def __init__(self, decisions):
        self.decisions = decisions
        self.views: list[SpanView] = []
        self.arrivals: list[ArrivalInfo] = []
        self.current = None

    def decide(self, view):
        self.views.append(view)
        self.current = self.decisions[view.span_index % len(self.decisions)]
        return self.current

    def classify(self, arrival):
        self.arrivals.append(arrival)
        return arrival.request_index % 4

    def route(self, class_index, loads):
        return least_loaded(loads, self.current.eligible(class_index))


def _even(dep: Deployment, k: int = 4):
    return tuple((1.0,) * len(dep.replicas) for _ in range(k))


def _tp(tp: int, n: int, prefix: str) -> Deployment:
    return Deployment(tuple(Replica(f"{prefix}{i}", ReplicaShape(tp), tuple(range(tp * i, tp * i + tp)))
                            for i in range(n)))


def test_every_request_finishes_once_through_switches(conv):
    cluster = cluster_for_gpus(16)
    a, b = _tp(4, 4, "a"), _tp(8, 2, "b")
    policy = Scripted([Decision(a, _even(a), 5.0), Decision(b, _even(b), 5.0)])
    trace = scale_volume(conv, 4.0, np.random.default_rng(1))
    res = simulate(LLAMA, H100, cluster, trace, policy, SimConfig(span_s=60.0, migrate_min_context_tokens=256))
    assert not res.dropped.any()
    fin = res.finished
    assert np.all(res.e2e_s[fin] > 0) and np.all(res.ttft_s[fin] <= res.e2e_s[fin])
    assert sum(s["switched"] for s in res.spans) >= 9
    assert res.num_migrations > 0  # long contexts moved with their KV
    # each admitted request was classified exactly once, and reported complete exactly once
    assert sorted(a.request_index for a in policy.arrivals) == np.nonzero(res.admitted)[0].tolist()
    done = [c.request_index for v in policy.views for c in v.completed]
    assert len(done) == len(set(done))


def test_a_policy_sees_arrivals_without_their_output_and_completions_after_they_finish(conv):
    cluster = cluster_for_gpus(8)
    dep = _tp(4, 2, "r")
    policy = Scripted([Decision(dep, _even(dep))])
    trace = conv.slice_time(0.0, 300.0)
    res = simulate(LLAMA, H100, cluster, trace, policy, SimConfig(span_s=60.0))
    assert all(not hasattr(a, "output_tokens") for a in policy.arrivals)
    for view in policy.views:
        for c in view.completed:
            assert isinstance(c, CompletionInfo) and c.finish_s <= view.now_s + 1e-9
            assert c.output_tokens == res.output_tokens[c.request_index]
    # spans start at the first arrival and come every span_s while requests arrive
    starts = [v.now_s for v in policy.views]
    assert np.allclose(np.diff(starts), 60.0) and starts[0] == trace.arrival_s[0]


def test_requests_beyond_the_context_window_are_refused_as_vllm_refuses_them():
    cluster = cluster_for_gpus(8)
    dep = _tp(4, 2, "r")
    policy = Scripted([Decision(dep, _even(dep))])
    window = LLAMA.max_context_tokens  # 4096
    trace = Trace(np.array([0.0, 1.0, 2.0, 3.0]), np.array([100, window, 3000, 3000]), np.array([50, 10, 2000, 2000]),
                  max_tokens=np.array([0, 0, 0, 1500]))
    res = simulate(LLAMA, H100, cluster, trace, policy)
    # input == window leaves no room for a token; 3000 + 1500 > 4096; without max tokens it stops at the window
    assert res.refused.tolist() == [False, True, False, True]
    assert res.output_tokens[2] == window - 3000
    assert res.summary()["drop_reasons"] == {"refused_context": 2}
    assert res.finished.tolist() == [True, False, True, False]
    assert [a.request_index for a in policy.arrivals] == [0, 2]  # the refused never reach the policy


def test_a_request_larger_than_the_kv_cache_is_dropped_with_a_reason():
    from oserve.specs import MemoryConfig, kv_capacity_tokens

    memory = MemoryConfig(gpu_memory_utilization=0.432, min_kv_tokens=1)  # TP4 KV room below the context window
    kv = kv_capacity_tokens(LLAMA, H100, ReplicaShape(4), memory)
    assert 1000 < kv < LLAMA.max_context_tokens - 300
    cluster = cluster_for_gpus(8)
    dep = _tp(4, 1, "r")
    policy = Scripted([Decision(dep, _even(dep))])
    trace = Trace(np.array([0.0, 0.5]), np.array([100, kv]), np.array([10, 300]), max_tokens=np.array([0, 300]))
    res = simulate(LLAMA, H100, cluster, trace, policy, SimConfig(memory=memory))
    assert res.finished.tolist() == [True, False]
    assert res.summary()["drop_reasons"] == {"rejected_kv": 1}


def test_unfinished_requests_make_the_percentile_infinite():
    cluster = cluster_for_gpus(8)
    dep = _tp(4, 2, "r")
    policy = Scripted([Decision(dep, _even(dep))])
    trace = Trace(np.arange(200) * 0.01, np.full(200, 100), np.full(200, 50))
    res = simulate(LLAMA, H100, cluster, trace, policy, SimConfig(horizon_after_last_arrival_s=0.5))
    assert res.dropped.any()
    assert res.percentile("e2e", 99) == float("inf")  # more than 1% never finished


class ReadinessRecorder(Scripted):
    """Scripted, recording for each routed request whether the replica it went to was ready and whether
    any ready replica accepted then."""

    def __init__(self, decisions):
        super().__init__(decisions)
        self.routed: list[tuple[bool, bool]] = []

    def route(self, class_index, loads):
        k = super().route(class_index, loads)
        self.routed.append((loads[k].ready, any(r.accepting and r.ready for r in loads)))
        return k


def test_a_replica_still_switching_in_gets_requests_only_when_no_ready_one_accepts(conv):
    cluster = cluster_for_gpus(8)
    a = _tp(4, 2, "a")
    b = Deployment((a.replicas[0], Replica("b0", ReplicaShape(2), (4, 5)), Replica("b1", ReplicaShape(2), (6, 7))))
    policy = ReadinessRecorder([Decision(a, _even(a), 0.0)] + [Decision(b, _even(b), 20.0)] * 20)
    res = simulate(LLAMA, H100, cluster, conv.slice_time(0.0, 180.0), policy, SimConfig(span_s=60.0))
    assert not res.dropped.any() and res.finished[res.admitted].all()
    during_switch = (res.arrival_s[res.admitted] >= 60.0) & (res.arrival_s[res.admitted] < 80.0)
    assert during_switch.sum() > 50  # b0 and b1 load their weights then, the kept a0 serves
    # a0 is ready and accepts throughout: nothing waits on a replica that is still loading
    assert policy.routed and all(ready for ready, _ in policy.routed)


@given(st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 5000)), min_size=1, max_size=30),
       st.integers(2, 8192))
def test_the_context_rule_is_one_rule_for_a_request_and_a_trace(requests, context) -> None:
    """The live gateway applies `context_rule` to one request, the simulator to a whole trace: the same
    answers, and vLLM's rule by its definition (refused when input plus max tokens, 1 when none, exceeds
    the window; else the answer's cap is its max tokens or what the window leaves)."""
    inp = np.array([i for i, _ in requests])
    cap = np.array([m for _, m in requests])
    refused_all, cap_all = context_rule(inp, cap, context)
    for k, (i, m) in enumerate(requests):
        refused, one_cap = context_rule(i, m, context)
        assert bool(refused) == bool(refused_all[k]) == (i + (m or 1) > context)
        if not refused:
            assert int(one_cap) == int(cap_all[k]) == (m or context - i)
