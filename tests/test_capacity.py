"""Capacity table: positive and finite for every valid shape, physically ordered, cached."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oserve.capacity import CapacityTable, FixedLengths, LatencyTarget, homogeneous_rate
from oserve.errors import ConfigError
from oserve.specs import GPUS, MODELS, ReplicaShape, model_preset

H100 = GPUS["h100-80gb"]
PAPER_TYPES = FixedLengths(
    names=("SISO", "SILO", "LISO", "LILO"),
    inputs=((200, 300, 400), (150, 200, 250), (2000, 2500, 3000), (1000, 1200, 1400)),
    outputs=((50, 80, 110), (300, 400, 500), (40, 60, 80), (300, 400, 500)),
)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_capacity_positive_and_finite_for_every_valid_shape(name):
    table = CapacityTable(MODELS[name], H100, PAPER_TYPES)
    shapes = table.shapes(16)
    assert shapes
    n = table.matrix(shapes)
    assert np.all(np.isfinite(n)) and np.all(n > 0)


@settings(max_examples=8)
@given(tbt=st.floats(0.02, 0.5), name=st.sampled_from(["llama2-70b", "opt-66b", "llama2-7b"]))
def test_looser_target_never_lowers_capacity(tbt, name):
    strict = CapacityTable(MODELS[name], H100, PAPER_TYPES, LatencyTarget(tbt_s=tbt))
    loose = CapacityTable(MODELS[name], H100, PAPER_TYPES, LatencyTarget(tbt_s=tbt * 1.5))
    for shape in strict.shapes(8)[:6]:
        for j in range(4):
            assert loose.rate(shape, j) >= strict.rate(shape, j) * (1 - 1e-9)
            d = strict.detail(shape, j)
            assert d.limit == "tbt-unmet" or d.tbt_s <= tbt * (1 + 1e-9)


def test_longer_outputs_cost_more():
    table = CapacityTable(model_preset("llama2-70b"), H100, PAPER_TYPES)
    for shape in table.shapes(8):
        assert table.rate(shape, 0) > table.rate(shape, 3)  # SISO serves more req/s than LILO
        assert table.rate(shape, 0) > table.rate(shape, 2)  # and more than LISO


def test_cached():
    table = CapacityTable(model_preset("llama2-70b"), H100, PAPER_TYPES)
    shape = ReplicaShape(4)
    assert table.detail(shape, 1) is table.detail(shape, 1)


def test_bad_type_index_and_mix():
    table = CapacityTable(model_preset("llama2-70b"), H100, PAPER_TYPES)
    with pytest.raises(ConfigError, match="type index 7"):
        table.rate(ReplicaShape(4), 7)
    with pytest.raises(ConfigError, match="sum to 1"):
        homogeneous_rate(table, ReplicaShape(4), np.array([0.5, 0.6, 0, 0]))


def test_homogeneous_rate_is_harmonic_mix():
    table = CapacityTable(model_preset("llama2-70b"), H100, PAPER_TYPES)
    shape = ReplicaShape(4)
    n = [table.rate(shape, j) for j in range(4)]
    assert homogeneous_rate(table, shape, np.array([1, 0, 0, 0.0])) == pytest.approx(n[0])
    mix = np.array([0.25] * 4)
    assert homogeneous_rate(table, shape, mix) == pytest.approx(1 / sum(0.25 / x for x in n))


def test_kv_bound_long_outputs_favour_larger_replicas():
    """Long outputs are memory-bound: one TP4 replica beats two TP2 replicas for LILO on Llama-2-70B."""
    table = CapacityTable(model_preset("llama2-70b"), H100, PAPER_TYPES)
    assert table.rate(ReplicaShape(4), 3) > 2 * table.rate(ReplicaShape(2), 3)
    assert math.isfinite(table.rate(ReplicaShape(2), 3))


def test_a_pipeline_limit_keeps_every_deeper_shape_out_of_the_candidates():
    """`max_pp`: the shapes a planner may pick are only those the engines run (vLLM's CPU build: no PP)."""
    model = model_preset("llama2-7b")
    types = FixedLengths(("a",), ((200, 300),), ((50, 60),))
    free = CapacityTable(model, GPUS["h100-80gb"], types, gpus_per_node=2)
    flat = CapacityTable(model, GPUS["h100-80gb"], types, gpus_per_node=2, max_pp=1)
    assert any(s.pp > 1 for s in free.shapes(2))
    assert flat.shapes(2) == tuple(s for s in free.shapes(2) if s.pp == 1) and flat.shapes(2)
