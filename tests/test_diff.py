"""`kvtrace summary` / `diff` on the real H200 traces, checked against plain SQL over the same files."""

from __future__ import annotations

import csv
import io
import json
import sqlite3

import numpy as np
import pytest

from conftest import NSYS2023_DIR, NSYS2025_DIR, REPEAT, REPO
from kvtrace.analyzer import compare, kernels, results
from kvtrace.analyzer.load import open_trace
from kvtrace.analyzer.stats.verdicts import Verdict

FP8 = NSYS2025_DIR / "fp8.sqlite"
NVFP4 = NSYS2025_DIR / "nvfp4.sqlite"

# Kernel families by the substring that identifies them in the demangled name, for the independent SQL.
PREFILL = "%BatchPrefillWithPagedKVCacheKernel%MaskMode)1%"
DECODE = "%BatchPrefillWithPagedKVCacheKernel%MaskMode)0%"
GEMM = "nvjet%"


def sql_durations(path, like: str) -> list[int]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return [r[0] for r in conn.execute(
            "SELECT k.end - k.start FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON s.id = k.demangledName "
            "WHERE s.value LIKE ? ORDER BY k.start", (like,))]


@pytest.fixture(scope="module")
def recipes(shipped_recipes):
    return shipped_recipes


@pytest.fixture(scope="module")
def fp8_nvfp4(fi_h200_diff):
    return fi_h200_diff


def family_row(result, segment: str, label_part: str):
    rows = [r for r in result.families if r.segment == segment and label_part in (r.family_label or "")]
    assert len(rows) == 1, [r.family_label for r in result.families if r.segment == segment]
    return rows[0]


def test_prefill_and_decode_are_separate_regressions_matching_plain_sql(fp8_nvfp4):
    for segment, like in (("prefill_attention", PREFILL), ("decode_attention", DECODE)):
        row = family_row(fp8_nvfp4, segment, "BatchPrefillWithPagedKVCacheKernel")
        base, cand = sql_durations(FP8, like), sql_durations(NVFP4, like)
        assert row.baseline.calls == len(base) and row.candidate.calls == len(cand)
        assert row.baseline.total_ns == sum(base) and row.candidate.total_ns == sum(cand)
        assert row.ratio == pytest.approx((sum(cand) / len(cand)) / (sum(base) / len(base)))
        assert row.verdict == Verdict.REGRESSION
        assert row.ci_low > 1 and row.ci_high >= row.ratio >= row.ci_low
        assert row.baseline_kv_dtypes == ("fp8_e4m3",) and row.candidate_kv_dtypes == ("nvfp4",)


def test_gemm_control_is_unchanged(fp8_nvfp4):
    row = next(r for r in fp8_nvfp4.segments if r.segment == "gemm")
    base, cand = sql_durations(FP8, GEMM), sql_durations(NVFP4, GEMM)
    assert (row.baseline.calls, row.candidate.calls) == (len(base), len(cand))
    assert row.verdict == Verdict.NO_CHANGE
    assert abs(row.ratio - 1) < fp8_nvfp4.threshold


def test_segments_partition_each_arm_and_explain_the_whole_delta(fp8_nvfp4):
    for arm, path, side in ((fp8_nvfp4.baseline, FP8, "baseline"), (fp8_nvfp4.candidate, NVFP4, "candidate")):
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
            total, count = conn.execute("SELECT sum(end - start), count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchone()
        rows = fp8_nvfp4.segments
        assert arm.total_ns == total
        assert sum(getattr(r, f"{side}_total_ns") for r in rows) == total
        assert sum(getattr(r, f"{side}_calls") for r in rows) == count
    shares = [r.abs_delta_share for r in fp8_nvfp4.segments]
    assert all(0 <= s <= 1 for s in shares) and sum(shares) == pytest.approx(1)
    # Sorted by impact: the largest absolute delta first.
    deltas = [abs(r.total_delta_ns) for r in fp8_nvfp4.segments]
    assert deltas == sorted(deltas, reverse=True)


def test_rows_with_different_work_are_not_comparable(fp8_nvfp4):
    # The FP8 append casts in separate torch kernels the NVFP4 arm never launches.
    only_fp8 = [r for r in fp8_nvfp4.families if r.candidate is None]
    assert only_fp8 and all(r.verdict == Verdict.NOT_COMPARABLE and "only in the baseline" in r.reason
                            for r in only_fp8)
    assert all(r.ratio is None and r.ci_low is None for r in only_fp8)


def test_unpaired_work_that_carries_the_change_is_different_work(fp8_nvfp4):
    """The `other` segment pairs its 224 elementwise calls, which did not change, while the FP8 arm's 384
    scaling multiplies (part of its KV cast, BUnaryFunctor) have no partner: the segment is "different
    work", never "no significant change", and the pairs' own verdict stays available."""
    row = next(r for r in fp8_nvfp4.segments if r.segment == "other")
    unpaired = sum(sql_durations(FP8, "%BUnaryFunctor%"))
    assert row.total_delta_ns - row.paired_delta_ns == -unpaired
    assert row.unpaired_share == pytest.approx(unpaired / (unpaired + abs(row.paired_delta_ns)))
    assert row.verdict == Verdict.DIFFERENT_WORK and row.paired_verdict == Verdict.NO_CHANGE
    assert "BUnaryFunctor ×384" in row.note
    assert row.compared_calls == row.candidate_calls == len(sql_durations(NVFP4, "%AUnaryFunctor%"))


def test_a_pooled_mean_never_poses_as_one_call(fp8_nvfp4, run_kvtrace):
    """Prefill calls of 2k, 8k and 32k contexts take 2 ms to 468 ms; their pooled mean (167 ms) describes no
    call that ran, so rows spanning them show totals, and rows of one context show per-call means."""
    from kvtrace.analyzer.render.units import duration

    base = sql_durations(FP8, PREFILL)
    segment = next(r for r in fp8_nvfp4.segments if r.segment == "prefill_attention")
    assert not segment.same_work and segment.baseline.mean_ns is None and segment.baseline.total_ns == sum(base)
    phases = [r for r in fp8_nvfp4.phases if r.segment == "prefill_attention"]
    assert all(r.same_work and r.baseline.mean_ns == pytest.approx(r.baseline.total_ns / r.compared_calls)
               for r in phases)
    gemm = next(r for r in fp8_nvfp4.segments if r.segment == "gemm")  # one GEMM in three ranges: same work
    assert gemm.same_work and gemm.baseline.mean_ns == pytest.approx(np.mean(sql_durations(FP8, GEMM)))
    code, out, err = run_kvtrace("diff", str(FP8), str(NVFP4), "--format", "markdown")
    assert code == 0, err
    assert duration(sum(base) / len(base)) not in out and f"{duration(sum(base))} total, 3 cells" in out


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_same_format_repeat_has_no_regression(recipes, fmt):
    result = compare.diff(open_trace(NSYS2025_DIR / f"{fmt}.sqlite"), open_trace(REPEAT / f"{fmt}.sqlite"), recipes,
                          labels=(fmt, f"{fmt}-repeat"))
    for row in result.segments + result.families:
        assert row.verdict == Verdict.NO_CHANGE, (row.segment, row.family_label, row.ratio, row.ci_low, row.ci_high)
    assert any(f.level == "warning" and "same KV dtype" in f.message for f in result.findings)


def test_swapped_arms_are_flagged(recipes):
    result = compare.diff(open_trace(NVFP4), open_trace(FP8), recipes, labels=("fp8", "nvfp4"))
    errors = [f.message for f in result.findings if f.level == "error"]
    assert any("look swapped" in m for m in errors), result.findings


def test_summary_on_the_2023_export(recipes):
    summary = compare.summarize(open_trace(NSYS2023_DIR / "nvfp4.sqlite"), recipes)
    segments = {r.segment: r for r in summary.segments}
    assert {"prefill_attention", "decode_attention", "kv_append", "gemm"} <= set(segments)
    assert segments["prefill_attention"].stats.calls == len(sql_durations(NSYS2023_DIR / "nvfp4.sqlite", PREFILL))
    assert segments["prefill_attention"].kv_dtypes == ("nvfp4",)
    assert summary.arm.info.product_version.startswith("2023.4")


@pytest.mark.slow
def test_cli_formats(run_kvtrace, tmp_path):
    code, out, err = run_kvtrace("diff", str(FP8), str(NVFP4), "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert data["schema"] == results.DIFF_SCHEMA
    assert {r["segment"] for r in data["segments"]} >= {"prefill_attention", "decode_attention", "kv_append", "gemm"}

    code, out, err = run_kvtrace("diff", str(FP8), str(NVFP4), "--format", "csv")
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == len(data["segments"]) + len(data["phases"]) + len(data["phase_totals"]) + len(data["families"])
    header = out.splitlines()[0].split(",")
    documented = (REPO / "docs" / "json-schema.md").read_text().split("### CSV")[1]
    assert len(set(header)) == len(header)  # one meaning per name
    for name in header:
        stat = name.split("_stats_")[-1]
        assert f"`{name}`" in documented or ("_stats_" in name and f"`{stat}`" in documented), name
    prefill = next(r for r in rows if r["level"] == "segment" and r["segment"] == "prefill_attention")
    assert float(prefill["ratio"]) == pytest.approx(next(
        s["ratio"] for s in data["segments"] if s["segment"] == "prefill_attention"))

    report = tmp_path / "report.md"
    report.write_text("old contents")
    code, out, err = run_kvtrace("diff", str(FP8), str(NVFP4), "--format", "markdown", "-o", str(report))
    assert code == 0 and out == "", err
    text = report.read_text()
    for needle in ("## kvtrace diff: fp8 → nvfp4", "### Segments", "### Kernel families", "### Environment",
                   "NVIDIA H200 (132 SMs, SM 9.0)", "2025.3.2.0 (schema 3.20.3)", "<details>", "fp8_e4m3",
                   "| prefill_attention |", "regression", "no significant change"):
        assert needle in text, needle
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".report")] == []  # no temp file left

    code, out, err = run_kvtrace("summary", str(FP8))
    assert code == 0 and "prefill_attention" in out and "Kernel families" in out


def test_kernels_unclassified_lists_only_unmatched(run_kvtrace, recipes):
    code, out, err = run_kvtrace("kernels", str(FP8), "--unclassified", "--format", "json")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert rows and all(r["recipe"] is None and r["segment"] == "other" for r in rows)
    everything = kernels.list_kernels(open_trace(FP8), recipes).rows
    assert {r["demangled"] for r in rows} == {r["demangled"] for r in everything if r["recipe"] is None}
    shares = [r["share"] for r in rows]
    assert shares == sorted(shares, reverse=True)
