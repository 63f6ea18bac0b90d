"""An .nsys-rep is exported with only the tables kvtrace reads (`nsys export --tables`, issue 24).

Run against the real Nsight Systems 2023.4.4 CLI on the committed 2023.4 reports: what the narrow export
holds, that every per-kernel total through it equals the one through a full `nsys export --type sqlite` of
the same report to the nanosecond (summed by plain SQL on that export, not by kvtrace), the fallback to a full
export where nsys refuses `--tables`, and the side-by-side export of a diff's two reports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import time
from contextlib import closing
from pathlib import Path

import pytest

from conftest import NSYS2023_DIR, NSYS2023_REPORTS, exports_in, fingerprint
from kvtrace.analyzer import cache, load
from kvtrace.analyzer.load import EXPORT_TABLES, open_trace, open_traces

REPORTS = ("fp8", "nvfp4")


def _tables(path: Path) -> list[str]:
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return sorted(name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))


def _sql_totals(path: Path) -> dict[str, tuple[int, int]]:
    """Demangled name -> (calls, total ns), by SQL on an export."""
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        rows = conn.execute('SELECT s.value, count(*), sum(k."end" - k.start) FROM CUPTI_ACTIVITY_KIND_KERNEL k '
                            "JOIN StringIds s ON s.id = k.demangledName GROUP BY s.value").fetchall()
    return {name: (calls, total) for name, calls, total in rows}


def _kvtrace_totals(out: str) -> dict[str, tuple[int, int]]:
    return {row["demangled"]: (row["calls"], row["total_ns"]) for row in json.loads(out)["rows"]}


def _alone(tmp_path: Path, name: str) -> Path:
    """A copy of a committed report in a folder of its own (no sibling .sqlite to reuse)."""
    folder = tmp_path / "in"
    folder.mkdir(exist_ok=True)
    report = folder / f"{name}.nsys-rep"
    shutil.copy2(NSYS2023_REPORTS / report.name, report)
    return report


def _full_export(nsys: str, report: Path, output: Path) -> Path:
    """`nsys export --type sqlite` of every table, as kvtrace ran it before issue 24."""
    subprocess.run([nsys, "export", "--type=sqlite", "-q", "true", f"--output={output}", str(report)],
                   check=True, capture_output=True, timeout=600)
    return output


@pytest.mark.parametrize("name", REPORTS)
def test_narrow_export_totals_equal_full_export_to_the_nanosecond(name, nsys, tmp_path, cache_dir, run_kvtrace):
    report = _alone(tmp_path, name)
    before = fingerprint(report)
    code, out, err = run_kvtrace("kernels", report, "--format", "json", env={"NSYS": nsys})
    assert code == 0, err
    # 2023.4.4 exports the tables named; its Parquet output would lack META_DATA_CAPTURE, so SQLite, in one line.
    [line] = err.splitlines()
    assert re.fullmatch(rf"kvtrace: note: {re.escape(str(report))}: Nsight Systems version 2023\.4\.4\S*: its "
                        r"Parquet output lacks META_DATA_CAPTURE \(the CUDA graph trace mode\): exported to SQLite "
                        r"instead", line), line
    exported = cache_dir / "exports" / json.loads(out)["arm"]["info"]["sqlite"]
    full = _full_export(nsys, report, tmp_path / "full.sqlite")

    # Only tables kvtrace reads, every one of them that the full export has, and nsys recorded the request.
    assert _tables(exported) == sorted(set(EXPORT_TABLES) & set(_tables(full)))
    assert len(_tables(exported)) < len(_tables(full))
    with closing(sqlite3.connect(f"file:{exported}?mode=ro", uri=True)) as conn:
        asked = dict(conn.execute("SELECT name, value FROM META_DATA_EXPORT").fetchall())
    assert asked["EXPORT_PARAM_TABLES_TO_EXPORT"].split() == list(EXPORT_TABLES)

    # Per kernel, to the nanosecond: kvtrace through the narrow export, SQL on both exports.
    assert _kvtrace_totals(out) == _sql_totals(full) == _sql_totals(exported)
    code, full_out, err = run_kvtrace("kernels", full, "--format", "json")
    assert code == 0, err
    assert _kvtrace_totals(full_out) == _kvtrace_totals(out)
    # Per launch, range by range, and the trace's info (META_DATA_CAPTURE, GPU, driver) alike.
    narrow, wide = open_trace(exported, cache=False), open_trace(full, cache=False)
    assert narrow.kernels.join(narrow.signatures, on="sig").drop("sig").equals(
        wide.kernels.join(wide.signatures, on="sig").drop("sig"))
    assert narrow.ranges.equals(wide.ranges)
    skip = {"source", "sqlite"}
    assert {k: v for k, v in vars(narrow.info).items() if k not in skip} == \
        {k: v for k, v in vars(wide.info).items() if k not in skip}
    assert fingerprint(report) == before


def test_nsys_stats_reads_the_narrow_export_for_verify(nsys, tmp_path, cache_dir, run_kvtrace):
    """--verify runs `nsys stats` on the export kvtrace read: the narrow one holds what it needs."""
    fp8, nvfp4 = _alone(tmp_path, "fp8"), _alone(tmp_path, "nvfp4")
    code, out, err = run_kvtrace("diff", fp8, nvfp4, "--verify", "--nsys", nsys, "--format", "json")
    assert code == 0, err
    checked = json.loads(out)["verification"]
    assert checked["agrees"] is True
    assert [c["source"] for c in checked["inputs"]] == ["fp8.nsys-rep", "nvfp4.nsys-rep"]
    assert all(c["problem"] is None and c["calls"] > 0 for c in checked["inputs"])


def test_nsys_that_refuses_tables_falls_back_to_every_table_with_one_line(nsys, tmp_path, cache_dir, run_kvtrace):
    """An nsys without --tables (here the real 2023.4.4 behind a front that refuses the option, as an older
    release would) still gets the report exported, in full, and one line says so."""
    front = tmp_path / "nsys-without-tables"
    front.write_text('#!/bin/bash\nfor a in "$@"; do case "$a" in --tables*) '
                     'echo "unrecognised option \'--tables\'"; exit 1;; esac; done\n'
                     f'exec {nsys} "$@"\n')
    front.chmod(0o755)
    report = _alone(tmp_path, "fp8")
    code, out, err = run_kvtrace("kernels", report, "--format", "json", env={"NSYS": str(front)})
    assert code == 0, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: note: "), err
    assert "2023.4.4" in lines[0] and "--tables" in lines[0] and "every table" in lines[0]
    exported = cache_dir / "exports" / json.loads(out)["arm"]["info"]["sqlite"]
    full = _full_export(nsys, report, tmp_path / "full.sqlite")
    assert _tables(exported) == _tables(full)
    assert _kvtrace_totals(out) == _sql_totals(full)


def test_a_diffs_reports_export_once_each_and_the_steps_name_them(nsys, tmp_path, cache_dir, monkeypatch):
    """open_traces exports each distinct report once (a report given twice is one export), before any is read,
    and tells its progress display which report and which step runs."""
    monkeypatch.setenv("KVTRACE_CACHE_DIR", str(cache_dir))
    monkeypatch.setattr(load.export_tables, "workers", lambda: 2)  # cores for both, whatever this machine has
    fp8, nvfp4 = _alone(tmp_path, "fp8"), _alone(tmp_path, "nvfp4")
    steps: list[str] = []
    traces = open_traces([fp8, nvfp4, fp8], nsys=nsys, step=steps.append)
    assert sorted(p.name.split("-")[0] for p in exports_in(cache_dir / "exports")) == ["fp8", "nvfp4"]
    assert traces[0].info.sqlite == traces[2].info.sqlite != traces[1].info.sqlite
    exporting = [s for s in steps if s.startswith("exporting")]
    assert exporting == ["exporting fp8.nsys-rep and nvfp4.nsys-rep (2 at once)"] * 2
    assert steps[2:] == ["reading fp8.nsys-rep", "reading nvfp4.nsys-rep", "reading fp8.nsys-rep"]

    # Exported once: a second load reads the cached exports, exporting nothing.
    steps.clear()
    open_traces([fp8, nvfp4], nsys=nsys, step=steps.append)
    assert steps == ["reading fp8.nsys-rep", "reading nvfp4.nsys-rep"]


def test_one_core_exports_one_report_at_a_time(nsys, tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("KVTRACE_CACHE_DIR", str(cache_dir))
    monkeypatch.setattr(load.export_tables, "workers", lambda: 1)
    steps: list[str] = []
    open_traces([_alone(tmp_path, "fp8"), _alone(tmp_path, "nvfp4")], nsys=nsys, step=steps.append)
    assert steps == ["exporting fp8.nsys-rep (nsys export, the tables kvtrace reads)",
                     "exporting nvfp4.nsys-rep (nsys export, the tables kvtrace reads)",
                     "reading fp8.nsys-rep", "reading nvfp4.nsys-rep"]


def test_exports_made_before_the_cache_days_go_when_another_is_made(nsys, tmp_path, cache_dir, run_kvtrace):
    """The exports folder does not grow without end (a 10M-kernel report's export is 1.6 GB): a new export removes
    kvtrace's exports made more than CACHE_DAYS ago and what killed exports left more than LEFTOVER_DAYS ago, and
    nothing else: not a fresh export or leftover (an export may be under way), not a file or a link of another
    name, not a link of an export's name."""
    folder = cache_dir / "exports"
    folder.mkdir(parents=True)
    old = time.time() - (cache.CACHE_DAYS + 1) * 86400
    stale_sqlite, stale_parquet = folder / f"fp8-{'a' * 20}.sqlite", folder / f"nvfp4-{'b' * 20}.parquetdir"
    fresh = folder / f"fp8-{'c' * 20}.sqlite"
    foreign, linked = folder / "notes.sqlite", folder / f"fp8-{'d' * 20}.sqlite"
    target = tmp_path / "user.sqlite"
    for path in (stale_sqlite, fresh, foreign, target):
        shutil.copyfile(NSYS2023_DIR / "fp8.sqlite", path)
    stale_parquet.mkdir()
    (stale_parquet / "StringIds.parquet").write_bytes(b"")
    linked.symlink_to(target)
    # As files.beside and nsys.export_parquet name them while an export runs.
    left_file = folder / f".fp8-{'e' * 20}.sqlite.k2j4h1.sqlite"
    left_folder = folder / f".fp8-{'e' * 20}.parquetdir.x8z"
    running = folder / f".nvfp4-{'f' * 20}.sqlite.q9w8e7.sqlite"
    left_file.write_bytes(b"half an export")
    running.write_bytes(b"an export under way")
    left_folder.mkdir()
    (left_folder / "StringIds.parquet").write_bytes(b"")
    leftover_age = time.time() - (cache.LEFTOVER_DAYS + 1) * 86400
    os.utime(left_file, (leftover_age, leftover_age))
    os.utime(left_folder, (leftover_age, leftover_age))
    for path in (stale_sqlite, stale_parquet, foreign, target):
        os.utime(path, (old, old))
    os.utime(linked, (old, old), follow_symlinks=False)
    report = _alone(tmp_path, "fp8")
    code, out, err = run_kvtrace("kernels", report, "--format", "csv", env={"NSYS": nsys})
    assert code == 0, err
    left = {path.name for path in exports_in(folder)}
    assert not {stale_sqlite.name, stale_parquet.name, left_file.name, left_folder.name} & left
    assert {fresh.name, foreign.name, linked.name, running.name} <= left and target.is_file()
    assert len(left) == 5  # and the new export
