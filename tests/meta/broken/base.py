"""What every broken driver shares: ``Broken``, the host driver every one subclasses, and the pieces several of them
call (the host's own checks and native steps, written out so a driver can break one of them).
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable

from extensible_kv.drivers import host
from extensible_kv.drivers.records import check_inside, check_no_overlap
from extensible_kv.errors import DriverError

BUDGET = 1 << 30
"""The budget of every broken driver: that of the registered host drivers."""

FALLOC_FL_KEEP_SIZE = 0x01

FALLOC_FL_PUNCH_HOLE = 0x02

GIB = 1 << 30

RACE_WINDOW_S = 1e-4
"""How long a racing broken driver sleeps between its check and its act, so a race lands in a few hundred tries."""

RESERVE_FLAGS = host.MAP_PRIVATE | host.MAP_ANONYMOUS | host.MAP_NORESERVE

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

fallocate = libc.fallocate


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def revoke_after_the_first_granule(d: host.HostDriver, va: int, size: int) -> None:
    lo = va + d.granularity()
    for m, (s, _) in list(d.mappings.items()):
        start, end = max(m, lo), min(m + s, va + size)
        if start < end:
            host.libc().mprotect(start, end - start, host.PROT_NONE)


def kernel_ranges() -> list[tuple[int, int, str, str]]:
    """``(lo, hi, permissions, path)`` of every range the kernel maps in this process (``/proc/self/maps``)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi, fields[1], fields[5].strip() if len(fields) == 6 else ""))
    return ranges


def mmap_handle(
    d: host.HostDriver,
    va: int,
    size: int,
    handle: host.HostHandle,
    offset: int,
    flags: int = host.MAP_SHARED,
    prot: int = host.PROT_NONE,
) -> None:
    """Record the mapping and mmap the memfd at ``va`` (``flags``, ``prot``), undone whole on any exception (the
    host's own)."""
    live = (size, handle)
    try:
        handle.maps, d.mappings[va] = handle.maps + 1, live
        if host.libc().mmap(va, size, prot, flags | host.MAP_FIXED, handle.fd, offset) != va:
            d.fail("map", f"mmap(prot={prot}, MAP_FIXED, {va:#x}, {size}, fd={handle.fd}, offset={offset})")
    except BaseException:
        if d.mappings.get(va) is live:
            host.libc().mmap(va, size, host.PROT_NONE, host.RESERVED, -1, 0)
            handle.maps, _ = handle.maps - 1, d.mappings.pop(va)
        raise


def check_map(d: host.HostDriver, va: int, size: int, handle: host.HostHandle, offset: int) -> None:
    """The host's refusals of ``map``, in its order."""
    check_inside("map", va, size, d.reservations.items())
    check_no_overlap(va, size, ((m_va, m_size) for m_va, (m_size, _) in d.mappings.items()))
    check_handle(handle, size, offset)


def check_handle(handle: host.HostHandle, size: int, offset: int) -> None:
    """The host's refusals of ``map`` that look at the handle, in its order."""
    if handle.released:
        raise DriverError("map", f"{handle!r} was released; map a live handle")
    if offset + size > handle.size:
        raise DriverError("map", f"offset {offset} + size {size} exceeds the {handle.size}-byte handle")


def grant(va: int, size: int) -> None:
    """``mprotect`` the range read-write, or ``DriverError`` naming ``set_access``."""
    if host.libc().mprotect(va, size, host.PROT_READ | host.PROT_WRITE) != 0:
        host.HostDriver.fail("set_access", f"mprotect({va:#x}, {size}, RW)")


def reservation_of(d: host.HostDriver, va: int) -> tuple[int, int] | None:
    """The reservation ``(start, size)`` of ``d`` that holds the address ``va``, as its records say."""
    return next(((r, s) for r, s in d.reservations.items() if r <= va < r + s), None)


class KeeperSlot:
    """What a tensor's storage holds: a slot of its driver's keeper table, emptied when the storage is freed unless the
    slot was handed out again since."""

    def __init__(self, table: dict[int, tuple[int, object]], slot: int, serial: int) -> None:
        self.table, self.slot, self.serial = table, slot, serial

    def __del__(self) -> None:
        if self.table.get(self.slot, (None, None))[0] == self.serial:
            del self.table[self.slot]


class Broken(host.HostDriver):
    """A host driver with one break, at the host's granularity (2 MiB) and the registered host drivers' budget.

    ``breaks`` names the protocol sentence it breaks (its P-id in ``drivers/_protocol.py``) and ``caught_by`` the
    rules (``conformance/`` test names) of which at least one must fail on it: ``tests/meta/test_broken_caught.py``
    runs just those. The class is its own factory: ``--driver tests.meta.broken.<module>:<Class>``.
    """

    breaks: str = ""
    caught_by: tuple[str, ...] = ()
    state: dict[str, Callable[[], object]] = {}
    """Attributes of the driver's own, each made afresh for every driver by its function."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name=name or "broken-" + kebab(type(self).__name__), budget_bytes=BUDGET)
        for attr, make in self.state.items():
            setattr(self, attr, make())


def kebab(name: str) -> str:
    """``MapIgnoresOffset`` as ``map-ignores-offset``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "-", name).lower()
