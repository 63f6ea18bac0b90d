"""Which kernels to compare: NVTX projection, vLLM step phases, user windows, and call matching.

NVTX ranges are projected onto kernels the way Nsight Systems' own reports do it
(nvtx_gpu_proj_trace.py, shared/reference/nsys-sqlite.md §2): a kernel belongs to a range when the CUDA
API call that launched it (joined on correlationId and process) lies inside the range on the same thread.
Kernels replayed from a CUDA graph carry the correlationId of their cudaGraphLaunch, so they land in the
range around the launch (vLLM's per-step range), not in ranges opened during capture.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import polars as pl

from kvtrace.analyzer.load import Trace
from kvtrace.errors import KvtraceError

PROCESS_MASK = 0xFFFFFFFFFF000000  # globalTid -> globalPid, as NVIDIA's joins do
MAX_DEPTH = 16
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


def enclosing_ranges(trace: Trace) -> pl.DataFrame:
    """Per kernel row (kernel_row), its enclosing NVTX ranges, outermost first: names (`ranges`) and start
    times (`range_starts`, which tell two ranges of the same name apart)."""
    return trace.memo("enclosing_ranges", lambda: _enclosing_ranges(trace))


def _enclosing_ranges(trace: Trace) -> pl.DataFrame:
    kernels = trace.kernels.with_row_index("kernel_row").select("kernel_row", "correlation_id", "global_pid")
    runtime = trace.runtime(api=False).with_columns((pl.col("global_tid") & PROCESS_MASK).alias("global_pid"))
    launches = kernels.join(runtime.select("correlation_id", "global_pid", "global_tid", "start", "end"),
                            on=["correlation_id", "global_pid"], how="inner")
    ranges = _with_depth(trace.nvtx_ranges())
    found = []
    for depth in range(int(ranges["depth"].max()) + 1 if ranges.height else 0):
        level = ranges.filter(pl.col("depth") == depth).sort("start")
        # At one depth ranges of a thread do not overlap, so the latest one starting before the launch is
        # the only candidate; keep it if it also ends after the launch.
        hit = (launches.sort("start")
               .join_asof(level.select("global_tid", pl.col("start").alias("range_start"),
                                       pl.col("end").alias("range_end"), "name"),
                          left_on="start", right_on="range_start", by="global_tid", strategy="backward",
                          check_sortedness=False)
               .filter(pl.col("range_end") >= pl.col("end"))
               .select("kernel_row", pl.lit(depth).alias("depth"), "name", "range_start"))
        found.append(hit)
    if not found:
        return pl.DataFrame(schema={"kernel_row": pl.UInt32, "ranges": pl.List(pl.Utf8),
                                    "range_starts": pl.List(pl.Int64)})
    return (pl.concat(found).sort("kernel_row", "depth").group_by("kernel_row", maintain_order=True)
            .agg(pl.col("name").alias("ranges"), pl.col("range_start").alias("range_starts")))


def _with_depth(ranges: pl.DataFrame) -> pl.DataFrame:
    """Nesting depth of each range on its thread (0 = outermost), by a stack sweep over ranges."""
    if ranges.height == 0:
        return ranges.with_columns(pl.lit(0, dtype=pl.Int32).alias("depth"))
    ordered = ranges.sort(["global_tid", "start", "end"], descending=[False, False, True])
    depths = np.zeros(ordered.height, dtype=np.int32)
    tids, starts, ends = (ordered[c].to_numpy() for c in ("global_tid", "start", "end"))
    stack: list[int] = []  # end times of the open ranges of the current thread
    previous_tid = None
    for i in range(ordered.height):  # over NVTX ranges (thousands), never over kernels
        if tids[i] != previous_tid:
            stack, previous_tid = [], tids[i]
        while stack and stack[-1] <= starts[i]:
            stack.pop()
        depths[i] = min(len(stack), MAX_DEPTH)
        stack.append(ends[i])
    return ordered.with_columns(pl.Series("depth", depths))


def step_phases(trace: Trace) -> pl.DataFrame:
    """kernel_row -> vLLM step (name, start), kind and token counts, for kernels inside vLLM step ranges."""
    return trace.memo("step_phases", lambda: _step_phases(trace))


def _step_phases(trace: Trace) -> pl.DataFrame:
    ranges = enclosing_ranges(trace).explode("ranges", "range_starts").rename({"ranges": "name"})
    steps = ranges.with_columns(pl.col("name").str.extract_groups(VLLM_STEP.pattern).alias("m")).filter(
        pl.col("m").struct.field("1").is_not_null())
    if steps.height == 0:
        return pl.DataFrame(schema={"kernel_row": pl.UInt32, "step": pl.Utf8, "step_start": pl.Int64,
                                    "phase": pl.Utf8, "context_tokens": pl.Int64, "generation_tokens": pl.Int64})
    steps = steps.select(
        "kernel_row", pl.col("name").alias("step"), pl.col("range_starts").alias("step_start"),
        pl.col("m").struct.field("1").cast(pl.Int64).alias("context_requests"),
        pl.col("m").struct.field("2").cast(pl.Int64, strict=False).alias("context_tokens"),
        pl.col("m").struct.field("3").cast(pl.Int64).alias("generation_requests"),
        pl.col("m").struct.field("4").cast(pl.Int64, strict=False).alias("generation_tokens"))
    phase = (pl.when((pl.col("generation_requests") == 0) & (pl.col("context_requests") == 0)).then(pl.lit(IDLE))
             .when(pl.col("generation_requests") == 0).then(pl.lit(PREFILL))
             .when(pl.col("context_requests") == 0).then(pl.lit(DECODE)).otherwise(pl.lit(MIXED)))
    return steps.with_columns(phase.alias("phase")).unique("kernel_row", keep="last").select(
        "kernel_row", "step", "step_start", "phase", "context_tokens", "generation_tokens")


def apply_window(trace: Trace, kernels: pl.DataFrame, window: Window) -> pl.DataFrame:
    """Filter classified kernel rows (with kernel_row) to the window; per-family trimming last."""
    if window.nvtx:
        try:
            pattern = re.compile(window.nvtx)
        except re.error as error:
            raise KvtraceError(f"--window {window.nvtx!r} is not a valid regex ({error})") from None
        ranges = enclosing_ranges(trace)
        inside = ranges.filter(pl.col("ranges").list.eval(pl.element().str.contains(pattern.pattern)).list.any())
        kernels = kernels.join(inside.select("kernel_row"), on="kernel_row", how="semi")
    start, end = window.time_ns
    if start is not None:
        kernels = kernels.filter(pl.col("start") >= start)
    if end is not None:
        kernels = kernels.filter(pl.col("start") < end)
    if window.phase:
        steps = step_phases(trace).filter(pl.col("phase") == window.phase)
        kernels = kernels.join(steps.select("kernel_row"), on="kernel_row", how="semi")
    if window.skip_warmup or window.last is not None:
        order = pl.col("start").rank("ordinal").over(["family", *MATCH_KEY]) - 1
        count = pl.len().over(["family", *MATCH_KEY])
        keep = order >= window.skip_warmup
        if window.last is not None:
            keep = keep & (order >= count - window.last)
        kernels = kernels.filter(keep)
    return kernels


SHAPE = ["grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z"]
# Calls pair only within the same launch shape and the same innermost NVTX range: a decode kernel keeps
# its grid across context lengths, so the shape alone cannot tell a 2k-token call from a 32k one, while
# the range (`kvtrace:decode ctx=2048`, vLLM's `execute_context_0(0)_generation_8(8)`) can.
MATCH_KEY = [*SHAPE, "nvtx"]


def with_innermost_range(trace: Trace, kernels: pl.DataFrame) -> pl.DataFrame:
    """Add `nvtx`: the innermost NVTX range around each kernel's launch (null outside every range)."""
    innermost = enclosing_ranges(trace).select("kernel_row", pl.col("ranges").list.last().alias("nvtx"))
    return kernels.join(innermost, on="kernel_row", how="left")


@dataclass
class Match:
    """The calls of one family (or segment) that both arms ran, and how they were paired."""

    baseline: np.ndarray  # durations, in launch order
    candidate: np.ndarray
    baseline_total_calls: int
    candidate_total_calls: int
    note: str | None  # how the calls were matched when not one-to-one
    reason: str | None  # why nothing could be matched

    @property
    def matched(self) -> bool:
        return self.reason is None


def shape_label(row: tuple) -> str:
    gx, gy, gz, bx, by, bz, nvtx = row
    return f"grid {gx}×{gy}×{gz} block {bx}×{by}×{bz}" + (f" in '{nvtx}'" if nvtx else "")


def match_family(base: pl.DataFrame | None, cand: pl.DataFrame | None) -> Match:
    """Pair the calls of one kernel family across arms.

    The same launch shapes with the same counts pair everything in launch order. Otherwise, per launch
    shape both arms ran, the last N calls of each (N = the smaller count) are paired: extra calls in one
    arm are usually warm-up at the start, and a truncated arm loses calls at the end. Without a common
    shape nothing is paired: the arms did different work.
    """
    nb = base.height if base is not None else 0
    nc = cand.height if cand is not None else 0
    empty = np.zeros(0, dtype=np.int64)
    if nb == 0 or nc == 0:
        return Match(empty, empty, nb, nc, None, f"only in the {'candidate' if nb == 0 else 'baseline'}")
    shapes = (base.group_by(MATCH_KEY).len()
              .join(cand.group_by(MATCH_KEY).len(), on=MATCH_KEY, how="full", suffix="_candidate", coalesce=True,
                    nulls_equal=True)
              .with_columns(pl.col("len", "len_candidate").fill_null(0)).sort(MATCH_KEY, nulls_last=True))
    if (shapes["len"] == shapes["len_candidate"]).all():
        return Match(durations(base), durations(cand), nb, nc, None, None)
    common = shapes.filter((pl.col("len") > 0) & (pl.col("len_candidate") > 0))
    if common.height == 0:
        return Match(empty, empty, nb, nc, None, "the arms ran this family with different launch shapes or "
                     f"NVTX ranges ({_shape_list(base)} vs {_shape_list(cand)})")
    picked_b, picked_c, notes = [], [], []
    for row in common.iter_rows():  # one row per common launch shape
        shape, count_b, count_c = row[:7], row[7], row[8]
        keep = min(count_b, count_c)
        for frame, picked in ((base, picked_b), (cand, picked_c)):
            same_shape = frame.filter(pl.all_horizontal(pl.col(c).eq_missing(v) for c, v in zip(MATCH_KEY, shape)))
            picked.append(durations(same_shape)[-keep:])
        if count_b != count_c:
            notes.append(f"{shape_label(shape)}: last {keep} of {count_b} vs {count_c} calls")
    left_b = nb - sum(len(p) for p in picked_b)
    left_c = nc - sum(len(p) for p in picked_c)
    notes.append(f"{left_b} baseline and {left_c} candidate calls left out")
    return Match(np.concatenate(picked_b), np.concatenate(picked_c), nb, nc, "; ".join(notes), None)


def durations(calls: pl.DataFrame) -> np.ndarray:
    return calls.sort("start")["duration"].to_numpy()


def _shape_list(calls: pl.DataFrame, limit: int = 3) -> str:
    # Ties in count sort by shape and range, so that the same inputs always give the same text.
    shapes = calls.group_by(MATCH_KEY).len().sort(["len", *MATCH_KEY], descending=[True] + [False] * len(MATCH_KEY),
                                                  nulls_last=True)
    text = ", ".join(shape_label(r[:7]) for r in shapes.head(limit).iter_rows())
    return text + (", …" if shapes.height > limit else "")
