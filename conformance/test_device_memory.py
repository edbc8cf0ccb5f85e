"""Rules that need real device memory: running out of it for real, and what CUDA graphs may assume."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from extensible_kv import ExtensibleTensor
from extensible_kv.errors import CommitOutOfMemory

from .helpers import expect, expect_bytes

pytestmark = pytest.mark.drivers("cuda")

GIB = 1 << 30


def test_committing_past_the_device_memory_raises_commit_out_of_memory(driver):
    free, total = driver.mem_info()
    step = 8 * GIB
    t = ExtensibleTensor(2 * total // step * step, driver=driver)
    committed = 0
    with pytest.raises(CommitOutOfMemory) as info:
        while True:
            t.resize_per_segment_(committed + step, zero_new=False)
            committed += step
    err = info.value
    expect(err.committed == committed and err.requested == committed + step, driver,
           "CommitOutOfMemory (committed, requested)", (committed, committed + step), (err.committed, err.requested))
    expect(str(committed + step) in str(err) and str(committed) in str(err), driver, "CommitOutOfMemory message",
           "names the sizes asked and kept", str(err))
    expect(committed >= free - 2 * step, driver, "bytes committed before the refusal", f">= {free - 2 * step}",
           committed)
    # Still usable: the committed prefix reads and writes, and a smaller growth succeeds.
    view = t.segment_view(0)
    view[:4096].fill_(5)
    expect(int(view[:4096].sum()) == 5 * 4096, driver, "a write after the refusal", 5 * 4096, int(view[:4096].sum()))
    del view
    t.close()


def test_a_view_keeps_captured_graphs_valid_after_the_tensor_is_dropped(driver):
    # Note [CUDA graphs do not keep memory alive]: the graph holds addresses only; a view keeps the memory.
    t = ExtensibleTensor(4 * driver.granularity(), driver=driver)
    t.resize_per_segment_(driver.granularity())
    view = t.segment_view(0)
    ref = weakref.ref(t)
    stream = torch.cuda.Stream(t.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        view.add_(1)
    del t
    gc.collect()
    expect(ref() is not None, driver, "tensor while a view (and the graph) use its memory", "alive", "collected")
    graph.replay()
    driver.synchronize()
    expect_bytes(driver, "graph replay after the tensor's last direct reference went", view,
                 torch.ones_like(view))
    del graph, view
    gc.collect()
    expect(ref() is None, driver, "tensor after the view and the graph are gone", "collected", "alive")
