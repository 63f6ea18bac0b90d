"""Which kernels to compare: vLLM step phases, user windows, and call matching across arms.

The loader has already tied each kernel to the innermost NVTX range around its launch (analyzer.ranges,
as Nsight Systems' nvtx_gpu_proj_trace.py does). Kernels replayed from a CUDA graph carry the
correlationId of their cudaGraphLaunch, so they land in the range around the launch (vLLM's per-step
range), not in ranges opened during capture. Everything here works per range or per signature and
touches per-call rows only to filter them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np
import polars as pl

from kvtrace.analyzer import ranges as ranges_
from kvtrace.analyzer.load import Trace
from kvtrace.errors import KvtraceError

# vLLM's per-step range with the CUDA profiler on (vllm.v1.worker.gpu_worker.annotate_profile):
# execute_context_{nCtxReqs}({nCtxTokens})_generation_{nGenReqs}({nGenTokens}); the detailed form puts
# sq/sk lists in the parentheses instead of a token count.
VLLM_STEP = re.compile(r"execute_(?:\d+_)?context_(\d+)\(([^)]*)\)_generation_(\d+)\(([^)]*)\)")
PREFILL, DECODE, MIXED, IDLE = "prefill", "decode", "mixed", "idle"


@dataclass(frozen=True)
class Window:
    """What part of each arm to compare; the defaults keep everything."""

    nvtx: str | None = None  # regex over the names of enclosing NVTX ranges
    time_ns: tuple[int | None, int | None] = (None, None)  # on the trace's own timeline
    phase: str | None = None  # vLLM step kind
    skip_warmup: int = 0  # first calls dropped per family and launch shape
    last: int | None = None  # last calls kept per family and launch shape

    def describe(self) -> list[str]:
        parts = []
        if self.nvtx:
            parts.append(f"kernels launched inside NVTX ranges matching /{self.nvtx}/")
        if self.time_ns != (None, None):
            start, end = self.time_ns
            parts.append(f"kernels starting in [{_seconds(start)}, {_seconds(end)}) of each trace's timeline")
        if self.phase:
            parts.append(f"kernels of vLLM {self.phase} steps")
        if self.skip_warmup:
            parts.append(f"first {self.skip_warmup} calls per family, launch shape and NVTX range dropped as warm-up")
        if self.last is not None:
            parts.append(f"last {self.last} calls per family, launch shape and NVTX range kept")
        return parts


def _seconds(ns: int | None) -> str:
    return "…" if ns is None else f"{ns / 1e9:g} s"


def parse_time_window(text: str) -> tuple[int | None, int | None]:
    """'1.5:3', '1.5s:3s', '200ms:', ':2s' -> ns bounds."""
    def one(part: str) -> int | None:
        part = part.strip()
        if not part:
            return None
        match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(s|ms|us|µs|ns)?", part)
        if not match:
            raise KvtraceError(f"--time {text!r}: write START:END in seconds, e.g. 1.5:3 or 200ms:2s")
        scale = {"s": 1e9, None: 1e9, "ms": 1e6, "us": 1e3, "µs": 1e3, "ns": 1}[match.group(2)]
        return int(float(match.group(1)) * scale)

    if ":" not in text:
        raise KvtraceError(f"--time {text!r}: write START:END in seconds, e.g. 1.5:3 (either side may be empty)")
    start, end = (one(p) for p in text.split(":", 1))
    if start is not None and end is not None and end <= start:
        raise KvtraceError(f"--time {text!r}: END must be after START")
    return start, end


def range_matches(trace: Trace, pattern: str) -> np.ndarray:
    """Per range of the trace: it, or a range around it, has a name matching `pattern`."""
    names = trace.ranges["name"]
    own = np.where(names.str.contains(pattern).fill_null(False).to_numpy(), 0, ranges_.NO_RANGE)
    return ranges_.propagate(trace.ranges["parent"].to_numpy(),
                             trace.ranges["depth"].to_numpy(), own) == 0


def step_kind(context_requests: pl.Expr, generation_requests: pl.Expr) -> pl.Expr:
    """A vLLM step's kind from its request counts: idle, prefill, decode or mixed."""
    return (pl.when((generation_requests == 0) & (context_requests == 0)).then(pl.lit(IDLE))
            .when(generation_requests == 0).then(pl.lit(PREFILL))
            .when(context_requests == 0).then(pl.lit(DECODE)).otherwise(pl.lit(MIXED)))


def steps(trace: Trace) -> pl.DataFrame:
    """Per range inside a vLLM step range (including the step range itself): the innermost step around it
    (`step` name, `step_start`), its kind (`phase`) and token counts."""
    return trace.memo("steps", lambda: _steps(trace))


def _steps(trace: Trace) -> pl.DataFrame:
    ranges = trace.ranges
    parsed = ranges.select("range", pl.col("name").str.extract_groups(VLLM_STEP.pattern).alias("m"))
    is_step = parsed["m"].struct.field("1").is_not_null().to_numpy()
    step_range = ranges_.propagate(ranges["parent"].to_numpy(), ranges["depth"].to_numpy(),
                                   np.where(is_step, ranges["range"].to_numpy(), ranges_.NO_RANGE))
    m = pl.col("m")
    step_table = parsed.filter(pl.Series(is_step)).select(
        pl.col("range").alias("step_range"),
        m.struct.field("1").cast(pl.Int64).alias("context_requests"),
        m.struct.field("2").cast(pl.Int64, strict=False).alias("context_tokens"),
        m.struct.field("3").cast(pl.Int64).alias("generation_requests"),
        m.struct.field("4").cast(pl.Int64, strict=False).alias("generation_tokens"))
    phase = step_kind(pl.col("context_requests"), pl.col("generation_requests"))
    step_table = step_table.with_columns(phase.alias("phase")).join(
        ranges.select(pl.col("range").alias("step_range"), pl.col("name").alias("step"),
                      pl.col("start").alias("step_start")), on="step_range")
    return (pl.DataFrame({"range": ranges["range"], "step_range": pl.Series(step_range, dtype=pl.Int32)})
            .join(step_table, on="step_range", how="inner")
            .select("range", "step_range", "step", "step_start", "phase", "context_tokens", "generation_tokens"))


def apply_window(trace: Trace, calls: pl.DataFrame, window: Window) -> pl.DataFrame:
    """Filter a trace's calls (with `range`, NO_RANGE outside every range) to the window; per-family
    trimming last."""
    if window.nvtx:
        try:
            pattern = re.compile(window.nvtx)
        except re.error as error:
            raise KvtraceError(f"--window {window.nvtx!r} is not a valid regex ({error})") from None
        inside = np.flatnonzero(range_matches(trace, pattern.pattern))
        calls = calls.filter(pl.col("range").is_in(pl.Series(inside, dtype=pl.Int32).implode()))
    start, end = window.time_ns
    if start is not None:
        calls = calls.filter(pl.col("start") >= start)
    if end is not None:
        calls = calls.filter(pl.col("start") < end)
    if window.phase:
        in_phase = steps(trace).filter(pl.col("phase") == window.phase)["range"]
        calls = calls.filter(pl.col("range").is_in(in_phase.implode()))
    if window.skip_warmup or window.last is not None:
        # Calls are in start order, so a call's position in its group is its launch order.
        order = pl.int_range(pl.len()).over(["family", *MATCH_KEY])
        count = pl.len().over(["family", *MATCH_KEY])
        keep = order >= window.skip_warmup
        if window.last is not None:
            keep = keep & (order >= count - window.last)
        calls = calls.filter(keep)
    return calls


SHAPE = ["grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z"]
# Calls pair only within the same launch shape and the same innermost NVTX range: a decode kernel keeps
# its grid across context lengths, so the shape alone cannot tell a 2k-token call from a 32k one, while
# the range (`kvtrace:decode ctx=2048`, vLLM's `execute_context_0(0)_generation_8(8)`) can. Both are
# codes of a Vocabulary shared by the arms.
MATCH_KEY = ["shape", "nvtx"]


@dataclass(frozen=True)
class Vocabulary:
    """Codes for launch shapes and innermost range names, shared by the arms of a comparison. Codes follow
    the sorted values (no range last), so sorting by code sorts by value."""

    shapes: tuple[tuple[int, ...], ...]
    names: tuple[str, ...]

    @classmethod
    def of(cls, shapes: list[pl.DataFrame], names: list[pl.Series]) -> Vocabulary:
        all_shapes = sorted(set().union(*(set(frame.select(SHAPE).iter_rows()) for frame in shapes)))
        all_names = sorted(set().union(*(set(series.drop_nulls().unique()) for series in names)))
        return cls(tuple(all_shapes), tuple(all_names))

    @property
    def outside(self) -> int:
        """The nvtx code of calls outside every range."""
        return len(self.names)

    def shape_codes(self, frame: pl.DataFrame) -> np.ndarray:
        index = {shape: code for code, shape in enumerate(self.shapes)}
        return np.array([index[shape] for shape in frame.select(SHAPE).iter_rows()], dtype=np.uint32)

    def name_codes(self, names: pl.Series) -> np.ndarray:
        """Per range, the code of its name; one extra entry at the end for calls outside every range."""
        index = {name: code for code, name in enumerate(self.names)}
        # A range without a name (nvtxRangePushEx with only a colour) cannot be matched: like outside.
        return np.array([index.get(n, self.outside) for n in names.to_list()] + [self.outside], dtype=np.uint32)

    def name(self, code: int) -> str | None:
        return self.names[code] if code < len(self.names) else None

    def label(self, shape: int, nvtx: int) -> str:
        (gx, gy, gz, bx, by, bz), name = self.shapes[shape], self.name(nvtx)
        return f"grid {gx}×{gy}×{gz} block {bx}×{by}×{bz}" + (f" in '{name}'" if name else "")


@dataclass(frozen=True)
class Cells:
    """An arm's calls grouped into cells of one signature and one innermost range (`nvtx` code).

    `table` has a row per cell: cell, sig, nvtx, calls, total_ns, first (the row of its earliest call), plus
    the codes the caller adds (family, segment, shape, phase). `order` lists the calls' rows (in the
    arm's start order) cell after cell, ascending within a cell, and `durations` their durations in that
    order: cell i is [offsets[i], offsets[i + 1]) of both. Groups of cells (`where`) share the arrays, so
    comparisons work on the small table and copy contiguous runs of durations only for what they report.
    """

    table: pl.DataFrame
    durations: np.ndarray
    order: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(cls, calls: pl.DataFrame) -> Cells:
        """From calls (sig, nvtx, duration) in start order, in numpy: a hash group-by over millions of
        rows would hold several times their size."""
        width = int(calls["nvtx"].max()) + 1 if calls.height else 1
        key_type = np.uint32 if (int(calls["sig"].max() or 0) + 1) * width < 1 << 32 else np.int64
        keys = calls["sig"].to_numpy().astype(key_type)
        keys *= width
        keys += calls["nvtx"].to_numpy()
        if keys.size and int(keys.max()) < 1 << 24:
            calls_by_key = np.bincount(keys)
            present = np.flatnonzero(calls_by_key)
            lookup = np.zeros(calls_by_key.size, dtype=np.uint16 if present.size <= 1 << 16 else np.uint32)
            lookup[present] = np.arange(present.size)
            cell = lookup[keys]
            counts = calls_by_key[present]
        else:
            present, cell, counts = np.unique(keys, return_inverse=True, return_counts=True)
        del keys
        # A stable sort keeps each cell's calls in start order; numpy radix-sorts 16-bit cell numbers.
        order = np.argsort(cell, kind="stable").astype(np.uint32 if calls.height < 1 << 32 else np.int64)
        del cell
        offsets = np.zeros(present.size + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        durations = calls["duration"].to_numpy()[order]
        totals = np.add.reduceat(durations, offsets[:-1], dtype=np.int64) if present.size else \
            np.zeros(0, dtype=np.int64)
        if durations.size and 0 <= durations.min() and durations.max() < 1 << 32:
            durations = durations.astype(np.uint32)  # kernels shorter than 4.3 s: half the memory
        table = pl.DataFrame({"cell": np.arange(present.size, dtype=np.uint32),
                              "sig": (present // width).astype(np.uint32), "nvtx": (present % width).astype(np.uint32),
                              "calls": counts.astype(np.int64), "total_ns": totals, "first": order[offsets[:-1]]})
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
        spans = [(self.offsets[i], self.offsets[i + 1]) for i in self.table["cell"].to_list()]
        if not spans:
            return np.zeros(0, dtype=self.durations.dtype)
        durations = np.concatenate([self.durations[a:b] for a, b in spans])
        if ordered and len(spans) > 1:
            rows = np.concatenate([self.order[a:b] for a, b in spans])
            durations = durations[np.argsort(rows, kind="stable")]
        return durations

    def counts(self, keys: list[str]) -> pl.DataFrame:
        return self.table.group_by(keys).agg(pl.col("calls").sum().alias("len"))


@dataclass
class Match:
    """The calls of one family (or segment) that both arms ran, and how they were paired."""

    baseline: np.ndarray  # durations of the paired calls
    candidate: np.ndarray
    baseline_total_calls: int
    candidate_total_calls: int
    note: str | None  # how the calls were matched when not one-to-one
    reason: str | None  # why nothing could be matched

    @property
    def matched(self) -> bool:
        return self.reason is None


def match_family(base: Cells, cand: Cells, vocabulary: Vocabulary) -> Match:
    """Pair the calls of one kernel family across arms.

    The same launch shapes with the same counts pair everything. Otherwise, per launch shape both arms
    ran, the last N calls of each (N = the smaller count) are paired: extra calls in one arm are usually
    warm-up at the start, and a truncated arm loses calls at the end. Without a common shape nothing is
    paired: the arms did different work.
    """
    nb, nc = base.calls, cand.calls
    empty = np.zeros(0, dtype=np.int64)
    if nb == 0 or nc == 0:
        return Match(empty, empty, nb, nc, None, f"only in the {'candidate' if nb == 0 else 'baseline'}")
    shapes = (base.counts(MATCH_KEY)
              .join(cand.counts(MATCH_KEY), on=MATCH_KEY, how="full", suffix="_candidate", coalesce=True)
              .with_columns(pl.col("len", "len_candidate").fill_null(0)).sort(MATCH_KEY))
    if (shapes["len"] == shapes["len_candidate"]).all():
        return Match(base.values(), cand.values(), nb, nc, None, None)
    common = shapes.filter((pl.col("len") > 0) & (pl.col("len_candidate") > 0))
    if common.height == 0:
        return Match(empty, empty, nb, nc, None, "the arms ran this family with different launch shapes or "
                     f"NVTX ranges ({_shape_list(base, vocabulary)} vs {_shape_list(cand, vocabulary)})")
    picked_b, picked_c, notes = [], [], []
    for shape, nvtx, count_b, count_c in common.iter_rows():  # one row per common launch shape
        keep = min(count_b, count_c)
        for cells, picked in ((base, picked_b), (cand, picked_c)):
            same_shape = cells.where((pl.col("shape") == shape) & (pl.col("nvtx") == nvtx))
            picked.append(same_shape.values(ordered=True)[-keep:])
        if count_b != count_c:
            notes.append(f"{vocabulary.label(shape, nvtx)}: last {keep} of {count_b} vs {count_c} calls")
    left_b = nb - sum(len(p) for p in picked_b)
    left_c = nc - sum(len(p) for p in picked_c)
    notes.append(f"{left_b} baseline and {left_c} candidate calls left out")
    return Match(np.concatenate(picked_b), np.concatenate(picked_c), nb, nc, "; ".join(notes), None)


def _shape_list(cells: Cells, vocabulary: Vocabulary, limit: int = 3) -> str:
    # Ties in count sort by shape and range, so that the same inputs always give the same text.
    shapes = cells.counts(MATCH_KEY).sort(["len", *MATCH_KEY], descending=[True, False, False])
    text = ", ".join(vocabulary.label(shape, nvtx) for shape, nvtx, _ in shapes.head(limit).iter_rows())
    return text + (", …" if shapes.height > limit else "")
