"""The end-of-run summary: per driver, the rules passed, failed and skipped, the granularity and the commit
throughput, as a table in the terminal and, with ``--summary-json``, as JSON for the report.

Each rule's report carries its driver spec (a user property), so the summary also works where the tests ran in
pytest-xdist workers (crash isolation: a driver that faults kills a worker, fails that rule, and the run goes on).
There the figures come from the workers too: each measures the drivers it built as its session ends (within
``--rule-timeout``) and hands them back in ``workeroutput``; the controller builds nothing (Note [Who builds the
driver under test] in ``preflight``), and a figure no worker lived to measure reads "-".
The outcomes are kept by a ``Summary`` object registered for the run and stashed on the config.
"""

from __future__ import annotations

import time

import pytest
import torch

import extensible_kv

from .. import table
from ..limits import probe_bytes, summary_outputs
from .selection import build, selection
from .watchdog import is_controller, limit

_DRIVER_PROPERTY = "extensible_kv_driver"
_FIGURES = "extensible_kv_figures"  # workeroutput key: spec -> the figures a worker measured


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("extensible-kv")
    group.addoption(
        "--summary-json",
        action="store",
        default=None,
        help="write the per-driver summary (tests, granularity, commit throughput) to this JSON file",
    )
    group.addoption(
        "--commit-probe-bytes",
        action="store",
        type=probe_bytes,
        default=None,
        help="bytes to commit once per driver for the summary's throughput figure, from 1 to 2**47 "
        "(default: 8 GiB on GPUs, 256 MiB on the host)",
    )


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--summary-json", default=None)
    if path and not hasattr(config, "workerinput"):  # checked before any rule runs, not after every rule ran
        from extensible_kv.boundaries import BoundaryError

        try:
            summary_outputs(path)
        except BoundaryError as exc:
            raise pytest.UsageError(str(exc)) from None
    summary = Summary(config)
    config.stash[SUMMARY] = summary
    config.pluginmanager.register(summary, f"{__name__}.collector")


def pytest_unconfigure(config: pytest.Config) -> None:
    summary = config.stash.get(SUMMARY, None)
    if summary is not None and config.pluginmanager.is_registered(summary):
        config.pluginmanager.unregister(summary)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "driver_spec" in params:
            item.user_properties.append((_DRIVER_PROPERTY, params["driver_spec"]))


def _commit_throughput(driver: object, nbytes: int) -> float:
    """GB/s of one growth step of ``nbytes`` (zero_new=False), timed once with the device synchronized."""
    g = driver.granularity()
    nbytes = max(-(-nbytes // g) * g, g)
    t = extensible_kv.ExtensibleTensor(nbytes, driver=driver)
    try:
        driver.synchronize()
        start = time.perf_counter()
        t.resize_per_segment_(nbytes, zero_new=False)
        driver.synchronize()
        elapsed = time.perf_counter() - start
    finally:
        t.close(force=True)
    return nbytes / elapsed / 1e9


def _figures(config: pytest.Config, spec: str) -> dict:
    """The summary's figures of the driver this process built for ``spec``: its granularity and one timed commit,
    or why it could not be built; nothing when it was never built here."""
    built = selection(config).built.get(spec)
    if built is None:
        return {}
    if isinstance(built, str):
        return {"unavailable": built}
    probe_bytes = config.getoption("--commit-probe-bytes") or (8 << 30 if built.device.type == "cuda" else 256 << 20)
    limit_s = config.getoption("rule_timeout", default=0)
    figures: dict = {}
    try:  # a driver that failed its rules may fail here too: the table then shows what could be measured
        with limit(
            config, f"the summary's commit probe on driver {spec} ran past --rule-timeout={limit_s:g} s", limit_s
        ):
            figures["granularity"] = built.granularity()
            rate = _commit_throughput(built, probe_bytes)
    except Exception:  # the rules report the driver's faults; the summary shows "-"
        return figures
    return {**figures, "commit_bytes": probe_bytes, "commit_gb_per_s": round(rate, 2)}


class Summary:
    """The outcome of each rule per driver in this run, and the table and JSON made from them at its end."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.outcomes: dict[tuple[str, str], str] = {}  # (driver spec, nodeid) -> passed / failed / skipped
        self.reasons: dict[tuple[str, str], str] = {}  # (driver spec, nodeid) -> why it was skipped
        self.figures: dict[str, dict] = {}  # driver spec -> figures a pytest-xdist worker measured (the last one)
        self.session: pytest.Session | None = None

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        self.figures.update((getattr(node, "workeroutput", None) or {}).get(_FIGURES, {}))

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.session = session

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        maxfail = getattr(session.config.option, "maxfail", 0) or 0
        failed = sum(outcome == "failed" for outcome in self.outcomes.values())
        if session.exitstatus == pytest.ExitCode.INTERRUPTED and maxfail and failed >= maxfail:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED  # -x stopped a run that failed: 1, as without it
        output = getattr(session.config, "workeroutput", None)
        if output is not None:  # a pytest-xdist worker: its figures go back to the controller
            output[_FIGURES] = {
                spec: _figures(session.config, spec)
                for spec in selection(session.config).specs
                if spec in selection(session.config).built
            }

    def _spec_of(self, report: pytest.TestReport) -> str | None:
        for key, value in getattr(report, "user_properties", ()):
            if key == _DRIVER_PROPERTY:
                return value
        if report.failed and "[" in report.nodeid:  # a crashed xdist worker's report carries no properties
            params = report.nodeid.rpartition("[")[2].rstrip("]")
            specs = sorted(selection(self.config).specs, key=len, reverse=True)  # 'host-4k' before 'host'
            return next((s for s in specs if params == s or params.startswith(s + "-")), None)
        return None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        spec = self._spec_of(report)
        if spec is None:
            return
        key = (spec, report.nodeid)
        if report.failed:
            self.outcomes[key] = "failed"
        elif report.when == "call" or (report.when == "setup" and report.skipped):
            self.outcomes.setdefault(key, report.outcome)
            if report.skipped and isinstance(report.longrepr, tuple):  # (file, line, "Skipped: reason")
                self.reasons.setdefault(key, str(report.longrepr[2]).removeprefix("Skipped: "))

    def pytest_terminal_summary(self, terminalreporter, exitstatus: int, config: pytest.Config) -> None:
        sel = selection(config)
        outcomes = self.outcomes
        controller = is_controller(config)
        rows = []
        for spec in sel.specs:
            counts = {"passed": 0, "failed": 0, "skipped": 0}
            for (s, _), outcome in outcomes.items():
                if s == spec:
                    counts[outcome] = counts.get(outcome, 0) + 1
            if controller:  # measured by the workers; this process never builds the driver
                figures = self.figures.get(spec, {})
            elif sum(counts.values()):
                build(config, spec)
                figures = _figures(config, spec)
            else:
                built = sel.built.get(spec)
                figures = {"unavailable": built} if isinstance(built, str) else {}
            rows.append(table.row(spec, **counts, **figures))
        if not any(sum(r[k] for k in ("passed", "failed", "skipped")) for r in rows):
            return
        tr = terminalreporter
        tr.section(table.TITLE)
        for line in table.lines(rows):
            tr.write_line(line)
        path = config.getoption("--summary-json")
        if path:
            self._write(terminalreporter, path, exitstatus, rows, outcomes)

    def _write(self, terminalreporter, path: str, exitstatus: int, rows: list, outcomes: dict) -> None:
        """``--summary-json`` and the ``environment.json`` beside it (checked writable at the start); a write that
        fails all the same (a full disk) is one line, and the run's status says so."""
        from extensible_kv import record  # plain JSON; the lab's ConformanceSummary reads it
        from extensible_kv.boundaries import BoundaryError

        try:
            summary, environment = summary_outputs(path)
            record.write(
                summary,
                {
                    "exitstatus": int(exitstatus),
                    "torch": torch.__version__,
                    "drivers": rows,
                    "tests": [
                        {"driver": s, "test": n, "outcome": o, "reason": self.reasons.get((s, n))}
                        for (s, n), o in sorted(outcomes.items())
                    ],
                },
            )
            record.write(environment, record.environment())
        except (OSError, BoundaryError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            terminalreporter.write_line(f"error: --summary-json {path}: cannot be written ({reason})", red=True)
            if self.session is not None and self.session.exitstatus == 0:
                self.session.exitstatus = pytest.ExitCode.USAGE_ERROR


SUMMARY = pytest.StashKey[Summary]()
