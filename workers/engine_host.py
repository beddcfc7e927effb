"""The engine host: the engine workers of one host, started and drained on the switch planner's command.

A `StartReplica` brings a replica up after the modelled weight transfer (`ready_after_s` on the
clock; with the `vllm` backend, after its real engine has started and loaded its weights instead) and
reports `ReplicaReady` (one already serving is only reported; one whose worker stopped on a
failure is started anew, which is how the switch planner's restart of a silent replica reaches it); a `DrainReplica` finishes its requests, releases it and reports
`ReplicaDrained` (a vLLM engine is then shut down, its memory freed). A drain that arrives while the
replica is still starting cancels the start.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field, replace

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from opentelemetry.trace import Tracer

from oserve.defaults import GPUS_PER_NODE
from oserve.errors import ConfigError
from oserve.observability.metrics import Metrics
from oserve.streams.jetstream import EventPublisher
from oserve.streams.schemas import (CommandAck, DrainReplica, HostCommand, ReplicaDrained, ReplicaFailed, ReplicaReady,
                                    SendWeights, StartReplica, WeightsReceived, WeightsSent, encode)
from oserve.switch.wire import Rendezvous
from oserve.streams.subjects import Subjects
from oserve.workers.backends import SimBackendConfig
from oserve.workers.base import Worker
from oserve.workers.clock import Clock
from oserve.workers.engine import EngineWorker, EngineWorkerConfig
from oserve.workers.vllm_backend import VllmBackend, VllmBackendConfig, preload

log = logging.getLogger(__name__)
SEND_REPORT_WAIT_WALL_S = 5.0
"""A replica retired by the switch it sent weights for is stopped once its part is reported (`WeightsSent`),
or after this long: the new replicas verified every byte before the switch retired it, so only the report is
left (its ranks are polled once a second)."""
COMMAND_IDS_KEPT = 4096
"""Acknowledged command ids a host remembers, so a command sent again is not run twice."""
RETIRE_WAIT_WALL_S = 60.0
"""A start of a replica id whose earlier engine is still draining waits for it, this long at most (its drain
times out after `EngineWorkerConfig.drain_timeout_wall_s`, 30 s, then its engine stops)."""


@dataclass(frozen=True, slots=True)
class EngineHostConfig:
    host_id: str = "local"
    subjects: Subjects = field(default_factory=Subjects)
    model: str = "llama2-7b"
    gpu: str = "h100-80gb"
    gpus_per_node: int = GPUS_PER_NODE
    backend: str = "sim"
    """`sim`, `echo` or `vllm` (see `EngineWorkerConfig.backend`)."""
    vllm: VllmBackendConfig = field(default_factory=VllmBackendConfig)
    """The `vllm` backend's engine (model folder, context, memory); each replica's TP and PP come from its
    `StartReplica`."""
    heartbeat_interval_wall_s: float = 0.5
    fence_after_wall_s: float = 1.5
    """`EngineWorkerConfig.fence_after_wall_s` of every engine it starts."""
    transfer_host: str = "127.0.0.1"
    """The address this host's engine processes take part in a live switch's transfers on (gloo binds its
    sockets to it; the other hosts' engines connect to it): this host's address on the cluster network."""

    def __post_init__(self) -> None:
        self.subjects.host_control(self.host_id)  # validates the id as a subject token
        if self.backend not in ("sim", "echo", "vllm") or self.heartbeat_interval_wall_s <= 0 or self.gpus_per_node < 1:
            raise ConfigError(f"EngineHostConfig: invalid values {self}")


class EngineHost(Worker):
    """Engine workers of one host, started and drained on command."""

    name = "engine-host"

    def __init__(self, nc: NATS, config: EngineHostConfig, clock: Clock, *, tracer: Tracer | None = None,
                 metrics: Metrics | None = None, events: EventPublisher | None = None) -> None:
        super().__init__()
        self.nc, self.config, self.clock, self.tracer = nc, config, clock, tracer
        self.events = events or EventPublisher(nc, None)
        """Replica events go out through it: acknowledged by the plans stream where there is one."""
        self._command_ids: collections.OrderedDict[str, None] = collections.OrderedDict()  # acknowledged ones
        self.num_duplicate_commands = 0
        """Commands sent again with an id this host had (acknowledged again, not run twice)."""
        self.metrics = metrics
        """Handed to every engine it starts (None: no metrics)."""
        self.engines: dict[str, EngineWorker] = {}
        self._retiring: dict[str, EngineWorker] = {}  # replica_id -> engine being drained on command
        self._starting: set[str] = set()
        self._cancelled_starts: set[str] = set()  # replica ids drained while starting; honoured after the sleep
        self._sending: dict[str, asyncio.Task] = {}  # replica_id -> its `SendWeights` in progress
        self._queue: asyncio.Queue[tuple[StartReplica | DrainReplica, dict | None]] = asyncio.Queue()

    async def start(self) -> None:
        if self.config.backend == "vllm" and self._state == "new":
            preload()  # vLLM imported on this thread before any engine is built on another (see `preload`)
        await super().start()

    async def _subscribe(self) -> list:
        subject = self.config.subjects.host_control(self.config.host_id)
        return [await self.nc.subscribe(subject, cb=self.typed(HostCommand, self._on_command))]

    def _loops(self):
        return [self._command_loop]

    async def _on_command(self, cmd: HostCommand, msg: Msg) -> None:
        cid = cmd.command_id
        duplicate = bool(cid) and cid in self._command_ids
        if duplicate:
            self.num_duplicate_commands += 1
        else:
            self._queue.put_nowait((cmd, msg.headers))  # type: ignore[arg-type]
            if cid:
                self._command_ids[cid] = None
                while len(self._command_ids) > COMMAND_IDS_KEPT:
                    self._command_ids.popitem(last=False)
        # acknowledged only on an acknowledgement subject: a command's reply is never published anywhere else
        if cid and msg.reply and self.config.subjects.is_control_ack(msg.reply):
            await self.nc.publish(msg.reply, encode(CommandAck(host_id=self.config.host_id, command_id=cid,
                                                               duplicate=duplicate)))

    async def _command_loop(self) -> None:
        async with asyncio.TaskGroup() as tg:
            while True:
                cmd, headers = await self._queue.get()
                tg.create_task(self._run(cmd, headers))

    async def _run(self, cmd, headers) -> None:
        try:
            if isinstance(cmd, StartReplica):
                await self._start_replica(cmd, headers)
            elif isinstance(cmd, SendWeights):
                await self._send_weights(cmd, headers)
            else:
                await self._drain_replica(cmd, headers)
        except Exception as exc:  # outermost for one command: the switch planner rolls back
            log.exception("%s: command %s failed", self.config.host_id, cmd)
            if isinstance(cmd, StartReplica):
                await self._publish(ReplicaFailed(strategy_id=cmd.strategy_id, replica_id=cmd.replica.replica_id,
                                                  reason=f"{type(exc).__name__}: {exc}"), headers)

    async def _publish(self, event, headers) -> None:
        await self.events.publish(self.config.subjects.plan_event("replica"), encode(event), headers)

    async def _receive_weights(self, backend: VllmBackend, cmd: StartReplica, headers) -> bool:
        """A new replica's engine (started with dummy weights) receives its shards in a live switch, verified, and
        puts them in force; reports `WeightsReceived`, or `ReplicaFailed` when any of it failed."""
        w = cmd.weights
        assert w is not None
        rid = cmd.replica.replica_id
        outcome = await backend.run_switch_job(Rendezvous(w.session_id, w.host, w.port, w.timeout_s),
                                               tuple(w.endpoints), bind_host=self.config.transfer_host, serving=False)
        install_s = 0.0
        error = "; ".join(outcome.errors)
        if outcome.verified:
            try:
                install_s = await backend.install_weights()
            except Exception as exc:  # a rank could not put them in force: nothing of this replica serves
                error = f"installing the received weights failed: {type(exc).__name__}: {exc}"
        ok = outcome.verified and not error
        await self._publish(WeightsReceived(
            strategy_id=cmd.strategy_id, replica_id=rid, verified=ok, num_bytes=outcome.bytes_received,
            engine_start_wall_s=backend.start_wall_s, transfer_wall_s=outcome.transfer_s, install_wall_s=install_s,
            error=error), headers)
        if not ok:
            log.warning("%s: replica %s did not receive its weights: %s", self.config.host_id, rid, error)
            await self._publish(ReplicaFailed(strategy_id=cmd.strategy_id, replica_id=rid,
                                              reason=f"weights not received: {error}"), headers)
        else:
            log.info("%s: replica %s received %.1f MB in %.2f s (engine start %.1f s, install %.2f s)",
                     self.config.host_id, rid, outcome.bytes_received / 1e6, outcome.transfer_s,
                     backend.start_wall_s, install_s)
        return ok

    async def _send_weights(self, cmd: SendWeights, headers) -> None:
        """A serving replica sends its part of a live switch, while it goes on serving; reports `WeightsSent`."""
        engine = self.engines.get(cmd.replica_id)
        backend = engine.backend if engine is not None else None
        w = cmd.weights
        if not isinstance(backend, VllmBackend):
            error = (f"replica {cmd.replica_id} does not serve here" if engine is None else
                     f"replica {cmd.replica_id} has no real engine to send weights from (backend "
                     f"{self.config.backend})")
            await self._publish(WeightsSent(strategy_id=cmd.strategy_id, replica_id=cmd.replica_id, verified=False,
                                            error=error), headers)
            return
        self._sending[cmd.replica_id] = asyncio.current_task()  # type: ignore[assignment]
        try:
            outcome = await backend.run_switch_job(Rendezvous(w.session_id, w.host, w.port, w.timeout_s),
                                                   tuple(w.endpoints), bind_host=self.config.transfer_host)
        finally:
            self._sending.pop(cmd.replica_id, None)
        await self._publish(WeightsSent(strategy_id=cmd.strategy_id, replica_id=cmd.replica_id,
                                        verified=outcome.verified, num_bytes=outcome.bytes_sent, wall_s=outcome.wall_s,
                                        error="; ".join(outcome.errors)), headers)

    async def _start_replica(self, cmd: StartReplica, headers) -> None:
        rid = cmd.replica.replica_id
        waited = 0.0
        while rid in self._retiring:  # the same id is still draining: two engines on one subject would both serve
            if waited > RETIRE_WAIT_WALL_S:
                raise RuntimeError(f"replica {rid} is still draining after {waited:.0f} s; not started again")
            await asyncio.sleep(0.1)
            waited += 0.1
        dead = self.engines.get(rid)
        if dead is not None and not dead.running:  # its loop failed (`Worker.failure`): start it anew
            log.warning("%s: replica %s had stopped (%r); starting it again", self.config.host_id, rid, dead.failure)
            del self.engines[rid]
            await _stop_engine(dead)
        if rid not in self.engines and rid not in self._starting:
            self._starting.add(rid)
            try:
                backend = None
                if self.config.backend == "vllm":  # the real start, weights loaded or received, is the wait
                    backend = VllmBackend(rid, replace(self.config.vllm, tp=cmd.replica.tp, pp=cmd.replica.pp,
                                                       devices=tuple(g % self.config.gpus_per_node
                                                                     for g in cmd.replica.gpu_ids),
                                                       dummy_weights=cmd.weights is not None),
                                          self.clock.now_s)
                    await backend.start()  # a start that fails or is cancelled leaves no engine behind
                    if cmd.weights is not None and not await self._receive_weights(backend, cmd, headers):
                        await backend.stop()
                        return
                else:
                    await self.clock.sleep(cmd.ready_after_s)  # the modelled weight transfer
                if rid in self._cancelled_starts:  # drained while it started: never serves
                    log.info("%s: start of %s cancelled by a drain", self.config.host_id, rid)
                    if backend is not None:
                        await backend.stop()
                    return
                cfg = EngineWorkerConfig(rid, subjects=self.config.subjects,
                                         backend=self.config.backend,  # type: ignore[arg-type]
                                         sim=SimBackendConfig(self.config.model, self.config.gpu, cmd.replica.tp,
                                                              cmd.replica.pp, self.config.gpus_per_node),
                                         served_model=backend.model_name if backend is not None else "",
                                         heartbeat_interval_wall_s=self.config.heartbeat_interval_wall_s,
                                         fence_after_wall_s=self.config.fence_after_wall_s)
                engine = EngineWorker(self.nc, cfg, self.clock, tracer=self.tracer, metrics=self.metrics,
                                      backend=backend)
                await engine.start()
                if rid in self._cancelled_starts:  # the drain came while it subscribed
                    await _stop_engine(engine)
                    return
                self.engines[rid] = engine
            finally:
                self._starting.discard(rid)
                self._cancelled_starts.discard(rid)
        if rid in self.engines:
            await self._publish(ReplicaReady(strategy_id=cmd.strategy_id, replica_id=rid), headers)

    async def _drain_replica(self, cmd: DrainReplica, headers) -> None:
        engine = self.engines.pop(cmd.replica_id, None)
        if engine is None:
            if cmd.replica_id in self._starting:  # still loading: cancel the start, nothing to drain
                self._cancelled_starts.add(cmd.replica_id)
                await self._publish(ReplicaDrained(strategy_id=cmd.strategy_id, replica_id=cmd.replica_id), headers)
            return
        self._retiring[cmd.replica_id] = engine  # the host's own drain and stop still see it
        await engine.drain_migrating(cmd.migrate_after_s)
        sending = self._sending.get(cmd.replica_id)
        if sending is not None:  # its part of the switch that retires it: sent already, reported shortly
            await asyncio.wait([sending], timeout=SEND_REPORT_WAIT_WALL_S)
        await _stop_engine(engine)
        self._retiring.pop(cmd.replica_id, None)  # not on cancellation: the host's stop stops it
        await self._publish(ReplicaDrained(strategy_id=cmd.strategy_id, replica_id=cmd.replica_id), headers)

    async def _drain(self) -> None:
        await asyncio.gather(*(e.drain() for e in [*self.engines.values(), *self._retiring.values()]))

    async def _on_stop(self) -> None:
        for e in [*self.engines.values(), *self._retiring.values()]:
            await e.stop()
            await e.fail_inflight()  # stopped mid-drain: each client gets an error, not silence
            await _stop_backend(e)
        self.engines.clear()
        self._retiring.clear()


async def _stop_backend(engine: EngineWorker) -> None:
    """Shut down an engine's real backend (a vLLM engine's processes and memory); the simulated ones hold none."""
    stop = getattr(engine.backend, "stop", None)
    if stop is not None:
        try:
            await stop()
        except Exception:  # its processes are gone already
            log.warning("%s: could not shut its backend down cleanly", engine.config.replica_id, exc_info=True)


async def _stop_engine(engine: EngineWorker) -> None:
    await engine.stop()
    await _stop_backend(engine)
