"""Every threshold of OServe's planner, named, with its reason; one frozen object. Pure.

The defaults of the thresholds marked "tuned" come from `oserve bench tune` on the tuning scenarios
(`oserve.evaluation.tuning.TUNING_SET`: S1, S3, T1, T3, azure-code; Llama-2-70B, 16 GPUs, load 0.8);
`oserve bench e2e` reports on the disjoint test set. The tuning's geometric-mean P99 speedup over
vllm-static on its set was 1.045 at these defaults (1.036 with neighbour_min_gain 0.1, 0.992 with 0.2
or with neighbour_capacity_slack 0; switch_gain 0.05, 0.1 and 0.2 tied; 2026-12-01). measured_bonus was
tuned after the others (2026-12-03, with the twin's recent lengths and the measured deployment a
candidate): 1.061 at 0, 1.047 at 0.05, 1.010 at 0.1, 1.000 at 0.2; 1.044 before either change.
class_lengths and correction were chosen last (2026-12-06, `oserve bench levers --set tuning`, OServe
with its real estimator): "estimated" without moves 1.061 (the defaults until then), "estimated" with
moves 1.055, "types" without moves 1.035, "types" with moves 1.076, its worst scenario 1.000.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from oserve.errors import ConfigError
from oserve.correction import CorrectionConfig
from oserve.planner.prior import CLASS_LENGTHS
from oserve.planner.twin import TwinConfig
from oserve.scheduler import SEARCHES
from oserve.scheduler.search import SearchConfig


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """How OServe's planner searches, scores and decides to switch."""

    search: str = "milp"
    """Deployment search (`oserve.scheduler.search`) whose plans seed the candidates."""
    search_config: SearchConfig = field(default_factory=lambda: SearchConfig(fewer_replicas_slack=0.02))
    """Its settings; without the twin, the plan it returns is the one deployed."""
    candidate_slacks: tuple[float, ...] = (0.0, 0.02, 0.05)
    """The MILP is solved once per slack of its fewest-replicas phase (headroom traded for fewer replicas),
    each answer a candidate. Llama-2-70B's best deployments lie within a few percent of each other in
    the capacity table while their tails differ by tens of percent, so a few slacks give the twin real
    choices to tell apart."""
    num_homogeneous_candidates: int = 3
    """The best homogeneous deployments for the forecast's mix, by modelled capacity, are candidates too:
    when the mix is even, a uniform deployment is often the best, and the MILP's tie-breaking may miss it."""
    twin: TwinConfig | None = field(default_factory=TwinConfig)
    """Score candidates on the digital twin; None: the capacity model alone decides (the MILP's plan,
    switched by `busy_peak_utilisation` / `min_peak_drop`)."""
    rescore_change: float = 0.1
    """Candidates are rescored only when the forecast moved (relative L1 from the rates last scored) by
    more than this and than twice what Poisson noise explains: a rescore costs a second or more."""
    switch_gain: float = 0.1
    """Tuned. Switch only to a deployment whose twin score beats what runs by this fraction: the best of
    several candidates on one synthetic span looks better than it is (selection on noise)."""
    max_switch_loss_frac: float = 0.1
    """A switch may take out of service at most this fraction of the demand (capacity of the replicas
    leaving times the switching time) of the spans the mix has held: beyond it, the switch costs more than
    it is expected to gain. A switch put off is reconsidered every span while the mix holds, its cost
    weighed against one more span's demand each time (`Decision.deferred_spans`)."""
    neighbour_steps: int = 2
    """Moves of steepest descent on the twin from the best candidate (a replica reshaped, split, or two
    merged; `oserve.planner.neighbours`); 0 turns the search off."""
    neighbour_min_gain: float = 0.05
    """Tuned. A move must beat the current score by this fraction: the best of thirty neighbours on one
    synthetic span looks better than it is, so a bar above 0 keeps moves that are only noise out."""
    neighbour_capacity_slack: float = 0.05
    """Tuned. A neighbour's peak utilisation for the forecast may exceed the candidates' lowest by at most
    this fraction: the twin scores one span at the forecast's load, and a deployment that trades
    capacity for speed there is overrun when the load rises."""
    max_twin_scores: int | None = None
    """At most this many twin scorings per decision after the first (the candidates in their order — what
    runs now first — then the neighbours); None: no limit. It is how a decision is held to a time
    budget: a count, not a clock, so the same inputs and config give the same decision on any machine,
    in the simulator or live (the live system sets 4, `oserve.workers.system.SystemConfig`; the
    simulator's OServe has no limit unless `EvalConfig.planner` sets one). The MILP solves that build
    the candidates are not counted; the live scheduler measures the whole decision and publishes it."""
    measured_bonus: float = 0.0
    """Tuned. The deployment measured to serve best on whole runs before the window (the static candidates
    on the history, `oserve.planner.adaptive.SelfCorrectingPlanner`; none live unless seeded) is always a
    candidate, its twin score counted this fraction lower. The case for a bonus: it was measured over a
    whole run, the others are scored on one synthetic span. The case against, which the tuning set
    decided: searched over 0, 0.05, 0.1 and 0.2, no bonus was best there; a bonus held OServe on the
    measured shape where a heterogeneous plan gained."""
    min_served_gain_frac: float = 0.01
    """Capacity model only: switch to serve more only when the new plan serves this fraction more."""
    busy_peak_utilisation: float = 0.8
    """Capacity model only: when both plans serve everything, switch only away from a peak replica
    utilisation above this (queueing delay grows like 1 / (1 - utilisation)) ..."""
    min_peak_drop: float = 0.15
    """... and only to a plan whose peak utilisation is lower by at least this."""
    served_tolerance_frac: float = 0.001
    """A plan 'serves everything' when it serves all but this fraction of the demand (LP round-off)."""
    class_lengths: str = "types"
    """What the capacity table OServe plans with, and so the deployment search, takes each class to
    contain (`oserve.planner.prior.planning_table`): "estimated", what the estimator's class really
    holds, misclassed requests included, so plans hedge against the estimator's errors; "types", the type
    itself, as if every request were classed right, so plans give types their own replicas and leave the
    errors to the twin (which replays what each class really held lately) and to `correction`. Tuned,
    with `correction`: "types" pays only with the moves (module docstring). The live system's default is
    its own (`oserve.workers.system.SystemConfig`)."""
    correction: CorrectionConfig | None = field(default_factory=CorrectionConfig)
    """Requests that outgrow the class they were routed as move to a replica of the class they grew into
    (`oserve.correction`): the gateway moves them, and the twin scores every plan with those moves, so a
    plan that gives classes their own replicas is scored as the correction will serve it. None: requests
    stay where routed. Tuned, with `class_lengths`."""
    free_switching: bool = False
    """Switches cost nothing and retired replicas finish their requests: the perfect-forecast reference
    (`oserve.evaluation`), never the product."""

    def __post_init__(self) -> None:
        if self.search not in SEARCHES:
            raise ConfigError(f"PlannerConfig.search must be one of {', '.join(SEARCHES)}, got {self.search!r}")
        if not self.candidate_slacks or any(not 0 <= s < 1 for s in self.candidate_slacks):
            raise ConfigError(f"PlannerConfig.candidate_slacks must be fractions in [0, 1), got "
                              f"{self.candidate_slacks}")
        if self.max_twin_scores is not None and self.max_twin_scores < 2:
            raise ConfigError(f"PlannerConfig.max_twin_scores must be None or >= 2 (what runs and one rival), got "
                              f"{self.max_twin_scores}")
        if self.num_homogeneous_candidates < 0 or self.neighbour_steps < 0:
            raise ConfigError(f"PlannerConfig: num_homogeneous_candidates and neighbour_steps must be >= 0, got "
                              f"{self.num_homogeneous_candidates}, {self.neighbour_steps}")
        for name in ("rescore_change", "switch_gain", "measured_bonus", "max_switch_loss_frac", "neighbour_min_gain",
                     "min_served_gain_frac", "busy_peak_utilisation", "min_peak_drop", "served_tolerance_frac"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ConfigError(f"PlannerConfig.{name} must be in [0, 1), got {value!r}")
        if self.class_lengths not in CLASS_LENGTHS:
            raise ConfigError(f"PlannerConfig.class_lengths must be one of {', '.join(CLASS_LENGTHS)}, got "
                              f"{self.class_lengths!r}")
        if not self.neighbour_capacity_slack >= 0:
            raise ConfigError(f"PlannerConfig.neighbour_capacity_slack must be >= 0, got "
                              f"{self.neighbour_capacity_slack}")
