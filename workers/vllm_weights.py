"""vLLM worker extension for live switches: an engine's ranks send and receive weight shards in place.

vLLM loads this class into each of an engine's worker processes (`worker_extension_cls`, which the
`vllm` backend always sets) and calls its methods on every rank with `collective_rpc`:

- `oserve_switch_begin(rendezvous, keys, bind_host)` starts this rank's part of a switch
  (`oserve.switch.transport`) on a thread of its own, so a serving engine keeps serving while it sends;
  `oserve_switch_status()` reports it; `oserve_switch_cancel()` stops it between ops.
- A new engine starts with dummy weights (`load_format="dummy"`) and receives its shard straight into its
  parameters: it serves nothing until the switch verified every byte, and is discarded if it did not, so
  no staging copy is needed. `oserve_switch_install()` then re-runs each written layer's post-load
  processing (`quant_method.process_weights_after_loading`), which on a CPU packs the new weights for
  oneDNN (on CUDA it does nothing for unquantized weights).
- `oserve_weight_checksums(names)` gives the SHA-256 of each shard as the engine holds it, for checking
  a switch against the checkpoint on disk.

What a rank holds, by name: vLLM's fused parameters (`qkv_proj`, `gate_up_proj`), one shard per rank,
exactly as `oserve.switch.layout` cuts them; a rank refuses a job whose shards are not its parameters
(names or shapes), so a layout that is not the engine's fails before any byte moves. Only unquantized
models: a quantized weight is in a kernel format the layout does not describe.

On a CPU, vLLM's linear layers pack their weights for oneDNN after loading and drop the plain tensors
(`dispatch_cpu_unquantized_gemm(..., remove_weight=True)` in 0.32), so a serving engine could not read
its own weights back. Importing this module (vLLM does, in each worker process, before it loads the
model) wraps that function to keep the plain parameter as `layer._oserve_weight`: a CPU engine holds its
linear weights twice (plain and packed). On CUDA nothing is packed and nothing is kept.
"""

from __future__ import annotations

import hashlib
import time

import torch

from oserve.switch.transport import BackgroundJob, TransferError
from oserve.switch.wire import Rendezvous
from oserve.switch.wire import EndpointJob

_KEPT = "_oserve_weight"


def _keep_plain_weights() -> None:
    """Wrap vLLM's CPU GEMM dispatch so that a layer keeps its plain weight beside the packed one."""
    try:
        import vllm.model_executor.layers.utils as layer_utils
    except ImportError:  # pragma: no cover - vLLM not installed
        return
    dispatch = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "_oserve_keeps", False):
        return

    def keeping(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        dispatch(layer, remove_weight)
        if weight is not None and getattr(layer, "weight", None) is not weight:
            object.__setattr__(layer, _KEPT, weight)  # not registered: the Parameter itself, loader attributes kept

    keeping._oserve_keeps = True  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = keeping


_keep_plain_weights()


def _module_and_leaf(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    prefix, _, leaf = name.rpartition(".")
    return model.get_submodule(prefix), leaf


def shard_of(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The tensor that holds parameter `name`'s shard on this rank: the kept plain weight where vLLM packed it
    (a CPU), else the parameter's data."""
    module, leaf = _module_and_leaf(model, name)
    kept = getattr(module, _KEPT, None) if leaf == "weight" else None
    return (kept if kept is not None else getattr(module, leaf)).data


def check_job(model: torch.nn.Module, job: EndpointJob) -> None:
    """Refuse a job whose shards are not this rank's parameters (see the module docstring).

    Raises:
        TransferError: names missing on either side, or a quantized model.
    """
    names = {n for n, p in model.named_parameters()}
    missing, unknown = sorted(set(job.holds) - names), sorted(names - set(job.holds))
    if missing or unknown:
        raise TransferError(f"{job.key}: the layout's shards are not this engine's parameters (not in the engine: "
                            f"{missing[:3]}, not in the layout: {unknown[:3]})")
    for name in job.holds:
        module, _ = _module_and_leaf(model, name)
        method = getattr(module, "quant_method", None)
        if method is not None and "Unquantized" not in type(method).__name__:
            raise TransferError(f"{job.key}: {name} is quantized ({type(method).__name__}); only unquantized weights "
                                "move")


class SwitchExtension:
    """Methods vLLM adds to its worker class (see the module docstring); `self` is a vLLM worker."""

    def _oserve_model(self) -> torch.nn.Module:
        return self.model_runner.model  # type: ignore[attr-defined]

    def oserve_switch_begin(self, rendezvous: dict, keys: list[str], bind_host: str = "127.0.0.1") -> str:
        """Start this rank's part of a switch: `keys[rank]` is its endpoint. Returns the endpoint key."""
        rank = int(self.rank)  # type: ignore[attr-defined]
        job = getattr(self, "_oserve_job", None)
        if job is not None and job.result is None:
            raise TransferError(f"rank {rank}: a switch is already running here ({job.key})")
        model = self._oserve_model()
        device = next(model.parameters()).device
        bg = BackgroundJob(keys[rank], Rendezvous(**rendezvous))
        self._oserve_job = bg
        bg.start(lambda name: shard_of(model, name), device=device, bind_host=bind_host,
                 check=lambda j: check_job(model, j))
        return bg.key

    def oserve_switch_status(self, wait_s: float = 0.0) -> dict:
        """This rank's part of the switch; with `wait_s`, first wait up to that long for it to end (the engine's
        loop waits meanwhile: for an engine that serves nothing yet, whose polling would otherwise keep this
        process busy)."""
        job = getattr(self, "_oserve_job", None)
        if job is None:
            return {"state": "none"}
        if wait_s > 0 and job.thread is not None:
            job.thread.join(wait_s)
        return job.status()

    def oserve_switch_cancel(self) -> None:
        job = getattr(self, "_oserve_job", None)
        if job is not None:
            job.cancel.set()

    def oserve_switch_install(self) -> dict:
        """Put the received weights in force: re-run the post-load processing of every layer this rank received
        weights for. Only after its switch job verified every op."""
        job = getattr(self, "_oserve_job", None)
        if job is None or job.result is None or not job.result.verified or job.job is None:
            raise TransferError("no verified switch to install on this rank")
        t0 = time.perf_counter()
        model = self._oserve_model()
        done: set[int] = set()
        for name in job.job.holds:
            module, _ = _module_and_leaf(model, name)
            if id(module) in done:
                continue
            done.add(id(module))
            kept = getattr(module, _KEPT, None)
            if kept is not None:
                module.weight = kept  # back in place, so the processing packs the received bytes
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
        self._oserve_job = None
        return {"install_s": time.perf_counter() - t0, "modules": len(done)}

    def oserve_weight_checksums(self, names: list[str] | None = None) -> dict[str, str]:
        """SHA-256 of each parameter shard this rank holds (its bytes only), by vLLM's parameter name."""
        model = self._oserve_model()
        out = {}
        for name, _ in model.named_parameters():
            if names is not None and name not in names:
                continue
            t = shard_of(model, name).detach().to("cpu").contiguous()
            out[name] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
        return out


__all__ = ["SwitchExtension", "check_job", "shard_of"]
