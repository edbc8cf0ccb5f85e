"""The host driver's own construction and probing: defaults, refused arguments (typed, naming the value), the
probe's reason, the budget's starting figures, and ``accessible`` on addresses it never mapped."""

from __future__ import annotations

import errno
import os

import pytest

from extensible_kv.drivers import host
from extensible_kv.drivers.host import PAGE_BYTES, HostDriver
from extensible_kv.errors import DriverError, DriverOutOfMemory, DriverUnavailable

BAD_GRANULARITY = {"0": 0, "-4096": -PAGE_BYTES, "4097": PAGE_BYTES + 1, "6144": PAGE_BYTES + PAGE_BYTES // 2,
                   "'4096'": "4096", "4096.0": 4096.0}
BAD_BUDGET = {"0": 0, "-1": -1, "'1'": "1", "1.5": 1.5}


@pytest.mark.parametrize("value", BAD_GRANULARITY.values(), ids=BAD_GRANULARITY.keys())
def test_a_granularity_that_is_not_a_positive_multiple_of_the_page_is_refused_naming_it(value):
    with pytest.raises(ValueError) as info:
        HostDriver(granularity=value)
    message = str(info.value)
    assert repr(value) in message and str(PAGE_BYTES) in message, \
        f"HostDriver(granularity={value!r}): expected a message naming {value!r} and {PAGE_BYTES}, got {message!r}"


@pytest.mark.parametrize("value", BAD_BUDGET.values(), ids=BAD_BUDGET.keys())
def test_a_budget_that_is_not_a_positive_int_is_refused_naming_it(value):
    with pytest.raises(ValueError) as info:
        HostDriver(granularity=PAGE_BYTES, budget_bytes=value)
    assert repr(value) in str(info.value), \
        f"HostDriver(budget_bytes={value!r}): expected a message naming {value!r}, got {str(info.value)!r}"


@pytest.mark.parametrize("budget", [1, PAGE_BYTES, 3 << 20])
def test_a_new_driver_has_its_whole_budget_free(budget):
    got = HostDriver(granularity=PAGE_BYTES, budget_bytes=budget).mem_info()
    assert got == (budget, budget), f"HostDriver(budget_bytes={budget}).mem_info(): expected {(budget, budget)}, " \
                                    f"got {got}"


def test_the_defaults_are_2_mib_granules_named_host_with_fresh_pages_filled_with_0xa5():
    driver = HostDriver(budget_bytes=1 << 30)
    got = (driver.name, driver.granularity())
    assert got == ("host", 2 << 20), f"HostDriver() name and granularity: expected ('host', {2 << 20}), got {got}"
    g = driver.granularity()
    va = driver.reserve(g, g)
    handle = driver.create(g)
    driver.map(va, g, handle)
    driver.set_access(va, g)
    try:
        data = bytes(driver.tensor(va, g, None).numpy())  # Note [Fresh pages are not zero]
        assert data == b"\xa5" * g, f"fresh host pages: expected {g} bytes of 0xa5, got {data[:8]!r}..."
    finally:
        driver.unmap(va, g)
        driver.release(handle)
        driver.free(va, g)


def test_without_memfd_create_the_probe_says_why_and_the_driver_is_unavailable(monkeypatch):
    monkeypatch.delattr(os, "memfd_create")
    reason = host.probe()
    assert reason and reason.startswith("os.memfd_create is missing (") and reason.endswith(")"), \
        f"host.probe() without os.memfd_create: expected a reason that starts with the cause, got {reason!r}"
    for needle in ("Linux", "Python", "glibc >= 2.27"):
        assert needle in reason, f"host.probe() without os.memfd_create: expected {needle!r} in the reason, " \
                                 f"got {reason!r}"
    with pytest.raises(DriverUnavailable) as info:
        HostDriver(granularity=PAGE_BYTES)
    assert str(info.value) == reason, f"HostDriver() without memfd_create: expected {reason!r}, got {info.value}"


def test_accessible_is_false_where_the_kernel_maps_nothing_and_refuses_addresses_outside_the_address_space():
    driver = HostDriver(granularity=PAGE_BYTES, budget_bytes=1 << 20)
    va = driver.reserve(PAGE_BYTES, PAGE_BYTES)
    driver.free(va, PAGE_BYTES)  # the kernel now maps nothing at va
    assert driver.accessible(va) is False, f"accessible({va:#x}) after free: expected False, got True"
    for bad in (-PAGE_BYTES, 2**64):
        with pytest.raises(DriverError) as info:
            driver.accessible(bad)
        assert info.value.operation == "accessible" and str(bad) in str(info.value), \
            f"accessible({bad}): expected a DriverError of op 'accessible' naming {bad}, got {info.value.operation!r}: " \
            f"{info.value}"


def test_a_reservation_the_kernel_cannot_make_is_out_of_memory_naming_the_call_and_errno():
    driver = HostDriver(granularity=PAGE_BYTES, budget_bytes=1 << 20)
    size = 1 << 62  # past any x86-64 or arm64 user address space: mmap fails with ENOMEM
    with pytest.raises(DriverOutOfMemory) as info:
        driver.reserve(size, PAGE_BYTES)
    err = info.value
    got = (err.operation, err.code)
    assert got == ("reserve", errno.ENOMEM), f"reserve(2**62): expected ('reserve', ENOMEM), got {got}"
    for needle in (f"mmap(PROT_NONE, {size + PAGE_BYTES} bytes)", os.strerror(errno.ENOMEM)):
        assert needle in str(err), f"reserve(2**62) error: expected {needle!r} in it, got {str(err)!r}"
    assert not driver._reservations, f"reservations after the refused reserve: expected none, got {driver._reservations}"


class _LibcFailing:
    """The real libc, except that ``name`` fails with ``err`` (errno set, -1 returned) as the kernel would."""

    def __init__(self, real: object, name: str, err: int) -> None:
        self.real, self.name, self.err = real, name, err

    def __getattr__(self, attr: str):
        if attr != self.name:
            return getattr(self.real, attr)

        def fail(*args):
            import ctypes

            ctypes.set_errno(self.err)
            return -1
        return fail


@pytest.mark.parametrize("err,kind", [(errno.EACCES, DriverError), (errno.ENOMEM, DriverOutOfMemory)])
def test_a_failing_libc_call_raises_a_typed_error_naming_the_call_and_errno(monkeypatch, err, kind):
    driver = HostDriver(granularity=PAGE_BYTES, budget_bytes=1 << 20)
    va = driver.reserve(PAGE_BYTES, PAGE_BYTES)
    handle = driver.create(PAGE_BYTES)
    driver.map(va, PAGE_BYTES, handle, 0)
    try:
        failing = _LibcFailing(host._lib(), "mprotect", err)
        monkeypatch.setattr(host, "_lib", lambda: failing)
        with pytest.raises(DriverError) as info:
            driver.set_access(va, PAGE_BYTES)
        e = info.value
        got = (type(e), e.operation, e.code)
        assert got == (kind, "set_access", err), f"set_access with mprotect failing {errno.errorcode[err]}: " \
                                                 f"expected {(kind, 'set_access', err)}, got {got}"
        for needle in (f"mprotect({va:#x}, {PAGE_BYTES}, RW)", os.strerror(err)):
            assert needle in e.detail, f"set_access error detail: expected {needle!r} in it, got {e.detail!r}"
        monkeypatch.undo()
    finally:
        driver.unmap(va, PAGE_BYTES)
        driver.release(handle)
        driver.free(va, PAGE_BYTES)
