"""``attention_layer`` and ``backend_stride_order``: a layer built from a vLLM-style backend class (its own shape
function and stride order), on fake backends (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch

from extensible_kv.layout import (
    BLOCK_SENTINEL,
    AttentionLayer,
    LayoutError,
    attention_layer,
    backend_stride_order,
    block_dim,
)


class KVFirst:
    """A K/V-first backend, ``(2, num_blocks, block_size, heads, head_size)``, that records its calls."""

    calls: list[tuple] = []

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        KVFirst.calls.append((num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str))
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order():
        return (1, 0, 2, 3, 4)  # blocks physically outermost


class NoOrder:
    """A backend with no ``get_kv_cache_stride_order`` at all (AttributeError), as most vLLM backends."""

    get_kv_cache_shape = KVFirst.get_kv_cache_shape


class OrderNotImplemented(KVFirst):
    @staticmethod
    def get_kv_cache_stride_order():
        raise NotImplementedError


class WrongOrder(KVFirst):
    @staticmethod
    def get_kv_cache_stride_order():
        return (0, 1, 2)  # 3 dims for a 5-d shape


def _layer(backend: type, **kwargs) -> AttentionLayer:
    return attention_layer(
        "layer.0", backend, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, **kwargs
    )


def test_a_layer_takes_the_backends_shape_and_stride_order():
    KVFirst.calls.clear()
    layer = _layer(KVFirst, cache_dtype_str="fp8", block_major=True)
    got = (layer.name, layer.stride_order, layer.dtype, layer.block_major, layer.shape_of(7))
    expected = ("layer.0", (1, 0, 2, 3, 4), torch.bfloat16, True, (2, 7, 16, 2, 64))
    assert got == expected, f"attention_layer(KVFirst): expected {expected}, got {got}"
    assert KVFirst.calls[-1] == (7, 16, 2, 64, "fp8"), (
        f"get_kv_cache_shape arguments: expected (7, 16, 2, 64, 'fp8'), got {KVFirst.calls[-1]}"
    )
    assert (layer.block_dim, layer.page_size_bytes()) == (1, 2 * 16 * 2 * 64 * 2), (
        f"block dim and page bytes: expected (1, {2 * 16 * 2 * 64 * 2}), got "
        f"{(layer.block_dim, layer.page_size_bytes())}"
    )


@pytest.mark.parametrize("backend", [NoOrder, OrderNotImplemented], ids=["no method", "NotImplementedError"])
def test_a_backend_without_a_stride_order_gets_the_identity(backend):
    assert backend_stride_order(backend) is None, (
        f"backend_stride_order({backend.__name__}): expected None, got {backend_stride_order(backend)}"
    )
    order = _layer(backend).stride_order
    assert order == (0, 1, 2, 3, 4), f"attention_layer({backend.__name__}).stride_order: expected identity, got {order}"


def test_backend_stride_order_returns_the_backends_order_as_a_tuple():
    got = backend_stride_order(KVFirst)
    assert got == (1, 0, 2, 3, 4), f"backend_stride_order(KVFirst): expected (1, 0, 2, 3, 4), got {got!r}"


def test_a_stride_order_that_does_not_match_the_shape_is_refused_naming_both():
    with pytest.raises(LayoutError) as info:
        _layer(WrongOrder)
    message = str(info.value)
    for needle in ("WrongOrder", "(0, 1, 2)", "5-d shape (2, 1, 16, 2, 64)"):
        assert needle in message, f"attention_layer(WrongOrder) error: expected {needle!r} in it, got {message!r}"


def test_a_layer_defaults_to_the_models_cache_dtype_and_the_plain_layout():
    KVFirst.calls.clear()
    layer = _layer(KVFirst)
    layer.shape_of(3)
    got = (KVFirst.calls[-1], layer.block_major)
    expected = ((3, 16, 2, 64, "auto"), False)
    assert got == expected, (
        f"attention_layer(KVFirst) defaults (shape call, block_major): expected {expected}, got {got}"
    )


def test_the_refusal_names_the_backend_by_its_name_or_as_given():
    with pytest.raises(LayoutError) as info:
        _layer(WrongOrder)
    expected = "backend WrongOrder: stride order (0, 1, 2) does not match its declared 5-d shape (2, 1, 16, 2, 64)"
    assert str(info.value) == expected, f"attention_layer(WrongOrder) error: expected {expected!r}, got {info.value}"

    class Unnamed:  # a backend object without __name__ (an instance) is named by its repr
        get_kv_cache_shape = staticmethod(KVFirst.get_kv_cache_shape)
        get_kv_cache_stride_order = staticmethod(WrongOrder.get_kv_cache_stride_order)

        def __repr__(self):
            return "unnamed-backend"

    with pytest.raises(LayoutError) as info:
        _layer(Unnamed())
    expected = expected.replace("WrongOrder", "unnamed-backend")
    assert str(info.value) == expected, f"attention_layer(Unnamed()) error: expected {expected!r}, got {info.value}"


@pytest.mark.parametrize(
    "shape,expected", [((2, BLOCK_SENTINEL, 16, 8, 64), 1), ((BLOCK_SENTINEL, 2, 16), 0), ((4, 16, BLOCK_SENTINEL), 2)]
)
def test_block_dim_is_the_one_dimension_of_the_sentinel_block_count(shape, expected):
    assert block_dim(shape) == expected, f"block_dim{shape}: expected {expected}, got {block_dim(shape)}"


@pytest.mark.parametrize("shape", [(2, 16, 8), (BLOCK_SENTINEL, BLOCK_SENTINEL, 2), ()])
def test_block_dim_with_no_or_several_block_dimensions_is_refused_naming_the_shape(shape):
    with pytest.raises(LayoutError, match=rf"view: the shape {__import__('re').escape(str(shape))} .* expected 1"):
        block_dim(shape, "view")
