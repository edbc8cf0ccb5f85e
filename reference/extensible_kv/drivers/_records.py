"""Checks a driver makes against its own records of reservations and mappings before a native call.

The host and HIP drivers keep such records (the host driver because ``mmap(MAP_FIXED)`` replaces silently, the HIP
driver for its Notes on per-mapping calls) and refuse the same misuse with the same ``DriverError``. ``Ledger``
checks callers on its own, independently of any driver, and does not use these.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import DriverError


def check_free(va: int, size: int, is_reservation: bool, mapped: Iterable[int]) -> None:
    """Refuse ``free(va, size)`` unless it is one reservation of the driver (``is_reservation``, as its records
    say) with no mapping starting inside it (``mapped``: the start addresses of its live mappings)."""
    if not is_reservation:
        raise DriverError("free", f"[{va:#x}, +{size}) is not a reservation of this driver")
    live = [m for m in mapped if va <= m < va + size]
    if live:
        raise DriverError("free", f"reservation {va:#x} still has {len(live)} mapping(s)")


def check_no_overlap(va: int, size: int, mappings: Iterable[tuple[int, int]]) -> None:
    """Refuse ``map(va, size, ...)`` when ``[va, va+size)`` overlaps a live mapping (``mappings``: ``(va, size)``
    pairs); the first overlapping one is named."""
    for m_va, m_size in mappings:
        if m_va < va + size and va < m_va + m_size:
            raise DriverError("map", f"[{va:#x}, +{size}) overlaps the live mapping [{m_va:#x}, +{m_size})")
