"""Hostile use of the reference package on the host driver, each case in a child Python so a hang, a fault or a
fork cannot take the test run with it: a collection inside a driver call, interpreter exit under a writing thread,
use after fork, a signal handler raising at random moments of growth and close, sizes ctypes would truncate, and
small mistakes that must get typed errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from extensible_kv import ExtensibleTensor, Ledger
from extensible_kv.drivers import get_driver
from extensible_kv.errors import DriverLoadError, InvalidArgumentError

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60


def _child(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with the package importable; a hang is killed after ``TIMEOUT_S``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "reference"), str(ROOT)])}
    try:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"child process hung for {TIMEOUT_S} s (a deadlock): stdout {exc.stdout!r}", pytrace=False)


def _expect_child(proc: subprocess.CompletedProcess, what: str, expected_out: str) -> None:
    got = (proc.returncode, proc.stdout.strip())
    assert got == (0, expected_out), (
        f"host driver: {what}: expected exit 0 printing {expected_out!r}, got exit "
        f"{proc.returncode} printing {proc.stdout.strip()!r}; stderr: "
        f"{proc.stderr[-2000:]}"
    )


def test_a_tensor_collected_inside_a_driver_call_of_its_driver_does_not_deadlock():
    proc = _child("""
        import gc
        from contextlib import contextmanager
        from extensible_kv import ExtensibleTensor
        from extensible_kv.drivers.host import HostDriver

        class CollectingUnderTheLock(HostDriver):
            armed = False

            @contextmanager
            def locked(self):  # a collection that runs while the driver's lock is held
                with super().locked():
                    if self.armed:
                        self.armed = False
                        gc.collect()
                    yield

        driver = CollectingUnderTheLock(granularity=4096)
        gc.disable()
        dead = ExtensibleTensor(8192, driver=driver)
        dead.resize_per_segment_(4096)
        dead.cycle = dead  # only the cyclic collector can free it
        del dead
        live = ExtensibleTensor(8192, driver=driver)
        driver.armed = True
        live.resize_per_segment_(4096)  # its first call collects `dead`, whose finalizer unmaps on the same driver
        print(driver.armed, len(driver._reservations), len(driver._mappings))
    """)
    _expect_child(
        proc, "a tensor collected inside a locked call of its own driver (fired, reservations, mappings)", "False 1 1"
    )


def test_interpreter_exit_leaves_memory_mapped_under_a_writing_daemon_thread():
    code = """
        import ctypes, threading
        from extensible_kv import ExtensibleTensor
        t = ExtensibleTensor(8 << 20, driver="host-4k")
        t.resize_per_segment_(8 << 20)
        view = t.segment_view(0)
        started = threading.Event()

        def write():  # through ctypes, not torch: a daemon thread stopped inside C++ at exit aborts on its own
            started.set()
            while True:
                ctypes.memset(view.data_ptr(), 7, view.numel())

        threading.Thread(target=write, daemon=True).start()
        started.wait()
        del t
        print("exiting")
    """
    for attempt in range(8):  # the fault, where there is one, is a race with the writer: try several exits
        _expect_child(_child(code), f"exit with a daemon thread writing a view (attempt {attempt + 1})", "exiting")


def test_a_forked_child_is_refused_with_a_typed_error_and_the_parent_keeps_its_memory():
    proc = _child("""
        import os
        from extensible_kv import ExtensibleTensor
        from extensible_kv.errors import DriverError
        t = ExtensibleTensor(4 * 4096, driver="host-4k")
        t.resize_per_segment_(4096)
        t.segment_view(0).fill_(9)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                t.resize_per_segment_(8192)
                msg = "grew"
            except DriverError as exc:  # refused before any lock or driver call: Note [Forked children]
                msg = "refused" if "forked" in str(exc) else f"other: {exc}"
            except BaseException as exc:
                msg = f"{type(exc).__name__}: {exc}"
            t.close(force=True)  # the child does not own the memory: nothing is returned
            os.write(w, msg.encode())
            os._exit(0)
        os.waitpid(pid, 0)
        child = os.read(r, 1000).decode()
        data = int(t.segment_view(0).sum())
        t.resize_per_segment_(8192)
        print(child, data == 9 * 4096, t.bytes_per_segment)
    """)
    _expect_child(proc, "growth from a forked child", "refused True 8192")


SIGNALS_CHILD = """
    import gc, os, random, signal
    from extensible_kv import ExtensibleTensor
    from extensible_kv.drivers.host import HostDriver
    from extensible_kv.errors import DriverError

    class Alarm({base}):
        pass

    def handler(signum, frame):
        raise Alarm()

    signal.signal(signal.SIGALRM, handler)
    G = 4096
    driver = HostDriver(granularity=G, name="host-4k", budget_bytes=1024 * G)
    rng = random.Random(7)
    interrupted, states = 0, set()
    for trial in range(400):
        t = None
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(0, 0.003))
                t = ExtensibleTensor(64 * G, 2, driver=driver)
                for size in (G, 3 * G, 10 * G, 32 * G):
                    t.resize_per_segment_(size)
                t.close()
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except Alarm:
            interrupted += 1
        if t is not None:
            states.add(t.state)
            try:
                t.close()
            except DriverError:
                t.close()
            assert t.closed, t.state
    del t
    gc.collect()
    ExtensibleTensor(G, driver=driver).close()  # returns what a tensor interrupted while being built left
    lock_free = driver._lock.acquire(blocking=False) and not driver._lock.release()
    memfds = sum("extensible-kv" in os.readlink(f"/proc/self/fd/{{fd}}") for fd in os.listdir("/proc/self/fd")
                 if os.path.exists(f"/proc/self/fd/{{fd}}"))
    held = driver.mem_info()[1] - driver.mem_info()[0]
    print(interrupted > 0, lock_free, held, len(driver._reservations), len(driver._mappings), memfds)
"""


@pytest.mark.parametrize("base", ["KeyboardInterrupt", "TimeoutError"])
def test_a_signal_handler_raising_at_random_moments_of_growth_and_close_hangs_nothing_and_leaks_nothing(base):
    # 400 tensors grown in four steps and closed, a SIGALRM handler raising at a random moment of each (the handler
    # runs where the interpreter checks for pending calls: often right after a native call returns); every tensor is
    # closed afterwards, retrying once from its failure state. Then: the driver's lock is free, and no budget byte,
    # reservation, mapping or memfd is held.
    proc = _child(SIGNALS_CHILD.format(base=base))
    _expect_child(
        proc,
        f"{base} from a SIGALRM handler at random moments (interrupted some, lock free, held bytes, "
        f"reservations, mappings, memfds)",
        "True True 0 0 0 0",
    )


SMALL_MISTAKES = {
    "driver=42": (lambda: ExtensibleTensor(4096, driver=42), DriverLoadError, "driver=42 is a int"),
    "driver=object()": (lambda: ExtensibleTensor(4096, driver=object()), DriverLoadError, "lacks the protocol"),
    "segment_view dtype 'float32'": (
        lambda: ExtensibleTensor(4096, driver="host-4k").segment_view(0, "float32"),
        InvalidArgumentError,
        "dtype must be a torch.dtype",
    ),
    "full_view dtype None": (
        lambda: ExtensibleTensor(4096, driver="host-4k").full_view(None),
        InvalidArgumentError,
        "dtype must be a torch.dtype",
    ),
    "Ledger(42)": (lambda: Ledger(42), DriverLoadError, r"Ledger\(42\): a int, which lacks the protocol's granularity"),
    "Ledger('host-4k')": (lambda: Ledger("host-4k"), DriverLoadError, r"Ledger\('host-4k'\): a str, which lacks"),
}


@pytest.mark.parametrize("call,error,needle", SMALL_MISTAKES.values(), ids=SMALL_MISTAKES.keys())
def test_small_mistakes_get_typed_errors(call, error, needle):
    with pytest.raises(error, match=needle):
        call()


def test_a_ledger_wraps_the_driver_object_it_is_given():
    inner = get_driver("host-4k")
    ledger = Ledger(inner)
    got = (ledger.inner, ledger.name, ledger.granularity())
    assert got == (inner, "host-4k", 4096), f"Ledger(host-4k driver): expected ({inner!r}, 'host-4k', 4096), got {got}"
