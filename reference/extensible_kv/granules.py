"""Granule arithmetic for lockstep segments: which granules back a committed size, what a growth step adds and what a
shrink releases.

A reservation of ``num_segments * segment_bytes`` bytes is divided into equal segments; committing ``c`` bytes per
segment backs the byte ranges ``[i * segment_bytes, i * segment_bytes + c)``. Physical memory comes in granules of
``granularity`` bytes, so each range is widened outward to granule boundaries, and a granule that two ranges touch
(a granule straddling a segment boundary) is counted, and mapped, once.

Everything here is pure: intervals are ``(lo, hi)`` half-open pairs, sorted, disjoint and not touching.
"""

from __future__ import annotations

Interval = tuple[int, int]


def _merge_append(out: list[Interval], lo: int, hi: int) -> None:
    if out and lo <= out[-1][1]:
        out[-1] = (out[-1][0], max(out[-1][1], hi))
    else:
        out.append((lo, hi))


def merge(ranges: list[Interval]) -> list[Interval]:
    """``ranges`` sorted, with overlapping or touching intervals merged."""
    out: list[Interval] = []
    for lo, hi in sorted(ranges):
        _merge_append(out, lo, hi)
    return out


def committed_ranges(segment_bytes: int, num_segments: int, per_segment: int) -> list[Interval]:
    """The logical byte ranges committed when each segment holds ``per_segment`` bytes, merged where they touch."""
    out: list[Interval] = []
    if per_segment > 0:
        for i in range(num_segments):
            _merge_append(out, i * segment_bytes, i * segment_bytes + per_segment)
    return out


def new_ranges(segment_bytes: int, num_segments: int, old: int, new: int) -> list[Interval]:
    """The logical byte ranges a growth from ``old`` to ``new`` bytes per segment adds, merged where they touch."""
    out: list[Interval] = []
    if new > old:
        for i in range(num_segments):
            _merge_append(out, i * segment_bytes + old, i * segment_bytes + new)
    return out


def backed_granules(segment_bytes: int, num_segments: int, per_segment: int, granularity: int) -> list[Interval]:
    """Granule index intervals that must be mapped to back ``per_segment`` bytes in every segment."""
    out: list[Interval] = []
    for lo, hi in committed_ranges(segment_bytes, num_segments, per_segment):
        _merge_append(out, lo // granularity, -(-hi // granularity))
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The parts of intervals ``a`` not covered by intervals ``b`` (both sorted and disjoint)."""
    out: list[Interval] = []
    j = 0
    for lo, hi in a:
        while j < len(b) and b[j][1] <= lo:
            j += 1
        k = j
        cur = lo
        while k < len(b) and b[k][0] < hi:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < hi:
            out.append((cur, hi))
    return out


def new_granule_runs(segment_bytes: int, num_segments: int, old: int, new: int, granularity: int) -> list[Interval]:
    """Contiguous runs of granules that a growth from ``old`` to ``new`` bytes per segment must newly map."""
    return subtract(
        backed_granules(segment_bytes, num_segments, new, granularity),
        backed_granules(segment_bytes, num_segments, old, granularity),
    )


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The parts of intervals ``a`` also covered by intervals ``b`` (both sorted and disjoint)."""
    return subtract(a, subtract(a, b))


def released_granule_runs(
    segment_bytes: int, num_segments: int, old: int, new: int, granularity: int
) -> list[Interval]:
    """Contiguous runs of granules that a shrink from ``old`` to ``new`` bytes per segment unmaps: those backing
    ``old`` and not ``new`` (a granule still holding a byte below ``new`` in any segment stays). Growing back from
    ``new`` to ``old`` maps exactly these (``new_granule_runs(..., new, old, ...)``)."""
    return subtract(
        backed_granules(segment_bytes, num_segments, old, granularity),
        backed_granules(segment_bytes, num_segments, new, granularity),
    )


def chunks(lo: int, hi: int, max_granules: int | None) -> list[Interval]:
    """Split the granule run ``[lo, hi)`` into pieces of at most ``max_granules`` granules (``None``: one piece)."""
    if not max_granules or hi - lo <= max_granules:
        return [(lo, hi)]
    return [(s, min(s + max_granules, hi)) for s in range(lo, hi, max_granules)]
