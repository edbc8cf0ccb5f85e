"""Broken drivers of ``mem_info`` (P-mem-exact, P-mem-bounds)."""

from __future__ import annotations

import os

from extensible_kv.drivers import host
from tests.meta.broken.base import Broken


class TotalIsTheMachine(Broken):
    """Memory accounting. Breaks "On the host, ``total`` is the driver's budget": ``mem_info`` counts ``free`` from
    the budget but reports the machine's physical memory as ``total``."""

    breaks = "P-mem-exact"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def mem_info(self) -> tuple[int, int]:
        return super().mem_info()[0], os.sysconf("SC_PHYS_PAGES") * host.PAGE_BYTES
