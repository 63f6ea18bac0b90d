"""The size-aware no-change band (docs/statistics.md): how far the kernels the KV format cannot affect surely moved
between the runs, per size class of per-call time, and the band of a row from its cells' classes. Part of the
statistics (analyzer.stats computes the intervals it reads); pure numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike


# Per-call times (ns) that bound the size classes of the drift band: a launch-bound kernel of 1 µs moves by tens of
# nanoseconds between runs (3-12% of its time), a 200 µs GEMM by a fraction of a percent.
SIZE_CLASSES_NS = (4_000, 40_000, 400_000)
# With one run per arm, the band of a size class that no KV-independent kernel of its size or smaller measured:
# above the largest sure move of a kernel under 40 µs between two recordings of the same work in fixtures/
# (19.1%: NVFP4's 1.1 µs elementwise kernel of the 2k decode range, fi-h200-sm90 against -repeat, two H200
# machines; docs/statistics.md).
ASSUMED_BAND = 0.20
# With one run per arm nothing measures how far a serving mean moves between two recordings of the same work, and
# an interval over one run's requests cannot see it: a change within this band is not attributed to the KV format.
# Above the largest move of one arm's serving mean between recordings of the same point in fixtures/ (23.8%: NVFP4's
# mean TTFT, vllm033-h200 offline-decode-heavy against its --repeats run's r1, 46.5 against 57.5 ms).
ASSUMED_SERVING_BAND = 0.25
# The segment of kernels no recipe names (and of those kept there on purpose, such as rotary): no control is of
# their kind. vLLM's eager sampler kernels (2-40 µs, data-dependent) moved 5-19% between consecutive same-format
# runs while the graphed norms and activations of their sizes moved under 1.2% (docs/statistics.md).
UNCONTROLLED_SEGMENT = "other"
MEASURED, AS_SMALLER, ASSUMED, REPEATS = "measured", "as smaller kernels", "assumed", "from the repeats"


def unmeasured_band(runs: int, assumed: float) -> tuple[float, str]:
    """(band, basis) where no control measured the drift: `assumed` (ASSUMED_BAND for kernels, ASSUMED_SERVING_BAND
    for serving means) with one run per arm, whose drift nothing measures; 0 with several run pairs, whose intervals
    carry the run-to-run spread (REPEATS)."""
    return (assumed, ASSUMED) if runs == 1 else (0.0, REPEATS)


def size_class(per_call_ns: ArrayLike) -> np.ndarray:
    """The size class (index into size_class_label's classes) of each per-call time."""
    return np.searchsorted(SIZE_CLASSES_NS, np.asarray(per_call_ns, dtype=np.float64), side="right")


def size_class_label(first: int, last: int | None = None) -> str:
    """The per-call times of size classes first..last (one class by default): "< 4 µs", "4–40 µs", "≥ 400 µs"."""
    last = first if last is None else last
    low = f"{SIZE_CLASSES_NS[first - 1] // 1000}" if first > 0 else None
    high = f"{SIZE_CLASSES_NS[last] // 1000} µs" if last < len(SIZE_CLASSES_NS) else None
    if low is None:
        return f"< {high}" if high else "any"
    return f"{low}–{high}" if high else f"≥ {low} µs"


def sure_move(low: float | None, high: float | None) -> float:
    """How far an interval surely moved from 1: the distance of its end nearest 1, 0 when it holds 1."""
    if low is None or high is None:
        return 0.0
    return low - 1.0 if low > 1.0 else 1.0 - high if high < 1.0 else 0.0


@dataclass(frozen=True)
class Control:
    """One KV-independent kernel cell (all run pairs): its family, size class and interval."""

    family: str
    size_class: int
    low: float | None
    high: float | None


@dataclass(frozen=True)
class Bands:
    """The no-change band of each size class: ``band[c]``, how it was found (``basis[c]``: MEASURED, AS_SMALLER,
    ASSUMED or REPEATS), the control that set a measured one (``widest[c]``, an index into the controls), the
    family left out as an outlier (with its sure move), and the least band of a cell of UNCONTROLLED_SEGMENT
    (``uncontrolled``: ASSUMED_BAND with one run per arm, 0 with repeats, whose intervals carry the spread)."""

    band: tuple[float, ...]
    basis: tuple[str, ...]
    widest: tuple[int | None, ...]
    outlier: str | None = None
    outlier_move: float = 0.0
    uncontrolled: float = 0.0

    def of(self, per_call_ns: ArrayLike, weights: ArrayLike, uncontrolled: ArrayLike | None = None) -> float:
        """The band of a row: its cells' class bands, at least ``self.uncontrolled`` for the cells marked
        ``uncontrolled``, weighted by their share of the row's baseline time (a row's ratio is the time-weighted
        mean of its cells', so is its drift)."""
        weights = np.asarray(weights, dtype=np.float64)
        if weights.size == 0 or weights.sum() <= 0:
            return 0.0
        bands = np.asarray(self.band)[size_class(per_call_ns)]
        if uncontrolled is not None:
            bands = np.where(np.asarray(uncontrolled, dtype=bool), np.maximum(bands, self.uncontrolled), bands)
        return float(bands @ weights / weights.sum())


def drift_bands(controls: Sequence[Control], *, threshold: float, runs: int) -> Bands:
    """How far kernels the KV format cannot affect surely moved, per size class.

    A class's band is the largest sure move (sure_move) of its controls, so every control falls inside the
    band of its size. A class without controls takes the band of the nearest smaller class that has some
    (relative drift shrinks as a kernel grows: absolute jitter is amortised); below every measured class,
    one run per arm cannot know, and the class gets ASSUMED_BAND; with several run pairs the intervals carry
    the between-run spread themselves (REPEATS, band 0). One family cannot widen every row's band: the
    family that moved most is left out when it moved more than twice the threshold and more than twice as
    far as any of at least two other families (it gets a finding of its own). Controls measure their own kinds
    of kernel: cells of UNCONTROLLED_SEGMENT are held to ASSUMED_BAND at least with one run per arm."""
    moves = [sure_move(c.low, c.high) for c in controls]
    by_family: dict[str, float] = {}
    for control, move in zip(controls, moves):
        if control.low is not None:
            by_family[control.family] = max(by_family.get(control.family, 0.0), move)
    ranked = sorted(by_family.items(), key=lambda item: -item[1])
    outlier, outlier_move = None, 0.0
    if len(ranked) >= 3 and ranked[0][1] > 2 * max(threshold, ranked[1][1]):
        outlier, outlier_move = ranked[0]
    classes = len(SIZE_CLASSES_NS) + 1
    measured: list[tuple[float, int] | None] = [None] * classes
    for index, (control, move) in enumerate(zip(controls, moves)):
        if control.low is None or control.family == outlier:
            continue
        best = measured[control.size_class]
        if best is None or move > best[0]:
            measured[control.size_class] = (move, index)
    band, basis, widest = [], [], []
    for found in measured:
        if found is not None:
            band.append(found[0]), basis.append(MEASURED), widest.append(found[1])
        elif MEASURED in basis:
            smaller = max(i for i, b in enumerate(basis) if b == MEASURED)
            band.append(band[smaller]), basis.append(AS_SMALLER), widest.append(widest[smaller])
        else:
            assumed, how = unmeasured_band(runs, ASSUMED_BAND)
            band.append(assumed), basis.append(how), widest.append(None)
    return Bands(tuple(band), tuple(basis), tuple(widest), outlier, outlier_move,
                 unmeasured_band(runs, ASSUMED_BAND)[0])
