"""The wire plan of a live switch: which engine process sends which bytes to which, in what order. Pure.

A `SwitchPlan` names GPUs. A live switch runs between engine processes: each GPU of the source
deployment is one rank of an old replica's engine, each GPU of the target one rank of a new replica's
engine, and a GPU that is in both holds two processes while the switch runs (the old replica serving
until the router flips, the new one starting beside it with dummy weights). So every byte a new rank
needs comes from another process, including the bytes the plan keeps in place (`SwitchPlan.reused_bytes`)
or copies inside one GPU (`local` transfers): here they go from the old replica's process on that GPU
to the new one's, over the `local` link.

- **Endpoints.** `"<replica_id>/<rank>"`, rank the GPU's index in the replica's `gpu_ids` (stage-major,
  as `layout.gpu_role` counts). A source endpoint sends from the shard it holds (`holds`: tensor -> lines,
  `layout.gpu_weight_shards`); a target endpoint receives exactly its shard (`holds` is what it needs), and
  forwards lines it received earlier when the plan relays through its GPU (`Transfer.relay`).
- **Ops.** The reused shards, then the plan's transfers in the plan's order; without relays, all grouped by
  new endpoint in the order the new replicas start (the plan's order inside each group), so the first
  replica to start is served first. Consecutive pieces between the same two endpoints are merged into
  one op of at most `chunk_bytes` (a piece longer than that is cut at line boundaries). Each op is one
  message between two processes.
- **Order.** Every endpoint performs its ops in the global op order, each op blocking until both ends
  did it. No two endpoints can wait on each other in a circle: the earliest op not yet done has both of
  its ends waiting on it (each finished all its earlier ops, being earlier in the one order), so it
  completes. That holds for any number of processes and links, which is why the ops are not overlapped.
  A relayed piece is forwarded by an op after the op that delivered it (the plan's order guarantees it).

`EndpointJob` is one endpoint's share, as JSON-able data: what an engine process needs to run its part
without the rest of the plan (`oserve.switch.transport` runs it).
"""

from __future__ import annotations

import datetime
import json
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from oserve.errors import ConfigError
from oserve.specs import ModelSpec
from oserve.switch.intervals import IntervalSet, difference, length, normalize, union
from oserve.switch.layout import Holdings, TensorSpec, gpu_role, gpu_weight_shards, model_tensors
from oserve.switch.planner import SwitchPlan

MiB = 1 << 20
JOB_VERSION = 1
"""Version of `EndpointJob.to_json`'s format; a reader refuses another."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One engine process of a switch: a rank of an old (source) or a new (target) replica."""

    key: str
    """`"<replica_id>/<rank>"`."""
    replica_id: str
    rank: int
    gpu: int
    side: str
    """'source' or 'target'."""
    holds: Holdings
    """tensor -> lines: the shard it holds (source) or needs (target)."""


@dataclass(frozen=True, slots=True)
class WirePiece:
    """Lines [lo, hi) of one tensor, moving inside an op."""

    tensor: str
    lo: int
    hi: int
    relay: bool = False
    """The sender holds these lines because an earlier op delivered them to it (it is a target endpoint)."""


@dataclass(frozen=True, slots=True)
class WireOp:
    """One message between two endpoints: its pieces, packed back to back in this order."""

    index: int
    """Position in the global order."""
    src: str
    dst: str
    link: str
    """'local' (same GPU, two processes), 'nvlink' or 'network', as the plan's transfer says."""
    pieces: tuple[WirePiece, ...]
    num_bytes: int
    """Bytes of the pieces as the plan's model sizes them (`TensorSpec.line_bytes`)."""


@dataclass(frozen=True, slots=True)
class WirePlan:
    """Every endpoint of a live switch and every op, in the one order they run in."""

    endpoints: Mapping[str, Endpoint]
    ops: tuple[WireOp, ...]
    tensors: Mapping[str, TensorSpec]
    """The weight tensors of the model (name -> spec), as the layout cuts them."""

    @property
    def num_bytes(self) -> int:
        return sum(op.num_bytes for op in self.ops)

    def bytes_by_link(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for op in self.ops:
            out[op.link] += op.num_bytes
        return dict(out)

    def endpoints_of(self, replica_id: str) -> tuple[str, ...]:
        """The endpoint keys of one replica, by rank."""
        return tuple(e.key for e in sorted(self.endpoints.values(), key=lambda e: e.rank)
                     if e.replica_id == replica_id)

    def job(self, key: str) -> EndpointJob:
        """One endpoint's share of the plan. Pure."""
        ep = self.endpoints.get(key)
        if ep is None:
            raise ConfigError(f"wire plan: no endpoint {key!r}")
        ops = tuple(JobOp(op.index, op.dst if op.src == key else op.src, op.src == key, op.link, op.pieces)
                    for op in self.ops if key in (op.src, op.dst))
        names = sorted(set(ep.holds) | {p.tensor for op in ops for p in op.pieces})
        return EndpointJob(key, ep.side, ep.gpu, MappingProxyType(dict(ep.holds)),
                           MappingProxyType({n: self.tensors[n] for n in names}), ops)


@dataclass(frozen=True, slots=True)
class JobOp:
    """An op as one of its two endpoints sees it."""

    index: int
    peer: str
    send: bool
    """True: this endpoint sends the pieces; False: it receives them."""
    link: str
    pieces: tuple[WirePiece, ...]


@dataclass(frozen=True, slots=True)
class EndpointJob:
    """What one engine process does in a switch (see the module docstring)."""

    key: str
    side: str
    gpu: int
    holds: Mapping[str, IntervalSet]
    tensors: Mapping[str, TensorSpec]
    ops: tuple[JobOp, ...]
    """In the global order."""

    @property
    def receive_bytes(self) -> int:
        return sum((p.hi - p.lo) * self.tensors[p.tensor].line_bytes for op in self.ops if not op.send
                   for p in op.pieces)

    @property
    def send_bytes(self) -> int:
        return sum((p.hi - p.lo) * self.tensors[p.tensor].line_bytes for op in self.ops if op.send
                   for p in op.pieces)

    def to_json(self) -> bytes:
        """The job as JSON bytes (what the coordinator stores for the engine process). Pure."""
        return json.dumps({
            "version": JOB_VERSION, "key": self.key, "side": self.side, "gpu": self.gpu,
            "holds": {n: [list(iv) for iv in lines] for n, lines in self.holds.items()},
            "tensors": {n: [t.rows, t.cols, t.split_axis, t.bytes_per_elem, t.layer] for n, t in self.tensors.items()},
            "ops": [[op.index, op.peer, op.send, op.link, [[p.tensor, p.lo, p.hi, p.relay] for p in op.pieces]]
                    for op in self.ops],
        }, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> EndpointJob:
        """Read `to_json`'s bytes back. Pure.

        Raises:
            ConfigError: another format version, or malformed data (the message names what).
        """
        try:
            d = json.loads(data)
            if d.get("version") != JOB_VERSION:
                raise ConfigError(f"endpoint job: format version {d.get('version')!r}, this reader knows "
                                  f"{JOB_VERSION}")
            tensors = {n: TensorSpec(n, int(r), int(c), int(a), int(b), None if layer is None else int(layer))
                       for n, (r, c, a, b, layer) in d["tensors"].items()}
            ops = tuple(JobOp(int(i), str(peer), bool(send), str(link),
                              tuple(WirePiece(str(n), int(lo), int(hi), bool(relay)) for n, lo, hi, relay in pieces))
                        for i, peer, send, link, pieces in d["ops"])
            holds = {str(n): normalize((int(lo), int(hi)) for lo, hi in lines) for n, lines in d["holds"].items()}
            job = cls(str(d["key"]), str(d["side"]), int(d["gpu"]), MappingProxyType(holds),
                      MappingProxyType(tensors), ops)
        except ConfigError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"endpoint job: malformed ({type(exc).__name__}: {exc})") from None
        for op in job.ops:
            for p in op.pieces:
                if p.tensor not in job.tensors or not 0 <= p.lo < p.hi <= job.tensors[p.tensor].num_lines:
                    raise ConfigError(f"endpoint job {job.key}: op {op.index} names lines [{p.lo}, {p.hi}) of "
                                      f"{p.tensor!r}, outside the tensor")
        return job


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where a session's processes meet, and how long any wait may take."""

    session_id: str
    host: str
    port: int
    timeout_s: float = 600.0
    """Deadline of every wait: the store, a group's setup, each op."""

    def __post_init__(self) -> None:
        if not self.session_id or "/" in self.session_id or not 0 < self.port < 65536 or not self.timeout_s > 0:
            raise ConfigError(f"Rendezvous: need a session id without '/', a port and a timeout > 0, got {self}")

    @property
    def prefix(self) -> str:
        return f"oserve/{self.session_id}/"

    def connect(self):
        """A client of the session's store, under its prefix (a `torch.distributed.Store`; imports torch)."""
        from torch.distributed import PrefixStore, TCPStore

        store = TCPStore(self.host, self.port, is_master=False, timeout=datetime.timedelta(seconds=self.timeout_s))
        return PrefixStore(self.prefix, store)


def _endpoints(model: ModelSpec, plan: SwitchPlan, starting: frozenset[str]) -> tuple[dict[int, Endpoint],
                                                                                       dict[int, Endpoint]]:
    """gpu -> source endpoint, gpu -> target endpoint (of the replicas that start)."""
    src: dict[int, Endpoint] = {}
    for r in plan.source.replicas:
        for g in r.gpu_ids:
            stage, rank = gpu_role(r, g)
            src[g] = Endpoint(f"{r.replica_id}/{r.gpu_ids.index(g)}", r.replica_id, r.gpu_ids.index(g), g, "source",
                              gpu_weight_shards(model, r.shape, stage, rank))
    dst: dict[int, Endpoint] = {}
    for r in plan.target.replicas:
        if r.replica_id not in starting:
            continue
        for g in r.gpu_ids:
            stage, rank = gpu_role(r, g)
            dst[g] = Endpoint(f"{r.replica_id}/{r.gpu_ids.index(g)}", r.replica_id, r.gpu_ids.index(g), g, "target",
                              gpu_weight_shards(model, r.shape, stage, rank))
    return src, dst


def wire_plan(model: ModelSpec, plan: SwitchPlan, *, chunk_bytes: int = 64 * MiB,
              starting: frozenset[str] | None = None) -> WirePlan:
    """The ops that give every rank of every starting replica its shard, from the processes that hold it. Pure.

    `starting`: the target replicas that start anew (default: every target replica not kept as it is,
    `SwitchPlan.kept_replicas`); their ranks are the target endpoints. Replica ids of the source and of
    the starting replicas must differ (they run side by side).

    Raises:
        ConfigError: `chunk_bytes` < 1, a replica id in both deployments among the starting ones, or a
            plan that does not give a starting rank its whole shard (a plan made for other deployments).
    """
    if chunk_bytes < 1:
        raise ConfigError(f"wire_plan: chunk_bytes must be >= 1, got {chunk_bytes}")
    kept = {t for t, _ in plan.kept_replicas}
    if starting is None:
        starting = frozenset(r.replica_id for r in plan.target.replicas if r.replica_id not in kept)
    clash = starting & {r.replica_id for r in plan.source.replicas}
    if clash:
        raise ConfigError(f"wire_plan: replica ids {sorted(clash)} are in the source and start anew; a new replica "
                          "needs an id of its own")
    tensors = model_tensors(model)
    src, dst = _endpoints(model, plan, starting)
    pieces: list[tuple[str, str, str, WirePiece]] = []  # (src key, dst key, link, piece) in order
    got: dict[tuple[int, str], IntervalSet] = defaultdict(tuple)  # (target gpu, tensor) -> lines delivered
    for t in plan.transfers:
        if t.dst_gpu not in dst:
            continue  # a kept replica's GPU: nothing starts there
        relay = bool(getattr(t, "relay", False))
        sender = dst.get(t.src_gpu) if relay else src.get(t.src_gpu)
        if sender is None:
            raise ConfigError(f"wire_plan: transfer {t} comes from GPU {t.src_gpu}, which holds nothing of the "
                              "source deployment")
        pieces.append((sender.key, dst[t.dst_gpu].key, t.link, WirePiece(t.tensor, t.lines[0], t.lines[1], relay)))
        got[(t.dst_gpu, t.tensor)] = union(got[(t.dst_gpu, t.tensor)], (t.lines,))
    # Shards the plan keeps in place: from the old process on the same GPU, before everything else.
    reused: list[tuple[str, str, str, WirePiece]] = []
    for g, ep in sorted(dst.items()):
        for name, lines in ep.holds.items():
            missing = difference(lines, got[(g, name)])
            if not missing:
                continue
            old = src.get(g)
            if old is None or difference(missing, old.holds.get(name, ())):
                raise ConfigError(f"wire_plan: the plan gives GPU {g} ({ep.key}) no lines {missing} of {name!r} "
                                  "and no old replica on that GPU holds them; plan the switch for these deployments")
            reused.extend((old.key, ep.key, "local", WirePiece(name, lo, hi)) for lo, hi in missing)
    pieces = reused + pieces
    if not any(p.relay for _, _, _, p in pieces):
        # Without relays no op waits for another's delivery, so the new replicas are served one after the other,
        # in the order they start (an engine host starts them one at a time): the first can verify and serve
        # while the next still starts, instead of every one waiting for the last (measured on this machine: a
        # switch to two TP1 replicas, 53 s of the first's transfer spent waiting for the second's start).
        rank = {key: i for i, key in enumerate(e.key for r in plan.target.replicas for g in r.gpu_ids
                                                for e in [dst.get(g)] if e is not None)}
        pieces.sort(key=lambda item: rank[item[1]])  # stable: the plan's order inside each endpoint
    ops: list[WireOp] = []
    cur: list[WirePiece] = []
    cur_key: tuple[str, str, str] | None = None
    cur_bytes = 0

    def close() -> None:
        nonlocal cur, cur_bytes
        if cur:
            assert cur_key is not None
            ops.append(WireOp(len(ops), cur_key[0], cur_key[1], cur_key[2], tuple(cur), cur_bytes))
        cur, cur_bytes = [], 0

    for s, d, link, p in pieces:
        line_bytes = tensors[p.tensor].line_bytes
        step = max(1, chunk_bytes // line_bytes)
        for lo in range(p.lo, p.hi, step):
            hi = min(p.hi, lo + step)
            n = (hi - lo) * line_bytes
            if cur_key != (s, d, link) or (cur and cur_bytes + n > chunk_bytes):
                close()
                cur_key = (s, d, link)
            cur.append(WirePiece(p.tensor, lo, hi, p.relay))
            cur_bytes += n
    close()
    endpoints = {e.key: e for e in [*src.values(), *dst.values()]}
    return WirePlan(MappingProxyType(endpoints), tuple(ops), tensors)


def received_lines(plan: WirePlan, key: str) -> dict[str, IntervalSet]:
    """tensor -> lines the ops deliver to endpoint `key` (for checks). Pure."""
    out: dict[str, IntervalSet] = defaultdict(tuple)
    for op in plan.ops:
        if op.dst == key:
            for p in op.pieces:
                out[p.tensor] = union(out[p.tensor], ((p.lo, p.hi),))
    return dict(out)


def wire_problems(plan: WirePlan) -> list[str]:
    """What is wrong with a wire plan (empty: nothing): a target rank not given exactly its shard, a line
    delivered twice, a piece sent by an endpoint that does not hold it (yet). Pure."""
    problems = []
    delivered: dict[tuple[str, str], int] = defaultdict(int)  # (endpoint, tensor) -> lines delivered, counted
    have: dict[str, dict[str, IntervalSet]] = {k: dict(e.holds) if e.side == "source" else {}
                                               for k, e in plan.endpoints.items()}
    for op in plan.ops:
        if op.src == op.dst:
            problems.append(f"op {op.index} sends from {op.src} to itself")
        for p in op.pieces:
            if difference(((p.lo, p.hi),), have[op.src].get(p.tensor, ())):
                problems.append(f"op {op.index}: {op.src} sends lines [{p.lo}, {p.hi}) of {p.tensor} it does not "
                                "hold (yet)")
            have[op.dst][p.tensor] = union(have[op.dst].get(p.tensor, ()), ((p.lo, p.hi),))
            delivered[(op.dst, p.tensor)] += p.hi - p.lo
    for key, e in plan.endpoints.items():
        if e.side != "target":
            continue
        got = received_lines(plan, key)
        if got != {n: lines for n, lines in e.holds.items()}:
            problems.append(f"{key} receives {sorted(got)} lines that differ from its shard {sorted(e.holds)}")
        for name, lines in got.items():
            if delivered[(key, name)] != length(lines):
                problems.append(f"{key}: lines of {name} delivered more than once")
    return problems


@dataclass(frozen=True, slots=True)
class WireSummary:
    """Totals of a wire plan, for events and reports."""

    num_ops: int
    num_bytes: int
    bytes_by_link: Mapping[str, int] = field(default_factory=dict)


def summarize(plan: WirePlan) -> WireSummary:
    return WireSummary(len(plan.ops), plan.num_bytes, MappingProxyType(plan.bytes_by_link()))


__all__ = ["Endpoint", "EndpointJob", "JobOp", "Rendezvous", "WireOp", "WirePiece", "WirePlan", "WireSummary", "received_lines",
           "summarize", "wire_plan", "wire_problems"]
