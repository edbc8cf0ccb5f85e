"""The extensible_kv conformance suite: the rules every VMM driver (and the tensor on top of it) must pass.

Installed (``pip install extensible-kv``) this folder is the package ``extensible_kv_conformance``; in a source checkout
it is ``conformance``, and ``reference/extensible_kv_conformance`` links to it, so that the installed name resolves on
``PYTHONPATH=reference:.`` too (a build's metadata, left in ``reference/``, names the plugin by it). Run the rules with ``extensible-kv check-driver NAME|module:factory``, with pytest
(``pytest --pyargs extensible_kv_conformance --driver NAME|module:factory``, add ``-n 1`` for crash isolation; in a
checkout, ``pytest conformance --driver ...``) or, from another repository's tests, with ``check_driver``. The rules
live in this folder's ``test_*.py`` files; ``plugin/`` is the pytest plugin that selects the drivers, guards against
leaks and prints the summary. The project's own tests (the pure logic, and the meta-tests proving that the rules fail
on broken drivers) live in the checkout's ``tests/`` and are not part of the installed suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

SUITE = Path(__file__).resolve().parent
PLUGIN = "extensible_kv_conformance"  # the plugin's pytest11 entry point (pyproject.toml), and its registered name

# Folders of this one that hold no rules (none today: the project's own tests live in tests/).
NOT_RULES: tuple[str, ...] = ()


def rule_paths() -> list[str]:
    """pytest arguments that collect the rules and nothing else: this folder, less what ``NOT_RULES`` names."""
    ignored = [arg for name in NOT_RULES if (SUITE / name).is_dir() for arg in ("--ignore", str(SUITE / name))]
    return [str(SUITE), *ignored]


def load_plugin(pluginmanager) -> None:
    """Register the suite's pytest plugin (``plugin/``) under ``PLUGIN``, unless pytest loaded it already through its
    entry point (an installed copy) or it is blocked (``-p no:extensible_kv_conformance``): its hooks run once."""
    if pluginmanager.get_plugin(PLUGIN) is None and not pluginmanager.is_blocked(PLUGIN):
        from . import plugin  # noqa: PLC0415 - imported only when no installed copy was loaded

        pluginmanager.register(plugin, PLUGIN)


def _spec_of(driver: str | Callable[[], object]) -> str:
    if isinstance(driver, str):
        return driver
    from extensible_kv.errors import DriverLoadError  # noqa: PLC0415

    module, name = getattr(driver, "__module__", None), getattr(driver, "__qualname__", "")
    if not callable(driver) or not module or module == "__main__" or "<" in name or "." in name:
        raise DriverLoadError(f"check_driver needs a driver spec or a module-level factory it can import in a child "
                              f"process, got {driver!r}; pass 'package.module:factory'")
    return f"{module}:{name}"


def check_driver(driver: str | Callable[[], object], pytest_args: Sequence[str] = ()) -> int:
    """Run every conformance rule against ``driver`` and return pytest's exit code (0: conformant).

    ``driver`` is a registered name, a ``module:factory`` spec, or a module-level zero-argument factory (named by its
    module and name). The rules run in a child process, in a pytest-xdist worker: a driver that faults fails the rule
    it faulted in, the worker is restarted and the run goes on to its summary. The driver is named explicitly, so if
    it cannot run here the rules fail rather than skip.
    """
    spec = _spec_of(driver)
    args = [sys.executable, "-m", "pytest", *rule_paths(), "--driver", spec, "-p", "no:cacheprovider", "-p", "xdist",
            "-n", "1", *pytest_args]
    path = os.pathsep.join(p for p in [str(SUITE.parent), *sys.path] if p)
    return subprocess.run(args, env={**os.environ, "PYTHONPATH": path}).returncode
