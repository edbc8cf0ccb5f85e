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

Note [Subclassing the host driver]
    The broken drivers of the meta tests (``tests/meta/broken/``), and a test that needs a driver which misbehaves in
    one place, subclass ``HostDriver`` through these names alone; the rest of this module is private.

    - Native calls: ``libc()`` (``mmap``, ``munmap``, ``mprotect`` with their argument types set), the flags
      ``PROT_*``, ``MAP_*`` (``RESERVED``: the flags ``unmap`` maps with, putting a range back to reserved),
      ``MAP_FAILED``, ``MEMFD_NAME`` (the name of every memfd) and ``kernel_reserves(va, size)``.
    - Records: ``reservations`` (``va -> size``), ``mappings`` (``va -> (size, HostHandle)``), ``held`` and
      ``total`` (Note [Host memory accounting]), ``fill_byte``; a ``HostHandle``'s fields.
    - Hooks, each one step of a protocol call that a subclass overrides: ``check_call(op, **values)`` (what every
      call checks first), ``mark()`` and ``locked()`` (a locked section is ``with busy(), self.mark(),
      self.locked(): ...``), the locked work of each call (``do_reserve``, ``do_free``, ``do_release``, ``do_map``,
      ``do_unmap``, ``do_set_access``), ``do_create`` (the memfd, outside the lock), ``charge(size, counted)`` (the
      held count), ``forget``, ``recount`` and ``drop_if_unused`` (a mapping's and a handle's records going),
      ``fill`` (Note [Fresh pages are not zero]) and ``fail`` (a failed native call as a typed error).

    Each public protocol method checks, takes the lock and calls its hook: an override changes one step and keeps
    the others.

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
    A driver refuses every call from a process other than the one that built it, ``granularity`` and ``mem_info``
    included, with ``DriverError`` (as CUDA refuses a context after fork). The process is checked first, before
    any lock: a thread of the parent may have held the lock at the fork, and in the child nothing ever gives it back
    (Note [What a forked child inherits] in ``reaper``).

Note [The driver lock and the garbage collector]
    The driver's lock is not reentrant; a garbage collection inside a locked section may run a tensor finalizer
    that calls this driver. Locked sections run inside ``reaper.busy()``, so such a finalizer leaves the teardown to
    the next sweep (see ``extensible_kv.reaper``). Each is one line, ``with busy(), self.mark(), self.locked():
    return self._work(...)``: Note [Locked sections are one line] there says why.

Note [A call never waits on its own thread]
    A finalizer or a signal handler that runs inside a locked section and calls this driver (a user's ``__del__``
    that calls ``close()``) would wait forever on the lock its own thread holds. So each locked section also holds
    this thread's mark for this driver (``mark()``, a thread-local RLock taken before the lock and given back after
    it, in C on the same line), and a call that takes the lock is refused first, with ``DriverError`` naming the
    call and its values, when its thread holds the mark: nothing was done, and the caller may call again once the
    outer call has returned. Calls that take no lock (``zero``, ``tensor``, ``accessible``) run. The rule for every
    owner of a lock is Note [A finalizer never waits on a lock its thread may hold] in ``reaper``; one mark per
    thread and driver costs a thread-local lookup and an RLock per call (about 0.2 us).

Note [Every call is whole, even when interrupted]
    An exception may land on any line (a raising signal handler, a SIGALRM timeout, a trace hook): each call returns
    having done everything or raises having done nothing, and the records always say what the kernel holds.
    Undoable effects (``reserve``, ``create``, ``map``) are undone by the ``except`` clause of the call that made
    them. Effects that cannot be undone come last: ``release`` changes its records in the line that closes the memfd;
    ``free`` restores its records while the kernel still holds the range (``/proc/self/maps``); ``unmap``, idempotent
    in the kernel, finishes its records in its ``except`` clause. A two-field record changes in one tuple assignment;
    a handle's bytes leave the held count once (``HostHandle.counted``); a released fd is forgotten and closed in one
    line, so a number the process reused is never closed behind its back.
    What remains: a handler that runs after the lock is given back makes ``map``, ``unmap``, ``release`` or ``free``
    raise with the effect done (the records agree, and asking again is refused: Note [Intent, effect, record] in
    ``tensor``); one right after a ``reserve`` trimming ``munmap`` gives that piece back twice; a second exception
    inside an ``except`` clause cuts its cleanup short. A trace hook raises only between lines and reaches none.

Note [A result is stored by C]
    A signal handler runs where the interpreter checks for pending calls, and it checks right after a call returns,
    before the next bytecode stores the result: ``fd = os.memfd_create(...)`` can lose the fd. ``items.extend(map(
    call, args))`` calls and stores inside C (``map`` calls, ``list.extend`` appends), so no bytecode runs between
    the call's return and the store; the ``except`` clause then finds the result in ``items``. ``create`` and
    ``reserve`` get their native results, and hand theirs to ``ExtensibleTensor``, this way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys
import threading
from dataclasses import dataclass
from typing import NoReturn, cast

import torch

from ..errors import DriverError, DriverOutOfMemory, DriverUnavailable, InvalidSizeError
from ..reaper import busy
from .records import (
    check_alignment,
    check_entry,
    check_free,
    check_inside,
    check_no_overlap,
    check_one_mapping,
    check_range,
    mapped_parts,
    thread_mark,
)

MIB = 1 << 20
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

PROT_NONE = 0x0
PROT_READ = 0x1
PROT_WRITE = 0x2
MAP_SHARED = 0x01
MAP_PRIVATE = 0x02
MAP_FIXED = 0x10
MAP_ANONYMOUS = 0x20
MAP_NORESERVE = 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value
RESERVED = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED
"""The flags of an ``mmap`` that puts a range back to reserved (anonymous, no access), as ``unmap`` does."""
MEMFD_NAME = "extensible-kv"
_LOCKING = frozenset({"reserve", "free", "create", "release", "map", "unmap", "set_access", "mem_info"})
"""The calls that take the driver's lock: Note [A call never waits on its own thread]."""

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


def libc() -> ctypes.CDLL:
    """The C library the driver calls, argument types set: Note [Subclassing the host driver]."""
    return _lib()


def probe() -> str | None:
    """Return why the host driver cannot run here, or ``None`` when it can."""
    if not sys.platform.startswith("linux"):
        return f"the host driver needs Linux (mmap, memfd_create); this is {sys.platform}"
    if not hasattr(os, "memfd_create"):
        return "os.memfd_create is missing (needs Linux and Python built against glibc >= 2.27)"
    return None


def kernel_reserves(va: int, size: int) -> bool:
    """Whether the kernel still holds all of ``[va, va+size)`` as reserved: anonymous, no access."""
    covered = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo < va + size and va < hi and fields[1] == "---p" and fields[4] == "0" and len(fields) < 6:
                covered += min(hi, va + size) - max(lo, va)
    return covered == size


@dataclass(eq=False)
class HostHandle:
    """A physical allocation: one memfd of ``size`` bytes (``fd``, -1 once released), ``maps`` live mappings of it,
    whether the creation reference was released, and whether its bytes are still in the driver's held count
    (``counted``: Note [Every call is whole, even when interrupted]). Compared by identity."""

    fd: int
    size: int
    maps: int = 0
    released: bool = False
    counted: bool = True

    def __post_init__(self) -> None:
        self._shown = self.fd  # the fd it was made with names it, also once released

    def __repr__(self) -> str:
        return f"HostHandle(fd={self._shown}, size={self.size})"


class HostDriver:
    """VMM emulated with mmap/memfd on Linux (see the module docstring)."""

    device = torch.device("cpu")
    max_handle_bytes: int | None = None

    def __init__(
        self,
        granularity: int = 2 * MIB,
        *,
        fill_byte: int | None = 0xA5,
        name: str = "host",
        budget_bytes: int | None = None,
    ) -> None:
        reason = probe()
        if reason:
            raise DriverUnavailable(reason)
        if type(granularity) is not int or granularity <= 0 or granularity % PAGE_BYTES:
            raise InvalidSizeError(
                f"host granularity must be a positive multiple of the page size {PAGE_BYTES}, got {granularity!r}"
            )
        if budget_bytes is not None and (type(budget_bytes) is not int or not 0 < budget_bytes < 2**63):
            raise InvalidSizeError(
                f"host budget_bytes must be an int from 1 to 2**63 - 1, or None, got "
                f"{type(budget_bytes).__name__} {budget_bytes!r}"
            )
        self.name = name
        self._granularity = granularity
        self.total = budget_bytes or os.sysconf("SC_PHYS_PAGES") * PAGE_BYTES  # Note [Host memory accounting]
        self.held = 0
        self.fill_byte = fill_byte
        self._lock = threading.Lock()
        self._marks = threading.local()  # Note [A call never waits on its own thread]
        self._pid = os.getpid()
        self._reservations: dict[int, int] = {}  # va -> size
        self._mappings: dict[int, tuple[int, HostHandle]] = {}  # va -> (size, handle); see Note [MAP_FIXED ...]

    def __repr__(self) -> str:
        return f"HostDriver(name={self.name!r}, granularity={self._granularity})"

    # -- records: Note [Subclassing the host driver] ------------------------------------------------------------
    @property
    def reservations(self) -> dict[int, int]:
        """The live reservations, ``va -> size``: the driver's own dict, changed only with the lock held."""
        return self._reservations

    @property
    def mappings(self) -> dict[int, tuple[int, HostHandle]]:
        """The live mappings, ``va -> (size, handle)``: the driver's own dict, changed only with the lock held."""
        return self._mappings

    # -- protocol ---------------------------------------------------------------------------------------------
    def granularity(self) -> int:
        self.check_call("granularity")
        return self._granularity

    def reserve(self, size: int, alignment: int) -> int:
        self.check_call("reserve", size=size, alignment=alignment)
        check_alignment(alignment, self._granularity)
        alignment = max(alignment, PAGE_BYTES)
        made: list[int] = []
        try:  # the reservation is undone unless it is returned: Note [Every call is whole, even when interrupted]
            with busy(), self.mark(), self.locked(): made.extend(map(self.do_reserve, [size], [alignment]))  # fmt: skip
            return made[0]
        except BaseException:
            for va in made:
                with busy(), self.mark(), self.locked(): self.do_free(va, size)  # fmt: skip
            raise

    def do_reserve(self, size: int, alignment: int) -> int:
        span, flags = size + alignment, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
        raws: list[int | None] = []
        head = tail = False
        try:  # the mmap's result is stored by C: Note [A result is stored by C]
            raws.extend(map(_lib().mmap, [None], [span], [PROT_NONE], [flags], [-1], [0]))
            raw = raws[0]
            if raw is None or raw == MAP_FAILED:
                self.fail("reserve", f"mmap(PROT_NONE, {span} bytes) for {size} bytes aligned to {alignment}", oom=True)
            va = -(-raw // alignment) * alignment
            # Trim the over-reservation so the kernel holds exactly [va, va+size); each trim is remembered in the
            # line that makes it, so the except clause gives back exactly what is left.
            head = va == raw or _lib().munmap(raw, va - raw) == 0
            tail = raw + span == va + size or _lib().munmap(va + size, raw + span - (va + size)) == 0
            self._reservations[va] = size
            return va
        except BaseException:
            if raws and raws[0] not in (None, MAP_FAILED):
                raw = raws[0]
                va = -(-raw // alignment) * alignment
                self._reservations.pop(va, None)
                lo, hi = (va if head else raw), (va + size if tail else raw + span)
                _lib().munmap(lo, hi - lo)
            raise

    def free(self, va: int, size: int) -> None:
        self.check_call("free", va=va, size=size)
        with busy(), self.mark(), self.locked(): return self.do_free(va, size)  # fmt: skip

    def do_free(self, va: int, size: int) -> None:
        check_free(va, size, self._reservations.get(va) == size, self._mappings)
        try:  # the record goes first and the kernel's range last: Note [Every call is whole, even when interrupted]
            del self._reservations[va]
            if _lib().munmap(va, size) != 0:
                self.fail("free", f"munmap({va:#x}, {size})")
        except BaseException:  # a failed free keeps its record (close() can try again), as long as the kernel does
            if kernel_reserves(va, size):
                self._reservations[va] = size
            raise

    def create(self, size: int) -> HostHandle:
        self.check_call("create", size=size)
        made: list[HostHandle]
        counted, made = [0], []  # the bytes this call added to the held count, and the handle it made
        try:  # both are given back unless the handle is returned: Note [Every call is whole, even when interrupted]
            with busy(), self.mark(), self.locked(): self.charge(size, counted)  # fmt: skip
            made.extend(map(self.do_create, [size]))  # Note [A result is stored by C]
            return made[0]
        except BaseException:
            for handle in made:  # never returned: nobody maps it
                fd, handle.fd, handle.released = handle.fd, -1, True; os.close(fd)  # fmt: skip
            with busy(), self.mark(), self.locked(): self.charge(-counted[0], counted)  # fmt: skip
            raise

    def charge(self, size: int, counted: list[int]) -> None:
        """Add ``size`` (negative: take it back) to the held bytes and to ``counted`` in one step."""
        if size > 0 and self.held + size > self.total:  # Note [Host memory accounting]
            raise DriverOutOfMemory(
                "create", f"{size} bytes asked, {self.total - self.held} of {self.total} bytes free", errno.ENOMEM
            )
        self.held, counted[0] = self.held + size, counted[0] + size

    def do_create(self, size: int) -> HostHandle:
        fds: list[int] = []
        try:  # the fd is closed unless the handle is returned; memfd_create's result is stored by C (Notes)
            fds.extend(map(os.memfd_create, [MEMFD_NAME], [os.MFD_CLOEXEC]))
            os.ftruncate(fds[0], size)
            if self.fill_byte is not None:  # Note [Fresh pages are not zero]
                self.fill(fds[0], size, self.fill_byte)
            return HostHandle(fds[0], size)
        except BaseException as exc:
            for fd in fds:
                os.close(fd)
            if not isinstance(exc, OSError) or exc.errno is None:  # not a failed call (a TimeoutError from a handler)
                raise
            if not fds:
                raise DriverError("create", f"memfd_create for {size} bytes: {exc}", exc.errno) from exc
            kind = DriverOutOfMemory if exc.errno in (errno.ENOMEM, errno.ENOSPC) else DriverError
            raise kind("create", f"ftruncate/fill of a {size}-byte memfd: {exc}", exc.errno) from exc

    def release(self, handle: HostHandle) -> None:
        self.check_call("release")
        with busy(), self.mark(), self.locked(): return self.do_release(handle)  # fmt: skip

    def do_release(self, handle: HostHandle) -> None:
        if handle.released:
            raise DriverError("release", f"{handle!r} was already released")
        try:
            # Marked, forgotten and closed in one line with no call before the close: an exception lands before
            # all of it or after all of it, so the fd is never leaked and never closed twice.
            fd, handle.fd, handle.released = handle.fd, -1, True; os.close(fd)  # fmt: skip
            self.drop_if_unused(handle)
        except BaseException:
            self.drop_if_unused(handle)  # once released, the count follows (a second time changes nothing)
            raise

    def map(self, va: int, size: int, handle: HostHandle, offset: int = 0) -> None:
        self.check_call("map", va=va, size=size, offset=offset)
        with busy(), self.mark(), self.locked(): return self.do_map(va, size, handle, offset)  # fmt: skip

    def do_map(self, va: int, size: int, handle: HostHandle, offset: int) -> None:
        check_inside("map", va, size, self._reservations.items())
        # Note [MAP_FIXED replaces silently]
        check_no_overlap(va, size, ((m_va, m_size) for m_va, (m_size, _) in self._mappings.items()))
        if handle.released:
            raise DriverError("map", f"{handle!r} was released; map a live handle")
        if offset + size > handle.size:
            raise DriverError("map", f"offset {offset} + size {size} exceeds the {handle.size}-byte handle")
        live = (size, handle)
        try:  # recorded first, undone whole on any exception: Note [Every call is whole, even when interrupted]
            handle.maps, self._mappings[va] = handle.maps + 1, live
            if _lib().mmap(va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, handle.fd, offset) != va:
                self.fail("map", f"mmap(MAP_FIXED, {va:#x}, {size}, fd={handle.fd}, offset={offset})")
        except BaseException:
            if self._mappings.get(va) is live:  # whatever the kernel did there, the range is reserved again
                _lib().mmap(va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0)
                handle.maps, _ = handle.maps - 1, self._mappings.pop(va)
            raise

    def unmap(self, va: int, size: int) -> None:
        self.check_call("unmap", va=va, size=size)
        with busy(), self.mark(), self.locked(): return self.do_unmap(va, size)  # fmt: skip

    def do_unmap(self, va: int, size: int) -> None:
        found = self._mappings.get(va)
        check_one_mapping(va, size, found and found[0])
        live = cast(tuple[int, HostHandle], found)  # check_one_mapping refused a va with no mapping
        got: list[int | None]
        flags, got = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, []
        try:  # the kernel first, then the records: Notes [Every call is whole, ...], [A result is stored by C]
            got.extend(map(_lib().mmap, [va], [size], [PROT_NONE], [flags], [-1], [0]))
            if got[0] != va:
                self.fail("unmap", f"mmap(PROT_NONE, MAP_FIXED, {va:#x}, {size})")
            self.forget(va, live)
        except BaseException:
            if got == [va]:  # the kernel unmapped it: the records follow
                self.recount(va, live)
            raise

    def forget(self, va: int, live: tuple[int, HostHandle]) -> None:
        """Drop the record ``live`` of the mapping at ``va``, and its handle's bytes once nothing holds them."""
        live[1].maps, _ = live[1].maps - 1, self._mappings.pop(va)
        self.drop_if_unused(live[1])

    def recount(self, va: int, live: tuple[int, HostHandle]) -> None:
        """``forget`` after an exception that may have cut it short: the record goes if it is still there, and the
        handle's map count is counted again from the records."""
        handle = live[1]
        if self._mappings.get(va) is live:
            del self._mappings[va]
        handle.maps = sum(1 for _, h in self._mappings.values() if h is handle)
        self.drop_if_unused(handle)

    def set_access(self, va: int, size: int) -> None:
        self.check_call("set_access", va=va, size=size)
        with busy(), self.mark(), self.locked(): return self.do_set_access(va, size)  # fmt: skip

    def do_set_access(self, va: int, size: int) -> None:
        # The check and mprotect under one lock: an unmap between them would leave anonymous memory read-write
        # there (the protocol's P-threads).
        mapped_parts(va, size, ((m, s) for m, (s, _) in self._mappings.items()))
        if _lib().mprotect(va, size, PROT_READ | PROT_WRITE) != 0:
            self.fail("set_access", f"mprotect({va:#x}, {size}, RW)")

    def zero(self, va: int, size: int) -> None:
        self.check_call("zero", va=va, size=size)
        ctypes.memset(va, 0, size)

    def tensor(self, va: int, nbytes: int, keeper: object) -> torch.Tensor:
        self.check_call("tensor", va=va, size=nbytes)
        buffer = (ctypes.c_uint8 * nbytes).from_address(va)
        buffer.keeper = keeper  # type: ignore[attr-defined]  # the storage holds `buffer`, which holds the keeper
        return torch.frombuffer(buffer, dtype=torch.uint8)

    def accessible(self, va: int) -> bool:
        self.check_call("accessible", va=va)
        # Mapped means: the kernel maps one of our memfds here (not anonymous memory), readable and writable.
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= va < hi:
                    return fields[1].startswith("rw") and len(fields) == 6 and MEMFD_NAME in fields[5]
        return False

    def synchronize(self) -> None:
        self.check_call("synchronize")

    def mem_info(self) -> tuple[int, int]:
        """``(total - held, total)``: see Note [Host memory accounting]."""
        self.check_call("mem_info")
        with busy(), self.mark(), self.locked(): return self.total - self.held, self.total  # fmt: skip

    # -- helpers -----------------------------------------------------------------------------------------------
    def locked(self) -> threading.Lock:
        """The driver's lock, a C-level context manager; every section holding it is also inside ``reaper.busy()``
        and ``mark()`` and is one line (Note [The driver lock and the garbage collector])."""
        return self._lock

    def mark(self) -> threading.RLock:
        """This thread's mark of being inside a call of this driver (``records.thread_mark``): Note [A call never
        waits on its own thread]."""
        return thread_mark(self._marks)

    def drop_if_unused(self, handle: HostHandle) -> None:
        """Stop counting a handle's bytes once it is released and mapped nowhere, once (called with the lock held)."""
        if handle.released and handle.maps == 0 and handle.counted:
            self.held, handle.counted = self.held - handle.size, False

    def check_call(self, op: str, **values: int) -> None:
        # First, before any lock: Notes [No use after fork], [A call never waits on its own thread].
        check_entry(op, self.name, self._pid, self._marks, op in _LOCKING, values)
        check_range(op, **values)  # Note [Sizes are checked before ctypes]

    @staticmethod
    def fill(fd: int, size: int, byte: int) -> None:
        lib = _lib()
        addrs: list[int | None] = []
        unmapped: list[int] = []
        try:  # no ``finally`` (its body is a line an exception can land on before it runs); Note [A result is ...]
            addrs.extend(map(lib.mmap, [None], [size], [PROT_READ | PROT_WRITE], [MAP_SHARED], [fd], [0]))
            if addrs[0] in (None, MAP_FAILED):
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
            ctypes.memset(addrs[0], byte, size)
            unmapped.extend(map(lib.munmap, addrs, [size]))
        except BaseException:
            if addrs and addrs[0] not in (None, MAP_FAILED) and not unmapped:
                lib.munmap(addrs[0], size)
            raise

    @staticmethod
    def fail(op: str, detail: str, oom: bool = False) -> NoReturn:
        err = ctypes.get_errno()
        kind = DriverOutOfMemory if (oom or err == errno.ENOMEM) else DriverError
        raise kind(op, f"{detail}: {os.strerror(err)}", err)
