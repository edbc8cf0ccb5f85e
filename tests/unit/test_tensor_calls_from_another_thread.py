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


def test_a_reader_of_the_buffers_during_another_threads_growth_sees_them_open():
    # wrong: the buffers' state compares their record with each buffer's size while a growth changes them one by
    # one: a reader saw "failed" (a buffer "resized underneath") and num_blocks 0 in the middle of ensure_blocks
    from extensible_kv.kv_cache import ExtensibleKVCacheBuffers, KVBuffer

    driver = _Stalling("grow")
    kv = ExtensibleKVCacheBuffers(
        [KVBuffer("a", MIB, num_segments=1), KVBuffer("b", MIB, num_segments=1)], 8, driver=driver
    )
    step = threading.Thread(target=kv.ensure_blocks, args=(4,))
    step.start()
    try:
        assert driver.inside.wait(10), "unit-stalling: ensure_blocks never reached its second map"
        during = (kv.state, kv.num_blocks)
    finally:
        driver.go.set()
        step.join(10)
    after = (kv.state, kv.num_blocks)
    kv.close()
    assert (during, after) == (("open", 0), ("open", 4)), (
        f"unit-stalling: ensure_blocks(4) from 0 blocks: expected the state and block count read by another thread "
        f"during and after ('open', 0), ('open', 4), got {during}, {after}"
    )
