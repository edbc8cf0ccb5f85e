"""Lockstep growth of a real KV cache shape.

A KV cache is one buffer per layer; with the K/V split each buffer is two segments that grow together. The shape
here is 64 buffers x 2 segments (and the same with 1 segment), reserved at their final size, each with one KV block
committed (what vLLM commits before graph capture), then grown to 100 GiB in total in one step per buffer: the
timed part is the 64 ``resize_per_segment_(..., zero_new=False)`` calls, set-access included, plus a synchronize.
Target: <= 50 ms on an H200.

The cost of a commit depends on what was freed just before it, so each shape is measured in two states:

- ``fresh``: the previous round's memory was released, then the setup waited ``--bench-settle`` seconds;
- ``after_release``: the setup committed and freed a same-shaped, same-sized cache right before the timed growth.

On the host driver the shape shrinks to 8 buffers and 128 MiB. The number of handles (and set_access calls) a growth
makes is counted once through a Ledger and must equal the runs of new granules: one per segment.
"""

from __future__ import annotations

import math

import pytest

from ._vmm import KVCache, count_growth, plan_growth, record_rate, touch_tensor

KV_BLOCK_BYTES = 32 * 1024  # one block of one layer's K (or V): 16 tokens x 8 KV heads x 128 dims x 2 bytes
STATES = ("fresh", "after_release")
SEGMENTS = (2, 1)


@pytest.mark.benchmark(group="kv-growth-100GiB")
@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("segments", SEGMENTS, ids=[f"{s}seg" for s in SEGMENTS])
def test_kv_growth(bench_env, keeper, benchmark, segments, state):
    env, driver = bench_env, bench_env.driver
    buffers = env.kv_buffers
    unit = math.lcm(env.granularity, KV_BLOCK_BYTES)
    per_segment = max(unit, env.nbytes(100) // (buffers * segments) // unit * unit)
    total = per_segment * buffers * segments
    env.require_free(total)
    live: dict[str, KVCache] = {}

    def build(d) -> KVCache:
        kv = KVCache(d, buffers, segments, per_segment, KV_BLOCK_BYTES)
        try:
            kv.resize_per_segment_(KV_BLOCK_BYTES, zero_new=False)  # the first block, committed before capture
        except BaseException:
            kv.close()
            raise
        return kv

    def setup():
        keeper.close_all()
        if state == "after_release":
            previous = KVCache(driver, buffers, segments, per_segment, KV_BLOCK_BYTES)
            try:
                previous.resize_per_segment_(per_segment, zero_new=False)
                driver.synchronize()
            finally:
                previous.close()
        else:
            env.settle()
        live["kv"] = keeper.keep(build(driver))
        driver.synchronize()

    def grow():
        live["kv"].resize_per_segment_(per_segment, zero_new=False)
        driver.synchronize()

    plan = plan_growth(driver, per_segment, segments, KV_BLOCK_BYTES, per_segment)
    counts = count_growth(driver, build, lambda kv: kv.resize_per_segment_(per_segment, zero_new=False))
    assert counts["create"] == buffers * plan.handles and counts["set_access"] == buffers * plan.runs, (counts, plan)

    rounds = env.rounds(gpu=5, host=2)
    benchmark.pedantic(grow, setup=setup, rounds=rounds, warmup_rounds=0, iterations=1)

    kv = live["kv"]
    assert all(t.stats().committed_bytes == per_segment * segments for t in kv.tensors)
    for t in (kv.tensors[0], kv.tensors[-1]):
        touch_tensor(t)
    grown = (per_segment - KV_BLOCK_BYTES) * buffers * segments
    benchmark.extra_info.update(
        env.info(
            f"kv/{segments}seg/{state}",
            state=state,
            buffers=buffers,
            segments=segments,
            per_segment=per_segment,
            block_bytes=KV_BLOCK_BYTES,
            bytes=total,
            grown_bytes=grown,
            nominal="100 GiB",
            handles=counts["create"],
            set_access=counts["set_access"],
            rounds=rounds,
        )
    )
    record_rate(benchmark, grown)
