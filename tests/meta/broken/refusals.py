"""Broken drivers of refusals: their error, and the state they leave (P-refusal, P-refusal-names, P-refusal-
unchanged, P-bad-value).
"""

from __future__ import annotations

import bisect
import os

from extensible_kv.drivers import host
from extensible_kv.drivers.records import check_alignment
from extensible_kv.errors import DriverError
from tests.meta.broken.base import RESERVE_FLAGS, Broken, revoke_after_the_first_granule


class MapRefusesAfterMapping(Broken):
    """map() of a range running past its reservation's end maps the part inside first, then refuses."""

    breaks = "P-refusal-unchanged"
    caught_by = ("test_map_outside_one_reservation_or_over_a_mapping_is_refused_and_changes_nothing",)

    def map(self, va: int, size: int, handle: host.HostHandle, offset: int = 0) -> None:
        for r_va, r_size in self.reservations.items():
            if r_va <= va < r_va + r_size < va + size:
                host.libc().mmap(
                    va, r_va + r_size - va, host.PROT_NONE, host.MAP_SHARED | host.MAP_FIXED, handle.fd, offset
                )
        super().map(va, size, handle, offset)


class UnmapRefusesAfterUnmapping(Broken):
    """unmap() returns the range to reserved first, then refuses a range that is not exactly one mapping."""

    breaks = "P-refusal-unchanged"
    caught_by = ("test_unmap_of_anything_but_one_whole_mapping_is_refused_and_changes_nothing",)

    def unmap(self, va: int, size: int) -> None:
        host.libc().mmap(
            va, size, host.PROT_NONE, host.MAP_PRIVATE | host.MAP_ANONYMOUS | host.MAP_NORESERVE | host.MAP_FIXED, -1, 0
        )
        super().unmap(va, size)


class SetAccessRefusesAfterOpening(Broken):
    """set_access() opens the range first, then refuses one that is not fully mapped."""

    breaks = "P-refusal-unchanged"
    caught_by = ("test_set_access_on_a_range_not_fully_mapped_is_refused_and_changes_nothing",)

    def set_access(self, va: int, size: int) -> None:
        host.libc().mprotect(va, size, host.PROT_READ | host.PROT_WRITE)
        super().set_access(va, size)


class CreateLeaksWhenRefused(Broken):
    """create() past the budget makes the memfd first and leaves it open when it refuses."""

    breaks = "P-refusal-unchanged"
    caught_by = ("test_create_past_free_memory_raises_driver_out_of_memory_and_leaks_nothing",)

    def create(self, size: int) -> host.HostHandle:
        if self.held + size > self.total:
            fd = os.memfd_create(host.MEMFD_NAME, os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        return super().create(size)


class RefusedUnmapRevokesTheTail(Broken):
    """Refusals. Breaks "[a refusal] leaves the driver's state as it was before the call: what is ... accessible":
    a refused ``unmap`` (part of a mapping, a mapping and more) leaves every mapped granule of the range after its
    first without access."""

    breaks = "P-refusal-unchanged"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def unmap(self, va: int, size: int) -> None:
        live = self.mappings.get(va)
        if live is None or live[0] != size:
            revoke_after_the_first_granule(self, va, size)
        super().unmap(va, size)


class UnmapLooksUpTheOwner(Broken):
    """Refusals. Breaks "[P-refusal] Every refusal the protocol names raises ``DriverError`` whose ``operation`` is
    the method called": ``unmap`` first looks up the reservation that holds ``va`` (for its message) among the
    reservations' starts, and with no live reservation the lookup raises ``IndexError`` where P-unmap-refused wants
    a ``DriverError``."""

    breaks = "P-refusal"
    caught_by = ("test_what_the_driver_never_made_is_refused_or_not_accessible",)

    def unmap(self, va: int, size: int) -> None:
        starts = sorted(self.reservations)
        owner = starts[bisect.bisect_right(starts, va) - 1]  # IndexError when no reservation is live
        try:
            super().unmap(va, size)
        except DriverError as exc:
            raise DriverError("unmap", f"{exc.detail} in the reservation at {owner:#x}", exc.code) from exc


class MapTakesABoolOffset(Broken):
    """P-bad-value. Breaks "A value that is not an ``int`` (a ``bool``, ...) ... is refused by ... ``map``": its own
    check of the offset is ``isinstance(offset, int)``, which a ``bool`` passes, so ``map(..., offset=False)`` maps at
    offset 0 (``offset=True`` still fails, natively, as a misaligned offset)."""

    breaks = "P-bad-value"
    caught_by = ("test_every_bad_value_of_every_call_is_refused_and_named",)

    def map(self, va: int, size: int, handle: host.HostHandle, offset: int = 0) -> None:
        if isinstance(offset, bool):
            offset = int(offset)
        super().map(va, size, handle, offset)


class SecondReleaseNamesTheClosedFd(Broken):
    """P-refusal-names. Breaks "Its message names what was refused: ... the handle as ``str`` or ``repr`` shows it":
    the refusal of a second ``release`` of a handle that is still mapped names the handle by its file descriptor field,
    which the first release set to -1, so the message names no handle (``fd -1``). A second release of a handle mapped
    nowhere keeps the host's message."""

    breaks = "P-refusal-names"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def do_release(self, handle: host.HostHandle) -> None:
        if handle.released and handle.maps:
            raise DriverError("release", f"fd {handle.fd} is still mapped and was already released")
        super().do_release(handle)


class FreeOfAMappedReservationNamesUnmap(Broken):
    """P-refusal. Breaks "Every refusal the protocol names raises ``DriverError`` whose ``operation`` is the method
    called": ``free`` of a reservation that still has live mappings is refused with an error whose operation is
    ``unmap`` (its message tells the caller to unmap first); every other refusal of ``free`` names ``free``."""

    breaks = "P-refusal"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def do_free(self, va: int, size: int) -> None:
        if self.reservations.get(va) == size and any(va <= m < va + size for m in self.mappings):
            raise DriverError("unmap", f"reservation {va:#x} (+{size}) still has live mappings: unmap them first")
        super().do_free(va, size)


class ReserveChecksTheAlignmentAfterTheMmap(Broken):
    """P-refusal-unchanged. Breaks "A refused call leaves every observable as it was: ... the memory and address space
    the kernel holds": ``reserve`` makes its padded ``mmap`` first and checks the alignment where it works the padding
    out, so a reservation refused for an alignment that is not a multiple of the granularity leaves its whole padded
    range reserved in the kernel, owned by no one. Every other refusal of ``reserve`` comes before the ``mmap``."""

    breaks = "P-refusal-unchanged"
    caught_by = ("test_every_bad_value_of_every_call_is_refused_and_named",)

    def reserve(self, size: int, alignment: int) -> int:
        self.check_call("reserve", size=size, alignment=alignment)
        if alignment % self.granularity():
            host.libc().mmap(None, size + max(alignment, host.PAGE_BYTES), host.PROT_NONE, RESERVE_FLAGS, -1, 0)
            check_alignment(alignment, self.granularity())
        return super().reserve(size, alignment)
