"""A true lower bound on any policy's latency: each request served alone on the fastest replica shape. Pure.

No policy can serve a request faster than an empty replica serves it alone: batching only lengthens
an iteration (the performance model's iteration time grows with the batch's tokens and contexts),
splitting a prompt into more chunks only adds iterations, and queueing, preemption and switching only
add time. So each request's end-to-end latency under any policy, on any deployment of the cluster's
GPUs, is at least its isolated latency on the fastest shape for it; the P99 of those is a lower bound
on every policy's P99 over the same requests (a quantile of pointwise lower bounds is a lower bound).
The simulated engine times the isolated request as it would serve it: its prompt in chunks of the
token budget, then one decode step per further token, the step time linear in the context (exact for
the performance model's decode steps).
"""

from __future__ import annotations

import math

import numpy as np

from oserve.capacity import CapacityTable
from oserve.engine_model import SimReplica
from oserve.perfmodel import Batch
from oserve.planner.prior import admitted_lengths
from oserve.sim.kernel import SimConfig
from oserve.specs import ClusterSpec, ModelSpec
from oserve.traces import Trace


def isolated_latency_s(replica: SimReplica, input_tokens: int, output_tokens: int) -> float:
    """Seconds `replica`'s engine takes to serve one request alone: chunked prefill, then decode. Pure."""
    budget = replica.engine.max_num_batched_tokens if replica.engine.chunked_prefill else input_tokens
    t, done = 0.0, 0
    while done < input_tokens:
        chunk = min(budget, input_tokens - done)
        last = done + chunk >= input_tokens
        t += replica.step_seconds(Batch(chunk, chunk * (done + (chunk + 1) / 2), done, 0, 0, 1 if last else 0))
        done += chunk
    k = output_tokens - 1
    if k > 0:
        a = replica.step_seconds(Batch(1, 0.0, 0, 1, input_tokens, 1))
        b = replica.step_seconds(Batch(1, 0.0, 0, 1, input_tokens + 1, 1)) - a
        t += k * a + b * k * (k - 1) / 2
    return t


def isolated_latency_bound(model: ModelSpec, cluster: ClusterSpec, table: CapacityTable, trace: Trace,
                           sim: SimConfig = SimConfig()) -> np.ndarray:
    """Per admitted request of `trace` (in order), its isolated latency on the fastest valid shape of the
    cluster for it: a lower bound on its end-to-end latency under any policy (module docstring). Pure.

    The prefill and the decode step's linear coefficients depend on the input length only, so they are
    computed once per distinct input length and shape, and combined with each request's output length.
    """
    _, inputs, outputs = admitted_lengths(trace, model)
    lengths, index = np.unique(inputs, return_inverse=True)
    k = np.maximum(outputs - 1, 0).astype(float)
    best = np.full(len(inputs), math.inf)
    for shape in table.shapes(cluster.num_gpus):
        rep = SimReplica("bound", shape, table.perf.timer(shape), sim.engine, 1 << 30, sim.memory.block_tokens)
        prefill = np.array([isolated_latency_s(rep, int(n), 1) for n in lengths])
        a = np.array([rep.step_seconds(Batch(1, 0.0, 0, 1, int(n), 1)) for n in lengths])
        b = np.array([rep.step_seconds(Batch(1, 0.0, 0, 1, int(n) + 1, 1)) for n in lengths]) - a
        index = index.reshape(-1)
        best = np.minimum(best, prefill[index] + k * a[index] + b[index] * k * (k - 1) / 2)
    return best


def p99_bound_s(bound_s: np.ndarray) -> float:
    """The P99 of the per-request bounds: no policy's P99 over the same requests is lower. Pure."""
    return float(np.percentile(bound_s, 99)) if len(bound_s) else math.nan
