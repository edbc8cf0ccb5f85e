"""Synthetic KV cache layouts used by the rules (no vLLM needed), and a layout-independent oracle of the bytes a
block prefix occupies."""

from __future__ import annotations

import math

import torch

from extensible_kv.layout import AttentionLayer, MambaLayer

HEADS, BLOCK, HEAD = 2, 16, 64
DTYPE = torch.bfloat16
PAGE = 2 * HEADS * BLOCK * HEAD * 2  # bytes of one block of K and V: 8 KiB


def flash_nhd(name: str) -> AttentionLayer:
    """Blocks-first ``(B, H, N, 2D)`` viewed NHD: block-major, 1 segment."""
    return AttentionLayer(name, lambda b: (b, HEADS, BLOCK, 2 * HEAD), (0, 2, 1, 3), DTYPE)


def kv_first(name: str, block_major: bool = False) -> AttentionLayer:
    """K/V-first ``(2, B, N, H, D)`` with identity order: 2 segments (1 when re-strided block-major)."""
    return AttentionLayer(name, lambda b: (2, b, BLOCK, HEADS, HEAD), (0, 1, 2, 3, 4), DTYPE, block_major)


def kv_first_block_major_order(name: str) -> AttentionLayer:
    """K/V-first logical shape, stride order ``(1, 0, 2, 3, 4)``: blocks physically outermost, 1 segment."""
    return AttentionLayer(name, lambda b: (2, b, BLOCK, HEADS, HEAD), (1, 0, 2, 3, 4), DTYPE)


def blocks_first_kv_outer_order(name: str) -> AttentionLayer:
    """Blocks-first logical ``(B, 2, N, H, D)`` with stride order ``(1, 0, 2, 3, 4)``: K/V physically outer, 2."""
    return AttentionLayer(name, lambda b: (b, 2, BLOCK, HEADS, HEAD), (1, 0, 2, 3, 4), DTYPE)


def mamba(name: str, padded: int | None = PAGE) -> MambaLayer:
    """Two Mamba states (conv bf16, ssm fp32) packed in a page padded to the attention page."""
    return MambaLayer(name, ((3, 128), (2, 16, 16)), (torch.bfloat16, torch.float32), padded)


LAYOUTS = {
    # name: (layers of one buffer, expected segments)
    "flash_nhd": (lambda: (flash_nhd("l0"),), 1),
    "kv_first": (lambda: (kv_first("l0"),), 2),
    "kv_first_block_major_order": (lambda: (kv_first_block_major_order("l0"),), 1),
    "blocks_first_kv_outer_order": (lambda: (blocks_first_kv_outer_order("l0"),), 2),
    "mamba": (lambda: (mamba("m0"),), 1),
    "hybrid_kv_first_and_mamba": (lambda: (kv_first("l0", block_major=True), mamba("m0")), 1),
    "hybrid_flash_and_mamba": (lambda: (flash_nhd("l0"), mamba("m0")), 1),
}


def footprint(view: torch.Tensor, block_dim: int, num_blocks: int) -> list[tuple[int, int]]:
    """Byte ranges (relative to the buffer start) that blocks ``[0, num_blocks)`` of ``view`` occupy, merged.

    Computed by replaying the view's shape, strides and offset over element indices, so it does not trust the
    segment arithmetic it checks.
    """
    item = view.element_size()
    span = view.storage_offset() + sum((s - 1) * st for s, st in zip(view.shape, view.stride())) + 1
    index = torch.as_strided(torch.arange(span, dtype=torch.int64), view.shape, view.stride(),
                             view.storage_offset()).narrow(block_dim, 0, num_blocks)
    elements = torch.unique(index.reshape(-1))
    if elements.numel() == 0:
        return []
    # Merge consecutive element indices into byte ranges.
    breaks = torch.nonzero(elements[1:] != elements[:-1] + 1).flatten().tolist()
    starts = [0, *[b + 1 for b in breaks]]
    ends = [*breaks, elements.numel() - 1]
    return [(int(elements[s]) * item, (int(elements[e]) + 1) * item) for s, e in zip(starts, ends)]


def merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def granules_of(ranges: list[tuple[int, int]], granularity: int) -> set[int]:
    return {k for lo, hi in ranges for k in range(lo // granularity, math.ceil(hi / granularity))}
