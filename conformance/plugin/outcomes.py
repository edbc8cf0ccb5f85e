"""A driver under test that ends a rule with one of pytest's own outcomes fails the rule.

Note [A driver does not decide a rule's outcome]
    Rule: where ``pytest.skip``, ``xfail``, ``fail``, ``exit`` or ``importorskip`` is raised by code outside the
    rules (the driver's methods, its factory, anything they call), the rule fails with ``DriverEndedRule`` naming the
    outcome and the line that raised it; only a rule's own skip stays a skip.
    Why: pytest's outcomes are ``BaseException``s the rules cannot tell from their own: a driver whose ``reserve``
    called ``pytest.skip`` turned 255 rules into skips and ``check-driver`` exited 0 ("15 passed, 255 skipped"), and
    ``pytest.exit`` ended the xdist run with an INTERNALERROR and no summary.
    Figure: that driver now fails every rule that reserves, exit status 1 (``tests/unit/test_check_driver.py``,
    ``test_a_driver_that_raises_pytests_outcomes_fails_the_rules``).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

import _pytest
import pluggy
import pytest
from _pytest.outcomes import Exit, OutcomeException

from extensible_kv.boundaries import named, shown

RULES = str(Path(__file__).resolve().parent.parent) + os.sep  # the rules' package: where a skip is the rule's own
PYTEST = tuple(str(Path(m.__file__).resolve().parent) + os.sep for m in (_pytest, pluggy, pytest))


class DriverEndedRule(Exception):
    """Code outside the rules raised one of pytest's outcomes inside a rule."""


def _raiser(tb: TracebackType | None) -> tuple[str, int] | None:
    """The file and line of the innermost frame outside pytest's own packages: the code that called the outcome."""
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    for filename, line in reversed(frames):
        try:
            path = str(Path(filename).resolve())
        except (OSError, ValueError, RuntimeError):
            path = filename
        if not path.startswith(PYTEST):
            return path, line
    return None


def judged(exc: BaseException) -> DriverEndedRule | None:
    """``DriverEndedRule`` for an outcome raised outside the rules, else ``None`` (the rule's own)."""
    where = _raiser(exc.__traceback__)
    if where is None or where[0].startswith(RULES):
        return None
    text = getattr(exc, "msg", None) or str(exc)
    return DriverEndedRule(
        f"code outside the rules raised pytest's {type(exc).__name__} ({shown(text, 120)}) at "
        f"{named(where[0])}:{where[1]}: a driver's call returns or raises an Exception, it never decides a rule's "
        f"outcome"
    )


def _a_rule(node: pytest.Item | None) -> bool:
    """Whether ``node`` is one of the rules (elsewhere, a test's own skips are its own)."""
    path = getattr(node, "path", None)
    return path is not None and str(Path(path).resolve()).startswith(RULES)


def _guarded(node: pytest.Item | None):
    try:
        return (yield)
    except (OutcomeException, Exit) as exc:
        ended = judged(exc) if _a_rule(node) else None
        if ended is None:
            raise
        raise ended from None


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    return (yield from _guarded(pyfuncitem))


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    return (yield from _guarded(getattr(request, "node", None)))
