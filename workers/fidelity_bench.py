"""`oserve bench fidelity`: the simulator's engine against a real vLLM engine on this host.

Four steps, one engine (a replica as the vLLM backend starts it: `VllmBackend`, the shipped model unless a
model folder is given):

1. **Profile.** Iteration times of the engine, through its public API: a batch of prompts sent at once with one
   token to generate (their prefill is one iteration when they fit the batch's token budget: the time to the
   last first token), and batches of sequences decoding (the gaps between tokens once every sequence of the
   batch has its first one: pure decode iterations). Every point is measured after a run of the same shape
   (the first run of a new shape builds its CPU kernels), `repeats` times; the median is kept.
2. **Fit** the performance model to the profile (`oserve.fidelity.fit_engine`) on the host's measured
   matrix-multiply and memory rates (`measure_host`).
3. **Calibrate** (unless `calibration_load` is 0): one overloaded replay of a window before the scored ones, on the
   real engine and on the simulator, sets the per-sequence engine time so that the simulated capacity on that
   window is the real one (`oserve.fidelity.calibrate`): isolated iterations measure it least well, since it grows
   with the requests in flight. The scored replays are simulated with and without it.
4. **Replay** the same short trace twice: on the real engine (each request sent at its arrival time, a prompt of
   random token ids of the trace's length, nothing shared between prompts, its answer the trace's length), and
   on the simulator's replica with the fitted model, the engine's own batching limits and KV cache size. Loads
   are fractions of the fitted model's capacity on that trace (the simulator's throughput when every request
   arrives at once), so the engine is tried light and busy on any host; nothing is tuned on the real replay.
5. **Score** TTFT, time per output token and end-to-end latency at P50 and P99, and throughput
   (`oserve.fidelity.compare`), and beside it the real engine's own repeatability: every load is replayed once,
   then every load again, and each second replay is scored against the first the same way
   (`oserve.fidelity.against_repeat`). Two more readings say how steady the host was: a few profile points measured
   again at the end (`drift`), and the share of CPU time the hypervisor stole during each replay (`cpu_steal`).

vLLM's engine core is a spawned process: the program that runs this needs the `if __name__ == "__main__":`
guard (the `oserve` command has it).
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from oserve.errors import ConfigError
from oserve.fidelity import (DECODE, PREFILL, FitConfig, ProfilePoint, ReplayRecord, against_repeat, calibrate,
                             capacity_rps, compare,
                             engine_config, engine_memory, fit_engine, host_spec, perf_model, replay_simulated,
                             with_sequence_factor)
from oserve.specs import ReplicaShape
from oserve.workers.vllm_backend import VllmBackend, VllmBackendConfig, served_model_spec

Progress = Callable[[str, float], None]
"""(what is being done, the fraction of the bench done)."""


@dataclass(frozen=True, slots=True)
class FidelityConfig:
    """One run of the bench."""

    model_path: str = ""
    """A local model folder; empty: the shipped small Llama."""
    dtype: str = "bfloat16"
    """The engine's weights and activations (`VllmBackendConfig.dtype`); the device's rates are measured in it."""
    max_model_len: int = 2048
    """The engine's context window (prompt plus answer)."""
    max_num_seqs: int = 64
    """The engine's batch limit in sequences (its token budget is vLLM's default, read back from the engine)."""
    loads: tuple[float, ...] = (0.4, 0.8, 1.3)
    """Replay rates as fractions of the fitted model's capacity on the trace: light, busy, and overloaded (where
    throughput is the engine's, not the offered rate)."""
    replay_s: float = 60.0
    """Seconds of arrivals per replay."""
    max_input_tokens: int = 1024
    """Prompts longer in the trace are cut to this."""
    max_output_tokens: int = 128
    """Answers longer in the trace are cut to this (each answer is as long as the trace's, cut)."""
    history_minutes: float = 10.0
    """The scored replays' window starts this far into the bundled Azure conversation hour; the calibration's
    window is before it."""
    calibration_load: float = 1.3
    """The calibration replay's rate as a fraction of capacity (0: no calibration): on the window before the scored
    ones, overloaded so that its throughput is the engine's capacity, it measures the per-sequence engine time under
    a real workload (`oserve.fidelity.calibrate`); the scored replays are simulated with it too, beside the profile's
    fit alone."""
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """Sequences decoding together, per decode point (those over `max_num_seqs` are skipped)."""
    decode_contexts: tuple[int, ...] = (32, 512, 1024)
    """Their prompts' length, per decode point."""
    decode_steps: int = 24
    """Tokens each decode point's sequences generate (the gaps between them are the iteration times)."""
    prefill_points: tuple[tuple[int, int], ...] = ((1, 16), (1, 64), (1, 128), (1, 256), (1, 512), (1, 768),
                                                    (1, 1024), (1, 1536), (1, 2000), (2, 256), (2, 512), (2, 1024),
                                                    (4, 64), (4, 256), (4, 512), (8, 32), (8, 128), (8, 256),
                                                    (16, 64), (16, 128), (32, 32))
    """(prompts, tokens each) sent at once; those over the engine's token budget are skipped."""
    repeats: int = 3
    """Runs per profile point; the median is kept."""
    real_repeats: int = 2
    """Replays of each scored load on the real engine, back to back: the first is what the simulator is scored
    against; the second measures the engine's own repeatability on the same requests (`oserve.fidelity.against_repeat`);
    1: no repeat."""
    seed: int = 0
    """Seed of the prompts' random token ids."""

    def __post_init__(self) -> None:
        if not self.loads or not all(0 < x <= 2 for x in self.loads) or not 0 <= self.calibration_load <= 2:
            raise ConfigError(f"FidelityConfig.loads must be fractions of capacity in (0, 2], got {self.loads}")
        if self.calibration_load and not self.history_minutes > 0:
            raise ConfigError("FidelityConfig: a calibration needs the window before history_minutes (> 0), got "
                              f"{self.history_minutes}")
        if not self.replay_s > 0 or self.repeats < 1 or self.decode_steps < 4 or self.real_repeats < 1:
            raise ConfigError(f"FidelityConfig: replay_s must be > 0, repeats and real_repeats >= 1 and decode_steps "
                              f">= 4, got {self.replay_s}, {self.repeats}, {self.real_repeats} and {self.decode_steps}")
        if self.max_input_tokens + self.max_output_tokens > self.max_model_len:
            raise ConfigError(f"FidelityConfig: max_input_tokens + max_output_tokens ({self.max_input_tokens} + "
                              f"{self.max_output_tokens}) exceed max_model_len {self.max_model_len}")


def measure_host(dtype: str, device: str = "cpu", seconds: float = 1.0) -> tuple[float, float]:
    """(matrix-multiply FLOP/s in `dtype`, copy bytes/s) of the device the engine runs on (`cpu`, or `cuda` on a GPU
    host), as torch reaches them: the rates the fitted model's factors are shares of. Run before any engine starts,
    so nothing competes."""
    import torch

    dt = getattr(torch, dtype)
    cuda = device.startswith("cuda")
    n, copy_bytes = (4096, 1 << 30) if cuda else (1024, 64 << 20)

    def rate(fn, units: float) -> float:
        def timed() -> float:
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - t0
        timed()
        best, spent = math.inf, 0.0
        while spent < seconds:
            dt_s = timed()
            best, spent = min(best, dt_s), spent + dt_s
        return units / best

    def matmul() -> float:
        # as the engine's layers multiply: activations by a weight stored (out, in), `F.linear`. On an AVX2 host
        # without native bfloat16 the two layouts differ 20x: `a @ b` of contiguous bfloat16 matrices ran at
        # 0.9 GFLOP/s there, `F.linear` at 20 (and the fit, held to shares of the first, was 100x off)
        x, w = torch.randn(n, n, dtype=dt, device=device), torch.randn(n, n, dtype=dt, device=device)
        return rate(lambda: torch.nn.functional.linear(x, w), 2.0 * n ** 3)

    def copy() -> float:
        src = torch.ones(copy_bytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        return rate(lambda: dst.copy_(src), 2.0 * copy_bytes)  # read and write

    flops, bandwidth = matmul(), copy()
    if cuda:  # the engine, another process, sizes its KV cache by the memory free when it starts
        torch.cuda.empty_cache()
    return flops, bandwidth


class _Engine:
    """The engine under test and a way to send it requests of random token ids."""

    def __init__(self, backend: VllmBackend, vocab_size: int, seed: int) -> None:
        self.backend = backend
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab_size
        self.count = 0

    def ids(self, n: int) -> list[int]:
        return self.rng.integers(100, self.vocab - 1, size=max(n, 1)).tolist()

    async def request(self, prompt_tokens: int, max_tokens: int, t0: float) -> list[float]:
        """Send one request; the times (perf_counter seconds after `t0`) at which each of its tokens came."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        self.count += 1
        stamps: list[float] = []
        async for out in self.backend.engine.generate({"prompt_token_ids": self.ids(prompt_tokens)}, params,
                                              f"fidelity-{self.count}"):
            if out.outputs:
                now = time.perf_counter() - t0
                stamps.extend(now for _ in out.outputs[0].token_ids)
        return stamps

    async def batch(self, n: int, prompt_tokens: int, max_tokens: int) -> list[list[float]]:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(self.request(prompt_tokens, max_tokens, t0) for _ in range(n))))


async def profile(eng: _Engine, cfg: FidelityConfig, budget_tokens: int, max_seqs: int,
                  progress: Callable[[float], None]) -> list[ProfilePoint]:
    """The engine's iteration times (see the module docstring, step 1)."""
    prefill = [(b, n) for b, n in cfg.prefill_points if b * n <= budget_tokens and b <= max_seqs
               and n + 1 <= cfg.max_model_len]

    def steps_of(b: int, c: int) -> int:
        # the first sequences keep decoding while the last ones are prefilled (ceil(b * c / budget) iterations)
        return cfg.decode_steps + -(-b * c // budget_tokens) + 1

    decode = [(b, c) for b in cfg.decode_batches for c in cfg.decode_contexts
              if b <= max_seqs and c + steps_of(b, c) <= cfg.max_model_len]
    total, done = len(prefill) + len(decode), 0
    points: list[ProfilePoint] = []
    for b, n in prefill:
        points.append(await _prefill_point(eng, b, n, cfg.repeats))
        done += 1
        progress(done / total)
    for b, c in decode:
        point = await _decode_point(eng, b, c, steps_of(b, c), cfg.repeats)
        if point is not None:
            points.append(point)
        done += 1
        progress(done / total)
    return points


async def _prefill_point(eng: _Engine, b: int, n: int, repeats: int) -> ProfilePoint:
    """`b` prompts of `n` tokens sent at once, one token each: the time to the last first token."""
    await eng.batch(b, n, 1)  # the shape's first run builds its kernels
    times = []
    for _ in range(repeats):
        stamps = await eng.batch(b, n, 1)
        times.append(max(s[0] for s in stamps))
    return ProfilePoint(PREFILL, b, n, statistics.median(times), len(times))


async def _decode_point(eng: _Engine, b: int, c: int, steps: int, repeats: int) -> ProfilePoint | None:
    """`b` sequences with `c`-token prompts decoding together: the gaps between tokens once all have their first."""
    per_step: list[float] = []
    contexts: list[float] = []
    for _ in range(repeats):
        stamps = await eng.batch(b, c, steps)
        start = max(s[0] for s in stamps)  # from here every sequence of the batch decodes,
        end = min(s[-1] for s in stamps)  # until the first one ends: pure decode iterations of b sequences
        for s in stamps:
            inside = [x for x in s if start <= x <= end]
            if len(inside) >= 2 and inside[-1] > inside[0]:  # tokens handed over together share a stamp
                per_step.append((inside[-1] - inside[0]) / (len(inside) - 1))
                contexts.append(c + sum(1 for x in s if x < start) + len(inside) / 2)
    if not per_step:
        return None
    return ProfilePoint(DECODE, b, statistics.fmean(contexts), statistics.median(per_step), len(per_step))


DRIFT_POINTS = ((PREFILL, 1, 512), (PREFILL, 1, 1024), (DECODE, 1, 512), (DECODE, 16, 512))
"""Profile points measured again after the replays (those the profile has): how far the engine's own speed moved
while the bench ran."""


async def drift(eng: _Engine, cfg: FidelityConfig, points: list[ProfilePoint]) -> dict:
    """The engine's speed at the end of the bench against its profile: `DRIFT_POINTS` measured again the same way;
    per point the ratio of the time now to the profile's, and their median (above 1: the engine got slower)."""
    rows = []
    for kind, b, n in DRIFT_POINTS:
        before = next((p for p in points if p.kind == kind and p.batch == b
                       and (p.tokens == n if kind == PREFILL else abs(p.tokens - n) < 64)), None)
        if before is None:
            continue
        if kind == PREFILL:
            now = await _prefill_point(eng, b, n, cfg.repeats)
        else:
            now = await _decode_point(eng, b, n, cfg.decode_steps + 2, cfg.repeats)
        if now is not None:
            rows.append({"kind": kind, "batch": b, "tokens": n, "profile_s": before.seconds, "now_s": now.seconds,
                         "ratio": now.seconds / before.seconds})
    return {"points": rows, "median_ratio": statistics.median(r["ratio"] for r in rows) if rows else None}


def cpu_steal() -> tuple[int, int] | None:
    """(steal, all) CPU ticks since boot from /proc/stat: time the hypervisor gave this machine's CPUs to others;
    None where there is no such file."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU time stolen by the hypervisor between two `cpu_steal` readings. Pure."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


async def replay_real(eng: _Engine, arrival_s: np.ndarray, input_tokens: np.ndarray, output_tokens: np.ndarray,
                      progress: Callable[[float], None]) -> ReplayRecord:
    """Send each request at its arrival time (seconds from the first); what the client saw of each."""
    n = len(arrival_s)
    ttft, e2e, got = np.full(n, math.nan), np.full(n, math.nan), np.zeros(n, dtype=np.int64)
    sent = np.full(n, math.nan)
    t0 = time.perf_counter()
    finished = 0

    async def one(i: int) -> None:
        nonlocal finished
        delay = float(arrival_s[i]) - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        start = time.perf_counter()
        sent[i] = start - t0
        stamps = await eng.request(int(input_tokens[i]), int(output_tokens[i]), start)
        if stamps:
            ttft[i], e2e[i], got[i] = stamps[0], stamps[-1], len(stamps)
        finished += 1
        progress(finished / n)

    await asyncio.gather(*(one(i) for i in range(n)))
    return ReplayRecord(sent, ttft, e2e, got)


def workload(cfg: FidelityConfig, calibration: bool = False):
    """The replays' requests, from the bundled conversation hour, prompts and answers cut to the bench's bounds, in
    their order: from `history_minutes` on for the scored replays; before it for the calibration. Pure."""
    from oserve.traces import load_trace

    trace = load_trace("azure-conv")
    h = cfg.history_minutes * 60.0
    part = trace.slice_time(0.0, h) if calibration else trace.slice_time(h, trace.duration_s + 1.0)
    inp = np.clip(part.input_tokens, 1, cfg.max_input_tokens)
    out = np.clip(part.output_tokens, 1, cfg.max_output_tokens)
    return part.arrival_s - float(part.arrival_s[0]), inp, out


def at_rate(arrival_s: np.ndarray, inp: np.ndarray, out: np.ndarray, rate_rps: float, seconds: float):
    """`rate_rps` x `seconds` requests from the start of the trace, their gaps scaled so that they arrive at
    `rate_rps` on average over `seconds` (the next request's arrival closes the window), keeping the trace's
    burstiness; all of them, scaled alike, when the trace has fewer. Pure."""
    if not rate_rps > 0 or not seconds > 0 or len(arrival_s) < 2:
        raise ConfigError(f"at_rate: need a positive rate and duration and two requests, got {rate_rps}, {seconds} and "
                          f"{len(arrival_s)}")
    n = min(max(int(round(rate_rps * seconds)), 1), len(arrival_s) - 1)
    span = max(float(arrival_s[n] - arrival_s[0]), 1e-9)
    t = (arrival_s[:n] - arrival_s[0]) * (n / rate_rps / span)
    return t, inp[:n], out[:n]


async def run(cfg: FidelityConfig, progress: Progress = lambda what, frac: None) -> dict:
    """The whole bench (see the module docstring); a JSON-ready dict."""
    started = time.perf_counter()
    from vllm.platforms import current_platform

    device = "cpu" if current_platform.is_cpu() else "cuda"
    progress(f"measuring the device ({device})", 0.0)
    flops, bandwidth = await asyncio.to_thread(measure_host, cfg.dtype, device)
    backend_cfg = VllmBackendConfig(model_path=cfg.model_path, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
                                    max_num_seqs=cfg.max_num_seqs)
    backend = VllmBackend("fidelity", backend_cfg, time.monotonic)
    progress("starting the vLLM engine", 0.02)
    await backend.start()
    try:
        return await _run(cfg, backend, backend_cfg, device, flops, bandwidth, started, progress)
    finally:
        await backend.stop()


async def _run(cfg: FidelityConfig, backend: VllmBackend, backend_cfg: VllmBackendConfig, device: str, flops: float,
               bandwidth: float, started: float, progress: Progress) -> dict:
    vc = backend.engine.vllm_config
    sched, cache = vc.scheduler_config, vc.cache_config
    budget, max_seqs = int(sched.max_num_batched_tokens), int(sched.max_num_seqs)
    chunked = bool(getattr(sched, "enable_chunked_prefill", True))
    block = int(cache.block_size)
    model = replace(served_model_spec(backend_cfg), max_context_tokens=cfg.max_model_len)
    eng = _Engine(backend, model.vocab_size, cfg.seed)
    await eng.batch(4, 32, 8)  # warm-up
    share = 0.35
    points = await profile(eng, cfg, budget, max_seqs, lambda f: progress("profiling iterations", 0.05 + share * f))
    mem_bytes, memory = engine_memory(model, ReplicaShape(1, 1), backend.kv_capacity_tokens, block)
    gpu = host_spec(f"{device}-{cfg.dtype}", flops, bandwidth, mem_bytes)
    progress("fitting the performance model", 0.05 + share)
    fit = fit_engine(model, gpu, points, FitConfig())
    perf = perf_model(model, gpu, fit.params)
    engine = engine_config(max_seqs, budget, chunked)
    arrival, inp, out = workload(cfg)
    sample = min(len(inp), 400)
    capacity = capacity_rps(model, gpu, engine, memory, perf, inp[:sample], out[:sample])
    if not capacity > 0:
        raise ConfigError("oserve bench fidelity: the fitted model's replica serves none of the trace's requests")
    n_replays = len(cfg.loads) * cfg.real_repeats + (1 if cfg.calibration_load else 0)
    step = (1.0 - 0.05 - share) / (n_replays + 0.5)  # half a replay's share for the drift check
    base = 0.05 + share

    def simulate_with(p, t, i, o) -> ReplayRecord:
        return replay_simulated(model, gpu, engine, memory, p, t, i, o)

    factor, calibration = 1.0, None
    if cfg.calibration_load:
        rate = cfg.calibration_load * capacity
        t, i, o = at_rate(*workload(cfg, calibration=True), rate, cfg.replay_s)
        before = cpu_steal()
        real = await replay_real(eng, t, i, o, lambda f: progress("calibration replay", base + step * f))
        cal_steal = steal_share(before, cpu_steal())
        base += step

        def simulate_at(x: float, t=t, i=i, o=o) -> ReplayRecord:
            return simulate_with(perf_model(model, gpu, with_sequence_factor(fit.params, x)), t, i, o)
        served = real.throughput()[0]
        saturated = served < 0.95 * rate
        # only an overloaded replay measures the engine's capacity; one it kept up with says nothing of it
        factor = calibrate(real, simulate_at) if saturated else 1.0
        calibration = {"load": cfg.calibration_load, "rate_rps": rate, "requests": int(len(t)),
                       "arrivals_s": len(t) / rate,
                       "real_throughput_rps": served, "saturated": saturated, "sequence_overhead_factor": factor,
                       "cpu_steal": cal_steal,
                       "sequence_overhead_s": fit.params["sequence_overhead_s"] * factor,
                       "profile_fit": compare(real, simulate_at(1.0)), "calibrated": compare(real, simulate_at(factor))}
    calibrated = perf_model(model, gpu, with_sequence_factor(fit.params, factor))
    replays = []
    windows = [at_rate(arrival, inp, out, load * capacity, cfg.replay_s) for load in cfg.loads]
    runs: list[list[ReplayRecord]] = [[] for _ in cfg.loads]
    steal: list[list[float | None]] = [[] for _ in cfg.loads]
    for j in range(cfg.real_repeats):  # every load once, then every load again: a repeat minutes later, not at once
        for k, load in enumerate(cfg.loads):
            done = j * len(cfg.loads) + k
            what = f"replaying at {load:g} of capacity" + (f" (repeat {j})" if j else "")
            before = cpu_steal()
            runs[k].append(await replay_real(eng, *windows[k],
                                             lambda f, d=done, w=what: progress(w, base + step * (d + f))))
            steal[k].append(steal_share(before, cpu_steal()))
    progress("measuring the engine's drift", base + len(cfg.loads) * cfg.real_repeats * step)
    moved = await drift(eng, cfg, points)
    for k, load in enumerate(cfg.loads):
        rate = load * capacity
        t, i, o = windows[k]
        real = runs[k][0]
        sim = simulate_with(perf, t, i, o)
        sim_cal = sim if factor == 1.0 else simulate_with(calibrated, t, i, o)
        scored, scored_cal = compare(real, sim), compare(real, sim_cal)
        entry = {"load": load, "rate_rps": rate, "requests": int(len(t)), "arrivals_s": len(t) / rate, **scored,
                 "calibrated": scored_cal,
                 "real": {**_record(real), "scheduled_s": [round(float(x), 6) for x in t],
                          "input_tokens": [int(x) for x in i]},
                 "simulated": _record(sim), "simulated_calibrated": _record(sim_cal), "cpu_steal": steal[k]}
        if len(runs[k]) > 1:
            repeat = compare(real, runs[k][1])
            entry.update(repeat=repeat, real_repeat=_record(runs[k][1]), noise=against_repeat(scored, repeat),
                         noise_calibrated=against_repeat(scored_cal, repeat))
        replays.append(entry)
    progress("done", 1.0)
    return {
        "model": backend_cfg.model_name, "dtype": cfg.dtype, "engine_start_s": backend.start_wall_s,
        "host": {"device": device, "matmul_flops": flops, "copy_bytes_per_s": bandwidth},
        "engine": {"max_num_batched_tokens": budget, "max_num_seqs": max_seqs, "chunked_prefill": chunked,
                   "kv_capacity_tokens": backend.kv_capacity_tokens, "block_tokens": block},
        "profile": [{**asdict(p), "predicted_s": s} for p, s in zip(points, fit.predicted_s)],
        "fit": fit.to_dict(), "capacity_rps": capacity, "calibration": calibration, "replays": replays,
        "drift": moved,
        "within_targets": all(r["within_targets"] for r in replays),
        "within_targets_calibrated": all(r["calibrated"]["within_targets"] for r in replays),
        "within_repeatability": all(r["noise"]["within"] for r in replays) if cfg.real_repeats > 1 else None,
        "within_repeatability_calibrated": (all(r["noise_calibrated"]["within"] for r in replays)
                                            if cfg.real_repeats > 1 else None),
        "wall_s": time.perf_counter() - started,
    }


def _record(r: ReplayRecord) -> dict:
    """A replay's per-request columns, JSON-ready (NaN as null)."""
    def col(a: np.ndarray) -> list:
        return [None if not math.isfinite(float(x)) else round(float(x), 6) for x in a]
    return {"sent_s": col(r.arrival_s), "ttft_s": col(r.ttft_s), "e2e_s": col(r.e2e_s),
            "output_tokens": [int(x) for x in r.output_tokens]}


def _from_record(rec: dict) -> ReplayRecord:
    """A replay's columns as `_record` wrote them, back as a `ReplayRecord` (null as NaN)."""
    def col(values: list) -> np.ndarray:
        return np.array([math.nan if v is None else v for v in values], dtype=float)
    return ReplayRecord(col(rec["sent_s"]), col(rec["ttft_s"]), col(rec["e2e_s"]), np.array(rec["output_tokens"]))


def plot(result: dict, path: Path) -> None:
    """The profile against the fit, and each replay's latency CDFs, real against simulated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    replays = result["replays"]
    fig, axes = plt.subplots(1 + len(replays), 3, figsize=(15, 4 * (1 + len(replays))), squeeze=False)
    prof = result["profile"]
    for ax, kind in zip(axes[0][:2], (PREFILL, DECODE)):
        pts = [p for p in prof if p["kind"] == kind]
        for b in sorted({p["batch"] for p in pts}):
            sel = sorted((p for p in pts if p["batch"] == b), key=lambda p: p["tokens"])
            x = [p["tokens"] for p in sel]
            line, = ax.plot(x, [p["seconds"] * 1e3 for p in sel], "o", label=f"batch {b}")
            ax.plot(x, [p["predicted_s"] * 1e3 for p in sel], "-", color=line.get_color())
        ax.set_xlabel("prompt tokens" if kind == PREFILL else "context tokens")
        ax.set_ylabel("iteration ms")
        ax.set_title(f"{kind}: measured (dots) vs fitted (lines)")
        ax.legend(fontsize=7)
    ax = axes[0][2]
    meas = np.array([p["seconds"] for p in prof])
    pred = np.array([p["predicted_s"] for p in prof])
    ax.loglog(meas * 1e3, pred * 1e3, "o")
    lim = [min(meas.min(), pred.min()) * 1e3 * 0.8, max(meas.max(), pred.max()) * 1e3 * 1.2]
    ax.plot(lim, lim, "k--", lw=1)
    ax.set_xlabel("measured ms")
    ax.set_ylabel("fitted ms")
    ax.set_title(f"fit: MAPE {result['fit']['mape']:.1%}, held out {result['fit']['holdout_mape']:.1%}")
    for row, rep in zip(axes[1:], replays):
        for ax, metric in zip(row, ("ttft", "tpot", "e2e")):
            for side, style in (("real", "-"), ("real_repeat", "-."), ("simulated", "--"),
                                ("simulated_calibrated", ":")):
                rec = rep.get(side)
                if rec is None:
                    continue
                r = _from_record(rec)
                v = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2e": r.e2e_s}[metric]
                v = np.sort(v[np.isfinite(v)])
                ax.plot(v, np.arange(1, len(v) + 1) / max(len(v), 1), style, label=side)
            m = rep["metrics"]
            ax.set_title(f"{metric} at {rep['load']:g} of capacity ({rep['rate_rps']:.1f}/s): P50 "
                         f"{m[f'{metric}_p50_s']['error']:+.0%}, P99 {m[f'{metric}_p99_s']['error']:+.0%}", fontsize=9)
            ax.set_xlabel("seconds")
            ax.set_ylabel("CDF")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_json(result: dict) -> str:
    """The result without the per-request columns (the `--json` output; the report folder keeps all of it)."""
    slim = {**result, "replays": [{k: v for k, v in r.items()
                                   if k not in ("real", "real_repeat", "simulated", "simulated_calibrated")}
                                  for r in result["replays"]]}
    return json.dumps(slim, indent=2)
