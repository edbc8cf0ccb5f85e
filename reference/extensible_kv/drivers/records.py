"""Checks a driver makes against its own records of reservations and mappings before a native call.

The host, CUDA and HIP drivers keep such records (the host driver because ``mmap(MAP_FIXED)`` replaces silently, the
HIP driver for its Notes on per-mapping calls, the CUDA driver because ``cuMem*`` accepts some misuse the protocol
refuses: Note [cuMem accepts what the protocol refuses] in ``cuda.py``) and refuse the same misuse with the same
``DriverError``. ``Ledger``
checks callers on its own, independently of any driver, and does not use these.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

from ..errors import DriverError

MAX_BYTES = 1 << 63
"""Sizes and addresses are below this: a 64-bit address space, and what every native API takes without truncation
(a ``size_t`` past it wraps, and a wrapped size maps over unrelated memory)."""


def check_range(op: str, **values: int) -> None:
    """Refuse ``op`` when a size, address or offset is not an int in ``[0, MAX_BYTES)`` (sizes: ``[1, ...)``), or
    when ``va + size`` runs past the address space; before any native call, so nothing is truncated."""
    for name, value in values.items():
        low = 1 if name == "size" else 0
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value < MAX_BYTES:
            raise DriverError(op, f"{name}={value!r} is outside [{low}, 2**63)")
    if values.get("va", 0) + values.get("size", 0) + values.get("offset", 0) >= MAX_BYTES:
        raise DriverError(op, f"{', '.join(f'{k}={v}' for k, v in values.items())} runs past the 64-bit address space")


def check_process(op: str, name: str, pid: int) -> None:
    """Refuse ``op`` in any process but ``pid``, the one that built the driver ``name``: checked before any lock, as
    a forked child may have inherited it held (Note [What a forked child inherits] in ``reaper``)."""
    if os.getpid() != pid:
        child = os.getpid()
        raise DriverError(
            op,
            f"{name} driver built in process {pid} used from forked process {child}; build a new driver in the child",
        )


def check_not_inside(op: str, name: str, values: dict[str, int]) -> None:
    """Refuse ``op`` made by a thread that is already inside a call of the driver ``name`` (a finalizer or a signal
    handler run inside it), which would wait forever on the lock its own thread holds (``drivers/host.py``, Note [A
    call never waits on its own thread])."""
    shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
    raise DriverError(
        op,
        f"{name} driver: {op}({shown}) called by a thread already inside a call of this driver (a finalizer or a "
        f"signal handler run inside it); refused, nothing done: it would wait on the lock its own thread holds",
    )


def thread_mark(marks: threading.local) -> threading.RLock:
    """This thread's mark of being inside a call of one driver (``marks``: that driver's thread-local), made or found
    in one line, so every call runs the same lines (the interrupt rules count them): Note [A call never waits on its
    own thread] in ``host``. A locked section holds it around the driver's lock: ``with busy(), mark, lock:``."""
    return getattr(marks, "mark", None) or marks.__dict__.setdefault("mark", threading.RLock())


def check_entry(op: str, name: str, pid: int, marks: threading.local, locking: bool, values: dict[str, int]) -> None:
    """What every call of the driver ``name`` checks first, before any lock: the process (``check_process``), and,
    for a call that takes the driver's lock (``locking``), that this thread is not already inside a call of it
    (``check_not_inside``; ``marks`` as ``thread_mark`` takes)."""
    check_process(op, name, pid)
    if locking and getattr(marks, "mark", None) is not None and marks.mark._is_owned():
        check_not_inside(op, name, values)


def check_alignment(alignment: int, granularity: int) -> None:
    """Refuse a reservation aligned to anything but a multiple of the granularity (the protocol's ``reserve``):
    rounding to it would hand out a range whose first granule is not reserved."""
    if alignment % granularity:
        raise DriverError("reserve", f"alignment={alignment} is not a multiple of the granularity {granularity}")


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


def check_inside(op: str, va: int, size: int, reservations: Iterable[tuple[int, int]]) -> None:
    """Refuse ``op`` on ``[va, va+size)`` unless it lies inside one reservation (``reservations``: ``(va, size)``)."""
    for r_va, r_size in reservations:
        if r_va <= va and va + size <= r_va + r_size:
            return
    raise DriverError(op, f"[{va:#x}, +{size}) does not lie inside one reservation of this driver")


def check_one_mapping(va: int, size: int, mapped_size: int | None) -> None:
    """Refuse ``unmap(va, size)`` unless exactly one live mapping starts at ``va`` with ``size`` bytes
    (``mapped_size``: the size of the mapping starting at ``va``, ``None`` if none does)."""
    if mapped_size != size:
        raise DriverError("unmap", f"[{va:#x}, +{size}) is not exactly one live mapping of this driver")


def mapped_parts(va: int, size: int, mappings: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The pieces ``(lo, hi)`` of ``[va, va+size)`` that live mappings (``(va, size)`` pairs) cover, in address order;
    refuse ``set_access`` when they do not cover the whole range."""
    end = va + size
    parts = sorted((max(m, va), min(m + s, end)) for m, s in mappings if m < end and va < m + s)
    covered = sum(hi - lo for lo, hi in parts)
    if covered != size:
        raise DriverError("set_access", f"[{va:#x}, +{size}) is not fully mapped ({covered} bytes mapped)")
    return parts
