"""The vLLM patch's logic that needs no GPU and no vLLM: sizing arithmetic, gating, the V2 warmup prefix, the
segment derivation, and switching on by environment."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from extensible_kv.drivers import Ledger
from extensible_kv.drivers.host import HostDriver
from extensible_kv.layout import LayoutError, attention_view
from extensible_kv.vllm import ExtensibleKVUnsupported, env_enabled, patches, probes, worker_kv
from extensible_kv.vllm.sizing import MemoryState, reusable_cache, served_step_bound

GIB = 1 << 30


def _state(**overrides) -> MemoryState:
    values = dict(
        init_free=100 * GIB,
        requested=90 * GIB,
        free_now=60 * GIB,
        kv_backed=2 * GIB,
        weights=16 * GIB,
        profiled_peak=3 * GIB,
        again_reserved=5 * GIB,
        again_retained=1 * GIB,
        served_reserved=2 * GIB,
        served_retained=0,
        bytes_per_block=1 << 20,
        rounding_bound=4 << 20,
        capacity_blocks=80_000,
        committed_blocks=10,
    )
    values.update(overrides)
    return MemoryState(**values)


def test_sizing_commits_what_the_measured_budget_fits():
    s = _state()
    # non-KV = 100 - 60 - 2 = 38 GiB; the batch run again reserved 5 GiB and torch still holds 1 GiB of it (already
    # in non-KV), so it may take 4 GiB again; the served run gave back 2 GiB, less; budget = 90 - 38 - 4 = 48 GiB.
    # vLLM's profiled peak plays no part.
    assert (s.non_kv, s.torch_growth, s.budget) == (38 * GIB, 4 * GIB, 48 * GIB), s.to_dict()
    assert s.blocks() == (48 * GIB - (4 << 20)) // (1 << 20), s.to_dict()


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (dict(capacity_blocks=1000), 1000),  # never above the reservation
        (dict(free_now=1 * GIB, committed_blocks=77), 77),  # never below what is committed (grow-only)
        (dict(again_retained=6 * GIB, served_reserved=0), (52 * GIB - (4 << 20)) // (1 << 20)),  # no negative growth
        (
            dict(served_reserved=7 * GIB, served_retained=1 * GIB),
            (46 * GIB - (4 << 20)) // (1 << 20),
        ),  # served took more
        (dict(profiled_peak=40 * GIB), (48 * GIB - (4 << 20)) // (1 << 20)),  # vLLM's estimate is not used
        (dict(margin=GIB), (47 * GIB - (4 << 20)) // (1 << 20)),
    ],
)
def test_sizing_clamps(overrides, expected):
    s = _state(**overrides)
    assert s.blocks() == expected, f"MemoryState({overrides}).blocks(): expected {expected}, got {s.blocks()}"


def _segment(pool, total, active, device=0):
    return {"device": device, "segment_pool_id": pool, "total_size": total, "active_size": active}


def test_reusable_cache_counts_only_unused_default_pool_memory_of_this_device():
    # A captured graph's private pool and live tensors are reserved by torch but cannot serve eager activations;
    # another device's cache is not this worker's.
    segments = [
        _segment((0, 0), 64 << 20, 16 << 20),  # default pool: 48 MiB unused
        _segment((0, 0), 20 << 20, 20 << 20),  # default pool, fully in use (persistent buffers)
        _segment((0, 1), 230 << 20, 0),  # graph private pool, all "inactive" after capture
        _segment((0, 0), 512 << 20, 0, device=1),
    ]  # another GPU
    got = reusable_cache(segments, device=0)
    assert got == 48 << 20, f"reusable_cache: expected {48 << 20} bytes (default pool, unused, device 0), got {got}"


_PLATFORM_CUDA = SimpleNamespace(is_cuda_alike=lambda: True, device_name="cuda")


@pytest.mark.parametrize(
    "config,platform,needle",
    [
        (
            SimpleNamespace(
                kv_transfer_config=SimpleNamespace(kv_connector="OffloadingConnector"),
                model_config=SimpleNamespace(enable_sleep_mode=True),
            ),
            _PLATFORM_CUDA,
            r"KV connector OffloadingConnector with sleep mode \(enable_sleep_mode\)",
        ),
        (
            SimpleNamespace(kv_transfer_config=None, model_config=None),
            SimpleNamespace(is_cuda_alike=lambda: False, device_name="xpu"),
            "neither CUDA nor ROCm",
        ),
    ],
)
def test_unsupported_configurations_are_refused_with_the_reason(config, platform, needle):
    with pytest.raises(ExtensibleKVUnsupported, match=needle):
        patches.check_supported(config, platform)


@pytest.mark.parametrize(
    "connector,sleep",
    [(None, False), (None, True), ("OffloadingConnector", False)],
    ids=["plain", "sleep mode", "a connector"],
)
def test_supported_configuration_passes(connector, sleep):
    ktc = SimpleNamespace(kv_connector=connector) if connector else None
    patches.check_supported(
        SimpleNamespace(kv_transfer_config=ktc, model_config=SimpleNamespace(enable_sleep_mode=sleep)), _PLATFORM_CUDA
    )


def _output(new=(), cached=()):
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(block_ids=b) for b in new],
        scheduled_cached_reqs=SimpleNamespace(new_block_ids=list(cached)),
    )


@pytest.mark.parametrize(
    "output,expected",
    [
        (_output(), -1),
        (_output(new=[([1, 2, 3],), ([4, 5],)]), 5),
        (_output(new=[([1], [9, 2])], cached=[None, ([], [12])]), 12),
        (_output(cached=[([7, 30],)]), 30),
    ],
)
def test_max_block_id_reads_new_and_cached_requests(output, expected):
    assert patches.max_block_id(output) == expected


def _kv_config(num_blocks: int, page: int, tensors: int = 2):
    return SimpleNamespace(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            SimpleNamespace(size=num_blocks * page, shared_by=[f"layer{i}"], block_stride=0) for i in range(tensors)
        ],
    )


def _kv_first_reshape(raw: dict) -> dict:
    # A K/V-first layout (2, B, N, H, D) in bf16, as ROCM_ATTN builds it: 2 segments.
    out = {}
    for name, t in raw.items():
        blocks = t.numel() // (2 * 16 * 2 * 64 * 2)
        out[name] = attention_view(t, (2, blocks, 16, 2, 64), (0, 1, 2, 3, 4), torch.bfloat16)
    return out


def test_derive_segments_reads_the_runners_own_views():
    assert worker_kv.derive_segments(_kv_config(100, 8192), _kv_first_reshape) == [2, 2]


def _disagreeing_reshape(raw: dict) -> dict:
    # layer0: K/V-first (2 segments); layer1 and the Mamba-like list of layer2: block-major (1) and K/V-first (2).
    out = {}
    for name, t in raw.items():
        kv_first = _kv_first_reshape({name: t})[name]
        block_major = attention_view(t, kv_first.shape, (1, 0, 2, 3, 4), torch.bfloat16)
        out[name] = {
            "layer0": kv_first,
            "layer1": block_major,
            "layer2": [block_major.transpose(0, 1), kv_first.transpose(0, 1)],
        }[name]
    return out


@pytest.mark.parametrize("shared_by", [["layer0", "layer1"], ["layer2"]], ids=["two-layers", "one-layer-states"])
def test_derive_segments_refuses_views_of_one_tensor_that_disagree(shared_by):
    config = SimpleNamespace(
        num_blocks=100, kv_cache_tensors=[SimpleNamespace(size=100 * 8192, shared_by=shared_by, block_stride=0)]
    )
    with pytest.raises(LayoutError, match="disagree on segments"):
        segments = worker_kv.derive_segments(config, _disagreeing_reshape)
        pytest.fail(f"derive_segments over {shared_by}: expected LayoutError, got segments {segments}")


def test_packed_layouts_are_refused():
    config = _kv_config(100, 8192)
    config.kv_cache_tensors[0].block_stride = 8192
    with pytest.raises(ExtensibleKVUnsupported, match="packed"):
        worker_kv.derive_segments(config, _kv_first_reshape)


def test_v2_warmup_commits_exactly_the_block_ids_each_step_uses():
    ledger = Ledger(HostDriver(granularity=4096))
    state = worker_kv.start(ledger)
    config = _kv_config(200, 8192)
    state.segments = worker_kv.derive_segments(config, _kv_first_reshape)
    raw = state.allocate(config)
    assert state.buffers.num_blocks == 1 and set(raw) == {"layer0", "layer1"}
    seen = []

    def original(runner, execute, sample):
        for out in (_output(new=[([1, 2],), ([3, 4],)]), _output(cached=[([5],), ([6],)])):
            execute(out)
            seen.append(state.buffers.num_blocks)

    patches._warmup_kernels(original)(None, lambda out: None, None)
    assert seen == [5, 7], f"blocks committed before each warmup step: expected [5, 7], got {seen}"
    state.buffers.close()
    assert not ledger.outstanding(), ledger.outstanding()


@pytest.mark.parametrize("value,expected", [("1", True), ("0", False), (None, False)])
def test_env_switch(value, expected):
    env = {} if value is None else {"EXTENSIBLE_KV_CACHE": value}
    assert env_enabled(env) is expected


@pytest.mark.parametrize("value", ["yes", " 1", "1 ", "", "01", "true"])
def test_env_switch_refuses_other_values(value):
    with pytest.raises(ExtensibleKVUnsupported, match="must be 0 or 1"):
        env_enabled({"EXTENSIBLE_KV_CACHE": value})


def test_margin_from_environment_must_be_a_non_negative_integer(monkeypatch):
    monkeypatch.setenv(patches.MARGIN_ENV, "-5")
    with pytest.raises(ExtensibleKVUnsupported, match=">= 0"):
        patches._margin()
    monkeypatch.setenv(patches.MARGIN_ENV, "lots")
    with pytest.raises(ExtensibleKVUnsupported, match="integer"):
        patches._margin()
    monkeypatch.setenv(patches.MARGIN_ENV, "1024")
    assert patches._margin() == 1024


def test_measure_reads_free_memory_the_kv_mapping_and_the_batch_run_again(monkeypatch):
    # The worker-side wiring of the sizing: every MemoryState field comes from the named source, on this device.
    kv = worker_kv.start(Ledger(HostDriver(granularity=4096)))
    kv.segments = [1, 2]
    config = SimpleNamespace(
        num_blocks=100,
        kv_cache_tensors=[
            SimpleNamespace(size=100 * 8192, shared_by=["layer0"]),
            SimpleNamespace(size=100 * 16384, shared_by=["layer1"]),
        ],
    )
    kv.allocate(config)
    kv.ensure_blocks(3, reason="warmup")
    mib = 1 << 20
    segments = [
        _segment((0, 0), 40 * mib, 10 * mib, device=1),
        _segment((7, 0), 200 * mib, 0, device=1),
        _segment((0, 0), 90 * mib, 0),
    ]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (5 * GIB, 8 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda *a, **k: segments)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    worker = SimpleNamespace(
        init_snapshot=SimpleNamespace(free_memory=7 * GIB),
        requested_memory=6 * GIB,
        model_runner=SimpleNamespace(model_memory_usage=1 * GIB),
        peak_activation_memory=512 * mib,
    )
    try:
        s = kv.measure(
            worker,
            again={"peak_reserved": 300 * mib, "retained": 120 * mib},
            served={
                "peak_reserved": 70 * mib,
                "retained": 30 * mib,
                "peak_allocated": 65 * mib,
                "cache_after": 80 * mib,
            },
            margin=mib,
        )
        stats = kv.buffers.stats()
        got = (
            s.init_free,
            s.requested,
            s.free_now,
            s.kv_backed,
            s.weights,
            s.profiled_peak,
            s.again_reserved,
            s.again_retained,
            s.served_reserved,
            s.served_retained,
            s.bytes_per_block,
            s.rounding_bound,
            s.capacity_blocks,
            s.committed_blocks,
            s.margin,
            s.served_allocated,
            s.cache_after,
        )
        expected = (
            7 * GIB,
            6 * GIB,
            5 * GIB,
            stats.backed_bytes,
            1 * GIB,
            512 * mib,
            300 * mib,
            120 * mib,
            70 * mib,
            30 * mib,
            8192 + 16384,
            (1 + 2) * 4096,
            stats.max_num_blocks,
            3,
            mib,
            65 * mib,
            80 * mib,
        )
        assert got == expected, f"WorkerKV.measure on host: expected {expected}, got {got}"
    finally:
        kv.buffers.close()


# -- the worker's driver ---------------------------------------------------------------------------------------------
class _RecordingDriver:
    def __init__(self, ordinal: int = 0) -> None:
        self.ordinal = ordinal


class _UnavailableDriver:
    def __init__(self, ordinal: int = 0) -> None:
        from extensible_kv.errors import DriverUnavailable

        raise DriverUnavailable(f"no usable device {ordinal}")


def _worker_platform(monkeypatch, *, rocm: bool, cuda_driver: type, hip_driver: type, device: int) -> None:
    import sys

    from extensible_kv.drivers import cuda, hip

    platform = SimpleNamespace(is_rocm=lambda: rocm)
    monkeypatch.setitem(sys.modules, "vllm.platforms", SimpleNamespace(current_platform=platform))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device)
    monkeypatch.setattr(cuda, "CudaDriver", cuda_driver)
    monkeypatch.setattr(hip, "HipDriver", hip_driver)


@pytest.mark.parametrize("rocm", [False, True], ids=["cuda", "rocm"])
def test_worker_driver_is_built_on_the_workers_own_device(monkeypatch, rocm):
    class Cuda(_RecordingDriver):
        pass

    class Hip(_RecordingDriver):
        pass

    _worker_platform(monkeypatch, rocm=rocm, cuda_driver=Cuda, hip_driver=Hip, device=3)
    got = patches._platform_driver()
    want = Hip if rocm else Cuda
    assert type(got) is want and got.ordinal == 3, (
        f"worker driver (rocm={rocm}): expected {want.__name__} on device 3, got {type(got).__name__} on "
        f"{getattr(got, 'ordinal', None)}"
    )


def test_worker_driver_that_cannot_run_is_unsupported_naming_the_driver_and_the_reason(monkeypatch):
    _worker_platform(monkeypatch, rocm=False, cuda_driver=_UnavailableDriver, hip_driver=_RecordingDriver, device=3)
    with pytest.raises(
        ExtensibleKVUnsupported,
        match=r"the cuda driver cannot run in this worker: "
        r"no usable device 3",
    ):
        patches._platform_driver()


# -- an engine keeps its RPCs (Note [An engine keeps its RPCs] in patches.py) -----------------------------------------
def _fake_vllm(monkeypatch) -> SimpleNamespace:
    """Stand-ins for the vLLM modules the patch set touches, each attribute the real one's name."""
    import sys
    import types

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    class Worker:
        def __init__(self):
            self.model_runner = SimpleNamespace(
                profile_run=lambda: None,
                model_memory_usage=1 << 20,
                max_num_tokens=8192,
                is_pooling_model=False,
                max_model_len=2048,
                scheduler_config=SimpleNamespace(max_num_seqs=8),
                vllm_config=SimpleNamespace(  # what probes.limits_of reads
                    scheduler_config=SimpleNamespace(
                        max_num_batched_tokens=8192, max_num_seqs=8, enable_chunked_prefill=True
                    ),
                    cache_config=SimpleNamespace(block_size=16, enable_prefix_caching=True),
                    model_config=SimpleNamespace(use_mla=False, enable_sleep_mode=False, get_vocab_size=lambda: 1024),
                    speculative_config=None,
                    attention_config=SimpleNamespace(backend="FLASH_ATTN"),
                ),
                input_batch=SimpleNamespace(block_table=SimpleNamespace(clear=lambda: None)),
                _dummy_run=lambda num_tokens, **kwargs: (None, None),
                _build_attention_metadata=lambda **kwargs: ({}, None),
                _dummy_sampler_run=lambda hidden_states: None,
            )
            self.cache_config = SimpleNamespace(kv_cache_memory_bytes=None, num_gpu_blocks=None)
            self.init_snapshot = SimpleNamespace(free_memory=8 * GIB)
            self.requested_memory = 6 * GIB
            self.peak_activation_memory = 0

        def determine_available_memory(self):
            self.model_runner.profile_run()
            self.cudagraph_memory_estimate = 0
            return 4 * GIB

    class WorkerWrapper:  # vllm.v1.worker.worker_base.WorkerWrapperBase: attributes fall through to the worker
        def __init__(self, worker):
            self.worker = worker

        def __getattr__(self, attr):
            return getattr(self.worker, attr)

    class EngineCore:
        def _initialize_kv_caches(self, vllm_config):
            return None

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            return None

    class GPUModelRunner:
        def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes):
            return None

        def _allocate_kv_cache_tensors(self, kv_cache_config):
            return None

    pp = SimpleNamespace(is_last_rank=True)
    module("vllm", envs=SimpleNamespace(VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=True))
    module("vllm.config", CUDAGraphMode=SimpleNamespace(NONE="CUDAGraphMode.NONE", FULL="CUDAGraphMode.FULL"))
    module("vllm.distributed", get_pp_group=lambda: pp)
    module("vllm.v1.engine.core", EngineCore=EngineCore)
    module("vllm.v1.worker.gpu_worker", Worker=Worker, warmup_kernels=lambda *a: None)
    module("vllm.v1.worker.gpu_model_runner", GPUModelRunner=GPUModelRunner)
    module("vllm.v1.worker.gpu.model_runner", init_kv_cache=lambda *a: None)
    module("vllm.v1.worker.gpu.attn_utils", _allocate_kv_cache=lambda *a: None)
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    for name, value in (
        ("memory_reserved", 0),
        ("memory_allocated", 0),
        ("max_memory_reserved", 0),
        ("max_memory_allocated", 0),
    ):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _v=value, **k: _v)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda *a, **k: [])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fractions: list = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: fractions.append((f, d)))
    monkeypatch.setattr(worker_kv, "_allocator_settings", fractions.append)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)  # the worker sets it; undone after the test
    return SimpleNamespace(Worker=Worker, WorkerWrapper=WorkerWrapper, pp=pp, fractions=fractions)


def _rpc(wrapper: object, method: str, *args):
    """What vLLM's ``collective_rpc`` does with a method name (``vllm.v1.serial_utils.run_method``)."""
    try:
        func = getattr(wrapper, method)
    except AttributeError:
        raise NotImplementedError(f"Method {method!r} is not implemented.") from None
    return func(*args)


def test_an_engine_built_inside_the_block_keeps_its_rpcs_after_the_patches_are_removed(monkeypatch):
    fake = _fake_vllm(monkeypatch)
    patches.install()
    try:
        worker = fake.Worker()
        wrapper = fake.WorkerWrapper(worker)
        worker.determine_available_memory()  # the patched method, as the engine calls it while building
        state = worker_kv.start(Ledger(HostDriver(granularity=4096)))
        config = _kv_config(50, 8192)
        state.segments = [1, 1]
        state.allocate(config)
        worker.model_runner.kv_cache_config = SimpleNamespace(num_blocks=50)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (7 * GIB, 8 * GIB))
        monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda *a, **k: [])
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        fits = _rpc(wrapper, "extensible_kv_measure")
        _rpc(wrapper, "extensible_kv_commit", min(fits, 20))
    finally:
        patches.uninstall()
    assert not hasattr(fake.Worker, "extensible_kv_report"), "uninstall left the RPC on the class"
    try:
        worker_kv.start(Ledger(HostDriver(granularity=4096)))  # a later engine in the same process
        report = _rpc(wrapper, "extensible_kv_report")
        assert report["kv"] and report["kv"]["num_blocks"] == 20, (
            f"the report after the block exited: expected this engine's 20 committed blocks, got {report['kv']}"
        )
        assert report["profile"]["peak_reserved"] == 0 and report["measured"]["blocks"] == fits, report
        # the commit capped torch's cache (Note [Torch's cache, held to the budget]) once, on this device
        assert fake.fractions == ["expandable_segments:True"], fake.fractions
        assert report["torch_cap"]["cap"] > 0, report
    finally:
        state.buffers.close()


def test_a_worker_built_without_the_patches_has_no_extensible_rpcs(monkeypatch):
    fake = _fake_vllm(monkeypatch)
    worker = fake.Worker()
    worker.determine_available_memory()
    with pytest.raises(NotImplementedError, match="'extensible_kv_report' is not implemented"):
        _rpc(fake.WorkerWrapper(worker), "extensible_kv_report")


def test_profile_run_records_the_reserved_and_allocated_activation_peak(monkeypatch):
    stats = {"reserved": 100, "allocated": 60}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: stats["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: stats["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a, **k: 100 + 44 * GIB // 10)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 60 + 4 * GIB)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    snapshot = [{"device": 0, "segment_pool_id": (0, 0), "total_size": 64 << 20, "active_size": 16 << 20}]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snapshot)

    def profile_run():
        stats["reserved"] = 100 + GIB  # torch keeps 1 GiB of the 4.4 GiB it reserved, 40 MiB of it unused
        snapshot.append({"device": 0, "segment_pool_id": (0, 0), "total_size": GIB, "active_size": GIB - (40 << 20)})
        return "ran"

    run = probes.profile_run_reserved_peak(profile_run)
    assert run() == "ran"
    expected = {
        "peak_reserved": 44 * GIB // 10,
        "peak_allocated": 4 * GIB,
        "retained": GIB,
        "cache_before": 48 << 20,
        "cache_after": 88 << 20,
    }
    assert run.figures == expected, f"profile_run figures: expected {expected}, got {run.figures}"


class _DummyRunner:
    """The two methods of a vLLM model runner that ``probes.served_batch`` calls, recording their arguments."""

    def __init__(self, max_num_tokens=16384, is_pooling_model=False, on_run=None, max_num_seqs=8, max_model_len=4096):
        self.max_num_tokens, self.is_pooling_model, self.on_run = max_num_tokens, is_pooling_model, on_run
        self.scheduler_config, self.max_model_len = SimpleNamespace(max_num_seqs=max_num_seqs), max_model_len
        self.calls = []

    def _dummy_run(self, num_tokens, **kwargs):
        self.calls.append(("_dummy_run", num_tokens, kwargs))
        if kwargs.get("force_attention"):  # V1's dummy: the whole batch as the longest query
            self._build_attention_metadata(num_tokens=num_tokens, num_reqs=1, max_query_len=num_tokens)
        if self.on_run is not None:
            self.on_run()
        return "hidden", "last hidden"

    def _build_attention_metadata(self, num_tokens, num_reqs, max_query_len, **kwargs):
        self.calls.append(("attention max_query_len", max_query_len))
        return {}, None

    def _dummy_sampler_run(self, hidden_states):
        self.calls.append(("_dummy_sampler_run", hidden_states))


class _V2DummyRunner(_DummyRunner):
    __module__ = "vllm.v1.worker.gpu.model_runner"  # what worker_kv.runner_kind reads

    def __init__(self, is_last_pp_rank=True, pooling_runner=None, **kwargs):
        super().__init__(**kwargs)
        self.is_last_pp_rank, self.pooling_runner = is_last_pp_rank, pooling_runner


def _v1_call(tokens, seq_len):
    """V1's dummy run as served: each request's own sequence and query length (Note [A served batch's query
    length])."""
    return (
        "_dummy_run",
        tokens,
        {
            "cudagraph_runtime_mode": "CUDAGraphMode.NONE",
            "force_attention": True,
            "skip_eplb": True,
            "profile_seq_lens": seq_len,
        },
    ), ("attention max_query_len", seq_len)


# runners are made in the test: one made at collection keeps the calls of any earlier run of the same item
@pytest.mark.parametrize(
    "make_runner,last_rank,expected",
    [
        # 16,384 tokens over 8 requests: 2,048 each, the sequence length of a served prefill of that shape
        (partial(_DummyRunner), True, [*_v1_call(16384, 2048), ("_dummy_sampler_run", "last hidden")]),
        (partial(_DummyRunner, is_pooling_model=True), True, [*_v1_call(16384, 2048)]),
        # the last request takes the remainder: 16,376 over 8 is 2,047 + 0, 2,045 over 3 is 681 + 2
        (
            partial(_DummyRunner, max_num_tokens=16376, max_model_len=2048),
            True,
            [*_v1_call(16376, 2047), ("_dummy_sampler_run", "last hidden")],
        ),
        (partial(_DummyRunner, max_num_tokens=2045, max_num_seqs=3), False, [*_v1_call(2045, 683)]),
        # never past a block-table row: a request's sequence is at most max_model_len tokens, and a batch of 2 such
        # requests at most 8,192 tokens, whatever max_num_batched_tokens allows
        (
            partial(_DummyRunner, max_num_tokens=16384, max_num_seqs=2, max_model_len=4096),
            False,
            [*_v1_call(8192, 4096)],
        ),
        # the remainder can still take the last request past max_model_len: capped
        (partial(_DummyRunner, max_num_tokens=79, max_num_seqs=8, max_model_len=10), False, [*_v1_call(79, 10)]),
        (
            partial(_V2DummyRunner),
            True,
            [("_dummy_run", 16384, {"skip_eplb": True}), ("_dummy_sampler_run", "last hidden")],
        ),
        (partial(_V2DummyRunner, is_last_pp_rank=False), True, [("_dummy_run", 16384, {"skip_eplb": True})]),
        (partial(_V2DummyRunner, pooling_runner=object()), True, [("_dummy_run", 16384, {"skip_eplb": True})]),
    ],
    ids=[
        "v1",
        "v1-pooling",
        "v1-remainder",
        "v1-not-last-pp-rank",
        "v1-capped-at-max-model-len",
        "v1-remainder-capped",
        "v2",
        "v2-not-last-pp-rank",
        "v2-pooling",
    ],
)
def test_served_batch_runs_the_profiled_batch_with_attention_then_the_sampler(
    monkeypatch, make_runner, last_rank, expected
):
    # V1 builds attention metadata only with force_attention (or a FULL graph), and runs eager with mode NONE; its
    # dummy requests get the batch's whole token count as sequence length unless profile_seq_lens says otherwise,
    # which would read past a block-table row. V2 skips attention only when asked to (skip_attn) and gives each
    # request its own query length. The sampler runs where vLLM's own profile_run runs it: on the last pipeline
    # rank of a generating model.
    fake = _fake_vllm(monkeypatch)
    fake.pp.is_last_rank = last_rank
    runner = make_runner()
    probes.served_batch(runner)()
    assert runner.calls == expected, (
        f"served_batch on {type(runner).__name__}: expected calls {expected}, got {runner.calls}"
    )
    assert "_build_attention_metadata" not in vars(runner), "served_batch left its metadata builder on the runner"


def test_the_served_query_length_is_undone_on_error_and_refused_where_vllm_passes_it_positionally(monkeypatch):
    _fake_vllm(monkeypatch)

    def fail():
        raise KeyboardInterrupt

    runner = _DummyRunner(on_run=fail)
    with pytest.raises(KeyboardInterrupt):
        probes.served_batch(runner)()
    assert "_build_attention_metadata" not in vars(runner), "an interrupted served batch left its builder behind"

    class Positional(_DummyRunner):
        def _dummy_run(self, num_tokens, **kwargs):
            return self._build_attention_metadata(num_tokens, 1, num_tokens)

    runner = Positional()
    own = runner._build_attention_metadata = lambda *a, **k: ({}, None)  # an instance's own builder is put back
    with pytest.raises(ExtensibleKVUnsupported, match="passes max_query_len to _build_attention_metadata positionally"):
        probes.served_batch(runner)()
    assert vars(runner)["_build_attention_metadata"] is own, "served_batch did not put the runner's own builder back"


def _limits_config(max_num_batched_tokens=16384, max_num_seqs=8, block_size=16, mla=False, spec=None):
    """The vLLM config a runner carries, as ``probes.limits_of`` reads it."""
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, enable_chunked_prefill=True
        ),
        cache_config=SimpleNamespace(block_size=block_size, enable_prefix_caching=True),
        model_config=SimpleNamespace(use_mla=mla, enable_sleep_mode=False, get_vocab_size=lambda: 1024),
        speculative_config=spec,
        attention_config=SimpleNamespace(backend="FLASH_ATTN"),
    )


@pytest.mark.parametrize(
    "takes,growth",
    [
        # the first batch reserves 300 MiB above the emptied cache and torch keeps 200 MiB of it: the 100 MiB it gave
        # back is the growth still to come
        ([(300, 200)], 100),
        # the first keeps its 100 MiB; the second reserves 48 MiB more and keeps 16: the sequence's peak is 148 MiB
        # above the emptied cache, 116 MiB kept, 32 MiB still to come (a batch's peak counts from where the
        # sequence began, not from where the batch began)
        ([(100, 100), (48, 16)], 32),
        # nothing given back: no growth, the kept segments are in free_now
        ([(64, 64), (0, 0), (32, 32)], 0),
    ],
    ids=["first-gives-back", "second-on-top-of-first", "all-kept"],
)
def test_measure_runs_the_worst_batches_from_an_emptied_cache_and_sizes_from_what_they_took(monkeypatch, takes, growth):
    # Note [The worst batch, brought back and measured], Note [From an emptied cache]; figures in MiB: (reserved at
    # the batch's peak above what torch held when it began, kept after it)
    mib = 1 << 20
    fake = _fake_vllm(monkeypatch)
    memory = {"reserved": 150 * mib, "max": 150 * mib, "order": []}
    pending = list(takes)

    def empty_cache():
        memory["order"].append("empty_cache")
        memory["reserved"] = memory["max"] = 100 * mib  # 50 MiB of cached segments handed back

    def run():
        memory["order"].append("batch")
        peak, keep = pending.pop(0) if pending else (0, 0)
        memory["max"] = max(memory["max"], memory["reserved"] + peak * mib)
        memory["reserved"] += keep * mib

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: memory.update(max=memory["reserved"]))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: memory["reserved"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a, **k: memory["max"])
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda *a, **k: (7 * GIB - (memory["reserved"] - 100 * mib), 8 * GIB)
    )
    patches.install()
    try:
        worker = fake.Worker()
        worker.determine_available_memory()
        runner = _DummyRunner(on_run=run)
        runner.vllm_config = _limits_config()
        runner.vllm_config.scheduler_config.async_scheduling = True  # vLLM 0.26.0's default
        runner.input_batch = SimpleNamespace(block_table=SimpleNamespace(clear=lambda: memory["order"].append("null")))
        runner.profile_run = lambda: memory["order"].append("profile_run")
        runner.model_memory_usage = 1 << 20
        runner.reset_mm_cache = lambda: memory["order"].append("reset")
        runner.kv_cache_config = SimpleNamespace(num_blocks=50)
        worker.model_runner = runner
        state = worker_kv.start(Ledger(HostDriver(granularity=4096)))
        state.segments = [1, 1]
        state.allocate(_kv_config(50, 8192))
        _rpc(fake.WorkerWrapper(worker), "extensible_kv_measure")
        m = state.measured
        names = [b["name"] for b in m.worst_batches]
        peak = max(
            sum(k for _, k in takes[:i]) + p for i, (p, _) in enumerate(takes)
        )  # the most held above the emptied cache
        kept = sum(k for _, k in takes)
        got = (memory["order"], names, m.served_reserved, m.served_retained, m.torch_growth, m.free_now)
        ladder = (3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536)  # 2 x 1.5, 4/3
        expected = (
            ["empty_cache", "null"] + ["reset", "batch"] * 43 + ["null"],
            ["prefill_fresh"]
            + [f"prefill_fresh_q{q}" for q in ladder]
            + ["prefill_over_context", "prefill_longest_context"]
            + [f"prefill_split_q{q}" for q in ladder]
            + ["decode_max_len", "mixed"],
            peak * mib,
            kept * mib,
            growth * mib,
            7 * GIB - kept * mib,
        )
        assert got == expected, (
            f"extensible_kv_measure (order, batches, worst reserved/retained, growth, free): expected {expected}, "
            f"got {got}"
        )
        assert "profile_run" not in memory["order"], "vLLM's profile batch ran again after warmup"
        # Note [What a served step adds after the worst batches]: two steps in flight under async scheduling
        assert m.served_step == served_step_bound(async_scheduling=True) == 16 * mib, m.served_step
        assert runner.scheduler_config.max_num_seqs == 8, "a worst batch left max_num_seqs changed"
    finally:
        patches.uninstall()
        state.buffers.close()


# -- the served batch's multimodal and speculative parts ------------------------------------------------------------
def _fake_mm_modules(monkeypatch, encoded: list) -> None:
    import sys
    import types

    def group_and_batch_mm_kwargs(items, device, pin_memory):
        modality = items[0][0]
        yield modality, len(items), {"pixel_values": [item for _, item in items], "device": device}

    utils = types.ModuleType("vllm.multimodal.utils")
    utils.group_and_batch_mm_kwargs = group_and_batch_mm_kwargs
    budget_module = types.ModuleType("vllm.multimodal.encoder_budget")
    budget_module.MultiModalBudget = lambda vllm_config, registry: encoded.append("budget built") or _MMBudget()
    monkeypatch.setitem(sys.modules, "vllm.multimodal.utils", utils)
    monkeypatch.setitem(sys.modules, "vllm.multimodal.encoder_budget", budget_module)


class _MMBudget:
    """vLLM's MultiModalBudget for one modality of 576 tokens per item, 16,384 tokens of encoder cache."""

    encoder_cache_size, mm_max_toks_per_item, mm_max_items_per_batch = 16384, {"image": 576}, {"image": 8}

    def get_encoder_budget(self):
        return 16384

    def get_modality_with_max_tokens(self):
        return "image"


def _mm_runner(encoded: list, mm_budget=None, skip=False):
    def embed_multimodal(pixel_values, device):
        encoded.append(len(pixel_values))
        return [f"output of {item}" for item in pixel_values]

    registry = SimpleNamespace(
        get_dummy_mm_inputs=lambda model_config, mm_counts: {
            "mm_kwargs": {m: [f"dummy {m}"] * n for m, n in mm_counts.items()}
        }
    )
    config = SimpleNamespace(
        model_config=SimpleNamespace(multimodal_config=SimpleNamespace(skip_mm_profiling=skip, mm_encoder_only=False))
    )
    return SimpleNamespace(
        supports_mm_inputs=True,
        vllm_config=config,
        mm_registry=registry,
        device="cuda:3",
        mm_budget=mm_budget,
        model=SimpleNamespace(embed_multimodal=embed_multimodal),
    )


@pytest.mark.parametrize("own_budget", [True, False], ids=["v1-runner-budget", "v2-budget-built"])
def test_encoder_cache_held_fills_the_whole_cache_in_profiled_batches(monkeypatch, own_budget):
    # Note [The encoder cache, held whole]: 16,384 cache tokens hold 28 items of 576 tokens; vLLM's profile encodes
    # 8 per batch, so the cache is filled in batches of 8, 8, 8 and 4 and every output stays held.
    encoded: list = []
    _fake_mm_modules(monkeypatch, encoded)
    runner = _mm_runner(encoded, mm_budget=_MMBudget() if own_budget else None)
    held = probes.encoder_cache_held(runner)
    expected_batches = [8, 8, 8, 4] if own_budget else ["budget built", 8, 8, 8, 4]
    assert (encoded, len(held), held[-1]) == (expected_batches, 28, "output of dummy image"), (
        f"encoder_cache_held: expected batches {expected_batches} and 28 outputs held, got {encoded} and {len(held)}"
    )


@pytest.mark.parametrize("runner_kwargs", [dict(skip=True), dict()], ids=["mm-profiling-skipped", "not-multimodal"])
def test_encoder_cache_held_is_empty_without_an_encoder_cache_to_fill(monkeypatch, runner_kwargs):
    encoded: list = []
    _fake_mm_modules(monkeypatch, encoded)
    runner = _mm_runner(encoded, mm_budget=_MMBudget(), **runner_kwargs)
    if not runner_kwargs:
        runner.supports_mm_inputs = False
    held = probes.encoder_cache_held(runner)
    assert (held, encoded) == ([], []), (
        f"encoder_cache_held({runner_kwargs}): expected nothing encoded, got {encoded} and {len(held)} held"
    )


class _SpecRunner:
    """A V1 model runner's sampler side with ``k`` speculative tokens: vLLM's dummy sampler run calls the rejection
    sampler once with one draft per request, as vLLM 0.26.0's does."""

    vocab = 50

    def __init__(self, k, probabilistic=False):
        self.speculative_config = SimpleNamespace(num_speculative_tokens=k)
        self.device = "cpu"
        self.calls = []
        self.rejection_sampler = self._reject
        self.probabilistic = probabilistic
        self.model = SimpleNamespace(compute_logits=lambda hidden: torch.zeros(hidden.shape[0], self.vocab))

    def _reject(self, metadata, draft_probs, logits, sampling_metadata):
        self.calls.append(
            (
                metadata,
                None if draft_probs is None else tuple(draft_probs.shape),
                tuple(logits.shape),
                sampling_metadata,
            )
        )

    def _dummy_sampler_run(self, hidden_states):
        requests = hidden_states.shape[0]
        draft_probs = torch.ones(requests, self.vocab) / self.vocab if self.probabilistic else None
        self.rejection_sampler([[0]] * requests, draft_probs, torch.zeros(2 * requests, self.vocab), "sampling md")


@pytest.mark.parametrize(
    "k,probabilistic,expected_extra",
    [
        (1, False, []),  # vLLM's own dummy already has one draft
        (3, False, [([[0, 0, 0]] * 4, None, (16, 50), "sampling md")]),  # 4 requests x (1 + 3) logits rows
        (5, True, [([[0] * 5] * 4, (20, 50), (24, 50), "sampling md")]),  # draft probabilities where vLLM uses them
    ],
)
def test_sampler_run_adds_the_widest_speculative_step(monkeypatch, k, probabilistic, expected_extra):
    # Note [The speculative step, at its widest]: every request proposing k drafts, with vLLM's dummy sampling
    # parameters (captured from its own dummy run), after vLLM's one-draft dummy.
    import sys
    import types

    metadata_module = types.ModuleType("vllm.v1.spec_decode.metadata")
    metadata_module.SpecDecodeMetadata = SimpleNamespace(make_dummy=lambda drafts, device: drafts)
    monkeypatch.setitem(sys.modules, "vllm.v1.spec_decode.metadata", metadata_module)
    runner = _SpecRunner(k, probabilistic)
    own = runner.rejection_sampler
    probes._sampler_run(runner, torch.zeros(4, 8))
    vllm_dummy = ([[0]] * 4, (4, 50) if probabilistic else None, (8, 50), "sampling md")
    expected = [vllm_dummy, *expected_extra]
    assert runner.calls == expected, (
        f"_sampler_run with k={k}: expected rejection sampler calls {expected}, got {runner.calls}"
    )
    assert runner.rejection_sampler == own, "_sampler_run: the runner's rejection sampler was not put back"


def test_sampler_run_widens_nothing_where_vllms_dummy_runs_no_rejection_sampler(monkeypatch):
    # vLLM's _dummy_sampler_run returns before sampling for an encoder-only multimodal model
    runner = _SpecRunner(4)
    runner._dummy_sampler_run = lambda hidden_states: runner.calls.append("returned early")
    probes._sampler_run(runner, torch.zeros(4, 8))
    assert runner.calls == ["returned early"], (
        f"_sampler_run after a dummy without rejection sampler: expected no rejection sampler call, got {runner.calls}"
    )


@pytest.mark.parametrize(
    "where,value,needle",
    [("max_num_seqs", None, "max_num_seqs"), ("max_num_seqs", 8.5, "max_num_seqs"),
     ("max_num_seqs", float("nan"), "max_num_seqs"), ("enable_chunked_prefill", "False", "enable_chunked_prefill")],
)  # fmt: skip
def test_limits_from_a_vllm_config_of_odd_types_are_refused_naming_the_setting(where, value, needle):
    from extensible_kv.vllm import probes
    from extensible_kv.vllm.worst_batch import LimitsError

    config = _limits_config()
    setattr(config.scheduler_config, where, value)
    runner = SimpleNamespace(vllm_config=config, max_model_len=512, max_num_tokens=16384, speculative_config=None)
    with pytest.raises(LimitsError, match=needle):
        probes.limits_of(runner)
    setattr(config.scheduler_config, where, 8.0 if where == "max_num_seqs" else True)  # whole, and a real switch
    assert probes.limits_of(runner).max_num_seqs == 8
