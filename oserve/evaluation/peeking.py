"""What each kind of peeking was worth: the knowledge the evaluation used to give away, put back one kind
at a time. For measurement only: no product policy and no default comparison uses anything here.

Before the evaluation became honest (`oserve.evaluation.compare`), OServe's simulated gateway routed
each request by its true type (its output length known at arrival), its types, capacity table and
twin lengths were fitted on the window it served, and the static baseline's shape was chosen with
hindsight (simulated on the window) and routed round robin. `ablation` runs OServe and the static
baseline once per step from that state to the honest one, each step removing one kind of peeking:

1. all of it (the old evaluation);
2. the static baseline routes least-loaded, as every policy now does;
3. the static shape is chosen on the history instead of the window;
4. OServe's models are fitted on the history instead of history and window;
5. OServe classes each request at arrival by the estimator instead of by its true type: honest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from oserve.capacity import CapacityTable
from oserve.evaluation.compare import EvalConfig, choose_static, prepare, speedup
from oserve.evaluation.policies import OServePolicy
from oserve.evaluation.registry import Setup
from oserve.evaluation.scenarios import Scenario
from oserve.planner.context import PlanningContext
from oserve.planner.prior import Prior, fit_prior
from oserve.sim.kernel import ArrivalInfo, SimResult, simulate
from oserve.specs import ClusterSpec, ModelSpec
from oserve.traces import Trace

STEPS: tuple[str, ...] = (
    "old: true types, fitted on the window, static with hindsight and round robin",
    "static routed least-loaded",
    "static chosen on the history",
    "OServe fitted on the history",
    "OServe classes at arrival (honest)",
)


class TrueTypePolicy(OServePolicy):
    """OServe told each request's true type at arrival (from the window it is handed): the old peek."""

    def __init__(self, setup: Setup, window: Trace) -> None:
        super().__init__(setup.ctx, setup.prior, setup.new_forecaster(), setup.span_s, setup.planner,
                         name="oserve-true-types")
        self.window = window
        self.types = setup.prior.types
        self._served_output = window.served(setup.model.max_context_tokens)[1]  # its true length, as served

    def classify(self, arrival: ArrivalInfo) -> int:
        return self._record(arrival, self.true_type(arrival))

    def class_so_far(self, input_tokens: int, generated_tokens: int) -> int:
        return self.types.classify_one(input_tokens, generated_tokens)

    def class_log_outputs(self) -> np.ndarray:
        return np.array(self.types.centroids_log)[:, 1]

    def true_type(self, arrival: ArrivalInfo) -> int:
        return self.types.classify_one(arrival.input_tokens, int(self._served_output[arrival.request_index]))


def true_type_setup(setup: Setup, prior: Prior, config: EvalConfig) -> Setup:
    """`setup` with `prior` planned as the old evaluation planned: each class is a type itself (its
    capacity the type's), as when requests are routed by their true type."""
    model, cluster = setup.model, setup.cluster
    table = CapacityTable(model, cluster.gpu, prior.types, config.target, gpus_per_node=cluster.gpus_per_node)
    return replace(setup, prior=replace(prior, lengths=prior.types, table=table),
                   ctx=PlanningContext(model, cluster, table, config.costs, classes=prior.types))


def window_prior(scenario: Scenario, model: ModelSpec, cluster: ClusterSpec, config: EvalConfig) -> Prior:
    """A prior fitted on the history and the window together (the old peek), its span counts the
    history's only."""
    shifted = Trace(scenario.window.arrival_s + scenario.history_s, scenario.window.input_tokens,
                    scenario.window.output_tokens, max_tokens=scenario.window.max_tokens,
                    client_ids=scenario.window.client_ids)
    both = Trace.concat([scenario.history, shifted], "history+window")
    prior = fit_prior(both, model, cluster, target=config.target, span_s=config.sim.span_s,
                      duration_s=scenario.history_s + scenario.window.duration_s + 1.0)
    num_history_spans = int(np.ceil(scenario.history_s / config.sim.span_s - 1e-9))
    return replace(prior, counts=prior.counts[:num_history_spans])


def window_runner(model: ModelSpec, cluster: ClusterSpec, scenario: Scenario, config: EvalConfig,
                  progress: Callable[[str], None] | None = None) -> Callable[[str, object], SimResult]:
    """`run(label, policy)`: the policy simulated on the scenario's window, `progress(label)` told first."""
    def run(label: str, policy) -> SimResult:
        if progress is not None:
            progress(label)
        return simulate(model, cluster.gpu, cluster, scenario.window, policy, config.sim)
    return run


@dataclass(frozen=True)
class AblationRow:
    step: str
    oserve_p99_s: float
    static_p99_s: float
    speedup: float
    static_shape: str


def ablation(model: ModelSpec, cluster: ClusterSpec, scenario: Scenario, config: EvalConfig = EvalConfig(),
             progress: Callable[[str], None] | None = None) -> list[AblationRow]:
    """OServe and vllm-static at each step of `STEPS` (module docstring), on the scenario's window."""
    honest = prepare(model, cluster, scenario, config).setup
    peeked_prior = window_prior(scenario, model, cluster, config)
    hindsight, _ = choose_static(model, cluster, replace(scenario, history=scenario.window,
                                                         history_s=scenario.window.duration_s + 1.0),
                                 honest.prior, config)

    run = window_runner(model, cluster, scenario, config, progress)

    from oserve.evaluation.baselines import RoundRobinPolicy, StaticPolicy

    k = len(honest.prior.class_names)
    static = {
        "rr-hindsight": run("static rr, hindsight", RoundRobinPolicy(hindsight, k)),
        "ll-hindsight": run("static least-loaded, hindsight", StaticPolicy(hindsight, k)),
        "ll-history": run("static least-loaded, history", StaticPolicy(honest.static, k)),
    }
    oserve = {
        "peeked": run("oserve, true types, window fit",
                      TrueTypePolicy(true_type_setup(honest, peeked_prior, config), scenario.window)),
        "history": run("oserve, true types, history fit",
                       TrueTypePolicy(true_type_setup(honest, honest.prior, config), scenario.window)),
        "honest": run("oserve, honest", OServePolicy(honest.ctx, honest.prior, honest.new_forecaster(), honest.span_s,
                                                    honest.planner)),
    }
    plan = (("peeked", "rr-hindsight", hindsight), ("peeked", "ll-hindsight", hindsight),
            ("peeked", "ll-history", honest.static), ("history", "ll-history", honest.static),
            ("honest", "ll-history", honest.static))
    return [AblationRow(step, oserve[o].percentile("e2e", 99), static[s].percentile("e2e", 99),
                        speedup(oserve[o], static[s]), str(dep.replicas[0].shape))
            for step, (o, s, dep) in zip(STEPS, plan)]
