"""Nsight Systems Parquet exports (`nsys export --type parquetdir`, issue 24) load to the same trace as the SQLite
export of the same report, on the real 2025.3 exports of fixtures/fi-h200-sm90 and of the CUDA-graph loop
(fixtures/graph-loop-h200); hostile folders are refused in one line; an .nsys-rep goes to Parquet where nsys
gives an exact one and to SQLite, with one note, where it does not (the CI's 2023.4.4).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
from contextlib import closing
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import (GRAPH_LOOP, NSYS2023_DIR, NSYS2023_REPORTS, NSYS2025_DIR, PARQUET_2025, exports_in,
                      fingerprint)
from test_bad_input import assert_one_line_error
import kvtrace.nsys
from kvtrace.analyzer import load, parquet_tables
from kvtrace.analyzer.export_tables import EXPORT_TABLES
from kvtrace.analyzer.load import open_trace

# (Parquet folder, SQLite export of the same report), both by Nsight Systems 2025.3.
PAIRS = {"fi-fp8": (PARQUET_2025 / "fp8", NSYS2025_DIR / "fp8.sqlite"),
         "fi-nvfp4": (PARQUET_2025 / "nvfp4", NSYS2025_DIR / "nvfp4.sqlite"),
         "graph-a": (GRAPH_LOOP / "a-2000", GRAPH_LOOP / "a-2000.sqlite"),
         "graph-b": (GRAPH_LOOP / "b-2000", GRAPH_LOOP / "b-2000.sqlite")}
KERNEL = "CUPTI_ACTIVITY_KIND_KERNEL.parquet"


def _per_cell(trace: load.Trace) -> dict[tuple, tuple[int, int]]:
    """(demangled, short, grid, block, device, innermost range name) -> (calls, total ns), from the layout."""
    names = (*trace.range_names, None)
    cells = trace.calls.cells.join(trace.signatures, on="sig")
    return {(row["demangled"], row["short"], row["grid_x"], row["grid_y"], row["grid_z"], row["block_x"],
             row["block_y"], row["block_z"], row["device_id"], names[row["name"]]): (row["calls"], row["total_ns"])
            for row in cells.to_dicts()}


def _sql_totals(path: Path) -> dict[str, tuple[int, int]]:
    """Demangled name -> (calls, total ns), by SQL on the SQLite export."""
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        rows = conn.execute('SELECT s.value, count(*), sum(k."end" - k.start) FROM CUPTI_ACTIVITY_KIND_KERNEL k '
                            "JOIN StringIds s ON s.id = k.demangledName GROUP BY s.value").fetchall()
    return {name: (calls, total) for name, calls, total in rows}


def _polars_totals(folder: Path) -> dict[str, tuple[int, int]]:
    """The same by polars on the Parquet files, without kvtrace."""
    kernels = pl.read_parquet(folder / KERNEL).with_columns(pl.col("demangledName").cast(pl.Int64))
    strings = pl.read_parquet(folder / "StringIds.parquet").with_columns(pl.col("id").cast(pl.Int64))
    totals = kernels.join(strings, left_on="demangledName", right_on="id").group_by("value").agg(
        pl.len().alias("calls"), (pl.col("end") - pl.col("start")).sum().alias("total"))
    return {row["value"]: (row["calls"], row["total"]) for row in totals.to_dicts()}


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_parquet_loads_the_same_trace_as_sqlite(pair):
    parquet, sqlite = PAIRS[pair]
    before = {p.name: fingerprint(p) for p in parquet.iterdir()}
    through_parquet, through_sqlite = open_trace(parquet, cache=False), open_trace(sqlite, cache=False)

    assert _per_cell(through_parquet) == _per_cell(through_sqlite)
    assert sum(calls for calls, _ in _per_cell(through_parquet).values()) == through_sqlite.info.kernel_count > 0
    per_kernel = {}
    for (demangled, *_), (calls, total) in _per_cell(through_parquet).items():
        had = per_kernel.get(demangled, (0, 0))
        per_kernel[demangled] = (had[0] + calls, had[1] + total)
    assert per_kernel == _sql_totals(sqlite) == _polars_totals(parquet)
    # Call by call, range by range, and the trace's info (META_DATA_CAPTURE, GPU, driver, versions) alike.
    assert through_parquet.kernels.equals(through_sqlite.kernels)
    assert through_parquet.signatures.equals(through_sqlite.signatures)
    assert through_parquet.ranges.equals(through_sqlite.ranges)
    skip = {"source", "sqlite"}
    info = {k: v for k, v in vars(through_parquet.info).items() if k not in skip}
    assert info == {k: v for k, v in vars(through_sqlite.info).items() if k not in skip}
    assert info["graph_trace_mode"] == "Node" and info["capture_trigger"] and info["product_version"] == "2025.3.2.0"
    assert {p.name: fingerprint(p) for p in parquet.iterdir()} == before


def test_graph_loop_ranges_carry_the_graph_nodes():
    """The loop's kernels are CUDA graph nodes launched by cudaGraphLaunch inside step_N ranges: every one is tied
    to its step through the runtime table, in Parquet as in SQLite."""
    trace = open_trace(GRAPH_LOOP / "a-2000", cache=False)
    assert trace.info.kernel_count == 2000
    assert set(trace.range_names) == {f"step_{i}" for i in range(8)}
    assert (trace.kernels["range"] >= 0).all()
    assert trace.ranges["calls"].to_list() == [250] * 8


@pytest.mark.parametrize("run", ["fi", "graph"])
def test_diff_of_parquet_pair_prints_the_sqlite_pairs_table(run, run_kvtrace):
    a, b = ("fi-fp8", "fi-nvfp4") if run == "fi" else ("graph-a", "graph-b")
    outputs = []
    for side in (0, 1):
        code, out, err = run_kvtrace("diff", PAIRS[a][side], PAIRS[b][side])
        assert code == 0 and err == "", err
        outputs.append(out)
    assert outputs[0] == outputs[1] and "Segments" in outputs[0]


def test_cached_parquet_trace_is_the_same_and_a_rewritten_file_is_another_entry(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("KVTRACE_CACHE_DIR", str(cache_dir))
    folder = _copy(tmp_path, PARQUET_2025 / "nvfp4")
    first = open_trace(folder)
    again = open_trace(folder)  # from the cache entry
    assert again.kernels.equals(first.kernels) and again.info == first.info
    (entry,) = (cache_dir / "traces").iterdir()
    # A file rewritten in place leaves the folder's times alone: its own identity makes it another entry.
    table = pq.read_table(folder / KERNEL)
    ends = table.column("end").to_numpy() + 1
    pq.write_table(table.set_column(table.schema.get_field_index("end"), "end", pa.array(ends)), folder / KERNEL)
    changed = open_trace(folder)
    assert changed.calls.cells["total_ns"].sum() == first.calls.cells["total_ns"].sum() + first.info.kernel_count
    assert entry not in (cache_dir / "traces").iterdir()


def test_tables_in_many_row_groups_load_the_same(tmp_path, monkeypatch):
    """Each row group is a span read on its own thread (nsys writes groups of about a million rows): small groups
    on several threads give the same trace as the one group nsys wrote for this small report."""
    folder = _copy(tmp_path, PARQUET_2025 / "fp8")
    for table in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME"):
        path = folder / f"{table}.parquet"
        pq.write_table(pq.read_table(path), path, row_group_size=300)
    assert pq.read_metadata(folder / KERNEL).num_row_groups == 7
    monkeypatch.setattr(load.export_tables, "workers", lambda: 3)
    got, expected = open_trace(folder, cache=False), open_trace(NSYS2025_DIR / "fp8.sqlite", cache=False)
    assert got.kernels.equals(expected.kernels) and got.signatures.equals(expected.signatures)
    assert got.ranges.equals(expected.ranges)


def test_graph_launches_are_found_without_reading_the_runtime_table_past_the_first(tmp_path, monkeypatch):
    """As the SQLite reader's LIMIT 1: the runtime table is read span by span only until a span holds a graph
    launch. The graph loop's runtime table in one-row groups, each its own span: its first cudaGraphLaunch is the
    third call, so three spans are read of eighteen."""
    folder = _copy(tmp_path, GRAPH_LOOP / "a-2000")
    runtime = folder / "CUPTI_ACTIVITY_KIND_RUNTIME.parquet"
    pq.write_table(pq.read_table(runtime), runtime, row_group_size=1)
    strings = pq.read_table(folder / "StringIds.parquet").to_pylist()
    graph_ids = {s["id"] for s in strings if "GraphLaunch" in s["value"]}
    names = pq.read_table(runtime, columns=["nameId"]).column("nameId").to_pylist()
    first = next(i for i, name in enumerate(names) if name in graph_ids)
    assert (first, len(names)) == (2, 18)
    monkeypatch.setattr(parquet_tables, "_SPAN_ROWS", 1)
    read = []
    tables = parquet_tables.ParquetTables(folder)
    group = tables._group
    monkeypatch.setattr(tables, "_group", lambda table, span, columns: read.append(span) or group(table, span, columns))
    assert tables.graph_launched() is True
    assert read == [(row, row) for row in range(first + 1)]


# ---- hostile folders ------------------------------------------------------------------------------------

def _copy(tmp_path: Path, source: Path) -> Path:
    folder = tmp_path / source.name
    folder.mkdir()
    for path in source.iterdir():
        shutil.copyfile(path, folder / path.name)
    return folder


def _rewrite(folder: Path, table: str, change) -> None:
    path = folder / f"{table}.parquet"
    pq.write_table(change(pq.read_table(path)), path)


def _set(table: pa.Table, column: str, values) -> pa.Table:
    return table.set_column(table.schema.get_field_index(column), column, values)


def _first_null(table: pa.Table, column: str) -> pa.Table:
    values = table.column(column).to_pylist()
    return _set(table, column, pa.array([None, *values[1:]], type=table.schema.field(column).type))


def _truncate(folder: Path, name: str) -> None:
    path = folder / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


HOSTILE = {
    "no-kernel-table": (lambda f: (f / KERNEL).unlink(), r"no CUDA kernel records", r"nsys profile -t cuda"),
    "no-export-metadata": (lambda f: (f / "META_DATA_EXPORT.parquet").unlink(), r"partial .*Parquet export",
                           r"nsys export --type parquetdir --tables=CUPTI_ACTIVITY_KIND_KERNEL,"),
    "kernel-column-missing": (lambda f: _rewrite(f, "CUPTI_ACTIVITY_KIND_KERNEL", lambda t: t.drop(["shortName"])),
                              r"kernel table lacks shortName", r"re-export"),
    "start-as-text": (lambda f: _rewrite(f, "CUPTI_ACTIVITY_KIND_KERNEL", lambda t: _set(
        t, "start", pa.array([str(v) for v in t.column("start").to_pylist()]))), r"string \(not integer\) values in start",
        r"export the report again"),
    "end-null": (lambda f: _rewrite(f, "CUPTI_ACTIVITY_KIND_KERNEL", lambda t: _first_null(t, "end")),
                 r"NULL values in end", r"export the report again"),
    "grid-as-text": (lambda f: _rewrite(f, "CUPTI_ACTIVITY_KIND_KERNEL", lambda t: _set(
        t, "gridX", pa.array([str(v) for v in t.column("gridX").to_pylist()]))), r"values in gridX, gridY or gridZ",
        r"export the report again"),
    "grid-past-its-bits": (lambda f: _rewrite(f, "CUPTI_ACTIVITY_KIND_KERNEL", lambda t: _set(
        t, "gridY", pa.array([70000] * t.num_rows, pa.int32()))), r"NULL values in gridX, gridY or gridZ .*past",
        r"export the report again"),
    "end-before-start": (lambda f: _rewrite(f, "CUPTI_ACTIVITY_KIND_KERNEL", lambda t: _set(
        t, "end", t.column("start"))), r"do not end after they start", r"export the report again"),
    "dangling-name": (lambda f: _rewrite(f, "CUPTI_ACTIVITY_KIND_KERNEL", lambda t: _set(
        t, "demangledName", pa.array([987654] * t.num_rows, pa.uint64()))), r"string ids that StringIds lacks "
        r"\(987654\)", r"export the report again"),
    "nvtx-text-as-integer": (lambda f: _rewrite(f, "NVTX_EVENTS", lambda t: _set(
        t, "text", pa.array(range(t.num_rows), pa.int64()))), r"NVTX_EVENTS has Int64 \(not text\) values in text",
        r"export the report again"),
    "runtime-column-missing": (lambda f: _rewrite(f, "CUPTI_ACTIVITY_KIND_RUNTIME", lambda t: t.drop(["nameId"])),
                               r"CUPTI_ACTIVITY_KIND_RUNTIME\.parquet lacks column nameId", r"export the report again"),
    "launch-null": (lambda f: _rewrite(f, "CUPTI_ACTIVITY_KIND_RUNTIME", lambda t: _set(
        t, "globalTid", pa.nulls(t.num_rows, pa.uint64()))), r"NULL values in globalTid", r"export the report again"),
    "truncated-kernels": (lambda f: _truncate(f, KERNEL), r"damaged", r"copy or export it again"),
    "truncated-strings": (lambda f: _truncate(f, "StringIds.parquet"), r"damaged", r"copy or export it again"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_parquet_folder_is_refused_in_one_line(kind, tmp_path, run_kvtrace):
    folder = _copy(tmp_path, PARQUET_2025 / "fp8")
    make, problem, fix = HOSTILE[kind]
    make(folder)
    before = {p.name: fingerprint(p) for p in folder.iterdir()}
    code, out, err = run_kvtrace("summary", folder)
    assert_one_line_error(code, out, err, str(folder), problem, fix)
    assert {p.name: fingerprint(p) for p in folder.iterdir()} == before


def test_a_folder_that_is_no_parquet_export_is_refused(tmp_path, run_kvtrace):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "KERNELS.parquet").write_bytes(b"PAR1")
    code, out, err = run_kvtrace("diff", folder, PARQUET_2025 / "nvfp4")
    assert_one_line_error(code, out, err, str(folder), r"not an Nsight Systems Parquet export \(no StringIds\.parquet\)",
                          r"nsys export --type parquetdir")


def test_a_fifo_or_a_dangling_link_in_the_folder_is_refused(tmp_path, run_kvtrace):
    folder = _copy(tmp_path, PARQUET_2025 / "fp8")
    (folder / "NVTX_EVENTS.parquet").unlink()
    os.mkfifo(folder / "NVTX_EVENTS.parquet")
    code, out, err = run_kvtrace("summary", folder)
    assert_one_line_error(code, out, err, "NVTX_EVENTS.parquet is not a regular file", None, r"export the folder again")
    (folder / "NVTX_EVENTS.parquet").unlink()
    (folder / "NVTX_EVENTS.parquet").symlink_to(tmp_path / "gone.parquet")
    code, out, err = run_kvtrace("summary", folder)
    assert_one_line_error(code, out, err, "cannot read", r"no such file", r"export the folder again")


# ---- the .nsys-rep path ---------------------------------------------------------------------------------

def test_ci_nsys_2023_falls_back_to_sqlite_in_one_line_with_the_same_answer(nsys, tmp_path, cache_dir, run_kvtrace):
    """2023.4.4's Parquet lacks META_DATA_CAPTURE: its reports go to SQLite, one note says so for both, and the diff is
    the one of the committed SQLite exports of the same reports."""
    folder = tmp_path / "in"
    folder.mkdir()
    reports = [folder / f"{arm}.nsys-rep" for arm in ("fp8", "nvfp4")]
    for report in reports:
        shutil.copyfile(NSYS2023_REPORTS / report.name, report)
    code, out, err = run_kvtrace("diff", *reports, env={"NSYS": nsys})
    assert code == 0, err
    [line] = err.splitlines()
    assert re.fullmatch(rf"kvtrace: note: {re.escape(str(reports[0]))} and {re.escape(str(reports[1]))}: Nsight Systems "
                        r"version 2023\.4\.4\S*: its Parquet output lacks META_DATA_CAPTURE \(the CUDA graph trace "
                        r"mode\): exported to SQLite instead", line), line
    assert sorted(p.suffix for p in exports_in(cache_dir / "exports")) == [".sqlite", ".sqlite"]
    code, expected, err = run_kvtrace("diff", NSYS2023_DIR / "fp8.sqlite", NSYS2023_DIR / "nvfp4.sqlite")
    assert code == 0, err
    assert out == expected


def _stand_in(tmp_path: Path, nsys: str, version: str, parquet_from: Path | None) -> Path:
    """An nsys that says `version` and answers `export --type=parquetdir` by copying `parquet_from` (as 2025.3
    wrote it) to --output; everything else goes to the real 2023.4.4."""
    front = tmp_path / "nsys-stand-in"
    copy = f'mkdir -p "$out" && cp {parquet_from}/*.parquet "$out"/' if parquet_from else 'mkdir -p "$out"'
    front.write_text('#!/bin/bash\n'
                     f'if [ "$1" = --version ]; then echo "NVIDIA Nsight Systems version {version}"; exit 0; fi\n'
                     'for a in "$@"; do case "$a" in --output=*) out="${a#--output=}";; esac; done\n'
                     'for a in "$@"; do if [ "$a" = --type=parquetdir ]; then '
                     f'{copy}; exit 0; fi; done\n'
                     f'exec {nsys} "$@"\n')
    front.chmod(0o755)
    return front


def test_a_report_goes_to_parquet_in_the_cache_where_nsys_gives_an_exact_one(nsys, tmp_path, cache_dir, run_kvtrace):
    """With an nsys whose Parquet output holds every table it must (here 2025.3's own files, copied by a stand-in),
    the report is exported to a Parquet folder in kvtrace's cache, atomically, and read from it: no note."""
    report = tmp_path / "fp8.nsys-rep"
    shutil.copyfile(NSYS2023_REPORTS / "fp8.nsys-rep", report)
    front = _stand_in(tmp_path, nsys, "2025.3.1.90-253135822126v0", PARQUET_2025 / "fp8")
    code, out, err = run_kvtrace("kernels", report, "--format", "csv", env={"NSYS": str(front)})
    assert code == 0 and err == "", err
    (exported,) = exports_in(cache_dir / "exports")
    assert exported.suffix == ".parquetdir" and exported.is_dir()
    # nsys' files, and the seal kvtrace wrote inside before it published the folder
    assert sorted(p.name for p in exported.iterdir()) == sorted([p.name for p in (PARQUET_2025 / "fp8").iterdir()]
                                                                + ["kvtrace-export.json"])
    code, expected, err = run_kvtrace("kernels", PARQUET_2025 / "fp8", "--format", "csv")
    assert out == expected


@pytest.mark.parametrize("over_the_bound", [False, True])
def test_a_report_at_the_size_bound_goes_to_sqlite_without_a_note(over_the_bound, nsys, tmp_path, cache_dir,
                                                                    run_kvtrace, monkeypatch):
    """Even where Parquet is exact, a report of at least PARQUET_MAX_REPORT_BYTES is exported to SQLite (--tables):
    kvtrace's choice, so no note; the answer is the SQLite export's. The bound is set to this report's size (or just
    under it): the rule is the same at 256 MiB."""
    report = tmp_path / "fp8.nsys-rep"
    shutil.copyfile(NSYS2023_REPORTS / "fp8.nsys-rep", report)
    monkeypatch.setattr(kvtrace.nsys, "PARQUET_MAX_REPORT_BYTES", report.stat().st_size - over_the_bound)
    front = _stand_in(tmp_path, nsys, "2025.3.1.90-253135822126v0", PARQUET_2025 / "fp8")
    code, out, err = run_kvtrace("kernels", report, "--format", "csv", env={"NSYS": str(front)})
    assert code == 0 and err == "", err
    (exported,) = exports_in(cache_dir / "exports")
    assert exported.suffix == ".sqlite" and exported.is_file()
    with closing(sqlite3.connect(exported)) as conn:
        exported_tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert exported_tables <= {*EXPORT_TABLES, "StringIds"} and "CUPTI_ACTIVITY_KIND_KERNEL" in exported_tables
    code, expected, err = run_kvtrace("kernels", NSYS2023_DIR / "fp8.sqlite", "--format", "csv")
    assert out == expected


def test_parquet_output_without_capture_metadata_falls_back_to_sqlite(nsys, tmp_path, cache_dir, run_kvtrace):
    """An nsys not known to lack META_DATA_CAPTURE is tried, and its output checked: without the table (here an
    empty folder), nothing half-written stays, the report goes to SQLite, and one note says why."""
    report = tmp_path / "fp8.nsys-rep"
    shutil.copyfile(NSYS2023_REPORTS / "fp8.nsys-rep", report)
    front = _stand_in(tmp_path, nsys, "2099.1.1.1-0v0", None)
    code, out, err = run_kvtrace("kernels", report, "--format", "csv", env={"NSYS": str(front)})
    assert code == 0, err
    [line] = err.splitlines()
    assert "could not export Parquet" in line and "lacks StringIds, META_DATA_EXPORT, META_DATA_CAPTURE" in line, line
    assert "exported to SQLite instead" in line
    assert [p.suffix for p in exports_in(cache_dir / "exports")] == [".sqlite"]
    code, expected, err = run_kvtrace("kernels", NSYS2023_DIR / "fp8.sqlite", "--format", "csv")
    assert out == expected


def test_an_output_cannot_replace_a_file_of_the_parquet_folder_read(tmp_path, run_kvtrace):
    folder = _copy(tmp_path, PARQUET_2025 / "fp8")
    target = folder / "StringIds.parquet"
    before = fingerprint(target)
    code, out, err = run_kvtrace("summary", folder, "-o", target)
    assert_one_line_error(code, out, err, str(target), r"it is the input", r"choose another output file")
    assert fingerprint(target) == before


def _parquet_2023(nsys: str, tmp_path: Path, arm: str) -> Path:
    """A real 2023.4.4 Parquet export of a committed 2023.4 report, the report beside it (as `X/` beside
    `X.nsys-rep`)."""
    report = tmp_path / f"{arm}.nsys-rep"
    shutil.copyfile(NSYS2023_REPORTS / report.name, report)
    subprocess.run([nsys, "export", "--type=parquetdir", f"--tables={','.join(load.EXPORT_TABLES)}",
                    f"--output={tmp_path / arm}", str(report)], check=True, capture_output=True, timeout=600)
    return tmp_path / arm


def test_a_2023_parquet_export_loads_the_same_but_for_its_missing_capture_table(nsys, tmp_path):
    """2023.4.4's Parquet (schema 3.7.2) has every table but META_DATA_CAPTURE: it loads to the SQLite export's
    trace, with the graph trace mode and trigger unknown, which is why kvtrace does not export it."""
    folder = _parquet_2023(nsys, tmp_path, "fp8")
    assert not (folder / "META_DATA_CAPTURE.parquet").exists()
    got, expected = open_trace(folder, cache=False), open_trace(NSYS2023_DIR / "fp8.sqlite", cache=False)
    assert got.kernels.equals(expected.kernels) and got.signatures.equals(expected.signatures)
    assert got.ranges.equals(expected.ranges)
    assert (got.info.graph_trace_mode, got.info.capture_trigger) == (None, None)
    assert (expected.info.graph_trace_mode, expected.info.capture_trigger) == ("Node", "Immediate")
    unchanged = {"source", "sqlite", "graph_trace_mode", "capture_trigger"}
    assert {k: v for k, v in vars(got.info).items() if k not in unchanged} == \
        {k: v for k, v in vars(expected.info).items() if k not in unchanged}


def test_verify_checks_a_parquet_folder_through_the_report_beside_it(nsys, tmp_path, run_kvtrace):
    """nsys stats reads SQLite or a report, not Parquet: a Parquet folder is checked through `X.nsys-rep`."""
    fp8, nvfp4 = _parquet_2023(nsys, tmp_path, "fp8"), _parquet_2023(nsys, tmp_path, "nvfp4")
    code, out, err = run_kvtrace("diff", fp8, nvfp4, "--verify", "--nsys", nsys, "--format", "json")
    assert code == 0, err
    checked = json.loads(out)["verification"]
    assert checked["agrees"] is True
    assert [(c["source"], c["problem"]) for c in checked["inputs"]] == [("fp8", None), ("nvfp4", None)]
    assert all(c["calls"] > 0 for c in checked["inputs"])
    (fp8.parent / "nvfp4.nsys-rep").unlink()
    code, out, err = run_kvtrace("diff", fp8, nvfp4, "--verify", "--nsys", nsys, "--format", "json")
    problems = [c["problem"] for c in json.loads(out)["verification"]["inputs"]]
    assert problems[0] is None and "no .nsys-rep of the same name is beside this Parquet export" in problems[1]
