"""Tests of oserve.traces and oserve.workload_types: trace loading, workload types (k-means), type mix per span."""

from __future__ import annotations

import hashlib
import itertools
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conftest import SHARED_DATA
from oserve.data import data_path
from oserve.errors import ConfigError, TraceError
from oserve.workload_types import NAMES_4, NUM_LENGTH_SAMPLES, count_spans, fit_types, mix_cv, mix_cv_noise, span_counts
from oserve.traces import Request, Trace, load_trace

SHARED_TRACES = SHARED_DATA / "traces"
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
FAST = settings(max_examples=40, deadline=None)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --------------------------------------------------------------------------------------------------
# Loading: good files


def test_load_azure_csv_without_trailing_newline_sorts_and_rebases(tmp_path: Path) -> None:
    path = write(tmp_path, "t.csv", "\n".join([
        AZURE_HEADER,
        "2023-11-16 18:15:47.0000001,300,30",
        "2023-11-16 18:15:46.6800000,100,10",  # earlier than the row above: the loader sorts
        "2023-11-16 18:16:46.6800000,200,20",
    ]))  # no trailing newline, as in the Azure files
    trace = load_trace(path)
    assert trace.name == "t"
    assert len(trace) == 3
    np.testing.assert_allclose(trace.arrival_s, [0.0, 0.3200001, 60.0], rtol=0, atol=1e-9)
    assert trace.input_tokens.tolist() == [100, 300, 200]
    assert trace.output_tokens.tolist() == [10, 30, 20]
    assert trace.arrival_s.dtype == np.float64 and trace.input_tokens.dtype == np.int64
    assert trace.duration_s == pytest.approx(60.0)


def test_load_azure_csv_ignores_blank_lines_and_extra_columns(tmp_path: Path) -> None:
    path = write(tmp_path, "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens,Other\n"
                                    "2023-11-16 18:15:46.68,5,6,x\n\n"
                                    "2023-11-16 18:15:47,7,8,y\n\n")
    trace = load_trace(path)
    assert trace.input_tokens.tolist() == [5, 7]
    np.testing.assert_allclose(trace.arrival_s, [0.0, 0.32], atol=1e-9)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".ndjson"])
def test_load_jsonl(tmp_path: Path, suffix: str) -> None:
    path = write(tmp_path, "t" + suffix,
                 '{"timestamp": 12.5, "input_length": 100, "output_length": 10}\n'
                 '\n'
                 '{"timestamp": 10, "input_length": 50, "output_length": 5.0, "extra": "x"}\n'
                 '{"timestamp": 20.25, "input_length": 0, "output_length": 1}')
    trace = load_trace(path)
    np.testing.assert_allclose(trace.arrival_s, [0.0, 2.5, 10.25])
    assert trace.input_tokens.tolist() == [50, 100, 0]
    assert trace.output_tokens.tolist() == [5, 10, 1]


def test_bundled_traces_load() -> None:
    conv = load_trace("azure-conv")
    assert len(conv) == 19_366
    assert conv.name == "azure-conv"
    assert conv.arrival_s[0] == 0.0
    assert np.all(np.diff(conv.arrival_s) >= 0)
    assert conv.duration_s == pytest.approx(3501.7, abs=0.1)
    assert float(np.median(conv.input_tokens)) == 1020 and float(np.median(conv.output_tokens)) == 129
    assert conv.input_tokens.min() == 2 and conv.input_tokens.max() == 14_050
    code = load_trace("azure-code")
    assert len(code) == 8_819
    assert code.duration_s == pytest.approx(3435.9, abs=0.1)


@pytest.mark.parametrize("name", ["azure_2023_conv.csv", "azure_2023_code.csv"])
def test_bundled_traces_are_byte_identical_copies(name: str) -> None:
    shipped = data_path(name).read_bytes()
    assert data_path("ATTRIBUTION.md").read_text().count(name) >= 1
    source = SHARED_TRACES / name
    if not source.exists():
        pytest.skip(f"source copy {source} not present on this machine")
    assert hashlib.sha256(shipped).hexdigest() == hashlib.sha256(source.read_bytes()).hexdigest()


def test_core_imports_no_bus_or_async() -> None:
    code = ("import sys, oserve.traces, oserve.workload_types; "
            "bad = [m for m in ('nats', 'asyncio', 'opentelemetry') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------------------------
# Loading: bad input, each error names the problem (and its line)


def test_missing_file() -> None:
    with pytest.raises(TraceError, match=r"trace file not found: '/no/such/trace.csv'.*azure-conv"):
        load_trace("/no/such/trace.csv")


def test_unknown_extension(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"extension '\.txt'.*\.csv.*\.jsonl"):
        load_trace(write(tmp_path, "t.txt", "x"))


def test_csv_missing_column_names_it_and_lists_columns(tmp_path: Path) -> None:
    path = write(tmp_path, "t.csv", "TIMESTAMP,ContextTokens,Output\n2023-11-16 18:15:46.68,1,2\n")
    with pytest.raises(TraceError) as err:
        load_trace(path)
    msg = str(err.value)
    assert "missing column GeneratedTokens" in msg
    assert "TIMESTAMP, ContextTokens, Output" in msg


def test_csv_negative_token_count_gives_line(tmp_path: Path) -> None:
    path = write(tmp_path, "t.csv", "\n".join([
        AZURE_HEADER,                       # line 1
        "2023-11-16 18:15:46.6800000,1,2",  # line 2
        "2023-11-16 18:15:47.6800000,3,4",  # line 3
        "2023-11-16 18:15:48.6800000,-5,6",  # line 4
    ]))
    with pytest.raises(TraceError, match=r"t\.csv: line 4: negative token count in ContextTokens: -5"):
        load_trace(path)


def test_csv_non_integer_token_count_gives_line_counting_blank_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "t.csv", "\n".join([
        AZURE_HEADER,                        # line 1
        "2023-11-16 18:15:46.6800000,1,2",   # line 2
        "",                                  # line 3 (blank)
        "2023-11-16 18:15:47.6800000,3,4.5",  # line 4
        "2023-11-16 18:15:48.6800000,3,7.5",  # line 5
    ]))
    with pytest.raises(TraceError) as err:
        load_trace(path)
    msg = str(err.value)
    assert "line 4: non-integer token count in GeneratedTokens: 4.5" in msg
    assert "1 more bad line like it" in msg


def test_csv_token_count_not_a_number(tmp_path: Path) -> None:
    path = write(tmp_path, "t.csv", f"{AZURE_HEADER}\n2023-11-16 18:15:46.68,1,2\n"
                                    "2023-11-16 18:15:47,abc,2\n")
    with pytest.raises(TraceError, match=r"line 3: ContextTokens is not a number: 'abc'"):
        load_trace(path)


def test_csv_unparsable_timestamp_gives_line_and_value(tmp_path: Path) -> None:
    path = write(tmp_path, "t.csv", "\n".join([
        AZURE_HEADER,
        "2023-11-16 18:15:46.6800000,1,2",
        "2023-11-16 18:15:47.6800000,1,2",
        "16/11/2023 18:15,1,2",  # line 4
    ]))
    with pytest.raises(TraceError, match=r"line 4: cannot parse TIMESTAMP '16/11/2023 18:15'"):
        load_trace(path)


def test_csv_missing_value_gives_line(tmp_path: Path) -> None:
    path = write(tmp_path, "t.csv", f"{AZURE_HEADER}\n2023-11-16 18:15:46.68,1,2\n2023-11-16 18:15:47,,2\n")
    with pytest.raises(TraceError, match=r"line 3: missing value for ContextTokens"):
        load_trace(path)


def test_csv_ragged_row_gives_line(tmp_path: Path) -> None:
    path = write(tmp_path, "t.csv", f"{AZURE_HEADER}\n2023-11-16 18:15:46.68,1,2\n"
                                    "2023-11-16 18:15:47,1,2,3\n")
    with pytest.raises(TraceError, match=r"line 3: 4 fields where the header has 3"):
        load_trace(path)


@pytest.mark.parametrize("text, what", [("", "the file is empty"),
                                        (AZURE_HEADER + "\n", "a header and no rows"),
                                        (AZURE_HEADER + "\n\n\n", "a header and no rows")])
def test_csv_empty(tmp_path: Path, text: str, what: str) -> None:
    with pytest.raises(TraceError, match=f"empty trace \\({what}\\)"):
        load_trace(write(tmp_path, "t.csv", text))


@pytest.mark.parametrize("text", ["", "\n  \n\n"])
def test_jsonl_empty(tmp_path: Path, text: str) -> None:
    with pytest.raises(TraceError, match="empty trace"):
        load_trace(write(tmp_path, "t.jsonl", text))


def test_jsonl_missing_field(tmp_path: Path) -> None:
    path = write(tmp_path, "t.jsonl", '{"timestamp": 1, "input_length": 2, "output_tokens": 3}\n')
    with pytest.raises(TraceError) as err:
        load_trace(path)
    msg = str(err.value)
    assert "missing field output_length" in msg
    assert "timestamp, input_length, output_tokens" in msg


def test_jsonl_negative_count_line_counts_blank_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "t.jsonl",
                 '{"timestamp": 1, "input_length": 2, "output_length": 3}\n'   # line 1
                 '\n'                                                           # line 2
                 '{"timestamp": 2, "input_length": 2, "output_length": -3}\n')  # line 3
    with pytest.raises(TraceError, match=r"line 3: negative token count in output_length: -3"):
        load_trace(path)


def test_jsonl_non_integer_count(tmp_path: Path) -> None:
    path = write(tmp_path, "t.jsonl",
                 '{"timestamp": 1, "input_length": 2.5, "output_length": 3}\n')
    with pytest.raises(TraceError, match=r"line 1: non-integer token count in input_length: 2.5"):
        load_trace(path)


def test_jsonl_missing_value_gives_line(tmp_path: Path) -> None:
    path = write(tmp_path, "t.jsonl",
                 '{"timestamp": 1, "input_length": 2, "output_length": 3}\n'
                 '{"timestamp": 2, "input_length": 2}\n')
    with pytest.raises(TraceError, match=r"line 2: missing value for output_length"):
        load_trace(path)


def test_jsonl_unparsable_timestamp_gives_line_and_value(tmp_path: Path) -> None:
    path = write(tmp_path, "t.jsonl",
                 '{"timestamp": 1, "input_length": 2, "output_length": 3}\n'
                 '{"timestamp": "yesterday", "input_length": 2, "output_length": 3}\n')
    with pytest.raises(TraceError, match=r"line 2: cannot parse timestamp 'yesterday'"):
        load_trace(path)


def test_jsonl_bad_json_gives_line(tmp_path: Path) -> None:
    path = write(tmp_path, "t.jsonl",
                 '{"timestamp": 1, "input_length": 2, "output_length": 3}\n'
                 '\n'
                 '{"timestamp": 2, "input_length": 2,\n')
    with pytest.raises(TraceError, match=r"line 3: not valid JSON"):
        load_trace(path)


# --------------------------------------------------------------------------------------------------
# Trace


def test_trace_requests_and_slice() -> None:
    trace = Trace(np.array([0.0, 1.0, 61.0, 130.0]), np.array([1, 2, 3, 4]), np.array([5, 6, 7, 8]),
                  name="x")
    reqs = list(trace.requests())
    assert reqs[2] == Request("x-2", 61.0, 3, 7)
    part = trace.slice_time(60.0, 130.0)
    assert part.arrival_s.tolist() == [1.0] and part.input_tokens.tolist() == [3]
    assert len(trace.slice_time(200.0, 300.0)) == 0 and trace.slice_time(200.0, 300.0).duration_s == 0.0
    assert Trace.from_requests(list(reversed(reqs))).input_tokens.tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        trace.arrival_s[0] = 5.0  # read-only
    with pytest.raises(ConfigError, match="sorted"):
        Trace(np.array([1.0, 0.5]), np.array([1, 1]), np.array([1, 1]))
    with pytest.raises(ConfigError, match="differ in length"):
        Trace(np.array([0.0]), np.array([1, 1]), np.array([1]))
    with pytest.raises(ConfigError):
        trace.slice_time(10.0, 5.0)


# --------------------------------------------------------------------------------------------------
# Workload types (k-means)

token_pairs = st.lists(st.tuples(st.integers(0, 50_000), st.integers(0, 5_000)), min_size=1, max_size=80)


def arrays(pairs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    a = np.array([p[0] for p in pairs], dtype=np.int64)
    b = np.array([p[1] for p in pairs], dtype=np.int64)
    return a, b


def blobs(rng: np.random.Generator, per_blob: int, centres_tokens: list[tuple[float, float]],
          spread: float = 0.15) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Points scattered around centres in log space; returns (input, output, blob index)."""
    ins, outs, which = [], [], []
    for j, (ci, co) in enumerate(centres_tokens):
        ins.append(np.round(np.expm1(math.log1p(ci) + rng.uniform(-spread, spread, per_blob))))
        outs.append(np.round(np.expm1(math.log1p(co) + rng.uniform(-spread, spread, per_blob))))
        which.append(np.full(per_blob, j))
    return (np.concatenate(ins).astype(np.int64), np.concatenate(outs).astype(np.int64),
            np.concatenate(which))


@FAST
@given(token_pairs, st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_same_seed_same_result(pairs: list[tuple[int, int]], k: int, seed: int) -> None:
    a, b = arrays(pairs)
    assume(len(set(pairs)) >= k)
    assert fit_types(a, b, k=k, seed=seed) == fit_types(a.copy(), b.copy(), k=k, seed=seed)


@FAST
@given(token_pairs, st.integers(1, 5), st.randoms(use_true_random=False))
def test_invariant_under_shuffling(pairs: list[tuple[int, int]], k: int, rnd) -> None:
    assume(len(set(pairs)) >= k)
    shuffled = list(pairs)
    rnd.shuffle(shuffled)
    a, b = arrays(pairs)
    sa, sb = arrays(shuffled)
    types = fit_types(a, b, k=k)
    assert fit_types(sa, sb, k=k) == types
    # so each request keeps its label wherever it sits in the input
    assert types.classify(sa, sb).tolist() == [types.classify_one(i, o) for i, o in shuffled]


@FAST
@given(token_pairs, st.integers(1, 5))
def test_labels_are_nearest_centroids_and_centroids_are_means(pairs: list[tuple[int, int]], k: int) -> None:
    assume(len(set(pairs)) >= k)
    a, b = arrays(pairs)
    types = fit_types(a, b, k=k)
    labels = types.classify(a, b)
    for i, (x_in, x_out) in enumerate(pairs):
        d = [(math.log1p(x_in) - c_in) ** 2 + (math.log1p(x_out) - c_out) ** 2
             for c_in, c_out in types.centroids_log]
        assert d[labels[i]] <= min(d) + 1e-12
    # a Lloyd fixed point: every centroid is the mean of its members in log space
    for j, (c_in, c_out) in enumerate(types.centroids_log):
        members = labels == j
        assert members.any()
        assert np.log1p(a[members]).mean() == pytest.approx(c_in, abs=1e-9)
        assert np.log1p(b[members]).mean() == pytest.approx(c_out, abs=1e-9)
        assert types.stats[j].num_requests == int(members.sum())
    assert sum(s.num_requests for s in types.stats) == len(pairs)
    assert sum(s.share for s in types.stats) == pytest.approx(1.0)


@FAST
@given(token_pairs, st.integers(1, 6))
def test_names_unique_and_positional(pairs: list[tuple[int, int]], k: int) -> None:
    assume(len(set(pairs)) >= k)
    types = fit_types(*arrays(pairs), k=k)
    assert len(set(types.names)) == k
    if k == 4:
        assert types.names == NAMES_4
    else:
        assert types.names == tuple(f"T{j}" for j in range(k))
        assert list(types.centroids_log) == sorted(types.centroids_log)
    hash(types)  # hashable: can key a cache


@FAST
@given(token_pairs, st.integers(1, 4), st.integers(0, 2**32 - 1), st.floats(-0.05, 0.05))
def test_refit_keeps_names_by_matching(pairs: list[tuple[int, int]], k: int, seed: int,
                                       jitter: float) -> None:
    assume(len(set(pairs)) >= k)
    a, b = arrays(pairs)
    types = fit_types(a, b, k=k, seed=seed)
    assert fit_types(a, b, k=k, seed=seed + 1, previous=types) == types  # a fixed point
    rng = np.random.default_rng(seed)
    pa = np.round(a * np.exp(jitter * rng.standard_normal(len(a)))).astype(np.int64)
    pb = np.round(b * np.exp(jitter * rng.standard_normal(len(b)))).astype(np.int64)
    assume(len(set(zip(pa.tolist(), pb.tolist()))) >= k)
    refit = fit_types(pa, pb, k=k, previous=types)
    assert refit.names == types.names
    # the names follow the cheapest matching of new to old centroids
    new = np.array(refit.centroids_log)
    old = np.array(types.centroids_log)

    def cost(perm: tuple[int, ...]) -> float:
        return float(sum(((new[j] - old[perm[j]]) ** 2).sum() for j in range(k)))

    assert cost(tuple(range(k))) <= min(cost(p) for p in itertools.permutations(range(k))) + 1e-9


GRID = [(200.0, 30.0), (200.0, 600.0), (4000.0, 30.0), (4000.0, 600.0)]  # SISO, SILO, LISO, LILO


@FAST
@given(st.integers(0, 2**32 - 1), st.integers(5, 40), st.permutations(range(4)))
def test_well_separated_blobs_are_recovered_and_named(seed: int, per_blob: int, order: list[int]) -> None:
    rng = np.random.default_rng(seed)
    a, b, blob = blobs(rng, per_blob, [GRID[j] for j in order])
    types = fit_types(a, b, k=4, seed=seed)
    labels = types.classify(a, b)
    for j, grid_j in enumerate(order):  # blob j sits at grid corner grid_j: it is one whole type
        assert set(labels[blob == j].tolist()) == {grid_j}
        assert types.names[grid_j] == NAMES_4[grid_j]
    # the optimum is the blob partition
    pts = np.log1p(np.column_stack([a, b]).astype(float))
    optimum = sum(((pts[blob == j] - pts[blob == j].mean(axis=0)) ** 2).sum() for j in range(4))
    assert types.inertia == pytest.approx(optimum, rel=1e-9)
    # a refit on drifted data keeps every blob under its name
    drifted_a = np.round(a * 1.15).astype(np.int64)
    refit = fit_types(drifted_a, b, k=4, previous=types)
    assert refit.classify(drifted_a, b).tolist() == labels.tolist()


def exhaustive_inertia(a: np.ndarray, b: np.ndarray, k: int) -> float:
    pts = np.log1p(np.column_stack([a, b]).astype(float))
    best = math.inf
    for lab in itertools.product(range(k), repeat=len(pts)):
        lab_arr = np.array(lab)
        if len(set(lab)) < k:
            continue
        best = min(best, sum(((pts[lab_arr == j] - pts[lab_arr == j].mean(axis=0)) ** 2).sum()
                             for j in range(k)))
    return best


@pytest.mark.parametrize("instance", range(12))
def test_kmeans_matches_exhaustive_search_on_tiny_instances(instance: int) -> None:
    rng = np.random.default_rng(1000 + instance)
    n, k = 7, 2 + instance % 2
    a = rng.integers(1, 20_000, n)
    b = rng.integers(1, 2_000, n)
    assert fit_types(a, b, k=k).inertia == pytest.approx(exhaustive_inertia(a, b, k), rel=1e-9)


def test_type_lengths_and_stats() -> None:
    rng = np.random.default_rng(3)
    a, b, blob = blobs(rng, 50, GRID)
    types = fit_types(a, b, k=4)
    for j in range(4):
        inp, out, w = types.type_lengths(j)
        assert len(inp) == len(out) == len(w) == NUM_LENGTH_SAMPLES
        assert w.sum() == pytest.approx(1.0)
        assert np.all(np.diff(inp) >= 0) and np.all(np.diff(out) >= 0)
        members = blob == j
        assert set(inp.tolist()) <= set(a[members].tolist())  # observed lengths of its members
        assert types.stats[j].mean_input_tokens == pytest.approx(a[members].mean())
        assert types.stats[j].mean_output_tokens == pytest.approx(b[members].mean())
    assert types.index("LISO") == 2
    with pytest.raises(ConfigError, match="no workload type"):
        types.index("XL")


def test_fit_types_rejects_bad_input() -> None:
    with pytest.raises(ConfigError, match="at least 4 distinct"):
        fit_types(np.array([1, 1, 2]), np.array([1, 1, 2]), k=4)
    with pytest.raises(ConfigError, match="k must be >= 1"):
        fit_types(np.array([1]), np.array([1]), k=0)
    types = fit_types(np.array([1, 2, 3, 4]), np.array([1, 2, 3, 4]), k=4)
    with pytest.raises(ConfigError, match="previous has 4 types"):
        fit_types(np.array([1, 2, 3]), np.array([1, 2, 3]), k=3, previous=types)
    with pytest.raises(ConfigError, match=">= 0"):
        types.classify(np.array([-1]), np.array([1]))


def test_classify_is_vectorised_and_matches_classify_one() -> None:
    types = fit_types(*blobs(np.random.default_rng(0), 20, GRID)[:2], k=4)
    a = np.array([[150, 5000], [3000, 10]])
    b = np.array([[20, 20], [900, 900]])
    got = types.classify(a, b)
    assert got.shape == (2, 2) and got.dtype == np.int64
    assert got.tolist() == [[types.classify_one(int(x), int(y)) for x, y in zip(ra, rb)]
                            for ra, rb in zip(a, b)]
    assert got.tolist() == [[0, 2], [3, 1]]  # SISO, LISO / LILO, SILO


@settings(max_examples=200, deadline=None)
@given(centroids=st.lists(st.tuples(st.floats(0, 12), st.floats(0, 12)), min_size=1, max_size=8),
       points=st.lists(st.tuples(st.integers(0, 200_000), st.integers(0, 200_000)), min_size=1, max_size=40),
       copy=st.booleans())
def test_classify_one_equals_classify_bit_for_bit(centroids, points, copy) -> None:
    """Reference: the vectorised `classify` (numpy's argmin over `_sq_dist`). The scalar path gives the same
    index for every point, ties included: with `copy`, a centroid is duplicated, so every point nearest to it
    is an exact tie, which both must give to the lower index; and a centroid placed on a point's own log
    lengths (by libm's log1p, numpy's on most builds) makes its distance 0 or within an ulp of it. Non-finite
    centroids are refused (numpy's argmin would pick a NaN distance, a strict comparison never does)."""
    from oserve.workload_types import TypeStats, WorkloadTypes

    if copy:
        centroids = centroids + [centroids[0]]
    x, y = points[0]
    centroids = centroids + [(math.log1p(x), math.log1p(y))]
    stats = TypeStats(0, 0.0, 0.0, 0.0, (1,), (1,))
    types = WorkloadTypes(tuple(f"t{j}" for j in range(len(centroids))), tuple(centroids),
                          tuple(stats for _ in centroids), 0.0)
    a, b = np.array([p[0] for p in points]), np.array([p[1] for p in points])
    assert types.classify(a, b).tolist() == [types.classify_one(i, o) for i, o in points]
    with pytest.raises(ConfigError, match="finite"):
        WorkloadTypes(("a", "b"), ((1.0, math.nan), (5.0, 5.0)), (stats, stats), 0.0)


def test_bundled_conv_types() -> None:
    trace = load_trace("azure-conv")
    types = fit_types(trace.input_tokens, trace.output_tokens, k=4, seed=0)
    assert types.names == NAMES_4
    shares = [s.share for s in types.stats]
    assert sum(shares) == pytest.approx(1.0) and min(shares) > 0.05
    c = dict(zip(types.names, types.centroids_tokens))
    assert c["LISO"][0] > c["SISO"][0] and c["LILO"][1] > c["LISO"][1]


# --------------------------------------------------------------------------------------------------
# Type mix per span


@FAST
@given(st.lists(st.floats(0, 1_000, allow_nan=False), min_size=1, max_size=200),
       st.floats(1, 400), st.integers(1, 5), st.integers(0, 1000))
def test_count_spans_counts_requests_in_full_spans(arrivals: list[float], span_s: float, k: int,
                                                   seed: int) -> None:
    t = np.sort(np.array(arrivals))
    labels = np.random.default_rng(seed).integers(0, k, len(t))
    counts = count_spans(t, labels, k, span_s)
    num_full = int(t.max() // span_s)
    if num_full == 0:  # the only, partial span is kept whole
        assert counts.shape == (1, k) and counts.sum() == len(t)
        return
    assert counts.shape == (num_full, k)
    assert counts.sum() == int(np.sum(t < num_full * span_s))
    for i in range(num_full):
        in_span = (t >= i * span_s) & (t < (i + 1) * span_s)
        assert counts[i].tolist() == np.bincount(labels[in_span], minlength=k).tolist()


def test_span_counts_on_trace() -> None:
    trace = Trace(np.array([0.0, 10.0, 59.9, 60.0, 119.0, 125.0]), np.array([100] * 6),
                  np.array([10, 10, 10, 10, 10, 10]))
    types = fit_types(np.array([100, 200, 5000, 6000]), np.array([10, 12, 400, 500]), k=2)
    counts = span_counts(trace, types, span_s=60.0)
    assert counts.tolist() == [[3, 0], [2, 0]]  # the request at 125 s is in the partial span: dropped
    assert span_counts(trace.slice_time(0.0, 50.0), types, 60.0).tolist() == [[2, 0]]  # only span
    assert span_counts(trace.slice_time(500.0, 600.0), types, 60.0).shape == (0, 2)
    with pytest.raises(ConfigError, match="span_s"):
        span_counts(trace, types, span_s=0.0)


@FAST
@given(st.lists(st.integers(1, 50), min_size=1, max_size=30),
       st.lists(st.integers(0, 9), min_size=2, max_size=5))
def test_mix_cv_of_constant_mix_is_zero(scales: list[int], base: list[int]) -> None:
    assume(sum(base) > 0)
    counts = np.outer(scales, base)
    counts = np.vstack([counts, np.zeros((2, len(base)), dtype=np.int64)])  # idle spans are skipped
    cv = mix_cv(counts)
    for j, weight in enumerate(base):
        if weight == 0:
            assert math.isnan(cv[j])
        else:
            assert cv[j] == pytest.approx(0.0, abs=1e-9)


def test_mix_cv_known_value_and_noise() -> None:
    counts = np.array([[1, 3], [3, 1], [0, 0]])  # proportions 0.25/0.75 then 0.75/0.25
    np.testing.assert_allclose(mix_cv(counts), [0.5, 0.5])
    # binomial noise: p = 0.5, n = 4 per span -> sqrt(0.25 / 4) / 0.5 = 0.5
    np.testing.assert_allclose(mix_cv_noise(counts), [0.5, 0.5])
    assert np.isnan(mix_cv(np.zeros((3, 2)))).all()
