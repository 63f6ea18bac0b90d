"""The prefill part of a point's TTFT budget split on the GPU timeline, where a trace covers the point's own traffic:
per vLLM step that prefills (prefill and mixed steps), the span from its first kernel's start to its last kernel's
end is its kernels' time (overlaps counted once, by segment) plus the time inside it with no kernel of the step
running, which is time the GPU waited on the host (analyzer/steps). The host's synchronizing calls inside the
step (analyzer/host_waits) say what held it.

Only steps both arms ran alike are compared: per step name (vLLM's count of context requests and tokens and of
decoding requests), as many as each arm ran; the arms may batch the same prompts differently, and a mean over
different batches would compare different work.

Which trace covers which point: `kvtrace capture` writes ARM.rK.pN.sqlite, a window around point N's traced pass (its
prompt shape at its concurrency, just before its timed traffic; older captures: inside its traffic); a run recorded
before that keeps one trace, ARM.rK.sqlite, whose profiler range opened at the first point's traffic and closed after
its first steps, so it covers the first point only. A point no trace covers borrows nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from kvtrace.analyzer import align, ranges, steps
from kvtrace.errors import KvtraceError

if TYPE_CHECKING:
    from kvtrace.analyzer.classify import RecipeSet
    from kvtrace.analyzer.load import Trace
    from kvtrace.analyzer.runs import ArmInput
    from kvtrace.analyzer.serving import ServingRow
    from kvtrace.manifest import RunRecord

# The segments the split names; every other kernel is "other kernels".
SPLIT_SEGMENTS = ("prefill_attention", "decode_attention", "kv_append")
SEGMENT_WORDS = {"prefill_attention": "prefill attention kernels", "decode_attention": "decode attention kernels",
                 "kv_append": "KV append kernels", "other": "other kernels", "host": "GPU waiting on the host"}
PREFILL_PHASES = (align.PREFILL, align.MIXED)
# What a point says where no trace covers its own traffic in any run pair.
NOT_TRACED = "kernels not traced at this point"
NO_PREFILL_STEPS = "its traces hold no prefill or mixed step of both arms"
NO_MATCHED_STEPS = "its traces hold no prefill or mixed step both arms ran alike (the same requests and tokens)"
MIXED_TRACE = "kernels not traced at this point alone: the run's one trace holds every point's steps together"


def point_trace(run: Path, record: RunRecord, index: int, *, first_steps: bool) -> Path | None:
    """The trace that covers point `index` of a run: its own window (NAME.pN.sqlite), else, for a run recorded with
    one trace and no per-point windows, that trace where it holds this point's traffic alone: the first point's
    when the profiler stopped after its first steps (`first_steps`: --profile-steps), the only point's otherwise."""
    own = run / f"{record.name}.p{index}.sqlite"
    if own.is_file():
        if not own.resolve().is_relative_to(run.resolve()):
            raise KvtraceError(f"{own} leads outside the run directory (a link out): keep a run's traces inside it")
        return own
    whole = run / record.sqlite if record.sqlite else None
    if whole is None or any(run.glob(f"{record.name}.p*.sqlite")) or not whole.is_file():
        return None
    return whole if index == 0 and (first_steps or len(record.points) == 1) else None


@dataclass(frozen=True)
class ArmSteps:
    """One arm's prefill-carrying steps in the traces of a point, those the other arm ran alike: means per step,
    nanoseconds."""

    steps: int
    span_ns: float
    # segment (SPLIT_SEGMENTS, "other") -> kernel time per step, overlaps counted once per segment
    kernel_ns: dict[str, float]
    host_ns: float  # per step: time inside the span with no kernel of the step running (the GPU waiting on the host)
    host_waits: float | None  # per step: synchronizing runtime calls inside the step's range; None: not recorded


@dataclass(frozen=True)
class TracedSteps:
    """Both arms' prefill-carrying steps at one point: where the candidate's step span differs, per component."""

    traces: int  # traces per arm that cover the point
    baseline: ArmSteps
    candidate: ArmSteps

    def delta_ns(self, component: str) -> float:
        """candidate − baseline per step: a segment's kernels, "host" (no kernel running) or "span"."""
        if component == "span":
            return self.candidate.span_ns - self.baseline.span_ns
        if component == "host":
            return self.candidate.host_ns - self.baseline.host_ns
        return self.candidate.kernel_ns.get(component, 0.0) - self.baseline.kernel_ns.get(component, 0.0)

    @property
    def components(self) -> tuple[str, ...]:
        """The span's components, largest move first."""
        return tuple(sorted(("host", *SPLIT_SEGMENTS, "other"), key=lambda c: -abs(self.delta_ns(c))))


def _prefill_steps(traces: list[tuple[Trace, pl.DataFrame]]) -> pl.DataFrame | None:
    """An arm's prefill-carrying steps over its traces (run order, each in start order), with each step's occurrence
    among the steps of its name (`nth`); None without any."""
    tables = [t for t in (_segment_steps(trace, classes) for trace, classes in traces) if t.height]
    if not tables:
        return None
    table = pl.concat(tables, how="diagonal_relaxed")
    return table.with_columns(pl.int_range(pl.len()).over("step").alias("nth"))


def _summary(table: pl.DataFrame) -> ArmSteps:
    kernel = {segment: float(table[segment].mean()) if segment in table.columns else 0.0
              for segment in SPLIT_SEGMENTS}
    kernel["other"] = max(float(table["kernel_ns"].mean()) - sum(kernel.values()), 0.0)
    waits = None if table["host_waits"].null_count() else float(table["host_waits"].mean())
    return ArmSteps(steps=table.height, span_ns=float(table["span_ns"].mean()), kernel_ns=kernel,
                    host_ns=float(table["idle_ns"].mean()), host_waits=waits)


def _segment_steps(trace: Trace, classes: pl.DataFrame) -> pl.DataFrame:
    """Per prefill-carrying step: span_ns, kernel_ns, idle_ns, host_waits, and a column per SPLIT_SEGMENTS with its
    kernels' time (their union)."""
    table = steps.step_table(trace).filter(pl.col("phase").is_in(list(PREFILL_PHASES)))
    if not table.height:
        return table
    calls = trace.calls
    sig = np.repeat(calls.cells["sig"].to_numpy(), np.diff(calls.offsets))
    wanted = table["step_range"].to_numpy()
    lookup = np.full(int(trace.ranges["range"].max()) + 2, ranges.NO_RANGE, dtype=np.int64)
    inside = align.steps(trace)
    lookup[inside["range"].to_numpy()] = inside["step_range"].to_numpy()
    step = lookup[calls.range]
    mine = np.flatnonzero(np.isin(step, wanted))
    segment_of = dict(classes.select("sig", "segment").unique("sig").iter_rows())
    start = np.asarray(calls.start)[calls.rank[mine]]
    kernels = pl.DataFrame({"step_range": step[mine], "start": start,
                            "end": start + calls.duration[mine].astype(np.int64),
                            "segment": [segment_of.get(int(s)) for s in sig[mine]]})
    for segment in SPLIT_SEGMENTS:
        found = kernels.filter(pl.col("segment") == segment).drop("segment")
        per_step = steps.kernel_union(found).select("step_range", pl.col("kernel_ns").alias(segment)) \
            if found.height else pl.DataFrame(schema={"step_range": pl.Int64, segment: pl.Int64})
        table = table.join(per_step.cast({"step_range": table.schema["step_range"]}), on="step_range",
                           how="left").with_columns(pl.col(segment).fill_null(0))
    return table


def traced_steps(baseline: list[tuple[Trace, pl.DataFrame]],
                 candidate: list[tuple[Trace, pl.DataFrame]]) -> TracedSteps | str:
    """The split over the prefill-carrying steps both arms ran alike in the traces that cover the point, or why there
    is none (NO_PREFILL_STEPS, NO_MATCHED_STEPS)."""
    b, c = _prefill_steps(baseline), _prefill_steps(candidate)
    if b is None or c is None:
        return NO_PREFILL_STEPS
    alike = b.select("step", "nth").join(c.select("step", "nth"), on=["step", "nth"])
    if not alike.height:
        return NO_MATCHED_STEPS
    return TracedSteps(traces=min(len(baseline), len(candidate)),
                       baseline=_summary(b.join(alike, on=["step", "nth"])),
                       candidate=_summary(c.join(alike, on=["step", "nth"])))


def cover_points(rows: list[ServingRow], base: ArmInput, cand: ArmInput,
                 opened: dict[Path, tuple[Trace, pl.DataFrame]], recipes: RecipeSet, *, nsys: str | None = None,
                 cache: bool = True) -> None:
    """Per serving row: the traces that cover its own traffic in each run pair (point_trace), their split
    (ServingRow.steps), or why there is none (ServingRow.trace_note). `opened`: the traces the report's kernel diff
    read, by resolved path, with their classified signatures (a point covered by them alone is one the diff
    covers); other traces are opened here."""
    from kvtrace.analyzer.budget import reason
    from kvtrace.analyzer.compare import classify_signatures
    from kvtrace.analyzer.load import open_trace

    def load(path: Path) -> tuple[Trace, pl.DataFrame]:
        key = path.resolve()
        if key not in opened:
            trace = open_trace(path, nsys=nsys, cache=cache)
            opened[key] = (trace, classify_signatures(trace, recipes))
        return opened[key]

    read_by_diff = set(opened)
    for row in rows:
        if not row.run_pairs:
            continue
        found: tuple[list, list] = ([], [])
        paths = set()
        for names in zip(base.runs, cand.runs):
            pair = [_trace_of(item, name, row.point) for item, name in zip((base, cand), names)]
            if None in pair:
                continue
            for side, path in enumerate(pair):
                found[side].append(load(path))
                paths.add(path.resolve())
        traced = traced_steps(*found) if found[0] else (MIXED_TRACE if _whole_trace_of_all(base) else NOT_TRACED)
        split = traced if isinstance(traced, TracedSteps) else None
        row.trace_note = None if split else traced
        row.diff_covers = bool(found[0]) and paths <= read_by_diff
        if row.reason is not None:
            row.reason = reason(row.reason.budget, split, row.trace_note)


def _trace_of(item: ArmInput, name: str, spec: str) -> Path | None:
    record = item.manifest.runs[name]
    index = next((p.get("index", place) for place, p in enumerate(record.points) if p.get("point") == spec), None)
    return point_trace(item.run, record, index, first_steps=bool(item.manifest.settings.get("profile_steps"))) \
        if isinstance(index, int) else None


def _whole_trace_of_all(item: ArmInput) -> bool:
    """A run of several points recorded in one trace with the profiler on throughout."""
    record = item.record
    return bool(record.sqlite) and len(record.points) > 1 and not item.manifest.settings.get("profile_steps") \
        and not any(item.run.glob(f"{record.name}.p*.sqlite"))
