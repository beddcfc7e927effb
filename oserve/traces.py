"""Request traces: a trace as columns, and loading one from a file (Azure CSV, JSON Lines) or by name.

Pure core: no asyncio, no NATS, no clock reads, no environment reads; the only files read are the ones
handed to `load_trace` (a path, or the name of a trace shipped in `oserve.data`).

Workload types (clusters of these requests) live in `oserve.workload_types`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from oserve.data import data_path
from oserve.errors import ConfigError, TraceError

# bundled trace name -> file in oserve.data (see oserve/data/ATTRIBUTION.md)
BUNDLED_TRACES: dict[str, str] = {
    "azure-conv": "azure_2023_conv.csv",
    "azure-code": "azure_2023_code.csv",
}

# Azure LLM inference trace columns: arrival, input tokens, output tokens
AZURE_COLUMNS: tuple[str, str, str] = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# JSON Lines fields: arrival in seconds, input tokens, output tokens
JSONL_FIELDS: tuple[str, str, str] = ("timestamp", "input_length", "output_length")

_CSV_SUFFIXES = (".csv",)
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_AZURE_TIME_FORMAT = "%Y-%m-%d %H:%M:%S%.f"  # %.f: optional fraction, up to 9 digits (Azure has 7)



# --------------------------------------------------------------------------------------------------
# Requests and traces


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace: when it arrives and how long its prompt and its answer are."""

    request_id: str
    arrival_s: float  # seconds from the start of the trace
    input_tokens: int
    output_tokens: int


def context_rule(input_tokens, max_tokens, context_tokens: int):
    """vLLM's context-window rule, for one request (ints) or many (arrays): (refused, the answer's cap).
    A request is refused when its input plus max tokens (1 when none is given, max tokens 0) exceeds
    the window; an answer stops at its max tokens, or at the window when none is given. Pure."""
    refused = input_tokens + np.maximum(max_tokens, 1) > context_tokens
    cap = np.where(np.asarray(max_tokens) > 0, np.minimum(max_tokens, context_tokens - input_tokens),
                   context_tokens - input_tokens)
    return refused, cap


@dataclass(frozen=True, slots=True, eq=False)
class Trace:
    """A request trace as columns: arrivals sorted ascending, in seconds from the trace's time origin.

    A loaded trace's first request arrives at 0. A slice keeps the time origin of its window (its
    first request may arrive after 0), so spans counted on a slice line up with the window. The arrays
    are copied and made read-only; equality is identity (compare the arrays yourself).
    """

    arrival_s: np.ndarray  # float64, sorted ascending, >= 0
    input_tokens: np.ndarray  # int64, >= 0
    output_tokens: np.ndarray  # int64, >= 0: the answer's true length, known once it is generated
    name: str = "trace"
    max_tokens: np.ndarray | None = None
    """int64 per request: the client's cap on the answer's length; 0 where none was given (None: none at all)."""
    client_ids: np.ndarray | None = None
    """int64 per request: who sent it (an application, an API customer); -1 where unknown (None: all unknown)."""

    def __post_init__(self) -> None:
        arrival_s = np.array(self.arrival_s, dtype=np.float64)
        input_tokens = np.array(self.input_tokens, dtype=np.int64)
        output_tokens = np.array(self.output_tokens, dtype=np.int64)
        n = len(arrival_s)
        max_tokens = np.zeros(n, dtype=np.int64) if self.max_tokens is None else \
            np.array(self.max_tokens, dtype=np.int64)
        client_ids = np.full(n, -1, dtype=np.int64) if self.client_ids is None else \
            np.array(self.client_ids, dtype=np.int64)
        columns = (("arrival_s", arrival_s), ("input_tokens", input_tokens), ("output_tokens", output_tokens),
                   ("max_tokens", max_tokens), ("client_ids", client_ids))
        if not all(arr.ndim == 1 for _, arr in columns):
            raise ConfigError("Trace columns must be 1-D arrays")
        if any(len(arr) != n for _, arr in columns):
            raise ConfigError("Trace columns differ in length: "
                              + ", ".join(f"{name} {len(arr)}" for name, arr in columns))
        if n:
            if not np.all(np.isfinite(arrival_s)) or arrival_s[0] < 0:
                raise ConfigError(f"Trace arrival_s must be finite and >= 0; first is {arrival_s[0]!r}")
            if np.any(np.diff(arrival_s) < 0):
                raise ConfigError("Trace arrival_s must be sorted ascending")
            if input_tokens.min() < 0 or output_tokens.min() < 0 or max_tokens.min() < 0:
                raise ConfigError("Trace token counts must be >= 0")
        for name, arr in columns:
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)

    def __len__(self) -> int:
        return len(self.arrival_s)

    def __repr__(self) -> str:
        return f"Trace(name={self.name!r}, num_requests={len(self)}, duration_s={self.duration_s:.3f})"

    @property
    def duration_s(self) -> float:
        """Time from the trace's origin to its last arrival (0 for an empty trace). Pure."""
        return float(self.arrival_s[-1]) if len(self.arrival_s) else 0.0

    def requests(self) -> Iterator[Request]:
        """Yield the requests in arrival order; ids are `{name}-{index}`. Pure."""
        name = self.name
        for i, (t, n_in, n_out) in enumerate(zip(self.arrival_s.tolist(), self.input_tokens.tolist(),
                                                 self.output_tokens.tolist())):
            yield Request(f"{name}-{i}", t, n_in, n_out)

    def served(self, context_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """How a server with a `context_tokens` window serves each request (`context_rule`): (refused,
        tokens generated). An admitted request stops at its answer's cap (at least 1 token); a refused
        one keeps its trace length. Pure."""
        refused, limit = context_rule(self.input_tokens, self.max_tokens, context_tokens)
        return refused, np.where(refused, self.output_tokens, np.maximum(np.minimum(self.output_tokens, limit), 1))

    def slice_time(self, start_s: float, end_s: float) -> Trace:
        """The requests arriving in [start_s, end_s), with times re-based so start_s becomes 0. Pure."""
        if not (math.isfinite(start_s) and math.isfinite(end_s)) or end_s < start_s:
            raise ConfigError(f"slice_time needs finite start_s <= end_s; got {start_s!r}, {end_s!r}")
        lo, hi = np.searchsorted(self.arrival_s, [start_s, end_s], side="left")
        return Trace(self.arrival_s[lo:hi] - start_s, self.input_tokens[lo:hi], self.output_tokens[lo:hi],
                     name=f"{self.name}[{start_s:g}:{end_s:g}]", max_tokens=self.max_tokens[lo:hi],
                     client_ids=self.client_ids[lo:hi])

    def take(self, index: np.ndarray, arrival_s: np.ndarray | None = None, name: str | None = None) -> Trace:
        """The requests at `index` (every column), optionally at new arrival times; sorted by arrival. Pure."""
        index = np.asarray(index, dtype=np.int64)
        times = self.arrival_s[index] if arrival_s is None else np.asarray(arrival_s, dtype=np.float64)
        order = np.argsort(times, kind="stable")
        index = index[order]
        return Trace(times[order], self.input_tokens[index], self.output_tokens[index], name=name or self.name,
                     max_tokens=self.max_tokens[index], client_ids=self.client_ids[index])

    @staticmethod
    def concat(parts: list[Trace], name: str) -> Trace:
        """The requests of every part, in arrival order (each part's own times). Pure."""
        if not parts:
            raise ConfigError("Trace.concat needs at least one part")
        col = lambda attr: np.concatenate([getattr(p, attr) for p in parts])  # noqa: E731
        arrival = col("arrival_s")
        order = np.argsort(arrival, kind="stable")
        return Trace(arrival[order], col("input_tokens")[order], col("output_tokens")[order], name=name,
                     max_tokens=col("max_tokens")[order], client_ids=col("client_ids")[order])

    @classmethod
    def from_requests(cls, requests: list[Request] | tuple[Request, ...], name: str = "trace") -> Trace:
        """Build a trace from requests (sorted by arrival, stably; ids are not kept). Pure."""
        arrival_s = np.array([r.arrival_s for r in requests], dtype=np.float64)
        order = np.argsort(arrival_s, kind="stable")
        return cls(arrival_s[order],
                   np.array([r.input_tokens for r in requests], dtype=np.int64)[order],
                   np.array([r.output_tokens for r in requests], dtype=np.int64)[order], name=name)


# --------------------------------------------------------------------------------------------------
# Loading


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Read a trace file (Azure CSV or JSON Lines) or a bundled trace by name; reads only that file.

    Formats, told apart by the file extension:
    - `.csv`: the Azure LLM inference trace, columns `TIMESTAMP` (`YYYY-MM-DD HH:MM:SS.fffffff`),
      `ContextTokens`, `GeneratedTokens`; other columns are ignored.
    - `.jsonl`, `.json`, `.ndjson`: one JSON object per line with `timestamp` (seconds),
      `input_length` and `output_length` (tokens).
    Bundled names: `azure-conv`, `azure-code` (see `oserve/data/ATTRIBUTION.md`).

    Blank lines are skipped. Rows are sorted by arrival (stably) if the file is not, and times are
    shifted so the first request arrives at 0. Token counts must be whole numbers >= 0 (`12.0` is
    accepted). Raises TraceError naming the problem and, for a bad value, its 1-based line number in
    the file (a CSV header is line 1).
    """
    if isinstance(path, str) and path in BUNDLED_TRACES:
        file_path, name = data_path(BUNDLED_TRACES[path]), path
    else:
        file_path = Path(path)
        name = file_path.stem
    if not file_path.exists():
        raise TraceError(f"trace file not found: {str(path)!r} "
                         f"(bundled traces: {', '.join(BUNDLED_TRACES)})")
    if file_path.is_dir():
        raise TraceError(f"trace path is a directory, not a file: {str(path)!r}")
    suffix = file_path.suffix.lower()
    if suffix in _CSV_SUFFIXES:
        arrival_s, input_tokens, output_tokens = _read_azure_csv(file_path)
    elif suffix in _JSONL_SUFFIXES:
        arrival_s, input_tokens, output_tokens = _read_jsonl(file_path)
    else:
        raise TraceError(f"cannot tell the format of {str(path)!r} from its extension {suffix!r}: "
                         f"expected .csv (Azure) or .jsonl/.json/.ndjson (JSON Lines)")
    if np.any(np.diff(arrival_s) < 0):
        order = np.argsort(arrival_s, kind="stable")
        arrival_s, input_tokens, output_tokens = arrival_s[order], input_tokens[order], output_tokens[order]
    return Trace(arrival_s, input_tokens, output_tokens, name=name)


def _read_azure_csv(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parse an Azure trace CSV into (arrival_s from the first request, input, output). Reads `path`."""
    try:
        df = pl.read_csv(path, infer_schema=False)
    except pl.exceptions.NoDataError:
        raise TraceError(f"{path}: empty trace (the file is empty)") from None
    except pl.exceptions.PolarsError as exc:
        _raise_csv_shape_error(path)
        raise TraceError(f"{path}: cannot read as CSV: {_first_line(exc)}") from None
    missing = [c for c in AZURE_COLUMNS if c not in df.columns]
    if missing:
        raise TraceError(f"{path}: missing column{'s' if len(missing) > 1 else ''} "
                         f"{', '.join(missing)}; the file has columns: {', '.join(df.columns) or '(none)'}")
    # polars keeps blank lines as rows of nulls, so row i is line i + 2 (the header is line 1)
    df = (df.select([pl.col(c).str.strip_chars() for c in AZURE_COLUMNS])
          .with_row_index("_line", offset=2)
          .filter(~pl.all_horizontal([pl.col(c).is_null() | (pl.col(c) == "") for c in AZURE_COLUMNS])))
    if df.height == 0:
        raise TraceError(f"{path}: empty trace (a header and no rows)")
    lines = df["_line"]
    for col in AZURE_COLUMNS:
        _check_present(path, df[col], col, lines)
    stamps = df["TIMESTAMP"].str.strptime(pl.Datetime("ns"), _AZURE_TIME_FORMAT, strict=False)
    bad = stamps.is_null()
    if bad.any():
        _raise_bad_rows(path, bad, lines, df["TIMESTAMP"],
                        "cannot parse TIMESTAMP {value!r}; expected YYYY-MM-DD HH:MM:SS[.fffffff]")
    ns = stamps.cast(pl.Int64).to_numpy()
    arrival_s = (ns - ns.min()).astype(np.float64) / 1e9  # subtract in int64: keeps the 100-ns ticks
    input_tokens = _tokens(path, df["ContextTokens"], "ContextTokens", lines)
    output_tokens = _tokens(path, df["GeneratedTokens"], "GeneratedTokens", lines)
    return arrival_s, input_tokens, output_tokens


def _read_jsonl(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parse a JSON Lines trace into (arrival_s from the first request, input, output). Reads `path`."""
    if path.stat().st_size == 0:
        raise TraceError(f"{path}: empty trace (the file is empty)")
    try:
        df = pl.read_ndjson(path, infer_schema_length=None)
    except pl.exceptions.PolarsError as exc:
        _raise_jsonl_syntax_error(path)
        raise TraceError(f"{path}: cannot read as JSON Lines: {_first_line(exc)}") from None
    if df.height == 0:
        raise TraceError(f"{path}: empty trace (no JSON objects)")
    missing = [c for c in JSONL_FIELDS if c not in df.columns]
    if missing:
        raise TraceError(f"{path}: missing field{'s' if len(missing) > 1 else ''} "
                         f"{', '.join(missing)}; the objects have fields: "
                         f"{', '.join(df.columns) or '(none)'}")
    # polars skips blank lines; map row -> line only when an error needs it (one pass over the file)
    lines = _LazyLines(path)
    for col in JSONL_FIELDS:
        _check_present(path, df[col], col, lines)
    stamps = _as_float(path, df["timestamp"], "timestamp")
    bad = stamps.is_null() | ~stamps.is_finite()
    if bad.any():
        _raise_bad_rows(path, bad, lines, df["timestamp"].cast(pl.String, strict=False),
                        "cannot parse timestamp {value!r}; expected seconds as a number")
    t = stamps.to_numpy()
    arrival_s = t - t.min()
    input_tokens = _tokens(path, df["input_length"], "input_length", lines)
    output_tokens = _tokens(path, df["output_length"], "output_length", lines)
    return arrival_s, input_tokens, output_tokens


class _LazyLines:
    """Row index -> 1-based line number of a JSON Lines file, computed on first use. Reads `path`."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lines: list[int] | None = None

    def __getitem__(self, row: int) -> int:
        if self._lines is None:
            with open(self._path, "rb") as f:
                self._lines = [i for i, line in enumerate(f, start=1) if line.strip()]
        return self._lines[row]


def _check_present(path: Path, values: pl.Series, col: str, lines: pl.Series | _LazyLines) -> None:
    """Raise TraceError for the first row whose `col` is missing (null or empty). Pure but for errors."""
    bad = values.is_null()
    if values.dtype == pl.String:
        bad = bad | (values == "")
    if bad.any():
        _raise_bad_rows(path, bad, lines, values, f"missing value for {col}")


def _as_float(path: Path, values: pl.Series, col: str) -> pl.Series:
    """Cast a column to Float64 (strings that are not numbers become null). Pure."""
    if values.dtype.is_numeric() or values.dtype == pl.String:
        return values.cast(pl.Float64, strict=False)
    raise TraceError(f"{path}: {col} must hold numbers, but holds {values.dtype}")


def _tokens(path: Path, values: pl.Series, col: str, lines: pl.Series | _LazyLines) -> np.ndarray:
    """Validate a token-count column (whole numbers >= 0) and return it as int64. Pure but for errors."""
    if values.dtype.is_integer():
        counts = values.cast(pl.Int64).to_numpy()
        bad = pl.Series(counts < 0)
        if bad.any():
            _raise_bad_rows(path, bad, lines, values, f"negative token count in {col}: {{value}}")
        return counts
    as_float = _as_float(path, values, col)
    not_number = as_float.is_null()
    if not_number.any():
        _raise_bad_rows(path, not_number, lines, values.cast(pl.String, strict=False),
                        f"{col} is not a number: {{value!r}}")
    x = as_float.to_numpy()
    with np.errstate(invalid="ignore"):
        non_integer = pl.Series(~np.isfinite(x) | (x != np.floor(x)))
    if non_integer.any():
        _raise_bad_rows(path, non_integer, lines, values.cast(pl.String, strict=False),
                        f"non-integer token count in {col}: {{value}}")
    negative = pl.Series(x < 0)
    if negative.any():
        _raise_bad_rows(path, negative, lines, values.cast(pl.String, strict=False),
                        f"negative token count in {col}: {{value}}")
    return x.astype(np.int64)


def _raise_bad_rows(path: Path, bad: pl.Series, lines: pl.Series | _LazyLines, values: pl.Series,
                    template: str) -> None:
    """Raise TraceError for the first bad row: `path: line N: <template with value>` (+ how many more)."""
    bad_rows = bad.arg_true()
    row = int(bad_rows[0])
    line = int(lines[row])
    value = values[row]
    msg = f"{path}: line {line}: {template.format(value=value)}"
    if len(bad_rows) > 1:
        msg += f" ({len(bad_rows) - 1} more bad line{'s' if len(bad_rows) > 2 else ''} like it)"
    raise TraceError(msg)


def _raise_csv_shape_error(path: Path) -> None:
    """After polars failed on a CSV: raise for the first line with the wrong number of fields. Reads `path`."""
    import csv

    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            return
        for row in reader:
            if row and len(row) != len(header):
                raise TraceError(f"{path}: line {reader.line_num}: {len(row)} fields where the header "
                                 f"has {len(header)}")


def _raise_jsonl_syntax_error(path: Path) -> None:
    """After polars failed on JSON Lines: raise for the first line not a JSON object, or if none. Reads `path`."""
    import json

    num_objects = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_num, line in enumerate(f, start=1):
            if not line.strip():
                continue
            num_objects += 1
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}: line {line_num}: not valid JSON ({exc.msg} at column "
                                 f"{exc.colno})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{path}: line {line_num}: expected one JSON object per line, "
                                 f"found {type(obj).__name__}")
    if num_objects == 0:
        raise TraceError(f"{path}: empty trace (only blank lines)")


def _first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (polars appends hints on later lines). Pure."""
    return next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
