"""Loader (analyzer/load.py) on the real H200 exports, checked against SQL run here with sqlite3.

Covers: both export schemas (Nsight Systems 2023.4 / schema 3.7.x and 2025.3 / schema 3.20.x) load;
TraceInfo fields; kernel rows and durations; NVTX ranges and runtime rows; inputs are never written; and
.nsys-rep input exported through the real nsys 2023.4.4 into the cache, including the failure on a 2025.3
report (ProtobufParseException), which must leave no partial SQLite anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sqlite3
import subprocess
from contextlib import closing
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from conftest import (BAD_DIR, FIXTURES, NSYS2023_DIR, NSYS2023_REPORTS, NSYS2025_DIR, REAL_SQLITE, VLLM_DECODE_HEAVY,
                      fingerprint)
from kvtrace.analyzer import load, sqlite_file, sqlite_tables
from kvtrace.analyzer.load import KERNEL_TABLE, open_trace
from kvtrace.analyzer.ranges import NO_RANGE

# Nsight Systems release -> export schema it writes (META_DATA_EXPORT).
SCHEMA_OF_PRODUCT = {"2023.4.": "3.7.", "2025.3.": "3.20."}


def own_sql(path: Path, query: str, *params) -> list[tuple]:
    """Independent read of an export: plain sqlite3, read-only, immutable (no journal, no lock)."""
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro&immutable=1", uri=True)
    try:
        return conn.execute(query, params).fetchall()
    finally:
        conn.close()


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if not p.is_dir())


# ---- .sqlite exports, both schema versions -----------------------------------------------------------

def test_fixtures_cover_both_schema_versions():
    assert NSYS2023_DIR / "fp8.sqlite" in REAL_SQLITE.values()
    assert NSYS2025_DIR / "fp8.sqlite" in REAL_SQLITE.values()
    versions = {open_trace(p).info.schema_version.rsplit(".", 1)[0] for p in REAL_SQLITE.values()}
    assert {"3.7", "3.20"} <= versions


def test_trace_info_matches_export(real_sqlite):
    path = real_sqlite
    info = open_trace(path).info
    product_prefix = next((p for p in SCHEMA_OF_PRODUCT if (info.product_version or "").startswith(p)), None)
    assert product_prefix, f"{path}: unexpected Nsight Systems {info.product_version}"
    schema_prefix = SCHEMA_OF_PRODUCT[product_prefix]
    if path.parent == NSYS2023_DIR:
        assert product_prefix == "2023.4."
    if path.parent == NSYS2025_DIR:
        assert product_prefix == "2025.3."
    meta = dict(own_sql(path, "SELECT name, value FROM META_DATA_EXPORT"))

    assert info.source == str(path) and info.sqlite == str(path)
    assert info.product_version == meta["EXPORT_PRODUCT_VERSION"]
    assert info.product_version.startswith(product_prefix)
    assert info.schema_version == meta["EXPORT_SCHEMA_VERSION"]
    assert info.schema_version.startswith(schema_prefix)

    assert len(info.gpus) == 1
    gpu = info.gpus[0]
    # The H200s and the H100 that recorded the fixtures are all GH100 (fixtures/README.md names each run's GPU).
    [(name, chip)] = own_sql(path, "SELECT name, chipName FROM TARGET_INFO_GPU")
    assert gpu.name == name and chip == "GH100"
    assert gpu.sm_count == 132
    assert gpu.compute_capability == "9.0"
    assert info.gpu_label == gpu.name
    assert info.graph_trace_mode == "Node"

    [(count, first, last)] = own_sql(path, f'SELECT count(*), min(start), max("end") FROM {KERNEL_TABLE}')
    assert count > 0
    assert info.kernel_count == count
    assert (info.first_kernel_ns, info.last_kernel_ns) == (first, last)
    assert info.kernel_span_ns == last - first


def test_kernel_rows_and_durations_match_sql(real_sqlite):
    trace = open_trace(real_sqlite)
    rows = own_sql(real_sqlite, f"""
        SELECT k.start, k."end" - k.start, k.deviceId, d.value, s.value,
               k.gridX, k.gridY, k.gridZ, k.blockX, k.blockY, k.blockZ
        FROM {KERNEL_TABLE} k JOIN StringIds d ON d.id = k.demangledName JOIN StringIds s ON s.id = k.shortName""")
    columns = ["start", "duration", "device_id", "demangled", "short",
               "grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z"]
    expected = pl.DataFrame(rows, schema=columns, orient="row", infer_schema_length=None)

    # Launch configurations travel packed (two or three values per integer): unpacked, they are the table's.
    got = (trace.kernels.join(trace.signatures, on="sig", how="left").select(columns)
           .with_columns(pl.col(c).cast(pl.Int64) for c in columns if c not in ("demangled", "short")))
    assert got.height == trace.info.kernel_count == len(rows)
    assert got["demangled"].null_count() == 0 and got["short"].null_count() == 0
    assert got.sort(columns).equals(expected.sort(columns))
    assert (got["duration"] > 0).all()
    # One signature per distinct (name, launch shape, device).
    assert trace.signatures.height == expected.select(columns[2:]).unique().height
    # The frame is ordered by start, as the loader promises.
    assert trace.kernels["start"].is_sorted()


def test_every_kernel_launch_is_a_launch_call(real_sqlite):
    """The loader reads only runtime rows whose API name contains "Launch": in every real export, each
    kernel's launching call is one of those."""
    apis = own_sql(real_sqlite, f"""
        SELECT DISTINCT s.value FROM CUPTI_ACTIVITY_KIND_RUNTIME r JOIN StringIds s ON s.id = r.nameId
        WHERE r.correlationId IN (SELECT correlationId FROM {KERNEL_TABLE})""")
    assert apis and all("Launch" in api for (api,) in apis)


def _innermost_by_sql(path: Path) -> pl.DataFrame:
    """Each kernel's range: the innermost (latest-starting) range that holds its launch call on the
    launching thread, nsys's projection rule written out in plain SQL."""
    rows = own_sql(path, f"""
        SELECT k.start, k."end" - k.start, d.value, (
            SELECT n.start FROM CUPTI_ACTIVITY_KIND_RUNTIME r
            JOIN NVTX_EVENTS n ON n.globalTid = r.globalTid AND n.start <= r.start AND n."end" >= r."end"
                 AND n.eventType IN (59, 60, 70, 71) AND n.endGlobalTid IS NULL
            WHERE r.correlationId = k.correlationId AND (r.globalTid & 0xFFFFFFFFFF000000) = k.globalPid
            ORDER BY n.start DESC LIMIT 1)
        FROM {KERNEL_TABLE} k JOIN StringIds d ON d.id = k.demangledName""")
    return pl.DataFrame(rows, schema=["start", "duration", "demangled", "range_start"], orient="row")


def _innermost_by_kvtrace(path: Path) -> pl.DataFrame:
    trace = open_trace(path)
    return (trace.kernels.join(trace.signatures.select("sig", "demangled"), on="sig")
            .join(trace.ranges.select("range", pl.col("start").alias("range_start")), on="range", how="left")
            .select("start", "duration", "demangled", "range_start"))


def test_innermost_range_of_each_kernel_matches_sql(real_sqlite):
    expected, got = _innermost_by_sql(real_sqlite), _innermost_by_kvtrace(real_sqlite)
    assert expected["range_start"].null_count() < expected.height  # the fixtures have ranges around launches
    assert got.sort(got.columns).equals(expected.sort(expected.columns))


def _edited_copy(tmp_path: Path, source: Path, *statements: str) -> Path:
    copy = tmp_path / source.name
    shutil.copyfile(source, copy)
    with closing(sqlite3.connect(copy)) as conn:
        for statement in statements:
            conn.execute(statement)
        conn.commit()
    return copy


def test_runtime_rows_out_of_launch_order_project_the_same(tmp_path):
    """Launches from several threads can interleave in the runtime table; the loader then sorts them."""
    source = VLLM_DECODE_HEAVY / "fp8.sqlite"
    shuffled = _edited_copy(
        tmp_path, source,
        "CREATE TABLE shuffled AS SELECT * FROM CUPTI_ACTIVITY_KIND_RUNTIME ORDER BY correlationId % 7, start DESC",
        "DROP TABLE CUPTI_ACTIVITY_KIND_RUNTIME",
        "ALTER TABLE shuffled RENAME TO CUPTI_ACTIVITY_KIND_RUNTIME")
    [(descending,)] = own_sql(shuffled, "SELECT count(*) FROM (SELECT correlationId - lag(correlationId) OVER "
                                        "(ORDER BY rowid) AS step FROM CUPTI_ACTIVITY_KIND_RUNTIME) WHERE step < 0")
    assert descending > 0
    got = _innermost_by_kvtrace(shuffled)
    assert got.sort(got.columns).equals(_innermost_by_kvtrace(source).sort(got.columns))
    assert got.sort(got.columns).equals(_innermost_by_sql(shuffled).sort(got.columns))


def test_interleaved_processes_each_keep_their_own_ranges(tmp_path):
    """Tensor-parallel workers are separate processes whose runtime rows interleave and whose correlation
    ids overlap: here every odd launch, its kernels and a copy of the NVTX ranges move to a second process."""
    source = VLLM_DECODE_HEAVY / "fp8.sqlite"
    other = "+ (1 << 24)"
    split = _edited_copy(
        tmp_path, source,
        f"UPDATE CUPTI_ACTIVITY_KIND_RUNTIME SET globalTid = globalTid {other} WHERE correlationId % 2 = 1",
        f"UPDATE {KERNEL_TABLE} SET globalPid = globalPid {other} WHERE correlationId % 2 = 1",
        "CREATE TABLE moved AS SELECT * FROM NVTX_EVENTS WHERE eventType IN (59, 60, 70, 71)",
        f"UPDATE moved SET globalTid = globalTid {other}",
        "INSERT INTO NVTX_EVENTS SELECT * FROM moved",
        "DROP TABLE moved")
    got = _innermost_by_kvtrace(split)
    assert got.sort(got.columns).equals(_innermost_by_sql(split).sort(got.columns))
    assert got["range_start"].null_count() < got.height


@pytest.mark.slow
def test_unnamed_ranges_and_missing_launch_calls_still_compare(tmp_path, run_kvtrace):
    """A range without a name (nvtxRangePushEx with only a colour) is matched like no range; a trace
    whose launch calls were not traced has no kernel inside a range. Neither stops a diff."""
    source = VLLM_DECODE_HEAVY / "fp8.sqlite"
    unnamed = _edited_copy(tmp_path, source, """
        UPDATE NVTX_EVENTS SET text = NULL, textId = NULL
        WHERE rowid IN (SELECT rowid FROM NVTX_EVENTS WHERE eventType = 59 ORDER BY start LIMIT 1 OFFSET 2)""")
    (tmp_path / "no-launches").mkdir()
    no_launches = _edited_copy(tmp_path / "no-launches", source, "DELETE FROM CUPTI_ACTIVITY_KIND_RUNTIME")
    assert (open_trace(no_launches, cache=False).kernels["range"] == NO_RANGE).all()
    assert open_trace(unnamed, cache=False).ranges["name"].null_count() == 1
    for candidate in (unnamed, no_launches):
        code, out, err = run_kvtrace("diff", source, candidate, "--format", "json")
        assert code == 0, err
        segments = {row["segment"]: row for row in json.loads(out)["segments"]}
        assert segments["decode_attention"]["baseline_calls"] == segments["decode_attention"]["candidate_calls"]


def test_kernels_of_a_process_without_launch_calls_are_outside_every_range(tmp_path):
    """Correlation ids are per process: kernels whose process made no traced launch call (here: the last
    100 kernels moved to another pid) must not borrow another process's ranges."""
    source = VLLM_DECODE_HEAVY / "fp8.sqlite"
    moved = _edited_copy(tmp_path, source, f"""
        UPDATE {KERNEL_TABLE} SET globalPid = globalPid + (1 << 24)
        WHERE rowid IN (SELECT rowid FROM {KERNEL_TABLE} ORDER BY start DESC LIMIT 100)""")
    got = _innermost_by_kvtrace(moved)
    assert got.sort(got.columns).equals(_innermost_by_sql(moved).sort(got.columns))
    assert got.sort("start").tail(100)["range_start"].null_count() == 100


# ---- parallel scan and the calls' layout (analyzer/calls.py) ---------------------------------------------

def test_calls_are_laid_out_cell_by_cell_in_start_order(real_sqlite):
    trace = open_trace(real_sqlite, cache=False)
    calls, kernels = trace.calls, trace.kernels
    cells = calls.cells
    # One cell per (signature, innermost range name), in that order; a cell's calls are contiguous.
    assert cells.select("sig", "name").is_unique().all()
    assert cells.select("sig", "name").equals(cells.select("sig", "name").sort("sig", "name"))
    assert np.diff(calls.offsets).tolist() == cells["calls"].to_list() and calls.count == kernels.height
    assert calls.duration.dtype == np.uint32 and calls.rank.dtype == np.uint32
    assert sorted(calls.rank.tolist()) == list(range(calls.count))  # every call once
    assert np.all(np.diff(calls.start) >= 0)
    names = {name: code for code, name in enumerate(trace.range_names)}
    name_of_range = [names.get(n, len(names)) for n in trace.ranges["name"].to_list()] + [len(names)]
    by_rank = kernels.with_columns(pl.int_range(pl.len()).alias("rank"))
    for cell, sig, name, count, total, first in cells.iter_rows():
        span = slice(calls.offsets[cell], calls.offsets[cell + 1])
        ranks = calls.rank[span].astype(np.int64)
        assert np.all(np.diff(ranks) > 0) and first == ranks[0]  # start order within the cell
        rows = by_rank[ranks]
        assert (rows["sig"] == sig).all() and rows["duration"].to_list() == calls.duration[span].tolist()
        assert rows["range"].to_list() == calls.range[span].tolist()
        assert {name_of_range[r] for r in rows["range"].to_list()} == {name} and total == rows["duration"].sum()


def _same_calls(a, b) -> None:
    assert a.info == b.info and a.signatures.equals(b.signatures) and a.ranges.equals(b.ranges)
    assert a.calls.cells.equals(b.calls.cells) and a.kernels.equals(b.kernels)
    for name in ("offsets", "duration", "rank", "range", "start"):
        assert np.array_equal(getattr(a.calls, name), getattr(b.calls, name)), name


@pytest.mark.parametrize("workers", [1, 3])
def test_a_trace_read_in_many_rowid_ranges_and_spilled_loads_the_same(workers, tmp_path, monkeypatch):
    """Small rowid ranges over several connections (threads), chunks spilled to files and laid out a few rows
    at a time give the same trace as one range read in memory; rowids with gaps included."""
    source = VLLM_DECODE_HEAVY / "fp8.sqlite"
    gaps = _edited_copy(tmp_path, source, f"DELETE FROM {KERNEL_TABLE} WHERE rowid % 97 = 0",
                        "DELETE FROM CUPTI_ACTIVITY_KIND_RUNTIME WHERE rowid % 89 = 0 AND correlationId NOT IN "
                        f"(SELECT correlationId FROM {KERNEL_TABLE})")
    whole = open_trace(gaps, cache=False)
    assert whole.info.kernel_count == own_sql(gaps, f"SELECT count(*) FROM {KERNEL_TABLE}")[0][0]
    monkeypatch.setattr(sqlite_tables, "CHUNK_ROWS", 700)
    monkeypatch.setattr(load.export_tables, "workers", lambda: workers)
    monkeypatch.setattr(load.calls_, "HELD_BYTES", 3 * 700 * 20)  # three chunks in memory, the rest on disk
    monkeypatch.setattr(load.calls_, "BLOCK_ROWS", 256)
    [(rowids,)] = own_sql(gaps, f"SELECT max(rowid) - min(rowid) + 1 FROM {KERNEL_TABLE}")
    tables = sqlite_tables.SqliteTables(gaps)
    assert len(tables.spans(KERNEL_TABLE)) == min(4 * workers, -(-rowids // 700)) > 1
    tables.close()
    _same_calls(open_trace(gaps, cache=False), whole)


def test_kernel_rows_out_of_start_order_load_in_start_order(tmp_path, monkeypatch):
    """Traces of several GPUs can list kernels out of start order: they are sorted while laid out."""
    source = VLLM_DECODE_HEAVY / "fp8.sqlite"
    shuffled = _edited_copy(
        tmp_path, source,
        f"CREATE TABLE shuffled AS SELECT * FROM {KERNEL_TABLE} ORDER BY (rowid * 7919) % 1009, rowid",
        f"DROP TABLE {KERNEL_TABLE}", f"ALTER TABLE shuffled RENAME TO {KERNEL_TABLE}")
    [(descending,)] = own_sql(shuffled, f"SELECT count(*) FROM (SELECT start - lag(start) OVER (ORDER BY rowid) "
                                        f"AS step FROM {KERNEL_TABLE}) WHERE step < 0")
    assert descending > 0
    monkeypatch.setattr(sqlite_tables, "CHUNK_ROWS", 1000)
    monkeypatch.setattr(load.calls_, "HELD_BYTES", 0)
    got, expected = open_trace(shuffled, cache=False), open_trace(source, cache=False)
    assert got.kernels["start"].is_sorted()
    assert got.info == dataclasses.replace(expected.info, source=str(shuffled), sqlite=str(shuffled))

    def named(trace):  # signatures are numbered by first appearance in the table, which moved
        return trace.kernels.join(trace.signatures.select("sig", "demangled", "grid_x", "block_x"), on="sig") \
            .drop("sig")

    assert named(got).equals(named(expected))
    assert got.calls.cells.height == expected.calls.cells.height


def test_kernels_of_4_3_s_and_more_keep_their_duration(tmp_path, monkeypatch, run_kvtrace):
    """Durations are kept as uint32 ns; a kernel of 2^32 ns or more makes them int64, exactly, whether the
    chunk was held in memory or spilled."""
    source = NSYS2025_DIR / "fp8.sqlite"
    long = _edited_copy(tmp_path, source, f'UPDATE {KERNEL_TABLE} SET "end" = start + 5000000007 WHERE rowid = 7')
    [(start,)] = own_sql(long, f"SELECT start FROM {KERNEL_TABLE} WHERE rowid = 7")
    for held in (load.calls_.HELD_BYTES, 0):
        monkeypatch.setattr(load.calls_, "HELD_BYTES", held)
        trace = open_trace(long, cache=False)
        assert trace.calls.duration.dtype == np.int64
        assert trace.kernels.filter(pl.col("start") == start)["duration"].to_list() == [5000000007]
        assert trace.info.last_kernel_ns >= start + 5000000007
    code, out, err = run_kvtrace("summary", long, "--format", "json")
    assert code == 0, err


def test_no_cache_lays_the_calls_out_in_a_folder_removed_at_once(tmp_path, monkeypatch):
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(load.tempfile, "tempdir", str(temporary))
    trace = open_trace(VLLM_DECODE_HEAVY / "auto.sqlite", cache=False)
    assert list(temporary.iterdir()) == []
    assert trace.calls.maps and int(trace.calls.duration.sum()) == trace.kernels["duration"].sum()


def test_nvtx_ranges_load(real_sqlite):
    trace = open_trace(real_sqlite)
    ranges = trace.ranges
    # Independent: closed push/pop and start/end ranges that ended on their own thread; the fixtures use
    # the default domain (domainId 0), so the name is the range text itself.
    rows = own_sql(real_sqlite, """
        SELECT e.start, e."end", COALESCE(s.value, e.text), e.globalTid, (
            SELECT count(*) FROM NVTX_EVENTS o WHERE o.globalTid = e.globalTid AND o.rowid != e.rowid
                   AND o.eventType IN (59, 60, 70, 71) AND o.endGlobalTid IS NULL
                   AND o.start <= e.start AND o."end" >= e."end")
        FROM NVTX_EVENTS e
        LEFT JOIN StringIds s ON s.id = e.textId
        WHERE e.eventType IN (59, 60, 70, 71) AND e."end" IS NOT NULL AND e.endGlobalTid IS NULL""")
    assert ranges.columns == ["range", "name", "start", "end", "global_tid", "depth", "parent", "calls"]
    assert ranges.height == len(rows) > 0
    # calls: the kernels whose launch call has it as the innermost range
    launched = trace.kernels.filter(pl.col("range") != NO_RANGE)["range"].to_numpy()
    assert ranges["calls"].to_list() == np.bincount(launched, minlength=ranges.height).tolist()
    # depth = the number of ranges around it on its thread
    assert sorted(zip(ranges["start"], ranges["end"], ranges["name"], ranges["global_tid"], ranges["depth"])) \
        == sorted(rows)
    parents = ranges.join(ranges.select(pl.col("range").alias("parent"), pl.col("start").alias("p_start"),
                                        pl.col("end").alias("p_end"), pl.col("depth").alias("p_depth")), on="parent")
    assert parents.height == ranges.filter(pl.col("depth") > 0).height
    assert (ranges.filter(pl.col("depth") == 0)["parent"] == NO_RANGE).all()
    assert ((parents["p_start"] <= parents["start"]) & (parents["p_end"] >= parents["end"])
            & (parents["p_depth"] == parents["depth"] - 1)).all()
    if real_sqlite.parent.name.startswith("vllm-"):
        # vLLM's per-step ranges (profiler "cuda"): execute_context_N(T)_generation_M(G), inside the
        # offline workload's own range around the measured generate().
        names = set(ranges["name"])
        assert any(name.startswith("execute_context_") for name in names)
        assert all(name.startswith(("execute_context_", "kvtrace:")) for name in names)
    else:
        phases = {name.split(" ")[0] for name in ranges["name"]}
        assert {"kvtrace:prefill", "kvtrace:decode", "kvtrace:append", "kvtrace:gemm"} <= phases


# ---- trace cache ----------------------------------------------------------------------------------------

def _same_trace(a, b) -> bool:
    return (a.info == b.info and a.kernels.equals(b.kernels) and a.signatures.equals(b.signatures)
            and a.ranges.equals(b.ranges))


def _entries(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in (cache_dir / "traces").iterdir())


def test_second_load_comes_from_the_cache_and_equals_a_fresh_load(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("KVTRACE_CACHE_DIR", str(cache_dir))
    export = tmp_path / "fp8.sqlite"
    shutil.copy2(VLLM_DECODE_HEAVY / "fp8.sqlite", export)
    first = open_trace(export)
    assert len(_entries(cache_dir)) == 1

    def no_sqlite_reads(*args, **kwargs):
        raise AssertionError("the cached trace should not read the export's tables")

    with monkeypatch.context() as patched:
        patched.setattr(load, "read_kernels", no_sqlite_reads)
        patched.setattr(load, "read_launches", no_sqlite_reads)
        cached = open_trace(export)
    assert _same_trace(cached, first)
    assert _same_trace(open_trace(export, cache=False), first)


def test_a_cached_trace_read_through_another_relative_path_reads_its_tables_there(tmp_path, cache_dir, monkeypatch):
    """The entry was written by a run in the export's own folder (`fp8.sqlite`); a later run from the folder above
    (`run/fp8.sqlite`) reads the host waits from the export's tables, through the path it was given. Seen on the H100
    matrix: `kvtrace diff` inside a run directory, then `kvtrace matrix` from above, failed on the stale path."""
    from kvtrace.analyzer import host_waits

    monkeypatch.setenv("KVTRACE_CACHE_DIR", str(cache_dir))
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy2(VLLM_DECODE_HEAVY / "fp8.sqlite", run / "fp8.sqlite")
    monkeypatch.chdir(run)
    waits = host_waits.host_waits(open_trace("fp8.sqlite"))
    monkeypatch.chdir(tmp_path)
    cached = open_trace(Path("run") / "fp8.sqlite")
    assert len(_entries(cache_dir)) == 1
    assert (cached.info.source, cached.info.sqlite) == (str(Path("run") / "fp8.sqlite"),) * 2
    assert host_waits.host_waits(cached).equals(waits)


def test_a_changed_export_is_read_again_and_replaces_its_entry(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("KVTRACE_CACHE_DIR", str(cache_dir))
    export = tmp_path / "auto.sqlite"
    shutil.copyfile(VLLM_DECODE_HEAVY / "auto.sqlite", export)  # bytes only: the unpacked fixtures are read-only
    open_trace(export)
    before = _entries(cache_dir)
    # Re-exported in place: other contents under the same name.
    shutil.copyfile(VLLM_DECODE_HEAVY / "fp8.sqlite", export)
    again = open_trace(export)
    assert again.info.kernel_count == open_trace(VLLM_DECODE_HEAVY / "fp8.sqlite",
                                                 cache=False).info.kernel_count
    after = _entries(cache_dir)
    assert len(after) == 1 and after != before


def test_an_unreadable_entry_is_written_again(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("KVTRACE_CACHE_DIR", str(cache_dir))
    export = tmp_path / "fp8.sqlite"
    shutil.copy2(NSYS2025_DIR / "fp8.sqlite", export)
    fresh = open_trace(export)
    [entry] = (cache_dir / "traces").iterdir()
    # Replaced, not truncated in place: `fresh` maps the old file.
    (entry / "damaged").write_bytes(b"not npy")
    os.replace(entry / "damaged", entry / "duration.npy")
    assert _same_trace(open_trace(export), fresh)
    assert _same_trace(open_trace(export), fresh)  # from the rewritten entry


def test_no_cache_leaves_the_cache_empty(cache_dir, run_kvtrace, good_sqlite):
    code, out, err = run_kvtrace("diff", good_sqlite, good_sqlite, "--no-cache", "--format", "json")
    assert code == 0, err
    assert files_under(cache_dir) == []
    code, out, err = run_kvtrace("diff", good_sqlite, good_sqlite, "--format", "json")
    assert code == 0, err
    assert len(_entries(cache_dir)) == 1  # one export, one entry


# ---- read-only -------------------------------------------------------------------------------------------

def test_loading_never_writes_to_the_input(real_sqlite, run_kvtrace):
    """The committed fixture itself: same bytes and mtime, and no -journal/-wal/-shm beside it."""
    before, folder_before = fingerprint(real_sqlite), listing(real_sqlite.parent)
    trace = open_trace(real_sqlite)
    code, out, err = run_kvtrace("summary", real_sqlite, "--format", "json")
    assert code == 0, err
    assert json.loads(out)["arm"]["info"]["kernel_count"] == trace.info.kernel_count
    assert fingerprint(real_sqlite) == before
    assert listing(real_sqlite.parent) == folder_before
    assert not [n for n in listing(real_sqlite.parent) if n.endswith(("-journal", "-wal", "-shm"))]


def test_read_only_copy_loads_and_stays_unchanged(real_sqlite, tmp_path, run_kvtrace):
    """A copy with mode 0444 in a folder of its own: loads, and nothing is created next to it."""
    folder = tmp_path / "in"
    folder.mkdir()
    copy = folder / real_sqlite.name
    shutil.copy2(real_sqlite, copy)
    copy.chmod(0o444)
    before = fingerprint(copy)
    code, out, err = run_kvtrace("diff", copy, copy, "--format", "json", "--label", "a", "--label", "b")
    assert code == 0, err
    assert json.loads(out)["baseline"]["info"]["sqlite"] == copy.name  # reports name files, no paths
    assert open_trace(copy).info.kernel_count > 0
    assert fingerprint(copy) == before
    assert listing(folder) == [copy.name]


# ---- .nsys-rep ---------------------------------------------------------------------------------------

def _kernel_totals(kernels_json: str) -> dict[str, tuple[int, int]]:
    rows = json.loads(kernels_json)["rows"]
    return {row["demangled"]: (row["calls"], row["total_ns"]) for row in rows}


@pytest.mark.parametrize("name", ["fp8", "nvfp4"])
def test_nsys_rep_2023_exports_through_nsys_into_cache(name, nsys, tmp_path, cache_dir, run_kvtrace, monkeypatch):
    """A 2023.4 report alone in its folder (no sibling .sqlite): exported by the real nsys into the cache."""
    report_src = NSYS2023_REPORTS / f"{name}.nsys-rep"
    folder = tmp_path / "in"
    folder.mkdir()
    report = folder / report_src.name
    shutil.copy2(report_src, report)
    before = fingerprint(report)

    code, out, err = run_kvtrace("kernels", report, "--format", "json", env={"NSYS": nsys})
    assert code == 0, err
    info = json.loads(out)["arm"]["info"]
    exported = cache_dir / "exports" / info["sqlite"]  # reports name files, no paths
    assert info["source"] == report.name
    assert exported.is_file()
    assert info["product_version"].startswith("2023.4.4")
    # Only the complete export is left in the cache: no hidden temporary/partial files.
    assert files_under(cache_dir / "exports") == [exported, exported.with_name(exported.name + ".json")]  # and its seal
    # Nothing written beside the report, and the report itself untouched.
    assert listing(folder) == [report.name]
    assert fingerprint(report) == before

    # Same kernel totals as the committed .sqlite export of the same report.
    code, committed_out, err = run_kvtrace("kernels", NSYS2023_DIR / f"{name}.sqlite", "--format", "json")
    assert code == 0, err
    assert _kernel_totals(out) == _kernel_totals(committed_out)
    assert info["kernel_count"] == json.loads(committed_out)["arm"]["info"]["kernel_count"]

    # Second load reuses the cached export (same path, no new files).
    code, again, err = run_kvtrace("kernels", report, "--format", "json", env={"NSYS": nsys})
    assert code == 0, err
    assert json.loads(again)["arm"]["info"]["sqlite"] == exported.name
    assert files_under(cache_dir / "exports") == [exported, exported.with_name(exported.name + ".json")]  # and its seal

    # In-process: identical per-launch rows to the committed export.
    monkeypatch.setenv("KVTRACE_CACHE_DIR", str(cache_dir))
    from_report = open_trace(report, nsys=nsys)
    from_sqlite = open_trace(NSYS2023_DIR / f"{name}.sqlite")

    def rows(trace):
        named = trace.kernels.join(trace.signatures, on="sig")
        return named.select("start", "duration", "demangled", "grid_x", "block_x", "range").sort(
            "start", "demangled", "grid_x")

    assert rows(from_report).equals(rows(from_sqlite))


@pytest.mark.parametrize("name", ["fp8", "nvfp4"])
@pytest.mark.parametrize("command", ["summary", "diff"])
def test_nsys_rep_2025_with_nsys2023_is_one_line_and_leaves_nothing(name, command, nsys, tmp_path, cache_dir,
                                                                     run_kvtrace, good_sqlite):
    """nsys 2023.4.4 cannot parse a 2025.3 report (ProtobufParseException, exit 1, partial SQLite):
    kvtrace explains it in one line, exits 2, and removes the partial export."""
    folder = tmp_path / "in"
    folder.mkdir()
    report = folder / f"{name}-nsys2025.3.nsys-rep"
    shutil.copy2(NSYS2025_DIR / f"{name}.nsys-rep", report)
    before = fingerprint(report)
    args = ["summary", report] if command == "summary" else ["diff", report, good_sqlite]

    code, out, err = run_kvtrace(*args, env={"NSYS": nsys})
    assert code == 2
    assert out == ""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("kvtrace: error: ")
    assert str(report) in line
    assert "2023.4.4" in line  # which nsys failed
    assert "newer Nsight Systems" in line  # why: the report is from a newer version
    assert "nsys export --type sqlite" in line and "NSYS" in line  # what to do
    # No partial SQLite anywhere: not in the export cache, not beside the report. (The diff's good arm,
    # loaded alongside, may be in the trace cache.)
    assert files_under(cache_dir / "exports") == []
    assert listing(folder) == [report.name]
    assert fingerprint(report) == before


def test_committed_partial_export_is_what_nsys2023_writes(nsys, tmp_path):
    """fixtures/bad/partial-export-nsys2023-of-2025.3.sqlite is the real thing: re-running the same export
    today fails the same way and leaves a file with the same tables (StringIds, ProcessStreams)."""
    report = tmp_path / "nvfp4-nsys2025.3.nsys-rep"
    shutil.copy2(NSYS2025_DIR / "nvfp4.nsys-rep", report)
    output = tmp_path / "partial.sqlite"
    result = subprocess.run([nsys, "export", "--type=sqlite", f"--output={output}", str(report)],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode != 0
    assert "ProtobufParseException" in result.stdout + result.stderr
    assert output.exists(), "nsys 2023.4.4 no longer leaves a partial export: update fixtures/bad/README.md"

    def tables(path):
        return sorted(n for (n,) in own_sql(path, "SELECT name FROM sqlite_master WHERE type = 'table'"))

    committed = BAD_DIR / "partial-export-nsys2023-of-2025.3.sqlite"
    assert tables(output) == tables(committed) == ["ProcessStreams", "StringIds"]


def test_nsys_rep_with_newer_sibling_sqlite_uses_it_without_nsys(tmp_path, run_kvtrace):
    """A sibling <report>.sqlite newer than the report is used as is (as `nsys recipe` does), so a 2025.3
    report works with no nsys at all when its export sits beside it."""
    folder = tmp_path / "in"
    folder.mkdir()
    report, sibling = folder / "fp8.nsys-rep", folder / "fp8.sqlite"
    shutil.copy2(NSYS2025_DIR / "fp8.nsys-rep", report)
    shutil.copy2(NSYS2025_DIR / "fp8.sqlite", sibling)
    stamp = report.stat().st_mtime_ns
    os.utime(sibling, ns=(stamp + 10**9, stamp + 10**9))
    code, out, err = run_kvtrace("summary", report, "--format", "json",
                                 env={"NSYS": str(tmp_path / "no-nsys-here"), "PATH": os.defpath})
    assert code == 0, err
    info = json.loads(out)["arm"]["info"]
    assert info["sqlite"] == sibling.name
    assert info["product_version"].startswith("2025.3")
    assert listing(folder) == ["fp8.nsys-rep", "fp8.sqlite"]
