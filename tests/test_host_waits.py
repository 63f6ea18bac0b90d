"""Where the host waited for the GPU inside vLLM's steps (analyzer/host_waits.py, analyzer/steps.py), on the H200
8B-shaped run whose exports keep the copies and synchronizations (capacity-sweep-repeats): each step's waits, and the
kind that held NVFP4's host, against plain SQL over the exports; "not recorded" where an export lacks the tables;
the Parquet reader reads the same waits; a hostile kernel name reaches the markdown escaped."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import polars as pl
import pytest

from conftest import MATRIX_RUNS, VLLM033_8B_RUNS
from kvtrace.analyzer import align, host_waits, steps
from kvtrace.analyzer.export_tables import EXPORT_TABLES
from kvtrace.analyzer.load import open_trace
from kvtrace.analyzer.render import render_text
from kvtrace.analyzer.render.escape import md_text
from kvtrace.analyzer.render.statements import text as statement_text

REPEATS = MATRIX_RUNS["sweep"]
SWEEP = MATRIX_RUNS["sweep"]  # exports cut before the copy and synchronization tables were kept
STEPS = """WITH steps AS (
    SELECT n.rowid AS id, COALESCE(s.value, n.text) AS name, n.start, n."end", n.globalTid
    FROM NVTX_EVENTS n LEFT JOIN StringIds s ON s.id = n.textId
    WHERE COALESCE(s.value, n.text) LIKE 'execute_%context_%generation_%')"""
# Runtime calls in which the host waited: a copy's call that returned after the copy ended, a …Synchronize call.
WAITS = """waits AS (
    SELECT r.globalTid, r.start, r."end", m.copyKind, m.dstKind, m.bytes, r.correlationId
    FROM CUPTI_ACTIVITY_KIND_MEMCPY m JOIN CUPTI_ACTIVITY_KIND_RUNTIME r ON r.correlationId = m.correlationId
    JOIN StringIds c ON c.id = r.nameId WHERE c.value LIKE '%Memcpy%' AND r."end" >= m."end"
    UNION ALL
    SELECT r.globalTid, r.start, r."end", NULL, NULL, NULL, r.correlationId
    FROM CUPTI_ACTIVITY_KIND_SYNCHRONIZATION y JOIN CUPTI_ACTIVITY_KIND_RUNTIME r ON r.correlationId = y.correlationId
    JOIN StringIds c ON c.id = r.nameId WHERE c.value LIKE '%Synchronize%')"""
INSIDE = 'w.globalTid = st.globalTid AND w.start >= st.start AND w.start < st."end"'


def _sql(export: Path, query: str, *args) -> list[tuple]:
    with sqlite3.connect(f"file:{export}?mode=ro", uri=True) as conn:
        return conn.execute(query, args).fetchall()


@pytest.mark.parametrize("arm", ["fp8.r1", "nvfp4.r1", "nvfp4.r2"])
def test_each_steps_host_waits_are_plain_sqls(arm):
    export = REPEATS / f"{arm}.sqlite"
    expected = _sql(export, f"""{STEPS}, {WAITS}
        SELECT st.start, COUNT(w.start), COALESCE(SUM(w."end" - w.start), 0)
        FROM steps st LEFT JOIN waits w ON {INSIDE} GROUP BY st.id ORDER BY st.start""")
    table = steps.step_table(open_trace(export))
    assert table.height == len(expected) == 24
    assert table.select("start", "host_waits", "host_wait_ns").rows() == expected
    assert table["host_waits"].sum() > 0


def test_nvfp4s_device_to_host_copies_hold_its_host(shared):
    """The one kind of wait that NVFP4's paired steps make and FP8's do not: 8-byte copies into pageable memory, one
    per layer in each step with context tokens, between the same two kernel launches; FP8 makes none anywhere."""
    nvfp4, fp8 = REPEATS / "nvfp4.r1.sqlite", REPEATS / "fp8.r1.sqlite"
    copies = f"""{STEPS}, {WAITS}
        SELECT st.name, COUNT(*), MIN(w.bytes), MAX(w.bytes), AVG(w."end" - w.start), SUM(w."end" - w.start)
        FROM steps st JOIN waits w ON {INSIDE} WHERE w.copyKind = 2 AND w.dstKind = 0 GROUP BY st.id"""
    expected = {name: rest for name, *rest in _sql(nvfp4, copies)}
    assert _sql(fp8, "SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_MEMCPY WHERE dstKind = 0") == [(0,)]
    # The kernels launched on the copy's thread just before and just after it (a graph launch's last and first).
    around = _sql(nvfp4, f"""WITH {WAITS},
        launches AS (SELECT r.globalTid, r.start, r.correlationId FROM CUPTI_ACTIVITY_KIND_RUNTIME r
                     JOIN StringIds s ON s.id = r.nameId WHERE s.value LIKE '%Launch%')
        SELECT (SELECT n.value FROM launches l JOIN CUPTI_ACTIVITY_KIND_KERNEL k ON k.correlationId = l.correlationId
                JOIN StringIds n ON n.id = k.shortName WHERE l.globalTid = w.globalTid AND l.start < w.start
                ORDER BY l.start DESC, k.start DESC LIMIT 1),
               (SELECT n.value FROM launches l JOIN CUPTI_ACTIVITY_KIND_KERNEL k ON k.correlationId = l.correlationId
                JOIN StringIds n ON n.id = k.shortName WHERE l.globalTid = w.globalTid AND l.start > w.start
                ORDER BY l.start, k.start LIMIT 1), COUNT(*)
        FROM waits w WHERE w.copyKind = 2 AND w.dstKind = 0 GROUP BY 1, 2""")
    assert len(around) == 1
    before, after, count = around[0]

    result = shared.report([REPEATS])
    held = {row.phase: row for row in result.step_timeline if row.held_by}
    assert set(held) == {align.PREFILL, align.MIXED}
    table = steps.step_table(open_trace(nvfp4))
    phase_of = dict(zip(table["step"], table["phase"]))
    assert sorted(phase_of[name] for name in expected) == sorted(held)
    for name, (calls, low, high, mean_ns, total_ns) in expected.items():
        row = held[phase_of[name]]
        kind = row.held_by[0]
        assert (kind.call, kind.copy_kind, kind.src_kind, kind.dst_kind) == (
            "cudaMemcpyAsync", "device-to-host", "device", "pageable")
        assert (kind.candidate_calls, kind.bytes_low, kind.bytes_high) == (calls, low, high)
        assert kind.candidate_ns == total_ns
        assert kind.candidate_mean_ns == pytest.approx(mean_ns)
        assert (kind.baseline_calls, kind.steps, kind.per_step_low, kind.per_step_high) == (0, 1, calls, calls)
        assert (kind.before, kind.after, kind.around) == (before, after, calls)
        assert row.candidate_waited_steps > row.baseline_waited_steps and row.host_reading == steps.HELD_BY_WAIT
    assert sum(e[0] for e in expected.values()) == count == 64
    # The statement names the wait, its kernels and FP8's none, in the report and in the matrix's claim.
    said = [s for s in result.statements if s.kind == "step-timeline"]
    assert {s.row.phase for s in said} == set(held)
    for statement in said:
        kind = statement.row.held_by[0]
        words = statement_text(statement)
        assert (f"{kind.candidate_calls} device-to-host copies of {kind.bytes_low} bytes from device into pageable "
                f"memory (cudaMemcpyAsync" in words)
        assert f"between launches of {before} and {after}; fp8: none" in words
        assert "not a slower kernel" in words


def test_the_table_json_and_csv_carry_the_waits(run_kvtrace, tmp_path, shipped_output):
    shipped = shipped_output("report.vllm033-8b-capacity-sweep-repeats", "json")  # report REPEATS --format json -o
    assert shipped.code == 0, shipped.err
    rows = {row["phase"]: row for row in json.loads(shipped.path.read_text())["step_timeline"]}
    prefill = rows[align.PREFILL]
    assert prefill["candidate_host_waits"] > prefill["baseline_host_waits"] >= 0
    assert prefill["held_by"][0]["call"] == "cudaMemcpyAsync" and prefill["host_reading"] == steps.HELD_BY_WAIT
    code, _, err = run_kvtrace("report", REPEATS, "--format", "csv", "-o", tmp_path / "r.csv")
    lines = (tmp_path / "r.csv").read_text().splitlines()
    assert "steps_held_by,prefill 1,nvfp4,call,cudaMemcpyAsync" in lines
    shipped = shipped_output("report.vllm033-8b-capacity-sweep-repeats")
    table = shipped.path.read_text().split("### vLLM steps on the GPU")[1]
    assert "| host waits fp8 | host waits nvfp4 |" in table
    assert f"| {prefill['candidate_host_waits']:,.1f} (" in table


def test_exports_without_the_tables_have_no_waits_not_zero(shared):
    trace = open_trace(SWEEP / "nvfp4.sqlite")
    assert host_waits.host_waits(trace) is None
    table = steps.step_table(trace)
    assert table.height == 24 and table["host_waits"].null_count() == table["host_wait_ns"].null_count() == 24
    result = shared.report([SWEEP])
    assert result.step_timeline
    for row in result.step_timeline:
        assert None is row.baseline_host_waits is row.candidate_host_waits is row.candidate_host_wait_ns
        assert row.held_by == ()
    from kvtrace.analyzer.render.report_tables import _step_table
    _, cells = _step_table(result)
    assert all(cell[-2:] == ["not recorded", "not recorded"] for cell in cells)


def _parquet_copy(export: Path, folder: Path) -> Path:
    """The export's tables that kvtrace reads as an nsys Parquet folder: one file per table."""
    folder.mkdir()
    with sqlite3.connect(f"file:{export}?mode=ro", uri=True) as conn:
        present = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        for table in set(EXPORT_TABLES) & present:
            pl.read_database(f"SELECT * FROM {table}", conn, infer_schema_length=None).write_parquet(
                folder / f"{table}.parquet")
    return folder


def test_the_parquet_reader_finds_the_same_waits(tmp_path):
    export = REPEATS / "nvfp4.r1.sqlite"
    through_sqlite = host_waits.host_waits(open_trace(export, cache=False))
    through_parquet = host_waits.host_waits(open_trace(_parquet_copy(export, tmp_path / "pq"), cache=False))
    assert through_sqlite.height > 64 and through_parquet.equals(through_sqlite)


def test_a_hostile_kernel_name_around_a_wait_reaches_the_markdown_escaped(run_kvtrace, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(REPEATS, run)
    hostile = "Cat<img src=x onerror=alert(1)>**b**`x`[l](http://e)\u202e\x1b[31m"
    export = run / "nvfp4.r1.sqlite"
    export.chmod(0o644)
    with sqlite3.connect(export) as conn:
        changed = conn.execute("UPDATE StringIds SET value = ? WHERE value = 'CatArrayBatchedCopy_alignedK_contig'",
                               (hostile,)).rowcount
    assert changed == 1
    code, _, err = run_kvtrace("report", run, "--format", "markdown", "-o", tmp_path / "r.md")
    assert code == 0, err
    text = (tmp_path / "r.md").read_text()
    assert f"between launches of {md_text(hostile)} and NVFP4QuantizeAppendPagedKVCacheWithSlotMappingKernel" in text
    assert hostile not in text and "\x1b" not in text and "\u202e" not in text


def test_what_held_the_host_stands_beside_ttft_before_the_details(shared):
    """The steps statements explain TTFT, so they stand in the head's serving lines, before <details>, once; a run
    without serving numbers (the FlashInfer engine's) has no vLLM steps to state."""
    serve = render_text(shared.report([REPEATS]), "markdown")
    head, rest = serve.split("<details>", 1)
    lines = [line for line in serve.splitlines() if "device-to-host copies of 8 bytes" in line]
    assert len(lines) == 2 and all(line in head.splitlines() for line in lines)
    assert head.index("### Serving: TTFT beside the cached prompt tokens") < head.index(lines[0])
    assert all(line not in rest for line in lines)
