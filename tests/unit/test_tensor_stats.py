"""``ExtensibleTensor.stats()``: every field of the accounting, on a worked example at sizes that are not whole
granules."""

from __future__ import annotations

from extensible_kv.drivers import Ledger
from extensible_kv.drivers.host import HostDriver
from extensible_kv.tensor import ExtensibleTensor, TensorStats

G = 4096


def test_stats_account_every_byte_of_a_two_segment_tensor():
    ledger = Ledger(HostDriver(granularity=G))
    # 2 segments of 5 x G - 100 bytes (reserved as 5 granules each), 2 x G + 100 bytes committed per segment:
    # 3 granules backed in each.
    tensor = ExtensibleTensor(10 * G - 200, num_segments=2, driver=ledger)
    try:
        tensor.resize_per_segment_(2 * G + 100)
        got = tensor.stats()
        expected = TensorStats(
            reserved_bytes=10 * G,
            committed_bytes=2 * (2 * G + 100),
            backed_bytes=6 * G,
            bytes_per_segment=2 * G + 100,
            segment_bytes=5 * G - 100,
            num_segments=2,
            granularity=G,
            mappings=len(ledger.outstanding().mappings),
        )
        assert got == expected, f"ExtensibleTensor.stats(): expected {expected}, got {got}"
        assert got.waste_bytes == 6 * G - 2 * (2 * G + 100), f"waste_bytes: got {got.waste_bytes}"
    finally:
        tensor.close()
