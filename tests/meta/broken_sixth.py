"""A sixth set of deliberately broken host drivers, written from the protocol's text (``drivers/_protocol.py``) and the
host driver by a reader outside the rules, without reading them.

Same layout as ``tests.meta.broken_fifth``: each class breaks one sentence or clause of the protocol, quoted with its
id in the class docstring, the way a backend's own bug might (only in particular shapes, sizes, sequences, threads,
interrupt points or states), and comes with a proof that drives a driver built by the factory it is given and returns
what it observed; ``CASES`` pairs every factory with the id it breaks, its proof and what the intact host driver
observes. Use a driver as ``extensible-kv check-driver tests.meta.broken_sixth:<factory>``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import resource
import threading
import time
from collections.abc import Callable

import torch

from extensible_kv.drivers.host import (
    MAP_ANONYMOUS,
    MAP_FAILED,
    MAP_NORESERVE,
    MAP_PRIVATE,
    MAP_SHARED,
    MEMFD_NAME,
    PROT_NONE,
    PROT_READ,
    PROT_WRITE,
    MIB,
    PAGE_BYTES,
    HostDriver,
    HostHandle,
    libc,
)
from extensible_kv.drivers.records import check_alignment, check_free, check_inside, check_no_overlap, mapped_parts
from extensible_kv.errors import DriverError, DriverOutOfMemory
from extensible_kv.reaper import busy
from tests.meta.broken_protocol import (
    GIB,
    RACE_TRIES,
    RACE_WINDOW_S,
    _Broken,
    _race,
    Case,
    check_handle,
    check_map,
    interrupt_at_line,
    kernel_ranges,
    mmap_handle,
    outcome,
    poke,
    read_byte,
    tidy,
)


# -- shared pieces ---------------------------------------------------------------------------------------------------
def _held_granules(d: HostDriver) -> int:
    """How many granules ``mem_info`` counts as taken (``total - free``)."""
    free, total = d.mem_info()
    return (total - free) // d.granularity()


def _memfds() -> set[int]:
    """The file descriptors of this process that name one of the host driver's memfds."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}").startswith(f"/memfd:{MEMFD_NAME}"):
                found.add(int(name))
    return found


def _address_space() -> int:
    """Bytes of address space the process holds (every range of ``/proc/self/maps``)."""
    return sum(hi - lo for lo, hi, _, _ in kernel_ranges())


def _reserved_pieces(lo: int, hi: int) -> list[tuple[int, int]]:
    """The pieces of ``[lo, hi)`` the kernel holds as reserved (anonymous, no access)."""
    return [
        (max(lo, r_lo), min(hi, r_hi))
        for r_lo, r_hi, perms, path in kernel_ranges()
        if r_lo < hi and lo < r_hi and perms == "---p" and not path
    ]


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


_RESERVE_FLAGS = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE


# -- several mappings ------------------------------------------------------------------------------------------------
class ZeroSkipsTheMiddleMappings(_Broken):
    """P-zero. Breaks "Set exactly the bytes ``[va, va+size)`` to zero ...: any start and size (no alignment, 64 MiB
    and more, across several mappings)": a range across mappings is zeroed per mapping as a head (up to the end of the
    first mapping it touches) and a tail (from the start of the last), code written for a range across one boundary,
    so every mapping between the first and the last keeps its bytes. A range inside one mapping or across two is zeroed
    right."""

    def zero(self, va: int, size: int) -> None:
        self.check_call("zero", va=va, size=size)
        end = va + size
        with busy(), self.locked():
            pieces = sorted((m, m + s) for m, (s, _) in self.mappings.items() if m < end and va < m + s)
        if len(pieces) < 2:
            super().zero(va, size)
            return
        ctypes.memset(va, 0, pieces[0][1] - va)
        ctypes.memset(pieces[-1][0], 0, end - pieces[-1][0])


def prove_zero_skips_the_middle_mappings(make: Callable[[], HostDriver]) -> list[int]:
    """Three adjacent accessible one-granule mappings of three handles (filled with 0xA5), zeroed from byte 1 to the
    last byte but one: the bytes at the first byte, byte 1, the middle of the second and third granules, and the last
    byte."""
    d = make()
    g = d.granularity()
    r = d.reserve(3 * g, g)
    handles = [d.create(g) for _ in range(3)]
    try:
        for i, h in enumerate(handles):
            d.map(r + i * g, g, h)
        d.set_access(r, 3 * g)
        d.zero(r + 1, 3 * g - 2)
        d.synchronize()
        return [read_byte(d, a) for a in (r, r + 1, r + g + g // 2, r + 2 * g + g // 2, r + 3 * g - 1)]
    finally:
        tidy(d, [(r, 3 * g)], handles)


class OverlapChecksTheEnds(_Broken):
    """P-map-overlap. Breaks "Refused, changing nothing: ... a range overlapping a live mapping (from below, from
    above, inside, exactly, around it)": it looks up which live mapping holds the range's first byte and which its
    last (the lookup a page table does), so a range around a live mapping, starting below it and ending above it, is
    taken and ``MAP_FIXED`` silently replaces the mapping inside. Overlaps from below, from above, inside and exactly
    are refused."""

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        check_inside("map", va, size, self.reservations.items())
        for m_va, (m_size, _) in self.mappings.items():
            if m_va <= va < m_va + m_size or m_va < va + size <= m_va + m_size:
                raise DriverError("map", f"[{va:#x}, +{size}) overlaps the live mapping [{m_va:#x}, +{m_size})")
        check_handle(handle, size, offset)
        mmap_handle(self, va, size, handle, offset)


def prove_overlap_checks_the_ends(make: Callable[[], HostDriver]) -> list[str]:
    """A one-granule mapping in the middle of a 3-granule reservation: the outcomes of mapping 2 granules from below
    it, 2 granules from it upwards, and all 3 granules around it."""
    d = make()
    g = d.granularity()
    r = d.reserve(3 * g, g)
    middle, wide = d.create(g), d.create(3 * g)
    try:
        d.map(r + g, g, middle)
        return [outcome(d.map, r, 2 * g, wide), outcome(d.map, r + g, 2 * g, wide), outcome(d.map, r, 3 * g, wide)]
    finally:
        tidy(d, [(r, 3 * g)], [middle, wide])


# -- many live mappings ----------------------------------------------------------------------------------------------
class AccessibleFromRecordsPast64(_Broken):
    """P-accessible. Breaks "Whether the granule at ``va`` ... is mapped and readable/writable, from the driver's or the
    kernel's own state": reading ``/proc/self/maps`` is slow once many mappings are live, so with more than 64 live
    mappings it answers from its own record of the mappings ``set_access`` granted, and ``unmap`` does not take a
    mapping out of that record: a granule unmapped and mapped again (without access) is answered accessible. With 64
    mappings or fewer it asks the kernel."""

    FROM_RECORDS = 64

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._granted: set[int] = set()

    def do_set_access(self, va: int, size: int) -> None:
        super().do_set_access(va, size)
        self._granted.update(m for m, (s, _) in self.mappings.items() if m < va + size and va < m + s)

    def accessible(self, va: int) -> bool:
        self.check_call("accessible", va=va)
        with busy(), self.locked():
            if len(self.mappings) > self.FROM_RECORDS:
                return any(m <= va < m + s and m in self._granted for m, (s, _) in self.mappings.items())
        return super().accessible(va)


def prove_accessible_from_records_past_64(make: Callable[[], HostDriver]) -> list[bool]:
    """Seventy one-granule mappings of one handle; the sixth given access, unmapped and mapped again, the seventh given
    access: whether the sixth, seventh and eighth granules are accessible."""
    d = make()
    g, n = d.granularity(), 70
    r = d.reserve(n * g, g)
    h = d.create(g)
    try:
        for i in range(n):
            d.map(r + i * g, g, h)
        d.set_access(r + 5 * g, g)
        d.unmap(r + 5 * g, g)
        d.map(r + 5 * g, g, h)
        d.set_access(r + 6 * g, g)
        return [d.accessible(r + i * g) for i in (5, 6, 7)]
    finally:
        tidy(d, [(r, n * g)], [h])


# -- two threads -----------------------------------------------------------------------------------------------------
class FreeUnmapsAfterTheLock(_Broken):
    """P-threads. Breaks "Any call may be made from several threads at once on one driver: each takes effect whole, so
    what every call returned, and the state the driver is left in, are those of some serial order of the calls":
    ``free`` checks under its lock that the reservation is empty, lets the lock go, and takes it again to forget the
    reservation and give it back to the kernel, so a ``map`` into it from another thread in between is taken and then
    unmapped by the ``free``: both calls return, which no serial order allows, and the driver records a mapping the
    kernel no longer holds."""

    def free(self, va: int, size: int) -> None:
        self.check_call("free", va=va, size=size)
        with busy(), self.locked():
            check_free(va, size, self.reservations.get(va) == size, self.mappings)
        time.sleep(RACE_WINDOW_S)
        with busy(), self.locked():
            self.reservations.pop(va, None)
            failed = libc().munmap(va, size) != 0
        if failed:
            self.fail("free", f"munmap({va:#x}, {size})")


def prove_free_unmaps_after_the_lock(make: Callable[[], HostDriver]) -> bool:
    """Whether a ``free`` of an empty reservation and a ``map`` into it, from two threads at once, ever both returned
    (up to ``RACE_TRIES`` tries)."""
    d = make()
    g = d.granularity()
    h = d.create(g)
    try:
        for _ in range(RACE_TRIES):
            r = d.reserve(g, g)
            seen = ["", ""]

            def work(i: int, r: int = r, seen: list[str] = seen) -> None:
                if i == 0:
                    seen[0] = outcome(d.free, r, g)
                else:
                    time.sleep(RACE_WINDOW_S / 2)
                    seen[1] = outcome(d.map, r, g, h)

            _race(work)
            if seen == ["done", "done"]:
                return True
            if seen[1] == "done":
                d.unmap(r, g)
                d.free(r, g)
        return False
    finally:
        with contextlib.suppress(Exception):
            d.release(h)


class ReserveKeepsItsRawAddressOnTheDriver(_Broken):
    """P-reserve-disjoint. Breaks "The range overlaps no live reservation of the driver" for reservations made from two
    threads: ``reserve`` makes its over-sized ``mmap`` outside the lock (a native call needs none) and keeps the
    address the kernel gave on the driver (for its trimming, under the lock), so a second thread's ``reserve`` in
    between overwrites it and both calls return the same range (the first thread's ``mmap`` is lost). A ``reserve``
    alone, or two that do not meet, are right."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.lost: list[tuple[int, int]] = []

    def reserve(self, size: int, alignment: int) -> int:
        self.check_call("reserve", size=size, alignment=alignment)
        check_alignment(alignment, self.granularity())
        alignment = max(alignment, PAGE_BYTES)
        span = size + alignment
        self._raw = mine = libc().mmap(None, span, PROT_NONE, _RESERVE_FLAGS, -1, 0)
        if self._raw in (None, MAP_FAILED):
            self.fail("reserve", f"mmap(PROT_NONE, {span} bytes) for {size} bytes aligned to {alignment}", oom=True)
        time.sleep(RACE_WINDOW_S)
        with busy(), self.locked():
            raw = self._raw
            if mine != raw:  # lost to the other thread: kept for the proof to give back
                self.lost.append((mine, span))
            va = _align_up(raw, alignment)
            if va > raw:
                libc().munmap(raw, va - raw)
            if raw + span > va + size:
                libc().munmap(va + size, raw + span - (va + size))
            self.reservations[va] = size
        return va


def prove_reserve_keeps_its_raw_address_on_the_driver(make: Callable[[], HostDriver]) -> bool:
    """Whether two one-granule reservations made from two threads at once ever overlapped (up to ``RACE_TRIES``
    tries)."""
    d = make()
    g = d.granularity()
    try:
        for _ in range(RACE_TRIES):
            got = [0, 0]
            _race(lambda i, got=got: got.__setitem__(i, d.reserve(g, g)))
            lo, hi = sorted(got)
            for va in set(got):
                d.free(va, g)
            if hi < lo + g:
                return True
        return False
    finally:
        for raw, span in getattr(d, "lost", []):  # the broken driver's lost over-reservations
            libc().munmap(raw, span)


# -- memory accounting -----------------------------------------------------------------------------------------------
class MemoryCountedByFd(_Broken):
    """P-mem-exact. Breaks "On the host ``free`` is exactly ``total`` less the bytes of every handle not yet released
    and unmapped everywhere": ``mem_info`` adds up a table of held bytes keyed by the handle's file descriptor number,
    and ``release`` closes the memfd of a handle that stays mapped, so the next ``create`` gets the same number from the
    kernel and its entry replaces the older handle's (whose last ``unmap`` then drops the newer one's). Handles
    released once unmapped are counted right."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._by_fd: dict[int, int] = {}

    def create(self, size: int) -> HostHandle:
        handle = super().create(size)
        with busy(), self.locked():
            self._by_fd[handle.fd] = size
        return handle

    def drop_if_unused(self, handle: HostHandle) -> None:
        counted = handle.counted
        super().drop_if_unused(handle)
        if counted and not handle.counted:
            self._by_fd.pop(handle._shown, None)

    def mem_info(self) -> tuple[int, int]:
        with busy(), self.locked():
            return self.total - sum(self._by_fd.values()), self.total


def prove_memory_counted_by_fd(make: Callable[[], HostDriver]) -> list[int]:
    """A one-granule handle mapped and released, then a 2-granule handle created: the granules ``mem_info`` counts
    taken then, after the first handle's unmap, and after the second handle's release."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    first = d.create(g)
    handles = [first]
    try:
        d.map(r, g, first)
        d.release(first)
        handles.append(d.create(2 * g))
        seen = [_held_granules(d)]
        d.unmap(r, g)
        seen.append(_held_granules(d))
        d.release(handles[1])
        return [*seen, _held_granules(d)]
    finally:
        tidy(d, [(r, g)], handles)


class CreateChecksAFreeHint(_Broken):
    """P-release-returns. Breaks "Once the handle is released and unmapped everywhere, the bytes ``create`` took are
    free again": ``create`` checks the budget against a free-bytes hint of its own, which ``create`` lowers and
    ``release`` raises when it gives a handle's bytes back, but which the last ``unmap`` of a handle released while
    mapped does not raise; so handles released while mapped and then unmapped (the way a tensor closes) wear the hint
    down until a ``create`` that fits is refused as out of memory (``mem_info`` itself stays right)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._free_hint = self.total

    def charge(self, size: int, counted: list[int]) -> None:
        if size > self._free_hint:
            raise DriverOutOfMemory("create", f"{size} bytes asked, {self._free_hint} free", errno.ENOMEM)
        super().charge(size, counted)
        self._free_hint -= size

    def do_release(self, handle: HostHandle) -> None:
        counted = handle.counted
        super().do_release(handle)
        if counted and not handle.counted:
            self._free_hint += handle.size


def prove_create_checks_a_free_hint(make: Callable[[], HostDriver]) -> list[str]:
    """Nine times over: create a handle of 64 granules (an eighth of the budget), map it, release it, unmap it; the
    outcome of each create."""
    d = make()
    g, n = d.granularity(), 64
    r = d.reserve(n * g, g)
    seen: list[str] = []
    try:
        for _ in range(9):
            try:
                h = d.create(n * g)
            except DriverError as exc:
                seen.append(f"{type(exc).__name__}({exc.operation})")
                continue
            d.map(r, n * g, h)
            d.release(h)
            d.unmap(r, n * g)
            seen.append("done")
        return seen
    finally:
        tidy(d, [(r, n * g)], [])


# -- address space ---------------------------------------------------------------------------------------------------
class FreeInGibChunks(_Broken):
    """P-free-kernel. Breaks "Afterwards nothing of the range ... is held: on the host the kernel maps nothing there":
    a reservation larger than 1 GiB is given back in ``munmap`` calls of at most 1 GiB (a native limit), in a loop over
    ``range(va, va + size - CHUNK, CHUNK)`` that stops one chunk short, so the last GiB (or less) stays reserved in the
    kernel. Reservations of 1 GiB and less are given back whole."""

    CHUNK = GIB

    def do_free(self, va: int, size: int) -> None:
        if size <= self.CHUNK:
            super().do_free(va, size)
            return
        check_free(va, size, self.reservations.get(va) == size, self.mappings)
        del self.reservations[va]
        for at in range(va, va + size - self.CHUNK, self.CHUNK):
            if libc().munmap(at, min(self.CHUNK, va + size - at)) != 0:
                self.fail("free", f"munmap({at:#x}, {min(self.CHUNK, va + size - at)})")


def prove_free_in_gib_chunks(make: Callable[[], HostDriver]) -> int:
    """GiB of a freed 3 GiB reservation the kernel still holds (rounded)."""
    d = make()
    size = 3 * GIB
    va = d.reserve(size, d.granularity())
    d.free(va, size)
    kept = _reserved_pieces(va, va + size)
    for lo, hi in kept:
        libc().munmap(lo, hi - lo)
    return round(sum(hi - lo for lo, hi in kept) / GIB)


class TrimLengthIsAnInt(_Broken):
    """P-reserve-kernel. Breaks "On the host the kernel holds exactly ``[va, va+size)`` as reserved ...: address space
    taken to align the range is given back before ``reserve`` returns": the lengths of the trims pass through a C
    ``int`` (the native wrapper's prototype), so a head or tail of 2 GiB or more, which only alignments of 4 GiB and
    more leave, wraps: its ``munmap`` fails or gives back less, unchecked, and the kernel keeps gigabytes of the
    over-reservation. Smaller alignments are trimmed right."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.spans: list[tuple[int, int]] = []

    def do_reserve(self, size: int, alignment: int) -> int:
        span = size + alignment
        raw = libc().mmap(None, span, PROT_NONE, _RESERVE_FLAGS, -1, 0)
        if raw in (None, MAP_FAILED):
            self.fail("reserve", f"mmap(PROT_NONE, {span} bytes) for {size} bytes aligned to {alignment}", oom=True)
        va = _align_up(raw, alignment)
        self.spans.append((raw, span))  # for the proof to give back what the trims left
        if va > raw:
            libc().munmap(raw, ctypes.c_int(va - raw).value)
        if raw + span > va + size:
            libc().munmap(va + size, ctypes.c_int(raw + span - (va + size)).value)
        self.reservations[va] = size
        return va


def prove_trim_length_is_an_int(make: Callable[[], HostDriver]) -> int:
    """GiB of address space (rounded) a one-granule reservation aligned to 16 GiB takes beyond its granule."""
    d = make()
    g = d.granularity()
    before = _address_space()
    va = d.reserve(g, 16 * GIB)
    taken = _address_space() - before
    d.free(va, g)
    for raw, span in getattr(d, "spans", []):  # what the broken trims left reserved
        for lo, hi in _reserved_pieces(raw, raw + span):
            libc().munmap(lo, hi - lo)
    return round((taken - g) / GIB)


# -- access state ----------------------------------------------------------------------------------------------------
class SetAccessSkipsGrantedRanges(_Broken):
    """P-access. Breaks "Make the fully mapped range ``[va, va+size)`` readable and writable by the device": to spare
    the ``mprotect`` when a caller grants the same range again, it remembers the ranges it granted and only checks a
    remembered range is still fully mapped; ``free`` forgets the ranges of the reservation, ``unmap`` forgets none, so a
    range unmapped, mapped again and granted again is left without access."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._granted: set[tuple[int, int]] = set()

    def do_set_access(self, va: int, size: int) -> None:
        if (va, size) in self._granted:
            mapped_parts(va, size, ((m, s) for m, (s, _) in self.mappings.items()))
            return
        super().do_set_access(va, size)
        self._granted.add((va, size))

    def do_free(self, va: int, size: int) -> None:
        super().do_free(va, size)
        self._granted = {(a, s) for a, s in self._granted if not va <= a < va + size}


def prove_set_access_skips_granted_ranges(make: Callable[[], HostDriver]) -> list[bool]:
    """A one-granule mapping given access, then unmapped, mapped again and given access again: whether it is
    accessible after each ``set_access``."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.set_access(r, g)
        seen = [d.accessible(r)]
        d.unmap(r, g)
        d.map(r, g, h)
        d.set_access(r, g)
        return [*seen, d.accessible(r)]
    finally:
        tidy(d, [(r, g)], [h])


class SecondMappingFromTheStart(_Broken):
    """P-map. Breaks "Back ``[va, va+size)`` with bytes ``[offset, offset+size)`` of ``handle``" for a handle mapped at
    a second address: a handle already mapped is mapped again as a duplicate of its mapping (what ``mremap`` with an
    old size of 0 makes), which starts where the handle starts, so the offset asked is dropped. A handle's first
    mapping takes its offset."""

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        if not handle.maps:
            super().do_map(va, size, handle, offset)
            return
        check_map(self, va, size, handle, offset)
        mmap_handle(self, va, size, handle, 0)


def prove_second_mapping_from_the_start(make: Callable[[], HostDriver]) -> list[int]:
    """A 2-granule handle mapped whole and given access, 0x22 written at its first byte and 0x11 at its second
    granule's; its second granule then mapped at a second address (offset 1 granule) and given access: the first byte
    read there, and at the second granule of the first mapping."""
    d = make()
    g = d.granularity()
    r = d.reserve(3 * g, g)
    h = d.create(2 * g)
    try:
        d.map(r, 2 * g, h)
        d.set_access(r, 2 * g)
        poke(d, r, 0x22)
        poke(d, r + g, 0x11)
        d.map(r + 2 * g, g, h, g)
        d.set_access(r + 2 * g, g)
        return [read_byte(d, r + 2 * g), read_byte(d, r + g)]
    finally:
        tidy(d, [(r, 3 * g)], [h])


# -- identity --------------------------------------------------------------------------------------------------------
class DeviceOrdinalAfterTheFirstTensor(_Broken):
    """P-tensor-device. Breaks "Its device is the driver's ``device``": the driver fixes its ``device`` when it makes
    its first tensor, from the tensor's device type and the ordinal its context reports (0), so from then on it names
    ``cpu:0`` while its tensors are on ``cpu`` (torch does not count the two as equal). Before any tensor it names
    ``cpu``."""

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        t = super().tensor(va, nbytes, keeper)
        self.device = torch.device(t.device.type, 0)
        return t


def prove_device_ordinal_after_the_first_tensor(make: Callable[[], HostDriver]) -> list[bool]:
    """Whether the driver's ``device`` is the device of each of two tensors it returned, once it returned it."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    try:
        seen = []
        for _ in range(2):
            t = d.tensor(r, 16, None)
            seen.append(t.device == d.device)
            del t
        return seen
    finally:
        d.free(r, g)


# -- native failures -------------------------------------------------------------------------------------------------
class FillFailureIsAMemoryError(_Broken):
    """P-native-failure. Breaks "A native call that fails raises ``DriverError`` naming the operation, never ``OSError``
    or the native library's own error": when the ``mmap`` that fills a new handle's pages fails (the address space is
    exhausted), the fill helper raises Python's ``MemoryError``, which ``create`` lets through as it is. A failed
    ``memfd_create`` or ``ftruncate`` still raises ``DriverError``."""

    @staticmethod
    def fill(fd: int, size: int, byte: int) -> None:
        lib = libc()
        addr = lib.mmap(None, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        if addr in (None, MAP_FAILED):
            raise MemoryError(f"cannot map {size} bytes to fill a new handle")
        try:
            ctypes.memset(addr, byte, size)
        finally:
            lib.munmap(addr, size)


def prove_fill_failure_is_a_memory_error(make: Callable[[], HostDriver]) -> list[object]:
    """The outcome of a one-granule ``create`` while the process may map at most 1 MiB more (``RLIMIT_AS`` lowered
    for the one call), and the granules ``mem_info`` counts taken after it."""
    d = make()
    g = d.granularity()
    with open("/proc/self/status") as status:
        vm_size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_size + MIB, hard))
    try:
        seen = outcome(d.create, g)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    return [seen, _held_granules(d)]


# -- refusals --------------------------------------------------------------------------------------------------------
class RefusedMapSplitsTheReservation(_Broken):
    """P-refusal-unchanged. Breaks "A refused call leaves every observable as it was: ... every reservation as usable as
    before (each of its unmapped granules still takes a new mapping)": like an extent allocator, ``map`` splits the
    record of the reservation at ``va`` and ``va + size`` to claim the range as one extent before its checks, and joins
    the pieces back once the mapping is made; a ``map`` refused after the split (over a live mapping, past the handle's
    end, a released handle) leaves the reservation in pieces, so a later ``map`` across a piece's border is refused as
    not inside one reservation (and ``free`` of the whole reservation is refused)."""

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        whole = next(((r, s) for r, s in self.reservations.items() if r <= va and va + size <= r + s), None)
        made = []
        if whole is not None:
            r, s = whole
            for lo, hi in ((r, va), (va, va + size), (va + size, r + s)):
                if lo < hi:
                    self.reservations[lo] = hi - lo
                    made.append(lo)
        super().do_map(va, size, handle, offset)
        if whole is not None:
            for lo in made:
                del self.reservations[lo]
            self.reservations[whole[0]] = whole[1]


def prove_refused_map_splits_the_reservation(make: Callable[[], HostDriver]) -> list[str]:
    """A 4-granule reservation with its third granule mapped: the outcome of mapping granules 2 and 3 (over that
    mapping), then of mapping granules 1 and 2 (both unmapped)."""
    d = make()
    g = d.granularity()
    r = d.reserve(4 * g, g)
    one, two = d.create(g), d.create(2 * g)
    try:
        d.map(r + 2 * g, g, one)
        return [outcome(d.map, r + g, 2 * g, two), outcome(d.map, r, 2 * g, two)]
    finally:
        tidy(d, [(r, 4 * g)], [one, two])


class HandleEndRefusalInMib(_Broken):
    """P-refusal-names. Breaks "Its message names what was refused: at least one argument of the call, an address,
    size or offset in decimal or in hex (``0x...``), or the handle as ``str`` or ``repr`` shows it": the refusal of a
    ``map`` that runs past the handle's end says where the mapping would end and how large the handle is, in MiB, which
    names none of the arguments. Every other refusal keeps the host's message."""

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        if not handle.released and offset + size > handle.size:
            check_inside("map", va, size, self.reservations.items())
            check_no_overlap(va, size, ((m_va, m_size) for m_va, (m_size, _) in self.mappings.items()))
            raise DriverError(
                "map", f"the mapping would end {(offset + size) / MIB:g} MiB into a {handle.size / MIB:g} MiB handle"
            )
        super().do_map(va, size, handle, offset)


def prove_handle_end_refusal_in_mib(make: Callable[[], HostDriver]) -> list[object]:
    """A 2-granule handle mapped 2 granules long at offset 1 granule: the outcome, and whether the message names an
    argument (decimal or hex) or the handle."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(2 * g)
    try:
        try:
            d.map(r, 2 * g, h, g)
        except DriverError as exc:
            names = [str(v) for v in (r, 2 * g, g)] + [hex(v) for v in (r, 2 * g, g)] + [repr(h), str(h)]
            return [f"DriverError({exc.operation})", any(name in str(exc) for name in names)]
        return ["done", False]
    finally:
        tidy(d, [(r, 2 * g)], [h])


# -- interrupted calls -----------------------------------------------------------------------------------------------
class InterruptedCreateKeepsTheMemfd(_Broken):
    """P-interrupted. Breaks "``reserve`` and ``create``, whose result never reaches the caller, hold nothing
    afterwards": ``create`` closes its new memfd when ``ftruncate`` or the fill fails with an ``OSError`` (and raises
    ``DriverError``), but an exception of any other kind landing after the ``memfd_create`` (a ``KeyboardInterrupt``)
    passes the ``except OSError`` clause and leaves the memfd open (the held bytes are given back)."""

    def do_create(self, size: int) -> HostHandle:
        try:
            fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        except OSError as exc:
            raise DriverError("create", f"memfd_create for {size} bytes: {exc}", exc.errno) from exc
        try:
            os.ftruncate(fd, size)
            if self.fill_byte is not None:
                self.fill(fd, size, self.fill_byte)
        except OSError as exc:
            os.close(fd)
            kind = DriverOutOfMemory if exc.errno in (errno.ENOMEM, errno.ENOSPC) else DriverError
            raise kind("create", f"ftruncate/fill of a {size}-byte memfd: {exc}", exc.errno) from exc
        return HostHandle(fd, size)


def prove_interrupted_create_keeps_the_memfd(make: Callable[[], HostDriver]) -> list[int]:
    """For each line of a one-granule ``create`` interrupted in turn: the lines after which the process holds a memfd
    of the driver more than before."""
    kept = []
    for nth in range(1, 200):
        d = make()
        before = _memfds()
        interrupted = interrupt_at_line(d, nth, d.create, d.granularity())
        extra = _memfds() - before
        if interrupted and extra:
            kept.append(nth)
        for fd in extra:
            os.close(fd)
        if not interrupted:
            break
    return kept


class UnmapLockLeftAcrossALine(_Broken):
    """P-interrupted. Breaks "every later call, from any thread, behaves as the protocol says for that state (no lock
    is left held)": ``unmap`` takes the driver's lock by hand with a timeout (to fail rather than hang) and checks the
    result on the next line, outside the ``try`` whose ``finally`` gives the lock back, so an exception landing between
    the ``acquire`` and the ``try`` (or on the ``finally``'s own line, before its ``release``) leaves the lock held and
    every later call waits for it. Exceptions inside the ``try`` give the lock back."""

    LOCK_WAIT_S = 10.0

    def unmap(self, va: int, size: int) -> None:
        self.check_call("unmap", va=va, size=size)
        taken = self.locked().acquire(timeout=self.LOCK_WAIT_S)
        if not taken:
            raise DriverError("unmap", f"[{va:#x}, +{size}): the driver's lock stayed busy for {self.LOCK_WAIT_S} s")
        try:
            with busy():
                return self.do_unmap(va, size)
        finally:
            self.locked().release()


def _lock_left_held(d: HostDriver) -> bool:
    """Whether a ``mem_info`` from another thread waits (half a second) for the driver's lock; if it does, the lock is
    let go so that the waiting call returns."""
    done = threading.Event()
    worker = threading.Thread(target=lambda: (d.mem_info(), done.set()), daemon=True)
    worker.start()
    if done.wait(0.5):
        worker.join()
        return False
    d.locked().release()
    worker.join()
    return True


def prove_unmap_lock_left_across_a_line(make: Callable[[], HostDriver]) -> list[int]:
    """For each line of ``unmap`` of a one-granule mapping interrupted in turn: the lines after which a call from
    another thread waits for the driver's lock."""
    held = []
    for nth in range(1, 100):
        d = make()
        g = d.granularity()
        r = d.reserve(g, g)
        h = d.create(g)
        d.map(r, g, h)
        interrupted = interrupt_at_line(d, nth, d.unmap, r, g)
        if _lock_left_held(d):
            held.append(nth)
        tidy(d, [(r, g)], [h])
        if not interrupted:
            break
    return held


# -- tensors ---------------------------------------------------------------------------------------------------------
class TensorOfWholeWords(_Broken):
    """P-tensor. Breaks "A 1-D ``torch.uint8`` tensor of ``nbytes`` elements over ``[va, va+nbytes)``": a tensor of 64
    bytes and more is built over an array of 8-byte words (for word-wise copies) viewed as bytes, ``nbytes // 8`` of
    them, so a size that is not a multiple of 8 loses its last bytes. Smaller tensors, and sizes that are multiples
    of 8, are right."""

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        self.check_call("tensor", va=va, size=nbytes)
        if nbytes < 64:
            return super().tensor(va, nbytes, keeper)
        buffer = (ctypes.c_uint64 * (nbytes // 8)).from_address(va)
        buffer.keeper = keeper
        return torch.frombuffer(buffer, dtype=torch.uint8)


def prove_tensor_of_whole_words(make: Callable[[], HostDriver]) -> list[int]:
    """The element counts of tensors of 5, 64 and 100 bytes at 3 bytes into an accessible granule."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.set_access(r, g)
        return [d.tensor(r + 3, n, None).numel() for n in (5, 64, 100)]
    finally:
        tidy(d, [(r, g)], [h])


# -- the factories and the cases -------------------------------------------------------------------------------------
zero_skips_the_middle_mappings = functools.partial(ZeroSkipsTheMiddleMappings, "broken-zero-skips-the-middle-mappings")
overlap_checks_the_ends = functools.partial(OverlapChecksTheEnds, "broken-overlap-checks-the-ends")
accessible_from_records_past_64 = functools.partial(
    AccessibleFromRecordsPast64, "broken-accessible-from-records-past-64"
)
free_unmaps_after_the_lock = functools.partial(FreeUnmapsAfterTheLock, "broken-free-unmaps-after-the-lock")
reserve_keeps_its_raw_address_on_the_driver = functools.partial(
    ReserveKeepsItsRawAddressOnTheDriver, "broken-reserve-keeps-its-raw-address-on-the-driver"
)
memory_counted_by_fd = functools.partial(MemoryCountedByFd, "broken-memory-counted-by-fd")
create_checks_a_free_hint = functools.partial(CreateChecksAFreeHint, "broken-create-checks-a-free-hint")
free_in_gib_chunks = functools.partial(FreeInGibChunks, "broken-free-in-gib-chunks")
trim_length_is_an_int = functools.partial(TrimLengthIsAnInt, "broken-trim-length-is-an-int")
set_access_skips_granted_ranges = functools.partial(
    SetAccessSkipsGrantedRanges, "broken-set-access-skips-granted-ranges"
)
second_mapping_from_the_start = functools.partial(SecondMappingFromTheStart, "broken-second-mapping-from-the-start")
device_ordinal_after_the_first_tensor = functools.partial(
    DeviceOrdinalAfterTheFirstTensor, "broken-device-ordinal-after-the-first-tensor"
)
fill_failure_is_a_memory_error = functools.partial(FillFailureIsAMemoryError, "broken-fill-failure-is-a-memory-error")
refused_map_splits_the_reservation = functools.partial(
    RefusedMapSplitsTheReservation, "broken-refused-map-splits-the-reservation"
)
handle_end_refusal_in_mib = functools.partial(HandleEndRefusalInMib, "broken-handle-end-refusal-in-mib")
interrupted_create_keeps_the_memfd = functools.partial(
    InterruptedCreateKeepsTheMemfd, "broken-interrupted-create-keeps-the-memfd"
)
unmap_lock_left_across_a_line = functools.partial(UnmapLockLeftAcrossALine, "broken-unmap-lock-left-across-a-line")
tensor_of_whole_words = functools.partial(TensorOfWholeWords, "broken-tensor-of-whole-words")

CASES: dict[str, Case] = {
    "zero_skips_the_middle_mappings": Case(
        zero_skips_the_middle_mappings, "P-zero", prove_zero_skips_the_middle_mappings, [0xA5, 0, 0, 0, 0xA5]
    ),
    "overlap_checks_the_ends": Case(
        overlap_checks_the_ends, "P-map-overlap", prove_overlap_checks_the_ends, ["DriverError(map)"] * 3
    ),
    "accessible_from_records_past_64": Case(
        accessible_from_records_past_64, "P-accessible", prove_accessible_from_records_past_64, [False, True, False]
    ),
    "free_unmaps_after_the_lock": Case(
        free_unmaps_after_the_lock, "P-threads", prove_free_unmaps_after_the_lock, False
    ),
    "reserve_keeps_its_raw_address_on_the_driver": Case(
        reserve_keeps_its_raw_address_on_the_driver,
        "P-reserve-disjoint",
        prove_reserve_keeps_its_raw_address_on_the_driver,
        False,
    ),
    "memory_counted_by_fd": Case(memory_counted_by_fd, "P-mem-exact", prove_memory_counted_by_fd, [3, 2, 0]),
    "create_checks_a_free_hint": Case(
        create_checks_a_free_hint, "P-release-returns", prove_create_checks_a_free_hint, ["done"] * 9
    ),
    "free_in_gib_chunks": Case(free_in_gib_chunks, "P-free-kernel", prove_free_in_gib_chunks, 0),
    "trim_length_is_an_int": Case(trim_length_is_an_int, "P-reserve-kernel", prove_trim_length_is_an_int, 0),
    "set_access_skips_granted_ranges": Case(
        set_access_skips_granted_ranges, "P-access", prove_set_access_skips_granted_ranges, [True, True]
    ),
    "second_mapping_from_the_start": Case(
        second_mapping_from_the_start, "P-map", prove_second_mapping_from_the_start, [0x11, 0x11]
    ),
    "device_ordinal_after_the_first_tensor": Case(
        device_ordinal_after_the_first_tensor,
        "P-tensor-device",
        prove_device_ordinal_after_the_first_tensor,
        [True, True],
    ),
    "fill_failure_is_a_memory_error": Case(
        fill_failure_is_a_memory_error,
        "P-native-failure",
        prove_fill_failure_is_a_memory_error,
        ["DriverOutOfMemory(create)", 0],
    ),
    "refused_map_splits_the_reservation": Case(
        refused_map_splits_the_reservation,
        "P-refusal-unchanged",
        prove_refused_map_splits_the_reservation,
        ["DriverError(map)", "done"],
    ),
    "handle_end_refusal_in_mib": Case(
        handle_end_refusal_in_mib, "P-refusal-names", prove_handle_end_refusal_in_mib, ["DriverError(map)", True]
    ),
    "interrupted_create_keeps_the_memfd": Case(
        interrupted_create_keeps_the_memfd, "P-interrupted", prove_interrupted_create_keeps_the_memfd, []
    ),
    "unmap_lock_left_across_a_line": Case(
        unmap_lock_left_across_a_line, "P-interrupted", prove_unmap_lock_left_across_a_line, []
    ),
    "tensor_of_whole_words": Case(tensor_of_whole_words, "P-tensor", prove_tensor_of_whole_words, [5, 64, 100]),
}
