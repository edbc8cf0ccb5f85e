"""KV connectors on the extensible path: a connector is handed exactly the committed blocks, once, after the final
commit.

vLLM 0.26.0's runners hand a configured KV connector (``kv_transfer_config``: CPU offloading, disk, LMCache, NIXL)
the engine's KV tensors once: ``register_kv_caches`` (or ``register_cross_layers_kv_cache``) and
``set_host_xfer_buffer_ops``, right after the KV cache is allocated. On the extensible path those tensors span the
whole reservation, of which only block 0 is committed then. ``defer`` (called by the patched runners before they
allocate) records those calls instead of passing them on; ``register`` (called by the ``extensible_kv_commit`` RPC
after the final commit) hands the connector views narrowed to exactly the committed blocks, then replays the
recorded calls on the connector as vLLM made them.

Note [The contract for connector authors]
    On the extensible path a connector's worker side receives, once, after warmup and CUDA graph capture:

    - ``register_kv_caches(kv_caches)``: for every layer vLLM would register, the tensor (or, for a Mamba layer,
      the list of state tensors) vLLM's own reshape builds for the committed block count ``n``: the same shape,
      strides, dtype and byte offset as the legacy path with ``num_gpu_blocks = n``. Layers that share a KV cache
      tensor get the same tensor object. V1 with a connector that prefers cross-layer blocks gets
      ``register_cross_layers_kv_cache(tensor, backend)`` instead, the cross-layer tensor for ``n`` blocks.
    - Extent: each tensor's storage (``untyped_storage()``) is exactly the committed bytes of its buffer, ``n``
      pages starting at the buffer's first byte, so a connector that rebuilds a ``(num_blocks, page)`` view from
      the storage, or registers the storage with a transport (RDMA), covers exactly the committed blocks and
      nothing reserved beyond them. Memory outside them is not mapped on demand: a touch there faults.
    - ``_kv_cache_config`` (the ``KVCacheConfig`` the connector was built with) says ``num_blocks = n`` and each
      ``KVCacheTensor.size`` is ``n`` pages, as on the legacy path (Note [The connector is told the committed
      count]).
    - Addresses are stable: the base address of every buffer is fixed when the KV cache is reserved and never
      changes; the physical pages behind the registered blocks are never unmapped or remapped while the engine
      lives (growth and sleep mode are refused while a connector is registered: Note [Registered once]).
    - The per-step hooks (``save_kv_layer``'s ``kv_layer``, ``forward_context`` layers' ``kv_cache``) receive the
      runner's own views, whose block dimension spans the reservation (captured CUDA graphs hold them); block ids
      the scheduler hands out are always below ``n``, and only those blocks may be touched.

Note [Registered once]
    vLLM's connectors register the KV memory once: ``OffloadingConnector``'s spec keeps the first worker it builds
    (a second ``register_kv_caches`` keeps the old extent silently), NIXL and Mooncake register memory regions with
    the transport. So once a connector is registered the extensible KV cache neither grows nor releases its pages:
    ``register`` pins the buffers (Note [A registration pins the committed blocks] in ``extensible_kv.kv_cache``),
    which then refuse every release and every growth past the registered count, whichever path asks (the sleep
    backend included); ``check_resize`` and ``refuse_release`` say so first, naming the connector, where the engine
    asks; and sleep mode with a connector configured is refused when the engine starts (``unsupported_reasons``),
    before anything is reserved. Re-registering was the alternative; it would depend on every connector accepting a
    second registration, which vLLM's own do not.

Note [The connector is told the committed count]
    A connector's worker side is built (``ensure_kv_transfer_initialized``) before the KV cache, from the
    ``KVCacheConfig`` of the reservation, and some read ``num_blocks`` from it when they register
    (``OffloadingConnector``, ``SimpleCPUOffloadConnector``). ``register`` rewrites that object in place to the
    legacy configuration of the committed count (``num_blocks = n``, every tensor ``n`` pages), just before
    registering: in place, because a connector and its parts (``MultiConnector``'s children, a connector's worker
    helper) all hold the same object. The scheduler side is built after the final commit, from the final count.

Note [Cross-layer blocks on the extensible path]
    V1 gives a connector that prefers cross-layer blocks (``OffloadingConnector``) one tensor for all layers,
    blocks physically outermost (``allocate_uniform_kv_caches``). ``cross_layer_allocator`` runs vLLM's own
    allocation on the ``meta`` device for the shapes and strides, refuses it unless the block dimension is
    physically first (one lockstep segment), reserves one extensible buffer of the same size and rebuilds every
    view over it with the meta views' shapes, strides and offsets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from ..boundaries import escaped
from ..kv_cache import HOLDER_CHARS
from ..layout import LayoutError, block_dim
from . import worker_kv
from .worker_kv import ExtensibleKVUnsupported

logger = logging.getLogger("extensible_kv.vllm")

CROSS_LAYER = "<cross-layer KV cache>"
"""The name the cross-layer buffer is allocated under (it is shared by every layer)."""

DEFERRED = ("register_kv_caches", "register_cross_layers_kv_cache", "set_host_xfer_buffer_ops")
"""The connector methods the runners call while they allocate, recorded by ``defer`` and replayed by ``register``."""

_MISSING = object()


# -- naming --------------------------------------------------------------------------------------------------------
def connector_name(connector: object) -> str:
    """The connector's class name; a ``MultiConnector`` with its children's, in order."""
    name = type(connector).__name__
    children = getattr(connector, "_connectors", None)
    if isinstance(children, (list, tuple)) and children:
        name += "(" + ", ".join(connector_name(c) for c in children) + ")"
    return name


def configured_connector(vllm_config: Any) -> str | None:
    """The connector ``kv_transfer_config`` names (``MultiConnector`` with its children's names), or ``None``."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    name = getattr(ktc, "kv_connector", None) if ktc is not None else None
    if not name:
        return None
    extra = getattr(ktc, "kv_connector_extra_config", None) or {}
    children = [c.get("kv_connector") for c in extra.get("connectors", ()) if isinstance(c, dict)]
    return f"{name}({', '.join(str(c) for c in children)})" if children else str(name)


def unsupported_reasons(vllm_config: Any) -> list[str]:
    """Why the extensible path refuses this configuration's connector (empty: it does not); Note [Registered
    once]."""
    name = configured_connector(vllm_config)
    model_config = getattr(vllm_config, "model_config", None)
    if name and getattr(model_config, "enable_sleep_mode", False):
        return [
            (
                f"KV connector {name} with sleep mode (enable_sleep_mode): the connector registers the KV memory "
                f"once, and sleep would release the pages under it"
            )
        ]
    return []


def transfer_group() -> object | None:
    """This worker's KV connector (vLLM's KV transfer group), or ``None`` when none is configured."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


# -- the session: recorded calls, then one registration -------------------------------------------------------------
@dataclass
class Registration:
    """What the connector was handed: the block count, every tensor's shape, strides and extent, and the committed
    bytes of the buffers they live in (``to_dict`` is JSON-ready)."""

    connector: str
    kind: str  # "kv_caches" or "cross_layers"
    num_blocks: int
    committed_bytes: int  # the committed bytes of the buffers the tensors live in
    storage_bytes: int  # the bytes of the distinct storages handed over
    tensors: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Session:
    """One worker's connector between ``defer`` and ``register``."""

    state: worker_kv.WorkerKV
    connector: Any  # a vLLM KV connector (untyped here)
    name: str
    own: dict[str, object]  # the connector instance's own attributes DEFERRED replaced (_MISSING: none)
    calls: dict[str, tuple] = field(default_factory=dict)  # method -> the arguments of its last recorded call
    registration: Registration | None = None

    def restore(self) -> None:
        """Put the connector's own methods back (idempotent)."""
        for method, own in self.own.items():
            if own is _MISSING:
                vars(self.connector).pop(method, None)
            else:
                setattr(self.connector, method, own)
        self.own = {}


_SESSION: Session | None = None


def session(state: worker_kv.WorkerKV | None = None) -> Session | None:
    """The connector session of ``state`` (of any state when ``None``), or ``None``."""
    if _SESSION is None or (state is not None and _SESSION.state is not state):
        return None
    return _SESSION


def defer(state: worker_kv.WorkerKV, group: object = _MISSING) -> Session | None:
    """Before the runner allocates: refuse layouts a connector cannot be handed narrowed, then record (instead of
    passing on) the runner's registration calls on the connector until ``register``. ``group``: the connector
    (default: vLLM's KV transfer group); ``None`` or no connector configured: nothing to do."""
    global _SESSION
    connector = transfer_group() if group is _MISSING else group
    if _SESSION is not None:
        _SESSION.restore()
    _SESSION = None
    if connector is None:
        return None
    name = connector_name(connector)
    split = [i for i, count in enumerate(state.segments) if count > 1]
    if split:
        raise ExtensibleKVUnsupported(
            f"KV connector {name}: KV cache tensor(s) {split} have a K/V-split layout ({state.segments[split[0]]} "
            f"lockstep segments, as ROCM_ATTN's (2, num_blocks, ...)); their committed blocks lie in separate "
            f"ranges of the reservation, so no tensor over exactly the committed bytes has the legacy layout's "
            f"strides, and the extensible path cannot hand it to the connector"
        )
    config = getattr(connector, "_kv_cache_config", None)
    if config is None or not hasattr(config, "num_blocks"):
        raise ExtensibleKVUnsupported(
            f"KV connector {name} keeps no KVCacheConfig (_kv_cache_config): the "
            f"extensible path cannot tell it the committed block count"
        )
    current = Session(state, connector, name, {})
    for method in DEFERRED:
        current.own[method] = vars(connector).get(method, _MISSING)
        setattr(connector, method, _recorder(current, method))
    _SESSION = current
    return current


def _recorder(current: Session, method: str) -> Callable:
    def record(*args: Any, **kwargs: Any) -> None:
        current.calls[method] = (args, kwargs)

    return record


# -- narrowing ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Buffer:
    name: str
    page: int
    committed: torch.Tensor  # int8, exactly the committed bytes (one segment)


def _buffers_by_base(state: worker_kv.WorkerKV) -> dict[int, _Buffer]:
    buffers = state.buffers
    if buffers is None:
        raise ExtensibleKVUnsupported("no extensible KV buffers to hand to the KV connector")
    by_base = {}
    for spec in buffers.buffers:
        tensor = buffers.tensor(spec.name)
        if tensor.num_segments != 1:
            raise ExtensibleKVUnsupported(
                f"KV buffer {spec.name} has {tensor.num_segments} lockstep segments "
                f"(K/V-split): it cannot be narrowed to one range of committed bytes"
            )
        by_base[tensor.base_address] = _Buffer(spec.name, spec.page_size_bytes, tensor.segment_view(0, torch.int8))
    return by_base


def block_dim_of(view: torch.Tensor, page: int, reserved: int, what: str) -> int:
    """The block dimension of a view over a buffer of ``reserved`` pages of ``page`` bytes (``layout.block_dim``:
    the one dimension of ``reserved`` entries), refused unless consecutive blocks are one page apart (block-major)."""
    try:
        dim = block_dim(view.shape, what, num_blocks=reserved)
    except LayoutError as exc:
        raise ExtensibleKVUnsupported(f"{exc}; it cannot be narrowed to the committed blocks") from exc
    apart = view.stride(dim) * view.element_size()
    if apart != page:
        raise ExtensibleKVUnsupported(
            f"{what}: consecutive blocks of shape {tuple(view.shape)} strides "
            f"{view.stride()} are {apart} bytes apart, not one {page}-byte page (not "
            f"block-major); it cannot be narrowed to the committed blocks"
        )
    return dim


def narrow_view(
    view: torch.Tensor, committed: torch.Tensor, page: int, reserved: int, num_blocks: int, what: str
) -> torch.Tensor:
    """``view`` (over a block-major buffer of ``reserved`` pages) narrowed to its first ``num_blocks`` blocks, over
    ``committed`` (the buffer's committed bytes, its storage exactly ``num_blocks`` pages): the same strides and
    offset, the block dimension cut to the committed blocks. Refused when the result would reach past them."""
    shape = list(view.shape)
    shape[block_dim_of(view, page, reserved, what)] = num_blocks
    item = view.element_size()
    offset = view.storage_offset()
    end = (offset + sum((s - 1) * st for s, st in zip(shape, view.stride()))) * item + item if all(shape) else 0
    limit = num_blocks * page
    if offset < 0 or end > limit or committed.numel() != limit or limit % item:
        raise ExtensibleKVUnsupported(
            f"{what}: shape {tuple(shape)} strides {view.stride()} at element offset "
            f"{offset} reaches byte {end}, past the {limit} committed bytes of "
            f"{num_blocks} blocks; it cannot be narrowed"
        )
    return torch.as_strided(committed.view(view.dtype), shape, view.stride(), offset)


def _narrower(state: worker_kv.WorkerKV) -> Callable[[torch.Tensor, str], torch.Tensor]:
    """Narrow any tensor over one of ``state``'s buffers to the committed blocks; the same tensor object gives the
    same narrowed object (layers sharing a KV cache tensor keep sharing it)."""
    by_base = _buffers_by_base(state)
    buffers = state.buffers
    assert buffers is not None  # _buffers_by_base refused a state without buffers
    reserved, n = buffers.max_num_blocks, buffers.num_blocks
    done: dict[int, torch.Tensor] = {}

    def narrow(view: torch.Tensor, what: str) -> torch.Tensor:
        if id(view) in done:
            return done[id(view)]
        buffer = by_base.get(view.untyped_storage().data_ptr())
        if buffer is None:
            raise ExtensibleKVUnsupported(
                f"{what} is not a view of an extensible KV buffer (storage at "
                f"{view.untyped_storage().data_ptr():#x}); it cannot be narrowed"
            )
        done[id(view)] = narrow_view(view, buffer.committed, buffer.page, reserved, n, f"{what} ({buffer.name})")
        return done[id(view)]

    return narrow


def narrow_kv_caches(state: worker_kv.WorkerKV, kv_caches: dict[str, Any]) -> dict[str, Any]:
    """The runner's ``kv_caches`` (layer -> tensor, or list of Mamba state tensors) narrowed to the committed
    blocks of ``state``'s buffers."""
    narrow = _narrower(state)
    out: dict[str, Any] = {}
    for name, value in kv_caches.items():
        if isinstance(value, torch.Tensor):
            out[name] = narrow(value, f"layer {name}")
        else:
            out[name] = [narrow(v, f"layer {name} state {i}") for i, v in enumerate(value)]
    return out


def _flat(value: object) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flat(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat(v)


def extents(state: worker_kv.WorkerKV, handed: object) -> tuple[list[dict], int, int]:
    """Per tensor handed over: shape, strides, dtype, its buffer, the bytes of its storage and the bytes its own
    elements span; the distinct storages' bytes together, and the committed bytes of the buffers they are in."""
    buffers = state.buffers
    assert buffers is not None, "no extensible KV buffers: nothing was handed over from them"
    bases = {buffers.tensor(b.name).base_address: b.name for b in buffers.buffers}
    rows, storages, seen = [], {}, set()
    for t in _flat(handed):
        if id(t) in seen:
            continue
        seen.add(id(t))
        storage = t.untyped_storage()
        item = t.element_size()
        span = (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * item if t.numel() else 0
        rows.append(
            {
                "shape": list(t.shape),
                "stride": list(t.stride()),
                "dtype": str(t.dtype).replace("torch.", ""),
                "buffer": bases.get(storage.data_ptr()),
                "storage_bytes": storage.nbytes(),
                "offset_bytes": t.storage_offset() * item,
                "view_bytes": span,
            }
        )
        storages[storage.data_ptr()] = storage.nbytes()
    committed = sum(buffers.tensor(bases[p]).stats().committed_bytes for p in storages if p in bases)
    return rows, sum(storages.values()), committed


# -- registration ---------------------------------------------------------------------------------------------------
def tell_committed_count(config: Any, num_blocks: int) -> None:
    """Rewrite a connector's ``KVCacheConfig`` in place to the legacy configuration of ``num_blocks`` blocks
    (Note [The connector is told the committed count])."""
    old = config.num_blocks
    for tensor in getattr(config, "kv_cache_tensors", ()):
        tensor.size = tensor.size // old * num_blocks
    config.num_blocks = num_blocks


def register(state: worker_kv.WorkerKV) -> Registration | None:
    """After the final commit: hand ``state``'s connector its KV tensors narrowed to exactly the committed blocks
    and replay the recorded calls (Note [The contract for connector authors]). ``None`` without a connector.
    Everything is narrowed and checked before the connector is called; a connector that refuses gets
    ``ExtensibleKVUnsupported`` naming it and its reason."""
    current = session(state)
    if current is None:
        return None
    if current.registration is not None:
        return current.registration
    n = state.buffers.num_blocks if state.buffers is not None else 0
    handed: torch.Tensor | dict[str, Any]
    if "register_cross_layers_kv_cache" in current.calls:
        tensor, backend = _arguments(current.calls["register_cross_layers_kv_cache"], ("kv_cache", "attn_backend"))
        kind, handed = "cross_layers", _narrower(state)(tensor, "the cross-layer KV cache")
        args: tuple = (handed, backend)
    elif "register_kv_caches" in current.calls:
        (kv_caches,) = _arguments(current.calls["register_kv_caches"], ("kv_caches",))
        kind, handed = "kv_caches", narrow_kv_caches(state, kv_caches)
        args = (handed,)
    else:
        raise ExtensibleKVUnsupported(
            f"KV connector {current.name}: the model runner never registered its KV "
            f"caches (register_kv_caches) while it allocated them; nothing to hand over"
        )
    rows, storage_bytes, committed = extents(state, handed)
    current.restore()
    tell_committed_count(current.connector._kv_cache_config, n)
    method = "register_kv_caches" if kind == "kv_caches" else "register_cross_layers_kv_cache"
    assert state.buffers is not None  # the narrowing above refused a state without buffers
    holder = escaped(f"KV connector {current.name}")
    holder = holder if len(holder) <= HOLDER_CHARS else holder[: HOLDER_CHARS - 3] + "..."
    state.buffers.pin(holder)  # before the views are handed over: every release and growth path refuses from now on
    try:
        getattr(current.connector, method)(*args)
        if "set_host_xfer_buffer_ops" in current.calls:
            call_args, call_kwargs = current.calls["set_host_xfer_buffer_ops"]
            current.connector.set_host_xfer_buffer_ops(*call_args, **call_kwargs)
    except BaseException as exc:
        state.buffers.unpin(holder)  # the connector refused them: it holds no view
        if isinstance(exc, ExtensibleKVUnsupported) or not isinstance(exc, Exception):
            raise
        raise ExtensibleKVUnsupported(
            f"KV connector {current.name} refused the KV caches of this model "
            f"({kind}, {n} blocks): {type(exc).__name__}: {exc}"
        ) from exc
    current.registration = Registration(current.name, kind, n, committed, storage_bytes, rows)
    logger.info(
        "extensible KV cache: KV connector %s registered %d committed blocks (%d bytes in %d tensors)",
        current.name,
        n,
        storage_bytes,
        len(rows),
    )
    return current.registration


def _arguments(call: tuple, names: tuple[str, ...]) -> tuple:
    """A recorded call's arguments ``names``, whether passed by position or by name (vLLM's base signatures)."""
    args, kwargs = call
    return tuple(args[: len(names)]) + tuple(kwargs[n] for n in names[len(args) :])


# -- after registration ---------------------------------------------------------------------------------------------
def check_resize(state: worker_kv.WorkerKV, num_blocks: int, operation: str) -> None:
    """Refuse growing ``state`` past the block count its connector registered (Note [Registered once])."""
    current = session(state)
    if current is None or current.registration is None or num_blocks <= current.registration.num_blocks:
        return
    raise ExtensibleKVUnsupported(
        f"{operation}: growing the KV cache from {current.registration.num_blocks} to {num_blocks} blocks is "
        f"refused: KV connector {current.name} registered the {current.registration.num_blocks} committed blocks "
        f"and connectors register the KV memory once (Note [Registered once] in extensible_kv.vllm.connector)"
    )


def refuse_release(state: worker_kv.WorkerKV, operation: str) -> None:
    """Refuse releasing ``state``'s pages (sleep mode) while a connector has them registered."""
    current = session(state)
    if current is None or current.registration is None:
        return
    raise ExtensibleKVUnsupported(
        f"{operation}: releasing the KV pages is refused: KV connector {current.name} registered them "
        f"({current.registration.num_blocks} blocks) and would be left holding unmapped memory (Note [Registered "
        f"once] in extensible_kv.vllm.connector)"
    )


def report(state: worker_kv.WorkerKV | None) -> dict | None:
    """What the connector was handed (``Registration.to_dict``), ``{"connector", "registered": None}`` while it
    is deferred, ``None`` without a connector."""
    current = session(state) if state is not None else None
    if current is None:
        return None
    if current.registration is None:
        return {"connector": current.name, "registered": None}
    return current.registration.to_dict()


# -- V1 cross-layer blocks ------------------------------------------------------------------------------------------
def cross_layer_allocator(state: worker_kv.WorkerKV, original: Callable) -> Callable:
    """``allocate_uniform_kv_caches`` for one call, on ``state``'s extensible buffers (Note [Cross-layer blocks on
    the extensible path]). ``original``: vLLM's (a static method: no ``self``)."""

    def allocate_uniform_kv_caches(kv_cache_config, attn_groups, cache_dtype, device, kernel_block_sizes):
        caches, cross, backend = original(
            kv_cache_config, attn_groups, cache_dtype, torch.device("meta"), kernel_block_sizes
        )
        n = kv_cache_config.num_blocks
        total = cross.numel() * cross.element_size()
        page = total // n if n else 0
        try:
            first = block_dim(cross.shape, "the cross-layer KV cache", num_blocks=n) == 0
        except LayoutError:
            first = False
        if not first or total % n or cross.stride(0) * cross.element_size() != page:
            raise ExtensibleKVUnsupported(
                f"the cross-layer KV cache of shape {tuple(cross.shape)} strides {cross.stride()} ({n} blocks of "
                f"{page} bytes) does not put the blocks physically first; the extensible path cannot commit it a "
                f"block prefix at a time"
            )
        state.segments = [1]
        one = SimpleNamespace(num_blocks=n, kv_cache_tensors=[SimpleNamespace(size=total, shared_by=[CROSS_LAYER])])
        raw = state.allocate(one)[CROSS_LAYER]
        real = raw.view(cross.dtype).view(cross.shape)
        made: dict[int, torch.Tensor] = {}
        views = {}
        for name, meta in caches.items():
            if id(meta) not in made:
                made[id(meta)] = real.as_strided(meta.shape, meta.stride(), meta.storage_offset())
            views[name] = made[id(meta)]
        return views, real, backend

    return allocate_uniform_kv_caches
