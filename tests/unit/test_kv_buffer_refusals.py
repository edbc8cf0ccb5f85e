"""Bad input to the KV buffers and their layers: a typed error naming the values, and nothing half-done."""

from __future__ import annotations

import pytest
import torch

from conformance import layouts
from extensible_kv.drivers import Ledger
from extensible_kv.drivers.host import HostDriver
from extensible_kv.errors import ClosedError, CommitError, FailedStateError, InvalidArgumentError, InvalidSizeError
from extensible_kv.kv_cache import ExtensibleKVCacheBuffers, KVBuffer
from extensible_kv.layout import AttentionLayer, LayoutError, Segments


def _layer(name="l0"):
    return layouts.flash_nhd(name)


BAD_BUFFERS = {
    "no_buffers": ([], 10, InvalidSizeError, "ExtensibleKVCacheBuffers needs at least one buffer"),
    "zero_blocks": (
        [KVBuffer("b", layouts.PAGE, (_layer(),))],
        0,
        InvalidSizeError,
        "max_num_blocks must be positive, got 0",
    ),
    "negative_blocks": (
        [KVBuffer("b", layouts.PAGE, (_layer(),))],
        -3,
        InvalidSizeError,
        "max_num_blocks must be positive, got -3",
    ),
    "float_blocks": (
        [KVBuffer("b", layouts.PAGE, (_layer(),))],
        10.0,
        InvalidSizeError,
        "max_num_blocks must be an int, got float 10.0",
    ),
    "duplicate_buffer": (
        [KVBuffer("b", layouts.PAGE, (_layer("x"),)), KVBuffer("b", layouts.PAGE, (_layer("y"),))],
        10,
        InvalidSizeError,
        "duplicate buffer names: ['b']",
    ),
    "duplicate_layer": (
        [KVBuffer("a", layouts.PAGE, (_layer(),)), KVBuffer("b", layouts.PAGE, (_layer(),))],
        10,
        InvalidSizeError,
        "duplicate layer names: ['l0']",
    ),
    "zero_page": (
        [KVBuffer("b", 0, (_layer(),))],
        10,
        InvalidSizeError,
        "buffer b: page_size_bytes must be positive, got 0",
    ),
    "float_page": (
        [KVBuffer("b", 4096.0, num_segments=1)],
        10,
        InvalidSizeError,
        "page_size_bytes of buffer b must be an int, got float 4096.0",
    ),
    "page_too_small": (
        [KVBuffer("b", layouts.PAGE // 2, (_layer(),))],
        10,
        LayoutError,
        f"layer l0 needs {layouts.PAGE} bytes per block, the buffer's page is {layouts.PAGE // 2}",
    ),
    "layouts_disagree": (
        [KVBuffer("b", layouts.PAGE, (_layer("x"), layouts.kv_first("y")))],
        10,
        LayoutError,
        "layers sharing one buffer disagree on segments: x has 1, y has 2",
    ),
    "order_not_a_permutation": (
        [KVBuffer("b", layouts.PAGE, (AttentionLayer("x", lambda b: (b, 2, 16, 128), (0, 1, 2), torch.bfloat16),))],
        10,
        LayoutError,
        "stride order (0, 1, 2) is not a permutation of the 4 dims of the declared shape (10, 2, 16, 128)",
    ),
    "layers_and_segments": (
        [KVBuffer("b", layouts.PAGE, (_layer(),), num_segments=2)],
        10,
        LayoutError,
        "buffer b: give layers or num_segments, not both",
    ),
    "zero_segments": (
        [KVBuffer("b", layouts.PAGE, num_segments=0)],
        10,
        InvalidSizeError,
        "buffer b: num_segments must be positive, got 0",
    ),
    "float_segments": (
        [KVBuffer("b", 4096, num_segments=1.0)],
        10,
        InvalidSizeError,
        "num_segments of buffer b must be an int, got float 1.0",
    ),
    "past_the_address_space": (
        [KVBuffer("b", 2**62, num_segments=1)],
        2,
        InvalidSizeError,
        f"buffer b: max_num_blocks=2 pages of {2**62} bytes do not fit a 64-bit address space "
        f"(at most {2**63 - 1} bytes)",
    ),
}


@pytest.mark.parametrize("buffers,blocks,error,message", BAD_BUFFERS.values(), ids=BAD_BUFFERS.keys())
def test_bad_kv_buffers_raise_and_reserve_nothing(buffers, blocks, error, message):
    ledger = Ledger(HostDriver(granularity=4096))
    with pytest.raises(error) as info:
        ExtensibleKVCacheBuffers(buffers, blocks, driver=ledger)
    assert str(info.value) == message, f"ExtensibleKVCacheBuffers: expected {message!r}, got {str(info.value)!r}"
    assert not ledger.outstanding(), f"ExtensibleKVCacheBuffers({message}): left {ledger.outstanding()}"


def test_the_smallest_buffers_are_accepted_and_segments_divide_the_reservation():
    cache = ExtensibleKVCacheBuffers([KVBuffer("b", 1, num_segments=1)], 1, driver="host-4k")
    assert (cache.num_blocks, cache.max_num_blocks) == (0, 1), (cache.num_blocks, cache.max_num_blocks)
    cache.close()
    got = KVBuffer("b", 4096, num_segments=2).segments(10)
    assert got == Segments(2, 20480) and type(got.pitch) is int, f"2 segments of 10 x 4096 bytes: got {got!r}"


def test_ensure_blocks_without_zeroing_leaves_the_drivers_fresh_bytes():
    cache = ExtensibleKVCacheBuffers([KVBuffer("b", 4096, num_segments=1)], 4, driver="host-4k")
    try:
        cache.ensure_blocks(2, zero_new=False)
        raw = cache.tensor("b").segment_view(0)[: 2 * 4096]
        assert int(raw.count_nonzero()) > 0, "ensure_blocks(zero_new=False) zeroed the new blocks anyway"
        cache.ensure_blocks(4)
        new = cache.tensor("b").segment_view(0)[2 * 4096 : 4 * 4096]
        assert int(new.count_nonzero()) == 0, f"ensure_blocks(zero_new=True): {int(new.count_nonzero())} nonzero bytes"
    finally:
        cache.close()


def test_unknown_layer_and_buffer_names_are_refused_listing_the_known_ones():
    names = [f"l{i:02d}" for i in range(10)]
    cache = ExtensibleKVCacheBuffers(
        [KVBuffer("b", layouts.PAGE, tuple(_layer(n) for n in names))], 10, driver="host-4k"
    )
    try:
        for call, expected in (
            (lambda: cache.layer_views("nope"), f"unknown layer 'nope'; layers: {names[:8]}"),
            (lambda: cache.tensor("nope"), "unknown buffer 'nope'; buffers: ['b']"),
        ):
            with pytest.raises(InvalidSizeError) as info:
                call()
            assert str(info.value) == expected, f"unknown name: expected {expected!r}, got {info.value}"
    finally:
        cache.close()


@pytest.mark.parametrize(
    "blocks,expected",
    [
        (-1, "num_blocks must be non-negative, got -1"),
        (11, "num_blocks=11 exceeds the reserved upper bound max_num_blocks=10"),
        (2.0, "num_blocks must be an int, got float 2.0"),
    ],
)
def test_ensure_blocks_refuses_a_count_outside_the_reservation_naming_it(blocks, expected):
    cache = ExtensibleKVCacheBuffers([KVBuffer("b", layouts.PAGE, (_layer(),))], 10, driver="host-4k")
    try:
        with pytest.raises(InvalidSizeError) as info:
            cache.ensure_blocks(blocks)
        assert str(info.value) == expected, f"ensure_blocks({blocks!r}): expected {expected!r}, got {info.value}"
        assert cache.num_blocks == 0, f"ensure_blocks({blocks!r}) refused: expected 0 blocks, got {cache.num_blocks}"
    finally:
        cache.close()


def test_use_after_close_names_the_operation():
    cache = ExtensibleKVCacheBuffers([KVBuffer("b", layouts.PAGE, (_layer(),))], 10, driver="host-4k")
    tensor = cache.tensor("b")
    cache.close()
    whole = "on closed ExtensibleKVCacheBuffers (1 buffer(s), max_num_blocks=10)"
    for call, op in (
        (lambda: cache.tensor("b"), "tensor"),
        (lambda: cache.layer_views("l0"), "layer views"),
        (lambda: cache.ensure_blocks(5), "ensure_blocks"),
        (lambda: cache.committed_layer_views("l0"), "layer views"),
    ):
        with pytest.raises(ClosedError) as info:
            call()
        assert str(info.value) == f"{op} {whole}", f"{op} after close: expected {op} {whole!r}, got {info.value}"
    with pytest.raises(ClosedError) as info:
        tensor.stats()
    assert str(info.value).startswith("stats on a closed ExtensibleTensor ("), (
        f"ExtensibleTensor.stats() after close: expected a ClosedError naming stats, got {info.value}"
    )


def test_kv_buffers_with_a_buffer_closed_directly_say_failed_and_close_returns_the_rest():
    cache = ExtensibleKVCacheBuffers(
        [KVBuffer("a", layouts.PAGE, (_layer("l0"),)), KVBuffer("b", layouts.PAGE, (_layer("l1"),))],
        10,
        driver="host-4k",
    )
    cache.ensure_blocks(2)
    kept = cache.tensor("b").bytes_per_segment
    cache.tensor("a").close(force=True)
    assert cache.state == "failed", (
        f"KV buffers after tensor('a').close(): expected state 'failed', got {cache.state!r}"
    )
    with pytest.raises(FailedStateError, match=r"buffer\(s\) \['a'\] were closed directly") as info:
        cache.ensure_blocks(3)
    b = cache.tensor("b")
    assert (b.state, b.bytes_per_segment) == ("open", kept), (
        f"ensure_blocks(3) refused ({info.value}): expected 'b' open at {kept} bytes per segment, got {b.state} at "
        f"{b.bytes_per_segment}"
    )
    cache.close()
    assert cache.state == "closed", f"KV buffers after close(): expected 'closed', got {cache.state!r}"


def _kv_first(name: str, first: int, block_major: bool = True) -> AttentionLayer:
    """A ``(first, num_blocks, 8)`` bf16 layer, its blocks in dim 1."""
    return AttentionLayer(name, lambda b: (first, b, 8), (0, 1, 2), torch.bfloat16, block_major=block_major)


def test_the_block_major_re_stride_takes_a_three_dim_kv_first_layout():
    raw = torch.zeros(2 * 4 * 8 * 2, dtype=torch.int8)
    (view,) = _kv_first("kv", 2).views(raw, 4)
    assert (tuple(view.shape), view.stride()) == ((2, 4, 8), (8, 16, 1)), (
        f"block-major (2, 4, 8): expected shape (2, 4, 8) and strides (8, 16, 1), got {view.shape}, {view.stride()}"
    )


def test_the_block_major_re_stride_refuses_a_layout_that_is_not_kv_first_naming_it():
    raw = torch.zeros(3 * 4 * 8 * 2, dtype=torch.int8)
    with pytest.raises(LayoutError) as info:
        _kv_first("three", 3).views(raw, 4)
    expected = "layer three: block-major re-stride needs a (2, num_blocks, ...) layout, got shape (3, 4, 8)"
    assert str(info.value) == expected, f"block-major over (3, 4, 8): expected {expected!r}, got {info.value}"


def test_kv_buffers_whose_growth_could_not_be_undone_refuse_views_and_growth_until_close_returns_everything():
    ledger = Ledger(HostDriver(granularity=4096))
    cache = ExtensibleKVCacheBuffers(
        [KVBuffer("a", layouts.PAGE, (_layer("la"),)), KVBuffer("b", layouts.PAGE, (_layer("lb"),))], 8, driver=ledger
    )
    cache.ensure_blocks(1)
    ledger.fail("zero", 2)  # buffer b's step fails after its map ...
    ledger.fail("unmap", 1)  # ... and its rollback cannot unmap it
    with pytest.raises(CommitError, match="rollback also failed"):
        cache.ensure_blocks(4)
    outcomes = {}
    for what, call in {
        "ensure_blocks": lambda: cache.ensure_blocks(2),
        "raw": lambda: cache.raw("b"),
        "committed_layer_views": lambda: cache.committed_layer_views("la"),
    }.items():
        try:
            call()
            outcomes[what] = "handed out"
        except FailedStateError as exc:
            outcomes[what] = "refused" if "retry close()" in str(exc) else f"message: {exc}"
    refused = dict.fromkeys(("ensure_blocks", "raw", "committed_layer_views"), "refused")
    assert outcomes == refused, (
        f"KV buffers after a growth whose rollback could not unmap: expected growth and views {refused}, got {outcomes}"
    )
    got = (cache.state, cache.num_blocks, cache.stats().state, cache.tensor("a").bytes_per_segment)
    want = ("failed", 0, "failed", layouts.PAGE)
    assert got == want, (
        f"KV buffers after a growth whose rollback could not unmap (buffer a retracted, buffer b "
        f"failed): expected (state, num_blocks, stats state, a's bytes per segment) {want}, got {got}"
    )
    cache.close()
    got = (cache.state, bool(ledger.outstanding()))
    assert got == ("closed", False), (
        f"KV buffers close() from the failed state: expected (closed, nothing outstanding), got {got}"
    )


def _host():
    return HostDriver(granularity=4096)


def test_buffers_given_as_a_generator_are_read_once_and_checked_like_a_list():
    kv = ExtensibleKVCacheBuffers(iter([KVBuffer("k", 4096, num_segments=1)]), 4, driver=_host())
    try:
        assert [b.name for b in kv.buffers] == ["k"] and kv.stats().reserved_bytes > 0, kv.stats()
    finally:
        kv.close()
    with pytest.raises(InvalidSizeError, match="at least one buffer"):
        ExtensibleKVCacheBuffers(iter([]), 4, driver=_host())


@pytest.mark.parametrize("name", [1, ["x"], "", "a\nb", "\x1b[31m"], ids=["int", "list", "empty", "newline", "escape"])
def test_a_buffer_name_that_is_not_printable_text_is_refused_naming_it(name):
    with pytest.raises(InvalidArgumentError, match="name must be non-empty printable text"):
        ExtensibleKVCacheBuffers([KVBuffer("a", 4096, num_segments=1), KVBuffer(name, 4096, num_segments=1)], 4,
                                 driver=_host())  # fmt: skip


@pytest.mark.parametrize("holder", ["\x1b[31m\n" * 1000, "x" * 201, "a\nb"], ids=["escapes", "long", "newline"])
def test_a_pin_holder_that_is_not_one_short_line_is_refused_and_pins_nothing(holder):
    kv = ExtensibleKVCacheBuffers([KVBuffer("k", 4096, num_segments=1)], 4, driver=_host())
    try:
        kv.ensure_blocks(4)
        with pytest.raises(InvalidArgumentError, match="printable text, at most 200 characters"):
            kv.pin(holder)
        kv.shrink_blocks(1)  # nothing was pinned
        assert kv.num_blocks == 1
    finally:
        kv.close()


def _pinned_buffers():
    kv = ExtensibleKVCacheBuffers(
        [KVBuffer(f"b{i}", 2048, num_segments=2) for i in range(3)], 64, driver=HostDriver(granularity=4096)
    )
    kv.ensure_blocks(8)
    kv.pin("connector")
    return kv


def _interrupt_at_line(n: int, function: str, filename: str):
    """A trace function that raises KeyboardInterrupt at the ``n``-th line event of ``function`` in ``filename``."""
    seen = [0]

    def trace(frame, event, arg):
        code = frame.f_code
        if event == "line" and code.co_name == function and code.co_filename.endswith(filename):
            seen[0] += 1
            if seen[0] == n:
                raise KeyboardInterrupt
        return trace

    return trace, seen


def test_an_interrupt_at_any_line_of_unpin_leaves_the_buffers_open_with_every_pin_or_none():
    # wrong: an interrupt after the first buffer's unpin left the buffers failed ("unpinned directly, through
    # tensor(name)"), the pin recorded but gone from one buffer, and every retry refused
    import sys

    n, interrupted = 1, 0
    while True:
        kv = _pinned_buffers()
        trace, seen = _interrupt_at_line(n, "_unpin", "kv_cache.py")
        sys.settrace(trace)
        try:
            kv.unpin("connector")
            done = True
        except KeyboardInterrupt:
            done, interrupted = False, interrupted + 1
        finally:
            sys.settrace(None)
        pins = [kv.tensor(f"b{i}").pinned_by for i in range(3)]
        expected = (((),) * 3, {}) if "connector" not in kv.pinned_by else ((("connector",),) * 3, {"connector": 8})
        got = (kv.state, tuple(pins), kv.pinned_by)
        assert got == ("open", *expected), f"host: unpin interrupted at line {n} of _unpin: got {got}"
        if "connector" in kv.pinned_by:
            kv.unpin("connector")  # a retry goes through
        kv.close()
        if done and seen[0] < n:
            break
        n += 1
    assert interrupted >= 5, f"host: only {interrupted} lines of _unpin were interrupted"


def test_after_an_interrupted_release_the_refusal_names_the_release():
    import sys

    kv = _pinned_buffers()
    kv.unpin("connector")
    calls = [0]  # the second buffer's release is interrupted before it does anything

    def second(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "_release" and frame.f_code.co_filename.endswith("tensor.py"):
            calls[0] += 1
            if calls[0] == 2:
                raise KeyboardInterrupt
        return second

    sys.settrace(second)
    try:
        with pytest.raises(KeyboardInterrupt):
            kv.release_physical()
    finally:
        sys.settrace(None)
    with pytest.raises(
        FailedStateError, match=r"a release or a recommit did not finish: buffer\(s\) \['b0'\] released"
    ):
        kv.ensure_blocks(8)
    with pytest.raises(FailedStateError, match="raw on failed"):
        kv.raw("b0")  # a view of failed buffers is refused like the layer views
    kv.close()


def test_unpin_after_close_is_refused_and_a_holder_of_another_type_is_named():
    kv = _pinned_buffers()
    with pytest.raises(InvalidArgumentError, match=r"unpin\(\[\]\)"):
        kv.unpin([])
    t = kv.tensor("b0")
    kv.close()
    with pytest.raises(ClosedError, match="unpin on a closed"):
        t.unpin("connector")
