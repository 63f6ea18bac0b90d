"""Summaries of one trace and diffs of two arms, as plain result objects that every renderer reads.

Kernels are classified once per distinct signature (name, grid, block) and joined back; the window
(analyzer.align) picks which calls count; analyzer.pairing pairs the calls of each baseline run with those
of its candidate run, cell by cell; analyzer.stats turns the pairs into ratios, intervals, drift and
verdicts. This module decides which cells make up each row, adds up times and counts (totals, the kernel
list's shares and means) and words what it found.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import polars as pl

from kvtrace.analyzer import align, drift_band, pairing
from kvtrace.analyzer.calls import sums
from kvtrace.analyzer.classify import KV_SEGMENTS, RecipeSet
from kvtrace.analyzer.findings import (arm_findings, comparability, drift_findings, rank_findings, run_findings,
                                       window_findings)
from kvtrace.analyzer.load import Trace
from kvtrace.analyzer.pairing import KERNEL, RANGE, Cells, Run, Vocabulary, segment_order
from kvtrace.analyzer.results import (UNIT_NOTE, WHOLE_PHASE, Arm, ArmStats, Diff, DiffRow, Drift, SizeBand, Summary,
                                      SummaryRow)
from kvtrace.analyzer.stats import arm_summary, bootstrap, shares, verdicts
from kvtrace.analyzer.stats.verdicts import Verdict
from kvtrace.errors import KvtraceError

# Cells with fewer call pairs than this are named in the row's note: their spread is poorly known.
FEW_CALLS = 5


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


def _release(runs) -> None:
    """Hand the pages of the traces' calls read so far back to the page cache (analyzer.calls), once what was
    read from them is held elsewhere: memory then stays at what a comparison keeps, not at the traces' size."""
    for run in runs:
        for one in (run if isinstance(run, tuple) else (run,)):
            one.trace.calls.release()


def _codes_in(cells: Cells, *columns: str) -> set:
    return set(cells.table.select(columns).unique().iter_rows())


def _per_call_means(table: pl.DataFrame, calls: str = "calls", total: str = "total_ns") -> np.ndarray:
    return (table[total].to_numpy() / table[calls].to_numpy()) if table.height else np.zeros(0)


def _per_key_means(table: pl.DataFrame) -> np.ndarray:
    """Per-call means of one run's cells merged by signature and range key: a trace's cells of names that
    differ only in an instance counter (analyzer.names) are one kind of work."""
    return _per_call_means(table.group_by("sig", "nvtx").agg(pl.col("calls", "total_ns").sum()))


def summarize(trace: Trace, recipes: RecipeSet, label: str | None = None,
              window: align.Window = align.Window()) -> Summary:
    classes = classify_signatures(trace, recipes)
    vocabulary = Vocabulary.of([trace], [classes], window.names)
    run = vocabulary.run(trace, classes, window)
    arm = _arm([run], label or default_label([trace]))

    def row(group: Cells, **extra) -> SummaryRow:
        kv, names = run.kv_dtypes_and_names(group)
        numbers = ArmStats.of(group.values(), arm.total_ns) \
            if arm_summary.same_work([_per_key_means(group.table)]) else \
            ArmStats.total(group.calls, group.total_ns, arm.total_ns)
        _release([run])
        cells = group.table.select("sig", "nvtx").unique().height
        return SummaryRow(segment=run.earliest(group, "segment"), cells=cells, stats=numbers,
                          kv_dtypes=kv, names=names, **extra)

    segments = [row(run.cells.where(pl.col("segment") == code)) for (code,) in _codes_in(run.cells, "segment")]
    families = []
    for (code,) in _codes_in(run.cells, "family"):
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
            for phase, family in _codes_in(group, "phase", "family"):
                cell = group.where((pl.col("phase") == phase) & (pl.col("family") == family))
                name = vocabulary.phases[phase] if phase < len(vocabulary.phases) else None
                key = (segment, name, run.earliest(cell, "family_label"))
                parts.setdefault(key, []).append(cell.values())
    durations = {key: np.sort(np.concatenate(values).astype(np.int64)) for key, values in sorted(
        parts.items(), key=lambda item: (segments.index(item[0][0]), _natural(item[0][1] or ""), item[0][2]))}
    _release(runs)
    return durations


# ---- diff -------------------------------------------------------------------------------------------------


@dataclass
class _Comparison:
    """Every run pair of a diff with its pairs, and the pairs of all runs as strata for analyzer.stats."""

    vocabulary: Vocabulary
    runs: list[tuple[Run, Run]]
    pairs: list[pairing.Pairs]
    strata: pl.DataFrame  # all runs' strata, with `run` and a global `stratum`
    paired: bootstrap.PairedStrata
    strata_totals: tuple[np.ndarray, np.ndarray]  # per global stratum, summed paired time per arm

    @classmethod
    def of(cls, vocabulary: Vocabulary, runs: list[tuple[Run, Run]]) -> _Comparison:
        pairs = [pairing.pair(base, cand, vocabulary) for base, cand in runs]
        tables, first = [], 0
        for index, found in enumerate(pairs):
            tables.append(found.strata.with_columns(pl.lit(index, dtype=pl.UInt32).alias("run"),
                                                    (pl.col("stratum") + first).alias("stratum")))
            first += found.strata.height
        strata = pl.concat(tables)
        offsets = np.concatenate([[0]] + [p.offsets[1:] + total for p, total in
                                          zip(pairs, np.cumsum([0] + [p.offsets[-1] for p in pairs[:-1]]))])
        if len(pairs) == 1:
            baseline, candidate = pairs[0].baseline, pairs[0].candidate
        else:  # each run pair's calls become a view of the concatenation: they are held once
            baseline = np.concatenate([p.baseline for p in pairs])
            candidate = np.concatenate([p.candidate for p in pairs])
            ends = np.cumsum([p.baseline.size for p in pairs]).tolist()
            pairs = [replace(p, baseline=baseline[end - p.baseline.size:end], candidate=candidate[end - p.baseline.size:end])
                     for p, end in zip(pairs, ends)]
        _release(runs)
        paired = bootstrap.PairedStrata(baseline, candidate, offsets.astype(np.int64), strata["run"].to_numpy(),
                                        len(runs))
        totals = tuple(sums(values, offsets) for values in (baseline, candidate))
        return cls(vocabulary, runs, pairs, strata, paired, totals)

    def release(self) -> None:
        _release(self.runs)

    def pair_count(self, members: np.ndarray) -> int:
        return int(np.diff(self.paired.offsets)[members].sum())

    def values(self, members: np.ndarray, side: int) -> np.ndarray:
        """The paired durations of some strata, one arm."""
        array = self.paired.baseline if side == 0 else self.paired.candidate
        offsets = self.paired.offsets
        return np.concatenate([array[offsets[s]:offsets[s + 1]] for s in members.tolist()])


@dataclass
class _Row:
    """What one row covers: its cells in every run and its strata, before any number is computed."""

    level: str  # "segment", "phase", "family", "family_phase"
    cells: pl.Expr
    members: np.ndarray  # global strata
    code: int  # segment, or family code
    phase: int | None = None
    rank: int | None = None  # a row of one rank's cells (traces of several GPUs); None: every rank


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
    comparison = _Comparison.of(vocabulary, list(zip(base_runs, cand_runs)))
    strata = comparison.strata

    def present(*columns: str) -> set:
        return set().union(*(_codes_in(run.cells, *columns) for run in built))

    specs = []
    for (code,) in sorted(present("segment")):
        specs.append(_Row("segment", pl.col("segment") == code,
                          strata.filter(pl.col("segment") == code)["stratum"].to_numpy(), code))
    for code, phase in sorted(k for k in present("segment", "phase") if k[1] != vocabulary.outside_phase):
        specs.append(_Row("phase", (pl.col("segment") == code) & (pl.col("phase") == phase),
                          strata.filter((pl.col("segment") == code) & (pl.col("phase") == phase))["stratum"].to_numpy(),
                          code, phase))
    for (code,) in sorted(present("family"), key=lambda k: vocabulary.families[k[0]]):
        specs.append(_Row("family", pl.col("family") == code,
                          strata.filter((pl.col("level") == KERNEL) & (pl.col("family") == code))["stratum"].to_numpy(),
                          code))
    # With several ranks, each segment and phase row again per rank: the head shows them where ranks disagree.
    for spec in [spec for spec in specs if spec.level != "family"] if vocabulary.ranks > 1 else ():
        for rank in range(vocabulary.ranks):
            in_rank = strata.filter(pl.col("rank") == rank)["stratum"].to_numpy()
            specs.append(replace(spec, cells=spec.cells & (pl.col("rank") == rank), rank=rank,
                                 members=np.intersect1d(spec.members, in_rank)))
    # The head's attention and append segments kernel by kernel per phase: an attention kernel's own time, apart
    # from the split-KV merge kernel beside it.
    head = {vocabulary.segments.index(s) for s in pairing.PHASE_SEGMENTS.values() if s in vocabulary.segments}
    for code, phase in sorted({(family, phase) for family, segment, phase in present("family", "segment", "phase")
                               if segment in head and phase != vocabulary.outside_phase}):
        kernel = (pl.col("family") == code) & (pl.col("phase") == phase)
        specs.append(_Row("family_phase", kernel,
                          strata.filter((pl.col("level") == KERNEL) & kernel)["stratum"].to_numpy(), code, phase))
    # Calls paired by range ran different kernels in the two arms: a change of code, never a drift control (a
    # changed activation kernel would otherwise widen the band that hides its own change).
    controls = strata.filter(pl.col("kv_independent") & (pl.col("level") == KERNEL))
    # One control per KV-independent kernel cell (family, launch shape, NVTX range), all run pairs together.
    cells = controls.group_by("family", "shape", "nvtx", maintain_order=True).agg("stratum").sort("family", "nvtx",
                                                                                                   "shape")
    estimates = bootstrap.estimate_rows(comparison.paired, [spec.members for spec in specs] +
                                        [controls["stratum"].to_numpy()] + [m.to_numpy() for m in cells["stratum"]],
                                        confidence=confidence, seed=seed)
    builder = _RowBuilder(comparison, base_arm, cand_arm)
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
    _rank_agreement(segments + phases, rank_rows)
    family_phases = [r for r, s in zip(rows, specs) if s.level == "family_phase"]
    for table in (segments, families, phases, family_phases):
        for row, share in zip(table, shares.abs_shares([r.total_delta_ns for r in table])):
            row.abs_delta_share = share
    segments.sort(key=lambda r: (-abs(r.total_delta_ns), segment_order(r.segment)))
    families.sort(key=lambda r: (-abs(r.total_delta_ns), segment_order(r.segment), r.family))
    phases.sort(key=lambda r: (segment_order(r.segment), _natural(r.phase)))
    family_phases.sort(key=lambda r: (segment_order(r.segment), _natural(r.phase), -r.baseline_total_ns,
                                      r.family_label))

    phase_totals = _phase_totals(comparison, base_arm, cand_arm, threshold=threshold, bands=bands,
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


class _RowBuilder:
    """Counts, statistics and words of a row from its cells and strata (the verdict comes after the drift)."""

    def __init__(self, comparison: _Comparison, base_arm: Arm, cand_arm: Arm):
        self.comparison = comparison
        self.arm_totals = (base_arm.total_ns, cand_arm.total_ns)
        self.realigned: list[str] = []  # families paired on their last calls, for the alignment finding
        self.relaunched: list[tuple[str, str, str]] = []  # (family, baseline shapes, candidate shapes): see _relaunched
        self.row_groups: list[list] = []  # per row built, its groups per arm (the verdict's note may need them again)

    def groups(self, spec: _Row, side: int) -> list[tuple[Run, Cells, pl.DataFrame]]:
        """Per run of one arm: the run, the row's cells, and those cells with what each gave to pairs."""
        out = []
        for runs, found in zip(self.comparison.runs, self.comparison.pairs):
            run = runs[side]
            group = run.cells.where(spec.cells)
            table = group.table.join(found.paired[side], on="cell", how="left").with_columns(
                pl.col("paired_calls", "paired_ns").fill_null(0))
            out.append((run, group, table))
        return out

    def row(self, spec: _Row, estimate: bootstrap.Estimate | None) -> DiffRow:
        vocabulary = self.comparison.vocabulary
        sides = [self.groups(spec, side) for side in (0, 1)]
        self.row_groups.append(sides)
        window_calls = [sum(g.calls for _, g, _ in groups) for groups in sides]
        window_ns = [sum(g.total_ns for _, g, _ in groups) for groups in sides]
        paired_ns = [sum(int(t["paired_ns"].sum()) for _, _, t in groups) for groups in sides]
        kv = [self._kv_and_names(groups) for groups in sides]
        run, group = next((r, g) for groups in sides for r, g, _ in groups if g.table.height)  # earliest: baseline
        members = spec.members
        if estimate is not None:
            totals = self.comparison.strata_totals
            sizes = np.diff(self.comparison.paired.offsets)[members]
            per_call = arm_summary.same_work([totals[side][members] / sizes for side in (0, 1)])
            intervals = ((estimate.baseline_low, estimate.baseline_high),
                         (estimate.candidate_low, estimate.candidate_high))
            arm_stats = [ArmStats.of(self.comparison.values(members, side), self.arm_totals[side], intervals[side])
                         if per_call else ArmStats.total(int(sizes.sum()), int(totals[side][members].sum()),
                                                         self.arm_totals[side], intervals[side]) for side in (0, 1)]
        else:  # nothing paired: each arm's calls in the window
            per_call = arm_summary.same_work([np.concatenate([_per_key_means(t) for _, _, t in groups])
                                              for groups in sides if any(t.height for _, _, t in groups)])
            arm_stats = [None if not window_calls[side] else
                         ArmStats.of(np.concatenate([g.values() for _, g, _ in groups]), self.arm_totals[side])
                         if per_call else ArmStats.total(window_calls[side], window_ns[side], self.arm_totals[side])
                         for side, groups in enumerate(sides)]
            self.comparison.release()
        # Calls paired by range ran different kernels in the two arms: a change of code, which no drift control
        # may absorb (a changed activation kernel would otherwise widen the band that hides its own change).
        by_range = self.comparison.strata["level"].to_numpy()[members] == RANGE if members.size else np.zeros(0, bool)
        kv_independent = not by_range.any() and all(bool(g.table["kv_independent"].all()) for groups in sides
                                                    for _, g, _ in groups if g.table.height)
        row = DiffRow(segment=run.earliest(group, "segment"), baseline=arm_stats[0], candidate=arm_stats[1],
                      baseline_calls=window_calls[0], candidate_calls=window_calls[1], baseline_total_ns=window_ns[0],
                      candidate_total_ns=window_ns[1], compared_calls=self.comparison.pair_count(members),
                      cells=int(members.size), single_call_cells=estimate.single_call_strata if estimate else 0,
                      same_work=per_call, ratio=None, ci_low=None, ci_high=None, band=None,
                      verdict=Verdict.NOT_COMPARABLE, paired_verdict=None, note=None, reason=None,
                      total_delta_ns=window_ns[1] - window_ns[0],
                      paired_delta_ns=paired_ns[1] - paired_ns[0], unpaired_share=None, abs_delta_share=None,
                      kv_independent=kv_independent, baseline_kv_dtypes=kv[0][0], candidate_kv_dtypes=kv[1][0],
                      baseline_names=kv[0][1], candidate_names=kv[1][1])
        row.unpaired_share = shares.unpaired_share(row.paired_delta_ns, row.total_delta_ns - row.paired_delta_ns) \
            if estimate is not None else None
        if spec.level in ("family", "family_phase"):
            row.family, row.family_label = vocabulary.families[spec.code], run.earliest(group, "family_label")
        if spec.level in ("phase", "family_phase"):
            row.phase = vocabulary.phases[spec.phase]
        row.rank = spec.rank
        if estimate is not None:
            row.ratio, row.ci_low, row.ci_high = estimate.ratio, estimate.low, estimate.high
            row.run_ratios, row.no_interval = estimate.run_ratios, estimate.no_interval
        row.reason = None if estimate is not None else self._reason(spec, sides, window_calls)
        if spec.level == "family" and estimate is None and all(window_calls):
            self._relaunched(row.family_label, sides)
        row.note = self._note(spec, row, sides) if estimate is not None else None
        return row

    @staticmethod
    def _kv_and_names(groups) -> tuple[tuple[str, ...], tuple[str, ...]]:
        kv, names = set(), set()
        for run, group, _ in groups:
            found = run.kv_dtypes_and_names(group)
            kv |= set(found[0])
            names |= set(found[1])
        return tuple(sorted(kv)), tuple(sorted(names))

    def _reason(self, spec: _Row, sides, window_calls: list[int]) -> str:
        if not window_calls[0] or not window_calls[1]:
            return f"only in the {'candidate' if not window_calls[0] else 'baseline'}"
        if spec.level in ("family", "family_phase"):
            vocabulary = self.comparison.vocabulary
            lists = [pairing.shape_list(next(g for _, g, _ in groups if g.table.height), vocabulary)
                     for groups in sides]
            return (f"the arms ran this family with different launch shapes or NVTX ranges ({lists[0]} vs "
                    f"{lists[1]})")
        return (f"no calls pair across arms ({window_calls[0]:,} vs {window_calls[1]:,} calls in different NVTX "
                "ranges or launch shapes)")

    def _relaunched(self, label: str, sides) -> None:
        """A family that ran in the same ranges in both arms, but with other launch shapes (grid, block), and whose
        calls paired by range: the same name compiled or launched differently (Triton recompiles a kernel with
        another grid and block between runs of the same work), so its range rows pair two kernels."""
        ranges = [{nvtx for _, group, _ in groups for nvtx in group.table["nvtx"].to_list()} for groups in sides]
        shapes = [sorted({shape for _, group, _ in groups for shape in group.table["shape"].to_list()})
                  for groups in sides]
        by_range = all(any(table["paired_level"].eq(RANGE).any() for _, _, table in groups) for groups in sides)
        if ranges[0] == ranges[1] and shapes[0] != shapes[1] and by_range:
            vocabulary = self.comparison.vocabulary
            self.relaunched.append((label, *(", ".join(map(vocabulary.shape_label, s)) for s in shapes)))

    def _note(self, spec: _Row, row: DiffRow, sides) -> str | None:
        vocabulary = self.comparison.vocabulary
        strata = self.comparison.strata.filter(pl.col("stratum").is_in(pl.Series(spec.members).implode()))
        runs = self.comparison.paired.runs
        notes = []
        truncated = strata.filter((pl.col("level") == KERNEL) &
                                  (pl.col("baseline_calls") != pl.col("candidate_calls"))).sort("run", "stratum")
        for run, rank, shape, nvtx, pairs, nb, nc in truncated.select(
                "run", "rank", "shape", "nvtx", "pairs", "baseline_calls", "candidate_calls").iter_rows():
            where = (f"r{run + 1} " if runs > 1 else "") + (f"rank {rank} " if vocabulary.ranks > 1 else "")
            notes.append(f"{where}{vocabulary.label(shape, nvtx)}: last {pairs} of {nb} vs {nc} calls")
        if notes and spec.level == "family":
            self.realigned.append(row.family_label)
        if strata.filter(pl.col("level") == RANGE).height:
            labels = [self._labels(groups) for groups in sides]
            notes.append(f"different kernels paired by NVTX range: {', '.join(labels[0])} vs {', '.join(labels[1])}")
        found = sorted(set(strata["run"].to_list())) if runs > 1 else []
        if 0 < len(found) < runs:  # the others scheduled different work (vLLM steps): their calls found no partner
            which = " and ".join(f"r{run + 1}" for run in found)
            notes.append(f"calls paired in {which} only, of {runs} run pairs: " + (
                "one run pair cannot show how runs vary, so no interval" if len(found) == 1 else
                "the interval resamples those"))
        single = row.single_call_cells
        if single > 1:
            notes.append(f"{single} single-call cells resampled together (one call has no spread of its own)")
        sizes = np.diff(self.comparison.paired.offsets)[spec.members]
        few = int(np.count_nonzero((sizes > 1) & (sizes < FEW_CALLS)))
        if few:
            notes.append(f"{few} cell{'s' if few > 1 else ''} of 2 to {FEW_CALLS - 1} call pairs: the interval rests "
                         "on few calls and widens for it (Student's t)")
        return "; ".join(notes) or None

    def _labels(self, groups) -> list[str]:
        """Family labels (with the KV dtype) of the cells one arm paired by range."""
        labels = set()
        for run, group, table in groups:
            cells = table.filter(pl.col("paired_level") == RANGE)
            if cells.height:
                sigs = run.classes.filter(pl.col("sig").is_in(cells["sig"].implode()))
                labels |= {label + (f" ({kv})" if kv else "") for label, kv in sigs.select("family_label", "kv_dtype")
                           .iter_rows()}
        return sorted(labels)

    @staticmethod
    def different_work(sides, row: DiffRow) -> str:
        """What the unpaired calls are: the families with the most unpaired time, per arm."""
        parts = []
        for groups, word in zip(sides, ("baseline", "candidate")):
            unpaired = {}
            for run, group, table in groups:
                left = table.filter(pl.col("calls") > pl.col("paired_calls"))
                labels: dict = {}  # one look-up per group, not one per unpaired signature (thousands in a sweep)
                for sig, label in run.classes.filter(pl.col("sig").is_in(left["sig"].implode())).select(
                        "sig", "family_label").iter_rows():
                    labels.setdefault(sig, label)
                for sig, calls, paired_calls, total, paired_ns in left.select(
                        "sig", "calls", "paired_calls", "total_ns", "paired_ns").iter_rows():
                    label = labels[sig]
                    count, ns = unpaired.get(label, (0, 0))
                    unpaired[label] = (count + calls - paired_calls, ns + total - paired_ns)
            top = sorted(unpaired.items(), key=lambda item: (-item[1][1], item[0]))[:3]
            if top:
                parts.append(f"{word} " + ", ".join(f"{label} ×{count:,}" for label, (count, _) in top)
                             + (", …" if len(unpaired) > 3 else ""))
        share = f"{100 * row.unpaired_share:.0f}%" if row.unpaired_share is not None else "most"
        return (f"calls without a partner carry {share} of the change ({'; '.join(parts)}); the ratio is of the "
                f"{row.compared_calls:,} paired calls alone ({row.paired_verdict})")


def _rank_agreement(rows: list[DiffRow], rank_rows: list[DiffRow]) -> None:
    """Per row of every rank, whether its ranks agree: each rank's row compared, with the row's verdict, and the
    ranks' paired calls the same work per call in each arm (arm_summary.same_work). Rows of one rank keep None."""
    by_key: dict[tuple, list[DiffRow]] = {}
    for row in rank_rows:
        by_key.setdefault((row.segment, row.phase), []).append(row)
    for row in rows:
        ranks = by_key.get((row.segment, row.phase))
        if not ranks:
            continue
        compared = all(r.ratio is not None and r.verdict == row.verdict for r in ranks)
        row.ranks_agree = compared and arm_summary.same_work(
            [np.array([getattr(r, side).total_ns / getattr(r, side).calls for r in ranks])
             for side in ("baseline", "candidate")])


def _phase_totals(comparison: _Comparison, base_arm: Arm, cand_arm: Arm, *, threshold: float,
                  bands: drift_band.Bands, confidence: float, seed: int) -> list[DiffRow]:
    """Per phase, every kernel together: the units of its work (pairing._units) pair unit for unit per range
    name (the last N, as kernel cells pair). The unit, not the kernel, is compared, since the arms may do
    the same work with different kernels (FP8's append is a cast plus a copy, NVFP4's one fused kernel)."""
    vocabulary = comparison.vocabulary
    pieces, strata = ([], []), []  # strata: (run, nvtx, pairs, units per arm)
    for run, (base, cand) in enumerate(comparison.runs):
        sides = [dict(tuple(g) for g in r.units.group_by("nvtx", maintain_order=True)
                      .agg(pl.col("total_ns")).iter_rows()) for r in (base, cand)]
        for nvtx in sorted(set(sides[0]) & set(sides[1])):
            lists = [sides[0][nvtx], sides[1][nvtx]]
            count = min(map(len, lists))
            for side in (0, 1):
                pieces[side].append(np.array(lists[side][-count:], dtype=np.int64))
            strata.append((run, nvtx, count, *map(len, lists)))
    if not strata:
        return []
    sizes = np.array([s[2] for s in strata])
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    paired = bootstrap.PairedStrata(np.concatenate(pieces[0]), np.concatenate(pieces[1]), offsets,
                                    np.array([s[0] for s in strata]), len(comparison.runs))
    phase_of = vocabulary.phase_of_nvtx[[s[1] for s in strata]]
    codes = sorted(set(phase_of.tolist()), key=lambda code: _natural(vocabulary.phases[code]))
    members = [np.flatnonzero(phase_of == code) for code in codes]
    estimates = bootstrap.estimate_rows(paired, members, confidence=confidence, seed=seed)
    rows = []
    for code, chosen, estimate in zip(codes, members, estimates):
        values = [np.concatenate([(paired.baseline, paired.candidate)[side][offsets[i]:offsets[i + 1]]
                                  for i in chosen.tolist()]) for side in (0, 1)]
        means = [np.array([(paired.baseline, paired.candidate)[side][offsets[i]:offsets[i + 1]].mean()
                           for i in chosen.tolist()]) for side in (0, 1)]
        per_call = arm_summary.same_work(means)
        intervals = ((estimate.baseline_low, estimate.baseline_high), (estimate.candidate_low, estimate.candidate_high))
        arm_totals = (base_arm.total_ns, cand_arm.total_ns)
        arm_stats = [ArmStats.of(values[side], arm_totals[side], intervals[side]) if per_call else
                     ArmStats.total(values[side].size, int(values[side].sum()), arm_totals[side], intervals[side])
                     for side in (0, 1)]
        units = [sum(strata[i][3 + side] for i in chosen.tolist()) for side in (0, 1)]
        totals = [sum(int(r[side].units.filter(pl.col("nvtx").is_in([strata[i][1] for i in chosen.tolist()]))
                          ["total_ns"].sum()) for r in comparison.runs) for side in (0, 1)]
        paired_delta = int(values[1].sum()) - int(values[0].sum())
        base_ns = np.array([paired.baseline[offsets[i]:offsets[i + 1]].sum() for i in chosen.tolist()])
        band = bands.of(means[0], base_ns)
        verdict, paired_verdict = verdicts.row_verdict(estimate, threshold=threshold, drift=band,
                                                       paired_delta=paired_delta,
                                                       unpaired_delta=totals[1] - totals[0] - paired_delta)
        left = [units[side] - values[side].size for side in (0, 1)]
        rows.append(DiffRow(
            segment=WHOLE_PHASE, baseline=arm_stats[0], candidate=arm_stats[1], baseline_calls=units[0],
            candidate_calls=units[1], baseline_total_ns=totals[0], candidate_total_ns=totals[1],
            compared_calls=int(values[0].size), cells=int(chosen.size), single_call_cells=estimate.single_call_strata,
            same_work=per_call, ratio=estimate.ratio, ci_low=estimate.low, ci_high=estimate.high, band=band,
            verdict=verdict, paired_verdict=paired_verdict,
            note="; ".join([UNIT_NOTE] + ([f"{left[0]:,} baseline and {left[1]:,} candidate units without a partner"]
                                          if any(left) else [])),
            reason=None, total_delta_ns=totals[1] - totals[0], paired_delta_ns=paired_delta,
            unpaired_share=shares.unpaired_share(paired_delta, totals[1] - totals[0] - paired_delta),
            abs_delta_share=None, run_ratios=estimate.run_ratios, phase=vocabulary.phases[code]))
    for row, share in zip(rows, shares.abs_shares([r.total_delta_ns for r in rows])):
        row.abs_delta_share = share
    return rows


def _drift(rows: list[DiffRow], pooled: bootstrap.Estimate | None, controls: pl.DataFrame, cells: pl.DataFrame,
           estimates: list[bootstrap.Estimate | None], comparison: _Comparison, threshold: float,
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


def _natural(text: str) -> list:
    """Sort key that puts ctx=8192 before ctx=32768."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def default_label(traces: list[Trace]) -> str:
    """The file name; for repeated runs the arm's name (fp8.r1, fp8.r2 → fp8), since the numbers cover them all."""
    stems = [Path(t.info.source).stem for t in traces]
    arms = {re.sub(r"\.r\d+$", "", stem) for stem in stems}
    if len(stems) == 1:
        return stems[0]
    return arms.pop() if len(arms) == 1 else f"{stems[0]} (+{len(stems) - 1} runs)"
