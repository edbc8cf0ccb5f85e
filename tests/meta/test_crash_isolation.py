"""A driver that faults (SIGSEGV) fails the rule it faulted in, and the run goes on to the other rules and the
summary: through ``check_driver`` (a child process, a pytest-xdist worker) as a backend team runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RULES = "test_zero_sets_exactly_the_range or test_reserve_is_aligned_and_not_accessible"


def test_a_faulting_driver_fails_the_rule_that_faulted_and_the_run_reaches_its_summary():
    code = (
        "import sys; from conformance import check_driver; "
        f"sys.exit(check_driver('tests.meta.faulting:segfault_on_zero', ['-k', {RULES!r}]))"
    )
    path = os.pathsep.join([str(ROOT), str(ROOT / "reference"), os.environ.get("PYTHONPATH", "")])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXTENSIBLE_KV_", "PYTEST_"))}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**env, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    got = {
        "exit code": proc.returncode,
        "the zero rule failed": "FAILED conformance/test_driver_contract.py::test_zero_sets_exactly_the_range" in out,
        "a worker crashed": "crashed while running" in out,
        "the reserve rule passed": "1 failed, 1 passed" in out,
        "summary printed": "extensible-kv conformance summary" in out,
    }
    want = {
        "exit code": 1,
        "the zero rule failed": True,
        "a worker crashed": True,
        "the reserve rule passed": True,
        "summary printed": True,
    }
    assert got == want, f"check_driver on a driver that faults in zero(): expected {want}, got {got}\n{out[-3000:]}"
