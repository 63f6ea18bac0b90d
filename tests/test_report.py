"""`kvtrace report`: the kernel diff beside serving metrics, on the real FlashInfer run directories and the recorded
vLLM manifests in fixtures/vllm-recorded-report/. Kernel numbers are checked against plain SQL over the same
exports, serving numbers against the manifests' own fields, the guard rail against the capacity-win example."""

from __future__ import annotations

import copy
import csv
import io
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner

from conftest import FIXTURES, NSYS2023_DIR, NSYS2025_DIR, sql_durations
from kvtrace.analyzer import report, stats
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.render import json_out, markdown
from kvtrace.analyzer.render.units import duration
from kvtrace.cli import cli, main
from kvtrace.errors import KvtraceError

REPEAT = FIXTURES / "fi-h200-sm90-repeat"
RECORDED = FIXTURES / "vllm-recorded-report"
CAPACITY_WIN = RECORDED / "capacity-win"
SWEEP = RECORDED / "sweep"
VLLM_H200 = sorted(p.parent for p in FIXTURES.glob("vllm-h200-*/manifest.json"))

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
def recipes():
    return load_recipes()


@pytest.fixture(scope="module")
def fi(recipes):
    return report.build([NSYS2025_DIR], recipes)


@pytest.fixture(scope="module")
def win(recipes):
    return report.build([CAPACITY_WIN], recipes)


@pytest.fixture(scope="module")
def sweep(recipes):
    return report.build([SWEEP], recipes)


# ---- the FlashInfer run directory (the demo input) ------------------------------------------------------

def test_one_flashinfer_run_directory_compares_its_two_arms(fi):
    assert (fi.baseline.arm, fi.candidate.arm) == ("fp8", "nvfp4")  # wider format first
    assert fi.baseline.sqlite == str(NSYS2025_DIR / "fp8.sqlite")
    assert (fi.baseline.engine, fi.baseline.kv_format, fi.candidate.kv_format) == ("flashinfer", "fp8", "nvfp4")
    assert fi.diff.schema == "kvtrace.diff/3" and fi.serving == []
    assert fi.baseline.runs == (str(NSYS2025_DIR / "fp8.sqlite"),) and fi.diff.runs == 1
    assert any("no serving metrics" in note for note in fi.notes)


def test_prefill_statement_and_segment_times_match_plain_sql(fi):
    """Prefill spans three contexts (2 ms to 468 ms per call): the report gives each arm's total over the
    paired calls with the diff's interval, no pooled per-call mean, and the statement says "in total"."""
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
    statement = next(s for s in fi.statements if s.check == "prefill")
    assert statement.level == "warning" and f"{sum(cand) / sum(base):.3f}×" in statement.message
    assert "in total over 3 cells" in statement.message and "per call" not in statement.message
    assert "regression" in statement.message and f"{len(base):,} paired calls" in statement.message


def test_ecdf_durations_are_the_traces_per_call_durations(fi):
    for segment, likes in (("prefill_attention", (PREFILL,)), ("decode_attention", (DECODE, MERGE))):
        for side, name in (("baseline", "fp8"), ("candidate", "nvfp4")):
            expected = sorted(sql_durations(NSYS2025_DIR / f"{name}.sqlite", *likes))
            assert fi.durations[segment][side].tolist() == expected, (segment, side)


def test_bandwidth_per_phase_from_the_manifest_bytes_and_sql_time(fi):
    data = manifest(NSYS2025_DIR)
    ceiling = sql(NSYS2025_DIR / "fp8.sqlite", "SELECT memoryBandwidth FROM TARGET_INFO_GPU WHERE id IN "
                  "(SELECT DISTINCT deviceId FROM CUPTI_ACTIVITY_KIND_KERNEL)")[0][0]
    assert fi.hbm_ceiling.bytes_per_s == ceiling and "TARGET_INFO_GPU" in fi.hbm_ceiling.source
    likes = {"prefill": (PREFILL,), "decode": (DECODE, MERGE), "append": (APPEND,)}
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


def test_append_phase_statement_counts_every_kernel_in_the_append_ranges(fi):
    data = manifest(NSYS2025_DIR)
    per_call = {}
    for arm in ("fp8", "nvfp4"):
        phases = [p for p in data["arms"][arm]["workload"]["phases"] if p["nvtx"].startswith("kvtrace:append ")]
        total = sum(sum(sql_durations(NSYS2025_DIR / f"{arm}.sqlite", "%", nvtx=p["nvtx"])) for p in phases)
        per_call[arm] = total / sum(p["calls"] for p in phases)
    statement = next(s for s in fi.statements if s.check == "append" and "append phase" in s.message)
    assert f"{duration(per_call['fp8'])} (fp8) → {duration(per_call['nvfp4'])} (nvfp4)" in statement.message
    assert f"{per_call['nvfp4'] / per_call['fp8']:.3f}×" in statement.message


def test_capacity_in_the_report_uses_the_runs_shape(fi):
    workload = manifest(NSYS2025_DIR)["arms"]["fp8"]["workload"]
    context = workload["contexts"][0]
    per_token = context["kv_bytes_read_per_attention_call"] / (workload["settings"]["batch"] * context["context"])
    assert fi.capacity.formats[0].bytes_per_token == per_token
    assert fi.capacity.ideal_ratio == 0.5625 and fi.capacity.measured == []
    assert next(s for s in fi.statements if s.check == "capacity").message.count("1.78×") == 1


def test_json_is_the_result_object(fi):
    data = json.loads(json_out.render(fi))
    assert data["schema"] == "kvtrace.report/2" and data["diff"]["schema"] == "kvtrace.diff/3"
    assert "durations" not in data
    assert {"statements", "findings", "segment_times", "serving", "bandwidth", "hbm_ceiling", "capacity",
            "plots", "baseline", "candidate", "sweep", "notes"} <= set(data)
    assert data["capacity"]["schema"] == "kvtrace.capacity/2"
    assert len(data["bandwidth"]) == len(fi.bandwidth)


def test_two_run_directories_one_arm_each(recipes):
    result = report.build([NSYS2025_DIR, REPEAT], recipes, arms=("fp8",))
    assert (result.baseline.label, result.candidate.label) == ("fi-h200-sm90/fp8", "fi-h200-sm90-repeat/fp8")
    prefill = next(r for r in result.diff.segments if r.segment == "prefill_attention")
    assert prefill.verdict == stats.NO_CHANGE  # a same-format repeat (fixtures/README.md)
    assert not any(s.check == "capacity" for s in result.statements)  # same format: nothing to say
    named = report.resolve_inputs([NSYS2025_DIR / "fp8", REPEAT / "nvfp4"])
    assert [(i.run, i.arm) for i in named] == [(NSYS2025_DIR, "fp8"), (REPEAT, "nvfp4")]
    both = report.resolve_inputs([NSYS2025_DIR, REPEAT], ("nvfp4", "fp8"))
    assert [i.arm for i in both] == ["nvfp4", "fp8"]
    chosen = report.resolve_inputs([NSYS2025_DIR], ("nvfp4", "fp8"))  # --arm twice: the user's order
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
    message = ttft[0].message
    assert "capacity / prefix-hit effect" in message and "not a faster prefill kernel" in message
    assert f"{hits['nvfp4']:,} cached prompt tokens (nvfp4) against {hits['fp8']:,} (fp8)" in message
    assert f"regressed {np.mean(cand) / np.mean(base):.3f}×" in message
    text = markdown.render(win)
    assert "capacity / prefix-hit effect" in text
    lines = text.splitlines()
    ttft_row = next(i for i, line in enumerate(lines) if line.startswith("| TTFT mean"))
    assert lines[ttft_row + 1].startswith("| cached prompt tokens")  # cached tokens sit beside TTFT
    # Capacity: vLLM's measured tokens beside the ideal.
    assert [m.tokens for m in win.capacity.measured] == [data["arms"][a]["kv_cache"]["tokens"] for a in ("fp8", "nvfp4")]


def _variant(tmp_path: Path, source: Path, edit) -> Path:
    """A synthetic copy of a recorded manifest (sqlite paths made absolute), changed by `edit`."""
    data = copy.deepcopy(manifest(source))
    for arm in data["arms"].values():
        if arm.get("sqlite"):
            arm["sqlite"] = str((source / arm["sqlite"]).resolve())
    edit(data)
    run = tmp_path / f"synthetic-{source.name}"
    run.mkdir()
    (run / "manifest.json").write_text(json.dumps(data))
    return run


def test_guard_rail_stays_quiet_or_changes_its_words_when_the_case_differs(tmp_path, recipes):
    def same_cache(data):
        hits = data["arms"]["fp8"]["points"][0]["metrics"]["deltas"]["counters"]["vllm:prefix_cache_hits_total"]
        data["arms"]["nvfp4"]["points"][0]["metrics"]["deltas"]["counters"]["vllm:prefix_cache_hits_total"] = hits
        data["arms"]["nvfp4"]["points"][0]["capacity"] = data["arms"]["fp8"]["points"][0]["capacity"] = None
        data["arms"]["fp8"]["points"][0]["metrics"]["peaks"]["vllm:kv_cache_usage_perc"] = 0.5

    result = report.build([_variant(tmp_path, CAPACITY_WIN, same_cache)], recipes)
    message = next(s for s in result.statements if s.check == "ttft").message
    assert "prefix-hit" not in message and "outside the prefill kernels" in message

    def ttft_worse(data):
        for arm, value in (("fp8", 100.0), ("nvfp4", 150.0)):
            data["arms"][arm]["points"][0]["bench"]["p50_ttft_ms"] = value

    (tmp_path / "b").mkdir()
    result = report.build([_variant(tmp_path / "b", CAPACITY_WIN, ttft_worse)], recipes)
    statement = next(s for s in result.statements if s.check == "ttft")
    assert "capacity / prefix-hit effect" not in statement.message and "mixes kernel speed" in statement.message

    def fp8_traces_only(data):  # same-format traces: no prefill regression to contradict
        data["arms"]["nvfp4"]["sqlite"] = str(REPEAT / "fp8.sqlite")

    (tmp_path / "c").mkdir()
    result = report.build([_variant(tmp_path / "c", CAPACITY_WIN, fp8_traces_only)], recipes)
    statement = next(s for s in result.statements if s.check == "ttft")
    assert "capacity / prefix-hit effect" not in statement.message


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
    text = markdown.render(sweep)
    assert text.count("◆ fp8") == sum(r.baseline_first_capacity for r in sweep.serving)
    assert any(s.check == "ttft" and "capacity-bound" in s.message for s in sweep.statements)


@pytest.mark.skipif(not VLLM_H200, reason="no real vLLM H200 run directories under fixtures/ yet")
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
    if result.capacity and result.capacity.measured:
        assert result.capacity.measured[0].tokens == data["arms"][result.baseline.arm]["kv_cache"]["tokens"]


# ---- CLI and bad inputs ---------------------------------------------------------------------------------

def test_cli_writes_markdown_json_and_csv(tmp_path):
    runner = CliRunner()
    out = tmp_path / "report.md"
    result = runner.invoke(cli, ["report", str(CAPACITY_WIN), "--format", "markdown", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text().startswith("## kvtrace report: fp8 → nvfp4")
    data = json.loads(runner.invoke(cli, ["report", str(CAPACITY_WIN), "--format", "json"]).stdout)
    points = {arm: manifest(CAPACITY_WIN)["arms"][arm]["points"][0] for arm in ("fp8", "nvfp4")}
    assert data["serving"][0]["baseline"]["ttft_ms"]["p50"] == points["fp8"]["bench"]["p50_ttft_ms"]
    rows = list(csv.DictReader(io.StringIO(runner.invoke(cli, ["report", str(CAPACITY_WIN), "--format", "csv"]).stdout)))
    cached = [r for r in rows if r["section"] == "serving" and r["metric"] == "cached_prompt_tokens"]
    assert {r["arm"]: float(r["value"]) for r in cached} == {
        arm: point["metrics"]["deltas"]["counters"]["vllm:prefix_cache_hits_total"] for arm, point in points.items()}
    table = runner.invoke(cli, ["report", str(CAPACITY_WIN), "--label", "A", "--label", "B"])
    assert table.exit_code == 0 and "A" in table.stdout and "prefix-hit effect" in table.stdout


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
        report.resolve_inputs([NSYS2025_DIR, REPEAT])
    with pytest.raises(KvtraceError, match="one run directory and one --arm"):
        report.resolve_inputs([NSYS2025_DIR], ("fp8",))


def test_subprocess_smoke(tmp_path):
    """The installed entry point end to end, as `make demo` runs it."""
    out = tmp_path / "demo-report.md"
    result = subprocess.run([sys.executable, "-m", "kvtrace", "report", str(NSYS2025_DIR), "--format", "markdown",
                             "-o", str(out), "--plots", str(tmp_path / "plots")], capture_output=True, text=True,
                            cwd=tmp_path, check=False)
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert "![" in text and "(plots/segment-times.png)" in text and (tmp_path / "plots" / "segment-times.png").is_file()


def test_offline_point_records_give_means_and_rates():
    """A synthetic offline-mode point (the vLLM engine's worker record: counts, cached tokens, vLLM's histogram
    deltas, no client percentiles): means come from the histograms, rates from counts over wall time."""
    record = {"point": "input=1024,output=8,prompts=16,concurrency=16", "elapsed_s": 2.5, "requests": 16,
              "tokens_in": 16 * 1024, "tokens_out": 16 * 8, "cached_tokens": 512, "capacity": None,
              "metrics": {"deltas": {"counters": {"vllm:num_preemptions_total": 0.0},
                                     "histograms": {"vllm:time_to_first_token_seconds": {"count": 16.0, "sum": 4.0},
                                                    "vllm:inter_token_latency_seconds": {"count": 112.0, "sum": 2.24}}}}}
    metrics = report.serving_metrics(record, kv_cache_tokens=None)
    assert metrics.source == "vLLM metrics (offline)"
    assert metrics.ttft_ms.mean == pytest.approx(4.0 / 16 * 1000) and metrics.ttft_ms.p50 is None
    assert metrics.itl_ms.mean == pytest.approx(2.24 / 112 * 1000)
    assert metrics.cached_prompt_tokens == 512 and metrics.prompt_tokens == 16 * 1024
    assert metrics.input_tokens_per_s == 16 * 1024 / 2.5 and metrics.output_tokens_per_s == 16 * 8 / 2.5
    assert metrics.capacity is None
    # The same point against a pool too small for 16 x (1,024 + 8) tokens is capacity-bound (the engine's rule).
    tight = report.serving_metrics(record, kv_cache_tokens=16 * (1024 + 8))
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
    inputs = report.resolve_inputs([tmp_path / "fp8.manifest.json", tmp_path / "nvfp4.manifest.json"])
    assert [(i.run, i.arm) for i in inputs] == [(tmp_path, "fp8"), (tmp_path, "nvfp4")]
