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
    The activation peak that vLLM profiled comes back whenever a batch as large as the profiling one runs. The
    sizing used to predict what that batch would still take from the device after warmup, from the profile's
    figures; every prediction was wrong by tens of MiB on the H200 (Qwen3-0.6B shape, 16,384 batched tokens, the
    case files under ``reports/runs/h200-matrix-2026-12-03/``):

    - vLLM's profiled peak is torch's *allocated* bytes (448 to 508 MiB); the device sees *reserved* bytes: the
      caching allocator rounds blocks up and carves them from whole segments. The same profile reserved 708 to
      960 MiB, and that figure changes from run to run of the same case.
    - Crediting the default pool's unused bytes after warmup (70 to 143 MiB) against the peak was wrong: they are
      free blocks inside segments that also hold live tensors, and large activations do not fit in them. With that
      credit the batch took 708 MiB of new segments where 651 to 668 MiB were foreseen, and the runs ended 9.7 MiB
      (V1, bf16 KV), 7.7 MiB (V1, fp8) and 23.7 MiB (V2, bf16) over gpu_memory_utilization's budget.
    - Counting the profile from no cache (its reserved growth plus the unused cache it started with) foresaw 780 to
      1,017 MiB for a batch that took 642 to 708 MiB: 116 to 358 MiB of budget left unused.

    So nothing is predicted: after warmup, before measuring, the worker runs vLLM's own ``profile_run`` again (the
    batch vLLM profiled, attention skipped, sampler included) and records what torch reserved for it
    (``again_reserved``) and what it still holds afterwards (``again_retained``; torch keeps its cache unless
    something empties it). ``free_now`` is read after that run, so the peak's segments are already in ``non_kv``;
    a later batch of the same shape reuses them, and only what torch gave back in between can be taken again.
    With that, the Qwen3-0.6B shape ended 22.3, 48.3, 4.3 and 32.3 MiB *inside* the budget at its measured peak
    (V1 bf16, V1 fp8, V2 bf16, V2 fp8; the batch took 2.0 MiB of new segments after the final commit), where the
    legacy path went 425.7, 399.7, 499.7 and 415.7 MiB over.

    The profile skips attention; a served batch does not. On the interleaved sliding-window model
    (``tiny-llama-swa``: 4 layers, hidden 256, 16,376 batched tokens over 8 sequences) the profile run reserved
    100 MiB and kept it, and the served peak batch still took 48.0 MiB of new segments (torch's allocated peak
    rose 93.0 MiB above its level before the batch, the profile's 72.0 MiB), ending 47.7 MiB (V1 bf16),
    47.7 MiB (V1 fp8) and 45.7 MiB (V2 bf16) over the budget (legacy: 43.7, 39.7, 69.7 MiB over). So the same
    batch then runs once more as a served step runs it (``patches.served_batch``: attention on, eager, then the
    sampler; ``served_reserved``, ``served_retained``), and the growth still to come is the larger of the two
    runs' give-back. CUDA graph private pools never serve eager activations either way (an 8B Llama shape holds
    186 MiB of graph pools on V1, 230 MiB on V2).

    The served run comes first. Run second, it laid out segments of its own beside the profile's: on V2 the
    sliding-window model's profile run kept 80.0 MiB, the served run 48.0 MiB more, 128.0 MiB for a batch that
    took 96.0 MiB of new segments on the legacy path, and the extensible run ended 2.3 MiB inside the budget with
    102.0 MiB less KV than legacy, 30 MiB more than legacy's own overshoot (69.7 MiB) explains
    (``reports/runs/h200-matrix-served-2026-12-03/``). The profile's batch is the served one without attention,
    so run second it finds the served run's segments free.

    With the sizing as it stands, every parity case on the H200 ended inside the budget at its measured peak
    (``reports/runs/h200-matrix-current-2026-12-03/``, MiB over, extensible / legacy): Qwen3-0.6B shape V1 bf16
    -22.3 / +425.7, V1 fp8 -48.3 / +399.7, V2 bf16 -4.3 / +499.7, V2 fp8 -32.3 / +415.7, V1 block 32 -48.3 /
    +423.7; sliding-window model V1 bf16 and fp8 -0.3 / +43.7 and +39.7, V2 bf16 and fp8 -2.3 / +69.7; the 8B Llama
    shape at 256 sequences with vLLM's default capture sizes V1 -48.3 / +1,487.7, V2 -56.3 / +1,671.7. In each the
    served batch allocated what the peak batch did (416.0, 93.0 and 89.0, 1,728.0 MiB).

Note [A served batch's query length]
    V1's dummy batch describes its requests to attention with the batch's whole token count as the longest query
    (``max_query_len = num_tokens``: 16,376 on the sliding-window model) where served requests of that batch have
    2,047 each. Measured on the H200 (``reports/runs/h200-matrix-served-2026-12-03/``): on V1 the served dummy's
    allocated peak was 72.0 MiB (bf16 KV) and 72.0 MiB (fp8), the same as the profile that skips attention, while
    the real peak batch allocated 93.0 and 89.0 MiB and mapped a new 48.0 MiB segment, ending 35.7 and 47.7 MiB over
    the budget. V2's dummy gives each request its own query length; its served run allocated 93.0 and 89.0 MiB, as
    the real batch did, and those runs ended 2.3 MiB inside. Nothing was displaced in between: torch's unused cache
    before the peak batch was what it was after the served run (95.2 MiB, 123.2 MiB). Read from vLLM's code, not
    yet measured apart: the query length reaches FlashAttention as ``max_seqlen_q``; outside CUDA graphs vLLM lets
    FA3's heuristics choose the number of KV splits (``num_splits=0``), and a split run allocates float32
    accumulators per split (vLLM's comment in ``v1/attention/backends/flash_attn.py``). So on V1 the served batch's
    attention metadata gets each request's own query length (``patches.served_batch``), and the batch holds at most
    ``max_num_seqs x max_model_len`` tokens, as a served one does. With that (and the served run first), V1's served
    run allocated 93.0 and 89.0 MiB, as the real batch did; the real batch took no new segment and both runs ended
    0.3 MiB inside the budget (``integration/query-length/`` of the same run folder). The Qwen3-0.6B shape, whose
    dummy already allocated the real batch's 416.0 MiB, was unchanged by it: 72,237 blocks and 22.3 MiB inside on
    V1 bf16, as before (``reports/runs/h200-matrix-current-2026-12-03/``). Every parity case's table notes set the
    served batch's allocated peak against the peak batch's, so a dummy that misses part of the real batch shows there.

Note [The encoder cache, held whole]
    A multimodal model keeps encoder outputs (an image's embeddings) in the encoder cache until the scheduler needs
    the room: up to ``encoder_cache_size`` tokens (``max_num_batched_tokens`` by default), e.g. 28 images of 576
    tokens at 16,384 batched tokens. vLLM 0.26.0's V1 profile holds only one profiled batch of items during its
    dummy pass (``min(encoder budget // tokens per item, max_num_seqs x items per prompt)``: 8 of those 28 at
    ``max_num_seqs=8``) and V2's profile runs no encoder at all, so a cache that fills over several steps is outside
    the profiled peak (vLLM PR #47363 reserves the cache's full footprint for this reason). The served batch
    therefore runs with the cache held full (``patches.encoder_cache_held``: ``encoder_cache_size // tokens per
    item`` dummy items, encoded in batches of vLLM's profiled items per batch), and what that took is in
    ``served_reserved`` / ``served_retained``. The integration case ``tiny-mm`` (a Qwen2-VL shape, 576 tokens of
    1024 x bf16 per image: 1,179,648 bytes) records the cache's bytes at the profile and at its own peak. On the
    H200 (``reports/runs/h200-matrix-current-2026-12-03/``) the cache held 31.5 MiB at most (28 of 28 items, full at
    the measured peak) against 9.0 MiB during V1's profile and none during V2's. The served batch with the cache held
    allocated 389.1 MiB at its peak, the real peak batch 371.1 MiB; the extensible runs ended 0.3 MiB (V1) and
    2.3 MiB (V2) inside the budget, legacy 241.7 and 339.7 MiB over, tokens identical.

Note [The speculative step, at its widest]
    With ``k`` speculative tokens a decode step computes logits for ``S x (1 + k)`` rows (``S`` requests, drafts plus
    bonus tokens) and the rejection sampler works on float32 copies of them; vLLM 0.26.0's V1 dummy sampler run gives
    each request one draft (``2 x S`` rows) whatever ``k`` is, and V2 runs no rejection sampler in its profile (it
    refuses draft-free methods). Read from vLLM's sampler code, a random-sampling step holds about
    ``S x V x (16 + 14k)`` bytes at bf16 logits against the dummy's ``S x V x 30``: 1.01 GiB more at ``S=256``,
    ``k=3``, ``V=151,936``. So with ``k > 1`` the served batch's sampler run adds the widest step (``_sampler_run``:
    every request proposing ``k`` drafts, logits through the LM head and its tensor-parallel all-gather, the
    rejection sampler with vLLM's own dummy sampling parameters), measured like the rest. Every tensor-parallel rank
    holds the full-vocabulary logits of that step: ``extensible_kv.vllm.logits``. On the H200 (Qwen3-0.6B shape, V1,
    ngram with 4 drafts, 8 sequences: 40 rows x 151,936, ``reports/runs/h200-matrix-current-2026-12-03/``) the
    widest step ran in 15 of 16 steps and torch's allocated peak in it was 55.8 MiB, well under the profiled
    activation peak (448 to 508 MiB): at 8 sequences the prefill, not the step, sets the peak. The extensible run
    ended 36.3 MiB inside the budget, legacy 465.7 MiB over, tokens identical. At 64 sequences (320 rows, case
    ``...-ngram4-s64``) the reading above gives about 668 MiB, more than that profiled peak; not yet run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

DEFAULT_POOL = (0, 0)  # torch's segment_pool_id of the caching allocator's default pool


def reusable_cache(segments: Iterable[Mapping], device: int) -> int:
    """Bytes of ``device``'s default pool that torch holds reserved but unused (``torch.cuda.memory_snapshot()``
    segments; graph private pools and other devices left out). Recorded (``memory.torch_reusable`` of a case, the
    profile's ``cache_before``), never credited: Note [The peak, brought back and measured]."""
    return sum(int(s["total_size"]) - int(s["active_size"]) for s in segments
               if int(s["device"]) == device and tuple(s["segment_pool_id"]) == DEFAULT_POOL)


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
        return {**asdict(self), "non_kv": self.non_kv, "torch_growth": self.torch_growth, "budget": self.budget,
                "blocks": self.blocks()}
