"""Numbers given on a command line: parsed, then range-checked before anything uses them.

Note [A number from outside is in range before it is used]
    ``float("1e308")`` is a number, and so are ``nan``, ``inf`` and ``-5``; each fails somewhere far from the option
    that took it (``--build-timeout 1e308``: an ``OverflowError`` in ``selectors``; ``--rule-timeout 1e308``:
    ``faulthandler`` refuses a time_t past 2**63, pytest-xdist stops with INTERNALERROR, and with one rule selected
    the run exits 0 having run none, which reads as conformant). So every number an option takes is checked where it
    is parsed, against the range its use can take: a time limit is finite and at most ``SECONDS_LIMIT`` (a week; 0
    turns a limit off, so nothing longer is ever needed), a size or count an integer between its bounds. Text that
    is no number, ``nan``, infinities and integers of thousands of digits are refused with the same one line.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

from . import BoundaryError, shown

SECONDS_LIMIT = 7 * 24 * 3600.0  # a week, in seconds: the longest time limit an option takes
INT_LIMIT = 2**63  # sizes and counts: what a device's 64-bit figures can hold (Note [Numbers a device can hold])
ADDRESS_SPACE = 2**47  # bytes a process can address on x86-64 and aarch64 (48-bit virtual addresses, user half)


class BadNumber(BoundaryError):
    """A number from outside that is not one, or is out of its range; the message names the option and the value."""


def seconds(value: str, *, option: str, limit: float = SECONDS_LIMIT, off: bool = True) -> float:
    """``value`` as a time limit in seconds: finite, >= 0 and <= ``limit`` (0, with ``off``: no limit)."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    low_ok = number >= 0 if off else number > 0
    if not (low_ok and number <= limit):
        low = "0 (0: no limit)" if off else "more than 0"
        raise BadNumber(f"{option} must be a number of seconds from {low} to {limit:g}, got {shown(value)}")
    return number


def positive(value: str, *, option: str, high: float, what: str = "a number") -> float:
    """``value`` as a finite number above 0 and at most ``high`` (a fraction, a size in GiB)."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    if not 0 < number <= high:  # nan and the infinities fail here too
        raise BadNumber(f"{option} must be {what} above 0 and at most {high:g}, got {shown(value)}")
    return number


def integer(value: str, *, option: str, low: int = 1, high: int = INT_LIMIT - 1, what: str = "an integer") -> int:
    """``value`` as an integer from ``low`` to ``high`` (decimal digits only: no ``1e3``, no ``0x10``)."""
    text = str(value).strip()
    number = None
    if re.fullmatch(r"[+-]?[0-9]{1,40}", text, re.ASCII):  # one sign at most: "+-5" is no integer
        number = int(text)
    if number is None or not low <= number <= high:
        raise BadNumber(f"{option} must be {what} from {low:,} to {high:,}, got {shown(value)}")
    return number


def argument(check: Callable[..., object], option: str, **bounds: object) -> Callable[[str], object]:
    """``check`` as an ``argparse`` ``type=``: its refusal is argparse's one-line error."""

    def parse(value: str) -> object:
        try:
            return check(value, option=option, **bounds)
        except BadNumber as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = check.__name__  # argparse names the type in some messages
    return parse
