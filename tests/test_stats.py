"""Tests for kvtrace.analyzer.stats.

Expected values come from independent computations (Python's ``statistics`` module, normal theory for
the spread of a mean, the documented verdict rule) or from properties, never from earlier runs.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from statistics import NormalDist

import numpy as np
import pytest

from kvtrace.analyzer import stats


def lognormal_ns(seed: int, n: int, *, scale: float = 1.0, sigma: float = 0.3) -> np.ndarray:
    """Kernel-like durations around 20 us."""
    return scale * np.random.default_rng(seed).lognormal(np.log(20_000.0), sigma, n)


def normal_half_width(baseline: np.ndarray, candidate: np.ndarray, confidence: float) -> float:
    """Delta-method half-width of the interval for mean(candidate)/mean(baseline)."""
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    ratio = candidate.mean() / baseline.mean()
    rel_var = sum(
        arm.var(ddof=0) / arm.size / arm.mean() ** 2 for arm in (baseline, candidate)
    )
    return z * ratio * math.sqrt(rel_var)


# --- describe ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        [int(v) for v in np.random.default_rng(3).integers(5_000, 90_000, 57)],
        [float(v) for v in lognormal_ns(4, 1000)],
        [7, 3],
    ],
    ids=["int-ns", "float", "two-calls"],
)
def test_describe_matches_statistics_module(data):
    d = stats.describe(np.asarray(data))
    cuts = statistics.quantiles(data, n=100, method="inclusive")  # type 7 == numpy "linear"
    std = statistics.stdev(data)
    mean = statistics.fmean(data)
    assert d.count == len(data)
    assert d.total == pytest.approx(math.fsum(data), rel=1e-12)
    assert d.mean == pytest.approx(mean, rel=1e-12)
    assert d.median == pytest.approx(statistics.median(data), rel=1e-12)
    assert d.p90 == pytest.approx(cuts[89], rel=1e-12)
    assert d.p99 == pytest.approx(cuts[98], rel=1e-12)
    assert d.min == min(data)
    assert d.max == max(data)
    assert d.std == pytest.approx(std, rel=1e-9)
    assert d.cv == pytest.approx(std / mean, rel=1e-9)


def test_describe_single_call_has_zero_spread():
    d = stats.describe([1234])
    assert (d.count, d.std, d.cv) == (1, 0.0, 0.0)
    assert d.median == d.p90 == d.p99 == d.min == d.max == d.mean == d.total == 1234


def test_describe_cv_is_nan_for_zero_mean():
    assert math.isnan(stats.describe([0, 0, 0]).cv)


def test_describe_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.describe([1, 2]).mean = 0.0


@pytest.mark.parametrize("bad", [[], np.ones((2, 3))], ids=["empty", "2-D"])
def test_describe_rejects_empty_and_non_1d(bad):
    with pytest.raises(ValueError):
        stats.describe(bad)


# --- ratio_interval -----------------------------------------------------------------------------

# Distinct floats take the index-draw path; a few distinct integers take the multinomial-count path.
ARMS = {
    "float": (lognormal_ns(1, 300), lognormal_ns(2, 400, scale=1.1)),
    "tied-int": (
        np.random.default_rng(5).integers(10_000, 10_050, 3000),
        np.random.default_rng(6).integers(10_020, 10_060, 2000),
    ),
}


@pytest.mark.parametrize("arms", ARMS.values(), ids=ARMS.keys())
def test_ratio_is_ratio_of_means_and_inside_interval(arms):
    baseline, candidate = arms
    r = stats.ratio_interval(baseline, candidate, resamples=500)
    expected = statistics.fmean(candidate.tolist()) / statistics.fmean(baseline.tolist())
    assert r.ratio == pytest.approx(expected, rel=1e-12)
    assert r.low < r.ratio < r.high
    assert (r.confidence, r.resamples, r.method) == (0.95, 500, stats.BOOTSTRAP)


@pytest.mark.parametrize("arms", ARMS.values(), ids=ARMS.keys())
def test_bootstrap_is_deterministic_per_seed(arms):
    baseline, candidate = arms
    first = stats.ratio_interval(baseline, candidate, resamples=500, seed=7)
    again = stats.ratio_interval(baseline.copy(), candidate.copy(), resamples=500, seed=7)
    other = stats.ratio_interval(baseline, candidate, resamples=500, seed=8)
    assert (first.low, first.high) == (again.low, again.high)  # identical floats, not approx
    assert (first.low, first.high) != (other.low, other.high)


def test_higher_confidence_nests_the_interval():
    baseline, candidate = ARMS["float"]
    narrow = stats.ratio_interval(baseline, candidate, confidence=0.8)
    wide = stats.ratio_interval(baseline, candidate, confidence=0.99)
    assert wide.low < narrow.low < narrow.high < wide.high


@pytest.mark.parametrize("arms", ARMS.values(), ids=ARMS.keys())
def test_interval_width_matches_normal_theory(arms):
    baseline, candidate = arms
    r = stats.ratio_interval(baseline, candidate)
    expected = normal_half_width(baseline.astype(float), candidate.astype(float), 0.95)
    assert (r.high - r.low) / 2 == pytest.approx(expected, rel=0.15)


@pytest.mark.parametrize(
    "data",
    [lognormal_ns(9, 500), np.random.default_rng(10).integers(0, 20, 4000)],
    ids=["index-draws", "multinomial-counts"],
)
def test_resampled_means_have_bootstrap_moments(data, monkeypatch):
    # Seven rows per chunk and 2000 resamples: the last chunk is partial, so an unfilled or
    # misplaced row would show up as a wrong mean or spread.
    n = data.size
    distinct = np.unique(data).size
    monkeypatch.setattr(stats, "_CHUNK_ELEMENTS", 7 * (distinct if distinct * 16 <= n else n))
    means = stats._resample_means(data.astype(float), 2000, np.random.default_rng(0))
    sd = data.std(ddof=0) / math.sqrt(n)  # exact sd of a bootstrap mean
    assert means.shape == (2000,)
    assert abs(means.mean() - data.mean()) < 4 * sd / math.sqrt(2000)
    assert means.std(ddof=1) == pytest.approx(sd, rel=0.1)


def test_same_distribution_repeat_is_no_significant_change():
    r = stats.ratio_interval(lognormal_ns(1, 200), lognormal_ns(2, 200))
    assert r.low < 1 < r.high
    assert stats.verdict(r) == stats.NO_CHANGE


def test_same_distribution_repeats_are_calibrated():
    results = [
        stats.ratio_interval(lognormal_ns(2 * i, 200), lognormal_ns(2 * i + 1, 200), resamples=1000)
        for i in range(200)
    ]
    coverage = np.mean([r.low <= 1.0 <= r.high for r in results])
    assert 0.90 <= coverage <= 0.99
    assert np.mean([stats.verdict(r) == stats.NO_CHANGE for r in results]) >= 0.9


def test_slower_candidate_is_regression():
    r = stats.ratio_interval(lognormal_ns(1, 200), lognormal_ns(2, 200, scale=1.7))
    assert 1.0 < r.low < r.ratio < r.high
    assert stats.verdict(r) == stats.REGRESSION


def test_faster_candidate_is_improvement():
    r = stats.ratio_interval(lognormal_ns(1, 200), lognormal_ns(2, 200, scale=0.8))
    assert r.low < r.ratio < r.high < 1.0
    assert stats.verdict(r) == stats.IMPROVEMENT


def test_million_call_arms():
    # Realistic size and shape (integer ns, heavy ties). Runtime is reported, not asserted.
    baseline = np.rint(lognormal_ns(11, 1_000_000, sigma=0.1)).astype(np.int64)
    candidate = np.rint(lognormal_ns(12, 1_000_000, scale=1.01, sigma=0.1)).astype(np.int64)
    r = stats.ratio_interval(baseline, candidate)
    assert r.low < r.ratio < r.high
    expected = normal_half_width(baseline.astype(float), candidate.astype(float), 0.95)
    assert (r.high - r.low) / 2 == pytest.approx(expected, rel=0.1)


@pytest.mark.parametrize(
    "baseline,candidate",
    [([100.0], [90.0, 110.0]), ([90.0, 110.0], [100.0]), ([100.0], [250.0])],
    ids=["single-baseline", "single-candidate", "single-both"],
)
def test_single_call_has_no_interval(baseline, candidate):
    r = stats.ratio_interval(baseline, candidate)
    assert r.ratio == pytest.approx(np.mean(candidate) / np.mean(baseline))
    assert (r.low, r.high, r.resamples, r.method) == (None, None, 0, stats.SINGLE_CALL)


@pytest.mark.parametrize(
    "baseline,candidate",
    [([], [1.0, 2.0]), ([1.0, 2.0], []), ([0, 0, 0], [1, 2]), ([0], [5])],
    ids=["empty-baseline", "empty-candidate", "zero-baseline-mean", "zero-single-baseline"],
)
def test_ratio_interval_rejects_undefined_ratios(baseline, candidate):
    with pytest.raises(ValueError):
        stats.ratio_interval(baseline, candidate)


@pytest.mark.parametrize("kwargs", [{"confidence": 1.0}, {"confidence": 0.0}, {"resamples": 0}])
def test_ratio_interval_rejects_bad_parameters(kwargs):
    with pytest.raises(ValueError):
        stats.ratio_interval([1.0, 2.0], [1.0, 2.0], **kwargs)


# --- verdict ------------------------------------------------------------------------------------


def interval(ratio: float, low: float | None, high: float | None) -> stats.RatioInterval:
    method = stats.SINGLE_CALL if low is None else stats.BOOTSTRAP
    return stats.RatioInterval(ratio, low, high, 0.95, 0 if low is None else 2000, method)


@pytest.mark.parametrize(
    "ratio,low,high,threshold,expected",
    [
        (1.05, 1.03, 1.07, 0.02, stats.REGRESSION),
        (0.90, 0.85, 0.95, 0.02, stats.IMPROVEMENT),
        (1.01, 1.005, 1.015, 0.02, stats.NO_CHANGE),  # significant, inside the band
        (1.01, 1.005, 1.015, 0.0, stats.REGRESSION),  # same, with no band
        (0.99, 0.985, 0.995, 0.02, stats.NO_CHANGE),
        (1.10, 0.98, 1.22, 0.02, stats.NO_CHANGE),  # large but not significant
        (0.90, 0.78, 1.02, 0.02, stats.NO_CHANGE),
        (1.05, 1.00, 1.10, 0.02, stats.NO_CHANGE),  # touching 1 does not exclude it
        (1.01, None, None, 0.02, stats.NO_CHANGE),  # single call, inside the band
        (2.50, None, None, 0.02, stats.INSUFFICIENT_DATA),
        (0.50, None, None, 0.02, stats.INSUFFICIENT_DATA),
    ],
)
def test_verdict_rule(ratio, low, high, threshold, expected):
    assert stats.verdict(interval(ratio, low, high), threshold=threshold) == expected


def test_verdicts_are_distinct():
    names = {stats.REGRESSION, stats.IMPROVEMENT, stats.NO_CHANGE, stats.INSUFFICIENT_DATA}
    assert len(names) == 4


@pytest.mark.parametrize("threshold", [-0.01, 1.0])
def test_verdict_rejects_bad_threshold(threshold):
    with pytest.raises(ValueError):
        stats.verdict(interval(1.0, 0.9, 1.1), threshold=threshold)


# --- share and delta_attribution ----------------------------------------------------------------


def test_share():
    assert stats.share(3.0, 12.0) == 0.25
    assert stats.share(0.0, 5.0) == 0.0
    assert stats.share(1.0, 0.0) is None


def test_delta_attribution_mixed_signs_sums_to_one():
    deltas = {"attention": 30.0, "gemm": -10.0, "quantize": 5.0}
    fractions = stats.delta_attribution(deltas)
    total = sum(deltas.values())
    assert fractions == {k: pytest.approx(v / total) for k, v in deltas.items()}
    assert math.fsum(fractions.values()) == pytest.approx(1.0)
    assert fractions["attention"] > 1.0 and fractions["gemm"] < 0.0


@pytest.mark.parametrize(
    "deltas",
    [{"a": 5.0, "b": -5.0}, {"a": 1e16, "b": 1.0, "c": -1e16, "d": -1.0}],
    ids=["cancel", "cancel-beyond-float-summation"],
)
def test_delta_attribution_zero_net_change_is_none(deltas):
    assert stats.delta_attribution(deltas) == dict.fromkeys(deltas)


def test_delta_attribution_empty():
    assert stats.delta_attribution({}) == {}
