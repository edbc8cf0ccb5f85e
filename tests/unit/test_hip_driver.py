"""The HIP driver's logic on a CPU: hip-python is replaced by a recording fake (``_fake_hip.FakeHip``).

What is checked: the probe's messages; the granularity is the Recommended one, queried and never assumed; handle
chunking at 256 MiB rounded to the granularity; reserve alignment; ``hipMemMap`` only ever with offset 0; one
``hipMemSetAccess`` per mapping, with a host descriptor when host access is on; and that a failure of any call of a
growth step leaves every handle released and every range of the step unmapped. Nothing here needs a GPU,
hip-python or ROCm; what it cannot show (the real runtime's behaviour) is listed in ``ci/README.md``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import extensible_kv.drivers.hip as hip_driver
from extensible_kv import ExtensibleTensor
from extensible_kv.drivers import Ledger
from extensible_kv.errors import CommitError, CommitOutOfMemory, DriverError, DriverOutOfMemory, DriverUnavailable

from ._fake_hip import (
    KIB,
    LOCATION_DEVICE,
    LOCATION_HOST,
    MIB,
    READ_WRITE,
    FakeHip,
    FakePointer,
    hipError_t,
    hipMemAllocationGranularity_flags,
    hipMemAllocationType,
)

GIB = 1 << 30
STREAM = 0x5EED  # the hipStream_t torch would hand out; tests stand in for torch's current stream
VMM_CALLS = ("hipMemCreate", "hipMemMap", "hipMemRelease", "hipMemSetAccess", "hipMemUnmap", "hipMemsetD8Async")


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch):
    """Put a FakeHip where hip-python would be and report torch as a working ROCm build."""

    def put(fake: FakeHip, *, torch_ok: bool = True) -> FakeHip:
        monkeypatch.setattr(hip_driver, "_bindings", lambda: fake)
        if torch_ok:
            monkeypatch.setattr(hip_driver, "_torch_reason", lambda ordinal: None)
        return fake

    return put


@pytest.fixture
def make(install, monkeypatch: pytest.MonkeyPatch):
    """``make(fake=None, **driver_kwargs) -> (driver, fake)``: a HipDriver over a FakeHip."""

    def build(fake: FakeHip | None = None, **kwargs) -> tuple[hip_driver.HipDriver, FakeHip]:
        fake = install(fake or FakeHip())
        drv = hip_driver.HipDriver(**kwargs)
        monkeypatch.setattr(drv, "_current_stream", lambda: STREAM)
        return drv, fake

    return build


def vmm_names(fake: FakeHip, since: int = 0) -> list[str]:
    return [c.name for c in fake.calls[since:] if c.name in VMM_CALLS]


def ranges(fake: FakeHip, name: str, since: int = 0) -> list[tuple[int, int]]:
    return [(c.args[0], c.args[1]) for c in fake.calls_of(name, since)]


def assert_nothing_held(fake: FakeHip) -> None:
    left = fake.outstanding()
    assert not any(left.values()), f"expected nothing reserved, held or mapped in the fake, found {left}"


# -- probe ----------------------------------------------------------------------------------------------------------
PROBE_CASES = {
    "library does not load": (
        dict(init_raises=OSError("libamdhip64.so: cannot open shared object file")),
        0,
        "the HIP runtime library (libamdhip64.so) could not be loaded (libamdhip64.so",
    ),
    "hipInit fails": (dict(init_error=hipError_t.hipErrorNoDevice), 0, "hipInit failed: hipErrorNoDevice"),
    "no device at all": (dict(devices=0), 0, "no HIP device 0 (found 0)"),
    "ordinal past the devices": (dict(devices=2), 2, "no HIP device 2 (found 2)"),
    "no VMM support": (dict(vmm=False), 0, "HIP device 0 does not support virtual memory management"),
}


@pytest.mark.parametrize(("fake_kwargs", "ordinal", "expected"), PROBE_CASES.values(), ids=PROBE_CASES.keys())
def test_probe_names_the_reason_the_driver_cannot_run(install, fake_kwargs, ordinal, expected):
    install(FakeHip(**fake_kwargs))
    reason = hip_driver.probe(ordinal)
    assert reason is not None and reason.startswith(expected), (
        f"probe({ordinal}) with {fake_kwargs}: expected a reason starting {expected!r}, got {reason!r}"
    )
    with pytest.raises(DriverUnavailable) as info:
        hip_driver.HipDriver(ordinal)
    assert str(info.value) == reason, f"HipDriver({ordinal}): expected DriverUnavailable({reason!r}), got {info.value}"


def test_probe_says_hip_python_is_not_installed(monkeypatch):
    def missing():
        raise ModuleNotFoundError("No module named 'hip'")

    monkeypatch.setattr(hip_driver, "_bindings", missing)
    reason = hip_driver.probe()
    assert reason == (
        "hip-python is not installed (No module named 'hip'); install the 'rocm' extra (pip install -e .[rocm])"
    ), f"probe() without hip-python: got {reason!r}"


@pytest.mark.skipif(importlib.util.find_spec("hip") is not None, reason="hip-python is installed here")
def test_probe_without_hip_python_on_this_machine_says_so():
    reason = hip_driver.probe()
    assert reason is not None and reason.startswith("hip-python is not installed ("), (
        f"probe() on a machine without hip-python: expected 'hip-python is not installed (...', got {reason!r}"
    )


@pytest.mark.skipif(bool(getattr(torch.version, "hip", None)), reason="torch here is a ROCm build")
def test_probe_says_torch_is_not_a_rocm_build(install):
    install(FakeHip(), torch_ok=False)
    reason = hip_driver.probe()
    assert reason is not None and "was built without ROCm (torch.version.hip is None)" in reason, (
        f"probe() with a working fake HIP but a torch without ROCm: got {reason!r}"
    )


def test_probe_passes_when_hip_a_device_and_vmm_are_there(install):
    install(FakeHip())
    reason = hip_driver.probe()
    assert reason is None, f"probe() on a VMM-capable fake device: expected None, got {reason!r}"


# -- granularity, chunk size, reserve ---------------------------------------------------------------------------------
@pytest.mark.parametrize("recommended", [4 * KIB, 2 * MIB, 64 * MIB], ids=["4KiB", "2MiB", "64MiB"])
def test_granularity_is_queried_as_recommended_never_assumed(make, recommended):
    drv, fake = make(FakeHip(recommended=recommended, minimum=4 * KIB))
    queries = fake.calls_of("hipMemGetAllocationGranularity")
    assert [c.args[1] for c in queries] == [hipMemAllocationGranularity_flags.hipMemAllocationGranularityRecommended], (
        f"expected one granularity query with the Recommended flag, got {[c.args[1] for c in queries]}"
    )
    prop = queries[0].args[0]
    got = (prop.garbage_fields(), prop.type, int(prop.location.type), prop.location.id)
    assert got == ([], hipMemAllocationType.hipMemAllocationTypePinned, LOCATION_DEVICE, 0), (
        f"allocation properties: expected (no unset field, pinned, device location, ordinal 0), got {got}"
    )
    assert drv.granularity() == recommended, f"granularity(): expected {recommended}, got {drv.granularity()}"
    t = ExtensibleTensor(16 * recommended, driver=drv)
    try:
        ((size, alignment, _, _),) = [c.args for c in fake.calls_of("hipMemAddressReserve")]
        assert (size, alignment, t.base_address % recommended) == (16 * recommended, recommended, 0), (
            f"reserve: expected ({16 * recommended}, alignment {recommended}, aligned base), got "
            f"({size}, {alignment}, base % g = {t.base_address % recommended})"
        )
    finally:
        t.close()
    assert_nothing_held(fake)


@pytest.mark.parametrize(
    ("granularity", "expected"),
    [(4 * KIB, 256 * MIB), (2 * MIB, 256 * MIB), (6 * MIB, 252 * MIB), (192 * MIB, 192 * MIB), (512 * MIB, 512 * MIB)],
)
def test_max_handle_bytes_is_256_mib_rounded_down_to_the_granularity(make, granularity, expected):
    drv, _ = make(FakeHip(recommended=granularity))
    assert hip_driver.HANDLE_CHUNK_BYTES == 256 * MIB
    assert drv.max_handle_bytes == expected, (
        f"granularity {granularity}: expected max_handle_bytes {expected}, got {drv.max_handle_bytes}"
    )


def test_reserve_passes_size_and_alignment_and_returns_an_int(make):
    drv, fake = make()
    g = drv.granularity()
    va = drv.reserve(8 * g, 4 * g)
    assert [c.args for c in fake.calls_of("hipMemAddressReserve")] == [(8 * g, 4 * g, 0, 0)], (
        f"expected hipMemAddressReserve(size, alignment, 0, 0), got {fake.calls_of('hipMemAddressReserve')}"
    )
    assert type(va) is int and not isinstance(va, FakePointer) and va % (4 * g) == 0, (
        f"reserve returned {va!r}: expected an int aligned to {4 * g}"
    )
    drv.free(va, 8 * g)
    assert ranges(fake, "hipMemAddressFree") == [(va, 8 * g)]
    assert_nothing_held(fake)


def test_reserve_over_reserves_when_hip_ignores_the_alignment(make):
    drv, fake = make(FakeHip(ignore_alignment=True))
    g = drv.granularity()
    va = drv.reserve(8 * g, 4 * g)
    assert va % (4 * g) == 0, f"reserve returned {va:#x}, not aligned to {4 * g}"
    sizes = [c.args[0] for c in fake.calls_of("hipMemAddressReserve")]
    assert sizes == [8 * g, 12 * g] and fake.count("hipMemAddressFree") == 1, (
        f"expected a misaligned reservation freed and one of size + alignment taken, got reserve sizes {sizes}"
    )
    ((raw, raw_size),) = fake.reservations.items()
    assert raw <= va and va + 8 * g <= raw + raw_size, "the aligned range must lie inside the underlying reservation"
    drv.free(va, 8 * g)
    assert_nothing_held(fake)


# -- map, unmap, set_access -------------------------------------------------------------------------------------------
def test_map_uses_offset_zero_and_refuses_any_other_offset(make):
    drv, fake = make()
    g = drv.granularity()
    va = drv.reserve(4 * g, g)
    handle = drv.create(2 * g)
    drv.map(va, 2 * g, handle, 0)
    assert [c.args for c in fake.calls_of("hipMemMap")] == [(va, 2 * g, 0, handle, 0)], (
        f"expected hipMemMap(va, size, offset 0, handle, flags 0), got {fake.calls_of('hipMemMap')}"
    )
    before = fake.count("hipMemMap")
    with pytest.raises(DriverError) as info:
        drv.map(va + 2 * g, g, handle, g)
    assert info.value.operation == "map" and "offset must be 0" in str(info.value), (
        f"map with offset {g}: expected a DriverError naming the offset rule, got {info.value}"
    )
    assert fake.count("hipMemMap") == before, "a refused offset must not reach hipMemMap"
    drv.unmap(va, 2 * g)
    drv.release(handle)
    drv.free(va, 4 * g)
    assert_nothing_held(fake)


def test_set_access_issues_one_call_per_mapping_in_the_range(make):
    drv, fake = make()
    g = drv.granularity()
    va = drv.reserve(8 * g, g)
    sizes = [g, 3 * g, 2 * g]
    starts = [va, va + g, va + 4 * g]
    handles = [drv.create(s) for s in sizes]
    for start, size, h in zip(starts, sizes, handles):
        drv.map(start, size, h)
    drv.set_access(va, 6 * g)
    assert ranges(fake, "hipMemSetAccess") == list(zip(starts, sizes)), (
        f"set_access over 3 mappings: expected one hipMemSetAccess per mapping {list(zip(starts, sizes))}, got "
        f"{ranges(fake, 'hipMemSetAccess')}"
    )
    assert all(drv.accessible(s) for s in starts) and not drv.accessible(va + 6 * g)
    before = fake.count("hipMemSetAccess")
    with pytest.raises(DriverError) as info:
        drv.set_access(va + 4 * g, 4 * g)  # the last 2 granules are not mapped
    assert info.value.operation == "set_access" and fake.count("hipMemSetAccess") == before, (
        f"set_access over a partly unmapped range: expected a DriverError before any HIP call, got {info.value}"
    )
    for start, size, h in zip(starts, sizes, handles):
        drv.unmap(start, size)
        drv.release(h)
    drv.free(va, 8 * g)
    assert_nothing_held(fake)


def test_unmap_and_free_refuse_what_hip_cannot_undo(make):
    drv, fake = make()
    g = drv.granularity()
    va = drv.reserve(4 * g, g)
    handles = [drv.create(g), drv.create(g)]
    drv.map(va, g, handles[0])
    drv.map(va + g, g, handles[1])
    with pytest.raises(DriverError, match="not exactly one live mapping"):
        drv.unmap(va, 2 * g)  # two mappings in one call: ROCR-Runtime#285
    with pytest.raises(DriverError, match="still has 2 mapping"):
        drv.free(va, 4 * g)
    assert fake.count("hipMemUnmap") == 0 and fake.count("hipMemAddressFree") == 0, (
        "refused unmap/free calls must not reach HIP"
    )
    for i, h in enumerate(handles):
        drv.unmap(va + i * g, g)
        drv.release(h)
    drv.free(va, 4 * g)
    assert_nothing_held(fake)


# -- growth through ExtensibleTensor --------------------------------------------------------------------------------
def test_growing_by_1_gib_at_2_mib_makes_four_256_mib_handles_each_mapped_and_accessed_once(make):
    drv, fake = make(FakeHip(recommended=2 * MIB))
    t = ExtensibleTensor(2 * GIB, driver=drv)
    before = len(fake.calls)
    t.resize_per_segment_(GIB, zero_new=False)
    creates = [c.args[0] for c in fake.calls_of("hipMemCreate", before)]
    assert creates == [256 * MIB] * 4, f"growing by 1 GiB: expected 4 hipMemCreate of 256 MiB, got {creates}"
    chunks = [(t.base_address + i * 256 * MIB, 256 * MIB) for i in range(4)]
    maps = [(c.args[0], c.args[1], c.args[2]) for c in fake.calls_of("hipMemMap", before)]
    assert maps == [(va, size, 0) for va, size in chunks], f"expected 4 maps at offset 0 covering 1 GiB, got {maps}"
    assert ranges(fake, "hipMemSetAccess", before) == chunks, (
        f"expected one hipMemSetAccess per 256 MiB mapping, got {ranges(fake, 'hipMemSetAccess', before)}"
    )
    order = vmm_names(fake, before)
    assert order == ["hipMemCreate", "hipMemMap", "hipMemRelease"] * 4 + ["hipMemSetAccess"] * 4, (
        f"expected create, map, release per chunk, then access per mapping; got {order}"
    )
    assert not fake.live_handles() and len(fake.mappings) == 4
    t.close()
    assert sorted(ranges(fake, "hipMemUnmap")) == chunks and fake.count("hipMemAddressFree") == 1
    assert_nothing_held(fake)


def test_zero_new_memsets_on_the_current_stream_after_access(make):
    drv, fake = make()
    t = ExtensibleTensor(GIB, num_segments=2, driver=drv)
    before = len(fake.calls)
    t.resize_per_segment_(64 * MIB)
    memsets = [c.args for c in fake.calls_of("hipMemsetD8Async", before)]
    expected = [(t.base_address, 0, 64 * MIB, STREAM), (t.base_address + 512 * MIB, 0, 64 * MIB, STREAM)]
    assert memsets == expected, f"expected one memset per new range on torch's stream {expected}, got {memsets}"
    assert vmm_names(fake, before)[-2:] == ["hipMemsetD8Async"] * 2, "zeroing must follow every access grant"
    t.close()
    assert_nothing_held(fake)


HOST_CASES = {
    "forced on": (dict(host_access=True), dict(large_bar=False), True),
    "forced off on large BAR": (dict(host_access=False), dict(large_bar=True), False),
    "auto, large BAR": (dict(), dict(large_bar=True), True),
    "auto, small BAR": (dict(), dict(large_bar=False), False),
    "auto, bindings without Host": (dict(), dict(large_bar=True, host_location=False), False),
}


@pytest.mark.parametrize(("driver_kwargs", "fake_kwargs", "host"), HOST_CASES.values(), ids=HOST_CASES.keys())
def test_access_descriptors_grant_the_device_and_the_host_when_host_access_is_on(
    make, driver_kwargs, fake_kwargs, host
):
    drv, fake = make(FakeHip(**fake_kwargs), **driver_kwargs)
    assert drv.host_access is host, (
        f"{driver_kwargs} on {fake_kwargs}: expected host_access={host}, got {drv.host_access}"
    )
    t = ExtensibleTensor(GIB, driver=drv)
    t.resize_per_segment_(512 * MIB, zero_new=False)
    expected = ((LOCATION_DEVICE, 0, READ_WRITE),) + (((LOCATION_HOST, 0, READ_WRITE),) if host else ())
    got = {(c.args[2], c.args[3]) for c in fake.calls_of("hipMemSetAccess")}
    assert got == {(expected, len(expected))}, f"expected every hipMemSetAccess to carry {expected}, got {got}"
    t.close()
    assert_nothing_held(fake)


def test_host_access_forced_on_without_host_location_in_the_bindings_is_unavailable(make):
    with pytest.raises(DriverUnavailable, match="hipMemLocationTypeHost"):
        make(FakeHip(host_location=False), host_access=True)


def test_calls_run_on_the_driver_device_and_restore_the_threads_device(make):
    drv, fake = make(FakeHip(devices=2, current_device=0), ordinal=1)
    fake.current_device = 0  # torch's choice on this thread
    t = ExtensibleTensor(GIB, driver=drv)
    before = len(fake.calls)
    t.resize_per_segment_(256 * MIB, zero_new=False)
    step = [(c.name, c.args) for c in fake.calls[before:] if c.name in ("hipSetDevice", "hipMemCreate")]
    assert step[:3] == [("hipSetDevice", (1,)), step[1], ("hipSetDevice", (0,))] and step[1][0] == "hipMemCreate", (
        f"expected hipMemCreate between hipSetDevice(1) and hipSetDevice(0), got {step[:3]}"
    )
    assert step[1][1][1].location.id == 1 and fake.current_device == 0
    descs = {c.args[2] for c in fake.calls_of("hipMemSetAccess")}
    assert descs == {((LOCATION_DEVICE, 1, READ_WRITE),)}, f"expected device 1 access, got {descs}"
    t.close()
    assert_nothing_held(fake)


# -- rollback -------------------------------------------------------------------------------------------------------
LAYOUTS = {
    "1 segment, +1 GiB": dict(segments=1, first=0, per=GIB),
    "2 segments, +512 MiB each": dict(segments=2, first=0, per=512 * MIB),
    "after a 256 MiB step, +768 MiB": dict(segments=1, first=256 * MIB, per=GIB),
}
FAILING = {"hipMemCreate": "create", "hipMemMap": "map", "hipMemRelease": "release", "hipMemSetAccess": "set_access"}


def _tensor(drv, segments: int, first: int) -> ExtensibleTensor:
    t = ExtensibleTensor(2 * GIB, num_segments=segments, driver=drv)
    if first:
        t.resize_per_segment_(first, zero_new=False)
    return t


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("fn", FAILING)
def test_failure_at_every_call_of_a_growth_step_releases_every_handle_and_unmaps_every_range(make, layout, fn):
    drv, fake = make()  # a twin run measures how many calls of fn the step makes
    t = _tensor(drv, layout["segments"], layout["first"])
    before = len(fake.calls)
    t.resize_per_segment_(layout["per"], zero_new=False)
    total = fake.count(fn, before)
    t.close()
    assert total >= 3, f"the swept step should make several {fn} calls, made {total}"
    for k in range(1, total + 1):
        drv, fake = make()
        t = _tensor(drv, layout["segments"], layout["first"])
        kept = dict(fake.mappings)
        before = len(fake.calls)
        fake.fail(fn, k)
        with pytest.raises(CommitError) as info:
            t.resize_per_segment_(layout["per"], zero_new=False)
        where = f"{fn} call {k} of {total} failing"
        assert info.value.operation == FAILING[fn], f"{where}: CommitError names {info.value.operation!r}"
        assert t.bytes_per_segment == layout["first"], f"{where}: size changed to {t.bytes_per_segment}"
        assert not fake.live_handles(), f"{where}: handles never released: {fake.live_handles()}"
        assert fake.mappings == kept, (
            f"{where}: expected exactly the mappings from before the step, found {sorted(fake.mappings)}"
        )
        made = ranges(fake, "hipMemMap", before)
        undone = ranges(fake, "hipMemUnmap", before)
        succeeded = made[:-1] if fn == "hipMemMap" else made
        assert sorted(undone) == sorted(succeeded), (
            f"{where}: expected every range the step mapped to be unmapped once, mapped {succeeded}, unmapped {undone}"
        )
        t.resize_per_segment_(layout["per"], zero_new=False)  # still usable: the same step now succeeds
        t.close()
        assert_nothing_held(fake)


def test_out_of_memory_is_typed_all_the_way_up(make):
    drv, fake = make()
    t = ExtensibleTensor(2 * GIB, driver=drv)
    fake.fail("hipMemCreate", 3, hipError_t.hipErrorOutOfMemory)
    with pytest.raises(CommitOutOfMemory) as info:
        t.resize_per_segment_(GIB, zero_new=False)
    cause = info.value.__cause__
    assert (
        isinstance(cause, DriverOutOfMemory) and "hipMemCreate(" in str(cause) and "hipErrorOutOfMemory" in str(cause)
    ), f"expected a DriverOutOfMemory naming hipMemCreate, got {cause!r}"
    assert not fake.live_handles() and not fake.mappings
    t.close()
    assert_nothing_held(fake)


def test_driver_errors_name_the_operation_the_call_and_the_hip_error(make):
    drv, fake = make()
    g = drv.granularity()
    va = drv.reserve(2 * g, g)
    handle = drv.create(g)
    fake.fail("hipMemMap")
    with pytest.raises(DriverError) as info:
        drv.map(va, g, handle)
    message = str(info.value)
    assert info.value.operation == "map" and f"hipMemMap({va:#x}" in message and "hipErrorInvalidValue" in message, (
        f"expected a map DriverError naming hipMemMap, the address and the HIP error, got {message!r}"
    )
    drv.map(va, g, handle)  # the failed call left no record behind
    drv.unmap(va, g)
    drv.release(handle)
    drv.free(va, 2 * g)
    assert_nothing_held(fake)


def test_the_driver_keeps_the_protocol_under_a_ledger(make):
    drv, fake = make()
    ledger = Ledger(drv)
    t = ExtensibleTensor(2 * GIB, num_segments=4, driver=ledger)
    t.resize_per_segment_(3 * MIB, zero_new=False)
    t.resize_per_segment_(300 * MIB)
    assert ledger.mem_info()[1] == fake.total_bytes and drv.accessible(t.base_address)
    t.close()
    ledger.synchronize()
    assert not ledger.outstanding(), f"ledger after close: {ledger.outstanding()}"
    assert_nothing_held(fake)
