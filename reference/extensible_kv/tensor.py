"""ExtensibleTensor: a byte buffer that grows under a fixed base address, in lockstep segments.

The upper-bound byte range is reserved once. It is divided into ``num_segments`` equal segments; committed bytes
are always a prefix of every segment, and ``resize_per_segment_`` grows all prefixes together. Physical memory is
mapped in granules (the driver's granularity); each growth step maps one handle per contiguous run of new granules
(split only where the driver caps handle size) and grants access once per run, so growing by 32 GiB is a handful
of driver calls, not one per 2 MiB. A granule that straddles a segment boundary is mapped once.

``shrink_per_segment_`` gives the granules above a smaller size back, keeping the base, the reservation and the
bytes below it (Note [A shrink unmaps whole mappings]).

A growth step is all-or-nothing: if a driver call fails, or any exception lands before the step returns, everything
the step mapped is unmapped and released, the tensor keeps its previous size and stays usable, and ``CommitError``
(``CommitOutOfMemory`` where the driver ran out of memory) names the operation and the sizes (other exceptions,
KeyboardInterrupt included, are re-raised as they are). Where the rollback itself cannot finish (a driver call fails
in it too) the tensor is ``failed`` and the ``CommitError`` also names what it could not undo.

States (``state``): ``open``; ``failed`` when a ``close()``, a growth step's rollback or a shrink past its first unmap
did not finish (a driver call failed in it, or an exception interrupted it): the tensor then refuses views, growth and
shrink with ``FailedStateError``, counts no byte as committed, and ``close()`` retried returns everything it still
holds; ``released`` after ``release_physical()`` (sleep mode: every page unmapped and released, the reservation and
the committed size kept; views and growth refused with ``ReleasedError`` until ``recommit_physical()`` maps zeroed
pages back under the same addresses, all-or-nothing: a recommit that fails or is interrupted leaves it released);
``closed``.

Lifetimes: every tensor this object hands out (``segment_view``, ``full_view``) keeps it alive, so views may
outlive the last direct reference. Memory is unmapped and the reservation freed exactly once, by ``close()`` or,
after garbage collection, by the reaper's sweep (``extensible_kv.reaper``), which owns the memory record from
before the reservation exists; the tensor's ``weakref.finalize`` only starts a sweep, so the collection that takes
the last reference (or the last view) returns the memory. A tensor a user ``__del__`` resurrects from the cycle that
collected it is ``closed``: its memory was returned. ``close()`` refuses while views are alive. A tensor cannot be
copied or pickled (``TypeError``): a copy would be a second owner of the same memory.

Note [Intent, effect, record]
    An exception may land on any line, so every driver call that changes what the tensor holds (``map``,
    ``unmap``, ``release``, ``free``) is recorded as an intent before the call and in the records after it; the
    records then lag the driver by at most the intent's one target. A driver error from the call itself means
    nothing changed (the protocol's rule), so the intent is dropped there. Rollback, and ``close()`` as soon as
    anything interrupts it, settle an intent whose target the records may have wrong by asking the driver to undo
    that target once more: the driver refuses what is not there (``DriverError``; ``ProtocolViolation`` through a
    Ledger) and changes nothing, so success and refusal both mean it is gone, and nothing is undone twice or
    missed. What ``create`` and ``reserve`` return is stored by C as they return (``handles.extend(map(
    driver.create, ...))``: Note [A result is stored by C] in ``drivers/host.py``), so no exception falls between a
    new handle or reservation and its record. Locked sections are one line (Note [Locked sections are one line] in
    ``reaper``).
    What remains: a driver that fails the settling call natively after an interrupt is taken as having refused it
    (two faults at once); a ``free`` is settled inside the same ``close()`` call, so only another thread reserving
    the very same range, at the same size, in that instant would have its reservation freed; a second exception
    landing inside a rollback or a settling call leaves the tensor ``failed`` with the rest for ``close()``.

Note [Nothing is unmapped at interpreter exit]
    At exit the interpreter runs finalizers while daemon threads may still write through views; unmapping there
    would pull memory from under them (a fault, not an error). A tensor still open at exit is therefore left
    mapped, and the process's exit returns its memory.

Note [Forked children]
    A forked child inherits the parent's mappings, but not ownership of them: the child's tensor finalizers and
    ``close()`` return nothing to the driver (the parent still uses the memory) and take no lock (a thread of the
    parent may have held it at the fork); every other call of a tensor from a child is refused with ``DriverError``
    before any lock, as the host driver refuses every call from a child (CUDA forbids using a context after fork).
    Views the child inherited still see the parent's committed bytes (host memfds are shared mappings): a child
    must not write them.

Note [Operations never wait on themselves]
    A finalizer or a signal handler runs user code inside whatever this thread was doing: inside an operation of
    the same tensor (its lock held), or inside a driver call (``reaper.busy()``: the driver's own lock may be held).
    Waiting there waits forever. So the tensor's lock is an ``RLock`` used only to see who holds it: an operation
    entered again by the thread already inside one is refused with ``BusyError``, and so is an operation that calls
    the driver (growth, shrink, rollback, release, recommit, ``close()``) while the thread is inside a driver call;
    the message names the operation and which of the two it ran inside. Those that call no driver (``stats``,
    ``check_shrink``, views) run there as anywhere else, on a tensor whose lock is free. ``checkpoint``, ``pin`` and
    ``unpin`` take the lock too (another thread's wait for an operation to end; inside one, ``BusyError``): a mark or
    a pin taken in the middle of a growth or a shrink named half a step. Nothing has changed when it is refused; a
    finalizer's ``close()`` refused there leaves the memory to the reaper, which returns it once the tensor is
    collected, or to a later ``close()``.

        finalizer -> b.close() inside host.reserve (driver lock held): BusyError at once, b still open
        finalizer -> b.close() between operations:                     b closed, memory returned

Note [A reading waits for a step in another thread]
    A growth, a shrink, a release or a close passes through states that are not its result (a shrink is
    ``failed`` from its first unmap to its last map; a close is ``failed`` until everything is returned). So
    ``state``, ``closed``, ``released`` and ``bytes_per_segment`` take the tensor's lock like ``stats``: read from
    another thread they wait for the step to end and name its result, never a state in between, which a caller
    could act on (closing a tensor that a shrink leaves open). A thread inside an operation of any tensor or KV
    buffers, or inside a driver call (a finalizer, a signal handler, the KV buffers' own step reading their
    tensors), never waits: it reads the record as it stands, since the thread it would wait for may be waiting for
    the lock it holds (a KV step waits for its tensors' locks). In a forked child, whose lock a thread of the
    parent may hold forever, the reading takes no lock (Note [Forked children]).

        thread A: shrink 4 -> 2 MiB (stalled in unmap) | thread B: t.state waits, then "open" (never "failed")

Note [A checkpoint names a lineage]
    ``rollback_to`` unmaps the mappings made since its checkpoint and sets the size back; that is right only if the
    mappings before the checkpoint are still the ones it counted. A release unmaps all of them and a recommit maps
    new ones at the same addresses, so a count taken before (or while released) would unmap the recommitted pages
    and leave the tensor open over nothing. So every growth step gets a number, the tensor keeps the numbers of the
    steps since its last release or recommit (its lineage, which starts with a fresh number), and a checkpoint
    names its place in it: a checkpoint whose step is no longer there (a release, a recommit, or a rollback past
    it came since) is refused with ``InvalidArgumentError``, and nothing changes.

        grow (1,2) | checkpoint@2 | release (7) | recommit (8) | rollback_to(@2): refused, 7 != 2

    A checkpoint is also checked against the ones this tensor handed out (size, mapping count and step, by step
    number), so a mark edited with ``dataclasses.replace`` is refused the same way.

Note [A rollback never strands a view]
    ``rollback_to`` unmaps the granules above its checkpoint's size. A segment view taken after the checkpoint
    covers bytes up there, and a write through it after the rollback would fault (a SIGSEGV on the host driver, an
    illegal address on CUDA), which is what ``close()`` refuses with ``BusyError`` for the whole tensor. So each
    view's keeper records the bytes per segment it covers, and a rollback below that, while the view is alive after
    a collection, is refused with ``BusyError`` and undoes nothing; so is one below what a pin saw committed (a
    connector's registered views are views too). Views taken before the checkpoint (what a KV cache's users hold
    while ``ensure_blocks`` rolls a failed step back) cover no byte above it and never block it; ``full_view`` is
    exempt, as touching uncommitted bytes through it is undefined already.

Note [A shrink unmaps whole mappings]
    ``shrink_per_segment_`` gives back the granules no kept byte touches (``granules.released_granule_runs``): a
    granule straddling a segment boundary, or holding bytes below the new size, stays. Drivers unmap only whole
    mappings (P-unmap) and CUDA maps only whole handles, so a mapping with kept and released granules is split: a new
    handle per kept chunk is created and its bytes copied aside first (the prepare half: nothing mapped changes, and
    any exception there, a driver's failure or an interrupt, releases the new handles and keeps the old size), then
    the dropped and split mappings are unmapped, the new handles mapped at the same addresses and the bytes copied
    back. An exception after the first unmap leaves the tensor ``failed`` (``close()`` returns everything); a
    driver's failure is ``ShrinkError`` naming the operation. Growing back maps exactly the released granules.

        one mapping [g0 g1 g2 g3], keep 1.5 granules -> new handle [g0 g1] (bytes copied), g2 g3 returned

    Refused before anything changes while a segment view or a ``pin`` reaches past the new size (as a rollback is:
    Note [A rollback never strands a view]); a pin reaches the size committed when it was taken. The copy is a
    snapshot: a kernel or thread writing kept bytes of a split mapping during the shrink may lose the write, so
    shrink between steps, as growth is done; the copy takes the kept bytes of split mappings (at most a mapping per
    segment run) from torch's allocator on the device for the step.

Note [A shrink is a new lineage]
    A shrink unmaps mappings a checkpoint counted and maps new ones, as a release and a recommit do, so it starts a
    fresh lineage: ``rollback_to`` a checkpoint taken before it is refused with ``InvalidArgumentError`` and changes
    nothing (Note [A checkpoint names a lineage]); a checkpoint taken after it rolls back growth as before.

        grow (1,2) | checkpoint@2 | shrink (9) | grow (10) | rollback_to(@2): refused | checkpoint@10: valid

Note [CUDA graphs do not keep memory alive]
    A captured CUDA graph holds raw addresses, not Python references. Growth never moves the base, so graphs
    captured over committed bytes stay valid after ``resize_per_segment_``; but a graph must not be replayed after
    ``close()``, and keeping the graph is no reason for the memory to stay: keep a view (or the tensor) alive for as
    long as the graph may replay.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn, cast

import torch

from . import granules
from .boundaries import number
from .drivers import Driver, resolve
from .drivers.records import MAX_BYTES
from .errors import (
    BusyError,
    ClosedError,
    CommitError,
    CommitOutOfMemory,
    DriverError,
    DriverOutOfMemory,
    FailedStateError,
    InvalidArgumentError,
    InvalidSizeError,
    ProtocolViolation,
    ReleasedError,
    SegmentIndexError,
    ShrinkError,
)
from .reaper import Owned, busy, disown, inside_section, own, sweep

_SERIALS = itertools.count(1)
"""Growth steps and epochs (construction, release, recommit) are numbered from one counter: Note [A checkpoint names a
lineage]."""


MAX_INT_BITS = 1024  # no size or count has more bits: refused by its size before any message formats it


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSizeError(f"{name} must be an int, got {type(value).__name__} {value!r:.200}")
    if value.bit_length() > MAX_INT_BITS:
        raise InvalidSizeError(f"{name} must fit in {MAX_INT_BITS} bits, got {number(value)}")
    return value


def _itemsize(dtype: object) -> int:
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
    return torch.empty(0, dtype=dtype).element_size()


def refuse_reentry(op: str, owner: object, kind: str, lock: threading.RLock, driver: bool) -> None:
    """Refuse ``op`` on ``owner`` (a ``kind``) with ``BusyError`` when this thread holds ``lock`` (an operation of
    ``owner`` is running in it) or, for an operation that calls the driver (``driver``), is inside a driver call:
    Note [Operations never wait on themselves]. Nothing has changed when it refuses."""
    owned = lock._is_owned()  # type: ignore[attr-defined]  # RLock's own test, as threading.Condition uses it
    if owned or (driver and inside_section()):
        inside = f"an operation of this {kind}" if owned else "a driver call"
        raise BusyError(
            f"{op} on {owner!r} ran inside {inside} in this thread (from a finalizer or a signal handler): "
            f"refused, nothing changed"
        )
    entered = getattr(_ENTERED, "locks", None)
    if entered is None:
        entered = _ENTERED.locks = []
    entered[:] = [held for held in entered if held._is_owned()] + [lock]


_ENTERED = threading.local()  # the locks of the operations this thread entered (``refuse_reentry``), pruned lazily


def reading_lock(lock: threading.RLock, pid: int) -> threading.RLock | contextlib.nullcontext[None]:
    """The lock a reading of an object made in process ``pid`` takes: ``lock``, or none inside an operation or a
    driver call of this thread, or in a forked child (Note [A reading waits for a step in another thread])."""
    if pid != os.getpid() or inside_operation():
        return contextlib.nullcontext()
    return lock


def inside_operation() -> bool:
    """Whether this thread is inside an operation of a tensor or of KV buffers (it holds one's lock), or inside a
    driver call: where a reading must not wait for another thread (Note [A reading waits for a step in another
    thread])."""
    return inside_section() or any(held._is_owned() for held in getattr(_ENTERED, "locks", ()))


class Unshareable:
    """Base of the objects that own virtual memory: copy, deepcopy and pickle raise ``TypeError``, since a copy
    would be a second owner that frees the memory under the first one's views."""

    def _refuse(self) -> NoReturn:
        raise TypeError(
            f"{type(self).__name__} owns virtual memory and cannot be copied or pickled: a second owner "
            f"would free it under the first one's views; share the object, or copy a view's bytes"
        )

    def __copy__(self) -> NoReturn:
        self._refuse()

    def __deepcopy__(self, memo: dict) -> NoReturn:
        self._refuse()

    def __reduce_ex__(self, protocol: object) -> NoReturn:
        self._refuse()


_REFUSED = (DriverError, ProtocolViolation)
"""What a driver raises when it refuses or fails a call, having changed nothing (the protocol's rule; ``Ledger``
refuses a caller's misuse with ``ProtocolViolation``)."""


def _remove(items: list, item: object) -> None:
    """Remove ``item`` itself (not an equal one) from ``items``."""
    del items[next(i for i, x in enumerate(items) if x is item)]


def _undo(call: Callable[..., None], *args: object) -> None:
    """Undo the target of an intent that may already be undone: Note [Intent, effect, record]."""
    try:
        call(*args)
    except _REFUSED:
        pass


def _release_handles(memory: _Memory) -> list[str]:
    """Release every handle on record, newest first; a driver's refusal is noted and the rest still released."""
    problems = []
    for handle in reversed(list(memory.handles)):
        try:
            memory.release(handle)
        except _REFUSED as exc:
            problems.append(f"release: {exc}")
    return problems


class _Memory(Owned):
    """What must be returned to the driver: the reservation (``reservation``, its base address once ``reserve``
    returned, empty again after ``free``), the live mappings ``(va, size)``, the handles created and not yet
    released, and the one effect whose record may be a step behind (``intent``): Note [Intent, effect, record].
    Owned from before the reservation exists (Note [Memory is owned from before it exists] in ``reaper``); a forked
    child owns none of it."""

    def __init__(self, owner: object, driver: Driver, reserved: int) -> None:
        super().__init__(owner)
        self.driver = driver
        self.reserved = reserved
        self.reservation: list[int] = []
        self.mappings: list[tuple[int, int]] = []
        self.handles: list[object] = []
        self.intent: tuple | None = None

    @property
    def base(self) -> int | None:
        return self.reservation[0] if self.reservation else None

    @property
    def start(self) -> int:
        """``base`` where the caller holds the reservation (every growth, shrink and view step), as an int."""
        return cast(int, self.base)

    # -- effects: the intent, the driver call, the record ----------------------------------------------------------
    def reserve(self, alignment: int) -> None:
        self.reservation.extend(map(self.driver.reserve, [self.reserved], [alignment]))  # stored by C: Note [Intent...]

    def create(self, size: int) -> object:
        self.handles.extend(map(self.driver.create, [size]))  # stored by C: Note [Intent, effect, record]
        return self.handles[-1]

    def _call(self, intent: tuple, call: Callable[..., None], *args: object) -> None:
        self.intent = intent
        try:
            call(*args)
        except _REFUSED:  # the driver changed nothing and said so: nothing is uncertain
            self.intent = None
            raise

    def map(self, va: int, size: int, handle: object) -> None:
        self._call(("map", va, size), self.driver.map, va, size, handle, 0)
        self.mappings.append((va, size))

    def unmap(self, va: int, size: int) -> None:
        self._call(("unmap", va, size), self.driver.unmap, va, size)
        self.mappings.remove((va, size))

    def release(self, handle: object) -> None:
        self._call(("release", handle), self.driver.release, handle)
        _remove(self.handles, handle)

    def free(self) -> None:
        self._call(("free", self.base), self.driver.free, self.base, self.reserved)
        self.reservation.clear()

    # -- reconciling -------------------------------------------------------------------------------------------------
    def uncertain(self) -> bool:
        """Whether the intent's target may differ from the records: made and not yet recorded (``map``), or undone
        and still recorded (``unmap``, ``release``, ``free``)."""
        if self.intent is None:
            return False
        kind, target = self.intent[0], self.intent[1:]
        if kind == "map":
            return target not in self.mappings
        if kind == "unmap":
            return target in self.mappings
        if kind == "release":
            return any(h is target[0] for h in self.handles)
        return self.base is not None and self.base == target[0]

    def settle(self) -> None:
        """Make the records say what the driver holds for the intent's target (Note [Intent, effect, record])."""
        intent = self.intent
        if intent is not None and self.uncertain():
            kind, target = intent[0], intent[1:]
            if kind == "release":
                _undo(self.driver.release, target[0])
                _remove(self.handles, target[0])
            elif kind == "free":
                _undo(self.driver.free, self.base, self.reserved)
                self.reservation.clear()
            else:
                _undo(self.driver.unmap, *target)
                if kind == "unmap":
                    self.mappings.remove(target)
        self.intent = None

    def teardown(self) -> None:
        """Return everything: settle the intent, unmap (the device synchronized first), release, free. Raises the
        first failure, with the intent settled at once (so a ``free`` is never asked again after the address could
        have been reserved anew); called again, it picks up where it stopped."""
        if self.pid != os.getpid():  # Note [Forked children]
            return
        try:
            with busy(): return _teardown(self)  # one line: see reaper  # fmt: skip
        except BaseException:
            with busy(): self.settle()  # fmt: skip
            raise


def _unback(memory: _Memory) -> None:
    """Unmap every mapping (the device synchronized first, newest first) and release every handle still on record,
    keeping the reservation: ``release_physical`` and the first part of ``_teardown``."""
    memory.driver.synchronize()
    memory.settle()
    while memory.mappings:
        memory.unmap(*memory.mappings[-1])
    while memory.handles:
        memory.release(memory.handles[-1])


def _teardown(memory: _Memory) -> None:
    """What ``_Memory.teardown`` does inside its section (a function of its own, which the meta tests replace)."""
    _unback(memory)
    if memory.base is not None:
        memory.free()


@dataclass(frozen=True)
class TensorStats:
    """Plain accounting of one ExtensibleTensor, in bytes. In the ``failed`` state nothing is committed and
    ``backed_bytes`` is what is still mapped."""

    reserved_bytes: int
    committed_bytes: int
    backed_bytes: int
    bytes_per_segment: int
    segment_bytes: int
    num_segments: int
    granularity: int
    mappings: int
    state: str = "open"

    @property
    def waste_bytes(self) -> int:
        """Backed bytes that are not committed: rounding of each segment's prefix up to whole granules."""
        return self.backed_bytes - self.committed_bytes


@dataclass(frozen=True)
class Checkpoint:
    """A point ``rollback_to`` can return to (``ExtensibleTensor.checkpoint``): the size per segment, the number of
    mappings and the lineage of growth steps then (Note [A checkpoint names a lineage])."""

    tensor: weakref.ref
    per_segment: int
    mappings: int
    depth: int
    serial: int


class _ViewKeeper:
    """Held by each view's storage; holds the tensor. Weakly tracked so ``close()`` can see live views."""

    __slots__ = ("owner", "reach", "__weakref__")

    def __init__(self, owner: ExtensibleTensor, reach: int) -> None:
        self.owner = owner
        self.reach = reach  # the committed bytes per segment the view covers (Note [A rollback never strands a view])


class ExtensibleTensor(Unshareable):
    """A growable byte buffer with a stable base address (see the module docstring).

    ``max_num_bytes`` is the upper bound, reserved now; ``num_segments`` equal segments must divide it;
    ``alignment`` is the unit every per-segment size must be a multiple of (e.g. one KV block's bytes);
    ``driver`` is a driver object, a driver spec string, or ``None`` for the best available driver. By default one
    segment and an alignment of 1 byte.

    Refused with ``InvalidSizeError`` before any driver call, the message naming the argument and its value: an
    argument that is not an int (a bool included), a ``max_num_bytes``, ``num_segments`` or ``alignment`` that is not
    positive, ``num_segments`` that does not divide ``max_num_bytes`` (naming the remainder), a segment size that is
    not a multiple of ``alignment``, and a ``max_num_bytes`` that, rounded up to the driver's granularity, is not
    below 2**63 (a 64-bit address space).
    """

    def __init__(
        self, max_num_bytes: int, num_segments: int = 1, *, driver: Driver | str | None = None, alignment: int = 1
    ) -> None:
        max_num_bytes = _check_int("max_num_bytes", max_num_bytes)
        num_segments = _check_int("num_segments", num_segments)
        alignment = _check_int("alignment", alignment)
        if max_num_bytes <= 0:
            raise InvalidSizeError(f"max_num_bytes must be positive, got {max_num_bytes}")
        if num_segments <= 0:
            raise InvalidSizeError(f"num_segments must be positive, got {num_segments}")
        if max_num_bytes % num_segments:
            raise InvalidSizeError(
                f"num_segments={num_segments} does not divide max_num_bytes={max_num_bytes} "
                f"(remainder {max_num_bytes % num_segments})"
            )
        if alignment <= 0:
            raise InvalidSizeError(f"alignment must be positive, got {alignment}")
        segment_bytes = max_num_bytes // num_segments
        if segment_bytes % alignment:
            raise InvalidSizeError(
                f"segment size {segment_bytes} (max_num_bytes={max_num_bytes} / "
                f"num_segments={num_segments}) is not a multiple of alignment={alignment}"
            )
        driver = resolve(driver)
        self._driver = driver
        self._granularity = g = driver.granularity()
        reserved = -(-max_num_bytes // g) * g
        if reserved >= MAX_BYTES:
            raise InvalidSizeError(
                f"max_num_bytes={max_num_bytes} rounded up to the {driver.name} granularity {g} "
                f"does not fit a 64-bit address space (at most {MAX_BYTES - 1} bytes)"
            )
        self._max_num_bytes = max_num_bytes
        self._num_segments = num_segments
        self._segment_bytes = segment_bytes
        self._alignment = alignment
        self._per_segment = 0
        self._state = "open"
        self._failure = ""
        self._op = "create"
        self._lock = threading.RLock()  # reentry is refused, not waited on: Note [Operations never wait on themselves]
        self._lineage = [next(_SERIALS)]  # Note [A checkpoint names a lineage]
        self._marks: dict[int, tuple[int, int, int]] = {}  # the checkpoints handed out, by step: checked on return
        self._pins: list[str] = []
        self._pin_reach: list[int] = []  # the committed bytes per segment each pin saw: Note [A shrink ...]
        self._views: weakref.WeakSet[_ViewKeeper] = weakref.WeakSet()
        sweep()
        # Owned first, then reserved into: Note [Memory is owned from before it exists] in ``reaper``.
        self._memory = _Memory(self, driver, reserved)
        own(self._memory)
        self._finalizer = weakref.finalize(self, sweep)
        self._finalizer.atexit = False  # Note [Nothing is unmapped at interpreter exit]
        with busy(): self._memory.reserve(g)  # one line: Note [Locked sections are one line] in ``reaper``  # fmt: skip
        self._base = self._memory.start

    # -- properties --------------------------------------------------------------------------------------------
    @property
    def driver(self) -> Driver:
        return self._driver

    @property
    def device(self) -> torch.device:
        return self._driver.device

    @property
    def base_address(self) -> int:
        """The first byte of the reservation; it never changes until the tensor is closed (also in the failed
        state, which may have given the reservation back already)."""
        if self._state == "closed":
            self._check_open("base_address")
        return self._base

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
        """Committed bytes in each segment (the same in all of them); 0 unless open. Released, the size on record
        that ``recommit_physical`` maps back. Note [A reading waits for a step in another thread]."""
        with self._reading(): return self._per_segment if self._state in ("open", "released") else 0  # fmt: skip

    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def state(self) -> str:
        """``open``, ``released`` (``release_physical``), ``failed`` (a close, a rollback or a release did not finish:
        retry ``close()``) or ``closed``. Note [A reading waits for a step in another thread]."""
        with self._reading(): return self._state_now()  # one line: see reaper  # fmt: skip

    def _state_now(self) -> str:
        self._notice_reclaimed()
        return self._state

    def _reading(self) -> threading.RLock | contextlib.nullcontext[None]:
        """The lock a reading takes (Note [A reading waits for a step in another thread]); none inside an operation
        or a driver call of this thread, or in a forked child."""
        return reading_lock(self._lock, self._memory.pid)

    @property
    def closed(self) -> bool:
        return self.state == "closed"

    def _notice_reclaimed(self) -> None:
        """A tensor whose memory the collector's finalizer already returned (the object resurrected by a user
        ``__del__`` in its cycle) is closed: it holds no reservation and must hand out nothing."""
        if self._state != "closed" and self._memory.owner() is None:  # weakrefs die with the cycle: the reaper owns it
            self._state, self._failure = "closed", "its memory was returned when the collector finalized it"

    @property
    def released(self) -> bool:
        return self.state == "released"

    def stats(self) -> TensorStats:
        """The accounting; in the ``failed`` state it says so, counts nothing as committed and reports what is
        still mapped as backed."""
        with self._locked("stats", driver=False): return self._stats()  # one line: see reaper  # fmt: skip

    def _stats(self) -> TensorStats:
        self._notice_reclaimed()
        if self._state == "closed":
            self._check_open("stats")
        memory = self._memory
        if self._state in ("failed", "released"):
            backed = sum(size for _, size in memory.mappings)
        else:
            runs = granules.backed_granules(
                self._segment_bytes, self._num_segments, self._per_segment, self._granularity
            )
            backed = sum(hi - lo for lo, hi in runs) * self._granularity
        return TensorStats(
            reserved_bytes=memory.reserved if memory.base is not None else 0,
            committed_bytes=self.bytes_per_segment * self._num_segments if self._state == "open" else 0,
            backed_bytes=backed,
            bytes_per_segment=self.bytes_per_segment,
            segment_bytes=self._segment_bytes,
            num_segments=self._num_segments,
            granularity=self._granularity,
            mappings=len(memory.mappings),
            state=self._state,
        )

    def __repr__(self) -> str:
        """Names the bytes, the segments, the committed and the capacity bytes per segment while open (``n/cap bytes
        per segment``) or else the state, and the driver: what the refusals that name the tensor show."""
        state = self._state if self._state != "open" else f"{self._per_segment}/{self._segment_bytes} bytes per segment"
        return (
            f"ExtensibleTensor({self._max_num_bytes} bytes, {self._num_segments} segment(s), {state}, "
            f"driver={self._driver.name})"
        )

    # -- growth ------------------------------------------------------------------------------------------------
    def resize_per_segment_(self, nbytes: int, zero_new: bool = True) -> ExtensibleTensor:
        """Grow every segment's committed prefix to ``nbytes`` bytes; return ``self``.

        Grow-only and idempotent (the current size is a no-op). With ``zero_new`` the newly committed bytes of each
        segment are zeroed (one fused memset per contiguous new range); without it they are undefined. Bytes
        committed before are never touched. The base address never changes.
        """
        nbytes = _check_int("nbytes", nbytes)
        with self._locked("resize_per_segment_"): return self._resize(nbytes, zero_new)  # one line  # fmt: skip

    def _resize(self, nbytes: int, zero_new: bool) -> ExtensibleTensor:
        self._check_open("resize_per_segment_")
        old = self._per_segment
        if nbytes <= 0:
            raise InvalidSizeError(f"resize_per_segment_ needs a positive size, got nbytes={nbytes}")
        if nbytes < old:
            raise InvalidSizeError(
                f"ExtensibleTensor is grow-only: cannot shrink from {old} to {nbytes} bytes per segment"
            )
        if nbytes > self._segment_bytes:
            raise InvalidSizeError(
                f"nbytes={nbytes} per segment exceeds the segment capacity "
                f"{self._segment_bytes} (max_num_bytes={self._max_num_bytes}, "
                f"num_segments={self._num_segments})"
            )
        if nbytes % self._alignment:
            raise InvalidSizeError(f"nbytes={nbytes} per segment is not a multiple of alignment={self._alignment}")
        return self._grow(old, nbytes, zero_new) if nbytes > old else self

    def _grow(self, old: int, new: int, zero_new: bool) -> ExtensibleTensor:
        """One all-or-nothing growth step. The new size is set inside the ``try`` and the rollback sets the old one
        back, so an exception of any kind, KeyboardInterrupt included, landing on any line before the step returns
        rolls back exactly what was made (Note [Intent, effect, record])."""
        runs = granules.new_granule_runs(self._segment_bytes, self._num_segments, old, new, self._granularity)
        mark = len(self._memory.mappings)
        self._op = "create"
        try:
            with busy(): self._back(runs, old, new, zero_new)  # one line: see reaper  # fmt: skip
            sweep()  # what a collection inside the step left to the reaper: Note [Finalizers never wait ...]
            self._per_segment, self._lineage = new, [*self._lineage, next(_SERIALS)]  # one step: Note [A checkpoint...]
            return self
        except BaseException as exc:
            problems = self._rollback(mark, old)
            if not isinstance(exc, DriverError):
                raise
            op = self._op
            kind = CommitOutOfMemory if isinstance(exc, DriverOutOfMemory) else CommitError
            intact = self._state == "open"  # a mapping the rollback could not unmap leaves the tensor failed
            kept = f"kept {old} bytes per segment" if intact else "the tensor is failed: close() returns the rest"
            detail = f"; rollback also failed: {'; '.join(problems)}" if problems else ""
            raise kind(
                f"growing {self._driver.name} ExtensibleTensor from {old} to {new} bytes per segment "
                f"({self._num_segments} segment(s), {new * self._num_segments} bytes in all) failed at "
                f"{op}: {exc}; {kept}{detail}",
                operation=op,
                requested=new,
                committed=old if intact else 0,
            ) from exc

    def _back(self, runs: list[tuple[int, int]], old: int, new: int, zero_new: bool) -> None:
        """Map, grant and zero the new granules ``runs`` (inside ``busy()``); each handle is on record from the line
        that creates it until the line after its release, each mapping from its intent on."""
        driver, g, memory = self._driver, self._granularity, self._memory
        cap = driver.max_handle_bytes
        max_granules = max(cap // g, 1) if cap else None
        for lo, hi in runs:
            for c_lo, c_hi in granules.chunks(lo, hi, max_granules):
                va, size = memory.start + c_lo * g, (c_hi - c_lo) * g
                self._op = "create"
                handle = memory.create(size)
                self._op = "map"
                memory.map(va, size, handle)
                self._op = "release"
                memory.release(handle)  # the mapping keeps the memory alive
            self._op = "set_access"
            driver.set_access(memory.start + lo * g, (hi - lo) * g)
        if zero_new:
            self._op = "zero"
            for lo, hi in granules.new_ranges(self._segment_bytes, self._num_segments, old, new):
                driver.zero(memory.start + lo, hi - lo)

    # -- shrink ------------------------------------------------------------------------------------------------
    def shrink_per_segment_(self, nbytes: int) -> ExtensibleTensor:
        """Shrink every segment's committed prefix to ``nbytes`` bytes and give back the granules above it; return
        ``self``. Bytes below ``nbytes`` keep their values; the base address and the reservation stay. ``0`` releases
        every granule and leaves the tensor open at 0 bytes; the current size is a no-op. Growth after it maps fresh
        granules (zeroed with ``zero_new``). Refused, nothing changed: ``InvalidSizeError`` (not an int, negative,
        above the current size, misaligned), ``ReleasedError``/``FailedStateError``/``ClosedError`` unless open,
        ``BusyError`` while a segment view or a ``pin`` reaches past ``nbytes`` (``full_view`` never blocks).
        Checkpoints taken before it are of another lineage (Note [A shrink is a new lineage]). All or nothing: Note
        [A shrink unmaps whole mappings]."""
        nbytes = _check_int("nbytes", nbytes)
        with self._locked("shrink_per_segment_"): return self._shrink_checked(nbytes)  # one line  # fmt: skip

    def check_shrink(self, nbytes: int) -> None:
        """Raise what ``shrink_per_segment_(nbytes)`` would be refused with, changing nothing; return if it would
        not be refused now (a view or pin taken later still refuses it). For a caller that shrinks several tensors
        as one step and must refuse before the first one shrinks (``ExtensibleKVCacheBuffers.shrink_blocks``)."""
        nbytes = _check_int("nbytes", nbytes)
        with self._locked("check_shrink", driver=False): self._shrink_refusals(nbytes)  # one line  # fmt: skip

    def _shrink_checked(self, nbytes: int) -> ExtensibleTensor:
        self._shrink_refusals(nbytes)
        old = self._per_segment
        return self._shrink(old, nbytes) if nbytes < old else self

    def _shrink_refusals(self, nbytes: int) -> None:
        self._check_open("shrink_per_segment_")
        old = self._per_segment
        if nbytes < 0:
            raise InvalidSizeError(f"shrink_per_segment_ needs a non-negative size, got nbytes={nbytes}")
        if nbytes > old:
            raise InvalidSizeError(
                f"shrink_per_segment_({nbytes}) on a tensor at {old} bytes per segment: a shrink cannot grow "
                f"(use resize_per_segment_)"
            )
        if nbytes % self._alignment:
            raise InvalidSizeError(f"nbytes={nbytes} per segment is not a multiple of alignment={self._alignment}")
        self._refuse_stranding(nbytes, f"shrink_per_segment_({nbytes})", "released")

    def _shrink_plan(self, new: int) -> tuple[list[tuple[int, int]], list[tuple[int, int, list]]]:
        """The mappings a shrink to ``new`` unmaps whole (``(va, size)``) and those it splits (``(va, size, kept
        granule runs)``): Note [A shrink unmaps whole mappings]."""
        g, base = self._granularity, self._memory.start
        kept = granules.backed_granules(self._segment_bytes, self._num_segments, new, g)
        drops, splits = [], []
        for va, size in self._memory.mappings:
            run = [((va - base) // g, (va - base + size) // g)]
            parts = granules.intersect(run, kept)
            if not parts:
                drops.append((va, size))
            elif parts != run:
                splits.append((va, size, parts))
        return drops, splits

    def _shrink(self, old: int, new: int) -> ExtensibleTensor:
        """One shrink step: prepare (new handles for the kept parts of split mappings, their bytes copied aside),
        then unmap, map the new handles and copy back. Until the first unmap an exception of any kind leaves the old
        size and everything mapped; after it, the tensor is ``failed`` (Note [A shrink unmaps whole mappings])."""
        memory, lineage, before = self._memory, self._lineage, list(self._memory.mappings)
        drops, splits = self._shrink_plan(new)
        failure = f"shrinking from {old} to {new} bytes per segment did not finish"
        self._op = "create"
        try:
            with busy(): parts = self._shrink_prepare(splits)  # one line: see reaper  # fmt: skip
            self._state, self._failure, self._per_segment, self._lineage = "failed", failure, new, [next(_SERIALS)]
            with busy(): self._shrink_apply(drops, splits, parts)  # one line: see reaper  # fmt: skip
            self._state = "open"  # done: an exception from here on (the sweep's) leaves it done
            sweep()  # what a collection inside the step left to the reaper: Note [Finalizers never wait ...]
            return self
        except BaseException as exc:
            if self._state == "open" and self._per_segment == new:  # the step was done: it stays done
                raise
            with busy(): problems = self._shrink_abort()  # one line: see reaper  # fmt: skip
            intact = memory.mappings == before and not memory.uncertain()
            if intact:
                self._state, self._per_segment, self._lineage = "open", old, lineage  # one step
            if not isinstance(exc, DriverError):
                raise
            kept = f"kept {old} bytes per segment" if intact else "the tensor is failed: close() returns the rest"
            detail = f"; undoing also failed: {'; '.join(problems)}" if problems else ""
            raise ShrinkError(
                f"shrinking {self._driver.name} ExtensibleTensor from {old} to {new} bytes per segment "
                f"({self._num_segments} segment(s)) failed at {self._op}: {exc}; {kept}{detail}",
                operation=self._op,
                requested=new,
                committed=old if intact else 0,
            ) from exc

    def _shrink_prepare(self, splits: list[tuple[int, int, list]]) -> list[tuple[int, int, object, torch.Tensor]]:
        """Create a handle per kept chunk of every split mapping and copy its bytes aside (inside ``busy()``);
        nothing mapped changes. Each handle is on record from the line that creates it."""
        driver, g, memory = self._driver, self._granularity, self._memory
        cap = driver.max_handle_bytes
        max_granules = max(cap // g, 1) if cap else None
        parts = []
        if splits:
            self._op = "synchronize"
            driver.synchronize()
        for _, _, kept in splits:
            for lo, hi in kept:
                for c_lo, c_hi in granules.chunks(lo, hi, max_granules):
                    va, size = memory.start + c_lo * g, (c_hi - c_lo) * g
                    self._op = "create"
                    handle = memory.create(size)
                    self._op = "copy"
                    parts.append((va, size, handle, driver.tensor(va, size, None).clone()))
        return parts

    def _shrink_apply(self, drops: list, splits: list, parts: list) -> None:
        """Unmap the dropped and split mappings (the device synchronized first, highest first), map the kept chunks'
        new handles, grant access, copy their bytes back and release the handles (inside ``busy()``)."""
        driver, memory = self._driver, self._memory
        self._op = "synchronize"
        driver.synchronize()
        for va, size in sorted([*drops, *((va, size) for va, size, _ in splits)], reverse=True):
            self._op = "unmap"
            memory.unmap(va, size)
        for va, size, handle, _ in parts:
            self._op = "map"
            memory.map(va, size, handle)
        for va, size, _, saved in parts:
            self._op = "set_access"
            driver.set_access(va, size)
            self._op = "copy"
            driver.tensor(va, size, None).copy_(saved)
        for _, _, handle, _ in parts:
            self._op = "release"
            try:
                memory.release(handle)  # the mapping keeps the memory alive
            except _REFUSED:  # mapped and in place: the step is done; the handle stays on record for close()
                pass

    def _shrink_abort(self) -> list[str]:
        """Settle the intent and release every handle on record not yet released (a prepared handle, mapped or
        not); what a failed shrink left mapped stays for ``close()``. Returns what could not be undone."""
        memory, problems = self._memory, []
        try:
            memory.settle()
        except _REFUSED as exc:
            problems.append(f"{exc}")
        return problems + _release_handles(memory)

    def _rollback(self, count: int, old: int, depth: int | None = None) -> list[str]:
        """Set the size back to ``old`` and undo what was made since the memory held ``count`` mappings: settle the
        intent, unmap (newest first), release the handles not yet released. The tensor is ``failed`` until that is
        done, and stays so when a mapping could not be unmapped (``close()`` retries it); a handle that could not be
        released stays on record for ``close()``. The lineage keeps its first ``depth`` steps (all of them by
        default). Returns what could not be undone."""
        memory, failure = self._memory, f"undoing a growth step from {old} bytes per segment did not finish"
        lineage = self._lineage[: len(self._lineage) if depth is None else depth]
        self._state, self._failure, self._per_segment, self._lineage = "failed", failure, old, lineage  # one step
        with busy(): problems = self._undo_since(count)  # one line: Note [Locked sections are one line]  # fmt: skip
        if len(memory.mappings) > count or memory.uncertain():
            self._failure = f"undoing a growth step from {old} bytes per segment failed: {'; '.join(problems)}"
            return problems
        self._state = "open"
        return problems

    def _undo_since(self, count: int) -> list[str]:
        """What ``_rollback`` undoes; a driver's failure is noted and the rest still undone, anything else (an
        interrupt) stops it there, leaving the tensor failed."""
        memory, problems = self._memory, []
        try:
            if len(memory.mappings) > count or memory.uncertain():
                memory.driver.synchronize()
            memory.settle()
        except _REFUSED as exc:
            problems.append(f"{exc}")
        for va, size in reversed(memory.mappings[count:]):
            try:
                memory.unmap(va, size)
            except _REFUSED as exc:
                problems.append(f"unmap({va:#x}, {size}): {exc}")
        return problems + _release_handles(memory)

    def checkpoint(self) -> Checkpoint:
        """A point to ``rollback_to`` (for callers that grow several tensors as one step, as
        ``ExtensibleKVCacheBuffers.ensure_blocks`` does): valid until a release, a recommit or a rollback past it
        (Note [A checkpoint names a lineage]). Waits for an operation of another thread (a mark taken in the middle of
        a growth would name a step that is not there); refused after ``close()`` (``ClosedError``)."""
        with self._locked("checkpoint", driver=False): return self._checkpoint()  # one line: see reaper  # fmt: skip

    def _checkpoint(self) -> Checkpoint:
        if self._state == "closed":
            self._check_open("checkpoint")
        lineage = self._lineage
        mark = Checkpoint(weakref.ref(self), self._per_segment, len(self._memory.mappings), len(lineage), lineage[-1])
        live = set(lineage)
        self._marks = {k: v for k, v in self._marks.items() if k in live}
        self._marks[mark.serial] = (mark.per_segment, mark.mappings, mark.depth)
        return mark

    def rollback_to(self, mark: Checkpoint) -> list[str]:
        """Undo the growth steps made since ``mark`` (for callers that grow several tensors as one step); a tensor
        that is not open is left as it is. Returns what could not be undone (the tensor is then ``failed``). A mark
        that is not a checkpoint of this tensor, or one of another lineage (taken before a release, a recommit or a
        rollback past it), is refused with ``InvalidArgumentError`` and nothing changes."""
        if not isinstance(mark, Checkpoint) or mark.tensor() is not self:
            raise InvalidArgumentError(
                f"rollback_to needs a checkpoint() of this {self._driver.name} ExtensibleTensor, got "
                f"{type(mark).__name__} {mark!r}"
            )
        with self._locked("rollback_to"): return self._retract_to(mark)  # one line: see reaper  # fmt: skip

    def _retract_to(self, mark: Checkpoint) -> list[str]:
        lineage = self._lineage
        if self._state != "open":
            return []
        fields = (mark.per_segment, mark.mappings, mark.depth, mark.serial)
        if not all(type(v) is int for v in fields):
            raise InvalidArgumentError(f"rollback_to a checkpoint with fields that are not ints: {mark!r}")
        if not 1 <= mark.depth <= len(lineage) or lineage[mark.depth - 1] != mark.serial:
            raise InvalidArgumentError(
                f"rollback_to a checkpoint of another lineage ({mark.per_segment} bytes per segment, step "
                f"{mark.depth}): a release, a recommit, a shrink or a rollback past it came since; the tensor keeps "
                f"{self._per_segment} bytes per segment (Note [A checkpoint names a lineage])"
            )
        if self._marks.get(mark.serial) != (mark.per_segment, mark.mappings, mark.depth):
            raise InvalidArgumentError(
                f"rollback_to a checkpoint this tensor did not hand out ({mark.per_segment} bytes per segment, "
                f"{mark.mappings} mappings, step {mark.depth}): it keeps {self._per_segment} bytes per segment "
                f"(Note [A checkpoint names a lineage])"
            )
        if len(lineage) == mark.depth:  # no growth step since
            return []
        self._refuse_stranding(mark.per_segment, f"rollback_to {mark.per_segment} bytes per segment", "undone")
        return self._rollback(mark.mappings, mark.per_segment, mark.depth)

    def _refuse_stranding(self, per_segment: int, op: str, undone: str) -> None:
        """Refuse ``op`` (a rollback or a shrink to ``per_segment``) while a pin or a segment view reaches the bytes
        above it: Note [A rollback never strands a view]. ``undone``: what nothing was, in the message."""
        pinned = [f"{h} (at {r})" for h, r in zip(self._pins, self._pin_reach) if r > per_segment]
        if pinned:
            raise BusyError(
                f"{op} on {self!r} is refused: {', '.join(pinned)} registered views of the committed bytes per "
                f"segment and would be left on unmapped memory; nothing was {undone}"
            )
        if any(k.reach > per_segment for k in self._views):
            gc.collect()
        beyond = sorted({k.reach for k in self._views if k.reach > per_segment})
        if beyond:
            raise BusyError(
                f"{op} on {self!r} is refused: segment view(s) over {', '.join(map(str, beyond))} committed bytes "
                f"per segment are alive and would be left on unmapped memory; drop them first (nothing was {undone})"
            )

    # -- release and recommit (sleep mode) -----------------------------------------------------------------------
    def release_physical(self) -> None:
        """Unmap and release every page, keeping the reservation and the committed size on record: the tensor is
        ``released`` and holds no physical memory. Views already handed out keep their addresses but must not be
        touched until ``recommit_physical()``. Refused unless open (``ReleasedError`` when released already). A
        release that does not finish (a driver call fails, an exception lands) leaves the tensor ``failed``:
        ``close()`` returns the rest."""
        with self._locked("release_physical"): return self._release()  # one line: see reaper  # fmt: skip

    def _release(self) -> None:
        self._check_open("release_physical")
        if self._pins:
            raise BusyError(
                f"release_physical on {self!r} is refused: {', '.join(self._pins)} registered views of its "
                f"{self._per_segment} committed bytes per segment and would be left on unmapped memory; "
                f"nothing was released"
            )
        failure = "release_physical() did not finish"  # until every page is returned
        self._state, self._failure, self._lineage = "failed", failure, [next(_SERIALS)]
        try:
            with busy(): _unback(self._memory)  # one line: see reaper  # fmt: skip
        except BaseException:
            with busy(): self._memory.settle()  # fmt: skip
            raise
        self._state = "released"

    def recommit_physical(self) -> ExtensibleTensor:
        """Map zeroed pages back for the committed size on record, at the same addresses; return ``self``. All or
        nothing: a recommit that fails (``CommitError``/``CommitOutOfMemory``, as growth) or is interrupted leaves
        the tensor ``released`` with its size on record (or ``failed`` where its own rollback could not finish).
        Refused unless released."""
        with self._locked("recommit_physical"): return self._recommit()  # one line: see reaper  # fmt: skip

    def _recommit(self) -> ExtensibleTensor:
        if self._state != "released":
            self._check_open("recommit_physical")
            raise ReleasedError(
                f"recommit_physical on an ExtensibleTensor that is not released "
                f"({self._per_segment} bytes per segment committed, driver={self._driver.name}): "
                f"call release_physical() first"
            )
        size = self._per_segment
        try:
            self._state, self._per_segment, self._lineage = "open", 0, [next(_SERIALS)]
            if size:
                self._grow(0, size, True)
            return self
        except BaseException:
            # Rolled back to nothing (or interrupted before anything was mapped): released again, size on record.
            # A grown tensor that an exception reached after its step returned keeps its mappings and stays open.
            if self._state == "open" and not self._memory.mappings:
                self._state, self._per_segment = "released", size
            raise

    # -- views -------------------------------------------------------------------------------------------------
    def segment_view(self, index: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A 1-D tensor over exactly the committed bytes of segment ``index``, as ``dtype``. Refused: an ``index``
        that is not an int (``InvalidSizeError``) or out of range (``SegmentIndexError``), a ``dtype`` that is not a
        ``torch.dtype`` (``InvalidArgumentError``), and a segment whose offset or committed bytes are not a whole
        number of ``dtype`` elements (``InvalidSizeError`` naming them), each message naming the values."""
        index = _check_int("index", index)
        itemsize = _itemsize(dtype)
        if not 0 <= index < self._num_segments:
            raise SegmentIndexError(f"segment index {index} is out of range for {self._num_segments} segment(s)")
        with self._locked("segment_view", driver=False): return self._segment_view(index, dtype, itemsize)  # fmt: skip

    def _segment_view(self, index: int, dtype: torch.dtype, itemsize: int) -> torch.Tensor:
        self._check_open("segment_view")
        start = index * self._segment_bytes
        if start % itemsize or self._per_segment % itemsize:
            raise InvalidSizeError(
                f"segment {index} (offset {start}, {self._per_segment} committed bytes) is "
                f"not a whole number of {dtype} elements of {itemsize} bytes"
            )
        return self._view(start, self._per_segment, dtype, self._per_segment)

    def full_view(self, dtype: torch.dtype = torch.uint8, *, keep_committed: bool = False) -> torch.Tensor:
        """A 1-D tensor over the whole reservation (``max_num_bytes``), committed or not; refused, as
        ``segment_view``, for a ``dtype`` that is not a ``torch.dtype`` or does not divide ``max_num_bytes``.

        Its address is stable for the tensor's lifetime, so it can be captured (e.g. in CUDA graphs) before the
        bytes are committed. Touching bytes outside the committed prefixes is undefined (a fault on most drivers).
        ``keep_committed``: the view holds the bytes per segment committed now, as a segment view does: a shrink or
        rollback below them is refused while it lives (for a caller that narrows it to the committed prefixes).
        """
        itemsize = _itemsize(dtype)
        if self._max_num_bytes % itemsize:
            raise InvalidSizeError(
                f"max_num_bytes={self._max_num_bytes} is not a whole number of {dtype} elements of {itemsize} bytes"
            )
        keep = bool(keep_committed)
        with self._locked("full_view", driver=False): return self._full_view(dtype, keep)  # one line  # fmt: skip

    def _full_view(self, dtype: torch.dtype, keep_committed: bool = False) -> torch.Tensor:
        self._check_open("full_view")
        reach = self._per_segment if keep_committed else 0  # past the committed bytes is undefined anyway
        return self._view(0, self._max_num_bytes, dtype, reach)

    def _view(self, offset: int, nbytes: int, dtype: torch.dtype, reach: int) -> torch.Tensor:
        """A view of ``[offset, offset+nbytes)``; called with the lock held, so ``close()`` cannot run meanwhile."""
        if nbytes == 0:
            return torch.empty(0, dtype=dtype, device=self._driver.device)
        keeper = _ViewKeeper(self, reach)
        with busy(): raw = self._driver.tensor(self._memory.start + offset, nbytes, keeper)  # one line  # fmt: skip
        self._views.add(keeper)
        return raw.view(dtype)

    # -- lifetime ----------------------------------------------------------------------------------------------
    def live_views(self) -> int:
        """How many storages handed out by this tensor are still alive."""
        self._refuse_forked("live_views")
        return len(self._views)

    def close(self, *, force: bool = False) -> None:
        """Unmap everything and free the reservation. A second call does nothing.

        Refuses with ``BusyError`` while views are alive (they would point at freed memory), unless ``force``:
        then the caller promises no view is used again. If it does not finish (a driver call fails, an exception
        lands), the tensor is ``failed`` and ``close()`` again returns the rest.
        """
        if self._memory.pid != os.getpid():  # Note [Forked children]: nothing to return, no lock to wait on
            self._state = "closed"
            return
        if inside_section():  # Note [Operations never wait on themselves]
            raise BusyError(
                f"close() of {self!r} ran inside a driver call of this thread (from a finalizer or a signal "
                f"handler), where the driver's lock may be held: refused, nothing changed; the memory goes back "
                f"when the tensor is collected or close() is called again"
            )
        sweep()
        with self._locked("close"): return self._close(force)  # one line: see reaper  # fmt: skip

    def _close(self, force: bool) -> None:
        if self._state == "closed":
            return
        if self._views and not force:
            gc.collect()
        if self._views and not force:
            raise BusyError(
                f"cannot close {self!r}: {len(self._views)} view(s) of its memory are alive; drop "
                f"them first or pass force=True"
            )
        self._state, self._failure = "failed", "close() did not finish"  # until everything is returned
        self._memory.teardown()  # always now, never deferred: the caller waits for the memory to go
        disown(self._memory)
        self._finalizer.detach()
        self._state = "closed"

    def _locked(self, op: str, driver: bool = True) -> threading.RLock:
        """The tensor's lock for ``op``, refusing what would wait forever (Note [Operations never wait on
        themselves]): a forked child (``DriverError``: the parent owns the memory; Note [Forked children]), an
        operation of this tensor already running in this thread, or, for an operation that calls the driver, a
        driver call of this thread in progress (``BusyError``)."""
        self._refuse_forked(op)
        refuse_reentry(op, self, "tensor", self._lock, driver)
        return self._lock

    def _refuse_forked(self, op: str) -> None:
        """In a forked child every call is refused with one ``DriverError``, also those that take no lock
        (checkpoints, pins, the view count): the parent owns the memory (Note [Forked children])."""
        if self._memory.pid != os.getpid():
            raise DriverError(
                op,
                f"ExtensibleTensor made in process {self._memory.pid} used from forked process {os.getpid()}; "
                f"the parent owns its memory (Note [Forked children])",
            )

    # -- registrations -------------------------------------------------------------------------------------------
    def pin(self, holder: str) -> None:
        """Record that ``holder`` (a KV connector, say) registered views of the committed bytes: until ``unpin``,
        ``release_physical`` is refused with ``BusyError`` naming it, since it would leave them on unmapped memory."""
        if not isinstance(holder, str) or not holder:
            raise InvalidArgumentError(f"pin needs a holder's name, got {type(holder).__name__} {holder!r}")
        with self._locked("pin", driver=False): return self._pin(holder)  # one line: see reaper  # fmt: skip

    def _pin(self, holder: str) -> None:
        self._check_open("pin")
        self._pins, self._pin_reach = [*self._pins, holder], [*self._pin_reach, self._per_segment]  # one step

    def unpin(self, holder: str) -> None:
        """Drop one registration of ``holder`` (``pin``); one that is not there is refused with
        ``InvalidArgumentError``."""
        with self._locked("unpin", driver=False): return self._unpin(holder)  # one line: see reaper  # fmt: skip

    def _unpin(self, holder: str) -> None:
        if self._state == "closed":
            self._check_open("unpin")
        if holder not in self._pins:
            raise InvalidArgumentError(f"unpin({holder!r}): not pinned by it; pinned by {self._pins}")
        i = self._pins.index(holder)
        self._pins, self._pin_reach = (
            self._pins[:i] + self._pins[i + 1 :],
            self._pin_reach[:i] + self._pin_reach[i + 1 :],
        )

    @property
    def pinned_by(self) -> tuple[str, ...]:
        """Who registered views of the committed bytes (``pin``)."""
        self._refuse_forked("pinned_by")
        return tuple(self._pins)

    def _check_open(self, op: str) -> None:
        self._notice_reclaimed()
        if self._state == "released":
            raise ReleasedError(
                f"{op} on a released ExtensibleTensor ({self._max_num_bytes} bytes, "
                f"{self._num_segments} segment(s), {self._per_segment} bytes per segment on record, "
                f"driver={self._driver.name}): its pages were released by release_physical(); call "
                f"recommit_physical() first"
            )
        if self._state == "closed":
            raise ClosedError(
                f"{op} on a closed ExtensibleTensor ({self._max_num_bytes} bytes, "
                f"{self._num_segments} segment(s), driver={self._driver.name})"
            )
        if self._state == "failed":
            raise FailedStateError(
                f"{op} on a failed ExtensibleTensor ({self._max_num_bytes} bytes, "
                f"{self._num_segments} segment(s), driver={self._driver.name}): {self._failure}; "
                f"retry close() to return the memory it still holds"
            )
