"""The reference's own refusals name what was wrong (the operation, the argument, the values), and its accounting
adds up: tensor views, copies, the Ledger's fault injection, the KV buffers' statistics and ``repr``."""

from __future__ import annotations

import copy

import pytest
import torch

from conformance import layouts
from extensible_kv import ExtensibleTensor
from extensible_kv.drivers import Ledger, get_driver
from extensible_kv.kv_cache import ExtensibleKVCacheBuffers, KVBuffer

G = 4096


def _message(call) -> str:
    with pytest.raises(Exception) as info:
        call()
    return f"{type(info.value).__name__}: {info.value}"


def _expect_words(what: str, message: str, *needles: str) -> None:
    missing = [n for n in needles if n not in message]
    assert not missing, f"{what}: expected {missing} in the message, got {message!r}"


def test_segment_view_refusals_name_the_argument_index_and_sizes():
    t = ExtensibleTensor(4 * G, 2, driver="host-4k")
    t.resize_per_segment_(G + 2)  # 4098 bytes: not a whole number of float32 elements, at offset 0
    _expect_words(
        "segment_view('0')", _message(lambda: t.segment_view("0")), "InvalidSizeError", "index must be an int", "'0'"
    )
    _expect_words(
        "segment_view(2)", _message(lambda: t.segment_view(2)), "SegmentIndexError", "segment index 2", "2 segment(s)"
    )
    _expect_words(
        "segment_view(0, float32)",
        _message(lambda: t.segment_view(0, torch.float32)),
        "InvalidSizeError",
        "segment 0 (offset 0, 4098 committed bytes)",
        "torch.float32",
        "4 bytes",
    )
    t.close()
    _expect_words(
        "segment_view(0) after close()",
        _message(lambda: t.segment_view(0)),
        "ClosedError",
        "segment_view on a closed ExtensibleTensor",
        f"{4 * G} bytes",
        "2 segment(s)",
        "driver=host-4k",
    )


def test_repr_says_the_committed_and_segment_bytes_or_closed():
    t = ExtensibleTensor(4 * G, 2, driver="host-4k")
    t.resize_per_segment_(100)
    got = repr(t)
    assert got == f"ExtensibleTensor({4 * G} bytes, 2 segment(s), 100/{2 * G} bytes per segment, driver=host-4k)", (
        f"repr of an open tensor: got {got!r}"
    )
    t.close()
    got = repr(t)
    assert got == f"ExtensibleTensor({4 * G} bytes, 2 segment(s), closed, driver=host-4k)", (
        f"repr of a closed tensor: got {got!r}"
    )


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy], ids=["copy", "deepcopy"])
def test_a_refused_copy_names_the_class_that_owns_the_memory(how):
    t = ExtensibleTensor(G, driver="host-4k")
    kv = ExtensibleKVCacheBuffers([KVBuffer("b0", layouts.PAGE, (layouts.flash_nhd("l0"),))], 4, driver="host-4k")
    try:
        for obj, name in ((t, "ExtensibleTensor"), (kv, "ExtensibleKVCacheBuffers")):
            _expect_words(
                f"{how.__name__}({name})",
                _message(lambda obj=obj: how(obj)),
                "TypeError",
                f"{name} owns virtual memory",
            )
    finally:
        t.close()
        kv.close()


def test_the_ledger_refuses_faults_it_cannot_inject_naming_them():
    ledger = Ledger(get_driver("host-4k"))
    _expect_words(
        "Ledger.fail('mmap')",
        _message(lambda: ledger.fail("mmap")),
        "ValueError",
        "'mmap'",
        "'reserve'",
        "'synchronize'",
    )
    _expect_words(
        "Ledger.fail('map', 0)", _message(lambda: ledger.fail("map", 0)), "ValueError", "nth must be >= 1", "got 0"
    )


def test_kv_stats_add_up_the_buffers_and_name_their_layers():
    buffers = [
        KVBuffer("attn", layouts.PAGE, (layouts.kv_first("a0"), layouts.kv_first("a1"))),
        KVBuffer("nhd", layouts.PAGE, (layouts.flash_nhd("n0"),)),
    ]
    kv = ExtensibleKVCacheBuffers(buffers, 40, driver="host-4k")
    kv.ensure_blocks(3)
    s = kv.stats()
    rows = s.buffers
    got = (s.driver, s.granularity, s.max_num_blocks, s.num_blocks, [(r.name, r.layers, r.num_segments) for r in rows])
    expected = ("host-4k", G, 40, 3, [("attn", ("a0", "a1"), 2), ("nhd", ("n0",), 1)])
    assert got == expected, f"KV stats: expected {expected}, got {got}"
    for field in ("reserved_bytes", "committed_bytes", "backed_bytes", "waste_bytes"):
        total = sum(getattr(r, field) for r in rows)
        assert getattr(s, field) == total, (
            f"KV stats {field}: expected the buffers' sum {total}, got {getattr(s, field)}"
        )
    assert s.reserved_bytes > s.backed_bytes >= s.committed_bytes > 0, (
        f"KV stats: expected reserved > backed >= committed > 0, got {s}"
    )
    assert s.committed_bytes == 3 * 2 * layouts.PAGE, (
        f"KV stats committed_bytes: expected {3 * 2 * layouts.PAGE}, got {s.committed_bytes}"
    )
    d = s.to_dict()
    assert d["num_blocks"] == 3 and d["buffers"][1]["layers"] == ("n0",) and d["backed_bytes"] == s.backed_bytes, (
        f"KV stats to_dict: expected num_blocks 3, the second buffer's layers ('n0',), backed {s.backed_bytes}; got {d}"
    )
    kv.close()
    _expect_words(
        "stats() after close()",
        _message(kv.stats),
        "ClosedError",
        "stats on closed",
        "2 buffer(s)",
        "max_num_blocks=40",
    )
