"""Ranks agree on one block count: with tensor parallelism every rank owns its own KV cache, and the scheduler
hands the same block ids to all of them, so all must commit the same number of blocks: the smallest any rank fits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def agree_min(value: int, group: object | None = None) -> int:
    """The minimum of ``value`` over the ranks of ``group`` (an all-reduce MIN; a CPU/gloo group works).

    Without an initialized process group (one process) the value is returned as is.
    """
    if not dist.is_available() or not dist.is_initialized():
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def vllm_cpu_group() -> object | None:
    """vLLM's world CPU group in this worker (every TP/PP rank), or None when vLLM's groups are not set up."""
    try:
        from vllm.distributed import parallel_state
    except ImportError:
        return None
    world = getattr(parallel_state, "_WORLD", None)
    if world is None or world.world_size <= 1:
        return None
    return world.cpu_group
