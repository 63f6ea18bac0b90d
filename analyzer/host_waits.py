"""Where the host waited for the GPU: the runtime calls that returned only once the GPU had done something, read
from the export's copies (CUPTI_ACTIVITY_KIND_MEMCPY) and synchronizations (CUPTI_ACTIVITY_KIND_SYNCHRONIZATION)
with the runtime calls that made them, and the kernels launched on the same thread just before and just after.

A copy is a wait when its runtime call (cudaMemcpy*, cuMemcpy*) returned after the copy ended: the host stayed
in the call until the GPU had drained the stream and copied, as a device-to-host copy into pageable memory always
does (a `.item()` or `.cpu()` of a tensor), while an asynchronous copy returns before it runs. A synchronization
is a wait when its runtime call is one that blocks the host (…Synchronize); cudaEventQuery and
cudaStreamWaitEvent do not. The host's time in the wait is the runtime call's. A copy made by a graph launch
(a memcpy node) has a launch for its call and is no wait.

The reads happen after the load, only for traces with vLLM steps; an export without both tables (older
exports cut to the tables kvtrace read, or exported without them) recorded no waits: None, never zero.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import polars as pl

from kvtrace.analyzer import export_tables as et
from kvtrace.analyzer import load
from kvtrace.errors import KvtraceError

if TYPE_CHECKING:
    from kvtrace.analyzer.load import Trace

# nsys's ENUM_CUDA_MEMCPY_OPER and ENUM_CUDA_MEM_KIND (reference: docs of the SQLite export), in words.
COPY_KINDS = {1: "host-to-device", 2: "device-to-host", 3: "host-to-array", 4: "array-to-host", 5: "array-to-array",
              6: "array-to-device", 7: "device-to-array", 8: "device-to-device", 9: "host-to-host",
              10: "peer-to-peer", 11: "unified host-to-device", 12: "unified device-to-host",
              13: "unified device-to-device"}
MEMORY_KINDS = {0: "pageable", 1: "pinned", 2: "device", 3: "array", 4: "managed", 5: "device static",
                6: "managed static"}
_VERSION = re.compile(r"_v\d+$")  # the API version nsys appends to a runtime call's name (cudaMemcpyAsync_v3020)
WAIT_KEY = ("call", "copy_kind", "src_kind", "dst_kind")
SCHEMA = {"global_tid": pl.Int64, "start": pl.Int64, "end": pl.Int64, "call": pl.Utf8, "copy_kind": pl.Utf8,
          "src_kind": pl.Utf8, "dst_kind": pl.Utf8, "bytes": pl.Int64, "before": pl.Utf8, "after": pl.Utf8}
_WAIT_SCHEMA = {name: dtype for name, dtype in SCHEMA.items() if name not in ("before", "after")}  # waits()


@dataclass(frozen=True)
class WaitKind:
    """One kind of host wait (the runtime call, and for a copy its direction and memory kinds) in a phase's paired
    steps, that the candidate made and the baseline did not, or far less (steps.FAR_MORE): counts and host time
    over those steps, the bytes a copy moved, and the kernels launched around it on its thread."""

    call: str  # the runtime call, without nsys's version suffix: cudaMemcpyAsync, cudaStreamSynchronize
    copy_kind: str | None  # a copy's direction (COPY_KINDS), None for a synchronization
    src_kind: str | None  # a copy's memory kinds (MEMORY_KINDS)
    dst_kind: str | None
    bytes_low: int | None  # the smallest and largest copy, None for a synchronization
    bytes_high: int | None
    candidate_calls: int
    baseline_calls: int
    candidate_ns: int  # the host's time in those calls, all paired steps together
    baseline_ns: int
    candidate_mean_ns: float  # per call of the candidate's
    steps: int  # paired steps in which the candidate made at least one
    per_step_low: int  # the fewest and most such calls in one of those steps
    per_step_high: int
    before: str | None  # the short name of the kernel launched last before most of the candidate's calls
    after: str | None  # and first after them, on the same thread (None: no launch there)
    around: int  # how many of the candidate's calls had exactly these neighbours


def host_waits(trace: Trace) -> pl.DataFrame | None:
    """Per runtime call in which the host waited for the GPU (SCHEMA): its thread, start and end, the call,
    a copy's direction, memory kinds and bytes (None for a synchronization), and the short names of the kernels
    launched just before and just after it on its thread. None where the export recorded no copies and
    synchronizations."""
    return trace.memo("host_waits", lambda: _around(trace))


def waits(trace: Trace) -> pl.DataFrame | None:
    """host_waits without `before` and `after`, whose kernels are found among every launch call of the trace: what
    counting and timing the waits needs."""
    return trace.memo("waits", lambda: _read(trace))


def _around(trace: Trace) -> pl.DataFrame | None:
    found = waits(trace)
    if found is None or found.is_empty():
        return None if found is None else pl.DataFrame(schema=SCHEMA)
    with load.tables_of(trace) as tables:
        found = found.rename({"global_tid": "globalTid"}).with_columns(_process("globalTid"))
        return _with_neighbours(tables, found).rename({"globalTid": "global_tid"}).select(list(SCHEMA)).sort(
            "global_tid", "start")


def _read(trace: Trace) -> pl.DataFrame | None:
    with load.tables_of(trace) as tables:
        if not {et.MEMCPY_TABLE, et.SYNC_TABLE, et.RUNTIME_TABLE} <= tables.names:
            return None
        copies = _checked(tables, et.MEMCPY_TABLE, tables.integer_rows(et.MEMCPY_TABLE, (
            "correlationId", "globalPid", "copyKind", "srcKind", "dstKind", "bytes", "end")))
        syncs = _checked(tables, et.SYNC_TABLE, tables.integer_rows(et.SYNC_TABLE, ("correlationId", "globalPid")))
        copies = copies.with_columns(_process("globalPid")).rename({"end": "copy_end"})
        syncs = syncs.with_columns(_process("globalPid")).unique(["process", "correlationId"])
        wanted = pl.concat([copies["correlationId"], syncs["correlationId"]]).drop_nulls().unique().to_list()
        if not wanted:
            return pl.DataFrame(schema=_WAIT_SCHEMA)
        calls = _checked(tables, et.RUNTIME_TABLE, tables.integer_rows(et.RUNTIME_TABLE, (
            "correlationId", "globalTid", "start", "end", "nameId"), where=("correlationId", wanted)))
        calls = calls.with_columns(_process("globalTid"))
        names = _names(tables, calls["nameId"])
        calls = calls.join(names.rename({"id": "nameId", "value": "call"}), on="nameId", how="left")
        waited_copies = (copies.join(calls, on=["process", "correlationId"])
                         .filter(pl.col("call").str.contains(et.COPY_WORD, literal=True)
                                 & (pl.col("end") >= pl.col("copy_end"))))
        waited_syncs = (syncs.join(calls, on=["process", "correlationId"])
                        .filter(pl.col("call").str.contains(et.SYNC_WORD, literal=True)))
        waits = pl.concat([
            waited_copies.select("process", "globalTid", "start", "end", "call",
                                 *(_words(c, kinds).alias(name) for c, kinds, name in (
                                       ("copyKind", COPY_KINDS, "copy_kind"), ("srcKind", MEMORY_KINDS, "src_kind"),
                                       ("dstKind", MEMORY_KINDS, "dst_kind"))), "bytes"),
            waited_syncs.select("process", "globalTid", "start", "end", "call",
                                *(pl.lit(None, pl.Utf8).alias(c) for c in ("copy_kind", "src_kind", "dst_kind")),
                                pl.lit(None, pl.Int64).alias("bytes"))])
        waits = waits.with_columns(pl.col("call").str.replace(_VERSION.pattern, ""))
        return waits.rename({"globalTid": "global_tid"}).select(list(_WAIT_SCHEMA)).sort("global_tid", "start")


def _checked(tables: et.Tables, table: str, rows) -> pl.DataFrame:
    """Rows of copies, synchronizations or runtime calls as nsys writes them: no NULL (its columns are NOT NULL), no
    negative byte count, no call that ends before it starts; else the export is damaged, and its waits would be
    counted as copies of -8 bytes or negative host time."""
    frame = pl.from_arrow(rows)
    for column in frame.columns:
        if frame[column].null_count():
            raise et.damaged_values(tables.path, table, "NULL", column)
    if "bytes" in frame.columns and (frame["bytes"] < 0).any():
        raise et.damaged_values(tables.path, table, "negative", "bytes")
    if {"start", "end"} <= set(frame.columns) and (frame["end"] < frame["start"]).any():
        raise KvtraceError(f"{tables.path}: {table} has calls that end before they start: the export is damaged or "
                           "was edited; export the report again")
    return frame


def _words(column: str, words: dict[int, str]) -> pl.Expr:
    """An enum column in words; a value nsys may add later as "kind N"."""
    code = pl.col(column)
    return code.replace_strict(words, default=None, return_dtype=pl.Utf8).fill_null(
        pl.lit("kind ") + code.cast(pl.Utf8))


def _names(tables: et.Tables, ids: pl.Series) -> pl.DataFrame:
    return load.string_frame(tables, ids.drop_nulls().unique().to_list(), "value")


def _process(column: str) -> pl.Expr:
    """The process a globalTid or globalPid belongs to (export_tables.PROCESS_BITS): correlation ids are per
    process."""
    return (pl.col(column) & et.PROCESS_BITS).alias("process")


def _with_neighbours(tables: et.Tables, waits: pl.DataFrame) -> pl.DataFrame:
    """`before` and `after`: the short names of the kernels launched last before and first after each wait on its
    thread (a graph launch's last and first kernel)."""
    threads = waits["globalTid"].unique().to_list()
    launches = pl.from_arrow(tables.integer_rows(et.RUNTIME_TABLE, ("correlationId", "globalTid", "start"),
                                                 where=("nameId", tables.launch_api_ids() or [-1])))
    launches = (launches.filter(pl.col("globalTid").is_in(threads))
                .with_columns(_process("globalTid"))
                .rename({"start": "launch_start"}).sort("launch_start"))
    ordered = waits.sort("start")
    keys = ["globalTid", "process"]
    before = ordered.join_asof(launches, left_on="start", right_on="launch_start", by=keys, strategy="backward",
                              check_sortedness=False)
    after = ordered.join_asof(launches, left_on="start", right_on="launch_start", by=keys, strategy="forward",
                             check_sortedness=False)
    wanted = pl.concat([before["correlationId"], after["correlationId"]]).drop_nulls().unique().to_list()
    kernels = pl.from_arrow(tables.integer_rows(et.KERNEL_TABLE, ("correlationId", "globalPid", "start", "shortName"),
                                                where=("correlationId", wanted or [-1])))
    kernels = kernels.with_columns(_process("globalPid"))
    names = _names(tables, kernels["shortName"]).rename({"id": "shortName", "value": "name"})
    kernels = kernels.join(names, on="shortName", how="left").sort("start")
    last = kernels.group_by("process", "correlationId").agg(pl.col("name").last().alias("before"))
    first = kernels.group_by("process", "correlationId").agg(pl.col("name").first().alias("after"))
    before = before.join(last, on=["process", "correlationId"], how="left", maintain_order="left")["before"]
    after = after.join(first, on=["process", "correlationId"], how="left", maintain_order="left")["after"]
    return ordered.with_columns(before.alias("before"), after.alias("after"))
