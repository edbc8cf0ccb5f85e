"""The parity cases' memory-budget check (``check_memory_budget``) on hand-made case figures: it passes a run that
stays inside gpu_memory_utilization and fails the two ways a run can break it (no GPU needed)."""

from __future__ import annotations

import pytest

from .budget import BUDGET_TOLERANCE, check_memory_budget, over_budget

MIB = 1 << 20
BLOCK = 2 * MIB
INIT_FREE, REQUESTED = 140 << 30, 126 << 30
UNREQUESTED = INIT_FREE - REQUESTED  # what must stay free


def _memory(blocks: int, free_after_warmup: int, peak: int = 1800 * MIB, reusable: int = 100 * MIB) -> dict:
    return {"init_free": INIT_FREE, "requested": REQUESTED, "free_after_warmup": free_after_warmup,
            "profiled_peak_activation": peak, "torch_reusable": reusable, "num_gpu_blocks": blocks}


def _extensible(memory: dict) -> dict:
    return {"memory": memory, "extensible": {"measured": {"bytes_per_block": BLOCK, "rounding_bound": 64 * MIB}}}


def test_over_budget_counts_the_activation_peak_still_to_come():
    m = _memory(1000, free_after_warmup=UNREQUESTED + 1000 * MIB, peak=1800 * MIB, reusable=100 * MIB)
    assert over_budget(m) == -1000 * MIB + 1700 * MIB, f"over_budget({m}): expected {700 * MIB}, got {over_budget(m)}"
    m = _memory(1000, free_after_warmup=UNREQUESTED, peak=50 * MIB, reusable=100 * MIB)
    assert over_budget(m) == 0, f"over_budget with more reusable cache than peak: expected 0, got {over_budget(m)}"


def test_a_run_inside_the_budget_with_as_many_blocks_as_legacy_passes():
    legacy = {"memory": _memory(50_000, free_after_warmup=UNREQUESTED + 1700 * MIB)}
    ext = _extensible(_memory(50_000, free_after_warmup=UNREQUESTED + 1700 * MIB))
    check_memory_budget("inside", legacy, ext)


def test_an_extensible_run_over_the_budget_at_the_activation_peak_fails():
    # After warmup it looks 1 GiB inside the budget, but the peak still to come (1,700 MiB) does not fit.
    legacy = {"memory": _memory(50_000, free_after_warmup=UNREQUESTED + 1700 * MIB)}
    ext = _extensible(_memory(50_000, free_after_warmup=UNREQUESTED + 1024 * MIB))
    with pytest.raises(AssertionError, match="more than gpu_memory_utilization allows"):
        check_memory_budget("over at peak", legacy, ext)


def test_fewer_blocks_than_a_legacy_run_inside_its_budget_fails():
    legacy = {"memory": _memory(50_000, free_after_warmup=UNREQUESTED + 1700 * MIB)}
    short = 50_000 - (64 * MIB + BUDGET_TOLERANCE) // BLOCK - 1  # just past rounding and tolerance
    ext = _extensible(_memory(short, free_after_warmup=UNREQUESTED + 1700 * MIB + (50_000 - short) * BLOCK))
    with pytest.raises(AssertionError, match="more than legacy's own overshoot"):
        check_memory_budget("short", legacy, ext)


def test_fewer_blocks_than_a_legacy_run_over_its_budget_passes_up_to_its_overshoot():
    # Legacy ends 300 MiB over its budget at the peak; the extensible run may commit up to that many bytes fewer.
    legacy = {"memory": _memory(50_000, free_after_warmup=UNREQUESTED + 1400 * MIB)}
    ext = _extensible(_memory(50_000 - 150, free_after_warmup=UNREQUESTED + 1700 * MIB))
    assert over_budget(legacy["memory"]) == 300 * MIB
    check_memory_budget("legacy over", legacy, ext)
