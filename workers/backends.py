"""Engine backends behind one interface: `sim` (SimReplica timed by the performance model) and `echo`.

A backend owns one replica's requests. `add(job, now_s)` hands it a request and returns whatever is
finished by then (the echo backend finishes at once); `next_event_s()` says when on the clock it next
needs `advance(now_s)`, which returns what finished. The engine worker owns the clock and the timing
loop, so a vLLM backend fits behind the same interface: its `advance` would collect finished outputs.
`cancel(seq, now_s)` drops a job whose client went away (vLLM's `abort_request`), freeing its KV.

Streaming: `generated_tokens(seq, now_s)` says how many tokens an unfinished job has produced by now
and `text(seq, start, stop)` gives the text of tokens [start, stop) of its answer; the engine worker
sends the new ones to a streaming client as chunks. The `sim` and `echo` backends have no model, so
their answers are deterministic placeholder text (`placeholder_text`), the same for every request;
they cannot honour sampling fields (temperature, top_p, seed, stop) either: those reach the engine in
the `Dispatch` for the `vllm` backend (`oserve.workers.vllm_backend`), and these two ignore them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from oserve.defaults import GPUS_PER_NODE
from oserve.perfmodel import PerfModel
from oserve.engine_model import SimReplica, SimRequest
from oserve.specs import EngineConfig, MemoryConfig, ReplicaShape, gpu_preset, kv_capacity_tokens, model_preset


_PLACEHOLDER_WORDS = ("This", " is", " placeholder", " text", " from", " a", " simulated", " engine", ".", " ")
PLACEHOLDER_TEXT_TOKENS = 8192
"""Tokens of an answer that get placeholder text; later ones are empty, so a reply stays far below the
message limit (8192 tokens of at most 12 bytes: under 100 KiB) whatever max tokens says."""
_PLACEHOLDER = [_PLACEHOLDER_WORDS[i % len(_PLACEHOLDER_WORDS)] for i in range(PLACEHOLDER_TEXT_TOKENS)]
_PLACEHOLDER_TEXT = "".join(_PLACEHOLDER)
_PLACEHOLDER_OFFSETS = [0]  # token i's text starts at this character of _PLACEHOLDER_TEXT
for _word in _PLACEHOLDER:
    _PLACEHOLDER_OFFSETS.append(_PLACEHOLDER_OFFSETS[-1] + len(_word))


def placeholder_text(start_tokens: int, stop_tokens: int) -> str:
    """Text of tokens [start, stop) of a simulated answer: a fixed cycle of words, one per token, the
    same for every request (a placeholder until a real model backend writes answers). Pure, O(1)."""
    cap = PLACEHOLDER_TEXT_TOKENS
    a, b = min(max(start_tokens, 0), cap), min(max(stop_tokens, 0), cap)
    return _PLACEHOLDER_TEXT[_PLACEHOLDER_OFFSETS[a]:_PLACEHOLDER_OFFSETS[b]] if b > a else ""


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
    stream: bool = False
    """The client streams the answer: the engine asks `generated_tokens` as it goes."""
    detokenize: bool = True
    """The answer goes back as text too (`Dispatch.detokenize`); False: token counts only."""
    prompt: str | None = None
    """The prompt's text (`Dispatch.prompt`); None: given as a count (`input_tokens`). Only `vllm` reads it."""
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """The sampling fields of the request; only the `vllm` backend honours them."""
    resumed_tokens: int = 0
    """Tokens of the answer generated on another replica before the request migrated here in a switch
    (`Dispatch.resume`): they count towards `max_tokens` and the answer, and are not generated again."""
    resumed_ids: tuple[int, ...] = ()
    """Their token ids (a real engine's; empty when the old replica had no model): the `vllm` backend
    prefills the prompt plus these and goes on from there."""
    resumed_text: str = ""

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
    """KV blocks used plus demanded by the queue, over all blocks: the router's load figure (can pass 1)."""
    kv_capacity_tokens: int = 0
    kv_usage_frac: float = 0.0
    """KV blocks in use over all blocks, in [0, 1] (vLLM's `kv_cache_usage_perc`)."""
    busy_s: float = 0.0
    """Cumulative clock seconds of steps run since the replica started (0: not counted)."""
    saturated_s: float = 0.0
    """Cumulative clock seconds of steps that ended with requests still waiting (0: not counted)."""


class Backend(Protocol):
    def add(self, job: Job, now_s: float) -> list[Finished]: ...

    def advance(self, now_s: float) -> list[Finished]: ...

    def next_event_s(self) -> float | None: ...

    def load(self) -> Load: ...

    def generated_tokens(self, seq: int, now_s: float) -> int:
        """Tokens the unfinished job `seq` has produced by `now_s` (0 for one it does not hold)."""
        ...

    def text(self, seq: int, start_tokens: int, stop_tokens: int) -> str:
        """Text of tokens [start, stop) of job `seq`'s answer (asked until its `Finished` is handled)."""
        ...

    def cancel(self, seq: int, now_s: float) -> list[Finished]:
        """Drop the unfinished job `seq` (its client went away), freeing what it holds; no `Finished` will
        name it later (one that does is to be ignored). Returns what else is finished by `now_s`, as `add`."""
        ...

    def token_ids(self, seq: int) -> list[int]:
        """The token ids the unfinished job `seq` has produced (resumed ones included); [] from a backend
        without a model, which counts tokens only (`generated_tokens`)."""
        ...


class EchoBackend:
    """Zero-cost engine: every request finishes the moment it arrives (for the bus benchmark), with
    placeholder text; sampling fields are ignored (see the module docstring)."""

    def generated_tokens(self, seq: int, now_s: float) -> int:
        return 0  # nothing is ever unfinished here

    def text(self, seq: int, start_tokens: int, stop_tokens: int) -> str:
        return placeholder_text(start_tokens, stop_tokens)

    def add(self, job: Job, now_s: float) -> list[Finished]:
        return [Finished(job.seq, max(job.answer_tokens, job.resumed_tokens), now_s, now_s)]

    def token_ids(self, seq: int) -> list[int]:
        return []

    def cancel(self, seq: int, now_s: float) -> list[Finished]:
        return []  # nothing is ever unfinished here

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
    """A `SimReplica` driven on the worker's clock: continuous batching timed by the performance model.

    Its answers are placeholder text (`placeholder_text`), its tokens produced when the simulated
    replica produces them: the first at the end of the prompt's last prefill step, then one per decode
    step, read from the replica's decode aggregate between step ends (`SimReplica.generated_tokens`)
    without cutting its runs, so streaming changes no timing. Sampling fields are ignored."""

    def __init__(self, replica_id: str, config: SimBackendConfig = SimBackendConfig()) -> None:
        model, gpu = model_preset(config.model), gpu_preset(config.gpu)
        shape = ReplicaShape(config.tp, config.pp)
        memory, engine = MemoryConfig(), EngineConfig()
        perf = PerfModel(model, gpu, gpus_per_node=config.gpus_per_node)
        self.replica = SimReplica(replica_id, shape, perf.timer(shape), engine,
                                  kv_capacity_tokens(model, gpu, shape, memory), memory.block_tokens)
        self._held: dict[int, SimRequest] = {}  # seq -> unfinished request
        self._resumed: dict[int, int] = {}  # seq -> tokens generated elsewhere before it migrated here

    def add(self, job: Job, now_s: float) -> list[Finished]:
        """A migrated job (`Job.resumed_tokens`) prefills its prompt plus what it generated and produces the rest."""
        done = self.advance(now_s)  # the kernel's order: step ends up to now first, then the arrival
        resumed = min(job.resumed_tokens, job.answer_tokens - 1)
        req = SimRequest(job.seq, job.type_index, now_s, job.input_tokens + resumed, job.answer_tokens - resumed)
        self._held[job.seq] = req
        if resumed:
            self._resumed[job.seq] = resumed
        self.replica.enqueue(req, now_s)
        return done + self._rejected()

    def token_ids(self, seq: int) -> list[int]:
        return []

    def cancel(self, seq: int, now_s: float) -> list[Finished]:
        """Abort the job in the simulated replica (`SimReplica.abort`): its KV is freed at once, or at the end
        of the step in progress when it is in that step's batch; the run of decode steps is cut there."""
        done = self.advance(now_s)  # step ends up to now first, as for an arrival
        req = self._held.pop(seq, None)
        self._resumed.pop(seq, None)
        if req is not None:
            self.replica.abort(req, now_s)
        return done + self._rejected()

    def advance(self, now_s: float) -> list[Finished]:
        rep = self.replica
        out: list[Finished] = []
        while rep.busy and rep.step_end_s <= now_s:
            outcome = rep.on_step_end(rep.step_end_s)
            out += [Finished(r.request_id, r.generated + self._resumed.pop(r.request_id, 0), r.first_token_s,
                             r.finish_s) for r in outcome.finished]
        for f in out:
            self._held.pop(f.seq, None)
        return out + self._rejected()

    def _rejected(self) -> list[Finished]:
        rep = self.replica
        if not rep.rejected:
            return []
        out = [Finished(r.request_id, 0, math.nan, math.nan, "request can never fit in this replica's KV cache")
               for r in rep.rejected]
        for r in rep.rejected:
            self._held.pop(r.request_id, None)
            self._resumed.pop(r.request_id, None)
        rep.rejected.clear()
        return out

    def generated_tokens(self, seq: int, now_s: float) -> int:
        req = self._held.get(seq)
        return 0 if req is None else self.replica.generated_tokens(req, now_s) + self._resumed.get(seq, 0)

    def text(self, seq: int, start_tokens: int, stop_tokens: int) -> str:
        return placeholder_text(start_tokens, stop_tokens)

    def next_event_s(self) -> float | None:
        return self.replica.step_end_s if self.replica.busy else None

    def load(self) -> Load:
        rep = self.replica
        return Load(len(rep.waiting), rep.num_running, rep.kv_load_frac(), rep.total_blocks * rep.block_tokens,
                    kv_usage_frac=(rep.total_blocks - rep.free_blocks) / rep.total_blocks, busy_s=rep.busy_s,
                    saturated_s=rep.saturated_s)
