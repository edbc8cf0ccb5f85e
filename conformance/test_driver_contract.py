"""Rules of the driver protocol itself, one per test (see extensible_kv.drivers._protocol)."""

from __future__ import annotations

import gc
import weakref

import pytest

from extensible_kv import drivers
from extensible_kv.errors import DriverError

from .helpers import expect, expect_bytes, expect_equal, granule_states, host_kernel, pattern


@pytest.fixture
def reservation(driver):
    """Four granules reserved (and freed after the test)."""
    g = driver.granularity()
    va = driver.reserve(4 * g, g)
    yield va
    for m_va, size in sorted(driver.outstanding().mappings.items()):
        driver.unmap(m_va, size)
    driver.free(va, 4 * g)


def _map(driver, va, size, access=True):
    h = driver.create(size)
    driver.map(va, size, h, 0)
    driver.release(h)
    if access:
        driver.set_access(va, size)


def test_granularity_is_a_positive_multiple_of_4096(driver):
    g = driver.granularity()
    expect(isinstance(g, int) and g > 0 and g % 4096 == 0, driver, "granularity", "a positive multiple of 4096", g)


def test_reserve_is_aligned_and_not_accessible(driver, reservation):
    g = driver.granularity()
    expect(reservation % g == 0, driver, "reserve", f"an address aligned to {g}", hex(reservation))
    states = granule_states(driver, reservation, 4 * g)
    expect_equal(driver, "accessible after reserve", [False] * 4, states)


def test_mapping_alone_grants_no_access(driver, reservation):
    g = driver.granularity()
    _map(driver, reservation, g, access=False)
    expect_equal(driver, "accessible after map without set_access", False, driver.accessible(reservation))


def test_set_access_makes_mapped_range_readable_and_writable(driver, reservation):
    g = driver.granularity()
    _map(driver, reservation, 2 * g)
    states = granule_states(driver, reservation, 4 * g)
    expect_equal(driver, "accessible after map+set_access of 2 granules", [True, True, False, False], states)
    data = pattern(2 * g, 1, driver.device)
    driver.tensor(reservation, 2 * g, None).copy_(data)
    expect_bytes(driver, "read back after write", driver.tensor(reservation, 2 * g, None), data)


def test_unmap_returns_range_to_reserved(driver, reservation):
    g = driver.granularity()
    _map(driver, reservation, g)
    driver.synchronize()
    driver.unmap(reservation, g)
    expect_equal(driver, "accessible after unmap", False, driver.accessible(reservation))


def test_map_over_mapped_granule_is_refused(driver, reservation):
    # Asked of the driver itself: the ledger would refuse first.
    g = driver.granularity()
    _map(driver, reservation, 2 * g)
    h = driver.inner.create(g)
    try:
        with pytest.raises(DriverError) as info:
            driver.inner.map(reservation + g, g, h, 0)
            driver.inner.unmap(reservation + g, g)  # the driver accepted it; undo so teardown stays sane
        expect_equal(
            driver,
            "operation of the DriverError from a map over a mapped granule",
            "map",
            info.value.operation,
            error=repr(info.value),
        )
    finally:
        driver.inner.release(h)


def test_unmap_of_a_subrange_is_refused(driver, reservation):
    g = driver.granularity()
    _map(driver, reservation, 2 * g)
    driver.synchronize()
    with pytest.raises(DriverError):
        driver.inner.unmap(reservation, g)
    expect_equal(driver, "accessible after a refused partial unmap", True, driver.accessible(reservation))


def test_map_outside_a_reservation_is_refused(driver, reservation):
    g = driver.granularity()
    h = driver.inner.create(g)
    try:
        with pytest.raises(DriverError):
            driver.inner.map(reservation + 8 * g, g, h, 0)
    finally:
        driver.inner.release(h)


def test_release_while_mapped_keeps_the_memory(driver, reservation):
    g = driver.granularity()
    _map(driver, reservation, g)  # _map releases the handle right after mapping
    data = pattern(g, 2, driver.device)
    view = driver.tensor(reservation, g, None)
    view.copy_(data)
    expect_bytes(driver, "read after release of the mapped handle", view, data)


def test_zero_sets_exactly_the_range(driver, reservation):
    g = driver.granularity()
    _map(driver, reservation, 2 * g)
    view = driver.tensor(reservation, 2 * g, None)
    view.fill_(0xFF)
    lo, hi = g // 2, 2 * g - g // 4  # crosses the granule boundary, stops short of the end
    driver.zero(reservation + lo, hi - lo)
    driver.synchronize()
    expected = view.new_full((2 * g,), 0xFF)
    expected[lo:hi] = 0
    expect_bytes(driver, f"zero({lo}, {hi - lo})", view, expected)


def test_tensor_aliases_memory_without_copy(driver, reservation):
    g = driver.granularity()
    _map(driver, reservation, g)
    a = driver.tensor(reservation, g, None)
    half = g // 2
    b = driver.tensor(reservation + half, g - half, None)
    expect_equal(driver, "tensor().data_ptr()", hex(reservation), hex(a.data_ptr()))
    a.fill_(3)
    b[:16].fill_(9)
    driver.synchronize()
    expect_equal(driver, "write through one tensor seen through another", 9, int(a[half]))


def test_tensor_keeps_its_keeper_alive(driver, reservation):
    g = driver.granularity()
    _map(driver, reservation, g)

    class Keeper:
        pass

    keeper = Keeper()
    ref = weakref.ref(keeper)
    view = driver.tensor(reservation, g, keeper)
    del keeper
    gc.collect()
    expect(ref() is not None, driver, "keeper while the tensor lives", "alive", "collected")
    del view
    gc.collect()
    expect(ref() is None, driver, "keeper after the tensor died", "collected", "alive")


def test_a_driver_built_again_starts_empty_and_serves(driver, driver_spec):
    """The driver's spec built once more in this process (the rules share one driver per session, built before the
    first rule; this checks a driver's first state and its first calls): the same name, device, granularity and
    ``mem_info`` total as the driver under test, nothing held yet (on the host ``free == total``: P-mem-exact; elsewhere
    ``0 <= free <= total``: P-mem-bounds), and a first reserve, create, map (at the default offset), set_access, zero
    and read that work and give every byte back. Checks: P-granularity, P-mem-bounds, P-mem-exact, P-tensor-device,
    P-zero, P-release-returns."""
    fresh = drivers.get_driver(driver_spec)
    for what, mine, theirs in (
        ("name", driver.name, fresh.name),
        ("device", driver.device, fresh.device),
        ("granularity()", driver.granularity(), fresh.granularity()),
        ("mem_info() total", driver.mem_info()[1], fresh.mem_info()[1]),
    ):
        expect_equal(driver, f"{what} of the driver built again from {driver_spec!r}", mine, theirs)
    expect(isinstance(fresh.name, str) and fresh.name, driver, "name of a driver", "a non-empty str", repr(fresh.name))
    g = fresh.granularity()
    free0, total = fresh.mem_info()
    if host_kernel(driver):
        expect_equal(driver, "mem_info() free of a host driver just built (P-mem-exact)", total, free0)
    expect(0 <= free0 <= total, driver, "mem_info() of a driver just built", f"0 <= free <= {total}", free0)
    va = fresh.reserve(2 * g, g)
    try:
        handle = fresh.create(2 * g)
        try:
            fresh.map(va, 2 * g, handle)  # the offset left to its default, 0, as ExtensibleTensor calls it
            try:
                fresh.set_access(va, 2 * g)
                view = fresh.tensor(va, 2 * g, None)
                expect_equal(driver, "device of the first tensor of a driver just built", fresh.device, view.device)
                view.copy_(pattern(2 * g, 5, view.device))
                fresh.zero(va + g // 2, g)
                fresh.synchronize()
                want = pattern(2 * g, 5, view.device)
                want[g // 2 : g // 2 + g] = 0
                expect_bytes(driver, f"first zero({g // 2}, {g}) of a driver just built", view, want)
                del view
            finally:
                fresh.synchronize()
                fresh.unmap(va, 2 * g)
        finally:
            fresh.release(handle)
    finally:
        fresh.free(va, 2 * g)
    if host_kernel(driver):
        expect_equal(
            driver, "mem_info() free once its first handle is unmapped and released", total, fresh.mem_info()[0]
        )
