"""A ninth set of deliberately broken host drivers, written from the protocol's text (``drivers/_protocol.py``) and
the host driver by a reader outside the rules, without reading them.

Same layout as ``tests.meta.broken_eighth``: each class breaks one sentence or clause of the protocol, quoted with its
id in the class docstring, the way a backend's own bug might (only in particular shapes, sizes, offsets, alignments,
sequences, orders of calls, counts of live objects or caller errors), and comes with a proof that drives a driver built
by the factory it is given and returns what it observed; ``CASES`` pairs every factory with the id it breaks, its proof
and what the intact host driver observes. The set aims at the sentences the eighth set did not target, one id a driver.
Use a driver as ``extensible-kv check-driver tests.meta.broken_ninth:<factory>``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import weakref
from collections.abc import Callable

import torch

from extensible_kv.drivers.host import (
    MAP_ANONYMOUS,
    MAP_FAILED,
    MAP_NORESERVE,
    MAP_PRIVATE,
    MEMFD_NAME,
    PROT_NONE,
    PROT_READ,
    PROT_WRITE,
    MIB,
    HostDriver,
    HostHandle,
    libc,
)
from extensible_kv.drivers.records import check_free, check_inside, check_no_overlap, mapped_parts
from extensible_kv.errors import DriverError
from tests.meta.broken_protocol import (
    BUDGET,
    Case,
    _Broken,
    kernel_holds,
    kernel_ranges,
    outcome,
    poke,
    read_byte,
    tidy,
)

# -- shared pieces ---------------------------------------------------------------------------------------------------
_G = 2 * MIB
"""HostDriver's default granularity, the broken drivers' granularity."""

_RESERVE_FLAGS = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
"""The flags of a new reservation (the host's ``reserve``), without ``MAP_FIXED``."""


def _held_granules(d: HostDriver) -> int:
    """How many granules ``mem_info`` counts as taken (``total - free``)."""
    free, total = d.mem_info()
    return (total - free) // d.granularity()


def _reservation_of(d: HostDriver, va: int) -> int | None:
    """The start of the reservation of ``d`` that holds the address ``va``, as its records say."""
    return next((r for r, s in d.reservations.items() if r <= va < r + s), None)


def _memfd_fds() -> set[int]:
    """The file descriptors of this process open on one of the host driver's memfds."""
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the directory's own descriptor, closed by now
            continue
        if target.startswith(f"/memfd:{MEMFD_NAME}"):
            fds.add(int(name))
    return fds


def _names_a_value(message: str, *values: object) -> bool:
    """Whether ``message`` names one of ``values``: an int in decimal or in hex, anything else as ``str`` or
    ``repr``."""
    for value in values:
        shown = [str(value), hex(value)] if isinstance(value, int) else [str(value), repr(value)]
        if any(s in message for s in shown):
            return True
    return False


def _grant(va: int, size: int) -> None:
    """``mprotect`` the range read-write, or ``DriverError`` naming ``set_access``."""
    if libc().mprotect(va, size, PROT_READ | PROT_WRITE) != 0:
        HostDriver.fail("set_access", f"mprotect({va:#x}, {size}, RW)")


# -- refusals --------------------------------------------------------------------------------------------------------
class UnmapFindsItsReservationFirst(_Broken):
    """P-refusal. Breaks "Every refusal the protocol names raises ``DriverError`` whose ``operation`` is the method
    called": like a backend that keeps a stream per reservation, ``unmap`` first finds the reservation that holds the
    range as the nearest reservation start at or below ``va`` (``max`` over the starts), which raises ``ValueError``
    (an empty sequence) for a range below every live reservation, or with none live. A range at or above a
    reservation's start is refused with ``DriverError`` as before; nothing changes either way."""

    def do_unmap(self, va: int, size: int) -> None:
        owner = max(r for r in self.reservations if r <= va)  # the reservation's stream would be looked up here
        del owner
        super().do_unmap(va, size)


def prove_unmap_finds_its_reservation_first(make: Callable[[], HostDriver]) -> list[str]:
    """A one-granule reservation: the outcomes of unmapping one granule at the address of one granule (below every
    reservation, nothing mapped), then the reservation's own granule (nothing mapped)."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    try:
        return [outcome(d.unmap, g, g), outcome(d.unmap, r, g)]
    finally:
        tidy(d, [(r, g)], [])


class HandleEndRefusedInGranules(_Broken):
    """P-refusal-names. Breaks "Its message names what was refused: at least one argument of the call, an address, size
    or offset in decimal or in hex (``0x...``), or the handle as ``str`` or ``repr`` shows it": the refusal of a
    ``map`` at a non-zero offset past the handle's end was written for a log that counts granules, and says which
    granules of the handle the range would need and how many it has, naming no argument. A ``map`` at offset 0 past
    the end, and every other refusal, names its arguments."""

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        if offset and not handle.released and offset + size > handle.size:
            check_inside("map", va, size, self.reservations.items())
            check_no_overlap(va, size, ((m_va, m_size) for m_va, (m_size, _) in self.mappings.items()))
            g = self.granularity()
            raise DriverError(
                "map",
                f"granules {offset // g} to {(offset + size) // g - 1} are past a {handle.size // g}-granule handle",
            )
        super().do_map(va, size, handle, offset)


def prove_handle_end_refused_in_granules(make: Callable[[], HostDriver]) -> list[object]:
    """A 2-granule handle mapped at offset one granule for two granules (past its end): the operation the refusal
    names, and whether its message names the address, size, offset or handle."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(2 * g)
    try:
        d.map(r, 2 * g, h, g)
    except DriverError as exc:
        return [exc.operation, _names_a_value(str(exc), r, 2 * g, g, h)]
    else:
        return ["done", False]
    finally:
        tidy(d, [(r, 2 * g)], [h])


# -- memory ----------------------------------------------------------------------------------------------------------
class ShortByReleasedMappingsIsNoOom(_Broken):
    """P-oom. Breaks "A call refused for lack of memory raises ``DriverOutOfMemory`` (a ``DriverError``)": a ``create``
    that would fit if the bytes of handles released but still mapped were free again is refused with a plain
    ``DriverError`` asking the caller to unmap them (as a backend that tells fragmentation or pending frees apart from
    an exhausted device), though memory is short all the same. A ``create`` short of more than those bytes raises
    ``DriverOutOfMemory``."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._draining: list[HostHandle] = []

    def do_release(self, handle: HostHandle) -> None:
        mapped = not handle.released and handle.maps > 0
        super().do_release(handle)
        if mapped:
            self._draining.append(handle)

    def charge(self, size: int, counted: list[int]) -> None:
        self._draining = [h for h in self._draining if h.counted]
        if size > 0 and self.held + size > self.total:
            draining = sum(h.size for h in self._draining)
            if self.total - self.held + draining >= size:
                raise DriverError(
                    "create", f"{size} bytes asked: {draining} bytes are still mapped by released handles; unmap them"
                )
        super().charge(size, counted)


def prove_short_by_released_mappings_is_no_oom(make: Callable[[], HostDriver]) -> str:
    """A 2-granule handle mapped and released, the rest of the budget but one granule taken by another handle: the
    outcome of creating 2 granules."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    small = d.create(2 * g)
    handles = [small]
    try:
        d.map(r, 2 * g, small)
        d.release(small)
        handles.append(d.create(BUDGET - 3 * g))
        return outcome(d.create, 2 * g)
    finally:
        tidy(d, [(r, 2 * g)], handles)


class MemfdSizedToAPowerOfTwo(_Broken):
    """P-create-memory. Breaks "(on the host exactly ``size``, and the kernel holds one new memfd of ``size`` bytes)":
    handles of more than 8 granules come from a power-of-two size class, and the memfd is truncated to the class's
    size (the handle's next power of two of granules), though only ``size`` bytes are filled, counted and mappable.
    Handles of 8 granules or fewer, and of a power of two of granules, are exact."""

    CLASSED = 8

    def do_create(self, size: int) -> HostHandle:
        handle = super().do_create(size)
        granules = size // self.granularity()
        if granules > self.CLASSED:
            try:
                os.ftruncate(handle.fd, (1 << (granules - 1).bit_length()) * self.granularity())
            except OSError as exc:
                os.close(handle.fd)
                raise DriverError("create", f"ftruncate of a {size}-byte memfd to its size class: {exc}") from exc
        return handle


def prove_memfd_sized_to_a_power_of_two(make: Callable[[], HostDriver]) -> list[int]:
    """The size the kernel shows for the memfd of a 9-granule and of a 2-granule handle, in granules."""
    d = make()
    g = d.granularity()
    handles = [d.create(9 * g), d.create(2 * g)]
    try:
        return [os.fstat(h.fd).st_size // g for h in handles]
    finally:
        tidy(d, [], handles)


class MemInfoCachedUntilCreateOrRelease(_Broken):
    """P-mem-exact. Breaks "On the host ``free`` is exactly ``total`` less the bytes of every handle not yet released
    and unmapped everywhere": ``mem_info`` answers from a cache that ``create`` and ``release`` clear (the calls that
    change what is held, as its author saw it), but not the last ``unmap`` of a released handle, which gives the
    handle's bytes back: ``free`` stays short of them until the next ``create`` or ``release``. A handle unmapped before
    it is released is counted right."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._cached: tuple[int, int] | None = None

    def mem_info(self) -> tuple[int, int]:
        cached = self._cached
        if cached is None:
            cached = self._cached = super().mem_info()
        return cached

    def create(self, size: int) -> HostHandle:
        try:
            return super().create(size)
        finally:
            self._cached = None

    def release(self, handle: HostHandle) -> None:
        try:
            super().release(handle)
        finally:
            self._cached = None


def prove_mem_info_cached_until_create_or_release(make: Callable[[], HostDriver]) -> list[int]:
    """A one-granule handle mapped and released: the granules ``mem_info`` counts taken, then again once it is
    unmapped."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.release(h)
        seen = [_held_granules(d)]
        d.unmap(r, g)
        return [*seen, _held_granules(d)]
    finally:
        tidy(d, [(r, g)], [h])


# -- reservations ----------------------------------------------------------------------------------------------------
class ReserveKeepsTheTailOfLargeAlignments(_Broken):
    """P-reserve-kernel. Breaks "On the host the kernel holds exactly ``[va, va+size)`` as reserved (anonymous, no
    access): address space taken to align the range is given back before ``reserve`` returns": a reservation aligned
    to more than the granularity goes through the path written for GPUs, which trims the padding below the range and
    keeps the padding above it until ``free`` (which gives both back). Reservations aligned to the granularity are
    trimmed both ways."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._tails: dict[int, tuple[int, int]] = {}

    def do_reserve(self, size: int, alignment: int) -> int:
        if alignment <= self.granularity():
            return super().do_reserve(size, alignment)
        span = size + alignment
        raw = libc().mmap(None, span, PROT_NONE, _RESERVE_FLAGS, -1, 0)
        if raw in (None, MAP_FAILED):
            self.fail("reserve", f"mmap(PROT_NONE, {span} bytes) for {size} bytes aligned to {alignment}", oom=True)
        va = -(-raw // alignment) * alignment
        if va != raw:
            libc().munmap(raw, va - raw)
        if raw + span > va + size:
            self._tails[va] = (va + size, raw + span - (va + size))
        self.reservations[va] = size
        return va

    def do_free(self, va: int, size: int) -> None:
        super().do_free(va, size)
        tail = self._tails.pop(va, None)
        if tail is not None:
            libc().munmap(*tail)


def prove_reserve_keeps_the_tail_of_large_alignments(make: Callable[[], HostDriver]) -> list[bool]:
    """A one-granule reservation aligned to two granules: whether it is aligned, and whether the kernel holds the page
    right after it as reserved (anonymous, no access)."""
    d = make()
    g = d.granularity()
    va = d.reserve(g, 2 * g)
    try:
        after = next(((perms, path) for lo, hi, perms, path in kernel_ranges() if lo <= va + g < hi), ("", ""))
        return [va % (2 * g) == 0, after == ("---p", "")]
    finally:
        tidy(d, [(va, g)], [])


class RefusedMapKeepsTheReservationBusy(_Broken):
    """P-free. Breaks "Return the reservation ``[va, va+size)``, exactly as ``reserve`` made it, once nothing is mapped
    in it": the driver counts the mappings of each reservation to refuse ``free`` of a busy one without a scan, and
    ``map`` takes the count up as it starts; a ``map`` refused after that (past the handle's end, a released handle,
    over a mapping, past the reservation's end) never takes it back, so the reservation is refused by ``free`` for
    good once its mappings are gone. A reservation whose maps all succeeded is freed."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._counts: dict[int, int] = {}

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        owner = _reservation_of(self, va)
        if owner is not None:
            self._counts[owner] = self._counts.get(owner, 0) + 1
        super().do_map(va, size, handle, offset)

    def do_unmap(self, va: int, size: int) -> None:
        super().do_unmap(va, size)
        owner = _reservation_of(self, va)
        if owner is not None:
            self._counts[owner] -= 1

    def do_free(self, va: int, size: int) -> None:
        busy_maps = self._counts.get(va, 0) if self.reservations.get(va) == size else 0
        if busy_maps:
            raise DriverError("free", f"reservation {va:#x} still has {busy_maps} mapping(s)")
        super().do_free(va, size)
        self._counts.pop(va, None)


def prove_refused_map_keeps_the_reservation_busy(make: Callable[[], HostDriver]) -> list[str]:
    """A 2-granule reservation with a one-granule handle mapped at its start: the outcome of mapping the handle at
    offset one granule (past its end) there, then, once the handle is unmapped, of freeing the reservation."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(g)
    left = [(r, 2 * g)]
    try:
        d.map(r, g, h)
        seen = [outcome(d.map, r + g, g, h, g)]
        d.unmap(r, g)
        seen.append(outcome(d.free, r, 2 * g))
        if seen[-1] == "done":
            left.clear()
        return seen
    finally:
        tidy(d, left, [h])


class FreeInChunksSkipsTheLastWholeOne(_Broken):
    """P-free-kernel. Breaks "Afterwards nothing of the range ... is held: on the host the kernel maps nothing there":
    reservations of 256 granules and more are given back in ``munmap`` calls of 256 granules, whole chunks first and
    the remainder last, and the count of whole chunks is taken as ``(size - 1) // chunk`` (the chunks before the last
    piece); when the size is a multiple of the chunk, the last piece is a whole chunk and not a remainder, and it is
    never given back. The records forget the reservation whole. Smaller reservations, and ones of any other size, go
    back whole."""

    CHUNK = 256

    def do_free(self, va: int, size: int) -> None:
        chunk = self.CHUNK * self.granularity()
        if size < chunk:
            super().do_free(va, size)
            return
        check_free(va, size, self.reservations.get(va) == size, self.mappings)
        whole, rest = (size - 1) // chunk, size % chunk
        pieces = [(va + i * chunk, chunk) for i in range(whole)] + ([(va + whole * chunk, rest)] if rest else [])
        del self.reservations[va]
        for at, n in pieces:
            if libc().munmap(at, n) != 0:
                self.fail("free", f"munmap({at:#x}, {n})")


def prove_free_in_chunks_skips_the_last_whole_one(make: Callable[[], HostDriver]) -> list[int]:
    """The granules the kernel holds of a freed 256-granule reservation and of a freed 300-granule one (given back
    here)."""
    d = make()
    g = d.granularity()
    held = []
    for n in (FreeInChunksSkipsTheLastWholeOne.CHUNK, 300):
        va = d.reserve(n * g, g)
        d.free(va, n * g)
        held.append(kernel_holds(va, va + n * g) // g)
        if held[-1]:
            libc().munmap(va, n * g)
    return held


# -- handles ---------------------------------------------------------------------------------------------------------
class HandleTailRefusedOffByOne(_Broken):
    """P-create. Breaks "``map`` takes any part of it within ``size`` bytes": the check of a ``map`` at a non-zero
    offset compares ``offset + size`` with the handle's size with ``>=``, so a part that ends exactly at the handle's
    end (its last granules) is refused as past it. A map at offset 0, the whole handle among them, and parts that end
    before the handle's end are taken."""

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        if offset and not handle.released and offset + size >= handle.size:
            check_inside("map", va, size, self.reservations.items())
            check_no_overlap(va, size, ((m_va, m_size) for m_va, (m_size, _) in self.mappings.items()))
            raise DriverError("map", f"offset {offset} + size {size} exceeds the {handle.size}-byte handle")
        super().do_map(va, size, handle, offset)


def prove_handle_tail_refused_off_by_one(make: Callable[[], HostDriver]) -> list[str]:
    """A 3-granule handle: the outcomes of mapping its first granule, its second, and its last."""
    d = make()
    g = d.granularity()
    r = d.reserve(3 * g, g)
    h = d.create(3 * g)
    try:
        return [outcome(d.map, r + i * g, g, h, i * g) for i in range(3)]
    finally:
        tidy(d, [(r, 3 * g)], [h])


class ReleasedFdKeptUntilTheFirstMappingGoes(_Broken):
    """P-release-returns. Breaks "Once the handle is released and unmapped everywhere ... on the host the kernel holds
    no memfd of it, and the driver keeps no file descriptor of a released handle": ``release`` of a handle that is still
    mapped keeps a duplicate of its memfd (to reach its pages for a later hole punch), closed when the handle's memory
    goes, which the driver looks for at the unmap of the handle's first mapping only: a handle whose first mapping is
    unmapped before its others keeps the duplicate for good. The held bytes are counted right; a handle unmapped last
    at its first address, or released when mapped nowhere, keeps nothing."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._first: weakref.WeakKeyDictionary[HostHandle, int] = weakref.WeakKeyDictionary()
        self._kept: dict[int, int] = {}  # id(handle) -> duplicate fd

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        super().do_map(va, size, handle, offset)
        self._first.setdefault(handle, va)

    def do_release(self, handle: HostHandle) -> None:
        if handle.released or handle.maps == 0:
            super().do_release(handle)
            return
        kept = os.dup(handle.fd)
        try:
            super().do_release(handle)
        except BaseException:
            os.close(kept)
            raise
        self._kept[id(handle)] = kept

    def forget(self, va: int, live: tuple[int, HostHandle]) -> None:
        super().forget(va, live)
        handle = live[1]
        if self._first.get(handle) == va:
            del self._first[handle]
            if handle.maps == 0 and id(handle) in self._kept:
                os.close(self._kept.pop(id(handle)))


def prove_released_fd_kept_until_the_first_mapping_goes(make: Callable[[], HostDriver]) -> list[int]:
    """A one-granule handle mapped at two addresses, released, and unmapped from the first address then from the
    second: how many memfd descriptors the process holds more than before (closed here), and the granules ``mem_info``
    counts taken."""
    before = _memfd_fds()
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
        extra = _memfd_fds() - before
        for fd in extra:
            os.close(fd)
        return [len(extra), _held_granules(d)]
    finally:
        tidy(d, [(r, 2 * g)], [h])


class ReleasedIsKeptByFdNumber(_Broken):
    """P-release-once. Breaks "A handle is released once: releasing it again while it is still mapped somewhere is
    refused": the driver records a release by the handle's memfd number (as a native driver keeps released handle
    values), and a ``create`` whose new memfd gets that number (the kernel hands out the lowest free one) clears the
    record: a released handle, still mapped, whose number went to a new handle is taken again by ``release``, which has
    nothing left to close and returns. Released handles whose number was not handed out again are refused."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._released_numbers: set[int] = set()

    def do_release(self, handle: HostHandle) -> None:
        if handle._shown in self._released_numbers:
            raise DriverError("release", f"{handle!r} was already released")
        if handle.released:  # its number is live again: as far as the records go, a release of a handle closed
            self.drop_if_unused(handle)
            return
        super().do_release(handle)
        self._released_numbers.add(handle._shown)

    def do_create(self, size: int) -> HostHandle:
        handle = super().do_create(size)
        self._released_numbers.discard(handle.fd)
        return handle


def prove_released_is_kept_by_fd_number(make: Callable[[], HostDriver]) -> list[str]:
    """A one-granule handle mapped and released, a new one-granule handle created: the outcome of releasing the first
    handle again (still mapped), and whether the new handle took its memfd number."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    old = d.create(g)
    handles = [old]
    try:
        d.map(r, g, old)
        d.release(old)
        handles.append(d.create(g))
        return [outcome(d.release, old), "same number" if handles[1].fd == old._shown else "other number"]
    finally:
        tidy(d, [(r, g)], handles)


# -- mappings --------------------------------------------------------------------------------------------------------
class AccessIsKeptPerHandle(_Broken):
    """P-map-no-access. Breaks "The new mapping is not accessible until ``set_access``, also when the handle was mapped
    before and unmapped": like a backend that keeps the access descriptor with the allocation (as its creation
    properties), a handle once granted access is mapped accessible from then on: ``map`` of such a handle ``mprotect``s
    the new mapping read-write at once. A handle never granted access maps without access."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._granted: weakref.WeakSet[HostHandle] = weakref.WeakSet()

    def do_set_access(self, va: int, size: int) -> None:
        super().do_set_access(va, size)
        for m_va, (m_size, handle) in self.mappings.items():
            if m_va < va + size and va < m_va + m_size:
                self._granted.add(handle)

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        super().do_map(va, size, handle, offset)
        if handle in self._granted:
            _grant(va, size)


def prove_access_is_kept_per_handle(make: Callable[[], HostDriver]) -> list[bool]:
    """A one-granule handle mapped with access at one address and unmapped, then mapped at another: whether that
    granule is accessible, and whether the kernel shows it read-write."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.set_access(r, g)
        d.unmap(r, g)
        d.map(r + g, g, h)
        perms = next((p for lo, hi, p, _ in kernel_ranges() if lo <= r + g < hi), "")
        return [d.accessible(r + g), perms.startswith("rw")]
    finally:
        tidy(d, [(r, 2 * g)], [h])


class LastUnmapDecommitsLargeHandles(_Broken):
    """P-map-remap. Breaks "A handle unmapped and mapped again (at the same or another address) shows its bytes still":
    to let the kernel reclaim idle memory, the last ``unmap`` of a handle of 4 granules and more decommits its pages
    (truncates its memfd to nothing and back), as a driver might for an allocation it believes is dead; the handle is
    not released, and its bytes read as zeros once mapped again. Smaller handles, and handles unmapped with another
    mapping left, keep their bytes."""

    LARGE = 4

    def forget(self, va: int, live: tuple[int, HostHandle]) -> None:
        super().forget(va, live)
        handle = live[1]
        if handle.maps == 0 and not handle.released and handle.size >= self.LARGE * self.granularity():
            os.ftruncate(handle.fd, 0)
            os.ftruncate(handle.fd, handle.size)


def prove_last_unmap_decommits_large_handles(make: Callable[[], HostDriver]) -> list[int]:
    """A 4-granule and a one-granule handle, each mapped with access, written 0x3C, unmapped, and mapped with access at
    another address: the byte read back through each."""
    d = make()
    g = d.granularity()
    n = LastUnmapDecommitsLargeHandles.LARGE
    r = d.reserve(2 * (n + 1) * g, g)
    handles = [d.create(n * g), d.create(g)]
    try:
        seen = []
        at = r
        for h in handles:
            d.map(at, h.size, h)
            d.set_access(at, h.size)
            poke(d, at, 0x3C)
            d.unmap(at, h.size)
            d.map(at + h.size, h.size, h)
            d.set_access(at + h.size, h.size)
            seen.append(read_byte(d, at + h.size))
            at += 2 * h.size
        return seen
    finally:
        tidy(d, [(r, 2 * (n + 1) * g)], handles)


class SameMapAgainIsTaken(_Broken):
    """P-map-overlap. Breaks "Refused, changing nothing: ... a range overlapping a live mapping (from below, from above,
    inside, exactly, around it)": a ``map`` that repeats a live mapping exactly (the same address, size, handle and
    offset) is taken as already done and returns, as an idempotent call of a mapping cache would. A map over a live
    mapping of another handle, offset or size is refused."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._offsets: dict[int, int] = {}

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        live = self.mappings.get(va)
        if live is not None and live[0] == size and live[1] is handle and self._offsets.get(va) == offset:
            return
        super().do_map(va, size, handle, offset)
        self._offsets[va] = offset


def prove_same_map_again_is_taken(make: Callable[[], HostDriver]) -> list[str]:
    """A one-granule handle mapped: the outcomes of mapping it again exactly so, and of mapping another handle there."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h, other = d.create(g), d.create(g)
    try:
        d.map(r, g, h)
        return [outcome(d.map, r, g, h), outcome(d.map, r, g, other)]
    finally:
        tidy(d, [(r, g)], [h, other])


# -- access ----------------------------------------------------------------------------------------------------------
class SetAccessLooksUpItsStart(_Broken):
    """P-access. Breaks "Part of a mapping is granted by a driver whose native call takes it (the host's mprotect) and
    refused, changing nothing, by one whose native call takes whole mappings only (``cuMemSetAccess``); either way, the
    same for every call": ``set_access`` looks up the mapping at the range's start, as a backend does that keys its
    per-mapping state by address, and refuses a range that starts inside a mapping; a range that starts at a mapping's
    start is granted, also when it ends inside one. Fully mapped ranges starting at a mapping are granted."""

    def do_set_access(self, va: int, size: int) -> None:
        mapped_parts(va, size, ((m, s) for m, (s, _) in self.mappings.items()))
        if va not in self.mappings:
            raise DriverError("set_access", f"{va:#x} is not the start of a mapping")
        super().do_set_access(va, size)


def prove_set_access_looks_up_its_start(make: Callable[[], HostDriver]) -> list[str]:
    """A 3-granule mapping: the outcomes of granting access to its first granule, then to its second."""
    d = make()
    g = d.granularity()
    r = d.reserve(3 * g, g)
    h = d.create(3 * g)
    try:
        d.map(r, 3 * g, h)
        return [outcome(d.set_access, r, g), outcome(d.set_access, r + g, g)]
    finally:
        tidy(d, [(r, 3 * g)], [h])


class SetAccessGrantsTheMappedPrefix(_Broken):
    """P-access-refused. Breaks "Refused, changing nothing: a range with any granule unmapped (partly mapped from below
    or above, a gap between mappings, nothing mapped)": ``set_access`` grants mapping after mapping in address order (as
    a per-mapping native call is made) and stops at the first granule it finds unmapped, refusing then; what it granted
    before that stays granted. A range whose first granule is unmapped is refused with nothing granted."""

    def do_set_access(self, va: int, size: int) -> None:
        end, at = va + size, va
        for m_va, m_size in sorted((m, s) for m, (s, _) in self.mappings.items() if m < end and va < m + s):
            if max(m_va, va) != at:
                break
            hi = min(m_va + m_size, end)
            _grant(at, hi - at)
            at = hi
        if at != end:
            raise DriverError("set_access", f"[{va:#x}, +{size}) is not fully mapped ({at - va} bytes from its start)")


def prove_set_access_grants_the_mapped_prefix(make: Callable[[], HostDriver]) -> list[object]:
    """A 2-granule reservation with its first granule mapped: the outcome of granting access to both granules, and
    whether the first is accessible afterwards."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        return [outcome(d.set_access, r, 2 * g), d.accessible(r)]
    finally:
        tidy(d, [(r, 2 * g)], [h])


class AccessibleCachedByGranule(_Broken):
    """P-accessible. Breaks "Whether the granule at ``va`` ... is mapped and readable/writable, from the driver's or
    the kernel's own state": ``accessible`` answers from a cache of granules it has read from the kernel, and
    ``map``, ``unmap``, ``set_access`` and ``free`` drop the cached granule at their range's start (where a mapping is
    looked up), not the others: after a change to a range of several granules, the later granules answer what they
    were. Ranges of one granule are answered right."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._known: dict[int, bool] = {}

    def accessible(self, va: int) -> bool:
        self.check_call("accessible", va=va)
        key = va - va % self.granularity()
        known = self._known.get(key)
        if known is None:
            known = self._known[key] = super().accessible(va)
        return known

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        super().do_map(va, size, handle, offset)
        self._known.pop(va, None)

    def do_unmap(self, va: int, size: int) -> None:
        super().do_unmap(va, size)
        self._known.pop(va, None)

    def do_set_access(self, va: int, size: int) -> None:
        super().do_set_access(va, size)
        self._known.pop(va, None)

    def do_free(self, va: int, size: int) -> None:
        super().do_free(va, size)
        self._known.pop(va, None)


def prove_accessible_cached_by_granule(make: Callable[[], HostDriver]) -> list[bool]:
    """A 2-granule mapping with access, each granule asked, then unmapped: whether each granule is accessible."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(2 * g)
    try:
        d.map(r, 2 * g, h)
        d.set_access(r, 2 * g)
        asked = [d.accessible(r), d.accessible(r + g)]
        del asked
        d.unmap(r, 2 * g)
        return [d.accessible(r), d.accessible(r + g)]
    finally:
        tidy(d, [(r, 2 * g)], [h])


# -- tensors ---------------------------------------------------------------------------------------------------------
class TensorDropsTheByteOffset(_Broken):
    """P-tensor. Breaks "A 1-D ``torch.uint8`` tensor of ``nbytes`` elements over ``[va, va+nbytes)`` (``data_ptr() ==
    va``) without copying, at any address": the tensor is built over the address rounded down to 16 bytes (the
    alignment a DLPack exporter asks of its data pointer), and the byte offset that should go with it is dropped, so a
    tensor at an address that is not a multiple of 16 starts up to 15 bytes early. Tensors at such multiples are
    right."""

    ALIGN = 16

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        self.check_call("tensor", va=va, size=nbytes)
        buffer = (ctypes.c_uint8 * nbytes).from_address(va - va % self.ALIGN)
        buffer.keeper = keeper
        return torch.frombuffer(buffer, dtype=torch.uint8)


def prove_tensor_drops_the_byte_offset(make: Callable[[], HostDriver]) -> list[int]:
    """An accessible granule with 0x3C stored at byte 5: a 3-byte tensor at byte 5, its ``data_ptr`` less the granule's
    address, and its first element."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.set_access(r, g)
        ctypes.c_uint8.from_address(r + 5).value = 0x3C
        t = d.tensor(r + 5, 3, None)
        seen = [t.data_ptr() - r, int(t[0])]
        del t
        return seen
    finally:
        tidy(d, [(r, g)], [h])


# -- the factories and the cases -------------------------------------------------------------------------------------
unmap_finds_its_reservation_first = functools.partial(
    UnmapFindsItsReservationFirst, "broken-unmap-finds-its-reservation-first"
)
handle_end_refused_in_granules = functools.partial(HandleEndRefusedInGranules, "broken-handle-end-refused-in-granules")
short_by_released_mappings_is_no_oom = functools.partial(
    ShortByReleasedMappingsIsNoOom, "broken-short-by-released-mappings-is-no-oom"
)
memfd_sized_to_a_power_of_two = functools.partial(MemfdSizedToAPowerOfTwo, "broken-memfd-sized-to-a-power-of-two")
mem_info_cached_until_create_or_release = functools.partial(
    MemInfoCachedUntilCreateOrRelease, "broken-mem-info-cached-until-create-or-release"
)
reserve_keeps_the_tail_of_large_alignments = functools.partial(
    ReserveKeepsTheTailOfLargeAlignments, "broken-reserve-keeps-the-tail-of-large-alignments"
)
refused_map_keeps_the_reservation_busy = functools.partial(
    RefusedMapKeepsTheReservationBusy, "broken-refused-map-keeps-the-reservation-busy"
)
free_in_chunks_skips_the_last_whole_one = functools.partial(
    FreeInChunksSkipsTheLastWholeOne, "broken-free-in-chunks-skips-the-last-whole-one"
)
handle_tail_refused_off_by_one = functools.partial(HandleTailRefusedOffByOne, "broken-handle-tail-refused-off-by-one")
released_fd_kept_until_the_first_mapping_goes = functools.partial(
    ReleasedFdKeptUntilTheFirstMappingGoes, "broken-released-fd-kept-until-the-first-mapping-goes"
)
released_is_kept_by_fd_number = functools.partial(ReleasedIsKeptByFdNumber, "broken-released-is-kept-by-fd-number")
access_is_kept_per_handle = functools.partial(AccessIsKeptPerHandle, "broken-access-is-kept-per-handle")
last_unmap_decommits_large_handles = functools.partial(
    LastUnmapDecommitsLargeHandles, "broken-last-unmap-decommits-large-handles"
)
same_map_again_is_taken = functools.partial(SameMapAgainIsTaken, "broken-same-map-again-is-taken")
set_access_looks_up_its_start = functools.partial(SetAccessLooksUpItsStart, "broken-set-access-looks-up-its-start")
set_access_grants_the_mapped_prefix = functools.partial(
    SetAccessGrantsTheMappedPrefix, "broken-set-access-grants-the-mapped-prefix"
)
accessible_cached_by_granule = functools.partial(AccessibleCachedByGranule, "broken-accessible-cached-by-granule")
tensor_drops_the_byte_offset = functools.partial(TensorDropsTheByteOffset, "broken-tensor-drops-the-byte-offset")

CASES: dict[str, Case] = {
    "unmap_finds_its_reservation_first": Case(
        unmap_finds_its_reservation_first,
        "P-refusal",
        prove_unmap_finds_its_reservation_first,
        ["DriverError(unmap)", "DriverError(unmap)"],
    ),
    "handle_end_refused_in_granules": Case(
        handle_end_refused_in_granules, "P-refusal-names", prove_handle_end_refused_in_granules, ["map", True]
    ),
    "short_by_released_mappings_is_no_oom": Case(
        short_by_released_mappings_is_no_oom,
        "P-oom",
        prove_short_by_released_mappings_is_no_oom,
        "DriverOutOfMemory(create)",
    ),
    "memfd_sized_to_a_power_of_two": Case(
        memfd_sized_to_a_power_of_two, "P-create-memory", prove_memfd_sized_to_a_power_of_two, [9, 2]
    ),
    "mem_info_cached_until_create_or_release": Case(
        mem_info_cached_until_create_or_release, "P-mem-exact", prove_mem_info_cached_until_create_or_release, [1, 0]
    ),
    "reserve_keeps_the_tail_of_large_alignments": Case(
        reserve_keeps_the_tail_of_large_alignments,
        "P-reserve-kernel",
        prove_reserve_keeps_the_tail_of_large_alignments,
        [True, False],
    ),
    "refused_map_keeps_the_reservation_busy": Case(
        refused_map_keeps_the_reservation_busy,
        "P-free",
        prove_refused_map_keeps_the_reservation_busy,
        ["DriverError(map)", "done"],
    ),
    "free_in_chunks_skips_the_last_whole_one": Case(
        free_in_chunks_skips_the_last_whole_one, "P-free-kernel", prove_free_in_chunks_skips_the_last_whole_one, [0, 0]
    ),
    "handle_tail_refused_off_by_one": Case(
        handle_tail_refused_off_by_one, "P-create", prove_handle_tail_refused_off_by_one, ["done", "done", "done"]
    ),
    "released_fd_kept_until_the_first_mapping_goes": Case(
        released_fd_kept_until_the_first_mapping_goes,
        "P-release-returns",
        prove_released_fd_kept_until_the_first_mapping_goes,
        [0, 0],
    ),
    "released_is_kept_by_fd_number": Case(
        released_is_kept_by_fd_number,
        "P-release-once",
        prove_released_is_kept_by_fd_number,
        ["DriverError(release)", "same number"],
    ),
    "access_is_kept_per_handle": Case(
        access_is_kept_per_handle, "P-map-no-access", prove_access_is_kept_per_handle, [False, False]
    ),
    "last_unmap_decommits_large_handles": Case(
        last_unmap_decommits_large_handles, "P-map-remap", prove_last_unmap_decommits_large_handles, [0x3C, 0x3C]
    ),
    "same_map_again_is_taken": Case(
        same_map_again_is_taken,
        "P-map-overlap",
        prove_same_map_again_is_taken,
        ["DriverError(map)", "DriverError(map)"],
    ),
    "set_access_looks_up_its_start": Case(
        set_access_looks_up_its_start, "P-access", prove_set_access_looks_up_its_start, ["done", "done"]
    ),
    "set_access_grants_the_mapped_prefix": Case(
        set_access_grants_the_mapped_prefix,
        "P-access-refused",
        prove_set_access_grants_the_mapped_prefix,
        ["DriverError(set_access)", False],
    ),
    "accessible_cached_by_granule": Case(
        accessible_cached_by_granule, "P-accessible", prove_accessible_cached_by_granule, [False, False]
    ),
    "tensor_drops_the_byte_offset": Case(
        tensor_drops_the_byte_offset, "P-tensor", prove_tensor_drops_the_byte_offset, [5, 0x3C]
    ),
}
