"""The simulator against a real engine: the pure half of `oserve bench fidelity`.

`oserve.workers.fidelity_bench` measures a real vLLM engine (its iteration times, then a trace replayed on
it); this module fits the performance model to those iteration times, builds the simulated replica that
stands for that engine, and scores the simulator's replay of the same trace against the real one. No clock,
no engine, no files: every input is handed in.

The fit, as `oserve.calibration` fits the H100 profiles: the same cost formulas (`oserve.perfmodel`: GEMM
roofline, element-wise operators, first-principles attention, a fixed engine overhead per iteration), their
free factors fitted by least squares on the relative (log) error of whole iterations, held-out points scored.
What differs is what can be measured: on an engine's public API a profile is an iteration, not one
operator, so the factors are fitted to iteration times:

- `iteration_overhead_s`: engine time per iteration outside the model (scheduling, launching the step);
- `prefill_overhead_s`: engine time per prompt with a chunk in the iteration (the CPU engine's prefill path runs
  attention prompt by prompt; a 16-token prompt alone costs 4 ms more than one decode step there);
- `sequence_overhead_s`: engine time per sequence that gets a token (sampling over the vocabulary, the hand-off
  of its output to the caller);
- `eff_flops`, `eff_bw`: the GEMM roofline's shares of the host's measured matrix-multiply and memory rates
  (`host_spec`), with the roofline's exponent and launch time kept from the H100 fit;
- `prefill_flops_frac`, `decode_bw_frac`: attention's shares of the same rates (prefill pairs, KV reads);
- `elementwise_scale`: the H100-fitted element-wise costs, scaled (norms, rotary, activation, residual).

The weights' read and the overhead are both a fixed cost per iteration for one model, so the data cannot
tell them apart; a weak prior (`FitConfig.prior_weight`) keeps `eff_bw` near the measured memory rate and
the rest goes to the overhead. The replay's metrics are those a client sees: time to the first token, time
per output token (a request's decode time over its tokens after the first), end-to-end latency, at P50 and
P99, and throughput; `against_repeat` sets them beside the real engine's own repeatability on the same requests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
from scipy.optimize import least_squares

from oserve.decision import Decision
from oserve.errors import ConfigError
from oserve.perfmodel import AttentionModel, Batch, PerfModel, shipped_coefficients
from oserve.routing import least_loaded
from oserve.sim.kernel import SimConfig, simulate
from oserve.specs import (ClusterSpec, Deployment, EngineConfig, GPUSpec, MemoryConfig, ModelSpec, Replica, ReplicaShape,
                          stage_kv_bytes_per_token, stage_weight_bytes)
from oserve.traces import Trace

PREFILL, DECODE = "prefill", "decode"
FIT_PARAMETERS = ("iteration_overhead_s", "prefill_overhead_s", "sequence_overhead_s", "eff_flops", "eff_bw", "prefill_flops_frac", "decode_bw_frac",
                  "elementwise_scale")
P50_TARGET, P99_TARGET, THROUGHPUT_TARGET = 0.15, 0.25, 0.15
"""The issue's targets: the simulator's P50s within 15% of the real engine's, P99s within 25%; throughput is
held to the P50's bound."""


@dataclass(frozen=True, slots=True)
class ProfilePoint:
    """One measured iteration kind: `batch` prompts of `tokens` tokens prefilled in one iteration (nothing cached),
    or `batch` sequences decoding one token each at a context of `tokens`."""

    kind: str
    batch: int
    tokens: float
    seconds: float
    """The median of the measured iteration times (wall seconds)."""
    samples: int = 1

    def __post_init__(self) -> None:
        if self.kind not in (PREFILL, DECODE):
            raise ConfigError(f"ProfilePoint.kind must be {PREFILL!r} or {DECODE!r}, got {self.kind!r}")
        if self.batch < 1 or not self.tokens >= 1 or not self.seconds > 0 or not math.isfinite(self.seconds):
            raise ConfigError(f"ProfilePoint: batch and tokens must be >= 1 and seconds positive and finite, got "
                              f"{self.batch}, {self.tokens} and {self.seconds}")

    def as_batch(self) -> Batch:
        if self.kind == PREFILL:
            n = int(round(self.tokens))
            return Batch.of([(n, 0)] * self.batch)
        return Batch(num_tokens=self.batch, num_decode_seqs=self.batch,
                     decode_context_tokens=int(round(self.batch * self.tokens)), num_logit_rows=self.batch)


@dataclass(frozen=True, slots=True)
class FitConfig:
    """How the engine's iteration model is fitted."""

    prior_weight: float = 0.1
    """Weight of the prior that keeps `eff_bw` at the host's measured memory rate, against the log residuals of
    the points (see the module docstring: the weights' read and the overhead are not separable)."""
    holdout_every: int = 4
    """Every this-many-th point (in the order given) is held out of the scoring fit; 0: none held out."""

    def __post_init__(self) -> None:
        if self.prior_weight < 0 or self.holdout_every < 0 or self.holdout_every == 1:
            raise ConfigError(f"FitConfig: prior_weight must be >= 0 and holdout_every 0 or >= 2, got "
                              f"{self.prior_weight} and {self.holdout_every}")


@dataclass(frozen=True, slots=True)
class EngineFit:
    """The fitted factors and how well they predict the profile."""

    params: dict[str, float]
    """`FIT_PARAMETERS` -> value."""
    mape: float
    """Mean absolute relative error over every point, the fit on every point."""
    holdout_mape: float
    """The same over the held-out points, fitted without them (NaN when none is held out)."""
    predicted_s: tuple[float, ...] = field(default_factory=tuple)
    """The full fit's time for each point, in the order given."""

    def to_dict(self) -> dict:
        return {"params": dict(self.params), "mape": self.mape, "holdout_mape": self.holdout_mape}


def is_cpu_host(gpu: GPUSpec) -> bool:
    """Whether `gpu` is a CPU host as `host_spec` names it (`cpu-<dtype>`): its matrix multiplies pad no rows to
    a GPU kernel's tile. On an AVX2 host (bfloat16 at 20 GFLOP/s) a decode step of one sequence padded to 128
    rows was predicted at 0.14 s against 0.007 s measured, and no factor within bounds could fit it."""
    return gpu.name == "cpu" or gpu.name.startswith("cpu-")


def host_spec(name: str, matmul_flops: float, memory_bytes_per_s: float, memory_bytes: int) -> GPUSpec:
    """The host a CPU engine runs on, as the performance model's device: its measured matrix-multiply rate in the
    engine's dtype as the peak, its measured copy rate as the memory bandwidth. Pure."""
    return GPUSpec(name, memory_bytes=int(memory_bytes), hbm_bytes_per_s=float(memory_bytes_per_s),
                   peak_flops=float(matmul_flops))


def perf_model(model: ModelSpec, gpu: GPUSpec, params: dict[str, float]) -> PerfModel:
    """The performance model with the fitted factors (`FIT_PARAMETERS`) on `gpu`. Pure."""
    base = shipped_coefficients()
    # The H100's element-wise costs, moved to this device's memory rate, then scaled by the fit.
    scale = params["elementwise_scale"] * base["gpu"]["hbm_bytes_per_s"] / gpu.hbm_bytes_per_s
    coefficients = {
        "source": "fitted to a real engine's iteration times (oserve bench fidelity)",
        "gpu": {"name": gpu.name, "peak_flops": gpu.peak_flops, "hbm_bytes_per_s": gpu.hbm_bytes_per_s},
        "gemm": {**base["gemm"], "eff_flops": params["eff_flops"], "eff_bw": params["eff_bw"],
                 **({"tile_rows": 1} if is_cpu_host(gpu) else {})},
        "elementwise": {op: {"a_s": c["a_s"] * params["elementwise_scale"], "b_s_per_elem": c["b_s_per_elem"] * scale}
                        for op, c in base["elementwise"].items()},
        "collectives": base["collectives"],
    }
    attention = replace(AttentionModel(), prefill_flops_frac=params["prefill_flops_frac"],
                        decode_bw_frac=params["decode_bw_frac"])
    return PerfModel(model, gpu, iteration_overhead_s=params["iteration_overhead_s"],
                     prefill_overhead_s=params.get("prefill_overhead_s", 0.0),
                     sequence_overhead_s=params["sequence_overhead_s"],
                     attention=attention, coefficients=coefficients)


def predict(model: ModelSpec, gpu: GPUSpec, params: dict[str, float], points: list[ProfilePoint],
            shape: ReplicaShape = ReplicaShape(1, 1)) -> np.ndarray:
    """The model's iteration time of each point. Pure."""
    timer = perf_model(model, gpu, params).timer(shape)
    return np.array([timer.iteration_seconds(p.as_batch()) for p in points])


_START = {"iteration_overhead_s": 2e-3, "prefill_overhead_s": 1e-3, "sequence_overhead_s": 1e-5, "eff_flops": 0.5, "eff_bw": 1.0, "prefill_flops_frac": 0.3,
          "decode_bw_frac": 0.5, "elementwise_scale": 1.0}
_BOUNDS = {"iteration_overhead_s": (1e-6, 10.0), "prefill_overhead_s": (1e-7, 10.0), "sequence_overhead_s": (1e-9, 1.0), "eff_flops": (1e-4, 1.0),
           "eff_bw": (1e-3, 2.0), "prefill_flops_frac": (1e-5, 1.0), "decode_bw_frac": (1e-5, 2.0),
           "elementwise_scale": (1e-3, 1e5)}
"""No share of the host's measured matrix-multiply rate above 1; memory rates up to twice the measured copy rate
(caches: the H100 fit's `eff_bw` is 1.42, see `oserve.calibration.fit_gemm`)."""


def _fit(model: ModelSpec, gpu: GPUSpec, points: list[ProfilePoint], prior_weight: float,
         shape: ReplicaShape) -> dict[str, float]:
    measured = np.log(np.array([p.seconds for p in points]))
    weights = np.ones(len(points))  # each point its median; a decode point has far more samples, not more weight

    def params_of(x: np.ndarray) -> dict[str, float]:
        return {k: float(math.exp(v)) for k, v in zip(FIT_PARAMETERS, x)}

    def residuals(x: np.ndarray) -> np.ndarray:
        pred = predict(model, gpu, params_of(x), points, shape)
        prior = prior_weight * x[FIT_PARAMETERS.index("eff_bw")]  # log(eff_bw) toward 0: the measured rate
        return np.append(weights * (np.log(pred) - measured), prior)

    lo = [math.log(_BOUNDS[k][0]) for k in FIT_PARAMETERS]
    hi = [math.log(_BOUNDS[k][1]) for k in FIT_PARAMETERS]
    x0 = np.clip([math.log(_START[k]) for k in FIT_PARAMETERS], lo, hi)
    return params_of(least_squares(residuals, x0, bounds=(lo, hi)).x)


def fit_engine(model: ModelSpec, gpu: GPUSpec, points: list[ProfilePoint], config: FitConfig = FitConfig(),
               shape: ReplicaShape = ReplicaShape(1, 1)) -> EngineFit:
    """Fit `FIT_PARAMETERS` to a profile of one replica of `shape` (see the module docstring). Pure and
    deterministic.

    Raises:
        ConfigError: fewer points than parameters.
    """
    if len(points) < len(FIT_PARAMETERS):
        raise ConfigError(f"fit_engine: {len(points)} profile points for {len(FIT_PARAMETERS)} parameters")
    params = _fit(model, gpu, points, config.prior_weight, shape)
    measured = np.array([p.seconds for p in points])
    pred = predict(model, gpu, params, points, shape)
    mape = float(np.mean(np.abs(pred / measured - 1.0)))
    holdout = math.nan
    if config.holdout_every:
        held = np.arange(len(points)) % config.holdout_every == config.holdout_every - 1
        train = [p for p, h in zip(points, held) if not h]
        test = [p for p, h in zip(points, held) if h]
        if test and len(train) >= len(FIT_PARAMETERS):
            part = _fit(model, gpu, train, config.prior_weight, shape)
            got = predict(model, gpu, part, test, shape)
            holdout = float(np.mean(np.abs(got / np.array([p.seconds for p in test]) - 1.0)))
    return EngineFit(params, mape, holdout, tuple(float(x) for x in pred))


def engine_memory(model: ModelSpec, shape: ReplicaShape, kv_tokens: int, block_tokens: int) -> tuple[int, MemoryConfig]:
    """(device bytes, memory config) under which the simulator's replica of `shape` holds exactly `kv_tokens`
    tokens of KV cache in blocks of `block_tokens`, as the real engine reported. Pure."""
    if kv_tokens < block_tokens or block_tokens < 1:
        raise ConfigError(f"engine_memory: kv_tokens ({kv_tokens}) must hold at least one block of {block_tokens}")
    need = max(w + kv_tokens * kv for w, kv in zip(stage_weight_bytes(model, shape),
                                                   stage_kv_bytes_per_token(model, shape)))
    return int(need), MemoryConfig(gpu_memory_utilization=1.0, reserve_bytes=0, min_kv_tokens=0,
                                   block_tokens=block_tokens)


def engine_config(max_num_seqs: int, max_num_batched_tokens: int, chunked_prefill: bool) -> EngineConfig:
    """The simulated engine's batching, as the real engine reported its scheduler's: vLLM's V1 scheduler admits a
    prompt a chunk at a time (`admit_whole_prompt=False`). Pure."""
    return EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        chunked_prefill=chunked_prefill, admit_whole_prompt=False)


# --- scoring a replay --------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ReplayRecord:
    """What a client saw of each request of one replay (arrays in the trace's order; NaN: never happened)."""

    arrival_s: np.ndarray
    """Seconds from the replay's start at which each request was sent."""
    ttft_s: np.ndarray
    e2e_s: np.ndarray
    output_tokens: np.ndarray
    """Tokens each request received."""

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if any(len(a) != n for a in (self.ttft_s, self.e2e_s, self.output_tokens)):
            raise ConfigError("ReplayRecord: columns differ in length")

    @property
    def tpot_s(self) -> np.ndarray:
        """Per request with two tokens or more: seconds per output token after the first."""
        n = self.output_tokens.astype(float)
        ok = n >= 2
        return (self.e2e_s[ok] - self.ttft_s[ok]) / (n[ok] - 1.0)

    @property
    def finished(self) -> int:
        return int(np.isfinite(self.e2e_s).sum())

    def throughput(self) -> tuple[float, float]:
        """(requests, output tokens) a second, from the first send to the last answer."""
        done = np.isfinite(self.e2e_s)
        if not done.any():
            return 0.0, 0.0
        span = float((self.arrival_s[done] + self.e2e_s[done]).max() - self.arrival_s.min())
        span = max(span, 1e-9)
        return float(done.sum()) / span, float(self.output_tokens[done].sum()) / span

    def metrics(self) -> dict[str, float]:
        """P50 and P99 of TTFT, TPOT and end-to-end latency (finished requests), and throughput."""
        done = np.isfinite(self.e2e_s)
        out: dict[str, float] = {}
        for name, values in (("ttft", self.ttft_s[done]), ("tpot", self.tpot_s[np.isfinite(self.tpot_s)]),
                             ("e2e", self.e2e_s[done])):
            for q in (50, 99):
                out[f"{name}_p{q}_s"] = float(np.percentile(values, q)) if len(values) else math.nan
        out["throughput_rps"], out["throughput_tokens_s"] = self.throughput()
        return out


def compare(real: ReplayRecord, simulated: ReplayRecord) -> dict:
    """Each metric of `ReplayRecord.metrics`, real and simulated, with the simulator's relative error
    (simulated / real - 1) and whether it is within the target (P50 and throughput 15%, P99 25%). Pure."""
    r, s = real.metrics(), simulated.metrics()
    rows = {}
    for key in r:
        target = P99_TARGET if "_p99_" in key else P50_TARGET if "_p50_" in key else THROUGHPUT_TARGET
        err = s[key] / r[key] - 1.0 if r[key] > 0 else math.nan
        rows[key] = {"real": r[key], "simulated": s[key], "error": err, "target": target,
                     "within": bool(math.isfinite(err) and abs(err) <= target)}
    return {"metrics": rows, "within_targets": all(v["within"] for v in rows.values()),
            "real_finished": real.finished, "simulated_finished": simulated.finished, "requests": len(real.arrival_s)}


def against_repeat(simulated: dict, repeat: dict) -> dict:
    """The simulator's errors (`compare(real, simulated)`) judged beside the engine's own repeatability: `repeat` is
    `compare(real, real_again)`, the same requests replayed once more on the same engine. Per metric, the bound is
    the larger of the target and the repeat's own error, and the simulator is within the engine's noise when its
    error is within that bound: no check can hold a simulator closer to an engine than the engine holds to itself.
    Pure."""
    rows = {}
    for key, m in simulated["metrics"].items():
        noise = repeat["metrics"][key]["error"]
        bound = max(m["target"], abs(noise)) if math.isfinite(noise) else m["target"]
        rows[key] = {"error": m["error"], "repeat_error": noise, "bound": bound,
                     "within": bool(math.isfinite(m["error"]) and abs(m["error"]) <= bound)}
    return {"metrics": rows, "within": all(v["within"] for v in rows.values())}


# --- the simulated replay -----------------------------------------------------------------------------------

class _OneReplica:
    """The simulator's policy for the bench: the engine under test as one TP1 replica from the start, every request
    sent to it (the kernel's `Policy`)."""

    name = "one-replica"

    def __init__(self) -> None:
        self.deployment = Deployment((Replica("r0", ReplicaShape(1, 1), (0,)),))

    def decide(self, view):
        if view.current is not None:
            return None
        return Decision(self.deployment, ((1.0,),), 0.0, (), "fidelity")

    def classify(self, arrival) -> int:
        return 0

    def route(self, class_index: int, loads) -> int | None:
        return least_loaded(loads, None)


def replay_simulated(model: ModelSpec, gpu: GPUSpec, engine: EngineConfig, memory: MemoryConfig, perf,
                     arrival_s: np.ndarray, input_tokens: np.ndarray, output_tokens: np.ndarray) -> ReplayRecord:
    """The same requests on the simulator's replica (one TP1 replica, the same batching and KV cache). Pure."""
    trace = Trace(arrival_s, input_tokens, output_tokens, name="fidelity", max_tokens=output_tokens)
    cluster = ClusterSpec("host", 1, 1, gpu, nvlink_bytes_per_s=1e9, network_bytes_per_s=1e9)
    result = simulate(model, gpu, cluster, trace, _OneReplica(), SimConfig(engine=engine, memory=memory), perf)
    fin = np.isfinite(result.e2e_s)
    return ReplayRecord(result.arrival_s - float(arrival_s[0]), np.where(np.isfinite(result.ttft_s), result.ttft_s, math.nan),
                        np.where(fin, result.e2e_s, math.nan), np.where(fin, result.generated_tokens, 0))


def capacity_rps(model: ModelSpec, gpu: GPUSpec, engine: EngineConfig, memory: MemoryConfig, perf,
                 input_tokens: np.ndarray, output_tokens: np.ndarray) -> float:
    """Requests a second the fitted model's replica serves of this mix: its throughput when all arrive at once."""
    burst = np.zeros(len(input_tokens))
    return replay_simulated(model, gpu, engine, memory, perf, burst, input_tokens, output_tokens).throughput()[0]


# --- a correction measured on another window -----------------------------------------------------------------

def calibration_loss(real: ReplayRecord, simulated: ReplayRecord) -> float:
    """Squared log ratio of the simulated replay's throughput (requests a second) to the real one's; inf when either
    served nothing. In a saturated replay that throughput is the engine's capacity on the mix: a figure linear in
    the engine's speed, unlike latencies near saturation, which a small error in speed moves by any amount."""
    r, s = real.throughput()[0], simulated.throughput()[0]
    return math.log(s / r) ** 2 if r > 0 and s > 0 else math.inf


def calibrate(real: ReplayRecord, simulate_at: Callable[[float], ReplayRecord], low: float = 0.125,
              high: float = 8.0, iterations: int = 30) -> float:
    """The factor x in [low, high] whose simulated replay of a calibration window (`simulate_at(x)`) comes closest
    to the real one (`calibration_loss`), by golden-section search over log x; among equal losses the one nearest 1.
    The bench calibrates the per-sequence engine time (`sequence_overhead_s`): what isolated iterations measure
    least well, since it grows with the requests in flight. Measured on one window, scored on another
    (`oserve.workers.fidelity_bench`). Pure, given a pure `simulate_at`."""
    if not 0 < low < high:
        raise ConfigError(f"calibrate: need 0 < low < high, got {low} and {high}")
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = math.log(low), math.log(high)
    cache: dict[float, float] = {}

    def loss(x: float) -> float:
        if x not in cache:
            cache[x] = calibration_loss(real, simulate_at(math.exp(x)))
        return cache[x]

    c, d = b - ratio * (b - a), a + ratio * (b - a)
    for _ in range(iterations):
        if loss(c) <= loss(d):
            b, d = d, c
            c = b - ratio * (b - a)
        else:
            a, c = c, d
            d = a + ratio * (b - a)
    best = min(cache, key=lambda x: (cache[x], abs(x)))
    return float(math.exp(best))


def with_sequence_factor(params: dict[str, float], factor: float) -> dict[str, float]:
    """The fitted factors with the per-sequence engine time multiplied by `factor` (the calibration's). Pure."""
    return {**params, "sequence_overhead_s": params["sequence_overhead_s"] * factor}
