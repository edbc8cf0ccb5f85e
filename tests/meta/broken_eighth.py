"""An eighth set of deliberately broken host drivers, written from the protocol's text (``drivers/_protocol.py``) and
the host driver by a reader outside the rules, without reading them.

Same layout as ``tests.meta.broken_seventh``: each class breaks one sentence or clause of the protocol, quoted with its
id in the class docstring, the way a backend's own bug might (only in particular shapes, sizes, offsets, sequences,
orders of calls, counts of live objects, threads, interrupt points or native-failure states), and comes with a proof
that drives a driver built by the factory it is given and returns what it observed; ``CASES`` pairs every factory with
the id it breaks, its proof and what the intact host driver observes. The set aims at the sentences the earlier sets
targeted least. Use a driver as ``extensible-kv check-driver tests.meta.broken_eighth:<factory>``.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import queue
import resource
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

import torch

from extensible_kv.drivers.host import (
    MAP_ANONYMOUS,
    MAP_FAILED,
    MAP_FIXED,
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
from extensible_kv.drivers.records import check_alignment, check_free, check_no_overlap
from extensible_kv.errors import DriverError, DriverOutOfMemory
from extensible_kv.reaper import busy
from tests.meta.broken_protocol import (
    BUDGET,
    GIB,
    RESERVED,
    Case,
    _Broken,
    _race,
    check_map,
    interrupt_at_line,
    kernel_ranges,
    mmap_handle,
    outcome,
    poke,
    prove_reserve_aligned_to_64_gib_with_1_gib_left,
    read_byte,
    tidy,
    vm_size,
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


def _perms_at(va: int) -> str:
    """The permissions ``/proc/self/maps`` shows for the page at ``va`` (``""`` if the kernel maps nothing there)."""
    return next((perms for lo, hi, perms, _ in kernel_ranges() if lo <= va < hi), "")


def _memfd_ranges() -> set[tuple[int, int]]:
    """The ranges the kernel maps from one of the host driver's memfds."""
    return {(lo, hi) for lo, hi, _, path in kernel_ranges() if f"memfd:{MEMFD_NAME}" in path}


def _reserved_ranges() -> set[tuple[int, int]]:
    """The ranges the kernel holds as reserved (anonymous, no access)."""
    return {(lo, hi) for lo, hi, perms, path in kernel_ranges() if perms == "---p" and not path}


def _reservation_of(d: HostDriver, va: int) -> int | None:
    """The start of the reservation of ``d`` that holds the address ``va``, as its records say."""
    return next((r for r, s in d.reservations.items() if r <= va < r + s), None)


# -- identity and memory ---------------------------------------------------------------------------------------------
class GranularityIsThreadLocal(_Broken):
    """P-granularity. Breaks "The size in bytes that every size, address and offset of ``map``/``unmap``/
    ``set_access``/``create`` is a multiple of: a positive multiple of 4096, the same on every call": like a backend
    that keeps its allocation properties in a per-thread context, made current in the thread that built the driver,
    ``granularity()`` answers from the calling thread's context, and a thread with none answers the minimum (the page,
    4096). The driver's own checks use its real granularity; the building thread is answered right."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._context = threading.local()
        self._context.granularity = self.granularity()

    def granularity(self) -> int:
        return getattr(self._context, "granularity", PAGE_BYTES)


def prove_granularity_is_thread_local(make: Callable[[], HostDriver]) -> list[int]:
    """``granularity()`` asked from the thread that built the driver, then from another thread."""
    d = make()
    seen = [d.granularity()]
    worker = threading.Thread(target=lambda: seen.append(d.granularity()))
    worker.start()
    worker.join()
    return seen


class TotalLessPageTables(_Broken):
    """P-mem-bounds. Breaks "``(free, total)`` bytes with ``0 <= free <= total``, ``total`` the same for the driver's
    life": like a device whose page tables live in its own memory, ``mem_info`` takes the page tables of the address
    space reserved (4 KiB per granule) out of ``total`` and ``free``, counted only for the address space reserved past
    ``total`` (the first level it preallocates covers that much), so ``total`` shrinks while more address space than
    memory is reserved. With less reserved, ``total`` is the budget."""

    def mem_info(self) -> tuple[int, int]:
        free, total = super().mem_info()
        with busy(), self.locked(): reserved = sum(self.reservations.values())  # fmt: skip
        tables = max(0, reserved - total) // self.granularity() * PAGE_BYTES
        return free - tables, total - tables


def prove_total_less_page_tables(make: Callable[[], HostDriver]) -> list[int]:
    """``mem_info``'s ``total`` before and while 2 GiB of address space is reserved."""
    d = make()
    seen = [d.mem_info()[1]]
    r = d.reserve(2 * GIB, d.granularity())
    try:
        return [*seen, d.mem_info()[1]]
    finally:
        tidy(d, [(r, 2 * GIB)], [])


# -- mappings: shapes, sizes, offsets --------------------------------------------------------------------------------
class LargeMappingsArePrivate(_Broken):
    """P-map-shared. Breaks "Mappings share the handle's bytes: a handle mapped at two addresses shows the same bytes at
    both, and a write through one is read through the other": mappings of 16 granules and more take a prefaulting
    path whose ``mmap`` flags were copied from the reserve path, ``MAP_PRIVATE``, so a write through such a mapping is
    copied on write and reaches neither the handle nor its other mappings. Smaller mappings are shared."""

    LARGE = 16

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        if size < self.LARGE * self.granularity():
            super().do_map(va, size, handle, offset)
            return
        check_map(self, va, size, handle, offset)
        mmap_handle(self, va, size, handle, offset, MAP_PRIVATE)


def prove_large_mappings_are_private(make: Callable[[], HostDriver]) -> list[int]:
    """A 16-granule handle mapped whole at two addresses, both given access: 0x3C written through the first, then
    the byte read through the second and through the first."""
    d = make()
    g = d.granularity()
    n = LargeMappingsArePrivate.LARGE
    r = d.reserve(2 * n * g, g)
    h = d.create(n * g)
    try:
        d.map(r, n * g, h)
        d.map(r + n * g, n * g, h)
        d.set_access(r, 2 * n * g)
        poke(d, r, 0x3C)
        return [read_byte(d, r + n * g), read_byte(d, r)]
    finally:
        tidy(d, [(r, 2 * n * g)], [h])


class FirstMapFixesTheHandlesLayout(_Broken):
    """P-map-offset. Breaks "any other driver (the host's mmap) takes every offset and size within the handle;
    whichever a driver does, it does for every call": like a backend that lays a handle's pages out at its first
    ``map``, a handle first mapped whole is marked as a whole-handle allocation, and a later ``map`` of part of it is
    refused. A handle first mapped in part maps every part and the whole afterwards."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._layout: weakref.WeakKeyDictionary[HostHandle, bool] = weakref.WeakKeyDictionary()

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        whole = offset == 0 and size == handle.size
        if self._layout.get(handle) and not whole:
            check_map(self, va, size, handle, offset)
            raise DriverError("map", f"offset {offset} + size {size}: {handle!r} was mapped whole; map all of it")
        super().do_map(va, size, handle, offset)
        self._layout.setdefault(handle, whole)


def prove_first_map_fixes_the_handles_layout(make: Callable[[], HostDriver]) -> list[str]:
    """A 2-granule handle: the outcomes of mapping it whole, then of mapping its second granule at another address."""
    d = make()
    g = d.granularity()
    r = d.reserve(3 * g, g)
    h = d.create(2 * g)
    try:
        return [outcome(d.map, r, 2 * g, h, 0), outcome(d.map, r + 2 * g, g, h, g)]
    finally:
        tidy(d, [(r, 3 * g)], [h])


class MapInChunksFromTheSameOffset(_Broken):
    """P-map. Breaks "Back ``[va, va+size)`` with bytes ``[offset, offset+size)`` of ``handle``": a mapping of more
    than 6 granules is made in ``mmap`` calls of at most 6 granules (the staging limit of a native call), and the loop
    advances the address by each chunk but not the handle's offset, so every chunk after the first shows the handle
    from ``offset`` again. Mappings of 6 granules or fewer are one call, and right."""

    CHUNK = 6

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        chunk = self.CHUNK * self.granularity()
        if size <= chunk:
            super().do_map(va, size, handle, offset)
            return
        check_map(self, va, size, handle, offset)
        live = (size, handle)
        try:
            handle.maps, self.mappings[va] = handle.maps + 1, live
            for at in range(va, va + size, chunk):
                n = min(chunk, va + size - at)
                if libc().mmap(at, n, PROT_NONE, MAP_SHARED | MAP_FIXED, handle.fd, offset) != at:
                    self.fail("map", f"mmap(MAP_FIXED, {at:#x}, {n}, fd={handle.fd}, offset={offset})")
        except BaseException:
            if self.mappings.get(va) is live:
                libc().mmap(va, size, PROT_NONE, RESERVED, -1, 0)
                handle.maps, _ = handle.maps - 1, self.mappings.pop(va)
            raise


def prove_map_in_chunks_from_the_same_offset(make: Callable[[], HostDriver]) -> list[int]:
    """A 7-granule handle mapped whole with access: 0x3C written at its first granule, 0x5A at its seventh, then the
    first byte of each read back."""
    d = make()
    g = d.granularity()
    r = d.reserve(7 * g, g)
    h = d.create(7 * g)
    try:
        d.map(r, 7 * g, h)
        d.set_access(r, 7 * g)
        poke(d, r, 0x3C)
        poke(d, r + 6 * g, 0x5A)
        return [read_byte(d, r), read_byte(d, r + 6 * g)]
    finally:
        tidy(d, [(r, 7 * g)], [h])


class OffsetMappingsAreReadable(_Broken):
    """P-accessible-kernel. Breaks "``/proc/self/maps`` shows ... a mapped granule without access as a shared mapping of
    it without access ...; touching any granule that is not accessible faults": a mapping at a non-zero offset (a view
    into a handle) is made ``PROT_READ``, to let the kernel share its page-cache pages at once (read-ahead), until
    ``set_access`` grants it; ``accessible`` says ``False`` (it is not writable), but reading it does not fault.
    Mappings at offset 0 are made without access."""

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        if not offset:
            super().do_map(va, size, handle, offset)
            return
        check_map(self, va, size, handle, offset)
        live = (size, handle)
        try:
            handle.maps, self.mappings[va] = handle.maps + 1, live
            if libc().mmap(va, size, PROT_READ, MAP_SHARED | MAP_FIXED, handle.fd, offset) != va:
                self.fail("map", f"mmap(PROT_READ, MAP_FIXED, {va:#x}, {size}, fd={handle.fd}, offset={offset})")
        except BaseException:
            if self.mappings.get(va) is live:
                libc().mmap(va, size, PROT_NONE, RESERVED, -1, 0)
                handle.maps, _ = handle.maps - 1, self.mappings.pop(va)
            raise


def prove_offset_mappings_are_readable(make: Callable[[], HostDriver]) -> list[object]:
    """The second granule of a 2-granule handle mapped (offset one granule), without access: the permissions the kernel
    shows there, and whether ``accessible`` says it is."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(2 * g)
    try:
        d.map(r, g, h, g)
        return [_perms_at(r), d.accessible(r)]
    finally:
        tidy(d, [(r, g)], [h])


# -- contents --------------------------------------------------------------------------------------------------------
class LargeZeroRoundsItsEndUp(_Broken):
    """P-zero. Breaks "Set exactly the bytes ``[va, va+size)`` to zero ...; the bytes around the range keep their
    values": a zero of 1 MiB and more takes a page-wise path (whole pages at once, as a page-granular native fill
    does) whose page count rounds the range's end up to a page, so the bytes after an end that is not page-aligned, up
    to the next page, are zeroed too. Smaller zeroes, and large ones ending on a page, are exact."""

    def zero(self, va: int, size: int) -> None:
        self.check_call("zero", va=va, size=size)
        end = va + size
        if size >= MIB:
            end = -(-end // PAGE_BYTES) * PAGE_BYTES
        ctypes.memset(va, 0, end - va)


def prove_large_zero_rounds_its_end_up(make: Callable[[], HostDriver]) -> list[int]:
    """An accessible granule with 0x3C written at bytes ``1 MiB + 99`` and ``1 MiB + 100``; the first ``1 MiB + 100``
    bytes zeroed: the two bytes read back."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.set_access(r, g)
        end = r + MIB + 100
        poke(d, end - 1, 0x3C)
        poke(d, end, 0x3C)
        d.zero(r, MIB + 100)
        d.synchronize()
        return [read_byte(d, end - 1), read_byte(d, end)]
    finally:
        tidy(d, [(r, g)], [h])


class SynchronizeWaitsForAnEmptyQueue(_Broken):
    """P-synchronize. Breaks "Wait for the device's outstanding work and return ``None``": a zero of 16 MiB and more is
    queued to a worker (an asynchronous fill on a stream, after a launch latency), and ``synchronize`` waits until the
    queue is empty, not until its work is done: the worker takes a job off the queue before it runs it, so
    ``synchronize`` returns while the zero is still pending. Smaller zeroes are synchronous."""

    LARGE = 16 * MIB
    LAUNCH_S = 0.5

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._queue: queue.Queue[tuple[int, int]] = queue.Queue()

    def zero(self, va: int, size: int) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < self.LARGE:
            super().zero(va, size)
            return
        self.check_call("zero", va=va, size=size)
        self._queue.put((va, size))
        threading.Thread(target=self._launch, daemon=True).start()

    def _launch(self) -> None:
        va, size = self._queue.get()
        try:
            time.sleep(self.LAUNCH_S)
            g = self.granularity()
            with busy(), self.locked():  # never into memory unmapped meanwhile (that would crash the process)
                if all(HostDriver.accessible(self, a) for a in range(va - va % g, va + size, g)):
                    ctypes.memset(va, 0, size)
        finally:
            self._queue.task_done()

    def synchronize(self) -> None:
        while not self._queue.empty():
            time.sleep(1e-3)


def prove_synchronize_waits_for_an_empty_queue(make: Callable[[], HostDriver]) -> list[int]:
    """An accessible 8-granule (16 MiB) mapping, filled 0xA5 at creation, zeroed whole and synchronized: its first
    and last bytes."""
    d = make()
    g = d.granularity()
    r = d.reserve(8 * g, g)
    h = d.create(8 * g)
    try:
        d.map(r, 8 * g, h)
        d.set_access(r, 8 * g)
        d.zero(r, 8 * g)
        d.synchronize()
        return [read_byte(d, r), read_byte(d, r + 8 * g - 1)]
    finally:
        pending = getattr(d, "_queue", None)
        if pending is not None:  # the broken driver's pending work, before the unmap
            pending.join()
        tidy(d, [(r, 8 * g)], [h])


# -- released handles ------------------------------------------------------------------------------------------------
class ReleasedMemfdRecycled(_Broken):
    """P-release-mapped. Breaks "memory that is still mapped stays alive, with its bytes, until unmapped everywhere":
    ``release`` of a handle that is still mapped parks its memfd (to be closed at the handle's last ``unmap``), and a
    ``create`` of the same size takes a parked memfd instead of making a new one, as a physical allocator might take
    memory it believes is on its way out, and fills it with the fill byte: the released handle's live mapping shows
    the new handle's bytes. A handle released while mapped nowhere is closed at once, and a ``create`` of another size,
    or with nothing parked, makes a new memfd."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._parked: list[tuple[HostHandle, int]] = []

    def do_release(self, handle: HostHandle) -> None:
        if handle.released or handle.maps == 0:
            super().do_release(handle)
            return
        # parked, marked and forgotten in one line: an exception lands before all of it or after all of it
        self._parked[len(self._parked) :], handle.fd, handle.released = [(handle, handle.fd)], -1, True

    def drop_if_unused(self, handle: HostHandle) -> None:
        if handle.released and handle.maps == 0:
            for i, (parked, fd) in enumerate(self._parked):
                if parked is handle:
                    del self._parked[i]
                    os.close(fd)
                    break
        super().drop_if_unused(handle)

    def _unpark(self, size: int) -> int | None:
        for i, (parked, fd) in enumerate(self._parked):
            if parked.size == size:
                del self._parked[i]
                return fd
        return None

    def do_create(self, size: int) -> HostHandle:
        with busy(), self.locked(): fd = self._unpark(size)  # fmt: skip
        if fd is None:
            return super().do_create(size)
        if self.fill_byte is not None:
            self.fill(fd, size, self.fill_byte)
        return HostHandle(fd, size)


def prove_released_memfd_recycled(make: Callable[[], HostDriver]) -> int:
    """A one-granule handle mapped with access and written 0x3C, then released (still mapped); a new one-granule handle
    created: the byte read through the released handle's mapping."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    old = d.create(g)
    handles = [old]
    try:
        d.map(r, g, old)
        d.set_access(r, g)
        poke(d, r, 0x3C)
        d.release(old)
        handles.append(d.create(g))
        return read_byte(d, r)
    finally:
        tidy(d, [(r, g)], handles)


class ReleasedHandlesLastMappingLingers(_Broken):
    """P-unmap. Breaks "Return ``[va, va+size)`` ... to reserved: not accessible ..., and free for a new mapping": like
    a driver that leaves a dead allocation's teardown to a later sweep, the last ``unmap`` of a released handle puts the
    range back to reserved and gives the bytes back, but keeps the range in the table ``map``'s overlap check reads
    until the sweep, which runs at the next ``create`` (or the reservation's ``free``); a ``map`` there before it is
    refused. Unmapping a handle not released, or with mappings left, frees the range at once."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._lingering: dict[int, int] = {}

    def forget(self, va: int, live: tuple[int, HostHandle]) -> None:
        super().forget(va, live)
        if live[1].released and live[1].maps == 0:
            self._lingering[va] = live[0]

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        if self._lingering:
            check_map(self, va, size, handle, offset)
            check_no_overlap(va, size, self._lingering.items())
        super().do_map(va, size, handle, offset)

    def create(self, size: int) -> HostHandle:
        handle = super().create(size)
        with busy(), self.locked(): self._lingering.clear()  # fmt: skip
        return handle

    def do_free(self, va: int, size: int) -> None:
        super().do_free(va, size)
        for m in [m for m in self._lingering if va <= m < va + size]:
            del self._lingering[m]


def prove_released_handles_last_mapping_lingers(make: Callable[[], HostDriver]) -> str:
    """Two one-granule handles; the first mapped, released and unmapped: the outcome of mapping the second there."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    first, second = d.create(g), d.create(g)
    try:
        d.map(r, g, first)
        d.release(first)
        d.unmap(r, g)
        return outcome(d.map, r, g, second)
    finally:
        tidy(d, [(r, g)], [first, second])


# -- threads ---------------------------------------------------------------------------------------------------------
class MapLocksItsReservationOnly(_Broken):
    """P-threads. Breaks "Any call may be made from several threads at once on one driver: each takes effect whole,
    so what every call returned, and the state the driver is left in, are those of some serial order of the calls":
    to let maps into different reservations run in parallel, ``map`` takes a lock of the reservation it maps into, not
    the driver's, and counts the mapping on its handle (shared between reservations) as a read, then a write when it
    records the mapping; two threads mapping one handle into two reservations at once both read the same count, and the
    handle is counted mapped once: once released, its bytes are given back at its first ``unmap`` while it is still
    mapped at the other address. Maps from one thread, or into one reservation, are counted right."""

    WINDOW_S = 2e-3

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._reservation_locks: dict[int, threading.Lock] = {}

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        self.check_call("map", va=va, size=size, offset=offset)
        with busy(), self.locked(): lock = self._lock_of(va)  # fmt: skip
        if lock is None:  # no reservation there: refused under the driver's lock
            with busy(), self.locked(): return self.do_map(va, size, handle, offset)  # fmt: skip
        with busy(), lock: return self._map_in_reservation(va, size, handle, offset)  # fmt: skip

    def _lock_of(self, va: int) -> threading.Lock | None:
        owner = _reservation_of(self, va)
        return None if owner is None else self._reservation_locks.setdefault(owner, threading.Lock())

    def _map_in_reservation(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        check_map(self, va, size, handle, offset)
        live, maps = (size, handle), handle.maps
        time.sleep(self.WINDOW_S)  # the race window, widened (Note [A proof drives both drivers])
        try:  # recorded with the count read above, and undone whole on any exception
            handle.maps, self.mappings[va] = maps + 1, live
            if libc().mmap(va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, handle.fd, offset) != va:
                self.fail("map", f"mmap(MAP_FIXED, {va:#x}, {size}, fd={handle.fd}, offset={offset})")
        except BaseException:
            if self.mappings.get(va) is live:
                libc().mmap(va, size, PROT_NONE, RESERVED, -1, 0)
                handle.maps, _ = handle.maps - 1, self.mappings.pop(va)
            raise

    def do_free(self, va: int, size: int) -> None:
        super().do_free(va, size)
        self._reservation_locks.pop(va, None)


def prove_map_locks_its_reservation_only(make: Callable[[], HostDriver]) -> int:
    """A one-granule handle mapped from two threads at once into two one-granule reservations, released, and unmapped
    from the first: the granules ``mem_info`` counts taken (the first try that differs from one, of up to 20)."""
    for _ in range(20):
        d = make()
        g = d.granularity()
        a, b = d.reserve(g, g), d.reserve(g, g)
        h = d.create(g)
        try:
            _race(lambda i: d.map((a, b)[i], g, h))
            d.release(h)
            d.unmap(a, g)
            held = _held_granules(d)
        finally:
            tidy(d, [(a, g), (b, g)], [h])
        if held != 1:
            return held
    return 1


# -- interrupted calls -----------------------------------------------------------------------------------------------
class MapRecordsAfterTheKernel(_Broken):
    """P-interrupted. Breaks "any other call leaves the state of the call made or of the call never made": ``map``
    makes the kernel's mapping first and records it in the next line, undoing the kernel's mapping only when the
    ``mmap`` itself fails, so an exception landing between the two lines leaves the handle's memfd mapped in the kernel
    with no record of it: ``unmap`` there is refused (nothing is mapped, say the records) while the kernel shows the
    memfd. Exceptions on the other lines leave a whole state."""

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        check_map(self, va, size, handle, offset)
        if libc().mmap(va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, handle.fd, offset) != va:
            libc().mmap(va, size, PROT_NONE, RESERVED, -1, 0)
            self.fail("map", f"mmap(MAP_FIXED, {va:#x}, {size}, fd={handle.fd}, offset={offset})")
        handle.maps, self.mappings[va] = handle.maps + 1, (size, handle)


def prove_map_records_after_the_kernel(make: Callable[[], HostDriver]) -> list[int]:
    """For each line of a one-granule ``map`` interrupted in turn: the lines after which ``unmap`` is refused while the
    kernel maps a memfd there."""
    bad = []
    for nth in range(1, 100):
        d = make()
        g = d.granularity()
        r = d.reserve(g, g)
        h = d.create(g)
        interrupted = interrupt_at_line(d, nth, d.map, r, g, h)
        if outcome(d.unmap, r, g) != "done" and f"memfd:{MEMFD_NAME}" in next(
            (path for lo, hi, _, path in kernel_ranges() if lo <= r < hi), ""
        ):
            bad.append(nth)
            libc().mmap(r, g, PROT_NONE, RESERVED, -1, 0)  # back to reserved, as the records say
        tidy(d, [(r, g)], [h])
        if not interrupted:
            break
    return bad


# -- native failures -------------------------------------------------------------------------------------------------
class FillWindowsLeakOnFailure(_Broken):
    """P-native-failure. Breaks "A native call that fails raises ``DriverError`` naming the operation ... and changes
    nothing": a new handle is filled through windows of at most 8 granules, each ``mmap``ed in turn and all ``munmap``ed
    together at the end, and a window's failed ``mmap`` (the address space exhausted) raises the right error without
    unmapping the windows made before it: the kernel keeps the closed memfd mapped there. Handles of 8 granules or
    fewer are one window, and a failure leaves nothing."""

    WINDOW = 8 * _G

    @staticmethod
    def fill(fd: int, size: int, byte: int) -> None:
        lib = libc()
        window = FillWindowsLeakOnFailure.WINDOW
        made: list[tuple[int, int]] = []
        for start in range(0, size, window):
            n = min(window, size - start)
            addr = lib.mmap(None, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, start)
            if addr in (None, MAP_FAILED):
                err = ctypes.get_errno()
                raise OSError(err, f"mmap of a {n}-byte fill window at offset {start}")
            made.append((addr, n))
            ctypes.memset(addr, byte, n)
        for addr, n in made:
            lib.munmap(addr, n)


def prove_fill_windows_leak_on_failure(make: Callable[[], HostDriver]) -> list[object]:
    """The outcome of a 24-granule ``create`` while the process may map at most 24 MiB more (``RLIMIT_AS`` lowered for
    the one call), how many memfd mappings the kernel holds more than before (unmapped again here), and the granules
    ``mem_info`` counts taken."""
    d = make()
    g = d.granularity()
    before = _memfd_ranges()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + 24 * MIB, hard))
    try:
        seen = outcome(d.create, 24 * g)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    extra = _memfd_ranges() - before
    for lo, hi in extra:
        libc().munmap(lo, hi - lo)
    return [seen, len(extra), _held_granules(d)]


class ReserveRetriesWithoutThePadding(_Broken):
    """P-reserve-aligned. Breaks "Reserve ``size`` bytes of virtual addresses and return the first, a multiple of
    ``alignment``": when the padded ``mmap`` (``size + alignment``) fails for want of address space, ``reserve``
    retries with ``size`` alone, trusting the kernel's placement of ranges of 2 MiB and more on 2 MiB boundaries (which
    holds for the granularity, not for larger alignments), and returns what it gets. A reservation whose padded
    ``mmap`` succeeds is aligned, and one that fails at the granularity's alignment is refused."""

    def do_reserve(self, size: int, alignment: int) -> int:
        try:
            return super().do_reserve(size, alignment)
        except DriverOutOfMemory:
            if alignment <= self.granularity():
                raise
        raws: list[int | None] = []
        raws.extend(map(libc().mmap, [None], [size], [PROT_NONE], [_RESERVE_FLAGS], [-1], [0]))
        if raws[0] in (None, MAP_FAILED):
            self.fail("reserve", f"mmap(PROT_NONE, {size} bytes) without padding", oom=True)
        self.reservations[raws[0]] = size
        return raws[0]


# -- many live objects -----------------------------------------------------------------------------------------------
class _KeeperSlot:
    """What a tensor's storage holds: a slot of its driver's keeper table, emptied when the storage is freed unless the
    slot was handed out again since."""

    def __init__(self, table: dict[int, tuple[int, object]], slot: int, serial: int) -> None:
        self.table, self.slot, self.serial = table, slot, serial

    def __del__(self) -> None:
        if self.table.get(self.slot, (None, None))[0] == self.serial:
            del self.table[self.slot]


class KeepersInATableOf100(_Broken):
    """P-tensor-keeper. Breaks "Its storage holds a strong reference to ``keeper`` until the storage is freed": like a
    native context with a user-data array of 100 entries, the keepers live in a table of 100 slots handed out round
    robin, and the storage holds its slot (emptied when the storage is freed), on the belief that a slot is free again
    by the time the ring comes back to it: the 101st tensor made while the first still lives takes the first one's slot,
    and its keeper may be collected. With fewer than 100 tensors made over a live one, every keeper is held."""

    SLOTS = 100

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._keepers: dict[int, tuple[int, object]] = {}
        self._serial = 0

    def _take_slot(self) -> int:
        serial, self._serial = self._serial, self._serial + 1
        return serial

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        self.check_call("tensor", va=va, size=nbytes)
        buffer = (ctypes.c_uint8 * nbytes).from_address(va)
        with busy(), self.locked(): serial = self._take_slot()  # fmt: skip
        slot = serial % self.SLOTS
        self._keepers[slot] = (serial, keeper)
        buffer.keeper = _KeeperSlot(self._keepers, slot, serial)
        return torch.frombuffer(buffer, dtype=torch.uint8)


class _Keeper:
    """Something a weak reference can follow."""


def prove_keepers_in_a_table_of_100(make: Callable[[], HostDriver]) -> bool:
    """A one-byte tensor with a keeper no one else holds, then 100 more tensors (each with its own keeper) while it
    lives: whether its keeper is still alive after a collection."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.set_access(r, g)
        keeper = _Keeper()
        ref = weakref.ref(keeper)
        first = d.tensor(r, 1, keeper)
        del keeper
        rest = [d.tensor(r + 1 + i, 1, _Keeper()) for i in range(100)]
        gc.collect()
        alive = ref() is not None
        del first, rest
        gc.collect()
        return alive
    finally:
        tidy(d, [(r, g)], [h])


class UnmapPast300TakesTheMappingAtItsStart(_Broken):
    """P-unmap-refused. Breaks "Refused, changing nothing: part of a mapping, a mapping and more": with more than 300
    live mappings the driver looks a mapping up by its start alone (its large table keeps sizes apart), and ``unmap``
    of a range that starts where a mapping starts unmaps that mapping, whatever size was asked: part of a mapping (or
    a mapping and more) is taken and the whole mapping goes. With 300 live mappings or fewer the size is checked."""

    LARGE = 300

    def do_unmap(self, va: int, size: int) -> None:
        live = self.mappings.get(va)
        if len(self.mappings) > self.LARGE and live is not None:
            size = live[0]
        super().do_unmap(va, size)


def prove_unmap_past_300_takes_the_mapping_at_its_start(make: Callable[[], HostDriver]) -> list[str]:
    """A 2-granule handle mapped whole: the outcome of unmapping its first granule alone, with it the only live
    mapping, then with 300 other live mappings (one granule-handle mapped at 300 addresses)."""
    d = make()
    g = d.granularity()
    n = UnmapPast300TakesTheMappingAtItsStart.LARGE
    wide_r, many_r = d.reserve(2 * g, g), d.reserve(n * g, g)
    wide, one = d.create(2 * g), d.create(g)
    try:
        d.map(wide_r, 2 * g, wide)
        seen = [outcome(d.unmap, wide_r, g)]
        for i in range(n):
            d.map(many_r + i * g, g, one)
        return [*seen, outcome(d.unmap, wide_r, g)]
    finally:
        tidy(d, [(wide_r, 2 * g), (many_r, n * g)], [wide, one])


class FreeChecksTheLast48Maps(_Broken):
    """P-free-refused. Breaks "Refused, changing nothing: a reservation with live mappings": to spare a scan of every
    mapping, ``free`` looks for live mappings inside the reservation among the 48 most recent ``map`` calls still live
    (a ring it keeps), so a reservation whose mappings are all older than 48 later maps is freed with them: the kernel
    range goes, and the mappings' records go with it. With fewer than 48 maps since, a mapped reservation is refused."""

    RECENT = 48

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._recent: deque[int] = deque(maxlen=self.RECENT)

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        self._recent.append(va)  # first: a mapping made is always in the ring until 48 later maps push it out
        super().do_map(va, size, handle, offset)

    def do_unmap(self, va: int, size: int) -> None:
        super().do_unmap(va, size)
        if va in self._recent:
            self._recent.remove(va)

    def do_free(self, va: int, size: int) -> None:
        recent = [m for m in self._recent if m in self.mappings]  # entries of refused or undone maps are stale
        check_free(va, size, self.reservations.get(va) == size, recent)
        inside = [(m, live) for m, live in self.mappings.items() if va <= m < va + size]
        if not inside:
            super().do_free(va, size)
            return
        del self.reservations[va]
        if libc().munmap(va, size) != 0:
            self.reservations[va] = size
            self.fail("free", f"munmap({va:#x}, {size})")
        for m, live in inside:  # the kernel took them with the range
            self.forget(m, live)


def prove_free_checks_the_last_48_maps(make: Callable[[], HostDriver]) -> list[str]:
    """A one-granule reservation mapped, then 48 one-granule maps elsewhere (one handle at 48 addresses): the outcome of
    freeing the first reservation before and after those maps."""
    d = make()
    g = d.granularity()
    n = FreeChecksTheLast48Maps.RECENT
    first, many = d.reserve(g, g), d.reserve(n * g, g)
    h, one = d.create(g), d.create(g)
    left = [(first, g), (many, n * g)]
    try:
        d.map(first, g, h)
        seen = [outcome(d.free, first, g)]
        for i in range(n):
            d.map(many + i * g, g, one)
        seen.append(outcome(d.free, first, g))
        if seen[-1] == "done":
            left.remove((first, g))
        return seen
    finally:
        tidy(d, left, [h, one])


# -- refusals --------------------------------------------------------------------------------------------------------
class ReserveChecksTheAlignmentAfterTheMmap(_Broken):
    """P-refusal-unchanged. Breaks "A refused call leaves every observable as it was: ... the memory and address space
    the kernel holds": ``reserve`` makes its padded ``mmap`` first and checks the alignment where it works the padding
    out, so a reservation refused for an alignment that is not a multiple of the granularity leaves its whole padded
    range reserved in the kernel, owned by no one. Every other refusal of ``reserve`` comes before the ``mmap``."""

    def reserve(self, size: int, alignment: int) -> int:
        self.check_call("reserve", size=size, alignment=alignment)
        if alignment % self.granularity():
            libc().mmap(None, size + max(alignment, PAGE_BYTES), PROT_NONE, _RESERVE_FLAGS, -1, 0)
            check_alignment(alignment, self.granularity())
        return super().reserve(size, alignment)


def prove_reserve_checks_the_alignment_after_the_mmap(make: Callable[[], HostDriver]) -> list[object]:
    """The outcome of a 4-granule reservation aligned to a granule and a page, and how many granules more the kernel
    holds as reserved afterwards (given back here)."""
    d = make()
    g = d.granularity()
    span = 4 * g + g + PAGE_BYTES
    before = _reserved_ranges()
    seen = outcome(d.reserve, 4 * g, g + PAGE_BYTES)
    after = _reserved_ranges()
    grown = sum(hi - lo for lo, hi in after) - sum(hi - lo for lo, hi in before)
    for lo, hi in after - before:
        if hi - lo == span:
            libc().munmap(lo, span)
    return [seen, grown // g]


# -- the factories and the cases -------------------------------------------------------------------------------------
granularity_is_thread_local = functools.partial(GranularityIsThreadLocal, "broken-granularity-is-thread-local")
total_less_page_tables = functools.partial(TotalLessPageTables, "broken-total-less-page-tables")
large_mappings_are_private = functools.partial(LargeMappingsArePrivate, "broken-large-mappings-are-private")
first_map_fixes_the_handles_layout = functools.partial(
    FirstMapFixesTheHandlesLayout, "broken-first-map-fixes-the-handles-layout"
)
map_in_chunks_from_the_same_offset = functools.partial(
    MapInChunksFromTheSameOffset, "broken-map-in-chunks-from-the-same-offset"
)
offset_mappings_are_readable = functools.partial(OffsetMappingsAreReadable, "broken-offset-mappings-are-readable")
large_zero_rounds_its_end_up = functools.partial(LargeZeroRoundsItsEndUp, "broken-large-zero-rounds-its-end-up")
synchronize_waits_for_an_empty_queue = functools.partial(
    SynchronizeWaitsForAnEmptyQueue, "broken-synchronize-waits-for-an-empty-queue"
)
released_memfd_recycled = functools.partial(ReleasedMemfdRecycled, "broken-released-memfd-recycled")
released_handles_last_mapping_lingers = functools.partial(
    ReleasedHandlesLastMappingLingers, "broken-released-handles-last-mapping-lingers"
)
map_locks_its_reservation_only = functools.partial(MapLocksItsReservationOnly, "broken-map-locks-its-reservation-only")
map_records_after_the_kernel = functools.partial(MapRecordsAfterTheKernel, "broken-map-records-after-the-kernel")
fill_windows_leak_on_failure = functools.partial(FillWindowsLeakOnFailure, "broken-fill-windows-leak-on-failure")
reserve_retries_without_the_padding = functools.partial(
    ReserveRetriesWithoutThePadding, "broken-reserve-retries-without-the-padding"
)
keepers_in_a_table_of_100 = functools.partial(KeepersInATableOf100, "broken-keepers-in-a-table-of-100")
unmap_past_300_takes_the_mapping_at_its_start = functools.partial(
    UnmapPast300TakesTheMappingAtItsStart, "broken-unmap-past-300-takes-the-mapping-at-its-start"
)
free_checks_the_last_48_maps = functools.partial(FreeChecksTheLast48Maps, "broken-free-checks-the-last-48-maps")
reserve_checks_the_alignment_after_the_mmap = functools.partial(
    ReserveChecksTheAlignmentAfterTheMmap, "broken-reserve-checks-the-alignment-after-the-mmap"
)

CASES: dict[str, Case] = {
    "granularity_is_thread_local": Case(
        granularity_is_thread_local, "P-granularity", prove_granularity_is_thread_local, [_G, _G]
    ),
    "total_less_page_tables": Case(
        total_less_page_tables, "P-mem-bounds", prove_total_less_page_tables, [BUDGET, BUDGET]
    ),
    "large_mappings_are_private": Case(
        large_mappings_are_private, "P-map-shared", prove_large_mappings_are_private, [0x3C, 0x3C]
    ),
    "first_map_fixes_the_handles_layout": Case(
        first_map_fixes_the_handles_layout, "P-map-offset", prove_first_map_fixes_the_handles_layout, ["done", "done"]
    ),
    "map_in_chunks_from_the_same_offset": Case(
        map_in_chunks_from_the_same_offset, "P-map", prove_map_in_chunks_from_the_same_offset, [0x3C, 0x5A]
    ),
    "offset_mappings_are_readable": Case(
        offset_mappings_are_readable, "P-accessible-kernel", prove_offset_mappings_are_readable, ["---s", False]
    ),
    "large_zero_rounds_its_end_up": Case(
        large_zero_rounds_its_end_up, "P-zero", prove_large_zero_rounds_its_end_up, [0, 0x3C]
    ),
    "synchronize_waits_for_an_empty_queue": Case(
        synchronize_waits_for_an_empty_queue, "P-synchronize", prove_synchronize_waits_for_an_empty_queue, [0, 0]
    ),
    "released_memfd_recycled": Case(released_memfd_recycled, "P-release-mapped", prove_released_memfd_recycled, 0x3C),
    "released_handles_last_mapping_lingers": Case(
        released_handles_last_mapping_lingers, "P-unmap", prove_released_handles_last_mapping_lingers, "done"
    ),
    "map_locks_its_reservation_only": Case(
        map_locks_its_reservation_only, "P-threads", prove_map_locks_its_reservation_only, 1
    ),
    "map_records_after_the_kernel": Case(
        map_records_after_the_kernel, "P-interrupted", prove_map_records_after_the_kernel, []
    ),
    "fill_windows_leak_on_failure": Case(
        fill_windows_leak_on_failure,
        "P-native-failure",
        prove_fill_windows_leak_on_failure,
        ["DriverOutOfMemory(create)", 0, 0],
    ),
    "reserve_retries_without_the_padding": Case(
        reserve_retries_without_the_padding,
        "P-reserve-aligned",
        prove_reserve_aligned_to_64_gib_with_1_gib_left,
        "DriverOutOfMemory(reserve)",
    ),
    "keepers_in_a_table_of_100": Case(
        keepers_in_a_table_of_100, "P-tensor-keeper", prove_keepers_in_a_table_of_100, True
    ),
    "unmap_past_300_takes_the_mapping_at_its_start": Case(
        unmap_past_300_takes_the_mapping_at_its_start,
        "P-unmap-refused",
        prove_unmap_past_300_takes_the_mapping_at_its_start,
        ["DriverError(unmap)", "DriverError(unmap)"],
    ),
    "free_checks_the_last_48_maps": Case(
        free_checks_the_last_48_maps,
        "P-free-refused",
        prove_free_checks_the_last_48_maps,
        ["DriverError(free)", "DriverError(free)"],
    ),
    "reserve_checks_the_alignment_after_the_mmap": Case(
        reserve_checks_the_alignment_after_the_mmap,
        "P-refusal-unchanged",
        prove_reserve_checks_the_alignment_after_the_mmap,
        ["DriverError(reserve)", 0],
    ),
}
