"""The ``vllm`` driver against a fake of vLLM's VmmDriver: every call reaches vLLM's method as vLLM's tensor makes it,
errors come back typed, nothing is refused of its own; its probe; the caller-guaranteed profile and its selection."""

from __future__ import annotations

import ast
import ctypes
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from extensible_kv import drivers
from extensible_kv.drivers import vllm_vmm
from extensible_kv.drivers.vllm_vmm import VllmVmmDriver
from extensible_kv.errors import DriverError, DriverOutOfMemory

from ._fake_vllm import FakeVmm, G

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "conformance"


def _driver() -> tuple[VllmVmmDriver, FakeVmm]:
    vmm = FakeVmm()
    return VllmVmmDriver(vmm=vmm), vmm


def _ops(vmm: FakeVmm) -> list[str]:
    return [name for name, _ in vmm.calls]


def test_every_call_reaches_vllms_method_after_ensure_context():
    d, vmm = _driver()
    vmm.calls.clear()
    va = d.reserve(4 * G, G)
    h = d.create(2 * G)
    d.map(va, 2 * G, h)
    d.set_access(va, 2 * G)
    d.unmap(va, 2 * G)
    d.release(h)
    d.free(va, 4 * G)
    want = ["reserve", "create", "map", "set_access", "unmap", "release", "free_reserved"]
    assert _ops(vmm) == [x for op in want for x in ("ensure_context", op)], _ops(vmm)
    assert vmm.calls[3] == ("create", (2 * G, 0)), vmm.calls[3]
    assert vmm.calls[5] == ("map", (va, 2 * G, h)), vmm.calls[5]


def test_an_alignment_past_the_granularity_goes_to_vllms_reserve_binding():
    d, vmm = _driver()
    va = d.reserve(3 * G, 64 * G)
    assert va % (64 * G) == 0 and ("address_reserve", (3 * G, 64 * G)) in vmm.calls, (hex(va), vmm.calls)
    assert "reserve" not in _ops(vmm), vmm.calls


@pytest.mark.parametrize(("code", "kind"), [(2, DriverOutOfMemory), (1, DriverError), (801, DriverError)])
def test_vllms_runtime_error_becomes_the_typed_error_naming_operation_args_and_code(code, kind):
    d, vmm = _driver()
    vmm.fail["create"] = code
    with pytest.raises(kind) as info:
        d.create(5 * G)
    err = info.value
    assert (type(err), err.operation, err.code) == (kind, "create", code), (type(err), err.operation, err.code)
    assert hex(5 * G) in str(err) and "GPU driver error" in str(err), str(err)


def test_a_ctypes_refusal_of_vllms_signature_is_a_driver_error():
    d, vmm = _driver()

    def refuse(*args):
        raise ctypes.ArgumentError("argument 2: TypeError: wrong type")

    vmm.map = refuse
    with pytest.raises(DriverError) as info:
        d.map(64 * G, 1.5, 3)
    assert info.value.operation == "map" and "ArgumentError" in str(info.value), str(info.value)


def test_nothing_is_refused_that_vllms_driver_takes():
    d, vmm = _driver()
    va = d.reserve(2 * G, G)
    h = d.create(2 * G)
    d.map(va, 2 * G, h)
    d.map(va, 2 * G, h)  # a second mapping over a live one: left to vLLM's driver (and CUDA), which takes it here
    d.unmap(va + G, G)  # part of a mapping: likewise
    assert _ops(vmm).count("map") == 2 and _ops(vmm).count("unmap") == 1, vmm.calls


def test_a_mapping_offset_vllms_map_cannot_take_is_a_driver_error_naming_it_and_calls_nothing():
    d, vmm = _driver()
    before = len(vmm.calls)
    with pytest.raises(DriverError) as info:
        d.map(64 * G, G, 7, offset=G)
    assert info.value.operation == "map" and f"offset {G}" in str(info.value), str(info.value)
    assert vmm.calls[before:] == [], vmm.calls[before:]


def test_it_names_the_caller_guaranteed_profile_and_is_never_picked_unasked():
    d, _ = _driver()
    assert d.conformance_profile == "caller-guaranteed"
    assert drivers._REGISTRY["vllm"].auto is False and "vllm" in drivers.registered()


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        (None, "vLLM is not importable"),
        (types.SimpleNamespace(__version__="0.33.1"), "vLLM 0.33.1 has no VMM driver of its own"),
        (types.SimpleNamespace(__version__="0.26.0"), "vLLM 0.26.0 has no VMM driver of its own"),
    ],
)
def test_probe_says_why_vllms_driver_cannot_run(monkeypatch, module, expected):
    monkeypatch.setitem(sys.modules, "vllm", module)
    reason = drivers.probe("vllm")
    assert reason is not None and reason.startswith(expected), reason


def test_probe_of_a_vllm_with_the_driver_but_no_gpu_says_no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.34.0"))
    monkeypatch.setattr(vllm_vmm, "_vllm_module", lambda: object())
    monkeypatch.setattr(vllm_vmm.torch.cuda, "is_available", lambda: False)
    reason = drivers.probe("vllm")
    assert reason is not None and "no GPU device 0" in reason, reason


# -- the profile ---------------------------------------------------------------------------------------------------
def _rule_names() -> dict[str, set[str]]:
    """Rule function names per rule file, read from the source."""
    found = {}
    for path in RULES.glob("test_*.py"):
        tree = ast.parse(path.read_text())
        found[path.name] = {
            n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
        }
    return found


def test_every_rule_a_profile_or_the_tensor_selection_names_exists():
    from conformance import profiles, tensors

    every = set().union(*_rule_names().values())
    named = set(profiles.PROFILES["caller-guaranteed"]) | set(tensors.HELD_ON_VLLM)
    named |= {k.split("[")[0] for k in tensors.NOT_HELD_ON_VLLM}
    assert not named - every, f"names of no rule: {sorted(named - every)}"


def test_every_rule_of_the_tensor_files_is_held_or_not_held_on_vllm_with_a_reason():
    from conformance import tensors

    names = _rule_names()
    for file_name in tensors.TENSOR_RULE_FILES:
        for rule in names[file_name]:
            tensors.not_held(file_name, rule, None)  # LookupError for a rule in neither table
    with pytest.raises(LookupError, match="test_new_rule"):
        tensors.not_held("test_extensible_tensor.py", "test_new_rule", None)


def test_the_profile_reports_its_rules_not_held_per_rule_and_holds_the_rest():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "reference")])}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(RULES / "test_driver_contract.py"),
        "--driver",
        "tests.unit._fake_vllm:profiled_host",
        "-k",
        "map_over_mapped or granularity_is",
        "-p",
        "no:cacheprovider",
        "-q",
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    text = done.stdout + done.stderr
    assert done.returncode == 0 and "1 passed, 1 skipped" in text, text[-3000:]
    assert "rules not held (1)" in text, text[-3000:]
    line = next(x for x in text.splitlines() if "test_map_over_mapped_granule_is_refused" in x and "not held" in x)
    assert "not held: caller-guaranteed profile: a call vLLM's ExtensibleTensor never makes" in line, line


def test_an_unknown_profile_is_refused_naming_it():
    from conformance import profiles

    with pytest.raises(ValueError, match="'lenient'"):
        profiles.not_held("lenient", "test_map_over_mapped_granule_is_refused")
    assert profiles.not_held(None, "test_map_over_mapped_granule_is_refused") is None
