"""What `kvtrace matrix` and `kvtrace report` say over the four vLLM 0.33 runs on the Llama-3.1-8B-shaped model
(fixtures/vllm033-h200-8b): the capacity-bound region's decision lines, the server's measures beside them, the
bench's wall time, and no interval that is not a number.

Numbers are checked against what kvtrace did not compute: the run directories' manifests (/metrics counters and
histograms), the bench result files, and a diff of the one run pair whose steps matched.
"""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path
from statistics import mean

import pytest
from rich.console import Console

from conftest import MATRIX_RUNS, VLLM033_8B_RUNS, deciding_on_any_run_pairs
from kvtrace.analyzer import claims as claims_lib, compare, matrix, report
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.load import open_traces
from kvtrace.analyzer.render import render_table, render_text
from kvtrace.analyzer.render.matrix import claim_text, kernel_table, table
from kvtrace.analyzer.render.statements import text as statement_text
from kvtrace.analyzer.render.units import interval
from kvtrace.analyzer.stats import bootstrap, serving_intervals
from kvtrace.analyzer.stats.verdicts import Verdict
from kvtrace.text import plural

PREEMPTION = VLLM033_8B_RUNS["capacity-preemption"]
SWEEP = MATRIX_RUNS["sweep"]
ONE_RUN_PAIR = bootstrap.NO_INTERVAL_WHY[bootstrap.ONE_RUN_PAIR]
NAN = re.compile(r"\bnan\b", re.IGNORECASE)


@pytest.fixture(scope="module")
def recipes():
    return load_recipes()


@pytest.fixture(scope="module")
def preemption(preemption_report):
    return preemption_report


@pytest.fixture(scope="module")
def decision(capacity_matrix):
    return capacity_matrix


@pytest.fixture(scope="module")
def decided(recipes):
    """The same matrix as if one or two run pairs could decide (none can): the reasons a decided point gives."""
    with deciding_on_any_run_pairs():
        return matrix.build([VLLM033_8B_RUNS[name] for name in sorted(VLLM033_8B_RUNS)], recipes)


def _points(run, arm: str) -> list[dict]:
    """An arm's points as the capture recorded them (a --repeats arm's every run, in repeat order)."""
    arms = json.loads((run / "manifest.json").read_text())["arms"]
    return [point for name in sorted(arms) if name.split(".")[0] == arm for point in arms[name]["points"]]


def _counter(point: dict, name: str) -> float:
    return point["metrics"]["deltas"]["counters"].get(name, 0)


def _queue_ms(point: dict) -> float:
    histogram = point["metrics"]["deltas"]["histograms"]["vllm:request_queue_time_seconds"]
    return 1000 * histogram["sum"] / histogram["count"]


def _decode_steps(diff, family: str):
    return next(r for r in diff.family_phases if r.segment == "decode_attention" and r.phase == "vLLM decode steps"
                and family in r.family)


def _outputs(result) -> dict[str, str]:
    buffer = io.StringIO()
    render_table(result, Console(file=buffer, width=200))
    texts = {"table": buffer.getvalue()}
    texts.update({fmt: render_text(result, fmt) for fmt in ("markdown", "json", "csv")
                  if not (fmt == "csv" and isinstance(result, matrix.Matrix))})
    return texts


# ---- intervals: a row paired in one run pair of two -------------------------------------------------------

def test_a_row_paired_in_one_run_pair_of_two_has_no_interval_and_says_why(preemption, recipes):
    """r1's arms scheduled different vLLM steps (a finding), r2's the same: the decode steps' decode attention paired
    its 928 calls in r2 alone. Its ratio is r2's own (a diff of r2 alone, which has an interval of r2's calls), and
    over both run pairs it has none: one run pair cannot show how runs vary."""
    assert any(f.message.startswith("r1: the arms scheduled different vLLM steps") for f in preemption.diff.findings)
    assert any(f.message.startswith("r2: both arms ran the same 32 vLLM steps") for f in preemption.diff.findings)
    row = _decode_steps(preemption.diff, "BatchPrefillWithPagedKVCacheKernel")
    assert row.compared_calls == 928 and row.run_ratios[0] is None
    assert row.ci_low is None and row.ci_high is None and row.no_interval == ONE_RUN_PAIR
    assert row.verdict == Verdict.DIFFERENT_WORK and row.paired_verdict == Verdict.INSUFFICIENT_DATA
    assert "calls paired in r2 only, of 2 run pairs" in row.note

    fp8, nvfp4 = open_traces([PREEMPTION / "fp8.r2.sqlite", PREEMPTION / "nvfp4.r2.sqlite"])
    alone = _decode_steps(compare.diff(fp8, nvfp4, recipes), "BatchPrefillWithPagedKVCacheKernel")
    assert alone.compared_calls == 928 and alone.ratio == pytest.approx(row.ratio, rel=1e-12)
    assert alone.ratio == pytest.approx(row.run_ratios[1], rel=1e-12) and alone.ci_low < alone.ratio < alone.ci_high

    merge = _decode_steps(preemption.diff, "MergeStates")
    assert merge.no_interval == ONE_RUN_PAIR and merge.verdict == Verdict.INSUFFICIENT_DATA  # 0.964x: beyond ±2%


def test_a_row_paired_in_two_run_pairs_of_three_is_resampled_over_those(recipes):
    """The same runs with r2 again as a third run pair: the decode steps' rows paired in two of three run pairs get an
    interval over those two (finite, around the ratio), where the row's draws once included 0 / 0."""
    names = ("fp8.r1", "fp8.r2", "fp8.r2", "nvfp4.r1", "nvfp4.r2", "nvfp4.r2")
    traces = open_traces([PREEMPTION / f"{name}.sqlite" for name in names])
    diff = compare.diff(traces[:3], traces[3:], recipes)
    row = _decode_steps(diff, "BatchPrefillWithPagedKVCacheKernel")
    assert diff.runs == 3 and row.run_ratios[0] is None and row.compared_calls == 2 * 928
    assert row.no_interval is None and row.ci_low < row.ratio < row.ci_high
    assert "calls paired in r2 and r3 only, of 3 run pairs: the interval resamples those" in row.note


@pytest.mark.parametrize("which", ["report", "matrix"])
def test_no_output_prints_nan_for_an_interval(which, preemption, decision):
    result = preemption if which == "report" else decision
    for fmt, text in _outputs(result).items():
        assert not NAN.search(text), f"{which} {fmt}: {NAN.search(text).group()!r}"
    json.loads(render_text(result, "json"), parse_constant=lambda c: pytest.fail(f"{which} JSON holds {c}"))
    words = [statement_text(s) for s in preemption.statements if s.kind == "kernels" and s.no_interval]
    assert len(words) == 3 and all(f"× no interval ({ONE_RUN_PAIR})" in w for w in words)
    cells = [cell for row in kernel_table(decision, str)[1] for cell in row if "no interval" in cell]
    assert len(cells) == 3 and all(ONE_RUN_PAIR in cell for cell in cells)


def test_an_interval_that_is_not_a_number_is_no_interval():
    assert interval(float("nan"), float("nan")) == "no interval"
    assert interval(None, 1.0, "why") == "no interval (why)" and interval(0.5, 1.5) == "[0.500, 1.500]"


# ---- counts and their nouns ----------------------------------------------------------------------------------

def test_one_preemption_is_singular(decision):
    """The sweep's last point: NVFP4 preempted once (its /metrics counter), FP8 not at all."""
    last = _points(SWEEP, "nvfp4")[-1]
    assert _counter(last, "vllm:num_preemptions_total") == 1
    point = next(p for s in decision.scenarios for p in s.points if p.scenario.startswith("sweep") and
                 p.point == last["point"])
    assert point.candidate_capacity == "1 preemption"
    body = " ".join(" ".join(row) for row in table(decision, str)[1])
    assert "nvfp4: 1 preemption" in body and "1 preemptions" not in body
    assert [plural(n, "preemption") for n in (0, 1, 9)] == ["preemptions", "preemption", "preemptions"]


# ---- residency where prefix caching happened ------------------------------------------------------------------

def test_residency_is_stated_only_where_prefix_caching_happened(decision):
    """Of the serve points, only prefix reuse served prompt tokens from the cache (the server's per-request counts,
    from the relay's files) or evicted cached blocks: it alone gets a residency sentence."""
    cached = {}
    for name in ("capacity-preemption", "capacity-prefix-reuse", "capacity-sweep"):
        run = VLLM033_8B_RUNS[name]
        for arm in ("fp8", "nvfp4"):
            for point in _points(run, arm):
                requests = json.loads((run / point["requests"]["file"]).read_text())
                removed = (point.get("kv_events") or {}).get("BlockRemoved", 0)
                key = (name, point["point"])
                cached[key] = cached.get(key, False) or sum(r["cached_tokens"] for r in requests) > 0 or removed > 0
    assert sum(cached.values()) == 1
    claims = [c for c in decision.claims if c.kind == "residency"]
    assert [c.point for c in claims] == [point for (_, point), used in cached.items() if used]
    words = "\n".join(claim_text(c, decision) for c in decision.claims)
    assert words.count("Residency at") == 1 and "the same share" not in words


# ---- capacity: the server's measures, one arm bound or both -----------------------------------------------

def _capacity_claims(decision, run) -> dict[str, claims_lib.CapacityClaim]:
    """The capacity claims that cite one run directory's points, by point (a point measured in two run directories
    has one claim, citing both)."""
    rows = {p.row for s in decision.scenarios if Path(s.report.baseline.run) == run for p in s.points}
    return {c.outcome.point: c for c in decision.claims if c.kind == "capacity" and rows & set(c.rows)}


def test_where_capacity_binds_for_one_arm_the_server_measures_stand_beside_it(decided):
    """The preemption case: FP8 preempted 9 times in each run and NVFP4 not; its requests queued far longer. The
    claim carries both arms' preemptions, peak running requests, peak KV-cache usage and mean time queued, and the
    words give every run's (one run's measure is not the point's)."""
    fp8, nvfp4 = _points(PREEMPTION, "fp8")[0], _points(PREEMPTION, "nvfp4")[0]
    claim = _capacity_claims(decided, PREEMPTION)[fp8["point"]]
    v = claim.outcome
    assert v.baseline_capacity == "9 preemptions" and v.candidate_capacity is None
    assert list(v.preemptions) == [_counter(fp8, "vllm:num_preemptions_total"),
                                   _counter(nvfp4, "vllm:num_preemptions_total")] == [9, 0]
    peaks = [p["metrics"]["peaks"] for p in (fp8, nvfp4)]
    assert list(v.peak_running) == [p["vllm:num_requests_running"] for p in peaks] == [15, 16]
    assert list(v.peak_kv_usage) == [p["vllm:kv_cache_usage_perc"] for p in peaks]
    assert list(v.queue_ms) == pytest.approx([_queue_ms(fp8), _queue_ms(nvfp4)])
    runs = {arm: _points(PREEMPTION, arm) for arm in ("fp8", "nvfp4")}  # r1, r2

    def each(arm: str, measure) -> str:
        return " and ".join(measure(p) for p in runs[arm])

    measures = (("preemptions", lambda p: f"{_counter(p, 'vllm:num_preemptions_total'):,.0f}"),
                ("peak running requests", lambda p: f"{p['metrics']['peaks']['vllm:num_requests_running']:,.0f}"),
                ("peak KV-cache usage", lambda p: f"{100 * p['metrics']['peaks']['vllm:kv_cache_usage_perc']:.1f}%"),
                ("mean time queued", lambda p: f"{_queue_ms(p):.1f} ms"))
    words = claim_text(claim, decided)
    assert "fp8 is capacity-bound (9 preemptions) and nvfp4 is not" in words
    assert "; the server measured, fp8 against nvfp4: " + ", ".join(
        f"{name} {each('fp8', m)} against {each('nvfp4', m)}" for name, m in measures) + \
        " (each of its 2 runs, in order)" in words
    assert "preemptions 9 and 9 against 0 and 0" in words and "TTFT mean" in words


def test_where_capacity_binds_for_both_arms_the_decision_says_so(decided):
    """The sweep's last point: FP8's demand exceeds its pool and NVFP4 preempted once. The sweep points where FP8 alone
    is bound (concurrency 8 to 12) are capacity claims too, each with the server's measures: every point is pooled
    with the later session's (capacity-sweep-repeats, whose one complete run pair is fp8.r1 + nvfp4.r1), so each
    measure is given for the sweep's run, then that one."""
    fp8_points, nvfp4_points = _points(SWEEP, "fp8"), _points(SWEEP, "nvfp4")
    later = {arm: {p["point"]: p for p in _points(MATRIX_RUNS["sweep"], arm)
                   if p["bench_result"].startswith(f"{arm}.r1")} for arm in ("fp8", "nvfp4")}
    claims = _capacity_claims(decided, SWEEP)
    both = claims[fp8_points[-1]["point"]]
    assert both.outcome.baseline_capacity.startswith("30,464 KV tokens needed of 16,384")
    assert both.outcome.candidate_capacity == "1 preemption" and both.outcome.preemptions == (0, 1)
    words = claim_text(both, decided)
    assert "Where capacity binds for both arms" in words and "and so is nvfp4 (1 preemption)" in words
    last = fp8_points[-1]["point"]
    assert (f"mean time queued {_queue_ms(fp8_points[-1]):.1f} ms and {_queue_ms(later['fp8'][last]):.1f} ms against "
            f"{_queue_ms(nvfp4_points[-1]):.1f} ms and {_queue_ms(later['nvfp4'][last]):.1f} ms") in words
    fp8_only = [p["point"] for p in fp8_points[2:5]]
    for point in fp8_only:
        v = claims[point].outcome
        assert v.baseline_capacity and not v.candidate_capacity
        assert "and nvfp4 is not; the server measured, fp8 against nvfp4: preemptions 0 and 0 against 0 and 0" in \
            claim_text(claims[point], decided)
    assert set(claims) == {fp8_points[-1]["point"], *fp8_only}


def test_where_both_arms_are_bound_the_one_bound_less_wins_by_capacity(decided):
    """At concurrency 14 both sweeps' NVFP4 preempted once, so both arms are capacity-bound; but the server saw NVFP4
    run up to 13-14 requests at once against FP8's 7. Pooled over both sessions NVFP4's TTFT clears the band, and the
    win is credited to the capacity effect its TTFT budget measures (queue time carries it), not to a kernel."""
    last = _points(SWEEP, "fp8")[-1]["point"]
    points = [p for s in decided.scenarios for p in s.points if p.point == last]
    assert len(points) == 2 and all(p.pooled_with for p in points)
    for p in points:
        running = (p.serving.baseline.peak_running, p.serving.candidate.peak_running)
        assert p.baseline_capacity and p.candidate_capacity and running[1] > running[0] == 7
        assert p.estimate.high < 1 and p.winner == "candidate" and p.causes == (matrix.CAPACITY,)
    words = claim_text(_capacity_claims(decided, SWEEP)[last], decided)
    assert "nvfp4 wins, by a capacity effect, its requests queued less (queue time −" in words
    assert "peak running requests 7 and 7 against 14 and 13" in words and words.endswith("not kernel speed.")


def test_a_capacity_win_rests_on_queue_time_not_on_polled_peaks(tmp_path, recipes):
    """The same point with NVFP4's observed peak running set to FP8's (a constructed copy): both bound alike by the
    polls, yet the win stays a capacity effect, since the server's queue time (untouched) carries the TTFT
    difference in every run pair."""
    copies = []
    for run in (SWEEP, MATRIX_RUNS["sweep"]):
        copy = tmp_path / run.name
        shutil.copytree(run, copy)
        manifest = json.loads((copy / "manifest.json").read_text())
        for name, arm in manifest["arms"].items():
            if name.startswith("nvfp4") and arm["points"]:
                arm["points"][-1]["metrics"]["peaks"]["vllm:num_requests_running"] = 7
        (copy / "manifest.json").write_text(json.dumps(manifest))
        copies.append(copy)
    last = _points(SWEEP, "fp8")[-1]["point"]
    with deciding_on_any_run_pairs():
        points = [p for s in matrix.build(copies, recipes).scenarios for p in s.points if p.point == last]
    for run in (SWEEP, MATRIX_RUNS["sweep"]):
        fp8, nvfp4 = (next(p for p in _points(run, arm)[::-1] if p["point"] == last) for arm in ("fp8", "nvfp4"))
        assert _queue_ms(nvfp4) - _queue_ms(fp8) < -500  # the queue carries a TTFT difference of some −450 ms
    assert points and all(p.winner == "candidate" and p.causes == (matrix.CAPACITY,) for p in points)


# ---- the bench's wall time -----------------------------------------------------------------------------------

def test_the_report_states_the_benchs_wall_time(preemption):
    """Each arm's mean over its two runs of the bench's own `duration` (its result files), the ratio, and the
    run pairs' interval; in the terminal, the markdown and the JSON."""
    durations = {arm: [json.loads((PREEMPTION / f"{arm}.{r}.bench.json").read_text())["duration"]
                       for r in ("r1", "r2")] for arm in ("fp8", "nvfp4")}
    estimate = preemption.serving[0].estimates["duration_s"]
    assert estimate.baseline == pytest.approx(mean(durations["fp8"]))
    assert estimate.candidate == pytest.approx(mean(durations["nvfp4"]))
    assert estimate.ratio == pytest.approx(sum(durations["nvfp4"]) / sum(durations["fp8"]))
    assert estimate.method == serving_intervals.RUN_MEANS and estimate.low < estimate.ratio < estimate.high
    cell = (f"{mean(durations['fp8']):.1f} s | {mean(durations['nvfp4']):.1f} s | {estimate.ratio:.3f}× "
            f"[{estimate.low:.3f}, {estimate.high:.3f}], 2 runs")
    texts = _outputs(preemption)
    assert f"| wall time | {cell} |" in texts["markdown"]
    assert re.search(r"wall time\s*│\s*" + re.escape(f"{mean(durations['fp8']):.1f} s"), texts["table"])
    data = json.loads(texts["json"])["serving"][0]["estimates"]["duration_s"]
    assert data["baseline"] == pytest.approx(mean(durations["fp8"])) and data["runs"] == 2


def test_one_run_per_arm_gives_the_wall_time_no_interval(shared):
    """The sweep ran once per arm: its points' wall times are the bench's own, with no interval."""
    result = shared.report([SWEEP])
    for row, fp8, nvfp4 in zip(result.serving, _points(SWEEP, "fp8"), _points(SWEEP, "nvfp4")):
        estimate = row.estimates["duration_s"]
        assert estimate.baseline == pytest.approx(json.loads((SWEEP / fp8["bench_result"]).read_text())["duration"])
        assert estimate.candidate == pytest.approx(json.loads((SWEEP / nvfp4["bench_result"]).read_text())["duration"])
        assert estimate.low is None and estimate.method == serving_intervals.NO_INTERVAL
