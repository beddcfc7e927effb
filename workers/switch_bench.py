"""`oserve bench switch --live`: what a switch costs with real vLLM engines, against a reload, measured.

Two parts, each with real engines (vLLM's CPU build here, the same code on CUDA):

- **Engines** (`engine_switch`), per shipped model: two TP1 replicas serving from the model's files become
  one TP2 replica. Measured first, the reload: a TP2 engine started from the model's safetensors files,
  evicted from the page cache (`reload_s`; and `files_read_cold_s`, reading those files alone, its weights
  phase). Then the switch: a TP2 engine starts without weights (`engine_start_s`) and receives its shards
  from the serving TP1 engines (`oserve.switch.wire`, `oserve.switch.transport`, over gloo), verified op by
  op (`transfer_s`, bytes, bytes/s), then puts them in force (`install_s`). Checked: `bit_exact` (every
  shard the new engine holds has the SHA-256 of the same lines read from the files on disk) and
  `serves_like_reload` (its greedy answers equal those of the TP2 engine that loaded from disk). Then
  migration, as a retiring replica does it: requests stopped after `migrate_after_tokens` tokens and
  continued elsewhere from the prompt plus what they generated (re-prefill), TP1 -> TP1 (`token_exact`:
  every answer equals its answer without a switch) and TP1 -> TP2 (`token_exact_across_shapes_requests`),
  with each re-prefill's time from the hand-over to the next token.
- **Pipeline** (`pipeline_switch`): the same switch through the live system on a real nats-server (engine
  host, gateway, switch planner; the strategies published as the scheduler publishes them) while
  streamed requests come in: the switch's events with their times (planned, weights sent and received,
  ready, the router's flip, completed), the requests sent, answered, answered twice, failed and migrated,
  and each migrated answer against the same request asked again without a switch.

Across shapes, token-exactness needs TP1 and TP2 to compute alike. In bfloat16 they do not: TP2 sums two
rounded partial results where TP1 rounds once, and greedy answers part after tens of tokens with or without
a switch (`tp2_equals_tp1_without_switch_requests` counts how many agree). In float32 they answered alike
on every prompt tried here, so the pipeline part runs in float32 (`pipeline_dtype`) and its migrated
answers are compared with unswitched ones across shapes.

"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from oserve.errors import ConfigError
from oserve.specs import Deployment, ModelSpec, Replica, ReplicaShape, cluster_for_gpus
from oserve.switch.layout import gpu_weight_shards, model_tensors
from oserve.switch.planner import SwitchConfig, plan_switch
from oserve.switch.wire import wire_plan
from oserve.workers.backends import Finished, Job
from oserve.workers.tinymodel import LARGER_MODEL, TINY_MODEL, HashTokenizer, materialize
from oserve.workers.vllm_backend import VllmBackend, VllmBackendConfig, served_model_spec

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class LiveBenchConfig:
    """What `oserve bench switch --live` runs."""

    models: tuple[str, ...] = (TINY_MODEL, LARGER_MODEL)
    """Shipped models to switch (`oserve.workers.tinymodel`): the small one and one 10.9x its size."""
    dtype: str = "bfloat16"
    """The engines' dtype in the engines part (what is served)."""
    pipeline_dtype: str = "float32"
    """The engines' dtype in the pipeline part (see the module docstring)."""
    num_requests: int = 8
    """Requests that migrate (and whose answers are compared)."""
    answer_tokens: int = 64
    """Tokens each answers (greedy, end of sequence ignored)."""
    migrate_after_tokens: int = 16
    """Tokens a request generates on its TP1 replica before it migrates."""
    pipeline: bool = True
    """Also run the switch through the live system on NATS (the first model)."""
    model_dir: str = ""
    """Where the shipped models are written (empty: their default folders)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.models or self.num_requests < 1 or not 0 < self.migrate_after_tokens < self.answer_tokens:
            raise ConfigError(f"LiveBenchConfig: need models, num_requests >= 1 and 0 < migrate_after_tokens < "
                              f"answer_tokens, got {self}")


def prompts(n: int) -> list[str]:
    """The bench's prompts: `n` texts of different lengths, cycling through 20 lengths so every prompt, with the
    tokens a migrated request has generated, fits a 1024-token context (the longest is about 600 tokens)."""
    return [f"prompt {i}: " + "the switch moves weights between engines, " * (1 + 3 * (i % 20)) for i in range(n)]


def reference_checksums(folder: Path, model: ModelSpec, shape: ReplicaShape) -> list[dict[str, str]]:
    """Per rank of a `shape` replica, the SHA-256 of each of its shards as the layout cuts them from the model's
    safetensors files (q, k, v fused as vLLM's `qkv_proj`, gate and up as `gate_up_proj`), in the engine's dtype
    as `model.bytes_per_param` says (the files' bfloat16 converted as vLLM converts them)."""
    import torch
    from safetensors.torch import load_file

    from oserve.switch.executor import take_lines

    dtype = {2: torch.bfloat16, 4: torch.float32}[model.bytes_per_param]
    weights: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    fused = {}
    for name, t in weights.items():
        if ".q_proj." in name:
            fused[name.replace("q_proj", "qkv_proj")] = torch.cat(
                [t, weights[name.replace("q_proj", "k_proj")], weights[name.replace("q_proj", "v_proj")]])
        elif ".gate_proj." in name:
            fused[name.replace("gate_proj", "gate_up_proj")] = torch.cat([t, weights[name.replace("gate_proj", "up_proj")]])
        elif not any(k in name for k in (".k_proj.", ".v_proj.", ".up_proj.")):
            fused[name] = t if t.dim() == 2 else t.view(-1, 1)
    specs = model_tensors(model)
    out = []
    for index in range(shape.num_gpus):
        sums = {}
        for name, lines in gpu_weight_shards(model, shape, index // shape.tp, index % shape.tp).items():
            shard = take_lines(fused[name].to(dtype), specs[name], lines).contiguous()
            sums[name] = hashlib.sha256(shard.view(torch.uint8).numpy().tobytes()).hexdigest()
        out.append(sums)
    return out


class _Driver:
    """Runs jobs on a `VllmBackend` through its `Backend` interface, as the engine worker does."""

    def __init__(self, backend: VllmBackend) -> None:
        self.backend = backend
        self.tokens: dict[int, list[int]] = {}
        self.finished: dict[int, Finished] = {}
        self._seq = 0

    def add(self, prompt: str, max_tokens: int, *, resumed: list[int] | None = None) -> int:
        self._seq += 1
        job = Job(self._seq, f"r{self._seq}", max(1, len(prompt) // 4), max_tokens, 0, 0.0, output_tokens=max_tokens,
                  prompt=prompt, detokenize=False, resumed_tokens=len(resumed or ()), resumed_ids=tuple(resumed or ()))
        self.backend.add(job, 0.0)
        return self._seq

    async def wait(self, seqs: list[int], timeout_s: float = 600.0) -> list[list[int]]:
        deadline = time.monotonic() + timeout_s
        while any(s not in self.tokens for s in seqs):
            for f in self.backend.advance(0.0):
                if f.error:
                    raise RuntimeError(f"request {f.seq} failed in vLLM: {f.error}")
                self.tokens[f.seq] = self.backend.token_ids(f.seq)
                self.finished[f.seq] = f
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len([s for s in seqs if s not in self.tokens])} answers not ready in {timeout_s} s")
            await asyncio.sleep(0.005)
        return [self.tokens[s] for s in seqs]

    async def until_generated(self, seq: int, tokens: int, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.backend.generated_tokens(seq, 0.0) < tokens:
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {seq} did not reach {tokens} tokens in {timeout_s} s")
            await asyncio.sleep(0.005)


def _rate(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds if seconds > 0 else math.nan


async def engine_switch(model_name: str, cfg: LiveBenchConfig, progress: Progress = lambda _: None) -> dict:
    """The engines part for one shipped model (see the module docstring); returns its figures."""
    folder = materialize(Path(cfg.model_dir) / f"{model_name}-s{cfg.seed}" if cfg.model_dir else None, cfg.seed,
                         model_name)
    base = VllmBackendConfig(model_path=str(folder), max_model_len=1024, dtype=cfg.dtype)
    model = served_model_spec(base)
    out: dict = {"model": model_name, "params": model.num_params, "weight_bytes": model.weight_bytes,
                 "dtype": cfg.dtype, "source": "2 x TP1", "target": "TP2"}

    started: list[VllmBackend] = []
    try:
        return await _engine_switch(model_name, cfg, folder, base, model, out, started, progress)
    finally:  # an error must not leave engine processes behind
        for backend in started:
            await backend.stop()


async def _engine_switch(model_name: str, cfg: LiveBenchConfig, folder: Path, base: VllmBackendConfig,
                         model: ModelSpec, out: dict, started: list, progress: Progress) -> dict:
    texts = prompts(cfg.num_requests)
    n_tok, k_tok = cfg.answer_tokens, cfg.migrate_after_tokens
    now = time.monotonic

    def backend(name: str, **changes) -> VllmBackend:
        b = VllmBackend(name, replace(base, **changes), now)
        started.append(b)
        return b

    progress(f"{model_name}: two TP1 replicas serve from the model's files")
    a, b = backend("a", devices=(0,)), backend("b", devices=(1,))
    await a.start()
    await b.start()
    out["source_start_s"] = [a.start_wall_s, b.start_wall_s]
    da, db = _Driver(a), _Driver(b)
    ref_tp1 = await da.wait([da.add(t, n_tok) for t in texts])  # the answers without a switch

    progress(f"{model_name}: reload baseline: a TP2 engine reads the model's files, evicted from the page cache")
    out["files_read_cold_s"] = read_cold_s(folder)  # the weights phase of a reload, alone
    evict(folder)
    loaded = backend("reload", tp=2, devices=(0, 1))
    await loaded.start()
    out["reload_s"] = loaded.start_wall_s
    dl = _Driver(loaded)
    ref_tp2 = await dl.wait([dl.add(t, n_tok) for t in texts])
    await loaded.stop()
    started.remove(loaded)

    source = Deployment((Replica("a", ReplicaShape(1), (0,)), Replica("b", ReplicaShape(1), (1,))))
    target = Deployment((Replica("t", ReplicaShape(2), (0, 1)),))
    plan = plan_switch(model, cluster_for_gpus(2), source, target, config=SwitchConfig(remap=False))
    wire = wire_plan(model, plan, starting=frozenset({"t"}))
    from oserve.switch.transport import SessionStore

    session = SessionStore(f"bench-{model_name}", timeout_s=600)
    session.put_jobs({k: wire.job(k) for k in wire.endpoints})
    rv = session.rendezvous
    progress(f"{model_name}: the TP2 engine starts without weights and receives {wire.num_bytes / 1e6:.0f} MB from the "
             "TP1 engines")
    t0 = now()
    sends = asyncio.gather(a.run_switch_job(rv, wire.endpoints_of("a")), b.run_switch_job(rv, wire.endpoints_of("b")))
    new = backend("t", tp=2, devices=(0, 1), dummy_weights=True)
    await new.start()
    got = await new.run_switch_job(rv, wire.endpoints_of("t"), serving=False)
    sent = await sends
    session.close()
    if not got.verified:
        raise RuntimeError(f"{model_name}: the transfer failed: {got.errors} / {[x.errors for x in sent]}")
    install_s = await new.install_weights()
    out.update({"engine_start_s": new.start_wall_s, "transfer_s": got.transfer_s, "transfer_setup_s": got.setup_s,
                "install_s": install_s, "switch_s": new.start_wall_s + got.transfer_s + install_s,
                "switch_wall_s": now() - t0, "moved_bytes": got.bytes_received, "plan_bytes": wire.num_bytes,
                "bytes_by_link": wire.bytes_by_link(), "num_ops": len(wire.ops),
                "gbytes_per_s": _rate(got.bytes_received, got.transfer_s) / 1e9,
                "sources_verified": all(x.verified for x in sent)})
    out["bit_exact"] = await new.weight_checksums() == reference_checksums(folder, model, ReplicaShape(2))
    dt = _Driver(new)
    out["serves_like_reload"] = await dt.wait([dt.add(t, n_tok) for t in texts]) == ref_tp2
    out["switch_below_reload"] = out["switch_s"] < out["reload_s"]
    out["weights_phase_below_reload"] = out["transfer_s"] + out["install_s"] < out["files_read_cold_s"]

    progress(f"{model_name}: running requests migrate, TP1 -> TP1 and TP1 -> TP2")
    same, same_gaps = await _migrate(da, db, texts, n_tok, k_tok)
    out["token_exact"] = same == ref_tp1  # a -> b: replicas that compute alike
    out["token_exact_requests"] = sum(x == y for x, y in zip(same, ref_tp1))
    across, gaps = await _migrate(da, dt, texts, n_tok, k_tok)
    out["token_exact_across_shapes_requests"] = sum(x == y for x, y in zip(across, ref_tp1))
    out["tp2_equals_tp1_without_switch_requests"] = sum(x == y for x, y in zip(ref_tp2, ref_tp1))
    out["migrated"] = 2 * len(texts)
    out["migration_s"] = {"same_shape_median": same_gaps[len(same_gaps) // 2], "same_shape_max": same_gaps[-1],
                          "to_tp2_median": gaps[len(gaps) // 2], "to_tp2_max": gaps[-1]}
    return out


async def _migrate(src: _Driver, dst: _Driver, texts: list[str], n_tok: int, k_tok: int,
                   ) -> tuple[list[list[int]], list[float]]:
    """Start every prompt on `src`; once each has generated `k_tok` tokens, hand it to `dst` with them, as a
    retiring replica does (`EngineWorker._migrate`); returns the final answers and each re-prefill's time (from
    the hand-over to its next token), sorted."""
    seqs = [src.add(t, n_tok) for t in texts]
    moved: list[tuple[int, float]] = []
    for text, seq in zip(texts, seqs):
        await src.until_generated(seq, k_tok)
        ids = src.backend.token_ids(seq)[:src.backend.generated_tokens(seq, 0.0)]
        if len(ids) >= n_tok:
            raise RuntimeError("a request finished before it could migrate: raise answer_tokens")
        handed = time.monotonic()
        src.backend.cancel(seq, 0.0)
        moved.append((dst.add(text, n_tok, resumed=ids), handed))
    finals = await dst.wait([s for s, _ in moved])
    return finals, sorted(dst.finished[s].first_token_s - handed for s, handed in moved)


def _model_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def evict(folder: Path) -> None:
    """Drop a model folder's weight files from the page cache (`posix_fadvise` DONTNEED), so the next read comes
    from the disk, as it does on a host that has not read them lately."""
    import os

    for f in _model_files(folder):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_cold_s(folder: Path) -> float:
    """Seconds to read a model folder's weight files from the disk (evicted from the page cache first)."""
    evict(folder)
    t0 = time.monotonic()
    for f in _model_files(folder):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    return time.monotonic() - t0


@dataclass(slots=True)
class _Timeline:
    """Switch events as a tap on the bus saw them, in wall seconds from the tap's start."""

    start: float = field(default_factory=time.monotonic)
    events: list[tuple[float, str, dict]] = field(default_factory=list)

    def add(self, tag: str, fields: dict) -> None:
        self.events.append((time.monotonic() - self.start, tag, fields))

    def first(self, tag: str, **match) -> float | None:
        return next((t for t, g, f in self.events if g == tag and all(f.get(k) == v for k, v in match.items())), None)


async def pipeline_switch(cfg: LiveBenchConfig, progress: Progress = lambda _: None, *, nats_url: str = "",
                          model_name: str | None = None, request_interval_s: float = 2.0,
                          answer_tokens: int = 128, min_in_flight: int = 3) -> dict:
    """The pipeline part (see the module docstring): 2 x TP1 -> TP2 through the live system on NATS while streamed
    greedy requests come in, one every `request_interval_s` and sooner whenever fewer than `min_in_flight` are
    being answered (so requests are running on the old replicas when they retire, however fast the host
    decodes), until four after the switch. Starts its own nats-server unless `nats_url` is given. Returns the
    counts, the timeline and the checks."""
    import msgspec
    import nats

    from oserve.streams.client import OServeClient
    from oserve.streams.schemas import (AssignmentSet, Completed, Reply, ReplicaEvent, ReplicaSpec, StrategyChosen,
                                        SwitchEvent, decode, encode)
    from oserve.streams.server import NatsServer, reconnects
    from oserve.streams.testing import unique_subjects
    from oserve.workers.clock import Clock
    from oserve.workers.engine_host import EngineHost, EngineHostConfig
    from oserve.workers.gateway import Gateway, GatewayConfig
    from oserve.workers.switch_planner import SwitchPlannerConfig, SwitchPlannerWorker, deployment_of

    model_name = model_name or cfg.models[0]
    folder = materialize(Path(cfg.model_dir) / f"{model_name}-s{cfg.seed}" if cfg.model_dir else None, cfg.seed,
                         model_name)
    vcfg = VllmBackendConfig(model_path=str(folder), max_model_len=1024, dtype=cfg.pipeline_dtype)
    model = served_model_spec(vcfg)
    pair = [ReplicaSpec(replica_id="a", tp=1, pp=1, gpu_ids=[0]), ReplicaSpec(replica_id="b", tp=1, pp=1, gpu_ids=[1])]
    tp2 = [ReplicaSpec(replica_id="t", tp=2, pp=1, gpu_ids=[0, 1])]

    def strategy(sid: str, replicas: list) -> bytes:
        share = 1.0 / len(replicas)
        return encode(StrategyChosen(strategy_id=sid, span_index=int(sid[1:]), replicas=replicas,
                                     weights=[{r.replica_id: share for r in replicas}], switch_s=0.0,
                                     forecast_rps=[1.0]))

    server = NatsServer().start() if not nats_url else None
    timeline = _Timeline()
    migrated: list = []
    out: dict = {"model": model_name, "dtype": cfg.pipeline_dtype, "source": "2 x TP1", "target": "TP2"}
    nc = await nats.connect(nats_url or server.url)
    stop: list = []
    in_flight: list[int] = []  # requests being answered now (the load below keeps it up)
    engines: dict = {}  # every engine that served, retired ones too (their counters)
    try:
        subjects = unique_subjects("bench")
        clock = Clock(speedup=1.0)

        async def tap(msg) -> None:
            try:
                ev = decode(msg.data, SwitchEvent | ReplicaEvent | AssignmentSet)
            except Exception:  # another kind of plan event: not the switch's
                return
            timeline.add(type(ev).__name__, msgspec.structs.asdict(ev))
            if isinstance(ev, AssignmentSet) and ev.strategy_id == "s2":  # what ran where when the router flipped
                now_s = clock.now_s()
                engines.update(host.engines)
                out["at_flip"] = {"client_in_flight": in_flight[0] if in_flight else None,
                                  "engines": {rid: {"in_flight": e.num_inflight, "stalled": e._stalled(),
                                                    "generated": sorted(e.backend.generated_tokens(q, now_s)
                                                                        for q in e._inflight)}
                                              for rid, e in sorted(host.engines.items())}}

        async def on_completed(msg) -> None:
            migrated.extend(decode(msg.data, Completed).migrated)
        for kind in ("switch", "replica", "assignment"):
            await nc.subscribe(subjects.plan_event(kind), cb=tap)
        await nc.subscribe(subjects.completions(), cb=on_completed)
        # three engines and this process share the host's cores: liveness timeouts are long
        host = EngineHost(nc, EngineHostConfig(subjects=subjects, backend="vllm", vllm=vcfg, gpus_per_node=2,
                                               heartbeat_interval_wall_s=0.5, fence_after_wall_s=20.0), clock)
        gw = Gateway(nc, GatewayConfig(subjects=subjects, heartbeat_timeout_wall_s=30.0), clock)
        switcher = SwitchPlannerWorker(nc, SwitchPlannerConfig(subjects=subjects, gpus_per_node=2, ready_slack_wall_s=600,
                                                               restart_after_wall_s=0, live_transfer=True,
                                                               transfer_timeout_s=600, migrate_after_wall_s=0.0),
                                       clock, model=model, cluster=cluster_for_gpus(2), served_model=model)
        for w in (host, gw, switcher):
            await w.start()
            stop.append(w)

        async def completed(n: int, timeout_s: float) -> None:
            deadline = time.monotonic() + timeout_s
            while sum(g in ("SwitchCompleted", "SwitchRolledBack") for _, g, _ in timeline.events) < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"switch {n} not done in {timeout_s} s")
                await asyncio.sleep(0.05)

        progress(f"pipeline: 2 x TP1 of {model_name} load from disk")
        await nc.publish(subjects.plan_event("strategy"), strategy("s1", pair))
        await completed(1, 900)
        await gw.wait_for_replicas(2, 60.0)
        client = OServeClient(nc, subjects, default_timeout_s=300.0)
        texts = prompts(200)
        answers: dict[int, Reply] = {}
        latency: dict[int, float] = {}
        errors: list = []
        switched = asyncio.Event()
        finished = asyncio.Event()
        in_flight.append(0)

        async def one(i: int) -> None:
            t0 = time.monotonic()
            in_flight[0] += 1
            try:
                final, parts = None, []
                async for item in client.stream(prompt=texts[i], max_tokens=answer_tokens, temperature=0.0):
                    if isinstance(item, Reply):
                        final = item
                    else:
                        parts.append(item.text)
                if final is None or "".join(parts) != final.text:
                    raise RuntimeError("the streamed chunks are not the answer")
                answers[i], latency[i] = final, time.monotonic() - t0
            except Exception as exc:  # counted: a failed request is reported, not raised
                errors.append((i, f"{type(exc).__name__}: {exc}"))
            finally:
                in_flight[0] -= 1
                finished.set()

        sent: list[int] = []

        async def next_send() -> None:
            """Until the interval is up, or sooner once fewer than `min_in_flight` requests are being answered."""
            deadline = time.monotonic() + request_interval_s
            while in_flight[0] >= min_in_flight and (left := deadline - time.monotonic()) > 0:
                finished.clear()
                try:
                    await asyncio.wait_for(finished.wait(), left)
                except TimeoutError:
                    return

        async def load() -> None:
            async with asyncio.TaskGroup() as tg:
                after = 0
                for i in range(len(texts)):
                    tg.create_task(one(i))
                    sent.append(i)
                    after += switched.is_set()
                    if after >= 4:
                        break
                    await asyncio.sleep(0)  # the new request counts as in flight before the next is weighed
                    await next_send()
        progress("pipeline: requests stream in; the switch to TP2 starts")
        load_task = asyncio.create_task(load())
        await asyncio.sleep(3 * request_interval_s)
        await nc.publish(subjects.plan_event("strategy"), strategy("s2", tp2))
        await completed(2, 600)
        switched.set()
        await load_task
        deadline = time.monotonic() + 120
        while set(host.engines) != {"t"} and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        progress("pipeline: the migrated requests are asked again, without a switch")
        ids = {m.request_id for m in migrated}
        resumed = [i for i, r in answers.items() if r.request_id in ids]
        again = [await client.submit(prompt=texts[i], max_tokens=answer_tokens, temperature=0.0) for i in resumed]
        done = [(t, g, f) for t, g, f in timeline.events if g in ("SwitchCompleted", "SwitchRolledBack")][-1]
        t_plan = timeline.first("SwitchPlanned", strategy_id="s2")
        t_ready = timeline.first("ReplicaReady", strategy_id="s2", replica_id="t")
        t_flip = timeline.first("AssignmentSet", strategy_id="s2")
        lat = sorted(latency.values())
        engines.update(host.engines)
        plan = plan_switch(model, cluster_for_gpus(2), deployment_of(pair), deployment_of(tp2),
                           config=SwitchConfig(remap=False))
        out.update({
            "completed": done[1] == "SwitchCompleted", "rolled_back_reason": done[2].get("reason", ""),
            "sent": len(sent), "answered": len(answers), "answered_twice": client.num_duplicates,
            "failed": len(errors), "errors": errors[:5], "lost": len(sent) - len(answers) - len(errors),
            "migrated": len(migrated), "gateway_migrated": gw.num_migrated,
            "client_resent": client.num_resent + client.num_unaccepted_resent,
            "stale_copies_dropped": sum(e.num_stale_handed for e in engines.values()),
            "late_copies_dropped": gw.num_late_copies,
            "reconnects": reconnects(nc),  # the one connection every part shares
            "migrated_tokens": sorted(m.resume.num_tokens for m in migrated),
            "migrated_token_exact": [a.text for a in again] == [answers[i].text for i in resumed],
            "moved_bytes": done[2].get("moved_bytes", 0),
            "plan_bytes": wire_plan(model, plan, starting=frozenset({"t"})).num_bytes,
            "engine_start_s": done[2].get("engine_start_wall_s", 0.0), "transfer_s": done[2].get("transfer_wall_s", 0.0),
            "install_s": done[2].get("install_wall_s", 0.0), "switch_wall_s": done[2].get("switch_wall_s", 0.0),
            "flip_s": (t_flip - t_ready) if t_flip is not None and t_ready is not None else None,
            "ready_after_plan_s": (t_ready - t_plan) if t_ready is not None and t_plan is not None else None,
            "retired": sorted(f["replica_id"] for _, g, f in timeline.events if g == "ReplicaDrained"),
            "serving_after": sorted(host.engines),
            "p50_s": lat[len(lat) // 2] if lat else None, "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
            "bad_messages": host.num_bad_messages + switcher.num_bad_messages + gw.num_bad_messages,
            "timeline": [(round(t, 3), g, {k: v for k, v in f.items() if k in ("replica_id", "strategy_id", "verified", "error",
                                                                              "num_bytes", "reason")})
                         for t, g, f in timeline.events],
        })
        await client.close()
    finally:
        for w in reversed(stop):
            try:
                await w.stop()
            except Exception:  # shutting down: report what was measured
                pass
        await nc.close()
        if server is not None:
            server.stop()
    return out


async def run(cfg: LiveBenchConfig, progress: Progress = lambda _: None) -> dict:
    """Both parts: each model's engine switch, then (`cfg.pipeline`) the pipeline switch of the first model."""
    started = time.monotonic()
    out: dict = {"engines": [], "dtype": cfg.dtype}
    for name in cfg.models:
        out["engines"].append(await engine_switch(name, cfg, progress))
    if cfg.pipeline:
        out["pipeline"] = await pipeline_switch(cfg, progress)
    e = out["engines"]
    out["bit_exact"] = all(r["bit_exact"] for r in e)
    out["token_exact"] = all(r["token_exact"] for r in e) and \
        (not cfg.pipeline or out["pipeline"]["migrated_token_exact"])
    out["switch_below_reload"] = all(r["switch_below_reload"] for r in e)
    out["wall_s"] = time.monotonic() - started
    return out


def plot(result: dict, path: Path) -> None:
    """A PNG of each model's switch against its reload: stacked engine start, transfer and install beside the
    reload (an engine start that reads the weights from disk)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["engines"]
    fig, ax = plt.subplots(figsize=(1.8 + 2.2 * len(rows), 4.2))
    x = range(len(rows))
    start = [r["engine_start_s"] for r in rows]
    transfer = [r["transfer_s"] for r in rows]
    install = [r["install_s"] for r in rows]
    ax.bar([i - 0.2 for i in x], start, 0.38, label="engine start, no weights", color="#8fb3d9")
    ax.bar([i - 0.2 for i in x], transfer, 0.38, bottom=start, label="weight transfer (gloo)", color="#d9534f")
    ax.bar([i - 0.2 for i in x], install, 0.38, bottom=[a + b for a, b in zip(start, transfer)], label="install",
           color="#5cb85c")
    ax.bar([i + 0.2 for i in x], [r["reload_s"] for r in rows], 0.38, label="reload from local safetensors",
           color="#777777")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['moved_bytes'] / 1e6:.0f} MB in {r['transfer_s']:.2f} s", (i - 0.2, start[i] + transfer[i]),
                    textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
    ax.set_xticks(list(x), [f"{r['model']}\n{r['params'] / 1e6:.0f} M params" for r in rows])
    ax.set_ylabel("wall seconds")
    ax.set_title(f"2 x TP1 -> TP2 with real vLLM engines ({result['dtype']}, this machine)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["LiveBenchConfig", "engine_switch", "pipeline_switch", "plot", "prompts", "reference_checksums", "run"]
