"""The switch-planner worker: strategy -> transfer plan -> replica commands -> router flip, as a transaction.

For each new strategy that starts or retires a replica it plans the switch with the core switch
planner (`oserve.switch.plan_switch`: which weight bytes each new replica's GPUs need and which GPU
sends them) and publishes the plan's size in `SwitchPlanned`; then it starts the new replicas, waits until all report ready, flips the
router (`AssignmentSet`) and drains the retired ones. If the new replicas are not ready in time, or one
reports `ReplicaFailed`, it drains them again and publishes `SwitchRolledBack` with the reason, the old
deployment serving throughout. A strategy that keeps the same replicas only re-routes: the assignment goes
out and no switch event does, so a telemetry consumer counts switches by counting `SwitchPlanned`.

With simulated engines (`live_transfer` off) a new replica takes the plan's modelled time. With real ones
the transfer is live: the plan becomes a wire plan (`oserve.switch.wire`) whose jobs this worker serves
from a rendezvous store for the switch's length; the serving replicas that hold bytes get `SendWeights`,
the new ones `StartReplica.weights`, and a new replica is ready only once every byte it received matched
its sender's checksum and is in force (`WeightsReceived`; totals in `SwitchCompleted`). The retired
replicas drain for `migrate_after_wall_s`, then hand what still runs to the new ones.

Between switches it keeps the deployment in force alive: a replica of it silent (no heartbeat) for
`restart_after_wall_s` — its engine host was killed and restarted empty, or lost the replica — is
started again on its host (`StartReplica`, a reload: `ENGINE_START_S` of clock time), at most once per
`restart_after_wall_s`, and each such restart is published as `ReplicaRestarted`.

Acknowledged control: every command carries an id and asks its host for a `CommandAck` on this worker's own
acknowledgement subject (`Subjects.control_ack`); one not acknowledged within `command_ack_wall_s` is sent
again with the same id (the host runs an id once), `command_attempts` times at most, and commands to several
replicas go out together. Switch and assignment events are published through an `EventPublisher`: with the
plans stream there, each is acknowledged by JetStream (its `PubAck`) and published again until it is.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.kv import KeyValue
from opentelemetry.trace import SpanKind, Tracer

from oserve.defaults import ENGINE_START_S, GPUS_PER_NODE
from oserve.errors import ConfigError, OServeError
from oserve.observability.metrics import Metrics
from oserve.observability.tracing import extract, inject, messaging_attributes, messaging_span_name
from oserve.specs import ClusterSpec, Deployment, ModelSpec, Replica, ReplicaShape
from oserve.streams.jetstream import EventPublisher
from oserve.streams.schemas import (AssignmentSet, CommandAck, DrainReplica, Heartbeat, ReplicaDrained, ReplicaEvent,
                                    ReplicaFailed, ReplicaReady, ReplicaRestarted, ReplicaSpec, SendWeights,
                                    StartReplica, StrategyChosen, SwitchCompleted, SwitchPlanned, SwitchRolledBack,
                                    WeightSession, WeightsReceived, WeightsSent, encode)
from oserve.streams.subjects import Subjects
from oserve.switch import SwitchConfig, SwitchPlan, plan_switch
from oserve.switch.wire import wire_plan
from oserve.workers.base import Worker
from oserve.workers.clock import Clock

log = logging.getLogger(__name__)
MSG_ID = "Nats-Msg-Id"


def deployment_of(specs: list[ReplicaSpec] | tuple[ReplicaSpec, ...]) -> Deployment:
    """The core form of replica specs. Pure."""
    return Deployment(tuple(Replica(r.replica_id, ReplicaShape(r.tp, r.pp), tuple(r.gpu_ids)) for r in specs))


@dataclass(frozen=True, slots=True)
class SwitchPlannerConfig:
    subjects: Subjects = field(default_factory=Subjects)
    host_ids: tuple[str, ...] = ("local",)
    """Engine hosts; a replica goes to the host of its first GPU's node (node % number of hosts)."""
    gpus_per_node: int = GPUS_PER_NODE
    ready_slack_wall_s: float = 5.0
    """Wall seconds allowed beyond the modelled switch time before a switch is rolled back."""
    restart_after_wall_s: float = 3.0
    """A serving replica silent this long (wall seconds; longer than a gateway waits before declaring it
    dead) is started again on its host; 0 turns this off."""
    restart_ready_after_s: float = ENGINE_START_S
    """The modelled time (clock seconds) a restarted replica takes to come up."""
    live_transfer: bool = False
    """Real engines (the `vllm` backend): a new replica starts without weights and receives its shards from the
    serving replicas that hold them (`oserve.switch.wire`, `oserve.switch.transport`), verified before it
    serves. False: engines model the transfer (`StartReplica.ready_after_s`)."""
    rendezvous_host: str = "127.0.0.1"
    """The address this worker serves a live switch's rendezvous store on (engine hosts connect to it)."""
    transfer_timeout_s: float = 600.0
    """Deadline of every wait inside a live transfer (a peer's arrival, one op)."""
    chunk_bytes: int = 64 * 1024 * 1024
    """Largest message of a live transfer (`wire_plan`)."""
    migrate_after_wall_s: float | None = None
    """A retiring replica finishes its requests in place for this long (wall seconds), then hands what still
    runs over to the new replicas with what it generated (`DrainReplica.migrate_after_s`); None: it finishes
    everything in place."""
    command_ack_wall_s: float = 2.0
    """Wall seconds a command (`StartReplica`, `DrainReplica`, `SendWeights`) waits for its host's `CommandAck`
    before it is sent again, with the same id (the host runs it once)."""
    command_attempts: int = 3
    """Sends of one command before it is given up as unacknowledged (logged and counted; the switch's ready
    timeout rolls it back, the restart loop starts a silent replica again)."""

    def __post_init__(self) -> None:
        if not self.host_ids or self.gpus_per_node < 1 or self.ready_slack_wall_s <= 0:
            raise ConfigError(f"SwitchPlannerConfig: invalid values {self}")
        if not self.transfer_timeout_s > 0 or self.chunk_bytes < 1 or not (self.migrate_after_wall_s is None
                                                                             or self.migrate_after_wall_s >= 0):
            raise ConfigError(f"SwitchPlannerConfig: transfer_timeout_s > 0, chunk_bytes >= 1 and migrate_after_wall_s "
                              f">= 0 (or None) required, got {self.transfer_timeout_s}, {self.chunk_bytes}, "
                              f"{self.migrate_after_wall_s}")
        if not self.command_ack_wall_s > 0 or self.command_attempts < 1:
            raise ConfigError(f"SwitchPlannerConfig: command_ack_wall_s > 0 and command_attempts >= 1 required, got "
                              f"{self.command_ack_wall_s}, {self.command_attempts}")
        if not self.restart_after_wall_s >= 0 or not self.restart_ready_after_s >= 0:
            raise ConfigError(f"SwitchPlannerConfig: restart_after_wall_s and restart_ready_after_s must be >= 0, "
                              f"got {self.restart_after_wall_s}, {self.restart_ready_after_s}")


class SwitchPlannerWorker(Worker):
    """Strategy events -> replica commands -> router flip, as a transaction (see the module docstring)."""

    name = "switch-planner"

    def __init__(self, nc: NATS, config: SwitchPlannerConfig, clock: Clock, *, tracer: Tracer | None = None,
                 kv: KeyValue | None = None, model: ModelSpec | None = None, cluster: ClusterSpec | None = None,
                 metrics: Metrics | None = None, served_model: ModelSpec | None = None,
                 events: EventPublisher | None = None) -> None:
        super().__init__()
        self.nc, self.config, self.clock, self.tracer, self.kv = nc, config, clock, tracer, kv
        self.publisher = events or EventPublisher(nc, None)
        """Switch and assignment events go out through it: acknowledged by the plans stream where there is one."""
        self._commander = uuid.uuid4().hex[:16]  # this worker's acknowledgement subjects (`Subjects.control_ack`)
        self._command_seq = itertools.count(1)
        self._acks: dict[str, asyncio.Future] = {}  # command id -> its acknowledgement, while awaited
        self.num_commands = 0
        self.num_command_resends = 0
        """Commands sent again because no acknowledgement came in time."""
        self.num_unacked_commands = 0
        """Commands no send of which was acknowledged."""
        self._unacked_drains: dict[str, tuple[str, DrainReplica]] = {}  # replica_id -> (host, command) to resend
        self._control = asyncio.Lock()  # a switch and the restart loop's commands never interleave
        self._last_strategy_id = ""  # the strategy handled last: the same one heard again is not run again
        self.metrics = metrics
        """The deployment serving, switches by outcome and their wall time (None: no metrics)."""
        self.model, self.cluster = model, cluster
        """The model and cluster the transfer plans are made for (no plan without them)."""
        self.served_model = served_model
        """The model the engines really serve, whose weights a live switch moves (None: `model`)."""
        self._switching_to: str | None = None  # the strategy id of the switch in progress
        self._failed: dict[str, str] = {}  # replica_id -> why it could not start, for the switch in progress
        self._received: dict[str, WeightsReceived] = {}  # replica_id -> its transfer, for the switch in progress
        self.current: dict[str, ReplicaSpec] = {}  # replica_id -> spec, of the serving deployment
        self.strategy_id = ""
        self._queue: asyncio.Queue[tuple[StrategyChosen, dict | None]] = asyncio.Queue()
        self._ready: set[str] = set()
        self._ready_changed = asyncio.Event()
        self.events: list[str] = []  # switch event tags in order, for views and tests
        self._heard_wall_s: dict[str, float] = {}  # replica_id -> loop time of its last heartbeat
        self._restarted_wall_s: dict[str, float] = {}  # replica_id -> loop time it was last started again
        self._switching = False
        self.num_restarts = 0

    async def _subscribe(self) -> list:
        s = self.config.subjects
        return [await self.nc.subscribe(s.plan_event("strategy"), cb=self.typed(StrategyChosen, self._on_strategy)),
                await self.nc.subscribe(s.plan_event("replica"), cb=self.typed(ReplicaEvent, self._on_replica)),
                await self.nc.subscribe(s.heartbeats(), cb=self.typed(Heartbeat, self._on_heartbeat)),
                await self.nc.subscribe(s.control_acks(self._commander), cb=self.typed(CommandAck, self._on_ack))]

    async def _on_ack(self, ack: CommandAck, msg: Msg) -> None:
        waiting = self._acks.get(ack.command_id)
        if waiting is not None and not waiting.done():
            waiting.set_result(ack)

    def _loops(self):
        return [self._switch_loop] + ([self._restart_loop] if self.config.restart_after_wall_s > 0 else [])

    async def _on_heartbeat(self, hb: Heartbeat, msg: Msg) -> None:
        self._heard_wall_s[hb.replica_id] = asyncio.get_running_loop().time()

    async def _restart_loop(self) -> None:
        """Start again every replica of the deployment in force that fell silent (see the module docstring)."""
        loop = asyncio.get_running_loop()
        after = self.config.restart_after_wall_s
        began = loop.time()
        cut_off = False
        while True:
            await asyncio.sleep(min(1.0, after / 3))
            now = loop.time()
            if not self.nc.is_connected:
                cut_off = True  # every replica looks silent meanwhile: nothing to judge by
                continue
            if cut_off:  # back: every replica gets a fresh timeout, as in the gateway
                cut_off = False
                self._heard_wall_s = {rid: now for rid in self._heard_wall_s}
                began = now
                continue
            if self._switching:
                continue  # a switch starts and drains replicas itself
            async with self._control:
                if self._switching:
                    continue
                silent = [(rid, spec, self._heard_wall_s.get(rid, began)) for rid, spec in list(self.current.items())
                          if now - max(self._heard_wall_s.get(rid, began),
                                       self._restarted_wall_s.get(rid, began)) > after]
                drains = [(rid, host, cmd) for rid, (host, cmd) in list(self._unacked_drains.items())
                          if rid not in self.current]
                # together: a host still coming back acknowledges late, and one replica's wait is not the next's
                await asyncio.gather(*(self._restart(rid, spec, heard, now) for rid, spec, heard in silent),
                                     *(self._command(rid, cmd, None, host=host) for rid, host, cmd in drains))

    async def _restart(self, rid: str, spec: ReplicaSpec, heard: float, now: float) -> None:
        """Start a silent replica again; its next restart is judged from when its host acknowledged this one."""
        self._restarted_wall_s[rid] = now
        self._ready.discard(rid)
        self.num_restarts += 1
        log.warning("switch planner: replica %s silent for %.1f s; starting it again", rid, now - heard)
        await self._command(spec, StartReplica(strategy_id=self.strategy_id, replica=spec,
                                               ready_after_s=self.config.restart_ready_after_s), None)
        self._restarted_wall_s[rid] = asyncio.get_running_loop().time()
        await self._publish_switch(ReplicaRestarted(strategy_id=self.strategy_id, replica_id=rid,
                                                    silent_wall_s=now - heard), None)

    async def _on_strategy(self, s: StrategyChosen, msg: Msg) -> None:
        self._queue.put_nowait((s, msg.headers))

    async def _on_replica(self, ev: ReplicaEvent, msg: Msg) -> None:
        if isinstance(ev, ReplicaReady):
            self._ready.add(ev.replica_id)
        elif isinstance(ev, ReplicaDrained):
            self._ready.discard(ev.replica_id)
        elif ev.strategy_id != self._switching_to:
            pass  # news of an earlier switch, or of a restart: not the switch in progress
        elif isinstance(ev, ReplicaFailed):
            self._failed[ev.replica_id] = ev.reason
        elif isinstance(ev, WeightsReceived):
            self._received[ev.replica_id] = ev
        elif isinstance(ev, WeightsSent) and not ev.verified:  # a source failed: its targets cannot complete
            self._failed[f"{ev.replica_id} (sending)"] = ev.error or "sending failed"
        self._ready_changed.set()

    def host_of(self, spec: ReplicaSpec) -> str:
        node = spec.gpu_ids[0] // self.config.gpus_per_node if spec.gpu_ids else 0
        return self.config.host_ids[node % len(self.config.host_ids)]

    async def _switch_loop(self) -> None:
        while True:
            s, headers = await self._queue.get()
            while not self._queue.empty():  # only the latest strategy matters
                s, headers = self._queue.get_nowait()
            if s.strategy_id == self._last_strategy_id:
                continue  # heard again (an event published once more after a late acknowledgement): done already
            self._last_strategy_id = s.strategy_id
            try:
                self._switching = True
                async with self._control:
                    await self.switch(s, headers)
            except Exception:  # outermost: report and keep the old deployment
                log.exception("switch planner: switch to %s failed", s.strategy_id)
                await self._publish_switch(SwitchRolledBack(strategy_id=s.strategy_id, reason="internal error"), None)
                if self.metrics is not None:
                    self.metrics.switches.labels("rolled_back").inc()
            finally:
                self._switching = False
                now = asyncio.get_running_loop().time()
                for rid in self.current:  # a replica the switch just started gets a full timeout
                    self._heard_wall_s.setdefault(rid, now)

    async def _publish_switch(self, ev, headers) -> None:
        tag = ev.__struct_config__.tag
        self.events.append(tag)
        out = dict(headers) if headers else {}
        out[MSG_ID] = f"{ev.strategy_id}:{tag}:{len(self.events)}"
        await self.publisher.publish(self.config.subjects.plan_event("switch"), encode(ev), out)

    def transfer_plan(self, s: StrategyChosen) -> SwitchPlan | None:
        """The core switch planner's plan from the serving deployment to the strategy's (None without a
        model and cluster, or when the plan cannot be made: the switch then goes on as modelled, or, live,
        the new replicas load their weights themselves). A live switch's plan keeps the strategy's placement
        (no relabelling of GPUs: the engines start where the strategy puts them)."""
        model = self.served_model or self.model
        if model is None or self.cluster is None or not self.current:
            return None  # no model to plan for, or nothing to copy from (the first load is from disk)
        try:
            return plan_switch(model, self.cluster, deployment_of(list(self.current.values())),
                               deployment_of(s.replicas), planner="improved",
                               config=SwitchConfig(remap=not self.config.live_transfer))
        except OServeError as exc:
            log.warning("switch planner: no transfer plan for %s: %s", s.strategy_id, exc)
            return None

    def _live_session(self, s: StrategyChosen, plan: SwitchPlan, start: list[ReplicaSpec]):
        """The rendezvous of a live switch: its store (served here), each endpoint's job in it, and the
        `WeightSession` of each new replica and of each serving replica that sends. None when the plan cannot
        be made into one (the new replicas then load their weights themselves), said in a warning."""
        from oserve.switch.transport import SessionStore

        model = self.served_model or self.model
        assert model is not None
        try:
            wire = wire_plan(model, plan, chunk_bytes=self.config.chunk_bytes,
                             starting=frozenset(r.replica_id for r in start))
        except OServeError as exc:
            log.warning("switch planner: no live transfer for %s (%s); the new replicas load their weights", s.strategy_id,
                        exc)
            return None
        session = SessionStore(f"{s.strategy_id}-{len(self.events)}".replace("/", "_")[:100],
                               host=self.config.rendezvous_host, timeout_s=self.config.transfer_timeout_s)
        jobs = {k: wire.job(k) for k in wire.endpoints}
        session.put_jobs(jobs)
        rv = session.rendezvous

        def weights(rid: str, sending: bool) -> WeightSession:
            keys = list(wire.endpoints_of(rid))
            num = sum(jobs[k].send_bytes if sending else jobs[k].receive_bytes for k in keys)
            return WeightSession(session_id=rv.session_id, host=rv.host, port=rv.port, timeout_s=rv.timeout_s,
                                 endpoints=keys, num_bytes=num)
        senders = sorted({wire.endpoints[op.src].replica_id for op in wire.ops
                          if wire.endpoints[op.src].side == "source"})
        return session, {r.replica_id: weights(r.replica_id, False) for r in start}, \
            {rid: weights(rid, True) for rid in senders}

    async def _command(self, spec_or_id, cmd, headers, *, host: str | None = None) -> bool:
        """Send a command to its replica's host and wait for the host's acknowledgement, sending it again (the
        same id: run once) while none comes, `command_attempts` times at most; True once acknowledged. Never
        raises (the commands of a switch go out together): an error is logged and counted as unacknowledged. A
        `DrainReplica` no send of which was acknowledged is kept and sent again by the restart loop, so a
        retired replica does not go on holding GPUs the next deployment may use."""
        if host is None:
            host = self.host_of(spec_or_id) if isinstance(spec_or_id, ReplicaSpec) else \
                self.host_of(self.current.get(spec_or_id, ReplicaSpec(replica_id=spec_or_id, tp=1, pp=1, gpu_ids=[])))
        try:
            acked = await self._send_command(spec_or_id, cmd, headers, host)
        except Exception:  # a bug, not a lost message: reported, and the switch goes on to its own checks
            log.exception("switch planner: %s to host %s failed", type(cmd).__name__, host)
            self.num_unacked_commands += 1
            acked = False
        if isinstance(cmd, DrainReplica):
            if acked:
                self._unacked_drains.pop(cmd.replica_id, None)
            else:
                self._unacked_drains[cmd.replica_id] = (host, cmd)
        elif isinstance(cmd, StartReplica) and acked:  # the id serves again: an old drain of it is void
            self._unacked_drains.pop(cmd.replica.replica_id, None)
        return acked

    async def _send_command(self, spec_or_id, cmd, headers, host: str) -> bool:
        n = next(self._command_seq)
        cid = f"{self._commander}-{n}"
        data = encode(msgspec.structs.replace(cmd, command_id=cid))
        reply = self.config.subjects.control_ack(self._commander, n)
        waiting = self._acks[cid] = asyncio.get_running_loop().create_future()
        self.num_commands += 1
        try:
            for attempt in range(self.config.command_attempts):
                if attempt:
                    self.num_command_resends += 1
                    log.warning("switch planner: %s for %s not acknowledged by host %s in %.1f s; sending it again",
                                type(cmd).__name__, spec_or_id if isinstance(spec_or_id, str) else spec_or_id.replica_id,
                                host, self.config.command_ack_wall_s)
                try:
                    await self.nc.publish(self.config.subjects.host_control(host), data, reply=reply,
                                          headers=dict(headers) if headers else None)
                    await asyncio.wait_for(asyncio.shield(waiting), self.config.command_ack_wall_s)
                    return True
                except (TimeoutError, nats.errors.Error, OSError):
                    continue
            self.num_unacked_commands += 1
            log.warning("switch planner: host %s acknowledged no send of %s (%d tries); the switch's timeout and "
                        "the restart loop take over", host, type(cmd).__name__, self.config.command_attempts)
            return False
        finally:
            self._acks.pop(cid, None)

    async def _flip(self, s: StrategyChosen, headers) -> None:
        """Point the routers at the strategy's assignment (and record it for routers that start later)."""
        assignment = encode(AssignmentSet(strategy_id=s.strategy_id, weights=s.weights, shares=s.shares))
        if self.kv is not None:
            await self.kv.put(Subjects.ASSIGNMENT_KEY, assignment)
        await self.publisher.publish(self.config.subjects.plan_event("assignment"), assignment, headers)

    async def switch(self, s: StrategyChosen, headers=None) -> bool:
        """Carry out one strategy; True when it is serving, False when rolled back."""
        span = None
        if self.tracer is not None:
            subject = self.config.subjects.plan_event("strategy")
            span = self.tracer.start_span(messaging_span_name("process", subject), context=extract(headers),
                                          kind=SpanKind.CONSUMER,
                                          attributes={"oserve.step": "switch.execute", "oserve.strategy_id": s.strategy_id,
                                                      **messaging_attributes(subject, "process", "process",
                                                                             message_id=s.strategy_id)})
        hdr = inject(span) if span is not None else None
        started = time.monotonic()
        session = None  # a live transfer's rendezvous store, while the switch runs
        try:
            target = {r.replica_id: r for r in s.replicas}
            start = [r for rid, r in target.items() if rid not in self.current]
            retire = [rid for rid in self.current if rid not in target]
            if not start and not retire:  # the same replicas, re-routed: no switch, so no switch event
                await self._flip(s, hdr)
                self.strategy_id = s.strategy_id
                return True
            plan = await asyncio.to_thread(self.transfer_plan, s) if start else None
            await self._publish_switch(SwitchPlanned(
                strategy_id=s.strategy_id, start_ids=[r.replica_id for r in start], retire_ids=retire,
                switch_s=s.switch_s, num_transfers=len(plan.transfers) if plan else 0,
                transfer_bytes=(plan.nvlink_bytes + plan.network_bytes + plan.local_bytes) if plan else 0,
                modelled_transfer_s=plan.switch_seconds if plan else 0.0), hdr)
            if start:
                self._switching_to = s.strategy_id
                self._failed.clear()
                self._received.clear()
                for r in start:  # a replica started (again) is ready when it says so, not by an earlier report
                    self._ready.discard(r.replica_id)
                sessions = (await asyncio.to_thread(self._live_session, s, plan, start)
                            if self.config.live_transfer and plan else None)
                if sessions is not None:
                    session, weights_of, sources = sessions
                    # the serving replicas send while they go on serving (commands to several hosts go out
                    # together, each sent again until its host acknowledges it)
                    await asyncio.gather(*(self._command(rid, SendWeights(strategy_id=s.strategy_id, replica_id=rid,
                                                                          weights=w), hdr)
                                           for rid, w in sources.items()))
                else:
                    weights_of = {}
                await asyncio.gather(*(self._command(r, StartReplica(strategy_id=s.strategy_id, replica=r,
                                                                     ready_after_s=s.switch_s,
                                                                     weights=weights_of.get(r.replica_id)), hdr)
                                       for r in start))
                need = {r.replica_id for r in start}
                timeout = self.clock.to_wall_s(s.switch_s) + self.config.ready_slack_wall_s

                async def all_ready() -> None:
                    while not need <= self._ready and not self._failed:
                        self._ready_changed.clear()
                        await self._ready_changed.wait()
                try:
                    await asyncio.wait_for(all_ready(), timeout)
                except TimeoutError:
                    pass
                if not need <= self._ready:
                    if session is not None:
                        session.abort("rolled back")
                    # roll back: the old deployment never stopped serving
                    await asyncio.gather(*(self._command(r, DrainReplica(strategy_id=s.strategy_id,
                                                                         replica_id=r.replica_id), hdr)
                                           for r in start))
                    reason = ("; ".join(f"{rid}: {why}" for rid, why in sorted(self._failed.items())) if self._failed
                              else f"replicas not ready after {timeout:.1f} s: {sorted(need - self._ready)}")
                    await self._publish_switch(SwitchRolledBack(strategy_id=s.strategy_id, reason=reason), hdr)
                    if self.metrics is not None:
                        self.metrics.switch_done("rolled_back", time.monotonic() - started)
                    return False
            # every new replica serves: flip the router, then retire the old ones
            await self._flip(s, hdr)
            await asyncio.gather(*(self._command(rid, DrainReplica(strategy_id=s.strategy_id, replica_id=rid,
                                                                   migrate_after_s=self.config.migrate_after_wall_s),
                                                 hdr)
                                   for rid in retire))
            self.current = target
            self.strategy_id = s.strategy_id
            took_wall_s = time.monotonic() - started
            got = [self._received[r.replica_id] for r in start if r.replica_id in self._received]
            await self._publish_switch(SwitchCompleted(
                strategy_id=s.strategy_id, switch_wall_s=took_wall_s, moved_bytes=sum(e.num_bytes for e in got),
                engine_start_wall_s=max((e.engine_start_wall_s for e in got), default=0.0),
                transfer_wall_s=max((e.transfer_wall_s for e in got), default=0.0),
                install_wall_s=max((e.install_wall_s for e in got), default=0.0)), hdr)
            if self.metrics is not None:
                self.metrics.switch_done("completed", took_wall_s)
                self.metrics.deployment_serving((r.tp, r.pp) for r in target.values())
            return True
        finally:
            self._switching_to = None
            if session is not None:
                session.close()
            if span is not None:
                span.end()
