"""Tests for kvtrace.analyzer.stats.

Expected values come from independent computations (Python's ``statistics`` module, normal theory for
the spread of a mean, the documented verdict rule) or from properties, never from earlier runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics

import numpy as np
import pytest

from kvtrace.analyzer import drift_band
from kvtrace.analyzer.stats import arm_summary, bootstrap, distributions, shares, verdicts
from kvtrace.analyzer.stats.verdicts import Verdict


def lognormal_ns(seed: int, n: int, *, scale: float = 1.0, sigma: float = 0.3) -> np.ndarray:
    """Kernel-like durations around 20 us."""
    return scale * np.random.default_rng(seed).lognormal(np.log(20_000.0), sigma, n)


def paired_half_width(strata: list[tuple[np.ndarray, np.ndarray]], confidence: float) -> float:
    """Delta-method half-width for Σ candidate / Σ baseline over paired strata: each stratum adds
    n·var(c - R·b) (ddof=1) to the variance of the linearised total, and the quantile is Student's t with the
    Welch-Satterthwaite df of those parts (scipy-free: statistics.NormalDist only for df=inf)."""
    base = sum(b.sum() for b, _ in strata)
    ratio = sum(c.sum() for _, c in strata) / base
    parts = [(b.size * np.var(c - ratio * b, ddof=1), b.size - 1) for b, c in strata]
    variance = sum(v for v, _ in parts)
    df = variance ** 2 / sum(v * v / d for v, d in parts)
    return t_quantile(0.5 + confidence / 2, df) * math.sqrt(variance) / base


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile by bisection on the CDF, integrated with statistics-free Simpson sums over the
    density (an independent check of stats' own quantile)."""
    def cdf(x: float) -> float:
        grid = np.linspace(0.0, x, 20001)
        density = np.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi) * (
            1 + grid * grid / df) ** (-(df + 1) / 2)
        h = grid[1] - grid[0]
        return 0.5 + h / 3 * (density[0] + density[-1] + 4 * density[1:-1:2].sum() + 2 * density[2:-1:2].sum())

    low, high = 0.0, 100.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < p else (low, middle)
    return (low + high) / 2


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
    d = arm_summary.describe(np.asarray(data))
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
    d = arm_summary.describe([1234])
    assert (d.count, d.std, d.cv) == (1, 0.0, 0.0)
    assert d.median == d.p90 == d.p99 == d.min == d.max == d.mean == d.total == 1234


def test_describe_cv_is_nan_for_zero_mean():
    assert math.isnan(arm_summary.describe([0, 0, 0]).cv)


def test_describe_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        arm_summary.describe([1, 2]).mean = 0.0


@pytest.mark.parametrize("bad", [[], np.ones((2, 3))], ids=["empty", "2-D"])
def test_describe_rejects_empty_and_non_1d(bad):
    with pytest.raises(ValueError):
        arm_summary.describe(bad)


# --- estimate_rows: paired, stratified ratios -----------------------------------------------------------


def strata_of(pairs: list[tuple[np.ndarray, np.ndarray]], runs: list[int] | None = None, count: int = 1
              ) -> bootstrap.PairedStrata:
    sizes = [b.size for b, _ in pairs]
    return bootstrap.PairedStrata(np.concatenate([b for b, _ in pairs]), np.concatenate([c for _, c in pairs]),
                                  np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                                  np.array(runs if runs is not None else [0] * len(pairs)), count)


def shared_noise_pair(seed: int, n: int, level: float, ratio: float, *, shared: float = 0.2, own: float = 0.01):
    """Call pairs whose durations share most of their variation (a long step slows both arms' call)."""
    rng = np.random.default_rng(seed)
    common = level * rng.lognormal(0.0, shared, n)
    return common * rng.lognormal(0.0, own, n), ratio * common * rng.lognormal(0.0, own, n)


PAIRS = [shared_noise_pair(1, 40, 2e6, 5.0), shared_noise_pair(2, 12, 4e8, 5.4), shared_noise_pair(3, 200, 1e4, 0.9)]


def test_ratio_is_the_ratio_of_summed_paired_time():
    estimates = bootstrap.estimate_rows(strata_of(PAIRS), [np.array([0]), np.array([0, 1, 2])], resamples=500)
    assert estimates[0].ratio == pytest.approx(PAIRS[0][1].sum() / PAIRS[0][0].sum(), rel=1e-12)
    expected = math.fsum(c.sum() for _, c in PAIRS) / math.fsum(b.sum() for b, _ in PAIRS)
    assert estimates[1].ratio == pytest.approx(expected, rel=1e-12)
    assert estimates[1].baseline_ns == pytest.approx(math.fsum(b.sum() for b, _ in PAIRS), rel=1e-12)
    for e in estimates:
        assert e.low < e.ratio < e.high and e.baseline_low < e.baseline_ns < e.baseline_high
        assert (e.confidence, e.resamples, e.method) == (0.95, 500, bootstrap.BOOTSTRAP)
    assert (estimates[1].strata, estimates[1].single_call_strata) == (3, 0)


@pytest.mark.parametrize("members", [[0], [1], [0, 1, 2]], ids=["40-pairs", "12-pairs", "three-strata"])
def test_interval_width_matches_paired_stratified_normal_theory(members):
    estimate = bootstrap.estimate_rows(strata_of(PAIRS), [np.array(members)], resamples=4000)[0]
    expected = paired_half_width([PAIRS[m] for m in members], 0.95)
    assert (estimate.high - estimate.low) / 2 == pytest.approx(expected, rel=0.12)


def test_pairing_cancels_variation_both_arms_share():
    """20% shared spread per call, 1% own: the paired interval is as narrow as the own noise allows, far
    narrower than treating the arms as independent samples would give."""
    base, cand = PAIRS[2]
    estimate = bootstrap.estimate_rows(strata_of([PAIRS[2]]), [np.array([0])])[0]
    unpaired = 1.96 * estimate.ratio * math.sqrt(sum(np.var(a, ddof=1) / a.size / a.mean() ** 2 for a in (base, cand)))
    assert (estimate.high - estimate.low) / 2 < unpaired / 10


def test_strata_are_never_mixed():
    """2k- and 32k-context cells with the same ratio: resampled apart, the mix cannot move the ratio, so the
    row is as tight as its cells; pooled into one cell, its width would follow the mix."""
    short = shared_noise_pair(4, 8, 2e6, 5.0, shared=0.01)
    long = shared_noise_pair(5, 8, 4.7e8, 5.0, shared=0.01)
    strata = strata_of([short, long])
    row, alone_short, alone_long = bootstrap.estimate_rows(strata, [np.array([0, 1]), np.array([0]), np.array([1])])
    assert row.high - row.low <= max(alone_short.high - alone_short.low, alone_long.high - alone_long.low)


def test_seeded_and_independent_of_the_order_of_rows():
    strata = strata_of(PAIRS)
    first = bootstrap.estimate_rows(strata, [np.array([0, 1, 2]), np.array([1])], seed=7)
    again = bootstrap.estimate_rows(strata_of([(b.copy(), c.copy()) for b, c in PAIRS]),
                                    [np.array([0, 1, 2]), np.array([1])], seed=7)
    other = bootstrap.estimate_rows(strata, [np.array([0, 1, 2]), np.array([1])], seed=8)
    assert [(e.low, e.high) for e in first] == [(e.low, e.high) for e in again]  # identical floats
    assert (first[0].low, first[0].high) != (other[0].low, other[0].high)


def test_higher_confidence_nests_the_interval():
    strata = strata_of(PAIRS)
    narrow = bootstrap.estimate_rows(strata, [np.array([0, 1, 2])], confidence=0.8)[0]
    wide = bootstrap.estimate_rows(strata, [np.array([0, 1, 2])], confidence=0.99)[0]
    assert wide.low < narrow.low < narrow.high < wide.high


@pytest.mark.parametrize("size", [2, 9, 300])
def test_resampled_totals_have_the_unbiased_variance(size, monkeypatch):
    """n - 1 draws scaled by n / (n - 1): mean n·x̄ and variance n·s² (ddof=1), the unbiased variance of
    a total, where n draws would give n·s²·(n-1)/n. Chunks of seven rows leave a partial last chunk, so an
    unfilled or misplaced row would show."""
    base, cand = shared_noise_pair(6, size, 1e5, 1.3)
    strata = strata_of([(base, cand)])
    monkeypatch.setattr(bootstrap, "CHUNK_ELEMENTS", 7 * (size - 1))
    unit = bootstrap._units(strata, np.array([0]), np.array([0]))[0]
    totals_b, totals_c = bootstrap._resampled_totals(strata, [unit], size, 4000, np.random.default_rng(0))
    assert totals_b.shape == totals_c.shape == (1, 4000)
    sd = math.sqrt(size * np.var(base, ddof=1))
    assert abs(totals_b.mean() - base.sum()) < 5 * sd / math.sqrt(4000)
    assert totals_b.std(ddof=1) == pytest.approx(sd, rel=0.08)
    assert np.corrcoef(totals_b[0], totals_c[0])[0, 1] > 0.9  # pairs drawn together


def test_large_units_take_the_normal_limit_with_the_same_interval():
    strata = strata_of(PAIRS)
    exact = bootstrap.estimate_rows(strata, [np.array([0, 1, 2])], resamples=4000)[0]
    limit = bootstrap.estimate_rows(strata, [np.array([0, 1, 2])], resamples=4000, exact_calls=0)[0]
    assert limit.ratio == exact.ratio
    assert (limit.low, limit.high) == pytest.approx((exact.low, exact.high), rel=2e-3)


def test_million_call_cell():
    # Realistic size (integer ns); runs through the normal limit. Runtime is reported, not asserted.
    base, cand = shared_noise_pair(11, 1_000_000, 2e4, 1.01, shared=0.1)
    base, cand = np.rint(base).astype(np.int64), np.rint(cand).astype(np.int64)
    estimate = bootstrap.estimate_rows(strata_of([(base, cand)]), [np.array([0])])[0]
    assert estimate.low < estimate.ratio < estimate.high
    assert (estimate.high - estimate.low) / 2 == pytest.approx(paired_half_width([(base, cand)], 0.95), rel=0.1)


def test_single_call_strata_are_pooled_or_have_no_interval():
    rng = np.random.default_rng(9)
    singles = [(np.array([v]), np.array([v * 1.2 * rng.lognormal(0, 0.01)])) for v in rng.uniform(1e4, 1e6, 30)]
    strata = strata_of(singles + [PAIRS[0]])
    pooled, lone, mixed = bootstrap.estimate_rows(strata, [np.arange(30), np.array([0]), np.array([0, 30])])
    assert pooled.low < pooled.ratio < pooled.high and (pooled.strata, pooled.single_call_strata) == (30, 30)
    assert (lone.low, lone.high, lone.resamples, lone.method) == (None, None, 0, bootstrap.SINGLE_CALL)
    assert lone.ratio == pytest.approx(singles[0][1][0] / singles[0][0][0])
    assert mixed.low is not None and mixed.single_call_strata == 1


def test_repeated_runs_put_between_run_variance_in_the_interval():
    """Two run pairs whose ratios differ by 4%: within each run the calls agree to 0.1%, so only the
    hierarchical bootstrap (runs, then calls) covers both runs' ratios."""
    first = shared_noise_pair(12, 64, 1e5, 2.0, own=0.001)
    second = shared_noise_pair(13, 64, 1e5, 2.08, own=0.001)
    strata = strata_of([first, second], runs=[0, 1], count=2)
    both = bootstrap.estimate_rows(strata, [np.array([0, 1])])[0]
    alone = bootstrap.estimate_rows(strata_of([first]), [np.array([0])])[0]
    assert both.method == bootstrap.HIERARCHICAL
    assert both.run_ratios == pytest.approx((first[1].sum() / first[0].sum(), second[1].sum() / second[0].sum()))
    assert both.low < min(both.run_ratios) and max(both.run_ratios) < both.high
    assert alone.high - alone.low < (both.high - both.low) / 10


@pytest.mark.parametrize("kwargs", [{"confidence": 1.0}, {"confidence": 0.0}, {"resamples": 0}])
def test_estimate_rows_rejects_bad_parameters(kwargs):
    with pytest.raises(ValueError):
        bootstrap.estimate_rows(strata_of(PAIRS), [np.array([0])], **kwargs)


@pytest.mark.parametrize("rows", [[np.array([3])], [np.array([0, 0])], [np.array([-1])]],
                         ids=["unknown", "twice", "negative"])
def test_estimate_rows_rejects_bad_rows(rows):
    with pytest.raises(ValueError):
        bootstrap.estimate_rows(strata_of(PAIRS), rows)


def test_rows_without_strata_or_baseline_time_have_no_estimate():
    zero = (np.zeros(4), np.ones(4))
    estimates = bootstrap.estimate_rows(strata_of([PAIRS[0], zero]), [np.zeros(0, dtype=np.int64), np.array([1])])
    assert estimates == [None, None]


@pytest.mark.parametrize("make", [
    lambda: bootstrap.PairedStrata(np.ones(3), np.ones(2), np.array([0, 3]), np.array([0]), 1),
    lambda: bootstrap.PairedStrata(np.ones(3), np.ones(3), np.array([0, 2]), np.array([0]), 1),
    lambda: bootstrap.PairedStrata(np.ones(3), np.ones(3), np.array([0, 3, 3]), np.array([0, 0]), 1),
    lambda: bootstrap.PairedStrata(np.ones(3), np.ones(3), np.array([0, 3]), np.array([1]), 1),
], ids=["lengths", "offsets-end", "empty-stratum", "run-out-of-range"])
def test_paired_strata_reject_inconsistent_arrays(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize("runs", [1, 2])
def test_intervals_are_positive_and_invert_when_the_arms_swap(runs):
    """Ratios and times are positive, and so are their intervals, however few the run pairs and however far t
    stretches them: two run pairs whose ratios are 1.0 and 3.0 (t with 1 df) reached below zero on the linear
    scale. On the log scale swapping the arms inverts the ratio's interval exactly."""
    pairs = [shared_noise_pair(11, 6, 1e4, 1.0, own=0.3), shared_noise_pair(12, 6, 1e4, 3.0, own=0.3)][:runs]
    swapped = [(c, b) for b, c in pairs]
    run_of = list(range(runs))
    forward = bootstrap.estimate_rows(strata_of(pairs, run_of, runs), [np.arange(runs)], seed=5)[0]
    backward = bootstrap.estimate_rows(strata_of(swapped, run_of, runs), [np.arange(runs)], seed=5)[0]
    for e in (forward, backward):
        assert 0 < e.low < e.ratio < e.high and 0 < e.baseline_low < e.baseline_high
        assert 0 < e.candidate_low < e.candidate_high
    assert (backward.low, backward.high) == pytest.approx((1 / forward.high, 1 / forward.low), rel=1e-9)
    if runs == 2:  # the linear interval, ratio ± half its log width times the ratio, would reach below zero
        assert forward.ratio - forward.ratio * math.log(forward.high / forward.ratio) < 0


@pytest.mark.parametrize("df", [1, 1.5, 2, 3, 7.5, 30, 400])
def test_t_quantile(df):
    assert distributions.t_quantile(0.975, df) == pytest.approx(t_quantile(0.975, df), rel=1e-5)


# --- verdicts ---------------------------------------------------------------------------------------------


def estimate(ratio: float, low: float | None, high: float | None) -> bootstrap.Estimate:
    method = bootstrap.SINGLE_CALL if low is None else bootstrap.BOOTSTRAP
    return bootstrap.Estimate(ratio, low, high, 0.95, 0 if low is None else 2000, method, 1.0, None, None, ratio, None,
                              None, (), 1, 0)


@pytest.mark.parametrize(
    "ratio,low,high,threshold,drift,expected",
    [
        (1.05, 1.03, 1.07, 0.02, 0.0, Verdict.REGRESSION),
        (0.90, 0.85, 0.95, 0.02, 0.0, Verdict.IMPROVEMENT),
        (1.01, 1.005, 1.015, 0.02, 0.0, Verdict.NO_CHANGE),  # significant, inside the band
        (1.01, 1.005, 1.015, 0.0, 0.0, Verdict.REGRESSION),  # same, with no band
        (0.99, 0.985, 0.995, 0.02, 0.0, Verdict.NO_CHANGE),
        (1.10, 0.98, 1.22, 0.02, 0.0, Verdict.NO_CHANGE),  # large but not significant
        (0.90, 0.78, 1.02, 0.02, 0.0, Verdict.NO_CHANGE),
        (1.05, 1.00, 1.10, 0.02, 0.0, Verdict.NO_CHANGE),  # touching 1 does not exclude it
        (0.974, 0.971, 0.977, 0.02, 0.0, Verdict.IMPROVEMENT),
        (0.974, 0.971, 0.977, 0.02, 0.032, Verdict.NO_CHANGE),  # within what drift moves
        (1.05, 1.04, 1.06, 0.02, 0.032, Verdict.REGRESSION),  # beyond it
        (1.05, 1.03, 1.07, 0.02, 0.032, Verdict.NO_CHANGE),  # reaching into it
        (1.01, None, None, 0.02, 0.0, Verdict.NO_CHANGE),  # single call, inside the band
        (2.50, None, None, 0.02, 0.0, Verdict.INSUFFICIENT_DATA),
        (0.50, None, None, 0.02, 0.0, Verdict.INSUFFICIENT_DATA),
    ],
)
def test_verdict_rule(ratio, low, high, threshold, drift, expected):
    assert verdicts.verdict(estimate(ratio, low, high), threshold=threshold, drift=drift) == expected


def test_verdicts_are_distinct_and_read_as_their_values():
    assert len({v.value for v in Verdict}) == len(Verdict) == 7
    assert verdicts.UNMEASURED == {Verdict.INSUFFICIENT_DATA, Verdict.NOT_COMPARABLE, Verdict.DIFFERENT_WORK,
                                   Verdict.TOO_FEW_RUNS}
    for v in Verdict:  # JSON, CSV and sentences carry the value, never the enum's name
        assert str(v) == f"{v}" == v.value and json.dumps(v) == json.dumps(v.value)


@pytest.mark.parametrize("ratio,low,high", [(2.0, 1.5, 2.5), (0.5, 0.4, 0.6), (1.01, 0.9, 1.1), (2.0, None, None)])
def test_higher_is_better_judges_the_reciprocal(ratio, low, high):
    """Throughput: a candidate twice as fast is an improvement, judged as baseline / candidate would be."""
    swapped = verdicts.judge(1 / ratio, None if high is None else 1 / high, None if low is None else 1 / low,
                             drift=0.25)
    mirrored = {Verdict.REGRESSION: Verdict.IMPROVEMENT, Verdict.IMPROVEMENT: Verdict.REGRESSION}
    assert verdicts.judge(ratio, low, high, drift=0.25, higher_is_better=True) == swapped
    assert verdicts.judge(ratio, low, high, drift=0.25) == mirrored.get(swapped, swapped)


@pytest.mark.parametrize("verdict,ratio,expected", [
    (Verdict.NO_CHANGE, 1.01, "ok"),  # within the band: nothing to report
    (Verdict.NO_CHANGE, 1.567, "info"),  # beyond the band and not decided: never ✅
    (Verdict.INSUFFICIENT_DATA, 0.964, "info"),
    (Verdict.IMPROVEMENT, 0.5, "info"),  # a speed-up is a change, not "all well"
    (Verdict.TOO_FEW_RUNS, 1.0, "info"),
    (Verdict.REGRESSION, 2.3, "warning"),
    (Verdict.DIFFERENT_WORK, 1.0, "warning"),
    (Verdict.NOT_COMPARABLE, None, "warning"),
])
def test_a_statement_is_ok_only_within_its_band(verdict, ratio, expected):
    assert verdicts.level_of(verdict, ratio, 0.02) == expected


@pytest.mark.parametrize("kwargs", [{"threshold": -0.01}, {"threshold": 1.0}, {"drift": -0.1}, {"drift": 1.0}])
def test_verdict_rejects_bad_bands(kwargs):
    with pytest.raises(ValueError):
        verdicts.verdict(estimate(1.0, 0.9, 1.1), **kwargs)


@pytest.mark.parametrize(
    "paired_delta,unpaired_delta,expected",
    [(100.0, 0.0, (Verdict.REGRESSION, None)),
     (100.0, 99.0, (Verdict.REGRESSION, None)),
     (100.0, -101.0, (Verdict.DIFFERENT_WORK, Verdict.REGRESSION)),  # offsetting unpaired work still dominates
     (1.0, 350.0, (Verdict.DIFFERENT_WORK, Verdict.REGRESSION))],
)
def test_different_work_is_never_a_plain_verdict(paired_delta, unpaired_delta, expected):
    found = verdicts.row_verdict(estimate(1.05, 1.03, 1.07), threshold=0.02, drift=0.0, paired_delta=paired_delta,
                                 unpaired_delta=unpaired_delta)
    assert found == expected


def test_no_pairs_is_not_comparable():
    assert verdicts.row_verdict(None, threshold=0.02, drift=0.0, paired_delta=0, unpaired_delta=5) == \
        (Verdict.NOT_COMPARABLE, None)


def test_unpaired_share_stays_within_zero_and_one():
    assert shares.unpaired_share(-40.0, -354.0) == pytest.approx(354 / 394)
    assert shares.unpaired_share(100.0, -100.0) == pytest.approx(0.5)
    assert shares.unpaired_share(0.0, 0.0) is None


def test_sure_move_is_the_interval_end_nearest_one():
    assert drift_band.sure_move(0.964, 0.968) == pytest.approx(0.032)
    assert drift_band.sure_move(1.004, 1.02) == pytest.approx(0.004)
    assert drift_band.sure_move(0.98, 1.01) == 0.0 and drift_band.sure_move(None, None) == 0.0


def test_size_classes():
    assert drift_band.size_class([900, 3_999, 4_000, 19_000, 171_000, 468e6]).tolist() == [0, 0, 1, 1, 2, 3]
    assert [drift_band.size_class_label(c) for c in range(4)] == ["< 4 µs", "4–40 µs", "40–400 µs", "≥ 400 µs"]
    assert drift_band.size_class_label(0, 1) == "< 40 µs" and drift_band.size_class_label(2, 3) == "≥ 40 µs"


def control(family: str, per_call_ns: float, low: float | None, high: float | None) -> drift_band.Control:
    return drift_band.Control(family, int(drift_band.size_class(per_call_ns)), low, high)


def test_drift_band_of_each_size_is_its_largest_sure_move():
    """Each class takes the largest sure move of its own controls; a larger class without controls takes the
    band of the nearest smaller one; classes below every control are assumed with one run per arm."""
    controls = [control("norm", 2_000, 0.964, 0.968), control("act", 1_400, 0.97, 0.99),
                control("gemm", 9_000, 1.004, 1.02), control("gemm", 19_000, 0.98, 1.01),
                control("x", 30_000, None, None)]
    bands = drift_band.drift_bands(controls, threshold=0.02, runs=1)
    assert bands.band[:2] == pytest.approx((0.032, 0.004)) and bands.widest[:2] == (0, 2)
    assert bands.basis == (drift_band.MEASURED, drift_band.MEASURED, drift_band.AS_SMALLER, drift_band.AS_SMALLER)
    assert bands.band[2:] == pytest.approx((0.004, 0.004)) and bands.outlier is None
    gemm_only = drift_band.drift_bands([control("gemm", 171_000, 0.997, 0.999)], threshold=0.02, runs=1)
    assert gemm_only.band[:2] == (drift_band.ASSUMED_BAND,) * 2 and gemm_only.basis[:2] == (drift_band.ASSUMED,) * 2
    assert gemm_only.band[2:] == pytest.approx((0.001, 0.001))
    repeated = drift_band.drift_bands([control("gemm", 171_000, 0.99, 1.01)], threshold=0.02, runs=2)
    assert repeated.band[:2] == (0.0, 0.0) and repeated.basis[:2] == (drift_band.REPEATS,) * 2
    assert drift_band.drift_bands([], threshold=0.02, runs=1).band == (drift_band.ASSUMED_BAND,) * 4


def test_one_family_that_moves_far_more_than_its_peers_is_left_out():
    """The vLLM 0.33 FP8 vs NVFP4 shape: one 19 µs GEMM moved 7% for sure, its peers at most 2%. It is left out,
    so the 4-40 µs band is its peers' 2%; with a single peer, or a move within twice the threshold, nothing is."""
    peers = [control("splitK", 9_200, 1.020, 1.026), control("norm", 2_000, 0.995, 0.999),
             control("nvjet_128x16", 19_000, 1.070, 1.076), control("nvjet_128x16", 25_000, 1.0, 1.01)]
    bands = drift_band.drift_bands(peers, threshold=0.02, runs=1)
    assert (bands.outlier, bands.outlier_move) == ("nvjet_128x16", pytest.approx(0.070))
    assert bands.band[1] == pytest.approx(0.020) and bands.widest[1] == 0
    assert drift_band.drift_bands(peers[1:3], threshold=0.02, runs=1).outlier is None  # one peer: no telling
    assert drift_band.drift_bands(peers, threshold=0.04, runs=1).outlier is None  # within twice the threshold
    close = peers[:2] + [control("nvjet_128x16", 19_000, 1.035, 1.04)]
    assert drift_band.drift_bands(close, threshold=0.02, runs=1).outlier is None  # not twice the next


def test_row_band_weighs_its_cells_bands_by_baseline_time():
    bands = drift_band.Bands((0.15, 0.02, 0.004, 0.004), (drift_band.ASSUMED,) + (drift_band.MEASURED,) * 3, (None, 1, 2, 2))
    assert bands.of([1_000], [5.0]) == pytest.approx(0.15)
    assert bands.of([1_000, 171_000], [1.0, 99.0]) == pytest.approx(0.01 * 0.15 + 0.99 * 0.004)
    assert bands.of([], []) == 0.0


def test_uncontrolled_cells_are_held_to_the_assumed_band_with_one_run_per_arm():
    """No control is of the kind of `other` kernels: with one run per arm their cells' band is at least the
    assumed one, whatever their size class measured (a wider class band stays); a row weighs it by time. With
    repeats the intervals carry the spread, and nothing changes."""
    controls = [control("norm", 2_000, 0.995, 0.999), control("gemm", 19_000, 1.001, 1.003)]
    one, two = (drift_band.drift_bands(controls, threshold=0.02, runs=runs) for runs in (1, 2))
    assert one.band[:2] == pytest.approx((0.001, 0.001)) and two.band[:2] == pytest.approx((0.001, 0.001))
    assert (one.uncontrolled, two.uncontrolled) == (drift_band.ASSUMED_BAND, 0.0)
    assert one.of([2_000], [1.0], [True]) == drift_band.ASSUMED_BAND
    assert one.of([2_000], [1.0], [False]) == one.of([2_000], [1.0]) == pytest.approx(0.001)
    assert one.of([2_000, 19_000], [1.0, 3.0], [True, False]) == pytest.approx(0.25 * 0.20 + 0.75 * 0.001)
    assert two.of([2_000], [1.0], [True]) == pytest.approx(0.001)
    wide = drift_band.Bands((0.3,) * 4, (drift_band.MEASURED,) * 4, (0,) * 4, uncontrolled=drift_band.ASSUMED_BAND)
    assert wide.of([2_000], [1.0], [True]) == 0.3


def test_same_work():
    assert arm_summary.same_work([np.array([170.7, 172.1, 171.7]), np.array([171.1, 171.3])])
    assert not arm_summary.same_work([np.array([2.08e6, 30.1e6, 468e6])])
    assert not arm_summary.same_work([np.array([100.0]), np.array([100.0, 111.0])])
    assert arm_summary.same_work([np.array([100.0, 110.0]), np.zeros(0)])


# --- ratios and shares --------------------------------------------------------------------------------------


def test_share_and_ratio():
    assert shares.share(3.0, 12.0) == 0.25
    assert shares.share(0.0, 5.0) == 0.0
    assert shares.share(1.0, 0.0) is None
    assert shares.ratio(4.0, 5.0) == 1.25
    assert shares.ratio(0.0, 5.0) is None and shares.ratio(None, 5.0) is None and shares.ratio(4.0, None) is None


def test_abs_shares_stay_within_zero_and_one_and_sum_to_one():
    deltas = [11.45e6, -9.34e6, -2.22e6, 1.64e6, 1.59e6]  # signed shares of these reach 398% and -325%
    found = shares.abs_shares(deltas)
    assert all(0.0 <= s <= 1.0 for s in found)
    assert math.fsum(found) == pytest.approx(1.0)
    assert found[0] == pytest.approx(11.45e6 / sum(abs(d) for d in deltas))


@pytest.mark.parametrize("deltas", [[0.0, 0.0], []], ids=["no-change", "empty"])
def test_abs_shares_without_change_are_none(deltas):
    assert shares.abs_shares(deltas) == [None] * len(deltas)
