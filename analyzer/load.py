"""Nsight Systems exports → typed columnar data: the loader that every export format shares.

An export is an SQLite file or a Parquet folder; its tables are read through analyzer.export_tables' `Tables`
(analyzer.sqlite_tables, analyzer.parquet_tables), and validated at the boundary, so every bad input becomes
one KvtraceError naming the problem and the fix. Checks go by tables and columns, not version strings: 2023.4
(schema 3.7.x) and 2025.3 (schema 3.20.x) exports both load. Here: the NVTX ranges and their nesting, each
launch call's innermost range, the kernel rows read on several threads at once and laid out by cell as they
come (analyzer.calls) into an entry of the trace cache (analyzer.cache), signatures and names, the trace's info.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from operator import itemgetter
from pathlib import Path

import numpy as np
import polars as pl

from kvtrace.analyzer import calls as calls_
from kvtrace.analyzer import ranges as ranges_
from kvtrace.analyzer import cache as cache_
from kvtrace.analyzer import export_tables, parquet_tables, sqlite_file, sqlite_tables
from kvtrace.analyzer.export_tables import (EXPORT_TABLES, KERNEL_TABLE, RUNTIME_TABLE, SIGNATURE, INT, TEXT,
                                            TYPE_NAMES, check_integers, check_rows, damaged_values)
from kvtrace.errors import KvtraceError
from kvtrace.nsys import is_sqlite

# Kernel durations are summed in int64 nanoseconds (per cell, per segment, across both arms of a diff): a trace
# whose kernels add up to more than a quarter of int64 (73 years) would overflow those sums, so it is refused.
MAX_TOTAL_NS = 1 << 61


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
class RankInfo:
    """One device that ran kernels. A trace's ranks are its devices in deviceId order: rank k of one trace pairs
    with rank k of another (vLLM's tensor-parallel worker k drives the k-th visible device)."""

    device_id: int
    processes: tuple[int, ...]  # the pids whose kernels ran on it
    kernels: int


@dataclass(frozen=True)
class TraceInfo:
    source: str  # what the user passed
    sqlite: str  # the export read, an SQLite file or a Parquet folder (the source, or an .nsys-rep's cached export)
    product_version: str | None
    schema_version: str | None
    driver_version: str | None
    gpus: tuple[GpuInfo, ...]
    kernel_count: int
    first_kernel_ns: int
    last_kernel_ns: int
    graph_trace_mode: str | None  # "Node", "Graph", or None when the export does not say
    capture_trigger: str | None
    ranks: tuple[RankInfo, ...] = ()  # per device that ran kernels, in deviceId order
    graph_launches: bool | None = None  # whether any CUDA graph was launched; None without a runtime table

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
    column = ranges["name"]
    names = column.drop_nulls().unique().sort()  # by UTF-8 bytes: Python's order of str (by code point)
    codes = names.search_sorted(column, side="left").to_numpy().astype(np.int64)
    return tuple(names.to_list()), np.where(column.is_null().to_numpy(), names.len(), codes)


def open_trace(path: str | os.PathLike, *, nsys: str | None = None, cache: bool = True,
               step: Callable[[str], None] | None = None, exported: Path | None = None) -> Trace:
    """Validate and load one export (an .sqlite file or a Parquet folder), or export an .nsys-rep first (only
    the tables kvtrace reads), unless `exported` is that export already. `step` hears which step runs, for the
    progress display.

    The tables are read on one thread per core this process may use. The calls are laid out in a new entry of
    kvtrace's cache (keyed by the export's path, inode, size, modification and change time), and a later load
    of the same unchanged export maps that entry once its checksums hold. Without `cache`, they are laid out in
    a temporary folder that is removed once they are mapped; in memory when no folder can be written.
    """
    source = Path(path)
    notes: dict[Path, str] = {}
    export = exported or _export_of(source, nsys, step, notes.__setitem__)
    if step is not None:
        step(f"reading {source.name}")
    with _reading(source, export) as tables:
        tables.check(source if export == source else Path(f"{source} (exported as {export})"))
        entry = cache_.entry_of(export) if cache else None
        cached = cache_.read(entry, export_tables.workers(), _cached_trace(source, export)) \
            if entry is not None else None
        if cached is not None:
            sys.stderr.write(cache_.notes_text(notes))
            return cached
        ranges, index = read_ranges(tables)
        launch_names = tables.launch_api_ids() if ranges.height and RUNTIME_TABLE in tables.names else None
        spans = {table: tables.spans(table) for table in (KERNEL_TABLE, RUNTIME_TABLE) if table in tables.names}
        launches = read_launches(tables, index, launch_names, spans[RUNTIME_TABLE]) if launch_names else None
        partial = cache_.partial(entry) if entry is not None else None
        try:
            laid, signatures, processes, in_partial = _laid_out(tables, launches, ranges, spans[KERNEL_TABLE],
                                                                partial)
            signatures = _with_names(tables, signatures)
            _check_names(signatures, export)
            info = _trace_info(tables, source, laid, signatures, processes)
            trace = Trace(info=info, calls=laid.calls, signatures=signatures,
                          ranges=ranges.with_columns(pl.Series("calls", laid.launched, dtype=pl.Int64)))
            if in_partial:
                frames = {"cells": trace.calls.cells, "signatures": trace.signatures, "ranges": trace.ranges}
                cache_.seal(entry, partial, frames, asdict(trace.info), export_tables.workers())
                partial = None
        finally:
            if partial is not None:
                shutil.rmtree(partial, ignore_errors=True)
    sys.stderr.write(cache_.notes_text(notes))
    return trace


def _cached_trace(source: Path, export: Path):
    """Builds the Trace of a cache entry (analyzer.cache.read), named by the paths the user passed now: the entry's
    own were written by an earlier run, perhaps from another directory (a relative path would then name nothing)."""
    def build(info: dict, frames: dict[str, pl.DataFrame], calls: calls_.Calls) -> Trace:
        info["gpus"] = tuple(GpuInfo(**gpu) for gpu in info["gpus"])
        info["ranks"] = tuple(RankInfo(rank["device_id"], tuple(rank["processes"]), rank["kernels"])
                              for rank in info["ranks"])
        return Trace(info=TraceInfo(**{**info, "source": str(source), "sqlite": str(export)}), calls=calls, **frames)
    return build


def _is_report(source: Path) -> bool:
    """Whether `source` is an .nsys-rep to export (False: an SQLite or Parquet export); anything else is refused."""
    if parquet_tables.is_parquet_export(source):
        return False
    sqlite_file.check_file(source)
    if is_sqlite(source):
        return False
    if source.suffix in (".nsys-rep", ".qdrep"):
        return True
    raise KvtraceError(f"{source} is not an SQLite file: pass an Nsight Systems export (.sqlite from "
                       "`nsys export --type sqlite`, or its `--type parquetdir` folder) or an .nsys-rep report")


def _export_of(source: Path, nsys: str | None, step: Callable[[str], None] | None,
               note: Callable[[Path, str], None]) -> Path:
    """The export to read for `source`: itself, or the export of an .nsys-rep."""
    return cache_.export_report(source, nsys=nsys, tables=EXPORT_TABLES, step=step, note=note) \
        if _is_report(source) else source


def open_traces(paths: list, *, nsys: str | None = None, cache: bool = True,
                step: Callable[[str], None] | None = None) -> list[Trace]:
    """Load several exports one after the other (each load keeps every core busy on its own), once every input
    is checked and their .nsys-rep reports are exported side by side. The exports' notes (a fallback to SQLite)
    go to standard error once every trace has loaded: where one is bad, its error is the one line."""
    sources = [Path(p) for p in paths]
    reports = [s for s in sources if _is_report(s)]
    notes: dict[Path, str] = {}
    exported = cache_.export_reports(reports, export_tables.workers(), nsys=nsys, tables=EXPORT_TABLES, step=step,
                                     notes=notes)
    traces = [open_trace(s, nsys=nsys, cache=cache, step=step, exported=exported.get(s.resolve())) for s in sources]
    sys.stderr.write(cache_.notes_text(notes))
    return traces


def _laid_out(tables: export_tables.Tables, launches: ranges_.Launches | None, ranges: pl.DataFrame, spans: list,
              partial: Path | None) -> tuple[calls_.Laid, pl.DataFrame, dict[int, set[int]], bool]:
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
                return (*read_kernels(tables, launches, ranges, spans, folder), folder == partial)
        return (*read_kernels(tables, launches, ranges, spans, None), False)
    finally:
        if folder is not None and folder != partial:
            shutil.rmtree(folder, ignore_errors=True)


def tables_of(trace: Trace):
    """The tables of the export a trace was loaded from, open while the block reads them (as `_reading`)."""
    return _reading(Path(trace.info.source), Path(trace.info.sqlite))


@contextmanager
def _reading(source: Path, export: Path):
    """The export's tables, in its format (a Parquet folder, else SQLite), open while the block reads them. A
    page or file that validation did not touch can still be damaged: report it like any other bad input."""
    errors = parquet_tables.damage_errors() + sqlite_tables.damage_errors()
    try:
        tables = parquet_tables.ParquetTables(export) if export.is_dir() else sqlite_tables.SqliteTables(export)
        try:
            yield tables
        finally:
            tables.close()
    except MemoryError:  # Arrow's own (ArrowMemoryError) too: a decompression bomb is not damage
        raise parquet_tables.out_of_memory(source) from None
    except errors as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise KvtraceError(f"{source} is damaged ({detail}): copy or export it again") from None


def read_ranges(tables: export_tables.Tables) -> tuple[pl.DataFrame, ranges_.RangeIndex]:
    """Closed NVTX ranges that ended on their own thread, nested per thread and indexed for launch lookups."""
    schema = {"range": pl.Int32, "name": pl.Utf8, "start": pl.Int64, "end": pl.Int64, "global_tid": pl.Int64}
    rows = tables.nvtx_rows()
    frame = pl.DataFrame({name: pl.Series(name, list(map(itemgetter(place), rows)), dtype=schema[name])
                          for place, name in enumerate(list(schema)[1:])}) \
        .with_columns(pl.int_range(pl.len(), dtype=pl.Int32).alias("range")).select(list(schema))
    nesting, index = ranges_.sweep(*(frame[c].to_numpy() for c in ("global_tid", "start", "end")))
    return frame.with_columns(pl.Series("depth", nesting.depth), pl.Series("parent", nesting.parent)), index


class _Unsorted(Exception):
    """A process's launch calls are not in correlationId order in the runtime table (its threads interleave)."""


def read_launches(tables: export_tables.Tables, index: ranges_.RangeIndex, api_ids: list[int],
                  spans: list) -> ranges_.Launches:
    """Every launch call's innermost NVTX range, as runs; the spans are read side by side. A process's
    runtime rows usually come in correlationId order, and then runs are cut batch by batch and memory stays at
    a few values per range; otherwise the calls are read again, sorted, and cut."""
    processes = ranges_.Processes()

    def runs_of(span) -> tuple[dict, dict]:
        runs: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        last: dict[int, int] = {}
        for key, found in _launch_batches(tables, api_ids, span, index, processes):
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

    with ThreadPoolExecutor(max_workers=export_tables.workers()) as pool:
        try:
            runs: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
            last: dict[int, int] = {}
            for span_runs, span_last in pool.map(runs_of, spans):  # in table order
                for number, pieces in span_runs.items():
                    if pieces[0][0][0] <= last.get(number, -1):
                        raise _Unsorted
                    runs.setdefault(number, []).extend(pieces)
                    last[number] = span_last[number]
        except _Unsorted:
            batches = [batch for span in pool.map(
                lambda span: list(_launch_batches(tables, api_ids, span, index, processes)), spans)
                for batch in span]
            key = np.concatenate([k for k, _ in batches]) if batches else np.zeros(0, dtype=np.int64)
            found = np.concatenate([f for _, f in batches]) if batches else np.zeros(0, dtype=np.int32)
            del batches
            order = np.argsort(key, kind="stable")
            runs = {0: [ranges_.launch_runs(key[order], found[order])]}
    return ranges_.Launches.of_sorted([run for number in sorted(runs) for run in runs[number]], processes)


def _launch_batches(tables: export_tables.Tables, api_ids: list[int], span, index: ranges_.RangeIndex,
                    processes: ranges_.Processes):
    for batch in tables.launch_batches(span, api_ids):
        check_integers(batch, tables.path, RUNTIME_TABLE, export_tables.LAUNCH_VALUES)
        correlation, tid, start = (batch.column(i).to_numpy() for i in range(3))
        if correlation.size:
            yield ranges_.launch_key(processes.of(tid, add=True), correlation), index.innermost(tid, start)


class _SignatureNumbers:
    """Numbers for launch signatures as the kernel-table spans meet them, on several threads at once; the
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


def read_kernels(tables: export_tables.Tables, launches: ranges_.Launches | None, ranges: pl.DataFrame,
                 spans: list, folder: Path | None) -> tuple[calls_.Laid, pl.DataFrame, dict[int, set[int]]]:
    """The kernel calls laid out by cell in `folder` (None: in memory), the distinct signatures they use, and per
    signature the processes (pids) that launched it.
    The spans are read side by side, each batch looked up in the launch calls' runs and handed to the layout, so
    that memory stays at a batch per core (SQLite) or the columns read (Parquet)."""
    names, name_of_range = range_names(ranges)
    layout = calls_.Layout(folder, name_of_range, outside=len(names))
    numbers = _SignatureNumbers()
    path = tables.path
    launched_by: list[tuple[int, np.ndarray]] = []  # (pid, provisional signatures it launched), per batch

    def read(position: int) -> tuple[int, float]:
        """Reads one span into its chunk of the layout; the number of kernels that do not end after they start,
        and their total duration (as a float, which cannot overflow)."""
        low, high = spans[position]  # rows low..high of the table (rowids in SQLite), both included
        chunk = layout.chunk(position, high - low + 1)
        not_after, total = 0, 0.0
        for batch in tables.kernel_batches(spans[position]):
            check_integers(batch, path, KERNEL_TABLE, export_tables.KERNEL_VALUES)
            start = batch.column(0).to_numpy()
            duration = batch.column(1).to_numpy() - start
            not_after += int(np.count_nonzero(duration <= 0))
            total += float(duration.sum(dtype=np.float64))
            packed = pl.from_arrow(batch.select([2, 3, 4])).rename(dict(zip(batch.schema.names[2:5], SIGNATURE)))
            in_range = launches.innermost_of(batch.column(5).to_numpy(), batch.column(6).to_numpy()) \
                if launches is not None else np.full(start.size, ranges_.NO_RANGE, dtype=np.int32)
            sig = numbers.of(packed)
            chunk.add(start, duration, sig, in_range)
            launched_by.extend(_processes(batch.column(6).to_numpy(), sig))
        return not_after, total

    with ThreadPoolExecutor(max_workers=export_tables.workers()) as pool:
        counts, totals = zip(*pool.map(read, range(len(spans)))) if spans else ((), ())
    not_after = sum(counts)
    if sum(totals) >= MAX_TOTAL_NS and not not_after:
        layout.discard()
        raise KvtraceError(f"{path}: its kernels last {sum(totals) / 1e9 / 86400 / 365:,.0f} years in all, past "
                           "what kvtrace can sum exactly (int64 nanoseconds): its timestamps are damaged; export the "
                           "report again")
    if not_after:
        # A kernel takes at least a few hundred nanoseconds; end <= start is a damaged or edited timestamp, and a
        # zero or negative duration would poison every mean and ratio it enters.
        count = sum(chunk.rows for chunk in layout.chunks.values())
        layout.discard()
        raise KvtraceError(f"{path}: {not_after:,} of {count:,} kernel rows do not end after they start "
                           "(end <= start): its timestamps are damaged; export the report again")
    laid = layout.finish(export_tables.workers())
    provisional = numbers.table["sig"].to_numpy()
    signatures = numbers.table.with_columns(pl.Series("sig", laid.sig_order[provisional], dtype=pl.UInt32))
    processes: dict[int, set[int]] = {}
    for pid, sigs in launched_by:
        for sig in laid.sig_order[provisional[sigs]].tolist():
            processes.setdefault(sig, set()).add(pid)
    return laid, _unpack(signatures), processes


def _processes(global_pid: np.ndarray, sig: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(pid, the signatures it launched) of one batch of kernels; one process per batch is the usual case."""
    pid = (global_pid >> 24) & 0xFFFFFF
    if not pid.size:
        return []
    if pid.min() == pid.max():
        return [(int(pid[0]), np.flatnonzero(np.bincount(sig)))]
    return [(p, np.unique(sig[pid == p])) for p in np.unique(pid).tolist()]


def _unpack(signatures: pl.DataFrame) -> pl.DataFrame:
    def field(column: str, shift: int, bits: int) -> pl.Expr:
        return ((pl.col(column) // (1 << shift)) % (1 << bits)).cast(pl.Int32)

    return signatures.select(
        "sig", (pl.col("names") % (1 << 32)).alias("name_id"), (pl.col("names") // (1 << 32)).alias("short_id"),
        field("grid", 0, 31).alias("grid_x"), field("grid", 31, 16).alias("grid_y"),
        field("grid", 47, 16).alias("grid_z"), field("block", 0, 11).alias("block_x"),
        field("block", 11, 11).alias("block_y"), field("block", 22, 10).alias("block_z"),
        field("block", 32, 31).alias("device_id")).sort("sig")


def _trace_info(tables: export_tables.Tables, source: Path, laid: calls_.Laid, signatures: pl.DataFrame,
                processes: dict[int, set[int]]) -> TraceInfo:
    path = tables.path

    def values(table: str) -> dict:
        if table not in tables.names:
            return {}
        rows = tables.name_values(table)
        check_rows(rows, path, table, (TEXT, None), ("name", "value"))
        return {name: value for name, value in rows if name is not None}

    def text(found: dict, name: str | None, table: str) -> str | None:
        value = found.get(name)
        if value is not None and not isinstance(value, str):
            raise damaged_values(path, table, f"{TYPE_NAMES.get(type(value))} (not text)", f"{name}'s value")
        return value

    meta, capture, system = (values(t) for t in ("META_DATA_EXPORT", "META_DATA_CAPTURE", "TARGET_INFO_SYSTEM_ENV"))
    graph_mode = text(capture, next((k for k in capture if k.endswith("CUDA_GRAPH_TRACE_OPTIONS:MODE")), None),
                      "META_DATA_CAPTURE")
    count, first, last = laid.calls.count, int(laid.calls.start[0]), laid.last_end
    return TraceInfo(
        source=str(source), sqlite=str(path),
        product_version=text(meta, "EXPORT_PRODUCT_VERSION", "META_DATA_EXPORT"),
        schema_version=text(meta, "EXPORT_SCHEMA_VERSION", "META_DATA_EXPORT"),
        driver_version=text(system, "NvDriverVersion", "TARGET_INFO_SYSTEM_ENV"),
        gpus=_gpus(tables, signatures), kernel_count=count, first_kernel_ns=first,
        last_kernel_ns=last, graph_trace_mode=graph_mode,
        capture_trigger=text(capture, "START_TRIGGER", "META_DATA_CAPTURE"),
        ranks=_ranks(laid.calls.cells, signatures, processes),
        graph_launches=tables.graph_launched() if RUNTIME_TABLE in tables.names else None)


def _ranks(cells: pl.DataFrame, signatures: pl.DataFrame, processes: dict[int, set[int]]) -> tuple[RankInfo, ...]:
    """The devices that ran kernels, in deviceId order, with their processes and kernel counts."""
    per_sig = cells.group_by("sig").agg(pl.col("calls").sum()).join(
        signatures.select(pl.col("sig").cast(pl.UInt32), "device_id"), on="sig")
    ranks = []
    for device, sigs, calls in per_sig.group_by("device_id").agg("sig", pl.col("calls").sum()).sort(
            "device_id").iter_rows():
        pids = sorted(set().union(*(processes.get(sig, set()) for sig in sigs)))
        ranks.append(RankInfo(int(device), tuple(pids), int(calls)))
    return tuple(ranks)


def _gpus(tables: export_tables.Tables, signatures: pl.DataFrame) -> tuple[GpuInfo, ...]:
    if "TARGET_INFO_GPU" not in tables.names:
        return ()
    # Only GPUs that ran kernels: a multi-GPU host lists all of its devices.
    rows = tables.gpu_rows(_ids(signatures["device_id"]))
    check_rows(rows, tables.path, "TARGET_INFO_GPU", export_tables.GPU_TYPES, export_tables.GPU_COLUMNS)
    return tuple(GpuInfo(device_id=r[0], name=r[1] or f"GPU {r[0]} (unnamed)", sm_count=r[2],
                         compute_capability=None if r[3] is None else f"{r[3]}.{r[4]}", chip=r[5],
                         memory_bytes=r[6], memory_bandwidth=r[7]) for r in rows)


def _ids(*columns: pl.Series) -> list[int]:
    return pl.concat([c.cast(pl.Int64) for c in columns]).unique().to_list()


def _check_names(signatures: pl.DataFrame, path: Path) -> None:
    dangling = signatures.filter(pl.col("demangled").is_null() | pl.col("short").is_null())
    if dangling.height:
        ids = sorted(set(dangling.filter(pl.col("demangled").is_null())["name_id"].to_list())
                     | set(dangling.filter(pl.col("short").is_null())["short_id"].to_list()))
        raise KvtraceError(f"{path}: kernel names refer to string ids that StringIds lacks "
                           f"({', '.join(map(str, ids[:3]))}{', …' if len(ids) > 3 else ''}): the export is damaged; "
                           "export the report again")


def string_frame(tables: export_tables.Tables, ids: list[int], what: str) -> pl.DataFrame:
    """StringIds' id and value of these ids, checked (`what` names the value in a damaged export's error)."""
    rows = tables.strings(ids)
    check_rows(rows, tables.path, "StringIds", (INT, TEXT), ("id", what))
    return pl.DataFrame(rows, schema={"id": pl.Int64, "value": pl.Utf8}, orient="row")


def _with_names(tables: export_tables.Tables, signatures: pl.DataFrame) -> pl.DataFrame:
    """Attach the demangled and short kernel names (StringIds) to the signatures."""
    strings = string_frame(tables, _ids(signatures["name_id"], signatures["short_id"]), "value (a kernel name)")
    return (signatures.join(strings.rename({"id": "name_id", "value": "demangled"}), on="name_id", how="left")
            .join(strings.rename({"id": "short_id", "value": "short"}), on="short_id", how="left").sort("sig"))
