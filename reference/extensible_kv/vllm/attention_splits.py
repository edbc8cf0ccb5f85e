"""FlashAttention-3's split-KV accumulators on Hopper, derived: how many splits a prefill step gets for its longest
query and longest sequence, and the query length at which the accumulators of the largest step peak.

Pure arithmetic (no vLLM, no GPU), used by ``worst_batch.derive`` to add the batch that brings the accumulators'
peak back (Note [FlashAttention-3 splits by the longest query, not the batch]).

Note [FlashAttention-3 splits by the longest query, not the batch]
    Rule: with FlashAttention-3 on Hopper the worst batches include ``prefill_split_fa3_q{q}``: the most requests of
    ``q`` new tokens at max_model_len, where ``q`` maximizes ``splits(q, L) x tokens(q)`` (``worst_query``).
    Why: for a variable-length batch FA3 allocates its accumulators (fp32 ``splits x tokens x heads x (head_dim
    + 1)``) for every query token of the step, but chooses ``splits`` as if the batch were one sequence of the
    longest query over the longest context (``get_num_splits`` in FA3's ``flash_api.cpp``): the most waves-efficient
    count of ``kv_heads x ceil(q x heads / kv_heads / kBlockM)`` tiles over the SMs, when they fill less than 80% of
    them. That count jumps with the query length (7 at 1,725 tokens, 4 at 1,536, 3 at 2,047), so a ladder of query
    lengths misses the peak between two rungs; it never falls as the context grows (more key blocks only allow
    more splits), so the context is max_model_len.
    Figure: the sliding-window model (4 heads, 2 KV heads, head_dim 64, 132 SMs) split a served step of 8 fresh
    prompts of 1,725 tokens 7 ways (94.3 MiB of accumulators) while no worst batch's accumulators passed 49 MiB
    (3 splits of 16,376 tokens, 6 of 8,192): 28.9 MiB over the budget. The derivation gives every split count
    measured in that run's prefill batches of 48 or more query tokens (15 of 15). Run h100-2026-12-07-fa3-splits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

L2_BYTES = 50 * 1024 * 1024  # FA3's assumed L2 size for one KV head
MAX_SPLITS = 128  # FA3's cap


@dataclass(frozen=True)
class SplitShape:
    """The attention layers' shape as FA3 sees it (per rank) and the device's SM count."""

    heads: int
    kv_heads: int
    head_dim: int
    sms: int


def tile_sm90(head_dim: int, causal: bool) -> tuple[int, int]:
    """FA3's forward tile ``(kBlockM, kBlockN)`` on SM90 for 16-bit elements, ``head_dim_v == head_dim``, no sliding
    window, paged KV through TMA (``tile_size_fwd_sm90``)."""
    if head_dim <= 64:
        return 192, 128 if causal else 192
    if head_dim <= 96:
        return 192, 144
    if head_dim <= 128:
        return 128, 128 if causal else 176
    if head_dim <= 192:
        return 128, 112
    return 128, 64 if causal else 80


def heuristic(total_mblocks: int, sms: int, n_blocks: int, m_blocks: int, kv_head_bytes: int, causal: bool) -> int:
    """FA3's ``num_splits_heuristic``: 1 when the tiles nearly fill the SMs (or too few key blocks), else the fewest
    splits within 85% of the best waves efficiency."""
    if total_mblocks >= 0.8 * sms:
        if kv_head_bytes > L2_BYTES and m_blocks >= 2 * sms and not causal:
            return min(-(-kv_head_bytes // L2_BYTES), MAX_SPLITS)
        return 1
    if n_blocks <= 4:
        return 1
    most = min(MAX_SPLITS, sms, n_blocks)
    efficiency = []
    for s in range(1, most + 1):
        waves = total_mblocks * s / sms
        efficiency.append(waves / math.ceil(waves))
    best = max(efficiency)
    return next(s for s, e in enumerate(efficiency, 1) if e >= 0.85 * best)


def splits(shape: SplitShape, max_query: int, max_seq: int, causal: bool = True) -> int:
    """The splits FA3 allocates accumulators for in a variable-length step whose longest query is ``max_query``
    tokens and longest sequence ``max_seq`` (``get_num_splits`` with dynamic splits: the batch counted as one)."""
    block_m, block_n = tile_sm90(shape.head_dim, causal)
    m_blocks = -(-max_query * (shape.heads // shape.kv_heads) // block_m)
    n_blocks = -(-max_seq // block_n)
    kv_head_bytes = max_seq * 2 * shape.head_dim * 2
    return heuristic(shape.kv_heads * m_blocks, shape.sms, n_blocks, m_blocks, kv_head_bytes, causal)


def accumulator_bytes(shape: SplitShape, n_splits: int, tokens: int) -> int:
    """What FA3 allocates for a split step of ``tokens`` query tokens: the fp32 output and log-sum-exp partials."""
    return 0 if n_splits <= 1 else n_splits * tokens * shape.heads * (shape.head_dim + 1) * 4


def worst_query(
    shape: SplitShape, first: int, max_model_len: int, max_num_seqs: int, max_tokens: int
) -> tuple[int, int]:
    """The query length ``q`` (``first <= q < max_model_len``) whose step of the most requests of ``q`` new tokens
    at max_model_len (``min(S, T // q)`` of them) allocates the most accumulator bytes, the first such ``q``, and
    those bytes (0: no such step splits). The split count is one per class of query lengths that cover the same
    number of ``kBlockM`` tiles, and 1 from the class whose tiles fill 80% of the SMs on: one count per class."""
    block_m, _ = tile_sm90(shape.head_dim, True)
    group = shape.heads // shape.kv_heads
    best, best_q, m = 0, first, 1
    while shape.kv_heads * m < 0.8 * shape.sms:
        lo, hi = max(first, (m - 1) * block_m // group + 1), min(max_model_len - 1, m * block_m // group)
        if lo > max_model_len - 1:
            break
        n = splits(shape, hi, max_model_len) if lo <= hi else 1
        for q in range(lo, hi + 1) if n > 1 else ():
            got = accumulator_bytes(shape, n, min(max_num_seqs, max_tokens // q) * q)
            if got > best:
                best, best_q = got, q
        m += 1
    return best_q, best
