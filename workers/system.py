"""The whole live system in one process (`oserve up`), and a trace replay through the client.

`LiveSystem` wires the workers on one NATS connection: gateway, engine host, forecaster stage,
scheduler and switch planner, all reading one `Clock`. What the planner knows before serving (types,
the arrival-time estimator, what each class contains, the capacity table, the last span's rates) is
fitted on a history trace with the same function the simulator's evaluation uses
(`oserve.planner.prior.fit_prior`): the trace the system starts from, never what it then serves.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass, field, replace

import nats
import numpy as np
from nats.aio.client import Client as NATS

from oserve.defaults import ENGINE_START_S, SPAN_S, WORKER_NAMES
from oserve.errors import ConfigError
from oserve.forecast.baselines import LastValue
from oserve.forecast.gate import GatedForecaster
from oserve.observability.metrics import Metrics
from oserve.observability.tracing import TracingConfig, setup_tracing
from oserve.planner.adaptive import SelfCorrectingPlanner
from oserve.correction import CorrectionConfig
from oserve.planner.config import PlannerConfig
from oserve.planner.context import PlanningContext, SwitchCosts
from oserve.planner.oserve import OServePlanner
from oserve.planner.prior import CLASS_LENGTHS, Prior, client_tag, fit_prior, planning_table
from oserve.planner.static import StaticPlanner
from oserve.planner.twin import TwinConfig
from oserve.scheduler.search import SearchConfig
from oserve.specs import Deployment, cluster_for_gpus, model_preset
from oserve.streams.client import ClientError, OServeClient, RequestRejected
from oserve.streams.jetstream import EventPublisher, StreamLimits, ensure_model_store, ensure_streams
from oserve.streams.schemas import BYTES_PER_TOKEN, CLIENT_TAG, SwitchCompleted, SwitchEvent, SwitchPlanned, decode
from oserve.streams.server import reconnects
from oserve.streams.subjects import Subjects
from oserve.traces import Trace, load_trace
from oserve.workers.clock import Clock
from oserve.workers.engine_host import EngineHost, EngineHostConfig
from oserve.workers.forecaster import ForecasterConfig, ForecasterStage
from oserve.workers.gateway import Gateway, GatewayConfig
from oserve.workers.scheduler import SchedulerConfig, SchedulerWorker
from oserve.workers.switch_planner import SwitchPlannerConfig, SwitchPlannerWorker
from oserve.workers.vllm_backend import (VllmBackendConfig, engine_start_estimate_s, max_pipeline_stages,
                                         served_model_spec)

ENGINES = ("sim", "vllm")
"""What the engine host runs: simulated replicas timed by the performance model, or real vLLM engines."""
VLLM_START_SLACK_WALL_S = 600.0
"""Wall seconds a switch waits for real engines to start (about 30 s each on two cores, one at a time)."""
VLLM_HEARTBEAT_TIMEOUTS = 16
"""With real engines on a CPU host, a replica is declared dead after this many heartbeat intervals of silence
(and fences itself after three quarters of it): vLLM's CPU workers spin on every core, and on two cores
the host's event loop went 1.5 s without running (`oserve demo --engine vllm`, TP2 on 2 cores)."""


@dataclass(frozen=True, slots=True)
class SystemConfig:
    """What `oserve up` runs."""

    subjects: Subjects = field(default_factory=Subjects)
    model: str = "llama2-7b"
    gpus: int = 8
    gateway_id: str = "gateway-0"
    """The gateway's id: its journal of owned requests (`Subjects.ownership`) is under it, so a gateway restarted
    with the same id takes back what it owned; give each gateway of a system its own."""
    gpu: str = "h100-80gb"
    trace: str = "azure-conv"
    """The history the planner's models are fitted on (`fit_prior`): requests seen before the system starts."""
    history_minutes: float | None = None
    """Fit on this many first minutes of `trace` (None: all of it)."""
    num_types: int = 4
    span_s: float = SPAN_S
    """Forecast/planning span on the clock (seconds)."""
    speedup: float = 1.0
    epoch_unix_s: float | None = None
    """Unix time at which the clock reads 0; workers in different processes given the same epoch share one
    clock. None: the clock starts at 0 when the system does."""
    search: str = "milp"
    fewer_replicas_slack: float = 0.02
    """Headroom the deployment MILP may give up for fewer replicas (`SearchConfig.fewer_replicas_slack`)."""
    twin: bool = True
    """Score candidate deployments on the digital twin (`oserve.planner.twin`), as the simulated OServe does;
    False: the capacity model alone decides."""
    max_twin_scores: int | None = 4
    """Twin scorings per decision (`PlannerConfig.max_twin_scores`): what keeps a decision inside the
    scheduler's budget of a tenth of a span. In the demo (Llama-2-70B on 8 GPUs, 10 requests/s, a span
    of 3 wall seconds at 20x, so a 0.3 s budget) the slowest rescoring with four took 0.42-0.46 s on
    this machine, over the budget in 1 of 18 decisions (the three MILP solves that build the candidates
    are not counted); each strategy event says how long its decision took. None: no limit."""
    class_lengths: str = "estimated"
    """The table the deployment search plans with (`PlannerConfig.class_lengths`); the same value must be in
    the `PlanningInputs` the system is started with (`planning_inputs` reads it from here). Not the
    simulator's default ("types"), which pays only with the moves (`move_outgrown`)."""
    move_outgrown: bool = False
    """Requests that outgrow their class move (`PlannerConfig.correction`, `GatewayConfig.move_outgrown`).
    Off live, unlike in the simulator: on the demo's workload (`oserve demo --no-static`, TP4 + TP4 in every
    run) the live P99 was 26.0 s with "estimated" and no moves, 26.3 s with "types" and no moves, and
    46.0 s with "types" and the moves (41.4 s in a second run); the simulator, on the same workload with
    the live budget of twin scorings, chose one TP4xPP2 and moved nothing, so it never priced this. With the
    engine asking before it moves a request and the gateway moving it only where there is room (`MoveAsk`),
    "types" with the moves still gave 38.3 s and 57.8 s against 26.4 s (README, "Correcting after the
    fact"): a live move re-prefills, where the simulator moves the KV."""
    planner_process: bool = True
    """The scheduler makes its decisions in a child process (`SchedulerConfig.planner_process`) when other workers
    share its process (`oserve up`, `oserve demo`), so its CPU does not hold the interpreter lock against them; a
    scheduler alone in its process (`oserve worker scheduler`) decides on a thread. The scheduler's `planner` is
    then the child's, sent back after each decision: the planner in `PlanningInputs` stays as it was handed in."""
    forecaster: str = "lstm"
    """`lstm`: last value, or the LSTM while it beats last value on recent spans (`GatedForecaster`);
    `last_value`: last value alone."""
    lstm_lookback_spans: int = 8
    """Spans the live LSTM looks back over; it first trains once twice as many spans are known (the
    history's and the live ones). The paper's 50 needs hours of one-minute spans before the first
    training; with 8 the demo's LSTM (10 minutes of history) first trains after 6 live spans."""
    lstm_retrain_every_spans: int = 5
    """The live LSTM is fine-tuned (on a thread) every this many spans, on all it has counted."""
    engine_start_s: float | None = None
    """Engine start time of a switched-in replica, on top of its weight transfer (clock s), as the planner prices a
    switch; None: `ENGINE_START_S` (an H100) for simulated engines, and for real ones what they take here
    (`oserve.workers.vllm_backend.engine_start_estimate_s`: the measured CPU figure on a CPU host)."""
    heartbeat_interval_wall_s: float = 0.5
    engine: str = "sim"
    """`sim`: simulated engines (the model preset on the simulated GPUs); `vllm`: a real vLLM engine per
    replica (`vllm`), at wall speed (`speedup` 1). The planner still plans with the preset's capacity model
    as its prior, and learns what the real engines serve (`SelfCorrectingPlanner`)."""
    vllm: VllmBackendConfig = field(default_factory=VllmBackendConfig)
    """The vLLM engines: model folder (empty: the shipped small Llama), context window, KV cache."""
    migrate_after_wall_s: float | None = 2.0
    """With real engines, a replica a switch retires finishes its requests in place for this long (wall
    seconds), then hands the rest over to the new replicas with what they generated (re-prefilled there);
    None: every request finishes in place. Simulated engines always finish in place."""
    js_replicas: int = 1
    """Copies of each JetStream stream and bucket (`StreamLimits.num_replicas`): 1 on one NATS server, 3 on
    the 3-node cluster of `deploy/k8s`."""
    tracing: TracingConfig = field(default_factory=TracingConfig)
    workers: tuple[str, ...] = WORKER_NAMES
    http_host: str = "127.0.0.1"
    """Address the OpenAI-compatible HTTP front (`http` worker) listens on."""
    http_port: int = 0
    """Its TCP port; 0 takes a free one (`LiveSystem.http.port`), as tests want; `oserve up` gives 8000."""
    http_api_keys: tuple[str, ...] = field(default=(), repr=False)
    """Bearer keys the HTTP front wants (`HTTPFrontConfig.api_keys`); empty: none. Out of the repr, so out of logs."""

    def __post_init__(self) -> None:
        if not set(self.workers) <= set(WORKER_NAMES):
            raise ConfigError(f"SystemConfig.workers: unknown {sorted(set(self.workers) - set(WORKER_NAMES))}; "
                              f"known {list(WORKER_NAMES)}")
        if self.gpus < 1 or self.num_types < 1 or not self.span_s > 0 or not self.speedup > 0:
            raise ConfigError(f"SystemConfig: gpus, num_types, span_s and speedup must be positive, got "
                              f"{self.gpus}, {self.num_types}, {self.span_s}, {self.speedup}")
        if self.class_lengths not in CLASS_LENGTHS:
            raise ConfigError(f"SystemConfig.class_lengths must be one of {', '.join(CLASS_LENGTHS)}, got "
                              f"{self.class_lengths!r}")
        if not 0 <= self.fewer_replicas_slack < 1:
            raise ConfigError(f"SystemConfig.fewer_replicas_slack must be in [0, 1), got {self.fewer_replicas_slack}")
        if (self.engine_start_s is not None and self.engine_start_s < 0) or self.heartbeat_interval_wall_s <= 0:
            raise ConfigError(f"SystemConfig: engine_start_s must be >= 0 and heartbeat_interval_wall_s > 0, got "
                              f"{self.engine_start_s}, {self.heartbeat_interval_wall_s}")
        if self.forecaster not in ("lstm", "last_value"):
            raise ConfigError(f"SystemConfig.forecaster must be lstm or last_value, got {self.forecaster!r}")
        if self.lstm_lookback_spans < 1 or self.lstm_retrain_every_spans < 1:
            raise ConfigError(f"SystemConfig: lstm_lookback_spans and lstm_retrain_every_spans must be >= 1, got "
                              f"{self.lstm_lookback_spans}, {self.lstm_retrain_every_spans}")
        if self.engine not in ENGINES:
            raise ConfigError(f"SystemConfig.engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine == "vllm" and self.speedup != 1.0:
            raise ConfigError(f"SystemConfig: real vLLM engines run at wall speed; speedup must be 1, got {self.speedup}")
        if not 1 <= self.js_replicas <= 5:
            raise ConfigError(f"SystemConfig.js_replicas must be in 1..5, got {self.js_replicas}")
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(f"SystemConfig.http_port must be in 0..65535, got {self.http_port}")
        if self.migrate_after_wall_s is not None and not self.migrate_after_wall_s >= 0:
            raise ConfigError(f"SystemConfig.migrate_after_wall_s must be >= 0 or None, got {self.migrate_after_wall_s}")
        if self.history_minutes is not None and not self.history_minutes > 0:
            raise ConfigError(f"SystemConfig.history_minutes must be > 0, got {self.history_minutes}")

    @property
    def heartbeat_timeout_wall_s(self) -> float:
        """Silence after which the gateway declares a replica dead: 4 heartbeats, or more with real engines."""
        return (VLLM_HEARTBEAT_TIMEOUTS if self.engine == "vllm" else 4) * self.heartbeat_interval_wall_s

    @property
    def fence_after_wall_s(self) -> float:
        """An engine fences itself after this much silence: 1.5 s, or three quarters of the gateway's timeout
        with real engines (under the timeout less a heartbeat, as `EngineWorkerConfig` asks)."""
        return 0.75 * self.heartbeat_timeout_wall_s if self.engine == "vllm" else 1.5

    @property
    def served_model(self) -> str:
        """The model's name to clients: the preset's, or the vLLM engines' model folder's."""
        return self.vllm.model_name if self.engine == "vllm" else self.model

    def max_context_tokens(self, ctx) -> int:
        """The context window the gateway enforces: the preset's, and no more than the vLLM engines serve."""
        window = ctx.model.max_context_tokens
        return min(window, self.vllm.max_model_len) if self.engine == "vllm" else window

    def planner_config(self) -> PlannerConfig:
        return PlannerConfig(search=self.search, search_config=SearchConfig(fewer_replicas_slack=self.fewer_replicas_slack),
                             twin=TwinConfig() if self.twin else None, max_twin_scores=self.max_twin_scores,
                             class_lengths=self.class_lengths,
                             correction=CorrectionConfig() if self.move_outgrown else None)


@dataclass(frozen=True, slots=True, eq=False)
class PlanningInputs:
    """What the workers start from: the prior fitted on history, the planner built on it, and the rates
    the first span is planned for. OServe's planner learns capacity as it serves (it holds state: one
    `PlanningInputs` per system run)."""

    prior: Prior
    ctx: PlanningContext
    planner: SelfCorrectingPlanner | OServePlanner | StaticPlanner
    initial_rps: np.ndarray
    """Per-class rates of the first span: the history's last span, unless given."""

    def static(self, deployment: Deployment) -> PlanningInputs:
        """The same inputs with the static baseline's planner: `deployment` for every span. Pure."""
        return replace(self, planner=StaticPlanner(deployment, self.prior.class_names))


def planning_inputs(config: SystemConfig, history: Trace | None = None,
                    initial_rps: np.ndarray | None = None) -> PlanningInputs:
    """Fit the prior on `history` (default: `config.trace`, cut to `config.history_minutes`) and build the
    planner (`SelfCorrectingPlanner`: OServe's planner, its capacity learned from the engines' telemetry,
    the learned per-class scales weighed by the history's class mix); `initial_rps` overrides the first
    span's rates (an operator's expectation). Pure but slow (about a second)."""
    if history is None:
        history = load_trace(config.trace)
        if config.history_minutes is not None:
            history = history.slice_time(0.0, config.history_minutes * 60.0)
    model = model_preset(config.model)
    cluster = cluster_for_gpus(config.gpus, config.gpu)
    prior = fit_prior(history, model, cluster, span_s=config.span_s, k=config.num_types,
                      duration_s=config.history_minutes * 60.0 if config.history_minutes else None,
                      max_pp=max_pipeline_stages() if config.engine == "vllm" else None)
    start_s = config.engine_start_s
    if start_s is None:
        start_s = engine_start_estimate_s() if config.engine == "vllm" else ENGINE_START_S
    table = planning_table(prior, config.planner_config().class_lengths)
    ctx = PlanningContext(model, cluster, table, SwitchCosts(engine_start_s=start_s), classes=prior.types)
    first = prior.counts[-1] / prior.span_s if initial_rps is None else np.asarray(initial_rps, dtype=float)
    if first.shape != (prior.types.k,) or not np.all(np.isfinite(first)) or (first < 0).any():
        raise ConfigError(f"planning_inputs: initial_rps must be {prior.types.k} rates >= 0, got {first.tolist()}")
    planner = SelfCorrectingPlanner(ctx, config.planner_config(), mix=prior.counts.sum(axis=0))
    return PlanningInputs(prior, ctx, planner, first)


def live_forecaster(config: SystemConfig, prior: Prior) -> GatedForecaster:
    """The forecaster stage's forecaster: last value fitted on the history's class counts, and (with
    `config.forecaster == "lstm"`) an LSTM that has learned them but is not trained yet: the stage trains
    it on a thread, so start-up never waits for it. Pure."""
    k = prior.types.k
    baseline = LastValue(k).fit(prior.counts)
    if config.forecaster == "last_value":
        return GatedForecaster(baseline, config.span_s)
    from oserve.forecast.lstm import LSTMForecaster

    lookback = config.lstm_lookback_spans
    lstm = LSTMForecaster(k, lookback_spans=lookback, min_train_spans=2 * lookback,
                          retrain_every_spans=config.lstm_retrain_every_spans)
    for row in prior.counts:
        lstm.learn_one(row)
    return GatedForecaster(baseline, config.span_s, challenger=lstm)


class LiveSystem:
    """Every worker of `config.workers` on one connection; `async with` starts, drains and stops them."""

    def __init__(self, nc: NATS, config: SystemConfig, inputs: PlanningInputs, clock: Clock | None = None, *,
                 metrics: Metrics | None = None) -> None:
        self.nc, self.config, self.inputs = nc, config, inputs
        self.metrics = metrics
        """The process's Prometheus instruments, handed to every worker (None: no metrics)."""
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
        self.events: EventPublisher | None = None
        """The control events' publisher the workers share (its counts: acknowledged, retried, unacknowledged)."""
        self.http = None  # the OpenAI-compatible front (`OpenAIFront`), when `http` is among the workers

    async def start(self) -> None:
        cfg, clock, nc, metrics = self.config, self.clock, self.nc, self.metrics
        tracer = self.tracing.tracer_for  # one service per worker: oserve-gateway, oserve-engine, ...
        kv = await ensure_streams(nc.jetstream(), cfg.subjects, StreamLimits(num_replicas=cfg.js_replicas))
        # control events (replica, switch, assignment, strategy, forecast) acknowledged by the plans stream
        events = EventPublisher(nc, nc.jetstream())
        self.events = events
        ctx = self.inputs.ctx
        gpn = ctx.cluster.gpus_per_node
        w = set(cfg.workers)
        # order: consumers before producers, so no event is published to nobody
        if "engines" in w:
            self.host = EngineHost(nc, EngineHostConfig(subjects=cfg.subjects, model=cfg.model, gpu=cfg.gpu,
                                                        gpus_per_node=gpn, backend=cfg.engine, vllm=cfg.vllm,
                                                        fence_after_wall_s=cfg.fence_after_wall_s,
                                                        heartbeat_interval_wall_s=cfg.heartbeat_interval_wall_s),
                                   clock, tracer=tracer("engine"), metrics=metrics, events=events)
            await self.host.start()
        if "gateway" in w:
            self.gateway = Gateway(nc, GatewayConfig(subjects=cfg.subjects, gateway_id=cfg.gateway_id,
                                                     max_context_tokens=cfg.max_context_tokens(ctx),
                                                     heartbeat_timeout_wall_s=cfg.heartbeat_timeout_wall_s,
                                                     surplus_window_s=cfg.span_s,
                                                     move_outgrown=cfg.planner_config().correction is not None),
                                   clock, estimator=self.inputs.prior.fresh_estimator(), tracer=tracer("gateway"), kv=kv,
                                   metrics=metrics, js=nc.jetstream())
            await self.gateway.start()
        if "switch-planner" in w:
            live = {"ready_slack_wall_s": VLLM_START_SLACK_WALL_S, "restart_after_wall_s": cfg.heartbeat_timeout_wall_s,
                    "live_transfer": True, "migrate_after_wall_s": cfg.migrate_after_wall_s} \
                if cfg.engine == "vllm" else {}
            self.switcher = SwitchPlannerWorker(nc, SwitchPlannerConfig(subjects=cfg.subjects, gpus_per_node=gpn,
                                                                        **live),
                                                clock, tracer=tracer("switch-planner"), kv=kv, model=ctx.model,
                                                cluster=ctx.cluster, metrics=metrics,
                                                served_model=served_model_spec(cfg.vllm) if cfg.engine == "vllm" else None,
                                                events=events)
            await self.switcher.start()
        if "forecaster" in w:
            prior = self.inputs.prior
            self.forecaster = ForecasterStage(
                nc, ForecasterConfig(subjects=cfg.subjects, span_s=cfg.span_s, num_types=prior.types.k),
                clock, forecaster=live_forecaster(cfg, prior), types=prior.types, tracer=tracer("forecaster"),
                metrics=metrics, js=nc.jetstream(),
                store=await ensure_model_store(nc.jetstream(), cfg.subjects, cfg.js_replicas),
                class_names=prior.class_names, events=events)
            await self.forecaster.start()
        if "scheduler" in w:
            shared = len(w) > 1  # other workers in this process: the scheduler's CPU would slow them
            self.scheduler = SchedulerWorker(nc, kv, SchedulerConfig(subjects=cfg.subjects, span_s=cfg.span_s,
                                                                     planner_process=cfg.planner_process and shared),
                                             clock, self.inputs.planner, self.inputs.initial_rps,
                                             tracer=tracer("scheduler"), metrics=metrics, events=events)
            await self.scheduler.start()
        if "http" in w:  # a producer of requests: last; imported here, so FastAPI loads only when it serves
            from oserve.workers.http_front import HTTPFrontConfig, OpenAIFront

            self.http = OpenAIFront(nc, HTTPFrontConfig(model_name=cfg.served_model, subjects=cfg.subjects,
                                                        host=cfg.http_host, port=cfg.http_port,
                                                        api_keys=cfg.http_api_keys),
                                    tracer=tracer("http"), metrics=metrics)
            await self.http.start()

    def _workers(self):
        # the HTTP front first: it stops taking requests before the gateway does
        return [w for w in (self.http, self.gateway, self.forecaster, self.scheduler, self.switcher, self.host)
                if w is not None]

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


_PROMPT_WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "engines",
                 "serve", "tokens", "on", "two", "cores")


def prompt_text(num_tokens: int, i: int = 0) -> str:
    """A prompt of `num_tokens` tokens as the gateway counts text (`BYTES_PER_TOKEN` bytes a token), its words
    starting at word `i` of a fixed cycle: text for a real engine where a trace gives only lengths. Pure."""
    size = max(num_tokens, 1) * BYTES_PER_TOKEN
    words, n = [], 0
    while n < size:
        w = _PROMPT_WORDS[(i + len(words)) % len(_PROMPT_WORDS)]
        words.append(w)
        n += len(w) + 1
    return " ".join(words)[:size]


async def replay(client: OServeClient, trace: Trace, speedup: float, *, timeout_s: float = 120.0,
                 subjects: Subjects | None = None, watch_switches: bool = True, settle_s: float = 0.0,
                 text_prompts: bool = False, answers: list | None = None) -> dict:
    """Publish a trace's requests at their sped-up times, await every reply, and summarise.

    Each request carries what a client sends: its input length, and its max tokens and client tag if
    the trace has them. Its true output length goes only to the simulated engine (`sim_output_tokens`, which the
    gateway never reads): the router classes it as a real one would, without knowing it.

    It never raises for a request's failure, whatever it is: each request is answered or counted under an
    error code (`_failure_code`), so `answered + errors + lost == sent`. The summary: `sent`, `answered`,
    `error_codes` (every failure by code: the system's `ErrorCode`s and the client's `timeout`,
    `connection_lost`, `no_gateway`, ...), `errors` (answered with a system error), `lost` (no answer:
    the client's codes), `duplicates` (answers that came to an inbox after its first, over the run and
    `settle_s` wall seconds after it), `late` (first answers after the client gave up), `resent` and
    `reconnects` (the client's, during the run). `watch_switches` counts the switch events (a subscription
    to plan events, which a client user under auth may not have): without it `switches` is None.

    `text_prompts` sends each request as text of its length (`prompt_text`), for real engines, which then
    answer with text; `answers`, when given, gets every `Reply` (in the order they came).
    """
    import logging

    from oserve.streams.schemas import SchemaError

    subjects = subjects or client.subjects
    switches = {"planned": 0, "completed": 0, "rolled_back": 0, "changed": 0}
    planned: dict[str, bool] = {}

    async def on_switch(msg) -> None:
        try:
            ev = decode(msg.data, SwitchEvent)
        except SchemaError:
            return
        if isinstance(ev, SwitchPlanned):
            switches["planned"] += 1
            planned[ev.strategy_id] = bool(ev.start_ids or ev.retire_ids)
        elif isinstance(ev, SwitchCompleted):
            switches["completed"] += 1
            switches["changed"] += planned.get(ev.strategy_id, False)
        else:
            switches["rolled_back"] += 1

    sub = None
    if watch_switches:
        try:
            sub = await client.nc.subscribe(subjects.plan_event("switch"), cb=on_switch)
        except (nats.errors.Error, OSError) as exc:
            logging.getLogger("oserve.replay").warning("replay: not counting switches: cannot subscribe to switch "
                                                       "events (%s)", exc)
    e2e: list[float] = []
    failures: dict[str, int] = {}  # error code -> requests
    rejected = 0  # answered with a system error (the rest of the failures got no answer)
    sent = 0
    before = _replay_counters(client)
    t0 = time.monotonic()
    run_id = uuid.uuid4().hex[:12]  # ids unique per run: a second replay must not meet the first's answers

    async def one(i: int, at_s: float, inp: int, out: int, cap: int, cid: int) -> None:
        nonlocal rejected, sent
        await asyncio.sleep(max(0.0, t0 + at_s / speedup - time.monotonic()))
        sent += 1
        try:
            tag = client_tag(cid)
            prompt = dict(prompt=prompt_text(inp, i)) if text_prompts else dict(input_tokens=inp)
            r = await client.submit(**prompt, max_tokens=cap or None, request_id=f"replay-{run_id}-{i}",
                                    tags={CLIENT_TAG: tag} if tag else None, timeout_s=timeout_s,
                                    sim_output_tokens=max(1, out))
            e2e.append(r.e2e_s)
            if answers is not None:
                answers.append(r)
        except Exception as exc:  # every failure is counted, none ends the replay
            code = _failure_code(exc)
            failures[code] = failures.get(code, 0) + 1
            rejected += isinstance(exc, RequestRejected)

    start_s = float(trace.arrival_s[0]) if len(trace) else 0.0
    try:
        async with asyncio.TaskGroup() as tg:
            for i in range(len(trace)):
                tg.create_task(one(i, float(trace.arrival_s[i]) - start_s, int(trace.input_tokens[i]),
                                   int(trace.output_tokens[i]), int(trace.max_tokens[i]), int(trace.client_ids[i])))
        wall_s = time.monotonic() - t0
        if settle_s > 0:
            await asyncio.sleep(settle_s)  # answers that still come are duplicates or late
    finally:
        if sub is not None:
            try:
                await sub.unsubscribe()
            except (nats.errors.Error, OSError):
                pass
    after = _replay_counters(client)
    e2e.sort()
    lost = sum(failures.values()) - rejected
    return {
        "requests": len(trace),
        "sent": sent,
        "answered": len(e2e),
        "errors": rejected,
        "error_codes": dict(sorted(failures.items())),
        "lost": lost,
        "unaccounted": sent - len(e2e) - rejected - lost,
        "duplicates": after["duplicates"] - before["duplicates"],
        "late": after["late"] - before["late"],
        "resent": after["resent"] - before["resent"],
        "reconnects": after["reconnects"] - before["reconnects"],
        "switches": switches["changed"] if sub is not None else None,
        "switch_events": switches if sub is not None else None,
        "p50_s": e2e[len(e2e) // 2] if e2e else math.nan,
        "p99_s": e2e[min(len(e2e) - 1, int(0.99 * len(e2e)))] if e2e else math.nan,
        "wall_s": wall_s,
        "speedup": speedup,
    }


def _failure_code(exc: Exception) -> str:
    """The code a failed request of `replay` is counted under: a client error's `code` (the system's
    `ErrorCode` for a rejection), else `unexpected:<type>` (logged: a bug, not an outcome)."""
    if isinstance(exc, ClientError):
        return exc.code
    import logging

    logging.getLogger("oserve.replay").error("replay: a request failed unexpectedly: %r", exc)
    return f"unexpected:{type(exc).__name__}"


def _replay_counters(client: OServeClient) -> dict[str, int]:
    """The client's counters `replay` reports the change of."""
    return {"duplicates": client.num_duplicates, "late": client.num_late, "resent": client.num_resent,
            "reconnects": reconnects(client.nc)}


async def connect(url: str, name: str, *, inbox_prefix: str | None = None) -> NATS:
    """A worker connection with reconnects and logged disconnects; `inbox_prefix` (None: nats-py's `_INBOX`)
    is where the answers to its own requests come (the HTTP front's role may read only its own)."""
    import logging

    log = logging.getLogger("oserve.nats")

    async def disconnected() -> None:
        log.info("%s: disconnected from NATS", name)

    async def reconnected() -> None:
        log.warning("%s: reconnected to NATS", name)

    async def error(exc: Exception) -> None:
        log.warning("%s: NATS error: %s", name, exc)

    # a quarter second between attempts (nats-py's default is 2 s): a worker back soon after the server is
    # what lets a client's resend after its own reconnect (`ReconnectPolicy.resend_delay_s`) find the answers
    # the engines buffered while cut off, rather than draw second ones
    extra = {"inbox_prefix": inbox_prefix} if inbox_prefix else {}
    # 64 MiB of publishes buffered through an outage (nats-py's default, 2 MiB, is a few seconds of an
    # engine's answers; past it a publish raises and the worker's loop stops)
    return await nats.connect(url, name=name, disconnected_cb=disconnected, reconnected_cb=reconnected,
                              error_cb=error, max_reconnect_attempts=-1, reconnect_time_wait=0.25,
                              pending_size=64 * 1024 * 1024, **extra)
