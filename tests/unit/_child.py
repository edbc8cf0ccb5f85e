"""Run a test's hostile part in a fresh interpreter, so a deadlock is a failure after a deadline instead of a hung
run, and a fork or a collection inside a driver call cannot take the test process with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_child(code: str, what: str, timeout_s: float = 60) -> dict:
    """Run ``code`` (dedented) with the package importable; it prints one JSON object as its last line, returned
    here. A hang past ``timeout_s``, a non-zero exit or no JSON fails the test naming ``what``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "reference"), str(ROOT)])}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{what}: the child hung for {timeout_s} s (a deadlock); stdout {exc.stdout!r}", pytrace=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        pytest.fail(
            f"{what}: expected exit 0 and a JSON line, got exit {proc.returncode}, stdout {proc.stdout[-2000:]!r}, "
            f"stderr {proc.stderr[-3000:]!r}",
            pytrace=False,
        )
    return json.loads(lines[-1])
