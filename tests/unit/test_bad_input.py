"""Bad input on the command line: a non-zero exit with the reason, each run in a child process.

(The KV buffers' bad inputs are in ``test_kv_buffer_refusals.py``; the tensor's are conformance rules, run on every
driver; driver specs and the vLLM switches have their own unit tests.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "reference"), str(ROOT)]))
    return subprocess.run(
        [sys.executable, "-m", "extensible_kv", *args], capture_output=True, text=True, env=env, timeout=120
    )


BAD_CLI = {
    "no_command": ((), 2, "check-driver"),  # lists the commands
    "unknown_command": (("frobnicate",), 2, "invalid choice"),
    "bad_dtype": (("validate-backend", "x:y", "--dtype", "float7"), 2, "--dtype 'float7' is not a torch dtype"),
    "quantized_dtype": (
        ("validate-backend", "x:y", "--dtype", "qint8"),
        2,
        "--dtype 'qint8' is a quantized dtype; a KV cache holds plain elements",
    ),
    "bad_layout": (("validate-backend", "x:y", "--layout", "XYZ"), 2, "invalid choice"),
    "missing_module": (("validate-backend", "no_such_module:Backend", "--driver", "host"), 1, "could not be loaded"),
    "not_a_backend": (
        ("validate-backend", "conformance.layouts:flash_nhd", "--driver", "host"),
        1,
        "has no attribute 'get_kv_cache_shape'",
    ),
    "bad_driver": (
        ("validate-backend", "tests.unit._factories:KVFirstBackend", "--driver", "nope"),
        2,
        "unknown driver 'nope'",
    ),
}


@pytest.mark.parametrize("args,code,needle", BAD_CLI.values(), ids=BAD_CLI.keys())
def test_bad_command_lines_exit_nonzero_with_the_reason(args, code, needle):
    proc = _cli(*args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == code and needle in out, (
        f"python -m extensible_kv {' '.join(args)}: expected exit {code} mentioning {needle!r}, got "
        f"{proc.returncode}:\n{out[-1500:]}"
    )
