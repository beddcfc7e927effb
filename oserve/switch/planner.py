"""Switch planner: which bytes each target GPU needs, which source GPU sends them, and how long it takes. Pure.

Given the lines every GPU holds now (`have`) and must hold after the switch (`want`, see `layout`), a
target GPU g needs `want[g] - have[g]` of each tensor; what it already holds it keeps: in place when the
shard is unchanged (`reused_bytes`, free), otherwise as an HBM copy inside the GPU (a `local` transfer).
Every needed line is sent by a GPU that holds it in the source deployment, or, in a relay plan, by a
target GPU that received it earlier in the same plan and wants it itself (`Transfer.relay`; see
`oserve.switch.relay`).

Time model (`schedule`). Each GPU has five ports: NVLink out, NVLink in, network out, network in, and
its HBM for local copies. A transfer from s to d over link L occupies s's L-out port and d's L-in port
for `bytes / bandwidth(L)` seconds (NVLink inside a node, the network across nodes, both per GPU and per
direction as `ClusterSpec` gives them; local copies at half the HBM bandwidth, read plus write). Each
port serves its transfers one at a time in the plan's order; a transfer starts as soon as both of its
ports are free; ports of different GPUs and of different link types work in parallel; a relayed transfer
also waits for the end of the earlier transfers that delivered its lines to its source (pieces are cut
at `max_transfer_bytes`, so forwarding pipelines behind arrival). The modeled switch time is the
makespan. Not modeled: latency per message, congestion inside the network fabric beyond the per-GPU
NIC, and the engine restart of a target replica (its weights arrive; starting it with dummy weights
happens beforehand).

Lower bounds. `relay_free_bound_seconds`: for the plan's target placement, the least T such that the
needed bytes can be split among their holders (any fractions) with every port's load <= T * its
bandwidth: a linear program (HiGHS). Bytes with no holder in the target's node must cross the network;
the LP counts that. Any relay-free plan into that placement has a port at least this loaded, so its
makespan under the model above is at least this. It does not bound plans with relays (one GPU's NIC can
feed several GPUs of a node through a relay). `relay_bound_seconds`: the multicast LP of
`oserve.switch.relay`, which does, and is never above the other. A plan's `lower_bound_seconds` is the
one for its kind: the relay bound if it has a relayed transfer, the relay-free bound if not.

Planners:

- `greedy` (the paper's): pieces are the needed intervals cut where the set of holders changes; going
  through the tensors in model order and the target GPUs in id order, each piece comes from the holder
  that has sent the fewest bytes so far, holders in the target's node before holders elsewhere. The
  target placement is used as given.
- `improved` (ours): (1) map the target's replicas onto physical GPUs to reuse what is already there:
  every node-preserving relabelling of GPUs keeps a placement valid, so the target GPUs of each node are
  assigned to the physical GPUs of a node by a linear assignment (scipy) on the estimated time to fill
  them, and target nodes to physical nodes by a second assignment over those costs; (2) split each
  class of needed bytes (same target GPU, same holder set) across its holders as the lower-bound LP
  does, preferring, among the time-optimal splits, the one with the fewest network bytes; (3) order the
  transfers so that the schedule meets the bound: per link type, the (source, target) byte matrix is
  padded to equal line sums and decomposed into perfect matchings (Birkhoff-von Neumann, as in the
  preemptive open-shop schedule of Gonzalez and Sahni), each matching a round in which every port moves
  the same bytes; pieces are cut at line boundaries between rounds; (4) with `SwitchConfig.relay`, on
  each placement a relay plan is a second candidate (`oserve.switch.relay`: the relay LP's split, no more
  network bytes than the relay-free plan, ordered by list scheduling since relays wait for their
  deliveries) and is kept where it is faster, or as fast with fewer network bytes. The plan returned is
  the fastest of the candidates (as-given placement, remapped placement, and the greedy plan), so it
  never loses to the greedy nor, per placement, to itself without relays.

  Measured on `oserve bench switch --gpus 32` (Llama-2-70B and OPT-66B, 8 switches): relays change one
  improved plan, OPT-66B short -> long mix, 0.08175 -> 0.08159 s and 130.7 -> 130.5 GB over the network;
  the relay bound equals the relay-free one within 0.2% on all eight, so no relay plan could do more
  there: remapping already leaves almost no line that several GPUs of a node want and none of it holds.
  On the placements as given (no remapping) relays take that switch from 0.1633 to 0.0818 s and its
  network bytes from 392 to 261 GB, and the executor's 4-GPU scale-out (`executor.relay_switch`) from
  1.56 to 0.94 ms (modeled; it runs bit-exact over real processes).
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import numpy as np
from scipy.optimize import linear_sum_assignment, linprog
from scipy.sparse import coo_array

from oserve.defaults import ENGINE_START_S
from oserve.errors import ConfigError, InfeasibleError
from oserve.specs import ClusterSpec, Deployment, ModelSpec, Replica
from oserve.switch.intervals import IntervalSet, difference, intersection, length, normalize
from oserve.switch.layout import Holdings, TensorSpec, deployment_weight_layout, holdings_bytes, model_tensors
from oserve.switch.relay import RelayClass, RelaySplit, relay_bound_seconds, relay_classes, relay_split

PLANNERS = ("greedy", "improved")
LINKS = ("nvlink", "network", "local")
MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class SwitchConfig:
    """Knobs of the switch planner and of the reload baseline it is compared with."""

    disk_bytes_per_s: float = 3e9
    """Reload baseline: bytes per second one node reads checkpoint shards from disk into its GPUs."""
    engine_start_s: float = ENGINE_START_S
    """Seconds to start an engine once its weights are in place (process, communicators, memory profiling,
    graphs); a reload pays it after reading from disk, a GPU-to-GPU switch after the copy."""
    local_copy_bytes_per_s: float | None = None
    """HBM-to-HBM copy rate inside one GPU; None: half the GPU's HBM bandwidth (read plus write)."""
    max_transfer_bytes: int = 256 * MiB
    """Largest single transfer; longer pieces are cut at line boundaries (a message-size limit)."""
    lp_time_limit_s: float = 60.0
    """Per linear program (the lower bound and the improved planner's split); past it the bound falls back
    to a closed form and the improved planner to the greedy's split."""
    remap: bool = True
    """Whether the improved planner may relabel the target's GPUs to reuse what is already there."""
    relay: bool = True
    """Whether the improved planner may also plan relays (lines forwarded by a target GPU that received them
    and wants them too; see `oserve.switch.relay`) and return that plan where it is faster. The greedy
    never relays."""

    def __post_init__(self) -> None:
        if not (self.disk_bytes_per_s > 0 and self.engine_start_s >= 0):
            raise ConfigError(f"SwitchConfig: disk_bytes_per_s must be > 0 and engine_start_s >= 0, got "
                              f"{self.disk_bytes_per_s}, {self.engine_start_s}")
        if self.local_copy_bytes_per_s is not None and not self.local_copy_bytes_per_s > 0:
            raise ConfigError(f"SwitchConfig: local_copy_bytes_per_s must be > 0, got {self.local_copy_bytes_per_s}")
        if self.max_transfer_bytes < 1 or not self.lp_time_limit_s > 0:
            raise ConfigError(f"SwitchConfig: max_transfer_bytes must be >= 1 and lp_time_limit_s > 0, got "
                              f"{self.max_transfer_bytes}, {self.lp_time_limit_s}")


@dataclass(frozen=True, slots=True)
class Transfer:
    """One contiguous piece moving from a source GPU to a target GPU (or copied inside one GPU)."""

    src_gpu: int
    dst_gpu: int
    tensor: str
    lines: tuple[int, int]
    """[lo, hi) along the tensor's split axis (see `layout`)."""
    num_bytes: int
    link: str
    """'nvlink' (same node), 'network' (across nodes) or 'local' (src == dst, an HBM copy)."""
    start_s: float = 0.0
    """Modeled start, seconds after the switch begins."""
    end_s: float = 0.0
    relay: bool = False
    """True: src_gpu holds these lines only because earlier transfers of the same plan delivered them to it
    (it forwards from its staging copy of its target shard); it starts no earlier than they end."""


@dataclass(frozen=True, slots=True)
class SwitchPlan:
    """How to go from the source deployment to the target: transfers, volumes, modeled times."""

    planner: str
    source: Deployment
    target: Deployment
    """The target as this plan places it on physical GPUs (the improved planner may relabel GPUs)."""
    transfers: tuple[Transfer, ...]
    """In execution order: each port serves its transfers in this order."""
    nvlink_bytes: int
    network_bytes: int
    local_bytes: int
    """Bytes copied inside a GPU (held already, but in a different shard layout)."""
    reused_bytes: int
    """Bytes held already in exactly the shard the target needs: kept in place, not moved."""
    switch_seconds: float
    """Modeled makespan of the transfers (see the module docstring for what is modeled)."""
    lower_bound_seconds: float
    """No plan of this plan's kind into its target placement is faster: `relay_free_bound_seconds` when the
    plan has no relayed transfer, `relay_bound_seconds` when it has."""
    reload_seconds: float
    """The paper's baseline: restart changed replicas and load their weights from disk."""
    kept_replicas: tuple[tuple[str, str], ...] = ()
    """(target replica id, source replica id) of replicas that stay exactly as they are."""
    gpu_map: tuple[tuple[int, int], ...] = ()
    """(GPU id in the requested target, physical GPU id in this plan) where they differ."""
    relay_free_bound_seconds: float | None = None
    """No relay-free plan into this placement is faster (the LP bound). A relay plan may beat it; one that
    does is faster than any relay-free plan could be. None where not computed (the empty plan)."""
    relay_bound_seconds: float | None = None
    """No plan into this placement is faster, relays through target GPUs that want the lines allowed (the
    multicast LP of `oserve.switch.relay`); <= `relay_free_bound_seconds`. None where relays were not
    considered (the greedy, or `SwitchConfig.relay` off)."""

    @classmethod
    def empty(cls, deployment: Deployment | None = None) -> SwitchPlan:
        """No change: nothing moves, nothing takes time."""
        d = deployment if deployment is not None else Deployment.empty()
        return cls("none", d, d, (), 0, 0, 0, 0, 0.0, 0.0, 0.0)

    @property
    def is_empty(self) -> bool:
        return not self.transfers and self.planner == "none"

    @property
    def moved_bytes(self) -> int:
        """Bytes over NVLink and the network."""
        return self.nvlink_bytes + self.network_bytes

    @property
    def relayed_bytes(self) -> int:
        """Bytes of relayed transfers (forwarded by a target GPU; counted in `moved_bytes` too)."""
        return sum(t.num_bytes for t in self.transfers if t.relay)


# --- needs -------------------------------------------------------------------------------------

@dataclass(slots=True)
class _Needs:
    local: list[tuple[int, str, int, int]] = field(default_factory=list)  # (gpu, tensor, lo, hi)
    reused_bytes: int = 0
    atoms: list[tuple[str, int, int, int, frozenset[int]]] = field(default_factory=list)  # (tensor, dst, lo, hi, holders)


def _segments(holders: tuple[tuple[int, IntervalSet], ...]) -> list[tuple[int, int, frozenset[int]]]:
    """Elementary segments of a tensor's line axis with the GPUs holding each; adjacent equal ones merged."""
    bounds = sorted({b for _, s in holders for iv in s for b in iv})
    out: list[tuple[int, int, frozenset[int]]] = []
    for a, b in zip(bounds, bounds[1:]):
        who = []
        for gpu, s in holders:
            k = bisect.bisect_right(s, (a, float("inf"))) - 1
            if k >= 0 and s[k][0] <= a < s[k][1]:
                who.append(gpu)
        h = frozenset(who)
        if out and out[-1][1] == a and out[-1][2] == h:
            out[-1] = (out[-1][0], b, h)
        else:
            out.append((a, b, h))
    return out


def _needs(tensors: Mapping[str, TensorSpec], have: Mapping[int, Holdings], want: Mapping[int, Holdings]) -> _Needs:
    """What each target GPU keeps in place, copies locally, and needs from holders (atoms). Pure."""
    out = _Needs()
    by_tensor: dict[str, list[tuple[int, IntervalSet]]] = defaultdict(list)  # tensor -> [(gpu, lines)]
    for gpu in sorted(have):
        for name, lines in have[gpu].items():
            if lines:
                by_tensor[name].append((gpu, lines))
    seg_cache: dict[tuple, list] = {}
    pending: dict[str, list[tuple[int, IntervalSet]]] = defaultdict(list)  # tensor -> [(dst, needed lines)]
    for gpu in sorted(want):
        mine = have.get(gpu, {})
        for name, lines in want[gpu].items():
            held = mine.get(name, ())
            if lines == held:
                out.reused_bytes += length(lines) * tensors[name].line_bytes
                continue
            for lo, hi in intersection(lines, held):
                out.local.append((gpu, name, lo, hi))
            need = difference(lines, held)
            if need:
                pending[name].append((gpu, need))
    for name in (n for n in tensors if n in pending):
        key = tuple(by_tensor.get(name, ()))
        segs = seg_cache.get(key)
        if segs is None:
            segs = seg_cache[key] = _segments(key)
        starts = [s[0] for s in segs]
        for dst, need in pending[name]:
            for lo, hi in need:
                k = max(bisect.bisect_right(starts, lo) - 1, 0)
                cur = lo
                while cur < hi:
                    if k >= len(segs) or segs[k][0] > cur:
                        raise InfeasibleError(f"no source GPU holds lines [{cur}, ...) of {name} that GPU {dst} "
                                              "needs; the switch cannot be done GPU-to-GPU (reload from disk)")
                    a, b, h = segs[k]
                    if b <= cur:
                        k += 1
                        continue
                    if not h:
                        raise InfeasibleError(f"no source GPU holds lines [{cur}, {b}) of {name} that GPU {dst} "
                                              "needs; the switch cannot be done GPU-to-GPU (reload from disk)")
                    end = min(b, hi)
                    out.atoms.append((name, dst, cur, end, h))
                    cur = end
                    k += 1
    return out


# --- scheduling --------------------------------------------------------------------------------

def _bandwidths(cluster: ClusterSpec, config: SwitchConfig) -> dict[str, float]:
    local = config.local_copy_bytes_per_s or cluster.gpu.hbm_bytes_per_s / 2
    return {"nvlink": cluster.nvlink_bytes_per_s, "network": cluster.network_bytes_per_s, "local": local}


def link_between(cluster: ClusterSpec, src: int, dst: int) -> str:
    if src == dst:
        return "local"
    return "nvlink" if cluster.node_of(src) == cluster.node_of(dst) else "network"


def _ports(t: Transfer) -> tuple[tuple[int, str, str], ...]:
    if t.link == "local":
        return ((t.src_gpu, "local", "rw"),)
    return ((t.src_gpu, t.link, "out"), (t.dst_gpu, t.link, "in"))


def _delivered_by(t: Transfer, deliveries: Mapping[tuple[int, str], Sequence[tuple[int, int, int]]]) -> list[int]:
    """Indices of the transfers in `deliveries` ((gpu, tensor) -> [(lo, hi, index)]) that brought lines of
    relayed transfer `t` to its source. Pure.

    Raises:
        ConfigError: `t` is not a valid relay, or some of its lines were delivered by none of them.
    """
    if t.link == "local" or t.src_gpu == t.dst_gpu:
        raise ConfigError(f"a relayed transfer moves between two GPUs: {t}")
    lo, hi = t.lines
    got = [(a, b, i) for a, b, i in deliveries.get((t.src_gpu, t.tensor), ()) if a < hi and b > lo]
    if difference(((lo, hi),), normalize((a, b) for a, b, _ in got)):
        raise ConfigError(f"relayed transfer of {t.tensor} lines {t.lines} from GPU {t.src_gpu} to {t.dst_gpu}: "
                          "no earlier transfer of the plan delivered all of those lines to its source")
    return [i for _, _, i in got]


def schedule(transfers: Sequence[Transfer], cluster: ClusterSpec,
             config: SwitchConfig = SwitchConfig()) -> tuple[tuple[Transfer, ...], float]:
    """Modeled start and end of every transfer, and the makespan (see the module docstring). Pure.

    A relayed transfer also starts no earlier than the end of the earlier transfers that delivered its
    lines to its source.

    Raises:
        ConfigError: a relayed transfer comes before (or without) the delivery of its lines.
    """
    bw = _bandwidths(cluster, config)
    free: dict[tuple, float] = defaultdict(float)  # (gpu, link, direction) -> time the port is free
    deliveries: dict[tuple[int, str], list[tuple[int, int, int]]] = defaultdict(list)  # (gpu, tensor) -> [(lo, hi, i)]
    out: list[Transfer] = []
    makespan = 0.0
    for t in transfers:
        ports = _ports(t)
        start = max(free[p] for p in ports)
        if t.relay:
            start = max([start] + [out[i].end_s for i in _delivered_by(t, deliveries)])
        end = start + t.num_bytes / bw[t.link]
        for p in ports:
            free[p] = end
        makespan = max(makespan, end)
        if t.link != "local":
            deliveries[(t.dst_gpu, t.tensor)].append((t.lines[0], t.lines[1], len(out)))
        out.append(Transfer(t.src_gpu, t.dst_gpu, t.tensor, t.lines, t.num_bytes, t.link, start, end, t.relay))
    return tuple(out), makespan


def _chunk(pieces: Sequence[tuple], tensors: Mapping[str, TensorSpec], cluster: ClusterSpec,
           max_bytes: int) -> list[Transfer]:
    """Transfers from (src, dst, tensor, lo, hi[, relay]) pieces, cut to at most `max_bytes` (at least one line)."""
    out = []
    for src, dst, name, lo, hi, *rest in pieces:
        relay = bool(rest and rest[0])
        lb = tensors[name].line_bytes
        step = max(1, max_bytes // lb)
        link = link_between(cluster, src, dst)
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            out.append(Transfer(src, dst, name, (a, b), (b - a) * lb, link, relay=relay))
    return out


# --- the lower-bound LP ------------------------------------------------------------------------

def _classes(atoms, tensors) -> dict[tuple[int, frozenset[int]], list[tuple[str, int, int]]]:
    """(dst, holders) -> the atoms of that class, in order."""
    out: dict[tuple[int, frozenset[int]], list[tuple[str, int, int]]] = defaultdict(list)
    for name, dst, lo, hi, h in atoms:
        out[(dst, h)].append((name, lo, hi))
    return out


def _lp(classes: Mapping[tuple[int, frozenset[int]], list[tuple[str, int, int]]], tensors: Mapping[str, TensorSpec],
        cluster: ClusterSpec, bw: Mapping[str, float], local_floor_s: float, time_limit_s: float,
        ) -> tuple[float, dict[tuple[int, frozenset[int]], dict[int, float]] | None]:
    """The least makespan bound T and, at T, a split of each class over its holders with fewest network bytes.

    Returns (T seconds, class -> holder -> bytes); the split is None when the LP hit its time limit, and
    T is then the weaker closed-form bound of `_simple_bound`.
    """
    if not classes:
        return local_floor_s, {}
    keys = list(classes)
    class_bytes = [sum((hi - lo) * tensors[n].line_bytes for n, lo, hi in classes[k]) for k in keys]
    scale = 1e9  # LP variables in GB, times in s, bandwidths in GB/s: coefficients near 1
    var: list[tuple[int, int]] = []  # (class index, holder)
    ports: dict[tuple, int] = {}  # (gpu, link, direction) -> row
    rows, cols, vals = [], [], []
    eq_rows, eq_cols = [], []
    is_net = []
    for ci, (dst, holders) in enumerate(keys):
        for h in sorted(holders):
            j = len(var)
            var.append((ci, h))
            link = link_between(cluster, h, dst)
            is_net.append(link == "network")
            for port in ((h, link, "out"), (dst, link, "in")):
                r = ports.setdefault(port, len(ports))
                rows.append(r)
                cols.append(j)
                vals.append(1.0)
            eq_rows.append(ci)
            eq_cols.append(j)
    nv, npt = len(var), len(ports)
    port_bw = np.array([bw[p[1]] / scale for p in ports])
    a_ub = coo_array((vals + list(-port_bw), (rows + list(range(npt)), cols + [nv] * npt)), shape=(npt, nv + 1)).tocsr()
    a_eq = coo_array((np.ones(len(eq_rows)), (eq_rows, eq_cols)), shape=(len(keys), nv + 1)).tocsr()
    b_eq = np.array(class_bytes, dtype=float) / scale
    c = np.zeros(nv + 1)
    c[nv] = 1.0
    opts = {"time_limit": time_limit_s}
    res = linprog(c, A_ub=a_ub, b_ub=np.zeros(npt), A_eq=a_eq, b_eq=b_eq,
                  bounds=[(0, None)] * nv + [(local_floor_s, None)], method="highs", options=opts)
    if res.status != 0:  # time limit: a closed-form bound, and no split (the caller falls back to greedy)
        return _simple_bound(classes, class_bytes, keys, cluster, bw, local_floor_s), None
    t_star = float(res.x[nv])
    # Phase two: at (almost) that makespan, the split with the fewest network bytes.
    c2 = np.zeros(nv + 1)
    c2[:nv] = np.where(is_net, 1.0, 1e-6)
    res2 = linprog(c2, A_ub=a_ub, b_ub=np.zeros(npt), A_eq=a_eq, b_eq=b_eq,
                   bounds=[(0, None)] * nv + [(t_star, t_star * (1 + 1e-7) + 1e-12)], method="highs", options=opts)
    x = res2.x if res2.status == 0 else res.x
    split: dict[tuple[int, frozenset[int]], dict[int, float]] = defaultdict(dict)
    for j, (ci, h) in enumerate(var):
        if x[j] > 0:
            split[keys[ci]][h] = float(x[j]) * scale
    return t_star, split


def _simple_bound(classes, class_bytes, keys, cluster: ClusterSpec, bw: Mapping[str, float],
                  local_floor_s: float) -> float:
    """A closed-form lower bound: per target GPU, bytes with no holder in its node over the network
    bandwidth, and all its bytes over both links together."""
    total: dict[int, int] = defaultdict(int)
    far: dict[int, int] = defaultdict(int)
    for (dst, holders), b in zip(keys, class_bytes):
        total[dst] += b
        if all(cluster.node_of(h) != cluster.node_of(dst) for h in holders):
            far[dst] += b
    return max([local_floor_s] + [far[g] / bw["network"] for g in far]
               + [total[g] / (bw["nvlink"] + bw["network"]) for g in total])


def _local_floor(local: Sequence[tuple[int, str, int, int]], tensors, bw) -> float:
    per_gpu: dict[int, int] = defaultdict(int)
    for gpu, name, lo, hi in local:
        per_gpu[gpu] += (hi - lo) * tensors[name].line_bytes
    return max(per_gpu.values(), default=0) / bw["local"]


# --- planners on a fixed placement -------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TransferPlan:
    """A planner's answer on a fixed placement: ordered, scheduled transfers and their totals."""

    transfers: tuple[Transfer, ...]
    nvlink_bytes: int
    network_bytes: int
    local_bytes: int
    reused_bytes: int
    switch_seconds: float
    lower_bound_seconds: float
    """For the plan's kind: `relay_free_bound_seconds` without relayed transfers, `relay_bound_seconds` with."""
    relay_free_bound_seconds: float | None = None
    """The relay-free LP bound (see the module docstring)."""
    relay_bound_seconds: float | None = None
    """The relay bound (`oserve.switch.relay`); None where relays were not considered."""

    @property
    def has_relays(self) -> bool:
        return any(t.relay for t in self.transfers)


def _greedy_pieces(needs: _Needs, cluster: ClusterSpec, tensors) -> list[tuple[int, int, str, int, int]]:
    sent: dict[int, int] = defaultdict(int)
    pieces = []
    order = {n: i for i, n in enumerate(tensors)}
    for name, dst, lo, hi, holders in sorted(needs.atoms, key=lambda a: (order[a[0]], a[1], a[2])):
        node = cluster.node_of(dst)
        near = [h for h in holders if cluster.node_of(h) == node]
        src = min(near or holders, key=lambda h: (sent[h], h))
        sent[src] += (hi - lo) * tensors[name].line_bytes
        pieces.append((src, dst, name, lo, hi))
    return pieces


def _cut_sequence(items: Sequence[tuple[str, int, int]], tensors, amounts: Sequence[float],
                  ) -> list[list[tuple[str, int, int]]]:
    """Cut a sequence of (tensor, lo, hi) runs into consecutive parts of about `amounts` bytes each.

    Cuts fall on line boundaries (the nearest one to each cumulative target), so the parts' sizes add up
    to the whole exactly and no rounding error accumulates. The last part takes whatever is left.
    """
    parts: list[list[tuple[str, int, int]]] = [[] for _ in amounts]
    targets = np.cumsum(amounts)
    k = 0
    pos = 0.0
    for name, lo, hi in items:
        lb = tensors[name].line_bytes
        cur = lo
        while cur < hi:
            while k < len(parts) - 1 and targets[k] <= pos + 0.5 * lb:
                k += 1
            if k == len(parts) - 1:
                end = hi
            else:
                end = min(hi, cur + max(1, int(round((targets[k] - pos) / lb))))
            parts[k].append((name, cur, end))
            pos += (end - cur) * lb
            cur = end
    return parts


def _bvn_rounds(matrix: np.ndarray) -> list[tuple[int, list[tuple[int, int]]]]:
    """Decompose a non-negative integer matrix into rounds of disjoint (row, col) pairs. Pure.

    Pads to a 2n x 2n matrix whose every line sums to the largest line sum L of `matrix`, then peels off
    perfect matchings on its support (they exist by Birkhoff's theorem); the rounds' amounts add up to
    L, and each round lists the pairs of the original matrix it moves `amount` bytes on.
    """
    n = matrix.shape[0]
    m = np.asarray(matrix, dtype=np.int64)
    r, c = m.sum(axis=1), m.sum(axis=0)
    big_l = int(max(r.max(initial=0), c.max(initial=0)))
    if big_l == 0:
        return []
    pad = np.zeros((2 * n, 2 * n), dtype=np.int64)
    pad[:n, :n] = m
    pad[:n, n:] = np.diag(big_l - r)
    pad[n:, :n] = np.diag(big_l - c)
    pad[n:, n:] = m.T
    rounds = []
    remaining = big_l
    while remaining > 0:
        support = pad > 0
        # Among perfect matchings on the support prefer heavy entries (fewer rounds); off-support is forbidden.
        cost = np.where(support, -pad / remaining, 1e6)
        ri, ci = linear_sum_assignment(cost)
        if not support[ri, ci].all():
            raise AssertionError("no perfect matching on the support of a doubly balanced matrix")
        amount = int(pad[ri, ci].min())
        pad[ri, ci] -= amount
        remaining -= amount
        rounds.append((amount, [(int(i), int(j)) for i, j in zip(ri, ci) if i < n and j < n]))
    return rounds


def _improved_pieces(needs: _Needs, cluster: ClusterSpec, tensors, split) -> list[tuple[int, int, str, int, int]]:
    """Pieces from the LP split, ordered in Birkhoff-von Neumann rounds per link type."""
    per_pair: dict[tuple[int, int], list[tuple[str, int, int]]] = defaultdict(list)  # (src, dst) -> runs
    for (dst, holders), items in _classes(needs.atoms, tensors).items():
        alloc = split.get((dst, holders), {})
        hs = sorted(alloc)
        if not hs:
            raise AssertionError("LP left a class without holders")
        for h, part in zip(hs, _cut_sequence(items, tensors, [alloc[h] for h in hs])):
            per_pair[(h, dst)].extend(part)
    pair_bytes = {p: sum((hi - lo) * tensors[n].line_bytes for n, lo, hi in runs) for p, runs in per_pair.items()}
    pieces: list[tuple[int, int, str, int, int]] = []
    groups: dict[tuple, list[tuple[int, int]]] = defaultdict(list)  # (link, node or -1) -> pairs
    for (s, d) in per_pair:
        if pair_bytes[(s, d)] == 0:
            continue
        link = link_between(cluster, s, d)
        groups[(link, cluster.node_of(s) if link == "nvlink" else -1)].append((s, d))
    for key in sorted(groups):
        pairs = groups[key]
        gpus = sorted({g for p in pairs for g in p})
        idx = {g: i for i, g in enumerate(gpus)}
        mat = np.zeros((len(gpus), len(gpus)), dtype=np.int64)
        for s, d in pairs:
            mat[idx[s], idx[d]] = pair_bytes[(s, d)]
        rounds = _bvn_rounds(mat)
        # Which rounds each pair takes part in, with the bytes it moves in each.
        shares: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)  # pair -> [(round, amount)]
        for k, (amount, matched) in enumerate(rounds):
            for i, j in matched:
                shares[(gpus[i], gpus[j])].append((k, amount))
        by_round: list[list[tuple[int, int, str, int, int]]] = [[] for _ in rounds]
        for pair, sh in shares.items():
            parts = _cut_sequence(per_pair[pair], tensors, [a for _, a in sh])
            for (k, _), part in zip(sh, parts):
                by_round[k].extend((pair[0], pair[1], n, lo, hi) for n, lo, hi in part)
        for rnd in by_round:
            pieces.extend(rnd)
    return pieces


def _relay_pieces(classes: Mapping[RelayClass, Sequence[tuple[str, int, int]]],
                  split: Mapping[RelayClass, RelaySplit], tensors) -> list[tuple[int, int, str, int, int, bool]]:
    """Pieces (src, dst, tensor, lo, hi, relayed) of the relay LP's answer. Pure.

    Per class, the lines are cut into consecutive first parts, one per receiver; receiver d takes from
    first receiver r the head of r's part (the LP's bytes r -> d) and gets everything else it lacks
    straight from the holders, its own first part at the front, split over the holders as the LP says.
    """
    pieces: list[tuple[int, int, str, int, int, bool]] = []
    for key, runs in classes.items():
        receivers, holders = key
        sp = split[key]
        rs = sorted(receivers)
        direct: dict[int, list[tuple[str, int, int]]]
        if len(rs) == 1:
            direct = {rs[0]: list(runs)}
        else:
            first = dict(zip(rs, _cut_sequence(runs, tensors, [sp.first.get(r, 0.0) for r in rs])))
            direct = {d: list(first[d]) for d in rs}
            for r in rs:
                part_bytes = sum((hi - lo) * tensors[n].line_bytes for n, lo, hi in first[r])
                for d in rs:
                    if d == r or not first[r]:
                        continue
                    w = min(sp.relay.get((r, d), 0.0), part_bytes)
                    via, rest = _cut_sequence(first[r], tensors, [w, part_bytes - w])
                    pieces.extend((r, d, n, lo, hi, True) for n, lo, hi in via)
                    direct[d].extend(rest)
        hs = sorted(holders)
        for d in rs:
            amounts = [sp.direct.get((h, d), 0.0) for h in hs]
            if not sum(amounts) > 0:
                amounts = [1.0] + [0.0] * (len(hs) - 1)  # the LP sends d nothing straight: rounding leftovers
            for h, part in zip(hs, _cut_sequence(direct[d], tensors, amounts)):
                pieces.extend((h, d, n, lo, hi, False) for n, lo, hi in part)
    return pieces


def _list_order(transfers: Sequence[Transfer], cluster: ClusterSpec, config: SwitchConfig) -> list[Transfer]:
    """An execution order for transfers with relays: list scheduling, earliest possible start first. Pure.

    Each step places the transfer that can start soonest given what its ports already carry and, for a
    relay, when its deliveries end; among equal starts, deliveries that relays wait for go first, then
    transfers whose busiest port has the most work left (without that rule OPT-66B's short -> long switch
    on 32 GPUs, placement as given, took 0.0885 s; with it 0.08175 s, against a relay bound of 0.08159 s).
    A relay is placed only after every transfer it depends on, so the order puts deliveries before the
    relays that forward them, and `schedule` replays it with no transfer later than placed here (it serves
    each port in this order, and these starts never decrease).
    """
    bw = _bandwidths(cluster, config)
    deliveries: dict[tuple[int, str], list[tuple[int, int, int]]] = defaultdict(list)
    for i, t in enumerate(transfers):
        if t.link != "local":
            deliveries[(t.dst_gpu, t.tensor)].append((t.lines[0], t.lines[1], i))
    waiters: dict[int, list[int]] = defaultdict(list)  # i -> relays waiting for transfer i
    missing: dict[int, int] = {}  # relay -> deliveries not placed yet
    for i, t in enumerate(transfers):
        if t.relay:
            deps = [j for j in _delivered_by(t, deliveries) if j != i]
            missing[i] = len(deps)
            for j in deps:
                waiters[j].append(i)
    # Transfers on the same ports share their earliest start but for relays' deliveries, so the heap holds
    # port groups, each with its ready transfers in a heap of (ready time, priority, index).
    groups: dict[tuple, int] = {}
    group_ports: list[tuple] = []
    group_of = []
    for t in transfers:
        ports = _ports(t)
        if ports not in groups:
            groups[ports] = len(group_ports)
            group_ports.append(ports)
        group_of.append(groups[ports])
    ready: list[list[tuple[float, int, int]]] = [[] for _ in group_ports]
    ready_s: dict[int, float] = defaultdict(float)  # relay -> latest end of its placed deliveries
    for i in range(len(transfers)):
        if not missing.get(i):
            ready[group_of[i]].append((0.0, 0 if i in waiters else 1, i))
    for items in ready:
        heapq.heapify(items)
    free: dict[tuple, float] = defaultdict(float)  # port -> time it is free
    left_s: dict[tuple, float] = defaultdict(float)  # port -> seconds of its transfers not placed yet
    for t, g in zip(transfers, group_of):
        for p in group_ports[g]:
            left_s[p] += t.num_bytes / bw[t.link]
    # Lazy heap: a group's entry is stale once its version moved on; an entry whose ports got busier since
    # is pushed again with its later start.
    version = [0] * len(group_ports)
    heap: list[tuple[float, tuple[int, float], int, int]] = []  # (earliest start, priority, group, version)

    def push(g: int) -> None:
        version[g] += 1
        if ready[g]:
            head_s, prio, _ = ready[g][0]
            heapq.heappush(heap, (max([head_s] + [free[p] for p in group_ports[g]]),
                                  (prio, -max(left_s[p] for p in group_ports[g])), g, version[g]))

    for g in range(len(group_ports)):
        push(g)
    order: list[int] = []
    while heap:
        key_s, _, g, ver = heapq.heappop(heap)
        if ver != version[g]:
            continue
        head_s, _, i = ready[g][0]
        start = max([head_s] + [free[p] for p in group_ports[g]])
        if start > key_s:  # its ports got busier since it was queued
            push(g)
            continue
        heapq.heappop(ready[g])
        t = transfers[i]
        end = start + t.num_bytes / bw[t.link]
        for p in group_ports[g]:
            free[p] = end
            left_s[p] -= end - start
        order.append(i)
        touched = {g}
        for k in waiters.get(i, ()):
            ready_s[k] = max(ready_s[k], end)
            missing[k] -= 1
            if missing[k] == 0:
                heapq.heappush(ready[group_of[k]], (ready_s[k], 0 if k in waiters else 1, k))
                touched.add(group_of[k])
        for h in touched:
            push(h)
    if len(order) != len(transfers):
        raise AssertionError("relays wait for each other in a cycle")
    return [transfers[i] for i in order]


def _totals(transfers: tuple[Transfer, ...], makespan: float, reused_bytes: int, lower_bound: float,
            relay_free_bound: float, relay_bound: float | None) -> TransferPlan:
    volume: dict[str, int] = defaultdict(int)
    for t in transfers:
        volume[t.link] += t.num_bytes
    if lower_bound > makespan * (1 + 1e-6) + 1e-12:
        raise AssertionError(f"lower bound {lower_bound!r} s exceeds the schedule's makespan {makespan!r} s: "
                             "the bound LP or the schedule is wrong")
    return TransferPlan(transfers, volume["nvlink"], volume["network"], volume["local"], reused_bytes, makespan,
                        lower_bound, relay_free_bound, relay_bound)


def _with_relays(plan: TransferPlan, needs: _Needs, tensors, cluster: ClusterSpec, config: SwitchConfig,
                 local_floor_s: float, exact_bound: bool) -> TransferPlan:
    """The relay-free `plan`, or the relay plan where that is faster (or as fast with fewer network bytes).

    Either way the result carries the relay bound. The relay LP may not put more bytes on the network
    than `plan` does (relays are there to save crossings), and a relay plan that ends up with more
    network bytes after cutting at line boundaries is not taken: network bytes never grow with relays.
    `exact_bound`: `plan`'s relay-free bound is the LP's optimum, not its closed-form fallback.
    """
    classes = relay_classes(needs.atoms, tensors)
    relay_bound = relay_bound_seconds(classes, tensors, cluster, local_floor_s, config.lp_time_limit_s)
    free_bound = plan.relay_free_bound_seconds
    if relay_bound > free_bound * (1 + 1e-6) + 1e-12:
        if exact_bound:
            raise AssertionError(f"relay bound {relay_bound!r} s exceeds the relay-free bound {free_bound!r} s: "
                                 "relays only widen the choice")
        # A relay-free plan is a relay plan that relays nothing: the relay bound holds for it too, and here
        # it is the tighter one (the relay-free LP fell back to its closed form).
        free_bound = relay_bound
    keep = replace(plan, lower_bound_seconds=free_bound, relay_free_bound_seconds=free_bound,
                   relay_bound_seconds=relay_bound)
    if keep.lower_bound_seconds > keep.switch_seconds * (1 + 1e-6) + 1e-12:
        raise AssertionError(f"relay bound {relay_bound!r} s exceeds the relay-free plan's makespan "
                             f"{keep.switch_seconds!r} s: the relay LP or the schedule is wrong")
    if all(len(receivers) < 2 for receivers, _ in classes):
        return keep  # no line is wanted by two GPUs: nothing to relay
    solved = relay_split(classes, tensors, cluster, local_floor_s, config.lp_time_limit_s,
                         network_budget_bytes=plan.network_bytes)
    if solved is None:
        return keep
    t_lp, split = solved
    lp_network = sum(v for sp in split.values() for pairs in (sp.direct, sp.relay) for (a, b), v in pairs.items()
                     if link_between(cluster, a, b) == "network")
    if t_lp >= plan.switch_seconds * (1 - 1e-6) and lp_network >= plan.network_bytes * (1 - 1e-6):
        return keep  # its ports would carry as much as the relay-free plan's, over as much network: no gain
    pieces = _relay_pieces(classes, split, tensors)
    if not any(p[5] for p in pieces):
        return keep
    local = [(g, g, name, lo, hi) for g, name, lo, hi in needs.local]
    chunks = _chunk(local + pieces, tensors, cluster, config.max_transfer_bytes)
    transfers, makespan = schedule(_list_order(chunks, cluster, config), cluster, config)
    cand = _totals(transfers, makespan, needs.reused_bytes, relay_bound, free_bound, relay_bound)
    if cand.network_bytes > plan.network_bytes:
        return keep
    faster = cand.switch_seconds < plan.switch_seconds * (1 - 1e-9)
    as_fast = cand.switch_seconds <= plan.switch_seconds * (1 + 1e-9)
    return cand if faster or (as_fast and cand.network_bytes < plan.network_bytes) else keep


def plan_transfers(tensors: Mapping[str, TensorSpec], have: Mapping[int, Holdings], want: Mapping[int, Holdings],
                   cluster: ClusterSpec, planner: str = "improved", config: SwitchConfig = SwitchConfig(),
                   *, relay: bool = False) -> TransferPlan:
    """Transfers that give every GPU in `want` exactly its lines, from GPUs that hold them in `have`. Pure.

    The placement is fixed here (no relabelling); `plan_switch` adds that for weights. With `relay` (and
    the improved planner) the relay plan of `oserve.switch.relay` is a second candidate and the faster one
    is returned; `plan_switch` passes `SwitchConfig.relay`, the KV migration leaves it off.

    Raises:
        InfeasibleError: some needed line is held by no GPU.
    """
    if planner not in PLANNERS:
        raise ConfigError(f"unknown switch planner {planner!r}; known: {', '.join(PLANNERS)}")
    bw = _bandwidths(cluster, config)
    needs = _needs(tensors, have, want)
    local_floor = _local_floor(needs.local, tensors, bw)
    classes = _classes(needs.atoms, tensors)
    bound, split = _lp(classes, tensors, cluster, bw, local_floor, config.lp_time_limit_s)
    if planner == "greedy" or split is None:
        pieces = _greedy_pieces(needs, cluster, tensors)
    else:
        pieces = _improved_pieces(needs, cluster, tensors, split)
    local = [(g, g, name, lo, hi) for g, name, lo, hi in needs.local]
    ordered = _chunk(local + pieces, tensors, cluster, config.max_transfer_bytes)
    transfers, makespan = schedule(ordered, cluster, config)
    plan = _totals(transfers, makespan, needs.reused_bytes, bound, bound, None)
    if planner == "improved" and relay:
        return _with_relays(plan, needs, tensors, cluster, config, local_floor, exact_bound=split is not None)
    return plan


# --- target placement --------------------------------------------------------------------------

def relabel(deployment: Deployment, gpu_map: Mapping[int, int]) -> Deployment:
    """The deployment with every GPU id g replaced by gpu_map.get(g, g). Pure."""
    return Deployment(tuple(Replica(r.replica_id, r.shape, tuple(gpu_map.get(g, g) for g in r.gpu_ids))
                            for r in deployment.replicas))


def _remap(model: ModelSpec, cluster: ClusterSpec, have: Mapping[int, Holdings], target: Deployment,
           bw: Mapping[str, float]) -> dict[int, int]:
    """A node-preserving relabelling of the target's GPUs that reuses what the GPUs hold. Pure.

    Cost of putting target GPU role w on physical GPU p of node n: bytes w needs that n holds on other
    GPUs, over NVLink bandwidth, plus bytes n does not hold at all, over network bandwidth. Inner
    assignment per (target node, physical node), outer assignment of nodes on the inner optima.
    """
    tensors = model_tensors(model)
    want = deployment_weight_layout(model, target)
    g_per, num_nodes = cluster.gpus_per_node, cluster.num_nodes
    empty: Holdings = MappingProxyType({})
    node_union: list[dict[str, IntervalSet]] = []
    for n in range(num_nodes):
        u: dict[str, IntervalSet] = {}
        for p in range(n * g_per, (n + 1) * g_per):
            for name, lines in have.get(p, empty).items():
                u[name] = normalize(u.get(name, ()) + lines)
        node_union.append(u)
    memo_total: dict[int, int] = {}
    memo_in: dict[tuple[int, int], int] = {}
    memo_local: dict[tuple[int, int], int] = {}

    def overlap(w: Holdings, h: Mapping[str, IntervalSet]) -> int:
        return sum(length(intersection(lines, h.get(name, ()))) * tensors[name].line_bytes for name, lines in w.items())

    def cost(w: Holdings, p: int, n: int) -> float:
        if id(w) not in memo_total:
            memo_total[id(w)] = holdings_bytes(w, tensors)
        if (id(w), n) not in memo_in:
            memo_in[(id(w), n)] = overlap(w, node_union[n])
        h = have.get(p, empty)
        if (id(w), id(h)) not in memo_local:
            memo_local[(id(w), id(h))] = overlap(w, h)
        total, innode, local = memo_total[id(w)], memo_in[(id(w), n)], memo_local[(id(w), id(h))]
        return (innode - local) / bw["nvlink"] + (total - innode) / bw["network"]

    inner: dict[tuple[int, int], tuple[float, dict[int, int]]] = {}
    node_cost = np.zeros((num_nodes, num_nodes))
    for tau in range(num_nodes):
        roles = list(range(tau * g_per, (tau + 1) * g_per))
        ws = [want.get(g, empty) for g in roles]
        for n in range(num_nodes):
            phys = list(range(n * g_per, (n + 1) * g_per))
            mat = np.array([[cost(w, p, n) for p in phys] for w in ws])
            ri, ci = linear_sum_assignment(mat)
            node_cost[tau, n] = mat[ri, ci].sum()
            inner[(tau, n)] = (node_cost[tau, n], {roles[i]: phys[j] for i, j in zip(ri, ci)})
    ti, ni = linear_sum_assignment(node_cost)
    gpu_map: dict[int, int] = {}
    for tau, n in zip(ti, ni):
        gpu_map.update(inner[(int(tau), int(n))][1])
    return gpu_map


def reload_seconds(model: ModelSpec, cluster: ClusterSpec, source: Deployment, target: Deployment,
                   config: SwitchConfig = SwitchConfig()) -> float:
    """The reload baseline: every target replica not running unchanged restarts and reads its shards. Pure.

    The GPUs of one node share the node's disk bandwidth; nodes read in parallel; engines start in
    parallel after (or while) their weights load: time = slowest node's read + one engine start.
    """
    running = {(r.shape, r.gpu_ids) for r in source.replicas}
    tensors = model_tensors(model)
    per_node: dict[int, int] = defaultdict(int)
    for r in target.replicas:
        if (r.shape, r.gpu_ids) in running:
            continue
        for g, h in deployment_weight_layout(model, Deployment((r,))).items():
            per_node[cluster.node_of(g)] += holdings_bytes(h, tensors)
    if not per_node:
        return 0.0
    return max(per_node.values()) / config.disk_bytes_per_s + config.engine_start_s


def _kept(source: Deployment, target: Deployment) -> tuple[tuple[str, str], ...]:
    src = {(r.shape, r.gpu_ids): r.replica_id for r in source.replicas}
    return tuple((r.replica_id, src[(r.shape, r.gpu_ids)]) for r in target.replicas if (r.shape, r.gpu_ids) in src)


def _check(model: ModelSpec, cluster: ClusterSpec, deployment: Deployment, what: str) -> None:
    for r in deployment.replicas:
        problems = r.placement_problems(cluster)
        if problems:
            raise ConfigError(f"{what} deployment: {'; '.join(problems)}")


def plan_switch(model: ModelSpec, cluster: ClusterSpec, source: Deployment, target: Deployment, *,
                planner: str = "improved", config: SwitchConfig = SwitchConfig()) -> SwitchPlan:
    """Plan the weight transfers that turn the source deployment into the target. Pure.

    `greedy` keeps the target's placement and never relays; `improved` may relabel its GPUs
    (node-preserving), may relay (`SwitchConfig.relay`) and returns the fastest of its candidates, the
    greedy plan among them (times within a relative 1e-9 tie, and then the one with fewer network bytes wins: it
    may be slower than the fastest by that much). Returns `SwitchPlan.empty(source)` when the target equals the source.

    Raises:
        ConfigError: a placement invalid on the cluster, or an unknown planner.
        InfeasibleError: a needed weight is on no source GPU (e.g. an empty source deployment).
    """
    if planner not in PLANNERS:
        raise ConfigError(f"unknown switch planner {planner!r}; known: {', '.join(PLANNERS)}")
    _check(model, cluster, source, "source")
    _check(model, cluster, target, "target")
    if source == target:
        return SwitchPlan.empty(source)
    tensors = model_tensors(model)
    have = deployment_weight_layout(model, source)
    reload_s = reload_seconds(model, cluster, source, target, config)

    def build(name: str, placed: Deployment, gpu_map: Mapping[int, int]) -> SwitchPlan:
        tp = plan_transfers(tensors, have, deployment_weight_layout(model, placed), cluster, name, config,
                            relay=config.relay and name == "improved")
        return SwitchPlan(planner, source, placed, tp.transfers, tp.nvlink_bytes, tp.network_bytes, tp.local_bytes,
                          tp.reused_bytes, tp.switch_seconds, tp.lower_bound_seconds, reload_s,
                          _kept(source, placed), tuple(sorted((a, b) for a, b in gpu_map.items() if a != b)),
                          tp.relay_free_bound_seconds, tp.relay_bound_seconds)

    greedy = build("greedy", target, {})
    if planner == "greedy":
        return greedy
    candidates = [build("improved", target, {})]
    if config.remap:
        gpu_map = _remap(model, cluster, have, target, _bandwidths(cluster, config))
        if any(a != b for a, b in gpu_map.items()):
            candidates.append(build("improved", relabel(target, gpu_map), gpu_map))
    candidates.append(greedy)
    # Fastest first (times within a relative 1e-9 are a tie: the schedules' sums differ in their last bits); then
    # fewer network bytes; then the earliest candidate (as-given before remapped).
    fastest = min(c.switch_seconds for c in candidates)
    tied = [i for i, c in enumerate(candidates) if c.switch_seconds <= fastest * (1 + 1e-9)]
    chosen = candidates[min(tied, key=lambda i: (candidates[i].network_bytes, i))]
    if chosen is greedy and config.relay:
        # the greedy plan goes into the target as given, as the first candidate does: that one's relay bound (no
        # plan into this placement is faster, relays allowed) holds for it too
        chosen = replace(chosen, relay_bound_seconds=candidates[0].relay_bound_seconds)
    return chosen


__all__ = [
    "LINKS", "PLANNERS", "SwitchConfig", "SwitchPlan", "Transfer", "TransferPlan", "link_between", "plan_switch",
    "plan_transfers", "relabel", "reload_seconds", "schedule",
]
