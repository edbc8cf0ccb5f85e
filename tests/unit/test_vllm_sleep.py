"""Sleep mode on the extensible path, without a GPU or vLLM: the order of things in a worker's ``sleep`` and
``wake_up`` (the KV pages released before vLLM's backend sleeps, recommitted before it wakes), tags, levels, what a
failure leaves, the V1 wake hook, the CuMem pool check and the patch lines that wire it in.

The worker below repeats the lines of vLLM 0.26.0's ``gpu_worker.Worker.sleep`` / ``wake_up`` that decide the order:
the backend from ``_get_sleep_mode_backend()`` suspends or resumes, then ``post_kv_cache_wake_up`` when the KV cache
wakes. The KV buffers and vLLM's backend are fakes with the names the extensible path calls."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from extensible_kv.errors import CommitOutOfMemory, ExtensibleKVError, InvalidArgumentError, InvalidSizeError
from extensible_kv.vllm import ExtensibleKVUnsupported, patches, sleep, worker_kv


class _AlreadyReleased(ExtensibleKVError, RuntimeError):
    """The fake's refusal of a second release (the real buffers refuse it with a typed error too)."""


class _Buffers:
    """ExtensibleKVCacheBuffers' sleep API: ``release_physical``, ``recommit_physical``, ``released``."""

    def __init__(
        self, log: list, fail_release: BaseException | None = None, fail_recommit: BaseException | None = None
    ) -> None:
        self.log, self.released = log, False
        self.fail_release, self.fail_recommit = fail_release, fail_recommit

    def release_physical(self) -> None:
        if self.released:
            raise _AlreadyReleased("release_physical on released buffers")
        if self.fail_release is not None:
            raise self.fail_release
        self.released = True
        self.log.append("release")

    def recommit_physical(self) -> None:
        if not self.released:
            raise _AlreadyReleased("recommit_physical on committed buffers")
        if self.fail_recommit is not None:
            exc, self.fail_recommit = self.fail_recommit, None  # fails once, as an OOM that later clears
            raise exc
        self.released = False
        self.log.append("recommit")


class _VllmBackend:
    """vLLM's sleep-mode backend: records what it was asked to do."""

    def __init__(self, log: list, fail_suspend: BaseException | None = None) -> None:
        self.log, self.fail_suspend = log, fail_suspend

    def suspend(self, level: int = 1) -> None:
        self.log.append(("suspend", level))
        if self.fail_suspend is not None:
            raise self.fail_suspend

    def resume(self, tags=None) -> None:
        self.log.append(("resume", tags))

    def state(self) -> str:
        return "RUNNING"

    @classmethod
    def preserves_communicators(cls) -> bool:
        return True


class _V1Runner:
    def __init__(self, log: list) -> None:
        self.log = log
        self.kv_caches = ["full-view-0", "full-view-1"]

    def post_kv_cache_wake_up(self) -> None:
        self.log.append(("post_wake", list(self.kv_caches)))


_V2Runner = type("GPUModelRunner", (_V1Runner,), {"__module__": "vllm.v1.worker.gpu.model_runner"})


class _Worker:
    """The order-deciding lines of vLLM 0.26.0's ``Worker.sleep`` and ``Worker.wake_up``."""

    def __init__(
        self,
        log: list,
        buffers: object | None = None,
        vllm_backend: object | None = None,
        runner: object | None = None,
        sleep_mode: bool = True,
    ) -> None:
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=sleep_mode))
        self._sleep_mode_backend = vllm_backend
        self.model_runner = runner if runner is not None else _V1Runner(log)
        self._extensible_kv_state = worker_kv.WorkerKV(driver=None, buffers=buffers)

    def _get_sleep_mode_backend(self):
        return self._sleep_mode_backend

    def sleep(self, level: int = 1) -> None:
        self._get_sleep_mode_backend().suspend(level)

    def wake_up(self, tags=None) -> None:
        self._get_sleep_mode_backend().resume(tags)
        if tags is None or "kv_cache" in tags:
            self.model_runner.post_kv_cache_wake_up()


def _bound(**kwargs) -> tuple[_Worker, _Buffers, list]:
    log: list = []
    buffers = _Buffers(log, **kwargs)
    worker = _Worker(log, buffers, _VllmBackend(log))
    sleep.bind(worker)
    return worker, buffers, log


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_the_kv_pages_then_vllms_backend_sleeps(level):
    worker, buffers, log = _bound()
    worker.sleep(level)
    got = (log, buffers.released)
    assert got == (["release", ("suspend", level)], True), (
        f"sleep(level={level}): expected (calls, released) = (['release', ('suspend', {level})], True), got {got}"
    )


@pytest.mark.parametrize("tags", [None, ["kv_cache"], ["weights", "kv_cache"]])
def test_wake_up_recommits_before_vllm_wakes_and_before_the_runners_wake_hook(tags):
    worker, buffers, log = _bound()
    worker.sleep(1)
    del log[:]
    worker.wake_up(tags)
    expected = ["recommit", ("resume", tags), ("post_wake", [])]
    assert (log, buffers.released) == (expected, False), (
        f"wake_up(tags={tags}): expected (calls, released) = ({expected}, False), got {(log, buffers.released)}"
    )


def test_a_weights_only_wake_leaves_the_kv_released_until_a_kv_cache_wake():
    worker, buffers, log = _bound()
    worker.sleep(1)
    worker.wake_up(["weights"])
    after_weights = (list(log), buffers.released)
    worker.wake_up(["kv_cache"])
    assert after_weights == (["release", ("suspend", 1), ("resume", ["weights"])], True), (
        f"wake_up(['weights']): expected the KV still released and no recommit, got (calls, released) = {after_weights}"
    )
    assert (log[3:], buffers.released) == (["recommit", ("resume", ["kv_cache"]), ("post_wake", [])], False), (
        f"wake_up(['kv_cache']) after a weights-only wake: expected a recommit, got {(log[3:], buffers.released)}"
    )


def test_a_wake_naming_no_tag_recommits_nothing():
    worker, buffers, log = _bound()
    worker.sleep(1)
    worker.wake_up([])
    assert (log[2:], buffers.released) == ([("resume", [])], True), (
        f"wake_up([]): expected no recommit, got (calls, released) = {(log[2:], buffers.released)}"
    )


def test_ten_cycles_release_and_recommit_once_each_and_record_them():
    worker, buffers, log = _bound()
    for _ in range(10):
        worker.sleep(1)
        worker.wake_up()
    events = [e["event"] for e in worker._extensible_kv_state.events]
    got = (
        log.count("release"),
        log.count("recommit"),
        events.count("release"),
        events.count("recommit"),
        buffers.released,
    )
    assert got == (10, 10, 10, 10, False), (
        f"10 sleep/wake cycles: expected (releases, recommits, release events, "
        f"recommit events, released) = (10, 10, 10, 10, False), got {got}"
    )


def test_a_second_sleep_does_not_release_again():
    worker, _, log = _bound()
    worker.sleep(1)
    worker.sleep(2)  # the fake refuses a second release_physical, as the real buffers do
    assert log == ["release", ("suspend", 1), ("suspend", 2)], f"sleep twice: expected one release, got {log}"


@pytest.mark.parametrize(
    "method,arg,error",
    [
        ("sleep", 0, InvalidSizeError),
        ("sleep", 3, InvalidSizeError),
        ("sleep", True, InvalidArgumentError),
        ("sleep", "1", InvalidArgumentError),
        ("wake_up", "kv_cache", InvalidArgumentError),
        ("wake_up", [None], InvalidArgumentError),
        ("wake_up", 5, InvalidArgumentError),
    ],
    ids=["level-0", "level-3", "level-bool", "level-str", "tags-str", "tags-not-names", "tags-not-a-list"],
)
def test_bad_levels_and_tags_are_refused_before_anything_happens(method, arg, error):
    worker, buffers, log = _bound()
    if method == "wake_up":
        worker.sleep(1)
    before = (list(log), buffers.released)
    with pytest.raises(error):
        getattr(worker, method)(arg)
    assert (log, buffers.released) == before, (
        f"{method}({arg!r}) was refused but changed things: (calls, "
        f"released) before {before}, after {(log, buffers.released)}"
    )


def test_a_failed_recommit_leaves_the_kv_released_and_nothing_woken_and_can_be_retried():
    oom = CommitOutOfMemory("recommit: out of memory", operation="create", requested=1 << 30, committed=0)
    worker, buffers, log = _bound(fail_recommit=oom)
    worker.sleep(1)
    with pytest.raises(CommitOutOfMemory):
        worker.wake_up(["kv_cache"])
    failed = (log[2:], buffers.released, worker._extensible_kv_state.events[-1]["event"])
    worker.wake_up(["kv_cache"])
    assert failed == ([], True, "recommit_failed"), (
        f"a failed recommit: expected (calls after sleep, released, last event) = ([], True, 'recommit_failed'), "
        f"got {failed}"
    )
    assert (log[2:], buffers.released) == (["recommit", ("resume", ["kv_cache"]), ("post_wake", [])], False), (
        f"wake_up(['kv_cache']) again after a failed recommit: expected it to wake, got {(log[2:], buffers.released)}"
    )


def test_a_failed_vllm_sleep_recommits_the_kv_and_raises_its_error():
    log: list = []
    buffers = _Buffers(log)
    worker = _Worker(log, buffers, _VllmBackend(log, fail_suspend=RuntimeError("cudaMemcpy failed")))
    sleep.bind(worker)
    with pytest.raises(RuntimeError, match="cudaMemcpy failed"):
        worker.sleep(1)
    assert (log, buffers.released) == (["release", ("suspend", 1), "recommit"], False), (
        f"vLLM's sleep failed: expected the KV recommitted (awake, as before), got {(log, buffers.released)}"
    )


def test_an_interrupt_in_the_recommit_after_a_failed_sleep_reaches_the_caller():
    # wrong: the recommit's failures caught whole, a KeyboardInterrupt among them: logged and lost
    log: list = []
    buffers = _Buffers(log, fail_recommit=KeyboardInterrupt())
    worker = _Worker(log, buffers, _VllmBackend(log, fail_suspend=RuntimeError("cudaMemcpy failed")))
    sleep.bind(worker)
    with pytest.raises(KeyboardInterrupt):
        worker.sleep(1)


@pytest.mark.parametrize(
    "make", [iter, tuple, lambda names: (n for n in names)], ids=["iterator", "tuple", "generator"]
)
def test_a_wake_with_tags_of_any_iterable_wakes_the_kv_and_hands_vllm_the_same_names(make):
    # wrong: the names read once to see whether they wake the KV cache, then the used-up iterator handed to vLLM,
    # which woke nothing
    worker, buffers, log = _bound()
    worker.sleep(1)
    del log[:]
    worker.wake_up(make(["weights", "kv_cache"]))
    got = (log[:2], buffers.released)
    want = (["recommit", ("resume", ["weights", "kv_cache"])], False)
    assert got == want, f"wake_up of an {type(make).__name__} of tags: expected {want}, got {got}"


def test_a_failed_release_stops_before_vllms_backend_sleeps():
    worker, _, log = _bound(fail_release=RuntimeError("cuMemUnmap failed"))
    with pytest.raises(RuntimeError, match="cuMemUnmap failed"):
        worker.sleep(1)
    assert log == [], f"a failed release: expected vLLM's backend untouched, got calls {log}"


def test_without_extensible_buffers_vllms_backend_does_everything():
    log: list = []
    worker = _Worker(log, None, _VllmBackend(log))
    sleep.bind(worker)
    worker.sleep(1)
    worker.wake_up()
    assert log == [("suspend", 1), ("resume", None), ("post_wake", [])], (
        f"no extensible buffers: expected vLLM's backend alone, got {log}"
    )


def test_bind_wraps_once_keeps_vllms_backend_and_forwards_the_rest():
    log: list = []
    inner = _VllmBackend(log)
    worker = _Worker(log, _Buffers(log), inner)
    sleep.bind(worker)
    first, hook = worker._sleep_mode_backend, worker.model_runner.post_kv_cache_wake_up
    sleep.bind(worker)
    got = (
        worker._sleep_mode_backend is first,
        worker.model_runner.post_kv_cache_wake_up is hook,
        first.inner is inner,
        first.state(),
        first.preserves_communicators(),
    )
    assert got == (True, True, True, "RUNNING", True), (
        f"bind twice: expected (same backend, same hook, inner kept, state, capability) = (True, True, True, "
        f"'RUNNING', True), got {got}"
    )


def test_vllms_backend_is_made_by_vllms_factory_on_first_use(monkeypatch):
    log: list = []
    made = []
    monkeypatch.setattr(sleep, "_vllm_backend", lambda w: made.append(w) or _VllmBackend(log))
    worker = _Worker(log, _Buffers(log), None)
    sleep.bind(worker)
    untouched = list(made)
    worker.sleep(1)
    worker.wake_up()
    assert (untouched, made, log[:2]) == ([], [worker], ["release", ("suspend", 1)]), (
        f"expected vLLM's backend made once, on the first sleep, for this worker; got (made at bind, made, calls) "
        f"= {(untouched, made, log[:2])}"
    )


def test_bind_with_sleep_mode_off_changes_nothing():
    log: list = []
    worker = _Worker(log, _Buffers(log), None, sleep_mode=False)
    hook = worker.model_runner.post_kv_cache_wake_up
    sleep.bind(worker)
    got = (worker._sleep_mode_backend, worker.model_runner.post_kv_cache_wake_up == hook)
    assert got == (None, True), f"sleep mode off: expected (backend, hook unchanged) = (None, True), got {got}"


def test_bind_refuses_a_worker_without_a_sleep_mode_backend():
    worker = SimpleNamespace(
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=True)), model_runner=_V1Runner([])
    )
    with pytest.raises(ExtensibleKVUnsupported, match="_sleep_mode_backend"):
        sleep.bind(worker)


def test_the_v1_wake_hook_runs_with_no_kv_views_and_gives_them_back():
    worker, _, log = _bound()
    views = worker.model_runner.kv_caches
    worker.sleep(1)
    worker.wake_up()
    got = (log[-1], worker.model_runner.kv_caches is views)
    assert got == (("post_wake", []), True), (
        f"V1 post_kv_cache_wake_up: expected it to see no KV views and the views back after, got {got}"
    )


def test_the_v2_wake_hook_is_left_alone():
    log: list = []
    runner = _V2Runner(log)
    worker = _Worker(log, _Buffers(log), _VllmBackend(log), runner=runner)
    sleep.bind(worker)
    worker.sleep(1)
    worker.wake_up()
    got = ("post_kv_cache_wake_up" in vars(runner), log[-1])
    assert got == (False, ("post_wake", ["full-view-0", "full-view-1"])), (
        f"V2 post_kv_cache_wake_up: expected vLLM's own, seeing the views, got (bound on instance, call) = {got}"
    )


# -- vLLM's CuMem pool ---------------------------------------------------------------------------------------------
def _fake_cumem(monkeypatch, usage: list) -> None:
    instance = SimpleNamespace(get_current_usage=lambda: usage[0])
    module = types.ModuleType(sleep._CUMEM_MODULE)
    module.CuMemAllocator = SimpleNamespace(instance=instance)
    monkeypatch.setitem(sys.modules, sleep._CUMEM_MODULE, module)


def test_an_allocation_that_lands_in_vllms_pool_is_refused(monkeypatch):
    usage = [4096]
    _fake_cumem(monkeypatch, usage)
    with (
        pytest.raises(ExtensibleKVUnsupported, match="from 4096 to 6144 bytes"),
        sleep.nothing_in_pool("the extensible KV allocation"),
    ):
        usage[0] += 2048


def test_an_allocation_outside_vllms_pool_passes(monkeypatch):
    usage = [4096]
    _fake_cumem(monkeypatch, usage)
    with sleep.nothing_in_pool("the extensible KV allocation"):
        pass
    monkeypatch.delitem(sys.modules, sleep._CUMEM_MODULE)
    with sleep.nothing_in_pool("the extensible KV allocation"):  # no CuMem allocator: sleep mode off
        pass


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_the_allocation_patches_check_vllms_pool(monkeypatch, runner):
    usage = [0]
    _fake_cumem(monkeypatch, usage)

    def allocate(config):
        usage[0] += 1 << 20  # as if the allocation had made a torch tensor inside use_memory_pool
        return {"layer0": "raw"}

    monkeypatch.setattr(worker_kv, "active", lambda: SimpleNamespace(allocate=allocate))
    with pytest.raises(ExtensibleKVUnsupported, match="CuMem pool"):
        if runner == "v1":
            patches._v1_allocate_kv_cache_tensors(None)(object(), "config")
        else:
            patches._v2_allocate_kv_cache(None)("config", {}, "cuda")


def test_determine_available_memory_binds_the_sleep_backend(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.envs = SimpleNamespace(VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=False)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    log: list = []
    worker = _Worker(log, _Buffers(log), _VllmBackend(log))
    worker.model_runner.profile_run = lambda: None
    worker.cache_config = SimpleNamespace(kv_cache_memory_bytes=None)
    patches._determine_available_memory(lambda self: 1 << 30)(worker)
    assert isinstance(worker._sleep_mode_backend, sleep.KVSleepBackend), (
        f"determine_available_memory with sleep mode on: expected a KVSleepBackend, got {worker._sleep_mode_backend!r}"
    )


def test_sleep_mode_is_no_longer_refused():
    cuda = SimpleNamespace(is_cuda_alike=lambda: True, device_name="cuda")
    patches.check_supported(
        SimpleNamespace(kv_transfer_config=None, model_config=SimpleNamespace(enable_sleep_mode=True)), cuda
    )
