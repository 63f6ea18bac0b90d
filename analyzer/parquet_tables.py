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
        self._groups: dict[str, dict[tuple[int, int], int]] = {}  # per table, each span's row group

    def close(self) -> None:
        self._read.clear()

    def _file(self, table: str) -> str:
        return str(self.path / f"{table}{SUFFIX}")

    def columns(self, table: str) -> set[str]:
        import pyarrow.parquet as pq

        return set(pq.read_schema(self._file(table)).names)

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
            read = pq.read_table(self._file(table), columns=[c for c in columns if c in present], memory_map=True)
            self._read[key] = pa.table({c: read.column(c) if c in present else pa.nulls(read.num_rows)
                                        for c in columns})
        return self._read[key]

    def check(self, shown: Path) -> None:
        import pyarrow.parquet as pq

        if "StringIds" in self.names and "META_DATA_EXPORT" not in self.names:
            # Each table is its own file: a folder without the export's metadata is a partial export, or one of
            # a few tables such as `nsys recipe` writes for itself.
            raise KvtraceError(f"{shown} is a partial Nsight Systems Parquet export (no META_DATA_EXPORT.parquet): "
                               "an export that did not finish, or of only some tables; export the report with "
                               f"`nsys export --type parquetdir --tables={','.join(et.EXPORT_TABLES)}`")

        has_kernels = et.KERNEL_TABLE in self.names and pq.read_metadata(self._file(et.KERNEL_TABLE)).num_rows > 0
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
        frame = pl.from_arrow(_as_int64(self.table("StringIds", ("id", "value")), ("id",), self.path, "StringIds"))
        _texts(frame, ("value",), self.path, "StringIds")
        return frame

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
        names = _as_int64(self.table(et.RUNTIME_TABLE, ("nameId",)), ("nameId",), self.path, et.RUNTIME_TABLE)
        return bool(pc.any(pc.is_in(names.column("nameId"), value_set=pa.array(ids, pa.int64()))).as_py())

    def spans(self, table: str) -> list[tuple[int, int]]:
        """The table's row groups as (first row, last row): nsys' writer cuts tables into groups of about a
        million rows, and each group is read on its own thread, so that memory stays at a group per core."""
        import pyarrow.parquet as pq

        self._groups[table] = _row_groups(pq.read_metadata(self._file(table)))
        return list(self._groups[table])

    def _group(self, table: str, span: tuple[int, int], columns: tuple[str, ...]):
        """The row group of `span` (from `spans`), with only `columns`; a missing column is a damaged export."""
        import pyarrow.parquet as pq

        handle = pq.ParquetFile(self._file(table), memory_map=True)
        missing = [c for c in columns if c not in handle.schema_arrow.names]
        if missing:
            raise _lacks(self.path, table, missing)
        return handle.read_row_group(self._groups[table][span], columns=list(columns))

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
        return pl.from_arrow(self.table("StringIds", ("id", "value"))).filter(pl.col("id").is_in(ids)).rows()


def _row_groups(metadata) -> dict[tuple[int, int], int]:
    """Each non-empty row group's (first row, last row), in table order, and its index."""
    found, low = {}, 0
    for group in range(metadata.num_row_groups):
        rows = metadata.row_group(group).num_rows
        if rows:
            found[(low, low + rows - 1)] = group
        low += rows
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
