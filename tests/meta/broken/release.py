"""Broken drivers of ``release`` (P-release-once, P-release-mapped, P-release-returns)."""

from __future__ import annotations

import os

from extensible_kv.drivers import host
from tests.meta.broken.base import FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, Broken, fallocate


class ReleaseKeepsMemory(Broken):
    """release() of a handle mapped nowhere never returns its bytes to mem_info()."""

    breaks = "P-release-returns"
    caught_by = ("test_memory_is_returned_once_unmapped_and_released",)

    def release(self, handle: host.HostHandle) -> None:
        handle.maps += 1
        try:
            super().release(handle)
        finally:
            handle.maps -= 1


class ReleaseKeepsTheMemfd(Broken):
    """release() accounts the bytes as returned but keeps the memfd open: mem_info() says free, the kernel holds."""

    breaks = "P-release-returns"
    caught_by = ("test_closing_a_tensor_returns_its_memory", "test_memory_is_returned_once_unmapped_and_released")

    def release(self, handle: host.HostHandle) -> None:
        handle.fd = os.dup(handle.fd)
        super().release(handle)


class MappedIsAFlag(Broken):
    """Memory accounting. Breaks "once a handle is released and unmapped everywhere its bytes are free again" for a
    handle mapped at two addresses: it keeps "is mapped" as a flag, not a count, so a released handle's bytes are
    counted free at its first unmap, while it is still mapped at the second address."""

    breaks = "P-release-returns"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def map(self, va: int, size: int, handle: host.HostHandle, offset: int = 0) -> None:
        super().map(va, size, handle, offset)
        handle.maps = 1

    def unmap(self, va: int, size: int) -> None:
        live = self.mappings.get(va)
        if live is not None and live[0] == size:
            live[1].maps = 1
        super().unmap(va, size)


class ReleaseReturnsWithOneMappingLeft(Broken):
    """Memory accounting. Breaks "[P-release-mapped] Drop the creation reference of ``handle``; memory that is still
    mapped stays alive, with its bytes, until unmapped everywhere": it counts a released handle's bytes free once it is
    mapped at one address or none, so they are free while its last mapping lives."""

    breaks = "P-release-mapped"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def drop_if_unused(self, handle: host.HostHandle) -> None:
        if handle.released and handle.maps <= 1 and handle.counted:
            self.held, handle.counted = self.held - handle.size, False


class ReleaseIsARefcount(Broken):
    """P-release-once. Breaks "releasing it again while it is still mapped somewhere is refused": it treats the
    creation reference and each mapping as references and a ``release`` as dropping one, so a second release of a
    handle still mapped at two addresses is accepted (and drops a mapping's reference: its bytes come back at the next
    unmap while one mapping is left)."""

    breaks = "P-release-once"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def do_release(self, handle: host.HostHandle) -> None:
        if handle.released and handle.maps >= 2:
            handle.maps -= 1
            return
        super().do_release(handle)


class ReleaseGivesBackUngrantedPages(Broken):
    """P-release-mapped. Breaks "memory that is still mapped stays alive, with its bytes, until unmapped everywhere":
    to give memory back early, ``release`` of a handle that is still mapped, but nowhere with access, punches its pages
    out of the memfd (``FALLOC_FL_PUNCH_HOLE``), reasoning that no one can read or write them any more; a mapping given
    access afterwards reads zeros. A handle released while one of its mappings has access keeps its bytes."""

    breaks = "P-release-mapped"
    caught_by = ("test_a_handles_bytes_survive_every_order_of_remap_release_alias_and_unmap",)

    def do_release(self, handle: host.HostHandle) -> None:
        mapped = [m for m, (_, h) in self.mappings.items() if h is handle]
        if not handle.released and mapped and not any(host.HostDriver.accessible(self, m) for m in mapped):
            if fallocate(handle.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, handle.size) != 0:
                self.fail("release", f"fallocate(PUNCH_HOLE, fd={handle.fd}, {handle.size})")
        super().do_release(handle)
