"""The whole live system in one process (`oserve up`), and a trace replay through the client.

`LiveSystem` wires the workers on one NATS connection: gateway, engine host, forecaster stage,
scheduler and switch planner, all reading one `Clock`. Planning inputs (workload types, the capacity
table, the first span's rates) are computed from a trace with the core's own functions.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import nats
from nats.aio.client import Client as NATS

from oserve.capacity import CapacityTable, LatencyTarget
from oserve.client import ClientError, OServeClient, RequestRejected, RequestTimeout
from oserve.observability.tracing import TracingConfig, setup_tracing
from oserve.sim.policies import PlanningContext, SwitchCosts
from oserve.specs import cluster_for_gpus, model_preset
from oserve.streams.jetstream import ensure_streams
from oserve.streams.schemas import SwitchCompleted, SwitchEvent, SwitchPlanned, decode
from oserve.streams.subjects import Subjects
from oserve.workers.clock import Clock
from oserve.workers.control import (EngineHost, EngineHostConfig, ForecasterConfig, ForecasterStage,
                                   SchedulerConfig, SchedulerWorker, SwitchPlannerConfig, SwitchPlannerWorker)
from oserve.workers.gateway import Gateway, GatewayConfig
from oserve.workers.router import Classifier
from oserve.workload import Trace, WorkloadTypes, fit_types, load_trace, span_counts


@dataclass(frozen=True, slots=True)
class SystemConfig:
    """What `oserve up` runs."""

    subjects: Subjects = field(default_factory=Subjects)
    model: str = "llama2-7b"
    gpus: int = 8
    gpu: str = "h100-80gb"
    trace: str = "azure-conv"
    """Trace the workload types and the initial rates are fitted on."""
    num_types: int = 4
    span_s: float = 60.0
    """Forecast/planning span on the clock (seconds)."""
    speedup: float = 1.0
    epoch_unix_s: float | None = None
    """Unix time at which the clock reads 0; workers in different processes given the same epoch share one
    clock. None: the clock starts at 0 when the system does."""
    search: str = "milp"
    fewer_replicas_slack: float = 0.02
    """Headroom the deployment MILP may give up for fewer replicas (`SearchConfig.fewer_replicas_slack`)."""
    twin: bool = False
    """Score candidate deployments on the digital twin (`oserve.sim.twin`), as the simulated OServe does
    (here on Poisson arrivals at the forecast: the live span view carries no arrival times). Off by
    default: a re-plan then costs seconds of CPU, which a span of one real minute affords but the demo,
    whose clock runs 60x faster than wall time, does not."""
    engine_start_s: float = 8.0
    """Modelled engine start time of a switched-in replica, on top of its weight transfer (clock s)."""
    heartbeat_interval_wall_s: float = 0.5
    tracing: TracingConfig = field(default_factory=TracingConfig)
    workers: tuple[str, ...] = ("gateway", "engines", "forecaster", "scheduler", "switch-planner")

    def __post_init__(self) -> None:
        known = {"gateway", "engines", "forecaster", "scheduler", "switch-planner"}
        if not set(self.workers) <= known:
            raise ValueError(f"SystemConfig.workers: unknown {sorted(set(self.workers) - known)}; known {sorted(known)}")
        if self.gpus < 1 or self.num_types < 1 or not self.span_s > 0 or not self.speedup > 0:
            raise ValueError(f"SystemConfig: gpus, num_types, span_s and speedup must be positive, got "
                             f"{self.gpus}, {self.num_types}, {self.span_s}, {self.speedup}")
        if not 0 <= self.fewer_replicas_slack < 1:
            raise ValueError(f"SystemConfig.fewer_replicas_slack must be in [0, 1), got {self.fewer_replicas_slack}")
        if self.engine_start_s < 0 or self.heartbeat_interval_wall_s <= 0:
            raise ValueError(f"SystemConfig: engine_start_s must be >= 0 and heartbeat_interval_wall_s > 0, got "
                             f"{self.engine_start_s}, {self.heartbeat_interval_wall_s}")


@dataclass(frozen=True, slots=True)
class PlanningInputs:
    types: WorkloadTypes
    ctx: PlanningContext


def planning_inputs(config: SystemConfig, trace: Trace | None = None,
                    initial_rps: np.ndarray | None = None) -> PlanningInputs:
    """Types, capacity table and first-span rates from a trace, by the core's functions. Pure but slow (~1 s)."""
    tr = trace if trace is not None else load_trace(config.trace)
    types = fit_types(tr.input_tokens, tr.output_tokens, k=config.num_types)
    model = model_preset(config.model)
    cluster = cluster_for_gpus(config.gpus, config.gpu)
    table = CapacityTable(model, cluster.gpu, types, LatencyTarget(), gpus_per_node=cluster.gpus_per_node)
    if initial_rps is None:
        initial_rps = span_counts(tr, types, config.span_s)[0] / config.span_s
    costs = SwitchCosts(engine_start_s=config.engine_start_s)
    return PlanningInputs(types, PlanningContext(model, cluster, table, costs,
                                                 initial_rps=np.maximum(np.asarray(initial_rps, dtype=float), 1e-3)))


class LiveSystem:
    """Every worker of `config.workers` on one connection; `async with` starts, drains and stops them."""

    def __init__(self, nc: NATS, config: SystemConfig, inputs: PlanningInputs, clock: Clock | None = None) -> None:
        self.nc, self.config, self.inputs = nc, config, inputs
        if clock is None:
            clock = Clock(config.speedup) if config.epoch_unix_s is None else \
                Clock.from_epoch(config.epoch_unix_s, config.speedup)
        self.clock = clock
        self.tracing = setup_tracing(config.tracing)
        self.gateway: Gateway | None = None
        self.host: EngineHost | None = None
        self.forecaster: ForecasterStage | None = None
        self.scheduler: SchedulerWorker | None = None
        self.switcher: SwitchPlannerWorker | None = None

    async def start(self) -> None:
        cfg, tracer, clock, nc = self.config, self.tracing.tracer, self.clock, self.nc
        kv = await ensure_streams(nc.jetstream(), cfg.subjects)
        gpn = self.inputs.ctx.cluster.gpus_per_node
        w = set(cfg.workers)
        # order: consumers before producers, so no event is published to nobody
        if "engines" in w:
            self.host = EngineHost(nc, EngineHostConfig(subjects=cfg.subjects, model=cfg.model, gpu=cfg.gpu,
                                                        gpus_per_node=gpn,
                                                        heartbeat_interval_wall_s=cfg.heartbeat_interval_wall_s),
                                   clock, tracer=tracer)
            await self.host.start()
        if "gateway" in w:
            self.gateway = Gateway(nc, GatewayConfig(subjects=cfg.subjects,
                                                     heartbeat_timeout_wall_s=4 * cfg.heartbeat_interval_wall_s),
                                   clock, types=self.inputs.types, tracer=tracer, kv=kv)
            await self.gateway.start()
        if "switch-planner" in w:
            self.switcher = SwitchPlannerWorker(nc, SwitchPlannerConfig(subjects=cfg.subjects, gpus_per_node=gpn),
                                                clock, tracer=tracer, kv=kv)
            await self.switcher.start()
        if "forecaster" in w:
            self.forecaster = ForecasterStage(
                nc, ForecasterConfig(subjects=cfg.subjects, span_s=cfg.span_s, num_types=self.inputs.types.k),
                clock, classifier=Classifier(self.inputs.types), tracer=tracer, js=nc.jetstream())
            await self.forecaster.start()
        if "scheduler" in w:
            self.scheduler = SchedulerWorker(nc, kv, SchedulerConfig(subjects=cfg.subjects, span_s=cfg.span_s), clock,
                                             self.inputs.ctx, search_name=cfg.search,
                                             fewer_replicas_slack=cfg.fewer_replicas_slack, twin=cfg.twin,
                                             tracer=tracer)
            await self.scheduler.start()

    def _workers(self):
        return [w for w in (self.gateway, self.forecaster, self.scheduler, self.switcher, self.host) if w is not None]

    async def drain(self) -> None:
        """Stop taking requests, finish every accepted one."""
        for w in self._workers():
            await w.drain()

    async def stop(self) -> None:
        for w in self._workers():
            await w.stop()
        self.tracing.shutdown()

    async def wait_serving(self, timeout_s: float) -> None:
        """Wait until the gateway sees the first strategy's replicas."""
        assert self.gateway is not None and self.switcher is not None

        async def wait() -> None:
            while not (self.switcher.strategy_id and self.gateway.strategy_id):
                await asyncio.sleep(0.02)
        await asyncio.wait_for(wait(), timeout_s)

    async def __aenter__(self) -> LiveSystem:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()
        await self.stop()


async def replay(client: OServeClient, trace: Trace, speedup: float, *, timeout_s: float = 120.0,
                 subjects: Subjects | None = None) -> dict:
    """Publish a trace's requests at their sped-up times, await every reply, and summarise.

    The output length of each trace request is sent as its `max_tokens` (the `sim` backend generates
    exactly that many); no hint is given, so the router classifies with max tokens.
    """
    subjects = subjects or client.subjects
    switches = {"planned": 0, "completed": 0, "rolled_back": 0, "changed": 0}
    planned: dict[str, bool] = {}

    async def on_switch(msg) -> None:
        ev = decode(msg.data, SwitchEvent)
        if isinstance(ev, SwitchPlanned):
            switches["planned"] += 1
            planned[ev.strategy_id] = bool(ev.start_ids or ev.retire_ids)
        elif isinstance(ev, SwitchCompleted):
            switches["completed"] += 1
            switches["changed"] += planned.get(ev.strategy_id, False)
        else:
            switches["rolled_back"] += 1

    sub = await client.nc.subscribe(subjects.plan_event("switch"), cb=on_switch)
    e2e: list[float] = []
    errors: dict[str, int] = {}
    lost = 0
    t0 = time.monotonic()
    run_id = uuid.uuid4().hex[:12]  # ids unique per run: a second replay must not meet the first's answers

    async def one(i: int, at_s: float, inp: int, out: int) -> None:
        nonlocal lost
        await asyncio.sleep(max(0.0, t0 + at_s / speedup - time.monotonic()))
        try:
            r = await client.submit(input_tokens=inp, max_tokens=max(1, out), request_id=f"replay-{run_id}-{i}",
                                    timeout_s=timeout_s)
            e2e.append(r.e2e_s)
        except RequestRejected as exc:
            errors[exc.code] = errors.get(exc.code, 0) + 1
        except (RequestTimeout, ClientError):
            lost += 1

    start_s = float(trace.arrival_s[0]) if len(trace) else 0.0
    async with asyncio.TaskGroup() as tg:
        for i in range(len(trace)):
            tg.create_task(one(i, float(trace.arrival_s[i]) - start_s, int(trace.input_tokens[i]),
                               int(trace.output_tokens[i])))
    await sub.unsubscribe()
    e2e.sort()
    return {
        "requests": len(trace),
        "answered": len(e2e),
        "errors": sum(errors.values()),
        "error_codes": errors,
        "lost": lost,
        "switches": switches["changed"],
        "switch_events": switches,
        "p50_s": e2e[len(e2e) // 2] if e2e else math.nan,
        "p99_s": e2e[min(len(e2e) - 1, int(0.99 * len(e2e)))] if e2e else math.nan,
        "wall_s": time.monotonic() - t0,
        "speedup": speedup,
    }


async def connect(url: str, name: str) -> NATS:
    """A worker connection with reconnects and logged disconnects."""
    import logging

    log = logging.getLogger("oserve.nats")

    async def disconnected() -> None:
        log.info("%s: disconnected from NATS", name)

    async def reconnected() -> None:
        log.warning("%s: reconnected to NATS", name)

    async def error(exc: Exception) -> None:
        log.warning("%s: NATS error: %s", name, exc)

    return await nats.connect(url, name=name, disconnected_cb=disconnected, reconnected_cb=reconnected,
                              error_cb=error, max_reconnect_attempts=-1)
