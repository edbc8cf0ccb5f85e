"""How many KV blocks to commit once warmup is over: measured memory instead of vLLM's estimates.

vLLM 0.26.0 sizes the KV cache before CUDA graphs are captured, from ``requested - (weights + profiled activation
peak + non-torch memory) - estimated graph memory``. The extensible path reserves that amount *without* the graph
estimate (an upper bound), warms up and captures graphs with a small committed prefix, then measures what
everything other than the KV cache really uses and commits the rest:

    (the profiled batch runs as served, then again as profiled: Note [The peak, brought back and measured])
    non_kv   = init_free - free_now - kv_backed          (weights, graph pools, activations, workspaces, NCCL, ...)
    growth   = max(0, again_reserved - again_retained,   (what either batch took from the device
                   served_reserved - served_retained)     and torch gave back)
    budget   = requested - non_kv - growth - margin
    blocks   = (budget - granule rounding bound) // bytes_per_block, clamped to [committed, capacity]

All quantities are bytes and come from the worker (``MemoryState``), so the arithmetic is testable without a GPU.

Note [The peak, brought back and measured]
    Rule: nothing about the activation peak is predicted. After warmup the worker runs the peak batch twice, first
    as served (attention on, eager, sampler: ``served_*``), then as vLLM profiled it (``again_*``); ``free_now`` is
    read after both, so the peak's segments are in ``non_kv``, and the growth still to come is the larger of what
    either run reserved and torch gave back.
    Why: vLLM's profiled peak counts torch's allocated bytes while the device sees reserved segments, and every
    prediction from the profile's figures was off by tens of MiB; the profile skips attention, which a served
    batch runs; run second, the served batch laid out segments beside the profile's instead of reusing them.
    Figure: Qwen3-0.6B shape, V1 bf16: 22.3 MiB inside the budget at the measured peak (legacy: 425.7 MiB over),
    run ``h200-matrix-current-2026-12-03``; the evidence per case is in that run folder's README.

Note [A served batch's query length]
    Rule: on V1 the served batch's attention metadata gives each request its own query length and the batch holds
    at most ``max_num_seqs x max_model_len`` tokens, as a served batch does.
    Why: V1's dummy batch passes the batch's whole token count as the longest query, which changes FlashAttention's
    split heuristics and so the float32 accumulators it allocates; its served run then missed part of the real
    batch's peak.
    Figure: sliding-window model, V1 bf16: the served run's allocated peak went from 72.0 to 93.0 MiB (the real
    batch's), and the case went from 35.7 MiB over to 0.3 MiB inside the budget, run
    ``h200-matrix-served-2026-12-03`` (its README).

Note [The encoder cache, held whole]
    Rule: for a multimodal model the served batch runs with the encoder cache held full (``encoder_cache_size //
    tokens per item`` dummy items, encoded in vLLM's profiled items per batch).
    Why: the cache fills over several steps and stays until the scheduler needs the room; V1's profile holds one
    batch of items and V2's runs no encoder, so the full cache is outside the profiled peak.
    Figure: ``tiny-mm`` (a Qwen2-VL shape) held 31.5 MiB at its measured peak against 9.0 MiB in V1's profile; the
    extensible runs ended 0.3 MiB (V1) and 2.3 MiB (V2) inside the budget, run ``h200-matrix-current-2026-12-03``.

Note [The speculative step, at its widest]
    Rule: with ``k > 1`` speculative tokens the served batch adds a sampler run at the widest step: every request
    proposing ``k`` drafts, logits through the LM head and its all-gather, the rejection sampler.
    Why: V1's dummy sampler run gives each request one draft whatever ``k`` is and V2 runs no rejection sampler in
    its profile; a step of ``S x (1 + k)`` logits rows and their float32 copies is then outside the profiled peak.
    Figure: Qwen3-0.6B shape, V1, ngram with 4 drafts, 8 sequences: the widest step's allocated peak was 55.8 MiB
    and the case ended 36.3 MiB inside the budget, run ``h200-matrix-current-2026-12-03``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

DEFAULT_POOL = (0, 0)  # torch's segment_pool_id of the caching allocator's default pool


def reusable_cache(segments: Iterable[Mapping], device: int) -> int:
    """Bytes of ``device``'s default pool that torch holds reserved but unused (``torch.cuda.memory_snapshot()``
    segments; graph private pools and other devices left out). Recorded (``memory.torch_reusable`` of a case, the
    profile's ``cache_before``), never credited: Note [The peak, brought back and measured]."""
    return sum(
        int(s["total_size"]) - int(s["active_size"])
        for s in segments
        if int(s["device"]) == device and tuple(s["segment_pool_id"]) == DEFAULT_POOL
    )


@dataclass(frozen=True)
class MemoryState:
    """What a worker measured; every field in bytes (blocks where named)."""

    init_free: int  # free device memory when the worker started
    requested: int  # gpu_memory_utilization x total: this instance's budget
    free_now: int  # free device memory after warmup and graph capture
    kv_backed: int  # KV bytes physically mapped now
    weights: int  # model weights (torch-allocated)
    profiled_peak: int  # vLLM's profiled activation peak (allocated bytes; recorded, not used)
    bytes_per_block: int  # one block in every KV buffer, summed
    rounding_bound: int  # most bytes granule rounding can add (granularity x segments, summed over buffers)
    capacity_blocks: int  # blocks reserved (the upper bound)
    committed_blocks: int  # blocks committed now (grow-only: the result is never below this)
    again_reserved: int  # what torch reserved for the profiled batch, run again after warmup
    again_retained: int  # of that, what torch still holds after the run (in ``free_now`` already)
    served_reserved: int  # what torch reserved for the same batch run as served (attention on), after that
    served_retained: int  # of that, what torch still holds after the run (in ``free_now`` already)
    margin: int = 0  # extra bytes kept free on purpose
    served_allocated: int = 0  # the served run's allocated peak above what was allocated before it (recorded)
    cache_after: int = 0  # bytes of torch's default pool held unused after the served run (recorded)

    @property
    def non_kv(self) -> int:
        return self.init_free - self.free_now - self.kv_backed

    @property
    def torch_growth(self) -> int:
        """Activation bytes a peak batch may still take from the device: the most that either run of the batch
        (profiled, served) reserved and torch then gave back. Note [The peak, brought back and measured]."""
        return max(0, self.again_reserved - self.again_retained, self.served_reserved - self.served_retained)

    @property
    def budget(self) -> int:
        return self.requested - self.non_kv - self.torch_growth - self.margin

    def blocks(self) -> int:
        """Blocks to commit: what fits the budget, never below the committed count, never above capacity."""
        fit = max(0, self.budget - self.rounding_bound) // self.bytes_per_block
        return max(self.committed_blocks, min(self.capacity_blocks, fit))

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "non_kv": self.non_kv,
            "torch_growth": self.torch_growth,
            "budget": self.budget,
            "blocks": self.blocks(),
        }
