"""A fourth set of deliberately broken host drivers, written from the protocol's text (``drivers/_protocol.py``) and the
host driver by a reader outside the rules, without reading them.

Same layout as ``tests.meta.broken_third``: each class breaks one sentence or clause of the protocol, quoted with its
id in the class docstring, the way a backend's own bug might (mostly only in particular shapes, sequences or states),
and comes with a proof that drives a driver built by the factory it is given and returns what it observed; ``CASES``
pairs every factory with the id it breaks, its proof and what the intact host driver observes. Use a driver as
``extensible-kv check-driver tests.meta.broken_fourth:<factory>``.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from extensible_kv.drivers.host import (
    MAP_FIXED,
    MAP_PRIVATE,
    MAP_SHARED,
    PROT_NONE,
    PROT_READ,
    PROT_WRITE,
    MIB,
    HostDriver,
    HostHandle,
    libc,
)
from extensible_kv.drivers.records import check_free, check_inside, check_no_overlap, check_one_mapping
from extensible_kv.errors import DriverError, DriverOutOfMemory
from extensible_kv.reaper import busy
from tests.meta.broken_protocol import (
    BUDGET,
    RACE_TRIES,
    RACE_WINDOW_S,
    RESERVED,
    _Broken,
    _race,
    Case,
    check_map,
    interrupt_at_line,
    kernel_holds,
    kernel_ranges,
    mmap_handle,
    outcome,
    poke,
    read_byte,
    tidy,
)


# -- mappings --------------------------------------------------------------------------------------------------------
class MapEndCheckIgnoresTheOffset(_Broken):
    """P-map-handle-end. Breaks "Refused, changing nothing: ... ``offset + size`` past the handle's end": its check is
    ``size > handle.size``, the offset left out, so a mapping at a non-zero offset that runs past the handle's end is
    taken (the kernel maps a memfd past its end without complaint; touching that part raises SIGBUS). At offset 0 the
    check is right."""

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        check_inside("map", va, size, self.reservations.items())
        check_no_overlap(va, size, ((m_va, m_size) for m_va, (m_size, _) in self.mappings.items()))
        if handle.released:
            raise DriverError("map", f"{handle!r} was released; map a live handle")
        if size > handle.size:  # the bug: offset + size
            raise DriverError("map", f"size {size} exceeds the {handle.size}-byte handle")
        mmap_handle(self, va, size, handle, offset)


def prove_map_end_check_ignores_the_offset(make: Callable[[], HostDriver]) -> list[str]:
    """A handle of 2 granules: the outcomes of mapping 3 granules of it at offset 0, then 2 granules at offset 1."""
    d = make()
    g = d.granularity()
    r = d.reserve(3 * g, g)
    h = d.create(2 * g)
    try:
        return [outcome(d.map, r, 3 * g, h, 0), outcome(d.map, r, 2 * g, h, g)]
    finally:
        tidy(d, [(r, 3 * g)], [h])


class ReleasedHandleStaysMappable(_Broken):
    """P-map-released. Breaks "Refused, changing nothing: ... a handle already released that is still mapped
    elsewhere": ``release`` of a mapped handle only marks it and closes its memfd at its last ``unmap`` (its memory
    lives on until then anyway), and ``map`` takes a released handle whose memfd is still open, as if a mapping were a
    reference that kept the handle alive."""

    def do_release(self, handle: HostHandle) -> None:
        if handle.released or not handle.maps:
            return super().do_release(handle)
        handle.released = True  # the fd is closed by the last unmap

    def forget(self, va: int, live: tuple[int, HostHandle]) -> None:
        super().forget(va, live)
        handle = live[1]
        if handle.released and not handle.maps and handle.fd >= 0:
            fd, handle.fd = handle.fd, -1
            os.close(fd)

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        if handle.released and handle.maps and handle.fd >= 0:  # the bug: still mapped, so still alive
            handle.released = False
            try:
                super().do_map(va, size, handle, offset)
            finally:
                handle.released = True
            return
        super().do_map(va, size, handle, offset)


def prove_released_handle_stays_mappable(make: Callable[[], HostDriver]) -> str:
    """A handle mapped once and released: the outcome of mapping it at a second address."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.release(h)
        return outcome(d.map, r + g, g, h)
    finally:
        tidy(d, [(r, 2 * g)], [h])


class MapJoinsAnAccessibleNeighbour(_Broken):
    """P-map-no-access. Breaks "The new mapping is not accessible until ``set_access``": a tensor grows upwards, so a
    mapping made right above an accessible mapping is given the same access at once, to let the kernel merge the two
    (fewer VMAs); a mapping with no accessible neighbour just below it is made without access, as it should be."""

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        super().do_map(va, size, handle, offset)
        below = any(m + s == va for m, (s, _) in self.mappings.items())
        if below and HostDriver.accessible(self, va - 1):
            if libc().mprotect(va, size, PROT_READ | PROT_WRITE) != 0:
                self.fail("map", f"mprotect({va:#x}, {size}, RW)")


def prove_map_joins_an_accessible_neighbour(make: Callable[[], HostDriver]) -> list[bool]:
    """Two adjacent one-granule mappings of two handles, the lower given access before the upper is mapped: whether
    each is accessible."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h1, h2 = d.create(g), d.create(g)
    try:
        d.map(r, g, h1)
        d.set_access(r, g)
        d.map(r + g, g, h2)
        return [d.accessible(r), d.accessible(r + g)]
    finally:
        tidy(d, [(r, 2 * g)], [h1, h2])


class SecondMappingIsPrivate(_Broken):
    """P-map-shared. Breaks "Mappings share the handle's bytes: a handle mapped at two addresses shows the same bytes
    at both, and a write through one is read through the other": a handle mapped while it is already mapped elsewhere
    is mapped ``MAP_PRIVATE`` (an alias is taken for a read-only view), so a write through the second mapping is
    copied on write and never reaches the first. The first mapping of a handle is shared, as it should be."""

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        if not handle.maps:
            return super().do_map(va, size, handle, offset)
        check_map(self, va, size, handle, offset)
        mmap_handle(self, va, size, handle, offset, flags=MAP_PRIVATE)


def prove_second_mapping_is_private(make: Callable[[], HostDriver]) -> int:
    """A handle mapped at two adjacent addresses, both given access, 0x3C written through the second: the byte read
    through the first."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.map(r + g, g, h)
        d.set_access(r, 2 * g)
        poke(d, r + g, 0x3C)
        return read_byte(d, r)
    finally:
        tidy(d, [(r, 2 * g)], [h])


class LastUnmapDecommitsTheHandle(_Broken):
    """P-map-remap. Breaks "A handle unmapped and mapped again (at the same or another address) shows its bytes
    still": to give physical pages back early, the last ``unmap`` of a live handle truncates its memfd to nothing and
    back to its size, so a handle mapped again reads zeros. A handle still mapped elsewhere keeps its bytes."""

    def forget(self, va: int, live: tuple[int, HostHandle]) -> None:
        super().forget(va, live)
        handle = live[1]
        if not handle.released and not handle.maps:
            os.ftruncate(handle.fd, 0)
            os.ftruncate(handle.fd, handle.size)


def prove_last_unmap_decommits_the_handle(make: Callable[[], HostDriver]) -> int:
    """A handle mapped, given access, 0x5A written to its first byte, unmapped and mapped again: its first byte."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.set_access(r, g)
        poke(d, r, 0x5A)
        d.unmap(r, g)
        d.map(r, g, h)
        d.set_access(r, g)
        return read_byte(d, r)
    finally:
        tidy(d, [(r, g)], [h])


class UnmapTakesTheReservedTail(_Broken):
    """P-unmap-refused. Breaks "Refused, changing nothing: ... a mapping and more": ``unmap`` of a range that starts
    with a mapping and runs on over granules that are only reserved unmaps the mapping, since the rest is "already
    unmapped" (it refuses the range when another mapping starts in it)."""

    def do_unmap(self, va: int, size: int) -> None:
        live = self.mappings.get(va)
        if live is not None and live[0] < size and not any(va < m < va + size for m in self.mappings):
            return super().do_unmap(va, live[0])
        super().do_unmap(va, size)


def prove_unmap_takes_the_reserved_tail(make: Callable[[], HostDriver]) -> str:
    """A one-granule mapping at the start of a 2-granule reservation: the outcome of unmapping both granules."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        return outcome(d.unmap, r, 2 * g)
    finally:
        tidy(d, [(r, 2 * g)], [h])


class RefusedMapKeepsItsCount(_Broken):
    """P-refusal-unchanged. Breaks "A refused call leaves every observable as it was: ... ``mem_info``": ``map`` counts
    the new mapping on its handle before it checks the handle's end (so an exception can only leave the count high),
    and the refusal for a range past the handle's end does not take the count back: the handle is then never unmapped
    everywhere, and its bytes never come back to ``mem_info`` after its release."""

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        check_inside("map", va, size, self.reservations.items())
        check_no_overlap(va, size, ((m_va, m_size) for m_va, (m_size, _) in self.mappings.items()))
        if handle.released:
            raise DriverError("map", f"{handle!r} was released; map a live handle")
        handle.maps += 1  # counted first: an exception below can only leave it high
        if offset + size > handle.size:
            raise DriverError("map", f"offset {offset} + size {size} exceeds the {handle.size}-byte handle")
        live = (size, handle)
        try:
            self.mappings[va] = live
            if libc().mmap(va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, handle.fd, offset) != va:
                self.fail("map", f"mmap(MAP_FIXED, {va:#x}, {size}, fd={handle.fd}, offset={offset})")
        except BaseException:
            if self.mappings.get(va) is live:
                libc().mmap(va, size, PROT_NONE, RESERVED, -1, 0)
                del self.mappings[va]
            handle.maps -= 1
            raise


def prove_refused_map_keeps_its_count(make: Callable[[], HostDriver]) -> list[object]:
    """The outcome of mapping a one-granule handle at offset 1 granule, then ``mem_info`` once it is released."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        refused = outcome(d.map, r, g, h, g)
        d.release(h)
        return [refused, d.mem_info()]
    finally:
        tidy(d, [(r, g)], [h])


# -- reservations ----------------------------------------------------------------------------------------------------
class FreeTrustsItsRecordedSize(_Broken):
    """P-free-refused. Breaks "Refused, changing nothing: ... a range around one": it frees the size it recorded for
    the reservation at ``va`` and checks the caller's size only against leaking (a size below the reservation's is
    refused), so ``free`` of a range that starts at a reservation and runs past its end frees the reservation."""

    def do_free(self, va: int, size: int) -> None:
        reserved = self.reservations.get(va)
        if reserved is not None and reserved < size:  # the bug: only a smaller size is refused
            size = reserved
        super().do_free(va, size)


def prove_free_trusts_its_recorded_size(make: Callable[[], HostDriver]) -> str:
    """A one-granule reservation: the outcome of freeing 2 granules from its start."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    freed = outcome(d.free, r, 2 * g)
    tidy(d, [] if freed == "done" else [(r, g)], [])
    return freed


class FreeKeepsSmallReservations(_Broken):
    """P-free-kernel. Breaks "Afterwards nothing of the range ... is held: on the host the kernel maps nothing there,
    and the process's address space is as before the ``reserve``": reservations of up to 4 granules are kept in a cache
    (the kernel keeps them reserved) for the next ``reserve`` of the same size, up to 8 of them; they are no
    reservation of the driver meanwhile (a ``map`` there is refused). Larger ones are given back."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._cached: dict[int, list[int]] = {}

    def do_free(self, va: int, size: int) -> None:
        if size > 4 * self.granularity() or sum(map(len, self._cached.values())) >= 8:
            return super().do_free(va, size)
        check_free(va, size, self.reservations.get(va) == size, self.mappings)
        del self.reservations[va]
        self._cached.setdefault(size, []).append(va)

    def do_reserve(self, size: int, alignment: int) -> int:
        for va in self._cached.get(size, []):
            if va % alignment == 0:
                self._cached[size].remove(va)
                self.reservations[va] = size
                return va
        return super().do_reserve(size, alignment)


def prove_free_keeps_small_reservations(make: Callable[[], HostDriver]) -> int:
    """Bytes of a freed one-granule reservation the kernel still holds."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    d.free(r, g)
    held = kernel_holds(r, r + g)
    for va in getattr(d, "_cached", {}).pop(g, []):  # what the broken driver kept
        libc().munmap(va, g)
    return held


class ReservationCountsMappingsAtItsStart(_Broken):
    """P-free. Breaks "Return the reservation ``[va, va+size)`` ... once nothing is mapped in it": it counts the live
    mappings of each reservation, adding one at ``map`` (the reservation that holds the range) but taking one away at
    ``unmap`` only when a reservation starts at the mapping's address; a reservation that had a mapping anywhere but
    at its start keeps counting it, and ``free`` refuses it once it is empty again."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._mapped_in: dict[int, int] = {}

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        super().do_map(va, size, handle, offset)
        for r_va, r_size in self.reservations.items():
            if r_va <= va < r_va + r_size:
                self._mapped_in[r_va] = self._mapped_in.get(r_va, 0) + 1

    def forget(self, va: int, live: tuple[int, HostHandle]) -> None:
        super().forget(va, live)
        if va in self._mapped_in:  # the bug: the reservation is looked up by the mapping's address
            self._mapped_in[va] -= 1

    def do_free(self, va: int, size: int) -> None:
        if self._mapped_in.get(va):
            raise DriverError("free", f"reservation {va:#x} still has {self._mapped_in[va]} mapping(s)")
        super().do_free(va, size)
        self._mapped_in.pop(va, None)


def prove_reservation_counts_mappings_at_its_start(make: Callable[[], HostDriver]) -> str:
    """A 2-granule reservation whose second granule was mapped and unmapped: the outcome of freeing it."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(g)
    d.map(r + g, g, h)
    d.unmap(r + g, g)
    freed = outcome(d.free, r, 2 * g)
    tidy(d, [] if freed == "done" else [(r, 2 * g)], [h])
    return freed


class ReserveLeavesTheRemainderReadWrite(_Broken):
    """P-reserve-inaccessible. Breaks "Nothing in it is accessible until mapped and granted access (on the host,
    touching it faults)": it reserves read-write (``MAP_NORESERVE`` overcommits it anyway) and takes access away with
    ``mprotect(va, size // alignment * alignment, PROT_NONE)``, so the last part of a size that is not a multiple of
    the alignment stays readable and writable anonymous memory until it is mapped. (Emulated: the host's reserve, then
    access granted to that remainder.)"""

    def do_reserve(self, size: int, alignment: int) -> int:
        va = super().do_reserve(size, alignment)
        tail = size % alignment
        if tail and libc().mprotect(va + size - tail, tail, PROT_READ | PROT_WRITE) != 0:
            self.fail("reserve", f"mprotect({va + size - tail:#x}, {tail}, RW)")
        return va


def prove_reserve_leaves_the_remainder_read_write(make: Callable[[], HostDriver]) -> list[str]:
    """The permissions the kernel shows over a reservation of 3 granules aligned to 2."""
    d = make()
    g = d.granularity()
    r = d.reserve(3 * g, 2 * g)
    try:
        return sorted({perms for lo, hi, perms, _ in kernel_ranges() if lo < r + 3 * g and r < hi})
    finally:
        d.free(r, 3 * g)


# -- physical memory -------------------------------------------------------------------------------------------------
class SecondOutOfMemoryIsAPlainError(_Broken):
    """P-oom. Breaks "A call refused for lack of memory raises ``DriverOutOfMemory``": like a sticky native error
    state, a ``create`` refused for lack of memory right after another one (no ``create`` taken in between) raises a
    plain ``DriverError`` saying the allocator is still failing; the first refusal is ``DriverOutOfMemory``."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._failing = False

    def create(self, size: int) -> HostHandle:
        try:
            handle = super().create(size)
        except DriverOutOfMemory as exc:
            if self._failing:
                raise DriverError("create", f"{size} bytes: the allocator is still failing ({exc.detail})") from exc
            self._failing = True
            raise
        self._failing = False
        return handle


def prove_second_out_of_memory_is_a_plain_error(make: Callable[[], HostDriver]) -> list[str]:
    """The outcomes of two creates, each of one granule more than the free bytes."""
    d = make()
    g = d.granularity()
    return [outcome(d.create, d.mem_info()[0] + g), outcome(d.create, d.mem_info()[0] + g)]


class OnlyThePrimaryMappingReturnsMemory(_Broken):
    """P-release-returns. Breaks "Once the handle is released and unmapped everywhere, the bytes ``create`` took are
    free again (``mem_info``...)": it checks whether a released handle's bytes come back only when its primary mapping
    (the first one made) is unmapped, so a handle mapped at two addresses, released, and unmapped first where it was
    mapped first is never given back. Unmapped in the other order, it is."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._primary: dict[HostHandle, int] = {}

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        super().do_map(va, size, handle, offset)
        self._primary.setdefault(handle, va)

    def forget(self, va: int, live: tuple[int, HostHandle]) -> None:
        handle = live[1]
        handle.maps, _ = handle.maps - 1, self.mappings.pop(va)
        if self._primary.get(handle) == va:
            self.drop_if_unused(handle)
        if not handle.maps:
            self._primary.pop(handle, None)


def prove_only_the_primary_mapping_returns_memory(make: Callable[[], HostDriver]) -> tuple[int, int]:
    """``mem_info`` after a one-granule handle mapped at two addresses is released and unmapped from each, the first
    mapping first."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.map(r + g, g, h)
        d.release(h)
        d.unmap(r, g)
        d.unmap(r + g, g)
        return d.mem_info()
    finally:
        tidy(d, [(r, 2 * g)], [h])


# -- access and the kernel's view ------------------------------------------------------------------------------------
class LazyUnmapKeepsTheMemfd(_Broken):
    """P-accessible-kernel. Breaks "``/proc/self/maps`` shows ... a reserved granule as anonymous memory without
    access": ``unmap`` of a live handle's mapping only takes its access away and parks the memfd mapping there, to
    skip the ``mmap`` when the same handle is mapped there again (a new mapping replaces it; ``release`` and ``free``
    put the range back to anonymous memory), so an unmapped granule shows as a shared mapping of the memfd."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._parked: dict[int, tuple[int, HostHandle, int]] = {}  # va -> (size, handle, offset)
        self._offsets: dict[int, int] = {}  # va -> offset of the live mapping there

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        check_map(self, va, size, handle, offset)
        parked = self._parked.pop(va, None)
        if parked is not None and parked[0] == size and parked[1] is handle and parked[2] == offset:
            handle.maps, self.mappings[va], self._offsets[va] = handle.maps + 1, (size, handle), offset
            return
        if parked is not None:
            self._parked[va] = parked
        self._unpark(lambda p_va, p_size, _: p_va < va + size and va < p_va + p_size)
        super().do_map(va, size, handle, offset)
        self._offsets[va] = offset

    def do_unmap(self, va: int, size: int) -> None:
        live = self.mappings.get(va)
        check_one_mapping(va, size, live and live[0])
        if live[1].released:
            return super().do_unmap(va, size)
        if libc().mprotect(va, size, PROT_NONE) != 0:
            self.fail("unmap", f"mprotect({va:#x}, {size}, NONE)")
        self._parked[va] = (size, live[1], self._offsets.pop(va, 0))
        self.forget(va, live)

    def forget(self, va: int, live: tuple[int, HostHandle]) -> None:
        self._offsets.pop(va, None)
        super().forget(va, live)

    def do_release(self, handle: HostHandle) -> None:
        super().do_release(handle)
        self._unpark(lambda _va, _size, p_handle: p_handle is handle)

    def do_free(self, va: int, size: int) -> None:
        super().do_free(va, size)
        for p_va in [p for p in self._parked if va <= p < va + size]:
            del self._parked[p_va]

    def _unpark(self, which: Callable[[int, int, HostHandle], bool]) -> None:
        for p_va, (p_size, p_handle, _) in list(self._parked.items()):
            if which(p_va, p_size, p_handle):
                libc().mmap(p_va, p_size, PROT_NONE, RESERVED, -1, 0)
                del self._parked[p_va]


def prove_lazy_unmap_keeps_the_memfd(make: Callable[[], HostDriver]) -> tuple[str, bool]:
    """A live handle mapped and unmapped: the permissions the kernel shows at the granule, and whether it maps a file
    there."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.unmap(r, g)
        (perms, path), *_ = [(p, path) for lo, hi, p, path in kernel_ranges() if lo <= r < hi]
        return perms, bool(path)
    finally:
        tidy(d, [(r, g)], [h])


# -- zero and tensors ------------------------------------------------------------------------------------------------
_LAUNCH = 16 * MIB


class LargeZeroDropsTheLastChunk(_Broken):
    """P-zero. Breaks "Set exactly the bytes ``[va, va+size)`` to zero ...: any start and size (no alignment, 64 MiB
    and more...)": a zero of 64 MiB and more is split into launches of 16 MiB (a grid-size limit), with a loop that
    stops at the last whole launch, so the remainder of a size that is not a multiple of 16 MiB keeps its bytes.
    Smaller zeroes are one call, and right."""

    def zero(self, va: int, size: int) -> None:
        self.check_call("zero", va=va, size=size)
        if size < 64 * MIB:
            ctypes.memset(va, 0, size)
            return
        for start in range(va, va + size - _LAUNCH + 1, _LAUNCH):  # the bug: the remainder is never launched
            ctypes.memset(start, 0, _LAUNCH)


def prove_large_zero_drops_the_last_chunk(make: Callable[[], HostDriver]) -> tuple[int, int]:
    """A zero of 64 MiB + 4095 bytes from byte 1 of a 34-granule mapping: how many of its bytes are not zero, and how
    many bytes around it are."""
    d = make()
    g = d.granularity()
    span, n = 34 * g, 64 * MIB + 4095
    r = d.reserve(span, g)
    h = d.create(span)
    try:
        d.map(r, span, h)
        d.set_access(r, span)
        d.zero(r + 1, n)
        d.synchronize()
        t = d.tensor(r, span, None)
        inside = int((t[1 : 1 + n] != 0).sum())
        around = int((t[:1] == 0).sum()) + int((t[1 + n :] == 0).sum())
        del t
        return inside, around
    finally:
        tidy(d, [(r, span)], [h])


class TensorViewsAreCached(_Broken):
    """P-tensor-keeper. Breaks "Its storage holds a strong reference to ``keeper`` until the storage is freed": it
    caches the ctypes view of each ``(va, nbytes)`` (building one is slow) and sets the keeper on the cached view, so a
    second tensor over the same bytes replaces the first tensor's keeper, which may then be collected while the first
    tensor lives."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._views: dict[tuple[int, int], Any] = {}

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        self.check_call("tensor", va=va, size=nbytes)
        buffer = self._views.get((va, nbytes))
        if buffer is None:
            buffer = self._views[(va, nbytes)] = (ctypes.c_uint8 * nbytes).from_address(va)
        buffer.keeper = keeper
        return torch.frombuffer(buffer, dtype=torch.uint8)


class _Keeper:
    """Something a weak reference can follow."""


def prove_tensor_views_are_cached(make: Callable[[], HostDriver]) -> bool:
    """Two tensors over the same 64 bytes with two keepers: whether the first keeper is alive while the first tensor
    is, once nothing else holds it."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.set_access(r, g)
        first, second = _Keeper(), _Keeper()
        t1 = d.tensor(r, 64, first)
        t2 = d.tensor(r, 64, second)
        alive = weakref.ref(first)
        del first, second
        gc.collect()
        kept = alive() is not None
        del t1, t2
        return kept
    finally:
        tidy(d, [(r, g)], [h])


# -- interrupts and threads ------------------------------------------------------------------------------------------
class UnmapForgetsBeforeTheKernel(_Broken):
    """P-interrupted. Breaks "An exception raised inside a call while it runs (a ``KeyboardInterrupt`` ...) ... leaves
    the call done whole or not at all": ``unmap`` forgets the mapping in its records first and replaces it in the
    kernel in a later line, with nothing to put the records back, so an exception between the two lines leaves the
    granule mapped and accessible in the kernel while the driver says nothing is mapped there (``unmap`` again is
    refused, and the granule stays readable and writable)."""

    def do_unmap(self, va: int, size: int) -> None:
        live = self.mappings.get(va)
        check_one_mapping(va, size, live and live[0])
        self.forget(va, live)
        flags = RESERVED
        if libc().mmap(va, size, PROT_NONE, flags, -1, 0) != va:
            self.fail("unmap", f"mmap(PROT_NONE, MAP_FIXED, {va:#x}, {size})")


def prove_unmap_forgets_before_the_kernel(make: Callable[[], HostDriver]) -> list[int]:
    """For each line of ``unmap`` of an accessible mapping interrupted in turn: the lines after which the granule's
    accessibility disagrees with the driver's answer to ``unmap`` made again (taken: it was mapped)."""
    torn = []
    for nth in range(1, 100):
        d = make()
        g = d.granularity()
        r = d.reserve(g, g)
        h = d.create(g)
        try:
            d.map(r, g, h)
            d.set_access(r, g)
            interrupted = interrupt_at_line(d, nth, d.unmap, r, g)
            if d.accessible(r) != (outcome(d.unmap, r, g) == "done"):
                torn.append(nth)
        finally:
            tidy(d, [(r, g)], [h])
        if not interrupted:
            break
    return torn


class ReleaseChecksOutsideTheLock(_Broken):
    """P-threads. Breaks "two threads releasing one handle: one release and one refusal": ``release`` refuses a handle
    already released in a fast path before it takes the lock, and closes the memfd under the lock only if it is still
    open, so two threads releasing the same handle at once both pass the check and both return."""

    def release(self, handle: HostHandle) -> None:
        self.check_call("release")
        if handle.released:  # the fast path, before the lock
            raise DriverError("release", f"{handle!r} was already released")
        time.sleep(RACE_WINDOW_S)
        with busy(), self.locked(): return self._close(handle)  # fmt: skip

    def _close(self, handle: HostHandle) -> None:
        fd, handle.fd, handle.released = handle.fd, -1, True
        if fd >= 0:
            os.close(fd)
        self.drop_if_unused(handle)


def prove_release_checks_outside_the_lock(make: Callable[[], HostDriver]) -> bool:
    """Whether two threads releasing one handle at once ever both returned (up to ``RACE_TRIES`` tries)."""
    d = make()
    g = d.granularity()
    for _ in range(RACE_TRIES):
        h = d.create(g)
        outcomes: list[str] = []

        def work(_i: int, h: HostHandle = h, outcomes: list[str] = outcomes) -> None:
            outcomes.append(outcome(d.release, h))

        _race(work)
        if outcomes == ["done", "done"]:
            return True
    return False


# -- the factories and the cases -------------------------------------------------------------------------------------
map_end_check_ignores_the_offset = functools.partial(
    MapEndCheckIgnoresTheOffset, "broken-map-end-check-ignores-the-offset"
)
released_handle_stays_mappable = functools.partial(ReleasedHandleStaysMappable, "broken-released-handle-stays-mappable")
map_joins_an_accessible_neighbour = functools.partial(
    MapJoinsAnAccessibleNeighbour, "broken-map-joins-an-accessible-neighbour"
)
second_mapping_is_private = functools.partial(SecondMappingIsPrivate, "broken-second-mapping-is-private")
last_unmap_decommits_the_handle = functools.partial(
    LastUnmapDecommitsTheHandle, "broken-last-unmap-decommits-the-handle"
)
unmap_takes_the_reserved_tail = functools.partial(UnmapTakesTheReservedTail, "broken-unmap-takes-the-reserved-tail")
refused_map_keeps_its_count = functools.partial(RefusedMapKeepsItsCount, "broken-refused-map-keeps-its-count")
free_trusts_its_recorded_size = functools.partial(FreeTrustsItsRecordedSize, "broken-free-trusts-its-recorded-size")
free_keeps_small_reservations = functools.partial(FreeKeepsSmallReservations, "broken-free-keeps-small-reservations")
reservation_counts_mappings_at_its_start = functools.partial(
    ReservationCountsMappingsAtItsStart, "broken-reservation-counts-mappings-at-its-start"
)
reserve_leaves_the_remainder_read_write = functools.partial(
    ReserveLeavesTheRemainderReadWrite, "broken-reserve-leaves-the-remainder-read-write"
)
second_out_of_memory_is_a_plain_error = functools.partial(
    SecondOutOfMemoryIsAPlainError, "broken-second-out-of-memory-is-a-plain-error"
)
only_the_primary_mapping_returns_memory = functools.partial(
    OnlyThePrimaryMappingReturnsMemory, "broken-only-the-primary-mapping-returns-memory"
)
lazy_unmap_keeps_the_memfd = functools.partial(LazyUnmapKeepsTheMemfd, "broken-lazy-unmap-keeps-the-memfd")
large_zero_drops_the_last_chunk = functools.partial(
    LargeZeroDropsTheLastChunk, "broken-large-zero-drops-the-last-chunk"
)
tensor_views_are_cached = functools.partial(TensorViewsAreCached, "broken-tensor-views-are-cached")
unmap_forgets_before_the_kernel = functools.partial(
    UnmapForgetsBeforeTheKernel, "broken-unmap-forgets-before-the-kernel"
)
release_checks_outside_the_lock = functools.partial(
    ReleaseChecksOutsideTheLock, "broken-release-checks-outside-the-lock"
)

CASES: dict[str, Case] = {
    "map_end_check_ignores_the_offset": Case(
        map_end_check_ignores_the_offset,
        "P-map-handle-end",
        prove_map_end_check_ignores_the_offset,
        ["DriverError(map)", "DriverError(map)"],
    ),
    "released_handle_stays_mappable": Case(
        released_handle_stays_mappable, "P-map-released", prove_released_handle_stays_mappable, "DriverError(map)"
    ),
    "map_joins_an_accessible_neighbour": Case(
        map_joins_an_accessible_neighbour, "P-map-no-access", prove_map_joins_an_accessible_neighbour, [True, False]
    ),
    "second_mapping_is_private": Case(second_mapping_is_private, "P-map-shared", prove_second_mapping_is_private, 0x3C),
    "last_unmap_decommits_the_handle": Case(
        last_unmap_decommits_the_handle, "P-map-remap", prove_last_unmap_decommits_the_handle, 0x5A
    ),
    "unmap_takes_the_reserved_tail": Case(
        unmap_takes_the_reserved_tail, "P-unmap-refused", prove_unmap_takes_the_reserved_tail, "DriverError(unmap)"
    ),
    "refused_map_keeps_its_count": Case(
        refused_map_keeps_its_count,
        "P-refusal-unchanged",
        prove_refused_map_keeps_its_count,
        ["DriverError(map)", (BUDGET, BUDGET)],
    ),
    "free_trusts_its_recorded_size": Case(
        free_trusts_its_recorded_size, "P-free-refused", prove_free_trusts_its_recorded_size, "DriverError(free)"
    ),
    "free_keeps_small_reservations": Case(
        free_keeps_small_reservations, "P-free-kernel", prove_free_keeps_small_reservations, 0
    ),
    "reservation_counts_mappings_at_its_start": Case(
        reservation_counts_mappings_at_its_start, "P-free", prove_reservation_counts_mappings_at_its_start, "done"
    ),
    "reserve_leaves_the_remainder_read_write": Case(
        reserve_leaves_the_remainder_read_write,
        "P-reserve-inaccessible",
        prove_reserve_leaves_the_remainder_read_write,
        ["---p"],
    ),
    "second_out_of_memory_is_a_plain_error": Case(
        second_out_of_memory_is_a_plain_error,
        "P-oom",
        prove_second_out_of_memory_is_a_plain_error,
        ["DriverOutOfMemory(create)", "DriverOutOfMemory(create)"],
    ),
    "only_the_primary_mapping_returns_memory": Case(
        only_the_primary_mapping_returns_memory,
        "P-release-returns",
        prove_only_the_primary_mapping_returns_memory,
        (BUDGET, BUDGET),
    ),
    "lazy_unmap_keeps_the_memfd": Case(
        lazy_unmap_keeps_the_memfd, "P-accessible-kernel", prove_lazy_unmap_keeps_the_memfd, ("---p", False)
    ),
    "large_zero_drops_the_last_chunk": Case(
        large_zero_drops_the_last_chunk, "P-zero", prove_large_zero_drops_the_last_chunk, (0, 0)
    ),
    "tensor_views_are_cached": Case(tensor_views_are_cached, "P-tensor-keeper", prove_tensor_views_are_cached, True),
    "unmap_forgets_before_the_kernel": Case(
        unmap_forgets_before_the_kernel, "P-interrupted", prove_unmap_forgets_before_the_kernel, []
    ),
    "release_checks_outside_the_lock": Case(
        release_checks_outside_the_lock, "P-threads", prove_release_checks_outside_the_lock, False
    ),
}
