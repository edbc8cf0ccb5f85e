"""Rules that hold the raw driver (the one under the fixture's Ledger, so its own refusals are reached) to each
sentence of the protocol (extensible_kv.drivers._protocol): alignment, offsets, a handle mapped twice, unaligned and
large ranges, refusals in every layout with the driver's state checked unchanged, memory returned, running out of
memory, and, on the host driver, what the kernel itself maps and holds."""

from __future__ import annotations

import pytest
import torch

from extensible_kv.errors import DriverError, DriverOutOfMemory

from .helpers import (
    RawDriver,
    expect,
    expect_bytes,
    expect_equal,
    expected_granules,
    free_bytes,
    granule_states,
    host_kernel,
    kernel_backing,
    kernel_granules,
    kernel_memfds,
    odd_tensor,
    oom_step,
    shared_pattern,
    touch,
)

BIG = 64 << 20  # well past sizes a driver might treat apart (16 MiB and the like)
FAULT = ("SIGSEGV", "SIGBUS")


@pytest.fixture
def raw(driver):
    r = RawDriver(driver)
    yield r
    r.close()


def _host_only(driver) -> None:
    if not host_kernel(driver):
        pytest.skip(f"driver {driver.name}: the kernel's own records are read for host (mmap/memfd) drivers only")


def _kernel(driver) -> dict[int, int] | None:
    return kernel_memfds() if host_kernel(driver) else None


# -- reserve ---------------------------------------------------------------------------------------------------------
def test_reserve_returns_a_range_aligned_to_the_alignment_asked(raw, driver):
    for multiple in (1, 2, 8, 64):
        alignment = multiple * raw.g
        va = raw.reserve(3, alignment)
        expect(
            va % alignment == 0,
            driver,
            f"reserve({3 * raw.g}, alignment={alignment})",
            f"an address aligned to {alignment}",
            f"{va:#x} ({va % alignment} bytes past a multiple)",
        )
        raw.free(va)


def test_touching_a_granule_without_access_faults(raw, driver):
    _host_only(driver)
    g = raw.g
    va = raw.reserve(3)
    raw.map(va + g, g, raw.create(g), access=False)
    raw.commit(va + 2 * g, g)
    for i, what, faults in (
        (0, "reserved only", True),
        (1, "mapped without access", True),
        (2, "mapped with access", False),
    ):
        got = touch(va + i * g + 100, write=True)
        expect(
            (got in FAULT) == faults,
            driver,
            f"touching granule {i} ({what}) in a child process",
            "a fault (SIGSEGV or SIGBUS)" if faults else "no fault",
            got,
        )


# -- accessible: what the kernel maps ------------------------------------------------------------------------------
def test_the_kernel_maps_what_accessible_reports(raw, driver):
    _host_only(driver)
    g = raw.g
    va = raw.reserve(4)

    def check(step: str, want: list[str]) -> None:
        kernel = kernel_granules(va, 4 * g, g)
        expect_equal(driver, f"/proc/self/maps over the 4 granules after {step}", want, kernel)
        states = granule_states(driver, va, 4 * g)
        expect_equal(driver, f"accessible() after {step}", [w == "accessible" for w in want], states)

    check("reserve", ["reserved"] * 4)
    first = raw.create(2 * g)
    raw.map(va, 2 * g, first, access=False)
    check("map of granules 0-1 without set_access", ["mapped", "mapped", "reserved", "reserved"])
    raw.set_access(va, 2 * g)
    raw.commit(va + 3 * g, g)
    check(
        "set_access of granules 0-1 and a second handle at granule 3",
        ["accessible", "accessible", "reserved", "accessible"],
    )
    backing = [kernel_backing(va + i * g) for i in (0, 1, 3)]
    expect(
        backing[0] is not None
        and backing[1] == (backing[0][0], g)
        and backing[0][1] == 0
        and backing[2] is not None
        and backing[2][0] != backing[0][0],
        driver,
        "memfd (inode, offset) behind granules 0, 1, 3",
        "(A, 0), (A, granularity), (B != A, 0)",
        backing,
    )
    raw.unmap(va, 2 * g)
    check("unmap of granules 0-1", ["reserved", "reserved", "reserved", "accessible"])
    raw.release(first)


def test_free_returns_the_range_to_the_kernel(raw, driver):
    _host_only(driver)
    g = raw.g
    va = raw.reserve(3)
    raw.commit(va + g, g)
    raw.unmap(va + g, g)
    raw.free(va)
    kernel = kernel_granules(va, 3 * g, g)  # the process may place other memory in the hole: only ours counts
    expect(
        not {"reserved", "mapped", "accessible"} & set(kernel),
        driver,
        "/proc/self/maps over a freed reservation",
        "no reservation or memfd mapping left",
        kernel,
    )


# -- map: offsets and a handle mapped twice --------------------------------------------------------------------------
def test_map_backs_the_range_with_the_handle_bytes_at_the_offset(raw, driver):
    g = raw.g
    va = raw.reserve(4)
    target = raw.reserve(2)
    handle = raw.create(4 * g)
    raw.map(va, 4 * g, handle)
    data = shared_pattern(4 * g, 5, driver.device)
    raw.view(va, 4 * g).copy_(data)
    for offset, size in ((g, g), (2 * g, 2 * g), (3 * g, g)):
        before = raw_state(raw)
        try:
            raw.inner.map(target, size, handle, offset)
        except DriverError:  # a driver whose native map takes offset 0 only refuses, and changes nothing
            expect_state(raw, f"a refused map({size} bytes of the handle at offset {offset})", before)
            continue
        raw.mappings[target] = size
        raw.set_access(target, size)
        got = raw.view(target, size)
        expect_bytes(
            driver, f"map({size} bytes of the handle at offset {offset}), read back", got, data[offset : offset + size]
        )
        got[:256].fill_(offset // g)
        driver.synchronize()
        expect_bytes(
            driver,
            f"a write through the mapping at offset {offset}, read through offset 0",
            raw.view(va + offset, 256),
            torch.full((256,), offset // g, dtype=torch.uint8),
        )
        raw.view(va + offset, 256).copy_(data[offset : offset + 256])
        raw.unmap(target, size)


def test_a_handle_mapped_at_two_addresses_shows_the_same_bytes_through_both(raw, driver):
    g = raw.g
    a, b = raw.reserve(2), raw.reserve(2)
    handle = raw.create(2 * g)
    raw.map(a, 2 * g, handle)
    raw.map(b, 2 * g, handle)
    one, two = shared_pattern(2 * g, 1, driver.device), shared_pattern(2 * g, 2, driver.device)
    raw.view(a, 2 * g).copy_(one)
    driver.synchronize()
    expect_bytes(driver, "bytes written through the first mapping, read through the second", raw.view(b, 2 * g), one)
    raw.view(b, 2 * g).copy_(two)
    driver.synchronize()
    expect_bytes(driver, "bytes written through the second mapping, read through the first", raw.view(a, 2 * g), two)
    if host_kernel(driver):
        backing = [kernel_backing(x) for x in (a, a + g, b, b + g)]
        expect(
            backing[:2] == backing[2:] and None not in backing,
            driver,
            "memfd (inode, offset) behind both mappings",
            "the same memfd bytes",
            backing,
        )
    raw.release(handle)
    raw.unmap(a, 2 * g)
    expect_bytes(driver, "the second mapping after the first was unmapped", raw.view(b, 2 * g), two)
    raw.unmap(b, 2 * g)
    handle = raw.create(2 * g)
    raw.map(a, 2 * g, handle)
    raw.view(a, 2 * g).copy_(one)
    driver.synchronize()
    raw.unmap(a, 2 * g)
    raw.map(a, 2 * g, handle)
    expect_bytes(driver, "a handle unmapped and mapped again", raw.view(a, 2 * g), one)


# -- zero and tensor: any range, large ranges ------------------------------------------------------------------------
def test_zero_sets_exactly_the_bytes_of_any_range(raw, driver):
    g = raw.g
    va = raw.reserve(2)
    raw.commit(va, 2 * g)
    data = shared_pattern(2 * g, 3, driver.device)
    view = raw.view(va, 2 * g)
    for lo, hi in ((100, 300), (1, 2), (255, 257), (257, 511), (g - 100, g + 100), (4095, 4097), (300, 2 * g - 3)):
        view.copy_(data)
        raw.inner.zero(va + lo, hi - lo)
        driver.synchronize()
        want = data.clone()
        want[lo:hi] = 0
        expect_bytes(driver, f"zero(base + {lo}, {hi - lo}) over committed bytes", view, want, zeroed=(lo, hi))


def _expect_all(driver, op: str, t: torch.Tensor, value: int, start: int) -> None:
    wrong = (t != value).nonzero()
    expect(
        wrong.numel() == 0,
        driver,
        op,
        f"{t.numel()} bytes of {value}",
        "first other byte at offset "
        + (str(start + int(wrong[0])) if wrong.numel() else "-")
        + f" ({wrong.numel()} bytes differ)",
    )


def test_zero_of_64_mib_sets_every_byte(raw, driver):
    n = -(-BIG // raw.g) * raw.g + raw.g
    va = raw.reserve(n // raw.g)
    raw.commit(va, n)
    view = raw.view(va, n)
    view.fill_(0xFF)
    lo, hi = 100, n - 300
    raw.inner.zero(va + lo, hi - lo)
    driver.synchronize()
    _expect_all(driver, f"zero(base + {lo}, {hi - lo}): the zeroed range", view[lo:hi], 0, lo)
    _expect_all(driver, f"zero(base + {lo}, {hi - lo}): the bytes before", view[:lo], 0xFF, 0)
    _expect_all(driver, f"zero(base + {lo}, {hi - lo}): the bytes after", view[hi:], 0xFF, hi)


def test_tensor_of_64_mib_aliases_memory_without_copy(raw, driver):
    n = -(-BIG // raw.g) * raw.g + raw.g
    va = raw.reserve(n // raw.g)
    raw.commit(va, n)
    big = raw.inner.tensor(va + 100, n - 200, None)
    expect_equal(
        driver,
        f"tensor(base + 100, {n - 200}) (address, bytes)",
        (hex(va + 100), n - 200),
        (hex(big.data_ptr()), big.numel()),
    )
    tail = raw.view(va + n - 4096, 4096)
    big[-1] = 7
    driver.synchronize()
    expect_equal(driver, "a write through the 64 MiB tensor, read through a small one", 7, int(tail[-101]))
    tail[-101] = 9
    driver.synchronize()
    expect_equal(driver, "a write through a small tensor, read through the 64 MiB one", 9, int(big[-1]))


# -- refusals: every layout, nothing changed ---------------------------------------------------------------------------
def raw_state(raw: RawDriver, data: bool = True) -> dict[str, object]:
    """What a refused call must leave as it was: accessible granules (and on the host what the kernel maps there),
    free memory, the memfds the kernel holds, and (``data``) the bytes of every accessible granule."""
    driver, g = raw.ledger, raw.g
    state: dict[str, object] = {}
    if data:  # first: copies may take device memory (torch's allocator) before free memory is read
        state["bytes"] = {va: raw.view(va, g).clone() for va in sorted(raw.accessed)}
    for va, size in sorted(raw.reservations.items()):
        state[f"accessible() over the reservation at {va:#x}"] = granule_states(driver, va, size)
        if host_kernel(driver):
            state[f"/proc/self/maps over the reservation at {va:#x}"] = [
                (k, kernel_backing(va + i * g)) for i, k in enumerate(kernel_granules(va, size, g))
            ]
    state["mem_info free bytes"] = free_bytes(driver)
    if host_kernel(driver):
        state["memfds the kernel holds (inode: bytes)"] = kernel_memfds()
    return state


def expect_state(raw: RawDriver, what: str, before: dict[str, object]) -> None:
    """The driver's state is ``before`` (bytes read last, once the granules are known to be as they were), and each
    reservation still takes a new mapping in its first free granule."""
    driver, g = raw.ledger, raw.g
    after = raw_state(raw, data=False)
    for key, value in after.items():
        expect_equal(driver, f"{key} after {what}", before[key], value)
    for va, data in before["bytes"].items():
        expect_bytes(driver, f"bytes of granule {va:#x} after {what}", raw.view(va, g), data)
    for va, size in sorted(raw.reservations.items()):
        mapped = {m + i * g for m, s in raw.mappings.items() for i in range(s // g)}
        spare = next((x for x in range(va, va + size, g) if x not in mapped), None)
        if spare is not None:
            raw.commit(spare, g, seed=9)
            expect_bytes(
                driver,
                f"a new mapping at {spare:#x} after {what}",
                raw.view(spare, g),
                shared_pattern(g, 9, driver.device),
            )
            raw.unmap(spare, g)


def _refused(raw: RawDriver, op: str, args: tuple, what: str) -> None:
    """``op(*args)`` on the raw driver raises DriverError naming ``op`` and changes nothing."""
    before = raw_state(raw)
    try:
        getattr(raw.inner, op)(*args)
    except DriverError as exc:
        expect_equal(raw.ledger, f"{what}: the error's operation", op, exc.operation)
    else:
        if op == "map":
            raw.mappings[args[0]] = args[1]
        elif op == "free":
            raw.reservations.pop(args[0], None)
        raise AssertionError(f"driver {raw.ledger.name}: {what}: expected DriverError(operation={op!r}), got no error")
    expect_state(raw, f"the refused {what}", before)


@pytest.fixture
def layout(raw):
    """Reservation A of 7 granules: [1, 3) one mapping, [4] another, both accessible and written, the rest
    reserved; reservation B of 2 granules, nothing mapped; a live 2-granule handle, mapped nowhere."""
    a = raw.reserve(7)
    b = raw.reserve(2)
    raw.commit(a + raw.g, 2 * raw.g, seed=1)
    raw.commit(a + 4 * raw.g, raw.g, seed=2)
    return a, b, raw.create(2 * raw.g)


MAP_REFUSALS = {  # name: (reservation, first granule, granules, offset in granules)
    "past_the_reservation_end": ("a", 6, 2, 0),
    "before_the_reservation_start": ("a", -1, 2, 0),
    "overlapping_a_mapping_from_below": ("a", 3, 2, 0),
    "overlapping_a_mapping_from_above": ("a", 2, 2, 0),
    "inside_a_mapping": ("a", 1, 1, 0),
    "exactly_over_a_mapping": ("a", 1, 2, 0),
    "covering_a_mapping": ("a", 3, 3, 0),
    "past_the_handle_end": ("b", 0, 2, 1),
}


@pytest.mark.parametrize("case", MAP_REFUSALS)
def test_map_outside_one_reservation_or_over_a_mapping_is_refused_and_changes_nothing(raw, layout, case):
    a, b, handle = layout
    where, first, n, offset = MAP_REFUSALS[case]
    va = (a if where == "a" else b) + first * raw.g
    _refused(
        raw,
        "map",
        (va, n * raw.g, handle, offset * raw.g),
        f"map({where.upper()}{first:+d} granules, {n} granules, offset {offset} granules) {case}",
    )


UNMAP_REFUSALS = {  # name: (first granule of A, granules)
    "lower_part_of_a_mapping": (1, 1),
    "upper_part_of_a_mapping": (2, 1),
    "a_mapping_and_the_granule_after": (1, 3),
    "two_mappings_and_the_gap": (1, 4),
    "nothing_mapped": (5, 1),
}


@pytest.mark.parametrize("case", UNMAP_REFUSALS)
def test_unmap_of_anything_but_one_whole_mapping_is_refused_and_changes_nothing(raw, layout, case):
    a, _, _ = layout
    first, n = UNMAP_REFUSALS[case]
    raw.inner.synchronize()
    _refused(raw, "unmap", (a + first * raw.g, n * raw.g), f"unmap(A{first:+d} granules, {n} granules) {case}")


SET_ACCESS_REFUSALS = {  # name: (first granule of A, granules)
    "partly_mapped_from_below": (3, 2),
    "partly_mapped_from_above": (4, 2),
    "two_mappings_and_the_gap": (1, 4),
    "nothing_mapped": (5, 2),
}


@pytest.mark.parametrize("case", SET_ACCESS_REFUSALS)
def test_set_access_on_a_range_not_fully_mapped_is_refused_and_changes_nothing(raw, layout, case):
    a, _, _ = layout
    first, n = SET_ACCESS_REFUSALS[case]
    _refused(
        raw, "set_access", (a + first * raw.g, n * raw.g), f"set_access(A{first:+d} granules, {n} granules) {case}"
    )


FREE_REFUSALS = {  # name: (reservation, first granule, granules)
    "a_reservation_with_live_mappings": ("a", 0, 7),
    "lower_part_of_a_reservation": ("b", 0, 1),
    "upper_part_of_a_reservation": ("b", 1, 1),
    "part_of_a_reservation_with_live_mappings": ("a", 0, 3),
}


@pytest.mark.parametrize("case", FREE_REFUSALS)
def test_free_of_anything_but_one_empty_reservation_is_refused_and_changes_nothing(raw, layout, case):
    a, b, _ = layout
    where, first, n = FREE_REFUSALS[case]
    va = (a if where == "a" else b) + first * raw.g
    _refused(raw, "free", (va, n * raw.g), f"free({where.upper()}{first:+d} granules, {n} granules) {case}")


# -- memory is returned --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["release_then_unmap", "unmap_then_release"])
def test_memory_is_returned_once_unmapped_and_released(raw, driver, order):
    g = raw.g
    free0, kernel0 = free_bytes(driver), _kernel(driver)
    va = raw.reserve(2)
    handle = raw.create(2 * g)
    held = free_bytes(driver)
    expect(held <= free0 - 2 * g, driver, f"mem_info free bytes after create({2 * g})", f"<= {free0 - 2 * g}", held)
    if kernel0 is not None:
        grown = {k: v for k, v in kernel_memfds().items() if k not in kernel0}
        expect_equal(
            driver,
            f"sizes of the memfds the kernel holds after create({2 * g}) that it did not before",
            [2 * g],
            list(grown.values()),
        )
    raw.map(va, 2 * g, handle)
    steps = {"release": lambda: raw.release(handle), "unmap": lambda: raw.unmap(va, 2 * g)}
    first, second = order.split("_then_")
    steps[first]()
    expect_equal(driver, f"mem_info free bytes after {first} alone", held, free_bytes(driver))
    steps[second]()
    expect_equal(driver, f"mem_info free bytes after {first} and {second}", free0, free_bytes(driver))
    if kernel0 is not None:
        expect_equal(driver, f"memfds the kernel holds after {first} and {second}", kernel0, kernel_memfds())


def test_closing_a_tensor_returns_its_memory(driver):
    free0, kernel0 = free_bytes(driver), _kernel(driver)
    t = odd_tensor(driver)
    t.resize_per_segment_(t.segment_bytes)
    backed = sum(expected_granules(t)) * t.granularity
    expect(
        free_bytes(driver) <= free0 - backed,
        driver,
        "mem_info free bytes with the tensor committed",
        f"<= {free0 - backed}",
        free_bytes(driver),
    )
    t.close()
    expect_equal(driver, "mem_info free bytes after close()", free0, free_bytes(driver))
    if kernel0 is not None:
        expect_equal(driver, "memfds the kernel holds after close()", kernel0, kernel_memfds())


# -- running out of memory -------------------------------------------------------------------------------------------
def test_create_past_free_memory_raises_driver_out_of_memory_and_leaks_nothing(raw, driver):
    free0, total = driver.mem_info()
    step = oom_step(driver)
    kernel0 = _kernel(driver)
    error, made = None, 0
    for _ in range(total // step + 1):
        before = (free_bytes(driver), _kernel(driver))
        try:
            raw.create(step)
        except DriverError as exc:
            error = exc
            break
        made += 1
    expect(
        isinstance(error, DriverOutOfMemory) and error.operation == "create",
        driver,
        f"create({step}) once {made * step} of {free0} free bytes are held",
        "DriverOutOfMemory from create",
        repr(error) if error else f"no error after {made} creates ({made * step} bytes, total {total})",
    )
    expect(
        free0 - 2 * step <= made * step <= free0,
        driver,
        f"bytes created in steps of {step} before the refusal",
        f"between {free0 - 2 * step} and {free0}",
        made * step,
    )
    after = (free_bytes(driver), _kernel(driver))
    expect_equal(driver, "(mem_info free bytes, memfds the kernel holds) after the refused create", before, after)
    for handle in list(raw.handles):
        raw.release(handle)
    expect_equal(driver, "mem_info free bytes after releasing every handle", free0, free_bytes(driver))
    if kernel0 is not None:
        expect_equal(driver, "memfds the kernel holds after releasing every handle", kernel0, kernel_memfds())
