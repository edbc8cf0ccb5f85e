"""A pytest plugin that breaks the shrink of the reference ExtensibleTensor or KV buffers in one way each, to prove
the shrink rules (``conformance/test_shrink.py``) can fail: ``-p tests.meta.sabotage_shrink`` with the environment
variable ``EXTENSIBLE_KV_SHRINK_SABOTAGE=<name>``. Each entry of ``SABOTAGE`` says which promise it breaks."""

from __future__ import annotations

import os

from extensible_kv import granules, kv_cache, tensor
from extensible_kv.errors import InvalidSizeError

_Tensor = tensor.ExtensibleTensor
_ORIGINAL_GROW = _Tensor._grow


def _forgets_to_release(self, new):
    """The shrink sets the size and unmaps nothing: every granule stays mapped."""
    return [], []


def _one_granule_too_many(self, new):
    """The shrink also releases the last granule that holds kept bytes."""
    g, base = self._granularity, self._memory.base
    kept = granules.backed_granules(self._segment_bytes, self._num_segments, new, g)
    if kept:
        kept[-1] = (kept[-1][0], kept[-1][1] - 1)
        kept = [run for run in kept if run[0] < run[1]]
    drops, splits = [], []
    for va, size in self._memory.mappings:
        run = [((va - base) // g, (va - base + size) // g)]
        parts = granules.intersect(run, kept)
        if not parts:
            drops.append((va, size))
        elif parts != run:
            splits.append((va, size, parts))
    return drops, splits


def _lazy_shrink(self, old, new):
    """The shrink keeps the granules mapped as a cache, and growth back over them reuses them unzeroed."""
    self._per_segment, self._lineage, self._lazy = new, [next(tensor._SERIALS)], max(old, getattr(self, "_lazy", 0))
    return self


def _lazy_grow(self, old, new, zero_new):
    lazy = getattr(self, "_lazy", 0)
    if new <= lazy:
        self._per_segment, self._lineage = new, [*self._lineage, next(tensor._SERIALS)]
        return self
    self._lazy = 0
    return _ORIGINAL_GROW(self, max(old, lazy), new, zero_new)


_ORIGINAL_SHRINK = _Tensor._shrink


def _marking_shrink(self, old, new):
    self._shrunk = True
    return _ORIGINAL_SHRINK(self, old, new)


def _unzeroed_grow(self, old, new, zero_new):
    """Growth after a shrink does not zero what it maps, over memory that still holds bytes (as a driver's recycled
    pages do: 0xAA here)."""
    out = _ORIGINAL_GROW(self, old, new, zero_new and not getattr(self, "_shrunk", False))
    if getattr(self, "_shrunk", False):
        for lo, hi in granules.new_ranges(self._segment_bytes, self._num_segments, old, new):
            self._driver.tensor(self._memory.base + lo, hi - lo, None).fill_(0xAA)
    return out


def _keeps_lineage(self, old, new):
    """The shrink is one more step of the lineage, so a checkpoint taken before it can still be rolled back to."""
    lineage = self._lineage
    out = _ORIGINAL_SHRINK(self, old, new)
    self._lineage = [*lineage, next(tensor._SERIALS)]
    return out


def _unguarded(self, nbytes):
    """The shrink skips the views and pins that reach past the new size."""
    self._check_open("shrink_per_segment_")
    old = self._per_segment
    if nbytes < 0 or nbytes > old or nbytes % self._alignment:
        raise InvalidSizeError(f"shrink_per_segment_({nbytes}) from {old}")
    return self._shrink(old, nbytes) if nbytes < old else self


def _no_abort(self):
    """A shrink that fails or is interrupted leaves its new handles and the intent as they are."""
    return []


def _no_regrow(self, b, t, num_blocks):
    """A failed shrink_blocks leaves the buffers shrunk before the failure at the new count."""


SABOTAGE = {
    "forgets_to_release": [(_Tensor, "_shrink_plan", _forgets_to_release)],
    "one_granule_too_many": [(_Tensor, "_shrink_plan", _one_granule_too_many)],
    "lazy_unzeroed_regrow": [(_Tensor, "_shrink", _lazy_shrink), (_Tensor, "_grow", _lazy_grow)],
    "unzeroed_regrow": [(_Tensor, "_shrink", _marking_shrink), (_Tensor, "_grow", _unzeroed_grow)],
    "keeps_lineage": [(_Tensor, "_shrink", _keeps_lineage)],
    "unguarded": [(_Tensor, "_shrink_checked", _unguarded)],
    "no_abort": [(_Tensor, "_shrink_abort", _no_abort)],
    "kv_no_regrow": [(kv_cache.ExtensibleKVCacheBuffers, "_regrow", _no_regrow)],
}


def pytest_configure(config):
    name = os.environ.get("EXTENSIBLE_KV_SHRINK_SABOTAGE")
    if name:
        for owner, attr, replacement in SABOTAGE[name]:
            setattr(owner, attr, replacement)
