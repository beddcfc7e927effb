"""The static baseline's decision: one deployment for every span, every class on every replica. Pure.

The live demo's static run plans with `StaticPlanner`; the simulator's vllm-static policy routes by the
same `everywhere` weights. Both serve the one deployment with the routing rule every policy gets
(`oserve.routing.least_loaded` over all replicas).
"""

from __future__ import annotations

import numpy as np

from oserve.decision import Decision
from oserve.errors import ConfigError
from oserve.planner.twin import ArrivalPattern
from oserve.specs import Deployment


def everywhere(deployment: Deployment, num_classes: int) -> tuple[tuple[float, ...], ...]:
    """Weights that let every class use every replica. Pure."""
    return tuple((1.0,) * len(deployment.replicas) for _ in range(num_classes))


class StaticPlanner:
    """Always the same deployment (what an operator deploys once); same call as `OServePlanner.plan`."""

    def __init__(self, deployment: Deployment, class_names: tuple[str, ...]) -> None:
        if not deployment.replicas:
            raise ConfigError("StaticPlanner: the deployment has no replica")
        self.deployment = deployment
        self.class_names = tuple(class_names)

    def plan(self, rates_rps: np.ndarray, current: Decision | None, recent: ArrivalPattern | None,
             span_s: float) -> Decision:
        """The one deployment (the one in force, once there is one: the same replicas, so never a switch),
        every class routed to every replica (`rates_rps` only recorded)."""
        rates = tuple(float(r) for r in np.asarray(rates_rps, dtype=float))
        if len(rates) != len(self.class_names):
            raise ConfigError(f"StaticPlanner.plan: {len(rates)} rates for {len(self.class_names)} classes")
        dep = current.deployment if current is not None and current.deployment.replicas else self.deployment
        return Decision(dep, everywhere(dep, len(self.class_names)), 0.0, rates, "static")
