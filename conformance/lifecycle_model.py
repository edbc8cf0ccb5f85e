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
it, a release failed. Every failure names the driver, the step, what was expected and what was found.
"""

from __future__ import annotations

import gc
import os
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
    DriverError,
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

    def failed(self) -> None:
        self.state, self.per_segment = "failed", 0

    def closed(self) -> None:
        self.state, self.per_segment = "closed", 0

    def resize_names(self, op: str, nbytes: object) -> tuple[str, ...]:
        """What the refusal of ``resize_per_segment_(nbytes)`` must name: the value as given (its type's refusal),
        the operation and the state, or the size with the bound it breaks."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            return (repr(nbytes),)
        if self.state_error():
            return (op, self.state)
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
            return (repr(nbytes),)
        if self.state_error():
            return (op, self.state)
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
        missing = [n for n in names if n not in str(got)]
        if not isinstance(got, error) or not str(got) or missing:
            changed = f"; it changed (state, size, records, views) from {before} to {after}" if after != before else ""
            self.fail(f"{what} on {name} ({self.model[name].state})", f"{error.__name__} naming {names}",
                      f"{got!r}{changed} (not named: {missing})")  # fmt: skip
        expect_equal(self.driver, f"after step {self.step}: {what} refused: state, size, driver records, views",
                     before, after)  # fmt: skip

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

    def check_tensor(self, name: str, out) -> None:
        t, m, g = self.real[name], self.model[name], self.g
        step = f"step {self.step}: tensor {name}"
        expect_equal(self.driver, f"{step}: state", m.state, t.state)
        expect_equal(self.driver, f"{step}: bytes_per_segment", m.per_segment, t.bytes_per_segment)
        base = self.base[name]
        mine = {va: size for va, size in out.mappings.items() if base <= va < base + m.reserved}
        if m.state == "closed":  # what lies in its old range now may be a later tensor's
            live = [(self.base[o], self.model[o].reserved) for o in self.base if self.model[o].state != "closed"]
            ours = {va: size for va, size in mine.items() if not any(b <= va < b + r for b, r in live)}
            reservation = None if any(b <= base < b + r for b, r in live) else out.reservations.get(base)
            expect_equal(self.driver, f"{step}: reservation and mappings on record after close", (None, {}),
                         (reservation, ours))  # fmt: skip
            return
        if m.state == "failed":
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
    def strands(self, mark) -> bool:
        """Whether rolling tensor a back to ``mark`` would leave a segment view the machine holds over unmapped bytes:
        refused with ``BusyError`` (Note [A rollback never strands a view])."""
        m = self.model["a"]
        return mark.per_segment < m.per_segment and any(r > mark.per_segment for r in self.reaches("a"))

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
            self.refused("a", what, m.state_error(), call, ("full_view" if full else "segment_view", m.state))
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
        elif self.strands(mark):
            beyond = sorted({r for r in self.reaches("a") if r > mark.per_segment})
            self.refused("a", "rollback_to(a checkpoint below a live segment view)", BusyError,
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
        mark = {"tuple": (0, 0), "none": None, "other tensor": self.real["b"].checkpoint()}[what]
        self.refused("a", f"rollback_to({what})", InvalidArgumentError, lambda: t.rollback_to(mark),
                     ("rollback_to", type(mark).__name__))  # fmt: skip
        self.check(f"rollback a to a foreign mark ({what})")

    # -- tensor a: release, recommit, close --------------------------------------------------------------------------
    @rule()
    def release(self):
        m, t = self.model["a"], self.real["a"]
        if m.state_error():
            self.refused("a", "release_physical()", m.state_error(), t.release_physical, ("release_physical", m.state))
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
            names = ("recommit_physical", m.state) if m.state_error() else ("not released", str(m.per_segment))
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
            self.refused("a", f"pin({holder!r})", m.state_error(), lambda: t.pin(holder), ("pin", m.state))
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
            m.failed()
        self.refuse_failed()
        self.check(f"{what} -> {got}")

    # -- interrupts --------------------------------------------------------------------------------------------------
    @rule(op=st.sampled_from(["grow", "shrink", "release", "recommit", "close", "rollback"]), at=st.integers(0, 999),
          units=st.integers(1, 12), pick=st.integers(0, 50))  # fmt: skip
    def interrupt(self, op, at, units, pick):
        """An ``Interrupt`` at a line event drawn uniformly over a whole operation of ``a`` that the model says may
        run (``line_event``): it ends whole, not at all, or failed (growth, rollback, release) and nothing else."""
        m, t = self.model["a"], self.real["a"]
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
        elif got == ("failed", 0) and old != got:
            m.failed()
        self.refuse_failed()
        self.check(f"{op} of a interrupted at line event {n} (fired: {fired}) -> {got}")

    def refuse_failed(self) -> None:
        """A failed ``a`` refuses views, growth, shrink and release with ``FailedStateError`` naming the state."""
        m, t = self.model["a"], self.real["a"]
        if m.state == "failed":
            for what, call in (("segment_view(0)", lambda: t.segment_view(0)), ("resize_per_segment_()",
                    lambda: t.resize_per_segment_(m.segment_bytes)), ("release_physical()", t.release_physical),
                    ("shrink_per_segment_()", lambda: t.shrink_per_segment_(0))):  # fmt: skip
                self.refused("a", what, FailedStateError, call, (what.split("(")[0], "failed"))

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
        trace = sys.gettrace()
        sys.settrace(action)
        try:
            self.guarded(call)
        finally:
            sys.settrace(trace)
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
            for call in (lambda: t.segment_view(0), driver.mem_info, lambda: t.close(force=True)):
                try:
                    call()
                    outcomes.append("returned")
                except BaseException as exc:  # the child reports every outcome
                    outcomes.append(type(exc).__name__)
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
            want = "DriverError,DriverError,returned"
            if said != want:
                state_error = {"released": "ReleasedError", "failed": "FailedStateError", "closed": "ClosedError"}
                ok = said.split(",")[1:] == ["DriverError", "returned"] and said.split(",")[0] in state_error.values()
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
        trace = sys.gettrace()
        sys.settrace(action)
        try:
            self.guarded(call)
        finally:
            sys.settrace(trace)
            gc.enable()
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
