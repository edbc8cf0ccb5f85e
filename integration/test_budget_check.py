"""The parity cases' memory-budget check at the measured peak (``integration.parity``, Note [Over budget at the
measured peak]) on hand-made case figures: it passes a run that stays inside gpu_memory_utilization at its peak and
fails each way a run can break it (no GPU needed)."""

from __future__ import annotations

from integration.parity import (
    BUDGET_TOLERANCE,
    MIB,
    Case,
    budget_terms,
    check_memory_budget,
    over_budget_measured,
    peak_figures,
    row,
    table,
)

BLOCK = 2 * MIB
TOTAL, INIT_FREE = 140 << 30, 139 << 30
REQUESTED = 126 << 30  # ceil(0.9 x total), counted from the worker's start
BATCH = {
    "max_num_batched_tokens": 16384,
    "max_num_seqs": 8,
    "num_seqs": 8,
    "prompt_tokens": 16384,
    "step_tokens": [16384, 8],
    "cached_tokens": 0,
    "seconds": 0.5,
}


def _case(
    blocks: int, used_at_peak: int, *, released: int = 0, batch: dict | None = None, extensible: bool = True
) -> dict:
    """A case whose peak-shaped batch left ``used_at_peak`` bytes in use since the worker started (``released`` of
    them reserved by torch during the batch and given back before the reading)."""
    after_warmup = {
        "total": TOTAL,
        "init_free": INIT_FREE,
        "requested": REQUESTED,
        "num_gpu_blocks": blocks,
        "free_after_warmup": INIT_FREE - used_at_peak + 900 * MIB,
        "torch_reserved": 17 << 30,
        "kv_backed_after_warmup": blocks * BLOCK if extensible else 0,
        "profiled_peak_activation": 1800 * MIB,
    }
    readings = {
        "batch": dict(batch or BATCH),
        "before_batch": {
            "free": INIT_FREE - used_at_peak + 850 * MIB,
            "torch_reserved": (17 << 30) + 20 * MIB,
            "torch_allocated": 16 << 30,
            "kv_backed": after_warmup["kv_backed_after_warmup"],
        },
        "free_after_batch": INIT_FREE - used_at_peak + released,
        "torch_max_reserved": (17 << 30) + 850 * MIB + released,
        "torch_reserved_after": (17 << 30) + 850 * MIB,
        "torch_max_allocated": 18 << 30,
        "kv_backed": after_warmup["kv_backed_after_warmup"],
        "pools": [],
    }
    memory = after_warmup | {"peak": peak_figures(after_warmup, readings)}
    case = {"memory": memory, "token_ids": [[1, 2]]}
    if extensible:
        case["extensible"] = {
            "measured": {"bytes_per_block": BLOCK, "rounding_bound": 64 * MIB, "torch_growth": 700 * MIB}
        }
    return case


def test_over_budget_is_memory_used_since_the_worker_started_minus_the_budget():
    assert over_budget_measured(init_free=100, free_at_peak=30, requested=60) == 10
    assert over_budget_measured(init_free=100, free_at_peak=50, requested=60) == -10


def test_the_peak_reading_counts_what_torch_reserved_and_released_during_the_batch():
    # 40 MiB reserved at the peak and released before the reading still count as used at the peak.
    case = _case(50_000, REQUESTED + 8 * MIB, released=40 * MIB)
    peak = case["memory"]["peak"]
    assert peak["reserved_released"] == 40 * MIB, peak
    assert peak["over_budget_measured"] == 8 * MIB, f"expected 8 MiB over, got {peak['over_budget_measured'] / MIB}"


def test_the_growth_since_the_final_commit_is_split_into_torch_non_torch_and_kv():
    g = _case(50_000, REQUESTED)["memory"]["peak"]["growth"]
    # Before the batch: torch +20 MiB, 50 MiB more in use (so non-torch +30 MiB); during it: torch +830 MiB,
    # 850 MiB more in use (non-torch +20 MiB); the KV cache did not grow.
    assert g == {
        "before_batch": {"torch_reserved": 20 * MIB, "non_torch": 30 * MIB, "kv": 0},
        "during_batch": {"torch_reserved": 830 * MIB, "non_torch": 20 * MIB, "kv": 0},
    }, g
    t = budget_terms(_case(50_000, REQUESTED))
    assert (t["torch_growth"], t["predicted_torch_growth"], t["non_torch_growth"]) == (
        850 * MIB,
        700 * MIB,
        50 * MIB,
    ), t


def test_the_terms_set_the_served_batchs_allocated_peak_against_the_peak_batchs():
    # the peak batch allocated 18 GiB at most from 16 GiB before it; the sizing's served batch 1.5 GiB
    case = _case(50_000, REQUESTED)
    assert budget_terms(case)["served_allocated"] is None, "a case without the figure reports None"
    case["extensible"]["measured"]["served_allocated"] = 1536 * MIB
    t = budget_terms(case)
    got = (t["served_allocated"], t["batch_allocated"])
    assert got == (1536 * MIB, 2048 * MIB), f"budget_terms (served, batch allocated): expected (1.5, 2) GiB, got {got}"
    legacy = _case(50_000, REQUESTED - 10 * MIB, extensible=False)
    text = table([row(Case("qwen3-0.6b-shape", "v1"), {"legacy": [legacy, legacy], "extensible": case})])
    needle = "the sizing's served batch allocated 1536.0 MiB at its peak, the peak batch 2048.0 MiB"
    assert needle in text, f"parity table: expected {needle!r} in its notes, got {text}"


def test_a_run_inside_the_budget_at_its_peak_with_as_many_blocks_as_legacy_passes():
    legacy = _case(50_000, REQUESTED - 10 * MIB, extensible=False)
    ext = _case(50_000, REQUESTED + BUDGET_TOLERANCE)
    assert check_memory_budget(legacy, ext) == []


def test_an_extensible_run_over_the_budget_at_its_measured_peak_fails():
    legacy = _case(50_000, REQUESTED - 10 * MIB, extensible=False)
    ext = _case(50_000, REQUESTED + BUDGET_TOLERANCE + 1 * MIB)
    problems = check_memory_budget(legacy, ext)
    assert len(problems) == 1 and "17.0 MiB more than gpu_memory_utilization allows" in problems[0], problems


def test_fewer_blocks_than_a_legacy_run_inside_its_budget_fails():
    legacy = _case(50_000, REQUESTED, extensible=False)
    short = 50_000 - (64 * MIB + BUDGET_TOLERANCE) // BLOCK - 1  # just past rounding and tolerance
    problems = check_memory_budget(legacy, _case(short, REQUESTED - (50_000 - short) * BLOCK))
    assert len(problems) == 1 and "more than legacy's own overshoot" in problems[0], problems


def test_fewer_blocks_than_a_legacy_run_over_its_budget_passes_up_to_its_overshoot():
    # Legacy ends 300 MiB over its budget at its peak; the extensible run may commit up to that many bytes fewer.
    legacy = _case(50_000, REQUESTED + 300 * MIB, extensible=False)
    assert check_memory_budget(legacy, _case(50_000 - 150, REQUESTED)) == []
    problems = check_memory_budget(legacy, _case(50_000 - 150 - 41, REQUESTED))
    assert len(problems) == 1 and "shortfall" in problems[0], problems


def test_a_batch_that_was_not_peak_shaped_fails():
    legacy = _case(50_000, REQUESTED, extensible=False)
    for batch in (BATCH | {"prompt_tokens": 16000}, BATCH | {"num_seqs": 4}, BATCH | {"step_tokens": [8192, 8192]}):
        problems = check_memory_budget(legacy, _case(50_000, REQUESTED, batch=batch))
        assert len(problems) == 1 and "extensible peak batch was not peak-shaped" in problems[0], (batch, problems)


def test_a_run_without_a_measured_peak_fails():
    legacy = _case(50_000, REQUESTED, extensible=False)
    ext = _case(50_000, REQUESTED)
    del ext["memory"]["peak"]
    assert check_memory_budget(legacy, ext) == ["no measured peak (extensible run ran without --peak)"]
