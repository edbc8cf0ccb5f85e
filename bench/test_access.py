"""No access penalty: VMM-backed memory is as fast to use as memory from torch's allocator.

``test_copy_bandwidth[op-memory]``: a bandwidth-bound operation from one 8 GiB half of a buffer to the other half,
for ``memory`` = ``vmm`` (an ExtensibleTensor with two 8 GiB segments, fully committed) and ``native`` (one
``torch.empty`` buffer: cudaMalloc on a GPU, the CPU allocator on the host), and ``op`` = ``copy``
(``dst.copy_(src)``: cudaMemcpyAsync device-to-device on a GPU) or ``kernel`` (``torch.bitwise_not(src, out=dst)``
over int32: a plain elementwise kernel). Bytes moved = 2 x 8 GiB (read + write). The summary reports
bandwidth(vmm) / bandwidth(native) per op; target >= 0.98. The memory is committed once, outside the rounds.

``test_graph_replay[before_growth|after_growth]`` (CUDA only): a CUDA graph that copies 1 GiB inside an
ExtensibleTensor is captured once, replayed and timed; then the tensor grows by 32 GiB under the captured graph
(base address unchanged) and the same graph is timed again. The summary reports after / before (target: the same,
within 2%). The two cases share one module-scoped graph, so ``before_growth`` must run first (it skips otherwise).
"""

from __future__ import annotations

import pytest
import torch

from extensible_kv import ExtensibleTensor

from ._vmm import close_quietly, record_rate

OPS = ("copy", "kernel")
MEMORIES = ("vmm", "native")


@pytest.mark.benchmark(group="access-copy-8GiB")
@pytest.mark.parametrize("memory", MEMORIES)
@pytest.mark.parametrize("op", OPS)
def test_copy_bandwidth(bench_env, keeper, benchmark, op, memory):
    env, driver = bench_env, bench_env.driver
    n = env.nbytes(8, multiple=4096)  # both halves start 4 KiB-aligned: vectorised kernels on both memories
    env.require_free(2 * n)
    if memory == "vmm":
        t = keeper.keep(ExtensibleTensor(2 * n, num_segments=2, driver=driver))
        t.resize_per_segment_(n, zero_new=False)
        src, dst = t.segment_view(0), t.segment_view(1)
    else:
        buf = keeper.keep(torch.empty(2 * n, dtype=torch.uint8, device=driver.device))
        src, dst = buf[:n], buf[n:]
        del buf
    src.fill_(0x3C)
    dst.fill_(0)
    driver.synchronize()

    if op == "copy":

        def run():
            dst.copy_(src)
            driver.synchronize()
    else:
        src32, dst32 = src.view(torch.int32), dst.view(torch.int32)

        def run():
            torch.bitwise_not(src32, out=dst32)
            driver.synchronize()

    rounds, warmup = env.rounds(gpu=20, host=3), env.rounds(gpu=3, host=1)
    benchmark.pedantic(run, rounds=rounds, warmup_rounds=warmup, iterations=1)

    expected = 0x3C if op == "copy" else 0xFF ^ 0x3C
    edge = min(n, 1 << 20)
    for part in (dst[:edge], dst[n - edge :]):
        assert bool((part == expected).all()), f"{op} over {memory} memory: wrong bytes in the destination"
    del part
    benchmark.extra_info.update(
        env.info(
            f"access/{op}/{memory}", op=op, memory=memory, bytes=n, moved_bytes=2 * n, nominal="8 GiB", rounds=rounds
        )
    )
    record_rate(benchmark, 2 * n)


class _Graph:
    """A captured 1 GiB copy inside an ExtensibleTensor that can later grow by ``grow_bytes`` under it."""

    def __init__(self, env, n: int, grow_bytes: int) -> None:
        self.env, self.n, self.grow_bytes = env, n, grow_bytes
        driver, device = env.driver, env.driver.device
        self.tensor = ExtensibleTensor(2 * n + grow_bytes, driver=driver)
        self.tensor.resize_per_segment_(2 * n, zero_new=False)
        self.base = self.tensor.base_address
        view = self.tensor.segment_view(0)
        self.src, self.dst = view[:n], view[n:]
        del view
        self.src.random_(0, 256)
        self.dst.zero_()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm up on the capture stream, as torch recommends
            self.dst.copy_(self.src)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(self.graph, stream=stream):
            self.dst.copy_(self.src)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        self.grown = False

    def grow(self) -> None:
        if not self.grown:
            self.tensor.resize_per_segment_(2 * self.n + self.grow_bytes, zero_new=False)
            self.env.driver.synchronize()
            self.grown = True
        assert self.tensor.base_address == self.base

    def check(self) -> None:
        """The graph still copies src to dst (every byte) when replayed."""
        self.dst.zero_()
        self.graph.replay()
        self.env.driver.synchronize()
        assert torch.equal(self.dst, self.src), "graph replay did not copy src to dst"

    def close(self) -> None:
        self.env.driver.synchronize()
        del self.graph, self.src, self.dst
        close_quietly(self.tensor)


@pytest.fixture(scope="module")
def graph(bench_env):
    bench_env.require_gpu()
    n, grow_bytes = bench_env.nbytes(1), bench_env.nbytes(32)
    bench_env.require_free(2 * n + grow_bytes)
    state = _Graph(bench_env, n, grow_bytes)
    yield state
    state.close()
    bench_env.release_cached()


@pytest.mark.benchmark(group="graph-replay-1GiB")
@pytest.mark.parametrize("when", ("before_growth", "after_growth"))
def test_graph_replay(bench_env, graph, benchmark, when):
    device = bench_env.driver.device
    if when == "before_growth" and graph.grown:
        pytest.skip("the shared graph's tensor has already grown: run before_growth first")
    if when == "after_growth":
        graph.grow()

    def replay():
        graph.graph.replay()
        torch.cuda.synchronize(device)

    rounds, warmup = 50, 5
    benchmark.pedantic(replay, rounds=rounds, warmup_rounds=warmup, iterations=1)

    graph.check()
    committed = graph.tensor.stats().committed_bytes
    benchmark.extra_info.update(
        bench_env.info(
            f"graph/{when}",
            when=when,
            bytes=graph.n,
            moved_bytes=2 * graph.n,
            committed_bytes=committed,
            grown_bytes=graph.grow_bytes,
            nominal="1 GiB copy, 32 GiB growth",
            rounds=rounds,
        )
    )
    record_rate(benchmark, 2 * graph.n)
