"""Broken drivers of calls interrupted at a line (P-interrupted)."""

from __future__ import annotations

from extensible_kv.drivers import host
from tests.meta.broken.base import Broken, check_map


class MapRecordsAfterTheKernel(Broken):
    """P-interrupted. Breaks "any other call leaves the state of the call made or of the call never made": ``map``
    makes the kernel's mapping first and records it in the next line, undoing the kernel's mapping only when the
    ``mmap`` itself fails, so an exception landing between the two lines leaves the handle's memfd mapped in the kernel
    with no record of it: ``unmap`` there is refused (nothing is mapped, say the records) while the kernel shows the
    memfd. Exceptions on the other lines leave a whole state."""

    breaks = "P-interrupted"
    caught_by = ("test_a_call_interrupted_at_any_line_is_done_whole_or_not_at_all",)

    def do_map(self, va: int, size: int, handle: host.HostHandle, offset: int) -> None:
        check_map(self, va, size, handle, offset)
        if host.libc().mmap(va, size, host.PROT_NONE, host.MAP_SHARED | host.MAP_FIXED, handle.fd, offset) != va:
            host.libc().mmap(va, size, host.PROT_NONE, host.RESERVED, -1, 0)
            self.fail("map", f"mmap(MAP_FIXED, {va:#x}, {size}, fd={handle.fd}, offset={offset})")
        handle.maps, self.mappings[va] = handle.maps + 1, (size, handle)
