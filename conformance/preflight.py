"""The preflight: build the driver under test once, in a child process with a time limit, before any rule runs.

Note [Who builds the driver under test]
    A ``module:factory`` spec names code from outside this project: importing its module or calling its factory may
    raise, crash the interpreter, hang, or return something that is not a driver. So the process a user starts
    (``extensible-kv check-driver``, ``check_driver``) and pytest's controller never import, build or call it: the
    preflight builds it in a child of its own process group, killed on ``--build-timeout``, and the rules build it
    again in pytest-xdist workers, where the plugin's watchdog bounds each build and each rule. A driver that cannot
    be built is then one message and no rule runs (exit status 1), instead of the same error once per rule; a spec
    that names no driver (bad syntax, no such module, no such factory) is one line and exit status 2. The preflight
    resolves the module with ``importlib.util.find_spec`` before importing it, so "no such module" and "the module
    raised on import" are told apart. The header and summary figures (granularity, commit throughput) come from the
    workers too (``plugin/summary.py``).

Run as ``python -m <suite>.preflight SPEC``: the last line on stdout is ``PREFIX`` and a JSON object with ``status``
(``ok``, ``bad-spec``, ``unbuildable``) and ``message`` or ``facts``.
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import importlib.util
import json
import os
import re
import signal
import sys
import sysconfig
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from extensible_kv.boundaries import escaped, named, shown

from . import process_group

PREFIX = "extensible-kv-preflight: "
PR_SET_CHILD_SUBREAPER = 36  # prctl(2)
EXIT_STATUS = {"ok": 0, "bad-spec": 2, "unbuildable": 1}  # the child's status line and the exit status it ends with
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MODULE = re.compile(rf"{_NAME.pattern}(\.{_NAME.pattern})*")


@dataclass(frozen=True)
class Outcome:
    """What the preflight found: ``status`` is ``ok`` (with ``facts``), ``bad-spec`` or ``unbuildable``."""

    status: str
    message: str = ""
    facts: dict = field(default_factory=dict)


class _BadSpec(Exception):
    pass


class _Unbuildable(Exception):
    pass


def syntax_error(spec: str) -> str | None:
    """Why ``spec`` is neither a driver name nor ``package.module:factory`` (read, not imported), or ``None``."""
    module, colon, attr = spec.partition(":")
    if not colon:
        if spec and spec.strip() == spec and not any(c.isspace() for c in spec):
            return None
    elif _MODULE.fullmatch(module) and _NAME.fullmatch(attr):
        return None
    return f"driver spec {spec!r} is neither a registered driver name nor 'package.module:factory'"


def _build(spec: str) -> dict:
    """Build the driver ``spec`` names here and return what the run's header shows of it."""
    from extensible_kv import drivers  # after faulthandler, so a crash in torch's import is named
    from extensible_kv.boundaries import factories
    from extensible_kv.errors import DriverLoadError, DriverUnavailable

    if ":" not in spec:
        if spec not in drivers.registered():
            raise _BadSpec(f"unknown driver {spec!r}; registered: {', '.join(drivers.registered())}")
        try:
            driver = drivers.get_driver(spec)
        except (DriverUnavailable, DriverLoadError) as exc:
            raise _Unbuildable(str(exc)) from None
        except Exception as exc:
            raise _Unbuildable(f"building it raised {type(exc).__name__}: {exc}") from None
    else:
        module_name, _, attr = spec.partition(":")
        try:
            found = importlib.util.find_spec(module_name)
        except ImportError as exc:  # a parent package that does not exist
            raise _BadSpec(f"driver spec {spec!r}: no module named {exc.name or module_name!r}") from None
        except Exception as exc:  # a parent package that raised on import
            raise _Unbuildable(
                f"importing {module_name.rpartition('.')[0]} raised {type(exc).__name__}: {exc}"
            ) from None
        if found is None:
            raise _BadSpec(f"driver spec {spec!r}: no module named {module_name!r}")
        try:
            module = importlib.import_module(module_name)
        except BaseException as exc:  # its code: SystemExit and KeyboardInterrupt are its failures too
            raise _Unbuildable(f"importing {module_name} raised {type(exc).__name__}: {exc}") from None
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise _BadSpec(f"driver spec {spec!r}: module {module_name} has no callable {attr!r}")
        try:
            built = factory()
        except BaseException as exc:
            raise _Unbuildable(f"its factory raised {type(exc).__name__}: {exc}") from None
        try:  # judged as an object, never read as a spec (Note [A factory's result is judged as an object])
            driver = factories.judge(built, f"driver spec {spec!r}: its factory")
        except factories.NotADriver as exc:
            raise _BadSpec(str(exc)) from None
    try:
        return {
            "name": str(driver.name),
            "type": type(driver).__qualname__,
            "device": str(driver.device),
            "granularity": int(driver.granularity()),
        }
    except BaseException as exc:
        raise _Unbuildable(
            f"the built driver's name, device or granularity() raised {type(exc).__name__}: {exc}"
        ) from None


def _one_line(text: str) -> str:
    """``text`` as one line of a message: blanks folded, every character that is not printable escaped (a
    factory's exception reaches the terminal with no escape sequence of its own)."""
    return escaped(" ".join(text.split()))


def _say(status: str, **payload: object) -> None:
    try:
        sys.stdout.flush()
    except Exception:  # a stdout the factory closed, replaced or set to None: the line below does not need it
        pass
    # to file descriptor 1 itself (the factory may have replaced sys.stdout), on a line of its own (whatever the
    # factory wrote before it without a newline)
    line = "\n" + PREFIX + json.dumps({"status": status, **payload}) + "\n"
    try:
        os.write(1, line.encode())
    except OSError:  # descriptor 1 closed: the parent reads no status and says so
        pass


def _become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``), so that a helper
    the factory detached stays a descendant that ``factories.left_running`` finds; whether it took."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def main(argv: list[str]) -> int:
    """The child: build ``argv[0]`` and say how it went (exit 0, 2 for a bad spec, 1 for a driver not built). A
    factory that returned but left a non-daemon thread or a process running is not built, and what it left is named
    and ended (Note [A factory's result is judged as an object])."""
    faulthandler.enable()  # a crash while building names the frame it happened in, on stderr
    if len(argv) != 1:
        _say("bad-spec", message=f"the preflight takes one driver spec, got {argv!r}")
        return 2
    threads_before = {t.ident for t in threading.enumerate()}
    _become_subreaper()  # a helper the factory detaches (a double fork, setsid) stays ours to find and end
    try:
        status, code, payload = "ok", 0, {"facts": _build(argv[0])}
    except _BadSpec as exc:
        status, code, payload = "bad-spec", 2, {"message": _one_line(str(exc))}
    except _Unbuildable as exc:
        status, code, payload = "unbuildable", 1, {"message": _one_line(str(exc))}
    if "extensible_kv.boundaries.factories" in sys.modules:  # imported by _build once the driver's code could run
        factories = sys.modules["extensible_kv.boundaries.factories"]
        threads, processes = factories.left_running(threads_before)
        if (threads or processes) and status == "ok":
            status, code, payload = "unbuildable", 1, {"message": factories.leftovers_message(threads, processes)}
        factories.end(processes)
    _say(status, **payload)
    return code


def _crash_frame(stderr: str) -> str:
    """The innermost frame of the faulthandler dump in ``stderr`` (most recent call first) outside Python's own
    library (the factory's line, not ctypes'), else the innermost one; '' without a dump. The crashing thread's
    section ("Current thread ...") where the dump has one: other threads are dumped before it."""
    stdlib = sysconfig.get_paths()["stdlib"]
    lines = stderr.split("\n")
    current = [i for i, line in enumerate(lines) if line.startswith("Current thread ")]
    if current:
        lines = lines[current[-1] + 1 :]
        lines = lines[: next((i for i, line in enumerate(lines) if not line.startswith(" ")), len(lines))]
    frames = [m for m in (re.match(r'\s*File "(.+)", line (\d+) in (\S+)', line) for line in lines) if m]
    frame = next((m for m in frames if not m[1].startswith(stdlib)), frames[0] if frames else None)
    return f" in {named(frame[3])} ({named(frame[1])}:{frame[2]})" if frame else ""


def run(spec: str, *, timeout: float, env: Mapping[str, str], package: str) -> Outcome:
    """Run the preflight of ``spec`` in a child (``python -m {package}.preflight``) for at most ``timeout`` seconds
    (0: no limit)."""
    done = process_group.run(
        [sys.executable, "-m", f"{package}.preflight", spec], env=env, timeout=timeout or None, capture=True
    )
    if done.timed_out:
        return Outcome(
            "unbuildable", f"building it did not finish within {timeout:g} s (--build-timeout; the process was killed)"
        )
    said = [line[len(PREFIX) :] for line in done.stdout.splitlines() if line.startswith(PREFIX)]
    if said:
        try:
            answer = json.loads(said[-1])
        except ValueError:
            answer = {}
        status = answer.get("status")
        if status in EXIT_STATUS and done.returncode == EXIT_STATUS[status]:  # a line the exit contradicts is not
            return Outcome(status, str(answer.get("message", "")), dict(answer.get("facts") or {}))  # the child's
    code = done.returncode or 0
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return Outcome("unbuildable", f"building it ended the process with {name}{_crash_frame(done.stderr)}")
    last = next((line.strip() for line in reversed(done.stderr.split("\n")) if line.strip()), "")
    return Outcome(
        "unbuildable",
        f"building it ended the process with exit status {code} before it said how it went "
        f"({'stderr: ' + shown(last, 200) if last else 'no output on stderr'})",
    )


if __name__ == "__main__":
    status = main(sys.argv[1:])
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a stream the factory closed, replaced or set to None
            pass
    os._exit(status)  # a non-daemon thread the driver's code left running does not hold the process (it was named)
