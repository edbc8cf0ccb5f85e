"""Which driver call dominates a large commit: create, map and set_access timed one by one.

One 32 GiB (scaled) single-handle commit, each call timed with the device synchronized around it, in two states:
``settled`` (``--bench-settle`` seconds after the last release) and ``after_release`` (right after committing and
releasing a same-sized range). The medians of each call go to ``extra_info["calls"]`` in seconds; the summary
prints them next to the commit figures.
"""

from __future__ import annotations

import statistics
import time

import pytest

from extensible_kv.drivers import protocol_methods

from ._vmm import RawCommit

STATES = ("settled", "after_release")
CALLS = protocol_methods("create", "map", "set_access")  # timed in this order


@pytest.mark.benchmark(group="call-breakdown-32GiB")
@pytest.mark.parametrize("state", STATES)
def test_commit_call_breakdown(bench_env, keeper, benchmark, state):
    env, driver = bench_env, bench_env.driver
    n = env.nbytes(32)
    env.require_free(n)
    timings: dict[str, list[float]] = {c: [] for c in CALLS}
    live: dict[str, int] = {}

    def setup():
        keeper.close_all()
        if state == "after_release":
            warm = RawCommit(driver, n)
            warm.single_handle()
            warm.close()
            driver.synchronize()
        else:
            env.settle()
        live["va"] = driver.reserve(n, env.granularity)

    def commit():
        va = live["va"]
        driver.synchronize()
        t0 = time.perf_counter()
        handle = driver.create(n)
        t1 = time.perf_counter()
        driver.map(va, n, handle, 0)
        t2 = time.perf_counter()
        driver.set_access(va, n)
        driver.synchronize()
        t3 = time.perf_counter()
        for call, seconds in zip(CALLS, (t1 - t0, t2 - t1, t3 - t2)):
            timings[call].append(seconds)
        driver.release(handle)
        driver.unmap(va, n)
        driver.free(va, n)

    benchmark.pedantic(commit, setup=setup, rounds=env.rounds(gpu=3, host=2), iterations=1)
    calls = {c: statistics.median(v) for c, v in timings.items()}
    benchmark.extra_info.update(env.info(f"calls/{state}", bytes=n, calls=calls, dominant=max(calls, key=calls.get)))
    assert all(v > 0 for v in calls.values()), f"{driver.name}: call timings must be positive, got {calls}"
