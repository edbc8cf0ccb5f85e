"""How many KV blocks to commit once warmup is over: measured memory instead of vLLM's estimates.

vLLM 0.26.0 sizes the KV cache before CUDA graphs are captured, from ``requested - (weights + profiled activation
peak + non-torch memory) - estimated graph memory``. The extensible path reserves that amount *without* the graph
estimate (an upper bound), warms up and captures graphs with a small committed prefix, then measures what
everything other than the KV cache really uses and commits the rest:

    non_kv   = init_free - free_now - kv_backed          (weights, graph pools, activations, workspaces, NCCL, ...)
    growth   = max(0, weights + profiled_peak - torch_reserved_now)   (activation memory torch may still take)
    budget   = requested - non_kv - growth - margin
    blocks   = (budget - granule rounding bound) // bytes_per_block, clamped to [committed, capacity]

All quantities are bytes and come from the worker (``MemoryState``), so the arithmetic is testable without a GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class MemoryState:
    """What a worker measured; every field in bytes (blocks where named)."""

    init_free: int  # free device memory when the worker started
    requested: int  # gpu_memory_utilization x total: this instance's budget
    free_now: int  # free device memory after warmup and graph capture
    kv_backed: int  # KV bytes physically mapped now
    weights: int  # model weights (torch-allocated)
    profiled_peak: int  # vLLM's profiled activation peak
    torch_reserved_now: int  # torch caching allocator reserved bytes now (weights + cached activations)
    bytes_per_block: int  # one block in every KV buffer, summed
    rounding_bound: int  # most bytes granule rounding can add (granularity x segments, summed over buffers)
    capacity_blocks: int  # blocks reserved (the upper bound)
    committed_blocks: int  # blocks committed now (grow-only: the result is never below this)
    margin: int = 0  # extra bytes kept free on purpose

    @property
    def non_kv(self) -> int:
        return self.init_free - self.free_now - self.kv_backed

    @property
    def torch_growth(self) -> int:
        return max(0, self.weights + self.profiled_peak - self.torch_reserved_now)

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
