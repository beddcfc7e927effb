"""Engine backends behind one interface: `sim` (SimReplica timed by the performance model) and `echo`.

A backend owns one replica's requests. `add(job, now_s)` hands it a request and returns whatever is
finished by then (the echo backend finishes at once); `next_event_s()` says when on the clock it next
needs `advance(now_s)`, which returns what finished. The engine worker owns the clock and the timing
loop, so a vLLM backend fits behind the same interface: its `advance` would collect finished outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from oserve.defaults import GPUS_PER_NODE
from oserve.perfmodel import PerfModel
from oserve.engine_model import SimReplica, SimRequest
from oserve.specs import EngineConfig, MemoryConfig, ReplicaShape, gpu_preset, kv_capacity_tokens, model_preset


@dataclass(slots=True)
class Job:
    """One request inside an engine; `seq` is the engine's own id for it."""

    seq: int
    request_id: str
    input_tokens: int
    max_tokens: int
    type_index: int
    arrival_s: float
    output_tokens: int = 0
    """Tokens the simulated model answers with (`Dispatch.sim_output_tokens`, capped at max_tokens); 0:
    max_tokens. Only the `sim` and `echo` backends read it."""

    @property
    def answer_tokens(self) -> int:
        return min(self.output_tokens, self.max_tokens) if self.output_tokens > 0 else self.max_tokens


@dataclass(frozen=True, slots=True)
class Finished:
    seq: int
    output_tokens: int
    first_token_s: float
    finish_s: float
    error: str = ""
    """Non-empty when the backend refused the request (e.g. it can never fit in the KV cache)."""


@dataclass(frozen=True, slots=True)
class Load:
    num_waiting: int
    num_running: int
    kv_load_frac: float
    kv_capacity_tokens: int = 0


class Backend(Protocol):
    def add(self, job: Job, now_s: float) -> list[Finished]: ...

    def advance(self, now_s: float) -> list[Finished]: ...

    def next_event_s(self) -> float | None: ...

    def load(self) -> Load: ...


class EchoBackend:
    """Zero-cost engine: every request finishes the moment it arrives (for the bus benchmark)."""

    def add(self, job: Job, now_s: float) -> list[Finished]:
        return [Finished(job.seq, job.answer_tokens, now_s, now_s)]

    def advance(self, now_s: float) -> list[Finished]:
        return []

    def next_event_s(self) -> float | None:
        return None

    def load(self) -> Load:
        return Load(0, 0, 0.0)


@dataclass(frozen=True, slots=True)
class SimBackendConfig:
    """The simulated replica: model, GPU type and parallelism."""

    model: str = "llama2-7b"
    """Model preset name (oserve.specs.MODELS)."""
    gpu: str = "h100-80gb"
    tp: int = 1
    pp: int = 1
    gpus_per_node: int = GPUS_PER_NODE


class SimBackend:
    """A `SimReplica` driven on the worker's clock: continuous batching timed by the performance model."""

    def __init__(self, replica_id: str, config: SimBackendConfig = SimBackendConfig()) -> None:
        model, gpu = model_preset(config.model), gpu_preset(config.gpu)
        shape = ReplicaShape(config.tp, config.pp)
        memory, engine = MemoryConfig(), EngineConfig()
        perf = PerfModel(model, gpu, gpus_per_node=config.gpus_per_node)
        self.replica = SimReplica(replica_id, shape, perf.timer(shape), engine,
                                  kv_capacity_tokens(model, gpu, shape, memory), memory.block_tokens)

    def add(self, job: Job, now_s: float) -> list[Finished]:
        done = self.advance(now_s)  # the kernel's order: step ends up to now first, then the arrival
        self.replica.enqueue(SimRequest(job.seq, job.type_index, now_s, job.input_tokens, job.answer_tokens), now_s)
        return done + self._rejected()

    def advance(self, now_s: float) -> list[Finished]:
        rep = self.replica
        out: list[Finished] = []
        while rep.busy and rep.step_end_s <= now_s:
            outcome = rep.on_step_end(rep.step_end_s)
            out += [Finished(r.request_id, r.generated, r.first_token_s, r.finish_s) for r in outcome.finished]
        return out + self._rejected()

    def _rejected(self) -> list[Finished]:
        rep = self.replica
        if not rep.rejected:
            return []
        out = [Finished(r.request_id, 0, math.nan, math.nan, "request can never fit in this replica's KV cache")
               for r in rep.rejected]
        rep.rejected.clear()
        return out

    def next_event_s(self) -> float | None:
        return self.replica.step_end_s if self.replica.busy else None

    def load(self) -> Load:
        rep = self.replica
        return Load(len(rep.waiting), rep.num_running, rep.kv_load_frac(), rep.total_blocks * rep.block_tokens)
