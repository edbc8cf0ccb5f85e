"""A third set of deliberately broken host drivers, written from the protocol's text (``drivers/_protocol.py``) and the
host driver by a reader outside the rules.

Same layout as ``tests.meta.broken_outside``: each class breaks one sentence or clause of the protocol, quoted with its
id in the class docstring, the way a backend's own bug might (mostly only in particular shapes or sequences), and comes
with a proof that drives a driver built by the factory it is given and returns what it observed; ``CASES`` pairs every
factory with the id it breaks, its proof and what the intact host driver observes. Use a driver as
``extensible-kv check-driver tests.meta.broken_third:<factory>``.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from extensible_kv.drivers.host import (
    MAP_ANONYMOUS,
    MAP_FAILED,
    MAP_FIXED,
    MAP_NORESERVE,
    MAP_PRIVATE,
    MAP_SHARED,
    PROT_NONE,
    PROT_READ,
    PROT_WRITE,
    PAGE_BYTES,
    HostDriver,
    HostHandle,
    libc,
)
from extensible_kv.drivers.records import check_inside, mapped_parts
from extensible_kv.errors import DriverError
from extensible_kv.reaper import busy
from tests.meta.broken_protocol import (
    _G,
    BUDGET,
    RACE_TRIES,
    RACE_WINDOW_S,
    Case,
    _Broken,
    _race,
    kernel_holds,
    kernel_ranges,
    outcome,
    tidy,
)


def result(call: Callable[..., Any], *args: Any) -> object:
    """What ``call(*args)`` returned, or the type of the error it raised and the operation it names."""
    try:
        return call(*args)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}({getattr(exc, 'operation', '')})"


def names_an_argument(call: Callable[..., Any], *args: Any) -> tuple[str, bool]:
    """The outcome of ``call(*args)`` and whether its error message names one of its int arguments (decimal or hex)."""
    try:
        call(*args)
    except Exception as exc:  # noqa: BLE001
        msg = str(exc)
        named = any(isinstance(a, int) and (str(a) in msg or f"{a:#x}" in msg) for a in args)
        return f"{type(exc).__name__}({getattr(exc, 'operation', '')})", named
    return "done", False


# -- bad values ------------------------------------------------------------------------------------------------------
class MapTakesABoolOffset(_Broken):
    """P-bad-value. Breaks "A value that is not an ``int`` (a ``bool``, ...) ... is refused by ... ``map``": its own
    check of the offset is ``isinstance(offset, int)``, which a ``bool`` passes, so ``map(..., offset=False)`` maps at
    offset 0 (``offset=True`` still fails, natively, as a misaligned offset)."""

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        if isinstance(offset, bool):
            offset = int(offset)
        super().map(va, size, handle, offset)


def prove_map_takes_a_bool_offset(make: Callable[[], HostDriver]) -> str:
    """The outcome of ``map(r, g, h, False)``."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        return outcome(d.map, r, g, h, False)
    finally:
        tidy(d, [(r, g)], [h])


# -- refusals --------------------------------------------------------------------------------------------------------
class GapRefusalNamesNothing(_Broken):
    """P-refusal-names. Breaks "Its message names what was refused: at least one argument of the call": when
    ``set_access`` is refused for a gap between two mappings (the range's ends are mapped), its message says only that
    there is a gap, with no address or size."""

    def do_set_access(self, va: int, size: int) -> None:
        touched = [(m, s) for m, (s, _) in self.mappings.items() if m < va + size and va < m + s]
        if touched and min(m for m, _ in touched) <= va and max(m + s for m, s in touched) >= va + size:
            try:
                mapped_parts(va, size, touched)
            except DriverError:
                raise DriverError("set_access", "the range has a gap between two of its mappings") from None
        super().do_set_access(va, size)


def prove_gap_refusal_names_nothing(make: Callable[[], HostDriver]) -> tuple[str, bool]:
    """``set_access`` over two mappings with an unmapped granule between them: its outcome, and whether the message
    names ``va`` or ``size``."""
    d = make()
    g = d.granularity()
    r = d.reserve(3 * g, g)
    h1, h2 = d.create(g), d.create(g)
    try:
        d.map(r, g, h1)
        d.map(r + 2 * g, g, h2)
        return names_an_argument(d.set_access, r, 3 * g)
    finally:
        tidy(d, [(r, 3 * g)], [h1, h2])


class FreeOfAMappedReservationNamesUnmap(_Broken):
    """P-refusal. Breaks "Every refusal the protocol names raises ``DriverError`` whose ``operation`` is the method
    called": ``free`` of a reservation that still has live mappings is refused with an error whose operation is
    ``unmap`` (its message tells the caller to unmap first); every other refusal of ``free`` names ``free``."""

    def do_free(self, va: int, size: int) -> None:
        if self.reservations.get(va) == size and any(va <= m < va + size for m in self.mappings):
            raise DriverError("unmap", f"reservation {va:#x} (+{size}) still has live mappings: unmap them first")
        super().do_free(va, size)


def prove_free_of_a_mapped_reservation_names_unmap(make: Callable[[], HostDriver]) -> str:
    """The outcome of ``free`` of a reservation with one live mapping."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        return outcome(d.free, r, g)
    finally:
        tidy(d, [(r, g)], [h])


class RefusedFreeForgetsTheReservation(_Broken):
    """P-refusal-unchanged. Breaks "A refused call leaves ... every reservation as usable as before (each of its
    unmapped granules still takes a new mapping)": ``free`` pops its record of the reservation at ``va`` before it
    compares the sizes, and a ``free`` of the first part of a reservation is refused without putting the record back,
    so the reservation (which the kernel still holds) takes no mapping and can never be freed."""

    def do_free(self, va: int, size: int) -> None:
        reserved = self.reservations.pop(va, None)
        if reserved != size:
            raise DriverError("free", f"[{va:#x}, +{size}) is not a reservation of this driver")
        self.reservations[va] = reserved
        super().do_free(va, size)


def prove_refused_free_forgets_the_reservation(make: Callable[[], HostDriver]) -> list[str]:
    """The outcome of ``free`` of the first granule of a 2-granule reservation, then of a ``map`` of that granule."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(g)
    try:
        return [outcome(d.free, r, g), outcome(d.map, r, g, h)]
    finally:
        tidy(d, [(r, 2 * g)], [h])


# -- address space ---------------------------------------------------------------------------------------------------
class LargeReserveTrustsTheKernelAlignment(_Broken):
    """P-reserve-aligned. Breaks "return the first [address], a multiple of ``alignment`` (... 1, 2 or 64 granules
    and more)": for a large reservation (16 granules and more) aligned to at most 2 granules it skips the padding,
    since Linux places large anonymous mappings on 2 MiB boundaries, and accepts the kernel's address when it is a
    multiple of the granularity, not of the alignment: a 2-granule alignment is honoured about half the time."""

    def reserve(self, size: int, alignment: int) -> int:
        self.check_call("reserve", size=size, alignment=alignment)
        g = self.granularity()
        if size >= 16 * g and alignment <= 2 * g and alignment % g == 0:
            flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
            raw = libc().mmap(None, size, PROT_NONE, flags, -1, 0)
            if raw not in (None, MAP_FAILED):
                if raw % g == 0:  # the bug: the granularity, not the alignment
                    with busy(), self.locked(): self.reservations[raw] = size  # fmt: skip
                    return raw
                libc().munmap(raw, size)
        return super().reserve(size, alignment)


def prove_large_reserve_trusts_the_kernel_alignment(make: Callable[[], HostDriver]) -> int:
    """How many of eight reservations of 16 to 23 granules aligned to 2 granules are not aligned to 2 granules."""
    d = make()
    g = d.granularity()
    misaligned = 0
    for n in range(16, 24):
        va = d.reserve(n * g, 2 * g)
        misaligned += va % (2 * g) != 0
        d.free(va, n * g)
    return misaligned


class ReserveKeepsTheTailUntilFree(_Broken):
    """P-reserve-kernel. Breaks "On the host the kernel holds exactly ``[va, va+size)`` as reserved ...: address space
    taken to align the range is given back before ``reserve`` returns": for alignments of 64 granules and more it
    trims the head of its over-reservation at once but keeps the tail until ``free`` (what a GPU driver may do)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._tails: dict[int, int] = {}

    def do_reserve(self, size: int, alignment: int) -> int:
        if alignment < 64 * self.granularity():
            return super().do_reserve(size, alignment)
        span = size + alignment
        raw = libc().mmap(None, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if raw in (None, MAP_FAILED):
            self.fail("reserve", f"mmap(PROT_NONE, {span} bytes) for {size} bytes aligned to {alignment}", oom=True)
        va = -(-raw // alignment) * alignment
        if va > raw:
            libc().munmap(raw, va - raw)
        self._tails[va] = raw + span - (va + size)
        self.reservations[va] = size
        return va

    def do_free(self, va: int, size: int) -> None:
        super().do_free(va, size)
        tail = self._tails.pop(va, 0)
        if tail:
            libc().munmap(va + size, tail)


def prove_reserve_keeps_the_tail_until_free(make: Callable[[], HostDriver]) -> int:
    """Bytes of the page right after a reservation of one granule aligned to 64 granules the kernel holds."""
    d = make()
    g = d.granularity()
    va = d.reserve(g, 64 * g)
    held = kernel_holds(va + g, va + g + PAGE_BYTES)
    d.free(va, g)
    return held


class FreedAddressStaysRefused(_Broken):
    """P-map-inside. Breaks "Refused, changing nothing: a range not inside one live reservation (... in a freed one)"
    by refusing too much: it remembers every freed reservation to refuse maps there, and never forgets one, so once
    the kernel hands the same addresses out again to a new ``reserve``, a valid ``map`` in the new reservation is
    refused."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._freed: list[tuple[int, int]] = []

    def do_free(self, va: int, size: int) -> None:
        super().do_free(va, size)
        self._freed.append((va, size))

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        for f_va, f_size in self._freed:
            if f_va < va + size and va < f_va + f_size:
                raise DriverError("map", f"[{va:#x}, +{size}) lies in the freed reservation [{f_va:#x}, +{f_size})")
        super().do_map(va, size, handle, offset)


def prove_freed_address_stays_refused(make: Callable[[], HostDriver]) -> str:
    """The outcome of a ``map`` in a reservation the kernel placed where a freed one was."""
    d = make()
    g = d.granularity()
    h = d.create(g)
    r = d.reserve(g, g)
    d.free(r, g)
    again = d.reserve(g, g)
    try:
        if again != r:
            return "the kernel placed the new reservation elsewhere"
        return outcome(d.map, again, g, h)
    finally:
        tidy(d, [(again, g)], [h])


# -- physical memory -------------------------------------------------------------------------------------------------
class MemfdRoundsUpToAPowerOfTwo(_Broken):
    """P-create-memory. Breaks "(on the host exactly ``size``, and the kernel holds one new memfd of ``size`` bytes)":
    its memfds come in power-of-two sizes (a bucket allocator), so a handle of 3 granules is a memfd of 4 (its
    accounting still says ``size``)."""

    def do_create(self, size: int) -> HostHandle:
        handle = super().do_create(size)
        bucket = 1 << (size - 1).bit_length()
        if bucket != size:
            os.ftruncate(handle.fd, bucket)
        return handle


def prove_memfd_rounds_up_to_a_power_of_two(make: Callable[[], HostDriver]) -> int:
    """The size of the memfd of a handle of 3 granules, in granules."""
    d = make()
    h = d.create(3 * d.granularity())
    try:
        return os.fstat(h.fd).st_size // d.granularity()
    finally:
        d.release(h)


class CreatePastTotalIsNotOutOfMemory(_Broken):
    """P-create-oom. Breaks "When memory is short (... more than ``total`` anywhere): ``DriverOutOfMemory`` naming
    ``create``": a size larger than the whole memory is refused as an invalid argument, a plain ``DriverError``."""

    def create(self, size: int) -> HostHandle:
        if isinstance(size, int) and not isinstance(size, bool) and self.total < size < 1 << 63:
            raise DriverError("create", f"size {size} exceeds the device's {self.total} bytes")
        return super().create(size)


def prove_create_past_total_is_not_out_of_memory(make: Callable[[], HostDriver]) -> str:
    """The outcome of a create of one granule more than ``total``."""
    d = make()
    return outcome(d.create, d.mem_info()[1] + d.granularity())


class ReleaseIsARefcount(_Broken):
    """P-release-once. Breaks "releasing it again while it is still mapped somewhere is refused": it treats the
    creation reference and each mapping as references and a ``release`` as dropping one, so a second release of a
    handle still mapped at two addresses is accepted (and drops a mapping's reference: its bytes come back at the next
    unmap while one mapping is left)."""

    def do_release(self, handle: HostHandle) -> None:
        if handle.released and handle.maps >= 2:
            handle.maps -= 1
            return
        super().do_release(handle)


def prove_release_is_a_refcount(make: Callable[[], HostDriver]) -> str:
    """The outcome of a second release of a handle mapped at two addresses."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.map(r + g, g, h)
        d.release(h)
        return outcome(d.release, h)
    finally:
        tidy(d, [(r, 2 * g)], [h])


class UnmapSubtractsTheHandleSize(_Broken):
    """P-mem-exact. Breaks "On the host ``free`` is exactly ``total`` less the bytes of every handle not yet released
    and unmapped everywhere": it counts how many bytes of each handle are mapped, adds a mapping's size at ``map`` but
    subtracts the handle's whole size at ``unmap``, so a released handle mapped in parts is counted free at its first
    unmap while its other parts are still mapped (a handle mapped whole is counted right)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._mapped_bytes: dict[HostHandle, int] = {}

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        super().do_map(va, size, handle, offset)
        self._mapped_bytes[handle] = self._mapped_bytes.get(handle, 0) + size

    def forget(self, va: int, live: tuple[int, HostHandle]) -> None:
        handle = live[1]
        left = max(0, self._mapped_bytes.get(handle, 0) - handle.size)  # the bug: handle.size, not live[0]
        self._mapped_bytes[handle] = left
        del self.mappings[va]
        handle.maps = handle.maps - 1 if left else 0
        self.drop_if_unused(handle)


def prove_unmap_subtracts_the_handle_size(make: Callable[[], HostDriver]) -> tuple[int, int]:
    """``mem_info`` after a released handle of 2 granules, mapped one granule at a time, lost its first mapping."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(2 * g)
    try:
        d.map(r, g, h, 0)
        d.map(r + g, g, h, g)
        d.release(h)
        d.unmap(r, g)
        return d.mem_info()
    finally:
        tidy(d, [(r, 2 * g)], [h])


# -- mappings --------------------------------------------------------------------------------------------------------
class OverlapIndexDropsTheNeighbour(_Broken):
    """P-map-overlap. Breaks "Refused, changing nothing: ... a range overlapping a live mapping": it keeps the starts of
    its mappings in a sorted index for the overlap check, and ``unmap`` deletes ``bisect_right(starts, va)`` (the
    index of the next start, missing ``- 1``), so unmapping a mapping that is not the highest drops its upper
    neighbour from the index; a later ``map`` over that neighbour is not refused and replaces it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._starts: list[int] = []

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        check_inside("map", va, size, self.reservations.items())
        i = bisect.bisect_left(self._starts, va + size)
        if i:  # the last mapping starting below the range's end is the only one that can overlap it
            prev = self._starts[i - 1]
            live_prev = self.mappings.get(prev)
            if live_prev is not None and prev + live_prev[0] > va:
                raise DriverError("map", f"[{va:#x}, +{size}) overlaps the live mapping [{prev:#x}, +{live_prev[0]})")
        if handle.released:
            raise DriverError("map", f"{handle!r} was released; map a live handle")
        if offset + size > handle.size:
            raise DriverError("map", f"offset {offset} + size {size} exceeds the {handle.size}-byte handle")
        live = (size, handle)
        try:
            handle.maps, self.mappings[va] = handle.maps + 1, live
            if libc().mmap(va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, handle.fd, offset) != va:
                self.fail("map", f"mmap(MAP_FIXED, {va:#x}, {size}, fd={handle.fd}, offset={offset})")
            bisect.insort(self._starts, va)
        except BaseException:
            if self.mappings.get(va) is live:
                libc().mmap(va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0)
                handle.maps, _ = handle.maps - 1, self.mappings.pop(va)
            raise

    def forget(self, va: int, live: tuple[int, HostHandle]) -> None:
        if self._starts:
            del self._starts[min(bisect.bisect_right(self._starts, va), len(self._starts) - 1)]
        super().forget(va, live)


def prove_overlap_index_drops_the_neighbour(make: Callable[[], HostDriver]) -> str:
    """Three adjacent one-granule mappings, the lowest unmapped: the outcome of a map over the middle one."""
    d = make()
    g = d.granularity()
    r = d.reserve(3 * g, g)
    hs = [d.create(g) for _ in range(4)]
    try:
        for i in range(3):
            d.map(r + i * g, g, hs[i])
        d.unmap(r, g)
        return outcome(d.map, r + g, g, hs[3])
    finally:
        tidy(d, [(r, 3 * g)], hs)


class MergesContiguousMappings(_Broken):
    """P-unmap. Breaks "Return ``[va, va+size)``, exactly the range of one ``map`` call, to reserved": like the kernel
    with its VMAs, it merges a mapping into the one just below it when both map the same handle at contiguous offsets,
    so the range of the second ``map`` call is no longer one mapping (its ``unmap`` is refused, and the two together
    are taken as one)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._offsets: dict[int, int] = {}

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        super().do_map(va, size, handle, offset)
        self._offsets[va] = offset
        for prev, (p_size, p_handle) in list(self.mappings.items()):
            if prev + p_size == va and p_handle is handle and self._offsets.get(prev, -1) + p_size == offset:
                self.mappings[prev] = (p_size + size, handle)
                del self.mappings[va], self._offsets[va]
                handle.maps -= 1
                break

    def forget(self, va: int, live: tuple[int, HostHandle]) -> None:
        self._offsets.pop(va, None)
        super().forget(va, live)


def prove_merges_contiguous_mappings(make: Callable[[], HostDriver]) -> str:
    """A handle of 2 granules mapped one granule at a time at contiguous offsets: the outcome of unmapping the second
    map call's range."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(2 * g)
    try:
        d.map(r, g, h, 0)
        d.map(r + g, g, h, g)
        return outcome(d.unmap, r + g, g)
    finally:
        tidy(d, [(r, 2 * g)], [h])


# -- access ----------------------------------------------------------------------------------------------------------
class SetAccessRefusesTheMiddleOfAMapping(_Broken):
    """P-access. Breaks "Part of a mapping is granted by a driver whose native call takes it (the host's mprotect) and
    refused ... by one whose native call takes whole mappings only ...; either way, the same for every call": it grants
    a part of a mapping that starts or ends with it, but refuses one strictly inside it."""

    def do_set_access(self, va: int, size: int) -> None:
        for m, (s, _) in self.mappings.items():
            if m < va and va + size < m + s:
                raise DriverError(
                    "set_access", f"[{va:#x}, +{size}) lies strictly inside the mapping [{m:#x}, +{s}); grant an end"
                )
        super().do_set_access(va, size)


def prove_set_access_refuses_the_middle_of_a_mapping(make: Callable[[], HostDriver]) -> list[str]:
    """A mapping of 3 granules: the outcomes of ``set_access`` of its first granule, then of its second."""
    d = make()
    g = d.granularity()
    r = d.reserve(3 * g, g)
    h = d.create(3 * g)
    try:
        d.map(r, 3 * g, h)
        return [outcome(d.set_access, r, g), outcome(d.set_access, r + g, g)]
    finally:
        tidy(d, [(r, 3 * g)], [h])


class SetAccessForgetsToClip(_Broken):
    """P-access-refused. Breaks "Refused, changing nothing: a range with any granule unmapped (partly mapped from ...
    above ...)": it adds up the sizes of the mappings the range touches without clipping them to the range, so a range
    that starts inside a large mapping and runs past its end into unmapped granules counts as fully mapped, and the
    unmapped (anonymous, reserved) granules become readable and writable."""

    def do_set_access(self, va: int, size: int) -> None:
        touched = [s for m, (s, _) in self.mappings.items() if m < va + size and va < m + s]
        if sum(touched) < size:
            raise DriverError("set_access", f"[{va:#x}, +{size}) is not fully mapped ({sum(touched)} bytes mapped)")
        if libc().mprotect(va, size, PROT_READ | PROT_WRITE) != 0:
            self.fail("set_access", f"mprotect({va:#x}, {size}, RW)")


def prove_set_access_forgets_to_clip(make: Callable[[], HostDriver]) -> str:
    """A mapping of 2 granules, one unmapped granule above it: the outcome of ``set_access`` from its second granule
    over the unmapped one."""
    d = make()
    g = d.granularity()
    r = d.reserve(3 * g, g)
    h = d.create(2 * g)
    try:
        d.map(r, 2 * g, h)
        return outcome(d.set_access, r + g, 2 * g)
    finally:
        tidy(d, [(r, 3 * g)], [h])


class AccessibleRefusesHighAddresses(_Broken):
    """P-accessible. Breaks "Whether the granule at ``va`` (any address in it, also one outside every reservation) is
    mapped and readable/writable": it validates ``va`` against the x86-64 user address space and raises
    ``ValueError`` for an address at or above 2**47, which is no reservation (the answer is ``False``)."""

    def accessible(self, va: int) -> bool:
        if isinstance(va, int) and not isinstance(va, bool) and (1 << 47) <= va < (1 << 63):
            raise ValueError(f"{va:#x} is above the user address space")
        return super().accessible(va)


def prove_accessible_refuses_high_addresses(make: Callable[[], HostDriver]) -> object:
    """What ``accessible(2**47)`` answers."""
    d = make()
    return result(d.accessible, 1 << 47)


class SetAccessMprotectsUnlocked(_Broken):
    """P-threads. Breaks "each takes effect whole, so what every call returned, and the state the driver is left in,
    are those of some serial order of the calls": ``set_access`` checks the range under its lock but calls
    ``mprotect`` after letting it go, so an ``unmap`` of the range from another thread in between is followed by an
    ``mprotect`` of reserved anonymous memory: both calls succeed and the granule is left readable and writable
    anonymous memory, which no serial order leaves (touching it does not fault, ``accessible`` says False)."""

    def set_access(self, va: int, size: int) -> None:
        self.check_call("set_access", va=va, size=size)
        parts = ((m, s) for m, (s, _) in self.mappings.items())
        with busy(), self.locked(): mapped_parts(va, size, parts)  # fmt: skip
        time.sleep(RACE_WINDOW_S)
        if libc().mprotect(va, size, PROT_READ | PROT_WRITE) != 0:
            self.fail("set_access", f"mprotect({va:#x}, {size}, RW)")


def _anonymous_read_write(lo: int, hi: int) -> bool:
    return any(
        r_lo < hi and lo < r_hi and perms.startswith("rw") and not path for r_lo, r_hi, perms, path in kernel_ranges()
    )


def prove_set_access_mprotects_unlocked(make: Callable[[], HostDriver]) -> bool:
    """Whether a mapped granule given access and unmapped from two threads at once was ever left readable and writable
    anonymous memory (up to ``RACE_TRIES`` tries)."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)

    def work(i: int) -> None:
        if i == 0:
            outcome(d.set_access, r, g)
        else:
            time.sleep(RACE_WINDOW_S / 4)
            outcome(d.unmap, r, g)

    try:
        for _ in range(RACE_TRIES):
            d.map(r, g, h)
            _race(work)
            if r in d.mappings:
                d.unmap(r, g)
            if _anonymous_read_write(r, r + g):
                return True
        return False
    finally:
        tidy(d, [(r, g)], [h])


# -- tensors ---------------------------------------------------------------------------------------------------------
class TensorRoundsDownAnOddBase(_Broken):
    """P-tensor. Breaks "A 1-D ``torch.uint8`` tensor of ``nbytes`` elements over ``[va, va+nbytes)`` (``data_ptr()
    == va``) ... at any address": it builds its buffer from ``va`` rounded down to 8 bytes (for aligned loads) and
    forgets to skip the rounding, so a tensor at an address that is not a multiple of 8 starts up to 7 bytes early."""

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        self.check_call("tensor", va=va, size=nbytes)
        base = va & ~7
        buffer = (ctypes.c_uint8 * (nbytes + va - base)).from_address(base)
        buffer.keeper = keeper
        return torch.frombuffer(buffer, dtype=torch.uint8)[:nbytes]


def prove_tensor_rounds_down_an_odd_base(make: Callable[[], HostDriver]) -> int:
    """``data_ptr() - va`` of a tensor at 3 bytes into a mapped granule."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.set_access(r, g)
        t = d.tensor(r + 3, 16, None)
        shift = t.data_ptr() - (r + 3)
        del t
        return shift
    finally:
        tidy(d, [(r, g)], [h])


# -- the factories and the cases -------------------------------------------------------------------------------------
map_takes_a_bool_offset = functools.partial(MapTakesABoolOffset, "broken-map-takes-a-bool-offset")
gap_refusal_names_nothing = functools.partial(GapRefusalNamesNothing, "broken-gap-refusal-names-nothing")
free_of_a_mapped_reservation_names_unmap = functools.partial(
    FreeOfAMappedReservationNamesUnmap, "broken-free-of-a-mapped-reservation-names-unmap"
)
refused_free_forgets_the_reservation = functools.partial(
    RefusedFreeForgetsTheReservation, "broken-refused-free-forgets-the-reservation"
)
large_reserve_trusts_the_kernel_alignment = functools.partial(
    LargeReserveTrustsTheKernelAlignment, "broken-large-reserve-trusts-the-kernel-alignment"
)
reserve_keeps_the_tail_until_free = functools.partial(
    ReserveKeepsTheTailUntilFree, "broken-reserve-keeps-the-tail-until-free"
)
freed_address_stays_refused = functools.partial(FreedAddressStaysRefused, "broken-freed-address-stays-refused")
memfd_rounds_up_to_a_power_of_two = functools.partial(
    MemfdRoundsUpToAPowerOfTwo, "broken-memfd-rounds-up-to-a-power-of-two"
)
create_past_total_is_not_out_of_memory = functools.partial(
    CreatePastTotalIsNotOutOfMemory, "broken-create-past-total-is-not-out-of-memory"
)
release_is_a_refcount = functools.partial(ReleaseIsARefcount, "broken-release-is-a-refcount")
unmap_subtracts_the_handle_size = functools.partial(
    UnmapSubtractsTheHandleSize, "broken-unmap-subtracts-the-handle-size"
)
overlap_index_drops_the_neighbour = functools.partial(
    OverlapIndexDropsTheNeighbour, "broken-overlap-index-drops-the-neighbour"
)
merges_contiguous_mappings = functools.partial(MergesContiguousMappings, "broken-merges-contiguous-mappings")
set_access_refuses_the_middle_of_a_mapping = functools.partial(
    SetAccessRefusesTheMiddleOfAMapping, "broken-set-access-refuses-the-middle-of-a-mapping"
)
set_access_forgets_to_clip = functools.partial(SetAccessForgetsToClip, "broken-set-access-forgets-to-clip")
accessible_refuses_high_addresses = functools.partial(
    AccessibleRefusesHighAddresses, "broken-accessible-refuses-high-addresses"
)
set_access_mprotects_unlocked = functools.partial(SetAccessMprotectsUnlocked, "broken-set-access-mprotects-unlocked")
tensor_rounds_down_an_odd_base = functools.partial(TensorRoundsDownAnOddBase, "broken-tensor-rounds-down-an-odd-base")

CASES: dict[str, Case] = {
    "map_takes_a_bool_offset": Case(
        map_takes_a_bool_offset, "P-bad-value", prove_map_takes_a_bool_offset, "DriverError(map)"
    ),
    "gap_refusal_names_nothing": Case(
        gap_refusal_names_nothing, "P-refusal-names", prove_gap_refusal_names_nothing, ("DriverError(set_access)", True)
    ),
    "free_of_a_mapped_reservation_names_unmap": Case(
        free_of_a_mapped_reservation_names_unmap,
        "P-refusal",
        prove_free_of_a_mapped_reservation_names_unmap,
        "DriverError(free)",
    ),
    "refused_free_forgets_the_reservation": Case(
        refused_free_forgets_the_reservation,
        "P-refusal-unchanged",
        prove_refused_free_forgets_the_reservation,
        ["DriverError(free)", "done"],
    ),
    "large_reserve_trusts_the_kernel_alignment": Case(
        large_reserve_trusts_the_kernel_alignment,
        "P-reserve-aligned",
        prove_large_reserve_trusts_the_kernel_alignment,
        0,
    ),
    "reserve_keeps_the_tail_until_free": Case(
        reserve_keeps_the_tail_until_free, "P-reserve-kernel", prove_reserve_keeps_the_tail_until_free, 0
    ),
    "freed_address_stays_refused": Case(
        freed_address_stays_refused, "P-map-inside", prove_freed_address_stays_refused, "done"
    ),
    "memfd_rounds_up_to_a_power_of_two": Case(
        memfd_rounds_up_to_a_power_of_two, "P-create-memory", prove_memfd_rounds_up_to_a_power_of_two, 3
    ),
    "create_past_total_is_not_out_of_memory": Case(
        create_past_total_is_not_out_of_memory,
        "P-create-oom",
        prove_create_past_total_is_not_out_of_memory,
        "DriverOutOfMemory(create)",
    ),
    "release_is_a_refcount": Case(
        release_is_a_refcount, "P-release-once", prove_release_is_a_refcount, "DriverError(release)"
    ),
    "unmap_subtracts_the_handle_size": Case(
        unmap_subtracts_the_handle_size, "P-mem-exact", prove_unmap_subtracts_the_handle_size, (BUDGET - 2 * _G, BUDGET)
    ),
    "overlap_index_drops_the_neighbour": Case(
        overlap_index_drops_the_neighbour, "P-map-overlap", prove_overlap_index_drops_the_neighbour, "DriverError(map)"
    ),
    "merges_contiguous_mappings": Case(merges_contiguous_mappings, "P-unmap", prove_merges_contiguous_mappings, "done"),
    "set_access_refuses_the_middle_of_a_mapping": Case(
        set_access_refuses_the_middle_of_a_mapping,
        "P-access",
        prove_set_access_refuses_the_middle_of_a_mapping,
        ["done", "done"],
    ),
    "set_access_forgets_to_clip": Case(
        set_access_forgets_to_clip, "P-access-refused", prove_set_access_forgets_to_clip, "DriverError(set_access)"
    ),
    "accessible_refuses_high_addresses": Case(
        accessible_refuses_high_addresses, "P-accessible", prove_accessible_refuses_high_addresses, False
    ),
    "set_access_mprotects_unlocked": Case(
        set_access_mprotects_unlocked, "P-threads", prove_set_access_mprotects_unlocked, False
    ),
    "tensor_rounds_down_an_odd_base": Case(
        tensor_rounds_down_an_odd_base, "P-tensor", prove_tensor_rounds_down_an_odd_base, 0
    ),
}
