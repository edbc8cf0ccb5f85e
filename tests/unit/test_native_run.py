"""The CPU parts of the native-path matrix (``integration/native_run.py``): which cases it runs, the summary of the
JSON files a run left, and a matrix that resumes from them."""

from __future__ import annotations

import json

from integration import native_run as nr


def _run(folder, case, mode, tokens=((1, 2), (3, 4)), over=-5 << 20, blocks=1000, error=None, extensible=None):
    data = {"case": {"name": case}, "mode": mode, "vllm": "0.34.0", "num_gpu_blocks": blocks, "engine_seconds": 30.0}
    data |= {"token_ids": [list(t) for t in tokens], "load": {"highest_over_budget": over, "bursts": 200}}
    data["figures"] = {"extensible": mode == "native" if extensible is None else extensible}
    if error:
        data = {"case": {"name": case}, "mode": mode, "error": error}
    (folder / f"{case}-{mode}.json").write_text(json.dumps(data))


def test_only_v2_cases_run_since_vllm_034_has_no_v1_runner():
    assert nr.NATIVE_CASES and all(c["runner"] == "v2" for c in nr.NATIVE_CASES)
    assert [c["name"] for c in nr.selected(["mla-*"])] == ["mla-v2"]
    assert nr.selected([]) == nr.NATIVE_CASES and nr.selected(["nothing"]) == []


def test_the_summary_compares_tokens_blocks_and_the_budget_of_both_modes(tmp_path):
    _run(tmp_path, "mla-v2", "off", blocks=33_000, over=-(10 << 20))
    _run(tmp_path, "mla-v2", "native", blocks=33_500, over=3 << 20)
    _run(tmp_path, "qwen3-v2", "off")
    _run(tmp_path, "qwen3-v2", "native", tokens=((1, 2), (3, 5)))
    rows = {r["case"]: r for r in nr.summarize(tmp_path)["rows"]}
    assert rows["mla-v2"]["tokens_identical"] is True and rows["qwen3-v2"]["tokens_identical"] is False
    assert rows["mla-v2"]["native_over_budget"] == 3 << 20 and rows["mla-v2"]["off_blocks"] == 33_000
    assert rows["mla-v2"]["native_extensible"] is True and rows["mla-v2"]["off_extensible"] is False
    table = (tmp_path / "native-table.md").read_text()
    assert "| mla-v2 | 0.34.0 | 33000 / 33500 | -10.0 / +3.0 |" in table
    assert json.loads((tmp_path / "native-summary.json").read_text())["rows"]


def test_a_failed_engine_is_a_row_with_its_error_and_no_token_verdict(tmp_path):
    _run(tmp_path, "mla-v2", "off")
    _run(tmp_path, "mla-v2", "native", error="ImportError: libnccl.so.2: undefined symbol")
    (row,) = nr.summarize(tmp_path)["rows"]
    assert "tokens_identical" not in row and row["native_errors"] == ["ImportError: libnccl.so.2: undefined symbol"]
    assert "undefined symbol" in (tmp_path / "native-table.md").read_text()


def test_the_matrix_reads_finished_engines_and_starts_none_without_the_time(tmp_path, capsys):
    for case in nr.NATIVE_CASES:
        for mode in nr.MODES:
            _run(tmp_path, case["name"], mode)
    assert nr.matrix(tmp_path, [], budget_s=0.0, batches=1) == 0  # nothing left to run
    (tmp_path / "mla-v2-native.json").unlink()
    assert nr.matrix(tmp_path, ["mla-v2"], budget_s=1.0, batches=1) == 1
    assert "mla-v2 native: 1 s left" in capsys.readouterr().out
    assert not (tmp_path / "mla-v2-native.json").exists()


def test_failed_or_unreadable_engines_run_again_and_the_matrix_says_it_failed(tmp_path, monkeypatch):
    started = []

    def fake_run(cmd, **kwargs):
        out = cmd[cmd.index("--out") + 1]
        started.append(out.rsplit("/", 1)[-1])
        (tmp_path / out.rsplit("/", 1)[-1]).write_text(json.dumps({"error": "ImportError: x", "traceback": "t"}))
        return type("Done", (), {"returncode": 1})()

    monkeypatch.setattr(nr.subprocess, "run", fake_run)
    _run(tmp_path, "mla-v2", "off")
    (tmp_path / "mla-v2-native.json").write_text('{"case": {"name": "mla-')  # cut short
    assert nr.matrix(tmp_path, ["mla-v2"], budget_s=10_000, batches=1) == 1
    assert started == ["mla-v2-native.json"]  # the finished one is read, the cut one rerun
    assert nr.matrix(tmp_path, ["mla-v2"], budget_s=10_000, batches=1) == 1 and started[-1] == "mla-v2-native.json"
    (tmp_path / "mla-v2-native.json").write_text("not json")
    (row,) = nr.summarize(tmp_path)["rows"]
    assert row["native_errors"] == ["unreadable mla-v2-native.json: JSONDecodeError"]
    assert "| mla-v2 | 0.34.0 | 1000 / - |" in (tmp_path / "native-table.md").read_text()


def test_a_pattern_that_matches_no_case_is_refused(tmp_path, capsys):
    assert nr.matrix(tmp_path, ["qwen3-V2"], budget_s=10_000, batches=1) == 2
    assert "no case matches qwen3-V2; cases: " in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_the_modes_run_in_the_order_asked(tmp_path, monkeypatch):
    started = []

    def fake_run(cmd, **kwargs):
        started.append(cmd[cmd.index("--mode") + 1])
        return type("Done", (), {"returncode": 1})()

    monkeypatch.setattr(nr.subprocess, "run", fake_run)
    nr.main([str(tmp_path), "--only", "mla-v2", "--mode", "native", "--mode", "off", "--budget-seconds", "10000"])
    assert started == ["native", "off"]
