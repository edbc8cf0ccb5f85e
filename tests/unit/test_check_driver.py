"""``conformance.check_driver`` with a factory: 0 for an intact driver, non-zero for a broken one.

Each run happens in a fresh interpreter, so the suite's pytest session does not re-enter this one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RULES = ["-q", "-k", "test_base_address_is_stable_across_growth or test_zero_sets_exactly_the_range",
         "-p", "no:randomly"]


def check_driver_in_subprocess(factory: str) -> subprocess.CompletedProcess:
    code = ("import sys; from conformance import check_driver; "
            f"from tests.unit._factories import {factory}; "
            f"sys.exit(check_driver({factory}, {RULES!r}))")
    path = os.pathsep.join([str(ROOT), str(ROOT / "reference"), os.environ.get("PYTHONPATH", "")])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXTENSIBLE_KV_", "PYTEST_"))}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("factory", "expected"), [
    ("host_4k", (0, True, False)),  # exit 0, rules passed, none failed
    ("no_zero", (1, True, True)),  # exit 1, base address rule passed, zero rule failed
])
def test_check_driver_returns_zero_exactly_for_a_conformant_driver(factory, expected):
    proc = check_driver_in_subprocess(factory)
    output = (proc.stdout + proc.stderr)[-3000:]
    got = (proc.returncode, bool(re.search(r"\b[1-9]\d* passed", output)),
           "FAILED conformance/test_driver_contract.py::test_zero_sets_exactly_the_range" in output)
    assert got == expected, f"check_driver({factory}, {RULES}): expected (exit code, some passed, zero rule " \
                            f"failed) == {expected}, got {got}:\n{output}"
