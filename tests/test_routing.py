"""The one routing rule (`oserve.routing`): least loaded among the eligible replicas, checked against a
brute-force reference, and used alike by the simulator's policies, the twin and the live gateway."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from oserve.routing import least_loaded, round_robin


@dataclass
class Load:
    accepting: bool
    kv_load_frac: float
    num_requests: int
    ready: bool = True
    num_running: int = 0
    kv_capacity_tokens: int = 1000
    incoming_kv_tokens: int = 0


loads_st = st.lists(st.builds(Load, st.booleans(), st.floats(0, 2), st.integers(0, 50), st.booleans()),
                    min_size=0, max_size=8)


def reference(loads, eligible):
    """The rule by brute force: the minimum (load, requests, index) over the accepting replicas that are
    ready and eligible, else ready, else eligible, else any."""
    accepting = [k for k, r in enumerate(loads) if r.accepting]
    ready = [k for k in accepting if loads[k].ready]

    def allowed(pool):
        return pool if eligible is None else [k for k in pool if k < len(eligible) and eligible[k] > 0]

    for pool in (allowed(ready), ready, allowed(accepting), accepting):
        if pool:
            return min(pool, key=lambda k: (loads[k].kv_load_frac, loads[k].num_requests, k))
    return None


@given(loads_st, st.one_of(st.none(), st.lists(st.floats(0, 3), max_size=8)))
def test_least_loaded_is_the_brute_force_minimum(loads, eligible) -> None:
    assert least_loaded(loads, eligible) == reference(loads, eligible)


@given(loads_st, st.lists(st.floats(0, 3), max_size=8))
def test_a_ready_replica_is_preferred_then_an_eligible_one(loads, eligible) -> None:
    k = least_loaded(loads, eligible)
    if not any(r.accepting for r in loads):
        assert k is None
        return
    assert k is not None and loads[k].accepting
    if any(r.accepting and r.ready for r in loads):
        assert loads[k].ready  # a replica still loading its weights waits until none that serves accepts
        if any(r.accepting and r.ready and i < len(eligible) and eligible[i] > 0 for i, r in enumerate(loads)):
            assert eligible[k] > 0
    elif any(r.accepting and i < len(eligible) and eligible[i] > 0 for i, r in enumerate(loads)):
        assert eligible[k] > 0


@given(loads_st, st.integers(0, 100))
def test_round_robin_takes_the_next_accepting_replica_a_ready_one_first(loads, counter) -> None:
    k = round_robin(loads, counter)
    if not any(r.accepting for r in loads):
        assert k is None
        return
    n = len(loads)
    assert loads[k].accepting
    any_ready = any(r.accepting and r.ready for r in loads)
    assert loads[k].ready or not any_ready
    steps = (k - counter) % n
    assert not any(loads[(counter + s) % n].accepting and (loads[(counter + s) % n].ready or not any_ready)
                   for s in range(steps))


@given(st.floats(0, 1000), st.floats(0, 100), st.floats(0, 120))
def test_beyond_plan_is_the_surplus_over_the_forecast_share_of_the_span(arrived, planned_rps, elapsed_s) -> None:
    """A class is beyond its plan exactly when its arrivals so far exceed 1.5x its planned rate times the
    time elapsed, plus 10 requests; never within the slack; more arrivals never bring it back."""
    from oserve.routing import SURPLUS_FACTOR, SURPLUS_SLACK, beyond_plan

    assert beyond_plan(arrived, planned_rps, elapsed_s) == (arrived > SURPLUS_FACTOR * planned_rps * elapsed_s
                                                            + SURPLUS_SLACK)
    if arrived <= SURPLUS_SLACK:
        assert not beyond_plan(arrived, planned_rps, elapsed_s)
    if beyond_plan(arrived, planned_rps, elapsed_s):
        assert beyond_plan(arrived + 1.0, planned_rps, elapsed_s)
        if planned_rps > 0:  # at the planned rate, the time catches up with the arrivals (a request's margin)
            assert not beyond_plan(arrived, planned_rps,
                                   elapsed_s + (arrived - SURPLUS_SLACK + 1.0) / (SURPLUS_FACTOR * planned_rps))


def test_the_simulated_gateway_routes_a_class_beyond_its_plan_to_any_replica() -> None:
    """The simulator's gateway (`oserve.evaluation.policies.Gateway`): a class the plan gave one replica at
    1 request/s goes there while it arrives at that rate, and to the least loaded replica of all once it
    has come 1.5x beyond it (plus the slack) in the span."""
    import numpy as np

    from oserve.decision import Decision
    from oserve.evaluation.policies import Gateway
    from oserve.sim.kernel import ArrivalInfo
    from oserve.planner.candidates import homogeneous_deployment
    from oserve.specs import ReplicaShape, cluster_for_gpus

    gw = Gateway("g", 2)
    two = homogeneous_deployment(cluster_for_gpus(2), ReplicaShape(1, 1))
    gw.current = Decision(two, ((1.0, 0.0), (0.0, 1.0)), forecast_rps=(1.0, 1.0))
    loads = [Load(True, 0.9, 9), Load(True, 0.1, 1)]  # the planned replica of class 0 is the busier one
    routed = []
    for i in range(20):  # class 0 at 10/s for 2 s: planned 1/s
        gw._record(ArrivalInfo(request_index=i, arrival_s=0.1 * i, input_tokens=10, max_tokens=0, client_id=0), 0)
        routed.append(gw.route(0, loads))
    arrived = np.arange(1, 21)
    expected = [1 if a > 1.5 * 1.0 * (0.1 * i) + 10 else 0 for i, a in enumerate(arrived)]
    assert routed == expected and routed[:10] == [0] * 10 and routed[-1] == 1
