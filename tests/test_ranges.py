"""analyzer/ranges.py: nesting and innermost-range lookup, on hand-made ranges whose answers are known."""

from __future__ import annotations

import numpy as np

from kvtrace.analyzer.ranges import NO_RANGE, propagate, sweep


def ranges(*spans: tuple[int, int, int]):
    tid, start, end = (np.array(column, dtype=np.int64) for column in zip(*spans))
    return sweep(tid, start, end)


def test_nested_and_sibling_ranges():
    # thread 1: 0 [0, 100) holds 1 [10, 40) and 2 [50, 90); 2 holds 3 [60, 70). Thread 2: 4 [0, 50).
    nesting, index = ranges((1, 0, 100), (1, 10, 40), (1, 50, 90), (1, 60, 70), (2, 0, 50))
    assert nesting.depth.tolist() == [0, 1, 1, 2, 0]
    assert nesting.parent.tolist() == [NO_RANGE, 0, 0, 2, NO_RANGE]
    times = np.array([0, 5, 10, 39, 40, 60, 69, 70, 99, 100, 150])
    on_one = index.innermost(np.full(times.size, 1), times)
    # A range holds its start and not its end.
    assert on_one.tolist() == [0, 0, 1, 1, 0, 3, 3, 2, 0, NO_RANGE, NO_RANGE]
    mixed = index.innermost(np.array([1, 2, 2, 3]), np.array([65, 10, 50, 10]))
    assert mixed.tolist() == [3, 4, NO_RANGE, NO_RANGE]  # thread 3 has no ranges


def test_zero_length_and_shared_start():
    # 0 [10, 10) holds nothing; 1 [20, 40) and 2 [20, 30) start together, the longer one outside.
    nesting, index = ranges((1, 10, 10), (1, 20, 40), (1, 20, 30))
    assert nesting.parent.tolist() == [NO_RANGE, NO_RANGE, 1]
    assert index.innermost(np.full(4, 1), np.array([10, 20, 30, 39])).tolist() == [NO_RANGE, 2, 1, 1]


def test_overlapping_start_end_ranges_nest_by_containment():
    # nvtxRangeStart/End ranges may overlap: A [0, 10), B [2, 20) (not inside A), C [12, 15) (inside B only).
    nesting, index = ranges((1, 0, 10), (1, 2, 20), (1, 12, 15))
    assert nesting.parent.tolist() == [NO_RANGE, NO_RANGE, 1]
    assert nesting.depth.tolist() == [0, 0, 1]
    assert index.innermost(np.full(6, 1), np.array([1, 5, 11, 13, 17, 20])).tolist() == [0, 1, 1, 2, 1, NO_RANGE]
    # "Inside a range named like A" must not reach C through B.
    own = np.array([0, NO_RANGE, NO_RANGE])
    assert propagate(nesting.parent, nesting.depth, own).tolist() == [0, NO_RANGE, NO_RANGE]
