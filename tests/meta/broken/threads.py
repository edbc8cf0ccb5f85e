"""Broken drivers of calls from two threads at once (P-threads)."""

from __future__ import annotations

import os
import time

from extensible_kv.drivers import host
from extensible_kv.drivers.records import mapped_parts
from extensible_kv.reaper import busy
from tests.meta.broken.base import RACE_WINDOW_S, Broken


class SetAccessUnlocked(Broken):
    """[P-threads] ``set_access`` checks that the range is mapped under the lock, lets go of it, then ``mprotect``s:
    an ``unmap`` by another thread in between puts the range back to reserved, and the ``mprotect`` then makes that
    anonymous memory readable and writable, where the protocol says nothing is accessible."""

    breaks = "P-threads"
    caught_by = ("test_each_contended_pair_at_every_line_matches_a_serial_order",)

    def set_access(self, va: int, size: int) -> None:
        self.check_call("set_access", va=va, size=size)
        with busy(), self.locked(): self._mapped(va, size)  # fmt: skip
        if host.libc().mprotect(va, size, host.PROT_READ | host.PROT_WRITE) != 0:
            self.fail("set_access", f"mprotect({va:#x}, {size}, RW)")

    def _mapped(self, va: int, size: int) -> None:
        mapped_parts(va, size, ((m, s) for m, (s, _) in self.mappings.items()))


class ReserveRecordsUnlocked(Broken):
    """Two threads. Breaks "``free(va, size)`` returns exactly that range" for reservations made from two threads:
    it publishes its reservation records as a copy taken before the kernel call, so a reservation made meanwhile by
    another thread is forgotten and its ``free`` is refused."""

    breaks = "P-threads"
    caught_by = (
        "test_calls_from_two_threads_match_some_serial_order",
        "test_each_contended_pair_at_every_line_matches_a_serial_order",
        "test_every_contended_pair_of_calls_from_two_threads_matches_some_serial_order",
    )

    def reserve(self, size: int, alignment: int) -> int:
        records = dict(self.reservations)
        time.sleep(RACE_WINDOW_S)
        va = super().reserve(size, alignment)
        records[va] = size
        self.reservations.clear()
        self.reservations.update(records)
        return va


class ReleaseCountsOutsideTheLock(Broken):
    """P-threads. Breaks "Any call may be made from several threads at once on one driver: each takes effect whole, so
    what every call returned, and the state the driver is left in, are those of some serial order of the calls":
    ``release`` closes the handle under the driver's lock and reads the bytes held there, then lets the lock go and
    writes the count read less the handle's size; two threads releasing handles of their own at once (each mapped
    nowhere) both subtract from the same count, and one handle's bytes stay counted. Releases from one thread, and of
    mapped handles, are counted right."""

    breaks = "P-threads"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    WINDOW_S = 2e-3

    def release(self, handle: host.HostHandle) -> None:
        self.check_call("release")
        if handle.released or handle.maps:
            return super().release(handle)
        with busy(), self.locked(): held = self._close(handle)  # fmt: skip
        time.sleep(self.WINDOW_S)  # the race window, widened (Note [A proof drives both drivers])
        with busy(), self.locked(): self.held, handle.counted = held - handle.size, False  # fmt: skip

    def _close(self, handle: host.HostHandle) -> int:
        """Mark ``handle`` released and close its memfd in one line (as the host does); the bytes held, as read."""
        fd, handle.fd, handle.released = handle.fd, -1, True; os.close(fd)  # noqa: E702  # fmt: skip
        return self.held
