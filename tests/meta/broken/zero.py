"""Broken drivers of ``zero`` (P-zero)."""

from __future__ import annotations

import ctypes

from extensible_kv.drivers import host
from tests.meta.broken.base import Broken


class NoZero(Broken):
    """zero() does nothing: fresh pages keep their garbage."""

    breaks = "P-zero"
    caught_by = ("test_zero_new_zeroes_exactly_the_new_range", "test_zero_sets_exactly_the_range")

    def zero(self, va: int, size: int) -> None:
        pass


class ZeroInLines(Broken):
    """zero() widens the range to whole 256-byte lines, erasing the committed bytes around it."""

    breaks = "P-zero"
    caught_by = ("test_zero_sets_exactly_the_bytes_of_any_range",)

    def zero(self, va: int, size: int) -> None:
        lo, hi = va // 256 * 256, -(-(va + size) // 256) * 256
        super().zero(lo, hi - lo)


class ZeroStopsAt16MiB(Broken):
    """zero() clears at most 16 MiB."""

    breaks = "P-zero"
    caught_by = ("test_zero_of_64_mib_sets_every_byte",)

    def zero(self, va: int, size: int) -> None:
        super().zero(va, min(size, 16 * host.MIB))


class ZeroHeadOffByOne(Broken):
    """Contents. Breaks "[P-zero] Set exactly the bytes ``[va, va+size)`` to zero ...: any start and size (no
    alignment ...)": it zeros the head of an unaligned range up to the next multiple of 8 from its second byte, so
    the first byte keeps its value."""

    breaks = "P-zero"
    caught_by = ("test_random_protocol_calls_match_the_model",)

    def zero(self, va: int, size: int) -> None:
        self.check_call("zero", va=va, size=size)
        head = -va % 8
        if head and size > head:
            ctypes.memset(va + 1, 0, head - 1)
            ctypes.memset(va + head, 0, size - head)
        else:
            ctypes.memset(va, 0, size)
