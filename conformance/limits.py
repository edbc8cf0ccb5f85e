"""The time limits of a conformance run, and the options of it that ``check_driver`` reads before pytest starts.

``--build-timeout`` bounds building the driver under test (importing its module and calling its factory), both in
``check_driver``'s preflight and in each pytest-xdist worker; ``--rule-timeout`` bounds each rule in a worker (setup,
call and the leak guard). A worker that runs past either is ended, the rule it was running fails naming the limit,
and pytest-xdist starts a fresh worker for the rest. 0 turns a limit off.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

BUILD_TIMEOUT_S = 60.0  # a CUDA driver's first build (cuInit, a context) takes a few seconds on an H200
RULE_TIMEOUT_S = 300.0  # the slowest rule on the host driver takes seconds; a GPU rule commits at most a few GiB


def seconds(text: str) -> float:
    """A time limit in seconds: a number >= 0 (0: no limit)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0 (0: no limit), got {text!r}")
    return value


@dataclass(frozen=True)
class RunOptions:
    """What ``check_driver`` needs of the pytest arguments it passes on."""

    build_timeout: float = BUILD_TIMEOUT_S
    summary_json: str | None = None


class OptionError(ValueError):
    """An option ``check_driver`` reads has a bad value (the message names it)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise OptionError(message)


def run_options(pytest_args: Sequence[str]) -> RunOptions:
    """``--build-timeout`` and ``--summary-json`` among ``pytest_args`` (which pytest then reads too)."""
    parser = _Parser(add_help=False, allow_abbrev=False)
    parser.add_argument("--build-timeout", type=seconds, default=BUILD_TIMEOUT_S)
    parser.add_argument("--summary-json", default=None)
    known, _ = parser.parse_known_args(list(pytest_args))
    return RunOptions(known.build_timeout, known.summary_json)
