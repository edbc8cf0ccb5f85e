"""How many KV blocks to commit once warmup is over: measured memory instead of vLLM's estimates.

vLLM 0.26.0 sizes the KV cache before CUDA graphs are captured, from ``requested - (weights + profiled activation
peak + non-torch memory) - estimated graph memory``. The extensible path reserves that amount *without* the graph
estimate (an upper bound), warms up and captures graphs with a small committed prefix, then measures what
everything other than the KV cache really uses and commits the rest:

    non_kv   = init_free - free_now - kv_backed          (weights, graph pools, activations, workspaces, NCCL, ...)
    peak     = max(profiled_peak, profiled_peak_reserved)   (Note [Reserved, not allocated, at the activation peak])
    growth   = max(0, peak - torch_reusable_now)            (activation memory torch may still take)
    budget   = requested - non_kv - growth - margin
    blocks   = (budget - granule rounding bound) // bytes_per_block, clamped to [committed, capacity]

All quantities are bytes and come from the worker (``MemoryState``), so the arithmetic is testable without a GPU.

Note [Graph pools are not activation cache]
    The activation peak that vLLM profiled comes back whenever a batch as large as the profiling one runs; torch
    serves it first from blocks its default pool holds unused, and takes new device memory for the rest. Only those
    unused default-pool blocks may be credited against the peak. CUDA graph private pools (vLLM captures into one
    shared pool) and live tensors (persistent input buffers, workspaces) are reserved too, but cannot serve eager
    activations. Crediting all of ``memory_reserved() - weights`` counted the graph pool twice (once in ``non_kv``,
    once as reusable cache): on an 8B Llama shape on the H200 (graph pools 186 MiB on V1, 230 MiB on V2) that
    committed about that many bytes too many. ``reusable_cache`` reads the default pool from torch's segment snapshot.

Note [Reserved, not allocated, at the activation peak]
    vLLM profiles the activation peak as torch's *allocated* bytes (``allocated_bytes.all.peak``). What the batch
    takes from the device is *reserved* bytes: the caching allocator rounds each block up and carves blocks out of
    whole segments (2 MiB for small blocks, 20 MiB for blocks under 10 MiB, the 2 MiB-rounded request above), so the
    reserved peak of the same run is larger. The patch records both around vLLM's own ``profile_run``
    (``patches.profile_run_reserved_peak``) and the growth still to come is taken from the larger one. Measured: the
    run's ``extensible.profile`` holds ``peak_allocated`` and ``peak_reserved``; ``memory.peak`` of a case holds what
    the peak-shaped batch really took after the final commit (``integration/parity.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

DEFAULT_POOL = (0, 0)  # torch's segment_pool_id of the caching allocator's default pool


def reusable_cache(segments: Iterable[Mapping], device: int) -> int:
    """Bytes of ``device``'s default pool that torch holds reserved but unused (``torch.cuda.memory_snapshot()``
    segments): the part of torch's cache a new activation peak can reuse. Note [Graph pools are not activation
    cache]."""
    return sum(int(s["total_size"]) - int(s["active_size"]) for s in segments
               if int(s["device"]) == device and tuple(s["segment_pool_id"]) == DEFAULT_POOL)


def activation_to_come(profiled_peak: int, reusable: int) -> int:
    """Bytes the next batch as large as the profiling one takes beyond torch's reusable cache (Note [Graph pools
    are not activation cache])."""
    return max(0, profiled_peak - reusable)


@dataclass(frozen=True)
class MemoryState:
    """What a worker measured; every field in bytes (blocks where named)."""

    init_free: int  # free device memory when the worker started
    requested: int  # gpu_memory_utilization x total: this instance's budget
    free_now: int  # free device memory after warmup and graph capture
    kv_backed: int  # KV bytes physically mapped now
    weights: int  # model weights (torch-allocated)
    profiled_peak: int  # vLLM's profiled activation peak
    torch_reusable_now: int  # bytes torch's default pool holds unused now (``reusable_cache``)
    bytes_per_block: int  # one block in every KV buffer, summed
    rounding_bound: int  # most bytes granule rounding can add (granularity x segments, summed over buffers)
    capacity_blocks: int  # blocks reserved (the upper bound)
    committed_blocks: int  # blocks committed now (grow-only: the result is never below this)
    margin: int = 0  # extra bytes kept free on purpose
    profiled_peak_reserved: int = 0  # what torch reserved for that peak (0: not recorded)

    @property
    def non_kv(self) -> int:
        return self.init_free - self.free_now - self.kv_backed

    @property
    def torch_growth(self) -> int:
        """Note [Graph pools are not activation cache], Note [Reserved, not allocated, at the activation peak]."""
        return activation_to_come(max(self.profiled_peak, self.profiled_peak_reserved), self.torch_reusable_now)

    @property
    def budget(self) -> int:
        return self.requested - self.non_kv - self.torch_growth - self.margin

    def blocks(self) -> int:
        """Blocks to commit: what fits the budget, never below the committed count, never above capacity."""
        fit = max(0, self.budget - self.rounding_bound) // self.bytes_per_block
        return max(self.committed_blocks, min(self.capacity_blocks, fit))

    def to_dict(self) -> dict:
        return {**asdict(self), "non_kv": self.non_kv, "torch_growth": self.torch_growth, "budget": self.budget,
                "blocks": self.blocks()}
