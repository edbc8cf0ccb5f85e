"""The pure parts of ``integration/sleep_mode.py`` without a GPU or vLLM: the case list, the rows and verdicts made
from case files (hand-made readings here), the table, and the command line that lists cases."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from integration import sleep_mode
from integration.sleep_mode import GIB, MIB

ROOT = Path(__file__).resolve().parents[1]
TOKENS = [[5, 6, 7], [8, 9, 10]]


def _reading(used_gib: float, kv: dict | None = None, kv_bytes: int = 100 * GIB) -> dict:
    return {
        "used": int(used_gib * GIB),
        "total": 140 * GIB,
        "torch_reserved": 0,
        "kv_ptrs": [4096, 8192],
        "kv": kv,
        "kv_bytes": kv_bytes,
        "nvidia_smi_used": int(used_gib * GIB) + 500 * MIB,
    }


def _kv(released: bool = False, mappings: int = 3) -> dict:
    return {
        "released": released,
        "num_blocks": 1000,
        "bases": [1 << 40],
        "driver_mappings": mappings,
        "driver_reservations": 1,
        "unreleased_handles": 0,
    }


def _tokens(ids=TOKENS, warm_cached=(0, 0)) -> dict:
    return {"token_ids": copy.deepcopy(ids), "num_cached_tokens": [32, 32], "warm_cached_tokens": list(warm_cached)}


def _result(mode: str = "extensible", runner: str = "v1", wake_s: float = 0.5, **changes) -> dict:
    """A complete case file of a good run: 102 GiB in use awake (100 GiB of KV), 1 GiB asleep, 2 GiB after the
    weights-only wake. ``changes``: ``path__to__key=value`` (list indices as numbers) replaced in it."""

    def kv(**k) -> dict | None:
        return _kv(**k) if mode == "extensible" else None

    cycles = [{"sleep_s": 0.8, "wake_s": wake_s, "after_wake": _reading(102.0, kv())} for _ in range(10)]
    case = {
        "model": "qwen3-0.6b-shape",
        "runner": runner,
        "mode": mode,
        "max_model_len": 4096,
        "cycles": 10,
        "seconds": 75,
        "timeout": 300,
        "id": f"qwen3-0.6b-shape-{runner}-{mode}",
    }
    result = {
        "case": case,
        "complete": True,
        "engine_seconds": 40.0,
        "phases": {
            "before": {"tokens": _tokens(), "memory": _reading(102.0, kv())},
            "sleep_wake": {
                "sleep_s": 0.85,
                "asleep": _reading(1.0, kv(released=True)),
                "wake_s": wake_s,
                "woken": _reading(102.0, kv()),
                "tokens": _tokens(),
            },
            "weights_then_kv": {
                "sleep_s": 0.8,
                "asleep": _reading(1.0, kv(released=True)),
                "weights_wake_s": 0.1,
                "weights_woken": _reading(2.0, kv(released=True)),
                "kv_wake_s": 0.4,
                "kv_woken": _reading(102.0, kv()),
                "tokens": _tokens(),
            },
            "cycles": {"cycles": cycles, "tokens": _tokens()},
            "level2": {
                "sleep_s": 0.3,
                "asleep": _reading(0.8, kv(released=True)),
                "wake_s": 0.5,
                "woken": _reading(102.0, kv()),
                "tokens": _tokens(),
            },
        },
    }
    for path, value in changes.items():
        *keys, last = path.split("__")
        target = result
        for k in keys:
            target = target[int(k)] if isinstance(target, list) else target[k]
        target[int(last) if isinstance(target, list) else last] = value
    return result


def test_a_good_case_row_reads_every_phase():
    row = sleep_mode.case_row(_result())
    got = {
        k: row[k]
        for k in (
            "state",
            "freed",
            "tokens_after_wake",
            "tokens_after_kv_wake",
            "tokens_after_cycles",
            "level2_tokens",
            "kv_released_after_weights_wake",
            "cycle_drift",
            "handles_stable",
            "addresses_kept",
            "cached_after_wake",
            "cycle_wake_median_s",
        )
    }
    expected = {
        "state": "complete",
        "freed": 101 * GIB,
        "tokens_after_wake": True,
        "tokens_after_kv_wake": True,
        "tokens_after_cycles": True,
        "level2_tokens": True,
        "kv_released_after_weights_wake": True,
        "cycle_drift": 0,
        "handles_stable": True,
        "addresses_kept": True,
        "cached_after_wake": 0,
        "cycle_wake_median_s": 0.5,
    }
    assert got == expected, f"case_row of a good extensible case: expected {expected}, got {got}"


@pytest.mark.parametrize(
    "change,key,expected",
    [
        ({"phases__sleep_wake__tokens__token_ids": [[5, 6, 7], [8, 9, 11]]}, "tokens_after_wake", False),
        ({"phases__weights_then_kv__weights_woken": _reading(101.0, _kv())}, "kv_released_after_weights_wake", False),
        ({"phases__cycles__cycles__9__after_wake": _reading(102.5, _kv())}, "cycle_drift", 512 * MIB),
        ({"phases__cycles__cycles__4__after_wake": _reading(102.0, _kv(mappings=4))}, "handles_stable", False),
        ({"phases__sleep_wake__woken__kv_ptrs": [4096, 12288]}, "addresses_kept", False),
        ({"phases__sleep_wake__tokens__warm_cached_tokens": [16, 0]}, "cached_after_wake", 16),
        ({"phases__level2__tokens__token_ids": [[1, 2, 3], [8, 9, 10]]}, "level2_tokens", False),
    ],
    ids=[
        "tokens-after-wake",
        "kv-woken-with-weights",
        "drift",
        "handle-leak",
        "address-moved",
        "prefix-cache-kept",
        "level2-tokens",
    ],
)
def test_a_case_row_sees_what_went_wrong(change, key, expected):
    row = sleep_mode.case_row(_result(**change))
    assert row[key] == expected, f"case_row after {list(change)}: expected {key}={expected!r}, got {row[key]!r}"


def test_a_case_that_failed_midway_keeps_what_it_measured():
    result = _result()
    for phase in ("weights_then_kv", "cycles", "level2"):
        del result["phases"][phase]
    result.update(complete=False, error={"phase": "weights_then_kv", "error": "RuntimeError: boom"})
    row = sleep_mode.case_row(result)
    got = (row["state"], row["detail"], row["freed"], "cycles" in row)
    assert got == ("failed in weights_then_kv", "RuntimeError: boom", 101 * GIB, False), (
        f"case_row of a case failed in weights_then_kv: expected (state, detail, freed, cycles read) = "
        f"('failed in weights_then_kv', 'RuntimeError: boom', {101 * GIB}, False), got {got}"
    )


def test_a_refused_case_is_a_row_with_the_reason():
    result = {"case": _result()["case"], "refused": "ExtensibleKVUnsupported: a KV connector"}
    row = sleep_mode.case_row(result)
    assert (row["state"], row["detail"]) == ("refused", "ExtensibleKVUnsupported: a KV connector"), row


def test_the_pair_passes_when_extensible_frees_as_much_wakes_as_fast_and_matches():
    summary = sleep_mode.summarize([_result("legacy", wake_s=0.55), _result("extensible", wake_s=0.5)])
    pair = summary["pairs"][0]
    got = (pair["pair"], pair["verdict"], round(pair["wake_ratio"], 3), pair["freed_diff"])
    assert got == ("qwen3-0.6b-shape-v1", "pass", round(0.5 / 0.55, 3), 0), (
        f"a good pair: expected ('qwen3-0.6b-shape-v1', 'pass', {round(0.5 / 0.55, 3)}, 0), got {got}"
    )


@pytest.mark.parametrize(
    "ext_changes,ext_wake,failed",
    [
        ({"phases__sleep_wake__asleep": _reading(1.1, _kv(released=True))}, 0.5, "freed_ok"),
        ({}, 0.6, "wake_ok"),
        (
            {
                "phases__before__tokens__token_ids": [[1, 1, 1], [8, 9, 10]],
                "phases__sleep_wake__tokens__token_ids": [[1, 1, 1], [8, 9, 10]],
                "phases__weights_then_kv__tokens__token_ids": [[1, 1, 1], [8, 9, 10]],
                "phases__cycles__tokens__token_ids": [[1, 1, 1], [8, 9, 10]],
            },
            0.5,
            "tokens_vs_legacy",
        ),
        ({"phases__cycles__cycles__3__after_wake": _reading(102.1, _kv())}, 0.5, "drift_ok"),
    ],
    ids=["frees-less", "wakes-slower", "tokens-differ-from-legacy", "drifts"],
)
def test_the_pair_names_the_check_that_failed(ext_changes, ext_wake, failed):
    summary = sleep_mode.summarize(
        [_result("legacy", wake_s=0.55), _result("extensible", wake_s=ext_wake, **ext_changes)]
    )
    verdict = summary["pairs"][0]["verdict"]
    assert verdict == f"fail: {failed}", f"pair with {failed} broken: expected 'fail: {failed}', got {verdict!r}"


def test_the_table_has_a_row_per_case_a_row_per_pair_and_the_skipped_cases():
    summary = sleep_mode.summarize(
        [_result("legacy"), _result("extensible"), {"case": _result(runner="v2")["case"], "refused": "ValueError: no"}],
        skipped=["tiny-jamba-v1-legacy (budget: 10 s left, about 45 s needed)"],
    )
    table = sleep_mode.render_table(summary)
    rows = [line for line in table.splitlines() if line.startswith("| qwen3") or line.startswith("Not run")]
    firsts = [r.split(" | ")[0].lstrip("| ") for r in rows]
    assert firsts == [
        "qwen3-0.6b-shape-v1-legacy",
        "qwen3-0.6b-shape-v1-extensible",
        "qwen3-0.6b-shape-v2-extensible",
        "qwen3-0.6b-shape-v1",
        "Not run: tiny-jamba-v1-legacy (budget: 10 s left, about 45 s needed)",
    ], table
    assert all(r.count("|") == 17 for r in rows[:3]), f"every case row has 16 cells:\n{table}"


def test_select_matches_ids_by_pattern_or_substring():
    got = [c.id for c in sleep_mode.select(sleep_mode.CASES, ["tiny-jamba", "*v2-legacy"])]
    assert got == ["qwen3-0.6b-shape-v2-legacy", "tiny-jamba-v1-legacy", "tiny-jamba-v1-extensible"], got


def test_the_cases_are_both_modes_of_every_model_and_runner():
    keys = {(c.model, c.runner) for c in sleep_mode.CASES}
    modes = {k: sorted(c.mode for c in sleep_mode.CASES if (c.model, c.runner) == k) for k in keys}
    expected = {
        ("qwen3-0.6b-shape", "v1"): ["extensible", "legacy"],
        ("qwen3-0.6b-shape", "v2"): ["extensible", "legacy"],
        ("tiny-jamba", "v1"): ["extensible", "legacy"],
    }
    assert modes == expected, f"sleep_mode.CASES: expected {expected}, got {modes}"


def test_list_reads_the_output_folder_without_vllm(tmp_path):
    done = _result("legacy")
    (tmp_path / "qwen3-0.6b-shape-v1-legacy.json").write_text(json.dumps(done))
    proc = subprocess.run(
        [sys.executable, "integration/sleep_mode.py", str(tmp_path), "--list"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    states = dict(line.split("\t")[::2] for line in proc.stdout.splitlines())
    got = (proc.returncode, states.get("qwen3-0.6b-shape-v1-legacy"), states.get("tiny-jamba-v1-extensible"))
    assert got == (0, "done", "to run"), (
        f"sleep_mode --list: expected (exit, done case, case to run) = (0, 'done', 'to run'), got {got}; states "
        f"{states}, stderr {proc.stderr[-500:]}"
    )


class _FakeLLM:
    """vLLM's ``LLM`` as the case calls it: sleep and wake by tags, greedy outputs, RPCs on one worker. Memory in
    use: 2 GiB of weights and 100 GiB of KV, each there only while awake."""

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.asleep, self.calls = kwargs, set(), []

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tags))
        self.asleep -= set(tags or ("weights", "kv_cache"))

    def generate(self, batch, params, use_tqdm=False):
        cached = 0 if params.max_tokens == 1 else 32
        return [
            SimpleNamespace(
                outputs=[SimpleNamespace(token_ids=list(range(params.max_tokens)))], num_cached_tokens=cached
            )
            for _ in batch
        ]

    def apply_model(self, fn):
        return [fn(None)]

    def collective_rpc(self, method):
        used = 0.5 + 2 * ("weights" not in self.asleep) + 100 * ("kv_cache" not in self.asleep)
        return [_reading(used)]


def test_a_case_runs_every_phase_in_order_and_writes_a_file_the_summary_reads(tmp_path, monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.LLM = _FakeLLM
    vllm.SamplingParams = SimpleNamespace
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    fake_case = SimpleNamespace(
        reinit_weights=lambda model: 1,
        text_token_limit=lambda config: 100,
        model_config=lambda name: {},
        prompts=lambda vocab: [[3] * 40] * 4,
    )
    monkeypatch.setattr(sleep_mode, "_engine", lambda case, path: ({"model": "m"}, fake_case))
    monkeypatch.setattr(sleep_mode, "nvidia_smi_used", lambda: None)
    case = sleep_mode.CASES[0]
    llms: list = []
    monkeypatch.setattr(vllm, "LLM", lambda **kw: llms.append(_FakeLLM(**kw)) or llms[-1])
    result = sleep_mode.run_one(case, tmp_path / "case.json")
    on_disk = json.loads((tmp_path / "case.json").read_text())
    calls = llms[0].calls
    expected_calls = (
        [("sleep", 1), ("wake_up", None), ("sleep", 1), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]
        + [("sleep", 1), ("wake_up", None)] * case.cycles
        + [("sleep", 2), ("wake_up", None)]
    )
    assert (result["complete"], on_disk == result, calls) == (True, True, expected_calls), (
        f"run_one on a fake engine: expected complete, the file equal to the result and calls {expected_calls}; "
        f"got complete={result['complete']}, file equal={on_disk == result}, calls {calls}, error "
        f"{result.get('error')}"
    )
    row = sleep_mode.case_row(on_disk)
    got = (row["state"], row["freed"], row["kv_released_after_weights_wake"], row["cycles"], row["tokens_after_wake"])
    assert got == ("complete", 102 * GIB, True, case.cycles, True), f"case_row of the fake run: got {got}"
