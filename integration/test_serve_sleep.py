"""``integration/serve_sleep.py`` without a GPU or vLLM: the client's sequence, parsing, summary and table against a
fake of vLLM's API server (``http.server`` in a thread, the dev routes, ``/v1/completions``, ``/collective_rpc``,
``/metrics``) with an injected memory reader; each check failing on a fake that breaks it; the command line
(``--dry-run``, one-line errors); the plugin's dist-info; stopping a process group; and, where vLLM is importable,
the server's flags against vLLM 0.26.0's own parser."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import tomllib

from integration import serve_sleep
from integration.serve_sleep import PLAN, ROUTES
from integration.sleep_mode import GIB, MIB

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "integration" / "serve_sleep.py"
IDLE, CONTEXT, WEIGHTS, KV = 512 * MIB, 600 * MIB, 1200 * MIB, 100 * GIB
LEAK = 100 * MIB
TORCH_CACHE = 700 * MIB  # what vLLM's sleep may give back of torch's cache (Note [Woken below awake])


class FakeVllm:
    """vLLM's API server as the script sees it, in a thread: memory follows what sleeps and wakes (context,
    weights, KV cache), tokens follow the prompt. ``broken`` names the faults to play (see ``BREAKS``)."""

    def __init__(self, mode: str, port: int, broken: frozenset[str] = frozenset()) -> None:
        self.mode, self.broken = mode, broken
        self.weights_awake = self.kv_awake = True
        self.health_misses, self.wakes, self.plain_wakes, self.leak = 2, 0, 0, 0
        self.context = CONTEXT
        self.cached: set[tuple[int, ...]] = set()
        self.calls: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> FakeVllm:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def used(self) -> int:
        return IDLE + self.context + WEIGHTS * self.weights_awake + KV * self.kv_awake + self.leak

    def handle(self, method: str, path: str, query: dict, body: dict | None) -> tuple[int, object]:
        self.calls.append(
            f"{method} {path}" + (f"?{'&'.join(f'{k}={v[0]}' for k, v in query.items())}" if query else "")
        )
        routes = {
            ("GET", "/health"): self.health,
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/sleep"): self.sleep,
            ("POST", "/wake_up"): self.wake_up,
            ("GET", "/is_sleeping"): self.is_sleeping,
            ("POST", "/collective_rpc"): self.collective_rpc,
            ("GET", "/metrics"): self.metrics,
        }
        found = routes.get((method, path))
        return found(query, body) if found else (404, {"detail": "Not Found"})

    def health(self, query, body):
        if self.health_misses:
            self.health_misses -= 1
            return 503, ""
        return 200, ""

    def completions(self, query, body):
        if not (self.weights_awake and self.kv_awake):
            return 500, {"error": "asleep"}
        prompt = body["prompt"]
        shift = (
            ("tokens_change_after_wake" in self.broken and self.wakes > 0)
            + 100 * self.plain_wakes * ("tokens_change_after_plain_wake" in self.broken)
            + 1000 * ("extensible_tokens_differ" in self.broken and self.mode == "extensible")
        )
        ids = [(sum(prompt) * 31 + 7 * i + shift) % 151936 for i in range(body["max_tokens"])]
        cached = 32 if tuple(prompt) in self.cached else 0
        self.cached.add(tuple(prompt))
        choice = {"index": 0, "text": "", "finish_reason": "length"}
        if "no_token_ids" not in self.broken:
            choice["token_ids"] = ids
        return 200, {"choices": [choice], "usage": {"prompt_tokens_details": {"cached_tokens": cached}}}

    def sleep(self, query, body):
        assert query == {"level": ["1"]}
        self.weights_awake = self.kv_awake = False
        self.cached.clear()
        if "cache_emptied_on_sleep" in self.broken:
            self.context = CONTEXT - TORCH_CACHE
        return 200, ""

    def wake_up(self, query, body):
        tags = query.get("tags")
        if tags is None or "weights" in tags:
            self.weights_awake = True
        if tags is None or "kv_cache" in tags or "kv_wakes_with_weights" in self.broken:
            self.kv_awake = True
        self.wakes += 1
        self.plain_wakes += tags is None
        if self.weights_awake and self.kv_awake and "leak_after_wake" in self.broken:
            self.leak += LEAK
        if self.weights_awake and self.kv_awake and "leak_at_first_wake" in self.broken:
            self.leak = LEAK
        return 200, ""

    def is_sleeping(self, query, body):
        asleep = not (self.weights_awake and self.kv_awake)
        if "sleeping_wrong" in self.broken and self.weights_awake:
            asleep = False
        return 200, {"is_sleeping": asleep}

    def collective_rpc(self, query, body):
        method = body["method"]
        if method == "serve_sleep_reinit_weights" and "reinit_fails" not in self.broken:
            return 200, {"results": [310]}
        if method == "serve_sleep_reading":
            extensible = self.mode == "extensible" and "plugin_inactive" not in self.broken
            reading = {"used": self.used(), "kv": {"released": not self.kv_awake} if extensible else None}
            if "no_kv_bytes" not in self.broken:
                reading["kv_bytes"] = KV
            return 200, {"results": [reading]}
        if method == "extensible_kv_report" and self.mode == "extensible":
            return 200, {"results": [{"final_blocks": 1000}]}
        return 500, {"error": f"Call to {method} method failed"}

    def metrics(self, query, body):
        awake = int(self.weights_awake and self.kv_awake)
        lines = [
            "# HELP vllm:engine_sleep_state Engine sleep state",
            f'vllm:engine_sleep_state{{engine="0",model_name="m",sleep_state="awake"}} {float(awake)}',
            f'vllm:engine_sleep_state{{engine="0",model_name="m",sleep_state="weights_offloaded"}} {1.0 - awake}',
            'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="discard_all"} 0.0',
        ]
        return 200, "\n".join(lines) + "\n"


def _handler(fake: FakeVllm) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._answer("GET")

        def do_POST(self) -> None:
            self._answer("POST")

        def _answer(self, method: str) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            status, payload = fake.handle(method, url.path, parse_qs(url.query), body)
            data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    return Handler


class FakeHandle:
    describe = {"command": ["fake"], "env": {}}

    def __init__(self, launcher: FakeLauncher, fake: FakeVllm | None, exit_code: int | None) -> None:
        self.launcher, self.fake, self.exit_code = launcher, fake, exit_code
        self.stopped = False

    def exited(self) -> int | None:
        return self.exit_code

    def stop(self) -> dict:
        self.stopped = True
        if self.fake is not None:
            self.fake.stop()
        self.launcher.current = None
        return {"signals": ["SIGTERM"], "exit": 0, "seconds": 0.0, "left": []}


class FakeLauncher:
    """The script's ``launch``: a ``FakeVllm`` per mode (``broken`` in every mode unless ``only``), or, with
    ``exit_code``, a server that is gone before it answers."""

    def __init__(self, broken=(), only: str | None = None, exit_code: int | None = None, healthy: bool = True):
        self.broken, self.only, self.exit_code, self.healthy = frozenset(broken), only, exit_code, healthy
        self.servers: dict[str, FakeVllm] = {}
        self.handles: list[FakeHandle] = []
        self.current: FakeVllm | None = None

    def __call__(self, mode: str, port: int, log: Path) -> FakeHandle:
        log.write_text("fake server\n")
        fake = None
        if self.exit_code is None:
            fake = FakeVllm(mode, port, self.broken if self.only in (None, mode) else frozenset()).start()
            if not self.healthy:
                fake.health_misses = 10**9
            self.servers[mode] = self.current = fake
        self.handles.append(FakeHandle(self, fake, self.exit_code))
        return self.handles[-1]

    def memory(self) -> int:
        """nvidia-smi's figure: MiB, device-wide."""
        used = self.current.used() if self.current else IDLE
        return used // MIB * MIB


@pytest.fixture(autouse=True)
def _fast_polls(monkeypatch):
    monkeypatch.setattr(serve_sleep, "POLL_S", 0.01)


def _run(tmp_path: Path, launcher: FakeLauncher, *extra: str) -> tuple[int, dict]:
    args = serve_sleep.parser().parse_args([str(tmp_path / "out"), "--timeout-s", "5", *extra])
    rc = serve_sleep.run(args, launch=launcher, memory=launcher.memory)
    return rc, json.loads((tmp_path / "out" / "summary.json").read_text())


# -- a good run ----------------------------------------------------------------------------------------------------
def test_a_good_run_passes_every_check_and_writes_the_files(tmp_path, capsys):
    launcher = FakeLauncher()
    rc, summary = _run(tmp_path, launcher)
    assert rc == 0
    assert summary["checks"] == {
        "tokens_identical_after_wake": True,
        "tokens_legacy_vs_extensible": True,
        "kv_released_while_weights_awake": True,
        "memory_after_wake_within_64_mib": True,
    }
    legacy, extensible = summary["cases"]
    assert [legacy["mode"], extensible["mode"]] == ["legacy", "extensible"]
    for row in (legacy, extensible):
        assert row["state"] == "complete" and row["verdict"] == "pass", row
        assert row["weights"] == "reinitialised"
        assert row["awake"] == IDLE + CONTEXT + WEIGHTS + KV
        assert row["asleep"] == IDLE + CONTEXT
        assert row["weights_woken"] == IDLE + CONTEXT + WEIGHTS
        assert row["freed"] == WEIGHTS + KV
        assert row["kv_released_basis"] == "kv bytes"
        assert row["wake_drift"] == 0
        assert row["cached_after_wake"] == 0  # the sleep reset the prefix cache
        assert row["distinct_tokens"] > 1
    assert (legacy["extensible_active"], extensible["extensible_active"]) == (False, True)
    assert summary["pairs"][0]["verdict"] == "pass"
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "serve-extensible.json",
        "serve-extensible.log",
        "serve-legacy.json",
        "serve-legacy.log",
        "summary.json",
        "table.md",
    ]
    table = (out / "table.md").read_text()
    assert table in capsys.readouterr().out
    assert "| serve-qwen3-0.6b-shape-extensible | complete | reinitialised |" in table
    assert "- tokens legacy vs extensible: yes" in table
    assert all(h.stopped for h in launcher.handles)


def test_the_mode_file_holds_the_sequence_its_timings_and_the_readings(tmp_path):
    launcher = FakeLauncher()
    _run(tmp_path, launcher)
    result = json.loads((tmp_path / "out" / "serve-extensible.json").read_text())
    assert result["complete"] and result["extensible"] == {"final_blocks": 1000}
    phases = result["phases"]
    assert phases["weights_then_kv"]["sleeping_weights"] is True and phases["sleep_wake"]["sleeping_woken"] is False
    assert phases["before"]["memory"]["sleep_state"] == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    assert phases["weights_then_kv"]["asleep"]["sleep_state"]["weights_offloaded"] == 1.0
    assert phases["before"]["tokens"]["cached_tokens"] == [32] * serve_sleep.NUM_PROMPTS  # read what the warm pass left
    calls = [c["call"] for c in result["calls"]]
    assert calls[0] == "POST /collective_rpc" and all(isinstance(c["seconds"], float) for c in result["calls"])
    assert result["server"]["stop"]["signals"] == ["SIGTERM"]


def test_the_server_sees_the_planned_routes_in_order(tmp_path):
    launcher = FakeLauncher()
    _run(tmp_path, launcher)
    planned = [serve_sleep.route(*ROUTES[action]) for _, action, _ in PLAN if action in ROUTES]
    for fake in launcher.servers.values():
        seen = [c for c in fake.calls if c.split(" ")[1].split("?")[0] in ("/sleep", "/wake_up", "/is_sleeping")]
        assert seen == planned
        assert seen[:4] == ["POST /sleep?level=1", "GET /is_sleeping", "POST /wake_up?tags=weights", "GET /is_sleeping"]


# -- each check fails when the server breaks it --------------------------------------------------------------------
BREAKS = [
    ("tokens_change_after_wake", None, ("checks", "tokens_identical_after_wake")),
    ("extensible_tokens_differ", None, ("checks", "tokens_legacy_vs_extensible")),
    ("kv_wakes_with_weights", None, ("checks", "kv_released_while_weights_awake")),
    ("leak_after_wake", None, ("checks", "memory_after_wake_within_64_mib")),
    ("leak_at_first_wake", None, ("checks", "memory_after_wake_within_64_mib")),
    ("tokens_change_after_plain_wake", "extensible", ("extensible", "tokens_after_wake")),
    ("sleeping_wrong", "extensible", ("extensible", "is_sleeping_ok")),
    ("plugin_inactive", "extensible", ("extensible", "mode_ok")),
]


@pytest.mark.parametrize(("broken", "only", "where"), BREAKS, ids=[b[0] for b in BREAKS])
def test_a_broken_server_fails_its_check(tmp_path, broken, only, where):
    rc, summary = _run(tmp_path, FakeLauncher([broken], only=only))
    assert rc == 0  # it ran to its end: the failure is in the table
    group, name = where
    if group == "checks":
        assert summary["checks"][name] is False
        assert [k for k, v in summary["checks"].items() if v is not True] == [name]
    else:
        row = next(r for r in summary["cases"] if r["mode"] == group)
        assert row[name] is False and row["verdict"] == f"fail: {name}"
    assert summary["pairs"][0]["verdict"].startswith("fail")


def test_a_wake_below_before_sleep_passes_when_every_wake_agrees(tmp_path):
    """Note [Woken below awake]: torch's cache emptied by the sleep leaves every wake lower than before; it passes
    (the same run with every wake above before sleep is ``leak_at_first_wake`` in ``BREAKS``)."""
    rc, summary = _run(tmp_path, FakeLauncher(["cache_emptied_on_sleep"]))
    assert rc == 0
    rows = {r["mode"]: r for r in summary["cases"]}
    got = {m: (r["awake"] - r["woken"], r["wake_drift"], r["verdict"]) for m, r in rows.items()}
    assert got == {"legacy": (TORCH_CACHE, 0, "pass"), "extensible": (TORCH_CACHE, 0, "pass")}, got
    assert summary["checks"]["memory_after_wake_within_64_mib"] is True


def test_kv_released_without_kv_bytes_falls_back_to_the_tolerance(tmp_path):
    rc, summary = _run(tmp_path, FakeLauncher(["no_kv_bytes"]))
    assert {r["kv_released_basis"] for r in summary["cases"]} == {"tolerance"}
    assert summary["checks"]["kv_released_while_weights_awake"] is True
    rc, summary = _run(tmp_path, FakeLauncher(["no_kv_bytes", "kv_wakes_with_weights"]))
    assert summary["checks"]["kv_released_while_weights_awake"] is False


def test_a_reply_without_token_ids_stops_the_mode_where_it_failed(tmp_path):
    launcher = FakeLauncher(["no_token_ids"])
    rc, summary = _run(tmp_path, launcher)
    assert rc == 1
    row = summary["cases"][0]
    assert row["state"] == "failed in before" and "return_token_ids" in row["detail"]
    assert summary["checks"]["tokens_identical_after_wake"] is False
    assert all(h.stopped for h in launcher.handles)
    assert "| failed in before |" in (tmp_path / "out" / "table.md").read_text()


def test_a_failed_reinit_is_recorded_and_the_run_goes_on(tmp_path):
    rc, summary = _run(tmp_path, FakeLauncher(["reinit_fails"]))
    assert rc == 0
    assert {r["weights"] for r in summary["cases"]} == {"dummy (reinit failed)"}
    rc, summary = _run(tmp_path, FakeLauncher(), "--dummy-weights")
    assert {r["weights"] for r in summary["cases"]} == {"dummy"}


def test_a_server_that_exits_or_never_answers_fails_in_start(tmp_path):
    launcher = FakeLauncher(exit_code=1)
    rc, summary = _run(tmp_path, launcher, "--modes", "legacy")
    assert rc == 1 and summary["cases"][0]["state"] == "failed in start"
    assert "exited with status 1" in summary["cases"][0]["detail"] and launcher.handles[0].stopped
    assert json.loads((tmp_path / "out" / "serve-legacy.json").read_text())["error"]["log_tail"] == ["fake server"]
    args = serve_sleep.parser().parse_args([str(tmp_path / "o2"), "--modes", "extensible", "--timeout-s", "0.05"])
    launcher = FakeLauncher(healthy=False)
    assert serve_sleep.run(args, launch=launcher, memory=launcher.memory) == 1
    detail = json.loads((tmp_path / "o2" / "summary.json").read_text())["cases"][0]["detail"]
    assert "no 200 from /health" in detail


def test_the_summary_fits_the_reports_schema(tmp_path):
    pytest.importorskip("pydantic")
    from extensible_kv_lab.measurements import ScriptSummary, read

    _run(tmp_path, FakeLauncher())
    summary = read(tmp_path / "out" / "summary.json", ScriptSummary)
    assert len(summary.cases) == 2 and len(summary.pairs) == 1


# -- pure parts ----------------------------------------------------------------------------------------------------
def test_parse_completion_needs_token_ids():
    ids, cached = serve_sleep.parse_completion(
        {"choices": [{"token_ids": [1, 2]}], "usage": {"prompt_tokens_details": {"cached_tokens": 16}}}
    )
    assert (ids, cached) == ([1, 2], 16)
    assert serve_sleep.parse_completion({"choices": [{"token_ids": [3]}], "usage": {}}) == ([3], None)
    for bad in ({}, {"choices": []}, {"choices": [{"text": ""}]}, {"choices": [{"token_ids": ["a"]}]}, None):
        with pytest.raises(serve_sleep.StepFailed):
            serve_sleep.parse_completion(bad)


def test_sleep_state_reads_the_gauges():
    text = 'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 0.0\nother 1\n'
    assert serve_sleep.sleep_state(text) == {"awake": 0.0}
    assert serve_sleep.sleep_state("vllm:num_requests_running 0\n") is None


def test_wait_released_waits_for_memory_to_come_back():
    readings = iter([90 * GIB, 40 * GIB, 1 * GIB])
    assert serve_sleep.wait_released(lambda: next(readings), 1 * GIB)["used"] == 1 * GIB
    assert serve_sleep.wait_released(lambda: 90 * GIB, 1 * GIB, timeout=0.05)["used"] == 90 * GIB


def test_server_env_sets_the_mode_and_leads_with_the_plugin():
    base = {"PYTHONPATH": "/tmp/site", "VLLM_PLUGINS": "other", "KEEP": "1"}
    legacy = serve_sleep.server_env("legacy", "v1", "/plug", base)
    extensible = serve_sleep.server_env("extensible", "v2", "/plug", base)
    assert (legacy["EXTENSIBLE_KV_CACHE"], extensible["EXTENSIBLE_KV_CACHE"]) == ("0", "1")
    assert (legacy["VLLM_USE_V2_MODEL_RUNNER"], extensible["VLLM_USE_V2_MODEL_RUNNER"]) == ("0", "1")
    assert legacy["VLLM_SERVER_DEV_MODE"] == "1" and legacy["KEEP"] == "1" and "VLLM_PLUGINS" not in legacy
    assert legacy["PYTHONPATH"].split(os.pathsep) == ["/plug", str(ROOT / "reference"), str(ROOT), "/tmp/site"]


# -- the command line ----------------------------------------------------------------------------------------------
def _script(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )


def test_dry_run_prints_commands_env_and_routes_and_starts_nothing(tmp_path):
    proc = _script(str(tmp_path / "out"), "--dry-run", "--port", "8123")
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "out").exists()
    legacy, extensible = proc.stdout.split("\nextensible:\n")
    for flags in (
        "-m vllm.entrypoints.openai.api_server --host 127.0.0.1 --port 8123",
        "--load-format dummy --skip-tokenizer-init",
        "--max-model-len 4096 --gpu-memory-utilization 0.85",
        "--enable-sleep-mode",
        "--worker-extension-cls integration.serve_sleep.SleepProbe",
    ):
        assert flags in legacy and flags in extensible
    assert "--enforce-eager" not in proc.stdout
    assert "VLLM_SERVER_DEV_MODE=1" in legacy and "EXTENSIBLE_KV_CACHE=0" in legacy
    assert "EXTENSIBLE_KV_CACHE=1" in extensible
    assert "extensible_kv = extensible_kv.vllm.plugin:register" in legacy
    routes = [line.strip() for line in extensible.splitlines() if ": POST /wake_up" in line or "/sleep?" in line]
    assert routes == [
        "weights_then_kv: POST /sleep?level=1",
        "weights_then_kv: POST /wake_up?tags=weights",
        "weights_then_kv: POST /wake_up?tags=kv_cache",
        "sleep_wake: POST /sleep?level=1",
        "sleep_wake: POST /wake_up",
    ]
    assert 'POST /collective_rpc {"method": "extensible_kv_report"}' in extensible
    assert "extensible_kv_report" not in legacy


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--modes", "legacy,bogus"], "--modes: expected a comma-separated subset of legacy,extensible"),
        (["--modes", "legacy,legacy"], "--modes: expected"),
        (["--port", "70000"], "--port: expected 0 (a free port) or a port up to 65535"),
        (["--timeout-s", "0"], "--timeout-s: expected a positive number of seconds"),
        (["--timeout-s", "inf"], "--timeout-s: expected a positive number"),
        (["--runner", "v3"], "--runner: invalid choice"),
    ],
)
def test_bad_arguments_give_one_line_errors(tmp_path, args, message):
    proc = _script(str(tmp_path / "out"), *args, "--dry-run")
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and message in proc.stderr, proc.stderr


def test_modes_keep_the_order_given():
    assert serve_sleep.parser().parse_args(["o", "--modes", "extensible,legacy"]).modes == ["extensible", "legacy"]


# -- the plugin without an install ---------------------------------------------------------------------------------
def test_the_plugin_dist_is_found_on_pythonpath_alone(tmp_path):
    serve_sleep.write_plugin_dist(tmp_path)
    code = (
        "import json; from importlib.metadata import entry_points; "
        "print(json.dumps([[e.name, e.value, e.dist.name] for e in entry_points(group='vllm.general_plugins')]))"
    )
    # -S: no site-packages, so an installed extensible-kv cannot answer for it
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path)}
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [["extensible_kv", "extensible_kv.vllm.plugin:register", "extensible_kv_plugin"]]


def test_the_plugin_dist_declares_what_pyproject_declares():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared[serve_sleep.PLUGIN_GROUP] == {serve_sleep.PLUGIN_NAME: serve_sleep.PLUGIN_TARGET}


# -- stopping the server's process group ---------------------------------------------------------------------------
@pytest.mark.parametrize("ignores_term", [False, True])
def test_stop_group_leaves_no_process_behind(ignores_term):
    trap = "trap '' TERM; " if ignores_term else ""
    script = f"{trap}sleep 60 & sleep 60 & echo ready; wait"
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"  # the trap is set and the children run
        stopped = serve_sleep.stop_group(proc, grace=1.0 if ignores_term else 10.0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
    assert stopped["left"] == [] and not serve_sleep.group_alive(proc.pid)
    assert stopped["signals"] == (["SIGTERM", "SIGKILL"] if ignores_term else ["SIGTERM"])


# -- vLLM 0.26.0's own parser (where vLLM is importable) -----------------------------------------------------------
PARSE = """
import json, sys
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
platforms._current_platform = CpuPlatform()  # no GPU here: the parser's defaults ask for a device type
from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
validate_parsed_serve_args(args)
keys = ("load_format", "skip_tokenizer_init", "enable_sleep_mode", "enforce_eager", "gpu_memory_utilization",
        "max_model_len", "worker_extension_cls", "attention_backend", "enable_prompt_tokens_details", "port")
out = {k: getattr(args, k) for k in keys}
out["attention_backend"] = str(getattr(out["attention_backend"], "name", out["attention_backend"]))
cc = args.compilation_config
out["capture_sizes"] = cc["cudagraph_capture_sizes"] if isinstance(cc, dict) else cc.cudagraph_capture_sizes
print(json.dumps(out))
"""


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not importable here")
def test_the_server_flags_parse_with_vllms_parser():
    command = serve_sleep.server_command(8123)
    proc = subprocess.run(
        [sys.executable, "-c", PARSE, *command[3:]], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert parsed == {
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enable_sleep_mode": True,
        "enforce_eager": False,
        "gpu_memory_utilization": 0.85,
        "max_model_len": 4096,
        "worker_extension_cls": serve_sleep.PROBE,
        "attention_backend": "FLASH_ATTN",
        "enable_prompt_tokens_details": True,
        "port": 8123,
        "capture_sizes": list(serve_sleep.CAPTURE_SIZES),
    }
