"""What the planner knows before it serves: models fitted on history, never on the window served. Pure.

From a history trace (the requests before the window: a warm-up prefix, an earlier hour or day),
`fit_prior` fits, in this order and from nothing else:
- the workload types (k-means on the history's true lengths: every history request has completed);
- the arrival-time estimator (`oserve.online_types.OnlineTypes`), replayed over the history as a
  gateway runs it: each request classified at arrival with what it knows then (input length, max
  tokens, client), then learned from its completion;
- what each estimated class really contains (`FixedLengths.from_observed`): the true lengths of the
  requests the estimator put in it, so plans and the twin reason about classes as routed, errors
  included, not about perfectly separated types;
- the capacity table of those classes, and the per-span class counts the forecaster starts from.

That table is what the classes really carry, and what the static baseline is chosen by. The table
OServe plans with is `planning_table(prior, PlannerConfig.class_lengths)`: that one, or the types' own
(each class planned as if every request in it were classed right).

The live system fits the same from the trace it starts with (`oserve.workers.system`); the
simulator's evaluation from a scenario's history (`oserve.evaluation.scenarios`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import numpy as np

from oserve.capacity import CapacityTable, FixedLengths, LatencyTarget
from oserve.defaults import SPAN_S
from oserve.errors import ConfigError
from oserve.online_types import OnlineTypes
from oserve.specs import ClusterSpec, ModelSpec
from oserve.traces import Trace
from oserve.workload_types import WorkloadTypes, fit_types

CLASS_LENGTHS: tuple[str, ...] = ("estimated", "types")
"""What a planning table takes a class to contain (`planning_table`, `PlannerConfig.class_lengths`)."""


@dataclass(frozen=True, eq=False)
class Prior:
    """Everything fitted on history (see the module docstring)."""

    types: WorkloadTypes
    """The types, fitted on the history's true lengths: the estimator's classes and their names."""
    estimator: OnlineTypes
    """The arrival-time estimator as the history left it; use `fresh_estimator()` for a copy to run."""
    lengths: FixedLengths
    """What each class, as estimated at arrival, really contains (true lengths)."""
    table: CapacityTable
    """Capacity n[shape][class] of those classes."""
    counts: np.ndarray
    """(history spans, classes) requests per span and estimated class, oldest first."""
    span_s: float
    accuracy: float
    """Fraction of the history's requests whose class at arrival was their true type (NaN if none)."""

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.types.names

    def fresh_estimator(self) -> OnlineTypes:
        """An independent copy of the estimator, to run forward from the end of the history."""
        return copy.deepcopy(self.estimator)


def admitted_lengths(trace: Trace, model: ModelSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mask of requests the model's context window admits, their input tokens, the tokens they generate):
    input plus max tokens (1 when none is given) must fit, and an answer stops at the window or at its
    max tokens, as vLLM serves them. Pure."""
    refused, out = trace.served(model.max_context_tokens)
    ok = ~refused
    return ok, trace.input_tokens[ok], out[ok]


def fit_prior(history: Trace, model: ModelSpec, cluster: ClusterSpec, *, target: LatencyTarget = LatencyTarget(),
              span_s: float = SPAN_S, k: int = 4, seed: int = 0, duration_s: float | None = None,
              max_pp: int | None = None) -> Prior:
    """Fit everything the planner knows before the window from `history` alone (module docstring). Pure.

    The history's time origin is its start and it lasts `duration_s` (default: up to the span holding
    its last arrival), ending where the window starts: its spans are [i * span_s, (i + 1) * span_s), so
    the last one is the span just before the window. `max_pp`: the deepest pipeline the engines run
    (`CapacityTable.max_pp`).
    """
    ok, inp, out = admitted_lengths(history, model)
    if len(inp) < k:
        raise ConfigError(f"fit_prior: the history holds {len(inp)} servable requests; need at least {k}")
    types = fit_types(inp, out, k=k, seed=seed)
    estimator = OnlineTypes(types, seed=seed)
    caps = history.max_tokens[ok]
    clients = history.client_ids[ok]
    predicted = np.empty(len(inp), dtype=np.int64)
    right = 0
    for i in range(len(inp)):
        tag = client_tag(int(clients[i]))
        cap = int(caps[i]) or None
        predicted[i] = estimator.predict_one(int(inp[i]), tag=tag, max_tokens=cap)
        right += estimator.learn_one(int(inp[i]), int(out[i]), tag=tag, max_tokens=cap) == predicted[i]
    lengths = FixedLengths.from_observed(types.names, predicted, inp, out, fallback=types)
    table = CapacityTable(model, cluster.gpu, lengths, target, gpus_per_node=cluster.gpus_per_node, max_pp=max_pp)
    end_s = float(history.arrival_s[-1]) if duration_s is None else duration_s
    num_spans = max(1, int(np.ceil(end_s / span_s - 1e-9)))
    span = np.minimum((history.arrival_s[ok] // span_s).astype(np.int64), num_spans - 1)
    counts = np.bincount(span * k + predicted, minlength=num_spans * k).reshape(num_spans, k).astype(float)
    return Prior(types, estimator, lengths, table, counts, span_s, right / len(inp))


def planning_table(prior: Prior, class_lengths: str) -> CapacityTable:
    """The capacity table a planner plans with (`PlannerConfig.class_lengths`): "estimated", the prior's
    own (what each estimated class really contains); "types", the table of the types themselves, for the
    same model, GPU, target and pipeline limit. Pure."""
    if class_lengths not in CLASS_LENGTHS:
        raise ConfigError(f"class_lengths must be one of {', '.join(CLASS_LENGTHS)}, got {class_lengths!r}")
    if class_lengths == "estimated":
        return prior.table
    return replace(prior.table, types=prior.types)


def client_tag(client_id: int) -> str | None:
    """The estimator's tag feature for a client id (-1: unknown, no tag). Pure."""
    return None if client_id < 0 else f"client{client_id}"
