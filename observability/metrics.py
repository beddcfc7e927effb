"""Prometheus metrics of the live workers: one `Metrics` on a registry it is handed, served at `/metrics`.

Names follow vLLM's where they mean the same (`vllm:*`, labels `model_name` and `engine`, vLLM's bucket
edges), so a dashboard built for vLLM reads an OServe engine; OServe's own are `oserve_*`. Each worker
takes a `Metrics | None` (None: no metrics, the fast path) and observes where the event happens: the
engine when a request finishes and at each heartbeat, the forecaster stage on each forecast, the
scheduler on each decision, the switch planner on each switch, the gateway on accept, reject and
re-dispatch. Histograms, not hand-made percentiles: Prometheus computes quantiles over any window.

Two clocks: latencies measured by an engine (TTFT, TPOT, end to end) and per-second rates of the
forecaster are on the system's clock, which runs `--speedup` times faster than the wall clock (with
the `sim` backend at speedup 20 a 20 s TTFT took one wall second); decision and switch durations are
wall seconds. Each HELP text says which.

No global registry (prometheus_client's default one is a hidden global): the caller creates a
`CollectorRegistry`, hands it here and to `MetricsServer`.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

# vLLM's bucket edges (vllm/v1/metrics/loggers.py, PrometheusStatLogger), seconds
TTFT_BUCKETS_S: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS_S: tuple[float, ...] = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                     7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S: tuple[float, ...] = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# OServe's own: a decision is budgeted a tenth of a span (0.3 s in the demo, 6 s at 1x); a switch takes
# seconds to a minute (the paper: about 10 s GPU-to-GPU, over 50 s reloading)
DECISION_BUCKETS_S: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SWITCH_BUCKETS_S: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)

FINISHED_REASONS: tuple[str, ...] = ("stop", "length", "abort")
"""vLLM's `FinishReason` values: the answer ended by itself, hit max tokens, or was cut off (here: the
engine stopped with it in flight)."""

CLOCK = "clock seconds: the system clock runs --speedup times faster than wall time"
WALL = "wall seconds"

_ENGINE = ("model_name", "engine")


class Metrics:
    """The instruments of one process's workers, on `registry` (no global state)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        # --- engines: vLLM's names, labels and buckets
        self.num_requests_running = Gauge("vllm:num_requests_running", "Number of requests in model execution "
                                          "batches (sampled at each heartbeat).", _ENGINE, registry=r)
        self.num_requests_waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be "
                                          "processed (sampled at each heartbeat).", _ENGINE, registry=r)
        self.kv_cache_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage "
                                    "(sampled at each heartbeat).", _ENGINE, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", f"Histogram of time to first token in seconds "
                              f"({CLOCK}).", _ENGINE, buckets=TTFT_BUCKETS_S, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", f"Histogram of e2e request latency in seconds, "
                             f"from the engine's receipt to its answer ({CLOCK}).", _ENGINE, buckets=E2E_BUCKETS_S,
                             registry=r)
        # per request, as vLLM's request_time_per_output_token_seconds (its time_per_output_token_seconds
        # is per token, a deprecated alias of inter_token_latency_seconds: not what is measured here)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", f"Histogram of time_per_output_token_"
                              f"seconds per request: one observation per request of two or more tokens, "
                              f"(e2e - ttft) / (output tokens - 1) ({CLOCK}).", _ENGINE, buckets=TPOT_BUCKETS_S,
                              registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", _ENGINE,
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         _ENGINE, registry=r)
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests "
                                       "(finished_reason: stop, length, abort).", (*_ENGINE, "finished_reason"),
                                       registry=r)
        # --- forecaster stage
        self.observed_rps = Gauge("oserve_observed_requests_per_second", "Arrivals of each type (as classed at "
                                  "arrival) per second over the last span closed (per clock second).", ("type",),
                                  registry=r)
        self.forecast_rps = Gauge("oserve_forecast_requests_per_second", "Forecast arrivals of each type per "
                                  "second for the next span (per clock second).", ("type",), registry=r)
        self.forecast_rrmse = Gauge("oserve_forecast_relative_rmse", "Each forecaster's relative RMSE over the "
                                    "recent spans (a fraction; 0.05 is 5%).", ("forecaster",), registry=r)
        self.forecasts = Counter("oserve_forecasts", "Forecasts made, by the forecaster in force.", ("forecaster",),
                                 registry=r)
        self.misclassified = Gauge("oserve_misclassified_ratio", "Fraction of the last span's completions whose "
                                   "true type differs from the class they were routed as.", registry=r)
        # --- scheduler
        self.decisions = Counter("oserve_strategy_decisions", "Strategy decisions, by the planner's label.",
                                 ("label",), registry=r)
        self.decision_seconds = Histogram("oserve_strategy_decision_seconds", f"Time one strategy decision took "
                                          f"({WALL}).", buckets=DECISION_BUCKETS_S, registry=r)
        self.decisions_over_budget = Counter("oserve_strategy_decisions_over_budget", "Decisions (after the first) "
                                             "that took longer than their budget of a fraction of a span.",
                                             registry=r)
        # --- switch planner: the deployment serving, and the switches to it
        self.replicas = Gauge("oserve_deployment_replicas", "Replicas of the deployment serving, by shape "
                              "(tensor- and pipeline-parallel degree).", ("tp", "pp"), registry=r)
        self.gpus_in_use = Gauge("oserve_deployment_gpus", "GPUs held by the deployment serving.", registry=r)
        self.switches = Counter("oserve_switches", "Switches between deployments, by outcome (completed, "
                                "rolled_back).", ("outcome",), registry=r)
        self.switch_seconds = Histogram("oserve_switch_duration_seconds", f"Time from a switch's start to its "
                                        f"completion or roll-back ({WALL}).", buckets=SWITCH_BUCKETS_S, registry=r)
        # --- gateway
        self.accepted = Counter("oserve_requests_accepted", "Requests the gateway accepted (and owns until "
                                "answered).", registry=r)
        self.rejected = Counter("oserve_requests_rejected", "Requests the gateway refused at arrival, by error "
                                "code.", ("code",), registry=r)
        self.failed = Counter("oserve_requests_failed", "Accepted requests the gateway answered with an error "
                              "(no replica took them), by error code.", ("code",), registry=r)
        self.redispatched = Counter("oserve_requests_redispatched", "Requests dispatched again because their "
                                    "replica went silent.", registry=r)
        self.gateway_inflight = Gauge("oserve_gateway_inflight_requests", "Requests a gateway owns now "
                                      "(forwarded or held, not answered yet).", ("gateway",), registry=r)
        # --- the OpenAI-compatible HTTP front
        self.http_requests = Counter("oserve_http_requests", "Requests to the OpenAI-compatible HTTP front, by "
                                     "endpoint and HTTP status.", ("endpoint", "status"), registry=r)
        self.http_seconds = Histogram("oserve_http_request_duration_seconds", f"Time from a request's arrival at "
                                      f"the HTTP front to its last byte, streamed answers included ({WALL}), by "
                                      f"endpoint.", ("endpoint",), buckets=E2E_BUCKETS_S, registry=r)
        self._shapes: set[tuple[str, str]] = set()  # (tp, pp) label pairs of the deployment last set

    # --- engines -------------------------------------------------------------------------------------

    def engine_load(self, model_name: str, engine: str, *, num_running: int, num_waiting: int,
                    kv_usage_frac: float) -> None:
        self.num_requests_running.labels(model_name, engine).set(num_running)
        self.num_requests_waiting.labels(model_name, engine).set(num_waiting)
        self.kv_cache_usage.labels(model_name, engine).set(kv_usage_frac)

    def request_finished(self, model_name: str, engine: str, *, input_tokens: int, output_tokens: int,
                         ttft_s: float, e2e_s: float, finished_reason: str) -> None:
        """One answered request (latencies in clock seconds)."""
        labels = (model_name, engine)
        self.ttft.labels(*labels).observe(ttft_s)
        self.e2e.labels(*labels).observe(e2e_s)
        if output_tokens > 1:
            self.tpot.labels(*labels).observe((e2e_s - ttft_s) / (output_tokens - 1))
        self.prompt_tokens.labels(*labels).inc(input_tokens)
        self.generation_tokens.labels(*labels).inc(output_tokens)
        self.request_success.labels(*labels, finished_reason).inc()

    def request_aborted(self, model_name: str, engine: str) -> None:
        self.request_success.labels(model_name, engine, "abort").inc()

    def engine_stopped(self, model_name: str, engine: str) -> None:
        """Forget a retired engine's series, all of them: every switch names its new replicas afresh
        (`<strategy>-rK`), so series kept after retirement would grow with the system's uptime. A scraper
        sees the series end, as it sees a pod's end; what the engine observed after the last scrape is lost."""
        for family in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage, self.ttft,
                       self.e2e, self.tpot, self.prompt_tokens, self.generation_tokens):
            try:
                family.remove(model_name, engine)
            except KeyError:  # never observed
                pass
        for reason in FINISHED_REASONS:
            try:
                self.request_success.remove(model_name, engine, reason)
            except KeyError:
                pass

    # --- forecaster stage ------------------------------------------------------------------------------

    def forecast_made(self, *, type_names: Sequence[str], observed_rps: Sequence[float],
                      forecast_rps: Sequence[float], recent_rrmse: Mapping[str, float], misclassified_frac: float,
                      forecaster: str) -> None:
        """One closed span: its observed rates, the next span's forecast (per clock second), the errors."""
        for name, observed, forecast in zip(type_names, observed_rps, forecast_rps):
            self.observed_rps.labels(name).set(observed)
            self.forecast_rps.labels(name).set(forecast)
        for kind, err in recent_rrmse.items():
            self.forecast_rrmse.labels(kind).set(err)
        self.misclassified.set(misclassified_frac)
        self.forecasts.labels(forecaster).inc()

    # --- scheduler -------------------------------------------------------------------------------------

    def decision_made(self, label: str, wall_s: float, *, over_budget: bool) -> None:
        self.decisions.labels(label).inc()
        self.decision_seconds.observe(wall_s)
        if over_budget:
            self.decisions_over_budget.inc()

    # --- switch planner --------------------------------------------------------------------------------

    def deployment_serving(self, shapes: Iterable[tuple[int, int]]) -> None:
        """The deployment now serving, as its replicas' (tp, pp); shapes it no longer has are dropped."""
        counts: dict[tuple[str, str], int] = {}
        gpus = 0
        for tp, pp in shapes:
            key = (str(tp), str(pp))
            counts[key] = counts.get(key, 0) + 1
            gpus += tp * pp
        for key in self._shapes - counts.keys():
            self.replicas.remove(*key)
        for key, n in counts.items():
            self.replicas.labels(*key).set(n)
        self._shapes = set(counts)
        self.gpus_in_use.set(gpus)

    def switch_done(self, outcome: str, wall_s: float) -> None:
        """A switch that completed or rolled back after `wall_s` wall seconds."""
        self.switches.labels(outcome).inc()
        self.switch_seconds.observe(wall_s)

    # --- gateway ---------------------------------------------------------------------------------------

    def http_request(self, endpoint: str, status: int, wall_s: float) -> None:
        """One request the HTTP front answered (a streamed one when its stream ended)."""
        self.http_requests.labels(endpoint, str(status)).inc()
        self.http_seconds.labels(endpoint).observe(wall_s)

    def track_inflight(self, gateway_id: str, count: Callable[[], int]) -> None:
        """Report `count()` (read at scrape time, on the server's thread) as the gateway's in-flight requests."""
        self.gateway_inflight.labels(gateway_id).set_function(count)

    def untrack_inflight(self, gateway_id: str) -> None:
        try:
            self.gateway_inflight.remove(gateway_id)
        except KeyError:
            pass


class MetricsServer:
    """`/metrics` of one registry over HTTP, on a thread of its own (prometheus_client's server).

    `port` 0 binds a free port (tests); `start()` returns the port bound and raises `OSError` when it is
    taken. `stop()` is idempotent.
    """

    def __init__(self, registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"MetricsServer: port must be in 0..65535, got {port}")
        self.registry, self.port, self.addr = registry, port, addr
        self._server = None
        self._thread = None

    def start(self) -> int:
        if self._server is None:
            self._server, self._thread = start_http_server(self.port, self.addr, registry=self.registry)
            self.port = self._server.server_address[1]
        return self.port

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.addr in ("0.0.0.0", "", "::") else self.addr
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
