"""The CUDA driver's logic on a CPU: cuda-bindings is replaced by a recording fake (``_fake_cuda.FakeCuda``) whose
functions take exactly the arguments cuda-bindings' do.

What is checked: every protocol call is made through the bindings as they are called (argument counts, wrapper
results opened with ``int()``) and leaves the fake as the driver's records say; a native failure of each call is a
``DriverError`` naming the operation and the native call, and changes nothing; a call interrupted at any line of the
driver's code leaves its records equal to the fake's state. The rules (``check-driver cuda``) need a GPU; these run
wherever the package does, so a code path the rules reach only on a GPU is reached here first.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import extensible_kv.drivers.cuda as cuda_driver
import extensible_kv.drivers.records as records
from conformance.line_trap import Interrupt, LineTrap
from extensible_kv.errors import DriverError, DriverOutOfMemory

from ._fake_cuda import CUmemAllocationGranularity_flags, CUresult, FakeCuda

STREAM = 0x5EED  # the CUstream torch would hand out
MAX_LINES = 300


@pytest.fixture
def make(monkeypatch: pytest.MonkeyPatch) -> Callable[[], tuple[cuda_driver.CudaDriver, FakeCuda]]:
    """``make() -> (driver, fake)``: a CudaDriver over a FakeCuda, torch's CUDA calls stood in for."""

    def build() -> tuple[cuda_driver.CudaDriver, FakeCuda]:
        fake = FakeCuda()
        monkeypatch.setattr(cuda_driver, "_bindings", lambda: fake)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "init", lambda: None)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=STREAM))
        return cuda_driver.CudaDriver(), fake

    return build


def assert_records_match(drv: cuda_driver.CudaDriver, fake: FakeCuda, when: str) -> None:
    expected = (fake.reservations, {va: size for va, (size, _, _) in fake.mappings.items()}, fake.live_handles())
    actual = (drv._reservations, drv._mappings, drv._live)
    assert actual == expected, (
        f"driver cuda (over the fake), {when}: expected the records (reservations, mappings, live handles) "
        f"{expected}, the fake holds them; the driver records {actual}"
    )


def test_every_protocol_call_goes_through_the_bindings_and_leaves_what_the_records_say(make):
    drv, fake = make()
    g = fake.granularity
    granularity_call = next(args for name, args in fake.calls if name == "cuMemGetAllocationGranularity")
    got = (drv.granularity(), granularity_call[1], drv.mem_info())
    expected = (g, CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED, (fake.total, fake.total))
    assert got == expected, f"driver cuda: granularity, its flag and mem_info: expected {expected}, got {got}"
    va = drv.reserve(4 * g, 2 * g)
    handle = drv.create(2 * g)
    assert (type(va), type(handle), va % (2 * g)) == (int, int, 0), (
        f"reserve/create: expected aligned ints, got {va!r}, {handle!r}"
    )
    assert_records_match(drv, fake, "after reserve and create")
    drv.map(va + g, 2 * g, handle)
    before = (drv.accessible(va + g), drv.accessible(va))
    drv.set_access(va + g, 2 * g)
    after = (drv.accessible(va + g), drv.accessible(va + 2 * g), drv.accessible(va), drv.accessible(va + 3 * g))
    assert (before, after) == ((False, False), (True, True, False, False)), (
        f"driver cuda: accessible() at the mapping and beside it, before and after set_access: expected "
        f"((False, False), (True, True, False, False)), got {(before, after)}"
    )
    since = len(fake.calls)
    drv.zero(va + g, 2 * g)
    assert fake.calls[since:] == [("cuMemsetD8Async", (va + g, 0, 2 * g, STREAM))], (
        f"driver cuda: zero(va + g, 2 g): expected one cuMemsetD8Async on torch's stream, got {fake.calls[since:]}"
    )
    drv.release(handle)
    held = drv.mem_info()[0]
    drv.unmap(va + g, 2 * g)
    drv.free(va, 4 * g)
    got = (held, drv.mem_info()[0], fake.handles[1].released)
    expected = (fake.total - 2 * g, fake.total, True)
    assert got == expected, (
        f"driver cuda: free bytes released-but-mapped, then after unmap; released: expected {expected}, got {got}"
    )
    assert_records_match(drv, fake, "after everything is given back")
    assert not fake.reservations and not fake.mappings and fake.held() == 0


# Each case: the state to build (on the driver, with the fake), then the call to fail, as (op, native, call).
def _reserved(drv, g):
    return {"va": drv.reserve(4 * g, g)}


def _mapped(drv, g):
    state = _reserved(drv, g)
    state["handle"] = drv.create(2 * g)
    drv.map(state["va"], 2 * g, state["handle"])
    return state


def _accessible(drv, g):
    state = _mapped(drv, g)
    drv.set_access(state["va"], 2 * g)
    return state


CASES = {
    "reserve": (lambda drv, g: {}, "cuMemAddressReserve", lambda drv, g, s: drv.reserve(2 * g, g)),
    "free": (_reserved, "cuMemAddressFree", lambda drv, g, s: drv.free(s["va"], 4 * g)),
    "create": (lambda drv, g: {}, "cuMemCreate", lambda drv, g, s: drv.create(2 * g)),
    "release": (lambda drv, g: {"handle": drv.create(g)}, "cuMemRelease", lambda drv, g, s: drv.release(s["handle"])),
    "map": (
        lambda drv, g: {**_reserved(drv, g), "handle": drv.create(2 * g)},
        "cuMemMap",
        lambda drv, g, s: drv.map(s["va"] + g, 2 * g, s["handle"], 0),
    ),
    "unmap": (_mapped, "cuMemUnmap", lambda drv, g, s: drv.unmap(s["va"], 2 * g)),
    "set_access": (_mapped, "cuMemSetAccess", lambda drv, g, s: drv.set_access(s["va"], 2 * g)),
    "zero": (_accessible, "cuMemsetD8Async", lambda drv, g, s: drv.zero(s["va"], g)),
    "mem_info": (lambda drv, g: {}, "cuMemGetInfo", lambda drv, g, s: drv.mem_info()),
}


@pytest.mark.parametrize("op", list(CASES))
def test_a_native_failure_of_every_call_is_a_driver_error_naming_it_that_changes_nothing(make, op):
    drv, fake = make()
    build, native, call = CASES[op]
    state = build(drv, fake.granularity)
    snapshot = (dict(fake.reservations), dict(fake.mappings), fake.live_handles(), fake.held())
    fake.fail(native)
    with pytest.raises(DriverError) as caught:
        call(drv, fake.granularity, state)
    got = (type(caught.value).__name__, caught.value.operation, native in caught.value.detail)
    assert got == ("DriverError", op, True), (
        f"driver cuda: {op} with {native} failing: expected a DriverError naming {op!r} and {native}, got {got} "
        f"({caught.value})"
    )
    after = (dict(fake.reservations), dict(fake.mappings), fake.live_handles(), fake.held())
    assert after == snapshot, f"driver cuda: {op} refused natively: expected the fake unchanged {snapshot}, got {after}"
    assert_records_match(drv, fake, f"after {op} failed natively")
    call(drv, fake.granularity, state)  # taken once the native call works again: no record left half-changed
    assert_records_match(drv, fake, f"after {op} made again")


@pytest.mark.parametrize("op", ["reserve", "create"])
def test_out_of_memory_from_cuda_is_driver_out_of_memory(make, op):
    drv, fake = make()
    build, native, call = CASES[op]
    fake.fail(native, CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(DriverOutOfMemory) as caught:
        call(drv, fake.granularity, build(drv, fake.granularity))
    assert caught.value.operation == op, (
        f"driver cuda: {op} out of memory: expected operation {op!r}, got {caught.value.operation!r}"
    )


WATCHED = {str(Path(m.__file__).resolve()) for m in (cuda_driver, records)}


@pytest.mark.parametrize("op", [op for op in CASES if op not in ("zero", "mem_info")])
def test_a_call_interrupted_at_any_line_leaves_the_records_as_the_fake(make, op):
    build, _, call = CASES[op]
    for n in range(1, MAX_LINES):
        drv, fake = make()
        state = build(drv, fake.granularity)
        trap = LineTrap(lambda name: str(Path(name).resolve()) in WATCHED, n)
        try:
            with trap:
                call(drv, fake.granularity, state)
        except Interrupt:
            pass
        assert_records_match(drv, fake, f"{op} interrupted at line event {n} ({trap.fired})")
        if trap.fired is None:
            assert n > 1, f"driver cuda: {op} ran no line of cuda.py or records.py under the trap"
            return
    pytest.fail(f"driver cuda: {op} ran past {MAX_LINES} line events")
