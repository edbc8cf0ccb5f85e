"""An int past any size or count (here 10**4300, beyond Python's 4,300-digit limit for str()) given to a public
entry point of the runtime: refused with the entry point's typed error, naming the int by its bit length
(``boundaries.number``), and nothing changed."""

from __future__ import annotations

import pytest

from extensible_kv import ExtensibleKVError, ExtensibleTensor
from extensible_kv.drivers.host import HostDriver

HUGE = 10**4300  # past Python's 4,300-digit limit: str() of it raises ValueError


def _huge_calls():
    from extensible_kv.kv_cache import ExtensibleKVCacheBuffers, KVBuffer
    from extensible_kv.vllm.coordinator import Policy
    from extensible_kv.vllm.resize import check_count

    driver = HostDriver(granularity=4096)
    t = ExtensibleTensor(1 << 20, driver=driver)
    t.resize_per_segment_(4096)
    kv = ExtensibleKVCacheBuffers([KVBuffer("a", 4096, num_segments=1)], 64, driver=driver)
    calls = {
        "ExtensibleTensor": lambda: ExtensibleTensor(HUGE, driver=driver),
        "resize_per_segment_": lambda: t.resize_per_segment_(HUGE),
        "shrink_per_segment_": lambda: t.shrink_per_segment_(-HUGE),
        "segment_view": lambda: t.segment_view(HUGE),
        "ensure_blocks": lambda: kv.ensure_blocks(HUGE),
        "shrink_blocks": lambda: kv.shrink_blocks(HUGE),
        "check_count": lambda: check_count(HUGE, current=10, reserved=100, floor=2),
        "Policy.limit_bytes": lambda: Policy(HUGE),
        "Policy.target_usage": lambda: Policy(1 << 30, target_usage=HUGE),
        "Policy.min_step": lambda: Policy(1 << 30, min_step=HUGE),
    }
    return t, kv, calls


@pytest.mark.parametrize(
    "call",
    ["ExtensibleTensor", "resize_per_segment_", "shrink_per_segment_", "segment_view", "ensure_blocks",
     "shrink_blocks", "check_count", "Policy.limit_bytes", "Policy.target_usage", "Policy.min_step"],
)  # fmt: skip
def test_an_int_of_thousands_of_digits_is_refused_naming_its_size(call):
    # wrong: the refusal's own message formatted the int: ValueError (4,300 digits) or OverflowError (a float)
    t, kv, calls = _huge_calls()
    with pytest.raises(ExtensibleKVError, match="an int of 14285 bits"):
        calls[call]()
    assert (t.state, t.bytes_per_segment, kv.state, kv.num_blocks) == ("open", 4096, "open", 0), call
    kv.close()
    t.close()
