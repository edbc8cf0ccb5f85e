"""Driver factories that misbehave, for the tests of ``check-driver``'s trust boundary (``tests/unit/
test_check_driver_boundary.py``), loaded by spec (``tests.unit._hostile_factories:...``).

Importing this module records which process imported it: with ``IMPORTED_BY`` set to a folder, each importing
process writes a file named by its pid holding its parent's pid, so a test can tell the processes that imported the
driver's module (the preflight child, the pytest-xdist workers) from those that must not (the command and pytest's
controller, the workers' parent).
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

from extensible_kv.drivers.host import HostDriver

IMPORTED_BY = "HOSTILE_FACTORIES_IMPORTED_BY"

if os.environ.get(IMPORTED_BY):
    (Path(os.environ[IMPORTED_BY]) / str(os.getpid())).write_text(str(os.getppid()))


def segfault() -> HostDriver:
    """Reads address 0 while building: the process dies of SIGSEGV."""
    ctypes.string_at(0)
    raise AssertionError("ctypes.string_at(0) returned")


def hang() -> HostDriver:
    """Never returns."""
    while True:
        time.sleep(60)


class _HangInZero(HostDriver):
    """zero() never returns: any rule that commits memory hangs in it."""

    def zero(self, va: int, size: int) -> None:
        while True:
            time.sleep(60)


def hang_in_zero() -> HostDriver:
    return _HangInZero(granularity=4096, name="hang-in-zero")


def returns_none() -> None:
    """Returns ``None``, which ``drivers.resolve`` would read as "the best available driver"."""
    return None


def returns_host() -> str:
    """Returns the string ``"host"``, which ``drivers.resolve`` would read as a spec and build the host driver."""
    return "host"


def returns_a_module():
    """Returns an object with no driver methods (this module)."""
    import sys

    return sys.modules[__name__]


def leaves_a_thread() -> HostDriver:
    """Returns a driver at once, but leaves a non-daemon thread running that keeps its process alive."""
    import threading

    threading.Thread(target=time.sleep, args=(3600,), name="factory-helper", daemon=False).start()
    return HostDriver(granularity=4096, name="leaves-a-thread")


def leaves_a_process() -> HostDriver:
    """Returns a driver at once, but leaves a child process running that holds its stdout and stderr."""
    import subprocess
    import sys

    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    return HostDriver(granularity=4096, name="leaves-a-process")


def detaches_a_process() -> HostDriver:
    """Returns a driver at once, but leaves a helper running that it detached: a new session, then a double fork
    (its parent is gone, so it is no child of the factory's process)."""
    import subprocess
    import sys

    code = "import os, time; os.fork() and os._exit(0); time.sleep(3600)"
    subprocess.run([sys.executable, "-c", code], start_new_session=True, check=True)
    return HostDriver(granularity=4096, name="detaches-a-process")


def floods_stdout() -> HostDriver:
    """Writes 8 MiB to stdout with no newline at the end, then returns a good driver."""
    os.write(1, b"x" * (8 << 20))
    return HostDriver(granularity=4096)


def exits_with_escapes() -> HostDriver:
    """Writes a terminal escape sequence to stderr and ends the process before the preflight can say anything."""
    os.write(2, b"\x1b[2J\x1b[31mred\x1b[0m\r\n")
    os._exit(3)


def silences_stdout() -> HostDriver:
    """Leaves ``sys.stdout`` pointing at /dev/null, then returns a good driver."""
    import sys

    sys.stdout = open(os.devnull, "w")
    return HostDriver(granularity=4096)


def says_ok_then_fails() -> HostDriver:
    """Writes a status line of its own that says the driver was built, then ends the process with status 1."""
    os.write(1, b'\nextensible-kv-preflight: {"status": "ok", "facts": {"name": "fake"}}\n')
    os._exit(1)


def crashes_after_an_escaped_frame() -> HostDriver:
    """Writes a frame line holding terminal escapes to stderr, then dies of SIGSEGV."""
    import signal

    os.write(2, b'  File "\x1b[2J\x1b[31mevil.py", line 1 in \x1b[0mf\n')
    os.kill(os.getpid(), signal.SIGSEGV)
    raise AssertionError("SIGSEGV did not end the process")


def sets_stdout_to_none() -> HostDriver:
    """Sets ``sys.stdout`` to None, then returns a good driver."""
    import sys

    sys.stdout = None
    return HostDriver(granularity=4096)


def _idle() -> None:
    while True:
        time.sleep(0.05)


def crashes_beside_a_thread() -> HostDriver:
    """Starts a thread that idles, then reads address 0: the dump lists the idle thread first."""
    import threading

    threading.Thread(target=_idle, daemon=True).start()
    time.sleep(0.2)
    ctypes.string_at(0)
    raise AssertionError("ctypes.string_at(0) returned")


DETACHED_PID_FILE = "HOSTILE_FACTORIES_DETACHED_PID_FILE"


def leaves_a_detached_helper() -> HostDriver:
    """Starts a helper in a session of its own that keeps stdout and stderr open for 30 s (its pid written to the
    file ``DETACHED_PID_FILE`` names), then returns a good driver at once."""
    pid = os.fork()
    if pid == 0:  # the first child: a new session, then a grandchild that outlives it
        os.setsid()
        if os.fork() == 0:
            Path(os.environ[DETACHED_PID_FILE]).write_text(str(os.getpid()))
            time.sleep(30)
        os._exit(0)
    os.waitpid(pid, 0)
    return HostDriver(granularity=4096)


def raises_escapes() -> HostDriver:
    """Raises with terminal escape sequences in its message."""
    raise RuntimeError("\x1b]0;owned\x07\x1b[31mred\x1b[0m")
