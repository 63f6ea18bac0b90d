"""Pure statistics over kernel-call durations: summaries, paired stratified intervals, drift, verdicts.

No I/O and no dataframes: callers hand in arrays grouped by stratum and run and get frozen results back,
so every renderer and the CI gate judge the same values. The model is described in docs/statistics.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "ASSUMED_SERVING_BAND",
    "BOOTSTRAP",
    "DIFFERENT_WORK",
    "HIERARCHICAL",
    "IMPROVEMENT",
    "INSUFFICIENT_DATA",
    "NOT_COMPARABLE",
    "NO_CHANGE",
    "REGRESSION",
    "SAME_WORK_SPREAD",
    "NO_INTERVAL_WHY",
    "ONE_RUN_PAIR",
    "SINGLE_CALL",
    "UNMEASURED",
    "Describe",
    "Estimate",
    "PairedAccuracy",
    "PairedStrata",
    "ArmSamples",
    "ServingEstimate",
    "abs_shares",
    "describe",
    "estimate_rows",
    "mcnemar_exact",
    "paired_accuracy",
    "pool_serving",
    "ratio",
    "row_verdict",
    "same_work",
    "serving_estimate",
    "share",
    "unpaired_share",
    "verdict",
]

REGRESSION = "regression"
IMPROVEMENT = "improvement"
NO_CHANGE = "no significant change"
INSUFFICIENT_DATA = "insufficient data"
NOT_COMPARABLE = "not comparable"
DIFFERENT_WORK = "different work"
# Verdicts that say the row could not be measured: a gate watching such a row cannot pass or fail on it.
UNMEASURED = frozenset({INSUFFICIENT_DATA, NOT_COMPARABLE, DIFFERENT_WORK})

BOOTSTRAP = "stratified paired bootstrap"
HIERARCHICAL = "hierarchical bootstrap: run pairs, then call pairs within cells"
SINGLE_CALL = "single call"
ONE_RUN_PAIR = "one run pair of several"
# Why a compared row has a ratio and no interval (Estimate.no_interval), by method.
NO_INTERVAL_WHY = {SINGLE_CALL: "single calls, which have no spread of their own",
                   ONE_RUN_PAIR: "its calls paired in one run pair only, which cannot show how runs vary"}

# A row's per-call statistics describe calls only when its cells cost about the same per call: the
# largest cell mean at most this much above the smallest, in each arm. Otherwise the row is a total.
SAME_WORK_SPREAD = 0.10

# Call pairs resampled index by index per comparison, smallest units first (where the bootstrap's shape
# matters most); the rest use the bootstrap's normal limit. Exact draws cost resamples x calls.
EXACT_CALLS = 1 << 13
# Elements drawn per chunk of exact resampling: bounds memory to tens of MiB whatever the cell sizes.
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
    """The sample std (ddof=1): numpy's for up to _CHUNK_ELEMENTS values, else summed in float64 chunks, so that
    no float copy of millions of calls is made."""
    if x.size < 2:
        return 0.0
    if x.size <= _CHUNK_ELEMENTS:
        return float(x.std(ddof=1))
    squares = 0.0
    for start in range(0, x.size, _CHUNK_ELEMENTS):
        deviation = x[start:start + _CHUNK_ELEMENTS].astype(np.float64) - mean
        squares += float(deviation @ deviation)
    return math.sqrt(squares / (x.size - 1))


# ---- paired, stratified estimates -----------------------------------------------------------------------


@dataclass(frozen=True)
class PairedStrata:
    """The paired calls of a comparison, stratum after stratum.

    A stratum is the calls of one cell in one run pair; ``baseline[i]`` pairs with ``candidate[i]``
    (the same call of the same work in both arms). Stratum s is ``[offsets[s], offsets[s + 1])`` and was
    recorded in run pair ``run[s]`` of ``runs``.
    """

    baseline: np.ndarray
    candidate: np.ndarray
    offsets: np.ndarray
    run: np.ndarray
    runs: int

    def __post_init__(self):
        if self.baseline.shape != self.candidate.shape or self.baseline.ndim != 1:
            raise ValueError("baseline and candidate must be 1-D arrays of the same length (one element per pair)")
        if self.offsets.size == 0 or self.offsets[0] != 0 or self.offsets[-1] != self.baseline.size or \
                np.any(np.diff(self.offsets) < 1):
            raise ValueError("offsets must start at 0, end at the number of pairs and give every stratum a pair")
        if self.run.size != self.offsets.size - 1 or (self.run.size and not 0 <= self.run.min() <= self.run.max()
                                                        < self.runs):
            raise ValueError("run must give each stratum a run pair in [0, runs)")

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass(frozen=True)
class Estimate:
    """One row: candidate / baseline summed paired time, with its interval and each arm's paired time.

    ``ratio`` is Σ candidate / Σ baseline over the row's call pairs (all runs); low/high are None when no
    stratum of the row has two pairs (``method`` SINGLE_CALL), or when, of several run pairs, only one paired
    the row's calls (``method`` ONE_RUN_PAIR); ``no_interval`` then says why. ``baseline_ns``/``candidate_ns``
    are the summed paired times with their intervals. ``run_ratios`` holds the ratio of each run pair (None
    where that run pair paired none of the row's calls).
    """

    ratio: float
    low: float | None
    high: float | None
    confidence: float
    resamples: int
    method: str
    baseline_ns: float
    baseline_low: float | None
    baseline_high: float | None
    candidate_ns: float
    candidate_low: float | None
    candidate_high: float | None
    run_ratios: tuple[float | None, ...]
    strata: int
    single_call_strata: int
    no_interval: str | None = None  # why low/high are None (NO_INTERVAL_WHY), for a row with a ratio


def estimate_rows(strata: PairedStrata, rows: Sequence[np.ndarray], *, confidence: float = 0.95,
                  resamples: int = 2000, seed: int = 0, exact_calls: int = EXACT_CALLS) -> list[Estimate | None]:
    """Ratio of summed paired time per row (a set of strata), with a bootstrap interval.

    Within a stratum, call pairs are resampled as pairs (the same index in both arms), so variation
    both arms share cancels; strata are resampled each inside itself and never across, so a row over
    2k and 32k contexts mixes no calls of one into the other. A stratum of n pairs draws n − 1 pairs
    (the with-replacement bootstrap of McCarthy & Snowden 1985, Rao & Wu 1988's rescaling with m = n − 1),
    whose variance is the unbiased one: with 8 calls per cell the plain bootstrap would understate it by
    1/8. Single-call strata that belong to the same rows and run are pooled into one, since one call
    has no spread of its own. Units above the ``exact_calls`` budget use the bootstrap's normal limit
    (a bivariate normal with the same covariance).

    With several run pairs the bootstrap is hierarchical (Kalibera & Jones 2013): each resample draws
    runs − 1 run pairs, then, within each, the calls as above, so between-run variance is inside the
    interval, which is then ± t(runs − 1) standard deviations of the draws (_bounds, _run_widening). A row whose
    calls paired in only some of the run pairs (vLLM steps that one run pair scheduled alike and another not) is
    resampled over those run pairs alone, with their count's t: a run pair without its calls adds nothing to
    either arm, and drawn alone it would make 0 / 0. Paired in one run pair of several, the row gets no
    interval (ONE_RUN_PAIR): its calls' spread says nothing of how runs vary, which the repeats' band of 0
    leaves to the interval. Draws come from one ``Generator(PCG64(seed))`` in a fixed order. A row without
    strata, or whose baseline sums to 0, gets None.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    sizes = strata.sizes
    row_of, stratum_of = _incidence(rows, sizes.size)
    units = _units(strata, row_of, stratum_of)
    rng = np.random.Generator(np.random.PCG64(seed))
    cells = len(rows) * strata.runs
    point_b, point_c = np.zeros(cells), np.zeros(cells)
    draws_b, draws_c = np.zeros((cells, resamples)), np.zeros((cells, resamples))
    varied = np.zeros(cells, dtype=bool)  # whether a (row, run) has any spread to resample
    normal = np.zeros((cells, 3))  # summed covariance (bb, cc, bc) of the normal-limit units

    for unit in units:
        np.add.at(point_b, unit.targets, unit.total_b)
        np.add.at(point_c, unit.targets, unit.total_c)
    for size, group in _by_size(units, exact_calls):
        if size == 1:
            continue
        totals_b, totals_c = _resampled_totals(strata, group, size, resamples, rng)
        targets = np.concatenate([u.targets for u in group])
        which = np.repeat(np.arange(len(group)), [u.targets.size for u in group])
        np.add.at(draws_b, targets, totals_b[which] - np.array([u.total_b for u in group])[which, None])
        np.add.at(draws_c, targets, totals_c[which] - np.array([u.total_c for u in group])[which, None])
        varied[targets] = True
    for unit in units:
        if unit.normal:
            np.add.at(normal, unit.targets, unit.covariance)
            varied[unit.targets] = True
    draws_b, draws_c = _add_normal(draws_b, draws_c, normal, rng)
    draws_b += point_b[:, None]
    draws_c += point_c[:, None]

    shape = (len(rows), strata.runs)
    point_b, point_c, varied = point_b.reshape(shape), point_c.reshape(shape), varied.reshape(shape)
    draws_b, draws_c = draws_b.reshape(*shape, resamples), draws_c.reshape(*shape, resamples)
    compared = [np.unique(strata.run[np.asarray(members, dtype=np.int64)]) for members in rows]  # run pairs per row
    if strata.runs > 1:
        per_run_b, per_run_c = draws_b, draws_c
        draws_b, draws_c = _resample_runs(per_run_b, per_run_c, rng)
        for index, found in enumerate(compared):
            if 1 < found.size < strata.runs:
                some_b, some_c = _resample_runs(per_run_b[index:index + 1, found], per_run_c[index:index + 1, found],
                                                rng)
                draws_b[index], draws_c[index] = some_b[0], some_c[0]
        method = HIERARCHICAL
    else:
        draws_b, draws_c = draws_b[:, 0], draws_c[:, 0]
        method = BOOTSTRAP
    run_counts = np.array([found.size for found in compared])
    base, cand = point_b.sum(axis=1), point_c.sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):  # a row paired in one run pair of several: no interval
        ratios = cand / base
        if strata.runs > 1:  # the run pair is the unit: one widening for the ratio and each arm
            widenings = (_run_widening(run_counts, confidence),) * 3
        else:
            widenings = (_widening(units, point_b, point_c, ratios, confidence),
                         *(_widening(units, point_b, point_c, None, confidence, arm=arm) for arm in (0, 1)))
        ratio_bounds = _bounds(draws_c / draws_b, ratios, widenings[0], confidence, runs=strata.runs)
        base_bounds = _bounds(draws_b, base, widenings[1], confidence, runs=strata.runs)
        cand_bounds = _bounds(draws_c, cand, widenings[2], confidence, runs=strata.runs)

    results: list[Estimate | None] = []
    for index, members in enumerate(rows):
        if members.size == 0 or base[index] == 0:
            results.append(None)
            continue
        spread = bool(varied[index].any()) or strata.runs > 1 and np.count_nonzero(point_b[index]) > 1
        run_ratios = tuple(float(c / b) if b else None for b, c in zip(point_b[index], point_c[index])) \
            if strata.runs > 1 else ()
        single = int(np.count_nonzero(sizes[members] == 1))
        b, c = float(base[index]), float(cand[index])
        if strata.runs > 1 and compared[index].size == 1:
            results.append(Estimate(c / b, None, None, confidence, 0, ONE_RUN_PAIR, b, None, None, c, None, None,
                                    run_ratios, int(members.size), single, NO_INTERVAL_WHY[ONE_RUN_PAIR]))
        elif spread:
            results.append(Estimate(c / b, float(ratio_bounds[0, index]), float(ratio_bounds[1, index]),
                                    confidence, resamples, method, b, float(base_bounds[0, index]),
                                    float(base_bounds[1, index]), c, float(cand_bounds[0, index]),
                                    float(cand_bounds[1, index]), run_ratios, int(members.size), single))
        else:
            results.append(Estimate(c / b, None, None, confidence, 0, SINGLE_CALL, b, None, None, c,
                                    None, None, run_ratios, int(members.size), single, NO_INTERVAL_WHY[SINGLE_CALL]))
    return results


def _incidence(rows: Sequence[np.ndarray], count: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, stratum) pairs, one per membership."""
    arrays = [np.asarray(r, dtype=np.int64) for r in rows]
    for members in arrays:
        if members.size and (members.min() < 0 or members.max() >= count or np.unique(members).size != members.size):
            raise ValueError("each row must list distinct strata of the comparison")
    row_of = np.repeat(np.arange(len(arrays)), [a.size for a in arrays])
    stratum_of = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    return row_of, stratum_of


@dataclass
class _Unit:
    """What is resampled as one: a stratum, or single-call strata pooled; with the accumulators it feeds."""

    positions: slice | np.ndarray  # of its pairs in PairedStrata's arrays
    targets: np.ndarray  # row * runs + run, one per row it belongs to
    total_b: float = 0.0
    total_c: float = 0.0
    covariance: tuple[float, float, float] = (0.0, 0.0, 0.0)  # of the totals under resampling
    normal: bool = False

    @property
    def size(self) -> int:
        if isinstance(self.positions, slice):
            return self.positions.stop - self.positions.start
        return int(self.positions.size)

    def indices(self) -> np.ndarray:
        if isinstance(self.positions, slice):
            return np.arange(self.positions.start, self.positions.stop)
        return self.positions


def _units(strata: PairedStrata, row_of: np.ndarray, stratum_of: np.ndarray) -> list[_Unit]:
    sizes, offsets, runs = strata.sizes, strata.offsets, strata.runs
    order = np.argsort(stratum_of, kind="stable")
    bounds = np.searchsorted(stratum_of[order], np.arange(sizes.size + 1))
    units: list[_Unit] = []
    pooled: dict[tuple, list[int]] = {}
    for s in range(sizes.size):
        rows_of_s = row_of[order[bounds[s]:bounds[s + 1]]]
        if rows_of_s.size == 0:
            continue
        targets = rows_of_s * runs + int(strata.run[s])
        if sizes[s] == 1:
            pooled.setdefault(tuple(targets.tolist()), []).append(int(offsets[s]))
        else:
            units.append(_Unit(slice(int(offsets[s]), int(offsets[s + 1])), targets))
    units += [_Unit(np.array(positions), np.array(targets)) for targets, positions in pooled.items()]
    for unit in units:
        unit.total_b, unit.total_c, unit.covariance = _moments(strata.baseline[unit.positions],
                                                               strata.candidate[unit.positions])
    return units


def _moments(base: np.ndarray, cand: np.ndarray) -> tuple[float, float, tuple[float, float, float]]:
    """Sums of both arms and the covariance of the resampled totals, in float64 chunks (no full copy).

    Rao-Wu with m = n - 1: the resampled total n·mean(m draws) has variance n·s² (s² with ddof=1)."""
    n = base.size
    total_b, total_c = float(base.sum(dtype=np.float64)), float(cand.sum(dtype=np.float64))
    if n < 2:
        return total_b, total_c, (0.0, 0.0, 0.0)
    mean_b, mean_c = total_b / n, total_c / n
    bb = cc = bc = 0.0
    for start in range(0, n, _CHUNK_ELEMENTS):
        db = base[start:start + _CHUNK_ELEMENTS].astype(np.float64) - mean_b
        dc = cand[start:start + _CHUNK_ELEMENTS].astype(np.float64) - mean_c
        bb, cc, bc = bb + float(db @ db), cc + float(dc @ dc), bc + float(db @ dc)
    scale = n / (n - 1)
    return total_b, total_c, (scale * bb, scale * cc, scale * bc)


def _by_size(units: list[_Unit], exact_calls: int) -> list[tuple[int, list[_Unit]]]:
    """Units drawn exactly, grouped by size, smallest first within the budget; the rest marked normal."""
    groups: dict[int, list[_Unit]] = {}
    spent = 0
    for unit in sorted(units, key=lambda u: u.size):
        if unit.size > 1 and spent + unit.size > exact_calls:
            unit.normal = True
            continue
        spent += unit.size if unit.size > 1 else 0
        groups.setdefault(unit.size, []).append(unit)
    return sorted(groups.items())


def _resampled_totals(strata: PairedStrata, group: list[_Unit], size: int, resamples: int,
                      rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Per unit of one size, `resamples` totals n/m · Σ of m = n - 1 pairs drawn with replacement."""
    positions = np.stack([u.indices() for u in group])
    base = strata.baseline[positions].astype(np.float64).ravel()
    cand = strata.candidate[positions].astype(np.float64).ravel()
    draws = size - 1
    totals_b, totals_c = np.empty((len(group), resamples)), np.empty((len(group), resamples))
    per_unit = max(1, _CHUNK_ELEMENTS // (resamples * draws))
    per_block = max(1, _CHUNK_ELEMENTS // draws)
    for first in range(0, len(group), per_unit):
        units = slice(first, min(first + per_unit, len(group)))
        count = units.stop - units.start
        for start in range(0, resamples, per_block):
            block = slice(start, min(start + per_block, resamples))
            picked = rng.integers(0, size, size=(count, block.stop - block.start, draws))
            picked += (np.arange(units.start, units.stop) * size)[:, None, None]
            totals_b[units, block] = base[picked].sum(axis=2) * (size / draws)
            totals_c[units, block] = cand[picked].sum(axis=2) * (size / draws)
    return totals_b, totals_c


def _add_normal(draws_b: np.ndarray, draws_c: np.ndarray, normal: np.ndarray, rng: np.random.Generator):
    """Add the normal limit of the large units: per (row, run), a bivariate normal with their summed covariance."""
    if not normal.any():
        return draws_b, draws_c
    vb, vc, vbc = normal.T
    sb = np.sqrt(vb)
    slope = np.divide(vbc, sb, out=np.zeros_like(vbc), where=sb > 0)
    rest = np.sqrt(np.maximum(vc - slope ** 2, 0.0))
    first = rng.standard_normal(draws_b.shape)
    second = rng.standard_normal(draws_b.shape)
    return draws_b + sb[:, None] * first, draws_c + slope[:, None] * first + rest[:, None] * second


def _bounds(draws: np.ndarray, point: np.ndarray, widening: np.ndarray, confidence: float, *,
            runs: int = 1) -> np.ndarray:
    """Percentile interval of each row's draws, its distances from the point estimate times `widening`.

    With run pairs, z standard deviations of the draws instead: two or three run pairs give the draws two or
    three values, whose percentiles lie about one standard error from the point, not z."""
    alpha = 1.0 - confidence
    if runs > 1:
        half = _normal_quantile(1 - alpha / 2) * draws.std(axis=1, ddof=1)
        return np.stack([point - widening * half, point + widening * half])
    low, high = np.quantile(draws, [alpha / 2, 1 - alpha / 2], axis=1)
    return np.stack([point - widening * (point - low), point + widening * (high - point)])


def _run_widening(run_counts: np.ndarray, confidence: float) -> np.ndarray:
    """_widening with several run pairs: runs - 1 df whatever the calls, the ratio's and each arm's alike. Each run
    pair's total varies with its calls too, so the calls' df would count that spread twice (at 2 and 3 runs per
    arm the interval then covered 90% for 95%, tests/test_intervals.py). `run_counts`: per row, the run pairs that
    paired its calls (a row resampled over fewer than all of them takes their count's df)."""
    z = _normal_quantile(0.5 + confidence / 2)
    return np.array([_t_quantile(0.5 + confidence / 2, max(int(k), 2) - 1) / z for k in run_counts])


def _widening(units: list[_Unit], point_b: np.ndarray, point_c: np.ndarray, ratios: np.ndarray | None,
              confidence: float, *, arm: int | None = None) -> np.ndarray:
    """Per row of one run pair, t(df) / z at the confidence level: the percentile bootstrap stretched as a t
    interval is over a z interval, with df the Welch-Satterthwaite degrees of freedom of the row's variance.

    The percentile bootstrap treats the estimated spread as known; with eight calls per cell that is the
    difference between z = 1.96 and t = 2.36 (Hesterberg 2015 expands the percentile interval for the
    same reason). Components: per unit of n pairs, the variance of its linearised total (C - R·B for the
    ratio, B or C for one arm) with n - 1 df. Several run pairs: _run_widening."""
    rows, runs = point_b.shape
    z = _normal_quantile(0.5 + confidence / 2)
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
    widening = np.ones(rows)
    for row in np.flatnonzero(weighted > 0):
        widening[row] = _t_quantile(0.5 + confidence / 2, round(float(variance[row] ** 2 / weighted[row]), 2)) / z
    return widening


def _normal_quantile(p: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(p)


@functools.lru_cache(maxsize=4096)
def _t_quantile(p: float, df: float) -> float:
    """Student's t quantile for p > 1/2 and real df >= 1 (Satterthwaite df need not be whole).

    With t = √df·tan θ the density becomes k·cos^(df-1) θ on [0, π/2), k = Γ((df+1)/2) / (√π Γ(df/2)), a
    bounded integrand, so P(0 < T < t) is a smooth integral up to atan(t/√df), taken on a fine grid and
    inverted. Above 1000 df t differs from z by under 0.1%."""
    if df > 1000:
        return _normal_quantile(p)
    df = max(df, 1.0)
    theta = np.linspace(0.0, np.pi / 2, 1 << 13)
    density = np.cos(theta) ** (df - 1)
    mass = np.concatenate([[0.0], np.cumsum((density[1:] + density[:-1]) / 2) * (theta[1] - theta[0])])
    scale = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi)
    angle = float(np.interp(p - 0.5, scale * mass, theta))
    return math.sqrt(df) * math.tan(angle)


def _resample_runs(draws_b: np.ndarray, draws_c: np.ndarray, rng: np.random.Generator):
    """Top level of the hierarchical bootstrap: per resample, runs - 1 run pairs drawn with replacement
    (the same m = n - 1 rule as for calls), each with an inner resample of its own, scaled to all runs."""
    rows, runs, resamples = draws_b.shape
    picks = runs - 1
    chosen = rng.integers(0, runs, size=(resamples, picks))
    total_b, total_c = np.zeros((rows, resamples)), np.zeros((rows, resamples))
    for position in range(picks):
        inner = rng.permutation(resamples)  # a run drawn twice gets two different inner resamples
        total_b += draws_b[:, chosen[:, position], inner]
        total_c += draws_c[:, chosen[:, position], inner]
    return total_b * (runs / picks), total_c * (runs / picks)


# ---- verdicts -----------------------------------------------------------------------------------------


def verdict(estimate: Estimate, *, threshold: float = 0.02, drift: float = 0.0) -> str:
    """Classify a candidate/baseline ratio (above 1 means the candidate is slower).

    REGRESSION when the interval lies wholly above 1 + drift (a change the run-to-run drift cannot
    explain) and the ratio exceeds 1 + threshold (a change that matters); IMPROVEMENT mirrored below;
    otherwise NO_CHANGE. Like pyperf's "Not significant!" plus ``--min-speed``, a real but tiny change
    is not reported, and a large one is not reported without evidence. With drift 0 the interval need
    only exclude 1. Without an interval (single calls): NO_CHANGE if the ratio is within the threshold,
    else INSUFFICIENT_DATA, since one call cannot show significance.
    """
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"threshold must be in [0, 1), got {threshold}")
    if not 0.0 <= drift < 1.0:
        raise ValueError(f"drift must be in [0, 1), got {drift}")
    beyond_above = estimate.ratio > 1.0 + threshold
    beyond_below = estimate.ratio < 1.0 - threshold
    if estimate.low is None or estimate.high is None:
        return INSUFFICIENT_DATA if beyond_above or beyond_below else NO_CHANGE
    if beyond_above and estimate.low > 1.0 + drift:
        return REGRESSION
    if beyond_below and estimate.high < 1.0 - drift:
        return IMPROVEMENT
    return NO_CHANGE


def unpaired_share(paired_delta: float, unpaired_delta: float) -> float | None:
    """The part of a row's change carried by calls without a partner: |Δ unpaired| / (|Δ paired| + |Δ unpaired|)."""
    return share(abs(unpaired_delta), abs(paired_delta) + abs(unpaired_delta))


def row_verdict(estimate: Estimate | None, *, threshold: float, drift: float, paired_delta: float,
                unpaired_delta: float) -> tuple[str, str | None]:
    """(verdict, verdict of the paired calls alone). NOT_COMPARABLE without paired calls; DIFFERENT_WORK
    when the unpaired calls carry more of the change than the paired ones, whatever the paired calls say."""
    if estimate is None:
        return NOT_COMPARABLE, None
    paired = verdict(estimate, threshold=threshold, drift=drift)
    if (unpaired_share(paired_delta, unpaired_delta) or 0.0) > 0.5:
        return DIFFERENT_WORK, paired
    return paired, None


def same_work(per_call_means: Sequence[np.ndarray]) -> bool:
    """Whether cells cost the same per call (within SAME_WORK_SPREAD) in every arm, so that a pooled
    per-call mean describes calls that ran rather than a mix of different work."""
    for means in per_call_means:
        means = np.asarray(means, dtype=np.float64)
        if means.size > 1 and means.max() > (1.0 + SAME_WORK_SPREAD) * means.min():
            return False
    return True


# ---- ratios and shares ---------------------------------------------------------------------------------


def ratio(baseline: float | None, candidate: float | None) -> float | None:
    """candidate / baseline, or None when either is missing or the baseline is 0."""
    return candidate / baseline if baseline and candidate is not None else None


def share(part: float, whole: float) -> float | None:
    """part / whole, or None when whole is 0 (no meaningful share rather than inf or NaN)."""
    return part / whole if whole else None


def abs_shares(deltas: Sequence[float]) -> list[float | None]:
    """Each delta's part of the total absolute change, |Δ_i| / Σ|Δ|: within 0–1 and summing to 1, whatever
    the signs (a signed share reaches far beyond 100% when changes offset each other). None when
    nothing changed. Summed exactly (math.fsum), so the order of the rows does not matter."""
    total = math.fsum(abs(d) for d in deltas)
    return [share(abs(d), total) for d in deltas]


# ---- paired accuracy -----------------------------------------------------------------------------------

ACCURACY_DIFFERS = "accuracy differs"
ACCURACY_SAME = "no significant accuracy difference"
MCNEMAR = "McNemar's exact test (two-sided binomial on the prompts the arms disagree on)"


@dataclass(frozen=True)
class PairedAccuracy:
    """Two arms' per-prompt correctness on the same prompts. Only the discordant prompts (one arm right, the other
    wrong) carry evidence of a difference; McNemar's exact test asks whether they split unevenly."""

    prompts: int
    baseline_correct: int
    candidate_correct: int
    baseline_only: int  # right in the baseline, wrong in the candidate
    candidate_only: int  # right in the candidate, wrong in the baseline
    p_value: float
    alpha: float
    verdict: str  # ACCURACY_DIFFERS when p < alpha, else ACCURACY_SAME
    test: str = MCNEMAR

    @property
    def baseline_accuracy(self) -> float | None:
        return share(self.baseline_correct, self.prompts)

    @property
    def candidate_accuracy(self) -> float | None:
        return share(self.candidate_correct, self.prompts)


def mcnemar_exact(baseline_only: int, candidate_only: int) -> float:
    """Two-sided exact McNemar p-value: under no difference each discordant prompt goes either way with
    probability 1/2, so the p-value is twice the binomial(n, 1/2) tail at the smaller count, at most 1.
    Summed in integers, exact for any n."""
    if baseline_only < 0 or candidate_only < 0:
        raise ValueError("discordant counts must be non-negative")
    n = baseline_only + candidate_only
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(baseline_only, candidate_only) + 1))
    return min(1.0, 2 * tail / 2 ** n)


def paired_accuracy(baseline: Sequence[bool], candidate: Sequence[bool], *, alpha: float = 0.05) -> PairedAccuracy:
    """Per-prompt correctness of two arms, prompt i of one paired with prompt i of the other."""
    if len(baseline) != len(candidate):
        raise ValueError(f"paired answers need as many prompts per arm, got {len(baseline)} and {len(candidate)}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    pairs = [(bool(b), bool(c)) for b, c in zip(baseline, candidate)]
    b_only = sum(b and not c for b, c in pairs)
    c_only = sum(c and not b for b, c in pairs)
    p = mcnemar_exact(b_only, c_only)
    return PairedAccuracy(prompts=len(pairs), baseline_correct=sum(b for b, _ in pairs),
                          candidate_correct=sum(c for _, c in pairs), baseline_only=b_only, candidate_only=c_only,
                          p_value=p, alpha=alpha, verdict=ACCURACY_DIFFERS if p < alpha else ACCURACY_SAME)
# ---- serving intervals ---------------------------------------------------------------------------------
# TTFT, ITL and throughput of the two arms at one traffic point (docs/statistics.md, "Serving intervals").

# With one run per arm nothing measures how far a serving mean moves between two recordings of the same work, and
# an interval over one run's requests cannot see it: a change within this band is not attributed to the KV format.
# Above the largest move of one arm's serving mean between recordings of the same point in fixtures/ (23.8%: NVFP4's
# mean TTFT, vllm033-h200 offline-decode-heavy against its --repeats run's r1, 46.5 against 57.5 ms).
ASSUMED_SERVING_BAND = 0.25

PAIRED_REQUESTS = "paired requests, stratified bootstrap"
RUN_MEANS = "run pairs' means, t interval over run pairs"
MOMENTS = "each arm's per-request mean and std (unpaired), log-ratio t interval"
NO_INTERVAL = "one value per arm: no interval"


@dataclass(frozen=True)
class ArmSamples:
    """One arm's samples of a serving metric at one traffic point in one run: per request in request order (so
    that request i of one arm is the same prompt as request i of the other), or the mean, std and count of
    requests the client summarised, or a mean alone (a whole-run value such as throughput, a histogram mean)."""

    mean: float | None
    std: float | None = None
    count: int | None = None
    values: np.ndarray | None = None
    strata: np.ndarray | None = None  # per request, the stratum it was generated in (e.g. its prefix), if known

    @classmethod
    def of_values(cls, values: Sequence[float], strata: Sequence | None = None) -> "ArmSamples":
        array = np.asarray(values, dtype=np.float64)
        return cls(mean=float(array.mean()) if array.size else None,
                   std=float(array.std(ddof=1)) if array.size > 1 else None, count=int(array.size), values=array,
                   strata=None if strata is None else np.asarray(strata))


@dataclass(frozen=True)
class ServingEstimate:
    """candidate / baseline of a serving mean at one point over every run pair, its interval, and its verdict
    against the no-change band (`band`: ASSUMED_SERVING_BAND with one run per arm, 0 with repeats, whose interval
    carries the run-to-run spread). `baseline`/`candidate` are the means over runs; `improvement` always means
    better for the candidate (lower latency, higher throughput). `run_means` holds each run pair's (baseline,
    candidate) means, in repeat order: what pool_serving joins."""

    ratio: float
    low: float | None
    high: float | None
    baseline: float
    candidate: float
    method: str
    runs: int
    requests: int | None  # request pairs per run, where the interval pairs requests
    strata: int
    band: float
    band_basis: str  # drift_band.ASSUMED or drift_band.REPEATS
    verdict: str
    run_ratios: tuple[float | None, ...] = ()
    higher_is_better: bool = False
    run_means: tuple[tuple[float, float], ...] = ()


def serving_estimate(runs: Sequence[tuple[ArmSamples, ArmSamples]], *, higher_is_better: bool = False,
                     threshold: float = 0.02, confidence: float = 0.95, resamples: int = 2000,
                     seed: int = 0) -> ServingEstimate | None:
    """The two arms' serving metric over their run pairs (baseline, candidate), in repeat order. None when a run
    lacks either arm's mean.

    The interval, by what the runs recorded. Several run pairs: a t interval over the run pairs' means, the run
    pair being the unit (_run_means_interval). One run pair with per-request values of the same requests in both
    arms: request pairs resampled inside each stratum the requests were generated in (where known, else the
    point as one stratum), as estimate_rows resamples call pairs. One run pair with each arm's mean, std and
    count: a t interval of the log ratio (unpaired, since which request is which is not known). Anything else:
    none. Requests of one run share its batches and its machine, so an interval over one run's requests
    describes that run only: with one run per arm the verdict's band is ASSUMED_SERVING_BAND."""
    from kvtrace.analyzer.drift_band import ASSUMED, REPEATS

    if not runs or any(b.mean is None or c.mean is None for b, c in runs):
        return None
    count = len(runs)
    base_value = float(np.mean([b.mean for b, _ in runs]))
    cand_value = float(np.mean([c.mean for _, c in runs]))
    if not base_value:
        return None
    point, low, high, method, requests, strata_count = cand_value / base_value, None, None, NO_INTERVAL, None, 1
    (b, c) = runs[0]
    if count > 1:
        method, (low, high) = RUN_MEANS, _run_means_interval(runs, confidence)
    elif b.values is not None and c.values is not None and b.values.size == c.values.size >= 2:
        labels = b.strata if b.strata is not None and b.strata.size == b.values.size else np.zeros(b.values.size)
        _, codes = np.unique(labels, return_inverse=True)
        order = np.argsort(codes, kind="stable")
        sizes = np.bincount(codes)
        strata = PairedStrata(b.values[order], c.values[order], np.concatenate([[0], np.cumsum(sizes)]),
                              np.zeros(sizes.size, dtype=np.int64), 1)
        (estimate,) = estimate_rows(strata, [np.arange(sizes.size)], confidence=confidence, resamples=resamples,
                                    seed=seed)
        point, low, high, method = estimate.ratio, estimate.low, estimate.high, PAIRED_REQUESTS
        base_value, cand_value = float(b.values.mean()), float(c.values.mean())
        requests, strata_count = int(b.values.size), int(sizes.size)
    else:
        bounds = _moments_interval(b, c, confidence)
        if bounds is not None:
            method, (low, high) = MOMENTS, bounds
    band, basis = (ASSUMED_SERVING_BAND, ASSUMED) if count == 1 else (0.0, REPEATS)
    judged = Estimate(point, low, high, confidence, resamples, method, base_value, None, None, cand_value, None,
                      None, (), strata_count, 0)
    if higher_is_better:  # verdict() reads a ratio above 1 as worse for the candidate
        judged = Estimate(1 / point, None if high is None else 1 / high, None if low is None else 1 / low,
                          confidence, resamples, method, cand_value, None, None, base_value, None, None, (), 1, 0)
    return ServingEstimate(ratio=point, low=low, high=high, baseline=base_value, candidate=cand_value, method=method,
                           runs=count, requests=requests, strata=strata_count, band=band, band_basis=basis,
                           verdict=verdict(judged, threshold=threshold, drift=band),
                           run_ratios=tuple(ratio(b.mean, c.mean) for b, c in runs) if count > 1 else (),
                           higher_is_better=higher_is_better,
                           run_means=tuple((float(b.mean), float(c.mean)) for b, c in runs) if count > 1 else
                           ((base_value, cand_value),))


def pool_serving(estimates: Sequence[ServingEstimate], *, threshold: float = 0.02,
                 confidence: float = 0.95) -> ServingEstimate:
    """One serving metric of one point measured in several recordings (run directories of other sessions), as one
    estimate over all their run pairs: each run pair stays a unit, paired as it ran (its two arms' means; requests
    are never pooled across runs), and the interval is serving_estimate's over several run pairs, the band 0.
    Run pairs of different sessions were not interleaved, so their spread holds the drift between sessions too."""
    if len(estimates) < 2:
        raise ValueError("pooling needs two estimates or more")
    if len({e.higher_is_better for e in estimates}) > 1:
        raise ValueError("cannot pool estimates of different metrics (higher_is_better differs)")
    if any(not e.run_means for e in estimates):
        raise ValueError("every pooled estimate needs its run pairs' means")
    runs = [(ArmSamples(b), ArmSamples(c)) for e in estimates for b, c in e.run_means]
    return serving_estimate(runs, higher_is_better=estimates[0].higher_is_better, threshold=threshold,
                            confidence=confidence)


def _run_means_interval(runs: Sequence[tuple[ArmSamples, ArmSamples]], confidence: float) -> tuple[float, float]:
    """Σ c / Σ b over the run pairs' means, r · exp(± t_(runs-1) · se / r): the run pair is the unit, so the
    spread of its means carries both the requests' and the runs' variation. se is the delta method's, from the
    linearised run totals c_k - r · b_k. A bootstrap over two or three run pairs has two or three values to draw
    and covers less than it says (92% for 95% in tests/test_serving_intervals.py); the t interval does not."""
    base = np.array([b.mean for b, _ in runs], dtype=np.float64)
    cand = np.array([c.mean for _, c in runs], dtype=np.float64)
    count, point = base.size, float(cand.sum() / base.sum())
    residual = cand - point * base
    se = math.sqrt(count / (count - 1) * float(residual @ residual)) / float(base.sum())
    spread = _t_quantile(0.5 + confidence / 2, count - 1) * se / point
    return point * math.exp(-spread), point * math.exp(spread)


def _moments_interval(base: ArmSamples, cand: ArmSamples, confidence: float) -> tuple[float, float] | None:
    """mean_c / mean_b · exp(± t · se), se² = s_b² / (n_b m_b²) + s_c² / (n_c m_c²): the delta method on the log
    ratio, with Welch-Satterthwaite degrees of freedom. None without a std and two requests in each arm."""
    parts = []
    for arm in (base, cand):
        if arm.std is None or not arm.count or arm.count < 2 or not arm.mean or arm.mean <= 0:
            return None
        parts.append((arm.std ** 2 / (arm.count * arm.mean ** 2), arm.count - 1))
    variance = sum(v for v, _ in parts)
    point = cand.mean / base.mean
    if variance == 0:
        return point, point
    df = variance ** 2 / sum(v ** 2 / d for v, d in parts)
    spread = _t_quantile(0.5 + confidence / 2, round(df, 2)) * math.sqrt(variance)
    return point * math.exp(-spread), point * math.exp(spread)
