"""An Nsight Systems SQLite export's tables (analyzer.export_tables.Tables), read with SQL.

The file is opened read-only (`mode=ro&immutable=1`, as NVIDIA's own report scripts do). Kernel and runtime
rows are read as Arrow through ADBC, never as Python rows, over several connections at once (one per core,
each over a range of rowids).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import sqlite_utils

from kvtrace.analyzer import export_tables as et
from kvtrace.analyzer import sqlite_file
from kvtrace.errors import KvtraceError

# Rows per Arrow batch and connection, for memory: one batch per core in flight, about 60 bytes per row while it
# is turned into the layout's columns. The batch size barely changes SQLite's cost.
BATCH_BYTES = 64 << 20
# Rows of a table read over one connection: a table is cut into at most 4 such ranges per core, so that cores
# that finish early take more.
CHUNK_ROWS = 1 << 20


def damage_errors() -> tuple[type[Exception], ...]:
    """What a damaged SQLite page raises while it is read."""
    import adbc_driver_manager

    return (sqlite3.Error, UnicodeDecodeError, adbc_driver_manager.Error)


class SqliteTables:
    what = "an SQLite database"

    def __init__(self, path: Path):
        sqlite_file.check_size(path)
        sqlite_file.check_settled(path)
        self.path = path
        self.conn = sqlite_file.connect(path)
        self.names = set(sqlite_utils.Database(self.conn).table_names())

    def close(self) -> None:
        self.conn.close()

    def check(self, shown: Path) -> None:
        try:
            columns = set(sqlite_utils.Database(self.conn)[et.KERNEL_TABLE].columns_dict) \
                if et.KERNEL_TABLE in self.names else set()
            has_kernels = bool(columns) and self.conn.execute(
                f"SELECT 1 FROM {et.KERNEL_TABLE} LIMIT 1").fetchone() is not None
            et.check_tables(self, shown, columns, has_kernels, "nsys export --type sqlite")
        except sqlite3.DatabaseError as error:
            raise KvtraceError(f"{shown} is damaged ({error}): copy or export it again") from None

    def nvtx_rows(self) -> list[tuple]:
        if et.NVTX_TABLE not in self.names:
            return []
        types = ",".join(map(str, et.NVTX_RANGE_TYPES))
        # A range that ends on another thread (endGlobalTid set) cannot be tied to launches; nsys's own
        # projection reports drop it too (nvtx_gpu_proj_trace.py).
        rows = self.conn.execute(f"""
            SELECT CASE WHEN d.text IS NULL THEN COALESCE(s.value, e.text)
                        ELSE d.text || ':' || COALESCE(s.value, e.text) END,
                   e.start, e."end", e.globalTid
            FROM {et.NVTX_TABLE} e
            LEFT JOIN StringIds s ON s.id = e.textId
            LEFT JOIN {et.NVTX_TABLE} d ON d.eventType = {et.NVTX_DOMAIN_CREATE} AND d.domainId = e.domainId
                 AND e.domainId != 0 AND (d.globalTid & {et.PROCESS_BITS}) = (e.globalTid & {et.PROCESS_BITS})
            WHERE e.eventType IN ({types}) AND e."end" IS NOT NULL AND e.endGlobalTid IS NULL
            ORDER BY e.rowid""").fetchall()
        et.check_rows(rows, self.path, et.NVTX_TABLE, et.NVTX_TYPES, et.NVTX_VALUES)
        return rows

    def launch_api_ids(self) -> list[int]:
        return [r[0] for r in self.conn.execute(f"SELECT id FROM StringIds WHERE value GLOB '*{et.LAUNCH_WORD}*'")]

    def graph_launched(self) -> bool:
        ids = [r[0] for r in self.conn.execute(f"SELECT id FROM StringIds WHERE value GLOB '*{et.GRAPH_LAUNCH_WORD}*'")]
        # No such name: no scan. Otherwise the first graph launch ends it; only a trace that names one and never
        # launched it reads the whole table.
        return bool(ids) and self.conn.execute(f"SELECT 1 FROM {et.RUNTIME_TABLE} WHERE nameId IN "
                                               f"({','.join(map(str, ids))}) LIMIT 1").fetchone() is not None

    def spans(self, table: str) -> list[tuple[int, int]]:
        """The table's rowids cut into ranges of about CHUNK_ROWS, at most 4 per core; rowid bounds are b-tree
        lookups. Each range is read over its own connection."""
        # Separate queries: SQLite answers a lone min() or max() from the b-tree, but scans for both together.
        low, high = (self.conn.execute(f"SELECT {bound}(rowid) FROM {table}").fetchone()[0]
                     for bound in ("min", "max"))
        if low is None:
            return []
        rows = high - low + 1
        pieces = max(1, min(4 * et.workers(), -(-rows // CHUNK_ROWS)))
        edges = [low + rows * i // pieces for i in range(pieces + 1)]
        return [(edges[i], edges[i + 1] - 1) for i in range(pieces)]

    def kernel_batches(self, span: tuple[int, int]):
        return read_batches(self.path, _within(kernel_query(), span))

    def launch_batches(self, span: tuple[int, int], api_ids: list[int]):
        return read_batches(self.path, _within(launch_query(api_ids), span))

    def name_values(self, table: str) -> list[tuple]:
        return self.conn.execute(f"SELECT name, value FROM {table}").fetchall()

    def gpu_rows(self, device_ids: list[int]) -> list[tuple]:
        columns = sqlite_utils.Database(self.conn)["TARGET_INFO_GPU"].columns_dict
        select = ", ".join(c if c in columns else f"NULL AS {c}" for c in et.GPU_COLUMNS)
        return self.conn.execute(f"SELECT {select} FROM TARGET_INFO_GPU WHERE id IN (SELECT value FROM json_each(?)) "
                                 "ORDER BY id", (json.dumps(device_ids),)).fetchall()

    def strings(self, ids: list[int]) -> list[tuple]:
        return self.conn.execute("SELECT id, value FROM StringIds WHERE id IN (SELECT value FROM json_each(?))",
                                 (json.dumps(ids),)).fetchall()

    def integer_rows(self, table: str, columns: tuple[str, ...], where: tuple[str, list[int]] | None = None):
        import pyarrow as pa

        present = sqlite_utils.Database(self.conn)[table].columns_dict
        missing = [c for c in dict.fromkeys((*columns, *(where[:1] if where else ()))) if c not in present]
        if missing:  # SQLite would read a quoted name it lacks as text, "bytes" for bytes
            raise KvtraceError(f"{self.path}: {table} lacks column {', '.join(missing)}: the export is damaged or was "
                               "edited; export the report again")
        query = "SELECT " + ", ".join(f'"{c}"' for c in columns) + f" FROM {table}"
        if where is not None:
            query += f" WHERE \"{where[0]}\" IN ({','.join(str(int(v)) for v in where[1])})"
        batches = [batch for batch in read_batches(self.path, query) if batch.num_rows]
        if not batches:  # no rows, no types to check: empty int64 columns
            return pa.table({c: pa.array([], pa.int64()) for c in columns})
        read = pa.Table.from_batches(batches)
        for column in columns:
            values = read.column(column)
            if not (pa.types.is_integer(values.type) or pa.types.is_null(values.type)):
                raise et.damaged_values(self.path, table, f"{values.type} (not integer)", column)
        return pa.table({c: read.column(c).cast(pa.int64()) for c in columns})


def _packed(fields: tuple[tuple[str, int], ...]) -> str:
    """Columns packed into one integer (export_tables.PACKED). SQLite's `+` reads text as 0 and a value past its
    bits would spill into the next field, so each field is NULL unless it is a number inside its bits."""
    terms, shift = [], 0
    for column, bits in fields:
        # Text and BLOBs sort above every number in SQLite, so BETWEEN alone turns them into NULL.
        terms.append(f"CASE WHEN {column} BETWEEN 0 AND {(1 << bits) - 1} THEN {column} END"
                     + (f" * {1 << shift}" if shift else ""))
        shift += bits
    return " + ".join(terms)


def launch_query(api_ids: list[int]) -> str:
    return (f"SELECT correlationId, globalTid, start FROM {et.RUNTIME_TABLE} "
            f"WHERE nameId IN ({','.join(map(str, api_ids))})")


def kernel_query() -> str:
    """The kernel table's columns kvtrace reads, with what ties a kernel to its launch call and its process."""
    packed = ", ".join(_packed(fields) for fields in et.PACKED.values())
    return f"SELECT start, \"end\", {packed}, correlationId, globalPid FROM {et.KERNEL_TABLE}"


def _within(query: str, span: tuple[int, int]) -> str:
    """A query of one table narrowed to a range of its rowids (a b-tree range, not a scan)."""
    return f"{query} {'AND' if ' WHERE ' in query else 'WHERE'} rowid BETWEEN {span[0]} AND {span[1]}"


def read_batches(path: Path, query: str):
    """Stream a query's rows as Arrow record batches through ADBC, read-only: memory stays at one batch."""
    import adbc_driver_sqlite.dbapi as adbc

    with adbc.connect(sqlite_file.read_only_uri(path)) as conn:
        with conn.cursor() as cursor:
            rows = min(1 << 18, max(1 << 14, BATCH_BYTES // 60 // et.workers()))
            cursor.adbc_statement.set_options(**{"adbc.sqlite.query.batch_rows": str(rows)})
            cursor.execute(query)
            yield from cursor.fetch_record_batch()


# ---- stages of a load, for bench/stages.py, which times each alone -------------------------------------

def stage_queries(path: Path) -> dict[str, str]:
    """The two table reads a load makes, as SQL: "kernels" (with the launch keys) and "launches"."""
    tables = SqliteTables(path)
    try:
        api_ids = tables.launch_api_ids()
    finally:
        tables.close()
    return {"kernels": kernel_query(), "launches": launch_query(api_ids)}


def drain(path: Path, query: str) -> int:
    """Read a query's rows as a load reads them (Arrow batches through ADBC) and throw them away."""
    return sum(batch.num_rows for batch in read_batches(path, query))
