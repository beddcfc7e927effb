"""A plan in force: the deployment, and which replicas may serve each workload class. Pure data.

Planners return it (`oserve.planner`, the baselines of `oserve.evaluation`), the simulator applies it
(`oserve.sim.kernel`), the live scheduler publishes it as a strategy and the gateway routes by it
(`oserve.routing`).
"""

from __future__ import annotations

from dataclasses import dataclass

from oserve.errors import ConfigError
from oserve.specs import Deployment


@dataclass(frozen=True, slots=True)
class Decision:
    """A deployment and, per workload class, the replicas that may serve it."""

    deployment: Deployment
    weights: tuple[tuple[float, ...], ...]
    """weights[j][k] >= 0: requests/s of class j the plan gives replica k of `deployment` (the assignment's
    flows; they are rates, not shares). The router sends a class-j request to the least loaded replica
    with a positive weight (`oserve.routing.least_loaded`); a class with no row goes anywhere."""
    switch_s: float = 0.0
    """Seconds until replicas new in this deployment start serving."""
    forecast_rps: tuple[float, ...] = ()
    """The per-class rates the decision was planned for (reported, not used to route)."""
    label: str = ""
    """Why: initial, reroute, rescored, keep, switch (the planner); initial-measured, guard, held, deferred
    (the self-correcting planner, `oserve.planner.adaptive`); static, reload, scale-up, scale-down
    (baselines)."""
    drain_retired: bool = False
    """Retired replicas finish everything they run instead of handing it off when the switch completes
    (free switching, as the perfect-forecast reference assumes: no request is disturbed)."""
    scored_rps: tuple[float, ...] = ()
    """The rates at which the deployment was last scored against the alternatives; the planner rescores
    only when its forecast has moved away from them. Empty: never scored."""
    deferred_spans: int = 0
    """Consecutive spans in which a better deployment was found and the switch to it put off for its cost
    (label `keep`). While positive the planner rescores every span, weighing the switch's cost against
    the demand of the spans the mix has held."""

    def __post_init__(self) -> None:
        n = len(self.deployment.replicas)
        for j, row in enumerate(self.weights):
            if len(row) != n or any(not w >= 0 for w in row):
                raise ConfigError(f"Decision: weights[{j}] must hold {n} values >= 0, got {row}")
        if self.deferred_spans < 0:
            raise ConfigError(f"Decision: deferred_spans must be >= 0, got {self.deferred_spans}")
        if not self.switch_s >= 0:
            raise ConfigError(f"Decision: switch_s must be >= 0, got {self.switch_s}")

    def eligible(self, class_index: int) -> tuple[float, ...] | None:
        """Class `class_index`'s weights over the replicas; None when the decision has no row for it. Pure."""
        return self.weights[class_index] if 0 <= class_index < len(self.weights) else None
