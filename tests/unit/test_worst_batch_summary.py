"""The worst-batch matrix's verdict (``integration.worst_batch_run.summarize``): a case fits only where its
extensible engine ran the load without an error and stayed within the budget."""

from __future__ import annotations

import json

import pytest

from integration import worst_batch_run


def _write(folder, case: str, mode: str, result: dict) -> None:
    (folder / f"{case}-{mode}.json").write_text(json.dumps({"mode": mode, **result}))


def _ran(over: int, errors=()) -> dict:
    return {"num_gpu_blocks": 10, "load": {"highest_over_budget": over, "bursts": 200, "errors": list(errors)}}


@pytest.mark.parametrize(
    "second,expected",
    [
        ({"error": "exit 1", "log_tail": "torch.OutOfMemoryError"}, False),  # the engine died during the load
        (_ran(-5, errors=["burst 7: EngineDeadError"]), False),  # within budget, but a request failed
        (_ran(3), False),  # over the budget
        (_ran(-5), True),
    ],
    ids=["engine-died", "load-error", "over", "fits"],
)
def test_a_case_fits_only_where_its_engine_ran_the_load_within_the_budget(tmp_path, second, expected):
    folder = tmp_path / "worst-batch"
    folder.mkdir()
    _write(folder, "mla-v1", "extensible", _ran(-30))
    _write(folder, "swa-v1", "legacy", _ran(150))
    _write(folder, "swa-v1", "extensible", second)
    summary = worst_batch_run.summarize(folder)
    assert summary["all_within_budget"] is expected, (
        f"summarize with swa-v1 extensible {second}: expected all_within_budget {expected}, got "
        f"{summary['all_within_budget']}\n{summary['table']}"
    )


def test_no_extensible_run_is_no_verdict_of_fitting(tmp_path):
    folder = tmp_path / "worst-batch"
    folder.mkdir()
    _write(folder, "swa-v1", "legacy", _ran(150))
    assert worst_batch_run.summarize(folder)["all_within_budget"] is False


def test_each_component_names_the_batch_that_allocated_most_for_it_beside_the_profile_and_the_load(tmp_path):
    mib = worst_batch_run.MIB
    batches = [
        {"name": "prefill_fresh", "targets": ["activations", "sampler"], "peak_allocated": 90 * mib},
        {"name": "prefill_over_context", "targets": ["activations", "attention_prefill_context"],
         "peak_allocated": 95 * mib, "peak_reserved": 96 * mib},
        {"name": "decode_max_len", "targets": ["attention_decode", "sampler"], "peak_allocated": 10 * mib},
    ]  # fmt: skip
    run = {
        "extensible": {"measured": {"worst_batches": batches, "profiled_peak": 154 * mib}},
        "load": {
            "highest_over_budget": 37 * mib,
            "highest": {"reading": {"torch_allocated": 80 * mib}},  # at rest, after the closest burst
            "highest_allocated": {"peak_allocated": 212 * mib, "burst": {"kind": "long_prompts_twice", "index": 5}},
        },
    }
    path = tmp_path / "swa-v1-extensible.json"
    path.write_text(json.dumps(run))
    got = {r["component"]: (r["batch"], r["batch_allocated_mib"]) for r in worst_batch_run.component_rows(path)}
    want = {
        "activations": ("prefill_over_context", 95.0),  # the larger of the two batches that target it
        "attention_prefill_context": ("prefill_over_context", 95.0),
        "sampler": ("prefill_fresh", 90.0),
        "attention_decode": ("decode_max_len", 10.0),
    }
    assert got == want, f"component_rows: expected {want}, got {got}"
    row = worst_batch_run.component_rows(path)[0]
    side = (row["profiled_mib"], row["generator_step_mib"], row["generator_burst"], row["case_fits"])
    assert side == (154.0, 132.0, "long_prompts_twice #5", False), side  # 212 MiB at its peak, 80 at rest
    assert worst_batch_run.component_rows(tmp_path / "absent-extensible.json") == []
