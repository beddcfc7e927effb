"""The scheduler benchmark behind `oserve bench scheduler`: every search on the paper's type mixes. Pure
but for the `timer` handed in (through `search_problem`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from oserve.errors import ConfigError, UnknownNameError
from oserve.scheduler.problem import PlanningProblem
from oserve.scheduler.search import SEARCHES, SearchConfig, check_search_name, search_problem
from oserve.specs import ClusterSpec, ModelSpec, ReplicaShape, cluster_for_gpus
from oserve.workload_types import COMPOSITIONS

# The paper's Table 1: share (%) of each type in the five compositions S1-S5 (one table, in
# `oserve.workload_types`).
PAPER_MIXES: dict[str, dict[str, float]] = COMPOSITIONS
BENCH_GPU_COUNTS = (8, 16, 32, 64, 128)
DEFAULT_LOAD = 1.2
"""Demand as a multiple of what the best homogeneous deployment serves at saturation: near the
cluster's capacity, and enough above it that deployments differ in what they serve."""


def mix_fractions(mix: Mapping[str, float], type_names: Sequence[str]) -> np.ndarray:
    """Shares of a named mix in `type_names` order, summing to 1. Pure."""
    unknown = [k for k in mix if k not in type_names]
    if unknown:
        raise UnknownNameError("workload type", unknown[0], tuple(type_names))
    p = np.array([float(mix.get(name, 0.0)) for name in type_names])
    if p.min() < 0 or p.sum() <= 0:
        raise ConfigError(f"mix shares must be >= 0 with a positive sum, got {dict(mix)}")
    return p / p.sum()


def best_homogeneous(problem: PlanningProblem, mix: np.ndarray) -> tuple[ReplicaShape, int, float]:
    """(shape, replicas, requests/s) of the homogeneous deployment serving the most of `mix` at saturation.

    A replica of shape s serves a mix p at 1 / sum_j p_j / n[s][j] requests/s; the replica count is the
    most that pack on the cluster. Pure.
    """
    best = None
    for s, shape in enumerate(problem.shapes):
        counts = np.zeros(len(problem.shapes), dtype=int)
        while True:
            counts[s] += 1
            if not problem.packs(counts):
                counts[s] -= 1
                break
        rate = counts[s] / float(np.sum(mix / problem.n[s])) if counts[s] else 0.0
        if best is None or rate > best[2]:
            best = (shape, int(counts[s]), rate)
    assert best is not None
    return best


def bench_cases(model: ModelSpec, capacity: object, *, gpu_counts: Sequence[int] = BENCH_GPU_COUNTS,
                mixes: Mapping[str, Mapping[str, float]] = PAPER_MIXES, searches: Sequence[str] = SEARCHES,
                load: float = DEFAULT_LOAD, cluster_for: Callable[[int], ClusterSpec] = cluster_for_gpus,
                config: SearchConfig = SearchConfig(), timer: Callable[[], float] = time.perf_counter,
                on_case: Callable[[dict], None] | None = None) -> list[dict]:
    """One case per (GPU count, mix, search): seconds, throughput, ratio to exhaustive (None beyond its
    reach) and to the MILP (exact, so this is the gap where exhaustive cannot run).

    `capacity` is a `CapacityTable` (or anything with `rate`, `type_names` and `shapes`). The demand of
    a (GPU count, mix) is `load` times the best homogeneous deployment's saturation rate. Exhaustive runs
    first where the cluster has at most `config.exhaustive_max_gpus` GPUs, then the MILP, then the rest,
    so each can be compared with those before it.
    `on_case` is called after each case (progress display).
    """
    for name in searches:
        check_search_name(name)
    if not load > 0:
        raise ConfigError(f"load must be > 0, got {load}")
    type_names = tuple(getattr(capacity, "type_names"))
    order = sorted(searches, key=lambda s: ("exhaustive", "milp").index(s) if s in ("exhaustive", "milp") else 2)
    cases = []
    for gpus in gpu_counts:
        cluster = cluster_for(gpus)
        for mix_name, mix in mixes.items():
            p = mix_fractions(mix, type_names)
            probe = PlanningProblem.build(model, cluster, p, capacity, type_names=type_names)
            shape, count, homogeneous_rps = best_homogeneous(probe, p)
            rates = tuple(float(v) for v in p * homogeneous_rps * load)
            problem = PlanningProblem(cluster, probe.shapes, type_names, rates, probe.capacity_rps, model.name)
            reference = milp_rps = None
            for name in order:
                if name == "exhaustive" and gpus > config.exhaustive_max_gpus:
                    continue
                plan = search_problem(name, problem, config=config, timer=timer)
                if name == "exhaustive":
                    reference = plan.throughput_rps
                if name == "milp":
                    milp_rps = plan.throughput_rps
                case = {
                    "gpus": gpus, "mix": mix_name, "search": name, "seconds": round(plan.solve_s, 4),
                    "throughput": round(plan.throughput_rps, 4),
                    "ratio_to_exhaustive": (None if reference is None or reference <= 0
                                            else round(plan.throughput_rps / reference, 6)),
                    "ratio_to_milp": (None if milp_rps is None or milp_rps <= 0
                                      else round(plan.throughput_rps / milp_rps, 6)),
                    "demand_rps": round(plan.demand_rps, 4),
                    "peak_utilisation": round(plan.peak_utilisation, 6),
                    "homogeneous": {"shape": str(shape), "replicas": count, "throughput": round(homogeneous_rps, 4)},
                    "replicas": [str(r.shape) for r in plan.deployment.replicas],
                    "evaluations": plan.evaluations,
                }
                cases.append(case)
                if on_case is not None:
                    on_case(case)
    return cases


def num_bench_cases(gpu_counts: Sequence[int], num_mixes: int, searches: Sequence[str],
                    config: SearchConfig = SearchConfig()) -> int:
    return sum(num_mixes for g in gpu_counts for s in searches
               if s != "exhaustive" or g <= config.exhaustive_max_gpus)
