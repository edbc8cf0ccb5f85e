"""Broken host drivers that let go of their lock between their records and their kernel call, one for each effectful
method (``reserve``, ``free``, ``create``, ``release``, ``map``, ``unmap``, ``set_access``): each call is whole when
it runs alone, and a call of another thread on the same range or handle that lands in the gap (tens of microseconds,
no sleep widens it) sees records that the kernel does not yet agree with. ``unmap_unlocked`` is the driver the
two-thread rules once passed 3 runs of 3: a ``map`` of the range in its gap is wiped by its kernel call. The rule that
must catch each, every run, is ``conformance/test_contended_pairs.py`` (``conformance/protocol_pairs.py``).

Each comes with a proof, as in ``broken_protocol`` (Note [A proof drives both drivers] there): the racing calls made
from two threads, the waiting one repeating its call until it is taken (so it lands at the first moment the records
allow), up to ``TRIES`` times, returning what the protocol forbids the first time it shows, else what it allows.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from extensible_kv.drivers.host import (
    MAP_ANONYMOUS,
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
from extensible_kv.drivers.records import check_alignment, check_free, check_one_mapping, mapped_parts
from extensible_kv.errors import DriverError, DriverOutOfMemory
from extensible_kv.reaper import busy
from tests.meta.broken_protocol import BUDGET, RESERVED, Case, check_map, intact, kernel_ranges

TRIES = 200
"""Races a proof runs at most; the first that shows the break ends it."""


class _Unlocked(HostDriver):
    def __init__(self, name: str) -> None:
        super().__init__(name=name, budget_bytes=BUDGET)


class UnmapUnlocked(_Unlocked):
    """[P-threads] ``unmap`` forgets the mapping in its records under the lock, lets go of it, then puts the range
    back to reserved in the kernel: a ``map`` of the range by another thread in between is recorded, mapped, then
    wiped by this ``unmap``'s kernel call."""

    def unmap(self, va: int, size: int) -> None:
        self.check_call("unmap", va=va, size=size)
        with busy(), self.locked(): self._forget_one(va, size)  # fmt: skip
        if libc().mmap(va, size, PROT_NONE, RESERVED, -1, 0) != va:
            self.fail("unmap", f"mmap(PROT_NONE, MAP_FIXED, {va:#x}, {size})")

    def _forget_one(self, va: int, size: int) -> None:
        live = self.mappings.get(va)
        check_one_mapping(va, size, live and live[0])
        self.forget(va, live)


class MapUnlocked(_Unlocked):
    """[P-threads] ``map`` checks and records the mapping under the lock, lets go of it, then maps the memfd: an
    ``unmap`` (or a ``set_access``) of the range by another thread in between acts on the reserved range, and this
    ``map``'s kernel call then leaves a mapping the records do not have (or no access where they say access)."""

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        self.check_call("map", va=va, size=size, offset=offset)
        with busy(), self.locked(): self._record_map(va, size, handle)  # fmt: skip
        if libc().mmap(va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, handle.fd, offset) != va:
            self.fail("map", f"mmap(MAP_FIXED, {va:#x}, {size}, fd={handle.fd}, offset={offset})")

    def _record_map(self, va: int, size: int, handle: HostHandle) -> None:
        check_map(self, va, size, handle, 0)
        handle.maps, self.mappings[va] = handle.maps + 1, (size, handle)


class SetAccessUnlocked(_Unlocked):
    """[P-threads] ``set_access`` checks that the range is mapped under the lock, lets go of it, then ``mprotect``s:
    an ``unmap`` by another thread in between puts the range back to reserved, and the ``mprotect`` then makes that
    anonymous memory readable and writable, where the protocol says nothing is accessible."""

    def set_access(self, va: int, size: int) -> None:
        self.check_call("set_access", va=va, size=size)
        with busy(), self.locked(): self._mapped(va, size)  # fmt: skip
        if libc().mprotect(va, size, PROT_READ | PROT_WRITE) != 0:
            self.fail("set_access", f"mprotect({va:#x}, {size}, RW)")

    def _mapped(self, va: int, size: int) -> None:
        mapped_parts(va, size, ((m, s) for m, (s, _) in self.mappings.items()))


class ReleaseUnlocked(_Unlocked):
    """[P-threads] ``release`` checks its records under the lock, lets go of it, closes the memfd, then marks the
    handle released: two threads releasing one handle both pass the check, and the second closes a descriptor that is
    no longer open (an ``OSError``, or worse, a descriptor another call opened meanwhile)."""

    def release(self, handle: HostHandle) -> None:
        self.check_call("release")
        with busy(), self.locked(): fd = self._unreleased_fd(handle)  # fmt: skip
        os.close(fd)
        with busy(), self.locked(): self._mark_released(handle)  # fmt: skip

    @staticmethod
    def _unreleased_fd(handle: HostHandle) -> int:
        if handle.released:
            raise DriverError("release", f"{handle!r} was already released")
        return handle.fd

    def _mark_released(self, handle: HostHandle) -> None:
        handle.fd, handle.released = -1, True
        self.drop_if_unused(handle)


class FreeUnlocked(_Unlocked):
    """[P-threads] ``free`` checks its records under the lock, lets go of it, unmaps the range, then forgets the
    reservation: two threads freeing one reservation both pass the check and both succeed, and a ``map`` into it by
    another thread in between is taken and mapped where the kernel holds nothing."""

    def free(self, va: int, size: int) -> None:
        self.check_call("free", va=va, size=size)
        with busy(), self.locked(): self._free_allowed(va, size)  # fmt: skip
        if libc().munmap(va, size) != 0:
            self.fail("free", f"munmap({va:#x}, {size})")
        with busy(), self.locked(): self.reservations.pop(va, None)  # fmt: skip

    def _free_allowed(self, va: int, size: int) -> None:
        check_free(va, size, self.reservations.get(va) == size, self.mappings)


class CreateUnlocked(_Unlocked):
    """[P-threads] ``create`` checks the budget under the lock, lets go of it, makes the memfd, then counts its bytes:
    two threads creating at once, with room for one handle, both pass the check, and both are taken."""

    def create(self, size: int) -> HostHandle:
        self.check_call("create", size=size)
        with busy(), self.locked(): self._room_for(size)  # fmt: skip
        handle = self.do_create(size)
        with busy(), self.locked(): self._add(size)  # fmt: skip
        return handle

    def _room_for(self, size: int) -> None:
        if self.held + size > self.total:
            raise DriverOutOfMemory("create", f"{size} bytes asked, {self.total - self.held} of {self.total} free")

    def _add(self, size: int) -> None:
        self.held += size  # counted, past the budget too: mem_info's free bytes may go below zero


class ReserveUnlocked(_Unlocked):
    """[P-threads] ``reserve`` finds an aligned hole (an ``mmap`` it gives back at once) and records it under the
    lock, lets go of it, then reserves the hole with ``MAP_FIXED``: another thread's ``reserve`` in between is handed
    the same hole by the kernel, and the two reservations overlap."""

    def reserve(self, size: int, alignment: int) -> int:
        self.check_call("reserve", size=size, alignment=alignment)
        check_alignment(alignment, self.granularity())
        alignment = max(alignment, PAGE_BYTES)
        with busy(), self.locked(): va = self._hole(size, alignment)  # fmt: skip
        if libc().mmap(va, size, PROT_NONE, RESERVED, -1, 0) != va:
            self.fail("reserve", f"mmap(MAP_FIXED, {va:#x}, {size})", oom=True)
        return va

    def _hole(self, size: int, alignment: int) -> int:
        span = size + alignment
        raw = libc().mmap(None, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        libc().munmap(raw, span)
        va = -(-raw // alignment) * alignment
        self.reservations[va] = size
        return va


def unmap_unlocked() -> HostDriver:
    return UnmapUnlocked("broken-unmap-unlocked")


def map_unlocked() -> HostDriver:
    return MapUnlocked("broken-map-unlocked")


def set_access_unlocked() -> HostDriver:
    return SetAccessUnlocked("broken-set-access-unlocked")


def release_unlocked() -> HostDriver:
    return ReleaseUnlocked("broken-release-unlocked")


def free_unlocked() -> HostDriver:
    return FreeUnlocked("broken-free-unlocked")


def create_unlocked() -> HostDriver:
    return CreateUnlocked("broken-create-unlocked")


def reserve_unlocked() -> HostDriver:
    return ReserveUnlocked("broken-reserve-unlocked")


# -- proofs ------------------------------------------------------------------------------------------------------------
def _pair(once: Callable[[], object], spin: Callable[[], bool]) -> None:
    """``once()`` in one thread while the other calls ``spin()`` from the same start until it returns True, or until
    ``once`` has returned and it was called once more."""
    barrier, done = threading.Barrier(2), threading.Event()

    def first() -> None:
        barrier.wait()
        try:
            once()
        except Exception:  # noqa: BLE001 - the proof looks at the driver afterwards
            pass
        done.set()

    def second() -> None:
        barrier.wait()
        while True:
            finished = done.is_set()
            try:
                if spin():
                    return
            except Exception:  # noqa: BLE001 - a refusal: again
                pass
            if finished:
                return

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _maps_at(va: int) -> str:
    """What the kernel maps at ``va``: ``memfd`` (a shared mapping of a memfd), ``reserved``, ``anonymous rw`` or
    ``nothing``."""
    for lo, hi, perms, path in kernel_ranges():
        if lo <= va < hi:
            if path:
                return "memfd"
            return "reserved" if perms == "---p" else f"anonymous {perms}"
    return "nothing"


def _taken(call: Callable[[], object]) -> bool:
    call()
    return True


def prove_map_in_unmaps_gap(make: Callable[[], HostDriver]) -> str:
    """A mapping unmapped by one thread while another maps the range again as soon as it may: the kernel maps the
    memfd wherever the second map was taken (``memfd``), else what it shows."""
    d = make()
    g = d.granularity()
    va, a, b = d.reserve(g, g), d.create(g), d.create(g)
    try:
        for _ in range(TRIES):
            d.map(va, g, a, 0)
            _pair(lambda: d.unmap(va, g), lambda: _taken(lambda: d.map(va, g, b, 0)))
            seen = _maps_at(va) if va in d.mappings else "memfd"
            for m in list(d.mappings):
                d.unmap(m, g)
            if seen != "memfd":
                return seen
        return "memfd"
    finally:
        d.release(a)
        d.release(b)
        d.free(va, g)


def prove_unmap_in_maps_gap(make: Callable[[], HostDriver]) -> str:
    """A range mapped by one thread while another unmaps it as soon as it may: the kernel shows ``reserved`` after
    both, else what it shows."""
    d = make()
    g = d.granularity()
    va, a = d.reserve(g, g), d.create(g)
    try:
        for _ in range(TRIES):
            _pair(lambda: d.map(va, g, a, 0), lambda: _taken(lambda: d.unmap(va, g)))
            seen = _maps_at(va)
            if va in d.mappings:
                d.unmap(va, g)
            if seen != "reserved":
                libc().mmap(va, g, PROT_NONE, RESERVED, -1, 0)
                return seen
        return "reserved"
    finally:
        d.release(a)
        d.free(va, g)


def prove_unmap_in_set_access_gap(make: Callable[[], HostDriver]) -> str:
    """Access granted again and again by one thread while another unmaps the range: the kernel shows ``reserved``
    after both, else what it shows."""
    d = make()
    g = d.granularity()
    va, a = d.reserve(g, g), d.create(g)
    try:
        for _ in range(TRIES):
            d.map(va, g, a, 0)
            _pair(lambda: d.unmap(va, g), lambda: not _taken(lambda: d.set_access(va, g)))
            seen = _maps_at(va)
            if seen != "reserved":
                libc().mmap(va, g, PROT_NONE, RESERVED, -1, 0)
                return seen
        return "reserved"
    finally:
        d.release(a)
        d.free(va, g)


def _both(work: Callable[[int], object]) -> list[str]:
    """``work(0)`` and ``work(1)`` from two threads lined up by a barrier: ``done`` or the error's type each."""
    barrier, out = threading.Barrier(2), ["", ""]

    def run(i: int) -> None:
        barrier.wait()
        try:
            work(i)
            out[i] = "done"
        except Exception as exc:  # noqa: BLE001 - the type is what the proof looks at
            out[i] = type(exc).__name__

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(out)


def prove_release_twice_at_once(make: Callable[[], HostDriver]) -> list[str]:
    """One handle released by two threads at once: one ``done`` and one ``DriverError``, else what they raised."""
    d = make()
    for _ in range(TRIES):
        h = d.create(d.granularity())
        seen = _both(lambda i, h=h: d.release(h))
        if seen != ["DriverError", "done"]:
            return seen
    return ["DriverError", "done"]


def prove_free_twice_at_once(make: Callable[[], HostDriver]) -> list[str]:
    """One reservation freed by two threads at once: one ``done`` and one ``DriverError``, else what they did."""
    d = make()
    g = d.granularity()
    for _ in range(TRIES):
        va = d.reserve(g, g)
        seen = _both(lambda i, va=va: d.free(va, g))
        if seen != ["DriverError", "done"]:
            return seen
    return ["DriverError", "done"]


def prove_create_twice_with_room_for_one(make: Callable[[], HostDriver]) -> list[str]:
    """Two threads creating one granule each with room for one: one ``done`` and one ``DriverOutOfMemory``, else
    what they did."""
    d = make()
    g = d.granularity()
    d.held = d.total - g  # the budget full but for one granule (a proof's shortcut: no filler handle)
    try:
        for _ in range(TRIES):
            made: list[HostHandle] = []
            seen = _both(lambda i: made.append(d.create(g)))
            for h in made:
                d.release(h)
            d.held = d.total - g
            if seen != ["DriverOutOfMemory", "done"]:
                return seen
        return ["DriverOutOfMemory", "done"]
    finally:
        d.held = 0


def prove_reserve_beside_reserve(make: Callable[[], HostDriver]) -> str:
    """Two threads reserving at once, again and again: ``disjoint``, or ``overlapping`` the first time two ranges
    they hold overlap."""
    d = make()
    g = d.granularity()
    for _ in range(TRIES):
        got: list[list[int]] = [[], []]
        _both(lambda i: got[i].append(d.reserve(4 * g, g)))
        vas = [va for side in got for va in side]
        overlap = len(vas) == 2 and abs(vas[0] - vas[1]) < 4 * g
        for va in vas:
            try:
                d.free(va, 4 * g)
            except DriverError:
                libc().munmap(va, 4 * g)
        if overlap:
            return "overlapping"
    return "disjoint"


CASES: dict[str, Case] = {
    "unmap_unlocked": Case(unmap_unlocked, "P-threads", prove_map_in_unmaps_gap, "memfd"),
    "map_unlocked": Case(map_unlocked, "P-threads", prove_unmap_in_maps_gap, "reserved"),
    "set_access_unlocked": Case(set_access_unlocked, "P-threads", prove_unmap_in_set_access_gap, "reserved"),
    "release_unlocked": Case(release_unlocked, "P-threads", prove_release_twice_at_once, ["DriverError", "done"]),
    "free_unlocked": Case(free_unlocked, "P-threads", prove_free_twice_at_once, ["DriverError", "done"]),
    "create_unlocked": Case(
        create_unlocked, "P-threads", prove_create_twice_with_room_for_one, ["DriverOutOfMemory", "done"]
    ),
    "reserve_unlocked": Case(reserve_unlocked, "P-threads", prove_reserve_beside_reserve, "disjoint"),
}

__all__ = ["CASES", "intact"]
