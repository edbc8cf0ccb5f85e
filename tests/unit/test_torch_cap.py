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
from extensible_kv.errors import ExtensibleKVError, InvalidArgumentError, InvalidSizeError
from extensible_kv.vllm import sizing, worker_kv
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


def _segment(device: int, pool: tuple, total: int) -> dict:
    return {"device": device, "segment_pool_id": pool, "total_size": total, "active_size": 0}


# The largest default-pool segment of device 3 is 200 MiB; larger ones of another device or a graph pool do not count.
SNAPSHOT = [
    _segment(3, (0, 0), 200 * MIB),
    _segment(3, (0, 0), 20 * MIB),
    _segment(3, (1, 7), 900 * MIB),
    _segment(0, (0, 0), 800 * MIB),
]


def test_the_largest_segment_is_of_this_devices_default_pool():
    got = sizing.largest_segment(SNAPSHOT, 3)
    assert got == 200 * MIB, f"largest_segment(SNAPSHOT, 3): expected 200 MiB, got {got}"
    assert sizing.largest_segment([], 3) == 0


def _fake_cuda(monkeypatch, free: int, total: int, reserved: int, device: int) -> list:
    calls: list = []
    monkeypatch.setattr(worker_kv, "_allocator_settings", lambda text: calls.append(text))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: reserved)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda *a, **k: SNAPSHOT)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: calls.append((f, d)))
    return calls


def test_the_worker_caps_torch_on_its_own_device_at_the_derived_cap(monkeypatch):
    total, init_free = 80 << 30, 79 << 30
    calls = _fake_cuda(monkeypatch, free=10 << 30, total=total, reserved=600 * MIB, device=3)
    state = worker_kv.WorkerKV(Ledger(HostDriver(granularity=4096)))
    state.measured = SimpleNamespace(init_free=init_free)  # what torch_cap reads is checked above; here: the wiring
    seen = {}

    def cap_of(measured, used_now, reserved_now):
        seen.update(measured=measured, used=used_now, reserved=reserved_now)
        return 1 << 30

    monkeypatch.setattr(worker_kv, "torch_cap", cap_of)
    assert state.hold_torch_to_budget() == 1 << 30
    assert seen == {"measured": state.measured, "used": init_free - (10 << 30), "reserved": 600 * MIB}, seen
    expected_calls = [(1.0, 3), "garbage_collection_threshold:0.010058"]  # (1 GiB - 200 MiB) of 80 GiB, rounded down
    assert calls == expected_calls, f"hold_torch_to_budget: expected the calls {expected_calls}, got {calls}"
    expected = {
        "cap": 1 << 30,
        "used": init_free - (10 << 30),
        "reserved": 600 * MIB,
        "total": total,
        "largest_segment": 200 * MIB,
        "threshold": "0.010058",
    }
    assert state.torch_cap == expected, f"WorkerKV.torch_cap: expected {expected}, got {state.torch_cap}"


def test_a_worker_that_measured_nothing_caps_nothing(monkeypatch):
    calls = _fake_cuda(monkeypatch, free=1, total=2, reserved=0, device=0)
    state = worker_kv.WorkerKV(Ledger(HostDriver(granularity=4096)))
    assert state.hold_torch_to_budget() is None
    assert calls == [] and state.report()["torch_cap"] is None, calls


@pytest.mark.parametrize(
    "cap,total,expected",
    [
        (3 << 30, 80 << 30, "0.037500"),
        (1, 80 << 30, "0.000001"),  # torch refuses 0: at least a millionth
        (1 << 40, 80 << 30, "0.999999"),  # torch refuses 1: at most 0.999999
        ((1 << 30) + 1, 3 << 30, "0.333333"),  # rounded down, never above the cap by more than a millionth
    ],
)
def test_the_threshold_is_the_cap_over_the_device_total_inside_what_torch_accepts(cap, total, expected):
    got = worker_kv.gc_threshold(cap, total)
    assert got == expected, f"gc_threshold({cap}, {total}): expected {expected}, got {got}"


def test_an_allocator_that_refuses_the_settings_leaves_the_engine_running_uncapped_and_says_why(monkeypatch):
    calls = _fake_cuda(monkeypatch, free=1 << 30, total=80 << 30, reserved=0, device=0)

    def refuse(text):
        raise RuntimeError(f"Unrecognized key '{text.split(':')[0]}' in allocator config")

    monkeypatch.setattr(worker_kv, "_allocator_settings", refuse)
    state = worker_kv.WorkerKV(Ledger(HostDriver(granularity=4096)))
    state.measured = SimpleNamespace(init_free=2 << 30)
    monkeypatch.setattr(worker_kv, "torch_cap", lambda *a: 3 << 30)
    assert state.hold_torch_to_budget() is None
    error = state.torch_cap.get("error", "")
    assert error.startswith("RuntimeError: Unrecognized key 'garbage_collection_threshold'"), state.torch_cap
    assert calls == [(1.0, 0)], calls


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


@pytest.mark.parametrize(
    "cap,total,needle",
    [
        (1 << 30, 0, "total=0 is below 1"),
        (float("nan"), 1 << 30, "cap must be an integer, got 'nan'"),
        (-1, 1 << 30, "cap=-1"),
    ],
)
def test_the_threshold_refuses_a_cap_or_device_that_cannot_be(cap, total, needle):
    with pytest.raises(ExtensibleKVError, match=needle):
        worker_kv.gc_threshold(cap, total)


def test_readings_that_do_not_add_up_leave_the_engine_uncapped_naming_them(monkeypatch):
    calls = _fake_cuda(monkeypatch, free=96 << 30, total=80 << 30, reserved=-5, device=0)
    state = worker_kv.WorkerKV(Ledger(HostDriver(granularity=4096)))
    state.measured = MemoryState(**_valid())
    assert state.hold_torch_to_budget() is None
    assert calls == [] and "reserved_now=-5 is below 0" in state.torch_cap["error"], (calls, state.torch_cap)
