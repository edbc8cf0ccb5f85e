"""Finalizers and signal handlers that run inside a driver's locked section and call the driver again (Note [A finalizer
never waits on a lock its thread may hold] in ``extensible_kv.reaper``, Note [A call never waits on its own thread] in
``drivers/host.py``): each is refused at once with ``DriverError`` naming the call, the outer call finishes whole, and
memory a refused ``close()`` left is returned by the next collection. Each case runs in a child interpreter, so the
deadlock these tests were written against fails after a deadline instead of hanging the run."""

from __future__ import annotations

import gc

from extensible_kv import reaper
from extensible_kv.reaper import Owned, busy, defer, own

from ._child import run_child

# Inside the host driver's locked ``_reserve`` (its mmap, through a wrapped libc), run ``INSIDE[0]`` once.
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
    # driver's `_reserve` while it holds the driver's lock. Before the rule the child hung in the nested unmap.
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
        outer = driver.reserve(G, G)  # the outer call: its _reserve runs the nested one under the lock
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
