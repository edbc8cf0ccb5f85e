"""How many KV blocks to commit once warmup is over: measured memory instead of vLLM's estimates.

vLLM 0.26.0 sizes the KV cache before CUDA graphs are captured, from ``requested - (weights + profiled activation
peak + non-torch memory) - estimated graph memory``. The extensible path reserves that amount *without* the graph
estimate (an upper bound; the estimate is not even computed: Note [No CUDA graph estimate on the extensible path]),
warms up and captures graphs with a small committed prefix, then runs the engine's worst batches
(``worst_batch.derive``) and measures what everything other than the KV cache really uses and commits the rest:

    (the worst batches run in sequence from an emptied cache: Note [The worst batch, brought back and measured])
    non_kv   = init_free - free_now - kv_backed          (weights, graph pools, activations, workspaces, NCCL, ...)
    growth   = max(0, worst_reserved - worst_retained)   (what the batches took from the device and torch gave back)
    served   = served_step_bound(async_scheduling)       (Note [What a served step adds after the worst batches])
    budget   = requested - non_kv - growth - served - margin
    blocks   = (budget - granule rounding bound) // bytes_per_block, clamped to [committed, capacity]
    cap      = torch reserved after the commit, cache emptied, + (requested - used then - margin - code granules)
                                                          (Note [Torch's cache, held to the budget])

All quantities are bytes and come from the worker (``MemoryState``), so the arithmetic is testable without a GPU.
``again_*`` and ``served_*`` both hold the worst-batch sequence's figures (``worst_batches``: per batch).

Note [The worst batch, brought back and measured]
    Rule: nothing about the working memory is predicted. After warmup the worker empties torch's cache, then runs
    every batch ``worst_batch.derive`` gives for the engine's limits (the table in ``worst_batch``: fresh prefill,
    prefill over the longest cached context, decode of max_num_seqs sequences at max_model_len, the sampler at its
    widest, a mixed step on V1, the encoder cache held full), as served (attention on, eager); ``free_now`` is read
    after all of them, so what torch kept of their peak is in ``non_kv``. vLLM's profile batch is not run again: the
    fresh prefill is that batch with attention.
    Why: the profile batch has no cached context, and a served step does: on an H100 a DeepSeek-V2 dense MLA shape
    (max_model_len 512, 4096 batched tokens, 32 sequences) ended 625 MiB over the budget sized from the profile
    batch, under 32 prompts of 400 tokens whose prefix-cache hits ran MLA's context path (Note [MLA's context
    workspace]).
    Figure: the worst-batch matrix (``ci/worst_batch_matrix.sh``) records, per case, each batch's peak and the
    load generator's highest reading against the budget.

Note [What a served step adds after the worst batches]
    Rule: the budget keeps ``(k_small + k_code) x 2 MiB`` free beyond the worst batches (``served_step_bound``):
    k_small = 2 per step in flight (2 with async scheduling, vLLM 0.26.0's default; 1 without), k_code = 4. 16 MiB
    with async scheduling, 12 MiB without.
    Why: after the worst batches torch holds every large segment a step needs, but a step's small tensors (<= 1 MiB:
    input and attention metadata, FlashMLA's tile-scheduler metadata, sampled ids) come from 2 MiB small-pool
    segments; a dummy batch runs alone, while a served step keeps the previous step's outputs alive as it builds its
    own: per step in flight one segment for its small tensors and one that a longer-lived block pins. The driver
    loads kernel code on first use in 2 MiB granules, as the load reaches kernels no batch ran (GEMM kernels chosen
    by token count, attention split variants, V1's slot-mapping kernel): one granule per family of four.
    Figure: used after the commit grew by torch + non-torch 4 + 6 MiB (mla-v1), 6 + 6 (mla-v2), 2 + 2 (qwen3-v1);
    legacy's non-torch growth was the same (6, 6, 2 MiB); mla-v1 ended 8.8 MiB over. Run h100-2026-12-06-worst-batch.
    With the bound and Note [A prefill is a prefill to the backend], 200 bursts: mla-v1 11.2, mla-v2 61.2, mla-v1
    with 7 sleep cycles 1.2, qwen3-v2 27.2 MiB inside. Not bounded here: a hybrid Mamba2 model whose torch reserve
    grew 239 MiB past the worst batches under load (NemotronH, 128.9 MiB over). Run
    h100-2026-12-06-worst-batch-served-bound.

Note [Torch's cache, held to the budget]
    Rule: once the final size is committed the worker makes torch's new segments expandable (pages mapped as they
    grow; emptying the cache unmaps every free page, not only whole free segments), empties what the worst batches
    left cached, and holds torch to ``torch_cap`` of the readings then (its reserve plus what the budget leaves, less
    the margin and the driver's code granules, never less than the worst batches' growth and a served step's small
    segments): after every step that ends past the cap it empties the cache again (``trim_torch_cache``). A soft
    cap: it refuses nothing, so a step whose live tensors need more than the cap still runs, over the budget.
    Why: the worst batches bound the live tensors, not how torch's cache lays them out, and torch keeps what it
    reserved. Its garbage collection frees only whole unused segments: as a soft cap it changed nothing (4 of 4
    seeded runs identical to no cap). A hard cap (the memory fraction) killed the sliding-window engine.
    Figure: H100, 200 bursts: NemotronH 119.1 MiB inside (128.9 over uncapped), MLA V1 41.2 inside, Qwen3 with 7
    sleep cycles 113.2 inside; sliding window 36.9 over (86.9 uncapped): its live peak, 210 MiB, is 2.3x the worst
    batches' 93 MiB. Run h100-2026-12-07-torch-cap.

Note [Split partials peak between the shortest and the longest query]
    Rule: besides the context batches at the shortest and the longest query, the worst batches run query lengths
    between them in steps of at most 1.5x (``worst_batch``'s ``prefill_split_q{q}``: the most requests of q new
    tokens at max_model_len, the longest context, which allows the most splits), and the same ladder of fresh
    prompts up to the fresh batch's (``prefill_fresh_q{q}``: a kernel's heuristics read the query and the context).
    Why: FlashAttention-3 sizes its split count for one sequence of the batch's longest query over its longest
    context (fewer query blocks, more splits) and allocates splits x heads x every query token of the batch in
    fp32: the product peaks at a middle query length that neither end reaches; where the split count does not grow
    with the query, a step of 1.5x leaves at most 1.5x of a peak between two batches unrun.
    Figure: the sliding-window model (4 heads, 64 dims, max_model_len 2048) peaked at 212 MiB allocated on a fresh
    burst of 8 prompts of up to 1,725 tokens, against 93 MiB over every worst batch before the sweep (its fresh
    batch: 8 of 2,047). Run h100-2026-12-07-torch-cap. The ladder did not bring it back (28.9 MiB over, run
    h100-2026-12-07-fresh-sweep): FA3's split count jumps between two rungs, and Note [FlashAttention-3 splits by
    the longest query, not the batch] in ``attention_splits`` derives the rung that does (65.1 MiB inside).

Note [A prefill is a prefill to the backend]
    Rule: a prefill batch gives each request more new tokens than the backend's decode threshold
    (``reorder_batch_threshold`` of its metadata builders, ``probes.decode_threshold_of``): FlashMLA's is 128.
    Why: MLA builders take every request of at most that many query tokens (uniform lengths) for a decode; 4096
    tokens over 32 requests are 128 each, so the fresh and the context batch ran FlashMLA's decode kernel, never
    MLA's prefill with its context gather and up-projection.
    Figure: mla-v1 recorded identical peaks for both (624,951,296 reserved, 424,707,072 allocated); with the
    threshold 31 requests of 132 to 136 new tokens gather 7,936 context tokens. Run h100-2026-12-06-worst-batch.

Note [The peak, brought back and measured]
    Rule (the one before the worst batches): the profiled batch ran twice after warmup, as served and as profiled,
    and the growth was the larger of what either reserved and torch gave back. Kept as the fresh-prefill batch.
    Why: vLLM's profiled peak counts torch's allocated bytes while the device sees reserved segments.
    Figure: Qwen3-0.6B shape, V1 bf16: 22.3 MiB inside the budget at the measured peak (legacy: 425.7 MiB over),
    run ``h200-matrix-current-2026-12-03``.

Note [MLA's context workspace]
    Rule: with an MLA backend the worst batches include a prefill over cached context whose contexts fill MLA's
    context workspace: ``W = max(min(max(8 x max_model_len, 4 x max_num_seqs x block_size), 65536), max_num_seqs
    x block_size)`` tokens (``worst_batch.mla_workspace_tokens``).
    Why: MLA's prefill gathers the cached latent KV of the context into that workspace chunk by chunk and
    up-projects it (``kv_b_proj``: ``chunk x heads x (qk_nope + v_head)`` values, then K assembled, per-chunk
    outputs and their merge): a transient that grows with ``min(W, sum of contexts)`` and that no fresh batch runs.
    Figure: max_model_len 512, 32 sequences, 4096 batched tokens, block 64: W = 8192 tokens; 32 sequences of 128
    new tokens at context 384 gather 8192 (``prefill_over_context``); the profile batch gathers 0.

Note [Cached context over the null block]
    Rule: the worst batches read their cached context through block-table rows of zeros: block 0, the null block,
    committed before warmup; their new tokens write nowhere (padding slots).
    Why: after warmup only a prefix of blocks is committed; kernels' working memory depends on lengths (splits,
    chunk sizes, query and context counts), never on which committed block a row names, so a context of
    max_model_len tokens read from block 0 takes the memory the same context read from its own blocks takes.
    Figure: the V1 and V2 worst batches ran without touching an uncommitted block (the committed prefix is 1
    block on V1): an uncommitted read would fault, not read zeros.

Note [From an emptied cache]
    Rule: the worst batches start from an emptied torch cache and run in one sequence; ``worst_reserved`` is the
    most torch held during the sequence above what it held once emptied.
    Why: after a wake (sleep mode) torch's cache is rebuilt from empty, in the order the served batches come; the
    sequence lays the largest batches' segments out from nothing, and what one batch left cached and the next
    could not reuse counts too. The load generator's sleep cycles check it (``integration/load_generator.py``).
    Figure: the sleep-cycle column of the worst-batch matrix.

Note [A mixed step, bounded by its parts]
    Rule: a step of max_num_seqs - 1 decodes at max_model_len and one prefill chunk runs on V1 (``create_mixed_batch``
    with every sequence at max_model_len); V2's dummy run spreads its tokens evenly over its requests and cannot
    express it, and there it is bounded by the parts run on their own: its tokens are at most max_num_batched_tokens
    (the fresh prefill's activations), its decode attention at most the decode batch's, its prefill attention at
    most one sequence's context (the context batches').
    Why: a mixed step allocates per layer the activations of all its tokens and, in turn, the attention of its decode
    and prefill parts; none of them is larger than in the batch that runs that part alone.
    Figure: V1 records the mixed batch's peak beside the others' (``worst_batches``): the bound holds where the
    mixed batch's peak is not above the largest of the others.

Note [No CUDA graph estimate on the extensible path]
    Rule: on the extensible path ``profile_cudagraph_memory`` returns 0 instead of capturing throwaway graphs.
    Why: the extensible reservation is an upper bound of address space; the graphs' real memory is measured after
    capture, so the estimate only cost start time (vLLM captures every graph size once more to estimate it).
    Figure: engine start extensible / legacy, recorded per case by the worst-batch matrix (``start_ratio``).

Note [A served batch's query length]
    Rule: on V1 the served batch's attention metadata gives each request its own query length and the batch holds
    at most ``max_num_seqs x max_model_len`` tokens, as a served batch does.
    Why: V1's dummy batch passes the batch's whole token count as the longest query, which changes FlashAttention's
    split heuristics and so the float32 accumulators it allocates; its served run then missed part of the real
    batch's peak.
    Figure: sliding-window model, V1 bf16: the served run's allocated peak went from 72.0 to 93.0 MiB (the real
    batch's), and the case went from 35.7 MiB over to 0.3 MiB inside the budget, run
    ``h200-matrix-served-2026-12-03`` (removed; its figures are in ``reports/runs/current.json``).

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
from dataclasses import asdict, dataclass, fields

from ..boundaries import shown
from ..errors import InvalidArgumentError, InvalidSizeError

DEFAULT_POOL = (0, 0)  # torch's segment_pool_id of the caching allocator's default pool
SEGMENT = 2 << 20  # torch's small-pool segment (kSmallBuffer) and the driver's granule for kernel code
SMALL_SEGMENTS_PER_STEP = 2  # per step in flight: one for its small tensors, one pinned by a longer-lived block
CODE_GRANULES = 4  # GEMM by token count, attention split variants, served-path Triton kernels, torch's own ops


def _count(owner: str, name: str, value: object, low: int | None = 0) -> int:
    """``value`` as a count of bytes or blocks: an ``int`` (not a bool) of at least ``low`` (None: any int);
    ``InvalidArgumentError`` or ``InvalidSizeError`` naming ``owner``, the field and the value otherwise."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgumentError(f"{owner}: {name} must be an integer, got {shown(value)}")
    if low is not None and value < low:
        raise InvalidSizeError(f"{owner}: {name}={value} is below {low}")
    return value


def served_step_bound(async_scheduling: bool) -> int:
    """Bytes a served step may add after the worst batches: torch small-pool segments for the steps in flight and
    the driver's granules for kernels first loaded by served steps. Note [What a served step adds after the worst
    batches]."""
    steps_in_flight = 2 if async_scheduling else 1
    return (SMALL_SEGMENTS_PER_STEP * steps_in_flight + CODE_GRANULES) * SEGMENT


def default_pool(segments: Iterable[Mapping], device: int) -> list[Mapping]:
    """The segments of ``device``'s default pool among ``torch.cuda.memory_snapshot()``'s (graph private pools and
    other devices left out)."""
    return [s for s in segments if int(s["device"]) == device and tuple(s["segment_pool_id"]) == DEFAULT_POOL]


def reusable_cache(segments: Iterable[Mapping], device: int) -> int:
    """Bytes of ``device``'s default pool that torch holds reserved but unused (``torch.cuda.memory_snapshot()``
    segments; graph private pools and other devices left out). Recorded (``memory.torch_reusable`` of a case, the
    profile's ``cache_before``), never credited: Note [The peak, brought back and measured]."""
    return sum(int(s["total_size"]) - int(s["active_size"]) for s in default_pool(segments, device))


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
    worst_batches: tuple = ()  # per worst batch: name, targets, peak_reserved, peak_allocated, seconds, shape
    bounded_batches: tuple = ()  # worst batches this runner cannot run, each with the Note that bounds it
    served_step: int = 0  # ``served_step_bound``: what a served step adds after the worst batches

    def __post_init__(self) -> None:
        """Every measured field is an int of at least 0 (``bytes_per_block`` and ``capacity_blocks`` at least 1),
        and no more blocks are committed than reserved: ``InvalidArgumentError`` or ``InvalidSizeError`` naming the
        field and the value otherwise, before any arithmetic."""
        for f in fields(self):
            if f.name not in ("worst_batches", "bounded_batches"):
                low = 1 if f.name in ("bytes_per_block", "capacity_blocks") else 0
                _count("MemoryState", f.name, getattr(self, f.name), low)
        if self.committed_blocks > self.capacity_blocks:
            raise InvalidSizeError(
                f"MemoryState: committed_blocks={self.committed_blocks} is above capacity_blocks={self.capacity_blocks}"
            )

    @property
    def non_kv(self) -> int:
        return self.init_free - self.free_now - self.kv_backed

    @property
    def torch_growth(self) -> int:
        """Activation bytes a worst batch may still take from the device: the most the worst-batch sequence
        reserved and torch then gave back. Note [The worst batch, brought back and measured]."""
        return max(0, self.again_reserved - self.again_retained, self.served_reserved - self.served_retained)

    @property
    def budget(self) -> int:
        return self.requested - self.non_kv - self.torch_growth - self.served_step - self.margin

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


def torch_cap(measured: MemoryState, used_now: int, reserved_now: int) -> int:
    """The most torch's caching allocator may reserve once the final size is committed, in bytes: ``reserved_now``
    (torch's reserve after the commit) plus what the budget leaves (``requested - used_now``, ``used_now`` being the
    device memory used since the worker started, read after the commit) less the margin and the driver's code
    granules; never less than ``reserved_now`` plus the worst batches' growth and a served step's small segments, so
    the measured batches still run where the commit was clamped. ``used_now`` is any int (below 0 where other
    processes freed memory since the worker started), ``reserved_now`` an int of at least 0: the typed errors of
    ``MemoryState`` otherwise. Note [Torch's cache, held to the budget]."""
    _count("torch_cap", "used_now", used_now, low=None)  # negative where others freed memory since the start
    _count("torch_cap", "reserved_now", reserved_now)
    code = CODE_GRANULES * SEGMENT
    left = measured.requested - used_now - measured.margin - code
    floor = measured.torch_growth + max(0, measured.served_step - code)
    return reserved_now + max(left, floor)
