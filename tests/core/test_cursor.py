"""The cursor's interval helpers the plans share (core/cursor.py): positions to intervals, intervals joined."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from croupier.core.cursor import Interval, intervals_of, merge_intervals
from tests._budget import examples


def covered(ints: list[Interval]) -> set[int]:
    return {p for a, b in ints for p in range(a, b)}


def is_canonical(ints: list[Interval]) -> bool:
    """Sorted, each non-empty, and no two overlapping or touching (the fewest intervals for what they cover)."""
    return all(a < b for a, b in ints) and all(b < c for (_, b), (c, _) in zip(ints, ints[1:]))


@settings(max_examples=examples(300), deadline=None)
@given(st.sets(st.integers(0, 200)))
def test_intervals_of_covers_the_positions_with_the_fewest_intervals(positions: set[int]) -> None:
    v = np.array(sorted(positions), dtype=np.int64)
    ints = intervals_of(v)
    assert covered(ints) == positions
    assert is_canonical(ints), ints
    assert all(isinstance(x, int) for iv in ints for x in iv)  # Python ints, as a cursor holds


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 100), st.integers(1, 20)).map(lambda t: (t[0], t[0] + t[1]))))
def test_merge_intervals_joins_overlapping_and_touching_intervals(ints: list[Interval]) -> None:
    merged = merge_intervals(ints)
    assert covered(merged) == covered(ints)
    assert is_canonical(merged), merged


def test_the_examples_of_the_docstrings() -> None:
    assert intervals_of(np.array([3, 4, 5, 9])) == [(3, 6), (9, 10)]
    assert intervals_of(np.array([], dtype=np.int64)) == []
    assert merge_intervals([(5, 7), (0, 2), (2, 3)]) == [(0, 3), (5, 7)]
