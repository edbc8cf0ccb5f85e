"""``conformance.check_driver`` and ``extensible-kv check-driver``: 0 for an intact driver, non-zero for a broken
one, the rules and nothing else.

Each run of the rules happens in a fresh interpreter, so the suite's pytest session does not re-enter this one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conformance import rule_paths
from extensible_kv import __main__ as cli
from extensible_kv.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
RULES = [
    "-q",
    "-k",
    "test_base_address_is_stable_across_growth or test_zero_sets_exactly_the_range",
    "-p",
    "no:randomly",
]


def check_driver_in_subprocess(factory: str) -> subprocess.CompletedProcess:
    code = (
        "import sys; from conformance import check_driver; "
        f"from tests.unit._factories import {factory}; "
        f"sys.exit(check_driver({factory}, {RULES!r}))"
    )
    path = os.pathsep.join([str(ROOT), str(ROOT / "reference"), os.environ.get("PYTHONPATH", "")])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXTENSIBLE_KV_", "PYTEST_"))}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**env, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        ("host_4k", (0, True, False)),  # exit 0, rules passed, none failed
        ("no_zero", (1, True, True)),  # exit 1, base address rule passed, zero rule failed
    ],
)
def test_check_driver_returns_zero_exactly_for_a_conformant_driver(factory, expected):
    proc = check_driver_in_subprocess(factory)
    output = (proc.stdout + proc.stderr)[-3000:]
    got = (
        proc.returncode,
        bool(re.search(r"\b[1-9]\d* passed", output)),
        "FAILED conformance/test_driver_contract.py::test_zero_sets_exactly_the_range" in output,
    )
    assert got == expected, (
        f"check_driver({factory}, {RULES}): expected (exit code, some passed, zero rule "
        f"failed) == {expected}, got {got}:\n{output}"
    )


def _cli(*args: str, pythonpath: list[Path], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXTENSIBLE_KV_", "PYTEST_"))}
    path = os.pathsep.join(str(p) for p in pythonpath)
    return subprocess.run(
        [sys.executable, "-m", "extensible_kv", *args],
        cwd=cwd,
        env={**env, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("spec", "separator", "expected"),
    [
        ("host-4k", [], 0),  # pytest arguments right after the driver ...
        ("tests.unit._factories:no_zero", ["--"], 1),  # ... or after "--"
        ("tests.unit._factories:no_zero", ["-x"], 1),  # stopped at the first failure: failed, not interrupted (2)
    ],
)
def test_the_command_line_exits_with_the_status_of_the_rules(spec, separator, expected):
    proc = _cli("check-driver", spec, *separator, *RULES, pythonpath=[ROOT / "reference", ROOT], cwd=ROOT)
    output = (proc.stdout + proc.stderr)[-3000:]
    got = (proc.returncode, "extensible-kv conformance summary" in output)
    assert got == (expected, True), (
        f"python -m extensible_kv check-driver {spec} {' '.join(separator + RULES)}: "
        f"expected (exit {expected}, a summary), got {got}:\n{output}"
    )


@pytest.mark.parametrize("factory", ["skips", "xfails", "exits"])
def test_a_driver_that_raises_pytests_outcomes_fails_the_rules(factory):
    # wrong: rules that the driver's pytest.skip or xfail turns into skips (exit 0), or a pytest.exit that ends the
    # run with no summary
    proc = _cli(
        "check-driver", f"tests.unit._factories:{factory}", *RULES, pythonpath=[ROOT / "reference", ROOT], cwd=ROOT
    )
    output = (proc.stdout + proc.stderr)[-6000:]
    got = (proc.returncode, "extensible-kv conformance summary" in output, "DriverEndedRule" in output)
    assert got == (1, True, True), (
        f"check-driver tests.unit._factories:{factory}: expected (exit 1, a summary, DriverEndedRule), got {got}:\n"
        f"{output}"
    )


@pytest.mark.parametrize(("absent", "options"), [("extensible_kv_conformance", []), ("pytest", [])])
def test_the_command_line_without_the_conformance_extra_says_so_in_one_line(monkeypatch, capsys, absent, options):
    real_find = cli._find
    monkeypatch.setattr(cli, "_find", lambda name: None if name in (absent, "conformance") else real_find(name))
    started = []
    monkeypatch.setattr(cli.os, "execv", lambda *argv: started.append(argv))  # the suite is never started
    code = main(["check-driver", "host-4k", *options])
    err = capsys.readouterr().err
    named = "conformance suite" if absent == "extensible_kv_conformance" else absent
    got = (code, len(err.splitlines()), "needs the conformance extra" in err, "[conformance]" in err, named in err)
    assert (got, started) == ((2, 1, True, True, True), []), (
        f"check-driver {' '.join(options)} without {absent}: expected (exit 2, one line, naming the "
        f"conformance extra, how to install it and {named}) and the suite not started, got {got}, {started}:\n{err}"
    )


def test_the_command_line_names_the_missing_driver_and_nothing_else(capsys):
    with pytest.raises(SystemExit) as info:
        main(["check-driver"])
    err = capsys.readouterr().err
    got = (info.value.code, err.strip().rpartition(": ")[2])
    assert got == (2, "driver"), (
        f"check-driver without arguments: expected (exit 2, naming only the driver), got {got}: {err}"
    )


def test_the_rule_paths_collect_the_rules_and_nothing_else():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *rule_paths(),
            "--driver",
            "host-4k",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "reference"), str(ROOT)])},
    )
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    others = sorted({i.split("::")[0] for i in ids if not re.fullmatch(r"conformance/test_\w+\.py", i.split("::")[0])})
    got = (proc.returncode, len(ids) > 100, others)
    assert got == (0, True, []), (
        f"pytest {' '.join(rule_paths())} --collect-only: expected (exit 0, over 100 rules, "
        f"nothing but conformance/test_*.py), got {got}\n{proc.stdout[-2000:]}"
    )
