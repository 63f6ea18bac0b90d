"""kvtrace on the real vLLM 0.33 FP8 vs NVFP4 runs from the H200 (fixtures/vllm033-h200, fixtures/README.md).

Every number is checked against an independent source: plain SQL over the exports (cut.json's totals, taken
from the uncut originals), the runs' own bench JSON, /metrics scrapes and vLLM's log lines.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sqlite3
from pathlib import Path

import pytest

from conftest import VLLM033_RUNS, sql_durations
from kvtrace.analyzer import compare, report, statements
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.load import open_trace
from kvtrace.analyzer.render.escape import md_text, visible
from kvtrace.analyzer.render.statements import text as statement_text
from kvtrace.analyzer.run_context import RunContext
from kvtrace.analyzer.stats import bootstrap
from kvtrace.analyzer.stats.verdicts import Verdict

ARMS = ("fp8", "nvfp4")
# The kernels each phase runs, by SQL name pattern, per arm (fixtures/README.md: FP8 prefills on FA3, NVFP4
# on FA2; both decode on FA2 with the split-KV merge; two different append kernels).
EXPECTED = {
    "prefill_attention": {"fp8": ["%FP8PrefillWithKVCacheKernel%"],
                          "nvfp4": ["%BatchPrefillWithPagedKVCacheKernel<(bool)1, flashinfer::KernelTraits<(flashinfer::MaskMode)1%"]},
    "decode_attention": {arm: ["%BatchPrefillWithPagedKVCacheKernel<(bool)1, flashinfer::KernelTraits<(flashinfer::MaskMode)0%",
                               "%PersistentVariableLengthMergeStatesKernel%"] for arm in ARMS},
    "kv_append": {"fp8": ["%reshape_and_cache_flash_kernel%"],
                  "nvfp4": ["%NVFP4QuantizeAppendPagedKVCacheWithSlotMappingKernel%"]},
    "quantize": {"fp8": ["%scaled_fp8_quant%"], "nvfp4": []},
}


@pytest.fixture(scope="module")
def recipes():
    return load_recipes()


@pytest.fixture(scope="module")
def built(recipes):
    """built(NAME): `report.build` of the run NAME, made once per module (the tests only read it)."""
    cache = {}

    def build(name: str):
        if name not in cache:
            cache[name] = report.build([VLLM033_RUNS[name]], recipes)
        return cache[name]
    return build


def sql_totals(path: Path, likes: list[str]) -> tuple[int, int]:
    """(calls, GPU ns) of the kernels whose demangled name matches any of `likes`."""
    if not likes:
        return 0, 0
    where = " OR ".join("s.value LIKE ?" for _ in likes)
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        calls, total = conn.execute(f"""SELECT count(*), coalesce(sum(k."end" - k.start), 0)
            FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON s.id = k.demangledName WHERE {where}""",
                                    likes).fetchone()
    return calls, total


def log_line(run: Path, arm: str, pattern: str) -> re.Match:
    found = re.findall(pattern, (run / f"{arm}.log").read_text())
    assert found, (arm, pattern)
    return found[-1]


def recorded_arms(run: Path) -> dict[str, str]:
    """Each arm run the capture recorded (fp8, or fp8.r1 ... with --repeats) and its KV format, by manifest.json."""
    return {name: entry["arm"] for name, entry in json.loads((run / "manifest.json").read_text())["arms"].items()}


@pytest.mark.parametrize("name", sorted(VLLM033_RUNS))
def test_every_arm_export_is_cut(name):
    """Every recorded arm run's export is in cut.json (test_report checks each one's totals against its original)."""
    run = VLLM033_RUNS[name]
    cut = json.loads((run / "cut.json").read_text())
    arms = recorded_arms(run)
    assert sorted(arms.values()) == sorted(ARMS * (len(arms) // 2))
    assert sorted(cut["exports"]) == sorted(f"{arm}.sqlite" for arm in arms)


@pytest.mark.parametrize("name", sorted(VLLM033_RUNS))
def test_every_phase_kernel_lands_in_its_segment(name, run_kvtrace):
    """`kvtrace kernels` files each arm's attention, append and quantize kernels in their segments, with the
    calls and time plain SQL counts for them, and nothing else in those segments."""
    run = VLLM033_RUNS[name]
    for arm, fmt in recorded_arms(run).items():
        code, out, err = run_kvtrace("kernels", run / f"{arm}.sqlite", "--format", "json")
        assert code == 0, err
        rows = json.loads(out)["rows"]
        for segment, likes in EXPECTED.items():
            mine = [r for r in rows if r["segment"] == segment]
            calls, total = sql_totals(run / f"{arm}.sqlite", likes[fmt])
            assert (sum(r["calls"] for r in mine), sum(r["total_ns"] for r in mine)) == (calls, total), (arm, segment)
        # Query quantization only where vLLM's log says the prefill queries are FP8.
        prefill_query = log_line(run, arm, r"FlashInfer resolved query dtypes: prefill=torch\.(\w+)")
        assert (sql_totals(run / f"{arm}.sqlite", ["%scaled_fp8_quant%"])[0] > 0) == (prefill_query == "float8_e4m3fn")


def test_decode_heavy_statements_match_sql_and_name_kernels_and_queries(built):
    run = VLLM033_RUNS["offline-decode-heavy"]
    result = built("offline-decode-heavy")
    said = {s.subject: s for s in reversed(result.statements) if s.kind == "kernels"}  # each subject's first
    sql = {segment: {arm: sql_totals(run / f"{arm}.sqlite", likes[arm]) for arm in ARMS}
           for segment, likes in EXPECTED.items()}
    queries = {arm: log_line(run, arm, r"FlashInfer resolved query dtypes: prefill=torch\.(\w+), decode=torch\.(\w+)")
               for arm in ARMS}
    assert queries == {"fp8": ("float8_e4m3fn", "bfloat16"), "nvfp4": ("bfloat16", "bfloat16")}

    prefill = said["prefill_attention"]  # every prefill call pairs: one per prefill step
    (fp8_calls, fp8_ns), (nv_calls, nv_ns) = sql["prefill_attention"]["fp8"], sql["prefill_attention"]["nvfp4"]
    assert prefill.compared_calls == fp8_calls == nv_calls == 16
    assert prefill.ratio == pytest.approx(nv_ns / fp8_ns) and prefill.ratio > 1.5
    assert (prefill.baseline_ns, prefill.candidate_ns) == (pytest.approx(fp8_ns / 16), pytest.approx(nv_ns / 16))
    words = statement_text(prefill)
    assert "kernels FP8PrefillWithKVCacheKernel → BatchPrefillWithPagedKVCacheKernel[MaskMode=1]" in words
    assert "queries float8_e4m3fn (fp8) → bfloat16 (nvfp4) per vLLM's log" in words

    # Decode attention's kernel and the split-KV merge kernel, each its own statement with its own totals.
    decode = [s for s in result.statements if s.kind == "kernels" and s.subject == "decode_attention"]
    assert [s.kernels for s in decode] == ["BatchPrefillWithPagedKVCacheKernel[MaskMode=0]",
                                           "PersistentVariableLengthMergeStatesKernel"]
    for statement, like in zip(decode, EXPECTED["decode_attention"]["fp8"]):
        (fp8_calls, fp8_ns), (nv_calls, nv_ns) = (sql_totals(run / f"{arm}.sqlite", [like]) for arm in ARMS)
        assert statement.compared_calls == fp8_calls == nv_calls and statement.ratio == pytest.approx(nv_ns / fp8_ns)
        assert "queries bfloat16 (fp8) → bfloat16 (nvfp4)" in statement_text(statement)
    assert decode[0].verdict == "regression" and decode[1].verdict != "regression"

    append = [s for s in result.statements if s.kind == "kernels" and s.subject == "kv_append"]
    (fp8_calls, fp8_ns), (nv_calls, nv_ns) = sql["kv_append"]["fp8"], sql["kv_append"]["nvfp4"]
    assert sum(s.compared_calls for s in append) == fp8_calls == nv_calls
    for s in append:
        assert "kernels reshape_and_cache_flash_kernel → NVFP4QuantizeAppendPagedKVCacheWithSlotMappingKernel" in \
            statement_text(s) and "queries" not in statement_text(s)

    # FP8's query quantization is part of its prefill: said so, with the phase's totals from SQL.
    (quantize,) = [s for s in result.statements if s.kind == "query_quantize"]
    q_calls, q_ns = sql["quantize"]["fp8"]
    assert (quantize.arm, quantize.query, quantize.calls, quantize.quantize_ns) == ("fp8", "float8_e4m3fn", q_calls, q_ns)
    assert quantize.attention_ns == sql["prefill_attention"]["fp8"][1]
    assert quantize.ratio == pytest.approx(sql["prefill_attention"]["nvfp4"][1] / (sql["prefill_attention"]["fp8"][1] + q_ns))
    assert "part of fp8's prefill cost" in statement_text(quantize)


# The vLLM steps of the decode-heavy workload by NVTX range (16 prompts of 512 tokens prefilled in one step, then
# 31 decode steps), as the report's points name them.
STEPS = {"prefill steps": "execute_context_16(8192)_generation_0(0)",
         "decode steps": "execute_context_0(0)_generation_16(16)"}
QUERIES = r"FlashInfer resolved query dtypes: prefill=torch\.(\w+), decode=torch\.(\w+)"
KV_TOKENS = r"GPU KV cache size: ([\d,]+) tokens"


def test_repeats_report_pairs_run_by_run_and_matches_sql(recipes, built):
    """`--repeats 2` (fp8.r1, nvfp4.r1, fp8.r2, nvfp4.r2): `kvtrace report RUNDIR` pairs r1 with r1 and r2 with r2;
    each head row's ratio is both runs' summed time, its interval holds each run pair's own ratio (plain SQL),
    and the row keeps those ratios apart. Each run pair alone says its own ratios, its own vLLM KV-token counts
    and its own logs' query dtypes; the pooled report's capacity is the first run's, and it says so."""
    run = VLLM033_RUNS["offline-decode-heavy-repeats"]
    settings = json.loads((run / "manifest.json").read_text())["settings"]
    assert settings["repeats"] == 2 and settings["order"] == ["fp8.r1", "nvfp4.r1", "fp8.r2", "nvfp4.r2"]
    for k in (1, 2):
        assert {arm: log_line(run, f"{arm}.r{k}", QUERIES) for arm in ARMS} == {
            "fp8": ("float8_e4m3fn", "bfloat16"), "nvfp4": ("bfloat16", "bfloat16")}
    pool = {(arm, k): int(log_line(run, f"{arm}.r{k}", KV_TOKENS).replace(",", "")) for arm in ARMS for k in (1, 2)}
    assert pool == {("fp8", 1): 4_094_528, ("nvfp4", 1): 7_279_184, ("fp8", 2): 4_096_448, ("nvfp4", 2): 7_282_592}

    def sql(segment: str, point: str | None, arm: str, k: int) -> tuple[int, int]:
        likes = EXPECTED[segment][arm][:1]  # decode: the attention kernel, which the head gives a row of its own
        if point is None:
            return sql_totals(run / f"{arm}.r{k}.sqlite", likes)
        durations = sql_durations(run / f"{arm}.r{k}.sqlite", *likes, nvtx=STEPS[point])
        return len(durations), sum(durations)

    heads = [("prefill_attention", None), ("decode_attention", None),
             ("kv_append", "prefill steps"), ("kv_append", "decode steps")]
    both = built("offline-decode-heavy-repeats")
    assert both.diff.runs == 2 and both.diff.method == bootstrap.HIERARCHICAL
    assert both.baseline.runs == (str(run / "fp8.r1.sqlite"), str(run / "fp8.r2.sqlite"))
    assert both.candidate.runs == (str(run / "nvfp4.r1.sqlite"), str(run / "nvfp4.r2.sqlite"))
    singles = {k: report.build([run], recipes, arms=(f"fp8.r{k}", f"nvfp4.r{k}")) for k in (1, 2)}
    assert [singles[k].diff.runs for k in (1, 2)] == [1, 1]

    def head(result, segment, point):
        found = [s for s in result.statements if s.kind == "kernels" and s.subject == segment
                 and (point is None or s.point == point) and "MergeStates" not in s.kernels]
        assert len(found) == 1, (segment, point)
        return found[0]

    for segment, point in heads:
        totals = {(arm, k): sql(segment, point, arm, k) for arm in ARMS for k in (1, 2)}
        assert all(totals["fp8", k][0] == totals["nvfp4", k][0] > 0 for k in (1, 2))  # every call pairs
        per_run = [totals["nvfp4", k][1] / totals["fp8", k][1] for k in (1, 2)]
        fp8_ns, nv_ns = (sum(totals[arm, k][1] for k in (1, 2)) for arm in ARMS)
        pooled = head(both, segment, point)
        assert pooled.compared_calls == totals["fp8", 1][0] + totals["fp8", 2][0]
        assert pooled.ratio == pytest.approx(nv_ns / fp8_ns) and pooled.verdict == Verdict.REGRESSION
        assert pooled.ci_low <= min(per_run) and max(per_run) <= pooled.ci_high, (segment, point, per_run)
        if pooled.per_call:
            assert pooled.baseline_ns == pytest.approx(fp8_ns / pooled.compared_calls)
        else:
            assert (pooled.baseline_ns, pooled.candidate_ns) == (pytest.approx(fp8_ns), pytest.approx(nv_ns))
        for k in (1, 2):
            alone = head(singles[k], segment, point)
            assert alone.compared_calls == totals["fp8", k][0] and alone.ratio == pytest.approx(per_run[k - 1])
            assert alone.verdict == Verdict.REGRESSION
        if point is None:
            row = ([r for r in both.diff.family_phases if r.segment == segment
                    and r.family_label == "BatchPrefillWithPagedKVCacheKernel[MaskMode=0]"]
                   or [r for r in both.diff.segments if r.segment == segment])[0]
            assert row.run_ratios == pytest.approx(per_run)

    for result, labels in [(both, ("fp8", "nvfp4")), *((singles[k], (f"fp8.r{k}", f"nvfp4.r{k}")) for k in (1, 2))]:
        fp8, nvfp4 = labels
        words = statement_text(head(result, "prefill_attention", None))
        assert "kernels FP8PrefillWithKVCacheKernel → BatchPrefillWithPagedKVCacheKernel[MaskMode=1]" in words
        assert f"queries float8_e4m3fn ({fp8}) → bfloat16 ({nvfp4}) per vLLM's log" in words
        assert f"queries bfloat16 ({fp8}) → bfloat16 ({nvfp4})" in statement_text(head(result, "decode_attention", None))
        (quantize,) = [s for s in result.statements if s.kind == "query_quantize"]
        assert (quantize.arm, quantize.query) == (fp8, "float8_e4m3fn")

    first = 1  # the pooled report's capacity and serving numbers are the first run pair's
    assert any("capacity are the first run's" in note for note in both.notes)
    for result, k in [(both, first), (singles[1], 1), (singles[2], 2)]:
        (capacity,) = [s for s in result.statements if isinstance(s, statements.MeasuredCapacityStatement)]
        assert (capacity.tokens, capacity.reference_tokens) == (pool["nvfp4", k], pool["fp8", k])
        assert capacity.multiplier == pytest.approx(pool["nvfp4", k] / pool["fp8", k])
        assert "no kernel got faster" in statement_text(capacity)


def test_repeats_diff_keeps_run_pairs_apart(run_kvtrace):
    """`kvtrace diff fp8.r1 nvfp4.r1 --repeat fp8.r2 nvfp4.r2` on the vLLM run: per segment, each run pair's
    ratio (plain SQL) and an interval holding both."""
    run = VLLM033_RUNS["offline-decode-heavy-repeats"]
    pairs = [(run / f"fp8.r{k}.sqlite", run / f"nvfp4.r{k}.sqlite") for k in (1, 2)]
    code, out, err = run_kvtrace("diff", *pairs[0], "--repeat", *pairs[1], "--format", "json")
    assert code == 0, err
    result = json.loads(out)
    assert result["runs"] == 2 and result["method"] == bootstrap.HIERARCHICAL
    for segment in ("prefill_attention", "decode_attention", "kv_append"):
        per_run = [sql_totals(nvfp4, EXPECTED[segment]["nvfp4"])[1] / sql_totals(fp8, EXPECTED[segment]["fp8"])[1]
                   for fp8, nvfp4 in pairs]
        row = next(r for r in result["segments"] if r["segment"] == segment)
        assert row["run_ratios"] == pytest.approx(per_run)
        assert row["ci_low"] <= min(per_run) and max(per_run) <= row["ci_high"]
        assert row["verdict"] == Verdict.REGRESSION and row["ci_low"] > 1 + result["threshold"]


def _metric(path: Path, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", path.read_text(), re.M).group(1))


def test_prefix_reuse_keeps_the_capacity_win_apart_from_the_slower_kernel(built):
    """NVFP4's pool (36,400 tokens in 640 MiB) holds the 12 shared 2,048-token prefixes, FP8's (20,480) does not:
    NVFP4 serves more prompt tokens from its prefix cache. Its prefill kernel is slower, and its TTFT longer.
    The report says both, and never calls the capacity win a faster kernel."""
    run = VLLM033_RUNS["serve-prefix-reuse"]
    result = built("serve-prefix-reuse")
    pool = {arm: int(log_line(run, arm, r"GPU KV cache size: ([\d,]+) tokens").replace(",", "")) for arm in ARMS}
    assert pool == {"fp8": 20480, "nvfp4": 36400}
    cached = {arm: _metric(run / f"{arm}.metrics.after.prom", "vllm:prompt_tokens_cached_total")
              - _metric(run / f"{arm}.metrics.before.prom", "vllm:prompt_tokens_cached_total") for arm in ARMS}
    bench = {arm: json.loads((run / f"{arm}.bench.json").read_text()) for arm in ARMS}
    assert cached["nvfp4"] > cached["fp8"] and bench["nvfp4"]["p50_ttft_ms"] > bench["fp8"]["p50_ttft_ms"]

    row = result.serving[0]
    assert (row.baseline.cached_prompt_tokens, row.candidate.cached_prompt_tokens) == (cached["fp8"], cached["nvfp4"])
    assert (row.baseline.ttft_ms.p50, row.candidate.ttft_ms.p50) == (bench["fp8"]["p50_ttft_ms"], bench["nvfp4"]["p50_ttft_ms"])
    (capacity,) = [s for s in result.statements if isinstance(s, statements.MeasuredCapacityStatement)]
    assert (capacity.tokens, capacity.reference_tokens) == (pool["nvfp4"], pool["fp8"])
    assert "no kernel got faster" in statement_text(capacity)

    (ttft,) = [s for s in result.statements if s.check == "ttft"]
    assert ttft.reading == statements.PREFIX_HIT_SLOWER and ttft.prefill_verdict == "regression"
    words = statement_text(ttft)
    assert f"{cached['nvfp4']:,.0f} cached prompt tokens (nvfp4) against {cached['fp8']:,.0f} (fp8)" in words
    assert f"fit nvfp4's {pool['nvfp4']:,}-token KV cache and not fp8's {pool['fp8']:,}" in words
    # One run pair decides nothing: what the arms differ in, and what would decide the TTFT change.
    assert "a capacity / prefix-hit effect, not a faster prefill kernel" in words and "not lower" not in words
    assert "too few runs to decide (one run pair, 3 needed" in words
    assert f"regressed {ttft.prefill_ratio:.3f}× per call" in words
    prefill = [s for s in result.statements if s.kind == "kernels" and s.subject == "prefill_attention"]
    assert all("faster" not in statement_text(s) for s in prefill)


def test_sweep_shows_fp8_capacity_bound_at_2048_by_16(built):
    """FP8's 20,480-token pool cannot hold 16 requests of 2,048 + 16 tokens (33,024); NVFP4's 36,400 can."""
    run = VLLM033_RUNS["serve-sweep"]
    result = built("serve-sweep")
    manifest = json.loads((run / "manifest.json").read_text())
    points = {arm: [p["point"] for p in manifest["arms"][arm]["points"]] for arm in ARMS}
    assert points["fp8"] == points["nvfp4"] and len(points["fp8"]) == 4
    (sweep,) = [s for s in result.statements if isinstance(s, statements.SweepCapacityStatement)]
    first = {arm.label: [f.point for f in arm.first] for arm in sweep.arms}
    pool = {arm: int(log_line(run, arm, r"GPU KV cache size: ([\d,]+) tokens").replace(",", "")) for arm in ARMS}
    bound = {arm: [p for p in points[arm] if (lambda d: int(d["concurrency"]) * (int(d["input"]) + int(d["output"]))
                                             > pool[arm])(dict(kv.split("=") for kv in p.split(",")))]
             for arm in ARMS}
    assert bound == {"fp8": ["input=2048,output=16,prompts=32,concurrency=16"], "nvfp4": []}
    assert first == bound
    assert "33,024 KV tokens needed of 20,480" in statement_text(sweep)


# vLLM's prefill step ranges: context requests, no generation requests (analyzer.align.step_kind).
_PREFILL_STEP = re.compile(r"execute_context_([1-9]\d*)\(\d+\)_generation_0\(0\)")


def _sql_prefill_ns(path: Path, likes: list[str]) -> tuple[int, int]:
    """(calls, ns) of the kernels launched inside vLLM's prefill step ranges, in plain SQL."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        names = [name for (name,) in conn.execute("SELECT DISTINCT text FROM NVTX_EVENTS WHERE text IS NOT NULL")
                 if _PREFILL_STEP.fullmatch(name)]
    durations = [d for name in names for d in sql_durations(path, *likes, nvtx=name)]
    return len(durations), sum(durations)


def test_diff_states_the_query_quantization_the_report_states(recipes, built, run_kvtrace):
    """`kvtrace diff fp8.sqlite nvfp4.sqlite` (make demo's first command) says what `kvtrace report` says of
    FP8's query quantization, from the same statement, in every renderer; its numbers are plain SQL sums over
    the prefill steps."""
    run = VLLM033_RUNS["offline-decode-heavy"]
    result = built("offline-decode-heavy")
    (said,) = [s for s in result.statements if s.kind == "query_quantize"]
    assert result.diff.headline.query_quantize == [said]  # the library's report carries the headline the CLI shows
    quantize = {arm: _sql_prefill_ns(run / f"{arm}.sqlite", EXPECTED["quantize"]["fp8"]) for arm in ARMS}
    attention = {arm: _sql_prefill_ns(run / f"{arm}.sqlite", EXPECTED["prefill_attention"][arm]) for arm in ARMS}
    assert quantize["nvfp4"] == (0, 0) and quantize["fp8"][0] == 16
    # Every quantize call of the trace lies in a prefill step: the phase holds them all.
    assert quantize["fp8"] == sql_totals(run / "fp8.sqlite", EXPECTED["quantize"]["fp8"])
    assert (said.calls, said.quantize_ns) == quantize["fp8"]
    assert (said.attention_ns, said.other_attention_ns) == (attention["fp8"][1], attention["nvfp4"][1])
    assert said.runs == 1 and "in total" in statement_text(said)

    code, out, err = run_kvtrace("diff", "fp8.sqlite", "nvfp4.sqlite", "--format", "json", cwd=run)
    assert code == 0, err
    shown = json.loads(out)["headline"]
    assert shown["query_quantize"] == [dataclasses.asdict(said)]
    # A Python caller of the library gets the same headline, but for the command as run.
    traces = [run / f"{arm}.sqlite" for arm in ARMS]
    made = RunContext.of(*traces).attach(compare.diff(*map(open_trace, traces), recipes)).headline
    assert json.loads(json.dumps(dataclasses.asdict(made))) == {**shown, "commands": shown["commands"][:-1]}
    code, out, err = run_kvtrace("diff", "fp8.sqlite", "nvfp4.sqlite", "--format", "markdown", cwd=run)
    assert code == 0, err
    assert statement_text(said, md_text) in out.split("### Environment")[0]
    code, out, err = run_kvtrace("diff", "fp8.sqlite", "nvfp4.sqlite", cwd=run)
    assert code == 0, err
    assert " ".join(statement_text(said, visible).split()) in " ".join(out.split("everything else")[0].split())
    assert "only in the baseline" in out  # the quantize rows' own footnote stays: the head says what they are


def test_repeated_runs_state_the_query_quantization_per_run(run_kvtrace, tmp_path):
    """With --repeat the diff sums its runs; the statement gives one run's calls and time (their mean), never
    the pooled sum. A second run with the first run's kernels has the first run's numbers (its header differs, so
    that it is not refused as a byte copy of the first: a run is not independent evidence of itself)."""
    run = VLLM033_RUNS["offline-decode-heavy"]
    for arm in ARMS:
        shutil.copyfile(run / f"{arm}.sqlite", tmp_path / f"{arm}.sqlite")
        (tmp_path / f"{arm}.sqlite").chmod(0o644)
        with sqlite3.connect(tmp_path / f"{arm}.sqlite") as conn:
            conn.execute("PRAGMA user_version = 1")
        conn.close()
    code, out, err = run_kvtrace("diff", run / "fp8.sqlite", run / "nvfp4.sqlite", "--repeat", tmp_path / "fp8.sqlite",
                                 tmp_path / "nvfp4.sqlite", "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    (said,) = data["headline"]["query_quantize"]
    calls, ns = sql_totals(run / "fp8.sqlite", EXPECTED["quantize"]["fp8"])
    (quantize_row,) = [r for r in data["phases"] if r["segment"] == "quantize"]
    assert data["runs"] == said["runs"] == 2 and quantize_row["baseline_total_ns"] == 2 * ns  # the rows sum runs
    assert (said["calls"], said["quantize_ns"]) == (calls, ns)
    assert said["attention_ns"] == _sql_prefill_ns(run / "fp8.sqlite", EXPECTED["prefill_attention"]["fp8"])[1]
    code, out, err = run_kvtrace("diff", run / "fp8.sqlite", run / "nvfp4.sqlite", "--repeat", tmp_path / "fp8.sqlite",
                                 tmp_path / "nvfp4.sqlite", "--format", "markdown")
    assert code == 0, err
    line = next(line for line in out.splitlines() if "query quantization" in line)
    assert f"{calls} quantize calls, {ns / 1e3:.2f} µs per run (mean of 2 runs)" in line and "in total" not in line


def test_the_real_repeats_state_the_query_quantization_per_run(built):
    """On the real `--repeats 2` run the statement is the mean of the two runs' own prefill-step sums (plain SQL
    over fp8.r1 and fp8.r2, which differ), not their pooled sum."""
    run = VLLM033_RUNS["offline-decode-heavy-repeats"]
    (said,) = [s for s in built("offline-decode-heavy-repeats").statements if s.kind == "query_quantize"]
    per_run = [_sql_prefill_ns(run / f"fp8.r{k}.sqlite", EXPECTED["quantize"]["fp8"]) for k in (1, 2)]
    attention = [_sql_prefill_ns(run / f"fp8.r{k}.sqlite", EXPECTED["prefill_attention"]["fp8"])[1] for k in (1, 2)]
    assert per_run[0][1] != per_run[1][1] and all(calls == 16 for calls, _ in per_run)
    assert said.runs == 2 and said.calls == 16
    assert said.quantize_ns == pytest.approx(sum(ns for _, ns in per_run) / 2, abs=1)
    assert said.attention_ns == pytest.approx(sum(attention) / 2, abs=1)
    assert "per run (mean of 2 runs)" in statement_text(said) and "in total" not in statement_text(said)


def test_diff_never_writes_onto_the_log_it_read_the_query_dtypes_from(run_kvtrace, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(VLLM033_RUNS["offline-decode-heavy"], run)
    before = (run / "nvfp4.log").read_bytes()
    code, out, err = run_kvtrace("diff", "fp8.sqlite", "nvfp4.sqlite", "-o", "nvfp4.log", cwd=run)
    assert code == 2 and "never overwrites its inputs" in err and len(err.strip().splitlines()) == 1
    assert (run / "nvfp4.log").read_bytes() == before
