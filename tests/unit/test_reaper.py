"""The reaper's promise that a put-off sweep is never lost (Note [A put-off sweep is never lost] in
``extensible_kv.reaper``): a tensor whose last reference goes inside a section (any driver call this package makes)
has its memory back after the next collection outside one, whether or not that collection finds garbage, and a tensor
that dies inside another tensor's teardown is returned by the same sweep."""

from __future__ import annotations

import gc
import signal
import sys
from collections.abc import Callable

import pytest

from extensible_kv.drivers import Ledger
from extensible_kv.drivers.host import HostDriver
from extensible_kv.errors import DriverError
from extensible_kv.reaper import busy
from extensible_kv.tensor import ExtensibleTensor

G = 4096


class _DropsInside(HostDriver):
    """A host driver that, inside the locked section of its ``op`` calls, drops whatever ``doomed`` holds (so a
    tensor's last reference goes, and its finalizer runs, inside a driver call)."""

    def __init__(self, op: str) -> None:
        super().__init__(granularity=G)
        self.op = op
        self.doomed: list[object] = []

    def _drop(self) -> None:
        self.doomed.clear()

    def do_unmap(self, va: int, size: int) -> None:
        if self.op == "unmap":
            self._drop()
        super().do_unmap(va, size)

    def do_set_access(self, va: int, size: int) -> None:
        if self.op == "set_access":
            self._drop()
        super().do_set_access(va, size)

    def mem_info(self) -> tuple[int, int]:
        with busy():
            if self.op == "mem_info":
                self._drop()
            return super().mem_info()


def _tensor(driver: Ledger) -> ExtensibleTensor:
    t = ExtensibleTensor(4 * G, driver=driver)
    t.resize_per_segment_(2 * G)
    return t


def _inside_a_growth(driver: Ledger, host: _DropsInside) -> None:
    _tensor(driver).resize_per_segment_(4 * G)  # set_access drops the doomed tensor


def _inside_a_query(driver: Ledger, host: _DropsInside) -> None:
    driver.mem_info()


def _inside_a_close(driver: Ledger, host: _DropsInside) -> None:
    _tensor(driver).close()  # unmap drops the doomed tensor


def _inside_a_section(driver: Ledger, host: _DropsInside) -> None:
    with busy():
        host.doomed.clear()


CALLS: dict[str, tuple[str, Callable[[Ledger, _DropsInside], None]]] = {
    "a growth": ("set_access", _inside_a_growth),
    "a driver query": ("mem_info", _inside_a_query),
    "a close": ("unmap", _inside_a_close),
    "a bare section": ("none", _inside_a_section),
}


@pytest.mark.parametrize("where", CALLS)
def test_a_tensor_dropped_inside_a_driver_call_is_returned_by_the_next_collection(where):
    op, call = CALLS[where]
    host = _DropsInside(op)
    driver = Ledger(host)
    doomed = _tensor(driver)
    base = doomed.base_address
    host.doomed.append(doomed)
    del doomed
    call(driver, host)
    assert not host.doomed, f"{where}: expected the driver's {op} to drop the tensor"
    gc.collect()  # finds no garbage: the tensor died by its reference count, inside the call
    left = driver.outstanding().reservations
    assert base not in left, (
        f"host driver, a tensor dropped inside {where} ({op}): expected its reservation at {base:#x} back after the "
        f"next collection; still reserved: {left}"
    )


def test_a_tensor_that_dies_inside_another_teardown_is_returned_by_the_same_sweep():
    host = _DropsInside("unmap")
    driver = Ledger(host)
    second = _tensor(driver)  # older: the sweep passes it first, while it is still alive
    first = _tensor(driver)
    bases = second.base_address, first.base_address
    host.doomed.append(second)
    del second
    with busy():  # the first tensor dies inside a section: its sweep is put off
        del first
    assert bases[1] in driver.outstanding().reservations, "expected the put-off tensor still reserved"
    third = ExtensibleTensor(G, driver=driver)  # its construction sweeps: the first's teardown drops the second
    left = driver.outstanding().reservations
    third.close()
    assert not set(bases) & set(left), (
        f"host driver, a sweep whose teardown dropped another tensor: expected both reservations "
        f"({bases[0]:#x}, {bases[1]:#x}) back after it; still reserved: {left}"
    )


FAILURES = {"the driver's refusal": lambda: DriverError("unmap", "injected"), "an interrupt": KeyboardInterrupt}


@pytest.mark.parametrize("failure", FAILURES)
def test_a_teardown_that_failed_outside_a_section_is_retried_by_the_next_full_collection(failure, monkeypatch):
    """A tensor collected outside any section whose teardown fails once (its ``unmap`` refused, or an interrupt
    there): nothing was put off, so the put-off count alone does not bring the next collection back to it (Note [A
    failed teardown is owed to the next full collection] in ``extensible_kv.reaper``)."""
    reports: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reports.append(f"{u.exc_type.__name__}: {u.exc_value}"))
    driver = Ledger(HostDriver(granularity=G))
    doomed = _tensor(driver)
    base = doomed.base_address
    driver.fail("unmap", 1, FAILURES[failure]())
    del doomed  # its finalizer sweeps at once, outside any section; the unmap fails
    assert base in driver.outstanding().reservations and len(reports) == 1, (
        f"host driver, {failure} at a collected tensor's unmap: expected its reservation still owned and one report; "
        f"reserved: {driver.outstanding().reservations}, reports: {reports}"
    )
    gc.collect()  # no tensor operation in between: only the collection can return it
    left = driver.outstanding().reservations
    assert base not in left, (
        f"host driver, {failure} at a collected tensor's unmap: expected its reservation at {base:#x} back after the "
        f"next full collection; still reserved: {left}"
    )
    assert len(reports) == 1, f"expected the failure reported once, got {reports}"


class _CollectsInside(HostDriver):
    """A host driver that runs a full collection inside every ``synchronize`` (so inside a teardown's section) and,
    while ``refuse`` is set, refuses every ``unmap``."""

    refuse = True

    def synchronize(self) -> None:
        gc.collect()
        super().synchronize()

    def unmap(self, va: int, size: int) -> None:
        if self.refuse:
            raise DriverError("unmap", "refused by the test's driver")
        super().unmap(va, size)


def test_a_sweep_ends_when_full_collections_end_inside_its_teardown(monkeypatch):
    """Full collections that end inside a sweep's own teardown, whose driver keeps failing: the end-of-collection
    hook must do nothing inside the section; counted as put-off sweeps, they made the sweep repeat forever
    (``_after_collection`` in ``extensible_kv.reaper``). The failure is reported once, and the next full collection
    after the driver recovers returns the memory."""
    reports: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reports.append(f"{u.exc_type.__name__}: {u.exc_value}"))
    host = _CollectsInside(granularity=G)
    driver = Ledger(host)
    doomed = _tensor(driver)
    base = doomed.base_address

    def too_long(signum: int, frame: object) -> None:
        raise TimeoutError("the sweep did not end within 5 s")

    handler = signal.signal(signal.SIGALRM, too_long)
    try:
        signal.setitimer(signal.ITIMER_REAL, 5)
        del doomed  # its finalizer sweeps at once, outside any section; every unmap is refused
        signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, handler)
    assert [r.split(":")[0] for r in reports] == ["DriverError"], (
        f"host driver refusing every unmap, a full collection in every synchronize: expected the sweep to end with "
        f"one DriverError reported, got {reports}"
    )
    host.refuse = False
    gc.collect()
    left = driver.outstanding().reservations
    assert base not in left, f"expected {base:#x} back after the driver recovered and a full collection; {left}"
