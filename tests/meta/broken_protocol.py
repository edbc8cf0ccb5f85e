"""Deliberately broken host drivers written from the protocol's text (``drivers/_protocol.py``) alone.

Each class breaks one sentence or clause of the protocol, quoted in its docstring, and comes with a proof: a function
that takes a zero-argument driver factory, drives the driver with the calls that show the break, and returns what
it observed. ``CASES`` pairs every factory with its proof and with what the protocol says the proof must observe:
the intact host driver observes exactly that, the broken one something else (see Note [A proof drives both
drivers]). Use a driver as ``extensible-kv check-driver tests.meta.broken_protocol:<factory>``.

Note [A proof drives both drivers]
    A broken driver proves nothing unless its break is real on this machine: a subclass that overrides a method
    may still behave like the intact driver (the override never runs, the kernel does the same thing either way,
    a race never lands). So every proof makes the same calls on a driver built by the factory it is given and
    returns an observable: accessible granules, the outcome of a call (``done`` or the error's type and the
    operation it names), ``mem_info``, the bytes the kernel holds. The meta test runs each proof on the intact
    ``HostDriver`` (same granularity and budget) and on the broken one: the intact one must observe what the
    protocol says (``Case.want``), the broken one must not. Races are widened inside the broken driver (a sleep in
    the window between its check and its act) and the proof repeats the racing calls until the difference shows,
    up to a few hundred tries, so the intact driver is tried as often. Proofs clean up what they made, also on a
    broken driver, best effort: a broken driver's records may not allow it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import gc
import itertools
import os
import resource
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from extensible_kv.drivers.records import (
    check_alignment,
    check_free,
    check_inside,
    check_no_overlap,
    check_one_mapping,
    mapped_parts,
)
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
from extensible_kv.errors import DriverError, DriverOutOfMemory
from extensible_kv.reaper import busy

BUDGET = 1 << 30
"""The budget of every driver here, broken or intact: the registered host drivers' budget."""

GIB = 1 << 30
RACE_WINDOW_S = 1e-4
"""How long a racing broken driver sleeps between its check and its act, so a race lands in a few hundred tries."""
RACE_TRIES = 300


class _Broken(HostDriver):
    def __init__(self, name: str) -> None:
        super().__init__(name=name, budget_bytes=BUDGET)


def intact() -> HostDriver:
    """The intact host driver, with the broken drivers' granularity and budget: what every proof is compared with."""
    return HostDriver(name="host", budget_bytes=BUDGET)


# -- what a proof observes -------------------------------------------------------------------------------------------
def outcome(call: Callable[..., Any], *args: Any) -> str:
    """``done``, or the type of the error ``call(*args)`` raised and the operation it names."""
    try:
        call(*args)
    except Exception as exc:  # noqa: BLE001 - an untyped error is exactly what some proofs look for
        return f"{type(exc).__name__}({getattr(exc, 'operation', '')})"
    return "done"


def vm_size() -> int:
    """The bytes of address space the process holds, as the kernel counts them against ``RLIMIT_AS``."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))


def prove_reserve_aligned_to_64_gib_with_1_gib_left(make: Callable[[], HostDriver]) -> str:
    """The outcome of a 4-granule reservation aligned to 64 GiB while the process may map at most 1 GiB more
    (``RLIMIT_AS`` lowered for the one call): the error, or whether the range returned is aligned (freed again)."""
    d = make()
    size, alignment = 4 * d.granularity(), 1 << 36
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + GIB, hard))
    try:
        va = d.reserve(size, alignment)
    except Exception as exc:  # noqa: BLE001 - the type is what the proof looks at
        return f"{type(exc).__name__}({getattr(exc, 'operation', '')})"
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    d.free(va, size)
    return "aligned" if va % alignment == 0 else "unaligned"


def kernel_ranges() -> list[tuple[int, int, str, str]]:
    """``(lo, hi, permissions, path)`` of every range the kernel maps in this process (``/proc/self/maps``)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi, fields[1], fields[5].strip() if len(fields) == 6 else ""))
    return ranges


def kernel_holds(lo: int, hi: int) -> int:
    """How many bytes of ``[lo, hi)`` the kernel maps (reserved or not)."""
    return sum(max(0, min(hi, r_hi) - max(lo, r_lo)) for r_lo, r_hi, _, _ in kernel_ranges())


def tidy(driver: HostDriver, reservations: list[tuple[int, int]], handles: list[HostHandle]) -> None:
    """Unmap, release and free what a proof made, best effort (a broken driver's records may refuse); a reservation
    the driver will not free is given back to the kernel directly."""
    for va, (size, _) in list(driver.mappings.items()):
        with contextlib.suppress(Exception):
            driver.unmap(va, size)
    for handle in handles:
        if not handle.released:
            with contextlib.suppress(Exception):
                driver.release(handle)
    for va, size in reservations:
        try:
            driver.free(va, size)
        except Exception:  # noqa: BLE001
            libc().munmap(va, size)


def _race(work: Callable[[int], None]) -> None:
    """Run ``work(0)`` and ``work(1)`` in two threads that start together; wait for both."""
    barrier = threading.Barrier(2)

    def run(i: int) -> None:
        barrier.wait()
        work(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


# -- pieces the later sets share ---------------------------------------------------------------------------------------
RESERVED = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED
"""The flags that put a range back to reserved (anonymous, no access), as the host's ``unmap`` does."""


def check_handle(handle: HostHandle, size: int, offset: int) -> None:
    """The host's refusals of ``map`` that look at the handle, in its order."""
    if handle.released:
        raise DriverError("map", f"{handle!r} was released; map a live handle")
    if offset + size > handle.size:
        raise DriverError("map", f"offset {offset} + size {size} exceeds the {handle.size}-byte handle")


def check_map(d: HostDriver, va: int, size: int, handle: HostHandle, offset: int) -> None:
    """The host's refusals of ``map``, in its order."""
    check_inside("map", va, size, d.reservations.items())
    check_no_overlap(va, size, ((m_va, m_size) for m_va, (m_size, _) in d.mappings.items()))
    check_handle(handle, size, offset)


def mmap_handle(d: HostDriver, va: int, size: int, handle: HostHandle, offset: int, flags: int = MAP_SHARED) -> None:
    """Record the mapping and mmap the handle's memfd at ``va`` with ``flags``, undone whole on any exception (the
    host's own)."""
    live = (size, handle)
    try:
        handle.maps, d.mappings[va] = handle.maps + 1, live
        if libc().mmap(va, size, PROT_NONE, flags | MAP_FIXED, handle.fd, offset) != va:
            d.fail("map", f"mmap(MAP_FIXED, {va:#x}, {size}, fd={handle.fd}, offset={offset})")
    except BaseException:
        if d.mappings.get(va) is live:
            libc().mmap(va, size, PROT_NONE, RESERVED, -1, 0)
            handle.maps, _ = handle.maps - 1, d.mappings.pop(va)
        raise


def read_byte(d: HostDriver, va: int) -> int:
    """The byte at ``va``, read through a one-byte tensor."""
    t = d.tensor(va, 1, None)
    value = int(t[0])
    del t
    return value


def poke(d: HostDriver, va: int, value: int) -> None:
    """Write ``value`` at ``va`` through a one-byte tensor."""
    t = d.tensor(va, 1, None)
    t[0] = value
    del t


def interrupt_at_line(d: HostDriver, nth: int, call: Callable[..., Any], *args: Any) -> bool:
    """Make ``call(*args)`` with a ``KeyboardInterrupt`` raised at the ``nth`` line that the driver's own methods run
    (a trace hook, between lines); whether it was raised. A broken driver interrupted as it leaves a multi-line
    ``with busy():`` keeps this thread's section (Note [Locked sections are one line] in ``reaper``): it is given
    back here, or every later sweep of the process (other tests' collected tensors) would be put off for good."""
    section = busy()
    outside = not section._is_owned()
    lines = [0]

    def on_line(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            lines[0] += 1
            if lines[0] == nth:
                raise KeyboardInterrupt
        return on_line

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        return on_line if frame.f_locals.get("self") is d else None

    sys.settrace(on_call)
    try:
        call(*args)
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
        while outside and section._is_owned():
            section.release()
    return False


# -- several mappings, many live mappings ----------------------------------------------------------------------------
class SetAccessFirstMappingOnly(_Broken):
    """Several mappings. Breaks "``set_access(va, size)`` makes a fully mapped range readable and writable": over a
    range made by several map calls it checks the whole range but grants only the mapping that starts at ``va``."""

    def set_access(self, va: int, size: int) -> None:
        with busy(), self.locked():
            mapped_parts(va, size, ((m, s) for m, (s, _) in self.mappings.items()))
            first = self.mappings.get(va)
        super().set_access(va, min(size, first[0]) if first else size)


def prove_set_access_first_mapping_only(make: Callable[[], HostDriver]) -> list[bool]:
    d = make()
    g = d.granularity()
    r = d.reserve(3 * g, g)
    h1, h2 = d.create(g), d.create(2 * g)
    try:
        d.map(r, g, h1)
        d.map(r + g, 2 * g, h2)
        d.set_access(r, 3 * g)
        return [d.accessible(r + i * g) for i in range(3)]
    finally:
        tidy(d, [(r, 3 * g)], [h1, h2])


class SetAccessChecksTheEndsOnly(_Broken):
    """Several mappings. Breaks "A range with any granule unmapped is refused" (a gap between mappings): it refuses
    only a range whose first or last granule is unmapped, and opens a gap between two mappings."""

    def set_access(self, va: int, size: int) -> None:
        self.check_call("set_access", va=va, size=size)
        g = self.granularity()
        with busy(), self.locked():
            ends = [a for a in (va, va + size - g) if not any(m <= a < m + s for m, (s, _) in self.mappings.items())]
        if ends:
            raise DriverError("set_access", f"[{va:#x}, +{size}) is not mapped at {ends[0]:#x}")
        if libc().mprotect(va, size, PROT_READ | PROT_WRITE) != 0:
            self.fail("set_access", f"mprotect({va:#x}, {size}, RW)")


def prove_set_access_checks_the_ends_only(make: Callable[[], HostDriver]) -> str:
    d = make()
    g = d.granularity()
    r = d.reserve(3 * g, g)
    h1, h2 = d.create(g), d.create(g)
    try:
        d.map(r, g, h1)
        d.map(r + 2 * g, g, h2)
        return outcome(d.set_access, r, 3 * g)
    finally:
        tidy(d, [(r, 3 * g)], [h1, h2])


class UnmapTakesATiledRange(_Broken):
    """Several mappings. Breaks "``unmap(va, size)`` takes exactly a range that one ``map`` call made (no sub-range,
    nothing more)": a range tiled exactly by adjacent whole mappings is unmapped, mapping by mapping."""

    def unmap(self, va: int, size: int) -> None:
        tiles, at = [], va
        while at < va + size and at in self.mappings:
            tiles.append((at, self.mappings[at][0]))
            at += self.mappings[at][0]
        if len(tiles) > 1 and at == va + size:
            for t_va, t_size in tiles:
                super().unmap(t_va, t_size)
            return
        super().unmap(va, size)


def prove_unmap_takes_a_tiled_range(make: Callable[[], HostDriver]) -> str:
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h1, h2 = d.create(g), d.create(g)
    try:
        d.map(r, g, h1)
        d.map(r + g, g, h2)
        return outcome(d.unmap, r, 2 * g)
    finally:
        tidy(d, [(r, 2 * g)], [h1, h2])


class MappingTableOf32(_Broken):
    """Many live mappings. Breaks "``unmap(va, size)`` takes exactly a range that one ``map`` call made ... and
    returns it to reserved": its table of live mappings holds 32 entries, and the 33rd map drops the oldest one, so
    that mapping can no longer be unmapped (and could be mapped over)."""

    CAPACITY = 32

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        super().map(va, size, handle, offset)
        with busy(), self.locked():
            while len(self.mappings) > self.CAPACITY:
                del self.mappings[next(iter(self.mappings))]


def prove_mapping_table_of_32(make: Callable[[], HostDriver]) -> str:
    d = make()
    g, n = d.granularity(), 40
    r = d.reserve(n * g, g)
    h = d.create(n * g)
    try:
        for i in range(n):
            d.map(r + i * g, g, h, i * g)
        return outcome(d.unmap, r, g)
    finally:
        tidy(d, [(r, n * g)], [h])


# -- two threads calling one driver -----------------------------------------------------------------------------------
class CreateCountsOutsideTheLock(_Broken):
    """Two threads. Breaks "``create`` takes at least ``size`` from ``free``; once a handle is released and unmapped
    everywhere its bytes are free again" for calls from two threads: it checks the budget under its lock but reads
    the held bytes before making the memfd and writes them back after, so a concurrent create or release is lost."""

    def create(self, size: int) -> HostHandle:
        self.check_call("create", size=size)
        with busy(), self.locked():
            if self.held + size > self.total:
                raise DriverOutOfMemory("create", f"{size} bytes asked, {self.total - self.held} free", errno.ENOMEM)
        held = self.held
        time.sleep(RACE_WINDOW_S)
        handle = self.do_create(size)
        self.held = held + size
        return handle


def prove_create_counts_outside_the_lock(make: Callable[[], HostDriver]) -> tuple[int, int]:
    d = make()
    g = d.granularity()

    def churn(_: int) -> None:
        for _ in range(RACE_TRIES // 2):
            d.release(d.create(g))

    for _ in range(2):
        _race(churn)
        if d.mem_info() != (BUDGET, BUDGET):
            break
    return d.mem_info()


class MapChecksThenMapsUnlocked(_Broken):
    """Two threads. Breaks "The range ... must not overlap a live mapping ...; anything else is refused" for calls
    from two threads: it checks the range under its lock, then maps and records it after letting the lock go, so
    two threads mapping the same range both succeed."""

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        self.check_call("map", va=va, size=size, offset=offset)
        with busy(), self.locked():
            if any(m < va + size and va < m + s for m, (s, _) in self.mappings.items()):
                raise DriverError("map", f"[{va:#x}, +{size}) overlaps a live mapping")
            if not any(r <= va and va + size <= r + s for r, s in self.reservations.items()):
                raise DriverError("map", f"[{va:#x}, +{size}) does not lie inside one reservation")
            if handle.released or offset + size > handle.size:
                raise DriverError("map", f"{handle!r} is released or too small for offset {offset} + size {size}")
        time.sleep(RACE_WINDOW_S)
        if libc().mmap(va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, handle.fd, offset) != va:
            self.fail("map", f"mmap(MAP_FIXED, {va:#x}, {size}, fd={handle.fd}, offset={offset})")
        with busy(), self.locked():
            self.mappings[va] = (size, handle)
            handle.maps += 1


def prove_map_checks_then_maps_unlocked(make: Callable[[], HostDriver]) -> int:
    """The most maps of one range that succeeded together when two threads made them at once."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    handles = [d.create(g), d.create(g)]
    try:
        for _ in range(RACE_TRIES):
            seen: list[str] = []
            _race(lambda i, seen=seen: seen.append(outcome(d.map, r, g, handles[i])))
            if seen.count("done") != 1:
                return seen.count("done")
            d.unmap(r, g)
        return 1
    finally:
        tidy(d, [(r, g)], handles)


class ReserveRecordsUnlocked(_Broken):
    """Two threads. Breaks "``free(va, size)`` returns exactly that range" for reservations made from two threads:
    it publishes its reservation records as a copy taken before the kernel call, so a reservation made meanwhile by
    another thread is forgotten and its ``free`` is refused."""

    def reserve(self, size: int, alignment: int) -> int:
        records = dict(self.reservations)
        time.sleep(RACE_WINDOW_S)
        va = super().reserve(size, alignment)
        records[va] = size
        self.reservations.clear()
        self.reservations.update(records)
        return va


def prove_reserve_records_unlocked(make: Callable[[], HostDriver]) -> int:
    """How many reservations made from two threads at once the driver refused to free."""
    d = make()
    g = d.granularity()
    refused = 0
    for _ in range(3):
        made: list[list[int]] = [[], []]
        _race(lambda i, made=made: made[i].extend(d.reserve(g, g) for _ in range(RACE_TRIES // 2)))
        for va in made[0] + made[1]:
            if outcome(d.free, va, g) != "done":
                refused += 1
                libc().munmap(va, g)
        if refused:
            break
    return refused


# -- exact memory accounting ------------------------------------------------------------------------------------------
class CreateTakesAPowerOfTwo(_Broken):
    """Memory accounting. Breaks "a handle released and unmapped everywhere ... give[s] it back exactly": ``create``
    takes its size rounded up to a power of two (allowed: at least ``size``), ``release`` gives back ``size``, so a
    handle of an odd number of granules (3 and more) leaks the difference."""

    def create(self, size: int) -> HostHandle:
        extra = (1 << (size - 1).bit_length()) - size
        with busy(), self.locked():
            if self.held + size + extra > self.total:
                raise DriverOutOfMemory("create", f"{size} bytes asked, {self.total - self.held} free", errno.ENOMEM)
            self.held += extra
        try:
            return super().create(size)
        except BaseException:
            with busy(), self.locked():
                self.held -= extra
            raise


def prove_create_takes_a_power_of_two(make: Callable[[], HostDriver]) -> list[int]:
    """How much ``free`` lost after a handle of 1, 2 and 3 granules was created and released."""
    d = make()
    g = d.granularity()
    lost = []
    for n in (1, 2, 3):
        before = d.mem_info()[0]
        d.release(d.create(n * g))
        lost.append(before - d.mem_info()[0])
    return lost


class MappedIsAFlag(_Broken):
    """Memory accounting. Breaks "once a handle is released and unmapped everywhere its bytes are free again" for a
    handle mapped at two addresses: it keeps "is mapped" as a flag, not a count, so a released handle's bytes are
    counted free at its first unmap, while it is still mapped at the second address."""

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        super().map(va, size, handle, offset)
        handle.maps = 1

    def unmap(self, va: int, size: int) -> None:
        live = self.mappings.get(va)
        if live is not None and live[0] == size:
            live[1].maps = 1
        super().unmap(va, size)


def prove_mapped_is_a_flag(make: Callable[[], HostDriver]) -> list[tuple[int, int]]:
    """``mem_info`` after each unmap of a released handle mapped at two addresses."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(g)
    seen = []
    try:
        d.map(r, g, h)
        d.map(r + g, g, h)
        d.release(h)
        for va in (r, r + g):
            d.unmap(va, g)
            seen.append(d.mem_info())
        return seen
    finally:
        tidy(d, [(r, 2 * g)], [h])


class TotalIsTheMachine(_Broken):
    """Memory accounting. Breaks "On the host, ``total`` is the driver's budget": ``mem_info`` counts ``free`` from
    the budget but reports the machine's physical memory as ``total``."""

    def mem_info(self) -> tuple[int, int]:
        return super().mem_info()[0], os.sysconf("SC_PHYS_PAGES") * PAGE_BYTES


def prove_total_is_the_machine(make: Callable[[], HostDriver]) -> tuple[int, int]:
    d = make()
    h = d.create(d.granularity())
    try:
        return d.mem_info()[1], d.mem_info()[0] + h.size
    finally:
        d.release(h)


# -- address space ----------------------------------------------------------------------------------------------------
def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


class FreeKeepsTheAlignmentPadding(_Broken):
    """Address space. Breaks "``free(va, size)`` returns exactly that range" (all the address space ``reserve``
    took): ``reserve`` keeps the over-reservation it made to align the range, and ``free`` gives back only
    ``[va, va+size)``, so every aligned reservation leaks up to ``alignment`` bytes of address space."""

    def reserve(self, size: int, alignment: int) -> int:
        self.check_call("reserve", size=size, alignment=alignment)
        check_alignment(alignment, self.granularity())
        alignment = max(alignment, PAGE_BYTES)
        span = size + alignment
        raw = libc().mmap(None, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if raw in (None, MAP_FAILED):
            self.fail("reserve", f"mmap(PROT_NONE, {span} bytes)", oom=True)
        va = _align_up(raw, alignment)
        with busy(), self.locked():
            self.reservations[va] = size
        return va


def prove_free_keeps_the_alignment_padding(make: Callable[[], HostDriver]) -> int:
    """Address space the process holds after a reservation aligned to 1 GiB was freed, in GiB (rounded)."""
    d = make()
    before = sum(hi - lo for lo, hi, _, _ in kernel_ranges())
    va = d.reserve(d.granularity(), GIB)
    d.free(va, d.granularity())
    return round((sum(hi - lo for lo, hi, _, _ in kernel_ranges()) - before) / GIB)


class ReserveTrimsFromTheRawStart(_Broken):
    """Address space. Breaks "``reserve(size, alignment)`` returns a virtual range of ``size`` bytes aligned to
    ``alignment``" for a large alignment: it trims its over-reservation as if the range began where the kernel
    placed it, not at the aligned address, so the kernel holds only ``[va, raw+size)``; the rest of the range is
    free for any other mapping to take."""

    def reserve(self, size: int, alignment: int) -> int:
        self.check_call("reserve", size=size, alignment=alignment)
        check_alignment(alignment, self.granularity())
        alignment = max(alignment, PAGE_BYTES)
        span = size + alignment
        raw = libc().mmap(None, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if raw in (None, MAP_FAILED):
            self.fail("reserve", f"mmap(PROT_NONE, {span} bytes)", oom=True)
        va = _align_up(raw, alignment)
        if va > raw:
            libc().munmap(raw, va - raw)
        libc().munmap(raw + size, span - size)
        with busy(), self.locked():
            self.reservations[va] = size
        return va


def prove_reserve_trims_from_the_raw_start(make: Callable[[], HostDriver]) -> bool:
    """Whether the kernel holds every byte of reservations of 4 granules aligned to 1 GiB (three tries: an address
    the kernel picks may happen to be aligned already)."""
    d = make()
    size = 4 * d.granularity()
    for _ in range(3):
        va = d.reserve(size, GIB)
        held = kernel_holds(va, va + size)
        d.free(va, size)
        if held != size:
            return False
    return True


# -- access state of a handle mapped again ----------------------------------------------------------------------------
class RemapRestoresAccess(_Broken):
    """Access state. Breaks "``map`` ... without access" (and "a mapping alone is not" accessible) for a handle mapped
    again after an unmap: it remembers access per handle, and a handle that once had access gets it back when it
    is mapped again."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._granted: set[HostHandle] = set()

    def set_access(self, va: int, size: int) -> None:
        super().set_access(va, size)
        self._granted.update(h for m, (s, h) in self.mappings.items() if m < va + size and va < m + s)

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        super().map(va, size, handle, offset)
        if handle in self._granted and handle.maps == 1:
            libc().mprotect(va, size, PROT_READ | PROT_WRITE)


def prove_remap_restores_access(make: Callable[[], HostDriver]) -> bool:
    """Whether a handle given access, unmapped and mapped again is accessible before ``set_access``."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.set_access(r, g)
        d.unmap(r, g)
        d.map(r, g, h)
        return d.accessible(r)
    finally:
        tidy(d, [(r, g)], [h])


class SecondMappingSharesAccess(_Broken):
    """Access state. Breaks "``map`` ... without access" for a handle mapped at a second address: the new mapping
    gets the access the handle already has at another address."""

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        others = [m for m, (_, h) in self.mappings.items() if h is handle]
        super().map(va, size, handle, offset)
        if any(self.accessible(m) for m in others):
            libc().mprotect(va, size, PROT_READ | PROT_WRITE)


def prove_second_mapping_shares_access(make: Callable[[], HostDriver]) -> bool:
    """Whether a handle's second mapping is accessible before ``set_access`` while its first one has access."""
    d = make()
    g = d.granularity()
    r = d.reserve(2 * g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.set_access(r, g)
        d.map(r + g, g, h)
        return d.accessible(r + g)
    finally:
        tidy(d, [(r, 2 * g)], [h])


class MapFillsTheHandle(_Broken):
    """Access state. Breaks "one unmapped and mapped again shows its bytes": it fills fresh pages with the fill byte
    when a handle is mapped rather than when it is created, and does so at every map, erasing what was written."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._map_fill, self.fill_byte = self.fill_byte, None

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        super().map(va, size, handle, offset)
        self.fill(handle.fd, handle.size, self._map_fill)


def prove_map_fills_the_handle(make: Callable[[], HostDriver]) -> list[int]:
    """The first bytes a handle shows when mapped again after 0x3C was written through its first mapping."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.set_access(r, g)
        d.tensor(r, 4, None).fill_(0x3C)
        d.synchronize()
        d.unmap(r, g)
        d.map(r, g, h)
        d.set_access(r, g)
        return d.tensor(r, 4, None).tolist()
    finally:
        tidy(d, [(r, g)], [h])


# -- identity ---------------------------------------------------------------------------------------------------------
class DeviceWithAnIndex(_Broken):
    """Identity. Breaks "``device``: the torch device whose tensors ``tensor`` returns": it names ``cpu:0``, its
    tensors are on ``cpu`` (torch does not count the two as equal)."""

    device = torch.device("cpu", 0)


class DeviceIsAString(_Broken):
    """Identity. Breaks "``device: torch.device`` ... whose tensors ``tensor`` returns": it names its device with the
    string ``"cpu"``, which no ``torch.device`` equals."""

    device = "cpu"  # type: ignore[assignment]


def prove_device_names_the_tensors_device(make: Callable[[], HostDriver]) -> bool:
    """Whether the device a driver names is the device of a tensor it returns."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    try:
        return d.tensor(r, 16, None).device == d.device
    finally:
        d.free(r, g)


# -- native failures --------------------------------------------------------------------------------------------------
class ReserveFailsWithOSError(_Broken):
    """Native failures. Breaks "A failed native call ... raises ``DriverError`` (``DriverOutOfMemory`` for lack of
    memory) naming the operation": a failed ``mmap`` in ``reserve`` surfaces as the ``OSError`` of its errno."""

    def reserve(self, size: int, alignment: int) -> int:
        try:
            return super().reserve(size, alignment)
        except DriverError as exc:
            if exc.code is None:  # a refusal before any native call keeps its type
                raise
            raise OSError(exc.code, os.strerror(exc.code)) from None


class NativeFailureNamesTheCall(_Broken):
    """Native failures. Breaks "raises ``DriverError`` ... naming the operation": a failed native call names the
    libc call that failed (``mmap``, ``munmap``, ``mprotect``) as the operation, not the protocol operation."""

    @staticmethod
    def fail(op: str, detail: str, oom: bool = False) -> None:
        HostDriver.fail(detail.split("(")[0], detail, oom)


def prove_reserve_failure_is_typed(make: Callable[[], HostDriver]) -> str:
    """The error of a reservation the kernel cannot place (2**62 bytes, past any address space)."""
    d = make()
    return outcome(d.reserve, 1 << 62, d.granularity())


class CreateFailsWithOSError(_Broken):
    """Native failures. Breaks "A failed native call ... raises ``DriverError`` ... naming the operation" in
    ``create``: a failed ``memfd_create``, ``ftruncate`` or fill surfaces as the ``OSError`` Python raised (the held
    bytes are still given back)."""

    def do_create(self, size: int) -> HostHandle:
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            if self.fill_byte is not None:
                self.fill(fd, size, self.fill_byte)
        except BaseException:
            os.close(fd)
            raise
        return HostHandle(fd, size)


def prove_create_failure_is_typed(make: Callable[[], HostDriver]) -> str:
    """The error of ``create`` while the process may open no more file descriptors (``RLIMIT_NOFILE`` lowered to the
    lowest free descriptor for the one call, so ``memfd_create`` fails with EMFILE)."""
    d = make()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = next(fd for fd in itertools.count() if not _is_open(fd))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        return outcome(d.create, d.granularity())
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


# -- a refusal that leaves the reservation less usable ----------------------------------------------------------------
class RefusedMapLeavesItsTail(_Broken):
    """Refusals. Breaks "[a refusal] leaves the driver's state as it was before the call: what is mapped": it maps
    granule by granule, and when it reaches a granule it must refuse (past the reservation, over a live mapping) it
    undoes only the first granule, so the granules after it stay mapped (and recorded) and cannot be mapped again."""

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        try:
            super().map(va, size, handle, offset)
        except DriverError:
            g = self.granularity()
            k = 0
            while (
                (k + 1) * g <= size
                and offset + (k + 1) * g <= handle.size
                and not handle.released
                and self._free_and_reserved(va + k * g)
            ):
                k += 1
            for i in range(1, k):
                libc().mmap(va + i * g, g, PROT_NONE, MAP_SHARED | MAP_FIXED, handle.fd, offset + i * g)
                self.mappings[va + i * g] = (g, handle)
                handle.maps += 1
            raise

    def _free_and_reserved(self, a: int) -> bool:
        return any(r <= a < r + s for r, s in self.reservations.items()) and not any(
            m <= a < m + s for m, (s, _) in self.mappings.items()
        )


def prove_refused_map_leaves_its_tail(make: Callable[[], HostDriver]) -> list[str]:
    """After a refused map of 3 granules (its third granule is mapped already): the outcome of mapping its first
    granule, then its second."""
    d = make()
    g = d.granularity()
    r = d.reserve(3 * g, g)
    top, wide, one, two = d.create(g), d.create(3 * g), d.create(g), d.create(g)
    try:
        d.map(r + 2 * g, g, top)
        outcome(d.map, r, 3 * g, wide)
        return [outcome(d.map, r, g, one), outcome(d.map, r + g, g, two)]
    finally:
        tidy(d, [(r, 3 * g)], [top, wide, one, two])


class RefusedSetAccessRevokesTheTail(_Broken):
    """Refusals. Breaks "[a refusal] leaves the driver's state as it was before the call: what is ... accessible":
    a refused ``set_access`` leaves every mapped granule of the range after its first without access, also granules
    that had access before."""

    def set_access(self, va: int, size: int) -> None:
        try:
            super().set_access(va, size)
        except DriverError:
            _revoke_after_the_first_granule(self, va, size)
            raise


class RefusedUnmapRevokesTheTail(_Broken):
    """Refusals. Breaks "[a refusal] leaves the driver's state as it was before the call: what is ... accessible":
    a refused ``unmap`` (part of a mapping, a mapping and more) leaves every mapped granule of the range after its
    first without access."""

    def unmap(self, va: int, size: int) -> None:
        live = self.mappings.get(va)
        if live is None or live[0] != size:
            _revoke_after_the_first_granule(self, va, size)
        super().unmap(va, size)


def _revoke_after_the_first_granule(d: HostDriver, va: int, size: int) -> None:
    lo = va + d.granularity()
    for m, (s, _) in list(d.mappings.items()):
        start, end = max(m, lo), min(m + s, va + size)
        if start < end:
            libc().mprotect(start, end - start, PROT_NONE)


def prove_refused_set_access_keeps_access(make: Callable[[], HostDriver]) -> list[bool]:
    """Accessible granules of a mapping of 3 granules with access, after ``set_access`` over it and one unmapped
    granule more was refused."""
    d = make()
    g = d.granularity()
    r = d.reserve(4 * g, g)
    h = d.create(3 * g)
    try:
        d.map(r, 3 * g, h)
        d.set_access(r, 3 * g)
        outcome(d.set_access, r, 4 * g)
        return [d.accessible(r + i * g) for i in range(3)]
    finally:
        tidy(d, [(r, 4 * g)], [h])


def prove_refused_unmap_keeps_access(make: Callable[[], HostDriver]) -> list[bool]:
    """Accessible granules of a mapping of 3 granules with access, after ``unmap`` of its first two was refused."""
    d = make()
    g = d.granularity()
    r = d.reserve(3 * g, g)
    h = d.create(3 * g)
    try:
        d.map(r, 3 * g, h)
        d.set_access(r, 3 * g)
        outcome(d.unmap, r, 2 * g)
        return [d.accessible(r + i * g) for i in range(3)]
    finally:
        tidy(d, [(r, 3 * g)], [h])


# -- many live objects: a table that changes past a count -------------------------------------------------------------
class ReleasePast128HandlesKeepsTheBytes(_Broken):
    """P-release-returns. Breaks "Once the handle is released and unmapped everywhere, the bytes ``create`` took are
    free again": the driver keeps its live handles in a table of 128 entries and moves the rest to an overflow list
    whose handles, once gone, are taken off the list but not out of the held bytes. With 128 live handles or fewer
    every release gives its bytes back."""

    TABLE = 128

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._alive: set[int] = set()

    def create(self, size: int) -> HostHandle:
        handle = super().create(size)
        with busy(), self.locked():
            self._alive.add(id(handle))
        return handle

    def drop_if_unused(self, handle: HostHandle) -> None:
        if handle.released and handle.maps == 0 and handle.counted and len(self._alive) > self.TABLE:
            handle.counted = False  # the bug: its bytes stay in the held count
            self._alive.discard(id(handle))
            return
        super().drop_if_unused(handle)
        if not handle.counted:
            self._alive.discard(id(handle))


def prove_release_past_128_handles_keeps_the_bytes(make: Callable[[], HostDriver]) -> list[int]:
    """130 one-granule handles: the granules ``mem_info`` counts taken, then after one of them is released."""
    d = make()
    g = d.granularity()
    handles = [d.create(g) for _ in range(130)]
    try:
        seen = [(d.mem_info()[1] - d.mem_info()[0]) // g]
        d.release(handles[64])
        return [*seen, (d.mem_info()[1] - d.mem_info()[0]) // g]
    finally:
        tidy(d, [], handles)


class FreePast256ReservationsKeepsTheRange(_Broken):
    """P-free-kernel. Breaks "Afterwards nothing of the range ... is held: on the host the kernel maps nothing there":
    with more than 256 live reservations ``free`` forgets the record at once but batches its ``munmap``, which runs
    once the count is back at 256, so the kernel still holds the range when ``free`` returns. With 256 live
    reservations or fewer every free gives its range back at once."""

    BATCH_ABOVE = 256

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._batch: list[tuple[int, int]] = []

    def do_free(self, va: int, size: int) -> None:
        if len(self.reservations) > self.BATCH_ABOVE:
            check_free(va, size, self.reservations.get(va) == size, self.mappings)
            del self.reservations[va]
            self._batch.append((va, size))
            return
        super().do_free(va, size)
        while self._batch:
            libc().munmap(*self._batch.pop())


def prove_free_past_256_reservations_keeps_the_range(make: Callable[[], HostDriver]) -> int:
    """Bytes of a freed one-granule reservation the kernel still maps, with 257 more reservations live."""
    d = make()
    g = d.granularity()
    vas = [d.reserve(g, g) for _ in range(258)]
    try:
        d.free(vas[-1], g)
        return kernel_holds(vas[-1], vas[-1] + g)
    finally:
        tidy(d, [(va, g) for va in vas[:-1]], [])


class UnmapPast512MappingsKeepsTheKernelMapping(_Broken):
    """P-unmap. Breaks "Afterwards the range is reserved and not mapped: not accessible": with more than 512 live
    mappings ``unmap`` only forgets its record (the kernel's mapping is left for the next ``map`` there to replace), so
    an unmapped granule that had access stays readable and writable. With 512 live mappings or fewer every unmap
    gives the range back to the reservation."""

    LAZY_ABOVE = 512

    def do_unmap(self, va: int, size: int) -> None:
        if len(self.mappings) <= self.LAZY_ABOVE:
            super().do_unmap(va, size)
            return
        live = self.mappings.get(va)
        check_one_mapping(va, size, live and live[0])
        self.forget(va, live)


def prove_unmap_past_512_mappings_keeps_the_kernel_mapping(make: Callable[[], HostDriver]) -> bool:
    """514 one-granule mappings of one handle; the last given access and unmapped: whether it is accessible."""
    d = make()
    g, n = d.granularity(), 514
    r = d.reserve(n * g, g)
    h = d.create(g)
    try:
        for i in range(n):
            d.map(r + i * g, g, h)
        d.set_access(r + (n - 1) * g, g)
        d.unmap(r + (n - 1) * g, g)
        return d.accessible(r + (n - 1) * g)
    finally:
        libc().mmap(r, n * g, PROT_NONE, RESERVED, -1, 0)  # whatever the kernel kept is reserved again
        tidy(d, [(r, n * g)], [h])


# -- bytes no one sees ------------------------------------------------------------------------------------------------
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def _punch(fd: int, size: int) -> None:
    """Give the pages of ``[0, size)`` of the file ``fd`` back to the kernel (they read as zeros afterwards)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, size)


class LastUnmapDropsTheBytes(_Broken):
    """P-map-remap. Breaks "A handle unmapped and mapped again (at the same or another address) shows its bytes
    still": when the last mapping of a handle that is not released goes, the driver gives the handle's pages back to
    the kernel, reasoning that a handle mapped nowhere shows nothing to anyone; mapped again it reads zeros. A handle
    with another mapping alive keeps its bytes."""

    def forget(self, va: int, live: tuple[int, HostHandle]) -> None:
        super().forget(va, live)
        handle = live[1]
        if handle.maps == 0 and not handle.released:
            _punch(handle.fd, handle.size)


def prove_last_unmap_drops_the_bytes(make: Callable[[], HostDriver]) -> int:
    """A one-granule handle mapped with access, 0x5A written at its first byte, unmapped, mapped again with access:
    the byte read there."""
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


# -- a native step that fails after the first ------------------------------------------------------------------------
class FtruncateUnchecked(_Broken):
    """P-native-failure. Breaks "A native call that fails raises ``DriverError`` naming the operation": ``create``
    sizes its memfd through libc's ``ftruncate`` and does not look at what it returned, so where the kernel refuses
    the size (a file size limit) the handle is made over an empty file: ``create`` succeeds, holding nothing it could
    map. A failed ``memfd_create`` is still a ``DriverError``."""

    def do_create(self, size: int) -> HostHandle:
        try:
            fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        except OSError as exc:
            raise DriverError("create", f"memfd_create for {size} bytes: {exc}", exc.errno) from exc
        libc = ctypes.CDLL(None, use_errno=True)
        libc.ftruncate.argtypes = [ctypes.c_int, ctypes.c_long]
        libc.ftruncate(fd, size)  # the bug: -1 (EFBIG) goes unseen
        return HostHandle(fd, size)


def prove_ftruncate_unchecked(make: Callable[[], HostDriver]) -> str:
    """The outcome of a one-granule ``create`` while no file may grow past one byte (``RLIMIT_FSIZE``, one call)."""
    d = make()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    made: list[HostHandle] = []
    resource.setrlimit(resource.RLIMIT_FSIZE, (1, hard))
    try:
        return outcome(lambda: made.append(d.create(d.granularity())))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        tidy(d, [], made)


# -- refusals, counts, limits and pairs of the eighth set's kinds ----------------------------------------------------
_ANON_RESERVE = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
"""The flags of a new reservation (the host's ``reserve``), without ``MAP_FIXED``."""


def _reserved_ranges() -> list[tuple[int, int]]:
    """The ranges the kernel holds as reserved (anonymous, no access), in address order."""
    return sorted((lo, hi) for lo, hi, perms, path in kernel_ranges() if perms == "---p" and not path)


def _ranges_minus(ranges: list[tuple[int, int]], taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``ranges`` that no range of ``taken`` covers (``taken`` in address order)."""
    left = []
    for lo, hi in ranges:
        cut = lo
        for t_lo, t_hi in taken:
            if t_lo < hi and cut < t_hi:
                if cut < t_lo:
                    left.append((cut, t_lo))
                cut = t_hi
        if cut < hi:
            left.append((cut, hi))
    return left


class MapRefusalLeaksAScratchRange(_Broken):
    """P-refusal-unchanged. Breaks "A refused call leaves every observable as it was: ... the memory and address space
    the kernel holds": ``map`` first reserves a staging range of one granule (anonymous, no access) and then runs its
    usual checks; a map that is taken gives the staging range back, a refused one (past the reservation's end, over a
    live mapping, a released handle, a bad value) leaves it with the kernel: one granule of address space more per
    refusal. A staging range the kernel will not give is done without."""

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        g = self.granularity()
        scratch: list[int | None] = []
        try:  # the staging range's address is stored by C (host.py, Note [A result is stored by C])
            scratch.extend(map(libc().mmap, [None], [g], [PROT_NONE], [_ANON_RESERVE], [-1], [0]))
            super().map(va, size, handle, offset)
            self._drop_scratch(scratch)
        except DriverError:
            raise  # the bug: a refused map keeps its staging range
        except BaseException:
            self._drop_scratch(scratch)
            raise

    def _drop_scratch(self, scratch: list[int | None]) -> None:
        for raw in scratch:
            if raw not in (None, MAP_FAILED):
                libc().munmap(raw, self.granularity())


def prove_map_refusal_leaks_a_scratch_range(make: Callable[[], HostDriver]) -> list[object]:
    """A one-granule map refused over a live mapping: its outcome, and how many granules of reserved address space
    (anonymous, no access) the kernel holds that it did not hold before the call (given back to the kernel here)."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    live, other = d.create(g), d.create(g)
    try:
        d.map(r, g, live)
        before = _reserved_ranges()
        seen = outcome(d.map, r, g, other)
        leaked = _ranges_minus(_reserved_ranges(), before)
        for lo, hi in leaked:
            libc().munmap(lo, hi - lo)
        return [seen, sum(hi - lo for lo, hi in leaked) // g]
    finally:
        tidy(d, [(r, g)], [live, other])


class FreeAroundAReservationTakenPast100Reservations(_Broken):
    """P-free-refused. Breaks "Refused, changing nothing: ... a range around one": with more than 100 live reservations
    the driver searches its records by range (its large table is kept in address order), and ``free`` of a range
    around a live reservation with nothing mapped in it (starting before it or ending after it) frees the first such
    reservation the range covers instead of refusing. With 100 live reservations or fewer the range must be exactly
    one reservation."""

    SEARCH_ABOVE = 100

    def do_free(self, va: int, size: int) -> None:
        if len(self.reservations) > self.SEARCH_ABOVE and self.reservations.get(va) != size:
            covered = [
                (r, s)
                for r, s in self.reservations.items()
                if va <= r and r + s <= va + size and not any(r <= m < r + s for m in self.mappings)
            ]
            if covered:
                super().do_free(*min(covered))  # the bug: the reservation the range covers goes
                return
        super().do_free(va, size)


def prove_free_around_a_reservation_taken_past_100_reservations(make: Callable[[], HostDriver]) -> str:
    """102 one-granule reservations: the outcome of ``free`` of the newest one and the granule below it."""
    d = make()
    g = d.granularity()
    vas = [d.reserve(g, g) for _ in range(102)]
    try:
        return outcome(d.free, vas[-1] - g, 2 * g)
    finally:
        tidy(d, [(va, g) for va in vas if va in d.reservations], [])


class _Tally:
    """Held by a tensor's buffer: takes its serial out of its driver's set of live storages when the storage is freed
    (no lock: ``set.discard`` is one step, and a finalizer must not take the driver's lock)."""

    def __init__(self, alive: set[int], serial: int) -> None:
        self.alive, self.serial = alive, serial

    def __del__(self) -> None:
        self.alive.discard(self.serial)


class KeeperHeldWeaklyPast600Tensors(_Broken):
    """P-tensor-keeper. Breaks "Its storage holds a strong reference to ``keeper`` until the storage is freed": the
    driver counts the storages of its tensors alive and, while more than 600 are, spares their memory by having a new
    storage hold only a weak reference to its keeper (a keeper no weak reference can follow is held as before), so a
    keeper no one else holds is collected while its tensor lives. With 600 tensors alive or fewer every keeper is
    held."""

    WEAK_ABOVE = 600

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._alive: set[int] = set()
        self._serials = itertools.count()

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        self.check_call("tensor", va=va, size=nbytes)
        buffer = (ctypes.c_uint8 * nbytes).from_address(va)
        buffer.keeper = keeper
        if len(self._alive) > self.WEAK_ABOVE:
            with contextlib.suppress(TypeError):  # the bug: a keeper a weak reference can follow is held weakly
                buffer.keeper = weakref.ref(keeper)
        serial = next(self._serials)
        buffer.tally = _Tally(self._alive, serial)  # before the count: a storage counted is one that will be uncounted
        self._alive.add(serial)
        return torch.frombuffer(buffer, dtype=torch.uint8)


class _Keeper:
    """Something a weak reference can follow."""


def prove_keeper_held_weakly_past_600_tensors(make: Callable[[], HostDriver]) -> bool:
    """601 one-byte tensors alive (each with its own keeper), then one more with a keeper no one else holds: whether
    that keeper is still alive after a collection."""
    d = make()
    g = d.granularity()
    r = d.reserve(g, g)
    h = d.create(g)
    try:
        d.map(r, g, h)
        d.set_access(r, g)
        rest = [d.tensor(r + i, 1, _Keeper()) for i in range(601)]
        keeper = _Keeper()
        ref = weakref.ref(keeper)
        last = d.tensor(r + 601, 1, keeper)
        del keeper
        gc.collect()
        alive = ref() is not None
        del last, rest
        gc.collect()
        return alive
    finally:
        tidy(d, [(r, g)], [h])


class ReserveHalvesThePaddingUntilItFits(_Broken):
    """P-reserve-aligned. Breaks "Reserve ``size`` bytes of virtual addresses and return the first, a multiple of
    ``alignment``": when the padded ``mmap`` (``size + alignment``) fails for want of address space, ``reserve`` tries
    again with half the padding, and half of that, down to the granularity, and aligns the range within the padding it
    got to the largest power of two it can: a range aligned to less than was asked. A reservation whose padded ``mmap``
    succeeds is aligned, and one that fails at the granularity's alignment is refused."""

    def do_reserve(self, size: int, alignment: int) -> int:
        try:
            return super().do_reserve(size, alignment)
        except DriverOutOfMemory:
            if alignment <= self.granularity():
                raise
        pad = alignment // 2
        while pad >= self.granularity():  # the bug: less padding than the alignment needs
            va = self._reserve_in(size, pad, alignment)
            if va is not None:
                return va
            pad //= 2
        raise DriverOutOfMemory("reserve", f"mmap(PROT_NONE) of {size} bytes with any padding down to {pad * 2}")

    def _reserve_in(self, size: int, pad: int, alignment: int) -> int | None:
        """``[va, va+size)`` taken from an ``mmap`` of ``size + pad`` bytes, ``va`` the multiple of the largest power
        of two up to ``alignment`` the padding allows, the rest given back (as the host's ``_reserve`` does, undone
        whole on any exception); ``None`` when the ``mmap`` fails."""
        span = size + pad
        raws: list[int | None] = []
        at: list[int] = []
        head = tail = False
        try:  # the mmap's result is stored by C (host.py, Note [A result is stored by C])
            raws.extend(map(libc().mmap, [None], [span], [PROT_NONE], [_ANON_RESERVE], [-1], [0]))
            if raws[0] in (None, MAP_FAILED):
                return None
            raw = raws[0]
            fit = next(a for a in (alignment >> k for k in itertools.count()) if -raw % a <= pad)
            at.append(raw + -raw % fit)
            va = at[0]
            head = va == raw or libc().munmap(raw, va - raw) == 0
            tail = raw + span == va + size or libc().munmap(va + size, raw + span - (va + size)) == 0
            self.reservations[va] = size
            return va
        except BaseException:
            if raws and raws[0] not in (None, MAP_FAILED):
                raw = raws[0]
                va = at[0] if at else raw
                if at:
                    self.reservations.pop(va, None)
                lo, hi = (va if head else raw), (va + size if tail else raw + span)
                libc().munmap(lo, hi - lo)
            raise


class UnmapCountsDownOutsideTheLock(_Broken):
    """P-threads. Breaks "Any call may be made from several threads at once on one driver: each takes effect whole, so
    what every call returned, and the state the driver is left in, are those of some serial order of the calls":
    ``unmap`` gives the range back to the kernel, forgets its record and reads its handle's count of mappings under the
    driver's lock, then lets the lock go and writes the count less one, giving the handle's bytes back once it wrote 0
    on a released handle; two threads unmapping two mappings of one released handle at once both write the same count,
    and the bytes are never given back. Unmaps from one thread, or of mappings of different handles, are counted
    right."""

    WINDOW_S = 2e-3

    def unmap(self, va: int, size: int) -> None:
        self.check_call("unmap", va=va, size=size)
        taken: list[tuple[tuple[int, HostHandle], int]] = []
        try:  # the kernel and the record under the lock, the count after it; on any exception the records count it
            with busy(), self.locked(): taken.extend(map(self._take, [va], [size]))  # fmt: skip
            time.sleep(self.WINDOW_S)  # the race window, widened (Note [A proof drives both drivers])
            (_, handle), maps = taken[0]
            handle.maps = maps - 1  # the bug: written outside the lock, from the count read under it
            with busy(), self.locked(): self.drop_if_unused(handle)  # fmt: skip
        except BaseException:
            for (_, handle), _ in taken:  # the mapping is gone: its handle's count is counted again from the records
                with busy(), self.locked(): self._count_maps(handle)  # fmt: skip
            raise

    def _take(self, va: int, size: int) -> tuple[tuple[int, HostHandle], int]:
        """Give ``[va, va+size)`` back to the reservation and forget its record (the host's ``_unmap`` up to the count);
        the mapping's record and its handle's count of mappings, as read."""
        live = self.mappings.get(va)
        check_one_mapping(va, size, live and live[0])
        got: list[int | None] = []
        try:  # the kernel first, then the record (host.py, Notes [Every call is whole, ...], [A result is stored by C])
            got.extend(map(libc().mmap, [va], [size], [PROT_NONE], [RESERVED], [-1], [0]))
            if got[0] != va:
                self.fail("unmap", f"mmap(PROT_NONE, MAP_FIXED, {va:#x}, {size})")
            return self.mappings.pop(va), live[1].maps
        except BaseException:
            if got == [va]:  # the kernel unmapped it: the records follow
                self.recount(va, live)
            raise

    def _count_maps(self, handle: HostHandle) -> None:
        """Count the mappings of ``handle`` from the records, and give its bytes back if it is released and mapped
        nowhere (called with the lock held)."""
        handle.maps = sum(1 for _, h in self.mappings.values() if h is handle)
        self.drop_if_unused(handle)


def prove_unmap_counts_down_outside_the_lock(make: Callable[[], HostDriver]) -> int:
    """A one-granule handle mapped at two one-granule reservations, released, and unmapped from both by two threads at
    once: the granules ``mem_info`` counts taken (the first try that differs from none, of up to 20)."""
    for _ in range(20):
        d = make()
        g = d.granularity()
        a, b = d.reserve(g, g), d.reserve(g, g)
        h = d.create(g)
        try:
            d.map(a, g, h)
            d.map(b, g, h)
            d.release(h)
            _race(lambda i: d.unmap((a, b)[i], g))
            free, total = d.mem_info()
        finally:
            tidy(d, [(a, g), (b, g)], [h])
        if free != total:
            return (total - free) // g
    return 0


class ReleaseCountsOutsideTheLock(_Broken):
    """P-threads. Breaks "Any call may be made from several threads at once on one driver: each takes effect whole, so
    what every call returned, and the state the driver is left in, are those of some serial order of the calls":
    ``release`` closes the handle under the driver's lock and reads the bytes held there, then lets the lock go and
    writes the count read less the handle's size; two threads releasing handles of their own at once (each mapped
    nowhere) both subtract from the same count, and one handle's bytes stay counted. Releases from one thread, and of
    mapped handles, are counted right."""

    WINDOW_S = 2e-3

    def release(self, handle: HostHandle) -> None:
        self.check_call("release")
        if handle.released or handle.maps:
            return super().release(handle)
        with busy(), self.locked(): held = self._close(handle)  # fmt: skip
        time.sleep(self.WINDOW_S)  # the race window, widened (Note [A proof drives both drivers])
        with busy(), self.locked(): self.held, handle.counted = held - handle.size, False  # fmt: skip

    def _close(self, handle: HostHandle) -> int:
        """Mark ``handle`` released and close its memfd in one line (as the host does); the bytes held, as read."""
        fd, handle.fd, handle.released = handle.fd, -1, True; os.close(fd)  # noqa: E702  # fmt: skip
        return self.held


def prove_release_counts_outside_the_lock(make: Callable[[], HostDriver]) -> int:
    """Two one-granule handles, mapped nowhere, released by two threads at once: the granules ``mem_info`` counts
    taken after (the first try that differs from none, of up to 20)."""
    for _ in range(20):
        d = make()
        g = d.granularity()
        made = [d.create(g), d.create(g)]
        _race(lambda i: d.release(made[i]))
        held = (d.mem_info()[1] - d.mem_info()[0]) // g
        if held:
            return held
    return 0


class LastUnmapPunchesLargeHandlesTails(_Broken):
    """P-map-remap. Breaks "A handle unmapped and mapped again (at the same or another address) shows its bytes still":
    the last unmap of a handle of 16 granules or more hands the pages past its first granule back to the kernel
    (``fallocate(PUNCH_HOLE)``, as a driver trimming a handle it thinks idle might); the memfd, its size and the memory
    counted stay as they were, and bytes past the first granule read as zeros once the handle is mapped again. Smaller
    handles keep every byte."""

    LARGE = 16

    def forget(self, va: int, live: tuple[int, HostHandle]) -> None:
        super().forget(va, live)
        handle = live[1]
        if handle.maps == 0 and not handle.released and handle.size >= self.LARGE * self.granularity():
            g = self.granularity()
            punch_hole_keep_size = 0x02 | 0x01
            fallocate = ctypes.CDLL(None, use_errno=True).fallocate
            fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
            fallocate(handle.fd, punch_hole_keep_size, g, handle.size - g)


def prove_last_unmap_punches_large_handles_tails(make: Callable[[], HostDriver]) -> list[int]:
    """A 16-granule handle mapped with access, 0x3C written at the start of its first and of its last granule,
    unmapped, and mapped with access into another reservation: the two bytes read back."""
    d = make()
    g = d.granularity()
    n = LastUnmapPunchesLargeHandlesTails.LARGE
    first, second = d.reserve(n * g, g), d.reserve(n * g, g)
    handle = d.create(n * g)
    try:
        d.map(first, n * g, handle)
        d.set_access(first, n * g)
        poke(d, first, 0x3C)
        poke(d, first + (n - 1) * g, 0x3C)
        d.unmap(first, n * g)
        d.map(second, n * g, handle)
        d.set_access(second, n * g)
        return [read_byte(d, second), read_byte(d, second + (n - 1) * g)]
    finally:
        tidy(d, [(first, n * g), (second, n * g)], [handle])


# -- the factories and the cases -------------------------------------------------------------------------------------
set_access_first_mapping_only = functools.partial(SetAccessFirstMappingOnly, "broken-set-access-first-mapping-only")
set_access_checks_the_ends_only = functools.partial(
    SetAccessChecksTheEndsOnly, "broken-set-access-checks-the-ends-only"
)
unmap_takes_a_tiled_range = functools.partial(UnmapTakesATiledRange, "broken-unmap-takes-a-tiled-range")
mapping_table_of_32 = functools.partial(MappingTableOf32, "broken-mapping-table-of-32")
create_counts_outside_the_lock = functools.partial(CreateCountsOutsideTheLock, "broken-create-counts-outside-the-lock")
map_checks_then_maps_unlocked = functools.partial(MapChecksThenMapsUnlocked, "broken-map-checks-then-maps-unlocked")
reserve_records_unlocked = functools.partial(ReserveRecordsUnlocked, "broken-reserve-records-unlocked")
create_takes_a_power_of_two = functools.partial(CreateTakesAPowerOfTwo, "broken-create-takes-a-power-of-two")
mapped_is_a_flag = functools.partial(MappedIsAFlag, "broken-mapped-is-a-flag")
total_is_the_machine = functools.partial(TotalIsTheMachine, "broken-total-is-the-machine")
free_keeps_the_alignment_padding = functools.partial(
    FreeKeepsTheAlignmentPadding, "broken-free-keeps-the-alignment-padding"
)
reserve_trims_from_the_raw_start = functools.partial(
    ReserveTrimsFromTheRawStart, "broken-reserve-trims-from-the-raw-start"
)
remap_restores_access = functools.partial(RemapRestoresAccess, "broken-remap-restores-access")
second_mapping_shares_access = functools.partial(SecondMappingSharesAccess, "broken-second-mapping-shares-access")
map_fills_the_handle = functools.partial(MapFillsTheHandle, "broken-map-fills-the-handle")
device_with_an_index = functools.partial(DeviceWithAnIndex, "broken-device-with-an-index")
device_is_a_string = functools.partial(DeviceIsAString, "broken-device-is-a-string")
reserve_fails_with_os_error = functools.partial(ReserveFailsWithOSError, "broken-reserve-fails-with-os-error")
native_failure_names_the_call = functools.partial(NativeFailureNamesTheCall, "broken-native-failure-names-the-call")
create_fails_with_os_error = functools.partial(CreateFailsWithOSError, "broken-create-fails-with-os-error")
refused_map_leaves_its_tail = functools.partial(RefusedMapLeavesItsTail, "broken-refused-map-leaves-its-tail")
refused_set_access_revokes_the_tail = functools.partial(
    RefusedSetAccessRevokesTheTail, "broken-refused-set-access-revokes-the-tail"
)
refused_unmap_revokes_the_tail = functools.partial(RefusedUnmapRevokesTheTail, "broken-refused-unmap-revokes-the-tail")
release_past_128_handles_keeps_the_bytes = functools.partial(
    ReleasePast128HandlesKeepsTheBytes, "broken-release-past-128-handles-keeps-the-bytes"
)
free_past_256_reservations_keeps_the_range = functools.partial(
    FreePast256ReservationsKeepsTheRange, "broken-free-past-256-reservations-keeps-the-range"
)
ftruncate_unchecked = functools.partial(FtruncateUnchecked, "broken-ftruncate-unchecked")
last_unmap_drops_the_bytes = functools.partial(LastUnmapDropsTheBytes, "broken-last-unmap-drops-the-bytes")
unmap_past_512_mappings_keeps_the_kernel_mapping = functools.partial(
    UnmapPast512MappingsKeepsTheKernelMapping, "broken-unmap-past-512-mappings-keeps-the-kernel-mapping"
)
map_refusal_leaks_a_scratch_range = functools.partial(
    MapRefusalLeaksAScratchRange, "broken-map-refusal-leaks-a-scratch-range"
)
free_around_a_reservation_taken_past_100_reservations = functools.partial(
    FreeAroundAReservationTakenPast100Reservations, "broken-free-around-a-reservation-taken-past-100-reservations"
)
keeper_held_weakly_past_600_tensors = functools.partial(
    KeeperHeldWeaklyPast600Tensors, "broken-keeper-held-weakly-past-600-tensors"
)
reserve_halves_the_padding_until_it_fits = functools.partial(
    ReserveHalvesThePaddingUntilItFits, "broken-reserve-halves-the-padding-until-it-fits"
)
unmap_counts_down_outside_the_lock = functools.partial(
    UnmapCountsDownOutsideTheLock, "broken-unmap-counts-down-outside-the-lock"
)
last_unmap_punches_large_handles_tails = functools.partial(
    LastUnmapPunchesLargeHandlesTails, "broken-last-unmap-punches-large-handles-tails"
)
release_counts_outside_the_lock = functools.partial(
    ReleaseCountsOutsideTheLock, "broken-release-counts-outside-the-lock"
)


@dataclass(frozen=True)
class Case:
    """A broken driver's factory, the area of the protocol it breaks, its proof, and what the protocol says the
    proof observes (what the intact driver observes)."""

    factory: Callable[[], HostDriver]
    area: str
    proof: Callable[[Callable[[], HostDriver]], object]
    want: object


_G = 2 * MIB  # HostDriver's default granularity, the broken drivers' granularity
CASES: dict[str, Case] = {
    "set_access_first_mapping_only": Case(
        set_access_first_mapping_only, "several mappings", prove_set_access_first_mapping_only, [True, True, True]
    ),
    "set_access_checks_the_ends_only": Case(
        set_access_checks_the_ends_only,
        "several mappings",
        prove_set_access_checks_the_ends_only,
        "DriverError(set_access)",
    ),
    "unmap_takes_a_tiled_range": Case(
        unmap_takes_a_tiled_range, "several mappings", prove_unmap_takes_a_tiled_range, "DriverError(unmap)"
    ),
    "mapping_table_of_32": Case(mapping_table_of_32, "many live mappings", prove_mapping_table_of_32, "done"),
    "create_counts_outside_the_lock": Case(
        create_counts_outside_the_lock, "two threads", prove_create_counts_outside_the_lock, (BUDGET, BUDGET)
    ),
    "map_checks_then_maps_unlocked": Case(
        map_checks_then_maps_unlocked, "two threads", prove_map_checks_then_maps_unlocked, 1
    ),
    "reserve_records_unlocked": Case(reserve_records_unlocked, "two threads", prove_reserve_records_unlocked, 0),
    "create_takes_a_power_of_two": Case(
        create_takes_a_power_of_two, "memory accounting", prove_create_takes_a_power_of_two, [0, 0, 0]
    ),
    "mapped_is_a_flag": Case(
        mapped_is_a_flag, "memory accounting", prove_mapped_is_a_flag, [(BUDGET - _G, BUDGET), (BUDGET, BUDGET)]
    ),
    "total_is_the_machine": Case(
        total_is_the_machine, "memory accounting", prove_total_is_the_machine, (BUDGET, BUDGET)
    ),
    "free_keeps_the_alignment_padding": Case(
        free_keeps_the_alignment_padding, "address space", prove_free_keeps_the_alignment_padding, 0
    ),
    "reserve_trims_from_the_raw_start": Case(
        reserve_trims_from_the_raw_start, "address space", prove_reserve_trims_from_the_raw_start, True
    ),
    "remap_restores_access": Case(remap_restores_access, "access state", prove_remap_restores_access, False),
    "second_mapping_shares_access": Case(
        second_mapping_shares_access, "access state", prove_second_mapping_shares_access, False
    ),
    "map_fills_the_handle": Case(map_fills_the_handle, "access state", prove_map_fills_the_handle, [0x3C] * 4),
    "device_with_an_index": Case(device_with_an_index, "identity", prove_device_names_the_tensors_device, True),
    "device_is_a_string": Case(device_is_a_string, "identity", prove_device_names_the_tensors_device, True),
    "reserve_fails_with_os_error": Case(
        reserve_fails_with_os_error, "native failures", prove_reserve_failure_is_typed, "DriverOutOfMemory(reserve)"
    ),
    "native_failure_names_the_call": Case(
        native_failure_names_the_call, "native failures", prove_reserve_failure_is_typed, "DriverOutOfMemory(reserve)"
    ),
    "create_fails_with_os_error": Case(
        create_fails_with_os_error, "native failures", prove_create_failure_is_typed, "DriverError(create)"
    ),
    "refused_map_leaves_its_tail": Case(
        refused_map_leaves_its_tail, "refusals", prove_refused_map_leaves_its_tail, ["done", "done"]
    ),
    "refused_set_access_revokes_the_tail": Case(
        refused_set_access_revokes_the_tail, "refusals", prove_refused_set_access_keeps_access, [True, True, True]
    ),
    "refused_unmap_revokes_the_tail": Case(
        refused_unmap_revokes_the_tail, "refusals", prove_refused_unmap_keeps_access, [True, True, True]
    ),
    "release_past_128_handles_keeps_the_bytes": Case(
        release_past_128_handles_keeps_the_bytes,
        "many live objects",
        prove_release_past_128_handles_keeps_the_bytes,
        [130, 129],
    ),
    "free_past_256_reservations_keeps_the_range": Case(
        free_past_256_reservations_keeps_the_range,
        "many live objects",
        prove_free_past_256_reservations_keeps_the_range,
        0,
    ),
    "ftruncate_unchecked": Case(
        ftruncate_unchecked, "native failures", prove_ftruncate_unchecked, "DriverError(create)"
    ),
    "last_unmap_drops_the_bytes": Case(
        last_unmap_drops_the_bytes, "bytes no one sees", prove_last_unmap_drops_the_bytes, 0x5A
    ),
    "unmap_past_512_mappings_keeps_the_kernel_mapping": Case(
        unmap_past_512_mappings_keeps_the_kernel_mapping,
        "many live objects",
        prove_unmap_past_512_mappings_keeps_the_kernel_mapping,
        False,
    ),
    "map_refusal_leaks_a_scratch_range": Case(
        map_refusal_leaks_a_scratch_range, "refusals", prove_map_refusal_leaks_a_scratch_range, ["DriverError(map)", 0]
    ),
    "free_around_a_reservation_taken_past_100_reservations": Case(
        free_around_a_reservation_taken_past_100_reservations,
        "many live objects",
        prove_free_around_a_reservation_taken_past_100_reservations,
        "DriverError(free)",
    ),
    "keeper_held_weakly_past_600_tensors": Case(
        keeper_held_weakly_past_600_tensors, "many live objects", prove_keeper_held_weakly_past_600_tensors, True
    ),
    "reserve_halves_the_padding_until_it_fits": Case(
        reserve_halves_the_padding_until_it_fits,
        "address space",
        prove_reserve_aligned_to_64_gib_with_1_gib_left,
        "DriverOutOfMemory(reserve)",
    ),
    "unmap_counts_down_outside_the_lock": Case(
        unmap_counts_down_outside_the_lock, "two threads", prove_unmap_counts_down_outside_the_lock, 0
    ),
    "release_counts_outside_the_lock": Case(
        release_counts_outside_the_lock, "two threads", prove_release_counts_outside_the_lock, 0
    ),
    "last_unmap_punches_large_handles_tails": Case(
        last_unmap_punches_large_handles_tails,
        "handle size classes",
        prove_last_unmap_punches_large_handles_tails,
        [0x3C, 0x3C],
    ),
}
