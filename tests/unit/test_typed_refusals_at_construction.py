"""Every public entry point answers bad input with a typed error naming the value (README, Troubleshooting): the
host driver's constructor numbers, the KV buffers' entries and names. A value of the wrong type never reaches
arithmetic or a dict lookup (an untyped ``ValueError``, ``AttributeError`` or ``TypeError: unhashable``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conformance import layouts
from extensible_kv.drivers.host import HostDriver
from extensible_kv.errors import InvalidArgumentError, InvalidSizeError
from extensible_kv.kv_cache import ExtensibleKVCacheBuffers, KVBuffer

G = 4096


@pytest.mark.parametrize("budget", [0, -1, 1.5, True, "1", math.nan, 2**70, np.int64(1 << 20)], ids=repr)
def test_a_host_budget_that_is_not_a_positive_int_is_refused_with_a_typed_error(budget):
    with pytest.raises(InvalidSizeError, match="budget_bytes") as info:
        HostDriver(granularity=G, budget_bytes=budget, name="unit-host")
    assert repr(budget) in str(info.value), f"HostDriver(budget_bytes={budget!r}): the error does not name it"


@pytest.mark.parametrize("granularity", [0, -G, 1000, True, float(G), np.int64(G)], ids=repr)
def test_a_host_granularity_that_is_not_a_page_multiple_int_is_refused_with_a_typed_error(granularity):
    with pytest.raises(InvalidSizeError, match="granularity"):
        HostDriver(granularity=granularity, budget_bytes=1 << 20, name="unit-host")


def _buffers():
    return ExtensibleKVCacheBuffers(
        [KVBuffer("b", layouts.PAGE, (layouts.flash_nhd("l0"),))],
        4,
        driver=HostDriver(granularity=G, budget_bytes=1 << 20, name="unit-host"),
    )


@pytest.mark.parametrize("entry", [("a", 65536), {"name": "a"}, None, "a"], ids=repr)
def test_kv_buffers_refuse_an_entry_that_is_not_a_kv_buffer(entry):
    with pytest.raises(InvalidArgumentError, match="KVBuffer"):
        ExtensibleKVCacheBuffers([entry], 64, driver=HostDriver(granularity=G, budget_bytes=1 << 20, name="unit-host"))


@pytest.mark.parametrize("name", [[], {}, None, 3, b"b"], ids=repr)
def test_kv_buffers_refuse_a_buffer_or_layer_name_that_is_not_a_str(name):
    b = _buffers()
    try:
        for call in (b.tensor, b.layer_views, b.committed_layer_views):
            with pytest.raises(InvalidArgumentError, match="named by a str"):
                call(name)
    finally:
        b.close()
