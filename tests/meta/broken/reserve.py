"""Broken drivers of ``reserve`` and ``granularity`` (P-reserve-*, P-granularity)."""

from __future__ import annotations

import ctypes
import threading
import time

from extensible_kv.drivers import host
from extensible_kv.drivers.records import check_alignment, check_free
from extensible_kv.errors import DriverError, DriverOutOfMemory
from extensible_kv.reaper import busy
from tests.meta.broken.base import GIB, RACE_WINDOW_S, RESERVE_FLAGS, Broken, align_up, reservation_of


class ReserveIgnoresAlignment(Broken):
    """reserve() aligns to the granularity only, whatever alignment is asked."""

    breaks = "P-reserve-aligned"
    caught_by = ("test_reserve_returns_a_range_aligned_to_the_alignment_asked",)

    def reserve(self, size: int, alignment: int) -> int:
        g = self.granularity()
        va = super().reserve(size + g, 2 * g)
        host.libc().munmap(va, g)
        del self.reservations[va]
        self.reservations[va + g] = size
        return va + g


class ReserveAccessible(Broken):
    """reserve() makes the reserved range readable and writable anonymous memory."""

    breaks = "P-reserve-inaccessible"
    caught_by = ("test_the_kernel_maps_what_accessible_reports", "test_touching_a_granule_without_access_faults")

    def reserve(self, size: int, alignment: int) -> int:
        va = super().reserve(size, alignment)
        host.libc().mprotect(va, size, host.PROT_READ | host.PROT_WRITE)
        return va


class ReserveCapsTheAlignment(Broken):
    """Address space. Breaks "[P-reserve-aligned] Reserve ``size`` bytes of virtual addresses and return the first, a
    multiple of ``alignment`` (the granularity times a power of two: 1, 2 or 64 granules and more)": to bound the
    address space it over-reserves, it caps the alignment at 64 granules, and a larger one is not honoured."""

    breaks = "P-reserve-aligned"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def reserve(self, size: int, alignment: int) -> int:
        return super().reserve(size, min(alignment, 64 * self.granularity()))


class LargeReserveTrustsTheKernelAlignment(Broken):
    """P-reserve-aligned. Breaks "return the first [address], a multiple of ``alignment`` (... 1, 2 or 64 granules
    and more)": for a large reservation (16 granules and more) aligned to at most 2 granules it skips the padding,
    since Linux places large anonymous mappings on 2 MiB boundaries, and accepts the kernel's address when it is a
    multiple of the granularity, not of the alignment: a 2-granule alignment is honoured about half the time."""

    breaks = "P-reserve-aligned"
    caught_by = ("test_reservations_of_every_size_class_are_aligned_exact_and_disjoint",)

    def reserve(self, size: int, alignment: int) -> int:
        self.check_call("reserve", size=size, alignment=alignment)
        g = self.granularity()
        if size >= 16 * g and alignment <= 2 * g and alignment % g == 0:
            flags = host.MAP_PRIVATE | host.MAP_ANONYMOUS | host.MAP_NORESERVE
            raw = host.libc().mmap(None, size, host.PROT_NONE, flags, -1, 0)
            if raw not in (None, host.MAP_FAILED):
                if raw % g == 0:  # the bug: the granularity, not the alignment
                    with busy(), self.locked(): self.reservations[raw] = size  # fmt: skip
                    return raw
                host.libc().munmap(raw, size)
        return super().reserve(size, alignment)


class ReserveKeepsTheTailUntilFree(Broken):
    """P-reserve-kernel. Breaks "On the host the kernel holds exactly ``[va, va+size)`` as reserved ...: address space
    taken to align the range is given back before ``reserve`` returns": for alignments of 64 granules and more it
    trims the head of its over-reservation at once but keeps the tail until ``free`` (what a GPU driver may do)."""

    breaks = "P-reserve-kernel"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    state = {"_tails": dict}

    def do_reserve(self, size: int, alignment: int) -> int:
        if alignment < 64 * self.granularity():
            return super().do_reserve(size, alignment)
        span = size + alignment
        raw = host.libc().mmap(
            None, span, host.PROT_NONE, host.MAP_PRIVATE | host.MAP_ANONYMOUS | host.MAP_NORESERVE, -1, 0
        )
        if raw in (None, host.MAP_FAILED):
            self.fail("reserve", f"mmap(PROT_NONE, {span} bytes) for {size} bytes aligned to {alignment}", oom=True)
        va = -(-raw // alignment) * alignment
        if va > raw:
            host.libc().munmap(raw, va - raw)
        self._tails[va] = raw + span - (va + size)
        self.reservations[va] = size
        return va

    def do_free(self, va: int, size: int) -> None:
        super().do_free(va, size)
        tail = self._tails.pop(va, 0)
        if tail:
            host.libc().munmap(va + size, tail)


class ReserveLeavesTheRemainderReadWrite(Broken):
    """P-reserve-inaccessible. Breaks "Nothing in it is accessible until mapped and granted access (on the host,
    touching it faults)": it reserves read-write (``MAP_NORESERVE`` overcommits it anyway) and takes access away with
    ``mprotect(va, size // alignment * alignment, PROT_NONE)``, so the last part of a size that is not a multiple of
    the alignment stays readable and writable anonymous memory until it is mapped. (Emulated: the host's reserve, then
    access granted to that remainder.)"""

    breaks = "P-reserve-inaccessible"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def do_reserve(self, size: int, alignment: int) -> int:
        va = super().do_reserve(size, alignment)
        tail = size % alignment
        if tail and host.libc().mprotect(va + size - tail, tail, host.PROT_READ | host.PROT_WRITE) != 0:
            self.fail("reserve", f"mprotect({va + size - tail:#x}, {tail}, RW)")
        return va


class AlignmentTruncatedTo32Bits(Broken):
    """P-reserve-aligned. Breaks "Reserve ``size`` bytes of virtual addresses and return the first, a multiple of
    ``alignment`` (... 1, 2 or 64 granules and more)": the alignment travels in a 32-bit field (as in a native
    descriptor struct), so an alignment of 4 GiB or more is truncated, and one of exactly 4 GiB becomes 0: the range is
    aligned to a page. Alignments below 4 GiB are kept."""

    breaks = "P-reserve-aligned"
    caught_by = ("test_every_bad_value_of_every_call_is_refused_and_named",)

    def reserve(self, size: int, alignment: int) -> int:
        if isinstance(alignment, int) and not isinstance(alignment, bool) and alignment > 0:
            alignment = ctypes.c_uint32(alignment).value  # the bug
        return super().reserve(size, alignment)


class ReserveKeepsItsRawAddressOnTheDriver(Broken):
    """P-reserve-disjoint. Breaks "The range overlaps no live reservation of the driver" for reservations made from two
    threads: ``reserve`` makes its over-sized ``mmap`` outside the lock (a native call needs none) and keeps the
    address the kernel gave on the driver (for its trimming, under the lock), so a second thread's ``reserve`` in
    between overwrites it and both calls return the same range (the first thread's ``mmap`` is lost). A ``reserve``
    alone, or two that do not meet, are right."""

    breaks = "P-reserve-disjoint"
    caught_by = ("test_each_contended_pair_at_every_line_matches_a_serial_order",)

    state = {"lost": list}

    def reserve(self, size: int, alignment: int) -> int:
        self.check_call("reserve", size=size, alignment=alignment)
        check_alignment(alignment, self.granularity())
        alignment = max(alignment, host.PAGE_BYTES)
        span = size + alignment
        self._raw = mine = host.libc().mmap(None, span, host.PROT_NONE, RESERVE_FLAGS, -1, 0)
        if self._raw in (None, host.MAP_FAILED):
            self.fail("reserve", f"mmap(PROT_NONE, {span} bytes) for {size} bytes aligned to {alignment}", oom=True)
        time.sleep(RACE_WINDOW_S)
        with busy(), self.locked():
            raw = self._raw
            if mine != raw:  # lost to the other thread: kept, to give back
                self.lost.append((mine, span))
            va = align_up(raw, alignment)
            if va > raw:
                host.libc().munmap(raw, va - raw)
            if raw + span > va + size:
                host.libc().munmap(va + size, raw + span - (va + size))
            self.reservations[va] = size
        return va


class TrimLengthIsAnInt(Broken):
    """P-reserve-kernel. Breaks "On the host the kernel holds exactly ``[va, va+size)`` as reserved ...: address space
    taken to align the range is given back before ``reserve`` returns": the lengths of the trims pass through a C
    ``int`` (the native wrapper's prototype), so a head or tail of 2 GiB or more, which only alignments of 4 GiB and
    more leave, wraps: its ``munmap`` fails or gives back less, unchecked, and the kernel keeps gigabytes of the
    over-reservation. Smaller alignments are trimmed right."""

    breaks = "P-reserve-kernel"
    caught_by = ("test_every_call_the_kernel_refuses_natively_is_a_driver_error_that_leaves_nothing",)

    state = {"spans": list}

    def do_reserve(self, size: int, alignment: int) -> int:
        span = size + alignment
        raw = host.libc().mmap(None, span, host.PROT_NONE, RESERVE_FLAGS, -1, 0)
        if raw in (None, host.MAP_FAILED):
            self.fail("reserve", f"mmap(PROT_NONE, {span} bytes) for {size} bytes aligned to {alignment}", oom=True)
        va = align_up(raw, alignment)
        self.spans.append((raw, span))  # for the proof to give back what the trims left
        if va > raw:
            host.libc().munmap(raw, ctypes.c_int(va - raw).value)
        if raw + span > va + size:
            host.libc().munmap(va + size, ctypes.c_int(raw + span - (va + size)).value)
        self.reservations[va] = size
        return va


class GranularityFromTheFirstCreate(Broken):
    """P-granularity. Breaks "The size in bytes that every size, address and offset of ``map``/``unmap``/
    ``set_access``/``create`` is a multiple of: a positive multiple of 4096, the same on every call": like a backend
    that asks ``cuMemGetAllocationGranularity`` with the allocation properties it builds at its first ``create`` and
    answers with the minimum (the page) until then, ``granularity()`` is 4096 before the first ``create`` and the
    driver's real 2 MiB after it (its own checks use 2 MiB throughout)."""

    breaks = "P-granularity"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self._props_built = False

    def granularity(self) -> int:
        return self.granularity() if self._props_built else host.PAGE_BYTES

    def create(self, size: int) -> host.HostHandle:
        handle = super().create(size)
        self._props_built = True
        return handle


class HugeReservationsAreSparse(Broken):
    """P-reserve-too-large. Breaks "A range no address space holds (2**62 bytes and more) is refused": a reservation
    larger than the process's address space (2**47 bytes and more, the x86-64 user half) is made sparse, as a GPU
    driver with a VA allocator of its own might: the driver records all of it and takes only a first window of 1 GiB
    from the kernel, to be grown as mappings come (a map past the window is refused). Reservations that fit an address
    space are made whole."""

    breaks = "P-reserve-too-large"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    SPARSE_FROM = 1 << 47
    WINDOW = GIB

    state = {"_windows": dict}

    def reserve(self, size: int, alignment: int) -> int:
        if not isinstance(size, int) or isinstance(size, bool) or size < self.SPARSE_FROM:
            return super().reserve(size, alignment)
        self.check_call("reserve", size=size, alignment=alignment)
        va = super().reserve(self.WINDOW, alignment)
        with busy(), self.locked():
            self.reservations[va], self._windows[va] = size, self.WINDOW
        return va

    def do_map(self, va: int, size: int, handle: host.HostHandle, offset: int) -> None:
        owner = reservation_of(self, va)
        if owner is not None and owner[0] in self._windows and va + size > owner[0] + self._windows[owner[0]]:
            raise DriverError("map", f"[{va:#x}, +{size}) lies past the backed window of a sparse reservation")
        super().do_map(va, size, handle, offset)

    def do_free(self, va: int, size: int) -> None:
        window = self._windows.get(va)
        if window is None:
            super().do_free(va, size)
            return
        check_free(va, size, self.reservations.get(va) == size, self.mappings)
        del self.reservations[va], self._windows[va]
        if host.libc().munmap(va, window) != 0:
            self.fail("free", f"munmap({va:#x}, {window})")


class GranularityIsThreadLocal(Broken):
    """P-granularity. Breaks "The size in bytes that every size, address and offset of ``map``/``unmap``/
    ``set_access``/``create`` is a multiple of: a positive multiple of 4096, the same on every call": like a backend
    that keeps its allocation properties in a per-thread context, made current in the thread that built the driver,
    ``granularity()`` answers from the calling thread's context, and a thread with none answers the minimum (the page,
    4096). The driver's own checks use its real granularity; the building thread is answered right."""

    breaks = "P-granularity"
    caught_by = ("test_reservations_of_every_size_class_are_aligned_exact_and_disjoint",)

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self._context = threading.local()
        self._context.granularity = self.granularity()

    def granularity(self) -> int:
        return getattr(self._context, "granularity", host.PAGE_BYTES)


class ReserveRetriesWithoutThePadding(Broken):
    """P-reserve-aligned. Breaks "Reserve ``size`` bytes of virtual addresses and return the first, a multiple of
    ``alignment``": when the padded ``mmap`` (``size + alignment``) fails for want of address space, ``reserve``
    retries with ``size`` alone, trusting the kernel's placement of ranges of 2 MiB and more on 2 MiB boundaries (which
    holds for the granularity, not for larger alignments), and returns what it gets. A reservation whose padded
    ``mmap`` succeeds is aligned, and one that fails at the granularity's alignment is refused."""

    breaks = "P-reserve-aligned"
    caught_by = ("test_every_call_the_kernel_refuses_natively_is_a_driver_error_that_leaves_nothing",)

    def do_reserve(self, size: int, alignment: int) -> int:
        try:
            return super().do_reserve(size, alignment)
        except DriverOutOfMemory:
            if alignment <= self.granularity():
                raise
        raws: list[int | None] = []
        raws.extend(map(host.libc().mmap, [None], [size], [host.PROT_NONE], [RESERVE_FLAGS], [-1], [0]))
        if raws[0] in (None, host.MAP_FAILED):
            self.fail("reserve", f"mmap(PROT_NONE, {size} bytes) without padding", oom=True)
        self.reservations[raws[0]] = size
        return raws[0]
