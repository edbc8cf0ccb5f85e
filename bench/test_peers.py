"""Peers: how long torch takes to make 32 GiB usable, measured in the same run as our commit.

- ``test_peer_torch_default``: ``torch.empty(32 GiB, uint8, device='cuda')`` with torch's default caching allocator,
  in this process. Each round's setup drops the previous tensor and calls ``torch.cuda.empty_cache()`` (then waits
  ``--bench-settle`` s, like our fresh rounds), so every timed round really reaches ``cudaMalloc``.
- ``test_peer_expandable_segments``: the same with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``. The
  allocator's mode is fixed when torch initialises CUDA, so this runs in a subprocess that times its own rounds
  (after one warmup round, with the same empty_cache + settle between rounds) and prints them as JSON. The pytest-
  benchmark timing of this test is the whole subprocess (interpreter start, torch import, CUDA init) and means
  nothing; the real figures are ``extra_info['subprocess_times_s']`` and ``extra_info['subprocess_median_s']``,
  which is what ``extensible_kv_lab.report.benchmarks`` uses. The subprocess also reports whether torch's memory
  snapshot marks the
  big segment expandable; ``False`` fails the test (the environment variable was not honoured).

The summary reports our 32 GiB commit time (``commit/extensible``) as a ratio to each (goal: <= 1). Both are GPU-only.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

from ._vmm import record_rate

_EXPANDABLE = "expandable_segments:True"

_SUBPROCESS = r"""
import json, sys, time
import torch

n, rounds, warmup, index, settle = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                                    float(sys.argv[5]))
dev = torch.device("cuda", index)
torch.cuda.set_device(dev)
torch.empty(1, device=dev)  # CUDA context and allocator initialised outside the timed rounds
torch.cuda.synchronize(dev)
times, expandable, touched = [], None, True
for i in range(warmup + rounds):
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    time.sleep(settle)
    start = time.perf_counter()
    x = torch.empty(n, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize(dev)
    elapsed = time.perf_counter() - start
    if i >= warmup:
        times.append(elapsed)
    if i == 0:
        segments = [s for s in torch.cuda.memory_snapshot() if s.get("total_size", 0) >= n]
        flags = [s.get("is_expandable") for s in segments]
        expandable = None if not flags or None in flags else all(flags)
        x[0] = 0x5A
        x[-1] = 0xC3
        touched = (int(x[0]), int(x[-1])) == (0x5A, 0xC3)
    del x
torch.cuda.synchronize(dev)
torch.cuda.empty_cache()
print(json.dumps({"times_s": times, "expandable": expandable, "touched": touched, "torch": torch.__version__}))
"""


def _conf_has_expandable() -> bool:
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        if "expandable_segments:true" in os.environ.get(name, "").replace(" ", "").lower():
            return True
    return False


@pytest.mark.benchmark(group="peers-32GiB")
def test_peer_torch_default(bench_env, keeper, benchmark):
    env, driver = bench_env, bench_env.driver
    env.require_gpu()
    if _conf_has_expandable():
        pytest.skip("this process runs torch with expandable segments (PYTORCH_[CUDA_]ALLOC_CONF): not the default")
    if torch.cuda.get_allocator_backend() != "native":
        pytest.skip(f"torch's allocator backend is {torch.cuda.get_allocator_backend()!r}, not the default 'native'")
    n = env.nbytes(32)
    env.require_free(n)
    device = driver.device
    held: list[torch.Tensor] = []

    def setup():
        held.clear()
        env.release_cached()  # empty_cache: the next torch.empty must call cudaMalloc again
        env.settle()

    def allocate():
        held.append(torch.empty(n, dtype=torch.uint8, device=device))
        torch.cuda.synchronize(device)

    rounds, warmup = env.rounds(gpu=5, host=1), env.rounds(gpu=1, host=0)
    benchmark.pedantic(allocate, setup=setup, rounds=rounds, warmup_rounds=warmup, iterations=1)

    (x,) = held
    assert x.numel() == n and torch.cuda.memory_reserved(device) >= n
    x[0], x[-1] = 0x5A, 0xC3  # usable: bytes written at both ends read back
    assert (int(x[0]), int(x[-1])) == (0x5A, 0xC3)
    del x
    held.clear()
    benchmark.extra_info.update(
        env.info("peer/torch_default", allocator="default (cudaMalloc)", bytes=n, nominal="32 GiB", rounds=rounds)
    )
    record_rate(benchmark, n)


@pytest.mark.benchmark(group="peers-32GiB")
def test_peer_expandable_segments(bench_env, keeper, benchmark):
    env, driver = bench_env, bench_env.driver
    env.require_gpu()
    n = env.nbytes(32)
    env.require_free(n)
    rounds, warmup = env.rounds(gpu=5, host=1), 1
    index = driver.device.index if driver.device.index is not None else torch.cuda.current_device()
    environ = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=_EXPANDABLE, PYTORCH_ALLOC_CONF=_EXPANDABLE)
    command = [sys.executable, "-c", _SUBPROCESS, str(n), str(rounds), str(warmup), str(index), str(env.settle_s)]
    result: dict[str, object] = {}

    def run():
        proc = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=600, check=False)
        if proc.returncode != 0:
            pytest.fail(
                f"expandable-segments subprocess exited {proc.returncode}:\n{proc.stderr[-4000:]}", pytrace=False
            )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if not lines:
            pytest.fail(
                f"expandable-segments subprocess printed no JSON:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}",
                pytrace=False,
            )
        result.update(json.loads(lines[-1]))

    benchmark.pedantic(run, rounds=1, warmup_rounds=0, iterations=1)

    times = [float(t) for t in result["times_s"]]
    assert len(times) == rounds and all(t > 0 for t in times), result
    assert result["touched"] is True, f"bytes written through torch.empty's tensor did not read back: {result}"
    assert result["expandable"] is not False, f"the subprocess did not use expandable segments: {result}"
    median = statistics.median(times)
    benchmark.extra_info.update(
        env.info(
            "peer/expandable_segments",
            allocator=_EXPANDABLE,
            bytes=n,
            nominal="32 GiB",
            rounds=rounds,
            subprocess_times_s=times,
            subprocess_median_s=median,
            subprocess_min_s=min(times),
            subprocess_expandable=result["expandable"],
            subprocess_torch=result.get("torch"),
            note="the pytest-benchmark stats time the whole subprocess; subprocess_median_s is the figure",
        )
    )
    record_rate(benchmark, n, median)
