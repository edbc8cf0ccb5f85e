"""Rules of ExtensibleTensor on a driver, one per test."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from extensible_kv import ExtensibleTensor, granules
from extensible_kv.errors import BusyError, ClosedError, CommitError, InvalidSizeError

from .helpers import (
    expect,
    expect_bytes,
    expect_equal,
    expect_rolled_back,
    expected_granules,
    granule_states,
    growth_state,
    odd_tensor,
    pattern,
)
from .tensors import new_tensor


def _steps(t: ExtensibleTensor) -> list[int]:
    """Growth sizes per segment: a sliver, across a granule, across the segment boundary's granule, the end."""
    g, seg = t.granularity, t.segment_bytes
    return sorted({256, min(g + 512, seg), min(2 * g + 1024, seg), seg})


def _fill_committed(t: ExtensibleTensor, seed: int) -> list[torch.Tensor]:
    written = []
    for i in range(t.num_segments):
        data = pattern(t.bytes_per_segment, seed + i, t.device)
        t.segment_view(i).copy_(data)
        written.append(data)
    return written


def test_base_address_is_stable_across_growth(driver):
    t = odd_tensor(driver)
    base = t.base_address
    full = t.full_view().data_ptr()
    expect_equal(driver, "full_view().data_ptr()", hex(base), hex(full))
    for n in _steps(t):
        t.resize_per_segment_(n)
        for i in range(t.num_segments):
            ptr = t.segment_view(i).data_ptr()
            expect_equal(
                driver, f"segment_view({i}).data_ptr() after growth to {n}", hex(base + i * t.segment_bytes), hex(ptr)
            )
        expect_equal(driver, f"full_view().data_ptr() after growth to {n}", hex(base), hex(t.full_view().data_ptr()))
    t.close()


def test_committed_data_survives_growth(driver):
    t = odd_tensor(driver)
    sizes = _steps(t)
    t.resize_per_segment_(sizes[0])
    for step, n in enumerate(sizes[1:], 1):
        old = t.bytes_per_segment
        written = _fill_committed(t, seed=step)
        t.resize_per_segment_(n)
        driver.synchronize()
        for i, data in enumerate(written):
            expect_bytes(driver, f"segment {i} prefix after growth {old}->{n}", t.segment_view(i)[:old], data)
    t.close()


def test_segments_grow_in_lockstep(driver):
    t = odd_tensor(driver)
    for n in _steps(t):
        t.resize_per_segment_(n)
        lengths = [t.segment_view(i).numel() for i in range(t.num_segments)]
        expect_equal(driver, f"segment view lengths after growth to {n}", [n] * t.num_segments, lengths)
        actual = granule_states(driver, t.base_address, t.max_num_bytes)
        want = expected_granules(t)
        expect_equal(driver, f"accessible granules after growth to {n} per segment", want, actual)
    t.close()


def test_zero_new_zeroes_exactly_the_new_range(driver):
    t = odd_tensor(driver)
    g = t.granularity
    t.resize_per_segment_(1024)
    old_data = _fill_committed(t, seed=5)
    # Bytes that are backed (same granule) but not committed yet: the next step must zero them, and only them.
    full = t.full_view()
    starts = [i * t.segment_bytes for i in range(t.num_segments)]
    ends = [min(-(-(s + 1024) // g) * g, s + t.segment_bytes) for s in starts]  # end of the backed granule
    for s, e in zip(starts, ends):
        full[s + 1024 : e].fill_(0xEE)
    new = 1024 + min(e - s - 1024 for s, e in zip(starts, ends)) // 2 // 256 * 256
    t.resize_per_segment_(new, zero_new=True)
    driver.synchronize()
    for i, (s, e) in enumerate(zip(starts, ends)):
        view = t.segment_view(i)
        expect_bytes(driver, f"segment {i} old bytes after zero_new growth", view[:1024], old_data[i])
        zeros = torch.zeros(new - 1024, dtype=torch.uint8, device=t.device)
        expect_bytes(driver, f"segment {i} new bytes [1024, {new}) after zero_new growth", view[1024:new], zeros)
        beyond = full[s + new : e]
        expect(
            bool((beyond == 0xEE).all()),
            driver,
            f"segment {i} backed bytes beyond the new size",
            "left alone (0xEE)",
            f"{int((beyond != 0xEE).sum())} of {beyond.numel()} bytes changed",
        )
    del full, view, beyond
    t.close()


def test_zero_new_false_leaves_old_data_and_zeroes_nothing(driver):
    t = odd_tensor(driver)
    t.resize_per_segment_(4096)
    old_data = _fill_committed(t, seed=9)
    before = len(driver.calls)
    t.resize_per_segment_(t.segment_bytes, zero_new=False)
    driver.synchronize()
    zeros = driver.count("zero", since=before)
    expect_equal(driver, "zero calls during a zero_new=False growth", 0, zeros)
    for i in range(t.num_segments):
        expect_bytes(
            driver, f"segment {i} old bytes after zero_new=False growth", t.segment_view(i)[:4096], old_data[i]
        )
    t.close()


def test_zeroing_is_one_memset_per_contiguous_new_range(driver):
    t = odd_tensor(driver)
    t.resize_per_segment_(512)
    before = len(driver.calls)
    t.resize_per_segment_(t.granularity + 512)
    zeros = driver.count("zero", since=before)
    expect_equal(driver, "zero calls for one growth step", t.num_segments, zeros)
    # From empty to full, all segments' new ranges touch: one memset for the whole reservation.
    t2 = odd_tensor(driver)
    before = len(driver.calls)
    t2.resize_per_segment_(t2.segment_bytes)
    zeros = driver.count("zero", since=before)
    expect_equal(driver, "zero calls for an empty-to-full growth", 1, zeros)
    t.close()
    t2.close()


def test_straddling_granule_is_mapped_once(driver):
    t = odd_tensor(driver, num_segments=2, granules_per_segment=1.5)
    g, seg = t.granularity, t.segment_bytes
    # The granule [g, 2g) holds the end of segment 0 and the start of segment 1.
    t.resize_per_segment_(256)  # maps the first granule of each segment: granules 0 and 1
    t.resize_per_segment_(seg)  # segment 0 now needs granule 1 too: it must not be mapped again
    base = t.base_address
    covered: dict[int, int] = {}
    for call in driver.calls:
        if call.op == "map":
            va, size, _ = call.args
            for k in range((va - base) // g, (va - base + size) // g):
                covered[k] = covered.get(k, 0) + 1
    twice = {k: n for k, n in covered.items() if n != 1}
    expect_equal(driver, "granules mapped other than once (granule: times)", {}, twice)
    expect_equal(driver, "granules mapped", list(range(-(-2 * seg // g))), sorted(covered))
    t.close()


def test_one_handle_per_contiguous_run_of_new_granules(driver):
    g = driver.granularity()
    t = new_tensor(16 * g, driver=driver)
    t.resize_per_segment_(g)
    before = len(driver.calls)
    t.resize_per_segment_(16 * g)
    cap = driver.max_handle_bytes
    want = 1 if not cap else -(-15 * g // max(cap // g * g, g))
    creates, accesses = driver.count("create", since=before), driver.count("set_access", since=before)
    expect_equal(driver, "create calls for one 15-granule run", want, creates)
    expect_equal(driver, "set_access calls for one 15-granule run", 1, accesses)
    t2 = odd_tensor(driver, num_segments=4, granules_per_segment=3.25)
    before = len(driver.calls)
    t2.resize_per_segment_(t2.segment_bytes // 2)
    runs = granules.new_granule_runs(t2.segment_bytes, 4, 0, t2.segment_bytes // 2, g)
    accesses = driver.count("set_access", since=before)
    expect_equal(driver, "set_access calls for a 4-segment growth", len(runs), accesses)
    t.close()
    t2.close()


def test_views_cover_exactly_the_committed_bytes(driver):
    t = odd_tensor(driver)
    n = t.granularity + 1024
    t.resize_per_segment_(n)
    for i in range(t.num_segments):
        v = t.segment_view(i)
        expect_equal(driver, f"segment_view({i}).numel()", n, v.numel())
        half = t.segment_view(i, torch.float16)
        expect_equal(driver, f"segment_view({i}, float16).shape", (n // 2,), tuple(half.shape))
        expect_equal(driver, f"segment_view({i}, float16).data_ptr()", v.data_ptr(), half.data_ptr())
    full = t.full_view()
    expect_equal(driver, "full_view().numel()", t.max_num_bytes, full.numel())
    empty = odd_tensor(driver)
    expect_equal(driver, "segment_view before any growth", 0, empty.segment_view(1).numel())
    del v, half, full
    t.close()
    empty.close()


# -- invalid use ---------------------------------------------------------------------------------------------------
def _shrink(t):
    t.resize_per_segment_(t.bytes_per_segment - 256)


def _past_reservation(t):
    t.resize_per_segment_(t.segment_bytes + 256)


def _zero_size(t):
    t.resize_per_segment_(0)


def _negative_size(t):
    t.resize_per_segment_(-4096)


def _misaligned_size(t):
    t.resize_per_segment_(t.bytes_per_segment + 100)  # alignment is 256 in these tests


def _float_size(t):
    t.resize_per_segment_(4096.0)


def _segment_index_out_of_range(t):
    t.segment_view(t.num_segments)


INVALID_USES = [
    _shrink,
    _past_reservation,
    _zero_size,
    _negative_size,
    _misaligned_size,
    _float_size,
    _segment_index_out_of_range,
]


@pytest.mark.parametrize("misuse", INVALID_USES, ids=[f.__name__.lstrip("_") for f in INVALID_USES])
def test_invalid_use_raises_invalid_size_error_and_changes_nothing(driver, misuse):
    t = odd_tensor(driver, alignment=256)
    t.resize_per_segment_(4096)
    data = _fill_committed(t, seed=3)
    before = len(driver.calls)
    with pytest.raises(InvalidSizeError):
        misuse(t)
    calls = driver.calls[before:]
    expect_equal(driver, f"driver calls made by {misuse.__name__}", [], calls)
    expect_equal(driver, f"bytes_per_segment after {misuse.__name__}", 4096, t.bytes_per_segment)
    for i in range(t.num_segments):
        expect_bytes(driver, f"segment {i} after {misuse.__name__}", t.segment_view(i), data[i])
    t.close()


CONSTRUCTOR_MISUSES = {
    "segments_do_not_divide": dict(max_num_bytes=3 * 4096 + 1, num_segments=3),
    "zero_bytes": dict(max_num_bytes=0),
    "negative_bytes": dict(max_num_bytes=-4096),
    "zero_segments": dict(max_num_bytes=4096, num_segments=0),
    "segment_not_multiple_of_alignment": dict(max_num_bytes=2 * 4096, num_segments=2, alignment=3000),
    "string_size": dict(max_num_bytes="4096"),
}


@pytest.mark.parametrize("kwargs", CONSTRUCTOR_MISUSES.values(), ids=CONSTRUCTOR_MISUSES.keys())
def test_invalid_construction_raises_and_reserves_nothing(driver, kwargs):
    with pytest.raises(InvalidSizeError):
        new_tensor(driver=driver, **kwargs)
    expect_equal(driver, f"driver calls made by ExtensibleTensor({kwargs})", [], driver.calls)


USES_AFTER_CLOSE = {
    "resize_per_segment_": lambda t: t.resize_per_segment_(8192),
    "segment_view": lambda t: t.segment_view(0),
    "full_view": lambda t: t.full_view(),
    "base_address": lambda t: t.base_address,
    "stats": lambda t: t.stats(),
}


@pytest.mark.parametrize("use", USES_AFTER_CLOSE.values(), ids=USES_AFTER_CLOSE.keys())
def test_use_after_close_raises_closed_error(driver, use):
    t = odd_tensor(driver)
    t.resize_per_segment_(4096)
    t.close()
    with pytest.raises(ClosedError):
        use(t)


# -- rollback ------------------------------------------------------------------------------------------------------
FAULTS = [
    ("create", 1),
    ("create", 2),
    ("map", 1),
    ("map", 3),
    ("release", 2),
    ("set_access", 1),
    ("set_access", 2),
    ("zero", 1),
    ("zero", 3),
]


@pytest.mark.parametrize("op,nth", FAULTS, ids=[f"{op}-{n}" for op, n in FAULTS])
def test_failed_growth_rolls_back_completely(driver, op, nth):
    t = odd_tensor(driver, num_segments=3, granules_per_segment=2.5)
    t.resize_per_segment_(1024)
    data = _fill_committed(t, seed=11)
    before = growth_state(driver, t)
    driver.fail(op, nth)
    with pytest.raises(CommitError) as info:
        t.resize_per_segment_(t.segment_bytes)
    expect_equal(driver, "CommitError.operation", op, info.value.operation)
    expect_equal(
        driver,
        "CommitError sizes (requested, committed)",
        (t.segment_bytes, 1024),
        (info.value.requested, info.value.committed),
    )
    expect_rolled_back(
        driver, t, f"failed {op} #{nth}", before, 1024, data, retry=lambda u: u.resize_per_segment_(u.segment_bytes)
    )  # the tensor is still usable
    t.close()


# -- lifetimes -----------------------------------------------------------------------------------------------------
def test_views_keep_the_tensor_alive(driver):
    t = odd_tensor(driver)
    t.resize_per_segment_(4096)
    view = t.segment_view(1)
    view.fill_(4)
    ref = weakref.ref(t)
    del t
    gc.collect()
    expect(ref() is not None, driver, "tensor while a view lives", "alive", "collected")
    expect(driver.outstanding().reservations != {}, driver, "reservation while a view lives", "held", "freed")
    expect_equal(driver, "view contents after the owner's last reference went", 4 * 4096, int(view.sum()))
    del view
    gc.collect()
    expect(ref() is None, driver, "tensor after its last view died", "collected", "alive")
    expect(
        not driver.outstanding(), driver, "driver state after collection", "nothing outstanding", driver.outstanding()
    )


def test_garbage_collection_frees_exactly_once(driver):
    t = odd_tensor(driver)
    t.resize_per_segment_(t.segment_bytes)
    del t
    gc.collect()
    frees = driver.count("free")
    expect_equal(driver, "free calls after collection", 1, frees)
    unmaps, maps = driver.count("unmap"), driver.count("map")
    expect_equal(driver, "unmap calls after collection", maps, unmaps)


def test_close_twice_is_harmless(driver):
    t = odd_tensor(driver)
    t.resize_per_segment_(4096)
    t.close()
    t.close()
    expect_equal(driver, "free calls after close twice", 1, driver.count("free"))


def test_close_refuses_while_views_are_alive(driver):
    t = odd_tensor(driver)
    t.resize_per_segment_(4096)
    view = t.segment_view(0)
    with pytest.raises(BusyError):
        t.close()
    expect_equal(
        driver, "tensor after a refused close (closed, view bytes)", (False, 4096), (t.closed, int(view.numel()))
    )
    del view
    t.close()
    expect_equal(driver, "closed after the view died", True, t.closed)
