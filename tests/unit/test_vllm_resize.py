"""Resizing a running engine's KV cache (``extensible_kv.vllm.resize``): the arithmetic and the ranks' agreement
everywhere; the scheduler's side against vLLM 0.26.0's real ``KVCacheManager``, ``BlockPool`` and ``Request`` and the
real ``Scheduler`` methods it calls (where vLLM is installed: the ``layouts`` venv; elsewhere those tests skip, and
with ``EXTENSIBLE_KV_REQUIRE_VLLM=1`` a missing vLLM fails instead)."""

from __future__ import annotations

import importlib.util
import os
import queue
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from extensible_kv.errors import InvalidSizeError, ReleasedError
from extensible_kv.vllm import resize
from extensible_kv.vllm.resize import (
    ResizeArgumentError,
    ResizeFailed,
    ResizeInProgress,
    ResizeRefused,
    ResizeUnsupported,
    ResizeWhileAsleep,
)
from extensible_kv.vllm.worker_kv import WorkerKV

HAVE_VLLM = importlib.util.find_spec("vllm") is not None or os.environ.get("EXTENSIBLE_KV_REQUIRE_VLLM") == "1"
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="needs vllm==0.26.0 (the nox layouts venv)")

BLOCK, PAGE, MAX_LEN = 16, 4096, 256


# -- stand-ins -------------------------------------------------------------------------------------------------------
class StandInBuffers:
    """KV buffers that shrink and grow by count (the shape of ``ExtensibleKVCacheBuffers.shrink_blocks`` and
    ``ensure_blocks``); ``fail`` makes the next move raise, ``released`` refuses as sleep mode does."""

    def __init__(self, num_blocks: int, max_num_blocks: int, page: int = PAGE) -> None:
        self.num_blocks, self.max_num_blocks, self.page = num_blocks, max_num_blocks, page
        self.fail: str | None = None
        self.released = False

    def _check(self, n: int) -> None:
        if self.released:
            raise ReleasedError(f"move to {n} blocks on released buffers ({self.num_blocks} on record)")
        if self.fail:
            message, self.fail = self.fail, None
            raise RuntimeError(message)

    def ensure_blocks(self, n: int) -> int:
        self._check(n)
        if n > self.max_num_blocks:
            raise InvalidSizeError(f"num_blocks={n} exceeds max_num_blocks={self.max_num_blocks}")
        self.num_blocks = max(self.num_blocks, n)
        return self.num_blocks

    def shrink_blocks(self, n: int) -> int:
        self._check(n)
        released = (self.num_blocks - n) * self.page
        self.num_blocks = n
        return released

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(
            committed_bytes=self.num_blocks * self.page,
            granularity=2 << 20,
            max_num_blocks=self.max_num_blocks,
            num_blocks=self.num_blocks,
            buffers=[SimpleNamespace(page_size_bytes=self.page, num_segments=1)],
        )


class StandInWorker:
    def __init__(self, rank: int, num_blocks: int, reserved: int) -> None:
        self.rank = rank
        self._extensible_kv_state = WorkerKV(driver=None, buffers=StandInBuffers(num_blocks, reserved))
        self.model_runner = SimpleNamespace(kv_cache_config=SimpleNamespace(num_blocks=num_blocks))
        self.cache_config = SimpleNamespace(num_gpu_blocks=num_blocks)

    @property
    def buffers(self) -> StandInBuffers:
        return self._extensible_kv_state.buffers


class StandInExecutor:
    """``collective_rpc`` by name over the workers, as vLLM's executors resolve a worker RPC."""

    def __init__(self, workers: list[StandInWorker]) -> None:
        self.workers = workers
        self.is_sleeping = False

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [resize.WORKER_RPCS[method](w, *args) for w in self.workers]


def _workers(n: int, reserved: int, ranks: int = 2) -> StandInExecutor:
    return StandInExecutor([StandInWorker(r, n, reserved) for r in range(ranks)])


# -- pure arithmetic -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, match",
    [
        (0, "must be positive, got 0"),
        (-3, "must be positive, got -3"),
        (501, "num_blocks=501 exceeds the reservation of 500 blocks"),
        (5, "num_blocks=5 is below the floor of 18 blocks"),
    ],
)
def test_a_count_out_of_range_is_refused_naming_the_values(value, match):
    with pytest.raises(ResizeRefused, match=match) as info:
        resize.check_count(value, current=100, reserved=500, floor=18)
    assert isinstance(info.value, ValueError) and "100 blocks" in str(info.value)


@pytest.mark.parametrize(
    "value",
    [True, 1.5, "12x", None, [3], "9" * 5000, "\u0663\u0664", "1" * 41],
    ids=["bool", "float", "text", "None", "list", "5000_digits", "arabic_indic_digits", "41_digits"],
)
def test_a_count_that_is_not_an_integer_is_refused_naming_its_type(value):
    with pytest.raises(ResizeArgumentError, match=type(value).__name__):
        resize.check_count(value, current=100, reserved=500, floor=18)


def test_a_count_sent_as_a_decimal_string_is_read_as_collective_rpc_sends_it():
    assert resize.check_count(" 120 ", current=100, reserved=500, floor=18) == 120


def test_a_budget_holds_the_floor_of_its_bytes_less_the_rounding_over_the_bytes_per_block():
    assert resize.blocks_for_budget(10 * PAGE + 100, PAGE, 0) == 10
    assert resize.blocks_for_budget(10 * PAGE + 100, PAGE, 200) == 9
    assert resize.blocks_for_budget(PAGE // 2, PAGE, 0) == 0
    with pytest.raises(ResizeRefused, match="budget_bytes must be positive, got -1"):
        resize.blocks_for_budget(-1, PAGE, 0)


def test_the_floor_is_one_request_of_max_model_len_plus_the_null_block():
    assert resize.floor_blocks(MAX_LEN / BLOCK) == MAX_LEN // BLOCK + 1
    assert resize.floor_blocks(16.2) == 18


@pytest.mark.parametrize(
    "value, error",
    [
        (-1, ResizeRefused),
        (0, ResizeRefused),
        (-0.5, ResizeRefused),
        (2.0**63, ResizeRefused),
        (10**400, ResizeRefused),
        (float("nan"), ResizeArgumentError),
        (float("inf"), ResizeArgumentError),
        ("5", ResizeArgumentError),
        (True, ResizeArgumentError),
        (None, ResizeArgumentError),
    ],
    ids=repr,
)
def test_a_floor_from_blocks_per_request_that_is_no_positive_finite_number_is_refused_naming_it(value, error):
    try:
        got = resize.floor_blocks(value)
    except error as exc:
        assert "blocks_per_request" in str(exc) and repr(value)[:8] in str(exc), f"floor_blocks({value!r}): {exc}"
    except Exception as exc:
        pytest.fail(f"floor_blocks({value!r}): expected {error.__name__}, got {type(exc).__name__}: {exc}")
    else:
        pytest.fail(f"floor_blocks({value!r}): expected {error.__name__}, got the floor {got}")


class Client:
    """An offline ``LLM`` whose engine answers ``collective_rpc`` with ``reply`` (or raises it), recording calls."""

    def __init__(self, reply) -> None:
        self.reply, self.calls = reply, []
        self.llm_engine = SimpleNamespace(collective_rpc=self.collective_rpc)

    def collective_rpc(self, method, args=()):
        self.calls.append((method, args))
        if isinstance(self.reply, BaseException):
            raise self.reply
        return self.reply

    async def collective_rpc_async(self, method, args=()):
        return self.collective_rpc(method, args)


CLIENT_CALLS = [
    ("resize_kv_cache", resize.resize_kv_cache, "num_blocks"),
    ("resize_kv_cache_to_bytes", resize.resize_kv_cache_to_bytes, "budget_bytes"),
]


@pytest.mark.parametrize("name, call, what", CLIENT_CALLS, ids=[c[0] for c in CLIENT_CALLS])
@pytest.mark.parametrize("value", [True, float("nan"), "abc", -1, 0, 2**63, None], ids=repr)
def test_a_client_argument_that_is_no_positive_count_is_refused_before_any_rpc_is_sent(name, call, what, value):
    client = Client([{"from": 100, "to": 40}])
    with pytest.raises(resize.ResizeError) as info:
        call(client, value)
    message = str(info.value)
    assert isinstance(info.value, (ResizeArgumentError, ResizeRefused)), f"{name}({value!r}): got {info.value!r}"
    assert what in message and str(value)[:6] in message, f"{name}({value!r}): the message names neither: {message}"
    assert client.calls == [], f"{name}({value!r}): expected no RPC sent, got {client.calls}"


BAD_REPLIES = ["x", None, [], [None], [1, 2], [{"num_blocks": "NaN"}], [{"num_blocks": 1}, {"num_blocks": 2}]]
STATE = dict(num_blocks=40, reserved_blocks=500, floor_blocks=17, free_blocks=39, running=0, waiting=0,
             bytes_per_block=PAGE)  # fmt: skip


@pytest.mark.parametrize(
    "method, call",
    [
        (resize.RESIZE, lambda llm: resize.resize_kv_cache(llm, 40)),
        (resize.RESIZE_BYTES, lambda llm: resize.resize_kv_cache_to_bytes(llm, 40 * PAGE)),
        (resize.KV_STATE, resize.kv_state),
    ],
    ids=["resize", "resize_bytes", "kv_state"],
)
@pytest.mark.parametrize(
    "reply",
    [
        *BAD_REPLIES,
        [{"from": 100, "to": "40"}],
        [{"num_blocks": "x" * 100_000}],
        [{**STATE, "free_blocks": 40}],
        [{**STATE, "num_blocks": 501}],
        [{**STATE, "running": -1}],
    ],
    ids=lambda r: repr(r)[:40],
)
def test_a_reply_not_of_its_documented_shape_is_refused_naming_the_call_and_the_reply_shortened(method, call, reply):
    try:
        got = call(Client(reply))
    except resize.ResizeReplyError as exc:
        message = str(exc)
        assert method in message and "the reply was" in message and len(message) < 600, message
    except Exception as exc:
        pytest.fail(f"{method} with reply {repr(reply)[:60]}: expected ResizeReplyError, got {exc!r}"[:300])
    else:
        pytest.fail(f"{method} with reply {repr(reply)[:60]}: expected ResizeReplyError, got the reply {got!r}"[:300])


def test_a_resize_reply_at_another_count_than_asked_is_refused():
    with pytest.raises(resize.ResizeReplyError, match="asked for 40 blocks, the reply says 41"):
        resize.resize_kv_cache(Client([{"from": 100, "to": 41}]), 40)


def test_replies_of_the_documented_shape_are_returned():
    assert resize.kv_state(Client([STATE])) == STATE
    assert resize.resize_kv_cache(Client([{"from": 100, "to": 40}]), "40") == {"from": 100, "to": 40}


@pytest.mark.parametrize("method", [resize.RESIZE, resize.KV_STATE])
def test_a_timeout_of_the_rpc_is_the_typed_timeout_naming_the_call(method):
    client = Client(TimeoutError("RPC call to collective_rpc timed out"))
    try:
        resize.kv_state(client) if method == resize.KV_STATE else resize.resize_kv_cache(client, 40)
    except resize.ResizeTimeout as exc:
        assert isinstance(exc, TimeoutError) and method in str(exc) and "timed out" in str(exc), str(exc)
    except BaseException as exc:
        pytest.fail(f"{method} timing out: expected ResizeTimeout, got {type(exc).__name__}: {exc}")


def test_the_async_clients_check_the_argument_the_reply_and_a_timeout_alike():
    import asyncio

    def run(reply, call, *args):
        client = Client(reply)
        return asyncio.run(call(SimpleNamespace(collective_rpc=client.collective_rpc_async), *args)), client

    with pytest.raises(ResizeArgumentError, match="num_blocks"):
        run([], resize.resize_kv_cache_async, True)
    with pytest.raises(resize.ResizeReplyError, match="expected a list of one dict"):
        run([1, 2], resize.resize_kv_cache_async, 40)
    with pytest.raises(resize.ResizeReplyError, match="free_blocks"):
        run([{**STATE, "free_blocks": 40}], resize.kv_state_async)
    with pytest.raises(resize.ResizeTimeout, match=resize.RESIZE_BYTES):
        run(TimeoutError(), resize.resize_kv_cache_to_bytes_async, PAGE)
    assert run([STATE], resize.kv_state_async)[0] == STATE


def test_a_typed_error_survives_a_utility_call_that_carries_only_its_message():
    sent = ResizeWhileAsleep("resize to 40 blocks refused: the engine is asleep at 100 blocks")
    back = resize.typed(RuntimeError(f"Call to collective_rpc method failed: {sent}"))
    assert type(back) is ResizeWhileAsleep and "asleep at 100 blocks" in str(back)
    other = RuntimeError("something else")
    assert resize.typed(other) is other


# -- the workers' agreement ------------------------------------------------------------------------------------------
def test_every_rank_moves_to_the_count_and_reports_it():
    executor = _workers(100, 500)
    replies = resize.move_workers(executor.collective_rpc, 100, 40)
    assert [r["num_blocks"] for r in replies] == [40, 40]
    assert [w.buffers.num_blocks for w in executor.workers] == [40, 40]
    assert [w.model_runner.kv_cache_config.num_blocks for w in executor.workers] == [40, 40]
    assert replies[0]["bytes"] == -60 * PAGE


@pytest.mark.parametrize("old, new", [(100, 40), (40, 80)])
def test_a_failing_rank_moves_every_rank_back_to_the_old_count(old, new):
    executor = _workers(old, 500)
    executor.workers[1].buffers.fail = "rank 1: out of device memory"
    with pytest.raises(ResizeFailed, match=f"rank 1: rank 1: out of device memory.*every rank is back at {old}"):
        resize.move_workers(executor.collective_rpc, old, new)
    assert [w.buffers.num_blocks for w in executor.workers] == [old, old]


def test_an_interrupt_after_the_ranks_moved_moves_every_rank_back_before_it_propagates():
    executor = _workers(100, 500)
    calls = []

    def rpc(name, args=()):
        calls.append(args)
        replies = executor.collective_rpc(name, args=args)
        if len(calls) == 1:  # every rank moved, then the interrupt lands before the replies are read
            raise KeyboardInterrupt
        return replies

    with pytest.raises(KeyboardInterrupt):
        resize.move_workers(rpc, 100, 40)
    assert calls == [(40,), (100,)] and [w.buffers.num_blocks for w in executor.workers] == [100, 100]


def test_a_budget_per_block_that_is_not_an_integer_is_refused():
    with pytest.raises(ResizeArgumentError, match="bytes_per_block"):
        resize.blocks_for_budget(100, 0.5, 0)


def test_a_worker_rpc_answers_a_refusal_instead_of_raising():
    worker = StandInWorker(0, 100, 500)
    worker.buffers.released = True
    reply = resize.extensible_kv_set_blocks(worker, 40)
    assert reply["ok"] is False and reply["num_blocks"] == 100 and "released buffers" in reply["error"]


@pytest.mark.parametrize("value", [2.9, True, 0, -1, None, "2.5", 2**64])
def test_a_worker_rpc_refuses_a_count_that_is_no_positive_integer_and_moves_nothing(value):
    # wrong: int() of the count (2.9 moved to 2 blocks, True to 1, 0 to none), or ok that disagrees with the count
    worker = StandInWorker(0, 100, 500)
    reply = resize.extensible_kv_set_blocks(worker, value)
    got = (reply["ok"], reply["num_blocks"], worker.buffers.num_blocks, "num_blocks" in (reply["error"] or ""))
    assert got == (False, 100, 100, True), (
        f"extensible_kv_set_blocks({value!r}): expected (False, 100, 100, True), got {got}: {reply}"
    )


def test_buffers_that_cannot_shrink_are_named():
    worker = StandInWorker(0, 100, 500)
    del StandInBuffers.shrink_blocks  # restored below
    try:
        reply = resize.extensible_kv_set_blocks(worker, 40)
    finally:
        StandInBuffers.shrink_blocks = _shrink
    assert reply["ok"] is False and "StandInBuffers has no shrink_blocks" in reply["error"]


_shrink = StandInBuffers.shrink_blocks


# -- the scheduler's side, on vLLM's real classes -------------------------------------------------------------------
def _vllm():
    if os.environ.get("EXTENSIBLE_KV_REQUIRE_VLLM") == "1":
        import vllm  # noqa: F401 - a missing vllm must fail here
    return pytest.importorskip("vllm")


class Engine:
    """A scheduler built from vLLM's own ``KVCacheManager``, request queue, ``Request`` and ``Scheduler`` methods
    (preemption, block frees), an engine core around it, and stand-in workers."""

    def __init__(self, num_blocks: int = 100, reserved: int = 500, caching: bool = True, ranks: int = 2) -> None:
        _vllm()
        import torch
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.interface import PauseState
        from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
        from vllm.v1.request import Request

        init_none_hash(sha256)
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float16)
        config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[KVCacheTensor(size=spec.page_size_bytes * num_blocks, shared_by=["l0"])],
            kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
        )
        manager = KVCacheManager(
            config, max_model_len=MAX_LEN, scheduler_block_size=BLOCK, hash_block_size=BLOCK, enable_caching=caching
        )

        class SchedulerStandIn:
            _preempt_request = Scheduler._preempt_request
            _free_request_blocks = Scheduler._free_request_blocks
            _drain_deferred_frees = Scheduler._drain_deferred_frees
            set_pause_state = Scheduler.set_pause_state
            pause_state = Scheduler.pause_state

        s = SchedulerStandIn()
        s.kv_cache_manager, s.running, s.waiting = manager, [], create_request_queue(SchedulingPolicy.FCFS)
        s.encoder_cache_manager = SimpleNamespace(free=lambda request: None)
        s._inflight_prefills, s.log_stats, s.reset_preempted_req_ids = set(), False, set()
        s.defer_block_free, s.deferred_frees, s.processed_step_seq, s.sched_step_seq = False, [], 0, 0
        s.prev_step_scheduled_req_ids, s._pause_state, s.connector = set(), PauseState.UNPAUSED, None
        self.scheduler = s
        self.PauseState = PauseState
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(max_model_len=MAX_LEN),
            parallel_config=SimpleNamespace(decode_context_parallel_size=1),
            cache_config=SimpleNamespace(
                num_gpu_blocks=num_blocks, kv_cache_size_tokens=num_blocks * BLOCK, kv_cache_max_concurrency=1.0
            ),
        )
        self.model_executor = _workers(num_blocks, reserved, ranks)
        self._extensible_kv_reports = {"reserved_blocks": reserved}
        self._make = lambda rid, tokens: Request(
            rid, tokens, SamplingParams(max_tokens=8), None, block_hasher=get_request_block_hasher(BLOCK, sha256)
        )

    @property
    def pool(self):
        return self.scheduler.kv_cache_manager.block_pool

    def run(self, rid: str, num_tokens: int, first_token: int = 0):
        """A running request holding the blocks of ``num_tokens`` prompt tokens (cached as vLLM caches them)."""
        from vllm.v1.request import RequestStatus

        request = self._make(rid, list(range(first_token, first_token + num_tokens)))
        got = self.scheduler.kv_cache_manager.allocate_slots(request, num_tokens)
        assert got is not None, f"no room for {rid}"
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_tokens
        self.scheduler.running.append(request)
        return request

    def finish(self, request) -> None:
        self.scheduler.running.remove(request)
        self.scheduler.kv_cache_manager.free(request)

    def ids(self, request) -> list[int]:
        return [b for ids in self.scheduler.kv_cache_manager.get_block_ids(request.request_id) for b in ids]

    def cached_ids(self) -> set[int]:
        return {b.block_id for b in self.pool.blocks if b.block_hash is not None}

    def snapshot(self) -> tuple:
        pool = self.pool
        return (
            pool.num_gpu_blocks,
            len(pool.blocks),
            pool.get_num_free_blocks(),
            len(pool.cached_block_hash_to_block),
            [w.buffers.num_blocks for w in self.model_executor.workers],
            [r.request_id for r in self.scheduler.running],
            self.vllm_config.cache_config.num_gpu_blocks,
        )


def _fill(engine: Engine) -> list:
    """Requests until the pool is dry: every block they get."""
    got = []
    i = 0
    while engine.pool.get_num_free_blocks() >= 1:
        got += engine.ids(engine.run(f"fill{i}", BLOCK, first_token=10_000 * (i + 1)))
        i += 1
    return got


@needs_vllm
def test_after_a_shrink_no_block_at_or_above_the_count_is_allocatable_or_cached():
    engine = Engine(num_blocks=100)
    for i in range(6):  # 6 x 16 blocks, cached, then freed: eviction candidates up to block 96
        engine.finish(engine.run(f"old{i}", 16 * BLOCK, first_token=1000 * i))
    assert max(engine.cached_ids()) >= 40
    resize.engine_resize(engine, 40)
    assert not {b for b in engine.cached_ids() if b >= 40}, "a block above the count is still in the prefix cache"
    assert all(b.block_id < 40 for b in engine.pool.free_block_queue.get_all_free_blocks())
    assert engine.pool.get_num_free_blocks() == 39 and engine.pool.num_gpu_blocks == 40
    assert max(_fill(engine)) < 40, "a block above the count was handed out"
    assert engine.vllm_config.cache_config.num_gpu_blocks == 40
    assert engine.scheduler.kv_cache_manager.kv_cache_config.num_blocks == 40


@needs_vllm
@pytest.mark.parametrize(
    "step, value, error",
    [
        ("take_out", -1, ResizeRefused),
        ("take_out", 0, ResizeRefused),
        ("take_out", True, ResizeArgumentError),
        ("put_back", 21.5, ResizeArgumentError),
        ("put_back", "130", None),  # a decimal string, as collective_rpc sends it: read as 130
    ],
)
def test_the_pool_steps_refuse_counts_they_cannot_take_and_change_nothing(step, value, error):
    engine = Engine(num_blocks=100)
    before = engine.snapshot()
    call = getattr(resize, step)
    if error is None:
        call(engine.scheduler, engine.vllm_config, value)
        assert engine.pool.num_gpu_blocks == int(value)
        return
    with pytest.raises(error, match=repr(value) if error is ResizeArgumentError else str(value)):
        call(engine.scheduler, engine.vllm_config, value)
    assert engine.snapshot() == before


@needs_vllm
def test_the_prefix_cache_keeps_no_entry_for_a_block_taken_out():
    engine = Engine(num_blocks=100)
    for i in range(6):
        engine.finish(engine.run(f"old{i}", 16 * BLOCK, first_token=1000 * i))
    resize.engine_resize(engine, 40)
    mapped = set()
    for entry in engine.pool.cached_block_hash_to_block._cache.values():
        mapped |= set(entry) if isinstance(entry, dict) else {entry.block_id}
    assert not {b for b in mapped if b >= 40}, f"hash map entries for blocks {sorted(b for b in mapped if b >= 40)}"


@needs_vllm
def test_requests_holding_blocks_above_the_count_are_preempted_and_the_others_keep_running():
    from vllm.v1.request import RequestStatus

    engine = Engine(num_blocks=100)
    low = engine.run("low", 8 * BLOCK)  # blocks 1..8
    engine.run("pad", 40 * BLOCK, first_token=5000)  # blocks 9..48
    high = engine.run("high", 8 * BLOCK, first_token=9000)  # blocks 49..56
    engine.finish(engine.scheduler.running[1])
    result = resize.engine_resize(engine, 30)
    assert result["preempted"] == ["high"] and high.status == RequestStatus.PREEMPTED
    assert [r.request_id for r in engine.scheduler.running] == ["low"] and low.status == RequestStatus.RUNNING
    assert engine.scheduler.waiting.peek_request() is high and high.num_computed_tokens == 0
    assert engine.pool.get_num_free_blocks() == 30 - 1 - len(engine.ids(low))
    assert "high" in engine.scheduler.reset_preempted_req_ids


@needs_vllm
def test_growing_makes_the_blocks_allocatable_again_with_the_free_count_right():
    engine = Engine(num_blocks=100)
    resize.engine_resize(engine, 40)
    running = engine.run("r", 8 * BLOCK)
    result = resize.engine_resize(engine, 120)
    assert result["from"] == 40 and result["to"] == 120
    assert engine.pool.num_gpu_blocks == 120 and len(engine.pool.blocks) == 120
    assert engine.pool.get_num_free_blocks() == 120 - 1 - len(engine.ids(running))
    assert [w.buffers.num_blocks for w in engine.model_executor.workers] == [120, 120]
    got = _fill(engine)
    assert max(got) == 119 and set(range(40, 120)) <= set(got)


@needs_vllm
@pytest.mark.parametrize(
    "value, error, match",
    [
        (501, ResizeRefused, "exceeds the reservation of 500"),
        (0, ResizeRefused, "must be positive, got 0"),
        (-1, ResizeRefused, "must be positive, got -1"),
        (10, ResizeRefused, "below the floor of 17"),
        (2.5, ResizeArgumentError, "float"),
    ],
)
def test_bad_input_is_refused_and_nothing_changes(value, error, match):
    engine = Engine(num_blocks=100)
    engine.run("r", 8 * BLOCK, first_token=7000)
    before = engine.snapshot()
    with pytest.raises(error, match=match):
        resize.engine_resize(engine, value)
    assert engine.snapshot() == before


@needs_vllm
def test_a_resize_while_asleep_or_paused_is_refused_and_nothing_changes():
    engine = Engine(num_blocks=100)
    engine.model_executor.is_sleeping = True
    before = engine.snapshot()
    with pytest.raises(ResizeWhileAsleep, match="asleep at 100 blocks"):
        resize.engine_resize(engine, 40)
    engine.model_executor.is_sleeping = False
    engine.scheduler.set_pause_state(engine.PauseState.PAUSED_NEW)
    with pytest.raises(ResizeWhileAsleep, match="paused at 100 blocks"):
        resize.engine_resize(engine, 40)
    assert engine.snapshot() == before


@needs_vllm
def test_a_failing_rank_leaves_the_pool_and_every_rank_at_the_old_count():
    engine = Engine(num_blocks=100)
    for i in range(6):
        engine.finish(engine.run(f"old{i}", 16 * BLOCK, first_token=1000 * i))
    engine.model_executor.workers[1].buffers.fail = "rank 1 cannot release"
    with pytest.raises(ResizeFailed, match="rank 1 cannot release"):
        resize.engine_resize(engine, 40)
    assert engine.pool.num_gpu_blocks == 100 and engine.pool.get_num_free_blocks() == 99
    assert [w.buffers.num_blocks for w in engine.model_executor.workers] == [100, 100]
    assert max(_fill(engine)) == 99


@needs_vllm
def test_a_failing_rank_on_growth_leaves_the_pool_at_the_old_count():
    engine = Engine(num_blocks=100)
    engine.model_executor.workers[0].buffers.fail = "rank 0 out of memory"
    with pytest.raises(ResizeFailed, match="rank 0 out of memory"):
        resize.engine_resize(engine, 200)
    assert engine.pool.num_gpu_blocks == 100 and len(engine.pool.blocks) == 100
    assert [w.buffers.num_blocks for w in engine.model_executor.workers] == [100, 100]


@needs_vllm
def test_a_budget_in_bytes_resizes_to_the_blocks_it_holds():
    engine = Engine(num_blocks=100)
    reply = resize.engine_call(engine, resize.RESIZE_BYTES, (str(50 * PAGE + (2 << 20)),), None)
    assert reply[0]["to"] == 50 and engine.pool.num_gpu_blocks == 50
    reply = resize.engine_call(engine, resize.RESIZE_BYTES, (10**15,), None)
    assert reply[0]["to"] == 500, "a budget above the reservation is clamped to it"


@needs_vllm
def test_the_kv_state_names_counts_and_load():
    engine = Engine(num_blocks=100)
    engine.run("r", 8 * BLOCK)
    (state,) = resize.engine_call(engine, resize.KV_STATE, (), None)
    assert state["num_blocks"] == 100 and state["reserved_blocks"] == 500 and state["floor_blocks"] == 17
    assert state["running"] == 1 and state["free_blocks"] == 91 and state["bytes_per_block"] == PAGE


class BusyEngine(Engine):
    """An engine-core process (``EngineCoreProc``) with a step in flight: idle callbacks and an input queue."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._idle_state_callbacks: list = []
        self.input_queue: queue.Queue = queue.Queue()
        self.busy = True

    def has_work(self) -> bool:
        return self.busy

    def go_idle(self) -> None:
        self.busy = False
        while self._idle_state_callbacks:
            self._idle_state_callbacks.pop()(self)


@needs_vllm
def test_a_busy_engine_pauses_resizes_when_idle_and_resumes():
    engine = BusyEngine(num_blocks=100)
    engine.run("r", 8 * BLOCK, first_token=3000)
    future = resize.engine_resize(engine, 40)
    assert isinstance(future, Future) and not future.done()
    assert engine.scheduler.pause_state == engine.PauseState.PAUSED_ALL
    assert engine.pool.num_gpu_blocks == 100, "resized with a step in flight"
    engine.go_idle()
    assert future.result()["to"] == 40 and engine.pool.num_gpu_blocks == 40
    assert engine.scheduler.pause_state == engine.PauseState.UNPAUSED
    assert engine.input_queue.qsize() >= 1, "the busy loop was not woken to resume"


@needs_vllm
def test_a_resize_racing_another_is_refused_naming_both():
    engine = BusyEngine(num_blocks=100)
    future = resize.engine_resize(engine, 40)
    with pytest.raises(ResizeInProgress, match="resize to 60 blocks refused: a resize to 40 blocks is in progress"):
        resize.engine_resize(engine, 60)
    engine.go_idle()
    assert future.result()["to"] == 40
    engine.busy = True
    assert isinstance(resize.engine_resize(engine, 60), Future), "the refusal outlived the resize it named"


@needs_vllm
def test_a_failed_resize_in_a_busy_engine_resumes_it_at_the_old_size():
    engine = BusyEngine(num_blocks=100)
    engine.model_executor.workers[1].buffers.fail = "rank 1 cannot release"
    future = resize.engine_resize(engine, 40)
    engine.go_idle()
    with pytest.raises(ResizeFailed):
        future.result()
    assert engine.pool.num_gpu_blocks == 100 and engine.scheduler.pause_state == engine.PauseState.UNPAUSED


@needs_vllm
def test_the_offline_helpers_go_through_collective_rpc_and_raise_typed():
    engine = Engine(num_blocks=100)
    rpc = resize.engine_collective_rpc(lambda self, method, timeout, args, kwargs: ["worker"])
    llm = SimpleNamespace(llm_engine=SimpleNamespace(collective_rpc=lambda m, args=(): rpc(engine, m, None, args)))
    assert resize.resize_kv_cache(llm, 40)["to"] == 40
    assert resize.kv_state(llm)["num_blocks"] == 40
    assert rpc(engine, "other", None, (), None) == ["worker"]

    def remote(method, args=()):  # a multiprocess client: only the message crosses
        try:
            return rpc(engine, method, None, args, None)
        except Exception as exc:
            raise RuntimeError(f"Call to collective_rpc method failed: {exc}") from None

    with pytest.raises(ResizeRefused, match="exceeds the reservation of 500"):
        resize.resize_kv_cache(SimpleNamespace(llm_engine=SimpleNamespace(collective_rpc=remote)), 900)


# -- the real KV buffers on the host driver --------------------------------------------------------------------------
def _real_worker(num_blocks: int = 100, reserved: int = 500) -> StandInWorker:
    from extensible_kv.drivers.host import HostDriver
    from extensible_kv.kv_cache import ExtensibleKVCacheBuffers, KVBuffer

    worker = StandInWorker(0, num_blocks, reserved)
    buffers = ExtensibleKVCacheBuffers(
        [KVBuffer("kv0", PAGE, num_segments=1), KVBuffer("kv1", 2 * PAGE, num_segments=2)],
        reserved,
        driver=HostDriver(granularity=4096),
    )
    buffers.ensure_blocks(num_blocks)
    worker._extensible_kv_state = WorkerKV(driver=None, buffers=buffers)
    return worker


def test_real_buffers_shrink_and_grow_under_the_same_addresses_keeping_the_blocks_below():
    worker = _real_worker()
    buffers = worker.buffers
    try:
        raw = buffers.raw("kv0")
        base = raw.data_ptr()
        raw[: 40 * PAGE].fill_(7)
        reply = resize.extensible_kv_set_blocks(worker, 40)
        assert reply["ok"] and reply["num_blocks"] == 40 and reply["bytes"] == -60 * 3 * PAGE
        assert buffers.stats().committed_bytes == 40 * 3 * PAGE
        reply = resize.extensible_kv_set_blocks(worker, 300)
        assert reply["ok"] and reply["bytes"] == 260 * 3 * PAGE and buffers.num_blocks == 300
        assert buffers.raw("kv0").data_ptr() == base and bool(buffers.raw("kv0")[: 40 * PAGE].eq(7).all())
        assert resize.extensible_kv_block_bytes(worker) == {
            "bytes_per_block": 3 * PAGE,
            "rounding_bytes": 3 * 4096,
            "max_num_blocks": 500,
            "num_blocks": 300,
        }
    finally:
        del raw
        buffers.close()


def test_real_buffers_pinned_by_a_connector_refuse_the_shrink_and_keep_their_size():
    worker = _real_worker()
    try:
        worker.buffers.pin("KV connector X")
        reply = resize.extensible_kv_set_blocks(worker, 40)
        assert reply["ok"] is False and reply["num_blocks"] == 100 and "KV connector X" in reply["error"]
        assert worker.buffers.num_blocks == 100
    finally:
        worker.buffers.close()


def test_real_buffers_released_for_sleep_refuse_the_resize():
    worker = _real_worker()
    try:
        worker.buffers.release_physical()
        reply = resize.extensible_kv_set_blocks(worker, 40)
        assert reply["ok"] is False and "released" in reply["error"] and worker.buffers.num_blocks == 100
    finally:
        worker.buffers.close()


@needs_vllm
def test_an_in_process_engine_core_resizes_at_once_between_steps():
    engine = Engine(num_blocks=100)
    engine._idle_state_callbacks = []  # EngineCore's own, though only EngineCoreProc has has_work()
    engine.batch_queue = None
    assert resize.engine_resize(engine, 40)["to"] == 40 and engine.pool.num_gpu_blocks == 40


@needs_vllm
def test_a_sleep_that_went_idle_first_fails_the_pending_resize_and_keeps_its_pause():
    engine = BusyEngine(num_blocks=100)
    future = resize.engine_resize(engine, 40)
    engine.scheduler.set_pause_state(engine.PauseState.PAUSED_NEW)  # sleep(level=1): pause, then the executor sleeps
    engine.model_executor.is_sleeping = True
    engine.go_idle()
    with pytest.raises(ResizeWhileAsleep, match="asleep at 100 blocks"):
        future.result()
    assert engine.pool.num_gpu_blocks == 100 and engine.scheduler.pause_state == engine.PauseState.PAUSED_NEW
    assert [w.buffers.num_blocks for w in engine.model_executor.workers] == [100, 100]


@needs_vllm
def test_an_engine_keeps_its_resizing_rpc_on_the_instance_after_the_patches_are_removed():
    engine = Engine(num_blocks=100)

    class Core:
        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            return [f"workers: {method}"]

    core = Core()
    core.__dict__.update(vars(engine))
    resize.bind_engine(core)
    resize.bind_engine(core)  # idempotent
    assert core.collective_rpc(resize.RESIZE, args=(40,))[0]["to"] == 40
    assert core.collective_rpc("other") == ["workers: other"]
    assert "extensible_kv_original" not in vars(Core.collective_rpc)


class ServedEngine(BusyEngine):
    """A busy engine-core process with vLLM's own ``collective_rpc`` to wrap (its executor's)."""

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return self.model_executor.collective_rpc(method, timeout, args, kwargs)


def _utility(engine, args: tuple) -> list:
    """One utility call as ``EngineCoreProc._handle_client_request`` makes it: vLLM's argument conversion and
    ``_invoke_utility_method`` (which waits on a Future result); returns what it enqueued."""
    from vllm.v1.engine import UtilityOutput
    from vllm.v1.engine.core import EngineCoreProc

    method = engine.collective_rpc
    converted = EngineCoreProc._convert_msgspec_args(method, args)
    sent: list = []
    EngineCoreProc._invoke_utility_method(
        "collective_rpc", lambda: method(*converted), UtilityOutput(call_id=1), sent.append
    )
    return sent


@needs_vllm
def test_vllms_utility_machinery_waits_for_the_resize_and_returns_its_reply():
    engine = ServedEngine(num_blocks=100)
    resize.bind_engine(engine)
    sent = _utility(engine, (resize.RESIZE, None, ["40"], {}))  # /collective_rpc sends strings
    assert sent == [], "answered before the engine went idle"
    engine.go_idle()
    (output,) = sent
    assert output.failure_message is None and output.result.result[0]["to"] == 40
    passed_on = _utility(engine, (resize.WORKER_BLOCK_BYTES, None, (), None))[0].result.result  # to the workers
    assert [r["bytes_per_block"] for r in passed_on] == [PAGE, PAGE]


@needs_vllm
def test_a_refusal_crosses_vllms_utility_machinery_typed():
    engine = ServedEngine(num_blocks=100)
    resize.bind_engine(engine)
    (output,) = _utility(engine, (resize.RESIZE, None, ["900"], {}))
    assert output.result is None and "[ResizeRefused]" in output.failure_message
    error = resize.typed(Exception(output.failure_message))
    assert type(error) is ResizeRefused and "exceeds the reservation of 500" in str(error)


@needs_vllm
def test_vllms_busy_loop_resizes_when_idle_and_steps_again_without_new_input():
    import threading

    from vllm.v1.engine.core import EngineCoreProc

    engine = ServedEngine(num_blocks=100)
    engine.run("r", 8 * BLOCK, first_token=3000)
    paused = engine.PauseState.PAUSED_ALL
    # EngineCoreProc.has_work: a running request is work unless the scheduler is paused with "keep"
    engine.has_work = lambda: bool(engine.scheduler.running) and engine.scheduler.pause_state != paused
    engine.is_running = lambda: True
    engine.process_input_queue_block = True
    engine.aborts_queue = queue.Queue()
    engine._handle_client_request = EngineCoreProc._handle_client_request.__get__(engine)
    engine._notify_idle_state_callbacks = EngineCoreProc._notify_idle_state_callbacks.__get__(engine)
    engine.busy_loop_input = EngineCoreProc._process_input_queue.__get__(engine)
    engine.busy = True
    future = resize.engine_resize(engine, 40)  # handled between steps: the engine is busy, so it pauses
    while not engine.input_queue.empty():
        engine.input_queue.get_nowait()  # the first wake-up is for the loop that is already awake
    done = threading.Event()
    thread = threading.Thread(target=lambda: (engine.busy_loop_input(), done.set()), daemon=True)
    thread.start()
    assert done.wait(10), "the busy loop stayed blocked on its input queue after the resize"
    assert future.result()["to"] == 40 and engine.pool.num_gpu_blocks == 40
    assert engine.has_work(), "the engine did not resume its running request"


@needs_vllm
def test_a_shrink_and_a_growth_back_give_back_the_watermark_and_capacity_figures():
    engine = Engine(num_blocks=100)
    manager, cache = engine.scheduler.kv_cache_manager, engine.vllm_config.cache_config
    manager.watermark_blocks = 3  # vLLM's int(0.03 x 100)
    before = (manager.watermark_blocks, cache.kv_cache_size_tokens, cache.kv_cache_max_concurrency)
    resize.engine_resize(engine, 20)
    assert (manager.watermark_blocks, cache.kv_cache_size_tokens) == (0, 320)
    resize.engine_resize(engine, 100)
    assert (manager.watermark_blocks, cache.kv_cache_size_tokens, cache.kv_cache_max_concurrency) == before


@pytest.mark.parametrize("rounding", [-1, -(10 * PAGE)])
def test_a_negative_rounding_bound_is_refused_naming_it_not_clamped(rounding):
    # a worker that reports a negative rounding bound is wrong; clamping it to 0 would hide that
    with pytest.raises(ResizeUnsupported, match=f"rounding must be at least 0, got {rounding}"):
        resize.blocks_for_budget(10 * PAGE, PAGE, rounding)


@needs_vllm
@pytest.mark.parametrize(
    ("args", "kwargs"), [(5, None), ("1200", None), ((), ["1200"]), ((), "n=12")], ids=["int", "str", "list", "str-kw"]
)
def test_arguments_of_another_shape_are_refused_naming_them(args, kwargs):
    # wrong: an int as args was iterated (TypeError), a list as kwargs asked for .values() (AttributeError)
    engine = Engine(num_blocks=100)
    with pytest.raises(ResizeArgumentError, match="takes its arguments as a list and a mapping"):
        resize.engine_call(engine, resize.RESIZE, args, kwargs)
    assert engine.pool.num_gpu_blocks == 100
