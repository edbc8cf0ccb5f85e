"""Contended pairs: every pair of protocol calls that can touch one range or one handle, made by two threads at once
many times over, each outcome judged against the model's serial orders (``protocol_model.linearize``) and the kernel's
view of the shared granules compared with the model after each try. The rule is ``test_contended_pairs.py``.

Note [Stalls inside the driver]
    A driver that lets go of its lock between its records and its kernel call leaves a gap of a few microseconds in
    which another thread's call on the same range sees records the kernel does not agree with. Two calls started from
    a barrier, with the thread switch interval at 5 ms or at a microsecond, land in it rarely (the map of a range
    another thread unmaps: 2 to 3 times in 100, 0 in 100 once the range had access), and a wrapper around the driver
    cannot widen it: the gap is inside the driver. So one thread runs under a trace function that sleeps
    ``STALL_S`` at every line of the driver's own Python code (its class and its bases), which widens every gap
    between two lines, and the other thread's call starts at the stalled one's first line event, then its second,
    and so on to its last (at most ``MAX_LINES``), then the same with the roles swapped: the other call lands between
    every two lines of this one, the gap among them. Figure: each of the seven drivers of
    ``tests/meta/broken_unlocked.py`` fails its pair at 6 to 40 of the 18 to 62 start lines, and fails this rule 10
    runs of 10, where the two-thread rules before passed the ``unmap`` one 3 runs of 3 and its pair landed 0 times in
    40 without the stalls; the rule takes about 24 s per host driver on two loaded cores.

Note [A waiting call lands in the gap]
    Where the records let one call through only after the other (a ``map`` of a range being unmapped, an ``unmap``
    of a range being mapped, a ``set_access`` of a range being unmapped), that call repeats until it is taken (or
    refused): it is then taken at the first moment the records allow, which is inside a gap when there is one, also
    between two stalls. A run of the same refusal (or of the same grant of access) counts once in the serial orders:
    it changes nothing, so it fits wherever its first call fits.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import time
from dataclasses import dataclass

import pytest
from hypothesis.stateful import rule

from .helpers import expect, expect_equal, wait_until_gone
from .kernel_view import KernelView
from .protocol_checks import ProtocolChecks, learn_setup, shown
from .protocol_model import Event, linearize

MAX_LINES = 40
"""The most line events of a stalled thread's calls that the other thread's call is started at, one try each."""
STALL_S = 2e-4
"""How long a stalled thread sleeps at each line of the driver's code: long enough for the other thread's whole call
on a loaded two-core machine."""
SPIN_LIMIT = 20000
"""The most calls a repeating thread makes in one try."""
JOIN_S = 30


@dataclass(frozen=True)
class Call:
    """A call in the model's terms (``args`` name handles by key); ``spin``, how the thread repeats it: ``None`` (once),
    ``taken`` (until one is taken) or ``refused`` (until one is refused), ending too one call after the other thread's
    call returned."""

    op: str
    args: tuple
    spin: str | None = None


class Stall:
    """A trace function that sleeps ``STALL_S`` at every line event of the code of ``cls`` and its bases (the
    driver's own Python code): Note [Stalls inside the driver]."""

    def __init__(self, cls: type, start_at: int) -> None:
        self.files = {inspect.getsourcefile(k) for k in cls.__mro__ if k.__module__ != "builtins"} - {None}
        self.files = {f for f in self.files if not f.startswith(os.path.dirname(threading.__file__))}
        self.lines, self.start_at, self.go = 0, start_at, threading.Event()

    def __call__(self, frame, event, arg):
        return self._line if frame.f_code.co_filename in self.files else None

    def _line(self, frame, event, arg):
        if event == "line":
            self.lines += 1
            if self.lines == self.start_at:  # the other thread's call starts here
                self.go.set()
            time.sleep(STALL_S)
        return self._line


class PairChecks(ProtocolChecks):
    """The calls of a pair from two threads, judged by the model's serial orders (see the module docstring)."""

    kept: set[int]
    """Handles held across the tries of a pair (the one that fills the budget), released by the teardown."""

    def __init__(self, setup) -> None:
        super().__init__(setup)
        self.kept = set()

    @rule()
    def nothing(self) -> None:
        """No step of its own: the machine is driven by the rule of this module, not by Hypothesis."""

    def native(self, call: Call) -> tuple:
        if call.op == "map":
            va, size, key, offset = call.args
            return (va, size, self.objects[key], offset)
        if call.op == "release":
            return (self.objects[call.args[0]],)
        return call.args

    def attempt(self, call: Call, events: list[Event]) -> bool:
        """Make ``call`` on the raw driver and record it as an event; whether it was taken."""
        try:
            got, raised = getattr(self.raw, call.op)(*self.native(call)), None
        except Exception as exc:  # an outcome, judged by the serial orders
            got, raised = None, exc
        key = call.args[0] if call.op == "release" else None
        if raised is None:
            if call.op == "create":
                key = next(self.keys)
                got = self.register(key)(got)
            self.record_made(call.op, self.native(call) if call.op != "create" else call.args, got, key)
        events.append(Event(call.op, call.args, raised, got))
        return raised is None

    def race(self, calls: tuple[Call, Call], what: str, stalled: int, start_at: int) -> tuple[list[list[Event]], int]:
        """Both calls from two threads, thread ``stalled`` pausing at every line of the driver's own code and the other
        starting at its ``start_at``-th line event (Note [Stalls inside the driver]); the events of each thread, and
        how many line events the stalled one ran."""
        barrier, done = threading.Barrier(2), [threading.Event(), threading.Event()]
        histories: list[list[Event]] = [[], []]
        errors: list[BaseException] = []
        stall = Stall(type(self.raw), start_at)

        def run(t: int) -> None:
            call, other = calls[t], done[1 - t]
            trace = sys.gettrace()
            try:
                barrier.wait(JOIN_S)
                if t == stalled:
                    sys.settrace(stall)
                else:
                    stall.go.wait(JOIN_S)
                for _ in range(SPIN_LIMIT):
                    finished = other.is_set()
                    taken = self.attempt(call, histories[t])
                    if call.spin is None or finished or taken == (call.spin == "taken"):
                        break
            except BaseException as exc:  # reported below, with the calls made
                errors.append(exc)
                barrier.abort()
            finally:
                sys.settrace(trace)
                done[t].set()
                stall.go.set()

        threads = [threading.Thread(target=run, args=(t,), name=f"contended-{t}") for t in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_S)
        hung = [t.name for t in threads if t.is_alive()]
        if not hung:
            wait_until_gone(threads)
        expect(not hung and not errors, self.driver, what, "both threads done", f"{hung} running, errors {errors}")
        return histories, stall.lines

    def judge(self, histories: list[list[Event]], what: str, shared: list[tuple[int, int]]) -> None:
        """The outcome of some serial order of both threads' calls (the model moves to it), then the kernel's view of
        every shared granule, and mem_info, as the model says."""
        after, why = linearize(self.model, [_collapsed(h) for h in histories])
        calls = [[(e.op, shown(e.args), type(e.raised).__name__ if e.raised else "ok") for e in h] for h in histories]
        expect(after is not None, self.driver, f"{what}: calls {_compact(calls)}", "some serial order of them", why)
        self.model = after
        if self.setup.host:
            kernel = KernelView()
            for lo, hi in shared:
                for va in range(lo, hi, self.g):
                    want = self.model.granule(va)
                    kind, inode, offset = kernel.granule(va)
                    expect_equal(
                        self.driver,
                        f"{what}: calls {_compact(calls)}: /proc/self/maps at granule {va:#x}: (state, offset)",
                        (want.kind, want.offset),
                        (kind, offset),
                    )
        self.call(self.model.mem_info())

    def clear(self, shared: list[tuple[int, int]]) -> None:
        """Unmap, release and free everything the model holds, then on the host: the kernel holds nothing at the
        shared ranges (a kernel call that came late leaves something there)."""
        for m in sorted(self.model.mappings.values(), key=lambda m: m.va):
            self.do_unmap(m.va, m.size)
        for key in sorted(self.model.unreleased() - self.kept):
            self.do_release(key)
        for r in sorted(self.model.reservations.values(), key=lambda r: r.va):
            self.do_free(r.va, r.size)
        if self.setup.host:
            kernel = KernelView()
            heaps = kernel.thread_heaps()
            left = [(lo, kernel.granule(lo)[0]) for lo, hi in shared for lo in range(lo, hi, self.g)]
            left = [(va, kind) for va, kind in left if kind != "nothing" and not any(a <= va < b for a, b in heaps)]
            expect_equal(self.driver, "what the kernel maps at the pair's ranges once all is given back", [], left)


def _collapsed(history: list[Event]) -> list[Event]:
    """``history`` with each run of the same call refused the same way, or of the same ``set_access`` taken, kept
    once: a refusal changes nothing and a second grant of the same access nothing more, so the run fits wherever its
    first call fits (a repeating thread makes thousands while the other is stalled)."""
    out: list[Event] = []
    for e in history:
        last = out[-1] if out else None
        same = last is not None and (last.op, last.args) == (e.op, e.args)
        if same and e.raised is not None and last.raised is not None and repr(last.raised) == repr(e.raised):
            continue
        if same and e.op == "set_access" and e.raised is None and last.raised is None:
            continue
        out.append(e)
    return out


def _compact(calls: list[list[tuple]]) -> list:
    """Each thread's calls, a run of the same call and outcome shown once with its count."""
    out = []
    for history in calls:
        runs: list[list] = []
        for c in history:
            if runs and runs[-1][0] == c:
                runs[-1][1] += 1
            else:
                runs.append([c, 1])
        out.append([c if n == 1 else (*c, f"x{n}") for c, n in runs])
    return out


def _pair(m: PairChecks, name: str) -> tuple[tuple[Call, Call], list[tuple[int, int]]] | None:
    """The shared resources of pair ``name``, made through the model, its two calls and the ranges they touch."""
    g = m.g
    if name == "reserve beside reserve":
        return (Call("reserve", (4 * g, g)), Call("reserve", (4 * g, g), "taken")), []
    if name == "create with room for one":
        if not m.setup.host:
            return None
        if m.model.expected_free() > g:  # held across the tries: the budget full but for a granule
            m.kept.add(m.do_create(m.model.expected_free() - g))
        return (Call("create", (g,)), Call("create", (g,))), []
    va = m.do_reserve(2 * g, g)
    a, b = m.do_create(g), m.do_create(g)
    if None in (va, a, b):
        return None
    x = (va, g)
    mapped = m.do_map(va, g, a) and m.do_set_access(va, g)
    if name == "map while unmapping":
        return (Call("unmap", x), Call("map", (*x, b, 0), "taken")), [(va, va + g)]
    if name == "unmap twice":
        return (Call("unmap", x), Call("unmap", x)), [(va, va + g)]
    if name == "access while unmapping":
        return (Call("unmap", x), Call("set_access", x, "refused")), [(va, va + g)]
    if name == "free while unmapping":
        return (Call("unmap", x), Call("free", (va, 2 * g), "taken")), [(va, va + 2 * g)]
    if name == "release while unmapping":  # its only mapping: the bytes come back once, whichever is first
        return (Call("unmap", x), Call("release", (a,))), [(va, va + g)]
    if name == "release twice":  # mapped: the second release is refused (P-release-once)
        return (Call("release", (a,)), Call("release", (a,))), [(va, va + g)]
    if name == "map beside a map":  # the next granule: one may not take the other's
        return (Call("map", (va + g, g, b, 0)), Call("map", (va, 2 * g, b, 0))), [(va, va + 2 * g)]
    if mapped:  # the pairs below start from nothing mapped
        m.do_unmap(va, g)
    if name == "unmap while mapping":
        return (Call("map", (*x, a, 0)), Call("unmap", x, "taken")), [(va, va + g)]
    if name == "access while mapping":
        return (Call("map", (*x, a, 0)), Call("set_access", x, "taken")), [(va, va + g)]
    if name == "map twice":
        return (Call("map", (*x, a, 0)), Call("map", (*x, b, 0))), [(va, va + g)]
    if name == "free while mapping":
        return (Call("free", (va, 2 * g)), Call("map", (*x, a, 0))), [(va, va + 2 * g)]
    if name == "free twice":
        return (Call("free", (va, 2 * g)), Call("free", (va, 2 * g))), [(va, va + 2 * g)]
    if name == "release while mapping":  # mapped at the next granule too: released, it is still alive
        m.do_map(va + g, g, a)
        return (Call("map", (*x, a, 0)), Call("release", (a,))), [(va, va + 2 * g)]
    raise ValueError(f"no pair named {name!r}")


PAIRS = (
    "map while unmapping",
    "unmap while mapping",
    "access while unmapping",
    "free twice",
    "release twice",
    "create with room for one",
    "reserve beside reserve",
    "access while mapping",
    "free while unmapping",
    "free while mapping",
    "release while unmapping",
    "release while mapping",
    "map twice",
    "map beside a map",
    "unmap twice",
)
"""Every pair of calls that can touch one range or one handle; where the records let one through only after the other,
that one repeats (Note [A waiting call lands in the gap]). The first seven come first: between them a driver that
lets go of its lock in any effectful method fails early."""


def run_pair(driver, pair: str) -> int:
    """Pair ``pair`` on ``driver`` (the fixture's Ledger), from both sides and every start line (Note [Stalls inside
    the driver]); how many tries it made. Raises ``AssertionError`` naming the driver, the try and what differed."""
    m = PairChecks(learn_setup(driver))
    tries = 0
    try:
        for stalled in (0, 1):
            start_at, lines = 1, 1
            while start_at <= min(lines, MAX_LINES):
                made = _pair(m, pair)
                if made is None:
                    pytest.skip(f"{pair}: its resources could not be made on {m.driver.name}")
                calls, shared = made
                what = f"{pair}, thread {stalled} stalled, thread {1 - stalled} from its line event {start_at}"
                histories, seen = m.race(calls, what, stalled, start_at)
                shared += [
                    (e.result, e.result + e.args[0]) for h in histories for e in h if e.op == "reserve" and not e.raised
                ]
                m.judge(histories, what, shared)
                m.clear(shared)
                lines, start_at, tries = max(lines, seen), start_at + 1, tries + 1
        m.every_observable_matches_the_model()
    finally:
        m.teardown()
    return tries
