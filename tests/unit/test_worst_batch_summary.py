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
