"""The CPU parts of the two-engine sharing measurement (``integration/share_run.py``): the load schedule, the phase
length, the limit and the fixed split, the percentiles and the rows, the limit check, the verdicts and premises, the
table, the server command, the dry run, the streaming client against a local fake server, and a phase driven by a
fake sender."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import islice

import pytest

from integration import share_run as sr
from integration.serve_sleep import PROBE

QWEN_BLOCK = 1_835_008  # Note [The card's KV limit]: 28 x 2 x 8 x 128 x 2 x 16


def _state(bpb=QWEN_BLOCK, floor=129, reserved=16_000, num_blocks=16_000):
    return {"bytes_per_block": bpb, "floor_blocks": floor, "reserved_blocks": reserved, "num_blocks": num_blocks}


# -- the load schedule -------------------------------------------------------------------------------------------------
def _take(seed=7, phase="phase1", engine="a", load=sr.HEAVY, worker=0, n=5, vocab=1000):
    return list(islice(sr.worker_requests(seed, phase, engine, load, worker, vocab), n))


def test_a_worker_draws_the_same_requests_every_time_so_both_configurations_see_one_load():
    assert _take() == _take()
    assert [s.index for s in _take()] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "other", [dict(seed=8), dict(phase="phase2"), dict(engine="b"), dict(worker=1), dict(load=sr.LIGHT)]
)
def test_each_worker_phase_engine_and_seed_draws_its_own_prompts(other):
    assert [s.prompt for s in _take(**other)] != [s.prompt for s in _take()]


def test_prompts_stay_within_the_load_lengths_and_the_vocabulary():
    for load in (sr.HEAVY, sr.LIGHT):
        specs = _take(load=load, n=200, vocab=50)
        assert all(load.prompt_lo <= len(s.prompt) <= load.prompt_hi for s in specs)
        assert all(3 <= t < 50 for s in specs for t in s.prompt)
        assert all(s.max_tokens == load.max_tokens and s.role == load.role for s in specs)
        lengths = {len(s.prompt) for s in specs}
        assert min(lengths) < load.prompt_lo + 100 and max(lengths) > load.prompt_hi - 100  # spread, not one length


def test_light_workers_think_one_to_three_seconds_and_heavy_workers_not_at_all():
    light = [s.think_s for s in _take(load=sr.LIGHT, n=100)]
    assert all(1.0 <= t <= 3.0 for t in light) and len(set(light)) > 50
    assert {s.think_s for s in _take(load=sr.HEAVY, n=20)} == {0.0}


def test_heavy_workers_start_spread_over_the_ramp_and_the_busy_engine_gets_the_heavy_load():
    offsets = [sr.start_offset(sr.HEAVY, w) for w in range(sr.HEAVY.workers)]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < sr.HEAVY.ramp_s
    assert sr.start_offset(sr.LIGHT, 0) == 0
    assert sr.phase_loads("a") == {"a": sr.HEAVY, "b": sr.LIGHT}
    assert sr.phase_loads("b") == {"a": sr.LIGHT, "b": sr.HEAVY}
    with pytest.raises(ValueError, match="no engine"):
        sr.phase_loads("c")


def test_open_arrivals_draw_the_same_exponential_gaps_every_time_from_one_dispatcher():
    load = sr.replace(sr.HEAVY, rate=40.0)
    gaps = [s.think_s for s in _take(load=load, n=4_000)]
    assert gaps == [s.think_s for s in _take(load=load, n=4_000)]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 40.0, rel=0.06)  # mean 1 / rate
    assert sum(g > 3 / 40.0 for g in gaps) / len(gaps) == pytest.approx(0.0498, abs=0.012)  # e^-3: exponential
    assert load.open and load.senders == 1 and sr.start_offset(load, 0) == 0.0
    assert not sr.HEAVY.open and sr.HEAVY.senders == sr.HEAVY.workers


def test_phases_share_the_time_left_after_the_reserves_capped_and_refused_below_the_minimum():
    assert sr.phase_seconds(1_000) == sr.MAX_PHASE_S
    # 300 s left: (300 - 45 - 4 x 15) / 4 = 48.75 s a phase
    assert sr.phase_seconds(300) == pytest.approx((300 - sr.END_RESERVE_S - 4 * sr.PHASE_OVERHEAD_S) / 4)
    assert sr.phase_seconds(100) is None
    lowest = sr.END_RESERVE_S + 4 * (sr.PHASE_OVERHEAD_S + sr.MIN_PHASE_S)
    assert sr.phase_seconds(lowest) == sr.MIN_PHASE_S and sr.phase_seconds(lowest - 1) is None


# -- the limit and the fixed split -------------------------------------------------------------------------------------
def test_the_limit_is_the_notes_figure_for_the_qwen3_shape():
    assert sr.estimated_bytes_per_block(json.loads((sr.MODEL_DIR / "config.json").read_text())) == QWEN_BLOCK
    assert sr.demand_blocks(sr.HEAVY, 16) == 32 * 48 == 1_536
    limit = sr.kv_limit({"a": _state(), "b": _state()})
    assert limit["limit_bytes"] == 2_304 * QWEN_BLOCK == 4_227_858_432
    assert limit["fixed_blocks"] == {"a": 1_152, "b": 1_152}
    assert limit["room_blocks"] == {"a": 2_175, "b": 2_175}
    assert limit["checks"] == {"fixed_below_demand": True, "room_fits_demand": True}


def test_the_fixed_split_never_exceeds_the_limit_even_for_engines_of_different_block_sizes():
    states = {"a": _state(bpb=3 * 2**20 + 7), "b": _state(bpb=2**20)}
    limit = sr.kv_limit(states)
    used = sum(limit["fixed_blocks"][n] * s["bytes_per_block"] for n, s in states.items())
    assert used <= limit["limit_bytes"]
    assert limit["limit_bytes"] == pytest.approx(1.5 * 1_536 * (3 * 2**20 + 7), abs=1)  # the larger engine's bytes
    assert limit["fixed_blocks"]["b"] > limit["fixed_blocks"]["a"]


def test_a_headroom_that_lets_the_busy_engine_fit_at_half_fails_the_queueing_check():
    assert sr.kv_limit({"a": _state(), "b": _state()}, headroom=3.0)["checks"]["fixed_below_demand"] is False
    assert sr.kv_limit({"a": _state(), "b": _state()}, headroom=1.0)["checks"]["room_fits_demand"] is False


def test_the_fixed_split_is_clamped_to_the_reservation_and_refused_below_the_floor():
    assert sr.fixed_blocks(10 * QWEN_BLOCK * 2_000, _state(reserved=1_000)) == 1_000
    with pytest.raises(sr.SizingError, match="below the engine's floor"):
        sr.fixed_blocks(2 * 100 * QWEN_BLOCK, _state())
    with pytest.raises(sr.SizingError, match="floors take"):
        sr.kv_limit({"a": _state(floor=2_000), "b": _state(floor=2_000)})
    with pytest.raises(sr.SizingError, match="headroom"):
        sr.kv_limit({"a": _state()}, headroom=0)


# -- percentiles, rows, the limit check --------------------------------------------------------------------------------
def test_percentiles_interpolate_between_ranks():
    assert sr.percentile([4, 1, 3, 2], 50) == 2.5
    assert sr.percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert sr.percentile([1, 2, 3, 4], 0) == 1 and sr.percentile([1, 2, 3, 4], 100) == 4
    assert sr.percentile(list(range(101)), 99) == 99
    assert sr.percentile([5.0], 99) == 5.0 and sr.percentile([], 50) is None
    with pytest.raises(ValueError):
        sr.percentile([1], 101)


def _rec(config="fixed", phase="phase1", engine="a", ttft=0.1, e2e=2.0, start=100.0, ok=True, tokens=128):
    return {
        "config": config,
        "phase": phase,
        "engine": engine,
        "ttft_s": ttft if ok else None,
        "e2e_s": e2e,
        "start": start,
        "ok": ok,
        "output_tokens": tokens if ok else None,
    }


def _meta(config="fixed", phase="phase1", busy="a", start=100.0, drained=170.0):
    return {"config": config, "phase": phase, "busy": busy, "start": start, "end": start + 60, "drained": drained}


def _poll(t, a_blocks=1_152, b_blocks=1_152, a_waiting=0, bpb=QWEN_BLOCK, sizes=None):
    loads = [
        {"name": "a", "num_blocks": a_blocks, "bytes_per_block": bpb, "waiting": a_waiting},
        {"name": "b", "num_blocks": b_blocks, "bytes_per_block": bpb, "waiting": 0},
    ]
    return {"time": t, "loads": loads, "sizes": sizes or {"a": a_blocks, "b": b_blocks}, "errors": {}}


def test_a_row_counts_failures_apart_and_takes_ttft_and_throughput_from_successful_requests():
    records = [_rec(ttft=0.1, start=100), _rec(ttft=0.3, start=101, e2e=9.0), _rec(ok=False, ttft=9, start=102)]
    records.append(_rec(engine="b", ttft=5.0))
    polls = [_poll(99), _poll(120, a_blocks=2_000, a_waiting=3), _poll(180, a_blocks=5_000, a_waiting=9)]
    row = sr.phase_row(_meta(), "a", records, polls)
    assert (row["requests"], row["failed"], row["role"]) == (3, 1, "heavy")
    assert row["ttft_p50_s"] == pytest.approx(0.3) and row["ttft_p99_s"] is None  # the failed one ranks last
    assert row["output_tokens"] == 256 and row["span_s"] == pytest.approx(10.0)  # last end 101 + 9 - start 100
    assert row["tokens_per_s"] == pytest.approx(25.6)
    assert (row["polls"], row["blocks_min"], row["blocks_max"], row["waiting_max"]) == (1, 2_000, 2_000, 3)
    empty = sr.phase_row(_meta(), "a", [_rec(ok=False)], [])
    assert empty["ttft_p50_s"] is None and empty["tokens_per_s"] is None and empty["failed"] == 1


def test_the_limit_check_fails_on_a_poll_over_the_limit_read_or_left():
    limit = 2_304 * QWEN_BLOCK
    held = sr.limit_check([_poll(1), _poll(2, a_blocks=2_175, b_blocks=129), {"time": 3, "error": "x"}], limit)
    assert held["held"] is True and held["polls"] == 2 and held["failed_polls"] == 1
    assert held["max_bytes"] == limit
    read_over = sr.limit_check([_poll(1), _poll(2, a_blocks=2_176, b_blocks=129)], limit)
    assert read_over["held"] is False and read_over["over"][0]["time"] == 2
    left_over = sr.limit_check([_poll(1, sizes={"a": 2_000, "b": 1_152})], limit)
    assert left_over["held"] is False and left_over["over"][0]["left_bytes"] == 3_152 * QWEN_BLOCK
    assert sr.limit_check([{"time": 1, "error": "x"}], limit)["held"] is None


# -- verdicts, premises, the table -------------------------------------------------------------------------------------
def _rows(shared_ttft=(0.05, 0.2), fixed_ttft=(0.5, 2.0), failed=0, drop=None, blocks_max=2_100, waiting=4):
    rows = []
    for config in sr.CONFIGS:
        for phase, busy in sr.PHASES:
            for engine in sr.ENGINES:
                p50, p99 = (shared_ttft if config == "shared" else fixed_ttft) if engine == busy else (0.05, 0.1)
                row = {"config": config, "phase": phase, "engine": engine, "failed": 0}
                row |= {"ttft_p50_s": p50, "ttft_p99_s": p99, "blocks_max": blocks_max, "waiting_max": waiting}
                rows.append(row)
    rows[-1]["failed"] = failed
    return [r for r in rows if (r["config"], r["phase"], r["engine"]) != drop]


def test_shared_passes_only_where_it_beats_fixed_for_the_busy_engine_without_failures_within_the_limit():
    good = sr.verdicts(_rows(), {"held": True})
    assert set(good.values()) == {True} and len(good) == 6
    worse = sr.verdicts(_rows(shared_ttft=(0.5, 3.0)), {"held": True})
    assert worse["phase1_busy_a_ttft_p50_shared_better"] is False
    assert worse["phase2_busy_b_ttft_p99_shared_better"] is False
    assert sr.verdicts(_rows(shared_ttft=(0.5, 2.0)), {"held": True})["phase1_busy_a_ttft_p99_shared_better"] is False
    assert sr.verdicts(_rows(failed=2), {"held": True})["no_failed_requests"] is False
    assert sr.verdicts(_rows(), {"held": False})["limit_never_exceeded"] is False
    missing = sr.verdicts(_rows(drop=("shared", "phase2", "b")), None)
    assert missing["phase2_busy_b_ttft_p50_shared_better"] is None and missing["no_failed_requests"] is None
    assert missing["limit_never_exceeded"] is None


def test_a_configuration_cannot_look_faster_by_leaving_its_slowest_requests_unfinished():
    meta = _meta("shared", "phase1", "a")
    served = [_rec("shared", ttft=0.1) for _ in range(20)]
    dropped = [_rec("shared", ok=False) for _ in range(10)]
    row = sr.phase_row(meta, "a", served + dropped, [])
    assert row["failed"] == 10 and row["ttft_p50_s"] == pytest.approx(0.1) and row["ttft_p99_s"] is None
    assert sr.phase_row(meta, "a", served + dropped * 2, [])["ttft_p50_s"] is None  # half never finished
    assert sr.censored_percentile([0.1, 0.2], 0, 50) == pytest.approx(0.15)
    done = [0.1 * i for i in range(1, 11)]
    for q in (0, 10, 50, 77, 88.9):  # below the failed ones: the percentile of all, interpolated between the done
        assert sr.censored_percentile(done, 1, q) == pytest.approx(sr.percentile([*done, 99.0], q))
    assert sr.censored_percentile(done, 1, 91) is None and sr.censored_percentile([0.5], 0, 99) == 0.5
    assert sr.censored_percentile([], 0, 50) is None and sr.censored_percentile([], 3, 50) is None
    rows = _rows()
    for r in rows:
        if r["config"] == "shared" and r["phase"] == "phase1" and r["engine"] == "a":
            r["ttft_p99_s"], r["failed"] = None, 10
    judged = sr.verdicts(rows, {"held": True})
    assert judged["phase1_busy_a_ttft_p99_shared_better"] is None and judged["no_failed_requests"] is False


def test_the_calibrations_failures_are_reported_but_not_judged():
    rows = _rows() + [{"config": "calibrate", "phase": "phase1", "engine": "a", "failed": 3}]
    assert sr.verdicts(rows, {"held": True})["no_failed_requests"] is True


def test_premises_say_whether_the_busy_engine_queued_at_half_and_grew_under_the_coordinator():
    fixed = {"a": 1_152, "b": 1_152}
    assert set(sr.premises(_rows(), fixed).values()) == {True}
    flat = sr.premises(_rows(blocks_max=1_152, waiting=0), fixed)
    assert set(flat.values()) == {False}
    assert set(sr.premises(_rows(), None).values()) == {True, None}


def test_the_summary_and_table_name_every_row_the_verdict_and_the_stage_that_failed():
    phases = [_meta("fixed", "phase1", "a"), _meta("fixed", "phase2", "b", start=200, drained=270)]
    result = {
        "limit": sr.kv_limit({"a": _state(), "b": _state()}),
        "runs": {"fixed": {"phases": phases, "polls": [_poll(120, a_waiting=5)]}},
        "stages": {"start": {"state": "complete"}, "fixed": {"state": "complete"}, "shared": {"state": "failed"}},
        "error": {"stage": "shared", "error": "StepFailed: boom"},
        "memory": [{"label": "idle", "used": 2**30}],
    }
    records = [_rec(), _rec(phase="phase2", engine="b", start=200)]
    summary = sr.summarize(result, records)
    assert len(summary["rows"]) == 4 and summary["verdict"] == "fail"
    assert summary["limit_checks"]["fixed"]["held"] is True
    assert summary["verdicts"]["limit_never_exceeded"] is None  # the shared run never polled
    table = sr.render_table(summary)
    assert table.count("| fixed | phase") == 4 and "Verdict: fail" in table
    assert "shared failed" in table and "Error in shared: StepFailed: boom" in table and "idle 1.00 GiB" in table
    assert json.loads(json.dumps(summary)) == summary


# -- the server command, the dry run -----------------------------------------------------------------------------------
def test_the_engine_command_takes_serve_sleeps_server_with_this_runs_limits():
    cmd = sr.engine_command(8123, "b", util=0.35, max_num_seqs=32)
    value = {flag: cmd[cmd.index(flag) + 1] for flag in ("--port", "--served-model-name", "--gpu-memory-utilization")}
    assert value == {"--port": "8123", "--served-model-name": "engine-b", "--gpu-memory-utilization": "0.35"}
    assert cmd[cmd.index("--max-num-seqs") + 1] == "32" and cmd[cmd.index("--max-model-len") + 1] == "2048"
    assert cmd[cmd.index("--block-size") + 1] == "16" and "--no-enable-prefix-caching" in cmd
    sizes = json.loads(cmd[cmd.index("--compilation-config") + 1])["cudagraph_capture_sizes"]
    assert max(sizes) == 32
    for gone in ("--enable-sleep-mode", "--enable-prefix-caching", "--worker-extension-cls", PROBE):
        assert gone not in cmd
    assert len([c for c in cmd if c.startswith("--")]) == len({c for c in cmd if c.startswith("--")})


def test_flags_are_replaced_where_present_appended_where_not_and_dropped_with_their_value():
    assert sr.set_flag(["x", "--a", "1"], "--a", "2") == ["x", "--a", "2"]
    assert sr.set_flag(["x"], "--a", "2") == ["x", "--a", "2"]
    assert sr.drop_flag(["x", "--a", "1", "--b"], "--a", takes_value=True) == ["x", "--b"]
    assert sr.drop_flag(["x", "--b"], "--b") == ["x"] and sr.drop_flag(["x"], "--b") == ["x"]
    with pytest.raises(ValueError, match="without a value"):
        sr.set_flag(["x", "--a"], "--a", "2")


def test_the_dry_run_prints_both_commands_and_the_schedule_and_starts_nothing(tmp_path, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the dry run started something")

    monkeypatch.setattr(subprocess, "Popen", refuse)  # every launcher's (serve_sleep.launch_server's too)
    out = tmp_path / "out"
    assert sr.main([str(out), "--dry-run", "--budget-seconds", "540"]) == 0
    text = capsys.readouterr().out
    assert not out.exists()
    assert "--served-model-name engine-a" in text and "--served-model-name engine-b" in text
    assert "EXTENSIBLE_KV_CACHE=1" in text and "VLLM_SERVER_DEV_MODE=1" in text
    assert "phase length: 60.0 s" in text and "4227858432 bytes = 1.5 x 1536 blocks" in text
    assert text.count("heavy 32 worker(s)") == 4 and "a then b" in text
    assert sr.main([str(out), "--dry-run", "--budget-seconds", "200"]) == 0
    assert "phase length: not enough time" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["--util", "1.2"],
        ["--budget-seconds", "0"],
        ["--heavy-workers", "x"],
        ["--arrivals", "poisson"],
        ["--rate-factor", "0"],
    ],
)
def test_the_command_line_refuses_values_out_of_range(argv, capsys):
    with pytest.raises(SystemExit):
        sr.parser().parse_args(["out", *argv])


# -- the streaming client against a local server -----------------------------------------------------------------------
def _serve(chunks, status=200, delay=0.15):
    """A server on 127.0.0.1 that answers every POST with ``chunks`` as SSE, chunked, ``delay`` s before the first."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            if status != 200:
                body = b'{"error": "overloaded"}'
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            time.sleep(delay)
            for chunk in chunks:
                data = f"data: {chunk}\n\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
                time.sleep(0.02)
            self.wfile.write(b"0\r\n\r\n")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _stream(chunks, status=200, max_tokens=3):
    server, url = _serve(chunks, status)
    try:
        return sr.stream_completion(url, "engine-a", [5, 6, 7], max_tokens, timeout=10)
    finally:
        server.shutdown()
        server.server_close()


def _choice(finish=None):
    return json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": finish}]})


USAGE = json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}})


def test_the_client_times_the_first_token_and_the_end_and_reads_the_usage():
    got = _stream([_choice(), _choice(), _choice("length"), USAGE, "[DONE]"])
    assert got["ok"] is True and got["error"] is None and got["status"] == 200
    assert got["output_tokens"] == 3 and got["finish_reason"] == "length"
    assert 0.15 <= got["ttft_s"] < got["e2e_s"] and got["e2e_s"] - got["ttft_s"] >= 0.05


@pytest.mark.parametrize(
    "chunks, status, reason",
    [
        ([_choice(), USAGE], 200, "without [DONE]"),
        ([USAGE, "[DONE]"], 200, "no chunk carried a choice"),
        ([_choice("length"), "[DONE]"], 200, "None output tokens"),
        ([_choice(), json.dumps({"error": {"message": "oom"}}), "[DONE]"], 200, "error in the stream"),
        ([], 503, "HTTP 503"),
    ],
)
def test_the_client_fails_a_request_that_did_not_stream_every_token(chunks, status, reason):
    got = _stream(chunks, status)
    assert got["ok"] is False and reason in got["error"]


def test_the_client_fails_a_short_completion_and_a_server_that_is_not_there():
    assert "3 output tokens, expected 4" in _stream([_choice(), USAGE, "[DONE]"], max_tokens=4)["error"]
    server, url = _serve([])
    server.server_close()  # nothing listens there any more
    got = sr.stream_completion(url, "engine-a", [1], 1, timeout=2)
    assert got["ok"] is False and "Error" in got["error"]


# -- a phase, the sink, the poller, the resizes ------------------------------------------------------------------------
def test_a_phase_sends_each_engines_load_and_fails_what_the_drain_did_not_finish():
    sent = []
    lock = threading.Lock()

    def send(url, model, prompt, max_tokens):
        with lock:
            sent.append((url, model))
        time.sleep(0.05 if model == "engine-a" else 5.0)  # b's requests outlive the drain
        return {"ok": True, "ttft_s": 0.01, "e2e_s": 0.05, "output_tokens": max_tokens}

    heavy = sr.replace(sr.HEAVY, workers=3, prompt_lo=4, prompt_hi=8, ramp_s=0.1)
    light = sr.replace(sr.LIGHT, prompt_lo=4, prompt_hi=8, think_lo=0.0, think_hi=0.01)
    urls = {"a": "http://a", "b": "http://b"}
    meta, records = sr.run_phase("fixed", "phase1", "a", urls, 0.4, send, 1, 100, heavy, light, 0.2, settle_s=0.0)
    a = [r for r in records if r["engine"] == "a"]
    b = [r for r in records if r["engine"] == "b"]
    assert {r["worker"] for r in a} == {0, 1, 2} and all(r["ok"] and r["role"] == "heavy" for r in a)
    assert len(a) >= 9  # three workers, back to back, for 0.4 s
    assert len(b) == 1 and b[0]["ok"] is False and "drain" in b[0]["error"] and b[0]["role"] == "light"
    assert all(r["config"] == "fixed" and r["phase"] == "phase1" for r in records)
    assert meta["drained"] - meta["start"] < 1.5 and meta["busy"] == "a" and meta["unsettled"] == 1


def test_open_arrivals_send_on_schedule_without_waiting_for_replies_and_the_drain_counts_the_rest():
    lock, sent = threading.Lock(), []

    def send(url, model, prompt, max_tokens):
        with lock:
            sent.append(time.monotonic())
            n = len(sent)
        time.sleep(0.3 if n <= 5 else 5.0)  # the later ones outlive the drain
        return {"ok": True, "ttft_s": 0.01, "e2e_s": 0.3, "output_tokens": max_tokens}

    heavy = sr.replace(sr.HEAVY, prompt_lo=4, prompt_hi=8, rate=60.0)
    light = sr.replace(sr.LIGHT, prompt_lo=4, prompt_hi=8, think_lo=5.0, think_hi=5.0)
    urls = {"a": "x", "b": "y"}
    meta, records = sr.run_phase("shared", "phase1", "a", urls, 0.5, send, 1, 100, heavy, light, 0.5, settle_s=0.0)
    due, expected = 0.0, 0
    for spec in sr.worker_requests(1, "phase1", "a", heavy, 0, 100):
        due += spec.think_s
        if due >= 0.5:
            break
        expected += 1
    assert 15 <= expected <= 50 and abs(len(records) - expected) <= 1  # the schedule, not one request per 0.3 s
    assert {r["worker"] for r in records} == {0} and all(r["role"] == "heavy" for r in records)
    assert sum(r["ok"] for r in records) == 5 and all("drain" in r["error"] for r in records if not r["ok"])
    assert all(0 <= r["dispatch_lag_s"] < 0.2 for r in records)  # sent on schedule, not after the replies
    row = sr.phase_row(meta, "a", records, [])
    assert row["dispatch_lag_p99_s"] == pytest.approx(sr.percentile([r["dispatch_lag_s"] for r in records], 99))
    assert meta["drained"] - meta["start"] < 1.5


def test_the_open_rate_is_the_busy_engines_completions_per_second_at_the_fixed_split():
    phases = [_meta("calibrate", "phase1", "a", start=100.0), _meta("calibrate", "phase2", "b", start=200.0)]
    records = [_rec("calibrate", "phase1", "a", start=100.0 + i, e2e=2.0) for i in range(10)]
    records += [_rec("calibrate", "phase1", "a", ok=False), _rec("calibrate", "phase1", "b", start=100.0)]
    records += [_rec("calibrate", "phase2", "b", start=200.0 + i / 2, e2e=1.0) for i in range(30)]
    rates = sr.calibrated_rates(phases, records, factor=1.0)
    assert rates["phase1"] == {"busy": "a", "completed": 10, "span_s": 11.0, "rate": 10 / 11.0}
    assert rates["phase2"]["completed"] == 30 and rates["phase2"]["rate"] == pytest.approx(30 / 15.5)
    assert sr.calibrated_rates(phases, records, factor=1.5)["phase1"]["rate"] == pytest.approx(1.5 * 10 / 11.0)
    with pytest.raises(sr.StepFailed, match="phase2: the busy engine completed no request"):
        sr.calibrated_rates(phases, [r for r in records if r["phase"] == "phase1"])
    backwards = [_rec("calibrate", "phase1", "a", start=90.0, e2e=1.0)]  # the wall clock stepped back
    with pytest.raises(sr.StepFailed, match="phase1"):
        sr.calibrated_rates(phases[:1], backwards)


def test_with_open_arrivals_the_calibration_comes_first_and_the_table_names_the_rates():
    args = sr.parser().parse_args(["out", "--arrivals", "open"])
    assert sr.configs(args) == ("calibrate", "fixed", "shared")
    assert sr.configs(sr.parser().parse_args(["out"])) == ("fixed", "shared")
    runs = {
        c: {"phases": [_meta(c, "phase1", "a", start=100.0 * i)], "polls": []} for i, c in enumerate(sr.configs(args))
    }
    records = [_rec(c, "phase1", "a", start=100.0 * i) for i, c in enumerate(sr.configs(args))]
    rate = {"busy": "a", "completed": 1, "span_s": 2.0, "rate": 0.5}
    summary = sr.summarize({"runs": runs, "rates": {"phase1": rate}}, records)
    assert [r["config"] for r in summary["rows"] if r["engine"] == "a"] == ["calibrate", "fixed", "shared"]
    table = sr.render_table(summary)
    assert "\n\nOpen arrivals, phase1: 0.50 requests/s to a (calibrate: 1 completed in 2.0 s)" in table  # not a row


def test_requests_that_outlive_the_drain_fail_then_settle_before_the_next_phase_and_count_late():
    def send(url, model, prompt, max_tokens):
        time.sleep(0.4)  # past the drain, within the settle
        return {"ok": True, "ttft_s": 0.01, "e2e_s": 0.4, "output_tokens": max_tokens}

    heavy = sr.replace(sr.HEAVY, prompt_lo=4, prompt_hi=4, rate=20.0)
    light = sr.replace(sr.LIGHT, prompt_lo=4, prompt_hi=4, think_lo=5.0, think_hi=5.0)
    urls = {"a": "x", "b": "y"}
    meta, records = sr.run_phase("fixed", "phase1", "a", urls, 0.3, send, 1, 100, heavy, light, 0.05, settle_s=2.0)
    assert records and all(not r["ok"] and "drain" in r["error"] for r in records)
    assert meta["late"] == len(records) and meta["unsettled"] == 0  # ended during the settle, not in the next phase


def test_a_sender_that_raises_fails_its_request_and_the_worker_goes_on():
    def send(url, model, prompt, max_tokens):
        raise RuntimeError("refused")

    heavy = sr.replace(sr.HEAVY, workers=1, prompt_lo=4, prompt_hi=4)
    light = sr.replace(sr.LIGHT, workers=1, prompt_lo=4, prompt_hi=4, think_lo=0.3, think_hi=0.3)
    _, records = sr.run_phase("shared", "phase2", "b", {"a": "x", "b": "y"}, 0.1, send, 1, 100, heavy, light, 0.2, 0.0)
    b = [r for r in records if r["engine"] == "b"]
    assert len(b) > 1 and all(r["ok"] is False and "RuntimeError: refused" in r["error"] for r in b)
    assert not [r for r in records if r["engine"] == "a"]  # its think time outlasted the phase


def test_the_sink_keeps_late_ends_apart():
    sink = sr.Sink()
    sink.begin(("a", 1), {"n": 1})
    sink.begin(("a", 2), {"n": 2})
    sink.end(("a", 1), {"n": 1, "ok": True})
    records = sink.close()
    assert records[0] == {"n": 1, "ok": True} and records[1]["ok"] is False
    sink.end(("a", 2), {"n": 2, "ok": True})
    assert len(sink.records) == 2 and sink.late == [{"n": 2, "ok": True}]


def test_the_poller_records_polls_and_the_errors_of_those_that_raised():
    calls = iter([{"time": 1}, RuntimeError("gone"), {"time": 3}])

    def poll():
        got = next(calls, {"time": 9})
        if isinstance(got, Exception):
            raise got
        return got

    poller = sr.Poller(poll, 0.01)
    poller.start()
    time.sleep(0.1)
    records = poller.stop(1.0)
    assert not poller.is_alive()
    assert records[:3] == [{"time": 1}, {"time": records[1]["time"], "error": "RuntimeError: gone"}, {"time": 3}]


class _Engine:
    def __init__(self, name, blocks, calls):
        self.name, self.blocks, self.calls = name, blocks, calls

    def state(self):
        return {"num_blocks": self.blocks}

    def resize(self, n):
        self.calls.append((self.name, n))
        self.blocks = n
        return {"from": self.blocks, "to": n}


def test_resizing_both_engines_shrinks_before_it_grows_and_skips_an_engine_at_its_target():
    calls = []
    engines = [_Engine("a", 100, calls), _Engine("b", 5_000, calls), _Engine("c", 7, calls)]
    sr.resize_all(engines, {"a": 1_152, "b": 1_152, "c": 7})
    assert calls == [("b", 1_152), ("a", 1_152)]


def test_a_server_that_never_answers_fails_the_start_is_stopped_and_the_files_say_so(tmp_path, monkeypatch, capsys):
    from integration.serve_sleep import group_alive

    monkeypatch.setattr(sr, "engine_command", lambda *a, **k: [sr.sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(sr, "START_TIMEOUT_S", 1.5)
    monkeypatch.setattr(sr, "nvidia_smi_used", lambda: None)
    args = sr.parser().parse_args([str(tmp_path), "--budget-seconds", "400"])
    assert sr.run_all(args) == 1
    summary = json.loads((tmp_path / "share-summary.json").read_text())
    assert summary["stages"]["start"]["state"] == "failed" and summary["stages"]["shared"] == {"state": "not run"}
    assert "engine a" in summary["error"]["error"] and summary["verdict"] == "fail"
    stop = summary["stop"]["a"]
    assert stop["signals"] == ["SIGTERM"] and stop["exit"] is not None
    assert not group_alive(summary["engines"]["a"]["pid"])
    assert "b" not in summary["stop"]  # b never started: a's failure ends the start
    assert (tmp_path / "engine-a.log").exists() and (tmp_path / "share-table.md").read_text() in capsys.readouterr().out
