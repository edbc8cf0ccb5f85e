"""The granule arithmetic of a shrink (``granules.released_granule_runs``, ``granules.intersect``) against a model of
sets of bytes and granules: a shrink releases exactly the granules that no kept byte touches, and growing back maps
exactly those."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extensible_kv import granules as gr

from .test_granules import MODEL, check, committed_bytes, granules_of, interval_lists, layouts, points


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
