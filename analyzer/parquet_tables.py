"""An Nsight Systems Parquet export's tables (analyzer.export_tables.Tables): a folder with one `TABLE.parquet`
per table, as `nsys export --type parquetdir` writes it (and 2025.3's `nsys recipe`, `<report>_pqtdir`).

Only the columns kvtrace needs are read, through pyarrow. Parquet columns carry their types, so a column of
another type than nsys writes is refused by its type, and NULLs by their count. nsys writes unsigned
columns (globalTid uint64, deviceId uint32) where SQLite holds the same bits as signed integers; they are read
as int64 with the bits kept, which is what the SQLite export holds.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import polars as pl

from kvtrace.analyzer import export_tables as et
from kvtrace.errors import KvtraceError

SUFFIX = ".parquet"
_KERNEL_KEYS = ("correlationId", "globalPid")
# nsys writes row groups of about a million rows; a file of tiny groups (one row each) is read as spans of at least
# this many rows, so that the loader's work per span is not paid per row, and refused past _MAX_ROW_GROUPS groups,
# whose metadata alone would cost more than the rows.
_SPAN_ROWS = 1 << 16
_MAX_ROW_GROUPS = 1 << 16


def is_parquet_export(path: Path) -> bool:
    """Whether `path` is a folder that holds StringIds.parquet, as an nsys Parquet export does (False where it
    cannot be reached: the file checks say why)."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode) and stat.S_ISREG(os.stat(path / f"StringIds{SUFFIX}").st_mode)
    except OSError:
        return False


def damage_errors() -> tuple[type[Exception], ...]:
    """What a damaged Parquet file raises while it is read."""
    import pyarrow as pa

    return (pa.ArrowException, pl.exceptions.PolarsError)


def _memory_limit() -> int:
    """Bytes this process can still allocate: the memory available (Linux' MemAvailable, else free pages), within
    its address-space limit (ulimit -v)."""
    import resource

    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as meminfo:
            available = next(int(line.split()[1]) << 10 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    return available if limit == resource.RLIM_INFINITY else min(available, limit)


def out_of_memory(source: Path, needed: int | None = None) -> KvtraceError:
    """A read that does not fit in memory (a decompression bomb, or an export too large for this machine): said as
    such, not as damage."""
    size = f" (its pages decompress to {needed / 2 ** 30:.1f} GiB)" if needed else ""
    return KvtraceError(f"{source}: not enough memory to read it{size}; a Parquet file that decompresses to more "
                        "than the memory free is a decompression bomb or an export too large for this machine: "
                        "export the report again, as SQLite for a large report, on a machine with more memory")


class ParquetTables:
    what = "a folder of Parquet files"

    def __init__(self, path: Path):
        self.path = path
        self.names = set()
        for entry in os.scandir(path):
            if entry.name.endswith(SUFFIX):
                try:
                    # A FIFO or device would block the read, a folder cannot be one: refused by name.
                    if not stat.S_ISREG(entry.stat().st_mode):
                        raise KvtraceError(f"{path}: {entry.name} is not a regular file: copy or export the "
                                           "folder again")
                    with open(entry.path, "rb"):
                        pass
                except OSError as error:
                    raise KvtraceError(f"cannot read {entry.path}: {(error.strerror or str(error)).lower()}; check "
                                       "it and its permissions, or export the folder again") from None
                self.names.add(entry.name.removesuffix(SUFFIX))
        self._read: dict[str, object] = {}  # the small tables, read whole once
        self._groups: dict[str, dict[tuple[int, int], list[int]]] = {}  # per table, each span's row groups
        self._metadata: dict[str, object] = {}  # per table, its file's metadata, parsed once
        self._strings: pl.DataFrame | None = None  # StringIds, checked, built once

    def close(self) -> None:
        self._read.clear()
        self._strings = None

    def _file(self, table: str) -> str:
        return str(self.path / f"{table}{SUFFIX}")

    def _meta(self, table: str):
        import pyarrow.parquet as pq

        if table not in self._metadata:
            metadata = pq.read_metadata(self._file(table))
            names = metadata.schema.to_arrow_schema().names
            twice = sorted({name for name in names if names.count(name) > 1})
            if twice:  # Arrow would refuse to pick one by name (KeyError)
                raise KvtraceError(f"{self.path}: {table}{SUFFIX} has column {', '.join(twice)} more than once: the "
                                   "export is damaged or was edited; export the report again")
            self._metadata[table] = metadata
        return self._metadata[table]

    def columns(self, table: str) -> set[str]:
        return set(self._meta(table).schema.to_arrow_schema().names)

    def _fits(self, table: str, groups, columns) -> None:
        """Refuse, before reading, row groups whose `columns` decompress past the memory this process can have."""
        metadata = self._meta(table)
        wanted = set(columns)
        needed = sum(chunk.total_uncompressed_size for group in groups
                     for chunk in (metadata.row_group(group).column(i) for i in range(metadata.num_columns))
                     if chunk.path_in_schema in wanted)
        if needed > _memory_limit():
            raise out_of_memory(Path(self._file(table)), needed)

    def table(self, table: str, columns: tuple[str, ...], optional: tuple[str, ...] = ()):
        """The named columns of a small table (NVTX, strings, metadata, GPUs) as Arrow, read once; NULL for an
        `optional` column the schema lacks; a missing column is a damaged export."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        key = f"{table}:{','.join(columns)}"
        if key not in self._read:
            present = self.columns(table)
            missing = [c for c in columns if c not in present and c not in optional]
            if missing:
                raise _lacks(self.path, table, missing)
            self._fits(table, range(self._meta(table).num_row_groups), columns)
            read = pq.read_table(self._file(table), columns=[c for c in columns if c in present], memory_map=True)
            for column in read.column_names:
                if pa.types.is_string(read.column(column).type) or pa.types.is_large_string(read.column(column).type):
                    try:  # Arrow does not check UTF-8 as it reads; polars would panic on it
                        read.column(column).validate(full=True)
                    except pa.ArrowInvalid:
                        raise et.damaged_values(self.path, table, "invalid UTF-8 (not text)", column) from None
            self._read[key] = pa.table({c: read.column(c) if c in present else pa.nulls(read.num_rows)
                                        for c in columns})
        return self._read[key]

    def check(self, shown: Path) -> None:
        if "StringIds" in self.names and "META_DATA_EXPORT" not in self.names:
            # Each table is its own file: a folder without the export's metadata is a partial export, or one of
            # a few tables such as `nsys recipe` writes for itself.
            raise KvtraceError(f"{shown} is a partial Nsight Systems Parquet export (no META_DATA_EXPORT.parquet): "
                               "an export that did not finish, or of only some tables; export the report with "
                               f"`nsys export --type parquetdir --tables={','.join(et.EXPORT_TABLES)}`")

        has_kernels = et.KERNEL_TABLE in self.names and self._meta(et.KERNEL_TABLE).num_rows > 0
        columns = self.columns(et.KERNEL_TABLE) if et.KERNEL_TABLE in self.names else set()
        et.check_tables(self, shown, columns, has_kernels, "nsys export --type parquetdir")

    def nvtx_rows(self) -> list[tuple]:
        if et.NVTX_TABLE not in self.names:
            return []
        read = self.table(et.NVTX_TABLE, ("eventType", "start", "end", "text", "globalTid", "endGlobalTid", "textId",
                                          "domainId"))
        frame = pl.from_arrow(_as_int64(read, ("eventType", "start", "end", "globalTid", "textId", "domainId"),
                                        self.path, et.NVTX_TABLE)).with_row_index("row")
        _texts(frame, ("text",), self.path, et.NVTX_TABLE)
        strings = self._strings_frame()
        process = pl.col("globalTid").cast(pl.Int64) & et.PROCESS_BITS
        domains = frame.filter(pl.col("eventType") == et.NVTX_DOMAIN_CREATE).select(
            "domainId", process.alias("process"), pl.col("text").alias("domain"))
        # A range that ends on another thread (endGlobalTid set) cannot be tied to launches; nsys's own
        # projection reports drop it too (nvtx_gpu_proj_trace.py).
        ranges = frame.filter(pl.col("eventType").is_in(et.NVTX_RANGE_TYPES) & pl.col("end").is_not_null()
                              & pl.col("endGlobalTid").is_null())
        named = (ranges.with_columns(process.alias("process"))
                 .join(strings.rename({"id": "textId"}), on="textId", how="left", maintain_order="left")
                 .join(domains, on=["domainId", "process"], how="left", maintain_order="left")
                 .with_columns(pl.when(pl.col("domainId") == 0).then(None).otherwise(pl.col("domain")).alias("domain"))
                 .with_columns(pl.coalesce("value", "text").alias("name"))
                 .with_columns(pl.when(pl.col("domain").is_null()).then(pl.col("name"))
                               .otherwise(pl.concat_str("domain", pl.lit(":"), "name")).alias("name"))
                 .sort("row", maintain_order=True))
        rows = named.select("name", "start", "end", "globalTid").rows()
        et.check_rows(rows, self.path, et.NVTX_TABLE, et.NVTX_TYPES, et.NVTX_VALUES)
        return rows

    def _strings_frame(self) -> pl.DataFrame:
        """StringIds, its ids checked to be unique (SQLite's primary key makes them so; a Parquet file holding one
        twice would give a kernel the name of whichever row came first), integers and text."""
        import pyarrow.compute as pc

        if self._strings is None:
            strings = self.table("StringIds", ("id", "value"))
            if pc.count_distinct(strings.column("id")).as_py() != strings.num_rows - strings.column("id").null_count:
                ids = strings.column("id").to_pylist()
                seen = set()
                twice = next(i for i in ids if i is not None and (i in seen or seen.add(i)))
                raise KvtraceError(f"{self.path}: StringIds{SUFFIX} holds id {twice} more than once, so a kernel's "
                                   "name is ambiguous: the export is damaged or was edited; export the report again")
            frame = pl.from_arrow(_as_int64(strings, ("id",), self.path, "StringIds"))
            _texts(frame, ("value",), self.path, "StringIds")
            self._strings = frame
        return self._strings

    def launch_api_ids(self) -> list[int]:
        strings = self._strings_frame()
        return strings.filter(pl.col("value").str.contains(et.LAUNCH_WORD, literal=True))["id"].to_list()

    def graph_launched(self) -> bool:
        import pyarrow as pa
        import pyarrow.compute as pc

        strings = self._strings_frame()
        ids = strings.filter(pl.col("value").str.contains(et.GRAPH_LAUNCH_WORD, literal=True))["id"].to_list()
        if not ids:
            return False
        # As the SQLite reader's LIMIT 1: span by span, the first one holding a graph launch ends the scan.
        wanted = pa.array(ids, pa.int64())
        for span in self.spans(et.RUNTIME_TABLE):
            names = _as_int64(self._group(et.RUNTIME_TABLE, span, ("nameId",)), ("nameId",), self.path,
                              et.RUNTIME_TABLE)
            if pc.any(pc.is_in(names.column("nameId"), value_set=wanted)).as_py():
                return True
        return False

    def spans(self, table: str) -> list[tuple[int, int]]:
        """The table's row groups as (first row, last row): nsys' writer cuts tables into groups of about a
        million rows, and each group is read on its own thread, so that memory stays at a group per core."""
        self._groups[table] = _row_groups(self._meta(table), Path(self._file(table)))
        return list(self._groups[table])

    def _group(self, table: str, span: tuple[int, int], columns: tuple[str, ...]):
        """The row groups of `span` (from `spans`), with only `columns`; a missing column is a damaged export."""
        import pyarrow.parquet as pq

        missing = [c for c in columns if c not in self.columns(table)]
        if missing:
            raise _lacks(self.path, table, missing)
        groups = self._groups[table][span]
        self._fits(table, groups, columns)
        handle = pq.ParquetFile(self._file(table), memory_map=True, metadata=self._meta(table))
        return handle.read_row_groups(groups, columns=list(columns))

    def kernel_batches(self, span: tuple[int, int]):
        import pyarrow as pa

        packed_columns = tuple(column for fields in et.PACKED.values() for column, _ in fields)
        piece = self._group(et.KERNEL_TABLE, span, ("start", "end", *packed_columns, *_KERNEL_KEYS))
        integers = _as_int64(piece, ("start", "end", *_KERNEL_KEYS), None, et.KERNEL_TABLE)
        columns = {"start": integers.column("start"), "end": integers.column("end")}
        columns.update({name: _packed(piece, fields) for name, fields in et.PACKED.items()})
        columns.update({key: integers.column(key) for key in _KERNEL_KEYS})
        yield from pa.table(columns).to_batches()

    def launch_batches(self, span: tuple[int, int], api_ids: list[int]):
        import pyarrow as pa
        import pyarrow.compute as pc

        piece = self._group(et.RUNTIME_TABLE, span, ("correlationId", "globalTid", "start", "nameId"))
        piece = _as_int64(piece, ("nameId",), self.path, et.RUNTIME_TABLE)
        launches = piece.filter(pc.is_in(piece.column("nameId"), value_set=pa.array(api_ids, pa.int64())))
        yield from _as_int64(launches.select(list(et.LAUNCH_VALUES)), et.LAUNCH_VALUES, None,
                             et.RUNTIME_TABLE).to_batches()

    def name_values(self, table: str) -> list[tuple]:
        return pl.from_arrow(self.table(table, ("name", "value"))).rows()

    def gpu_rows(self, device_ids: list[int]) -> list[tuple]:
        read = self.table("TARGET_INFO_GPU", et.GPU_COLUMNS, optional=et.GPU_COLUMNS[1:])
        frame = pl.from_arrow(_as_int64(read, ("id",), self.path, "TARGET_INFO_GPU"))
        return frame.filter(pl.col("id").is_in(device_ids)).sort("id", maintain_order=True).rows()

    def strings(self, ids: list[int]) -> list[tuple]:
        return self._strings_frame().filter(pl.col("id").is_in(ids)).rows()

    def integer_rows(self, table: str, columns: tuple[str, ...], where: tuple[str, list[int]] | None = None):
        import pyarrow as pa
        import pyarrow.compute as pc

        wanted = tuple(dict.fromkeys((*columns, *(where[:1] if where else ()))))
        pieces = []
        for span in self.spans(table):  # a row group at a time, as the kernel and runtime tables are read
            piece = _as_int64(self._group(table, span, wanted), wanted, self.path, table)
            if where is not None:
                piece = piece.filter(pc.is_in(piece.column(where[0]), value_set=pa.array(where[1], pa.int64())))
            pieces.append(piece.select(list(columns)))
        return pa.concat_tables(pieces) if pieces else pa.table({c: pa.array([], pa.int64()) for c in columns})


def _row_groups(metadata, file: Path) -> dict[tuple[int, int], list[int]]:
    """Spans of consecutive row groups, each of at least _SPAN_ROWS rows but the last, as (first row, last row) in
    table order, with their groups' indexes. nsys' own groups are a span each."""
    if metadata.num_row_groups > _MAX_ROW_GROUPS:
        raise KvtraceError(f"{file}: {metadata.num_row_groups:,} row groups for {metadata.num_rows:,} rows, not as "
                           f"nsys writes them (about a million rows a group), and past the {_MAX_ROW_GROUPS:,} "
                           "kvtrace reads: export the report again")
    found, low, groups, rows = {}, 0, [], 0
    for group in range(metadata.num_row_groups):
        count = metadata.row_group(group).num_rows
        if count:
            groups.append(group)
            rows += count
        if rows >= _SPAN_ROWS or (group == metadata.num_row_groups - 1 and rows):
            found[(low, low + rows - 1)] = groups
            low, groups, rows = low + rows, [], 0
    return found


def _lacks(path: Path, table: str, missing: list[str]) -> KvtraceError:
    return KvtraceError(f"{path}: {table}{SUFFIX} lacks column {', '.join(missing)}: the export is damaged or was "
                        "edited; export the report again")


def _as_int64(table, columns: tuple[str, ...], path: Path | None, name: str):
    """`columns` of an Arrow table as int64, unsigned ones with their bits kept (as SQLite holds them). A column of
    another type is refused when `path` names the export; else left as it is, for check_integers to refuse."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for column in columns:
        values = table.column(column)
        if pa.types.is_integer(values.type) or pa.types.is_null(values.type):
            table = table.set_column(table.schema.get_field_index(column), column,
                                     pc.cast(values, pa.int64(), safe=False))
        elif path is not None:
            raise et.damaged_values(path, name, f"{values.type} (not integer)", column)
    return table


def _texts(frame: pl.DataFrame, columns: tuple[str, ...], path: Path, table: str) -> None:
    for column in columns:
        if frame[column].dtype not in (pl.Utf8, pl.Null):
            raise et.damaged_values(path, table, f"{frame[column].dtype} (not text)", column)


def _packed(table, fields: tuple[tuple[str, int], ...]):
    """Columns packed into one int64 (export_tables.PACKED): NULL where any field is NULL, not an integer column, or
    not a number inside its bits, as the SQLite reader's SQL makes it."""
    import pyarrow as pa

    total = np.zeros(table.num_rows, dtype=np.int64)
    bad = np.zeros(table.num_rows, dtype=bool)
    shift = 0
    for column, bits in fields:
        values = table.column(column)
        if not pa.types.is_integer(values.type):
            bad[:] = True
        else:
            numbers = values.to_numpy(zero_copy_only=False).astype(np.float64) if values.null_count \
                else values.to_numpy()
            outside = ~((numbers >= 0) & (numbers <= (1 << bits) - 1))  # NaN (NULL) is outside too
            bad |= outside
            total += np.where(outside, 0, numbers).astype(np.int64) << shift
        shift += bits
    return pa.array(total, mask=bad)
