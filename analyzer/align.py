"""Which kernels to compare: vLLM step phases and user windows (pairing the calls is analyzer.pairing).

The loader has already tied each kernel to the innermost NVTX range around its launch (analyzer.ranges,
as Nsight Systems' nvtx_gpu_proj_trace.py does). Kernels replayed from a CUDA graph carry the
correlationId of their cudaGraphLaunch, so they land in the range around the launch (vLLM's per-step
range), not in ranges opened during capture. Everything here works per range or per signature and
touches per-call rows only to filter them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import polars as pl
import regex

from kvtrace.analyzer import ranges
from kvtrace.analyzer.classify import MATCH_TIMEOUT_S
from kvtrace.analyzer.load import Trace
from kvtrace.analyzer.names import NameKey
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
    names: NameKey = NameKey()  # which part of a range name pairs calls (analyzer.names)
    arm: str | None = None  # regex over enclosing range names: this arm's part of its trace (diff --arms)

    def describe(self) -> list[str]:
        parts = []
        if self.nvtx:
            parts.append(f"kernels launched inside NVTX ranges matching /{self.nvtx}/")
        if self.arm:
            parts.append(f"arm /{self.arm}/: kernels launched inside NVTX ranges matching it")
        if self.time_ns != (None, None):
            start, end = self.time_ns
            parts.append(f"kernels starting in [{_seconds(start)}, {_seconds(end)}) of each trace's timeline")
        if self.phase:
            parts.append(f"kernels of vLLM {self.phase} steps")
        if self.skip_warmup:
            parts.append(f"first {self.skip_warmup} calls per family, launch shape and NVTX range dropped as warm-up")
        if self.last is not None:
            parts.append(f"last {self.last} calls per family, launch shape and NVTX range kept")
        return parts + self.names.describe()


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
        ns = float(match.group(1)) * scale
        if ns >= 2 ** 63:  # past int64 nanoseconds (292 years), where timestamps end; inf for 400 digits
            raise KvtraceError(f"--time: {part[:20]}{'…' if len(part) > 20 else ''} is past any trace's timeline "
                              "(int64 nanoseconds); give a time in its span")
        return int(ns)

    if ":" not in text:
        raise KvtraceError(f"--time {text!r}: write START:END in seconds, e.g. 1.5:3 (either side may be empty)")
    start, end = (one(p) for p in text.split(":", 1))
    if start is not None and end is not None and end <= start:
        raise KvtraceError(f"--time {text!r}: END must be after START")
    return start, end


def range_matches(trace: Trace, pattern: regex.Pattern, option: str = "--window") -> np.ndarray:
    """Per range of the trace: it, or a range around it, has a name matching `pattern`. Matched once per
    distinct name by the `regex` package with recipe patterns' time limit per match: a user's (.+)+Z backtracks
    without end on a long step name."""
    table = trace.ranges

    def matches(name: str) -> bool:
        try:
            return pattern.search(name, timeout=MATCH_TIMEOUT_S) is not None
        except TimeoutError:
            raise KvtraceError(f"{option} {pattern.pattern!r} took over {MATCH_TIMEOUT_S:g} s on an NVTX name of "
                               f"{len(name):,} characters (nested quantifiers such as (a+)+ backtrack without end): "
                               "simplify the pattern") from None

    named = np.array([matches(name) for name in trace.range_names] + [False])
    own = np.where(named[trace.range_name_codes], 0, ranges.NO_RANGE)
    return ranges.propagate(table["parent"].to_numpy(), table["depth"].to_numpy(), own) == 0


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
    table = trace.ranges
    # Each distinct name is parsed once (steps of the same batch share their name, and an hour of serving has
    # hundreds of thousands of step ranges); per range, only codes are gathered.
    m = pl.col("name").str.extract_groups(VLLM_STEP.pattern)
    names = pl.DataFrame({"name": pl.Series([*trace.range_names, None], dtype=pl.Utf8)}).select(
        "name",
        m.struct.field("1").cast(pl.Int64).alias("context_requests"),
        m.struct.field("2").cast(pl.Int64, strict=False).alias("context_tokens"),
        m.struct.field("3").cast(pl.Int64).alias("generation_requests"),
        m.struct.field("4").cast(pl.Int64, strict=False).alias("generation_tokens"))
    names = names.with_columns(step_kind(pl.col("context_requests"), pl.col("generation_requests")).alias("phase"))
    codes = trace.range_name_codes
    is_step = names["context_requests"].is_not_null().to_numpy()[codes]
    step_range = ranges.propagate(table["parent"].to_numpy(), table["depth"].to_numpy(),
                                  np.where(is_step, table["range"].to_numpy(), ranges.NO_RANGE))
    inside = np.flatnonzero(step_range != ranges.NO_RANGE)
    step_of = step_range[inside]
    step = names[codes[step_of]]
    return pl.DataFrame({"range": table["range"].gather(inside), "step_range": pl.Series(step_of, dtype=pl.Int32),
                         "step": step["name"], "step_start": table["start"].gather(step_of), "phase": step["phase"],
                         "context_tokens": step["context_tokens"], "generation_tokens": step["generation_tokens"]})


def window_calls(trace: Trace, window: Window, group_of_cell: np.ndarray) -> np.ndarray | None:
    """Which of a trace's calls (in the order of its cells, analyzer.calls) are inside the window; None when
    the window keeps every call. Trimming (--skip-warmup, --last) comes last and counts calls per group of
    cells (`group_of_cell`: the family, rank and match key of each of the trace's cells) in start order."""
    calls = trace.calls
    keep = None

    def narrow(inside: np.ndarray) -> np.ndarray:
        return inside if keep is None else keep & inside

    for option, expression in (("--window", window.nvtx), ("--arms", window.arm)):
        if expression:
            try:
                pattern = regex.compile(expression)
            except regex.error as error:
                raise KvtraceError(f"{option} {expression!r} is not a valid regex ({error})") from None
            keep = narrow(np.isin(calls.range, np.flatnonzero(range_matches(trace, pattern, option))))
    start, end = window.time_ns
    if start is not None or end is not None:
        # Starts are kept in start order, so the window is a span of ranks.
        low = int(np.searchsorted(calls.start, start)) if start is not None else 0
        high = int(np.searchsorted(calls.start, end)) if end is not None else calls.count
        keep = narrow((calls.rank >= low) & (calls.rank < high))
    if window.phase:
        in_phase = steps(trace).filter(pl.col("phase") == window.phase)["range"].to_numpy()
        keep = narrow(np.isin(calls.range, in_phase))
    if window.skip_warmup or window.last is not None:
        kept = np.arange(calls.count) if keep is None else np.flatnonzero(keep)
        group = np.repeat(group_of_cell, np.diff(calls.offsets))[kept]
        by_group = np.lexsort((calls.rank[kept], group))  # a call's position in its group is its launch order
        count = np.bincount(group, minlength=int(group_of_cell.max(initial=-1)) + 1)
        position = np.empty(kept.size, dtype=np.int64)
        position[by_group] = np.arange(kept.size) - (np.cumsum(count) - count)[group[by_group]]
        trimmed = position >= window.skip_warmup
        if window.last is not None:
            trimmed &= position >= count[group] - window.last
        keep = np.zeros(calls.count, dtype=bool)
        keep[kept[trimmed]] = True
    return keep


# Calls pair only within the same launch shape and the same innermost NVTX range: a decode kernel keeps
# its grid across context lengths, so the shape alone cannot tell a 2k-token call from a 32k one, while
# the range (`kvtrace:decode ctx=2048`, vLLM's `execute_context_0(0)_generation_8(8)`) can. Both are
# codes of the comparison's pairing.Vocabulary; trimming (--skip-warmup, --last) counts calls per family
# and this key.
MATCH_KEY = ["shape", "nvtx"]
