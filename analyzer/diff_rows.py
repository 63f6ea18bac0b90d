"""The rows of a diff: which cells and strata make up each row (segment, phase, family, family per phase, per rank),
and each row's counts, statistics and words from its cells and its estimate. Every DiffRow is made by `new_row`.

analyzer.compare pairs the runs (Comparison), asks analyzer.stats for every row's estimate at once, sets the
drift band and the verdicts, and sorts the rows into a Diff.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
import polars as pl

from kvtrace.analyzer import drift_band, pairing
from kvtrace.analyzer.stats import arm_summary, bootstrap, shares, verdicts
from kvtrace.analyzer.stats.verdicts import Verdict
from kvtrace.analyzer.calls import sums
from kvtrace.analyzer.pairing import KERNEL, RANGE, Cells, Run, Vocabulary
from kvtrace.analyzer.results import UNIT_NOTE, WHOLE_PHASE, Arm, ArmStats, DiffRow

# Cells with fewer call pairs than this are named in the row's note: their spread is poorly known.
FEW_CALLS = 5


def release_runs(runs) -> None:
    """Hand the pages of the traces' calls read so far back to the page cache (analyzer.calls), once what was
    read from them is held elsewhere: memory then stays at what a comparison keeps, not at the traces' size."""
    for run in runs:
        for one in (run if isinstance(run, tuple) else (run,)):
            one.trace.calls.release()


def codes_in(cells: Cells, *columns: str) -> set:
    return set(cells.table.select(columns).unique().iter_rows())


def per_key_means(cells) -> np.ndarray:
    """Per-call means of one run's cells merged by signature and range key: a trace's cells of names that
    differ only in an instance counter (analyzer.names) are one kind of work. `cells`: a cells table, or its
    columns sig, nvtx, calls and total_ns by name; the means come in no particular order."""
    sig, nvtx, calls, total = (np.asarray(cells[name]) for name in ("sig", "nvtx", "calls", "total_ns"))
    if not sig.size:
        return np.zeros(0)
    _, key = np.unique((sig.astype(np.int64) << 32) | nvtx.astype(np.int64), return_inverse=True)
    # Sums of whole nanoseconds and calls, exact in float64 below 2**53 (104 days).
    return np.bincount(key, weights=total) / np.bincount(key, weights=calls)


@dataclass
class Comparison:
    """Every run pair of a diff with its pairs, and the pairs of all runs as strata for analyzer.stats."""

    vocabulary: Vocabulary
    runs: list[tuple[Run, Run]]
    pairs: list[pairing.Pairs]
    strata: pl.DataFrame  # all runs' strata, with `run` and a global `stratum`
    paired: bootstrap.PairedStrata
    strata_totals: tuple[np.ndarray, np.ndarray]  # per global stratum, summed paired time per arm

    @classmethod
    def of(cls, vocabulary: Vocabulary, runs: list[tuple[Run, Run]]) -> Comparison:
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
        release_runs(runs)
        paired = bootstrap.PairedStrata(baseline, candidate, offsets.astype(np.int64), strata["run"].to_numpy(),
                                    len(runs))
        totals = tuple(sums(values, offsets) for values in (baseline, candidate))
        return cls(vocabulary, runs, pairs, strata, paired, totals)

    def release(self) -> None:
        release_runs(self.runs)

    def pair_count(self, members: np.ndarray) -> int:
        return int(np.diff(self.paired.offsets)[members].sum())

    def values(self, members: np.ndarray, side: int) -> np.ndarray:
        """The paired durations of some strata, one arm."""
        array = self.paired.baseline if side == 0 else self.paired.candidate
        offsets = self.paired.offsets
        return np.concatenate([array[offsets[s]:offsets[s + 1]] for s in members.tolist()])


@dataclass
class RowSpec:
    """What one row covers: its cells in every run and its strata, before any number is computed."""

    level: str  # "segment", "phase", "family", "family_phase"
    keys: tuple[tuple[str, int], ...]  # (column, code) pairs that the row's cells all have
    members: np.ndarray  # global strata
    code: int  # segment, or family code
    phase: int | None = None
    rank: int | None = None  # a row of one rank's cells (traces of several GPUs); None: every rank


def _matching(columns: dict[str, np.ndarray], keys: tuple[tuple[str, int], ...]) -> np.ndarray:
    """Which rows of a table (given as its columns) have every (column, code) of `keys`."""
    chosen = np.ones(next(iter(columns.values())).size, dtype=bool)
    for column, code in keys:
        chosen &= columns[column] == code
    return chosen


def row_specs(comparison: Comparison) -> list[RowSpec]:
    """What each row of the diff covers, in the order estimate_rows gets them: segments, phases, families, then
    (several ranks) segments and phases per rank, then the head's attention and append families per phase."""
    vocabulary, strata = comparison.vocabulary, comparison.strata
    built = [run for pair in comparison.runs for run in pair]
    # The strata's columns as arrays (a range stratum has no family: -1 matches no code); stratum s is row s.
    columns = {name: strata[name].cast(pl.Int64).fill_null(-1).to_numpy()
               for name in ("segment", "phase", "family", "rank")}
    kernel = strata["level"].to_numpy() == KERNEL

    def present(*columns: str) -> set:
        return set().union(*(codes_in(run.cells, *columns) for run in built))

    def spec(level: str, keys: tuple, code: int, phase: int | None = None, *, kernels: bool = False) -> RowSpec:
        chosen = _matching(columns, keys) & (kernel if kernels else True)
        return RowSpec(level, keys, np.flatnonzero(chosen).astype(np.uint32), code, phase)

    specs = [spec("segment", (("segment", code),), code) for (code,) in sorted(present("segment"))]
    specs += [spec("phase", (("segment", code), ("phase", phase)), code, phase)
              for code, phase in sorted(k for k in present("segment", "phase") if k[1] != vocabulary.outside_phase)]
    specs += [spec("family", (("family", code),), code, kernels=True)
              for (code,) in sorted(present("family"), key=lambda k: vocabulary.families[k[0]])]
    # With several ranks, each segment and phase row again per rank: the head shows them where ranks disagree.
    for one in [one for one in specs if one.level != "family"] if vocabulary.ranks > 1 else ():
        for rank in range(vocabulary.ranks):
            in_rank = np.flatnonzero(columns["rank"] == rank).astype(np.uint32)
            specs.append(replace(one, keys=(*one.keys, ("rank", rank)), rank=rank,
                                 members=np.intersect1d(one.members, in_rank)))
    # The head's attention and append segments kernel by kernel per phase: an attention kernel's own time, apart
    # from the split-KV merge kernel beside it.
    head = {vocabulary.segments.index(s) for s in pairing.PHASE_SEGMENTS.values() if s in vocabulary.segments}
    specs += [spec("family_phase", (("family", code), ("phase", phase)), code, phase, kernels=True)
              for code, phase in sorted({(family, phase) for family, segment, phase
                                         in present("family", "segment", "phase")
                                         if segment in head and phase != vocabulary.outside_phase})]
    return specs


@dataclass(frozen=True, eq=False)
class Group:
    """A row's cells in one run of one arm: `cells.table` has what each cell gave to pairs beside it (paired_calls,
    paired_ns, paired_level; see pairing.Pairs), and `side` the arrays behind its sums."""

    run: Run
    side: _RunSide
    rows: np.ndarray  # rows of side.table

    @cached_property
    def cells(self) -> Cells:
        return replace(self.run.cells, table=self.side.table[self.rows])

    @property
    def height(self) -> int:
        return self.rows.size

    @property
    def columns(self) -> dict[str, np.ndarray]:
        return {name: values[self.rows] for name, values in self.side.columns.items()}

    def sum(self, column: str) -> int:
        return int(self.side.columns[column][self.rows].sum())

    def sigs(self) -> np.ndarray:
        return self.side.columns["sig"][self.rows]

    def earliest(self, column: str) -> str:
        """A classification column (segment, family_label) of the group's earliest call."""
        return self.run.class_of(int(self.sigs()[self.side.columns["first"][self.rows].argmin()]))[column]


@dataclass(frozen=True, eq=False)
class _RunSide:
    """One run of one arm, its cells joined once with what each gave to pairs, and those columns as arrays: a row's
    group of cells is then an index into them."""

    table: pl.DataFrame
    columns: dict[str, np.ndarray]

    @classmethod
    def of(cls, run: Run, paired: pl.DataFrame) -> _RunSide:
        table = run.cells.table.join(paired, on="cell", how="left", maintain_order="left").with_columns(
            pl.col("paired_calls", "paired_ns").fill_null(0))
        return cls(table, {name: table[name].to_numpy() for name in (
            "segment", "phase", "family", "rank", "sig", "nvtx", "first", "calls", "total_ns", "paired_calls",
            "paired_ns", "paired_level", "kv_independent")})


class RowBuilder:
    """Counts, statistics and words of a row from its cells and strata (the verdict comes after the drift).

    A diff has thousands of rows: each row's cells and strata are picked by index from arrays made once here, not
    by a polars query per row and run."""

    def __init__(self, comparison: Comparison, base_arm: Arm, cand_arm: Arm):
        self.comparison = comparison
        self.arm_totals = (base_arm.total_ns, cand_arm.total_ns)
        self.realigned: list[str] = []  # families paired on their last calls, for the alignment finding
        self.relaunched: list[tuple[str, str, str]] = []  # (family, baseline shapes, candidate shapes): see _relaunched
        self.row_groups: list[list[list[Group]]] = []  # per row built, its groups per arm (the verdict's note)
        self._sides = [[_RunSide.of(runs[side], found.paired[side])
                        for runs, found in zip(comparison.runs, comparison.pairs)] for side in (0, 1)]
        strata = comparison.strata  # stratum s is row s, and the run pairs follow each other in it
        self._strata = {name: strata[name].cast(pl.Int64).fill_null(-1).to_numpy() for name in (
            "run", "rank", "shape", "nvtx", "pairs", "baseline_calls", "candidate_calls")}
        level = strata["level"].to_numpy()
        self._kernel, self._range = level == KERNEL, level == RANGE

    def groups(self, spec: RowSpec, side: int) -> list[Group]:
        """Per run of one arm, the row's cells."""
        return [Group(runs[side], one, np.flatnonzero(_matching(one.columns, spec.keys)))
                for runs, one in zip(self.comparison.runs, self._sides[side])]

    def row(self, spec: RowSpec, estimate: bootstrap.Estimate | None) -> DiffRow:
        vocabulary = self.comparison.vocabulary
        sides = [self.groups(spec, side) for side in (0, 1)]
        self.row_groups.append(sides)
        window_calls = [sum(g.sum("calls") for g in groups) for groups in sides]
        window_ns = [sum(g.sum("total_ns") for g in groups) for groups in sides]
        paired_ns = [sum(g.sum("paired_ns") for g in groups) for groups in sides]
        kv = [self._kv_and_names(groups) for groups in sides]
        first = next(g for groups in sides for g in groups if g.height)  # earliest: baseline
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
            per_call = arm_summary.same_work([np.concatenate([per_key_means(g.columns) for g in groups])
                                              for groups in sides if any(g.height for g in groups)])
            arm_stats = [None if not window_calls[side] else
                         ArmStats.of(np.concatenate([g.cells.values() for g in groups]), self.arm_totals[side])
                         if per_call else ArmStats.total(window_calls[side], window_ns[side], self.arm_totals[side])
                         for side, groups in enumerate(sides)]
            self.comparison.release()
        # Calls paired by range ran different kernels in the two arms: a change of code, which no drift control
        # may absorb (a changed activation kernel would otherwise widen the band that hides its own change).
        kv_independent = not self._range[members].any() and all(
            bool(g.side.columns["kv_independent"][g.rows].all()) for groups in sides for g in groups if g.height)
        row = new_row(estimate, segment=first.earliest("segment"), arm_stats=arm_stats, calls=window_calls,
                      totals=window_ns, paired_delta_ns=paired_ns[1] - paired_ns[0],
                      compared_calls=self.comparison.pair_count(members), cells=int(members.size), same_work=per_call,
                      kv_independent=kv_independent, baseline_kv_dtypes=kv[0][0], candidate_kv_dtypes=kv[1][0],
                      baseline_names=kv[0][1], candidate_names=kv[1][1])
        if spec.level in ("family", "family_phase"):
            row.family, row.family_label = vocabulary.families[spec.code], first.earliest("family_label")
        if spec.level in ("phase", "family_phase"):
            row.phase = vocabulary.phases[spec.phase]
        row.rank = spec.rank
        row.reason = None if estimate is not None else self._reason(spec, sides, window_calls)
        if spec.level == "family" and estimate is None and all(window_calls):
            self._relaunched(row.family_label, sides)
        row.note = self._note(spec, row, sides) if estimate is not None else None
        return row

    @staticmethod
    def _kv_and_names(groups: list[Group]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        kv, names = set(), set()
        for g in groups:
            found = g.run.kv_dtypes_and_names_of(g.sigs().tolist())
            kv |= set(found[0])
            names |= set(found[1])
        return tuple(sorted(kv)), tuple(sorted(names))

    def _reason(self, spec: RowSpec, sides: list[list[Group]], window_calls: list[int]) -> str:
        if not window_calls[0] or not window_calls[1]:
            return f"only in the {'candidate' if not window_calls[0] else 'baseline'}"
        if spec.level in ("family", "family_phase"):
            vocabulary = self.comparison.vocabulary
            lists = [pairing.shape_list(next(g.cells for g in groups if g.height), vocabulary) for groups in sides]
            return (f"the arms ran this family with different launch shapes or NVTX ranges ({lists[0]} vs "
                    f"{lists[1]})")
        return (f"no calls pair across arms ({window_calls[0]:,} vs {window_calls[1]:,} calls in different NVTX "
                "ranges or launch shapes)")

    def _relaunched(self, label: str, sides: list[list[Group]]) -> None:
        """A family that ran in the same ranges in both arms, but with other launch shapes (grid, block), and whose
        calls paired by range: the same name compiled or launched differently (Triton recompiles a kernel with
        another grid and block between runs of the same work), so its range rows pair two kernels."""
        tables = [[g.cells.table for g in groups] for groups in sides]
        ranges = [{nvtx for table in one for nvtx in table["nvtx"].to_list()} for one in tables]
        shapes = [sorted({shape for table in one for shape in table["shape"].to_list()}) for one in tables]
        by_range = all(any(table["paired_level"].eq(RANGE).any() for table in one) for one in tables)
        if ranges[0] == ranges[1] and shapes[0] != shapes[1] and by_range:
            vocabulary = self.comparison.vocabulary
            self.relaunched.append((label, *(", ".join(map(vocabulary.shape_label, s)) for s in shapes)))

    def _note(self, spec: RowSpec, row: DiffRow, sides: list[list[Group]]) -> str | None:
        vocabulary = self.comparison.vocabulary
        members, strata = spec.members, self._strata
        runs = self.comparison.paired.runs
        notes = []
        # members ascend, so these are in run order, then stratum order
        truncated = members[self._kernel[members] &
                            (strata["baseline_calls"][members] != strata["candidate_calls"][members])]
        for stratum in truncated.tolist():
            run, rank, shape, nvtx, pairs, nb, nc = (int(strata[name][stratum]) for name in (
                "run", "rank", "shape", "nvtx", "pairs", "baseline_calls", "candidate_calls"))
            where = (f"r{run + 1} " if runs > 1 else "") + (f"rank {rank} " if vocabulary.ranks > 1 else "")
            notes.append(f"{where}{vocabulary.label(shape, nvtx)}: last {pairs} of {nb} vs {nc} calls")
        if notes and spec.level == "family":
            self.realigned.append(row.family_label)
        if self._range[members].any():
            labels = [self._labels(groups) for groups in sides]
            notes.append(f"different kernels paired by NVTX range: {', '.join(labels[0])} vs {', '.join(labels[1])}")
        found = np.unique(strata["run"][members]).tolist() if runs > 1 else []
        if 0 < len(found) < runs:  # the others scheduled different work (vLLM steps): their calls found no partner
            which = " and ".join(f"r{run + 1}" for run in found)
            notes.append(f"calls paired in {which} only, of {runs} run pairs: " + (
                "one run pair cannot show how runs vary, so no interval" if len(found) == 1 else
                "the interval resamples those"))
        single = row.single_call_cells
        if single > 1:
            notes.append(f"{single} single-call cells resampled together (one call has no spread of its own)")
        sizes = np.diff(self.comparison.paired.offsets)[members]
        few = int(np.count_nonzero((sizes > 1) & (sizes < FEW_CALLS)))
        if few:
            notes.append(f"{few} cell{'s' if few > 1 else ''} of 2 to {FEW_CALLS - 1} call pairs: the interval rests "
                         "on few calls and widens for it (Student's t)")
        return "; ".join(notes) or None

    @staticmethod
    def _labels(groups: list[Group]) -> list[str]:
        """Family labels (with the KV dtype) of the cells one arm paired by range."""
        labels = set()
        for g in groups:
            for sig in g.sigs()[g.side.columns["paired_level"][g.rows] == RANGE].tolist():
                entry = g.run.class_of(sig)
                labels.add(entry["family_label"] + (f" ({entry['kv_dtype']})" if entry["kv_dtype"] else ""))
        return sorted(labels)

    @staticmethod
    def different_work(sides: list[list[Group]], row: DiffRow) -> str:
        """What the unpaired calls are: the families with the most unpaired time, per arm."""
        parts = []
        for groups, word in zip(sides, ("baseline", "candidate")):
            unpaired = {}
            for g in groups:
                columns = g.side.columns
                left = g.rows[columns["calls"][g.rows] > columns["paired_calls"][g.rows]]
                for sig, calls, paired_calls, total, paired_ns in zip(*(columns[name][left].tolist() for name in (
                        "sig", "calls", "paired_calls", "total_ns", "paired_ns"))):
                    label = g.run.class_of(sig)["family_label"]
                    count, ns = unpaired.get(label, (0, 0))
                    unpaired[label] = (count + calls - paired_calls, ns + total - paired_ns)
            top = sorted(unpaired.items(), key=lambda item: (-item[1][1], item[0]))[:3]
            if top:
                parts.append(f"{word} " + ", ".join(f"{label} ×{count:,}" for label, (count, _) in top)
                             + (", …" if len(unpaired) > 3 else ""))
        share = f"{100 * row.unpaired_share:.0f}%" if row.unpaired_share is not None else "most"
        return (f"calls without a partner carry {share} of the change ({'; '.join(parts)}); the ratio is of the "
                f"{row.compared_calls:,} paired calls alone ({row.paired_verdict})")


def new_row(estimate: bootstrap.Estimate | None, *, segment: str, arm_stats: list[ArmStats | None], calls: list[int],
            totals: list[int], paired_delta_ns: int, compared_calls: int, cells: int, same_work: bool,
            **where) -> DiffRow:
    """A row from its counts (per arm: calls and total time in the window) and its estimate (None: nothing paired);
    `where` names the family, phase and kernels. Band, verdict, note and share come once the drift is known:
    until then the row is not comparable."""
    total_delta = totals[1] - totals[0]
    paired = estimate is not None
    return DiffRow(segment=segment, baseline=arm_stats[0], candidate=arm_stats[1], baseline_calls=calls[0],
                   candidate_calls=calls[1], baseline_total_ns=totals[0], candidate_total_ns=totals[1],
                   compared_calls=compared_calls, cells=cells,
                   single_call_cells=estimate.single_call_strata if paired else 0, same_work=same_work,
                   ratio=estimate.ratio if paired else None, ci_low=estimate.low if paired else None,
                   ci_high=estimate.high if paired else None, band=None, verdict=Verdict.NOT_COMPARABLE,
                   paired_verdict=None, note=None, reason=None, total_delta_ns=total_delta,
                   paired_delta_ns=paired_delta_ns, unpaired_share=shares.unpaired_share(
                       paired_delta_ns, total_delta - paired_delta_ns) if paired else None,
                   abs_delta_share=None, run_ratios=estimate.run_ratios if paired else (),
                   no_interval=estimate.no_interval if paired else None, **where)


def rank_agreement(rows: list[DiffRow], rank_rows: list[DiffRow]) -> None:
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


def phase_totals(comparison: Comparison, base_arm: Arm, cand_arm: Arm, *, threshold: float,
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
    codes = sorted(set(phase_of.tolist()), key=lambda code: natural(vocabulary.phases[code]))
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
        row = new_row(estimate, segment=WHOLE_PHASE, arm_stats=arm_stats, calls=units, totals=totals,
                      paired_delta_ns=paired_delta, compared_calls=int(values[0].size), cells=int(chosen.size),
                      same_work=per_call, phase=vocabulary.phases[code])
        row.band, row.verdict, row.paired_verdict = band, verdict, paired_verdict
        row.note = "; ".join([UNIT_NOTE] + ([f"{left[0]:,} baseline and {left[1]:,} candidate units without a partner"]
                                            if any(left) else []))
        rows.append(row)
    for row, share in zip(rows, shares.abs_shares([r.total_delta_ns for r in rows])):
        row.abs_delta_share = share
    return rows


def natural(text: str) -> list:
    """Sort key that puts ctx=8192 before ctx=32768."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]

