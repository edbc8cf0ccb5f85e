"""Calls of a second thread wait for an operation of the tensor in progress (Note [Operations never wait on
themselves] in ``tensor``): ``checkpoint``, ``pin`` and ``unpin`` take the tensor's lock as growth does, so a mark or
a pin taken while another thread grows or shrinks names the step's result, never half of it."""

from __future__ import annotations

import threading

import pytest

from extensible_kv import ExtensibleTensor
from extensible_kv.drivers.host import HostDriver

MIB = 1 << 20


class _Stalling(HostDriver):
    """A host driver whose second map (or unmap) stalls until ``go`` is set, after setting ``inside``."""

    def __init__(self, op: str) -> None:
        super().__init__(budget_bytes=1 << 30, name="unit-stalling")
        self.op, self.n, self.inside, self.go = op, 0, threading.Event(), threading.Event()

    def _stall(self) -> None:
        self.n += 1
        if self.n == 2:
            self.inside.set()
            self.go.wait(10)

    def do_map(self, *args):
        if self.op == "grow":
            self._stall()
        return super().do_map(*args)

    def do_unmap(self, *args):
        if self.op == "shrink":
            self._stall()
        return super().do_unmap(*args)


@pytest.mark.parametrize("op", ["grow", "shrink"])
@pytest.mark.parametrize("call", ["checkpoint", "pin"])
def test_a_call_of_another_thread_waits_for_the_operation_in_progress(op, call):
    # wrong: no lock in checkpoint or pin: a mark taken mid-growth named a step that was not there (its rollback
    # left a mapping behind and every later growth failed), a pin taken mid-shrink recorded the old size
    driver = _Stalling(op)
    t = ExtensibleTensor(16 * MIB, 2, driver=driver)
    if op == "shrink":
        t.resize_per_segment_(4 * MIB)
        driver.n = 0
    target = 4 * MIB if op == "grow" else 2 * MIB
    step = threading.Thread(target=(t.resize_per_segment_ if op == "grow" else t.shrink_per_segment_), args=(target,))
    step.start()
    try:
        assert driver.inside.wait(10), f"unit-stalling: {op}: the driver call never stalled"
        got = {}
        second = threading.Thread(target=lambda: got.update(r=t.checkpoint() if call == "checkpoint" else t.pin("x")))
        second.start()
        second.join(0.2)
        waited = second.is_alive()
    finally:
        driver.go.set()
        step.join(10)
    second.join(10)
    assert waited, f"unit-stalling: {call} of another thread during {op}: expected it to wait for the lock, it returned"
    if call == "checkpoint":
        mark = got["r"]
        assert (mark.per_segment, t.rollback_to(mark), t.bytes_per_segment) == (target, [], target), (
            f"unit-stalling: checkpoint during {op}: expected a mark at {target} bytes that rolls back to itself"
        )
        t.resize_per_segment_(8 * MIB)  # growth after it works
    else:
        with pytest.raises(Exception, match="x"):
            t.shrink_per_segment_(target - 1 * MIB)  # the pin saw the step's result and holds it
        t.unpin("x")
    t.close()
    held = driver.mem_info()[1] - driver.mem_info()[0]
    assert held == 0, f"unit-stalling: {call} during {op}, then close(): expected 0 bytes held, got {held}"


@pytest.mark.parametrize("op", ["grow", "release"])
def test_a_reader_of_the_buffers_during_another_threads_step_waits_for_its_result(op):
    # wrong: between two buffers of a step no tensor's lock is held: a reader saw the record before the growth
    # ("open", 0 blocks) with one buffer grown, and a release part released, part open ("failed")
    from extensible_kv.kv_cache import ExtensibleKVCacheBuffers, KVBuffer

    kv = ExtensibleKVCacheBuffers(
        [KVBuffer("a", MIB, num_segments=1), KVBuffer("b", MIB, num_segments=1)], 8, driver=HostDriver(1 << 30)
    )
    if op == "release":
        kv.ensure_blocks(4)
    second_buffer, inside, go = kv.tensor("b"), threading.Event(), threading.Event()
    name = "checkpoint" if op == "grow" else "release_physical"
    original = getattr(second_buffer, name)

    def stalled(*args):  # the step has done buffer a and not yet begun buffer b
        inside.set()
        go.wait(10)
        return original(*args)

    setattr(second_buffer, name, stalled)
    step = threading.Thread(target=kv.ensure_blocks if op == "grow" else kv.release_physical, args=(4,)[: op == "grow"])
    step.start()
    got: dict = {}
    try:
        assert inside.wait(10), f"{op} of the buffers never reached buffer b"
        second = threading.Thread(target=lambda: got.update(r=(kv.state, kv.num_blocks)))
        second.start()
        second.join(0.2)
        waited = second.is_alive()
    finally:
        go.set()
        step.join(10)
    second.join(10)
    delattr(second_buffer, name)
    kv.close()
    expected = ("open", 4) if op == "grow" else ("released", 4)
    assert (waited, got.get("r")) == (True, expected), (
        f"host: {op} of the buffers: expected a reader in another thread to wait and read {expected}, "
        f"got waited={waited}, {got.get('r')}"
    )


@pytest.mark.parametrize("op", ["grow", "shrink", "close"])
@pytest.mark.parametrize("reading", ["state", "closed", "bytes_per_segment"])
def test_a_reading_of_another_thread_names_the_result_of_the_step_in_progress(op, reading):
    # wrong: a reading without the lock saw a shrink or a close half done ("failed", 0 bytes per segment), which
    # a caller could act on (close a tensor that the shrink leaves open)
    driver = _Stalling("grow" if op == "grow" else "shrink")
    t = ExtensibleTensor(16 * MIB, 2, driver=driver)
    if op != "grow":
        t.resize_per_segment_(4 * MIB)
        driver.n = 0
    target = {"grow": 4 * MIB, "shrink": 2 * MIB, "close": 0}[op]
    run = {"grow": t.resize_per_segment_, "shrink": t.shrink_per_segment_, "close": lambda _n: t.close()}[op]
    step = threading.Thread(target=run, args=(target,))
    step.start()
    got: dict = {}
    try:
        assert driver.inside.wait(10), f"unit-stalling: {op}: the driver call never stalled"
        second = threading.Thread(target=lambda: got.update(r=getattr(t, reading)))
        second.start()
        second.join(0.2)
        waited = second.is_alive()
    finally:
        driver.go.set()
        step.join(10)
    second.join(10)
    expected = {"state": "closed" if op == "close" else "open", "closed": op == "close", "bytes_per_segment": target}[
        reading
    ]
    assert (waited, got.get("r")) == (True, expected), (
        f"unit-stalling: {reading} read by another thread during {op}: expected it to wait and read {expected!r}, "
        f"got waited={waited}, {got.get('r')!r}"
    )
    t.close()


def test_a_finalizer_reading_the_buffers_inside_a_tensor_operation_never_waits_on_a_step_of_another_thread():
    # wrong: readings that wait on the lock: thread A, inside a shrink of a buffer's tensor (its lock held, the
    # collector running a user finalizer that reads kv.state), waits for the KV lock; thread B, in a KV step that
    # holds the KV lock, waits for the tensor's lock: both forever
    import gc
    import time

    from extensible_kv import ExtensibleKVError
    from extensible_kv.kv_cache import ExtensibleKVCacheBuffers, KVBuffer

    kv = ExtensibleKVCacheBuffers([KVBuffer("a", 4096, num_segments=1)], 64, driver=HostDriver(granularity=4096))
    kv.ensure_blocks(8)
    tensor, seen, inside = kv.tensor("a"), [], threading.Event()

    class Cycle:
        def __init__(self):
            self.me = self  # only the collector frees it

        def __del__(self):
            inside.set()  # the tensor's lock is held
            time.sleep(0.2)  # the step of the other thread holds the KV lock by now
            seen.append(kv.state)

    view = tensor.segment_view(0)  # reaches 8 blocks: a shrink below it collects garbage under the tensor's lock

    def step():
        inside.wait(5)
        try:
            kv.shrink_blocks(8)  # the KV lock, then the tensor's
        except ExtensibleKVError:
            pass

    refused = []

    def shrink():  # refused, the view reaching past it, after the collector ran the finalizer under the lock
        try:
            tensor.shrink_per_segment_(0)
        except ExtensibleKVError as exc:
            refused.append(type(exc).__name__)

    threads = [threading.Thread(target=step, daemon=True), threading.Thread(target=shrink, daemon=True)]
    gc.disable()  # the collection is the shrink's own
    try:
        Cycle()
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)  # a deadlock leaves them waiting: daemons, so the run goes on to fail
    finally:
        gc.enable()
    alive = [t.is_alive() for t in threads]
    del view
    assert (alive, len(seen), refused) == ([False, False], 1, ["BusyError"]), (
        f"host: a finalizer reading kv.state inside a tensor shrink while another thread runs a KV step: expected "
        f"both threads to finish, one reading and the shrink refused, got alive={alive}, readings {seen}, {refused}"
    )
    kv.close()
