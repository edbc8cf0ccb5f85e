"""Two ``vllm serve`` engines on one GPU trading KV memory through the coordinator (``extensible_kv.vllm.coordinator``)
against a fixed 50/50 split of the same memory, under a load that moves from one engine to the other.

    python -m integration.share_run OUT [--budget-seconds S] [--dry-run] [--util U] [--headroom H] ...

Writes ``OUT/share-summary.json`` (rows, verdicts, premises, the limit, memory readings, stages, every poll),
``OUT/share-requests.json`` (one record per request), ``OUT/share-table.md`` and ``OUT/engine-<name>.log`` (each
server's output), and prints the table last. Exit status 1 when a stage did not finish (the table says which);
failed verdicts are in the table, not in the status. ``--dry-run`` prints the server commands, their environment,
the load schedule and the limit as the model's shape predicts it, and starts nothing.

The engines, ``a`` and ``b``: ``integration/serve_sleep.py``'s server command (the Qwen3-0.6B shape, dummy weights,
no tokenizer: prompts are token ids; plugin through a written ``*.dist-info``: Note [The plugin without an install]
there; ``VLLM_SERVER_DEV_MODE=1`` for ``POST /collective_rpc``; ``EXTENSIBLE_KV_CACHE=1``) with max_model_len 2048,
``--gpu-memory-utilization`` 0.4 each, 64 sequences, 16-token blocks, prefix caching off, no sleep mode, each
served under its own name. They start one after the other (Note [One engine after the other]).

The stages: ``start`` (both servers up); ``size`` (each engine's ``extensible_kv_kv_state``, the limit: Note [The
card's KV limit]; both resized to the fixed split, shrinks first); ``warmup`` (a few requests per engine, not
measured); ``fixed`` (the two phases at the fixed split, a monitor reading both states every ``--interval`` s);
``shared`` (both back at the fixed split, the ``Coordinator`` polling in a thread of this process with
``Policy(limit_bytes=LIMIT)``, the same two phases with the same requests). With ``--arrivals open``,
``calibrate`` (the fixed split under the closed load) runs first, and the busy engine's load in ``fixed`` and
``shared`` is open arrivals at its rate (Note [Open arrivals at the fixed split's rate]). A phase: ``phase1`` is
heavy on ``a`` and light on ``b``, ``phase2`` the other way; its length follows from the time left
(``phase_seconds``), the same for all. After a phase's time no request is sent; those in flight get ``DRAIN_S`` to
finish (later ones count as failed).

Per request (``stream_completion``: streamed ``/v1/completions``, standard library only): time to the first chunk
that carries a choice (TTFT), to ``[DONE]`` (end-to-end), the output tokens from the final usage chunk, and whether
it succeeded (HTTP 200, ``[DONE]``, ``max_tokens`` tokens: ``ignore_eos``). Per configuration, phase and engine:
TTFT p50/p99 (linear interpolation between ranks), end-to-end p50/p99, output tokens per second over the phase
(from its start to its last request's end), failed requests, the engine's block counts and waiting queue at the
polls. Memory in use (nvidia-smi, device-wide) at every stage boundary.

The verdicts: for the busy engine of each phase, shared beats fixed on TTFT p50 and on p99; no request failed in
either configuration; under the coordinator, at every poll, ``sum(num_blocks_i x bytes_per_block_i) <= LIMIT``
for the sizes read and for the sizes the poll left. The premises (context: a verdict means little without them):
the busy engine queued under the fixed split; it grew past its fixed share under the coordinator.

Note [One engine after the other]
    Rule: engine ``b`` starts once ``a`` answers ``/health``; neither starts while the other is being built.
    Why: an engine sizes its KV cache from device-wide readings taken since its own start: vLLM's profile counts
    another process's allocations as its own non-torch memory (and asserts when the other frees some), and the
    extensible path's final commit is ``requested - (init_free - free_now - kv_backed) - ...``, so an engine that
    commits while the other measures takes its whole commit out of the other's budget, which then falls below
    max_model_len and refuses to start. Started after ``a`` is up, ``b``'s readings hold only ``b``.
    Figure (arithmetic, not a measurement): utilization 0.4 of an 80 GiB card requests 32 GiB; ``a`` commits what
    its weights, graphs and working memory leave of it, about 29 GiB, all of which ``b`` measuring afterwards would
    count against its own 32 GiB. Cost: ``b``'s start (about a minute; ``a``'s compile cache shortens it).

Note [The card's KV limit]
    Rule: ``LIMIT = ceil(headroom x D x bytes_per_block)`` with ``D = heavy concurrency x ceil((mean prompt +
    max_tokens) / block_size)``, the blocks the busy phase's requests hold at their typical length (the larger
    engine's bytes where they differ); the fixed split gives each engine ``floor(LIMIT / 2 / bytes_per_block)``
    blocks (within its floor and reservation). ``headroom`` is 1.5.
    Why: the comparison needs a limit under which the busy engine queues at half (0.75 D) and fits when it takes
    what the idle one does not need (LIMIT less the other's floor, at least ``D / target_usage``); both are
    recorded (``limit.checks``), as is whether it really queued and grew (the premises).
    Figure: Qwen3-0.6B shape, 16-token blocks: 28 layers x 2 x 8 heads x 128 x 2 bytes x 16 = 1,835,008 bytes a
    block; D = 32 x ceil((640 + 128) / 16) = 1,536 blocks; LIMIT = 2,304 blocks (3.94 GiB); the fixed split 1,152
    each (about 8 of the 32 wait); shared, the busy one may reach 2,304 - 129 = 2,175 >= 1,536 / 0.8 = 1,920.

Note [The same load twice]
    Rule: every worker (engine, role, index) draws its requests from its own generator seeded by the seed, the
    phase, the engine and the worker, so both configurations send the same prompts in the same order; prefix
    caching is off, and a warmup runs before the fixed configuration.
    Why: a prompt seen in the first configuration would hit the prefix cache in the second, and the first requests
    an engine serves pay for lazy set-up; either would favour the configuration that runs second.
    Figure: ``tests/unit/test_share_run.py`` draws a worker's requests twice and compares them.

Note [A light engine goes idle]
    Rule: the light load is one worker that waits 1 to 3 s (seeded) before each request; the heavy load is 32
    workers sending back to back, started over ``RAMP_S``.
    Why: the policy keeps a busy engine's ask from the poll before for as long as it stays busy (Note [Never over
    the limit, never flapping] in the coordinator), and a busy engine that queued asked for its whole reservation;
    an engine that went from heavy to a light load that never leaves it idle keeps that ask, and the next busy one
    gets half of the room. With gaps between light requests a poll finds it idle and its ask is let go.
    Figure: a light request takes about 1 to 2 s, so about half the polls of a light engine find it idle.

Note [Open arrivals at the fixed split's rate]
    Rule: with ``--arrivals open`` the run first measures the fixed split under the closed load (``calibrate``),
    then sends the busy engine Poisson arrivals at ``rate-factor`` x the requests per second the fixed split
    completed there, phase by phase, the same seeded schedule to ``fixed`` and to ``shared``.
    Why: under closed arrivals each configuration sets its own load: the one that serves faster is sent more, so
    its steps mix more prefills with more decodes and its median TTFT measures that, not the memory. Users do not
    wait for each other: at one offered load both configurations serve the same requests, and the rate is the
    fixed split's own saturation point (its closed-loop throughput while it queued), chosen by neither side.
    Figure: H100, 2026-12-07, closed arrivals (``reports/runs/h100-2026-12-07-share``): the coordinator served
    4,199 requests to the fixed split's 3,477 in 60 s and its TTFT p50 was 54 ms to 49 (p99 110 to 595).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.error import HTTPError
from urllib.request import Request, urlopen

if __package__ in (None, ""):  # python integration/share_run.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from extensible_kv.vllm.coordinator import Coordinator, EngineLoad, Policy, ServeEngine
from integration.serve_sleep import (
    DIST_NAME,
    DIST_VERSION,
    MODEL,
    MODEL_DIR,
    PLUGIN_GROUP,
    PLUGIN_NAME,
    PLUGIN_TARGET,
    Client,
    ServerProcess,
    StepFailed,
    _exit_on_sigterm,
    free_port,
    launch_server,
    log_tail,
    server_command,
    server_env,
    server_env_changes,
    stop_group,
    wait_healthy,
    write_plugin_dist,
)
from integration.sleep_mode import MIB, nvidia_smi_used, write_json

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("a", "b")
PHASES = (("phase1", "a"), ("phase2", "b"))  # (name, the busy engine)
CONFIGS = ("fixed", "shared")
CALIBRATE = "calibrate"  # open arrivals: the fixed split under closed arrivals first, for the rate
ARRIVALS = ("closed", "open")
MAX_MODEL_LEN, UTILIZATION, MAX_NUM_SEQS, BATCHED_TOKENS, BLOCK_SIZE = 2048, 0.4, 64, 8192, 16
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
HEADROOM = 1.5  # Note [The card's KV limit]
SEED = 2026
INTERVAL_S, IDLE_POLLS, TARGET_USAGE = 1.0, 2, 0.8  # the coordinator's poll and policy
RPC_TIMEOUT_S = 30.0  # one state read or resize through /collective_rpc
REQUEST_TIMEOUT_S = 60.0  # one completion: no byte for this long fails it
WARMUP_REQUESTS, WARMUP_TOKENS = 4, 16
# The time box: phases get what the start left, the same length for all four.
EXPECTED_START_S = 75.0  # one server (the dry run's schedule only)
START_TIMEOUT_S = 300.0
SETUP_S = 10.0  # sizing and warmup (the dry run's schedule only)
MIN_PHASE_S, MAX_PHASE_S = 15.0, 60.0
DRAIN_S = 15.0  # after a phase's time, for the requests in flight
SETTLE_S = 5.0  # after the drain, for the requests it failed to end before the next phase starts
PHASE_OVERHEAD_S = DRAIN_S + SETTLE_S  # per phase (the resizes and readings around it take seconds)
END_RESERVE_S = 45.0  # stopping both servers and writing the files
STOP_GRACE_S = 15.0
TIME_CLEARANCE_S = 1e-3  # a check that must be strictly better: at least this much


# -- the load (pure) ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Load:
    """One role's workers on one engine: each sends a request, waits for its end, waits ``think`` s, repeats
    (closed arrivals). With ``rate`` > 0 the arrivals are open instead: one dispatcher sends a request every
    exponential gap of mean ``1 / rate`` s without waiting for any to end (Note [Open arrivals at the fixed split's
    rate]); ``workers`` and the think times do not apply."""

    role: str
    workers: int
    prompt_lo: int
    prompt_hi: int
    max_tokens: int
    think_lo: float = 0.0
    think_hi: float = 0.0
    ramp_s: float = 0.0  # worker w starts at w x ramp_s / workers
    rate: float = 0.0  # requests a second, open arrivals; 0: closed (workers back to back)

    @property
    def open(self) -> bool:
        return self.rate > 0

    @property
    def senders(self) -> int:
        """Threads drawing requests: one dispatcher for open arrivals, else one per worker."""
        return 1 if self.open else self.workers

    @property
    def mean_prompt(self) -> float:
        return (self.prompt_lo + self.prompt_hi) / 2


HEAVY = Load("heavy", workers=32, prompt_lo=256, prompt_hi=1024, max_tokens=128, ramp_s=2.0)
LIGHT = Load("light", workers=1, prompt_lo=256, prompt_hi=1024, max_tokens=128, think_lo=1.0, think_hi=3.0)


@dataclass(frozen=True)
class Spec:
    """One request a worker sends."""

    phase: str
    engine: str
    role: str
    worker: int
    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    think_s: float  # waited before sending it


def phase_loads(busy: str, heavy: Load = HEAVY, light: Load = LIGHT) -> dict[str, Load]:
    """The load on every engine in a phase whose busy engine is ``busy``."""
    if busy not in ENGINES:
        raise ValueError(f"no engine {busy!r}; engines: {ENGINES}")
    return {name: heavy if name == busy else light for name in ENGINES}


def start_offset(load: Load, worker: int) -> float:
    """Seconds after the phase's start at which ``worker`` sends its first request (Note [A light engine goes
    idle]); open arrivals start at once (their first gap is drawn like every other)."""
    return 0.0 if load.open else worker * load.ramp_s / load.workers


def worker_requests(seed: int, phase: str, engine: str, load: Load, worker: int, vocab: int) -> Iterator[Spec]:
    """The requests of one worker, endless, from its own seeded generator (Note [The same load twice])."""
    rng = random.Random(f"{seed}/{phase}/{engine}/{load.role}/{worker}")
    index = 0
    while True:
        length = rng.randint(load.prompt_lo, load.prompt_hi)
        if load.open:
            think = rng.expovariate(load.rate)
        else:
            think = rng.uniform(load.think_lo, load.think_hi) if load.think_hi > 0 else 0.0
        prompt = tuple(rng.randrange(3, vocab) for _ in range(length))
        yield Spec(phase, engine, load.role, worker, index, prompt, load.max_tokens, think)
        index += 1


def phase_seconds(remaining_s: float, phases: int = 2 * len(PHASES)) -> float | None:
    """Each phase's length when ``remaining_s`` are left for ``phases`` phases and the end: what is left after the
    reserves, shared out, at most ``MAX_PHASE_S``; ``None`` below ``MIN_PHASE_S`` (not enough time)."""
    share = (remaining_s - END_RESERVE_S - phases * PHASE_OVERHEAD_S) / phases
    if share < MIN_PHASE_S:
        return None
    return min(MAX_PHASE_S, share)


# -- the limit (pure) --------------------------------------------------------------------------------------------------
class SizingError(ValueError):
    """The limit cannot hold the engines' floors, or a fixed share falls below an engine's floor."""


def demand_blocks(load: Load, block_size: int) -> int:
    """The blocks ``load``'s requests hold together at their typical length (Note [The card's KV limit])."""
    return load.workers * math.ceil((load.mean_prompt + load.max_tokens) / block_size)


def fixed_blocks(limit_bytes: int, state: Mapping, engines: int = len(ENGINES)) -> int:
    """One engine's blocks under a fixed even split of ``limit_bytes``: within its reservation, never below its
    floor (``SizingError``)."""
    blocks = min(int(state["reserved_blocks"]), limit_bytes // engines // int(state["bytes_per_block"]))
    if blocks < int(state["floor_blocks"]):
        raise SizingError(
            f"a fixed share of {limit_bytes // engines} bytes holds {blocks} blocks of {state['bytes_per_block']} "
            f"bytes, below the engine's floor of {state['floor_blocks']}"
        )
    return blocks


def kv_limit(
    states: Mapping[str, Mapping],
    heavy: Load = HEAVY,
    block_size: int = BLOCK_SIZE,
    headroom: float = HEADROOM,
    target_usage: float = TARGET_USAGE,
) -> dict:
    """The card's KV limit, the fixed split and the checks that the comparison can show something (Note [The card's
    KV limit])."""
    if headroom <= 0:
        raise SizingError(f"headroom must be positive, got {headroom}")
    demand = demand_blocks(heavy, block_size)
    limit = math.ceil(headroom * demand * max(int(s["bytes_per_block"]) for s in states.values()))
    floors = sum(int(s["floor_blocks"]) * int(s["bytes_per_block"]) for s in states.values())
    if floors > limit:
        raise SizingError(f"the engines' floors take {floors} bytes, above the limit of {limit} bytes")
    fixed = {name: fixed_blocks(limit, s, len(states)) for name, s in states.items()}
    room = {}  # the most a busy engine reaches under the coordinator: the limit less the others' floors
    for name, s in states.items():
        others = sum(int(o["floor_blocks"]) * int(o["bytes_per_block"]) for n, o in states.items() if n != name)
        room[name] = min(int(s["reserved_blocks"]), (limit - others) // int(s["bytes_per_block"]))
    wanted = math.ceil(demand / target_usage)
    return {
        "limit_bytes": limit,
        "demand_blocks": demand,
        "headroom": headroom,
        "block_size": block_size,
        "fixed_blocks": fixed,
        "room_blocks": room,
        "checks": {
            "fixed_below_demand": all(n < demand for n in fixed.values()),
            "room_fits_demand": all(n >= wanted for n in room.values()),
        },
    }


def estimated_bytes_per_block(config: Mapping, block_size: int = BLOCK_SIZE, dtype_bytes: int = 2) -> int:
    """K and V of every layer for one block, from a model's config.json (the dry run's figure; a run reads each
    engine's own)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * dtype_bytes * block_size


# -- the servers -------------------------------------------------------------------------------------------------------
def set_flag(command: Sequence[str], flag: str, value: str) -> list[str]:
    """``command`` with ``flag``'s value replaced, or ``flag value`` appended where it has none."""
    out = list(command)
    if flag in out:
        at = out.index(flag)
        if at + 1 >= len(out):
            raise ValueError(f"{flag} ends the command without a value")
        out[at + 1] = value
        return out
    return out + [flag, value]


def drop_flag(command: Sequence[str], flag: str, takes_value: bool = False) -> list[str]:
    """``command`` without ``flag`` (and its value)."""
    out = list(command)
    if flag in out:
        at = out.index(flag)
        del out[at : at + 1 + int(takes_value)]
    return out


def engine_command(
    port: int | str,
    name: str,
    util: float = UTILIZATION,
    max_num_seqs: int = MAX_NUM_SEQS,
    python: str = sys.executable,
) -> list[str]:
    """``serve_sleep.server_command`` for one engine of the pair: its own served name, this run's limits, 16-token
    blocks, prefix caching off (Note [The same load twice]), no sleep mode and no worker extension."""
    command = server_command(port, python)
    command = drop_flag(command, "--enable-sleep-mode")
    command = drop_flag(command, "--enable-prefix-caching")
    command = drop_flag(command, "--worker-extension-cls", takes_value=True)
    values = {
        "--served-model-name": served_name(name),
        "--max-model-len": str(MAX_MODEL_LEN),
        "--gpu-memory-utilization": str(util),
        "--max-num-seqs": str(max_num_seqs),
        "--max-num-batched-tokens": str(BATCHED_TOKENS),
        "--block-size": str(BLOCK_SIZE),
        "--compilation-config": json.dumps(
            {"cudagraph_capture_sizes": [s for s in CAPTURE_SIZES if s <= max_num_seqs]}
        ),
    }
    for flag, value in values.items():
        command = set_flag(command, flag, value)
    return command + ["--no-enable-prefix-caching"]


def served_name(engine: str) -> str:
    return f"engine-{engine}"


def stop_all(servers: Mapping[str, ServerProcess]) -> dict:
    """Stop every server at once (each in a thread: SIGTERM, SIGKILL after ``STOP_GRACE_S``); what each did."""
    done: dict[str, dict] = {}

    def stop(name: str, server: ServerProcess) -> None:
        try:
            done[name] = stop_group(server.proc, STOP_GRACE_S)
        except BaseException as exc:  # recorded: the other server is still stopped
            done[name] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            server.log.close()

    threads = [threading.Thread(target=stop, args=item, daemon=True) for item in servers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * STOP_GRACE_S)
    return done


# -- the client --------------------------------------------------------------------------------------------------------
def stream_completion(base_url: str, model: str, prompt: Sequence[int], max_tokens: int, timeout: float) -> dict:
    """One streamed greedy completion (``ignore_eos``): TTFT (the first chunk with a choice), end-to-end seconds,
    output tokens (the final usage chunk), and ``ok`` with the reason where not."""
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = Request(
        base_url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    out: dict = {"status": None, "ttft_s": None, "e2e_s": None, "output_tokens": None, "finish_reason": None}
    error, done = None, False
    start = time.perf_counter()
    try:
        with urlopen(request, timeout=timeout) as reply:
            out["status"] = reply.status
            for raw in reply:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if isinstance(chunk, dict) and chunk.get("error"):
                    error = f"error in the stream: {str(chunk['error'])[:200]}"
                    break
                choices = chunk.get("choices") or []
                if choices and out["ttft_s"] is None:
                    out["ttft_s"] = time.perf_counter() - start
                for choice in choices:
                    out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
                if chunk.get("usage"):
                    out["output_tokens"] = chunk["usage"].get("completion_tokens")
    except HTTPError as exc:
        with exc:
            out["status"] = exc.code
            error = f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:200]}"
    except (OSError, ValueError) as exc:  # refused, reset, timed out, a chunk that is not JSON
        error = f"{type(exc).__name__}: {exc}"
    out["e2e_s"] = time.perf_counter() - start
    if error is None and not done:
        error = "the stream ended without [DONE]"
    if error is None and out["ttft_s"] is None:
        error = "no chunk carried a choice"
    if error is None and out["output_tokens"] != max_tokens:
        error = f"{out['output_tokens']} output tokens, expected {max_tokens}"
    return out | {"ok": error is None, "error": error}


Sender = Callable[[str, str, Sequence[int], int], dict]


def http_sender(timeout: float = REQUEST_TIMEOUT_S) -> Sender:
    return lambda url, model, prompt, max_tokens: stream_completion(url, model, prompt, max_tokens, timeout)


# -- a phase -----------------------------------------------------------------------------------------------------------
class Sink:
    """The records of one phase: appended as requests end, and, once closed, a failure for each still in flight
    (later ends are kept apart, under ``late``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: list[dict] = []
        self.late: list[dict] = []
        self.inflight: dict[tuple, dict] = {}
        self.closed = False

    def begin(self, key: tuple, record: dict) -> None:
        with self.lock:
            self.inflight[key] = record

    def end(self, key: tuple, record: dict) -> None:
        with self.lock:
            self.inflight.pop(key, None)
            (self.late if self.closed else self.records).append(record)

    def close(self) -> list[dict]:
        with self.lock:
            self.closed = True
            for record in self.inflight.values():
                self.records.append(record | {"ok": False, "error": f"not finished within the drain ({DRAIN_S:g} s)"})
            self.inflight.clear()
            return list(self.records)


def spec_record(config: str, spec: Spec) -> dict:
    return {
        "config": config,
        "phase": spec.phase,
        "engine": spec.engine,
        "role": spec.role,
        "worker": spec.worker,
        "index": spec.index,
        "prompt_len": len(spec.prompt),
        "max_tokens": spec.max_tokens,
        "start": time.time(),
    }


def run_worker(
    config: str, specs: Iterator[Spec], url: str, model: str, first_at: float, end_at: float, sink: Sink, send: Sender
) -> None:
    """Send ``specs`` one after the other from ``first_at`` (monotonic) until ``end_at``: each after its think
    time, none once ``end_at`` has passed."""
    _sleep_until(first_at, end_at)
    for spec in specs:
        _sleep_until(time.monotonic() + spec.think_s, end_at)
        if time.monotonic() >= end_at:
            return
        send_one(config, spec, url, model, sink, send)


def run_arrivals(
    config: str,
    specs: Iterator[Spec],
    url: str,
    model: str,
    first_at: float,
    end_at: float,
    sink: Sink,
    send: Sender,
    spawned: list[threading.Thread],
) -> None:
    """Open arrivals: from ``first_at`` until ``end_at``, each of ``specs`` after its gap from the one before, each in
    a thread of its own (appended to ``spawned``), whether or not the ones before have ended."""
    _sleep_until(first_at, end_at)
    due = time.monotonic()
    for spec in specs:
        due += spec.think_s  # gaps from the schedule, not from when the last thread started
        _sleep_until(due, end_at)
        if time.monotonic() >= end_at:
            return
        args = (config, spec, url, model, sink, send, due)
        thread = threading.Thread(target=send_one, args=args, daemon=True)
        thread.start()  # a start that fails ends the arrivals; those before it are joined as usual
        spawned.append(thread)


def send_one(config: str, spec: Spec, url: str, model: str, sink: Sink, send: Sender, due: float | None = None) -> None:
    """One request, recorded in ``sink`` when it begins and when it ends; ``due`` (monotonic): when the open
    arrivals' schedule meant to send it, recorded as ``dispatch_lag_s`` (a client that falls behind its schedule
    would otherwise hide its lag from TTFT, which starts when the request is sent)."""
    record = spec_record(config, spec)
    if due is not None:
        record["dispatch_lag_s"] = max(0.0, time.monotonic() - due)
    key = (spec.engine, spec.role, spec.worker, spec.index)
    sink.begin(key, record)
    try:
        reply = send(url, model, spec.prompt, spec.max_tokens)
    except Exception as exc:  # a sender that raised: the request failed, the worker goes on
        reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    sink.end(key, record | reply)


def _sleep_until(when: float, end_at: float) -> None:
    delay = min(when, end_at) - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def run_phase(
    config: str,
    phase: str,
    busy: str,
    urls: Mapping[str, str],
    seconds: float,
    send: Sender,
    seed: int = SEED,
    vocab: int = 151936,
    heavy: Load = HEAVY,
    light: Load = LIGHT,
    drain_s: float = DRAIN_S,
    settle_s: float = SETTLE_S,
) -> tuple[dict, list[dict]]:
    """One phase: every engine's workers for ``seconds``, then ``drain_s`` for the requests in flight (those still
    running fail), then up to ``settle_s`` for them to end before the next phase (``late``: ended meanwhile;
    ``unsettled``: still running). Returns the phase's times and its records."""
    sink = Sink()
    start_mono, start = time.monotonic(), time.time()
    end_at = start_mono + seconds
    threads: list[threading.Thread] = []
    spawned: list[threading.Thread] = []  # open arrivals' requests
    for engine, load in phase_loads(busy, heavy, light).items():
        for worker in range(load.senders):
            specs = worker_requests(seed, phase, engine, load, worker, vocab)
            args = (config, specs, urls[engine], served_name(engine), start_mono + start_offset(load, worker))
            if load.open:
                target, args = run_arrivals, (*args, end_at, sink, send, spawned)
            else:
                target, args = run_worker, (*args, end_at, sink, send)
            threads.append(threading.Thread(target=target, args=args, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, end_at + drain_s - time.monotonic()))
    for t in list(spawned):
        t.join(max(0.0, end_at + drain_s - time.monotonic()))
    records = sink.close()
    drained = time.time()
    # The requests the drain did not finish are failed already; wait up to settle_s more for them to end, so that
    # they do not load the next phase, and count those that ended late.
    settle_at = time.monotonic() + settle_s
    for t in [*threads, *spawned]:
        t.join(max(0.0, settle_at - time.monotonic()))
    unsettled = sum(t.is_alive() for t in [*threads, *spawned])
    meta = {"config": config, "phase": phase, "busy": busy, "seconds": seconds, "start": start}
    meta |= {"end": start + seconds, "drained": drained, "late": len(sink.late), "unsettled": unsettled}
    return meta, records


# -- polling -----------------------------------------------------------------------------------------------------------
def read_loads(engines: Sequence[ServeEngine]) -> Callable[[], dict]:
    """A poll that only reads (the fixed split): the coordinator's record without targets."""

    def poll() -> dict:
        loads = [EngineLoad.from_state(e.name, e.state()) for e in engines]
        sizes = {e.name: e.num_blocks for e in loads}
        return {"time": time.time(), "loads": [vars(e) for e in loads], "sizes": sizes, "errors": {}}

    return poll


class Poller(threading.Thread):
    """Calls ``poll`` every ``interval`` s until stopped; each record (or the error of a poll that raised) is kept."""

    def __init__(self, poll: Callable[[], dict], interval: float) -> None:
        super().__init__(daemon=True)
        self.poll, self.interval = poll, interval
        self.records: list[dict] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                self.records.append(self.poll())
            except Exception as exc:  # a failed read: recorded, the next poll tries again
                self.records.append({"time": time.time(), "error": f"{type(exc).__name__}: {exc}"})
            self.halt.wait(self.interval)

    def stop(self, timeout: float) -> list[dict]:
        self.halt.set()
        self.join(timeout)
        return list(self.records)


def resize_all(engines: Sequence[ServeEngine], targets: Mapping[str, int]) -> list[dict]:
    """Every engine to its target, shrinks first (the limit holds between the calls); the replies."""
    current = {e.name: int(e.state()["num_blocks"]) for e in engines}
    replies = []
    for e in sorted(engines, key=lambda e: targets[e.name] - current[e.name]):
        if targets[e.name] != current[e.name]:
            replies.append({"engine": e.name, **e.resize(targets[e.name])})
    return replies


# -- the summary (pure) ------------------------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation between the closest ranks; ``None`` for no values.
    A value may be ``math.inf`` (a time never measured): interpolating towards it gives ``inf``."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    lo, hi = ordered[low], ordered[min(low + 1, len(ordered) - 1)]
    if rank == low or lo == hi:
        return lo
    return lo + (hi - lo) * (rank - low)


def in_phase(poll: dict, meta: Mapping) -> bool:
    return meta["start"] <= poll.get("time", -1) <= meta["drained"]


def censored_percentile(done: Sequence[float], failed: int, q: float) -> float | None:
    """The ``q``-th percentile of a phase's times where each of ``failed`` requests counts as longer than any that
    completed; ``None`` where the percentile falls on one of them (no time was measured there). A configuration
    cannot look faster by leaving its slowest requests unfinished."""
    value = percentile([*done, *[math.inf] * failed], q)
    return None if value is None or math.isinf(value) else value


def phase_row(meta: Mapping, engine: str, records: Sequence[dict], polls: Sequence[dict]) -> dict:
    """One configuration, phase and engine: requests, failures, TTFT and end-to-end percentiles (a failed request
    longer than any: ``censored_percentile``), output tokens per second over the phase, and the engine's blocks
    and queue at the phase's polls."""
    mine = [r for r in records if r["engine"] == engine]
    ok = [r for r in mine if r.get("ok")]
    failed = len(mine) - len(ok)
    ttft = [r["ttft_s"] for r in ok]
    e2e = [r["e2e_s"] for r in ok]
    lags = [r["dispatch_lag_s"] for r in mine if r.get("dispatch_lag_s") is not None]
    tokens = sum(r.get("output_tokens") or 0 for r in ok)
    last_end = max((r["start"] + r["e2e_s"] for r in ok), default=None)
    span = None if last_end is None else last_end - meta["start"]
    loads = [ld for p in polls if in_phase(p, meta) for ld in p.get("loads", []) if ld["name"] == engine]
    blocks = [ld["num_blocks"] for ld in loads]
    return {
        "config": meta["config"],
        "phase": meta["phase"],
        "engine": engine,
        "role": "heavy" if engine == meta["busy"] else "light",
        "requests": len(mine),
        "failed": failed,
        "ttft_p50_s": censored_percentile(ttft, failed, 50),
        "ttft_p99_s": censored_percentile(ttft, failed, 99),
        "e2e_p50_s": censored_percentile(e2e, failed, 50),
        "e2e_p99_s": censored_percentile(e2e, failed, 99),
        "dispatch_lag_p99_s": percentile(lags, 99),  # open arrivals: how far the client fell behind its schedule
        "output_tokens": tokens,
        "span_s": span,
        "tokens_per_s": tokens / span if span else None,
        "polls": len(loads),
        "blocks_min": min(blocks, default=None),
        "blocks_max": max(blocks, default=None),
        "waiting_max": max((ld["waiting"] for ld in loads), default=None),
    }


def limit_check(polls: Sequence[dict], limit_bytes: int) -> dict:
    """Whether every poll kept ``sum(num_blocks x bytes_per_block) <= limit_bytes``, for the sizes it read and for
    the sizes it left; ``held`` is ``None`` when no poll read the engines."""
    read = [p for p in polls if p.get("loads")]
    worst, over = 0, []
    for p in read:
        per_block = {ld["name"]: ld["bytes_per_block"] for ld in p["loads"]}
        seen = sum(ld["num_blocks"] * ld["bytes_per_block"] for ld in p["loads"])
        left = sum(n * per_block[name] for name, n in (p.get("sizes") or {}).items())
        worst = max(worst, seen, left)
        if max(seen, left) > limit_bytes:
            over.append({"time": p["time"], "read_bytes": seen, "left_bytes": left})
    return {
        "polls": len(read),
        "failed_polls": len(polls) - len(read),
        "max_bytes": worst if read else None,
        "limit_bytes": limit_bytes,
        "over": over,
        "held": None if not read else not over,
    }


def _better(shared: float | None, fixed: float | None) -> bool | None:
    """Shared strictly better (lower) than fixed; ``None`` when either was not measured."""
    if shared is None or fixed is None:
        return None
    return shared + TIME_CLEARANCE_S <= fixed


def verdicts(rows: Sequence[dict], shared_limit: Mapping | None) -> dict:
    """The comparison's verdicts: shared beats fixed on TTFT p50 and p99 for each phase's busy engine, no failed
    request in either configuration, the limit held under the coordinator (``None``: not measured)."""
    by = {(r["config"], r["phase"], r["engine"]): r for r in rows}
    out: dict[str, bool | None] = {}
    for phase, busy in PHASES:
        fixed, shared = by.get(("fixed", phase, busy), {}), by.get(("shared", phase, busy), {})
        for q in ("p50", "p99"):
            out[f"{phase}_busy_{busy}_ttft_{q}_shared_better"] = _better(
                shared.get(f"ttft_{q}_s"), fixed.get(f"ttft_{q}_s")
            )
    complete = all((c, p, e) in by for c in CONFIGS for p, _ in PHASES for e in ENGINES)
    failed = sum(r["failed"] for r in rows if r["config"] in CONFIGS)  # the calibration is not compared
    out["no_failed_requests"] = (failed == 0) if complete else (False if failed else None)
    out["limit_never_exceeded"] = None if shared_limit is None else shared_limit.get("held")
    return out


def premises(rows: Sequence[dict], fixed_blocks_of: Mapping[str, int] | None) -> dict:
    """What the comparison rests on, per phase: the busy engine queued under the fixed split, and grew past its
    fixed share under the coordinator."""
    by = {(r["config"], r["phase"], r["engine"]): r for r in rows}
    out: dict[str, bool | None] = {}
    for phase, busy in PHASES:
        fixed, shared = by.get(("fixed", phase, busy)), by.get(("shared", phase, busy))
        waiting = None if fixed is None else fixed.get("waiting_max")
        out[f"{phase}_busy_{busy}_queued_under_fixed"] = None if waiting is None else waiting > 0
        grown = None if shared is None else shared.get("blocks_max")
        share = (fixed_blocks_of or {}).get(busy)
        out[f"{phase}_busy_{busy}_grew_under_shared"] = None if grown is None or share is None else grown > share
    return out


def _all_true(values: Sequence[bool | None]) -> bool:
    return bool(values) and all(v is True for v in values)


def summarize(result: Mapping, records: Sequence[dict]) -> dict:
    """Rows per configuration, phase and engine; the verdicts, the premises and the limit checks."""
    limit = result.get("limit") or {}
    rows, checks = [], {}
    for config in result.get("runs") or {}:  # in the order they ran: the calibration first
        run = result["runs"][config] or {}
        polls = run.get("polls") or []
        for meta in run.get("phases") or []:
            mine = [r for r in records if r["config"] == config and r["phase"] == meta["phase"]]
            rows += [phase_row(meta, e, mine, polls) for e in ENGINES]
        if polls and limit.get("limit_bytes"):
            checks[config] = limit_check(polls, limit["limit_bytes"])
        errors = [p for p in polls if p.get("errors") or p.get("error")]
        if run:
            checks.setdefault(config, {})["poll_errors"] = len(errors)
            checks[config]["first_poll_errors"] = [p.get("errors") or p.get("error") for p in errors[:5]]
    judged = verdicts(rows, checks.get("shared") if "polls" in checks.get("shared", {}) else None)
    return {
        "rows": rows,
        "verdicts": judged,
        "verdict": "pass" if _all_true(list(judged.values())) else "fail",
        "premises": premises(rows, limit.get("fixed_blocks")),
        "limit": limit,
        "limit_checks": checks,
        "memory": result.get("memory", []),
        "stages": result.get("stages", {}),
        "rates": result.get("rates"),
        "error": result.get("error"),
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def _num(value: float | int | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _flag(value: object) -> str:
    if value is None:
        return "-"
    return "yes" if value is True else "NO" if value is False else str(value)


def render_table(summary: Mapping) -> str:
    """The summary as markdown: one row per configuration, phase and engine, then the verdicts, premises, limit,
    memory and stages."""
    lines = [
        "| config | phase | engine | role | requests | failed | TTFT p50 ms | TTFT p99 ms | E2E p50 s | E2E p99 s | "
        "out tok/s | blocks min-max | waiting max | send lag p99 ms |",
        "|" + " --- |" * 14,
    ]
    for r in summary["rows"]:
        blocks = "-" if r["blocks_min"] is None else f"{r['blocks_min']}-{r['blocks_max']}"
        cells = [r["config"], r["phase"], r["engine"], r["role"], r["requests"], r["failed"]]
        cells += [_ms(r["ttft_p50_s"]), _ms(r["ttft_p99_s"]), _num(r["e2e_p50_s"], "{:.2f}")]
        cells += [
            _num(r["e2e_p99_s"], "{:.2f}"),
            _num(r["tokens_per_s"], "{:.0f}"),
            blocks,
            _num(r["waiting_max"], "{}"),
            _ms(r.get("dispatch_lag_p99_s")),
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    if summary.get("rates"):
        lines.append("")
    for phase, rate in (summary.get("rates") or {}).items():
        lines.append(
            f"Open arrivals, {phase}: {rate['rate']:.2f} requests/s to {rate['busy']} (calibrate: {rate['completed']} "
            f"completed in {rate['span_s']:.1f} s)"
        )
    lines += ["", f"Verdict: {summary['verdict']}"]
    lines += [f"- {name.replace('_', ' ')}: {_flag(v)}" for name, v in summary["verdicts"].items()]
    lines += ["", "Premises:"] + [f"- {name.replace('_', ' ')}: {_flag(v)}" for name, v in summary["premises"].items()]
    limit = summary.get("limit") or {}
    if limit.get("limit_bytes"):
        lines += [
            "",
            f"Limit: {limit['limit_bytes']} bytes ({limit['limit_bytes'] / MIB:.0f} MiB) = {limit['headroom']} x "
            f"{limit['demand_blocks']} blocks; fixed split {limit['fixed_blocks']}; room {limit['room_blocks']}; "
            f"checks {limit['checks']}",
        ]
    for config, check in (summary.get("limit_checks") or {}).items():
        if "polls" in check:
            lines.append(
                f"- {config}: {check['polls']} polls ({check['failed_polls']} failed), most "
                f"{_num(check['max_bytes'], '{}')} bytes, over the limit {len(check['over'])}, poll errors "
                f"{check.get('poll_errors', 0)}"
            )
    if summary.get("memory"):
        lines += [
            "",
            "Memory in use (nvidia-smi): " + ", ".join(f"{m['label']} {_gib(m['used'])}" for m in summary["memory"]),
        ]
    stages = summary.get("stages") or {}
    lines += ["", "Stages: " + ", ".join(f"{name} {s['state']}" for name, s in stages.items())]
    if summary.get("error"):
        lines.append(f"Error in {summary['error']['stage']}: {summary['error']['error'][:300]}")
    return "\n".join(lines) + "\n"


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f} GiB"


# -- the run -----------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """What the stages share: the output folder, the deadline, the servers and the result being built."""

    out: Path
    args: argparse.Namespace
    deadline: float
    memory: Callable[[], int | None] = nvidia_smi_used
    send: Sender = field(default_factory=http_sender)
    servers: dict[str, ServerProcess] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    result: dict = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def read_memory(self, label: str) -> None:
        self.result.setdefault("memory", []).append({"label": label, "used": self.memory(), "time": time.time()})

    def engines(self) -> list[ServeEngine]:
        return [ServeEngine(name, self.urls[name], RPC_TIMEOUT_S) for name in ENGINES]


class Stage:
    """A stage's state in ``result["stages"]``: running, complete, failed or not run, and its seconds."""

    def __init__(self, run: Run, name: str) -> None:
        self.run, self.name = run, name

    def __enter__(self) -> Stage:
        self.start = time.monotonic()
        self.run.result.setdefault("stages", {})[self.name] = {"state": "running"}
        print(f"{self.name} ...", flush=True)
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        state = "complete" if kind is None else "failed"
        self.run.result["stages"][self.name] = {"state": state, "seconds": round(time.monotonic() - self.start, 1)}
        if kind is not None:
            self.run.result["error"] = {
                "stage": self.name,
                "error": f"{kind.__name__}: {exc}",
                "traceback": "".join(traceback.format_exception(kind, exc, tb)),
            }
        return False


def start_servers(run: Run, plugin_dir: str) -> None:
    """Each server after the one before answers ``/health`` (Note [One engine after the other])."""
    env = server_env("extensible", "v1", plugin_dir, dict(os.environ))
    run.read_memory("idle")
    for name in ENGINES:
        port = free_port()
        run.urls[name] = f"http://127.0.0.1:{port}"
        command = engine_command(port, name, run.args.util, run.args.max_num_seqs)
        log = run.out / f"engine-{name}.log"
        run.servers[name] = launch_server(command, env, log)
        engine = run.result.setdefault("engines", {}).setdefault(name, {})
        engine |= {"url": run.urls[name], "command": command, "pid": run.servers[name].proc.pid}
        phases = len(configs(run.args)) * len(PHASES)
        timeout = min(START_TIMEOUT_S, run.left() - END_RESERVE_S - phases * (MIN_PHASE_S + PHASE_OVERHEAD_S))
        if timeout <= 0:
            raise StepFailed(f"no time left to start engine {name}", "start")
        try:
            seconds = wait_healthy(Client(run.urls[name]), run.servers[name], timeout)
        except StepFailed as exc:
            raise StepFailed(f"engine {name}: {exc}; log tail: {log_tail(log, 12)}", "start") from exc
        engine["start_s"] = seconds
        run.read_memory(f"{name} up")


def size(run: Run) -> None:
    """Read both engines, derive the limit, resize both to the fixed split."""
    engines = run.engines()
    states = {e.name: dict(e.state()) for e in engines}
    for name, state in states.items():
        run.result["engines"][name]["state_at_start"] = state
    heavy = replace(HEAVY, workers=run.args.heavy_workers)
    run.result["limit"] = kv_limit(states, heavy, BLOCK_SIZE, run.args.headroom, TARGET_USAGE)
    run.result["resizes"] = {"size": resize_all(engines, run.result["limit"]["fixed_blocks"])}
    run.read_memory("fixed split")


def warmup(run: Run) -> None:
    """A few requests per engine, not measured: the first requests an engine serves pay for lazy set-up."""
    replies = {}
    for name in ENGINES:
        specs = worker_requests(run.args.seed, "warmup", name, LIGHT, 0, _vocab())
        prompts = [next(specs).prompt for _ in range(WARMUP_REQUESTS)]
        replies[name] = [run.send(run.urls[name], served_name(name), p, WARMUP_TOKENS) for p in prompts]
    run.result["warmup"] = {n: [r.get("ok") for r in rs] for n, rs in replies.items()}
    bad = [f"{n}: {r.get('error')}" for n, rs in replies.items() for r in rs if not r.get("ok")]
    if bad:
        raise StepFailed("warmup requests failed: " + "; ".join(bad[:4]), "warmup")


def run_config(run: Run, config: str, seconds: float) -> None:
    """Both engines at the fixed split, then the phases under a monitor (fixed) or the coordinator (shared)."""
    engines = run.engines()
    limit = run.result["limit"]
    run.result.setdefault("resizes", {})[config] = resize_all(engines, limit["fixed_blocks"])
    if config == "shared":
        policy = Policy(limit["limit_bytes"], target_usage=TARGET_USAGE, idle_polls=run.args.idle_polls)
        poll = Coordinator([e.handle() for e in engines], policy).poll
    else:
        poll = read_loads(engines)
    poller = Poller(poll, run.args.interval)
    summary: dict = {"phases": [], "polls": poller.records}
    run.result.setdefault("runs", {})[config] = summary
    heavy = replace(HEAVY, workers=run.args.heavy_workers)
    poller.start()
    try:
        for phase, busy in PHASES:
            if run.args.arrivals == "open" and config != CALIBRATE:
                heavy = replace(heavy, rate=run.result["rates"][phase]["rate"])
            meta, records = run_phase(config, phase, busy, run.urls, seconds, run.send, run.args.seed, _vocab(), heavy)
            summary["phases"].append(meta)
            run.records += records
            run.read_memory(f"{config} {phase}")
    finally:
        summary["polls"] = poller.stop(run.args.interval + 2 * RPC_TIMEOUT_S)
    summary["states_at_end"] = {e.name: dict(e.state()) for e in engines}
    if config == CALIBRATE:
        mine = [r for r in run.records if r["config"] == CALIBRATE]
        run.result["rates"] = calibrated_rates(summary["phases"], mine, run.args.rate_factor)


def configs(args: argparse.Namespace) -> tuple[str, ...]:
    """The configurations a run measures, in order: with open arrivals the calibration comes first."""
    return (CALIBRATE, *CONFIGS) if args.arrivals == "open" else CONFIGS


def calibrated_rates(phases: Sequence[Mapping], records: Sequence[dict], factor: float = 1.0) -> dict:
    """Per phase, the open arrivals' rate: ``factor`` x the requests the busy engine completed per second at the
    fixed split under closed arrivals (Note [Open arrivals at the fixed split's rate])."""
    rates = {}
    for meta in phases:
        row = phase_row(meta, meta["busy"], [r for r in records if r["phase"] == meta["phase"]], [])
        completed = row["requests"] - row["failed"]
        if not completed or (row["span_s"] or 0) <= 0:
            raise StepFailed(f"{meta['phase']}: the busy engine completed no request, no rate to offer", CALIBRATE)
        rate = factor * completed / row["span_s"]
        rates[meta["phase"]] = {"busy": meta["busy"], "completed": completed, "span_s": row["span_s"], "rate": rate}
    return rates


def _vocab() -> int:
    return json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]


def write_outputs(run: Run) -> dict:
    summary = summarize(run.result, run.records)
    summary["runs"] = {
        c: {"phases": r.get("phases"), "polls": r.get("polls")} for c, r in run.result.get("runs", {}).items()
    }
    summary |= {k: run.result.get(k) for k in ("engines", "resizes", "warmup", "phase_seconds", "stop", "args")}
    write_json(run.out / "share-requests.json", {"records": run.records})
    write_json(run.out / "share-summary.json", summary)
    table = render_table(summary)
    (run.out / "share-table.md").write_text(table)
    print(table, flush=True)
    return summary


def run_all(args: argparse.Namespace) -> int:
    """Every stage in order, the servers stopped whatever happens, the files written; 1 when a stage did not
    finish."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, args, time.monotonic() + args.budget_seconds)
    run.result["args"] = {k: v for k, v in vars(args).items()}
    with tempfile.TemporaryDirectory(prefix="share-run-plugin-") as plugin_dir:
        write_plugin_dist(Path(plugin_dir))
        try:
            with Stage(run, "start"):
                start_servers(run, plugin_dir)
            with Stage(run, "size"):
                size(run)
            with Stage(run, "warmup"):
                warmup(run)
            seconds = phase_seconds(run.left(), len(configs(args)) * len(PHASES))
            run.result["phase_seconds"] = seconds
            for config in configs(args):
                with Stage(run, config):
                    if seconds is None:
                        raise StepFailed(f"{run.left():.0f} s left: not enough for phases of {MIN_PHASE_S:g} s", config)
                    run_config(run, config, seconds)
        except BaseException:  # recorded by the stage (an interrupt too); the servers are stopped below
            pass
        finally:
            run.result["stop"] = stop_all(run.servers)
            run.read_memory("stopped")
    for name in (*("start", "size", "warmup"), *configs(args)):
        run.result.setdefault("stages", {}).setdefault(name, {"state": "not run"})
    write_outputs(run)
    return 0 if all(s["state"] == "complete" for s in run.result["stages"].values()) else 1


# -- the command line --------------------------------------------------------------------------------------------------
def positive(kind: type) -> Callable[[str], float]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value

    return parse


def fraction(text: str) -> float:
    value = positive(float)(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction below 1, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m integration.share_run", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="output folder")
    p.add_argument("--budget-seconds", type=positive(float), default=540.0, help="the whole run, servers included")
    p.add_argument("--dry-run", action="store_true", help="print the commands and the schedule; start nothing")
    p.add_argument("--util", type=fraction, default=UTILIZATION, help="each engine's --gpu-memory-utilization")
    p.add_argument("--max-num-seqs", type=positive(int), default=MAX_NUM_SEQS)
    p.add_argument("--heavy-workers", type=positive(int), default=HEAVY.workers, help="the busy engine's concurrency")
    p.add_argument("--headroom", type=positive(float), default=HEADROOM, help="LIMIT = headroom x the busy demand")
    p.add_argument("--interval", type=positive(float), default=INTERVAL_S, help="seconds between polls")
    p.add_argument("--idle-polls", type=positive(int), default=IDLE_POLLS, help="the coordinator's idle_polls")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument(
        "--arrivals",
        choices=ARRIVALS,
        default="closed",
        help="the busy engine's load: closed (workers back to back) or open (Poisson arrivals at the fixed split's "
        "rate, measured first)",
    )
    p.add_argument(
        "--rate-factor", type=positive(float), default=1.0, help="open arrivals: this x the fixed split's rate"
    )
    return p


def schedule_lines(args: argparse.Namespace) -> list[str]:
    """The load, the phases' length for the budget (with ``EXPECTED_START_S`` a server) and the limit as the
    model's shape predicts it."""
    heavy = replace(HEAVY, workers=args.heavy_workers)
    runs = configs(args)
    seconds = phase_seconds(args.budget_seconds - len(ENGINES) * EXPECTED_START_S - SETUP_S, len(runs) * len(PHASES))
    length = "not enough time" if seconds is None else f"{seconds:.1f} s"
    lines = [f"phase length: {length} (budget {args.budget_seconds:g} s, {EXPECTED_START_S:g} s a server start)"]
    for config in runs:
        for phase, busy in PHASES:
            load = heavy
            if args.arrivals == "open" and config != CALIBRATE:
                load = replace(heavy, rate=float("nan"))  # measured by the calibration
            loads = phase_loads(busy, load, LIGHT)
            words = [f"{e} {describe_load(loads[e], args.rate_factor)}" for e in ENGINES]
            lines.append(f"{config} {phase}: " + "; ".join(words))
    config = json.loads((MODEL_DIR / "config.json").read_text())
    per_block = estimated_bytes_per_block(config)
    floor = math.ceil(MAX_MODEL_LEN / BLOCK_SIZE) + 1
    state = {"bytes_per_block": per_block, "floor_blocks": floor, "reserved_blocks": 10**9}
    limit = kv_limit({e: state for e in ENGINES}, heavy, BLOCK_SIZE, args.headroom, TARGET_USAGE)
    lines += [
        f"limit (estimated: {per_block} bytes a block, floor {floor}; a run reads each engine's): "
        f"{limit['limit_bytes']} bytes = {args.headroom:g} x {limit['demand_blocks']} blocks; fixed split "
        f"{limit['fixed_blocks']}; room {limit['room_blocks']}; checks {limit['checks']}",
        f"shared: Coordinator(Policy(limit_bytes=LIMIT, target_usage={TARGET_USAGE}, idle_polls={args.idle_polls})) "
        f"polled every {args.interval:g} s; fixed: the states read every {args.interval:g} s",
    ]
    return lines


def describe_load(load: Load, factor: float = 1.0) -> str:
    if load.rate != 0:  # nan in a dry run: measured by the calibration
        rate = f"{factor:g} x the calibration's rate" if math.isnan(load.rate) else f"{load.rate:.2f} requests/s"
        return (
            f"{load.role} open arrivals at {rate}, prompts {load.prompt_lo}-{load.prompt_hi} tokens, "
            f"max_tokens {load.max_tokens}"
        )
    think = f", think {load.think_lo:g}-{load.think_hi:g} s" if load.think_hi else ""
    ramp = f", ramp {load.ramp_s:g} s" if load.ramp_s else ""
    return (
        f"{load.role} {load.workers} worker(s), prompts {load.prompt_lo}-{load.prompt_hi} tokens, "
        f"max_tokens {load.max_tokens}{think}{ramp}"
    )


def dry_run(args: argparse.Namespace) -> str:
    out = []
    changes = server_env_changes("extensible", "v1", "<plugin dir>", "$PYTHONPATH")
    for name in ENGINES:
        command = engine_command(f"PORT_{name.upper()}", name, args.util, args.max_num_seqs)
        out += [f"engine {name}:", f"  command: {shlex.join(command)}"]
    out += ["  env (both, on top of this one's):"] + [f"    {k}={v}" for k, v in changes.items()]
    out += ["    VLLM_PLUGINS unset"]
    out.append(
        f"  plugin: <plugin dir>/{DIST_NAME}-{DIST_VERSION}.dist-info: [{PLUGIN_GROUP}] {PLUGIN_NAME} = {PLUGIN_TARGET}"
    )
    out.append(f"  start: {' then '.join(ENGINES)}, each once the one before answers /health ({MODEL})")
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
