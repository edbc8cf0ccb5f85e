"""Synthetic KV cache layouts used by the rules (no vLLM needed), and a layout-independent oracle of the bytes a
block prefix occupies."""

from __future__ import annotations

import dataclasses
import math

import torch

from extensible_kv.granules import merge  # noqa: F401 - re-exported for the rules
from extensible_kv.kv_cache import ExtensibleKVCacheBuffers, KVBuffer
from extensible_kv.layout import AttentionLayer, MambaLayer, footprint  # noqa: F401 - re-exported for the rules

HEADS, BLOCK, HEAD = 2, 16, 64
DTYPE = torch.bfloat16
PAGE = 2 * HEADS * BLOCK * HEAD * 2  # bytes of one block of K and V: 8 KiB
MAX_BLOCKS = 600  # 600 pages of 8 KiB: several 2 MiB granules per segment


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


def kv_cache(driver, layout: str, buffers: int = 2, **kwargs) -> ExtensibleKVCacheBuffers:
    """``buffers`` KV buffers of ``MAX_BLOCKS`` pages, each with the layers of ``LAYOUTS[layout]`` (named
    ``b<i>.<layer>``), on ``driver``; ``kwargs`` go to ``ExtensibleKVCacheBuffers``."""
    make, _ = LAYOUTS[layout]
    specs = []
    for i in range(buffers):
        layers = tuple(dataclasses.replace(layer, name=f"b{i}.{layer.name}") for layer in make())
        specs.append(KVBuffer(f"b{i}", PAGE, layers))
    return ExtensibleKVCacheBuffers(specs, MAX_BLOCKS, driver=driver, **kwargs)


def kv_cache_blocks(driver, max_num_blocks: int) -> ExtensibleKVCacheBuffers:
    """One ``flash_nhd`` buffer of ``max_num_blocks`` pages on ``driver``."""
    return ExtensibleKVCacheBuffers([KVBuffer("b0", PAGE, (flash_nhd("b0.l0"),))], max_num_blocks, driver=driver)


def granules_of(ranges: list[tuple[int, int]], granularity: int) -> set[int]:
    return {k for lo, hi in ranges for k in range(lo // granularity, math.ceil(hi / granularity))}
