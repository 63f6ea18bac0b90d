"""NVTX range nesting and point lookup over numpy arrays: which range is innermost at a time on a thread.

A kernel belongs to the ranges around the CUDA API call that launched it, on the launching thread, as in
Nsight Systems' own projection (target-linux-x64/reports/nvtx_gpu_proj_trace.py, which ships with nsys;
read in 2023.4.4). That script tests that the whole call lies inside the range; the call's start is enough
here, because a range that ends on its own thread cannot end while that thread is inside the launch call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NO_RANGE = -1


@dataclass(frozen=True)
class Nesting:
    """Per range (in the order given): nesting depth on its thread (0 = outermost) and the enclosing range."""

    depth: np.ndarray  # int32
    parent: np.ndarray  # int32 index, NO_RANGE at depth 0


@dataclass(frozen=True)
class RangeIndex:
    """Per thread, the times at which the innermost open range changes, and the range from then on."""

    threads: dict[int, tuple[np.ndarray, np.ndarray]]  # global_tid -> (change times, range index after)

    def innermost(self, global_tid: np.ndarray, time: np.ndarray) -> np.ndarray:
        """Index of the innermost range open at `time` on `global_tid` (NO_RANGE outside every range)."""
        found = np.full(time.shape, NO_RANGE, dtype=np.int32)
        if time.size and global_tid.min() == global_tid.max():  # one launching thread, the usual case
            self._look_up(int(global_tid[0]), slice(None), time, found)
            return found
        for tid in np.unique(global_tid).tolist():
            self._look_up(tid, global_tid == tid, time, found)
        return found

    def _look_up(self, tid: int, rows, time: np.ndarray, found: np.ndarray) -> None:
        if tid in self.threads:
            changes, after = self.threads[tid]
            position = np.searchsorted(changes, time[rows], side="right") - 1
            found[rows] = np.where(position >= 0, after[np.maximum(position, 0)], NO_RANGE)


def sweep(global_tid: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[Nesting, RangeIndex]:
    """Nest the closed ranges of each thread and index them for lookups, in one pass over the ranges.

    Ranges are visited by thread, start, and longest first, with a stack of the open ones. A range that
    overlaps the range below it without nesting in it (possible with start/end ranges) is closed when the
    stack unwinds past it, never earlier than the ranges above it; its parent is the nearest range that
    contains it.
    """
    count = start.size
    depth = np.zeros(count, dtype=np.int32)
    parent = np.full(count, NO_RANGE, dtype=np.int32)
    order = np.lexsort((-end, start, global_tid))
    threads: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    changes: list[int] = []
    after: list[int] = []
    stack: list[int] = []
    current_tid = None

    def close_until(time: int) -> None:
        while stack and end[stack[-1]] <= time:
            closed_at = max(int(end[stack.pop()]), changes[-1])
            changes.append(closed_at)
            after.append(stack[-1] if stack else NO_RANGE)

    def finish_thread() -> None:
        if current_tid is not None:
            close_until(np.iinfo(np.int64).max)
            threads[current_tid] = (np.asarray(changes, dtype=np.int64), np.asarray(after, dtype=np.int32))

    for i in order.tolist():  # over NVTX ranges (thousands), never over kernels
        tid = int(global_tid[i])
        if tid != current_tid:
            finish_thread()
            current_tid, changes, after, stack = tid, [], [], []
        if stack:
            close_until(int(start[i]))
        # The parent is the nearest open range that contains this one: a start/end range can overlap
        # the one below it on the stack without nesting in it.
        holder = next((j for j in reversed(stack) if end[j] >= end[i]), NO_RANGE)
        depth[i] = depth[holder] + 1 if holder != NO_RANGE else 0
        parent[i] = holder
        changes.append(int(start[i]))
        after.append(i)
        stack.append(i)
    finish_thread()
    return Nesting(depth, parent), RangeIndex(threads)


def propagate(parent: np.ndarray, depth: np.ndarray, own: np.ndarray) -> np.ndarray:
    """For each range, `own` of the nearest range among itself and its ancestors that has one (>= 0),
    else NO_RANGE. Used for "inside a range matching --window" and "inside which vLLM step"."""
    result = own.astype(np.int32, copy=True)
    for level in range(1, int(depth.max()) + 1 if depth.size else 0):
        at_level = np.flatnonzero((depth == level) & (result == NO_RANGE))
        result[at_level] = result[parent[at_level]]
    return result
