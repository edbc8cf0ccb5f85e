"""KV connectors on the extensible path, without vLLM: a connector is handed exactly the committed blocks, once, after
the final commit, in the legacy layout for that block count; what cannot be narrowed, growth after registration and
release are refused (``extensible_kv.vllm.connector``)."""

from __future__ import annotations

import math
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from extensible_kv.drivers import Ledger
from extensible_kv.drivers.host import HostDriver
from extensible_kv.layout import attention_view, block_major, mamba_state_views
from extensible_kv.vllm import ExtensibleKVUnsupported, connector, patches, worker_kv

RESERVED, COMMITTED = 96, 5  # 96: no other dimension of the layouts below has that size (block_dim)
BLOCK, HEADS, HEAD = 16, 2, 64
ATTN_PAGE = 2 * BLOCK * HEADS * HEAD * 2  # K and V, bf16
MAMBA_SHAPES, MAMBA_DTYPES = ((3, 40), (2, 8, 8)), (torch.bfloat16, torch.float32)


@pytest.fixture(autouse=True)
def _no_session(monkeypatch):
    monkeypatch.setattr(connector, "_SESSION", None)  # one worker's connector session per test


# -- the runner's reshape of raw int8 buffers, per layout kind (as vLLM 0.26.0's runners build them) ---------------
def _blocks(raw: torch.Tensor, page: int) -> int:
    return raw.numel() // page


def _flash(raw):  # block-major, logical (B, 2, N, H, D) viewed in the HND stride order
    return attention_view(raw, (_blocks(raw, ATTN_PAGE), 2, BLOCK, HEADS, HEAD), (0, 1, 3, 2, 4), torch.bfloat16)


def _mla(raw):  # (B, N, 576), one latent head
    return attention_view(raw, (_blocks(raw, BLOCK * 576 * 2), BLOCK, 576), (0, 1, 2), torch.bfloat16)


def _hybrid(raw):  # K/V-first (2, B, N, H, D) re-strided block-major, as vLLM does for attention next to Mamba
    return block_major(
        attention_view(raw, (2, _blocks(raw, ATTN_PAGE), BLOCK, HEADS, HEAD), (0, 1, 2, 3, 4), torch.bfloat16)
    )


def _mamba(raw):  # Mamba states packed in the attention page of a hybrid model
    return mamba_state_views(raw, MAMBA_SHAPES, MAMBA_DTYPES, ATTN_PAGE, _blocks(raw, ATTN_PAGE))


def _kv_split(raw):  # ROCM_ATTN's K/V-split (2, B, N, H, D): two lockstep segments
    return attention_view(raw, (2, _blocks(raw, ATTN_PAGE), BLOCK, HEADS, HEAD), (0, 1, 2, 3, 4), torch.bfloat16)


KINDS = {  # layout kind: (page bytes, reshape per layer)
    "block_major": (ATTN_PAGE, {"layer0": _flash, "layer1": _flash}),
    "mla": (BLOCK * 576 * 2, {"layer0": _mla, "layer1": _mla}),
    "hybrid": (ATTN_PAGE, {"layer0": _hybrid, "layer1": _mamba}),
}


def _reshape(kind: str):
    _, per_layer = KINDS.get(kind, (ATTN_PAGE, {"layer0": _kv_split, "layer1": _kv_split}))
    return lambda raw: {name: per_layer[name](t) for name, t in raw.items()}


def _config(num_blocks: int, page: int):
    return SimpleNamespace(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            SimpleNamespace(size=num_blocks * page, shared_by=[f"layer{i}"], block_stride=0) for i in range(2)
        ],
    )


class FakeConnector:
    """A worker-side connector as vLLM's base class has it: the KVCacheConfig it was built with (``_kv_cache_config``)
    and the calls it gets, each with the block count its config said at that moment."""

    def __init__(self, config, fail: Exception | None = None):
        self._kv_cache_config = config
        self.fail = fail
        self.calls: list[tuple] = []

    def register_kv_caches(self, kv_caches):
        if self.fail is not None:
            raise self.fail
        self.calls.append(("register_kv_caches", kv_caches, self._kv_cache_config.num_blocks))

    def register_cross_layers_kv_cache(self, kv_cache, attn_backend):
        self.calls.append(("register_cross_layers_kv_cache", kv_cache, attn_backend, self._kv_cache_config.num_blocks))

    def set_host_xfer_buffer_ops(self, copy_operation):
        self.calls.append(("set_host_xfer_buffer_ops", copy_operation))

    def methods(self) -> list[str]:
        """The methods called, in order (for messages: a tensor over reserved memory must never be printed)."""
        return [call[0] for call in self.calls]


def _worker(kind: str):
    """A worker that derived its segments, allocated the reservation and built the runner's views over it."""
    page = KINDS[kind][0] if kind in KINDS else ATTN_PAGE
    state = worker_kv.start(Ledger(HostDriver(granularity=4096)))
    config = _config(RESERVED, page)
    state.segments = worker_kv.derive_segments(config, _reshape(kind))
    return state, config, page


def _signature(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.untyped_storage().nbytes()


def _flat(value) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


# -- narrowing, per layout kind -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_connector_gets_the_legacy_layout_of_exactly_the_committed_blocks(kind):
    state, config, page = _worker(kind)
    conn = FakeConnector(config)
    connector.defer(state, conn)
    views = _reshape(kind)(state.allocate(config))
    conn.register_kv_caches(views)  # what the runner does right after allocating: recorded, not passed on
    conn.set_host_xfer_buffer_ops("copy_kv_blocks")
    try:
        assert conn.methods() == [], f"{kind}: the connector was called before the final commit: {conn.methods()}"
        state.ensure_blocks(COMMITTED, reason="final size")
        registration = connector.register(state)
        (method, handed, told), xfer = conn.calls
        assert (method, told, xfer) == (
            "register_kv_caches",
            COMMITTED,
            ("set_host_xfer_buffer_ops", "copy_kv_blocks"),
        ), conn.methods()
        legacy = _reshape(kind)({name: torch.zeros(COMMITTED * page, dtype=torch.int8) for name in views})
        for name in views:
            for k, (got, want) in enumerate(zip(_flat(handed[name]), _flat(legacy[name]), strict=True)):
                assert _signature(got) == _signature(want), (
                    f"{kind} layer {name} view {k}: expected the legacy (shape, stride, offset, dtype, storage "
                    f"bytes) for {COMMITTED} blocks {_signature(want)}, got {_signature(got)}"
                )
                base = state.buffers.tensor(state.layer_buffer[name]).base_address
                assert got.untyped_storage().data_ptr() == base, f"{kind} {name}: not at the buffer's base address"
        assert registration.storage_bytes == registration.committed_bytes == 2 * COMMITTED * page, (
            registration.to_dict()
        )
        assert all(row["storage_bytes"] == COMMITTED * page for row in registration.tensors), registration.tensors
    finally:
        state.buffers.close()


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_narrowed_view_reads_and_writes_the_runners_own_bytes(kind):
    state, config, _ = _worker(kind)
    conn = FakeConnector(config)
    connector.defer(state, conn)
    views = _reshape(kind)(state.allocate(config))
    conn.register_kv_caches(views)
    try:
        state.ensure_blocks(COMMITTED, reason="final size")
        connector.register(state)
        handed = conn.calls[0][1]
        gen = torch.Generator().manual_seed(3)
        for name, full in views.items():
            for k, (mine, runners) in enumerate(zip(_flat(handed[name]), _flat(full))):
                dim = max(range(runners.dim()), key=lambda d: runners.stride(d) if runners.shape[d] > 1 else -1)
                values = torch.randn(mine.shape, generator=gen).to(mine.dtype)
                mine.copy_(values)
                runner_part = runners.narrow(dim, 0, mine.shape[dim])
                assert torch.equal(runner_part, values), (
                    f"{kind} layer {name} view {k}: what the connector wrote is not what the runner reads in the "
                    f"committed blocks"
                )
    finally:
        state.buffers.close()


def test_layers_sharing_one_tensor_keep_sharing_it():
    state, config, _ = _worker("block_major")
    conn = FakeConnector(config)
    connector.defer(state, conn)
    views = _reshape("block_major")(state.allocate(config))
    views["layer2"] = views["layer0"]  # KV sharing: vLLM maps the layer to its target's tensor
    conn.register_kv_caches(views)
    try:
        state.ensure_blocks(COMMITTED, reason="final size")
        connector.register(state)
        handed = conn.calls[0][1]
        assert handed["layer2"] is handed["layer0"] and handed["layer1"] is not handed["layer0"], (
            "layers sharing a KV cache tensor must be handed one tensor object, the others their own"
        )
    finally:
        state.buffers.close()


def test_the_connectors_kv_cache_config_says_the_committed_count_when_it_registers():
    state, config, page = _worker("block_major")
    conn = FakeConnector(config)
    connector.defer(state, conn)
    conn.register_kv_caches(_reshape("block_major")(state.allocate(config)))
    try:
        assert config.num_blocks == RESERVED, "the config must not change before the final commit"
        state.ensure_blocks(COMMITTED, reason="final size")
        connector.register(state)
        got = (conn.calls[0][2], config.num_blocks, [t.size for t in config.kv_cache_tensors])
        assert got == (COMMITTED, COMMITTED, [COMMITTED * page] * 2), (
            f"the connector's KVCacheConfig: expected {COMMITTED} blocks of {page} bytes per tensor when it "
            f"registers, got (count seen, count, sizes) {got}"
        )
    finally:
        state.buffers.close()


# -- cross-layer blocks (V1, a connector preferring them) ----------------------------------------------------------
def _uniform(layers_first: bool = False):
    """vLLM's allocate_uniform_kv_caches for a block-major backend: one tensor, physically (B, L, N, H, 2D), each
    layer's view the layer index of it (physically (L, B, ...) with ``layers_first``)."""

    def allocate_uniform_kv_caches(kv_cache_config, attn_groups, cache_dtype, device, kernel_block_sizes):
        n, count = kv_cache_config.num_blocks, len(kv_cache_config.kv_cache_tensors)
        total = count * kv_cache_config.kv_cache_tensors[0].size
        shape = (count, n, BLOCK, HEADS, 2 * HEAD) if layers_first else (n, count, BLOCK, HEADS, 2 * HEAD)
        cross = torch.zeros(total, dtype=torch.int8, device=device).view(torch.bfloat16).view(shape)
        per_layer = cross if layers_first else cross.permute(1, 0, 2, 3, 4)
        caches = {name: per_layer[i] for i, t in enumerate(kv_cache_config.kv_cache_tensors) for name in t.shared_by}
        return caches, cross, "BACKEND"

    return allocate_uniform_kv_caches


def test_cross_layer_blocks_are_reserved_as_one_buffer_and_handed_over_narrowed():
    state = worker_kv.start(Ledger(HostDriver(granularity=4096)))
    config = _config(RESERVED, ATTN_PAGE)
    conn = FakeConnector(config)
    connector.defer(state, conn)
    caches, cross, backend = connector.cross_layer_allocator(state, _uniform())(config, None, "auto", "cuda", [16])
    conn.register_cross_layers_kv_cache(cross, backend)
    try:
        assert state.segments == [1] and state.buffers.max_num_blocks == RESERVED, (state.segments, state.buffers)
        legacy_caches, _, _ = _uniform()(_config(RESERVED, ATTN_PAGE), None, "auto", "cpu", [16])
        for name, view in caches.items():
            assert _signature(view)[:4] == _signature(legacy_caches[name])[:4], (name, _signature(view))
            assert view.untyped_storage().data_ptr() == cross.untyped_storage().data_ptr(), name
        state.ensure_blocks(COMMITTED, reason="final size")
        connector.register(state)
        ((method, handed, got_backend, told),) = conn.calls
        _, want, _ = _uniform()(_config(COMMITTED, ATTN_PAGE), None, "auto", "cpu", [16])
        assert (method, got_backend, told) == ("register_cross_layers_kv_cache", "BACKEND", COMMITTED), conn.methods()
        assert _signature(handed) == _signature(want), (
            f"cross-layer tensor: expected the legacy {_signature(want)} for {COMMITTED} blocks, got "
            f"{_signature(handed)}"
        )
    finally:
        state.buffers.close()


def test_cross_layer_blocks_that_are_not_physically_first_are_refused_before_anything_is_reserved():
    state = worker_kv.start(Ledger(HostDriver(granularity=4096)))
    allocate = connector.cross_layer_allocator(state, _uniform(layers_first=True))
    with pytest.raises(ExtensibleKVUnsupported, match="does not put the blocks physically first"):
        allocate(_config(RESERVED, ATTN_PAGE), None, "auto", "cuda", [16])
    assert state.buffers is None, "a refused cross-layer layout must reserve nothing"


# -- refusals -------------------------------------------------------------------------------------------------------
def test_a_kv_split_layout_is_refused_naming_the_connector_before_anything_is_reserved():
    state, config, _ = _worker("kv_split")
    conn = FakeConnector(config)
    assert state.segments == [2, 2], state.segments
    with pytest.raises(ExtensibleKVUnsupported, match=r"KV connector FakeConnector: .*K/V-split"):
        connector.defer(state, conn)
    assert state.buffers is None and connector.session() is None, "nothing may be reserved or deferred"
    assert not set(connector.DEFERRED) & set(vars(conn)), f"the connector was left patched: {vars(conn)}"


def test_a_view_reaching_past_the_committed_blocks_is_refused_even_with_one_page_between_blocks():
    # Blocks one page apart, but an inner dimension strides over whole blocks (a K/V split the segment count missed):
    # the first COMMITTED blocks of it reach past the committed bytes.
    page = 64
    full = torch.zeros(2 * RESERVED * page, dtype=torch.int8)
    view = torch.as_strided(full, (RESERVED, 2, 32), (page, RESERVED * page, 1))
    committed = torch.zeros(COMMITTED * page, dtype=torch.int8)
    with pytest.raises(ExtensibleKVUnsupported, match=rf"reaches byte \d+, past the {COMMITTED * page} committed"):
        connector.narrow_view(view, committed, page, RESERVED, COMMITTED, "layer x")
    ok = connector.narrow_view(
        full[: RESERVED * page].view(RESERVED, page), committed, page, RESERVED, COMMITTED, "layer y"
    )
    assert _signature(ok) == ((COMMITTED, page), (page, 1), 0, torch.int8, COMMITTED * page), _signature(ok)


def test_a_view_whose_blocks_are_not_one_page_apart_is_refused():
    full = torch.zeros(RESERVED * 64, dtype=torch.int8)
    view = torch.as_strided(full, (RESERVED, 32), (32, 1))  # blocks half a page apart
    with pytest.raises(ExtensibleKVUnsupported, match="are 32 bytes apart, not one 64-byte page"):
        connector.narrow_view(view, torch.zeros(COMMITTED * 64, dtype=torch.int8), 64, RESERVED, COMMITTED, "z")


def test_a_connector_that_refuses_the_kv_caches_gets_a_refusal_naming_it_and_its_reason():
    state, config, _ = _worker("hybrid")
    conn = FakeConnector(config, fail=NotImplementedError("no MambaSpec here"))
    connector.defer(state, conn)
    conn.register_kv_caches(_reshape("hybrid")(state.allocate(config)))
    try:
        state.ensure_blocks(COMMITTED, reason="final size")
        with pytest.raises(
            ExtensibleKVUnsupported,
            match=r"KV connector FakeConnector refused .*"
            r"NotImplementedError: no MambaSpec here",
        ):
            connector.register(state)
        assert connector.session(state).registration is None, "a refused registration must not be recorded"
        connector.check_resize(state, COMMITTED + 1, "test")  # not registered: growth is not refused
    finally:
        state.buffers.close()


def test_a_tensor_outside_the_extensible_buffers_is_refused_before_the_connector_sees_anything():
    state, config, _ = _worker("block_major")
    conn = FakeConnector(config)
    connector.defer(state, conn)
    views = _reshape("block_major")(state.allocate(config))
    views["stray"] = torch.zeros(8, dtype=torch.bfloat16)
    conn.register_kv_caches(views)
    try:
        state.ensure_blocks(COMMITTED, reason="final size")
        with pytest.raises(ExtensibleKVUnsupported, match="layer stray is not a view of an extensible KV buffer"):
            connector.register(state)
        assert conn.methods() == [] and config.num_blocks == RESERVED, (conn.methods(), config.num_blocks)
    finally:
        state.buffers.close()


def test_a_runner_that_never_registered_is_refused():
    state, config, _ = _worker("block_major")
    connector.defer(state, FakeConnector(config))
    state.allocate(config)
    try:
        with pytest.raises(ExtensibleKVUnsupported, match="never registered its KV caches"):
            connector.register(state)
    finally:
        state.buffers.close()


def test_growth_and_release_after_registration_are_refused_naming_the_connector():
    state, config, _ = _worker("block_major")
    conn = FakeConnector(config)
    connector.defer(state, conn)
    conn.register_kv_caches(_reshape("block_major")(state.allocate(config)))
    try:
        connector.check_resize(state, RESERVED, "before registration")  # nothing registered yet: allowed
        connector.refuse_release(state, "before registration")
        state.ensure_blocks(COMMITTED, reason="final size")
        connector.register(state)
        connector.check_resize(state, COMMITTED, "the same count again")  # no growth: allowed
        with pytest.raises(
            ExtensibleKVUnsupported,
            match=rf"growing the KV cache from {COMMITTED} to "
            rf"{COMMITTED + 1} blocks is refused: KV connector "
            rf"FakeConnector",
        ):
            connector.check_resize(state, COMMITTED + 1, "extensible_kv_commit")
        with pytest.raises(
            ExtensibleKVUnsupported, match="sleep: releasing the KV pages is refused: KV connector FakeConnector"
        ):
            connector.refuse_release(state, "sleep")
    finally:
        state.buffers.close()


def test_after_registration_the_connectors_own_methods_are_back():
    state, config, _ = _worker("block_major")
    conn = FakeConnector(config)
    connector.defer(state, conn)
    assert set(connector.DEFERRED) <= set(vars(conn)), "defer must record the runner's calls on the instance"
    conn.register_kv_caches(_reshape("block_major")(state.allocate(config)))
    try:
        state.ensure_blocks(COMMITTED, reason="final size")
        connector.register(state)
        assert not set(connector.DEFERRED) & set(vars(conn)), f"left on the instance: {sorted(vars(conn))}"
        assert connector.register(state) is connector.session(state).registration and len(conn.calls) == 1, (
            "a second register must not register again"
        )
    finally:
        state.buffers.close()


def test_without_a_connector_nothing_is_deferred_or_registered():
    state, _, _ = _worker("block_major")
    assert connector.defer(state, None) is None and connector.register(state) is None
    assert connector.report(state) is None
    connector.check_resize(state, RESERVED, "no connector")


# -- configuration ---------------------------------------------------------------------------------------------------
def _vllm_config(name: str | None, sleep: bool = False, children: tuple = ()):
    extra = {"connectors": [{"kv_connector": c} for c in children]} if children else {}
    ktc = None if name is None else SimpleNamespace(kv_connector=name, kv_connector_extra_config=extra)
    return SimpleNamespace(kv_transfer_config=ktc, model_config=SimpleNamespace(enable_sleep_mode=sleep))


_CUDA = SimpleNamespace(is_cuda_alike=lambda: True, device_name="cuda")


@pytest.mark.parametrize("name", ["OffloadingConnector", "ExampleConnector", "SimpleCPUOffloadConnector"])
def test_a_kv_connector_alone_is_no_longer_refused(name):
    patches.check_supported(_vllm_config(name), _CUDA)  # raises if refused


def test_a_kv_connector_with_sleep_mode_is_refused_naming_both():
    config = _vllm_config("MultiConnector", sleep=True, children=("OffloadingConnector", "ExampleConnector"))
    with pytest.raises(
        ExtensibleKVUnsupported,
        match=r"KV connector MultiConnector\(OffloadingConnector, "
        r"ExampleConnector\) with sleep mode",
    ):
        patches.check_supported(config, _CUDA)
    patches.check_supported(_vllm_config(None, sleep=True), _CUDA)  # sleep mode alone is not refused here


def test_connector_names_include_a_multiconnectors_children():
    class MultiConnector:
        def __init__(self, children):
            self._connectors = children

    class OffloadingConnector:
        pass

    got = connector.connector_name(MultiConnector([OffloadingConnector(), FakeConnector(None)]))
    assert got == "MultiConnector(OffloadingConnector, FakeConnector)", got


# -- the hooks in patches.py, end to end with stand-ins for vLLM ----------------------------------------------------
class _Runner:
    """V1's GPUModelRunner as the patch sees it: the connector's cross-layer preference decides the path."""

    __module__ = "vllm.v1.worker.gpu_model_runner"

    def __init__(self, uniform: bool):
        self.vllm_config = _vllm_config("OffloadingConnector")
        self.attn_groups = [[object()]]
        self.uniform = uniform
        self.kv_cache_config = SimpleNamespace(num_blocks=RESERVED)

    def use_uniform_kv_cache(self, attn_groups):
        return self.uniform

    allocate_uniform_kv_caches = staticmethod(_uniform())

    def _reshape_kv_cache_tensors(self, raw, kernel_block_sizes):
        return _reshape("block_major")(raw)


def _v1_original(conn):
    """vLLM's initialize_kv_cache_tensors, and initialize_kv_cache's registration right after it."""

    def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes):
        if self.use_uniform_kv_cache(self.attn_groups):
            caches, cross, backend = self.allocate_uniform_kv_caches(
                kv_cache_config, self.attn_groups, "auto", "cuda", kernel_block_sizes
            )
            conn.register_cross_layers_kv_cache(cross, backend)
        else:
            caches = self._reshape_kv_cache_tensors(worker_kv.active().allocate(kv_cache_config), kernel_block_sizes)
            conn.register_kv_caches(caches)
        conn.set_host_xfer_buffer_ops("copy_kv_blocks")
        return caches

    return initialize_kv_cache_tensors


@pytest.mark.parametrize("uniform", [False, True], ids=["per_layer", "cross_layer"])
def test_the_v1_patch_defers_registration_to_the_final_commit_and_refuses_growth_after_it(monkeypatch, uniform):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.platforms", SimpleNamespace(current_platform=_CUDA))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(patches, "_platform_driver", lambda: Ledger(HostDriver(granularity=4096)))
    config = _config(RESERVED, ATTN_PAGE)
    conn = FakeConnector(config)
    monkeypatch.setattr(connector, "transfer_group", lambda: conn)
    runner = _Runner(uniform)
    patches._v1_initialize_kv_cache_tensors(_v1_original(conn))(runner, config, [BLOCK])
    state = worker_kv.active()
    worker = SimpleNamespace(_extensible_kv_state=state, model_runner=runner, cache_config=SimpleNamespace())
    try:
        assert conn.methods() == [] and "allocate_uniform_kv_caches" not in vars(runner), (conn.methods(), vars(runner))
        report = patches.extensible_kv_commit(worker, COMMITTED)
        method = "register_cross_layers_kv_cache" if uniform else "register_kv_caches"
        assert conn.methods() == [method, "set_host_xfer_buffer_ops"], conn.methods()
        handed = conn.calls[0][1]
        tensors = [handed] if uniform else list(handed.values())
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        committed = report["kv"]["committed_bytes"]
        assert sum(storages.values()) == committed == 2 * COMMITTED * ATTN_PAGE, (
            f"V1 {method}: expected the storages handed over to be the {committed} committed bytes, got {storages}"
        )
        kind = "cross_layers" if uniform else "kv_caches"
        assert (report["connector"]["num_blocks"], report["connector"]["kind"]) == (COMMITTED, kind), report[
            "connector"
        ]
        with pytest.raises(ExtensibleKVUnsupported, match="growing the KV cache"):
            patches.extensible_kv_commit(worker, COMMITTED + 3)
        assert state.buffers.num_blocks == COMMITTED, "a refused growth must commit nothing"
    finally:
        state.buffers.close()


def test_extents_count_each_storage_once():
    state, config, page = _worker("hybrid")
    state.allocate(config)
    try:
        state.ensure_blocks(COMMITTED, reason="final size")
        narrowed = connector.narrow_kv_caches(
            state, _reshape("hybrid")({name: state.buffers.raw(buf) for name, buf in state.layer_buffer.items()})
        )
        rows, storage_bytes, committed = connector.extents(state, narrowed)
        want_rows = 1 + len(MAMBA_SHAPES)
        assert (len(rows), storage_bytes, committed) == (want_rows, 2 * COMMITTED * page, 2 * COMMITTED * page), (
            rows,
            storage_bytes,
            committed,
        )
        spans = [row["view_bytes"] for row in rows]
        assert all(0 < s <= COMMITTED * page for s in spans), spans
        assert math.prod(rows[0]["shape"]) * 2 == COMMITTED * page, rows[0]
    finally:
        state.buffers.close()


def test_the_scheduler_is_built_from_the_legacy_configuration_of_the_committed_blocks(monkeypatch):
    """The engine's KVCacheConfig (the scheduler's, and the scheduler side of a connector, which sizes its CPU tier
    from the bytes per block) says the committed count and the tensor sizes of that count, not the reserved ones."""
    page = ATTN_PAGE
    config = SimpleNamespace(
        num_blocks=RESERVED,
        kv_cache_groups=[],
        kv_cache_tensors=[SimpleNamespace(size=RESERVED * page, shared_by=["l0"])],
    )
    monkeypatch.setitem(
        sys.modules,
        "vllm.platforms",
        types.SimpleNamespace(current_platform=SimpleNamespace(is_cuda_alike=lambda: True, device_name="cuda")),
    )
    monkeypatch.setitem(sys.modules, "vllm.v1.engine", types.SimpleNamespace(core=SimpleNamespace()))
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.core", SimpleNamespace())
    rpcs = {"extensible_kv_measure": [COMMITTED], "extensible_kv_commit": [{}]}
    engine = SimpleNamespace(model_executor=SimpleNamespace(collective_rpc=lambda name, args=(): rpcs[name]))
    vllm_config = SimpleNamespace(kv_transfer_config=None, model_config=None, cache_config=SimpleNamespace())
    got = patches._initialize_kv_caches(lambda self, cfg: config)(engine, vllm_config)
    seen = (got.num_blocks, [t.size for t in got.kv_cache_tensors], vllm_config.cache_config.num_gpu_blocks)
    want = (COMMITTED, [COMMITTED * page], COMMITTED)
    assert seen == want, (
        f"engine KVCacheConfig after the final commit (num_blocks, tensor sizes, num_gpu_blocks): "
        f"expected {want}, got {seen}"
    )
