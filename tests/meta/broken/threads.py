"""Broken drivers of calls from two threads at once (P-threads)."""

from __future__ import annotations

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
