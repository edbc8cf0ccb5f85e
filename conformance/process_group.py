"""Child processes that end with their parent: each runs in its own process group, killed as a group.

``check_driver`` starts pytest (whose pytest-xdist workers run the driver under test) and the preflight build in
children of their own session. A driver's code can hang, ignore signals or leave processes behind, and a terminal's
Ctrl-C reaches only the foreground group; so the parent, not the terminal, ends the children: on Ctrl-C or SIGTERM
it passes the signal on to the whole group, waits a few seconds, then kills what is left, and it kills what is left
of the group when the child exits normally too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

GRACE_S = 5.0  # after the first signal, before SIGKILL


@dataclass(frozen=True)
class Finished:
    """How a child ended: its exit status (negative: the signal that ended it), or ``timed_out``."""

    returncode: int | None
    timed_out: bool = False
    stdout: str = ""
    stderr: str = ""


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to every process of the group ``pgid``; a group already gone is fine."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _end(proc: subprocess.Popen, first: int) -> None:
    """Send ``first`` to ``proc``'s group, give it ``GRACE_S`` to exit, then kill the group."""
    kill_group(proc.pid, first)
    try:
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    kill_group(proc.pid)
    proc.wait()


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While the child runs, SIGTERM to this process raises ``SystemExit(143)`` here (so the group is ended on the way
    out), where SIGTERM still has its default action and this is the main thread; restored after."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def terminated(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run(cmd: Sequence[str], *, env: Mapping[str, str], timeout: float | None = None, capture: bool = False) -> Finished:
    """Run ``cmd`` in a new session and wait for it (at most ``timeout`` seconds, ``None``: no limit); whatever
    happens, no process of its group outlives this call. With ``capture``, its output is returned as text (the last
    ``CAPTURE_LIMIT`` bytes of each stream), kept in unnamed files rather than pipes: the wait is for the child
    itself, not for every process that holds its output open (a helper it left in a session of its own)."""
    with _sigterm_raises(), _outputs(capture) as (out_file, err_file):
        proc = subprocess.Popen(list(cmd), env=dict(env), stdout=out_file, stderr=err_file, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _end(proc, signal.SIGTERM)
            return Finished(None, True, _tail(out_file), _tail(err_file))
        except KeyboardInterrupt:
            _end(proc, signal.SIGINT)
            raise
        except BaseException:
            _end(proc, signal.SIGTERM)
            raise
        kill_group(proc.pid)  # what the child left running in its group (a worker that outlived its controller)
        return Finished(proc.returncode, False, _tail(out_file), _tail(err_file))


CAPTURE_LIMIT = 8 << 20  # the most of each captured stream kept, its end: a status line is the last thing said


@contextmanager
def _outputs(capture: bool) -> Iterator[tuple]:
    if not capture:
        yield None, None
        return
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        yield out, err


def _tail(file) -> str:
    """The last ``CAPTURE_LIMIT`` bytes written to ``file`` as text ('' without capture)."""
    if file is None:
        return ""
    size = file.seek(0, os.SEEK_END)
    file.seek(max(0, size - CAPTURE_LIMIT))
    return file.read().decode("utf-8", errors="replace")
