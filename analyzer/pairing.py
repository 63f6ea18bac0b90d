"""Which calls are compared with which: cells of each run, codes shared by every run, and call pairs.

A run (one trace, inside the window) groups its calls into cells of one signature and one innermost NVTX
range name, taken as its pairing key (analyzer.names: instance counters such as PyTorch's `op_id = N` or a
loop's `step 17` taken out). Two runs, one per arm, pair their calls in two passes:

1. **Kernel cells**: calls of the same kernel family, launch shape and NVTX range (and segment) pair call
   for call in launch order. When the arms made different numbers of such calls, the last N of each pair
   (N the smaller count): extra calls are usually warm-up at the start, and a truncated arm loses calls at
   the end.
2. **Range cells**: calls of kernels that only one arm ran in a range (the FP8 and NVFP4 append kernels
   differ by name and grid; so do vLLM's BF16 and FP8 prefill kernels) pair per segment and range, in
   launch order, when both arms made as many there.

Both passes pair within a rank: a trace of several GPUs (tensor parallel, all ranks under one `nsys profile`)
has a rank per device in deviceId order (load.RankInfo), and rank k of the baseline pairs with rank k of the
candidate only.

Each pair of cells is a stratum for the statistics (analyzer.stats); nothing here computes numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
import polars as pl

from kvtrace.analyzer import align
from kvtrace.analyzer.calls import BLOCK_ROWS, Calls, sums
from kvtrace.analyzer.classify import DIMS, SEGMENTS
from kvtrace.analyzer.load import Trace
from kvtrace.analyzer.names import NameKey
from kvtrace.errors import KvtraceError
from kvtrace.manifest import parse_phase_name

# The key of a kernel cell; range cells keep segment and nvtx.
# Both keep the rank (load.RankInfo): rank k of one arm pairs with rank k of the other, never across ranks.
KERNEL_KEY = ["segment", "family", "rank", *align.MATCH_KEY]
RANGE_KEY = ["segment", "rank", "nvtx"]
KERNEL, RANGE = "kernel", "range"
# FlashInfer workload phases (kvtrace.manifest.phase_name) and the segment whose kernels do their KV work.
PHASE_SEGMENTS = {"prefill": "prefill_attention", "decode": "decode_attention", "append": "kv_append"}


def segment_order(segment: str) -> int:
    return SEGMENTS.index(segment) if segment in SEGMENTS else len(SEGMENTS)


@dataclass(frozen=True)
class Vocabulary:
    """Codes shared by every run of a comparison: launch shapes, innermost range names (their pairing keys,
    `key_of_raw` maps the traces' own names to them), kernel families, segments and phases. Shape, name and family
    codes follow the sorted values, so sorting by code sorts by value; the code after the last name (`outside`) and
    after the last phase stand for calls outside every range."""

    shapes: tuple[tuple[int, ...], ...]
    names: tuple[str, ...]
    families: tuple[str, ...]
    segments: tuple[str, ...]  # in SEGMENTS order
    phases: tuple[str, ...]
    phase_of_nvtx: np.ndarray  # per name code (and `outside`), its phase code
    raw: pl.Series  # every trace's range names, distinct and sorted
    key_of_raw: np.ndarray  # per raw name, its pairing key's name code (names.NameKey)
    ranks: int = 1  # the most ranks (devices that ran kernels) of any trace

    @classmethod
    def of(cls, traces: list[Trace], classes: list[pl.DataFrame], key: NameKey = NameKey()) -> Vocabulary:
        shapes = sorted(set().union(*(set(c.select(DIMS).iter_rows()) for c in classes)))
        # Names as sorted polars columns, codes by binary search: a trace may hold a million distinct names. Polars
        # sorts text by its UTF-8 bytes, which is Python's order (by code point).
        raw = pl.concat([pl.Series("name", t.range_names, dtype=pl.Utf8) for t in traces]).unique().sort()
        keys = pl.Series("name", key.of(raw.to_list()), dtype=pl.Utf8)
        names = keys.unique().sort()
        families = sorted(set().union(*(set(c["family"]) for c in classes)))
        segments = sorted(set().union(*(set(c["segment"]) for c in classes)), key=segment_order)
        phase_names = _phase_names(names)
        phases = phase_names.unique().sort()
        phase_of_nvtx = np.append(_codes(phases, phase_names), phases.len()).astype(np.uint32)
        ranks = max((len(t.info.ranks) for t in traces), default=1)
        return cls(tuple(shapes), tuple(names.to_list()), tuple(families), tuple(segments), tuple(phases.to_list()),
                   phase_of_nvtx, raw, _codes(names, keys), max(ranks, 1))

    @property
    def outside(self) -> int:
        """The nvtx code of calls outside every range."""
        return len(self.names)

    @property
    def outside_phase(self) -> int:
        return len(self.phases)

    @cached_property
    def anchor_of_nvtx(self) -> np.ndarray:
        """Per name code (and `outside`), the segment code whose calls delimit units of its work (`_units`);
        a code no segment has for other ranges."""
        none = len(self.segments)
        anchors = np.full(len(self.names) + 1, none, dtype=np.uint32)
        # Only workload phase names (kvtrace:KIND ctx=N) have an anchor.
        for code in np.flatnonzero(pl.Series(self.names, dtype=pl.Utf8).str.starts_with("kvtrace:")).tolist():
            anchor = PHASE_SEGMENTS.get((parse_phase_name(self.names[code]) or ("", 0))[0])
            if anchor in self.segments:
                anchors[code] = self.segments.index(anchor)
        return anchors

    def name(self, code: int) -> str | None:
        return self.names[code] if code < len(self.names) else None

    def shape_label(self, shape: int) -> str:
        gx, gy, gz, bx, by, bz = self.shapes[shape]
        return f"grid {gx}×{gy}×{gz} block {bx}×{by}×{bz}"

    def label(self, shape: int, nvtx: int) -> str:
        name = self.name(nvtx)
        return self.shape_label(shape) + (f" in '{name}'" if name else "")

    def run(self, trace: Trace, classes: pl.DataFrame, window: align.Window) -> Run:
        """One trace's calls inside the window, grouped into cells that carry this vocabulary's codes."""
        by_sig = classes.sort("sig")
        family = np.searchsorted(self.families, by_sig["family"].to_numpy()).astype(np.uint32)
        segment = np.array([self.segments.index(s) for s in by_sig["segment"]], dtype=np.uint32)
        index = {shape: code for code, shape in enumerate(self.shapes)}
        shape = np.array([index[s] for s in by_sig.select(DIMS).iter_rows()], dtype=np.uint32)
        rank_of_device = {rank.device_id: code for code, rank in enumerate(trace.info.ranks)}
        rank = np.array([rank_of_device.get(d, 0) for d in by_sig["device_id"].to_list()], dtype=np.uint32)
        # The trace's cells number their range names among its own; a range without a name (nvtxRangePushEx
        # with only a colour) cannot be matched, and its calls count as outside, like calls outside every range.
        own = self.key_of_raw[_codes(self.raw, pl.Series(trace.range_names, dtype=pl.Utf8))]
        nvtx_of_name = np.append(own, self.outside).astype(np.uint32)
        of_trace = trace.calls.cells
        cell_sig, cell_nvtx = of_trace["sig"].to_numpy(), nvtx_of_name[of_trace["name"].to_numpy()]
        # Trimming (--skip-warmup, --last) counts the calls of each rank's kernel cells, as they pair.
        group_of_cell = np.unique(np.stack([family[cell_sig], rank[cell_sig], shape[cell_sig], cell_nvtx]), axis=1,
                                  return_inverse=True)[1].reshape(-1) if of_trace.height else np.zeros(0, np.int64)
        keep = align.window_calls(trace, window, group_of_cell)
        cells = Cells.of(trace.calls, cell_nvtx, keep)
        if cells.table.height == 0:
            raise KvtraceError(f"{trace.info.source}: no kernels inside the window "
                               f"({'; '.join(window.describe())}); widen --window/--time/--phase")
        if keep is None:
            launched = trace.ranges.filter(pl.col("calls") > 0)["range"]
        else:
            launched = pl.Series("range", np.unique(trace.calls.range[keep]), dtype=pl.Int32)
        units = _units(trace.calls, keep, cell_nvtx, segment[cell_sig], self.anchor_of_nvtx,
                       nvtx_of_name[trace.range_name_codes], self.outside)
        sig, nvtx = cells.table["sig"].to_numpy(), cells.table["nvtx"].to_numpy()
        cells = replace(cells, table=cells.table.with_columns(
            pl.Series("family", family[sig]), pl.Series("segment", segment[sig]), pl.Series("rank", rank[sig]),
            pl.Series("shape", shape[sig]),
            pl.Series("phase", self.phase_of_nvtx[nvtx]),
            pl.Series("kv_independent", by_sig["kv_independent"].to_numpy()[sig])))
        return Run(trace, classes, cells, launched, units, keep)


def _units(calls: Calls, keep: np.ndarray | None, nvtx_of_cell: np.ndarray, segment_of_cell: np.ndarray,
           anchor_of_nvtx: np.ndarray, nvtx_of_range: np.ndarray, outside: int) -> pl.DataFrame:
    """Units of a phase's work in launch order, with their range-name code and summed time (every kernel
    launched directly inside, whichever did the work). A unit is one range instance, or inside a kvtrace
    workload phase one call of its anchor segment with the calls launched since the previous one (FP8's
    append is a cast and a copy before AppendPagedKVCacheKernel; NVFP4's one fused kernel); calls after a
    range's last anchor join its last unit.

    Read from the trace's layout cell by cell, a block at a time: units are numbered first by anchor call,
    in (range, rank) order, then one per range without anchors, so that a call's unit is a search among
    the anchors alone."""
    inside = np.flatnonzero(nvtx_of_cell != outside)
    anchored = inside[segment_of_cell[inside] == anchor_of_nvtx[nvtx_of_cell[inside]]]
    count = calls.count
    unreleased = 0  # bytes read since the pages were last handed back

    def blocks(cells: np.ndarray):
        """(range, rank, duration) of the kept calls of these cells, a million at a time."""
        nonlocal unreleased
        for cell in cells.tolist():
            low, high = int(calls.offsets[cell]), int(calls.offsets[cell + 1])
            for first in range(low, high, BLOCK_ROWS * 4):
                span = slice(first, min(first + BLOCK_ROWS * 4, high))
                kept = slice(None) if keep is None else keep[span]
                # int64 throughout: np.add.at and np.minimum.at take their fast path only for matching types.
                yield (calls.range[span][kept].astype(np.int64), calls.rank[span][kept].astype(np.int64),
                       calls.duration[span][kept].astype(np.int64))
                unreleased += (span.stop - span.start) * 12
                if unreleased > 64 << 20:
                    calls.release()
                    unreleased = 0
        calls.release()

    anchor_keys = [range_ * count + rank for range_, rank, _ in blocks(anchored)]
    anchor_keys = np.sort(np.concatenate(anchor_keys)) if anchor_keys else np.zeros(0, dtype=np.int64)
    anchor_range = anchor_keys // max(count, 1)
    anchors = np.bincount(anchor_range, minlength=nvtx_of_range.size)
    anchor_first = np.cumsum(anchors) - anchors
    units = anchor_keys.size + nvtx_of_range.size
    total_ns = np.zeros(units, dtype=np.int64)
    first_rank = np.full(units, count, dtype=np.int64)
    for range_, rank, duration in blocks(inside):
        unit = range_ + anchor_keys.size
        with_anchors = anchors[range_] > 0
        if with_anchors.any():
            ranged = range_[with_anchors]
            found = np.searchsorted(anchor_keys, ranged * count + rank[with_anchors])
            unit[with_anchors] = np.minimum(found, anchor_first[ranged] + anchors[ranged] - 1)
        np.add.at(total_ns, unit, duration)
        np.minimum.at(first_rank, unit, rank)
    present = np.flatnonzero(first_rank < count)
    present = present[np.argsort(first_rank[present])]
    range_of_unit = np.concatenate([anchor_range, np.arange(nvtx_of_range.size)])
    return pl.DataFrame({"nvtx": pl.Series(nvtx_of_range[range_of_unit[present]], dtype=pl.UInt32),
                         "total_ns": pl.Series(total_ns[present], dtype=pl.Int64)})


def _phase_names(names: pl.Series) -> pl.Series:
    """Per range name, its phase: the name itself, or for vLLM's per-step ranges their step kind."""
    step = pl.col("nvtx").str.extract_groups(align.VLLM_STEP.pattern)
    context, generation = step.struct.field("1").cast(pl.Int64), step.struct.field("3").cast(pl.Int64)
    kind = pl.format("vLLM {} steps", align.step_kind(context, generation))
    return pl.DataFrame({"nvtx": names}).select(pl.when(context.is_null()).then(pl.col("nvtx")).otherwise(kind))[
        "nvtx"]


def _codes(sorted_values: pl.Series, values: pl.Series) -> np.ndarray:
    """Per value, its place in `sorted_values` (distinct and sorted), which holds every one of them."""
    return sorted_values.search_sorted(values, side="left").to_numpy().astype(np.int64)


@dataclass(frozen=True)
class Cells:
    """A run's calls grouped into cells of one signature and one innermost range (`nvtx` code).

    `table` has a row per cell: cell, sig, nvtx, calls, total_ns, first (the rank of its earliest call in the
    trace's start order), plus the codes Vocabulary.run adds (family, segment, rank, shape, phase, kv_independent).
    `durations` holds the calls' durations cell after cell, in start order within a cell, and `order` their
    ranks in the trace's start order: cell i is [offsets[i], offsets[i + 1]) of both. Without a window both
    are the trace's own memory-mapped columns (analyzer.calls). Groups of cells (`where`) share the arrays,
    so comparisons work on the small table and copy contiguous runs of durations only for what they report.
    """

    table: pl.DataFrame
    durations: np.ndarray
    order: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(cls, calls: Calls, nvtx: np.ndarray, keep: np.ndarray | None) -> Cells:
        """A trace's cells, with their nvtx codes, and only the calls `keep` marks (all with None)."""
        table = calls.cells.select("cell", "sig", pl.Series("nvtx", nvtx, dtype=pl.UInt32), "calls", "total_ns",
                                   "first")
        if keep is None:
            return cls(table=table, durations=calls.duration, order=calls.rank, offsets=calls.offsets)
        kept = np.add.reduceat(keep, calls.offsets[:-1], dtype=np.int64) if table.height else \
            np.zeros(0, dtype=np.int64)
        present = np.flatnonzero(kept)
        offsets = np.zeros(present.size + 1, dtype=np.int64)
        np.cumsum(kept[present], out=offsets[1:])
        durations, order = calls.duration[keep], calls.rank[keep]
        totals = sums(durations, offsets)
        table = table[present].with_columns(
            pl.int_range(present.size, dtype=pl.UInt32).alias("cell"), pl.Series("calls", kept[present]),
            pl.Series("total_ns", totals), pl.Series("first", order[offsets[:-1]].astype(np.int64)))
        return cls(table=table, durations=durations, order=order, offsets=offsets)

    def where(self, predicate: pl.Expr) -> Cells:
        return replace(self, table=self.table.filter(predicate))

    @property
    def calls(self) -> int:
        return int(self.table["calls"].sum())

    @property
    def total_ns(self) -> int:
        return int(self.table["total_ns"].sum())

    def values(self, *, ordered: bool = False) -> np.ndarray:
        """The durations of the group's calls; in launch order when `ordered`."""
        return _gather(self, self.table["cell"].to_numpy(), ordered=ordered)

    def counts(self, keys: list[str]) -> pl.DataFrame:
        return self.table.group_by(keys).agg(pl.col("calls").sum().alias("len"))


def _gather(cells: Cells, chosen: np.ndarray, *, ordered: bool) -> np.ndarray:
    """Durations of the chosen cells: one slice for one cell, else concatenated (in launch order when asked)."""
    offsets = cells.offsets
    if chosen.size == 1:
        return cells.durations[offsets[chosen[0]]:offsets[chosen[0] + 1]]
    if chosen.size == 0:
        return np.zeros(0, dtype=cells.durations.dtype)
    durations = np.concatenate([cells.durations[offsets[i]:offsets[i + 1]] for i in chosen.tolist()])
    if ordered:
        rows = np.concatenate([cells.order[offsets[i]:offsets[i + 1]] for i in chosen.tolist()])
        durations = durations[np.argsort(rows, kind="stable")]
    return durations


@dataclass
class Run:
    """One trace inside the window: its calls grouped into cells (Cells) whose table carries codes of the
    comparison's Vocabulary, the classified signatures behind them, the NVTX ranges the window's calls
    were launched in, the units of each phase's work with their summed time (`_units`), and the window as a
    mask over the trace's calls."""

    trace: Trace
    classes: pl.DataFrame
    cells: Cells
    ranges: pl.Series
    units: pl.DataFrame
    keep: np.ndarray | None  # which of the trace's calls (in its layout's cell order) are inside the window; None: all

    def signatures(self, group: Cells) -> pl.DataFrame:
        """The classified signatures that a group of cells uses."""
        return self.classes.filter(pl.col("sig").is_in(group.table["sig"].unique().implode()))

    @cached_property
    def _class_of(self) -> dict[int, dict[str, str | None]]:
        """Per signature, the classification columns that rows ask for: a diff asks for each of its thousands of
        rows, and a polars filter per question was a good part of a row's cost."""
        found: dict[int, dict[str, str | None]] = {}
        for entry in self.classes.select("sig", "segment", "family_label", "kv_dtype", "demangled").iter_rows(
                named=True):
            found.setdefault(entry["sig"], entry)
        return found

    def class_of(self, sig: int) -> dict[str, str | None]:
        """A signature's classification columns (segment, family_label, kv_dtype, demangled)."""
        return self._class_of[sig]

    def earliest(self, group: Cells, column: str) -> str:
        """A classification column (segment, family_label) of the group's earliest call."""
        sig = group.table["sig"][group.table["first"].arg_min()]
        return self._class_of[sig][column]

    def kv_dtypes_and_names(self, group: Cells) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The KV dtypes and demangled names of a group of cells."""
        return self.kv_dtypes_and_names_of(group.table["sig"].to_list())

    def kv_dtypes_and_names_of(self, sigs: list[int]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The KV dtypes and demangled names of some signatures."""
        found = [self._class_of[sig] for sig in set(sigs) if sig in self._class_of]
        return (tuple(sorted({entry["kv_dtype"] for entry in found} - {None})),
                tuple(sorted({entry["demangled"] for entry in found})))


@dataclass(frozen=True)
class Pairs:
    """The call pairs of one run pair (baseline run, candidate run), cell by cell.

    `strata` has a row per pair of cells: stratum, level (KERNEL or RANGE), segment, family (null at range
    level), rank (the device's place in each trace, load.RankInfo), shape (null at range level), nvtx, phase, kv_independent, pairs, and the calls each arm made
    under that key (`baseline_calls`, `candidate_calls`, more than `pairs` when the counts differ).
    `baseline[i]` pairs with `candidate[i]`; stratum s is [offsets[s], offsets[s + 1]). `paired` has, per
    arm, each cell's paired calls, their time and the level they paired at (cell, paired_calls, paired_ns,
    paired_level), so that the unpaired rest of any group of cells is known.
    """

    strata: pl.DataFrame
    baseline: np.ndarray
    candidate: np.ndarray
    offsets: np.ndarray
    paired: tuple[pl.DataFrame, pl.DataFrame]


_STRATA_SCHEMA = {"stratum": pl.UInt32, "level": pl.Utf8, "segment": pl.UInt32, "family": pl.UInt32,
                  "rank": pl.UInt32, "shape": pl.UInt32, "nvtx": pl.UInt32, "kv_independent": pl.Boolean,
                  "pairs": pl.Int64,
                  "baseline_calls": pl.Int64, "candidate_calls": pl.Int64}


def pair(base: Run, cand: Run, vocabulary: Vocabulary) -> Pairs:
    """Pair the calls of two runs, kernel cells first, then range cells (see the module docstring)."""
    arms = (base.cells, cand.cells)
    keys = [_cell_lists(cells.table, KERNEL_KEY) for cells in arms]
    both = (keys[0].join(keys[1], on=KERNEL_KEY, how="full", coalesce=True, suffix="_candidate")
            .with_columns(pl.col("calls", "calls_candidate").fill_null(0)).sort(KERNEL_KEY))
    rows, pieces = [], ([], [])
    paired = ({}, {})  # cell -> (paired calls, paired ns), per arm
    paging = _Paging(base, cand)
    shared = both.filter((pl.col("calls") > 0) & (pl.col("calls_candidate") > 0))
    for row in shared.iter_rows(named=True):
        count = min(row["calls"], row["calls_candidate"])
        for side, cell_list in enumerate((row["cells"], row["cells_candidate"])):
            pieces[side].append(paging.read(_last(arms[side], np.array(cell_list), count, paired[side], KERNEL)))
        kv_independent = row["kv_independent"] and row["kv_independent_candidate"]
        rows.append((KERNEL, row["segment"], row["family"], row["rank"], row["shape"], row["nvtx"], kv_independent,
                     count, row["calls"], row["calls_candidate"]))
    # Range cells: the calls of kernel keys that only one arm ran, per segment and range.
    alone = both.filter((pl.col("calls") == 0) | (pl.col("calls_candidate") == 0))
    ranges_of = []
    for side, suffix in enumerate(("", "_candidate")):
        cells = alone.filter(pl.col(f"calls{suffix}") > 0).select(*RANGE_KEY, pl.col(f"cells{suffix}").alias("cells"))
        ranges_of.append(cells.explode("cells").group_by(RANGE_KEY).agg(pl.col("cells").sort()))
    by_range = ranges_of[0].join(ranges_of[1], on=RANGE_KEY, how="inner", suffix="_candidate").sort(RANGE_KEY)
    for row in by_range.iter_rows(named=True):
        chosen = [np.array(row["cells"]), np.array(row["cells_candidate"])]
        counts = [int(arms[side].table["calls"].to_numpy()[chosen[side]].sum()) for side in (0, 1)]
        if counts[0] != counts[1]:
            continue
        for side in (0, 1):
            pieces[side].append(paging.read(_last(arms[side], chosen[side], counts[side], paired[side], RANGE)))
        rows.append((RANGE, row["segment"], None, row["rank"], None, row["nvtx"], False, counts[0], counts[0],
                     counts[1]))
    strata = pl.DataFrame(
        [(index, *row) for index, row in enumerate(rows)], schema=_STRATA_SCHEMA, orient="row").with_columns(
        pl.Series("phase", vocabulary.phase_of_nvtx[np.array([r[5] for r in rows], dtype=np.int64)]
                  if rows else np.zeros(0, dtype=np.uint32), dtype=pl.UInt32))
    sizes = strata["pairs"].to_numpy()
    offsets = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    dtype = np.result_type(*(cells.durations.dtype for cells in arms))
    baseline, candidate = (paging.joined(p, dtype) for p in pieces)
    return Pairs(strata, baseline, candidate, offsets, tuple(_paired_table(p) for p in paired))


class _Paging:
    """Reads of the traces' memory-mapped durations (analyzer.calls) that hand their pages back to the page
    cache every RELEASE_BYTES, so that pairing holds the pairs it copies out and little of the traces."""

    RELEASE_BYTES = 64 << 20

    def __init__(self, *runs: Run):
        self.calls = [run.trace.calls for run in runs]
        self.since = 0

    def read(self, values: np.ndarray) -> np.ndarray:
        self.since += values.nbytes
        if self.since > self.RELEASE_BYTES:
            for calls in self.calls:
                calls.release()
            self.since = 0
        return values

    def joined(self, pieces: list[np.ndarray], dtype) -> np.ndarray:
        """The pieces in one array, read piece by piece."""
        out = np.empty(sum(piece.size for piece in pieces), dtype=dtype)
        at = 0
        for piece in pieces:
            out[at:at + piece.size] = self.read(piece)
            at += piece.size
        return out


def _cell_lists(table: pl.DataFrame, key: list[str]) -> pl.DataFrame:
    return table.group_by(key).agg(pl.col("calls").sum(), pl.col("cell").sort().alias("cells"),
                                   pl.col("kv_independent").all())


def _last(cells: Cells, chosen: np.ndarray, count: int, paired: dict, level: str) -> np.ndarray:
    """The last `count` calls of the chosen cells in launch order; records what each cell gave, at which level."""
    if chosen.size == 1:
        cell = int(chosen[0])
        end = cells.offsets[cell + 1]
        values = cells.durations[end - count:end]
        paired[cell] = (count, int(values.sum(dtype=np.int64)), level)
        return values
    rows = np.concatenate([cells.order[cells.offsets[i]:cells.offsets[i + 1]] for i in chosen.tolist()])
    owner = np.repeat(chosen, np.diff(cells.offsets)[chosen])
    values = np.concatenate([cells.durations[cells.offsets[i]:cells.offsets[i + 1]] for i in chosen.tolist()])
    order = np.argsort(rows, kind="stable")[-count:]
    for cell in np.unique(owner[order]).tolist():
        mine = order[owner[order] == cell]
        paired[cell] = (int(mine.size), int(values[mine].sum(dtype=np.int64)), level)
    return values[order]


def _paired_table(paired: dict) -> pl.DataFrame:
    cells = sorted(paired)
    return pl.DataFrame({"cell": pl.Series(cells, dtype=pl.UInt32),
                         "paired_calls": pl.Series([paired[c][0] for c in cells], dtype=pl.Int64),
                         "paired_ns": pl.Series([paired[c][1] for c in cells], dtype=pl.Int64),
                         "paired_level": pl.Series([paired[c][2] for c in cells], dtype=pl.Utf8)})


def shape_list(group: Cells, vocabulary: Vocabulary, limit: int = 3) -> str:
    """The launch shapes and ranges a group of cells ran, most calls first."""
    # Ties in count sort by shape and range, so that the same inputs always give the same text.
    shapes = group.counts(align.MATCH_KEY).sort(["len", *align.MATCH_KEY], descending=[True, False, False])
    text = ", ".join(vocabulary.label(shape, nvtx) for shape, nvtx, _ in shapes.head(limit).iter_rows())
    return text + (", …" if shapes.height > limit else "")
