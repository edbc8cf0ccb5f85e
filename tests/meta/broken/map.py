"""Broken drivers of ``map`` (P-map-*)."""

from __future__ import annotations

import os
import weakref

from extensible_kv.drivers import host
from extensible_kv.drivers.records import check_inside
from extensible_kv.errors import DriverError
from tests.meta.broken.base import Broken, check_handle, check_map, mmap_handle


class NonLockstep(Broken):
    """map() silently skips the upper half of every reservation: later segments never get physical pages.

    set_access then makes the skipped range readable anonymous memory, so data round-trips and only the driver's
    own state (``accessible``) shows that the pages are not the mapped ones.
    """

    breaks = "P-map"
    caught_by = ("test_segments_grow_in_lockstep",)

    def map(self, va: int, size: int, handle: host.HostHandle, offset: int = 0) -> None:
        for r_va, r_size in self.reservations.items():
            if r_va <= va < r_va + r_size and va >= r_va + r_size // 2:
                self.mappings[va] = (size, handle)
                return
        super().map(va, size, handle, offset)


class DoubleMap(Broken):
    """map() replaces whatever is mapped at the address, as raw MAP_FIXED does, instead of refusing."""

    breaks = "P-map-overlap"
    caught_by = ("test_map_over_mapped_granule_is_refused",)

    def map(self, va: int, size: int, handle: host.HostHandle, offset: int = 0) -> None:
        got = host.libc().mmap(va, size, host.PROT_NONE, host.MAP_SHARED | host.MAP_FIXED, handle.fd, offset)
        assert got == va
        for m_va in [m for m, (s, _) in self.mappings.items() if m < va + size and va < m + s]:
            del self.mappings[m_va]
        self.mappings[va] = (size, handle)


class MapIgnoresOffset(Broken):
    """map() always maps the handle from its first byte."""

    breaks = "P-map-offset"
    caught_by = ("test_map_backs_the_range_with_the_handle_bytes_at_the_offset",)

    def map(self, va: int, size: int, handle: host.HostHandle, offset: int = 0) -> None:
        super().map(va, size, handle, 0)


class MapPrivate(Broken):
    """map() maps a private copy-on-write copy of the handle (MAP_PRIVATE): writes stay in this mapping."""

    breaks = "P-map-shared"
    caught_by = (
        "test_a_handle_mapped_at_two_addresses_shows_the_same_bytes_through_both",
        "test_the_kernel_maps_what_accessible_reports",
    )

    def map(self, va: int, size: int, handle: host.HostHandle, offset: int = 0) -> None:
        super().map(va, size, handle, offset)
        got = host.libc().mmap(va, size, host.PROT_NONE, host.MAP_PRIVATE | host.MAP_FIXED, handle.fd, offset)
        assert got == va


class MapGrantsAccess(Broken):
    """map() alone makes the range readable and writable."""

    breaks = "P-map-no-access"
    caught_by = ("test_mapping_alone_grants_no_access", "test_touching_a_granule_without_access_faults")

    def map(self, va: int, size: int, handle: host.HostHandle, offset: int = 0) -> None:
        super().map(va, size, handle, offset)
        host.libc().mprotect(va, size, host.PROT_READ | host.PROT_WRITE)


class MapClampsToReservation(Broken):
    """map() of a range running past its reservation's end maps the part that fits instead of refusing."""

    breaks = "P-map-inside"
    caught_by = ("test_map_outside_one_reservation_or_over_a_mapping_is_refused_and_changes_nothing",)

    def map(self, va: int, size: int, handle: host.HostHandle, offset: int = 0) -> None:
        for r_va, r_size in self.reservations.items():
            if r_va <= va < r_va + r_size:
                size = min(size, r_va + r_size - va)
        super().map(va, size, handle, offset)


class OverlapFromBelow(Broken):
    """map() refuses only a range that starts inside a live mapping; one that runs into a mapping from below
    replaces its first granules."""

    breaks = "P-map-overlap"
    caught_by = ("test_map_outside_one_reservation_or_over_a_mapping_is_refused_and_changes_nothing",)

    def map(self, va: int, size: int, handle: host.HostHandle, offset: int = 0) -> None:
        if any(m <= va < m + s for m, (s, _) in self.mappings.items()):
            raise DriverError("map", f"{va:#x} lies in a live mapping")
        saved = dict(self.mappings)
        self.mappings.clear()
        try:
            super().map(va, size, handle, offset)
        finally:
            self.mappings.update(saved)


class SecondMappingSharesAccess(Broken):
    """Access state. Breaks "``map`` ... without access" for a handle mapped at a second address: the new mapping
    gets the access the handle already has at another address."""

    breaks = "P-map-no-access"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def map(self, va: int, size: int, handle: host.HostHandle, offset: int = 0) -> None:
        others = [m for m, (_, h) in self.mappings.items() if h is handle]
        super().map(va, size, handle, offset)
        if any(self.accessible(m) for m in others):
            host.libc().mprotect(va, size, host.PROT_READ | host.PROT_WRITE)


class MapFillsTheHandle(Broken):
    """Access state. Breaks "one unmapped and mapped again shows its bytes": it fills fresh pages with the fill byte
    when a handle is mapped rather than when it is created, and does so at every map, erasing what was written."""

    breaks = "P-map-remap"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self._map_fill, self.fill_byte = self.fill_byte, None

    def map(self, va: int, size: int, handle: host.HostHandle, offset: int = 0) -> None:
        super().map(va, size, handle, offset)
        self.fill(handle.fd, handle.size, self._map_fill)


class MapHandleEndForgetsTheOffset(Broken):
    """Refusals. Breaks "Refused, changing nothing: ... [P-map-handle-end] ``offset + size`` past the handle's end":
    it checks ``size`` alone against the handle's size, so a mapping at an offset that runs past the handle's end is
    made (touching its tail raises SIGBUS)."""

    breaks = "P-map-handle-end"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def do_map(self, va: int, size: int, handle: host.HostHandle, offset: int) -> None:
        past_the_end = offset + size > handle.size >= size
        super().do_map(va, size, handle, 0 if past_the_end else offset)
        if (
            past_the_end
            and host.libc().mmap(va, size, host.PROT_NONE, host.MAP_SHARED | host.MAP_FIXED, handle.fd, offset) != va
        ):
            self.fail("map", f"mmap(MAP_FIXED, {va:#x}, {size}, fd={handle.fd}, offset={offset})")


class FreedAddressStaysRefused(Broken):
    """P-map-inside. Breaks "Refused, changing nothing: a range not inside one live reservation (... in a freed one)"
    by refusing too much: it remembers every freed reservation to refuse maps there, and never forgets one, so once
    the kernel hands the same addresses out again to a new ``reserve``, a valid ``map`` in the new reservation is
    refused."""

    breaks = "P-map-inside"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    state = {"_freed": list}

    def do_free(self, va: int, size: int) -> None:
        super().do_free(va, size)
        self._freed.append((va, size))

    def do_map(self, va: int, size: int, handle: host.HostHandle, offset: int) -> None:
        for f_va, f_size in self._freed:
            if f_va < va + size and va < f_va + f_size:
                raise DriverError("map", f"[{va:#x}, +{size}) lies in the freed reservation [{f_va:#x}, +{f_size})")
        super().do_map(va, size, handle, offset)


class SameMapAgainIsTaken(Broken):
    """P-map-overlap. Breaks "Refused, changing nothing: ... a range overlapping a live mapping (from below, from above,
    inside, exactly, around it)": a ``map`` that repeats a live mapping exactly (the same address, size, handle and
    offset) is taken as already done and returns, as an idempotent call of a mapping cache would. A map over a live
    mapping of another handle, offset or size is refused."""

    breaks = "P-map-overlap"
    caught_by = ("test_every_shape_of_every_range_call_matches_the_model",)

    state = {"_offsets": dict}

    def do_map(self, va: int, size: int, handle: host.HostHandle, offset: int) -> None:
        live = self.mappings.get(va)
        if live is not None and live[0] == size and live[1] is handle and self._offsets.get(va) == offset:
            return
        super().do_map(va, size, handle, offset)
        self._offsets[va] = offset


class ReleasedHandleStaysMappable(Broken):
    """P-map-released. Breaks "Refused, changing nothing: ... a handle already released that is still mapped
    elsewhere": ``release`` of a mapped handle only marks it and closes its memfd at its last ``unmap`` (its memory
    lives on until then anyway), and ``map`` takes a released handle whose memfd is still open, as if a mapping were a
    reference that kept the handle alive."""

    breaks = "P-map-released"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def do_release(self, handle: host.HostHandle) -> None:
        if handle.released or not handle.maps:
            return super().do_release(handle)
        handle.released = True  # the fd is closed by the last unmap

    def forget(self, va: int, live: tuple[int, host.HostHandle]) -> None:
        super().forget(va, live)
        handle = live[1]
        if handle.released and not handle.maps and handle.fd >= 0:
            fd, handle.fd = handle.fd, -1
            os.close(fd)

    def do_map(self, va: int, size: int, handle: host.HostHandle, offset: int) -> None:
        if handle.released and handle.maps and handle.fd >= 0:  # the bug: still mapped, so still alive
            handle.released = False
            try:
                super().do_map(va, size, handle, offset)
            finally:
                handle.released = True
            return
        super().do_map(va, size, handle, offset)


class SecondMappingIsPrivate(Broken):
    """P-map-shared. Breaks "Mappings share the handle's bytes: a handle mapped at two addresses shows the same bytes
    at both, and a write through one is read through the other": a handle mapped while it is already mapped elsewhere
    is mapped ``MAP_PRIVATE`` (an alias is taken for a read-only view), so a write through the second mapping is
    copied on write and never reaches the first. The first mapping of a handle is shared, as it should be."""

    breaks = "P-map-shared"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def do_map(self, va: int, size: int, handle: host.HostHandle, offset: int) -> None:
        if not handle.maps:
            return super().do_map(va, size, handle, offset)
        check_map(self, va, size, handle, offset)
        mmap_handle(self, va, size, handle, offset, flags=host.MAP_PRIVATE)


class LastUnmapDecommitsTheHandle(Broken):
    """P-map-remap. Breaks "A handle unmapped and mapped again (at the same or another address) shows its bytes
    still": to give physical pages back early, the last ``unmap`` of a live handle truncates its memfd to nothing and
    back to its size, so a handle mapped again reads zeros. A handle still mapped elsewhere keeps its bytes."""

    breaks = "P-map-remap"
    caught_by = ("test_handles_of_every_size_class_map_whole_in_parts_and_at_offsets",)

    def forget(self, va: int, live: tuple[int, host.HostHandle]) -> None:
        super().forget(va, live)
        handle = live[1]
        if not handle.released and not handle.maps:
            os.ftruncate(handle.fd, 0)
            os.ftruncate(handle.fd, handle.size)


class LargeHandlesMapWhole(Broken):
    """P-map-offset. Breaks "any other driver (the host's mmap) takes every offset and size within the handle; whichever
    a driver does, it does for every call": handles of 32 granules and more take a path written for the whole-handle
    native call, which refuses a mapping of part of the handle; smaller handles map at every offset and size."""

    breaks = "P-map-offset"
    caught_by = ("test_handles_of_every_size_class_map_whole_in_parts_and_at_offsets",)

    def do_map(self, va: int, size: int, handle: host.HostHandle, offset: int) -> None:
        if handle.size >= 32 * self.granularity() and (offset or size != handle.size):
            raise DriverError(
                "map", f"{handle!r} maps whole only: offset {offset}, size {size} of a {handle.size}-byte handle"
            )
        super().do_map(va, size, handle, offset)


class OverlapChecksTheEnds(Broken):
    """P-map-overlap. Breaks "Refused, changing nothing: ... a range overlapping a live mapping (from below, from
    above, inside, exactly, around it)": it looks up which live mapping holds the range's first byte and which its
    last (the lookup a page table does), so a range around a live mapping, starting below it and ending above it, is
    taken and ``MAP_FIXED`` silently replaces the mapping inside. Overlaps from below, from above, inside and exactly
    are refused."""

    breaks = "P-map-overlap"
    caught_by = ("test_every_range_over_mappings_and_gaps_is_judged_as_the_model_says",)

    def do_map(self, va: int, size: int, handle: host.HostHandle, offset: int) -> None:
        check_inside("map", va, size, self.reservations.items())
        for m_va, (m_size, _) in self.mappings.items():
            if m_va <= va < m_va + m_size or m_va < va + size <= m_va + m_size:
                raise DriverError("map", f"[{va:#x}, +{size}) overlaps the live mapping [{m_va:#x}, +{m_size})")
        check_handle(handle, size, offset)
        mmap_handle(self, va, size, handle, offset)


class SecondMappingFromTheStart(Broken):
    """P-map. Breaks "Back ``[va, va+size)`` with bytes ``[offset, offset+size)`` of ``handle``" for a handle mapped at
    a second address: a handle already mapped is mapped again as a duplicate of its mapping (what ``mremap`` with an
    old size of 0 makes), which starts where the handle starts, so the offset asked is dropped. A handle's first
    mapping takes its offset."""

    breaks = "P-map"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def do_map(self, va: int, size: int, handle: host.HostHandle, offset: int) -> None:
        if not handle.maps:
            super().do_map(va, size, handle, offset)
            return
        check_map(self, va, size, handle, offset)
        mmap_handle(self, va, size, handle, 0)


class LargeMappingsArePrivate(Broken):
    """P-map-shared. Breaks "Mappings share the handle's bytes: a handle mapped at two addresses shows the same bytes at
    both, and a write through one is read through the other": mappings of 16 granules and more take a prefaulting
    path whose ``mmap`` flags were copied from the reserve path, ``MAP_PRIVATE``, so a write through such a mapping is
    copied on write and reaches neither the handle nor its other mappings. Smaller mappings are shared."""

    breaks = "P-map-shared"
    caught_by = ("test_handles_of_every_size_class_map_whole_in_parts_and_at_offsets",)

    LARGE = 16

    def do_map(self, va: int, size: int, handle: host.HostHandle, offset: int) -> None:
        if size < self.LARGE * self.granularity():
            super().do_map(va, size, handle, offset)
            return
        check_map(self, va, size, handle, offset)
        mmap_handle(self, va, size, handle, offset, host.MAP_PRIVATE)


class FirstMapFixesTheHandlesLayout(Broken):
    """P-map-offset. Breaks "any other driver (the host's mmap) takes every offset and size within the handle;
    whichever a driver does, it does for every call": like a backend that lays a handle's pages out at its first
    ``map``, a handle first mapped whole is marked as a whole-handle allocation, and a later ``map`` of part of it is
    refused. A handle first mapped in part maps every part and the whole afterwards."""

    breaks = "P-map-offset"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    state = {"_layout": weakref.WeakKeyDictionary}

    def do_map(self, va: int, size: int, handle: host.HostHandle, offset: int) -> None:
        whole = offset == 0 and size == handle.size
        if self._layout.get(handle) and not whole:
            check_map(self, va, size, handle, offset)
            raise DriverError("map", f"offset {offset} + size {size}: {handle!r} was mapped whole; map all of it")
        super().do_map(va, size, handle, offset)
        self._layout.setdefault(handle, whole)
