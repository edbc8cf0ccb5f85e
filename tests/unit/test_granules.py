"""Granule arithmetic against a brute-force model built from sets of byte and granule indices."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extensible_kv import granules as gr

MODEL = settings(max_examples=200, deadline=None, database=None)


# -- the model ----------------------------------------------------------------------------------------------------
def committed_bytes(segment_bytes: int, num_segments: int, per_segment: int) -> set[int]:
    return {i * segment_bytes + b for i in range(num_segments) for b in range(per_segment)}


def granules_of(byte_set: set[int], granularity: int) -> set[int]:
    return {b // granularity for b in byte_set}


def points(intervals: list[tuple[int, int]]) -> set[int]:
    return {p for lo, hi in intervals for p in range(lo, hi)}


def intervals_of(point_set: set[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for p in sorted(point_set):
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def check(fn: str, args: tuple, actual: list[tuple[int, int]], expected_points: set[int]) -> None:
    """``actual`` is sorted, disjoint, non-touching, non-empty pieces whose union is ``expected_points``."""
    call = f"{fn}{args}"
    for lo, hi in actual:
        assert lo < hi, f"{call}: expected non-empty intervals, got {(lo, hi)} in {actual}"
    for (_, hi), (lo, _) in zip(actual, actual[1:]):
        assert hi < lo, f"{call}: expected sorted intervals with gaps between them, got {actual}"
    assert points(actual) == expected_points, f"{call}: expected {intervals_of(expected_points)}, got {actual}"


@st.composite
def layouts(draw):
    """(segment_bytes, num_segments, granularity, old, new) with old <= new <= segment_bytes."""
    segment_bytes = draw(st.integers(1, 5000))
    old = draw(st.integers(0, segment_bytes))
    return (
        segment_bytes,
        draw(st.integers(1, 5)),
        draw(st.sampled_from([1, 7, 64, 4096])),
        old,
        draw(st.integers(old, segment_bytes)),
    )


def interval_lists(limit: int = 80):
    return st.sets(st.integers(0, limit)).map(intervals_of)


# -- properties -----------------------------------------------------------------------------------------------------
@MODEL
@given(layouts())
def test_committed_ranges_are_the_merged_committed_bytes(layout):
    s, n, _, _, new = layout
    check("committed_ranges", (s, n, new), gr.committed_ranges(s, n, new), committed_bytes(s, n, new))


@MODEL
@given(layouts())
def test_new_ranges_are_exactly_the_bytes_a_growth_adds(layout):
    s, n, _, old, new = layout
    check(
        "new_ranges",
        (s, n, old, new),
        gr.new_ranges(s, n, old, new),
        committed_bytes(s, n, new) - committed_bytes(s, n, old),
    )


@MODEL
@given(layouts())
def test_backed_granules_are_the_granules_any_committed_byte_touches(layout):
    s, n, g, _, new = layout
    check(
        "backed_granules", (s, n, new, g), gr.backed_granules(s, n, new, g), granules_of(committed_bytes(s, n, new), g)
    )


@MODEL
@given(layouts())
def test_new_granule_runs_are_backed_new_minus_backed_old(layout):
    s, n, g, old, new = layout
    args = (s, n, old, new, g)
    runs = gr.new_granule_runs(*args)
    already = granules_of(committed_bytes(s, n, old), g)
    check("new_granule_runs", args, runs, granules_of(committed_bytes(s, n, new), g) - already)
    assert not points(runs) & already, (
        f"new_granule_runs{args}: expected no already-backed granule, got {sorted(points(runs) & already)}"
    )


@MODEL
@given(layouts(), st.integers(0, 5000))
def test_growth_steps_map_every_backed_granule_exactly_once(layout, mid):
    s, n, g, old, new = layout
    mid = old + mid % (new - old + 1)
    steps = [(0, old), (old, mid), (mid, new)]
    mapped = [p for a, b in steps for lo, hi in gr.new_granule_runs(s, n, a, b, g) for p in range(lo, hi)]
    expected = granules_of(committed_bytes(s, n, new), g)
    assert sorted(mapped) == sorted(expected), (
        f"new_granule_runs over steps {steps} ({s=}, {n=}, {g=}): expected each of {intervals_of(expected)} "
        f"once, got granules {sorted(mapped)}"
    )


@MODEL
@given(interval_lists(), interval_lists())
def test_subtract_is_set_difference(a, b):
    check("subtract", (a, b), gr.subtract(a, b), points(a) - points(b))


@MODEL
@given(st.integers(0, 1000), st.integers(1, 1000), st.none() | st.integers(0, 300))
def test_chunks_cover_the_run_exactly_with_the_fewest_pieces_of_at_most_max(lo, length, max_granules):
    hi = lo + length
    call = f"chunks({lo}, {hi}, {max_granules})"
    pieces = gr.chunks(lo, hi, max_granules)
    flat = [p for a, b in pieces for p in range(a, b)]
    assert flat == list(range(lo, hi)), f"{call}: expected pieces covering [{lo}, {hi}) in order, got {pieces}"
    limit = max_granules or length
    assert all(0 < b - a <= limit for a, b in pieces), f"{call}: expected pieces of 1..{limit}, got {pieces}"
    assert len(pieces) == -(-length // limit), f"{call}: expected {-(-length // limit)} pieces, got {pieces}"


# -- shrink: what it releases, and growth back maps exactly that -------------------------------------------------------
@MODEL
@given(layouts())
def test_a_shrink_releases_the_granules_no_kept_byte_touches(layout):
    s, n, g, new, old = layout  # new <= old: a shrink from old to new
    args = (s, n, old, new, g)
    kept = granules_of(committed_bytes(s, n, new), g)
    check(
        "released_granule_runs",
        args,
        gr.released_granule_runs(*args),
        granules_of(committed_bytes(s, n, old), g) - kept,
    )


@MODEL
@given(layouts())
def test_growing_back_after_a_shrink_maps_exactly_the_released_granules(layout):
    s, n, g, new, old = layout
    released = gr.released_granule_runs(s, n, old, new, g)
    regrown = gr.new_granule_runs(s, n, new, old, g)
    assert regrown == released, (
        f"shrink {old} -> {new} then grow back ({s=}, {n=}, {g=}): expected the growth to map the released runs "
        f"{released}, got {regrown}"
    )


@MODEL
@given(layouts(), st.integers(0, 5000))
def test_shrink_steps_release_every_backed_granule_once(layout, mid):
    s, n, g, low, high = layout
    mid = low + mid % (high - low + 1)
    steps = [(high, mid), (mid, low), (low, 0)]
    released = [p for a, b in steps for lo, hi in gr.released_granule_runs(s, n, a, b, g) for p in range(lo, hi)]
    expected = granules_of(committed_bytes(s, n, high), g)
    assert sorted(released) == sorted(expected), (
        f"released_granule_runs over steps {steps} ({s=}, {n=}, {g=}): expected each of {sorted(expected)} once, "
        f"got {sorted(released)}"
    )


@MODEL
@given(interval_lists(), interval_lists())
def test_intersect_is_set_intersection(a, b):
    check("intersect", (a, b), gr.intersect(a, b), points(a) & points(b))


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((200, 2, 200, 20, 64), [(1, 3), (4, 7)]),  # segments of 200 bytes, granules of 64: g0 and g3 stay
        ((100, 2, 100, 50, 64), [(3, 4)]),  # g1 and g2 hold segment 1's kept bytes 100..149: only g3 goes
        ((96, 2, 96, 32, 64), [(2, 3)]),  # the boundary granule 1 holds bytes of both segments: it stays
        ((128, 1, 128, 0, 64), [(0, 2)]),  # to zero: everything goes
        ((128, 1, 64, 64, 64), []),  # no change
    ],
)
def test_released_granule_runs_match_worked_examples(args, expected):
    assert gr.released_granule_runs(*args) == expected, (
        f"released_granule_runs{args}: expected {expected}, got {gr.released_granule_runs(*args)}"
    )


# -- exact examples -------------------------------------------------------------------------------------------------
G = 4096
EXAMPLES = [
    # 2 segments of 1.5 granules: granule 1 straddles the boundary and is backed (and newly mapped) once.
    ("committed_ranges", (6144, 2, 1), [(0, 1), (6144, 6145)]),
    ("committed_ranges", (6144, 2, 6144), [(0, 12288)]),
    ("committed_ranges", (6144, 2, 0), []),
    ("backed_granules", (6144, 2, 1, G), [(0, 2)]),
    ("backed_granules", (6144, 2, 6144, G), [(0, 3)]),
    ("new_granule_runs", (6144, 2, 0, 1, G), [(0, 2)]),
    ("new_granule_runs", (6144, 2, 1, 2048, G), []),
    ("new_granule_runs", (6144, 2, 2048, 6144, G), [(2, 3)]),
    ("new_ranges", (6144, 2, 2048, 6144), [(2048, 6144), (8192, 12288)]),
    ("new_ranges", (8192, 3, 0, G), [(0, G), (8192, 12288), (16384, 20480)]),
    ("new_ranges", (10, 2, 5, 5), []),
    ("new_granule_runs", (8192, 3, 0, G, G), [(0, 1), (2, 3), (4, 5)]),
    ("subtract", ([(0, 10)], [(2, 3), (5, 7)]), [(0, 2), (3, 5), (7, 10)]),
    ("subtract", ([(0, 4), (6, 9)], [(3, 7)]), [(0, 3), (7, 9)]),
    ("chunks", (0, 10, 4), [(0, 4), (4, 8), (8, 10)]),
    ("chunks", (0, 8, 4), [(0, 4), (4, 8)]),
    ("chunks", (3, 5, None), [(3, 5)]),
]


@pytest.mark.parametrize(("fn", "args", "expected"), EXAMPLES, ids=[f"{fn}{args}" for fn, args, _ in EXAMPLES])
def test_granule_arithmetic_matches_worked_examples(fn, args, expected):
    actual = getattr(gr, fn)(*args)
    assert actual == expected, f"{fn}{args}: expected {expected}, got {actual}"
