"""`kvtrace matrix` pools the run pairs of one point measured in several run directories when the measurements
agree: on the 8B-shaped H200 sweep recorded in two sessions (capacity-sweep, one run per arm; capacity-sweep-repeats,
whose one complete run pair is fp8.r1 + nvfp4.r1), each shared point's TTFT is decided once on both run pairs. The
pooled ratio and interval are recomputed here from each run's own bench JSON (per-request TTFTs) with scipy's t;
the verdicts from those intervals; a point measured once is not pooled; a synthetic disagreement is not decided."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sp

from conftest import MATRIX_RUNS, VLLM033_8B_RUNS, deciding_on_any_run_pairs
from kvtrace.analyzer import claims as claims_lib, drift_band, matrix
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.render import render_text
from kvtrace.analyzer.render import matrix as matrix_render
from kvtrace.analyzer.stats import serving_intervals

SWEEP = MATRIX_RUNS["sweep"]
REPEATS = MATRIX_RUNS["sweep"]
THRESHOLD = 0.02


@pytest.fixture(scope="module")
def recipes():
    return load_recipes()


@pytest.fixture(scope="module")
def both(recipes):
    return matrix.build([SWEEP, REPEATS], recipes)


@pytest.fixture(scope="module")
def decided(recipes):
    """The two sessions as if two run pairs could decide: what a decided pooled point says and cites."""
    with deciding_on_any_run_pairs():
        return matrix.build([SWEEP, REPEATS], recipes)


def run_pair_means(run: Path) -> dict[str, list[tuple[float, float]]]:
    """Per point, each complete run pair's (fp8, nvfp4) mean TTFT in ms, from the arms' own bench JSON: arms pair
    by their repeat suffix (fp8.r1 with nvfp4.r1); an arm whose partner recorded no point is left out."""
    arms = json.loads((run / "manifest.json").read_text())["arms"]
    means: dict[str, list[tuple[float, float]]] = {}
    for label, arm in arms.items():
        if not label.startswith("fp8"):
            continue
        partner = arms.get("nvfp4" + label.removeprefix("fp8"))
        if not arm["points"] or not partner or not partner["points"]:
            continue
        theirs = {p["point"]: p for p in partner["points"]}
        for mine in arm["points"]:
            if mine["point"] in theirs:
                pair = tuple(1000 * float(np.mean(json.loads((run / p["bench_result"]).read_text())["ttfts"]))
                             for p in (mine, theirs[mine["point"]]))
                means.setdefault(mine["point"], []).append(pair)
    return means


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


def test_each_shared_point_is_decided_on_both_sessions_run_pairs(both):
    old, new = run_pair_means(SWEEP), run_pair_means(REPEATS)
    shared = sorted(set(old) & set(new))
    assert len(new) == len(shared) >= 2 and all(len(pairs) == 1 for pairs in (*old.values(), *new.values()))
    points = by_point(both)
    for spec in shared:
        first, second = sorted(points[spec], key=lambda p: p.row)
        assert first.pooled_with == (second.row,) and second.pooled_with == (first.row,)
        r, low, high = t_interval(old[spec] + new[spec])
        for p in (first, second):
            e = p.estimate
            assert (e.ratio, e.low, e.high) == pytest.approx((r, low, high), rel=1e-9)
            assert (e.runs, e.band, e.method) == (2, 0.0, serving_intervals.RUN_MEANS)
            assert p.ratio == e.ratio
            assert list(np.ravel(e.run_means)) == pytest.approx(list(np.ravel(old[spec] + new[spec])), rel=1e-9)
            own = p.serving.estimates["ttft_ms"]  # the row's own measurement is kept, unpooled
            assert own.runs == 1 and own.band == drift_band.ASSUMED_SERVING_BAND
            # Two run pairs pooled decide nothing, however narrow the pooled interval (concurrency 14's excludes 1).
            assert p.winner is None and p.causes == ()
            assert p.undecided == "too few runs to decide (2 run pairs, 3 needed): record --repeats 3"


def test_a_point_measured_once_is_not_pooled(both):
    old, new = run_pair_means(SWEEP), run_pair_means(REPEATS)
    once = [spec for spec in old if spec not in new]
    assert once  # concurrency 6: the later session's sweep skipped it
    for spec in once:
        (p,) = by_point(both)[spec]
        assert p.pooled_with == () and p.estimate is p.serving.estimates["ttft_ms"]
        assert p.estimate.runs == 1 and p.estimate.band == drift_band.ASSUMED_SERVING_BAND
        assert p.estimate.ratio == pytest.approx(old[spec][0][1] / old[spec][0][0], rel=1e-9)


def test_no_pooled_point_of_two_run_pairs_is_decided_and_each_says_why(both):
    (choice,) = [c for c in both.claims if c.kind == "choice"]
    pooled = sorted(p.row for p in both.points if p.pooled_with)
    assert pooled and set(pooled) <= set(choice.undecided)
    sentence = matrix_render.claim_text(choice, both)
    assert f"not decided at {matrix_render.rows_text(choice.undecided)} (their cells say why)" in sentence
    header, body = matrix_render.table(both, str)
    for row in pooled:
        cell = dict(zip(header, body[row - 1]))["wins on TTFT"]
        assert cell == "too few runs to decide (2 run pairs, 3 needed): record --repeats 3"


def test_the_decision_states_each_pooled_point_once_naming_every_row(decided):
    both = decided
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
        assert len(citing) == 1 and citing[0].rows == rows  # one claim, every row of the point
        sentence = matrix_render.claim_text(citing[0], both)
        assert sentence in text and sentence not in head  # the first screen has the choice; each point's words follow
        e = points[0].estimate
        if len(rows) > 1:
            assert citing[0].outcome.pooled_rows == rows
            assert (f"{e.ratio:.3f}× [{e.low:.3f}, {e.high:.3f}] (nvfp4 / fp8, 2 run pairs pooled over "
                    f"{matrix_render.rows_text(rows)} (2 run directories))") in sentence
            for p in points:
                other = next(q.row for q in points if q is not p)
                assert cells[f"R{p.row}"]["TTFT ms"].endswith(
                    f"<br>all run pairs: {e.ratio:.3f}× [{e.low:.3f}, {e.high:.3f}], 2 runs, pooled with R{other} "
                    "(2 run directories)")
        else:
            assert "pooled" not in sentence and "pooled" not in cells[f"R{rows[0]}"]["TTFT ms"]
    data = json.loads(render_text(both, "json"))
    shown = [p for s in data["scenarios"] for p in s["points"]]
    for point, p in zip(both.points, shown):
        assert p["pooled_with"] == list(point.pooled_with)
        assert p["pooled_directories"] == (2 if point.pooled_with else 0)
        assert p["estimate"]["runs"] == point.estimate.runs and p["ratio"] == pytest.approx(point.ratio)
        assert p["serving"]["estimates"]["ttft_ms"]["runs"] == 1  # the row's own measurement, as before


def test_pooling_refuses_estimates_of_different_metrics(both):
    p = next(p for p in both.points if p.pooled_with)
    ttft, throughput = p.serving.estimates["ttft_ms"], p.serving.estimates["output_tokens_per_s"]
    with pytest.raises(ValueError, match="different metrics"):
        serving_intervals.pool_serving([ttft, throughput])
    with pytest.raises(ValueError, match="two estimates"):
        serving_intervals.pool_serving([ttft])


def test_synthetic_disagreeing_measurements_are_not_pooled_nor_decided(recipes, tmp_path):
    """The later session's run with its nvfp4.r1 TTFTs at concurrency 12 doubled (synthetic): its ratio now lies
    outside the first session's interval, so the point is measured twice with disagreeing results."""
    run = tmp_path / REPEATS.name
    shutil.copytree(REPEATS, run)
    for path in run.iterdir():
        path.chmod(0o644)
    arms = json.loads((run / "manifest.json").read_text())["arms"]
    spec = "input=2048,output=128,prompts=24,concurrency=12"
    entry = next(p for p in arms["nvfp4.r1"]["points"] if p["point"] == spec)
    bench = json.loads((run / entry["bench_result"]).read_text())
    bench["ttfts"] = [2 * t for t in bench["ttfts"]]
    for key in [k for k in bench if k.endswith("_ttft_ms")]:
        bench[key] *= 2
    (run / entry["bench_result"]).write_text(json.dumps(bench))
    result = matrix.build([SWEEP, run], recipes)
    first, second = sorted(by_point(result)[spec], key=lambda p: p.row)
    own = [p.serving.estimates["ttft_ms"] for p in (first, second)]
    assert not own[0].low <= own[1].ratio <= own[0].high
    for p, other in ((first, second), (second, first)):
        assert p.pooled_with == () and p.disagrees_with == (other.row,)
        assert p.winner is None and p.estimate is p.serving.estimates["ttft_ms"]
    assert not any(c.kind in ("capacity", "point") and first.row in c.rows for c in result.claims)
    text = render_text(result, "markdown")
    assert f"measurements disagree at R{first.row}, R{second.row}" in text
    # The other shared points still agree and are pooled.
    assert sum(1 for p in result.points if p.pooled_with) == 2 * (len(run_pair_means(run)) - 1)


def test_a_sweep_run_again_with_another_kv_cache_size_is_not_pooled(recipes, both, tmp_path):
    """The later session's manifest edited to say its server had twice the KV cache (synthetic): its points are
    other points, so none is pooled with the first session's, though the traffic and formats are the same."""
    run = tmp_path / REPEATS.name
    shutil.copytree(REPEATS, run)
    for path in run.iterdir():
        path.chmod(0o644)
    data = json.loads((run / "manifest.json").read_text())
    args = data["settings"]["extra_vllm_args"]
    args[args.index("--kv-cache-memory-bytes") + 1] = str(2 * int(args[args.index("--kv-cache-memory-bytes") + 1]))
    (run / "manifest.json").write_text(json.dumps(data))
    result = matrix.build([SWEEP, run], recipes)
    assert len(result.points) == len(both.points) and any(p.pooled_with for p in both.points)
    for p in result.points:
        assert p.pooled_with == () and p.disagrees_with == ()
        assert p.estimate is None or p.estimate is p.serving.estimates["ttft_ms"]


def test_synthetic_pooled_row_whose_own_run_credits_the_win_otherwise_is_named(recipes):
    """Causes stay each row's own: where one row of a pooled point credits its win to something else (here made so
    by hand), the one claim of the point says so for that row."""
    with deciding_on_any_run_pairs():
        result = matrix.build([SWEEP, REPEATS], recipes)
    first, second = next(sorted(points, key=lambda p: p.row) for points in by_point(result).values()
                         if len(points) > 1 and points[0].winner == "baseline")
    second.causes = (matrix.CAPACITY,)
    (claim,) = [c for c in claims_lib.claims(result.scenarios, "ttft", THRESHOLD) if first.row in c.rows
                and c.kind in ("capacity", "point")]
    assert claim.rows == (first.row, second.row)
    assert [row for row, _ in claim.outcome.differing] == [second.row]
    text = matrix_render.claim_text(claim, result)
    assert f"; on R{second.row}'s own run, fp8 wins, by a capacity effect" in text


def test_a_pooled_claim_gives_every_pooled_runs_server_measures(decided, recipes):
    """A pooled capacity claim's server measures are each pooled row's runs, row by row, as each directory alone
    gives them, and its words list them all (not the lowest row's run only)."""
    both = decided
    with deciding_on_any_run_pairs():
        alone = [matrix.build([run], recipes) for run in (SWEEP, REPEATS)]

    def own(result, point):
        claim = next(c for c in result.claims if c.kind == "capacity" and c.outcome.point == point)
        return claim.outcome.server_runs

    pooled = [c for c in both.claims if c.kind == "capacity" and c.outcome.pooled_rows]
    assert {c.outcome.point for c in pooled} >= {"input=2048,output=128,prompts=28,concurrency=14"}
    for claim in pooled:
        point, runs = claim.outcome.point, claim.outcome.server_runs
        parts = [own(result, point) for result in alone]
        for key in claims_lib.SERVER_MEASURES:
            assert getattr(runs, key) == tuple(getattr(parts[0], key)[side] + getattr(parts[1], key)[side]
                                               for side in (0, 1)), (point, key)
        assert claim.outcome.server_rows == claim.outcome.pooled_rows  # one complete run pair per directory
        sentence = matrix_render.claim_text(claim, both)
        assert (f"(each of the 2 runs of {matrix_render.rows_text(claim.outcome.pooled_rows)}, row by row in repeat "
                "order)") in sentence
        queued = runs.queue_ms[0]
        assert f"mean time queued {queued[0]:.1f} ms and {queued[1]:.1f} ms against" in sentence
