"""Broken drivers of ``free`` (P-free, P-free-kernel, P-free-refused)."""

from __future__ import annotations

from collections import deque

from extensible_kv.drivers import host
from extensible_kv.drivers.records import check_alignment, check_free
from extensible_kv.errors import DriverError
from extensible_kv.reaper import busy
from tests.meta.broken.base import GIB, Broken, align_up


class FreeOfASubrange(Broken):
    """free() takes any range that starts at a reservation, releasing only that part."""

    breaks = "P-free-refused"
    caught_by = ("test_free_of_anything_but_one_empty_reservation_is_refused_and_changes_nothing",)

    def free(self, va: int, size: int) -> None:
        if va in self.reservations and size < self.reservations[va]:
            self.reservations[va + size] = self.reservations[va] - size
            self.reservations[va] = size
        super().free(va, size)


class FreeKeepsTheRange(Broken):
    """free() forgets the reservation but never returns the address range to the kernel."""

    breaks = "P-free-kernel"
    caught_by = ("test_free_returns_the_range_to_the_kernel",)

    def free(self, va: int, size: int) -> None:
        self.check_call("free", va=va, size=size)
        if self.reservations.get(va) != size or any(va <= m < va + size for m in self.mappings):
            raise DriverError("free", f"[{va:#x}, +{size}) is not one empty reservation")
        del self.reservations[va]


class FreeKeepsTheAlignmentPadding(Broken):
    """Address space. Breaks "``free(va, size)`` returns exactly that range" (all the address space ``reserve``
    took): ``reserve`` keeps the over-reservation it made to align the range, and ``free`` gives back only
    ``[va, va+size)``, so every aligned reservation leaks up to ``alignment`` bytes of address space."""

    breaks = "P-free-kernel"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def reserve(self, size: int, alignment: int) -> int:
        self.check_call("reserve", size=size, alignment=alignment)
        check_alignment(alignment, self.granularity())
        alignment = max(alignment, host.PAGE_BYTES)
        span = size + alignment
        raw = host.libc().mmap(
            None, span, host.PROT_NONE, host.MAP_PRIVATE | host.MAP_ANONYMOUS | host.MAP_NORESERVE, -1, 0
        )
        if raw in (None, host.MAP_FAILED):
            self.fail("reserve", f"mmap(PROT_NONE, {span} bytes)", oom=True)
        va = align_up(raw, alignment)
        with busy(), self.locked():
            self.reservations[va] = size
        return va


class FreeTrustsItsRecordedSize(Broken):
    """P-free-refused. Breaks "Refused, changing nothing: ... a range around one": it frees the size it recorded for
    the reservation at ``va`` and checks the caller's size only against leaking (a size below the reservation's is
    refused), so ``free`` of a range that starts at a reservation and runs past its end frees the reservation."""

    breaks = "P-free-refused"
    caught_by = ("test_every_shape_of_every_range_call_matches_the_model",)

    def do_free(self, va: int, size: int) -> None:
        reserved = self.reservations.get(va)
        if reserved is not None and reserved < size:  # the bug: only a smaller size is refused
            size = reserved
        super().do_free(va, size)


class ReservationCountsMappingsAtItsStart(Broken):
    """P-free. Breaks "Return the reservation ``[va, va+size)`` ... once nothing is mapped in it": it counts the live
    mappings of each reservation, adding one at ``map`` (the reservation that holds the range) but taking one away at
    ``unmap`` only when a reservation starts at the mapping's address; a reservation that had a mapping anywhere but
    at its start keeps counting it, and ``free`` refuses it once it is empty again."""

    breaks = "P-free"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    state = {"_mapped_in": dict}

    def do_map(self, va: int, size: int, handle: host.HostHandle, offset: int) -> None:
        super().do_map(va, size, handle, offset)
        for r_va, r_size in self.reservations.items():
            if r_va <= va < r_va + r_size:
                self._mapped_in[r_va] = self._mapped_in.get(r_va, 0) + 1

    def forget(self, va: int, live: tuple[int, host.HostHandle]) -> None:
        super().forget(va, live)
        if va in self._mapped_in:  # the bug: the reservation is looked up by the mapping's address
            self._mapped_in[va] -= 1

    def do_free(self, va: int, size: int) -> None:
        if self._mapped_in.get(va):
            raise DriverError("free", f"reservation {va:#x} still has {self._mapped_in[va]} mapping(s)")
        super().do_free(va, size)
        self._mapped_in.pop(va, None)


class FreeInGibChunks(Broken):
    """P-free-kernel. Breaks "Afterwards nothing of the range ... is held: on the host the kernel maps nothing there":
    a reservation larger than 1 GiB is given back in ``munmap`` calls of at most 1 GiB (a native limit), in a loop over
    ``range(va, va + size - CHUNK, CHUNK)`` that stops one chunk short, so the last GiB (or less) stays reserved in the
    kernel. Reservations of 1 GiB and less are given back whole."""

    breaks = "P-free-kernel"
    caught_by = ("test_reservations_of_every_size_class_are_aligned_exact_and_disjoint",)

    CHUNK = GIB

    def do_free(self, va: int, size: int) -> None:
        if size <= self.CHUNK:
            super().do_free(va, size)
            return
        check_free(va, size, self.reservations.get(va) == size, self.mappings)
        del self.reservations[va]
        for at in range(va, va + size - self.CHUNK, self.CHUNK):
            if host.libc().munmap(at, min(self.CHUNK, va + size - at)) != 0:
                self.fail("free", f"munmap({at:#x}, {min(self.CHUNK, va + size - at)})")


class FreeChecksTheLast48Maps(Broken):
    """P-free-refused. Breaks "Refused, changing nothing: a reservation with live mappings": to spare a scan of every
    mapping, ``free`` looks for live mappings inside the reservation among the 48 most recent ``map`` calls still live
    (a ring it keeps), so a reservation whose mappings are all older than 48 later maps is freed with them: the kernel
    range goes, and the mappings' records go with it. With fewer than 48 maps since, a mapped reservation is refused."""

    breaks = "P-free-refused"
    caught_by = ("test_every_call_is_judged_as_the_model_says_at_every_count_of_live_objects",)

    RECENT = 48

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self._recent: deque[int] = deque(maxlen=self.RECENT)

    def do_map(self, va: int, size: int, handle: host.HostHandle, offset: int) -> None:
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
        if host.libc().munmap(va, size) != 0:
            self.reservations[va] = size
            self.fail("free", f"munmap({va:#x}, {size})")
        for m, live in inside:  # the kernel took them with the range
            self.forget(m, live)
