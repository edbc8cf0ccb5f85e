"""Note [Torch's cache, held to the budget] (``extensible_kv.vllm.sizing``): the cap on torch's caching allocator
after the final commit, derived from what the worker measured, and the worker setting it on its own device."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from extensible_kv.drivers import Ledger
from extensible_kv.drivers.host import HostDriver
from extensible_kv.errors import InvalidArgumentError, InvalidSizeError
from extensible_kv.vllm import worker_kv
from extensible_kv.vllm.sizing import CODE_GRANULES, SEGMENT, MemoryState, served_step_bound, torch_cap

MIB = 1 << 20
CODE = CODE_GRANULES * SEGMENT


@st.composite
def measured_and_commit(draw):
    """A worker's measurements after warmup, then the commit of ``blocks()`` as the driver rounds it: the KV bytes
    backed after the commit lie between the blocks' bytes and the blocks' bytes plus the rounding bound."""
    bytes_per_block = draw(st.integers(1, 64)) * 64 * 1024
    rounding_bound = draw(st.integers(1, 8)) * SEGMENT
    capacity = draw(st.integers(1, 200_000))
    committed = draw(st.integers(1, capacity))
    kv_backed = committed * bytes_per_block + draw(st.integers(0, rounding_bound))
    non_kv = draw(st.integers(0, 160 << 30))
    init_free = kv_backed + non_kv + draw(st.integers(0, 160 << 30))  # what was free when the worker started
    requested = draw(st.integers(1 << 28, max(1 << 28, init_free)))
    again_reserved = draw(st.integers(0, 4 << 30))
    served_reserved = draw(st.integers(0, 4 << 30))
    m = MemoryState(
        init_free=init_free,
        requested=requested,
        free_now=init_free - non_kv - kv_backed,
        kv_backed=kv_backed,
        weights=0,
        profiled_peak=0,
        bytes_per_block=bytes_per_block,
        rounding_bound=rounding_bound,
        capacity_blocks=capacity,
        committed_blocks=committed,
        again_reserved=again_reserved,
        again_retained=draw(st.integers(0, again_reserved)),
        served_reserved=served_reserved,
        served_retained=draw(st.integers(0, served_reserved)),
        margin=draw(st.sampled_from([0, MIB, 64 * MIB])),
        served_step=served_step_bound(draw(st.booleans())),
    )
    blocks = m.blocks()
    kv_after = blocks * bytes_per_block + draw(st.integers(0, rounding_bound))
    used_after = m.non_kv + kv_after
    reserved_now = draw(st.integers(0, non_kv))  # torch's reserve is part of what is not KV
    return m, blocks, used_after, reserved_now


@given(measured_and_commit())
def test_torch_grown_to_its_cap_keeps_the_engine_within_the_budget(case):
    m, blocks, used_after, reserved_now = case
    fit = max(0, m.budget - m.rounding_bound) // m.bytes_per_block
    if fit < m.committed_blocks:
        return  # the commit was clamped at what warmup committed: over the budget before any cap (next test)
    cap = torch_cap(m, used_after, reserved_now)
    at_cap = used_after + (cap - reserved_now) + CODE + m.margin
    assert at_cap <= m.requested, (
        f"torch_cap({m.to_dict()}, used={used_after}, reserved={reserved_now}) = {cap}: expected torch at its cap, the "
        f"code granules and the margin within requested={m.requested}, got {at_cap} ({at_cap - m.requested} over)"
    )


@given(measured_and_commit())
def test_the_cap_always_leaves_torch_the_worst_batches_growth_and_a_served_steps_small_segments(case):
    m, _, used_after, reserved_now = case
    cap = torch_cap(m, used_after, reserved_now)
    needed = m.torch_growth + (m.served_step - CODE)
    assert cap - reserved_now >= needed, (
        f"torch_cap({m.to_dict()}, used={used_after}, reserved={reserved_now}) = {cap}: expected at least "
        f"{needed} bytes above torch's reserve (growth {m.torch_growth} + small segments {m.served_step - CODE}), "
        f"got {cap - reserved_now}"
    )


def test_the_cap_is_reserve_plus_what_the_budget_leaves():
    m = MemoryState(
        **_valid(free_now=0, kv_backed=0, capacity_blocks=1, margin=MIB, served_step=served_step_bound(True))
    )
    # 70 GiB requested (71,680 MiB), 69,000 MiB used after the commit: 2,680 MiB left, less the 1 MiB margin and
    # 8 MiB of code.
    assert torch_cap(m, used_now=69_000 * MIB, reserved_now=500 * MIB) == (500 + 2_680 - 1 - 8) * MIB


class FakeCache:
    """torch's caching allocator as the worker sees it: a reserve that ``empty_cache`` brings down to what is live,
    and the settings given."""

    def __init__(self, reserved: int, live: int):
        self.reserved, self.live, self.calls = reserved, live, []

    def empty_cache(self):
        self.calls.append("empty_cache")
        self.reserved = self.live


def _fake_cuda(monkeypatch, free: int, total: int, cache: FakeCache) -> list:
    monkeypatch.setattr(worker_kv, "_allocator_settings", lambda text: cache.calls.append(text))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: cache.reserved)
    monkeypatch.setattr(torch.cuda, "empty_cache", cache.empty_cache)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda *a: cache.calls.append(("fraction", a)))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    return cache.calls


def _capped_worker(monkeypatch, cap: int, reserved: int, live: int):
    cache = FakeCache(reserved, live)
    _fake_cuda(monkeypatch, free=10 << 30, total=80 << 30, cache=cache)
    state = worker_kv.WorkerKV(Ledger(HostDriver(granularity=4096)))
    state.measured = SimpleNamespace(init_free=79 << 30)
    seen = {}

    def cap_of(measured, used_now, reserved_now):
        seen.update(measured=measured, used=used_now, reserved=reserved_now)
        return cap

    monkeypatch.setattr(worker_kv, "torch_cap", cap_of)
    return state, cache, seen


def test_the_worker_makes_segments_expandable_empties_the_cache_then_derives_the_cap_from_what_is_left(monkeypatch):
    state, cache, seen = _capped_worker(monkeypatch, cap=1 << 30, reserved=900 * MIB, live=600 * MIB)
    assert state.hold_torch_to_budget() == 1 << 30
    expected_calls = ["expandable_segments:True", "empty_cache"]  # no fraction: the cap refuses nothing
    assert cache.calls == expected_calls, (
        f"hold_torch_to_budget: expected the calls {expected_calls}, got {cache.calls}"
    )
    # the cap is derived from the reserve after emptying: what the worst batches left cached is not kept
    assert seen == {"measured": state.measured, "used": (79 << 30) - (10 << 30), "reserved": 600 * MIB}, seen
    expected = {
        "cap": 1 << 30,
        "used": (79 << 30) - (10 << 30),
        "reserved": 600 * MIB,
        "total": 80 << 30,
        "expandable": True,
        "trims": 0,
        "highest_before_trim": 600 * MIB,
    }
    assert state.torch_cap == expected, f"WorkerKV.torch_cap: expected {expected}, got {state.torch_cap}"


def test_vllm_is_told_segments_are_expandable_so_its_sleep_pool_turns_them_off_around_itself(monkeypatch):
    state, _, _ = _capped_worker(monkeypatch, cap=1 << 30, reserved=0, live=0)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    state.hold_torch_to_budget()
    got = worker_kv.os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    assert got == "max_split_size_mb:512,expandable_segments:True", f"PYTORCH_CUDA_ALLOC_CONF: got {got!r}"
    state.hold_torch_to_budget()  # said once, not appended again
    assert worker_kv.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == got


@pytest.mark.parametrize(
    "reserved,trimmed",
    [(1 << 30, False), ((1 << 30) + 1, True), (3 << 30, True), (0, False)],
    ids=["at-cap", "one-byte-past", "far-past", "empty"],
)
def test_a_step_that_ends_past_the_cap_empties_torchs_cache_and_one_within_it_does_not(monkeypatch, reserved, trimmed):
    state, cache, _ = _capped_worker(monkeypatch, cap=1 << 30, reserved=0, live=0)
    state.hold_torch_to_budget()
    cache.calls.clear()
    cache.reserved, cache.live = reserved, 512 * MIB
    got = state.trim_torch_cache()
    assert got is trimmed, f"trim_torch_cache at {reserved} B reserved, cap {1 << 30}: expected {trimmed}, got {got}"
    assert cache.calls == (["empty_cache"] if trimmed else []), cache.calls
    assert state.torch_cap["trims"] == int(trimmed), state.torch_cap
    assert state.torch_cap["highest_before_trim"] == (reserved if trimmed else 0), state.torch_cap


def test_a_worker_without_a_cap_never_trims(monkeypatch):
    cache = FakeCache(5 << 30, 0)
    _fake_cuda(monkeypatch, free=1, total=2, cache=cache)
    state = worker_kv.WorkerKV(Ledger(HostDriver(granularity=4096)))
    assert state.trim_torch_cache() is False and cache.calls == [], cache.calls
    state.torch_cap = {"error": "RuntimeError: refused"}  # uncapped, the reason recorded
    assert state.trim_torch_cache() is False and cache.calls == [], cache.calls


class _Runner:
    """A model runner of vLLM 0.26.0 as the trim sees it: a step in one call (``execute_model`` returning the
    output) or two (``execute_model`` returning None, then ``sample_tokens``)."""

    def execute_model(self, scheduler_output):
        if scheduler_output == "bad":
            raise RuntimeError("step failed")
        return None if scheduler_output == "split" else scheduler_output

    def sample_tokens(self, grammar_output):
        return "sampled"

    def pool(self, hidden_states):
        return "pooled"


def _bound_worker(trim):
    from extensible_kv.vllm import patches

    worker = SimpleNamespace(_extensible_kv_state=SimpleNamespace(trim_torch_cache=trim), model_runner=_Runner())
    worker.execute_model = lambda so: worker.model_runner.execute_model(so)  # the worker calls its runner
    patches.bind_worker_rpcs(worker)
    patches.bind_worker_rpcs(worker)  # bound twice (a second engine build): still one trim per call
    return worker


def test_every_step_of_a_bound_runner_trims_after_it_raised_or_not_split_in_two_or_not():
    trims: list = []
    worker = _bound_worker(lambda: trims.append(1))
    assert worker.execute_model("ok") == "ok" and len(trims) == 1, trims
    with pytest.raises(RuntimeError, match="step failed"):
        worker.execute_model("bad")
    assert len(trims) == 2, f"execute_model: expected one trim per step, raised or not; got {len(trims)} for 2"
    # vLLM 0.26.0 ends most steps in sample_tokens: the sampler's memory is checked at the step's end
    assert worker.execute_model("split") is None and worker.model_runner.sample_tokens(None) == "sampled"
    assert len(trims) == 4, f"a step split in two: expected a trim after each half, got {len(trims) - 2}"
    assert worker.model_runner.pool(None) == "pooled" and len(trims) == 5, "a pooling step's end was not trimmed"
    # Ray's executor calls the runner's methods itself, never the worker's
    worker.model_runner.execute_model("ok")
    assert len(trims) == 6, "a step through the runner directly (Ray) was not trimmed"


def test_a_trim_that_fails_leaves_the_steps_outcome_to_its_caller(monkeypatch):
    state, cache, _ = _capped_worker(monkeypatch, cap=1 << 30, reserved=0, live=0)
    state.hold_torch_to_budget()

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "empty_cache", broken)
    cache.reserved = 2 << 30
    worker = _bound_worker(state.trim_torch_cache)
    assert worker.execute_model("ok") == "ok", "a failing trim replaced the step's output"
    with pytest.raises(RuntimeError, match="step failed"):
        worker.execute_model("bad")
    assert state.torch_cap["trim_error"].startswith("RuntimeError: CUDA error"), state.torch_cap
    assert state.torch_cap["trims"] == 0, state.torch_cap


def test_readings_that_do_not_add_up_put_the_allocator_and_the_variable_back(monkeypatch):
    state, cache, _ = _capped_worker(monkeypatch, cap=1 << 30, reserved=-1, live=-1)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    monkeypatch.setattr(worker_kv, "torch_cap", torch_cap)  # the real derivation refuses reserved_now=-1
    state.measured = MemoryState(**_valid())
    assert state.hold_torch_to_budget() is None and "reserved_now=-1" in state.torch_cap["error"], state.torch_cap
    settings = _settings(cache)
    got = (settings, worker_kv.os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    assert got == (["expandable_segments:True", "expandable_segments:False"], "max_split_size_mb:512"), (
        f"an uncapped engine: expected the setting turned back off and the variable as it was, got {got}"
    )


def test_a_second_commit_keeps_the_trims_counted_before_it(monkeypatch):
    state, cache, _ = _capped_worker(monkeypatch, cap=1 << 30, reserved=0, live=0)
    state.hold_torch_to_budget()
    cache.reserved = 3 << 30
    assert state.trim_torch_cache() is True
    state.hold_torch_to_budget()  # extensible_kv_commit again
    got = (state.torch_cap["trims"], state.torch_cap["highest_before_trim"])
    assert got == (1, 3 << 30), f"after a second hold: expected the earlier trim and its reserve kept, got {got}"


def test_a_worker_that_measured_nothing_caps_nothing(monkeypatch):
    cache = FakeCache(0, 0)
    _fake_cuda(monkeypatch, free=1, total=2, cache=cache)
    state = worker_kv.WorkerKV(Ledger(HostDriver(granularity=4096)))
    assert state.hold_torch_to_budget() is None
    assert cache.calls == [] and state.report()["torch_cap"] is None, cache.calls


def test_an_allocator_that_refuses_the_setting_leaves_the_engine_running_uncapped_and_says_why(monkeypatch):
    state, cache, _ = _capped_worker(monkeypatch, cap=3 << 30, reserved=0, live=0)

    def refuse(text):
        raise RuntimeError(f"Unrecognized key '{text.split(':')[0]}' in allocator config")

    monkeypatch.setattr(worker_kv, "_allocator_settings", refuse)
    assert state.hold_torch_to_budget() is None
    error = state.torch_cap.get("error", "")
    assert error.startswith("RuntimeError: Unrecognized key 'expandable_segments'"), state.torch_cap
    assert cache.calls == [] and "PYTORCH_CUDA_ALLOC_CONF" not in worker_kv.os.environ, cache.calls
    assert state.trim_torch_cache() is False


def _valid(**overrides) -> dict:
    values = dict(
        init_free=80 << 30,
        requested=70 << 30,
        free_now=10 << 30,
        kv_backed=MIB,
        weights=0,
        profiled_peak=0,
        bytes_per_block=MIB,
        rounding_bound=SEGMENT,
        capacity_blocks=100,
        committed_blocks=1,
        again_reserved=0,
        again_retained=0,
        served_reserved=0,
        served_retained=0,
    )
    return {**values, **overrides}


@pytest.mark.parametrize(
    "overrides,error,needle",
    [
        (dict(requested=float("nan")), InvalidArgumentError, "requested must be an integer, got 'nan'"),
        (dict(free_now=float("inf")), InvalidArgumentError, "free_now must be an integer, got 'inf'"),
        (dict(init_free=True), InvalidArgumentError, "init_free must be an integer, got 'True'"),
        (dict(requested="72"), InvalidArgumentError, "requested must be an integer, got '72'"),
        (dict(margin=-10 << 30), InvalidSizeError, f"margin={-10 << 30} is below 0"),
        (dict(bytes_per_block=0), InvalidSizeError, "bytes_per_block=0 is below 1"),
        (dict(capacity_blocks=-5), InvalidSizeError, "capacity_blocks=-5 is below 1"),
        (dict(committed_blocks=101), InvalidSizeError, "committed_blocks=101 is above capacity_blocks=100"),
    ],
    ids=["nan", "inf", "bool", "str", "negative-margin", "zero-block", "negative-capacity", "committed-past-capacity"],
)
def test_measurements_that_cannot_be_are_refused_naming_the_field_and_value(overrides, error, needle):
    with pytest.raises(error) as caught:
        MemoryState(**_valid(**overrides))
    assert needle in str(caught.value), f"MemoryState({overrides}): expected {needle!r} in {str(caught.value)!r}"


@pytest.mark.parametrize(
    "used,reserved,error,needle",
    [
        (float("nan"), 0, InvalidArgumentError, "used_now must be an integer, got 'nan'"),
        (0, -1, InvalidSizeError, "reserved_now=-1 is below 0"),
        (0, float("inf"), InvalidArgumentError, "reserved_now must be an integer, got 'inf'"),
        (True, 0, InvalidArgumentError, "used_now must be an integer, got 'True'"),
    ],
)
def test_torch_cap_refuses_readings_that_are_not_byte_counts(used, reserved, error, needle):
    with pytest.raises(error, match=needle):
        torch_cap(MemoryState(**_valid()), used, reserved)


def test_torch_cap_takes_a_device_freer_than_at_the_start():
    # another process freed memory since this worker started: used is negative, the cap larger, no refusal
    m = MemoryState(**_valid(served_step=served_step_bound(True)))
    assert torch_cap(m, -MIB, 0) == m.requested + MIB - CODE


def test_readings_that_do_not_add_up_leave_the_engine_uncapped_naming_them(monkeypatch):
    calls = _fake_cuda(monkeypatch, free=96 << 30, total=80 << 30, cache=FakeCache(-5, -5))
    state = worker_kv.WorkerKV(Ledger(HostDriver(granularity=4096)))
    state.measured = MemoryState(**_valid())
    assert state.hold_torch_to_budget() is None
    assert "reserved_now=-5 is below 0" in state.torch_cap["error"], state.torch_cap
    assert state.trim_torch_cache() is False and not any(isinstance(c, tuple) for c in calls), calls


def _settings(cache: FakeCache) -> list:
    """The expandable-segments settings the worker gave torch's allocator, in order."""
    return [c for c in cache.calls if isinstance(c, str) and c.startswith("expandable")]


def _refused_readings(monkeypatch):
    def refuse(*a):
        raise InvalidSizeError("torch_cap: reserved_now=-1 is below 0")

    monkeypatch.setattr(worker_kv, "torch_cap", refuse)


def test_a_later_hold_that_fails_keeps_the_cap_trims_and_setting_of_the_earlier_one(monkeypatch):
    state, cache, _ = _capped_worker(monkeypatch, cap=1 << 30, reserved=0, live=0)
    assert state.hold_torch_to_budget() == 1 << 30
    cache.reserved = 3 << 30
    state.trim_torch_cache()
    _refused_readings(monkeypatch)
    for _ in range(2):  # twice: the second must still know the first hold turned segments on
        assert state.hold_torch_to_budget() == 1 << 30, "a failed later hold dropped the cap the engine had"
    got = {k: state.torch_cap.get(k) for k in ("cap", "trims", "highest_before_trim", "expandable")}
    want = {"cap": 1 << 30, "trims": 1, "highest_before_trim": 3 << 30, "expandable": True}
    assert got == want and "reserved_now=-1" in state.torch_cap["error"], state.torch_cap
    settings = _settings(cache)
    assert "expandable_segments:False" not in settings, f"a failed later hold turned segments off: {settings}"
    cache.reserved = 2 << 30
    assert state.trim_torch_cache() is True, "the engine stopped trimming after a failed later hold"


def test_an_allocator_that_refuses_a_later_hold_keeps_the_earlier_cap(monkeypatch):
    state, cache, _ = _capped_worker(monkeypatch, cap=1 << 30, reserved=0, live=0)
    state.hold_torch_to_budget()

    def refuse(text):
        raise RuntimeError("refused")

    monkeypatch.setattr(worker_kv, "_allocator_settings", refuse)
    assert state.hold_torch_to_budget() == 1 << 30 and state.torch_cap["cap"] == 1 << 30, state.torch_cap


@pytest.mark.parametrize(
    "name,value",
    [("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"), ("PYTORCH_ALLOC_CONF", "expandable_segments:True"),
     ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments: True"),
     ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64, expandable_segments :true")],
)  # fmt: skip
def test_the_users_expandable_segments_are_read_as_torch_reads_them(monkeypatch, name, value):
    state, cache, _ = _capped_worker(monkeypatch, cap=1 << 30, reserved=0, live=0)
    monkeypatch.setenv(name, value)
    _refused_readings(monkeypatch)
    state.hold_torch_to_budget()
    settings = _settings(cache)
    assert settings == ["expandable_segments:True"], f"{name}={value!r}: the user's segments turned off: {settings}"


def test_a_reading_that_raises_leaves_the_engine_as_it_was_and_says_why(monkeypatch):
    state, cache, _ = _capped_worker(monkeypatch, cap=1 << 30, reserved=0, live=0)

    def broken(*a, **k):
        raise RuntimeError("CUDA error: unspecified launch failure")

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    assert state.hold_torch_to_budget() is None
    settings = _settings(cache)
    got = (settings, worker_kv.os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), state.torch_cap.get("error", ""))
    assert got[:2] == (["expandable_segments:True", "expandable_segments:False"], None), got
    assert got[2].startswith("RuntimeError: CUDA error"), got
