"""Relays in the switch planner: lines forwarded by target GPUs that received them earlier in the plan."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from dataclasses import replace
from types import MappingProxyType

import networkx as nx
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from oserve.errors import ConfigError
from oserve.specs import GPUS, ClusterSpec, Deployment, ModelSpec, Replica, ReplicaShape, sharding_problems
from oserve.switch import intervals as iv
from oserve.switch.layout import TensorSpec, deployment_weight_layout, model_tensors
from oserve.switch.planner import SwitchConfig, Transfer, link_between, plan_switch, plan_transfers, schedule
from oserve.switch.relay import FABRIC, hops, nvswitch, relay_classes, topology

GQA = ModelSpec("tiny-gqa", num_layers=5, hidden_size=64, num_heads=8, num_kv_heads=2, intermediate_size=96,
                vocab_size=203, gated_mlp=True, max_context_tokens=256)
OPTLIKE = ModelSpec("tiny-opt", num_layers=4, hidden_size=48, num_heads=6, num_kv_heads=6, intermediate_size=72,
                    vocab_size=150, gated_mlp=False, max_context_tokens=128, tied_embeddings=True, has_bias=True,
                    learned_positions=130)
H100 = GPUS["h100-80gb"]
CLUSTER = ClusterSpec("3x2", 3, 2, H100, 400e9, 200e9)
TWO_BY_TWO = ClusterSpec("2x2", 2, 2, H100, 400e9, 200e9)
CONFIG = SwitchConfig(max_transfer_bytes=4096)
REL = 1e-9


@st.composite
def placed(draw, model: ModelSpec, cluster: ClusterSpec = CLUSTER, prefix: str = "r") -> Deployment:
    """Random replicas of random shapes on random GPUs, each stage inside one node."""
    g = cluster.gpus_per_node
    shapes = [ReplicaShape(t, p) for t in range(1, g + 1) for p in (1, 2, 3)
              if not sharding_problems(model, ReplicaShape(t, p), g)]
    free = {n: list(draw(st.permutations(range(n * g, (n + 1) * g)))) for n in range(cluster.num_nodes)}
    replicas = []
    for i in range(draw(st.integers(1, 4))):
        shape = draw(st.sampled_from(shapes))
        trial = {n: list(ids) for n, ids in free.items()}
        ids: list[int] = []
        for _ in range(shape.pp):
            nodes = [n for n in trial if len(trial[n]) >= shape.tp]
            if not nodes:
                break
            n = draw(st.sampled_from(nodes))
            ids += trial[n][:shape.tp]
            del trial[n][:shape.tp]
        else:
            free = trial
            replicas.append(Replica(f"{prefix}{i}", shape, tuple(ids)))
    assume(replicas)
    return Deployment(tuple(replicas))


def check_relay_plan(tensors, have, want, cluster, plan) -> None:
    """Each target GPU gets exactly the lines it lacks, once; a relay forwards lines an earlier transfer
    delivered to its source, which wants them itself; the schedule starts no relay before its delivery."""
    got: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)  # over the wire, so far
    ends: dict[tuple[int, str], list[tuple[int, int, float]]] = defaultdict(list)
    copied: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
    for t in plan.transfers:
        lo, hi = t.lines
        assert t.num_bytes == (hi - lo) * tensors[t.tensor].line_bytes and t.link == link_between(cluster, t.src_gpu,
                                                                                                    t.dst_gpu)
        if t.relay:
            assert t.src_gpu != t.dst_gpu
            assert iv.contains(iv.normalize(got[(t.src_gpu, t.tensor)]), ((lo, hi),)), f"relay before delivery: {t}"
            assert iv.contains(want[t.src_gpu][t.tensor], ((lo, hi),)), f"relay through a GPU not wanting it: {t}"
            assert not iv.intersection(have.get(t.src_gpu, {}).get(t.tensor, ()), ((lo, hi),))
            arrived = [e for a, b, e in ends[(t.src_gpu, t.tensor)] if a < hi and b > lo]
            assert t.start_s >= max(arrived) - 1e-15, f"relay starts before its delivery ends: {t}"
        else:
            assert iv.contains(have.get(t.src_gpu, {}).get(t.tensor, ()), ((lo, hi),)), f"source does not hold {t}"
        if t.link == "local":
            copied[(t.dst_gpu, t.tensor)].append((lo, hi))
        else:
            got[(t.dst_gpu, t.tensor)].append((lo, hi))
            ends[(t.dst_gpu, t.tensor)].append((lo, hi, t.end_s))
    for gpu, by_name in want.items():
        for name, lines in by_name.items():
            parts = got[(gpu, name)] + copied[(gpu, name)]
            assert sum(hi - lo for lo, hi in parts) == iv.length(iv.normalize(parts)), f"GPU {gpu} {name} twice"
            if have.get(gpu, {}).get(name) == lines:
                assert not parts
            else:
                assert iv.normalize(parts) == lines, f"GPU {gpu} {name}: gap or excess"
    replayed, makespan = schedule(plan.transfers, cluster, CONFIG)
    assert replayed == plan.transfers and makespan == pytest.approx(plan.switch_seconds, rel=REL)


# --- the topology graph ------------------------------------------------------------------------

def test_topology_is_a_graph_of_ports_and_hops_follow_it():
    g = topology(CLUSTER)
    assert nx.is_frozen(g)
    assert g.number_of_nodes() == CLUSTER.num_gpus + CLUSTER.num_nodes + 1  # GPUs, NVSwitches, the fabric
    ports = [d["port"] for _, _, d in g.edges(data=True)]
    assert len(ports) == len(set(ports)) == 4 * CLUSTER.num_gpus  # each GPU: NVLink and NIC, out and in
    for (src, dst), hop in hops(CLUSTER).items():
        assert hop.link == link_between(CLUSTER, src, dst)
        assert hop.ports == ((src, hop.link, "out"), (dst, hop.link, "in"))
    # A relayed line's route passes through the relay's GPU node: with GPU 3's NIC-in taken away, the way
    # from GPU 0 to GPU 3 is over the network to GPU 2, its node-mate, then over NVLink.
    no_nic_in = g.edge_subgraph([e for e in g.edges if e != (FABRIC, 3)])
    assert nx.shortest_path(no_nic_in, 0, 3, weight="weight") == [0, FABRIC, 2, nvswitch(1), 3]
    one_node = ClusterSpec("1x4", 1, 4, H100, 400e9, 200e9)
    assert FABRIC not in topology(one_node) and all(h.link == "nvlink" for h in hops(one_node).values())


def test_relay_classes_cover_every_needed_line_once():
    tensors = model_tensors(GQA)
    have = deployment_weight_layout(GQA, Deployment((Replica("a", ReplicaShape(2), (0, 1)),)))
    want = deployment_weight_layout(GQA, Deployment((Replica("b", ReplicaShape(2), (2, 3)),
                                                     Replica("c", ReplicaShape(2), (4, 5)))))
    classes = relay_classes([(name, dst, lo, hi, frozenset(g for g in have if iv.contains(have[g].get(name, ()),
                                                                                             ((lo, hi),))))
                             for dst, by_name in want.items() for name, lines in by_name.items()
                             for lo, hi in lines], tensors)
    seen: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
    for (receivers, holders), runs in classes.items():
        assert holders and receivers
        for name, lo, hi in runs:
            for d in receivers:
                seen[(d, name)].append((lo, hi))
    for d, by_name in want.items():
        for name, lines in by_name.items():
            assert iv.normalize(seen[(d, name)]) == lines
    # TP rank r of both target replicas wants the same lines: classes with two receivers, one per node.
    assert any(len(r) == 2 and {g // 2 for g in r} == {1, 2} for r, _ in classes)


# --- properties of relay plans -----------------------------------------------------------------

@settings(max_examples=30)
@given(st.sampled_from([GQA, OPTLIKE]), st.data())
def test_relays_deliver_exactly_once_after_their_deliveries_and_never_cost_more(model, data):
    source = data.draw(placed(model, prefix="s"))
    target = data.draw(placed(model, prefix="t"))
    tensors = model_tensors(model)
    have = deployment_weight_layout(model, source)
    want = deployment_weight_layout(model, target)
    free = plan_transfers(tensors, have, want, CLUSTER, "improved", CONFIG)
    relay = plan_transfers(tensors, have, want, CLUSTER, "improved", CONFIG, relay=True)
    check_relay_plan(tensors, have, want, CLUSTER, relay)
    assert not free.has_relays and free.relay_bound_seconds is None
    assert relay.switch_seconds <= free.switch_seconds * (1 + REL)
    assert relay.network_bytes <= free.network_bytes
    assert relay.relay_bound_seconds <= relay.switch_seconds * (1 + REL) + 1e-15
    assert relay.relay_bound_seconds <= relay.relay_free_bound_seconds * (1 + REL) + 1e-15
    assert relay.relay_free_bound_seconds == free.relay_free_bound_seconds == free.lower_bound_seconds
    if relay.has_relays:  # taken because it is faster, or as fast with fewer network bytes
        assert relay.lower_bound_seconds == relay.relay_bound_seconds
        assert (relay.switch_seconds < free.switch_seconds * (1 - REL)
                or relay.network_bytes < free.network_bytes)
    else:
        assert relay.transfers == free.transfers


def test_a_greedy_plan_chosen_by_a_rounding_tie_still_carries_the_relay_bound():
    """Found by CI (hypothesis): the greedy plan beat the relay plan into the same placement by 5e-22 s, a last-bit
    difference of two schedules' sums, and came back without the relay bound. Times within a relative 1e-9 are a
    tie (then fewer network bytes wins), and a greedy plan chosen with relays on carries the first candidate's
    bound, which holds for any plan into the target as given."""
    source = Deployment((Replica("s0", ReplicaShape(2, 2), (2, 3, 4, 5)), Replica("s1", ReplicaShape(1, 1), (0,))))
    target = Deployment((Replica("t0", ReplicaShape(1, 2), (0, 1)), Replica("t1", ReplicaShape(2, 1), (2, 3)),
                         Replica("t2", ReplicaShape(1, 1), (4,))))
    on = plan_switch(GQA, CLUSTER, source, target, config=CONFIG)
    greedy = plan_switch(GQA, CLUSTER, source, target, planner="greedy", config=CONFIG)
    assert on.relay_bound_seconds is not None
    assert on.relay_bound_seconds <= on.switch_seconds * (1 + REL) + 1e-15
    assert on.switch_seconds <= greedy.switch_seconds * (1 + REL)
    assert on.network_bytes <= greedy.network_bytes


@settings(max_examples=15)
@given(st.data())
def test_the_improved_planner_with_relays_is_never_slower_and_the_greedy_never_relays(data):
    model = GQA
    source = data.draw(placed(model, prefix="s"))
    target = data.draw(placed(model, prefix="t"))
    on = plan_switch(model, CLUSTER, source, target, config=CONFIG)
    off = plan_switch(model, CLUSTER, source, target, config=replace(CONFIG, relay=False))
    greedy = plan_switch(model, CLUSTER, source, target, planner="greedy", config=CONFIG)
    assert on.switch_seconds <= off.switch_seconds * (1 + REL)
    assert not any(t.relay for t in off.transfers + greedy.transfers)
    assert off.relay_bound_seconds is None and greedy.relay_bound_seconds is None
    if on.is_empty:
        return
    tensors = model_tensors(model)
    check_relay_plan(tensors, deployment_weight_layout(model, source), deployment_weight_layout(model, on.target),
                     CLUSTER, on)
    assert on.relay_bound_seconds <= on.switch_seconds * (1 + REL) + 1e-15


def test_a_relay_that_comes_before_its_delivery_is_refused():
    tensors = model_tensors(GQA)
    have = deployment_weight_layout(GQA, Deployment((Replica("a", ReplicaShape(1), (0,)),)))
    want = deployment_weight_layout(GQA, Deployment((Replica("b", ReplicaShape(1), (2,)),
                                                     Replica("c", ReplicaShape(1), (3,)))))
    plan = plan_transfers(tensors, have, want, TWO_BY_TWO, "improved", CONFIG, relay=True)
    assert plan.has_relays
    first = next(i for i, t in enumerate(plan.transfers) if t.relay)
    moved = list(plan.transfers)
    relay = moved.pop(first)
    with pytest.raises(ConfigError, match="no earlier transfer"):
        schedule([relay] + moved, TWO_BY_TWO, CONFIG)
    with pytest.raises(ConfigError, match="between two GPUs"):
        schedule([replace(relay, dst_gpu=relay.src_gpu, link="local")], TWO_BY_TWO, CONFIG)


# --- against references ------------------------------------------------------------------------

def _one_tensor(lines: int) -> dict[str, TensorSpec]:
    return {"w": TensorSpec("w", lines, 512, 0, 2)}


def test_scale_out_crosses_the_network_once_and_fans_out_over_nvlink():
    """One holder in node 0, two GPUs of node 1 want its B bytes. Without relays the holder's NIC sends 2B:
    2B / net. With relays B crosses once, split between the two, which swap halves over NVLink: the
    holder's NIC bounds it at B / net, reached up to one chunk's pipeline delay."""
    lines = 64
    tensors = _one_tensor(lines)
    b = lines * tensors["w"].line_bytes
    have = {0: MappingProxyType({"w": ((0, lines),)})}
    want = {g: MappingProxyType({"w": ((0, lines),)}) for g in (2, 3)}
    config = SwitchConfig(max_transfer_bytes=4 * tensors["w"].line_bytes)
    free = plan_transfers(tensors, have, want, TWO_BY_TWO, "improved", config)
    relay = plan_transfers(tensors, have, want, TWO_BY_TWO, "improved", config, relay=True)
    net, nvl = TWO_BY_TWO.network_bytes_per_s, TWO_BY_TWO.nvlink_bytes_per_s
    assert free.switch_seconds == pytest.approx(2 * b / net, rel=1e-9) and free.network_bytes == 2 * b
    assert relay.relay_bound_seconds == pytest.approx(b / net, rel=1e-6)
    assert relay.network_bytes == b
    assert sum(t.num_bytes for t in relay.transfers if t.relay) == b
    assert all(t.link == "nvlink" for t in relay.transfers if t.relay)
    chunk = config.max_transfer_bytes
    assert b / net <= relay.switch_seconds <= b / net + chunk / nvl + 1e-15
    check_relay_plan(tensors, have, want, TWO_BY_TWO, relay)


def _brute_force_makespan(tensors, have, want, cluster, config) -> float:
    """The fastest line-by-line plan: every (line, target) from any holder or, relayed, from another target
    that gets that line (no cycles), in every order that puts deliveries first, timed by `schedule`."""
    name = "w"
    lb = tensors[name].line_bytes
    pairs = [(line, d) for d in sorted(want) for lo, hi in want[d][name] for line in range(lo, hi)
             if not iv.contains(have.get(d, {}).get(name, ()), ((line, line + 1),))]
    wanting = defaultdict(list)
    for line, d in pairs:
        wanting[line].append(d)
    holders = {line: [g for g in sorted(have) if iv.contains(have[g][name], ((line, line + 1),))]
               for line, _ in pairs}
    options = [[(h, False) for h in holders[line]] + [(r, True) for r in wanting[line] if r != d] for line, d in pairs]
    best = float("inf")
    for choice in itertools.product(*options):
        src = {(line, d): s for (line, d), s in zip(pairs, choice)}
        # Reject relay cycles: following relays from any target must reach a holder.
        ok = True
        for line, d in pairs:
            seen, cur = set(), (line, d)
            while src[cur][1]:
                if cur in seen:
                    ok = False
                    break
                seen.add(cur)
                cur = (line, src[cur][0])
            if not ok:
                break
        if not ok:
            continue
        transfers = [Transfer(s, d, name, (line, line + 1), lb, link_between(cluster, s, d), relay=r)
                     for (line, d), (s, r) in src.items()]
        for order in itertools.permutations(transfers):
            try:
                _, makespan = schedule(order, cluster, config)
            except ConfigError:  # a relay before its delivery
                continue
            best = min(best, makespan)
    return best


@settings(max_examples=12)
@given(st.data())
def test_bound_and_plan_bracket_the_brute_force_optimum(data):
    """On tiny cases (at most 4 line deliveries) every line-granular plan is tried: the relay bound is at
    most the best, the planner's plans at least the best, and the relay plan no slower than relay-free."""
    lines = data.draw(st.integers(1, 2))
    tensors = _one_tensor(lines)
    gpus = list(range(TWO_BY_TWO.num_gpus))
    receivers = data.draw(st.lists(st.sampled_from(gpus), min_size=1, max_size=3 if lines == 1 else 2, unique=True))
    holders = data.draw(st.lists(st.sampled_from([g for g in gpus if g not in receivers]), min_size=1, max_size=2,
                                 unique=True))
    have = {h: MappingProxyType({"w": ((0, lines),)}) for h in holders}
    want = {d: MappingProxyType({"w": ((0, lines),)}) for d in receivers}
    config = SwitchConfig(max_transfer_bytes=tensors["w"].line_bytes)  # transfers of one line, as brute force
    free = plan_transfers(tensors, have, want, TWO_BY_TWO, "improved", config)
    relay = plan_transfers(tensors, have, want, TWO_BY_TWO, "improved", config, relay=True)
    best = _brute_force_makespan(tensors, have, want, TWO_BY_TWO, config)
    assert relay.relay_bound_seconds <= best * (1 + REL)
    assert best <= relay.switch_seconds * (1 + REL) and best <= free.switch_seconds * (1 + REL)
    assert relay.switch_seconds <= free.switch_seconds * (1 + REL)
    check_relay_plan(tensors, have, want, TWO_BY_TWO, relay)


def test_the_relay_plan_is_optimal_on_a_two_line_scale_out():
    """Holder GPU 0; GPUs 2 and 3 (the other node) want both lines. Brute force: 2.5 line-times of the
    network (two lines cross once, the last one is forwarded over NVLink at twice the speed); relay-free
    the holder's NIC sends four lines."""
    tensors = _one_tensor(2)
    have = {0: MappingProxyType({"w": ((0, 2),)})}
    want = {g: MappingProxyType({"w": ((0, 2),)}) for g in (2, 3)}
    config = SwitchConfig(max_transfer_bytes=tensors["w"].line_bytes)
    tau = tensors["w"].line_bytes / TWO_BY_TWO.network_bytes_per_s
    best = _brute_force_makespan(tensors, have, want, TWO_BY_TWO, config)
    relay = plan_transfers(tensors, have, want, TWO_BY_TWO, "improved", config, relay=True)
    free = plan_transfers(tensors, have, want, TWO_BY_TWO, "improved", config)
    assert best == pytest.approx(2.5 * tau, rel=1e-9)
    assert relay.switch_seconds == pytest.approx(best, rel=1e-9)
    assert free.switch_seconds == pytest.approx(4 * tau, rel=1e-9)
    assert relay.relay_bound_seconds == pytest.approx(2 * tau, rel=1e-6)


# --- execution ---------------------------------------------------------------------------------

TINY = ModelSpec("llama-tiny", num_layers=4, hidden_size=128, num_heads=8, num_kv_heads=2, intermediate_size=256,
                 vocab_size=1000, gated_mlp=True, max_context_tokens=512)


def test_the_executor_forwards_relayed_lines_bit_exact():
    pytest.importorskip("torch")
    pytest.importorskip("torch.distributed")
    from oserve.switch.executor import ExecutorConfig, execute_switch

    source = Deployment((Replica("r0", ReplicaShape(1), (0,)),))
    target = Deployment((Replica("t0", ReplicaShape(1), (0,)), Replica("t1", ReplicaShape(1), (1,)),
                         Replica("t2", ReplicaShape(2), (2, 3))))
    plan = plan_switch(TINY, TWO_BY_TWO, source, target)
    off = plan_switch(TINY, TWO_BY_TWO, source, target, config=SwitchConfig(relay=False))
    assert plan.relayed_bytes > 0 and plan.switch_seconds < off.switch_seconds
    cfg = ExecutorConfig(timeout_s=60, max_inflight=4)
    res = execute_switch(TINY, plan, seed=5, config=cfg)
    assert res.committed and res.bit_exact, res.errors
    assert res.bytes == plan.moved_bytes
    # A plan whose relay comes before its delivery is refused before any worker starts.
    i = next(i for i, t in enumerate(plan.transfers) if t.relay)
    bad = replace(plan, transfers=(plan.transfers[i],) + plan.transfers[:i] + plan.transfers[i + 1:])
    with pytest.raises(ConfigError, match="before any earlier transfer delivered"):
        execute_switch(TINY, bad, seed=5, config=cfg)


# --- the benchmark -----------------------------------------------------------------------------

def test_bench_reports_relays_on_against_off():
    from oserve.switch.bench import SwitchCase, case_rows, check_targets

    source = Deployment((Replica("r0", ReplicaShape(2), (0, 1)),))
    target = Deployment((Replica("t0", ReplicaShape(1), (2,)), Replica("t1", ReplicaShape(1), (3,))))
    case = SwitchCase("tiny/scale-out", "paper", GQA, CLUSTER, source, target)
    rows = [row for row, _ in case_rows(case, CONFIG)]
    improved = next(r for r in rows if r["planner"] == "improved")
    greedy = next(r for r in rows if r["planner"] == "greedy")
    assert greedy["relay"] is None and greedy["relay_lower_bound_seconds"] is None
    x, given = improved["relay"], improved["relay"]["as_given"]
    # As given, both GPUs of node 1 pull the whole model over the network; with relays it crosses once.
    # Remapped, the target's node is the source's and nothing crosses.
    assert given["no_relay_network_bytes"] == 2 * given["network_bytes"] == 2 * GQA.weight_bytes
    assert given["relayed_bytes"] == GQA.weight_bytes and x["no_relay_network_bytes"] == 0
    assert given["speedup"] > 1 and given["relay_lower_bound_seconds"] <= given["switch_seconds"] * (1 + REL)
    assert x["switch_seconds"] == improved["switch_seconds"] and x["speedup"] >= 1 - REL
    targets = check_targets(rows)
    assert targets["relays_never_slower"] and targets["relays_never_more_network_bytes"]
    assert [g["name"] for g in targets["relay_gains"]] == ["tiny/scale-out"]
    assert [r["relay"] for r, _ in case_rows(case, replace(CONFIG, relay=False))] == [None, None]


def test_bench_switch_json_has_relay_records():
    from typer.testing import CliRunner

    from oserve.cli import app
    from oserve.cli import switch_cmds  # noqa: F401  (registers `bench switch`)

    result = CliRunner().invoke(app, ["bench", "switch", "--json", "--model", "opt-66b", "--gpus", "8",
                                      "--no-scheduler", "--no-executor"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["config"]["relay"] is True
    for row in out["cases"]:
        if row["planner"] == "improved":
            assert {"switch_seconds", "no_relay_switch_seconds", "network_bytes", "no_relay_network_bytes",
                    "relayed_bytes", "relay_lower_bound_seconds", "as_given"} <= set(row["relay"])
    assert out["targets"]["relays_never_slower"]
