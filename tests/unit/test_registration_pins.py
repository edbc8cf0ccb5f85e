"""Note [A registration pins the committed blocks] (``extensible_kv/kv_cache.py``): once a KV connector registered
the committed blocks, every path that would release them (the sleep backend, the buffers, a buffer's tensor) or grow
past them is refused with ``BusyError`` before anything changes; and a block count past the reservation is refused
by the buffers before anything is committed, whoever asks (``WorkerKV.ensure_blocks`` included)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from extensible_kv.drivers import Ledger
from extensible_kv.drivers.host import HostDriver
from extensible_kv.errors import BusyError, InvalidSizeError
from extensible_kv.vllm import connector, worker_kv
from extensible_kv.vllm.sleep import KVSleepBackend

G, PAGE, BLOCKS, COMMITTED = 4096, 8192, 24, 4


class _Connector:
    def __init__(self, config):
        self._kv_cache_config = config
        self.registered = None

    def register_kv_caches(self, kv_caches):
        self.registered = kv_caches


class _Inner:
    def __init__(self):
        self.calls = []

    def suspend(self, level=1):
        self.calls.append(("suspend", level))

    def resume(self, tags=None):
        self.calls.append(("resume", tags))


@pytest.fixture
def registered(monkeypatch):
    """A worker whose connector registered ``COMMITTED`` blocks."""
    monkeypatch.setattr(connector, "_SESSION", None)
    ledger = Ledger(HostDriver(granularity=G, budget_bytes=1 << 20, name="unit-host"))
    state = worker_kv.WorkerKV(ledger, segments=[1])
    config = SimpleNamespace(
        num_blocks=BLOCKS, kv_cache_tensors=[SimpleNamespace(size=BLOCKS * PAGE, shared_by=["l0"])]
    )
    conn = _Connector(config)
    connector.defer(state, conn)
    conn.register_kv_caches({"l0": state.allocate(config)["l0"].view(BLOCKS, PAGE)})
    state.ensure_blocks(COMMITTED, reason="final size")
    connector.register(state)
    yield state, ledger
    state.buffers.close()


def _held(state, ledger) -> tuple:
    out = ledger.outstanding()
    return state.buffers.state, state.buffers.num_blocks, sorted(out.mappings.items()), out.handles


def _refused(state, ledger, call, what: str, error=BusyError, match="KV connector _Connector") -> None:
    before = _held(state, ledger)
    with pytest.raises(error, match=match):
        call()
    assert _held(state, ledger) == before, (
        f"unit-host driver: {what} was refused but changed (state, blocks, mappings, handles) from {before} to "
        f"{_held(state, ledger)}"
    )


def test_the_sleep_backend_does_not_release_pages_a_connector_registered(registered):
    state, ledger = registered
    inner = _Inner()
    backend = KVSleepBackend(SimpleNamespace(_extensible_kv_state=state), inner)
    _refused(state, ledger, lambda: backend.suspend(1), "KVSleepBackend.suspend(1)")
    assert inner.calls == [], f"KVSleepBackend.suspend refused: expected vLLM's backend not asked, got {inner.calls}"


def test_no_other_path_releases_or_grows_registered_blocks(registered):
    state, ledger = registered
    _refused(state, ledger, state.buffers.release_physical, "ExtensibleKVCacheBuffers.release_physical()")
    _refused(state, ledger, state.buffers.tensor("kv0").release_physical, "the buffer tensor's release_physical()")
    _refused(state, ledger, lambda: state.buffers.ensure_blocks(COMMITTED + 1), f"ensure_blocks({COMMITTED + 1})")
    _refused(state, ledger, lambda: state.ensure_blocks(BLOCKS, reason="model"), f"WorkerKV.ensure_blocks({BLOCKS})")
    assert state.ensure_blocks(COMMITTED, reason="again") == COMMITTED, "the registered count again must be a no-op"


@pytest.mark.parametrize("blocks", [BLOCKS + 1, 2**70])
def test_a_count_past_the_reservation_is_refused_before_anything_is_committed(monkeypatch, blocks):
    monkeypatch.setattr(connector, "_SESSION", None)
    ledger = Ledger(HostDriver(granularity=G, budget_bytes=1 << 20, name="unit-host"))
    state = worker_kv.WorkerKV(ledger, segments=[1])
    state.allocate(
        SimpleNamespace(num_blocks=BLOCKS, kv_cache_tensors=[SimpleNamespace(size=BLOCKS * PAGE, shared_by=["l0"])])
    )
    try:
        what, match = f"WorkerKV.ensure_blocks({blocks})", rf"warmup: num_blocks={blocks} exceeds"
        _refused(state, ledger, lambda: state.ensure_blocks(blocks, reason="warmup"), what, InvalidSizeError, match)
    finally:
        state.buffers.close()


@pytest.mark.parametrize("name", ["C" * 300, "Conn\x1b]0;title\x07"])
def test_a_connector_of_any_name_is_pinned_before_it_is_handed_the_views(monkeypatch, name):
    # wrong: the views handed over first and the pin refused after (a name past the holder limit or with control
    # characters), leaving the connector's views unprotected: release and growth then pass under them
    monkeypatch.setattr(connector, "_SESSION", None)
    ledger = Ledger(HostDriver(granularity=G, budget_bytes=1 << 20, name="unit-host"))
    state = worker_kv.WorkerKV(ledger, segments=[1])
    config = SimpleNamespace(
        num_blocks=BLOCKS, kv_cache_tensors=[SimpleNamespace(size=BLOCKS * PAGE, shared_by=["l0"])]
    )
    conn = type(name, (_Connector,), {})(config)
    connector.defer(state, conn)
    conn.register_kv_caches({"l0": state.allocate(config)["l0"].view(BLOCKS, PAGE)})
    state.ensure_blocks(COMMITTED, reason="final size")
    try:
        connector.register(state)
        holders = list(state.buffers.pinned_by)
        assert len(holders) == 1 and holders[0].startswith("KV connector") and holders[0].isprintable(), holders
        _refused(state, ledger, state.buffers.release_physical, "release_physical()", match="KV connector")
        _refused(state, ledger, lambda: state.buffers.ensure_blocks(COMMITTED + 1), "ensure_blocks", match="KV conn")
    finally:
        state.buffers.close()
