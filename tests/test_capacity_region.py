"""The capacity-bound region (issues 33 and 46): vLLM 0.33, FP8 against NVFP4 on the Llama-3.1-8B-shaped dummy model.
Prefix reuse past FP8's pool, the sweep across FP8's capacity and the preemption case come from the capacity matrix
recorded on an NVIDIA H100 80GB HBM3 (fixtures/vllm033-h100-matrix: one server per arm, 3 interleaved run pairs per
point, 1 GiB of KV pool: 16,384 tokens FP8, 29,120 NVFP4; each point's trace is 8 engine steps of a traced pass of its
own shape, closed before its timed traffic); the matched offline cold prefill and the preemption run
with --repeats 2 are the older H200 recordings (fixtures/vllm033-h200-8b). A capture stopped early is the matrix's
sweep with its last run marked "not run" (a constructed copy).

Every number is checked against a source kvtrace did not compute: the server's per-request counts (the usage
relay's files) against its /metrics counters and the bench client's own per-request lists, the evictions against
the raw KV-event stream, and the kernel rows against plain SQL over the exports.
"""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import statistics
from datetime import datetime
from pathlib import Path

import pytest

from conftest import MATRIX, MATRIX_RUNS, VLLM033_8B_RUNS, reading_stalled_timings
from kvtrace.analyzer import budget, matrix, report, statements
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.render import render_text
from kvtrace.analyzer.render.escape import md_prose
from kvtrace.analyzer.render.matrix import claim_text
from kvtrace.analyzer.render.statements import text as statement_text
from kvtrace.analyzer.reuse import REUSED_SHARE
from kvtrace.analyzer.stats.arm_summary import SAME_WORK_SPREAD
from kvtrace.analyzer.stats.verdicts import Verdict
from kvtrace.errors import KvtraceError
from test_matrix_pooling import run_pair_means, t_interval

PREFIX = MATRIX_RUNS["prefix-reuse"]
COLD = VLLM033_8B_RUNS["capacity-cold-prefill"]
PREEMPTION = VLLM033_8B_RUNS["capacity-preemption"]
SWEEP = MATRIX_RUNS["sweep"]
RUNS = ("fp8.r1", "nvfp4.r1", "fp8.r2", "nvfp4.r2", "fp8.r3", "nvfp4.r3")
REPEATS = ("r1", "r2", "r3")
TOKENS_PER_REQUEST = 2048 + 128  # the sweep's prompt and output


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
    """One server per arm records its whole life's KV events (servers/ARM/kv-events.jsonl), and the prefix cache is
    reset before every point: the point's counts are the stream's batches from the first reset after the point
    started, as many as it counted, in a row, summed; the stream arrived without a gap."""
    arm = json.loads((PREFIX / "manifest.json").read_text())["arms"][run]
    lines = [json.loads(line) for line in (MATRIX / "servers" / arm["server"] / "kv-events.jsonl").read_text()
             .splitlines()]
    assert [line["seq"] for line in lines] == list(range(len(lines)))
    point = _point(run)
    events, started = point["kv_events"], datetime.fromisoformat(point["started_utc"]).timestamp()
    first = next(i for i, line in enumerate(lines) if line["AllBlocksCleared"] and line["ts"] >= started)
    assert lines[first]["ts"] < started + point["seconds"]
    batches = lines[first:first + events["batches"]]
    for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        assert sum(line[kind] for line in batches) == events[kind]
    assert events["exact"] and events["AllBlocksCleared"] == 1 and events["BlockRemoved"] > 0


def _kv_tokens(run: Path, arm: str) -> int:
    """The arm's KV pool in tokens, as its server logged it at startup."""
    (tokens,) = re.findall(r"GPU KV cache size: ([\d,]+) tokens", (run / f"{arm}.server.log").read_text())
    return int(tokens.replace(",", ""))


def test_nvfp4s_pool_holds_the_prefixes_and_evicts_less_in_every_repeat():
    """12 prefixes of 2,048 tokens are 1.5x FP8's pool of 16,384 tokens and inside NVFP4's 29,120 (the startup log)."""
    assert (_kv_tokens(PREFIX, "fp8"), _kv_tokens(PREFIX, "nvfp4")) == (16384, 29120)
    assert _kv_tokens(PREFIX, "fp8") < 12 * 2048 <= _kv_tokens(PREFIX, "nvfp4")
    for repeat in REPEATS:
        fp8, nvfp4 = _point(f"fp8.{repeat}"), _point(f"nvfp4.{repeat}")
        assert nvfp4["requests"]["cached_share"] > fp8["requests"]["cached_share"] + 0.25
        assert nvfp4["kv_events"]["BlockRemoved"] * 5 < fp8["kv_events"]["BlockRemoved"]
        assert _reused(f"nvfp4.{repeat}") > _reused(f"fp8.{repeat}")


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
    """NVFP4's prefix hits are stated as residency beside its slower prefill kernel. In the first run pair NVFP4's
    median TTFT is lower (the bench's per-request TTFTs), which makes the reading a prefix-hit effect; three run
    pairs decide the TTFT (no significant difference, the interval recomputed here from the bench's per-request
    TTFTs), so the words claim no gain: they say what the arms differ in and credit no kernel."""
    result = shared.report([PREFIX])
    (ttft,) = [s for s in result.statements if s.check == "ttft"]
    medians = {arm: 1000 * statistics.median(json.loads((PREFIX / _point(f"{arm}.r1")["bench_result"]).read_text())[
        "ttfts"]) for arm in ("fp8", "nvfp4")}
    assert medians["nvfp4"] < (1 - result.diff.threshold) * medians["fp8"]
    assert ttft.stat == "p50"
    assert (ttft.baseline_ms, ttft.candidate_ms) == pytest.approx((medians["fp8"], medians["nvfp4"]), rel=1e-9)
    assert ttft.reading == statements.PREFIX_HIT and ttft.prefill_verdict == "regression"
    words = statement_text(ttft)
    cached = [sum(r["cached_tokens"] for r in _requests(f"{arm}.r1")) for arm in ("nvfp4", "fp8")]
    assert f"{cached[0]:,} cached prompt tokens (nvfp4) against {cached[1]:,} (fp8)" in words
    removed = [_point(f"{arm}.r1")["kv_events"]["BlockRemoved"] for arm in ("nvfp4", "fp8")]
    assert f"{_reused('nvfp4.r1')} of nvfp4's 96 requests had at least half their prompt served" in words
    assert f"against {_reused('fp8.r1')} of fp8's 96 requests" in words
    assert f"nvfp4 evicted {removed[0]:,} cached KV blocks against {removed[1]:,}" in words
    (spec, pairs), = run_pair_means(PREFIX).items()
    ratio, low, high = t_interval(pairs)
    assert low < 1 < high and len(pairs) == 3
    assert (ttft.estimate.runs, ttft.estimate.verdict) == (3, Verdict.NO_CHANGE)
    assert (ttft.estimate.ratio, ttft.estimate.low, ttft.estimate.high) == pytest.approx((ratio, low, high), rel=1e-6)
    assert (f"the mean over 3 run pairs {ratio:.3f}× [{low:.3f}, {high:.3f}], no significant difference: not a "
            "significant gain. What the arms differ in: ") in words
    assert (f"while prefill attention kernels regressed {ttft.prefill_ratio:.3f}× per call: a capacity / prefix-hit "
            "effect, not a faster prefill kernel") in words
    assert "The TTFT gain" not in words and "too few runs" not in words
    checks = [c for m in (result.serving[0].baseline, result.serving[0].candidate) for c in m.checks
              if c.first.startswith("the server, per request")]
    assert len(checks) == 2 and all(c.agree for c in checks)


def test_the_matrix_states_the_residency_beside_the_cold_kernel(recipes):
    """The decision over the matrix's cold prefill and prefix reuse (one session, one H100): NVFP4's residency (its
    share of cached prompt tokens, its evictions) stated beside its slower prefill kernel on the matched cold
    prefill; three run pairs decide no TTFT difference there, so the residency buys NVFP4 no TTFT choice."""
    result = matrix.build([MATRIX_RUNS["cold-prefill"], PREFIX], recipes)
    spec = _point("fp8.r1")["point"]
    (claim,) = [c for c in result.claims if c.kind == "residency" and c.point == spec]
    shares = list(claim.cached_share)
    assert shares == [_point("fp8.r1")["requests"]["cached_share"], _point("nvfp4.r1")["requests"]["cached_share"]]
    cold_row = next(p.row for s in result.scenarios for p in s.points if p.cold_prefill)
    assert claim.cold_prefill_kernel.row == cold_row and claim.cold_prefill_kernel.ratio > 2
    ratio, low, high = t_interval(run_pair_means(PREFIX)[spec])
    assert low < 1 < high and claim.winner == matrix.NO_CLEAR_WINNER
    words = claim_text(claim, result)
    assert "residency, a capacity effect, not a faster kernel" in words
    assert words.endswith(f"TTFT there: {ratio:.3f}× [{low:.3f}, {high:.3f}] over 3 run pairs (nvfp4 / fp8), no "
                          "significant difference: nvfp4's residency did not buy a better TTFT here.")
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


@pytest.mark.parametrize("run, repeat", [("H200", "r1"), ("H200", "r2"), ("H100", "r1"), ("H100", "r2"),
                                         ("H100", "r3")])
def test_fp8_preempts_and_nvfp4_does_not(run, repeat):
    """32 requests of 1,024 + 512 tokens at concurrency 16 need 24,576 tokens at the end of a wave: past FP8's
    16,384 and inside NVFP4's 29,120, on the H200 (--repeats 2) and in the H100 matrix (3 run pairs). The preemptions
    are the server's counter across the traffic (the scrapes before and after it, read here as text), the completions
    the bench client's. The polled peak KV-cache usage is higher where the server preempted, and below full where it
    did not."""
    path = PREEMPTION if run == "H200" else MATRIX_RUNS["preemption"]
    usage = {}
    for arm, preempted in (("fp8", True), ("nvfp4", False)):
        (point,) = _arm(path, f"{arm}.{repeat}")["points"]
        metrics = point["metrics"]
        counted = (_prom(path / metrics["after"], "vllm:num_preemptions_total")
                   - _prom(path / metrics["before"], "vllm:num_preemptions_total"))
        assert counted == metrics["deltas"]["counters"]["vllm:num_preemptions_total"]
        assert (counted > 0) == preempted
        bench = json.loads((path / point["bench_result"]).read_text())
        assert bench["completed"] == 32 and bench["failed"] == 0
        assert 32 * 1024 == bench["total_input_tokens"] and 32 * 512 == bench["total_output_tokens"]
        usage[arm] = metrics["peaks"]["vllm:kv_cache_usage_perc"]
        assert metrics["peaks"]["vllm:num_requests_running"] <= 16
    assert usage["nvfp4"] < usage["fp8"] <= 1 and usage["nvfp4"] < 1


def test_the_preemption_report_calls_the_ttft_change_capacity_not_kernel(shared):
    """The report's serving row names FP8's preemptions as its capacity bound, and its TTFT statement does not
    credit NVFP4's (slower) prefill kernels with any gain. The H200 run's window closed inside its timed traffic:
    its timings are read stalls and all (conftest.reading_stalled_timings) to test the machinery on them."""
    with reading_stalled_timings():
        result = shared.report([PREEMPTION])
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


@pytest.mark.parametrize("repeat", REPEATS)
def test_the_sweep_crosses_fp8s_capacity(repeat):
    """Each run pair, FP8 first, then NVFP4 on the same points. 2,048 + 128 tokens per request: concurrency 4 fits
    FP8's pool (the startup log's), and from concurrency 8 on it does not: the server ran as many requests at once
    as fit (7), where NVFP4 ran them all. At 16 (34,816 tokens) NVFP4's 29,120 is past too: it preempted (the /metrics
    scrapes before and after the traffic, read as text) and ran fewer than 16 at once, yet more than FP8."""
    order = json.loads((SWEEP / "manifest.json").read_text())["settings"]["order"]
    fp8_run, nvfp4_run = f"fp8.{repeat}", f"nvfp4.{repeat}"
    assert order.index(nvfp4_run) == order.index(fp8_run) + 1
    pools = {"fp8": _kv_tokens(SWEEP, "fp8"), "nvfp4": _kv_tokens(SWEEP, "nvfp4")}
    fp8, nvfp4 = (_arm(SWEEP, run)["points"] for run in (fp8_run, nvfp4_run))
    assert [p["point"] for p in fp8] == [p["point"] for p in nvfp4]
    concurrencies = [json.loads((SWEEP / a["bench_result"]).read_text())["max_concurrency"] for a in fp8]
    assert concurrencies == [4, 8, 12, 16]
    for concurrency, a, b in zip(concurrencies, fp8, nvfp4):
        assert json.loads((SWEEP / b["bench_result"]).read_text())["max_concurrency"] == concurrency
        running = {arm: point["metrics"]["peaks"]["vllm:num_requests_running"] for arm, point in (("fp8", a),
                                                                                                  ("nvfp4", b))}
        preempted = {arm: _prom(SWEEP / point["metrics"]["after"], "vllm:num_preemptions_total")
                     - _prom(SWEEP / point["metrics"]["before"], "vllm:num_preemptions_total")
                     for arm, point in (("fp8", a), ("nvfp4", b))}
        fits = {arm: concurrency * TOKENS_PER_REQUEST <= tokens for arm, tokens in pools.items()}
        assert running["fp8"] == (concurrency if fits["fp8"] else pools["fp8"] // TOKENS_PER_REQUEST)
        assert preempted["fp8"] == 0  # FP8 admitted only what fit: it queued rather than preempted
        if fits["nvfp4"]:
            assert running["nvfp4"] == concurrency and preempted["nvfp4"] == 0
        else:
            assert preempted["nvfp4"] > 0 and running["fp8"] < running["nvfp4"] < concurrency
        for point in (a, b):
            assert len(json.loads((SWEEP / point["requests"]["file"]).read_text())) == \
                json.loads((SWEEP / point["bench_result"]).read_text())["completed"]


# ---- a --repeats capture stopped early -----------------------------------------------------------------------

def _stopped_early(tmp_path: Path) -> Path:
    """A copy of the matrix's sweep as a capture stopped before its last run (nvfp4.r3) would leave it: that arm
    "not run", with no points nor export, as capture writes a run it never started."""
    run = tmp_path / SWEEP.name
    shutil.copytree(SWEEP, run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["arms"]["nvfp4.r3"].update(status="not run", sqlite=None, commands=[], seconds=None, kv_cache=None,
                                        request_order_sha256=None, points=[])
    (run / "manifest.json").chmod(0o644)
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def _ttft_means(run: Path, name: str) -> list[float]:
    """A run's mean TTFT per point, as the bench client wrote it."""
    return [json.loads((run / p["bench_result"]).read_text())["mean_ttft_ms"] for p in _arm(run, name)["points"]]


def test_a_repeats_capture_stopped_early_compares_the_run_pairs_that_ran(tmp_path, recipes):
    """Stopped before nvfp4.r3: the report compares the two run pairs that ran (r1 and r2), says so, and leaves
    fp8.r3, left without a pair, out of every ratio; two run pairs decide nothing."""
    run = _stopped_early(tmp_path)
    result = report.build([run], recipes)
    assert [Path(p).name for p in (*result.baseline.runs, *result.candidate.runs)] == [
        "fp8.r1.p0.sqlite", "fp8.r2.p0.sqlite", "nvfp4.r1.p0.sqlite", "nvfp4.r2.p0.sqlite"]
    note = result.left_out
    head = render_text(result, "markdown").split("<details>", 1)[0]
    assert f"⚠️ {md_prose(note)}" in head and result.to_dict()["left_out"] == note
    assert note.startswith("nvfp4.r3 was not run (the capture stopped before it): 2 of 3 run pairs compared; "
                           "fp8.r3, left without a pair, is not in the ratios")
    means = {name: _ttft_means(run, name) for name in ("fp8.r1", "fp8.r2", "nvfp4.r1", "nvfp4.r2")}
    for index, row in enumerate(result.serving):
        estimate = row.estimates["ttft_ms"]
        fp8, nvfp4 = ([means[f"{arm}.{r}"][index] for r in ("r1", "r2")] for arm in ("fp8", "nvfp4"))
        assert estimate.runs == 2 and estimate.verdict == "too few runs to decide"
        assert estimate.baseline == pytest.approx(sum(fp8) / 2) and estimate.candidate == pytest.approx(sum(nvfp4) / 2)
        assert estimate.ratio == pytest.approx(sum(nvfp4) / sum(fp8))
    assert len(result.serving) == len(means["fp8.r1"]) == 4


def test_the_run_left_without_a_pair_compares_with_its_own_arm(recipes):
    """The command the note gives: fp8.r3 against fp8.r1, the same arm twice, is the run-to-run drift."""
    result = report.build([SWEEP / "fp8.r1", SWEEP / "fp8.r3"], recipes)
    for row, first, second in zip(result.serving, _ttft_means(SWEEP, "fp8.r1"), _ttft_means(SWEEP, "fp8.r3"),
                                  strict=True):
        assert row.estimates["ttft_ms"].ratio == pytest.approx(second / first)


@pytest.mark.parametrize("edit, message", [
    ({"fp8.r2": {"status": "failed", "error": "server exited"}}, "arm fp8.r2 in"),
    ({"fp8.r1": {"status": "not run"}, "fp8.r2": {"status": "not run"}}, "arm fp8.r1 in"),
    ({"fp8.r3": {"status": "failed", "error": "server exited"}}, "arm fp8.r3 in .* failed: server exited"),
])
def test_a_failed_run_or_no_complete_pair_is_still_refused(tmp_path, recipes, edit, message):
    """Only runs the capture never started are left out: a failed one may be the finding (fp8.r3 too, whose partner
    nvfp4.r3 was never run), and with no run pair that both ran there is nothing to compare."""
    run = _stopped_early(tmp_path)
    manifest = json.loads((run / "manifest.json").read_text())
    for name, fields in edit.items():
        manifest["arms"][name].update(fields)
    (run / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(KvtraceError, match=message):
        report.build([run], recipes)


def _sql_prefill_steps(path: Path, like: str) -> dict[str, tuple[int, int]]:
    """Per name of vLLM's pure prefill steps (NVTX ranges execute_context_N(T)_generation_0(0)), the calls and summed
    GPU ns of the kernels matching `like` launched inside them, joined by plain SQL from launch call to range on its
    thread."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return {name: (calls, total) for name, calls, total in conn.execute(
            """SELECT COALESCE(s.value, n.text), count(*), sum(k."end" - k.start) FROM CUPTI_ACTIVITY_KIND_KERNEL k
            JOIN StringIds d ON d.id = k.demangledName
            JOIN CUPTI_ACTIVITY_KIND_RUNTIME r ON r.correlationId = k.correlationId
            JOIN NVTX_EVENTS n ON n.globalTid = r.globalTid AND r.start >= n.start AND r.start < n."end"
            LEFT JOIN StringIds s ON s.id = n.textId
            WHERE d.value LIKE ? AND COALESCE(s.value, n.text) LIKE 'execute_context_%generation_0(0)'
            GROUP BY 1""", (like,))}


PREFILL_KERNELS = (("fp8", "%FP8PrefillWithKVCacheKernel%"),
                   ("nvfp4", "%BatchPrefillWithPagedKVCacheKernel<(bool)1, flashinfer::KernelTraits<"
                             "(flashinfer::MaskMode)1%"))


@pytest.mark.parametrize("run", ["H200 preemption", "sweep", "prefix-reuse", "preemption", "sweep stopped early"])
def test_the_prefill_step_kernel_row_is_plain_sqls(run, recipes, tmp_path):
    """The report's prefill-attention row in prefill steps, every repeat together, against plain SQL. Calls pair
    only within a run pair and inside prefill steps of the same name (the same requests and tokens): the traced
    pass of the matrix batches its first requests as they arrive, so a round's two arms may open with different
    prefill steps, whose calls stay unpaired. The paired calls, each arm's time per call (where the paired steps
    cost alike per call) and the ratio of the summed paired time per run pair and in all; one run pair with pairs
    of several has no interval; where the unpaired calls carry most of the change the row is "different work",
    the pairs' own verdict still a regression (the runs whose pair ran: in the sweep stopped early, r1 and r2)."""
    path = {"H200 preemption": PREEMPTION, "sweep stopped early": None}.get(run, MATRIX_RUNS.get(run)) \
        or _stopped_early(tmp_path)
    result = report.build([path], recipes)
    row = next(r for r in result.diff.phases if r.segment == "prefill_attention" and r.phase == "vLLM prefill steps")
    arms = json.loads((path / "manifest.json").read_text())["arms"]
    rounds = [name.removeprefix("fp8.") for name in arms if name.startswith("fp8.") and arms[name]["status"] == "ok"
              and arms[name.replace("fp8", "nvfp4")]["status"] == "ok"]
    every = {arm: [0, 0] for arm, _ in PREFILL_KERNELS}  # all calls in prefill steps: [calls, ns]
    paired = {arm: [0, 0] for arm, _ in PREFILL_KERNELS}
    per_call = {arm: [] for arm, _ in PREFILL_KERNELS}  # per run pair and step name: the paired calls' mean
    run_ratios = []
    for repeat in rounds:
        found = {arm: _sql_prefill_steps(path / arms[f"{arm}.{repeat}"]["sqlite"], like)
                 for arm, like in PREFILL_KERNELS}
        # A step name's calls pair when both arms made as many there.
        names = [n for n in found["fp8"].keys() & found["nvfp4"].keys() if found["fp8"][n][0] == found["nvfp4"][n][0]]
        for arm, steps in found.items():
            every[arm] = [sum(v[i] for v in steps.values()) + every[arm][i] for i in (0, 1)]
            paired[arm] = [sum(steps[n][i] for n in names) + paired[arm][i] for i in (0, 1)]
            per_call[arm] += [steps[n][1] / steps[n][0] for n in names]
        paired_ns = {arm: sum(steps[n][1] for n in names) for arm, steps in found.items()}
        run_ratios.append(paired_ns["nvfp4"] / paired_ns["fp8"] if names else None)
    assert (row.baseline_calls, row.baseline_total_ns) == tuple(every["fp8"])
    assert (row.candidate_calls, row.candidate_total_ns) == tuple(every["nvfp4"])
    assert row.compared_calls == paired["fp8"][0] == paired["nvfp4"][0] > 0
    assert row.ratio == pytest.approx(paired["nvfp4"][1] / paired["fp8"][1], rel=1e-9) and row.ratio > 2
    # A pooled mean per call only where the paired steps cost alike per call (kvtrace's SAME_WORK_SPREAD).
    if all(max(means) <= (1 + SAME_WORK_SPREAD) * min(means) for means in per_call.values()):
        fp8, nvfp4 = (ns / calls for calls, ns in paired.values())
        assert row.baseline.mean_ns == pytest.approx(fp8, rel=1e-9)
        assert row.candidate.mean_ns == pytest.approx(nvfp4, rel=1e-9)
    else:
        assert row.baseline.mean_ns is None is row.candidate.mean_ns
    assert list(row.run_ratios) == pytest.approx(run_ratios, rel=1e-9)
    if sum(r is not None for r in run_ratios) == 1:  # the run pair is the unit: one shows no spread
        assert row.no_interval and row.ci_low is None and row.verdict == Verdict.INSUFFICIENT_DATA
        return
    verdict = row.verdict
    paired_delta = paired["nvfp4"][1] - paired["fp8"][1]
    unpaired_delta = every["nvfp4"][1] - every["fp8"][1] - paired_delta
    if abs(unpaired_delta) > abs(paired_delta):
        assert verdict == Verdict.DIFFERENT_WORK
        verdict = row.paired_verdict
    assert row.ci_low > 1 and verdict == Verdict.REGRESSION
