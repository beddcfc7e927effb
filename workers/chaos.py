"""`oserve bench chaos`: requests served while, in turn, each worker kind and the NATS server fail.

The workers run as separate `oserve worker` processes against one JetStream `nats-server`; a client
sends requests at a steady rate (input and output lengths from a bundled trace) through phases, one per
fault. In each phase the fault comes `fault_at_wall_s` in:

- `gateway`, `engines`, `forecaster`, `scheduler`, `switch-planner`: that worker's process is SIGKILLed
  and started again `down_wall_s` later;
- `gateway+engines`: the gateway and the engine host are SIGKILLed together and started again: the requests
  the gateway had accepted and dispatched die with their replicas while no gateway watches, and only the
  restarted gateway's journal (`Gateway._recover`) can have them served (the client sends nothing again: it
  was told they were accepted);
- `switch-half`: a switch is ordered (a strategy that renames one replica, as the scheduler would
  publish it) and the engine host is SIGKILLed as soon as the switch is planned, then started again;
- `nats-short`, `nats-long`: the nats-server is SIGKILLed and started again on its port and store after
  `nats_short_wall_s` / `nats_long_wall_s`;
- `burst`: `burst_requests` long requests (timeout `burst_timeout_s`) come at once beside the steady ones,
  far more than the replicas serve before their deadline; the phase reports what became of them
  (`burst`: answered, and refused by code) and how long the steady requests were disrupted.

A tap (its own connection, subscribed to every client inbox) counts the final answers each request
gets on the wire. Per phase: `sent`; `answered` (a `Reply`); `answered_twice` (the larger of: requests
with more than one final answer on the wire, and answers the client saw after a request's first — the
tap, reconnecting itself, can miss some); `errors` by code (each an
`ErrorCode` the system answered, or the client's own: `timeout`, `connection_lost`, `no_gateway`);
`lost` (no answer at all: the client's codes); `disrupted` (requests sent after the fault that failed or
took longer than twice, and a second more than, the phase's P99 before it, in wall time as the client
saw it); `recovery_s` (from the fault to the send time of the last disrupted request; 0 when none); and
the P99 of the answered; and, where the gateway was killed, `gateway_took_back`: the requests its restart
took back from its journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import nats
import numpy as np

from oserve.errors import ConfigError
from oserve.streams.client import ClientError, OServeClient, RequestRejected
from oserve.streams.schemas import (ErrorCode, ErrorReply, Reply, ReplicaSpec, SchemaError, StrategyChosen, SwitchEvent,
                                    SwitchPlanned, decode, decode_reply, encode)
from oserve.streams.server import NatsServer
from oserve.streams.subjects import Subjects

PROCESSES = ("gateway", "engines", "forecaster", "scheduler", "switch-planner")
"""The worker processes of the system under test (`oserve worker NAME`); the HTTP front is left out."""
FAULTS = (*PROCESSES, "gateway+engines", "switch-half", "nats-short", "nats-long", "burst")
DOCUMENTED_CODES = frozenset(v for k, v in vars(ErrorCode).items() if k.isupper()) | {"no_gateway"}
"""What a failed request may be answered with: the system's `ErrorCode`s, and NATS's "no responders"
(`NoGateway`: nobody took it; safe to send again). A client-side timeout or lost connection is `lost`."""
BASELINE = "none"
"""The phase without a fault that every run starts with: its P99 wall latency is what `disrupted` compares to."""


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    faults: tuple[str, ...] = FAULTS
    rate_rps: float = 8.0
    """Requests sent per wall second, steadily, through every phase."""
    phase_wall_s: float = 14.0
    """Wall seconds of sending per phase."""
    fault_at_wall_s: float = 3.0
    down_wall_s: float = 1.0
    """A killed worker is started again this long after the kill."""
    nats_short_wall_s: float = 1.0
    nats_long_wall_s: float = 8.0
    settle_wall_s: float = 3.0
    """After a phase's last answer: time for late and duplicate answers to show on the tap."""
    timeout_s: float = 40.0
    """Each request's timeout (sent with it: the system's deadline too)."""
    speedup: float = 4.0
    gpus: int = 8
    model: str = "llama2-7b"
    trace: str = "azure-conv"
    max_output_tokens: int = 512
    """Output lengths from the trace are capped here, so a phase's requests finish within it."""
    burst_requests: int = 2000
    """Long requests (2,000 input tokens, `max_output_tokens` out) the `burst` fault sends at once ..."""
    burst_timeout_s: float = 10.0
    """... each with this timeout."""
    ready_timeout_wall_s: float = 120.0
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown:
            raise ConfigError(f"ChaosConfig.faults: unknown {unknown}; choose from {', '.join(FAULTS)}")
        for name in ("rate_rps", "phase_wall_s", "timeout_s", "speedup", "ready_timeout_wall_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"ChaosConfig.{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.fault_at_wall_s < self.phase_wall_s:
            raise ConfigError(f"ChaosConfig.fault_at_wall_s must be in [0, phase_wall_s), got {self.fault_at_wall_s}")


@dataclass(slots=True)
class _Sent:
    at_wall_s: float
    outcome: str = ""
    """"ok", or the failure's code."""
    message: str = ""
    took_wall_s: float = math.nan
    """Wall seconds from its send to its answer (or failure), as the client saw them."""
    e2e_s: float = math.nan


class _Workers:
    """The worker processes, started and SIGKILLed by name; their output goes to log files."""

    def __init__(self, url: str, config: ChaosConfig, prefix: str, log_dir: Path) -> None:
        self.url, self.config, self.prefix, self.log_dir = url, config, prefix, log_dir
        self.epoch = time.time()
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: Counter[str] = Counter()

    def start(self, name: str) -> None:
        c = self.config
        self.starts[name] += 1
        log = open(self.log_dir / f"{name}.{self.starts[name]}.log", "w")  # noqa: SIM115 (closed by the child's exit)
        cmd = [sys.executable, "-c", "from oserve.cli import main; main()", "worker", name, "--nats", self.url,
               "--model", c.model, "--gpus", str(c.gpus), "--speedup", str(c.speedup), "--trace", c.trace,
               "--prefix", self.prefix, "--epoch", repr(self.epoch), "--metrics-port", "0", "--tracing", "none"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        log.close()

    def gateway_took_back(self) -> int:
        """Requests the latest gateway process took back from its journal when it started (its log says)."""
        path = self.log_dir / f"gateway.{self.starts['gateway']}.log"
        found = re.search(r"took back (\d+) requests", path.read_text()) if path.exists() else None
        return int(found.group(1)) if found else 0

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.procs.clear()

    def dead(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.log_dir / f"{name}.{self.starts[name]}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


class _Tap:
    """Final answers (`Reply`, `ErrorReply`) per request id, as they cross the wire to the clients' inboxes;
    and the switch events (`plan.switch`) by kind."""

    def __init__(self) -> None:
        self.finals: Counter[str] = Counter()
        self.switch_events: Counter[str] = Counter()

    async def on_switch(self, msg) -> None:
        try:
            ev = decode(msg.data, SwitchEvent)
        except SchemaError:
            return
        self.switch_events[ev.__struct_config__.tag] += 1

    async def on(self, msg) -> None:
        try:
            answer = decode_reply(msg.data)
        except SchemaError:
            return
        if isinstance(answer, (Reply, ErrorReply)) and answer.request_id:
            self.finals[answer.request_id] += 1


def _p99(values: list[float]) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(0.99 * len(v)))] if v else math.nan


def _lengths(config: ChaosConfig, n: int) -> tuple[np.ndarray, np.ndarray]:
    """`n` (input, output) lengths drawn from the trace, of requests that fit the model's context window
    (the rest would be refused `invalid` whatever the fault, and say nothing about it)."""
    from oserve.specs import model_preset
    from oserve.traces import load_trace

    t = load_trace(config.trace)
    inp = np.asarray(t.input_tokens).astype(int)
    out = np.minimum(np.asarray(t.output_tokens), config.max_output_tokens).astype(int)
    fits = np.flatnonzero(inp + out + 16 <= model_preset(config.model).max_context_tokens)
    idx = np.random.default_rng(config.seed).choice(fits, size=n)
    return inp[idx], out[idx]


async def _wait_ready(client: OServeClient, workers: _Workers, timeout_s: float) -> None:
    """Until a gateway answers and sees a replica (the scheduler's first strategy is up)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        dead = workers.dead()
        if dead:
            raise RuntimeError(f"worker {dead[0]} exited at start:\n{workers.log_tail(dead[0])}")
        try:
            if (await client.ping(timeout_s=1.0)).num_replicas > 0:
                return
        except ClientError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"the system was not serving within {timeout_s} s")


async def _order_switch(nc, subjects: Subjects, n: int) -> bool:
    """Publish a strategy that renames the first replica of the one in force (a switch: start the new
    replica, retire the old); False when there is no strategy in force to change."""
    js = nc.jetstream()
    try:
        kv = await js.key_value(subjects.strategy_bucket())
        current = decode((await kv.get(Subjects.STRATEGY_KEY)).value or b"", StrategyChosen)
    except Exception:  # no bucket or no strategy yet
        return False
    assert isinstance(current, StrategyChosen)
    if not current.replicas:
        return False
    old = current.replicas[0].replica_id
    new = f"chaos{n}"
    replicas = [ReplicaSpec(replica_id=new, tp=r.tp, pp=r.pp, gpu_ids=list(r.gpu_ids)) if r.replica_id == old else r
                for r in current.replicas]
    weights = [{(new if k == old else k): v for k, v in w.items()} for w in current.weights]
    shares = [{(new if k == old else k): v for k, v in w.items()} for w in current.shares]
    s = StrategyChosen(strategy_id=f"{current.strategy_id}-chaos{n}", span_index=current.span_index,
                       replicas=replicas, weights=weights, shares=shares, switch_s=current.switch_s or 1.0,
                       forecast_rps=current.forecast_rps, label="chaos")
    await nc.publish(subjects.plan_event("strategy"), encode(s))
    return True


async def run_chaos(config: ChaosConfig, *, progress=None) -> dict:
    """Run every phase of `config.faults` against a fresh system; the per-fault figures (module docstring)."""
    prefix = f"chaos{uuid.uuid4().hex[:6]}"
    subjects = Subjects(prefix)
    with tempfile.TemporaryDirectory(prefix="oserve-chaos-") as tmp:
        server = NatsServer(store_dir=Path(tmp) / "js").start()
        workers = _Workers(server.url, config, prefix, Path(tmp))
        try:
            return await _run(config, server, workers, subjects, progress)
        finally:
            workers.stop_all()
            server.stop()


async def _run(config: ChaosConfig, server: NatsServer, workers: _Workers, subjects: Subjects, progress) -> dict:
    loop = asyncio.get_running_loop()
    for name in PROCESSES:
        workers.start(name)
    client = await OServeClient.connect(server.url, subjects=subjects, default_timeout_s=config.timeout_s)
    async def quiet(exc: Exception) -> None:  # the outages are on purpose: no traceback per reconnect attempt
        pass
    tap_nc = await nats.connect(server.url, max_reconnect_attempts=-1, name="chaos-tap", error_cb=quiet)
    ctl_nc = await nats.connect(server.url, max_reconnect_attempts=-1, name="chaos-control", error_cb=quiet)
    tap = _Tap()
    await tap_nc.subscribe(f"{subjects.reply_prefix()}.>", cb=tap.on)
    await tap_nc.subscribe(subjects.plan_event("switch"), cb=tap.on_switch)
    began = loop.time()
    try:
        await _wait_ready(client, workers, config.ready_timeout_wall_s)
        ready_s = loop.time() - began
        per_phase = int(config.rate_rps * config.phase_wall_s)
        inputs, outputs = _lengths(config, per_phase * (1 + len(config.faults)))
        phases = []
        normal_s = math.inf
        for k, fault in enumerate((BASELINE, *config.faults)):
            phase = await _phase(config, k, fault, server, workers, client, ctl_nc, subjects, tap,
                                 inputs[k * per_phase:(k + 1) * per_phase], outputs[k * per_phase:(k + 1) * per_phase],
                                 normal_s)
            if fault == BASELINE:
                normal_s = phase["p99_wall_s"]
            phases.append(phase)
            if progress is not None:
                progress(fault, phase)
    finally:
        with contextlib.suppress(Exception):
            await client.close()
        for c in (tap_nc, ctl_nc):
            with contextlib.suppress(Exception):
                await c.close()
    return {"config": {k: getattr(config, k) for k in ChaosConfig.__dataclass_fields__},
            "ready_wall_s": ready_s, "phases": phases,
            "totals": {k: sum(p[k] for p in phases) for k in ("sent", "answered", "answered_twice", "lost")},
            "targets": {"lost": 0, "answered_twice": 0, "errors": "only documented ErrorCodes"},
            "meets_targets": all(p["lost"] == 0 and p["answered_twice"] == 0
                                 and set(p["errors"]) <= DOCUMENTED_CODES for p in phases)}


async def _phase(config: ChaosConfig, k: int, fault: str, server: NatsServer, workers: _Workers,
                 client: OServeClient, ctl_nc, subjects: Subjects, tap: _Tap, inputs, outputs, normal_s: float) -> dict:
    loop = asyncio.get_running_loop()
    sent: dict[str, _Sent] = {}
    before_dupes = client.num_duplicates
    before_statuses = client.num_late_statuses
    events_before = Counter(tap.switch_events)
    t0 = loop.time()

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, t0 + i / config.rate_rps - loop.time()))
        rid = f"p{k}-{i}"
        rec = sent[rid] = _Sent(loop.time() - t0)
        try:
            await _submit(rec, rid, i)
        finally:
            rec.took_wall_s = loop.time() - t0 - rec.at_wall_s

    async def _submit(rec: _Sent, rid: str, i: int) -> None:
        try:
            r = await client.submit(input_tokens=int(inputs[i]), max_tokens=int(outputs[i]) + 16,
                                    sim_output_tokens=max(1, int(outputs[i])), request_id=rid,
                                    timeout_s=config.timeout_s)
            rec.outcome, rec.e2e_s = "ok", r.e2e_s
        except RequestRejected as exc:
            rec.outcome, rec.message = exc.code, exc.message
        except ClientError as exc:
            rec.outcome, rec.message = getattr(exc, "code", "client_error"), str(exc)
        except Exception as exc:  # noqa: BLE001 (counted, never ends the bench)
            rec.outcome = f"exception:{type(exc).__name__}"

    async def inject() -> float:
        await asyncio.sleep(config.fault_at_wall_s)
        at = loop.time() - t0
        if fault == BASELINE:
            pass
        elif fault in PROCESSES or fault == "gateway+engines":
            names = fault.split("+")
            for name in names:
                workers.kill(name)
            await asyncio.sleep(config.down_wall_s)
            for name in names:
                workers.start(name)
        elif fault == "burst":
            burst_task.append(asyncio.create_task(_burst(config, client, k)))
        elif fault == "switch-half":
            planned = asyncio.Event()

            async def on_switch(msg) -> None:
                with contextlib.suppress(SchemaError):
                    if isinstance(decode(msg.data, SwitchPlanned), SwitchPlanned):
                        planned.set()
            sub = await ctl_nc.subscribe(subjects.plan_event("switch"), cb=on_switch)
            if await _order_switch(ctl_nc, subjects, k):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(planned.wait(), 5.0)
            await sub.unsubscribe()
            at = loop.time() - t0
            workers.kill("engines")
            await asyncio.sleep(config.down_wall_s)
            workers.start("engines")
        else:
            server._proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
            server._proc.wait(10)  # type: ignore[union-attr]
            await asyncio.sleep(config.nats_short_wall_s if fault == "nats-short" else config.nats_long_wall_s)
            await asyncio.to_thread(server.restart)
        return at

    n = len(inputs)
    burst_task: list[asyncio.Task] = []
    fault_task = asyncio.create_task(inject())
    await asyncio.gather(*(one(i) for i in range(n)))
    fault_at_s = await fault_task
    burst = await burst_task[0] if burst_task else None
    await asyncio.sleep(config.settle_wall_s)
    outcomes = Counter(r.outcome for r in sent.values())
    errors = {code: c for code, c in sorted(outcomes.items()) if code != "ok"}
    no_answer = {"timeout", "connection_lost", "no_gateway", "cannot_connect", "client_error"}
    lost = sum(c for code, c in errors.items() if code in no_answer or code.startswith("exception:"))
    twice_wire = sum(1 for rid in sent if tap.finals.get(rid, 0) > 1)
    # disrupted: sent after the fault and failed, or answered much later than in the phase without a fault
    slow_s = max(2 * normal_s, normal_s + 1.0)
    failed_after = [r.at_wall_s for r in sent.values() if r.at_wall_s >= fault_at_s
                    and (r.outcome != "ok" or r.took_wall_s > slow_s)]
    e2e = [r.e2e_s for r in sent.values() if r.outcome == "ok"]
    examples: dict[str, str] = {}
    for r in sent.values():
        if r.outcome != "ok":
            examples.setdefault(r.outcome, r.message[:200])
    return {"fault": fault, "sent": len(sent), "answered": outcomes.get("ok", 0), "errors": errors,
            "lost": lost, "answered_twice": max(twice_wire, client.num_duplicates - before_dupes),
            "answered_twice_wire": twice_wire, "client_duplicates": client.num_duplicates - before_dupes,
            "client_late_no_responders": client.num_late_statuses - before_statuses,
            "recovery_s": max(failed_after) - fault_at_s if failed_after else 0.0,
            "disrupted": len(failed_after), "p99_wall_s": _p99([r.took_wall_s for r in sent.values()
                                                                 if r.outcome == "ok"]),
            "p99_s": _p99(e2e),
            "fault_at_s": fault_at_s, "error_examples": examples,
            "switch_events": dict(tap.switch_events - events_before),
            "gateway_took_back": workers.gateway_took_back() if "gateway" in fault.split("+") else 0,
            **({"burst": burst} if burst is not None else {})}


async def _burst(config: ChaosConfig, client: OServeClient, k: int) -> dict:
    """`burst_requests` long requests at once; what became of them, by outcome."""
    loop = asyncio.get_running_loop()
    outcomes: Counter[str] = Counter()
    took: list[float] = []

    async def one(i: int) -> None:
        began = loop.time()
        try:
            await client.submit(input_tokens=2000, max_tokens=config.max_output_tokens,
                                sim_output_tokens=config.max_output_tokens, request_id=f"burst{k}-{i}",
                                timeout_s=config.burst_timeout_s)
            outcomes["ok"] += 1
        except RequestRejected as exc:
            outcomes[exc.code] += 1
        except ClientError as exc:
            outcomes[getattr(exc, "code", "client_error")] += 1
        took.append(loop.time() - began)
    began = loop.time()
    await asyncio.gather(*(one(i) for i in range(config.burst_requests)))
    return {"sent": config.burst_requests, "outcomes": dict(sorted(outcomes.items())),
            "all_ended_wall_s": loop.time() - began, "p99_wall_s": _p99(took)}

