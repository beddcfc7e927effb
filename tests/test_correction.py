"""Correct after the fact (`oserve.correction`): a request that outgrows the class it was routed as moves to a
replica of the class it grew into. The plan's invariants (property tests), its completeness against an
enumeration of what must move, and real simulated runs: the moved requests finish once, with every token."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oserve.correction import CorrectionConfig, OutgrownMover, migration_times, move_after_tokens, outgrown
from oserve.errors import ConfigError
from oserve.planner.twin import FixedPolicy
from oserve.sim.kernel import simulate
from oserve.specs import GPUS, Deployment, Replica, ReplicaShape, cluster_for_gpus, model_preset
from oserve.traces import Trace
from oserve.workload_types import fit_types

H100 = GPUS["h100-80gb"]
LLAMA = model_preset("llama2-70b")
CLUSTER = cluster_for_gpus(8)
# two classes of one input length: short answers (index of the smaller centroid output) and long ones
TYPES = fit_types(np.array([500] * 40 + [520] * 40), np.array([40] * 40 + [1200] * 40), k=2)
SHORT = int(np.argmin(np.array(TYPES.centroids_log)[:, 1]))
LONG = 1 - SHORT
LOG_OUT = np.array(TYPES.centroids_log)[:, 1]


@dataclass
class View:
    """What `OutgrownMover.plan` reads of a replica (`oserve.sim.kernel.BalancerView`'s fields it uses)."""

    contexts: list[tuple[int, int]]
    gpu_ids: tuple[int, ...]
    total_blocks: int = 4000
    kv_load_frac: float = 0.2
    incoming_kv_blocks: int = 0
    accepting: bool = True
    ready: bool = True
    block_tokens: int = 16
    shape: ReplicaShape = field(default_factory=lambda: ReplicaShape(4))

    @property
    def num_requests(self) -> int:
        return len(self.contexts)

    def decoding_contexts(self) -> list[tuple[int, int]]:
        return list(self.contexts)


def _mover(**kw) -> OutgrownMover:
    return OutgrownMover(LLAMA, CLUSTER, TYPES.classify_one, lambda: LOG_OUT, CorrectionConfig(**kw))


def test_config_names_the_bad_field():
    for kw, name in (({"interval_s": 0}, "interval_s"), ({"max_moves_per_round": 0}, "max_moves_per_round"),
                     ({"migration_link_frac": 0}, "migration_link_frac")):
        with pytest.raises(ConfigError, match=name):
            CorrectionConfig(**kw)


@given(st.integers(0, 3), st.integers(0, 3), st.lists(st.floats(0, 10), min_size=4, max_size=4))
def test_outgrown_only_towards_longer_answers(now, routed, logs):
    out = np.array(logs)
    assert outgrown(now, routed, out) == (now != routed and out[now] > out[routed])
    assert not outgrown(routed, routed, out)


def test_a_request_classed_short_moves_once_it_generated_a_long_class_worth():
    mover = _mover()
    mover.admit(7, 500, SHORT)
    eligible = {SHORT: (1.0, 0.0), LONG: (0.0, 1.0)}.get
    boundary = next(g for g in range(1, 5000) if TYPES.classify_one(500, g) == LONG)
    reps = [View([(500 + boundary - 1, 7)], (0, 1, 2, 3)), View([], (4, 5, 6, 7))]
    assert mover.plan(reps, eligible) == []  # one token short of the class boundary: it stays
    reps[0].contexts = [(500 + boundary, 7)]
    moves = mover.plan(reps, eligible)
    assert [(m.src_index, m.dst_index, m.request_id) for m in moves] == [(0, 1, 7)]
    precopy, downtime = migration_times(LLAMA, CLUSTER, 500 + boundary, reps[0], reps[1], 0.02, 0.5)
    assert (moves[0].precopy_s, moves[0].downtime_s) == (precopy, downtime)
    assert moves[0].kv_blocks == -(-(500 + boundary + 1) // 16)
    # a request routed long is never moved by a bound from below, nor one whose replica serves its class
    mover.admit(8, 500, LONG)
    mover.admit(9, 500, SHORT)
    both = {SHORT: (1.0, 1.0), LONG: (0.0, 1.0)}.get
    reps = [View([(510, 8)], (0, 1, 2, 3)), View([(500 + boundary, 9)], (4, 5, 6, 7))]
    assert mover.plan(reps, both) == []
    assert mover.routed_class(9) == LONG  # reclassed where it stands


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_plan_invariants_and_completeness(data):
    """Every move is of a request that outgrew its class, from a replica that does not serve the class it grew
    into, to one that does, is accepting, ready and has room for it (with what this round already reserved
    there); no request moves twice; at most max_moves. With room everywhere and no cap, every request that
    must move (an enumeration of the rule) moves."""
    num_reps = data.draw(st.integers(2, 4))
    max_moves = data.draw(st.integers(1, 6))
    mover = _mover(max_moves_per_round=max_moves)
    ample = _mover(max_moves_per_round=1000)
    weights = [data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=num_reps, max_size=num_reps))
               for _ in range(2)]
    eligible = lambda j: tuple(weights[j])  # noqa: E731
    reps, rid = [], 0
    routed: dict[int, tuple[int, int]] = {}
    for k in range(num_reps):
        contexts = []
        for _ in range(data.draw(st.integers(0, 5))):
            inp = data.draw(st.integers(1, 3000))
            cls = data.draw(st.sampled_from([SHORT, LONG]))
            gen = data.draw(st.integers(1, 3000))
            contexts.append((inp + gen, rid))
            routed[rid] = (inp, cls)
            for m in (mover, ample):
                m.admit(rid, inp, cls)
            rid += 1
        reps.append(View(contexts, tuple(range(2 * k, 2 * k + 2)), total_blocks=data.draw(st.integers(50, 800)),
                         kv_load_frac=data.draw(st.floats(0, 1)), accepting=data.draw(st.booleans()),
                         ready=data.draw(st.booleans())))
    moves = mover.plan(reps, eligible)
    assert len(moves) <= max_moves
    assert len({m.request_id for m in moves}) == len(moves)
    reserved = [0] * num_reps
    for m in moves:
        inp, cls = routed[m.request_id]
        src, dst = reps[m.src_index], reps[m.dst_index]
        ctx = dict((r, c) for c, r in src.contexts)[m.request_id]
        grown = TYPES.classify_one(inp, max(ctx - inp, 1))
        assert outgrown(grown, cls, LOG_OUT) and src.accepting
        assert weights[grown][m.src_index] == 0 and weights[grown][m.dst_index] > 0
        assert dst.accepting and dst.ready and m.src_index != m.dst_index
        reserved[m.dst_index] += m.kv_blocks
        assert dst.kv_load_frac * dst.total_blocks + reserved[m.dst_index] <= dst.total_blocks + 1e-9
    # completeness where room is no constraint
    roomy = [View(r.contexts, r.gpu_ids, total_blocks=10**9, kv_load_frac=0.0, accepting=r.accepting, ready=r.ready)
             for r in reps]
    must = set()
    for s, r in enumerate(roomy):
        for ctx, q in r.contexts:
            inp, cls = routed[q]
            grown = TYPES.classify_one(inp, max(ctx - inp, 1))
            if (r.accepting and outgrown(grown, cls, LOG_OUT) and weights[grown][s] == 0
                    and any(weights[grown][d] > 0 and roomy[d].accepting and roomy[d].ready
                            for d in range(num_reps) if d != s)):
                must.add(q)
    assert {m.request_id for m in ample.plan(roomy, eligible)} == must


def _run(classes: np.ndarray, trace: Trace, correction: CorrectionConfig | None):
    dep = Deployment((Replica("short", ReplicaShape(4), (0, 1, 2, 3)), Replica("long", ReplicaShape(4), (4, 5, 6, 7))))
    weights = tuple((1.0, 0.0) if j == SHORT else (0.0, 1.0) for j in range(2))
    mover = OutgrownMover(LLAMA, CLUSTER, TYPES.classify_one, lambda: LOG_OUT, correction) if correction else None
    policy = FixedPolicy(dep, weights, classes, "fixed", mover=mover)
    return simulate(LLAMA, H100, CLUSTER, trace, policy), mover


def test_misrouted_long_answers_move_and_finish_once_with_every_token():
    """All requests classed short (a wrong estimate for half of them) on a deployment that keeps the classes
    apart: with the correction the long ones move to the long class's replica, finish once with every token,
    and the run is deterministic; where every class is right nothing moves."""
    rng = np.random.default_rng(3)
    n = 300
    arrival = np.sort(rng.random(n) * 60.0)
    out = np.where(rng.random(n) < 0.5, 40, 1200)
    trace = Trace(arrival, np.full(n, 500), out)
    wrong = np.full(n, SHORT)
    base, _ = _run(wrong, trace, None)
    fixed, mover = _run(wrong, trace, CorrectionConfig())
    again, _ = _run(wrong, trace, CorrectionConfig())
    assert mover is not None and mover.num_moves > 0 and fixed.num_migrations == mover.num_moves
    assert base.num_migrations == 0
    for r in (base, fixed):
        assert np.isfinite(r.finish_s).all()
        assert (r.generated_tokens == r.output_tokens).all()  # every token, none twice
    assert np.array_equal(fixed.e2e_s, again.e2e_s)
    # only the long answers moved: the short ones never reach the long class's bound
    assert fixed.num_migrations <= int((out == 1200).sum())
    right = np.array([TYPES.classify_one(500, int(o)) for o in out])
    exact, exact_mover = _run(right, trace, CorrectionConfig())
    assert exact.num_migrations == 0 and exact_mover is not None and exact_mover.num_moves == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 9), st.floats(0, 9)), min_size=2, max_size=5, unique=True),
       st.integers(0, 20000), st.data())
def test_move_after_tokens_is_the_first_count_the_rule_holds(centroids, input_tokens, data):
    """Reference: scan every count from 1 to max_tokens with the nearest centroid (ties to the lower index)."""
    c = np.array(centroids)
    k = len(c)
    routed = data.draw(st.integers(0, k - 1))
    served = data.draw(st.lists(st.booleans(), min_size=k, max_size=k))
    max_tokens = data.draw(st.integers(1, 3000))
    moves_for = lambda j: not served[j]  # noqa: E731
    want = None
    for g in range(1, max_tokens + 1):
        d = (c[:, 0] - np.log1p(input_tokens)) ** 2 + (c[:, 1] - np.log1p(g)) ** 2
        j = int(np.argmin(d))
        if outgrown(j, routed, c[:, 1]) and moves_for(j):
            want = g
            break
    assert move_after_tokens(c, input_tokens, routed, moves_for, max_tokens) == want


def test_move_after_tokens_agrees_with_the_mover():
    """The live threshold is the count at which the simulator's mover first moves the request."""
    eligible = {SHORT: (1.0, 0.0), LONG: (0.0, 1.0)}.get
    g = move_after_tokens(np.array(TYPES.centroids_log), 500, SHORT, lambda j: eligible(j)[0] == 0, 5000)
    assert g is not None
    for gen, moved in ((g - 1, False), (g, True)):
        mover = _mover()
        mover.admit(1, 500, SHORT)
        reps = [View([(500 + gen, 1)], (0, 1, 2, 3)), View([], (4, 5, 6, 7))]
        assert bool(mover.plan(reps, eligible)) == moved


def test_the_twin_scores_a_plan_with_the_moves():
    """A class routed short that really holds long answers, on a deployment that keeps the classes apart: the
    twin with the correction moves them (its score differs), without it it does not; the same inputs give the
    same score."""
    from oserve.capacity import FixedLengths
    from oserve.planner.twin import DigitalTwin, TwinConfig

    names = TYPES.names
    outputs = [(40, 1200) * 20, (1200,) * 40]
    if SHORT == 1:
        outputs.reverse()
    lengths = FixedLengths(names, ((500,) * 40, (500,) * 40), tuple(outputs))
    dep = Deployment((Replica("short", ReplicaShape(4), (0, 1, 2, 3)), Replica("long", ReplicaShape(4), (4, 5, 6, 7))))
    weights = tuple((1.0, 0.0) if j == SHORT else (0.0, 1.0) for j in range(2))
    rates = np.zeros(2)
    rates[SHORT], rates[LONG] = 3.0, 0.5
    plain = DigitalTwin(LLAMA, H100, CLUSTER, lengths, TwinConfig(horizon_s=60.0, warmup_s=10.0))
    moving = DigitalTwin(LLAMA, H100, CLUSTER, lengths, TwinConfig(horizon_s=60.0, warmup_s=10.0), classes=TYPES,
                         correction=CorrectionConfig())
    without, with_ = plain.score(dep, weights, rates), moving.score(dep, weights, rates)
    assert with_ != without
    assert with_ == moving.score(dep, weights, rates)
