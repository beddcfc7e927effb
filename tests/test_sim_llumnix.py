"""Llumnix-like balancer: live migration happens where load is uneven and helps; nothing is lost or
double-counted, KV is never over-allocated, runs are deterministic."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oserve.decision import Decision
from oserve.engine_model import SimReplica
from oserve.evaluation.llumnix import LlumnixPolicy, freeness_tokens, load_freeness_tokens
from oserve.planner.candidates import homogeneous_deployment
from oserve.sim.kernel import BalancerView, SimConfig, SimResult, _LoadView, simulate
from oserve.specs import (GPUS, ClusterSpec, Deployment, EngineConfig, MemoryConfig, Replica, ReplicaShape,
                          cluster_for_gpus, model_preset)
from oserve.traces import Trace

H100 = GPUS["h100-80gb"]
LLAMA = model_preset("llama2-70b")
SMALL_KV = MemoryConfig(gpu_memory_utilization=0.47)  # ~43k tokens per TP4 replica of Llama-2-70B


def _llumnix(cluster: ClusterSpec, dep: Deployment, cls=LlumnixPolicy, **kw) -> LlumnixPolicy:
    return cls(dep, 1, LLAMA, cluster, **kw)


def _tp4(num_replicas: int) -> tuple[ClusterSpec, Deployment, int]:
    """num_replicas TP4 replicas on as many 8-GPU nodes as they need (a third one on a second node)."""
    num_gpus = 8 * -(-num_replicas // 2)
    dep = Deployment(tuple(Replica(f"r{i}", ReplicaShape(4), tuple(range(4 * i, 4 * i + 4)))
                           for i in range(num_replicas)))
    return cluster_for_gpus(num_gpus), dep, num_gpus


def _used_blocks(rep: SimReplica) -> int:
    """Blocks held (as in test_sim_engine): prompts' blocks, plus each decoding request's context with
    the token of the step in flight (its block is reserved when the step starts)."""
    used = sum(r.blocks for r in rep.prefilling)
    in_flight = 1 if rep.busy and rep._run_n_dec else 0
    used += sum(-(-(r.offset + rep.step_index + in_flight) // rep.block_tokens) for r in rep._dec.values())
    return used


class Checked:
    """Wraps a LlumnixPolicy; at every arrival and migration round asserts the replicas' invariants
    (KV blocks add up and never overflow, batch limits hold, no request is in two places) and keeps
    every request it routed for the end-of-run checks."""

    def __init__(self, inner: LlumnixPolicy, pinned: frozenset[int] = frozenset()) -> None:
        self.inner = inner
        self.pinned = pinned  # request ids routed to replica 0 whatever the load (a skewed router)
        self.name = inner.name
        self.migration_interval_s = inner.migration_interval_s
        self.requests: list[int] = []
        self.replicas: list[SimReplica] = []
        self.seen: dict[int, SimReplica] = {}  # every replica ever shown, retired ones included
        self.num_checks = 0
        self.num_planned = 0
        self._pin_next = False

    def decide(self, view):
        return self.inner.decide(view)

    def classify(self, arrival):
        self.requests.append(arrival.request_index)
        self._pin_next = arrival.request_index in self.pinned
        return self.inner.classify(arrival)

    def route(self, class_index, loads):
        # the test looks inside the replicas behind the load views (a policy is only shown their loads)
        self.check([load._rep for load in loads if isinstance(load, _LoadView)])
        pinned, self._pin_next = self._pin_next, False
        return 0 if pinned else self.inner.route(class_index, loads)

    def plan_migrations(self, replicas, now_s):
        # the test looks inside the replicas behind the balancer views, as route does behind load views
        assert all(isinstance(v, BalancerView) for v in replicas)
        self.check([v._rep for v in replicas])
        moves = self.inner.plan_migrations(replicas, now_s)
        self.num_planned += len(moves)
        return moves

    def check(self, replicas: list[SimReplica]) -> None:
        self.num_checks += 1
        self.seen.update((id(r), r) for r in replicas)
        self.replicas = list(replicas)
        seen: set[int] = set()
        for rep in replicas:
            assert rep.free_blocks >= 0
            assert rep.free_blocks + _used_blocks(rep) == rep.total_blocks
            assert rep.num_running <= rep.engine.max_num_seqs * rep.shape.pp
            assert rep.incoming_kv_blocks >= 0
            ids = [r.request_id for r in (*rep.waiting, *rep.prefilling, *rep._dec.values())]
            assert len(set(ids)) == len(ids) and not seen & set(ids)
            seen |= set(ids)


def _run(policy, num_gpus: int, arrival_s, input_tokens, output_tokens, engine=EngineConfig(),
         memory=MemoryConfig(), span_s: float = 60.0) -> SimResult:
    # no max tokens: none is refused at the gateway, an answer stops at the context window at most
    trace = Trace(np.asarray(arrival_s, dtype=float), np.asarray(input_tokens), np.asarray(output_tokens))
    return simulate(LLAMA, H100, cluster_for_gpus(num_gpus), trace, policy,
                    SimConfig(span_s=span_s, engine=engine, memory=memory, horizon_after_last_arrival_s=600.0))


def _assert_conserved(policy: Checked, res: SimResult, n: int) -> None:
    """Every request finished exactly once with all its tokens, or was dropped with a reason; the
    replicas end empty with no migration in flight."""
    assert sorted(policy.requests) == list(range(n))
    assert int(res.dropped.sum()) == sum(res.drop_reasons.values())
    fin = res.finished
    assert np.array_equal(res.generated_tokens[fin], res.output_tokens[fin])
    assert np.all(res.ttft_s[fin] <= res.e2e_s[fin]) and np.all(res.ttft_s[fin] >= 0)
    if not fin.all():
        assert res.drop_reasons.get("rejected_kv", 0) > 0
    for rep in policy.seen.values():
        assert rep.free_blocks == rep.total_blocks and rep.num_requests == 0
        assert rep.incoming_kv_blocks == 0 and not rep.migrating_out


def _piled_up_workload(n: int = 16, long_out: int = 2000, short_out: int = 20, inp: int = 100, period: int = 2):
    """One long request, then period - 1 short ones, repeated in one burst: freeness dispatch (blind to
    output lengths, as any real router is) goes round the `period` replicas, so every long one lands
    on the first."""
    arrival = np.arange(n) * 0.001
    output = np.array([long_out if i % period == 0 else short_out for i in range(n)])
    return arrival, np.full(n, inp), output


def test_migration_moves_long_requests_off_the_piled_up_replica_and_shortens_the_run():
    cluster = cluster_for_gpus(8)
    dep = homogeneous_deployment(cluster, ReplicaShape(4))
    arrival, inp, out = _piled_up_workload()
    engine = EngineConfig(max_num_seqs=4)  # replica 0's 8 long requests: 4 run, 4 wait a whole wave
    still = _run(_llumnix(cluster, dep, migration_interval_s=None), 8, arrival, inp, out, engine)
    moving = _run(_llumnix(cluster, dep), 8, arrival, inp, out, engine)
    assert still.num_migrations == 0 and not still.dropped.any()
    assert moving.num_migrations >= 3 and not moving.dropped.any()
    # the idle replica takes over half the long requests: about one wave of decoding instead of two
    assert moving.duration_s < 0.6 * still.duration_s
    assert moving.percentile("e2e", 90) < 0.6 * still.percentile("e2e", 90)
    # the downtime is tens of milliseconds, not a recompute of a long context
    assert moving.percentile("tbt", 100) < 0.2


def test_kv_stays_consistent_and_nothing_is_lost_under_kv_pressure_with_migrations():
    cluster = cluster_for_gpus(8)
    dep = homogeneous_deployment(cluster, ReplicaShape(4))
    arrival, inp, out = _piled_up_workload(n=60, long_out=1500, short_out=30, inp=1000)
    policy = Checked(_llumnix(cluster, dep, migration_interval_s=0.2))
    res = _run(policy, 8, arrival, inp, out, memory=SMALL_KV)
    assert res.num_migrations > 0 and res.num_preemptions > 0  # both mechanisms exercised
    assert not res.dropped.any()
    assert policy.num_checks > len(arrival)  # migration rounds were checked too, not only arrivals
    _assert_conserved(policy, res, len(arrival))


def test_runs_with_migration_are_deterministic():
    cluster, dep, num_gpus = _tp4(3)
    arrival, inp, out = _piled_up_workload(n=90, long_out=1500, short_out=30, inp=1000, period=3)
    runs = [_run(_llumnix(cluster, dep, migration_interval_s=0.2), num_gpus, arrival, inp, out, memory=SMALL_KV)
            for _ in range(2)]
    assert runs[0].num_migrations > 0
    assert runs[0].summary() == runs[1].summary() and runs[0].num_events == runs[1].num_events
    assert np.array_equal(runs[0].finish_s, runs[1].finish_s)


class SlowCopy(LlumnixPolicy):
    """Pre-copies take seconds, so requests finish while their KV is being copied."""

    def migration_times(self, context_tokens, src, dst):
        return 3.0, 0.02


def test_a_move_whose_request_finishes_during_the_precopy_is_called_off():
    cluster, dep, num_gpus = _tp4(2)
    n = 12
    policy = Checked(_llumnix(cluster, dep, SlowCopy, migration_interval_s=0.5), pinned=frozenset(range(n)))
    # all on replica 0, 4 at a time; each decodes its 100 tokens in about 2.5 s, within a pre-copy
    res = _run(policy, num_gpus, np.zeros(n), np.full(n, 100), np.full(n, 100), EngineConfig(max_num_seqs=4))
    assert policy.num_planned > 0 and res.num_migrations < policy.num_planned
    assert not res.dropped.any()
    _assert_conserved(policy, res, n)  # the destination's reservations were released too


class Switching(SlowCopy):
    """Alternates every span between replicas {r0, r1} and {r0, r2}: migrations meet hand-offs."""

    def __init__(self, cluster, deployments):
        super().__init__(deployments[0], 1, LLAMA, cluster, migration_interval_s=0.3,
                         migrate_out_freeness_tokens=4096.0, migrate_in_freeness_tokens=8192.0)
        self.deployments = deployments

    def migration_times(self, context_tokens, src, dst):
        return 0.4, 0.5  # long enough that spans end while moves are in flight

    def decide(self, view):
        dep = self.deployments[view.span_index % 2]
        return Decision(dep, ((1.0,) * len(dep.replicas),), 1.0, (1.0,), "switch")


def test_migrations_survive_deployment_switches():
    cluster, _, num_gpus = _tp4(3)
    r = [Replica(f"r{i}", ReplicaShape(4), tuple(range(4 * i, 4 * i + 4))) for i in range(3)]
    rng = np.random.default_rng(3)
    n = 80
    arrival = np.sort(rng.uniform(0, 12, n))
    out = np.where(rng.random(n) < 0.5, rng.integers(5, 40, n), rng.integers(300, 900, n))
    policy = Checked(Switching(cluster, (Deployment((r[0], r[1])), Deployment((r[0], r[2])))),
                     pinned=frozenset(k for k in range(n) if k % 4))  # r0 takes 3 in 4, r1 or r2 1 in 4
    res = _run(policy, num_gpus, arrival, rng.integers(100, 3000, n), out, EngineConfig(max_num_seqs=6), SMALL_KV,
               span_s=2.0)
    assert policy.num_planned > 0 and sum(s["switched"] for s in res.spans) >= 5
    assert not res.dropped.any()
    _assert_conserved(policy, res, n)


def test_migration_cost_model():
    cluster = cluster_for_gpus(16)  # two nodes of 8
    policy = _llumnix(cluster, homogeneous_deployment(cluster, ReplicaShape(4)))
    reps = [SimReplica(f"r{i}", ReplicaShape(4), None, EngineConfig(), 16_000) for i in range(3)]
    for rep, gpus in zip(reps, ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11))):
        rep.gpu_ids = gpus
    pre_short, down_short = policy.migration_times(100, BalancerView(reps[0]), BalancerView(reps[1]))
    pre_long, down_long = policy.migration_times(10_000, BalancerView(reps[0]), BalancerView(reps[1]))
    assert down_short == down_long and 0.02 <= down_long < 0.03  # near-constant downtime
    assert pre_long == pytest.approx(100 * pre_short)  # the copy overlapped with decoding grows with context
    pre_far, down_far = policy.migration_times(10_000, BalancerView(reps[0]), BalancerView(reps[2]))
    assert pre_far > pre_long and down_far > down_long  # across nodes the network is slower than NVLink


def test_dispatch_goes_to_the_freest_replica():
    cluster = cluster_for_gpus(8)
    policy = _llumnix(cluster, homogeneous_deployment(cluster, ReplicaShape(4)))
    reps = [SimReplica(f"r{i}", ReplicaShape(4), None, EngineConfig(), 16_000) for i in range(2)]
    loads = [_LoadView(r) for r in reps]
    reps[0].free_blocks -= 500
    views = [BalancerView(r) for r in reps]
    assert freeness_tokens(views[0]) < freeness_tokens(views[1])
    assert [load_freeness_tokens(x) for x in loads] == [freeness_tokens(v) for v in views]
    assert policy.route(0, loads) == 1
    reps[1].incoming_kv_blocks = 600  # reserved for a migration counts as used
    assert policy.route(0, loads) == 0


@settings(max_examples=30)
@given(requests=st.lists(st.tuples(st.floats(0.0, 0.1), st.integers(1, 3000),
                                   st.one_of(st.integers(1, 50), st.integers(300, 2000)),  # short and long outputs
                                   st.booleans()),  # pinned to replica 0, to make the load uneven
                         min_size=10, max_size=40),
       num_replicas=st.integers(2, 3), max_seqs=st.integers(1, 64),
       memory_frac=st.sampled_from([0.44, 0.45, 0.47]),  # 12k to 43k tokens of KV per replica
       interval_s=st.sampled_from([0.05, 0.2, 0.5]), per_pair=st.integers(1, 3),
       out_threshold=st.sampled_from([256.0, 2048.0, 8192.0]))  # high ones migrate at moderate imbalance
def test_conservation_with_migration_on_random_workloads(requests, num_replicas, max_seqs, memory_frac,
                                                         interval_s, per_pair, out_threshold):
    cluster, dep, num_gpus = _tp4(num_replicas)
    pinned = frozenset(k for k, (*_, pin) in enumerate(requests) if pin)
    policy = Checked(_llumnix(cluster, dep, migration_interval_s=interval_s, max_migrations_per_pair=per_pair,
                              migrate_out_freeness_tokens=out_threshold,
                              migrate_in_freeness_tokens=2 * out_threshold), pinned)
    arrival = np.cumsum([gap for gap, *_ in requests])
    inp = [i for _, i, _, _ in requests]
    out = [o for _, _, o, _ in requests]
    res = _run(policy, num_gpus, arrival, inp, out, EngineConfig(max_num_seqs=max_seqs),
               MemoryConfig(gpu_memory_utilization=memory_frac))
    assert not res.dropped.any()  # every request fits a replica's cache here
    _assert_conserved(policy, res, len(requests))
