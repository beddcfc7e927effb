"""The local search over deployments one move away, by which the planner improves on its candidates. Pure.

A move replaces one replica by another shape of as many GPUs, splits one in two, or merges two
(`neighbours`); `local_search` descends the twin's score over such moves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from oserve.specs import ReplicaShape

Multiset = tuple[ReplicaShape, ...]
"""A deployment's replica shapes, sorted."""


def neighbours(shapes: Sequence[ReplicaShape], valid: Sequence[ReplicaShape]) -> set[Multiset]:
    """Deployments one move from the multiset `shapes`, each as a sorted tuple of `valid` shapes. Pure.

    A move replaces one replica by another shape of as many GPUs, splits one replica into two whose
    GPUs sum to its own, or merges two replicas into one shape of their summed GPUs. So every
    neighbour uses exactly the GPUs `shapes` uses, and the relation is symmetric (a split undoes a
    merge). Whether a neighbour packs onto the cluster's nodes is not checked here.
    """
    by_gpus: dict[int, list[ReplicaShape]] = {}
    for shape in dict.fromkeys(valid):
        by_gpus.setdefault(shape.num_gpus, []).append(shape)
    combo = sorted(shapes)
    out: set[Multiset] = set()
    for i, shape in enumerate(combo):
        rest = combo[:i] + combo[i + 1:]
        for other in by_gpus.get(shape.num_gpus, []):
            if other != shape:
                out.add(tuple(sorted(rest + [other])))
        for a in range(1, shape.num_gpus // 2 + 1):
            for x in by_gpus.get(a, []):
                for y in by_gpus.get(shape.num_gpus - a, []):
                    out.add(tuple(sorted(rest + [x, y])))
        for j in range(i + 1, len(combo)):
            rest2 = [c for t, c in enumerate(combo) if t not in (i, j)]
            for merged in by_gpus.get(shape.num_gpus + combo[j].num_gpus, []):
                out.add(tuple(sorted(rest2 + [merged])))
    out.discard(tuple(combo))
    return out


def local_search(start: Sequence[ReplicaShape], start_score: float, valid: Sequence[ReplicaShape],
                 score: Callable[[Multiset], float | None], max_steps: int,
                 min_gain: float = 0.0) -> tuple[Multiset, float]:
    """Steepest descent over `neighbours` from `start` (scored `start_score`): at most `max_steps` moves,
    each to the best-scoring neighbour while it beats the current score by more than the fraction
    `min_gain`. `score` returns None for a deployment that is not allowed (it does not pack, or gives
    up too much capacity); it is called at most once per multiset. Returns the deployment reached and
    its score. Pure given `score`."""
    seen: dict[Multiset, float | None] = {}
    best, best_score = tuple(sorted(start)), start_score
    seen[best] = start_score
    for _ in range(max_steps):
        step = None
        for nb in sorted(neighbours(best, valid)):
            if nb not in seen:
                seen[nb] = score(nb)
            value = seen[nb]
            if value is not None and value < best_score * (1 - min_gain) and (step is None or value < step[1]):
                step = (nb, value)
        if step is None:
            break
        best, best_score = step
    return best, best_score
