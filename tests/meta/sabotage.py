"""Pytest plugins that break the reference ExtensibleTensor in one way each, to prove the tensor rules can fail.

Use one with ``-p tests.meta.sabotage_<name>``-style loading: ``-p tests.meta.sabotage`` plus the
environment variable ``EXTENSIBLE_KV_SABOTAGE=<name>``. Each entry of ``SABOTAGE`` says which promise it breaks.
"""

from __future__ import annotations

import os

from extensible_kv import granules, kv_cache, layout, tensor


def _per_granule(seg, n, old, new, g):
    """One handle per granule instead of one per contiguous run."""
    return [(k, k + 1) for lo, hi in _ORIGINAL_RUNS(seg, n, old, new, g) for k in range(lo, hi)]


def _no_dedup(seg, n, old, new, g):
    """Each segment maps its own granules, so a granule straddling a boundary is mapped twice."""
    runs = []
    for i in range(n):
        lo = -(-(i * seg + old) // g) if old else (i * seg) // g
        hi = -(-(i * seg + new) // g)
        if hi > lo:
            runs.append((lo, hi))
    return runs


def _wide_views(self, index, dtype=None):
    """segment_view covers the whole segment capacity, not the committed bytes."""
    import torch

    return self._view(index * self.segment_bytes, self.segment_bytes, dtype or torch.uint8)


def _skip_rollback(self, mapped, pending):
    """A failed growth step leaves what it mapped in place."""
    return []


def _leaky_teardown(memory):
    """close() unmaps but never frees the reservation."""
    memory.driver.synchronize()
    while memory.mappings:
        memory.driver.unmap(*memory.mappings.pop())


def _single_segment(layers, page_size_bytes, num_blocks):
    """KV buffers ignore their layout: one segment, as if every backend were block-major."""
    return layout.Segments(1, page_size_bytes * num_blocks)


def _no_retract(self, mark):
    """A failed multi-buffer step leaves the buffers grown before the failure as they are."""


_ORIGINAL_RUNS = granules.new_granule_runs
SABOTAGE = {
    "per_granule": (granules, "new_granule_runs", _per_granule),
    "no_dedup": (granules, "new_granule_runs", _no_dedup),
    "wide_views": (tensor.ExtensibleTensor, "segment_view", _wide_views),
    "skip_rollback": (tensor.ExtensibleTensor, "_rollback", _skip_rollback),
    "leaky_teardown": (tensor, "_teardown", _leaky_teardown),
    "single_segment": (kv_cache, "buffer_segments", _single_segment),
    "no_retract": (tensor.ExtensibleTensor, "rollback_to", _no_retract),
}


def pytest_configure(config):
    name = os.environ.get("EXTENSIBLE_KV_SABOTAGE")
    if name:
        owner, attr, replacement = SABOTAGE[name]
        setattr(owner, attr, replacement)
