"""The result objects of a summary and a diff (rows, arms, drift, findings): what every renderer, the gate and the
JSON schema read. Below both analyzer.compare, which builds them, and analyzer.findings, which checks arms, so
that neither imports the other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvtrace import __version__
from kvtrace.analyzer.load import TraceInfo
from kvtrace.analyzer.stats import arm_summary, bootstrap, shares
from kvtrace.analyzer.stats.verdicts import Verdict


@dataclass
class Finding:
    level: str  # "ok", "warning", "error"
    check: str
    message: str


# /3: a family may have several rows, one per launch shape (and range) of the same work (SummaryRow.launch).
SUMMARY_SCHEMA = "kvtrace.summary/3"
DIFF_SCHEMA = "kvtrace.diff/4"
# The segment field of a whole-phase row: every kernel of a phase's NVTX range instances together.
WHOLE_PHASE = "whole phase"
# A summary row's range name for calls outside every NVTX range.
OUTSIDE_RANGES = "outside every NVTX range"
UNIT_NOTE = ("a call here is one unit of the phase's work: one append, prefill or decode call with the kernels "
             "launched since the previous one, or one NVTX range (a vLLM step)")


@dataclass(frozen=True)
class ArmStats:
    """One arm's calls in a row. The per-call statistics (mean … cv) are None when the row spans cells of
    different work (arm_summary.same_work): a pooled mean would describe no call that ran."""

    calls: int
    total_ns: int
    total_low_ns: float | None  # interval of the summed paired time (diff rows with pairs only)
    total_high_ns: float | None
    mean_ns: float | None
    median_ns: float | None
    p90_ns: float | None
    p99_ns: float | None
    min_ns: float | None
    max_ns: float | None
    cv: float | None
    share: float | None  # of the arm's GPU kernel time

    @classmethod
    def of(cls, durations: np.ndarray, arm_total_ns: int,
           interval: tuple[float | None, float | None] = (None, None)) -> ArmStats:
        """Calls of one kind of work: every statistic."""
        d = arm_summary.describe(durations)
        return cls(calls=d.count, total_ns=int(d.total), total_low_ns=interval[0], total_high_ns=interval[1],
                   mean_ns=d.mean, median_ns=d.median, p90_ns=d.p90, p99_ns=d.p99, min_ns=d.min, max_ns=d.max,
                   cv=d.cv, share=shares.share(d.total, arm_total_ns))

    @classmethod
    def total(cls, calls: int, total_ns: int, arm_total_ns: int,
              interval: tuple[float | None, float | None] = (None, None)) -> ArmStats:
        """Calls of different work: counts and time only."""
        return cls(calls=calls, total_ns=total_ns, total_low_ns=interval[0], total_high_ns=interval[1], mean_ns=None,
                   median_ns=None, p90_ns=None, p99_ns=None, min_ns=None, max_ns=None, cv=None,
                   share=shares.share(total_ns, arm_total_ns))


@dataclass(frozen=True)
class Arm:
    label: str
    info: TraceInfo  # of the first run
    total_ns: int  # GPU kernel time in the window, all runs
    kv_dtypes: tuple[str, ...]  # seen in attention / append kernels
    runs: int = 1
    sources: tuple[str, ...] = ()  # every run's trace, in repeat order


@dataclass
class SummaryRow:
    segment: str
    stats: ArmStats
    cells: int = 1  # cells (signature × NVTX range) the row spans
    family: str | None = None
    family_label: str | None = None
    kv_dtypes: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    # A family row's part of the family's calls: its launch shape, where the family ran several, and its range name
    # (OUTSIDE_RANGES for calls outside every range), where one launch shape cost differently per range.
    launch: str | None = None
    nvtx_range: str | None = None


@dataclass
class Summary:
    arm: Arm
    recipes: tuple[str, ...]
    segments: list[SummaryRow]
    families: list[SummaryRow]
    schema: str = SUMMARY_SCHEMA
    kvtrace_version: str = __version__

    def to_dict(self) -> dict:
        return schema_first(asdict(self))


@dataclass
class DiffRow:
    segment: str
    baseline: ArmStats | None  # of the paired calls; of all calls in the window when none paired
    candidate: ArmStats | None
    baseline_calls: int  # in the window (all runs), paired or not
    candidate_calls: int
    baseline_total_ns: int  # all calls in the window
    candidate_total_ns: int
    compared_calls: int  # call pairs (0 when not comparable)
    cells: int  # cells the pairs come from (a cell: one kernel, launch shape and NVTX range in one run)
    single_call_cells: int
    same_work: bool  # the cells cost the same per call, so per-call statistics describe calls
    ratio: float | None  # Σ candidate / Σ baseline over the pairs
    ci_low: float | None
    ci_high: float | None
    # The row's no-change band, the drift its verdict was given (None when not compared): a regression needs the
    # interval above 1 + band and the ratio above 1 + threshold (verdicts.verdict); improvement mirrored.
    band: float | None
    verdict: Verdict
    paired_verdict: Verdict | None  # the pairs' own verdict when the row is "different work"
    note: str | None  # how calls were paired when not one-to-one
    reason: str | None  # why the row is not comparable
    total_delta_ns: int  # candidate total - baseline total, all calls in the window
    paired_delta_ns: int  # the same over the paired calls only
    unpaired_share: float | None  # of the row's absolute change, the part carried by calls without a partner
    abs_delta_share: float | None  # |Δ| of this row / Σ|Δ| of its table
    run_ratios: tuple[float | None, ...] = ()  # per run pair, with repeated runs
    no_interval: str | None = None  # why a row with a ratio has no interval (bootstrap.NO_INTERVAL_WHY)
    kv_independent: bool = False  # every kernel of the row is one the KV format cannot affect
    family: str | None = None
    family_label: str | None = None
    phase: str | None = None
    baseline_kv_dtypes: tuple[str, ...] = ()
    candidate_kv_dtypes: tuple[str, ...] = ()
    baseline_names: tuple[str, ...] = ()
    candidate_names: tuple[str, ...] = ()
    rank: int | None = None  # a row of one rank (Diff.rank_rows); None: every rank
    # Of a segment or phase row of traces with several ranks: whether every rank's row has its verdict and the
    # ranks cost the same per call (then the row speaks for each rank); None with one rank.
    ranks_agree: bool | None = None

    @property
    def run_ratio_range(self) -> tuple[float, ...]:
        """The lowest and highest ratio of the run pairs that have one; the one ratio where only one has; ()."""
        found = [r for r in self.run_ratios if r is not None]
        return (min(found), max(found)) if len(found) > 1 else tuple(found)


@dataclass
class Drift:
    """How far the kernels the KV format cannot affect moved between the arms' runs."""

    ratio: float | None  # all their call pairs together; None when none paired (every band then assumed or 0)
    ci_low: float | None
    ci_high: float | None
    compared_calls: int
    segments: tuple[str, ...]
    band: float  # the widest measured band of any size class
    widest: str | None  # the kernel cell whose sure move set it
    bands: tuple[SizeBand, ...] = ()  # per size class: changes within 1 ± band are not attributed to the KV format
    outlier: str | None = None  # a KV-independent family that moved far more than its peers, left out of the bands
    outlier_move: float = 0.0  # its sure move
    uncontrolled_band: float = 0.0  # the least band of `other` cells (no control of their kind), when any paired


@dataclass(frozen=True)
class SizeBand:
    size: str  # the class of per-call time, "< 4 µs"
    band: float
    basis: str  # drift_band.MEASURED, AS_SMALLER, ASSUMED or REPEATS
    widest: str | None  # the kernel cell whose sure move set it


@dataclass
class Diff:
    baseline: Arm
    candidate: Arm
    recipes: tuple[str, ...]
    threshold: float
    confidence: float
    findings: list[Finding]
    segments: list[DiffRow]
    families: list[DiffRow]
    phases: list[DiffRow] = field(default_factory=list)  # per segment and NVTX phase, when ranges exist
    # Per kernel family and NVTX phase, for the segments of the head's attention and append rows.
    family_phases: list[DiffRow] = field(default_factory=list)
    # Per phase, every kernel together, paired range instance by range instance (_phase_totals).
    phase_totals: list[DiffRow] = field(default_factory=list)
    # With several ranks (GPUs) per trace: each segment and phase row again per rank (DiffRow.rank).
    rank_rows: list[DiffRow] = field(default_factory=list)
    drift: Drift | None = None
    runs: int = 1  # run pairs (repeated runs per arm)
    method: str = bootstrap.BOOTSTRAP
    window: list[str] = field(default_factory=list)
    headline: Any = None  # analyzer.headline.Headline: the rows that answer first, environment, commands
    verification: Any = None  # analyzer.verify.Verification, with --verify
    schema: str = DIFF_SCHEMA
    kvtrace_version: str = __version__

    @property
    def total_ratio(self) -> float | None:
        return shares.ratio(self.baseline.total_ns, self.candidate.total_ns)

    def to_dict(self) -> dict:
        data = schema_first(asdict(self))
        data["total_ratio"] = self.total_ratio
        return data


def schema_first(data: dict) -> dict:
    return {"schema": data.pop("schema"), "kvtrace_version": data.pop("kvtrace_version"), **data}
