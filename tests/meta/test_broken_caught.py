"""Every broken driver of ``tests/meta/broken`` is caught by the rules it names, and the check can tell.

``tests.meta.broken.catch`` runs, for each driver, only the rules of its ``caught_by`` (in a child of its own, forked
from one process that imported the rules once), and this test fails naming every driver none of those rules failed on.
The check is itself checked: the intact host driver, named as a broken one, must come back not caught. ``nox -s
broken_sweep`` runs every rule on every driver instead.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from extensible_kv.drivers.host import HostDriver
from tests.meta import broken
from tests.meta.broken.base import Broken
from tests.meta.broken.catch import rule_files

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ROOT / "reference" / "extensible_kv" / "drivers" / "_protocol.py"
DRIVERS = broken.drivers()
CATCH_TIMEOUT_S = 1800


class Intact(Broken):
    """The host driver, not broken at all, under a broken driver's id and rule: no rule may fail on it."""

    breaks = "P-zero"
    caught_by = ("test_zero_sets_exactly_the_range",)


def catch(tmp_path: Path, specs: list[str]) -> dict[str, dict]:
    """What ``tests.meta.broken.catch`` found for ``specs``, run as a backend team would: a fresh interpreter."""
    out = tmp_path / "caught.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXTENSIBLE_KV_", "PYTEST_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "reference"), os.environ.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "tests.meta.broken.catch", "--jobs", str(os.cpu_count() or 1), "--out", str(out)]
    proc = subprocess.run([*cmd, *specs], cwd=ROOT, env=env, capture_output=True, text=True, timeout=CATCH_TIMEOUT_S)
    assert out.exists(), f"tests.meta.broken.catch wrote no results (exit {proc.returncode})\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text())


def test_every_broken_driver_fails_a_rule_it_names(tmp_path):
    found = catch(tmp_path, list(DRIVERS))
    missed = {
        spec: f"{DRIVERS[spec].breaks}: none of {list(DRIVERS[spec].caught_by)} failed (exit {got['exit']})"
        for spec, got in found.items()
        if not got["failed"]
    }
    assert set(found) == set(DRIVERS) and not missed, (
        f"broken drivers: expected each to fail a rule of its caught_by; not run: {sorted(set(DRIVERS) - set(found))}"
        f", not caught: {json.dumps(missed, indent=1)}"
    )


def test_the_check_fails_on_an_intact_driver(tmp_path):
    spec = f"{__name__}:Intact"
    got = catch(tmp_path, [spec])[spec]
    assert got["exit"] == 0 and got["failed"] == [], (
        f"intact host driver as {spec}: expected {Intact.caught_by} to pass (exit 0, nothing failed), got exit "
        f"{got['exit']} and failed {got['failed']}"
    )


def test_every_driver_names_a_promise_of_the_protocol_and_rules_that_exist():
    ids, rules = set(re.findall(r"P-[a-z][a-z0-9-]*", PROTOCOL.read_text())), set(rule_files())
    wrong = {
        spec: (cls.breaks, [r for r in cls.caught_by if r not in rules])
        for spec, cls in DRIVERS.items()
        if cls.breaks not in ids or not cls.caught_by or any(r not in rules for r in cls.caught_by)
    }
    assert DRIVERS and not wrong, (
        f"broken drivers: expected each to break a P-id of {PROTOCOL.name} and name rules of conformance/; got "
        f"(id, unknown rules) {wrong}"
    )


def test_no_two_drivers_break_the_same_promise_for_the_same_rules():
    seen: dict[tuple, list[str]] = {}
    for spec, cls in DRIVERS.items():
        seen.setdefault((cls.breaks, tuple(sorted(cls.caught_by))), []).append(spec)
    twins = {f"{k[0]} {list(k[1])}": v for k, v in seen.items() if len(v) > 1}
    assert not twins, f"broken drivers: expected one driver per promise and rules, got several for {twins}"


def test_no_broken_driver_reaches_into_a_private_name_of_the_drivers():
    private = {n for n in [*vars(HostDriver), *vars(HostDriver())] if n.startswith("_") and not n.startswith("__")}
    found = []
    for path in sorted((ROOT / "tests" / "meta" / "broken").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("extensible_kv.drivers"):
                found += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names if a.name.startswith("_")]
            elif isinstance(node, ast.Attribute) and node.attr in private:
                found.append(f"{path.name}:{node.lineno} uses .{node.attr}")
    assert not found, f"broken drivers: expected the host driver's public surface only, got {found}"
