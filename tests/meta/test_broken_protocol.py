"""Broken drivers written from the protocol's text, each breaking one sentence: the break is real, and the rules alone
catch it.

Nine sets, each a module of ``tests/meta`` with its ``CASES``: ``broken_protocol``, and ``broken_outside``,
``broken_third``, ``broken_fourth``, ``broken_fifth``, ``broken_sixth``, ``broken_seventh``, ``broken_eighth`` and
``broken_ninth`` (each written by a reader outside the rules); a case's id names its set and its factory
(``outside:zero_head_off_by_one``). For every driver: its proof, run on the intact host driver and on the broken one,
observes what the protocol says on the first and something else on the second (the break is real on this machine); and
``extensible-kv check-driver`` on the broken driver, in a fresh process as a backend team runs it, fails (exit status 1)
with at least one rule named. The second test runs the whole rule set up to the first failure, minutes for a driver no
rule catches: it is marked ``slow`` and runs with ``EXTENSIBLE_KV_BROKEN_DRIVERS=1``. With ``-x`` pytest-xdist (which
``check-driver`` runs the rules in) ends the run at the first failure as interrupted, exit status 2: that status counts
as a failure only together with xdist's own "stopping after 1 failures" line and a failed rule in the report.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.meta import (
    broken_eighth,
    broken_fifth,
    broken_fourth,
    broken_ninth,
    broken_outside,
    broken_protocol,
    broken_seventh,
    broken_sixth,
    broken_third,
)

ROOT = Path(__file__).resolve().parents[2]
CHECK_TIMEOUT_S = 900
"""A driver no rule catches runs every rule (about three minutes on two cores); a hung run is cut off here."""
SETS = {
    "protocol": broken_protocol,
    "outside": broken_outside,
    "third": broken_third,
    "fourth": broken_fourth,
    "fifth": broken_fifth,
    "sixth": broken_sixth,
    "seventh": broken_seventh,
    "eighth": broken_eighth,
    "ninth": broken_ninth,
}
"""The sets of broken drivers, by the label their cases' ids start with."""
CASES = {f"{label}:{name}": case for label, module in SETS.items() for name, case in module.CASES.items()}
STOPPED_AT_THE_FIRST_FAILURE = "stopping after 1 failures"
RUN_ENV = "EXTENSIBLE_KV_BROKEN_DRIVERS"
"""Set to 1 to run ``test_the_rules_alone_catch_it``: one ``check-driver`` per broken driver, up to the first failed
rule, takes 2 to 5 minutes on two cores (the rules before the catching one pass first), too long for every CI run."""


@pytest.mark.parametrize("name", CASES)
def test_the_proof_shows_the_break(name):
    case = CASES[name]
    intact = case.proof(broken_protocol.intact)
    broken = case.proof(case.factory)
    assert intact == case.want and broken != case.want, (
        f"broken driver {name} ({case.area}), {case.proof.__name__}: expected the intact host driver to observe "
        f"{case.want!r} and the broken one something else; the intact one observed {intact!r}, the broken one "
        f"{broken!r}"
    )


def check_driver(tmp_path: Path, name: str) -> tuple[int, list[str], str]:
    """Run ``check-driver tests.meta.<module>:<factory> -- -x -q`` for the case ``<label>:<factory>`` in a fresh
    process; return its exit status, the rules that failed (from its JUnit XML report, else from its output) and its
    output."""
    label, _, factory = name.partition(":")
    report = tmp_path / "junit.xml"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXTENSIBLE_KV_", "PYTEST_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "reference"), os.environ.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "extensible_kv",
        "check-driver",
        f"{SETS[label].__name__}:{factory}",
        "--",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    out = proc.stdout + proc.stderr
    failed = []
    if report.exists():
        for case in ET.parse(report).iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(case.get("name").split("[")[0])
    if not failed:
        failed = re.findall(r"^(?:FAILED|ERROR) \S+::(\w+)", out, re.MULTILINE)
    return proc.returncode, sorted(set(failed)), out


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get(RUN_ENV) != "1",
    reason=f"{RUN_ENV}=1 runs check-driver on every broken driver (2 to 5 minutes each on two cores)",
)
@pytest.mark.parametrize("name", CASES)
def test_the_rules_alone_catch_it(tmp_path, name):
    rc, failed, out = check_driver(tmp_path, name)
    print(f"{name}: check-driver exit {rc}, caught by {', '.join(failed) or 'no rule'}")
    stopped = rc == pytest.ExitCode.INTERRUPTED and STOPPED_AT_THE_FIRST_FAILURE in out  # -x under xdist
    assert failed and (rc == pytest.ExitCode.TESTS_FAILED or stopped), (
        f"broken driver {name} ({CASES[name].area}): expected check-driver to fail (exit 1, or 2 when xdist stops at "
        f"the first failure) with a rule named; got exit {rc}, failed rules {failed}\n{out[-3000:]}"
    )
