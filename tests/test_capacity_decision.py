"""What `kvtrace matrix` and `kvtrace report` say over the vLLM 0.33 runs on the Llama-3.1-8B-shaped model: the
capacity matrix recorded on an NVIDIA H100 80GB HBM3 (fixtures/vllm033-h100-matrix, 3 run pairs per point) and the
older H200 preemption run with --repeats 2 (fixtures/vllm033-h200-8b): the capacity-bound region's decision lines,
the server's measures beside them, the bench's wall time, and no interval that is not a number.

Numbers are checked against what kvtrace did not compute: the run directories' manifests (/metrics counters and
histograms, peaks), the servers' startup logs, the bench result files, and a diff of the one run pair whose steps
matched.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import sqlite3
from pathlib import Path
from statistics import mean

import pytest
from rich.console import Console

from conftest import (MATRIX_RUNS, VLLM033_8B_RUNS, deciding_on_any_run_pairs, reading_stalled_timings,
                      sql_durations)
from kvtrace.analyzer import budget, claims as claims_lib, compare, matrix, report
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


@pytest.fixture(scope="module", autouse=True)
def _stalled_timings_read():
    """This machinery is tested on the shipped timings, stalls and all (conftest.reading_stalled_timings)."""
    with reading_stalled_timings():
        yield


@pytest.fixture(scope="module")
def recipes():
    return load_recipes()


@pytest.fixture(scope="module")
def preemption(shared):
    """As conftest's preemption_report, but built here, where stalled timings are read (shared keeps them apart)."""
    return shared.report([VLLM033_8B_RUNS["capacity-preemption"]])


@pytest.fixture(scope="module")
def decision(capacity_matrix):
    return capacity_matrix


@pytest.fixture(scope="module")
def h100(shared):
    """The decision over the whole H100 matrix: cold prefill, prefix reuse, preemption and the sweep."""
    return shared.matrix([MATRIX_RUNS[name] for name in sorted(MATRIX_RUNS)])


@pytest.fixture(scope="module")
def decided(recipes):
    """The same matrix as if one or two run pairs could decide (none can): the reasons a decided point gives."""
    with deciding_on_any_run_pairs():
        return matrix.build([VLLM033_8B_RUNS[name] for name in sorted(VLLM033_8B_RUNS)], recipes)


def _points(run, arm: str) -> list[dict]:
    """An arm's points as the capture recorded them (a --repeats arm's every run, in repeat order)."""
    return [point for points in _runs(run, arm) for point in points]


def _runs(run, arm: str) -> list[list[dict]]:
    """An arm's runs, in repeat order, each its points."""
    arms = json.loads((run / "manifest.json").read_text())["arms"]
    return [arms[name]["points"] for name in sorted(arms) if name.split(".")[0] == arm]


def _counter(point: dict, name: str) -> float:
    return point["metrics"]["deltas"]["counters"].get(name, 0)


def _queue_ms(point: dict) -> float:
    histogram = point["metrics"]["deltas"]["histograms"]["vllm:request_queue_time_seconds"]
    return 1000 * histogram["sum"] / histogram["count"]


def _decode_steps(diff, family: str):
    return next(r for r in diff.family_phases if r.segment == "decode_attention" and r.phase == "vLLM decode steps"
                and family in r.family)


def _sql_steps(export: Path) -> tuple[list[str], int]:
    """vLLM's engine steps in an export, in order, and its decode steps' decode attention calls, in plain SQL."""
    with sqlite3.connect(f"file:{export}?mode=ro", uri=True) as conn:
        steps = [name for (name,) in conn.execute("SELECT text FROM NVTX_EVENTS WHERE text LIKE 'execute_context_%' "
                                                  "ORDER BY start")]
    decode = sorted({name for name in steps if name.startswith("execute_context_0(0)_generation_")})
    return steps, sum(len(sql_durations(export, "%BatchPrefillWithPagedKVCacheKernel%MaskMode)0%", nvtx=name))
                      for name in decode)


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
    its calls in r2 alone. Its ratio is r2's own (a diff of r2 alone, which has an interval of r2's calls), and
    over both run pairs it has none: one run pair cannot show how runs vary."""
    steps = {name: _sql_steps(PREEMPTION / f"{name}.sqlite") for name in ("fp8.r1", "nvfp4.r1", "fp8.r2", "nvfp4.r2")}
    assert steps["fp8.r1"][0] != steps["nvfp4.r1"][0] and steps["fp8.r2"] == steps["nvfp4.r2"]
    calls = steps["fp8.r2"][1]
    assert any(f.message.startswith("r1: the arms scheduled different vLLM steps") for f in preemption.diff.findings)
    assert any(f.message.startswith(f"r2: both arms ran the same {len(steps['fp8.r2'][0])} vLLM steps")
               for f in preemption.diff.findings)
    row = _decode_steps(preemption.diff, "BatchPrefillWithPagedKVCacheKernel")
    assert calls and row.compared_calls == calls and row.run_ratios[0] is None
    assert row.ci_low is None and row.ci_high is None and row.no_interval == ONE_RUN_PAIR
    assert row.verdict == Verdict.DIFFERENT_WORK and row.paired_verdict == Verdict.INSUFFICIENT_DATA
    assert "calls paired in r2 only, of 2 run pairs" in row.note

    fp8, nvfp4 = open_traces([PREEMPTION / "fp8.r2.sqlite", PREEMPTION / "nvfp4.r2.sqlite"])
    alone = _decode_steps(compare.diff(fp8, nvfp4, recipes), "BatchPrefillWithPagedKVCacheKernel")
    assert alone.compared_calls == calls and alone.ratio == pytest.approx(row.ratio, rel=1e-12)
    assert alone.ratio == pytest.approx(row.run_ratios[1], rel=1e-12) and alone.ci_low < alone.ratio < alone.ci_high

    merge = _decode_steps(preemption.diff, "MergeStates")
    assert merge.no_interval == ONE_RUN_PAIR and merge.verdict == Verdict.INSUFFICIENT_DATA  # 0.893x: beyond ±2%


def test_a_row_paired_in_two_run_pairs_of_three_is_resampled_over_those(recipes):
    """The same runs with r2 again as a third run pair: the decode steps' rows paired in two of three run pairs get an
    interval over those two (finite, around the ratio), where the row's draws once included 0 / 0."""
    names = ("fp8.r1", "fp8.r2", "fp8.r2", "nvfp4.r1", "nvfp4.r2", "nvfp4.r2")
    traces = open_traces([PREEMPTION / f"{name}.sqlite" for name in names])
    diff = compare.diff(traces[:3], traces[3:], recipes)
    row = _decode_steps(diff, "BatchPrefillWithPagedKVCacheKernel")
    calls = _sql_steps(PREEMPTION / "fp8.r2.sqlite")[1]
    assert diff.runs == 3 and row.run_ratios[0] is None and row.compared_calls == 2 * calls
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

def _sweep_copy(tmp_path: Path, edit) -> Path:
    """A copy of the matrix's sweep with `edit(arm name, its points)` applied to each arm in its manifest."""
    copy = tmp_path / SWEEP.name
    shutil.copytree(SWEEP, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    for name, arm in manifest["arms"].items():
        edit(name, arm["points"])
    (copy / "manifest.json").chmod(0o644)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def _body(result) -> str:
    return " ".join(" ".join(row) for row in table(result, str)[1])


def test_one_preemption_is_singular(h100, tmp_path, recipes):
    """The sweep's last point: NVFP4 preempted in every run (its /metrics counter), once in some; the matrix gives each
    run's count in its own number. The same sweep with NVFP4's counter there set to 1 in every run (synthetic) gives
    the one count, in the singular."""
    last = [points[-1] for points in _runs(SWEEP, "nvfp4")]
    counts = [_counter(p, "vllm:num_preemptions_total") for p in last]
    assert all(counts) and 1 in counts
    point = next(p for s in h100.scenarios for p in s.points if s.name.startswith("sweep") and
                 p.point == last[0]["point"])
    each = [f"{n:g} {plural(n, 'preemption')}" for n in counts]
    expected = each[0] if len(set(counts)) == 1 else f"{', '.join(each[:-1])} and {each[-1]} in its {len(each)} runs"
    assert point.candidate_capacity == expected and "1 preemptions" not in _body(h100)

    def once(name, points):
        if name.startswith("nvfp4"):
            points[-1]["metrics"]["deltas"]["counters"]["vllm:num_preemptions_total"] = 1

    result = matrix.build([_sweep_copy(tmp_path, once)], recipes)
    assert result.points[-1].candidate_capacity == "1 preemption"
    body = _body(result)
    assert "nvfp4: 1 preemption" in body and "1 preemptions" not in body
    assert [plural(n, "preemption") for n in (0, 1, 9)] == ["preemptions", "preemption", "preemptions"]


def test_an_arm_bound_in_some_runs_only_is_not_counted_as_bound(tmp_path, recipes):
    """The sweep at concurrency 12, where NVFP4's demand fits its pool and it never preempted, with 3 preemptions
    given to its second run (synthetic): NVFP4 is then bound there in 1 of 3 runs, and one run's evidence is not the
    point's. The cell says so and NVFP4 is not counted as capacity-bound; yet, bound somewhere, its win stays a
    capacity effect only because it ran more requests at once than FP8 in every run pair."""
    twelve = 2  # the sweep's points in order: concurrency 4, 8, 12, 16
    assert all(_counter(run[twelve], "vllm:num_preemptions_total") == 0 for run in _runs(SWEEP, "nvfp4"))

    def preempted(name, points):
        if name == "nvfp4.r2":
            points[twelve]["metrics"]["deltas"]["counters"]["vllm:num_preemptions_total"] = 3

    result = matrix.build([_sweep_copy(tmp_path, preempted)], recipes)
    point = result.points[twelve]
    assert point.candidate_capacity is None and point.baseline_capacity
    assert point.capacity_notes == ["nvfp4: capacity-bound in 1 of 3 runs (not bound, 3 preemptions and not bound): "
                                    "not counted as capacity-bound"]
    assert "nvfp4: capacity-bound in 1 of 3 runs" in _body(result)
    running = [(b.peak_running, c.peak_running) for b, c in point.serving.run_pairs]
    assert all(c > b for b, c in running)
    assert point.winner == "candidate" and point.causes == (matrix.CAPACITY,)


# ---- residency where prefix caching happened ------------------------------------------------------------------

def test_residency_is_stated_only_where_prefix_caching_happened(h100):
    """A residency sentence wherever either arm served prompt tokens from its prefix cache (the server's per-request
    counts, from the relay's files), not where blocks were only evicted (KV-cache events): in the matrix every
    point's pool turned over, but only prefix reuse served prompt tokens from the cache, so only it has one, and
    there the shares differ. The counts are the first run's, as the claim states them."""
    used, differs = {}, {}
    for name, run in MATRIX_RUNS.items():
        first = {arm: _runs(run, arm)[0] for arm in ("fp8", "nvfp4")}
        for fp8, nvfp4 in zip(first["fp8"], first["nvfp4"], strict=True):
            cached = [sum(r["cached_tokens"] for r in json.loads((run / p["requests"]["file"]).read_text()))
                      for p in (fp8, nvfp4)]
            removed = [p["kv_events"]["BlockRemoved"] for p in (fp8, nvfp4)]
            used[fp8["point"]] = any(cached)
            differs[fp8["point"]] = cached[0] != cached[1]
            assert all(removed)  # every point's pool turned over: evictions alone say nothing of residency
    prefix = _runs(MATRIX_RUNS["prefix-reuse"], "fp8")[0][0]["point"]
    assert [point for point, u in used.items() if u] == [prefix] == [point for point, d in differs.items() if d]
    claims = [c for c in h100.claims if c.kind == "residency"]
    assert sorted(c.point for c in claims) == sorted(point for point, u in used.items() if u)
    for claim in claims:
        words = claim_text(claim, h100)
        assert words.startswith(f"Residency at {claim.point}")
        assert ("the same share" in words) == (not differs[claim.point])
        assert ("residency, a capacity effect, not a faster kernel" in words) == differs[claim.point]
    text = "\n".join(claim_text(c, h100) for c in h100.claims)
    assert text.count("Residency at") == sum(used.values())


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


def _kv_tokens(run: Path, arm: str) -> int:
    """The arm's KV pool in tokens, as its server logged it at startup."""
    (tokens,) = re.findall(r"GPU KV cache size: ([\d,]+) tokens", (run / f"{arm}.server.log").read_text())
    return int(tokens.replace(",", ""))


def _needed(point: dict) -> int:
    """The KV tokens a point's requests in flight need at their end: concurrency × (prompt + output), the bench's."""
    bench = json.loads((SWEEP / point["bench_result"]).read_text())
    return bench["max_concurrency"] * (bench["total_input_tokens"] + bench["total_output_tokens"]) // bench["completed"]


def test_where_capacity_binds_for_both_arms_the_decision_says_so(h100):
    """The sweep's last point: FP8's demand exceeds its pool and NVFP4 preempted in each run. The sweep points where
    FP8 alone is bound (concurrency 8 and 12) are capacity claims too, each with the server's measures of each of
    the 3 runs, in order."""
    fp8_runs, nvfp4_runs = _runs(SWEEP, "fp8"), _runs(SWEEP, "nvfp4")
    pool = _kv_tokens(SWEEP, "fp8")
    claims = _capacity_claims(h100, SWEEP)
    last = fp8_runs[0][-1]
    both = claims[last["point"]]
    assert both.outcome.baseline_capacity == f"{_needed(last):,} KV tokens needed of {pool:,} available"
    assert _needed(last) > pool and _needed(last) > _kv_tokens(SWEEP, "nvfp4")
    preempted = tuple(tuple(_counter(run[-1], "vllm:num_preemptions_total") for run in runs)
                      for runs in (fp8_runs, nvfp4_runs))
    assert both.outcome.server_runs.preemptions == preempted and not any(preempted[0]) and all(preempted[1])
    assert all(f"{n:g} {plural(n, 'preemption')}" in both.outcome.candidate_capacity for n in preempted[1])
    words = claim_text(both, h100)
    assert "Where capacity binds for both arms" in words
    assert f"and so is nvfp4 ({both.outcome.candidate_capacity})" in words
    queued = [" and ".join(f"{_queue_ms(run[-1]):,.1f} ms" for run in runs) for runs in (fp8_runs, nvfp4_runs)]
    assert f"mean time queued {queued[0]} against {queued[1]} (each of its 3 runs, in order)" in words
    fp8_only = [p["point"] for p in fp8_runs[0][1:3]]
    for index, point in enumerate(fp8_only, start=1):
        v = claims[point].outcome
        assert v.baseline_capacity == f"{_needed(fp8_runs[0][index]):,} KV tokens needed of {pool:,} available"
        assert not v.candidate_capacity and _needed(fp8_runs[0][index]) <= _kv_tokens(SWEEP, "nvfp4")
        assert "and nvfp4 is not; the server measured, fp8 against nvfp4: preemptions 0 and 0 and 0 against 0 and 0 " \
            "and 0" in claim_text(claims[point], h100)
    assert _needed(fp8_runs[0][0]) <= pool and set(claims) == {last["point"], *fp8_only}


def test_where_both_arms_are_bound_the_one_bound_less_wins_by_capacity(h100):
    """At concurrency 16 NVFP4 preempted, so both arms are capacity-bound; but the server saw NVFP4 run more
    requests at once than FP8 in every run. Three run pairs decide NVFP4's TTFT past the band, and the win is credited to
    the capacity effect its TTFT budget measures (queue time carries it: shorter in every run pair), not to a kernel."""
    last = _points(SWEEP, "fp8")[-1]["point"]
    (p,) = [p for s in h100.scenarios for p in s.points if s.name.startswith("sweep") and p.point == last]
    fp8, nvfp4 = ([run[-1] for run in _runs(SWEEP, arm)] for arm in ("fp8", "nvfp4"))
    assert all(_queue_ms(b) < _queue_ms(a) for a, b in zip(fp8, nvfp4, strict=True))
    running = [(a["metrics"]["peaks"]["vllm:num_requests_running"], b["metrics"]["peaks"]["vllm:num_requests_running"])
               for a, b in zip(fp8, nvfp4, strict=True)]
    assert p.baseline_capacity and p.candidate_capacity and all(c > b for b, c in running)
    assert p.estimate.runs == 3 and p.estimate.high < 1 and p.winner == "candidate" and p.causes == (matrix.CAPACITY,)
    assert p.reason.budget.carrier == "queue" and p.reason.budget.part("queue").high_ms < 0
    words = claim_text(_capacity_claims(h100, SWEEP)[last], h100)
    assert "nvfp4 wins, by a capacity effect, its requests queued less (queue time −" in words
    peaks = [" and ".join(f"{q['metrics']['peaks']['vllm:num_requests_running']:,.0f}" for q in arm)
             for arm in (fp8, nvfp4)]
    assert f"peak running requests {peaks[0]} against {peaks[1]}" in words and words.endswith("not kernel speed.")


def test_a_capacity_win_needs_the_winner_to_have_had_more_room(tmp_path, recipes):
    """The sweep with NVFP4's observed peak running set to FP8's of the same run at concurrency 12 and 16 (a
    constructed copy), queue times untouched. At 12 FP8 alone is bound (its demand past its pool, NVFP4's inside its own): the win stays
    a capacity effect, resting on the bound and the queue time, not on the polls. At 16 both are bound and the polls
    now show NVFP4 no roomier: its shorter queue may be shorter work ahead, so nothing measured there explains the
    win, and none is credited."""
    fp8_runs = _runs(SWEEP, "fp8")

    def as_fp8(name, points):
        if name.startswith("nvfp4"):
            fp8_points = fp8_runs[int(name.rsplit(".r", 1)[1]) - 1]
            for point, fp8 in zip(points[2:], fp8_points[2:], strict=True):
                point["metrics"]["peaks"]["vllm:num_requests_running"] = fp8["metrics"]["peaks"][
                    "vllm:num_requests_running"]

    result = matrix.build([_sweep_copy(tmp_path, as_fp8)], recipes)
    for runs in zip(*(_runs(SWEEP, arm) for arm in ("fp8", "nvfp4"))):
        for fp8, nvfp4 in zip(*(run[2:] for run in runs), strict=True):
            assert _queue_ms(nvfp4) < _queue_ms(fp8) / 2  # the queue carries the TTFT difference
    twelve, sixteen = result.points[2:]
    assert twelve.baseline_capacity and not twelve.candidate_capacity
    assert twelve.winner == "candidate" and twelve.causes == (matrix.CAPACITY,)
    assert sixteen.baseline_capacity and sixteen.candidate_capacity and sixteen.estimate.high < 1
    assert sixteen.reason.cause == budget.CAPACITY  # the budget's carrier is still the queue
    assert sixteen.winner == matrix.NOT_EXPLAINED and sixteen.apparent == "candidate" and sixteen.causes == ()


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


def test_one_run_per_arm_gives_the_wall_time_no_interval(recipes):
    """The sweep's first run pair named alone (RUNDIR/fp8.r1 and RUNDIR/nvfp4.r1): its points' wall times are the
    bench's own, with no interval; over all 3 run pairs each arm's mean of the bench's durations, with one."""
    result = report.build([SWEEP / "fp8.r1", SWEEP / "nvfp4.r1"], recipes)
    first = {arm: _runs(SWEEP, arm)[0] for arm in ("fp8", "nvfp4")}
    for row, fp8, nvfp4 in zip(result.serving, first["fp8"], first["nvfp4"], strict=True):
        estimate = row.estimates["duration_s"]
        assert estimate.baseline == pytest.approx(json.loads((SWEEP / fp8["bench_result"]).read_text())["duration"])
        assert estimate.candidate == pytest.approx(json.loads((SWEEP / nvfp4["bench_result"]).read_text())["duration"])
        assert estimate.low is None and estimate.method == serving_intervals.NO_INTERVAL
    whole = report.build([SWEEP], recipes)
    for index, row in enumerate(whole.serving):
        durations = {arm: [json.loads((SWEEP / run[index]["bench_result"]).read_text())["duration"]
                           for run in _runs(SWEEP, arm)] for arm in ("fp8", "nvfp4")}
        estimate = row.estimates["duration_s"]
        assert estimate.baseline == pytest.approx(mean(durations["fp8"]))
        assert estimate.candidate == pytest.approx(mean(durations["nvfp4"]))
        assert estimate.ratio == pytest.approx(sum(durations["nvfp4"]) / sum(durations["fp8"]))
        assert estimate.runs == 3 and estimate.method == serving_intervals.RUN_MEANS
        assert estimate.low < estimate.ratio < estimate.high
