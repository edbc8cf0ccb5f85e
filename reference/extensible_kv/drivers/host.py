"""The host driver: virtual memory management emulated on the CPU with Linux mmap and memfd.

It is a real implementation of the driver protocol, not a mock: reservations, physical handles and mappings are
kernel objects, so a granule that was never mapped really faults when touched, and ``accessible`` reads the
kernel's view (``/proc/self/maps``). Tensors are CPU torch tensors over the mapped bytes.

==========================  =========================================================================
protocol operation          Linux call
==========================  =========================================================================
``reserve``                 ``mmap(PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)``, trimmed to the alignment
``create``                  ``memfd_create`` + ``ftruncate``
``map``                     ``mmap(PROT_NONE, MAP_SHARED|MAP_FIXED)`` of the memfd at the address
``set_access``              ``mprotect(PROT_READ|PROT_WRITE)``
``unmap``                   ``mmap(PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE|MAP_FIXED)``: back to reserved
``release``                 ``close`` (a live mapping keeps the pages, as ``cuMemRelease`` does)
``free``                    ``munmap``
==========================  =========================================================================

What it does not emulate: peer access, IPC handles, asynchronous streams (``zero`` and ``synchronize`` are
synchronous).

Note [Host memory accounting]
    The driver counts the physical memory it holds, as a GPU does: a handle's bytes are held from ``create`` until
    it is both released and unmapped everywhere. ``mem_info()`` is ``(total - held, total)`` with ``total`` the
    ``budget_bytes`` given (default: the machine's physical memory), and ``create`` past the budget raises
    ``DriverOutOfMemory`` before any memfd exists, so running out of memory, its rollback and "memory is returned"
    are rules on the host too. The kernel's own count (memfds open or mapped) is what the conformance suite checks
    this against.

Note [Host granularity]
    The default granularity is 2 MiB, the CUDA granularity on current NVIDIA GPUs, so the rounding, straddling and
    dedup arithmetic that runs on GPUs runs here too. 4 KiB (the ROCm minimum, and the Linux page) is registered as
    ``host-4k``. Any multiple of the page size works.

Note [Fresh pages are not zero]
    ``cuMemCreate`` makes no promise about the contents of new physical memory, but a fresh memfd reads as zeros,
    which would hide a missing zero step. The host driver therefore fills every new handle with ``fill_byte``
    (0xA5 by default; ``None`` turns this off) so callers that forget to zero are caught.

Note [MAP_FIXED replaces silently]
    ``mmap(MAP_FIXED)`` silently replaces whatever was mapped at the address, where ``cuMemMap`` refuses a range
    that is already mapped. The driver keeps a table of its live mappings and refuses overlaps itself, so a caller
    that maps a granule twice gets the same error here as on a GPU, instead of silently losing the first mapping's
    data.

Note [Sizes are checked before ctypes]
    ctypes converts a Python int to ``size_t`` by truncation: ``mmap(2**64 + 4096)`` reserves 4 KiB. Every size,
    address and offset is range-checked (``check_range``) before it reaches libc.

Note [No use after fork]
    Handles are ``MAP_SHARED`` memfds, so a forked child that wrote through an inherited mapping would change the
    parent's data, and one that mapped or unmapped would desynchronize this driver's records from the parent's.
    A driver refuses every call from a process other than the one that built it, with ``DriverError`` (as CUDA
    refuses a context after fork).

Note [The driver lock and the garbage collector]
    The driver's lock is not reentrant; a garbage collection inside a locked section may run a tensor finalizer
    that calls this driver. Locked sections run inside ``reaper.busy()``, so such a finalizer defers its teardown
    until the section ends (see ``extensible_kv.reaper``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..errors import DriverError, DriverOutOfMemory, DriverUnavailable
from ..reaper import busy
from ._records import (check_alignment, check_free, check_inside, check_no_overlap, check_one_mapping, check_range,
                       mapped_parts)

MIB = 1 << 20
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_PROT_NONE = 0x0
_PROT_READ = 0x1
_PROT_WRITE = 0x2
_MAP_SHARED = 0x01
_MAP_PRIVATE = 0x02
_MAP_FIXED = 0x10
_MAP_ANONYMOUS = 0x20
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value
_MEMFD_NAME = "extensible-kv"

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mprotect.restype = ctypes.c_int
        lib.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc = lib
    return _libc


def probe() -> str | None:
    """Return why the host driver cannot run here, or ``None`` when it can."""
    if not sys.platform.startswith("linux"):
        return f"the host driver needs Linux (mmap, memfd_create); this is {sys.platform}"
    if not hasattr(os, "memfd_create"):
        return "os.memfd_create is missing (needs Linux and Python built against glibc >= 2.27)"
    return None


@dataclass(eq=False)
class HostHandle:
    """A physical allocation: one memfd of ``size`` bytes, ``maps`` live mappings of it, and whether the creation
    reference was released. Compared by identity."""

    fd: int
    size: int
    maps: int = 0
    released: bool = False

    def __repr__(self) -> str:
        return f"HostHandle(fd={self.fd}, size={self.size})"


class HostDriver:
    """VMM emulated with mmap/memfd on Linux (see the module docstring)."""

    device = torch.device("cpu")
    max_handle_bytes: int | None = None

    def __init__(self, granularity: int = 2 * MIB, *, fill_byte: int | None = 0xA5, name: str = "host",
                 budget_bytes: int | None = None) -> None:
        reason = probe()
        if reason:
            raise DriverUnavailable(reason)
        if not isinstance(granularity, int) or granularity <= 0 or granularity % PAGE_BYTES:
            raise ValueError(f"host granularity must be a positive multiple of the page size {PAGE_BYTES}, "
                             f"got {granularity!r}")
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes <= 0):
            raise ValueError(f"host budget_bytes must be a positive int or None, got {budget_bytes!r}")
        self.name = name
        self._granularity = granularity
        self._total = budget_bytes or os.sysconf("SC_PHYS_PAGES") * PAGE_BYTES  # Note [Host memory accounting]
        self._held = 0
        self._fill_byte = fill_byte
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._reservations: dict[int, int] = {}  # va -> size
        self._mappings: dict[int, tuple[int, HostHandle]] = {}  # va -> (size, handle); see Note [MAP_FIXED ...]

    def __repr__(self) -> str:
        return f"HostDriver(name={self.name!r}, granularity={self._granularity})"

    # -- protocol ---------------------------------------------------------------------------------------------
    def granularity(self) -> int:
        return self._granularity

    def reserve(self, size: int, alignment: int) -> int:
        self._check("reserve", size=size, alignment=alignment)
        check_alignment(alignment, self._granularity)
        alignment = max(alignment, PAGE_BYTES)
        span = size + alignment
        raw = _lib().mmap(None, span, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if raw in (None, _MAP_FAILED):
            self._fail("reserve", f"mmap(PROT_NONE, {span} bytes)", oom=True)
        va = (raw + alignment - 1) // alignment * alignment
        # Trim the over-reservation so the kernel holds exactly [va, va+size).
        if va > raw:
            _lib().munmap(raw, va - raw)
        if raw + span > va + size:
            _lib().munmap(va + size, raw + span - (va + size))
        with self._locked():
            self._reservations[va] = size
        return va

    def free(self, va: int, size: int) -> None:
        self._check("free", va=va, size=size)
        with self._locked():
            check_free(va, size, self._reservations.get(va) == size, self._mappings)
            if _lib().munmap(va, size) != 0:  # a failed free keeps its record: close() can try again
                self._fail("free", f"munmap({va:#x}, {size})")
            del self._reservations[va]

    def create(self, size: int) -> HostHandle:
        self._check("create", size=size)
        with self._locked():
            if self._held + size > self._total:  # Note [Host memory accounting]
                raise DriverOutOfMemory("create", f"{size} bytes asked, {self._total - self._held} of "
                                                  f"{self._total} bytes free", errno.ENOMEM)
            self._held += size
        try:
            return self._create(size)
        except BaseException:
            with self._locked():
                self._held -= size
            raise

    def _create(self, size: int) -> HostHandle:
        try:
            fd = os.memfd_create(_MEMFD_NAME, os.MFD_CLOEXEC)
        except OSError as exc:
            raise DriverError("create", f"memfd_create for {size} bytes: {exc}", exc.errno) from exc
        try:
            os.ftruncate(fd, size)
            if self._fill_byte is not None:  # Note [Fresh pages are not zero]
                self._fill(fd, size, self._fill_byte)
        except OSError as exc:
            os.close(fd)
            kind = DriverOutOfMemory if exc.errno in (errno.ENOMEM, errno.ENOSPC) else DriverError
            raise kind("create", f"ftruncate/fill of a {size}-byte memfd: {exc}", exc.errno) from exc
        return HostHandle(fd, size)

    def release(self, handle: HostHandle) -> None:
        self._check("release")
        with self._locked():
            if handle.released:
                raise DriverError("release", f"{handle!r} was already released")
            os.close(handle.fd)
            handle.released = True
            self._drop_if_unused(handle)

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        self._check("map", va=va, size=size, offset=offset)
        with self._locked():
            check_inside("map", va, size, self._reservations.items())
            # Note [MAP_FIXED replaces silently]
            check_no_overlap(va, size, ((m_va, m_size) for m_va, (m_size, _) in self._mappings.items()))
            if handle.released:
                raise DriverError("map", f"{handle!r} was released; map a live handle")
            if offset + size > handle.size:
                raise DriverError("map", f"offset {offset} + size {size} exceeds the {handle.size}-byte handle")
            got = _lib().mmap(va, size, _PROT_NONE, _MAP_SHARED | _MAP_FIXED, handle.fd, offset)
            if got != va:
                self._fail("map", f"mmap(MAP_FIXED, {va:#x}, {size}, fd={handle.fd}, offset={offset})")
            self._mappings[va] = (size, handle)
            handle.maps += 1

    def unmap(self, va: int, size: int) -> None:
        self._check("unmap", va=va, size=size)
        with self._locked():
            live = self._mappings.get(va)
            check_one_mapping(va, size, live and live[0])
            got = _lib().mmap(va, size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1, 0)
            if got != va:
                self._fail("unmap", f"mmap(PROT_NONE, MAP_FIXED, {va:#x}, {size})")
            del self._mappings[va]
            live[1].maps -= 1
            self._drop_if_unused(live[1])

    def set_access(self, va: int, size: int) -> None:
        self._check("set_access", va=va, size=size)
        with self._locked():
            mapped_parts(va, size, ((m, s) for m, (s, _) in self._mappings.items()))
        if _lib().mprotect(va, size, _PROT_READ | _PROT_WRITE) != 0:
            self._fail("set_access", f"mprotect({va:#x}, {size}, RW)")

    def zero(self, va: int, size: int) -> None:
        self._check("zero", va=va, size=size)
        ctypes.memset(va, 0, size)

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        self._check("tensor", va=va, size=nbytes)
        buffer = (ctypes.c_uint8 * nbytes).from_address(va)
        buffer.keeper = keeper  # the storage holds `buffer`, which holds the keeper
        return torch.frombuffer(buffer, dtype=torch.uint8)

    def accessible(self, va: int) -> bool:
        self._check("accessible", va=va)
        # Mapped means: the kernel maps one of our memfds here (not anonymous memory), readable and writable.
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= va < hi:
                    return fields[1].startswith("rw") and len(fields) == 6 and _MEMFD_NAME in fields[5]
        return False

    def synchronize(self) -> None:
        pass

    def mem_info(self) -> tuple[int, int]:
        """``(total - held, total)``: see Note [Host memory accounting]."""
        with self._locked():
            return self._total - self._held, self._total

    # -- helpers -----------------------------------------------------------------------------------------------
    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The driver's lock, inside ``reaper.busy()``: Note [The driver lock and the garbage collector]."""
        with busy(), self._lock:
            yield

    def _drop_if_unused(self, handle: HostHandle) -> None:
        """Stop counting a handle's bytes once it is released and mapped nowhere (called with the lock held)."""
        if handle.released and handle.maps == 0:
            self._held -= handle.size

    def _check(self, op: str, **values: int) -> None:
        if os.getpid() != self._pid:  # Note [No use after fork]
            raise DriverError(op, f"{self.name} driver built in process {self._pid} used from forked process "
                                  f"{os.getpid()}; build a new driver in the child")
        check_range(op, **values)  # Note [Sizes are checked before ctypes]

    @staticmethod
    def _fill(fd: int, size: int, byte: int) -> None:
        lib = _lib()
        addr = lib.mmap(None, size, _PROT_READ | _PROT_WRITE, _MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        try:
            ctypes.memset(addr, byte, size)
        finally:
            lib.munmap(addr, size)

    @staticmethod
    def _fail(op: str, detail: str, oom: bool = False) -> None:
        err = ctypes.get_errno()
        kind = DriverOutOfMemory if (oom or err == errno.ENOMEM) else DriverError
        raise kind(op, f"{detail}: {os.strerror(err)}", err)
