"""Fit the performance model's coefficients to measured H100 profiles (Vidur's), and score the fit.

Pure functions over tables handed in: `extract_profiles` reads the Vidur CSVs from a directory it is
given (used only to rebuild the compact copy shipped in `oserve.data`); everything else works on that
compact table. The product never reads the profiling directory at run time: the fitted coefficients
ship as `oserve/data/perf_coefficients.json`, and the measured points as `oserve/data/h100_profile_*.csv`.

What is fitted:
- Linear layers (QKV, attention output, MLP up/gate, MLP down): one roofline shared by all GEMMs,
  t = t0 + ((F / (eff_flops * peak))^p + (B / (eff_bw * hbm))^p)^(1/p), with F the FLOPs (M rounded up
  to the 128-row tile the kernels compute in) and B the bytes of weights, input and output. Fitted in
  log space (relative error) by least squares (what its eff_bw > 1 absorbs: see `fit_gemm`).
- Element-wise operators (two RMSNorms, rotary embedding, activation, residual add): per operator
  t = a + b * elements, weighted least squares in relative terms.
- Collectives (all-reduce per group size, send/recv inside and across nodes): time against message
  size as a piecewise-linear curve in log-log space over size bins (medians of the measured points in
  each bin); sizes outside the measured range extrapolate with the end bins' bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from oserve.errors import ConfigError
from oserve.perfmodel import (ELEMENTWISE_OPS, GEMM_OPS, collective_seconds,
                              elementwise_widths, gemm_dims, gemm_seconds)

# Vidur profiling folders -> our model preset names.
PROFILED_MODELS = {
    "llama2-70b": "meta-llama/Llama-2-70b-hf",
    "llama2-7b": "meta-llama/Llama-2-7b-hf",
    "codellama-34b": "codellama/CodeLlama-34b-Instruct-hf",
}
# (collective, group size, GPUs per node in the measurement) -> our key
COLLECTIVES = {
    ("all_reduce", 2, 2): "all_reduce_2",
    ("all_reduce", 4, 4): "all_reduce_4",
    ("all_reduce", 8, 8): "all_reduce_8",
    ("send_recv", 2, 2): "send_recv_intra",
    ("send_recv", 2, 1): "send_recv_inter",
}
SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size")


@dataclass(frozen=True, slots=True)
class LayerProfile:
    """Measured per-layer operator medians (seconds) for one model at each (TP, tokens) point."""

    model: tuple[str, ...]
    num_heads: np.ndarray
    num_kv_heads: np.ndarray
    hidden_size: np.ndarray
    intermediate_size: np.ndarray
    tp: np.ndarray
    num_tokens: np.ndarray
    op_seconds: dict[str, np.ndarray]  # op name -> seconds per point

    def __len__(self) -> int:
        return len(self.model)

    def subset(self, mask: np.ndarray) -> LayerProfile:
        return LayerProfile(tuple(np.asarray(self.model)[mask]), self.num_heads[mask], self.num_kv_heads[mask],
                            self.hidden_size[mask], self.intermediate_size[mask], self.tp[mask],
                            self.num_tokens[mask], {k: v[mask] for k, v in self.op_seconds.items()})

    @property
    def total_seconds(self) -> np.ndarray:
        """One layer's non-attention time: the sum of the GEMM and element-wise medians."""
        return sum(self.op_seconds[o] for o in GEMM_OPS + ELEMENTWISE_OPS)


def fit_gemm(profile: LayerProfile, peak_flops: float, hbm_bytes_per_s: float) -> dict[str, float]:
    """Least-squares fit of the shared GEMM roofline to every GEMM point, in log space. Pure."""
    dims = gemm_dims(profile.hidden_size, profile.num_heads, profile.num_kv_heads,
                     profile.intermediate_size, profile.tp)
    ms, ks, ns, ts = [], [], [], []
    for op in GEMM_OPS:
        k, n = dims[op]
        ms.append(profile.num_tokens)
        ks.append(k)
        ns.append(n)
        ts.append(profile.op_seconds[op])
    m, k, n, t = (np.concatenate(a).astype(float) for a in (ms, ks, ns, ts))

    def residuals(x: np.ndarray) -> np.ndarray:
        theta = (x[0] * 1e-6, math.exp(x[1]), math.exp(x[2]), math.exp(x[3]))
        return np.log(gemm_seconds(theta, m, k, n, peak_flops, hbm_bytes_per_s)) - np.log(t)

    # eff_bw fits at 1.42 (142% of HBM bandwidth): the factor absorbs two things that are not the HBM.
    # (1) The profiler times one layer's GEMM back to back, so a small per-GPU weight shard (a TP8
    # projection is 16 MiB) stays in the 50 MiB L2 cache and reads faster than HBM allows; (2) the
    # smooth maximum ((c^p + m^p)^(1/p), p = 1.22) overestimates where compute and memory are
    # comparable, which a larger eff_bw offsets. A weight-streaming GEMM that misses L2 still never
    # beats HBM in this model: t0 plus the smooth maximum keep it at or under the bandwidth
    # (tests/test_perfmodel.py). Bounded at 1, the fit's held-out error is 4.8% (4.9% unbounded) but
    # capacities shift so that the profiles' own trends the paper reports (long outputs want fewer,
    # larger replicas on OPT-30B) no longer hold, so the fitted factor stays, explained here.
    x = least_squares(residuals, [3.0, math.log(0.7), math.log(0.9), math.log(3.0)]).x
    return {"t0_s": float(x[0] * 1e-6), "eff_flops": math.exp(x[1]), "eff_bw": math.exp(x[2]), "p": math.exp(x[3])}


def fit_elementwise(profile: LayerProfile) -> dict[str, dict[str, float]]:
    """Per operator t = a + b * elements, fitted by relative-error-weighted least squares. Pure."""
    widths = elementwise_widths(profile.hidden_size, profile.num_heads, profile.num_kv_heads,
                                profile.intermediate_size, profile.tp)
    out = {}
    for op in ELEMENTWISE_OPS:
        elements = profile.num_tokens * np.asarray(widths[op], dtype=float)
        t = profile.op_seconds[op]
        w = 1.0 / t
        a = np.stack([np.ones_like(elements), elements], axis=1) * w[:, None]
        (c0, c1), *_ = np.linalg.lstsq(a, t * w, rcond=None)
        out[op] = {"a_s": float(max(c0, 0.0)), "b_s_per_elem": float(max(c1, 0.0))}
    return out


def predict_layer_seconds(coeffs: dict, profile: LayerProfile) -> np.ndarray:
    """Predicted non-attention time of one layer at each profile point. Pure."""
    peak, hbm = coeffs["gpu"]["peak_flops"], coeffs["gpu"]["hbm_bytes_per_s"]
    dims = gemm_dims(profile.hidden_size, profile.num_heads, profile.num_kv_heads,
                     profile.intermediate_size, profile.tp)
    widths = elementwise_widths(profile.hidden_size, profile.num_heads, profile.num_kv_heads,
                                profile.intermediate_size, profile.tp)
    m = profile.num_tokens.astype(float)
    total = np.zeros_like(m)
    for op in GEMM_OPS:
        k, n = dims[op]
        total += gemm_seconds(coeffs["gemm"], m, k, n, peak, hbm)
    for op in ELEMENTWISE_OPS:
        c = coeffs["elementwise"][op]
        total += c["a_s"] + c["b_s_per_elem"] * m * np.asarray(widths[op], dtype=float)
    return total


def fit_collective(size_bytes: np.ndarray, seconds: np.ndarray, num_bins: int = 24) -> dict[str, list[float]]:
    """A piecewise-linear log-log curve: median time in each log-size bin. Pure."""
    order = np.argsort(size_bytes)
    s, t = size_bytes[order].astype(float), seconds[order].astype(float)
    edges = np.geomspace(s[0], s[-1] * (1 + 1e-9), num_bins + 1)
    xs, ys = [], []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (s >= lo) & (s < hi)
        if sel.any():
            xs.append(float(np.exp(np.median(np.log(s[sel])))))
            ys.append(float(np.median(t[sel])))
    ys = np.maximum.accumulate(ys).tolist()  # a bigger message never takes less time
    return {"size_bytes": xs, "seconds": ys}


# --- reading the measured data ------------------------------------------------------------------

def extract_profiles(profiling_dir: Path) -> tuple[list[dict], list[dict]]:
    """Read Vidur's mlp.csv and collective CSVs under `profiling_dir` into compact rows.

    Returns (layer_rows, collective_rows): dicts with the model/shape columns, tp, num_tokens and one
    median (seconds) per operator; and key, size_bytes, seconds. Duplicated (tp, tokens) points are kept.
    """
    import polars as pl

    profiling_dir = Path(profiling_dir)
    layer_rows: list[dict] = []
    for name, folder in PROFILED_MODELS.items():
        path = profiling_dir / "h100" / folder / "mlp.csv"
        if not path.exists():
            raise ConfigError(f"profiling file missing: {path}")
        df = pl.read_csv(path)
        for r in df.iter_rows(named=True):
            row = {"model": name, **{c: int(r[c]) for c in SHAPE_COLUMNS},
                   "tp": int(r["num_tensor_parallel_workers"]), "num_tokens": int(r["num_tokens"])}
            for op in GEMM_OPS + ELEMENTWISE_OPS:
                row[op] = float(r[f"time_stats.{op}.median"]) * 1e-3
            layer_rows.append(row)
    coll_rows: list[dict] = []
    for kind in ("all_reduce", "send_recv"):
        path = profiling_dir / "h100_dgx" / f"{kind}.csv"
        if not path.exists():
            raise ConfigError(f"profiling file missing: {path}")
        df = pl.read_csv(path)
        for r in df.iter_rows(named=True):
            key = COLLECTIVES.get((kind, int(r["num_workers"]), int(r["devices_per_node"])))
            if key is not None:
                coll_rows.append({"key": key, "size_bytes": int(r["size"]),
                                  "seconds": float(r[f"time_stats.{kind}.median"]) * 1e-3})
    return layer_rows, coll_rows


def layer_profile(rows: list[dict]) -> LayerProfile:
    """Columnar LayerProfile from compact rows. Pure."""
    col = lambda k, t=np.int64: np.array([r[k] for r in rows], dtype=t)  # noqa: E731
    return LayerProfile(tuple(r["model"] for r in rows), col("n_head"), col("n_kv_head"), col("n_embd"),
                        col("n_expanded_embd"), col("tp"), col("num_tokens"),
                        {op: col(op, float) for op in GEMM_OPS + ELEMENTWISE_OPS})


def fit_all(layer_rows: list[dict], coll_rows: list[dict], peak_flops: float,
            hbm_bytes_per_s: float) -> dict:
    """Every coefficient of the performance model, as a JSON-ready dict. Pure and deterministic."""
    profile = layer_profile(layer_rows)
    collectives = {}
    for key in sorted({r["key"] for r in coll_rows}):
        sel = [r for r in coll_rows if r["key"] == key]
        collectives[key] = fit_collective(np.array([r["size_bytes"] for r in sel]),
                                          np.array([r["seconds"] for r in sel]))
    return {
        "source": "Vidur H100 profiles (microsoft/vidur@7d47513363ec447a741ac5e47241580b47724fbf), medians",
        "gpu": {"name": "h100-80gb", "peak_flops": peak_flops, "hbm_bytes_per_s": hbm_bytes_per_s},
        "gemm": fit_gemm(profile, peak_flops, hbm_bytes_per_s),
        "elementwise": fit_elementwise(profile),
        "collectives": collectives,
    }


def score(layer_rows: list[dict], coll_rows: list[dict], peak_flops: float, hbm_bytes_per_s: float) -> dict:
    """Held-out accuracy of the fit. Pure.

    Layers: leave one profiled model out — fit on the other two, predict every point of the third —
    so the figure says how well the model carries to an architecture it was not fitted on.
    Collectives: every fifth measured size of each curve is held out from its fit.
    """
    profile = layer_profile(layer_rows)
    models = sorted(set(profile.model))
    errors, per_model = [], {}
    for held in models:
        test = np.array([m == held for m in profile.model])
        train_rows = [r for r in layer_rows if r["model"] != held]
        coeffs = fit_all(train_rows, coll_rows, peak_flops, hbm_bytes_per_s)
        sub = profile.subset(test)
        err = np.abs(predict_layer_seconds(coeffs, sub) / sub.total_seconds - 1.0)
        per_model[held] = {"mape": float(err.mean()), "p90_ape": float(np.quantile(err, 0.9)), "points": int(len(err))}
        errors.append(err)
    layer_err = np.concatenate(errors)
    coll_err, per_coll = [], {}
    for key in sorted({r["key"] for r in coll_rows}):
        sel = sorted((r for r in coll_rows if r["key"] == key), key=lambda r: r["size_bytes"])
        size = np.array([r["size_bytes"] for r in sel], dtype=float)
        secs = np.array([r["seconds"] for r in sel])
        held = np.arange(len(sel)) % 5 == 0
        curve = fit_collective(size[~held], secs[~held])
        err = np.abs(collective_seconds(curve, size[held]) / secs[held] - 1.0)
        per_coll[key] = {"mape": float(err.mean()), "points": int(held.sum())}
        coll_err.append(err)
    coll_all = np.concatenate(coll_err)
    return {
        "layers": {"mape": float(layer_err.mean()), "p90_ape": float(np.quantile(layer_err, 0.9)),
                   "points": int(len(layer_err)), "held_out": "leave-one-model-out", "per_model": per_model},
        "collectives": {"mape": float(coll_all.mean()), "points": int(len(coll_all)),
                        "held_out": "every 5th size", "per_key": per_coll},
    }


# --- the compact copy shipped in oserve.data ----------------------------------------------------

LAYER_FILE = "h100_profile_layers.csv"
COLLECTIVE_FILE = "h100_profile_collectives.csv"


def write_compact(layer_rows: list[dict], coll_rows: list[dict], out_dir: Path) -> None:
    """Write the compact measured tables as CSV (full float precision)."""
    import csv

    out_dir = Path(out_dir)
    for name, rows in ((LAYER_FILE, layer_rows), (COLLECTIVE_FILE, coll_rows)):
        with open(out_dir / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows({k: repr(v) if isinstance(v, float) else v for k, v in r.items()} for r in rows)


def read_compact(data_dir: Path) -> tuple[list[dict], list[dict]]:
    """Read the compact measured tables written by `write_compact`."""
    import csv

    def parse(v: str):
        try:
            return int(v)
        except ValueError:
            try:
                return float(v)
            except ValueError:
                return v

    out = []
    for name in (LAYER_FILE, COLLECTIVE_FILE):
        with open(Path(data_dir) / name, newline="") as f:
            out.append([{k: parse(v) for k, v in r.items()} for r in csv.DictReader(f)])
    return out[0], out[1]
