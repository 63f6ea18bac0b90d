"""Nsight Systems tables as kvtrace reads them, whatever the export's format: the table and column names, the
kernel signature packed into three integers, the interface each format's reader gives the loader
(`Tables`: analyzer.sqlite_tables, analyzer.parquet_tables), and the checks of the values read.

Every value nsys writes for what kvtrace reads is an integer or text of a known column: anything else (NULL
where nsys writes none, text in a count, a number past its packed bits) is a damaged or edited export, refused
in one line that names the table and the column.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from operator import itemgetter
from pathlib import Path
from typing import Protocol

from kvtrace.errors import KvtraceError

KERNEL_TABLE = "CUPTI_ACTIVITY_KIND_KERNEL"
RUNTIME_TABLE = "CUPTI_ACTIVITY_KIND_RUNTIME"
NVTX_TABLE = "NVTX_EVENTS"
# The GPU's copies and the synchronizations CUPTI recorded, each with the correlationId of its runtime call: where
# the host waited for the GPU (analyzer.host_waits). An export without them recorded no such waits.
MEMCPY_TABLE = "CUPTI_ACTIVITY_KIND_MEMCPY"
SYNC_TABLE = "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION"
# Every table kvtrace reads: an .nsys-rep is exported with only these (nsys export --tables).
EXPORT_TABLES = (KERNEL_TABLE, RUNTIME_TABLE, NVTX_TABLE, "StringIds", "META_DATA_EXPORT", "META_DATA_CAPTURE",
                 "TARGET_INFO_SYSTEM_ENV", "TARGET_INFO_GPU", MEMCPY_TABLE, SYNC_TABLE)
# Columns kvtrace needs from the kernel table; present in every schema since 2023.4 (schema 3.7.2).
KERNEL_COLUMNS = ("start", "end", "deviceId", "correlationId", "globalPid", "demangledName",
                  "shortName", "gridX", "gridY", "gridZ", "blockX", "blockY", "blockZ")
NVTX_RANGE_TYPES = (59, 60, 70, 71)  # push/pop, start/end, and their NVTXT twins
NVTX_DOMAIN_CREATE = 75  # the event that names a domain; a range's name is prefixed with its domain's
PROCESS_BITS = 0x0000FFFFFF000000  # the process id inside a globalTid: domains are per process
# The runtime and driver calls that can launch kernels (cudaLaunchKernel*, cuLaunchKernel*, cudaGraphLaunch*,
# cudaLaunchCooperativeKernel*, …) hold this in their names: reading only their rows halves the runtime scan.
LAUNCH_WORD = "Launch"
GRAPH_LAUNCH_WORD = "GraphLaunch"  # cudaGraphLaunch*, cuGraphLaunch*: a trace without them has no graph to miss
# The runtime and driver calls that copy (cudaMemcpy*, cuMemcpy*) and those that block the host until the GPU has
# reached a point (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, cuCtxSynchronize, …).
COPY_WORD = "Memcpy"
SYNC_WORD = "Synchronize"
GPU_COLUMNS = ("id", "name", "smCount", "computeMajor", "computeMinor", "chipName", "totalMemory", "memoryBandwidth")
NSYS_HINT = "profile with `nsys profile -t cuda` (add --cuda-graph-trace=node for vLLM)"

# The signature travels packed, three integers per kernel instead of eight columns, within CUDA's launch
# limits (grid 2^31-1 × 65535 × 65535, block 1024 × 1024 × 64) and 32-bit StringIds, so no sum overflows.
# (column, bits) from the lowest bits up; a value that is not a number inside its bits packs to NULL, which
# check_integers refuses, so that it cannot pass as another kernel.
PACKED = {"names": (("demangledName", 32), ("shortName", 31)),
          "grid": (("gridX", 31), ("gridY", 16), ("gridZ", 16)),
          "block": (("blockX", 11), ("blockY", 11), ("blockZ", 10), ("deviceId", 31))}
SIGNATURE = list(PACKED)
# What each column of a kernel batch is made of, for messages about its values.
_PACKED_TOO = " (or text, or values past a string id's or CUDA's launch limits)"
KERNEL_VALUES = ("start", "end", "demangledName or shortName" + _PACKED_TOO, "gridX, gridY or gridZ" + _PACKED_TOO,
                 "blockX, blockY, blockZ or deviceId" + _PACKED_TOO, "correlationId", "globalPid")
LAUNCH_VALUES = ("correlationId", "globalTid", "start")


def workers() -> int:
    """The cores this process may run on (taskset and cpusets narrow them): the threads a load reads on."""
    return max(1, len(os.sched_getaffinity(0)))


class Tables(Protocol):
    """One export's tables, as the loader reads them (analyzer.load); the same answers from every format.

    Rows are Python tuples, checked (check_rows) against what nsys writes; batches are Arrow record batches
    of integers, checked by the loader (check_integers). A span is a piece of a table that one thread reads."""

    path: Path  # the export (an SQLite file or a Parquet folder)
    what: str  # what it is, for messages: "an SQLite database", …
    names: set[str]  # the tables it holds

    def check(self, shown: Path) -> None:
        """Refuse an export that is not a complete Nsight Systems export of a CUDA trace, named as `shown`."""

    def nvtx_rows(self) -> list[tuple]:
        """Closed ranges that ended on their own thread, in table order: (domain-prefixed name, start, end,
        globalTid)."""

    def launch_api_ids(self) -> list[int]:
        """StringIds of the calls that can launch kernels (LAUNCH_WORD in their names)."""

    def spans(self, table: str) -> list:
        """`table` cut into pieces read side by side, in table order."""

    def kernel_batches(self, span) -> Iterator:
        """start, end, the packed names, grid and block, correlationId and globalPid."""

    def graph_launched(self) -> bool:
        """Whether the runtime table holds a CUDA graph launch (GRAPH_LAUNCH_WORD in its name)."""

    def launch_batches(self, span, api_ids: list[int]) -> Iterator:
        """correlationId, globalTid and start of the runtime rows whose nameId is in `api_ids`."""

    def name_values(self, table: str) -> list[tuple]:
        """(name, value) of a metadata table."""

    def gpu_rows(self, device_ids: list[int]) -> list[tuple]:
        """GPU_COLUMNS of TARGET_INFO_GPU for these devices (NULL for a column the schema lacks), by id."""

    def strings(self, ids: list[int]) -> list[tuple]:
        """(id, value) of StringIds for these ids."""

    def integer_rows(self, table: str, columns: tuple[str, ...], where: tuple[str, list[int]] | None = None):
        """`columns` of `table` as one Arrow table of int64 (NULL where nsys left a value out), only the rows whose
        where[0] is one of where[1] when `where` is given; a value that is not an integer is a damaged export."""

    def close(self) -> None: ...


def check_integers(batch, path: Path, table: str, values: tuple[str, ...]) -> None:
    """Every value read is an integer: nsys writes them NOT NULL, so a NULL or text is a damaged or edited export."""
    import pyarrow as pa

    for column, what in zip(batch.columns, values):
        if column.null_count or not pa.types.is_integer(column.type):
            problem = "NULL" if column.null_count else f"{column.type} (not integer)"
            raise damaged_values(path, table, problem, what)


# What a value read row by row may be: the Python types it may have (None where nsys may leave it out).
INT, TEXT, ANY = (int,), (str, type(None)), None
OPTIONAL_INT = (int, type(None))
TYPE_NAMES = {type(None): "NULL", str: "text", bytes: "BLOB", float: "real", int: "integer"}
NVTX_TYPES = (TEXT, INT, INT, INT)
NVTX_VALUES = ("text or its StringIds value", "start", "end", "globalTid")
GPU_TYPES = (INT, TEXT, OPTIONAL_INT, OPTIONAL_INT, OPTIONAL_INT, TEXT, OPTIONAL_INT, OPTIONAL_INT)


def check_rows(rows, path: Path, table: str, types: tuple, what: tuple[str, ...]) -> None:
    """Every value of rows read as Python values has a type nsys writes there: text or NULL for names, integers
    for numbers. SQLite stores any value in any column, so a BLOB name or text in a count is an edited export."""
    # Column by column first (a million NVTX rows): only an export holding another type is read value by value, for
    # the first such value in row order.
    if not any(allowed is not None and not set(map(type, map(itemgetter(place), rows))) <= set(allowed)
               for place, allowed in enumerate(types)):
        return
    for row in rows:
        for value, allowed, column in zip(row, types, what):
            if allowed is not None and type(value) not in allowed:
                found = TYPE_NAMES.get(type(value), type(value).__name__)
                problem = "NULL" if value is None else f"{found} (not {'text' if str in allowed else 'integer'})"
                raise damaged_values(path, table, problem, column)


def damaged_values(path: Path, table: str, problem: str, what: str) -> KvtraceError:
    return KvtraceError(f"{path}: {table} has {problem} values in {what}: the export is damaged or was "
                        "edited; export the report again")


def check_tables(tables: Tables, shown: Path, kernel_columns: set[str], has_kernels: bool, how: str) -> None:
    """The checks every format shares, given what the export holds: StringIds, the metadata nsys writes last,
    the kernel table with kvtrace's columns and at least one row. `how` names the export command."""
    if "StringIds" not in tables.names:
        raise KvtraceError(f"{shown} is {tables.what} but not an Nsight Systems export (no StringIds "
                           f"table): pass the output of `{how}`")
    if "META_DATA_EXPORT" not in tables.names:
        # nsys writes StringIds first and the metadata last: an export that died in between, such as
        # Nsight Systems 2023.4 failing on a 2025.x report with ProtobufParseException.
        raise KvtraceError(f"{shown} is a partial Nsight Systems export (no META_DATA_EXPORT): the export "
                           "did not finish; export the report again with the nsys that recorded it or newer")
    if KERNEL_TABLE not in tables.names:
        raise KvtraceError(f"{shown} has no CUDA kernel records: {NSYS_HINT}")
    missing = [c for c in KERNEL_COLUMNS if c not in kernel_columns]
    if missing:
        raise KvtraceError(f"{shown}: kernel table lacks {', '.join(missing)}: re-export with a newer nsys")
    if not has_kernels:
        raise KvtraceError(f"{shown} has no CUDA kernel records: {NSYS_HINT}")
