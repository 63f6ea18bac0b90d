"""The GPU timeline of vLLM's engine steps: per step, the time its kernels ran, the span from its first kernel's
start to its last kernel's end, the time inside that span with no kernel of the step running, and the host's own
time in the step's NVTX range; then the arms' identical steps paired, phase by phase.

Kernel time per call can stay nearly equal while the step takes longer: when something inside the step makes the
host wait for the GPU (a synchronizing copy, a value read back), the host stops launching ahead and every launch
after it reaches an idle GPU. On the H200 with vLLM 0.33, NVFP4's prefill steps lasted longer than FP8's by more
than their kernels did for exactly that reason (fixtures/README.md, capacity-sweep). A kernel diff cannot see it;
this table does, and the statement built from it names it as host-side time, never as a slower kernel.

A kernel belongs to the step around the launch call that made it (analyzer.ranges); kernels that overlap are
counted once (their union), so concurrent streams do not inflate the step's kernel time. Where the export recorded
copies and synchronizations (analyzer.host_waits), each step also counts the runtime calls inside its range, on its
thread, in which the host waited for the GPU, and a phase names the kind of wait that the candidate's steps made
and the baseline's did not: what held the host.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from kvtrace.analyzer import align, host_waits, ranges
from kvtrace.analyzer.host_waits import WaitKind
from kvtrace.analyzer.stats import bootstrap, verdicts
from kvtrace.analyzer.stats.verdicts import Verdict

if TYPE_CHECKING:
    from kvtrace.analyzer.load import Trace
    from kvtrace.analyzer.pairing import Run

PHASES = (align.PREFILL, align.MIXED, align.DECODE)
# A step held its host when the host left the step's range less than this share of the step's GPU span before
# the last kernel ended: the last few kernels launch after any synchronization inside the step, so "at or after
# the end" would miss it (NVFP4's prefill steps on the H200 ended their range ~1 ms before their last kernel, 2% of
# the span; FP8's host left 38–90% of the span early).
HELD_SHARE = 0.1
# A kind of host wait is the candidate's when it made more than this many times as many in the paired steps as the
# baseline (or the baseline none), and spent more host time in them.
FAR_MORE = 2
# What a phase's steps say of the candidate's host (StepPhase.host_reading): its steps took longer by host time
# (host_bound), or its host was held by a wait of its own while the span was not measured as longer (host_held).
LONGER_BY_HOST = "longer by host time"
HELD_BY_WAIT = "host held by a wait"


@dataclass(frozen=True)
class StepPhase:
    """One phase's vLLM steps that both arms ran (same step name, paired in order within each run pair): means
    per step, the ratios of their sums with intervals (bootstrap.estimate_rows, steps paired, strata by step name and
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
    span_verdict: Verdict
    # Per step: the runtime calls inside its range in which the host waited for the GPU, and the host's time in
    # them; None where an arm's exports did not record copies and synchronizations (analyzer.host_waits).
    baseline_host_waits: float | None = None
    candidate_host_waits: float | None = None
    baseline_host_wait_ns: float | None = None
    candidate_host_wait_ns: float | None = None
    # The kinds of wait the candidate made and the baseline did not, or far less (FAR_MORE), most added host time
    # first; empty where neither arm recorded waits or none is the candidate's.
    held_by: tuple[WaitKind, ...] = ()
    host_reading: str = ""  # LONGER_BY_HOST, HELD_BY_WAIT, or "": nothing to state


def step_table(trace: Trace) -> pl.DataFrame:
    """Per vLLM step range with at least one kernel: step (name), phase, start, host_ns, kernels, kernel_ns,
    span_ns, idle_ns, host_tail_ns (the range's end minus the last kernel's end: not negative when the host was
    still in the step as its GPU work ended), step_range, host_waits and host_wait_ns (the host waits inside the
    range and the host's time in them; null where the export recorded none), in start order."""
    return trace.memo("step_table", lambda: _step_table(trace))


def _step_table(trace: Trace) -> pl.DataFrame:
    inside = align.steps(trace)
    empty = pl.DataFrame(schema={"step": pl.Utf8, "phase": pl.Utf8, "start": pl.Int64, "host_ns": pl.Int64,
                                 "kernels": pl.UInt32, "kernel_ns": pl.Int64, "span_ns": pl.Int64,
                                 "idle_ns": pl.Int64, "host_tail_ns": pl.Int64, "step_range": pl.Int32,
                                 "host_waits": pl.UInt32, "host_wait_ns": pl.Int64})
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
    table = (per_step.join(names, on="step_range").join(host, on="step_range")
             .with_columns((pl.col("span_ns") - pl.col("kernel_ns")).alias("idle_ns"),
                           (pl.col("host_end") - pl.col("last_end")).alias("host_tail_ns")))
    waits = step_waits(trace)
    if waits is None:
        table = table.with_columns(pl.lit(None, pl.UInt32).alias("host_waits"),
                                   pl.lit(None, pl.Int64).alias("host_wait_ns"))
    else:
        per_step = waits.group_by("step_range").agg(pl.len().alias("host_waits"),
                                                    pl.col("ns").sum().alias("host_wait_ns"))
        table = table.join(per_step, on="step_range", how="left").with_columns(
            pl.col("host_waits").fill_null(0), pl.col("host_wait_ns").fill_null(0))
    return table.cast({c: empty.schema[c] for c in empty.columns}).sort("start").select(empty.columns)


def step_waits(trace: Trace, *, around: bool = False) -> pl.DataFrame | None:
    """The host waits (analyzer.host_waits) inside the trace's vLLM step ranges on each range's own thread, with
    their step_range and ns (the host's time in the call); None where the export recorded none. `around`: with the
    kernels launched before and after each (host_waits.host_waits, which reads every launch call of the trace), for
    what held the host; counts and times per step need only host_waits.waits."""
    return trace.memo(f"step_waits around={around}", lambda: _step_waits(trace, around))


def _step_waits(trace: Trace, around: bool) -> pl.DataFrame | None:
    waits = host_waits.host_waits(trace) if around else host_waits.waits(trace)
    if waits is None:
        return None
    steps = (trace.ranges.filter(pl.col("range").is_in(align.steps(trace)["step_range"].unique().to_list()))
             .select(pl.col("range").cast(pl.Int64).alias("step_range"), "global_tid",
                     pl.col("start").alias("step_start"), pl.col("end").alias("step_end")).sort("step_start"))
    # Steps do not overlap on a thread: a wait is in the last step that started before it, if that one is still open.
    return (waits.sort("start").join_asof(steps, left_on="start", right_on="step_start", by="global_tid",
                                          strategy="backward", check_sortedness=False)
            .filter(pl.col("start") < pl.col("step_end"))
            .with_columns((pl.col("end") - pl.col("start")).alias("ns")).drop("step_start", "step_end"))


def _in_steps(waits: pl.DataFrame | None, step_ranges: pl.Series) -> pl.DataFrame | None:
    """The waits of these steps alone (None stays None: not recorded)."""
    return None if waits is None else waits.filter(pl.col("step_range").is_in(step_ranges.to_list()))


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
    waits: dict[str, list[tuple[pl.DataFrame | None, pl.DataFrame | None]]] = {phase: [] for phase in PHASES}
    for base, cand in zip(baseline, candidate):
        b, c = (step_table(r.trace).with_columns(pl.int_range(pl.len()).over("step").alias("occurrence"))
                for r in (base, cand))
        joined = b.join(c, on=["step", "occurrence"], suffix="_c")
        for phase in PHASES:
            found = joined.filter(pl.col("phase") == phase).sort("step", "occurrence")
            if found.height:
                pairs[phase].append(found)
                waits[phase].append((_in_steps(step_waits(base.trace, around=True), found["step_range"]),
                                     _in_steps(step_waits(cand.trace, around=True), found["step_range_c"])))
    return [_phase(phase, parts, waits[phase], threshold, confidence, seed) for phase, parts in pairs.items()
            if parts]


def _phase(phase: str, parts: list[pl.DataFrame], waits: list[tuple[pl.DataFrame | None, pl.DataFrame | None]],
           threshold: float, confidence: float, seed: int) -> StepPhase:
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
        strata = bootstrap.PairedStrata(table[name].to_numpy().astype(float),
                                        table[f"{name}_c"].to_numpy().astype(float), np.array(offsets),
                                        np.array(run_of), runs)
        (estimates[name],) = bootstrap.estimate_rows(strata, [np.arange(len(run_of))], confidence=confidence, seed=seed)
    kernel, span = estimates["kernel_ns"], estimates["span_ns"]

    def mean(column: str) -> float:
        return float(table[column].mean())

    def waited(suffix: str) -> int:
        return int((table[f"host_tail_ns{suffix}"] >= -HELD_SHARE * table[f"span_ns{suffix}"]).sum())

    def recorded_mean(column: str) -> float | None:  # a run pair that did not record them leaves the mean unknown
        return None if table[column].null_count() else mean(column)

    base_waits, cand_waits = ([pair[side] for pair in waits] for side in (0, 1))
    recorded = all(w is not None for w in (*base_waits, *cand_waits))
    held = _held_by(base_waits, cand_waits) if recorded else ()
    row = StepPhase(phase, table.height, mean("kernel_ns"), mean("kernel_ns_c"), mean("span_ns"), mean("span_ns_c"),
                    mean("idle_ns"), mean("idle_ns_c"), mean("host_ns"), mean("host_ns_c"), waited(""),
                    waited("_c"), kernel.ratio, kernel.low, kernel.high, span.ratio, span.low, span.high,
                    verdicts.verdict(span, threshold=threshold), recorded_mean("host_waits"),
                    recorded_mean("host_waits_c"), recorded_mean("host_wait_ns"), recorded_mean("host_wait_ns_c"),
                    held)
    return replace(row, host_reading=LONGER_BY_HOST if host_bound(row) else HELD_BY_WAIT if host_held(row) else "")


def _held_by(baseline: list[pl.DataFrame], candidate: list[pl.DataFrame]) -> tuple[WaitKind, ...]:
    """The kinds of host wait in a phase's paired steps (one frame per run pair and arm, from step_waits) that the
    candidate made and the baseline did not, or far less, with the kernels launched around most of them."""
    key = list(host_waits.WAIT_KEY)
    # A step is its run pair's: step ranges number each trace's own ranges.
    cand = pl.concat([w.with_columns(pl.lit(run).alias("run")) for run, w in enumerate(candidate)])
    base = pl.concat(baseline).group_by(key).agg(pl.len().alias("baseline_calls"),
                                                 pl.col("ns").sum().alias("baseline_ns"))
    per_step = cand.group_by(*key, "run", "step_range").len().group_by(key).agg(
        pl.len().alias("steps"), pl.col("len").min().alias("per_step_low"), pl.col("len").max().alias("per_step_high"))
    around = (cand.group_by(*key, "before", "after").len().sort("len", descending=True, maintain_order=True)
              .group_by(key, maintain_order=True).first().rename({"len": "around"}))
    kinds = (cand.group_by(key).agg(pl.len().alias("candidate_calls"), pl.col("ns").sum().alias("candidate_ns"),
                                    pl.col("bytes").min().alias("bytes_low"), pl.col("bytes").max().alias("bytes_high"))
             .join(base, on=key, how="left", nulls_equal=True)
             .with_columns(pl.col("baseline_calls").fill_null(0), pl.col("baseline_ns").fill_null(0),
                           (pl.col("candidate_ns") / pl.col("candidate_calls")).alias("candidate_mean_ns"))
             .filter((pl.col("candidate_calls") > FAR_MORE * pl.col("baseline_calls"))
                     & (pl.col("candidate_ns") > pl.col("baseline_ns")))
             .join(per_step, on=key, nulls_equal=True).join(around, on=key, nulls_equal=True)
             .sort(pl.col("candidate_ns") - pl.col("baseline_ns"), descending=True, maintain_order=True))
    return tuple(WaitKind(**{name: row[name] for name in WaitKind.__dataclass_fields__})
                 for row in kinds.iter_rows(named=True))


def host_bound(row: StepPhase) -> bool:
    """Whether the candidate's steps of a phase lasted longer mostly by GPU time with no kernel running, with its
    host held in the step until its kernels ended more often than the baseline's: time the host added (launches
    that no longer ran ahead, a synchronization inside the step), which a kernel diff cannot show."""
    grew = row.candidate_span_ns - row.baseline_span_ns
    return (row.span_verdict == Verdict.REGRESSION and row.candidate_idle_ns - row.baseline_idle_ns >= grew / 2
            and row.candidate_waited_steps > row.baseline_waited_steps)


def host_held(row: StepPhase) -> bool:
    """Whether the candidate's host stayed in more of a phase's steps than the baseline's while a kind of wait that
    the baseline did not make (held_by) says what held it: facts of the traces, stated even where the steps are too
    few for the span to be measured as a change."""
    return bool(row.held_by) and row.candidate_waited_steps > row.baseline_waited_steps
