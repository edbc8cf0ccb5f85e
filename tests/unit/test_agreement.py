"""Ranks agree on the smallest committable block count (all-reduce MIN over gloo, two CPU processes), then commit
the same number of blocks each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

RANK = textwrap.dedent("""
    import json, sys
    import torch.distributed as dist
    from extensible_kv.drivers import Ledger
    from extensible_kv.drivers.host import HostDriver
    from extensible_kv.vllm import worker_kv
    from extensible_kv.vllm.agreement import agree_min
    from extensible_kv.vllm.sizing import MemoryState
    from types import SimpleNamespace

    rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    MIB = 1 << 20
    # Rank 1 has 40 MiB less free memory after warmup (another process grew on its GPU, say).
    state = MemoryState(init_free=512 * MIB, requested=400 * MIB, free_now=(460 if rank == 0 else 420) * MIB,
                        kv_backed=0, weights=10 * MIB, profiled_peak=0, again_reserved=0, again_retained=0,
                        served_reserved=0, served_retained=0, bytes_per_block=MIB, rounding_bound=0,
                        capacity_blocks=1000, committed_blocks=1)
    fits = state.blocks()
    agreed = agree_min(fits)
    kv = worker_kv.start(Ledger(HostDriver(granularity=4096)))
    config = SimpleNamespace(num_blocks=400, kv_cache_tensors=[
        SimpleNamespace(size=400 * 64 * 1024, shared_by=["layer0"], block_stride=0)])
    kv.segments = [1]
    kv.allocate(config)
    kv.ensure_blocks(agreed, reason="final size")
    json.dump({"rank": rank, "fits": fits, "agreed": agreed, "committed": kv.buffers.num_blocks}, open(out, "w"))
    kv.buffers.close()
    dist.destroy_process_group()
""")


def test_ranks_commit_the_minimum_block_count(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "reference"), os.environ.get("PYTHONPATH", "")]))
    store = tmp_path / "store"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(store), str(tmp_path / f"r{r}.json")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r}: exit {p.returncode}\n{text[-3000:]}"
    results = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 1)]
    # non-KV = 512 - free; budget = 400 - non-KV: rank 0 fits 348 blocks of 1 MiB, rank 1 fits 308.
    assert [r["fits"] for r in results] == [348, 308], results
    assert [r["agreed"] for r in results] == [308, 308], f"ranks must agree on the minimum, got {results}"
    assert [r["committed"] for r in results] == [308, 308], f"ranks must commit the agreed count, got {results}"


def test_one_process_keeps_its_own_count():
    from extensible_kv.vllm.agreement import agree_min

    assert agree_min(123) == 123
