"""The GPU timeline of vLLM's steps (analyzer/steps.py) on real runs of the 8B-shaped model (the H100 capacity matrix
of 2026-12-07, each point's export holding the 8 engine steps of its traced pass; the H200 preemption and offline
cold-prefill runs): each step's kernel time, GPU span and host time against plain SQL over the exports, and the
statement that names time the host added inside NVFP4's prefill steps apart from its kernels."""

from __future__ import annotations

import json
import re
import sqlite3
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import pytest

from conftest import MATRIX_RUNS, NSYS2025_DIR, VLLM033_8B_RUNS
from kvtrace.analyzer import align, report, steps
from kvtrace.analyzer.load import open_trace
from kvtrace.analyzer.render.statements import text as statement_text
from kvtrace.analyzer.stats.verdicts import Verdict

SWEEP = MATRIX_RUNS["sweep"]
PREEMPTION = VLLM033_8B_RUNS["capacity-preemption"]
COLD = VLLM033_8B_RUNS["capacity-cold-prefill"]
STEP_LIKE = "execute_%context_%generation_%"


def _sql_steps(export: Path) -> list[tuple[str, int, int, list[tuple[int, int]]]]:
    """Per vLLM step range: name, start, host ns and its kernels' (start, end), from the kernels whose launch call
    started inside the range on the range's own thread."""
    with sqlite3.connect(f"file:{export}?mode=ro", uri=True) as conn:
        rows = conn.execute("""
            SELECT n.rowid, COALESCE(s.value, n.text), n.start, n."end" - n.start, k.start, k."end"
            FROM NVTX_EVENTS n LEFT JOIN StringIds s ON s.id = n.textId
            JOIN CUPTI_ACTIVITY_KIND_RUNTIME r ON r.globalTid = n.globalTid AND r.start >= n.start AND r.start < n."end"
            JOIN CUPTI_ACTIVITY_KIND_KERNEL k ON k.correlationId = r.correlationId
            WHERE COALESCE(s.value, n.text) LIKE ? ORDER BY n.start, k.start""", (STEP_LIKE,)).fetchall()
    found: dict[int, tuple] = {}
    for rowid, name, start, host, k_start, k_end in rows:
        found.setdefault(rowid, (name, start, host, []))[3].append((k_start, k_end))
    return list(found.values())


def _union(intervals: list[tuple[int, int]]) -> int:
    total, reached = 0, None
    for start, end in sorted(intervals):
        if reached is None or start >= reached:
            total, reached = total + end - start, end
        elif end > reached:
            total, reached = total + end - reached, end
    return total


@pytest.mark.parametrize("run", ["fp8.r1", "nvfp4.r1"])
def test_each_steps_times_are_plain_sqls(run):
    export = SWEEP / f"{run}.p0.sqlite"  # the first sweep point's traced pass
    table = steps.step_table(open_trace(export))
    expected = _sql_steps(export)
    profile_steps = json.loads((SWEEP / "manifest.json").read_text())["settings"]["profile_steps"]
    assert table.height == len(expected) == profile_steps == 8  # the engine steps the capture traced
    for row, (name, start, host, kernels) in zip(table.iter_rows(named=True), expected):
        first, last = min(k[0] for k in kernels), max(k[1] for k in kernels)
        assert (row["step"], row["start"], row["host_ns"], row["kernels"]) == (name, start, host, len(kernels))
        assert (row["kernel_ns"], row["span_ns"]) == (_union(kernels), last - first)
        assert row["idle_ns"] == last - first - row["kernel_ns"] and row["host_tail_ns"] == start + host - last


def test_overlapping_kernels_count_once():
    """The union of a step's kernel intervals, checked on constructed intervals against a direct sweep."""
    import numpy as np
    import polars as pl

    rng = np.random.default_rng(3)
    start = np.sort(rng.integers(0, 1000, 40))
    end = start + rng.integers(1, 80, 40)
    frame = pl.DataFrame({"step_range": np.zeros(40, dtype=np.int64), "start": start, "end": end})
    union = steps.kernel_union(frame)["kernel_ns"].item()
    covered = np.zeros(1100, dtype=bool)
    for a, b in zip(start, end):
        covered[a:b] = True
    assert union == covered.sum() < (end - start).sum()


def test_nvfp4s_prefill_steps_wait_on_the_host(shared):
    """Preemption run, --repeats 2: NVFP4's prefill steps last longer on the GPU by time with no kernel running,
    while their kernels are nearly as fast: the statement says host-side time, not a slower kernel."""
    result = shared.report([PREEMPTION])
    prefill = next(r for r in result.step_timeline if r.phase == align.PREFILL)
    assert prefill.span_verdict == Verdict.REGRESSION and prefill.span_low > prefill.kernel_high
    assert prefill.candidate_idle_ns > 2 * prefill.baseline_idle_ns
    assert prefill.candidate_waited_steps == prefill.steps > prefill.baseline_waited_steps
    (said,) = [s for s in result.statements if s.kind == "step-timeline"]
    words = statement_text(said)
    assert said.row == prefill and "host-side time, not a slower kernel" in words
    assert f"{prefill.candidate_waited_steps} of {prefill.steps} steps" in words
    # The original exports held more copies in NVFP4's runs: the memcpy rows the cut dropped (cut.json).
    copies = {entry["original"]["file"]: entry["rows_dropped"]["CUPTI_ACTIVITY_KIND_MEMCPY"]
              for entry in json.loads((PREEMPTION / "cut.json").read_text())["exports"].values()}
    for repeat in ("r1", "r2"):
        assert copies[f"nvfp4.{repeat}.sqlite"] > copies[f"fp8.{repeat}.sqlite"]


def test_the_cold_prefill_step_statement_and_the_json(shipped_recipes, run_kvtrace, tmp_path):
    code, out, err = run_kvtrace("report", COLD, "--format", "json", "-o", tmp_path / "r.json")
    assert code == 0, err
    data = json.loads((tmp_path / "r.json").read_text())
    (row,) = data["step_timeline"]
    assert row["phase"] == align.PREFILL and row["steps"] == 4
    assert any(s["kind"] == "step-timeline" for s in data["statements"])
    code, _, err = run_kvtrace("report", COLD, "--format", "markdown", "-o", tmp_path / "r.md")
    text = (tmp_path / "r.md").read_text()
    head = text.split("<details>", 1)[0]
    assert "### vLLM steps on the GPU" in text and "prefill steps (4 paired): nvfp4's kernels ran" in head


def test_no_step_timeline_without_vllm_steps_or_inside_a_window(shared, shipped_recipes):
    assert shared.report([NSYS2025_DIR]).step_timeline == []
    windowed = report.build([SWEEP], shipped_recipes, window=align.Window(phase=align.DECODE))
    assert windowed.step_timeline == [] and not any(s.kind == "step-timeline" for s in windowed.statements)


class _Step(NamedTuple):
    name: str
    phase: str  # from the request counts in its name: no generation requests is prefill, no context ones decode
    span: int  # first kernel start to last kernel end
    held: bool  # the host left the range at most steps.HELD_SHARE of the span before the last kernel ended
    copies: int  # device-to-host copies into pageable memory whose runtime call returned after the copy: waits


def _sql_step_waits(export: Path) -> list[_Step]:
    """Per vLLM step range, in start order, by plain SQL (_sql_steps, and the copies launched inside the range on
    its thread)."""
    with sqlite3.connect(f"file:{export}?mode=ro", uri=True) as conn:
        copies = dict(conn.execute("""
            SELECT n.start, COUNT(*) FROM NVTX_EVENTS n LEFT JOIN StringIds s ON s.id = n.textId
            JOIN CUPTI_ACTIVITY_KIND_RUNTIME r ON r.globalTid = n.globalTid AND r.start >= n.start AND r.start < n."end"
            JOIN CUPTI_ACTIVITY_KIND_MEMCPY m ON m.correlationId = r.correlationId
            WHERE COALESCE(s.value, n.text) LIKE ? AND m.copyKind = 2 AND m.dstKind = 0 AND r."end" >= m."end"
            GROUP BY n.start""", (STEP_LIKE,)).fetchall())
    found, rows = [], _sql_steps(export)
    assert len({start for _, start, _, _ in rows}) == len(rows)  # a step's start names it in `copies`
    for name, start, host, kernels in rows:
        context, generation = map(int, re.search(r"context_(\d+)\(.*_generation_(\d+)\(", name).groups())
        phase = align.PREFILL if not generation else align.DECODE if not context else align.MIXED
        first, last = min(k[0] for k in kernels), max(k[1] for k in kernels)
        found.append(_Step(name, phase, last - first, start + host - last >= -steps.HELD_SHARE * (last - first),
                           copies.get(start, 0)))
    return found


def _paired_step_waits(run: Path) -> dict[str, list[tuple[_Step, _Step]]]:
    """Per phase, the (fp8, nvfp4) steps of a run directory's manifest exports paired as kvtrace pairs them: run k
    with run k, the i-th step of a name in one arm with the i-th of that name in the other."""
    arms = json.loads((run / "manifest.json").read_text())["arms"]
    paired: dict[str, list[tuple[_Step, _Step]]] = defaultdict(list)
    for label in sorted(arms):
        if not label.startswith("fp8."):
            continue
        named = []
        for arm in (label, "nvfp4." + label.removeprefix("fp8.")):
            by_name = defaultdict(list)
            for step in _sql_step_waits(run / arms[arm]["sqlite"]):
                by_name[step.name].append(step)
            named.append(by_name)
        for name, mine in named[0].items():
            for pair in zip(mine, named[1].get(name, [])):
                paired[pair[0].phase].append(pair)
    return paired


def test_the_matrix_names_the_host_time_where_the_report_does(shared):
    """Over the H100 matrix's four scenarios: a `steps` claim exactly where a scenario's report states its steps
    waiting on the host, which plain SQL finds where nvfp4's host stayed in more paired steps than fp8's and made
    device-to-host copies into pageable memory that fp8's did not: every scenario's prefill and mixed steps in this
    recording. A claim of time the host added only where the span verdict is a regression (cold prefill's paired
    prefill steps, each longer in nvfp4 by SQL); a claim of what held the host says the span is not measured as
    longer (where it is not, and where one paired step, as in the sweep's, gives the span no interval)."""
    from kvtrace.analyzer.render.matrix import claim_text

    result = shared.matrix([MATRIX_RUNS[name] for name in sorted(MATRIX_RUNS)])
    claims = [c for c in result.claims if c.kind == "steps"]
    stated = {(s.name, row.phase): row.host_reading for s in result.scenarios for row in s.report.step_timeline
              if row.host_reading}
    assert {(c.scenario, c.step.phase) for c in claims} == set(stated)
    assert {scenario.split()[0] for scenario, _ in stated} == set(MATRIX_RUNS) - {"preemption"} | {"decode-heavy"}
    paired = {}
    for s in result.scenarios:
        (run,) = s.runs
        paired.update({(s.name, phase): pairs for phase, pairs in _paired_step_waits(Path(run)).items()})
    expected = {key for key, pairs in paired.items() if sum(c.held for _, c in pairs) > sum(b.held for b, _ in pairs)
                and sum(b.copies for b, _ in pairs) == 0 < sum(c.copies for _, c in pairs)}
    assert expected and set(stated) == expected
    assert all(row.steps == len(paired[(s.name, row.phase)])
               for s in result.scenarios for row in s.report.step_timeline)
    for claim in claims:
        scenario = next(s for s in result.scenarios if s.name == claim.scenario)
        # The report's steps are each run's manifest export: the first point's traced pass; only its row is claimed.
        assert claim.rows == (scenario.points[0].row,)
        text = claim_text(claim, result)
        assert "not a slower kernel" in text
        if claim.step.host_reading == steps.LONGER_BY_HOST:
            assert claim.step.span_verdict == Verdict.REGRESSION and steps.host_bound(claim.step)
        else:
            assert claim.step.host_reading == steps.HELD_BY_WAIT and claim.step.span_verdict != Verdict.REGRESSION
            assert "is not measured as longer: what holds the host" in text
    # Both readings occur, so both branches above ran. Longer by host time: cold prefill's 14 paired prefill steps,
    # each spanning longer in nvfp4.
    longer = {key for key, reading in stated.items() if reading == steps.LONGER_BY_HOST}
    assert longer == {("cold-prefill (serve)", align.PREFILL)}
    assert all(c.span > b.span for key in longer for b, c in paired[key])
    # One paired step (the sweep's prefill and mixed) gives the span no interval: only what held the host is said.
    single = {key for key in stated if len(paired[key]) == 1}
    assert single and all(stated[key] == steps.HELD_BY_WAIT for key in single)
