"""The paper's qualitative claims about deployments, on the real capacity table (performance model +
workload types fitted on the bundled Azure conversation trace)."""

from __future__ import annotations

import numpy as np
import pytest

from oserve.capacity import CapacityTable
from oserve.scheduler import PlanningProblem, search_problem
from oserve.scheduler.bench import PAPER_MIXES, best_homogeneous, mix_fractions
from oserve.specs import cluster_for_gpus, gpu_preset, model_preset
from oserve.workload_types import fit_types
from oserve.traces import load_trace

LONG_OUTPUT = {"SILO": 50.0, "LILO": 50.0}
SHORT_OUTPUT = {"SISO": 50.0, "LISO": 50.0}


@pytest.fixture(scope="module")
def types():
    trace = load_trace("azure-conv")
    return fit_types(trace.input_tokens, trace.output_tokens)


def table_for(model_name: str, types) -> CapacityTable:
    return CapacityTable(model_preset(model_name), gpu_preset("h100"), types)


def problem_at(table: CapacityTable, mix: dict[str, float], gpus: int = 16, load: float = 1.2) -> PlanningProblem:
    """Demand `load` times what the best homogeneous deployment serves of the mix at saturation."""
    p = mix_fractions(mix, table.type_names)
    probe = PlanningProblem.build(table.model, cluster_for_gpus(gpus), p, table)
    _, _, saturation_rps = best_homogeneous(probe, p)
    return PlanningProblem.build(table.model, cluster_for_gpus(gpus), p * saturation_rps * load, table)


def best_homogeneous_throughput(problem: PlanningProblem) -> float:
    """The most any deployment of one shape serves of the problem's demand (exact evaluation)."""
    best = 0.0
    for s in range(len(problem.shapes)):
        counts = np.zeros(len(problem.shapes), dtype=int)
        while True:
            counts[s] += 1
            if not problem.packs(counts):
                counts[s] -= 1
                break
        best = max(best, problem.evaluate(counts).throughput_rps)
    return best


def sizes(plan) -> list[int]:
    return [r.shape.num_gpus for r in plan.deployment.replicas]


@pytest.mark.parametrize("model_name", ["llama-30b", "opt-30b"])
def test_long_outputs_get_fewer_larger_replicas(types, model_name: str) -> None:
    """Memory-bound (long-output) mixes want KV cache: fewer, larger replicas; compute-bound
    (short-output) mixes want more, smaller ones. The paper shows this on its MHA models."""
    table = table_for(model_name, types)
    long_plan = search_problem("milp", problem_at(table, LONG_OUTPUT))
    short_plan = search_problem("milp", problem_at(table, SHORT_OUTPUT))
    assert len(long_plan.deployment.replicas) < len(short_plan.deployment.replicas)
    assert np.mean(sizes(long_plan)) > np.mean(sizes(short_plan))
    # Between the paper's own compositions, S2 (most long outputs) vs S5 (fewest), the trend holds but may
    # tie: with GEMM efficiencies bounded at the hardware's (oserve.calibration), LLaMA-30B's S2 and S5
    # plans both have three replicas of 16/3 GPUs on average.
    s2 = search_problem("milp", problem_at(table, PAPER_MIXES["S2"]))
    s5 = search_problem("milp", problem_at(table, PAPER_MIXES["S5"]))
    assert len(s2.deployment.replicas) <= len(s5.deployment.replicas)
    assert np.mean(sizes(s2)) >= np.mean(sizes(s5))


@pytest.mark.parametrize("model_name,capacity_gain,overload_gain", [
    ("llama-30b", 1.03, 1.01),
    ("llama2-70b", 1.003, 1.001),  # GQA: KV is cheap, replica shapes differ less, so does the gain
])
def test_mixed_workload_gets_a_heterogeneous_deployment_beating_homogeneous(
        types, model_name: str, capacity_gain: float, overload_gain: float) -> None:
    """S1 (the most even mix) on 16 GPUs: the best deployment mixes shapes and beats every homogeneous one,
    both in how much of the mix it can carry (at the best homogeneous deployment's saturation rate it
    serves everything below full utilisation) and in what it serves under overload."""
    table = table_for(model_name, types)
    at_saturation = problem_at(table, PAPER_MIXES["S1"], load=1.0)
    plan = search_problem("milp", at_saturation)
    assert len({r.shape for r in plan.deployment.replicas}) >= 2
    assert plan.throughput_rps == pytest.approx(plan.demand_rps, rel=1e-9)
    assert 1.0 / plan.peak_utilisation >= capacity_gain  # the mix could grow this much and still be served
    overload = problem_at(table, PAPER_MIXES["S1"], load=1.3)
    plan = search_problem("milp", overload)
    assert len({r.shape for r in plan.deployment.replicas}) >= 2
    assert plan.throughput_rps >= overload_gain * best_homogeneous_throughput(overload)
