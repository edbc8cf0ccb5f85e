"""Interrupts landing on any line, on the host driver: a trace hook raises KeyboardInterrupt at the n-th line event
of the package's frames (every frame whose code is in ``extensible_kv``, the driver's and the reaper's included),
for every n a step reaches, and each test checks what is left: no lock held (no hang), the records and the kernel
agree, the object open at its old size or in its failure state, and a final ``close()`` returns every handle,
reservation, mapping, fd and budget byte, without closing an fd the test opened itself.

Note [A trace hook stands for a signal handler]
    A signal handler that raises (Ctrl-C, a timeout library's SIGALRM) lands where the interpreter checks for
    pending calls; a trace hook that raises lands before any line. Line events are the finer grid for everything
    but the instants right after a call returns (Notes [Every call is whole, even when interrupted] and [A result
    is stored by C] in ``drivers/host.py``; a real SIGALRM at random moments drives those in
    ``test_hostile_host.py``), and unlike a timer they are reproducible: interrupting at every n of a step reaches
    every line the step runs. The hook raises once; CPython removes a trace function that raised, so what the
    interrupt sets off (rollback, a finalizer's sweep) runs untraced.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import extensible_kv
from conformance.helpers import shared_pattern
from conformance.line_trap import Interrupt, LineTrap
from extensible_kv.drivers import host
from extensible_kv.drivers.host import PAGE_BYTES, HostDriver
from extensible_kv.errors import DriverError, FailedStateError
from extensible_kv.kv_cache import ExtensibleKVCacheBuffers, KVBuffer
from extensible_kv.tensor import ExtensibleTensor

PACKAGE = str(Path(extensible_kv.__file__).resolve().parent) + os.sep
HANG_S = 120
DRIVERS = {"host": 2 << 20, "host-4k": PAGE_BYTES}
BUDGET_GRANULES = 32


class Kernel:
    """One reading of ``/proc/self/maps`` (the cases read it once or twice per interrupt, thousands of times)."""

    def __init__(self) -> None:
        self.rows = []
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                self.rows.append((lo, hi, fields[1], int(fields[4]), fields[5].strip() if len(fields) == 6 else ""))

    def granules(self, base: int, nbytes: int, granularity: int) -> list[str]:
        """What the kernel maps at each granule: ``accessible`` (a memfd of the host driver, shared read-write),
        ``mapped`` (one without access), ``reserved`` (anonymous, no access), ``nothing``, or what else it is."""
        states = []
        for va in range(base, base + nbytes, granularity):
            row = next((r for r in self.rows if r[0] <= va < r[1]), None)
            if row is None:
                states.append("nothing")
            elif host.MEMFD_NAME in row[4] and row[2] in ("rw-s", "---s"):
                states.append("accessible" if row[2] == "rw-s" else "mapped")
            elif row[2] == "---p" and row[3] == 0 and not row[4]:
                states.append("reserved")
            else:
                states.append(f"{row[2]} {row[4] or 'anonymous'}")
        return states

    def reserved_in(self, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The parts of ``spans`` the kernel holds as reservations (anonymous, no access)."""
        return [
            (max(lo, s_lo), min(hi, s_hi))
            for lo, hi, perms, inode, name in self.rows
            if perms == "---p" and inode == 0 and not name
            for s_lo, s_hi in spans
            if lo < s_hi and s_lo < hi
        ]

    def memfds(self) -> set[int]:
        """Inodes of the host driver's memfds this process holds open (``/proc/self/fd``) or mapped."""
        found = {inode for *_, inode, name in self.rows if host.MEMFD_NAME in name}
        for fd in os.listdir("/proc/self/fd"):
            try:
                if host.MEMFD_NAME in os.readlink(f"/proc/self/fd/{fd}"):
                    found.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
            except OSError:  # the listing's own fd, closed meanwhile
                pass
        return found


def trapped(step: Callable[[], object], n: int) -> tuple[LineTrap, BaseException | None, list[str]]:
    """Run ``step`` with a ``LineTrap(n)`` installed; return the trap, the ``Interrupt`` that came out of the step
    (``None`` if the step returned) and the exceptions the interpreter swallowed meanwhile (an interrupt inside a
    finalizer is one). Callers pause the garbage collector, so collections land only where the step makes them."""
    swallowed: list[str] = []
    hook, trace = sys.unraisablehook, sys.gettrace()
    sys.unraisablehook = lambda u: swallowed.append(f"{u.exc_type.__name__}: {u.exc_value}")
    trap = LineTrap(lambda name: name.startswith(PACKAGE), n)
    raised = None
    sys.settrace(trap)
    try:
        step()
    except Interrupt as exc:
        raised = exc
    finally:
        sys.settrace(trace)
        sys.unraisablehook = hook
    return trap, raised, swallowed


class paused_collector:
    """Automatic garbage collection off inside the block (a plain class: nothing here may be a generator)."""

    def __enter__(self) -> None:
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        gc.enable()


class ReservedSpans:
    """Stands in for the host driver's libc and records every range its ``reserve`` asks the kernel for
    (``mmap(NULL, ..., fd=-1)``), so a reservation the driver and the tensor both lost is still found."""

    def __init__(self, lib: object) -> None:
        self._lib = lib
        self.spans: list[tuple[int, int]] = []

    def mmap(self, addr, size, prot, flags, fd, offset):
        got = self._lib.mmap(addr, size, prot, flags, fd, offset)
        if addr is None and fd == -1 and got not in (None, host.MAP_FAILED):
            self.spans.append((got, got + size))
        return got

    def __getattr__(self, name: str) -> object:
        return getattr(self._lib, name)

    def still_reserved(self, kernel: Kernel) -> list[tuple[int, int]]:
        """The parts of the recorded ranges the kernel still holds as reservations; then forget the ranges."""
        held = kernel.reserved_in(self.spans)
        self.spans.clear()
        return held


@pytest.fixture(autouse=True)
def spans(monkeypatch) -> ReservedSpans:
    recorder = ReservedSpans(host._lib())
    monkeypatch.setattr(host, "_libc", recorder)
    return recorder


@dataclass
class Baseline:
    """What the process held before a case, and the fds the test opened itself (each on ``/dev/null``)."""

    memfds: set[int]
    spans: ReservedSpans
    own_fds: list[int] = field(default_factory=list)

    @staticmethod
    def take(spans: ReservedSpans) -> Baseline:
        gc.collect()
        own = [os.open(os.devnull, os.O_RDONLY) for _ in range(3)]
        return Baseline(Kernel().memfds(), spans, own)

    def open_one(self) -> None:
        """Open one more ``/dev/null``: it takes the lowest free number, the one an fd closed last had."""
        self.own_fds.append(os.open(os.devnull, os.O_RDONLY))

    def closed_of_ours(self) -> list[int]:
        null = os.stat(os.devnull)
        gone = []
        for fd in self.own_fds:
            try:
                st = os.fstat(fd)
                if (st.st_ino, st.st_rdev) != (null.st_ino, null.st_rdev):
                    gone.append(fd)
            except OSError:
                gone.append(fd)
        return gone

    def close(self) -> None:
        for fd in self.own_fds:
            try:
                os.close(fd)
            except OSError:
                pass


def host_driver(name: str) -> HostDriver:
    return HostDriver(granularity=DRIVERS[name], name=name, budget_bytes=BUDGET_GRANULES * DRIVERS[name])


def expect_returned(d: HostDriver, where: str, before: Baseline, bases: list[tuple[int, int]]) -> None:
    """Everything is back: the driver's records, its budget, the kernel's memfds and reservations (the ranges
    ``bases``, ``(base, size)``, map nothing) and the fds the test opened are still open on ``/dev/null``."""
    kernel = Kernel()
    got = {
        "reservations": dict(d._reservations),
        "mappings": len(d._mappings),
        "free budget": d.mem_info()[0],
        "memfds": sorted(kernel.memfds() - before.memfds),
        "reservations the kernel holds": before.spans.still_reserved(kernel),
        "kernel at the bases": [s for b, n in bases for s in set(kernel.granules(b, n, d.granularity()))],
        "test fds closed": before.closed_of_ours(),
        "driver lock held": d._lock.locked(),
    }
    want = {
        "reservations": {},
        "mappings": 0,
        "free budget": d.mem_info()[1],
        "memfds": [],
        "reservations the kernel holds": [],
        "kernel at the bases": ["nothing"] * len(bases),
        "test fds closed": [],
        "driver lock held": False,
    }
    assert got == want, f"{d.name}: {where}: expected everything returned {want}, got {got}"


def expect_lock_free(d: HostDriver, where: str, *owners: object) -> None:
    """The locks of the driver and of ``owners`` (tensors, KV buffers and their tensors) are not held: a later call
    would wait on a held one forever."""
    locks = {"driver": d._lock}
    for owner in owners:
        locks[type(owner).__name__] = owner._lock
        for name, t in getattr(owner, "_tensors", {}).items():
            locks[f"buffer {name}"] = t._lock
    held = []
    for name, lock in locks.items():
        if lock.acquire(blocking=False):
            lock.release()
        else:
            held.append(name)
    assert not held, f"{d.name}: {where}: expected every lock free, got held: {held} (the next call would hang)"


def close_retrying(obj: object) -> None:
    """``close()``, once more if the first left the object in its failure state."""
    try:
        obj.close()
    except DriverError:
        obj.close()


@pytest.fixture(autouse=True)
def hang_guard():
    """A hang prints every thread's stack and ends the run; what exists before the test is frozen out of the
    collector's reach, so the collections each case makes scan only what it made (a full one takes a fifth of a
    second with torch loaded)."""
    gc.collect()
    gc.freeze()
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
    gc.unfreeze()


# -- What was found, item 1: an interrupt between two statements ---------------------------------------------------
DRIVER_CALLS = ("reserve", "create", "map", "set_access", "unmap", "release", "free", "mem_info")


def _driver_call(d: HostDriver, op: str, made: dict) -> Callable[[], object]:
    """A call of ``op`` on ``d`` whose arguments ``made`` holds: a reservation, a handle, mapped or not."""
    g = d.granularity()
    calls = {
        "reserve": lambda: made.setdefault("reserved", []).append(d.reserve(g, g)),
        "create": lambda: made.setdefault("created", []).append(d.create(g)),
        "map": lambda: d.map(made["va"], g, made["handle"], 0),
        "set_access": lambda: d.set_access(made["va"], g),
        "unmap": lambda: d.unmap(made["va"], g),
        "release": lambda: d.release(made["handle"]),
        "free": lambda: d.free(made["va"], g),
        "mem_info": d.mem_info,
    }
    return calls[op]


def _prepare(d: HostDriver, op: str) -> dict:
    g = d.granularity()
    made: dict = {"va": d.reserve(g, g)}
    if op in ("map", "set_access", "unmap", "release"):
        made["handle"] = d.create(g)
    if op in ("set_access", "unmap"):
        d.map(made["va"], g, made["handle"], 0)
    return made


def _tidy(d: HostDriver, made: dict) -> None:
    """Return what a driver case made, as a caller that trusts the driver's answers would: what the driver says is
    mapped, unreleased or reserved."""
    for va, (size, _) in list(d._mappings.items()):
        d.unmap(va, size)
    for handle in [made.get("handle"), *made.get("created", [])]:
        if handle is not None and not handle.released:
            d.release(handle)
    for va in [made["va"], *made.get("reserved", [])]:
        if va in d._reservations:
            d.free(va, d.granularity())


def _sweep_driver_call(
    spans: ReservedSpans, name: str, op: str, check: Callable[[HostDriver, dict, Baseline, str], None]
) -> int:
    """Interrupt ``op`` at every line it reaches; after each, ``check``, then tidy and expect everything returned.
    Returns how many line events the call has."""
    d = host_driver(name)
    before = Baseline.take(spans)
    try:
        made = _prepare(d, op)
        total = trapped(_driver_call(d, op, made), 0)[0].lines
        _tidy(d, made)
        assert total > 0, f"{name}: {op}: expected the call to run lines of the package, counted {total}"
        for n in range(1, total + 1):
            made = _prepare(d, op)
            with paused_collector():
                trap, raised, _ = trapped(_driver_call(d, op, made), n)
            where = f"{op} interrupted at line event {n} of {total} ({trap.fired})"
            assert raised is not None, f"{name}: {where}: expected the Interrupt to come out of the call, got none"
            expect_lock_free(d, where)
            check(d, made, before, where)
            _tidy(d, made)
            expect_returned(d, f"{where}, then tidied", before, [(made["va"], d.granularity())])
        return total
    finally:
        before.close()


@pytest.mark.parametrize("name", DRIVERS)
@pytest.mark.parametrize("op", DRIVER_CALLS)
def test_no_driver_call_leaves_its_lock_held_when_interrupted_on_any_line(name, op, spans):
    _sweep_driver_call(spans, name, op, lambda d, made, before, where: None)


def _records_match_the_kernel(d: HostDriver, made: dict, before: Baseline, where: str) -> None:
    g = d.granularity()
    kernel = Kernel().granules(made["va"], g, g)[0]
    recorded = "mapped" if made["va"] in d._mappings else "reserved" if made["va"] in d._reservations else "nothing"
    kernel = "mapped" if kernel in ("mapped", "accessible") else kernel
    handle = made.get("handle")
    maps = handle.maps if handle is not None else 0
    assert (recorded, maps) == (kernel, int(recorded == "mapped")), (
        f"{d.name}: {where}: expected the driver's records (state, the handle's map count) to say what the kernel "
        f"maps ({kernel!r}, {int(kernel == 'mapped')}), got ({recorded!r}, {maps})"
    )


@pytest.mark.parametrize("name", DRIVERS)
@pytest.mark.parametrize("op", ["map", "unmap", "reserve", "free"])
def test_an_interrupted_driver_call_leaves_records_that_say_what_the_kernel_maps(name, op, spans):
    _sweep_driver_call(spans, name, op, _records_match_the_kernel)


def _release_again_spares_a_reused_fd(d: HostDriver, made: dict, before: Baseline, where: str) -> None:
    handle = made["handle"]
    expected = "refused" if handle.released else "released"
    before.open_one()  # the lowest free number: the memfd's, if the interrupted release closed it
    try:
        d.release(handle)
        outcome = "released"
    except DriverError:
        outcome = "refused"
    assert (outcome, before.closed_of_ours()) == (expected, []), (
        f"{d.name}: {where}, then release() again after the test opened {os.devnull}: expected ({expected!r}, no fd "
        f"of the test closed), got ({outcome!r}, closed {before.closed_of_ours()})"
    )


@pytest.mark.parametrize("name", DRIVERS)
def test_an_interrupted_release_never_closes_an_fd_twice(name, spans):
    _sweep_driver_call(spans, name, "release", _release_again_spares_a_reused_fd)


def _budget_is_whole(d: HostDriver, made: dict, before: Baseline, where: str) -> None:
    got = d.mem_info()
    assert got == (d.mem_info()[1], d.mem_info()[1]), (
        f"{d.name}: {where}: expected the interrupted create to hold none of the budget, mem_info {got}"
    )


@pytest.mark.parametrize("name", DRIVERS)
def test_an_interrupted_create_holds_none_of_the_budget(name, spans):
    _sweep_driver_call(spans, name, "create", _budget_is_whole)


def test_a_collected_tensor_returns_its_memory_at_once_after_interrupted_driver_calls(spans):
    # The section the driver's calls run in (reaper.busy) is left as it was: a tensor collected afterwards, outside
    # any call, returns its memory during the collection.
    d = host_driver("host-4k")
    before = Baseline.take(spans)
    try:
        for op in ("create", "map", "unmap", "release"):
            made = _prepare(d, op)
            with paused_collector():
                trapped(_driver_call(d, op, made), 2)
            expect_lock_free(d, f"{op} interrupted at line event 2")
            _tidy(d, made)
        t = ExtensibleTensor(2 * PAGE_BYTES, driver=d)
        t.resize_per_segment_(PAGE_BYTES)
        base = t.base_address
        del t
        gc.collect()
        got = (dict(d._reservations), Kernel().granules(base, 2 * PAGE_BYTES, PAGE_BYTES))
        assert got == ({}, ["nothing", "nothing"]), (
            f"host-4k: a tensor collected after interrupted driver calls: expected its reservation returned during "
            f"the collection, got (driver reservations, kernel) {got}"
        )
    finally:
        before.close()


# -- the tensor and the KV buffers: growth, close, construction, collection ----------------------------------------
@dataclass
class Case:
    """One step to interrupt: ``make`` builds what it acts on, ``step`` is the step, ``after`` checks the object
    right after the interrupt (and returns the ranges the final check looks at), ``finish`` closes what is left
    (retrying ``close()`` once from the failure state)."""

    name: str
    make: Callable[[HostDriver], dict]
    step: Callable[[dict, HostDriver], object]
    after: Callable[[HostDriver, dict, BaseException | None, str], list[tuple[int, int]]]
    finish: Callable[[dict, HostDriver], None]


def _grown_tensor(d: HostDriver) -> dict:
    """Two segments of two granules, half a granule committed in each, some bytes written; the step grows each
    segment by one granule (two runs of new granules)."""
    g = d.granularity()
    t = ExtensibleTensor(4 * g, 2, driver=d, alignment=256)
    t.resize_per_segment_(g // 2)
    data = [shared_pattern(1024, i, t.device) for i in range(2)]
    for i, chunk in enumerate(data):
        t.segment_view(i)[: chunk.numel()].copy_(chunk)
    return {"t": t, "old": g // 2, "new": g + g // 2, "data": data, "base": t.base_address}


def _expect_open_or_failed(d: HostDriver, ctx: dict, raised: BaseException | None, where: str) -> list:
    """After an interrupted growth: open at the old size (new if the step returned), its data and the kernel's
    granules as that size says, no handle held; or failed, refusing views."""
    t, g = ctx["t"], d.granularity()
    size = ctx["new"] if raised is None else ctx["old"]
    if t.state == "failed":
        with pytest.raises(FailedStateError, match="retry close"):
            t.segment_view(0)
        return [(ctx["base"], t.max_num_bytes)]
    backed = -(-size // g) * g
    got = (
        t.state,
        t.bytes_per_segment,
        d.mem_info()[0] + 2 * backed - d.mem_info()[1],
        Kernel().granules(ctx["base"], 4 * g, g),
    )
    half = ["accessible"] * (backed // g) + ["reserved"] * (2 - backed // g)
    want = ("open", size, 0, half + half)
    assert got == want, (
        f"{d.name}: {where}: expected (state, bytes_per_segment, budget held beyond the mapped "
        f"bytes, kernel granules) {want}, got {got}"
    )
    for i, chunk in enumerate(ctx["data"]):
        assert torch.equal(t.segment_view(i)[: chunk.numel()], chunk), (
            f"{d.name}: {where}: segment {i} lost the bytes written before the step"
        )
    return [(ctx["base"], t.max_num_bytes)]


def _expect_closed_or_not(d: HostDriver, ctx: dict, raised: BaseException | None, where: str) -> list:
    t = ctx["t"]
    allowed = {"closed"} if raised is None else {"open", "failed"}
    assert t.state in allowed, f"{d.name}: {where}: expected the tensor's state in {sorted(allowed)}, got {t.state}"
    if t.state == "failed":
        with pytest.raises(FailedStateError, match="retry close"):
            t.segment_view(0)
        assert t.stats().committed_bytes == 0, f"{d.name}: {where}: a failed tensor counts bytes as committed"
    return [(ctx["base"], t.max_num_bytes)]


def _build(ctx: dict, d: HostDriver) -> None:
    ctx["t"] = ExtensibleTensor(4 * d.granularity(), 2, driver=d)


def _close_built(ctx: dict, d: HostDriver) -> None:
    if "t" in ctx:
        ctx["t"].close()
    _probe_sweep(ctx, d)


def _expect_built_or_not(d: HostDriver, ctx: dict, raised: BaseException | None, where: str) -> list:
    assert ("t" in ctx) == (raised is None), (
        f"{d.name}: {where}: expected a tensor exactly when the constructor returned, got {ctx.get('t')!r}"
    )
    return [(ctx["t"].base_address, ctx["t"].max_num_bytes)] if "t" in ctx else []


def _dead_in_a_cycle(d: HostDriver) -> dict:
    g = d.granularity()
    t = ExtensibleTensor(4 * g, 2, driver=d)
    t.resize_per_segment_(g)
    base = t.base_address
    t.cycle = t  # only the collector frees it
    del t
    return {"base": base}


def _expect_collected(d: HostDriver, ctx: dict, raised: BaseException | None, where: str) -> list:
    return [(ctx["base"], 4 * d.granularity())]


def _probe_sweep(ctx: dict, d: HostDriver) -> None:
    """The next operation of any tensor: it sweeps what an interrupted finalizer left (construction and close do)."""
    ExtensibleTensor(d.granularity(), driver=d).close()


def _kv(d: HostDriver) -> dict:
    """Two buffers, ``kv`` (two segments, one granule per block) and ``state`` (one segment, half a granule per
    block), one block committed; the step grows each segment of each buffer by one granule."""
    g = d.granularity()
    cache = ExtensibleKVCacheBuffers(
        [KVBuffer("kv", g, num_segments=2), KVBuffer("state", g // 2, num_segments=1)], 4, driver=d
    )
    cache.ensure_blocks(1)
    bases = [(cache.tensor(b).base_address, cache.tensor(b).max_num_bytes) for b in ("kv", "state")]
    return {"cache": cache, "old": 1, "new": 3, "bases": bases}


def _expect_kv_open_or_failed(d: HostDriver, ctx: dict, raised: BaseException | None, where: str) -> list:
    """After an interrupted ``ensure_blocks``: open at the old block count (the new one if the step returned), every
    buffer at that size and the kernel's granules as it says; or failed, refusing growth."""
    cache, g = ctx["cache"], d.granularity()
    blocks = ctx["new"] if raised is None else ctx["old"]
    if cache.state == "failed":
        with pytest.raises(FailedStateError, match="retry close"):
            cache.ensure_blocks(ctx["new"])
        return ctx["bases"]
    per_segment = {"kv": blocks * g // 2, "state": blocks * g // 2}
    sizes = {b.name: cache.tensor(b.name).bytes_per_segment for b in cache.buffers}
    backed = -(-blocks // 2)
    want_granules = [
        (["accessible"] * backed + ["reserved"] * (2 - backed)) * 2,
        ["accessible"] * backed + ["reserved"] * (2 - backed),
    ]
    kernel = Kernel()
    got = (cache.state, cache.num_blocks, sizes, [kernel.granules(base, size, g) for base, size in ctx["bases"]])
    want = ("open", blocks, per_segment, want_granules)
    assert got == want, (
        f"{d.name}: {where}: expected (state, blocks, bytes per segment, kernel granules) {want}, got {got}"
    )
    return ctx["bases"]


def _expect_pinned_or_not(d: HostDriver, ctx: dict, raised: BaseException | None, where: str) -> list:
    """After an interrupted ``pin``: every buffer pinned by the holder and the registration recorded, or neither;
    never a buffer pinned that the buffers do not record (nothing could unpin it, and no release would pass)."""
    cache = ctx["cache"]
    got = (cache.state, cache.pinned_by, {b.name: cache.tensor(b.name).pinned_by for b in cache.buffers})
    whole = ("open", {"conn": ctx["old"]}, {"kv": ("conn",), "state": ("conn",)})
    none = ("open", {}, {"kv": (), "state": ()})
    allowed = (whole, none) if raised is not None else (whole,)
    assert got in allowed, f"{d.name}: {where}: expected (state, pinned_by, each buffer's pins) in {allowed}, got {got}"
    if got == whole:
        cache.unpin("conn")
    return ctx["bases"]


class _Inner:
    """vLLM's sleep backend, as the KV sleep backend sees it."""

    asleep = False

    def suspend(self, level: int) -> None:
        self.asleep = True

    def resume(self, tags: object = None) -> None:
        self.asleep = False


def _sleeper(d: HostDriver) -> dict:
    """``_kv``'s buffers held by a worker, and the KV sleep backend over a vLLM backend that is awake."""
    from extensible_kv.vllm.sleep import KVSleepBackend
    from extensible_kv.vllm.worker_kv import WorkerKV

    ctx = _kv(d)
    state = WorkerKV(driver=d)
    state.buffers = ctx["cache"]
    worker = type("Worker", (), {})()
    worker._extensible_kv_state = state
    ctx["inner"] = _Inner()
    ctx["sleep"] = KVSleepBackend(worker, ctx["inner"])
    return ctx


def _expect_asleep_or_awake(d: HostDriver, ctx: dict, raised: BaseException | None, where: str) -> list:
    """After an interrupted ``suspend``: the KV released and vLLM's backend asleep, or both awake; never the KV
    released under an engine that is awake (its next step would touch unmapped pages). A release interrupted
    between two buffers leaves the buffers failed (Note [A registration pins the committed blocks]'s
    ``release_physical``): refused, never released silently."""
    got = (ctx["cache"].state, ctx["inner"].asleep)
    allowed = {("released", True)} | ({("open", False), ("failed", False)} if raised is not None else set())
    assert got in allowed, f"{d.name}: {where}: expected (KV state, vLLM asleep) in {sorted(allowed)}, got {got}"
    return ctx["bases"]


STEPS = [
    Case(
        "resize_per_segment_",
        _grown_tensor,
        lambda ctx, d: ctx["t"].resize_per_segment_(ctx["new"]),
        _expect_open_or_failed,
        lambda ctx, d: close_retrying(ctx["t"]),
    ),
    Case(
        "close",
        _grown_tensor,
        lambda ctx, d: ctx["t"].close(),
        _expect_closed_or_not,
        lambda ctx, d: close_retrying(ctx["t"]),
    ),
    Case(
        "ensure_blocks",
        _kv,
        lambda ctx, d: ctx["cache"].ensure_blocks(ctx["new"]),
        _expect_kv_open_or_failed,
        lambda ctx, d: close_retrying(ctx["cache"]),
    ),
    Case(
        "KV buffers pin",
        _kv,
        lambda ctx, d: ctx["cache"].pin("conn"),
        _expect_pinned_or_not,
        lambda ctx, d: close_retrying(ctx["cache"]),
    ),
    Case(
        "KV sleep backend suspend",
        _sleeper,
        lambda ctx, d: ctx["sleep"].suspend(1),
        _expect_asleep_or_awake,
        lambda ctx, d: close_retrying(ctx["cache"]),
    ),
]
CONSTRUCTION = Case("ExtensibleTensor()", lambda d: {}, _build, _expect_built_or_not, _close_built)
COLLECTION = Case(
    "collection of a dead tensor", _dead_in_a_cycle, lambda ctx, d: gc.collect(), _expect_collected, _probe_sweep
)


def _sweep_case(spans: ReservedSpans, name: str, case: Case) -> None:
    """Interrupt ``case`` at every line event of its step, on driver ``name``: after each, the checks the case and
    ``expect_returned`` make."""
    d = host_driver(name)
    before = Baseline.take(spans)
    try:
        with paused_collector():
            ctx = case.make(d)
            total = trapped(lambda ctx=ctx: case.step(ctx, d), 0)[0].lines
        case.finish(ctx, d)
        assert total > 0, f"{name}: {case.name}: expected the step to run lines of the package, counted {total}"
        for n in range(1, total + 1):
            with paused_collector():
                ctx = case.make(d)
                trap, raised, swallowed = trapped(lambda ctx=ctx: case.step(ctx, d), n)
            where = f"{case.name} interrupted at line event {n} of {total} ({trap.fired})"
            assert trap.fired is not None and (raised is not None or swallowed), (
                f"{name}: {where}: expected the interrupt to fire and come out of the step or a finalizer, got "
                f"fired={trap.fired}, raised={raised!r}, swallowed={swallowed}"
            )
            expect_lock_free(d, where, *(ctx[k] for k in ("t", "cache") if k in ctx))
            bases = case.after(d, ctx, raised, where)
            del raised, trap  # the interrupt's traceback holds the frames of the step
            before.open_one()  # takes the number of an fd closed in the step, if one was
            gc.collect()
            case.finish(ctx, d)
            del ctx
            gc.collect()
            expect_returned(d, f"{where}, then close()", before, bases)
    finally:
        before.close()


@pytest.mark.parametrize("name", DRIVERS)
@pytest.mark.parametrize("case", STEPS, ids=[c.name for c in STEPS])
def test_a_step_interrupted_on_any_line_leaves_the_object_whole_and_close_returns_everything(name, case, spans):
    _sweep_case(spans, name, case)


@pytest.mark.parametrize("name", DRIVERS)
def test_a_constructor_interrupted_on_any_line_leaves_no_reservation_owned_by_nobody(name, spans):
    _sweep_case(spans, name, CONSTRUCTION)


@pytest.mark.parametrize("name", DRIVERS)
def test_a_finalizer_interrupted_on_any_line_loses_no_memory(name, spans):
    _sweep_case(spans, name, COLLECTION)
