"""The parity logic without a GPU: outcome classification and the determinism control (``integration.parity``), the
case sequence with a fake runner, the table, the throughput JSON, the matrix's selection and resumption, and the GPU
scripts' argument parsing (``run_case --dry-run``, ``matrix --list``) on a machine without vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from extensible_kv_lab.measurements import IntegrationCase
from extensible_kv_lab.parity import (
    DIFFERS,
    EXTENSIBLE_REFUSED,
    FAILED,
    IDENTICAL,
    NONDETERMINISTIC,
    NOT_RUN,
    REFUSED,
    classify,
    classify_with_fallback,
    first_difference,
)
from integration import matrix, parity, run_case
from integration.parity import Case

ROOT = Path(__file__).resolve().parents[1]
A = [[5, 6, 7, 8], [9, 10, 11, 12]]
B = [[5, 6, 7, 8], [9, 10, 99, 12]]


def _run(tokens=None, **extra) -> dict:
    """A run as ``run_case`` writes it: every field of the schema present, ``null`` where it has no value (a built
    engine's ``refused`` is ``null``; a refused one's ``token_ids`` and ``memory`` are)."""
    return {**dict.fromkeys(IntegrationCase.model_fields), "token_ids": tokens, **extra}


# -- outcomes ------------------------------------------------------------------------------------------------------
def test_first_difference_names_the_prompt_and_the_token():
    assert first_difference(A, A) is None
    assert first_difference(A, B) == "prompt 1 first differs at token 2: [11, 12] vs [99, 12]"
    assert first_difference([[1, 2]], [[1, 2, 3]]) == "prompt 0 first differs at token 2: [] vs [3]"
    assert first_difference(A, A[:1]) == "2 vs 1 prompts"


@pytest.mark.parametrize(
    "legacy,ext,outcome,deterministic,identical,needle",
    [
        ([_run(A), _run(A)], _run(A), IDENTICAL, True, True, ""),
        ([_run(A), _run(A)], _run(B), DIFFERS, True, False, "extensible vs legacy: prompt 1 first differs at token 2"),
        ([_run(A)], _run(A), IDENTICAL, None, True, ""),  # one legacy run: determinism not established
        ([_run(A), _run(B)], _run(A), NONDETERMINISTIC, False, None, "legacy runs disagree: prompt 1 first differs"),
        ([_run(A), _run(B)], None, NONDETERMINISTIC, False, None, "legacy runs disagree"),
        ([_run(refused="ValueError: Selected backend")], None, REFUSED, None, None, "Selected backend"),
        (
            [_run(A), _run(A)],
            _run(refused="ExtensibleKVUnsupported: sleep mode"),
            EXTENSIBLE_REFUSED,
            True,
            None,
            "sleep mode",
        ),
        ([_run(A), {"error": "exit 1 after 30 s: boom"}], _run(A), FAILED, None, None, "legacy: exit 1"),
        ([_run(A), _run(A)], {"error": "timed out after 300 s"}, FAILED, True, None, "extensible: timed out"),
        ([_run(A), _run(A)], None, NOT_RUN, True, None, ""),
        ([_run(A), None], _run(A), NOT_RUN, None, None, ""),
        ([], None, NOT_RUN, None, None, ""),
    ],
)
def test_classify(legacy, ext, outcome, deterministic, identical, needle):
    v = classify(legacy, ext)
    assert (v.outcome, v.baseline_deterministic, v.tokens_identical) == (outcome, deterministic, identical), v
    assert needle in v.detail, v


def test_a_nondeterministic_baseline_takes_its_token_verdict_from_batch_invariant_mode():
    runs = {
        "legacy": [_run(A), _run(B)],
        "extensible": _run(A),
        "legacy_bi": [_run(B), _run(B)],
        "extensible_bi": _run(B),
    }
    v = classify_with_fallback(runs)
    assert (v.outcome, v.baseline_deterministic, v.tokens_identical) == (NONDETERMINISTIC, False, True), v
    assert v.detail == (
        "legacy runs disagree: prompt 1 first differs at token 2: [11, 12] vs [99, 12]; batch-invariant mode: identical"
    ), v.detail
    runs["extensible_bi"] = _run(A)
    assert classify_with_fallback(runs).tokens_identical is False
    runs["legacy_bi"] = [_run(refused="ValueError: batch invariance not supported")]
    v = classify_with_fallback(runs)
    assert v.tokens_identical is None and "batch-invariant mode: refused (ValueError: batch invariance" in v.detail
    assert classify_with_fallback({"legacy": [_run(A), _run(A)], "extensible": _run(A)}).outcome == IDENTICAL


# -- the case sequence ---------------------------------------------------------------------------------------------
class FakeRunner:
    """Answers each run from ``answers`` (by mode and batch invariance: a list is consumed run by run)."""

    def __init__(self, **answers):
        self.answers = answers
        self.calls: list[tuple[str, list[str], int]] = []

    def __call__(self, name, args, timeout, budget_cut):
        self.calls.append((name, args, timeout, budget_cut))
        key = args[args.index("--mode") + 1] + ("_bi" if "--batch-invariant" in args else "")
        answer = self.answers[key]
        return answer.pop(0) if isinstance(answer, list) else answer


CASE = Case("qwen3-0.6b-shape", "v1", kv_cache_dtype="fp8", max_model_len=4096, timeout=300)


def test_a_deterministic_baseline_runs_legacy_twice_then_extensible():
    fake = FakeRunner(legacy=_run(A), extensible=_run(A))
    runs = parity.run_parity(CASE, fake)
    assert [c[0] for c in fake.calls] == [
        "qwen3-0.6b-shape-v1-FLASH_ATTN-fp8-b16-legacy",
        "qwen3-0.6b-shape-v1-FLASH_ATTN-fp8-b16-legacy-r2",
        "qwen3-0.6b-shape-v1-FLASH_ATTN-fp8-b16-extensible",
    ]
    args = fake.calls[0][1]
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8" and args[args.index("--block-size") + 1] == "16"
    assert classify_with_fallback(runs).outcome == IDENTICAL


def test_a_nondeterministic_baseline_repeats_the_comparison_in_batch_invariant_mode():
    fake = FakeRunner(legacy=[_run(A), _run(B)], extensible=_run(A), legacy_bi=_run(A), extensible_bi=_run(A))
    runs = parity.run_parity(CASE, fake)
    names = [c[0] for c in fake.calls]
    assert names[3:] == [
        "qwen3-0.6b-shape-v1-FLASH_ATTN-fp8-b16-legacy-bi",
        "qwen3-0.6b-shape-v1-FLASH_ATTN-fp8-b16-legacy-bi-r2",
        "qwen3-0.6b-shape-v1-FLASH_ATTN-fp8-b16-extensible-bi",
    ], names
    assert all("--batch-invariant" in c[1] for c in fake.calls[3:])
    assert not any("--batch-invariant" in c[1] for c in fake.calls[:3])
    v = classify_with_fallback(runs)
    assert (v.outcome, v.tokens_identical) == (NONDETERMINISTIC, True), v


def test_a_combination_vllm_refuses_runs_nothing_more():
    fake = FakeRunner(legacy=_run(refused="ValueError: Model Runner V2 does not yet support: x"))
    runs = parity.run_parity(CASE, fake)
    assert len(fake.calls) == 1 and classify_with_fallback(runs).outcome == REFUSED


def test_no_run_starts_once_the_time_budget_is_spent():
    fake = FakeRunner(legacy=_run(A), extensible=_run(A))
    left = iter([400, 200, None])
    runs = parity.run_parity(CASE, fake, budget=lambda expected: next(left))
    assert [c[2:] for c in fake.calls] == [(300, False), (200, True)], (
        "timeouts: the case's own, then what the budget leaves"
    )
    assert runs["extensible"] is None and classify_with_fallback(runs).outcome == NOT_RUN


def test_clock_gives_what_is_left_and_nothing_once_a_run_no_longer_fits():
    now = [0.0]
    clock = matrix.Clock(500, now=lambda: now[0])
    assert clock(60) == 500
    now[0] = 450.0
    assert clock(60) is None and clock(50) == 50
    assert matrix.Clock(None)(60) == 600


# -- rows, table, throughput ---------------------------------------------------------------------------------------
def _case_json(tokens, blocks, over, *, sensitivity=True, cached=(32, 32)) -> dict:
    peak = {
        "over_budget_measured": over,
        "peak_shaped": True,
        "batch": {
            "prompt_tokens": 16384,
            "max_num_batched_tokens": 16384,
            "num_seqs": 8,
            "max_num_seqs": 8,
            "step_tokens": [16384],
        },
        "growth": {
            "before_batch": {"torch_reserved": 0, "non_torch": 0, "kv": 0},
            "during_batch": {"torch_reserved": 0, "non_torch": 0, "kv": 0},
        },
    }
    return {
        "token_ids": tokens,
        "num_cached_tokens": list(cached),
        "memory": {"num_gpu_blocks": blocks, "peak": peak, "init_free": 10, "requested": 8, "free_after_warmup": 5},
        "extensible": {"measured": {"bytes_per_block": 1 << 20, "rounding_bound": 0, "torch_growth": 0}},
        "sensitivity": {"changed": sensitivity},
    }


def test_row_and_table_report_every_column():
    runs = {
        "legacy": [_case_json(A, 1000, 229 << 20), _case_json(A, 1000, 229 << 20)],
        "extensible": _case_json(A, 1000, -(1 << 20)),
    }
    r = parity.row(CASE, runs)
    assert (
        r["legacy_blocks"],
        r["extensible_blocks"],
        r["baseline_deterministic"],
        r["tokens_identical"],
        r["sensitivity_proven"],
        r["budget_problems"],
    ) == (1000, 1000, True, True, True, []), r
    text = parity.table([r])
    assert (
        "| qwen3-0.6b-shape | v1 | FLASH_ATTN | fp8 | 16 | 1000 | 1000 | yes | yes | +229.0 / -1.0 | yes | "
        "identical |" in text
    ), text
    runs["extensible"] = _case_json(A, 1000, 40 << 20, sensitivity=False, cached=(0, 0))
    r = parity.row(CASE, runs)
    assert r["sensitivity_proven"] is False and len(r["budget_problems"]) == 2, r["budget_problems"]
    assert "identical (budget!)" in parity.table([r])
    assert "must read 2 cached KV blocks per prompt (32 tokens), got [0, 0]" in parity.table([r])


def throughput_run(mode, seconds, engine=80.0, written=0):
    """A ``--throughput`` case file: one window of 25,600 tokens per entry of ``seconds``."""
    rate = 25600 * len(seconds) / sum(seconds) if seconds else 0.0
    return {
        "case": {"model": "llama-8b-shape", "runner": "v2", "mode": mode},
        "engine_seconds": engine,
        "memory": {"num_gpu_blocks": 16384},
        "compile_cache_files_written": written,
        "throughput": {
            "tokens_per_s": rate,
            "num_seqs": 256,
            "steps_per_window": 100,
            "windows": [{"tokens": 25600, "seconds": s} for s in seconds],
        },
    }


def test_throughput_json_is_pytest_benchmark_shaped_with_the_ratio():
    bench = parity.throughput_benchmark(
        [throughput_run("legacy", [3.2] * 3, 80.0)], [throughput_run("extensible", [3.2 / 0.995] * 3, 60.0)]
    )
    assert [b["extra_info"]["key"] for b in bench["benchmarks"]] == ["serve/decode/legacy", "serve/decode/extensible"]
    stats = bench["benchmarks"][1]["stats"]
    assert (
        stats["rounds"] == 3 and stats["median"] == pytest.approx(1 / 7960.0) and stats["ops"] == pytest.approx(7960.0)
    )
    assert bench["ratio"]["decode_tokens_per_s"] == pytest.approx(0.995)
    assert bench["ratio"]["engine_seconds"] == pytest.approx(0.75) and bench["ratio"]["same_block_count"]


def test_decode_ratio_pairs_windows_at_the_same_context_length():
    # The H200's V2 pair (Note [Decode windows are paired]): windows slow down as the context grows, and legacy's
    # second window was slow; taken window by window the runs are within 1%, run median against run median 6% apart.
    legacy = throughput_run("legacy", [1.024, 1.263, 1.227, 1.285, 1.362])
    ext = throughput_run("extensible", [1.028, 1.103, 1.189, 1.277, 1.369])
    ratio = parity.throughput_benchmark([legacy], [ext])["ratio"]
    paired = [l_ / e for l_, e in zip([1.024, 1.263, 1.227, 1.285, 1.362], [1.028, 1.103, 1.189, 1.277, 1.369])]
    assert ratio["decode_window_ratios"] == pytest.approx(paired), ratio
    assert ratio["decode_tokens_per_s"] == pytest.approx(1.285 / 1.277), ratio  # the median pair
    assert ratio["decode_range"] == pytest.approx([1.362 / 1.369, 1.263 / 1.103]), ratio


def test_decode_ratio_refuses_runs_with_different_window_counts():
    with pytest.raises(ValueError, match="legacy timed 3 windows, extensible 2"):
        parity.throughput_benchmark([throughput_run("legacy", [1.0] * 3)], [throughput_run("extensible", [1.0] * 2)])


@pytest.mark.parametrize(
    "legacy_written,ext_written,comparable",
    [(12, 0, False), (0, 12, False), (0, 0, True), (12, 7, True), (None, 0, None), (0, None, None)],
)
def test_start_ratio_is_comparable_only_from_the_same_compile_cache(legacy_written, ext_written, comparable):
    ratio = parity.throughput_benchmark(
        [throughput_run("legacy", [1.0] * 3, 51.0, legacy_written)],
        [throughput_run("extensible", [1.0] * 3, 21.9, ext_written)],
    )["ratio"]
    assert ratio["engine_seconds_comparable"] is comparable, (legacy_written, ext_written, ratio)


def test_run_throughput_runs_legacy_extensible_extensible_legacy_and_pairs_first_with_first():
    case = parity.Throughput("llama-8b-shape", "v1", num_gpu_blocks_override=16384)
    calls = []

    def runner(name, args, timeout, cut):
        calls.append(name.removeprefix(case.id + "-"))
        return {**throughput_run(args[args.index("--mode") + 1], [1.0]), "name": calls[-1]}

    runs = parity.run_throughput(case, runner)
    assert calls == ["legacy", "extensible", "extensible-r2", "legacy-r2"], calls
    got = {m: [r["name"] for r in rs] for m, rs in runs.items()}
    assert got == {"legacy": ["legacy", "legacy-r2"], "extensible": ["extensible", "extensible-r2"]}, got
    files = {f"{case.id}-{r['name']}": r for rs in runs.values() for r in rs}
    read_back = parity.throughput_pair(lambda mode, repeat: files.get(case.run_name(mode, repeat)))
    assert read_back == runs, "read back from files, the same runs in the same order"


def test_two_pairs_cancel_a_drift_that_one_pair_takes_for_a_difference():
    # Every run 2% slower than the one before it, the two modes equally fast: one pair (legacy first) reads 0.98,
    # the order legacy, extensible, extensible, legacy reads 0.98 and 1/0.98 around 1 (Note [Legacy, extensible,
    # extensible, legacy]).
    base = [1.0, 1.1, 1.2]
    run = [[s * 1.02**i for s in base] for i in range(4)]  # in the order the runs ran
    legacy = [throughput_run("legacy", run[0]), throughput_run("legacy", run[3])]
    ext = [throughput_run("extensible", run[1]), throughput_run("extensible", run[2])]
    one = parity.throughput_benchmark(legacy[:1], ext[:1])["ratio"]
    both = parity.throughput_benchmark(legacy, ext)["ratio"]
    assert one["decode_tokens_per_s"] == pytest.approx(1 / 1.02), one
    assert both["pairs"] == 2 and len(both["decode_window_ratios"]) == 6, both
    assert both["decode_tokens_per_s"] == pytest.approx((1 / 1.02 + 1.02) / 2), both  # the even median: the middle two
    assert abs(both["decode_tokens_per_s"] - 1) < abs(one["decode_tokens_per_s"] - 1) / 50, (one, both)


def test_the_start_ratio_is_taken_between_each_modes_last_run():
    legacy = [throughput_run("legacy", [1.0], 51.0, 12), throughput_run("legacy", [1.0], 17.0, 0)]
    ext = [throughput_run("extensible", [1.0], 21.9, 0), throughput_run("extensible", [1.0], 17.85, 0)]
    bench = parity.throughput_benchmark(legacy, ext)
    r = bench["ratio"]
    assert (r["engine_seconds"], r["engine_seconds_comparable"]) == (pytest.approx(17.85 / 17.0), True), r
    assert [b["extra_info"]["runs"] for b in bench["benchmarks"]] == [2, 2]
    with pytest.raises(ValueError, match="2 legacy and 1 extensible runs"):
        parity.throughput_benchmark(legacy, ext[:1])


def test_throughput_lines_say_what_did_not_pair_and_write_the_rest(tmp_path):
    def pair(legacy, ext, second=(None, None)):
        return {"legacy": [legacy, second[0]], "extensible": [ext, second[1]]}

    failed = {"error": "exit 1 after 30 s: CUDA out of memory"}
    pairs = {
        "a": pair(throughput_run("legacy", [1.0] * 4), throughput_run("extensible", [1.0] * 5)),
        "b": pair(throughput_run("legacy", []), throughput_run("extensible", [])),
        "c": pair(throughput_run("legacy", [2.0, 2.0]), None),
        "d": pair(
            throughput_run("legacy", [1.0, 1.2]),
            throughput_run("extensible", [1.1, 1.2]),
            (failed, throughput_run("extensible", [1.0, 1.0])),
        ),
    }  # a second pair that failed: left out
    lines = matrix.throughput_lines(pairs, tmp_path)
    assert (
        lines[0] == "- a: not compared: throughput pair: legacy timed 4 windows, extensible 5; the windows are "
        "compared pairwise"
    ), lines
    assert lines[1].startswith("- b: not compared: throughput pair: legacy timed 0 windows"), lines
    assert lines[2] == "- c: legacy: measured; extensible: not run", lines
    # d: tokens/s from the windows (2 x 25,600 tokens over 2.2 and 2.3 s), the ratio from the pairs (1/1.1, 1)
    assert lines[3].startswith(
        f"- d: decode {51200 / 2.3:.0f} vs {51200 / 2.2:.0f} tokens/s, extensible/legacy "
        f"{(1 / 1.1 + 1) / 2:.3f} (median of 2 paired windows from 1 pair,"
    ), lines
    assert "(ratio 1.00)" in lines[3] and not (tmp_path / "serving-a.json").exists(), lines[3]


# -- running processes ---------------------------------------------------------------------------------------------
def test_run_subprocess_resumes_from_the_json_and_does_not_rerun_a_failure(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        if "--fail" in cmd:
            print("Traceback ...\nRuntimeError: boom", file=kwargs["stdout"], flush=True)
            return subprocess.CompletedProcess(cmd, 1)
        out.write_text(json.dumps({"token_ids": A}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(parity.subprocess, "run", fake_run)
    assert parity.run_subprocess(tmp_path, "ok", ["--x"], 10) == {"token_ids": A}
    assert parity.run_subprocess(tmp_path, "ok", ["--x"], 10) == {"token_ids": A} and len(calls) == 1
    bad = parity.run_subprocess(tmp_path, "bad", ["--fail"], 10)
    assert bad["error"].startswith("exit 1 after") and bad["error"].endswith("RuntimeError: boom"), bad
    assert parity.run_subprocess(tmp_path, "bad", ["--fail"], 10) == bad and len(calls) == 2
    parity.run_subprocess(tmp_path, "bad", ["--fail"], 10, retry_failed=True)
    assert len(calls) == 3

    def slow(cmd, **kwargs):
        calls.append(cmd)
        raise subprocess.TimeoutExpired(cmd, 5)

    monkeypatch.setattr(parity.subprocess, "run", slow)
    assert parity.run_subprocess(tmp_path, "late", ["--x"], 5, budget_cut=True) is None, "budget: not run"
    assert not (tmp_path / "late.error.txt").exists()
    assert (
        parity.run_subprocess(tmp_path, "hung", ["--x"], 5)["error"]
        == "timed out after 5 s: " + (tmp_path / "hung.log").read_text().strip().splitlines()[-1]
    )
    assert (tmp_path / "hung.error.txt").exists() and len(calls) == 5
    monkeypatch.setattr(parity.subprocess, "run", fake_run)
    (tmp_path / "cut.json").write_text('{"token_ids": [')  # a call killed mid-write
    assert parity.run_subprocess(tmp_path, "cut", ["--x"], 10) == {"token_ids": A} and len(calls) == 6


def test_matrix_selects_by_group_pattern_and_part():
    ids = [c.id for c in matrix.CASES]
    assert len(ids) == len(set(ids)), "case ids must be unique (they name the files)"
    assert ids[:2] == ["qwen3-0.6b-shape-v1-FLASH_ATTN-bf16-b16", "qwen3-0.6b-shape-v1-FLASH_ATTN-fp8-b16"]
    assert {c.group for c in matrix.select(matrix.CASES, ["swa"], None)} == {"swa"}
    assert [c.id for c in matrix.select(matrix.CASES, ["*fp8-b32"], None)] == [
        "qwen3-0.6b-shape-v1-FLASH_ATTN-fp8-b32",
        "qwen3-0.6b-shape-v2-FLASH_ATTN-fp8-b32",
    ]
    # a case id is that case alone, though other ids begin with it (its speculative variants)
    exact = [c.id for c in matrix.select(matrix.CASES, ["qwen3-0.6b-shape-v1-FLASH_ATTN-bf16-b16"], None)]
    assert exact == ["qwen3-0.6b-shape-v1-FLASH_ATTN-bf16-b16"], f"select by a case id: got {exact}"
    assert len(matrix.select(matrix.CASES, ["qwen3-0.6b-shape-v1-FLASH_ATTN-bf16-b16-"], None)) == 2
    parts = [matrix.select(matrix.CASES, None, f"{n}/4") for n in range(1, 5)]
    assert [c.id for p in parts for c in p] == ids
    with pytest.raises(SystemExit, match="--part 5/4"):
        matrix.select(matrix.CASES, None, "5/4")
    models = {c.model for c in matrix.CASES}
    assert {"qwen3-0.6b-shape", "tiny-llama-swa", "llama-8b-shape"} <= models
    big = [c for c in matrix.CASES if c.model == "llama-8b-shape" and isinstance(c, Case)]
    assert {c.runner for c in big} == {"v1", "v2"} and all(c.max_num_seqs == 256 and c.capture_sizes == "" for c in big)


def test_matrix_table_from_files_marks_missing_runs_not_run(tmp_path):
    cases = tmp_path / "integration"
    cases.mkdir()
    first = matrix.CASES[0]
    for name in (first.run_name("legacy"), first.run_name("legacy", 1), first.run_name("extensible")):
        (cases / f"{name}.json").write_text(json.dumps(_case_json(A, 10, 0)))
    rows, pairs = matrix.rows_from_files(matrix.CASES, cases)
    assert rows[0]["outcome"] == IDENTICAL and all(r["outcome"] == NOT_RUN for r in rows[1:]), rows[:2]
    assert set(pairs) == {"throughput-llama-8b-shape-v2", "throughput-llama-8b-shape-v1"}


def test_matrix_table_from_files_names_a_case_file_that_is_not_json(tmp_path):
    cases = tmp_path / "integration"
    cases.mkdir()
    first = matrix.CASES[0]
    for name in (first.run_name("legacy"), first.run_name("legacy", 1)):
        (cases / f"{name}.json").write_text(json.dumps(_case_json(A, 10, 0)))
    (cases / f"{first.run_name('extensible')}.json").write_text('{"case": {"model": "qwen3')  # a killed write
    rows, _ = matrix.rows_from_files(matrix.CASES, cases)
    text = parity.table(rows[:1])
    assert f"{first.run_name('extensible')}.json is not JSON" in text, f"matrix table for a cut-short file: {text}"


def test_matrix_table_only_counts_a_throughput_case_with_runs_missing_as_not_run(tmp_path, capsys):
    case = next(c for c in matrix.CASES if isinstance(c, parity.Throughput))
    cases = tmp_path / "integration"
    cases.mkdir()
    for mode, repeat in parity.THROUGHPUT_ORDER[:2]:  # the first pair only, as before the second pair existed
        (cases / f"{case.run_name(mode, repeat)}.json").write_text(json.dumps(throughput_run(mode, [1.0])))
    assert matrix.main([str(tmp_path), "--table-only", "--only", case.id]) == 0
    out = capsys.readouterr().out
    assert "1 selected case(s) not run yet" in out, f"matrix --only {case.id} with its second pair missing: {out}"
    for mode, repeat in parity.THROUGHPUT_ORDER[2:]:
        (cases / f"{case.run_name(mode, repeat)}.json").write_text(json.dumps(throughput_run(mode, [1.0])))
    assert matrix.main([str(tmp_path), "--table-only", "--only", case.id]) == 0
    out = capsys.readouterr().out
    assert "not run yet" not in out and "from 2 pairs" in out, f"matrix --only {case.id} with all four runs: {out}"


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )


def test_run_case_parses_its_arguments_without_vllm():
    proc = _python(
        "-m",
        "integration.run_case",
        "--model",
        "qwen3-0.6b-shape",
        "--runner",
        "v2",
        "--mode",
        "extensible",
        "--kv-cache-dtype",
        "fp8",
        "--block-size",
        "32",
        "--max-model-len",
        "4096",
        "--num-gpu-blocks-override",
        "900",
        "--batch-invariant",
        "--no-peak",
        "--dry-run",
        "--out",
        "x",
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    engine = plan["engine"]
    assert (
        engine["kv_cache_dtype"],
        engine["block_size"],
        engine["num_gpu_blocks_override"],
        engine["max_num_batched_tokens"],
    ) == ("fp8", 32, 900, 16384), engine
    assert engine["model"].endswith("integration/models/qwen3-0.6b-shape")
    assert plan["case"]["peak"] is False and plan["case"]["sensitivity"] is True and plan["case"]["batch_invariant"]
    assert _python("-m", "integration.run_case", "--help").returncode == 0
    bad = _python("-m", "integration.run_case", "--runner", "v3", "--mode", "legacy", "--out", "x")
    assert bad.returncode == 2 and "invalid choice: 'v3'" in bad.stderr


def test_matrix_lists_its_cases_without_vllm():
    proc = _python("-m", "integration.matrix", "unused", "--only", "qwen", "--part", "1/2", "--list")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].startswith("qwen3-0.6b-shape-v1-FLASH_ATTN-bf16-b16")
    assert "cases, ~" in proc.stdout


@pytest.mark.parametrize(
    "batched,seqs,model_len,expected",
    [
        (16384, 8, 4096, [2048] * 8),
        (2040, 8, 256, [255] * 8),
        (16384, 256, 8192, [64] * 256),
        (10, 4, 100, [3, 3, 2, 2]),
        (2048, 8, 256, [255] * 8),  # vLLM's default for 8 x 256: no prompt of 256 tokens leaves one to generate
    ],
)
def test_peak_batch_lengths(batched, seqs, model_len, expected):
    assert run_case.peak_batch_lengths(batched, seqs, model_len) == expected


@pytest.mark.parametrize(
    "argv,expected",
    [
        ([], 2040),  # 8 sequences x (256 - 1)
        (["--max-model-len", "4096"], 16384),
        (["--max-num-batched-tokens", "4096"], 4096),
        (["--max-num-seqs", "0"], None),
    ],
)
def test_default_max_num_batched_tokens_is_one_a_peak_batch_can_fill(argv, expected):
    args = run_case.parser().parse_args(["--runner", "v1", "--mode", "legacy", "--out", "x", *argv])
    assert run_case.max_num_batched_tokens(args) == expected


# -- run_case's GPU steps on a fake engine (their wiring; the figures come from torch.cuda, faked) -------------------
class _FakeWorker:
    def __init__(self):
        self.init_snapshot = type("S", (), {"free_memory": 100 << 30})()
        self.requested_memory = 90 << 30

    def execute_model(self, scheduler_output):
        return "ran"


class _FakeLLM:
    """collective_rpc runs the function on one worker, as vLLM's in-process executor does; each generate runs one
    engine step of all its prompts through the worker's execute_model (by name, as run_method resolves it)."""

    def __init__(self, free_during_batch):
        self.worker = _FakeWorker()
        self.free_during_batch = free_during_batch
        sched = type("Sch", (), {"max_num_batched_tokens": 16384, "max_num_seqs": 8})()
        model = type("M", (), {"max_model_len": 4096})()
        self.llm_engine = type(
            "E", (), {"vllm_config": type("V", (), {"scheduler_config": sched, "model_config": model})()}
        )()

    def collective_rpc(self, fn):
        return [fn(self.worker)]

    def generate(self, batch, params, use_tqdm=False):
        out = type("SO", (), {"total_num_scheduled_tokens": sum(len(b["prompt_token_ids"]) for b in batch)})()
        self.worker.execute_model(out)
        self.free_during_batch()
        return [type("O", (), {"num_cached_tokens": 0})() for _ in batch]


def test_run_peak_reads_memory_after_the_peak_shaped_batch(monkeypatch):
    import types

    import torch

    state = {"free": 12 << 30, "reserved": 17 << 30, "max_reserved": 17 << 30}

    def batch_runs():  # the batch takes 900 MiB of segments; torch gives 100 MiB of them back before the reading
        state["max_reserved"] = state["reserved"] + 900 * parity.MIB
        state["reserved"] += 800 * parity.MIB
        state["free"] -= 800 * parity.MIB

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **k: k))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (state["free"], 140 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: state["reserved"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a, **k: state["max_reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 16 << 30)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 17 << 30)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda *a, **k: [])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    llm = _FakeLLM(batch_runs)
    peak, ranks = run_case.run_peak(llm, vocab=1000)
    assert "execute_model" not in vars(llm.worker), "the step probe must be removed after the batch"
    assert peak["batch"] == {
        "max_num_batched_tokens": 16384,
        "max_num_seqs": 8,
        "num_seqs": 8,
        "prompt_tokens": 16384,
        "cached_tokens": 0,
        "seconds": peak["batch"]["seconds"],
        "step_tokens": [16384],
    }, peak["batch"]
    after_warmup = {
        "init_free": 100 << 30,
        "requested": 90 << 30,
        "total": 140 << 30,
        "free_after_warmup": 12 << 30,
        "torch_reserved": 17 << 30,
        "kv_backed_after_warmup": 0,
    }
    figures = parity.peak_figures(after_warmup, peak)
    # used = 100 GiB - (12 GiB - 800 MiB - 100 MiB released) = 88 GiB + 900 MiB: 1148 MiB under the 90 GiB budget.
    assert figures["over_budget_measured"] == (88 << 30) + 900 * parity.MIB - (90 << 30), figures
    assert figures["peak_shaped"] and figures["growth"]["during_batch"]["torch_reserved"] == 900 * parity.MIB


class _DecodeEngine:
    """vLLM's LLMEngine as ``run_case.run_throughput`` drives it: every request gains one token a step until its
    ``max_tokens``; ``on_step(step)`` runs at the start of each step."""

    def __init__(self, on_step=lambda step: None):
        self.requests, self.steps, self.on_step = {}, 0, on_step

    def add_request(self, rid, prompt, params):
        self.requests[rid] = params["max_tokens"]

    def step(self):
        import types

        self.steps += 1
        self.on_step(self.steps)
        outs = [
            types.SimpleNamespace(request_id=rid, outputs=[types.SimpleNamespace(token_ids=[7])])
            for rid in self.requests
        ]
        self.requests = {rid: n - 1 for rid, n in self.requests.items() if n > 1}  # one token per request per step
        return outs

    def has_unfinished_requests(self):
        return bool(self.requests)


def _run_throughput(monkeypatch, engine, **kwargs) -> dict:
    """``run_case.run_throughput`` on ``engine`` with vLLM's sampling classes stood in."""
    import types

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **k: k))
    monkeypatch.setitem(
        sys.modules,
        "vllm.sampling_params",
        types.SimpleNamespace(RequestOutputKind=types.SimpleNamespace(DELTA="delta")),
    )
    return run_case.run_throughput(types.SimpleNamespace(llm_engine=engine), vocab=1000, **kwargs)


def test_run_throughput_times_decode_steps_only(monkeypatch):
    engine = _DecodeEngine()
    tp = _run_throughput(monkeypatch, engine, num_seqs=4, warm_steps=3, steps=5, windows=2)
    assert [w["tokens"] for w in tp["windows"]] == [20, 20], tp["windows"]
    assert not engine.requests, "every request runs to its end"
    assert tp["tokens_per_s"] == pytest.approx(40 / sum(w["seconds"] for w in tp["windows"])) and tp["num_seqs"] == 4


def test_run_throughput_collects_garbage_before_the_windows_and_times_what_the_collector_takes_in_each(monkeypatch):
    import gc

    # inside the second window: a full collection, as Python might start one
    engine = _DecodeEngine(on_step=lambda step: step == 3 + 5 + 2 and gc.collect())
    collected_at = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: collected_at.append(engine.steps) or collect(*a))
    tp = _run_throughput(monkeypatch, engine, num_seqs=4, warm_steps=3, steps=5, windows=2)
    assert collected_at[0] == 3, f"gc.collect() after the 3 warm steps and before the first window: {collected_at}"
    full = [w["gc_full_collections"] for w in tp["windows"]]
    assert full == [0, 1], f"full collections per window: expected [0, 1], got {full}"
    assert tp["windows"][1]["gc_seconds"] > 0 and tp["windows"][0]["gc_seconds"] >= 0, tp["windows"]


def test_compile_cache_files_counts_what_vllm_cached(tmp_path, monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "vllm.envs", types.SimpleNamespace(VLLM_CACHE_ROOT=str(tmp_path)))
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(envs=sys.modules["vllm.envs"]))
    assert run_case.compile_cache_files() == 0
    graph = tmp_path / "torch_compile_cache" / "472991a6db" / "rank_0_0"
    graph.mkdir(parents=True)
    for name in ("a.py", "b.bin"):
        (graph / name).write_text("x")
    (tmp_path / "other.txt").write_text("not the compile cache")
    assert run_case.compile_cache_files() == 2
    monkeypatch.setitem(sys.modules, "vllm.envs", None)  # vLLM absent: nothing to say
    assert run_case.compile_cache_files() is None


@pytest.mark.parametrize("block,expected", [(None, 40), (16, 40), (32, 72), (64, 136)])
def test_measured_prompts_hold_two_full_blocks_to_read_from_the_prefix_cache(block, expected):
    argv = ["--runner", "v1", "--mode", "legacy", "--out", "x"] + (["--block-size", str(block)] if block else [])
    length = run_case.prompt_len(run_case.parser().parse_args(argv))
    assert length == expected and (length // (block or 16)) == 2, (block, length)
