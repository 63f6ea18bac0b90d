"""The GPU timeline of vLLM's engine steps: per step, the time its kernels ran, the span from its first kernel's
start to its last kernel's end, the time inside that span with no kernel of the step running, and the host's own
time in the step's NVTX range; then the arms' identical steps paired, phase by phase.

Kernel time per call can stay nearly equal while the step takes longer: when something inside the step makes the
host wait for the GPU (a synchronizing copy, a value read back), the host stops launching ahead and every launch
after it reaches an idle GPU. On the H200 with vLLM 0.33, NVFP4's prefill steps lasted longer than FP8's by more
than their kernels did for exactly that reason (fixtures/README.md, capacity-sweep). A kernel diff cannot see it;
this table does, and the statement built from it names it as host-side time, never as a slower kernel.

A kernel belongs to the step around the launch call that made it (analyzer.ranges); kernels that overlap are
counted once (their union), so concurrent streams do not inflate the step's kernel time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from kvtrace.analyzer import align, ranges, stats

if TYPE_CHECKING:
    from kvtrace.analyzer.load import Trace
    from kvtrace.analyzer.pairing import Run

PHASES = (align.PREFILL, align.MIXED, align.DECODE)
# A step held its host when the host left the step's range less than this share of the step's GPU span before
# the last kernel ended: the last few kernels launch after any synchronization inside the step, so "at or after
# the end" would miss it (NVFP4's prefill steps on the H200 ended their range ~1 ms before their last kernel, 2% of
# the span; FP8's host left 38–90% of the span early).
HELD_SHARE = 0.1


@dataclass(frozen=True)
class StepPhase:
    """One phase's vLLM steps that both arms ran (same step name, paired in order within each run pair): means
    per step, the ratios of their sums with intervals (stats.estimate_rows, steps paired, strata by step name and
    run pair), and how many steps of each arm held the host until their GPU work was nearly done."""

    phase: str
    steps: int  # paired steps, all runs
    baseline_kernel_ns: float  # per step: the step's kernels, overlaps counted once
    candidate_kernel_ns: float
    baseline_span_ns: float  # per step: first kernel start to last kernel end
    candidate_span_ns: float
    baseline_idle_ns: float  # per step: span minus kernel time (no kernel of the step running)
    candidate_idle_ns: float
    baseline_host_ns: float  # per step: the step's NVTX range on the host
    candidate_host_ns: float
    baseline_waited_steps: int  # steps that held their host until the GPU work was nearly done (HELD_SHARE)
    candidate_waited_steps: int
    kernel_ratio: float
    kernel_low: float | None
    kernel_high: float | None
    span_ratio: float
    span_low: float | None
    span_high: float | None
    span_verdict: str


def step_table(trace: Trace) -> pl.DataFrame:
    """Per vLLM step range with at least one kernel: step (name), phase, start, host_ns, kernels, kernel_ns,
    span_ns, idle_ns and host_tail_ns (the range's end minus the last kernel's end: not negative when the host was
    still in the step as its GPU work ended), in start order."""
    return trace.memo("step_table", lambda: _step_table(trace))


def _step_table(trace: Trace) -> pl.DataFrame:
    inside = align.steps(trace)
    empty = pl.DataFrame(schema={"step": pl.Utf8, "phase": pl.Utf8, "start": pl.Int64, "host_ns": pl.Int64,
                                 "kernels": pl.UInt32, "kernel_ns": pl.Int64, "span_ns": pl.Int64,
                                 "idle_ns": pl.Int64, "host_tail_ns": pl.Int64})
    if inside.is_empty():
        return empty
    calls = trace.calls
    step_of_range = np.full(int(trace.ranges["range"].max()) + 2, ranges.NO_RANGE, dtype=np.int64)
    step_of_range[inside["range"].to_numpy()] = inside["step_range"].to_numpy()
    step = step_of_range[calls.range]  # NO_RANGE (-1) indexes the spare last entry, which stays NO_RANGE
    mine = np.flatnonzero(step != ranges.NO_RANGE)
    if not mine.size:
        return empty
    start = np.asarray(calls.start)[calls.rank[mine]]
    per_step = kernel_union(pl.DataFrame({"step_range": step[mine], "start": start,
                                          "end": start + calls.duration[mine].astype(np.int64)}))
    host = trace.ranges.select(pl.col("range").alias("step_range"), "start", pl.col("end").alias("host_end"),
                               (pl.col("end") - pl.col("start")).alias("host_ns"))
    names = inside.unique("step_range").select("step_range", "step", "phase")
    return (per_step.join(names, on="step_range").join(host, on="step_range")
            .with_columns((pl.col("span_ns") - pl.col("kernel_ns")).alias("idle_ns"),
                          (pl.col("host_end") - pl.col("last_end")).alias("host_tail_ns"))
            .sort("start").select(empty.columns))


def kernel_union(kernels: pl.DataFrame) -> pl.DataFrame:
    """Per step_range of (step_range, start, end) kernel rows: kernels, kernel_ns (the union of their intervals),
    span_ns (first start to last end) and last_end."""
    kernels = kernels.sort("step_range", "start")
    # Each kernel adds only what reaches past every earlier kernel's end in its step.
    earlier = pl.col("end").cum_max().shift(1).over("step_range")
    reach = (pl.col("end") - pl.max_horizontal("start", earlier.fill_null(pl.col("start")))).clip(lower_bound=0)
    return kernels.with_columns(reach.alias("busy")).group_by("step_range").agg(
        pl.len().alias("kernels"), pl.col("busy").sum().alias("kernel_ns"),
        (pl.col("end").max() - pl.col("start").min()).alias("span_ns"), pl.col("end").max().alias("last_end"))


def compare(baseline: list[Run], candidate: list[Run], *, threshold: float = 0.02, confidence: float = 0.95,
            seed: int = 0) -> list[StepPhase]:
    """The arms' identical steps per phase (run k with run k; within a run pair the i-th step of a name in one
    arm with the i-th of that name in the other). Empty where the traces hold no vLLM steps."""
    pairs: dict[str, list[pl.DataFrame]] = {phase: [] for phase in PHASES}
    for base, cand in zip(baseline, candidate):
        b, c = (step_table(r.trace).with_columns(pl.int_range(pl.len()).over("step").alias("occurrence"))
                for r in (base, cand))
        joined = b.join(c, on=["step", "occurrence"], suffix="_c")
        for phase in PHASES:
            found = joined.filter(pl.col("phase") == phase).sort("step", "occurrence")
            if found.height:
                pairs[phase].append(found)
    return [_phase(phase, parts, threshold, confidence, seed) for phase, parts in pairs.items() if parts]


def _phase(phase: str, parts: list[pl.DataFrame], threshold: float, confidence: float, seed: int) -> StepPhase:
    table = pl.concat(parts)
    # One stratum per step name and run pair: steps of one batch shape are alike, different shapes are not. Run
    # pairs without a paired step of the phase (their arms scheduled different steps) are left out, not zeros.
    offsets, run_of = [0], []
    for place, frame in enumerate(parts):
        for size in frame.group_by("step", maintain_order=True).len()["len"].to_list():
            offsets.append(offsets[-1] + size)
            run_of.append(place)
    runs = len(parts)
    estimates = {}
    for name in ("kernel_ns", "span_ns"):
        strata = stats.PairedStrata(table[name].to_numpy().astype(float), table[f"{name}_c"].to_numpy().astype(float),
                                    np.array(offsets), np.array(run_of), runs)
        (estimates[name],) = stats.estimate_rows(strata, [np.arange(len(run_of))], confidence=confidence, seed=seed)
    kernel, span = estimates["kernel_ns"], estimates["span_ns"]

    def mean(column: str) -> float:
        return float(table[column].mean())

    def waited(suffix: str) -> int:
        return int((table[f"host_tail_ns{suffix}"] >= -HELD_SHARE * table[f"span_ns{suffix}"]).sum())

    return StepPhase(phase, table.height, mean("kernel_ns"), mean("kernel_ns_c"), mean("span_ns"), mean("span_ns_c"),
                     mean("idle_ns"), mean("idle_ns_c"), mean("host_ns"), mean("host_ns_c"), waited(""),
                     waited("_c"), kernel.ratio, kernel.low, kernel.high, span.ratio, span.low, span.high,
                     stats.verdict(span, threshold=threshold))


def host_bound(row: StepPhase) -> bool:
    """Whether the candidate's steps of a phase lasted longer mostly by GPU time with no kernel running, with its
    host held in the step until its kernels ended more often than the baseline's: time the host added (launches
    that no longer ran ahead, a synchronization inside the step), which a kernel diff cannot show."""
    grew = row.candidate_span_ns - row.baseline_span_ns
    return (row.span_verdict == stats.REGRESSION and row.candidate_idle_ns - row.baseline_idle_ns >= grew / 2
            and row.candidate_waited_steps > row.baseline_waited_steps)
