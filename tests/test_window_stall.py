"""A profile window that closes inside a point's timed traffic: nsys holds the engine while it stops collecting, so
the point's timings measure the profiler. On the first H100 matrix (2026-12-06, windows of 24 to 48 engine steps
opened as each point's traffic began; its sweep and counterfactual kept in fixtures/vllm033-h100-counterfactual) only
cold prefill's whole traffic fit its window; kvtrace finds the others from the manifests alone, and their bench
timelines show the stall it infers. The shipped matrix (fixtures/vllm033-h100-matrix) closes every window in a traced
pass before the timed traffic, and nothing of it is found stalled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import COUNTERFACTUAL, MATRIX, MATRIX_RUNS, VLLM033_8B_RUNS, WINDOW_STALL
from kvtrace.analyzer import matrix, serving
from kvtrace.analyzer.classify import load_recipes
from kvtrace.manifest import read_manifest

STEPS = serving.ENGINE_STEPS
# The first matrix's run directories: its stalled sweep, and the counterfactual's (cold prefill's traffic fit its
# window; the sweep's first two points did not).
FIRST_MATRIX = {"sweep": COUNTERFACTUAL / "sweep", "counterfactual/cold-prefill": COUNTERFACTUAL / "counterfactual" /
                "cold-prefill", "counterfactual/sweep": COUNTERFACTUAL / "counterfactual" / "sweep"}
# Which of them, and of the shipped matrix's, a window stalled: the traffic outlasted the window opened at its start.
STALLED = {"sweep", "counterfactual/sweep"}
RUN_DIRS = {**FIRST_MATRIX, **{f"shipped/{name}": run for name, run in MATRIX_RUNS.items()}}
SHORT_REQUESTS = ("cold-prefill", "prefix-reuse", "sweep")  # whose timelines can show a stall (below)


def quiet_gap_s(bench: Path) -> float:
    """The longest interval inside a point's timed traffic in which no request started, got its first token or
    finished, from the bench client's own per-request times."""
    data = json.loads(bench.read_text())
    events = sorted(t for start, ttft, latency in zip(data["start_times"], data["ttfts"], data["latencies"])
                    for t in (start, start + ttft, start + latency))
    return max(b - a for a, b in zip(events, events[1:]))


@pytest.mark.parametrize("name", sorted(RUN_DIRS))
def test_the_windows_that_closed_inside_the_timed_traffic_are_found_from_the_manifest(name):
    """A window is found stalling a point exactly where vLLM counted more engine steps in the point's timed traffic
    than the window traced, and the traced pass keeps every shipped point clear of it."""
    recorded = read_manifest(RUN_DIRS[name])
    for run in recorded.runs.values():
        stalls = serving.window_stalls(run, recorded.settings.get("profile_steps"))
        windows = {w.point: w for w in run.windows}
        for record in run.points:
            steps = record["metrics"]["deltas"]["histograms"][STEPS]["count"]
            window = windows[record["index"]]
            inside = "traced_pass" not in record  # the window opened as the timed traffic began
            assert (record["point"] in stalls) == (inside and steps > window.steps), (run.name, record["point"])
            assert (record["point"] in stalls) == (name in STALLED)


@pytest.mark.parametrize("name", [n for n in sorted(RUN_DIRS) if n.split("/")[-1] in SHORT_REQUESTS])
def test_the_bench_timelines_show_the_stall_where_it_is_inferred(name):
    """Short requests (cold prefill's one token, prefix reuse's 16, the sweep's 128 at ~10 ms a step) leave no quiet
    second of their own; a window's close leaves 3 s or more. (Preemption's 512-token waves are quiet for 3 s
    anyway, so its timeline cannot tell.)"""
    recorded = read_manifest(RUN_DIRS[name])
    for run in recorded.runs.values():
        stalls = serving.window_stalls(run, recorded.settings.get("profile_steps"))
        for record in run.points:
            gap = quiet_gap_s(RUN_DIRS[name] / record["bench_result"])
            assert (gap > 2.5) == (record["point"] in stalls), (run.name, record["point"], gap)
            assert gap < 1.0 or gap > 3.0


def test_a_single_runs_window_stalls_only_the_point_it_closed_in():
    """vLLM 0.33's preemption run (--profile-steps 32, one window from its first point on): its one point took far
    more steps, so the window closed inside it."""
    run_dir = VLLM033_8B_RUNS["capacity-preemption"]
    recorded = read_manifest(run_dir)
    assert recorded.settings["profile_steps"] == 32
    for run in recorded.runs.values():
        stalls = serving.window_stalls(run, 32)
        assert list(stalls) == [run.points[0]["point"]]
        steps = run.points[0]["metrics"]["deltas"]["histograms"][STEPS]["count"]
        assert stalls[run.points[0]["point"]].endswith(f"closed after 32 of the traffic's {steps:,.0f} engine steps")


@pytest.mark.parametrize("run_dir", [FIRST_MATRIX["sweep"], MATRIX_RUNS["sweep"]], ids=["first", "shipped"])
def test_the_reports_ttft_statements_say_where_the_timings_hold_a_stall(run_dir):
    from kvtrace.analyzer import report, statements
    from kvtrace.analyzer.render.report_markdown import report_markdown

    stalled = run_dir == FIRST_MATRIX["sweep"]
    result = report.build([run_dir], load_recipes())
    ttft = [s for s in result.statements if isinstance(s, statements.TtftStatement)]
    assert len(ttft) == len(result.serving) == 4
    assert {s.reading == statements.WINDOW_STALL for s in ttft} == {stalled}
    head = report_markdown(result)[0].split("<details>")[0]
    assert head.count("not comparable (profile window stall)") == (4 if stalled else 0)


@pytest.mark.parametrize("root", [COUNTERFACTUAL, MATRIX], ids=["first", "shipped"])
def test_the_matrix_decides_only_the_points_whose_timings_hold_no_stall(root):
    result = matrix.build([root], load_recipes())
    stalled = root == COUNTERFACTUAL  # its root holds the stalled sweep alone
    assert len(result.points) == (4 if stalled else 7)
    for point in result.points:
        assert (point.excluded or "").startswith("not comparable: a profile window closed inside the timed "
                                                 "traffic of 6 of 6 runs") == stalled
        if stalled:
            assert point.winner is None and point.undecided == point.excluded and point.estimate is None
        else:
            assert point.excluded is None and point.estimate.runs == 3


# ---- the same matrix on 2026-12-07: windows in the timed traffic, then around a traced pass before it ---------------

SCENARIOS = ("cold-prefill", "prefix-reuse", "preemption", "sweep")


def recorded_points(recording: str, scenario: str):
    """(run, point record, its bench JSON) for every point the recording finished."""
    run_dir = WINDOW_STALL / recording / scenario
    recorded = read_manifest(run_dir)
    for run in recorded.runs.values():
        for record in run.points:
            if (run_dir / f"{run.name}.p{record['index']}.bench.json").is_file():
                yield recorded, run, record, run_dir / f"{run.name}.p{record['index']}.bench.json"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_eight_step_windows_in_the_timed_traffic_stall_every_point(scenario):
    """The first recording traced each point's first 8 steps: cold prefill's 11 steps outlast them too."""
    found = list(recorded_points("windows-in-traffic", scenario))
    assert len(found) == (24 if scenario == "sweep" else 6)
    for recorded, run, record, bench in found:
        assert "traced_pass" not in record and recorded.settings["profile_steps"] == 8
        assert record["point"] in serving.window_stalls(run, 8)
        if scenario in SHORT_REQUESTS:
            assert quiet_gap_s(bench) > 2.5, (run.name, record["point"])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_windows_closed_before_the_timed_traffic_leave_it_unstalled_and_shorter(scenario):
    """The second recording (rounds 1 and 2; its device time ran out in round 3) ran each window around a traced
    pass: no point is found stalled, no short-request timeline has a quiet second, and each point's timed traffic
    took over a second less than the same round's point with the window inside it (1.4 to 3.1 s less)."""
    stalled = {(run.name, record["point"]): json.loads(bench.read_text())["duration"]
               for _, run, record, bench in recorded_points("windows-in-traffic", scenario)}
    found = list(recorded_points("traced-pass", scenario))
    assert len(found) >= (12 if scenario == "sweep" else 4)
    for _, run, record, bench in found:
        assert record["traced_pass"]["requests"] > 0 and not serving.window_stalls(run, 8)
        if scenario in SHORT_REQUESTS:
            assert quiet_gap_s(bench) < 1.0, (run.name, record["point"])
        assert json.loads(bench.read_text())["duration"] < stalled[(run.name, record["point"])] - 1.0
