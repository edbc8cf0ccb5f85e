"""Bad input to the KV buffers and the command line: a typed error naming the values, and nothing half-done.

(The tensor's bad inputs are conformance rules, run on every driver; driver specs and the vLLM switches have their
own unit tests.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from extensible_kv.drivers import Ledger
from extensible_kv.drivers.host import HostDriver
from extensible_kv.errors import InvalidSizeError
from extensible_kv.kv_cache import ExtensibleKVCacheBuffers, KVBuffer
from extensible_kv.layout import AttentionLayer, LayoutError

from conformance import layouts

ROOT = Path(__file__).resolve().parents[2]


def _layer(name="l0"):
    return layouts.flash_nhd(name)


BAD_BUFFERS = {
    "no_buffers": ([], 10, InvalidSizeError, "at least one buffer"),
    "zero_blocks": ([KVBuffer("b", layouts.PAGE, (_layer(),))], 0, InvalidSizeError, "max_num_blocks"),
    "negative_blocks": ([KVBuffer("b", layouts.PAGE, (_layer(),))], -3, InvalidSizeError, "-3"),
    "float_blocks": ([KVBuffer("b", layouts.PAGE, (_layer(),))], 10.0, InvalidSizeError, "int"),
    "duplicate_buffer": ([KVBuffer("b", layouts.PAGE, (_layer("x"),)), KVBuffer("b", layouts.PAGE, (_layer("y"),))],
                         10, InvalidSizeError, "duplicate buffer"),
    "duplicate_layer": ([KVBuffer("a", layouts.PAGE, (_layer(),)), KVBuffer("b", layouts.PAGE, (_layer(),))], 10,
                        InvalidSizeError, "duplicate layer"),
    "zero_page": ([KVBuffer("b", 0, (_layer(),))], 10, InvalidSizeError, "page_size_bytes"),
    "page_too_small": ([KVBuffer("b", layouts.PAGE // 2, (_layer(),))], 10, LayoutError, "needs 8192 bytes"),
    "layouts_disagree": ([KVBuffer("b", layouts.PAGE, (_layer("x"), layouts.kv_first("y")))], 10, LayoutError,
                         "disagree"),
    "order_not_a_permutation": ([KVBuffer("b", layouts.PAGE, (AttentionLayer(
        "x", lambda b: (b, 2, 16, 128), (0, 1, 2), torch.bfloat16),))], 10, LayoutError, "not a permutation"),
    "layers_and_segments": ([KVBuffer("b", layouts.PAGE, (_layer(),), num_segments=2)], 10, LayoutError,
                            "not both"),
    "zero_segments": ([KVBuffer("b", layouts.PAGE, num_segments=0)], 10, InvalidSizeError, "num_segments"),
}


@pytest.mark.parametrize("buffers,blocks,error,needle", BAD_BUFFERS.values(), ids=BAD_BUFFERS.keys())
def test_bad_kv_buffers_raise_and_reserve_nothing(buffers, blocks, error, needle):
    ledger = Ledger(HostDriver(granularity=4096))
    with pytest.raises(error, match=needle):
        ExtensibleKVCacheBuffers(buffers, blocks, driver=ledger)
    assert not ledger.outstanding(), f"ExtensibleKVCacheBuffers({needle}): left {ledger.outstanding()}"


def test_unknown_layer_and_buffer_names_are_refused():
    cache = ExtensibleKVCacheBuffers([KVBuffer("b", layouts.PAGE, (_layer(),))], 10, driver="host-4k")
    with pytest.raises(InvalidSizeError, match="unknown layer 'nope'"):
        cache.layer_views("nope")
    with pytest.raises(InvalidSizeError, match="unknown buffer 'nope'"):
        cache.tensor("nope")
    cache.close()


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "reference"), str(ROOT)]))
    return subprocess.run([sys.executable, "-m", "extensible_kv", *args], capture_output=True, text=True, env=env,
                          timeout=120)


BAD_CLI = {
    "no_command": ((), 2, "required"),
    "unknown_command": (("frobnicate",), 2, "invalid choice"),
    "bad_dtype": (("validate-backend", "x:y", "--dtype", "float7"), 2, "--dtype 'float7' is not a torch dtype"),
    "bad_layout": (("validate-backend", "x:y", "--layout", "XYZ"), 2, "invalid choice"),
    "missing_module": (("validate-backend", "no_such_module:Backend", "--driver", "host"), 1,
                       "could not be loaded"),
    "not_a_backend": (("validate-backend", "conformance.layouts:flash_nhd", "--driver", "host"), 1,
                      "has no attribute 'get_kv_cache_shape'"),
    "bad_driver": (("validate-backend", "tests.unit._factories:KVFirstBackend", "--driver", "nope"), 1,
                   "unknown driver 'nope'"),
}


@pytest.mark.parametrize("args,code,needle", BAD_CLI.values(), ids=BAD_CLI.keys())
def test_bad_command_lines_exit_nonzero_with_the_reason(args, code, needle):
    proc = _cli(*args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == code and needle in out, \
        f"python -m extensible_kv {' '.join(args)}: expected exit {code} mentioning {needle!r}, got " \
        f"{proc.returncode}:\n{out[-1500:]}"
