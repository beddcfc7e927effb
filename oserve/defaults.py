"""Defaults shared by several components, each defined once with its reason. Pure constants.

A component's config takes its default from here, so the simulator, the planner, the switch planner
and the live workers agree unless a caller sets a value on purpose.
"""

SPAN_S = 60.0
"""Forecasting and planning span (seconds): the paper forecasts per-type arrivals a minute ahead and
re-plans each minute; a shorter span makes forecasts noisier (Poisson), a longer one reacts late."""

GPUS_PER_NODE = 8
"""GPUs per node: an H100 HGX/DGX node, the paper's testbed and Vidur's profiled collectives."""

ENGINE_START_S = 8.0
"""Starting an engine on GPUs that already hold, or are receiving, its weights: process start, KV
allocation, CUDA-graph capture. The paper measures about 10 s for a whole GPU-to-GPU switch, of which
the weight copy over NVLink is the smaller part; a reload adds reading the weights from disk."""

VLLM_CPU_ENGINE_START_S = 30.0
"""Starting a vLLM engine of the shipped small Llama on this kind of 2-core CPU host, weights not read
(`load_format="dummy"`): process spawn, imports, model build, memory profiling, KV allocation. Measured
with `oserve bench switch --live` and in live switches: TP1 22-31 s, TP2 26-65 s (the slower ones
while two other engines served on the same cores). A live system with real engines prices its
switches with it (`SystemConfig.engine_start_s`); `ENGINE_START_S` stays the H100 figure."""

MIGRATE_MIN_CONTEXT_TOKENS = 512
"""On a switch, a running request with at least this much context moves with its KV cache; a shorter
one drains on its old replica (most finish while the switch runs) or is recomputed on a new one.
Re-prefilling 512 tokens of Llama-2-70B on TP4 costs 46 ms in the performance model; copying their KV
over NVLink at 80% of 400 GB/s costs 0.13 ms plus the hand-off, so long contexts are worth moving."""

WORKER_NAMES: tuple[str, ...] = ("gateway", "engines", "forecaster", "scheduler", "switch-planner", "http")
"""The services of the live pipeline, as `oserve worker NAME` and `SystemConfig.workers` name them
(`http`: the OpenAI-compatible HTTP front, a client of the gateway)."""
HTTP_PORT = 8000
"""Port of `oserve up`'s OpenAI-compatible HTTP front (vLLM's default)."""
