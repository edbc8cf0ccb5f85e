"""The batches that bring back the peak of each part of a served engine's working memory, derived from its limits.

Pure arithmetic over ``Limits`` (no vLLM, no GPU): ``derive(limits)`` returns named ``Batch`` shapes, each a tuple of
``(cached_context_len, new_tokens)`` per sequence, the components it targets, and how vLLM 0.26.0's dummy run
expresses it (``Dummy``); a batch that no dummy run can express names the Note that bounds it instead. The sizing
(``probes.worst_batch_runs``, ``patches.extensible_kv_measure``) runs every runnable batch after warmup, from an
emptied torch cache, and keeps free the most any of them took (Note [The worst batch, brought back and measured] in
``sizing``).

Which batch brings which peak back (vLLM 0.26.0; ``S`` max_num_seqs, ``T`` max_num_batched_tokens, ``L``
max_model_len, ``k`` speculative tokens, ``W`` MLA's context workspace in tokens, ``mla_workspace_tokens``):

    component                 batch that brings its peak back            why that batch
    activations (QKV, MLP,    prefill_fresh: T new tokens over            a step schedules at most T tokens
      residuals, per token)     min(T, S) sequences, no context
    encoder cache             prefill_fresh, the cache held full          Note [The encoder cache, held whole]
    attention over cached     prefill_over_context: T new tokens over     the most new tokens, every sequence
      context (FA / Triton /    S sequences, each at L                      at the longest context
      FlashInfer split-KV)    prefill_longest_context: S sequences of     the most cached context
                                k + 2 new tokens at L
    MLA context: workspace    prefill_over_context where its contexts     Note [MLA's context workspace]
      gather, kv_b_proj         fill W, else prefill_longest_context
      up-projection, merges
    split-KV partials         prefill_split_q{q}: min(S, T // q)          Note [Split partials peak between the
      (num_splits x heads x     sequences of q new tokens at L, q in         shortest and the longest query]
      query tokens floats)      steps of at most 1.5x between the two
                                context batches; prefill_fresh_q{q}: the
                                same query lengths with no context, up
                                to prefill_fresh's
                              prefill_split_fa3_q{q}: the same at the    Note [FlashAttention-3 splits by the
                                q that FA3's split count makes worst        longest query, not the batch] in
                                (FlashAttention-3 on Hopper)                ``attention_splits``
    decode attention          decode_max_len: S sequences of 1 + k new    the most sequences at the longest
      (split-KV partials)       tokens at L                                 context
    sampler (rows x vocab     decode_max_len's sampler run: S x (1 + k)   Note [The speculative step, at its
      logits, sorts)            rows; prefill_fresh's: S rows               widest]
    mixed prefill/decode      mixed: S - 1 decodes at L, one prefill      Note [A mixed step, bounded by its
                                chunk (V1 runs it, V2 bounds it)            parts]
    torch's cache rebuilt     every batch in one sequence from an         Note [From an emptied cache]
      after a wake              emptied cache

The Notes named are in ``sizing``; each batch's measured peak is in the worker's report (``measured.worst_batches``)
and, per case, in the worst-batch matrix (``ci/worst_batch_matrix.sh``).

Without chunked prefill and prefix caching no prefill has cached context: the two context batches are left out. A
backend that takes short queries for decodes (FlashMLA: up to 128 tokens, ``decode_threshold``) gets prefill batches
of more new tokens per request than that (Note [A prefill is a prefill to the backend]).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .attention_splits import SplitShape, worst_query

MLA_WORKSPACE_CAP = 64 * 1024  # vLLM 0.26.0's cap on MLA's context workspace, in tokens


class LimitsError(ValueError):
    """Engine limits that no scheduler accepts; the message names the values."""


@dataclass(frozen=True)
class Limits:
    """The limits of one engine that shape its batches (vLLM's names)."""

    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    chunked_prefill: bool = True
    prefix_caching: bool = True
    mla: bool = False  # an MLA attention backend (context workspace, Note [MLA's context workspace])
    attention_backend: str = "FLASH_ATTN"
    spec_tokens: int = 0  # ngram / draft tokens per step (k)
    vocab_size: int = 0
    encoder_cache_tokens: int = 0  # the scheduler's encoder cache size in tokens (0: no encoder)
    encoder_tokens_per_item: int = 0
    sleep_mode: bool = False
    decode_threshold: int = 1  # the longest query the backend takes for a decode (its reorder_batch_threshold)
    # FlashAttention-3 on Hopper: its layers' heads, KV heads, head size (per rank) and the device's SMs; 0: not FA3
    # (Note [FlashAttention-3 splits by the longest query, not the batch] in ``attention_splits``)
    fa3_heads: int = 0
    fa3_kv_heads: int = 0
    fa3_head_dim: int = 0
    fa3_sms: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value, kind = getattr(self, f.name), {"bool": bool, "str": str}.get(str(f.type), int)
            if type(value) is not kind:  # a bool is no count, a float or NaN no token count, a string neither
                raise LimitsError(f"{f.name} must be {kind.__name__}, got {type(value).__name__} {value!r:.60}")
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "block_size", "decode_threshold"):
            if getattr(self, name) < 1:
                raise LimitsError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.spec_tokens < 0:
            raise LimitsError(f"spec_tokens must be >= 0, got {self.spec_tokens}")
        if self.max_model_len < self.spec_tokens + 2:
            raise LimitsError(
                f"max_model_len ({self.max_model_len}) leaves no room for a step of 1 + {self.spec_tokens} "
                f"speculative tokens after a one-token prompt"
            )
        if self.max_num_batched_tokens < self.spec_tokens + 1:
            raise LimitsError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) cannot hold one decode step of 1 + "
                f"{self.spec_tokens} speculative tokens"
            )
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise LimitsError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}): a prompt of max_model_len tokens could never be scheduled"
            )
        fa3 = (self.fa3_heads, self.fa3_kv_heads, self.fa3_head_dim, self.fa3_sms)
        if any(fa3) and (min(fa3) < 1 or self.fa3_heads % self.fa3_kv_heads):
            raise LimitsError(
                f"FlashAttention-3's heads {self.fa3_heads}, KV heads {self.fa3_kv_heads}, head size "
                f"{self.fa3_head_dim} and SMs {self.fa3_sms} must all be 0 (not FA3) or >= 1 with the heads a "
                f"multiple of the KV heads"
            )
        if self.encoder_cache_tokens and self.encoder_tokens_per_item < 1:
            raise LimitsError(
                f"an encoder cache of {self.encoder_cache_tokens} tokens needs encoder_tokens_per_item >= 1, "
                f"got {self.encoder_tokens_per_item}"
            )

    @property
    def context_possible(self) -> bool:
        """A prefill may run on top of cached context: a chunk after the first (chunked prefill) or a prefix-cache
        hit."""
        return self.chunked_prefill or self.prefix_caching

    @property
    def fa3(self) -> SplitShape | None:
        """The attention shape FlashAttention-3 splits for, if the engine runs it."""
        if not self.fa3_sms:
            return None
        return SplitShape(self.fa3_heads, self.fa3_kv_heads, self.fa3_head_dim, self.fa3_sms)

    @property
    def decode_query_len(self) -> int:
        return 1 + self.spec_tokens

    @property
    def prefill_query_len(self) -> int:
        """The fewest new tokens a request needs to be a prefill to the backend: more than a decode step and more
        than the backend's decode threshold (Note [A prefill is a prefill to the backend] in ``sizing``)."""
        return max(self.decode_query_len, self.decode_threshold) + 1


@dataclass(frozen=True)
class Dummy:
    """How vLLM 0.26.0's ``_dummy_run`` runs a batch: ``num_tokens`` spread over ``min(num_tokens, num_reqs)``
    requests (the last takes the remainder) with every request's sequence length ``seq_len`` (its cached context is
    ``seq_len`` minus its new tokens); ``uniform_decode``: every request ``1 + k`` tokens; ``mixed``: V1's
    ``create_mixed_batch`` (decodes of one token, then one prefill of the rest)."""

    num_tokens: int
    num_reqs: int
    seq_len: int
    uniform_decode: bool = False
    mixed: bool = False


@dataclass(frozen=True)
class Batch:
    """One worst batch: ``seqs`` are ``(cached_context_len, new_tokens)`` per sequence."""

    name: str
    targets: tuple[str, ...]
    seqs: tuple[tuple[int, int], ...]
    dummy: Dummy | None
    sampled_rows: int = 0  # logits rows through the sampler after the forward (0: no sampler run)
    encoder_items_held: int = 0  # encoder outputs held in the cache during the batch
    runners: tuple[str, ...] = ("v1", "v2")  # the model runners whose dummy run expresses it
    bound: str | None = None  # the Note that bounds it where a runner cannot run it
    mla_context_tokens: int = 0  # tokens gathered into MLA's workspace in one chunk (0 unless MLA)

    @property
    def new_tokens(self) -> int:
        return sum(n for _, n in self.seqs)

    @property
    def context_tokens(self) -> int:
        return sum(c for c, _ in self.seqs)


@dataclass(frozen=True)
class Plan:
    """The batches of one engine, in the order they run."""

    limits: Limits
    batches: tuple[Batch, ...] = field(default_factory=tuple)

    def by_component(self) -> dict[str, list[str]]:
        """Component -> the batches that target it."""
        table: dict[str, list[str]] = {}
        for b in self.batches:
            for t in b.targets:
                table.setdefault(t, []).append(b.name)
        return table

    def runnable(self, runner: str) -> tuple[Batch, ...]:
        return tuple(b for b in self.batches if runner in b.runners and b.dummy is not None)


def mla_workspace_tokens(limits: Limits) -> int:
    """Rows of MLA's context workspace (``MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size`` in
    vLLM 0.26.0, no decode context parallelism)."""
    s, bs = limits.max_num_seqs, limits.block_size
    w = min(max(8 * limits.max_model_len, 4 * s * bs), MLA_WORKSPACE_CAP)
    return max(w, s * bs)


def mla_chunk_tokens(contexts: list[int], limits: Limits) -> int:
    """Tokens MLA gathers into its workspace in the first (largest) context chunk of a prefill batch with these
    cached contexts (``build_mla_chunked_context_metadata``: an equal share of the workspace per prefill with
    context, rounded down to the block size)."""
    with_context = [c for c in contexts if c > 0]
    if not with_context:
        return 0
    share = mla_workspace_tokens(limits) // len(with_context)
    share = max(limits.block_size, share // limits.block_size * limits.block_size)
    return sum(min(c, share) for c in with_context)


def _dummy_seqs(d: Dummy) -> tuple[tuple[int, int], ...]:
    """The ``(cached_context_len, new_tokens)`` per sequence that a dummy run runs."""
    if d.mixed:
        decodes = min(d.num_reqs - 1, d.num_tokens // 2)
        prefill = d.num_tokens - decodes
        return tuple([(d.seq_len - 1, 1)] * decodes + [(d.seq_len - prefill, prefill)])
    reqs = min(d.num_tokens, d.num_reqs)
    per, extra = divmod(d.num_tokens, reqs)
    new = [per] * reqs
    new[-1] += extra
    return tuple((d.seq_len - n, n) for n in new)


def _batch(name: str, targets: tuple[str, ...], dummy: Dummy, limits: Limits, **kwargs: Any) -> Batch:
    seqs = _dummy_seqs(dummy)
    for ctx, new in seqs:
        if ctx < 0 or new < 1 or ctx + new > limits.max_model_len:
            raise LimitsError(f"batch {name}: sequence of context {ctx} and {new} new tokens outside {limits}")
    if dummy.num_tokens > limits.max_num_batched_tokens:
        raise LimitsError(f"batch {name}: {dummy.num_tokens} tokens > max_num_batched_tokens")
    prefills = [c for c, n in seqs if n >= limits.prefill_query_len]  # the requests the backend takes for prefills
    chunk = mla_chunk_tokens(prefills, limits) if limits.mla else 0
    return Batch(name, targets, seqs, dummy, mla_context_tokens=chunk, **kwargs)


def _fits(tokens: int, reqs: int, cap: int) -> int:
    """The most of ``tokens`` that ``reqs`` requests take when the last takes the remainder (as vLLM's dummy run
    spreads them) and no request takes more than ``cap``."""
    per = min(tokens // reqs, cap)
    return reqs * per + min(tokens - reqs * per, max(0, cap - per))


def _ladder(first: int, last: int) -> list[int]:
    """Every ``q`` above ``first`` and below ``last`` of the form ``first x 2^i`` or ``first x 3 x 2^i``: each at
    most 1.5 times the one before."""
    qs, p = [], first
    while p < last:
        qs += [p, 3 * p // 2] if p > first else [3 * p // 2]
        p *= 2
    return sorted({q for q in qs if first < q < last})


def _split_sweep(limits: Limits, first: int, last: int) -> list[Batch]:
    """``prefill_split_q{q}``: for every ``q`` of the ladder between ``first`` and ``last``, the most requests
    (``min(S, T // q)``) of ``q`` new tokens each at max_model_len."""
    s, t, L = limits.max_num_seqs, limits.max_num_batched_tokens, limits.max_model_len
    sweep = []
    for q in _ladder(first, min(last, L)):
        reqs = min(s, t // q)
        sweep.append(_batch(f"prefill_split_q{q}", ("attention_split_partials",), Dummy(reqs * q, reqs, L), limits))
    return sweep


def _fresh_sweep(limits: Limits, first: int, last: int) -> list[Batch]:
    """``prefill_fresh_q{q}``: for every ``q`` of the ladder between ``first`` and ``last``, the most requests
    (``min(S, T // q)``) of ``q`` new tokens each with no cached context."""
    s, t = limits.max_num_seqs, limits.max_num_batched_tokens
    sweep = []
    for q in _ladder(first, last):
        reqs = min(s, t // q)
        sweep.append(_batch(f"prefill_fresh_q{q}", ("attention_split_partials",), Dummy(reqs * q, reqs, q), limits))
    return sweep


def _fa3_split(limits: Limits, first: int, before: list[Batch]) -> list[Batch]:
    """``prefill_split_fa3_q{q}``: FlashAttention-3's accumulators at their largest step, the most requests of the
    ``q`` new tokens at max_model_len that ``attention_splits.worst_query`` derives (none where no step splits or a
    batch before runs the same sequences; Note [FlashAttention-3 splits by the longest query, not the batch])."""
    shape = limits.fa3
    if shape is None:
        return []
    s, t, L = limits.max_num_seqs, limits.max_num_batched_tokens, limits.max_model_len
    q, nbytes = worst_query(shape, first, L, s, t)
    reqs = min(s, t // q)
    batch = _batch(f"prefill_split_fa3_q{q}", ("attention_split_partials",), Dummy(reqs * q, reqs, L), limits)
    return [batch] if nbytes and all(b.seqs != batch.seqs for b in before) else []


def derive(limits: Limits) -> Plan:
    """The worst batches of an engine with these limits (the table in the module's docstring)."""
    s, t, L = limits.max_num_seqs, limits.max_num_batched_tokens, limits.max_model_len
    batches: list[Batch] = []

    # Activations: the most tokens a step schedules, every sequence fresh, the encoder cache full; where the backend
    # takes short queries for decodes, few enough requests that each is a prefill to it.
    prefill_min = limits.prefill_query_len  # fewer new tokens and the backend takes it for a decode
    reqs = min(t, s)
    if limits.decode_threshold > limits.decode_query_len and t >= prefill_min:
        reqs = min(reqs, t // prefill_min)
    fresh_tokens = _fits(min(t, s * L), reqs, L)
    if not limits.context_possible:  # every request as long as the last: the dummy run gives all one length
        fresh_tokens = fresh_tokens // reqs * reqs
    longest = fresh_tokens // reqs + fresh_tokens % reqs
    held = limits.encoder_cache_tokens // limits.encoder_tokens_per_item if limits.encoder_cache_tokens else 0
    targets = ("activations", "sampler") + (("encoder_cache",) if held else ())
    batches.append(
        _batch(
            "prefill_fresh",
            targets,
            Dummy(fresh_tokens, reqs, min(longest, L)),
            limits,
            sampled_rows=reqs,
            encoder_items_held=held,
        )
    )
    # Fresh prompts of every query length between a prefill's shortest and the fresh batch's, each at most 1.5 times
    # the one before (Note [Split partials peak between the shortest and the longest query] in ``sizing``).
    batches.extend(_fresh_sweep(limits, first=prefill_min, last=min(longest, L)))

    if limits.context_possible and L > prefill_min and t >= prefill_min:
        # The most new tokens at the longest context: each sequence at max_model_len.
        reqs = min(s, t // prefill_min)
        tokens = _fits(min(t, reqs * (L - 1)), reqs, L - 1)
        over = _batch(
            "prefill_over_context",
            ("activations", "attention_prefill_context") + (("mla_context_workspace",) if limits.mla else ()),
            Dummy(tokens, reqs, L),
            limits,
        )
        batches.append(over)
        # The most cached context: every sequence a short prefill chunk at max_model_len (Note [MLA's context
        # workspace]); for the other backends the split-KV prefill at its longest context.
        longest_ctx = _batch(
            "prefill_longest_context",
            ("attention_prefill_context",) + (("mla_context_workspace",) if limits.mla else ()),
            Dummy(reqs * prefill_min, reqs, L),
            limits,
        )
        if longest_ctx.context_tokens > over.context_tokens and (
            not limits.mla or longest_ctx.mla_context_tokens > over.mla_context_tokens
        ):
            batches.append(longest_ctx)
        # Split-KV partials: query lengths between those two, each at most 1.5 times the one before (Note [Split
        # partials peak between the shortest and the longest query] in ``sizing``).
        batches.extend(_split_sweep(limits, first=prefill_min, last=max(n for _, n in over.seqs)))
        batches.extend(_fa3_split(limits, prefill_min, batches))

    # Decode: every sequence at max_model_len, 1 + k tokens each, then the sampler at its widest.
    q = limits.decode_query_len
    reqs = max(1, min(s, t // q))
    batches.append(
        _batch(
            "decode_max_len",
            ("attention_decode", "sampler"),
            Dummy(reqs * q, reqs, L, uniform_decode=True),
            limits,
            sampled_rows=reqs * q,
        )
    )

    # A mixed step: S - 1 decodes at max_model_len and one prefill chunk (V1's create_mixed_batch).
    if limits.chunked_prefill and s > 1:
        prefill = min(t - (s - 1), L - 1 if limits.context_possible else L)
        if prefill >= s - 1 and prefill >= prefill_min:  # create_mixed_batch makes S - 1 decodes only then
            batches.append(
                _batch(
                    "mixed",
                    ("activations", "attention_prefill_context", "attention_decode"),
                    Dummy(s - 1 + prefill, s, L, mixed=True),
                    limits,
                    runners=("v1",),
                    bound="Note [A mixed step, bounded by its parts]",
                )
            )
    return Plan(limits, tuple(batches))
