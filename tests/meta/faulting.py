"""A host driver that kills its own process (SIGSEGV) in ``zero()``: proves that a driver fault fails the rule that
faulted and the run goes on to a summary. Use it as ``--driver tests.meta.faulting:segfault_on_zero``."""

from __future__ import annotations

import ctypes

from extensible_kv.drivers.host import HostDriver


class SegfaultOnZero(HostDriver):
    """zero() writes to address 0."""

    def zero(self, va: int, size: int) -> None:
        ctypes.memset(0, 0, 1)


def segfault_on_zero() -> SegfaultOnZero:
    return SegfaultOnZero(granularity=4096, name="segfault-on-zero")
