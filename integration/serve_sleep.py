"""vLLM 0.26.0's sleep mode through ``vllm serve`` (the OpenAI API server) with the ``extensible_kv`` plugin, legacy
and extensible KV cache: the dev-mode routes ``POST /sleep``, ``GET /is_sleeping`` and ``POST /wake_up``, device
memory around them, their times, and greedy tokens before sleep and after every wake.

    PYTHONPATH=/tmp/site:$PWD/reference:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 \\
        python3 integration/serve_sleep.py OUT [--modes legacy,extensible] [--port 0] [--timeout-s 300] \\
        [--runner v1] [--dummy-weights] [--dry-run]

Writes ``OUT/serve-<mode>.json`` and ``OUT/serve-<mode>.log`` (the server's output) per mode, then
``OUT/summary.json`` (``cases`` and ``pairs`` as ``integration/sleep_mode.py`` writes them, plus ``checks``) and
``OUT/table.md``, and prints the table last. Exit status 1 when a mode did not run to its end (the table says where
it stopped); failed checks are in the table, not in the status. ``--dry-run`` prints the server commands, their
environment and the route sequence, and starts nothing.

The server, per mode, one after the other: ``python3 -m vllm.entrypoints.openai.api_server`` in its own process
group on ``127.0.0.1`` (``--port 0``: a free port per server), with the Qwen3-0.6B shape of the matrix
(``integration/models/qwen3-0.6b-shape``, dummy weights, no tokenizer: prompts and replies are token ids),
``max_model_len`` 4096, ``gpu_memory_utilization`` 0.85, 8 sequences, CUDA graphs of sizes 1, 2, 4, 8 (no
``--enforce-eager``), prefix caching, ``--enable-sleep-mode``, ``VLLM_SERVER_DEV_MODE=1`` (the routes above and
``/collective_rpc``), and ``EXTENSIBLE_KV_CACHE=1`` on the extensible side. ``VLLM_PLUGINS`` is removed from its
environment: every discovered plugin loads.

Note [The plugin without an install]
    vLLM finds the plugin through the ``vllm.general_plugins`` entry point of an installed distribution; on the
    device the package is only on ``PYTHONPATH``. The script writes ``extensible_kv_plugin-0.0.0.dist-info/``
    (``METADATA`` and ``entry_points.txt`` naming ``extensible_kv.vllm.plugin:register``, as pyproject.toml does)
    into a temporary folder that leads the server's ``PYTHONPATH``; ``importlib.metadata`` reads any
    ``*.dist-info`` folder on ``sys.path``. ``register`` is a no-op without ``EXTENSIBLE_KV_CACHE=1``, so the
    legacy server loads it too, as it would from an installed package.

Note [Tokens a server can compare]
    vLLM's dummy loader is deterministic (``initialize_dummy_weights``: uniform in +-1e-3 from a fixed seed, 1234,
    per parameter, whatever ``--seed`` says), so two servers start from the same weights; but such weights make
    greedy tokens nearly independent of the KV cache, so equal tokens would prove little. The server therefore
    gets ``--worker-extension-cls integration.serve_sleep.SleepProbe``, which adds two worker methods that the
    dev route ``POST /collective_rpc`` calls by name: ``serve_sleep_reinit_weights`` (``run_case.reinit_weights``:
    a seeded normal written in place, as ``sleep_mode.py`` does in-process) right after ``/health`` answers, and
    ``serve_sleep_reading`` (``sleep_mode.reading``: memory in use, KV bytes, the extensible buffers' state). A
    level-1 sleep copies the weights to the host and back, so the re-initialised weights survive every wake of the
    sequence. ``--dummy-weights`` skips the re-initialisation (the rows then say ``dummy``), and so does a failed
    call (``dummy (reinit failed)``); ``distinct tokens`` in the table shows how varied the tokens were.

Note [Woken below awake]
    Memory in use after a wake may be below that before sleep, never above it. vLLM's ``CuMemAllocator.sleep``
    ends with ``torch.cuda.empty_cache()``: on the extensible server the blocks torch's allocator kept from warmup
    (outside the KV cache, which is ours) go back to the device and return only when a batch needs them, while on
    the legacy server the same allocator's readings cover the CuMem pool and show no change. The check is therefore
    the issue's (every wake within ``TOLERANCE`` of the first) plus "no wake above before sleep"; the row's
    ``torch_cache_released`` says how much of the gap torch's cache explains. On the H200 (2026-12-05,
    ``reports/runs/h200-2026-12-05/serve-sleep``) the extensible server came back 736,100,352 bytes (702 MiB)
    below before sleep, with torch's reserved bytes 740,294,656 lower and the KV cache's backed bytes equal
    (125,074,145,280); the legacy server came back 4 MiB above.

The sequence (``PLAN``; every call is timed and listed in the mode's file under ``calls``). Tokens: each of 4
prompts of 40 token ids once with ``max_tokens`` 1 (it fills the prefix cache), then again with 24 tokens (greedy,
``ignore_eos``, ``return_token_ids``), one request at a time. A reading: nvidia-smi's memory in use (device-wide,
the basis of every memory figure), the worker's ``serve_sleep_reading`` and vLLM's ``vllm:engine_sleep_state``
from ``/metrics``.

1. ``before``: tokens, a reading.
2. ``weights_then_kv``: ``POST /sleep?level=1``, ``GET /is_sleeping`` (true), a reading; ``POST
   /wake_up?tags=weights``, ``/is_sleeping`` (still true), a reading (the KV cache must still be released);
   ``POST /wake_up?tags=kv_cache``, ``/is_sleeping`` (false), a reading; tokens.
3. ``sleep_wake``: ``POST /sleep?level=1``, ``/is_sleeping`` (true), a reading; ``POST /wake_up``, ``/is_sleeping``
   (false), a reading; tokens.

Then the server stops: SIGTERM to its process group (the API server, its engine core and worker), SIGKILL to what
is left after ``STOP_GRACE_S``; the next server starts once memory in use is back near what it was before the first.

The checks (per mode, and summarised in ``summary.json``'s ``checks``): tokens after each wake are the tokens
before sleep; the extensible server's tokens are the legacy server's; after the weights-only wake the KV cache is
still released (the kv_cache wake brings back at least the KV bytes the worker reports, less ``TOLERANCE``; more
than ``TOLERANCE`` where the worker did not report them); memory in use after each full wake is within
``TOLERANCE`` (64 MiB) of that after the first, and no more than ``TOLERANCE`` above before sleep. Also recorded:
``/is_sleeping`` answered as expected at every step, and the extensible buffers are present exactly on the
extensible server (the mode asked for is the mode that ran).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.error import HTTPError
from urllib.parse import urlencode
from urllib.request import Request, urlopen

if __package__ in (None, ""):  # python integration/serve_sleep.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from integration.sleep_mode import MIB, TOLERANCE, _flag, _gib, _mib, _same, _secs, nvidia_smi_used, write_json

ROOT = Path(__file__).resolve().parents[1]
MODEL = "qwen3-0.6b-shape"
MODEL_DIR = ROOT / "integration" / "models" / MODEL
SERVED_NAME = "serve-sleep"
MODES = ("legacy", "extensible")
MAX_MODEL_LEN, UTILIZATION, MAX_NUM_SEQS, BATCHED_TOKENS = 4096, 0.85, 8, 16384
CAPTURE_SIZES = (1, 2, 4, 8)
NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS, PROMPT_SEED = 4, 40, 24, 1234
POLL_S = 1.0  # between /health attempts
CALL_TIMEOUT_S = 120.0  # one HTTP call (a wake copies the weights back: seconds, not minutes)
STOP_GRACE_S = 30.0
RELEASE_SLACK = 512 * MIB  # memory in use before the next server starts: at most this above the first idle reading
RELEASE_WAIT_S = 60.0

# Note [The plugin without an install]
DIST_NAME, DIST_VERSION = "extensible_kv_plugin", "0.0.0"
PLUGIN_GROUP, PLUGIN_NAME, PLUGIN_TARGET = "vllm.general_plugins", "extensible_kv", "extensible_kv.vllm.plugin:register"
PROBE = "integration.serve_sleep.SleepProbe"  # Note [Tokens a server can compare]

# The sequence: (phase, action, key); a step's result lands in phases[phase][key].
PLAN = (
    ("before", "tokens", "tokens"),
    ("before", "read", "memory"),
    ("weights_then_kv", "sleep", "sleep_s"),
    ("weights_then_kv", "is_sleeping", "sleeping_asleep"),
    ("weights_then_kv", "read", "asleep"),
    ("weights_then_kv", "wake weights", "weights_wake_s"),
    ("weights_then_kv", "is_sleeping", "sleeping_weights"),
    ("weights_then_kv", "read", "weights_woken"),
    ("weights_then_kv", "wake kv_cache", "kv_wake_s"),
    ("weights_then_kv", "is_sleeping", "sleeping_kv"),
    ("weights_then_kv", "read", "kv_woken"),
    ("weights_then_kv", "tokens", "tokens"),
    ("sleep_wake", "sleep", "sleep_s"),
    ("sleep_wake", "is_sleeping", "sleeping_asleep"),
    ("sleep_wake", "read", "asleep"),
    ("sleep_wake", "wake", "wake_s"),
    ("sleep_wake", "is_sleeping", "sleeping_woken"),
    ("sleep_wake", "read", "woken"),
    ("sleep_wake", "tokens", "tokens"),
)
# What /is_sleeping must answer at each of its steps: a weights-only wake leaves the engine asleep.
EXPECT_SLEEPING = {"sleeping_asleep": True, "sleeping_weights": True, "sleeping_kv": False, "sleeping_woken": False}
ROUTES = {
    "sleep": ("POST", "/sleep", {"level": "1"}),
    "wake weights": ("POST", "/wake_up", {"tags": "weights"}),
    "wake kv_cache": ("POST", "/wake_up", {"tags": "kv_cache"}),
    "wake": ("POST", "/wake_up", {}),
    "is_sleeping": ("GET", "/is_sleeping", {}),
}
CASE_CHECKS = (
    "tokens_after_kv_wake",
    "tokens_after_wake",
    "kv_released_after_weights_wake",
    "memory_after_wake_ok",
    "is_sleeping_ok",
    "mode_ok",
)


# -- the worker's side (imported by vLLM in the server's worker) ----------------------------------------------------
class SleepProbe:
    """vLLM's worker extension (``--worker-extension-cls``): vLLM adds it to the worker's bases, so these methods are
    worker RPCs that ``POST /collective_rpc`` reaches by name (Note [Tokens a server can compare]). Every name is
    prefixed: vLLM refuses an extension whose names the worker already has."""

    def serve_sleep_reinit_weights(self) -> int:
        """Seeded normal weights written in place (``run_case.reinit_weights``); the number of tensors written."""
        from integration.run_case import reinit_weights

        return reinit_weights(self.get_model())

    def serve_sleep_reading(self) -> dict:
        """Memory in use, the KV tensors and bytes, and the extensible buffers' state (``sleep_mode.reading``)."""
        from integration.sleep_mode import reading

        return reading(self)


# -- the server: command, environment, plugin, process group --------------------------------------------------------
def server_command(port: int | str, python: str = sys.executable) -> list[str]:
    """The API server's command line: the engine ``sleep_mode.py`` builds in-process, served (Note [Tokens a server
    can compare] for the worker extension)."""
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        str(MODEL_DIR),
        "--served-model-name",
        SERVED_NAME,
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--dtype",
        "bfloat16",
        "--seed",
        "0",
        "--generation-config",
        "vllm",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--gpu-memory-utilization",
        str(UTILIZATION),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-num-batched-tokens",
        str(BATCHED_TOKENS),
        "--attention-backend",
        "FLASH_ATTN",
        "--compilation-config",
        json.dumps({"cudagraph_capture_sizes": list(CAPTURE_SIZES)}),
        "--enable-prefix-caching",
        "--enable-sleep-mode",
        "--enable-prompt-tokens-details",
        "--worker-extension-cls",
        PROBE,
    ]


def server_env_changes(mode: str, runner: str, plugin_dir: str, pythonpath: str | None) -> dict[str, str]:
    """What the server's environment sets on top of this process's: dev routes on, the extensible path on or off,
    the runner, no network, and ``PYTHONPATH`` led by the plugin folder (Note [The plugin without an install])."""
    path = [plugin_dir, str(ROOT / "reference"), str(ROOT)] + ([pythonpath] if pythonpath else [])
    return {
        "VLLM_SERVER_DEV_MODE": "1",
        "EXTENSIBLE_KV_CACHE": "1" if mode == "extensible" else "0",
        "VLLM_USE_V2_MODEL_RUNNER": "1" if runner == "v2" else "0",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(path),
    }


def server_env(mode: str, runner: str, plugin_dir: str, base: dict[str, str]) -> dict[str, str]:
    """``base`` with ``server_env_changes`` applied and ``VLLM_PLUGINS`` removed (it would filter the plugins)."""
    env = {k: v for k, v in base.items() if k != "VLLM_PLUGINS"}
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    return env | server_env_changes(mode, runner, plugin_dir, base.get("PYTHONPATH"))


def write_plugin_dist(folder: Path) -> Path:
    """The ``*.dist-info`` folder that makes the plugin's entry point discoverable from ``folder`` on ``sys.path``
    (Note [The plugin without an install]); returns it."""
    dist = Path(folder) / f"{DIST_NAME}-{DIST_VERSION}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: {DIST_VERSION}\n")
    (dist / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\n{PLUGIN_NAME} = {PLUGIN_TARGET}\n")
    return dist


def free_port() -> int:
    """A port no one listens on now (the kernel's choice); the server binds it moments later."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_members(pgid: int) -> list[int] | None:
    """Live (not zombie) processes of process group ``pgid`` from /proc; ``None`` where /proc cannot say. A zombie
    whose parent is gone waits for a reaper that a container may lack: it holds no GPU memory and is not counted."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def group_alive(pgid: int) -> bool:
    """Whether any live process is left in group ``pgid`` (``killpg(0)`` where /proc cannot say)."""
    members = group_members(pgid)
    if members is not None:
        return bool(members)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _wait_group(proc: subprocess.Popen, timeout: float) -> bool:
    """Reap the leader and wait until its group has no live process; whether that happened within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        proc.poll()
        if proc.returncode is not None and not group_alive(proc.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def stop_group(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> dict:
    """Stop the server's whole process group: SIGTERM, then SIGKILL for what is left after ``grace`` seconds. The
    API server starts its engine core (which holds the GPU) as a child in its group: stopping the leader alone could
    leave it running and its memory in use for the next server."""
    start = time.monotonic()
    _signal_group(proc.pid, signal.SIGTERM)
    sent = ["SIGTERM"]
    if not _wait_group(proc, grace):
        _signal_group(proc.pid, signal.SIGKILL)
        sent.append("SIGKILL")
        _wait_group(proc, grace)
    if proc.returncode is None:  # a leader SIGKILL did not end (stuck in the kernel): said, not waited for
        proc.poll()
    return {
        "signals": sent,
        "exit": proc.returncode,
        "seconds": round(time.monotonic() - start, 2),
        "left": group_members(proc.pid) or [],
    }


class Handle(Protocol):
    describe: dict

    def exited(self) -> int | None: ...

    def stop(self) -> dict: ...


@dataclass
class ServerProcess:
    """A started API server: its process (leader of its own group) and its log file."""

    proc: subprocess.Popen
    log: Any
    describe: dict = field(default_factory=dict)

    def exited(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> dict:
        try:
            return stop_group(self.proc)
        finally:
            self.log.close()


def process_launcher(runner: str, plugin_dir: str) -> Callable[[str, int, Path], ServerProcess]:
    """Starts one mode's server on a port, its output in a log file, in a session of its own (``stop_group``)."""

    def launch(mode: str, port: int, log_path: Path) -> ServerProcess:
        env = server_env(mode, runner, plugin_dir, dict(os.environ))
        changes = server_env_changes(mode, runner, plugin_dir, os.environ.get("PYTHONPATH"))
        return launch_server(server_command(port), env, log_path, {"env": changes})

    return launch


def launch_server(command: list[str], env: dict[str, str], log_path: Path, info: dict | None = None) -> ServerProcess:
    """Start one server in a session of its own (``stop_group`` stops its whole group), its command line and output
    in ``log_path``; ``info`` joins the command and pid in the handle's record."""
    log = open(log_path, "w")  # closed by ServerProcess.stop
    log.write(shlex.join(command) + "\n")
    log.flush()
    try:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    except OSError:
        log.close()
        raise
    return ServerProcess(proc, log, {"command": command, **(info or {}), "pid": proc.pid})


def wait_released(memory: Callable[[], int | None], idle: int | None, timeout: float = RELEASE_WAIT_S) -> dict:
    """Wait until memory in use is back within ``RELEASE_SLACK`` of ``idle`` (a stopped server's memory is freed
    by the driver moments after its processes exit), so the next server measures only itself."""
    start = time.monotonic()
    used = memory()
    while idle is not None and used is not None and used > idle + RELEASE_SLACK:
        if time.monotonic() - start >= timeout:
            break
        time.sleep(POLL_S)
        used = memory()
    return {"used": used, "seconds": round(time.monotonic() - start, 2)}


# -- the client ----------------------------------------------------------------------------------------------------
class StepFailed(RuntimeError):
    """A step of the sequence that failed; ``phase`` says where."""

    def __init__(self, message: str, phase: str | None = None) -> None:
        super().__init__(message)
        self.phase = phase


@dataclass
class Reply:
    status: int
    body: str
    seconds: float

    def json(self) -> Any:
        return json.loads(self.body) if self.body.strip() else None


def route(method: str, path: str, params: dict | None = None) -> str:
    """A call as the tables and logs show it: ``POST /wake_up?tags=weights``."""
    query = urlencode(params or {}, doseq=True)
    return f"{method} {path}" + (f"?{query}" if query else "")


@dataclass
class Client:
    """HTTP calls to one server (standard library only: the device has no ``requests`` guaranteed); each recorded
    call is appended to ``calls`` with its status and seconds."""

    base_url: str
    timeout: float = CALL_TIMEOUT_S
    calls: list = field(default_factory=list)

    def call(self, method: str, path: str, params: dict | None = None, body: Any = None, record: bool = True) -> Reply:
        """One request; any HTTP status is a ``Reply``, a connection failure an ``OSError``."""
        query = urlencode(params or {}, doseq=True)
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        headers = {"Content-Type": "application/json"} if body is not None else {}
        request = Request(self.base_url + path + (f"?{query}" if query else ""), data, headers, method=method)
        start = time.perf_counter()
        try:
            with urlopen(request, timeout=self.timeout) as response:
                status, text = response.status, response.read().decode(errors="replace")
        except HTTPError as exc:
            with exc:
                status, text = exc.code, exc.read().decode(errors="replace")
        reply = Reply(status, text, round(time.perf_counter() - start, 4))
        if record:
            self.calls.append({"call": route(method, path, params), "status": status, "seconds": reply.seconds})
        return reply

    def ok(self, method: str, path: str, params: dict | None = None, body: Any = None) -> Reply:
        """A call that must answer 200; ``StepFailed`` naming the call, the status and the reply's start if not."""
        reply = self.call(method, path, params, body)
        if reply.status != 200:
            raise StepFailed(f"{route(method, path, params)}: HTTP {reply.status}: {reply.body[:300]}")
        return reply


def rpc(client: Client, method: str) -> tuple[Any, str | None]:
    """The first worker's answer to ``POST /collective_rpc`` with ``method`` (a worker method's name), and ``None``
    as the error; or ``None`` and why not. vLLM's engine survives a failed RPC, so the caller decides what it means."""
    try:
        reply = client.call("POST", "/collective_rpc", body={"method": method})
        data = reply.json()
    except (OSError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if reply.status != 200:
        return None, f"HTTP {reply.status}: {reply.body[:300]}"
    results = data.get("results") if isinstance(data, dict) else None
    if not results:
        return None, f"no results in {reply.body[:300]!r}"
    return results[0], None


def wait_healthy(client: Client, handle: Handle, timeout: float) -> float:
    """Seconds until ``GET /health`` answers 200; ``StepFailed`` when the server exits first or ``timeout`` passes
    (vLLM answers only once the engine is built: weights, profile, KV cache, CUDA graphs)."""
    start = time.monotonic()
    while True:
        if (code := handle.exited()) is not None:
            raise StepFailed(f"the server exited with status {code} before /health answered", "start")
        try:
            if client.call("GET", "/health", record=False).status == 200:
                return round(time.monotonic() - start, 2)
        except OSError:
            pass  # not listening yet
        if time.monotonic() - start >= timeout:
            raise StepFailed(f"no 200 from /health within {timeout:.0f} s", "start")
        time.sleep(POLL_S)


def parse_completion(data: Any) -> tuple[list[int], int | None]:
    """The generated token ids of a ``/v1/completions`` reply (``return_token_ids``) and the prompt tokens vLLM
    found in its prefix cache (``usage.prompt_tokens_details``; ``None`` if not reported). Without a tokenizer the
    reply's text is empty: token ids are the only thing to compare."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not choices or not isinstance(choices[0], dict):
        raise StepFailed(f"a completion reply without choices: {str(data)[:200]}")
    ids = choices[0].get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise StepFailed(f"a completion reply without token ids (return_token_ids): {str(choices[0])[:200]}")
    details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
    return ids, details.get("cached_tokens")


def completion(client: Client, prompt: list[int], max_tokens: int) -> tuple[list[int], int | None]:
    """One greedy completion of ``prompt`` (token ids), every token generated (``ignore_eos``)."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return parse_completion(client.ok("POST", "/v1/completions", body=body).json())


def prompts(vocab: int, count: int = NUM_PROMPTS, length: int = PROMPT_LEN, seed: int = PROMPT_SEED) -> list[list]:
    """Fixed prompts of token ids from ``[3, vocab)``: the same for every server and every run."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def sleep_state(metrics: str) -> dict[str, float] | None:
    """vLLM's ``vllm:engine_sleep_state`` gauges from ``/metrics`` text, by ``sleep_state`` label (``awake``,
    ``weights_offloaded``, ``discard_all``); ``None`` when the text has none."""
    found = {}
    pattern = re.compile(r'^vllm:engine_sleep_state\{[^}]*sleep_state="(\w+)"[^}]*\}\s+(\S+)', re.M)
    for state, value in pattern.findall(metrics):
        try:
            found[state] = float(value)
        except ValueError:
            continue
    return found or None


@dataclass
class Session:
    """What the steps of the sequence need: the client, the memory reader, the prompts."""

    client: Client
    memory: Callable[[], int | None]
    prompts: list[list[int]]


def tokens(session: Session) -> dict:
    """A one-token pass over the prompts (it fills the prefix cache: nothing is cached right after a wake), then
    the measured pass, which reads the blocks the first cached (as ``sleep_mode.py`` measures)."""
    warm = [completion(session.client, p, 1) for p in session.prompts]
    measured = [completion(session.client, p, MAX_TOKENS) for p in session.prompts]
    return {
        "token_ids": [ids for ids, _ in measured],
        "cached_tokens": [cached for _, cached in measured],
        "warm_cached_tokens": [cached for _, cached in warm],
    }


def read(session: Session) -> dict:
    """A reading: nvidia-smi's memory in use (device-wide), the worker's own reading (``None`` with the reason if
    it did not answer) and vLLM's sleep-state gauges."""
    worker, error = rpc(session.client, "serve_sleep_reading")
    try:
        reply = session.client.call("GET", "/metrics")
        state = sleep_state(reply.body) if reply.status == 200 else None
    except OSError:
        state = None
    out = {"smi_used": session.memory(), "worker": worker if isinstance(worker, dict) else None, "sleep_state": state}
    if error:
        out["worker_error"] = error
    return out


def _route_action(name: str) -> Callable[[Session], Any]:
    method, path, params = ROUTES[name]

    def call(session: Session) -> Any:
        reply = session.client.ok(method, path, params)
        if name == "is_sleeping":
            value = (reply.json() or {}).get("is_sleeping")
            if not isinstance(value, bool):
                raise StepFailed(f"GET /is_sleeping answered {reply.body[:100]!r}")
            return value
        return reply.seconds

    return call


ACTIONS: dict[str, Callable[[Session], Any]] = {"tokens": tokens, "read": read} | {
    name: _route_action(name) for name in ROUTES
}


def run_plan(session: Session, phases: dict, plan: Sequence[tuple[str, str, str]] = PLAN) -> None:
    """Run ``plan`` in order, each result into ``phases[phase][key]`` as it comes (a failure keeps what ran); a
    failed step raises ``StepFailed`` naming its phase and key."""
    for phase, action, key in plan:
        try:
            phases.setdefault(phase, {})[key] = ACTIONS[action](session)
        except Exception as exc:  # recorded with its place in the sequence
            raise StepFailed(f"{phase}/{key}: {type(exc).__name__}: {exc}", phase) from exc


def reinit_weights(client: Client, dummy: bool) -> dict:
    """Re-initialise the weights through the worker extension (Note [Tokens a server can compare]); a failure is
    recorded and the run goes on with the dummy weights."""
    if dummy:
        return {"state": "dummy"}
    count, error = rpc(client, "serve_sleep_reinit_weights")
    if error is not None:
        return {"state": "dummy (reinit failed)", "error": error}
    return {"state": "reinitialised", "tensors": count}


@dataclass(frozen=True)
class Options:
    port: int
    timeout_s: float
    dummy_weights: bool


def run_mode(
    mode: str, out: Path, launch: Callable[[str, int, Path], Handle], memory: Callable[[], int | None], options: Options
) -> dict:
    """One mode: start its server, run the sequence, stop the server, write ``OUT/serve-<mode>.json``."""
    port = options.port or free_port()
    log = out / f"serve-{mode}.log"
    result: dict = {"mode": mode, "complete": False, "server": {"port": port, "log": log.name}, "phases": {}}
    client = Client(f"http://127.0.0.1:{port}")
    result["calls"] = client.calls
    handle, step = None, "start"
    try:
        handle = launch(mode, port, log)
        result["server"].update(handle.describe)
        result["server"]["start_s"] = wait_healthy(client, handle, options.timeout_s)
        step = "weights"
        result["weights"] = reinit_weights(client, options.dummy_weights)
        if mode == "extensible":
            result["extensible"] = rpc(client, "extensible_kv_report")[0]
        session = Session(client, memory, prompts(_vocab()))
        run_plan(session, result["phases"])
        if mode == "extensible":
            result["extensible_after"] = rpc(client, "extensible_kv_report")[0]
        result["complete"] = True
    except Exception as exc:  # the mode's file says where it stopped; the server is stopped below
        phase = getattr(exc, "phase", None) or step
        result["error"] = {
            "phase": phase,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
            "log_tail": log_tail(log),
        }
    finally:
        result["server"]["stop"] = handle.stop() if handle is not None else None
        write_json(out / f"serve-{mode}.json", result)
    return result


def log_tail(path: Path, lines: int = 30) -> list[str]:
    """The last ``lines`` lines of a server's log (why it exited or never answered); empty if there is none."""
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def _vocab() -> int:
    return json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]


# -- the summary (pure) --------------------------------------------------------------------------------------------
def _worker(reading: dict | None) -> dict:
    """The worker's side of a reading (empty when there is none)."""
    return (reading or {}).get("worker") or {}


def used(reading: dict | None) -> int | None:
    """Memory in use of a reading: nvidia-smi's, else the worker's own (``None``: neither said)."""
    if not reading:
        return None
    if reading.get("smi_used") is not None:
        return reading["smi_used"]
    return _worker(reading).get("used")


def _diff(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


def kv_released(weights_woken: int | None, kv_woken: int | None, kv_bytes: int | None) -> tuple[bool | None, str]:
    """Whether the KV cache stayed released after the weights-only wake: the kv_cache wake then brought back at
    least ``kv_bytes`` (less ``TOLERANCE``), or, where the worker did not report them, more than ``TOLERANCE``.
    Returns the answer and its basis."""
    back = _diff(kv_woken, weights_woken)
    if back is None:
        return None, "-"
    if kv_bytes:
        return back >= kv_bytes - TOLERANCE, "kv bytes"
    return back > TOLERANCE, "tolerance"


def sleeping_as_expected(*phases: dict) -> bool | None:
    """Every ``/is_sleeping`` step of ``phases`` answered ``EXPECT_SLEEPING``: ``False`` once one did not,
    ``None`` while a step of ``PLAN`` did not run (a mode that stopped early)."""
    seen = [phase[key] for phase in phases for key in EXPECT_SLEEPING if key in phase]
    wrong = [p for p in phases for k in EXPECT_SLEEPING if k in p and p[k] is not EXPECT_SLEEPING[k]]
    if wrong:
        return False
    return True if len(seen) == sum(action == "is_sleeping" for _, action, _ in PLAN) else None


def within_tolerance(awake: int | None, woken: Sequence[int | None]) -> tuple[int | None, bool | None]:
    """The largest distance of the ``woken`` readings from the first, and whether memory in use after every wake is
    within ``TOLERANCE`` of the first and at most ``TOLERANCE`` above ``awake`` (before sleep): ``False`` once one is
    not, ``None`` while a reading is missing. Below ``awake`` is allowed: vLLM's sleep empties torch's cache, which
    the next batch grows again (Note [Woken below awake])."""
    seen = [w for w in woken if w is not None]
    if awake is None or not seen:
        return None, None
    drift = max(abs(w - seen[0]) for w in seen)
    if drift > TOLERANCE or max(seen) - awake > TOLERANCE:
        return drift, False
    return drift, True if len(seen) == len(woken) else None


def _verdict(row: dict, checks: Sequence[str]) -> str:
    failed = [c for c in checks if row.get(c) is not True]
    return "pass" if not failed else "fail: " + ", ".join(failed)


def extensible_active(result: dict, worker: dict) -> bool | None:
    """Whether the server ran the extensible KV cache: the worker's reading shows its buffers; without a reading,
    an extensible server's answer to ``extensible_kv_report`` (``None``: nothing says)."""
    if worker:
        return worker.get("kv") is not None
    return True if result.get("extensible") is not None else None


def case_row(result: dict) -> dict:
    """One summary row of a mode's file: its state, memory at each reading, call times and the checks."""
    mode = result["mode"]
    row: dict = {"case": f"serve-{MODEL}-{mode}", "mode": mode}
    if result.get("error"):
        row |= {"state": f"failed in {result['error']['phase']}", "detail": result["error"]["error"]}
    else:
        row["state"] = "complete" if result.get("complete") else "incomplete"
    row |= {"weights": (result.get("weights") or {}).get("state"), "start_s": result.get("server", {}).get("start_s")}
    phases = result.get("phases", {})
    before, wk, sw = phases.get("before", {}), phases.get("weights_then_kv", {}), phases.get("sleep_wake", {})
    if "memory" not in before:
        return row | {"verdict": "not measured"}
    worker = _worker(before["memory"])
    awake = used(before["memory"])
    woken = {k: used(p.get(k)) for p, k in ((wk, "kv_woken"), (sw, "woken"))}
    drift, drift_ok = within_tolerance(awake, list(woken.values()))
    released, basis = kv_released(used(wk.get("weights_woken")), woken["kv_woken"], worker.get("kv_bytes"))
    all_ids = [i for ids in before.get("tokens", {}).get("token_ids", []) for i in ids]
    row |= {
        "awake": awake,
        "kv_bytes": worker.get("kv_bytes"),
        "asleep": used(wk.get("asleep")),
        "weights_woken": used(wk.get("weights_woken")),
        "kv_woken": woken["kv_woken"],
        "woken": woken["woken"],
        "freed": _diff(awake, used(wk.get("asleep"))),
        "sleep_s": wk.get("sleep_s"),
        "weights_wake_s": wk.get("weights_wake_s"),
        "kv_wake_s": wk.get("kv_wake_s"),
        "cycle_sleep_s": sw.get("sleep_s"),
        "wake_s": sw.get("wake_s"),
        "kv_released_after_weights_wake": released,
        "kv_released_basis": basis,
        "wake_drift": drift,
        "torch_cache_released": _diff(worker.get("torch_reserved"), _worker(sw.get("woken")).get("torch_reserved")),
        "memory_after_wake_ok": drift_ok,
        "is_sleeping_ok": sleeping_as_expected(wk, sw),
        "extensible_active": extensible_active(result, worker),
        "tokens_after_kv_wake": _same(before.get("tokens"), wk.get("tokens")),
        "tokens_after_wake": _same(before.get("tokens"), sw.get("tokens")),
        "cached_after_wake": sum(n or 0 for n in sw["tokens"]["warm_cached_tokens"]) if "tokens" in sw else None,
        "distinct_tokens": len(set(all_ids)),
        "tokens_before": before.get("tokens", {}).get("token_ids"),
    }
    active = row["extensible_active"]
    row["mode_ok"] = None if active is None else active == (mode == "extensible")
    row["verdict"] = _verdict(row, CASE_CHECKS)
    return row


def pair_row(legacy: dict, extensible: dict) -> dict:
    """Extensible against legacy: what sleep frees and what stays in use asleep, the wake times' ratios (one call
    each: context, not a check), tokens against legacy's, and the verdict over both rows' checks."""
    row: dict = {"pair": f"serve-{MODEL}"}
    if legacy.get("awake") is None or extensible.get("awake") is None:
        return row | {"verdict": "not measured"}
    lw, ew, lk, ek = (
        legacy.get("wake_s"),
        extensible.get("wake_s"),
        legacy.get("kv_wake_s"),
        extensible.get("kv_wake_s"),
    )
    freed_diff = _diff(extensible.get("freed"), legacy.get("freed"))
    row |= {
        "freed_diff": freed_diff,
        "asleep_diff": _diff(extensible.get("asleep"), legacy.get("asleep")),
        "wake_ratio": ew / lw if lw and ew is not None else None,
        "kv_wake_ratio": ek / lk if lk and ek is not None else None,
        "freed_ok": None if freed_diff is None else freed_diff >= -TOLERANCE,
        "tokens_vs_legacy": extensible.get("tokens_before") is not None
        and extensible.get("tokens_before") == legacy.get("tokens_before"),
        "legacy_ok": legacy.get("verdict") == "pass",
        "extensible_ok": extensible.get("verdict") == "pass",
    }
    row["verdict"] = _verdict(row, ("freed_ok", "tokens_vs_legacy", "legacy_ok", "extensible_ok"))
    return row


def _all_true(values: Sequence[bool | None]) -> bool | None:
    """``None`` when nothing was measured, else whether every value is ``True`` (an unmeasured one is not)."""
    return None if not values else all(v is True for v in values)


def summarize(results: Sequence[dict], skipped: Sequence[str] = ()) -> dict:
    """Rows per mode, the extensible-vs-legacy pair when both ran, and the four checks the issue names."""
    rows = [case_row(r) for r in results]
    by_mode = {r["mode"]: r for r in rows}
    pairs = [pair_row(by_mode["legacy"], by_mode["extensible"])] if set(MODES) <= set(by_mode) else []
    checks = {
        "tokens_identical_after_wake": _all_true(
            [r.get(k) for r in rows for k in ("tokens_after_kv_wake", "tokens_after_wake")]
        ),
        "tokens_legacy_vs_extensible": _all_true([p.get("tokens_vs_legacy") for p in pairs]),
        "kv_released_while_weights_awake": _all_true([r.get("kv_released_after_weights_wake") for r in rows]),
        "memory_after_wake_within_64_mib": _all_true([r.get("memory_after_wake_ok") for r in rows]),
    }
    return {"cases": rows, "pairs": pairs, "checks": checks, "skipped": list(skipped)}


def render_table(summary: dict) -> str:
    """The summary as markdown: the modes, the pair, then the checks."""
    header = (
        "| case | state | weights | start s | awake GiB | asleep GiB | weights woken GiB | kv woken GiB | "
        "woken GiB | freed GiB | sleep s | weights wake s | kv wake s | wake s | KV released after weights wake | "
        "wake drift MiB | is_sleeping | tokens after kv wake / wake | distinct tokens | verdict |"
    )
    lines = [header, "|" + " --- |" * 20]
    for r in summary["cases"]:
        if "awake" not in r:
            cells = [r["case"], r["state"], r.get("weights") or "-", _secs(r.get("start_s"))] + ["-"] * 15
            lines.append("| " + " | ".join(cells) + f" | {r.get('detail', r['verdict'])} |")
            continue
        cells = [
            r["case"],
            r["state"],
            r.get("weights") or "-",
            _secs(r.get("start_s")),
            *(_gib(r.get(k)) for k in ("awake", "asleep", "weights_woken", "kv_woken", "woken", "freed")),
            *(_secs(r.get(k)) for k in ("sleep_s", "weights_wake_s", "kv_wake_s", "wake_s")),
            f"{_flag(r.get('kv_released_after_weights_wake'))} ({r.get('kv_released_basis')})",
            _mib(r.get("wake_drift")),
            _flag(r.get("is_sleeping_ok")),
            f"{_flag(r.get('tokens_after_kv_wake'))} / {_flag(r.get('tokens_after_wake'))}",
            r.get("distinct_tokens", "-"),
            r["verdict"],
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += [
        "",
        "| pair | freed ext - legacy MiB | asleep ext - legacy MiB | wake ratio ext/legacy | kv wake ratio | "
        "tokens ext = legacy | verdict |",
        "|" + " --- |" * 7,
    ]
    for p in summary["pairs"]:
        ratios = ["-" if p.get(k) is None else f"{p[k]:.2f}" for k in ("wake_ratio", "kv_wake_ratio")]
        cells = [p["pair"], _mib(p.get("freed_diff")), _mib(p.get("asleep_diff")), *ratios]
        lines.append("| " + " | ".join(cells) + f" | {_flag(p.get('tokens_vs_legacy'))} | {p['verdict']} |")
    lines += ["", "Checks:"] + [f"- {name.replace('_', ' ')}: {_flag(v)}" for name, v in summary["checks"].items()]
    if summary["skipped"]:
        lines += ["", "Not run: " + "; ".join(summary["skipped"])]
    return "\n".join(lines) + "\n"


# -- the command line ----------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        """One line, no usage block: the caller is a script's log."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def modes_arg(text: str) -> list[str]:
    """``--modes``: a comma-separated, duplicate-free subset of ``MODES``."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in MODES for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(MODES)}, got {text!r}")
    return names


def port_arg(text: str) -> int:
    """``--port``: 0 (a free port per server) or a TCP port."""
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected 0 (a free port) or a port up to 65535, got {text!r}")
    return int(text)


def seconds_arg(text: str) -> float:
    """``--timeout-s``: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python integration/serve_sleep.py", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="output folder")
    p.add_argument("--modes", type=modes_arg, default=list(MODES), help="comma-separated: legacy,extensible")
    p.add_argument("--port", type=port_arg, default=0, help="the servers' port (0: a free one per server)")
    p.add_argument("--timeout-s", type=seconds_arg, default=300.0, help="longest wait for a server's /health")
    p.add_argument("--runner", choices=("v1", "v2"), default="v1", help="vLLM's model runner")
    p.add_argument("--dummy-weights", action="store_true", help="keep the dummy weights (no re-initialisation)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, environment and routes; start nothing")
    return p


def plan_lines(mode: str) -> list[str]:
    """The route sequence of one mode, in words."""
    lines = [
        f"GET /health (every {POLL_S:g} s until 200, at most --timeout-s)",
        'POST /collective_rpc {"method": "serve_sleep_reinit_weights"} (not with --dummy-weights)',
    ]
    report = 'POST /collective_rpc {"method": "extensible_kv_report"}'
    if mode == "extensible":
        lines.append(report)
    words = {
        "tokens": f"POST /v1/completions x{NUM_PROMPTS} (max_tokens 1), x{NUM_PROMPTS} (max_tokens {MAX_TOKENS})",
        "read": 'nvidia-smi memory.used; POST /collective_rpc {"method": "serve_sleep_reading"}; GET /metrics',
    }
    for phase, action, key in PLAN:
        text = words.get(action) or route(*ROUTES[action])
        expect = f" (expect {str(EXPECT_SLEEPING[key]).lower()})" if key in EXPECT_SLEEPING else ""
        lines.append(f"{phase}: {text}{expect}")
    if mode == "extensible":
        lines.append(report)
    lines.append(f"stop: SIGTERM to the process group, SIGKILL after {STOP_GRACE_S:g} s")
    return lines


def dry_run(args: argparse.Namespace) -> str:
    """What a run would start and call, per mode; nothing is started or written."""
    out = []
    for mode in args.modes:
        port = args.port or "PORT"
        changes = server_env_changes(mode, args.runner, "<plugin dir>", "$PYTHONPATH")
        out += [f"{mode}:", f"  command: {shlex.join(server_command(port))}", "  env (on top of this one's):"]
        out += [f"    {k}={v}" for k, v in changes.items()] + ["    VLLM_PLUGINS unset"]
        out.append(
            f"  plugin: <plugin dir>/{DIST_NAME}-{DIST_VERSION}.dist-info: [{PLUGIN_GROUP}] {PLUGIN_NAME} = "
            f"{PLUGIN_TARGET}"
        )
        out += ["  routes:"] + [f"    {line}" for line in plan_lines(mode)]
    return "\n".join(out) + "\n"


def run(
    args: argparse.Namespace,
    launch: Callable[[str, int, Path], Handle] | None = None,
    memory: Callable[[], int | None] = nvidia_smi_used,
) -> int:
    """Every mode of ``args`` in turn, then the summary and the table; 1 when a mode did not run to its end."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    options = Options(args.port, args.timeout_s, args.dummy_weights)
    results = []
    with tempfile.TemporaryDirectory(prefix="serve-sleep-plugin-") as plugin_dir:
        write_plugin_dist(Path(plugin_dir))
        launch = launch or process_launcher(args.runner, plugin_dir)
        idle = memory()
        for mode in args.modes:
            print(f"{mode} ...", flush=True)
            results.append(run_mode(mode, out, launch, memory, options))
            results[-1]["released"] = wait_released(memory, idle)
            write_json(out / f"serve-{mode}.json", results[-1])
    summary = summarize(results)
    write_json(out / "summary.json", summary)
    table = render_table(summary)
    (out / "table.md").write_text(table)
    print(table)
    return 0 if all(r.get("complete") for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.dry_run:
        print(dry_run(args), end="")
        return 0
    return run(args)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """A SIGTERM (a device call's time limit) unwinds like an interrupt, so the running server is stopped too."""
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sys.exit(main())
