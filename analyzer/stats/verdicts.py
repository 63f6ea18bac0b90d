"""Verdicts: whether an interval shows a change beyond the no-change band and the threshold, and a row's verdict with
its unpaired calls weighed."""

from __future__ import annotations

from kvtrace.analyzer.stats.bootstrap import Estimate
from kvtrace.analyzer.stats.shares import unpaired_share

REGRESSION = "regression"
IMPROVEMENT = "improvement"
NO_CHANGE = "no significant change"
INSUFFICIENT_DATA = "insufficient data"
NOT_COMPARABLE = "not comparable"
DIFFERENT_WORK = "different work"
# Verdicts that say the row could not be measured: a gate watching such a row cannot pass or fail on it.
UNMEASURED = frozenset({INSUFFICIENT_DATA, NOT_COMPARABLE, DIFFERENT_WORK})


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
