"""Paired, stratified estimates: the ratio of summed paired time per row with its bootstrap interval, call pairs
resampled inside their stratum, run pairs above them (docs/statistics.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtrace.analyzer.stats.arm_summary import CHUNK_ELEMENTS
from kvtrace.analyzer.stats.widening import bounds, run_widening, widening

BOOTSTRAP = "stratified paired bootstrap"
HIERARCHICAL = "hierarchical bootstrap: run pairs, then call pairs within cells"
SINGLE_CALL = "single call"
ONE_RUN_PAIR = "one run pair of several"
# Why a compared row has a ratio and no interval (Estimate.no_interval), by method.
NO_INTERVAL_WHY = {SINGLE_CALL: "single calls, which have no spread of their own",
                   ONE_RUN_PAIR: "its calls paired in one run pair only, which cannot show how runs vary"}


# Call pairs resampled index by index per comparison, smallest units first (where the bootstrap's shape
# matters most); the rest use the bootstrap's normal limit. Exact draws cost resamples x calls.
EXACT_CALLS = 1 << 13


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
    interval, which is then ± t(runs − 1) standard deviations of the log draws (bounds, run_widening). A row whose
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
            widenings = (run_widening(run_counts, confidence),) * 3
        else:
            widenings = (widening(units, point_b, point_c, ratios, confidence),
                         *(widening(units, point_b, point_c, None, confidence, arm=arm) for arm in (0, 1)))
        ratio_bounds = bounds(draws_c / draws_b, ratios, widenings[0], confidence, runs=strata.runs)
        base_bounds = bounds(draws_b, base, widenings[1], confidence, runs=strata.runs)
        cand_bounds = bounds(draws_c, cand, widenings[2], confidence, runs=strata.runs)

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
    for start in range(0, n, CHUNK_ELEMENTS):
        db = base[start:start + CHUNK_ELEMENTS].astype(np.float64) - mean_b
        dc = cand[start:start + CHUNK_ELEMENTS].astype(np.float64) - mean_c
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
    per_unit = max(1, CHUNK_ELEMENTS // (resamples * draws))
    per_block = max(1, CHUNK_ELEMENTS // draws)
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
