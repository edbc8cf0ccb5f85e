"""Broken drivers of ``create`` (P-create, P-create-memory, P-create-oom, P-oom)."""

from __future__ import annotations

import errno
import os

from extensible_kv.drivers import host
from extensible_kv.drivers.records import check_inside, check_no_overlap
from extensible_kv.errors import DriverError, DriverOutOfMemory
from tests.meta.broken.base import Broken


class BudgetIgnored(Broken):
    """create() never runs out: the budget is not enforced."""

    breaks = "P-create-oom"
    caught_by = (
        "test_committing_past_the_device_memory_raises_commit_out_of_memory",
        "test_create_past_free_memory_raises_driver_out_of_memory_and_leaks_nothing",
    )

    def create(self, size: int) -> host.HostHandle:
        self.total += size
        try:
            return super().create(size)
        finally:
            self.total -= size


class CreateRefusesAnExactFit(Broken):
    """Memory accounting. Breaks "[P-create-oom] When memory is short (more than the free bytes on the host ...):
    ``DriverOutOfMemory`` naming ``create``": it counts a create of exactly the free bytes as short, and refuses it."""

    breaks = "P-create-oom"
    caught_by = ("test_exactly_the_free_bytes_can_be_taken",)

    def charge(self, size: int, counted: list[int]) -> None:
        if size > 0 and self.held + size == self.total:
            raise DriverOutOfMemory("create", f"{size} bytes asked, {self.total - self.held} free", errno.ENOMEM)
        super().charge(size, counted)


class MemfdRoundsUpToAPowerOfTwo(Broken):
    """P-create-memory. Breaks "(on the host exactly ``size``, and the kernel holds one new memfd of ``size`` bytes)":
    its memfds come in power-of-two sizes (a bucket allocator), so a handle of 3 granules is a memfd of 4 (its
    accounting still says ``size``)."""

    breaks = "P-create-memory"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def do_create(self, size: int) -> host.HostHandle:
        handle = super().do_create(size)
        bucket = 1 << (size - 1).bit_length()
        if bucket != size:
            os.ftruncate(handle.fd, bucket)
        return handle


class CreatePastTotalIsNotOutOfMemory(Broken):
    """P-create-oom. Breaks "When memory is short (... more than ``total`` anywhere): ``DriverOutOfMemory`` naming
    ``create``": a size larger than the whole memory is refused as an invalid argument, a plain ``DriverError``."""

    breaks = "P-create-oom"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def create(self, size: int) -> host.HostHandle:
        if isinstance(size, int) and not isinstance(size, bool) and self.total < size < 1 << 63:
            raise DriverError("create", f"size {size} exceeds the device's {self.total} bytes")
        return super().create(size)


class ShortByReleasedHandlesIsAPlainError(Broken):
    """P-oom. Breaks "A call refused for lack of memory raises ``DriverOutOfMemory``": a ``create`` refused for lack of
    memory while some released handle is still mapped raises a plain ``DriverError`` telling the caller to unmap the
    released handles (whose bytes come back once they are unmapped), as a more helpful error; with no released handle
    still mapped, the refusal is ``DriverOutOfMemory``."""

    breaks = "P-oom"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def charge(self, size: int, counted: list[int]) -> None:
        if size > 0 and self.held + size > self.total:
            pending = {id(h): h.size for _, h in self.mappings.values() if h.released}
            if pending:
                raise DriverError(
                    "create",
                    f"{size} bytes asked, {self.total - self.held} free; {sum(pending.values())} bytes are held by "
                    "released handles still mapped: unmap them first",
                )
        super().charge(size, counted)


class HandleTailRefusedOffByOne(Broken):
    """P-create. Breaks "``map`` takes any part of it within ``size`` bytes": the check of a ``map`` at a non-zero
    offset compares ``offset + size`` with the handle's size with ``>=``, so a part that ends exactly at the handle's
    end (its last granules) is refused as past it. A map at offset 0, the whole handle among them, and parts that end
    before the handle's end are taken."""

    breaks = "P-create"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def do_map(self, va: int, size: int, handle: host.HostHandle, offset: int) -> None:
        if offset and not handle.released and offset + size >= handle.size:
            check_inside("map", va, size, self.reservations.items())
            check_no_overlap(va, size, ((m_va, m_size) for m_va, (m_size, _) in self.mappings.items()))
            raise DriverError("map", f"offset {offset} + size {size} exceeds the {handle.size}-byte handle")
        super().do_map(va, size, handle, offset)
