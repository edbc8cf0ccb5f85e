"""What a driver factory (``module:factory``) hands back, and what it leaves running.

Note [A factory's result is judged as an object]
    A factory is code from outside, and what it returns is judged as it is: a driver object, with every method and
    attribute of the protocol (``drivers._protocol``), its ``name`` a non-empty string and its ``device`` a
    ``torch.device``. It is never read as a spec: ``drivers.resolve`` would build the best available driver for
    ``None`` and the host driver for the string ``"host"``, and ``check-driver`` said "built HostDriver 'host'" of a
    factory that returned either. What a factory leaves running is named too: a non-daemon thread keeps its process
    from exiting, and a forked helper holds the pipes the preflight reads, so either used to read as "building it did
    not finish within 60 s". The preflight takes the threads alive before it imports the driver's module, and after
    the build lists the non-daemon threads started since and the processes of its own group (``/proc``), names them
    in one line, and ends them with itself.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import torch

from ..drivers._protocol import DRIVER_ATTRIBUTES, DRIVER_METHODS
from . import BoundaryError, shown


class NotADriver(BoundaryError):
    """A factory returned something that is not a driver object; the message names what it returned."""


class LeftRunning(BoundaryError):
    """A factory returned but left threads or processes running; the message names them."""


def judge(built: object, what: str) -> object:
    """``built`` if it is a driver object (Note [A factory's result is judged as an object]), else ``NotADriver``
    naming ``what`` (where it came from) and what it is."""
    if built is None or isinstance(built, (str, bytes, int, float, bool, list, tuple, dict)):
        raise NotADriver(f"{what} returned {_described(built)}, not a driver object")
    lacks = [m for m in DRIVER_METHODS if not callable(getattr(built, m, None))]
    lacks += [a for a in DRIVER_ATTRIBUTES if not hasattr(built, a)]
    if lacks:
        raise NotADriver(
            f"{what} returned {_described(built)}, not a driver: it lacks the protocol's {', '.join(lacks)}"
        )
    name, device = getattr(built, "name", None), getattr(built, "device", None)
    if not isinstance(name, str) or not name:
        raise NotADriver(f"{what} returned a {type(built).__qualname__} whose name is {_described(name)}, not a name")
    if not isinstance(device, torch.device):
        raise NotADriver(
            f"{what} returned a {type(built).__qualname__} whose device is {_described(device)}, not a torch.device"
        )
    return built


def _described(value: object) -> str:
    if value is None:
        return "None"
    return f"{type(value).__qualname__} {shown(repr(value) if not isinstance(value, str) else value, 60)}"


def threads_now() -> set[int]:
    """The idents of the threads alive now (before the factory's module is imported)."""
    return {t.ident for t in threading.enumerate() if t.ident is not None}


def left_running(threads_before: set[int]) -> tuple[list[threading.Thread], list[int]]:
    """The non-daemon threads started since ``threads_before`` and still alive, and the other processes of this
    process's group (when it leads one) or its children."""
    threads = [
        t
        for t in threading.enumerate()
        if t.ident not in threads_before and not t.daemon and t.is_alive() and t is not threading.current_thread()
    ]
    return threads, _processes()


def _processes() -> list[int]:
    """The live processes descended from this one (children, and theirs), and the others of its group when it
    leads one."""
    me, group = os.getpid(), os.getpgrp()
    table = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        table[int(entry.name)] = (fields[0], int(fields[1]), int(fields[2]))

    def descends(pid: int) -> bool:
        seen = set()
        while pid in table and pid not in seen and pid > 1:
            seen.add(pid)
            pid = table[pid][1]
            if pid == me:
                return True
        return False

    return sorted(
        pid
        for pid, (state, _, pgrp) in table.items()
        if pid != me and state != "Z" and (descends(pid) or (group == me and pgrp == group))
    )


def _command(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").strip()
    except OSError:
        return "?"
    return shown(raw.decode("utf-8", "replace") or "?", 60)


def leftovers_message(threads: list[threading.Thread], processes: list[int]) -> str:
    """One line naming the threads and processes a factory left running."""
    parts = [f"non-daemon thread {shown(t.name, 60)}" for t in threads]
    parts += [f"process {pid} ({_command(pid)})" for pid in processes]
    return (
        f"its factory returned but left running {'; '.join(parts)} (a factory must leave no non-daemon thread or "
        f"process behind: either keeps the build from ending; ended with it)"
    )


def end(processes: list[int]) -> None:
    """SIGKILL each of ``processes`` (gone already is fine)."""
    for pid in processes:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
