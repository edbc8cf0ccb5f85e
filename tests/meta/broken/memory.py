"""Broken drivers of ``mem_info`` (P-mem-exact, P-mem-bounds)."""

from __future__ import annotations

import os

from extensible_kv.drivers import host
from extensible_kv.reaper import busy
from tests.meta.broken.base import Broken


class TotalIsTheMachine(Broken):
    """Memory accounting. Breaks "On the host, ``total`` is the driver's budget": ``mem_info`` counts ``free`` from
    the budget but reports the machine's physical memory as ``total``."""

    breaks = "P-mem-exact"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def mem_info(self) -> tuple[int, int]:
        return super().mem_info()[0], os.sysconf("SC_PHYS_PAGES") * host.PAGE_BYTES


class TotalLessPageTables(Broken):
    """P-mem-bounds. Breaks "``(free, total)`` bytes with ``0 <= free <= total``, ``total`` the same for the driver's
    life": like a device whose page tables live in its own memory, ``mem_info`` takes the page tables of the address
    space reserved (4 KiB per granule) out of ``total`` and ``free``, counted only for the address space reserved past
    ``total`` (the first level it preallocates covers that much), so ``total`` shrinks while more address space than
    memory is reserved. With less reserved, ``total`` is the budget."""

    breaks = "P-mem-bounds"
    caught_by = ("test_every_call_is_judged_as_the_model_says_at_every_count_of_live_objects",)

    def mem_info(self) -> tuple[int, int]:
        free, total = super().mem_info()
        with busy(), self.locked(): reserved = sum(self.reservations.values())  # fmt: skip
        tables = max(0, reserved - total) // self.granularity() * host.PAGE_BYTES
        return free - tables, total - tables
