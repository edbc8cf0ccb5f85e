"""From an attention backend's KV cache layout to lockstep segments.

A KV cache buffer is a raw byte tensor that every layer sharing it views through its own shape and strides. Blocks
are committed as a prefix: committing blocks ``[0, n)`` must back every byte those blocks occupy and nothing else.
If the block dimension is physically outermost (block-major), that is one prefix of the buffer: one segment. If
some dimension is physically outside the block dimension (K/V-split ``(2, num_blocks, ...)``), the blocks occupy a
prefix of each of its slices: one segment per physical index outside the block dimension.

The count is derived from the physical strides of the final per-layer view (``segments_of``), never from backend
names, so re-strided hybrid caches and unknown backends come out right. ``attention_view``, ``block_major`` and
``mamba_state_views`` build the same views vLLM 0.26.0's model runners build (``_reshape_attention_kv_cache``,
``_update_hybrid_attention_mamba_layout``, the Mamba branch of ``_reshape_kv_cache_tensors``), so the derivation can
run on the ``meta`` device before any memory exists.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ExtensibleKVError

BLOCK_SENTINEL = 1234567
"""Block count of a shape or view built only to find its block dimension (``block_dim``): vLLM's own trick with
``get_kv_cache_shape``, and the block count of the ``meta`` dry run of vLLM's reshape."""


class LayoutError(ExtensibleKVError, ValueError):
    """A layout cannot be split into lockstep segments, or its parts disagree; the message names the values."""


def block_dim(shape: Sequence[int], what: str = "shape", num_blocks: int = BLOCK_SENTINEL) -> int:
    """The block dimension of ``shape``, built for ``num_blocks`` blocks (``BLOCK_SENTINEL`` by default): the one
    dimension of that size. Refused (``LayoutError`` naming ``what`` and the shape) when none or several are: the
    block dimension would be a guess. The one way this package finds a block dimension."""
    shape = tuple(shape)
    if shape.count(num_blocks) != 1:
        raise LayoutError(
            f"{what}: the shape {shape} for num_blocks={num_blocks} has "
            f"{shape.count(num_blocks)} block dims, expected 1"
        )
    return shape.index(num_blocks)


@dataclass(frozen=True)
class Segments:
    """How committing a prefix of blocks maps onto a buffer: ``count`` segments ``pitch`` bytes apart."""

    count: int
    pitch: int  # bytes from one segment's start to the next (the buffer size when count == 1)


def segments_of(view: torch.Tensor, block_dim: int, buffer_bytes: int) -> Segments:
    """Lockstep segments of a buffer of ``buffer_bytes`` bytes, from one layer's final view of it.

    Dimensions whose byte stride exceeds the block dimension's are outside it: each index of them starts a
    segment. Their starts must tile the buffer evenly (``k * buffer_bytes / count``), else ``LayoutError``.
    """
    if not 0 <= block_dim < view.dim():
        raise LayoutError(
            f"block dim {block_dim} is out of range for a {view.dim()}-d view of shape {tuple(view.shape)}"
        )
    item = view.element_size()
    block_stride = view.stride(block_dim) * item
    outer = [
        d for d in range(view.dim()) if d != block_dim and view.shape[d] > 1 and view.stride(d) * item > block_stride
    ]
    count = math.prod(view.shape[d] for d in outer)
    if count == 1:
        return Segments(1, buffer_bytes)
    if buffer_bytes % count:
        raise LayoutError(
            f"{count} segments (outer dims {outer} of shape {tuple(view.shape)}) do not divide the "
            f"{buffer_bytes}-byte buffer"
        )
    pitch = buffer_bytes // count
    starts = {0}
    for d in outer:
        starts = {s + i * view.stride(d) * item for s in starts for i in range(view.shape[d])}
    want = {k * pitch for k in range(count)}
    if starts != want:
        raise LayoutError(
            f"segment starts of view shape {tuple(view.shape)} strides {view.stride()} (outer dims "
            f"{outer}) are {sorted(starts)[:4]}..., not multiples of the pitch {pitch}"
        )
    return Segments(count, pitch)


def inverse(order: Sequence[int]) -> list[int]:
    return [list(order).index(i) for i in range(len(order))]


def attention_view(
    raw: torch.Tensor, shape: Sequence[int], stride_order: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """The view vLLM builds over a raw int8 buffer: ``raw.view(dtype).view(permuted).permute(inverse)``."""
    shape, order = tuple(shape), tuple(stride_order)
    if sorted(order) != list(range(len(shape))):
        raise LayoutError(
            f"stride order {order} is not a permutation of the {len(shape)} dims of the declared shape {shape}"
        )
    permuted = tuple(shape[i] for i in order)
    item = torch.empty(0, dtype=dtype).element_size()
    if raw.numel() != math.prod(shape) * item:
        raise LayoutError(
            f"shape {shape} of {dtype} needs {math.prod(shape) * item} bytes, the buffer has {raw.numel()}"
        )
    return raw.view(dtype).view(permuted).permute(*inverse(order))


def block_major(view: torch.Tensor) -> torch.Tensor:
    """The hybrid attention+Mamba re-stride: ``(2, B, ...)`` K/V-first becomes block-major (K and V of a block in
    one page), as vLLM's ``_update_hybrid_attention_mamba_layout`` does with ``as_strided``."""
    shape = tuple(view.shape)
    hidden = math.prod(shape[2:])
    tail = view.stride()[2:]
    return view.as_strided(shape, (hidden, 2 * hidden, *tail), view.storage_offset())


def mamba_state_bytes(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]) -> int:
    """Bytes of one block's Mamba states, back to back (its page, unpadded)."""
    return sum(math.prod(shape) * torch.empty(0, dtype=dtype).element_size() for shape, dtype in zip(shapes, dtypes))


def mamba_state_views(
    raw: torch.Tensor,
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[torch.dtype],
    page_size_bytes: int,
    num_blocks: int,
) -> list[torch.Tensor]:
    """Mamba state views: per state, ``(num_blocks, *shape)`` with one page per block, states back to back."""
    need = mamba_state_bytes(shapes, dtypes)
    if need > page_size_bytes:  # refused before any view is built: a view past the page may run past the buffer
        raise LayoutError(f"Mamba states need {need} bytes per block, the page has {page_size_bytes}")
    views, offset = [], 0
    for shape, dtype in zip(shapes, dtypes):
        item = torch.empty(0, dtype=dtype).element_size()
        target = (num_blocks, *shape)
        tail = torch.empty(target, device="meta").stride()[1:]
        if page_size_bytes % item or offset % item:
            raise LayoutError(
                f"Mamba state {tuple(shape)} of {dtype}: page {page_size_bytes} or offset {offset} "
                f"is not a multiple of its {item}-byte element"
            )
        views.append(torch.as_strided(raw.view(dtype), target, (page_size_bytes // item, *tail), offset // item))
        offset += math.prod(shape) * item
    return views


def footprint(view: torch.Tensor, block_dim: int, num_blocks: int) -> list[tuple[int, int]]:
    """Byte ranges (relative to the buffer start) that blocks ``[0, num_blocks)`` of ``view`` occupy, merged.

    Computed by replaying the view's shape, strides and offset over element indices, so it does not trust the
    segment arithmetic it checks.
    """
    item = view.element_size()
    span = view.storage_offset() + sum((s - 1) * st for s, st in zip(view.shape, view.stride())) + 1
    index = torch.as_strided(
        torch.arange(span, dtype=torch.int64), view.shape, view.stride(), view.storage_offset()
    ).narrow(block_dim, 0, num_blocks)
    elements = torch.unique(index.reshape(-1))
    if elements.numel() == 0:
        return []
    # Merge consecutive element indices into byte ranges.
    breaks = torch.nonzero(elements[1:] != elements[:-1] + 1).flatten().tolist()
    starts = [0, *[b + 1 for b in breaks]]
    ends = [*breaks, elements.numel() - 1]
    return [(int(elements[s]) * item, (int(elements[e]) + 1) * item) for s, e in zip(starts, ends)]


# -- layers ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionLayer:
    """An attention layer: ``shape_of(num_blocks)`` is the backend's logical KV shape, viewed in ``stride_order``.

    ``block_major`` applies the hybrid attention+Mamba re-stride after the view is built.
    """

    name: str
    shape_of: Callable[[int], tuple[int, ...]]
    stride_order: tuple[int, ...]
    dtype: torch.dtype
    block_major: bool = False

    @property
    def block_dim(self) -> int:
        return block_dim(self.shape_of(BLOCK_SENTINEL), f"layer {self.name}")

    def page_size_bytes(self) -> int:
        item = torch.empty(0, dtype=self.dtype).element_size()
        return math.prod(self.shape_of(1)) * item

    def views(self, raw: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
        view = attention_view(raw, self.shape_of(num_blocks), self.stride_order, self.dtype)
        if self.block_major and self.block_dim != 0:  # already block-major: vLLM skips it too
            if view.dim() < 3 or view.shape[0] != 2 or self.block_dim != 1:
                raise LayoutError(
                    f"layer {self.name}: block-major re-stride needs a (2, num_blocks, ...) layout, "
                    f"got shape {tuple(view.shape)}"
                )
            view = block_major(view)
        return [view]

    def block_dims(self) -> list[int]:
        return [self.block_dim]


@dataclass(frozen=True)
class MambaLayer:
    """A Mamba layer: its states (``shapes``/``dtypes``) packed back to back in each block's page."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    page_size_padded: int | None = None

    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return mamba_state_bytes(self.shapes, self.dtypes)

    def views(self, raw: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
        return mamba_state_views(raw, self.shapes, self.dtypes, self.page_size_bytes(), num_blocks)

    def block_dims(self) -> list[int]:
        return [0] * len(self.shapes)


Layer = AttentionLayer | MambaLayer


def agreed_segments(views: Iterable[tuple[str, torch.Tensor, int]], buffer_bytes: int) -> Segments | None:
    """The segments every ``(layer name, view, block dim)`` of one buffer of ``buffer_bytes`` gives (each view of a
    layer counts: Mamba layers have several); they must all agree. ``None`` when there is no view."""
    first: tuple[str, Segments] | None = None
    for name, view, block_dim in views:
        seg = segments_of(view, block_dim, buffer_bytes)
        if first is None:
            first = (name, seg)
        elif seg != first[1]:
            raise LayoutError(
                f"layers sharing one buffer disagree on segments: {first[0]} has {first[1].count}, "
                f"{name} has {seg.count}"
            )
    return first[1] if first else None


def buffer_segments(layers: Sequence[Layer], page_size_bytes: int, num_blocks: int) -> Segments:
    """The segments of a buffer of ``num_blocks`` pages shared by ``layers``; they must all agree.

    Computed on the ``meta`` device: nothing is allocated.
    """
    if not layers:
        raise LayoutError("a KV cache buffer needs at least one layer")
    nbytes = page_size_bytes * num_blocks
    raw = torch.empty(nbytes, dtype=torch.int8, device="meta")

    def views() -> Iterator[tuple[str, torch.Tensor, int]]:
        for layer in layers:
            if layer.page_size_bytes() > page_size_bytes:
                raise LayoutError(
                    f"layer {layer.name} needs {layer.page_size_bytes()} bytes per block, the "
                    f"buffer's page is {page_size_bytes}"
                )
            for view, block_dim in zip(layer.views(raw, num_blocks), layer.block_dims()):
                yield layer.name, view, block_dim

    segments = agreed_segments(views(), nbytes)
    if segments is None:
        raise LayoutError(f"no layer of {', '.join(layer.name for layer in layers)} has a view of the buffer")
    return segments


# -- vLLM backends ----------------------------------------------------------------------------------------------------
def backend_stride_order(backend: type[Any]) -> tuple[int, ...] | None:
    """``backend.get_kv_cache_stride_order()``, or ``None`` where the backend has none (identity, as in vLLM)."""
    try:
        return tuple(backend.get_kv_cache_stride_order())
    except (AttributeError, NotImplementedError):
        return None


def attention_layer(
    name: str,
    backend: type[Any],
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    cache_dtype_str: str = "auto",
    block_major: bool = False,
) -> AttentionLayer:
    """An AttentionLayer from a vLLM attention backend class (its own shape and stride order)."""

    def shape_of(num_blocks: int) -> tuple[int, ...]:
        return tuple(
            backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str=cache_dtype_str)
        )

    shape = shape_of(1)
    order = backend_stride_order(backend) or tuple(range(len(shape)))
    if sorted(order) != list(range(len(shape))):
        raise LayoutError(
            f"backend {getattr(backend, '__name__', backend)}: stride order {order} does not match its "
            f"declared {len(shape)}-d shape {shape}"
        )
    return AttentionLayer(name, shape_of, order, dtype, block_major)
