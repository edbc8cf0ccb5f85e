"""A fifth set of deliberately broken host drivers, written from the protocol's text (``drivers/_protocol.py``) and the
host driver by a reader outside the rules, without reading them.

Same layout as ``tests.meta.broken_fourth``: each class breaks one sentence or clause of the protocol, quoted with its
id in the class docstring, the way a backend's own bug might (only in particular shapes, sequences, threads or
states), and comes with a proof that drives a driver built by the factory it is given and returns what it observed;
``CASES`` pairs every factory with the id it breaks, its proof and what the intact host driver observes. Use a driver
as ``extensible-kv check-driver tests.meta.broken_fifth:<factory>``.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable

import torch

from extensible_kv.drivers.host import PROT_READ, PROT_WRITE, HostDriver, HostHandle, libc
from extensible_kv.drivers.records import check_free, check_inside, check_no_overlap
from extensible_kv.errors import DriverError
from tests.meta.broken_protocol import (
    _Broken,
    Case,
    check_handle,
    interrupt_at_line,
    kernel_holds,
    mmap_handle,
    outcome,
    read_byte,
    tidy,
)


# -- shared pieces ---------------------------------------------------------------------------------------------------
def _free_granules(d: HostDriver) -> int:
    """``mem_info``'s free bytes less the total, in granules (0: nothing held)."""
    free, total = d.mem_info()
    return (free - total) // d.granularity()


# -- refusals --------------------------------------------------------------------------------------------------------
class UnmapInsideAMappingNamesMap(_Broken):
    """P-refusal. Breaks "Every refusal the protocol names raises ``DriverError`` whose ``operation`` is the method
    called": to name the mapping that a wrong ``unmap`` falls into, an ``unmap`` whose range starts at no mapping runs
    the overlap check that ``map`` uses, and that check raises its error naming ``map``. An ``unmap`` at a mapping's
    start with the wrong size, or of a range overlapping no mapping, is refused naming ``unmap``, as it should be."""

    def do_unmap(self, va: int, size: int) -> None:
        if va not in self.mappings:  # the bug: check_no_overlap names "map"
            check_no_overlap(va, size, ((m_va, m_size) for m_va, (m_size, _) in self.mappings.items()))
        super().do_unmap(va, size)


def prove_unmap_inside_a_mapping_names_map(make: Callable[[], HostDriver]) -> list[str]:
    """A 2-granule mapping: the outcomes of unmapping its first granule, then its second."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(2 * g)
    try:
        d.map(r, 2 * g, h)
        return [outcome(d.unmap, r, g), outcome(d.unmap, r + g, g)]
    finally:
        tidy(d, [(r, 2 * g)], [h])


class SecondReleaseNamesTheClosedFd(_Broken):
    """P-refusal-names. Breaks "Its message names what was refused: ... the handle as ``str`` or ``repr`` shows it":
    the refusal of a second ``release`` of a handle that is still mapped names the handle by its file descriptor field,
    which the first release set to -1, so the message names no handle (``fd -1``). A second release of a handle mapped
    nowhere keeps the host's message."""

    def do_release(self, handle: HostHandle) -> None:
        if handle.released and handle.maps:
            raise DriverError("release", f"fd {handle.fd} is still mapped and was already released")
        super().do_release(handle)


def prove_second_release_names_the_closed_fd(make: Callable[[], HostDriver]) -> list[object]:
    """A mapped handle released twice: the second release's outcome, and whether its message names the handle."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.release(h)
        try:
            d.release(h)
        except DriverError as exc:
            return [f"DriverError({exc.operation})", repr(h) in str(exc) or str(h) in str(exc)]
        return ["done", False]
    finally:
        tidy(d, [(r, g)], [h])


class SetAccessGrantsPiecesBeforeTheGap(_Broken):
    """P-access-refused. Breaks "Refused, changing nothing: a range with any granule unmapped (... a gap between
    mappings ...)": ``set_access`` walks the mappings in address order and grants each piece as it goes, refusing when
    it meets the first gap, so the mappings below the gap are left accessible. A range that starts unmapped is refused
    before anything is granted."""

    def do_set_access(self, va: int, size: int) -> None:
        end, at = va + size, va
        pieces = sorted((m, s) for m, (s, _) in self.mappings.items() if m < end and va < m + s)
        for m, s in pieces:
            if m > at:
                break
            hi = min(m + s, end)
            if libc().mprotect(at, hi - at, PROT_READ | PROT_WRITE) != 0:
                self.fail("set_access", f"mprotect({at:#x}, {hi - at}, RW)")
            at = hi
        if at != end:
            raise DriverError("set_access", f"[{va:#x}, +{size}) is not fully mapped (nothing mapped at {at:#x})")


def prove_set_access_grants_pieces_before_the_gap(make: Callable[[], HostDriver]) -> list[object]:
    """Granules 0 and 2 of a 3-granule reservation mapped: the outcome of ``set_access`` over all three, and whether
    granules 0 and 2 are then accessible."""
    d = make()
    g = d.granularity()
    r = d.reserve(3 * g, g)
    h1, h2 = d.create(g), d.create(g)
    try:
        d.map(r, g, h1)
        d.map(r + 2 * g, g, h2)
        return [outcome(d.set_access, r, 3 * g), d.accessible(r), d.accessible(r + 2 * g)]
    finally:
        tidy(d, [(r, 3 * g)], [h1, h2])


# -- accounting ------------------------------------------------------------------------------------------------------
class OddHandlesCountAnEvenGranule(_Broken):
    """P-create-memory. Breaks "It takes at least ``size`` bytes from ``mem_info()``'s free bytes (on the host exactly
    ``size`` ...)": the held count is kept in pairs of granules (the allocator's block), so a handle of an odd number of
    granules takes one granule more than its size, and gives the same back. Even handles are counted exactly."""

    def _pairs(self, size: int) -> int:
        pair = 2 * self.granularity()
        return -(-size // pair) * pair

    def charge(self, size: int, counted: list[int]) -> None:
        super().charge(self._pairs(size) if size > 0 else -self._pairs(-size), counted)

    def drop_if_unused(self, handle: HostHandle) -> None:
        if handle.released and handle.maps == 0 and handle.counted:
            self.held, handle.counted = self.held - self._pairs(handle.size), False


def prove_odd_handles_count_an_even_granule(make: Callable[[], HostDriver]) -> list[int]:
    """The granules ``mem_info`` counts taken by a create of 1, of 2 and of 3 granules, and after all are released."""
    d = make()
    g = d.granularity()
    taken, handles = [], []
    try:
        for n in (1, 2, 3):
            before = _free_granules(d)
            handles.append(d.create(n * g))
            taken.append(before - _free_granules(d))
        for h in handles:
            d.release(h)
        return [*taken, _free_granules(d)]
    finally:
        tidy(d, [], handles)


class ReleaseOfASharedHandleUncountsIt(_Broken):
    """P-mem-exact. Breaks "On the host ``free`` is exactly ``total`` less the bytes of every handle not yet released
    and unmapped everywhere": a handle released while it is mapped at two or more addresses is taken out of the held
    count at once (its pages then belong to the kernel's shared mappings, the reasoning goes), though it is still
    mapped. A handle released while mapped once is counted until its unmap."""

    def do_release(self, handle: HostHandle) -> None:
        shared = not handle.released and handle.maps >= 2
        super().do_release(handle)
        if shared and handle.counted:
            self.held, handle.counted = self.held - handle.size, False


def prove_release_of_a_shared_handle_uncounts_it(make: Callable[[], HostDriver]) -> list[int]:
    """A one-granule handle mapped at two addresses and released, then unmapped from each: the granules ``mem_info``
    counts held after the release, after the first unmap and after the second."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.map(r + g, g, h)
        d.release(h)
        seen = [_free_granules(d)]
        d.unmap(r, g)
        seen.append(_free_granules(d))
        d.unmap(r + g, g)
        return [*seen, _free_granules(d)]
    finally:
        tidy(d, [(r, 2 * g)], [h])


# -- reservations ----------------------------------------------------------------------------------------------------
_FOUR_GIB = 1 << 32


class AlignmentTruncatedTo32Bits(_Broken):
    """P-reserve-aligned. Breaks "Reserve ``size`` bytes of virtual addresses and return the first, a multiple of
    ``alignment`` (... 1, 2 or 64 granules and more)": the alignment travels in a 32-bit field (as in a native
    descriptor struct), so an alignment of 4 GiB or more is truncated, and one of exactly 4 GiB becomes 0: the range is
    aligned to a page. Alignments below 4 GiB are kept."""

    def reserve(self, size: int, alignment: int) -> int:
        if isinstance(alignment, int) and not isinstance(alignment, bool) and alignment > 0:
            alignment = ctypes.c_uint32(alignment).value  # the bug
        return super().reserve(size, alignment)


def prove_alignment_truncated_to_32_bits(make: Callable[[], HostDriver]) -> list[bool]:
    """Three one-granule reservations aligned to 4 GiB: whether each starts at a multiple of 4 GiB."""
    d = make()
    g = d.granularity()
    made = [d.reserve(g, _FOUR_GIB) for _ in range(3)]
    try:
        return [va % _FOUR_GIB == 0 for va in made]
    finally:
        tidy(d, [(va, g) for va in made], [])


class InsideCacheOutlivesFree(_Broken):
    """P-map-inside. Breaks "Refused, changing nothing: a range not inside one live reservation (... in a freed one)":
    ``map`` remembers the reservation its last range fell in, to skip the search through many reservations when a
    tensor grows, and ``free`` does not forget it, so a ``map`` into a reservation just freed (the last one mapped in)
    is taken, and maps the handle into address space the driver no longer holds. Once another reservation has been
    mapped in, the freed one is refused."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._last: tuple[int, int] | None = None

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        last = self._last
        if last is None or not (last[0] <= va and va + size <= last[0] + last[1]):
            check_inside("map", va, size, self.reservations.items())
            self._last = next((r, s) for r, s in self.reservations.items() if r <= va and va + size <= r + s)
        check_no_overlap(va, size, ((m_va, m_size) for m_va, (m_size, _) in self.mappings.items()))
        check_handle(handle, size, offset)
        mmap_handle(self, va, size, handle, offset)


def prove_inside_cache_outlives_free(make: Callable[[], HostDriver]) -> str:
    """A one-granule reservation mapped, unmapped and freed: the outcome of mapping it again."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.unmap(r, g)
        d.free(r, g)
        return outcome(d.map, r, g, h)
    finally:
        tidy(d, [(r, g)] if r in d.mappings else [], [h])


class InterruptedFreeRestoresItsRecord(_Broken):
    """P-interrupted. Breaks "An exception raised inside a call while it runs ... leaves the call done whole or not at
    all": ``free`` forgets its record, unmaps the range and then checks the result in a later line, and its ``except``
    clause puts the record back without asking the kernel, so an exception landing after the ``munmap`` leaves a
    record of a reservation the kernel no longer holds (``free`` again is taken, and a ``map`` there would map over
    whatever the kernel has put there since). An exception before the ``munmap`` is rolled back right."""

    def do_free(self, va: int, size: int) -> None:
        check_free(va, size, self.reservations.get(va) == size, self.mappings)
        try:
            del self.reservations[va]
            gone = libc().munmap(va, size) == 0
            if not gone:
                self.fail("free", f"munmap({va:#x}, {size})")
        except BaseException:
            self.reservations[va] = size  # the bug: the kernel may have given the range back already
            raise


def prove_interrupted_free_restores_its_record(make: Callable[[], HostDriver]) -> list[int]:
    """For each line of ``free`` of an empty reservation interrupted in turn: the lines after which whether the kernel
    still holds the range disagrees with the driver's answer to ``free`` made again (taken: it was still held)."""
    torn = []
    for nth in range(1, 100):
        d = make()
        g = d.granularity()
        r = d.reserve(g, g)
        interrupted = interrupt_at_line(d, nth, d.free, r, g)
        held = kernel_holds(r, r + g) == g
        again = outcome(d.free, r, g) == "done"
        if held != again:
            torn.append(nth)
        if held and not again:
            libc().munmap(r, g)
        if not interrupted:
            break
    return torn


# -- mappings --------------------------------------------------------------------------------------------------------
class LargeHandlesMapWhole(_Broken):
    """P-map-offset. Breaks "any other driver (the host's mmap) takes every offset and size within the handle; whichever
    a driver does, it does for every call": handles of 32 granules and more take a path written for the whole-handle
    native call, which refuses a mapping of part of the handle; smaller handles map at every offset and size."""

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        if handle.size >= 32 * self.granularity() and (offset or size != handle.size):
            raise DriverError(
                "map", f"{handle!r} maps whole only: offset {offset}, size {size} of a {handle.size}-byte handle"
            )
        super().do_map(va, size, handle, offset)


def prove_large_handles_map_whole(make: Callable[[], HostDriver]) -> list[str]:
    """The outcomes of mapping one granule at offset 1 granule of a 2-granule handle, then of a 32-granule one."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    small, large = d.create(2 * g), d.create(32 * g)
    try:
        return [outcome(d.map, r, g, small, g), outcome(d.map, r + g, g, large, g)]
    finally:
        tidy(d, [(r, 2 * g)], [small, large])


class OverlapCheckPast16ByStart(_Broken):
    """P-map-overlap. Breaks "Refused, changing nothing: ... a range overlapping a live mapping (from below, from
    above, inside, exactly, around it)": the first 16 live mappings are checked for overlap in full, later ones (a
    slower table) only for a mapping starting at the same address, so once 16 mappings are live a range overlapping a
    later mapping from below, from above or around it is taken, and ``MAP_FIXED`` silently replaces part of it."""

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        check_inside("map", va, size, self.reservations.items())
        spans = [(m_va, m_size) for m_va, (m_size, _) in self.mappings.items()]
        check_no_overlap(va, size, spans[:16])
        for m_va, m_size in spans[16:]:
            if m_va == va:  # the bug: the later mappings are looked up by their start only
                raise DriverError("map", f"[{va:#x}, +{size}) overlaps the live mapping [{m_va:#x}, +{m_size})")
        check_handle(handle, size, offset)
        mmap_handle(self, va, size, handle, offset)


def prove_overlap_check_past_16_by_start(make: Callable[[], HostDriver]) -> list[str]:
    """Sixteen one-granule mappings, and a seventeenth at granule 17 of a 20-granule reservation: the outcomes of
    mapping 2 granules from granule 15 (over a checked mapping), then from granule 16 (over the seventeenth)."""
    d = make()
    g = d.granularity()
    r = d.reserve(20 * g, g)
    h = d.create(2 * g)
    try:
        for i in (*range(16), 17):
            d.map(r + i * g, g, h)
        return [outcome(d.map, r + 15 * g, 2 * g, h), outcome(d.map, r + 16 * g, 2 * g, h)]
    finally:
        tidy(d, [(r, 20 * g)], [h])


# -- tensors ---------------------------------------------------------------------------------------------------------
class SpanningTensorIsACopy(_Broken):
    """P-tensor. Breaks "... over ``[va, va+nbytes)`` (``data_ptr() == va``) without copying, at any address and size
    (... across several mappings)": a range that spans several mappings is built as one view per mapping joined with
    ``torch.cat`` (as a backend that wraps each mapping's allocation separately would), which copies, so writes through
    it reach no mapping. A range inside one mapping is a view, as it should be."""

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        self.check_call("tensor", va=va, size=nbytes)
        end = va + nbytes
        pieces = sorted((m, s) for m, (s, _) in self.mappings.items() if m < end and va < m + s)
        if len(pieces) < 2:
            return super().tensor(va, nbytes, keeper)
        parts = [HostDriver.tensor(self, max(m, va), min(m + s, end) - max(m, va), keeper) for m, s in pieces]
        return torch.cat(parts)


def prove_spanning_tensor_is_a_copy(make: Callable[[], HostDriver]) -> list[object]:
    """Two adjacent accessible mappings of two handles, a tensor over the 8 bytes around their border filled with 7:
    whether its ``data_ptr`` is the address asked, and the bytes read back on each side of the border."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h1, h2 = d.create(g), d.create(g)
    try:
        d.map(r, g, h1)
        d.map(r + g, g, h2)
        d.set_access(r, 2 * g)
        t = d.tensor(r + g - 4, 8, None)
        t.fill_(7)
        at = t.data_ptr() == r + g - 4
        del t
        d.synchronize()
        return [at, read_byte(d, r + g - 1), read_byte(d, r + g)]
    finally:
        tidy(d, [(r, 2 * g)], [h1, h2])


# -- threads ---------------------------------------------------------------------------------------------------------
class ContextCurrentOnlyWhereCreated(_Broken):
    """P-threads. Breaks "Any call may be made from several threads at once on one driver": like a CUDA backend that
    makes its context current per thread only in ``create`` (and in the thread that built it), a ``map`` from a thread
    that never created a handle fails for want of a current context. Threads that create before they map, and the
    building thread, map fine."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._current = threading.local()
        self._current.ready = True

    def create(self, size: int) -> HostHandle:
        self._current.ready = True
        return super().create(size)

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        if not getattr(self._current, "ready", False):
            raise DriverError("map", f"no current context in this thread to map [{va:#x}, +{size})")
        super().do_map(va, size, handle, offset)


def prove_context_current_only_where_created(make: Callable[[], HostDriver]) -> list[str]:
    """A handle created in the building thread: the outcome of mapping it from a second thread, then (unmapped again)
    from the building thread."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    seen: list[str] = []
    try:
        worker = threading.Thread(target=lambda: seen.append(outcome(d.map, r, g, h)))
        worker.start()
        worker.join()
        if seen == ["done"]:
            d.unmap(r, g)
        seen.append(outcome(d.map, r, g, h))
        return seen
    finally:
        tidy(d, [(r, g)], [h])


# -- the factories and the cases -------------------------------------------------------------------------------------
unmap_inside_a_mapping_names_map = functools.partial(
    UnmapInsideAMappingNamesMap, "broken-unmap-inside-a-mapping-names-map"
)
second_release_names_the_closed_fd = functools.partial(
    SecondReleaseNamesTheClosedFd, "broken-second-release-names-the-closed-fd"
)
set_access_grants_pieces_before_the_gap = functools.partial(
    SetAccessGrantsPiecesBeforeTheGap, "broken-set-access-grants-pieces-before-the-gap"
)
odd_handles_count_an_even_granule = functools.partial(
    OddHandlesCountAnEvenGranule, "broken-odd-handles-count-an-even-granule"
)
release_of_a_shared_handle_uncounts_it = functools.partial(
    ReleaseOfASharedHandleUncountsIt, "broken-release-of-a-shared-handle-uncounts-it"
)
alignment_truncated_to_32_bits = functools.partial(AlignmentTruncatedTo32Bits, "broken-alignment-truncated-to-32-bits")
inside_cache_outlives_free = functools.partial(InsideCacheOutlivesFree, "broken-inside-cache-outlives-free")
interrupted_free_restores_its_record = functools.partial(
    InterruptedFreeRestoresItsRecord, "broken-interrupted-free-restores-its-record"
)
large_handles_map_whole = functools.partial(LargeHandlesMapWhole, "broken-large-handles-map-whole")
overlap_check_past_16_by_start = functools.partial(OverlapCheckPast16ByStart, "broken-overlap-check-past-16-by-start")
spanning_tensor_is_a_copy = functools.partial(SpanningTensorIsACopy, "broken-spanning-tensor-is-a-copy")
context_current_only_where_created = functools.partial(
    ContextCurrentOnlyWhereCreated, "broken-context-current-only-where-created"
)

CASES: dict[str, Case] = {
    "unmap_inside_a_mapping_names_map": Case(
        unmap_inside_a_mapping_names_map,
        "P-refusal",
        prove_unmap_inside_a_mapping_names_map,
        ["DriverError(unmap)", "DriverError(unmap)"],
    ),
    "second_release_names_the_closed_fd": Case(
        second_release_names_the_closed_fd,
        "P-refusal-names",
        prove_second_release_names_the_closed_fd,
        ["DriverError(release)", True],
    ),
    "set_access_grants_pieces_before_the_gap": Case(
        set_access_grants_pieces_before_the_gap,
        "P-access-refused",
        prove_set_access_grants_pieces_before_the_gap,
        ["DriverError(set_access)", False, False],
    ),
    "odd_handles_count_an_even_granule": Case(
        odd_handles_count_an_even_granule, "P-create-memory", prove_odd_handles_count_an_even_granule, [1, 2, 3, 0]
    ),
    "release_of_a_shared_handle_uncounts_it": Case(
        release_of_a_shared_handle_uncounts_it, "P-mem-exact", prove_release_of_a_shared_handle_uncounts_it, [-1, -1, 0]
    ),
    "alignment_truncated_to_32_bits": Case(
        alignment_truncated_to_32_bits, "P-reserve-aligned", prove_alignment_truncated_to_32_bits, [True, True, True]
    ),
    "inside_cache_outlives_free": Case(
        inside_cache_outlives_free, "P-map-inside", prove_inside_cache_outlives_free, "DriverError(map)"
    ),
    "interrupted_free_restores_its_record": Case(
        interrupted_free_restores_its_record, "P-interrupted", prove_interrupted_free_restores_its_record, []
    ),
    "large_handles_map_whole": Case(
        large_handles_map_whole, "P-map-offset", prove_large_handles_map_whole, ["done", "done"]
    ),
    "overlap_check_past_16_by_start": Case(
        overlap_check_past_16_by_start,
        "P-map-overlap",
        prove_overlap_check_past_16_by_start,
        ["DriverError(map)", "DriverError(map)"],
    ),
    "spanning_tensor_is_a_copy": Case(
        spanning_tensor_is_a_copy, "P-tensor", prove_spanning_tensor_is_a_copy, [True, 7, 7]
    ),
    "context_current_only_where_created": Case(
        context_current_only_where_created, "P-threads", prove_context_current_only_where_created, ["done", "done"]
    ),
}
