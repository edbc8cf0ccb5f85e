"""What a forked child inherits (Note [What a forked child inherits] in ``extensible_kv.reaper``): a child forked while
other threads of the parent hold the driver's lock (inside a release), the Ledger's lock and a ``process_lock()``
refuses every driver and Ledger call with ``DriverError`` naming the call and both processes, at once, never waits,
and changes nothing the parent holds. Each case runs in a child interpreter that forks a grandchild under a hard
alarm, so a hang is reported as one instead of hanging the run."""

from __future__ import annotations

from ._child import run_child

# A thread stopped inside the host driver's locked `_unmap` (through a wrapped libc mmap), inside
# `release_physical` of tensor `t`; another thread holding a Ledger's lock; a third holding a process_lock().
SETUP = """
    import json, os, signal, threading, time, warnings
    from extensible_kv import ExtensibleTensor, reaper
    from extensible_kv.drivers import Ledger, host
    from extensible_kv.drivers.host import HostDriver
    from extensible_kv.errors import DriverError

    warnings.simplefilter("ignore", DeprecationWarning)  # fork of a multi-threaded process: that is the case
    REAL = host._lib()
    ENTERED, GO = threading.Event(), threading.Event()

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
    holding = threading.Event()

    def hold(lk):
        with lk:
            holding.set()
            GO.wait()

    Lib.armed = True
    threads = [threading.Thread(target=t.release_physical), threading.Thread(target=hold, args=(ledger._lock,))]
    threads[0].start(); ENTERED.wait()
    threads[1].start(); holding.wait(); holding.clear()
    threads.append(threading.Thread(target=hold, args=(lock,))); threads[2].start(); holding.wait()

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
    want = {"t.close": "returned", "keep.stats": "DriverError", "keep.close": "returned"}
    assert got == want, (
        f"ExtensibleTensor calls in a child forked inside a release: expected (close returns, nothing to give back; "
        f"anything else refused as the driver refuses) {want}, got {out['seen']}"
    )
