"""Broken drivers of ``release`` (P-release-once, P-release-mapped, P-release-returns)."""

from __future__ import annotations

import errno
import os

from extensible_kv.drivers import host
from extensible_kv.errors import DriverOutOfMemory
from tests.meta.broken.base import Broken


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


class CreateChecksAFreeHint(Broken):
    """P-release-returns. Breaks "Once the handle is released and unmapped everywhere, the bytes ``create`` took are
    free again": ``create`` checks the budget against a free-bytes hint of its own, which ``create`` lowers and
    ``release`` raises when it gives a handle's bytes back, but which the last ``unmap`` of a handle released while
    mapped does not raise; so handles released while mapped and then unmapped (the way a tensor closes) wear the hint
    down until a ``create`` that fits is refused as out of memory (``mem_info`` itself stays right)."""

    breaks = "P-release-returns"
    caught_by = ("test_exactly_the_free_bytes_can_be_taken",)

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self._free_hint = self.total

    def charge(self, size: int, counted: list[int]) -> None:
        if size > self._free_hint:
            raise DriverOutOfMemory("create", f"{size} bytes asked, {self._free_hint} free", errno.ENOMEM)
        super().charge(size, counted)
        self._free_hint -= size

    def do_release(self, handle: host.HostHandle) -> None:
        counted = handle.counted
        super().do_release(handle)
        if counted and not handle.counted:
            self._free_hint += handle.size
