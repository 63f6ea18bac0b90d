"""How far a bootstrap interval reaches from its point, on the log scale: the percentile interval stretched by t / z,
or z standard deviations of the log draws times t / z over run pairs, with the degrees of freedom of what varied."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtrace.analyzer.stats.distributions import normal_quantile, t_quantile


def bounds(draws: np.ndarray, point: np.ndarray, stretch: np.ndarray, confidence: float, *,
           runs: int = 1) -> np.ndarray:
    """Percentile interval of each row's draws, its distances from the point estimate times `stretch`, taken on the
    log scale: ratios and times are positive, so their intervals are too, and swapping the arms inverts a ratio's
    interval exactly ([1/high, 1/low]).

    With run pairs, z standard deviations of the log draws instead: two or three run pairs give the draws two or
    three values, whose percentiles lie about one standard error from the point, not z; t(1) = 12.7 stretches such
    an interval far, which on the linear scale reached below zero (1.567× [-1.456, 4.590]). A row whose point or
    draws are not all positive keeps the linear interval, cut at 0."""
    alpha = 1.0 - confidence
    positive = (point > 0) & np.all(draws > 0, axis=1)
    found = np.empty((2, point.size))
    # Each row's interval on one scale only (each row's draws are summarised on their own): nearly every row is
    # positive, and the quantiles of thousands of draws per row are most of a diff's time outside the resampling.
    for rows, on_log in ((positive, True), (~positive, False)):
        if not rows.any():
            continue
        rows = slice(None) if rows.all() else rows  # no copy of the draws in the usual case
        values, centre, widen = draws[rows], point[rows], stretch[rows]
        if on_log:
            values, centre = np.log(values), np.log(centre)
        if runs > 1:
            half = normal_quantile(1 - alpha / 2) * values.std(axis=1, ddof=1)
            interval = np.stack([centre - widen * half, centre + widen * half])
        else:
            low, high = np.quantile(values, [alpha / 2, 1 - alpha / 2], axis=1)
            interval = np.stack([centre - widen * (centre - low), centre + widen * (high - centre)])
        found[:, rows] = np.exp(interval) if on_log else np.maximum(interval, 0.0)
    return found


def run_widening(run_counts: np.ndarray, confidence: float) -> np.ndarray:
    """widening with several run pairs: runs - 1 df whatever the calls, the ratio's and each arm's alike. Each run
    pair's total varies with its calls too, so the calls' df would count that spread twice (at 2 and 3 runs per
    arm the interval then covered 90% for 95%, tests/test_intervals.py). `run_counts`: per row, the run pairs that
    paired its calls (a row resampled over fewer than all of them takes their count's df)."""
    z = normal_quantile(0.5 + confidence / 2)
    return np.array([t_quantile(0.5 + confidence / 2, max(int(k), 2) - 1) / z for k in run_counts])


def widening(units: Sequence, point_b: np.ndarray, point_c: np.ndarray, ratios: np.ndarray | None,
             confidence: float, *, arm: int | None = None) -> np.ndarray:
    """Per row of one run pair, t(df) / z at the confidence level: the percentile bootstrap stretched as a t
    interval is over a z interval, with df the Welch-Satterthwaite degrees of freedom of the row's variance.

    The percentile bootstrap treats the estimated spread as known; with eight calls per cell that is the
    difference between z = 1.96 and t = 2.36 (Hesterberg 2015 expands the percentile interval for the
    same reason). Components: per unit of n pairs, the variance of its linearised total (C - R·B for the
    ratio, B or C for one arm) with n - 1 df; `units`: bootstrap's units. Several run pairs: run_widening."""
    rows, runs = point_b.shape
    z = normal_quantile(0.5 + confidence / 2)
    spread_units = [u for u in units if u.size > 1]
    row_index = np.concatenate([u.targets // runs for u in spread_units] + [np.zeros(0, dtype=np.int64)])
    repeat = [u.targets.size for u in spread_units]
    covariance = np.repeat(np.array([u.covariance for u in spread_units]).reshape(-1, 3), repeat, axis=0)
    df = np.repeat(np.array([u.size - 1 for u in spread_units], dtype=np.float64), repeat)
    vbb, vcc, vbc = covariance.T
    if arm is None:
        r = ratios[row_index]
        values = vcc - 2 * r * vbc + r * r * vbb
    else:
        values = vbb if arm == 0 else vcc
    # float even without spread units (bincount of no weights is integer)
    variance = np.bincount(row_index, values, minlength=rows).astype(np.float64)
    weighted = np.bincount(row_index, values ** 2 / df, minlength=rows).astype(np.float64)
    stretch = np.ones(rows)
    for row in np.flatnonzero(weighted > 0):
        stretch[row] = t_quantile(0.5 + confidence / 2, round(float(variance[row] ** 2 / weighted[row]), 2)) / z
    return stretch
