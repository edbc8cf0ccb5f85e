"""Decode throughput of a resized ``vllm serve`` engine against a never-resized one of the same model and settings on
the same GPU, in paired windows (issue #45: the resized engine at >= 0.995 of the other).

    python -m integration.decode_pair_run OUT [--model qwen3-0.6b-shape|llama-8b-shape] [--runner v1|v2]
        [--rounds R] [--max-tokens T] [--budget-seconds S] [--dry-run]

Writes ``OUT/decode-pair-summary.json`` (rows, checks, verdict, every window with its start, end, tokens, engine,
round and phase, the resize replies and times, the engines' states), ``OUT/decode-pair-table.md`` and
``OUT/engine-<name>.log`` (each server's output), and prints the table last. Exit status 1 when a stage did not
finish (the table says which); a failed verdict is in the table, not in the status. ``--dry-run`` prints the server
commands, their environment and the schedule with its expected seconds, and starts nothing.

The engines, ``a`` (never resized) and ``b`` (resized): ``integration/share_run.py``'s ``engine_command`` (dummy
weights, no tokenizer, max_model_len 2048, 64 sequences, 16-token blocks, prefix caching off, the plugin with
``EXTENSIBLE_KV_CACHE=1``, ``VLLM_SERVER_DEV_MODE=1`` for ``POST /collective_rpc``) with ``--model`` set to the
chosen shape and ``--gpu-memory-utilization`` 0.42 each (two 8B engines on an 80 GB card: 2 x 33.6 GB, each with
16 GB of weights and about 15 GB of KV). They start one after the other (share_run's Note [One engine after the
other]) and are stopped together at the end (``share_run.stop_all``).

A window: ``max_num_seqs`` streamed ``/v1/completions`` sent at once to one engine (``share_run.stream_completion``:
greedy, ``ignore_eos``), each with its own fixed prompt of ``PROMPT_LEN`` token ids (the same prompts in every
window on both engines), ``max_tokens`` T; its throughput is the output tokens of its requests over the last end
less the first start. Only one engine has a window at a time. A round is four windows, ``a b b a`` or ``b a a b``
(Note [Paired windows, in both orders]); its ratio is the mean of ``b``'s two window throughputs over the mean of
``a``'s.

The stages: ``start`` (both servers up, each engine's ``extensible_kv_kv_state``); ``warmup`` (one round, not
measured; its windows' seconds size the rounds: ``rounds_that_fit``); ``before`` (R rounds, neither resized: the
pair's own bias and spread); ``resize`` (a load of ``max_num_seqs`` requests on ``b`` whose prompts hold at least
twice the shrink's blocks; once they run, ``b`` is resized to ``resize_run.shrink_target`` (10% of its blocks, not
below its floor), which preempts the requests holding blocks above it, held ``HOLD_S`` under the load, then resized
back to all of its blocks; both replies and their times recorded, the load's requests must finish); ``after`` (R
rounds). The figures: the decode ratio ``median(after round ratios) / median(before round ratios)``, the before
rounds' spread (min, max, IQR), and a 95% bootstrap interval of the ratio (``bootstrap_interval``: rounds resampled
with replacement within each phase, ``BOOTSTRAP_RESAMPLES`` times, seeded). The verdict: pass when the ratio is at
least ``TARGET`` (0.995) and no request failed; the table also says whether the interval is at most 0.5% wide
(whether the run resolves the target's margin) and whether it lies clear of the target.

The time box (8B shape on an H100, the defaults R = 6, T = 256): a window decodes 256 steps of 64 sequences at
about 12 ms a step, 3.1 s, plus its prefill and the streams' end, about 3.5 s (``EXPECTED_WINDOW_S``); 13 rounds
(warmup, 6 before, 6 after) x 4 windows x 3.5 s = 182 s; two server starts at about 75 s = 150 s; the resize stage
about 15 s; stopping both about 15 s: about 362 s, 6 minutes. ``--budget-seconds`` (480) is the hard box: after
the warmup, R is cut to the rounds that fit what is left at the measured window time (``rounds_that_fit``; fewer
than ``MIN_ROUNDS`` fails the ``before`` stage).

Note [Paired windows, in both orders]
    Rule: the resized engine is compared with a second engine of the same model and settings that is never
    resized, window against window on one GPU, in rounds ``a b b a`` then ``b a a b``; the figure is the median
    of the rounds after the resize over the median of the rounds before it, so the pair's own bias (the two
    engines' starts differ: compile cache, allocator history) divides out.
    Why: on the H100 two runs of one engine with nothing between them differed by up to 2.6% (``resize_run``'s
    Note [Decode before and after, in the same engine]), five times the 0.5% the target allows. A round puts
    each engine at the same mean position (drift that is linear over a round cancels), the alternation puts each
    first after a switch equally often, and the before rounds measure what the pair differs by when nothing was
    resized. The interval and the before rounds' IQR say whether the run could resolve 0.5% at all.
    Figure: on an H200 (8B shape, V1, 6 rounds a phase, windows of about 1.7 s) the before rounds' ratios spread
    over 0.991-1.013 (IQR 1.1%); the decode ratio was 0.9986 with a 95% interval of [0.9776, 1.0069], 2.9% wide:
    six rounds do not resolve 0.5%. Run ``reports/runs/h200-2026-12-07-decode-pair``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # python integration/decode_pair_run.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from extensible_kv.vllm.coordinator import ServeEngine
from integration.resize_run import shrink_target
from integration.serve_sleep import (
    Client,
    ServerProcess,
    StepFailed,
    _exit_on_sigterm,
    free_port,
    launch_server,
    log_tail,
    server_env,
    server_env_changes,
    wait_healthy,
    write_plugin_dist,
)
from integration.share_run import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    RPC_TIMEOUT_S,
    START_TIMEOUT_S,
    Sender,
    Stage,
    engine_command,
    fraction,
    http_sender,
    percentile,
    positive,
    resize_all,
    served_name,
    set_flag,
    stop_all,
)
from integration.sleep_mode import nvidia_smi_used, write_json

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("qwen3-0.6b-shape", "llama-8b-shape")
ENGINES = ("a", "b")  # a: never resized; b: resized
RESIZED = "b"
PHASES = ("before", "after")
UTILIZATION = 0.42  # each engine: two 8B engines fit an 80 GB card
PROMPT_LEN, MAX_TOKENS, ROUNDS, MIN_ROUNDS = 32, 256, 6, 2
TARGET = 0.995
RESOLUTION = 0.005  # the target's margin: an interval at most this wide resolves it
BOOTSTRAP_RESAMPLES, LEVEL = 2000, 0.95
SEED = 2026
HOLD_S = 2.0  # b held at the shrunk size under the load
LOAD_WAIT_S = 30.0  # for the resize load's requests to be running before the shrink
SETTLE_S = 0.5  # then this long, so they are decoding
POLL_S = 0.2
WINDOW_TIMEOUT_S = 300.0  # a window's requests not back by then count as failed
EXPECTED_START_S = 75.0  # one server (the dry run's schedule only)
EXPECTED_WINDOW_S = {"qwen3-0.6b-shape": 2.0, "llama-8b-shape": 3.5}  # at T = 256 (the dry run's schedule)
RESIZE_STAGE_S = 15.0  # the resize stage (the dry run's schedule, and reserved before the rounds are sized)
END_RESERVE_S = 45.0  # stopping both servers and writing the files
STOP_RESERVE_S = 15.0  # stopping both servers (the dry run's schedule)
ROUND_MARGIN = 1.15  # a round's expected seconds: 4 windows x the warmup's window time x this


# -- the schedule (pure) -----------------------------------------------------------------------------------------------
def round_order(index: int) -> tuple[str, ...]:
    """The engines' order in round ``index``: ``a b b a`` for an even round, ``b a a b`` for an odd one (Note
    [Paired windows, in both orders])."""
    first, second = ENGINES if index % 2 == 0 else ENGINES[::-1]
    return (first, second, second, first)


def schedule(rounds: int) -> list[dict]:
    """Every window in order: one warmup round, ``rounds`` before, ``rounds`` after (the resize between)."""
    out = []
    for phase, count in (("warmup", 1), ("before", rounds), ("after", rounds)):
        for r in range(count):
            out += [{"phase": phase, "round": r, "slot": s, "engine": e} for s, e in enumerate(round_order(r))]
    return out


def rounds_that_fit(left_s: float, window_s: float, rounds: int, reserve_s: float = RESIZE_STAGE_S + END_RESERVE_S):
    """The most rounds per phase, at most ``rounds``, whose two phases fit ``left_s`` less ``reserve_s`` at
    ``window_s`` a window (``ROUND_MARGIN`` on top)."""
    per_round = len(round_order(0)) * window_s * ROUND_MARGIN
    if per_round <= 0:
        return rounds
    return max(0, min(rounds, math.floor((left_s - reserve_s) / (len(PHASES) * per_round))))


def fixed_prompts(count: int, length: int, vocab: int, seed: int = SEED) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids in ``[3, vocab)``, the same for a seed."""
    rng = random.Random(f"{seed}/prompts/{count}/{length}")
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def load_prompt_len(
    target_blocks: int, requests: int, max_tokens: int, block_size: int = BLOCK_SIZE, max_model_len: int = MAX_MODEL_LEN
) -> int:
    """The resize load's prompt length: its ``requests`` prompts hold at least twice ``target_blocks`` (so at least
    half of the blocks they hold lie above the shrink's count, whatever order the pool handed them out in), within
    ``max_model_len`` with ``max_tokens`` to go."""
    wanted = math.ceil(2 * target_blocks / requests) * block_size
    return max(PROMPT_LEN, min(wanted, max_model_len - max_tokens))


# -- the figures (pure) ------------------------------------------------------------------------------------------------
def window_figures(records: Sequence[Mapping]) -> dict:
    """One window from its requests' records (``start``, ``end``, ``ok``, ``tokens``): the output tokens of the
    requests that succeeded over the last end less the first start."""
    if not records:
        return {
            "requests": 0,
            "failed": 0,
            "tokens": 0,
            "start": None,
            "end": None,
            "seconds": None,
            "tokens_per_s": None,
        }
    start = min(r["start"] for r in records)
    end = max(r["end"] for r in records)
    tokens = sum(r.get("tokens") or 0 for r in records if r.get("ok"))
    seconds = end - start
    return {
        "requests": len(records),
        "failed": sum(1 for r in records if not r.get("ok")),
        "tokens": tokens,
        "start": start,
        "end": end,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 and tokens > 0 else None,
    }


def round_ratio(windows: Sequence[Mapping]) -> float:
    """A round's ratio: the mean of ``b``'s window throughputs over the mean of ``a``'s; ValueError when either
    engine has no window with a throughput."""
    rates = {e: [w["tokens_per_s"] for w in windows if w["engine"] == e and w.get("tokens_per_s")] for e in ENGINES}
    if not all(rates.values()):
        raise ValueError(f"a round needs windows with a throughput on both engines, got {rates}")
    return statistics.fmean(rates[RESIZED]) / statistics.fmean(rates["a"])


def phase_ratios(windows: Sequence[Mapping], phase: str) -> list[float]:
    """The ratios of ``phase``'s complete rounds (all four windows timed), in round order; a round a failed stage
    cut short, or with a window that timed no tokens, has none."""
    out = []
    for r in sorted({w["round"] for w in windows if w["phase"] == phase}):
        mine = [w for w in windows if w["phase"] == phase and w["round"] == r]
        if len(mine) == len(round_order(r)) and all(w.get("tokens_per_s") for w in mine):
            out.append(round_ratio(mine))
    return out


def decode_ratio(before: Sequence[float], after: Sequence[float]) -> float | None:
    """The resized engine's decode over the never-resized one's, with the pair's own bias divided out:
    ``median(after) / median(before)``; ``None`` where a phase has no round."""
    if not before or not after:
        return None
    return statistics.median(after) / statistics.median(before)


def spread(ratios: Sequence[float]) -> dict:
    """Median, min, max and interquartile range (linear interpolation) of round ratios."""
    if not ratios:
        return {"rounds": 0, "median": None, "min": None, "max": None, "iqr": None}
    return {
        "rounds": len(ratios),
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "iqr": percentile(ratios, 75) - percentile(ratios, 25),
    }


def bootstrap_interval(
    before: Sequence[float],
    after: Sequence[float],
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = SEED,
    level: float = LEVEL,
) -> dict | None:
    """A percentile bootstrap interval of ``decode_ratio``: each phase's rounds resampled with replacement (the
    phases apart), ``resamples`` times from ``random.Random(seed)``; ``None`` where a phase has no round."""
    if not before or not after:
        return None
    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        b = [rng.choice(before) for _ in before]
        a = [rng.choice(after) for _ in after]
        values.append(statistics.median(a) / statistics.median(b))
    low = percentile(values, 100 * (1 - level) / 2)
    high = percentile(values, 100 * (1 + level) / 2)
    return {"low": low, "high": high, "width": high - low, "level": level, "resamples": resamples, "seed": seed}


def judge(ratio: float | None, interval: Mapping | None, failed: int, target: float = TARGET) -> dict:
    """The checks and the verdict: pass when the ratio is at least ``target`` and no request failed; whether the
    interval is at most ``RESOLUTION`` wide, and whether it lies clear of the target (``None``: not measured)."""
    checks = {
        "decode_at_target": None if ratio is None else ratio >= target,
        "no_failed_requests": failed == 0,
        "interval_resolves_half_percent": None if interval is None else interval["width"] <= RESOLUTION,
        "interval_clear_of_target": None
        if interval is None
        else (interval["low"] >= target or interval["high"] < target),
    }
    if ratio is None:
        verdict = "not measured"
    else:
        verdict = "pass" if checks["decode_at_target"] and checks["no_failed_requests"] else "fail"
    return {"checks": checks, "verdict": verdict}


def summarize(result: Mapping) -> dict:
    """Rows per phase, the ratio, its interval, the checks and the verdict from the run's windows."""
    windows = result.get("windows") or []
    measured = [w for w in windows if w["phase"] in PHASES]
    ratios = {p: phase_ratios(measured, p) for p in PHASES}
    rows = []
    for p in PHASES:
        mine = [w for w in measured if w["phase"] == p]
        rates = {e: [w["tokens_per_s"] for w in mine if w["engine"] == e and w.get("tokens_per_s")] for e in ENGINES}
        rows.append(
            {
                "phase": p,
                **spread(ratios[p]),
                "ratios": ratios[p],
                "a_tokens_per_s": statistics.fmean(rates["a"]) if rates["a"] else None,
                "b_tokens_per_s": statistics.fmean(rates["b"]) if rates["b"] else None,
                "windows": len(mine),
                "failed": sum(w["failed"] for w in mine),
            }
        )
    ratio = decode_ratio(ratios["before"], ratios["after"])
    interval = bootstrap_interval(ratios["before"], ratios["after"])
    resize = result.get("resize") or {}
    failed = sum(w["failed"] for w in measured) + ((resize.get("load") or {}).get("failed") or 0)
    judged = judge(ratio, interval, failed)
    shrink = next((r for r in resize.get("replies", []) if r.get("label") == "shrink"), None)
    premises = {
        "shrink_preempted": None if shrink is None else len(shrink.get("preempted") or []) > 0,
        "grown_back": None if not resize.get("replies") else resize.get("blocks_after") == resize.get("blocks_before"),
    }
    return {
        "rows": rows,
        "ratio": ratio,
        "target": TARGET,
        "interval": interval,
        "before_spread": spread(ratios["before"]),
        **judged,
        "premises": premises,
        "windows": windows,
        "resize": resize,
        "stages": result.get("stages", {}),
        "error": result.get("error"),
    }


def _num(value: float | None, fmt: str = "{:.4f}") -> str:
    return "-" if value is None else fmt.format(value)


def _flag(value: object) -> str:
    return "-" if value is None else "yes" if value is True else "NO" if value is False else str(value)


def render_table(summary: Mapping) -> str:
    """The summary as markdown: one row per phase, then the ratio, interval, verdict, checks, resize and stages."""
    lines = [
        "| phase | rounds | median b/a | min | max | IQR | a tok/s | b tok/s | windows | failed |",
        "|" + " --- |" * 10,
    ]
    for r in summary["rows"]:
        cells = [r["phase"], r["rounds"], _num(r["median"]), _num(r["min"]), _num(r["max"]), _num(r["iqr"])]
        cells += [_num(r["a_tokens_per_s"], "{:.0f}"), _num(r["b_tokens_per_s"], "{:.0f}"), r["windows"], r["failed"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    interval = summary.get("interval")
    span = (
        "-" if interval is None else f"[{interval['low']:.4f}, {interval['high']:.4f}] (width {interval['width']:.4f})"
    )
    lines += [
        "",
        f"Decode ratio (median after / median before): {_num(summary['ratio'])}; target >= {summary['target']}",
        f"Bootstrap {LEVEL:.0%} interval: {span}",
        f"Verdict: {summary['verdict']}",
    ]
    lines += [f"- {name.replace('_', ' ')}: {_flag(v)}" for name, v in summary["checks"].items()]
    lines += ["", "Premises:"] + [f"- {name.replace('_', ' ')}: {_flag(v)}" for name, v in summary["premises"].items()]
    rounds = summary.get("rounds") or {}
    if rounds:
        lines += [
            "",
            f"Rounds: {rounds['run']} before and after (asked {rounds['asked']}), {rounds['window_s']:.2f} s a window "
            f"in the warmup",
        ]
    resize = summary.get("resize") or {}
    if resize.get("replies"):
        lines += ["", f"Resize of {RESIZED} under a load of prompts of {resize.get('prompt_len')} tokens:"]
    for reply in resize.get("replies", []):
        lines.append(
            f"- resize {reply.get('label')}: {reply.get('from')} -> {reply.get('to')} blocks, "
            f"{_num(reply.get('client_seconds'), '{:.3f}')} s at the client, "
            f"{len(reply.get('preempted') or [])} preempted"
        )
    stages = summary.get("stages") or {}
    lines += ["", "Stages: " + ", ".join(f"{name} {s['state']}" for name, s in stages.items())]
    if summary.get("error"):
        lines.append(f"Error in {summary['error']['stage']}: {summary['error']['error'][:300]}")
    return "\n".join(lines) + "\n"


# -- a window ----------------------------------------------------------------------------------------------------------
def run_window(url: str, model: str, prompts: Sequence[Sequence[int]], max_tokens: int, send: Sender) -> list[dict]:
    """Every prompt sent at once (one thread each, released together), each request's start, end, tokens and
    outcome; one not back within ``WINDOW_TIMEOUT_S`` counts as failed."""
    records: list[dict | None] = [None] * len(prompts)
    gate = threading.Barrier(len(prompts))

    def one(slot: int) -> None:
        try:
            gate.wait(timeout=30)
        except threading.BrokenBarrierError:
            pass
        start = time.time()
        try:
            reply = send(url, model, prompts[slot], max_tokens)
        except Exception as exc:  # a sender that raised: the request failed
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        records[slot] = {
            "slot": slot,
            "start": start,
            "end": time.time(),
            "ok": bool(reply.get("ok")),
            "tokens": reply.get("output_tokens") or 0,
            "ttft_s": reply.get("ttft_s"),
            "error": reply.get("error"),
        }

    threads = [threading.Thread(target=one, args=(s,), daemon=True) for s in range(len(prompts))]
    for t in threads:
        t.start()
    until = time.monotonic() + WINDOW_TIMEOUT_S
    for t in threads:
        t.join(max(0.0, until - time.monotonic()))
    now = time.time()
    return [
        r if r is not None else {"slot": s, "start": now, "end": now, "ok": False, "tokens": 0, "error": "timed out"}
        for s, r in enumerate(records)
    ]


# -- the run -----------------------------------------------------------------------------------------------------------
@dataclass
class PairRun:
    """What the stages share: the output folder, the deadline, the servers and the result being built."""

    out: Path
    args: argparse.Namespace
    deadline: float
    memory: Callable[[], int | None] = nvidia_smi_used
    send: Sender = field(default_factory=http_sender)
    servers: dict[str, ServerProcess] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    result: dict = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def read_memory(self, label: str) -> None:
        self.result.setdefault("memory", []).append({"label": label, "used": self.memory(), "time": time.time()})

    def engine(self, name: str) -> ServeEngine:
        return ServeEngine(name, self.urls[name], RPC_TIMEOUT_S)


def model_dir(model: str) -> Path:
    return ROOT / "integration" / "models" / model


def pair_command(port: int | str, name: str, args: argparse.Namespace, python: str = sys.executable) -> list[str]:
    """``share_run.engine_command`` for one engine of the pair, with the chosen model."""
    command = engine_command(port, name, args.util, args.max_num_seqs, python)
    return set_flag(command, "--model", str(model_dir(args.model)))


def vocab(model: str) -> int:
    return json.loads((model_dir(model) / "config.json").read_text())["vocab_size"]


def start_servers(run: PairRun, plugin_dir: str) -> None:
    """Each server once the one before answers ``/health`` (share_run's Note [One engine after the other])."""
    env = server_env("extensible", run.args.runner, plugin_dir, dict(os.environ))
    run.read_memory("idle")
    for name in ENGINES:
        port = free_port()
        run.urls[name] = f"http://127.0.0.1:{port}"
        command = pair_command(port, name, run.args)
        log = run.out / f"engine-{name}.log"
        run.servers[name] = launch_server(command, env, log)
        engine = run.result.setdefault("engines", {}).setdefault(name, {})
        engine |= {"url": run.urls[name], "command": command, "pid": run.servers[name].proc.pid}
        timeout = min(START_TIMEOUT_S, run.left() - END_RESERVE_S)
        if timeout <= 0:
            raise StepFailed(f"no time left to start engine {name}", "start")
        try:
            engine["start_s"] = wait_healthy(Client(run.urls[name]), run.servers[name], timeout)
        except StepFailed as exc:
            raise StepFailed(f"engine {name}: {exc}; log tail: {log_tail(log, 12)}", "start") from exc
        run.read_memory(f"{name} up")
    for name in ENGINES:
        run.result["engines"][name]["state_at_start"] = dict(run.engine(name).state())


def run_windows(run: PairRun, phase: str, rounds: int, prompts: Sequence[Sequence[int]]) -> None:
    """The windows of ``phase``'s ``rounds`` rounds in schedule order, each appended to ``result["windows"]``."""
    windows = run.result.setdefault("windows", [])
    for step in (s for s in schedule(rounds) if s["phase"] == phase):
        engine = step["engine"]
        records = run_window(run.urls[engine], served_name(engine), prompts, run.args.max_tokens, run.send)
        window = {**step, **window_figures(records)}
        window["errors"] = [r["error"] for r in records if not r["ok"]][:4]
        windows.append(window)


def size_rounds(run: PairRun) -> int:
    """The rounds per phase that fit the time left at the warmup's window time (``rounds_that_fit``)."""
    warm = [w for w in run.result.get("windows", []) if w["phase"] == "warmup"]
    window_s = (max(w["end"] for w in warm) - min(w["start"] for w in warm)) / len(warm)
    rounds = rounds_that_fit(run.left(), window_s, run.args.rounds)
    run.result["rounds"] = {"asked": run.args.rounds, "run": rounds, "window_s": window_s, "left_s": run.left()}
    if rounds < MIN_ROUNDS:
        raise StepFailed(f"{run.left():.0f} s left at {window_s:.1f} s a window: {rounds} rounds fit", "before")
    return rounds


def resize_under_load(run: PairRun) -> None:
    """``b`` shrunk to ``shrink_target`` while a load runs on it, held ``HOLD_S``, grown back to all of its blocks;
    the replies (with their times) and the load's requests recorded."""
    engine = run.engine(RESIZED)
    state = dict(engine.state())
    blocks, target = int(state["num_blocks"]), shrink_target(int(state["num_blocks"]), int(state["floor_blocks"]))
    length = load_prompt_len(target, run.args.max_num_seqs, run.args.max_tokens)
    prompts = fixed_prompts(run.args.max_num_seqs, length, vocab(run.args.model), run.args.seed + 1)
    info: dict = {"blocks_before": blocks, "target": target, "prompt_len": length, "replies": []}
    run.result["resize"] = info
    records: list[dict] = []
    url, model = run.urls[RESIZED], served_name(RESIZED)
    load = threading.Thread(
        target=lambda: records.extend(run_window(url, model, prompts, run.args.max_tokens, run.send)), daemon=True
    )
    load.start()
    until = time.monotonic() + LOAD_WAIT_S
    while time.monotonic() < until:
        seen = dict(engine.state())
        if seen["running"] >= run.args.max_num_seqs or not load.is_alive():
            break
        time.sleep(POLL_S)
    time.sleep(SETTLE_S)
    info["state_before_shrink"] = dict(engine.state())
    shrunk = False
    try:
        for label, to in (("shrink", target), ("grow", blocks)):
            start = time.time()
            replies = resize_all([engine], {RESIZED: to})
            end = time.time()
            info["replies"] += [
                r | {"label": label, "start": start, "end": end, "client_seconds": end - start} for r in replies
            ]
            shrunk = label == "shrink"
            if shrunk:
                info["state_shrunk"] = dict(engine.state())
                time.sleep(HOLD_S)
    finally:
        if shrunk:  # the grow did not happen: back to all blocks, or the after rounds measure a small engine
            resize_all([engine], {RESIZED: blocks})
        load.join(WINDOW_TIMEOUT_S)
    info["load"] = window_figures(records) | {"errors": [r["error"] for r in records if not r["ok"]][:4]}
    info["state_after"] = dict(engine.state())
    info["blocks_after"] = int(info["state_after"]["num_blocks"])
    if info["blocks_after"] != blocks:
        raise StepFailed(f"b has {info['blocks_after']} blocks after growing back, not {blocks}", "resize")


def write_outputs(run: PairRun) -> dict:
    summary = summarize(run.result)
    summary |= {k: run.result.get(k) for k in ("engines", "rounds", "memory", "stop", "args")}
    write_json(run.out / "decode-pair-summary.json", summary)
    table = render_table(summary)
    (run.out / "decode-pair-table.md").write_text(table)
    print(table, flush=True)
    return summary


STAGES = ("start", "warmup", "before", "resize", "after")


def run_all(args: argparse.Namespace, send: Sender | None = None) -> int:
    """Every stage in order, the servers stopped whatever happens, the files written; 1 when a stage did not
    finish."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = PairRun(out, args, time.monotonic() + args.budget_seconds)
    if send is not None:
        run.send = send
    run.result["args"] = dict(vars(args))
    prompts = fixed_prompts(args.max_num_seqs, PROMPT_LEN, vocab(args.model), args.seed)
    with tempfile.TemporaryDirectory(prefix="decode-pair-plugin-") as plugin_dir:
        write_plugin_dist(Path(plugin_dir))
        try:
            with Stage(run, "start"):
                start_servers(run, plugin_dir)
            with Stage(run, "warmup"):
                run_windows(run, "warmup", 1, prompts)
            with Stage(run, "before"):
                rounds = size_rounds(run)
                run_windows(run, "before", rounds, prompts)
            with Stage(run, "resize"):
                resize_under_load(run)
            with Stage(run, "after"):
                run_windows(run, "after", rounds, prompts)
        except BaseException:  # recorded by the stage (an interrupt too); the servers are stopped below
            pass
        finally:
            run.result["stop"] = stop_all(run.servers)
            run.read_memory("stopped")
    for name in STAGES:
        run.result.setdefault("stages", {}).setdefault(name, {"state": "not run"})
    write_outputs(run)
    return 0 if all(s["state"] == "complete" for s in run.result["stages"].values()) else 1


# -- the command line --------------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m integration.decode_pair_run", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="output folder")
    p.add_argument("--model", choices=MODELS, default="llama-8b-shape")
    p.add_argument("--runner", choices=("v1", "v2"), default="v1", help="vLLM's model runner")
    p.add_argument("--rounds", type=positive(int), default=ROUNDS, help="rounds before and after the resize, each")
    p.add_argument("--max-tokens", type=positive(int), default=MAX_TOKENS, help="output tokens of every request")
    p.add_argument("--budget-seconds", type=positive(float), default=480.0, help="the whole run, servers included")
    p.add_argument("--dry-run", action="store_true", help="print the commands and the schedule; start nothing")
    p.add_argument("--util", type=fraction, default=UTILIZATION, help="each engine's --gpu-memory-utilization")
    p.add_argument("--max-num-seqs", type=positive(int), default=MAX_NUM_SEQS, help="a window's requests")
    p.add_argument("--seed", type=int, default=SEED)
    return p


def expected_seconds(args: argparse.Namespace) -> dict:
    """The run's seconds as the dry run expects them (``EXPECTED_WINDOW_S`` scaled to ``--max-tokens``)."""
    window = EXPECTED_WINDOW_S[args.model] * args.max_tokens / MAX_TOKENS
    windows = len(schedule(args.rounds))
    starts = len(ENGINES) * EXPECTED_START_S
    total = starts + windows * window + RESIZE_STAGE_S + STOP_RESERVE_S
    return {"window_s": window, "windows": windows, "starts_s": starts, "total_s": total}


def schedule_lines(args: argparse.Namespace) -> list[str]:
    lines = []
    for phase in ("warmup", *PHASES):
        steps = [s for s in schedule(args.rounds) if s["phase"] == phase]
        for r in sorted({s["round"] for s in steps}):
            order = " ".join(s["engine"] for s in steps if s["round"] == r)
            lines.append(f"{phase} round {r}: {order}" + (" (not measured)" if phase == "warmup" else ""))
        if phase == "before":
            lines.append(
                f"resize {RESIZED}: to max(floor, 10% of its blocks) under {args.max_num_seqs} requests whose prompts "
                f"hold twice that, held {HOLD_S:g} s, then back to all of its blocks"
            )
    e = expected_seconds(args)
    lines += [
        f"a window: {args.max_num_seqs} streamed requests at once, prompts of {PROMPT_LEN} token ids, max_tokens "
        f"{args.max_tokens}, ignore_eos; throughput = output tokens / (last end - first start)",
        f"ratio: median(after round ratios) / median(before round ratios), round ratio mean(b)/mean(a); target >= "
        f"{TARGET}; bootstrap {LEVEL:.0%} interval from {BOOTSTRAP_RESAMPLES} resamples, seed {args.seed}",
        f"expected: {len(ENGINES)} starts x {EXPECTED_START_S:g} s + {e['windows']} windows x {e['window_s']:.1f} s + "
        f"resize {RESIZE_STAGE_S:g} s + stop {STOP_RESERVE_S:g} s = {e['total_s']:.0f} s "
        f"(budget {args.budget_seconds:g} s; the rounds are cut to what fits after the warmup)",
    ]
    return lines


def dry_run(args: argparse.Namespace) -> str:
    out = []
    for name in ENGINES:
        out += [f"engine {name}:", f"  command: {shlex.join(pair_command(f'PORT_{name.upper()}', name, args))}"]
    changes = server_env_changes("extensible", args.runner, "<plugin dir>", "$PYTHONPATH")
    out += ["  env (both, on top of this one's):"] + [f"    {k}={v}" for k, v in changes.items()]
    out.append(f"  start: {' then '.join(ENGINES)}, each once the one before answers /health ({args.model})")
    out += schedule_lines(args)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.dry_run:
        print(dry_run(args), end="")
        return 0
    return run_all(args)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # both servers are stopped too
    sys.exit(main())
