"""Hostile-use rules: an interrupted close, races between views, growth and close, copies, absurd sizes, and use
after close (an interrupt at every call of a growth step is swept in ``test_reliability``). Whatever the caller does,
the tensor and the KV buffers end in a state they can explain: the
old size or the new one, never a mapping off the record, a view over freed memory or a second owner."""

from __future__ import annotations

import copy
import pickle
import sys
import threading

import pytest

from extensible_kv import ExtensibleTensor
from extensible_kv.errors import BusyError, ClosedError, FailedStateError, InvalidSizeError

from . import layouts
from .helpers import expect, expect_equal, odd_tensor
from .layouts import MAX_BLOCKS
from .tensors import new_tensor

RACES = 30


class Interrupt(KeyboardInterrupt):
    """A KeyboardInterrupt that a test raised on purpose (so a real Ctrl-C is never mistaken for it)."""


@pytest.mark.parametrize("op", ["unmap", "free", "synchronize"])
def test_an_interrupted_close_can_be_retried_and_returns_everything(driver, op):
    t = odd_tensor(driver)
    t.resize_per_segment_(t.segment_bytes)
    driver.fail(op, 1, Interrupt())
    with pytest.raises(Interrupt):
        t.close()
    expect_equal(driver, f"closed after an interrupt at {op} during close()", False, t.closed)
    t.close()
    expect(
        t.closed and not driver.outstanding(),
        driver,
        f"close() retried after an interrupt at {op}",
        "closed, nothing outstanding",
        (t.closed, driver.outstanding()),
    )


@pytest.mark.parametrize("view", ["segment_view", "full_view"])
def test_a_view_is_never_handed_out_over_a_closed_tensor(driver, view):
    """Many short races of one view against one close(), with the interpreter switching threads as often as it
    can: a view made after close() has checked for live views would point at freed memory."""
    g = driver.granularity()
    handed_over_freed = 0
    interval = sys.getswitchinterval()
    for _ in range(RACES):
        t = ExtensibleTensor(2 * g, driver=driver)
        t.resize_per_segment_(g)
        got = {}

        def make_view(t=t, got=got):
            try:
                got["view"] = t.segment_view(0) if view == "segment_view" else t.full_view()
            except ClosedError:
                pass

        def close(t=t, got=got):
            try:
                t.close()
                got["closed"] = True
            except BusyError:
                pass

        threads = [threading.Thread(target=make_view), threading.Thread(target=close)]
        sys.setswitchinterval(1e-6)
        try:
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        finally:
            sys.setswitchinterval(interval)
        handed_over_freed += "view" in got and "closed" in got
        got.clear()
        t.close(force=True)
    expect_equal(
        driver, f"views handed out over a closed tensor in {view} racing close() {RACES} times", 0, handed_over_freed
    )


def test_growth_racing_close_ends_closed_with_nothing_outstanding(driver):
    cache = layouts.kv_cache(driver, "kv_first", buffers=2)
    unexpected = []
    barrier = threading.Barrier(5)

    def grow(n):
        barrier.wait()
        try:
            for k in range(n, MAX_BLOCKS, 97):
                cache.ensure_blocks(k)
        except ClosedError:
            return
        except BaseException as exc:
            unexpected.append(exc)

    def close():
        barrier.wait()
        cache.close()

    threads = [threading.Thread(target=grow, args=(n,)) for n in (1, 5, 9, 13)]
    threads.append(threading.Thread(target=close))
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    expect_equal(driver, "errors other than ClosedError from ensure_blocks racing close()", [], unexpected)
    with pytest.raises(ClosedError):
        cache.ensure_blocks(1)
    expect(not driver.outstanding(), driver, "driver state after growth raced close()", "nothing", driver.outstanding())


def _kv_after_close_calls(cache):
    name = cache.buffers[0].name
    layer = cache.buffers[0].layers[0].name
    return {
        "ensure_blocks(committed)": lambda: cache.ensure_blocks(cache.num_blocks),
        "ensure_blocks(0)": lambda: cache.ensure_blocks(0),
        "ensure_blocks(more)": lambda: cache.ensure_blocks(cache.num_blocks + 1),
        "layer_views": lambda: cache.layer_views(layer),
        "committed_layer_views": lambda: cache.committed_layer_views(layer),
        "raw": lambda: cache.raw(name),
        "tensor": lambda: cache.tensor(name),
        "stats": cache.stats,
    }


def test_kv_buffers_refuse_every_use_after_close(driver):
    cache = layouts.kv_cache(driver, "flash_nhd", buffers=2)
    cache.ensure_blocks(3)
    calls = _kv_after_close_calls(cache)
    cache.close()
    for what, call in calls.items():
        try:
            call()
            outcome = "returned"
        except ClosedError:
            outcome = "ClosedError"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        expect_equal(driver, f"KV buffers {what} after close()", "ClosedError", outcome)


def test_kv_growth_is_all_or_nothing_when_a_buffer_was_closed_underneath(driver):
    cache = layouts.kv_cache(driver, "kv_first", buffers=3)
    cache.ensure_blocks(5)
    last = cache.tensor(cache.buffers[-1].name)
    last.close(force=True)
    with pytest.raises(FailedStateError):  # a buffer closed underneath: nothing to resume, close() returns the rest
        cache.ensure_blocks(50)
    sizes = [cache.tensor(b.name).bytes_per_segment for b in cache.buffers[:-1]]
    expect_equal(
        driver,
        "open buffers' sizes and the set's state after ensure_blocks was refused for a closed buffer",
        ([5 * layouts.PAGE // 2] * 2, "failed"),
        (sizes, cache.state),
    )
    cache.close()


COPIES = {"copy.copy": copy.copy, "copy.deepcopy": copy.deepcopy, "pickle.dumps": pickle.dumps}


@pytest.mark.parametrize("how", COPIES.values(), ids=COPIES.keys())
def test_tensors_and_kv_buffers_refuse_to_be_copied(driver, how):
    t = odd_tensor(driver)
    cache = layouts.kv_cache(driver, "flash_nhd", buffers=1)
    for obj in (t, cache):
        try:
            how(obj)
            outcome = "a copy"
        except TypeError as exc:
            outcome = "TypeError" if "cannot be copied" in str(exc) else f"TypeError: {exc}"
        expect_equal(driver, f"{how.__module__}.{how.__name__} of {type(obj).__name__}", "TypeError", outcome)
    t.close()
    cache.close()


HUGE = {
    "2**64 + 4096": lambda d: new_tensor(2**64 + 4096, driver=d),
    "2**63": lambda d: new_tensor(2**63, driver=d),
    "2**63 - 1, rounded up": lambda d: new_tensor(2**63 - 1, driver=d),
    "2**70 in 2 segments": lambda d: new_tensor(2**70, 2, driver=d),
    "KV max_num_blocks=2**51": lambda d: layouts.kv_cache_blocks(d, 2**51),
}


@pytest.mark.parametrize("make", HUGE.values(), ids=HUGE.keys())
def test_sizes_past_the_address_space_are_refused_before_any_driver_call(driver, make):
    before = len(driver.calls)
    with pytest.raises(InvalidSizeError, match="64-bit address space"):
        make(driver)
    made = [c.op for c in driver.calls[before:]]
    expect_equal(driver, "driver calls for a size past the address space", [], made)
    expect(
        not driver.outstanding(),
        driver,
        "driver state after a size past the address space",
        "nothing",
        driver.outstanding(),
    )
