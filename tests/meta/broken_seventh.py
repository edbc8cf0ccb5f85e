"""A seventh set of deliberately broken host drivers, written from the protocol's text (``drivers/_protocol.py``) and
the host driver by a reader outside the rules, without reading them.

Same layout as ``tests.meta.broken_sixth``: each class breaks one sentence or clause of the protocol, quoted with its
id in the class docstring, the way a backend's own bug might (only in particular shapes, sizes, offsets, sequences,
orders of calls, threads, interrupt points or states), and comes with a proof that drives a driver built by the factory
it is given and returns what it observed; ``CASES`` pairs every factory with the id it breaks, its proof and what the
intact host driver observes. The set aims at the sentences the earlier sets targeted least. Use a driver as
``extensible-kv check-driver tests.meta.broken_seventh:<factory>``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import resource
import threading
import time
from collections.abc import Callable

from extensible_kv.drivers.host import MEMFD_NAME, PROT_NONE, MIB, PAGE_BYTES, HostDriver, HostHandle, libc
from extensible_kv.drivers.records import check_alignment, check_free, check_inside, check_no_overlap
from extensible_kv.errors import DriverError
from extensible_kv.reaper import busy
from tests.meta.broken_protocol import (
    BUDGET,
    GIB,
    RESERVED,
    Case,
    _Broken,
    interrupt_at_line,
    outcome,
    poke,
    read_byte,
    tidy,
)

# -- shared pieces ---------------------------------------------------------------------------------------------------
_G = 2 * MIB
"""HostDriver's default granularity, the broken drivers' granularity."""

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_fallocate = _libc.fallocate
_fallocate.restype = ctypes.c_int
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_mremap = _libc.mremap
_mremap.restype = ctypes.c_void_p
_mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
_MREMAP_MAYMOVE = 0x01
_MREMAP_FIXED = 0x02


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


def _is_memfd(fd: int) -> bool:
    """Whether ``fd`` is open and names one of the host driver's memfds."""
    try:
        return fd >= 0 and os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{MEMFD_NAME}")
    except OSError:
        return False


def _reservation_of(d: HostDriver, va: int) -> tuple[int, int] | None:
    """The reservation ``(start, size)`` of ``d`` that holds the address ``va``, as its records say."""
    return next(((r, s) for r, s in d.reservations.items() if r <= va < r + s), None)


# -- identity --------------------------------------------------------------------------------------------------------
class GranularityFromTheFirstCreate(_Broken):
    """P-granularity. Breaks "The size in bytes that every size, address and offset of ``map``/``unmap``/
    ``set_access``/``create`` is a multiple of: a positive multiple of 4096, the same on every call": like a backend
    that asks ``cuMemGetAllocationGranularity`` with the allocation properties it builds at its first ``create`` and
    answers with the minimum (the page) until then, ``granularity()`` is 4096 before the first ``create`` and the
    driver's real 2 MiB after it (its own checks use 2 MiB throughout)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._props_built = False

    def granularity(self) -> int:
        return self.granularity() if self._props_built else PAGE_BYTES

    def create(self, size: int) -> HostHandle:
        handle = super().create(size)
        self._props_built = True
        return handle


def prove_granularity_from_the_first_create(make: Callable[[], HostDriver]) -> list[int]:
    """``granularity()`` before and after a first ``create`` of 2 MiB."""
    d = make()
    seen = [d.granularity()]
    h = d.create(_G)
    try:
        return [*seen, d.granularity()]
    finally:
        d.release(h)


# -- address space ---------------------------------------------------------------------------------------------------
class HugeReservationsAreSparse(_Broken):
    """P-reserve-too-large. Breaks "A range no address space holds (2**62 bytes and more) is refused": a reservation
    larger than the process's address space (2**47 bytes and more, the x86-64 user half) is made sparse, as a GPU
    driver with a VA allocator of its own might: the driver records all of it and takes only a first window of 1 GiB
    from the kernel, to be grown as mappings come (a map past the window is refused). Reservations that fit an address
    space are made whole."""

    SPARSE_FROM = 1 << 47
    WINDOW = GIB

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._windows: dict[int, int] = {}

    def reserve(self, size: int, alignment: int) -> int:
        if not isinstance(size, int) or isinstance(size, bool) or size < self.SPARSE_FROM:
            return super().reserve(size, alignment)
        self.check_call("reserve", size=size, alignment=alignment)
        va = super().reserve(self.WINDOW, alignment)
        with busy(), self.locked():
            self.reservations[va], self._windows[va] = size, self.WINDOW
        return va

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        owner = _reservation_of(self, va)
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
        if libc().munmap(va, window) != 0:
            self.fail("free", f"munmap({va:#x}, {window})")


def prove_huge_reservations_are_sparse(make: Callable[[], HostDriver]) -> str:
    """The outcome of a reservation of 2**62 bytes (freed again if it was made)."""
    d = make()
    size = 1 << 62
    try:
        va = d.reserve(size, d.granularity())
    except Exception as exc:  # noqa: BLE001 - the type is what the proof looks at
        return f"{type(exc).__name__}({getattr(exc, 'operation', '')})"
    d.free(va, size)
    return "done"


class AlignmentCheckedAsAMultipleOnly(_Broken):
    """P-bad-value. Breaks "A value that is not an ``int`` (a ``bool``, a ``float``) ..., or a value or range that
    reaches 2**63 is refused by ``reserve`` ... before any native call": ``reserve`` range-checks ``size`` but checks
    ``alignment`` only as an alignment (a multiple of the granularity), so an alignment of 2**63 (a multiple of every
    granularity) reaches ``mmap`` as a span past the address space, and a ``float`` multiple of the granularity
    reaches ``ctypes``, which rejects it with its own ``ArgumentError``. Every alignment that is an ``int`` below 2**63
    is handled right."""

    def reserve(self, size: int, alignment: int) -> int:
        self.check_call("reserve", size=size)
        check_alignment(alignment, self.granularity())
        alignment = max(alignment, PAGE_BYTES)
        made: list[int] = []
        try:
            with busy(), self.locked(): made.extend(map(self.do_reserve, [size], [alignment]))  # fmt: skip
            return made[0]
        except BaseException:
            for va in made:
                with busy(), self.locked(): self.do_free(va, size)  # fmt: skip
            raise


def prove_alignment_checked_as_a_multiple_only(make: Callable[[], HostDriver]) -> list[str]:
    """The outcomes of one-granule reservations aligned to 2**63 and to the granularity as a ``float``."""
    d = make()
    g = d.granularity()
    return [outcome(d.reserve, g, 1 << 63), outcome(d.reserve, g, float(g))]


class DoubleFreeIsANoOp(_Broken):
    """P-free-refused. Breaks "Refused, changing nothing: ... a range that is no live reservation (one already
    freed)": like ``munmap``, which takes a range twice without complaint, ``free`` remembers the ranges it gave back
    and takes a second ``free`` of one as done, until a new reservation is made over it. A ``free`` of a range it never
    reserved, or of part of a live reservation, is refused."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._freed: set[tuple[int, int]] = set()

    def reserve(self, size: int, alignment: int) -> int:
        va = super().reserve(size, alignment)
        with busy(), self.locked():
            self._freed = {(a, s) for a, s in self._freed if not (a < va + size and va < a + s)}
        return va

    def do_free(self, va: int, size: int) -> None:
        if (va, size) in self._freed and va not in self.reservations:
            return
        super().do_free(va, size)
        self._freed.add((va, size))


def prove_double_free_is_a_no_op(make: Callable[[], HostDriver]) -> list[str]:
    """The outcomes of freeing a one-granule reservation, then of freeing it again."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    return [outcome(d.free, r, g), outcome(d.free, r, g)]


class UnmapUncountsTheLastReservationMapped(_Broken):
    """P-free. Breaks "Return the reservation ``[va, va+size)`` ... once nothing is mapped in it": to refuse ``free``
    without a scan of every mapping it counts the live mappings of each reservation; ``map`` adds one to the
    reservation it found the range in and remembers that reservation (a tensor grows in one), and ``unmap`` takes one
    from the remembered reservation, not from the one that holds the mapping. Mapping into two reservations and then
    unmapping from the first leaves the first counted as mapped, so its ``free`` is refused though nothing is mapped in
    it. Mapping and unmapping in one reservation at a time is counted right."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._live: dict[int, int] = {}
        self._last: int | None = None

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        super().do_map(va, size, handle, offset)
        owner = _reservation_of(self, va)
        if owner is not None:
            self._live[owner[0]] = self._live.get(owner[0], 0) + 1
            self._last = owner[0]

    def do_unmap(self, va: int, size: int) -> None:
        super().do_unmap(va, size)
        if self._last is not None:
            self._live[self._last] -= 1

    def do_free(self, va: int, size: int) -> None:
        if self._live.get(va, 0) > 0:
            raise DriverError("free", f"reservation {va:#x} still has {self._live[va]} mapping(s)")
        super().do_free(va, size)
        self._live.pop(va, None)
        if self._last == va:
            self._last = None


def prove_unmap_uncounts_the_last_reservation_mapped(make: Callable[[], HostDriver]) -> str:
    """Two one-granule reservations, each mapped; the first one's mapping unmapped: the outcome of freeing it."""
    d = make()
    g = d.granularity()
    a, b = d.reserve(g, g), d.reserve(g, g)
    h1, h2 = d.create(g), d.create(g)
    left = [(a, g), (b, g)]
    try:
        d.map(a, g, h1)
        d.map(b, g, h2)
        d.unmap(a, g)
        seen = outcome(d.free, a, g)
        if seen == "done":
            left.remove((a, g))
        return seen
    finally:
        tidy(d, left, [h1, h2])


# -- offsets and shapes ----------------------------------------------------------------------------------------------
class OffsetViewEndIsInclusive(_Broken):
    """P-create. Breaks "A physical handle of ``size`` bytes ...: ``map`` takes any part of it within ``size`` bytes":
    a mapping at a non-zero offset (a view into the handle) checks its end as the granule index ``(offset + size) //
    granularity`` against the handle's granule count with ``>=``, an inclusive end, so a view at a non-zero offset that
    ends exactly at the handle's end (its last granule) is refused as running past it. Views that end before the last
    granule, and mappings at offset 0, are taken."""

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        g = self.granularity()
        if offset and not handle.released and (offset + size) // g >= handle.size // g:
            check_inside("map", va, size, self.reservations.items())
            check_no_overlap(va, size, ((m_va, m_size) for m_va, (m_size, _) in self.mappings.items()))
            raise DriverError("map", f"offset {offset} + size {size} runs past the {handle.size}-byte handle")
        super().do_map(va, size, handle, offset)


def prove_offset_view_end_is_inclusive(make: Callable[[], HostDriver]) -> list[str]:
    """A 3-granule handle: the outcomes of mapping its first granule (offset 0), its second (offset 1 granule) and its
    last (offset 2 granules), each at its own granule of a reservation."""
    d = make()
    g = d.granularity()
    r = d.reserve(3 * g, g)
    h = d.create(3 * g)
    try:
        return [outcome(d.map, r + i * g, g, h, i * g) for i in range(3)]
    finally:
        tidy(d, [(r, 3 * g)], [h])


class UnmapResetsTheHandlesSpan(_Broken):
    """P-unmap. Breaks "Return ``[va, va+size)``, exactly the range of one ``map`` call, to reserved": written for a
    native call that maps whole handles, ``unmap`` puts back to reserved the span the mapping's handle would take from
    ``va`` (its size, clipped to the reservation), not the mapping's size, so unmapping a mapping of part of a larger
    handle also replaces the mapping just above it in the kernel (it stops being mapped and accessible while the
    driver's records keep it). Mappings of whole handles are unmapped right."""

    def do_unmap(self, va: int, size: int) -> None:
        live = self.mappings.get(va)
        if live is None or live[0] != size:
            super().do_unmap(va, size)
            return
        owner = _reservation_of(self, va)
        span = min(live[1].size, owner[0] + owner[1] - va) if owner else size
        if libc().mmap(va, span, PROT_NONE, RESERVED, -1, 0) != va:
            self.fail("unmap", f"mmap(PROT_NONE, MAP_FIXED, {va:#x}, {span})")
        self.forget(va, live)


def prove_unmap_resets_the_handles_span(make: Callable[[], HostDriver]) -> list[bool]:
    """The first granule of a 2-granule handle mapped at a reservation's first granule, a one-granule handle mapped
    above it and given access; the first mapping unmapped: whether the two granules are accessible."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    wide, one = d.create(2 * g), d.create(g)
    try:
        d.map(r, g, wide)
        d.map(r + g, g, one)
        d.set_access(r + g, g)
        d.unmap(r, g)
        return [d.accessible(r), d.accessible(r + g)]
    finally:
        tidy(d, [(r, 2 * g)], [wide, one])


class UnmapTakesAMappingsTail(_Broken):
    """P-unmap-refused. Breaks "Refused, changing nothing: part of a mapping": to let a tensor shrink from the top,
    ``unmap`` of a range that starts inside a mapping and ends exactly where the mapping ends puts that tail back to
    reserved and shortens the mapping's record. Parts at a mapping's start or in its middle are refused."""

    def do_unmap(self, va: int, size: int) -> None:
        if va not in self.mappings:
            tail = next(((m, h) for m, (s, h) in self.mappings.items() if m < va < m + s and va + size == m + s), None)
            if tail is not None:
                m, h = tail
                if libc().mmap(va, size, PROT_NONE, RESERVED, -1, 0) != va:
                    self.fail("unmap", f"mmap(PROT_NONE, MAP_FIXED, {va:#x}, {size})")
                self.mappings[m] = (va - m, h)
                return
        super().do_unmap(va, size)


def prove_unmap_takes_a_mappings_tail(make: Callable[[], HostDriver]) -> list[object]:
    """A 3-granule mapping with access: the outcomes of unmapping its last granule, then its middle granule, and
    whether the last granule is accessible afterwards."""
    d = make()
    g = d.granularity()
    r = d.reserve(3 * g, g)
    h = d.create(3 * g)
    try:
        d.map(r, 3 * g, h)
        d.set_access(r, 3 * g)
        seen: list[object] = [outcome(d.unmap, r + 2 * g, g), outcome(d.unmap, r + g, g)]
        return [*seen, d.accessible(r + 2 * g)]
    finally:
        tidy(d, [(r, 3 * g)], [h])


class AccessibleRoundsUp(_Broken):
    """P-accessible. Breaks "Whether the granule at ``va`` (any address in it, ...) is mapped and readable/writable":
    it asks the kernel about the start of the granule, computed with the ceiling division it uses for sizes, so an
    address inside a granule (not at its start) is answered for the next granule. Granule starts are answered
    right."""

    def accessible(self, va: int) -> bool:
        self.check_call("accessible", va=va)
        g = self.granularity()
        return super().accessible(-(-va // g) * g)


def prove_accessible_rounds_up(make: Callable[[], HostDriver]) -> list[bool]:
    """A 2-granule reservation whose first granule is mapped with access: whether its first byte, its second byte,
    its last byte and the second granule's first byte are accessible."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.set_access(r, g)
        return [d.accessible(a) for a in (r, r + 1, r + g - 1, r + g)]
    finally:
        tidy(d, [(r, 2 * g)], [h])


# -- released handles ------------------------------------------------------------------------------------------------
class ReleaseGivesBackUngrantedPages(_Broken):
    """P-release-mapped. Breaks "memory that is still mapped stays alive, with its bytes, until unmapped everywhere":
    to give memory back early, ``release`` of a handle that is still mapped, but nowhere with access, punches its pages
    out of the memfd (``FALLOC_FL_PUNCH_HOLE``), reasoning that no one can read or write them any more; a mapping given
    access afterwards reads zeros. A handle released while one of its mappings has access keeps its bytes."""

    def do_release(self, handle: HostHandle) -> None:
        mapped = [m for m, (_, h) in self.mappings.items() if h is handle]
        if not handle.released and mapped and not any(HostDriver.accessible(self, m) for m in mapped):
            if _fallocate(handle.fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, handle.size) != 0:
                self.fail("release", f"fallocate(PUNCH_HOLE, fd={handle.fd}, {handle.size})")
        super().do_release(handle)


def prove_release_gives_back_ungranted_pages(make: Callable[[], HostDriver]) -> int:
    """A handle given access, written 0x3C, unmapped and mapped again (without access), then released and given access:
    the byte read back."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.set_access(r, g)
        poke(d, r, 0x3C)
        d.unmap(r, g)
        d.map(r, g, h)
        d.release(h)
        d.set_access(r, g)
        return read_byte(d, r)
    finally:
        tidy(d, [(r, g)], [h])


class ReleasedKeyedByFdNumber(_Broken):
    """P-release-once. Breaks "A handle is released once: releasing it again while it is still mapped somewhere is
    refused": ``release`` refuses a handle whose file descriptor number is in its set of released numbers (the number
    names the handle in its messages), and ``create`` takes a new handle's number out of that set; the kernel hands the
    number of a released handle's closed memfd to the next ``create``, so once a new handle is made, releasing the old
    one again (still mapped) is taken. A second release before any new ``create`` is refused."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._released_fds: set[int] = set()

    def create(self, size: int) -> HostHandle:
        handle = super().create(size)
        with busy(), self.locked():
            self._released_fds.discard(handle.fd)
        return handle

    def do_release(self, handle: HostHandle) -> None:
        if handle._shown in self._released_fds:
            raise DriverError("release", f"{handle!r} was already released")
        fd, handle.fd, handle.released = handle.fd, -1, True
        if fd >= 0:
            os.close(fd)
        self._released_fds.add(handle._shown)
        self.drop_if_unused(handle)


def prove_released_keyed_by_fd_number(make: Callable[[], HostDriver]) -> list[str]:
    """A handle mapped and released: the outcome of releasing it again, then again after a new handle was created."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    old = d.create(g)
    handles = [old]
    try:
        d.map(r, g, old)
        d.release(old)
        seen = [outcome(d.release, old)]
        handles.append(d.create(g))
        return [*seen, outcome(d.release, old)]
    finally:
        tidy(d, [(r, g)], handles)
        for h in handles:  # a release the broken records refuse leaves the new handle's memfd open
            if not h.released and h.fd >= 0:
                fd, h.fd, h.released = h.fd, -1, True
                os.close(fd)


class SecondMappingDuplicatesTheFirst(_Broken):
    """P-map-released. Breaks "Refused, changing nothing: ... a handle already released that is still mapped
    elsewhere": a part of a handle that one of its live mappings already shows is mapped by duplicating that mapping
    (``mremap`` with an old size of 0, no file descriptor needed), and that path checks the range and the handle's end
    but not whether the handle was released, so a released handle still mapped elsewhere is mapped again. A handle's
    first mapping, and a part no live mapping shows, take the host's path with all its checks."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._offsets: dict[int, int] = {}

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        source = next(
            (
                m + offset - self._offsets[m]
                for m, (s, h) in self.mappings.items()
                if h is handle and m in self._offsets and self._offsets[m] <= offset <= self._offsets[m] + s - size
            ),
            None,
        )
        if source is None:
            super().do_map(va, size, handle, offset)
        else:
            check_inside("map", va, size, self.reservations.items())
            check_no_overlap(va, size, ((m_va, m_size) for m_va, (m_size, _) in self.mappings.items()))
            if offset + size > handle.size:
                raise DriverError("map", f"offset {offset} + size {size} exceeds the {handle.size}-byte handle")
            live = (size, handle)
            try:
                handle.maps, self.mappings[va] = handle.maps + 1, live
                if _mremap(source, 0, size, _MREMAP_MAYMOVE | _MREMAP_FIXED, va) != va:
                    self.fail("map", f"mremap({source:#x}, 0, {size}, FIXED, {va:#x})")
                if libc().mprotect(va, size, PROT_NONE) != 0:  # the duplicate has the source's access
                    self.fail("map", f"mprotect({va:#x}, {size}, NONE)")
            except BaseException:
                if self.mappings.get(va) is live:
                    libc().mmap(va, size, PROT_NONE, RESERVED, -1, 0)
                    handle.maps, _ = handle.maps - 1, self.mappings.pop(va)
                raise
        self._offsets[va] = offset

    def do_unmap(self, va: int, size: int) -> None:
        super().do_unmap(va, size)
        self._offsets.pop(va, None)


def prove_second_mapping_duplicates_the_first(make: Callable[[], HostDriver]) -> list[str]:
    """A live handle mapped at two addresses, and a handle mapped once and released: the outcome of the live handle's
    second map, then of mapping the released handle at a second address."""
    d = make()
    g = d.granularity()
    r = d.reserve(4 * g, g)
    live, gone = d.create(g), d.create(g)
    try:
        d.map(r, g, live)
        seen = [outcome(d.map, r + g, g, live)]
        d.map(r + 2 * g, g, gone)
        d.release(gone)
        return [*seen, outcome(d.map, r + 3 * g, g, gone)]
    finally:
        tidy(d, [(r, 4 * g)], [live, gone])


# -- memory ----------------------------------------------------------------------------------------------------------
class ShortByReleasedHandlesIsAPlainError(_Broken):
    """P-oom. Breaks "A call refused for lack of memory raises ``DriverOutOfMemory``": a ``create`` refused for lack of
    memory while some released handle is still mapped raises a plain ``DriverError`` telling the caller to unmap the
    released handles (whose bytes come back once they are unmapped), as a more helpful error; with no released handle
    still mapped, the refusal is ``DriverOutOfMemory``."""

    def charge(self, size: int, counted: list[int]) -> None:
        if size > 0 and self.held + size > self.total:
            pending = {id(h): h.size for _, h in self.mappings.values() if h.released}
            if pending:
                raise DriverError(
                    "create",
                    f"{size} bytes asked, {self.total - self.held} free; {sum(pending.values())} bytes are held by "
                    "released handles still mapped: unmap them first",
                )
        super().charge(size, counted)


def prove_short_by_released_handles_is_a_plain_error(make: Callable[[], HostDriver]) -> list[str]:
    """A one-granule handle mapped: the outcome of a ``create`` of the whole budget, then of the same ``create`` once
    the handle was released (still mapped)."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        seen = [outcome(d.create, BUDGET)]
        d.release(h)
        return [*seen, outcome(d.create, BUDGET)]
    finally:
        tidy(d, [(r, g)], [h])


class OutOfMemoryRollbackGivesBackTheAsk(_Broken):
    """P-create-oom. Breaks "When memory is short ...: ``DriverOutOfMemory`` naming ``create``, and nothing is held
    (no handle, free bytes unchanged, ...)": ``create``'s rollback gives back the size asked rather than what it
    counted, so a ``create`` refused by the budget check itself, which counted nothing, raises the right error but
    gives back bytes it never took (``free`` rises, past ``total`` when nothing else is held). A ``create`` that fails
    after counting (a native failure) is rolled back right."""

    def create(self, size: int) -> HostHandle:
        self.check_call("create", size=size)
        try:
            with busy(), self.locked(): self.charge(size, [0])  # fmt: skip
            return self.do_create(size)
        except BaseException:
            with busy(), self.locked(): self.held -= size  # fmt: skip
            raise


def prove_out_of_memory_rollback_gives_back_the_ask(make: Callable[[], HostDriver]) -> list[object]:
    """A one-granule handle held: the outcome of a ``create`` of the whole budget, the granules ``mem_info`` counts
    taken after it, and after the handle's release."""
    d = make()
    g = d.granularity()
    h = d.create(g)
    seen: list[object] = [outcome(d.create, BUDGET), _held_granules(d)]
    d.release(h)
    return [*seen, _held_granules(d)]


# -- native failures -------------------------------------------------------------------------------------------------
class TruncateFailureKeepsTheMemfd(_Broken):
    """P-native-failure. Breaks "A native call that fails raises ``DriverError`` naming the operation ... and changes
    nothing": ``create`` handles each native step's failure in its own ``except``, and the one around ``ftruncate``
    raises the right ``DriverError`` but does not close the memfd it just made, so a failed ``ftruncate`` (a file size
    limit) leaves the process holding a new memfd. A failed ``memfd_create`` or fill leaves nothing."""

    def do_create(self, size: int) -> HostHandle:
        try:
            fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        except OSError as exc:
            raise DriverError("create", f"memfd_create for {size} bytes: {exc}", exc.errno) from exc
        try:
            os.ftruncate(fd, size)
        except OSError as exc:
            raise DriverError("create", f"ftruncate of a {size}-byte memfd: {exc}", exc.errno) from exc
        try:
            if self.fill_byte is not None:
                self.fill(fd, size, self.fill_byte)
        except BaseException:
            os.close(fd)
            raise
        return HostHandle(fd, size)


def prove_truncate_failure_keeps_the_memfd(make: Callable[[], HostDriver]) -> list[object]:
    """The outcome of a one-granule ``create`` while files may grow to 1 MiB at most (``RLIMIT_FSIZE`` lowered for the
    one call, so ``ftruncate`` fails with EFBIG; Python ignores SIGXFSZ), the memfds the process holds more than
    before, and the granules ``mem_info`` counts taken."""
    d = make()
    before = _memfds()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (MIB, hard))
    try:
        seen = outcome(d.create, d.granularity())
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    extra = _memfds() - before
    for fd in extra:
        os.close(fd)
    return [seen, len(extra), _held_granules(d)]


# -- refusals --------------------------------------------------------------------------------------------------------
class UnmapOfNothingFailsLater(_Broken):
    """P-refusal. Breaks "Every refusal the protocol names raises ``DriverError`` whose ``operation`` is the method
    called": like a native error reported asynchronously, an ``unmap`` of a range with nothing mapped in it returns,
    and its refusal is kept and raised by the driver's next call that checks its arguments, or by ``synchronize``
    (naming ``unmap``, from another method). Every other refusal of ``unmap`` is raised at once."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._sticky: DriverError | None = None

    def check_call(self, op: str, **values: int) -> None:
        sticky, self._sticky = self._sticky, None
        if sticky is not None:
            raise sticky
        super().check_call(op, **values)

    def synchronize(self) -> None:
        self.check_call("synchronize")

    def unmap(self, va: int, size: int) -> None:
        self.check_call("unmap", va=va, size=size)
        with busy(), self.locked():
            touched = any(m < va + size and va < m + s for m, (s, _) in self.mappings.items())
        if not touched:
            self._sticky = DriverError("unmap", f"[{va:#x}, +{size}) has nothing mapped")
            return
        super().unmap(va, size)


def prove_unmap_of_nothing_fails_later(make: Callable[[], HostDriver]) -> list[str]:
    """A one-granule reservation with nothing mapped: the outcome of unmapping it, then of ``accessible`` on it."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    try:
        return [outcome(d.unmap, r, g), outcome(d.accessible, r)]
    finally:
        tidy(d, [(r, g)], [])


# -- interrupted calls -----------------------------------------------------------------------------------------------
class ReleaseClosesBeforeItMarks(_Broken):
    """P-interrupted. Breaks "any other call leaves the state of the call made or of the call never made, so the same
    call made again is taken or refused as that state says": ``release`` closes the memfd in one line and marks the
    handle released (its fd forgotten) in the next, so an exception landing between the two leaves a handle that is
    not released but whose memfd is closed: releasing it again closes the number again, which fails with an
    ``OSError`` (or closes a file the process has opened since). Exceptions on the other lines leave a whole state."""

    def do_release(self, handle: HostHandle) -> None:
        if handle.released:
            raise DriverError("release", f"{handle!r} was already released")
        os.close(handle.fd)
        handle.fd, handle.released = -1, True
        self.drop_if_unused(handle)


def prove_release_closes_before_it_marks(make: Callable[[], HostDriver]) -> list[int]:
    """For each line of a one-granule handle's ``release`` interrupted in turn: the lines after which releasing it
    again neither is taken nor is refused with ``DriverError``."""
    bad = []
    for nth in range(1, 100):
        d = make()
        h = d.create(d.granularity())
        interrupted = interrupt_at_line(d, nth, d.release, h)
        again = outcome(d.release, h)
        if again not in ("done", "DriverError(release)"):
            bad.append(nth)
        if not h.released and _is_memfd(h.fd):  # still open: given back here
            fd, h.fd, h.released = h.fd, -1, True
            os.close(fd)
        if not interrupted:
            break
    return bad


# -- threads ---------------------------------------------------------------------------------------------------------
class SynchronizeWaitsForItsOwnThread(_Broken):
    """P-synchronize. Breaks "Wait for the device's outstanding work": like a backend on per-thread streams, a ``zero``
    from a thread other than the one that built the driver is launched on that thread's stream (a worker that starts
    after a launch latency), and ``synchronize`` waits for the calling thread's stream only, so a ``zero`` made from
    another thread may still be pending when the building thread's ``synchronize`` returns. A thread that synchronizes
    its own work, and every ``zero`` from the building thread, see it done."""

    LAUNCH_S = 0.1

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._owner = threading.get_ident()
        self._streams: dict[int, list[threading.Thread]] = {}

    def zero(self, va: int, size: int) -> None:
        me = threading.get_ident()
        if me == self._owner:
            super().zero(va, size)
            return
        self.check_call("zero", va=va, size=size)
        with busy(), self.locked():
            stream = self._streams.setdefault(me, [])
            job = threading.Thread(target=self._launch, args=(stream[-1] if stream else None, va, size), daemon=True)
            stream.append(job)
        job.start()

    def _launch(self, before: threading.Thread | None, va: int, size: int) -> None:
        if before is not None:
            before.join()
        time.sleep(self.LAUNCH_S)
        g = self.granularity()
        with busy(), self.locked():  # never into memory unmapped meanwhile (that would crash the process)
            if all(HostDriver.accessible(self, a) for a in range(va - va % g, va + size, g)):
                ctypes.memset(va, 0, size)

    def synchronize(self) -> None:
        with busy(), self.locked():
            jobs = list(self._streams.get(threading.get_ident(), []))
        for job in jobs:
            job.join()


def prove_synchronize_waits_for_its_own_thread(make: Callable[[], HostDriver]) -> list[int]:
    """An accessible granule (filled with 0xA5) whose upper half is zeroed from another thread, then the building
    thread synchronizes: its first and last bytes, read through a tensor made before."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.set_access(r, g)
        t = d.tensor(r, g, None)
        worker = threading.Thread(target=d.zero, args=(r + g // 2, g // 2))
        worker.start()
        worker.join()
        d.synchronize()
        seen = [int(t[0]), int(t[g - 1])]
        del t
        return seen
    finally:
        for stream in list(getattr(d, "_streams", {}).values()):  # the broken driver's pending work, before unmap
            for job in stream:
                job.join()
        tidy(d, [(r, g)], [h])


# -- the factories and the cases -------------------------------------------------------------------------------------
granularity_from_the_first_create = functools.partial(
    GranularityFromTheFirstCreate, "broken-granularity-from-the-first-create"
)
huge_reservations_are_sparse = functools.partial(HugeReservationsAreSparse, "broken-huge-reservations-are-sparse")
alignment_checked_as_a_multiple_only = functools.partial(
    AlignmentCheckedAsAMultipleOnly, "broken-alignment-checked-as-a-multiple-only"
)
double_free_is_a_no_op = functools.partial(DoubleFreeIsANoOp, "broken-double-free-is-a-no-op")
unmap_uncounts_the_last_reservation_mapped = functools.partial(
    UnmapUncountsTheLastReservationMapped, "broken-unmap-uncounts-the-last-reservation-mapped"
)
offset_view_end_is_inclusive = functools.partial(OffsetViewEndIsInclusive, "broken-offset-view-end-is-inclusive")
unmap_resets_the_handles_span = functools.partial(UnmapResetsTheHandlesSpan, "broken-unmap-resets-the-handles-span")
unmap_takes_a_mappings_tail = functools.partial(UnmapTakesAMappingsTail, "broken-unmap-takes-a-mappings-tail")
accessible_rounds_up = functools.partial(AccessibleRoundsUp, "broken-accessible-rounds-up")
release_gives_back_ungranted_pages = functools.partial(
    ReleaseGivesBackUngrantedPages, "broken-release-gives-back-ungranted-pages"
)
released_keyed_by_fd_number = functools.partial(ReleasedKeyedByFdNumber, "broken-released-keyed-by-fd-number")
second_mapping_duplicates_the_first = functools.partial(
    SecondMappingDuplicatesTheFirst, "broken-second-mapping-duplicates-the-first"
)
short_by_released_handles_is_a_plain_error = functools.partial(
    ShortByReleasedHandlesIsAPlainError, "broken-short-by-released-handles-is-a-plain-error"
)
out_of_memory_rollback_gives_back_the_ask = functools.partial(
    OutOfMemoryRollbackGivesBackTheAsk, "broken-out-of-memory-rollback-gives-back-the-ask"
)
truncate_failure_keeps_the_memfd = functools.partial(
    TruncateFailureKeepsTheMemfd, "broken-truncate-failure-keeps-the-memfd"
)
unmap_of_nothing_fails_later = functools.partial(UnmapOfNothingFailsLater, "broken-unmap-of-nothing-fails-later")
release_closes_before_it_marks = functools.partial(ReleaseClosesBeforeItMarks, "broken-release-closes-before-it-marks")
synchronize_waits_for_its_own_thread = functools.partial(
    SynchronizeWaitsForItsOwnThread, "broken-synchronize-waits-for-its-own-thread"
)

CASES: dict[str, Case] = {
    "granularity_from_the_first_create": Case(
        granularity_from_the_first_create, "P-granularity", prove_granularity_from_the_first_create, [_G, _G]
    ),
    "huge_reservations_are_sparse": Case(
        huge_reservations_are_sparse,
        "P-reserve-too-large",
        prove_huge_reservations_are_sparse,
        "DriverOutOfMemory(reserve)",
    ),
    "alignment_checked_as_a_multiple_only": Case(
        alignment_checked_as_a_multiple_only,
        "P-bad-value",
        prove_alignment_checked_as_a_multiple_only,
        ["DriverError(reserve)"] * 2,
    ),
    "double_free_is_a_no_op": Case(
        double_free_is_a_no_op, "P-free-refused", prove_double_free_is_a_no_op, ["done", "DriverError(free)"]
    ),
    "unmap_uncounts_the_last_reservation_mapped": Case(
        unmap_uncounts_the_last_reservation_mapped, "P-free", prove_unmap_uncounts_the_last_reservation_mapped, "done"
    ),
    "offset_view_end_is_inclusive": Case(
        offset_view_end_is_inclusive, "P-create", prove_offset_view_end_is_inclusive, ["done"] * 3
    ),
    "unmap_resets_the_handles_span": Case(
        unmap_resets_the_handles_span, "P-unmap", prove_unmap_resets_the_handles_span, [False, True]
    ),
    "unmap_takes_a_mappings_tail": Case(
        unmap_takes_a_mappings_tail,
        "P-unmap-refused",
        prove_unmap_takes_a_mappings_tail,
        ["DriverError(unmap)", "DriverError(unmap)", True],
    ),
    "accessible_rounds_up": Case(
        accessible_rounds_up, "P-accessible", prove_accessible_rounds_up, [True, True, True, False]
    ),
    "release_gives_back_ungranted_pages": Case(
        release_gives_back_ungranted_pages, "P-release-mapped", prove_release_gives_back_ungranted_pages, 0x3C
    ),
    "released_keyed_by_fd_number": Case(
        released_keyed_by_fd_number,
        "P-release-once",
        prove_released_keyed_by_fd_number,
        ["DriverError(release)", "DriverError(release)"],
    ),
    "second_mapping_duplicates_the_first": Case(
        second_mapping_duplicates_the_first,
        "P-map-released",
        prove_second_mapping_duplicates_the_first,
        ["done", "DriverError(map)"],
    ),
    "short_by_released_handles_is_a_plain_error": Case(
        short_by_released_handles_is_a_plain_error,
        "P-oom",
        prove_short_by_released_handles_is_a_plain_error,
        ["DriverOutOfMemory(create)"] * 2,
    ),
    "out_of_memory_rollback_gives_back_the_ask": Case(
        out_of_memory_rollback_gives_back_the_ask,
        "P-create-oom",
        prove_out_of_memory_rollback_gives_back_the_ask,
        ["DriverOutOfMemory(create)", 1, 0],
    ),
    "truncate_failure_keeps_the_memfd": Case(
        truncate_failure_keeps_the_memfd,
        "P-native-failure",
        prove_truncate_failure_keeps_the_memfd,
        ["DriverError(create)", 0, 0],
    ),
    "unmap_of_nothing_fails_later": Case(
        unmap_of_nothing_fails_later, "P-refusal", prove_unmap_of_nothing_fails_later, ["DriverError(unmap)", "done"]
    ),
    "release_closes_before_it_marks": Case(
        release_closes_before_it_marks, "P-interrupted", prove_release_closes_before_it_marks, []
    ),
    "synchronize_waits_for_its_own_thread": Case(
        synchronize_waits_for_its_own_thread, "P-synchronize", prove_synchronize_waits_for_its_own_thread, [0xA5, 0]
    ),
}
