"""The host driver's own construction and probing: defaults, refused arguments (typed, naming the value), the
probe's reason, the budget's starting figures, and ``accessible`` on addresses it never mapped; its libc binding
made afresh, the budget's edge, memfds the kernel cannot size or fill, and a forked child's calls."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import warnings

import pytest

from conformance.helpers import kernel_granules, kernel_memfds
from extensible_kv.drivers import host
from extensible_kv.drivers.host import PAGE_BYTES, HostDriver
from extensible_kv.errors import DriverError, DriverOutOfMemory, DriverUnavailable

BAD_GRANULARITY = {
    "0": 0,
    "-4096": -PAGE_BYTES,
    "4097": PAGE_BYTES + 1,
    "6144": PAGE_BYTES + PAGE_BYTES // 2,
    "'4096'": "4096",
    "4096.0": 4096.0,
}
BAD_BUDGET = {"0": 0, "-1": -1, "'1'": "1", "1.5": 1.5}


@pytest.mark.parametrize("value", BAD_GRANULARITY.values(), ids=BAD_GRANULARITY.keys())
def test_a_granularity_that_is_not_a_positive_multiple_of_the_page_is_refused_naming_it(value):
    with pytest.raises(ValueError) as info:
        HostDriver(granularity=value)
    message = str(info.value)
    assert repr(value) in message and str(PAGE_BYTES) in message, (
        f"HostDriver(granularity={value!r}): expected a message naming {value!r} and {PAGE_BYTES}, got {message!r}"
    )


@pytest.mark.parametrize("value", BAD_BUDGET.values(), ids=BAD_BUDGET.keys())
def test_a_budget_that_is_not_a_positive_int_is_refused_naming_it(value):
    with pytest.raises(ValueError) as info:
        HostDriver(granularity=PAGE_BYTES, budget_bytes=value)
    assert repr(value) in str(info.value), (
        f"HostDriver(budget_bytes={value!r}): expected a message naming {value!r}, got {str(info.value)!r}"
    )


@pytest.mark.parametrize("budget", [1, PAGE_BYTES, 3 << 20])
def test_a_new_driver_has_its_whole_budget_free(budget):
    got = HostDriver(granularity=PAGE_BYTES, budget_bytes=budget).mem_info()
    assert got == (budget, budget), (
        f"HostDriver(budget_bytes={budget}).mem_info(): expected {(budget, budget)}, got {got}"
    )


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
    assert reason and reason.startswith("os.memfd_create is missing (") and reason.endswith(")"), (
        f"host.probe() without os.memfd_create: expected a reason that starts with the cause, got {reason!r}"
    )
    for needle in ("Linux", "Python", "glibc >= 2.27"):
        assert needle in reason, (
            f"host.probe() without os.memfd_create: expected {needle!r} in the reason, got {reason!r}"
        )
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
        assert info.value.operation == "accessible" and str(bad) in str(info.value), (
            f"accessible({bad}): expected a DriverError of op 'accessible' naming {bad}, got "
            f"{info.value.operation!r}: "
            f"{info.value}"
        )


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
    assert not driver._reservations, (
        f"reservations after the refused reserve: expected none, got {driver._reservations}"
    )


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
            return host.MAP_FAILED if self.name == "mmap" else -1  # what the restype makes of MAP_FAILED

        return fail


# A libc call that fails (as the kernel can: EACCES, ENOMEM) at each operation, with what the error must name.
FAILING = {
    "set_access": ("mprotect", lambda d, va, h: d.set_access(va, PAGE_BYTES), "mprotect({va:#x}, 4096, RW)"),
    "unmap": ("mmap", lambda d, va, h: d.unmap(va, PAGE_BYTES), "mmap(PROT_NONE, MAP_FIXED, {va:#x}, 4096)"),
    "map": (
        "mmap",
        lambda d, va, h: d.map(va + PAGE_BYTES, PAGE_BYTES, h, 0),
        "mmap(MAP_FIXED, {va2:#x}, 4096, fd={fd}, offset=0)",
    ),
    "free": ("munmap", lambda d, va, h: d.free(va, 2 * PAGE_BYTES), "munmap({va:#x}, 8192)"),
}


@pytest.mark.parametrize(
    "err,kind", [(errno.EACCES, DriverError), (errno.ENOMEM, DriverOutOfMemory)], ids=["EACCES", "ENOMEM"]
)
@pytest.mark.parametrize("op", FAILING)
def test_a_failing_libc_call_raises_a_typed_error_naming_the_call_and_errno_and_changes_nothing(
    monkeypatch, op, err, kind
):
    function, call, template = FAILING[op]
    driver = HostDriver(granularity=PAGE_BYTES, budget_bytes=1 << 20)
    va = driver.reserve(2 * PAGE_BYTES, PAGE_BYTES)
    handle = driver.create(PAGE_BYTES)
    if op != "free":
        driver.map(va, PAGE_BYTES, handle, 0)
    records = (dict(driver._reservations), dict(driver._mappings), handle.maps)
    failing = _LibcFailing(host._lib(), function, err)
    monkeypatch.setattr(host, "_lib", lambda: failing)
    with pytest.raises(DriverError) as info:
        call(driver, va, handle)
    monkeypatch.undo()
    e = info.value
    got = (type(e), e.operation, e.code)
    assert got == (kind, op, err), (
        f"{op} with {function} failing {errno.errorcode[err]}: expected {(kind, op, err)}, got {got}"
    )
    detail = template.format(va=va, va2=va + PAGE_BYTES, fd=handle.fd)
    assert e.detail == f"{detail}: {os.strerror(err)}", (
        f"{op} error detail: expected {detail!r} and strerror, got {e.detail!r}"
    )
    after = (dict(driver._reservations), dict(driver._mappings), handle.maps)
    assert after == records, f"{op} failed in libc: expected the records unchanged ({records}), got {after}"
    if op != "free":
        driver.unmap(va, PAGE_BYTES)
    driver.release(handle)
    driver.free(va, 2 * PAGE_BYTES)


# Every argument of every method, outside the address space (or past its end with the other arguments): refused with
# the operation's name and the value (Note [Sizes are checked before ctypes] in drivers/host.py), before any libc call
# and with nothing recorded. ``None`` is the handle of a map that never gets that far.
OUTSIDE = {
    "reserve size 2**64 + 4096": ("reserve", lambda d: d.reserve(2**64 + 4096, 4096), "size=18446744073709555712"),
    "reserve size -4096": ("reserve", lambda d: d.reserve(-4096, 4096), "size=-4096 is outside [1, 2**63)"),
    "reserve alignment 2**64": (
        "reserve",
        lambda d: d.reserve(4096, 2**64),
        "alignment=18446744073709551616 is outside [0, 2**63)",
    ),
    "create size 2**64 + 4096": ("create", lambda d: d.create(2**64 + 4096), "size=18446744073709555712"),
    "free va -4096": ("free", lambda d: d.free(-4096, 4096), "va=-4096 is outside [0, 2**63)"),
    "free size 0": ("free", lambda d: d.free(4096, 0), "size=0 is outside [1, 2**63)"),
    "map va 2**64": ("map", lambda d: d.map(2**64, 4096, None, 0), "va=18446744073709551616 is outside [0, 2**63)"),
    "map size -1": ("map", lambda d: d.map(4096, -1, None, 0), "size=-1 is outside [1, 2**63)"),
    "map offset 2**63": ("map", lambda d: d.map(4096, 4096, None, 2**63), "offset=9223372036854775808 is outside"),
    "unmap va -1": ("unmap", lambda d: d.unmap(-1, 4096), "va=-1 is outside [0, 2**63)"),
    "unmap size 2**64": ("unmap", lambda d: d.unmap(4096, 2**64), "size=18446744073709551616 is outside"),
    "set_access va -1": ("set_access", lambda d: d.set_access(-1, 4096), "va=-1 is outside [0, 2**63)"),
    "set_access size 0": ("set_access", lambda d: d.set_access(4096, 0), "size=0 is outside [1, 2**63)"),
    "zero past the address space": ("zero", lambda d: d.zero(2**63 - 4096, 8192), "runs past the 64-bit"),
    "zero va -1": ("zero", lambda d: d.zero(-1, 4096), "va=-1 is outside [0, 2**63)"),
    "tensor va -1": ("tensor", lambda d: d.tensor(-1, 4096, None), "va=-1 is outside [0, 2**63)"),
    "tensor nbytes 0": ("tensor", lambda d: d.tensor(4096, 0, None), "size=0 is outside [1, 2**63)"),
}


@pytest.mark.parametrize("op,call,needle", OUTSIDE.values(), ids=OUTSIDE.keys())
def test_every_argument_outside_the_address_space_is_refused_before_libc_naming_the_operation(
    monkeypatch, op, call, needle
):
    driver = HostDriver(granularity=PAGE_BYTES)

    def no_libc():
        raise AssertionError(f"{op}: libc was called with an argument outside the address space")

    monkeypatch.setattr(host, "_lib", no_libc)
    with pytest.raises(DriverError) as info:
        call(driver)
    e = info.value
    assert e.operation == op and needle in e.detail, (
        f"host driver {op}: expected DriverError({op!r}, ...{needle}...), got {type(e).__name__}({e.operation!r}, "
        f"{e.detail!r})"
    )
    assert not driver._reservations and not driver._mappings, (
        f"host driver {op}: after the refusal expected no records, got {driver._reservations}, {driver._mappings}"
    )


def test_map_of_a_released_handle_is_refused_naming_it_and_records_nothing():
    driver = HostDriver(granularity=PAGE_BYTES)
    va = driver.reserve(PAGE_BYTES, PAGE_BYTES)
    handle = driver.create(PAGE_BYTES)
    shown = repr(handle)
    driver.release(handle)
    with pytest.raises(DriverError) as info:
        driver.map(va, PAGE_BYTES, handle, 0)
    e = info.value
    got = (e.operation, e.detail)
    expected = ("map", f"{shown} was released; map a live handle")
    assert got == expected, f"map of a released handle: expected {expected}, got {got}"
    assert not driver._mappings, f"map of a released handle: expected no mapping recorded, got {driver._mappings}"
    driver.free(va, PAGE_BYTES)


def test_map_past_the_end_of_a_handle_is_refused_naming_the_sizes():
    driver = HostDriver(granularity=PAGE_BYTES)
    va = driver.reserve(2 * PAGE_BYTES, PAGE_BYTES)
    handle = driver.create(PAGE_BYTES)
    try:
        with pytest.raises(DriverError) as info:
            driver.map(va, PAGE_BYTES, handle, PAGE_BYTES)
        got = (info.value.operation, info.value.detail)
        expected = ("map", f"offset {PAGE_BYTES} + size {PAGE_BYTES} exceeds the {PAGE_BYTES}-byte handle")
        assert got == expected, f"map past the handle: expected {expected}, got {got}"
    finally:
        driver.release(handle)
        driver.free(va, 2 * PAGE_BYTES)


def test_a_released_handle_mapped_twice_is_held_until_its_last_mapping_goes():
    driver = HostDriver(granularity=PAGE_BYTES, budget_bytes=1 << 20)
    va = driver.reserve(2 * PAGE_BYTES, PAGE_BYTES)
    handle = driver.create(PAGE_BYTES)
    driver.map(va, PAGE_BYTES, handle, 0)
    driver.map(va + PAGE_BYTES, PAGE_BYTES, handle, 0)
    driver.release(handle)
    free = [driver.mem_info()[0]]
    driver.unmap(va, PAGE_BYTES)
    free.append(driver.mem_info()[0])
    driver.unmap(va + PAGE_BYTES, PAGE_BYTES)
    free.append(driver.mem_info()[0])
    driver.free(va, 2 * PAGE_BYTES)
    total = 1 << 20
    expected = [total - PAGE_BYTES, total - PAGE_BYTES, total]
    assert free == expected, (
        f"host mem_info free bytes after release, unmap 1 of 2, unmap 2 of 2: expected {expected}, got {free}"
    )


def test_a_reservation_the_kernel_refuses_is_out_of_memory_whatever_its_errno(monkeypatch):
    driver = HostDriver(granularity=PAGE_BYTES)
    failing = _LibcFailing(host._lib(), "mmap", errno.EINVAL)
    monkeypatch.setattr(host, "_lib", lambda: failing)
    with pytest.raises(DriverOutOfMemory) as info:
        driver.reserve(PAGE_BYTES, PAGE_BYTES)
    got = (info.value.operation, info.value.code, info.value.detail)
    expected = (
        "reserve",
        errno.EINVAL,
        f"mmap(PROT_NONE, {2 * PAGE_BYTES} bytes) for {PAGE_BYTES} bytes aligned to {PAGE_BYTES}: "
        f"{os.strerror(errno.EINVAL)}",
    )
    assert got == expected, f"reserve with mmap failing EINVAL: expected {expected}, got {got}"
    assert not driver._reservations, f"a refused reserve recorded {driver._reservations}"


def _prot_none_bytes() -> int:
    """Bytes of private anonymous ``PROT_NONE`` mappings the kernel holds for this process (``/proc/self/maps``)."""
    total = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if fields[1] == "---p" and len(fields) == 5:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                total += hi - lo
    return total


@pytest.mark.parametrize("alignment", [16 * PAGE_BYTES, 512 * PAGE_BYTES])
def test_an_aligned_reservation_holds_exactly_its_size_in_the_kernel(alignment):
    # reserve over-reserves by the alignment and trims both ends: the kernel's own accounting must grow by the size.
    driver = HostDriver(granularity=PAGE_BYTES)
    before = _prot_none_bytes()
    va = driver.reserve(3 * PAGE_BYTES, alignment)
    during = _prot_none_bytes()
    driver.free(va, 3 * PAGE_BYTES)
    after = _prot_none_bytes()
    got = (va % alignment, during - before, after - before)
    assert got == (0, 3 * PAGE_BYTES, 0), (
        f"reserve(3 pages, alignment {alignment}): expected (va % alignment, "
        f"kernel PROT_NONE growth, after free) = (0, {3 * PAGE_BYTES}, 0), got {got}"
    )


@pytest.mark.parametrize("alignment", [6000, 3 * PAGE_BYTES])
def test_a_reservation_aligned_off_the_granularity_is_refused_naming_it_and_reserves_nothing(alignment):
    # Rounded to an alignment the granularity does not divide, the range would start on an unreserved page (6000) or
    # off a granule (three pages against two-page granules): the driver refuses it, not only the Ledger.
    driver = HostDriver(granularity=2 * PAGE_BYTES)
    before = _prot_none_bytes()
    with pytest.raises(DriverError) as info:
        driver.reserve(4 * PAGE_BYTES, alignment)
    got = (info.value.operation, str(info.value), _prot_none_bytes() - before)
    expected = (
        "reserve",
        f"reserve failed: alignment={alignment} is not a multiple of the granularity {2 * PAGE_BYTES}",
        0,
    )
    assert got == expected, (
        f"HostDriver.reserve(4 pages, alignment {alignment}): expected (op, message, kernel "
        f"PROT_NONE growth) {expected}, got {got}"
    )


def test_a_handle_is_not_inherited_across_exec():
    import fcntl

    driver = HostDriver(granularity=PAGE_BYTES)
    handle = driver.create(PAGE_BYTES)
    try:
        flags = fcntl.fcntl(handle.fd, fcntl.F_GETFD)
        assert flags & fcntl.FD_CLOEXEC, f"memfd {handle.fd}: expected FD_CLOEXEC, got flags {flags:#x}"
    finally:
        driver.release(handle)


def test_release_twice_and_a_failed_memfd_create_are_typed_errors_naming_the_handle_and_size(monkeypatch):
    driver = HostDriver(granularity=PAGE_BYTES)
    handle = driver.create(PAGE_BYTES)
    driver.release(handle)
    with pytest.raises(DriverError) as info:
        driver.release(handle)
    got = (info.value.operation, info.value.detail)
    assert got == ("release", f"{handle!r} was already released"), f"release twice: got {got}"

    def no_fds(name, flags=0):
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(os, "memfd_create", no_fds)
    with pytest.raises(DriverError) as info:
        driver.create(PAGE_BYTES)
    got = (info.value.operation, info.value.detail, info.value.code)
    expected = (
        "create",
        f"memfd_create for {PAGE_BYTES} bytes: [Errno {errno.EMFILE}] {os.strerror(errno.EMFILE)}",
        errno.EMFILE,
    )
    assert got == expected, f"create with memfd_create failing: expected {expected}, got {got}"
    assert driver.mem_info()[0] == driver.mem_info()[1], f"a failed create holds {driver.mem_info()}"


@pytest.mark.parametrize("finds_libc", [True, False], ids=["find_library finds libc", "find_library finds nothing"])
def test_a_libc_binding_made_afresh_serves_every_operation_at_64_bit_addresses(monkeypatch, finds_libc):
    # The binding is made once per process; drop it so this test makes it (as the first driver call of a process
    # does), where ctypes.util.find_library finds libc and where it finds nothing (no ldconfig, no compiler). The
    # kernel places mappings above 4 GiB on 64-bit Linux, so every address here needs the 64-bit argument types.
    monkeypatch.setattr(host, "_libc", None)
    if not finds_libc:
        monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    driver = HostDriver(granularity=PAGE_BYTES, budget_bytes=1 << 20)
    va = driver.reserve(2 * PAGE_BYTES, PAGE_BYTES)
    handle = driver.create(PAGE_BYTES)
    driver.map(va + PAGE_BYTES, PAGE_BYTES, handle, 0)
    driver.set_access(va + PAGE_BYTES, PAGE_BYTES)
    got = kernel_granules(va, 2 * PAGE_BYTES, PAGE_BYTES)
    assert got == ["reserved", "accessible"], (
        f"HostDriver reserve + map/set_access of the 2nd page at {va:#x}: expected the kernel to map ['reserved', "
        f"'accessible'], got {got}"
    )
    ctypes.memset(va + PAGE_BYTES, 0x5A, PAGE_BYTES)
    data = os.pread(handle.fd, PAGE_BYTES, 0)
    assert data == b"\x5a" * PAGE_BYTES, (
        f"HostDriver map at {va + PAGE_BYTES:#x}: expected a write there to reach the memfd, read {data[:8]!r}..."
    )
    driver.unmap(va + PAGE_BYTES, PAGE_BYTES)
    driver.release(handle)
    got = kernel_granules(va, 2 * PAGE_BYTES, PAGE_BYTES)
    assert got == ["reserved", "reserved"], (
        f"HostDriver unmap at {va + PAGE_BYTES:#x}: expected the kernel to map ['reserved', 'reserved'], got {got}"
    )
    driver.free(va, 2 * PAGE_BYTES)
    got = kernel_granules(va, 2 * PAGE_BYTES, PAGE_BYTES)
    assert got == ["nothing", "nothing"], (
        f"HostDriver free({va:#x}): expected the kernel to map nothing there, got {got}"
    )
    ctypes.set_errno(0)  # the errno a failed call reports must be the kernel's, not one left from before
    with pytest.raises(DriverOutOfMemory) as info:
        driver.reserve(1 << 62, PAGE_BYTES)
    got = (info.value.operation, info.value.code)
    assert got == ("reserve", errno.ENOMEM), (
        f"HostDriver reserve(2**62) the kernel refuses: expected ('reserve', ENOMEM={errno.ENOMEM}), got {got}"
    )


def test_create_may_take_exactly_the_free_budget_and_past_it_is_refused_naming_the_sizes():
    total = 4 * PAGE_BYTES
    driver = HostDriver(granularity=PAGE_BYTES, budget_bytes=total)
    first = driver.create(PAGE_BYTES)
    before = kernel_memfds()
    with pytest.raises(DriverOutOfMemory) as info:
        driver.create(total)
    e = info.value
    got = (e.operation, e.detail, e.code)
    expected = ("create", f"{total} bytes asked, {total - PAGE_BYTES} of {total} bytes free", errno.ENOMEM)
    assert got == expected, (
        f"HostDriver create({total}) with {PAGE_BYTES} of {total} held: expected {expected}, got {got}"
    )
    after = kernel_memfds()
    assert after == before, (
        f"HostDriver create refused for the budget: expected the kernel's memfds unchanged ({before}), got {after}"
    )
    rest = driver.create(total - PAGE_BYTES)  # exactly what is free
    try:
        got = (os.fstat(rest.fd).st_size, driver.mem_info())
        expected = (total - PAGE_BYTES, (0, total))
        assert got == expected, (
            f"HostDriver create of exactly the free {total - PAGE_BYTES} bytes: expected (memfd "
            f"size, mem_info) {expected}, got {got}"
        )
    finally:
        driver.release(rest)
        driver.release(first)
    got = driver.mem_info()
    assert got == (total, total), (
        f"HostDriver mem_info after releasing both handles: expected {(total, total)}, got {got}"
    )


def _sealed_memfd_create(real):
    """``os.memfd_create`` whose memfds the kernel refuses to grow (``F_SEAL_GROW``): ``ftruncate`` fails EPERM."""

    def memfd_create(name, flags=os.MFD_CLOEXEC):
        fd = real(name, flags | os.MFD_ALLOW_SEALING)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)
        return fd

    return memfd_create


# A memfd the kernel cannot size (sealed against growth: EPERM, not a lack of memory) or cannot fill (a 2**62-byte
# memfd sizes, as tmpfs files are sparse, but no address space holds a mapping of it: ENOMEM).
UNSIZABLE = {
    "ftruncate refused EPERM": (PAGE_BYTES, True, errno.EPERM, DriverError),
    "fill mmap refused ENOMEM": (1 << 62, False, errno.ENOMEM, DriverOutOfMemory),
}


@pytest.mark.parametrize("size,sealed,err,kind", UNSIZABLE.values(), ids=UNSIZABLE.keys())
def test_a_memfd_the_kernel_cannot_size_or_fill_is_a_typed_create_error_naming_errno_and_is_closed(
    monkeypatch, size, sealed, err, kind
):
    driver = HostDriver(granularity=PAGE_BYTES, budget_bytes=size)
    if sealed:
        monkeypatch.setattr(os, "memfd_create", _sealed_memfd_create(os.memfd_create))
    before = kernel_memfds()
    with pytest.raises(DriverError) as info:
        driver.create(size)
    e = info.value
    got = (type(e), e.operation, e.code, e.detail)
    expected = (kind, "create", err, f"ftruncate/fill of a {size}-byte memfd: {OSError(err, os.strerror(err))}")
    assert got == expected, (
        f"HostDriver create({size}) with the kernel refusing {errno.errorcode[err]}: expected {expected}, got {got}"
    )
    after = kernel_memfds()
    assert after == before, (
        f"HostDriver create({size}) refused: expected its memfd closed (the kernel's memfds {before}), got {after}"
    )
    got = driver.mem_info()
    assert got == (size, size), f"HostDriver mem_info after the refused create: expected {(size, size)}, got {got}"


def test_a_forked_child_is_refused_every_call_naming_the_operation_and_both_processes():
    # Note [No use after fork]: the child reports what each call raised through a pipe; the parent keeps its memory.
    driver = HostDriver(granularity=PAGE_BYTES, budget_bytes=1 << 20, name="unit-host")
    va = driver.reserve(PAGE_BYTES, PAGE_BYTES)
    handle = driver.create(PAGE_BYTES)
    driver.map(va, PAGE_BYTES, handle, 0)
    driver.set_access(va, PAGE_BYTES)
    calls = {
        "release": lambda: driver.release(handle),
        "create": lambda: driver.create(PAGE_BYTES),
        "unmap": lambda: driver.unmap(va, PAGE_BYTES),
    }
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a multi-threaded process: the child only calls
        pid = os.fork()
    if pid == 0:
        try:
            seen = {}
            for op, call in calls.items():
                try:
                    call()
                    seen[op] = "no error"
                except DriverError as exc:
                    seen[op] = [type(exc).__name__, exc.operation, exc.detail, exc.code]
                except BaseException as exc:  # reported to the parent
                    seen[op] = f"{type(exc).__name__}: {exc}"
            os.write(w, json.dumps(seen).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as pipe:
        report = pipe.read()
    os.waitpid(pid, 0)
    seen = json.loads(report or "{}")
    detail = (
        f"unit-host driver built in process {os.getpid()} used from forked process {pid}; build a new driver "
        f"in the child"
    )
    for op in calls:
        expected = ["DriverError", op, detail, None]
        assert seen.get(op) == expected, (
            f"HostDriver {op} from a forked child: expected {expected}, got {seen.get(op)!r}"
        )
    got = (kernel_granules(va, PAGE_BYTES, PAGE_BYTES), os.fstat(handle.fd).st_size, driver.mem_info())
    expected = (["accessible"], PAGE_BYTES, ((1 << 20) - PAGE_BYTES, 1 << 20))
    assert got == expected, (
        f"HostDriver in the parent after the child's refused calls: expected (kernel map, memfd "
        f"size, mem_info) {expected}, got {got}"
    )
    driver.unmap(va, PAGE_BYTES)
    driver.release(handle)
    driver.free(va, PAGE_BYTES)
