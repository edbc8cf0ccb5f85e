"""The life of an ``ExtensibleTensor`` and of the KV buffers as an executable model: states, checkpoints, views,
release and recommit, growth and shrink valid and invalid, pins, close, interrupts at any line of a whole step,
driver calls that fail, user finalizers run by the collector inside an operation, and forked children;
``LifecycleMachine`` drives random sequences of them against the real objects on one driver and compares
everything after every step.

``TensorModel`` is pure Python and shares no code with the package: what a tensor holds (state, bytes per segment,
the bytes of every segment, the granules that must be mapped, live views, its lineage of growth steps, its pins
with the bytes per segment each saw) and, for each call, the typed error the documentation demands (``refusal``)
or the state once it returned. The machine holds three objects: tensor ``a`` (one to three segments whose
boundaries fall inside granules), tensor ``b`` (the one a user finalizer closes) and a worker's KV cache
(``WorkerKV``, its buffers, a sleep-mode backend and, drawn, a KV connector), whose one buffer is modelled by a
``TensorModel`` too.

After every step (``check``): each object's state, committed bytes per segment, every field of ``stats()``, live
views, ``pinned_by``, the bytes of every segment (what was written through views, zeros after growth and recommit),
the driver's records (the reservation and exactly the granules that must be mapped, no handle held, none created
over a drawn ``max_handle_bytes``) and, on a CPU driver, ``mem_info``'s used bytes against the mappings on record. A
refused call must raise the typed error the model names, with a message naming the operation, the state or the
offending values the model knows, and change nothing. An interrupted call, its line event drawn uniformly over the
whole operation (``line_event``), may end in any state the model allows for it; the machine then adopts what it
finds. A driver call made to fail (``Ledger.fail``, a ``DriverError`` or a ``KeyboardInterrupt``) must end exactly
as the documentation says: growth and recommit rolled back, a shrink kept before its first unmap and failed after
it, a release failed. ``fault_sweep`` makes every driver call of a step go wrong in turn (``CallFault``: refused,
out of memory, interrupted in the call, interrupted just after it acted and before the tensor recorded it, or with
the rollback failing too) and a failed tensor's ``close()`` retried under faults until it returns everything.
``check_shrink`` is asked around the committed size in every state and must refuse exactly as the shrink would;
``reenter`` calls both tensors from inside a driver call of ``a`` (Note [Operations never wait on themselves]);
``construct`` makes tensors with every documented refusal of the constructor and of the views' dtypes, and
``lifetime`` drops the last reference with a view alive, and resurrects a collected tensor. A refusal's message must
name each value as written (``named``: the same case, not inside a longer word or number), and ``repr`` the sizes
and the state. Every failure names the driver, the step, what was expected and what was found.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import extensible_kv
from extensible_kv import ExtensibleTensor
from extensible_kv.errors import (
    BusyError,
    ClosedError,
    CommitError,
    CommitOutOfMemory,
    DriverError,
    DriverOutOfMemory,
    ExtensibleKVError,
    FailedStateError,
    InvalidArgumentError,
    InvalidSizeError,
    ReleasedError,
    SegmentIndexError,
    ShrinkError,
)
from extensible_kv.reaper import inside_section
from extensible_kv.vllm import connector, worker_kv
from extensible_kv.vllm.sleep import KVSleepBackend

from .helpers import expect, expect_bytes, expect_equal, pattern
from .line_trap import Interrupt, LineTrap

PACKAGE = str(Path(extensible_kv.__file__).resolve().parent) + os.sep
DRIVERS = PACKAGE + "drivers" + os.sep
HANG_S = 20  # one step; a lock that is never given back fails the step, not the suite
CHILD_S = 5  # a forked child's calls
PAGE = 8192  # one KV block
KV_BLOCKS = 24
SIZE_KINDS = ("shrink", "past", "misaligned", "zero", "negative", "2**70", "float", "str", "bool")
BLOCK_KINDS = ("-1", "past", "2**70", "float", "str", "bool")
FAULT_MODES = ("error", "out of memory", "interrupt", "interrupt after", "rollback fails")
MAX_BYTES = 1 << 63  # a reservation rounded up to the granularity must stay below it: a 64-bit address space
SHRINK_KINDS = ("grow", "misaligned", "negative", "2**70", "float", "str", "bool")
DTYPES = (torch.uint8, torch.float16, torch.int32, torch.float64)
FAULT_OPS = {
    "grow": ("create", "map", "release", "set_access", "zero"),
    "shrink": ("synchronize", "create", "synchronize", "unmap", "map", "set_access", "release"),
    "release": ("synchronize", "unmap", "release"),
    "recommit": ("create", "map", "release", "set_access", "zero"),
}  # the driver calls each operation makes, a shrink's synchronize twice as it calls it in both halves
HOLDERS = ("connector", "nixl", "lmcache")
LINES = {"grow": 260, "shrink": 450, "release": 110, "recommit": 350, "close": 160, "rollback": 200,
         "kv ensure": 400, "kv shrink": 600, "kv release": 200, "kv recommit": 450}  # fmt: skip
"""An interrupt's line event is drawn over this many line events of an operation outside the drivers: a little more
than a whole step of the largest the model makes runs (a shrink of three segments: about 350), fixed so that a
drawn step replays."""


def named(message: str, name: str) -> bool:
    """Whether ``message`` names ``name`` as written: the same case, and not as part of a longer word or number
    (``resize_per_segment_`` is not named by ``XXresize_per_segment_XX``, nor ``256`` by ``2560``)."""
    return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", message) is not None


def failure_of(op: str, old: int, new: int, mark: Mark | None = None) -> str:
    """What a failed tensor's refusals name as not finished after ``op`` (from ``old`` to ``new`` bytes per segment)
    failed it: Note [Intent, effect, record] and the states of the module docstring of ``tensor.py``."""
    return {
        "grow": f"undoing a growth step from {old} bytes per segment",
        "recommit": "undoing a growth step from 0 bytes per segment",
        "rollback": f"undoing a growth step from {mark.per_segment if mark else old} bytes per segment",
        "shrink": f"shrinking from {old} to {new} bytes per segment",
        "release": "release_physical() did not finish",
        "close": "close() did not finish",
    }[op]


class Hang(AssertionError):
    """A step ran past ``HANG_S`` seconds: a lock that is never given back (raised by SIGALRM, which interrupts a
    lock's wait)."""


def _in_package(name: str) -> bool:
    return name.startswith(PACKAGE)


def _outside_drivers(name: str) -> bool:
    """Where an interrupt rule's ``Interrupt`` lands: the package's lines outside the drivers. Inside a driver call
    (the Ledger's records after its inner driver's call) it would break the instrument, not the tensor; an
    interrupt arriving in a driver call is ``driver_fault``'s ``KeyboardInterrupt``."""
    return name.startswith(PACKAGE) and not name.startswith(DRIVERS)


class LineAction(LineTrap):
    """A ``LineTrap`` that runs ``action`` at the ``n``-th line event of the package's frames instead of raising:
    a collection (user finalizers run there) or a fork at a drawn point of an operation. With ``inside``, only the
    lines of the drivers run inside a driver call (``reaper.busy()``, where the driver's lock may be held) count."""

    def __init__(self, n: int, action, inside: bool = False) -> None:
        super().__init__(_in_package, n)
        self._action, self._inside = action, inside

    def _line(self, frame, event, arg):
        if event == "line" and (not self._inside or (inside_section() and DRIVERS in frame.f_code.co_filename)):
            self.lines += 1
            if self.lines == self.n:
                self.fired = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} ({frame.f_code.co_name})"
                self._action()
        return self._line


class CallFault:
    """The ``k``-th driver operation a call makes (of any kind, counted as the ``Ledger`` records them) goes wrong as
    ``mode`` says: ``error`` (a ``DriverError``, the call changing nothing), ``out of memory`` (a
    ``DriverOutOfMemory``), ``interrupt`` (a ``KeyboardInterrupt`` arriving in the call, before it acts), ``interrupt
    after`` (an ``Interrupt`` at the first line of ``tensor.py`` after the call returned: its effect is made and not
    yet recorded) or ``rollback fails`` (an ``error``, and the first ``unmap`` after it fails too). ``spare(op, ops)``
    says which calls are let through (``ops``: those made so far). ``op``: the call that went wrong, once it did."""

    TENSOR = PACKAGE + "tensor.py"

    def __init__(self, driver, k: int, mode: str, spare=lambda op, ops: False) -> None:
        self.driver, self.k, self.mode, self.spare = driver, k, mode, spare
        self.ops: list[str] = []
        self.op: str | None = None
        self.armed = False
        self.second: str | None = None

    def _record(self, op: str, *args) -> None:
        self._inner(op, *args)
        self.ops.append(op)
        if len(self.ops) == self.k and not self.spare(op, self.ops[:-1]):
            self.op = op
            if self.mode == "interrupt after":
                self.armed = True
                return
            if self.mode == "interrupt":
                raise KeyboardInterrupt("injected")
            kind = DriverOutOfMemory if self.mode == "out of memory" else DriverError
            raise kind(op, f"injected failure ({self.driver.name}, driver call {self.k})")
        if self.mode == "rollback fails" and self.op and op == "unmap" and self.second is None:
            self.second = op
            raise DriverError(op, f"injected failure of the rollback ({self.driver.name})")

    def _trace(self, frame, event, arg):
        return self._line if frame.f_code.co_filename == self.TENSOR else None

    def _line(self, frame, event, arg):
        if event == "line" and self.armed:
            self.armed = False
            raise Interrupt(f"after {self.op} (driver call {self.k}), at tensor.py:{frame.f_lineno}")
        return self._line

    def run(self, call):
        """``call()`` under the fault; what it raised (``None``: it returned)."""
        self._inner = self.driver._record
        self.driver._record = self._record  # the Ledger's own calls reach this one: an instance attribute
        trace = sys.gettrace()
        if self.mode == "interrupt after":
            sys.settrace(self._trace)
        try:
            call()
        except (ExtensibleKVError, KeyboardInterrupt) as exc:  # judged by the caller
            return exc.with_traceback(None)
        finally:
            sys.settrace(trace)
            del self.driver._record
        return None


# -- the model -------------------------------------------------------------------------------------------------------
@dataclass
class TensorModel:
    """What one tensor must hold (see the module docstring). ``lineage`` stands for the growth steps since the last
    release or recommit: a checkpoint names a prefix of it, and only a checkpoint whose prefix is still there can
    be rolled back to."""

    segments: int
    segment_bytes: int
    alignment: int
    granularity: int
    state: str = "open"
    per_segment: int = 0
    data: list[torch.Tensor] = field(default_factory=list)
    views: int = 0
    lineage: list[int] = field(default_factory=lambda: [0])
    serial: int = 0
    pins: list[tuple[str, int]] = field(default_factory=list)
    failure: str | None = None  # what did not finish, as a failed tensor's refusals name it (None: not known)

    def __post_init__(self) -> None:
        self.data = [torch.empty(0, dtype=torch.uint8) for _ in range(self.segments)]

    @property
    def reserved(self) -> int:
        g = self.granularity
        return -(-self.segments * self.segment_bytes // g) * g

    def mapped_granules(self) -> list[int]:
        """The granule indices that back the committed prefixes: every granule any prefix touches, once."""
        if self.state != "open" or self.per_segment == 0:
            return []
        g, s = self.granularity, self.segment_bytes
        out = set()
        for i in range(self.segments):
            out.update(range(i * s // g, -(-(i * s + self.per_segment) // g)))
        return sorted(out)

    def state_error(self) -> type[Exception] | None:
        return {"released": ReleasedError, "closed": ClosedError, "failed": FailedStateError}.get(self.state)

    def resize_refusal(self, nbytes: object) -> type[Exception] | None:
        """The documented order: the type, then the state, then the value."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            return InvalidSizeError
        if self.state_error():
            return self.state_error()
        bad = nbytes <= 0 or nbytes < self.per_segment or nbytes > self.segment_bytes or nbytes % self.alignment
        return InvalidSizeError if bad else None

    def shrink_refusal(self, nbytes: object, reaches: list[int]) -> type[Exception] | None:
        """The documented order: the type, the state, the value, then a pin or a live segment view (its bytes per
        segment in ``reaches``) past ``nbytes``."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            return InvalidSizeError
        if self.state_error():
            return self.state_error()
        if nbytes < 0 or nbytes > self.per_segment or nbytes % self.alignment:
            return InvalidSizeError
        if any(r > nbytes for _, r in self.pins) or any(r > nbytes for r in reaches):
            return BusyError
        return None

    def fresh(self) -> int:
        self.serial += 1
        return self.serial

    def grown(self, new: int) -> None:
        if new > self.per_segment:
            for i, d in enumerate(self.data):
                self.data[i] = torch.cat([d, torch.zeros(new - d.numel(), dtype=torch.uint8)])
            self.per_segment = new
            self.lineage.append(self.fresh())

    def shrunk(self, new: int) -> None:
        """Bytes below ``new`` kept; a shrink starts a new lineage (Note [A shrink is a new lineage])."""
        if new < self.per_segment:
            self.data = [d[:new].clone() for d in self.data]
            self.per_segment, self.lineage = new, [self.fresh()]

    def released(self) -> None:
        self.state, self.lineage = "released", [self.fresh()]

    def recommitted(self) -> None:
        size, self.per_segment = self.per_segment, 0
        self.state, self.lineage = "open", [self.fresh()]
        self.data = [torch.empty(0, dtype=torch.uint8) for _ in range(self.segments)]
        self.grown(size)

    def rolled_back(self, mark: Mark) -> None:
        del self.lineage[mark.depth :]
        self.per_segment = mark.per_segment
        self.data = [d[: mark.per_segment].clone() for d in self.data]

    def mark_valid(self, mark: Mark) -> bool:
        return len(self.lineage) >= mark.depth and self.lineage[mark.depth - 1] == mark.serial

    def failed(self, failure: str | None = None) -> None:
        """``failure``: what did not finish, which every ``FailedStateError`` of the tensor names from now on."""
        self.state, self.per_segment, self.failure = "failed", 0, failure

    def closed(self) -> None:
        self.state, self.per_segment = "closed", 0

    def state_names(self, op: str) -> tuple[str, ...]:
        """What a refusal for the state must name: the operation, the state and, failed, what did not finish."""
        return (op, self.state, *([self.failure] if self.state == "failed" and self.failure else []))

    def resize_names(self, op: str, nbytes: object) -> tuple[str, ...]:
        """What the refusal of ``resize_per_segment_(nbytes)`` must name: the value as given (its type's refusal),
        the operation and the state, or the size with the bound it breaks."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            return ("nbytes", type(nbytes).__name__, repr(nbytes))
        if self.state_error():
            return self.state_names(op)
        if nbytes <= 0:
            return (str(nbytes),)
        if nbytes < self.per_segment:
            return (str(nbytes), str(self.per_segment))
        if nbytes > self.segment_bytes:
            return (str(nbytes), str(self.segment_bytes))
        return (str(nbytes), str(self.alignment))

    def shrink_names(self, op: str, nbytes: object, reaches: list[int]) -> tuple[str, ...]:
        """What the refusal of ``shrink_per_segment_(nbytes)`` must name (as ``resize_names``; a pin by its holder and
        the bytes it reaches, a view by the bytes it reaches)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            return ("nbytes", type(nbytes).__name__, repr(nbytes))
        if self.state_error():
            return self.state_names(op)
        if nbytes < 0:
            return (str(nbytes),)
        if nbytes > self.per_segment:
            return (str(nbytes), str(self.per_segment))
        if nbytes % self.alignment:
            return (str(nbytes), str(self.alignment))
        pins = [f"{h} (at {r})" for h, r in self.pins if r > nbytes]
        if pins:
            return (str(nbytes), *pins)
        return (str(nbytes), *sorted({str(r) for r in reaches if r > nbytes}))


@dataclass
class Mark:
    """A checkpoint, the real one and what the model knew when it was taken."""

    real: object
    per_segment: int
    depth: int
    serial: int


@dataclass(eq=False)  # compared by identity: comparing views would read their bytes
class Held:
    """A view the machine holds: of which object, which segment (``None``: the full view) and how many bytes."""

    owner: str
    view: torch.Tensor
    segment: int | None
    nbytes: int


class _FakeInner:
    """vLLM's own sleep-mode backend, as ``KVSleepBackend`` calls it."""

    def suspend(self, level: int = 1) -> None:
        pass

    def resume(self, tags: object = None) -> None:
        pass


class _FakeConnector:
    """A KV connector's worker side: keeps its ``KVCacheConfig`` and what it was registered with."""

    def __init__(self, config: object) -> None:
        self._kv_cache_config = config
        self.registered = None

    def register_kv_caches(self, kv_caches: dict) -> None:
        self.registered = kv_caches


# -- the machine -----------------------------------------------------------------------------------------------------
class LifecycleMachine(RuleBasedStateMachine):
    """Random lives of two tensors and a worker's KV cache on one driver (see the module docstring). ``hostile``
    adds the rules of forks and user finalizers."""

    hostile = False

    def __init__(self, driver) -> None:
        super().__init__()
        gc.collect()
        self.driver = driver
        self.g = driver.granularity()
        self.name = driver.name
        self.real: dict[str, ExtensibleTensor] = {}
        self.model: dict[str, TensorModel] = {}
        self.held: list[Held] = []
        self.marks: dict[str, list[Mark]] = {"a": [], "kv": []}
        self.base: dict[str, int] = {}
        self.step = "start"
        total = driver.mem_info()[1] if driver.device.type == "cpu" else None
        self.used0 = None if total is None else total - driver.mem_info()[0]
        self.worker = None
        self.kv_blocks = 0
        self.registered = False
        self.connector = None
        self.kv_state = "open"
        self.cap0 = self.cap = driver.max_handle_bytes
        self.seen = len(driver.calls)

    # -- setup -------------------------------------------------------------------------------------------------------
    @initialize(
        segments=st.integers(1, 3),
        quarters=st.sampled_from([3, 5, 10]),
        alignment=st.sampled_from([256, 4096]),
        kv_segments=st.sampled_from([1, 1, 2]),
        with_connector=st.booleans(),
        cap=st.sampled_from([None, None, 1, 2]),
    )
    def build(self, segments, quarters, alignment, kv_segments, with_connector, cap):
        """Tensor ``a``: segment boundaries inside granules; ``b``: one segment of two granules; the KV cache of a
        worker, its null block committed, a connector deferred when drawn; when drawn, a cap of ``cap`` granules
        on a handle's size (``max_handle_bytes``), which no handle created may pass."""
        g = self.g
        if cap is not None:
            self.cap = self.driver.max_handle_bytes = cap * g
        seg = max(g * quarters // 4 // alignment, 1) * alignment
        self._make("a", seg * segments, segments, alignment)
        self._make("b", 2 * g, 1, g)
        self.worker = worker_kv.WorkerKV(self.driver, segments=[kv_segments])
        self.config = SimpleNamespace(
            num_blocks=KV_BLOCKS, kv_cache_tensors=[SimpleNamespace(size=KV_BLOCKS * PAGE, shared_by=["l0"])]
        )
        if with_connector and kv_segments == 1:
            self.connector = _FakeConnector(self.config)
            connector.defer(self.worker, self.connector)
        raw = self.worker.allocate(self.config)["l0"]
        if self.connector is not None:
            self.connector.register_kv_caches({"l0": raw.view(KV_BLOCKS, PAGE)})
        del raw
        t = self.worker.buffers.tensor("kv0")
        self.real["kv"], self.base["kv"] = t, t.base_address
        self.model["kv"] = TensorModel(kv_segments, t.segment_bytes, PAGE // kv_segments, g)
        self.model["kv"].grown(PAGE // kv_segments)
        self.kv_blocks = 1
        self.sleep = KVSleepBackend(SimpleNamespace(_extensible_kv_state=self.worker), _FakeInner())
        self.check("build")

    def _make(self, name: str, nbytes: int, segments: int, alignment: int) -> None:
        self.real[name] = ExtensibleTensor(nbytes, segments, driver=self.driver, alignment=alignment)
        self.model[name] = TensorModel(segments, nbytes // segments, alignment, self.g)
        self.base[name] = self.real[name].base_address

    # -- helpers -----------------------------------------------------------------------------------------------------
    def fail(self, what: str, expected: object, actual: object) -> None:
        raise AssertionError(f"driver {self.name}: after step {self.step!r}: {what}: expected {expected}, got {actual}")

    def snapshot(self, name: str) -> tuple:
        t = self.real[name]
        return (t.state, t.bytes_per_segment, self.driver.outstanding(), t.live_views())

    def refused(self, name: str, what: str, error: type[Exception], call, names: tuple[str, ...] = ()) -> None:
        """``call()`` must raise ``error`` (the type the documentation names) with a message that names each of
        ``names`` (the operation, the state, the offending values, as the model knows them) and change nothing."""
        before = self.snapshot(name)
        try:
            call()
            got = "no error"
        except Exception as exc:  # judged by type below
            got = exc
        after = self.snapshot(name)
        missing = [n for n in names if not named(str(got), n)]
        if not isinstance(got, error) or not str(got) or missing:
            changed = f"; it changed (state, size, records, views) from {before} to {after}" if after != before else ""
            self.fail(f"{what} on {name} ({self.model[name].state})", f"{error.__name__} naming {names}",
                      f"{got!r}{changed} (not named: {missing})")  # fmt: skip
        expect_equal(self.driver, f"after step {self.step}: {what} refused: state, size, driver records, views",
                     before, after)  # fmt: skip
        return got

    def traced(self, action, call, *, enable_gc: bool = False):
        """``guarded(call)`` with ``action`` as the line tracer, the tracer before it restored after; ``enable_gc``:
        the collector, which the caller turned off for the call, turned on again after it."""
        trace = sys.gettrace()
        sys.settrace(action)
        try:
            return self.guarded(call)
        finally:
            sys.settrace(trace)
            if enable_gc:
                gc.enable()

    def guarded(self, call):
        """Run ``call`` with a hard limit: a hang raises ``Hang`` (SIGALRM interrupts a lock's wait), every half
        second until the call returns (what a broken wait does next may wait again)."""

        def alarm(signum, frame):
            raise Hang(f"driver {self.name}: step {self.step}: no return within {HANG_S} s (a lock never given back)")

        old = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, HANG_S, 0.5)  # again every half second: every wait of the hang is broken
        try:
            return call()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)

    def interrupted(self, call, n: int) -> bool:
        """Run ``call`` with an ``Interrupt`` at the ``n``-th line event outside the drivers; whether it fired."""
        trap = LineTrap(_outside_drivers, n)
        trace = sys.gettrace()
        sys.settrace(trap)
        try:
            call()
        except Interrupt:
            pass
        finally:
            sys.settrace(trace)
        return trap.fired is not None

    @staticmethod
    def line_event(key: str, at: int) -> int:
        """The line event ``at`` (of 1000) of the way through operation ``key``'s ``LINES``: uniform over a whole
        step (past a small step's end it runs whole)."""
        return 1 + at * LINES[key] // 1000

    def interrupted_without_collection(self, call, n: int) -> bool:
        """``interrupted`` under the hang guard, with the collector emptied first and off meanwhile, so the line
        events counted are the call's own and no finalizer runs inside it; whether the interrupt fired."""
        gc.collect()
        gc.disable()
        try:
            return self.guarded(lambda: self.interrupted(call, n))
        finally:
            gc.enable()

    def open_kv(self) -> bool:
        return self.kv_state == "open"

    # -- checks after every step -------------------------------------------------------------------------------------
    def check(self, step: str) -> None:
        self.step = step
        out = self.driver.outstanding()
        calls, self.seen = self.driver.calls[self.seen :], len(self.driver.calls)
        if self.cap:
            over = [c.args[0] for c in calls if c.op == "create" and c.args[0] > self.cap]
            expect_equal(self.driver, f"step {step}: handles created over max_handle_bytes={self.cap}", [], over)
        for name in ("a", "b", "kv"):
            self.check_tensor(name, out)
        self.check_shrink_demands("a")
        if self.driver.device.type == "cpu" and not out.handles:
            used = self.driver.mem_info()[1] - self.driver.mem_info()[0]
            expect_equal(
                self.driver,
                f"step {step}: mem_info used bytes (those before the example plus every mapping on record)",
                self.used0 + sum(out.mappings.values()),
                used,
            )
        if all(m.state != "failed" for m in self.model.values()):
            expect_equal(self.driver, f"step {step}: handles held between steps", 0, out.handles)

    def check_shrink_demands(self, name: str) -> None:
        """``check_shrink(v)`` for sizes around the committed one and values of other types, in every state: refused
        with exactly the error and message ``shrink_per_segment_(v)`` is refused with, or returning ``None``
        where the model says a shrink would run; nothing changed either way."""
        m, t = self.model[name], self.real[name]
        per, al, reaches = m.per_segment, m.alignment, self.reaches(name)
        values = {(type(v), v): v for v in (0, per - al, per, per + al, per + al // 2, -al, 2**70, float(al), True)}
        for v in values.values():
            error, what = m.shrink_refusal(v, reaches), f"check_shrink({v!r})"
            if error is None:
                before = self.snapshot(name)
                try:
                    got = t.check_shrink(v)
                except Exception as exc:  # judged below
                    got = exc
                expect_equal(self.driver, f"step {self.step}: {what} on {name} ({m.state}), which a shrink would not "
                             "be refused at", None, got)  # fmt: skip
                expect_equal(self.driver, f"step {self.step}: {what} on {name}: state, size, records, views", before,
                             self.snapshot(name))  # fmt: skip
                continue
            names = m.shrink_names("shrink_per_segment_", v, reaches)
            said = self.refused(name, what, error, lambda: t.check_shrink(v), names)  # noqa: B023
            would = self.refused(name, f"shrink_per_segment_({v!r})", error, lambda: t.shrink_per_segment_(v), names)  # noqa: B023
            expect_equal(self.driver, f"step {self.step}: {what} on {name} ({m.state}): its refusal, against "
                         f"shrink_per_segment_({v!r})'s", f"{type(would).__name__}: {would}",
                         f"{type(said).__name__}: {said}")  # fmt: skip

    def check_tensor(self, name: str, out) -> None:
        t, m, g = self.real[name], self.model[name], self.g
        step = f"step {self.step}: tensor {name}"
        expect_equal(self.driver, f"{step}: state", m.state, t.state)
        expect_equal(self.driver, f"{step}: bytes_per_segment", m.per_segment, t.bytes_per_segment)
        shown = f"{m.per_segment}/{m.segment_bytes} bytes per segment" if m.state == "open" else m.state
        names = (f"{m.segment_bytes * m.segments} bytes", f"{m.segments} segment(s)", shown, f"driver={self.name}")
        expect(all(named(repr(t), x) for x in names), self.driver, f"{step}: repr", f"naming {names}", repr(t))
        base = self.base[name]
        mine = {va: size for va, size in out.mappings.items() if base <= va < base + m.reserved}
        if m.state == "closed":  # what lies in its old range now may be a later tensor's
            live = [(self.base[o], self.model[o].reserved) for o in self.base if self.model[o].state != "closed"]
            ours = {va: size for va, size in mine.items() if not any(b <= va < b + r for b, r in live)}
            reservation = None if any(b <= base < b + r for b, r in live) else out.reservations.get(base)
            expect_equal(self.driver, f"{step}: reservation and mappings on record after close", (None, {}),
                         (reservation, ours))  # fmt: skip
            return
        if m.state == "failed":  # what is still mapped is the records' to say: stats must say the same
            s = t.stats()
            reserved = m.reserved if out.reservations.get(base) == m.reserved else 0
            want = ("failed", 0, 0, sum(mine.values()), len(mine), reserved, m.segment_bytes, m.segments)
            got = (s.state, s.committed_bytes, s.bytes_per_segment, s.backed_bytes, s.mappings, s.reserved_bytes,
                   s.segment_bytes, s.num_segments)  # fmt: skip
            expect_equal(self.driver, f"{step}: stats of a failed tensor (state, committed, bytes per segment, backed: "
                         "what is still mapped, mappings, reserved, segment bytes, segments)", want, got)  # fmt: skip
            return
        expect_equal(self.driver, f"{step}: reservation on record", m.reserved, out.reservations.get(base))
        mapped = sorted(k for va, size in mine.items() for k in range((va - base) // g, (va - base + size) // g))
        expect_equal(self.driver, f"{step}: granules mapped on record", m.mapped_granules(), mapped)
        s = t.stats()
        committed, backed = m.per_segment * m.segments if m.state == "open" else 0, len(m.mapped_granules()) * g
        want = (m.state, committed, backed, len(mine), m.reserved, m.per_segment, m.segment_bytes, m.segments, g,
                backed - committed)  # fmt: skip
        got = (s.state, s.committed_bytes, s.backed_bytes, s.mappings, s.reserved_bytes, s.bytes_per_segment,
               s.segment_bytes, s.num_segments, s.granularity, s.waste_bytes)  # fmt: skip
        expect_equal(self.driver, f"{step}: stats (state, committed, backed, mappings, reserved, bytes per segment, "
                     "segment bytes, segments, granularity, waste)", want, got)  # fmt: skip
        if name == "a":
            expect_equal(self.driver, f"{step}: pinned_by", tuple(h for h, _ in m.pins), t.pinned_by)
        if name != "kv":
            gc.collect()
            expect_equal(self.driver, f"{step}: live_views", m.views, t.live_views())
        if m.state == "open":
            for i, d in enumerate(m.data):
                expect_bytes(self.driver, f"{step}: segment {i} (as written, zeros where grown)", t.segment_view(i), d)

    # -- tensor a: growth ----------------------------------------------------------------------------------------
    @rule(units=st.integers(0, 12))
    def grow(self, units):
        """A valid size (the current one, a no-op, included), refused unless open."""
        m, t = self.model["a"], self.real["a"]
        new = min(max(units * m.alignment, m.per_segment, m.alignment), m.segment_bytes)
        new -= new % m.alignment
        error = m.resize_refusal(new)
        if error:
            self.refused("a", f"resize_per_segment_({new})", error, lambda: t.resize_per_segment_(new),
                         m.resize_names("resize_per_segment_", new))  # fmt: skip
        else:
            self.guarded(lambda: t.resize_per_segment_(new))
            m.grown(new)
        self.check(f"grow a to {new}")

    @rule(kind=st.sampled_from(SIZE_KINDS))
    def grow_invalid(self, kind):
        """Shrink, past the reservation, misaligned, zero, negative, 2**70, a float, a string, a bool."""
        m, t = self.model["a"], self.real["a"]
        value = {
            "shrink": m.per_segment - m.alignment,
            "past": m.segment_bytes + m.alignment,
            "misaligned": m.per_segment + m.alignment // 2,
            "zero": 0,
            "negative": -m.alignment,
            "2**70": 2**70,
            "float": float(m.alignment),
            "str": str(m.alignment),
            "bool": True,
        }[kind]
        error = m.resize_refusal(value)
        if error is None:  # shrink from nothing, misaligned past the end: what is left is valid or invalid by size
            return
        self.refused("a", f"resize_per_segment_({value!r})", error, lambda: t.resize_per_segment_(value),
                     m.resize_names("resize_per_segment_", value))  # fmt: skip
        self.check(f"grow a invalid {kind} {value!r}")

    # -- tensor a: shrink ------------------------------------------------------------------------------------------
    def reaches(self, name: str) -> list[int]:
        """The bytes per segment of every segment view of ``name`` the machine holds (full views reach nothing)."""
        return [h.nbytes for h in self.held if h.owner == name and h.segment is not None]

    @rule(units=st.integers(0, 12))
    def shrink(self, units):
        """A smaller size (zero and the current one, a no-op, included): refused unless open, while a held segment
        view reaches past it; the bytes below it kept."""
        m, t = self.model["a"], self.real["a"]
        new = min(units * m.alignment, m.per_segment)
        new -= new % m.alignment
        error = m.shrink_refusal(new, self.reaches("a"))
        if error:
            self.refused("a", f"shrink_per_segment_({new})", error, lambda: t.shrink_per_segment_(new),
                         m.shrink_names("shrink_per_segment_", new, self.reaches("a")))  # fmt: skip
        else:
            self.guarded(lambda: t.shrink_per_segment_(new))
            m.shrunk(new)
        self.check(f"shrink a to {new}")

    @rule(kind=st.sampled_from(SHRINK_KINDS))
    def shrink_invalid(self, kind):
        """Larger than committed, misaligned, negative, 2**70, a float, a string, a bool."""
        m, t = self.model["a"], self.real["a"]
        value = {
            "grow": m.per_segment + m.alignment,
            "misaligned": m.per_segment - m.alignment // 2,
            "negative": -m.alignment,
            "2**70": 2**70,
            "float": float(m.alignment),
            "str": str(m.alignment),
            "bool": True,
        }[kind]
        error = m.shrink_refusal(value, self.reaches("a"))
        if error is None:
            return
        self.refused("a", f"shrink_per_segment_({value!r})", error, lambda: t.shrink_per_segment_(value),
                     m.shrink_names("shrink_per_segment_", value, self.reaches("a")))  # fmt: skip
        self.check(f"shrink a invalid {kind} {value!r}")

    # -- tensor a: views and data ------------------------------------------------------------------------------------
    def strands(self, mark) -> list[int]:
        """What rolling tensor a back to ``mark`` would leave over unmapped bytes: the reaches of the segment views
        the machine holds and of the pins above it; refused with ``BusyError`` where any (Note [A rollback never
        strands a view])."""
        m = self.model["a"]
        if mark.per_segment >= m.per_segment:
            return []
        return sorted({r for r in [*self.reaches("a"), *(r for _, r in m.pins)] if r > mark.per_segment})

    @rule(segment=st.integers(-1, 3), full=st.booleans(), dtype=st.sampled_from(DTYPES))
    def take_view(self, segment, full, dtype):
        """A segment view (its committed bytes, at its segment's offset) or the full view, as ``dtype``: the bytes
        the model holds there."""
        m, t = self.model["a"], self.real["a"]
        what = f"full_view({dtype})" if full else f"segment_view({segment}, {dtype})"
        call = (lambda: t.full_view(dtype)) if full else (lambda: t.segment_view(segment, dtype))
        if not full and not 0 <= segment < m.segments:
            self.refused("a", what, SegmentIndexError, call, (str(segment), str(m.segments)))
        elif m.state_error():
            self.refused("a", what, m.state_error(), call, m.state_names("full_view" if full else "segment_view"))
        else:
            typed = call()
            view = typed.view(torch.uint8)
            nbytes = view.numel()
            expect_equal(self.driver, f"{what} bytes", t.max_num_bytes if full else m.per_segment, nbytes)
            expect_equal(self.driver, f"{what} dtype", dtype, typed.dtype)
            if full:
                for i, d in enumerate(m.data):
                    lo = i * m.segment_bytes
                    expect_bytes(self.driver, f"{what}: segment {i} at offset {lo}", view[lo : lo + d.numel()], d)
            elif nbytes:
                expect_bytes(self.driver, f"{what}: the segment's bytes", view, m.data[segment])
            del typed
            self.held.append(Held("a", view, None if full else segment, nbytes))
            m.views += nbytes > 0
        self.check(f"take {what} of a")

    @precondition(lambda self: any(h.owner == "a" for h in self.held))
    @rule(pick=st.integers(0, 50))
    def drop_view(self, pick):
        mine = [h for h in self.held if h.owner == "a"]
        h = mine[pick % len(mine)]
        self.held.remove(h)
        self.model["a"].views -= h.nbytes > 0
        del h, mine
        self.check("drop a view of a")

    @precondition(lambda self: any(h.owner == "a" for h in self.held))
    @rule(pick=st.integers(0, 50), seed=st.integers(0, 250), segment=st.integers(0, 2))
    def write_through_view(self, pick, seed, segment):
        """A pattern written through a held view, where it is committed now (never released memory)."""
        m = self.model["a"]
        mine = [h for h in self.held if h.owner == "a"]
        h = mine[pick % len(mine)]
        if m.state != "open" or m.per_segment == 0:
            return
        if h.segment is None:
            segment %= m.segments
            lo, n = segment * m.segment_bytes, m.per_segment
        else:
            segment, lo, n = h.segment, 0, min(h.nbytes, m.per_segment)
        if n == 0:
            return
        data = pattern(n, seed, t_device := h.view.device)
        h.view[lo : lo + n].copy_(data.to(t_device))
        m.data[segment][:n] = data.cpu()
        self.check(f"write through a held view of a, segment {segment}")

    # -- tensor a: checkpoints -----------------------------------------------------------------------------------
    @rule()
    def checkpoint(self):
        m, t = self.model["a"], self.real["a"]
        if m.state == "closed":
            return
        self.marks["a"].append(Mark(t.checkpoint(), m.per_segment, len(m.lineage), m.lineage[-1]))
        self.check("checkpoint of a")

    @precondition(lambda self: self.marks["a"])
    @rule(pick=st.integers(0, 50))
    def rollback(self, pick):
        """To a checkpoint still in the lineage: back to its size; one of another lineage (taken before a release,
        a recommit or a rollback past it): ``InvalidArgumentError``, nothing changed; not open: nothing."""
        m, t = self.model["a"], self.real["a"]
        mark = self.marks["a"][pick % len(self.marks["a"])]
        if m.state != "open":
            got = t.rollback_to(mark.real)
            expect_equal(self.driver, f"rollback_to on a {m.state} tensor: what could not be undone", [], got)
        elif not m.mark_valid(mark):
            self.refused("a", "rollback_to(a checkpoint of another lineage)", InvalidArgumentError,
                         lambda: t.rollback_to(mark.real), ("rollback_to", str(mark.per_segment),
                                                            f"keeps {m.per_segment} bytes"))  # fmt: skip
        elif beyond := self.strands(mark):
            self.refused("a", "rollback_to(a checkpoint below a live segment view or a pin)", BusyError,
                         lambda: t.rollback_to(mark.real), (f"rollback_to {mark.per_segment} bytes",
                                                            ", ".join(map(str, beyond))))  # fmt: skip
        else:
            got = self.guarded(lambda: t.rollback_to(mark.real))
            expect_equal(self.driver, "rollback_to: what could not be undone", [], got)
            m.rolled_back(mark)
        self.check(f"rollback a to {mark.per_segment} bytes per segment (depth {mark.depth})")

    @rule(what=st.sampled_from(["tuple", "none", "other tensor"]))
    def rollback_to_a_foreign_mark(self, what):
        m, t = self.model["a"], self.real["a"]
        if m.state != "open":
            return
        others = [self.real[n] for n in ("b", "kv") if self.model[n].state != "closed"]  # a closed one hands none
        if what == "other tensor" and not others:
            return
        mark = {"tuple": lambda: (0, 0), "none": lambda: None, "other tensor": lambda: others[0].checkpoint()}[what]()
        self.refused("a", f"rollback_to({what})", InvalidArgumentError, lambda: t.rollback_to(mark),
                     ("rollback_to", type(mark).__name__))  # fmt: skip
        self.check(f"rollback a to a foreign mark ({what})")

    # -- tensor a: release, recommit, close --------------------------------------------------------------------------
    @rule()
    def release(self):
        m, t = self.model["a"], self.real["a"]
        if m.state_error():
            self.refused(
                "a", "release_physical()", m.state_error(), t.release_physical, m.state_names("release_physical")
            )
        elif m.pins:
            self.refused("a", "release_physical() while pinned", BusyError, t.release_physical,
                         (*(h for h, _ in m.pins), str(m.per_segment)))  # fmt: skip
        else:
            self.guarded(t.release_physical)
            m.released()
        self.check("release a")

    @rule()
    def recommit(self):
        m, t = self.model["a"], self.real["a"]
        if m.state != "released":
            names = m.state_names("recommit_physical") if m.state_error() else ("not released", str(m.per_segment))
            self.refused("a", "recommit_physical()", m.state_error() or ReleasedError, t.recommit_physical, names)
        else:
            self.guarded(t.recommit_physical)
            m.recommitted()
        self.check("recommit a")

    @rule(force=st.booleans(), segments=st.integers(1, 3), quarters=st.sampled_from([3, 5, 10]))
    def close(self, force, segments, quarters):
        """Close (refused while views are alive, unless forced); once closed, every use refused and a new ``a``,
        so that the rest of the example has a tensor to work on."""
        m, t = self.model["a"], self.real["a"]
        if m.state == "closed":
            self.guarded(lambda: t.close(force=force))  # a second close does nothing
        elif m.views and not force:
            self.refused("a", "close() with views alive", BusyError, t.close, (f"{m.views} view",))
        else:
            self.guarded(lambda: t.close(force=force))
            m.closed()
        self.check(f"close a (force={force})")
        if m.state == "closed":
            self.closed_tensor_refuses(force)
            self.reopen(segments, quarters)

    @rule(force=st.booleans())
    def closed_tensor_refuses(self, force):
        """After close every use is ``ClosedError``; close again does nothing."""
        m, t = self.model["a"], self.real["a"]
        if m.state != "closed":
            return
        for what, call in (("segment_view(0)", lambda: t.segment_view(0)), ("stats()", t.stats),
                           ("full_view()", t.full_view), ("base_address", lambda: t.base_address)):  # fmt: skip
            self.refused("a", what, ClosedError, call, (what.split("(")[0], "closed"))
        t.close(force=force)
        self.check("use a closed tensor")

    @precondition(lambda self: self.model["a"].state == "closed")
    @rule(segments=st.integers(1, 3), quarters=st.sampled_from([3, 5, 10]))
    def reopen(self, segments, quarters):
        """A new tensor ``a`` once the old one is closed (its address may be the old one's)."""
        self.held = [h for h in self.held if h.owner != "a"]
        self.marks["a"].clear()
        seg = max(self.g * quarters // 4 // 256, 1) * 256
        self._make("a", seg * segments, segments, 256)
        self.check("reopen a")

    # -- tensor a: pins ------------------------------------------------------------------------------------------
    @rule(holder=st.sampled_from(HOLDERS))
    def pin(self, holder):
        """A holder registers views of the committed bytes: refused unless open; until unpinned, a shrink below the
        size it saw and a release are refused with ``BusyError`` naming it."""
        m, t = self.model["a"], self.real["a"]
        if m.state_error():
            self.refused("a", f"pin({holder!r})", m.state_error(), lambda: t.pin(holder), m.state_names("pin"))
        else:
            t.pin(holder)
            m.pins.append((holder, m.per_segment))
        self.check(f"pin a by {holder}")

    @rule(holder=st.sampled_from(HOLDERS))
    def unpin(self, holder):
        """One registration of ``holder`` dropped; one that is not there: ``InvalidArgumentError`` naming it."""
        m, t = self.model["a"], self.real["a"]
        if m.state == "closed":
            return
        held = [h for h, _ in m.pins]
        if holder not in held:
            self.refused("a", f"unpin({holder!r})", InvalidArgumentError, lambda: t.unpin(holder), (repr(holder),))
        else:
            t.unpin(holder)
            del m.pins[held.index(holder)]
        self.check(f"unpin a by {holder}")

    # -- tensor a: no-ops keep the lineage -----------------------------------------------------------------------
    @rule()
    def noops_keep_the_lineage(self):
        """A checkpoint, a resize and a shrink to the current size (no-ops), then a growth step: rolling back to the
        checkpoint is allowed and restores its size (a no-op starts no lineage)."""
        m, t = self.model["a"], self.real["a"]
        if m.state != "open" or m.per_segment == 0 or m.shrink_refusal(m.per_segment, self.reaches("a")):
            return
        mark = Mark(t.checkpoint(), m.per_segment, len(m.lineage), m.lineage[-1])
        self.guarded(lambda: t.resize_per_segment_(m.per_segment))
        self.guarded(lambda: t.shrink_per_segment_(m.per_segment))
        if m.per_segment + m.alignment <= m.segment_bytes:
            self.guarded(lambda: t.resize_per_segment_(m.per_segment + m.alignment))
            m.grown(m.per_segment + m.alignment)
        got = self.guarded(lambda: t.rollback_to(mark.real))
        expect_equal(self.driver, "rollback_to a checkpoint taken before two no-ops: what could not be undone", [],
                     got)  # fmt: skip
        m.rolled_back(mark)
        self.marks["a"].append(mark)
        self.check("no-op resize and shrink, grow, rollback to before them")

    # -- tensor a: driver faults ---------------------------------------------------------------------------------
    @rule(during=st.sampled_from(sorted(FAULT_OPS)), which=st.integers(0, 69), nth=st.integers(1, 3),
          interrupt=st.booleans(), units=st.integers(0, 12))  # fmt: skip
    def driver_fault(self, during, which, nth, interrupt, units):
        """The ``nth`` next driver call ``op`` fails (``DriverError``, or ``KeyboardInterrupt`` as an interrupt
        landing in it) during a growth, shrink, release or recommit of ``a``. Growth and recommit roll back (the
        old size, released for a recommit; ``CommitError`` naming the driver call and the sizes); a shrink keeps
        its old size when the fault comes before its first unmap and is ``failed`` after it (``ShrinkError``);
        a release is ``failed``; a fault never reached changes nothing. Then every check."""
        m, t, d = self.model["a"], self.real["a"], self.driver
        target, old = during, m.per_segment  # what the state allows when ``during`` does not
        if m.state == "released":
            target = "recommit"
        elif m.state == "open" and during == "recommit":
            target = "grow" if m.pins else "release"
        op = FAULT_OPS[target][which % len(FAULT_OPS[target])]
        if target == "grow":
            new = min(max(units * m.alignment, old), m.segment_bytes)
            new -= new % m.alignment
            new = new if new > old else m.segment_bytes
            if m.state != "open" or new <= old:
                return
            call, done, kept = (lambda: t.resize_per_segment_(new)), ("open", new), ("open", old)
        elif target == "shrink":
            new = min(units * m.alignment, old)
            new -= new % m.alignment
            new = new if new < old else 0
            if m.state != "open" or new >= old or m.shrink_refusal(new, self.reaches("a")):
                return
            if op == "release" and not interrupt:  # after the step is done: the handle stays for close()
                return
            call, done, kept = (lambda: t.shrink_per_segment_(new)), ("open", new), ("open", old)
        elif target == "release" and m.state == "open" and not m.pins:
            new, call, done, kept = old, t.release_physical, ("released", old), ("failed", 0)
        elif target == "recommit" and m.state == "released":
            new, call, done, kept = old, t.recommit_physical, ("open", old), ("released", old)
        else:
            return
        error = KeyboardInterrupt("injected") if interrupt else None
        since = len(d.calls)
        gc.collect()
        gc.disable()
        d.fail(op, nth, error)
        raised = None
        try:
            self.guarded(call)
        except (ExtensibleKVError, KeyboardInterrupt) as exc:  # judged below
            raised = exc.with_traceback(None)
        finally:
            d.clear_faults()
            gc.enable()
        calls = [c.op for c in d.calls[since:]]
        hits = [i for i, c in enumerate(calls) if c == op]
        fired = len(hits) >= nth
        if fired and target == "shrink":  # a refused first unmap changed nothing; an interrupt in it may have
            at, first = hits[nth - 1], calls.index("unmap") if "unmap" in calls else len(calls)
            kept = ("open", old) if at < first or (at == first and not interrupt) else ("failed", 0)
        want = kept if fired else done
        got = (t.state, t.bytes_per_segment)
        what = f"{target} of a with {op} call {nth} failing ({'KeyboardInterrupt' if interrupt else 'DriverError'})"
        expect_equal(self.driver, f"{what}: state and size (fired: {fired}, calls {calls})", want, got)
        if not fired:
            expect_equal(self.driver, f"{what}: what it raised (the fault was not reached)", None, raised)
        elif interrupt:
            expect(raised is not None and str(raised) == "injected", self.driver, f"{what}: what it raised",
                   "the KeyboardInterrupt itself", repr(raised))  # fmt: skip
        elif target == "release":
            expect(isinstance(raised, DriverError) and op in str(raised), self.driver, f"{what}: what it raised",
                   f"the DriverError of {op}", repr(raised))  # fmt: skip
        else:
            kind = ShrinkError if target == "shrink" else CommitError
            committed = old if want[0] == "open" else 0
            names = (op, str(old), str(new), "injected failure")
            ok = (isinstance(raised, kind) and raised.operation == op and raised.requested == new
                  and raised.committed == committed and all(x in str(raised) for x in names))  # fmt: skip
            expect(ok, self.driver, f"{what}: what it raised", f"{kind.__name__}(operation={op!r}, requested={new}, "
                   f"committed={committed}) naming {names}", repr(raised))  # fmt: skip
        if got == done and got != (m.state, old):
            {"grow": lambda: m.grown(new), "shrink": lambda: m.shrunk(new), "release": m.released,
             "recommit": m.recommitted}[target]()  # fmt: skip
        elif got == ("failed", 0):
            m.failed(failure_of(target, old, new))
        self.refuse_failed()
        self.check(f"{what} -> {got}")

    @rule(during=st.sampled_from(["grow", "shrink", "recommit", "release", "close"]), mode=st.sampled_from(FAULT_MODES),
          units=st.integers(0, 12), start=st.integers(1, 8))  # fmt: skip
    def fault_sweep(self, during, mode, units, start):
        """Every driver call of a growth, a shrink or a recommit of ``a`` in turn goes wrong (``CallFault``), one
        attempt per call, until the step runs whole, the way it goes wrong cycling through the modes from ``mode``
        (a failing rollback, which fails the tensor, once, at call ``start``); a release or a close, whose first
        fault fails the tensor, once, at call ``start``. Each attempt must end as documented: growth and recommit all or
        nothing (``CommitError``, ``CommitOutOfMemory`` for lack of memory, naming the call and the sizes; failed,
        naming what the rollback could not undo, where the rollback's unmap fails too); a shrink kept before its
        first unmap (``ShrinkError``) and failed after it; a release failed; a close failed and, retried, closed
        with everything returned; an interrupt re-raised as it is. Then every check, the records of ``a`` after
        each attempt."""
        m, t = self.model["a"], self.real["a"]
        target, old = during, m.per_segment
        if m.state == "released":
            target = "close" if during == "close" else "recommit"
        elif m.state == "failed":
            target = "close"
        elif m.state == "open" and during == "recommit":
            target = "grow"
        if m.state == "closed" or (target == "release" and m.pins):
            return
        new = old
        if target == "grow":
            new = min(max(units * m.alignment, old), m.segment_bytes)
            new -= new % m.alignment
            new = new if new > old else m.segment_bytes
            if new <= old:
                return
            call = lambda: t.resize_per_segment_(new)  # noqa: E731
        elif target == "shrink":
            if old == 0:  # nothing to give back: grown whole first, so that the shrink splits mappings
                self.guarded(lambda: t.resize_per_segment_(m.segment_bytes))
                m.grown(m.segment_bytes)
                old = m.per_segment
            new = min(units * m.alignment, old)
            new -= new % m.alignment
            new = new if new < old else 0
            if new >= old or m.shrink_refusal(new, self.reaches("a")):
                return
            call = lambda: t.shrink_per_segment_(new)  # noqa: E731
        elif target == "recommit":
            call = t.recommit_physical
        elif target == "release":
            call = t.release_physical
        else:
            call = lambda: t.close(force=True)  # noqa: E731
        done = {"grow": ("open", new), "shrink": ("open", new), "recommit": ("open", old), "release": ("released", old),
                "close": ("closed", 0)}[target]  # fmt: skip
        sweep = target in ("grow", "shrink", "recommit") and mode != "rollback fails"
        cycle = FAULT_MODES[:-1]  # the modes that leave a growth or a shrink's first half as it was
        first = cycle.index(mode) if mode in cycle else 0
        k, attempt = (1 if sweep and target != "shrink" else start), 0  # a shrink's second half: from ``start``
        while True:
            if attempt:
                mode = cycle[(first + attempt) % len(cycle)]
            # A driver's refusal of a shrink's last release leaves the step done and the handle for close(): spared.
            refusal = target == "shrink" and mode not in ("interrupt", "interrupt after")
            spare = lambda op, ops, r=refusal: r and op == "release" and "unmap" in ops  # noqa: E731
            fault = CallFault(self.driver, k, mode, spare)
            gc.collect()
            gc.disable()
            try:
                raised = self.guarded(lambda f=fault, c=call: f.run(c))
            finally:
                gc.enable()
            got, op = (t.state, t.bytes_per_segment), fault.op
            what = f"{target} of a from {old} to {new} bytes per segment with driver call {k} ({op}) failing: {mode}"
            if op is None or (mode == "interrupt after" and fault.armed):  # not reached: the step ran whole
                expect_equal(self.driver, f"{what}: state and size (the fault not reached; calls {fault.ops})", done,
                             got)  # fmt: skip
                expect_equal(self.driver, f"{what}: what it raised (the fault not reached)", None, raised)
                {"grow": lambda: m.grown(new), "shrink": lambda: m.shrunk(new), "recommit": m.recommitted,
                 "release": m.released, "close": m.closed}[target]()  # fmt: skip
                break
            want = self.fault_outcome(target, mode, fault, old)
            expect_equal(self.driver, f"{what}: state and size (calls {fault.ops})", want, got)
            self.judge_raised(what, target, mode, fault, raised, old, new, want)
            if want[0] == "failed":
                m.failed(failure_of(target, old, new))
                self.refuse_failed()
                self.step = what
                self.check_tensor("a", self.driver.outstanding())
            attempt += 1
            if attempt >= 60:
                break
            if target in ("release", "close") and want[0] == "failed":
                # close() retried picks up where the last one stopped: its first call after the synchronize goes
                # wrong next, until one returns everything
                target, call, done, k = "close", (lambda: t.close(force=True)), ("closed", 0), 2
                continue
            if want[0] == "failed" or not sweep:
                break
            self.step = what
            self.check_tensor("a", self.driver.outstanding())
            expect_equal(self.driver, f"{what}: handles held after it", 0, self.driver.outstanding().handles)
            k += 1
        self.check(f"{target} of a with each driver call failing in turn ({mode}), {attempt} attempt(s)")
        if m.state == "closed":
            self.reopen(1, 5)

    @staticmethod
    def fault_outcome(target: str, mode: str, fault: CallFault, old: int) -> tuple[str, int]:
        """The (state, bytes per segment) ``target`` must end in when ``fault`` went wrong: Note [Intent, effect,
        record], Note [A shrink unmaps whole mappings] and the states of the module docstring of ``tensor.py``."""
        at, ops = fault.k - 1, fault.ops
        if target in ("grow", "recommit"):
            kept = ("open", old) if target == "grow" else ("released", old)
            mapped = "map" in ops[:at] or (mode == "interrupt after" and ops[at] == "map")
            return ("failed", 0) if mode == "rollback fails" and mapped else kept
        if target == "shrink":
            first = ops.index("unmap") if "unmap" in ops else len(ops)
            refused = mode in ("error", "out of memory", "rollback fails")  # the call changed nothing
            return ("open", old) if at < first or (at == first and refused) else ("failed", 0)
        return ("failed", 0)

    def judge_raised(self, what, target, mode, fault, raised, old, new, want) -> None:
        """What a step that ``fault`` broke must raise: the interrupt itself; for a growth, recommit or shrink the
        ``CommitError`` (``CommitOutOfMemory`` for lack of memory in growth, ``ShrinkError`` in a shrink) naming the
        driver call, the sizes and, where the rollback could not finish, what it could not undo; else the
        ``DriverError`` of the call."""
        op = fault.op
        if mode == "interrupt after":
            expect(isinstance(raised, Interrupt), self.driver, f"{what}: what it raised", "the Interrupt itself",
                   repr(raised))  # fmt: skip
            return
        if mode == "interrupt":
            expect(type(raised) is KeyboardInterrupt and str(raised) == "injected", self.driver,
                   f"{what}: what it raised", "the KeyboardInterrupt itself", repr(raised))  # fmt: skip
            return
        if target in ("release", "close"):
            kind = DriverOutOfMemory if mode == "out of memory" else DriverError
            expect(isinstance(raised, kind) and raised.operation == op and named(str(raised), op), self.driver,
                   f"{what}: what it raised", f"the {kind.__name__} of {op}", repr(raised))  # fmt: skip
            return
        kind = ShrinkError if target == "shrink" else CommitOutOfMemory if mode == "out of memory" else CommitError
        # committed: what the step kept, the size it started from (a recommit from none); none once the tensor is
        # failed (a growth or shrink whose undoing could not finish)
        requested, committed = new, 0 if target == "recommit" else old if want[0] == "open" else 0
        names = (op, str(old), str(new), "injected failure")
        unfinished = mode == "rollback fails" and want[0] == "failed" and target != "shrink"
        if unfinished:
            names += ("rollback also failed", "unmap") + (("the tensor is failed",) if target == "grow" else ())
        elif target == "shrink":  # the message says which (ShrinkError)
            names += (f"kept {old} bytes per segment",) if want[0] == "open" else ("the tensor is failed",)
        else:
            names += (f"kept {0 if target == 'recommit' else old} bytes per segment",)
        if target == "grow":
            names += (f"{new * self.model['a'].segments} bytes in all",)
        if not unfinished and any(named(str(raised), x) for x in ("rollback also failed", "undoing also failed")):
            self.fail(f"{what}: what it raised", "no word of an undo that failed (it finished)", repr(raised))
        ok = (type(raised) is kind and raised.operation == op and raised.requested == requested
              and raised.committed == committed and all(named(str(raised), x) for x in names))  # fmt: skip
        expect(ok, self.driver, f"{what}: what it raised", f"{kind.__name__}(operation={op!r}, requested={requested}, "
               f"committed={committed}) naming {names}", repr(raised))  # fmt: skip

    # -- re-entry ----------------------------------------------------------------------------------------------------
    @rule(op=st.sampled_from(["grow", "shrink", "release", "recommit", "view"]), n=st.integers(1, 30),
          units=st.integers(0, 12))  # fmt: skip
    def reenter(self, op, n, units):
        """Calls made (by a finalizer or a signal handler) inside the ``n``-th line of a driver call of an operation
        of ``a``, where ``a``'s lock is held and the driver's may be: on ``a`` every locked operation is refused with
        ``BusyError`` naming it and "an operation of this tensor", and ``close()`` naming "a driver call"; on
        ``b`` the operations that call the driver are refused with ``BusyError`` naming them and "a driver call",
        the others (``stats``, ``check_shrink``) run as between steps; nothing changes, and ``a``'s operation is
        whole (Note [Operations never wait on themselves])."""
        m, t, mb, b = self.model["a"], self.real["a"], self.model["b"], self.real["b"]
        new = m.per_segment
        if op == "grow" and m.state == "open":
            new = min(max(units * m.alignment, m.per_segment + m.alignment), m.segment_bytes)
            new -= new % m.alignment
            call, after = (lambda: t.resize_per_segment_(new)), (lambda: m.grown(new))
        elif op == "shrink" and m.state == "open":
            new = min(units * m.alignment, m.per_segment)
            new -= new % m.alignment
            if m.shrink_refusal(new, self.reaches("a")):
                return
            call, after = (lambda: t.shrink_per_segment_(new)), (lambda: m.shrunk(new))
        elif op == "release" and m.state == "open" and not m.pins:
            call, after = t.release_physical, m.released
        elif op == "recommit" and m.state == "released":
            call, after = t.recommit_physical, m.recommitted
        elif op == "view" and m.state == "open":
            call, after = (lambda: t.segment_view(0)), (lambda: None)
        else:
            return
        if op in ("grow", "shrink") and new == m.per_segment:
            return
        held = max(mb.per_segment, mb.alignment)
        tries = [("a", "stats", t.stats), ("a", "check_shrink", lambda: t.check_shrink(0)),
                 ("a", "segment_view", lambda: t.segment_view(0)),
                 ("a", "resize_per_segment_", lambda: t.resize_per_segment_(m.segment_bytes)),
                 ("a", "release_physical", t.release_physical), ("a", "close()", lambda: t.close(force=True)),
                 ("a", "full_view", t.full_view), ("a", "recommit_physical", t.recommit_physical),
                 ("a", "checkpoint", t.checkpoint), ("a", "pin", lambda: t.pin("finalizer")),
                 ("a", "unpin", lambda: t.unpin("finalizer")),
                 ("b", "full_view", b.full_view), ("b", "recommit_physical", b.recommit_physical),
                 ("b", "rollback_to", lambda: b.rollback_to(b.checkpoint())),
                 ("b", "stats", b.stats), ("b", "check_shrink", lambda: b.check_shrink(mb.per_segment)),
                 ("b", "resize_per_segment_", lambda: b.resize_per_segment_(held)),
                 ("b", "shrink_per_segment_", lambda: b.shrink_per_segment_(mb.per_segment)),
                 ("b", "release_physical", b.release_physical),
                 ("b", "close()", lambda: b.close(force=True))]  # fmt: skip
        if self.marks["a"]:  # one the model holds: a checkpoint taken inside the step would count half of it
            tries.append(("a", "rollback_to", lambda: t.rollback_to(self.marks["a"][-1].real)))
        outcomes = []

        def inside():
            for who, name, attempt in tries:
                try:
                    attempt()
                    outcomes.append((who, name, None))
                except Exception as exc:  # judged below
                    outcomes.append((who, name, exc.with_traceback(None)))

        action = LineAction(n, inside, inside=True)
        gc.collect()
        gc.disable()
        self.traced(action, call, enable_gc=True)
        after()
        for who, name, got in outcomes:
            runs = who == "b" and name in ("stats", "check_shrink", "full_view")
            if runs and mb.state == "open":
                want, names = None, ()
            elif who == "b" and name == "rollback_to" and mb.state == "closed":  # its checkpoint() first
                want, names = ClosedError, ("checkpoint", "closed")
            elif runs:
                want, names = ClosedError, (name if name != "check_shrink" else "shrink_per_segment_", "closed")
            else:
                reason = "an operation of this tensor" if who == "a" and name != "close()" else "a driver call"
                want, names = BusyError, (name, reason)
            if want is None:
                ok = got is None
            else:
                ok = isinstance(got, want) and all(named(str(got), x) for x in names)
            expect(
                ok,
                self.driver,
                f"{name} of {who} inside a driver call of {op} of a (line {action.fired})",
                f"{want.__name__ if want else 'a return'}" + (f" naming {names}" if names else ""),
                repr(got),
            )
        self.check(f"{op} of a with calls of a and b inside its driver call at line {n} ({action.fired})")

    # -- construction, views of every dtype, lifetimes ----------------------------------------------------------------
    @rule()
    def construct(self):
        """Every documented refusal of the constructor (``InvalidSizeError`` naming the argument and its value,
        before any driver call), the smallest tensor and the defaults (one segment, alignment 1: any size), and the
        views of a tensor of odd sizes: a dtype that does not divide the segment's offset, its committed bytes or
        the reservation is refused with ``InvalidSizeError`` naming them, one that is not a dtype with
        ``InvalidArgumentError``, an index that is not an int or out of range with ``InvalidSizeError`` and
        ``SegmentIndexError``."""
        d, g = self.driver, self.g
        odd = g + 1
        cases = [
            ((1.0,), {}, ("max_num_bytes", "float", "1.0")),
            ((g, "2"), {}, ("num_segments", "str", "'2'")),
            ((g,), {"alignment": True}, ("alignment", "bool", "True")),
            ((0,), {}, ("max_num_bytes", "0")),
            ((-g,), {}, ("max_num_bytes", str(-g))),
            ((g, 0), {}, ("num_segments", "0")),
            ((g, -1), {}, ("num_segments", "-1")),
            ((odd, 2), {}, ("num_segments=2", f"max_num_bytes={odd}", "remainder 1")),
            ((g,), {"alignment": 0}, ("alignment", "0")),
            ((g,), {"alignment": -256}, ("alignment", "-256")),
            ((2 * g, 2), {"alignment": 3}, (str(g), f"max_num_bytes={2 * g}", "num_segments=2", "alignment=3")),
            ((MAX_BYTES - 1,), {}, (f"max_num_bytes={MAX_BYTES - 1}", self.name, str(g), str(MAX_BYTES - 1))),
            ((MAX_BYTES - g + 1,), {}, (f"max_num_bytes={MAX_BYTES - g + 1}", str(MAX_BYTES - 1))),
        ]
        for args, kwargs, names in cases:
            what = f"ExtensibleTensor{(*args, *(f'{k}={v!r}' for k, v in kwargs.items()))}"
            before, calls = d.outstanding(), len(d.calls)
            try:
                ExtensibleTensor(*args, driver=d, **kwargs)
                got = "no error"
            except Exception as exc:  # judged below
                got = exc
            ok = type(got) is InvalidSizeError and all(named(str(got), x) for x in names)
            expect(ok, d, f"{what}: refused", f"InvalidSizeError naming {names}", repr(got))
            expect_equal(d, f"{what}: refused before any driver call (records, calls made)", (before, calls),
                         (d.outstanding(), len(d.calls)))  # fmt: skip
        try:  # the smallest, with the defaults: one segment, alignment 1 (any size)
            one = ExtensibleTensor(1, driver=d)
            got = (one.max_num_bytes, one.num_segments, one.segment_bytes, one.resize_per_segment_(1).bytes_per_segment)
            one.close()
        except Exception as exc:  # judged below
            got = exc
        expect_equal(d, "ExtensibleTensor(1) grown to 1 byte: bytes, segments (default), segment bytes, bytes per "
                     "segment (alignment 1 by default)", (1, 1, 1, 1), got)  # fmt: skip
        c = ExtensibleTensor(15, 3, driver=d)
        c.resize_per_segment_(3)
        views = [
            ("segment_view(1, torch.float16)", lambda: c.segment_view(1, torch.float16), InvalidSizeError,
             ("segment 1", "offset 5", "3 committed bytes", "torch.float16", "2 bytes")),
            ("segment_view(0, torch.int32)", lambda: c.segment_view(0, torch.int32), InvalidSizeError,
             ("segment 0", "offset 0", "3 committed bytes", "torch.int32", "4 bytes")),
            ("full_view(torch.float16)", lambda: c.full_view(torch.float16), InvalidSizeError,
             ("max_num_bytes=15", "torch.float16", "2 bytes")),
            ("segment_view(0, 'x')", lambda: c.segment_view(0, "x"), InvalidArgumentError, ("dtype", "str", "'x'")),
            ("full_view(None)", lambda: c.full_view(None), InvalidArgumentError, ("dtype", "NoneType", "None")),
            ("segment_view(1.0)", lambda: c.segment_view(1.0), InvalidSizeError, ("index", "float", "1.0")),
            ("segment_view(3)", lambda: c.segment_view(3), SegmentIndexError, ("3", "3 segment")),
            ("segment_view(-1)", lambda: c.segment_view(-1), SegmentIndexError, ("-1", "3 segment")),
        ]  # fmt: skip
        for what, attempt, error, names in views:
            try:
                attempt()
                got = "no error"
            except Exception as exc:  # judged below
                got = exc
            ok = type(got) is error and all(named(str(got), x) for x in names)
            expect(ok, d, f"{what} of a tensor of 15 bytes in 3 segments at 3 bytes per segment",
                   f"{error.__name__} naming {names}", repr(got))  # fmt: skip
        for holder, names in (("", ("pin", "str", "''")), (3, ("pin", "int", "3")), (None, ("pin", "NoneType"))):
            try:
                c.pin(holder)
                got = "no error"
            except Exception as exc:  # judged below
                got = exc
            ok = type(got) is InvalidArgumentError and all(named(str(got), x) for x in names)
            expect(ok, d, f"pin({holder!r})", f"InvalidArgumentError naming {names}", repr(got))
        expect_equal(d, "pinned_by after refused pins", (), c.pinned_by)
        for i in range(3):
            view = c.segment_view(i)
            expect_equal(d, f"segment_view({i}) of 3 odd segments: bytes, dtype", (3, torch.uint8),
                         (view.numel(), view.dtype))  # fmt: skip
            view.copy_(pattern(3, i, view.device))
        full = c.full_view()
        expect_equal(d, "full_view() of 15 bytes: bytes", 15, full.numel())
        for i in range(3):
            expect_bytes(d, f"full_view() of 3 odd segments: segment {i} at offset {5 * i}", full[5 * i : 5 * i + 3],
                         pattern(3, i, full.device))  # fmt: skip
        del full, view
        kept = c.full_view(keep_committed=True)  # holds the 3 bytes per segment committed now, as a segment view does
        for what, attempt in (("check_shrink(0)", lambda: c.check_shrink(0)),
                              ("shrink_per_segment_(0)", lambda: c.shrink_per_segment_(0))):  # fmt: skip
            try:
                attempt()
                got = "no error"
            except Exception as exc:  # judged below
                got = exc
            ok = type(got) is BusyError and named(str(got), "shrink_per_segment_(0)") and named(str(got), "3")
            expect(ok, d, f"{what} with a full_view(keep_committed=True) over 3 bytes per segment alive",
                   "BusyError naming shrink_per_segment_(0) and 3", repr(got))  # fmt: skip
        plain = c.full_view()  # reaches nothing: never blocks a shrink
        del kept
        c.shrink_per_segment_(0)
        expect_equal(d, "bytes per segment after shrink_per_segment_(0) with a plain full_view alive", 0,
                     c.bytes_per_segment)  # fmt: skip
        del plain
        c.close()
        self.check("construct tensors with valid and invalid arguments")

    @rule(resurrect=st.booleans())
    def lifetime(self, resurrect):
        """A view keeps its tensor alive after the last direct reference is gone (the bytes, the reservation and the
        mappings stay); once the view is gone too, the collection returns the memory. A tensor resurrected by a
        user ``__del__`` in the cycle that collected it is closed: everything returned, every use ``ClosedError``,
        ``close()`` nothing."""
        d, g = self.driver, self.g
        t = ExtensibleTensor(2 * g, 2, driver=d, alignment=256)
        t.resize_per_segment_(g // 2)
        base, keep = t.base_address, []
        view = t.segment_view(1)
        view.copy_(pattern(g // 2, 3, view.device))

        def ours():
            out = d.outstanding()
            mine = [(va - base) // g for va, size in out.mappings.items() if base <= va < base + 2 * g]
            return out.reservations.get(base), sorted(mine)

        if resurrect:

            class Resurrect:
                def __init__(self, victim):
                    self.victim, self.me = victim, self

                def __del__(self):
                    keep.append(self.victim)

            del view
            Resurrect(t)
        del t
        gc.collect()
        if resurrect:
            expect_equal(d, "a tensor resurrected after its collection: its reservation and mappings", (None, []),
                         ours())  # fmt: skip
            (t,) = keep
            expect_equal(d, "a resurrected tensor: state, bytes per segment", ("closed", 0),
                         (t.state, t.bytes_per_segment))  # fmt: skip
            for what, attempt in (("segment_view", lambda: t.segment_view(0)), ("stats", t.stats),
                                  ("resize_per_segment_", lambda: t.resize_per_segment_(g)),
                                  ("shrink_per_segment_", lambda: t.shrink_per_segment_(0)),
                                  ("check_shrink", lambda: t.check_shrink(0))):  # fmt: skip
                try:
                    attempt()
                    got = "no error"
                except Exception as exc:  # judged below
                    got = exc
                expect(isinstance(got, ClosedError) and named(str(got), "closed"), d,
                       f"{what} of a resurrected tensor", "ClosedError naming closed", repr(got))  # fmt: skip
            t.close()
            keep.clear()
            del t
        else:
            expect_equal(d, "a tensor whose view is alive after its last reference went: reservation, mappings",
                         (2 * g, [0, 1] if self.cap == g else [0]), ours())  # fmt: skip
            expect_bytes(d, "the view of a tensor with no other reference", view, pattern(g // 2, 3, view.device))
            del view
            gc.collect()
            expect_equal(d, "a tensor collected with its last view: its reservation and mappings", (None, []),
                         ours())  # fmt: skip
        self.check(f"a tensor's lifetime (resurrected: {resurrect})")

    # -- interrupts --------------------------------------------------------------------------------------------------
    @rule(op=st.sampled_from(["grow", "shrink", "release", "recommit", "close", "rollback"]), at=st.integers(0, 999),
          units=st.integers(1, 12), pick=st.integers(0, 50))  # fmt: skip
    def interrupt(self, op, at, units, pick):
        """An ``Interrupt`` at a line event drawn uniformly over a whole operation of ``a`` that the model says may
        run (``line_event``): it ends whole, not at all, or failed (growth, rollback, release) and nothing else."""
        m, t = self.model["a"], self.real["a"]
        new, mark = 0, None
        if op == "grow":
            new = min(max(units * m.alignment, m.per_segment), m.segment_bytes)
            new -= new % m.alignment
            if m.state != "open" or new <= m.per_segment:
                return
            call = lambda: t.resize_per_segment_(new)  # noqa: E731
        elif op == "shrink":
            new = min(units * m.alignment, m.per_segment)
            new -= new % m.alignment
            if m.state != "open" or new >= m.per_segment or m.shrink_refusal(new, self.reaches("a")):
                return
            call = lambda: t.shrink_per_segment_(new)  # noqa: E731
        elif op == "release" and m.state == "open" and not m.pins:
            call = t.release_physical
        elif op == "recommit" and m.state == "released":
            call = t.recommit_physical
        elif op == "close" and m.state in ("open", "released", "failed"):
            call = lambda: t.close(force=True)  # noqa: E731
        elif op == "rollback" and m.state == "open" and self.marks["a"]:
            mark = self.marks["a"][pick % len(self.marks["a"])]
            if not m.mark_valid(mark) or self.strands(mark):
                return
            call = lambda: t.rollback_to(mark.real)  # noqa: E731
        else:
            return
        old = (m.state, m.per_segment)
        n = self.line_event(op, at)
        fired = self.interrupted_without_collection(call, n)
        got = (t.state, t.bytes_per_segment)
        done = {
            "grow": ("open", new) if op == "grow" else None,
            "shrink": ("open", new) if op == "shrink" else None,
            "release": ("released", m.per_segment),
            "recommit": ("open", m.per_segment),
            "close": ("closed", 0),
            "rollback": ("open", mark.per_segment) if op == "rollback" else None,
        }[op]
        allowed = {old, done, ("failed", 0)}
        if not fired:
            allowed = {done}
        if got not in allowed:
            self.fail(f"{op} of a interrupted at line {n} (fired: {fired})", f"one of {sorted(allowed)}", got)
        if got == done and got != old:
            {"grow": lambda: m.grown(new), "shrink": lambda: m.shrunk(new), "release": m.released,
             "recommit": m.recommitted, "close": m.closed, "rollback": lambda: m.rolled_back(mark)}[op]()  # fmt: skip
        elif got == ("failed", 0):  # a failed tensor's close interrupted: before or after it says so, unknown
            m.failed(failure_of(op, old[1], new, mark) if old != got else None)
        self.refuse_failed()
        self.check(f"{op} of a interrupted at line event {n} (fired: {fired}) -> {got}")

    def refuse_failed(self) -> None:
        """A failed ``a`` refuses views, growth, shrink and release with ``FailedStateError`` naming the state."""
        m, t = self.model["a"], self.real["a"]
        if m.state == "failed":
            for what, call in (("segment_view(0)", lambda: t.segment_view(0)), ("resize_per_segment_()",
                    lambda: t.resize_per_segment_(m.segment_bytes)), ("release_physical()", t.release_physical),
                    ("shrink_per_segment_()", lambda: t.shrink_per_segment_(0))):  # fmt: skip
                self.refused("a", what, FailedStateError, call, m.state_names(what.split("(")[0]))

    # -- the worker's KV cache ---------------------------------------------------------------------------------------
    @rule(blocks=st.integers(0, KV_BLOCKS))
    def ensure_blocks(self, blocks):
        w, m = self.worker, self.model["kv"]
        if self.kv_state != "open":
            error = {"released": ReleasedError, "closed": ClosedError, "failed": FailedStateError}[self.kv_state]
            self.refused("kv", f"WorkerKV.ensure_blocks({blocks})", error,
                         lambda: w.ensure_blocks(blocks, reason="model"))  # fmt: skip
        elif self.registered and blocks > self.kv_blocks:
            self.refused("kv", f"WorkerKV.ensure_blocks({blocks}) after a connector registered", BusyError,
                         lambda: w.ensure_blocks(blocks, reason="model"))  # fmt: skip
        else:
            got = self.guarded(lambda: w.ensure_blocks(blocks, reason="model"))
            self.kv_blocks = max(self.kv_blocks, blocks)
            expect_equal(self.driver, f"WorkerKV.ensure_blocks({blocks})", self.kv_blocks, got)
            m.grown(self.kv_blocks * m.alignment)
        self.check(f"ensure {blocks} KV blocks")

    @rule(blocks=st.integers(0, KV_BLOCKS))
    def shrink_blocks(self, blocks):
        """``shrink_blocks`` to a count at or below the committed one: every buffer's granules above it given back
        (the bytes returned are the model's backed granules before minus after), the blocks below kept; refused
        unless open, above the count, and below the count a connector registered."""
        b, m = self.worker.buffers, self.model["kv"]
        blocks = min(blocks, self.kv_blocks)
        if self.kv_state != "open":
            error = {"released": ReleasedError, "closed": ClosedError, "failed": FailedStateError}[self.kv_state]
            self.refused("kv", f"shrink_blocks({blocks})", error, lambda: b.shrink_blocks(blocks))
        elif self.registered and blocks < self.kv_blocks:
            self.refused("kv", f"shrink_blocks({blocks}) after a connector registered", BusyError,
                         lambda: b.shrink_blocks(blocks))  # fmt: skip
        else:
            before = len(m.mapped_granules())
            got = self.guarded(lambda: b.shrink_blocks(blocks))
            self.kv_blocks = blocks
            m.shrunk(blocks * m.alignment)
            expect_equal(self.driver, f"bytes shrink_blocks({blocks}) gave back", (before - len(m.mapped_granules()))
                         * self.g, got)  # fmt: skip
            expect_equal(self.driver, f"num_blocks after shrink_blocks({blocks})", blocks, b.num_blocks)
        self.check(f"shrink to {blocks} KV blocks")

    @rule(how=st.sampled_from(["grow", "shrink", "unpin"]))
    def change_kv_underneath(self, how):
        """A KV buffer's tensor grown, shrunk or unpinned directly through ``tensor(name)``: the buffers are
        ``failed`` and refuse growth and views with ``FailedStateError`` naming the buffer (Note [A buffer changed
        underneath] in ``kv_cache``); undone the same way, they are open again at the count on record."""
        b, m, t = self.worker.buffers, self.model["kv"], self.real["kv"]
        if self.kv_state != "open":
            return
        old, name = t.bytes_per_segment, b.buffers[0].name
        if how == "grow" and not self.registered and old + m.alignment <= m.segment_bytes:
            t.resize_per_segment_(old + m.alignment)
            m.grown(old + m.alignment)
            undo = lambda: (t.shrink_per_segment_(old), m.shrunk(old))  # noqa: E731
        elif how == "shrink" and not self.registered and old > 0:
            t.shrink_per_segment_(old - m.alignment)
            m.shrunk(old - m.alignment)
            undo = lambda: (t.resize_per_segment_(old), m.grown(old))  # noqa: E731
        elif how == "unpin" and self.registered:
            holder = next(iter(b.pinned_by))
            t.unpin(holder)
            undo = lambda: t.pin(holder)  # noqa: E731
        else:
            return
        expect_equal(self.driver, f"KV buffers' state after {how} of buffer {name} through tensor(name)", "failed",
                     b.state)  # fmt: skip
        self.refused("kv", f"ensure_blocks after {how} through tensor(name)", FailedStateError,
                     lambda: b.ensure_blocks(min(self.kv_blocks + 1, b.max_num_blocks)), (name,))  # fmt: skip
        for layer in [x.name for buffer in b.buffers for x in buffer.layers][:1]:
            self.refused("kv", f"committed_layer_views after {how} through tensor(name)", FailedStateError,
                         lambda layer=layer: b.committed_layer_views(layer), (name,))  # fmt: skip
        undo()
        expect_equal(self.driver, f"KV buffers' state after {how} through tensor(name) was undone", "open", b.state)
        self.check(f"{how} of the KV buffer through tensor(name), refused, undone")

    @rule(kind=st.sampled_from(["-1", "past", "float", "bool"]))
    def shrink_blocks_invalid(self, kind):
        """Negative, above the committed count, not an int: ``InvalidSizeError``, nothing changed."""
        b = self.worker.buffers
        value = {"-1": -1, "past": self.kv_blocks + 1, "float": 1.0, "bool": True}[kind]
        if self.kv_state != "open":
            return
        self.refused("kv", f"shrink_blocks({value!r})", InvalidSizeError, lambda: b.shrink_blocks(value))
        self.check(f"shrink to an invalid count of KV blocks ({kind})")

    @rule(kind=st.sampled_from(BLOCK_KINDS))
    def ensure_blocks_invalid(self, kind):
        """A count the reservation cannot hold, negative, or not an int: ``InvalidSizeError`` before anything is
        committed, in every state but closed."""
        w = self.worker
        value = {"-1": -1, "past": KV_BLOCKS + 1, "2**70": 2**70, "float": 2.0, "str": "2", "bool": True}[kind]
        if self.kv_state == "closed":
            return
        self.refused("kv", f"WorkerKV.ensure_blocks({value!r})", InvalidSizeError,
                     lambda: w.ensure_blocks(value, reason="model"))  # fmt: skip
        self.check(f"ensure an invalid count of KV blocks ({kind})")

    @rule(data=st.integers(0, 250))
    def write_kv(self, data):
        m, t = self.model["kv"], self.real["kv"]
        if self.kv_state != "open":
            return
        n = m.per_segment
        for i in range(m.segments):
            block = pattern(n, data + i, t.device)
            t.segment_view(i).copy_(block)
            m.data[i] = block.cpu()
        self.check("write every committed KV byte")

    @rule(level=st.sampled_from([1, 2]))
    def suspend(self, level):
        """Sleep: the KV pages released, unless a connector registered them (``BusyError``, nothing released)."""
        m = self.model["kv"]
        if self.kv_state == "open" and self.registered:
            self.refused("kv", f"KVSleepBackend.suspend({level}) with a connector registered", BusyError,
                         lambda: self.sleep.suspend(level))  # fmt: skip
        elif self.kv_state == "open":
            self.guarded(lambda: self.sleep.suspend(level))
            self.kv_state = "released"
            m.released()
        elif self.kv_state == "released":
            self.sleep.suspend(level)  # asleep already: nothing released twice
        else:
            return
        self.check(f"suspend({level})")

    @rule(tags=st.sampled_from([None, ["kv_cache"], ["weights"]]))
    def resume(self, tags):
        m = self.model["kv"]
        if self.kv_state not in ("open", "released"):
            return
        self.guarded(lambda: self.sleep.resume(tags))
        if self.kv_state == "released" and tags != ["weights"]:
            self.kv_state = "open"
            m.recommitted()
        self.check(f"resume({tags})")

    @precondition(lambda self: self.connector is not None and not self.registered)
    @rule()
    def register_connector(self):
        if self.kv_state != "open":
            return
        connector.register(self.worker)
        expect_equal(self.driver, "blocks the connector was handed", self.kv_blocks * PAGE,
                     self.connector.registered["l0"].untyped_storage().nbytes())  # fmt: skip
        self.registered = True
        self.check("register the KV connector")

    @rule(op=st.sampled_from(["ensure", "shrink", "release", "recommit"]), at=st.integers(0, 999),
          blocks=st.integers(0, KV_BLOCKS))  # fmt: skip
    def interrupt_kv(self, op, at, blocks):
        """An ``Interrupt`` at a line event drawn uniformly over a KV step: whole, not at all, or failed."""
        m, b = self.model["kv"], self.worker.buffers
        if op == "ensure" and self.kv_state == "open" and blocks > self.kv_blocks and not self.registered:
            call, done = (lambda: b.ensure_blocks(blocks)), ("open", blocks * m.alignment)
        elif op == "shrink" and self.kv_state == "open" and blocks < self.kv_blocks and not self.registered:
            call, done = (lambda: b.shrink_blocks(blocks)), ("open", blocks * m.alignment)
        elif op == "release" and self.kv_state == "open" and not self.registered:
            call, done = b.release_physical, ("released", m.per_segment)
        elif op == "recommit" and self.kv_state == "released":
            call, done = b.recommit_physical, ("open", m.per_segment)
        else:
            return
        old = (self.kv_state, m.per_segment)
        n = self.line_event(f"kv {op}", at)
        fired = self.interrupted_without_collection(call, n)
        got = (b.state, self.real["kv"].bytes_per_segment)
        allowed = {old, done, ("failed", 0)} if fired else {done}
        if got not in allowed:
            self.fail(f"KV {op} interrupted at line {n}", f"one of {sorted(allowed)}", got)
        if got == done and got != old:
            if op in ("ensure", "shrink"):
                self.kv_blocks = blocks
                m.grown(done[1]) if op == "ensure" else m.shrunk(done[1])
            else:
                self.kv_state = done[0]
                m.released() if op == "release" else m.recommitted()
        elif got == ("failed", 0) and got != old:
            self.kv_state = "failed"
            m.failed()
        self.check(f"KV {op} interrupted at line event {n} (fired: {fired}) -> {got}")

    @rule()
    def close_kv(self):
        if self.kv_state == "closed":
            return
        self.guarded(self.worker.buffers.close)
        self.kv_state = "closed"
        self.model["kv"].closed()
        self.check("close the KV buffers")

    # -- forks and user finalizers (``hostile``) ---------------------------------------------------------------------
    @precondition(lambda self: self.hostile)
    @rule(n=st.integers(0, 40), op=st.sampled_from(["grow", "release", "view"]), units=st.integers(1, 12),
          inside=st.booleans())  # fmt: skip
    def fork(self, n, op, units, inside):
        """A fork between steps (``n == 0``) or at the ``n``-th line of an operation of ``a``: in the child,
        ``close()``, a view and ``mem_info`` of the inherited tensor and driver return or raise the documented typed
        error (``DriverError``: the driver refuses a forked process) within ``CHILD_S`` seconds, never hang; the
        parent's data, records and memory are untouched."""
        m, t = self.model["a"], self.real["a"]
        results = []
        if n == 0 or m.state not in ("open",) or (op == "release" and m.pins):
            results.append(self._fork_child())
            self.check("fork between steps")
            self._judge_children(results)
            return
        new = min(max(units * m.alignment, m.per_segment), m.segment_bytes)
        new -= new % m.alignment
        call = {"grow": lambda: t.resize_per_segment_(new), "release": t.release_physical,
                "view": lambda: t.segment_view(0)}[op]  # fmt: skip
        action = LineAction(n, lambda: results.append(self._fork_child()), inside)
        self.traced(action, call)
        if op == "grow":
            m.grown(new)
        elif op == "release":
            m.released()
        self.check(f"{op} of a with a fork at line event {n} ({action.fired}, inside={inside})")
        self._judge_children(results)

    def _fork_child(self) -> tuple[str, int]:
        t, driver = self.real["a"], self.driver
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report by the pipe and the exit status only
            os.close(r)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(CHILD_S)  # a hang is killed by SIGALRM
            outcomes = []
            for op, call in (("segment_view", lambda: t.segment_view(0)), ("mem_info", driver.mem_info),
                             ("close", lambda: t.close(force=True)), ("pin", lambda: t.pin("child")),
                             ("checkpoint", t.checkpoint), ("live_views", t.live_views)):  # fmt: skip
                try:
                    call()
                    outcomes.append("returned")
                except BaseException as exc:  # the child reports every outcome
                    outcomes.append(type(exc).__name__ + (f"(naming {op})" if named(str(exc), op) else ""))
            outcomes.append(t.state)  # closed: close() in a child returns nothing and closes its copy
            os.write(w, ",".join(outcomes).encode())
            os._exit(0)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        with os.fdopen(r) as fh:
            said = fh.read()
        return said, status

    def _judge_children(self, results) -> None:
        for said, status in results:
            if os.WIFSIGNALED(status):
                killed = f"killed by {signal.Signals(os.WTERMSIG(status)).name} after {said or 'nothing'}"
                self.fail("a forked child's segment_view, mem_info, close", f"an answer within {CHILD_S} s", killed)
            rest = ["DriverError(naming mem_info)", "returned", "DriverError(naming pin)",
                    "DriverError(naming checkpoint)", "DriverError(naming live_views)", "closed"]  # fmt: skip
            want = ",".join(["DriverError(naming segment_view)", *rest])
            if said != want:
                state_error = {"released": "ReleasedError", "failed": "FailedStateError", "closed": "ClosedError"}
                ok = said.split(",")[1:] == rest and said.split(",")[0] in state_error.values()
                if not ok:
                    self.fail("a forked child's segment_view, mem_info, close (typed refusals)", want, said)

    @precondition(lambda self: self.hostile)
    @rule(n=st.integers(1, 40), units=st.integers(1, 12), op=st.sampled_from(["grow", "new tensor", "view"]),
          inside=st.booleans())  # fmt: skip
    def finalizer_closes_b(self, n, units, op, inside):
        """A user object with ``__del__`` that calls ``b.close()``, garbage in a cycle, collected at the ``n``-th
        line of an operation of ``a`` (inside a driver call that holds the driver's lock, or anywhere else): no
        deadlock; ``b`` is closed, or refused with ``BusyError`` and unchanged; the operation of ``a`` is whole."""
        m, t = self.model["a"], self.real["a"]
        if self.model["b"].state == "closed" or m.state != "open":
            return
        outcome = []

        class Closer:
            def __init__(self, victim):
                self.victim, self.me = victim, self

            def __del__(self):
                try:
                    self.victim.close(force=True)
                    outcome.append("closed")
                except BaseException as exc:  # judged below
                    outcome.append(exc.with_traceback(None))  # its frames would keep a's half-made view alive

        gc.collect()
        gc.disable()
        Closer(self.real["b"])
        new = min(max(units * m.alignment, m.per_segment), m.segment_bytes)
        new -= new % m.alignment
        made = []
        call = {"grow": lambda: t.resize_per_segment_(new), "view": lambda: t.segment_view(0),
                "new tensor": lambda: made.append(ExtensibleTensor(self.g, driver=self.driver))}[op]  # fmt: skip
        action = LineAction(n, gc.collect, inside)
        self.traced(action, call, enable_gc=True)
        for extra in made:
            extra.close()
        if op == "grow":
            m.grown(new)
        if not action.fired:
            gc.collect()
        if outcome == ["closed"]:
            self.model["b"].closed()
        elif not (len(outcome) == 1 and isinstance(outcome[0], BusyError)):
            self.fail("a user finalizer's b.close() run by the collector", "closed, or BusyError", outcome)
        gc.collect()
        self.check(f"{op} of a with a collection at line event {n} ({action.fired}, inside={inside}): b {outcome}")

    # -- end -------------------------------------------------------------------------------------------------------
    def teardown(self):
        self.driver.max_handle_bytes = self.cap0
        self.held.clear()
        self.marks = {}
        for name in ("a", "b"):
            t = self.real.get(name)
            if t is not None:
                t.close(force=True)
                t.close(force=True)
        if self.worker is not None:
            self.worker.buffers.close()
            self.worker.buffers.close()
            connector.defer(self.worker, None)
        self.real.clear()
        self.worker = self.sleep = self.connector = None
        gc.collect()
        left = self.driver.outstanding()
        expect(not left, self.driver, f"after step {self.step}: what is left once every object is closed",
               "nothing", left)  # fmt: skip


class HostileLifecycleMachine(LifecycleMachine):
    """``LifecycleMachine`` with forks and user finalizers."""

    hostile = True


__all__ = ["LifecycleMachine", "HostileLifecycleMachine", "TensorModel", "Hang", "DriverError", "ExtensibleKVError"]
