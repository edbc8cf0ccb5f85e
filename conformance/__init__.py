"""The extensible_kv conformance suite: the rules every VMM driver (and the tensor on top of it) must pass.

Run it with pytest (``pytest conformance --driver NAME|module:factory``, add ``-n 1`` for crash isolation) or, from
another repository, with ``check_driver``. The rule tests live in this folder's ``test_*.py`` files; ``meta/`` proves
that the rules fail on deliberately broken drivers and tensors, and ``unit/`` tests the reference package's pure
logic.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

SUITE = Path(__file__).resolve().parent


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
    args = [sys.executable, "-m", "pytest", str(SUITE), "--ignore", str(SUITE / "meta"), "--ignore",
            str(SUITE / "unit"), "--driver", spec, "-p", "no:cacheprovider", "-p", "xdist", "-n", "1", *pytest_args]
    path = os.pathsep.join(p for p in [str(SUITE.parent), *sys.path] if p)
    return subprocess.run(args, env={**os.environ, "PYTHONPATH": path}).returncode
