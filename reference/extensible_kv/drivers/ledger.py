"""Ledger: a driver wrapper that records every call, checks it against the protocol, and can inject failures.

It wraps any driver (``Ledger(inner)``) and is itself a driver. It keeps:

- the live reservations, handles and mappings, so a test can assert that nothing leaked (``outstanding()``);
- every call in order (``calls``), so a test can count handles and map calls per growth step;
- the protocol's preconditions: granularity alignment, maps inside a reservation and never over a live mapping,
  unmaps of exactly one mapping, access only on fully mapped ranges, frees of exactly one empty reservation.
  A broken caller gets ``ProtocolViolation`` before the inner driver is touched.

Fault injection: ``fail(op, nth)`` makes the ``nth`` next call of ``op`` (1 = the next one) raise ``DriverError``
without reaching the inner driver, which is how the conformance suite proves that a growth step rolls back.

In a forked child every operation is refused with ``DriverError`` before the ledger's lock is taken or anything is
recorded, whatever the inner driver would do, and the queries reach the inner driver, which refuses them too; the
inspection (``outstanding``, ``count``, ``calls``) reads the parent's records as they were at the fork, and its lock
is free there (Note [What a forked child inherits] in ``reaper``). Its lock is reentrant, so a finalizer or a signal
handler that runs inside one of its sections and calls it again goes on; every check iterates over a copy of the
records (``dict.copy`` allocates nothing per entry, so no collection starts inside it), so a nested call that changes
them cannot cut the outer check short ("dictionary changed size during iteration").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import DriverError, ProtocolViolation
from ..reaper import process_lock
from ._protocol import DRIVER_METHODS, Driver, Handle, conforming, protocol_methods
from .records import check_process

# The queries read a driver's state without changing it: a Ledger passes them through, neither recorded nor failed.
QUERIES = protocol_methods("granularity", "tensor", "accessible", "mem_info")
OPERATIONS = tuple(m for m in DRIVER_METHODS if m not in QUERIES)
"""The calls a Ledger records (``calls``, ``count``) and can make fail (``fail``): every other protocol method."""


@dataclass(frozen=True)
class Call:
    op: str
    args: tuple[int, ...]


@dataclass
class Outstanding:
    """What a ledger still holds: reservations (va -> size), handles (count), mappings (va -> size)."""

    reservations: dict[int, int] = field(default_factory=dict)
    handles: int = 0
    mappings: dict[int, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.reservations or self.handles or self.mappings)


class Ledger:
    """A recording, checking, fault-injecting wrapper around a driver (see the module docstring)."""

    def __init__(self, inner: Driver) -> None:
        """``inner``: a driver object (``extensible_kv.drivers.get_driver`` builds one from a registered name or a
        ``module:factory`` spec); anything else is refused with ``DriverLoadError`` naming what it lacks."""
        inner = conforming(f"Ledger({inner!r}): a {type(inner).__name__}", inner)
        self.inner = inner
        self.name = inner.name
        self.device = inner.device
        self.max_handle_bytes = inner.max_handle_bytes
        self._granularity = inner.granularity()
        self._lock = process_lock(reentrant=True)
        self._pid = os.getpid()
        self.calls: list[Call] = []
        self.reservations: dict[int, int] = {}
        self.handles: dict[int, tuple[Handle, int]] = {}  # id(handle) -> (handle, size)
        self.mappings: dict[int, int] = {}  # va -> size
        self._faults: dict[str, int] = {}
        self._fault_errors: dict[str, BaseException | None] = {}

    def __repr__(self) -> str:
        return f"Ledger({self.inner!r})"

    # -- inspection --------------------------------------------------------------------------------------------
    def outstanding(self) -> Outstanding:
        with self._lock:
            return Outstanding(dict(self.reservations), len(self.handles), dict(self.mappings))

    def count(self, op: str, since: int = 0) -> int:
        """Number of ``op`` calls recorded from index ``since`` of ``calls`` on."""
        return sum(1 for c in self.calls[since:] if c.op == op)

    def fail(self, op: str, nth: int = 1, error: BaseException | None = None) -> None:
        """Make the ``nth`` next call of ``op`` fail with ``error`` (a DriverError by default; any exception, e.g.
        ``KeyboardInterrupt()``, to stand for an interrupt arriving during the call)."""
        if op not in OPERATIONS:
            raise ValueError(f"cannot inject a failure into {op!r}; operations are {OPERATIONS}")
        if nth < 1:
            raise ValueError(f"nth must be >= 1, got {nth}")
        with self._lock:
            self._faults[op] = nth
            self._fault_errors[op] = error

    def clear_faults(self) -> None:
        """Drop every failure injected with ``fail`` that has not fired yet."""
        with self._lock:
            self._faults.clear()
            self._fault_errors.clear()

    # -- protocol ----------------------------------------------------------------------------------------------
    def granularity(self) -> int:
        return self._granularity

    def reserve(self, size: int, alignment: int) -> int:
        check_process("reserve", self.name, self._pid)  # first: Note [What a forked child inherits]
        self._aligned("reserve", size=size, alignment=alignment)
        self._record("reserve", size, alignment)
        va = self.inner.reserve(size, alignment)
        if alignment and va % alignment:
            raise ProtocolViolation(f"{self.name}: reserve returned {va:#x}, not aligned to {alignment}")
        with self._lock:
            self.reservations[va] = size
        return va

    def free(self, va: int, size: int) -> None:
        check_process("free", self.name, self._pid)  # first: Note [What a forked child inherits]
        with self._lock:
            if self.reservations.get(va) != size:
                raise ProtocolViolation(f"{self.name}: free({va:#x}, {size}) is not exactly one live reservation")
            inside = [m for m in self.mappings.copy() if va <= m < va + size]
            if inside:
                raise ProtocolViolation(f"{self.name}: free({va:#x}, {size}) with {len(inside)} live mapping(s)")
        self._record("free", va, size)
        self.inner.free(va, size)
        with self._lock:
            del self.reservations[va]

    def create(self, size: int) -> Handle:
        check_process("create", self.name, self._pid)  # first: Note [What a forked child inherits]
        self._aligned("create", size=size)
        self._record("create", size)
        handle = self.inner.create(size)
        with self._lock:
            self.handles[id(handle)] = (handle, size)
        return handle

    def release(self, handle: Handle) -> None:
        check_process("release", self.name, self._pid)  # first: Note [What a forked child inherits]
        with self._lock:
            if id(handle) not in self.handles:
                raise ProtocolViolation(f"{self.name}: release of a handle that is not live: {handle!r}")
        self._record("release", id(handle))
        self.inner.release(handle)
        with self._lock:
            del self.handles[id(handle)]

    def map(self, va: int, size: int, handle: Handle, offset: int = 0) -> None:
        check_process("map", self.name, self._pid)  # first: Note [What a forked child inherits]
        self._aligned("map", va=va, size=size, offset=offset)
        with self._lock:
            if id(handle) not in self.handles:
                raise ProtocolViolation(f"{self.name}: map of a handle that is not live: {handle!r}")
            if offset + size > self.handles[id(handle)][1]:
                raise ProtocolViolation(
                    f"{self.name}: map offset {offset} + size {size} exceeds the "
                    f"{self.handles[id(handle)][1]}-byte handle"
                )
            if not any(r <= va and va + size <= r + s for r, s in self.reservations.copy().items()):
                raise ProtocolViolation(f"{self.name}: map [{va:#x}, +{size}) is outside every live reservation")
            for m_va, m_size in self.mappings.copy().items():
                if m_va < va + size and va < m_va + m_size:
                    raise ProtocolViolation(
                        f"{self.name}: map [{va:#x}, +{size}) overlaps the live mapping "
                        f"[{m_va:#x}, +{m_size}): a granule would be mapped twice"
                    )
        self._record("map", va, size, offset)
        self.inner.map(va, size, handle, offset)
        with self._lock:
            self.mappings[va] = size

    def unmap(self, va: int, size: int) -> None:
        check_process("unmap", self.name, self._pid)  # first: Note [What a forked child inherits]
        with self._lock:
            if self.mappings.get(va) != size:
                raise ProtocolViolation(f"{self.name}: unmap({va:#x}, {size}) is not exactly one live mapping")
        self._record("unmap", va, size)
        self.inner.unmap(va, size)
        with self._lock:
            del self.mappings[va]

    def set_access(self, va: int, size: int) -> None:
        check_process("set_access", self.name, self._pid)  # first: Note [What a forked child inherits]
        self._aligned("set_access", va=va, size=size)
        with self._lock:
            covered = sum(s for m, s in self.mappings.copy().items() if va <= m and m + s <= va + size)
        if covered != size:
            raise ProtocolViolation(f"{self.name}: set_access [{va:#x}, +{size}) covers only {covered} mapped bytes")
        self._record("set_access", va, size)
        self.inner.set_access(va, size)

    def zero(self, va: int, size: int) -> None:
        check_process("zero", self.name, self._pid)  # first: Note [What a forked child inherits]
        self._record("zero", va, size)
        self.inner.zero(va, size)

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        return self.inner.tensor(va, nbytes, keeper)

    def accessible(self, va: int) -> bool:
        return self.inner.accessible(va)

    def synchronize(self) -> None:
        check_process("synchronize", self.name, self._pid)  # first: Note [What a forked child inherits]
        self._record("synchronize")
        self.inner.synchronize()

    def mem_info(self) -> tuple[int, int]:
        return self.inner.mem_info()

    # -- helpers -----------------------------------------------------------------------------------------------
    def _aligned(self, op: str, **values: int) -> None:
        g = self._granularity
        bad = {k: v for k, v in values.items() if v % g or (k == "size" and v <= 0)}
        if bad:
            shown = ", ".join(f"{k}={v:#x}" if k == "va" else f"{k}={v}" for k, v in bad.items())
            raise ProtocolViolation(f"{self.name}: {op} with {shown}: not a positive multiple of the granularity {g}")

    def _record(self, op: str, *args: Any) -> None:
        with self._lock:
            self.calls.append(Call(op, tuple(args)))
            left = self._faults.get(op)
            if left is None:
                return
            if left > 1:
                self._faults[op] = left - 1
                return
            del self._faults[op]
            error = self._fault_errors.pop(op, None)
        raise error or DriverError(op, f"injected failure ({self.name}, args {args})")
