"""FlashAttention-3's split count, derived (``extensible_kv.vllm.attention_splits``), against the counts an H100
measured, and the worst batch it adds (Note [FlashAttention-3 splits by the longest query, not the batch])."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from extensible_kv.vllm.attention_splits import SplitShape, accumulator_bytes, splits, worst_query
from extensible_kv.vllm.worst_batch import Limits, derive

# The sliding-window model's full-attention layers on an H100 (132 SMs): (longest query, longest sequence) -> the
# splits its accumulators held, read from torch's allocations in run h100-2026-12-07-fa3-splits (bytes / (query
# tokens x 4 heads x 64 x 4)): the served step, the fresh ladder, the context ladder.
SWA = SplitShape(heads=4, kv_heads=2, head_dim=64, sms=132)
MEASURED = {
    (1725, 1725): 7,
    (2047, 2047): 3, (768, 768): 6, (1024, 1024): 6, (1536, 1536): 4, (2047, 2048): 3,
    (48, 2048): 14, (64, 2048): 14, (96, 2048): 14, (128, 2048): 14, (192, 2048): 14, (256, 2048): 14,
    (384, 2048): 14, (512, 2048): 10, (768, 2048): 7, (1024, 2048): 6, (1536, 2048): 4,
}  # fmt: skip


@pytest.mark.parametrize(("query", "seq"), sorted(MEASURED))
def test_the_derived_split_count_is_the_one_measured(query, seq):
    got = splits(SWA, query, seq)
    assert got == MEASURED[query, seq], (
        f"FA3 splits, 4 heads / 2 KV heads / head_dim 64 / 132 SMs, query {query}, sequence {seq}: "
        f"expected {MEASURED[query, seq]} (measured), got {got}"
    )


shapes = st.builds(
    lambda kv, group, dim, sms: SplitShape(kv * group, kv, dim, sms),
    st.integers(1, 16),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([64, 80, 96, 128, 192, 256]),
    st.sampled_from([78, 108, 114, 132]),
)


@settings(max_examples=300, deadline=None)
@given(shapes, st.integers(1, 9000), st.integers(1, 9000), st.integers(1, 9000))
def test_more_context_never_means_fewer_splits(shape, query, seq, more):
    # why the worst batch sits at max_model_len: were this wrong, a shorter context could split more
    assert splits(shape, query, seq) <= splits(shape, query, seq + more), (shape, query, seq, more)


@settings(max_examples=150, deadline=None)
@given(shapes, st.integers(8, 3000), st.integers(1, 64), st.integers(64, 20000), st.integers(2, 6))
@example(SWA, 2048, 64, 16330, 3)  # the most tokens at a class's shortest query (10 x 1,633: 9 x 1,634 fit less)
def test_the_worst_query_is_the_most_bytes_over_every_query_length(shape, max_model_len, seqs, tokens, first):
    # wrong: a class of query lengths left out, the class's top taken where fewer requests fit it, a later tie
    first = min(first, max_model_len - 1)
    got = worst_query(shape, first, max_model_len, seqs, tokens)
    every = [
        (accumulator_bytes(shape, splits(shape, q, max_model_len), min(seqs, tokens // q) * q), -q)
        for q in range(first, max_model_len)
    ]
    top, minus_q = max(every)
    assert got == ((-minus_q if top else first), top), (shape, max_model_len, seqs, tokens, first)


def test_the_sliding_window_engine_gets_the_step_the_served_load_found():
    # the served step that went 28.9 MiB over (8 fresh prompts of 1,725 tokens, 7 splits) is in the class the
    # derivation names: 8 requests of 1,728 tokens at max_model_len, 7 splits, at least the served step's bytes
    limits = Limits(2048, 16384, 8, 16, fa3_heads=4, fa3_kv_heads=2, fa3_head_dim=64, fa3_sms=132)
    batch = {b.name: b for b in derive(limits).batches}["prefill_split_fa3_q1728"]
    assert batch.seqs == ((320, 1728),) * 8
    served = accumulator_bytes(SWA, 7, 8 * 1725)
    assert accumulator_bytes(SWA, splits(SWA, 1728, 2048), batch.new_tokens) >= served


def test_no_fa3_batch_without_fa3_or_where_a_batch_before_runs_it():
    plain = Limits(2048, 16384, 8, 16)
    assert not [b for b in derive(plain).batches if "fa3" in b.name]
    # 32 heads over 8 KV heads, 128 dims, 256 sequences, 8,192 tokens: the worst step is 256 requests of 32 tokens at
    # max_model_len (15 splits, 1.9 GiB), which prefill_over_context already runs
    llama = {"fa3_heads": 32, "fa3_kv_heads": 8, "fa3_head_dim": 128, "fa3_sms": 132}
    batches = {b.name: b for b in derive(Limits(8192, 8192, 256, 16, **llama)).batches}
    assert batches["prefill_over_context"].seqs == ((8160, 32),) * 256 and not [n for n in batches if "fa3" in n]


@pytest.mark.parametrize(
    "fields",
    [dict(fa3_heads=4), dict(fa3_heads=3, fa3_kv_heads=2, fa3_head_dim=64, fa3_sms=132),
     dict(fa3_heads=4, fa3_kv_heads=2, fa3_head_dim=64, fa3_sms=-1)],
)  # fmt: skip
def test_fa3_fields_all_or_none_are_refused_naming_the_values(fields):
    from extensible_kv.vllm.worst_batch import LimitsError

    with pytest.raises(LimitsError, match="FlashAttention-3's heads"):
        Limits(2048, 16384, 8, 16, **fields)


def _layer(version, window, heads=4, kv_heads=2, head_size=64):
    impl = SimpleNamespace(
        vllm_flash_attn_version=version, sliding_window=window, num_heads=heads, num_kv_heads=kv_heads,
        head_size=head_size,
    )  # fmt: skip
    return SimpleNamespace(impl=impl)


@pytest.mark.parametrize(
    ("layers", "expected"),
    [
        # a sliding-window layer caps its key blocks: the shape is the first layer over the whole context
        ({"sw": _layer(3, (31, 0)), "full": _layer(3, (-1, -1), 8, 2, 128)}, (8, 2, 128, 132)),
        ({"fa2": _layer(2, (-1, -1))}, None),  # FlashAttention-2 splits by the batch: no FA3 fields
        ({"sw": _layer(3, (31, 0))}, None),
        ({"mamba": SimpleNamespace()}, None),
    ],
    ids=["sliding-then-full", "fa2", "only-sliding", "no-attention"],
)
def test_the_fa3_fields_come_from_the_first_fa3_layer_over_the_whole_context(monkeypatch, layers, expected):
    import torch

    from extensible_kv.vllm import probes

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    compilation = SimpleNamespace(static_forward_context=layers)
    runner = SimpleNamespace(vllm_config=SimpleNamespace(compilation_config=compilation), device="cuda:0")
    got = probes.fa3_shape_of(runner)
    want = {} if expected is None else dict(zip(("fa3_heads", "fa3_kv_heads", "fa3_head_dim", "fa3_sms"), expected))
    assert got == want, f"fa3_shape_of({sorted(layers)}): expected {want}, got {got}"
