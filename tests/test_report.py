"""`kvtrace report`: the kernel diff beside serving metrics, on the real FlashInfer run directories, the recorded
vLLM manifests in fixtures/vllm-recorded-report/ and the real serve-mode vLLM runs (fixtures/vllm-h200-serve).
Kernel numbers are checked against plain SQL over the same exports, serving numbers against the manifests' own
fields and the real runs' bench JSON and /metrics pages, the guard rail against the capacity-win example and the
real prefix-reuse pair."""

from __future__ import annotations

import copy
import csv
import io
import json
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner
from rich.console import Console

from conftest import (MATRIX_RUNS, NSYS2023_DIR, NSYS2025_DIR, PACKED_RUNS, RECORDED_REPORT, REPEAT, SERVE_RUNS,
                      VLLM033_8B_RUNS, VLLM033_RUNS, VLLM_COLD_PREFILL, VLLM_DECODE_HEAVY, deciding_on_any_run_pairs,
                      sql_durations)
from kvtrace.analyzer import align, headline, report, runs, serving, statements
from kvtrace.analyzer.export_tables import EXPORT_TABLES
from kvtrace.analyzer.render import json_out, render_table, render_text
from kvtrace.analyzer.render.statements import text as statement_text
from kvtrace.analyzer.render.units import duration
from kvtrace.analyzer.stats.verdicts import Verdict
from kvtrace.cli import cli, main
from kvtrace.errors import KvtraceError

RECORDED = RECORDED_REPORT
CAPACITY_WIN = RECORDED / "capacity-win"
SWEEP = RECORDED / "sweep"
VLLM_H200 = [VLLM_COLD_PREFILL, VLLM_DECODE_HEAVY]  # the offline vLLM 0.26 runs

PREFILL = "%BatchPrefillWithPagedKVCacheKernel%MaskMode)1%"
DECODE = "%BatchPrefillWithPagedKVCacheKernel%MaskMode)0%"
MERGE = "%MergeStates%"
APPEND = "%AppendPagedKVCache%"


def sql(path, query: str, *args) -> list[tuple]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return conn.execute(query, args).fetchall()


def manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


def run_main(args: list) -> object:
    """kvtrace's real entry point (one-line errors, exit codes) in-process."""
    return CliRunner().invoke(click.Command("kvtrace", callback=lambda: main([str(a) for a in args])), [])


@pytest.fixture(scope="module")
def recipes(shipped_recipes):
    return shipped_recipes


@pytest.fixture(scope="module")
def fi(fi_h200_report):
    return fi_h200_report


@pytest.fixture(scope="module")
def win(shared):
    return shared.report([CAPACITY_WIN])


@pytest.fixture(scope="module")
def sweep(sweep_report):
    return sweep_report


# ---- the FlashInfer run directory (the demo input) ------------------------------------------------------

def test_one_flashinfer_run_directory_compares_its_two_arms(fi):
    assert (fi.baseline.arm, fi.candidate.arm) == ("fp8", "nvfp4")  # wider format first
    assert fi.baseline.sqlite == str(NSYS2025_DIR / "fp8.sqlite")
    assert (fi.baseline.engine, fi.baseline.kv_format, fi.candidate.kv_format) == ("flashinfer", "fp8", "nvfp4")
    assert fi.diff.schema == "kvtrace.diff/4" and fi.serving == []
    assert fi.baseline.runs == (str(NSYS2025_DIR / "fp8.sqlite"),) and fi.diff.runs == 1
    assert any("no serving metrics" in note for note in fi.notes)


def test_prefill_segment_times_match_plain_sql(fi):
    """Prefill spans three contexts (2 ms to 468 ms per call): the report's segment times give each arm's total
    over the paired calls with the diff's interval, no pooled per-call mean."""
    base, cand = sql_durations(NSYS2025_DIR / "fp8.sqlite", PREFILL), sql_durations(NSYS2025_DIR / "nvfp4.sqlite", PREFILL)
    row = next(r for r in fi.segment_times if r.segment == "prefill_attention")
    assert row.baseline_total_ns == sum(base) and row.candidate_total_ns == sum(cand)
    assert row.baseline_mean_ns is None and row.candidate_mean_ns is None and row.cells == 3
    assert row.ratio == pytest.approx(sum(cand) / sum(base))
    assert row.baseline_ci_low < sum(base) < row.baseline_ci_high
    segment = next(r for r in fi.diff.segments if r.segment == "prefill_attention")
    assert (row.baseline_ci_low, row.baseline_ci_high) == (segment.baseline.total_low_ns, segment.baseline.total_high_ns)
    gemm = next(r for r in fi.segment_times if r.segment == "gemm")  # one GEMM shape in three ranges: per call
    assert gemm.baseline_mean_ns == pytest.approx(np.mean(sql_durations(NSYS2025_DIR / "fp8.sqlite", "nvjet%")))


def test_prefill_statements_are_per_context_and_match_plain_sql(fi):
    """One prefill statement per context, per call inside its kvtrace:prefill range; none pooled across the
    three contexts (2 ms to 468 ms per call)."""
    ranges = [p["nvtx"] for p in manifest(NSYS2025_DIR)["arms"]["fp8"]["workload"]["phases"]
              if p["nvtx"].startswith("kvtrace:prefill ")]
    said = [s for s in fi.statements if s.check == "prefill"]
    assert [s.phase for s in said] == ranges and len(said) == 3
    for statement, nvtx in zip(said, ranges):
        base, cand = (sql_durations(NSYS2025_DIR / f"{arm}.sqlite", PREFILL, nvtx=nvtx) for arm in ("fp8", "nvfp4"))
        context = int(re.search(r"ctx=(\d+)", nvtx).group(1))
        assert (statement.point, statement.context, statement.per_call) == (f"ctx={context}", context, True)
        assert (statement.baseline_ns, statement.candidate_ns) == pytest.approx((np.mean(base), np.mean(cand)))
        assert statement.ratio == pytest.approx(sum(cand) / sum(base)) and statement.compared_calls == len(base)
        words = statement_text(statement)
        assert words.startswith(f"prefill attention kernels (ctx={context}): {duration(np.mean(base))} (fp8) → "
                                f"{duration(np.mean(cand))} (nvfp4) per call, {statement.ratio:.3f}×")
        assert statement.level == "warning" and f"regression over {len(base):,} paired calls" in words


@pytest.mark.parametrize("run", [NSYS2025_DIR, VLLM_DECODE_HEAVY], ids=lambda p: p.name)
def test_kernel_statements_are_the_heads_rows(run, recipes):
    """Prefill, decode, append kernel and append phase: one statement per row of the diff's head, with its
    point, numbers and verdict, so that head and statements cannot disagree; a row over cells of different
    cost per call is worded as a total over those cells."""
    result = report.build([run], recipes)
    heads = [r for r in headline.head_rows(result.diff) if r.question != headline.CONTROL]
    said = [s for s in result.statements if s.kind == "kernels"]
    assert len(said) == len(heads) and len({(s.check, s.point, s.kernels) for s in said
                                            if s.subject != "append_phase"}) == \
        len([s for s in said if s.subject != "append_phase"])
    for statement, head in zip(said, heads):
        row = head.row
        assert (statement.point, statement.phase, statement.verdict, statement.compared_calls) == (
            head.point, row.phase, row.verdict, row.compared_calls)
        assert (statement.ratio, statement.ci_low, statement.ci_high) == (row.ratio, row.ci_low, row.ci_high)
        side = "mean_ns" if row.same_work else "total_ns"
        assert (statement.baseline_ns, statement.candidate_ns) == (getattr(row.baseline, side),
                                                                  getattr(row.candidate, side))
        words = statement_text(statement)
        assert ("per call" in words or "per append call" in words) == row.same_work
        assert (f"in total over {row.cells:,} cells" in words) == (not row.same_work)


def test_ecdf_durations_are_the_traces_per_call_durations_per_cell(fi):
    for segment, likes in (("prefill_attention", (PREFILL,)), ("decode_attention", (DECODE, MERGE))):
        for side, name in (("baseline", "fp8"), ("candidate", "nvfp4")):
            cells = [cell for cell in fi.durations if cell[0] == segment]
            assert len({(phase, family) for _, phase, family in cells}) == len(cells)
            pooled = sorted(v for cell in cells for v in fi.durations[cell][side].tolist())
            assert pooled == sorted(sql_durations(NSYS2025_DIR / f"{name}.sqlite", *likes)), (segment, side)
            for phase in {phase for _, phase, _ in cells}:  # a range's cells hold that range's calls only
                in_phase = sorted(v for cell in cells if cell[1] == phase for v in fi.durations[cell][side].tolist())
                assert in_phase == sorted(sql_durations(NSYS2025_DIR / f"{name}.sqlite", *likes, nvtx=phase))


def test_bandwidth_per_phase_from_the_manifest_bytes_and_sql_time(fi):
    data = manifest(NSYS2025_DIR)
    ceiling = sql(NSYS2025_DIR / "fp8.sqlite", "SELECT memoryBandwidth FROM TARGET_INFO_GPU WHERE id IN "
                  "(SELECT DISTINCT deviceId FROM CUPTI_ACTIVITY_KIND_KERNEL)")[0][0]
    assert fi.hbm_ceiling.bytes_per_s == ceiling and "TARGET_INFO_GPU" in fi.hbm_ceiling.source
    likes = {"decode": (DECODE, MERGE), "append": (APPEND,)}  # prefill: tests/test_roofline.py
    phases = [p for p in data["arms"]["fp8"]["workload"]["phases"] if p["nvtx"].split(":")[1].split()[0] in likes]
    assert [r.phase for r in fi.bandwidth] == sorted((p["nvtx"] for p in phases),
                                                      key=lambda n: (list(likes).index(n.split(":")[1].split()[0]),
                                                                     int(n.split("ctx=")[1].split()[0])))
    for row in fi.bandwidth:
        for side, arm in (("baseline", "fp8"), ("candidate", "nvfp4")):
            phase = next(p for p in data["arms"][arm]["workload"]["phases"] if p["nvtx"] == row.phase)
            total = sum(sql_durations(NSYS2025_DIR / f"{arm}.sqlite", *likes[row.kind], nvtx=row.phase))
            per_call = total / phase["calls"]
            assert getattr(row, f"{side}_bytes_per_call") == phase["bytes_per_call"]
            assert getattr(row, f"{side}_ns_per_call") == pytest.approx(per_call)
            assert getattr(row, f"{side}_bytes_per_s") == pytest.approx(phase["bytes_per_call"] / per_call * 1e9)
            assert getattr(row, f"{side}_fraction_of_ceiling") == pytest.approx(
                phase["bytes_per_call"] / per_call * 1e9 / ceiling)


def _append_phase_statements(result) -> dict[int, statements.KernelStatement]:
    return {s.context: s for s in result.statements if s.kind == "kernels" and s.subject == statements.APPEND_PHASE}


def test_append_phase_statement_counts_every_kernel_in_the_append_ranges(fi):
    """One statement per context, every kernel in its kvtrace:append range per workload call, with the diff's
    interval and verdict: the numbers of the diff's head, never a ratio pooled across contexts."""
    data = manifest(NSYS2025_DIR)
    said = _append_phase_statements(fi)
    phases = {arm: [p for p in data["arms"][arm]["workload"]["phases"] if p["nvtx"].startswith("kvtrace:append ")]
              for arm in ("fp8", "nvfp4")}
    contexts = [int(re.search(r"ctx=(\d+)", p["nvtx"]).group(1)) for p in phases["fp8"]]
    assert sorted(said) == sorted(contexts) and len(said) == 3
    for index, (phase, context) in enumerate(zip(phases["fp8"], contexts)):
        per_call = {arm: sum(sql_durations(NSYS2025_DIR / f"{arm}.sqlite", "%", nvtx=phases[arm][index]["nvtx"]))
                    / phases[arm][index]["calls"] for arm in ("fp8", "nvfp4")}
        statement = said[context]
        assert (statement.baseline_ns, statement.candidate_ns) == pytest.approx((per_call["fp8"], per_call["nvfp4"]))
        assert statement.ratio == pytest.approx(per_call["nvfp4"] / per_call["fp8"])
        assert statement.ci_low < statement.ratio < statement.ci_high and statement.verdict == Verdict.IMPROVEMENT
        assert statement.compared_calls == phase["calls"]
        words = statement_text(statement)
        assert words.startswith(f"append phase at ctx={context}, every kernel in the kvtrace:append ranges")
        assert f"{duration(per_call['fp8'])} (fp8) → {duration(per_call['nvfp4'])} (nvfp4) per append call" in words
        assert f"{statement.ratio:.3f}× [{statement.ci_low:.3f}, {statement.ci_high:.3f}], improvement" in words


def test_capacity_in_the_report_uses_the_runs_shape(fi):
    workload = manifest(NSYS2025_DIR)["arms"]["fp8"]["workload"]
    context = workload["contexts"][0]
    per_token = context["kv_bytes_read_per_attention_call"] / (workload["settings"]["batch"] * context["context"])
    assert fi.capacity.formats[0].bytes_per_token == per_token
    assert fi.capacity.ideal_ratio == 0.5625 and fi.capacity.measured == []
    assert statement_text(next(s for s in fi.statements if s.check == "capacity")).count("1.78×") == 1


def test_json_is_the_result_object(fi):
    data = json.loads(json_out.render(fi))
    assert data["schema"] == "kvtrace.report/4" and data["diff"]["schema"] == "kvtrace.diff/4"
    assert "durations" not in data
    assert {"statements", "findings", "segment_times", "serving", "bandwidth", "hbm_ceiling", "capacity",
            "plots", "baseline", "candidate", "sweep", "notes"} <= set(data)
    assert data["capacity"]["schema"] == "kvtrace.capacity/2"
    assert len(data["bandwidth"]) == len(fi.bandwidth)
    # Statements carry numbers, not words: the append phase per context is the diff's phase-total row.
    appends = [s for s in data["statements"] if s["kind"] == "kernels" and s["subject"] == "append_phase"]
    rows = {r["phase"]: r for r in data["diff"]["phase_totals"]}
    assert appends and all("message" not in s for s in data["statements"])
    for statement in appends:
        row = rows[statement["phase"]]
        assert (statement["ratio"], statement["ci_low"], statement["ci_high"], statement["compared_calls"]) == (
            row["ratio"], row["ci_low"], row["ci_high"], row["compared_calls"])
        assert statement["baseline_ns"] == row["baseline"]["mean_ns"]


def test_two_run_directories_one_arm_each(recipes):
    result = report.build([NSYS2025_DIR, REPEAT], recipes, arms=("fp8",))
    assert (result.baseline.label, result.candidate.label) == ("fi-h200-sm90/fp8", "fi-h200-sm90-repeat/fp8")
    prefill = next(r for r in result.diff.segments if r.segment == "prefill_attention")
    assert prefill.verdict == Verdict.NO_CHANGE  # a same-format repeat (fixtures/README.md)
    assert not any(s.check == "capacity" for s in result.statements)  # same format: nothing to say
    named = runs.resolve_inputs([NSYS2025_DIR / "fp8", REPEAT / "nvfp4"])
    assert [(i.run, i.arm) for i in named] == [(NSYS2025_DIR, "fp8"), (REPEAT, "nvfp4")]
    both = runs.resolve_inputs([NSYS2025_DIR, REPEAT], ("nvfp4", "fp8"))
    assert [i.arm for i in both] == ["nvfp4", "fp8"]
    chosen = runs.resolve_inputs([NSYS2025_DIR], ("nvfp4", "fp8"))  # --arm twice: the user's order
    assert [i.arm for i in chosen] == ["nvfp4", "fp8"]


# ---- serving metrics, the guard rail and sweeps (recorded vLLM manifests) ---------------------------------

def test_serving_metrics_come_from_the_manifest(win):
    data = manifest(CAPACITY_WIN)
    assert len(win.serving) == 1
    row = win.serving[0]
    assert row.point == data["settings"]["points"][0]
    for side, arm in (("baseline", "fp8"), ("candidate", "nvfp4")):
        metrics = getattr(row, side)
        point = data["arms"][arm]["points"][0]
        bench, counters = point["bench"], point["metrics"]["deltas"]["counters"]
        peaks = point["metrics"]["peaks"]
        assert (metrics.ttft_ms.p50, metrics.ttft_ms.p90, metrics.ttft_ms.p99, metrics.ttft_ms.mean) == (
            bench["p50_ttft_ms"], bench["p90_ttft_ms"], bench["p99_ttft_ms"], bench["mean_ttft_ms"])
        assert (metrics.itl_ms.p50, metrics.tpot_ms.p50) == (bench["p50_itl_ms"], bench["p50_tpot_ms"])
        assert metrics.cached_prompt_tokens == counters["vllm:prefix_cache_hits_total"]
        assert metrics.prompt_tokens == counters["vllm:prompt_tokens_total"]
        assert metrics.prefix_hit_rate == (counters["vllm:prefix_cache_hits_total"]
                                           / counters["vllm:prefix_cache_queries_total"])
        assert metrics.input_tokens_per_s == bench["input_throughput"]
        assert metrics.output_tokens_per_s == bench["output_throughput"]
        assert metrics.requests == bench["completed"] and metrics.preemptions == counters["vllm:num_preemptions_total"]
        assert metrics.peak_running == peaks["vllm:num_requests_running"]
        assert metrics.peak_kv_usage == peaks["vllm:kv_cache_usage_perc"]
    assert row.ttft_stat == "p50"
    assert row.ttft_ratio == (data["arms"]["nvfp4"]["points"][0]["bench"]["p50_ttft_ms"]
                              / data["arms"]["fp8"]["points"][0]["bench"]["p50_ttft_ms"])


def test_guard_rail_names_a_capacity_win_as_a_prefix_hit_effect(win):
    data = manifest(CAPACITY_WIN)
    hits = {arm: int(data["arms"][arm]["points"][0]["metrics"]["deltas"]["counters"]["vllm:prefix_cache_hits_total"])
            for arm in ("fp8", "nvfp4")}
    base = sql_durations(NSYS2025_DIR / "fp8.sqlite", PREFILL)
    cand = sql_durations(NSYS2025_DIR / "nvfp4.sqlite", PREFILL)
    ttft = [s for s in win.statements if s.check == "ttft"]
    assert len(ttft) == 1 and ttft[0].level == "warning"
    message = statement_text(ttft[0])
    assert "capacity / prefix-hit effect" in message and "not a faster prefill kernel" in message
    assert f"{hits['nvfp4']:,} cached prompt tokens (nvfp4) against {hits['fp8']:,} (fp8)" in message
    assert f"regressed {np.mean(cand) / np.mean(base):.3f}×" in message
    text = render_text(win, "markdown")
    assert "capacity / prefix-hit effect" in text
    lines = text.splitlines()
    ttft_row = next(i for i, line in enumerate(lines) if line.startswith("| TTFT mean"))
    assert lines[ttft_row + 1].startswith("| cached prompt tokens")  # cached tokens sit beside TTFT
    # Capacity: vLLM's measured tokens beside the ideal.
    assert [m.tokens for m in win.capacity.measured] == [data["arms"][a]["kv_cache"]["tokens"] for a in ("fp8", "nvfp4")]


def _variant(tmp_path: Path, source: Path, edit) -> Path:
    """A synthetic copy of a recorded manifest changed by `edit` (which may point an arm at any export by its
    absolute path); the exports are copied in, since a run directory is read inside itself."""
    data = copy.deepcopy(manifest(source))
    for arm in data["arms"].values():
        if arm.get("sqlite"):
            arm["sqlite"] = str((source / arm["sqlite"]).resolve())
    edit(data)
    run = tmp_path / f"synthetic-{source.name}"
    run.mkdir()
    for name, arm in data["arms"].items():
        if arm.get("sqlite"):
            shutil.copy2(arm["sqlite"], run / f"{name}.sqlite")
            arm["sqlite"] = f"{name}.sqlite"
        for point in arm.get("points") or []:  # the bench result files, which keep the per-request samples
            if (source / point.get("bench_result", "")).is_file() and point.get("bench_result"):
                shutil.copy2(source / point["bench_result"], run / point["bench_result"])
    (run / "manifest.json").write_text(json.dumps(data))
    return run


def test_guard_rail_stays_quiet_or_changes_its_words_when_the_case_differs(tmp_path, recipes):
    def same_cache(data):
        hits = data["arms"]["fp8"]["points"][0]["metrics"]["deltas"]["counters"]["vllm:prefix_cache_hits_total"]
        data["arms"]["nvfp4"]["points"][0]["metrics"]["deltas"]["counters"]["vllm:prefix_cache_hits_total"] = hits
        data["arms"]["nvfp4"]["points"][0]["capacity"] = data["arms"]["fp8"]["points"][0]["capacity"] = None
        data["arms"]["fp8"]["points"][0]["metrics"]["peaks"]["vllm:kv_cache_usage_perc"] = 0.5

    result = report.build([_variant(tmp_path, CAPACITY_WIN, same_cache)], recipes)
    message = statement_text(next(s for s in result.statements if s.check == "ttft"))
    assert "prefix-hit" not in message and "outside the prefill kernels" in message

    def ttft_worse(data):  # the first run's p50 and the mean the run pairs' estimate reads
        for arm, value in (("fp8", 100.0), ("nvfp4", 150.0)):
            data["arms"][arm]["points"][0]["bench"].update(p50_ttft_ms=value, mean_ttft_ms=value)

    (tmp_path / "b").mkdir()
    with deciding_on_any_run_pairs():  # the words of a decided point: one run pair decides nothing
        result = report.build([_variant(tmp_path / "b", CAPACITY_WIN, ttft_worse)], recipes)
    statement = next(s for s in result.statements if s.check == "ttft")
    # More hits, slower prefill kernels and a longer TTFT: the hits are a capacity win, never a faster kernel,
    # and they did not make up for the kernels (the real vLLM 0.33 prefix-reuse run, tests/test_vllm033.py).
    message = statement_text(statement)
    assert statement.reading == statements.PREFIX_HIT_SLOWER and "TTFT gain" not in message
    assert "capacity / prefix-hit win for nvfp4, not a faster kernel" in message and "did not make up" in message

    def fp8_traces_only(data):  # same-format traces: prefill kernels not faster (no significant change)
        data["arms"]["nvfp4"]["sqlite"] = str(REPEAT / "fp8.sqlite")

    (tmp_path / "c").mkdir()
    result = report.build([_variant(tmp_path / "c", CAPACITY_WIN, fp8_traces_only)], recipes)
    statement = next(s for s in result.statements if s.check == "ttft")
    assert "capacity / prefix-hit effect" in statement_text(statement) and "not a faster prefill kernel" in statement_text(statement)
    assert "showed no significant change per call" in statement_text(statement)

    def faster_kernels(data):  # the candidate's prefill kernels are the faster ones: TTFT credits neither alone
        data["arms"]["fp8"]["sqlite"], data["arms"]["nvfp4"]["sqlite"] = (str(NSYS2025_DIR / "nvfp4.sqlite"),
                                                                          str(NSYS2025_DIR / "fp8.sqlite"))

    (tmp_path / "d").mkdir()
    result = report.build([_variant(tmp_path / "d", CAPACITY_WIN, faster_kernels)], recipes)
    message = statement_text(next(s for s in result.statements if s.check == "ttft"))
    # One run per arm: too few runs to decide, so no gain is claimed, only what the arms differ in.
    assert "too few runs to decide (one run pair, 3 needed)" in message and "Part of the TTFT gain" not in message
    assert "capacity / prefix-hit effect, not kernel speed" in message and "credits neither alone" in message
    assert "not a faster prefill kernel" not in message

    def fewer_hits(data):  # the faster arm served fewer prompt tokens from the cache: no prefix-hit story
        counters = [data["arms"][arm]["points"][0]["metrics"]["deltas"]["counters"] for arm in ("fp8", "nvfp4")]
        counters[0]["vllm:prefix_cache_hits_total"], counters[1]["vllm:prefix_cache_hits_total"] = (
            counters[1]["vllm:prefix_cache_hits_total"], counters[0]["vllm:prefix_cache_hits_total"])
        data["arms"]["nvfp4"]["points"][0]["capacity"] = data["arms"]["fp8"]["points"][0]["capacity"] = None
        data["arms"]["fp8"]["points"][0]["metrics"]["peaks"]["vllm:kv_cache_usage_perc"] = 0.5

    (tmp_path / "e").mkdir()
    result = report.build([_variant(tmp_path / "e", CAPACITY_WIN, fewer_hits)], recipes)
    message = statement_text(next(s for s in result.statements if s.check == "ttft"))
    assert "prefix-hit effect" not in message and "mixes kernel speed" in message


def test_sweep_has_one_row_per_grid_point_and_marks_first_capacity(sweep):
    data = manifest(SWEEP)
    assert sweep.sweep and [r.point for r in sweep.serving] == data["settings"]["points"]
    for side, arm in (("baseline", "fp8"), ("candidate", "nvfp4")):
        tokens = data["arms"][arm]["kv_cache"]["tokens"]
        first: dict = {}
        for point in data["arms"][arm]["points"]:
            spec = dict(item.split("=") for item in point["point"].split(","))
            context, concurrency = int(spec["input"]), int(spec["concurrency"])
            preempted = point["metrics"]["deltas"]["counters"]["vllm:num_preemptions_total"] > 0
            full = point["metrics"]["peaks"]["vllm:kv_cache_usage_perc"] >= 0.95
            demand = concurrency * (context + int(spec["output"])) >= 0.95 * tokens
            if (preempted or full or demand) and (context not in first or concurrency < first[context][0]):
                first[context] = (concurrency, point["point"])
        marked = {r.point for r in sweep.serving if getattr(r, f"{side}_first_capacity")}
        assert marked == {spec for _, spec in first.values()}, side
    assert any(r.baseline_first_capacity for r in sweep.serving)  # fp8 runs out of KV in this sweep
    text = render_text(sweep, "markdown")
    assert text.count("◆ fp8") == sum(r.baseline_first_capacity for r in sweep.serving)
    assert any(s.check == "ttft" and "capacity-bound" in statement_text(s) for s in sweep.statements)


@pytest.mark.parametrize("run", VLLM_H200, ids=[p.name for p in VLLM_H200])
def test_real_vllm_run_directories(run, recipes):
    data = manifest(run)
    ok = [name for name, arm in data["arms"].items() if arm["status"] == "ok"]
    if len(ok) < 2:
        pytest.skip(f"{run.name}: fewer than two arms ok")
    result = report.build([run], recipes, arms=tuple(ok[:2]) if len(data["arms"]) > 2 else ())
    points = {p["point"]: p for p in data["arms"][result.baseline.arm]["points"]}
    assert {r.point for r in result.serving} >= set(points)
    for row in result.serving:
        record = points.get(row.point)
        if record and "cached_tokens" in record:
            assert row.baseline.cached_prompt_tokens == record["cached_tokens"]
        if record and "tokens_in" in record:
            assert row.baseline.prompt_tokens == record["metrics"]["deltas"]["counters"].get(
                "vllm:prompt_tokens_total", record["tokens_in"])
            # The offline worker's own counts against vLLM's counters: the same requests and tokens.
            checks = {check.quantity: check for check in row.baseline.checks}
            assert checks["prompt tokens"].first_value == record["tokens_in"]
            assert checks["output tokens"].first_value == record["tokens_out"]
            assert all(check.agree for check in checks.values()), checks
    if result.capacity and result.capacity.measured:
        assert result.capacity.measured[0].tokens == data["arms"][result.baseline.arm]["kv_cache"]["tokens"]


# ---- CLI and bad inputs ---------------------------------------------------------------------------------

def test_cli_writes_markdown_json_and_csv(tmp_path):
    runner = CliRunner()
    out = tmp_path / "report.md"
    # The example's manifest lists the FlashInfer exports by relative path, outside its run directory.
    beside = ["--exports-from", str(NSYS2025_DIR)]
    result = runner.invoke(cli, ["report", str(CAPACITY_WIN), *beside, "--format", "markdown", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text().startswith("## kvtrace report: fp8 → nvfp4")
    data = json.loads(runner.invoke(cli, ["report", str(CAPACITY_WIN), *beside, "--format", "json"]).stdout)
    points = {arm: manifest(CAPACITY_WIN)["arms"][arm]["points"][0] for arm in ("fp8", "nvfp4")}
    assert data["serving"][0]["baseline"]["ttft_ms"]["p50"] == points["fp8"]["bench"]["p50_ttft_ms"]
    rows = list(csv.DictReader(io.StringIO(
        runner.invoke(cli, ["report", str(CAPACITY_WIN), *beside, "--format", "csv"]).stdout)))
    cached = [r for r in rows if r["section"] == "serving" and r["metric"] == "cached_prompt_tokens"]
    assert {r["arm"]: float(r["value"]) for r in cached} == {
        arm: point["metrics"]["deltas"]["counters"]["vllm:prefix_cache_hits_total"] for arm, point in points.items()}
    table = runner.invoke(cli, ["report", str(CAPACITY_WIN), *beside, "--label", "A", "--label", "B"])
    assert table.exit_code == 0 and "A" in table.stdout and "prefix-hit effect" in table.stdout


def test_the_head_is_printed_once_and_the_whole_diff_follows(fi):
    """The report opens with the diff's head; its kernel-diff section holds the rest of the diff, not the head
    again."""
    text = render_text(fi, "markdown")
    assert text.count("The answer: nvfp4 against fp8") == 1 and text.count("### Environment") == 1
    assert text.index("### The answer") < text.index("### Kernel diff") < text.index("#### Segments by phase")
    assert text.count("<details>") == text.count("</details>")
    buffer = io.StringIO()
    render_table(fi, Console(file=buffer, width=200))
    table = buffer.getvalue()
    assert table.count("ratio nvfp4/fp8 with its") == 1 and "Segments by phase (NVTX range)" in table
    # As in markdown, the rest of the diff comes under its own label, after the report's own sections.
    lines = table.splitlines()
    assert lines.count("Kernel diff") == 1
    assert table.index("Achieved compute (prefill)") < table.index("\nKernel diff\n") < \
        table.index("total GPU kernel time") < table.index("Segments by phase")


def test_statement_names_are_escaped_for_each_format(recipes):
    """Statements carry the labels as data; each renderer makes them inert its own way."""
    result = report.build([NSYS2025_DIR], recipes, labels=("<b>fp8*", "\x1b[31mnv"))
    said = [line for line in render_text(result, "markdown").splitlines() if re.match(r"- \S+ \*\*append\*\*", line)]
    assert said and all("(\\<b\\>fp8\\*) → " in line and "(\\\\x1b\\[31mnv)" in line for line in said)
    buffer = io.StringIO()
    render_table(result, Console(file=buffer, width=400, force_terminal=True))
    assert "\x1b[31mnv" not in buffer.getvalue() and "(\\x1b[31mnv) per append call" in buffer.getvalue()
    rows = [r for r in csv.reader(io.StringIO(render_text(result, "csv"))) if r[0] == "statement"]
    assert any("(<b>fp8*) → " in r[4] and "(\\x1b[31mnv)" in r[4] for r in rows)


def test_each_format_is_dispatched_by_result_type_and_an_unknown_type_is_refused(fi):
    assert render_text(fi.capacity, "csv").startswith("section,label,")
    assert render_text(fi.diff, "csv").startswith("level,segment,phase,")
    with pytest.raises(KvtraceError, match=r"^--format csv is not available for a Headline result: use "):
        render_text(fi.diff.headline or headline.Headline.of(fi.diff), "csv")


def _copy_run(tmp_path: Path, edit=None) -> Path:
    run = tmp_path / "run"
    shutil.copytree(NSYS2025_DIR, run, ignore=shutil.ignore_patterns("*.nsys-rep", "*.log"))
    if edit:
        data = manifest(run)
        edit(data)
        (run / "manifest.json").write_text(json.dumps(data))
    return run


@pytest.mark.parametrize("case,message", [
    ("empty", "has no manifest.json"),
    ("foreign", "was not written by kvtrace"),
    ("failed", "arm fp8 in"),
    ("missing-sqlite", "is missing"),
    ("trace", "is a file"),
    ("three", "got 3"),
    ("one-arm", "names one arm"),
    ("unknown-arm", "has no arm 'int4'"),
])
def test_bad_inputs_are_one_line_and_exit_2(tmp_path, case, message):
    if case == "empty":
        (tmp_path / "empty").mkdir()
        args = [tmp_path / "empty"]
    elif case == "foreign":
        (tmp_path / "foreign").mkdir()
        (tmp_path / "foreign" / "manifest.json").write_text('{"name": "something else"}')
        args = [tmp_path / "foreign"]
    elif case == "failed":
        args = [NSYS2023_DIR]  # a real run whose arms the runner recorded as failed (fixtures/README.md)
    elif case == "missing-sqlite":
        run = _copy_run(tmp_path)
        (run / "nvfp4.sqlite").unlink()
        args = [run]
    elif case == "trace":
        args = [NSYS2025_DIR / "fp8.sqlite"]
    elif case == "three":
        args = [NSYS2025_DIR, REPEAT, NSYS2025_DIR]
    elif case == "one-arm":
        args = [NSYS2025_DIR / "fp8"]
    else:
        args = [NSYS2025_DIR, "--arm", "fp8", "--arm", "int4"]
    out = run_main(["report", *args])
    assert out.exit_code == 2, out.output
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: ") and message in lines[0], out.stderr
    if case == "failed":
        assert "failed" in lines[0] and manifest(NSYS2023_DIR)["arms"]["fp8"]["error"] in lines[0]


def test_resolve_errors_name_the_fix():
    with pytest.raises(KvtraceError, match="pick one with --arm"):
        runs.resolve_inputs([NSYS2025_DIR, REPEAT])
    with pytest.raises(KvtraceError, match="one run directory and one --arm"):
        runs.resolve_inputs([NSYS2025_DIR], ("fp8",))


@pytest.mark.slow
def test_subprocess_smoke(tmp_path):
    """The installed entry point end to end, as `make demo` runs it."""
    out = tmp_path / "demo-report.md"
    result = subprocess.run([sys.executable, "-m", "kvtrace", "report", str(NSYS2025_DIR), "--format", "markdown",
                             "-o", str(out), "--plots", str(tmp_path / "plots")], capture_output=True, text=True,
                            cwd=tmp_path, check=False)
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert "Drag `plots/summary.png` into the issue" in text and (tmp_path / "plots" / "summary.png").is_file()


def test_offline_point_records_give_means_and_rates():
    """A synthetic offline-mode point (the vLLM engine's worker record: counts, cached tokens, vLLM's histogram
    deltas, no client percentiles): means come from the histograms, rates from counts over wall time."""
    record = {"point": "input=1024,output=8,prompts=16,concurrency=16", "elapsed_s": 2.5, "requests": 16,
              "tokens_in": 16 * 1024, "tokens_out": 16 * 8, "cached_tokens": 512, "capacity": None,
              "metrics": {"deltas": {"counters": {"vllm:num_preemptions_total": 0.0},
                                     "histograms": {"vllm:time_to_first_token_seconds": {"count": 16.0, "sum": 4.0},
                                                    "vllm:inter_token_latency_seconds": {"count": 112.0, "sum": 2.24}}}}}
    metrics = serving.serving_metrics(record, kv_cache_tokens=None)
    assert metrics.source == "vLLM metrics (offline)"
    assert metrics.ttft_ms.mean == pytest.approx(4.0 / 16 * 1000) and metrics.ttft_ms.p50 is None
    assert metrics.itl_ms.mean == pytest.approx(2.24 / 112 * 1000)
    assert metrics.cached_prompt_tokens == 512 and metrics.prompt_tokens == 16 * 1024
    assert metrics.input_tokens_per_s == 16 * 1024 / 2.5 and metrics.output_tokens_per_s == 16 * 8 / 2.5
    assert metrics.capacity is None
    # The same point against a pool too small for 16 x (1,024 + 8) tokens is capacity-bound (the engine's rule).
    tight = serving.serving_metrics(record, kv_cache_tokens=16 * (1024 + 8))
    assert tight.capacity is not None and "KV tokens needed" in tight.capacity


def test_bandwidth_needs_whole_phases(recipes):
    from kvtrace.analyzer import align

    result = report.build([NSYS2025_DIR], recipes, window=align.Window(skip_warmup=1))
    assert result.bandwidth == [] and any("whole workload phases" in note for note in result.notes)


def test_a_per_arm_manifest_names_its_arm(tmp_path, recipes):
    data = manifest(CAPACITY_WIN)
    for name in ("fp8", "nvfp4"):
        single = {**data, "arms": {name: {**data["arms"][name],
                                          "sqlite": str((CAPACITY_WIN / data["arms"][name]["sqlite"]).resolve())}}}
        (tmp_path / f"{name}.manifest.json").write_text(json.dumps(single))
    inputs = runs.resolve_inputs([tmp_path / "fp8.manifest.json", tmp_path / "nvfp4.manifest.json"])
    assert [(i.run, i.arm) for i in inputs] == [(tmp_path, "fp8"), (tmp_path, "nvfp4")]


# ---- the real serve-mode runs from the H200 (fixtures/vllm-h200-serve, unpacked by conftest) --------------
# Checked against each run's own files, read here without kvtrace: the bench client's JSON, the /metrics pages
# scraped before and after the traffic (summed over label sets by hand), and the server log's capacity line.

def prom(path: Path) -> dict[str, float]:
    """A Prometheus text page as {sample name: value summed over its label sets}."""
    totals: dict[str, float] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            sample, value = line.rsplit(" ", 1)
            name = sample.split("{", 1)[0]
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def recorded_point(run: Path, arm: str, index: int = 0) -> dict:
    """One traffic point as the run's own files record it."""
    entry = manifest(run)["arms"][arm]["points"][index]
    before, after = (prom(run / entry["metrics"][when]) for when in ("before", "after"))
    delta = {name: after[name] - before[name] for name in after if name in before}
    pool = re.search(r'kv_cache_size_tokens="(\d+)"', (run / entry["metrics"]["after"]).read_text())
    return {"point": entry["point"], "bench": json.loads((run / entry["bench_result"]).read_text()), "delta": delta,
            "log_tokens": int(re.search(r"GPU KV cache size: ([\d,]+) tokens", (run / f"{arm}.log").read_text())
                              .group(1).replace(",", "")),
            "metrics_tokens": int(pool.group(1))}


@pytest.fixture(scope="module")
def prefix_reuse(shared):
    return shared.report([SERVE_RUNS["prefix-reuse-auto"], SERVE_RUNS["prefix-reuse-fp8"]])


def test_real_prefix_reuse_serving_metrics_match_the_runs_own_files(prefix_reuse):
    row = prefix_reuse.serving[0]
    for side, arm in (("baseline", "auto"), ("candidate", "fp8")):
        metrics, own = getattr(row, side), recorded_point(SERVE_RUNS[f"prefix-reuse-{arm}"], arm)
        bench, delta = own["bench"], own["delta"]
        assert (metrics.ttft_ms.p50, metrics.ttft_ms.p90, metrics.ttft_ms.p99) == (
            bench["p50_ttft_ms"], bench["p90_ttft_ms"], bench["p99_ttft_ms"])
        assert (metrics.itl_ms.p50, metrics.tpot_ms.p50) == (bench["p50_itl_ms"], bench["p50_tpot_ms"])
        assert metrics.requests == bench["completed"] == delta["vllm:request_success_total"]
        assert metrics.output_tokens_per_s == bench["output_throughput"]
        assert metrics.input_tokens_per_s == pytest.approx(bench["total_input_tokens"] / bench["duration"])
        assert metrics.prompt_tokens == bench["total_input_tokens"] == delta["vllm:prompt_tokens_total"]
        assert metrics.cached_prompt_tokens == delta["vllm:prompt_tokens_cached_total"]
        assert metrics.prefix_hit_rate == pytest.approx(
            delta["vllm:prefix_cache_hits_total"] / delta["vllm:prefix_cache_queries_total"])
        assert metrics.preemptions == delta["vllm:num_preemptions_total"]
        assert metrics.queue_ms == pytest.approx(1000 * delta["vllm:request_queue_time_seconds_sum"]
                                                 / delta["vllm:request_queue_time_seconds_count"])
        # Sub-second traffic against 0.5 s polling: no peak is claimed.
        assert metrics.peak_running is None and metrics.peak_kv_usage is None
        assert f"{bench['duration']:.2f} s of traffic" in metrics.peaks_note
        checks = {check.quantity: check for check in metrics.checks}
        assert checks["completed requests"].agree and checks["prompt tokens"].agree and checks["output tokens"].agree
        cached = checks["cached prompt tokens"]
        assert cached.agree and cached.second_value == (delta["vllm:prompt_tokens_total"]
                                                        - delta["vllm:request_prefill_kv_computed_tokens_sum"])
        pool = checks["KV cache size (tokens)"]
        assert pool.agree and pool.first_value == own["log_tokens"] and pool.second_value == own["metrics_tokens"]


def test_per_request_cached_tokens_are_checked_beside_the_other_cached_token_sources():
    """The server's cached tokens per request (the usage relay's file) are one more source of cached prompt tokens:
    checked against /metrics next to the two /metrics counters' check, not after the unrelated ones. On the H100
    matrix's prefix reuse, the first round's runs."""
    run = MATRIX_RUNS["prefix-reuse"]
    for arm in ("fp8.r1", "nvfp4.r1"):
        record = json.loads((run / "manifest.json").read_text())["arms"][arm]["points"][0]
        served = sum(r["cached_tokens"] for r in json.loads((run / record["requests"]["file"]).read_text())
                     if r.get("status") == 200)
        checks = serving.serving_metrics(record, None, run).checks
        cached = [i for i, c in enumerate(checks) if c.quantity == "cached prompt tokens"]
        assert len(cached) == 2 and cached[1] == cached[0] + 1
        per_request = checks[cached[1]]
        assert per_request.first == "the server, per request (usage.prompt_tokens_details)"
        assert per_request.agree and per_request.first_value == served == per_request.second_value


def test_real_prefix_reuse_hit_rate_disagreement_is_named(prefix_reuse):
    """BF16 (auto) could not keep the 12 prefixes: vLLM looked waiting requests up again and again, so its hit
    rate per lookup is not the share of prompt tokens it served from the cache. FP8's two numbers agree."""
    for side, arm in (("baseline", "auto"), ("candidate", "fp8")):
        delta = recorded_point(SERVE_RUNS[f"prefix-reuse-{arm}"], arm)["delta"]
        queries, prompt = delta["vllm:prefix_cache_queries_total"], delta["vllm:prompt_tokens_total"]
        check = next(c for c in getattr(prefix_reuse.serving[0], side).checks if c.quantity == "prefix-cache hit rate")
        assert check.first_value == pytest.approx(delta["vllm:prefix_cache_hits_total"] / queries)
        assert check.second_value == pytest.approx(delta["vllm:prompt_tokens_cached_total"] / prompt)
        assert check.agree == (queries == prompt)
        if queries > prompt:
            assert f"{queries:,.0f} prefix-cache lookups for {prompt:,.0f} prompt tokens" in check.note
    assert not next(c for c in prefix_reuse.serving[0].baseline.checks if c.quantity == "prefix-cache hit rate").agree
    text = render_text(prefix_reuse, "markdown")
    assert "auto: prefix-cache hit rate disagrees" in text and "| peak running requests | not observed |" in text
    rows = list(csv.DictReader(io.StringIO(render_text(prefix_reuse, "csv"))))
    agree = {r["arm"]: r["value"] for r in rows if r["section"] == "serving_check"
             and r["metric"] == "prefix-cache hit rate: agree"}
    assert agree == {"auto": "False", "fp8": "True"}


def test_real_prefix_reuse_tells_the_capacity_story(prefix_reuse):
    """FP8 served more of its prompts from the prefix cache and had the lower TTFT. On this H200 its prefill
    kernels (FP8 FA3) are also faster per call, so the report credits neither alone, and says which part is
    capacity: the shared prefixes fit FP8's pool and not BF16's."""
    own = {arm: recorded_point(SERVE_RUNS[f"prefix-reuse-{arm}"], arm) for arm in ("auto", "fp8")}
    cached = {arm: int(p["delta"]["vllm:prompt_tokens_cached_total"]) for arm, p in own.items()}
    prompt = {arm: int(p["delta"]["vllm:prompt_tokens_total"]) for arm, p in own.items()}
    p50 = {arm: p["bench"]["p50_ttft_ms"] for arm, p in own.items()}
    assert cached["fp8"] > cached["auto"] and p50["fp8"] < p50["auto"]  # what the run shows
    spec = dict(item.split("=") for item in own["fp8"]["point"].split(","))
    shared = int(spec["prefix"]) * int(spec["prefixes"])
    assert own["auto"]["log_tokens"] < shared <= own["fp8"]["log_tokens"]
    statement = next(s for s in prefix_reuse.statements if s.check == "ttft")
    message = statement_text(statement)
    assert statement.level == "warning"
    assert f"TTFT p50 {p50['auto']:.1f} ms (auto) → {p50['fp8']:.1f} ms (fp8), {p50['fp8'] / p50['auto']:.3f}×" in message
    assert f"{cached['fp8']:,} cached prompt tokens (fp8) against {cached['auto']:,} (auto)" in message
    assert (f"the {spec['prefixes']} shared prefixes ({shared:,} tokens) fit fp8's {own['fp8']['log_tokens']:,}-token "
            f"KV cache and not auto's {own['auto']['log_tokens']:,}") in message
    assert f"fp8 prefilled {prompt['fp8'] - cached['fp8']:,} prompt tokens against {prompt['auto'] - cached['auto']:,}" in message
    assert "capacity / prefix-hit effect, not kernel speed" in message
    prefill = next(r for r in prefix_reuse.diff.segments if r.segment == "prefill_attention")
    # The arms prefilled different amounts, so most prefill calls have no partner ("different work"); the
    # matched ones say the kernel (FA3 with FP8 queries) is faster on this GPU too.
    assert (prefill.verdict, prefill.paired_verdict) == (Verdict.DIFFERENT_WORK, Verdict.IMPROVEMENT)
    assert f"faster per matched call ({prefill.ratio:.3f}× over {prefill.compared_calls:,} paired calls)" in message
    assert "credits neither alone" in message
    capture = next(f for f in prefix_reuse.findings if f.check == "capture")
    assert capture.level == "warning" and "separate captures" in capture.message and "same GPU" in capture.message


def test_real_sweep_marks_where_each_arm_first_reaches_capacity(recipes):
    runs = {arm: SERVE_RUNS[f"sweep-{arm}"] for arm in ("auto", "fp8")}
    result = report.build([runs["auto"], runs["fp8"]], recipes)
    assert result.sweep
    expected = {}
    for side, arm in (("baseline", "auto"), ("candidate", "fp8")):
        first: dict = {}
        for index, entry in enumerate(manifest(runs[arm])["arms"][arm]["points"]):
            own = recorded_point(runs[arm], arm, index)
            spec = dict(item.split("=") for item in own["point"].split(","))
            context, concurrency = int(spec["input"]), int(spec["concurrency"])
            demand = concurrency * (context + int(spec["output"]))
            if (own["delta"]["vllm:num_preemptions_total"] > 0 or demand >= 0.95 * own["log_tokens"]) \
                    and context not in first:
                first[context] = own["point"]
            row = next(r for r in result.serving if r.point == own["point"])
            metrics = getattr(row, side)
            assert metrics.ttft_ms.p50 == own["bench"]["p50_ttft_ms"] and metrics.queue_ms == pytest.approx(
                1000 * own["delta"]["vllm:request_queue_time_seconds_sum"]
                / own["delta"]["vllm:request_queue_time_seconds_count"])
        expected[side] = set(first.values())
        assert {r.point for r in result.serving if getattr(r, f"{side}_first_capacity")} == expected[side], arm
        assert expected[side]  # each arm reached capacity somewhere in this grid
    statement = next(s for s in result.statements if s.kind == "sweep-capacity")
    for point in expected["baseline"] | expected["candidate"]:
        assert point in statement_text(statement)
    # auto stopped the 2,048-token context at capacity, so it never ran the last point fp8 ran.
    only_fp8 = [r.point for r in result.serving if r.candidate and not r.baseline]
    points = next(f for f in result.findings if f.check == "settings" and "traffic point" in f.message)
    assert only_fp8 and all(point in points.message for point in only_fp8) and "auto had reached capacity" in points.message
    text = render_text(result, "markdown")
    assert text.count("◆ auto") == len(expected["baseline"]) and text.count("◆ fp8") == len(expected["candidate"])


# The real sweeps: vLLM 0.33 (both arms in one run directory) and vLLM 0.26 (one arm each), every point under a
# second of traffic against /metrics polled every 0.5 s (shared/gpu/README.md, "Sweeps in serve mode").
SWEEPS = {"vllm033": ([VLLM033_RUNS["serve-sweep"]], ("fp8", "nvfp4")),
          "vllm026": ([SERVE_RUNS["sweep-auto"], SERVE_RUNS["sweep-fp8"]], ("auto", "fp8"))}


@pytest.mark.parametrize("sweep_name", sorted(SWEEPS))
def test_real_sweep_capacity_rests_only_on_observed_evidence(sweep_name, recipes):
    """An independent pass over each point's bench JSON, /metrics snapshots and log: a point is capacity-bound
    where vLLM preempted (counter delta) or the KV demand of the point's concurrency fills the log's pool. The
    polled peaks of these sub-second points are not observations; no capacity statement rests on them, and no
    cell the report calls "not observed" stands beside a reason drawn from it."""
    paths, arms = SWEEPS[sweep_name]
    result = report.build(paths, recipes)
    text = render_text(result, "markdown")
    for side, arm in zip(("baseline", "candidate"), arms):
        run = next(path for path in paths if arm in manifest(path)["arms"])
        for index, entry in enumerate(manifest(run)["arms"][arm]["points"]):
            own = recorded_point(run, arm, index)
            bench = own["bench"]
            assert bench["duration"] < serving.MIN_PEAK_POLLS * 0.5  # too short for its polls to see peaks
            per_request = (bench["total_input_tokens"] + bench["total_output_tokens"]) / bench["completed"]
            demand = bench["max_concurrency"] * per_request
            preempted = own["delta"]["vllm:num_preemptions_total"]
            metrics = getattr(next(r for r in result.serving if r.point == own["point"]), side)
            assert metrics.peaks_note and metrics.peak_kv_usage is None and metrics.peak_running is None
            if preempted > 0:
                assert metrics.capacity == f"{preempted:g} preemptions"
            elif demand >= 0.95 * own["log_tokens"]:
                assert metrics.capacity == f"{demand:,.0f} KV tokens needed of {own['log_tokens']:,} available"
            else:
                assert metrics.capacity is None, (arm, own["point"])
            assert metrics.capacity_note is None  # the capture's own reasons rest on the same evidence
    assert "peaked" not in text and "cannot tell" not in text


def test_a_capacity_reason_on_unobserved_peaks_is_not_counted(tmp_path, recipes):
    """The serve engine decides capacity on the maxima of every poll; a sub-second point's one poll that read
    97% KV usage is no peak. The report then calls the point neither bound nor free ("cannot tell"), the sweep
    statement and the TTFT reading do not count it, and the matrix takes the same decision from the report."""
    from kvtrace.analyzer import matrix

    point = "input=1024,output=16,prompts=32,concurrency=16"  # 16,640 KV tokens: FP8's 20,480 hold it

    def one_high_poll(data):
        entry = next(p for p in data["arms"]["fp8"]["points"] if p["point"] == point)
        assert entry["metrics"]["busy_polls"] < serving.MIN_PEAK_POLLS and entry["capacity"] is None
        entry["metrics"]["peaks"]["vllm:kv_cache_usage_perc"] = 0.97
        entry["capacity"] = "KV cache usage peaked at 97%"
        for when in ("before", "after"):
            entry["metrics"][when] = str(VLLM033_RUNS["serve-sweep"] / entry["metrics"][when])

    run = _variant(tmp_path, VLLM033_RUNS["serve-sweep"], one_high_poll)
    result = report.build([run], recipes)
    row = next(r for r in result.serving if r.point == point)
    assert row.baseline.capacity is None and not row.baseline_first_capacity
    assert row.baseline.capacity_note.startswith("KV cache usage peaked at 97%: not counted (peaks not observed")
    sweep = next(s for s in result.statements if s.kind == "sweep-capacity")
    assert [f.point for f in sweep.arms[0].first] == ["input=2048,output=16,prompts=32,concurrency=16"]
    ttft = next(s for s in result.statements if s.kind == "ttft" and s.point == point)
    assert ttft.baseline_capacity is None and ttft.reading != statements.CAPACITY_EFFECT
    text = render_text(result, "markdown")
    assert "fp8: cannot tell" in text and "capacity-bound: cannot tell (KV cache usage peaked at 97%: not" in text
    assert "first reaches capacity at input=1024" not in statement_text(sweep)
    decided = matrix.build([run], recipes)
    (judged,) = [p for p in decided.scenarios[0].points if p.point == point]
    assert judged.baseline_capacity is None
    assert judged.capacity_notes == [f"fp8: {row.baseline.capacity_note}"]


def test_real_cold_prefill_arms_ran_the_same_steps_and_pair(run_kvtrace, recipes):
    """One 1,024-token prompt at a time: every engine step is the same in both arms, so `kvtrace diff` pairs
    prefill attention and KV append call for call (not "not comparable")."""
    exports = {arm: SERVE_RUNS[f"cold-prefill-{arm}"] / f"{arm}.sqlite" for arm in ("auto", "fp8")}
    steps = {arm: sql(path, "SELECT text FROM NVTX_EVENTS WHERE text LIKE 'execute_%' ORDER BY start")
             for arm, path in exports.items()}
    assert steps["auto"] == steps["fp8"] and steps["auto"]
    counts = {segment: {arm: len(sql_durations(path, like)) for arm, path in exports.items()}
              for segment, like in (("prefill_attention", "%PrefillWithKVCacheKernel%"),
                                    ("kv_append", "%reshape_and_cache_flash_kernel%"))}
    code, out, err = run_kvtrace("diff", exports["auto"], exports["fp8"], "--format", "json")
    assert code == 0, err
    segments = {row["segment"]: row for row in json.loads(out)["segments"]}
    for segment, per_arm in counts.items():
        assert per_arm["auto"] == per_arm["fp8"] > 0
        row = segments[segment]
        assert row["verdict"] in (Verdict.REGRESSION, Verdict.IMPROVEMENT, Verdict.NO_CHANGE) and row["ratio"], row
        assert row["compared_calls"] == per_arm["auto"]
    result = report.build([SERVE_RUNS["cold-prefill-auto"], SERVE_RUNS["cold-prefill-fp8"]], recipes)
    metrics = result.serving[0].baseline
    assert metrics.itl_ms == serving.Latency() and metrics.tpot_ms == serving.Latency()  # one output token each


def test_polled_peaks_count_as_peaks_only_with_enough_polls_in_the_traffic():
    """Synthetic point records as the serve engine writes them now (busy polls counted) and as the real H200
    runs were written (polls over the point's whole wall time, client start-up included)."""
    def record(**metrics):
        return {"point": "input=1024,output=16,prompts=32,concurrency=8", "seconds": 21.0,
                "bench": {"duration": 0.42, "completed": 32},
                "metrics": {"deltas": {"counters": {}, "histograms": {}}, "polls": 40,
                            "peaks": {"vllm:num_requests_running": 2.0, "vllm:kv_cache_usage_perc": 0.31}, **metrics}}

    few = serving.serving_metrics(record(busy_polls=1, poll_interval_s=0.5), None)
    assert few.peak_running is None and few.peak_kv_usage is None
    assert few.peaks_note == ("peaks not observed: 0.42 s of traffic, /metrics polled about every 0.50 s "
                              "(1 poll saw requests in flight)")
    enough = serving.serving_metrics(record(busy_polls=serving.MIN_PEAK_POLLS, poll_interval_s=0.5), None)
    assert (enough.peak_running, enough.peak_kv_usage, enough.peaks_note) == (2.0, 0.31, None)
    estimated = serving.serving_metrics(record(), None)  # 40 polls in 21 s: one every 0.525 s, about 1 in 0.42 s
    assert estimated.peak_running is None and "about every 0.53 s (about 1 poll inside it)" in estimated.peaks_note


# The packed runs whose exports pack_run.py cut (fixtures/README.md); the others are packed as recorded.
CUT_PACKS = ("vllm-h200-cold-prefill", "vllm-h200-decode-heavy", "fi-h200-sm90-repeat", "fi-h200-sm90-repeats2",
             "fi-h200-sm90-quality", "fi-h200-sm90-gaussian", "fi-h200-sm90-outliers",
             "fi-h100-sm90-gaussian-fi0.7.2.post1")
# The tables a cut export keeps: kvtrace's, and the names of the copy and synchronization kinds.
READ_TABLES = {*EXPORT_TABLES, "ENUM_CUDA_MEMCPY_OPER", "ENUM_CUPTI_SYNC_TYPE"}


@pytest.mark.parametrize("run", [*SERVE_RUNS.values(), *VLLM033_RUNS.values(), *VLLM033_8B_RUNS.values(),
                                 *(PACKED_RUNS[name] for name in CUT_PACKS)], ids=lambda run: run.name)
def test_cut_exports_keep_the_originals_kernel_totals(run):
    """pack_run.py recorded, by plain SQL on the original export, calls and GPU time per kernel and innermost
    NVTX range (or of the steps it kept); kvtrace reads the same from the cut export, which holds no other table."""
    from kvtrace.analyzer.load import open_trace

    cut = json.loads((run / "cut.json").read_text())
    for export, record in cut["exports"].items():
        assert record["rows_dropped"] and record["cut"]["bytes"] < record["original"]["bytes"]
        assert {name for (name,) in sql(run / export, "SELECT name FROM sqlite_master WHERE type = 'table'")} \
            <= READ_TABLES
        trace = open_trace(run / export)
        names = trace.signatures.select("sig", "demangled")
        ranges = trace.ranges.select("range", pl.col("name").alias("range_name"))
        got = (trace.kernels.join(names, on="sig").join(ranges, on="range", how="left")
               .with_columns(pl.col("range_name").fill_null(""))
               .group_by("demangled", "range_name").agg(pl.len().alias("calls"), pl.col("duration").sum())
               .sort("demangled", "range_name"))
        assert [[r["kernel"], r["range"], r["calls"], r["total_ns"]] for r in record["kernel_totals"]] == [
            list(row) for row in got.iter_rows()]


def test_append_phase_statement_inside_a_window_counts_the_windowed_calls(recipes):
    last = 16
    result = report.build([NSYS2025_DIR], recipes, window=align.Window(last=last))
    data = manifest(NSYS2025_DIR)
    said = _append_phase_statements(result)
    for arm in ("fp8", "nvfp4"):
        phases = [p for p in data["arms"][arm]["workload"]["phases"] if p["nvtx"].startswith("kvtrace:append ")]
        for phase in phases:
            # --last keeps the last calls of every kernel and launch shape in each range: written out in SQL.
            rows = sql(NSYS2025_DIR / f"{arm}.sqlite", """
                SELECT s.value, k.gridX, k.gridY, k.gridZ, k.blockX, k.blockY, k.blockZ, k.end - k.start
                FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON s.id = k.demangledName
                JOIN CUPTI_ACTIVITY_KIND_RUNTIME r ON r.correlationId = k.correlationId
                     AND (r.globalTid & 0xFFFFFFFFFF000000) = k.globalPid
                JOIN NVTX_EVENTS n ON n.globalTid = r.globalTid AND n.start <= r.start AND n.end >= r.end
                     AND n.eventType IN (59, 60) AND n.text = ? ORDER BY k.start""", phase["nvtx"])
            groups: dict = {}
            for row in rows:
                groups.setdefault(row[:7], []).append(row[7])
            total = sum(sum(values[-last:]) for values in groups.values())
            calls = sum(len(values[-last:]) for key, values in groups.items() if "AppendPagedKVCache" in key[0])
            assert calls == last  # one append kernel per workload call
            statement = said[int(re.search(r"ctx=(\d+)", phase["nvtx"]).group(1))]
            assert statement.compared_calls == last
            assert getattr(statement, "baseline_ns" if arm == "fp8" else "candidate_ns") == pytest.approx(total / calls)


def test_the_ttft_reading_follows_every_run_pair_not_the_first(tmp_path, recipes):
    """The H100 matrix's prefix reuse, and a copy whose first run's NVFP4 p50 TTFT is made 1.5× FP8's (the bench
    summary in its manifest and its result file, constructed): the first run's ratio now says worse, but the
    reading, which follows the mean over the three run pairs (unchanged), is the same; the first run's ratio is still
    the one shown."""
    source = MATRIX_RUNS["prefix-reuse"]
    copy_dir = tmp_path / source.name
    shutil.copytree(source, copy_dir)
    recorded = json.loads((source / "manifest.json").read_text())
    slower = 1.5 * recorded["arms"]["fp8.r1"]["points"][0]["bench"]["median_ttft_ms"]
    for name, edit in (("manifest.json", lambda d: d["arms"]["nvfp4.r1"]["points"][0]["bench"]),
                       ("nvfp4.r1.p0.bench.json", lambda d: d)):
        path = copy_dir / name
        path.chmod(0o644)
        data = json.loads(path.read_text())
        edit(data).update(median_ttft_ms=slower, p50_ttft_ms=slower)
        path.write_text(json.dumps(data))
    readings = []
    for run in (source, copy_dir):
        (statement,) = [s for s in report.build([run], recipes).statements if s.check == "ttft"]
        readings.append((statement.reading, statement.ratio, statement.estimate.ratio))
    assert readings[1][1] > 1.02 > readings[0][1]
    assert readings[0][0] == readings[1][0] and readings[0][2] == readings[1][2] < 0.98
