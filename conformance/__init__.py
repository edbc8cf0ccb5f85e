"""The extensible_kv conformance suite: the rules every VMM driver (and the tensor on top of it) must pass.

Run it with pytest (``pytest conformance --driver NAME|module:factory``) or, from another repository, with
``check_driver``. The rule tests live in this folder's ``test_*.py`` files; ``meta/`` proves that the rules fail on
deliberately broken drivers and tensors, and ``unit/`` tests the reference package's pure logic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

SUITE = Path(__file__).resolve().parent


def check_driver(driver: str | Callable[[], object], pytest_args: Sequence[str] = ()) -> int:
    """Run every conformance rule against ``driver`` and return pytest's exit code (0: conformant).

    ``driver`` is a registered name, a ``module:factory`` spec, or a zero-argument factory returning a driver (it is
    registered for the run as ``checked``). The driver is named explicitly, so if it cannot run here the rules fail
    rather than skip.
    """
    import pytest  # noqa: PLC0415 - only needed when the suite runs

    from extensible_kv import drivers  # noqa: PLC0415

    if callable(driver):
        drivers.register("checked", driver, lambda: None, gpu=False)
        spec = "checked"
    else:
        spec = driver
    args = [str(SUITE), "--ignore", str(SUITE / "meta"), "--ignore", str(SUITE / "unit"), "--driver", spec,
            "-p", "no:cacheprovider", *pytest_args]
    return int(pytest.main(args))
