"""Trustworthy diffs: NVTX projection, windows, call pairing, planted mismatches, and the CI gate.

Planted mismatches are built from the real H200 exports by copying them into tmp_path and editing the
copy with SQL (cloned warm-up launches, a truncated arm); each test says what it plants.
"""

from __future__ import annotations

import json
import shutil
import sqlite3

import polars as pl
import pytest

from conftest import NSYS2023_DIR, NSYS2025_DIR, REPEAT, VLLM_COLD_PREFILL, VLLM_DECODE_HEAVY, sql_calls, sql_durations
from kvtrace.analyzer import align, compare, pairing
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.load import open_trace
from kvtrace.analyzer.ranges import NO_RANGE
from kvtrace.analyzer.stats.verdicts import Verdict

FP8 = NSYS2025_DIR / "fp8.sqlite"
NVFP4 = NSYS2025_DIR / "nvfp4.sqlite"
DECODE_LIKE = "%BatchPrefillWithPagedKVCacheKernel%MaskMode)0%"
PREFILL_LIKE = "%BatchPrefillWithPagedKVCacheKernel%MaskMode)1%"
DECODE_FAMILY = "BatchPrefillWithPagedKVCacheKernel[MaskMode=0]"
PREFILL_FAMILY = "BatchPrefillWithPagedKVCacheKernel[MaskMode=1]"


@pytest.fixture(scope="module")
def recipes(shipped_recipes):
    return shipped_recipes


def family(result, label):
    return next(r for r in result.families if r.family_label == label)


def sql_range_durations(path, like: str, range_name: str) -> list[int]:
    return sql_durations(path, like, nvtx=range_name)


def kernel_cell(recipes, base_path, cand_path, label: str, range_name: str) -> dict:
    """How pairing paired one family in one NVTX range: its kernel cell's pairs and each arm's calls."""
    traces = [open_trace(base_path), open_trace(cand_path)]
    classes = [compare.classify_signatures(t, recipes) for t in traces]
    vocabulary = pairing.Vocabulary.of(traces, classes)
    runs = [vocabulary.run(t, c, align.Window()) for t, c in zip(traces, classes)]
    family = classes[0].filter(pl.col("family_label") == label)["family"][0]
    strata = pairing.pair(*runs, vocabulary).strata.filter(
        (pl.col("level") == pairing.KERNEL) & (pl.col("family") == vocabulary.families.index(family))
        & (pl.col("nvtx") == vocabulary.names.index(range_name)))
    assert strata.height == 1
    return strata.row(0, named=True)


def test_every_kernel_lands_in_its_workload_phase_range(recipes):
    trace = open_trace(FP8)
    assert (trace.kernels["range"] != NO_RANGE).all()  # every launch of the workload was inside a phase range
    kernels = (trace.kernels.join(compare.classify_signatures(trace, recipes), on="sig")
               .join(trace.ranges.select("range", pl.col("name").alias("nvtx")), on="range"))
    assert kernels["nvtx"].str.starts_with("kvtrace:").all()
    for name, label, like in (("kvtrace:decode ctx=8192 batch=8", DECODE_FAMILY, DECODE_LIKE),
                              ("kvtrace:prefill ctx=32768 batch=8", PREFILL_FAMILY, PREFILL_LIKE)):
        ours = kernels.filter((kernels["nvtx"] == name) & (kernels["family_label"] == label))
        assert sorted(ours["duration"].to_list()) == sorted(sql_range_durations(FP8, like, name))


def test_phases_split_prefill_by_context(recipes):
    result = compare.diff(open_trace(FP8), open_trace(NVFP4), recipes)
    prefill = {r.phase: r for r in result.phases if r.segment == "prefill_attention"}
    assert set(prefill) == {f"kvtrace:prefill ctx={c} batch=8" for c in (2048, 8192, 32768)}
    for name, row in prefill.items():
        base, cand = sql_range_durations(FP8, PREFILL_LIKE, name), sql_range_durations(NVFP4, PREFILL_LIKE, name)
        assert row.ratio == pytest.approx((sum(cand) / len(cand)) / (sum(base) / len(base)))
        assert row.verdict == Verdict.REGRESSION and row.ci_low > 1
    # The segment resamples each context inside itself: it is no wider than its widest context (plus one
    # percentage point), where mixing 2k- and 32k-context calls would span [2.5, 11.7].
    whole = next(r for r in result.segments if r.segment == "prefill_attention")
    widest = max((r.ci_high - r.ci_low) / r.ratio for r in prefill.values())
    assert (whole.ci_high - whole.ci_low) / whole.ratio <= widest + 0.01
    assert whole.cells == 3 and not whole.same_work and whole.baseline.mean_ns is None


def test_unmatched_contexts_are_never_paired(recipes):
    """Real mismatch: the 2023.4 run recorded only ctx=2048. Decode kernels keep their grid across contexts,
    so only the NVTX range keeps ctx=32768 baseline calls from being paired with ctx=2048 candidate calls."""
    small = NSYS2023_DIR / "nvfp4.sqlite"
    result = compare.diff(open_trace(FP8), open_trace(small), recipes)
    row = family(result, DECODE_FAMILY)
    name = "kvtrace:decode ctx=2048 batch=8"
    base, cand = sql_range_durations(FP8, DECODE_LIKE, name), sql_range_durations(small, DECODE_LIKE, name)
    assert row.compared_calls == len(cand) == 16
    assert row.ratio == pytest.approx((sum(cand) / len(cand)) / (sum(base[-16:]) / 16))
    cell = kernel_cell(load_recipes(), FP8, small, DECODE_FAMILY, name)
    assert (cell["pairs"], cell["baseline_calls"], cell["candidate_calls"]) == (16, len(base), 16)
    assert any(f.check == "alignment" and DECODE_FAMILY in f.message for f in result.findings)
    assert any(f.check == "nsys" and f.level == "warning" for f in result.findings)


def _clone(conn, table: str, where: str, changes: dict[str, str]) -> int:
    columns = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
    select = ", ".join(changes.get(c, f'"{c}"') for c in columns)
    quoted = ", ".join(f'"{c}"' for c in columns)
    return conn.execute(f"INSERT INTO {table} ({quoted}) SELECT {select} FROM {table} WHERE {where}").rowcount


def planted_warmup(tmp_path, extra: int) -> tuple:
    """Copy of the NVFP4 export with `extra` cloned decode launches before the first ctx=2048 decode call:
    same runtime call times (inside the range), GPU start moved before the first real call, fresh
    correlation ids."""
    path = tmp_path / "nvfp4-extra-warmup.sqlite"
    shutil.copy(NVFP4, path)
    name = "kvtrace:decode ctx=2048 batch=8"
    with sqlite3.connect(path) as conn:
        rows = conn.execute("""
            SELECT k.rowid, k.correlationId, k.start FROM CUPTI_ACTIVITY_KIND_KERNEL k
            JOIN StringIds s ON s.id = k.demangledName
            JOIN CUPTI_ACTIVITY_KIND_RUNTIME r ON r.correlationId = k.correlationId
            JOIN NVTX_EVENTS n ON n.globalTid = r.globalTid AND n.start <= r.start AND n.end >= r.end AND n.text = ?
            WHERE s.value LIKE ? ORDER BY k.start LIMIT ?""", (name, DECODE_LIKE, extra)).fetchall()
        first_start = rows[0][2]
        shift = 10_000_000
        for i, (rowid, correlation, start) in enumerate(rows):
            _clone(conn, "CUPTI_ACTIVITY_KIND_KERNEL", f"rowid = {rowid}",
                   {"start": f"{first_start - (extra - i) * 200_000}",
                    "end": f'{first_start - (extra - i) * 200_000} + ("end" - start)',
                    "correlationId": f"correlationId + {shift}"})
            _clone(conn, "CUPTI_ACTIVITY_KIND_RUNTIME", f"correlationId = {correlation}",
                   {"correlationId": f"correlationId + {shift}"})
    return path, name


def test_extra_warmup_calls_in_one_arm_are_flagged_and_trimmed(tmp_path, recipes, run_kvtrace):
    clean = compare.diff(open_trace(FP8), open_trace(NVFP4), recipes)
    planted, name = planted_warmup(tmp_path, extra=8)
    result = compare.diff(open_trace(FP8), open_trace(planted), recipes)
    row = family(result, DECODE_FAMILY)
    assert row.candidate_calls == family(clean, DECODE_FAMILY).candidate_calls + 8
    cell = kernel_cell(recipes, FP8, planted, DECODE_FAMILY, name)
    calls = len(sql_range_durations(FP8, DECODE_LIKE, name))
    assert (cell["pairs"], cell["baseline_calls"], cell["candidate_calls"]) == (calls, calls, calls + 8)
    assert any(f.level == "warning" and f.check == "alignment" and "warm-up" in f.message for f in result.findings)
    # The extra calls sit at the start, so pairing the last 64 compares exactly the clean calls.
    assert row.ratio == pytest.approx(family(clean, DECODE_FAMILY).ratio)
    code, out, err = run_kvtrace("diff", str(FP8), str(planted), "--format", "markdown")
    assert code == 0, err
    assert f"last {calls} of {calls} vs {calls + 8} calls" in out and "⚠️" in out


def test_truncated_arm_is_flagged(tmp_path, recipes):
    """Planted: the NVFP4 export cut after its third ctx=32768 prefill call, as if the capture stopped early."""
    path = tmp_path / "nvfp4-truncated.sqlite"
    shutil.copy(NVFP4, path)
    name = "kvtrace:prefill ctx=32768 batch=8"
    calls = sql_calls(NVFP4, PREFILL_LIKE, nvtx=name)
    third = [end - start for start, end in calls[:3]]
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE start > ?", (calls[2][1],))
    result = compare.diff(open_trace(FP8), open_trace(path), recipes)
    prefill = next(r for r in result.phases if r.segment == "prefill_attention" and r.phase == name)
    cell = kernel_cell(recipes, FP8, path, PREFILL_FAMILY, name)
    assert (cell["pairs"], cell["baseline_calls"], cell["candidate_calls"]) == (3, len(calls), 3)
    assert prefill.compared_calls == 3 and prefill.candidate.total_ns == sum(third)
    gone = [r for r in result.phases if "ctx=32768" in r.phase and r.segment in ("decode_attention", "kv_append", "gemm")]
    assert gone and all(r.verdict == Verdict.NOT_COMPARABLE and r.reason == "only in the baseline" for r in gone)
    decode = next(r for r in result.segments if r.segment == "decode_attention")
    # The two contexts both arms decoded pair whole; the ctx=32768 decode calls exist only in the baseline and
    # carry more of the segment's change than the pairs do, so the segment is "different work", not a ratio.
    missing = sum(sql_durations(FP8, DECODE_LIKE, "%MergeStates%", nvtx="kvtrace:decode ctx=32768 batch=8"))
    assert decode.compared_calls == 256 and (decode.baseline_calls, decode.candidate_calls) == (384, 256)
    assert decode.total_delta_ns - decode.paired_delta_ns == -missing
    assert decode.verdict == Verdict.DIFFERENT_WORK and decode.paired_verdict == Verdict.REGRESSION
    assert decode.unpaired_share > 0.5


def test_same_format_repeat_passes_the_gate(run_kvtrace):
    repeat = REPEAT / "fp8.sqlite"
    code, out, err = run_kvtrace("diff", str(FP8), str(repeat), "--fail-on", "regression", "--format", "json")
    assert code == 0, err
    assert all(r["verdict"] == Verdict.NO_CHANGE for r in json.loads(out)["segments"])


def test_gate_trips_on_a_regressed_segment_only(run_kvtrace):
    code, out, err = run_kvtrace("diff", str(FP8), str(NVFP4), "--fail-on", "regression:gemm", "--format", "json")
    assert code == 0, err
    code, out, err = run_kvtrace("diff", str(FP8), str(NVFP4), "--fail-on", "regression:prefill_attention",
                                 "--format", "json")
    assert code == 1 and out  # the report is still written
    assert err.count("\n") == 1 and err.startswith("kvtrace: gate: prefill_attention regressed")
    code, out, err = run_kvtrace("diff", str(FP8), str(NVFP4), "--fail-on", "regression:attention")
    assert code == 2 and err.startswith("kvtrace: error: --fail-on")


def test_gate_cannot_pass_a_segment_it_cannot_measure(run_kvtrace):
    """quantize ran only in the FP8 arm (its cast), memory's change is the FP8 arm's extra copies, moe ran in
    neither: a gate watching them exits 3 with one line, and never 0."""
    for segment, why in (("quantize", Verdict.NOT_COMPARABLE), ("memory", Verdict.DIFFERENT_WORK),
                         ("moe", "no calls in either arm")):
        code, out, err = run_kvtrace("diff", str(FP8), str(NVFP4), "--fail-on", f"regression:{segment}",
                                     "--format", "json")
        assert code == 3 and out, err
        assert err.count("\n") == 1 and err.startswith(f"kvtrace: gate: cannot judge {segment} ({why})")
    # A regression wins: exit 1, with both lines.
    code, out, err = run_kvtrace("diff", str(FP8), str(NVFP4), "--fail-on", "regression:prefill_attention",
                                 "--fail-on", "regression:quantize", "--format", "json")
    assert code == 1 and err.count("\n") == 2 and "cannot judge quantize" in err
    # Watching every segment judges those it can and lists the others.
    code, out, err = run_kvtrace("diff", str(FP8), str(NVFP4), "--fail-on", "regression", "--format", "json")
    assert code == 1 and err.splitlines()[1] == ("kvtrace: gate: not judged: memory (different work), quantize (not "
                                                 "comparable), other (different work)"), err


@pytest.mark.slow
def _family_calls(summary_json: str, family_label: str) -> int:
    return sum(r["stats"]["calls"] for r in json.loads(summary_json)["families"] if r["family_label"] == family_label)


def test_windows_select_calls(run_kvtrace):
    code, out, err = run_kvtrace("diff", str(FP8), str(NVFP4), "--window", "decode ctx=8192", "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert {r["segment"] for r in data["segments"]} == {"decode_attention", "other"}
    decode = next(r for r in data["families"] if r["family_label"] == DECODE_FAMILY)
    assert decode["baseline_calls"] == len(sql_range_durations(FP8, DECODE_LIKE, "kvtrace:decode ctx=8192 batch=8"))
    assert any("NVTX ranges matching /decode ctx=8192/" in w for w in data["window"])

    code, out, err = run_kvtrace("summary", str(FP8), "--last", "2", "--format", "json")
    assert code == 0, err
    # The family's calls over its rows (summary splits a family whose calls cost differently by range).
    assert _family_calls(out, PREFILL_FAMILY) == 2 * 3  # last 2 per context range

    # A look-behind is valid Python regex; the window matches with the engine that validated it.
    code, out, err = run_kvtrace("diff", str(FP8), str(NVFP4), "--window", "(?<=decode )ctx=8192", "--format", "json")
    assert code == 0, err
    behind = next(r for r in json.loads(out)["families"] if r["family_label"] == DECODE_FAMILY)
    assert behind["baseline_calls"] == decode["baseline_calls"]

    # --last N keeps every call of a group that has fewer than N (a count must not wrap below zero).
    code, out, err = run_kvtrace("summary", str(FP8), "--format", "json")
    every = _family_calls(out, PREFILL_FAMILY)
    code, out, err = run_kvtrace("summary", str(FP8), "--last", str(every + 1), "--format", "json")
    assert code == 0, err
    assert _family_calls(out, PREFILL_FAMILY) == every

    code, out, err = run_kvtrace("summary", str(FP8), "--time", "0:0.0001", "--format", "json")
    assert code == 2 and "no kernels inside the window" in err
    code, out, err = run_kvtrace("summary", str(FP8), "--time", "later")
    assert code == 2 and err.startswith("kvtrace: error: --time")
    code, out, err = run_kvtrace("summary", str(FP8), "--window", "(")
    assert code == 2 and "not a valid regex" in err


def test_vllm_step_names_parse():
    names = ["execute_context_1(2048)_generation_0(0)", "execute_context_0(0)_generation_8(8)",
             "execute_context_2(300)_generation_6(6)", "execute_14_context_1(sq2048sk2048sqsq0sqsk0)_generation_0(sq)"]
    kinds = []
    for name in names:
        m = align.VLLM_STEP.search(name)
        context_requests, generation_requests = int(m.group(1)), int(m.group(3))
        kinds.append(align.PREFILL if generation_requests == 0 else align.DECODE if context_requests == 0 else align.MIXED)
    assert kinds == [align.PREFILL, align.DECODE, align.MIXED, align.PREFILL]



def test_real_vllm_steps_are_projected_and_unmatched_batches_refused(recipes):
    """The real H200 vLLM run: both arms prefilled the same 32 × 1024 tokens, but batched them into
    different engine steps, so kvtrace must not pair their attention kernels."""
    manifest = json.loads((VLLM_COLD_PREFILL / "manifest.json").read_text())
    for arm in ("auto", "fp8"):
        trace = open_trace(VLLM_COLD_PREFILL / f"{arm}.sqlite")
        launched = align.steps(trace).filter(pl.col("range").is_in(trace.kernels["range"].unique().implode()))
        steps = launched.unique("step_range")
        assert set(steps["phase"]) == {align.PREFILL}
        point = manifest["arms"][arm]["points"][0]
        assert steps["context_tokens"].sum() == point["tokens_in"] == 32 * 1024
    result = compare.diff(open_trace(VLLM_COLD_PREFILL / "auto.sqlite"), open_trace(VLLM_COLD_PREFILL / "fp8.sqlite"),
                          recipes)
    assert result.baseline.kv_dtypes == ("bf16",) and result.candidate.kv_dtypes == ("fp8_e4m3",)
    segments = {r.segment: r for r in result.segments}
    assert {"prefill_attention", "kv_append", "gemm"} <= set(segments)
    assert segments["prefill_attention"].verdict == Verdict.NOT_COMPARABLE
    assert segments["kv_append"].verdict == Verdict.NOT_COMPARABLE
    assert any(f.check == "steps" and f.level == "warning" and "different vLLM steps" in f.message
               for f in result.findings)


def test_same_inputs_give_the_same_bytes(run_kvtrace):
    """Bootstrap seeded, every listing sorted: two runs of the same diff write identical reports, also where
    polars groups in parallel (the vLLM traces have many families and ranges)."""
    outputs = [run_kvtrace("diff", VLLM_COLD_PREFILL / "auto.sqlite", VLLM_COLD_PREFILL / "fp8.sqlite", "--format", "json")
               for _ in range(2)]
    assert all(code == 0 for code, _, _ in outputs)
    assert outputs[0][1] == outputs[1][1]


DECODE_ATTENTION = "%BatchPrefillWithPagedKVCacheKernel%MaskMode)0%"


def test_real_vllm_decode_pairs_cuda_graph_kernels(recipes):
    """The real H200 decode-heavy run (engine core in-process): both arms ran the same steps, and decode
    attention, replayed from CUDA graphs, pairs call for call."""
    auto, fp8 = VLLM_DECODE_HEAVY / "auto.sqlite", VLLM_DECODE_HEAVY / "fp8.sqlite"
    with sqlite3.connect(f"file:{auto}?mode=ro", uri=True) as conn:
        graph_launched = conn.execute(
            "SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON s.id = k.demangledName "
            "WHERE s.value LIKE ? AND k.graphNodeId IS NOT NULL AND k.graphNodeId != 0", (DECODE_ATTENTION,)).fetchone()[0]
    base, cand = sql_durations(auto, DECODE_ATTENTION), sql_durations(fp8, DECODE_ATTENTION)
    assert graph_launched == len(base) > 0  # every decode attention call came from a CUDA graph
    result = compare.diff(open_trace(auto), open_trace(fp8), recipes)
    assert any(f.check == "steps" and f.level == "ok" for f in result.findings)
    phase = next(r for r in result.phases if r.segment == "decode_attention" and r.phase == "vLLM decode steps")
    # The decode segment also holds the split-KV merge kernels; the attention kernels alone, per SQL:
    attention = [r for r in result.families if r.segment == "decode_attention"
                 and "MaskMode=0" in (r.family_label or "")]
    assert sum(r.baseline_calls for r in attention) == len(base) and sum(r.candidate_calls for r in attention) == len(cand)
    assert phase.compared_calls == phase.baseline_calls == phase.candidate_calls
    assert phase.verdict == Verdict.REGRESSION and phase.ci_low > 1
    append = next(r for r in result.segments if r.segment == "kv_append")
    assert append.baseline_kv_dtypes == ("bf16",) and append.candidate_kv_dtypes == ("fp8_e4m3",)
    assert append.compared_calls == append.baseline_calls
