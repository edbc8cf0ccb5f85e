"""The stateful rule: any sequence of hostile uses of tensors and KV buffers that share one driver keeps the data,
zeroes new bytes, keeps base addresses, leaks nothing and never hangs.

Hypothesis drives a ``RuleBasedStateMachine`` (grow, write, read, close, copy attempts, cyclic owners dropped and
collected, collections forced inside driver calls, and an exception, ``KeyboardInterrupt`` and ``SystemExit``
included, injected at any driver call of a growth step or a close). ``EXTENSIBLE_KV_STATEFUL_EXAMPLES`` sets the
number of examples (``nox -s stress`` runs 10,000); by default it is twelve times the profile's ``max_examples``.
An example that hangs is killed after ``HANG_S`` seconds with every thread's traceback (under pytest-xdist the worker
restarts and
the test fails).
"""

from __future__ import annotations

import copy
import faulthandler
import gc
import os
from contextlib import contextmanager

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule, run_state_machine_as_test

from extensible_kv import ExtensibleTensor
from extensible_kv.drivers import protocol_methods
from extensible_kv.drivers.ledger import OPERATIONS
from extensible_kv.errors import ClosedError, CommitError, DriverError

from . import layouts
from .helpers import expect, expect_bytes, expect_equal, expected_granules, granule_states, pattern
from .layouts import MAX_BLOCKS

HANG_S = 60
EXAMPLES_ENV = "EXTENSIBLE_KV_STATEFUL_EXAMPLES"
# The calls a growth step makes: every recorded operation but those that build a tensor (reserve) or close one (unmap,
# free); a growth step calls unmap only to roll back, whose own failure has its rule in test_reliability.py.
FAULT_OPS = tuple(op for op in OPERATIONS if op not in protocol_methods("reserve", "unmap", "free"))
FAULTS = {
    "DriverError": lambda op: DriverError(op, "injected"),
    "KeyboardInterrupt": lambda op: KeyboardInterrupt(),
    "SystemExit": lambda op: SystemExit(3),
}


@contextmanager
def _injected(driver, op: str, nth: int, error: BaseException):
    """A fault armed for the calls of one step only: garbage is collected first and the collector is paused, so the
    fault cannot fire in an unrelated collected tensor's teardown instead of in the step."""
    gc.collect()
    gc.disable()
    driver.fail(op, nth, error)
    try:
        yield
    finally:
        driver.clear_faults()
        gc.enable()


class _Tracked:
    """A tensor and what its segments must hold (the model)."""

    def __init__(self, t: ExtensibleTensor) -> None:
        self.t = t
        self.base = t.base_address
        self.data = [torch.empty(0, dtype=torch.uint8) for _ in range(t.num_segments)]


class HostileUse(RuleBasedStateMachine):
    tensors = Bundle("tensors")
    caches = Bundle("caches")

    def __init__(self, driver) -> None:
        super().__init__()
        faulthandler.dump_traceback_later(HANG_S, exit=True)  # re-armed by every example
        # What earlier examples left (Hypothesis's own records grow with every example) is never this example's
        # garbage: freeze it, so the collections this example forces scan only what it made. Without this, 10,000
        # examples took quadratic time (each forced collection scanned every earlier example's records). The
        # previous example's machine is still alive here and is frozen with the rest: its teardown dropped what it
        # held (``made``), so only its skeleton stays until the test unfreezes.
        gc.collect()
        gc.freeze()
        self.driver = driver
        self.live: list[_Tracked] = []
        self.live_caches = []
        self.made: list[_Tracked] = []  # every tensor this example made, for teardown to drop

    # -- tensors -------------------------------------------------------------------------------------------------
    @rule(
        target=tensors,
        segments=st.integers(1, 3),
        quarter_granules=st.sampled_from([1, 2, 4, 5, 10]),
        alignment=st.sampled_from([1, 256, 4096]),
    )
    def new_tensor(self, segments, quarter_granules, alignment):
        seg = max(self.driver.granularity() * quarter_granules // 4 // alignment, 1) * alignment
        tracked = _Tracked(ExtensibleTensor(seg * segments, segments, driver=self.driver, alignment=alignment))
        self.live.append(tracked)
        self.made.append(tracked)
        return tracked

    def _target_size(self, tracked: _Tracked, frac: float) -> int:
        t = tracked.t
        units = t.segment_bytes // t._alignment
        return max(int(units * frac), 1) * t._alignment

    @rule(tracked=tensors, frac=st.floats(0, 1))
    def grow(self, tracked, frac):
        if tracked.t.closed:
            return
        new = max(self._target_size(tracked, frac), tracked.t.bytes_per_segment)
        tracked.t.resize_per_segment_(new)
        self._grown(tracked, new)

    def _grown(self, tracked: _Tracked, new: int) -> None:
        for i, d in enumerate(tracked.data):
            tracked.data[i] = torch.cat([d, torch.zeros(new - d.numel(), dtype=torch.uint8)])

    @rule(
        tracked=tensors,
        frac=st.floats(0, 1),
        op=st.sampled_from(FAULT_OPS),
        nth=st.integers(1, 4),
        fault=st.sampled_from(sorted(FAULTS)),
    )
    def grow_with_a_fault(self, tracked, frac, op, nth, fault):
        t = tracked.t
        if t.closed:
            return
        old, new = t.bytes_per_segment, max(self._target_size(tracked, frac), t.bytes_per_segment)
        with _injected(self.driver, op, nth, FAULTS[fault](op)):
            try:
                t.resize_per_segment_(new)
                raised = None
            except (CommitError, KeyboardInterrupt, SystemExit) as exc:
                raised = exc
        if raised is None:
            self._grown(tracked, new)
        else:
            expect_equal(self.driver, f"size after {fault} at {op} #{nth} of a growth step", old, t.bytes_per_segment)

    @rule(
        tracked=tensors, segment=st.integers(0, 2), seed=st.integers(0, 250), lo=st.floats(0, 1), span=st.floats(0, 1)
    )
    def write(self, tracked, segment, seed, lo, span):
        t = tracked.t
        if t.closed or t.bytes_per_segment == 0:
            return
        segment %= t.num_segments
        n = t.bytes_per_segment
        start = int(lo * (n - 1))
        length = max(int(span * (n - start)), 1)
        data = pattern(length, seed, t.device)
        t.segment_view(segment)[start : start + length].copy_(data)
        tracked.data[segment][start : start + length] = data.cpu()

    @rule(tracked=tensors)
    def read(self, tracked):
        t = tracked.t
        if t.closed:
            return
        expect_equal(self.driver, "base address", tracked.base, t.base_address)
        for i, d in enumerate(tracked.data):
            expect_bytes(self.driver, f"segment {i} of a tensor (as written, new bytes zero)", t.segment_view(i), d)
        states = granule_states(self.driver, t.base_address, t.max_num_bytes)
        expect_equal(self.driver, "accessible granules", expected_granules(t), states)

    @rule(tracked=tensors)
    def copy_attempt(self, tracked):
        for how in (copy.copy, copy.deepcopy):
            try:
                how(tracked.t)
                outcome = "a copy"
            except TypeError:
                outcome = "TypeError"
            expect_equal(self.driver, f"{how.__name__} of a tensor", "TypeError", outcome)

    @rule(tracked=tensors, op=st.sampled_from(("unmap", "free", "synchronize")), fault=st.sampled_from(sorted(FAULTS)))
    def close_with_a_fault(self, tracked, op, fault):
        t = tracked.t
        with _injected(self.driver, op, 1, FAULTS[fault](op)):
            try:
                t.close()
            except (DriverError, KeyboardInterrupt, SystemExit):
                pass
        t.close()
        self._closed(tracked)

    @rule(tracked=consumes(tensors))
    def close(self, tracked):
        tracked.t.close()
        self._closed(tracked)

    def _closed(self, tracked: _Tracked) -> None:
        try:
            tracked.t.segment_view(0)
            outcome = "a view"
        except ClosedError:
            outcome = "ClosedError"
        expect_equal(self.driver, "segment_view after close()", "ClosedError", outcome)
        if tracked in self.live:
            self.live.remove(tracked)

    @rule(tracked=consumes(tensors), keep_view=st.booleans())
    def drop_in_a_cycle(self, tracked, keep_view):
        """Only the cyclic collector can free the tensor now (or, with a view in the cycle, the view's death)."""
        owner = {"tensor": tracked.t}
        owner["self"] = owner
        if keep_view and not tracked.t.closed:
            owner["view"] = tracked.t.full_view()
        tracked.t = None  # Hypothesis keeps step arguments for its reports: they must not keep the tensor alive
        if tracked in self.live:
            self.live.remove(tracked)

    @rule(tracked=tensors, frac=st.floats(0, 1))
    def grow_while_collecting_at_every_allocation(self, tracked, frac):
        """Collections inside driver calls: a dead tensor's finalizer runs while this growth holds driver locks."""
        if tracked.t.closed:
            return
        thresholds = gc.get_threshold()
        gc.set_threshold(1, 1, 1)
        try:
            self.grow(tracked, frac)
        finally:
            gc.set_threshold(*thresholds)

    # -- KV buffers ----------------------------------------------------------------------------------------------
    @rule(target=caches, layout=st.sampled_from(["flash_nhd", "kv_first", "hybrid_flash_and_mamba"]))
    def new_cache(self, layout):
        cache = layouts.kv_cache(self.driver, layout, buffers=2)
        self.live_caches.append(cache)
        return cache

    @rule(cache=caches, blocks=st.integers(0, MAX_BLOCKS))
    def ensure_blocks(self, cache, blocks):
        if cache.closed:
            return
        before = cache.num_blocks
        got = cache.ensure_blocks(blocks)
        expect_equal(self.driver, f"ensure_blocks({blocks}) from {before}", max(before, blocks), got)

    @rule(
        cache=caches,
        blocks=st.integers(1, MAX_BLOCKS),
        op=st.sampled_from(FAULT_OPS),
        nth=st.integers(1, 6),
        fault=st.sampled_from(sorted(FAULTS)),
    )
    def ensure_blocks_with_a_fault(self, cache, blocks, op, nth, fault):
        if cache.closed:
            return
        before = [cache.tensor(b.name).bytes_per_segment for b in cache.buffers]
        old = cache.num_blocks
        with _injected(self.driver, op, nth, FAULTS[fault](op)):
            try:
                cache.ensure_blocks(blocks)
            except (CommitError, KeyboardInterrupt, SystemExit):
                after = [cache.tensor(b.name).bytes_per_segment for b in cache.buffers]
                expect_equal(
                    self.driver,
                    f"KV buffers after {fault} at {op} #{nth} of ensure_blocks({blocks})",
                    (old, before),
                    (cache.num_blocks, after),
                )

    @rule(cache=consumes(caches))
    def close_cache(self, cache):
        cache.close()
        if cache in self.live_caches:
            self.live_caches.remove(cache)

    # -- invariants ----------------------------------------------------------------------------------------------
    @invariant()
    def no_handle_is_held_between_steps(self):
        held = self.driver.outstanding().handles
        expect_equal(self.driver, "handles held between steps", 0, held)

    @rule()
    def collect_and_count_reservations(self):
        gc.collect()
        want = sorted(
            [t.t.stats().reserved_bytes for t in self.live]
            + [s.reserved_bytes for c in self.live_caches for s in c.stats().buffers]
        )
        got = sorted(self.driver.outstanding().reservations.values())
        expect_equal(self.driver, "reservations after a collection (live tensors and KV buffers only)", want, got)

    def teardown(self):
        for tracked in list(self.live):
            tracked.t.close(force=True)
        for cache in self.live_caches:
            cache.close()
        self.live.clear()
        self.live_caches.clear()
        for tracked in self.made:  # Hypothesis keeps step arguments: drop the tensors and their model bytes
            tracked.t, tracked.data = None, []
        self.made.clear()
        gc.collect()
        left = self.driver.outstanding()
        expect(
            not left,
            self.driver,
            "driver state after every tensor and KV buffer was closed or collected",
            "nothing",
            left,
        )
        if self.driver.device.type == "cpu":  # the kernel's truth: no memfd of the host driver is mapped
            with open("/proc/self/maps") as maps:
                mapped = [line for line in maps if "extensible-kv" in line]
            expect_equal(self.driver, "memfd mappings in /proc/self/maps at the end", [], mapped)


def test_any_sequence_of_hostile_uses_keeps_data_and_leaks_nothing(driver):
    examples = int(os.environ.get(EXAMPLES_ENV, 0)) or 12 * settings.default.max_examples
    gc.collect()
    gc.freeze()  # what exists now (torch's own objects) is never garbage here: collections scan only the machine's
    try:
        run_state_machine_as_test(
            lambda: HostileUse(driver),
            settings=settings(
                settings.default,
                max_examples=examples,
                stateful_step_count=15,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
    finally:
        faulthandler.cancel_dump_traceback_later()
        gc.unfreeze()
