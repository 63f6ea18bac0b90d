"""Nsight Systems SQLite exports → typed columnar data. The only module that knows nsys table names.

Exports are opened read-only (`mode=ro&immutable=1`, as NVIDIA's own report scripts do) and validated at
the boundary, so every bad input becomes one KvtraceError naming the problem and the fix. Checks go by
tables and columns, not version strings: 2023.4 (schema 3.7.x) and 2025.3 (schema 3.20.x) exports both
load. Kernel rows are read as Arrow through ADBC, never as Python rows.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import struct
import subprocess
import tempfile
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import polars as pl
import sqlite_utils

from kvtrace.capture import runner  # nsys discovery, shared with capture (standard library only)
from kvtrace.errors import KvtraceError

SQLITE_MAGIC = b"SQLite format 3\x00"
KERNEL_TABLE = "CUPTI_ACTIVITY_KIND_KERNEL"
RUNTIME_TABLE = "CUPTI_ACTIVITY_KIND_RUNTIME"
NVTX_TABLE = "NVTX_EVENTS"
# Columns kvtrace needs from the kernel table; present in every schema since 2023.4 (schema 3.7.2).
KERNEL_COLUMNS = ("start", "end", "deviceId", "streamId", "correlationId", "globalPid", "demangledName",
                  "shortName", "gridX", "gridY", "gridZ", "blockX", "blockY", "blockZ")
NVTX_RANGE_TYPES = (59, 60, 70, 71)  # push/pop, start/end, and their NVTXT twins
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
    kernels: pl.DataFrame  # one row per kernel launch, see read_kernels()
    names: pl.DataFrame  # StringIds restricted to kernel names: id, value
    _path: Path = field(repr=False)
    # Derived frames (NVTX projection, vLLM steps) that several analyses of one trace share.
    _memo: dict = field(default_factory=dict, repr=False)

    def memo(self, key: str, compute):
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def runtime(self, *, api: bool = True) -> pl.DataFrame:
        """CUDA runtime/driver calls that launched kernels: start, end, global_tid, correlation_id, api
        (api=False leaves out the per-call name string, which the NVTX projection does not need)."""
        schema = {"start": pl.Int64, "end": pl.Int64, "global_tid": pl.Int64, "correlation_id": pl.Int64}
        if api:
            schema["api"] = pl.Utf8
        with _reading(Path(self.info.source)), closing(_connect(self._path)) as conn:
            if not _has_table(conn, RUNTIME_TABLE):
                return pl.DataFrame(schema=schema)
            return _read_arrow(self._path, f"""
            SELECT r.start, r."end", r.globalTid AS global_tid, r.correlationId AS correlation_id
                   {", s.value AS api" if api else ""}
            FROM {RUNTIME_TABLE} r {"LEFT JOIN StringIds s ON s.id = r.nameId" if api else ""}
            WHERE r.correlationId IN (SELECT correlationId FROM {KERNEL_TABLE})""")

    def nvtx_ranges(self) -> pl.DataFrame:
        """Closed NVTX ranges that ended on their own thread: start, end, global_tid, name (domain-prefixed)."""
        with _reading(Path(self.info.source)), closing(_connect(self._path)) as conn:
            if not _has_table(conn, NVTX_TABLE):
                return pl.DataFrame(schema={"start": pl.Int64, "end": pl.Int64, "global_tid": pl.Int64,
                                            "name": pl.Utf8})
            types = ",".join(map(str, NVTX_RANGE_TYPES))
            # A range that ends on another thread (endGlobalTid set) cannot be tied to launches; nsys's own
            # projection reports drop it too (nvtx_gpu_proj_trace.py).
            return _read_arrow(self._path, f"""
            SELECT e.start, e."end", e.globalTid AS global_tid,
                   CASE WHEN d.text IS NULL THEN COALESCE(s.value, e.text)
                        ELSE d.text || ':' || COALESCE(s.value, e.text) END AS name
            FROM {NVTX_TABLE} e
            LEFT JOIN StringIds s ON s.id = e.textId
            LEFT JOIN {NVTX_TABLE} d ON d.eventType = 75 AND d.domainId = e.domainId AND e.domainId != 0
                 AND (d.globalTid & 0x0000FFFFFF000000) = (e.globalTid & 0x0000FFFFFF000000)
            WHERE e.eventType IN ({types}) AND e."end" IS NOT NULL AND e.endGlobalTid IS NULL""")


def open_trace(path: str | os.PathLike, *, nsys: str | None = None) -> Trace:
    """Validate and load one export (.sqlite), or export an .nsys-rep first."""
    source = Path(path)
    _check_file(source)
    sqlite_path = source
    if not _is_sqlite(source):
        if source.suffix in (".nsys-rep", ".qdrep"):
            sqlite_path = export_report(source, nsys=nsys)
        else:
            raise KvtraceError(f"{source} is not an SQLite file: pass an Nsight Systems export (.sqlite from "
                               "`nsys export --type sqlite`) or an .nsys-rep report")
    _check_sqlite_size(sqlite_path)
    with _reading(source):
        with closing(_connect(sqlite_path)) as conn:
            _check_export(conn, source if sqlite_path == source else Path(f"{source} (exported as {sqlite_path})"))
        # The kernel table is scanned once; counts, span, devices and names come from the columns read.
        kernels = read_kernels(sqlite_path)
        with closing(_connect(sqlite_path)) as conn:
            info = _trace_info(conn, source, sqlite_path, kernels)
            names = _kernel_names(conn, kernels)
    return Trace(info=info, kernels=kernels, names=names, _path=sqlite_path)


@contextmanager
def _reading(source: Path):
    """A page that validation did not touch can still be damaged: report it like any other bad input."""
    import adbc_driver_manager

    try:
        yield
    except (sqlite3.Error, UnicodeDecodeError, adbc_driver_manager.Error) as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise KvtraceError(f"{source} is damaged ({detail}): copy or export it again") from None


def read_kernels(sqlite_path: Path) -> pl.DataFrame:
    """Per-launch kernel rows with durations, as compact integer columns."""
    frame = _read_arrow(sqlite_path, f"""
        SELECT start, "end" - start AS duration, deviceId AS device_id, streamId AS stream_id,
               correlationId AS correlation_id, globalPid AS global_pid, demangledName AS name_id,
               shortName AS short_id, gridX AS grid_x, gridY AS grid_y, gridZ AS grid_z,
               blockX AS block_x, blockY AS block_y, blockZ AS block_z
        FROM {KERNEL_TABLE}""")
    # Sorted here rather than by SQLite's single-threaded sorter; ties keep table order.
    return frame.with_columns(pl.col(c).cast(pl.Int32) for c in
                              ("device_id", "stream_id", "grid_x", "grid_y", "grid_z", "block_x", "block_y",
                               "block_z")).sort("start", maintain_order=True)


# ---- .nsys-rep export ---------------------------------------------------------------------------------

def export_report(report: Path, *, nsys: str | None = None) -> Path:
    """Export an .nsys-rep to SQLite in kvtrace's cache (never beside the user's file).

    A sibling `<report>.sqlite` newer than the report is used as is, as `nsys recipe` does.
    """
    sibling = report.with_suffix(".sqlite")
    if sibling.exists() and sibling.stat().st_mtime >= report.stat().st_mtime and _is_sqlite(sibling):
        return sibling
    nsys_path = _find_nsys(nsys)
    stat = report.stat()
    key = hashlib.sha256(f"{report.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{nsys_path}".encode()).hexdigest()[:20]
    cache = _cache_dir()
    target = cache / f"{report.stem}-{key}.sqlite"
    if target.exists():
        return target
    # nsys writes into a temporary name; only a complete export is renamed into the cache.
    fd, partial_name = tempfile.mkstemp(dir=cache, prefix=f".{report.stem}-", suffix=".sqlite")
    os.close(fd)
    partial = Path(partial_name)
    command = [nsys_path, "export", "--type=sqlite", "--force-overwrite=true", f"--output={partial}", str(report)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        output = (result.stdout + result.stderr)
        if result.returncode != 0 or not _is_sqlite(partial):
            if "ProtobufParseException" in output:
                version = runner.nsys_version(nsys_path).replace("NVIDIA ", "")
                raise KvtraceError(f"{version} cannot read {report}: it was recorded by a newer "
                                   "Nsight Systems; export it there (nsys export --type sqlite) or point "
                                   "NSYS at that version")
            last_line = next((l for l in reversed(output.strip().splitlines()) if l.strip()), "no output")
            raise KvtraceError(f"nsys export failed on {report} (exit {result.returncode}: {last_line.strip()}); "
                               "check the report opens in Nsight Systems, or export it yourself")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _find_nsys(explicit: str | None) -> str:
    try:
        return runner.find_nsys(explicit)
    except KvtraceError as error:
        raise KvtraceError(f"an .nsys-rep needs nsys to export it: {error}; or pass the .sqlite from "
                           "`nsys export --type sqlite`") from None


def _cache_dir() -> Path:
    base = Path(os.environ.get("KVTRACE_CACHE_DIR") or
                Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvtrace")
    try:
        (base / "exports").mkdir(parents=True, exist_ok=True)
        return base / "exports"
    except OSError:
        fallback = Path(tempfile.gettempdir()) / "kvtrace-exports"
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


# ---- validation ---------------------------------------------------------------------------------------

def _check_file(path: Path) -> None:
    if not path.exists():
        raise KvtraceError(f"{path}: no such file: check the path")
    if path.is_dir():
        found = sorted(p.name for p in path.iterdir() if p.suffix in (".sqlite", ".nsys-rep"))
        hint = f" (it holds {', '.join(found[:4])})" if found else ""
        raise KvtraceError(f"{path} is a directory{hint}: pass one .sqlite or .nsys-rep file")
    try:
        with open(path, "rb") as handle:
            handle.read(1)
    except OSError as error:
        raise KvtraceError(f"cannot read {path}: {error.strerror.lower()}; check its permissions") from None
    if path.stat().st_size == 0:
        raise KvtraceError(f"{path} is empty (0 bytes): re-run `nsys export --type sqlite` on the report")


def _is_sqlite(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC


def _check_sqlite_size(path: Path) -> None:
    """Compare the file with the size its header promises, which catches truncated copies."""
    with open(path, "rb") as handle:
        header = handle.read(100)
    if len(header) < 100:
        raise KvtraceError(f"{path} is truncated (only {len(header)} bytes): copy or export it again")
    page_size = struct.unpack(">H", header[16:18])[0]
    page_size = 65536 if page_size == 1 else page_size
    change_counter, page_count = struct.unpack(">II", header[24:32])
    version_valid_for = struct.unpack(">I", header[92:96])[0]
    actual = path.stat().st_size
    if change_counter == version_valid_for and page_count and actual < page_size * page_count:
        raise KvtraceError(f"{path} is truncated ({actual} of {page_size * page_count} bytes): copy or export "
                           "it again")


def _connect(path: Path) -> sqlite3.Connection:
    try:
        conn = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro&immutable=1", uri=True)
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return conn
    except sqlite3.DatabaseError as error:
        raise KvtraceError(f"{path} is not a readable SQLite database ({error}): export it again") from None


def _has_table(conn: sqlite3.Connection, table: str) -> bool:
    return table in sqlite_utils.Database(conn).table_names()


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


def _trace_info(conn: sqlite3.Connection, source: Path, sqlite_path: Path, kernels: pl.DataFrame) -> TraceInfo:
    tables = set(sqlite_utils.Database(conn).table_names())
    meta = dict(conn.execute("SELECT name, value FROM META_DATA_EXPORT").fetchall())
    capture = dict(conn.execute("SELECT name, value FROM META_DATA_CAPTURE").fetchall()) \
        if "META_DATA_CAPTURE" in tables else {}
    graph_mode = next((v for k, v in capture.items() if k.endswith("CUDA_GRAPH_TRACE_OPTIONS:MODE")), None)
    system = dict(conn.execute("SELECT name, value FROM TARGET_INFO_SYSTEM_ENV").fetchall()) \
        if "TARGET_INFO_SYSTEM_ENV" in tables else {}
    count, first = kernels.height, kernels["start"].min()
    last = kernels.select((pl.col("start") + pl.col("duration")).max()).item()
    return TraceInfo(
        source=str(source), sqlite=str(sqlite_path),
        product_version=meta.get("EXPORT_PRODUCT_VERSION"), schema_version=meta.get("EXPORT_SCHEMA_VERSION"),
        driver_version=system.get("NvDriverVersion"), gpus=_gpus(conn, tables, kernels), kernel_count=count,
        first_kernel_ns=first, last_kernel_ns=last, graph_trace_mode=graph_mode,
        capture_trigger=capture.get("START_TRIGGER"))


def _gpus(conn: sqlite3.Connection, tables: set[str], kernels: pl.DataFrame) -> tuple[GpuInfo, ...]:
    if "TARGET_INFO_GPU" not in tables:
        return ()
    columns = sqlite_utils.Database(conn)["TARGET_INFO_GPU"].columns_dict
    wanted = ["id", "name", "smCount", "computeMajor", "computeMinor", "chipName", "totalMemory", "memoryBandwidth"]
    select = ", ".join(c if c in columns else f"NULL AS {c}" for c in wanted)
    # Only GPUs that ran kernels: a multi-GPU host lists all of its devices.
    rows = conn.execute(f"SELECT {select} FROM TARGET_INFO_GPU WHERE id IN (SELECT value FROM json_each(?)) "
                        "ORDER BY id", (_json_ids(kernels["device_id"]),)).fetchall()
    return tuple(GpuInfo(device_id=r[0], name=r[1], sm_count=r[2],
                         compute_capability=None if r[3] is None else f"{r[3]}.{r[4]}", chip=r[5],
                         memory_bytes=r[6], memory_bandwidth=r[7]) for r in rows)


def _json_ids(*columns: pl.Series) -> str:
    return json.dumps(pl.concat([c.cast(pl.Int64) for c in columns]).unique().to_list())


def _kernel_names(conn: sqlite3.Connection, kernels: pl.DataFrame) -> pl.DataFrame:
    rows = conn.execute("SELECT id, value FROM StringIds WHERE id IN (SELECT value FROM json_each(?)) ORDER BY id",
                        (_json_ids(kernels["name_id"], kernels["short_id"]),))
    return pl.DataFrame(rows.fetchall(), schema={"id": pl.Int64, "value": pl.Utf8}, orient="row")


def _read_arrow(path: Path, query: str) -> pl.DataFrame:
    """Run a query through ADBC so results arrive as Arrow columns, read-only."""
    import adbc_driver_sqlite.dbapi as adbc

    with adbc.connect(f"file:{quote(str(path.resolve()))}?mode=ro&immutable=1") as conn:
        with conn.cursor() as cursor:
            cursor.execute(query)
            return pl.from_arrow(cursor.fetch_arrow_table())
