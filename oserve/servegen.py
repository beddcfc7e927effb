"""The ServeGen traces (m-large, m-mid): reading them, and per-request traces generated from them.

Pure core: reads only the two files it is handed (or that a model name resolves to in
`DEFAULT_SERVEGEN_DIR`), takes randomness as a `numpy.random.Generator`, reads no clock.

ServeGen publishes no per-request records: per client, a request count and an inter-arrival
distribution per 10-minute window, and per 6-hour window the marginal input and output length
distributions (kept in `*_lengths.csv` as 18 quantiles). A slice [start_s, start_s + minutes*60) of
the trace becomes requests the way ServeGen's generator does it, window by window:

1. Count. For each client and each 10-minute window overlapping the slice, the request count is the
   published `round(rate_rps * 600)` times `rate_scale`, stochastically rounded: floor(n*s) plus one
   with probability frac(n*s). So the count is exact (bit-exact, no randomness) whenever n*s is an
   integer (always at rate_scale 1), and unbiased otherwise with the least possible variance (less than
   Poisson or binomial thinning would add).
2. Arrivals. n + 1 gaps are drawn from the window's distribution (`scipy.stats.gamma(a=shape,
   scale=scale)` or `weibull_min(c=shape, scale=scale)`, as the data README gives them) and rescaled
   to sum to 600 s; the n arrivals are the partial sums of the first n. The window is filled exactly
   (as ServeGen rescales its gaps to the window), only the shape matters, and every arrival lies
   strictly inside its own window. Requests of windows that only partly overlap the slice are
   generated for the whole window and those outside the slice dropped.
3. Lengths. Each request's input and output are drawn independently (the data has no joint
   distribution: an assumption, the same one `oserve.forecast.servegen_series` makes) from its client's
   6-hour window by inverse-CDF sampling: linear interpolation of u ~ U[0, 1) through the published
   quantiles at levels 0, .01, .05, ..., .99, .999, 1 (min .. max), rounded to whole tokens.
4. Clients without a published distribution for a 6-hour window (the largest clients are missing from
   the snapshot) draw from the pooled distribution of the covered clients of the same 6-hour window:
   a covered client picked with probability proportional to its requests in that window, then input
   and output drawn from it (the whole trace's covered clients where a window has none), as
   `oserve.forecast.servegen_series` does for its type shares.

Arrival times in a `Workload` are seconds from the start of the slice.

Typical use:

    data = load_servegen("servegen-m-large")
    start = default_start_s(data)
    trace = servegen_trace(data, start_s=start, minutes=60,
                           rate_scale=target_rps / slice_mean_rps(data, start, 60), rng=rng)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
from scipy import stats

from oserve.errors import ConfigError, TraceError
from oserve.traces import Trace

SERVEGEN_SPAN_S = 600.0  # ServeGen's window: 10 minutes
LENGTH_WINDOW_S = 21600.0  # ServeGen's length-distribution window: 6 hours

_QUANTILE_COLUMNS: tuple[str, ...] = ("min", "p1", "p5", "p10", "p20", "p25", "p30", "p40", "p50", "p60",
                                      "p70", "p75", "p80", "p90", "p95", "p99", "p99.9", "max")
_QUANTILE_LEVELS = np.array([0.0, 0.01, 0.05, 0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.9,
                             0.95, 0.99, 0.999, 1.0])
QUANTILE_LEVELS = _QUANTILE_LEVELS  # the levels of the 18 published quantiles (min .. max), public name
BIN_WEIGHTS = np.diff(_QUANTILE_LEVELS)  # 17 bins
_TRACE_COLUMNS: tuple[str, ...] = ("client_id", "timestamp_s", "rate_rps", "iat_cv", "iat_dist", "iat_shape",
                                   "iat_scale")
# The shared data folder (../shared/data/traces beside the repository) holding servegen_<model>.csv and
# servegen_<model>_lengths.csv; the same folder as the CLI's DEFAULT_DATA_DIR.
DEFAULT_SERVEGEN_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces"


SERVEGEN_MODELS = ("m-large", "m-mid")
SPANS_PER_LENGTH_WINDOW = int(round(LENGTH_WINDOW_S / SERVEGEN_SPAN_S))  # 36
_NONE, _GAMMA, _WEIBULL = 0, 1, 2
_P50 = 8  # column of the median among the 18 quantiles


@dataclass(frozen=True, slots=True, eq=False)
class ServeGenData:
    """One ServeGen model's trace and length quantiles, as arrays. Load once with `load_servegen`, reuse."""

    name: str  # "servegen-m-large", or the trace file's stem
    client_ids: np.ndarray  # (C,) sorted client ids
    count: np.ndarray  # (C, T) int64: requests of client c in 10-minute window t (round(rate_rps * 600))
    iat_dist: np.ndarray  # (C, T) int8: 0 none, 1 Gamma, 2 Weibull
    iat_shape: np.ndarray  # (C, T) float64
    iat_scale: np.ndarray  # (C, T) float64, seconds
    input_q: np.ndarray  # (R, 18) float64: input quantiles of each covered client-window row
    output_q: np.ndarray  # (R, 18) float64
    row: np.ndarray  # (C, W) int64: row of client c's 6-hour window w in input_q/output_q, -1 if not covered
    window_requests: np.ndarray  # (C, W) float64: requests of client c in 6-hour window w

    @property
    def num_spans(self) -> int:
        """Number of 10-minute windows (2016 for 14 days). Pure."""
        return self.count.shape[1]

    @property
    def span_s(self) -> float:
        return SERVEGEN_SPAN_S


def resolve_servegen(path_or_name: str | os.PathLike[str],
                     data_dir: str | os.PathLike[str] | None = None) -> tuple[Path, Path, str]:
    """(trace csv, lengths csv, workload name) for "servegen-m-large" / "servegen-m-mid" or a trace path.

    A name resolves to `data_dir` (default `DEFAULT_SERVEGEN_DIR`, the CLI's DEFAULT_DATA_DIR); a path
    to a `servegen_<model>.csv` takes its `_lengths.csv` beside it. Raises `ConfigError` when neither
    resolves to existing files. Reads nothing but the file system's directory entries.
    """
    text = os.fspath(path_or_name)
    model = text.removeprefix("servegen-") if text.startswith("servegen-") else None
    if model is not None and "/" not in text and not text.endswith(".csv"):
        if model not in SERVEGEN_MODELS:
            raise ConfigError(f"unknown ServeGen workload {text!r}; known: "
                              f"{', '.join('servegen-' + m for m in SERVEGEN_MODELS)}, or a servegen_*.csv path")
        folder = Path(data_dir) if data_dir is not None else DEFAULT_SERVEGEN_DIR
        trace, name = folder / f"servegen_{model}.csv", text
    else:
        trace = Path(text)
        name = trace.stem.replace("servegen_", "servegen-", 1)
    lengths = trace.with_name(trace.stem + "_lengths.csv")
    for p in (trace, lengths):
        if not p.is_file():
            raise ConfigError(f"ServeGen workload {text!r}: file not found: {str(p)!r}")
    return trace, lengths, name


def load_servegen(path_or_name: str | os.PathLike[str], *,
                  data_dir: str | os.PathLike[str] | None = None) -> ServeGenData:
    """Read a ServeGen model's trace and lengths files (see `resolve_servegen`) into arrays (~0.3 s).

    Raises `ConfigError` for a bad name or path, or a file that cannot be used as a ServeGen trace.
    """
    trace, lengths, name = resolve_servegen(path_or_name, data_dir)
    try:
        tr, ln = read_servegen(trace, lengths)
        t_idx = np.rint(tr["timestamp_s"].to_numpy() / SERVEGEN_SPAN_S).astype(np.int64)
        clients = tr["client_id"].to_numpy()
        client_ids = np.unique(clients)
        c_idx = np.searchsorted(client_ids, clients)
        num_spans = int(t_idx.max()) + 1
        shape = (len(client_ids), num_spans)
        count = np.zeros(shape, dtype=np.int64)
        count[c_idx, t_idx] = np.rint(tr["rate_rps"].fill_null(0.0).to_numpy() * SERVEGEN_SPAN_S).astype(np.int64)
        dist_col = tr["iat_dist"].fill_null("").to_numpy()
        iat_dist = np.zeros(shape, dtype=np.int8)
        iat_dist[c_idx, t_idx] = np.where(dist_col == "Gamma", _GAMMA, np.where(dist_col == "Weibull", _WEIBULL, _NONE))
        iat_shape = np.zeros(shape)
        iat_shape[c_idx, t_idx] = tr["iat_shape"].fill_null(0.0).to_numpy()
        iat_scale = np.zeros(shape)
        iat_scale[c_idx, t_idx] = tr["iat_scale"].fill_null(0.0).to_numpy()
        lq = length_quantiles(ln, lengths, client_ids)
    except TraceError as exc:
        raise ConfigError(f"ServeGen workload {os.fspath(path_or_name)!r}: {exc}") from None
    except Exception as exc:  # a CSV that is not a ServeGen trace (missing column, bad value)
        raise ConfigError(f"ServeGen workload {os.fspath(path_or_name)!r}: cannot read {str(trace)!r}: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    bad = (count > 0) & ((iat_dist == _NONE) | ~(iat_shape > 0))
    if bad.any():
        c, t = np.argwhere(bad)[0]
        raise ConfigError(f"{trace}: client {client_ids[c]} window {t * SERVEGEN_SPAN_S:.0f} s has requests but "
                          f"no usable inter-arrival distribution")
    num_windows = (num_spans + SPANS_PER_LENGTH_WINDOW - 1) // SPANS_PER_LENGTH_WINDOW
    padded = np.zeros((len(client_ids), num_windows * SPANS_PER_LENGTH_WINDOW))
    padded[:, :num_spans] = count
    window_requests = padded.reshape(len(client_ids), num_windows, SPANS_PER_LENGTH_WINDOW).sum(axis=2)
    row = np.full((len(client_ids), num_windows), -1, dtype=np.int64)
    ok = lq.window_index < num_windows
    row[lq.client_index[ok], lq.window_index[ok]] = np.nonzero(ok)[0]
    if not (row >= 0).any():
        raise ConfigError(f"{lengths}: no client-window with a length distribution")
    return ServeGenData(name=name, client_ids=client_ids, count=count, iat_dist=iat_dist, iat_shape=iat_shape,
                        iat_scale=iat_scale, input_q=lq.input_q, output_q=lq.output_q, row=row,
                        window_requests=window_requests)


def read_servegen(trace_csv: str | os.PathLike[str], lengths_csv: str | os.PathLike[str], *,
                  trace_columns: tuple[str, ...] = _TRACE_COLUMNS) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The two ServeGen files as data frames: (trace with `trace_columns`, lengths with every column).

    Reads exactly the two files given; raises `TraceError` naming the file when one is missing,
    unreadable or lacks a column.
    """
    trace_csv, lengths_csv = Path(trace_csv), Path(lengths_csv)
    for p in (trace_csv, lengths_csv):
        if not p.is_file():
            raise TraceError(f"ServeGen file not found: {str(p)!r}")
    schema = {"client_id": pl.Int64, "timestamp_s": pl.Float64, "rate_rps": pl.Float64, "iat_cv": pl.Float64,
              "iat_dist": pl.Utf8, "iat_shape": pl.Float64, "iat_scale": pl.Float64}
    try:
        tr = pl.read_csv(trace_csv, columns=list(trace_columns),
                         schema_overrides={c: schema[c] for c in trace_columns if c in schema})
        ln = pl.read_csv(lengths_csv, schema_overrides={c: pl.Float64 for c in _QUANTILE_COLUMNS})
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise TraceError(f"cannot read ServeGen files {str(trace_csv)!r}, {str(lengths_csv)!r}: "
                         f"{str(exc).splitlines()[0]}") from None
    missing = [c for c in ("client_id", "window_start_s", "field", "n_support", *_QUANTILE_COLUMNS)
               if c not in ln.columns]
    if missing:
        raise TraceError(f"{lengths_csv}: missing columns {', '.join(missing)}")
    return tr, ln


@dataclass(frozen=True, slots=True, eq=False)
class LengthQuantiles:
    """The published length quantiles of every covered client-window (rows), input and output paired."""

    client_index: np.ndarray  # (n,) int64: index into the `client_ids` handed to `length_quantiles`
    window_index: np.ndarray  # (n,) int64: 6-hour window (window_start_s / 21600)
    input_q: np.ndarray  # (n, 18) float64: input tokens at QUANTILE_LEVELS
    output_q: np.ndarray  # (n, 18) float64: output tokens at QUANTILE_LEVELS


def length_quantiles(ln: pl.DataFrame, lengths_csv: str | os.PathLike[str],
                     client_ids: np.ndarray) -> LengthQuantiles:
    """Rows of `ln` with requests (n_support > 0) of clients in `client_ids` (sorted), input and output paired.

    Raises `TraceError` (naming `lengths_csv`) when the input and output rows do not pair up. Pure.
    """
    ln = ln.filter(pl.col("n_support") > 0)
    inp = ln.filter(pl.col("field") == "input_tokens").sort(["client_id", "window_start_s"])
    out = ln.filter(pl.col("field") == "output_tokens").sort(["client_id", "window_start_s"])
    key_in = inp.select(["client_id", "window_start_s"])
    if not key_in.equals(out.select(["client_id", "window_start_s"])):
        raise TraceError(f"{lengths_csv}: input and output rows do not pair up by client and window")
    ids = key_in["client_id"].to_numpy()
    known = np.isin(ids, client_ids)
    return LengthQuantiles(
        client_index=np.searchsorted(client_ids, ids[known]).astype(np.int64),
        window_index=np.rint(key_in["window_start_s"].to_numpy()[known] / LENGTH_WINDOW_S).astype(np.int64),
        input_q=inp.select(_QUANTILE_COLUMNS).to_numpy()[known],
        output_q=out.select(_QUANTILE_COLUMNS).to_numpy()[known])


def percentile_inverse_cdf(quantiles: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse CDF through 18 published quantiles (min .. max at `QUANTILE_LEVELS`), linear between them. Pure.

    `quantiles` is (18,) or (n, 18) (one row per u); u in [0, 1]. Returns floats in [min, max] of
    each row, non-decreasing in u for a fixed row (the quantiles are non-decreasing).
    """
    q = np.asarray(quantiles, dtype=np.float64)
    u = np.clip(np.asarray(u, dtype=np.float64), 0.0, 1.0)
    q = np.broadcast_to(q, (*u.shape, q.shape[-1])) if q.ndim == 1 else q
    levels = QUANTILE_LEVELS
    b = np.clip(np.searchsorted(levels, u, side="right") - 1, 0, len(levels) - 2)
    frac = (u - levels[b]) / (levels[b + 1] - levels[b])
    lo = np.take_along_axis(q, b[..., None], axis=-1)[..., 0]
    hi = np.take_along_axis(q, (b + 1)[..., None], axis=-1)[..., 0]
    return np.clip(lo + frac * (hi - lo), q[..., 0], q[..., -1])


def sample_lengths(quantiles: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Whole-token lengths, one per row of `quantiles` (n, 18), by inverse-CDF sampling. Pure given rng."""
    return np.rint(percentile_inverse_cdf(quantiles, rng.random(len(quantiles)))).astype(np.int64)


def _slice_spans(data: ServeGenData, start_s: float, minutes: float) -> tuple[float, float, int, int]:
    if not (np.isfinite(start_s) and np.isfinite(minutes)) or start_s < 0 or minutes <= 0:
        raise ConfigError(f"ServeGen slice needs start_s >= 0 and minutes > 0; got start_s={start_s}, "
                          f"minutes={minutes}")
    end_s = start_s + minutes * 60.0
    span_total_s = data.num_spans * SERVEGEN_SPAN_S
    if end_s > span_total_s + 1e-9:
        raise ConfigError(f"{data.name}: slice [{start_s:.0f}, {end_s:.0f}) s ends after the trace "
                          f"({span_total_s:.0f} s)")
    t0 = int(np.floor(start_s / SERVEGEN_SPAN_S))
    t1 = int(np.ceil(end_s / SERVEGEN_SPAN_S - 1e-9))
    return start_s, end_s, t0, max(t1, t0 + 1)


def _rows_for(data: ServeGenData, c: np.ndarray, w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Length row of each request (client c, 6-hour window w); uncovered ones from the window's pool."""
    rows = data.row[c, w]
    for wi in np.unique(w[rows < 0]):
        need = np.nonzero((rows < 0) & (w == wi))[0]
        covered = data.row[:, wi] >= 0
        weights = np.where(covered, data.window_requests[:, wi], 0.0)
        if weights.sum() > 0:
            pool_rows = data.row[covered, wi]
            p = weights[covered] / weights[covered].sum()
        else:  # no covered client sent anything in this window: the whole trace's covered clients
            has = data.row >= 0
            pool_rows = data.row[has]
            p = data.window_requests[has]
            p = p / p.sum() if p.sum() > 0 else np.full(len(p), 1.0 / len(p))
        rows[need] = pool_rows[rng.choice(len(pool_rows), size=len(need), p=p)]
    return rows


@dataclass(frozen=True, slots=True, eq=False)
class ServeGenRequests:
    """Generated requests of a slice (arrival-sorted), with the client and 10-minute window of each."""

    arrival_s: np.ndarray  # seconds from the start of the trace
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    client_id: np.ndarray
    span_index: np.ndarray  # 10-minute window t (arrival in [600 t, 600 (t+1)))


def servegen_requests(data: ServeGenData, *, start_s: float, minutes: float, rate_scale: float = 1.0,
                      rng: np.random.Generator) -> ServeGenRequests:
    """Requests of the slice [start_s, start_s + 60 minutes) (see the module doc). Pure given rng.

    Raises `ConfigError` for a slice outside the trace, a non-positive rate_scale, or a slice without
    any request (for example one of m-mid's collection gaps).
    """
    if not (np.isfinite(rate_scale) and rate_scale > 0):
        raise ConfigError(f"rate_scale must be positive, got {rate_scale}")
    start_s, end_s, t0, t1 = _slice_spans(data, start_s, minutes)
    expected = data.count[:, t0:t1] * float(rate_scale)
    n = np.floor(expected)
    n = (n + (rng.random(n.shape) < expected - n)).astype(np.int64)
    arrivals, clients, spans = [], [], []
    for c, j in zip(*np.nonzero(n)):
        t = t0 + j
        k = int(n[c, j])
        a, sc = data.iat_shape[c, t], max(data.iat_scale[c, t], 1e-12)
        family = stats.gamma if data.iat_dist[c, t] == _GAMMA else stats.weibull_min
        gaps = np.asarray(family.rvs(a, scale=sc, size=k + 1, random_state=rng), dtype=np.float64)
        total = gaps.sum()
        if not (np.isfinite(total) and total > 0):  # all gaps underflowed (tiny shapes): spread evenly
            gaps, total = np.ones(k + 1), float(k + 1)
        arrivals.append(t * SERVEGEN_SPAN_S + np.cumsum(gaps[:k]) * (SERVEGEN_SPAN_S / total))
        clients.append(np.full(k, c, dtype=np.int64))
        spans.append(np.full(k, t, dtype=np.int64))
    if not arrivals:
        raise ConfigError(f"{data.name}: no request in the slice [{start_s:.0f}, {end_s:.0f}) s "
                          f"(rate_scale {rate_scale})")
    arrival = np.concatenate(arrivals)
    # keep inside its window despite rounding; then inside the slice
    span = np.concatenate(spans)
    arrival = np.clip(arrival, span * SERVEGEN_SPAN_S, np.nextafter((span + 1) * SERVEGEN_SPAN_S, 0.0))
    c_idx = np.concatenate(clients)
    keep = (arrival >= start_s) & (arrival < end_s)
    arrival, c_idx, span = arrival[keep], c_idx[keep], span[keep]
    if not len(arrival):
        raise ConfigError(f"{data.name}: no request in the slice [{start_s:.0f}, {end_s:.0f}) s "
                          f"(rate_scale {rate_scale})")
    order = np.argsort(arrival, kind="stable")
    arrival, c_idx, span = arrival[order], c_idx[order], span[order]
    rows = _rows_for(data, c_idx, span // SPANS_PER_LENGTH_WINDOW, rng)
    return ServeGenRequests(arrival_s=arrival, input_tokens=sample_lengths(data.input_q[rows], rng),
                            output_tokens=sample_lengths(data.output_q[rows], rng),
                            client_id=data.client_ids[c_idx], span_index=span)


def _as_data(source: ServeGenData | str | os.PathLike[str], data_dir: str | os.PathLike[str] | None) -> ServeGenData:
    return source if isinstance(source, ServeGenData) else load_servegen(source, data_dir=data_dir)


def servegen_trace(source: ServeGenData | str | os.PathLike[str], *, start_s: float | None = None,
                   minutes: float = 60.0, rate_scale: float = 1.0, rng: np.random.Generator,
                   name: str | None = None, data_dir: str | os.PathLike[str] | None = None) -> Trace:
    """The requests of a ServeGen slice as a trace, each with the client that sent it. Pure given rng.

    `source`: loaded data (fastest when called repeatedly), "servegen-m-large" / "servegen-m-mid"
    (resolved in `data_dir`, default `DEFAULT_SERVEGEN_DIR`) or a path to a servegen_*.csv. `start_s`
    (seconds from the trace start) defaults to `default_start_s(data, minutes)`. Arrival times are
    seconds from `start_s`. `rate_scale` multiplies every client-window's count (module doc, step 1).
    """
    data = _as_data(source, data_dir)
    if start_s is None:
        start_s = default_start_s(data, minutes)
    r = servegen_requests(data, start_s=start_s, minutes=minutes, rate_scale=rate_scale, rng=rng)
    label = name or (f"{data.name}@{start_s / 3600:.2f}h+{minutes:g}m"
                     + (f"x{rate_scale:.3g}" if rate_scale != 1 else ""))
    return Trace(r.arrival_s - start_s, r.input_tokens, r.output_tokens, name=label, client_ids=r.client_id)


def slice_mean_rps(data: ServeGenData, start_s: float, minutes: float) -> float:
    """Published mean request rate of the slice (whole 10-minute windows it overlaps), requests/s. Pure.

    rate_scale = target_rps / slice_mean_rps(...) gives a workload of about target_rps.
    """
    _, _, t0, t1 = _slice_spans(data, start_s, minutes)
    return float(data.count[:, t0:t1].sum()) / ((t1 - t0) * SERVEGEN_SPAN_S)


def default_start_s(data: ServeGenData, minutes: float = 60.0) -> float:
    """Start of the default slice: a busy hour whose request mix shifts the most. Pure, deterministic.

    Candidates: slices of `minutes` aligned to 10-minute windows, inside one 6-hour length window (so
    any shift comes from which clients are sending, not from the published distributions switching at
    a 6-hour boundary), without a collection gap (a window under 5 % of the median), and busy: holding
    a 10-minute window at or above the 90th percentile of all the model's windows. Among them, the one
    with the largest mix shift: the largest distance, over pairs of its 10-minute windows, between the
    request-weighted means of (log1p median input, log1p median output) of the clients sending
    (uncovered clients take their window's covered pool). Ties go to the earliest.
    """
    spans = int(round(minutes * 60.0 / SERVEGEN_SPAN_S))
    if spans < 1 or abs(spans * SERVEGEN_SPAN_S - minutes * 60.0) > 1e-6 or spans > SPANS_PER_LENGTH_WINDOW:
        raise ConfigError(f"default_start_s: minutes must be a multiple of 10 up to 360; got {minutes}")
    win = data.row.shape[1]
    med_in = np.full(data.row.shape, np.nan)
    med_out = np.full(data.row.shape, np.nan)
    cov = data.row >= 0
    med_in[cov] = np.log1p(data.input_q[data.row[cov], _P50])
    med_out[cov] = np.log1p(data.output_q[data.row[cov], _P50])
    for wi in range(win):  # uncovered clients: request-weighted mean of the covered ones
        w = np.where(cov[:, wi], data.window_requests[:, wi], 0.0)
        if w.sum() > 0:
            med_in[~cov[:, wi], wi] = np.nansum(w * med_in[:, wi]) / w.sum()
            med_out[~cov[:, wi], wi] = np.nansum(w * med_out[:, wi]) / w.sum()
    med_in, med_out = np.nan_to_num(med_in), np.nan_to_num(med_out)
    span_w = np.arange(data.num_spans) // SPANS_PER_LENGTH_WINDOW
    cnt = data.count.astype(np.float64)
    tot = cnt.sum(axis=0)
    safe = np.where(tot > 0, tot, 1.0)
    x = (cnt * med_in[:, span_w]).sum(axis=0) / safe
    y = (cnt * med_out[:, span_w]).sum(axis=0) / safe
    busy = np.quantile(tot, 0.9)
    gap = tot < 0.05 * np.median(tot)
    best, best_t = -1.0, None
    for t in range(data.num_spans - spans + 1):
        if t // SPANS_PER_LENGTH_WINDOW != (t + spans - 1) // SPANS_PER_LENGTH_WINDOW:
            continue
        sl = slice(t, t + spans)
        if gap[sl].any() or tot[sl].max() < busy:
            continue
        d = np.hypot(x[sl][:, None] - x[sl][None, :], y[sl][:, None] - y[sl][None, :]).max()
        if d > best:
            best, best_t = d, t
    if best_t is None:
        raise ConfigError(f"{data.name}: no busy, gap-free {minutes:g}-minute slice")
    return best_t * SERVEGEN_SPAN_S
