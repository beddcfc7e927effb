"""Capacity learned online (`oserve.planner.learned`) and the planner that uses it (`oserve.planner.adaptive`):
the estimator's invariants as properties, the simulator's telemetry it learns from, and the loop finding an
error injected on purpose."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oserve.capacity import CapacityTable, CorrectedTable, FixedLengths, LatencyTarget
from oserve.errors import ConfigError
from oserve.perfmodel import PerfModel, ScaledPerf
from oserve.planner.learned import (CapacityLearner, LearnerConfig, ReplicaWindow, prior_covariance,
                                    saturated_rate)
from oserve.specs import ReplicaShape, cluster_for_gpus, model_preset

MODEL = model_preset("llama2-70b")
CLUSTER = cluster_for_gpus(16)
TYPES = FixedLengths(("short", "long"), ((200, 300, 250), (1500, 2500, 2000)), ((100, 200, 150), (300, 500, 400)))
TABLE = CapacityTable(MODEL, CLUSTER.gpu, TYPES, gpus_per_node=8)
SHAPES = (ReplicaShape(4), ReplicaShape(8), ReplicaShape(4, 2))


FAST = LearnerConfig(probe_batches=2)


def learner(config: LearnerConfig = FAST) -> CapacityLearner:
    return CapacityLearner(TABLE, SHAPES, config)


def consistent_window(lrn: CapacityLearner, shape: ReplicaShape, counts: tuple[float, ...],
                      truth: np.ndarray) -> ReplicaWindow:
    """A saturated span whose length is what the work of `counts` takes at the true time scales."""
    seconds = float(lrn.work(shape, counts) @ truth)
    return ReplicaWindow(shape, counts, seconds, seconds, after_saturated=True)


def test_no_evidence_is_the_prior():
    lrn = learner()
    for s in SHAPES:
        assert np.array_equal(lrn.mean(s), np.ones(2))
    corr = lrn.correction()
    assert corr.scales == {} and lrn.corrected_table(corr) is TABLE


def test_saturated_rate_matches_the_capacity_model_at_full_batch():
    """The probe (a full simulated engine) agrees with the capacity model's rate without a latency bound
    within 10% (the model's steady state vs the engine's steps), and a 2x slower engine serves half."""
    full = CapacityTable(MODEL, CLUSTER.gpu, TYPES, gpus_per_node=8, target=LatencyTarget(tbt_s=1e9))
    slow = CapacityTable(MODEL, CLUSTER.gpu, TYPES, gpus_per_node=8,
                         perf=ScaledPerf(PerfModel(MODEL, CLUSTER.gpu, gpus_per_node=8), default=(2.0, 1.0)))
    for j in range(2):
        probe = saturated_rate(TABLE, ReplicaShape(4), np.eye(2)[j])
        assert probe == pytest.approx(full.rate(ReplicaShape(4), j), rel=0.1)
        assert saturated_rate(slow, ReplicaShape(4), np.eye(2)[j]) == pytest.approx(probe / 2, rel=0.02)


MIXES = ((40.0, 0.0), (0.0, 40.0), (20.0, 20.0), (30.0, 10.0), (4.0, 1.0), (2.0, 2.0))


@settings(max_examples=40, deadline=None)
@given(truth=st.lists(st.floats(0.4, 3.0), min_size=2, max_size=2),
       order=st.lists(st.sampled_from(MIXES), min_size=1, max_size=8), noise=st.sampled_from((0.05, 0.25)))
def test_more_evidence_is_never_further_from_the_truth(truth, order, noise):
    """With consistent observations the error in the posterior's own metric never grows (each Bayesian
    update contracts it), so the error in the prior's metric never exceeds where it started."""
    lrn = learner(LearnerConfig(noise_frac=noise, probe_batches=2))
    shape = SHAPES[0]
    full_truth = np.ones(len(SHAPES) * 2)
    full_truth[:2] = truth
    prec0 = np.linalg.inv(prior_covariance(len(SHAPES), 2, lrn.config))

    def errors() -> tuple[float, float]:
        e = lrn._mean - full_truth
        return float(e @ np.linalg.inv(lrn._cov) @ e), float(e @ prec0 @ e)

    before, start = errors()
    for c in order:
        lrn.observe(consistent_window(lrn, shape, c, np.asarray(truth)))
        now, in_prior = errors()
        assert now <= before * (1 + 1e-6) + 1e-9
        assert in_prior <= start * (1 + 1e-6) + 1e-9
        before = now


def test_diverse_evidence_converges_to_the_truth():
    lrn = learner(LearnerConfig(noise_frac=0.05, probe_batches=2))
    truth = np.array([2.0, 1.5])
    for _ in range(30):
        for c in ((50.0, 5.0), (5.0, 50.0), (30.0, 30.0)):
            lrn.observe(consistent_window(lrn, SHAPES[1], c, truth))
    assert lrn.mean(SHAPES[1]) == pytest.approx(truth, rel=0.05)
    assert lrn.sd(SHAPES[1]).max() < 0.1
    # the other shapes moved towards it only as far as they share its error (the prior's common part)
    assert 1.0 < lrn.mean(SHAPES[0]).mean() < lrn.mean(SHAPES[1]).mean()


def test_one_scalar_class_moves_monotonically_closer():
    one = FixedLengths(("only",), ((500, 700),), ((200, 300),))
    lrn = CapacityLearner(CapacityTable(MODEL, CLUSTER.gpu, one, gpus_per_node=8), (ReplicaShape(4),),
                          LearnerConfig(noise_frac=0.05, probe_batches=2))
    truth = np.array([1.8])
    gaps = []
    for n in (10.0, 40.0, 20.0, 80.0):
        lrn.observe(consistent_window(lrn, ReplicaShape(4), (n,), truth))
        gaps.append(abs(lrn.mean(ReplicaShape(4))[0] - 1.8))
    assert all(b <= a + 1e-12 for a, b in zip(gaps, gaps[1:])) and gaps[-1] < 0.2


def test_spans_that_are_not_measurements_teach_nothing():
    lrn = learner()
    s = SHAPES[0]
    # the onset of a saturation, too few completions, and a replica with time to spare
    assert not lrn.observe(ReplicaWindow(s, (40.0, 10.0), 60.0, 60.0, after_saturated=False))
    assert not lrn.observe(ReplicaWindow(s, (1.0, 0.0), 60.0, 60.0))
    assert not lrn.observe(ReplicaWindow(s, (1.0, 3.0), 60.0, 0.0))
    assert lrn.correction().scales == {}


def test_an_unsaturated_replica_that_served_more_than_believed_lowers_the_estimate():
    lrn = learner()
    s = SHAPES[0]
    a = lrn.work(s, (100.0, 20.0)).sum()  # model seconds of that work
    assert lrn.observe(ReplicaWindow(s, (100.0, 20.0), a / 2.0, 0.0))  # done in half the time, queue empty
    assert lrn.mean(s).max() < 1.0


def test_corrected_table_is_the_capacity_model_on_a_stretched_engine():
    corrected = CorrectedTable(MODEL, CLUSTER.gpu, TYPES, gpus_per_node=8, time_scales={(ReplicaShape(4), 1): 2.0})
    slow = CapacityTable(MODEL, CLUSTER.gpu, TYPES, gpus_per_node=8,
                         perf=ScaledPerf(PerfModel(MODEL, CLUSTER.gpu, gpus_per_node=8), {ReplicaShape(4): (2.0, 1.0)}))
    assert corrected.rate(ReplicaShape(4), 1) == pytest.approx(slow.rate(ReplicaShape(4), 1))
    assert corrected.rate(ReplicaShape(4), 0) == pytest.approx(TABLE.rate(ReplicaShape(4), 0))
    # the TBT target binds at a smaller batch: the rate falls by at least the time scale
    assert corrected.rate(ReplicaShape(4), 1) <= TABLE.rate(ReplicaShape(4), 1) / 2.0 + 1e-9


def test_state_survives_a_round_trip_and_refuses_another_prior():
    lrn = learner()
    lrn.observe(consistent_window(lrn, SHAPES[2], (30.0, 10.0), np.array([1.7, 1.7])))
    state = lrn.to_dict()
    again = learner()
    again.load_dict(state)
    assert again.to_dict() == state and again.correction().scales == lrn.correction().scales
    other = CapacityLearner(CapacityTable(MODEL, CLUSTER.gpu, FixedLengths(("a", "b"), ((10,), (20,)), ((5,), (6,))),
                                          gpus_per_node=8), SHAPES, FAST)
    with pytest.raises(ConfigError, match="classes"):
        other.load_dict(state)
    with pytest.raises(ConfigError):
        again.load_dict({**state, "mean": [math.nan] * len(state["mean"])})


def test_config_is_validated():
    with pytest.raises(ConfigError):
        LearnerConfig(saturated_frac=0.0)
    with pytest.raises(ConfigError):
        LearnerConfig(prior_sd_parts=(0.1, 0.1, 0.0, 0.1))
    with pytest.raises(ConfigError):
        ReplicaWindow(SHAPES[0], (1.0, 1.0), 0.0, 0.0)


# --- the loop in the simulator --------------------------------------------------------------------------


def test_the_simulator_shows_policies_replica_counters_and_who_finished_what():
    from oserve.evaluation.policies import MeasuringStaticPolicy
    from oserve.planner.candidates import homogeneous_deployment
    from oserve.planner.prior import fit_prior
    from oserve.sim.kernel import SimConfig, simulate
    from oserve.traces import Trace

    rng = np.random.default_rng(0)
    n = 8000
    arrival = np.sort(rng.random(n) * 300.0)
    trace = Trace(arrival, rng.integers(500, 2500, n), rng.integers(300, 900, n), name="burst")
    prior = fit_prior(trace.slice_time(0.0, 120.0), MODEL, CLUSTER, duration_s=120.0)
    dep = homogeneous_deployment(CLUSTER, ReplicaShape(8))  # 2 replicas, far too few for 27 requests/s of these
    policy = MeasuringStaticPolicy(dep, prior.fresh_estimator())
    simulate(MODEL, CLUSTER.gpu, CLUSTER, trace, policy, SimConfig(span_s=60.0))
    assert len(policy.spans) >= 3
    later = policy.spans[-1]
    assert len(later.windows) == 2 and all(w.shape == ReplicaShape(8) for w in later.windows)
    assert all(w.saturated_s > 0.9 * w.seconds and w.after_saturated for w in later.windows)
    assert sum(sum(w.completed) for w in later.windows) == later.completions > 0
    assert later.waiting_growth > 0.3 * later.arrivals  # what it could not finish waits
    assert all(0 < w.tpot_s < 1.0 for w in later.windows)


@pytest.mark.slow
def test_the_loop_finds_an_injected_error_and_stays_with_static():
    """Pipeline-parallel shapes 2x slower than the model believes (S5, 10 minutes): trusting the table
    OServe's P99 is several times static's; learning it is within noise of static and of OServe told
    the true table, finishes as many, and its learned table is closer to the truth than the model."""
    from oserve.evaluation.compare import EvalConfig
    from oserve.evaluation.robustness import PERTURBATIONS, run_robustness
    from oserve.evaluation.scenarios import build_scenario

    scenario = build_scenario("S5", MODEL, CLUSTER, load=0.8, minutes=10.0)
    # the loop alone, without the trial on the history (which `test_oserve_that_defers...` checks)
    row = run_robustness(MODEL, CLUSTER, scenario, PERTURBATIONS["pp-x0.5"],
                         EvalConfig(bound=False, history_trial=False))
    r = row.results
    assert r["oserve"]["finished"] >= r["vllm-static"]["finished"] == r["vllm-static"]["admitted"]
    assert r["oserve"]["p99_e2e_s"] <= 1.1 * r["vllm-static"]["p99_e2e_s"]
    assert r["oserve"]["p99_e2e_s"] <= 1.1 * r["oserve-true-table"]["p99_e2e_s"]
    assert r["oserve-trusting"]["p99_e2e_s"] > 2.0 * r["oserve"]["p99_e2e_s"]
    assert row.pairs > 0 and row.learned_error < 0.5 * row.model_error


@settings(max_examples=20, deadline=None)
@given(p99s=st.lists(st.one_of(st.floats(1.0, 100.0), st.just(math.inf)), min_size=3, max_size=3),
       distrusted=st.lists(st.booleans(), min_size=3, max_size=3))
def test_the_measured_best_is_the_lowest_p99_measured_before_the_window_and_trusted(p99s, distrusted):
    """Reference: the minimum over the seeded runs with a finite P99 that are not distrusted; None without one."""
    from oserve.planner.adaptive import MeasuredRun, SelfCorrectingPlanner, deployment_key
    from oserve.planner.candidates import homogeneous_deployment
    from oserve.planner.config import PlannerConfig
    from oserve.planner.context import PlanningContext

    planner = SelfCorrectingPlanner(PlanningContext(MODEL, CLUSTER, TABLE), PlannerConfig(twin=None))
    assert planner.measured_best_p99() is None
    deps = [homogeneous_deployment(CLUSTER, s) for s in SHAPES]
    planner.seed([MeasuredRun(d, (), p) for d, p in zip(deps, p99s)])
    for d, flag in zip(deps, distrusted):
        planner.measured[deployment_key(d)].distrusted = flag
    ok = [(p, i) for i, (p, flag) in enumerate(zip(p99s, distrusted)) if math.isfinite(p) and not flag]
    got = planner.measured_best_p99()
    if not ok:
        assert got is None
    else:
        assert got is not None and min(p for p, _ in ok) == p99s[[deployment_key(d) for d in deps].index(
            deployment_key(got))]


# --- the trial on the history --------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(p99s=st.lists(st.sampled_from([10.0, 20.0, 30.0, math.inf]) | st.floats(1.0, 100.0), min_size=3, max_size=3),
       dropped=st.lists(st.integers(0, 2), min_size=3, max_size=3),
       trial=st.one_of(st.floats(0.5, 150.0), st.just(math.inf), st.just(math.nan)), trial_dropped=st.integers(0, 2),
       switches=st.integers(0, 3), tolerance=st.one_of(st.none(), st.floats(0.0, 0.5)),
       max_switches=st.one_of(st.none(), st.integers(0, 2)),
       untouched=st.one_of(st.none(), st.lists(st.floats(0.3, 2.0), min_size=2, max_size=2).map(sorted)),
       judge_untouched=st.booleans())
def test_a_planner_that_lost_its_trial_on_the_history_defers_to_static_s_choice(p99s, dropped, trial, trial_dropped,
                                                                                switches, tolerance, max_switches,
                                                                                untouched, judge_untouched):
    """Reference: static's choice is the candidate with the fewest unfinished requests, then the lowest P99,
    then the first measured (`choose_static`). The planner defers to it exactly when the trial switched at
    most `trial_max_switches` times and did worse: more unfinished, or as many and a P99 not within
    `trial_tolerance` of its (NaN loses; a None tolerance never defers); or when it switched more, and it left
    more unfinished, or as many and on the requests its switches did not touch static's P99 over its was below
    1 over the whole interval (`trial_untouched`; without that comparison it is not judged). Then it serves
    that deployment as static does: every class on every replica, no switch, whatever the forecast."""
    from oserve.planner.adaptive import (GuardConfig, MeasuredRun, SelfCorrectingPlanner, Trial, Untouched,
                                         deployment_key)
    from oserve.planner.candidates import homogeneous_deployment
    from oserve.planner.config import PlannerConfig
    from oserve.planner.context import PlanningContext

    planner = SelfCorrectingPlanner(PlanningContext(MODEL, CLUSTER, TABLE), PlannerConfig(twin=None),
                                    guard=GuardConfig(trial_tolerance=tolerance, trial_max_switches=max_switches,
                                                      trial_untouched=judge_untouched))
    deps = [homogeneous_deployment(CLUSTER, s) for s in SHAPES]
    compared = None if untouched is None else Untouched(500, 20.0, 20.0 * untouched[0], *untouched)
    planner.seed([MeasuredRun(d, (), p, n) for d, p, n in zip(deps, p99s, dropped)],
                 trial=Trial(trial, switches, trial_dropped, compared))
    i = min(range(3), key=lambda k: (dropped[k], p99s[k], k))
    best = deps[i]
    few = max_switches is None or switches <= max_switches
    if trial_dropped != dropped[i]:
        worse = trial_dropped > dropped[i]
    elif few:
        worse = not trial <= p99s[i] * (1 + (tolerance or 0.0))
    else:
        worse = untouched is not None and untouched[1] < 1.0
    judged = tolerance is not None and (few or (judge_untouched and untouched is not None))
    expect = judged and worse
    assert planner.trial["judged_on"] == (None if not judged else "all" if few else "untouched")
    assert (planner.deferred_to is not None) == expect
    assert planner.trial.get("deferred", False) == expect
    first = planner.plan(np.array([3.0, 1.0]), None, None, 60.0)
    if expect:
        assert first.label == "deferred" and deployment_key(first.deployment) == deployment_key(best)
        assert all(w == 1.0 for row in first.weights for w in row) and first.switch_s == 0.0
        again = planner.plan(np.array([0.0, 9.0]), first, None, 60.0)  # the mix moved: it still holds
        assert again.label == "deferred" and again.deployment == first.deployment
    else:
        assert first.label != "deferred"


def test_a_deferring_planner_plans_again_once_the_measured_deployment_cannot_keep_up():
    """The deferral lasts until the queues of the deployment it deferred to grow in the window (underserving
    by the model's measure alone does not end it): then the planner decides as without a trial (here, the
    capacity model's plan)."""
    from oserve.planner.adaptive import MeasuredRun, SelfCorrectingPlanner, SpanOutcome, SpanRecord, Trial
    from oserve.planner.candidates import homogeneous_deployment
    from oserve.planner.config import PlannerConfig
    from oserve.planner.context import PlanningContext

    planner = SelfCorrectingPlanner(PlanningContext(MODEL, CLUSTER, TABLE), PlannerConfig(twin=None))
    deps = [homogeneous_deployment(CLUSTER, s) for s in SHAPES]
    planner.seed([MeasuredRun(d, (), p) for d, p in zip(deps, (30.0, 20.0, 25.0))], trial=Trial(21.0))
    held = planner.plan(np.array([3.0, 1.0]), None, None, 60.0)
    assert held.label == "deferred" and held.deployment == deps[1]
    planner.last = SpanOutcome(underserved=True)
    assert planner.plan(np.array([3.0, 1.0]), held, None, 60.0).label == "deferred"
    # what the engines showed: queues that grew by more than backlog_frac of the span's arrivals
    windows = tuple(ReplicaWindow(r.shape, (1.0, 1.0), 60.0, 0.0) for r in held.deployment.replicas)
    assert not planner.observe(SpanRecord(windows, 100.0, 100.0, 60.0, waiting_growth=5.0), held).queues_grew
    assert planner.plan(np.array([3.0, 1.0]), held, None, 60.0).label == "deferred"
    assert planner.observe(SpanRecord(windows, 100.0, 80.0, 60.0, waiting_growth=20.0), held).queues_grew
    moved = planner.plan(np.array([3.0, 1.0]), held, None, 60.0)
    assert planner.deferred_to is None and moved.label != "deferred"


def test_once_a_deferral_ends_the_twin_scores_the_alternatives_at_once():
    """A deferred decision was never scored (`scored_rps` empty), so when the deferral ends the planner with the
    twin scores its candidates, rather than re-routing what runs for a forecast that has not moved."""
    from oserve.planner.adaptive import MeasuredRun, SelfCorrectingPlanner, SpanOutcome, Trial
    from oserve.planner.candidates import homogeneous_deployment
    from oserve.planner.config import PlannerConfig
    from oserve.planner.context import PlanningContext
    from oserve.planner.twin import TwinConfig

    twin = TwinConfig(initial_horizon_s=60.0, horizon_s=30.0, warmup_s=10.0)
    planner = SelfCorrectingPlanner(PlanningContext(MODEL, CLUSTER, TABLE),
                                    PlannerConfig(twin=twin, neighbour_steps=0, num_homogeneous_candidates=1))
    deps = [homogeneous_deployment(CLUSTER, s) for s in SHAPES]
    planner.seed([MeasuredRun(d, (), p) for d, p in zip(deps, (30.0, 20.0, 25.0))], trial=Trial(21.0))
    rates = np.array([3.0, 1.0])
    held = planner.plan(rates, None, None, 60.0)
    assert held.label == "deferred" and held.scored_rps == ()
    planner.last = SpanOutcome(queues_grew=True)
    assert planner.plan(rates, held, None, 60.0).label in ("rescored", "switch", "keep")


def test_a_lost_trial_defers_to_the_lowest_p99_measured_even_when_the_planner_distrusts_it():
    """The static baseline picks the lowest P99 measured on the history; OServe distrusts a deployment that
    underserved there (the model was wrong about it). A trial that lost defers to static's pick all the
    same: the trial is measured against what static measured."""
    from oserve.planner.adaptive import MeasuredRun, SelfCorrectingPlanner, SpanRecord, Trial, deployment_key
    from oserve.planner.candidates import homogeneous_deployment
    from oserve.planner.config import PlannerConfig
    from oserve.planner.context import PlanningContext

    planner = SelfCorrectingPlanner(PlanningContext(MODEL, CLUSTER, TABLE), PlannerConfig(twin=None))
    deps = [homogeneous_deployment(CLUSTER, s) for s in SHAPES]
    full = SpanRecord(tuple(ReplicaWindow(r.shape, (5.0, 1.0), 60.0, 60.0) for r in deps[0].replicas), 400.0,
                      12.0, 60.0)  # every replica saturated through the span: it underserved
    planner.seed([MeasuredRun(deps[0], (full, full), 20.0), MeasuredRun(deps[1], (), 22.0),
                  MeasuredRun(deps[2], (), 25.0)], trial=Trial(21.0))
    assert planner.measured[deployment_key(deps[0])].distrusted
    assert planner.measured_best_p99() == deps[1]  # what the planner itself would go back to
    assert planner.deferred_to == deps[0] and planner.trial["measured_best_p99_s"] == 20.0


@pytest.mark.slow
def test_oserve_that_defers_serves_exactly_as_static_does():
    """Bit-exact against the reference: OServe whose trial lost serves the window as vllm-static serves it
    (the same deployment, chosen the same way; the same routing; no move, no switch): every latency equal."""
    from oserve.evaluation.compare import EvalConfig, prepare, run_policy
    from oserve.evaluation.policies import OServePolicy
    from oserve.evaluation.scenarios import build_scenario
    from oserve.planner.adaptive import Trial
    from oserve.sim.kernel import simulate

    cluster = cluster_for_gpus(8)
    scenario = build_scenario("S5", MODEL, cluster, load=0.8, minutes=4.0, history_minutes=3.0)
    setup = prepare(MODEL, cluster, scenario, EvalConfig(bound=False)).setup
    assert len(setup.measured) > 1  # the measured best is a choice, as static's is
    static = run_policy(setup, "vllm-static", EvalConfig().sim)[0]
    ours = OServePolicy(setup.ctx, setup.prior, setup.new_forecaster(), setup.span_s, setup.planner,
                        measured=setup.measured, trial=Trial(math.inf))
    result = simulate(MODEL, cluster.gpu, cluster, scenario.window, ours, EvalConfig().sim)
    assert ours.adaptive is not None and ours.adaptive.trial["deferred"]
    assert ours.adaptive.deferred_to == setup.static
    assert np.array_equal(result.e2e_s, static.e2e_s, equal_nan=True)
    assert np.array_equal(result.finished, static.finished) and result.num_migrations == 0


@settings(max_examples=80, deadline=None)
@given(arrivals=st.lists(st.floats(0.0, 600.0), min_size=1, max_size=40),
       e2e=st.lists(st.one_of(st.floats(0.0, 200.0), st.just(math.inf)), min_size=40, max_size=40),
       switch_at=st.lists(st.sampled_from([0.0, 60.0, 120.0, 300.0, 540.0]), max_size=3),
       span_s=st.sampled_from([30.0, 60.0]))
def test_untouched_requests_are_those_no_switch_saw(arrivals, e2e, switch_at, span_s):
    """Reference, request by request: a switch at t (from the first arrival) touches a request that arrived
    in [t, t + span) or was running at t (arrived before, finished after; never finished counts as after)."""
    from oserve.evaluation.registry import untouched_by_switches

    arrival = np.array(sorted(arrivals)) + 1000.0  # absolute times: the mask counts from the first arrival
    lat = np.array(e2e[:len(arrival)])
    got = untouched_by_switches(arrival, lat, switch_at, span_s)
    t0 = arrival[0]
    for a, e, keep in zip(arrival, lat, got):
        t = a - t0
        touched = any(at <= t < at + span_s or (t < at and t + e < math.inf and t + e > at) or
                      (t < at and e == math.inf) for at in switch_at)
        assert keep == (not touched)
    assert untouched_by_switches(arrival, lat, [], span_s).all()
    with pytest.raises(ConfigError):
        untouched_by_switches(arrival, lat[:-1] if len(lat) > 1 else np.zeros(2), switch_at, span_s)


def test_a_switching_trial_is_compared_with_static_s_choice_on_what_its_switches_left_alone():
    """Against references: the latencies kept with each measured run are the ones its deployment has on the
    history (bit-exact, re-simulated); static's choice compared with itself ties on every resample; a slower
    deployment in the trial's place is compared on exactly the requests the reference mask keeps, its P99s
    and interval those of `p99_ratio_interval` there."""
    from dataclasses import replace

    from oserve.evaluation.baselines import StaticPolicy
    from oserve.evaluation.compare import EvalConfig, prepare
    from oserve.evaluation.noise import p99_ratio_interval
    from oserve.evaluation.registry import MIN_UNTOUCHED, untouched_by_switches, untouched_comparison
    from oserve.evaluation.scenarios import build_scenario
    from oserve.planner.adaptive import static_choice
    from oserve.sim.kernel import latency_percentile, simulate

    cluster = cluster_for_gpus(8)
    scenario = build_scenario("S5", MODEL, cluster, load=0.8, minutes=2.0, history_minutes=4.0)
    setup = prepare(MODEL, cluster, scenario, EvalConfig(bound=False)).setup
    best = static_choice(setup.measured)
    assert best.deployment == setup.static
    runs = {}
    for run in setup.measured:
        res = simulate(MODEL, cluster.gpu, cluster, setup.history, StaticPolicy(run.deployment, setup.num_classes),
                       setup.sim)
        assert np.array_equal(res.e2e_s, run.e2e_s, equal_nan=True)
        runs[id(run)] = res
    same = untouched_comparison(setup, runs[id(best)], [60.0])
    assert same is not None and same.ratio_low == same.ratio_high == 1.0 and not same.worse_beyond_noise
    slowest = max(setup.measured, key=lambda r: (r.dropped, r.p99_s))
    assert slowest is not best
    trial = runs[id(slowest)]
    got = untouched_comparison(setup, trial, [60.0, 120.0])
    keep = untouched_by_switches(trial.arrival_s, trial.e2e_s, [60.0, 120.0], setup.span_s) & trial.admitted
    assert got is not None and got.requests == int(keep.sum()) >= MIN_UNTOUCHED
    assert got.p99_s == latency_percentile(trial.e2e_s[keep], 99)
    assert got.static_p99_s == latency_percentile(best.e2e_s[keep], 99)
    ref = p99_ratio_interval(trial.arrival_s[keep], trial.e2e_s[keep], best.e2e_s[keep])
    assert (got.ratio_low, got.ratio_high, got.worse_beyond_noise) == (ref.low, ref.high, ref.worse_beyond_noise)
    # a switch in every span leaves nothing to judge on
    assert untouched_comparison(setup, trial, [60.0 * k for k in range(7)]) is None
    # its meaning: a trial twice as slow as static's choice on every request is slower beyond any noise, one
    # twice as fast is not
    slow = untouched_comparison(setup, replace(runs[id(best)], e2e_s=2.0 * best.e2e_s), [60.0])
    assert slow is not None and slow.ratio_low == slow.ratio_high == 0.5 and slow.worse_beyond_noise
    fast = untouched_comparison(setup, replace(runs[id(best)], e2e_s=0.5 * best.e2e_s), [60.0])
    assert fast is not None and fast.ratio_low == 2.0 and not fast.worse_beyond_noise
    # runs of different histories are an error, not a silent pass
    with pytest.raises(ConfigError):
        untouched_comparison(setup, replace(trial, e2e_s=trial.e2e_s[:-1]), [60.0])


def test_history_trial_judges_its_switches_from_the_spans_it_switched_at():
    """The wiring, against a re-run of the same trial: a trial that switched (here, a planner made to switch
    eagerly) carries the comparison of the spans its simulation switched at, which start on whole spans
    after the first; one that did not switch carries none."""
    from dataclasses import replace

    from oserve.evaluation.compare import EvalConfig, prepare
    from oserve.evaluation.policies import OServePolicy
    from oserve.evaluation.registry import history_trial, untouched_comparison
    from oserve.evaluation.scenarios import build_scenario
    from oserve.sim.kernel import simulate

    cluster = cluster_for_gpus(8)
    scenario = build_scenario("quiet-busy", MODEL, cluster, load=0.8, minutes=2.0, history_minutes=4.0)
    setup = prepare(MODEL, cluster, scenario, EvalConfig(bound=False)).setup
    kept = history_trial(setup)
    assert kept is not None and kept.switches == 0 and kept.untouched is None
    eager = replace(setup.planner, switch_gain=0.0, max_switch_loss_frac=0.99, free_switching=True)
    trial = history_trial(setup, eager)
    assert trial is not None and trial.switches >= 1
    again = simulate(MODEL, cluster.gpu, cluster, setup.history,
                     OServePolicy(setup.ctx, setup.prior, setup.new_forecaster(), setup.span_s, eager,
                                  name="oserve-trial", measured=setup.measured), setup.sim)
    at = [s["start_s"] for s in again.spans[1:] if s["switched"]]
    assert len(at) == trial.switches and all(t > 0 and abs(t / setup.span_s - round(t / setup.span_s)) < 1e-9
                                              for t in at)
    assert trial.untouched == untouched_comparison(setup, again, at)
