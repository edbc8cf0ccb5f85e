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
``EngineCore.collective_rpc`` answers the resize names (``resize.ENGINE_METHODS``) on the engine core: the
scheduler's pool and every worker move to the new block count, under the same addresses (``resize``).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..drivers import Driver
from ..errors import DriverUnavailable
from . import agreement, connector, resize, sleep, worker_kv
from .probes import _on_instance, limits_of, profile_run_reserved_peak, worst_batch_runs
from .sizing import served_step_bound
from .worker_kv import ExtensibleKVUnsupported
from .worst_batch import derive

logger = logging.getLogger("extensible_kv.vllm")

MARGIN_ENV = "EXTENSIBLE_KV_CACHE_MARGIN_BYTES"


def check_supported(vllm_config: Any, platform: Any) -> None:
    """Raise ExtensibleKVUnsupported, naming the reason, for configurations the extensible path refuses."""
    reasons = connector.unsupported_reasons(vllm_config)  # a KV connector is registered after the final commit
    if not platform.is_cuda_alike():
        reasons.append(f"platform {getattr(platform, 'device_name', type(platform).__name__)} is neither CUDA nor ROCm")
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
        raise ExtensibleKVUnsupported(
            "the extensible KV cache is enabled but this worker built no extensible "
            "buffers (was it enabled before the engine started?)"
        )
    return state


def _platform_driver() -> Driver:
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
            kv_cache_config, lambda raw: self._reshape_kv_cache_tensors(raw, kernel_block_sizes)
        )
        connector.defer(state)  # register_kv_caches waits for the final commit (connector.py)
        return original(self, kv_cache_config, kernel_block_sizes)

    return initialize_kv_cache_tensors


def _v1_allocate_kv_cache_tensors(original: Callable) -> Callable:
    def _allocate_kv_cache_tensors(self, kv_cache_config):
        with sleep.nothing_in_pool("the extensible KV allocation"):  # Note [Nothing of ours in vLLM's pool]
            return worker_kv.active().allocate(kv_cache_config)  # type: ignore[union-attr]  # started by the init patch

    return _allocate_kv_cache_tensors


def _v2_init_kv_cache(original: Callable) -> Callable:
    def init_kv_cache(
        runner_kv_caches,
        forward_context,
        kv_cache_config,
        attn_groups,
        device,
        cache_dtype,
        kernel_block_sizes,
        vllm_config,
    ):
        from vllm.platforms import current_platform
        from vllm.v1.worker.gpu import attn_utils

        check_supported(vllm_config, current_platform)
        shared = attn_utils.get_shared_kv_cache_layers(vllm_config)
        flat = [g for groups in attn_groups for g in groups]
        state = worker_kv.start(_platform_driver())
        state.segments = worker_kv.derive_segments(
            kv_cache_config,
            lambda raw: attn_utils._reshape_kv_cache(
                attn_groups=flat,
                kv_cache_raw_tensors=raw,
                kernel_block_sizes=kernel_block_sizes,
                cache_dtype=cache_dtype,
                shared_kv_cache_layers=shared,
                kv_cache_config=kv_cache_config,
            ),
        )
        connector.defer(state)  # register_kv_caches waits for the final commit (connector.py)
        return original(
            runner_kv_caches,
            forward_context,
            kv_cache_config,
            attn_groups,
            device,
            cache_dtype,
            kernel_block_sizes,
            vllm_config,
        )

    return init_kv_cache


def _v2_allocate_kv_cache(original: Callable) -> Callable:
    def _allocate_kv_cache(kv_cache_config, shared_kv_cache_layers, device):
        with sleep.nothing_in_pool("the extensible KV allocation"):  # Note [Nothing of ours in vLLM's pool]
            raw = worker_kv.active().allocate(kv_cache_config)  # type: ignore[union-attr]  # started by the init patch
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


def _determine_available_memory(original: Callable) -> Callable:
    def determine_available_memory(self):
        from vllm import envs

        bind_worker_rpcs(self)
        sleep.bind(self)  # sleep mode releases and recommits the KV pages (sleep.py)
        runner = self.model_runner
        wrapped = profile_run_reserved_peak(runner.profile_run)
        # Note [No CUDA graph estimate on the extensible path] in sizing: the measured graph memory replaces it.
        with _on_instance(runner, "profile_run", wrapped), _on_instance(runner, "profile_cudagraph_memory", lambda: 0):
            available = original(self)
        estimate = getattr(self, "cudagraph_memory_estimate", 0) or 0
        if envs.VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS and self.cache_config.kv_cache_memory_bytes is None:
            available += estimate  # reserve the upper bound; the measured graph memory replaces the estimate
        self._extensible_kv_profile = {
            "profiled_available": available - estimate,
            "cudagraph_estimate": estimate,
            "reserved_available": available,
            "peak_reserved": wrapped.figures.get("peak_reserved"),
            "peak_allocated": wrapped.figures.get("peak_allocated"),
            "retained": wrapped.figures.get("retained"),
            "cache_before": wrapped.figures.get("cache_before"),
        }
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
def bind_worker_rpcs(worker: object) -> None:
    """Bind the extensible RPCs (``WORKER_RPCS``, after them) on this worker instance (Note [An engine keeps its
    RPCs]), and wrap the steps of its model runner (``execute_model``, then ``sample_tokens`` or ``pool`` where vLLM
    splits a step in two) to trim torch's cache after each (``_trimming``). The runner's, not the worker's: every
    executor reaches the runner, Ray's without the worker's methods."""
    for name, function in WORKER_RPCS.items():
        setattr(worker, name, types.MethodType(function, worker))
    owner = getattr(worker, "model_runner", None) or worker
    for name in STEP_METHODS:
        step = getattr(owner, name, None)
        if step is not None and not getattr(step, "_extensible_kv_trims", False):
            setattr(owner, name, _trimming(worker, step))


# A step of vLLM 0.26.0's model runners: one call, or two (``sample_tokens`` for generation, ``pool`` for pooling)
STEP_METHODS = ("execute_model", "sample_tokens", "pool")


def _trimming(worker: object, step: Callable) -> Callable:
    """``step`` (a bound step method), then the soft cap on torch's cache (Note [Torch's cache, held to the budget]
    in sizing), raised or not; what the step returned or raised is what the caller gets (``trim_torch_cache``
    raises nothing). Bound on the instance, so it outlives the patch set like the RPCs."""

    def trimmed(*args, **kwargs):
        try:
            return step(*args, **kwargs)
        finally:
            state = _state_of(worker)
            if state is not None:
                state.trim_torch_cache()

    trimmed.__name__ = getattr(step, "__name__", "step")
    trimmed._extensible_kv_trims = True  # type: ignore[attr-defined]
    return trimmed


def _state_of(worker: object) -> worker_kv.WorkerKV | None:
    """The WorkerKV this worker measured (pinned by ``extensible_kv_measure``), else this process's active one."""
    pinned = getattr(worker, "_extensible_kv_state", None)
    return pinned if pinned is not None else worker_kv.active()


def extensible_kv_measure(self: Any) -> int:
    """RPC: measure memory after warmup; return the blocks every rank can commit (the minimum over ranks).

    The ranks agree among themselves as well as through the engine's minimum over the replies: with the external
    launcher every rank has its own engine, which sees only its own worker's reply (vLLM agrees on the profiled KV
    memory the same way there)."""
    state = _worker_kv()
    self._extensible_kv_state = state  # Note [An engine keeps its RPCs]
    # Note [The worst batch, brought back and measured] in sizing: every worst batch of this engine's limits
    # (worst_batch.derive) runs after warmup, in sequence, from an emptied torch cache. V1's dummy batches of a
    # multimodal model process their dummy item through a cache that serves only profiling (and assert the item is
    # not read back from it); cleared before each batch (vLLM's reset_mm_cache), each processes it afresh.
    reset_mm_cache = getattr(self.model_runner, "reset_mm_cache", None) or (lambda: None)
    plan = derive(limits_of(self.model_runner))
    worst = worst_batch_runs(self.model_runner, plan, reset=reset_mm_cache)
    # The sequence's figures stand for both runs MemoryState names; vLLM's profile batch is not run again.
    measured = state.measure(self, margin=_margin(), again=worst, served=worst)
    async_scheduling = bool(getattr(self.model_runner.vllm_config.scheduler_config, "async_scheduling", False))
    state.measured = dataclasses.replace(
        measured,
        worst_batches=tuple(worst["batches"]),
        bounded_batches=tuple(worst["bounded"]),
        served_step=served_step_bound(async_scheduling),  # Note [What a served step adds after the worst batches]
    )
    fits = state.measured.blocks()
    group = agreement.vllm_cpu_group()
    return agreement.agree_min(fits, group) if group is not None else fits


def extensible_kv_commit(self: Any, num_blocks: int) -> dict:
    """RPC: commit ``num_blocks`` under the same base pointers; tell the runner its new size."""
    state = _state_of(self)
    if state is None or state.buffers is None:
        state = _worker_kv()  # raises, naming the reason
    connector.check_resize(state, num_blocks, "extensible_kv_commit")  # Note [Registered once] in connector
    state.commit(num_blocks)
    state.hold_torch_to_budget()  # Note [Torch's cache, held to the budget] in sizing
    connector.register(state)  # a KV connector sees exactly the committed blocks, from now on
    self.model_runner.kv_cache_config.num_blocks = num_blocks
    self.cache_config.num_gpu_blocks = num_blocks
    return extensible_kv_report(self)


def extensible_kv_report(self: Any) -> dict:
    """RPC: what this worker reserved, committed and measured (plain data, for reports)."""
    state = _state_of(self)
    report = state.report() if state is not None else {}
    report["profile"] = getattr(self, "_extensible_kv_profile", None)
    report["runner"] = worker_kv.runner_kind(self.model_runner)
    report["connector"] = connector.report(state)
    return report


WORKER_RPCS: dict[str, Callable[..., Any]] = {
    "extensible_kv_measure": extensible_kv_measure,
    "extensible_kv_commit": extensible_kv_commit,
    "extensible_kv_report": extensible_kv_report,
    **resize.WORKER_RPCS,  # resizing a running engine (resize.py)
}
"""The RPCs every worker gets, by the name vLLM's ``collective_rpc`` looks up (Note [An engine keeps its RPCs])."""


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
                    f"gpu_memory_utilization"
                )
        self._extensible_kv_reports = {
            "reserved_blocks": reserved,
            "worker_fits": fits,
            "final_blocks": final,
            "workers": reports,
        }
        resize.bind_engine(self)  # resizing answers on this engine after the patches are removed
        logger.info("extensible KV cache: %d blocks reserved, %d committed (per-worker fit %s)", reserved, final, fits)
        return config

    return _initialize_kv_caches


# -- install / remove ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Patch:
    module: str
    owner: str | None  # a class in the module, or None for a module-level function
    attr: str
    make: Callable[[Any], Callable]  # given the original attribute (None for an RPC this patch set adds)


def _as_is(function: Callable) -> Callable[[Any], Callable]:
    """The ``make`` of a patch that sets ``function`` itself (an RPC this patch set adds: no original to wrap)."""
    return lambda _: function


PATCHES = (
    _Patch("vllm.v1.engine.core", "EngineCore", "_initialize_kv_caches", _initialize_kv_caches),
    _Patch("vllm.v1.worker.gpu_worker", "Worker", "determine_available_memory", _determine_available_memory),
    _Patch("vllm.v1.worker.gpu_worker", None, "warmup_kernels", _warmup_kernels),
    _Patch("vllm.v1.worker.gpu_worker", "Worker", "extensible_kv_measure", lambda _: extensible_kv_measure),
    _Patch("vllm.v1.worker.gpu_worker", "Worker", "extensible_kv_commit", lambda _: extensible_kv_commit),
    _Patch("vllm.v1.worker.gpu_worker", "Worker", "extensible_kv_report", lambda _: extensible_kv_report),
    _Patch("vllm.v1.engine.core", "EngineCore", "collective_rpc", resize.engine_collective_rpc),
    *(_Patch("vllm.v1.worker.gpu_worker", "Worker", name, _as_is(f)) for name, f in resize.WORKER_RPCS.items()),
    _Patch(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner",
        "initialize_kv_cache_tensors",
        _v1_initialize_kv_cache_tensors,
    ),
    _Patch(
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_allocate_kv_cache_tensors", _v1_allocate_kv_cache_tensors
    ),
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
        targets.append(
            (p, owner, owner.__dict__.get(p.attr, _MISSING) if p.owner else getattr(module, p.attr, _MISSING))
        )
    for p, _owner, original in targets:
        if original is _MISSING and not p.attr.startswith("extensible_kv_"):
            raise ImportError(
                f"vLLM has no {p.module}.{p.owner + '.' if p.owner else ''}{p.attr}; this patch set targets vllm 0.26.0"
            )
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
