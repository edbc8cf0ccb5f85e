"""What a KV connector is handed on the extensible path, checked against vLLM 0.26.0's own reshape code and its own
connectors (runs on CPU): for every layout kind of ``test_backend_layouts``'s backends (block-major attention, MLA,
hybrid attention+Mamba re-strided, Mamba state, V1's cross-layer blocks) the views are exactly vLLM's legacy views
for the committed block count, over exactly the committed bytes; the K/V-split layout (ROCM_ATTN) is refused.

Needs vllm==0.26.0 (the nox ``layouts`` session installs it; elsewhere these tests skip, and with
``EXTENSIBLE_KV_REQUIRE_VLLM=1`` a missing vllm fails instead).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from extensible_kv.backend_check import resolve_backend
from extensible_kv.drivers import Ledger
from extensible_kv.drivers.host import HostDriver
from extensible_kv.errors import ExtensibleKVError
from extensible_kv.vllm import ExtensibleKVUnsupported, connector, worker_kv

if os.environ.get("EXTENSIBLE_KV_REQUIRE_VLLM") == "1":
    import vllm  # a missing vllm must fail here
vllm = pytest.importorskip("vllm")

from vllm.v1.attention.backends.utils import set_kv_cache_layout  # noqa: E402

HEADS, HEAD, BLOCK = 4, 64, 16
RESERVED, COMMITTED = 300, 7  # 300: no other dimension of these layouts has that size (layout.block_dim)
MAMBA_SHAPES, MAMBA_DTYPES = ((3, 256), (4, 16, 16)), (torch.bfloat16, torch.float32)
MODEL = Path(__file__).resolve().parent / "models" / "tiny-llama"
# Segments per backend (test_backend_layouts.EXPECTED_SEGMENTS): more than one is K/V-split, refused with a connector.
BACKENDS = {
    "FLASH_ATTN": 1,
    "FLASHINFER": 1,
    "TRITON_ATTN": 1,
    "FLEX_ATTENTION": 1,
    "ROCM_ATTN": 2,
    "ROCM_AITER_FA": 1,
    "ROCM_AITER_UNIFIED_ATTN": 1,
    "TRITON_MLA": 1,
    "FLASHMLA": 1,
    "FLASHINFER_MLA": 1,
    "CUTLASS_MLA": 1,
    "FLASH_ATTN_MLA": 1,
    "ROCM_AITER_MLA": 1,
    "ROCM_AITER_TRITON_MLA": 1,
}
NEEDS_CUDA_TO_IMPORT = {"CUTLASS_MLA", "FLASH_ATTN_MLA"}
HYBRID = ["FLASH_ATTN", "TRITON_ATTN", "ROCM_ATTN"]  # attention next to Mamba: vLLM re-strides block-major


@pytest.fixture(autouse=True)
def _no_session(monkeypatch):
    monkeypatch.setattr(connector, "_SESSION", None)


@pytest.fixture(params=["NHD", "HND"])
def kv_layout(request):
    set_kv_cache_layout(request.param)
    yield request.param
    set_kv_cache_layout(None)


def _backend(name: str) -> type:
    try:
        return resolve_backend(name)
    except ExtensibleKVError as exc:
        if name in NEEDS_CUDA_TO_IMPORT and not torch.cuda.is_available():
            pytest.skip(f"{name} imports only with a CUDA device: {exc}")
        if "No module named 'flashinfer'" in str(exc):
            pytest.skip(f"{name} needs the flashinfer package, which is not installed here: {exc}")
        raise


def _vllm_config(kv_connector: str | None = None, extra: dict | None = None):
    from vllm.config import DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig

    ktc = (
        None
        if kv_connector is None
        else KVTransferConfig(kv_connector=kv_connector, kv_role="kv_both", kv_connector_extra_config=extra or {})
    )
    if ktc is None:
        return VllmConfig(device_config=DeviceConfig(device="cpu"))
    model = ModelConfig(model=str(MODEL), skip_tokenizer_init=True, dtype="bfloat16")  # OffloadingConnector reads it
    return VllmConfig(model_config=model, device_config=DeviceConfig(device="cpu"), kv_transfer_config=ktc)


class Case:
    """One model's KV cache as vLLM 0.26.0's V2 runner builds it on CPU: its config for ``num_blocks`` blocks, the
    attention groups and vLLM's own reshape (``attn_utils._reshape_kv_cache``)."""

    def __init__(self, backend_name: str, hybrid: bool, cfg=None):
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
        from vllm.v1.core.kv_cache_utils import create_kv_cache_group_specs
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec
        from vllm.v1.worker.utils import AttentionGroup

        self.cfg = cfg or _vllm_config()
        mla = backend_name.endswith("MLA")
        spec_cls = MLAAttentionSpec if mla else FullAttentionSpec
        attn = spec_cls(
            block_size=BLOCK, num_kv_heads=1 if mla else HEADS, head_size=576 if mla else HEAD, dtype=torch.bfloat16
        )
        with set_current_vllm_config(self.cfg):
            self.backend = _backend(backend_name)
            specs, grouped = {"l0.attn": attn, "l2.attn": attn}, [["l0.attn", "l2.attn"]]
            if hybrid:
                mamba = MambaSpec(
                    block_size=BLOCK, shapes=MAMBA_SHAPES, dtypes=MAMBA_DTYPES, page_size_padded=attn.page_size_bytes
                )
                specs.update({"l1.mamba": mamba, "l3.mamba": mamba})
                grouped.append(["l1.mamba", "l3.mamba"])
            self.groups = create_kv_cache_group_specs(specs, grouped)
            self.attn_groups = [AttentionGroup(self.backend, grouped[0], self.groups[0].kv_cache_spec, 0)]
            if hybrid:
                self.attn_groups.append(
                    AttentionGroup(
                        MambaAttentionBackendEnum.MAMBA2.get_class(), grouped[1], self.groups[1].kv_cache_spec, 1
                    )
                )

    def config(self, num_blocks: int):
        from vllm.config import set_current_vllm_config
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

        self.cfg.cache_config.num_gpu_blocks_override = num_blocks
        with set_current_vllm_config(self.cfg):
            config = get_kv_cache_config_from_groups(self.cfg, self.groups, available_memory=1 << 40)
        assert config.num_blocks == num_blocks, (config.num_blocks, num_blocks)
        return config

    def reshape(self, config, raw: dict) -> dict:
        from vllm.config import set_current_vllm_config
        from vllm.v1.worker.gpu import attn_utils

        with set_current_vllm_config(self.cfg):
            return attn_utils._reshape_kv_cache(
                attn_groups=self.attn_groups,
                kv_cache_raw_tensors=raw,
                kernel_block_sizes=[BLOCK] * len(self.attn_groups),
                cache_dtype="auto",
                shared_kv_cache_layers={},
                kv_cache_config=config,
            )

    def legacy(self, num_blocks: int) -> dict:
        """vLLM's own allocation and views for ``num_blocks`` blocks: what the legacy path registers."""
        from vllm.v1.worker.gpu import attn_utils

        config = self.config(num_blocks)
        return self.reshape(config, attn_utils._allocate_kv_cache(config, {}, torch.device("cpu")))

    def extensible(self, group: object, config=None):
        """The extensible path up to the final commit: segments from the meta dry run, ``defer`` on ``group``,
        the reservation, vLLM's reshape over it and the runner's registration (recorded); ``COMMITTED`` blocks
        committed. Returns (state, the runner's views)."""
        config = config or self.config(RESERVED)
        state = worker_kv.start(Ledger(HostDriver(granularity=4096)))
        state.segments = worker_kv.derive_segments(config, lambda raw: self.reshape(config, raw))
        connector.defer(state, group)
        views = self.reshape(config, state.allocate(config))
        group.register_kv_caches(views)
        state.ensure_blocks(COMMITTED, reason="final size")
        return state, views


class Recorder:
    """A worker-side connector that keeps what it is handed (as vLLM's base class, ``_kv_cache_config``)."""

    def __init__(self, config):
        self._kv_cache_config = config
        self.handed = None

    def register_kv_caches(self, kv_caches):
        self.handed = kv_caches


def _flat(value) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


def _signature(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset() * t.element_size(), t.dtype, t.untyped_storage().nbytes()


def _assert_legacy(what: str, handed: dict, legacy: dict, state) -> None:
    assert set(handed) == set(legacy), f"{what}: layers handed {sorted(handed)}, legacy registers {sorted(legacy)}"
    for name, value in legacy.items():
        for k, (got, want) in enumerate(zip(_flat(handed[name]), _flat(value), strict=True)):
            assert _signature(got) == _signature(want), (
                f"{what} layer {name} view {k}: expected vLLM's legacy (shape, stride, byte offset, dtype, storage "
                f"bytes) for {COMMITTED} blocks {_signature(want)}, got {_signature(got)}"
            )
            base = state.buffers.tensor(state.layer_buffer[name]).base_address
            assert got.untyped_storage().data_ptr() == base, f"{what} layer {name}: not at its buffer's base address"


# -- every layout kind: the views are vLLM's legacy views for the committed count -----------------------------------
@pytest.mark.parametrize("name", BACKENDS, ids=list(BACKENDS))
def test_attention_views_handed_over_are_vllms_legacy_views_of_the_committed_blocks(name, kv_layout):
    case = Case(name, hybrid=False)
    config = case.config(RESERVED)
    recorder = Recorder(config)
    if BACKENDS[name] > 1:  # K/V-split: refused before anything is reserved
        state = worker_kv.start(Ledger(HostDriver(granularity=4096)))
        state.segments = worker_kv.derive_segments(config, lambda raw: case.reshape(config, raw))
        with pytest.raises(ExtensibleKVUnsupported, match="K/V-split"):
            connector.defer(state, recorder)
        assert state.buffers is None, f"{name} ({kv_layout}): a refused layout must reserve nothing"
        return
    state, _ = case.extensible(recorder, config)
    try:
        registration = connector.register(state)
        _assert_legacy(f"{name} ({kv_layout})", recorder.handed, case.legacy(COMMITTED), state)
        assert (
            registration.storage_bytes
            == registration.committed_bytes
            == sum(t.size for t in case.config(COMMITTED).kv_cache_tensors)
        ), registration.to_dict()
    finally:
        state.buffers.close()


@pytest.mark.parametrize("name", HYBRID)
def test_hybrid_attention_and_mamba_views_handed_over_are_vllms_legacy_views(name, kv_layout):
    case = Case(name, hybrid=True)
    config = case.config(RESERVED)
    recorder = Recorder(config)
    state, _ = case.extensible(recorder, config)
    try:
        assert state.segments == [1] * len(config.kv_cache_tensors), f"{name} hybrid: segments {state.segments}"
        connector.register(state)
        _assert_legacy(f"{name} ({kv_layout}, hybrid)", recorder.handed, case.legacy(COMMITTED), state)
        assert recorder._kv_cache_config.num_blocks == COMMITTED, recorder._kv_cache_config.num_blocks
    finally:
        state.buffers.close()


def _uniform_backends() -> list[str]:
    return ["FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "TRITON_MLA", "FLASHMLA"]


@pytest.mark.parametrize("name", _uniform_backends())
def test_cross_layer_blocks_handed_over_are_vllms_legacy_cross_layer_tensor(name, kv_layout):
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    case = Case(name, hybrid=False)
    if not case.backend.indexes_kv_by_block_stride():
        pytest.skip(f"{name} ({kv_layout}) does not index KV by the block stride: vLLM uses no cross-layer blocks")
    vllm_allocate = KVConnectorModelRunnerMixin.allocate_uniform_kv_caches
    config = case.config(RESERVED)
    state = worker_kv.start(Ledger(HostDriver(granularity=4096)))
    recorder = Recorder(config)
    recorder.register_cross_layers_kv_cache = lambda tensor, backend: setattr(recorder, "handed", (tensor, backend))
    connector.defer(state, recorder)
    _, cross, backend = connector.cross_layer_allocator(state, vllm_allocate)(
        config, [case.attn_groups], "auto", torch.device("cpu"), [BLOCK]
    )
    recorder.register_cross_layers_kv_cache(cross, backend)
    try:
        state.ensure_blocks(COMMITTED, reason="final size")
        registration = connector.register(state)
        handed, got_backend = recorder.handed
        _, want, _ = vllm_allocate(case.config(COMMITTED), [case.attn_groups], "auto", torch.device("cpu"), [BLOCK])
        assert (_signature(handed), got_backend) == (_signature(want), case.backend), (
            f"{name} ({kv_layout}) cross-layer: expected vLLM's legacy {_signature(want)} for {COMMITTED} blocks, got "
            f"{_signature(handed)}"
        )
        assert registration.kind == "cross_layers" and registration.storage_bytes == registration.committed_bytes
    finally:
        state.buffers.close()


# -- vLLM's own connectors, handed the narrowed views ---------------------------------------------------------------
def _worker_connector(case: Case, config):
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    with set_current_vllm_config(case.cfg):
        return KVConnectorFactory.create_connector(case.cfg, KVConnectorRole.WORKER, config)


def _offloading(case: Case, config) -> tuple[object, list]:
    """vLLM's OffloadingConnector (worker side) with its CPU worker, which needs a GPU, replaced by a recorder of
    the canonical (num_blocks, page) block tensors it derives."""
    conn = _worker_connector(case, config)
    seen: list = []
    conn.connector_worker.spec.get_worker = lambda caches: seen.append([t.tensor for t in caches.tensors])
    return conn, seen


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid_mamba"])
def test_offloading_connector_derives_exactly_the_committed_blocks(hybrid):
    set_kv_cache_layout("HND")  # OffloadingConnector.get_required_kvcache_layout
    try:
        case = Case("FLASH_ATTN", hybrid, cfg=_vllm_config("OffloadingConnector", {"cpu_bytes_to_use": 1 << 24}))
        config = case.config(RESERVED)
        conn, seen = _offloading(case, config)
        state, _ = case.extensible(conn, config)
        try:
            connector.register(state)
            legacy, legacy_seen = _offloading(case, case.config(COMMITTED))
            legacy.register_kv_caches(case.legacy(COMMITTED))
            got, want = [_signature(t) for t in seen[0]], [_signature(t) for t in legacy_seen[0]]
            assert got == want, (
                f"OffloadingConnector (hybrid={hybrid}): expected its legacy block tensors {want}, got {got}"
            )
            bases = {state.buffers.tensor(b.name).base_address for b in state.buffers.buffers}
            assert {t.data_ptr() for t in seen[0]} == bases, "the block tensors must start at the buffers' bases"
            assert all(t.shape[0] == COMMITTED for t in seen[0]), got
        finally:
            state.buffers.close()
    finally:
        set_kv_cache_layout(None)


class _Stream:  # torch.cuda.Stream on a machine without a GPU: SimpleCPUOffloadConnector makes two
    def __init__(self, *args, **kwargs):
        pass

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return 0, 0


def test_simple_cpu_offload_connector_derives_exactly_the_committed_blocks(monkeypatch):
    from vllm.v1.simple_kv_offload import worker as simple_worker

    set_kv_cache_layout("HND")
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(simple_worker, "PIN_MEMORY", False)  # pinning needs a GPU driver
    try:
        case = Case("FLASH_ATTN", False, cfg=_vllm_config("SimpleCPUOffloadConnector", {"cpu_bytes_to_use": 1 << 24}))

        def simple_cpu(config):
            conn = _worker_connector(case, config)
            monkeypatch.setattr(conn.worker_handler._backend, "init", lambda *a, **k: None)  # the copy kernels
            return conn

        config = case.config(RESERVED)
        conn = simple_cpu(config)
        state, _ = case.extensible(conn, config)
        try:
            connector.register(state)
            legacy = simple_cpu(case.config(COMMITTED))
            legacy.register_kv_caches(case.legacy(COMMITTED))
            got = {k: _signature(t) for k, t in conn.worker_handler.gpu_kv_caches.items()}
            want = {k: _signature(t) for k, t in legacy.worker_handler.gpu_kv_caches.items()}
            assert got == want, f"SimpleCPUOffloadConnector: expected its legacy block tensors {want}, got {got}"
            assert all(sig[0][0] == COMMITTED for sig in got.values()), got
        finally:
            state.buffers.close()
    finally:
        set_kv_cache_layout(None)


def test_the_v2_runners_connector_registers_only_at_the_final_commit(monkeypatch):
    # V2 builds its ActiveKVConnector right after allocating; its constructor registers with the transfer group.
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    case = Case("FLASH_ATTN", hybrid=True)
    config = case.config(RESERVED)
    calls: list[str] = []

    class Group(Recorder):
        def register_kv_caches(self, kv_caches):
            calls.append("register_kv_caches")
            super().register_kv_caches(kv_caches)

        def set_host_xfer_buffer_ops(self, copy_operation):
            calls.append("set_host_xfer_buffer_ops")

    group = Group(config)
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", group)
    state = worker_kv.start(Ledger(HostDriver(granularity=4096)))
    state.segments = worker_kv.derive_segments(config, lambda raw: case.reshape(config, raw))
    connector.defer(state, group)
    views = case.reshape(config, state.allocate(config))
    try:
        ActiveKVConnector(case.cfg, views)
        assert calls == [], f"V2's ActiveKVConnector reached the connector before the final commit: {calls}"
        state.ensure_blocks(COMMITTED, reason="final size")
        connector.register(state)
        assert calls == ["register_kv_caches", "set_host_xfer_buffer_ops"], calls
        _assert_legacy("V2 ActiveKVConnector (hybrid)", group.handed, case.legacy(COMMITTED), state)
    finally:
        state.buffers.close()
