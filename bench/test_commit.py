"""Commit throughput: how fast growing an ExtensibleTensor makes memory usable.

``test_commit_32gib[path]`` commits 32 GiB (scaled) three ways, side by side in one run:

- ``per_granule``: one handle + one set_access per granule (``RawCommit.per_granule``), the slow baseline;
- ``single_handle``: one handle + one set_access for the whole range (``RawCommit.single_handle``), the limit;
- ``extensible``: ``ExtensibleTensor.resize_per_segment_(n, zero_new=False)`` from empty, one segment.

Each round starts from a fresh reservation built in the untimed setup (which first closes the previous round's
memory and waits ``--bench-settle`` seconds); the timed part is the commit itself plus a device synchronize. The
summary turns the medians into GB/s and into the target ratios (>= 5 TB/s, >= 100x per-granule).

``test_commit_scaling[bytes-segments]`` publishes the curve: commit time vs bytes (1, 8, 32, 100 GiB) and vs segment
count (1, 2, 8, 64). Every segment is grown to half its capacity, so the committed prefixes never touch and each
segment is one run of new granules: handles must equal runs (checked through a Ledger), whatever the byte count.
"""

from __future__ import annotations

import pytest

from extensible_kv import ExtensibleTensor

from ._vmm import RawCommit, count_growth, plan_growth, record_rate, touch, touch_tensor

PATHS = ("per_granule", "single_handle", "extensible")
HOST_PER_GRANULE_LIMIT = 4096  # the host driver checks each map against every mapping: keep n^2 small


@pytest.mark.benchmark(group="commit-32GiB")
@pytest.mark.parametrize("path", PATHS)
def test_commit_32gib(bench_env, keeper, benchmark, path):
    env, driver = bench_env, bench_env.driver
    n = env.nbytes(32)
    g = env.granularity
    if path == "per_granule" and not env.full_scale and n // g > HOST_PER_GRANULE_LIMIT:
        pytest.skip(f"{n // g} granules: the host driver's per-map overlap check makes this quadratic")
    env.require_free(n)
    live: dict[str, object] = {}

    def setup():
        keeper.close_all()
        env.settle()
        live["obj"] = keeper.keep(ExtensibleTensor(n, driver=driver) if path == "extensible" else RawCommit(driver, n))

    def commit():
        obj = live["obj"]
        if path == "per_granule":
            obj.per_granule()
        elif path == "single_handle":
            obj.single_handle()
        else:
            obj.resize_per_segment_(n, zero_new=False)
        driver.synchronize()

    plan = plan_growth(driver, n, 1, 0, n)  # granules: per_granule's handles; handles: single_handle's and ours
    counts = None
    if path == "extensible":  # counted before the timed rounds, so at most one commit is alive at a time
        counts = count_growth(
            driver, lambda d: ExtensibleTensor(n, driver=d), lambda t: t.resize_per_segment_(n, zero_new=False)
        )
        assert counts["create"] == plan.handles and counts["set_access"] == plan.runs, (counts, plan)

    if path == "per_granule":  # about 1 s per round on an H200: few rounds
        rounds, warmup = env.rounds(gpu=2, host=2), env.rounds(gpu=1, host=0)
    else:
        rounds, warmup = env.rounds(gpu=5, host=3), env.rounds(gpu=1, host=0)
    benchmark.pedantic(commit, setup=setup, rounds=rounds, warmup_rounds=warmup, iterations=1)

    obj = live["obj"]
    if path == "extensible":
        assert obj.stats().committed_bytes == n
        touch_tensor(obj)
        handles, set_access = counts["create"], counts["set_access"]
    else:
        expected = plan.granules if path == "per_granule" else plan.handles
        assert obj.creates == expected, (obj.creates, expected, plan)
        touch(driver, obj.va, n)
        handles, set_access = obj.creates, obj.set_access_calls
    benchmark.extra_info.update(
        env.info(
            f"commit/{path}",
            path=path,
            bytes=n,
            nominal="32 GiB",
            handles=handles,
            set_access=set_access,
            granules=n // g,
            rounds=rounds,
        )
    )
    record_rate(benchmark, n)


SCALING_GIB = (1, 8, 32, 100)
SCALING_SEGMENTS = (1, 2, 8, 64)


@pytest.mark.benchmark(group="commit-scaling")
@pytest.mark.parametrize("segments", SCALING_SEGMENTS, ids=[f"{s}seg" for s in SCALING_SEGMENTS])
@pytest.mark.parametrize("gib", SCALING_GIB, ids=[f"{b}GiB" for b in SCALING_GIB])
def test_commit_scaling(bench_env, keeper, benchmark, gib, segments):
    env, driver = bench_env, bench_env.driver
    g = env.granularity
    per_segment = max(g, env.nbytes(gib) // segments // g * g)
    segment_bytes = 2 * per_segment  # prefixes never touch: one run of new granules per segment
    n = per_segment * segments
    env.require_free(n)
    live: dict[str, ExtensibleTensor] = {}

    def build(d):
        return ExtensibleTensor(segment_bytes * segments, segments, driver=d)

    def setup():
        keeper.close_all()
        env.settle()
        live["t"] = keeper.keep(build(driver))

    def grow():
        live["t"].resize_per_segment_(per_segment, zero_new=False)
        driver.synchronize()

    plan = plan_growth(driver, segment_bytes, segments, 0, per_segment)
    counts = count_growth(driver, build, lambda t: t.resize_per_segment_(per_segment, zero_new=False))
    assert plan.runs == segments, plan
    assert counts["create"] == plan.handles and counts["set_access"] == plan.runs, (counts, plan)

    rounds = env.rounds(gpu=3, host=2)
    benchmark.pedantic(grow, setup=setup, rounds=rounds, warmup_rounds=0, iterations=1)

    t = live["t"]
    assert t.stats().committed_bytes == n
    touch_tensor(t)
    benchmark.extra_info.update(
        env.info(
            f"scale/{gib}GiB/{segments}seg",
            nominal_gib=gib,
            segments=segments,
            bytes=n,
            per_segment=per_segment,
            handles=counts["create"],
            set_access=counts["set_access"],
            runs=plan.runs,
            granules=n // g,
            rounds=rounds,
        )
    )
    record_rate(benchmark, n)
