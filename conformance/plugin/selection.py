"""Driver selection: ``--driver``, the ``driver`` fixture every rule takes, and the report header.

``--driver host,cuda,pkg.module:factory`` picks the drivers; without it every registered driver runs. A driver
picked by default that cannot run here is skipped with its probe's reason; a driver named explicitly that cannot
run fails. Every test that takes the ``driver`` fixture runs once per selected driver, on the driver wrapped in a
fresh ``Ledger``; after the test the leak guard (``leaks``) fails it if anything is left reserved, held or mapped.
Where the rules run in pytest-xdist workers, only the workers build a driver named by spec, each build within
``--build-timeout`` (``watchdog``): the controller never imports or calls it (Note [Who builds the driver under test]
in ``preflight``), and its header says so.
"""

from __future__ import annotations

import importlib.util
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import extensible_kv
from extensible_kv import drivers
from extensible_kv.errors import DriverLoadError, DriverUnavailable

from . import leaks, watchdog

REQUIRE_GPU_ENV = "EXTENSIBLE_KV_REQUIRE_GPU"
RULES = Path(__file__).resolve().parents[1]  # the folder of the rules this plugin came with

MARKER = "drivers(*kinds): run only for drivers whose device type is one of kinds (e.g. 'cuda')"


@dataclass
class Selection:
    specs: list[str]
    explicit: bool
    built: dict[str, object] = field(default_factory=dict)  # spec -> driver or the reason it is unavailable


SELECTION = pytest.StashKey[Selection]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("extensible-kv")
    group.addoption(
        "--driver",
        action="store",
        default=None,
        help="comma-separated drivers to test: registered names (host, host-4k, cuda) or "
        "module:factory; default: every registered driver, skipping those that cannot run here",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER)  # the rules' own, also where no ini file of this project is read


def selection(config: pytest.Config) -> Selection:
    """The drivers of this run, from ``--driver`` (made on first use, kept in the config's stash)."""
    if SELECTION not in config.stash:
        raw = config.getoption("driver", default=None)
        if raw:
            config.stash[SELECTION] = Selection([s.strip() for s in raw.split(",") if s.strip()], explicit=True)
        else:
            config.stash[SELECTION] = Selection(drivers.registered(), explicit=False)
    return config.stash[SELECTION]


def build(config: pytest.Config, spec: str) -> object:
    """The driver for ``spec`` (built once per session), or the reason it cannot be built: unavailable here, a
    spec that does not load, or a factory that raised or returned something that is not a driver."""
    sel = selection(config)
    if spec not in sel.built:
        limit_s = config.getoption("build_timeout", default=0)
        with watchdog.limit(config, f"building driver {spec!r} ran past --build-timeout={limit_s:g} s", limit_s):
            try:
                sel.built[spec] = drivers.get_driver(spec)
            except (DriverUnavailable, DriverLoadError) as exc:
                sel.built[spec] = str(exc)
            except Exception as exc:  # the factory itself failed
                sel.built[spec] = f"driver {spec!r}: its factory raised {type(exc).__name__}: {exc}"
    return sel.built[spec]


def retire(config: pytest.Config, spec: str, why: str) -> None:
    """The driver built for ``spec`` can be used no more (a rule left it waiting on its own lock): every later rule
    fails at once naming ``why`` (is skipped naming it, where ``--driver`` did not name the driver; the rule that
    retired it has failed), and the summary measures nothing on it."""
    selection(config).built[spec] = why


def asks_for_rules(config: pytest.Config) -> bool:
    """Whether this run is about the rules: ``--driver`` is given, or a path it collects holds or lies in the rules'
    folder (``pytest conformance``, ``pytest .`` in the checkout, ``pytest --pyargs extensible_kv_conformance``)."""
    if config.getoption("driver", default=None):
        return True
    base = Path(config.invocation_params.dir)
    for arg in config.args:
        path = _path_of(base, str(arg).split("::", 1)[0], config.getoption("pyargs", default=False))
        if path is not None and (path == RULES or RULES in path.parents or path in RULES.parents):
            return True
    return False


def _path_of(base: Path, arg: str, pyargs: bool) -> Path | None:
    """The file or folder a command-line path names; with ``--pyargs``, a module name is looked up."""
    path = (base / arg).resolve()
    if path.exists() or not pyargs:
        return path
    try:
        spec = importlib.util.find_spec(arg)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).resolve()
    return Path(spec.origin).resolve() if spec.origin else None


def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    if os.environ.get(REQUIRE_GPU_ENV) == "1" and asks_for_rules(config) and drivers.best_available() == "host":
        reasons = "; ".join(f"{n}: {drivers.probe(n)}" for n in drivers.registered() if not n.startswith("host"))
        raise pytest.UsageError(f"{REQUIRE_GPU_ENV}=1 but no GPU driver can run here ({reasons})")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Only tests that take this plugin's ``driver`` fixture ask for ``driver_spec``; another project's own ``driver``
    # fixture hides this one and its tests are left alone.
    if "driver_spec" in metafunc.fixturenames:
        specs = selection(metafunc.config).specs
        metafunc.parametrize("driver_spec", specs, ids=specs, scope="session")


def pytest_report_header(config: pytest.Config) -> list[str]:
    if not asks_for_rules(config):
        return []
    sel = selection(config)
    lines = [
        f"extensible_kv {extensible_kv.__version__}, torch {torch.__version__}, python {platform.python_version()}"
    ]
    for spec in sel.specs:
        if sel.explicit and watchdog.is_controller(config):
            lines.append(
                f"driver {spec}: named explicitly; built only in the pytest-xdist workers (every rule fails "
                f"if it cannot run)"
            )
            continue
        if sel.explicit:  # built now, so a spec that does not load is named once, here
            built = build(config, spec)
            reason = built if isinstance(built, str) else None
        else:
            reason = drivers.probe(spec)
        lines.append(
            f"driver {spec}: {'available' if reason is None else 'cannot run: ' + reason}"
            f"{' (named explicitly: every rule errors)' if sel.explicit and reason else ''}"
        )
    env = {k: v for k, v in os.environ.items() if k.startswith("EXTENSIBLE_KV_")}
    if env:
        lines.append("environment: " + ", ".join(f"{k}={v}" for k, v in sorted(env.items())))
    return lines


@pytest.fixture
def driver(request: pytest.FixtureRequest, driver_spec: str):
    """The driver under test, wrapped in a fresh Ledger; fails the test if anything leaked."""
    config = request.config
    built = build(config, driver_spec)
    if isinstance(built, str):
        if selection(config).explicit:
            pytest.fail(f"driver {driver_spec!r} was asked for but cannot run: {built}", pytrace=False)
        pytest.skip(built)
    marker = request.node.get_closest_marker("drivers")
    if marker and built.device.type not in marker.args:
        pytest.skip(f"rule applies to {'/'.join(marker.args)} drivers; {driver_spec} runs on {built.device.type}")
    ledger = drivers.Ledger(built)
    yield ledger
    leaks.fail_if_outstanding(driver_spec, ledger)
