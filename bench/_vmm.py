"""Baseline commit paths and small helpers shared by the benchmarks (not part of the package).

The baselines talk to the driver protocol directly, so they measure what any VMM allocator pays for its choice of
handle size, not ExtensibleTensor's bookkeeping:

- ``RawCommit.per_granule``: one ``create`` + ``map`` + ``release`` and one ``set_access`` per granule: what an
  allocator that commits page by page (or a naive port of a per-block KV allocator) does. On an H200, 32 GiB is
  16384 handles and takes about a second: the slow end of the comparison.
- ``RawCommit.single_handle``: one handle and one ``set_access`` for the whole range (split only where the driver
  caps handle size): the fewest driver calls a commit can make, i.e. the limit ExtensibleTensor is measured against.

Handle counts: ExtensibleTensor growths are counted by running the same growth once more through a ``Ledger``
(``count_growth``), outside the timed rounds, so the timed rounds pay no bookkeeping. The raw baselines count their
own ``create`` calls (exact by construction): a Ledger checks every new mapping against every live one, which is
quadratic in the number of mappings and would take minutes for 16384 per-granule handles.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from extensible_kv import ExtensibleTensor, Ledger
from extensible_kv import granules as _granules
from extensible_kv.drivers.ledger import OPERATIONS
from extensible_kv.errors import BusyError


class RawCommit:
    """A reservation of ``nbytes`` and the mappings a baseline commit made in it; ``close()`` undoes both.

    The reservation is made in ``__init__`` (benchmark setup, untimed); ``per_granule()`` or ``single_handle()`` is
    the timed commit. ``creates`` and ``set_access_calls`` count the driver calls the commit made.
    """

    def __init__(self, driver, nbytes: int) -> None:
        g = driver.granularity()
        if nbytes <= 0 or nbytes % g:
            raise ValueError(f"RawCommit needs a positive multiple of the granularity {g}, got {nbytes}")
        self.driver = driver
        self.nbytes = nbytes
        self.granularity = g
        self.va = driver.reserve(nbytes, g)
        self.mappings: list[tuple[int, int]] = []
        self.creates = 0
        self.set_access_calls = 0
        self.closed = False

    def _map_one(self, va: int, size: int) -> None:
        driver = self.driver
        handle = driver.create(size)
        self.creates += 1
        try:
            driver.map(va, size, handle, 0)
        except BaseException:
            driver.release(handle)
            raise
        self.mappings.append((va, size))
        driver.release(handle)  # the mapping keeps the memory alive, as in ExtensibleTensor

    def per_granule(self) -> RawCommit:
        """Commit the range one granule at a time: a handle, a map and a set_access per granule."""
        self._check_empty()
        driver, g, va = self.driver, self.granularity, self.va
        for offset in range(0, self.nbytes, g):
            self._map_one(va + offset, g)
            driver.set_access(va + offset, g)
            self.set_access_calls += 1
        return self

    def single_handle(self) -> RawCommit:
        """Commit the range with one handle (chunked only at ``max_handle_bytes``) and one set_access."""
        self._check_empty()
        g, n = self.granularity, self.nbytes
        cap = self.driver.max_handle_bytes
        step = n if not cap else max(cap // g, 1) * g
        for offset in range(0, n, step):
            self._map_one(self.va + offset, min(step, n - offset))
        self.driver.set_access(self.va, n)
        self.set_access_calls += 1
        return self

    def close(self) -> None:
        if self.closed:
            return
        self.driver.synchronize()
        while self.mappings:
            va, size = self.mappings[-1]
            self.driver.unmap(va, size)
            self.mappings.pop()
        self.driver.free(self.va, self.nbytes)
        self.closed = True

    def _check_empty(self) -> None:
        if self.mappings or self.closed:
            raise RuntimeError("RawCommit commits once, into a fresh reservation")


class KVCache:
    """A KV cache's memory: ``buffers`` ExtensibleTensors (one per layer), each of ``segments`` equal segments
    (``2``: the K and V halves), every segment ``segment_bytes`` long, all grown together."""

    def __init__(self, driver, buffers: int, segments: int, segment_bytes: int, block_bytes: int) -> None:
        self.tensors: list[ExtensibleTensor] = []
        try:
            for _ in range(buffers):
                self.tensors.append(
                    ExtensibleTensor(segment_bytes * segments, segments, driver=driver, alignment=block_bytes)
                )
        except BaseException:
            self.close()
            raise

    def resize_per_segment_(self, nbytes: int, zero_new: bool = False) -> KVCache:
        for t in self.tensors:
            t.resize_per_segment_(nbytes, zero_new=zero_new)
        return self

    def close(self) -> None:
        while self.tensors:
            close_quietly(self.tensors[-1])
            self.tensors.pop()


def close_quietly(obj) -> None:
    """Close ``obj``; an ExtensibleTensor whose views outlive a failed test is force-closed (nothing uses them)."""
    try:
        obj.close()
    except BusyError:
        gc.collect()
        obj.driver.synchronize()
        obj.close(force=True)


@dataclass(frozen=True)
class Plan:
    """What a growth must do by the granule arithmetic: its runs of new granules and the handles they need."""

    runs: int
    handles: int
    new_ranges: int
    granules: int


def plan_growth(driver, segment_bytes: int, segments: int, old: int, new: int) -> Plan:
    """The driver calls a correct ExtensibleTensor makes to grow every segment from ``old`` to ``new`` bytes."""
    g = driver.granularity()
    runs = _granules.new_granule_runs(segment_bytes, segments, old, new, g)
    cap = driver.max_handle_bytes
    max_granules = max(cap // g, 1) if cap else None
    handles = sum(len(_granules.chunks(lo, hi, max_granules)) for lo, hi in runs)
    ranges = _granules.new_ranges(segment_bytes, segments, old, new)
    return Plan(runs=len(runs), handles=handles, new_ranges=len(ranges), granules=sum(hi - lo for lo, hi in runs))


def count_growth(driver, build: Callable, grow: Callable) -> dict[str, int]:
    """Driver calls of each operation made by ``grow(state)`` where ``state = build(ledger)``, counted through a
    ``Ledger`` (every one of its ``OPERATIONS``, 0 for those not called).

    ``build`` makes the objects (with the ledger as their driver) and does any untimed preparation; only the calls
    ``grow`` makes are counted. Everything is closed afterwards and the ledger must be empty: a leak fails here.
    """
    ledger = Ledger(driver)
    state = build(ledger)
    try:
        start = len(ledger.calls)
        grow(state)
        counts = {op: ledger.count(op, since=start) for op in OPERATIONS}
    finally:
        state.close()
    left = ledger.outstanding()
    if left:
        raise AssertionError(
            f"counting pass leaked: {len(left.reservations)} reservation(s), {left.handles} "
            f"handle(s), {len(left.mappings)} mapping(s)"
        )
    return counts


def touch(driver, va: int, nbytes: int) -> None:
    """Prove ``[va, va+nbytes)`` is usable: the driver says its ends are accessible, and bytes written there read
    back. Asking the driver first keeps a broken commit from faulting the device (which would end the run)."""
    g = driver.granularity()
    for where in {va, va + (nbytes - 1) // g * g}:
        if not driver.accessible(where):
            raise AssertionError(f"{driver.name}: granule at {where:#x} of a committed range is not accessible")
    view = driver.tensor(va, nbytes, None)
    view[0] = 0x5A
    view[nbytes - 1] = 0xC3
    got = (int(view[0]), int(view[nbytes - 1]))
    del view
    driver.synchronize()
    if got != (0x5A, 0xC3):
        raise AssertionError(f"{driver.name}: wrote (0x5a, 0xc3) at the ends of a committed range, read {got}")


def touch_tensor(t: ExtensibleTensor) -> None:
    """``touch`` the committed prefix of every segment of ``t``."""
    stats = t.stats()
    for i in range(t.num_segments):
        touch(t.driver, t.base_address + i * t.segment_bytes, stats.bytes_per_segment)


def all_zero(view: torch.Tensor, chunk: int = 1 << 30) -> bool:
    """Whether every byte of the 1-D uint8 ``view`` is zero, checked in chunks (no full-size temporaries)."""
    flat = view.view(torch.uint8)
    for lo in range(0, flat.numel(), chunk):
        if int(flat[lo : lo + chunk].amax()) != 0:
            return False
    return True


def record_rate(benchmark, nbytes: int, median: float | None = None) -> None:
    """Add ``nbytes / median`` in GB/s (decimal) to ``extra_info['gbps_median']`` when a median exists: ``median``
    where the benchmark measured its own, else the median of pytest-benchmark's rounds (none with benchmarks off)."""
    if median is None:
        stats = getattr(getattr(benchmark, "stats", None), "stats", None)
        median = getattr(stats, "median", None) if stats is not None else None
    if median:
        benchmark.extra_info["gbps_median"] = nbytes / median / 1e9
