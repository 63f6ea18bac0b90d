"""One arm's call durations summarised (count, total, mean, quantiles, spread), and whether cells cost the same
per call."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

# A row's per-call statistics describe calls only when its cells cost about the same per call: the
# largest cell mean at most this much above the smallest, in each arm. Otherwise the row is a total.
SAME_WORK_SPREAD = 0.10
# Elements per float64 chunk of a sum or of exact resampling: bounds memory to tens of MiB whatever the sizes.
CHUNK_ELEMENTS = 1 << 22


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
    std = _sample_std(x, mean)
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


def _sample_std(x: np.ndarray, mean: float) -> float:
    """The sample std (ddof=1): numpy's for up to CHUNK_ELEMENTS values, else summed in float64 chunks, so that
    no float copy of millions of calls is made."""
    if x.size < 2:
        return 0.0
    if x.size <= CHUNK_ELEMENTS:
        return float(x.std(ddof=1))
    squares = 0.0
    for start in range(0, x.size, CHUNK_ELEMENTS):
        deviation = x[start:start + CHUNK_ELEMENTS].astype(np.float64) - mean
        squares += float(deviation @ deviation)
    return math.sqrt(squares / (x.size - 1))


def same_work(per_call_means: Sequence[np.ndarray]) -> bool:
    """Whether cells cost the same per call (within SAME_WORK_SPREAD) in every arm, so that a pooled
    per-call mean describes calls that ran rather than a mix of different work."""
    for means in per_call_means:
        means = np.asarray(means, dtype=np.float64)
        if means.size > 1 and means.max() > (1.0 + SAME_WORK_SPREAD) * means.min():
            return False
    return True


