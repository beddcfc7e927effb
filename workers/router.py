"""Routing decisions of the gateway, pure and synchronous: classification and smooth weighted round robin."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from oserve.workload import WorkloadTypes


class Classifier:
    """Nearest type centroid in (log1p input, log1p output) space, as `WorkloadTypes.classify`. Pure.

    A scalar re-statement of `classify` for the request path (one request at a time, no numpy
    overhead); tests assert it agrees with `WorkloadTypes.classify` everywhere.
    """

    def __init__(self, types: WorkloadTypes | None) -> None:
        self.types = types
        self._centroids = tuple(types.centroids_log) if types is not None else ((0.0, 0.0),)
        # output estimate when a request gives neither a hint nor max tokens: the mean over types
        if types is not None:
            self.default_output_tokens = max(1, round(sum(s.share * s.mean_output_tokens for s in types.stats)))
        else:
            self.default_output_tokens = 256

    @property
    def num_types(self) -> int:
        return len(self._centroids)

    def estimate_output(self, hint_tokens: int | None, max_tokens: int | None) -> int:
        """The output length used to classify: the client's hint, else its max tokens, else the mean."""
        if hint_tokens is not None:
            return hint_tokens
        if max_tokens is not None:
            return max_tokens
        return self.default_output_tokens

    def classify(self, input_tokens: int, output_tokens: int) -> int:
        x, y = math.log1p(input_tokens), math.log1p(output_tokens)
        best, best_d = 0, math.inf
        for j, (cx, cy) in enumerate(self._centroids):
            d = (x - cx) ** 2 + (y - cy) ** 2
            if d < best_d:  # strict: ties go to the lower index, as argmin does
                best, best_d = j, d
        return best


class SmoothWRR:
    """Nginx's smooth weighted round robin over replicas, one state per workload type.

    Each pick adds every eligible replica's weight to its running score, takes the highest and
    subtracts the total from it: over any window the picks follow the weights and are spread out.
    """

    def __init__(self) -> None:
        self._current: dict[int, dict[str, float]] = {}  # type index -> replica_id -> running score

    def pick(self, type_index: int, weights: Mapping[str, float], eligible: Sequence[str]) -> str | None:
        cur = self._current.setdefault(type_index, {})
        total, best, best_score = 0.0, None, -math.inf
        for rid in eligible:
            w = weights.get(rid, 0.0)
            if w <= 0:
                continue
            score = cur.get(rid, 0.0) + w
            cur[rid] = score
            total += w
            if score > best_score:
                best, best_score = rid, score
        if best is not None:
            cur[best] -= total
        return best
