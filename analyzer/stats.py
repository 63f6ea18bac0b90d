"""Pure statistics over per-kernel-call durations: summaries, bootstrap ratio intervals, verdicts.

No I/O and no dataframes: callers hand in arrays and get plain numbers back, so every renderer and
the CI gate judge the same values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "BOOTSTRAP",
    "IMPROVEMENT",
    "INSUFFICIENT_DATA",
    "NO_CHANGE",
    "REGRESSION",
    "SINGLE_CALL",
    "Describe",
    "RatioInterval",
    "delta_attribution",
    "describe",
    "ratio_interval",
    "share",
    "verdict",
]

REGRESSION = "regression"
IMPROVEMENT = "improvement"
NO_CHANGE = "no significant change"
INSUFFICIENT_DATA = "insufficient data"

BOOTSTRAP = "percentile bootstrap"
SINGLE_CALL = "single call"

# Elements drawn per bootstrap chunk (index matrix or count matrix): bounds memory to tens of MiB
# whatever the arm size. A constant, so the random stream, and hence the result, is reproducible.
_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Describe:
    """Summary of one arm's call durations (same unit as the input, normally ns)."""

    count: int
    total: float
    mean: float
    median: float
    p90: float
    p99: float
    min: float
    max: float
    std: float
    cv: float


@dataclass(frozen=True)
class RatioInterval:
    """mean(candidate) / mean(baseline) with its interval; low/high are None when undefined."""

    ratio: float
    low: float | None
    high: float | None
    confidence: float
    resamples: int
    method: str


def _as_1d(values: ArrayLike, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype.kind not in "iu":  # integer ns stay integers: no float copy of millions of calls
        array = array.astype(np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size == 0:
        raise ValueError(f"{name} is empty")
    return array


def describe(durations_ns: ArrayLike) -> Describe:
    """Count, total, mean, median, p90, p99, min, max, sample std and cv of one arm.

    Quantiles use numpy's default linear interpolation (Hyndman-Fan type 7, the same as
    ``statistics.quantiles(method="inclusive")``), so p99 of few calls interpolates between the top two
    rather than jumping to the maximum. ``std`` is the sample std (ddof=1; 0.0 for a single call);
    ``cv = std / mean`` (NaN when the mean is 0). Raises ValueError for empty or non-1-D input.
    """
    x = _as_1d(durations_ns, "durations_ns")
    median, p90, p99 = np.quantile(x, [0.5, 0.9, 0.99])
    mean = float(x.mean())
    std = float(x.std(ddof=1)) if x.size > 1 else 0.0
    return Describe(
        count=int(x.size),
        total=float(x.sum()),
        mean=mean,
        median=float(median),
        p90=float(p90),
        p99=float(p99),
        min=float(x.min()),
        max=float(x.max()),
        std=std,
        cv=std / mean if mean else math.nan,
    )


def _resample_means(x: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Means of ``resamples`` bootstrap resamples (n draws with replacement) of ``x``.

    A resample's mean depends only on how often each distinct value is drawn, and those counts are
    Multinomial(n, share of each value). Nsight durations are integer ns with heavy ties, so drawing
    counts over the k distinct values costs O(resamples * k) instead of O(resamples * n) for index
    draws; both are exact. A multinomial count costs ~16x an index draw (measured, ~80 ns vs ~5 ns),
    hence the switch at k <= n / 16. Work is chunked to bound memory. Index draws go over the sorted
    values, so that neither path depends on the order of ``x``.
    """
    n = x.size
    values, counts = np.unique(x, return_counts=True)
    values = values.astype(np.float64)  # float sums: BLAS for the count matrix product
    use_counts = values.size * 16 <= n
    if not use_counts:
        x = np.repeat(values, counts)  # x sorted
    width = values.size if use_counts else n
    rows = max(1, _CHUNK_ELEMENTS // width)
    means = np.empty(resamples)
    for start in range(0, resamples, rows):
        size = min(rows, resamples - start)
        if use_counts:
            sums = rng.multinomial(n, counts / n, size=size) @ values
        else:
            sums = x[rng.integers(0, n, size=(size, n))].sum(axis=1)
        means[start : start + size] = sums / n
    return means


def ratio_interval(
    baseline: ArrayLike,
    candidate: ArrayLike,
    *,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> RatioInterval:
    """Percentile-bootstrap interval for mean(candidate) / mean(baseline).

    Each arm is resampled independently (the calls of two traces are not paired), baseline first,
    from one ``Generator(PCG64(seed))``. The interval depends on the durations and the seed, not on the
    order the calls arrive in. Ratio of
    means rather than mean of per-call ratios, because it is the ratio of total GPU time per call.
    With a single call in either arm there is no spread to resample: low and high are None and
    ``method`` is ``SINGLE_CALL``. Raises ValueError for an empty arm or a zero baseline mean.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    base = _as_1d(baseline, "baseline")
    cand = _as_1d(candidate, "candidate")
    base_mean = base.mean()
    if base_mean == 0:
        raise ValueError("baseline mean is 0; the ratio is undefined")
    ratio = float(cand.mean() / base_mean)
    if base.size == 1 or cand.size == 1:
        return RatioInterval(ratio, None, None, confidence, 0, SINGLE_CALL)
    rng = np.random.Generator(np.random.PCG64(seed))
    base_means = _resample_means(base, resamples, rng)
    cand_means = _resample_means(cand, resamples, rng)
    alpha = 1.0 - confidence
    low, high = np.quantile(cand_means / base_means, [alpha / 2, 1 - alpha / 2])
    return RatioInterval(ratio, float(low), float(high), confidence, resamples, BOOTSTRAP)


def verdict(interval: RatioInterval, *, threshold: float = 0.02) -> str:
    """Classify a candidate/baseline ratio (above 1 means the candidate is slower).

    Rule: REGRESSION when the interval lies wholly above 1 (significant) and the ratio exceeds
    1 + threshold (matters); IMPROVEMENT when the interval lies wholly below 1 and the ratio is below
    1 - threshold; otherwise NO_CHANGE. Like pyperf's "Not significant!" plus ``--min-speed``, a
    real but tiny change is not reported, and a large one is not reported without evidence.
    Without an interval (single call): NO_CHANGE if the ratio is within the band, else
    INSUFFICIENT_DATA, since one call cannot show significance.
    """
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"threshold must be in [0, 1), got {threshold}")
    ratio = interval.ratio
    beyond_above = ratio > 1.0 + threshold
    beyond_below = ratio < 1.0 - threshold
    if interval.low is None or interval.high is None:
        return INSUFFICIENT_DATA if beyond_above or beyond_below else NO_CHANGE
    if beyond_above and interval.low > 1.0:
        return REGRESSION
    if beyond_below and interval.high < 1.0:
        return IMPROVEMENT
    return NO_CHANGE


def share(part: float, whole: float) -> float | None:
    """part / whole, or None when whole is 0 (no meaningful share rather than inf or NaN)."""
    return part / whole if whole else None


def delta_attribution(deltas: Mapping[str, float]) -> dict[str, float | None]:
    """Fraction of the total delta that each segment explains.

    The denominator is the signed sum of the deltas, taken exactly (``math.fsum``) so that it does not
    depend on segment order and deltas that cancel give exactly 0; the fractions add up to 1. With mixed signs a segment can explain
    more than 100% (others partly offset it) and an offsetting segment gets a negative fraction. When
    the sum is 0 there is no net change to explain and every fraction is None.
    """
    total = math.fsum(deltas.values())
    return {segment: share(delta, total) for segment, delta in deltas.items()}
