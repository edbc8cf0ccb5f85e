"""Bad arguments to ``ExtensibleTensor`` and ``resize_per_segment_``: each refused with a typed error whose whole
message names the argument and the values, before any driver call (nothing is reserved, nothing grows)."""

from __future__ import annotations

import pytest

from extensible_kv.drivers import Ledger
from extensible_kv.drivers.host import HostDriver
from extensible_kv.drivers.records import MAX_BYTES
from extensible_kv.errors import InvalidSizeError
from extensible_kv.tensor import ExtensibleTensor

G = 4096
NAME = "unit-host-4k"

# keyword arguments -> the whole message of the InvalidSizeError
BAD_CONSTRUCTIONS = {
    "max_num_bytes float": (dict(max_num_bytes=4096.0), "max_num_bytes must be an int, got float 4096.0"),
    "num_segments str": (dict(max_num_bytes=2 * G, num_segments="2"), "num_segments must be an int, got str '2'"),
    "alignment bool": (dict(max_num_bytes=2 * G, alignment=True), "alignment must be an int, got bool True"),
    "max_num_bytes 0": (dict(max_num_bytes=0), "max_num_bytes must be positive, got 0"),
    "num_segments -1": (dict(max_num_bytes=2 * G, num_segments=-1), "num_segments must be positive, got -1"),
    "num_segments do not divide": (
        dict(max_num_bytes=3 * G + 1, num_segments=3),
        f"num_segments=3 does not divide max_num_bytes={3 * G + 1} (remainder 1)",
    ),
    "alignment 0": (dict(max_num_bytes=2 * G, alignment=0), "alignment must be positive, got 0"),
    "segment not a multiple of alignment": (
        dict(max_num_bytes=2 * G, num_segments=2, alignment=3000),
        f"segment size {G} (max_num_bytes={2 * G} / num_segments=2) is not a multiple of alignment=3000",
    ),
    "past the address space": (
        dict(max_num_bytes=MAX_BYTES - 1),
        f"max_num_bytes={MAX_BYTES - 1} rounded up to the {NAME} granularity {G} does not fit "
        f"a 64-bit address space (at most {MAX_BYTES - 1} bytes)",
    ),
}


@pytest.mark.parametrize("kwargs,message", BAD_CONSTRUCTIONS.values(), ids=BAD_CONSTRUCTIONS.keys())
def test_a_bad_construction_is_refused_naming_the_argument_and_values_and_reserves_nothing(kwargs, message):
    ledger = Ledger(HostDriver(granularity=G, name=NAME))
    with pytest.raises(InvalidSizeError) as info:
        ExtensibleTensor(driver=ledger, **kwargs)
    assert str(info.value) == message, (
        f"ExtensibleTensor({kwargs}) on HostDriver {NAME}: expected InvalidSizeError {message!r}, got {info.value}"
    )
    assert ledger.calls == [], (
        f"ExtensibleTensor({kwargs}) on HostDriver {NAME}: expected no driver call, got {ledger.calls}"
    )


# (size grown to first, the bad size) -> the whole message; the tensor is 2 segments of 2 granules, alignment 256
BAD_RESIZES = {
    "past the segment capacity": (
        0,
        2 * G + 256,
        f"nbytes={2 * G + 256} per segment exceeds the segment capacity "
        f"{2 * G} (max_num_bytes={4 * G}, num_segments=2)",
    ),
    "not a multiple of the alignment": (0, 100, "nbytes=100 per segment is not a multiple of alignment=256"),
    "negative": (0, -G, f"resize_per_segment_ needs a positive size, got nbytes={-G}"),
    "shrink": (512, 256, "ExtensibleTensor is grow-only: cannot shrink from 512 to 256 bytes per segment"),
}


@pytest.mark.parametrize("first,bad,message", BAD_RESIZES.values(), ids=BAD_RESIZES.keys())
def test_a_bad_resize_is_refused_naming_the_sizes_and_changes_nothing(first, bad, message):
    ledger = Ledger(HostDriver(granularity=G, name=NAME))
    tensor = ExtensibleTensor(4 * G, num_segments=2, driver=ledger, alignment=256)
    try:
        if first:
            tensor.resize_per_segment_(first)
        calls = len(ledger.calls)
        with pytest.raises(InvalidSizeError) as info:
            tensor.resize_per_segment_(bad)
        assert str(info.value) == message, (
            f"resize_per_segment_({bad}) on HostDriver {NAME}: expected InvalidSizeError {message!r}, got {info.value}"
        )
        got = (ledger.calls[calls:], tensor.bytes_per_segment)
        assert got == ([], first), (
            f"resize_per_segment_({bad}) on HostDriver {NAME}: expected no driver call and {first} bytes per "
            f"segment kept, got {got}"
        )
    finally:
        tensor.close()


def test_a_segment_index_out_of_range_is_an_index_error_and_the_projects_typed_error():
    from extensible_kv.errors import InvalidSizeError, SegmentIndexError

    t = ExtensibleTensor(2 * 4096, 2, driver=Ledger(HostDriver(granularity=4096)))
    try:
        for index in (2, -1):
            with pytest.raises(SegmentIndexError) as info:
                t.segment_view(index)
            got = (isinstance(info.value, IndexError), isinstance(info.value, InvalidSizeError), str(info.value))
            assert got[:2] == (True, True) and f"segment index {index} is out of range" in got[2], (
                f"segment_view({index}) of 2 segments: expected an IndexError and InvalidSizeError naming the "
                f"index, got {got}"
            )
        with pytest.raises(ValueError, match="exceeds the segment capacity 4096"):
            t.resize_per_segment_(8192)
    finally:
        t.close()


def test_ensure_blocks_on_legacy_buffers_is_a_no_op_returning_every_block():
    from extensible_kv.kv_cache import ExtensibleKVCacheBuffers, KVBuffer

    ledger = Ledger(HostDriver(granularity=4096))
    kv = ExtensibleKVCacheBuffers([KVBuffer("kv", 4096, num_segments=1)], 8, driver=ledger, legacy=True)
    try:
        calls = len(ledger.calls)
        got = [kv.ensure_blocks(n) for n in (0, 3, 8)]
        assert got == [8, 8, 8] and len(ledger.calls) == calls, (
            f"ensure_blocks(0, 3, 8) on legacy buffers of 8 blocks: expected [8, 8, 8] and no driver call, got "
            f"{got} and {len(ledger.calls) - calls} call(s)"
        )
    finally:
        kv.close()
