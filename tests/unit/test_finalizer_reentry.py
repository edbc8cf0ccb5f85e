"""Finalizers and signal handlers that run inside a driver's locked section and call the driver again (Note [A finalizer
never waits on a lock its thread may hold] in ``extensible_kv.reaper``, Note [A call never waits on its own thread] in
``drivers/host.py``): each is refused at once with ``DriverError`` naming the call, the outer call finishes whole, and
memory a refused ``close()`` left is returned by the next collection; the same for the cuda and hip drivers over their
fakes, and the KV buffers refuse with ``BusyError`` (Note [Operations never wait on themselves] in ``tensor``). Each
case runs in a child interpreter, so the deadlock these tests were written against fails after a deadline instead of
hanging the run."""

from __future__ import annotations

import gc

import pytest

from extensible_kv import reaper
from extensible_kv.reaper import Owned, busy, defer, own

from ._child import fake_driver, run_child

# Inside the host driver's locked ``do_reserve`` (its mmap, through a wrapped libc), run ``INSIDE[0]`` once.
HOOK = """
    import gc, json, os, signal
    from extensible_kv import ExtensibleTensor
    from extensible_kv.drivers import host
    from extensible_kv.drivers.host import HostDriver
    from extensible_kv.errors import DriverError, ExtensibleKVError

    REAL = host._lib()
    INSIDE = []

    class Lib:
        def __getattr__(self, name):
            return getattr(REAL, name)

        def mmap(self, *args):
            got = REAL.mmap(*args)
            while INSIDE:
                INSIDE.pop()()
            return got

    LIB = Lib()
    host._lib = lambda: LIB
    G = 4096
"""


def test_a_user_del_that_closes_a_tensor_collected_inside_reserve_neither_hangs_nor_loses_memory():
    # The case as found: a user object whose __del__ calls close(), garbage in a cycle, collected inside the host
    # driver's `do_reserve` while it holds the driver's lock. Before the rule the child hung in the nested unmap.
    out = run_child(
        HOOK
        + """
    driver = HostDriver(granularity=G, budget_bytes=1 << 20, name="unit-host")
    outcome = []

    class Holder:
        def __init__(self, t):
            self.t, self.me = t, self

        def __del__(self):
            try:
                self.t.close()
                outcome.append("closed")
            except BaseException as exc:
                outcome.append([type(exc).__name__, isinstance(exc, ExtensibleKVError)])

    gc.disable()
    t = ExtensibleTensor(2 * G, driver=driver)
    t.resize_per_segment_(G)
    Holder(t)
    del t
    INSIDE.append(gc.collect)
    u = ExtensibleTensor(2 * G, driver=driver)  # its reserve collects the holder under the driver's lock
    inside = [u.base_address is not None, driver.mem_info()[0]]
    gc.enable()
    gc.collect()  # the next collection outside a section returns what the refused close() left
    lock_free = driver._lock.acquire(blocking=False) and not driver._lock.release()
    u.close()
    print(json.dumps({"outcome": outcome, "inside": inside, "lock free": lock_free,
                      "after": [driver.mem_info()[0], len(driver._reservations), len(driver._mappings)]}))
    """,
        "a __del__ calling close() collected inside reserve",
    )
    got = {k: out[k] for k in ("inside", "lock free", "after")}
    want = {"inside": [True, (1 << 20) - 4096], "lock free": True, "after": [1 << 20, 0, 0]}
    assert got == want, f"unit-host driver, a __del__ that closes, collected inside reserve: expected {want}, got {got}"
    # The tensor's close() hands its memory to the reaper (closed), or is refused with a typed error (its own, or its
    # driver's DriverError): never a wait.
    outcome = out["outcome"]
    assert outcome == ["closed"] or (len(outcome) == 1 and outcome[0][1] is True), (
        f"unit-host driver, the __del__'s close() inside reserve: expected it closed or refused with a typed error "
        f"(ExtensibleKVError), got {outcome}"
    )


NESTED = (
    HOOK
    + """
    driver = HostDriver(granularity=G, budget_bytes=1 << 20, name="unit-host")
    va = driver.reserve(4 * G, G)
    h = driver.create(G)
    driver.map(va, G, h, 0)
    spare = driver.create(G)
    CALLS = {
        "reserve": lambda: driver.reserve(G, G),
        "free": lambda: driver.free(va, 4 * G),
        "create": lambda: driver.create(G),
        "release": lambda: driver.release(spare),
        "map": lambda: driver.map(va + G, G, spare, 0),
        "unmap": lambda: driver.unmap(va, G),
        "set_access": lambda: driver.set_access(va, G),
        "mem_info": driver.mem_info,
    }

    def state():
        return [driver.mem_info(), sorted(driver._reservations.items()), sorted(driver._mappings),
                [h.maps, h.released, spare.maps, spare.released], driver.accessible(va)]

    def attempt(op, seen):
        try:
            CALLS[op]()
            seen[op] = "taken"
        except DriverError as exc:
            seen[op] = [type(exc).__name__, exc.operation, exc.detail]
        except BaseException as exc:
            seen[op] = f"{type(exc).__name__}: {exc}"

    class Caller:  # a finalizer that calls the driver: collected inside the outer call
        def __init__(self, op, seen):
            self.op, self.seen, self.me = op, seen, self

        def __del__(self):
            attempt(self.op, self.seen)

    HOW = "HOW_HERE"
    seen = {}
    results = {}
    for op in CALLS:
        before = state()
        if HOW == "finalizer":
            gc.disable()
            Caller(op, seen)
            INSIDE.append(gc.collect)
        else:  # a signal handler, run where the interpreter next checks for pending calls inside the hook
            signal.signal(signal.SIGUSR1, lambda *_, op=op: attempt(op, seen))
            INSIDE.append(lambda: [signal.raise_signal(signal.SIGUSR1)] + [i for i in range(3)])
        outer = driver.reserve(G, G)  # the outer call: its do_reserve runs the nested one under the lock
        gc.enable()
        driver.free(outer, G)
        results[op] = [seen.get(op), state() == before]
    print(json.dumps(results))
    """
)


NAMED = {
    "reserve": "size=4096",
    "free": "size=16384",
    "create": "size=4096",
    "release": "release()",
    "map": "size=4096",
    "unmap": "size=4096",
    "set_access": "size=4096",
    "mem_info": "mem_info()",
}


def _expect_refused(how: str) -> None:
    out = run_child(NESTED.replace("HOW_HERE", how), f"driver calls from a {how} inside a locked section")
    for op, (seen, unchanged) in out.items():
        assert isinstance(seen, list) and seen[:2] == ["DriverError", op], (
            f"unit-host driver: {op} from a {how} inside reserve's locked section: expected DriverError naming {op}, "
            f"got {seen!r}"
        )
        detail = seen[2]
        assert "already inside a call of this driver" in detail and detail.startswith(f"unit-host driver: {op}("), (
            f"unit-host driver: {op} from a {how}: expected the refusal to name the driver, the call and why, got "
            f"{detail!r}"
        )
        named = NAMED[op]
        assert named in detail, f"unit-host driver: {op} refused: expected {named!r} in its message, got {detail!r}"
        assert unchanged, f"unit-host driver: {op} refused inside reserve: expected the driver's state unchanged"


def test_each_locking_call_a_finalizer_makes_inside_a_locked_section_is_refused_and_changes_nothing():
    _expect_refused("finalizer")


def test_each_locking_call_a_signal_handler_makes_inside_a_locked_section_is_refused_and_changes_nothing():
    _expect_refused("signal handler")


class _Record(Owned):
    def __init__(self, owner: object) -> None:
        super().__init__(owner)
        self.torn = 0

    def teardown(self) -> None:
        self.torn += 1


class _Owner:
    pass


def test_a_deferred_record_is_torn_down_by_the_next_collection_outside_a_section_though_its_owner_lives():
    owner = _Owner()
    record = _Record(owner)
    own(record)
    with busy():  # where a close() run by a finalizer inside a driver call finds itself
        defer(record)
        gc.collect()  # a collection inside the section puts the sweep off
    inside = record.torn
    gc.collect()
    got = (inside, record.torn, id(record) in reaper._owned, owner is not None)
    assert got == (0, 1, False, True), (
        f"reaper.defer inside a section: expected (torn inside, torn after the next collection, still owned, owner "
        f"alive) (0, 1, False, True), got {got}"
    )


# A finalizer or a signal handler run inside the cuda or hip driver's locked unmap (the fake's native call) calls
# each call of that driver that takes its lock.
NATIVE_NESTED = """
    import gc, json, signal
    from extensible_kv.errors import DriverError

    va = drv.reserve(4 * g, g)
    h, h2, spare = drv.create(g), drv.create(g), drv.create(g)
    drv.map(va, g, h, 0)
    drv.map(va + g, g, h2, 0)
    CALLS = {
        "reserve": lambda: drv.reserve(g, g),
        "free": lambda: drv.free(va, 4 * g),
        "create": lambda: drv.create(g),
        "release": lambda: drv.release(spare),
        "map": lambda: drv.map(va + 2 * g, g, spare, 0),
        "unmap": lambda: drv.unmap(va, g),
        "set_access": lambda: drv.set_access(va, g),
    }
    LOCKING = sorted(getattr(module, "_LOCKING", ()))

    def attempt(op, seen):
        try:
            CALLS[op]()
            seen[op] = "taken"
        except DriverError as exc:
            seen[op] = [type(exc).__name__, exc.operation, exc.detail]
        except BaseException as exc:
            seen[op] = f"{type(exc).__name__}: {exc}"

    class Caller:  # a finalizer that calls the driver: collected inside the outer call
        def __init__(self, op, seen):
            self.op, self.seen, self.me = op, seen, self

        def __del__(self):
            attempt(self.op, self.seen)

    seen, results = {}, {}
    for op in OPS:
        before = records()
        if HOW == "finalizer":
            gc.disable()
            Caller(op, seen)
            INSIDE.append(gc.collect)
        else:  # a signal handler, run where the interpreter next checks for pending calls inside the hook
            signal.signal(signal.SIGUSR1, lambda *_, op=op: attempt(op, seen))
            INSIDE.append(lambda: [signal.raise_signal(signal.SIGUSR1)] + [i for i in range(3)])
        drv.unmap(va + g, g)  # the outer call: the nested one runs under its lock
        gc.enable()
        drv.map(va + g, g, h2, 0)  # as before
        results[op] = [seen.get(op), records() == before]
    print(json.dumps({"results": results, "locking": LOCKING}))
"""

# The calls of each driver that take its lock: the others (hip's create and release, mem_info, zero) never wait.
NATIVE_LOCKING = {
    "cuda": ["create", "free", "map", "release", "reserve", "set_access", "unmap"],
    "hip": ["free", "map", "reserve", "set_access", "unmap"],
}


@pytest.mark.parametrize("how", ["finalizer", "signal handler"])
@pytest.mark.parametrize("kind", ["cuda", "hip"])
def test_each_locking_call_of_a_gpu_driver_made_inside_its_locked_section_is_refused_and_changes_nothing(kind, how):
    ops = NATIVE_LOCKING[kind]
    code = f"\n    HOW, OPS = {how!r}, {ops!r}" + fake_driver(kind) + NATIVE_NESTED
    out = run_child(code, f"{kind} driver calls from a {how} inside its locked unmap", timeout_s=30)
    assert out["locking"] == ops, (
        f"unit-{kind} driver: expected the calls that take its lock {ops}, got {out['locking']}"
    )
    for op, (seen, unchanged) in out["results"].items():
        assert isinstance(seen, list) and seen[:2] == ["DriverError", op], (
            f"unit-{kind} driver: {op} from a {how} inside unmap's locked section: expected DriverError naming {op}, "
            f"got {seen!r}"
        )
        assert seen[2].startswith(f"unit-{kind} driver: {op}(") and "already inside a call of this driver" in seen[2], (
            f"unit-{kind} driver: {op} from a {how}: expected the refusal to name the driver, the call and why, got "
            f"{seen[2]!r}"
        )
        assert unchanged, f"unit-{kind} driver: {op} refused inside unmap: expected its records and the fake unchanged"


# KV buffers: a finalizer calls each operation of theirs that takes their lock, collected inside their own growth (the
# host driver's mmap of a growth step, with their lock held) or inside another tensor's growth (a driver call of this
# thread, their lock free).
KV_NESTED = (
    HOOK
    + """
    from conformance import layouts
    from extensible_kv.errors import BusyError
    from extensible_kv.kv_cache import ExtensibleKVCacheBuffers, KVBuffer

    driver = HostDriver(granularity=G, budget_bytes=1 << 20, name="unit-host")
    kv = ExtensibleKVCacheBuffers([KVBuffer("kv", layouts.PAGE, (layouts.kv_first("l0"),))], 16, driver=driver)
    kv.ensure_blocks(2)
    other = ExtensibleTensor(16 * G, driver=driver)
    CALLS = {
        "close": kv.close,
        "ensure_blocks": lambda: kv.ensure_blocks(1),
        "release_physical": kv.release_physical,
        "recommit_physical": kv.recommit_physical,
        "pin": lambda: kv.pin("connector"),
        "unpin": lambda: kv.unpin("connector"),
        "pin, unpin": lambda: (kv.pin("connector"), kv.unpin("connector")),  # call no driver: taken outside kv's lock
    }
    WHERE = {
        "kv growth": [op for op in CALLS if op != "pin, unpin"],
        "other growth": ["close", "ensure_blocks", "release_physical", "recommit_physical", "pin, unpin"],
    }

    def state():
        return [kv.state, kv.pinned_by, [kv.tensor("kv").state], kv.stats().committed_bytes]

    class Caller:
        def __init__(self, op, seen):
            self.op, self.seen, self.me = op, seen, self

        def __del__(self):
            try:
                CALLS[self.op]()
                self.seen[self.op] = "taken"
            except BusyError as exc:
                self.seen[self.op] = ["BusyError", str(exc)]
            except BaseException as exc:
                self.seen[self.op] = [type(exc).__name__, str(exc)]

    results = {}
    for where, ops in WHERE.items():
        for op in ops:
            seen = {}
            blocks, size = kv.num_blocks, other.stats().committed_bytes
            before = state()
            gc.disable()
            Caller(op, seen)
            INSIDE.append(gc.collect)
            if where == "kv growth":
                kv.ensure_blocks(blocks + 1)
            else:
                other.resize_per_segment_(size + G)
            gc.enable()
            grown = [kv.num_blocks - blocks, other.stats().committed_bytes - size]
            committed = before[3] + (layouts.PAGE if where == "kv growth" else 0)
            results[f"{op} in {where}"] = [seen.get(op), state() == [*before[:3], committed], grown]
    kv.close()
    other.close()
    print(json.dumps({"results": results, "after": [driver.mem_info()[0], len(driver._mappings)]}))
    """
)


def test_each_kv_buffer_operation_a_finalizer_makes_inside_a_growth_is_refused_and_changes_nothing():
    out = run_child(KV_NESTED, "KV buffer operations from a finalizer inside a growth", timeout_s=30)
    for case, (seen, unchanged, grown) in out["results"].items():
        op, where = case.split(" in ")
        inside = "an operation of this KV cache" if where == "kv growth" else "a driver call"
        if op == "pin, unpin":  # their lock is free and they call no driver: they run, and leave no pin
            assert (seen, unchanged, grown) == ("taken", True, [0, 4096]), (
                f"ExtensibleKVCacheBuffers: pin and unpin from a finalizer inside {where}: expected both taken, the "
                f"buffers as before and the growth whole, got {(seen, unchanged, grown)}"
            )
            continue
        assert isinstance(seen, list) and seen[0] == "BusyError", (
            f"ExtensibleKVCacheBuffers: {op} from a finalizer inside {where}: expected BusyError, got {seen!r}"
        )
        assert seen[1].startswith(f"{op} on ExtensibleKVCacheBuffers(1 buffer(s), ") and inside in seen[1], (
            f"ExtensibleKVCacheBuffers: {op} from a finalizer inside {where}: expected the refusal to name the call, "
            f"the buffers and {inside!r}, got {seen[1]!r}"
        )
        assert unchanged, f"ExtensibleKVCacheBuffers: {op} refused inside {where}: expected the buffers unchanged"
        want = [1, 0] if where == "kv growth" else [0, 4096]
        assert grown == want, (
            f"ExtensibleKVCacheBuffers: the {where} with {op} refused inside it: expected it whole (blocks, bytes "
            f"grown) {want}, got {grown}"
        )
    assert out["after"] == [1 << 20, 0], (
        f"after closing everything: expected (free bytes, mappings) [1 MiB, 0], got {out['after']}"
    )
