"""Note [A rollback never strands a view] and the forged-mark part of Note [A checkpoint names a lineage]
(``extensible_kv/tensor.py``), and a tensor resurrected after the collector returned its memory: each refused with
its typed error, nothing changed, no view left over unmapped memory."""

from __future__ import annotations

import dataclasses
import gc

import pytest

from extensible_kv import ExtensibleTensor
from extensible_kv.drivers import Ledger
from extensible_kv.drivers.host import HostDriver
from extensible_kv.errors import BusyError, ClosedError, InvalidArgumentError

G = 4096


@pytest.fixture
def ledger():
    return Ledger(HostDriver(granularity=G, budget_bytes=1 << 20, name="unit-host"))


def _held(t: ExtensibleTensor, ledger: Ledger) -> tuple:
    out = ledger.outstanding()
    return t.state, t.bytes_per_segment, sorted(out.mappings.items()), out.handles


def test_a_rollback_below_a_live_segment_view_is_refused_and_undoes_nothing(ledger):
    t = ExtensibleTensor(8 * G, 2, driver=ledger)
    t.resize_per_segment_(G)
    mark = t.checkpoint()
    t.resize_per_segment_(3 * G)
    view = t.segment_view(1)
    view.fill_(7)
    before = _held(t, ledger)
    with pytest.raises(BusyError, match="segment view") as info:
        t.rollback_to(mark)
    assert _held(t, ledger) == before, (
        f"unit-host driver: rollback_to under a live view was refused ({info.value}) but changed (state, bytes per "
        f"segment, mappings, handles) from {before} to {_held(t, ledger)}"
    )
    assert bool(view.eq(7).all()), "unit-host driver: the view's bytes changed under a refused rollback"
    del view
    assert t.rollback_to(mark) == [], "unit-host driver: rollback_to after the view was dropped reported problems"
    assert t.bytes_per_segment == G, f"unit-host driver: rollback_to kept {t.bytes_per_segment}, expected {G}"
    t.close()


def test_a_rollback_below_what_a_pin_saw_committed_is_refused_and_undoes_nothing(ledger):
    # wrong: the pin's holder (a connector) registered the grown bytes; a rollback unmapped them under it while
    # shrink_per_segment_ and release_physical refused
    t = ExtensibleTensor(16 * G, 1, driver=ledger)
    t.resize_per_segment_(G)
    mark = t.checkpoint()
    t.resize_per_segment_(4 * G)
    t.pin("connector X")
    before = _held(t, ledger)
    with pytest.raises(BusyError, match="connector X") as info:
        t.rollback_to(mark)
    assert _held(t, ledger) == before, (
        f"unit-host: rollback_to({G}) past a pin at {4 * G}: expected nothing undone, got {_held(t, ledger)}"
    )
    assert "nothing was undone" in str(info.value)
    t.unpin("connector X")
    assert t.rollback_to(mark) == [] and t.bytes_per_segment == G  # once unpinned it goes through
    t.close()


def test_views_taken_before_the_checkpoint_never_block_its_rollback(ledger):
    t = ExtensibleTensor(8 * G, 2, driver=ledger)
    t.resize_per_segment_(G)
    early, whole = t.segment_view(0), t.full_view()
    mark = t.checkpoint()
    t.resize_per_segment_(4 * G)
    assert t.rollback_to(mark) == [], "unit-host driver: rollback_to with only earlier views reported problems"
    assert t.bytes_per_segment == G, f"unit-host driver: rollback_to kept {t.bytes_per_segment}, expected {G}"
    del early, whole
    t.close()


@pytest.mark.parametrize(
    "field, value", [("per_segment", 200 * G), ("per_segment", 0), ("mappings", -1), ("depth", 0), ("depth", -3)]
)
def test_an_edited_checkpoint_is_refused_and_changes_nothing(ledger, field, value):
    t = ExtensibleTensor(8 * G, 1, driver=ledger)
    t.resize_per_segment_(2 * G)
    mark = t.checkpoint()
    t.resize_per_segment_(4 * G)
    before = _held(t, ledger)
    with pytest.raises(InvalidArgumentError, match="did not hand out|another lineage") as info:
        t.rollback_to(dataclasses.replace(mark, **{field: value}))
    assert _held(t, ledger) == before, (
        f"unit-host driver: rollback_to a checkpoint with {field}={value} was refused ({info.value}) but changed "
        f"(state, bytes per segment, mappings, handles) from {before} to {_held(t, ledger)}"
    )
    t.close()


def test_a_tensor_resurrected_after_the_collector_returned_its_memory_is_closed(ledger):
    keep = []

    class Resurrecting:
        def __del__(self):
            keep.append(self.t)

    t = ExtensibleTensor(8 * G, 1, driver=ledger)
    t.resize_per_segment_(2 * G)
    holder = Resurrecting()
    holder.t, t.holder = t, holder
    del holder, t
    gc.collect()
    (t,) = keep
    assert ledger.outstanding().mappings == {}, "unit-host driver: the collector did not return the tensor's memory"
    assert t.state == "closed", f"unit-host driver: a resurrected tensor says state={t.state!r}, expected 'closed'"
    for call in (lambda: t.segment_view(0), t.full_view, lambda: t.resize_per_segment_(4 * G), t.stats):
        with pytest.raises(ClosedError):
            call()
    t.close()
