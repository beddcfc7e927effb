"""Per-type arrival series from the ServeGen traces, for the forecasters (per-client 10-minute counts + 6-hour length summaries).

Pure core: reads only the two files it is handed, takes randomness as a seed, reads no clock.

ServeGen publishes, per client, the number of requests in each 10-minute window and, per 6-hour window,
the marginal distributions of input and output lengths (summarised in `*_lengths.csv` as quantiles).
There are no per-request records and no joint (input, output) distribution, so the per-type series is
built as follows:

1. Each marginal of a client-window is read as a discrete distribution over 17 quantile bins (levels
   0, .01, .05, .1, .2, .25, .3, .4, .5, .6, .7, .75, .8, .9, .95, .99, .999, 1); the bin between two
   consecutive quantiles carries the difference of their levels and sits at their geometric mean.
2. Input and output are taken as independent within a client-window (the same assumption as
   `../shared/data/README.md`'s heterogeneity table), so the probability of each (input bin, output
   bin) pair is the product of the two bin masses.
3. Workload types are fitted with `oserve.workload_types.fit_types` on requests sampled from those
   distributions, each client-window weighted by its request count (seeded).
4. The type shares of a client-window are the mass of the bin pairs that `WorkloadTypes.classify`
   puts in each type; a client's requests in a 10-minute window are split by the shares of its 6-hour
   window. The series holds expected counts (floats): the client totals are the published counts,
   only the split among types is an expectation.
5. Clients whose length files are missing from the snapshot (the largest ones, 37 % of m-large's
   requests, 29 % of m-mid's) are split by the request-weighted mix of the covered clients in the same
   6-hour window (the whole trace's mix where no covered client is active), so the series' totals are
   the model's true totals.
6. Windows in which no client of the model has any request are collection gaps (m-mid has 84, in 8
   runs; see the data README), not idle spans, and so are the partial windows at their edges; a window
   whose model-wide count is below `gap_fraction` (5 %) of the median window is taken as a gap (m-mid:
   84 empty windows and 18 near-empty ones beside them, all under 1.5 % of the median; the next
   smallest window holds 27 %). With `gaps_as_missing` (the default) gap windows are NaN, which
   forecasters read as "not observed" and the metrics leave out. (m-large has none.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from oserve.servegen import BIN_WEIGHTS, LENGTH_WINDOW_S, SERVEGEN_SPAN_S, length_quantiles, read_servegen
from oserve.workload_types import WorkloadTypes, fit_types

@dataclass(frozen=True, slots=True, eq=False)
class ServeGenSeries:
    """Per-type request counts of one ServeGen model, one row per 10-minute window."""

    name: str
    counts: np.ndarray  # (num_spans, k) float64: expected requests per window and type
    span_s: float  # 600
    types: WorkloadTypes
    covered_share: float  # fraction of requests from clients with published length distributions
    gap_spans: int  # collection-gap windows (NaN rows when gaps_as_missing)


def _bin_points(quantiles: np.ndarray) -> np.ndarray:
    """Geometric midpoints (in tokens) of the 17 bins between 18 quantiles; rows are client-windows. Pure."""
    logq = np.log1p(np.maximum(quantiles, 0.0))
    return np.expm1(0.5 * (logq[:, :-1] + logq[:, 1:]))


def servegen_series(trace_csv: str | os.PathLike[str], lengths_csv: str | os.PathLike[str], *,
                    k: int = 4, seed: int = 0, fit_samples: int = 200_000,
                    name: str | None = None, gaps_as_missing: bool = True,
                    gap_fraction: float = 0.05) -> ServeGenSeries:
    """Build the per-type series of a ServeGen model from its trace and lengths files (see module doc).

    Reads exactly the two files given. Deterministic for a seed.
    """
    tr, ln = read_servegen(trace_csv, lengths_csv, trace_columns=("client_id", "timestamp_s", "rate_rps"))
    trace_csv = Path(trace_csv)

    n_req = np.rint(tr["rate_rps"].to_numpy() * SERVEGEN_SPAN_S)
    t_idx = np.rint(tr["timestamp_s"].to_numpy() / SERVEGEN_SPAN_S).astype(np.int64)
    clients = tr["client_id"].to_numpy()
    num_spans = int(t_idx.max()) + 1
    client_ids = np.unique(clients)
    c_idx = np.searchsorted(client_ids, clients)
    per_client = np.zeros((len(client_ids), num_spans))
    np.add.at(per_client, (c_idx, t_idx), n_req)
    spans_per_window = int(round(LENGTH_WINDOW_S / SERVEGEN_SPAN_S))
    num_windows = (num_spans + spans_per_window - 1) // spans_per_window

    # quantile bins of each covered client-window, input and output side by side
    lq = length_quantiles(ln, lengths_csv, client_ids)
    in_pts, out_pts = _bin_points(lq.input_q), _bin_points(lq.output_q)
    cw_client, cw_window = lq.client_index, lq.window_index

    # requests of each client in each 6-hour window
    padded = np.zeros((len(client_ids), num_windows * spans_per_window))
    padded[:, :num_spans] = per_client
    per_window = padded.reshape(len(client_ids), num_windows, spans_per_window).sum(axis=2)
    cw_requests = per_window[cw_client, cw_window]

    # fit types on requests sampled from the client-window distributions (weighted by requests)
    rng = np.random.default_rng(seed)
    nb = len(BIN_WEIGHTS)
    p = cw_requests / cw_requests.sum()
    rows = rng.choice(len(p), size=fit_samples, p=p)
    bi = rng.choice(nb, size=fit_samples, p=BIN_WEIGHTS)
    bo = rng.choice(nb, size=fit_samples, p=BIN_WEIGHTS)
    types = fit_types(np.rint(in_pts[rows, bi]).astype(np.int64), np.rint(out_pts[rows, bo]).astype(np.int64),
                      k=k, seed=seed)

    # type shares of each covered client-window: mass of the bin pairs in each type
    grid_in = np.repeat(in_pts, nb, axis=1)  # (rows, nb*nb): input bin a repeated for each output bin
    grid_out = np.tile(out_pts, (1, nb))
    labels = types.classify(grid_in, grid_out)  # (rows, nb*nb)
    mass = np.outer(BIN_WEIGHTS, BIN_WEIGHTS).ravel()
    mass = mass / mass.sum()
    shares = np.zeros((len(labels), k))
    for j in range(k):
        shares[:, j] = ((labels == j) * mass).sum(axis=1)

    share_cw = np.full((len(client_ids), num_windows, k), np.nan)
    share_cw[cw_client, cw_window] = shares
    covered = ~np.isnan(share_cw[:, :, 0])
    # request-weighted mix of the covered clients per 6-hour window, for the others
    w = np.where(covered, per_window, 0.0)
    mix_w = np.einsum("cw,cwk->wk", w, np.nan_to_num(share_cw))
    overall = mix_w.sum(axis=0) / mix_w.sum()
    tot = mix_w.sum(axis=1, keepdims=True)
    mix_w = np.where(tot > 0, mix_w / np.where(tot > 0, tot, 1.0), overall)
    share_cw = np.where(covered[:, :, None], share_cw, mix_w[None, :, :])

    span_window = np.arange(num_spans) // spans_per_window
    counts = np.einsum("ct,ctk->tk", per_client, share_cw[:, span_window, :])
    covered_requests = float((per_client * covered[:, span_window]).sum())
    totals = per_client.sum(axis=0)
    gaps = totals < gap_fraction * np.median(totals)
    if gaps_as_missing:
        counts[gaps] = np.nan
    return ServeGenSeries(name=name or trace_csv.stem, counts=counts, span_s=SERVEGEN_SPAN_S, types=types,
                          covered_share=covered_requests / max(float(per_client.sum()), 1.0),
                          gap_spans=int(gaps.sum()))
