"""Broken drivers of ``unmap`` (P-unmap, P-unmap-refused)."""

from __future__ import annotations

from extensible_kv.drivers import host
from extensible_kv.reaper import busy
from tests.meta.broken.base import Broken


class NoRollback(Broken):
    """unmap() forgets the mapping but leaves the pages mapped and accessible (free()'s munmap drops them with the
    reservation)."""

    breaks = "P-unmap"
    caught_by = ("test_failed_growth_rolls_back_completely", "test_unmap_returns_range_to_reserved")

    def unmap(self, va: int, size: int) -> None:
        if self.mappings.get(va, (None,))[0] != size:
            super().unmap(va, size)  # keeps the sub-range refusal
        del self.mappings[va]


class UnmapAcceptsAPrefix(Broken):
    """unmap() of the first part of a mapping unmaps that part and keeps the rest as a mapping."""

    breaks = "P-unmap-refused"
    caught_by = (
        "test_unmap_of_a_subrange_is_refused",
        "test_unmap_of_anything_but_one_whole_mapping_is_refused_and_changes_nothing",
    )

    def unmap(self, va: int, size: int) -> None:
        live = self.mappings.get(va)
        if live is not None and size < live[0]:
            self.mappings[va] = (size, live[1])
            self.mappings[va + size] = (live[0] - size, live[1])
            live[1].maps += 1
        super().unmap(va, size)


class UnmapTakesTheReservedTail(Broken):
    """P-unmap-refused. Breaks "Refused, changing nothing: ... a mapping and more": ``unmap`` of a range that starts
    with a mapping and runs on over granules that are only reserved unmaps the mapping, since the rest is "already
    unmapped" (it refuses the range when another mapping starts in it)."""

    breaks = "P-unmap-refused"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def do_unmap(self, va: int, size: int) -> None:
        live = self.mappings.get(va)
        if live is not None and live[0] < size and not any(va < m < va + size for m in self.mappings):
            return super().do_unmap(va, live[0])
        super().do_unmap(va, size)


class MappingTableOf32(Broken):
    """Many live mappings. Breaks "``unmap(va, size)`` takes exactly a range that one ``map`` call made ... and
    returns it to reserved": its table of live mappings holds 32 entries, and the 33rd map drops the oldest one, so
    that mapping can no longer be unmapped (and could be mapped over)."""

    breaks = "P-unmap"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    CAPACITY = 32

    def map(self, va: int, size: int, handle: host.HostHandle, offset: int = 0) -> None:
        super().map(va, size, handle, offset)
        with busy(), self.locked():
            while len(self.mappings) > self.CAPACITY:
                del self.mappings[next(iter(self.mappings))]


class UnmapTakesAMappingsTail(Broken):
    """P-unmap-refused. Breaks "Refused, changing nothing: part of a mapping": to let a tensor shrink from the top,
    ``unmap`` of a range that starts inside a mapping and ends exactly where the mapping ends puts that tail back to
    reserved and shortens the mapping's record. Parts at a mapping's start or in its middle are refused."""

    breaks = "P-unmap-refused"
    caught_by = ("test_every_range_over_mappings_and_gaps_is_judged_as_the_model_says",)

    def do_unmap(self, va: int, size: int) -> None:
        if va not in self.mappings:
            tail = next(((m, h) for m, (s, h) in self.mappings.items() if m < va < m + s and va + size == m + s), None)
            if tail is not None:
                m, h = tail
                if host.libc().mmap(va, size, host.PROT_NONE, host.RESERVED, -1, 0) != va:
                    self.fail("unmap", f"mmap(PROT_NONE, MAP_FIXED, {va:#x}, {size})")
                self.mappings[m] = (va - m, h)
                return
        super().do_unmap(va, size)


class UnmapPast300TakesTheMappingAtItsStart(Broken):
    """P-unmap-refused. Breaks "Refused, changing nothing: part of a mapping, a mapping and more": with more than 300
    live mappings the driver looks a mapping up by its start alone (its large table keeps sizes apart), and ``unmap``
    of a range that starts where a mapping starts unmaps that mapping, whatever size was asked: part of a mapping (or
    a mapping and more) is taken and the whole mapping goes. With 300 live mappings or fewer the size is checked."""

    breaks = "P-unmap-refused"
    caught_by = ("test_every_call_is_judged_as_the_model_says_at_every_count_of_live_objects",)

    LARGE = 300

    def do_unmap(self, va: int, size: int) -> None:
        live = self.mappings.get(va)
        if len(self.mappings) > self.LARGE and live is not None:
            size = live[0]
        super().do_unmap(va, size)
