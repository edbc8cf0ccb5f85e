"""The worker side of the extensible KV cache: reserve, commit a prefix, measure, commit the final size.

One ``WorkerKV`` per worker process (``active()``). It is created when the model runner initializes its KV cache:

1. ``prepare`` runs vLLM's own reshape of the KV cache on ``meta`` tensors whose block count is a sentinel, and
   derives every buffer's lockstep segments from the final per-layer views (``extensible_kv.layout.segments_of``):
   whatever vLLM does to the layout (stride orders, hybrid re-stride, Mamba pages) is what the segments follow.
2. ``allocate`` replaces vLLM's ``torch.zeros(size, int8)`` per ``KVCacheTensor`` with an ExtensibleTensor of the
   same size and commits block 0 (the null block, the only block profiling and graph capture touch). vLLM then
   reshapes these raw tensors itself; their addresses never change.
3. ``ensure_blocks`` commits more blocks (V2 warmup writes real block ids 1..n first).
4. ``measure`` (after warmup and capture) computes how many blocks fit (``sizing.MemoryState``); ``commit`` commits
   them under the same base pointers.
5. ``hold_torch_to_budget`` caps torch's caching allocator at what the budget leaves it (``sizing.torch_cap``), its
   new segments expandable so that the cap frees pages, not only whole segments.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..drivers import Driver
from ..errors import ExtensibleKVError, InvalidSizeError
from ..kv_cache import ExtensibleKVCacheBuffers, KVBuffer
from ..layout import BLOCK_SENTINEL, agreed_segments, block_dim
from .sizing import MemoryState, reusable_cache, torch_cap

logger = logging.getLogger("extensible_kv.vllm")


class ExtensibleKVUnsupported(ExtensibleKVError, RuntimeError):
    """This vLLM configuration cannot use the extensible KV cache; the message says why."""


def _views(value: torch.Tensor | Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """(view, block dim) pairs of one layer's KV cache value: a tensor (attention) or a list (Mamba states)."""
    if isinstance(value, torch.Tensor):
        return [(value, block_dim(value.shape, "attention view"))]
    return [(v, 0) for v in value]


def derive_segments(kv_cache_config: Any, reshape: Callable[[dict[str, torch.Tensor]], dict[str, Any]]) -> list[int]:
    """Segments of each ``KVCacheTensor``, from vLLM's own reshape applied to ``meta`` tensors."""
    num_blocks = kv_cache_config.num_blocks
    raw: dict[str, torch.Tensor] = {}
    pages = []
    for tensor in kv_cache_config.kv_cache_tensors:
        if getattr(tensor, "block_stride", 0):
            raise ExtensibleKVUnsupported(
                "packed KV cache layouts (KVCacheTensor.block_stride > 0, cross-layer "
                "blocks) are not supported by the extensible KV cache"
            )
        if tensor.size % num_blocks:
            raise ExtensibleKVUnsupported(
                f"KVCacheTensor of {tensor.size} bytes is not a whole number of {num_blocks} blocks"
            )
        page = tensor.size // num_blocks
        pages.append(page)
        meta = torch.empty(page * BLOCK_SENTINEL, dtype=torch.int8, device="meta")
        for name in tensor.shared_by:
            raw[name] = meta
    views = reshape(raw)
    counts = []
    for tensor, page in zip(kv_cache_config.kv_cache_tensors, pages):
        seg = agreed_segments(
            ((name, view, dim) for name in tensor.shared_by if name in views for view, dim in _views(views[name])),
            page * BLOCK_SENTINEL,
        )
        counts.append(seg.count if seg else 1)
    return counts


@dataclass
class WorkerKV:
    """A worker's extensible KV cache and what it measured (see the module docstring)."""

    driver: Driver | str | None
    segments: list[int] = field(default_factory=list)
    buffers: ExtensibleKVCacheBuffers | None = None
    layer_buffer: dict[str, str] = field(default_factory=dict)
    measured: MemoryState | None = None
    commit_seconds: float | None = None
    events: list[dict] = field(default_factory=list)
    torch_cap: dict | None = None  # what ``hold_torch_to_budget`` read and set

    def allocate(self, kv_cache_config: Any) -> dict[str, torch.Tensor]:
        """Raw int8 tensors per layer, at the full reserved size, with block 0 committed."""
        if not self.segments:
            raise ExtensibleKVError("allocate before prepare: the segments were not derived")
        n = kv_cache_config.num_blocks
        specs = []
        for i, (tensor, segs) in enumerate(zip(kv_cache_config.kv_cache_tensors, self.segments)):
            specs.append(KVBuffer(f"kv{i}", tensor.size // n, num_segments=segs))
            for name in tensor.shared_by:
                self.layer_buffer[name] = f"kv{i}"
        if self.buffers is not None:
            self.buffers.close()
        self.buffers = ExtensibleKVCacheBuffers(specs, n, driver=self.driver)
        self.ensure_blocks(1, reason="null block")
        return {name: self.buffers.raw(buf) for name, buf in self.layer_buffer.items()}

    def ensure_blocks(self, num_blocks: int, reason: str) -> int:
        if self.buffers is None:
            raise ExtensibleKVError("ensure_blocks before allocate")
        before = self.buffers.num_blocks
        try:  # the buffers refuse a count past the reservation before committing anything: one place checks it
            got = self.buffers.ensure_blocks(num_blocks)
        except InvalidSizeError as exc:
            raise InvalidSizeError(f"{reason}: {exc}") from exc
        if got > before:
            self.events.append({"event": "ensure_blocks", "reason": reason, "from": before, "to": got})
        return got

    def measure(self, worker: Any, again: Mapping[str, int], served: Mapping[str, int], margin: int = 0) -> MemoryState:
        """Measure memory after warmup on ``worker`` (a vLLM GPU worker) and size the final commit. ``again`` and
        ``served``: the figures (``probes.profile_run_reserved_peak``: ``peak_reserved`` and ``retained``; for
        ``served`` also ``peak_allocated`` and ``cache_after``) of vLLM's profile run, run again just before, and of
        the same batch with attention (``probes.served_batch``), run before that. Note [The peak, brought back and
        measured] in ``sizing``."""
        assert self.buffers is not None
        torch.cuda.synchronize()
        free_now, _ = torch.cuda.mem_get_info()
        stats = self.buffers.stats()
        g = stats.granularity
        self.measured = MemoryState(
            init_free=int(worker.init_snapshot.free_memory),
            requested=int(worker.requested_memory),
            free_now=int(free_now),
            kv_backed=stats.backed_bytes,
            weights=int(worker.model_runner.model_memory_usage),
            profiled_peak=int(getattr(worker, "peak_activation_memory", 0)),
            bytes_per_block=sum(b.page_size_bytes for b in stats.buffers),
            rounding_bound=sum(b.num_segments * g for b in stats.buffers),
            capacity_blocks=stats.max_num_blocks,
            committed_blocks=stats.num_blocks,
            again_reserved=int(again["peak_reserved"]),
            again_retained=int(again["retained"]),
            served_reserved=int(served["peak_reserved"]),
            served_retained=int(served["retained"]),
            margin=margin,
            served_allocated=int(served["peak_allocated"]),
            cache_after=int(served["cache_after"]),
        )
        return self.measured

    def commit(self, num_blocks: int) -> float:
        """Commit the final block count; return the seconds it took (device synchronized)."""
        assert self.buffers is not None
        torch.cuda.synchronize()
        start = time.perf_counter()
        self.ensure_blocks(num_blocks, reason="final size")
        torch.cuda.synchronize()
        self.commit_seconds = time.perf_counter() - start
        stats = self.buffers.stats()
        logger.info(
            "extensible KV cache: committed %d of %d reserved blocks (%.2f GiB) in %.1f ms",
            num_blocks,
            stats.max_num_blocks,
            stats.committed_bytes / 2**30,
            self.commit_seconds * 1e3,
        )
        return self.commit_seconds

    def hold_torch_to_budget(self) -> int | None:
        """Hold torch's caching allocator on this device to ``sizing.torch_cap`` of what this worker measured and
        reads now (after the final commit), as a soft cap: new segments become expandable (torch maps their pages
        as they grow; emptying its cache unmaps every free page, wherever it lies, not only whole free segments),
        the cache the worst batches left is emptied now, and after every step that ends with torch's reserve past
        the cap ``trim_torch_cache`` empties it again. Nothing is refused: a step that needs more than the cap gets
        it. Return the cap in bytes; None before ``measure`` (nothing sized, no cap). Where torch's allocator refuses
        the setting or the readings do not add up, the engine stays as it was (the cap of an earlier hold, else
        uncapped; the setting and ``PYTORCH_CUDA_ALLOC_CONF`` put back), the reason in ``torch_cap["error"]``,
        logged; that earlier cap is returned, or None. Note [Torch's cache, held to the budget] in ``sizing``."""
        if self.measured is None:
            return None
        torch.cuda.synchronize()
        earlier = dict(self.torch_cap or {})  # a commit after a commit: the cap and the trims so far still count
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        on_before = "expandable" in earlier or users_expandable_segments()  # by a hold or by the user
        try:  # an allocator without the setting leaves the engine as it was, the reason recorded
            _allocator_settings("expandable_segments:True")
        except (RuntimeError, ValueError, AttributeError) as exc:
            self._not_held(earlier, {}, exc)
            return earlier.get("cap")
        _tell_vllm_segments_are_expandable()
        readings: dict = {}
        try:  # readings that fail or do not add up leave the engine as it was, the reason recorded
            torch.cuda.empty_cache()
            free, total = (int(v) for v in torch.cuda.mem_get_info())
            used = self.measured.init_free - free
            reserved = int(torch.cuda.memory_reserved())
            readings = {"used": used, "reserved": reserved, "total": total}
            cap = torch_cap(self.measured, used, reserved)
        except (ExtensibleKVError, RuntimeError, ValueError, TypeError) as exc:
            _undo_expandable(conf, turn_off=not on_before)
            self._not_held(earlier, readings, exc)
            return earlier.get("cap")
        self.torch_cap = {
            "cap": cap,
            **readings,
            "expandable": True,
            "trims": int(earlier.get("trims", 0)),
            "highest_before_trim": max(reserved, int(earlier.get("highest_before_trim", 0))),
        }
        logger.info(
            "extensible KV cache: torch's cache held to %.1f MiB (%.1f MiB reserved now)", cap / 2**20, reserved / 2**20
        )
        return cap

    def trim_torch_cache(self) -> bool:
        """After a step: where torch's reserve ended past the cap ``hold_torch_to_budget`` set, empty its cache (its
        free pages unmapped) and count it in ``torch_cap["trims"]``. True where it trimmed; False with no cap or
        within it (one counter read, no synchronization) or where the trim failed (``torch_cap["trim_error"]``,
        logged once: it raises nothing into the step)."""
        held = self.torch_cap
        if held is None or held.get("cap") is None:
            return False
        try:
            reserved = trim_to(held["cap"])
        except Exception as exc:  # the step's outcome stands; a device error shows again at its next call
            if "trim_error" not in held:
                logger.warning("extensible KV cache: trimming torch's cache failed (%s)", exc)
            held["trim_error"] = f"{type(exc).__name__}: {exc}"
            return False
        if reserved is None:
            return False
        held["trims"] += 1
        held["highest_before_trim"] = max(held["highest_before_trim"], reserved)
        return True

    def _not_held(self, earlier: dict, readings: dict, exc: BaseException) -> None:
        """A hold that could not be made: the cap, trims and setting of an earlier hold stay (the engine keeps the
        cap it had, or stays uncapped), the readings and the reason recorded."""
        kept = {k: earlier[k] for k in ("cap", "expandable", "trims", "highest_before_trim") if k in earlier}
        self.torch_cap = {**readings, **kept, "error": f"{type(exc).__name__}: {exc}"}
        held = "keeps the cap it had" if "cap" in kept else "runs uncapped"
        logger.warning("extensible KV cache: torch's cache not capped (%s); the engine %s", exc, held)

    def report(self) -> dict:
        stats = self.buffers.stats() if self.buffers is not None else None
        return {
            "segments": self.segments,
            "kv": stats.to_dict() if stats else None,
            "measured": self.measured.to_dict() if self.measured else None,
            "commit_seconds": self.commit_seconds,
            "torch_cap": self.torch_cap,
            "events": self.events,
        }


def trim_to(cap: int) -> int | None:
    """Empty torch's cache on this device where its reserve is past ``cap`` bytes: return the reserve it had, or
    None where it was within (one counter read)."""
    reserved = int(torch.cuda.memory_reserved())
    if reserved <= cap:
        return None
    torch.cuda.empty_cache()
    return reserved


def _allocator_settings(settings: str) -> None:
    """torch's caching allocator settings, at run time (``PYTORCH_CUDA_ALLOC_CONF``'s syntax)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch releases before the accelerator API
        setter = torch.cuda.memory._set_allocator_settings
    setter(settings)


ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch reads one: which, by release


def users_expandable_segments() -> bool:
    """Whether the user's allocator variables turn expandable segments on, as torch reads them: ``key:value``
    pairs split at commas, blanks ignored, the value ``True`` or ``true``."""
    for name in ALLOC_CONF_VARIABLES:
        for pair in os.environ.get(name, "").split(","):
            key, _, value = (part.strip() for part in pair.partition(":"))
            if key == "expandable_segments" and value in ("True", "true"):
                return True
    return False


def _undo_expandable(conf: str | None, *, turn_off: bool) -> None:
    """Put back what ``hold_torch_to_budget`` changed before readings that did not add up: the allocator's setting
    where this hold turned it on (``turn_off``: neither an earlier hold nor the user's allocator variables had,
    ``users_expandable_segments``), and ``PYTORCH_CUDA_ALLOC_CONF`` as it was."""
    if turn_off:
        try:
            _allocator_settings("expandable_segments:False")
        except (RuntimeError, ValueError, AttributeError):  # it took the setting a moment ago
            logger.warning("extensible KV cache: could not turn expandable segments off again")
    if conf is None:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    else:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf


def _tell_vllm_segments_are_expandable() -> None:
    """vLLM's sleep-mode pool (``CuMemAllocator.use_memory_pool``) turns expandable segments off around itself, the
    two being incompatible, only where ``PYTORCH_CUDA_ALLOC_CONF`` says they are on: say so once they are. The
    setting and the variable stay for the process: a later engine built in it runs with expandable segments, and
    vLLM refuses one with a KV connector there unless its cumem allocator is on (its own rule for the setting)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments:True" not in conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, (conf, "expandable_segments:True")))


_ACTIVE: WorkerKV | None = None


def active() -> WorkerKV | None:
    """This process's WorkerKV, once a model runner built one."""
    return _ACTIVE


def runner_kind(model_runner: object) -> str:
    """ "v2" for vLLM's V2 model runner (``vllm.v1.worker.gpu.*``), "v1" for the V1 one."""
    return "v2" if type(model_runner).__module__.startswith("vllm.v1.worker.gpu.") else "v1"


def torch_reusable_now() -> int:
    """Bytes of torch's default pool on the current device held unused now (``sizing.reusable_cache``)."""
    return reusable_cache(torch.cuda.memory_snapshot(), torch.cuda.current_device())


def start(driver: Driver | str | None) -> WorkerKV:
    global _ACTIVE
    _ACTIVE = WorkerKV(driver)
    return _ACTIVE
