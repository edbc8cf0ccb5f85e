"""The layout arithmetic on worked examples: a Mamba layer's page, its state views, a view's byte footprint and the
block-major re-stride, at offsets and sizes the layout factories never use (a view that does not start at the
buffer's first byte, states that fill the page exactly, a one-element footprint)."""

from __future__ import annotations

import pytest
import torch

from extensible_kv.layout import LayoutError, MambaLayer, attention_view, block_major, footprint, mamba_state_views

SHAPES = ((3, 4), (5,), (2, 2))
DTYPES = (torch.float32, torch.bfloat16, torch.float64)
STATE_BYTES = (3 * 4 * 4, 5 * 2, 2 * 2 * 8)  # 48, 10, 32


def test_an_unpadded_mamba_page_is_the_sum_of_its_states_bytes():
    layer = MambaLayer("mamba.0", SHAPES, DTYPES)
    got = layer.page_size_bytes()
    assert type(got) is int and got == sum(STATE_BYTES), (
        f"MambaLayer{SHAPES}.page_size_bytes(): expected int {sum(STATE_BYTES)}, got {got!r}"
    )
    padded = MambaLayer("mamba.0", SHAPES, DTYPES, page_size_padded=4096).page_size_bytes()
    assert padded == 4096, f"page_size_bytes() with page_size_padded=4096: expected 4096, got {padded}"


def test_mamba_states_lie_back_to_back_in_each_page():
    # Three states of 48, 10 (+6 to align the float64 state) and 32 bytes in a 96-byte page: offsets 0, 48 and 64.
    shapes, dtypes, page, blocks = ((3, 4), (5,), (2, 2)), (torch.float32, torch.bfloat16, torch.float64), 96, 3
    raw = torch.zeros(page * blocks, dtype=torch.uint8)
    with pytest.raises(LayoutError, match=r"offset 58 is not a multiple of its 8-byte element"):
        mamba_state_views(raw, shapes, dtypes, page, blocks)
    shapes = ((3, 4), (8,), (2, 2))  # 48 + 16 + 32 = 96 bytes: the states fill the page exactly
    views = mamba_state_views(raw, shapes, dtypes, page, blocks)
    got = [(tuple(v.shape), v.stride(), v.data_ptr() - raw.data_ptr()) for v in views]
    expected = [((3, 3, 4), (96 // 4, 4, 1), 0), ((3, 8), (96 // 2, 1), 48), ((3, 2, 2), (96 // 8, 2, 1), 64)]
    assert got == expected, f"mamba_state_views (shape, strides, byte offset): expected {expected}, got {got}"
    for k, v in enumerate(views):  # each state's bytes of block 2 lie in page 2 at the state's own offset
        v[2].fill_(k + 1)
    page2 = raw[2 * page : 3 * page]
    filled = [bool(page2[a:b].any()) for a, b in ((0, 48), (48, 64), (64, 96))]
    assert filled == [True] * 3 and not raw[: 2 * page].any(), (
        f"mamba_state_views: block 2's states must fill page 2 and nothing else, got {raw.view(blocks, page)}"
    )


def test_a_page_counts_each_states_own_element_size():
    # One bfloat16 state of 8 elements fills a 16-byte page exactly (at 4 bytes an element it would need 32).
    raw = torch.zeros(16 * 2, dtype=torch.uint8)
    (view,) = mamba_state_views(raw, ((8,),), (torch.bfloat16,), 16, 2)
    assert (tuple(view.shape), view.stride()) == ((2, 8), (8, 1)), (
        f"mamba_state_views((8,) bf16, page 16): expected shape (2, 8) strides (8, 1), got {view.shape} {view.stride()}"
    )


@pytest.mark.parametrize(
    "page,message",
    [
        (98, "Mamba state (3, 4) of torch.float32: page 98 or offset 0 is not a multiple of its 4-byte element"),
        (64, "Mamba states need 96 bytes per block, the page has 64"),
    ],
)
def test_mamba_states_that_do_not_fit_the_page_are_refused_naming_the_sizes(page, message):
    raw = torch.zeros(page * 2, dtype=torch.uint8)
    with pytest.raises(LayoutError) as info:
        mamba_state_views(raw, ((3, 4), (8,), (2, 2)), DTYPES, page, 2)
    assert str(info.value) == message, f"mamba_state_views(page={page}): expected {message!r}, got {info.value}"


def test_the_footprint_of_a_view_counts_its_storage_offset_and_a_single_element():
    buf = torch.zeros(64, dtype=torch.float32)
    view = buf[10:].view(6, 9)[:, :2]  # starts at element 10; rows of 9, two elements used per row
    got = footprint(view, 0, 3)
    expected = [(40, 48), (76, 84), (112, 120)]
    assert got == expected, f"footprint(rows 0..2 of a view at element 10): expected {expected}, got {got}"
    one = buf[7:8].view(1, 1)
    assert footprint(one, 0, 1) == [(28, 32)], f"footprint of one element at 7: got {footprint(one, 0, 1)}"
    assert footprint(one, 0, 0) == [], f"footprint of no block: got {footprint(one, 0, 0)}"


def test_block_major_keeps_the_views_storage_offset():
    buf = torch.arange(100, dtype=torch.float32)
    view = buf[4:28].view(2, 3, 4)[:, :2]  # (K/V, blocks, hidden), 4 elements in
    got = block_major(view)
    assert got.storage_offset() == 4 and got.stride() == (4, 8, 1), (
        f"block_major: expected storage offset 4 and strides (4, 8, 1), got {got.storage_offset()}, {got.stride()}"
    )
    assert got[1, 0].tolist() == [8.0, 9.0, 10.0, 11.0], f"block_major: V of block 0 at elements 8..11, got {got[1, 0]}"


def test_an_attention_view_over_a_buffer_of_another_size_is_refused_naming_both_sizes():
    raw = torch.zeros(3 * 64, dtype=torch.int8)
    with pytest.raises(LayoutError) as info:
        attention_view(raw, (2, 4, 8), (0, 1, 2), torch.bfloat16)
    expected = "shape (2, 4, 8) of torch.bfloat16 needs 128 bytes, the buffer has 192"
    assert str(info.value) == expected, f"attention_view over 192 bytes: expected {expected!r}, got {info.value}"
