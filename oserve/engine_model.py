"""A simulated engine replica: continuous batching as vLLM does it, timed by the performance model. Pure.

One `SimReplica` owns a waiting queue, a running set and a pool of KV blocks. Each engine step it
builds a batch the way vLLM's scheduler does — running requests first (a decode token each, or the
next chunk of an unfinished prompt), then waiting requests in arrival order while the sequence limit,
the token budget and the free KV blocks allow — and preempts the most recently admitted running
request (recompute: its KV is freed and its prompt plus generated tokens are prefilled again) when a
running request needs a block and none is free.

Speed, two ways:
- Decoding requests are kept as an aggregate. Every running request whose prompt is done decodes one
  token every step, so its context is `offset + step_index`; the replica keeps the count, the sum of
  offsets, the offsets' residues modulo the block size (to know how many need a new KV block at each
  step) and a heap of finishing steps. A step costs O(changes), not O(batch).
- When a step is pure decode and nothing waiting can be admitted, the following steps repeat with
  contexts that grow by one token each, so the step time grows linearly (`a + b * i`). The replica
  then plans a *run* of k steps at once, k bounded by the first request to finish and by the free KV
  blocks, and a caller that needs the state earlier (an arrival, a switch) `cut`s the run at the
  first step boundary after that time.

Pipeline parallelism: a PP replica keeps `pp` micro-batches in flight; modelled as one logical batch
whose step (the interval between two tokens of a sequence) takes
max(latency of a 1/pp micro-batch through all stages, pp x its bottleneck-stage time).

The replica does not read a clock: every method takes `now_s` and returns when it next needs the
caller (the cluster kernel) to call `on_step_end`.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

from oserve.perfmodel import Batch, ShapeTimer
from oserve.specs import EngineConfig, ReplicaShape


class SimRequest:
    """One request's state as it moves through a simulated replica."""

    __slots__ = ("request_id", "type_index", "arrival_s", "input_tokens", "output_tokens", "prompt_tokens",
                 "prefilled", "ctx", "generated", "blocks", "first_token_s", "last_token_s", "finish_s",
                 "num_preemptions", "num_migrations", "replica_id", "seq", "offset", "decoding")

    def __init__(self, request_id: int, type_index: int, arrival_s: float, input_tokens: int,
                 output_tokens: int) -> None:
        self.request_id = request_id
        self.type_index = type_index
        self.arrival_s = arrival_s
        self.input_tokens = input_tokens
        self.output_tokens = max(1, output_tokens)
        self.prompt_tokens = input_tokens  # tokens to prefill (input, plus generated ones after a recompute)
        self.prefilled = 0
        self.ctx = 0  # tokens whose KV is in the cache
        self.generated = 0
        self.blocks = 0
        self.first_token_s = math.nan
        self.last_token_s = math.nan
        self.finish_s = math.nan
        self.num_preemptions = 0
        self.num_migrations = 0
        self.replica_id = ""
        self.seq = 0  # admission order, for LIFO preemption
        self.offset = 0  # while decoding in a replica: ctx - step_index (generated - step_index is ctx-derived)
        self.decoding = False

    def drop_kv(self) -> None:
        """Forget the KV cache: the prompt plus what was generated is prefilled again (recompute)."""
        self.prompt_tokens = self.input_tokens + self.generated
        self.prefilled = 0
        self.ctx = 0
        self.blocks = 0


class TokenHistogram:
    """Counts of token intervals in log-spaced bins (0.5% wide), for TBT percentiles without a list."""

    __slots__ = ("counts",)
    LOG_BASE = math.log(1.005)
    MIN_S = 1e-5

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def add(self, value_s: float, count: int = 1) -> None:
        b = int(math.log(max(value_s, self.MIN_S) / self.MIN_S) / self.LOG_BASE)
        self.counts[b] = self.counts.get(b, 0) + count

    def add_linear(self, first_s: float, step_s: float, k: int, count: int) -> None:
        """Add `count` tokens at each of the k values first + step * i (i < k)."""
        if k <= 0 or count <= 0:
            return
        if k <= 4 or step_s * k < first_s * 0.005:
            self.add(first_s + step_s * (k - 1) / 2.0, count * k)
            return
        # split the run into a handful of segments, each counted at its midpoint
        segments = min(k, 8)
        per = k // segments
        start = 0
        for s in range(segments):
            n = per if s < segments - 1 else k - start
            self.add(first_s + step_s * (start + (n - 1) / 2.0), count * n)
            start += n

    def merge(self, other: TokenHistogram) -> None:
        for b, c in other.counts.items():
            self.counts[b] = self.counts.get(b, 0) + c

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def quantile(self, q: float) -> float:
        total = self.total
        if total == 0:
            return math.nan
        target = q * (total - 1)
        seen = 0
        for b in sorted(self.counts):
            seen += self.counts[b]
            if seen > target:
                return self.MIN_S * math.exp((b + 0.5) * self.LOG_BASE)
        return math.nan


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What one `on_step_end` produced."""

    finished: tuple[SimRequest, ...]
    next_end_s: float | None
    """When the replica next needs `on_step_end`; None when it is idle."""


class SimReplica:
    """A replica of one shape, simulated step by step (see the module docstring)."""

    def __init__(self, replica_id: str, shape: ReplicaShape, timer: ShapeTimer, engine: EngineConfig,
                 kv_tokens: int, block_tokens: int = 16, available_s: float = 0.0,
                 tbt_histogram: TokenHistogram | None = None) -> None:
        self.replica_id = replica_id
        self.gpu_ids: tuple[int, ...] = ()
        self.shape = shape
        self.timer = timer
        self.engine = engine
        self.block_tokens = block_tokens
        self.total_blocks = max(1, kv_tokens // block_tokens)
        self.free_blocks = self.total_blocks
        self.available_s = available_s  # not serving before this (switching in)
        self.ready = True
        """False while switching in, as routers see it (`oserve.routing.ReplicaLoad.ready`); the kernel sets it."""
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []  # admitted, prompt not done, in admission order
        self.tbt = tbt_histogram if tbt_histogram is not None else TokenHistogram()
        self.accepting = True
        self.rejected: list[SimRequest] = []  # requests that can never fit; the kernel drains this
        # live migration, kept by the cluster kernel and read by balancers: KV blocks reserved for requests
        # migrating here, and request_ids being copied off this replica (still decoding here meanwhile)
        self.incoming_kv_blocks = 0
        self.migrating_out: set[int] = set()
        self.num_steps = 0
        self.busy_s = 0.0
        self.saturated_s = 0.0
        """Seconds of steps that ended with requests still waiting: the replica could not take all it was
        sent (its batch or KV cache full), so what it finished meanwhile is what it can serve."""
        self.step_token = 0  # changes whenever the pending step end changes; stale kernel events are skipped
        self._admitted = 0
        self._queued_tokens = 0  # prompt tokens still to prefill of the waiting requests
        self._max_seqs = engine.max_num_seqs * shape.pp
        self._pp = shape.pp
        # the decoding aggregate
        self.step_index = 0
        self._dec: dict[int, SimRequest] = {}  # seq -> request
        self._dec_sum_offset = 0
        self._dec_mod = [0] * block_tokens  # count of decoding requests by offset % block_tokens
        self._finish_heap: list[tuple[int, int]] = []  # (step_index at which it has all tokens, seq); lazy
        self._lifo: list[int] = []  # -seq of running requests; lazy
        # the step (or run of decode steps) in progress
        self._busy = False
        self._run_start_s = 0.0
        self._run_k = 0
        self._run_a = 0.0
        self._run_b = 0.0
        self._run_end_s = 0.0
        self._run_chunks: list[tuple[SimRequest, int]] = []  # prefill chunks of the step in progress
        self._run_n_dec = 0
        self._aborting: list[SimRequest] = []  # abandoned in the batch of the step in progress: gone at its end

    # --- load, as a balancer sees it ----------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._dec) + len(self.prefilling)

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + self.num_running

    def kv_load_frac(self) -> float:
        """Used plus queued demand for KV, as a fraction of the replica's blocks (Llumnix-style load)."""
        queued = self._queued_tokens / self.block_tokens
        return (self.total_blocks - self.free_blocks + queued) / self.total_blocks

    # --- timing --------------------------------------------------------------------------------

    def step_seconds(self, batch: Batch) -> float:
        if self._pp == 1:
            return self.timer.iteration_seconds(batch)
        pp = self._pp
        micro = Batch(max(1, round(batch.num_tokens / pp)), batch.prefill_pairs / pp,
                      round(batch.prefill_cached_tokens / pp), round(batch.num_decode_seqs / pp),
                      round(batch.decode_context_tokens / pp), max(1, round(batch.num_logit_rows / pp)),
                      -(-batch.num_prefill_seqs // pp))
        return self.timer.pipelined_step_seconds(micro)

    # --- the kernel's interface ----------------------------------------------------------------

    def enqueue(self, req: SimRequest, now_s: float, front: bool = False) -> float | None:
        """Accept a request; returns the new step end when the kernel must (re)schedule one, else None.

        `front` puts it at the head of the queue (a request migrating in with its KV resumes next step,
        as a preempted one would), instead of behind the requests already waiting.
        """
        req.replica_id = self.replica_id
        if self._blocks_for(req.input_tokens + req.output_tokens) > self.total_blocks:
            # It could never finish here: it would fill the cache, preempt itself and start over
            # forever. vLLM refuses such a request up front; so do we (the kernel reports it dropped).
            self.rejected.append(req)
            return None
        self.add_waiting(req, front)
        if self._busy:
            if self._run_k > 1:
                token = self.step_token
                end = self.cut(now_s)
                return end if token != self.step_token else None
            return None
        return self._start(max(now_s, self.available_s))

    def add_waiting(self, req: SimRequest, front: bool = False) -> None:
        """Queue a request without starting a step (`enqueue` does both)."""
        if front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)
        self._queued_tokens += req.prompt_tokens - req.prefilled

    def wake(self, now_s: float) -> float | None:
        """Start working if idle and something is queued (after becoming available)."""
        if self._busy or not (self.waiting or self.num_running):
            return None
        return self._start(max(now_s, self.available_s))

    def cut(self, now_s: float) -> float:
        """Shorten a run of decode steps to end at the first step boundary at or after `now_s`."""
        if not self._busy or self._run_k <= 1 or now_s >= self._run_end_s:
            return self._run_end_s
        i = self._steps_within(max(now_s - self._run_start_s, 0.0), self._run_k - 1)
        k = i + 1  # the step in progress completes
        if k < self._run_k:
            self._run_k = k
            self._run_end_s = self._run_start_s + k * self._run_a + self._run_b * k * (k - 1) / 2
            self.step_token += 1
        return self._run_end_s

    def _steps_within(self, elapsed_s: float, most: int) -> int:
        """Steps of the run in progress fully done `elapsed_s` after it started, at most `most`. Pure."""
        a, b = self._run_a, self._run_b
        # largest i with i*a + b*i*(i-1)/2 <= elapsed
        if b > 1e-15:
            i = int((-(a - b / 2) + math.sqrt((a - b / 2) ** 2 + 2 * b * elapsed_s)) / b)
        else:
            i = int(elapsed_s / a)
        i = max(0, min(i, most))
        while i > 0 and i * a + b * i * (i - 1) / 2 > elapsed_s:
            i -= 1
        return i

    def generated_tokens(self, req: SimRequest, now_s: float) -> int:
        """Tokens `req` has produced by `now_s`, counting the decode steps of the run in progress that are
        done by then (the aggregate applies them only at the run's end). Pure: reads, never cuts the run."""
        if not self.is_decoding(req):
            return req.generated  # waiting, prefilling or preempted: no token until its prompt is (re)done
        done = self._steps_within(max(now_s - self._run_start_s, 0.0), self._run_k) if self._busy else 0
        return min(req.output_tokens, req.generated + req.offset + self.step_index - req.ctx + done)

    def on_step_end(self, now_s: float, start_next: bool = True) -> StepOutcome:
        """Apply the step (or run) that ended at `now_s`, then start the next one (unless told not to)."""
        finished = self._apply(now_s)
        self._busy = False
        if self._aborting:
            gone, self._aborting = self._aborting, []
            for r in gone:
                self._remove(r)
        nxt = None
        if start_next and (self.waiting or self.num_running):
            nxt = self._start(now_s)
        return StepOutcome(tuple(finished), nxt)

    def abort(self, req: SimRequest, now_s: float) -> None:
        """Remove a request its client abandoned, freeing its KV blocks (vLLM's abort).

        A waiting request leaves at once, and so does a running one between steps. One held while a step
        is in progress (its batch was built with it) leaves when that step ends: a run of decode steps is
        cut to end at the first step boundary at or after `now_s`, so that is at most one step away. A
        request that finished or was rejected meanwhile is left alone (the caller ignores its outcome)."""
        if not self._busy or req in self.waiting:
            self._remove(req)
            return
        self._aborting.append(req)
        self.cut(now_s)

    def _remove(self, req: SimRequest) -> None:
        """Take `req` out of wherever it is (waiting, prefilling, decoding); only between steps for admitted ones."""
        if req in self.waiting:
            self.waiting.remove(req)
            self._queued_tokens -= req.prompt_tokens - req.prefilled
        elif req in self.prefilling:
            self.prefilling.remove(req)  # its lazy LIFO entry is skipped later
            self.free_blocks += req.blocks
            req.blocks = 0
        elif self.is_decoding(req):
            self._leave_decode(req)  # frees its blocks; its lazy heap entries are skipped later

    def take_all(self) -> list[SimRequest]:
        """Remove every queued and running request (for re-dispatch); only between steps."""
        out = [self._leave_decode(r) for r in sorted(self._dec.values(), key=lambda r: r.seq)]
        for r in self.prefilling:
            self.free_blocks += r.blocks
            r.blocks = 0
        out += self.prefilling
        self.prefilling = []
        self._lifo.clear()
        self._finish_heap.clear()
        out += list(self.waiting)
        self.waiting.clear()
        self._queued_tokens = 0
        return out

    def decoding_requests(self) -> list[tuple[int, SimRequest]]:
        """(context tokens, request) of every decoding request, in admission order. O(batch)."""
        return [(r.offset + self.step_index, r) for r in self._dec.values()]

    def is_decoding(self, req: SimRequest) -> bool:
        """Whether `req` decodes here (it has its whole prompt and at least one token in this replica)."""
        return req.decoding and self._dec.get(req.seq) is req

    def take_decoding(self, req: SimRequest) -> SimRequest:
        """Remove one decoding request, its context and generated tokens materialised and its KV blocks
        freed (the caller moves the KV elsewhere or drops it); only between steps."""
        if self._busy:
            raise RuntimeError(f"{self.replica_id}: take_decoding during a step")
        if not self.is_decoding(req):
            raise ValueError(f"{self.replica_id}: request {req.request_id} is not decoding here")
        self._leave_decode(req)  # its lazy LIFO and finish-heap entries are skipped later
        return req

    def take_waiting(self) -> list[SimRequest]:
        out = list(self.waiting)
        self.waiting.clear()
        self._queued_tokens = 0
        return out

    @property
    def busy(self) -> bool:
        return self._busy

    @property
    def step_end_s(self) -> float:
        return self._run_end_s

    # --- the decoding aggregate ----------------------------------------------------------------

    def _join_decode(self, r: SimRequest) -> None:
        """r's prompt is done and it has a token: from the next step on it decodes every step."""
        r.decoding = True
        r.offset = r.ctx - self.step_index
        self._dec[r.seq] = r
        self._dec_sum_offset += r.offset
        self._dec_mod[r.offset % self.block_tokens] += 1
        heapq.heappush(self._finish_heap, (self.step_index + r.output_tokens - r.generated, r.seq))

    def _leave_decode(self, r: SimRequest) -> SimRequest:
        """Materialise r's context, tokens and blocks and take it out of the aggregate."""
        del self._dec[r.seq]
        self._dec_sum_offset -= r.offset
        self._dec_mod[r.offset % self.block_tokens] -= 1
        ctx = r.offset + self.step_index
        r.generated += ctx - r.ctx
        r.ctx = ctx
        r.blocks = -(-ctx // self.block_tokens)
        self.free_blocks += r.blocks
        r.blocks = 0
        r.decoding = False
        # The aggregate keeps no per-request token times; r's last token came at the end of the last
        # step (the gap to its next token, after a preemption or a move, is then measured from there).
        r.last_token_s = self._run_end_s
        return r

    def _crossings(self, k: int) -> int:
        """New KV blocks the decoding requests need over the next k steps."""
        if k <= 0 or not self._dec:
            return 0
        bt, s = self.block_tokens, self.step_index
        if k == 1:  # the requests whose context is a whole number of blocks: (offset + s) % bt == 0
            return self._dec_mod[-s % bt]
        total = 0
        for c, count in enumerate(self._dec_mod):
            if count:
                # steps t in [s, s+k) with (c + t) % bt == 0 need a block
                first = s + ((-c - s) % bt)
                if first < s + k:
                    total += count * ((s + k - 1 - first) // bt + 1)
        return total

    def _preempt_last(self) -> SimRequest | None:
        """Preempt the most recently admitted running request (recompute), as vLLM does."""
        while self._lifo:
            seq = -heapq.heappop(self._lifo)
            r = self._dec.get(seq)
            if r is not None:
                self._leave_decode(r)
            else:
                r = next((p for p in self.prefilling if p.seq == seq), None)
                if r is None:
                    continue  # finished or moved already
                self.prefilling.remove(r)
                self.free_blocks += r.blocks
                r.blocks = 0
            r.drop_kv()
            r.num_preemptions += 1
            self.waiting.appendleft(r)
            self._queued_tokens += r.prompt_tokens
            return r
        return None

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    # --- planning a step -----------------------------------------------------------------------

    def _start(self, now_s: float) -> float | None:
        """Schedule the next step at `now_s` and return its end time (None: nothing to run)."""
        chunked = self.engine.chunked_prefill
        # 1. every decoding request takes one token; make room for their new blocks (LIFO preemption)
        need = self._crossings(1)
        while need > self.free_blocks and self._preempt_last() is not None:
            need = self._crossings(1)
        self.free_blocks -= need
        n_dec = len(self._dec)
        budget = self.engine.max_num_batched_tokens - n_dec
        chunks: list[tuple[SimRequest, int]] = []
        # 2. running prompts continue, in admission order
        for r in list(self.prefilling):
            if r not in self.prefilling or budget <= 0:
                continue
            left = r.prompt_tokens - r.prefilled
            tokens = min(left, budget) if chunked else left
            if tokens > budget and chunks:
                continue
            extra = self._blocks_for(r.ctx + tokens) - r.blocks
            while extra > self.free_blocks:
                victim = self._preempt_last()
                if victim is None or victim is r:
                    break
            if r not in self.prefilling or extra > self.free_blocks:
                continue
            self.free_blocks -= extra
            r.blocks += extra
            chunks.append((r, tokens))
            budget -= tokens
        n_dec = len(self._dec)  # preemption may have shrunk it
        # 3. waiting requests, first come first served
        while self.waiting and len(self._dec) + len(self.prefilling) < self._max_seqs and budget > 0:
            r = self.waiting[0]
            left = r.prompt_tokens - r.prefilled
            tokens = min(left, budget) if chunked else left
            if tokens > budget and (chunks or n_dec):
                break
            extra = self._blocks_for(r.ctx + tokens) - r.blocks
            if extra > self.free_blocks:
                break
            if self.engine.admit_whole_prompt:
                still = sum(self._blocks_for(p.prompt_tokens) - p.blocks for p in self.prefilling)
                if self._blocks_for(r.prompt_tokens) - r.blocks + still > self.free_blocks:
                    break  # its whole prompt does not fit beside the prompts being prefilled
            self.waiting.popleft()
            self._queued_tokens -= left
            self.free_blocks -= extra
            r.blocks += extra
            self._admitted += 1
            r.seq = self._admitted
            heapq.heappush(self._lifo, -r.seq)
            self.prefilling.append(r)
            chunks.append((r, tokens))
            budget -= tokens
        if not chunks and not n_dec:
            if self.waiting:
                # the head's prompt needs more KV than the whole replica has: reject it rather than spin
                gone = self.waiting.popleft()
                self._queued_tokens -= gone.prompt_tokens - gone.prefilled
                self.rejected.append(gone)
                return self._start(now_s)
            return None
        tokens = pairs = cached = rows = 0
        for r, t in chunks:
            tokens += t
            pairs += t * (r.ctx + (t + 1) / 2)
            cached += r.ctx
            if r.prefilled + t >= r.prompt_tokens:
                rows += 1
        dec_ctx = self._dec_sum_offset + n_dec * self.step_index
        batch = Batch(tokens + n_dec, float(pairs), cached, n_dec, dec_ctx, rows + n_dec, len(chunks))
        a = self.step_seconds(batch)
        k, b = 1, 0.0
        if not chunks and n_dec and (not self.waiting or n_dec >= self._max_seqs or self._head_blocked()):
            k = self._decode_run_length()
            if k > 1:
                grown = Batch(n_dec, 0.0, 0, n_dec, dec_ctx + n_dec, n_dec)
                b = self.step_seconds(grown) - a
        self._busy = True
        self._run_start_s = now_s
        self._run_k = k
        self._run_a = a
        self._run_b = b
        self._run_chunks = chunks
        self._run_n_dec = n_dec
        self._run_end_s = now_s + k * a + b * k * (k - 1) / 2
        self.step_token += 1
        return self._run_end_s

    def _head_blocked(self) -> bool:
        r = self.waiting[0]
        return self._blocks_for(r.ctx + 1) - r.blocks > self.free_blocks

    def _decode_run_length(self) -> int:
        """Steps the pure-decode batch can repeat: until the first finish or a KV shortfall."""
        while self._finish_heap and self._finish_heap[0][1] not in self._dec:
            heapq.heappop(self._finish_heap)
        k = self._finish_heap[0][0] - self.step_index if self._finish_heap else 1
        if k <= 1:
            return 1
        # the first step's blocks are reserved; steps 2..k need crossings(k) - crossings(1) more
        first = self._crossings(1)
        if self._crossings(k) - first <= self.free_blocks:
            return k
        lo, hi = 1, k
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._crossings(mid) - first <= self.free_blocks:
                lo = mid
            else:
                hi = mid
        return lo

    # --- applying a step -----------------------------------------------------------------------

    def _apply(self, now_s: float) -> list[SimRequest]:
        k = self._run_k
        n_dec = self._run_n_dec
        self.num_steps += k
        self.busy_s += now_s - self._run_start_s
        if self.waiting:
            self.saturated_s += now_s - self._run_start_s
        if k > 1:
            self.free_blocks -= self._crossings(k) - self._crossings(1)
        if n_dec:
            self.tbt.add_linear(self._run_a, self._run_b, k, n_dec)
        self.step_index += k
        finished: list[SimRequest] = []
        while self._finish_heap and self._finish_heap[0][0] <= self.step_index:
            _, seq = heapq.heappop(self._finish_heap)
            r = self._dec.get(seq)
            if r is None:
                continue
            self._leave_decode(r)
            r.finish_s = now_s
            r.last_token_s = now_s
            finished.append(r)
        for r, t in self._run_chunks:
            r.prefilled += t
            r.ctx += t
            if r.prefilled < r.prompt_tokens:
                continue
            self.prefilling.remove(r)
            if r.generated == 0:
                r.first_token_s = now_s
            else:
                self.tbt.add(now_s - r.last_token_s)  # the gap a preemption or migration caused
            r.generated += 1
            r.last_token_s = now_s
            if r.generated >= r.output_tokens:
                self.free_blocks += r.blocks
                r.blocks = 0
                r.finish_s = now_s
                finished.append(r)
            else:
                self._join_decode(r)
        self._run_chunks = []
        return finished
