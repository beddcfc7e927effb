"""The accuracy curve's classes (`oserve.evaluation.uncertainty`): each request right with the set
probability, the errors really errors, nested across accuracies, and the 100% point the true type as
served (capped at the context window), checked against the kernel's own record of lengths."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from oserve.evaluation.compare import EvalConfig, class_accuracy, prepare
from oserve.evaluation.peeking import TrueTypePolicy, true_type_setup
from oserve.evaluation.scenarios import build_scenario
from oserve.errors import ConfigError
from oserve.evaluation.uncertainty import NoisyTypePolicy, with_class_lengths, wrong_class
from oserve.planner.config import PlannerConfig
from oserve.planner.prior import planning_table
from oserve.sim.kernel import ArrivalInfo, simulate
from oserve.specs import GPUS, cluster_for_gpus, model_preset

LLAMA = model_preset("llama2-70b")
CONFIG = EvalConfig(static_candidates=1, bound=False)


@given(st.integers(2, 9).flatmap(lambda k: st.tuples(st.just(k), st.integers(0, k - 1))),
       st.floats(0.0, 1.0, exclude_max=True))
def test_a_wrong_class_is_another_class(k_true, u) -> None:
    k, true = k_true
    j = wrong_class(true, k, u)
    assert 0 <= j < k and j != true


@given(st.integers(2, 9).flatmap(lambda k: st.tuples(st.just(k), st.integers(0, k - 1))))
def test_wrong_classes_cover_every_other_class(k_true) -> None:
    k, true = k_true
    assert {wrong_class(true, k, (i + 0.5) / (k - 1)) for i in range(k - 1)} == set(range(k)) - {true}


@pytest.fixture(scope="module")
def typed():
    cluster = cluster_for_gpus(8)
    scenario = build_scenario("S5", LLAMA, cluster, minutes=4, history_minutes=3, seed=2)
    setup = prepare(LLAMA, cluster, scenario, CONFIG, needs_static=False).setup
    return scenario, true_type_setup(setup, setup.prior, CONFIG)


def _classes(policy, window, admitted) -> np.ndarray:
    return np.array([policy.classify(ArrivalInfo(int(i), float(window.arrival_s[i]), int(window.input_tokens[i]),
                                                 int(window.max_tokens[i]), int(window.client_ids[i])))
                     for i in np.nonzero(admitted)[0]])


def test_each_request_is_right_with_the_set_probability_and_errors_nest(typed) -> None:
    scenario, setup = typed
    window = scenario.window
    refused, served = window.served(LLAMA.max_context_tokens)
    admitted = ~refused
    truth = setup.prior.types.classify(window.input_tokens[admitted], served[admitted])
    right = {}
    for p in (1.0, 0.9, 0.8, 0.0):
        got = _classes(NoisyTypePolicy(setup, window, p, seed=3), window, admitted)
        right[p] = got == truth
        n = len(got)
        assert abs(right[p].mean() - p) <= 4 * np.sqrt(p * (1 - p) / n) + 1e-12, (p, right[p].mean())
    assert right[1.0].all() and not right[0.0].any()
    assert np.all(right[1.0] >= right[0.9]) and np.all(right[0.9] >= right[0.8])  # nested errors


def test_the_true_type_is_the_served_length_s_type(typed) -> None:
    """Some of the window's answers are longer than the context window leaves them: the true type is
    the type of what is served, the kernel's record agrees, so the 100% point is 100% right."""
    scenario, setup = typed
    window = scenario.window
    refused, served = window.served(LLAMA.max_context_tokens)
    assert (served[~refused] < window.output_tokens[~refused]).any()  # the case this test is about
    policy = TrueTypePolicy(setup, window)
    result = simulate(LLAMA, GPUS["h100-80gb"], setup.cluster, window, policy, CONFIG.sim)
    assert class_accuracy(result, setup.prior) == 1.0


def test_planning_classes_as_types_changes_the_planning_table_and_nothing_else(typed) -> None:
    """`class_lengths="types"` (the plan lever of `oserve bench levers`) plans with the table of the types
    themselves, the one the true-type reference plans with; "estimated" with the prior's (what each
    estimated class held). The prior, the static deployment chosen on the history (every candidate's P99
    included), what was measured there, and vllm-reload's table are the same under both."""
    from dataclasses import replace

    from oserve.evaluation.registry import policy_spec

    scenario, reference = typed
    cluster = reference.cluster
    shapes = reference.ctx.table.shapes(cluster.num_gpus)
    prepared = {how: prepare(LLAMA, cluster, scenario, replace(CONFIG, planner=PlannerConfig(class_lengths=how)))
                for how in ("estimated", "types")}
    est, typ = prepared["estimated"].setup, prepared["types"].setup
    assert np.array_equal(typ.ctx.table.matrix(shapes), reference.ctx.table.matrix(shapes))
    assert np.array_equal(est.ctx.table.matrix(shapes), est.prior.table.matrix(shapes))
    assert not np.array_equal(est.ctx.table.matrix(shapes), typ.ctx.table.matrix(shapes))
    assert est.static == typ.static and est.static.replicas
    assert prepared["estimated"].static_tried == prepared["types"].static_tried
    assert [(m.deployment, m.p99_s) for m in est.measured] == [(m.deployment, m.p99_s) for m in typ.measured]
    assert np.array_equal(est.prior.counts, typ.prior.counts) and est.prior.accuracy == typ.prior.accuracy
    # the lever moved by `with_class_lengths` is the same one
    assert np.array_equal(with_class_lengths(est, "types").ctx.table.matrix(shapes), typ.ctx.table.matrix(shapes))
    assert with_class_lengths(typ, "estimated").ctx.table is typ.prior.table
    # vllm-reload is a baseline: it plans by what the classes carry whatever OServe's lever
    for setup in (est, typ):
        reload = policy_spec("vllm-reload").build(setup)
        assert np.array_equal(reload.ctx.table.matrix(shapes), est.prior.table.matrix(shapes))


def test_class_lengths_must_be_a_known_kind(typed) -> None:
    with pytest.raises(ConfigError, match="class_lengths"):
        PlannerConfig(class_lengths="guessed")
    with pytest.raises(ConfigError, match="class_lengths"):
        planning_table(typed[1].prior, "guessed")


def test_levers_move_with_the_correction_the_config_gives(monkeypatch) -> None:
    """`levers` runs its move variants with `config.planner.correction` when no correction is handed in, and
    its no-move variants with none (before, the config's correction was ignored for the defaults)."""
    import oserve.evaluation.uncertainty as uncertainty
    from oserve.correction import CorrectionConfig

    seen = []

    class Recording(uncertainty.OServePolicy):
        def __init__(self, *args, **kwargs) -> None:
            seen.append(args[4].correction)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(uncertainty, "OServePolicy", Recording)
    cluster = cluster_for_gpus(8)
    mine = CorrectionConfig(interval_s=2.5, max_moves_per_round=3)
    config = EvalConfig(static_candidates=1, bound=False, planner=PlannerConfig(correction=mine))
    curve = uncertainty.levers(LLAMA, cluster, build_scenario("S5", LLAMA, cluster, load=0.8, minutes=1.0), config,
                               variants=(("types", "types", False), ("types + moves", "types", True)))
    assert [p.label for p in curve.points] == ["types", "types + moves"]
    assert seen == [None, mine]
