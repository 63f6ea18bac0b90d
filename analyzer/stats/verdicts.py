"""Verdicts: whether an interval shows a change beyond the no-change band and the threshold, and a row's verdict with
its unpaired calls weighed."""

from __future__ import annotations

from kvtrace.analyzer.stats.bootstrap import Estimate
from kvtrace.analyzer.stats.shares import unpaired_share
from kvtrace.text import TextEnum


class Verdict(TextEnum):
    """What a comparison of two arms found."""

    REGRESSION = "regression"
    IMPROVEMENT = "improvement"
    NO_CHANGE = "no significant change"
    INSUFFICIENT_DATA = "insufficient data"
    NOT_COMPARABLE = "not comparable"
    DIFFERENT_WORK = "different work"
    TOO_FEW_RUNS = "too few runs to decide"  # a serving point measured on fewer than 3 run pairs


# Verdicts that say the row could not be measured: a gate watching such a row cannot pass or fail on it.
UNMEASURED = frozenset({Verdict.INSUFFICIENT_DATA, Verdict.NOT_COMPARABLE, Verdict.DIFFERENT_WORK, Verdict.TOO_FEW_RUNS})


def judge(ratio: float, low: float | None, high: float | None, *, threshold: float = 0.02, drift: float = 0.0,
          higher_is_better: bool = False) -> Verdict:
    """Classify a candidate/baseline ratio with its interval (low/high None: no interval).

    Lower is better by default (times: above 1 the candidate is slower). REGRESSION when the interval lies wholly
    above 1 + drift (a change the run-to-run drift cannot explain) and the ratio exceeds 1 + threshold (a change that
    matters); IMPROVEMENT mirrored below; otherwise NO_CHANGE. Like pyperf's "Not significant!" plus
    ``--min-speed``, a real but tiny change is not reported, and a large one is not reported without evidence. With
    drift 0 the interval need only exclude 1. Without an interval (single calls): NO_CHANGE if the ratio is within the
    threshold, else INSUFFICIENT_DATA, since one call cannot show significance. ``higher_is_better`` (throughput)
    judges baseline / candidate, so that IMPROVEMENT still means better for the candidate.
    """
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"threshold must be in [0, 1), got {threshold}")
    if not 0.0 <= drift < 1.0:
        raise ValueError(f"drift must be in [0, 1), got {drift}")
    if higher_is_better:
        ratio, low, high = 1 / ratio, None if high is None else 1 / high, None if low is None else 1 / low
    beyond_above = ratio > 1.0 + threshold
    beyond_below = ratio < 1.0 - threshold
    if low is None or high is None:
        return Verdict.INSUFFICIENT_DATA if beyond_above or beyond_below else Verdict.NO_CHANGE
    if beyond_above and low > 1.0 + drift:
        return Verdict.REGRESSION
    if beyond_below and high < 1.0 - drift:
        return Verdict.IMPROVEMENT
    return Verdict.NO_CHANGE


def verdict(estimate: Estimate, *, threshold: float = 0.02, drift: float = 0.0) -> Verdict:
    """judge() of an estimate's ratio and interval (anything with ratio, low and high)."""
    return judge(estimate.ratio, estimate.low, estimate.high, threshold=threshold, drift=drift)


def no_change_half_width(band: float | None, threshold: float) -> float:
    """Half-width of what a compared row's ratio must leave for a verdict: its own band (the drift its verdict was
    given; None: none), at least the threshold, since a ratio within 1 ± threshold is never a change (judge)."""
    return max(band or 0.0, threshold)


def level_of(verdict: Verdict, ratio: float | None, band: float) -> str:
    """How a statement of one comparison is marked: "warning" where the candidate measured worse or the arms are not
    comparable, "ok" only where the ratio stays within its no-change band (`band`: no_change_half_width), "info"
    for the rest: a speed-up, or a change beyond the band that nothing decided, which is neither a problem nor all
    well."""
    if ratio is None or verdict in (Verdict.REGRESSION, Verdict.DIFFERENT_WORK, Verdict.NOT_COMPARABLE):
        return "warning"
    if verdict != Verdict.TOO_FEW_RUNS and 1 - band <= ratio <= 1 + band:
        return "ok"
    return "info"


def row_verdict(estimate: Estimate | None, *, threshold: float, drift: float, paired_delta: float,
                unpaired_delta: float) -> tuple[Verdict, Verdict | None]:
    """(verdict, verdict of the paired calls alone). NOT_COMPARABLE without paired calls; DIFFERENT_WORK
    when the unpaired calls carry more of the change than the paired ones, whatever the paired calls say."""
    if estimate is None:
        return Verdict.NOT_COMPARABLE, None
    paired = verdict(estimate, threshold=threshold, drift=drift)
    if (unpaired_share(paired_delta, unpaired_delta) or 0.0) > 0.5:
        return Verdict.DIFFERENT_WORK, paired
    return paired, None
