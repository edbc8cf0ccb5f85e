"""CUDA graphs captured over an ExtensibleTensor stay valid after it grows (the reason the base must not move)."""

from __future__ import annotations

import pytest
import torch

from .helpers import expect_bytes, expect_equal, odd_tensor

pytestmark = pytest.mark.drivers("cuda")


def test_graph_captured_before_growth_replays_after_growth(driver):
    t = odd_tensor(driver, num_segments=2)
    n = 4096
    t.resize_per_segment_(n)
    src, dst = t.segment_view(0), t.segment_view(1)
    src.copy_(torch.arange(n, device=t.device, dtype=torch.int64).remainder(251).to(torch.uint8))
    stream = torch.cuda.Stream(t.device)
    stream.wait_stream(torch.cuda.current_stream(t.device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        dst.copy_(src)
        src.add_(1)
    torch.cuda.current_stream(t.device).wait_stream(stream)
    t.resize_per_segment_(t.segment_bytes)  # grow under the captured graph
    expected_src = src.clone()
    graph.replay()
    driver.synchronize()
    expect_bytes(driver, "graph replay after growth: copied segment", dst, expected_src)
    expect_bytes(driver, "graph replay after growth: incremented segment", src, expected_src + 1)
    expect_equal(
        driver, "nonzero bytes where the graph does not write", 0, int(t.segment_view(1)[n:].count_nonzero().item())
    )
    del graph, src, dst, expected_src
    t.close()


def test_graph_captured_over_uncommitted_range_replays_once_committed(driver):
    # vLLM captures graphs over the full-size KV views before the final commit: capture records addresses only.
    t = odd_tensor(driver, num_segments=1, granules_per_segment=3.5)
    t.resize_per_segment_(1024)
    full = t.full_view()
    target = full[: t.segment_bytes]
    stream = torch.cuda.Stream(t.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        target.fill_(7)
    t.resize_per_segment_(t.segment_bytes)
    graph.replay()
    driver.synchronize()
    expect_bytes(
        driver,
        "graph over a then-uncommitted range, replayed after commit",
        t.segment_view(0),
        torch.full((t.segment_bytes,), 7, dtype=torch.uint8, device=t.device),
    )
    del graph, full, target
    t.close()
