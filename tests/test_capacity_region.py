"""The capacity-bound region on the H200 (issue 33): vLLM 0.33, FP8 against NVFP4 on the Llama-3.1-8B-shaped dummy
model (fixtures/vllm033-h200-8b, fixtures/README.md). Prefix reuse past FP8's pool and the preemption case, each
with --repeats 2, the sweep across FP8's capacity (once per arm, then again with --repeats 2, which the device's time
cut short after three of its four runs), and the matched cold prefill.

Every number is checked against a source kvtrace did not compute: the server's per-request counts (the usage
relay's files) against its /metrics counters and the bench client's own per-request lists, the evictions against
the raw KV-event stream, and the kernel rows against plain SQL over the exports.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from conftest import MATRIX_RUNS, VLLM033_8B_RUNS
from kvtrace.analyzer import budget, matrix, report, statements
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.render import render_text
from kvtrace.analyzer.render.escape import md_prose
from kvtrace.analyzer.render.matrix import claim_text
from kvtrace.analyzer.render.statements import text as statement_text
from kvtrace.analyzer.reuse import REUSED_SHARE
from kvtrace.errors import KvtraceError

PREFIX = MATRIX_RUNS["prefix-reuse"]
COLD = VLLM033_8B_RUNS["capacity-cold-prefill"]
PREEMPTION = VLLM033_8B_RUNS["capacity-preemption"]
SWEEP = MATRIX_RUNS["sweep"]
SWEEP_REPEATS = MATRIX_RUNS["sweep"]
RUNS = ("fp8.r1", "nvfp4.r1", "fp8.r2", "nvfp4.r2")


@pytest.fixture(scope="module")
def recipes():
    return load_recipes()


def _point(run: str) -> dict:
    return json.loads((PREFIX / "manifest.json").read_text())["arms"][run]["points"][0]


def _requests(run: str) -> list[dict]:
    return json.loads((PREFIX / _point(run)["requests"]["file"]).read_text())


def _reused(run: str) -> int:
    return sum(1 for r in _requests(run) if r["cached_tokens"] >= REUSED_SHARE * r["prompt_tokens"])


@pytest.mark.parametrize("run", RUNS)
def test_each_requests_cached_tokens_add_up_to_the_servers_counter(run):
    """The relay's per-request counts (usage.prompt_tokens_details) against /metrics' cached-token counter, and
    their prompt tokens against the bench client's own total."""
    point, requests = _point(run), _requests(run)
    bench = json.loads((PREFIX / point["bench_result"]).read_text())
    assert len(requests) == bench["completed"] == 96 and {r["status"] for r in requests} == {200}
    assert sum(r["prompt_tokens"] for r in requests) == bench["total_input_tokens"]
    counters = point["metrics"]["deltas"]["counters"]
    assert sum(r["cached_tokens"] for r in requests) == counters["vllm:prompt_tokens_cached_total"]
    assert all(0 <= r["cached_tokens"] <= r["prompt_tokens"] for r in requests)
    assert all(0 < r["first_token_ms"] <= r["end_ms"] for r in requests)


@pytest.mark.parametrize("run", RUNS)
def test_evictions_are_the_raw_event_streams_own(run):
    """The arm's totals are the event file's sums, its batches arrived without a gap, and the point's evictions are
    within them."""
    manifest = json.loads((PREFIX / "manifest.json").read_text())["arms"][run]
    lines = [json.loads(line) for line in (PREFIX / manifest["kv_events"]["file"]).read_text().splitlines()]
    totals = manifest["kv_events"]["totals"]
    assert [line["seq"] for line in lines] == list(range(len(lines))) and totals["batches"] == len(lines)
    for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        assert sum(line[kind] for line in lines) == totals[kind]
    events = _point(run)["kv_events"]
    assert events["exact"] and 0 < events["BlockRemoved"] <= totals["BlockRemoved"]


def test_nvfp4s_pool_holds_the_prefixes_and_evicts_less_in_both_repeats():
    """12 prefixes of 2,048 tokens are 1.5x FP8's pool of 16,384 tokens and inside NVFP4's 29,120 (the startup log)."""
    for repeat in ("r1", "r2"):
        fp8, nvfp4 = _point(f"fp8.{repeat}"), _point(f"nvfp4.{repeat}")
        assert nvfp4["requests"]["cached_share"] > fp8["requests"]["cached_share"] + 0.25
        assert nvfp4["kv_events"]["BlockRemoved"] * 5 < fp8["kv_events"]["BlockRemoved"]
        assert _reused(f"nvfp4.{repeat}") > _reused(f"fp8.{repeat}")
    for run, tokens in (("fp8.r1", 16384), ("nvfp4.r1", 29120)):
        assert f"GPU KV cache size: {tokens:,} tokens" in (PREFIX / f"{run}.log").read_text()


def _sql_mean(path: Path, like: str) -> float:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        calls, total = conn.execute("""SELECT count(*), sum(k."end" - k.start) FROM CUPTI_ACTIVITY_KIND_KERNEL k
            JOIN StringIds s ON s.id = k.demangledName WHERE s.value LIKE ?""", (like,)).fetchone()
    return total / calls


def test_the_cold_prefill_kernel_row_is_plain_sqls(shared):
    """On the 8B shape the NVFP4 FA2 prefill kernel is slower per call than FP8's FA3 one, and it is a small part
    of the step: the GEMMs dominate."""
    result = shared.report([COLD])
    row = next(r for r in result.diff.segments if r.segment == "prefill_attention")
    nvfp4 = _sql_mean(COLD / "nvfp4.sqlite",
                      "%BatchPrefillWithPagedKVCacheKernel<(bool)1, flashinfer::KernelTraits<(flashinfer::MaskMode)1%")
    fp8 = _sql_mean(COLD / "fp8.sqlite", "%FP8PrefillWithKVCacheKernel%")
    assert row.compared_calls == 128 and row.ratio == pytest.approx(nvfp4 / fp8, rel=1e-9)
    assert row.verdict == "regression" and row.ratio > 2
    gemm = next(r for r in result.diff.segments if r.segment == "gemm")
    assert gemm.baseline_total_ns > 10 * row.baseline_total_ns


def test_the_report_keeps_residency_apart_from_the_slower_kernel(shared):
    result = shared.report([PREFIX])
    (ttft,) = [s for s in result.statements if s.check == "ttft"]
    assert ttft.reading == statements.PREFIX_HIT_SLOWER and ttft.prefill_verdict == "regression"
    words = statement_text(ttft)
    removed = [_point(f"{arm}.r1")["kv_events"]["BlockRemoved"] for arm in ("nvfp4", "fp8")]
    assert f"{_reused('nvfp4.r1')} of nvfp4's 96 requests had at least half their prompt served" in words
    assert f"against {_reused('fp8.r1')} of fp8's 96 requests" in words
    assert f"nvfp4 evicted {removed[0]:,} cached KV blocks against {removed[1]:,}" in words
    # Two run pairs decide nothing: the words say what was measured and what would decide it, never that the hits
    # did not make up for the kernels.
    assert "not a faster prefill kernel" in words and "its TTFT is not lower" not in words
    assert "too few runs to decide (2 run pairs, 3 needed): record --repeats 3" in words
    checks = [c for m in (result.serving[0].baseline, result.serving[0].candidate) for c in m.checks
              if c.first.startswith("the server, per request")]
    assert len(checks) == 2 and all(c.agree for c in checks)


def test_the_matrix_states_the_residency_beside_the_cold_kernel(recipes):
    """The decision over both runs: NVFP4's residency (its share of cached prompt tokens, its evictions) stated
    beside its slower prefill kernel on the matched cold prefill, and no TTFT choice for it on the strength of
    the residency."""
    result = matrix.build([COLD, PREFIX], recipes)
    (claim,) = [c for c in result.claims if c.kind == "residency"]
    shares = list(claim.cached_share)
    assert shares == [_point("fp8.r1")["requests"]["cached_share"], _point("nvfp4.r1")["requests"]["cached_share"]]
    cold_row = next(p.row for s in result.scenarios for p in s.points if p.cold_prefill)
    assert claim.cold_prefill_kernel.row == cold_row and claim.cold_prefill_kernel.ratio > 2
    assert claim.winner != "candidate"
    words = claim_text(claim, result)
    assert "residency, a capacity effect, not a faster kernel" in words and "did not buy" not in words
    assert words.endswith("not decided: too few runs to decide (2 run pairs, 3 needed): record --repeats 3.")
    assert f"{100 * shares[1]:.1f}% of its prompt tokens" in words


@pytest.mark.parametrize("damage", ["not json", "a negative count", "more cached than prompted"])
def test_a_damaged_per_request_file_is_one_line(damage, tmp_path, run_kvtrace):
    """A copy of the real run with one arm's per-request file damaged: one line naming the file, exit 2."""
    from test_bad_input import assert_one_line_error

    run = tmp_path / PREFIX.name
    shutil.copytree(PREFIX, run)
    target = run / _point("fp8.r1")["requests"]["file"]
    target.chmod(0o644)
    entries = _requests("fp8.r1")
    if damage == "not json":
        target.write_text("{")
    else:
        entries[0]["cached_tokens"] = -1 if damage == "a negative count" else entries[0]["prompt_tokens"] + 1
        target.write_text(json.dumps(entries))
    code, out, err = run_kvtrace("report", run)
    assert_one_line_error(code, out, err, target.name)


def _prom(path: Path, metric: str) -> float:
    """One unlabelled-engine sample of a /metrics scrape, read as text."""
    (value,) = [float(line.rsplit(" ", 1)[1]) for line in path.read_text().splitlines()
                if line.startswith(metric + "{")]
    return value


def _arm(run: Path, name: str) -> dict:
    return json.loads((run / "manifest.json").read_text())["arms"][name]


@pytest.mark.parametrize("repeat", ["r1", "r2"])
def test_fp8_preempts_and_nvfp4_does_not(repeat):
    """32 requests of 1,024 + 512 tokens at concurrency 16 need 24,576 tokens at the end of a wave: past FP8's
    16,384 and inside NVFP4's 29,120. The preemptions are the server's counter across the traffic (the scrapes
    before and after it, read here as text), the completions the bench client's."""
    for arm, preempted in (("fp8", True), ("nvfp4", False)):
        name = f"{arm}.{repeat}"
        (point,) = _arm(PREEMPTION, name)["points"]
        counted = (_prom(PREEMPTION / f"{name}.metrics.after.prom", "vllm:num_preemptions_total")
                   - _prom(PREEMPTION / f"{name}.metrics.before.prom", "vllm:num_preemptions_total"))
        assert counted == point["metrics"]["deltas"]["counters"]["vllm:num_preemptions_total"]
        assert (counted > 0) == preempted
        bench = json.loads((PREEMPTION / point["bench_result"]).read_text())
        assert bench["completed"] == 32 and bench["failed"] == 0
        peaks = point["metrics"]["peaks"]
        assert (peaks["vllm:kv_cache_usage_perc"] == 1.0) == preempted
        assert peaks["vllm:num_requests_running"] <= 16


def test_the_preemption_report_calls_the_ttft_change_capacity_not_kernel(preemption_report):
    """The report's serving row names FP8's preemptions as its capacity bound, and its TTFT statement does not
    credit NVFP4's (slower) prefill kernels with any gain."""
    result = preemption_report
    (row,) = result.serving
    assert row.baseline.capacity and not row.candidate.capacity and "preemption" in row.baseline.capacity
    (ttft,) = [s for s in result.statements if s.check == "ttft"]
    assert ttft.prefill_verdict == "regression"
    # The server's TTFT budget: fp8's requests queued, nvfp4's did not; queue time carries the difference.
    assert ttft.reading == statements.BUDGET and ttft.reason.budget.carrier == "queue"
    assert ttft.reason.cause == budget.CAPACITY and ttft.reason.budget.part("queue").delta_ms < -300
    # The first run's p50 is lower, but two run pairs decide nothing: no gain is claimed, nor its absence.
    assert ttft.estimate.runs == 2 and ttft.estimate.verdict == "too few runs to decide"
    words = statement_text(ttft)
    assert "too few runs to decide (2 run pairs, 3 needed): record --repeats 3" in words
    assert "by vLLM's TTFT budget, nvfp4 − fp8: queue time −" in words
    assert "the TTFT gain is" not in words and "faster" not in words


@pytest.mark.parametrize("run, fp8_run, nvfp4_run", [(SWEEP, "fp8", "nvfp4"), (SWEEP_REPEATS, "fp8.r1", "nvfp4.r1"),
                                                     (SWEEP_REPEATS, "fp8.r1", "nvfp4.r2")])
def test_the_sweep_crosses_fp8s_capacity_on_nvfp4s_grid(run, fp8_run, nvfp4_run):
    """NVFP4 (the narrower format) ran first and set the grid; FP8 followed it. From concurrency 8 on, 2,048 + 128
    tokens per request pass FP8's 16,384: the server ran at most 7 requests at once, while NVFP4 ran them all. Both
    sweeps, a session apart, and the sweep's two NVFP4 runs."""
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["settings"]["order"][:2] == [nvfp4_run.replace("r2", "r1"), fp8_run]
    fp8, nvfp4 = (_arm(run, arm)["points"] for arm in (fp8_run, nvfp4_run))
    assert [p["point"] for p in fp8] == [p["point"] for p in nvfp4]
    for a, b in zip(fp8, nvfp4):
        concurrency = json.loads((run / a["bench_result"]).read_text())["max_concurrency"]
        running = (a["metrics"]["peaks"]["vllm:num_requests_running"],
                   b["metrics"]["peaks"]["vllm:num_requests_running"])
        fits = concurrency * (2048 + 128) <= 16384
        assert running[0] == (concurrency if fits else 7)
        # NVFP4 ran them all, but where it preempted (at 14, its pool's edge) one request was back in the queue.
        preempted = b["metrics"]["deltas"]["counters"].get("vllm:num_preemptions_total", 0)
        assert running[1] == concurrency if not preempted else concurrency - 1 <= running[1] <= concurrency
        for point in (a, b):
            assert len(json.loads((run / point["requests"]["file"]).read_text())) == \
                json.loads((run / point["bench_result"]).read_text())["completed"]


# ---- a --repeats capture stopped early -----------------------------------------------------------------------

def _ttft_means(run: Path, name: str) -> list[float]:
    """A run's mean TTFT per point, as the bench client wrote it."""
    return [json.loads((run / p["bench_result"]).read_text())["mean_ttft_ms"] for p in _arm(run, name)["points"]]


def test_a_repeats_capture_stopped_early_compares_the_run_pairs_that_ran(shared):
    """The device's time ran out before fp8.r2: the report compares fp8.r1 with nvfp4.r1, the one run pair that ran,
    says so, and leaves nvfp4.r2 out of every ratio."""
    statuses = {name: arm["status"] for name, arm in json.loads((SWEEP_REPEATS / "manifest.json").read_text())[
        "arms"].items()}
    assert statuses == {"nvfp4.r1": "ok", "fp8.r1": "ok", "nvfp4.r2": "ok", "fp8.r2": "not run"}
    result = shared.report([SWEEP_REPEATS])
    assert [Path(p).name for p in (*result.baseline.runs, *result.candidate.runs)] == ["fp8.r1.sqlite",
                                                                                       "nvfp4.r1.sqlite"]
    note = result.left_out
    head = render_text(result, "markdown").split("<details>", 1)[0]
    assert f"⚠️ {md_prose(note)}" in head and result.to_dict()["left_out"] == note
    assert note.startswith("fp8.r2 was not run (the capture stopped before it): 1 of 2 run pairs compared; "
                           "nvfp4.r2, left without a pair, is not in the ratios")
    for row, fp8, nvfp4 in zip(result.serving, _ttft_means(SWEEP_REPEATS, "fp8.r1"),
                               _ttft_means(SWEEP_REPEATS, "nvfp4.r1"), strict=True):
        estimate = row.estimates["ttft_ms"]
        assert estimate.runs == 1 and estimate.baseline == pytest.approx(fp8) and \
            estimate.candidate == pytest.approx(nvfp4)


def test_the_run_left_without_a_pair_compares_with_its_own_arm(recipes):
    """The command the note gives: nvfp4.r2 against nvfp4.r1, the same arm twice, is the run-to-run drift."""
    result = report.build([SWEEP_REPEATS / "nvfp4.r1", SWEEP_REPEATS / "nvfp4.r2"], recipes)
    for row, first, second in zip(result.serving, _ttft_means(SWEEP_REPEATS, "nvfp4.r1"),
                                  _ttft_means(SWEEP_REPEATS, "nvfp4.r2"), strict=True):
        assert row.estimates["ttft_ms"].ratio == pytest.approx(second / first)


@pytest.mark.parametrize("edit, message", [
    ({"fp8.r2": {"status": "failed", "error": "server exited"}}, "arm fp8.r2 in"),
    ({"fp8.r1": {"status": "not run"}}, "arm fp8.r1 in"),
    ({"nvfp4.r2": {"status": "failed", "error": "server exited"}}, "arm nvfp4.r2 in .* failed: server exited"),
])
def test_a_failed_run_or_no_complete_pair_is_still_refused(tmp_path, recipes, edit, message):
    """Only runs the capture never started are left out: a failed one may be the finding (nvfp4.r2 too, whose
    partner fp8.r2 was never run), and with no run pair that both ran there is nothing to compare."""
    run = tmp_path / SWEEP_REPEATS.name
    shutil.copytree(SWEEP_REPEATS, run)
    manifest = json.loads((run / "manifest.json").read_text())
    for name, fields in edit.items():
        manifest["arms"][name].update(fields)
    (run / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(KvtraceError, match=message):
        report.build([run], recipes)


def _sql_prefill_step_calls(path: Path, like: str) -> tuple[int, int]:
    """Calls and summed GPU ns of the kernels matching `like` launched inside vLLM's pure prefill steps (NVTX ranges
    named execute_context_N(T)_generation_0(0)), joined by plain SQL from launch call to range on its thread."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return conn.execute("""SELECT count(*), sum(k."end" - k.start) FROM CUPTI_ACTIVITY_KIND_KERNEL k
            JOIN StringIds d ON d.id = k.demangledName
            JOIN CUPTI_ACTIVITY_KIND_RUNTIME r ON r.correlationId = k.correlationId
            JOIN NVTX_EVENTS n ON n.globalTid = r.globalTid AND r.start >= n.start AND r.start < n."end"
            LEFT JOIN StringIds s ON s.id = n.textId
            WHERE d.value LIKE ? AND COALESCE(s.value, n.text) LIKE 'execute_context_%generation_0(0)'""",
                            (like,)).fetchone()


@pytest.mark.parametrize("run", ["capacity-preemption", "capacity-sweep", "capacity-sweep-repeats"])
def test_the_prefill_step_kernel_row_is_plain_sqls(run, recipes):
    """The report's prefill-attention row in prefill steps, every repeat together, against plain SQL: each arm's
    time per call, and their ratio (the runs whose pair ran: in the sweep cut short, fp8.r1 and nvfp4.r1)."""
    path = VLLM033_8B_RUNS[run]
    result = report.build([path], recipes)
    row = next(r for r in result.diff.phases if r.segment == "prefill_attention" and r.phase == "vLLM prefill steps")
    arms = json.loads((path / "manifest.json").read_text())["arms"]
    paired = [n for n in arms if arms[n]["status"] == "ok" and n.replace("nvfp4", "fp8").replace("fp8", "x") in
              {m.replace("nvfp4", "fp8").replace("fp8", "x") for m in arms if m != n and arms[m]["status"] == "ok"}]
    exports = sorted(path / arms[n]["sqlite"] for n in paired)
    per_arm = {}
    for arm, like in (("fp8", "%FP8PrefillWithKVCacheKernel%"),
                      ("nvfp4", "%BatchPrefillWithPagedKVCacheKernel<(bool)1, flashinfer::KernelTraits<"
                                "(flashinfer::MaskMode)1%")):
        found = [_sql_prefill_step_calls(e, like) for e in exports if e.name.startswith(arm + ".")]
        per_arm[arm] = (sum(c for c, _ in found), sum(t for _, t in found))
    assert row.compared_calls == per_arm["fp8"][0] == per_arm["nvfp4"][0]
    fp8, nvfp4 = (total / calls for calls, total in per_arm.values())
    assert row.baseline.mean_ns == pytest.approx(fp8, rel=1e-9) and row.candidate.mean_ns == pytest.approx(nvfp4, rel=1e-9)
    assert row.ratio == pytest.approx(nvfp4 / fp8, rel=1e-9) and row.verdict == "regression" and row.ratio > 2
