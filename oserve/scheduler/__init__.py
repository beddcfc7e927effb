"""Two-level workload-aware scheduler: the assignment of types to replicas, and the deployment search.

Pure: data in, frozen dataclasses out; no clock except the `timer` a search is handed to report its
solve time.
"""

from oserve.scheduler.assignment import Assignment, assign, violations
from oserve.scheduler.flownet import flow_network, max_flow_value, normalisation, saturated_replicas, with_flow
from oserve.scheduler.packing import can_pack, place
from oserve.scheduler.problem import CapacityFn, Evaluation, PlanningProblem, capacity_fn, resolve_rates
from oserve.scheduler.search import SEARCHES, Plan, SearchConfig, search, search_problem

__all__ = [
    "SEARCHES", "Assignment", "CapacityFn", "Evaluation", "Plan", "PlanningProblem", "SearchConfig", "assign",
    "can_pack", "capacity_fn", "flow_network", "max_flow_value", "normalisation", "place", "resolve_rates",
    "saturated_replicas", "search", "search_problem", "violations", "with_flow",
]
