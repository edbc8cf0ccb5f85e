"""Time limits in pytest-xdist workers: ``--build-timeout`` for building a driver, ``--rule-timeout`` for each rule.

Note [A hung rule ends its worker]
    A driver can hang in C code that holds the GIL, so a Python timer thread may never run; ``faulthandler``'s
    watchdog is a C thread that needs no GIL. In a worker each rule (setup, call, leak guard) and each build runs
    under ``faulthandler.dump_traceback_later(exit=True)``: past its limit the stacks are written to a file of this
    worker and the process exits. pytest-xdist reports the rule the worker was running as crashed and starts a fresh
    worker for the rest; the controller finds the file (its folder is handed to each worker in ``workerinput``) and
    rewrites that report to name the limit, with the stacks. The limits apply only in workers: where the rules run
    in pytest's own process there is nothing to restart, and a long run such as ``nox -s stress`` is not cut short.
    The first line written before arming says what is being timed; the dump follows it only if the limit passed.
"""

from __future__ import annotations

import faulthandler
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest

from ..limits import BUILD_TIMEOUT_S, RULE_TIMEOUT_S, seconds

WORKER_INPUT = "extensible_kv_watchdog"  # workerinput key: the folder the workers' watchdog files go to
_FIRED = "Timeout ("  # how faulthandler's dump begins


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("extensible-kv")
    group.addoption(
        "--build-timeout",
        type=seconds,
        default=BUILD_TIMEOUT_S,
        help=f"seconds a driver's build (its module's import and its factory) may take, in check-driver's "
        f"preflight and in each pytest-xdist worker (default {BUILD_TIMEOUT_S:g}; 0: no limit)",
    )
    group.addoption(
        "--rule-timeout",
        type=seconds,
        default=RULE_TIMEOUT_S,
        help=f"seconds each rule may take in a pytest-xdist worker before the worker is ended and the rule "
        f"fails (default {RULE_TIMEOUT_S:g}; 0: no limit)",
    )


class Watchdog:
    """The worker's limits: a stack of (what is timed, deadline); the earliest deadline is armed."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("w", encoding="utf-8")
        self.stack: list[tuple[str, float]] = []

    def _arm(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        if not self.stack:
            return
        what, deadline = min(self.stack, key=lambda entry: entry[1])
        self.file.seek(0)
        self.file.truncate()
        self.file.write(what + "\n")
        self.file.flush()
        faulthandler.dump_traceback_later(max(deadline - time.monotonic(), 0.001), exit=True, file=self.file)

    @contextmanager
    def limit(self, what: str, limit_s: float) -> Iterator[None]:
        """Run the block within ``limit_s`` seconds (0: no limit of its own); ``what`` names it if it runs past."""
        if not limit_s:
            yield
            return
        entry = (what, time.monotonic() + limit_s)
        self.stack.append(entry)
        self._arm()
        try:
            yield
        finally:
            self.stack.remove(entry)
            self._arm()

    def close(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        self.file.close()


WATCHDOG = pytest.StashKey[Watchdog]()
FOLDER = pytest.StashKey[Path]()


def limit(config: pytest.Config, what: str, limit_s: float):
    """``Watchdog.limit`` in a worker; elsewhere a block without a limit."""
    dog = config.stash.get(WATCHDOG, None)
    return dog.limit(what, limit_s) if dog is not None else nullcontext()


def is_controller(config: pytest.Config) -> bool:
    """Whether this process hands the rules to pytest-xdist workers and runs none itself."""
    return not hasattr(config, "workerinput") and config.pluginmanager.has_plugin("dsession")


def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and workerinput.get(WORKER_INPUT):
        path = Path(workerinput[WORKER_INPUT]) / f"{workerinput.get('workerid', 'worker')}.txt"
        config.stash[WATCHDOG] = Watchdog(path)


def pytest_unconfigure(config: pytest.Config) -> None:
    dog = config.stash.get(WATCHDOG, None)
    if dog is not None:
        dog.close()
    folder = config.stash.get(FOLDER, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """In the controller, before each worker starts: the folder its watchdog writes to."""
    stash = node.config.stash
    if FOLDER not in stash:
        stash[FOLDER] = Path(tempfile.mkdtemp(prefix="extensible-kv-watchdog-"))
    node.workerinput[WORKER_INPUT] = str(stash[FOLDER])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    spec = getattr(getattr(item, "callspec", None), "params", {}).get("driver_spec")
    limit_s = item.config.getoption("rule_timeout", default=0) if spec is not None else 0
    with limit(item.config, f"{item.nodeid} ran past --rule-timeout={limit_s:g} s on driver {spec}", limit_s):
        yield


@pytest.hookimpl(tryfirst=True)  # before the terminal and the summary read the report
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A worker crash whose watchdog fired: the report names the limit, and the stacks it wrote."""
    node = getattr(report, "node", None)
    folder = getattr(getattr(node, "config", None), "stash", {}).get(FOLDER, None) if node is not None else None
    if folder is None or not report.failed or not isinstance(report.longrepr, str):
        return
    worker = getattr(getattr(node, "gateway", None), "id", None)
    path = folder / f"{worker}.txt"
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return
    what, _, dump = text.partition("\n")
    if dump.startswith(_FIRED):
        report.longrepr = f"{what}: its worker ({worker}) was ended and replaced; its stacks then:\n{_innermost(dump)}"
        path.unlink(missing_ok=True)


def _innermost(dump: str, frames: int = 8) -> str:
    """faulthandler's dump with each thread cut to its ``frames`` innermost frames (it lists them first)."""
    out, kept = [], 0
    for line in dump.splitlines():
        if not line.startswith("  "):  # "Timeout (...)!", "Thread 0x... (most recent call first):", blank lines
            out.append(line)
            kept = 0
        elif kept < frames:
            out.append(line)
            kept += 1
        elif kept == frames:
            out.append("  ...")
            kept += 1
    return "\n".join(out)
