"""Lockstep segments from a layer's final view (``segments_of``), agreed over the layers of a buffer
(``agreed_segments``, ``buffer_segments``): worked examples, and the refusals with their whole messages."""

from __future__ import annotations

import pytest
import torch

from extensible_kv.layout import AttentionLayer, LayoutError, Segments, agreed_segments, buffer_segments, segments_of


def _view(shape, stride, nbytes):
    return torch.as_strided(torch.zeros(nbytes, dtype=torch.int8), shape, stride)


@pytest.mark.parametrize(
    "shape,stride,block_dim,nbytes,expected",
    [
        ((2, 4, 16), (64, 16, 1), 1, 128, Segments(2, 64)),  # K/V first: two segments, 64 bytes apart
        ((4, 2, 16), (32, 16, 1), 0, 128, Segments(1, 128)),  # blocks outermost: one segment, the whole buffer
        ((1, 4, 16), (1000, 16, 1), 1, 64, Segments(1, 64)),  # a size-1 outer dim starts no segment
        ((2, 4, 16), (16, 16, 1), 1, 128, Segments(1, 128)),  # a stride equal to the block dim's is not outside it
        ((3, 2, 4, 8), (64, 32, 8, 1), 2, 192, Segments(6, 32)),  # two outer dims: 3 x 2 segments
    ],
)
def test_segments_of_a_view_are_its_outer_dims_tiling_the_buffer(shape, stride, block_dim, nbytes, expected):
    got = segments_of(_view(shape, stride, nbytes), block_dim, nbytes)
    assert got == expected, (
        f"segments_of(shape {shape}, strides {stride}, block dim {block_dim}, {nbytes} bytes): "
        f"expected {expected}, got {got}"
    )


@pytest.mark.parametrize(
    "shape,stride,block_dim,nbytes,message",
    [
        ((2, 4, 16), (64, 16, 1), 3, 128, "block dim 3 is out of range for a 3-d view of shape (2, 4, 16)"),
        (
            (3, 4, 10),
            (40, 10, 1),
            1,
            100,
            "3 segments (outer dims [0] of shape (3, 4, 10)) do not divide the 100-byte buffer",
        ),
        (
            (2, 4, 10),
            (40, 10, 1),
            1,
            100,
            "segment starts of view shape (2, 4, 10) strides (40, 10, 1) (outer dims [0]) "
            "are [0, 40]..., not multiples of the pitch 50",
        ),
        # a size-1 dim is not an outer dim, whatever its stride; the message shows the first four starts
        (
            (1, 2, 4, 10),
            (1000, 40, 10, 1),
            2,
            100,
            "segment starts of view shape (1, 2, 4, 10) strides (1000, 40, 10, 1) "
            "(outer dims [1]) are [0, 40]..., not multiples of the pitch 50",
        ),
        (
            (6, 2, 10),
            (20, 10, 1),
            1,
            132,
            "segment starts of view shape (6, 2, 10) strides (20, 10, 1) (outer dims [0]) "
            "are [0, 20, 40, 60]..., not multiples of the pitch 22",
        ),
    ],
)
def test_a_view_whose_segments_do_not_tile_the_buffer_is_refused_naming_it(shape, stride, block_dim, nbytes, message):
    with pytest.raises(LayoutError) as info:
        segments_of(_view(shape, stride, 128), block_dim, nbytes)
    assert str(info.value) == message, f"segments_of(shape {shape}): expected {message!r}, got {info.value}"


def test_layers_of_one_buffer_must_agree_naming_both():
    kv_first, block_first = _view((2, 4, 16), (64, 16, 1), 128), _view((4, 2, 16), (32, 16, 1), 128)
    assert agreed_segments([("a", kv_first, 1), ("b", kv_first, 1)], 128) == Segments(2, 64)
    assert agreed_segments([], 128) is None
    with pytest.raises(LayoutError) as info:
        agreed_segments([("a", kv_first, 1), ("b", block_first, 0)], 128)
    expected = "layers sharing one buffer disagree on segments: a has 2, b has 1"
    assert str(info.value) == expected, f"agreed_segments(a, b): expected {expected!r}, got {info.value}"


def test_buffer_segments_refuses_no_layer_and_a_layer_larger_than_the_page():
    layer = AttentionLayer("wide", lambda b: (2, b, 16), (0, 1, 2), torch.bfloat16)  # 64 bytes per block
    assert buffer_segments([layer], 64, 4) == Segments(2, 128), buffer_segments([layer], 64, 4)
    for layers, page, expected in (
        ([], 64, "a KV cache buffer needs at least one layer"),
        ([layer], 32, "layer wide needs 64 bytes per block, the buffer's page is 32"),
    ):
        with pytest.raises(LayoutError) as info:
            buffer_segments(layers, page, 4)
        assert str(info.value) == expected, f"buffer_segments(page {page}): expected {expected!r}, got {info.value}"
