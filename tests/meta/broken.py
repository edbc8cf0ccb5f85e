"""Deliberately broken host drivers: each breaks one promise, and the suite must catch each one.

Use them as ``--driver tests.meta.broken:<factory>``. They exist only to prove that the conformance rules can
fail; each class says which promise it breaks.
"""

from __future__ import annotations

import functools
import os

import torch

from extensible_kv.drivers.host import (
    MAP_ANONYMOUS,
    MAP_FIXED,
    MAP_NORESERVE,
    MAP_PRIVATE,
    MAP_SHARED,
    MEMFD_NAME,
    PROT_NONE,
    PROT_READ,
    PROT_WRITE,
    MIB,
    HostDriver,
    HostHandle,
    libc,
)
from extensible_kv.errors import DriverError


class _Broken(HostDriver):
    def __init__(self, name: str) -> None:
        super().__init__(name=name, budget_bytes=1 << 30)  # the registered host drivers' budget


class NoZero(_Broken):
    """zero() does nothing: fresh pages keep their garbage."""

    def zero(self, va: int, size: int) -> None:
        pass


class MovingBase(_Broken):
    """tensor() hands out fresh memory elsewhere, so addresses seen by callers move and writes go nowhere."""

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


class NonLockstep(_Broken):
    """map() silently skips the upper half of every reservation: later segments never get physical pages.

    set_access then makes the skipped range readable anonymous memory, so data round-trips and only the driver's
    own state (``accessible``) shows that the pages are not the mapped ones.
    """

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        for r_va, r_size in self.reservations.items():
            if r_va <= va < r_va + r_size and va >= r_va + r_size // 2:
                self.mappings[va] = (size, handle)
                return
        super().map(va, size, handle, offset)


class DoubleMap(_Broken):
    """map() replaces whatever is mapped at the address, as raw MAP_FIXED does, instead of refusing."""

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        got = libc().mmap(va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, handle.fd, offset)
        assert got == va
        for m_va in [m for m, (s, _) in self.mappings.items() if m < va + size and va < m + s]:
            del self.mappings[m_va]
        self.mappings[va] = (size, handle)


class NoRollback(_Broken):
    """unmap() forgets the mapping but leaves the pages mapped and accessible (free()'s munmap drops them with the
    reservation)."""

    def unmap(self, va: int, size: int) -> None:
        if self.mappings.get(va, (None,))[0] != size:
            super().unmap(va, size)  # keeps the sub-range refusal
        del self.mappings[va]


class ZeroInLines(_Broken):
    """zero() widens the range to whole 256-byte lines, erasing the committed bytes around it."""

    def zero(self, va: int, size: int) -> None:
        lo, hi = va // 256 * 256, -(-(va + size) // 256) * 256
        super().zero(lo, hi - lo)


class ZeroStopsAt16MiB(_Broken):
    """zero() clears at most 16 MiB."""

    def zero(self, va: int, size: int) -> None:
        super().zero(va, min(size, 16 * MIB))


class TensorCopiesLarge(_Broken):
    """tensor() returns a copy of the bytes for views over 16 MiB."""

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        view = super().tensor(va, nbytes, keeper)
        return view.clone() if nbytes > 16 * MIB else view


class TensorDropsKeeper(_Broken):
    """tensor() does not keep its keeper alive."""

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        return super().tensor(va, nbytes, None)


class MapIgnoresOffset(_Broken):
    """map() always maps the handle from its first byte."""

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        super().map(va, size, handle, 0)


class MapPrivate(_Broken):
    """map() maps a private copy-on-write copy of the handle (MAP_PRIVATE): writes stay in this mapping."""

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        super().map(va, size, handle, offset)
        got = libc().mmap(va, size, PROT_NONE, MAP_PRIVATE | MAP_FIXED, handle.fd, offset)
        assert got == va


class MapGrantsAccess(_Broken):
    """map() alone makes the range readable and writable."""

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        super().map(va, size, handle, offset)
        libc().mprotect(va, size, PROT_READ | PROT_WRITE)


class MapClampsToReservation(_Broken):
    """map() of a range running past its reservation's end maps the part that fits instead of refusing."""

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        for r_va, r_size in self.reservations.items():
            if r_va <= va < r_va + r_size:
                size = min(size, r_va + r_size - va)
        super().map(va, size, handle, offset)


class MapRefusesAfterMapping(_Broken):
    """map() of a range running past its reservation's end maps the part inside first, then refuses."""

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        for r_va, r_size in self.reservations.items():
            if r_va <= va < r_va + r_size < va + size:
                libc().mmap(va, r_va + r_size - va, PROT_NONE, MAP_SHARED | MAP_FIXED, handle.fd, offset)
        super().map(va, size, handle, offset)


class OverlapFromBelow(_Broken):
    """map() refuses only a range that starts inside a live mapping; one that runs into a mapping from below
    replaces its first granules."""

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        if any(m <= va < m + s for m, (s, _) in self.mappings.items()):
            raise DriverError("map", f"{va:#x} lies in a live mapping")
        saved = dict(self.mappings)
        self.mappings.clear()
        try:
            super().map(va, size, handle, offset)
        finally:
            self.mappings.update(saved)


class RecordsOnly(_Broken):
    """map() keeps its records but leaves the kernel's range reserved, and accessible() answers from the records:
    set_access opens the reserved anonymous pages, so bytes round-trip while the kernel maps no memfd at all."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._granted: set[int] = set()

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        super().map(va, size, handle, offset)
        libc().mmap(va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0)

    def set_access(self, va: int, size: int) -> None:
        super().set_access(va, size)
        self._granted.update(range(va, va + size, self.granularity()))

    def unmap(self, va: int, size: int) -> None:
        super().unmap(va, size)
        self._granted.difference_update(range(va, va + size, self.granularity()))

    def accessible(self, va: int) -> bool:
        return va // self.granularity() * self.granularity() in self._granted


class UnmapAcceptsAPrefix(_Broken):
    """unmap() of the first part of a mapping unmaps that part and keeps the rest as a mapping."""

    def unmap(self, va: int, size: int) -> None:
        live = self.mappings.get(va)
        if live is not None and size < live[0]:
            self.mappings[va] = (size, live[1])
            self.mappings[va + size] = (live[0] - size, live[1])
            live[1].maps += 1
        super().unmap(va, size)


class UnmapRefusesAfterUnmapping(_Broken):
    """unmap() returns the range to reserved first, then refuses a range that is not exactly one mapping."""

    def unmap(self, va: int, size: int) -> None:
        libc().mmap(va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0)
        super().unmap(va, size)


class SetAccessOnPartlyMapped(_Broken):
    """set_access() opens any range, mapped or not."""

    def set_access(self, va: int, size: int) -> None:
        libc().mprotect(va, size, PROT_READ | PROT_WRITE)


class SetAccessRefusesAfterOpening(_Broken):
    """set_access() opens the range first, then refuses one that is not fully mapped."""

    def set_access(self, va: int, size: int) -> None:
        libc().mprotect(va, size, PROT_READ | PROT_WRITE)
        super().set_access(va, size)


class FreeWithMappings(_Broken):
    """free() of a reservation with live mappings frees it (and the mappings' address range) instead of refusing."""

    def free(self, va: int, size: int) -> None:
        for m in [m for m in self.mappings if va <= m < va + size]:
            _, handle = self.mappings.pop(m)
            handle.maps -= 1
            self.drop_if_unused(handle)
        super().free(va, size)


class FreeOfASubrange(_Broken):
    """free() takes any range that starts at a reservation, releasing only that part."""

    def free(self, va: int, size: int) -> None:
        if va in self.reservations and size < self.reservations[va]:
            self.reservations[va + size] = self.reservations[va] - size
            self.reservations[va] = size
        super().free(va, size)


class FreeKeepsTheRange(_Broken):
    """free() forgets the reservation but never returns the address range to the kernel."""

    def free(self, va: int, size: int) -> None:
        self.check_call("free", va=va, size=size)
        if self.reservations.get(va) != size or any(va <= m < va + size for m in self.mappings):
            raise DriverError("free", f"[{va:#x}, +{size}) is not one empty reservation")
        del self.reservations[va]


class ReserveIgnoresAlignment(_Broken):
    """reserve() aligns to the granularity only, whatever alignment is asked."""

    def reserve(self, size: int, alignment: int) -> int:
        g = self.granularity()
        va = super().reserve(size + g, 2 * g)
        libc().munmap(va, g)
        del self.reservations[va]
        self.reservations[va + g] = size
        return va + g


class ReserveAccessible(_Broken):
    """reserve() makes the reserved range readable and writable anonymous memory."""

    def reserve(self, size: int, alignment: int) -> int:
        va = super().reserve(size, alignment)
        libc().mprotect(va, size, PROT_READ | PROT_WRITE)
        return va


class ReleaseKeepsMemory(_Broken):
    """release() of a handle mapped nowhere never returns its bytes to mem_info()."""

    def release(self, handle: HostHandle) -> None:
        handle.maps += 1
        try:
            super().release(handle)
        finally:
            handle.maps -= 1


class UnmapKeepsMemory(_Broken):
    """unmap() does not drop the mapping's hold on the handle: its bytes never come back to mem_info()."""

    def unmap(self, va: int, size: int) -> None:
        live = self.mappings.get(va)
        super().unmap(va, size)
        if live is not None:
            self.held += live[1].size if live[1].released and live[1].maps == 0 else 0


class ReleaseKeepsTheMemfd(_Broken):
    """release() accounts the bytes as returned but keeps the memfd open: mem_info() says free, the kernel holds."""

    def release(self, handle: HostHandle) -> None:
        handle.fd = os.dup(handle.fd)
        super().release(handle)


class BudgetIgnored(_Broken):
    """create() never runs out: the budget is not enforced."""

    def create(self, size: int) -> HostHandle:
        self.total += size
        try:
            return super().create(size)
        finally:
            self.total -= size


class CreateLeaksWhenRefused(_Broken):
    """create() past the budget makes the memfd first and leaves it open when it refuses."""

    def create(self, size: int) -> HostHandle:
        if self.held + size > self.total:
            fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        return super().create(size)


def no_zero() -> NoZero:
    return NoZero("broken-no-zero")


def moving_base() -> MovingBase:
    return MovingBase("broken-moving-base")


def non_lockstep() -> NonLockstep:
    return NonLockstep("broken-non-lockstep")


def double_map() -> DoubleMap:
    return DoubleMap("broken-double-map")


def no_rollback() -> NoRollback:
    return NoRollback("broken-no-rollback")


zero_in_lines = functools.partial(ZeroInLines, "broken-zero-in-lines")
zero_stops_at_16_mib = functools.partial(ZeroStopsAt16MiB, "broken-zero-stops-at-16-mib")
tensor_copies_large = functools.partial(TensorCopiesLarge, "broken-tensor-copies-large")
tensor_drops_keeper = functools.partial(TensorDropsKeeper, "broken-tensor-drops-keeper")
map_ignores_offset = functools.partial(MapIgnoresOffset, "broken-map-ignores-offset")
map_private = functools.partial(MapPrivate, "broken-map-private")
map_grants_access = functools.partial(MapGrantsAccess, "broken-map-grants-access")
map_clamps_to_reservation = functools.partial(MapClampsToReservation, "broken-map-clamps-to-reservation")
map_refuses_after_mapping = functools.partial(MapRefusesAfterMapping, "broken-map-refuses-after-mapping")
overlap_from_below = functools.partial(OverlapFromBelow, "broken-overlap-from-below")
records_only = functools.partial(RecordsOnly, "broken-records-only")
unmap_accepts_a_prefix = functools.partial(UnmapAcceptsAPrefix, "broken-unmap-accepts-a-prefix")
unmap_refuses_after_unmapping = functools.partial(UnmapRefusesAfterUnmapping, "broken-unmap-refuses-after-unmapping")
set_access_on_partly_mapped = functools.partial(SetAccessOnPartlyMapped, "broken-set-access-on-partly-mapped")
set_access_refuses_after_opening = functools.partial(
    SetAccessRefusesAfterOpening, "broken-set-access-refuses-after-opening"
)
free_with_mappings = functools.partial(FreeWithMappings, "broken-free-with-mappings")
free_of_a_subrange = functools.partial(FreeOfASubrange, "broken-free-of-a-subrange")
free_keeps_the_range = functools.partial(FreeKeepsTheRange, "broken-free-keeps-the-range")
reserve_ignores_alignment = functools.partial(ReserveIgnoresAlignment, "broken-reserve-ignores-alignment")
reserve_accessible = functools.partial(ReserveAccessible, "broken-reserve-accessible")
release_keeps_memory = functools.partial(ReleaseKeepsMemory, "broken-release-keeps-memory")
unmap_keeps_memory = functools.partial(UnmapKeepsMemory, "broken-unmap-keeps-memory")
release_keeps_the_memfd = functools.partial(ReleaseKeepsTheMemfd, "broken-release-keeps-the-memfd")
budget_ignored = functools.partial(BudgetIgnored, "broken-budget-ignored")
create_leaks_when_refused = functools.partial(CreateLeaksWhenRefused, "broken-create-leaks-when-refused")
