"""Measurement probes into vLLM 0.26.0's model runners, for the sizing (``sizing``): what torch reserved for the
profiled activation peak, the peak batch run as served (attention on, each request's own query length, the encoder
cache held full, the widest speculative step). They reach into runner members that are not vLLM's public API; each
probe names the member it uses, and ``patches`` is the only caller.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol, cast

from . import worker_kv
from .worker_kv import ExtensibleKVUnsupported
from .worst_batch import Batch, Dummy, Limits, LimitsError, Plan

_MISSING = object()  # an attribute the instance did not have


class ProfiledRun(Protocol):
    """A run wrapped by ``profile_run_reserved_peak``: called as the run, its ``figures`` filled by each call."""

    figures: dict[str, int]

    def __call__(self) -> object: ...


def profile_run_reserved_peak(profile_run: Callable[[], object]) -> ProfiledRun:
    """``profile_run`` that also records what torch's caching allocator *reserved* for the activation peak.

    vLLM profiles the peak in allocated bytes (``allocated_bytes.all.peak``); the device sees reserved bytes, which
    are more: the allocator rounds every block up and carves blocks from whole segments. After the run ``figures``
    holds ``peak_reserved`` and ``peak_allocated`` (beyond what torch held before), ``retained`` (what torch still
    holds of it afterwards), ``cache_before`` and ``cache_after`` (the default pool's unused bytes when the run
    started and ended). The same wrapper measures vLLM's profile and the runs after warmup: Note [The peak, brought
    back and measured] in ``sizing``."""
    figures: dict[str, int] = {}

    def run() -> object:
        import torch

        torch.cuda.synchronize()
        reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        cache_before = worker_kv.torch_reusable_now()
        torch.cuda.reset_peak_memory_stats()
        result = profile_run()
        torch.cuda.synchronize()
        figures.update(
            peak_reserved=max(0, torch.cuda.max_memory_reserved() - reserved),
            peak_allocated=max(0, torch.cuda.max_memory_allocated() - allocated),
            retained=max(0, torch.cuda.memory_reserved() - reserved),
            cache_before=cache_before,
            cache_after=worker_kv.torch_reusable_now(),
        )
        return result

    profiled = cast(ProfiledRun, run)
    profiled.figures = figures
    return profiled


def encoder_cache_budget(model_runner: Any) -> dict | None:
    """The encoder cache as vLLM's scheduler sizes it (``MultiModalBudget``; V1's runner keeps one, V2's does not):
    the modality with the most tokens per item, ``encoder_cache_size`` tokens, the items that fit
    (``capacity_items``) and vLLM's profiled items per batch; ``None`` for a model without multimodal inputs or
    without an encoder budget. Note [The encoder cache, held whole] in ``sizing``."""
    if not getattr(model_runner, "supports_mm_inputs", False):
        return None
    budget = getattr(model_runner, "mm_budget", None)
    if budget is None:
        from vllm.multimodal.encoder_budget import MultiModalBudget

        budget = MultiModalBudget(model_runner.vllm_config, model_runner.mm_registry)
    if budget.get_encoder_budget() <= 0 or not budget.mm_max_toks_per_item:
        return None
    modality = budget.get_modality_with_max_tokens()
    tokens = int(budget.mm_max_toks_per_item[modality])
    return {
        "modality": modality,
        "encoder_cache_size": int(budget.encoder_cache_size),
        "tokens_per_item": tokens,
        "capacity_items": int(budget.encoder_cache_size) // tokens,
        "items_per_batch": int(budget.mm_max_items_per_batch[modality]),
    }


def encoder_cache_held(model_runner: Any) -> list:
    """Encoder outputs for as many items as the encoder cache may hold at once (``encoder_cache_budget``'s
    ``capacity_items``), encoded in batches of vLLM's profiled items per batch (so the encoder's own activation peak
    is the profiled one). ``[]`` for a model without an encoder cache or with multimodal profiling skipped.
    Note [The encoder cache, held whole] in ``sizing``."""
    if not getattr(model_runner, "supports_mm_inputs", False):
        return []
    model_config = model_runner.vllm_config.model_config
    mm_config = model_config.multimodal_config
    if mm_config is not None and (mm_config.skip_mm_profiling or getattr(mm_config, "mm_encoder_only", False)):
        return []
    budget = encoder_cache_budget(model_runner)
    if budget is None:
        return []
    from vllm.multimodal.utils import group_and_batch_mm_kwargs

    modality, items, per_batch = budget["modality"], budget["capacity_items"], max(1, budget["items_per_batch"])
    # no processor cache: an item vLLM's own profile cached would come back empty
    item = model_runner.mm_registry.get_dummy_mm_inputs(model_config, mm_counts={modality: 1})["mm_kwargs"][modality][0]
    held: list = []
    for start in range(0, items, per_batch):
        count = min(per_batch, items - start)
        batch = next(
            b
            for _, _, b in group_and_batch_mm_kwargs(
                [(modality, item)] * count, device=model_runner.device, pin_memory=False
            )
        )
        held.extend(model_runner.model.embed_multimodal(**batch))
        del batch
    return held


@contextmanager
def _on_instance(obj: object, name: str, value: object) -> Iterator[None]:
    """Within the block ``obj.name`` is ``value``, on this instance only; afterwards the instance's own attribute is
    back, or none where it had none (its class's shows through again)."""
    own = vars(obj).get(name, _MISSING)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, own)


def _served_query_length(model_runner: Any, query_len: int) -> AbstractContextManager[None]:
    """Within the block, V1's attention metadata is built with ``max_query_len`` at most ``query_len`` (this runner
    instance only). Note [A served batch's query length] in ``sizing``."""
    build = model_runner._build_attention_metadata

    def build_as_served(*args, **kwargs):
        if "max_query_len" not in kwargs:
            raise ExtensibleKVUnsupported(
                "this vLLM's _dummy_run passes max_query_len to _build_attention_metadata "
                f"positionally (args {len(args)}, keywords {sorted(kwargs)}); the served "
                "batch cannot give attention a request's query length"
            )
        kwargs["max_query_len"] = min(kwargs["max_query_len"], query_len)
        return build(*args, **kwargs)

    return _on_instance(model_runner, "_build_attention_metadata", build_as_served)


def _sampler_run(model_runner: Any, sampled: Any) -> None:
    """vLLM's dummy sampler run; with ``k > 1`` speculative tokens, then the rejection sampler at a worst-case step:
    every request proposing ``k`` drafts, ``S x (1 + k)`` logits rows through the LM head (and its tensor-parallel
    gather), with the sampling parameters vLLM's dummy run uses. vLLM's own dummy gives each request one draft.
    Note [The speculative step, at its widest] in ``sizing``."""
    spec = getattr(model_runner, "speculative_config", None)
    k = spec.num_speculative_tokens if spec is not None else 0
    if k <= 1 or worker_kv.runner_kind(model_runner) == "v2":
        model_runner._dummy_sampler_run(sampled)
        return
    rejection_sampler = model_runner.rejection_sampler
    seen: dict = {}

    def capture(metadata, draft_probs, logits, sampling_metadata):
        seen.update(sampling_metadata=sampling_metadata, draft_probs=draft_probs is not None)
        return rejection_sampler(metadata, draft_probs, logits, sampling_metadata)

    with _on_instance(model_runner, "rejection_sampler", capture):
        model_runner._dummy_sampler_run(sampled)
    if not seen:  # vLLM's dummy ran no rejection sampler (an encoder-only model): no step to widen
        return
    import torch
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    requests = sampled.shape[0]
    metadata = SpecDecodeMetadata.make_dummy([[0] * k for _ in range(requests)], model_runner.device)
    hidden = torch.rand(requests * (1 + k), sampled.shape[-1], dtype=sampled.dtype, device=sampled.device)
    logits = model_runner.model.compute_logits(hidden)
    del hidden
    draft_probs = (
        torch.softmax(torch.rand(requests * k, logits.shape[-1], device=logits.device, dtype=torch.float32), dim=-1)
        if seen["draft_probs"]
        else None
    )
    rejection_sampler(metadata, draft_probs, logits, seen["sampling_metadata"])


def served_batch(model_runner: Any) -> Callable[[], None]:
    """vLLM's profiling batch as a served step runs it: ``max_num_tokens`` tokens over up to ``max_num_seqs`` dummy
    requests *with attention* (``profile_run`` skips attention), on the eager path, then the sampler (at its widest
    speculative step), with the encoder cache held full. Dummy requests write no KV (their slot mappings are
    padding) and read only blocks already committed: V1's block-table rows are zeros (the null block) and each
    sequence is at most ``max_model_len`` tokens, one row; V2's rows hold the ids its kernel warmup wrote, which
    ``warmup_kernels`` committed. Wrapped in ``profile_run_reserved_peak`` like the profile:
    Note [The peak, brought back and measured] in ``sizing``."""

    def run() -> None:
        held = encoder_cache_held(model_runner)
        if worker_kv.runner_kind(model_runner) == "v2":
            hidden, sampled = model_runner._dummy_run(model_runner.max_num_tokens, skip_eplb=True)
            samples = model_runner.is_last_pp_rank and model_runner.pooling_runner is None
        else:
            from vllm.config import CUDAGraphMode
            from vllm.distributed import get_pp_group

            # V1's dummy gives every request seq_len = all the batch's tokens unless told otherwise, past the width
            # of a block-table row (max_model_len): each request's own query length, as served, capped by it (a
            # served batch has at most max_model_len tokens per request). It also tells attention that the longest
            # query is all the batch's tokens: the served one is a request's (Note [A served batch's query length]
            # in sizing).
            max_seqs, max_len = model_runner.scheduler_config.max_num_seqs, model_runner.max_model_len
            tokens = min(model_runner.max_num_tokens, max_seqs * max_len)
            requests = min(tokens, max_seqs)
            seq_len = min(tokens // requests + tokens % requests, max_len)
            with _served_query_length(model_runner, seq_len):
                hidden, sampled = model_runner._dummy_run(
                    tokens,
                    cudagraph_runtime_mode=CUDAGraphMode.NONE,
                    force_attention=True,
                    skip_eplb=True,
                    profile_seq_lens=seq_len,
                )
            samples = get_pp_group().is_last_rank and not model_runner.is_pooling_model
        if samples:
            _sampler_run(model_runner, sampled)
        del hidden, sampled, held

    return run


# -- the worst batches (worst_batch.derive), run after warmup -------------------------------------------------------
def limits_of(model_runner: Any) -> Limits:
    """The limits that shape this runner's batches, read from its vLLM config (``worst_batch.Limits``)."""
    config = model_runner.vllm_config
    scheduler, cache, model = config.scheduler_config, config.cache_config, config.model_config
    spec = getattr(model_runner, "speculative_config", None) or config.speculative_config
    budget = encoder_cache_budget(model_runner)
    groups = getattr(getattr(model_runner, "kv_cache_config", None), "kv_cache_groups", None) or ()
    block_sizes = [g.kv_cache_spec.block_size for g in groups] or [cache.block_size]
    return Limits(
        max_model_len=_whole("max_model_len", model_runner.max_model_len),
        max_num_batched_tokens=_whole(
            "max_num_batched_tokens", min(scheduler.max_num_batched_tokens, model_runner.max_num_tokens)
        ),
        max_num_seqs=_whole("max_num_seqs", scheduler.max_num_seqs),
        block_size=_whole("block_size", min(block_sizes)),
        chunked_prefill=_flag("enable_chunked_prefill", scheduler.enable_chunked_prefill),
        prefix_caching=_flag("enable_prefix_caching", cache.enable_prefix_caching),
        mla=_flag("use_mla", model.use_mla),
        attention_backend=str(getattr(config, "attention_config", None) and config.attention_config.backend),
        spec_tokens=_whole("num_speculative_tokens", spec.num_speculative_tokens) if spec is not None else 0,
        vocab_size=_whole("vocab_size", model.get_vocab_size()),
        encoder_cache_tokens=_whole("encoder_cache_size", budget["encoder_cache_size"]) if budget else 0,
        encoder_tokens_per_item=_whole("tokens_per_item", budget["tokens_per_item"]) if budget else 0,
        sleep_mode=_flag("enable_sleep_mode", model.enable_sleep_mode),
        decode_threshold=_whole("reorder_batch_threshold", decode_threshold_of(model_runner)),
        **fa3_shape_of(model_runner),
    )


def fa3_shape_of(model_runner: Any) -> dict[str, int]:
    """``Limits``' FlashAttention-3 fields from the first of the runner's attention layers that runs FA3 over the
    whole context (no sliding window: a window caps the key blocks, and so the splits); none where no layer does
    (Note [FlashAttention-3 splits by the longest query, not the batch] in ``attention_splits``)."""
    import torch

    compilation = getattr(model_runner.vllm_config, "compilation_config", None)
    for layer in (getattr(compilation, "static_forward_context", None) or {}).values():
        impl: Any = getattr(layer, "impl", None)
        whole_context = tuple(getattr(impl, "sliding_window", ())) == (-1, -1)
        if getattr(impl, "vllm_flash_attn_version", None) != 3 or not whole_context:
            continue
        sms = torch.cuda.get_device_properties(model_runner.device).multi_processor_count
        return {
            "fa3_heads": _whole("num_heads", impl.num_heads),
            "fa3_kv_heads": _whole("num_kv_heads", impl.num_kv_heads),
            "fa3_head_dim": _whole("head_size", impl.head_size),
            "fa3_sms": _whole("multi_processor_count", sms),
        }
    return {}


def _whole(name: str, value: object) -> int:
    """A count from vLLM's config as an int: an int (numpy's too) or a float with nothing after the point;
    ``LimitsError`` naming it otherwise (a bool, None, NaN, 4096.9, a string)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            if isinstance(value, float) and value.is_integer():
                return int(value)
    raise LimitsError(f"vLLM's {name} is not a whole number: {type(value).__name__} {value!r:.60}")


def _flag(name: str, value: object) -> bool:
    """A switch from vLLM's config as a bool: a bool, or 0 or 1; ``LimitsError`` naming it otherwise ("False")."""
    if isinstance(value, bool) or (type(value) is int and value in (0, 1)):
        return bool(value)
    raise LimitsError(f"vLLM's {name} is not a switch: {type(value).__name__} {value!r:.60}")


def decode_threshold_of(model_runner: Any) -> int:
    """The longest query any attention group of this runner takes for a decode: the largest
    ``reorder_batch_threshold`` of its metadata builders (``attn_groups``, V1 and V2; FlashMLA's is 128), at least 1.
    Note [A prefill is a prefill to the backend] in ``sizing``."""
    found = [1]
    for groups in getattr(model_runner, "attn_groups", None) or ():
        for group in groups:
            threshold = getattr(group.get_metadata_builder(), "reorder_batch_threshold", None)
            if threshold is not None:
                found.append(int(threshold))
    return max(found)


def _null_block_tables(model_runner: Any) -> None:
    """Every block-table row the dummy runs read points at block 0, the null block, committed before warmup: a
    batch's cached context is read from committed memory whatever its length (Note [Cached context over the null
    block] in ``sizing``). Run with no request in the batch (after warmup, before the scheduler exists)."""
    if worker_kv.runner_kind(model_runner) == "v2":
        for table in model_runner.block_tables.input_block_tables:
            table.zero_()
    else:
        model_runner.input_batch.block_table.clear()


@contextmanager
def _v2_context(model_runner: Any, seq_len: int) -> Iterator[None]:
    """Within the block, V2's dummy input batches have every request's sequence ``seq_len`` long (its cached
    context is ``seq_len`` less its new tokens): ``InputBatch.make_dummy`` gives seq_len = query_len otherwise."""
    from vllm.v1.worker.gpu import model_runner as v2

    original = v2.InputBatch

    class WithContext(original):  # type: ignore[valid-type, misc]  # vLLM's class, untyped here
        @classmethod
        def make_dummy(cls, num_reqs, num_tokens, input_buffers):
            batch = original.make_dummy.__func__(cls, num_reqs, num_tokens, input_buffers)
            input_buffers.seq_lens[:num_reqs] = seq_len
            batch.seq_lens_cpu_upper_bound[:] = seq_len
            batch.num_computed_tokens_np[:] = seq_len - batch.num_scheduled_tokens
            return batch

    v2.InputBatch = WithContext
    try:
        yield
    finally:
        v2.InputBatch = original


def run_dummy(model_runner: Any, d: Dummy) -> tuple[Any, Any]:
    """One dummy batch as served (attention on, eager): ``d.num_tokens`` new tokens, each request's sequence
    ``d.seq_len`` long over block-0 rows; returns (hidden states, sample hidden states)."""
    if worker_kv.runner_kind(model_runner) == "v2":
        if d.mixed:
            raise ExtensibleKVUnsupported("V2's dummy run spreads tokens evenly: a mixed step is bounded, not run")
        with _v2_context(model_runner, d.seq_len), _on_instance(model_runner, "max_num_reqs", d.num_reqs):
            return model_runner._dummy_run(d.num_tokens, uniform_decode=d.uniform_decode, skip_eplb=True)
    from vllm.config import CUDAGraphMode

    new = [n for _, n in _dummy_seqs_of(d)]
    scheduler = model_runner.scheduler_config
    saved = scheduler.max_num_seqs
    scheduler.max_num_seqs = d.num_reqs  # _dummy_run spreads over min(tokens, max_num_seqs) requests
    try:
        with _served_query_length(model_runner, max(new)):
            return model_runner._dummy_run(
                d.num_tokens,
                cudagraph_runtime_mode=CUDAGraphMode.NONE,
                force_attention=True,
                uniform_decode=d.uniform_decode,
                create_mixed_batch=d.mixed,
                skip_eplb=True,
                profile_seq_lens=d.seq_len,
            )
    finally:
        scheduler.max_num_seqs = saved


def _dummy_seqs_of(d: Dummy) -> tuple[tuple[int, int], ...]:
    from .worst_batch import _dummy_seqs

    return _dummy_seqs(d)


def _samples(model_runner: Any) -> bool:
    if worker_kv.runner_kind(model_runner) == "v2":
        return bool(model_runner.is_last_pp_rank and model_runner.pooling_runner is None)
    from vllm.distributed import get_pp_group

    return bool(get_pp_group().is_last_rank and not model_runner.is_pooling_model)


def run_batch(model_runner: Any, batch: Batch) -> None:
    """One worst batch: its dummy forward (with the encoder cache held full where it says so), then the sampler
    over its rows (at the widest speculative step)."""
    held = encoder_cache_held(model_runner) if batch.encoder_items_held else []
    assert batch.dummy is not None, f"batch {batch.name} has no dummy run (plan.runnable leaves it out)"
    hidden, sampled = run_dummy(model_runner, batch.dummy)
    if batch.sampled_rows and _samples(model_runner):
        _sampler_run(model_runner, sampled)
    del hidden, sampled, held


def worst_batch_runs(model_runner: Any, plan: Plan, reset: Callable[[], None] = lambda: None) -> dict:
    """Every batch of ``plan`` this runner can run, in order, from an emptied torch cache (Note [From an emptied
    cache] in ``sizing``). Returns the sequence's figures as ``profile_run_reserved_peak`` gives them (relative to
    torch's reserved bytes once emptied) and ``batches``: per batch its peak reserved (since the sequence began),
    allocated peak (since the batch began), seconds, shape. ``reset`` runs before every batch (V1's multimodal
    profiling cache)."""
    import time

    import torch

    kind = worker_kv.runner_kind(model_runner)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    cache_before = worker_kv.torch_reusable_now()
    _null_block_tables(model_runner)
    rows = []
    top_reserved = top_allocated = 0
    for batch in plan.runnable(kind):
        assert batch.dummy is not None  # plan.runnable gives only batches with a dummy run
        reset()
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with torch.inference_mode():
            run_batch(model_runner, batch)
        torch.cuda.synchronize()
        row: dict[str, Any] = {
            "name": batch.name,
            "targets": list(batch.targets),
            "seconds": round(time.perf_counter() - start, 4),
            "peak_reserved": max(0, torch.cuda.max_memory_reserved() - base),
            "peak_allocated": max(0, torch.cuda.max_memory_allocated() - allocated),
            "reserved_after": max(0, torch.cuda.memory_reserved() - base),
            "num_seqs": len(batch.seqs),
            "new_tokens": batch.new_tokens,
            "context_tokens": batch.context_tokens,
            "seq_len": batch.dummy.seq_len,
            "mla_context_tokens": batch.mla_context_tokens,
            "sampled_rows": batch.sampled_rows,
            "encoder_items_held": batch.encoder_items_held,
        }
        rows.append(row)
        top_reserved = max(top_reserved, row["peak_reserved"])
        top_allocated = max(top_allocated, row["peak_allocated"])
    _null_block_tables(model_runner)
    bounded = [{"name": b.name, "bound": b.bound} for b in plan.batches if kind not in b.runners or b.dummy is None]
    return {
        "peak_reserved": top_reserved,
        "peak_allocated": top_allocated,
        "retained": max(0, torch.cuda.memory_reserved() - base),
        "cache_before": cache_before,
        "cache_after": worker_kv.torch_reusable_now(),
        "batches": rows,
        "bounded": bounded,
    }
