"""Ratios and shares: None where the whole is 0 or a value is missing, never inf or NaN."""

from __future__ import annotations

import math
from collections.abc import Sequence


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

def unpaired_share(paired_delta: float, unpaired_delta: float) -> float | None:
    """The part of a row's change carried by calls without a partner: |Δ unpaired| / (|Δ paired| + |Δ unpaired|)."""
    return share(abs(unpaired_delta), abs(paired_delta) + abs(unpaired_delta))

