"""ExtensibleTensor: a byte buffer that grows under a fixed base address, in lockstep segments.

The upper-bound byte range is reserved once. It is divided into ``num_segments`` equal segments; committed bytes
are always a prefix of every segment, and ``resize_per_segment_`` grows all prefixes together. Physical memory is
mapped in granules (the driver's granularity); each growth step maps one handle per contiguous run of new granules
(split only where the driver caps handle size) and grants access once per run, so growing by 32 GiB is a handful
of driver calls, not one per 2 MiB. A granule that straddles a segment boundary is mapped once.

A growth step is all-or-nothing: if a driver call fails, everything the step mapped is unmapped and released, the
tensor keeps its previous size and stays usable, and ``CommitError`` names the operation and the sizes.

Lifetimes: every tensor this object hands out (``segment_view``, ``full_view``) keeps it alive, so views may
outlive the last direct reference. Memory is unmapped and the reservation freed exactly once, by ``close()`` or by
garbage collection, through a ``weakref.finalize`` that holds the memory record, not the object, so no callback
ever drops the last reference to the object that is running it. ``close()`` refuses while views are alive.
A tensor cannot be copied or pickled (``TypeError``): a copy would be a second owner of the same memory.

Note [Nothing is unmapped at interpreter exit]
    At exit the interpreter runs finalizers while daemon threads may still write through views; unmapping there
    would pull memory from under them (a fault, not an error). A tensor still open at exit is therefore left
    mapped, and the process's exit returns its memory.

Note [Forked children]
    A forked child inherits the parent's mappings, but not ownership of them: the child's tensor finalizers and
    ``close()`` return nothing to the driver (the parent still uses the memory), and the host driver refuses every
    call from a child with ``DriverError`` (CUDA forbids using a context after fork). Views the child inherited
    still see the parent's committed bytes (host memfds are shared mappings): a child must not write them.

Note [CUDA graphs do not keep memory alive]
    A captured CUDA graph holds raw addresses, not Python references. Growth never moves the base, so graphs
    captured over committed bytes stay valid after ``resize_per_segment_``; but a graph must not be replayed after
    ``close()``, and keeping the graph is no reason for the memory to stay: keep a view (or the tensor) alive for as
    long as the graph may replay.
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from dataclasses import dataclass, field

import torch

from . import granules
from .drivers import Driver, resolve
from .drivers._records import MAX_BYTES
from .errors import BusyError, ClosedError, CommitError, CommitOutOfMemory, DriverError, DriverOutOfMemory, \
    InvalidArgumentError, InvalidSizeError
from .reaper import busy, reap


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSizeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


def _itemsize(dtype: object) -> int:
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
    return torch.empty(0, dtype=dtype).element_size()


class Unshareable:
    """Base of the objects that own virtual memory: copy, deepcopy and pickle raise ``TypeError``, since a copy
    would be a second owner that frees the memory under the first one's views."""

    def _refuse(self) -> None:
        raise TypeError(f"{type(self).__name__} owns virtual memory and cannot be copied or pickled: a second owner "
                        f"would free it under the first one's views; share the object, or copy a view's bytes")

    def __copy__(self) -> None:
        self._refuse()

    def __deepcopy__(self, memo: dict) -> None:
        self._refuse()

    def __reduce_ex__(self, protocol: object) -> None:
        self._refuse()


@dataclass
class _Memory:
    """What must be returned to the driver: the reservation, the live mappings (va, size) and the handles a
    rollback could not release, made in process ``pid`` (a forked child does not own it)."""

    driver: Driver
    base: int
    reserved: int
    mappings: list[tuple[int, int]] = field(default_factory=list)
    unreleased: list[object] = field(default_factory=list)
    pid: int = field(default_factory=os.getpid)


def _unmap_down_to(memory: _Memory, count: int) -> None:
    """Unmap the newest mappings until ``count`` remain (the device synchronized first)."""
    memory.driver.synchronize()
    while len(memory.mappings) > count:
        va, size = memory.mappings[-1]
        memory.driver.unmap(va, size)
        memory.mappings.pop()


def _teardown(memory: _Memory) -> None:
    if memory.pid != os.getpid():  # Note [Forked children]
        return
    with busy():
        _unmap_down_to(memory, 0)
        while memory.unreleased:
            memory.driver.release(memory.unreleased[-1])
            memory.unreleased.pop()
        memory.driver.free(memory.base, memory.reserved)


def _collected(memory: _Memory) -> None:
    """The finalizer: see Note [Finalizers never wait on a driver lock] in ``reaper``."""
    reap(_teardown, memory)


@dataclass(frozen=True)
class TensorStats:
    """Plain accounting of one ExtensibleTensor, in bytes."""

    reserved_bytes: int
    committed_bytes: int
    backed_bytes: int
    bytes_per_segment: int
    segment_bytes: int
    num_segments: int
    granularity: int
    mappings: int

    @property
    def waste_bytes(self) -> int:
        """Backed bytes that are not committed: rounding of each segment's prefix up to whole granules."""
        return self.backed_bytes - self.committed_bytes


class _ViewKeeper:
    """Held by each view's storage; holds the tensor. Weakly tracked so ``close()`` can see live views."""

    __slots__ = ("owner", "__weakref__")

    def __init__(self, owner: ExtensibleTensor) -> None:
        self.owner = owner


class ExtensibleTensor(Unshareable):
    """A growable byte buffer with a stable base address (see the module docstring).

    ``max_num_bytes`` is the upper bound, reserved now; ``num_segments`` equal segments must divide it;
    ``alignment`` is the unit every per-segment size must be a multiple of (e.g. one KV block's bytes);
    ``driver`` is a driver object, a driver spec string, or ``None`` for the best available driver.
    """

    def __init__(self, max_num_bytes: int, num_segments: int = 1, *, driver: Driver | str | None = None,
                 alignment: int = 1) -> None:
        max_num_bytes = _check_int("max_num_bytes", max_num_bytes)
        num_segments = _check_int("num_segments", num_segments)
        alignment = _check_int("alignment", alignment)
        if max_num_bytes <= 0:
            raise InvalidSizeError(f"max_num_bytes must be positive, got {max_num_bytes}")
        if num_segments <= 0:
            raise InvalidSizeError(f"num_segments must be positive, got {num_segments}")
        if max_num_bytes % num_segments:
            raise InvalidSizeError(f"num_segments={num_segments} does not divide max_num_bytes={max_num_bytes} "
                                   f"(remainder {max_num_bytes % num_segments})")
        if alignment <= 0:
            raise InvalidSizeError(f"alignment must be positive, got {alignment}")
        segment_bytes = max_num_bytes // num_segments
        if segment_bytes % alignment:
            raise InvalidSizeError(f"segment size {segment_bytes} (max_num_bytes={max_num_bytes} / "
                                   f"num_segments={num_segments}) is not a multiple of alignment={alignment}")
        driver = resolve(driver)
        self._driver = driver
        self._granularity = g = driver.granularity()
        reserved = -(-max_num_bytes // g) * g
        if reserved >= MAX_BYTES:
            raise InvalidSizeError(f"max_num_bytes={max_num_bytes} rounded up to the {driver.name} granularity {g} "
                                   f"does not fit a 64-bit address space (at most {MAX_BYTES - 1} bytes)")
        self._max_num_bytes = max_num_bytes
        self._num_segments = num_segments
        self._segment_bytes = segment_bytes
        self._alignment = alignment
        self._per_segment = 0
        self._lock = threading.Lock()
        self._views: weakref.WeakSet[_ViewKeeper] = weakref.WeakSet()
        with busy():
            base = driver.reserve(reserved, g)
        self._memory = _Memory(driver, base, reserved)
        self._finalizer = weakref.finalize(self, _collected, self._memory)
        self._finalizer.atexit = False  # Note [Nothing is unmapped at interpreter exit]

    # -- properties --------------------------------------------------------------------------------------------
    @property
    def driver(self) -> Driver:
        return self._driver

    @property
    def device(self) -> torch.device:
        return self._driver.device

    @property
    def base_address(self) -> int:
        """The first byte of the reservation; it never changes while the tensor is open."""
        self._check_open("base_address")
        return self._memory.base

    @property
    def max_num_bytes(self) -> int:
        return self._max_num_bytes

    @property
    def num_segments(self) -> int:
        return self._num_segments

    @property
    def segment_bytes(self) -> int:
        """Capacity of one segment in bytes."""
        return self._segment_bytes

    @property
    def bytes_per_segment(self) -> int:
        """Committed bytes in each segment (the same in all of them)."""
        return self._per_segment

    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def stats(self) -> TensorStats:
        self._check_open("stats")
        backed = granules.backed_granules(self._segment_bytes, self._num_segments, self._per_segment,
                                          self._granularity)
        return TensorStats(
            reserved_bytes=self._memory.reserved,
            committed_bytes=self._per_segment * self._num_segments,
            backed_bytes=sum(hi - lo for lo, hi in backed) * self._granularity,
            bytes_per_segment=self._per_segment,
            segment_bytes=self._segment_bytes,
            num_segments=self._num_segments,
            granularity=self._granularity,
            mappings=len(self._memory.mappings),
        )

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self._per_segment}/{self._segment_bytes} bytes per segment"
        return (f"ExtensibleTensor({self._max_num_bytes} bytes, {self._num_segments} segment(s), {state}, "
                f"driver={self._driver.name})")

    # -- growth ------------------------------------------------------------------------------------------------
    def resize_per_segment_(self, nbytes: int, zero_new: bool = True) -> ExtensibleTensor:
        """Grow every segment's committed prefix to ``nbytes`` bytes; return ``self``.

        Grow-only and idempotent (the current size is a no-op). With ``zero_new`` the newly committed bytes of each
        segment are zeroed (one fused memset per contiguous new range); without it they are undefined. Bytes
        committed before are never touched. The base address never changes.
        """
        nbytes = _check_int("nbytes", nbytes)
        with self._lock:
            self._check_open("resize_per_segment_")
            old = self._per_segment
            if nbytes <= 0:
                raise InvalidSizeError(f"resize_per_segment_ needs a positive size, got nbytes={nbytes}")
            if nbytes < old:
                raise InvalidSizeError(f"ExtensibleTensor is grow-only: cannot shrink from {old} to {nbytes} "
                                       f"bytes per segment")
            if nbytes > self._segment_bytes:
                raise InvalidSizeError(f"nbytes={nbytes} per segment exceeds the segment capacity "
                                       f"{self._segment_bytes} (max_num_bytes={self._max_num_bytes}, "
                                       f"num_segments={self._num_segments})")
            if nbytes % self._alignment:
                raise InvalidSizeError(f"nbytes={nbytes} per segment is not a multiple of alignment="
                                       f"{self._alignment}")
            if nbytes > old:
                self._grow(old, nbytes, zero_new)
                self._per_segment = nbytes
        return self

    def _grow(self, old: int, new: int, zero_new: bool) -> None:
        """One all-or-nothing growth step. Each mapping is on record (``_memory.mappings``) the moment it exists, so
        an exception of any kind, KeyboardInterrupt included, at any point rolls back exactly what was made."""
        driver, g, memory = self._driver, self._granularity, self._memory
        runs = granules.new_granule_runs(self._segment_bytes, self._num_segments, old, new, g)
        cap = driver.max_handle_bytes
        max_granules = max(cap // g, 1) if cap else None
        mark = len(memory.mappings)
        pending = None  # a handle created and not yet released
        op = "create"
        try:
            with busy():
                for lo, hi in runs:
                    for c_lo, c_hi in granules.chunks(lo, hi, max_granules):
                        va, size = memory.base + c_lo * g, (c_hi - c_lo) * g
                        op = "create"
                        pending = driver.create(size)
                        op = "map"
                        driver.map(va, size, pending, 0)
                        memory.mappings.append((va, size))
                        op = "release"
                        driver.release(pending)  # the mapping keeps the memory alive
                        pending = None
                    op = "set_access"
                    driver.set_access(memory.base + lo * g, (hi - lo) * g)
                if zero_new:
                    op = "zero"
                    for lo, hi in granules.new_ranges(self._segment_bytes, self._num_segments, old, new):
                        driver.zero(memory.base + lo, hi - lo)
        except BaseException as exc:
            problems = self._rollback(mark, pending)
            if not isinstance(exc, DriverError):
                raise
            kind = CommitOutOfMemory if isinstance(exc, DriverOutOfMemory) else CommitError
            detail = f"; rollback also failed: {'; '.join(problems)}" if problems else ""
            raise kind(f"growing {self._driver.name} ExtensibleTensor from {old} to {new} bytes per segment "
                       f"({self._num_segments} segment(s), {new * self._num_segments} bytes in all) failed at "
                       f"{op}: {exc}; kept {old} bytes per segment{detail}",
                       operation=op, requested=new, committed=old) from exc

    def _rollback(self, mark: int, pending: object) -> list[str]:
        """Unmap the mappings made since ``mark`` (newest first) and release ``pending``; a mapping whose unmap
        fails, and a handle whose release fails, stay on record so ``close()`` retries them. Returns what could not
        be undone."""
        problems = []
        driver, mappings = self._driver, self._memory.mappings
        with busy():
            if len(mappings) > mark:
                driver.synchronize()
            kept = []
            while len(mappings) > mark:
                va, size = mappings[-1]
                try:
                    driver.unmap(va, size)
                except Exception as exc:
                    kept.append((va, size))
                    problems.append(f"unmap({va:#x}, {size}): {exc}")
                mappings.pop()
            mappings.extend(reversed(kept))
            if pending is not None:
                try:
                    driver.release(pending)
                except Exception as exc:
                    self._memory.unreleased.append(pending)
                    problems.append(f"release: {exc}")
        return problems

    def _mark(self) -> tuple[int, int]:
        """A point to ``_retract`` to: the size per segment and the number of mappings now."""
        return self._per_segment, len(self._memory.mappings)

    def _retract(self, mark: tuple[int, int]) -> None:
        """Undo the growth steps made since ``mark`` (for callers that grow several tensors as one step)."""
        per_segment, count = mark
        with self._lock, busy():
            _unmap_down_to(self._memory, count)
            self._per_segment = per_segment

    # -- views -------------------------------------------------------------------------------------------------
    def segment_view(self, index: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A 1-D tensor over exactly the committed bytes of segment ``index``, as ``dtype``."""
        index = _check_int("index", index)
        itemsize = _itemsize(dtype)
        if not 0 <= index < self._num_segments:
            raise InvalidSizeError(f"segment index {index} is out of range for {self._num_segments} segment(s)")
        start = index * self._segment_bytes
        with self._lock:
            self._check_open("segment_view")
            if start % itemsize or self._per_segment % itemsize:
                raise InvalidSizeError(f"segment {index} (offset {start}, {self._per_segment} committed bytes) is "
                                       f"not a whole number of {dtype} elements of {itemsize} bytes")
            return self._view(start, self._per_segment, dtype)

    def full_view(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A 1-D tensor over the whole reservation (``max_num_bytes``), committed or not.

        Its address is stable for the tensor's lifetime, so it can be captured (e.g. in CUDA graphs) before the
        bytes are committed. Touching bytes outside the committed prefixes is undefined (a fault on most drivers).
        """
        itemsize = _itemsize(dtype)
        if self._max_num_bytes % itemsize:
            raise InvalidSizeError(f"max_num_bytes={self._max_num_bytes} is not a whole number of {dtype} "
                                   f"elements of {itemsize} bytes")
        with self._lock:
            self._check_open("full_view")
            return self._view(0, self._max_num_bytes, dtype)

    def _view(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A view of ``[offset, offset+nbytes)``; called with the lock held, so ``close()`` cannot run meanwhile."""
        if nbytes == 0:
            return torch.empty(0, dtype=dtype, device=self._driver.device)
        keeper = _ViewKeeper(self)
        with busy():
            raw = self._driver.tensor(self._memory.base + offset, nbytes, keeper)
        self._views.add(keeper)
        return raw.view(dtype)

    # -- lifetime ----------------------------------------------------------------------------------------------
    def live_views(self) -> int:
        """How many storages handed out by this tensor are still alive."""
        return len(self._views)

    def close(self, *, force: bool = False) -> None:
        """Unmap everything and free the reservation. A second call does nothing.

        Refuses with ``BusyError`` while views are alive (they would point at freed memory), unless ``force``:
        then the caller promises no view is used again.
        """
        with self._lock:
            if self.closed:
                return
            if self._views and not force:
                gc.collect()
            if self._views and not force:
                raise BusyError(f"cannot close {self!r}: {len(self._views)} view(s) of its memory are alive; drop "
                                f"them first or pass force=True")
            if not self._finalizer.detach():
                return
            try:  # always now, never deferred: the caller waits for the memory to go
                _teardown(self._memory)
            except BaseException:  # what was returned is off the record; close() again retries the rest
                self._finalizer = weakref.finalize(self, _collected, self._memory)
                self._finalizer.atexit = False
                raise

    def _check_open(self, op: str) -> None:
        if self.closed:
            raise ClosedError(f"{op} on a closed ExtensibleTensor ({self._max_num_bytes} bytes, "
                              f"{self._num_segments} segment(s), driver={self._driver.name})")
