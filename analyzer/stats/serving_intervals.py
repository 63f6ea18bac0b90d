"""Serving intervals: TTFT, ITL and throughput of the two arms at one traffic point, and one point measured in
several recordings pooled (docs/statistics.md, "Serving intervals")."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtrace.analyzer.drift_band import ASSUMED_SERVING_BAND, unmeasured_band
from kvtrace.analyzer.stats.bootstrap import PairedStrata, estimate_rows
from kvtrace.analyzer.stats.distributions import t_quantile
from kvtrace.analyzer.stats.shares import ratio
from kvtrace.analyzer.stats.verdicts import Verdict, judge
from kvtrace.manifest import DECIDING_RUN_PAIRS  # fewer run pairs give Verdict.TOO_FEW_RUNS

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
    carries the run-to-run spread), on DECIDING_RUN_PAIRS run pairs or more (else Verdict.TOO_FEW_RUNS). `baseline`/`candidate` are the means over runs; `improvement` always means
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
    verdict: Verdict
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
    describes that run only: with one run per arm the band is ASSUMED_SERVING_BAND. Fewer than DECIDING_RUN_PAIRS
    run pairs decide nothing: their verdict is Verdict.TOO_FEW_RUNS, whatever the interval."""
    if not runs or any(b.mean is None or c.mean is None for b, c in runs):
        return None
    count = len(runs)
    base_value = float(np.mean([b.mean for b, _ in runs]))
    cand_value = float(np.mean([c.mean for _, c in runs]))
    if not base_value or not cand_value:  # a ratio of 0 or infinity has no interval on the log scale
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
    band, basis = unmeasured_band(count, ASSUMED_SERVING_BAND)
    return ServingEstimate(ratio=point, low=low, high=high, baseline=base_value, candidate=cand_value, method=method,
                           runs=count, requests=requests, strata=strata_count, band=band, band_basis=basis,
                           verdict=judge(point, low, high, threshold=threshold, drift=band,
                                         higher_is_better=higher_is_better)
                           if count >= DECIDING_RUN_PAIRS else Verdict.TOO_FEW_RUNS,
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
    spread = t_quantile(0.5 + confidence / 2, count - 1) * se / point
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
    spread = t_quantile(0.5 + confidence / 2, round(df, 2)) * math.sqrt(variance)
    return point * math.exp(-spread), point * math.exp(spread)


def too_few_runs(estimate: ServingEstimate) -> str:
    """Why a point on fewer than DECIDING_RUN_PAIRS run pairs is not decided and what would decide it, in words; with
    one run per arm, whether its interval clears the band one arm's mean has moved between recordings."""
    pairs = "one run pair" if estimate.runs == 1 else f"{estimate.runs} run pairs"
    seen = ""
    if estimate.runs == 1 and estimate.low is not None:
        beyond = estimate.low > 1 + estimate.band or estimate.high < 1 - estimate.band
        seen = (f"; its interval {'clears' if beyond else 'reaches into'} the ±{100 * estimate.band:g}% assumed "
                "for one run per arm")
    return (f"too few runs to decide ({pairs}, {DECIDING_RUN_PAIRS} needed{seen}): "
            f"record --repeats {DECIDING_RUN_PAIRS}")
