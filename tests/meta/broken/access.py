"""Broken drivers of ``set_access`` and ``accessible`` (P-access, P-access-refused, P-accessible, P-accessible-
kernel).
"""

from __future__ import annotations

from extensible_kv.drivers import host
from extensible_kv.drivers.records import mapped_parts
from extensible_kv.errors import DriverError
from extensible_kv.reaper import busy
from tests.meta.broken.base import Broken, check_map, grant, kernel_ranges, mmap_handle


class RecordsOnly(Broken):
    """map() keeps its records but leaves the kernel's range reserved, and accessible() answers from the records:
    set_access opens the reserved anonymous pages, so bytes round-trip while the kernel maps no memfd at all."""

    breaks = "P-accessible-kernel"
    caught_by = (
        "test_a_handle_mapped_at_two_addresses_shows_the_same_bytes_through_both",
        "test_the_kernel_maps_what_accessible_reports",
    )

    state = {"_granted": set}

    def map(self, va: int, size: int, handle: host.HostHandle, offset: int = 0) -> None:
        super().map(va, size, handle, offset)
        host.libc().mmap(
            va, size, host.PROT_NONE, host.MAP_PRIVATE | host.MAP_ANONYMOUS | host.MAP_NORESERVE | host.MAP_FIXED, -1, 0
        )

    def set_access(self, va: int, size: int) -> None:
        super().set_access(va, size)
        self._granted.update(range(va, va + size, self.granularity()))

    def unmap(self, va: int, size: int) -> None:
        super().unmap(va, size)
        self._granted.difference_update(range(va, va + size, self.granularity()))

    def accessible(self, va: int) -> bool:
        return va // self.granularity() * self.granularity() in self._granted


class SetAccessOnPartlyMapped(Broken):
    """set_access() opens any range, mapped or not."""

    breaks = "P-access-refused"
    caught_by = ("test_set_access_on_a_range_not_fully_mapped_is_refused_and_changes_nothing",)

    def set_access(self, va: int, size: int) -> None:
        host.libc().mprotect(va, size, host.PROT_READ | host.PROT_WRITE)


class SetAccessFirstMappingOnly(Broken):
    """Several mappings. Breaks "``set_access(va, size)`` makes a fully mapped range readable and writable": over a
    range made by several map calls it checks the whole range but grants only the mapping that starts at ``va``."""

    breaks = "P-access"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def set_access(self, va: int, size: int) -> None:
        with busy(), self.locked():
            mapped_parts(va, size, ((m, s) for m, (s, _) in self.mappings.items()))
            first = self.mappings.get(va)
        super().set_access(va, min(size, first[0]) if first else size)


class SetAccessChecksTheEndsOnly(Broken):
    """Several mappings. Breaks "A range with any granule unmapped is refused" (a gap between mappings): it refuses
    only a range whose first or last granule is unmapped, and opens a gap between two mappings."""

    breaks = "P-access-refused"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def set_access(self, va: int, size: int) -> None:
        self.check_call("set_access", va=va, size=size)
        g = self.granularity()
        with busy(), self.locked():
            ends = [a for a in (va, va + size - g) if not any(m <= a < m + s for m, (s, _) in self.mappings.items())]
        if ends:
            raise DriverError("set_access", f"[{va:#x}, +{size}) is not mapped at {ends[0]:#x}")
        if host.libc().mprotect(va, size, host.PROT_READ | host.PROT_WRITE) != 0:
            self.fail("set_access", f"mprotect({va:#x}, {size}, RW)")


class AccessibleAnyNamedReadWrite(Broken):
    """Access state. Breaks "[P-accessible] Whether the granule at ``va`` (any address in it, also one outside every
    reservation) is mapped and readable/writable": it asks the kernel for a read-write mapping with a path but not for
    one of its own memfds, so a file, the heap or the stack outside every reservation reads as accessible."""

    breaks = "P-accessible"
    caught_by = ("test_what_the_driver_never_made_is_refused_or_not_accessible",)

    def accessible(self, va: int) -> bool:
        self.check_call("accessible", va=va)
        return any(lo <= va < hi and perms.startswith("rw") and path for lo, hi, perms, path in kernel_ranges())


class OffsetMappingsAreReadable(Broken):
    """P-accessible-kernel. Breaks "``/proc/self/maps`` shows ... a mapped granule without access as a shared mapping of
    it without access ...; touching any granule that is not accessible faults": a mapping at a non-zero offset (a view
    into a handle) is made ``PROT_READ``, to let the kernel share its page-cache pages at once (read-ahead), until
    ``set_access`` grants it; ``accessible`` says ``False`` (it is not writable), but reading it does not fault.
    Mappings at offset 0 are made without access."""

    breaks = "P-accessible-kernel"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def do_map(self, va: int, size: int, handle: host.HostHandle, offset: int) -> None:
        if not offset:
            super().do_map(va, size, handle, offset)
            return
        check_map(self, va, size, handle, offset)
        mmap_handle(self, va, size, handle, offset, prot=host.PROT_READ)


class SetAccessGrantsTheMappedPrefix(Broken):
    """P-access-refused. Breaks "Refused, changing nothing: a range with any granule unmapped (partly mapped from below
    or above, a gap between mappings, nothing mapped)": ``set_access`` grants mapping after mapping in address order (as
    a per-mapping native call is made) and stops at the first granule it finds unmapped, refusing then; what it granted
    before that stays granted. A range whose first granule is unmapped is refused with nothing granted."""

    breaks = "P-access-refused"
    caught_by = ("test_every_range_over_mappings_and_gaps_is_judged_as_the_model_says",)

    def do_set_access(self, va: int, size: int) -> None:
        end, at = va + size, va
        for m_va, m_size in sorted((m, s) for m, (s, _) in self.mappings.items() if m < end and va < m + s):
            if max(m_va, va) != at:
                break
            hi = min(m_va + m_size, end)
            grant(at, hi - at)
            at = hi
        if at != end:
            raise DriverError("set_access", f"[{va:#x}, +{size}) is not fully mapped ({at - va} bytes from its start)")


class AccessibleFromRecordsPast64(Broken):
    """P-accessible. Breaks "Whether the granule at ``va`` ... is mapped and readable/writable, from the driver's or the
    kernel's own state": reading ``/proc/self/maps`` is slow once many mappings are live, so with more than 64 live
    mappings it answers from its own record of the mappings ``set_access`` granted, and ``unmap`` does not take a
    mapping out of that record: a granule unmapped and mapped again (without access) is answered accessible. With 64
    mappings or fewer it asks the kernel."""

    breaks = "P-accessible"
    caught_by = ("test_every_call_is_judged_as_the_model_says_at_every_count_of_live_objects",)

    FROM_RECORDS = 64

    state = {"_granted": set}

    def do_set_access(self, va: int, size: int) -> None:
        super().do_set_access(va, size)
        self._granted.update(m for m, (s, _) in self.mappings.items() if m < va + size and va < m + s)

    def accessible(self, va: int) -> bool:
        self.check_call("accessible", va=va)
        with busy(), self.locked():
            if len(self.mappings) > self.FROM_RECORDS:
                return any(m <= va < m + s and m in self._granted for m, (s, _) in self.mappings.items())
        return super().accessible(va)


class AccessibleRoundsUp(Broken):
    """P-accessible. Breaks "Whether the granule at ``va`` (any address in it, ...) is mapped and readable/writable":
    it asks the kernel about the start of the granule, computed with the ceiling division it uses for sizes, so an
    address inside a granule (not at its start) is answered for the next granule. Granule starts are answered
    right."""

    breaks = "P-accessible"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def accessible(self, va: int) -> bool:
        self.check_call("accessible", va=va)
        g = self.granularity()
        return super().accessible(-(-va // g) * g)


class SetAccessLooksUpItsStart(Broken):
    """P-access. Breaks "Part of a mapping is granted by a driver whose native call takes it (the host's mprotect) and
    refused, changing nothing, by one whose native call takes whole mappings only (``cuMemSetAccess``); either way, the
    same for every call": ``set_access`` looks up the mapping at the range's start, as a backend does that keys its
    per-mapping state by address, and refuses a range that starts inside a mapping; a range that starts at a mapping's
    start is granted, also when it ends inside one. Fully mapped ranges starting at a mapping are granted."""

    breaks = "P-access"
    caught_by = ("test_access_to_part_of_a_mapping_covers_that_part_only",)

    def do_set_access(self, va: int, size: int) -> None:
        mapped_parts(va, size, ((m, s) for m, (s, _) in self.mappings.items()))
        if va not in self.mappings:
            raise DriverError("set_access", f"{va:#x} is not the start of a mapping")
        super().do_set_access(va, size)
