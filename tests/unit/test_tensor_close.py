"""``ExtensibleTensor.close()`` and ``full_view``: a tensor with live views refuses to close unless forced, a tensor
whose close failed returns its memory when collected, and ``full_view`` refuses a dtype that does not tile the
reservation; each refusal with its whole message."""

from __future__ import annotations

import gc

import pytest
import torch

from extensible_kv.drivers import Ledger
from extensible_kv.drivers.host import HostDriver
from extensible_kv.errors import BusyError, ClosedError, DriverError, InvalidSizeError
from extensible_kv.tensor import ExtensibleTensor

G = 4096


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
    expected = (f"cannot close {shown}: 1 view(s) of its memory are alive; drop them first or pass force=True")
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


def test_full_view_refuses_a_dtype_that_does_not_tile_the_reservation_and_a_closed_tensor():
    tensor, _ = _tensor(2 * G - 2)
    with pytest.raises(InvalidSizeError) as info:
        tensor.full_view(torch.float32)
    expected = f"max_num_bytes={2 * G - 2} is not a whole number of torch.float32 elements of 4 bytes"
    assert str(info.value) == expected, f"full_view(float32): expected {expected!r}, got {info.value}"
    tensor.close()
    with pytest.raises(ClosedError) as info:
        tensor.full_view(torch.uint8)
    assert str(info.value).startswith("full_view on a closed ExtensibleTensor ("), \
        f"full_view after close: expected a ClosedError naming full_view, got {info.value}"


@pytest.mark.parametrize("call,error,message", [
    (lambda t: t.resize_per_segment_(1.5), InvalidSizeError, "nbytes must be an int, got float 1.5"),
    (lambda t: t.resize_per_segment_(0), InvalidSizeError, "resize_per_segment_ needs a positive size, got nbytes=0"),
    (lambda t: t.segment_view(0, "float32"), Exception, "dtype must be a torch.dtype, got str 'float32'"),
])
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
    assert (view.dtype, view.numel()) == (torch.int16, 0), \
        f"segment_view before growth: expected int16 and 0 elements, got {view.dtype}, {view.numel()}"
    del view
    tensor.close()
    with pytest.raises(ClosedError) as info:
        tensor.resize_per_segment_(G)
    assert str(info.value).startswith("resize_per_segment_ on a closed ExtensibleTensor ("), \
        f"resize_per_segment_ after close: expected a ClosedError naming it, got {info.value}"
