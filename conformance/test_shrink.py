"""Rules of shrink: a tensor's committed prefix made smaller (``shrink_per_segment_``) and a KV buffer set's block
count (``shrink_blocks``), on every driver.

A shrink gives back the granules no kept byte touches (``mem_info`` and the driver's records), keeps every address
and the bytes below the new size, and growth after it maps exactly the released granules, zeroed. It is refused,
changing nothing, while a view or a pin reaches past the new size; a driver failure or an interrupt at any line leaves
the old size with everything mapped, or the failed state that ``close()`` clears.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

import extensible_kv
from extensible_kv import ExtensibleTensor, granules
from extensible_kv.errors import (
    BusyError,
    ClosedError,
    CommitError,
    DriverError,
    FailedStateError,
    InvalidArgumentError,
    InvalidSizeError,
    ReleasedError,
    ShrinkError,
)
from extensible_kv.kv_cache import ExtensibleKVCacheBuffers, KVBuffer

from .helpers import (
    expect,
    expect_bytes,
    expect_equal,
    expected_granules,
    free_bytes,
    granule_states,
    host_kernel,
    kernel_memfds,
    odd_tensor,
    pattern,
    settle_device,
    shared_pattern,
)
from .line_trap import Interrupt, LineTrap

PACKAGE = Path(extensible_kv.__file__).resolve().parent
WATCHED = tuple(str(PACKAGE / name) for name in ("tensor.py", "reaper.py"))
"""The files whose lines the interrupt rule interrupts: the shrink's own code and its locked sections. The granule
arithmetic runs before anything changes; the driver's own lines are P-interrupted's (``test_interrupted_calls.py``),
and a ``Ledger`` interrupted between its inner call and its record would leak by itself."""
SHRINK_OPS = ("create", "synchronize", "unmap", "map", "set_access", "release")
"""The driver calls a shrink makes: its prepare half (``create``, ``synchronize``) and its unmapping half."""
MAX_LINES = 600
"""Line events of one uninterrupted shrink past which the interrupt rule stops (it reports how many it reached)."""


def _filled(driver, num_segments: int = 3, quarters: int = 2) -> ExtensibleTensor:
    """An odd-sized tensor (segment boundaries inside granules) grown in one step to ``quarters`` / 4 of each
    segment, so one mapping holds granules a shrink keeps and granules it releases, with a pattern in every byte."""
    t = odd_tensor(driver, num_segments=num_segments)
    t.resize_per_segment_(t.segment_bytes // 1024 * 256 * quarters)
    for i in range(t.num_segments):
        t.segment_view(i).copy_(shared_pattern(t.bytes_per_segment, i + 1, driver.device))
    return t


def _small(t: ExtensibleTensor) -> int:
    """A size that keeps a part of the first granule of every segment: most of each mapping is released."""
    return t.segment_bytes // 1024 * 64


def _mapped_bytes(driver) -> int:
    return sum(driver.outstanding().mappings.values())


def _data(t: ExtensibleTensor) -> list[torch.Tensor]:
    return [t.segment_view(i).cpu().clone() for i in range(t.num_segments)]


def _expect_unchanged(driver, t: ExtensibleTensor, where: str, size: int, mappings: dict, data: list) -> None:
    """After ``where``: ``t`` is open at ``size`` bytes per segment, the driver's mappings are ``mappings``, the
    granules of that size are accessible and segment ``i`` reads ``data[i]``."""
    expect_equal(driver, f"(state, bytes_per_segment) after {where}", ("open", size), (t.state, t.bytes_per_segment))
    expect_equal(driver, f"mappings after {where}", mappings, driver.outstanding().mappings)
    expect_equal(
        driver,
        f"accessible granules after {where}",
        expected_granules(t),
        granule_states(driver, t.base_address, t.max_num_bytes),
    )
    for i, d in enumerate(data):
        expect_bytes(driver, f"segment {i} after {where}", t.segment_view(i).cpu(), d)


def _expect_old_or_failed(driver, t: ExtensibleTensor, where: str, size: int, data: list) -> str:
    """After ``where``: ``t`` is open at ``size`` with every granule of it mapped and its bytes, or ``failed``,
    refusing views, with ``close()`` giving back everything; returns the state."""
    state = t.state
    expect(state in ("open", "failed"), driver, f"state after {where}", "open or failed", state)
    if state == "open":
        expect_equal(driver, f"bytes_per_segment after {where} (open)", size, t.bytes_per_segment)
        expect_equal(
            driver,
            f"accessible granules after {where} (open)",
            expected_granules(t),
            granule_states(driver, t.base_address, t.max_num_bytes),
        )
        for i, d in enumerate(data):
            expect_bytes(driver, f"segment {i} after {where} (open)", t.segment_view(i).cpu(), d)
        expect_equal(driver, f"handles held after {where} (open)", 0, driver.outstanding().handles)
    else:
        with pytest.raises(FailedStateError):
            t.segment_view(0)
    t.close()
    held = driver.outstanding()
    expect_equal(
        driver,
        f"(reservations, handles, mappings) after close() following {where}",
        ({}, 0, {}),
        (held.reservations, held.handles, held.mappings),
    )
    return state


# -- what a shrink gives back and keeps --------------------------------------------------------------------------------
def test_a_shrink_returns_the_memory_of_the_released_granules(driver):
    settle_device(driver)
    kernel0 = kernel_memfds() if host_kernel(driver) else None
    t = _filled(driver)
    g, old, new = t.granularity, t.bytes_per_segment, _small(t)
    released = granules.released_granule_runs(t.segment_bytes, t.num_segments, old, new, g)
    expected = sum(hi - lo for lo, hi in released) * g
    settle_device(driver)
    free0, mapped0 = free_bytes(driver), _mapped_bytes(driver)
    t.shrink_per_segment_(new)
    settle_device(driver)  # the kept bytes' copy went through torch's cache
    expect_equal(driver, "mapped bytes given back by shrink_per_segment_", expected, mapped0 - _mapped_bytes(driver))
    freed = free_bytes(driver) - free0
    expect(
        abs(freed - expected) <= g * t.num_segments,
        driver,
        f"mem_info free bytes gained by shrink_per_segment_({new}) from {old}",
        f"{expected} (the released granules), within one granule per segment ({g * t.num_segments})",
        freed,
    )
    expect_equal(driver, "handles held after shrink_per_segment_", 0, driver.outstanding().handles)
    stats = t.stats()
    expect_equal(
        driver,
        "stats (state, committed, backed) after shrink_per_segment_",
        ("open", new * t.num_segments, sum(expected_granules(t)) * g),
        (stats.state, stats.committed_bytes, stats.backed_bytes),
    )
    t.close()
    if kernel0 is not None:
        expect_equal(driver, "memfds the kernel holds after shrink and close()", kernel0, kernel_memfds())


@pytest.mark.parametrize("to", ["part_of_a_granule", "a_granule_boundary", "zero"])
def test_a_shrink_keeps_every_address_and_the_bytes_below_the_new_size(driver, to):
    t = _filled(driver)
    g, base, old = t.granularity, t.base_address, t.bytes_per_segment
    new = {"part_of_a_granule": _small(t), "a_granule_boundary": g if g < old else old // 512 * 256, "zero": 0}[to]
    full = t.full_view()
    t.shrink_per_segment_(new)
    expect_equal(
        driver,
        f"(base_address, full_view address) after shrink to {new}",
        (base, base),
        (t.base_address, full.data_ptr()),
    )
    expect_equal(
        driver, f"(state, bytes_per_segment) after shrink to {new}", ("open", new), (t.state, t.bytes_per_segment)
    )
    expect_equal(
        driver,
        f"accessible granules after shrink to {new}",
        expected_granules(t),
        granule_states(driver, base, t.max_num_bytes),
    )
    for i in range(t.num_segments):
        view = t.segment_view(i)
        if new:
            expect_equal(
                driver, f"segment {i} address after shrink to {new}", base + i * t.segment_bytes, view.data_ptr()
            )
        expect_bytes(
            driver, f"segment {i} after shrink to {new}", view, shared_pattern(old, i + 1, driver.device)[:new]
        )
        del view
    del full
    t.close()


def test_growth_after_a_shrink_maps_exactly_the_released_granules_and_zeroes_them(driver):
    t = _filled(driver)
    g, old, new = t.granularity, t.bytes_per_segment, _small(t)
    base = t.base_address
    t.shrink_per_segment_(new)
    expect_equal(  # growth zeroes from the new size up: a kept granule unmapped would fault there
        driver,
        f"accessible granules after a shrink {old} -> {new}",
        expected_granules(t),
        granule_states(driver, base, t.max_num_bytes),
    )
    before = driver.outstanding().mappings
    t.resize_per_segment_(old)
    expect_equal(  # first: the bytes below are read only where the driver says they are mapped
        driver,
        f"accessible granules after growing back from a shrink {old} -> {new}",
        expected_granules(t),
        granule_states(driver, base, t.max_num_bytes),
    )
    for i in range(t.num_segments):
        view = t.segment_view(i)
        expect_bytes(
            driver, f"segment {i} bytes growth mapped after a shrink", view[new:], torch.zeros_like(view[new:])
        )
        expect_bytes(
            driver,
            f"segment {i} kept bytes after growing back",
            view[:new],
            shared_pattern(old, i + 1, driver.device)[:new],
        )
        del view
    mapped = sorted(
        (va - base) // g + k
        for va, size in driver.outstanding().mappings.items()
        if va not in before
        for k in range(size // g)
    )
    released = granules.released_granule_runs(t.segment_bytes, t.num_segments, old, new, g)
    expect_equal(
        driver,
        f"granules growth maps after a shrink {old} -> {new} (the released runs {released})",
        [k for lo, hi in released for k in range(lo, hi)],
        mapped,
    )
    t.close()


# -- refusals --------------------------------------------------------------------------------------------------------
def test_a_checkpoint_taken_before_a_shrink_is_refused_and_one_after_rolls_back(driver):
    t = _filled(driver)
    old, new = t.bytes_per_segment, _small(t)
    before = t.checkpoint()
    t.shrink_per_segment_(new)
    mappings, data = driver.outstanding().mappings, _data(t)
    with pytest.raises(InvalidArgumentError) as info:
        t.rollback_to(before)
    expect(
        "lineage" in str(info.value),
        driver,
        f"rollback_to a checkpoint at {old} taken before a shrink to {new}",
        "InvalidArgumentError naming the lineage",
        str(info.value),
    )
    _expect_unchanged(driver, t, "a refused rollback_to across a shrink", new, mappings, data)
    after = t.checkpoint()
    t.resize_per_segment_(old)
    expect_equal(driver, "rollback_to a checkpoint taken after the shrink: left undone", [], t.rollback_to(after))
    _expect_unchanged(driver, t, "rollback_to a checkpoint taken after the shrink", new, mappings, data)
    t.close()


def test_a_view_or_a_pin_reaching_past_the_new_size_refuses_the_shrink_and_changes_nothing(driver):
    t = _filled(driver)
    old, new = t.bytes_per_segment, _small(t)
    mappings, data = driver.outstanding().mappings, _data(t)
    view = t.segment_view(1)
    with pytest.raises(BusyError) as info:
        t.shrink_per_segment_(new)
    expect(
        str(old) in str(info.value) and str(new) in str(info.value),
        driver,
        "BusyError of a shrink under a live segment view",
        f"a message naming {new} and the view's {old} bytes per segment",
        str(info.value),
    )
    _expect_unchanged(driver, t, "a shrink refused for a live segment view", old, mappings, data)
    del view
    t.pin("connector X")
    with pytest.raises(BusyError) as info:
        t.shrink_per_segment_(new)
    expect(
        "connector X" in str(info.value), driver, "BusyError of a pinned shrink", "naming connector X", str(info.value)
    )
    _expect_unchanged(driver, t, "a shrink refused for a pin", old, mappings, data)
    t.unpin("connector X")
    full = t.full_view()  # reaches nothing: never blocks
    t.shrink_per_segment_(new)
    expect_equal(driver, "bytes_per_segment after a shrink with a full_view alive", new, t.bytes_per_segment)
    del full
    t.close()


@pytest.mark.parametrize("kind", ["float", "bool", "negative", "larger", "misaligned", "released", "closed", "failed"])
def test_invalid_shrinks_are_refused_with_typed_errors_and_change_nothing(driver, kind):
    t = odd_tensor(driver, num_segments=2, alignment=256)
    t.resize_per_segment_(t.segment_bytes // 512 * 256)
    old = t.bytes_per_segment
    arg, error = {
        "float": (float(old // 2), InvalidSizeError),
        "bool": (True, InvalidSizeError),
        "negative": (-256, InvalidSizeError),
        "larger": (old + 256, InvalidSizeError),
        "misaligned": (old // 2 + 1, InvalidSizeError),
        "released": (old // 2, ReleasedError),
        "closed": (old // 2, ClosedError),
        "failed": (old // 2, FailedStateError),
    }[kind]
    if kind == "released":
        t.release_physical()
    elif kind == "closed":
        t.close()
    elif kind == "failed":
        driver.fail("unmap", 1)
        try:
            with pytest.raises(DriverError):
                t.release_physical()
        finally:
            driver.clear_faults()
        if t.state != "failed":
            t.close()
            pytest.skip(f"driver {driver.name}: a release failing at unmap did not leave the tensor failed")
    mappings, state = driver.outstanding().mappings, t.state
    with pytest.raises(error) as info:
        t.shrink_per_segment_(arg)
    expect(
        kind in ("released", "closed", "failed") or repr(arg) in str(info.value) or str(arg) in str(info.value),
        driver,
        f"{type(info.value).__name__} of shrink_per_segment_({arg!r}) ({kind})",
        "a message naming the value",
        str(info.value),
    )
    expect_equal(
        driver,
        f"(state, mappings) after a refused shrink ({kind})",
        (state, mappings),
        (t.state, driver.outstanding().mappings),
    )
    t.close()


# -- failures and interrupts -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nth", [1, 2])
@pytest.mark.parametrize("op", SHRINK_OPS)
def test_a_driver_failure_in_a_shrink_is_typed_and_leaves_the_old_size_or_failed(driver, op, nth):
    t = _filled(driver)
    old, new = t.bytes_per_segment, _small(t)
    mappings, data = driver.outstanding().mappings, _data(t)
    driver.fail(op, nth)
    try:
        try:
            t.shrink_per_segment_(new)
            raised = None
        except ShrinkError as exc:
            raised = exc
    finally:
        driver.clear_faults()
    if raised is None:  # fewer than nth calls of op, or a release failing after the step was done: shrunk
        expect_equal(
            driver,
            f"(state, bytes_per_segment) after a shrink whose {op} #{nth} failed or was never reached",
            ("open", new),
            (t.state, t.bytes_per_segment),
        )
        for i, d in enumerate(data):
            expect_bytes(
                driver, f"segment {i} after a shrink whose {op} #{nth} failed", t.segment_view(i).cpu(), d[:new]
            )
        t.close()
        held = driver.outstanding()
        expect_equal(
            driver,
            f"outstanding after close() (shrink, {op} #{nth})",
            ({}, 0, {}),
            (held.reservations, held.handles, held.mappings),
        )
        return
    expect(
        str(old) in str(raised) and str(new) in str(raised) and raised.operation == op,
        driver,
        f"ShrinkError of a shrink failing at {op} #{nth}",
        f"operation {op!r} and a message naming {old} and {new}",
        f"operation {raised.operation!r}: {raised}",
    )
    if op in ("create", "synchronize") or (op == "unmap" and nth == 1):  # nothing was unmapped yet
        _expect_unchanged(driver, t, f"a shrink failing at {op} #{nth}", old, mappings, data)
        expect_equal(driver, f"handles held after a shrink failing at {op} #{nth}", 0, driver.outstanding().handles)
        t.shrink_per_segment_(new)
        expect_equal(driver, f"bytes_per_segment of a shrink retried after {op} #{nth}", new, t.bytes_per_segment)
        data = [d[:new] for d in data]
        _expect_old_or_failed(driver, t, f"a shrink retried after {op} #{nth}", new, data)
    else:
        _expect_old_or_failed(driver, t, f"a shrink failing at {op} #{nth}", old, data)


def test_a_shrink_interrupted_at_any_line_leaves_the_old_size_or_failed(driver):
    counter = LineTrap(lambda name: name in WATCHED, 0)
    t = _filled(driver)
    new = _small(t)
    gc.collect()
    gc.disable()
    try:
        with counter:
            t.shrink_per_segment_(new)
    finally:
        gc.enable()
    t.close()
    total = min(counter.lines, MAX_LINES)
    outcomes = {"open": 0, "failed": 0, "shrunk": 0}
    for n in range(1, total + 1):
        t = _filled(driver)
        old, data = t.bytes_per_segment, _data(t)
        trap = LineTrap(lambda name: name in WATCHED, n)
        gc.disable()  # the line events are the shrink's own: no collection (and its callbacks) inside it
        try:
            with trap:
                t.shrink_per_segment_(new)
        except Interrupt:
            pass
        finally:
            gc.enable()
        where = f"a shrink {old} -> {new} interrupted at line event {n} of {counter.lines} ({trap.fired})"
        if trap.fired is None or (t.state == "open" and t.bytes_per_segment == new):
            outcomes["shrunk"] += 1
            _expect_old_or_failed(driver, t, where, new, [d[:new] for d in data])
        else:
            outcomes[_expect_old_or_failed(driver, t, where, old, data)] += 1
    expect(
        outcomes["open"] > 0,
        driver,
        f"outcomes of a shrink interrupted at each of {total} line events",
        "some interrupts keeping the old size",
        outcomes,
    )


# -- the KV buffers --------------------------------------------------------------------------------------------------
def _kv(driver) -> ExtensibleKVCacheBuffers:
    g = driver.granularity()
    return ExtensibleKVCacheBuffers(
        [KVBuffer("kv", g // 2, num_segments=2), KVBuffer("state", g // 4 * 3, num_segments=1)], 24, driver=driver
    )


def test_kv_shrink_blocks_gives_back_every_buffers_blocks_and_keeps_the_rest(driver):
    settle_device(driver)
    kv = _kv(driver)
    kv.ensure_blocks(20)
    for b in kv.buffers:
        for i in range(kv.tensor(b.name).num_segments):
            view = kv.tensor(b.name).segment_view(i)
            view.copy_(pattern(view.numel(), i + 3, driver.device))
            del view
    addresses = {b.name: kv.raw(b.name).data_ptr() for b in kv.buffers}
    backed0 = kv.stats().backed_bytes
    settle_device(driver)
    free0 = free_bytes(driver)
    released = kv.shrink_blocks(5)
    settle_device(driver)
    stats = kv.stats()
    expect_equal(
        driver,
        "(num_blocks, stats.num_blocks, returned bytes) after shrink_blocks(5) from 20",
        (5, 5, backed0 - stats.backed_bytes),
        (kv.num_blocks, stats.num_blocks, released),
    )
    expect(released > 0, driver, "bytes shrink_blocks(5) from 20 gave back", "more than 0", released)
    slack = driver.granularity() * sum(kv.tensor(b.name).num_segments for b in kv.buffers)
    gained = free_bytes(driver) - free0
    expect(
        abs(gained - released) <= slack,
        driver,
        "mem_info free bytes gained by shrink_blocks(5) from 20",
        f"{released} (the bytes it returned), within one granule per segment ({slack})",
        gained,
    )
    for b in kv.buffers:
        t = kv.tensor(b.name)
        expect_equal(
            driver, f"buffer {b.name} address after shrink_blocks", addresses[b.name], kv.raw(b.name).data_ptr()
        )
        expect_equal(
            driver, f"buffer {b.name} bytes per segment", 5 * b.page_size_bytes // t.num_segments, t.bytes_per_segment
        )
        for i in range(t.num_segments):
            view = t.segment_view(i)
            full = 20 * b.page_size_bytes // t.num_segments
            expect_bytes(
                driver,
                f"buffer {b.name} segment {i} after shrink_blocks",
                view,
                pattern(full, i + 3, driver.device)[: view.numel()],
            )
            del view
    expect_equal(driver, "ensure_blocks after shrink_blocks", 12, kv.ensure_blocks(12))
    view = kv.tensor("kv").segment_view(1)
    per_block = kv.buffers[0].page_size_bytes // 2
    expect_bytes(
        driver,
        "blocks 5..11 grown back after shrink_blocks",
        view[5 * per_block :],
        torch.zeros_like(view[5 * per_block :]),
    )
    del view
    kv.close()


def test_kv_shrink_blocks_is_refused_below_a_pin_and_changes_nothing(driver):
    kv = _kv(driver)
    kv.ensure_blocks(10)
    mappings = driver.outstanding().mappings
    kv.pin("connector X")
    for arg, error in ((4, BusyError), (11, InvalidSizeError), (-1, InvalidSizeError), (2.0, InvalidSizeError)):
        with pytest.raises(error) as info:
            kv.shrink_blocks(arg)
        expect(
            str(arg) in str(info.value),
            driver,
            f"{type(info.value).__name__} of shrink_blocks({arg!r}) on pinned buffers at 10 blocks",
            f"a message naming {arg!r}",
            str(info.value),
        )
        expect_equal(
            driver,
            f"(num_blocks, mappings) after a refused shrink_blocks({arg!r})",
            (10, mappings),
            (kv.num_blocks, driver.outstanding().mappings),
        )
    kv.unpin("connector X")
    kv.release_physical()
    with pytest.raises(ReleasedError):
        kv.shrink_blocks(4)
    kv.recommit_physical()
    expect_equal(driver, "shrink_blocks(10) at 10 blocks", 0, kv.shrink_blocks(10))
    kv.close()


def _kv_cycled(driver) -> tuple[ExtensibleKVCacheBuffers, list]:
    """``_kv`` at 20 blocks after two shrinks to 3 and growths back (the first leaves the mappings every later one
    starts from), and the driver calls of the last shrink: where a fault aimed at one buffer's step lands."""
    kv = _kv(driver)
    kv.ensure_blocks(20)
    for _ in range(2):
        since = len(driver.calls)
        kv.shrink_blocks(3)
        calls = driver.calls[since:]
        kv.ensure_blocks(20)
    return kv, calls


def _failure(kv) -> str:
    """Why the buffers refuse growth ('' while they take it)."""
    try:
        kv.ensure_blocks(0)
    except FailedStateError as exc:
        return str(exc)
    except Exception as exc:  # judged by the caller: not a failed state
        return f"{type(exc).__name__}: {exc}"
    return ""


def _failed_by_the_step(kv) -> bool:
    """Failed, and for a reason a failed step may give: a buffer failed by its own undo, or one that could not grow
    back; never only because the buffers' sizes disagree (a step that shrank one and did not grow it back)."""
    reason = _failure(kv)
    return kv.state == "failed" and bool(reason) and "through tensor(name)" not in reason


def test_kv_shrink_blocks_failing_in_one_buffer_grows_the_others_back(driver):
    kv, calls = _kv_cycled(driver)
    first = kv.tensor("kv")
    lo, hi = first.base_address, first.base_address + first.max_num_bytes
    in_first = [c for c in calls if c.op == "unmap" and lo <= c.args[0] < hi]
    driver.fail("unmap", len(in_first) + 1)  # the first unmap in the second buffer
    first.segment_view(0)[:16].fill_(7)
    try:
        with pytest.raises(CommitError):
            kv.shrink_blocks(3)
    finally:
        driver.clear_faults()
    expect(
        kv.state == "open" or _failed_by_the_step(kv),
        driver,
        "KV state after a shrink_blocks failing in its second buffer",
        "open, or failed by a buffer that could not undo its own step",
        f"{kv.state}: {_failure(kv)}",
    )
    if kv.state == "open":
        expect_equal(driver, "num_blocks after a failed shrink_blocks", 20, kv.num_blocks)
        for b in kv.buffers:
            t = kv.tensor(b.name)
            expect_equal(
                driver,
                f"buffer {b.name} bytes per segment after a failed shrink_blocks",
                20 * b.page_size_bytes // t.num_segments,
                t.bytes_per_segment,
            )
            expect_equal(
                driver,
                f"buffer {b.name} accessible granules",
                expected_granules(t),
                granule_states(driver, t.base_address, t.max_num_bytes),
            )
        view = first.segment_view(0)
        expect_bytes(
            driver,
            "kept block bytes after a failed shrink_blocks",
            view[:16],
            torch.full((16,), 7, dtype=torch.uint8, device=view.device),
        )
        del view
    kv.close()
    expect_equal(driver, "outstanding after close()", ({}, 0, {}), tuple(vars(driver.outstanding()).values()))


def test_a_kv_shrink_interrupted_at_any_line_leaves_the_old_count_or_failed(driver):
    watched = (*WATCHED, str(PACKAGE / "kv_cache.py"))
    outcomes: dict[str, int] = {}
    n, total = 0, None
    while total is None or n < min(total, MAX_LINES):
        kv = _kv(driver)
        kv.ensure_blocks(6)
        kv.tensor("kv").segment_view(1)[:64].fill_(5)
        trap = LineTrap(lambda name: name in watched, n)
        gc.disable()  # the line events are the step's own: no collection (and its callbacks) inside it
        try:
            with trap:
                kv.shrink_blocks(1)
        except Interrupt:
            pass
        finally:
            gc.enable()
        if total is None:
            total = trap.lines  # n == 0: the uninterrupted step, counted
        where = f"shrink_blocks(1) from 6 interrupted at line event {n} of {total} ({trap.fired})"
        got = (kv.state, kv.num_blocks)
        expect(got in {("open", 6), ("open", 1)} or _failed_by_the_step(kv), driver, where,
               "open at 6 or 1 blocks, or failed by a buffer that could not undo its own step",
               f"{got}: {_failure(kv)}")  # fmt: skip
        outcomes[str(got)] = outcomes.get(str(got), 0) + 1
        if kv.state == "open":
            for b in kv.buffers:
                t = kv.tensor(b.name)
                expect_equal(
                    driver,
                    f"buffer {b.name} bytes per segment after {where} (at {kv.num_blocks} blocks)",
                    kv.num_blocks * b.page_size_bytes // t.num_segments,
                    t.bytes_per_segment,
                )
                expect_equal(
                    driver,
                    f"buffer {b.name} accessible granules after {where}",
                    expected_granules(t),
                    granule_states(driver, t.base_address, t.max_num_bytes),
                )
            view = kv.tensor("kv").segment_view(1)
            expect_bytes(driver, f"kept bytes after {where}", view[:64].cpu(), torch.full((64,), 5, dtype=torch.uint8))
            del view
        kv.close()
        held = driver.outstanding()
        expect_equal(driver, f"outstanding after close() following {where}", ({}, 0, {}),
                     (held.reservations, held.handles, held.mappings))  # fmt: skip
        n += 1
    expect(
        outcomes.get(str(("open", 6)), 0) > 0,
        driver,
        f"outcomes of shrink_blocks interrupted at each of {total} line events",
        "some interrupts keeping the old count",
        outcomes,
    )


@pytest.mark.parametrize("holder", ["segment_view", "pin", "committed_layer_view"])
def test_kv_shrink_blocks_refused_by_the_last_buffer_changes_no_buffer(driver, holder):
    # A view or pin on the last buffer refuses the step before any buffer shrinks: an earlier buffer shrunk, then
    # grown back, would come back zeroed.
    from . import layouts

    kv = layouts.kv_cache(driver, "kv_first", buffers=2)
    kv.ensure_blocks(20)
    first, last = (kv.tensor(b.name) for b in kv.buffers)
    view = first.segment_view(0)
    view.copy_(pattern(view.numel(), 9, driver.device))
    before = view.clone()
    del view
    mappings = driver.outstanding().mappings
    held = None
    if holder == "segment_view":
        held = last.segment_view(0)
    elif holder == "pin":
        last.pin("connector Y")
    else:
        held = kv.committed_layer_views(kv.buffers[-1].layers[0].name)
    with pytest.raises(BusyError):
        kv.shrink_blocks(4)
    expect_equal(
        driver,
        f"(num_blocks, mappings) after shrink_blocks(4) refused by a {holder} on the last buffer",
        (20, mappings),
        (kv.num_blocks, driver.outstanding().mappings),
    )
    view = first.segment_view(0)
    expect_bytes(driver, f"the first buffer's bytes after shrink_blocks(4) refused by a {holder}", view, before)
    del view, held
    if holder == "pin":
        last.unpin("connector Y")
    kv.shrink_blocks(4)
    expect_equal(driver, f"num_blocks after shrink_blocks(4) once the {holder} is gone", 4, kv.num_blocks)
    kv.close()


@pytest.mark.parametrize("second", ["create", "map", "set_access"])
def test_a_second_interrupt_while_growing_back_leaves_the_kv_buffers_failed_or_agreeing(driver, second):
    # The first interrupt lands in the last buffer's shrink before it changed anything, the second in the growth back
    # of the buffer shrunk before it: the buffers end failed, or open with every buffer at their block count (never
    # open and disagreeing).
    kv, calls = _kv_cycled(driver)
    last = kv.tensor("state")
    lo, hi = last.base_address, last.base_address + last.max_num_bytes
    at = next(i for i, c in enumerate(calls) if c.args and isinstance(c.args[0], int) and lo <= c.args[0] < hi)
    syncs = sum(c.op == "synchronize" for c in calls[:at])  # the last of them opens the second buffer's shrink
    driver.fail("synchronize", syncs, KeyboardInterrupt())  # in the second buffer's shrink, before it changed
    driver.fail(second, 1, KeyboardInterrupt())  # the first in the growth back (the shrink itself makes none)
    try:
        with pytest.raises(KeyboardInterrupt):
            kv.shrink_blocks(3)
    finally:
        driver.clear_faults()
    where = f"shrink_blocks(3) interrupted in its second buffer's shrink, then at the first {second} growing back"
    sizes = {b.name: kv.tensor(b.name).bytes_per_segment for b in kv.buffers if kv.tensor(b.name).state == "open"}
    agreeing = {b.name: kv.num_blocks * b.page_size_bytes // kv.tensor(b.name).num_segments for b in kv.buffers}
    expect(
        kv.state == "failed" or (kv.state == "open" and sizes == agreeing),
        driver,
        f"KV state and bytes per segment after {where}",
        f"failed, or open with {agreeing}",
        (kv.state, sizes),
    )
    kv.close()
    expect_equal(driver, f"outstanding after close() following {where}", ({}, 0, {}),
                 tuple(vars(driver.outstanding()).values()))  # fmt: skip
