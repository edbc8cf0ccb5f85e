"""The extensible_kv conformance suite: the rules every VMM driver (and the tensor on top of it) must pass.

Installed (``pip install 'extensible-kv[conformance]'``) this folder is the package ``extensible_kv_conformance``; in
a source checkout it is ``conformance``. Run the rules with ``extensible-kv check-driver NAME|module:factory`` (or
``python -m extensible_kv_conformance NAME|module:factory``), with pytest (``pytest -p extensible_kv_conformance.plugin
--pyargs extensible_kv_conformance --driver NAME|module:factory -n 1``; in a checkout, ``pytest conformance --driver
...``) or, from another repository's tests, with ``check_driver``. The rules live in this folder's ``test_*.py``
files; ``plugin/`` is the pytest plugin that selects the drivers, bounds each build and rule in time, guards against
leaks and prints the summary. No pytest entry point loads it into other projects' runs: the rules' ``conftest.py``
registers it (``load_plugin``), or ``-p`` names it. The project's own tests (the pure logic, and the meta-tests
proving that the rules fail on broken drivers) live in the checkout's ``tests/`` and are not part of the suite.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

SUITE = Path(__file__).resolve().parent
PLUGIN = "extensible_kv_conformance"  # the name the suite's plugin is registered under

# Folders of this one that hold no rules (none today: the project's own tests live in tests/).
NOT_RULES: tuple[str, ...] = ()


def rule_paths() -> list[str]:
    """pytest arguments that collect the rules and nothing else: this folder, less what ``NOT_RULES`` names."""
    ignored = [arg for name in NOT_RULES if (SUITE / name).is_dir() for arg in ("--ignore", str(SUITE / name))]
    return [str(SUITE), *ignored]


def _registered(pluginmanager) -> bool:
    """Whether a copy of the suite's plugin is registered already: under ``PLUGIN`` (``load_plugin``), or by ``-p``
    under its module's name (``-p extensible_kv_conformance.plugin``, ``-p conformance.plugin``)."""
    if pluginmanager.get_plugin(PLUGIN) is not None:
        return True
    return any(
        getattr(p, "__name__", "").endswith(".plugin") and getattr(p, "NAME", None) == PLUGIN
        for p in pluginmanager.get_plugins()
    )


def load_plugin(pluginmanager) -> None:
    """Register the suite's pytest plugin (``plugin/``) under ``PLUGIN``, unless a copy is registered already or it is
    blocked (``-p no:extensible_kv_conformance``): its hooks run once."""
    if not _registered(pluginmanager) and not pluginmanager.is_blocked(PLUGIN):
        from . import plugin  # pytest is imported only where the rules run

        pluginmanager.register(plugin, PLUGIN)


def _spec_of(driver: str | Callable[[], object]) -> str:
    if isinstance(driver, str):
        return driver
    from extensible_kv.errors import DriverLoadError

    module, name = getattr(driver, "__module__", None), getattr(driver, "__qualname__", "")
    if not callable(driver) or not module or module == "__main__" or "<" in name or "." in name:
        raise DriverLoadError(
            f"check_driver needs a driver spec or a module-level factory it can import in a child "
            f"process, got {driver!r}; pass 'package.module:factory'"
        )
    return f"{module}:{name}"


def check_driver(driver: str | Callable[[], object], pytest_args: Sequence[str] = ()) -> int:
    """Run every conformance rule against ``driver`` and return the exit status (0: conformant).

    ``driver`` is a registered name, a ``module:factory`` spec, or a module-level zero-argument factory (named by its
    module and name). Nothing of it runs in this process (Note [Who builds the driver under test] in ``preflight``):
    a child builds it first, within ``--build-timeout``; a spec that names no driver (or whose factory returns an
    object that is not a driver) and an option out of range are one line on stderr and 2, a driver that cannot be
    built (the factory raises, crashes, hangs or leaves a thread or a process running) one line, the summary and 1.
    The rules then run in pytest's child process, in a pytest-xdist worker: a driver that faults or runs past
    ``--rule-timeout`` fails the rule it was in, the worker is replaced and the run goes on to its summary; the status
    is then pytest's. The driver is named explicitly, so if it cannot run here the rules fail rather than skip. On
    Ctrl-C or SIGTERM the children are ended as a group before this returns (``process_group``).
    """
    from . import preflight, process_group
    from .limits import OptionError, run_options

    spec = _spec_of(driver)
    args = list(pytest_args)
    problem = preflight.syntax_error(spec)
    try:
        options = run_options(args)
    except OptionError as exc:
        problem = problem or str(exc)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    path = os.pathsep.join(p for p in [str(SUITE.parent), *sys.path] if p)
    env = {**os.environ, "PYTHONPATH": path}
    found = preflight.run(spec, timeout=options.build_timeout, env=env, package=__name__)
    if found.status != "ok":
        return _not_built(spec, found, options.summary_json)
    facts = found.facts
    print(
        f"driver {spec}: built in a child process: {facts.get('type')} {facts.get('name')!r} on "
        f"{facts.get('device')}, granularity {facts.get('granularity')} bytes; the rules build it in a "
        f"pytest-xdist worker",
        flush=True,
    )
    # pytest-benchmark, where installed, warns under xdist, and the rules' warnings are errors: it has no part here.
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *rule_paths(),
        "--driver",
        spec,
        "-p",
        "no:cacheprovider",
        "-p",
        "no:benchmark",
        "-p",
        "xdist",
        "-n",
        "1",
        *args,
    ]
    return process_group.run(cmd, env=env).returncode


def _not_built(spec: str, found, summary_json: str | None) -> int:
    """One line for a spec that names no driver (2); one line and the summary for a driver not built (1)."""
    from . import table

    if found.status == "bad-spec":
        print(f"error: {found.message}", file=sys.stderr)
        return 2
    reason = f"cannot be built: {found.message}"
    print(f"error: driver {spec!r} {reason}; no rule ran", file=sys.stderr, flush=True)
    row = table.row(spec, failed=table.ALL, unavailable=reason)
    print("\n".join([table.section(), *table.lines([row])]), flush=True)
    if summary_json:
        from extensible_kv import record

        record.write(summary_json, {"exitstatus": 1, "torch": None, "drivers": [{**row, "failed": 0}], "tests": []})
    return 1
