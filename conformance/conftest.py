"""Driver selection, the leak guard, and the end-of-run summary for the conformance suite.

``--driver host,cuda,pkg.module:factory`` picks the drivers; without it every registered driver runs. A driver
picked by default that cannot run here is skipped with its probe's reason; a driver named explicitly that cannot
run fails. Every test that takes the ``driver`` fixture gets the driver wrapped in a fresh ``Ledger``; after the
test, anything the test left reserved, held or mapped fails it.
"""

from __future__ import annotations

import gc
import os
import platform
import time
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import Phase, settings

import extensible_kv
from extensible_kv import drivers
from extensible_kv.errors import DriverLoadError, DriverUnavailable

REQUIRE_GPU_ENV = "EXTENSIBLE_KV_REQUIRE_GPU"

# Hypothesis profiles: "default" for the suite, "meta" when the meta-tests re-run the suite many times.
settings.register_profile("default", max_examples=25)
settings.register_profile("meta", max_examples=5, phases=[Phase.explicit, Phase.generate], database=None,
                          derandomize=True)
settings.load_profile("default")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("extensible-kv")
    group.addoption("--driver", action="store", default=None,
                    help="comma-separated drivers to test: registered names (host, host-4k, cuda) or "
                         "module:factory; default: every registered driver, skipping those that cannot run here")
    group.addoption("--summary-json", action="store", default=None,
                    help="write the per-driver summary (tests, granularity, commit throughput) to this JSON file")
    group.addoption("--commit-probe-bytes", action="store", type=int, default=None,
                    help="bytes to commit once per driver for the summary's throughput figure "
                         "(default: 8 GiB on GPUs, 256 MiB on the host)")


@dataclass
class _Selection:
    specs: list[str]
    explicit: bool
    built: dict[str, object] = field(default_factory=dict)  # spec -> driver or the reason it is unavailable


def pytest_configure(config: pytest.Config) -> None:
    raw = config.getoption("--driver")
    if raw:
        specs = [s.strip() for s in raw.split(",") if s.strip()]
        config._ekv = _Selection(specs, explicit=True)
    else:
        config._ekv = _Selection(drivers.registered(), explicit=False)
    _configured_specs[:] = sorted(config._ekv.specs, key=len, reverse=True)


def _selection(config: pytest.Config) -> _Selection:
    return config._ekv  # type: ignore[attr-defined]


def _build(config: pytest.Config, spec: str) -> object:
    """The driver for ``spec`` (built once per session), or the reason it cannot be built: unavailable here, a
    spec that does not load, or a factory that raised or returned something that is not a driver."""
    sel = _selection(config)
    if spec not in sel.built:
        try:
            sel.built[spec] = drivers.get_driver(spec)
        except (DriverUnavailable, DriverLoadError) as exc:
            sel.built[spec] = str(exc)
        except Exception as exc:  # the factory itself failed
            sel.built[spec] = f"driver {spec!r}: its factory raised {type(exc).__name__}: {exc}"
    return sel.built[spec]


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get(REQUIRE_GPU_ENV) == "1" and drivers.best_available() == "host":
        reasons = "; ".join(f"{n}: {drivers.probe(n)}" for n in drivers.registered() if not n.startswith("host"))
        raise pytest.UsageError(f"{REQUIRE_GPU_ENV}=1 but no GPU driver can run here ({reasons})")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "driver" in metafunc.fixturenames:
        specs = _selection(metafunc.config).specs
        metafunc.parametrize("driver_spec", specs, ids=specs, scope="session")


def pytest_report_header(config: pytest.Config) -> list[str]:
    sel = _selection(config)
    lines = [f"extensible_kv {extensible_kv.__version__}, torch {torch.__version__}, python {platform.python_version()}"]
    for spec in sel.specs:
        if sel.explicit:  # built now, so a spec that does not load is named once, here
            built = _build(config, spec)
            reason = built if isinstance(built, str) else None
        else:
            reason = drivers.probe(spec)
        lines.append(f"driver {spec}: {'available' if reason is None else 'cannot run: ' + reason}"
                     f"{' (named explicitly: every rule errors)' if sel.explicit and reason else ''}")
    env = {k: v for k, v in os.environ.items() if k.startswith("EXTENSIBLE_KV_")}
    if env:
        lines.append("environment: " + ", ".join(f"{k}={v}" for k, v in sorted(env.items())))
    return lines


@pytest.fixture
def driver(request: pytest.FixtureRequest, driver_spec: str):
    """The driver under test, wrapped in a fresh Ledger; fails the test if anything leaked."""
    config = request.config
    built = _build(config, driver_spec)
    if isinstance(built, str):
        if _selection(config).explicit:
            pytest.fail(f"driver {driver_spec!r} was asked for but cannot run: {built}", pytrace=False)
        pytest.skip(built)
    marker = request.node.get_closest_marker("drivers")
    if marker and built.device.type not in marker.args:
        pytest.skip(f"rule applies to {'/'.join(marker.args)} drivers; {driver_spec} runs on {built.device.type}")
    ledger = drivers.Ledger(built)
    yield ledger
    gc.collect()
    left = ledger.outstanding()
    if left:
        pytest.fail(f"driver {driver_spec}: leak after the test: expected nothing outstanding, found "
                    f"{len(left.reservations)} reservation(s) {sorted(left.reservations.values())}, "
                    f"{left.handles} handle(s), {len(left.mappings)} mapping(s)", pytrace=False)


# -- summary -----------------------------------------------------------------------------------------------------
# Each rule's report carries its driver spec (a user property), so the summary also works where the tests ran in
# pytest-xdist workers (crash isolation: a driver that faults kills a worker, fails that rule, and the run goes on).
_DRIVER_PROPERTY = "extensible_kv_driver"
_outcomes: dict[tuple[str, str], str] = {}  # (driver spec, nodeid) -> passed / failed / skipped
_reasons: dict[tuple[str, str], str] = {}  # (driver spec, nodeid) -> why it was skipped


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "driver_spec" in params:
            item.user_properties.append((_DRIVER_PROPERTY, params["driver_spec"]))


def _spec_of(report: pytest.TestReport) -> str | None:
    for key, value in getattr(report, "user_properties", ()):
        if key == _DRIVER_PROPERTY:
            return value
    if report.failed and "[" in report.nodeid:  # a crashed xdist worker's report carries no properties
        params = report.nodeid.rpartition("[")[2].rstrip("]")
        return next((s for s in _configured_specs if params == s or params.startswith(s + "-")), None)
    return None


_configured_specs: list[str] = []  # longest first, so 'host-4k' is matched before 'host'


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    spec = _spec_of(report)
    if spec is None:
        return
    key = (spec, report.nodeid)
    if report.failed:
        _outcomes[key] = "failed"
    elif report.when == "call" or (report.when == "setup" and report.skipped):
        _outcomes.setdefault(key, report.outcome)
        if report.skipped and isinstance(report.longrepr, tuple):  # (file, line, "Skipped: reason")
            _reasons.setdefault(key, str(report.longrepr[2]).removeprefix("Skipped: "))


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


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    sel = _selection(config)
    rows = []
    for spec in sel.specs:
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        for (s, _), outcome in _outcomes.items():
            if s == spec:
                counts[outcome] = counts.get(outcome, 0) + 1
        built = _build(config, spec) if sum(counts.values()) else sel.built.get(spec)
        row = {"driver": spec, **counts, "granularity": None, "commit_gb_per_s": None, "commit_bytes": None,
               "unavailable": built if isinstance(built, str) else None}
        if built is not None and not isinstance(built, str) and sum(counts.values()):
            probe_bytes = config.getoption("--commit-probe-bytes") or \
                (8 << 30 if built.device.type == "cuda" else 256 << 20)
            row["granularity"] = built.granularity()
            row["commit_bytes"] = probe_bytes
            row["commit_gb_per_s"] = round(_commit_throughput(built, probe_bytes), 2)
        rows.append(row)
    if not any(sum(r[k] for k in ("passed", "failed", "skipped")) for r in rows):
        return
    tr = terminalreporter
    tr.section("extensible-kv conformance summary")
    tr.write_line(f"{'driver':<24} {'passed':>6} {'failed':>6} {'skipped':>7} {'granularity':>12} "
                  f"{'commit GB/s':>12}")
    for r in rows:
        gran = f"{r['granularity'] >> 10} KiB" if r["granularity"] else "-"
        rate = f"{r['commit_gb_per_s']:.1f}" if r["commit_gb_per_s"] is not None else "-"
        tr.write_line(f"{r['driver']:<24} {r['passed']:>6} {r['failed']:>6} {r['skipped']:>7} {gran:>12} "
                      f"{rate:>12}" + (f"   ({r['unavailable']})" if r["unavailable"] else ""))
    path = config.getoption("--summary-json")
    if path:
        from extensible_kv.measurements import ConformanceSummary, Environment, write  # noqa: PLC0415

        write(path, ConformanceSummary(
            exitstatus=int(exitstatus), torch=torch.__version__, drivers=rows,
            tests=[{"driver": s, "test": n, "outcome": o, "reason": _reasons.get((s, n))}
                   for (s, n), o in sorted(_outcomes.items())]))
        write(os.path.join(os.path.dirname(os.path.abspath(path)), "environment.json"), Environment.collect())
