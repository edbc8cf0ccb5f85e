"""The memory budget a greedy-parity case must keep (``check_memory_budget``), shared by the GPU cases
(``test_greedy_parity.py``) and the CPU checks of the arithmetic itself (``test_budget_check.py``)."""

from __future__ import annotations

from extensible_kv.vllm.sizing import activation_to_come

BUDGET_TOLERANCE = 16 << 20  # allocations made after the final commit (sampler warmup, small workspaces)


def over_budget(memory: dict) -> int:
    """Bytes a run would use beyond gpu_memory_utilization's budget at its worst point: what is in use after warmup,
    plus the profiled activation peak less the cache torch can serve it from (Note [Graph pools are not activation
    cache] in ``extensible_kv.vllm.sizing``). Negative: that much stays unused."""
    unrequested = memory["init_free"] - memory["requested"]  # memory this instance must leave free
    to_come = activation_to_come(memory["profiled_peak_activation"], memory["torch_reusable"])
    return unrequested - memory["free_after_warmup"] + to_come


def check_memory_budget(name: str, legacy: dict, ext: dict) -> None:
    """The extensible run stays inside gpu_memory_utilization's budget, and commits at least as many blocks as
    legacy except where legacy itself went over that budget: any shortfall is at most legacy's overshoot."""
    lm, em = legacy["memory"], ext["memory"]
    ext_over, legacy_over = over_budget(em), over_budget(lm)
    assert ext_over <= BUDGET_TOLERANCE, \
        f"{name}: extensible run uses {ext_over / 2**20:.1f} MiB more than gpu_memory_utilization allows"
    measured = ext["extensible"]["measured"]
    shortfall = (lm["num_gpu_blocks"] - em["num_gpu_blocks"]) * measured["bytes_per_block"]
    assert shortfall <= max(0, legacy_over) + measured["rounding_bound"] + BUDGET_TOLERANCE, (
        f"{name}: extensible committed {em['num_gpu_blocks']} blocks, legacy {lm['num_gpu_blocks']}: a shortfall of "
        f"{shortfall / 2**20:.1f} MiB, more than legacy's own overshoot of its budget ({legacy_over / 2**20:.1f} MiB)")
