"""The CPU parts of the paired decode measurement (``integration/decode_pair_run.py``): the rounds' order, a window's
throughput, a round's ratio, the phase ratio and its bootstrap interval, the verdict, the rounds that fit the time
left, the resize load's prompts, the dry run's schedule, and a whole run against fake engines and a fake sender."""

from __future__ import annotations

import json
import statistics
import subprocess

import pytest

from integration import decode_pair_run as dp


def _window(engine, rate, phase="before", round_=0, tokens=1000):
    return {"phase": phase, "round": round_, "engine": engine, "tokens": tokens, "tokens_per_s": rate, "failed": 0}


def _round(rates, phase="before", round_=0):
    """A round's four windows with the given throughputs, in the round's own order."""
    order = dp.round_order(round_)
    return [_window(e, r, phase, round_) for e, r in zip(order, rates)]


# -- the order ---------------------------------------------------------------------------------------------------------
def test_rounds_alternate_abba_and_baab_so_each_engine_holds_the_same_mean_position():
    assert dp.round_order(0) == ("a", "b", "b", "a")
    assert dp.round_order(1) == ("b", "a", "a", "b")
    assert dp.round_order(2) == dp.round_order(0) and dp.round_order(3) == dp.round_order(1)
    for r in range(4):
        order = dp.round_order(r)
        positions = {e: [i for i, x in enumerate(order) if x == e] for e in dp.ENGINES}
        assert statistics.fmean(positions["a"]) == statistics.fmean(positions["b"])  # linear drift cancels
    firsts = [dp.round_order(r)[0] for r in range(6)]
    assert firsts.count("a") == firsts.count("b")  # each engine first after a switch equally often


def test_the_schedule_is_a_warmup_round_then_the_same_rounds_before_and_after():
    steps = dp.schedule(3)
    assert [s["phase"] for s in steps] == ["warmup"] * 4 + ["before"] * 12 + ["after"] * 12
    for phase in dp.PHASES:
        mine = [s for s in steps if s["phase"] == phase]
        for r in range(3):
            assert tuple(s["engine"] for s in mine if s["round"] == r) == dp.round_order(r)
    assert [s["engine"] for s in steps[:4]] == ["a", "b", "b", "a"]


# -- a window and a round ----------------------------------------------------------------------------------------------
def test_a_windows_throughput_is_its_tokens_over_the_last_end_less_the_first_start():
    records = [
        {"start": 10.0, "end": 12.0, "ok": True, "tokens": 256},
        {"start": 10.5, "end": 13.0, "ok": True, "tokens": 256},
        {"start": 10.2, "end": 11.0, "ok": False, "tokens": 3},  # failed: its tokens do not count, its time does
    ]
    w = dp.window_figures(records)
    assert (w["start"], w["end"], w["seconds"], w["tokens"]) == (10.0, 13.0, 3.0, 512)
    assert w["tokens_per_s"] == pytest.approx(512 / 3.0) and w["failed"] == 1 and w["requests"] == 3
    assert dp.window_figures([])["tokens_per_s"] is None


def test_a_rounds_ratio_is_the_mean_of_b_windows_over_the_mean_of_a_windows():
    # a: 100 and 300 (mean 200); b: 150 and 250 (mean 200). The mean of window ratios would read 1.16, a ratio of
    # the a-then-b pairs (150/100, 250/300) 1.17: only the ratio of means is 1.
    windows = [_window("a", 100.0), _window("b", 150.0), _window("b", 250.0), _window("a", 300.0)]
    assert dp.round_ratio(windows) == pytest.approx(1.0)
    assert dp.round_ratio(_round([100.0, 99.0, 101.0, 100.0])) == pytest.approx(1.0)
    assert dp.round_ratio(_round([100.0, 98.0, 98.0, 100.0])) == pytest.approx(0.98)  # b slower: below 1
    with pytest.raises(ValueError, match="both engines"):
        dp.round_ratio([_window("a", 100.0), _window("a", 100.0)])


def test_a_round_cut_short_or_with_an_empty_window_has_no_ratio():
    empty = _round([100.0, 95.0, 95.0, 100.0], round_=2)
    empty[1] = empty[1] | {"tokens_per_s": None}
    windows = _round([100.0, 99.0, 99.0, 100.0], round_=0) + _round([100.0, 90.0, 90.0, 100.0], round_=1)[:3] + empty
    assert dp.phase_ratios(windows, "before") == [pytest.approx(0.99)]


# -- the phase ratio, its interval, the verdict ------------------------------------------------------------------------
def test_the_decode_ratio_is_the_median_after_over_the_median_before():
    before = [1.01, 1.02, 1.03, 1.20]  # one wild round: the median ignores it, a mean would not
    after = [1.00, 1.02, 1.01]
    assert dp.decode_ratio(before, after) == pytest.approx(1.01 / 1.025)
    assert dp.decode_ratio([], after) is None and dp.decode_ratio(before, []) is None
    s = dp.spread(before)
    assert (s["min"], s["max"], s["median"], s["rounds"]) == (1.01, 1.20, pytest.approx(1.025), 4)
    assert s["iqr"] == pytest.approx(1.0725 - 1.0175)  # linear interpolation: ranks 2.25 and 0.75


def test_the_bootstrap_interval_is_seeded_holds_the_ratio_and_resamples_both_phases():
    before = [1.00, 1.01, 0.99, 1.02, 0.98, 1.00]
    after = [0.99, 1.00, 0.98, 1.01, 0.99, 0.97]
    one = dp.bootstrap_interval(before, after, resamples=500, seed=3)
    assert one == dp.bootstrap_interval(before, after, resamples=500, seed=3)  # the same seed, the same interval
    assert one != dp.bootstrap_interval(before, after, resamples=500, seed=4)
    assert one["low"] <= dp.decode_ratio(before, after) <= one["high"]
    assert one["width"] == pytest.approx(one["high"] - one["low"]) and one["level"] == 0.95
    # before varies, after does not: an interval that resampled only the after rounds would have no width
    assert dp.bootstrap_interval(before, [1.0] * 6, resamples=500, seed=3)["width"] > 0
    assert dp.bootstrap_interval([1.0] * 6, after, resamples=500, seed=3)["width"] > 0
    flat = dp.bootstrap_interval([1.0] * 4, [0.996] * 4, resamples=100)
    assert flat["low"] == pytest.approx(0.996) and flat["high"] == pytest.approx(0.996) and flat["width"] == 0
    assert dp.bootstrap_interval([], after) is None


@pytest.mark.parametrize(
    "ratio, failed, verdict",
    [(0.995, 0, "pass"), (1.02, 0, "pass"), (0.9949, 0, "fail"), (1.0, 1, "fail"), (None, 0, "not measured")],
)
def test_the_verdict_passes_from_0_995_with_no_failed_request(ratio, failed, verdict):
    assert dp.judge(ratio, None, failed)["verdict"] == verdict


def test_the_interval_says_whether_it_resolves_half_a_percent_and_whether_it_clears_the_target():
    narrow = {"low": 0.996, "high": 1.000, "width": 0.004}
    wide = {"low": 0.990, "high": 1.010, "width": 0.020}
    below = {"low": 0.985, "high": 0.989, "width": 0.004}
    checks = {name: dp.judge(1.0, i, 0)["checks"] for name, i in (("n", narrow), ("w", wide), ("b", below))}
    assert checks["n"]["interval_resolves_half_percent"] and checks["n"]["interval_clear_of_target"]
    assert not checks["w"]["interval_resolves_half_percent"] and not checks["w"]["interval_clear_of_target"]
    assert checks["b"]["interval_resolves_half_percent"] and checks["b"]["interval_clear_of_target"]
    assert dp.judge(1.0, {"low": 0.99, "high": 0.995, "width": 0.005}, 0)["checks"]["interval_resolves_half_percent"]
    assert dp.judge(1.0, None, 0)["checks"]["interval_resolves_half_percent"] is None


def test_the_summary_divides_out_the_pairs_own_bias():
    # b reads 2% above a before the resize and 2% above after it: no change, ratio 1
    windows = []
    for r in range(4):
        for phase in dp.PHASES:
            windows += [_window(e, 102.0 if e == "b" else 100.0, phase, r) for e in dp.round_order(r)]
    summary = dp.summarize({"windows": windows, "stages": {}})
    assert summary["ratio"] == pytest.approx(1.0) and summary["verdict"] == "pass"
    assert [r["median"] for r in summary["rows"]] == [pytest.approx(1.02)] * 2
    assert summary["before_spread"]["iqr"] == pytest.approx(0.0)
    assert "Decode ratio (median after / median before): 1.0000" in dp.render_table(summary)


# -- the time box and the resize load ----------------------------------------------------------------------------------
def test_the_rounds_are_cut_to_what_fits_the_time_left():
    reserve = dp.RESIZE_STAGE_S + dp.END_RESERVE_S
    per_pair = 2 * 4 * 3.5 * dp.ROUND_MARGIN  # a round before and one after, 3.5 s a window
    assert dp.rounds_that_fit(reserve + 10 * per_pair, 3.5, 6) == 6
    assert dp.rounds_that_fit(reserve + 4.5 * per_pair, 3.5, 6) == 4
    assert dp.rounds_that_fit(reserve - 1, 3.5, 6) == 0


def test_the_resize_load_holds_twice_the_shrinks_blocks_within_the_model_length():
    for target in (800, 1_700, 140):  # 10% of 8,000, 17,000 and 1,400 blocks
        length = dp.load_prompt_len(target, 64, 256)
        assert 64 * (length // dp.BLOCK_SIZE) >= 2 * target
        assert length + 256 <= dp.MAX_MODEL_LEN and length % dp.BLOCK_SIZE == 0
    assert dp.load_prompt_len(100_000, 64, 256) == dp.MAX_MODEL_LEN - 256
    assert dp.load_prompt_len(10, 64, 256) == dp.PROMPT_LEN


# -- the dry run and the command line ----------------------------------------------------------------------------------
def test_the_dry_run_prints_both_commands_and_the_schedule_and_starts_nothing(tmp_path, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the dry run started something")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    out = tmp_path / "out"
    assert dp.main([str(out), "--dry-run", "--rounds", "2", "--model", "qwen3-0.6b-shape", "--runner", "v2"]) == 0
    text = capsys.readouterr().out
    assert not out.exists()
    assert "--served-model-name engine-a" in text and "--served-model-name engine-b" in text
    assert "integration/models/qwen3-0.6b-shape " in text and "--gpu-memory-utilization 0.42" in text
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in text and "EXTENSIBLE_KV_CACHE=1" in text and "a then b" in text
    lines = [ln for ln in text.splitlines() if ln.split(" round ")[0] in ("warmup", "before", "after")]
    assert lines == [
        "warmup round 0: a b b a (not measured)",
        "before round 0: a b b a",
        "before round 1: b a a b",
        "after round 0: a b b a",
        "after round 1: b a a b",
    ]
    order = text.splitlines()
    resize = next(i for i, ln in enumerate(order) if ln.startswith("resize b:"))
    assert order[resize - 1] == "before round 1: b a a b" and order[resize + 1] == "after round 0: a b b a"
    assert "2 starts x 75 s + 20 windows x 2.0 s + resize 15 s + stop 15 s = 220 s" in text


def test_the_default_8b_run_is_expected_within_about_six_minutes(capsys):
    assert dp.main(["out", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "--model" in text and "integration/models/llama-8b-shape " in text
    expected = dp.expected_seconds(dp.parser().parse_args(["out"]))
    assert expected["windows"] == 52 and expected["total_s"] <= 6.5 * 60


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--max-tokens", "x"], ["--model", "gpt"], ["--runner", "v3"]])
def test_the_command_line_refuses_values_out_of_range(argv):
    with pytest.raises(SystemExit):
        dp.parser().parse_args(["out", *argv])


# -- a whole run against fakes -----------------------------------------------------------------------------------------
class _FakeEngine:
    def __init__(self, name, log, blocks=8_000, floor=129, running=4):
        self.name, self.log, self.blocks, self.floor, self.running = name, log, blocks, floor, running

    def state(self):
        return {"num_blocks": self.blocks, "floor_blocks": self.floor, "running": self.running, "waiting": 0}

    def resize(self, n):
        self.log.append((self.name, n))
        old, self.blocks = self.blocks, n
        return {"from": old, "to": n, "preempted": ["r1", "r2"] if n < old else [], "evicted": 0}


def test_a_run_against_fake_engines_measures_every_window_and_resizes_b_down_and_back(tmp_path, monkeypatch, capsys):
    log, engines = [], {}

    def fake_start(run, plugin_dir):
        run.urls.update(a="http://a", b="http://b")
        run.result["engines"] = {n: {"url": u} for n, u in run.urls.items()}

    def fake_engine(self, name):
        return engines.setdefault(name, _FakeEngine(name, log))

    def send(url, model, prompt, max_tokens):
        return {"ok": True, "output_tokens": max_tokens, "ttft_s": 0.0, "error": None}

    monkeypatch.setattr(dp, "start_servers", fake_start)
    monkeypatch.setattr(dp.PairRun, "engine", fake_engine)
    monkeypatch.setattr(dp, "HOLD_S", 0.0)
    monkeypatch.setattr(dp, "SETTLE_S", 0.0)
    args = dp.parser().parse_args([str(tmp_path), "--rounds", "2", "--max-num-seqs", "4", "--max-tokens", "8"])
    assert dp.run_all(args, send=send) == 0
    summary = json.loads((tmp_path / "decode-pair-summary.json").read_text())
    assert all(s["state"] == "complete" for s in summary["stages"].values())
    assert [(w["phase"], w["round"], w["engine"]) for w in summary["windows"]] == [
        (s["phase"], s["round"], s["engine"]) for s in dp.schedule(2)
    ]
    assert all(w["tokens"] == 32 and w["end"] >= w["start"] and w["failed"] == 0 for w in summary["windows"])
    assert log == [("b", 800), ("b", 8_000)]  # only b, down to 10% and back
    labels = [(r["label"], r["from"], r["to"]) for r in summary["resize"]["replies"]]
    assert labels == [("shrink", 8_000, 800), ("grow", 800, 8_000)]
    assert all(r["end"] >= r["start"] for r in summary["resize"]["replies"])
    assert summary["premises"] == {"shrink_preempted": True, "grown_back": True}
    assert summary["resize"]["load"]["requests"] == 4 and summary["rounds"]["run"] == 2
    assert summary["verdict"] in ("pass", "fail") and len(summary["rows"]) == 2
    assert (tmp_path / "decode-pair-table.md").read_text() in capsys.readouterr().out


def test_a_run_whose_servers_do_not_start_exits_1_and_says_which_stages_did_not_run(tmp_path, monkeypatch):
    def fail_start(run, plugin_dir):
        raise dp.StepFailed("engine a: no 200 from /health", "start")

    monkeypatch.setattr(dp, "start_servers", fail_start)
    assert dp.run_all(dp.parser().parse_args([str(tmp_path)])) == 1
    summary = json.loads((tmp_path / "decode-pair-summary.json").read_text())
    assert summary["stages"]["start"]["state"] == "failed" and summary["stages"]["after"] == {"state": "not run"}
    assert summary["verdict"] == "not measured" and "engine a" in summary["error"]["error"]
