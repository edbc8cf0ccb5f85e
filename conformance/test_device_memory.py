"""Rules of running out of device memory (on every driver: the host driver's is its budget) and of what CUDA graphs
may assume."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from extensible_kv import ExtensibleTensor
from extensible_kv.errors import CommitOutOfMemory

from .helpers import (
    expect,
    expect_bytes,
    expect_equal,
    free_bytes,
    host_kernel,
    kernel_memfds,
    oom_step,
    settle_device,
    shared_pattern,
)


def test_committing_past_the_device_memory_raises_commit_out_of_memory(driver):
    settle_device(driver)
    free, total = driver.mem_info()
    step = oom_step(driver)
    kernel0 = kernel_memfds() if host_kernel(driver) else None
    t = ExtensibleTensor(2 * total // step * step, driver=driver)
    committed = 0
    with pytest.raises(CommitOutOfMemory) as info:
        for _ in range(2 * total // step):
            before = (driver.outstanding(), free_bytes(driver), kernel_memfds() if kernel0 is not None else None)
            t.resize_per_segment_(committed + step, zero_new=False)
            committed += step
            t.segment_view(0)[committed - 4096 : committed].copy_(
                shared_pattern(4096, committed // step, driver.device)
            )
    err = info.value
    expect_equal(
        driver,
        "CommitOutOfMemory (committed, requested)",
        (committed, committed + step),
        (err.committed, err.requested),
    )
    expect(
        str(committed + step) in str(err) and str(committed) in str(err),
        driver,
        "CommitOutOfMemory message",
        "names the sizes asked and kept",
        str(err),
    )
    expect(
        free - 2 * step <= committed <= free,
        driver,
        "bytes committed before the refusal",
        f"between {free - 2 * step} and {free}",
        committed,
    )
    expect_equal(driver, "bytes_per_segment after the refused growth", committed, t.bytes_per_segment)
    after = (driver.outstanding(), free_bytes(driver), kernel_memfds() if kernel0 is not None else None)
    for what, was, now in zip(
        ("reservations, handles and mappings", "mem_info free bytes", "memfds the kernel holds"), before, after
    ):
        expect_equal(driver, f"{what} after the refused growth", was, now)
    for k in range(1, committed // step + 1):
        expect_bytes(
            driver,
            f"the last 4 KiB of growth step {k} after the refused growth",
            t.segment_view(0)[k * step - 4096 : k * step],
            shared_pattern(4096, k, driver.device),
        )
    view = t.segment_view(0)
    view[:4096].fill_(5)
    expect_equal(driver, "a write after the refusal", 5 * 4096, int(view[:4096].sum()))
    del view
    t.close()
    expect_equal(driver, "mem_info free bytes after close()", free, free_bytes(driver))
    if kernel0 is not None:
        expect_equal(driver, "memfds the kernel holds after close()", kernel0, kernel_memfds())


@pytest.mark.drivers("cuda")
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
    expect_bytes(driver, "graph replay after the tensor's last direct reference went", view, torch.ones_like(view))
    del graph, view
    gc.collect()
    expect(ref() is None, driver, "tensor after the view and the graph are gone", "collected", "alive")
