"""Where the host waited for the GPU inside vLLM's steps (analyzer/host_waits.py, analyzer/steps.py), on the sweep of
the H100 capacity matrix (fixtures/vllm033-h100-matrix: 8B shape, three rounds, a trace window per point of 8 engine
steps of a traced pass of the point's shape, the copy and synchronization tables kept): each step's waits, and the
kind that held NVFP4's host in the report's paired steps (each run's first point), against plain SQL over the
exports; "not recorded" where an export lacks the tables (the same run with them dropped); the Parquet reader reads
the same waits; a hostile kernel name reaches the markdown escaped."""

from __future__ import annotations

import json
import shutil
import sqlite3
from collections import Counter
from pathlib import Path

import polars as pl
import pytest

from conftest import MATRIX_RUNS, edited_exports
from kvtrace.analyzer import align, host_waits, steps
from kvtrace.analyzer.export_tables import EXPORT_TABLES
from kvtrace.analyzer.load import open_trace
from kvtrace.analyzer.render import render_text
from kvtrace.analyzer.render.escape import md_text
from kvtrace.analyzer.render.statements import text as statement_text
from kvtrace.analyzer.stats.verdicts import Verdict

SWEEP = MATRIX_RUNS["sweep"]
# The report pairs each run's first point (its manifest's export): ARM.rK.p0.sqlite.
FIRST_POINT = {run: SWEEP / f"{run}.p0.sqlite" for run in ("fp8.r1", "fp8.r2", "fp8.r3", "nvfp4.r1", "nvfp4.r2",
                                                           "nvfp4.r3")}
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


def window_steps(export: Path) -> tuple[int, int]:
    """The engine steps the capture's window around the export traced (its arm's windows in manifest.json), and
    the steps a window was set to (settings.profile_steps)."""
    manifest = json.loads((export.parent / "manifest.json").read_text())
    (traced,) = [window["steps"] for arm in manifest["arms"].values() for window in arm["windows"]
                 if window["sqlite"] == export.name]
    return traced, manifest["settings"]["profile_steps"]


@pytest.mark.parametrize("arm", ["fp8.r1", "nvfp4.r1", "nvfp4.r2"])
def test_each_steps_host_waits_are_plain_sqls(arm):
    export = FIRST_POINT[arm]
    expected = _sql(export, f"""{STEPS}, {WAITS}
        SELECT st.start, COUNT(w.start), COALESCE(SUM(w."end" - w.start), 0)
        FROM steps st LEFT JOIN waits w ON {INSIDE} GROUP BY st.id ORDER BY st.start""")
    table = steps.step_table(open_trace(export))
    traced, configured = window_steps(export)
    assert table.height == len(expected) == traced == configured
    assert table.select("start", "host_waits", "host_wait_ns").rows() == expected
    assert table["host_waits"].sum() > 0


def test_nvfp4s_device_to_host_copies_hold_its_host(shared):
    """The one kind of wait that NVFP4's paired steps make and FP8's do not: 8-byte copies into pageable memory, one
    per layer in each step with context tokens, between the same two kernel launches; FP8 makes none anywhere. The
    report pairs the three rounds' first points step by step: a step with the step of the same name (the same batch)
    in the same round's other arm. Each phase's numbers are its paired steps' together."""
    layers = json.loads((SWEEP / "manifest.json").read_text())["settings"]["model"]["num_hidden_layers"]
    names = f"{STEPS} SELECT name, start FROM steps ORDER BY start"
    copies = f"""{STEPS}, {WAITS}
        SELECT st.start, COUNT(*), MIN(w.bytes), MAX(w.bytes), SUM(w."end" - w.start)
        FROM steps st JOIN waits w ON {INSIDE} WHERE w.copyKind = 2 AND w.dstKind = 0 GROUP BY st.id"""
    # The kernels launched on the copy's thread just before and just after it (a graph launch's last and first).
    around = f"""WITH {WAITS},
        launches AS (SELECT r.globalTid, r.start, r.correlationId FROM CUPTI_ACTIVITY_KIND_RUNTIME r
                     JOIN StringIds s ON s.id = r.nameId WHERE s.value LIKE '%Launch%')
        SELECT (SELECT n.value FROM launches l JOIN CUPTI_ACTIVITY_KIND_KERNEL k ON k.correlationId = l.correlationId
                JOIN StringIds n ON n.id = k.shortName WHERE l.globalTid = w.globalTid AND l.start < w.start
                ORDER BY l.start DESC, k.start DESC LIMIT 1),
               (SELECT n.value FROM launches l JOIN CUPTI_ACTIVITY_KIND_KERNEL k ON k.correlationId = l.correlationId
                JOIN StringIds n ON n.id = k.shortName WHERE l.globalTid = w.globalTid AND l.start > w.start
                ORDER BY l.start, k.start LIMIT 1), COUNT(*)
        FROM waits w WHERE w.copyKind = 2 AND w.dstKind = 0 GROUP BY 1, 2"""
    result = shared.report([SWEEP])
    # Decode steps hold a few more small pinned host-to-device copies than FP8's: another kind, not this one.
    held = {row.phase: row for row in result.step_timeline if row.held_by and row.held_by[0].dst_kind == "pageable"}
    assert set(held) == {align.PREFILL, align.MIXED}
    assert all(kind.copy_kind != "device-to-host" for row in result.step_timeline if row.phase not in held
               for kind in row.held_by)
    per_phase: dict[str, list[tuple]] = {}
    paired_steps: Counter[str] = Counter()
    pairs: Counter[tuple] = Counter()
    made = 0  # every such copy of the three exports, paired step or not
    for run in ("nvfp4.r1", "nvfp4.r2", "nvfp4.r3"):
        nvfp4, fp8 = FIRST_POINT[run], FIRST_POINT[run.replace("nvfp4", "fp8")]
        assert _sql(fp8, "SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_MEMCPY WHERE dstKind = 0") == [(0,)]
        table = steps.step_table(open_trace(nvfp4))
        phase_of = dict(zip(table["step"], table["phase"]))
        found = {start: rest for start, *rest in _sql(nvfp4, copies)}
        # One copy per layer in every step with context tokens (execute_context_N(...) with N > 0), and in no other.
        assert sorted(found) == [start for name, start in _sql(nvfp4, names)
                                 if not name.startswith("execute_context_0(")]
        assert {calls for calls, *_ in found.values()} == {layers}
        made += sum(calls for calls, *_ in found.values())
        # The i-th step of a name pairs with the i-th of that name in the same round's FP8 export.
        in_fp8, seen = Counter(name for name, _ in _sql(fp8, names)), Counter()
        for name, start in _sql(nvfp4, names):
            if seen[name] < in_fp8[name]:
                paired_steps[phase_of[name]] += 1
                if start in found:
                    per_phase.setdefault(phase_of[name], []).append(tuple(found[start]))
            seen[name] += 1
        pairs.update({(before, after): count for before, after, count in _sql(nvfp4, around)})
    assert len(pairs) == 1 and set(per_phase) == set(held)
    (before, after), count = next(iter(pairs.items()))
    assert count == made  # every copy lies between the same two launches
    for phase, per_step in per_phase.items():
        row = held[phase]
        kind = row.held_by[0]
        calls, total_ns = sum(s[0] for s in per_step), sum(s[3] for s in per_step)
        assert (kind.call, kind.copy_kind, kind.src_kind, kind.dst_kind) == (
            "cudaMemcpyAsync", "device-to-host", "device", "pageable")
        assert (kind.candidate_calls, kind.bytes_low, kind.bytes_high) == (
            calls, min(s[1] for s in per_step), max(s[2] for s in per_step))
        assert kind.candidate_ns == total_ns
        assert kind.candidate_mean_ns == pytest.approx(total_ns / calls)
        assert (kind.baseline_calls, kind.steps, kind.per_step_low, kind.per_step_high) == (
            0, len(per_step), min(s[0] for s in per_step), max(s[0] for s in per_step))
        assert (kind.before, kind.after, kind.around) == (before, after, calls)
        assert row.candidate_waited_steps > row.baseline_waited_steps
        # Round 1's steps alone pair: in rounds 2 and 3 FP8's traced pass prefilled its first requests in one step
        # and NVFP4's in two. One step pair has no interval: the wait is stated as what held the host, its time
        # left unmeasured.
        assert row.steps == paired_steps[phase] == len(per_step) == 1
        assert row.span_low is None and row.span_verdict == Verdict.INSUFFICIENT_DATA
        assert row.host_reading == steps.HELD_BY_WAIT
    # The statement names the wait, its kernels and FP8's none, in the report and in the matrix's claim.
    said = [s for s in result.statements if s.kind == "step-timeline"]
    assert {s.row.phase for s in said} == set(held)
    for statement in said:
        kind = statement.row.held_by[0]
        words = statement_text(statement)
        assert (f"{kind.candidate_calls} device-to-host copies of {kind.bytes_low} bytes from device into pageable "
                f"memory (cudaMemcpyAsync" in words)
        assert f"between launches of {before} and {after}; fp8: none" in words
        assert "not a slower kernel; how much time it adds needs more paired steps" in words


def test_the_table_json_and_csv_carry_the_waits(run_kvtrace, tmp_path):
    for fmt, name in (("json", "r.json"), ("csv", "r.csv"), ("markdown", "r.md")):
        code, _, err = run_kvtrace("report", SWEEP, "--format", fmt, "-o", tmp_path / name)
        assert code == 0, err
    rows = {row["phase"]: row for row in json.loads((tmp_path / "r.json").read_text())["step_timeline"]}
    prefill = rows[align.PREFILL]
    assert prefill["candidate_host_waits"] > prefill["baseline_host_waits"] >= 0
    assert prefill["held_by"][0]["call"] == "cudaMemcpyAsync" and prefill["host_reading"] == steps.HELD_BY_WAIT
    lines = (tmp_path / "r.csv").read_text().splitlines()
    assert "steps_held_by,prefill 1,nvfp4,call,cudaMemcpyAsync" in lines
    table = (tmp_path / "r.md").read_text().split("### vLLM steps on the GPU")[1]
    assert "| host waits fp8 | host waits nvfp4 |" in table
    assert f"| {prefill['candidate_host_waits']:,.1f} (" in table


def _without_host_wait_tables(tmp_path: Path) -> Path:
    """The sweep with its exports' copy and synchronization tables dropped, as exports cut before kvtrace kept them
    (and nsys exports without CUDA copy tracing) are."""
    return edited_exports(SWEEP, tmp_path, "*.sqlite", "DROP TABLE CUPTI_ACTIVITY_KIND_MEMCPY",
                          "DROP TABLE CUPTI_ACTIVITY_KIND_SYNCHRONIZATION")


def test_exports_without_the_tables_have_no_waits_not_zero(tmp_path, shipped_recipes):
    from kvtrace.analyzer import report

    run = _without_host_wait_tables(tmp_path)
    trace = open_trace(run / "nvfp4.r1.p0.sqlite", cache=False)
    assert host_waits.host_waits(trace) is None
    table = steps.step_table(trace)
    assert table.height == 8 and table["host_waits"].null_count() == table["host_wait_ns"].null_count() == 8
    result = report.build([run], shipped_recipes, cache=False)
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
    export = FIRST_POINT["nvfp4.r1"]
    through_sqlite = host_waits.host_waits(open_trace(export, cache=False))
    through_parquet = host_waits.host_waits(open_trace(_parquet_copy(export, tmp_path / "pq"), cache=False))
    assert through_sqlite.height > 64 and through_parquet.equals(through_sqlite)


def test_a_hostile_kernel_name_around_a_wait_reaches_the_markdown_escaped(run_kvtrace, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(SWEEP, run)
    hostile = "Cat<img src=x onerror=alert(1)>**b**`x`[l](http://e)\u202e\x1b[31m"
    for repeat in ("nvfp4.r1", "nvfp4.r2", "nvfp4.r3"):  # the kernel before the wait in every paired run
        export = run / FIRST_POINT[repeat].name
        export.chmod(0o644)
        with sqlite3.connect(export) as conn:
            changed = conn.execute("UPDATE StringIds SET value = ? WHERE value = "
                                   "'CatArrayBatchedCopy_alignedK_contig'", (hostile,)).rowcount
        assert changed == 1
    code, _, err = run_kvtrace("report", run, "--format", "markdown", "-o", tmp_path / "r.md")
    assert code == 0, err
    text = (tmp_path / "r.md").read_text()
    assert f"between launches of {md_text(hostile)} and NVFP4QuantizeAppendPagedKVCacheWithSlotMappingKernel" in text
    assert hostile not in text and "\x1b" not in text and "\u202e" not in text


def test_what_held_the_host_stands_beside_ttft_before_the_details(shared):
    """The steps statements explain TTFT, so they stand in the head's serving lines, before <details>, once; a run
    without serving numbers (the FlashInfer engine's) has no vLLM steps to state."""
    serve = render_text(shared.report([SWEEP]), "markdown")
    head, rest = serve.split("<details>", 1)
    lines = [line for line in serve.splitlines() if "device-to-host copies of 8 bytes" in line]
    assert len(lines) == 2 and all(line in head.splitlines() for line in lines)
    assert head.index("### Serving: TTFT beside the cached prompt tokens") < head.index(lines[0])
    assert all(line not in rest for line in lines)
