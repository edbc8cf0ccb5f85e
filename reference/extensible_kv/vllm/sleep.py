"""Sleep mode on the extensible path: ``sleep`` releases the KV pages, ``wake_up`` recommits them at the same
addresses.

Note [Sleep mode on the extensible path]
    With ``enable_sleep_mode=True`` vLLM 0.26.0 allocates the weights and the KV cache inside its CuMem allocator's
    pool (``Worker._maybe_get_memory_pool_context``, tags ``weights`` and ``kv_cache``). On ``sleep(level)`` the
    worker's sleep-mode backend (``Worker._get_sleep_mode_backend()``, ``CuMemBackend`` by default) copies the
    ``weights`` allocations to the host (level 1) or drops them (level 2) and unmaps the whole pool; on
    ``wake_up(tags)`` it maps the allocations of those tags again. The extensible KV cache is not in that pool: its
    pages come from this package's driver (cuMem/hipMem calls, no torch allocation), so vLLM's allocator never sees
    or frees them. ``bind`` therefore wraps each worker's backend in ``KVSleepBackend``: ``suspend(level)`` releases
    the KV pages (``release_physical``: the reservation, the addresses and the committed block count stay on
    record), then hands over to vLLM's backend; ``resume(tags)`` first recommits (``recommit_physical``: zeroed
    pages, the same committed size, the same addresses) when ``tags`` is ``None`` or names ``kv_cache``, then hands
    over. A recommit is all-or-nothing, and it runs before vLLM's backend maps anything back, so a failed one leaves
    the KV released and nothing of vLLM's half woken: ``wake_up(tags=["kv_cache"])`` can simply be called again.
    ``wake_up(tags=["weights"])`` leaves the KV released until a later ``wake_up`` that names ``kv_cache``. Captured
    CUDA graphs hold the unchanged addresses, so nothing is recaptured. The engine resets the prefix cache itself on
    ``sleep(level >= 1)`` (``EngineCore.pause_scheduler(clear_cache=True)``), before any worker sleeps; no cached
    block could survive the zeroed recommit anyway.

Note [Nothing of ours in vLLM's pool]
    vLLM runs ``initialize_kv_cache`` inside ``use_memory_pool(tag="kv_cache")``: every torch allocation there lands
    in the CuMem pool, is unmapped on sleep and mapped again, with undefined contents, on wake. The extensible
    allocation runs in that context too (it replaces vLLM's ``torch.zeros``), but makes no torch allocation: it
    reserves and maps through the driver and hands out views over those addresses. ``nothing_in_pool`` checks that
    around the allocation, so a change that made one (a temporary buffer for zeroing, say) is refused at start-up
    instead of being freed under the KV cache at the first sleep. The final commit (the ``extensible_kv_commit``
    RPC, after warmup) and the recommit on wake run outside any pool context.

Note [V1 zeroes the whole KV cache on wake]
    V1's ``post_kv_cache_wake_up`` (``init_fp8_kv_scales``) zeroes every tensor of ``model_runner.kv_caches`` when
    the KV cache is quantized (fp8): CuMem maps pages with undefined contents. On the extensible path those tensors
    span the whole reservation, committed or not, and writing past the committed blocks is an illegal address. The
    recommit has just zeroed every committed page, so ``bind`` gives the V1 runner a ``post_kv_cache_wake_up`` that
    runs vLLM's own with ``kv_caches`` empty: the scales are still reset, nothing is written twice. V2's resets its
    block-table layout tensors only and is left alone.

Everything is bound on the worker and runner instances (as the RPCs are, Note [An engine keeps its RPCs] in
``patches``), so an engine built inside ``extensible_kv_cache()`` keeps it after the block exits.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, cast

from ..errors import InvalidArgumentError, InvalidSizeError
from . import worker_kv
from .worker_kv import ExtensibleKVUnsupported

logger = logging.getLogger("extensible_kv.vllm")

KV_TAG = "kv_cache"
LEVELS = (1, 2)
_CUMEM_MODULE = "vllm.device_allocator.cumem"


def check_level(level: object) -> int:
    """A worker's sleep level: 1 (weights to the host) or 2 (weights dropped); anything else is refused."""
    if isinstance(level, bool) or not isinstance(level, int):
        raise InvalidArgumentError(f"sleep level must be an int, got {type(level).__name__} {level!r}")
    if level not in LEVELS:
        raise InvalidSizeError(
            f"sleep level {level} is out of range: a worker sleeps at level 1 or 2 (level 0, "
            f"pausing the scheduler, never reaches a worker)"
        )
    return level


def wakes_kv(tags: object) -> bool:
    """Whether ``wake_up(tags)`` brings the KV cache back: ``None`` (everything) or a list naming ``kv_cache``."""
    if tags is None:
        return True
    try:
        names = None if isinstance(tags, (str, bytes)) else list(cast(Iterable[object], tags))
    except TypeError:  # not iterable
        names = None
    if names is None or not all(isinstance(t, str) for t in names):
        raise InvalidArgumentError(
            f"wake_up tags must be None or a list of tag names such as ['kv_cache'], got {type(tags).__name__} {tags!r}"
        )
    return KV_TAG in names


def _kv_state(worker: object) -> worker_kv.WorkerKV | None:
    """The WorkerKV this worker measured (pinned by ``extensible_kv_measure``), else this process's active one."""
    pinned = getattr(worker, "_extensible_kv_state", None)
    return pinned if pinned is not None else worker_kv.active()


def _vllm_backend(worker: Any) -> Any:
    """vLLM's own sleep-mode backend for this worker, made as ``Worker._get_sleep_mode_backend`` makes it."""
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    return SleepModeBackendFactory.create_backend(worker.vllm_config.model_config)


class KVSleepBackend:
    """A worker's sleep-mode backend: vLLM's own (``inner``) plus the extensible KV pages (Note [Sleep mode on the
    extensible path]). Everything else (``state()``, the capability flags) is the inner backend's."""

    def __init__(self, worker: object, inner: object | None = None) -> None:
        self._worker = worker
        self._inner = inner

    @property
    def inner(self) -> Any:
        """vLLM's backend, made on first use as vLLM would."""
        if self._inner is None:
            self._inner = _vllm_backend(self._worker)
        return self._inner

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "inner":  # never recurse through a half-made backend
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _buffers(self) -> Any:
        state = _kv_state(self._worker)
        return None if state is None else state.buffers

    def _record(self, event: str, **fields: object) -> None:
        state = _kv_state(self._worker)
        if state is not None:
            state.events.append({"event": event, **fields})

    def suspend(self, level: int = 1) -> None:
        """Release the KV pages, then let vLLM's backend sleep. If vLLM's fails, the pages are recommitted (the
        worker is awake, as it was) and its error raised."""
        level = check_level(level)
        buffers = self._buffers()
        awake = buffers is not None and not buffers.released
        try:  # the release inside: an interrupt after it returns still recommits (the worker stays awake)
            if awake:
                start = time.perf_counter()
                buffers.release_physical()
                self._record("release", level=level, seconds=round(time.perf_counter() - start, 6))
            self.inner.suspend(level)
        except BaseException:
            if awake and buffers.released:
                self._recommit_after_failed_sleep(buffers)
            raise

    def _recommit_after_failed_sleep(self, buffers: Any) -> None:
        try:
            buffers.recommit_physical()
        except BaseException as exc:  # the KV stays released; the caller sees the sleep's own error
            if not isinstance(exc, Exception):  # an interrupt is the user's: it reaches the caller
                raise
            logger.error(
                "extensible KV cache: vLLM's sleep failed and recommitting the released KV pages failed "
                "too (%s: %s); the KV cache stays released until wake_up(tags=['kv_cache'])",
                type(exc).__name__,
                exc,
            )
            self._record("recommit_failed", after="failed sleep", error=f"{type(exc).__name__}: {exc}")
        else:
            self._record("recommit", after="failed sleep")

    def resume(self, tags: list[str] | None = None) -> None:
        """Recommit the KV pages when ``tags`` wakes the KV cache, then let vLLM's backend wake ``tags`` (read once:
        an iterator of names reaches vLLM as the list it held)."""
        if tags is not None and not isinstance(tags, (str, bytes, list)):
            try:
                tags = list(cast(Iterable[object], tags))
            except TypeError:  # not iterable: wakes_kv names it
                pass
        buffers = self._buffers() if wakes_kv(tags) else None
        if buffers is not None and buffers.released:
            start = time.perf_counter()
            try:
                buffers.recommit_physical()
            except BaseException as exc:
                self._record("recommit_failed", tags=tags, error=f"{type(exc).__name__}: {exc}")
                logger.error(
                    "extensible KV cache: recommitting the KV pages on wake_up(tags=%s) failed; the KV "
                    "cache stays released and nothing was woken: free device memory and call "
                    "wake_up(tags=['kv_cache']) again",
                    tags,
                )
                raise
            self._record("recommit", tags=tags, seconds=round(time.perf_counter() - start, 6))
        self.inner.resume(tags)


def _keep_kv_views(runner: Any, original: Callable[[], None]) -> Callable[[], None]:
    """V1's ``post_kv_cache_wake_up`` run with ``kv_caches`` empty (Note [V1 zeroes the whole KV cache on wake])."""

    def post_kv_cache_wake_up() -> None:
        own = runner.__dict__.get("kv_caches", _MISSING)
        runner.kv_caches = []
        try:
            original()
        finally:
            if own is _MISSING:
                del runner.kv_caches
            else:
                runner.kv_caches = own

    post_kv_cache_wake_up.extensible_kv = True  # type: ignore[attr-defined]  # a marker on the function, read by bind
    return post_kv_cache_wake_up


_MISSING = object()


def bind(worker: Any) -> None:
    """With sleep mode on, wrap this worker's sleep-mode backend in ``KVSleepBackend`` and give a V1 runner the
    ``post_kv_cache_wake_up`` of Note [V1 zeroes the whole KV cache on wake]; idempotent; nothing with sleep mode
    off."""
    model_config = getattr(getattr(worker, "vllm_config", None), "model_config", None)
    if not getattr(model_config, "enable_sleep_mode", False):
        return
    if not hasattr(worker, "_sleep_mode_backend"):
        raise ExtensibleKVUnsupported(
            f"sleep mode is enabled but this vLLM's worker ({type(worker).__name__}) has no "
            f"_sleep_mode_backend to wrap; the extensible path supports sleep mode on "
            f"vllm 0.26.0"
        )
    current = worker._sleep_mode_backend
    if not isinstance(current, KVSleepBackend):
        worker._sleep_mode_backend = KVSleepBackend(worker, current)
    runner = worker.model_runner
    hook = getattr(runner, "post_kv_cache_wake_up", None)
    if worker_kv.runner_kind(runner) == "v1" and hook is not None and not getattr(hook, "extensible_kv", False):
        runner.post_kv_cache_wake_up = _keep_kv_views(runner, hook)


def _pool_usage() -> int | None:
    """Bytes in vLLM's CuMem pool now, or ``None`` when no CuMem allocator exists in this process (sleep mode off:
    nothing to check). Read through ``sys.modules``: importing vLLM's allocator loads its compiled extension."""
    module = sys.modules.get(_CUMEM_MODULE)
    instance = getattr(getattr(module, "CuMemAllocator", None), "instance", None)
    return None if instance is None else int(instance.get_current_usage())


@contextmanager
def nothing_in_pool(what: str) -> Iterator[None]:
    """Refuse, after the block, if it allocated anything in vLLM's CuMem pool (Note [Nothing of ours in vLLM's
    pool])."""
    before = _pool_usage()
    yield
    after = _pool_usage()
    if before is not None and after != before:
        raise ExtensibleKVUnsupported(
            f"{what} changed vLLM's CuMem pool from {before} to {after} bytes: the "
            f"pool's sleep would free that memory under the KV cache"
        )
