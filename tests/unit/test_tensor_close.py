"""``ExtensibleTensor.close()`` and ``full_view``: a tensor with live views refuses to close unless forced (after a
collection, which runs only then), a tensor whose close failed returns its memory when collected, one whose close or
rollback half-failed is in its failed state (refusing views and growth, counting nothing as committed) until close()
is retried, one still open at interpreter exit stays mapped, ``full_view`` refuses a dtype that does not tile the
reservation (each refusal with its whole message), and views are on the driver's device, empty ones included."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import extensible_kv
from conformance.helpers import kernel_granules
from extensible_kv.drivers import Ledger
from extensible_kv.drivers.host import HostDriver
from extensible_kv.errors import BusyError, ClosedError, CommitError, DriverError, FailedStateError, InvalidSizeError
from extensible_kv.tensor import ExtensibleTensor

G = 4096
NAME = "unit-host-4k"


def _tensor(nbytes: int = 2 * G) -> tuple[ExtensibleTensor, Ledger]:
    ledger = Ledger(HostDriver(granularity=G))
    tensor = ExtensibleTensor(nbytes, driver=ledger)
    tensor.resize_per_segment_(G)
    return tensor, ledger


def test_close_refuses_while_a_view_is_alive_and_force_closes_anyway():
    tensor, ledger = _tensor()
    view = tensor.full_view(torch.uint8)
    shown = repr(tensor)
    with pytest.raises(BusyError) as info:
        tensor.close()
    expected = f"cannot close {shown}: 1 view(s) of its memory are alive; drop them first or pass force=True"
    assert str(info.value) == expected, f"close() with a live view: expected {expected!r}, got {info.value}"
    assert not tensor.closed and ledger.outstanding(), "close() refused: expected the tensor still open"
    tensor.close(force=True)
    assert tensor.closed and not ledger.outstanding(), f"close(force=True): left {ledger.outstanding()}"
    del view


def test_close_without_views_needs_no_force():
    tensor, ledger = _tensor()
    tensor.close()
    assert tensor.closed and not ledger.outstanding(), f"close() without views: left {ledger.outstanding()}"


def test_a_tensor_whose_close_failed_returns_its_memory_when_collected():
    tensor, ledger = _tensor()
    ledger.fail("free")
    with pytest.raises(DriverError):
        tensor.close()
    assert ledger.outstanding(), "the injected failure must leave the reservation for the collector"
    del tensor
    gc.collect()
    assert not ledger.outstanding(), f"a tensor whose close failed, collected: left {ledger.outstanding()}"


def _refusals(tensor: ExtensibleTensor) -> dict[str, str]:
    """What views and growth of ``tensor`` do: ``FailedStateError`` naming the call and saying to retry close(),
    or what else they did."""
    outcomes = {}
    for what, call in {
        "segment_view": lambda: tensor.segment_view(0),
        "full_view": tensor.full_view,
        "resize_per_segment_": lambda: tensor.resize_per_segment_(tensor.segment_bytes),
    }.items():
        try:
            call()
            outcomes[what] = "handed out"
        except FailedStateError as exc:
            outcomes[what] = "refused" if what in str(exc) and "retry close()" in str(exc) else f"message: {exc}"
    return outcomes


REFUSED = dict.fromkeys(("segment_view", "full_view", "resize_per_segment_"), "refused")


def test_a_close_that_unmapped_everything_and_failed_to_free_leaves_a_failed_tensor_until_close_is_retried():
    tensor, ledger = _tensor(4 * G)
    base = tensor.base_address
    ledger.fail("free")
    with pytest.raises(DriverError):
        tensor.close()
    got = _refusals(tensor)  # a view now would be of unmapped memory: reading it faults
    assert got == REFUSED, (
        f"HostDriver views and growth after close() unmapped everything and failed at free: "
        f"expected {REFUSED}, got {got}"
    )
    stats = tensor.stats()
    got = (
        tensor.state,
        tensor.closed,
        stats.state,
        stats.committed_bytes,
        stats.backed_bytes,
        stats.mappings,
        tensor.bytes_per_segment,
    )
    assert got == ("failed", False, "failed", 0, 0, 0, 0), (
        f"HostDriver tensor whose close() failed at free: expected (state, closed, stats state, committed, backed, "
        f"mappings, bytes_per_segment) ('failed', False, 'failed', 0, 0, 0, 0), got {got}"
    )
    tensor.close()
    got = (tensor.state, bool(ledger.outstanding()), kernel_granules(base, 4 * G, G))
    assert got == ("closed", False, ["nothing"] * 4), (
        f"HostDriver close() retried from the failed state: expected (closed, nothing outstanding, the kernel maps "
        f"nothing), got {got}"
    )


def test_a_growth_whose_rollback_could_not_unmap_leaves_a_failed_tensor_and_close_returns_everything():
    tensor, ledger = _tensor(4 * G)
    base = tensor.base_address
    ledger.fail("zero")  # the step fails after its maps ...
    ledger.fail("unmap")  # ... and the rollback cannot unmap the first of them
    with pytest.raises(CommitError, match="rollback also failed: unmap"):
        tensor.resize_per_segment_(2 * G)
    got = _refusals(tensor)
    assert got == REFUSED, (
        f"HostDriver views and growth after a rollback that could not unmap: expected {REFUSED}, got {got}"
    )
    stats = tensor.stats()
    got = (tensor.state, stats.state, stats.committed_bytes, stats.mappings)
    want = ("failed", "failed", 0, len(ledger.outstanding().mappings))
    assert got == want and want[3] > 1, (
        f"HostDriver tensor whose rollback could not unmap: expected (state, stats state, committed, mappings on "
        f"record) {want} (the driver's mappings, more than the first), got {got}"
    )
    tensor.close()
    got = (tensor.state, bool(ledger.outstanding()), kernel_granules(base, 4 * G, G))
    assert got == ("closed", False, ["nothing"] * 4), (
        f"HostDriver close() of a tensor whose rollback could not unmap: expected (closed, nothing outstanding, the "
        f"kernel maps nothing), got {got}"
    )


def test_full_view_refuses_a_dtype_that_does_not_tile_the_reservation_and_a_closed_tensor():
    tensor, _ = _tensor(2 * G - 2)
    with pytest.raises(InvalidSizeError) as info:
        tensor.full_view(torch.float32)
    expected = f"max_num_bytes={2 * G - 2} is not a whole number of torch.float32 elements of 4 bytes"
    assert str(info.value) == expected, f"full_view(float32): expected {expected!r}, got {info.value}"
    tensor.close()
    with pytest.raises(ClosedError) as info:
        tensor.full_view(torch.uint8)
    assert str(info.value).startswith("full_view on a closed ExtensibleTensor ("), (
        f"full_view after close: expected a ClosedError naming full_view, got {info.value}"
    )


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda t: t.resize_per_segment_(1.5), InvalidSizeError, "nbytes must be an int, got float 1.5"),
        (
            lambda t: t.resize_per_segment_(0),
            InvalidSizeError,
            "resize_per_segment_ needs a positive size, got nbytes=0",
        ),
        (lambda t: t.segment_view(0, "float32"), Exception, "dtype must be a torch.dtype, got str 'float32'"),
    ],
)
def test_bad_arguments_to_a_tensor_get_their_whole_message_and_change_nothing(call, error, message):
    ledger = Ledger(HostDriver(granularity=G))
    tensor = ExtensibleTensor(2 * G, driver=ledger)
    try:
        with pytest.raises(error) as info:
            call(tensor)
        assert str(info.value) == message, f"expected {message!r}, got {str(info.value)!r}"
        assert tensor.stats().bytes_per_segment == 0, f"a refused call grew the tensor: {tensor.stats()}"
    finally:
        tensor.close()


def test_an_empty_view_has_the_dtype_asked_for_and_a_closed_tensor_refuses_growth_naming_it():
    tensor = ExtensibleTensor(2 * G, driver=Ledger(HostDriver(granularity=G)))
    view = tensor.segment_view(0, torch.int16)
    assert (view.dtype, view.numel()) == (torch.int16, 0), (
        f"segment_view before growth: expected int16 and 0 elements, got {view.dtype}, {view.numel()}"
    )
    del view
    tensor.close()
    with pytest.raises(ClosedError) as info:
        tensor.resize_per_segment_(G)
    assert str(info.value).startswith("resize_per_segment_ on a closed ExtensibleTensor ("), (
        f"resize_per_segment_ after close: expected a ClosedError naming it, got {info.value}"
    )


def test_views_are_on_the_drivers_device_under_another_default_device():
    tensor = ExtensibleTensor(2 * G, driver=HostDriver(granularity=G, name=NAME))
    try:
        with torch.device("meta"):  # a default device for factory calls, as model code sets one
            empty = tensor.segment_view(0, torch.int16)
            tensor.resize_per_segment_(G)
            committed = tensor.segment_view(0)
        got = (empty.device, empty.dtype, empty.numel(), committed.device, committed.numel())
        del empty, committed
        expected = (torch.device("cpu"), torch.int16, 0, torch.device("cpu"), G)
        assert got == expected, (
            f"HostDriver {NAME} segment_view before and after growth under torch.device('meta'): "
            f"expected (device, dtype, numel, device, numel) {expected}, got {got}"
        )
    finally:
        tensor.close()


@contextmanager
def _collections():
    """The garbage collections that start inside the block (``gc.callbacks``), with automatic ones turned off."""
    started: list[int] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(info["generation"])

    enabled = gc.isenabled()
    gc.disable()
    gc.callbacks.append(callback)
    try:
        yield started
    finally:
        gc.callbacks.remove(callback)
        if enabled:
            gc.enable()


def test_close_collects_views_that_only_garbage_keeps_alive_and_then_closes():
    tensor, ledger = _tensor()
    base = tensor.base_address
    with _collections():
        view = tensor.segment_view(0)
        cycle = [view]
        cycle.append(cycle)  # only the cyclic collector frees the view now
        del view, cycle
        tensor.close()
    got = (tensor.closed, bool(ledger.outstanding()), kernel_granules(base, 2 * G, G))
    assert got == (True, False, ["nothing", "nothing"]), (
        f"HostDriver close() with a view only a reference cycle keeps: expected (closed, outstanding, kernel "
        f"granules) (True, False, ['nothing', 'nothing']), got {got}"
    )


def test_close_runs_no_garbage_collection_when_no_view_blocks_it():
    # A full collection costs time in a large process: close() runs one only to drop views that block it.
    for force in (False, True):
        tensor, ledger = _tensor()
        view = tensor.segment_view(0) if force else None
        with _collections() as started:
            tensor.close(force=force)
        got = (started, tensor.closed, bool(ledger.outstanding()))
        assert got == ([], True, False), (
            f"HostDriver close(force={force}) with {int(force)} live view(s): expected (collections, closed, "
            f"outstanding) ([], True, False), got {got}"
        )
        del view


EXIT_CHILD = """
    import atexit

    def report():  # registered before any weakref.finalize exists: runs after the finalizers' exit hook
        rows = []
        with open("/proc/self/maps") as fh:
            for line in fh:
                fields = line.split(None, 5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                rows.append((lo, hi, fields[1], fields[5].strip() if len(fields) == 6 else ""))
        states = []
        for va in bases:
            row = next((r for r in rows if r[0] <= va < r[1]), None)
            states.append("nothing" if row is None else "accessible" if row[2] == "rw-s" and "extensible-kv" in row[3]
                          else row[2])
        print(" ".join(states), flush=True)

    atexit.register(report)
    bases = []
    from extensible_kv.drivers import Ledger
    from extensible_kv.drivers.host import HostDriver
    from extensible_kv.errors import DriverError
    from extensible_kv.tensor import ExtensibleTensor

    kept_open = ExtensibleTensor(2 * 4096, driver=HostDriver(granularity=4096))
    kept_open.resize_per_segment_(4096)
    ledger = Ledger(HostDriver(granularity=4096))
    close_failed = ExtensibleTensor(2 * 4096, driver=ledger)
    close_failed.resize_per_segment_(4096)
    ledger.fail("unmap")
    try:
        close_failed.close()
    except DriverError:
        pass
    bases += [kept_open.base_address, close_failed.base_address]
"""


def test_a_tensor_still_open_at_interpreter_exit_stays_mapped_also_after_a_failed_close():
    # Note [Nothing is unmapped at interpreter exit]. In this process: what close() returns at once.
    ledger = Ledger(HostDriver(granularity=G))
    tensor = ExtensibleTensor(2 * G, driver=ledger)
    tensor.resize_per_segment_(G)
    base = tensor.base_address
    ledger.fail("unmap")
    with pytest.raises(DriverError):
        tensor.close()
    got = [kernel_granules(base, 2 * G, G)]
    tensor.close()
    got.append(kernel_granules(base, 2 * G, G))
    assert got == [["accessible", "reserved"], ["nothing", "nothing"]], (
        f"HostDriver close() failing at unmap, then close() again: expected the kernel to map [['accessible', "
        f"'reserved'], ['nothing', 'nothing']], got {got}"
    )
    # In a child interpreter (running this same package) that exits with both kinds of tensor open.
    package = Path(extensible_kv.__file__).resolve().parents[1]
    path = [str(package), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(EXIT_CHILD)], capture_output=True, text=True, env=env, timeout=120
    )
    got = (proc.returncode, proc.stdout.strip())
    assert got == (0, "accessible accessible"), (
        f"HostDriver tensors open at interpreter exit (one never closed, one whose close failed): expected exit 0 "
        f"with the kernel mapping both ('accessible accessible'), got {got}; stderr: {proc.stderr[-2000:]}"
    )
