"""Do the serving intervals keep their promise? Coverage by simulation on real per-request latencies, as
tests/test_intervals.py checks the kernel intervals on real call pairs; and what the serving rows read.

The population: the 32 requests of one real `vllm bench serve` point recorded in both arms
(fixtures/vllm033-h200 serve-sweep, input=1024 at concurrency 16: each request's end-to-end latency, which the
bench JSON keeps per request in request order). The candidate's latencies are rescaled so that, over the
population, both arms sum the same; a draw resamples the requests and scales the candidate by a known ratio r,
which is then the truth of every draw.
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from scipy import stats as sp

from conftest import VLLM033_RUNS
from kvtrace.analyzer import drift_band, serving
from kvtrace.analyzer.runs import ArmInput
from kvtrace.analyzer.stats import serving_intervals
from kvtrace.analyzer.stats.serving_intervals import ArmSamples, pool_serving, serving_estimate
from kvtrace.analyzer.stats.verdicts import Verdict
from kvtrace.errors import KvtraceError
from kvtrace.manifest import read_manifest

SWEEP = VLLM033_RUNS["serve-sweep"]
REPEATS = VLLM033_RUNS["offline-decode-heavy-repeats"]
DRAWS = 400


@pytest.fixture(scope="module")
def population() -> tuple[np.ndarray, np.ndarray]:
    base = np.array(json.loads((SWEEP / "fp8.p1.bench.json").read_text())["latencies"]) * 1000
    cand = np.array(json.loads((SWEEP / "nvfp4.p1.bench.json").read_text())["latencies"]) * 1000
    assert base.size == cand.size == 32
    return base, cand * base.sum() / cand.sum()


def test_paired_request_intervals_cover_a_known_ratio(population):
    """400 draws of 32 request pairs, r = 1.3: the 95% interval covers r in 93-97% of them (a correct interval
    leaves that range with probability about 4%; one covering 90% enters it with 0.1%)."""
    base, cand = population
    rng = np.random.default_rng(34)
    covered = 0
    for index in range(DRAWS):
        picked = rng.integers(0, base.size, base.size)
        estimate = serving_estimate([(ArmSamples.of_values(base[picked]), ArmSamples.of_values(1.3 * cand[picked]))],
                                    resamples=1000, seed=index)
        assert estimate.method == serving_intervals.PAIRED_REQUESTS and estimate.requests == base.size
        covered += estimate.low <= 1.3 <= estimate.high
    assert 0.93 <= covered / DRAWS <= 0.97


def test_moment_intervals_cover_a_known_ratio(population):
    """Each arm's mean, std and count alone (what the bench client's summary keeps): the same coverage, with the
    two arms' requests drawn independently since nothing pairs them."""
    base, cand = population
    rng = np.random.default_rng(35)
    covered = 0
    for _ in range(DRAWS):
        b, c = base[rng.integers(0, base.size, base.size)], 0.8 * cand[rng.integers(0, base.size, base.size)]
        estimate = serving_estimate([(ArmSamples(b.mean(), b.std(ddof=1), b.size),
                                      ArmSamples(c.mean(), c.std(ddof=1), c.size))])
        assert estimate.method == serving_intervals.MOMENTS
        covered += estimate.low <= 0.8 <= estimate.high
    assert 0.93 <= covered / DRAWS <= 0.97


@pytest.mark.parametrize("runs", [2, 3, 5])
def test_run_pair_intervals_cover_a_known_ratio_with_run_to_run_drift(population, runs):
    """--repeats: each run's mean of 32 resampled requests, each arm of each run moved by its own drift (10%
    log-normal, about what the vLLM 0.33 decode-heavy recordings of one point moved). The interval over run pairs
    covers r = 1.3 in 93-97% of draws, whether 2, 3 or 5 run pairs (a bootstrap over two run pairs covered 92%)."""
    base, cand = population
    rng = np.random.default_rng(runs)
    covered = 0
    for _ in range(DRAWS):
        pairs = []
        for _ in range(runs):
            drift = np.exp(rng.normal(0.0, 0.1, 2))
            picked = rng.integers(0, base.size, base.size)
            pairs.append((ArmSamples(float(drift[0] * base[picked].mean())),
                          ArmSamples(float(1.3 * drift[1] * cand[picked].mean()))))
        estimate = serving_estimate(pairs)
        assert estimate.method == serving_intervals.RUN_MEANS and estimate.band == 0.0
        assert len(estimate.run_ratios) == runs
        covered += estimate.low <= 1.3 <= estimate.high
    assert 0.93 <= covered / DRAWS <= 0.97


def test_one_run_pair_decides_nothing_however_narrow_its_interval(population):
    base, cand = population
    same = serving_estimate([(ArmSamples.of_values(base), ArmSamples.of_values(cand))])
    assert same.low <= 1 <= same.high and same.verdict == Verdict.TOO_FEW_RUNS
    # The band stays the assumed one, and says whether the interval clears it; a doubling is still not decided.
    slower = serving_estimate([(ArmSamples.of_values(base), ArmSamples.of_values(2 * cand))])
    assert slower.band == drift_band.ASSUMED_SERVING_BAND and slower.low > 1 + slower.band
    assert slower.verdict == Verdict.TOO_FEW_RUNS
    assert serving_intervals.too_few_runs(slower) == (
        "too few runs to decide (one run pair, 3 needed; its interval clears the ±25% assumed for one run per arm): "
        "record --repeats 3")
    inside = serving_estimate([(ArmSamples.of_values(base), ArmSamples.of_values(1.2 * cand))])
    assert "reaches into the ±25%" in serving_intervals.too_few_runs(inside)
    single = serving_estimate([(ArmSamples(100.0), ArmSamples(200.0))], higher_is_better=True)
    assert single.low is None and single.verdict == Verdict.TOO_FEW_RUNS


def test_two_run_pairs_decide_nothing_and_three_do():
    """Two recordings that agree within 1% give a narrow t interval on one degree of freedom: not a decision."""
    two = serving_estimate([(ArmSamples(100.0), ArmSamples(200.0)), (ArmSamples(101.0), ArmSamples(201.0))])
    assert two.low > 1.5 and two.band == 0.0 and two.verdict == Verdict.TOO_FEW_RUNS
    assert serving_intervals.too_few_runs(two) == "too few runs to decide (2 run pairs, 3 needed): record --repeats 3"
    three = [(ArmSamples(100.0), ArmSamples(200.0)), (ArmSamples(110.0), ArmSamples(215.0)),
             (ArmSamples(95.0), ArmSamples(196.0))]
    assert serving_estimate(three).verdict == Verdict.REGRESSION
    # Throughput: higher is better, so the same ratio is an improvement for the candidate.
    assert serving_estimate(three, higher_is_better=True).verdict == Verdict.IMPROVEMENT
    level = [(ArmSamples(100.0), ArmSamples(100.5)), (ArmSamples(110.0), ArmSamples(109.0)),
             (ArmSamples(95.0), ArmSamples(96.0))]
    assert serving_estimate(level).verdict == Verdict.NO_CHANGE


def test_pooled_points_count_their_pooled_run_pairs():
    one = serving_estimate([(ArmSamples(100.0), ArmSamples(200.0))])
    two = serving_estimate([(ArmSamples(104.0), ArmSamples(205.0)), (ArmSamples(98.0), ArmSamples(199.0))])
    assert pool_serving([one, one]).verdict == Verdict.TOO_FEW_RUNS
    pooled = pool_serving([one, two])
    assert pooled.runs == 3 and pooled.verdict == Verdict.REGRESSION


@pytest.mark.slow
@pytest.mark.parametrize("runs", [3, 5])
def test_run_pair_intervals_on_the_log_scale_cover_lognormal_run_means_with_drift(runs):
    """Run means drawn lognormal: each run pair shares a session's drift (σ 0.3 on the log scale) and each arm's run
    moves by its own (σ 0.2). The interval, recomputed here from the run means with scipy's t, covers the true
    ratio in 93–97% of 2,000 draws. With a spread as wide as a run's mean (σ 1) it still never reaches below zero,
    where r ± t·se on the linear scale does in some draws."""
    rng = np.random.default_rng(2026 + runs)
    truth, covered, linear_below_zero = 1.3, 0, 0
    for spread in (0.2, 1.0):
        for _ in range(2000):
            drift = rng.normal(0.0, 0.3, runs)
            base = 100 * np.exp(drift + rng.normal(0.0, spread, runs))
            cand = truth * 100 * np.exp(drift + rng.normal(0.0, spread, runs))
            estimate = serving_estimate([(ArmSamples(float(b)), ArmSamples(float(c))) for b, c in zip(base, cand)])
            r = cand.sum() / base.sum()
            residual = cand - r * base
            se = math.sqrt(runs / (runs - 1) * float(residual @ residual)) / base.sum()
            half = sp.t.ppf(0.975, runs - 1) * se
            assert (estimate.low, estimate.high) == pytest.approx((r * math.exp(-half / r), r * math.exp(half / r)))
            assert estimate.low > 0
            linear_below_zero += r - half < 0
            covered += spread == 0.2 and estimate.low <= truth <= estimate.high
    assert 0.93 <= covered / 2000 <= 0.97
    assert linear_below_zero > 0


def test_a_repeats_capture_is_estimated_over_every_run(shared):
    """The --repeats run of the decode-heavy point: its TTFT estimate is the mean over both runs of each arm
    (vLLM's histograms, read here from the manifest), not the first run's, and its run ratios are each run
    pair's."""
    result = shared.report([REPEATS])
    (row,) = result.serving
    manifest = json.loads((REPEATS / "manifest.json").read_text())
    means = {}
    for name, arm in manifest["arms"].items():
        histogram = arm["points"][0]["metrics"]["deltas"]["histograms"]["vllm:time_to_first_token_seconds"]
        means[name] = 1000 * histogram["sum"] / histogram["count"]
    estimate = row.estimates["ttft_ms"]
    assert row.runs == 2 and estimate.runs == 2 and estimate.method == serving_intervals.RUN_MEANS
    assert estimate.baseline == pytest.approx((means["fp8.r1"] + means["fp8.r2"]) / 2)
    assert estimate.candidate == pytest.approx((means["nvfp4.r1"] + means["nvfp4.r2"]) / 2)
    assert estimate.run_ratios == pytest.approx((means["nvfp4.r1"] / means["fp8.r1"],
                                                 means["nvfp4.r2"] / means["fp8.r2"]))
    assert estimate.low < min(estimate.run_ratios) and max(estimate.run_ratios) < estimate.high


def test_serve_points_pair_their_requests_end_to_end(shared):
    """The vLLM 0.33 serve sweep's bench files keep each request's end-to-end latency: E2E intervals pair request
    with request (same prompts, same order by the capture's hash); TTFT, of which only the summary is kept, gets
    the moments' interval."""
    result = shared.report([SWEEP])
    for row in result.serving:
        assert row.paired_requests
        e2e, ttft = row.estimates["e2el_ms"], row.estimates["ttft_ms"]
        assert e2e.method == serving_intervals.PAIRED_REQUESTS and e2e.requests == row.baseline.requests
        assert ttft.method == serving_intervals.MOMENTS and ttft.low < ttft.ratio < ttft.high
        detail = row.baseline.requests_detail
        assert detail.e2el_ms.size == row.baseline.requests and detail.ttft_ms is None


def test_detailed_bench_results_give_per_request_ttft_tpot_and_cached_share(tmp_path):
    """What `--save-detailed` adds (ttfts, output_lens, input_lens) is read per request, TPOT as the client
    computes it; lists of different lengths are no per-request data; a bench result outside the run directory is
    refused."""
    run = tmp_path / "run"
    run.mkdir()
    bench = json.loads((SWEEP / "fp8.p1.bench.json").read_text())
    n = len(bench["latencies"])
    bench.update(ttfts=[0.05 + 0.001 * i for i in range(n)], output_lens=[16] * n, input_lens=[1024] * n)
    (run / "p.bench.json").write_text(json.dumps(bench))
    record = {"point": "input=1024,output=16,prompts=32,concurrency=16", "bench_result": "p.bench.json",
              "cached_tokens_per_request": [512] * n}
    samples = serving.request_samples(record, run)
    assert samples.ttft_ms == pytest.approx([50 + i for i in range(n)])
    assert samples.tpot_ms == pytest.approx((np.array(bench["latencies"]) * 1000 - samples.ttft_ms) / 15)
    assert samples.cached_share == pytest.approx([0.5] * n)
    bench["ttfts"] = bench["ttfts"][:-1]
    (run / "p.bench.json").write_text(json.dumps(bench))
    broken = serving.request_samples(record, run)
    assert broken.ttft_ms is None and broken.e2el_ms is None and broken.cached_tokens is not None
    bench["ttfts"] = ["x"] * n
    (run / "p.bench.json").write_text(json.dumps(bench))
    assert serving.request_samples(record, run).ttft_ms is None
    for unreadable in ("p\x00.json", ".", "missing.json"):  # no file by that name, or not a file: the summary stands
        assert serving.request_samples({**record, "bench_result": unreadable}, run).ttft_ms is None
    shutil.copy2(run / "p.bench.json", tmp_path / "outside.bench.json")
    with pytest.raises(KvtraceError, match="leads outside the run directory"):
        serving.request_samples({**record, "bench_result": "../outside.bench.json"}, run)


def test_samples_pair_only_where_the_request_orders_match(tmp_path):
    """Per-request values pair only where both arms' request-order hashes for the point are equal: a copy of the
    serve sweep whose nvfp4 hash of the first point differs falls back to each arm's moments there."""
    data = json.loads((SWEEP / "manifest.json").read_text())
    data["arms"]["nvfp4"]["points"][0]["request_order_sha256"] = "0" * 64
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    for bench in SWEEP.glob("*.bench.json"):
        shutil.copy2(bench, tmp_path / bench.name)
    manifest = read_manifest(tmp_path)
    rows = serving.serving_rows(*(ArmInput.of(tmp_path, manifest, arm) for arm in ("fp8", "nvfp4")))
    assert [row.paired_requests for row in rows] == [False, True, True, True]
    assert rows[0].estimates["e2el_ms"].method == serving_intervals.MOMENTS
    assert rows[1].estimates["e2el_ms"].method == serving_intervals.PAIRED_REQUESTS
