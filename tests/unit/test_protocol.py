"""The protocol's method names are written once (``DRIVER_METHODS``): the ``Driver`` class defines exactly those, in
that order, and what else lists them (the Ledger's operations, lists of some of them) is derived or checked; the
helper a GPU driver builds its tensors with (``DeviceArray``) is public."""

from __future__ import annotations

import pytest

from extensible_kv import drivers
from extensible_kv.drivers import (
    DRIVER_ATTRIBUTES,
    DRIVER_METHODS,
    DeviceArray,
    Driver,
    Ledger,
    cuda,
    hip,
    protocol_methods,
)
from extensible_kv.drivers.host import HostDriver
from extensible_kv.drivers.ledger import OPERATIONS, QUERIES


def test_the_protocol_class_defines_exactly_the_driver_methods_in_their_order():
    methods = tuple(name for name, value in vars(Driver).items() if callable(value) and not name.startswith("_"))
    attributes = tuple(vars(Driver)["__annotations__"])
    got = (methods, attributes)
    assert got == (DRIVER_METHODS, DRIVER_ATTRIBUTES), (
        f"Driver: expected methods {DRIVER_METHODS} and attributes {DRIVER_ATTRIBUTES}, got {got}"
    )


def test_each_protocol_method_has_its_contract_in_its_docstring():
    missing = [name for name in DRIVER_METHODS if "Rules:" not in (getattr(Driver, name).__doc__ or "")]
    assert missing == [], f"Driver methods without a docstring naming their rules: {missing}"


@pytest.mark.parametrize(
    "cls", [Ledger, HostDriver, cuda.CudaDriver, hip.HipDriver], ids=["Ledger", "HostDriver", "CudaDriver", "HipDriver"]
)
def test_every_driver_class_implements_every_protocol_method(cls):
    missing = [name for name in DRIVER_METHODS if not callable(getattr(cls, name, None))]
    assert missing == [], f"{cls.__name__}: expected every protocol method, missing {missing}"


def test_the_ledger_records_every_protocol_method_but_the_queries_in_the_protocols_order():
    got = (OPERATIONS, set(OPERATIONS) | set(QUERIES), set(OPERATIONS) & set(QUERIES))
    want = (tuple(m for m in DRIVER_METHODS if m not in QUERIES), set(DRIVER_METHODS), set())
    assert got == want, f"Ledger OPERATIONS and QUERIES: expected {want}, got {got}"


@pytest.mark.parametrize("op", OPERATIONS)
def test_the_ledger_can_fail_each_operation(op):
    ledger = Ledger(HostDriver(granularity=4096))
    ledger.fail(op, 1)  # accepted
    ledger.clear_faults()


@pytest.mark.parametrize("op", QUERIES)
def test_the_ledger_refuses_to_fail_a_query(op):
    with pytest.raises(ValueError, match=f"cannot inject a failure into {op!r}"):
        Ledger(HostDriver(granularity=4096)).fail(op, 1)


def test_protocol_methods_returns_names_of_the_protocol_and_refuses_others():
    assert protocol_methods("create", "map") == ("create", "map")
    with pytest.raises(ValueError, match="not methods of the driver protocol: 'commit', 'set_acess'"):
        protocol_methods("create", "commit", "set_acess")


def test_device_array_is_public_and_describes_the_memory_and_holds_its_keeper():
    keeper = object()
    array = DeviceArray(0x7000_0000_0000, 8192, keeper)
    got = ("DeviceArray" in drivers.__all__, array.__cuda_array_interface__, array.keeper is keeper)
    want = (
        True,
        {
            "shape": (8192,),
            "typestr": "|u1",
            "data": (0x7000_0000_0000, False),
            "version": 3,
            "strides": None,
            "stream": None,
        },
        True,
    )
    assert got == want, f"extensible_kv.drivers.DeviceArray: expected {want}, got {got}"


def test_the_gpu_drivers_build_their_tensors_with_the_public_device_array():
    got = {m.__name__: m.DeviceArray is DeviceArray for m in (cuda, hip)}
    assert got == {cuda.__name__: True, hip.__name__: True}, f"expected both to use drivers.DeviceArray, got {got}"
