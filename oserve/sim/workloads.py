"""Workloads for the simulator: real traces scaled to a cluster, the paper's S1-S5 mixes and T1-T4 shifts. Pure.

Randomness comes in as a `numpy.random.Generator`; nothing reads files except through `load_trace`
on a path it is handed.

- Scaling a real trace (as the paper does): keep each minute's type mix and arrival pattern, change
  the volume. A factor f replaces every request by floor(f) copies plus one more with probability
  frac(f), each copy arriving at a uniformly jittered time inside the same minute.
- S1-S5 (the paper's Table 1): fixed type compositions; requests drawn from the real requests of each
  type in a trace (their real input and output lengths), Poisson arrivals.
- T1-T4 (Table 2): sequences of compositions, one phase after another.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from oserve.errors import ConfigError
from oserve.workload import NAMES_4, Trace, WorkloadTypes

# The paper's Table 1: percentages of SILO / LILO / SISO / LISO.
COMPOSITIONS: dict[str, dict[str, float]] = {
    "S1": {"SILO": 26.3, "LILO": 26.2, "SISO": 27.3, "LISO": 20.2},
    "S2": {"SILO": 30.0, "LILO": 28.0, "SISO": 24.2, "LISO": 17.8},
    "S3": {"SILO": 18.8, "LILO": 18.9, "SISO": 35.5, "LISO": 26.8},
    "S4": {"SILO": 13.2, "LILO": 14.2, "SISO": 41.1, "LISO": 31.5},
    "S5": {"SILO": 8.2, "LILO": 8.2, "SISO": 47.1, "LISO": 36.6},
}
# The paper's Table 2.
SEQUENCES: dict[str, tuple[str, ...]] = {
    "T1": ("S1", "S2", "S1"),
    "T2": ("S1", "S3", "S2"),
    "T3": ("S2", "S4", "S3"),
    "T4": ("S1", "S4", "S5"),
}


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests to simulate, with the type the router sees for each."""

    name: str
    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    type_index: np.ndarray

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s.max() - self.arrival_s.min()) if len(self) else 0.0

    def first_span_rps(self, span_s: float, num_types: int) -> np.ndarray:
        sel = self.arrival_s < self.arrival_s.min() + span_s
        return np.bincount(self.type_index[sel], minlength=num_types) / span_s


def from_trace(trace: Trace, types: WorkloadTypes, name: str | None = None) -> Workload:
    """A workload of a real trace's requests, typed by their true (input, output) lengths."""
    return Workload(name or trace.name, trace.arrival_s.astype(float), trace.input_tokens.astype(np.int64),
                    trace.output_tokens.astype(np.int64), types.classify(trace.input_tokens, trace.output_tokens))


def scale_volume(w: Workload, factor: float, rng: np.random.Generator, window_s: float = 60.0) -> Workload:
    """The same minutes with `factor` times the requests (see the module docstring)."""
    if not factor > 0:
        raise ConfigError(f"scale factor must be positive, got {factor}")
    base = int(np.floor(factor))
    copies = np.full(len(w), base) + (rng.random(len(w)) < factor - base)
    idx = np.repeat(np.arange(len(w)), copies)
    t0 = w.arrival_s.min()
    window = np.floor((w.arrival_s[idx] - t0) / window_s)
    arrival = t0 + (window + rng.random(len(idx))) * window_s
    # keep the original time of the first copy so an unscaled trace (factor 1) is unchanged
    first = np.ones(len(idx), dtype=bool)
    first[1:] = idx[1:] != idx[:-1]
    arrival = np.where(first, w.arrival_s[idx], arrival)
    arrival = np.minimum(arrival, w.arrival_s.max())
    order = np.argsort(arrival, kind="stable")
    return Workload(f"{w.name}x{factor:.2f}", arrival[order], w.input_tokens[idx][order],
                    w.output_tokens[idx][order], w.type_index[idx][order])


def composition(name_or_shares: str | dict[str, float], pool: Workload, types: WorkloadTypes, rate_rps: float,
                duration_s: float, rng: np.random.Generator, start_s: float = 0.0) -> Workload:
    """Poisson arrivals at `rate_rps` whose types follow a composition; lengths drawn from `pool`'s requests."""
    shares = COMPOSITIONS[name_or_shares] if isinstance(name_or_shares, str) else name_or_shares
    probs = np.zeros(types.k)
    for type_name, pct in shares.items():
        probs[types.index(type_name)] = pct
    if probs.sum() <= 0:
        raise ConfigError(f"composition {name_or_shares!r} has no weight")
    probs /= probs.sum()
    n = rng.poisson(rate_rps * duration_s)
    arrival = np.sort(start_s + rng.random(n) * duration_s)
    kinds = rng.choice(types.k, size=n, p=probs)
    inp = np.empty(n, dtype=np.int64)
    out = np.empty(n, dtype=np.int64)
    for j in range(types.k):
        sel = np.nonzero(kinds == j)[0]
        members = np.nonzero(pool.type_index == j)[0]
        if len(sel) and not len(members):
            raise ConfigError(f"the pool has no request of type {types.names[j]}")
        pick = members[rng.integers(0, len(members), size=len(sel))]
        inp[sel] = pool.input_tokens[pick]
        out[sel] = pool.output_tokens[pick]
    label = name_or_shares if isinstance(name_or_shares, str) else "custom"
    return Workload(label, arrival, inp, out, kinds.astype(np.int64))


def sequence(name_or_phases: str | tuple[str, ...], pool: Workload, types: WorkloadTypes, rate_rps: float,
             phase_s: float, rng: np.random.Generator) -> Workload:
    """Compositions one after another, `phase_s` each (the paper's shifting workloads)."""
    phases = SEQUENCES[name_or_phases] if isinstance(name_or_phases, str) else name_or_phases
    parts = [composition(p, pool, types, rate_rps, phase_s, rng, start_s=i * phase_s) for i, p in enumerate(phases)]
    label = name_or_phases if isinstance(name_or_phases, str) else "->".join(phases)
    return Workload(label, np.concatenate([p.arrival_s for p in parts]),
                    np.concatenate([p.input_tokens for p in parts]), np.concatenate([p.output_tokens for p in parts]),
                    np.concatenate([p.type_index for p in parts]))


def mix_cv_of(shares_seq: list[dict[str, float]] | tuple[str, ...]) -> float:
    """Coefficient of variation of the type shares of a composition (how skewed the mix is)."""
    vals = np.array(list(shares_seq.values()) if isinstance(shares_seq, dict) else shares_seq, dtype=float)
    vals = vals / vals.sum()
    return float(vals.std() / vals.mean())


def require_paper_names(types: WorkloadTypes) -> None:
    if tuple(types.names) != NAMES_4:
        raise ConfigError(f"the paper's compositions need the four types {NAMES_4}, got {types.names}")
