"""NVTX range nesting and point lookup over numpy arrays: which range is innermost at a time on a thread, and
which range a kernel's launch call was made in (`Launches`, by correlation id and process).

A kernel belongs to the ranges around the CUDA API call that launched it, on the launching thread, as in
Nsight Systems' own projection (target-linux-x64/reports/nvtx_gpu_proj_trace.py, which ships with nsys;
read in 2023.4.4). That script tests that the whole call lies inside the range; the call's start is enough
here, because a range that ends on its own thread cannot end while that thread is inside the launch call.
"""

from __future__ import annotations

import threading
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
    # Python lists: the loop reads one value at a time, which a NumPy array answers ten times slower.
    depth, parent = [0] * count, [NO_RANGE] * count
    order = np.lexsort((-end, start, global_tid))
    global_tid, start, end = global_tid.tolist(), start.tolist(), end.tolist()
    threads: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    changes: list[int] = []
    after: list[int] = []
    stack: list[int] = []
    current_tid = None

    def close_until(time: int) -> None:
        while stack and end[stack[-1]] <= time:
            closed_at = max(end[stack.pop()], changes[-1])
            changes.append(closed_at)
            after.append(stack[-1] if stack else NO_RANGE)

    def finish_thread() -> None:
        if current_tid is not None:
            close_until(np.iinfo(np.int64).max)
            threads[current_tid] = (np.asarray(changes, dtype=np.int64), np.asarray(after, dtype=np.int32))

    for i in order.tolist():  # over NVTX ranges, never over kernels
        tid = global_tid[i]
        if tid != current_tid:
            finish_thread()
            current_tid, changes, after, stack = tid, [], [], []
        if stack:
            close_until(start[i])
        # The parent is the nearest open range that contains this one: a start/end range can overlap
        # the one below it on the stack without nesting in it.
        if not stack:
            holder = NO_RANGE
        elif end[stack[-1]] >= end[i]:  # the usual case, nested in the top one
            holder = stack[-1]
        else:
            holder = next((j for j in reversed(stack) if end[j] >= end[i]), NO_RANGE)
        depth[i] = depth[holder] + 1 if holder != NO_RANGE else 0
        parent[i] = holder
        changes.append(start[i])
        after.append(i)
        stack.append(i)
    finish_thread()
    depth, parent = np.array(depth, dtype=np.int32), np.array(parent, dtype=np.int32)
    return Nesting(depth, parent), RangeIndex(threads)


def propagate(parent: np.ndarray, depth: np.ndarray, own: np.ndarray) -> np.ndarray:
    """For each range, `own` of the nearest range among itself and its ancestors that has one (>= 0),
    else NO_RANGE. Used for "inside a range matching --window" and "inside which vLLM step"."""
    result = own.astype(np.int32, copy=True)
    for level in range(1, int(depth.max()) + 1 if depth.size else 0):
        at_level = np.flatnonzero((depth == level) & (result == NO_RANGE))
        result[at_level] = result[parent[at_level]]
    return result


# ---- launch calls -------------------------------------------------------------------------------------

class Processes:
    """Small numbers for the processes that made launch calls (globalTid >> 24: pid, VM and hardware id, 40
    bits), so that a process number and a 32-bit correlationId fit one int64 launch key."""

    def __init__(self):
        self.numbers: dict[int, int] = {}
        self.lock = threading.Lock()  # launch calls are read on several threads

    def of(self, global_id: np.ndarray, *, add: bool) -> np.ndarray:
        """Per row, its process number; -1 for a process without launch calls when not `add`ing."""
        process = global_id >> 24
        if process.size and process.min() == process.max():  # one process per batch, the usual case
            return np.full(process.size, self._number(int(process[0]), add), dtype=np.int64)
        unique, inverse = np.unique(process, return_inverse=True)
        return np.array([self._number(int(p), add) for p in unique], dtype=np.int64)[inverse]

    def _number(self, process: int, add: bool) -> int:
        if add and process not in self.numbers:
            with self.lock:
                return self.numbers.setdefault(process, len(self.numbers))
        return self.numbers.get(process, -1)


def launch_key(number: np.ndarray, correlation: np.ndarray) -> np.ndarray:
    # CUPTI correlation ids are 32-bit and unique per process.
    return (number << 32) | correlation.astype(np.int64)


@dataclass(frozen=True)
class Launches:
    """Kernel-launching API calls in launch-key order (process number, then correlationId), cut into runs
    of calls with the same innermost NVTX range. A kernel carries its launch call's correlationId and
    process, so the run that holds its key gives its range; a NO_RANGE run opens and closes each process."""

    starts: np.ndarray  # first key of each run, ascending
    range: np.ndarray  # int32 innermost range of the run's calls
    processes: Processes

    @classmethod
    def of_sorted(cls, runs: list[tuple[np.ndarray, np.ndarray]], processes: Processes) -> Launches:
        starts = np.concatenate([s for s, _ in runs]) if runs else np.zeros(0, dtype=np.int64)
        found = np.concatenate([r for _, r in runs]) if runs else np.zeros(0, dtype=np.int32)
        numbers = np.arange(len(processes.numbers), dtype=np.int64)
        # Before a process's first launch and after its last, kernels (launched before the capture began)
        # are outside every range. Markers sort before real runs.
        markers = np.concatenate([numbers << 32, (numbers + 1) << 32])
        starts = np.concatenate([markers, starts])
        found = np.concatenate([np.full(markers.size, NO_RANGE, dtype=np.int32), found])
        order = np.argsort(starts, kind="stable")
        return cls(starts=starts[order], range=found[order], processes=processes)

    def innermost_of(self, correlation: np.ndarray, global_pid: np.ndarray) -> np.ndarray:
        """The innermost range of the launch calls of kernels with these correlation ids and processes."""
        number = self.processes.of(global_pid, add=False)
        if self.starts.size == 0:
            return np.full(correlation.size, NO_RANGE, dtype=np.int32)
        # A process without traced launch calls (number -1) has negative keys, below every run.
        run = np.searchsorted(self.starts, launch_key(number, correlation), side="right") - 1
        return np.where(run >= 0, self.range[np.maximum(run, 0)], NO_RANGE).astype(np.int32)


def launch_runs(key: np.ndarray, found: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs of sorted launch keys: a new run where the range or the process changes."""
    change = np.ones(key.size, dtype=bool)
    change[1:] = (found[1:] != found[:-1]) | ((key[1:] >> 32) != (key[:-1] >> 32))
    return key[change], found[change]
