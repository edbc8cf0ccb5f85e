"""The model-based rule of two threads: the same kinds of calls from two threads at once on one driver, each on its own
resources, with shared queries and contended calls on shared ones; every outcome, and the state after both, must be
that of some serial order of the calls (``protocol_model.linearize``), and every observable is compared with the model
after every step (``protocol_checks.py``)."""

from __future__ import annotations

import sys
import threading
import weakref

from hypothesis import strategies as st
from hypothesis.stateful import rule

from .helpers import expect, wait_until_gone
from .protocol_checks import ADDRESSED, Keeper, ProtocolChecks, Setup, pattern_at, shown
from .protocol_machine import MAX_RESERVATIONS, PICK
from .protocol_model import Event, linearize

THREAD_OPS = (
    "map",
    "map",
    "set_access",
    "write",
    "unmap",
    "mem_info",
    "accessible",
    "create",
    "release",
    "zero",
    "granularity",
    "synchronize",
)
CONTENDED = (
    "map_same",
    "unmap_same",
    "release_same",
    "free_same",
    "map_vs_free",
    "access_vs_unmap",
    "release_vs_unmap",
    "release_vs_map",
    "unmap_vs_free",
    "map_overlapping",
    "map_handle_twice",
    "unmap_handle_twice",
)
"""The calls both threads make at once on one shared resource: the same call twice, two different calls on one
reservation, mapping or handle (the pair decides what the other sees), and the same call on two mappings of one handle
(its count of mappings decides when its bytes come back)."""
OWN_CALLS = ("reserve", "free", "create", "release", "map", "unmap", "set_access", "write", "zero", "accessible")
"""Calls both threads make at once each on its own resources (``own_<call>`` in a contended list): nothing shared but
the driver's own tables, counters and locks."""
HANDLES = {"H": "HR", "R": "RR", "M": "MR"}  # a shared handle's name -> the reservation it is mapped at
BARRIER_S = 30


class _Worker:
    """One thread's calls: on its own reservation and handles (made by the thread), plus the contended calls both
    threads make at once on shared ones. Each call is recorded as an ``Event`` in the model's terms."""

    def __init__(
        self,
        machine: ProtocolChecks,
        tid: int,
        program: list,
        contended: list,
        shared: dict,
        barrier: threading.Barrier,
    ) -> None:
        self.m, self.tid, self.program, self.contended, self.shared = machine, tid, program, contended, shared
        self.barrier = barrier
        self.raw, self.g = machine.raw, machine.g
        self.events: list[Event] = []
        self.reservation: tuple[int, int] | None = None
        self.handles: list[int] = []
        self.mappings: dict[int, int] = {}  # va -> size
        self.accessed: set[int] = set()
        self.error: BaseException | None = None

    def do(self, op: str, args: tuple, native: tuple, result=None, key: int | None = None):
        try:
            got, raised = getattr(self.raw, op)(*native), None
        except Exception as exc:  # an outcome, judged by the linearization
            got, raised = None, exc
        if raised is None:
            self.m.record_made(op, native, got, key)
        self.events.append(Event(op, args, raised, result(got) if (result and raised is None) else got))
        return raised is None, got

    def create(self, size: int) -> None:
        key = next(self.m.keys)
        ok, _ = self.do("create", (size,), (size,), result=self.m.register(key))
        if ok:
            self.handles.append(key)

    def run(self) -> None:
        try:
            self.barrier.wait(BARRIER_S)
            ok, va = self.do("reserve", (3 * self.g, self.g), (3 * self.g, self.g))
            self.reservation = (va, 3 * self.g) if ok else None
            self.create(self.g)  # one granule each: every driver maps them whole (P-map-offset)
            self.create(self.g)
            per = -(-len(self.program) // (len(self.contended) + 1))
            for i, what in enumerate(self.contended):
                for op, pick in self.program[i * per : (i + 1) * per]:
                    self.step(op, pick)
                self.barrier.wait(BARRIER_S)
                self.contend(what)
            for op, pick in self.program[len(self.contended) * per :]:
                self.step(op, pick)
        except BaseException as exc:  # reported by the machine, with the thread's calls
            self.error = exc
            self.barrier.abort()

    def step(self, op: str, pick: int) -> None:
        g, raw = self.g, self.raw
        if op in ("mem_info", "granularity", "synchronize"):
            self.do(op, (), ())
        elif op == "accessible":
            if self.reservation:
                va = self.reservation[0] + pick % 3 * g + pick
                self.do("accessible", (va,), (va,))
        elif op == "create":
            self.create(g)
        elif op == "release" and self.handles:
            key = self.handles.pop(pick % len(self.handles))
            self.do("release", (key,), (self.m.objects[key],), key=key)
        elif op == "map" and self.handles and self.reservation:
            key = self.handles[pick % len(self.handles)]
            va = self.reservation[0] + pick % 3 * g
            if self.do("map", (va, g, key, 0), (va, g, self.m.objects[key], 0))[0]:
                self.mappings[va] = g
        elif op in ("set_access", "unmap") and self.mappings:
            va = sorted(self.mappings)[pick % len(self.mappings)]
            if op == "unmap":
                raw.synchronize()
                if self.do("unmap", (va, g), (va, g))[0]:
                    del self.mappings[va]
                    self.accessed.discard(va)
            elif self.do("set_access", (va, g), (va, g))[0]:
                self.accessed.add(va)
        elif op in ("write", "zero") and self.accessed:
            va = sorted(self.accessed)[pick % len(self.accessed)] + pick * 37 % (g - 64)
            if op == "zero":
                self.do("zero", (va, 64), (va, 64))
                return
            keeper = Keeper()
            alive = weakref.ref(keeper)
            t = raw.tensor(va, 64, keeper)
            del keeper
            self.events.append(
                Event(
                    "tensor",
                    (va, 64),
                    None,
                    {
                        "data_ptr": t.data_ptr(),
                        "numel": t.numel(),
                        "dtype": str(t.dtype),
                        "dim": t.dim(),
                        "device": str(t.device),
                        "keeper_alive": alive() is not None,
                    },
                )
            )
            t.copy_(pattern_at(0, 64, pick).to(t.device))
            raw.synchronize()
            self.events.append(Event("write", (va, 64, pick), None))

    def contend(self, what: str) -> None:
        s, g, objects = self.shared, self.g, self.m.objects
        if what.startswith("own_"):
            self.own(what.removeprefix("own_"))
        elif what == "map_same" and self.handles:
            key = self.handles[0]
            self.do("map", (s["S"], g, key, 0), (s["S"], g, objects[key], 0))
        elif what == "unmap_same":
            self.raw.synchronize()
            self.do("unmap", (s["U"], g), (s["U"], g))
        elif what == "release_same":
            self.do("release", (s["H"],), (objects[s["H"]],), key=s["H"])
        elif what == "free_same":
            self.do("free", (s["E"], g), (s["E"], g))
        elif what == "map_vs_free":
            if self.tid == 0 and self.handles:
                key = self.handles[-1]
                self.do("map", (s["F"], g, key, 0), (s["F"], g, objects[key], 0))
            elif self.tid == 1:
                self.do("free", (s["F"], g), (s["F"], g))
        elif what == "access_vs_unmap":
            if self.tid:
                self.raw.synchronize()
            self.do("set_access" if self.tid == 0 else "unmap", (s["A"], g), (s["A"], g))
        elif what == "release_vs_unmap":  # the handle's only mapping: its bytes come back once, whichever is first
            if self.tid == 0:
                self.do("release", (s["R"],), (objects[s["R"]],), key=s["R"])
            else:
                self.raw.synchronize()
                self.do("unmap", (s["RR"], g), (s["RR"], g))
        elif what == "release_vs_map":  # mapped again before the release, or refused after it
            if self.tid == 0:
                self.do("release", (s["M"],), (objects[s["M"]],), key=s["M"])
            else:
                self.do("map", (s["MT"], g, s["M"], 0), (s["MT"], g, objects[s["M"]], 0))
        elif what == "unmap_vs_free":
            if self.tid == 0:
                self.raw.synchronize()
                self.do("unmap", (s["UF"], g), (s["UF"], g))
            else:
                self.do("free", (s["UF"], 2 * g), (s["UF"], 2 * g))
        elif what == "map_handle_twice":  # one handle into two reservations: mapped twice, whatever the order
            va = s["MA"] if self.tid == 0 else s["MB"]
            self.do("map", (va, g, s["MH"], 0), (va, g, objects[s["MH"]], 0))
        elif what == "unmap_handle_twice":  # a released handle's two mappings: its bytes back once both are gone
            self.raw.synchronize()
            va = s["UA"] if self.tid == 0 else s["UB"]
            self.do("unmap", (va, g), (va, g))
        elif what == "map_overlapping":  # [O, O+2g) and [O+g, O+2g), sharing one granule: one of them is refused
            if self.tid == 0:
                self.do("map", (s["O"], 2 * g, s["OH"], 0), (s["O"], 2 * g, objects[s["OH"]], 0))
            elif self.handles:
                key = self.handles[0]
                self.do("map", (s["O"] + g, g, key, 0), (s["O"] + g, g, objects[key], 0))

    def own(self, op: str) -> None:
        """``op`` on this thread's own resources (``OWN_CALLS``): a new reservation, the free of its own (empty one),
        a new handle, the release of its second (mapped nowhere: its bytes come back), a map of its second handle at
        its second granule, and the calls of ``step`` on its mapping at the first."""
        g = self.g
        if op == "reserve":
            self.do("reserve", (g, g), (g, g))
        elif op == "free" and self.reservation:
            if self.do("free", self.reservation, self.reservation)[0]:
                self.reservation = None
        else:
            self.step(op, 1 if op in ("map", "release") else 0)


class TwoThreadMachine(ProtocolChecks):
    """Two threads call one driver at once (see the module docstring)."""

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        self.shared_left: list[int] = []

    def _shared(self, contended: list[str]) -> dict | None:
        """The shared resources the contended calls need, made here (in this thread) through the model."""
        g, shared = self.g, {}
        for what in contended:
            if what.startswith("own_"):  # nothing shared
                continue
            if what in ("release_vs_unmap", "release_vs_map"):  # a handle mapped once, at a reservation of its own
                name = "R" if what == "release_vs_unmap" else "M"
                key, va = self.do_create(g), self.do_reserve(g, g)
                if key is None or va is None or not self.do_map(va, g, key):
                    return None
                shared[name], shared[HANDLES[name]] = key, va
                if what == "release_vs_map":
                    shared["MT"] = self.do_reserve(g, g)
                    if shared["MT"] is None:
                        return None
                continue
            if what == "unmap_vs_free":  # a reservation of two granules, the first mapped (its handle released)
                va, key = self.do_reserve(2 * g, g), self.do_create(g)
                if va is None or key is None or not self.do_map(va, g, key):
                    return None
                self.do_release(key)
                shared["UF"] = va
                continue
            if what in ("map_handle_twice", "unmap_handle_twice"):  # one handle, a reservation for each thread
                key, a, b = self.do_create(g), self.do_reserve(g, g), self.do_reserve(g, g)
                if None in (key, a, b):
                    return None
                if what == "map_handle_twice":
                    shared["MH"], shared["MA"], shared["MB"] = key, a, b
                    continue
                if not (self.do_map(a, g, key) and self.do_map(b, g, key)):
                    return None
                self.do_release(key)
                shared["UA"], shared["UB"] = a, b
                continue
            if what == "map_overlapping":
                va, key = self.do_reserve(2 * g, g), self.do_create(2 * g)
                if va is None or key is None:
                    return None
                shared["O"], shared["OH"] = va, key
                continue
            if what in ("map_same", "unmap_same", "free_same", "map_vs_free", "access_vs_unmap"):
                va = self.do_reserve(g, g)
                if va is None:
                    return None
                name = {
                    "map_same": "S",
                    "unmap_same": "U",
                    "free_same": "E",
                    "map_vs_free": "F",
                    "access_vs_unmap": "A",
                }[what]
                shared[name] = va
                if what in ("unmap_same", "access_vs_unmap"):
                    key = self.do_create(g)
                    if key is None or not self.do_map(va, g, key):
                        return None
                    self.do_release(key)
            else:  # a handle mapped at a reservation of its own: released once, it is mapped still (P-release-once)
                key, va = self.do_create(g), self.do_reserve(g, g)
                if key is None or va is None or not self.do_map(va, g, key):
                    return None
                shared["H"], shared["HR"] = key, va
        return shared

    @rule(
        programs=st.tuples(*[st.lists(st.tuples(st.sampled_from(THREAD_OPS), PICK), min_size=2, max_size=10)] * 2),
        contended=st.lists(st.sampled_from(CONTENDED), min_size=1, max_size=2, unique=True),
    )
    def two_threads(self, programs, contended):
        """Two threads, lined up by a barrier, each reserve, create, map, grant access, write, zero, unmap and
        release on their own resources, query mem_info, accessible and granularity, and make the same contended call
        on a shared resource at once (both map one range, both unmap one mapping, both release one handle, both
        free one reservation, map into a reservation the other frees, grant access to a mapping the other
        unmaps, release a handle the other unmaps or maps, unmap in a reservation the other frees, map two ranges
        sharing a granule, map one handle into two reservations, unmap two mappings of one released handle); every
        outcome, and the state after both, is that of some serial order of the calls.
        Checks:
        P-threads, P-map-overlap, P-unmap-refused, P-release-once, P-free-refused, P-map-inside,
        P-reserve-disjoint, P-mem-exact."""
        for va in self.shared_left:  # the last threaded step's shared reservations, checked since: give them back
            r = self.model.reservations.get(va)
            if r is not None:
                for m in self.model.mappings_in(r):
                    self.do_unmap(m.va, m.size)
                self.do_free(r.va, r.size)
        if len(self.model.reservations) >= 2 * MAX_RESERVATIONS:  # not a precondition: the threads' outcome
            return  # varies from run to run, and what Hypothesis draws must not
        shared = self._shared(contended)
        self.shared_left = [va for name, va in (shared or {}).items() if name not in (*HANDLES, "OH", "MH")]
        if shared is None:
            return
        barrier = threading.Barrier(2)
        workers = [_Worker(self, t, list(programs[t]), contended, shared, barrier) for t in range(2)]
        threads = [threading.Thread(target=w.run, name=f"protocol-model-{t}") for t, w in enumerate(workers)]
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # switch threads often, so that the calls interleave
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(2 * BARRIER_S)
        finally:
            sys.setswitchinterval(interval)
        hung = [t.name for t in threads if t.is_alive()]
        if not hung:
            wait_until_gone(threads)
        expect(not hung, self.driver, "calls from two threads", "both threads done", f"{hung} still running")
        for w in workers:
            if w.error is not None:
                raise AssertionError(
                    f"driver {self.driver.name}: thread {w.tid} failed after calls {w.events}"
                ) from w.error
        self.refused += [
            (e.args[0], e.args[1]) if e.op in ADDRESSED else (0, 0)
            for w in workers
            for e in w.events
            if e.raised is not None
        ]
        try:
            self._linearize(workers)
        except AssertionError as exc:
            self.setup.failures.append(str(exc))
            raise
        if "OH" in shared:  # mapped at O or not: released now, given back with O's mappings
            self.do_release(shared["OH"])
        if "MH" in shared:  # released, then unmapped at one address: its bytes held while the other shows them
            self.do_release(shared["MH"])
            if shared["MA"] in self.model.mappings:
                self.do_unmap(shared["MA"], self.g)

    def _linearize(self, workers: list[_Worker]) -> None:
        after, why = linearize(self.model, [w.events for w in workers])
        histories = [
            [(e.op, shown(e.args), type(e.raised).__name__ if e.raised else "ok") for e in w.events] for w in workers
        ]
        expect(
            after is not None,
            self.driver,
            f"calls of two threads {histories}",
            "the outcome of some serial order of them",
            why,
        )
        self.model = after

    @rule(pick=PICK)
    def clear_and_free(self, pick):
        """Unmap every mapping of a reservation and free it, between threaded steps. Checks: P-unmap, P-free."""
        rs = sorted(self.model.reservations.values(), key=lambda r: r.va)
        if rs:
            r = rs[pick % len(rs)]
            for m in self.model.mappings_in(r):
                self.do_unmap(m.va, m.size)
            self.do_free(r.va, r.size)
