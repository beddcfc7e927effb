"""Migration executor: worker processes, one per GPU, move real tensors as a switch plan says.

Each worker holds real tensors: its source shards of the model's weights (made from a seed, one
`torch.Generator` per tensor, so every process can rebuild any full tensor to check against) and the
source KV shards of the requests that migrate. It executes its share of the plan, in plan order, with
`torch.distributed` point-to-point operations: `batch_isend_irecv` of every operation that fits in a
window of `max_inflight` outstanding ones, refilled each time the oldest finishes, so sends and receives
with all peers overlap. Data lands in *staging* buffers: the target shards, and one KV buffer per target
replica pre-allocated with the plan's headroom. Source shards are never written.

A switch is a transaction. Phase one: every worker moves its bytes and checks every staged target
shard bit-exact against the slice of the full tensor. Only if every worker reports success does the
coordinator send COMMIT (workers drop source shards and keep the staged ones); on any failure — an
error, a timeout, a mismatch — it sends ABORT: workers drop staging, check that their source shards
are intact (the source deployment keeps serving) and say so, and the result carries a
`SwitchRolledBack` event with the reason.

A relayed transfer (`Transfer.relay`: its source got those lines earlier in the same plan) is sent from
the source's staging buffer, and only once the receives that delivered its lines have completed: they
come earlier in plan order, every worker issues its operations in plan order, so waiting for them cannot
deadlock. A plan whose relay comes before its delivery is refused up front; KV plans carry no relays.

Only gloo (CPU tensors) is wired: the point-to-point calls are backend-agnostic, but NCCL would need
each rank's tensors on its own CUDA device and one GPU per rank.

The rendezvous store listens on a port of 127.0.0.1 the OS picks; every wait has a deadline; worker
processes are always joined, and terminated then killed if they do not exit.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import sys
import time
import traceback
import zlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from oserve.errors import ConfigError, OServeError
from oserve.specs import ModelSpec, stage_layers
from oserve.switch.intervals import IntervalSet, contains, offset_of, union
from oserve.switch.kv import KVMigrationPlan
from oserve.switch.layout import (RunningRequest, TensorSpec, deployment_weight_layout, gpu_role, kv_head_range,
                                  model_tensors, replica_kv_layout)
from oserve.switch.planner import SwitchPlan, Transfer

DTYPES = {2: torch.float16, 4: torch.float32}
BITS = {2: torch.int16, 4: torch.int32}


class SwitchExecutionError(OServeError):
    """The executor could not run (workers did not start or answer in time)."""


@dataclass(frozen=True, slots=True)
class ExecutorConfig:
    """How the executor runs its worker processes."""

    timeout_s: float = 60.0
    """Deadline of every wait: rendezvous, the transfer phase, each control answer."""
    max_inflight: int = 16
    """Point-to-point operations a worker keeps outstanding."""
    backend: str = "gloo"
    """torch.distributed backend ('gloo' on CPU; 'nccl' needs CUDA tensors and is not wired here)."""
    start_method: str = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    """multiprocessing start method. The forkserver (preloaded with torch, started once per parent process
    and gone with it) forks each worker in a fraction of a second; spawn re-imports torch per worker."""
    host: str = "127.0.0.1"
    gloo_ifname: str | None = "lo" if sys.platform.startswith("linux") else None
    """Network interface gloo binds to (the loopback, since every worker is local); None: gloo's default."""
    threads_per_worker: int = 1
    fail_gpu: int | None = None
    """Failure injection: the worker of this GPU fails..."""
    fail_after_ops: int = 0
    """...after issuing this many of its point-to-point operations."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0 or self.max_inflight < 1 or self.threads_per_worker < 1:
            raise ConfigError(f"ExecutorConfig: timeout_s > 0, max_inflight >= 1, threads_per_worker >= 1 required, "
                              f"got {self.timeout_s}, {self.max_inflight}, {self.threads_per_worker}")
        if self.backend != "gloo":
            raise ConfigError(f"ExecutorConfig: backend {self.backend!r} not supported on this path (gloo only)")
        if self.fail_after_ops < 0:
            raise ConfigError(f"ExecutorConfig: fail_after_ops must be >= 0, got {self.fail_after_ops}")


@dataclass(frozen=True, slots=True)
class ExecutorEvent:
    """Something the switch did, past tense: SwitchStarted, SwitchCommitted, SwitchRolledBack."""

    kind: str
    detail: str


@dataclass(frozen=True, slots=True)
class ExecutionResult:
    committed: bool
    rolled_back: bool
    bit_exact: bool
    """Every staged target shard (weights and KV) equalled the slice of the full tensor."""
    source_intact: bool
    """After a rollback, every surviving source shard still equals its slice (True after a commit)."""
    bytes: int
    """Bytes moved between processes (NVLink and network transfers of the plan)."""
    local_bytes: int
    """Bytes copied inside a process."""
    seconds: float
    """Wall time of the transfer phase, first worker start to last worker end."""
    gbytes_per_s: float
    num_workers: int
    events: tuple[ExecutorEvent, ...]
    errors: tuple[str, ...] = ()


# --- tensors from a seed -----------------------------------------------------------------------

def _tensor_seed(seed: int, name: str) -> int:
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 62)


def full_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    """The full tensor `spec` names, random normal from a generator seeded by (seed, name). Pure."""
    if spec.bytes_per_elem not in DTYPES:
        raise ConfigError(f"executor supports {sorted(DTYPES)} bytes per element, not {spec.bytes_per_elem}")
    g = torch.Generator().manual_seed(_tensor_seed(seed, spec.name))
    return torch.randn(spec.rows, spec.cols, generator=g, dtype=DTYPES[spec.bytes_per_elem])


def take_lines(full: torch.Tensor, spec: TensorSpec, lines: IntervalSet) -> torch.Tensor:
    """The lines of a full tensor as one local shard (intervals concatenated along the split axis)."""
    parts = [full.narrow(spec.split_axis, lo, hi - lo) for lo, hi in lines]
    return torch.cat(parts, dim=spec.split_axis).contiguous() if len(parts) != 1 else parts[0].contiguous()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(BITS[a.element_size()]),
                                                                      b.contiguous().view(BITS[b.element_size()]))


# --- what each worker is given -----------------------------------------------------------------

@dataclass(frozen=True)
class _KVPool:
    """The pre-allocated KV buffer of one target GPU: [layers here, 2, KV heads here, blocks*block_tokens, head_dim]."""

    first_layer: int
    num_layers: int
    head_lo: int
    head_hi: int
    num_blocks: int
    block_tokens: int
    # request_id -> (first block, context tokens)
    tables: Mapping[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Job:
    gpu: int
    rank: int
    world: int
    ranks: Mapping[int, int]  # gpu -> rank
    model: ModelSpec
    seed: int
    have: Mapping[str, IntervalSet]
    want: Mapping[str, IntervalSet]
    kv_tensors: Mapping[str, TensorSpec]
    kv_have: Mapping[str, IntervalSet]
    kv_want: Mapping[str, IntervalSet]
    kv_pool: _KVPool | None
    transfers: tuple[tuple[int, Transfer], ...]  # (global tag, transfer) involving this GPU, in plan order
    config: ExecutorConfig
    host: str
    port: int


class InjectedFailure(RuntimeError):
    pass


# --- the worker --------------------------------------------------------------------------------

def _worker(job: _Job, conn) -> None:  # pragma: no cover - runs in a child process
    """Entry point of one worker process: set up, transfer, verify, then commit or roll back."""
    try:
        code = _worker_main(job, conn)
    except BaseException as exc:  # the outermost handler: report and leave
        try:
            conn.send(("failed", job.gpu, {"error": f"{type(exc).__name__}: {exc}", "source_intact": None,
                                           "trace": traceback.format_exc(limit=6)}))
        except Exception:
            pass
        code = 1
    try:
        conn.close()
    finally:
        # Leave at once: exiting closes this worker's gloo connections, so peers blocked on an operation
        # with it fail fast instead of waiting out their deadline (that is how a failure spreads), and
        # outstanding operations of an aborted switch cannot block interpreter teardown.
        os._exit(code)


def _worker_main(job: _Job, conn) -> int:
    import torch.distributed as dist

    cfg = job.config
    torch.set_num_threads(cfg.threads_per_worker)
    if cfg.gloo_ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = cfg.gloo_ifname
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    store = dist.TCPStore(job.host, job.port, is_master=False, timeout=timeout)
    dist.init_process_group(cfg.backend, store=store, rank=job.rank, world_size=job.world, timeout=timeout)
    dist.barrier()  # every rank connected before the first point-to-point batch (NCCL needs it)

    specs = {**model_tensors(job.model), **job.kv_tensors}
    refs: dict[str, torch.Tensor] = {}

    def ref(name: str) -> torch.Tensor:
        if name not in refs:
            refs[name] = full_tensor(specs[name], job.seed)
        return refs[name]

    # Source shards (never written) and staging for the target shards.
    held = {**job.have, **job.kv_have}
    source = {n: take_lines(ref(n), specs[n], s) for n, s in held.items()}
    staging: dict[str, torch.Tensor] = {}
    for name, lines in job.want.items():
        if job.have.get(name) == lines:
            staging[name] = source[name]  # kept in place
        else:
            spec = specs[name]
            n = sum(hi - lo for lo, hi in lines)
            shape = (n, spec.cols) if spec.split_axis == 0 else (spec.rows, n)
            staging[name] = torch.full(shape, float("nan"), dtype=DTYPES[spec.bytes_per_elem])
    pool = None
    if job.kv_pool is not None:
        p = job.kv_pool
        pool = torch.full((p.num_layers, 2, p.head_hi - p.head_lo, p.num_blocks * p.block_tokens, job.model.head_dim),
                          float("nan"), dtype=DTYPES[job.model.bytes_per_param])
    nkv = job.model.num_kv_heads

    def put(name: str, lo: int, data: torch.Tensor) -> None:
        """Write lines [lo, lo + len) of tensor `name` into this GPU's staging (KV into its pool)."""
        spec = specs[name]
        if name in job.kv_tensors:
            kv = job.kv_pool
            _, req, layer = name.split(".")
            first_block, tokens = kv.tables[req]
            rows = data.shape[0]
            r = 0
            while r < rows:  # runs of consecutive tokens of one (kind, head)
                kind_head, tok = divmod(lo + r, tokens)
                kind, head = divmod(kind_head, nkv)
                n = min(rows - r, tokens - tok)
                slot = first_block * kv.block_tokens + tok
                pool[int(layer) - kv.first_layer, kind, head - kv.head_lo, slot:slot + n] = data[r:r + n]
                r += n
            return
        off = offset_of(job.want[name], lo)
        staging[name].narrow(spec.split_axis, off, data.shape[spec.split_axis]).copy_(data)

    def get(name: str, lo: int, hi: int) -> torch.Tensor:
        spec = specs[name]
        return source[name].narrow(spec.split_axis, offset_of(held[name], lo), hi - lo).contiguous()

    received: dict[str, IntervalSet] = {}  # weight tensor -> lines received into staging so far

    def forward(name: str, lo: int, hi: int) -> torch.Tensor:
        """Lines this GPU received earlier in the switch, read back from its staging (a relay's source)."""
        spec = specs[name]
        return staging[name].narrow(spec.split_axis, offset_of(job.want[name], lo), hi - lo).contiguous()

    def source_intact() -> bool:
        return all(same_bits(source[n], take_lines(ref(n), specs[n], s)) for n, s in held.items())

    conn.send(("ready", job.gpu))
    if not conn.poll(cfg.timeout_s):
        raise TimeoutError("no start signal from the coordinator")
    if conn.recv() != "go":
        conn.send(("rolled_back", job.gpu, {"source_intact": source_intact(), "why": "aborted before start"}))
        return 0

    deadline = time.monotonic() + cfg.timeout_s
    started = time.monotonic()
    moved = local = issued = 0
    try:
        # KV lines this GPU holds already in the right slice: adopt them into the new pool.
        for name, lines in job.kv_want.items():
            if job.kv_have.get(name) == lines:
                for lo, hi in lines:
                    put(name, lo, get(name, lo, hi))
        pending: deque = deque()  # (work, transfer, receive buffer or None), oldest first
        queue = job.transfers
        qi = 0
        while qi < len(queue) or pending:
            if conn.poll():
                if conn.recv() == "abort":
                    conn.send(("rolled_back", job.gpu, {"source_intact": source_intact(), "why": "aborted"}))
                    return 0
            batch, meta = [], []
            waiting_relay = False
            while qi < len(queue) and len(pending) + len(batch) < cfg.max_inflight:
                tag, t = queue[qi]
                if t.relay and t.src_gpu == job.gpu and not contains(received.get(t.tensor, ()), (t.lines,)):
                    # Forward only what has landed: the receives that deliver these lines come earlier in
                    # plan order, so they are issued already; wait for them before going on.
                    waiting_relay = True
                    break
                qi += 1
                if t.link == "local":
                    put(t.tensor, t.lines[0], get(t.tensor, *t.lines))
                    local += t.num_bytes
                    continue
                if cfg.fail_gpu == job.gpu and issued >= cfg.fail_after_ops:
                    raise InjectedFailure(f"injected failure: GPU {job.gpu} lost its link before transfer #{tag} "
                                          f"({t.tensor} {t.lines} {t.src_gpu}->{t.dst_gpu})")
                issued += 1
                spec = specs[t.tensor]
                if t.src_gpu == job.gpu:
                    data = forward(t.tensor, *t.lines) if t.relay else get(t.tensor, *t.lines)
                    batch.append(dist.P2POp(dist.isend, data, job.ranks[t.dst_gpu], tag=tag))
                    meta.append((t, None))
                else:
                    n = t.lines[1] - t.lines[0]
                    buf = torch.empty((n, spec.cols) if spec.split_axis == 0 else (spec.rows, n),
                                      dtype=DTYPES[spec.bytes_per_elem])
                    batch.append(dist.P2POp(dist.irecv, buf, job.ranks[t.src_gpu], tag=tag))
                    meta.append((t, buf))
            if batch:
                pending.extend((w, t, b) for w, (t, b) in zip(dist.batch_isend_irecv(batch), meta))
            if waiting_relay and not pending:
                tag, t = queue[qi]
                raise RuntimeError(f"transfer #{tag} relays {t.tensor} {t.lines} from GPU {job.gpu}, which no "
                                   "earlier transfer of the plan delivered them to")
            if pending:
                # gloo completes an operation only inside wait(), and a wait that times out breaks it, so
                # wait for the oldest with the whole remaining deadline; the others progress meanwhile.
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"transfers not done within {cfg.timeout_s} s")
                w, t, buf = pending.popleft()
                w.wait(timeout=datetime.timedelta(seconds=left))
                if buf is not None:
                    put(t.tensor, t.lines[0], buf)
                    if t.tensor in job.want:
                        received[t.tensor] = union(received.get(t.tensor, ()), (t.lines,))
                moved += t.num_bytes
    except Exception as exc:
        conn.send(("failed", job.gpu, {"error": f"{type(exc).__name__}: {exc}", "source_intact": source_intact()}))
        return 1
    ended = time.monotonic()

    # Verify every staged target shard, weights and KV, bit for bit.
    mismatches = []
    for name, lines in job.want.items():
        if not same_bits(staging[name], take_lines(ref(name), specs[name], lines)):
            mismatches.append(f"GPU {job.gpu}: {name} {lines}")
    if pool is not None:
        kv = job.kv_pool
        for name in job.kv_want:
            _, req, layer = name.split(".")
            first_block, tokens = kv.tables[req]
            slot = first_block * kv.block_tokens
            got = pool[int(layer) - kv.first_layer, :, :, slot:slot + tokens]  # [2, heads here, tokens, head_dim]
            full = ref(name).view(2, nkv, tokens, job.model.head_dim)[:, kv.head_lo:kv.head_hi]
            if not same_bits(got, full):
                mismatches.append(f"GPU {job.gpu}: {name}")
    conn.send(("transferred", job.gpu, {"moved": moved, "local": local, "start": started, "end": ended,
                                         "mismatches": mismatches}))
    if not conn.poll(cfg.timeout_s):
        conn.send(("rolled_back", job.gpu, {"source_intact": source_intact(), "why": "no decision in time"}))
        return 0
    if conn.recv() == "commit":
        source.clear()  # the staged shards are this GPU's weights and KV now
        conn.send(("committed", job.gpu))
        return 0
    conn.send(("rolled_back", job.gpu, {"source_intact": source_intact(), "why": "aborted"}))
    return 0


# --- the coordinator ---------------------------------------------------------------------------

def _kv_inputs(model: ModelSpec, plan: SwitchPlan, kv_plan: KVMigrationPlan | None):
    """Per GPU: KV tensors, source lines, target lines and the target pool geometry."""
    tensors: dict[str, TensorSpec] = {t.name: t for t in (kv_plan.tensors if kv_plan else ())}
    have: dict[int, dict[str, IntervalSet]] = {}
    want: dict[int, dict[str, IntervalSet]] = {}
    pools: dict[int, _KVPool] = {}
    if not kv_plan or not kv_plan.migrations:
        return tensors, have, want, pools
    src = {r.replica_id: r for r in plan.source.replicas}
    dst = {r.replica_id: r for r in plan.target.replicas}
    buffers = {b.replica_id: b for b in kv_plan.buffers}
    tables: dict[str, dict[str, tuple[int, int]]] = {}  # replica -> request -> (first block, tokens)
    for m in kv_plan.migrations:
        req = RunningRequest(m.request_id, m.src_replica_id, m.context_tokens)
        for replica, into in ((src[m.src_replica_id], have), (dst[m.dst_replica_id], want)):
            _, lines = replica_kv_layout(model, replica, [req])
            for g, by_name in lines.items():
                into.setdefault(g, {}).update(by_name)
        tables.setdefault(m.dst_replica_id, {})[m.request_id] = (m.first_block, m.context_tokens)
    for rid, table in tables.items():
        replica = dst[rid]
        layers = stage_layers(model.num_layers, replica.shape.pp)
        for g in replica.gpu_ids:
            stage, rank = gpu_role(replica, g)
            lo, hi = kv_head_range(model, replica.shape.tp, rank)
            pools[g] = _KVPool(sum(layers[:stage]), layers[stage], lo, hi, buffers[rid].num_blocks,
                               buffers[rid].block_tokens, dict(table))
    return tensors, have, want, pools


def execute_switch(model: ModelSpec, plan: SwitchPlan, *, seed: int, kv_plan: KVMigrationPlan | None = None,
                   config: ExecutorConfig = ExecutorConfig()) -> ExecutionResult:
    """Run a weight plan (and optionally a KV plan) on one worker process per GPU; commit or roll back.

    The model should be small enough for this machine: every worker builds the full tensors it checks
    against. Raises SwitchExecutionError when workers cannot be started or do not answer in time (after
    cleaning them up); a failure during the transfers is not raised but rolled back and reported.
    """
    import torch.distributed as dist

    _check_relays(plan.transfers, "weight plan")
    if kv_plan is not None and any(t.relay for t in kv_plan.transfers):
        raise ConfigError("execute_switch: the KV plan relays a transfer; KV relays are not supported "
                          "(plan_kv_migration plans none)")
    gpus = sorted({g for r in plan.source.replicas + plan.target.replicas for g in r.gpu_ids})
    if not gpus:
        return ExecutionResult(True, False, True, True, 0, 0, 0.0, 0.0, 0, (ExecutorEvent("SwitchCommitted", "no change"),))
    ranks = {g: i for i, g in enumerate(gpus)}
    have = deployment_weight_layout(model, plan.source)
    want = deployment_weight_layout(model, plan.target)
    kv_tensors, kv_have, kv_want, pools = _kv_inputs(model, plan, kv_plan)
    tagged = list(enumerate(plan.transfers))
    offset = len(tagged)
    if kv_plan is not None:
        tagged += [(offset + i, t) for i, t in enumerate(kv_plan.transfers)]
    per_gpu: dict[int, list] = {g: [] for g in gpus}
    for tag, t in tagged:
        per_gpu[t.src_gpu].append((tag, t))
        if t.dst_gpu != t.src_gpu:
            per_gpu[t.dst_gpu].append((tag, t))
    timeout = datetime.timedelta(seconds=config.timeout_s)
    store = dist.TCPStore(config.host, 0, is_master=True, timeout=timeout, wait_for_workers=False)
    ctx = _context(config.start_method)
    procs, conns = {}, {}
    events = [ExecutorEvent("SwitchStarted", f"{len(gpus)} workers, {len(tagged)} transfers")]
    try:
        for g in gpus:
            job = _Job(g, ranks[g], len(gpus), ranks, model, seed, dict(have.get(g, {})), dict(want.get(g, {})),
                       kv_tensors, kv_have.get(g, {}), kv_want.get(g, {}), pools.get(g), tuple(per_gpu[g]), config,
                       config.host, store.port)
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(job, child), name=f"oserve-switch-gpu{g}", daemon=True)
            p.start()
            child.close()
            procs[g], conns[g] = p, parent
        ready, failed = _gather(conns, procs, gpus, {"ready"}, config.timeout_s, stop_on_failure=True)
        if failed or len(ready) < len(gpus):
            why = "; ".join(_describe(g, info) for g, info in failed.items()) or "no answer in time"
            raise SwitchExecutionError(f"switch workers did not start: {why}")
        _broadcast(conns, "go")
        done, failed = _gather(conns, procs, gpus, {"transferred"}, config.timeout_s, stop_on_failure=True)
        stats = [info for info in done.values()]
        moved = sum(s["moved"] for s in stats) // 2  # each moved byte is counted by its sender and its receiver
        local = sum(s["local"] for s in stats)
        seconds = (max(s["end"] for s in stats) - min(s["start"] for s in stats)) if stats else 0.0
        mismatches = [m for s in stats for m in s["mismatches"]]
        bit_exact = len(done) == len(gpus) and not mismatches
        if bit_exact:
            _broadcast(conns, "commit")
            ok, failed = _gather(conns, procs, gpus, {"committed"}, config.timeout_s)
            if len(ok) == len(gpus):
                events.append(ExecutorEvent("SwitchCommitted", f"{moved} bytes moved, {local} copied locally, every "
                                                             "target shard bit-exact"))
                return ExecutionResult(True, False, True, True, moved, local, seconds,
                                       moved / seconds / 1e9 if seconds > 0 else 0.0, len(gpus), tuple(events))
            # A worker vanished between its report and the commit: the others have committed.
            errors = tuple(_describe(g, info) for g, info in failed.items())
            events.append(ExecutorEvent("SwitchCommitFailed", "; ".join(errors) or "a worker did not confirm"))
            return ExecutionResult(False, False, True, False, moved, local, seconds, 0.0, len(gpus), tuple(events),
                                   errors)
        # Roll back: every worker not already gone drops its staging and checks its source shards.
        errors = [_describe(g, info) for g, info in failed.items()] + mismatches
        _broadcast(conns, "abort")
        rest = [g for g in gpus if g not in failed]
        back, gone = _gather(conns, procs, rest, {"rolled_back"}, config.timeout_s)
        errors += [_describe(g, info) for g, info in gone.items()]
        verdicts = [info.get("source_intact") if info else None for info in {**failed, **back, **gone}.values()]
        intact = len(verdicts) == len(gpus) and all(v is True for v in verdicts)
        reason = errors[0] if errors else "workers did not report"
        events.append(ExecutorEvent("SwitchRolledBack", f"{reason}; source deployment kept serving"
                                  + (", every source shard verified intact" if intact else
                                     ", but not every source shard could be verified")))
        return ExecutionResult(False, True, False, intact, moved, local, seconds, 0.0, len(gpus), tuple(events),
                               tuple(errors))
    finally:
        for c in conns.values():
            c.close()
        for p in procs.values():
            p.join(timeout=5.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
        del store


def _check_relays(transfers, what: str) -> None:
    """Every relayed transfer forwards lines that earlier transfers delivered to its source GPU.

    Raises:
        ConfigError: one does not (the plan's order is wrong, or it relays what nobody sends it).
    """
    got: dict[tuple[int, str], IntervalSet] = {}  # (gpu, tensor) -> lines delivered so far
    for i, t in enumerate(transfers):
        if t.relay and not contains(got.get((t.src_gpu, t.tensor), ()), (t.lines,)):
            raise ConfigError(f"{what}: transfer #{i} relays {t.tensor} {t.lines} from GPU {t.src_gpu} to "
                              f"{t.dst_gpu} before any earlier transfer delivered those lines to GPU {t.src_gpu}")
        if t.link != "local":
            got[(t.dst_gpu, t.tensor)] = union(got.get((t.dst_gpu, t.tensor), ()), (t.lines,))


def _context(method: str):
    """A multiprocessing context; a forkserver preloads torch once, so each worker starts in a fraction of a second."""
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", "oserve.switch.executor"])
    return ctx


def _describe(gpu: int, info: dict | None) -> str:
    return f"GPU {gpu}: " + (info.get("error", "failed") if info else "worker exited without a word")


def _broadcast(conns, msg) -> None:
    for c in conns.values():
        try:
            c.send(msg)
        except (BrokenPipeError, OSError):
            pass  # that worker is gone; _gather reports it


def _gather(conns, procs, gpus, kinds: set[str], timeout_s: float, stop_on_failure: bool = False,
            ) -> tuple[dict[int, dict], dict[int, dict | None]]:
    """Replies of one of `kinds` from the workers of `gpus` within the deadline: (gpu -> payload, failures).

    Failures (gpu -> payload or None) are 'failed' replies, workers that exited without the reply, and
    workers still silent at the deadline. With `stop_on_failure` the first failure ends the wait.
    """
    from multiprocessing.connection import wait

    deadline = time.monotonic() + timeout_s
    got: dict[int, dict] = {}
    failed: dict[int, dict | None] = {}
    waiting = {g: conns[g] for g in gpus}
    by_conn = {id(c): g for g, c in waiting.items()}
    while waiting and not (stop_on_failure and failed):
        left = deadline - time.monotonic()
        if left <= 0:
            failed.update({g: {"error": f"no answer within {timeout_s} s"} for g in waiting})
            break
        for c in wait(list(waiting.values()), timeout=min(left, 0.5)):
            g = by_conn[id(c)]
            try:
                msg = c.recv()
            except (EOFError, OSError):
                failed[g] = None
                waiting.pop(g)
                continue
            if msg[0] in kinds:
                got[g] = msg[2] if len(msg) > 2 else {}
                waiting.pop(g)
            elif msg[0] == "failed":
                failed[g] = msg[2]
                waiting.pop(g)
        for g in list(waiting):
            if not procs[g].is_alive() and not waiting[g].poll():
                failed[g] = None
                waiting.pop(g)
    return got, failed




# --- the executor benchmark --------------------------------------------------------------------

BENCH_MODEL = ModelSpec("llama-mini", num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=4,
                        intermediate_size=2816, vocab_size=32000, gated_mlp=True, max_context_tokens=4096)
"""Llama-architecture model scaled down to fit four CPU processes: 8 blocks, width 1024, GQA 16/4, 156M params."""


def bench_executor(*, seed: int = 0, planner: str = "improved", with_failure: bool = True,
                   with_relay: bool = True, config: ExecutorConfig = ExecutorConfig()) -> dict:
    """Execute a real switch over 4 worker processes and report what it moved, how fast, and if bit-exact.

    Two nodes of two GPUs (so both NVLink and network transfers occur): (DP=2, TP=2) -> (TP=1, PP=4) of
    `BENCH_MODEL`, with three long requests migrating their KV cache. With `with_failure`, the same
    switch is run again with an injected link failure and must roll back with the sources intact. With
    `with_relay`, a scale-out whose plan relays (`relay_switch`) is run too.
    """
    from oserve.specs import ClusterSpec, Deployment, GPUS, Replica, ReplicaShape
    from oserve.switch.kv import KVPolicy, plan_kv_migration
    from oserve.switch.layout import RunningRequest
    from oserve.switch.planner import plan_switch

    model = BENCH_MODEL
    cluster = ClusterSpec("2x2-sim", 2, 2, GPUS["h100-80gb"], 400e9, 200e9)
    source = Deployment((Replica("r0", ReplicaShape(2), (0, 1)), Replica("r1", ReplicaShape(2), (2, 3))))
    target = Deployment((Replica("t0", ReplicaShape(1, 4), (0, 1, 2, 3)),))
    plan = plan_switch(model, cluster, source, target, planner=planner)
    requests = [RunningRequest("a", "r0", 1500), RunningRequest("b", "r1", 1100), RunningRequest("c", "r1", 700),
                RunningRequest("d", "r0", 90)]
    kv = plan_kv_migration(model, cluster, plan, requests, policy=KVPolicy(migrate_min_context_tokens=256),
                           planner=planner)
    res = execute_switch(model, plan, seed=seed, kv_plan=kv, config=config)
    out = {
        "bit_exact": res.bit_exact and res.committed,
        "bytes": res.bytes,
        "gbytes_per_s": res.gbytes_per_s,
        "seconds": res.seconds,
        "local_bytes": res.local_bytes,
        "workers": res.num_workers,
        "model": f"{model.name}: {model.num_layers} layers, hidden {model.hidden_size}, "
                 f"{model.num_params / 1e6:.0f}M params",
        "switch": f"(DP=2, TP=2) -> (TP=1, PP=4) on 2 nodes x 2 GPUs, planner {planner}",
        "weight_transfers": len(plan.transfers),
        "kv_migrated_requests": len(kv.migrations),
        "kv_drained_requests": len(kv.drained),
        "kv_transfers": len(kv.transfers),
        "planned_bytes": plan.moved_bytes + kv.nvlink_bytes + kv.network_bytes,
        "events": [f"{e.kind}: {e.detail}" for e in res.events],
    }
    if with_failure:
        movers = sorted({t.src_gpu for t in plan.transfers if t.link != "local"})
        fail = execute_switch(model, plan, seed=seed, kv_plan=kv,
                              config=replace(config, fail_gpu=movers[0] if movers else 0, fail_after_ops=3))
        out["injected_failure"] = {"rolled_back": fail.rolled_back, "committed": fail.committed,
                                   "source_intact": fail.source_intact,
                                   "event": f"{fail.events[-1].kind}: {fail.events[-1].detail}"}
    if with_relay:
        out["relay"] = relay_switch(seed=seed, config=config)
    return out


def relay_switch(*, seed: int = 0, config: ExecutorConfig = ExecutorConfig()) -> dict:
    """Execute a scale-out whose improved plan relays, and report it beside the relay-free plan's model.

    `BENCH_MODEL` on GPU 0 of two nodes x two GPUs -> the same replica kept, a second one on GPU 1 and a
    TP=2 replica on node 1. Without relays GPU 0's one NIC sends node 1 its whole copy; with relays GPU 1,
    which wants every line too, forwards part of what it gets over NVLink through its own NIC.
    """
    from oserve.specs import ClusterSpec, Deployment, GPUS, Replica, ReplicaShape
    from oserve.switch.planner import SwitchConfig, plan_switch

    model = BENCH_MODEL
    cluster = ClusterSpec("2x2-sim", 2, 2, GPUS["h100-80gb"], 400e9, 200e9)
    source = Deployment((Replica("r0", ReplicaShape(1), (0,)),))
    target = Deployment((Replica("t0", ReplicaShape(1), (0,)), Replica("t1", ReplicaShape(1), (1,)),
                         Replica("t2", ReplicaShape(2), (2, 3))))
    plan = plan_switch(model, cluster, source, target)
    free = plan_switch(model, cluster, source, target, config=SwitchConfig(relay=False))
    res = execute_switch(model, plan, seed=seed, config=config)
    return {
        "switch": "(TP=1 on GPU 0) -> TP=1 kept + TP=1 on GPU 1 + TP=2 on node 1, 2 nodes x 2 GPUs, planner improved",
        "bit_exact": res.bit_exact and res.committed,
        "relayed_transfers": sum(t.relay for t in plan.transfers),
        "relayed_bytes": plan.relayed_bytes,
        "bytes": res.bytes,
        "seconds": res.seconds,
        "modeled_switch_seconds": plan.switch_seconds,
        "modeled_switch_seconds_no_relay": free.switch_seconds,
        "network_bytes": plan.network_bytes,
        "network_bytes_no_relay": free.network_bytes,
        "events": [f"{e.kind}: {e.detail}" for e in res.events],
    }


__all__ = ["BENCH_MODEL", "ExecutionResult", "ExecutorConfig", "InjectedFailure", "ExecutorEvent", "SwitchExecutionError",
           "bench_executor", "execute_switch", "full_tensor", "relay_switch", "same_bits", "take_lines"]
