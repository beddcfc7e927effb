"""Switching deployments GPU-to-GPU: where every byte lives, the transfer plan, the KV policy. Pure.

`layout` says which lines of which tensor (weights and KV cache) each GPU holds; `planner` turns a
source and a target deployment into a `SwitchPlan` (the paper's greedy or our improved planner, with a
lower bound and the reload baseline); `kv` decides which running requests drain and which migrate.
The multi-process executor that moves real tensors lives in `oserve.switch.executor` and is not
imported here (it needs torch).
"""

from oserve.switch.kv import KVBuffer, KVMigration, KVMigrationPlan, KVPolicy, plan_kv_migration
from oserve.switch.layout import (RunningRequest, Shard, TensorSpec, deployment_weight_layout, gpu_weight_shards,
                                  kv_lines, kv_tensor, model_tensors, replica_kv_layout, replica_weight_layout)
from oserve.switch.planner import (LINKS, PLANNERS, SwitchConfig, SwitchPlan, Transfer, TransferPlan, plan_switch,
                                   plan_transfers, relabel, reload_seconds, schedule)

__all__ = [
    "LINKS", "PLANNERS", "KVBuffer", "KVMigration", "KVMigrationPlan", "KVPolicy", "RunningRequest", "Shard",
    "SwitchConfig", "SwitchPlan", "TensorSpec", "Transfer", "TransferPlan", "deployment_weight_layout",
    "gpu_weight_shards", "kv_lines", "kv_tensor", "model_tensors", "plan_kv_migration", "plan_switch",
    "plan_transfers", "relabel", "reload_seconds", "replica_kv_layout", "replica_weight_layout", "schedule",
]
