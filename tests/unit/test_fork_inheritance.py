"""What a forked child inherits (Note [What a forked child inherits] in ``extensible_kv.reaper``): a child forked while
other threads of the parent hold the driver's lock (inside a release), the Ledger's lock and a ``process_lock()``
refuses every driver and Ledger call with ``DriverError`` naming the call and both processes, at once, never waits,
and changes nothing the parent holds; so do the cuda and hip drivers over their fakes, and the KV buffers (whose
``close()`` returns, giving nothing back). Each case runs in a child interpreter that forks a grandchild under a hard
alarm, so a hang is reported as one instead of hanging the run."""

from __future__ import annotations

import pytest

from ._child import fake_driver, run_child

# Run `calls` in a child forked under a hard alarm, each answer sent back by a pipe with its time.
FORK = """
    import json, os, signal, threading, time, warnings
    from extensible_kv.errors import DriverError

    warnings.simplefilter("ignore", DeprecationWarning)  # fork of a multi-threaded process: that is the case
    ENTERED, GO = threading.Event(), threading.Event()
    holding = threading.Event()

    def hold(lk):
        with lk:
            holding.set()
            GO.wait()

    def child(calls):
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(CHILD_S)  # a hang is killed by SIGALRM and reported as such
        seen = {}
        for name, call in calls.items():
            start = time.monotonic()
            try:
                got = call()
                seen[name] = ["returned", repr(got)]
            except DriverError as exc:
                seen[name] = ["DriverError", exc.operation, exc.detail]
            except BaseException as exc:
                seen[name] = [type(exc).__name__, str(exc)]
            seen[name].append(round(time.monotonic() - start, 3))
            os.write(W, (json.dumps([name, seen[name]]) + "\\n").encode())

    def fork_and_judge(calls):
        global W
        r, W = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                child(calls)
            finally:
                os._exit(0)
        os.close(W)
        with os.fdopen(r) as pipe:
            lines = pipe.read().splitlines()
        _, status = os.waitpid(pid, 0)
        killed = signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status) else None
        return pid, dict(json.loads(line) for line in lines), killed
"""

# The host driver, its libc wrapped: the first anonymous mmap after `Lib.armed` (an unmap's, under the driver's
# lock) stops until GO.
HOOKED = """
    from extensible_kv import ExtensibleTensor, reaper
    from extensible_kv.drivers import Ledger, host
    from extensible_kv.drivers.host import HostDriver

    REAL = host._lib()

    class Lib:
        armed = False

        def __getattr__(self, name):
            return getattr(REAL, name)

        def mmap(self, *args):
            if Lib.armed and args[3] & 0x20:  # the anonymous mmap of an unmap, under the driver's lock
                Lib.armed = False
                ENTERED.set()
                GO.wait()
            return REAL.mmap(*args)

    LIB = Lib()
    host._lib = lambda: LIB
    G = 4096
    driver = HostDriver(granularity=G, budget_bytes=1 << 20, name="unit-host")
"""

# A thread stopped inside the host driver's locked `do_unmap`, inside `release_physical` of tensor `t`; another thread
# holding a Ledger's lock; a third holding a process_lock().
SETUP = (
    FORK
    + HOOKED
    + """
    ledger = Ledger(driver)
    keep = ExtensibleTensor(4 * G, driver=driver)
    keep.resize_per_segment_(2 * G)
    keep.segment_view(0).fill_(7)
    kva = keep.base_address
    t = ExtensibleTensor(4 * G, num_segments=4, driver=driver)
    t.resize_per_segment_(G)
    spare = driver.create(G)
    lva = ledger.reserve(2 * G, G)
    lock = reaper.process_lock()
    Lib.armed = True
    threads = [threading.Thread(target=t.release_physical), threading.Thread(target=hold, args=(ledger._lock,))]
    threads[0].start(); ENTERED.wait()
    threads[1].start(); holding.wait(); holding.clear()
    threads.append(threading.Thread(target=hold, args=(lock,))); threads[2].start(); holding.wait()
"""
)

FINISH = """
    GO.set()
    for th in threads:
        th.join()
    after = [driver.mem_info(), int(keep.segment_view(0).sum()), t.state, len(driver._mappings)]
    print(json.dumps({"pid": pid, "parent": os.getpid(), "seen": seen, "killed": killed, "after": after}))
"""

CHILD_S = 5

DRIVER_CALLS = """
    CALLS = {
        "granularity": driver.granularity,
        "reserve": lambda: driver.reserve(G, G),
        "free": lambda: driver.free(kva, 4 * G),
        "create": lambda: driver.create(G),
        "release": lambda: driver.release(spare),
        "map": lambda: driver.map(kva + 3 * G, G, spare, 0),
        "unmap": lambda: driver.unmap(kva, G),
        "set_access": lambda: driver.set_access(kva, G),
        "zero": lambda: driver.zero(kva, G),
        "tensor": lambda: driver.tensor(kva, G, None),
        "accessible": lambda: driver.accessible(kva),
        "synchronize": driver.synchronize,
        "mem_info": driver.mem_info,
        "ledger reserve": lambda: ledger.reserve(G, G),
        "ledger free": lambda: ledger.free(lva, 2 * G),
        "ledger create": lambda: ledger.create(G),
        "ledger synchronize": ledger.synchronize,
        "ledger zero": lambda: ledger.zero(kva, G),
        "ledger mem_info": ledger.mem_info,
        "ledger outstanding": lambda: len(ledger.outstanding().reservations),
        "process_lock": lambda: lock.acquire(timeout=1),
        "sweep": reaper.sweep,
    }
    pid, seen, killed = fork_and_judge(CALLS)
"""

# What each call in the child does: refused naming itself, or (the reads of the parent's own records) answered.
ANSWERED = {"ledger outstanding": "1", "process_lock": "True", "sweep": "None"}


def test_a_child_forked_while_threads_hold_the_locks_is_refused_every_call_at_once_and_touches_nothing():
    out = run_child(f"\n    CHILD_S = {CHILD_S}" + SETUP + DRIVER_CALLS + FINISH, "driver calls in a forked child")
    pid, parent, seen = out["pid"], out["parent"], out["seen"]
    assert out["killed"] is None, (
        f"unit-host driver in a child forked inside a release: expected every call answered within {CHILD_S} s, got "
        f"the child killed by {out['killed']} after {sorted(seen)}"
    )
    detail = (
        f"unit-host driver built in process {parent} used from forked process {pid}; build a new driver in the child"
    )
    for name, got in seen.items():
        op = name.removeprefix("ledger ")
        if name in ANSWERED:
            expected = ["returned", ANSWERED[name]]
        else:
            expected = ["DriverError", op, detail]
        assert got[:-1] == expected, f"unit-host driver: {name} in a forked child: expected {expected}, got {got[:-1]}"
        assert got[-1] < 1.0, f"unit-host driver: {name} in a forked child: expected an answer at once, got {got[-1]} s"
    # The parent after its release finished: the child's refused zero, unmap and free touched nothing of it.
    want = [[(1 << 20) - 3 * 4096, 1 << 20], 7 * 2 * 4096, "released", 1]
    assert out["after"] == want, (
        f"unit-host driver in the parent after the child: expected (mem_info, keep's byte sum, t's state, mappings) "
        f"{want}, got {out['after']}"
    )


TENSOR_CALLS = """
    CALLS = {
        "t.close": lambda: t.close(force=True),
        "keep.stats": lambda: keep.stats().state,
        "keep.checkpoint": keep.checkpoint,
        "keep.pin": lambda: keep.pin("connector"),
        "keep.unpin": lambda: keep.unpin("connector"),
        "keep.pinned_by": lambda: keep.pinned_by,
        "keep.live_views": keep.live_views,
        "keep.close": lambda: keep.close(force=True),
    }
    pid, seen, killed = fork_and_judge(CALLS)
"""


def test_a_child_forked_inside_a_release_closes_the_inherited_tensors_at_once():
    out = run_child(f"\n    CHILD_S = {CHILD_S}" + SETUP + TENSOR_CALLS + FINISH, "tensor calls in a forked child")
    assert out["killed"] is None, (
        f"ExtensibleTensor in a child forked inside its release_physical: expected close() to answer within "
        f"{CHILD_S} s, got the child killed by {out['killed']} after {out['seen']}"
    )
    got = {name: seen[0] for name, seen in out["seen"].items()}
    refused = ("stats", "checkpoint", "pin", "unpin", "pinned_by", "live_views")
    want = {"t.close": "returned", **{f"keep.{op}": "DriverError" for op in refused}, "keep.close": "returned"}
    assert got == want, (
        f"ExtensibleTensor calls in a child forked inside a release: expected (close returns, nothing to give back; "
        f"anything else refused as the driver refuses) {want}, got {out['seen']}"
    )


def _judge(out: dict, what: str, expected: dict[str, list]) -> None:
    """Every call in the child answered within ``CHILD_S`` s, at once, as ``expected`` says: ``[outcome, ...]``, where
    ``DETAIL`` in a refusal stands for the process refusal naming both processes."""
    seen = out["seen"]
    assert out["killed"] is None, (
        f"{what}: expected every call answered within {CHILD_S} s, got the child killed by {out['killed']} after "
        f"{sorted(seen)}"
    )
    assert sorted(seen) == sorted(expected), f"{what}: expected answers to {sorted(expected)}, got {sorted(seen)}"
    detail = (
        f"{out['driver']} driver built in process {out['parent']} used from forked process {out['pid']}; build a new "
        f"driver in the child"
    )
    for name, got in seen.items():
        want = [detail if part == "DETAIL" else part for part in expected[name]]
        assert got[:-1] == want, f"{what}: {name} in a forked child: expected {want}, got {got[:-1]}"
        assert got[-1] < 1.0, f"{what}: {name} in a forked child: expected an answer at once, got {got[-1]} s"


# A thread stopped inside the host driver's locked `do_unmap`, inside `release_physical` of KV buffers `kv` (their lock,
# a tensor's lock and the driver's lock held).
KV_CALLS = """
    from conformance import layouts
    from extensible_kv.kv_cache import ExtensibleKVCacheBuffers, KVBuffer

    kv = ExtensibleKVCacheBuffers([KVBuffer("kv", layouts.PAGE, (layouts.kv_first("l0"),))], 4, driver=driver)
    kv.ensure_blocks(2)
    Lib.armed = True
    threads = [threading.Thread(target=kv.release_physical)]
    threads[0].start(); ENTERED.wait()
    CALLS = {
        "ensure_blocks": lambda: kv.ensure_blocks(3),
        "release_physical": kv.release_physical,
        "recommit_physical": kv.recommit_physical,
        "pin": lambda: kv.pin("connector"),
        "unpin": lambda: kv.unpin("connector"),
        "stats": kv.stats,
        "tensor": lambda: kv.tensor("kv"),
        "raw": lambda: kv.raw("kv"),
        "layer_views": lambda: kv.layer_views("l0"),
        "committed_layer_views": lambda: kv.committed_layer_views("l0"),
        "close": kv.close,
        "state after close": lambda: kv.state,
    }
    pid, seen, killed = fork_and_judge(CALLS)
    GO.set()
    threads[0].join()
    after = [kv.state, kv.num_blocks, driver.mem_info()[0], len(driver._mappings)]
    print(json.dumps({"pid": pid, "parent": os.getpid(), "driver": driver.name, "seen": seen, "killed": killed,
                      "after": after}))
"""

KV_EXPECTED = {
    **{op: ["DriverError", op, "DETAIL"] for op in ("ensure_blocks", "release_physical", "recommit_physical")},
    **{op: ["DriverError", op, "DETAIL"] for op in ("pin", "unpin", "stats", "tensor")},
    "raw": ["DriverError", "raw", "DETAIL"],
    "layer_views": ["DriverError", "layer views", "DETAIL"],
    "committed_layer_views": ["DriverError", "layer views", "DETAIL"],
    "close": ["returned", "None"],  # nothing to give back: the parent owns the memory
    "state after close": ["returned", "'closed'"],
}


def test_a_child_forked_inside_a_kv_release_refuses_every_kv_call_at_once_and_touches_nothing():
    out = run_child(f"\n    CHILD_S = {CHILD_S}" + FORK + HOOKED + KV_CALLS, "KV buffer calls in a forked child")
    _judge(out, "ExtensibleKVCacheBuffers in a child forked inside their release_physical", KV_EXPECTED)
    want = ["released", 2, 1 << 20, 0]
    assert out["after"] == want, (
        f"ExtensibleKVCacheBuffers in the parent after the child: expected (state, blocks, free bytes, mappings) "
        f"{want}, got {out['after']}"
    )


# A thread stopped inside the fake's native unmap, under the cuda or hip driver's lock.
NATIVE_CALLS = """
    va = drv.reserve(4 * g, g)
    h, h2, spare = drv.create(g), drv.create(g), drv.create(g)
    drv.map(va, g, h, 0)
    drv.set_access(va, g)
    drv.map(va + g, g, h2, 0)
    INSIDE.append(lambda: (ENTERED.set(), GO.wait()))
    threads = [threading.Thread(target=drv.unmap, args=(va + g, g))]
    threads[0].start(); ENTERED.wait()
    CALLS = {
        "granularity": drv.granularity,
        "reserve": lambda: drv.reserve(g, g),
        "free": lambda: drv.free(va, 4 * g),
        "create": lambda: drv.create(g),
        "release": lambda: drv.release(spare),
        "map": lambda: drv.map(va + 2 * g, g, spare, 0),
        "unmap": lambda: drv.unmap(va, g),
        "set_access": lambda: drv.set_access(va, g),
        "zero": lambda: drv.zero(va, g),
        "tensor": lambda: drv.tensor(va, g, None),
        "accessible": lambda: drv.accessible(va),
        "synchronize": drv.synchronize,
        "mem_info": drv.mem_info,
    }
    pid, seen, killed = fork_and_judge(CALLS)
    GO.set()
    threads[0].join()
    after = [sorted(drv._mappings.items()) == [(va, g)], records()[:2] == records()[3:5], drv.accessible(va)]
    print(json.dumps({"pid": pid, "parent": os.getpid(), "driver": drv.name, "seen": seen, "killed": killed,
                      "after": after}))
"""

NATIVE_OPS = ("granularity", "reserve", "free", "create", "release", "map", "unmap", "set_access", "zero", "tensor")


@pytest.mark.parametrize("kind", ["cuda", "hip"])
def test_a_child_forked_inside_an_unmap_refuses_every_call_of_the_gpu_driver_at_once(kind):
    code = f"\n    CHILD_S = {CHILD_S}" + FORK + fake_driver(kind) + NATIVE_CALLS
    out = run_child(code, f"{kind} driver calls in a forked child")
    ops = (*NATIVE_OPS, "accessible", "synchronize", "mem_info")
    _judge(
        out,
        f"unit-{kind} driver (over its fake) in a child forked inside an unmap",
        {op: ["DriverError", op, "DETAIL"] for op in ops},
    )
    assert out["after"] == [True, True, True], (
        f"unit-{kind} driver in the parent after the child: expected (one mapping left, records as the fake's, the "
        f"first still accessible) [True, True, True], got {out['after']}"
    )
