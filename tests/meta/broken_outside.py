"""A second set of deliberately broken host drivers, written from the protocol's text (``drivers/_protocol.py``) by a
reader outside the rules: one who knew the protocol and the host driver, not the model or the rules that check them.

The set follows ``tests.meta.broken_protocol`` and shares its ``Case``, its helpers and Note [A proof drives both
drivers]: each class breaks one sentence or clause of the protocol, quoted with its id in the class docstring, the way
a backend's own bug might, and comes with a proof that drives a driver built by the factory it is given and returns
what it observed; ``CASES`` pairs every factory with the area it breaks, its proof and what the intact host driver
observes. Use a driver as ``extensible-kv check-driver tests.meta.broken_outside:<factory>``.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import functools
import gc
import mmap
import tempfile
import time
import weakref
from collections.abc import Callable

import torch

from extensible_kv.drivers.host import MAP_SHARED, MAP_FIXED, PROT_NONE, HostDriver, HostHandle, libc
from extensible_kv.drivers.records import check_inside, check_no_overlap
from extensible_kv.errors import DriverError, DriverOutOfMemory
from extensible_kv.reaper import busy
from tests.meta.broken_protocol import (
    _G,
    BUDGET,
    GIB,
    RACE_TRIES,
    RACE_WINDOW_S,
    Case,
    _Broken,
    _race,
    kernel_ranges,
    outcome,
    prove_create_failure_is_typed,
    tidy,
)


# -- memory accounting -----------------------------------------------------------------------------------------------
class CreateRefusesAnExactFit(_Broken):
    """Memory accounting. Breaks "[P-create-oom] When memory is short (more than the free bytes on the host ...):
    ``DriverOutOfMemory`` naming ``create``": it counts a create of exactly the free bytes as short, and refuses it."""

    def charge(self, size: int, counted: list[int]) -> None:
        if size > 0 and self.held + size == self.total:
            raise DriverOutOfMemory("create", f"{size} bytes asked, {self.total - self.held} free", errno.ENOMEM)
        super().charge(size, counted)


def prove_create_refuses_an_exact_fit(make: Callable[[], HostDriver]) -> str:
    """The outcome of a create of exactly the free bytes, with one granule held already."""
    d = make()
    held = d.create(d.granularity())
    made: list[HostHandle] = []
    try:
        return outcome(lambda: made.append(d.create(d.mem_info()[0])))
    finally:
        tidy(d, [], [held, *made])


class ReleaseReturnsWithOneMappingLeft(_Broken):
    """Memory accounting. Breaks "[P-release-mapped] Drop the creation reference of ``handle``; memory that is still
    mapped stays alive, with its bytes, until unmapped everywhere": it counts a released handle's bytes free once it is
    mapped at one address or none, so they are free while its last mapping lives."""

    def drop_if_unused(self, handle: HostHandle) -> None:
        if handle.released and handle.maps <= 1 and handle.counted:
            self.held, handle.counted = self.held - handle.size, False


def prove_release_returns_with_one_mapping_left(make: Callable[[], HostDriver]) -> tuple[int, int]:
    """``mem_info`` after a handle mapped at one address was released."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.release(h)
        return d.mem_info()
    finally:
        tidy(d, [(r, g)], [h])


# -- two threads calling one driver ----------------------------------------------------------------------------------
class ReleaseReadsMapsOutsideTheLock(_Broken):
    """Two threads. Breaks "[P-threads] ... each takes effect whole, so what every call returned, and the state the
    driver is left in, are those of some serial order of the calls": ``release`` reads how often the handle is mapped
    before it takes its lock, so when the handle's last unmap runs in between, the unmap sees the handle unreleased,
    the release sees it mapped, and neither gives its bytes back."""

    def release(self, handle: HostHandle) -> None:
        self.check_call("release")
        seen = handle.maps
        time.sleep(RACE_WINDOW_S)
        with busy(), self.locked():
            maps, handle.maps = handle.maps, seen  # the release decides on what it read before the lock
            try:
                self.do_release(handle)
            finally:
                handle.maps = maps


def prove_release_reads_maps_outside_the_lock(make: Callable[[], HostDriver]) -> tuple[int, int]:
    """``mem_info`` after a mapped handle was unmapped and released from two threads at once, until the bytes are lost
    or ``RACE_TRIES`` times."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    try:
        for _ in range(RACE_TRIES):
            h = d.create(g)
            d.map(r, g, h)
            _race(lambda i, h=h: d.unmap(r, g) if i == 0 else d.release(h))
            if d.mem_info() != (BUDGET, BUDGET):
                break
        return d.mem_info()
    finally:
        tidy(d, [(r, g)], [])


# -- address space ---------------------------------------------------------------------------------------------------
class ReserveCapsTheAlignment(_Broken):
    """Address space. Breaks "[P-reserve-aligned] Reserve ``size`` bytes of virtual addresses and return the first, a
    multiple of ``alignment`` (the granularity times a power of two: 1, 2 or 64 granules and more)": to bound the
    address space it over-reserves, it caps the alignment at 64 granules, and a larger one is not honoured."""

    def reserve(self, size: int, alignment: int) -> int:
        return super().reserve(size, min(alignment, 64 * self.granularity()))


def prove_reserve_caps_the_alignment(make: Callable[[], HostDriver]) -> bool:
    """Whether any of sixteen reservations of one granule aligned to 1 GiB, alive at once (sixteen different
    addresses: a capped alignment lands on a multiple of 1 GiB by chance one time in eight), is not aligned to it."""
    d = make()
    g = d.granularity()
    vas = [d.reserve(g, GIB) for _ in range(16)]
    for va in vas:
        d.free(va, g)
    return any(va % GIB for va in vas)


# -- access state ----------------------------------------------------------------------------------------------------
class AccessibleAnyNamedReadWrite(_Broken):
    """Access state. Breaks "[P-accessible] Whether the granule at ``va`` (any address in it, also one outside every
    reservation) is mapped and readable/writable": it asks the kernel for a read-write mapping with a path but not for
    one of its own memfds, so a file, the heap or the stack outside every reservation reads as accessible."""

    def accessible(self, va: int) -> bool:
        self.check_call("accessible", va=va)
        return any(lo <= va < hi and perms.startswith("rw") and path for lo, hi, perms, path in kernel_ranges())


def prove_accessible_any_named_read_write(make: Callable[[], HostDriver]) -> bool:
    """Whether the driver counts a byte of a shared read-write file mapping, made without it, as accessible."""
    d = make()
    with tempfile.TemporaryFile() as file:
        file.truncate(mmap.PAGESIZE)
        with mmap.mmap(file.fileno(), mmap.PAGESIZE) as mapped:
            byte = ctypes.c_uint8.from_buffer(mapped)
            va = ctypes.addressof(byte)
            del byte  # the mapping closes only once no buffer exports it
            return d.accessible(va)


class SetAccessWidensToMappings(_Broken):
    """Access state. Breaks "[P-access] ... Part of a mapping is granted by a driver whose native call takes it (the
    host's mprotect) and refused, changing nothing, by one whose native call takes whole mappings only
    (``cuMemSetAccess``); either way, the same for every call": it checks the range asked, then grants every mapping
    the range touches whole, so granules outside the range become accessible."""

    def set_access(self, va: int, size: int) -> None:
        super().set_access(va, size)
        with busy(), self.locked():
            touched = [(m, s) for m, (s, _) in self.mappings.items() if m < va + size and va < m + s]
        lo, hi = min(m for m, _ in touched), max(m + s for m, s in touched)
        super().set_access(lo, hi - lo)


def prove_set_access_widens_to_mappings(make: Callable[[], HostDriver]) -> list[bool]:
    """Accessible granules of a mapping of 2 granules after ``set_access`` of its first."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(2 * g)
    try:
        d.map(r, 2 * g, h)
        d.set_access(r, g)
        return [d.accessible(r), d.accessible(r + g)]
    finally:
        tidy(d, [(r, 2 * g)], [h])


# -- refusals --------------------------------------------------------------------------------------------------------
class UnmapLooksUpTheOwner(_Broken):
    """Refusals. Breaks "[P-refusal] Every refusal the protocol names raises ``DriverError`` whose ``operation`` is
    the method called": ``unmap`` first looks up the reservation that holds ``va`` (for its message) among the
    reservations' starts, and with no live reservation the lookup raises ``IndexError`` where P-unmap-refused wants
    a ``DriverError``."""

    def unmap(self, va: int, size: int) -> None:
        starts = sorted(self.reservations)
        owner = starts[bisect.bisect_right(starts, va) - 1]  # IndexError when no reservation is live
        try:
            super().unmap(va, size)
        except DriverError as exc:
            raise DriverError("unmap", f"{exc.detail} in the reservation at {owner:#x}", exc.code) from exc


def prove_unmap_looks_up_the_owner(make: Callable[[], HostDriver]) -> str:
    """The outcome of an unmap of a freed reservation, the driver's only one."""
    d = make()
    g = d.granularity()
    va = d.reserve(g, g)
    d.free(va, g)
    return outcome(d.unmap, va, g)


class MapCountsBeforeTheHandleChecks(_Broken):
    """Refusals. Breaks "[P-refusal-unchanged] A refused call leaves every observable as it was: ... ``mem_info``":
    ``map`` counts the new mapping on the handle before it checks the handle (released, ``offset + size`` past its
    end) and keeps the count when those checks refuse, so a released handle whose map was refused never gives its
    bytes back."""

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        check_inside("map", va, size, self.reservations.items())
        check_no_overlap(va, size, ((m, s) for m, (s, _) in self.mappings.items()))
        handle.maps += 1
        if handle.released or offset + size > handle.size:
            raise DriverError("map", f"{handle!r} is released or too small for offset {offset} + size {size}")
        handle.maps -= 1  # the host's map counts it
        super().do_map(va, size, handle, offset)


def prove_map_counts_before_the_handle_checks(make: Callable[[], HostDriver]) -> tuple[str, tuple[int, int]]:
    """The outcome of mapping a released handle still mapped elsewhere, and ``mem_info`` once that mapping is gone."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.release(h)
        refused = outcome(d.map, r + g, g, h)
        d.unmap(r, g)
        return refused, d.mem_info()
    finally:
        tidy(d, [(r, 2 * g)], [h])


class MapHandleEndForgetsTheOffset(_Broken):
    """Refusals. Breaks "Refused, changing nothing: ... [P-map-handle-end] ``offset + size`` past the handle's end":
    it checks ``size`` alone against the handle's size, so a mapping at an offset that runs past the handle's end is
    made (touching its tail raises SIGBUS)."""

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        past_the_end = offset + size > handle.size >= size
        super().do_map(va, size, handle, 0 if past_the_end else offset)
        if past_the_end and libc().mmap(va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, handle.fd, offset) != va:
            self.fail("map", f"mmap(MAP_FIXED, {va:#x}, {size}, fd={handle.fd}, offset={offset})")


def prove_map_handle_end_forgets_the_offset(make: Callable[[], HostDriver]) -> str:
    """The outcome of mapping a handle of 2 granules at offset 1 granule, 2 granules long."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(2 * g)
    try:
        return outcome(d.map, r, 2 * g, h, g)
    finally:
        tidy(d, [(r, 2 * g)], [h])


# -- native failures -------------------------------------------------------------------------------------------------
class CreateFailureKeepsTheCount(_Broken):
    """Native failures. Breaks "[P-native-failure] A native call that fails raises ``DriverError`` naming the
    operation ... and changes nothing": when ``memfd_create`` fails, ``create`` raises the right error but keeps the
    bytes it counted as held."""

    def create(self, size: int) -> HostHandle:
        self.check_call("create", size=size)
        with busy(), self.locked():
            self.charge(size, [0])
        return self.do_create(size)


def prove_create_failure_keeps_the_count(make: Callable[[], HostDriver]) -> tuple[str, tuple[int, int]]:
    """The error of ``create`` while the process may open no more file descriptors, and ``mem_info`` after it."""
    d = make()
    return prove_create_failure_is_typed(lambda: d), d.mem_info()


# -- contents and tensors --------------------------------------------------------------------------------------------
class ZeroHeadOffByOne(_Broken):
    """Contents. Breaks "[P-zero] Set exactly the bytes ``[va, va+size)`` to zero ...: any start and size (no
    alignment ...)": it zeros the head of an unaligned range up to the next multiple of 8 from its second byte, so
    the first byte keeps its value."""

    def zero(self, va: int, size: int) -> None:
        self.check_call("zero", va=va, size=size)
        head = -va % 8
        if head and size > head:
            ctypes.memset(va + 1, 0, head - 1)
            ctypes.memset(va + head, 0, size - head)
        else:
            ctypes.memset(va, 0, size)


def prove_zero_head_off_by_one(make: Callable[[], HostDriver]) -> list[int]:
    """The first 48 bytes of a granule of 0xFF after ``zero`` of its bytes 3 to 42."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.set_access(r, g)
        t = d.tensor(r, 64, None)
        t.fill_(0xFF)
        d.zero(r + 3, 40)
        d.synchronize()
        return t[:48].tolist()
    finally:
        tidy(d, [(r, g)], [h])


class TensorKeeperOnTheTensor(_Broken):
    """Tensors. Breaks "[P-tensor-keeper] Its storage holds a strong reference to ``keeper`` until the storage is
    freed": it holds the keeper on the tensor it returns, not on its storage, so the keeper goes with that tensor while
    a view keeps the storage (and the memory) in use."""

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        t = super().tensor(va, nbytes, None)
        t.keeper = keeper
        return t


class _Keeper:
    pass


def prove_tensor_keeper_on_the_tensor(make: Callable[[], HostDriver]) -> bool:
    """Whether a tensor's keeper lives while only a view of the tensor does."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.set_access(r, g)
        keeper = _Keeper()
        kept = weakref.ref(keeper)
        t = d.tensor(r, 64, keeper)
        view = t.view(torch.int8)
        del t, keeper
        gc.collect()
        alive = kept() is not None
        del view
        return alive
    finally:
        tidy(d, [(r, g)], [h])


# -- the factories and the cases -------------------------------------------------------------------------------------
create_refuses_an_exact_fit = functools.partial(CreateRefusesAnExactFit, "broken-create-refuses-an-exact-fit")
release_returns_with_one_mapping_left = functools.partial(
    ReleaseReturnsWithOneMappingLeft, "broken-release-returns-with-one-mapping-left"
)
release_reads_maps_outside_the_lock = functools.partial(
    ReleaseReadsMapsOutsideTheLock, "broken-release-reads-maps-outside-the-lock"
)
reserve_caps_the_alignment = functools.partial(ReserveCapsTheAlignment, "broken-reserve-caps-the-alignment")
accessible_any_named_read_write = functools.partial(
    AccessibleAnyNamedReadWrite, "broken-accessible-any-named-read-write"
)
set_access_widens_to_mappings = functools.partial(SetAccessWidensToMappings, "broken-set-access-widens-to-mappings")
unmap_looks_up_the_owner = functools.partial(UnmapLooksUpTheOwner, "broken-unmap-looks-up-the-owner")
map_counts_before_the_handle_checks = functools.partial(
    MapCountsBeforeTheHandleChecks, "broken-map-counts-before-the-handle-checks"
)
map_handle_end_forgets_the_offset = functools.partial(
    MapHandleEndForgetsTheOffset, "broken-map-handle-end-forgets-the-offset"
)
create_failure_keeps_the_count = functools.partial(CreateFailureKeepsTheCount, "broken-create-failure-keeps-the-count")
zero_head_off_by_one = functools.partial(ZeroHeadOffByOne, "broken-zero-head-off-by-one")
tensor_keeper_on_the_tensor = functools.partial(TensorKeeperOnTheTensor, "broken-tensor-keeper-on-the-tensor")

CASES: dict[str, Case] = {
    "create_refuses_an_exact_fit": Case(
        create_refuses_an_exact_fit, "memory accounting", prove_create_refuses_an_exact_fit, "done"
    ),
    "release_returns_with_one_mapping_left": Case(
        release_returns_with_one_mapping_left,
        "memory accounting",
        prove_release_returns_with_one_mapping_left,
        (BUDGET - _G, BUDGET),
    ),
    "release_reads_maps_outside_the_lock": Case(
        release_reads_maps_outside_the_lock, "two threads", prove_release_reads_maps_outside_the_lock, (BUDGET, BUDGET)
    ),
    "reserve_caps_the_alignment": Case(
        reserve_caps_the_alignment, "address space", prove_reserve_caps_the_alignment, False
    ),
    "accessible_any_named_read_write": Case(
        accessible_any_named_read_write, "access state", prove_accessible_any_named_read_write, False
    ),
    "set_access_widens_to_mappings": Case(
        set_access_widens_to_mappings, "access state", prove_set_access_widens_to_mappings, [True, False]
    ),
    "unmap_looks_up_the_owner": Case(
        unmap_looks_up_the_owner, "refusals", prove_unmap_looks_up_the_owner, "DriverError(unmap)"
    ),
    "map_counts_before_the_handle_checks": Case(
        map_counts_before_the_handle_checks,
        "refusals",
        prove_map_counts_before_the_handle_checks,
        ("DriverError(map)", (BUDGET, BUDGET)),
    ),
    "map_handle_end_forgets_the_offset": Case(
        map_handle_end_forgets_the_offset, "refusals", prove_map_handle_end_forgets_the_offset, "DriverError(map)"
    ),
    "create_failure_keeps_the_count": Case(
        create_failure_keeps_the_count,
        "native failures",
        prove_create_failure_keeps_the_count,
        ("DriverError(create)", (BUDGET, BUDGET)),
    ),
    "zero_head_off_by_one": Case(
        zero_head_off_by_one, "contents", prove_zero_head_off_by_one, [0xFF] * 3 + [0] * 40 + [0xFF] * 5
    ),
    "tensor_keeper_on_the_tensor": Case(
        tensor_keeper_on_the_tensor, "tensors", prove_tensor_keeper_on_the_tensor, True
    ),
}
