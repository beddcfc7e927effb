"""What planning needs besides the forecast: model, cluster, capacity table, and what a switch costs. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field

from oserve.capacity import CapacityTable
from oserve.defaults import ENGINE_START_S
from oserve.errors import ConfigError
from oserve.specs import ClusterSpec, Deployment, ModelSpec
from oserve.switch import SwitchConfig, plan_switch
from oserve.switch.planner import reload_seconds
from oserve.workload_types import WorkloadTypes


@dataclass(frozen=True, slots=True)
class SwitchCosts:
    """How long replicas are out of service when a deployment changes (the switch planner's models)."""

    engine_start_s: float = ENGINE_START_S
    """Starting an engine on GPUs that hold (or are receiving) its weights (`oserve.defaults`)."""
    disk_bytes_per_s: float = 3.0e9
    """Per-node storage bandwidth a reload reads weights at (the GPUs of a node share it)."""
    gpu_copy_efficiency: float = 0.8
    """Fraction of the modelled link bandwidth a weight transfer achieves."""

    def __post_init__(self) -> None:
        if self.engine_start_s < 0 or not self.disk_bytes_per_s > 0 or not 0 < self.gpu_copy_efficiency <= 1:
            raise ConfigError(f"SwitchCosts: invalid values {self}")

    def switch_config(self) -> SwitchConfig:
        # No relay plans here: with GPUs relabelled they changed one of the eight 32-GPU switches of `oserve bench
        # switch`, by 0.2%, and they made planning up to 3x slower; a decision prices many switches.
        return SwitchConfig(disk_bytes_per_s=self.disk_bytes_per_s, engine_start_s=self.engine_start_s, relay=False)

    def reload_s(self, model: ModelSpec, cluster: ClusterSpec, old: Deployment, target: Deployment) -> float:
        """The switch planner's reload baseline: changed replicas read their shards from disk, then start."""
        return reload_seconds(model, cluster, old, target, self.switch_config())

    def gpu_to_gpu(self, model: ModelSpec, cluster: ClusterSpec, old: Deployment,
                   target: Deployment) -> tuple[Deployment, float]:
        """The target as the improved switch planner places it, and the switch time: engine start plus
        the planner's modelled time to move every needed weight byte (kept replicas move nothing)."""
        plan = plan_switch(model, cluster, old, target, planner="improved", config=self.switch_config())
        return plan.target, plan.switch_seconds / self.gpu_copy_efficiency + self.engine_start_s


@dataclass(frozen=True)
class PlanningContext:
    """What every planner shares: the model, the cluster, the capacity table of the classes planned for,
    and the switch costs."""

    model: ModelSpec
    cluster: ClusterSpec
    table: CapacityTable
    costs: SwitchCosts = field(default_factory=SwitchCosts)
    classes: WorkloadTypes | None = None
    """The centroids requests are classed by (the prior's types), for the twin to reclass a request that
    outgrows its class as the gateway does (`PlannerConfig.correction`); None: the twin does not."""

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.table.type_names
