"""The worst-batch derivation (``extensible_kv.vllm.worst_batch``): given an engine's limits, the batches the sizing
runs after warmup. Each test names the wrong derivation it catches."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extensible_kv.vllm import probes, sizing, worst_batch
from extensible_kv.vllm.worst_batch import Dummy, Limits, LimitsError, derive, mla_chunk_tokens, mla_workspace_tokens

# The issue's engine: DeepSeek-V2 dense MLA shape, max_model_len 512, 4096 batched tokens, 32 sequences, FlashMLA's
# 64-token blocks.
ISSUE = Limits(max_model_len=512, max_num_batched_tokens=4096, max_num_seqs=32, block_size=64, mla=True)


def _by_name(limits: Limits) -> dict:
    return {b.name: b for b in derive(limits).batches}


def test_the_issue_engine_gets_a_prefill_over_context_that_fills_mlas_workspace():
    # wrong: a context batch at max_model_len - 1, or one that gathers less than the workspace holds
    batches = _by_name(ISSUE)
    ladder = (3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)  # 2 x 1.5 ... below 128
    split = [f"prefill_split_q{q}" for q in ladder]
    fresh = [f"prefill_fresh_q{q}" for q in ladder]
    assert list(batches) == ["prefill_fresh", *fresh, "prefill_over_context", *split, "decode_max_len", "mixed"]
    over = batches["prefill_over_context"]
    assert over.seqs == ((384, 128),) * 32, over.seqs
    assert over.mla_context_tokens == mla_workspace_tokens(ISSUE) == 8192
    assert batches["prefill_fresh"].seqs == ((0, 128),) * 32
    assert batches["prefill_fresh"].mla_context_tokens == 0  # what vLLM's profile batch gathers
    assert batches["decode_max_len"].seqs == ((511, 1),) * 32 and batches["decode_max_len"].sampled_rows == 32


@pytest.mark.parametrize(
    "max_model_len,max_num_seqs,block_size,expected",
    [
        (512, 32, 64, 8192),  # 4 pages per request beat 8 full-length requests
        (512, 32, 16, 4096),  # 8 full-length requests
        (16384, 8, 16, 65536),  # capped at 64k tokens
        (100_000, 256, 1024, 262_144),  # at least one page per request, over the cap
        (16, 1, 16, 128),
    ],
)
def test_mlas_workspace_is_vllms_formula(max_model_len, max_num_seqs, block_size, expected):
    # wrong: the cap without the one-page-per-request floor, or the floor missing
    limits = Limits(max_model_len, 1 << 20, max_num_seqs, block_size, mla=True)
    assert mla_workspace_tokens(limits) == expected


def test_mlas_chunk_is_an_equal_share_of_the_workspace_rounded_down_to_a_block():
    # wrong: a share not rounded to the block size (4080 gathered instead of 3840)
    limits = Limits(max_model_len=512, max_num_batched_tokens=4096, max_num_seqs=24, block_size=16, mla=True)
    assert mla_workspace_tokens(limits) == 4096
    assert mla_chunk_tokens([342] * 24, limits) == 24 * 160
    assert mla_chunk_tokens([0, 0], limits) == 0
    assert mla_chunk_tokens([100, 0], limits) == 100  # one prefill with context takes the whole workspace


def _vllm_dummy_seqs(d: Dummy, max_num_seqs: int) -> list[tuple[int, int]]:
    """vLLM 0.26.0's V1 ``_dummy_run`` spread of ``num_tokens`` (read from its source): ``min(num_tokens,
    max_num_seqs)`` requests, ``num_tokens // num_reqs`` each, the last the remainder; uniform decode: requests of
    ``q`` tokens; mixed: ``min(max_num_seqs - 1, num_tokens // 2)`` one-token decodes and one prefill; every request's
    sequence ``profile_seq_lens`` long."""
    if d.mixed:
        decodes = min(max_num_seqs - 1, d.num_tokens // 2)
        new = [1] * decodes + [d.num_tokens - decodes]
    elif d.uniform_decode:
        q = d.num_tokens // d.num_reqs
        new = [q] * min(max_num_seqs, -(-d.num_tokens // q))
    else:
        n = min(d.num_tokens, max_num_seqs)
        new = [d.num_tokens // n] * n
        new[-1] += d.num_tokens % n
    return [(d.seq_len - q, q) for q in new]


limits_strategy = st.builds(
    Limits,
    max_model_len=st.integers(10, 70_000),
    max_num_batched_tokens=st.integers(70_000, 140_000) | st.integers(9, 70_000),
    max_num_seqs=st.integers(1, 1024),
    block_size=st.sampled_from([16, 32, 64, 128]),
    chunked_prefill=st.just(True),
    prefix_caching=st.booleans(),
    mla=st.booleans(),
    spec_tokens=st.integers(0, 8),
)


@settings(max_examples=300, deadline=None)
@given(limits_strategy)
def test_every_batch_is_one_the_scheduler_could_schedule_and_vllms_dummy_run_runs(limits):
    # wrong: a sequence past max_model_len, a step past max_num_batched_tokens or max_num_seqs, or shapes that the
    # dummy run (as vLLM spreads tokens) would not run
    for b in derive(limits).batches:
        assert b.new_tokens <= limits.max_num_batched_tokens, b
        assert 1 <= len(b.seqs) <= limits.max_num_seqs, b
        for ctx, new in b.seqs:
            assert ctx >= 0 and new >= 1 and ctx + new <= limits.max_model_len, b
        assert list(b.seqs) == _vllm_dummy_seqs(b.dummy, b.dummy.num_reqs), b


@settings(max_examples=300, deadline=None)
@given(limits_strategy)
def test_the_batches_are_the_widest_the_limits_allow(limits):
    # wrong: fewer tokens than a step may hold, sequences short of max_model_len in the context and decode batches,
    # a decode batch of fewer than 1 + k tokens per sequence
    b = _by_name(limits)
    s, t, L, q = limits.max_num_seqs, limits.max_num_batched_tokens, limits.max_model_len, 1 + limits.spec_tokens
    # the most tokens min(T, S) requests take with the last one taking the remainder, none past max_model_len
    fresh = b["prefill_fresh"]
    assert fresh.new_tokens > min(t, s * L) - len(fresh.seqs)
    decode = b["decode_max_len"]
    assert all(ctx + new == L and new == q for ctx, new in decode.seqs)
    assert len(decode.seqs) == max(1, min(s, t // q)) and decode.sampled_rows == len(decode.seqs) * q
    if L > q + 1 and t >= q + 1:
        over = b["prefill_over_context"]
        assert all(ctx + new == L and new >= q + 1 for ctx, new in over.seqs)
        assert over.new_tokens > min(t, len(over.seqs) * (L - 1)) - len(over.seqs)
        assert len(over.seqs) == min(s, t // (q + 1))


@pytest.mark.parametrize(
    "chunked,prefix,context", [(False, False, False), (True, False, True), (False, True, True), (True, True, True)]
)
def test_context_batches_only_where_a_prefill_can_have_cached_context(chunked, prefix, context):
    # wrong: context batches without chunked prefill and prefix caching (or none with only one of them)
    limits = Limits(512, 4096, 8, 16, chunked_prefill=chunked, prefix_caching=prefix)
    names = set(_by_name(limits))
    assert ("prefill_over_context" in names) == context
    assert ("mixed" in names) == chunked


def test_speculative_tokens_widen_the_decode_and_keep_prefills_above_the_decode_threshold():
    # wrong: a decode of one token per sequence with k drafts, a prefill chunk a backend takes for a decode
    b = _by_name(Limits(4096, 16384, 8, 16, spec_tokens=4))
    assert b["decode_max_len"].seqs == ((4091, 5),) * 8 and b["decode_max_len"].sampled_rows == 40
    assert b["decode_max_len"].dummy.uniform_decode
    assert min(new for _, new in b["prefill_longest_context"].seqs) == 6


def test_the_longest_context_batch_is_added_only_where_it_brings_more_context():
    # wrong: the batch left out for a FlashAttention engine whose context batch has context 1 per sequence, or added
    # for MLA where it gathers no more than the context batch already does
    fa = _by_name(Limits(256, 2040, 8, 16))
    assert fa["prefill_over_context"].context_tokens == 8
    assert fa["prefill_longest_context"].seqs == ((254, 2),) * 8
    assert "prefill_longest_context" not in _by_name(ISSUE)
    mla_short = _by_name(Limits(256, 2040, 8, 16, mla=True))
    assert mla_short["prefill_longest_context"].mla_context_tokens == 8 * 254 > 8


def test_the_encoder_cache_is_held_full_during_the_fresh_prefill_only():
    # wrong: no items held, the wrong count, or items held in every batch
    b = _by_name(Limits(4096, 16384, 8, 16, encoder_cache_tokens=16384, encoder_tokens_per_item=576))
    assert b["prefill_fresh"].encoder_items_held == 28 and "encoder_cache" in b["prefill_fresh"].targets
    assert all(x.encoder_items_held == 0 for name, x in b.items() if name != "prefill_fresh")


def test_the_mixed_step_runs_on_v1_and_names_the_note_that_bounds_it_on_v2():
    # wrong: a mixed step left to V2's dummy run (which spreads tokens evenly), or a bound whose Note is not written
    plan = derive(ISSUE)
    mixed = next(b for b in plan.batches if b.name == "mixed")
    assert mixed.seqs[:-1] == ((511, 1),) * 31 and mixed.seqs[-1] == (1, 511)
    assert mixed not in plan.runnable("v2") and mixed in plan.runnable("v1")
    for b in plan.batches:
        if b.bound is not None:
            title = b.bound.removeprefix("Note ")
            assert f"Note {title}" in sizing.__doc__, f"{b.name} names {b.bound}, which sizing does not write"


def test_every_component_a_batch_targets_is_in_the_docstring_table():
    # wrong: a component the sizing runs for that the one table does not say which batch brings back
    limits = Limits(512, 4096, 32, 64, mla=True, spec_tokens=2, encoder_cache_tokens=4096, encoder_tokens_per_item=256)
    table = worst_batch.__doc__
    words = {
        "activations": "activations",
        "sampler": "sampler",
        "encoder_cache": "encoder cache",
        "attention_prefill_context": "attention over cached",
        "mla_context_workspace": "MLA context",
        "attention_decode": "decode attention",
        "attention_split_partials": "split-KV partials",
    }
    for component, batches in derive(limits).by_component().items():
        assert words[component] in table, component
        for name in batches:
            assert re.sub(r"_q\d+$", "_q{q}", name) in table, name


@pytest.mark.parametrize(
    "kwargs,names",
    [
        (dict(max_model_len=0), "max_model_len"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(spec_tokens=-1), "spec_tokens"),
        (dict(max_num_batched_tokens=4, spec_tokens=4), "max_num_batched_tokens (4) cannot hold one decode step"),
        (dict(max_model_len=5, spec_tokens=4), "max_model_len (5) leaves no room for a step of 1 + 4"),
        (dict(chunked_prefill=False, max_num_batched_tokens=100), "max_num_batched_tokens (100)"),
        (dict(encoder_cache_tokens=100), "encoder_tokens_per_item"),
        (dict(decode_threshold=0), "decode_threshold must be >= 1"),
    ],
)
def test_limits_no_scheduler_accepts_are_refused_naming_the_value(kwargs, names):
    base = dict(max_model_len=512, max_num_batched_tokens=4096, max_num_seqs=8, block_size=16)
    with pytest.raises(LimitsError, match=re.escape(names)):
        Limits(**{**base, **kwargs})


# -- Note [A prefill is a prefill to the backend] -----------------------------------------------------------------
FLASHMLA = dataclasses.replace(ISSUE, decode_threshold=128)  # FlashMLA's reorder_batch_threshold in vLLM 0.26.0


def test_prefills_give_each_request_more_than_the_backends_decode_threshold():
    # wrong: 32 requests of 128 tokens, which FlashMLA takes for decodes (the h100-2026-12-06-worst-batch run)
    b = _by_name(FLASHMLA)
    for name in ("prefill_fresh", "prefill_over_context"):
        assert min(new for _, new in b[name].seqs) > 128, (name, b[name].seqs)
        assert b[name].new_tokens == 4096, (name, b[name].new_tokens)  # still the most a step schedules
    over = b["prefill_over_context"]
    assert over.seqs == ((380, 132),) * 30 + ((376, 136),), over.seqs
    assert over.mla_context_tokens == 31 * 256 == 7936  # 8192 // 31 = 264, rounded down to 64-token blocks
    mixed_prefill = b["mixed"].seqs[-1]
    assert mixed_prefill[1] > 128 and all(new == 1 for _, new in b["mixed"].seqs[:-1]), b["mixed"].seqs


def test_a_request_at_the_threshold_gathers_no_mla_context():
    # wrong: counting requests of exactly the threshold's length as prefills (they run FlashMLA's decode kernel)
    limits = dataclasses.replace(FLASHMLA, decode_threshold=132)
    assert worst_batch._batch("x", (), Dummy(4096, 31, 512), limits).mla_context_tokens == 376  # the 136-token one


def test_the_decode_threshold_is_the_largest_of_the_runners_attention_groups():
    # wrong: the first group's, the smallest, or None read as 0
    def group(threshold):
        return SimpleNamespace(get_metadata_builder=lambda: SimpleNamespace(reorder_batch_threshold=threshold))

    runner = SimpleNamespace(attn_groups=[[group(16)], [group(128), group(None)], [group(1)]])
    assert probes.decode_threshold_of(runner) == 128
    assert probes.decode_threshold_of(SimpleNamespace(attn_groups=[[group(None)]])) == 1
    assert probes.decode_threshold_of(SimpleNamespace()) == 1


# -- Note [What a served step adds after the worst batches] ---------------------------------------------------------
RUN = Path(__file__).resolve().parents[2] / "reports" / "runs" / "h100-2026-12-06-worst-batch" / "worst-batch"
MIB = 1 << 20


def _run_case(name: str) -> dict:
    return json.loads((RUN / f"{name}.json").read_text())


def _growth_after_commit(case: dict) -> tuple[int, int]:
    """(torch, non-torch) bytes the load added to what the worker used right after the final commit."""
    memory, reading = case["memory"], case["load"]["highest"]["reading"]
    used = reading["used"] - (memory["init_free"] - memory["free_after_warmup"])
    torch_growth = reading["torch_reserved"] - memory["torch_reserved"]
    return torch_growth, used - torch_growth


def test_the_served_step_bound_is_its_derived_granules():
    # wrong: one step in flight under async scheduling, or the code granules left out
    assert sizing.served_step_bound(async_scheduling=True) == (2 * 2 + 4) * 2 * MIB == 16 * MIB
    assert sizing.served_step_bound(async_scheduling=False) == (2 * 1 + 4) * 2 * MIB == 12 * MIB


@pytest.mark.parametrize(
    "name", ["mla-v1-extensible", "mla-v2-extensible", "qwen3-v1-extensible", "mla-v1-sleep-extensible"]
)
def test_each_part_of_the_bound_covers_what_the_h100_load_added(name):
    # wrong: fewer small-pool segments than mla-v2 took (3), fewer code granules than the MLA loads took (3)
    torch_growth, non_torch = _growth_after_commit(_run_case(name))
    assert torch_growth % sizing.SEGMENT == 0 and non_torch % sizing.SEGMENT == 0, (torch_growth, non_torch)
    assert torch_growth <= sizing.SMALL_SEGMENTS_PER_STEP * 2 * sizing.SEGMENT, torch_growth
    assert non_torch <= sizing.CODE_GRANULES * sizing.SEGMENT, non_torch


@pytest.mark.parametrize("name", ["mla-v1", "mla-v2", "qwen3-v1"])
def test_legacy_loads_added_the_same_non_torch_memory(name):
    # wrong: reading the non-torch growth as something the extensible sizing causes
    assert (
        _growth_after_commit(_run_case(f"{name}-legacy"))[1] == _growth_after_commit(_run_case(f"{name}-extensible"))[1]
    )


@pytest.mark.parametrize("name", ["mla-v1", "mla-v2", "qwen3-v1", "mla-v1-sleep"])
def test_sized_with_the_bound_the_h100_loads_end_inside_the_budget(name):
    # wrong: a bound of 0 (mla-v1 ended 9,279,897 bytes over) or a budget that does not subtract it
    case = _run_case(f"{name}-extensible")
    recorded = case["extensible"]["measured"]
    fields = {f.name for f in dataclasses.fields(sizing.MemoryState)}
    state = sizing.MemoryState(**{k: v for k, v in recorded.items() if k in fields and k != "served_step"})
    assert state.blocks() == recorded["blocks"] == case["num_gpu_blocks"]  # the run's own sizing, recomputed
    bounded = dataclasses.replace(state, served_step=sizing.served_step_bound(async_scheduling=True))
    fewer = state.blocks() - bounded.blocks()
    over = case["load"]["highest_over_budget"] - fewer * state.bytes_per_block
    assert over <= 0, f"{name}: {fewer} blocks fewer, still {over} bytes over"
    assert fewer * state.bytes_per_block <= sizing.served_step_bound(async_scheduling=True) + state.bytes_per_block


@settings(max_examples=300, deadline=None)
@given(limits_strategy)
def test_the_split_sweep_steps_at_most_1_5x_between_the_two_context_batches(limits):
    # wrong: a step of more than 1.5x between the shortest and the longest prefill query, a sweep batch that is not
    # the most requests of its query length at max_model_len, or one outside the two context batches
    b = _by_name(limits)
    if "prefill_over_context" not in b:
        assert not any(n.startswith("prefill_split_q") for n in b), sorted(b)
        return
    s, t, L = limits.max_num_seqs, limits.max_num_batched_tokens, limits.max_model_len
    longest = max(n for _, n in b["prefill_over_context"].seqs)
    qs = [limits.prefill_query_len] + sorted(
        int(n[len("prefill_split_q") :]) for n in b if n.startswith("prefill_split_q")
    )
    qs.append(longest)
    if longest <= limits.prefill_query_len:
        assert qs == [longest, longest] or qs[0] >= longest, (limits, qs)
        return
    for short, long in zip(qs, qs[1:]):
        assert short < long and 2 * long <= 3 * short + 1, (limits, qs)
    for q in qs[1:-1]:
        sweep = b[f"prefill_split_q{q}"]
        assert sweep.seqs == ((L - q, q),) * min(s, t // q), (limits, q, sweep.seqs)


@settings(max_examples=300, deadline=None)
@given(limits_strategy)
def test_the_fresh_sweep_steps_at_most_1_5x_up_to_the_fresh_batch(limits):
    # wrong: fresh prompts of one length only (the profile batch's), a step of more than 1.5x between a prefill's
    # shortest query and the fresh batch's longest, or a sweep batch with cached context or fewer requests than fit
    b = _by_name(limits)
    s, t = limits.max_num_seqs, limits.max_num_batched_tokens
    longest = max(n for _, n in b["prefill_fresh"].seqs)
    qs = sorted(int(n[len("prefill_fresh_q") :]) for n in b if n.startswith("prefill_fresh_q"))
    if longest <= limits.prefill_query_len:
        assert not qs, (limits, qs)
        return
    qs = [limits.prefill_query_len, *qs, longest]
    for short, long in zip(qs, qs[1:]):
        assert short < long and 2 * long <= 3 * short + 1, (limits, qs)
    for q in qs[1:-1]:
        assert b[f"prefill_fresh_q{q}"].seqs == ((0, q),) * min(s, t // q), (limits, q)


wide_limits = st.builds(
    Limits,
    max_model_len=st.integers(2, 5_000),
    max_num_batched_tokens=st.integers(2, 10_000),
    max_num_seqs=st.integers(1, 300),
    block_size=st.sampled_from([1, 16, 64]),
    chunked_prefill=st.booleans(),
    prefix_caching=st.booleans(),
    mla=st.booleans(),
    spec_tokens=st.integers(0, 4),
    decode_threshold=st.integers(1, 200),
)


@settings(max_examples=500, deadline=None)
@given(st.data())
def test_limits_a_scheduler_accepts_give_a_plan_of_batches_within_them(data):
    # wrong: derive refusing limits that Limits accepted (a share per request past max_model_len), a batch past the
    # limits, or fresh prefills with cached context where no prefill can have any
    try:
        limits = data.draw(wide_limits)
    except LimitsError:
        return  # limits no scheduler accepts: refused where they enter
    for b in derive(limits).batches:
        assert b.new_tokens <= limits.max_num_batched_tokens and 1 <= len(b.seqs) <= limits.max_num_seqs, b
        assert all(ctx >= 0 and new >= 1 and ctx + new <= limits.max_model_len for ctx, new in b.seqs), b
    if not limits.context_possible:
        assert all(ctx == 0 for ctx, _ in _by_name(limits)["prefill_fresh"].seqs), limits


@pytest.mark.parametrize(
    "field,value",
    [("max_model_len", 512.5), ("max_model_len", float("nan")), ("max_num_seqs", True), ("spec_tokens", None),
     ("chunked_prefill", 1), ("attention_backend", 3)],
)  # fmt: skip
def test_limits_of_the_wrong_type_are_refused_naming_the_field(field, value):
    kwargs = dict(max_model_len=512, max_num_batched_tokens=4096, max_num_seqs=8, block_size=16)
    with pytest.raises(LimitsError, match=field):
        Limits(**{**kwargs, field: value})
