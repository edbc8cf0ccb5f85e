"""The CPU parts of the resize measurement (``integration/resize_run.py``): the shrink's count, the pass's size,
the token comparison, the checks and the table, and the pass driver against a fake engine."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest

from integration import resize_run as rr


def test_the_shrink_goes_to_a_tenth_of_the_blocks_never_below_the_floor():
    assert rr.shrink_target(35_000, 257) == 3_500
    assert rr.shrink_target(2_000, 257) == 257


def test_one_pass_holds_about_eight_percent_of_the_blocks():
    count = rr.request_count(35_000, 16, 1024 + 64)
    assert count == 42 and 0.08 <= count * 68 / 35_000 < 0.085
    assert rr.request_count(100, 16, 1088) == 8 and rr.request_count(10**7, 16, 1088) == 512


def test_tokens_compare_names_the_first_request_and_position_that_differ():
    ref = {"0": [1, 2, 3], "1": [4, 5, 6]}
    assert rr.compare(ref, {"0": [1, 2, 3], "1": [4, 5, 6]})["identical"] is True
    got = rr.compare(ref, {"0": [1, 2, 3], "1": [4, 9, 6]})
    assert got["identical"] is False and got["first"] == {"request": "1", "at": 1, "reference": [5, 6], "other": [9, 6]}
    assert rr.compare(ref, {"0": [1, 2, 3]})["missing"] == ["1"]


def _result(worker_seconds=0.02, identical=True, failed=(), decode=0.998):
    compare = {"identical": identical}
    return {
        "case": {"name": "qwen3-v1"},
        "passes": {
            "never": {"failed": []},
            "resized": {"failed": list(failed), "compare": compare},
            "after": {"failed": [], "compare": compare},
        },
        "resizes": [
            {"from": 35_000, "to": 3_500, "client_seconds": 0.2, "worker_seconds": worker_seconds, "preempted": ["3"]},
            {"from": 3_500, "to": 35_000, "client_seconds": 0.1, "worker_seconds": worker_seconds, "preempted": []},
        ],
        "alloc": {"ok": True, "bytes": 50 << 30},
        "memory": {"before_shrink": 70 << 30, "after_shrink": 15 << 30},
        "decode": {"ratio": decode, "spread": 1.001},
    }


@pytest.mark.parametrize(
    "result, failing",
    [
        (_result(), set()),
        (_result(worker_seconds=0.25), {"rank_resize_under_limit"}),
        (_result(identical=False), {"tokens_identical_resized", "tokens_identical_after"}),
        (_result(failed=["4"]), {"no_failed_request"}),
        (_result(decode=0.99), {"decode_at_target"}),
    ],
)
def test_each_check_fails_only_on_its_own_figure(result, failing):
    checks = rr.checks(result)
    assert {k for k, v in checks.items() if v is False} == failing, checks


def _windows(*seconds):
    return {"windows": [{"tokens": 320, "seconds": s} for s in seconds]}


def test_decode_is_the_median_window_ratio_after_over_before_with_the_spread_beside_it():
    same = _windows(0.1, 1.0, 1.1, 1.2)
    runs = {"before-1": same, "before-2": same, "after": _windows(0.1, 1.0, 1.1, 1.32)}
    got = rr.decode_ratio(runs)
    assert got["spread"] == pytest.approx(1.0) and got["ratio"] == pytest.approx(1.0)  # one slow window: not the median
    runs["after"] = _windows(0.1, 1.1, 1.21, 1.32)
    assert rr.decode_ratio(runs)["ratio"] == pytest.approx(1 / 1.1)
    runs["after"] = _windows(9.9, 1.0, 1.1, 1.2)  # the first window (tokens made before it began) counts for nothing
    assert rr.decode_ratio(runs)["ratio"] == pytest.approx(1.0)
    assert rr.decode_ratio({"before-2": _windows(1.0)})["ratio"] is None
    with pytest.raises(ValueError, match="windows"):
        rr.decode_ratio({"before-2": _windows(0.1, 1.0, 1.0), "after": _windows(0.1, 1.0)})


def test_the_table_has_a_row_per_case_and_an_error_row_for_a_case_that_failed(tmp_path):
    (tmp_path / "resize").mkdir()
    (tmp_path / "resize" / "qwen3-v1.json").write_text(json.dumps(_result()))
    (tmp_path / "resize" / "qwen3-v2.json").write_text(json.dumps({"case": {"name": "qwen3-v2"}, "error": "Boom"}))
    summary = rr.summarize(tmp_path)
    lines = summary["table"].splitlines()
    assert "| qwen3-v1 | 35000 -> 3500 -> 35000 | 200.0 (20.0) | 100.0 (20.0) | 1 | 56320 | 51200 |" in lines[2]
    assert lines[3].startswith("| qwen3-v2 | error: Boom")
    assert (tmp_path / "resize-table.md").read_text().startswith("| case |")


class FakeEngine:
    """``LLMEngine``'s add_request / step / has_unfinished_requests: each request ends after ``length`` steps."""

    def __init__(self, length=3):
        self.length, self.live = length, {}

    def add_request(self, rid, prompt, params):
        self.live[rid] = [0, list(prompt["prompt_token_ids"][:2])]

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        outs = []
        for rid, entry in list(self.live.items()):
            entry[0] += 1
            if entry[0] == self.length:
                del self.live[rid]
                out = SimpleNamespace(token_ids=entry[1], finish_reason="length")
                outs.append(SimpleNamespace(request_id=rid, finished=True, outputs=[out]))
        return outs


def test_a_pass_runs_its_actions_between_steps_and_the_late_ones_after_it():
    pytest.importorskip("vllm")
    seen = []
    llm = SimpleNamespace(llm_engine=FakeEngine(length=3))
    tokens, failed, steps = rr.drive(
        llm, [[5, 6, 7], [8, 9, 10]], 4, "p", {1: lambda: seen.append(1), 40: lambda: seen.append(40)}
    )
    assert tokens == {"0": [5, 6], "1": [8, 9]} and failed == [] and steps == 3 and seen == [1, 40]


class FakeLLM:
    """The offline ``LLM`` as ``one`` uses it, over ``FakeEngine``, answering the resize names as an engine core at
    ``blocks`` would: records every call."""

    def __init__(self, **kwargs):
        self.blocks, self.calls = 1000, []
        self.llm_engine = FakeEngine(length=60)
        self.llm_engine.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=16))
        self.llm_engine.collective_rpc = self.collective_rpc  # LLMEngine's, where resize_kv_cache calls it

    def apply_model(self, fn):
        self.calls.append("apply_model")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def collective_rpc(self, method, args=()):
        self.calls.append((method, args))
        if method == "extensible_kv_kv_state":
            return [{"num_blocks": self.blocks, "floor_blocks": 257, "free_blocks": self.blocks - 1}]
        if method == "extensible_kv_resize":
            old, self.blocks = self.blocks, args[0]
            return [{"from": old, "to": args[0], "seconds": 0.01, "worker_seconds": 0.005, "preempted": []}]
        return [{"events": []}]


def test_a_case_shrinks_lends_and_grows_back_in_its_second_pass(monkeypatch, tmp_path):
    vllm = pytest.importorskip("vllm")
    from integration import run_case

    made = []
    monkeypatch.setattr(vllm, "LLM", lambda **kw: made.append(FakeLLM(**kw)) or made[-1])
    monkeypatch.setattr(run_case, "_env", lambda args: None)
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.setattr(rr, "used_now", lambda: (500 + made[0].blocks) << 20)  # 1 MiB a block
    lent = []
    monkeypatch.setattr(rr, "run_alloc", lambda n: lent.append(n) or {"ok": True, "bytes": n})
    timed = []
    monkeypatch.setattr(
        run_case, "run_throughput", lambda llm, *a: timed.append(a) or _windows(*[1.0 + 0.1 * len(timed)] * 3)
    )
    path = list(sys.path)
    try:
        result = rr.one(rr.case_named("qwen3-v1"), tmp_path / "out.json")
    finally:
        sys.path[:] = path
    llm = made[0]
    resizes = [c for c in llm.calls if c[0] == "extensible_kv_resize"]
    assert resizes == [("extensible_kv_resize", (257,)), ("extensible_kv_resize", (1000,))]
    assert [r["label"] for r in result["resizes"]] == ["shrink", "grow"] and lent == [int(((1000 - 257) << 20) * 0.9)]
    assert llm.calls.count("reset_prefix_cache") == 3 and result["requests"]["count"] == 8
    assert result["passes"]["resized"]["compare"]["identical"] and result["checks"]["rank_resize_under_limit"]
    assert set(result["memory"]) >= {"before_shrink", "after_shrink", "after_alloc", "before_grow", "after_grow"}
    assert list(result["decode"]["runs"]) == ["before-1", "before-2", "after"] and len(set(timed)) == 1
    assert result["decode"]["ratio"] == pytest.approx(1.2 / 1.3) and result["checks"]["decode_at_target"] is False
