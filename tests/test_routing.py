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
    num_running: int = 0
    kv_capacity_tokens: int = 1000
    incoming_kv_tokens: int = 0


loads_st = st.lists(st.builds(Load, st.booleans(), st.floats(0, 2), st.integers(0, 50)), min_size=0, max_size=8)


def reference(loads, eligible):
    """The rule by brute force: the minimum (load, requests, index) over eligible accepting replicas, else over
    all accepting ones."""
    accepting = [k for k, r in enumerate(loads) if r.accepting]
    allowed = [k for k in accepting if eligible is not None and k < len(eligible) and eligible[k] > 0]
    pool = allowed if (eligible is not None and allowed) else accepting
    if not pool:
        return None
    return min(pool, key=lambda k: (loads[k].kv_load_frac, loads[k].num_requests, k))


@given(loads_st, st.one_of(st.none(), st.lists(st.floats(0, 3), max_size=8)))
def test_least_loaded_is_the_brute_force_minimum(loads, eligible) -> None:
    assert least_loaded(loads, eligible) == reference(loads, eligible)


@given(loads_st, st.lists(st.floats(0, 3), max_size=8))
def test_an_eligible_accepting_replica_is_always_preferred(loads, eligible) -> None:
    k = least_loaded(loads, eligible)
    if any(r.accepting and i < len(eligible) and eligible[i] > 0 for i, r in enumerate(loads)):
        assert k is not None and eligible[k] > 0 and loads[k].accepting
    elif any(r.accepting for r in loads):
        assert k is not None and loads[k].accepting
    else:
        assert k is None


@given(loads_st, st.integers(0, 100))
def test_round_robin_takes_the_next_accepting_replica(loads, counter) -> None:
    k = round_robin(loads, counter)
    if not any(r.accepting for r in loads):
        assert k is None
        return
    n = len(loads)
    assert loads[k].accepting
    steps = (k - counter) % n
    assert not any(loads[(counter + s) % n].accepting for s in range(steps))
