"""Segment counts derived from vLLM 0.26.0's real attention backends and runner reshape code (runs on CPU).

Needs vllm==0.26.0 (the nox ``layouts`` session installs it; elsewhere these tests skip, and with
``EXTENSIBLE_KV_REQUIRE_VLLM=1`` a missing vllm fails instead).
"""

from __future__ import annotations

import math
import os
import sys
import textwrap

import pytest
import torch

from extensible_kv.backend_check import resolve_backend, validate_backend
from extensible_kv.errors import ExtensibleKVError
from extensible_kv.layout import AttentionLayer, MambaLayer, attention_layer, block_dim, buffer_segments, segments_of

if os.environ.get("EXTENSIBLE_KV_REQUIRE_VLLM") == "1":
    import vllm  # a missing vllm must fail here
vllm = pytest.importorskip("vllm")

from vllm.v1.attention.backends.utils import set_kv_cache_layout  # noqa: E402

HEADS, HEAD, BLOCK = 4, 64, 16

# Segments per backend, for both VLLM_KV_CACHE_LAYOUT values: one per physical index outside the block dim.
EXPECTED_SEGMENTS = {
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
# These import only where their CUDA kernels load (module-level CUDA allocations / extensions).
NEEDS_CUDA_TO_IMPORT = {"CUTLASS_MLA", "FLASH_ATTN_MLA"}
MLA = {name for name in EXPECTED_SEGMENTS if name.endswith("MLA")}


def _backend(name: str) -> type:
    try:
        return resolve_backend(name)
    except ExtensibleKVError as exc:
        if name in NEEDS_CUDA_TO_IMPORT and not torch.cuda.is_available():
            pytest.skip(f"{name} imports only with a CUDA device: {exc}")
        if "No module named 'flashinfer'" in str(exc):
            pytest.skip(f"{name} needs the flashinfer package, which is not installed here: {exc}")
        raise


def _layer(name: str, backend: type, block_major: bool = False) -> AttentionLayer:
    head = 576 if name in MLA else HEAD
    heads = 1 if name in MLA else HEADS
    return attention_layer(
        name,
        backend,
        block_size=BLOCK,
        num_kv_heads=heads,
        head_size=head,
        dtype=torch.bfloat16,
        block_major=block_major,
    )


@pytest.fixture(params=["NHD", "HND"])
def kv_layout(request):
    set_kv_cache_layout(request.param)
    yield request.param
    set_kv_cache_layout(None)


@pytest.mark.parametrize("name", EXPECTED_SEGMENTS, ids=list(EXPECTED_SEGMENTS))
def test_backend_layout_gives_the_expected_segment_count(name, kv_layout):
    layer = _layer(name, _backend(name))
    got = buffer_segments([layer], layer.page_size_bytes(), 257).count
    assert got == EXPECTED_SEGMENTS[name], (
        f"backend {name} ({kv_layout}): segments expected {EXPECTED_SEGMENTS[name]}, got {got} (shape "
        f"{layer.shape_of(257)}, stride order {layer.stride_order})"
    )


def _vllm_views(backend_name: str, hybrid: bool, num_blocks: int = 9):
    """Run vLLM 0.26.0's own V2 allocation and reshape on CPU; return (kv_cache_config, raw, views, mamba spec,
    backend class, attention groups)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, MambaAttentionBackendEnum
    from vllm.v1.core.kv_cache_utils import create_kv_cache_group_specs, get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
    from vllm.v1.worker.gpu import attn_utils
    from vllm.v1.worker.utils import AttentionGroup

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    mamba = MambaSpec(
        block_size=BLOCK,
        shapes=((3, 256), (4, 16, 16)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=attn.page_size_bytes,
    )
    with set_current_vllm_config(cfg):
        backend = AttentionBackendEnum[backend_name].get_class()
        specs = {"l0.attn": attn, "l2.attn": attn}
        grouped = [["l0.attn", "l2.attn"]]
        if hybrid:
            specs.update({"l1.mamba": mamba, "l3.mamba": mamba})
            grouped.append(["l1.mamba", "l3.mamba"])
        groups = create_kv_cache_group_specs(specs, grouped)
        config = get_kv_cache_config_from_groups(
            cfg, groups, available_memory=len(grouped) * num_blocks * attn.page_size_bytes * 2
        )
        raw = attn_utils._allocate_kv_cache(config, {}, torch.device("cpu"))
        attn_groups = [AttentionGroup(backend, grouped[0], groups[0].kv_cache_spec, 0)]
        if hybrid:
            attn_groups.append(
                AttentionGroup(MambaAttentionBackendEnum.MAMBA2.get_class(), grouped[1], groups[1].kv_cache_spec, 1)
            )
        views = attn_utils._reshape_kv_cache(attn_groups, raw, "auto", [BLOCK] * len(grouped), {}, config)
    return config, raw, views, mamba, backend, attn_groups


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid_mamba"])
@pytest.mark.parametrize("backend_name", ["FLASH_ATTN", "TRITON_ATTN", "ROCM_ATTN"])
def test_our_views_and_segments_match_vllms_own_reshape(backend_name, hybrid, kv_layout):
    config, raw, views, mamba, backend, _ = _vllm_views(backend_name, hybrid)
    n = config.num_blocks
    want = 2 if backend_name == "ROCM_ATTN" and not hybrid else 1
    for tensor in config.kv_cache_tensors:
        page = tensor.size // n
        ours_layers = []
        for layer_name in tensor.shared_by:
            if layer_name.endswith("attn"):
                ours_layers.append(_layer(layer_name, backend, block_major=hybrid))
            else:
                ours_layers.append(MambaLayer(layer_name, mamba.shapes, mamba.dtypes, mamba.page_size_padded))
        meta = torch.empty(tensor.size, dtype=torch.int8, device="meta")
        ours_segments = buffer_segments(ours_layers, page, n)
        assert ours_segments.count == want, (
            f"{backend_name} hybrid={hybrid} buffer {tensor.shared_by}: expected {want} segment(s), got "
            f"{ours_segments.count}"
        )
        for ours in ours_layers:
            theirs = views[ours.name] if isinstance(views[ours.name], list) else [views[ours.name]]
            mine = ours.views(meta, n)
            for k, (a, b) in enumerate(zip(mine, theirs)):
                offset = b.data_ptr() - raw[ours.name].data_ptr()
                assert (tuple(a.shape), a.stride(), a.storage_offset() * a.element_size()) == (
                    tuple(b.shape),
                    b.stride(),
                    offset,
                ), (
                    f"{backend_name} ({kv_layout}, hybrid={hybrid}) layer {ours.name} view {k}: expected vLLM's "
                    f"(shape, stride, byte offset) {(tuple(b.shape), b.stride(), offset)}, got "
                    f"{(tuple(a.shape), a.stride(), a.storage_offset() * a.element_size())}"
                )
                dim = ours.block_dims()[k]
                theirs_segments = segments_of(b, dim, tensor.size)
                assert ours_segments == theirs_segments, (
                    f"{backend_name} ({kv_layout}, hybrid={hybrid}) buffer {tensor.shared_by}: segments from vLLM's "
                    f"view {theirs_segments}, ours {ours_segments}"
                )


def test_mamba2_state_layout_is_one_block_major_segment():
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        shapes = MambaStateShapeCalculator.mamba2_state_shape(
            tp_world_size=1, intermediate_size=512, n_groups=1, num_heads=8, head_dim=64, state_size=16, conv_kernel=4
        )
        dtypes = MambaStateDtypeCalculator.mamba2_state_dtype(torch.bfloat16, "auto", "auto")
    layer = MambaLayer("m", tuple(tuple(s) for s in shapes), tuple(dtypes))
    page = layer.page_size_bytes()
    assert page == sum(math.prod(s) * torch.empty(0, dtype=d).element_size() for s, d in zip(shapes, dtypes))
    got = buffer_segments([layer], page, 100)
    assert got.count == 1, f"Mamba2 state {shapes} {dtypes}: expected 1 segment, got {got}"


@pytest.mark.parametrize("name", ["FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "ROCM_ATTN", "TRITON_MLA"])
def test_validate_backend_passes_real_backends(name, kv_layout):
    backend = _backend(name)
    head, heads = (576, 1) if name in MLA else (HEAD, HEADS)
    report = validate_backend(backend, driver="host", kv_layout=kv_layout, num_kv_heads=heads, head_size=head)
    assert report.ok, "\n".join([f"validate-backend {name} ({kv_layout}) on host: expected PASS"] + report.lines())


def test_validate_backend_cli_fails_a_backend_whose_shape_does_not_match_its_stride_order(tmp_path):
    import subprocess

    (tmp_path / "synthetic_backends.py").write_text(
        textwrap.dedent("""
        class ShapeOrderMismatch:
            @staticmethod
            def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
                return (num_blocks, num_kv_heads, block_size, 2 * head_size)

            @staticmethod
            def get_kv_cache_stride_order(include_num_layers_dimension=False):
                return (1, 0, 2, 3, 4)
    """)
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tmp_path), os.path.join(root, "reference"), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "extensible_kv",
            "validate-backend",
            "synthetic_backends:ShapeOrderMismatch",
            "FLASH_ATTN",
            "--driver",
            "host",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, (
        f"validate-backend on a mismatched backend: expected exit 1, got {proc.returncode}\n{out}"
    )
    assert "stride order (1, 0, 2, 3, 4) does not match its declared 4-d shape" in out, out
    assert "1 of 2 passed; failed: synthetic_backends:ShapeOrderMismatch" in out, out


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid_mamba"])
@pytest.mark.parametrize("backend_name", ["FLASH_ATTN", "TRITON_ATTN", "ROCM_ATTN"])
def test_meta_dry_run_of_vllms_v2_reshape_gives_the_segments(backend_name, hybrid, kv_layout):
    # What the V2 patch does before allocating: run vLLM's own reshape on meta tensors, read the segments off it.
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.worker.gpu import attn_utils

    from extensible_kv.vllm.worker_kv import derive_segments

    config, raw, views, mamba, backend, attn_groups = _vllm_views(backend_name, hybrid)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        got = derive_segments(
            config,
            lambda meta: attn_utils._reshape_kv_cache(
                attn_groups=attn_groups,
                kv_cache_raw_tensors=meta,
                kernel_block_sizes=[BLOCK] * len(attn_groups),
                cache_dtype="auto",
                shared_kv_cache_layers={},
                kv_cache_config=config,
            ),
        )
    want = [2 if backend_name == "ROCM_ATTN" and not hybrid else 1] * len(config.kv_cache_tensors)
    assert got == want, (
        f"{backend_name} ({kv_layout}, hybrid={hybrid}): segments per KV tensor expected {want}, got {got}"
    )


@pytest.mark.parametrize("backend_name", ["FLASH_ATTN", "TRITON_ATTN"])
def test_two_kv_cache_groups_sharing_buffers_commit_in_lockstep(backend_name, kv_layout):
    # Interleaved sliding-window and full attention (integration/models/tiny-llama-swa): vLLM's hybrid KV cache
    # manager makes two KV cache groups, and every KVCacheTensor is shared by one layer of each. The patch derives one
    # segmentation per tensor from both layers' views, and a block committed in a tensor is committed for both.
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from vllm.v1.worker.gpu import attn_utils
    from vllm.v1.worker.utils import AttentionGroup

    from extensible_kv.drivers import Ledger
    from extensible_kv.drivers.host import HostDriver
    from extensible_kv.vllm import worker_kv

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False  # as on CUDA, where vLLM enables it
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    window = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16, sliding_window=32
    )
    specs = {"l0.attn": window, "l1.attn": full, "l2.attn": window, "l3.attn": full}
    with set_current_vllm_config(cfg):
        backend = AttentionBackendEnum[backend_name].get_class()
        groups = get_kv_cache_groups(cfg, specs)
        assert sorted(sorted(g.layer_names) for g in groups) == [["l0.attn", "l2.attn"], ["l1.attn", "l3.attn"]], (
            f"expected two KV cache groups (sliding, full), got {[g.layer_names for g in groups]}"
        )
        # 300 blocks: the block dimension is the views' largest, as block_dim() (and every real cache) has it.
        config = get_kv_cache_config_from_groups(cfg, groups, available_memory=2 * 300 * full.page_size_bytes)
        assert [len(t.shared_by) for t in config.kv_cache_tensors] == [2, 2], config.kv_cache_tensors
        attn_groups = [AttentionGroup(backend, g.layer_names, g.kv_cache_spec, i) for i, g in enumerate(groups)]

        def reshape(raw):
            return attn_utils._reshape_kv_cache(
                attn_groups=attn_groups,
                kv_cache_raw_tensors=raw,
                kernel_block_sizes=[BLOCK, BLOCK],
                cache_dtype="auto",
                shared_kv_cache_layers={},
                kv_cache_config=config,
            )

        state = worker_kv.start(Ledger(HostDriver(granularity=4096)))
        state.segments = worker_kv.derive_segments(config, reshape)
        assert state.segments == [1, 1], f"{backend_name} ({kv_layout}): segments {state.segments}"
        raw = state.allocate(config)
        try:
            views = reshape(raw)
            for tensor in config.kv_cache_tensors:
                a, b = (views[name] for name in tensor.shared_by)
                assert a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride(), (
                    f"layers {tensor.shared_by} of one KVCacheTensor must view the same bytes the same way"
                )
            state.ensure_blocks(5, reason="test")
            for name, view in views.items():  # every layer of either group writes its committed blocks
                assert block_dim(view.shape, name, num_blocks=config.num_blocks) == 0, (name, tuple(view.shape))
                view.narrow(0, 0, 5).fill_(1.0)
            assert state.buffers.num_blocks == 5 and state.buffers.max_num_blocks == config.num_blocks == 300
        finally:
            state.buffers.close()
