"""Note [A checkpoint names a lineage] (``extensible_kv/tensor.py``): ``rollback_to`` takes only a checkpoint of the
same tensor whose growth steps are still there; one taken before (or during) a release, before a recommit, or
before a rollback past it is refused with ``InvalidArgumentError`` and nothing changes."""

from __future__ import annotations

import pytest

from extensible_kv import ExtensibleTensor
from extensible_kv.drivers import Ledger
from extensible_kv.drivers.host import HostDriver
from extensible_kv.errors import InvalidArgumentError

G = 4096


@pytest.fixture
def ledger():
    return Ledger(HostDriver(granularity=G, budget_bytes=1 << 20, name="unit-host"))


def _held(t: ExtensibleTensor, ledger: Ledger) -> tuple:
    out = ledger.outstanding()
    return t.state, t.bytes_per_segment, sorted(out.mappings.items()), out.handles


def _refused(t: ExtensibleTensor, ledger: Ledger, mark, where: str) -> None:
    before = _held(t, ledger)
    with pytest.raises(InvalidArgumentError, match="another lineage|needs a checkpoint") as info:
        t.rollback_to(mark)
    assert _held(t, ledger) == before, (
        f"unit-host driver: rollback_to {where} was refused ({info.value}) but changed (state, bytes per segment, "
        f"mappings, handles) from {before} to {_held(t, ledger)}"
    )


def test_a_checkpoint_taken_while_released_is_refused_after_recommit(ledger):
    t = ExtensibleTensor(8 * G, 2, driver=ledger)
    t.resize_per_segment_(3 * G)
    t.release_physical()
    mark = t.checkpoint()
    t.recommit_physical()
    _refused(t, ledger, mark, "a checkpoint taken while released, after recommit")
    view = t.segment_view(1)
    assert int(view.count_nonzero()) == 0 and view.numel() == 3 * G, (
        f"unit-host driver: after the refused rollback_to, segment 1: expected 3 granules of zeros, got "
        f"{view.numel()} bytes, {int(view.count_nonzero())} nonzero"
    )
    del view
    t.close()


def test_a_checkpoint_from_before_a_release_is_refused_after_recommit(ledger):
    t = ExtensibleTensor(8 * G, 2, driver=ledger)
    t.resize_per_segment_(G)
    mark = t.checkpoint()
    t.resize_per_segment_(2 * G)
    t.release_physical()
    t.recommit_physical()
    _refused(t, ledger, mark, "a checkpoint from before release and recommit")
    t.close()


def test_a_checkpoint_past_which_a_rollback_went_is_refused_after_growing_again(ledger):
    t = ExtensibleTensor(8 * G, 1, driver=ledger)
    first = t.checkpoint()
    t.resize_per_segment_(G)
    second = t.checkpoint()
    t.resize_per_segment_(3 * G)
    assert t.rollback_to(first) == [] and t.bytes_per_segment == 0, "rollback_to the first checkpoint: expected 0"
    t.resize_per_segment_(2 * G)
    _refused(t, ledger, second, "a checkpoint a rollback went past, after growing again")
    assert t.rollback_to(first) == [] and _held(t, ledger) == ("open", 0, [], 0), (
        f"unit-host driver: rollback_to the first checkpoint again: expected open, 0 bytes, nothing mapped, got "
        f"{_held(t, ledger)}"
    )
    t.close()


def test_marks_that_are_not_checkpoints_of_this_tensor_are_refused(ledger):
    t = ExtensibleTensor(4 * G, 1, driver=ledger)
    other = ExtensibleTensor(4 * G, 1, driver=ledger)
    t.resize_per_segment_(2 * G)
    for mark, what in (((0, 0), "a tuple"), (None, "None"), (other.checkpoint(), "another tensor's checkpoint")):
        _refused(t, ledger, mark, what)
    t.close()
    other.close()
