"""Resize a running engine's KV cache: shrink releases the top blocks' pages, growth maps them again, under the same
addresses, so captured CUDA graphs stay valid and nothing is recaptured.

Reached through ``collective_rpc`` under three method names, on every client vLLM has (``EngineCore.collective_rpc``
is wrapped: these names are answered by the engine core, which tells the scheduler and then every worker; any other
name goes to the workers as before):

- ``extensible_kv_resize`` ``(num_blocks)``: resize to ``num_blocks`` blocks;
- ``extensible_kv_resize_bytes`` ``(budget_bytes)``: resize to the most blocks whose pages fit ``budget_bytes`` on
  each rank (``blocks_for_budget``; clamped to the reservation);
- ``extensible_kv_kv_state`` ``()``: the counts and the load, for a coordinator (``coordinator``).

Offline: ``resize_kv_cache(llm, n)``, ``resize_kv_cache_to_bytes(llm, b)``; ``AsyncLLM``: the ``*_async`` forms.
These check their argument before anything is sent (``ResizeArgumentError``, ``ResizeRefused``) and the engine's
reply where it comes back: one reply of the documented shape, else ``ResizeReplyError`` naming the call and the
reply, shortened; a ``TimeoutError`` of the RPC is ``ResizeTimeout`` naming the call.
A running ``vllm serve`` (``VLLM_SERVER_DEV_MODE=1``): the dev-mode route ``POST /collective_rpc`` with
``{"method": "extensible_kv_resize", "args": ["1200"]}`` (its arguments travel as strings).

Note [Shrinking preempts the requests that hold the top blocks]
    Rule: a shrink to ``n`` blocks waits only for the steps in flight (the scheduler is paused with vLLM's
    ``keep`` mode, the call completes when the engine is idle, then scheduling resumes), never for requests: every
    running request that holds a block ``>= n`` is preempted and recomputed later, as vLLM preempts when the pool
    runs dry; cached free blocks ``>= n`` are evicted from the prefix-cache map; then blocks ``>= n`` leave the
    free queue and the pool's count, and only then are their pages released on every rank. Growth maps the pages
    on every rank first and adds blocks ``[old, n)`` to the free queue after all ranks succeeded.
    Why: waiting for requests to finish has no bound (a long decode holds its blocks for minutes), and a shrink that
    another engine needs now must not depend on this one's requests; preemption is vLLM's own recovery path (greedy
    tokens are the same where a row's result does not depend on its batch: vLLM's batch-invariant mode) and costs
    one prefill per preempted request. An in-process engine resizes at once between steps.
    Figure: a pool of 100 blocks shrunk to 30, requests on blocks 1-8 and 49-56: the second is preempted, the first
    runs on, 30 - 1 - 8 blocks are free; cached free blocks up to 96 leave the prefix-cache map when shrunk to 40
    (``tests/unit/test_vllm_resize.py``). On an H100, 8B shape under load: 25,326 -> 2,532 blocks with 31
    requests preempted in 62.5 ms at the client, 32.3 ms on the rank (``reports/runs/h100-2026-12-07-resize``).

Note [Every rank at one count, or none moved]
    Rule: the engine asks every worker to move to ``n`` (``extensible_kv_set_blocks``); each answers with its count
    and error instead of raising. Unless every rank answered ``n``, every rank is moved back to the old count and the
    scheduler's pool is restored, and the call fails with ``ResizeFailed`` naming each rank's error.
    Why: the scheduler hands the same block ids to all ranks; one rank short of a block the others have is an
    illegal address on that rank at the first step that uses it. A worker that raised would lose the others'
    answers in ``collective_rpc``.
    Figure: a failing rank 1 of 2 on a growth 40 -> 80: rank 0 grew and is shrunk back, the pool stays at 40.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import reprlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NoReturn

from ..boundaries import number
from ..errors import BusyError, ExtensibleKVError, InvalidArgumentError, InvalidSizeError, ReleasedError
from . import worker_kv
from .worker_kv import ExtensibleKVUnsupported

logger = logging.getLogger("extensible_kv.vllm")

RESIZE = "extensible_kv_resize"
RESIZE_BYTES = "extensible_kv_resize_bytes"
KV_STATE = "extensible_kv_kv_state"
ENGINE_METHODS = (RESIZE, RESIZE_BYTES, KV_STATE)
"""The ``collective_rpc`` names the engine core answers itself."""
WORKER_SET_BLOCKS = "extensible_kv_set_blocks"
WORKER_BLOCK_BYTES = "extensible_kv_block_bytes"


# -- errors --------------------------------------------------------------------------------------------------------
class ResizeError(ExtensibleKVError):
    """A resize was refused or failed; the engine keeps serving at its old size. ``str()`` starts with the class name
    in brackets, so the type survives vLLM's utility calls, which carry only the message (``typed``)."""

    def __str__(self) -> str:
        return f"[{type(self).__name__}] {super().__str__()}"


class ResizeRefused(ResizeError, InvalidSizeError):
    """A block count or budget out of range: zero or negative, above the reservation, below the floor."""


class ResizeArgumentError(ResizeError, InvalidArgumentError):
    """A count or budget that is not an integer (a bool, a float, a string that is not a number)."""


class ResizeInProgress(ResizeError, BusyError):
    """Another resize is in progress on this engine (refused, not queued), or a step is in flight in-process."""


class ResizeWhileAsleep(ResizeError, ReleasedError):
    """The engine is asleep or its scheduler paused: its KV pages are released or nothing may be scheduled."""


class ResizeFailed(ResizeError, RuntimeError):
    """A rank could not move to the new count, or a block above it stayed referenced; every rank is back at the
    old count (Note [Every rank at one count, or none moved])."""


class ResizeUnsupported(ResizeError, ExtensibleKVUnsupported):
    """This engine cannot be resized (not on the extensible path, a KV connector, buffers that cannot shrink)."""


class ResizeReplyError(ResizeError, RuntimeError):
    """An engine's reply to one of these calls is not of its documented shape (not one reply, not a dict, a count
    that is not an integer in range), or is longer than a client reads; the message names the call and the reply,
    shortened. Nothing is known to have changed on the engine: read its state again."""


class ResizeTimeout(ResizeReplyError, TimeoutError):
    """No whole reply came within the call's deadline; the message names the call and the deadline."""


_TYPES = {
    cls.__name__: cls
    for cls in (
        ResizeRefused,
        ResizeArgumentError,
        ResizeInProgress,
        ResizeWhileAsleep,
        ResizeFailed,
        ResizeUnsupported,
        ResizeReplyError,
        ResizeTimeout,
    )
}


def typed(exc: BaseException) -> BaseException:
    """The typed resize error a message names (``[ResizeRefused] ...`` inside vLLM's "Call to ... failed: ..."), or
    ``exc`` itself when it names none."""
    if isinstance(exc, ResizeError):
        return exc
    found = re.search(r"\[(Resize\w+)\] (.*)", str(exc), re.S)
    if found is None or found.group(1) not in _TYPES:
        return exc
    return _TYPES[found.group(1)](found.group(2))


# -- the arithmetic ------------------------------------------------------------------------------------------------
COUNT_LIMIT = 2**63
"""Block counts, byte budgets and the counts of a reply are below this (what a 64-bit figure holds)."""

_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 3, 6, 12, 60, 60


def short(value: object, limit: int = 200) -> str:
    """``value`` for a one-line message: its repr, nested values and long texts elided, at most ``limit`` chars."""
    try:
        text = _SHORT.repr(value)
    except Exception as exc:  # a repr that raises
        text = f"<{type(value).__name__}: repr failed with {type(exc).__name__}>"
    text = text.replace("\n", "\\n").replace("\r", "\\r")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def as_count(value: object, what: str) -> int:
    """An int from an int or a decimal string (``/collective_rpc`` sends strings); anything else is refused."""
    if isinstance(value, bool):
        raise ResizeArgumentError(f"{what} must be an integer, got bool {value!r}")
    if isinstance(value, int):
        if value.bit_length() > 1024:  # no count; and past 4,300 digits no message could show it
            raise ResizeArgumentError(f"{what} must be an integer of at most 40 digits, got {number(value)}")
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?[0-9]{1,40}\s*", value, re.ASCII):
        return int(value)
    raise ResizeArgumentError(
        f"{what} must be an integer of at most 40 digits, got {type(value).__name__} {short(value, 80)}"
    )


def positive_count(value: object, what: str) -> int:
    """``value`` as an int from 1 to ``COUNT_LIMIT - 1`` (``as_count``); else ``ResizeRefused`` naming it."""
    n = as_count(value, what)
    if not 0 < n < COUNT_LIMIT:
        raise ResizeRefused(f"{what} must be an integer from 1 to 2**63 - 1, got {n if n <= 0 else short(n, 60)}")
    return n


def check_count(num_blocks: object, *, current: int, reserved: int, floor: int) -> int:
    """``num_blocks`` as an int if a resize from ``current`` may go there; else ``ResizeRefused`` naming the values.
    ``floor``: the fewest blocks that hold one request of ``max_model_len`` tokens and the null block."""
    n = as_count(num_blocks, "num_blocks")
    if n <= 0:
        raise ResizeRefused(f"num_blocks must be positive, got {n} (the engine is at {current} blocks)")
    if n > reserved:
        raise ResizeRefused(
            f"num_blocks={n} exceeds the reservation of {reserved} blocks (the engine is at {current} blocks)"
        )
    if n < floor:
        raise ResizeRefused(
            f"num_blocks={n} is below the floor of {floor} blocks (one request of max_model_len tokens and the null "
            f"block; the engine is at {current} blocks)"
        )
    return n


def blocks_for_budget(budget_bytes: object, bytes_per_block: int, rounding_bytes: int) -> int:
    """The most blocks whose pages fit ``budget_bytes``: ``floor((budget - rounding) / bytes_per_block)``, where
    ``rounding`` (at least 0) bounds what granule rounding adds (one granule per segment of every buffer); at least
    0 blocks."""
    budget = as_count(budget_bytes, "budget_bytes")
    if budget <= 0:
        raise ResizeRefused(f"budget_bytes must be positive, got {budget}")
    bytes_per_block, rounding_bytes = as_count(bytes_per_block, "bytes_per_block"), as_count(rounding_bytes, "rounding")
    if bytes_per_block <= 0:
        raise ResizeUnsupported(f"bytes_per_block must be positive, got {bytes_per_block}")
    if rounding_bytes < 0:
        raise ResizeUnsupported(f"rounding must be at least 0, got {rounding_bytes}")
    return max(0, (budget - rounding_bytes) // bytes_per_block)


def floor_blocks(blocks_per_request: float) -> int:
    """The fewest blocks a resize may leave: one request of ``max_model_len`` tokens (``blocks_per_request``, as
    vLLM's own capacity check counts it) plus the null block. ``blocks_per_request`` is a finite number above 0
    whose ceiling plus one is below ``COUNT_LIMIT``: else ``ResizeArgumentError`` (not a number: a bool, text, nan,
    an infinity) or ``ResizeRefused`` (0 or less, or too large), naming it."""
    value = blocks_per_request
    number = isinstance(value, int) and not isinstance(value, bool)  # an int of any size is finite
    if not (number or (isinstance(value, float) and math.isfinite(value))):
        raise ResizeArgumentError(
            f"blocks_per_request must be a finite number, got {type(value).__name__} {short(value, 80)}"
        )
    floor = math.ceil(value) + 1 if value > 0 else 0
    if not 0 < floor < COUNT_LIMIT:
        raise ResizeRefused(f"blocks_per_request must be above 0 and at most 2**63 - 2, got {short(value, 80)}")
    return floor


# -- the scheduler's side --------------------------------------------------------------------------------------------
def _pool(scheduler: Any) -> Any:
    return scheduler.kv_cache_manager.block_pool


def holders(scheduler: Any, num_blocks: int) -> list[Any]:
    """The running requests that hold a block ``>= num_blocks`` in any KV cache group, in running order."""
    manager = scheduler.kv_cache_manager
    found = []
    for request in scheduler.running:
        groups = manager.get_block_ids(request.request_id)
        if any(b >= num_blocks for ids in groups for b in ids):
            found.append(request)
    return found


def preempt(scheduler: Any, requests: list[Any]) -> list[str]:
    """Preempt ``requests`` as vLLM's ``reset_prefix_cache(reset_running_requests=True)`` does: newest first, so they
    resume in FIFO order; their blocks go back to the pool. Returns their ids."""
    timestamp = time.monotonic()
    ids = []
    for request in reversed(requests):
        scheduler.running.remove(request)
        scheduler._preempt_request(request, timestamp)
        if hasattr(request, "async_tokens_to_discard"):  # outputs in flight for it are stale (none when idle)
            request.async_tokens_to_discard = request.num_output_placeholders
            request.num_output_placeholders = 0
        getattr(scheduler, "prev_step_scheduled_req_ids", set()).discard(request.request_id)
        ids.append(request.request_id)
    return ids[::-1]


def _set_count(scheduler: Any, vllm_config: Any, old: int, new: int) -> None:
    """Tell every count of the scheduler's side (pool, config, watermark, capacity figures) that it is ``new``. The
    figures that scale with the count are taken per block once, at the first resize, so a shrink and a growth back
    give the figures vLLM computed (no rounding carried from one resize to the next)."""
    from .connector import tell_committed_count

    manager = scheduler.kv_cache_manager
    config = manager.kv_cache_config
    if config.num_blocks == old:
        tell_committed_count(config, new)
    cache_config = vllm_config.cache_config
    per_block = getattr(manager, "_extensible_kv_per_block", None)
    if per_block is None:
        per_block = {
            "watermark": getattr(manager, "watermark_blocks", 0) / old,
            "tokens": (getattr(cache_config, "kv_cache_size_tokens", None) or 0) / old,
            "concurrency": (getattr(cache_config, "kv_cache_max_concurrency", None) or 0) / old,
        }
        manager._extensible_kv_per_block = per_block
    if hasattr(manager, "watermark_blocks"):
        manager.watermark_blocks = int(per_block["watermark"] * new)  # vLLM's int(watermark x num_blocks)
    cache_config.num_gpu_blocks = new
    if per_block["tokens"]:
        cache_config.kv_cache_size_tokens = int(per_block["tokens"] * new)
    if per_block["concurrency"]:
        cache_config.kv_cache_max_concurrency = per_block["concurrency"] * new


def take_out(scheduler: Any, vllm_config: Any, num_blocks: int) -> dict:
    """Take blocks ``>= num_blocks`` out of the scheduler's pool (Note [Shrinking preempts the requests that hold the
    top blocks]): preempt their holders, evict them from the prefix cache, drop them from the free queue and the
    count. Refused with ``ResizeFailed`` (the pool unchanged) when one stays referenced after the preemptions."""
    pool = _pool(scheduler)
    old = pool.num_gpu_blocks
    num_blocks = as_count(num_blocks, "num_blocks")
    if not 1 <= num_blocks < old:  # block 0 is the null block: a pool keeps it
        raise ResizeRefused(f"take_out({num_blocks}) on a pool of {old} blocks: not a shrink to 1 or more blocks")
    preempted = preempt(scheduler, holders(scheduler, num_blocks))
    drain = getattr(scheduler, "_drain_deferred_frees", None)
    if drain is not None:  # frees fenced behind steps that have all completed by now
        drain()
    top = pool.blocks[num_blocks:]
    held = [b.block_id for b in top if b.ref_cnt > 0]
    if held:
        raise ResizeFailed(
            f"shrinking the pool from {old} to {num_blocks} blocks: blocks {held[:8]} (of {len(held)}) stay "
            f"referenced after preempting {len(preempted)} running request(s) (a deferred free or a copy in flight); "
            f"the pool keeps {old} blocks"
        )
    evicted = 0
    for block in top:
        if block.prev_free_block is not None or block.next_free_block is not None:
            pool.free_block_queue.remove(block)
        if pool.enable_caching:
            evicted += bool(pool._maybe_evict_cached_block(block))
    del pool.blocks[num_blocks:]
    pool.num_gpu_blocks = num_blocks
    _set_count(scheduler, vllm_config, old, num_blocks)
    return {"preempted": preempted, "evicted": evicted, "from": old, "to": num_blocks}


def put_back(scheduler: Any, vllm_config: Any, num_blocks: int) -> dict:
    """Add blocks ``[old, num_blocks)`` to the scheduler's pool, free and uncached, at the end of the free queue."""
    pool = _pool(scheduler)
    old = pool.num_gpu_blocks
    num_blocks = as_count(num_blocks, "num_blocks")
    if num_blocks <= old:
        raise ResizeRefused(f"put_back({num_blocks}) on a pool of {old} blocks: not a growth")
    block_type = type(pool.blocks[0])
    new = [block_type(i) for i in range(old, num_blocks)]
    pool.blocks.extend(new)
    pool.free_block_queue.append_n(new)
    pool.num_gpu_blocks = num_blocks
    _set_count(scheduler, vllm_config, old, num_blocks)
    return {"from": old, "to": num_blocks}


# -- the workers' side -----------------------------------------------------------------------------------------------
def _synchronize() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _buffers_of(worker: object) -> Any:
    pinned = getattr(worker, "_extensible_kv_state", None)
    state = pinned if pinned is not None else worker_kv.active()
    if state is None or state.buffers is None:
        raise ResizeUnsupported("this worker has no extensible KV buffers (was the extensible path on at start-up?)")
    return state


def set_blocks(state: worker_kv.WorkerKV, num_blocks: int) -> dict:
    """Move ``state``'s buffers to ``num_blocks`` (shrink: ``shrink_blocks``; growth: ``ensure_blocks``); the
    device synchronized before and after. Returns the new count, the seconds and the bytes moved."""
    buffers = state.buffers
    if buffers is None:
        raise ResizeUnsupported("set_blocks before the KV buffers were allocated")
    before = buffers.num_blocks
    _synchronize()
    start = time.perf_counter()
    moved = 0
    if num_blocks < before:
        shrink = getattr(buffers, "shrink_blocks", None)
        if shrink is None:
            raise ResizeUnsupported(f"{type(buffers).__name__} has no shrink_blocks: these KV buffers cannot shrink")
        moved = -int(shrink(num_blocks))
    elif num_blocks > before:
        committed = buffers.stats().committed_bytes
        state.ensure_blocks(num_blocks, reason="resize")
        moved = buffers.stats().committed_bytes - committed
    _synchronize()
    seconds = time.perf_counter() - start
    if num_blocks != before:
        state.events.append(
            {"event": "resize", "from": before, "to": buffers.num_blocks, "seconds": round(seconds, 6), "bytes": moved}
        )
    return {"num_blocks": buffers.num_blocks, "seconds": seconds, "bytes": moved}


def extensible_kv_set_blocks(self: Any, num_blocks: int) -> dict:
    """RPC: move this worker's KV buffers to ``num_blocks``; never raises (Note [Every rank at one count, or none
    moved]): ``ok`` says whether it got there, ``num_blocks`` where it is, ``error`` why not."""
    rank = getattr(self, "rank", None)
    try:
        state = _buffers_of(self)
    except Exception as exc:
        return {"ok": False, "rank": rank, "num_blocks": None, "error": f"{type(exc).__name__}: {exc}"}
    try:
        count = positive_count(num_blocks, "num_blocks")  # refused as the engine's call refuses it, never coerced
        moved = set_blocks(state, count)
    except Exception as exc:
        return {"ok": False, "rank": rank, "num_blocks": getattr(state.buffers, "num_blocks", None), "error": f"{exc}"}
    runner = getattr(self, "model_runner", None)
    if runner is not None and getattr(runner, "kv_cache_config", None) is not None:
        runner.kv_cache_config.num_blocks = moved["num_blocks"]
    if getattr(self, "cache_config", None) is not None:
        self.cache_config.num_gpu_blocks = moved["num_blocks"]
    return {"ok": moved["num_blocks"] == count, "rank": rank, **moved, "error": None}


def extensible_kv_block_bytes(self: Any) -> dict:
    """RPC: this worker's bytes per block over every buffer, the granule rounding bound, and its reservation."""
    buffers = _buffers_of(self).buffers
    if buffers is None:  # _buffers_of refuses this already; said again for the type checker
        raise ResizeUnsupported("this worker has no extensible KV buffers")
    stats = buffers.stats()
    return {
        "bytes_per_block": sum(b.page_size_bytes for b in stats.buffers),
        "rounding_bytes": sum(b.num_segments * stats.granularity for b in stats.buffers),
        "max_num_blocks": stats.max_num_blocks,
        "num_blocks": stats.num_blocks,
    }


WORKER_RPCS: dict[str, Callable[..., Any]] = {
    WORKER_SET_BLOCKS: extensible_kv_set_blocks,
    WORKER_BLOCK_BYTES: extensible_kv_block_bytes,
}


def move_workers(rpc: Callable[..., list], old: int, new: int) -> list[dict]:
    """Every rank to ``new``, or every rank back to ``old`` and ``ResizeFailed`` (Note [Every rank at one count, or
    none moved]). ``rpc(name, args=...)``: the executor's ``collective_rpc``."""
    try:
        replies = list(rpc(WORKER_SET_BLOCKS, args=(new,)))
        failed = [r for r in replies if not (isinstance(r, dict) and r.get("ok") and r.get("num_blocks") == new)]
    except Exception as exc:  # an executor that failed as a whole: no reply to read
        replies, failed = [], [{"rank": None, "error": f"{type(exc).__name__}: {exc}"}]
    except BaseException:  # an interrupt: the ranks may have moved; every one goes back before it propagates
        with contextlib.suppress(Exception):
            rpc(WORKER_SET_BLOCKS, args=(old,))
        raise
    if not failed:
        return replies
    try:
        back = list(rpc(WORKER_SET_BLOCKS, args=(old,)))
        stuck = [r for r in back if not (isinstance(r, dict) and r.get("num_blocks") == old)]
    except Exception as exc:
        stuck = [{"rank": None, "error": f"{type(exc).__name__}: {exc}"}]
    detail = "; ".join(f"rank {r.get('rank')}: {r.get('error')}" for r in failed if isinstance(r, dict))
    if stuck:
        raise ResizeFailed(
            f"resizing {old} -> {new} blocks failed ({detail}) and moving back to {old} failed on "
            f"{[r.get('rank') for r in stuck if isinstance(r, dict)]}: the ranks disagree; restart the engine"
        )
    raise ResizeFailed(f"resizing {old} -> {new} blocks failed ({detail}); every rank is back at {old} blocks")


# -- the engine's side -----------------------------------------------------------------------------------------------
class EngineResize:
    """What an engine core knows about its extensible KV cache's size, kept on the core (``of``)."""

    def __init__(self, core: Any) -> None:
        reports = getattr(core, "_extensible_kv_reports", None)
        if not reports:
            raise ResizeUnsupported("this engine did not start on the extensible KV path: its KV cache cannot resize")
        scheduler = core.scheduler
        if getattr(scheduler, "connector", None) is not None:
            raise ResizeUnsupported(
                "this engine has a KV connector, which registered the committed blocks once: resizing is refused"
            )
        self.core = core
        self.reserved = int(reports["reserved_blocks"])
        self.floor = floor_blocks(_blocks_per_request(core))
        self.pending: int | None = None  # the target of a resize waiting for the engine to go idle
        self.lock = threading.Lock()
        self.history: list[dict] = []
        self._bytes: dict | None = None

    @classmethod
    def of(cls, core: Any) -> EngineResize:
        state = getattr(core, "_extensible_kv_resize", None)
        if state is None:
            state = cls(core)
            core._extensible_kv_resize = state
        return state

    @property
    def current(self) -> int:
        return int(_pool(self.core.scheduler).num_gpu_blocks)

    def block_bytes(self) -> dict:
        """Bytes per block and the rounding bound: the largest over ranks (asked once)."""
        if self._bytes is None:
            replies = self.core.model_executor.collective_rpc(WORKER_BLOCK_BYTES)
            self._bytes = {
                "bytes_per_block": max(r["bytes_per_block"] for r in replies),
                "rounding_bytes": max(r["rounding_bytes"] for r in replies),
            }
        return self._bytes

    def check_awake(self, n: object, paused_ok: bool = False) -> None:
        core = self.core
        asleep = bool(getattr(core.model_executor, "is_sleeping", False))
        paused = not paused_ok and _paused(core.scheduler)
        if asleep or paused:
            raise ResizeWhileAsleep(
                f"resize to {n} blocks refused: the engine is {'asleep' if asleep else 'paused'} at {self.current} "
                f"blocks; wake it up (wake_up / resume) first"
            )

    def state(self) -> dict:
        scheduler = self.core.scheduler
        pool = _pool(scheduler)
        return {
            "num_blocks": self.current,
            "reserved_blocks": self.reserved,
            "floor_blocks": self.floor,
            "free_blocks": pool.get_num_free_blocks(),
            "usage": pool.get_usage(),
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "resizing": self.pending,
            **self.block_bytes(),
        }

    def apply(self, n: int) -> dict:
        """Resize now (the engine idle: no step in flight)."""
        core = self.core
        scheduler, config, rpc = core.scheduler, core.vllm_config, core.model_executor.collective_rpc
        old = self.current
        start = time.perf_counter()
        taken: dict = {}
        if n < old:
            taken = take_out(scheduler, config, n)
            try:
                replies = move_workers(rpc, old, n)
            except BaseException:
                put_back(scheduler, config, old)
                raise
        elif n > old:
            replies = move_workers(rpc, old, n)
            put_back(scheduler, config, n)
        else:
            replies = []
        result = {
            "from": old,
            "to": n,
            "seconds": time.perf_counter() - start,
            "worker_seconds": max((r.get("seconds", 0.0) for r in replies), default=0.0),
            "bytes": [r.get("bytes", 0) for r in replies],
            "preempted": taken.get("preempted", []),
            "evicted": taken.get("evicted", 0),
        }
        self.history.append(result)
        logger.info(
            "extensible KV cache: resized %d -> %d blocks in %.1f ms (%d preempted, %d evicted)",
            old,
            n,
            result["seconds"] * 1e3,
            len(result["preempted"]),
            result["evicted"],
        )
        return result


def _paused(scheduler: Any) -> bool:
    state = getattr(scheduler, "pause_state", None)
    return state is not None and getattr(state, "name", str(state)) != "UNPAUSED"


def _blocks_per_request(core: Any) -> float:
    """Blocks one request of max_model_len tokens takes, as vLLM's capacity check counts them."""
    import copy

    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    config = copy.copy(core.scheduler.kv_cache_manager.kv_cache_config)
    return config.num_blocks / get_max_concurrency_for_kv_cache_config(core.vllm_config, config)


def _idle(core: Any) -> bool:
    queue = getattr(core, "batch_queue", None)
    return not queue and not getattr(core, "engines_running", False)


def engine_resize(core: Any, num_blocks: object) -> dict | Future:
    """Resize ``core``'s KV cache to ``num_blocks``: refuse bad input at once (typed, nothing changed); resize now
    if nothing is in flight; otherwise (a busy engine-core process) pause scheduling in vLLM's ``keep`` mode and
    resize when the engine goes idle, returning a Future vLLM's utility machinery waits on."""
    state = EngineResize.of(core)
    if not state.lock.acquire(blocking=False):  # a resize running in another thread (in-process engines)
        raise ResizeInProgress(f"resize to {num_blocks} blocks refused: another resize is in progress")
    try:
        if state.pending is not None:
            raise ResizeInProgress(
                f"resize to {num_blocks} blocks refused: a resize to {state.pending} blocks is in progress (the "
                f"engine is at {state.current} blocks)"
            )
        n = check_count(num_blocks, current=state.current, reserved=state.reserved, floor=state.floor)
        state.check_awake(n)
        callbacks = getattr(core, "_idle_state_callbacks", None)
        has_work = getattr(core, "has_work", None)  # EngineCoreProc's; an in-process EngineCore has none
        if callbacks is None or has_work is None or not has_work():  # in-process, or a process with nothing to do
            if not _idle(core):
                raise ResizeInProgress(
                    f"resize to {n} blocks refused: a step is in flight in this in-process engine; call again "
                    f"between steps"
                )
            state.pending = n
            try:
                return state.apply(n)
            finally:
                state.pending = None
        state.pending = n
    finally:
        state.lock.release()
    future: Future = Future()
    scheduler = core.scheduler
    previous = scheduler.pause_state
    from vllm.v1.core.sched.interface import PauseState

    scheduler.set_pause_state(PauseState.PAUSED_ALL)

    def when_idle(engine: Any) -> None:
        try:
            state.check_awake(n, paused_ok=True)  # a sleep that went idle first released the pages meanwhile
            result = state.apply(n)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)
        finally:
            if scheduler.pause_state == PauseState.PAUSED_ALL:  # ours; a sleep's pause since then stays
                scheduler.set_pause_state(previous)
            state.pending = None
            _wake(engine)

    callbacks.append(when_idle)
    _wake(core)
    return future


def _wake(core: Any) -> None:
    """Make the busy loop look at its state again (it blocks on the input queue while idle)."""
    queue = getattr(core, "input_queue", None)
    if queue is not None:
        from vllm.v1.engine import EngineCoreRequestType

        queue.put_nowait((EngineCoreRequestType.WAKEUP, None))


def engine_call(core: Any, method: str, args: tuple, kwargs: dict | None) -> list | Future:
    """Answer one of ``ENGINE_METHODS`` on the engine core, in ``collective_rpc``'s shape: a list of one reply (or
    a Future of it)."""
    if not isinstance(args, (tuple, list, type(None))) or not isinstance(kwargs, (dict, type(None))):
        raise ResizeArgumentError(
            f"{method} takes its arguments as a list and a mapping, got args {type(args).__name__} "
            f"{short(args, 80)} and kwargs {type(kwargs).__name__} {short(kwargs, 80)}"
        )
    args = tuple(args or ()) + tuple((kwargs or {}).values())
    state = EngineResize.of(core)
    if method == KV_STATE:
        return [state.state()]
    if len(args) != 1:
        raise ResizeArgumentError(f"{method} takes one argument, got {len(args)}: {short(args, 200)}")
    target: object = args[0]
    if method == RESIZE_BYTES:
        sizes = state.block_bytes()
        blocks = blocks_for_budget(target, sizes["bytes_per_block"], sizes["rounding_bytes"])
        target = min(blocks, state.reserved)
        if target < state.floor:
            raise ResizeRefused(
                f"budget_bytes={as_count(args[0], 'budget_bytes')} holds {blocks} blocks of "
                f"{sizes['bytes_per_block']} bytes, below the floor of {state.floor} blocks"
            )
    result = engine_resize(core, target)
    if isinstance(result, Future):
        listed: Future = Future()

        def relay(done: Future) -> None:
            exc = done.exception()
            listed.set_exception(exc) if exc is not None else listed.set_result([done.result()])

        result.add_done_callback(relay)
        return listed
    return [result]


def engine_collective_rpc(original: Callable) -> Callable:
    """``EngineCore.collective_rpc``, answering ``ENGINE_METHODS`` on the engine core."""

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if isinstance(method, str) and method in ENGINE_METHODS:
            return engine_call(self, method, args, kwargs)
        return original(self, method, timeout, args, kwargs)

    collective_rpc.__dict__["extensible_kv_original"] = original  # what bind_engine unwraps
    return collective_rpc


def bind_engine(core: Any) -> None:
    """Give this engine core the resizing ``collective_rpc`` on the instance, so an engine built inside
    ``extensible_kv_cache()`` keeps it after the patches are removed (Note [An engine keeps its RPCs] in
    ``patches``); idempotent."""
    import types

    method = getattr(type(core), "collective_rpc", None)
    if method is None:  # not an EngineCore: nothing to answer through
        return
    original = getattr(method, "extensible_kv_original", method)
    core.collective_rpc = types.MethodType(engine_collective_rpc(original), core)


# -- clients ---------------------------------------------------------------------------------------------------------
def _raise_typed(exc: Exception) -> NoReturn:
    """Raise ``exc`` as the typed error it names (``typed``: vLLM's utility calls carry only a message)."""
    error = typed(exc)
    if error is exc:
        raise exc
    raise error from exc


REPLY_COUNTS = (
    *("num_blocks", "reserved_blocks", "floor_blocks", "free_blocks", "running", "waiting", "bytes_per_block"),
    *("rounding_bytes", "from", "to", "evicted"),
)
"""The counts a reply of these calls may hold (``EngineResize.state``, ``EngineResize.apply``)."""


def checked_reply(method: str, replies: object, target: int | None = None) -> dict:
    """The one reply in ``collective_rpc``'s list for ``method``, where it has its documented shape: a dict (with
    ``num_blocks`` for ``KV_STATE``) whose counts (``REPLY_COUNTS``, those it holds) are integers from 0 to
    2**63 - 1 and agree where it holds both of a pair (``floor_blocks``, ``num_blocks`` at most ``reserved_blocks``;
    ``free_blocks`` below ``num_blocks``: the null block is never free), and a resize to ``target`` says ``to``
    ``target`` where it says ``to``. Else ``ResizeReplyError`` naming the call and the reply, shortened."""

    def refuse(why: str) -> NoReturn:
        raise ResizeReplyError(f"{method}: {why}; the reply was {short(replies)}")

    if not isinstance(replies, (list, tuple)) or len(replies) != 1 or not isinstance(replies[0], dict):
        refuse("expected a list of one dict")
    reply = replies[0]
    if method == KV_STATE and "num_blocks" not in reply:
        refuse("a KV state names num_blocks")
    for key in REPLY_COUNTS:
        value = reply.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < COUNT_LIMIT:
            refuse(f"{key} must be an integer from 0 to 2**63 - 1, got {type(value).__name__} {short(value, 60)}")
    for low, high in (("floor_blocks", "reserved_blocks"), ("num_blocks", "reserved_blocks")):
        if low in reply and high in reply and not reply[low] <= reply[high]:
            refuse(f"needs {low} <= {high}, got {low}={reply[low]}, {high}={reply[high]}")
    if "free_blocks" in reply and "num_blocks" in reply and not reply["free_blocks"] < reply["num_blocks"]:
        refuse(
            f"needs free_blocks < num_blocks, got free_blocks={reply['free_blocks']}, num_blocks={reply['num_blocks']}"
        )
    if method == RESIZE and target is not None and reply.get("to", target) != target:
        refuse(f"asked for {target} blocks, the reply says {reply['to']}")
    return reply


def _timed_out(method: str, exc: TimeoutError) -> NoReturn:
    if isinstance(exc, ResizeError):
        raise exc
    raise ResizeTimeout(f"{method}: no reply in time ({type(exc).__name__}: {short(str(exc), 120)})") from exc


def _call(llm: Any, method: str, *args: int) -> dict:
    engine = getattr(llm, "llm_engine", llm)
    try:
        replies = engine.collective_rpc(method, args=args)
    except TimeoutError as exc:
        _timed_out(method, exc)
    except Exception as exc:
        _raise_typed(exc)
    return checked_reply(method, replies, *args[:1] if method == RESIZE else ())


def resize_kv_cache(llm: Any, num_blocks: int) -> dict:
    """Resize an offline ``LLM``'s (or ``LLMEngine``'s) KV cache to ``num_blocks`` blocks; returns what moved.
    ``num_blocks`` is checked before anything is sent (``positive_count``)."""
    return _call(llm, RESIZE, positive_count(num_blocks, "num_blocks"))


def resize_kv_cache_to_bytes(llm: Any, budget_bytes: int) -> dict:
    """Resize to the most blocks whose pages fit ``budget_bytes`` per rank (clamped to the reservation)."""
    return _call(llm, RESIZE_BYTES, positive_count(budget_bytes, "budget_bytes"))


def kv_state(llm: Any) -> dict:
    """The engine's block counts, bytes per block and load (``EngineResize.state``)."""
    return _call(llm, KV_STATE)


async def _call_async(client: Any, method: str, *args: int) -> dict:
    try:
        replies = await client.collective_rpc(method, args=args)
    except TimeoutError as exc:
        _timed_out(method, exc)
    except Exception as exc:
        _raise_typed(exc)
    return checked_reply(method, replies, *args[:1] if method == RESIZE else ())


async def resize_kv_cache_async(client: Any, num_blocks: int) -> dict:
    """``resize_kv_cache`` for an ``AsyncLLM`` (an engine client)."""
    return await _call_async(client, RESIZE, positive_count(num_blocks, "num_blocks"))


async def resize_kv_cache_to_bytes_async(client: Any, budget_bytes: int) -> dict:
    return await _call_async(client, RESIZE_BYTES, positive_count(budget_bytes, "budget_bytes"))


async def kv_state_async(client: Any) -> dict:
    return await _call_async(client, KV_STATE)
