"""Workload types online: River k-means started from the offline fit, an online output-length regressor,
and the arrival-time misclassification rate.

Pure core: no asyncio, NATS or clock; randomness comes in as a seed.

Two moments in a request's life:
- At arrival only the input length is known (with, sometimes, the client's tag, its max tokens, or an
  output-length hint). `predict_one` classifies it with an output estimate: the hint if given, else the
  online regressor's estimate (River `tree.HoeffdingTreeRegressor` of log output on log input, log max
  tokens and the tag one-hot; the prior mean before the first completion), capped at max tokens.
  This is what the router uses.
- At completion the true output length is known. `learn_one` returns the request's true type (nearest
  current centroid), moves that centroid towards the request (River `cluster.KMeans`: a step of
  `halflife` of the distance) and teaches the regressor. This is what the forecaster counts.

Label stability: type j is River's cluster j for good, started at the offline centroid named
`types.names[j]`, and each learned request moves only its nearest centroid a small step towards itself,
so a centroid follows its own members as they drift and a type never swaps its name with another.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
from river import cluster, tree

from oserve.errors import ConfigError
from oserve.workload_types import WorkloadTypes



class OnlineTypes:
    """Online workload types (see the module doc). Hyperparameters under their own names:

    - `halflife`: River k-means step, the fraction of the distance a centroid moves towards each learned
      request (0 freezes the centroids).
    - `grace_period`: requests a leaf of the regressor's Hoeffding tree sees between split attempts.
    - `max_depth`: the tree's depth limit. Unbounded, it keeps splitting the input length into a chain
      (height 333 after 250,000 Azure conversation requests, each learn and prediction then taking 0.5
      ms, and a RecursionError soon after); at 12 it stays at about 300 nodes, 18 us a learn, with the
      same accuracy of types at arrival (92.7% against 93.2% unbounded, after 200,000).
    - `learn_regressor`: False keeps the prior output estimate (the fitted requests' mean log output),
      the baseline the regressor is measured against.
    - `seed`: River's k-means seed (only used if a centroid ever lacks a coordinate; it never does here).
    Before the first completion the output estimate is the prior.
    """

    def __init__(self, types: WorkloadTypes, *, halflife: float = 0.002, grace_period: int = 200, max_depth: int = 12,
                 learn_regressor: bool = True, seed: int = 0) -> None:
        if not (isinstance(halflife, (int, float)) and math.isfinite(halflife) and 0 <= halflife <= 1):
            raise ConfigError(f"OnlineTypes: halflife must be in [0, 1]; got {halflife!r}")
        if not (isinstance(grace_period, int) and grace_period >= 1):
            raise ConfigError(f"OnlineTypes: grace_period must be an int >= 1; got {grace_period!r}")
        if not (isinstance(max_depth, int) and max_depth >= 1):
            raise ConfigError(f"OnlineTypes: max_depth must be an int >= 1; got {max_depth!r}")
        self.types = types
        self.halflife = float(halflife)
        self.grace_period = grace_period
        self.max_depth = max_depth
        self.learn_regressor = bool(learn_regressor)
        self.seed = int(seed)
        self._kmeans = cluster.KMeans(n_clusters=types.k, halflife=self.halflife, seed=self.seed)
        for j, (a, b) in enumerate(types.centroids_log):
            self._kmeans.centers[j]["in"] = float(a)
            self._kmeans.centers[j]["out"] = float(b)
        # prior output estimate: the fitted requests' mean log output (share-weighted centroids)
        shares = np.array([s.share for s in types.stats], dtype=np.float64)
        outs = np.array([c[1] for c in types.centroids_log])
        self.prior_log_output = float(np.dot(shares, outs) / shares.sum()) if shares.sum() > 0 \
            else float(outs.mean())
        self._regressor = tree.HoeffdingTreeRegressor(grace_period=grace_period, max_depth=max_depth)
        self.num_learned = 0

    @property
    def names(self) -> tuple[str, ...]:
        """Type names, index j is type j. Pure."""
        return self.types.names

    @property
    def k(self) -> int:
        return self.types.k

    @property
    def centroids_log(self) -> np.ndarray:
        """Current centroids, shape (k, 2), in (log1p input, log1p output). Pure (a copy)."""
        c = self._kmeans.centers
        return np.array([[c[j]["in"], c[j]["out"]] for j in range(self.k)])

    def snapshot(self) -> WorkloadTypes:
        """The current types as a WorkloadTypes (same names; stats are those of the offline fit). Pure."""
        return WorkloadTypes(names=self.types.names,
                             centroids_log=tuple((float(a), float(b)) for a, b in self.centroids_log),
                             stats=self.types.stats, inertia=self.types.inertia)

    # ------------------------------------------------------------------------------ arrival

    @staticmethod
    def _features(input_tokens: float, tag: str | None, max_tokens: int | None) -> dict[str, float | str]:
        x = {"log_input": math.log1p(input_tokens)}
        if max_tokens is not None:
            x["log_max_tokens"] = math.log1p(max_tokens)
        if tag is not None:
            x[f"tag={tag}"] = 1.0  # one-hot: the tree splits on it, its leaf models weigh it
        return x

    def estimate_output_one(self, input_tokens: int, *, tag: str | None = None,
                            max_tokens: int | None = None) -> float:
        """Estimated output tokens at arrival (the regressor's, capped at max_tokens). Pure."""
        _check_tokens(input_tokens, "input_tokens")
        if self.num_learned == 0 or not self.learn_regressor:
            log_out = self.prior_log_output
        else:
            log_out = float(self._regressor.predict_one(self._features(input_tokens, tag, max_tokens)))
        est = max(math.expm1(min(max(log_out, 0.0), 20.0)), 0.0)
        if max_tokens is not None:
            est = min(est, float(max_tokens))
        return est

    def predict_one(self, input_tokens: int, *, output_hint: int | None = None, tag: str | None = None,
                    max_tokens: int | None = None) -> int:
        """Type index at arrival: with the hint if given, else with the estimated output. Pure."""
        _check_tokens(input_tokens, "input_tokens")
        out = float(output_hint) if output_hint is not None else \
            self.estimate_output_one(input_tokens, tag=tag, max_tokens=max_tokens)
        if output_hint is not None:
            _check_tokens(output_hint, "output_hint")
        return self._nearest(math.log1p(input_tokens), math.log1p(out))

    # ------------------------------------------------------------------------------ completion

    def classify_one(self, input_tokens: int, output_tokens: int) -> int:
        """True type of a completed request: the nearest current centroid. Pure."""
        _check_tokens(input_tokens, "input_tokens")
        _check_tokens(output_tokens, "output_tokens")
        return self._nearest(math.log1p(input_tokens), math.log1p(output_tokens))

    def learn_one(self, input_tokens: int, output_tokens: int, *, tag: str | None = None,
                  max_tokens: int | None = None) -> int:
        """Learn a completed request; returns its true type (nearest centroid before the update)."""
        _check_tokens(input_tokens, "input_tokens")
        _check_tokens(output_tokens, "output_tokens")
        point = {"in": math.log1p(input_tokens), "out": math.log1p(output_tokens)}
        label = int(self._kmeans.learn_predict_one(point))  # nearest centroid, then moved towards point
        if self.learn_regressor:
            self._regressor.learn_one(self._features(input_tokens, tag, max_tokens), point["out"])
        self.num_learned += 1
        return label

    def _nearest(self, log_in: float, log_out: float) -> int:
        # River's KMeans.predict_one (p = 2), ties to the lower index like WorkloadTypes.classify
        return int(self._kmeans.predict_one({"in": log_in, "out": log_out}))


def _check_tokens(value: object, name: str) -> None:
    if not (isinstance(value, (int, float, np.integer, np.floating)) and value >= 0
            and math.isfinite(float(value))):
        raise ConfigError(f"OnlineTypes: {name} must be a number of tokens >= 0; got {value!r}")


# --------------------------------------------------------------------------------------------------
# Misclassification at arrival


class MisclassificationMeter:
    """Confusion of arrival-time types against true types known at completion (River-style `update`)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.confusion = np.zeros((k, k), dtype=np.int64)  # [true, predicted]

    def update(self, predicted: int, true: int) -> None:
        self.confusion[true, predicted] += 1

    @property
    def count(self) -> int:
        return int(self.confusion.sum())

    @property
    def rate(self) -> float:
        """Fraction of requests whose arrival-time type differs from the true one (NaN before any). Pure."""
        n = self.count
        return float("nan") if n == 0 else 1.0 - float(np.trace(self.confusion)) / n

    def per_type_rate(self) -> list[float]:
        """For each true type, the fraction classified as another type at arrival (NaN if none). Pure."""
        rows = self.confusion.sum(axis=1)
        return [float("nan") if rows[j] == 0 else 1.0 - self.confusion[j, j] / rows[j] for j in range(self.k)]


@dataclass(frozen=True, slots=True)
class MisclassificationReport:
    rate: float
    per_type_rate: tuple[float, ...]
    confusion: tuple[tuple[int, ...], ...]  # [true][predicted]
    requests: int

    def as_dict(self, names: tuple[str, ...]) -> dict[str, object]:
        return {"rate": self.rate, "requests": self.requests,
                "per_type_rate": dict(zip(names, self.per_type_rate)),
                "confusion": {"rows_true_cols_predicted": list(names),
                              "counts": [list(r) for r in self.confusion]}}


def replay_misclassification(online: OnlineTypes, input_tokens: np.ndarray, output_tokens: np.ndarray, *,
                             tags: list[str] | None = None, max_tokens: np.ndarray | None = None,
                             output_hints: np.ndarray | None = None,
                             completion_lag_requests: int = 0) -> MisclassificationReport:
    """Replay requests in arrival order: classify each at arrival, learn it at completion.

    A request completes `completion_lag_requests` arrivals after its own (0: before the next arrival),
    so the regressor and centroids only know requests that have completed. Mutates `online`.
    """
    inp = np.asarray(input_tokens, dtype=np.int64)
    out = np.asarray(output_tokens, dtype=np.int64)
    if inp.shape != out.shape or inp.ndim != 1:
        raise ConfigError("replay_misclassification: input and output tokens must be 1-D of equal length")
    meter = MisclassificationMeter(online.k)
    pending: deque[tuple[int, int]] = deque()

    def complete(i: int, predicted: int) -> None:
        true = online.learn_one(int(inp[i]), int(out[i]), tag=None if tags is None else tags[i],
                                max_tokens=None if max_tokens is None else int(max_tokens[i]))
        meter.update(predicted, true)

    for i in range(len(inp)):
        predicted = online.predict_one(
            int(inp[i]), output_hint=None if output_hints is None else int(output_hints[i]),
            tag=None if tags is None else tags[i],
            max_tokens=None if max_tokens is None else int(max_tokens[i]))
        pending.append((i, predicted))
        while len(pending) > completion_lag_requests:
            complete(*pending.popleft())
    while pending:
        complete(*pending.popleft())
    return MisclassificationReport(rate=meter.rate, per_type_rate=tuple(meter.per_type_rate()),
                                   confusion=tuple(tuple(int(v) for v in r) for r in meter.confusion),
                                   requests=meter.count)
