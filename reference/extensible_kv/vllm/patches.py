"""The patch points in vLLM 0.26.0, installed and removed as one set.

Worker side (runs in each worker process):

- V1 ``GPUModelRunner.initialize_kv_cache_tensors`` derives the segments (dry run of ``_reshape_kv_cache_tensors``
  on meta tensors), then ``GPUModelRunner._allocate_kv_cache_tensors`` allocates the extensible buffers (a
  connector's cross-layer blocks: ``connector.cross_layer_allocator``).
- V2 ``gpu.model_runner.init_kv_cache`` derives the segments (dry run of ``attn_utils._reshape_kv_cache``), then
  ``gpu.attn_utils._allocate_kv_cache`` allocates them.
- Both: a KV connector's registration is recorded (``connector.defer``) and replayed by ``extensible_kv_commit``
  after the final commit, with views of exactly the committed blocks (``connector.register``).
- ``gpu_worker.warmup_kernels`` (V2 only): before every warmup step, commits the block ids that step references.
- ``Worker.determine_available_memory`` adds back the CUDA graph estimate, so vLLM sizes the reservation as the
  upper bound; the measured graph memory replaces the estimate later. With sleep mode on it also wraps the worker's
  sleep-mode backend, so ``sleep`` releases the KV pages and ``wake_up`` recommits them (``sleep.bind``).
- ``Worker.extensible_kv_measure`` / ``Worker.extensible_kv_commit`` / ``Worker.extensible_kv_report``: new RPCs.
  ``determine_available_memory`` also binds them on the worker instance, with the worker's own ``WorkerKV``: an
  engine keeps the RPCs it was built with after the patches are removed (Note [An engine keeps its RPCs]).

Engine side: ``EngineCore._initialize_kv_caches`` runs vLLM's own sizing, allocation, warmup and capture, then asks
every worker how many blocks fit, takes the minimum, has every worker commit it, and hands that count to the
scheduler (built right after). ``initialize_kv_cache`` is never run again, so captured graphs stay valid.
"""

from __future__ import annotations

import importlib
import logging
import os
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..errors import DriverUnavailable
from . import agreement, connector, sleep, worker_kv
from .worker_kv import ExtensibleKVUnsupported

logger = logging.getLogger("extensible_kv.vllm")

MARGIN_ENV = "EXTENSIBLE_KV_CACHE_MARGIN_BYTES"


def check_supported(vllm_config: Any, platform: Any) -> None:
    """Raise ExtensibleKVUnsupported, naming the reason, for configurations the extensible path refuses."""
    reasons = connector.unsupported_reasons(vllm_config)  # a KV connector is registered after the final commit
    if not platform.is_cuda_alike():
        reasons.append(f"platform {getattr(platform, 'device_name', type(platform).__name__)} is neither CUDA nor "
                       f"ROCm")
    if reasons:
        raise ExtensibleKVUnsupported("the extensible KV cache cannot be used: " + "; ".join(reasons))


def _margin() -> int:
    raw = os.environ.get(MARGIN_ENV, "0")
    try:
        value = int(raw)
    except ValueError:
        raise ExtensibleKVUnsupported(f"{MARGIN_ENV} must be an integer number of bytes, got {raw!r}") from None
    if value < 0:
        raise ExtensibleKVUnsupported(f"{MARGIN_ENV} must be >= 0, got {value}")
    return value


def max_block_id(scheduler_output: Any) -> int:
    """The largest KV block id a SchedulerOutput references (-1 when none)."""
    top = -1
    for req in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        for ids in req.block_ids or ():
            if ids:
                top = max(top, max(ids))
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    for groups in getattr(cached, "new_block_ids", None) or ():
        for ids in groups or ():
            if ids:
                top = max(top, max(ids))
    return top


def _worker_kv() -> worker_kv.WorkerKV:
    state = worker_kv.active()
    if state is None or state.buffers is None:
        raise ExtensibleKVUnsupported("the extensible KV cache is enabled but this worker built no extensible "
                                      "buffers (was it enabled before the engine started?)")
    return state


def _platform_driver() -> object:
    """The driver for this worker's device: hip on ROCm, cuda otherwise, on torch's current device (the driver
    probes that device itself when it is built)."""
    import torch
    from vllm.platforms import current_platform

    from ..drivers.cuda import CudaDriver
    from ..drivers.hip import HipDriver

    name, factory = ("hip", HipDriver) if current_platform.is_rocm() else ("cuda", CudaDriver)
    try:
        return factory(torch.cuda.current_device())
    except DriverUnavailable as exc:
        raise ExtensibleKVUnsupported(f"the {name} driver cannot run in this worker: {exc}") from exc


# -- worker side ---------------------------------------------------------------------------------------------------
def _v1_initialize_kv_cache_tensors(original: Callable) -> Callable:
    def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes):
        from vllm.platforms import current_platform

        check_supported(self.vllm_config, current_platform)
        state = worker_kv.start(_platform_driver())
        if self.use_uniform_kv_cache(self.attn_groups):  # Note [Cross-layer blocks on the extensible path]
            connector.defer(state)
            allocate = connector.cross_layer_allocator(state, self.allocate_uniform_kv_caches)
            with _on_instance(self, "allocate_uniform_kv_caches", allocate):
                return original(self, kv_cache_config, kernel_block_sizes)
        state.segments = worker_kv.derive_segments(
            kv_cache_config, lambda raw: self._reshape_kv_cache_tensors(raw, kernel_block_sizes))
        connector.defer(state)  # register_kv_caches waits for the final commit (connector.py)
        return original(self, kv_cache_config, kernel_block_sizes)

    return initialize_kv_cache_tensors


def _v1_allocate_kv_cache_tensors(original: Callable) -> Callable:
    def _allocate_kv_cache_tensors(self, kv_cache_config):
        with sleep.nothing_in_pool("the extensible KV allocation"):  # Note [Nothing of ours in vLLM's pool]
            return worker_kv.active().allocate(kv_cache_config)

    return _allocate_kv_cache_tensors


def _v2_init_kv_cache(original: Callable) -> Callable:
    def init_kv_cache(runner_kv_caches, forward_context, kv_cache_config, attn_groups, device, cache_dtype,
                      kernel_block_sizes, vllm_config):
        from vllm.platforms import current_platform
        from vllm.v1.worker.gpu import attn_utils

        check_supported(vllm_config, current_platform)
        shared = attn_utils.get_shared_kv_cache_layers(vllm_config)
        flat = [g for groups in attn_groups for g in groups]
        state = worker_kv.start(_platform_driver())
        state.segments = worker_kv.derive_segments(kv_cache_config, lambda raw: attn_utils._reshape_kv_cache(
            attn_groups=flat, kv_cache_raw_tensors=raw, kernel_block_sizes=kernel_block_sizes,
            cache_dtype=cache_dtype, shared_kv_cache_layers=shared, kv_cache_config=kv_cache_config))
        connector.defer(state)  # register_kv_caches waits for the final commit (connector.py)
        return original(runner_kv_caches, forward_context, kv_cache_config, attn_groups, device, cache_dtype,
                        kernel_block_sizes, vllm_config)

    return init_kv_cache


def _v2_allocate_kv_cache(original: Callable) -> Callable:
    def _allocate_kv_cache(kv_cache_config, shared_kv_cache_layers, device):
        with sleep.nothing_in_pool("the extensible KV allocation"):  # Note [Nothing of ours in vLLM's pool]
            raw = worker_kv.active().allocate(kv_cache_config)
        return {name: t for name, t in raw.items() if name not in shared_kv_cache_layers}

    return _allocate_kv_cache


def _warmup_kernels(original: Callable) -> Callable:
    def warmup_kernels(model_runner, worker_execute_model, worker_sample_tokens):
        state = _worker_kv()

        def execute_model(scheduler_output):
            top = max_block_id(scheduler_output)
            if top >= 0:
                state.ensure_blocks(top + 1, reason="V2 warmup_kernels")
            return worker_execute_model(scheduler_output)

        return original(model_runner, execute_model, worker_sample_tokens)

    return warmup_kernels


def profile_run_reserved_peak(profile_run: Callable[[], object]) -> Callable[[], object]:
    """``profile_run`` that also records what torch's caching allocator *reserved* for the activation peak.

    vLLM profiles the peak in allocated bytes (``allocated_bytes.all.peak``); the device sees reserved bytes, which
    are more: the allocator rounds every block up and carves blocks from whole segments. After the run ``figures``
    holds ``peak_reserved`` and ``peak_allocated`` (beyond what torch held before), ``retained`` (what torch still
    holds of it afterwards), ``cache_before`` and ``cache_after`` (the default pool's unused bytes when the run
    started and ended). The same wrapper measures vLLM's profile and the runs after warmup: Note [The peak, brought
    back and measured] in ``sizing``."""
    figures: dict[str, int] = {}

    def run():
        import torch

        torch.cuda.synchronize()
        reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        cache_before = worker_kv.torch_reusable_now()
        torch.cuda.reset_peak_memory_stats()
        result = profile_run()
        torch.cuda.synchronize()
        figures.update(peak_reserved=max(0, torch.cuda.max_memory_reserved() - reserved),
                       peak_allocated=max(0, torch.cuda.max_memory_allocated() - allocated),
                       retained=max(0, torch.cuda.memory_reserved() - reserved), cache_before=cache_before,
                       cache_after=worker_kv.torch_reusable_now())
        return result

    run.figures = figures
    return run


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
    return {"modality": modality, "encoder_cache_size": int(budget.encoder_cache_size), "tokens_per_item": tokens,
            "capacity_items": int(budget.encoder_cache_size) // tokens,
            "items_per_batch": int(budget.mm_max_items_per_batch[modality])}


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
        batch = next(b for _, _, b in group_and_batch_mm_kwargs([(modality, item)] * count, device=model_runner.device,
                                                                pin_memory=False))
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


def _served_query_length(model_runner: Any, query_len: int):
    """Within the block, V1's attention metadata is built with ``max_query_len`` at most ``query_len`` (this runner
    instance only). Note [A served batch's query length] in ``sizing``."""
    build = model_runner._build_attention_metadata

    def build_as_served(*args, **kwargs):
        if "max_query_len" not in kwargs:
            raise ExtensibleKVUnsupported("this vLLM's _dummy_run passes max_query_len to _build_attention_metadata "
                                          f"positionally (args {len(args)}, keywords {sorted(kwargs)}); the served "
                                          "batch cannot give attention a request's query length")
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
    draft_probs = (torch.softmax(torch.rand(requests * k, logits.shape[-1], device=logits.device,
                                            dtype=torch.float32), dim=-1) if seen["draft_probs"] else None)
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
                hidden, sampled = model_runner._dummy_run(tokens, cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                                          force_attention=True, skip_eplb=True,
                                                          profile_seq_lens=seq_len)
            samples = get_pp_group().is_last_rank and not model_runner.is_pooling_model
        if samples:
            _sampler_run(model_runner, sampled)
        del hidden, sampled, held

    return run


def _determine_available_memory(original: Callable) -> Callable:
    def determine_available_memory(self):
        from vllm import envs

        bind_worker_rpcs(self)
        sleep.bind(self)  # sleep mode releases and recommits the KV pages (sleep.py)
        runner = self.model_runner
        wrapped = profile_run_reserved_peak(runner.profile_run)
        with _on_instance(runner, "profile_run", wrapped):
            available = original(self)
        estimate = getattr(self, "cudagraph_memory_estimate", 0) or 0
        if envs.VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS and self.cache_config.kv_cache_memory_bytes is None:
            available += estimate  # reserve the upper bound; the measured graph memory replaces the estimate
        self._extensible_kv_profile = {"profiled_available": available - estimate, "cudagraph_estimate": estimate,
                                       "reserved_available": available,
                                       "peak_reserved": wrapped.figures.get("peak_reserved"),
                                       "peak_allocated": wrapped.figures.get("peak_allocated"),
                                       "retained": wrapped.figures.get("retained"),
                                       "cache_before": wrapped.figures.get("cache_before")}
        return available

    return determine_available_memory


# Note [An engine keeps its RPCs]
#     ``extensible_kv_cache()`` removes the patches when its block exits, but an engine built inside keeps its
#     extensible KV cache, and ``llm.collective_rpc("extensible_kv_report")`` must keep answering for it. vLLM resolves
#     a string RPC with ``getattr`` on the worker, so the class attributes the patch set adds vanish with it ("Method
#     'extensible_kv_report' is not implemented."). Each worker therefore gets the three RPCs bound on the instance
#     (``bind_worker_rpcs``, in ``determine_available_memory``, which every worker runs before its KV cache exists),
#     and ``extensible_kv_measure`` pins the worker's ``WorkerKV`` on the worker, so a later engine in the same
#     process cannot change what an earlier one reports.
WORKER_RPCS = ("extensible_kv_measure", "extensible_kv_commit", "extensible_kv_report")


def bind_worker_rpcs(worker: object) -> None:
    """Bind the extensible RPCs on this worker instance (Note [An engine keeps its RPCs])."""
    for name in WORKER_RPCS:
        setattr(worker, name, types.MethodType(globals()[name], worker))


def _state_of(worker: object) -> worker_kv.WorkerKV | None:
    """The WorkerKV this worker measured (pinned by ``extensible_kv_measure``), else this process's active one."""
    pinned = getattr(worker, "_extensible_kv_state", None)
    return pinned if pinned is not None else worker_kv.active()


def extensible_kv_measure(self) -> int:
    """RPC: measure memory after warmup; return the blocks every rank can commit (the minimum over ranks).

    The ranks agree among themselves as well as through the engine's minimum over the replies: with the external
    launcher every rank has its own engine, which sees only its own worker's reply (vLLM agrees on the profiled KV
    memory the same way there)."""
    import torch

    state = _worker_kv()
    self._extensible_kv_state = state  # Note [An engine keeps its RPCs]
    # Note [The peak, brought back and measured]: vLLM's profile batch as a served step runs it, then as profiled
    # (the larger batch first: the other then reuses its segments instead of laying out its own). V1's dummy batches
    # of a multimodal model process their dummy item through a cache that serves only profiling (and assert the item
    # is not read back from it); cleared before each run (vLLM's reset_mm_cache), each processes it afresh, as
    # vLLM's own profile did.
    reset_mm_cache = getattr(self.model_runner, "reset_mm_cache", None) or (lambda: None)
    served = profile_run_reserved_peak(served_batch(self.model_runner))
    again = profile_run_reserved_peak(self.model_runner.profile_run)
    with torch.inference_mode():
        reset_mm_cache()
        served()
        reset_mm_cache()
        again()
    fits = state.measure(self, margin=_margin(), again=again.figures, served=served.figures).blocks()
    group = agreement.vllm_cpu_group()
    return agreement.agree_min(fits, group) if group is not None else fits


def extensible_kv_commit(self, num_blocks: int) -> dict:
    """RPC: commit ``num_blocks`` under the same base pointers; tell the runner its new size."""
    state = _state_of(self)
    if state is None or state.buffers is None:
        state = _worker_kv()  # raises, naming the reason
    connector.check_resize(state, num_blocks, "extensible_kv_commit")  # Note [Registered once] in connector
    state.commit(num_blocks)
    connector.register(state)  # a KV connector sees exactly the committed blocks, from now on
    self.model_runner.kv_cache_config.num_blocks = num_blocks
    self.cache_config.num_gpu_blocks = num_blocks
    return extensible_kv_report(self)


def extensible_kv_report(self) -> dict:
    """RPC: what this worker reserved, committed and measured (plain data, for reports)."""
    state = _state_of(self)
    report = state.report() if state is not None else {}
    report["profile"] = getattr(self, "_extensible_kv_profile", None)
    report["runner"] = worker_kv.runner_kind(self.model_runner)
    report["connector"] = connector.report(state)
    return report


# -- engine side ---------------------------------------------------------------------------------------------------
def _initialize_kv_caches(original: Callable) -> Callable:
    def _initialize_kv_caches(self, vllm_config):
        from vllm.platforms import current_platform
        from vllm.v1.engine import core

        check_supported(vllm_config, current_platform)
        config = original(self, vllm_config)  # sizes the reservation, allocates, warms up, captures graphs
        reserved = config.num_blocks
        fits = self.model_executor.collective_rpc("extensible_kv_measure")
        final = min(min(fits), reserved)
        reports = self.model_executor.collective_rpc("extensible_kv_commit", args=(final,))
        # The scheduler (and its side of a KV connector, which sizes e.g. its CPU tier from the bytes per block)
        # is built from this config: the legacy configuration of ``final`` blocks, tensor sizes included.
        connector.tell_committed_count(config, final)
        vllm_config.cache_config.num_gpu_blocks = final
        if config.kv_cache_groups:
            tokens, concurrency = core.get_kv_cache_capacity(vllm_config, config)
            vllm_config.cache_config.kv_cache_size_tokens = tokens
            vllm_config.cache_config.kv_cache_max_concurrency = concurrency
            block = min(g.kv_cache_spec.block_size for g in config.kv_cache_groups)
            if tokens < vllm_config.model_config.max_model_len:
                raise ExtensibleKVUnsupported(
                    f"after warmup only {final} KV blocks ({tokens} tokens of block size {block}) fit, fewer than "
                    f"max_model_len={vllm_config.model_config.max_model_len}; lower max_model_len or raise "
                    f"gpu_memory_utilization")
        self._extensible_kv_reports = {"reserved_blocks": reserved, "worker_fits": fits, "final_blocks": final,
                                       "workers": reports}
        logger.info("extensible KV cache: %d blocks reserved, %d committed (per-worker fit %s)", reserved, final,
                    fits)
        return config

    return _initialize_kv_caches


# -- install / remove ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Patch:
    module: str
    owner: str | None  # a class in the module, or None for a module-level function
    attr: str
    make: Callable[[Callable | None], Callable]


PATCHES = (
    _Patch("vllm.v1.engine.core", "EngineCore", "_initialize_kv_caches", _initialize_kv_caches),
    _Patch("vllm.v1.worker.gpu_worker", "Worker", "determine_available_memory", _determine_available_memory),
    _Patch("vllm.v1.worker.gpu_worker", None, "warmup_kernels", _warmup_kernels),
    _Patch("vllm.v1.worker.gpu_worker", "Worker", "extensible_kv_measure", lambda _: extensible_kv_measure),
    _Patch("vllm.v1.worker.gpu_worker", "Worker", "extensible_kv_commit", lambda _: extensible_kv_commit),
    _Patch("vllm.v1.worker.gpu_worker", "Worker", "extensible_kv_report", lambda _: extensible_kv_report),
    _Patch("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "initialize_kv_cache_tensors",
           _v1_initialize_kv_cache_tensors),
    _Patch("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_allocate_kv_cache_tensors",
           _v1_allocate_kv_cache_tensors),
    _Patch("vllm.v1.worker.gpu.model_runner", None, "init_kv_cache", _v2_init_kv_cache),
    _Patch("vllm.v1.worker.gpu.attn_utils", None, "_allocate_kv_cache", _v2_allocate_kv_cache),
)

_SAVED: dict[tuple[str, str | None, str], Any] = {}
_MISSING = object()


def install() -> None:
    """Install every patch (idempotent). Raises ImportError naming the module if vLLM's layout changed."""
    if _SAVED:
        return
    targets = []
    for p in PATCHES:
        module = importlib.import_module(p.module)
        owner = getattr(module, p.owner) if p.owner else module
        targets.append((p, owner, owner.__dict__.get(p.attr, _MISSING) if p.owner else getattr(module, p.attr,
                                                                                              _MISSING)))
    for p, owner, original in targets:
        if original is _MISSING and not p.attr.startswith("extensible_kv_"):
            raise ImportError(f"vLLM has no {p.module}.{p.owner + '.' if p.owner else ''}{p.attr}; this patch set "
                              f"targets vllm 0.26.0")
    for p, owner, original in targets:
        _SAVED[(p.module, p.owner, p.attr)] = original
        setattr(owner, p.attr, p.make(None if original is _MISSING else original))


def uninstall() -> None:
    """Restore every patched attribute (idempotent)."""
    for (module_name, owner_name, attr), original in list(_SAVED.items()):
        module = importlib.import_module(module_name)
        owner = getattr(module, owner_name) if owner_name else module
        if original is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)
        del _SAVED[(module_name, owner_name, attr)]


def installed() -> bool:
    return bool(_SAVED)
