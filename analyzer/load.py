"""Nsight Systems SQLite exports → typed columnar data. The only module that knows nsys table names.

Exports are opened read-only (`mode=ro&immutable=1`, as NVIDIA's own report scripts do) and validated at
the boundary, so every bad input becomes one KvtraceError naming the problem and the fix. Checks go by
tables and columns, not version strings: 2023.4 (schema 3.7.x) and 2025.3 (schema 3.20.x) exports both
load. Kernel rows are read as Arrow through ADBC, never as Python rows, over several connections at once (one
per core, each over a range of rowids), and laid out by cell as they come (analyzer.calls), into an entry of
the trace cache (analyzer.cache).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import sqlite_utils

from kvtrace.analyzer import calls as calls_
from kvtrace.analyzer import ranges as ranges_
from kvtrace.analyzer import cache as cache_
from kvtrace.analyzer import sqlite_file
from kvtrace.errors import KvtraceError
from kvtrace.nsys import is_sqlite

KERNEL_TABLE = "CUPTI_ACTIVITY_KIND_KERNEL"
RUNTIME_TABLE = "CUPTI_ACTIVITY_KIND_RUNTIME"
NVTX_TABLE = "NVTX_EVENTS"
# Every table kvtrace reads: an .nsys-rep is exported with only these (nsys export --tables).
EXPORT_TABLES = (KERNEL_TABLE, RUNTIME_TABLE, NVTX_TABLE, "StringIds", "META_DATA_EXPORT", "META_DATA_CAPTURE",
                 "TARGET_INFO_SYSTEM_ENV", "TARGET_INFO_GPU")
# Columns kvtrace needs from the kernel table; present in every schema since 2023.4 (schema 3.7.2).
KERNEL_COLUMNS = ("start", "end", "deviceId", "correlationId", "globalPid", "demangledName",
                  "shortName", "gridX", "gridY", "gridZ", "blockX", "blockY", "blockZ")
NVTX_RANGE_TYPES = (59, 60, 70, 71)  # push/pop, start/end, and their NVTXT twins
# Rows per Arrow batch and connection, for memory: one batch per core in flight, about 60 bytes per row while it
# is turned into the layout's columns. The batch size barely changes SQLite's cost.
BATCH_BYTES = 64 << 20
# Rows of a table read over one connection: a table is cut into at most 4 such ranges per core, so that cores
# that finish early take more.
CHUNK_ROWS = 1 << 20
# Kernel durations are summed in int64 nanoseconds (per cell, per segment, across both arms of a diff): a trace
# whose kernels add up to more than a quarter of int64 (73 years) would overflow those sums, so it is refused.
MAX_TOTAL_NS = 1 << 61
NSYS_HINT = "profile with `nsys profile -t cuda` (add --cuda-graph-trace=node for vLLM)"


@dataclass(frozen=True)
class GpuInfo:
    device_id: int
    name: str
    sm_count: int | None
    compute_capability: str | None
    chip: str | None
    memory_bytes: int | None
    memory_bandwidth: int | None  # bytes/s as nsys reports it


@dataclass(frozen=True)
class TraceInfo:
    source: str  # what the user passed
    sqlite: str  # the export read (the source, or the cached export of an .nsys-rep)
    product_version: str | None
    schema_version: str | None
    driver_version: str | None
    gpus: tuple[GpuInfo, ...]
    kernel_count: int
    first_kernel_ns: int
    last_kernel_ns: int
    graph_trace_mode: str | None  # "Node", "Graph", or None when the export does not say
    capture_trigger: str | None

    @property
    def kernel_span_ns(self) -> int:
        return self.last_kernel_ns - self.first_kernel_ns

    @property
    def gpu_label(self) -> str:
        names = sorted({g.name for g in self.gpus})
        return ", ".join(names) if names else "unknown GPU"


@dataclass
class Trace:
    info: TraceInfo
    # The kernel calls grouped by cell (signature and innermost range name), in analyzer.calls' compact layout;
    # the cells' `name` codes index `range_names`.
    calls: calls_.Calls
    # Distinct launch signatures: sig, name_id, short_id, demangled, short, grid_x…block_z, device_id.
    signatures: pl.DataFrame
    # Closed NVTX ranges: range, name (domain-prefixed), start, end, global_tid, depth, parent (NO_RANGE at depth 0),
    # calls (the kernels launched with it as their innermost range).
    ranges: pl.DataFrame
    # Derived frames (vLLM steps) that several analyses of one trace share.
    _memo: dict = field(default_factory=dict, repr=False)

    def memo(self, key: str, compute):
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    @property
    def range_names(self) -> tuple[str, ...]:
        return self.memo("range_names", lambda: range_names(self.ranges))[0]

    @property
    def range_name_codes(self) -> np.ndarray:
        """Per range, its name's place in `range_names` (one past the last for a range without a name)."""
        return self.memo("range_names", lambda: range_names(self.ranges))[1]

    @property
    def kernels(self) -> pl.DataFrame:
        """One row per kernel in start order: start, duration, sig and range (NO_RANGE outside every range). The
        whole trace in memory: for tests and small traces."""
        return self.calls.per_kernel()


def range_names(ranges: pl.DataFrame) -> tuple[tuple[str, ...], np.ndarray]:
    """The ranges' distinct names, sorted, and per range its name's code (one past the last for a range without
    a name, which cannot be matched: its calls count as outside every range)."""
    names = tuple(sorted(set(ranges["name"].drop_nulls().to_list())))
    index = {name: code for code, name in enumerate(names)}
    return names, np.array([index.get(n, len(names)) for n in ranges["name"].to_list()], dtype=np.int64)


def open_trace(path: str | os.PathLike, *, nsys: str | None = None, cache: bool = True,
               step: Callable[[str], None] | None = None, exported: Path | None = None) -> Trace:
    """Validate and load one export (.sqlite), or export an .nsys-rep first (only the tables kvtrace reads),
    unless `exported` is that export already. `step` hears which step runs, for the progress display.

    The tables are read over one connection per core this process may use. The calls are laid out in a new
    entry of kvtrace's cache (keyed by the export's path, inode, size, modification and change time), and a
    later load of the same unchanged export maps that entry once its checksums hold. Without `cache`, they
    are laid out in a temporary folder that is removed once they are mapped; in memory when no folder can be
    written.
    """
    source = Path(path)
    sqlite_path = exported or _export_of(source, nsys, step)
    if step is not None:
        step(f"reading {source.name}")
    sqlite_file.check_size(sqlite_path)
    sqlite_file.check_settled(sqlite_path)
    with _reading(source):
        with closing(sqlite_file.connect(sqlite_path)) as conn:
            _check_export(conn, source if sqlite_path == source else Path(f"{source} (exported as {sqlite_path})"))
            entry = cache_.entry_of(sqlite_path) if cache else None
            if entry is not None and (cached := cache_.read(entry, _workers(), _cached_trace(source))) is not None:
                return cached
            tables = set(sqlite_utils.Database(conn).table_names())
            ranges, index = read_ranges(conn, tables, sqlite_path)
            launch_names = _launch_api_ids(conn) if ranges.height and RUNTIME_TABLE in tables else None
            spans = {table: _rowid_spans(conn, table) for table in (KERNEL_TABLE, RUNTIME_TABLE) if table in tables}
        launches = read_launches(sqlite_path, index, launch_names, spans[RUNTIME_TABLE]) if launch_names else None
        partial = cache_.partial(entry) if entry is not None else None
        try:
            laid, signatures, in_partial = _laid_out(sqlite_path, launches, ranges, spans[KERNEL_TABLE], partial)
            with closing(sqlite_file.connect(sqlite_path)) as conn:
                signatures = _with_names(conn, signatures, sqlite_path)
                _check_names(signatures, sqlite_path)
                info = _trace_info(conn, tables, source, sqlite_path, laid, signatures)
            trace = Trace(info=info, calls=laid.calls, signatures=signatures,
                          ranges=ranges.with_columns(pl.Series("calls", laid.launched, dtype=pl.Int64)))
            if in_partial:
                frames = {"cells": trace.calls.cells, "signatures": trace.signatures, "ranges": trace.ranges}
                cache_.seal(entry, partial, frames, asdict(trace.info), _workers())
                partial = None
        finally:
            if partial is not None:
                shutil.rmtree(partial, ignore_errors=True)
    return trace


def _cached_trace(source: Path):
    """Builds the Trace of a cache entry (analyzer.cache.read), named by the path the user passed."""
    def build(info: dict, frames: dict[str, pl.DataFrame], calls: calls_.Calls) -> Trace:
        info["gpus"] = tuple(GpuInfo(**gpu) for gpu in info["gpus"])
        return Trace(info=TraceInfo(**{**info, "source": str(source)}), calls=calls, **frames)
    return build


def _is_report(source: Path) -> bool:
    """Whether `source` is an .nsys-rep to export (False: an SQLite export); anything else is refused."""
    sqlite_file.check_file(source)
    if is_sqlite(source):
        return False
    if source.suffix in (".nsys-rep", ".qdrep"):
        return True
    raise KvtraceError(f"{source} is not an SQLite file: pass an Nsight Systems export (.sqlite from "
                       "`nsys export --type sqlite`) or an .nsys-rep report")


def _export_of(source: Path, nsys: str | None, step: Callable[[str], None] | None) -> Path:
    """The SQLite file to read for `source`: itself, or the export of an .nsys-rep."""
    return cache_.export_report(source, nsys=nsys, tables=EXPORT_TABLES, step=step) if _is_report(source) else source


def open_traces(paths: list, *, nsys: str | None = None, cache: bool = True,
                step: Callable[[str], None] | None = None) -> list[Trace]:
    """Load several exports one after the other (each load keeps every core busy on its own), once every input
    is checked and their .nsys-rep reports are exported side by side."""
    sources = [Path(p) for p in paths]
    reports = [s for s in sources if _is_report(s)]
    exported = cache_.export_reports(reports, _workers(), nsys=nsys, tables=EXPORT_TABLES, step=step)
    return [open_trace(s, nsys=nsys, cache=cache, step=step, exported=exported.get(s.resolve()))
            for s in sources]


def _workers() -> int:
    """The cores this process may run on (taskset and cpusets narrow them)."""
    return max(1, len(os.sched_getaffinity(0)))


def _rowid_spans(conn: sqlite3.Connection, table: str) -> list[tuple[int, int]]:
    """A table's rowids cut into ranges of about CHUNK_ROWS, at most 4 per core; rowid bounds are b-tree
    lookups. Each range is read over its own connection."""
    # Separate queries: SQLite answers a lone min() or max() from the b-tree, but scans for both together.
    low, high = (conn.execute(f"SELECT {bound}(rowid) FROM {table}").fetchone()[0] for bound in ("min", "max"))
    if low is None:
        return []
    rows = high - low + 1
    pieces = max(1, min(4 * _workers(), -(-rows // CHUNK_ROWS)))
    edges = [low + rows * i // pieces for i in range(pieces + 1)]
    return [(edges[i], edges[i + 1] - 1) for i in range(pieces)]


def _laid_out(sqlite_path: Path, launches: ranges_.Launches | None, ranges: pl.DataFrame, spans: list[tuple[int, int]],
              partial: Path | None) -> tuple[calls_.Laid, pl.DataFrame, bool]:
    """read_kernels into the cache entry being written (`partial`), else into a temporary folder removed once
    the layout is mapped (its files live on while mapped), else in memory; whether it went into `partial`. A
    disk without room for the layout (OSError) means memory."""
    folder = partial
    if folder is None:
        with suppress(OSError):
            folder = Path(tempfile.mkdtemp(prefix="kvtrace-calls-"))
    try:
        if folder is not None:
            with suppress(OSError):
                return (*read_kernels(sqlite_path, launches, ranges, spans, folder), folder == partial)
        return (*read_kernels(sqlite_path, launches, ranges, spans, None), False)
    finally:
        if folder is not None and folder != partial:
            shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def _reading(source: Path):
    """A page that validation did not touch can still be damaged: report it like any other bad input."""
    import adbc_driver_manager

    try:
        yield
    except (sqlite3.Error, UnicodeDecodeError, adbc_driver_manager.Error) as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise KvtraceError(f"{source} is damaged ({detail}): copy or export it again") from None


def read_ranges(conn: sqlite3.Connection, tables: set[str],
                sqlite_path: Path) -> tuple[pl.DataFrame, ranges_.RangeIndex]:
    """Closed NVTX ranges that ended on their own thread, nested per thread and indexed for launch lookups."""
    schema = {"range": pl.Int32, "name": pl.Utf8, "start": pl.Int64, "end": pl.Int64, "global_tid": pl.Int64}
    rows = []
    if NVTX_TABLE in tables:
        types = ",".join(map(str, NVTX_RANGE_TYPES))
        # A range that ends on another thread (endGlobalTid set) cannot be tied to launches; nsys's own
        # projection reports drop it too (nvtx_gpu_proj_trace.py).
        rows = conn.execute(f"""
            SELECT e.rowid, CASE WHEN d.text IS NULL THEN COALESCE(s.value, e.text)
                        ELSE d.text || ':' || COALESCE(s.value, e.text) END,
                   e.start, e."end", e.globalTid
            FROM {NVTX_TABLE} e
            LEFT JOIN StringIds s ON s.id = e.textId
            LEFT JOIN {NVTX_TABLE} d ON d.eventType = 75 AND d.domainId = e.domainId AND e.domainId != 0
                 AND (d.globalTid & 0x0000FFFFFF000000) = (e.globalTid & 0x0000FFFFFF000000)
            WHERE e.eventType IN ({types}) AND e."end" IS NOT NULL AND e.endGlobalTid IS NULL
            ORDER BY e.rowid""").fetchall()
        _check_rows(rows, sqlite_path, NVTX_TABLE, (_ANY, _TEXT, _INT, _INT, _INT),
                    ("rowid", "text or its StringIds value", "start", "end", "globalTid"))
    frame = pl.DataFrame([r[1:] for r in rows], schema=list(schema)[1:], orient="row") \
        .with_columns(pl.int_range(pl.len(), dtype=pl.Int32).alias("range")).select(list(schema)) \
        .cast(schema)
    nesting, index = ranges_.sweep(*(frame[c].to_numpy() for c in ("global_tid", "start", "end")))
    return frame.with_columns(pl.Series("depth", nesting.depth), pl.Series("parent", nesting.parent)), index


def _launch_api_ids(conn: sqlite3.Connection) -> list[int]:
    """StringIds of the runtime and driver calls that can launch kernels (cudaLaunchKernel*, cuLaunchKernel*,
    cudaGraphLaunch*, cudaLaunchCooperativeKernel*, …): reading only those rows halves the runtime scan."""
    return [r[0] for r in conn.execute("SELECT id FROM StringIds WHERE value GLOB '*Launch*'")]


class _Unsorted(Exception):
    """A process's launch calls are not in correlationId order in the runtime table (its threads interleave)."""


def read_launches(sqlite_path: Path, index: ranges_.RangeIndex, api_ids: list[int],
                  spans: list[tuple[int, int]]) -> ranges_.Launches:
    """Every launch call's innermost NVTX range, as runs; the rowid spans are read side by side. A process's
    runtime rows usually come in correlationId order, and then runs are cut batch by batch and memory stays at
    a few values per range; otherwise the calls are read again, sorted, and cut."""
    query = _launch_query(api_ids)
    processes = ranges_.Processes()

    def runs_of(span: tuple[int, int]) -> tuple[dict, dict]:
        runs: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        last: dict[int, int] = {}
        for key, found in _launch_batches(sqlite_path, query, span, index, processes):
            numbers = key >> 32
            if numbers.min() == numbers.max():  # one process per batch, the usual case
                parts = [(int(numbers[0]), key, found)]
            else:  # several processes (tensor-parallel workers) interleave; each keeps its order
                parts = [(n, key[numbers == n], found[numbers == n]) for n in np.unique(numbers).tolist()]
            for number, own_key, own_found in parts:
                if own_key[0] <= last.get(number, -1) or not np.all(own_key[1:] > own_key[:-1]):
                    raise _Unsorted
                runs.setdefault(number, []).append(ranges_.launch_runs(own_key, own_found))
                last[number] = int(own_key[-1])
        return runs, last

    with ThreadPoolExecutor(max_workers=_workers()) as pool:
        try:
            runs: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
            last: dict[int, int] = {}
            for span_runs, span_last in pool.map(runs_of, spans):  # in rowid order
                for number, pieces in span_runs.items():
                    if pieces[0][0][0] <= last.get(number, -1):
                        raise _Unsorted
                    runs.setdefault(number, []).extend(pieces)
                    last[number] = span_last[number]
        except _Unsorted:
            batches = [batch for span in pool.map(
                lambda span: list(_launch_batches(sqlite_path, query, span, index, processes)), spans)
                for batch in span]
            key = np.concatenate([k for k, _ in batches]) if batches else np.zeros(0, dtype=np.int64)
            found = np.concatenate([f for _, f in batches]) if batches else np.zeros(0, dtype=np.int32)
            del batches
            order = np.argsort(key, kind="stable")
            runs = {0: [ranges_.launch_runs(key[order], found[order])]}
    return ranges_.Launches.of_sorted([run for number in sorted(runs) for run in runs[number]], processes)


def _launch_batches(sqlite_path: Path, query: str, span: tuple[int, int], index: ranges_.RangeIndex,
                    processes: ranges_.Processes):
    for batch in _read_batches(sqlite_path, _within(query, span)):
        _check_integers(batch, sqlite_path, RUNTIME_TABLE, _LAUNCH_VALUES)
        correlation, tid, start = (batch.column(i).to_numpy() for i in range(3))
        if correlation.size:
            yield ranges_.launch_key(processes.of(tid, add=True), correlation), index.innermost(tid, start)


# The signature travels packed, three integers per kernel instead of eight columns, within CUDA's launch
# limits (grid 2^31-1 × 65535 × 65535, block 1024 × 1024 × 64) and 32-bit StringIds, so no sum overflows.
def _packed(*fields: tuple[str, int]) -> str:
    """Columns packed into one integer, (column, bits) from the lowest bits up. Each field is NULL unless it is a
    number inside its bits: SQLite's `+` reads text as 0 and a value past its bits would spill into the next
    field, so either would pass as another kernel; _check_integers refuses the NULL (and a real's type)."""
    terms, shift = [], 0
    for column, bits in fields:
        # Text and BLOBs sort above every number in SQLite, so BETWEEN alone turns them into NULL.
        terms.append(f"CASE WHEN {column} BETWEEN 0 AND {(1 << bits) - 1} THEN {column} END"
                     + (f" * {1 << shift}" if shift else ""))
        shift += bits
    return " + ".join(terms)


_NAMES = _packed(("demangledName", 32), ("shortName", 31))
_GRID = _packed(("gridX", 31), ("gridY", 16), ("gridZ", 16))
_BLOCK = _packed(("blockX", 11), ("blockY", 11), ("blockZ", 10), ("deviceId", 31))
SIGNATURE = ["names", "grid", "block"]
# What each column read from the kernel table is made of, for messages about its values.
_PACKED_TOO = " (or text, or values past a string id's or CUDA's launch limits)"
_KERNEL_VALUES = ("start", "end", "demangledName or shortName" + _PACKED_TOO, "gridX, gridY or gridZ" + _PACKED_TOO,
                  "blockX, blockY, blockZ or deviceId" + _PACKED_TOO, "correlationId", "globalPid")
_LAUNCH_VALUES = ("correlationId", "globalTid", "start")


class _SignatureNumbers:
    """Numbers for launch signatures as the kernel-table ranges meet them, on several threads at once; the
    layout numbers them again by first appearance in the table."""

    def __init__(self):
        self.table = pl.DataFrame(schema={"names": pl.Int64, "grid": pl.Int64, "block": pl.Int64, "sig": pl.UInt32})
        self.lock = threading.Lock()

    def of(self, packed: pl.DataFrame) -> np.ndarray:
        found = packed.join(self.table, on=SIGNATURE, how="left", maintain_order="left")["sig"]
        if found.null_count():
            with self.lock:
                new = packed.filter(found.is_null()).unique(maintain_order=True).join(self.table, on=SIGNATURE,
                                                                                       how="anti")
                self.table = pl.concat([self.table, new.with_columns(
                    pl.int_range(self.table.height, self.table.height + new.height, dtype=pl.UInt32).alias("sig"))])
            found = packed.join(self.table, on=SIGNATURE, how="left", maintain_order="left")["sig"]
        return found.to_numpy()


def read_kernels(sqlite_path: Path, launches: ranges_.Launches | None, ranges: pl.DataFrame,
                 spans: list[tuple[int, int]], folder: Path | None) -> tuple[calls_.Laid, pl.DataFrame]:
    """The kernel calls laid out by cell in `folder` (None: in memory), and the distinct signatures they use.
    The rowid spans are read side by side, each batch looked up in the launch calls' runs and handed to the
    layout, so that memory stays at a batch per core."""
    names, name_of_range = range_names(ranges)
    layout = calls_.Layout(folder, name_of_range, outside=len(names))
    numbers = _SignatureNumbers()
    query = _kernel_query(launch_keys=launches is not None)

    def read(position: int) -> tuple[int, float]:
        """Reads one span into its chunk of the layout; the number of kernels that do not end after they start,
        and their total duration (as a float, which cannot overflow)."""
        low, high = spans[position]
        chunk = layout.chunk(position, high - low + 1)
        not_after, total = 0, 0.0
        for batch in _read_batches(sqlite_path, _within(query, spans[position])):
            _check_integers(batch, sqlite_path, KERNEL_TABLE, _KERNEL_VALUES)
            start = batch.column(0).to_numpy()
            duration = batch.column(1).to_numpy() - start
            not_after += int(np.count_nonzero(duration <= 0))
            total += float(duration.sum(dtype=np.float64))
            packed = pl.from_arrow(batch.select([2, 3, 4])).rename(dict(zip(batch.schema.names[2:5], SIGNATURE)))
            in_range = launches.innermost_of(batch.column(5).to_numpy(), batch.column(6).to_numpy()) \
                if launches is not None else np.full(start.size, ranges_.NO_RANGE, dtype=np.int32)
            chunk.add(start, duration, numbers.of(packed), in_range)
        return not_after, total

    with ThreadPoolExecutor(max_workers=_workers()) as pool:
        counts, totals = zip(*pool.map(read, range(len(spans)))) if spans else ((), ())
    not_after = sum(counts)
    if sum(totals) >= MAX_TOTAL_NS and not not_after:
        layout.discard()
        raise KvtraceError(f"{sqlite_path}: its kernels last {sum(totals) / 1e9 / 86400 / 365:,.0f} years in all, past "
                           "what kvtrace can sum exactly (int64 nanoseconds): its timestamps are damaged; export the "
                           "report again")
    if not_after:
        # A kernel takes at least a few hundred nanoseconds; end <= start is a damaged or edited timestamp, and a
        # zero or negative duration would poison every mean and ratio it enters.
        count = sum(chunk.rows for chunk in layout.chunks.values())
        layout.discard()
        raise KvtraceError(f"{sqlite_path}: {not_after:,} of {count:,} kernel rows do not end after they start "
                           "(end <= start): its timestamps are damaged; export the report again")
    laid = layout.finish(_workers())
    provisional = numbers.table["sig"].to_numpy()
    signatures = numbers.table.with_columns(pl.Series("sig", laid.sig_order[provisional], dtype=pl.UInt32))
    return laid, _unpack(signatures)


def _check_integers(batch, sqlite_path: Path, table: str, values: tuple[str, ...]) -> None:
    """Every value read is an integer: nsys writes them NOT NULL, so a NULL or text is a damaged or edited export."""
    import pyarrow as pa

    for column, what in zip(batch.columns, values):
        if column.null_count or not pa.types.is_integer(column.type):
            problem = "NULL" if column.null_count else f"{column.type} (not integer)"
            raise _damaged_values(sqlite_path, table, problem, what)


# What a value read row by row may be: the Python types sqlite3 returns for it (None where nsys may leave it out).
_INT, _TEXT, _ANY = (int,), (str, type(None)), None
_OPTIONAL_INT = (int, type(None))
_TYPE_NAMES = {type(None): "NULL", str: "text", bytes: "BLOB", float: "real", int: "integer"}


def _check_rows(rows, sqlite_path: Path, table: str, types: tuple, what: tuple[str, ...]) -> None:
    """Every value of rows read as Python values has a type nsys writes there: text or NULL for names, integers
    for numbers. SQLite stores any value in any column, so a BLOB name or text in a count is an edited export."""
    for row in rows:
        for value, allowed, column in zip(row, types, what):
            if allowed is not None and type(value) not in allowed:
                found = _TYPE_NAMES.get(type(value), type(value).__name__)
                problem = "NULL" if value is None else f"{found} (not {'text' if str in allowed else 'integer'})"
                raise _damaged_values(sqlite_path, table, problem, column)


def _damaged_values(sqlite_path: Path, table: str, problem: str, what: str) -> KvtraceError:
    return KvtraceError(f"{sqlite_path}: {table} has {problem} values in {what}: the export is damaged or was "
                        "edited; export the report again")


def _unpack(signatures: pl.DataFrame) -> pl.DataFrame:
    def field(column: str, shift: int, bits: int) -> pl.Expr:
        return ((pl.col(column) // (1 << shift)) % (1 << bits)).cast(pl.Int32)

    return signatures.select(
        "sig", (pl.col("names") % (1 << 32)).alias("name_id"), (pl.col("names") // (1 << 32)).alias("short_id"),
        field("grid", 0, 31).alias("grid_x"), field("grid", 31, 16).alias("grid_y"),
        field("grid", 47, 16).alias("grid_z"), field("block", 0, 11).alias("block_x"),
        field("block", 11, 11).alias("block_y"), field("block", 22, 10).alias("block_z"),
        field("block", 32, 31).alias("device_id")).sort("sig")


def _launch_query(api_ids: list[int]) -> str:
    return (f"SELECT correlationId, globalTid, start FROM {RUNTIME_TABLE} "
            f"WHERE nameId IN ({','.join(map(str, api_ids))})")


def _kernel_query(*, launch_keys: bool) -> str:
    """The kernel table's columns kvtrace reads; `launch_keys` adds what ties a kernel to its launch call."""
    columns = f"start, \"end\", {_NAMES}, {_GRID}, {_BLOCK}" + (", correlationId, globalPid" if launch_keys else "")
    return f"SELECT {columns} FROM {KERNEL_TABLE}"


def _within(query: str, span: tuple[int, int]) -> str:
    """A query of one table narrowed to a range of its rowids (a b-tree range, not a scan)."""
    return f"{query} {'AND' if ' WHERE ' in query else 'WHERE'} rowid BETWEEN {span[0]} AND {span[1]}"


def _read_batches(path: Path, query: str):
    """Stream a query's rows as Arrow record batches through ADBC, read-only: memory stays at one batch."""
    import adbc_driver_sqlite.dbapi as adbc

    with adbc.connect(sqlite_file.read_only_uri(path)) as conn:
        with conn.cursor() as cursor:
            rows = min(1 << 18, max(1 << 14, BATCH_BYTES // 60 // _workers()))
            cursor.adbc_statement.set_options(**{"adbc.sqlite.query.batch_rows": str(rows)})
            cursor.execute(query)
            yield from cursor.fetch_record_batch()


# ---- validation ---------------------------------------------------------------------------------------

def _check_export(conn: sqlite3.Connection, path: Path) -> None:
    db = sqlite_utils.Database(conn)
    try:
        tables = set(db.table_names())
        if "StringIds" not in tables:
            raise KvtraceError(f"{path} is an SQLite database but not an Nsight Systems export (no StringIds "
                               "table): pass the output of `nsys export --type sqlite`")
        if "META_DATA_EXPORT" not in tables:
            # nsys writes StringIds first and the metadata last: an export that died in between, such as
            # Nsight Systems 2023.4 failing on a 2025.x report with ProtobufParseException.
            raise KvtraceError(f"{path} is a partial Nsight Systems export (no META_DATA_EXPORT): the export "
                               "did not finish; export the report again with the nsys that recorded it or newer")
        if KERNEL_TABLE not in tables:
            raise KvtraceError(f"{path} has no CUDA kernel records: {NSYS_HINT}")
        missing = [c for c in KERNEL_COLUMNS if c not in db[KERNEL_TABLE].columns_dict]
        if missing:
            raise KvtraceError(f"{path}: kernel table lacks {', '.join(missing)}: re-export with a newer nsys")
        if conn.execute(f"SELECT 1 FROM {KERNEL_TABLE} LIMIT 1").fetchone() is None:
            raise KvtraceError(f"{path} has no CUDA kernel records: {NSYS_HINT}")
    except sqlite3.DatabaseError as error:
        raise KvtraceError(f"{path} is damaged ({error}): copy or export it again") from None


def _trace_info(conn: sqlite3.Connection, tables: set[str], source: Path, sqlite_path: Path, laid: calls_.Laid,
                signatures: pl.DataFrame) -> TraceInfo:
    def values(table: str) -> dict:
        if table not in tables:
            return {}
        rows = conn.execute(f"SELECT name, value FROM {table}").fetchall()
        _check_rows(rows, sqlite_path, table, (_TEXT, _ANY), ("name", "value"))
        return {name: value for name, value in rows if name is not None}

    def text(found: dict, name: str | None, table: str) -> str | None:
        value = found.get(name)
        if value is not None and not isinstance(value, str):
            raise _damaged_values(sqlite_path, table, f"{_TYPE_NAMES.get(type(value))} (not text)", f"{name}'s value")
        return value

    meta, capture, system = (values(t) for t in ("META_DATA_EXPORT", "META_DATA_CAPTURE", "TARGET_INFO_SYSTEM_ENV"))
    graph_mode = text(capture, next((k for k in capture if k.endswith("CUDA_GRAPH_TRACE_OPTIONS:MODE")), None),
                      "META_DATA_CAPTURE")
    count, first, last = laid.calls.count, int(laid.calls.start[0]), laid.last_end
    return TraceInfo(
        source=str(source), sqlite=str(sqlite_path),
        product_version=text(meta, "EXPORT_PRODUCT_VERSION", "META_DATA_EXPORT"),
        schema_version=text(meta, "EXPORT_SCHEMA_VERSION", "META_DATA_EXPORT"),
        driver_version=text(system, "NvDriverVersion", "TARGET_INFO_SYSTEM_ENV"),
        gpus=_gpus(conn, tables, signatures, sqlite_path), kernel_count=count, first_kernel_ns=first,
        last_kernel_ns=last, graph_trace_mode=graph_mode,
        capture_trigger=text(capture, "START_TRIGGER", "META_DATA_CAPTURE"))


def _gpus(conn: sqlite3.Connection, tables: set[str], signatures: pl.DataFrame,
          sqlite_path: Path) -> tuple[GpuInfo, ...]:
    if "TARGET_INFO_GPU" not in tables:
        return ()
    columns = sqlite_utils.Database(conn)["TARGET_INFO_GPU"].columns_dict
    wanted = ["id", "name", "smCount", "computeMajor", "computeMinor", "chipName", "totalMemory", "memoryBandwidth"]
    select = ", ".join(c if c in columns else f"NULL AS {c}" for c in wanted)
    # Only GPUs that ran kernels: a multi-GPU host lists all of its devices.
    rows = conn.execute(f"SELECT {select} FROM TARGET_INFO_GPU WHERE id IN (SELECT value FROM json_each(?)) "
                        "ORDER BY id", (_json_ids(signatures["device_id"]),)).fetchall()
    _check_rows(rows, sqlite_path, "TARGET_INFO_GPU", (_INT, _TEXT, _OPTIONAL_INT, _OPTIONAL_INT, _OPTIONAL_INT,
                                                       _TEXT, _OPTIONAL_INT, _OPTIONAL_INT), wanted)
    return tuple(GpuInfo(device_id=r[0], name=r[1] or f"GPU {r[0]} (unnamed)", sm_count=r[2],
                         compute_capability=None if r[3] is None else f"{r[3]}.{r[4]}", chip=r[5],
                         memory_bytes=r[6], memory_bandwidth=r[7]) for r in rows)


def _json_ids(*columns: pl.Series) -> str:
    return json.dumps(pl.concat([c.cast(pl.Int64) for c in columns]).unique().to_list())


def _check_names(signatures: pl.DataFrame, sqlite_path: Path) -> None:
    dangling = signatures.filter(pl.col("demangled").is_null() | pl.col("short").is_null())
    if dangling.height:
        ids = sorted(set(dangling.filter(pl.col("demangled").is_null())["name_id"].to_list())
                     | set(dangling.filter(pl.col("short").is_null())["short_id"].to_list()))
        raise KvtraceError(f"{sqlite_path}: kernel names refer to string ids that StringIds lacks "
                           f"({', '.join(map(str, ids[:3]))}{', …' if len(ids) > 3 else ''}): the export is damaged; "
                           "export the report again")


def _with_names(conn: sqlite3.Connection, signatures: pl.DataFrame, sqlite_path: Path) -> pl.DataFrame:
    """Attach the demangled and short kernel names (StringIds) to the signatures."""
    rows = conn.execute("SELECT id, value FROM StringIds WHERE id IN (SELECT value FROM json_each(?))",
                        (_json_ids(signatures["name_id"], signatures["short_id"]),))
    rows = rows.fetchall()
    _check_rows(rows, sqlite_path, "StringIds", (_INT, _TEXT), ("id", "value (a kernel name)"))
    strings = pl.DataFrame(rows, schema={"id": pl.Int64, "value": pl.Utf8}, orient="row")
    return (signatures.join(strings.rename({"id": "name_id", "value": "demangled"}), on="name_id", how="left")
            .join(strings.rename({"id": "short_id", "value": "short"}), on="short_id", how="left").sort("sig"))


# ---- stages of a load, for bench/stages.py, which times each alone -------------------------------------

def stage_queries(sqlite_path: Path) -> dict[str, str]:
    """The two table reads open_trace makes, as SQL: "kernels" (with the launch keys) and "launches"."""
    with closing(sqlite_file.connect(sqlite_path)) as conn:
        api_ids = _launch_api_ids(conn)
    return {"kernels": _kernel_query(launch_keys=True), "launches": _launch_query(api_ids)}


def drain(sqlite_path: Path, query: str) -> int:
    """Read a query's rows as open_trace reads them (Arrow batches through ADBC) and throw them away."""
    return sum(batch.num_rows for batch in _read_batches(sqlite_path, query))
