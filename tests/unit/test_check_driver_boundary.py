"""``extensible-kv check-driver`` against drivers that misbehave while being built or while a rule runs: the command
never imports the driver's module itself (nor does pytest's controller), every build and rule has a time limit, a
driver that cannot be built is one message and a summary, and ending the command ends every process it started.

Each case runs the command line in a child of its own session, killed as a group if the case's limit passes, so a
regression shows as a failure here and leaves nothing running. The factories are in ``_hostile_factories.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FACTORIES = "tests.unit._hostile_factories"
IMPORTED_BY = "HOSTILE_FACTORIES_IMPORTED_BY"  # _hostile_factories.IMPORTED_BY (tests do not import each other)
TWO_RULES = "test_zero_sets_exactly_the_range or test_reserve_is_aligned_and_not_accessible"
LIMIT_S = 240  # per command; the slowest case here takes about 30 s on a 2-core machine
TITLE = "extensible-kv conformance summary"


def _env(markers: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXTENSIBLE_KV_", "PYTEST_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "reference"), str(ROOT)])
    if markers is not None:
        env[IMPORTED_BY] = str(markers)
    return env


def _signals_at_their_default() -> None:
    """In the child before exec: SIGINT and SIGTERM at their default action, as in a terminal's foreground command. A
    shell without job control starts a background command with SIGINT ignored, and a process inherits that (and
    Python keeps it): a test run started that way would otherwise start check-driver deaf to Ctrl-C, as its user
    asked, and the SIGINT case would wait out the rule's limit."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _start(*args: str, markers: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "extensible_kv", "check-driver", *args],
        cwd=ROOT,
        env=_env(markers),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_signals_at_their_default,
    )


def _finish(proc: subprocess.Popen, what: str, limit_s: float = LIMIT_S) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{what}: expected it to end within {limit_s} s, it did not (killed)\n{(out + err)[-3000:]}")
    return proc.returncode, out, err


def _importers(markers: Path) -> dict[int, int]:
    """pid -> parent pid of every process that imported the factories' module."""
    return {int(p.name): int(p.read_text() or 0) for p in markers.iterdir()}


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, ended and waiting to be reaped, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.mark.parametrize(
    ("factory", "options", "words"),
    [
        ("segfault", [], ["ended the process with SIGSEGV", "in segfault"]),
        ("hang", ["--build-timeout", "2"], ["did not finish within 2 s", "--build-timeout"]),
    ],
    ids=["segfaults", "hangs"],
)
def test_a_driver_that_cannot_be_built_is_one_line_a_summary_and_exit_1(factory, options, words):
    spec = f"{FACTORIES}:{factory}"
    code, out, err = _finish(_start(spec, *options), f"check-driver {spec}")
    lines = err.splitlines()
    got = {
        "exit": code,
        "stderr lines": len(lines),
        "names why": all(w in err for w in words),
        "summary": TITLE in out and spec in out,
        "pytest ran": "test session starts" in out,
    }
    want = {"exit": 1, "stderr lines": 1, "names why": True, "summary": True, "pytest ran": False}
    assert got == want, f"check-driver {spec} {' '.join(options)}: expected {want}, got {got}\n{out[-2000:]}{err}"


def test_a_hung_rule_fails_naming_its_limit_and_no_controller_imports_the_driver(tmp_path):
    spec = f"{FACTORIES}:hang_in_zero"
    proc = _start(spec, "--rule-timeout", "3", "-k", TWO_RULES, markers=tmp_path)
    code, out, err = _finish(proc, f"check-driver {spec} --rule-timeout 3")
    importers = _importers(tmp_path)
    parents = set(importers.values())  # the command (parent of the preflight) and pytest's controller (of workers)
    got = {
        "exit": code,
        "names the limit": "ran past --rule-timeout=3 s" in out,
        "the other rule passed": "1 failed, 1 passed" in out,
        "summary": TITLE in out,
        "imported in a child and a worker": len(importers) >= 2,
        "imported by a parent": sorted(parents & set(importers)),
    }
    want = {
        "exit": 1,
        "names the limit": True,
        "the other rule passed": True,
        "summary": True,
        "imported in a child and a worker": True,
        "imported by a parent": [],
    }
    assert got == want, (
        f"check-driver {spec} --rule-timeout 3 (command pid {proc.pid}, importers pid -> parent "
        f"{importers}): expected {want}, got {got}\n{(out + err)[-3000:]}"
    )


@pytest.mark.parametrize(
    ("sig", "status"), [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"]
)
def test_a_signal_to_check_driver_ends_every_process_it_started(tmp_path, sig, status):
    spec = f"{FACTORIES}:hang_in_zero"
    proc = _start(spec, "-k", "test_zero_sets_exactly_the_range", markers=tmp_path)
    deadline = time.monotonic() + LIMIT_S
    while not any(parent != proc.pid for parent in _importers(tmp_path).values()):  # a worker has the driver
        if time.monotonic() > deadline or proc.poll() is not None:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(
                f"check-driver {spec}: no worker imported the driver within {LIMIT_S} s (exit "
                f"{proc.poll()})\n{proc.communicate()[1][-2000:]}"
            )
        time.sleep(0.5)
    os.kill(proc.pid, sig)  # the command alone, as `kill` or a terminal's Ctrl-C reaching its process does
    code, out, err = _finish(proc, f"check-driver {spec} after {sig.name}", limit_s=60)
    started = {pid for pair in _importers(tmp_path).items() for pid in pair} - {proc.pid}
    end = time.monotonic() + 10  # a killed process's parent may take a moment to reap it
    while any(_running(p) for p in started) and time.monotonic() < end:
        time.sleep(0.2)
    left = sorted(p for p in started if _running(p))
    for pid in left:  # leave nothing behind, whatever the result
        os.kill(pid, signal.SIGKILL)
    got = {"exit": code, "left running": left}
    want = {"exit": status, "left running": []}
    assert got == want, (
        f"{sig.name} to check-driver {spec} (pid {proc.pid}; preflight, controller and workers "
        f"{sorted(started)}): expected {want}, got {got}\n{(out + err)[-2000:]}"
    )


# Note [A factory's result is judged as an object]: before, a factory that returned None or "host" read as a spec and
# "built HostDriver 'host'", and one that left a thread or a process running read as "did not finish within 60 s".
NOT_A_DRIVER = {
    "returns_none": "returned None, not a driver object",
    "returns_host": "returned str 'host', not a driver object",
    "returns_a_module": "not a driver: it lacks the protocol's granularity",
}


@pytest.mark.parametrize(("factory", "words"), NOT_A_DRIVER.items(), ids=NOT_A_DRIVER.keys())
def test_a_factory_that_returns_no_driver_object_is_one_line_and_exit_2(factory, words):
    spec = f"{FACTORIES}:{factory}"
    code, out, err = _finish(_start(spec, "--build-timeout", "30"), f"check-driver {spec}", limit_s=120)
    lines = err.splitlines()
    head = f"error: driver spec {spec!r}: its factory returned "
    got = {"exit": code, "one line naming it": len(lines) == 1 and lines[0].startswith(head) and words in lines[0]}
    want = {"exit": 2, "one line naming it": True}
    assert got == want and not out, f"check-driver {spec}: expected {want} and no output, got {got}\n{out}{err}"


LEFT_RUNNING = {
    "leaves_a_thread": "non-daemon thread 'factory-helper'",
    "leaves_a_process": "process ",
    "detaches_a_process": "process ",
}


@pytest.mark.parametrize(("factory", "words"), LEFT_RUNNING.items(), ids=LEFT_RUNNING.keys())
def test_a_factory_that_leaves_helpers_running_is_named_at_once_and_they_are_ended(factory, words):
    spec = f"{FACTORIES}:{factory}"
    start = time.monotonic()
    proc = _start(spec, "--build-timeout", "60")
    code, out, err = _finish(proc, f"check-driver {spec}", limit_s=120)
    took = time.monotonic() - start
    left = [p.name for p in Path("/proc").glob("[0-9]*") if _running(int(p.name)) and _sleeps_an_hour(p)]
    for pid in left:  # leave nothing behind, whatever the result
        os.kill(int(pid), signal.SIGKILL)
    lines = err.splitlines()
    got = {
        "exit": code,
        "one line naming it": len(lines) == 1 and "left running" in lines[0] and words in lines[0],
        "read as a timeout": "did not finish" in err,
        "within the build limit": took < 60,
        "left running": left,
    }
    want = {
        "exit": 1,
        "one line naming it": True,
        "read as a timeout": False,
        "within the build limit": True,
        "left running": [],
    }
    assert got == want, f"check-driver {spec} (took {took:.1f} s): expected {want}, got {got}\n{err}{out[-1500:]}"


def _sleeps_an_hour(proc: Path) -> bool:
    try:
        return b"time.sleep(3600)" in (proc / "cmdline").read_bytes()
    except OSError:
        return False


def test_a_factory_that_floods_stdout_without_a_newline_is_still_built():
    from conformance import preflight

    got = preflight.run(f"{FACTORIES}:floods_stdout", timeout=60, env=dict(os.environ), package="conformance")
    assert got.status == "ok", f"preflight of {FACTORIES}:floods_stdout: expected ok, got {got}"


def test_what_a_dead_factory_left_on_stderr_is_shown_escaped_on_one_line():
    from conformance import preflight

    got = preflight.run(f"{FACTORIES}:exits_with_escapes", timeout=60, env=dict(os.environ), package="conformance")
    message = got.message
    assert got.status == "unbuildable" and "exit status 3" in message, got
    assert "\x1b" not in message and "\r" not in message and "\\x1b[31mred" in message, (
        f"preflight of {FACTORIES}:exits_with_escapes: expected the escape sequence shown escaped, got {message!r}"
    )


def test_a_factory_that_redirects_sys_stdout_is_still_built():
    from conformance import preflight

    got = preflight.run(f"{FACTORIES}:silences_stdout", timeout=60, env=dict(os.environ), package="conformance")
    assert got.status == "ok", f"preflight of {FACTORIES}:silences_stdout: expected ok, got {got}"


def test_a_status_line_that_the_exit_status_contradicts_is_not_believed():
    from conformance import preflight

    got = preflight.run(f"{FACTORIES}:says_ok_then_fails", timeout=60, env=dict(os.environ), package="conformance")
    assert got.status == "unbuildable" and "exit status 1" in got.message, (
        f"preflight of {FACTORIES}:says_ok_then_fails (a status line of the factory's, then exit 1): expected "
        f"unbuildable naming the exit status, got {got}"
    )


def test_the_crash_frame_of_a_dead_factory_is_shown_escaped():
    from conformance import preflight

    spec = f"{FACTORIES}:crashes_after_an_escaped_frame"
    got = preflight.run(spec, timeout=60, env=dict(os.environ), package="conformance")
    assert got.status == "unbuildable" and "SIGSEGV" in got.message and "\x1b" not in got.message, (
        f"preflight of {spec}: expected SIGSEGV named and no raw escape in {got.message!r}"
    )


def test_a_factory_that_sets_sys_stdout_to_none_is_still_built():
    from conformance import preflight

    got = preflight.run(f"{FACTORIES}:sets_stdout_to_none", timeout=60, env=dict(os.environ), package="conformance")
    assert got.status == "ok", f"preflight of {FACTORIES}:sets_stdout_to_none: expected ok, got {got}"


def test_the_crash_frame_is_the_crashing_threads_not_another_threads():
    from conformance import preflight

    spec = f"{FACTORIES}:crashes_beside_a_thread"
    got = preflight.run(spec, timeout=60, env=dict(os.environ), package="conformance")
    assert "in crashes_beside_a_thread" in got.message and "_idle" not in got.message, (
        f"preflight of {spec}: expected the crashing thread's frame, got {got.message!r}"
    )


def test_a_helper_that_left_the_session_holding_the_output_is_named_without_holding_the_preflight(tmp_path):
    from conformance import preflight

    pid_file = tmp_path / "detached.pid"
    env = {**os.environ, "HOSTILE_FACTORIES_DETACHED_PID_FILE": str(pid_file)}
    start = time.monotonic()
    try:
        got = preflight.run(f"{FACTORIES}:leaves_a_detached_helper", timeout=20, env=env, package="conformance")
        waited = time.monotonic() - start
    finally:
        deadline = time.monotonic() + 5
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert got.status == "unbuildable" and "left running process" in got.message and waited < 20, (
        f"preflight of a factory that built a driver and left a helper of its own session holding the output: "
        f"expected unbuildable naming the process left running, without waiting for it, got {got} after "
        f"{waited:.1f} s"
    )


def test_a_factorys_exception_is_shown_with_its_escape_sequences_escaped():
    from conformance import preflight

    got = preflight.run(f"{FACTORIES}:raises_escapes", timeout=60, env=dict(os.environ), package="conformance")
    assert "\x1b" not in got.message and "\x07" not in got.message and "\\x1b[31mred" in got.message, (
        f"preflight of {FACTORIES}:raises_escapes: expected the escapes shown escaped, got {got.message!r}"
    )
