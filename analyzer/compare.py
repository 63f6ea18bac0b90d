"""Summaries of one trace and diffs of two arms, as plain result objects that every renderer reads.

Kernels are classified once per distinct signature (name, grid, block) and joined back; the window
(analyzer.align) picks which calls count; analyzer.pairing pairs the calls of each baseline run with those
of its candidate run, cell by cell; analyzer.stats turns the pairs into ratios, intervals, drift and
verdicts. analyzer.diff_rows decides which cells make up each row and builds the rows; this module sets the drift
band and the verdicts, sorts the rows and adds the findings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from kvtrace.analyzer import align, diff_rows, drift_band
from kvtrace.analyzer.stats import arm_summary, bootstrap, shares, verdicts
from kvtrace.analyzer.stats.verdicts import Verdict
from kvtrace.analyzer.classify import KV_SEGMENTS, RecipeSet
from kvtrace.analyzer.findings import (arm_findings, comparability, drift_findings, rank_findings, run_findings,
                                       window_findings)
from kvtrace.analyzer.load import Trace
from kvtrace.analyzer.pairing import KERNEL, Cells, Run, Vocabulary, segment_order
from kvtrace.analyzer.results import Arm, ArmStats, Diff, DiffRow, Drift, SizeBand, Summary, SummaryRow
from kvtrace.errors import KvtraceError


def classify_signatures(trace: Trace, recipes: RecipeSet) -> pl.DataFrame:
    """The trace's distinct signatures with segment, family, family_label, kv_dtype, recipe, kv_independent."""
    return recipes.classify(trace.signatures)  # a few hundred rows: cheap to redo per analysis


def _arm(runs: list[Run], label: str) -> Arm:
    kv = set()
    for run in runs:
        kv |= set(run.signatures(run.cells).filter(pl.col("segment").is_in(list(KV_SEGMENTS)))["kv_dtype"]
                  .drop_nulls())
    return Arm(label=label, info=runs[0].trace.info, total_ns=sum(run.cells.total_ns for run in runs),
               kv_dtypes=tuple(sorted(kv)), runs=len(runs), sources=tuple(run.trace.info.source for run in runs))



def summarize(trace: Trace, recipes: RecipeSet, label: str | None = None,
              window: align.Window = align.Window()) -> Summary:
    classes = classify_signatures(trace, recipes)
    vocabulary = Vocabulary.of([trace], [classes], window.names)
    run = vocabulary.run(trace, classes, window)
    arm = _arm([run], label or default_label([trace]))

    def row(group: Cells, **extra) -> SummaryRow:
        kv, names = run.kv_dtypes_and_names(group)
        same_work = arm_summary.same_work([diff_rows.per_key_means(group.table)])
        numbers = ArmStats.of(group.values(), arm.total_ns) if same_work else \
            ArmStats.total(group.calls, group.total_ns, arm.total_ns)
        diff_rows.release_runs([run])
        cells = group.table.select("sig", "nvtx").unique().height
        return SummaryRow(segment=run.earliest(group, "segment"), cells=cells, stats=numbers,
                          kv_dtypes=kv, names=names, **extra)

    segments = [row(run.cells.where(pl.col("segment") == code)) for (code,) in diff_rows.codes_in(run.cells, "segment")]
    families = []
    for (code,) in diff_rows.codes_in(run.cells, "family"):
        group = run.cells.where(pl.col("family") == code)
        families.append(row(group, family=vocabulary.families[code], family_label=run.earliest(group, "family_label")))
    segments.sort(key=lambda r: (-r.stats.total_ns, r.segment))
    families.sort(key=lambda r: (-r.stats.total_ns, r.family))
    return Summary(arm=arm, recipes=tuple(recipes.files), segments=segments, families=families)


def cell_durations(vocabulary: Vocabulary, runs: list[Run], segments: tuple[str, ...]
                   ) -> dict[tuple[str, str | None, str], np.ndarray]:
    """Per-call durations of an arm's runs (as Sides windowed them), sorted (for ECDFs), per (segment, phase,
    family label) of the given segments: one context (or vLLM step kind) and one kernel family, never pooled."""
    parts: dict[tuple[str, str | None, str], list[np.ndarray]] = {}
    for run in runs:
        for segment in segments:
            if segment not in vocabulary.segments:
                continue
            group = run.cells.where(pl.col("segment") == vocabulary.segments.index(segment))
            for phase, family in diff_rows.codes_in(group, "phase", "family"):
                cell = group.where((pl.col("phase") == phase) & (pl.col("family") == family))
                name = vocabulary.phases[phase] if phase < len(vocabulary.phases) else None
                key = (segment, name, run.earliest(cell, "family_label"))
                parts.setdefault(key, []).append(cell.values())
    durations = {key: np.sort(np.concatenate(values).astype(np.int64)) for key, values in sorted(
        parts.items(), key=lambda item: (segments.index(item[0][0]), diff_rows.natural(item[0][1] or ""), item[0][2]))}
    diff_rows.release_runs(runs)
    return durations


# ---- diff -------------------------------------------------------------------------------------------------


@dataclass
class Sides:
    """Both arms' runs over one Vocabulary, classified and windowed once: what the diff compares, and what the
    report reads per-call durations from."""

    vocabulary: Vocabulary
    baseline: list[Run]
    candidate: list[Run]
    recipes: RecipeSet
    window: align.Window
    candidate_window: align.Window

    @classmethod
    def of(cls, baseline: Trace | list[Trace], candidate: Trace | list[Trace], recipes: RecipeSet,
           window: align.Window = align.Window(), candidate_window: align.Window | None = None) -> Sides:
        """Each arm is one trace or its repeated runs in repeat order; run k of the baseline pairs with run k
        of the candidate. The candidate's window is the baseline's unless given (two windows of one trace as
        the two arms, diff --arms); both share the pairing key (window.names)."""
        base_traces = [baseline] if isinstance(baseline, Trace) else list(baseline)
        cand_traces = [candidate] if isinstance(candidate, Trace) else list(candidate)
        if not base_traces or len(base_traces) != len(cand_traces):
            raise KvtraceError(f"{len(base_traces)} baseline run(s) and {len(cand_traces)} candidate run(s): give "
                               "each arm the same number of runs, in repeat order")
        traces = base_traces + cand_traces
        classes = [classify_signatures(t, recipes) for t in traces]
        candidate_window = candidate_window or window
        vocabulary = Vocabulary.of(traces, classes, window.names)
        windows = [window] * len(base_traces) + [candidate_window] * len(cand_traces)
        built = [vocabulary.run(t, c, w) for t, c, w in zip(traces, classes, windows)]
        return cls(vocabulary, built[:len(base_traces)], built[len(base_traces):], recipes, window, candidate_window)


def diff(baseline: Trace | list[Trace], candidate: Trace | list[Trace], recipes: RecipeSet, *,
         labels: tuple[str | None, str | None] = (None, None), threshold: float = 0.02, confidence: float = 0.95,
         seed: int = 0, window: align.Window = align.Window(), candidate_window: align.Window | None = None) -> Diff:
    """Compare the baseline arm with the candidate arm (see Sides.of)."""
    return diff_sides(Sides.of(baseline, candidate, recipes, window, candidate_window), labels=labels,
                      threshold=threshold, confidence=confidence, seed=seed)


def diff_sides(sides: Sides, *, labels: tuple[str | None, str | None] = (None, None), threshold: float = 0.02,
               confidence: float = 0.95, seed: int = 0) -> Diff:
    vocabulary, base_runs, cand_runs, recipes, window = (sides.vocabulary, sides.baseline, sides.candidate,
                                                         sides.recipes, sides.window)
    built = base_runs + cand_runs
    # Arms cut from their traces by --arms are named by their ranges: one trace may hold both.
    base_arm = _arm(base_runs, labels[0] or window.arm or default_label([run.trace for run in base_runs]))
    cand_arm = _arm(cand_runs, labels[1] or sides.candidate_window.arm or
                    default_label([run.trace for run in cand_runs]))
    # Before the pairs exist: the step check holds a few hundred bytes per step, the pairs 8 per call pair.
    findings_of_runs = run_findings(list(zip(base_runs, cand_runs)), base_arm, cand_arm)
    comparison = diff_rows.Comparison.of(vocabulary, list(zip(base_runs, cand_runs)))
    strata = comparison.strata

    specs = diff_rows.row_specs(comparison)
    # Calls paired by range ran different kernels in the two arms: a change of code, never a drift control (a
    # changed activation kernel would otherwise widen the band that hides its own change).
    controls = strata.filter(pl.col("kv_independent") & (pl.col("level") == KERNEL))
    # One control per KV-independent kernel cell (family, launch shape, NVTX range), all run pairs together.
    cells = controls.group_by("family", "shape", "nvtx", maintain_order=True).agg("stratum").sort("family", "nvtx",
                                                                                                   "shape")
    estimates = bootstrap.estimate_rows(comparison.paired, [spec.members for spec in specs] +
                                    [controls["stratum"].to_numpy()] + [m.to_numpy() for m in cells["stratum"]],
                                    confidence=confidence, seed=seed)
    builder = diff_rows.RowBuilder(comparison, base_arm, cand_arm)
    rows = [builder.row(spec, estimate) for spec, estimate in zip(specs, estimates)]

    uncontrolled = strata["segment"].to_numpy() == (vocabulary.segments.index(drift_band.UNCONTROLLED_SEGMENT)
                                                    if drift_band.UNCONTROLLED_SEGMENT in vocabulary.segments else -1)
    drift, bands = _drift(rows, estimates[len(specs)], controls, cells, estimates[len(specs) + 1:], comparison,
                          threshold, uncontrolled.any())
    per_call = comparison.strata_totals[0] / np.diff(comparison.paired.offsets)
    for row, spec, estimate, row_groups in zip(rows, specs, estimates, builder.row_groups):
        unpaired_delta = row.total_delta_ns - row.paired_delta_ns
        band = bands.of(per_call[spec.members], comparison.strata_totals[0][spec.members], uncontrolled[spec.members])
        # A control row pools cells whose sure moves set the bands; pooled, its interval is narrower than theirs,
        # yet it is the drift itself, never a KV effect. Not so for the outlier family's rows, nor for rows that
        # pool families (family None) while an outlier exists: they may hold it, and it has a finding of its own.
        holds_outlier = bands.outlier is not None and row.family in (bands.outlier, None)
        if estimate is not None and row.kv_independent and not holds_outlier:
            band = max(band, drift_band.sure_move(estimate.low, estimate.high))
        row.band = band if estimate is not None else None
        row.verdict, row.paired_verdict = verdicts.row_verdict(estimate, threshold=threshold, drift=band,
                                                            paired_delta=row.paired_delta_ns,
                                                            unpaired_delta=unpaired_delta)
        left = (row.baseline_calls - row.compared_calls, row.candidate_calls - row.compared_calls)
        if row.verdict == Verdict.DIFFERENT_WORK:
            row.note = "; ".join(filter(None, [builder.different_work(row_groups, row), row.note]))
        elif estimate is not None and any(left):
            row.note = "; ".join(filter(None, [row.note, f"{left[0]:,} baseline and {left[1]:,} candidate calls "
                                                         "without a partner"]))
    segments = [r for r, s in zip(rows, specs) if s.level == "segment" and s.rank is None]
    phases = [r for r, s in zip(rows, specs) if s.level == "phase" and s.rank is None]
    families = [r for r, s in zip(rows, specs) if s.level == "family"]
    rank_rows = [r for r, s in zip(rows, specs) if s.rank is not None]
    diff_rows.rank_agreement(segments + phases, rank_rows)
    family_phases = [r for r, s in zip(rows, specs) if s.level == "family_phase"]
    for table in (segments, families, phases, family_phases):
        for row, share in zip(table, shares.abs_shares([r.total_delta_ns for r in table])):
            row.abs_delta_share = share
    segments.sort(key=lambda r: (-abs(r.total_delta_ns), segment_order(r.segment)))
    families.sort(key=lambda r: (-abs(r.total_delta_ns), segment_order(r.segment), r.family))
    phases.sort(key=lambda r: (segment_order(r.segment), diff_rows.natural(r.phase)))
    family_phases.sort(key=lambda r: (segment_order(r.segment), diff_rows.natural(r.phase), -r.baseline_total_ns,
                                      r.family_label))

    phase_totals = diff_rows.phase_totals(comparison, base_arm, cand_arm, threshold=threshold, bands=bands,
                                 confidence=confidence, seed=seed)
    findings = comparability(base_arm, cand_arm) + window_findings(window, families, builder.realigned,
                                                                  builder.relaunched)
    findings += arm_findings(list(zip(base_runs, cand_runs)), sides.candidate_window) + findings_of_runs
    findings += drift_findings(drift, threshold)
    findings += rank_findings(vocabulary, comparison.runs, base_arm, cand_arm)
    return Diff(baseline=base_arm, candidate=cand_arm, recipes=tuple(recipes.files), threshold=threshold,
                confidence=confidence, findings=findings, segments=segments, families=families, phases=phases,
                family_phases=family_phases, phase_totals=phase_totals, drift=drift, runs=len(base_runs),
                rank_rows=rank_rows,
                method=bootstrap.HIERARCHICAL if len(base_runs) > 1 else bootstrap.BOOTSTRAP,
                window=window.describe() + [part for part in sides.candidate_window.describe()
                                            if part not in window.describe()])


def _drift(rows: list[DiffRow], pooled: bootstrap.Estimate | None, controls: pl.DataFrame, cells: pl.DataFrame,
           estimates: list[bootstrap.Estimate | None], comparison: diff_rows.Comparison, threshold: float,
           uncontrolled_paired: bool) -> tuple[Drift, drift_band.Bands]:
    """Drift from the kernels the KV format cannot affect, and the band of each size class from their cells (and
    of `other` cells, when some paired). With none of them paired no class is measured: every class gets what
    drift_bands gives a class below every measured one (ASSUMED with one run per arm, REPEATS with several), and
    the drift's ratio is None."""
    vocabulary = comparison.vocabulary
    labels = {r.family: r.family_label for r in rows if r.family is not None}
    totals, sizes = comparison.strata_totals[0], np.diff(comparison.paired.offsets)
    found, names = [], []
    for family, nvtx, members, estimate in zip(cells["family"], cells["nvtx"], cells["stratum"], estimates):
        members = members.to_numpy()
        family = vocabulary.families[family]
        per_call = totals[members].sum() / sizes[members].sum()
        found.append(drift_band.Control(family, int(drift_band.size_class(per_call)), estimate.low if estimate else None,
                                   estimate.high if estimate else None))
        where = vocabulary.name(nvtx)
        names.append(labels.get(family, family) + (f" in {where}" if where else ""))
    bands = drift_band.drift_bands(found, threshold=threshold, runs=comparison.paired.runs)
    size_bands = tuple(SizeBand(drift_band.size_class_label(index), band, basis, None if widest is None else names[widest])
                       for index, (band, basis, widest) in enumerate(zip(bands.band, bands.basis, bands.widest)))
    measured = [b for b in size_bands if b.basis == drift_band.MEASURED]
    widest = max(measured, key=lambda b: b.band, default=None)
    segments = tuple(sorted({vocabulary.segments[s] for s in controls["segment"].unique().to_list()},
                            key=segment_order))
    ratio, low, high = (pooled.ratio, pooled.low, pooled.high) if pooled else (None, None, None)
    drift = Drift(ratio=ratio, ci_low=low, ci_high=high,
                  compared_calls=int(controls["pairs"].sum()), segments=segments,
                  band=widest.band if widest else 0.0, widest=widest.widest if widest and widest.band else None,
                  bands=size_bands, outlier=labels.get(bands.outlier, bands.outlier), outlier_move=bands.outlier_move,
                  uncontrolled_band=bands.uncontrolled if uncontrolled_paired else 0.0)
    return drift, bands


def default_label(traces: list[Trace]) -> str:
    """The file name; for repeated runs the arm's name (fp8.r1, fp8.r2 → fp8), since the numbers cover them all."""
    stems = [Path(t.info.source).stem for t in traces]
    arms = {re.sub(r"\.r\d+$", "", stem) for stem in stems}
    if len(stems) == 1:
        return stems[0]
    return arms.pop() if len(arms) == 1 else f"{stems[0]} (+{len(stems) - 1} runs)"
