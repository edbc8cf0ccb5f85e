"""The driver registry: name and ``module:factory`` resolution, its typed errors, ordering and selection."""

from __future__ import annotations

import re

import pytest

from extensible_kv import drivers
from extensible_kv.errors import DriverLoadError, DriverUnavailable

FACTORIES = "tests.unit._factories"


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict:
    """A private copy of the registry, so entries a test adds are gone after it."""
    copy = dict(drivers._REGISTRY)
    monkeypatch.setattr(drivers, "_REGISTRY", copy)
    return copy


BAD_SPECS = {
    "unknown name": "no-such-driver",
    "empty string": "",
    "blank string": "   ",
    "int": 3,
    "None": None,
    "no factory": "extensible_kv.drivers:",
    "no module": ":host_4k",
    "module does not import": "tests.unit._no_such_module:make",
    "missing attribute": f"{FACTORIES}:no_such_factory",
    "non-callable attribute": f"{FACTORIES}:NOT_CALLABLE",
}


@pytest.mark.parametrize("spec", BAD_SPECS.values(), ids=BAD_SPECS.keys())
def test_get_driver_refuses_a_bad_spec_with_driver_load_error_naming_it(spec):
    with pytest.raises(DriverLoadError) as info:
        drivers.get_driver(spec)
    assert repr(spec) in str(info.value), (
        f"get_driver({spec!r}): expected a DriverLoadError naming {spec!r}, got {str(info.value)!r}"
    )


@pytest.mark.parametrize(
    ("factory", "missing"),
    [
        (
            "partial",
            [m for m in drivers.DRIVER_METHODS if m not in ("granularity", "reserve")] + ["device", "max_handle_bytes"],
        ),
        ("bare", [*drivers.DRIVER_METHODS, "name", "device", "max_handle_bytes"]),
    ],
)
def test_get_driver_refuses_a_factory_result_lacking_the_protocol_and_lists_what_is_missing(factory, missing):
    spec = f"{FACTORIES}:{factory}"
    with pytest.raises(DriverLoadError) as info:
        drivers.get_driver(spec)
    message = str(info.value)
    named = set(re.findall(r"\w+", message.rpartition("lacks the protocol's")[2]))
    assert spec in message and named == set(missing), (
        f"get_driver({spec!r}): expected a message naming the spec and exactly {sorted(missing)}, got {message!r}"
    )


@pytest.mark.skipif(drivers.probe("cuda") is None, reason="a CUDA driver can run here")
def test_get_driver_raises_driver_unavailable_for_cuda_without_a_gpu():
    with pytest.raises(DriverUnavailable) as info:
        drivers.get_driver("cuda")
    assert "'cuda'" in str(info.value), (
        f"get_driver('cuda'): expected DriverUnavailable naming 'cuda', got {str(info.value)!r}"
    )


def test_registered_lists_gpu_drivers_first_and_includes_the_host_drivers(registry):
    drivers.register("aaa-host", object, lambda: None, gpu=False)
    drivers.register("zzz-gpu", object, lambda: None, gpu=True)
    names = drivers.registered()
    gpu_flags = [registry[n].gpu for n in names]
    assert gpu_flags == sorted(gpu_flags, reverse=True) and {"host", "host-4k", "cuda"} <= set(names), (
        f"registered(): expected GPU drivers first and host, host-4k, cuda present, got {names} (gpu {gpu_flags})"
    )


def test_best_available_is_host_when_no_gpu_probe_passes(registry):
    for name, entry in list(registry.items()):
        if entry.gpu:
            drivers.register(name, entry.factory, lambda: "no device (test)", gpu=True)
    got = drivers.best_available()
    assert got == "host", f"best_available() with every GPU probe failing: expected 'host', got {got!r}"


def test_best_available_is_the_first_gpu_driver_whose_probe_passes(registry):
    drivers.register("aaa-gpu-down", object, lambda: "no device (test)", gpu=True)
    drivers.register("aab-gpu-up", object, lambda: None, gpu=True)
    got = drivers.best_available()
    assert got == "aab-gpu-up", (
        f"best_available() with 'aaa-gpu-down' failing and 'aab-gpu-up' passing: expected 'aab-gpu-up', got {got!r}"
    )


@pytest.mark.parametrize("name", ["pkg:factory", ":", "host:", ""])
def test_register_refuses_empty_names_and_names_containing_a_colon(registry, name):
    with pytest.raises(DriverLoadError):
        drivers.register(name, object, lambda: None, gpu=False)
    assert name not in registry, f"register({name!r}): expected the name left unregistered, got {sorted(registry)}"


def test_a_module_factory_spec_loads_a_working_driver():
    spec = f"{FACTORIES}:host_4k"
    drv = drivers.get_driver(spec)
    assert (drv.name, drv.granularity()) == ("unit-host-4k", 4096), (
        f"get_driver({spec!r}): expected ('unit-host-4k', 4096), got {(drv.name, drv.granularity())}"
    )
    va = drv.reserve(2 * 4096, 4096)
    handle = drv.create(4096)
    try:
        drv.map(va, 4096, handle)
        drv.set_access(va, 4096)
        data = drv.tensor(va, 4096, None)
        data.fill_(7)
        state = (drv.accessible(va), drv.accessible(va + 4096), int(data.sum()))
        del data
        drv.unmap(va, 4096)
    finally:
        drv.release(handle)
        drv.free(va, 2 * 4096)
    assert state == (True, False, 7 * 4096), (
        f"{spec} driver: expected (mapped, unmapped, sum) == (True, False, {7 * 4096}), got {state}"
    )


@pytest.mark.parametrize(
    ("source", "spec", "said"),
    [
        ("raise RuntimeError('no device here')\n", "ekv_unit_broken:make", "does not import: RuntimeError: no device"),
        ("def make(:\n", "ekv_unit_syntax:make", "does not import: SyntaxError"),
        ("def make(size):\n    return size\n", "ekv_unit_args:make", "make() raised TypeError"),
    ],
    ids=["import-raises", "syntax-error", "factory-needs-arguments"],
)
def test_a_module_that_does_not_import_or_a_factory_that_raises_is_a_driver_load_error(
    tmp_path, monkeypatch, source, spec, said
):
    # wrong: only ImportError was caught: the module's own error, a SyntaxError or the factory's TypeError escaped
    module = spec.partition(":")[0]
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(DriverLoadError, match=re.escape(said)):
        drivers.get_driver(spec)


def test_a_typed_refusal_of_the_factory_is_raised_as_it_is(tmp_path, monkeypatch):
    (tmp_path / "ekv_unit_unavailable.py").write_text(
        "from extensible_kv.errors import DriverUnavailable\n\ndef make():\n    raise DriverUnavailable('no GPU')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(DriverUnavailable, match="no GPU"):
        drivers.get_driver("ekv_unit_unavailable:make")
