"""`kvtrace matrix` pools the run pairs of one point measured in several run directories when the measurements
agree. The sweep of the H100 capacity matrix (fixtures/vllm033-h100-matrix, recorded 2026-12-07: 3 interleaved run
pairs per point) is split here into two run directories as if recorded in two sessions (constructed copies: r1 and r2
in the first, r3 without concurrency 8 in the second). Whether the sessions agree at a point they share is recomputed
here from each run's own bench JSON (per-request TTFTs): each session's ratio and interval (scipy's t over two run
pairs, scipy's paired bootstrap over one run pair's requests), and docs/statistics.md's rule, each ratio inside the
other's interval. In this recording they agree at concurrency 4 and 16, each then decided once on all 3 run pairs as
the one capture decides it, where neither directory alone decides (2 run pairs, 1); at concurrency 12, r3's ratio
lies outside r1 and r2's interval, so that point is not decided. A point measured once is not pooled; two run pairs
pooled decide nothing; a synthetic disagreement is not decided."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sp

from conftest import MATRIX_RUNS, deciding_on_any_run_pairs
from kvtrace.analyzer import claims as claims_lib, drift_band, matrix
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.render import render_text
from kvtrace.analyzer.render import matrix as matrix_render
from kvtrace.analyzer.render.units import rows_text
from kvtrace.analyzer.stats import serving_intervals
from kvtrace.analyzer.stats.verdicts import Verdict
from kvtrace.manifest import Point

SWEEP = MATRIX_RUNS["sweep"]
SKIPPED = "input=2048,output=128,prompts=32,concurrency=8"  # the point the second session did not run
THRESHOLD = 0.02


def session(folder: Path, repeats: tuple[str, ...], skipped: tuple[str, ...] = ()) -> Path:
    """A copy of the matrix's sweep holding only the runs of `repeats`, without the points in `skipped`: what a
    capture of those runs and points alone would have written."""
    run = folder / SWEEP.name
    shutil.copytree(SWEEP, run)
    for path in run.iterdir():
        path.chmod(0o644)
    data = json.loads((run / "manifest.json").read_text())
    data["arms"] = {name: arm for name, arm in data["arms"].items() if name.rsplit(".", 1)[1] in repeats}
    for arm in data["arms"].values():
        arm["points"] = [p for p in arm["points"] if p["point"] not in skipped]
    settings = data["settings"]
    settings["order"] = [name for name in settings["order"] if name in data["arms"]]
    settings["points"] = [p for p in settings["points"] if p not in skipped]
    settings["repeats"] = len(repeats)
    (run / "manifest.json").write_text(json.dumps(data))
    return run


@pytest.fixture(scope="module")
def recipes():
    return load_recipes()


@pytest.fixture(scope="module")
def sessions(tmp_path_factory) -> tuple[Path, Path]:
    """The two sessions: r1 and r2 at every point; r3 at every point but concurrency 8."""
    return (session(tmp_path_factory.mktemp("first"), ("r1", "r2")),
            session(tmp_path_factory.mktemp("second"), ("r3",), (SKIPPED,)))


@pytest.fixture(scope="module")
def both(sessions, recipes):
    return matrix.build(list(sessions), recipes)


@pytest.fixture(scope="module")
def agreed(sessions) -> dict[str, bool]:
    """Per point both sessions measured, whether their measurements agree, recomputed from the bench JSON."""
    return agreement(*sessions)


def run_pair_ttfts(run: Path) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """Per point, each complete run pair's (fp8, nvfp4) per-request TTFTs in s, in request order, from the arms' own
    bench JSON: arms pair by their repeat suffix (fp8.r1 with nvfp4.r1); an arm whose partner recorded no point is
    left out."""
    arms = json.loads((run / "manifest.json").read_text())["arms"]
    found: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for label, arm in arms.items():
        if not label.startswith("fp8"):
            continue
        partner = arms.get("nvfp4" + label.removeprefix("fp8"))
        if not arm["points"] or not partner or not partner["points"]:
            continue
        theirs = {p["point"]: p for p in partner["points"]}
        for mine in arm["points"]:
            if mine["point"] in theirs:
                pair = tuple(np.asarray(json.loads((run / p["bench_result"]).read_text())["ttfts"], dtype=float)
                             for p in (mine, theirs[mine["point"]]))
                found.setdefault(mine["point"], []).append(pair)
    return found


def run_pair_means(run: Path) -> dict[str, list[tuple[float, float]]]:
    """Per point, each complete run pair's (fp8, nvfp4) mean TTFT in ms (run_pair_ttfts)."""
    return {spec: [(1000 * float(b.mean()), 1000 * float(c.mean())) for b, c in pairs]
            for spec, pairs in run_pair_ttfts(run).items()}


def measurement(run: Path, spec: str) -> tuple[float, float, float]:
    """A directory's TTFT ratio (nvfp4 / fp8) at a point and its 95% interval: over several run pairs, the t
    interval of their means (t_interval); over one, its request pairs resampled (scipy's paired percentile bootstrap;
    kvtrace's draws n − 1 of n, a difference far inside this data's margins)."""
    pairs = run_pair_ttfts(run)[spec]
    if len(pairs) > 1:
        return t_interval(run_pair_means(run)[spec])
    ((b, c),) = pairs
    found = sp.bootstrap((b, c), lambda x, y, axis=-1: y.mean(axis=axis) / x.mean(axis=axis), paired=True,
                         vectorized=True, n_resamples=9999, method="percentile", random_state=0).confidence_interval
    return float(c.mean() / b.mean()), float(found.low), float(found.high)


def agreement(first: Path, second: Path) -> dict[str, bool]:
    """Per point both directories measured, whether the measurements agree (docs/statistics.md): each ratio lies
    inside the other's interval."""
    agree = {}
    for spec in sorted(set(run_pair_ttfts(first)) & set(run_pair_ttfts(second))):
        (r1, low1, high1), (r2, low2, high2) = measurement(first, spec), measurement(second, spec)
        agree[spec] = low1 <= r2 <= high1 and low2 <= r1 <= high2
    return agree


def t_interval(pairs: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Σ nvfp4 / Σ fp8 over the run pairs' means and its 95% t interval, r · exp(± t_(n-1) · se / r), se the delta
    method's from the linearised run totals c_k − r · b_k (docs/statistics.md)."""
    b, c = np.array(pairs).T
    r = c.sum() / b.sum()
    residual = c - r * b
    n = len(pairs)
    se = math.sqrt(n / (n - 1) * float(residual @ residual)) / b.sum()
    half = sp.t.ppf(0.975, n - 1) * se / r
    return r, r * math.exp(-half), r * math.exp(half)


def by_point(result: matrix.Matrix) -> dict[str, list[matrix.MatrixPoint]]:
    found: dict[str, list[matrix.MatrixPoint]] = {}
    for p in result.points:
        found.setdefault(p.point, []).append(p)
    return found


def _expected_winner(ratio: float, low: float, high: float) -> str | None:
    """Who a TTFT ratio (nvfp4 / fp8) and its interval name: the interval excludes 1 (three run pairs put the drift
    inside it) and the ratio is beyond the threshold (docs/statistics.md, verdicts)."""
    return ("baseline" if low > 1 and ratio > 1 + THRESHOLD else
            "candidate" if high < 1 and ratio < 1 - THRESHOLD else None)


def test_each_shared_point_that_agrees_is_decided_on_both_sessions_run_pairs(both, sessions, agreed, shared):
    old, new = (run_pair_means(run) for run in sessions)
    common = sorted(set(old) & set(new))
    assert len(new) == len(common) == 3 and SKIPPED not in common and sorted(agreed) == common
    assert all(len(pairs) == 2 for pairs in old.values()) and all(len(pairs) == 1 for pairs in new.values())
    pooled = [spec for spec in common if agreed[spec]]
    assert pooled  # concurrency 4 and 16 in this recording: else nothing below is checked
    whole = {p.point: p for p in shared.matrix([SWEEP]).points}  # the one capture of all three run pairs
    points = by_point(both)
    for spec in pooled:
        first, second = sorted(points[spec], key=lambda p: p.row)
        assert first.pooled_with == (second.row,) and second.pooled_with == (first.row,)
        r, low, high = t_interval(old[spec] + new[spec])
        for p, runs in ((first, 2), (second, 1)):
            e = p.estimate
            assert (e.ratio, e.low, e.high) == pytest.approx((r, low, high), rel=1e-6)  # scipy's t against kvtrace's
            assert (e.runs, e.band, e.method) == (3, 0.0, serving_intervals.RUN_MEANS)
            assert p.ratio == e.ratio and p.pooled_directories == 2
            assert list(np.ravel(e.run_means)) == pytest.approx(list(np.ravel(old[spec] + new[spec])), rel=1e-9)
            # Pooled as the one capture pools them.
            w = whole[spec].estimate
            assert (e.ratio, e.low, e.high) == pytest.approx((w.ratio, w.low, w.high), rel=1e-12)
            own = p.serving.estimates["ttft_ms"]  # the row's own measurement is kept, unpooled, and decides nothing
            assert own.runs == runs and own.verdict == Verdict.TOO_FEW_RUNS
            if runs == 1:
                assert own.band == drift_band.ASSUMED_SERVING_BAND
            # Three run pairs pooled decide the point, each row with its own run's causes.
            assert _expected_winner(r, low, high) is not None
            assert p.winner == _expected_winner(r, low, high) and p.causes and p.undecided is None


def test_a_shared_point_the_sessions_measure_apart_is_not_decided(both, sessions, agreed):
    """Real data, no edit: at concurrency 12, r3's ratio (0.602×) lies outside r1 and r2's t interval over their two
    run pairs (0.566× [0.539, 0.595]), though all three were interleaved in one capture. By the rule (one ratio
    outside the other's interval) the two measurements disagree: neither row is pooled or decided, and the decision
    names both."""
    apart = [spec for spec, same in agreed.items() if not same]
    assert apart  # concurrency 12 in this recording
    (choice,) = [c for c in both.claims if c.kind == "choice"]
    rows = set()
    for spec in apart:
        first, second = sorted(by_point(both)[spec], key=lambda p: p.row)
        rows |= {first.row, second.row}
        for p, other in ((first, second), (second, first)):
            assert p.pooled_with == () and p.pooled_directories == 0 and p.disagrees_with == (other.row,)
            assert p.winner is None and p.causes == () and p.estimate is p.serving.estimates["ttft_ms"]
            assert p.undecided == (f"measured again at R{other.row} with another result: the measurements disagree, "
                                   "so this point is not decided")
        (claim,) = [c for c in both.claims if c.kind == "disagree" and c.point == spec]
        measured = {m.row: m for m in claim.measurements}
        assert claim.rows == (first.row, second.row) and set(measured) == set(claim.rows)
        mine = measured[first.row]  # the first session's two run pairs: scipy's t against kvtrace's
        assert (mine.ratio, mine.ci_low, mine.ci_high) == pytest.approx(measurement(sessions[0], spec), rel=1e-9)
        assert mine.runs == 2 and measured[second.row].runs == 1
        assert measured[second.row].ratio == pytest.approx(measurement(sessions[1], spec)[0], rel=1e-9)
    assert not any(c.kind in ("capacity", "point") and rows & set(c.rows) for c in both.claims)
    assert set(choice.disagree) == rows
    assert f"measurements disagree at {rows_text(choice.disagree)}" in render_text(both, "markdown")


def test_a_point_measured_once_is_not_pooled(both, sessions):
    old, new = (run_pair_means(run) for run in sessions)
    once = [spec for spec in old if spec not in new]
    assert once == [SKIPPED]
    for spec in once:
        (p,) = by_point(both)[spec]
        r, low, high = t_interval(old[spec])
        assert p.pooled_with == () and p.pooled_directories == 0 and p.estimate is p.serving.estimates["ttft_ms"]
        assert p.estimate.runs == 2 and (p.estimate.ratio, p.estimate.low, p.estimate.high) == pytest.approx(
            (r, low, high), rel=1e-9)
        assert p.winner is None and p.causes == ()
        assert p.undecided == "too few runs to decide (2 run pairs, 3 needed): record --repeats 3"


def test_no_pooled_point_of_two_run_pairs_is_decided_and_each_says_why(sessions, recipes, tmp_path):
    """r1 alone beside r3: two run pairs pooled decide nothing, however narrow their interval. Pooled are the points
    where the two runs' request-level intervals hold each other's ratio (every shared point, in this recording)."""
    first = session(tmp_path, ("r1",))
    agree = agreement(first, sessions[1])
    two = matrix.build([first, sessions[1]], recipes)
    (choice,) = [c for c in two.claims if c.kind == "choice"]
    pooled = sorted(p.row for p in two.points if p.pooled_with)
    assert len(pooled) == 2 * sum(agree.values()) > 0 and set(pooled) <= set(choice.undecided)
    assert all(p.estimate.runs == 2 and p.winner is None for p in two.points if p.pooled_with)
    sentence = matrix_render.claim_text(choice, two)
    assert f"not decided at {matrix_render.rows_text(choice.undecided)} (their cells say why)" in sentence
    header, body = matrix_render.table(two, str)
    for row in pooled:
        cell = dict(zip(header, body[row - 1]))["wins on TTFT"]
        assert cell == "too few runs to decide (2 run pairs, 3 needed): record --repeats 3"


def test_the_decision_states_each_pooled_point_once_naming_every_row(both):
    text = render_text(both, "markdown")
    head, _ = matrix_render.markdown_parts(both)
    assert len(text) <= matrix_render.ISSUE_CHARS
    assert "judged once on all their run pairs pooled" in matrix_render._lead(both)
    header, body = matrix_render.table(both, str)
    cells = {row[0]: dict(zip(header, row)) for row in body}
    stated = [c for c in both.claims if c.kind in ("capacity", "cold-prefill", "decode", "prefix", "point")]
    for spec, points in by_point(both).items():
        rows = tuple(sorted(p.row for p in points))
        citing = [c for c in stated if set(c.rows) & set(rows)]
        if all(p.winner is None for p in points):  # a point not decided is stated by its cell alone
            assert citing == [] and points[0].undecided in cells[f"R{rows[0]}"]["wins on TTFT"]
            continue
        assert len(citing) == 1 and citing[0].rows == rows  # one claim, every row of the point
        sentence = matrix_render.claim_text(citing[0], both)
        assert sentence in text and sentence not in head  # the first screen has the choice; each point's words follow
        e = points[0].estimate
        if len(rows) > 1:
            assert citing[0].outcome.pooled_rows == rows
            assert (f"{e.ratio:.3f}× [{e.low:.3f}, {e.high:.3f}] (nvfp4 / fp8, 3 run pairs pooled over "
                    f"{matrix_render.rows_text(rows)} (2 run directories))") in sentence
            for p in points:
                other = next(q.row for q in points if q is not p)
                assert cells[f"R{p.row}"]["TTFT ms"].endswith(
                    f"<br>all run pairs: {e.ratio:.3f}× [{e.low:.3f}, {e.high:.3f}], 3 runs, pooled with R{other} "
                    "(2 run directories)")
        else:
            assert "pooled" not in sentence and "pooled" not in cells[f"R{rows[0]}"]["TTFT ms"]
    data = json.loads(render_text(both, "json"))
    shown = [p for s in data["scenarios"] for p in s["points"]]
    for point, p in zip(both.points, shown, strict=True):
        assert p["pooled_with"] == list(point.pooled_with)
        assert p["pooled_directories"] == (2 if point.pooled_with else 0)
        assert p["estimate"]["runs"] == point.estimate.runs and p["ratio"] == pytest.approx(point.ratio)
        # The row's own measurement, as before: its directory's run pairs.
        assert p["serving"]["estimates"]["ttft_ms"]["runs"] == len(point.serving.run_pairs)


def test_pooling_refuses_estimates_of_different_metrics(both):
    p = next(p for p in both.points if p.pooled_with)
    ttft, throughput = p.serving.estimates["ttft_ms"], p.serving.estimates["output_tokens_per_s"]
    with pytest.raises(ValueError, match="different metrics"):
        serving_intervals.pool_serving([ttft, throughput])
    with pytest.raises(ValueError, match="two estimates"):
        serving_intervals.pool_serving([ttft])


def test_synthetic_disagreeing_measurements_are_not_pooled_nor_decided(recipes, sessions, agreed, tmp_path):
    """The second session's run with its nvfp4.r3 TTFTs at concurrency 4 doubled (synthetic): its ratio now lies
    outside the first session's interval, so the point is measured twice with disagreeing results. The other shared
    points keep the real data's outcome (agreed)."""
    run = tmp_path / sessions[1].name
    shutil.copytree(sessions[1], run)
    arms = json.loads((run / "manifest.json").read_text())["arms"]
    spec = "input=2048,output=128,prompts=32,concurrency=4"
    entry = next(p for p in arms["nvfp4.r3"]["points"] if p["point"] == spec)
    bench = json.loads((run / entry["bench_result"]).read_text())
    bench["ttfts"] = [2 * t for t in bench["ttfts"]]
    for key in [k for k in bench if k.endswith("_ttft_ms")]:
        bench[key] *= 2
    (run / entry["bench_result"]).write_text(json.dumps(bench))
    _, low, high = t_interval(run_pair_means(sessions[0])[spec])
    (pair,) = run_pair_means(run)[spec]
    assert not low <= pair[1] / pair[0] <= high
    result = matrix.build([sessions[0], run], recipes)
    first, second = sorted(by_point(result)[spec], key=lambda p: p.row)
    for p, other in ((first, second), (second, first)):
        assert p.pooled_with == () and p.disagrees_with == (other.row,)
        assert p.winner is None and p.estimate is p.serving.estimates["ttft_ms"]
    assert not any(c.kind in ("capacity", "point") and first.row in c.rows for c in result.claims)
    (choice,) = [c for c in result.claims if c.kind == "choice"]
    apart = sorted(p.row for p in result.points if p.disagrees_with)
    assert {first.row, second.row} <= set(choice.disagree) and sorted(choice.disagree) == apart
    assert f"measurements disagree at {rows_text(choice.disagree)}" in render_text(result, "markdown")
    # The other shared points as the real data has them: pooled where the sessions agree, apart where not.
    others = [same for other, same in agreed.items() if other != spec]
    assert any(others) and len(others) == len(run_pair_means(run)) - 1
    assert sum(1 for p in result.points if p.pooled_with) == 2 * sum(others)
    assert len(apart) == 2 * (1 + others.count(False))


def test_a_sweep_run_again_with_another_kv_cache_size_is_not_pooled(recipes, both, sessions, tmp_path):
    """The second session's manifest edited to say its server had twice the KV cache (synthetic): its points are
    other points, so none is pooled with the first session's, though the traffic and formats are the same."""
    run = tmp_path / sessions[1].name
    shutil.copytree(sessions[1], run)
    data = json.loads((run / "manifest.json").read_text())
    args = data["settings"]["extra_vllm_args"]
    args[args.index("--kv-cache-memory-bytes") + 1] = str(2 * int(args[args.index("--kv-cache-memory-bytes") + 1]))
    (run / "manifest.json").write_text(json.dumps(data))
    result = matrix.build([sessions[0], run], recipes)
    assert len(result.points) == len(both.points) and any(p.pooled_with for p in both.points)
    for p in result.points:
        assert p.pooled_with == () and p.disagrees_with == ()
        assert p.estimate is None or p.estimate is p.serving.estimates["ttft_ms"]


def test_synthetic_pooled_row_whose_own_run_credits_the_win_otherwise_is_named(recipes, sessions):
    """Causes stay each row's own: where one row of a pooled point credits its win to something else (here made so
    by hand), the one claim of the point says so for that row."""
    result = matrix.build(list(sessions), recipes)
    first, second = next(sorted(points, key=lambda p: p.row) for points in by_point(result).values()
                         if len(points) > 1 and points[0].winner == "baseline")
    second.causes = (matrix.CAPACITY,)
    (claim,) = [c for c in claims_lib.claims(result.scenarios, "ttft", THRESHOLD) if first.row in c.rows
                and c.kind in ("capacity", "point")]
    assert claim.rows == (first.row, second.row)
    assert [row for row, _ in claim.outcome.differing] == [second.row]
    text = matrix_render.claim_text(claim, result)
    assert f"; on R{second.row}'s own run, fp8 wins, by a capacity effect" in text


def test_a_pooled_claim_gives_every_pooled_runs_server_measures(both, sessions, agreed, recipes):
    """A pooled capacity claim's server measures are each pooled row's runs, row by row, as each directory alone
    gives them, and its words list them all (not the lowest row's run only). Pooled capacity claims stand at the
    shared points where the sessions agree and the traffic needs more KV tokens than fp8's pool holds (the startup
    log's count in the manifest): concurrency 16 here; 12 needs more too, but its sessions disagree."""
    with deciding_on_any_run_pairs():
        alone = [matrix.build([run], recipes) for run in sessions]

    def own(result, point):
        claim = next(c for c in result.claims if c.kind == "capacity" and c.outcome.point == point)
        return claim.outcome.server_runs

    pooled = [c for c in both.claims if c.kind == "capacity" and c.outcome.pooled_rows]
    arms = json.loads((SWEEP / "manifest.json").read_text())["arms"]
    (fp8_tokens,) = {arm["kv_cache"]["tokens"] for label, arm in arms.items() if label.startswith("fp8.")}
    expected = {spec for spec, same in agreed.items() if same and Point.parse(spec).kv_tokens() > fp8_tokens}
    assert expected and {c.outcome.point for c in pooled} == expected
    for claim in pooled:
        point, runs = claim.outcome.point, claim.outcome.server_runs
        parts = [own(result, point) for result in alone]
        for key in claims_lib.SERVER_MEASURES:
            assert getattr(runs, key) == tuple(getattr(parts[0], key)[side] + getattr(parts[1], key)[side]
                                               for side in (0, 1)), (point, key)
            assert all(len(values) == 3 for values in getattr(runs, key))  # r1 and r2, then r3
        first, second = claim.outcome.pooled_rows
        assert claim.outcome.server_rows == (first, first, second)  # each run's row: r1 and r2, then r3
        sentence = matrix_render.claim_text(claim, both)
        assert (f"(each of the 3 runs of {matrix_render.rows_text(claim.outcome.pooled_rows)}, row by row in repeat "
                "order)") in sentence
        queued = [_queue_ms(SWEEP, f"fp8.{repeat}", point) for repeat in ("r1", "r2", "r3")]  # the /metrics histogram
        assert list(runs.queue_ms[0]) == pytest.approx(queued)
        assert f"mean time queued {' and '.join(f'{q:,.1f} ms' for q in queued)} against" in sentence


def _queue_ms(run: Path, arm: str, point: str) -> float:
    """An arm's mean time queued at a point: the server's histogram of it, across the traffic."""
    points = json.loads((run / "manifest.json").read_text())["arms"][arm]["points"]
    (entry,) = [p for p in points if p["point"] == point]
    histogram = entry["metrics"]["deltas"]["histograms"]["vllm:request_queue_time_seconds"]
    return 1000 * histogram["sum"] / histogram["count"]
