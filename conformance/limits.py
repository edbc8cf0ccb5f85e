"""The time limits of a conformance run, and the options of it that ``check_driver`` reads before pytest starts.

``--build-timeout`` bounds building the driver under test (importing its module and calling its factory), both in
``check_driver``'s preflight and in each pytest-xdist worker; ``--rule-timeout`` bounds each rule in a worker (setup,
call and the leak guard). A worker that runs past either is ended, the rule it was running fails naming the limit,
and pytest-xdist starts a fresh worker for the rest. 0 turns a limit off.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from extensible_kv.boundaries import BoundaryError, numbers, outputs

BUILD_TIMEOUT_S = 60.0  # a CUDA driver's first build (cuInit, a context) takes a few seconds on an H200
RULE_TIMEOUT_S = 300.0  # the slowest rule on the host driver takes seconds; a GPU rule commits at most a few GiB


def seconds(text: str) -> float:
    """A time limit in seconds, as an ``argparse`` type: a number from 0 (no limit) to a week
    (``extensible_kv.boundaries.numbers``)."""
    try:
        return numbers.seconds(text, option="the time limit")
    except numbers.BadNumber as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("the time limit ")) from None


def probe_bytes(text: str) -> int:
    """``--commit-probe-bytes``, as an ``argparse`` type: a positive byte count a process can address."""
    try:
        return numbers.integer(text, option="the byte count", high=numbers.ADDRESS_SPACE, what="a byte count")
    except numbers.BadNumber as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("the byte count ")) from None


@dataclass(frozen=True)
class RunOptions:
    """What ``check_driver`` needs of the pytest arguments it passes on, each checked before any work (Note [A number
    from outside is in range before it is used], Note [An output is a regular file or a new path, checked first])."""

    build_timeout: float = BUILD_TIMEOUT_S
    rule_timeout: float = RULE_TIMEOUT_S
    summary_json: str | None = None
    commit_probe_bytes: int | None = None


class OptionError(ValueError):
    """An option ``check_driver`` reads has a bad value (the message names it)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise OptionError(message)


def run_options(pytest_args: Sequence[str]) -> RunOptions:
    """The options of ``pytest_args`` that ``check_driver`` checks before pytest starts (which reads them too): the
    time limits, the commit probe's size and ``--summary-json`` with the ``environment.json`` written beside it."""
    parser = _Parser(add_help=False, allow_abbrev=False)
    parser.add_argument("--build-timeout", type=seconds, default=BUILD_TIMEOUT_S)
    parser.add_argument("--rule-timeout", type=seconds, default=RULE_TIMEOUT_S)
    parser.add_argument("--commit-probe-bytes", type=probe_bytes, default=None)
    parser.add_argument("--summary-json", default=None)
    known, _ = parser.parse_known_args(list(pytest_args))
    if known.summary_json is not None:
        try:
            summary_outputs(known.summary_json)
        except BoundaryError as exc:
            raise OptionError(str(exc)) from None
    return RunOptions(known.build_timeout, known.rule_timeout, known.summary_json, known.commit_probe_bytes)


def summary_outputs(path: str) -> tuple[Path, Path]:
    """The two files ``--summary-json PATH`` writes: PATH and ``environment.json`` beside it, each a regular file or a
    new path that can be written (``BadOutputPath`` otherwise)."""
    summary = outputs.output_file(path, option="--summary-json")
    beside = Path(os.path.dirname(os.path.abspath(path))) / "environment.json"
    return summary, outputs.output_file(beside, option="--summary-json: the environment.json beside it,")
