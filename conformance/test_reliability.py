"""Reliability rules: a failure at every driver call of a growth step rolls back completely (tensor and KV buffers),
concurrent growth serializes, and object lifetimes survive garbage-collection stress."""

from __future__ import annotations

import gc
import random
import threading
import weakref

import pytest
import torch

from extensible_kv.drivers.ledger import OPERATIONS
from extensible_kv.errors import CommitError, DriverError

from . import layouts
from .helpers import (
    expect,
    expect_equal,
    expect_rolled_back,
    expected_granules,
    granule_states,
    growth_state,
    odd_tensor,
)
from .layouts import MAX_BLOCKS
from .tensors import zeroes_through_driver


class Interrupt(KeyboardInterrupt):
    """A KeyboardInterrupt raised on purpose (so a real Ctrl-C is never mistaken for it)."""


# What fails at a driver call of a growth step, and what the step must raise: a driver error becomes CommitError; an
# interrupt (any BaseException) is re-raised as it is, after the same rollback.
FAULTS = {"driver_error": (lambda op: None, CommitError), "keyboard_interrupt": (lambda op: Interrupt(), Interrupt)}


def _calls_of_a_step(driver, make, grow) -> dict[str, int]:
    """How many calls of each operation (``Ledger`` ``OPERATIONS``) one growth step makes, measured on a twin
    object; operations the step does not call are left out, so the sweep fails each call the step makes."""
    obj = make()
    before = len(driver.calls)
    grow(obj)
    counts = {op: driver.count(op, since=before) for op in OPERATIONS}
    obj.close()
    return {op: n for op, n in counts.items() if n}


@pytest.mark.parametrize("fault", FAULTS)
def test_failure_at_every_call_of_a_tensor_growth_step_rolls_back(driver, fault):
    def make():
        t = odd_tensor(driver, num_segments=3, granules_per_segment=3.5)
        t.resize_per_segment_(1024)
        return t

    def grow(t):
        t.resize_per_segment_(t.segment_bytes)

    counts = _calls_of_a_step(driver, make, grow)
    expect(
        counts["create"] >= 2 and (counts.get("zero", 0) >= 1 or not zeroes_through_driver()),
        driver,
        "calls in the swept growth step",
        "several creates and zeros",
        counts,
    )
    swept = 0
    for op, total in counts.items():
        for k in range(1, total + 1):
            t = make()
            data = [torch.randint(0, 256, (1024,), dtype=torch.uint8).to(t.device) for _ in range(3)]
            for i, d in enumerate(data):
                t.segment_view(i).copy_(d)
            driver.synchronize()
            before = growth_state(driver, t)
            error, raised = FAULTS[fault]
            driver.fail(op, k, error(op))
            with pytest.raises(raised):
                grow(t)
            expect_rolled_back(driver, t, f"failed {op} #{k} of {total}", before, 1024, data, retry=grow)
            t.close()
            swept += 1
    expect_equal(driver, "fault points swept", sum(counts.values()), swept)


@pytest.mark.parametrize("fault", FAULTS)
def test_failure_at_every_call_of_a_kv_growth_step_rolls_back_every_buffer(driver, fault):
    def make():
        cache = layouts.kv_cache(driver, "kv_first", buffers=3)
        cache.ensure_blocks(17)
        return cache

    def grow(cache):
        cache.ensure_blocks(MAX_BLOCKS)

    counts = _calls_of_a_step(driver, make, grow)
    for op, total in counts.items():
        for k in range(1, total + 1):
            cache = make()
            maps = driver.outstanding().mappings
            error, raised = FAULTS[fault]
            driver.fail(op, k, error(op))
            with pytest.raises(raised):
                grow(cache)
            where = f"failed {op} #{k} of {total}"
            sizes = {b.name: cache.tensor(b.name).bytes_per_segment for b in cache.buffers}
            expect_equal(
                driver,
                f"KV block count and per-buffer sizes after a {where}",
                (17, dict.fromkeys(sizes, 17 * layouts.PAGE // 2)),
                (cache.num_blocks, sizes),
            )
            held = driver.outstanding()
            expect_equal(driver, f"mappings and handles after a {where}", (maps, 0), (held.mappings, held.handles))
            grow(cache)
            expect_equal(driver, f"KV block count after retrying a {where}", MAX_BLOCKS, cache.num_blocks)
            cache.close()


def test_a_rollback_that_fails_too_is_reported_and_close_returns_what_it_kept(driver):
    t = odd_tensor(driver, num_segments=2, granules_per_segment=3.5)
    t.resize_per_segment_(1024)
    before = len(driver.calls)
    driver.fail("zero", 1)  # the step fails after every map ...
    driver.fail("unmap", 1)  # ... and the rollback's first unmap fails as well
    with pytest.raises(CommitError) as info:
        t.resize_per_segment_(t.segment_bytes)
    message = str(info.value)
    expect(
        "rollback also failed" in message and "unmap(" in message,
        driver,
        "CommitError when the rollback's unmap fails too",
        "names the failed rollback unmap",
        message,
    )
    ops = [c.op for c in driver.calls[before:]]
    first_unmap = ops.index("unmap") if "unmap" in ops else len(ops)
    expect(
        "synchronize" in ops[ops.index("zero") : first_unmap],
        driver,
        "driver calls between the failed zero and the rollback's first unmap",
        "a synchronize",
        ops,
    )
    kept = t.stats().mappings
    expect(
        kept == len(driver.outstanding().mappings) and kept > 1,
        driver,
        "mappings on the tensor's record after the failed rollback (the initial one and the one that would not unmap)",
        f"{len(driver.outstanding().mappings)} (> 1)",
        kept,
    )
    t.close()
    expect(
        not driver.outstanding(),
        driver,
        "driver state after close() of a tensor whose rollback failed",
        "nothing",
        driver.outstanding(),
    )


def test_a_handle_the_rollback_cannot_release_is_reported_and_close_releases_it(driver):
    t = odd_tensor(driver, num_segments=2, granules_per_segment=3.5)
    t.resize_per_segment_(1024)
    driver.fail("map", 1)  # the step fails at its first map, with a handle created ...
    driver.fail("release", 1)  # ... and the rollback cannot release that handle either
    with pytest.raises(CommitError) as info:
        t.resize_per_segment_(t.segment_bytes)
    message = str(info.value)
    expect(
        "rollback also failed" in message and "release:" in message,
        driver,
        "CommitError when the rollback's release fails too",
        "names the failed rollback release",
        message,
    )
    held = driver.outstanding().handles
    expect(held == 1, driver, "handles held after the failed rollback (the one it could not release)", 1, held)
    expect(t.bytes_per_segment == 1024, driver, "bytes_per_segment after the failed step", 1024, t.bytes_per_segment)
    t.close()
    expect(
        not driver.outstanding(),
        driver,
        "driver state after close() of a tensor whose rollback kept a handle",
        "nothing",
        driver.outstanding(),
    )


def test_failed_reservation_leaves_nothing_behind(driver):
    driver.fail("reserve", 1)
    with pytest.raises(DriverError):
        odd_tensor(driver)
    expect(not driver.outstanding(), driver, "driver state after a failed reserve", "nothing", driver.outstanding())


def _run_together(worker, args: list[int]) -> None:
    """Run ``worker(a)`` for every ``a`` on its own thread, all released at once by a barrier."""
    barrier = threading.Barrier(len(args))

    def released(a):
        barrier.wait()
        worker(a)

    threads = [threading.Thread(target=released, args=(a,)) for a in args]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def test_concurrent_growth_serializes_to_the_largest_size(driver):
    t = odd_tensor(driver, num_segments=2, granules_per_segment=4.5)
    sizes = [random.Random(i).randrange(256, t.segment_bytes, 256) for i in range(16)]
    errors = []

    def worker(n):
        try:
            t.resize_per_segment_(n)
        except Exception as exc:  # a smaller size after a larger one is a shrink: the only allowed error
            if "grow-only" not in str(exc):
                errors.append(exc)

    _run_together(worker, sizes)
    expect_equal(driver, "errors from concurrent resize_per_segment_", [], errors)
    expect_equal(driver, "size after concurrent growth", max(sizes), t.bytes_per_segment)
    states = granule_states(driver, t.base_address, t.max_num_bytes)
    expect_equal(driver, "accessible granules after concurrent growth", expected_granules(t), states)
    t.close()


def test_concurrent_ensure_blocks_serializes_to_the_largest_count(driver):
    cache = layouts.kv_cache(driver, "kv_first", buffers=2)
    counts = [random.Random(i).randrange(1, MAX_BLOCKS) for i in range(12)]
    _run_together(cache.ensure_blocks, counts)
    expect_equal(driver, "blocks after concurrent ensure_blocks", max(counts), cache.num_blocks)
    cache.close()


def test_lifecycle_under_garbage_collection_stress(driver):
    refs = []
    survivors = []
    for round_ in range(20):
        t = odd_tensor(driver, num_segments=1 + round_ % 3)
        t.resize_per_segment_(256 * (1 + round_ % 5))
        view = t.segment_view(round_ % t.num_segments)
        view.fill_(round_ % 251)
        refs.append(weakref.ref(t))
        if round_ % 4 == 0:
            survivors.append((round_, view))  # the view outlives every direct reference to its tensor
        del t, view
        gc.collect()
    for round_, view in survivors:
        expect(
            bool((view == round_ % 251).all()),
            driver,
            f"a surviving view of round {round_}",
            f"filled with {round_ % 251}",
            "changed",
        )
    del view
    alive = sum(r() is not None for r in refs)
    expect_equal(driver, "tensors alive under gc stress", len(survivors), alive)
    survivors.clear()
    gc.collect()
    expect(not driver.outstanding(), driver, "driver state after the last view died", "nothing", driver.outstanding())
