"""The coordinator's policy (``extensible_kv.vllm.coordinator``): never over the card's limit, never below a floor,
steady load converges and does not flap; refused resizes leave the engine as it was; the HTTP adapter speaks the
dev-mode ``/collective_rpc`` route."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extensible_kv.vllm.coordinator import (
    LOG_RECORDS,
    REPLY_LIMIT_BYTES,
    Coordinator,
    CoordinatorError,
    EngineHandle,
    EngineLoad,
    Policy,
    ServeEngine,
    allocate,
    parse_engine,
    plan,
)
from extensible_kv.vllm.resize import ResizeInProgress, ResizeReplyError, ResizeTimeout

BPB = 1 << 20
STATE = dict(num_blocks=250, reserved_blocks=300, floor_blocks=10, bytes_per_block=BPB, free_blocks=200, running=0,
             waiting=0)  # fmt: skip


class FakeEngine:
    """An engine with a steady load: ``demand`` blocks of requests (what fits runs, the rest waits)."""

    def __init__(self, name, num_blocks, floor, reserved, demand, running=0, waiting=0, bpb=BPB, refuse=False):
        self.name, self.num_blocks, self.floor, self.reserved = name, num_blocks, floor, reserved
        self.demand, self.running, self.waiting, self.bpb, self.refuse = demand, running, waiting, bpb, refuse
        self.sizes = [num_blocks]

    def state(self):
        used = min(self.demand, self.num_blocks - 1)
        short = self.demand > self.num_blocks - 1
        return {
            "num_blocks": self.num_blocks,
            "floor_blocks": self.floor,
            "reserved_blocks": self.reserved,
            "bytes_per_block": self.bpb,
            "free_blocks": self.num_blocks - 1 - used,
            "running": self.running if self.demand else 0,
            "waiting": self.waiting + (1 if short else 0),
        }

    def resize(self, n):
        if self.refuse:
            raise ResizeInProgress(f"resize to {n} blocks refused: a resize is in progress")
        assert self.floor <= n <= self.reserved, (self.name, n)
        self.num_blocks = n
        self.sizes.append(n)
        return {"from": self.sizes[-2], "to": n}

    def handle(self):
        return EngineHandle(self.name, self.state, self.resize)


def _coordinator(engines, limit_blocks, **policy):
    return Coordinator([e.handle() for e in engines], Policy(limit_blocks * BPB, **policy))


engine_strategy = st.builds(
    lambda floor, extra, start, demand, running, waiting: dict(
        floor=floor, reserved=floor + extra, start=floor + min(start, extra), demand=demand, running=running,
        waiting=waiting,
    ),
    st.integers(2, 40),
    st.integers(0, 2000),
    st.integers(0, 2000),
    st.integers(0, 2500),
    st.integers(0, 8),
    st.integers(0, 3),
)  # fmt: skip


def _engines(specs):
    return [
        FakeEngine(f"e{i}", s["start"], s["floor"], s["reserved"], s["demand"], s["running"] or 1, s["waiting"])
        for i, s in enumerate(specs)
    ]


@settings(max_examples=300, deadline=None)
@given(st.lists(engine_strategy, min_size=2, max_size=4), st.integers(0, 3000), st.data())
def test_a_plan_is_never_over_the_limit_nor_below_a_floor_nor_above_a_reservation(specs, slack, data):
    # an engine may start below its floor (a resize of its own, a smaller start): the dead band must not keep it there
    starts = [max(2, s["start"] - data.draw(st.sampled_from([0, 0, 1, s["floor"] // 2]))) for s in specs]
    loads = [
        EngineLoad(
            f"e{i}", start, s["floor"], s["reserved"], BPB, min(s["demand"], start - 1), s["running"], s["waiting"]
        )
        for i, (s, start) in enumerate(zip(specs, starts))
    ]
    limit = sum(e.floor_blocks for e in loads) + slack
    idle_for = {e.name: data.draw(st.integers(0, 5)) for e in loads}
    out = plan(loads, Policy(limit * BPB), idle_for)
    assert sum(out.values()) <= limit
    for e in loads:
        assert e.floor_blocks <= out[e.name] <= e.reserved_blocks, (e, out)


@settings(max_examples=150, deadline=None)
@given(st.lists(engine_strategy, min_size=2, max_size=4), st.integers(0, 3000))
def test_steady_load_converges_and_never_flaps(specs, slack):
    engines = _engines(specs)
    limit = sum(e.floor for e in engines) + slack
    # engines start inside the limit, as engines sized by the coordinator do
    while sum(e.num_blocks for e in engines) > limit:
        big = max(engines, key=lambda e: e.num_blocks - e.floor)
        big.num_blocks = big.sizes[0] = max(big.floor, big.num_blocks - (sum(e.num_blocks for e in engines) - limit))
    coordinator = _coordinator(engines, limit)
    for _ in range(40):
        coordinator.poll()
        assert sum(e.num_blocks for e in engines) <= limit, "over the limit between polls"
    settled = [e.num_blocks for e in engines]
    for _ in range(5):
        coordinator.poll()
    assert [e.num_blocks for e in engines] == settled, "still resizing after 40 polls of a steady load"
    for e in engines:  # no flapping: at most one change of direction per engine
        steps = [b - a for a, b in zip(e.sizes, e.sizes[1:]) if b != a]
        turns = sum(1 for x, y in zip(steps, steps[1:]) if (x > 0) != (y > 0))
        assert turns <= 1, (e.name, e.sizes)


def test_an_idle_engine_shrinks_to_its_floor_and_a_busy_one_grows_within_the_limit():
    busy = FakeEngine("busy", 800, 17, 4000, demand=600, running=8)
    idle = FakeEngine("idle", 1400, 17, 4000, demand=0)
    coordinator = _coordinator([busy, idle], 2200)
    coordinator.poll()
    assert idle.num_blocks == 1400, "an engine idle for one poll was shrunk"
    for _ in range(3):
        coordinator.poll()
    assert idle.num_blocks == 17 and busy.num_blocks == 751
    assert sum(e.num_blocks for e in (busy, idle)) <= 2200
    before = (busy.sizes[:], idle.sizes[:])
    for _ in range(10):
        coordinator.poll()
    assert (busy.sizes, idle.sizes) == before, "a steady load kept resizing"


def test_a_shrink_pays_for_a_growth_in_the_same_poll():
    busy = FakeEngine("busy", 100, 17, 4000, demand=600, running=8, waiting=4)
    idle = FakeEngine("idle", 1800, 17, 4000, demand=0)
    record = _coordinator([busy, idle], 2000, idle_polls=1).poll()
    assert (idle.num_blocks, busy.num_blocks) == (17, 1983) and not record["errors"], record


def test_a_refused_resize_keeps_the_engine_and_defers_the_growth_it_would_have_paid_for():
    busy = FakeEngine("busy", 100, 17, 4000, demand=600, running=8, waiting=4)
    stuck = FakeEngine("stuck", 1800, 17, 4000, demand=0, refuse=True)
    coordinator = _coordinator([busy, stuck], 2000, idle_polls=1)
    record = coordinator.poll()
    assert "ResizeInProgress" in record["errors"]["stuck"] and "deferred" in record["errors"]["busy"]
    assert stuck.num_blocks == 1800 and busy.num_blocks + stuck.num_blocks <= 2000


def test_a_limit_below_the_floors_is_refused_naming_them():
    loads = [EngineLoad("a", 20, 17, 100, BPB, 0), EngineLoad("b", 20, 17, 100, BPB, 0)]
    with pytest.raises(CoordinatorError, match=r"floors take 35651584 bytes.*a 17 x 1048576"):
        allocate(loads, {"a": 17, "b": 17}, 30 * BPB)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"limit_bytes": 0},
        {"limit_bytes": 1, "target_usage": 0},
        {"limit_bytes": float("nan")},
        {"limit_bytes": "1"},
        {"limit_bytes": True},
        {"limit_bytes": 2**80},
        {"limit_bytes": 1, "target_usage": 5e-324},
        {"limit_bytes": 1, "target_usage": float("nan")},
        {"limit_bytes": 1, "idle_polls": 2.5},
    ],
    ids=repr,
)
def test_a_bad_policy_is_refused(kwargs):
    with pytest.raises(CoordinatorError):
        Policy(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"bytes_per_block": 0}, "bytes_per_block > 0"),
        ({"floor_blocks": 500}, "floor_blocks <= reserved_blocks"),
        ({"used_blocks": -1}, "counts must be integers"),
        ({"num_blocks": 1.5}, "counts must be integers"),
    ],
)
def test_a_load_that_cannot_be_planned_is_refused_naming_the_engine(kwargs, match):
    fields = dict(name="a", num_blocks=100, floor_blocks=10, reserved_blocks=100, bytes_per_block=BPB, used_blocks=0)
    with pytest.raises(CoordinatorError, match=f"engine a: .*{match}"):
        EngineLoad(**{**fields, **kwargs})


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(free_blocks=-1), "0 <= free_blocks < num_blocks"),
        (dict(free_blocks=250), "0 <= free_blocks < num_blocks"),
        (dict(num_blocks=100, free_blocks=500), "0 <= free_blocks < num_blocks"),
        (dict(num_blocks=301), "num_blocks <= reserved_blocks"),
        (dict(num_blocks=0, free_blocks=0), "0 <= free_blocks < num_blocks"),
        (dict(running=-1), "counts must be integers from 0"),
        (dict(waiting=2**63), "counts must be integers from 0"),
    ],
    ids=repr,
)
def test_a_state_with_counts_out_of_range_or_that_disagree_is_refused_naming_them(changes, match):
    state = {**STATE, **changes}
    try:
        load = EngineLoad.from_state("e", state)
    except CoordinatorError as exc:
        assert "engine e" in str(exc) and match in str(exc), f"from_state({changes}): {exc}"
    else:
        pytest.fail(f"from_state({changes}): expected CoordinatorError naming {match!r}, got {load}")


def test_two_engines_of_one_name_are_refused_by_plan_and_by_the_coordinator():
    loads = [EngineLoad("a", 100, 10, 300, BPB, 50, running=1), EngineLoad("a", 100, 10, 300, BPB, 0)]
    try:
        out = plan(loads, Policy(limit_bytes=200 * BPB), {"a": 0}, {})
    except CoordinatorError as exc:
        assert "'a' is given twice" in str(exc), str(exc)
    else:
        pytest.fail(f"plan of two engines named 'a': expected CoordinatorError, got {out}")
    engines = [FakeEngine("a", 100, 10, 300, 0).handle(), FakeEngine("a", 100, 10, 300, 90, running=1).handle()]
    try:
        coordinator = Coordinator(engines, Policy(200 * BPB))
    except CoordinatorError as exc:
        assert "'a' is given twice" in str(exc), str(exc)
    else:
        pytest.fail(f"Coordinator of two engines named 'a': expected CoordinatorError, got {coordinator}")


@pytest.mark.parametrize("reply", [{"num_blocks": "lots"}, {}, ["not", "a", "state"], {"num_blocks": True}])
def test_a_poll_with_an_engine_it_cannot_read_moves_no_engine(reply):
    busy, idle = FakeEngine("a", 100, 10, 1000, 90, running=4), FakeEngine("b", 900, 10, 1000, 0)
    broken = EngineHandle("c", lambda: reply, lambda n: pytest.fail("no resize of an engine that was not read"))
    coordinator = Coordinator([busy.handle(), idle.handle(), broken], Policy(1100 * BPB, idle_polls=1))
    for _ in range(3):
        record = coordinator.poll()
        assert "engine c: its state is not a KV state" in record["errors"]["c"], record["errors"]
    assert busy.sizes == [100] and idle.sizes == [900]


@pytest.mark.parametrize("spec", ["a", "a=localhost:8000", "=http://x", "a=http://[::1", "a=http://h:abc", "a=http://"])
def test_a_bad_engine_spec_is_refused(spec):
    with pytest.raises(CoordinatorError, match="name=http://host:port"):
        parse_engine(spec)


def test_the_serve_adapter_speaks_the_collective_rpc_route_and_raises_typed():
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, body))
            if body["args"] == ["7"]:
                self.send_response(500)
                self.end_headers()
                self.wfile.write(b'{"error": "Call to collective_rpc method failed: [ResizeRefused] below the floor"}')
                return
            reply = {"from": 100, "to": int(body["args"][0])} if body["args"] else STATE
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps({"results": [reply]}).encode())

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        engine = ServeEngine("a", f"http://127.0.0.1:{server.server_port}")
        assert engine.resize(40) == {"from": 100, "to": 40}
        assert seen[-1] == ("/collective_rpc", {"method": "extensible_kv_resize", "args": ["40"]})
        assert engine.state() == STATE
        assert seen[-1][1] == {"method": "extensible_kv_kv_state", "args": []}
        from extensible_kv.vllm.resize import ResizeRefused

        with pytest.raises(ResizeRefused, match="below the floor"):
            engine.resize(7)
    finally:
        server.shutdown()
        server.server_close()


class RawServer:
    """A local TCP server answering each connection with ``answer(connection, stop)`` in a thread, until closed."""

    def __init__(self, answer) -> None:
        self.answer, self.stop = answer, threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                connection, _ = self.sock.accept()
            except OSError:
                continue
            with connection:
                try:
                    connection.recv(65536)  # the request: one small segment on loopback
                    self.answer(connection, self.stop)
                    connection.shutdown(socket.SHUT_WR)  # the reply ends here
                    connection.settimeout(5.0)
                    while connection.recv(65536):  # the rest until the client hangs up: no reset on close
                        pass
                except OSError:  # the client hung up
                    pass

    def __enter__(self) -> RawServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
        self.sock.close()


def _within(call, bound: float = 60.0):
    """``call()``'s result or error, from a thread given ``bound`` seconds (a hang fails the test, not the run)."""
    out: dict = {}

    def target():
        try:
            out["value"] = call()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(bound)
    assert not thread.is_alive(), f"the call was still running after {bound} s"
    return out


def _trickle(start: bytes):
    def answer(connection, stop):
        connection.sendall(start)
        while not stop.wait(0.2):
            connection.sendall(b"a")

    return answer


@pytest.mark.parametrize(
    "start",
    [b"HTTP/1.0 200 OK\r\nX-Slow: ", b"HTTP/1.0 200 OK\r\nContent-Length: 100000\r\n\r\n", b"H"],
    ids=["headers", "body", "status_line"],
)
def test_a_serve_call_is_bounded_by_its_deadline_as_a_whole_not_per_read(start):
    with RawServer(_trickle(start)) as server:
        engine = ServeEngine("slow", server.url, timeout=1.0)
        out = _within(engine.state)
    error = out.get("error")
    assert isinstance(error, ResizeTimeout), f"state() of a trickling engine: expected ResizeTimeout, got {out}"
    assert "slow" in str(error) and "deadline of 1 s" in str(error), str(error)


def _stream(total: int):
    def answer(connection, stop):
        connection.sendall(b"HTTP/1.0 200 OK\r\n\r\n")
        for _ in range(total // 65536):
            connection.sendall(b"[" * 65536)

    return answer


def _declared(length: int):
    def answer(connection, stop):
        connection.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n[" % length)
        stop.wait(30)

    return answer


@pytest.mark.parametrize(
    "answer", [_stream(REPLY_LIMIT_BYTES + (4 << 20)), _declared(3 << 30)], ids=["streamed", "declared"]
)
def test_a_reply_over_the_limit_is_that_engines_error_for_the_poll_naming_the_limit(answer):
    with RawServer(answer) as server:
        big = ServeEngine("big", server.url, timeout=20.0)
        other = FakeEngine("other", 100, 10, 1000, 90, running=4)
        coordinator = Coordinator([big.handle(), other.handle()], Policy(1100 * BPB, idle_polls=1))
        out = _within(coordinator.poll)
    record = out.get("value")
    assert record is not None, f"poll with an over-long reply: expected a record, got {out}"
    error = record["errors"].get("big", "")
    assert "ResizeReplyError" in error and f"limit of {REPLY_LIMIT_BYTES} bytes" in error, record["errors"]
    assert other.sizes == [100], "an engine was resized in a poll that could not read every engine"


@pytest.mark.parametrize("body", [b"not json", b'{"results": 5}', b"[" * 100_000, b'{"results": [1, 2]}'])
def test_a_served_reply_not_of_its_shape_is_that_engines_typed_error(body):
    def answer(connection, stop):
        connection.sendall(b"HTTP/1.0 200 OK\r\n\r\n" + body)

    with RawServer(answer) as server:
        out = _within(ServeEngine("odd", server.url, timeout=20.0).state)
    error = out.get("error")
    assert isinstance(error, ResizeReplyError), (
        f"state() with reply {body[:20]!r}: expected ResizeReplyError, got {out}"
    )
    assert "odd" in str(error) and len(str(error)) < 600, str(error)


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), 1e308, True, "2"], ids=repr)
def test_a_serve_engine_timeout_that_is_no_deadline_is_refused_naming_it(timeout):
    with pytest.raises(CoordinatorError, match="timeout must be a number of seconds"):
        ServeEngine("a", "http://127.0.0.1:9", timeout=timeout)


def test_an_offline_engine_is_reached_through_its_collective_rpc():
    from extensible_kv.vllm.coordinator import llm_handle

    calls = []

    def collective_rpc(method, args=()):
        calls.append((method, args))
        return [STATE if method == "extensible_kv_kv_state" else {"from": 250, "to": 40}]

    handle = llm_handle(
        "a", type("LLM", (), {"llm_engine": type("E", (), {"collective_rpc": staticmethod(collective_rpc)})})
    )
    assert handle.state() == STATE and handle.resize(40) == {"from": 250, "to": 40}
    assert calls == [("extensible_kv_kv_state", ()), ("extensible_kv_resize", (40,))]


def test_the_command_line_polls_two_served_engines_and_resizes_the_idle_one():
    engines = {"/a": {"num_blocks": 900, "running": 0}, "/b": {"num_blocks": 100, "running": 4}}
    resized = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            engine = engines[self.path.removesuffix("/collective_rpc")]
            if body["method"] == "extensible_kv_resize":
                engine["num_blocks"] = int(body["args"][0])
                resized.append((self.path, engine["num_blocks"]))
                reply = {"to": engine["num_blocks"]}
            else:
                n = engine["num_blocks"]
                used = 90 if engine["running"] else 0
                reply = dict(num_blocks=n, floor_blocks=17, reserved_blocks=4000, bytes_per_block=BPB,
                             free_blocks=n - 1 - used, running=engine["running"], waiting=0)  # fmt: skip
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps({"results": [reply]}).encode())

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        from extensible_kv.vllm.coordinator import main

        argv = ["--engine", f"a={url}/a", "--engine", f"b={url}/b", "--limit-gib", str(1100 * BPB / 2**30)]
        assert main([*argv, "--interval", "0.001", "--polls", "3", "--idle-polls", "2"]) == 0
    finally:
        server.shutdown()
        server.server_close()
    assert ("/a/collective_rpc", 17) in resized and engines["/a"]["num_blocks"] == 17
    assert engines["/b"]["num_blocks"] == 114  # 90 used / 0.8 + 1


@pytest.mark.parametrize(
    "option, value",
    [
        ("--limit-gib", "-1"),
        ("--limit-gib", "nan"),
        ("--limit-gib", "1e308"),
        ("--target-usage", "1.5"),
        ("--interval", "inf"),
        ("--interval", "0"),
        ("--idle-polls", "0"),
        ("--polls", "1e3"),
        ("--target-usage", "5e-324"),
        ("--target-usage", "0.001"),
        ("--limit-gib", "1e-30"),
        ("--limit-gib", "8589934592"),
    ],
)
def test_a_bad_number_on_the_command_line_is_one_line_and_exit_2_before_any_engine_is_called(option, value, capsys):
    from extensible_kv.vllm.coordinator import main

    argv = ["--engine", "a=http://127.0.0.1:9/a", "--engine", "b=http://127.0.0.1:9/b", "--limit-gib", "1"]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, option, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1, f"{option} {value}: expected one line and exit 2, got {err}"
    assert option in err[0] and value in err[0], f"{option} {value}: expected both named, got {err[0]}"


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--engine", "a=http://127.0.0.1:9", "--engine", "a=http://127.0.0.1:9"], "engine names must differ"),
        (["--engine", "a=ftp://x", "--engine", "b=http://127.0.0.1:9"], "name=http://host:port"),
        (["--engine", "a=http://[::1", "--engine", "b=http://127.0.0.1:9"], "name=http://host:port"),
        (["--engine", "a=http://h:abc", "--engine", "b=http://127.0.0.1:9"], "name=http://host:port"),
        (["--engine", "a=http://127.0.0.1:9"], "--engine must be given two or more times"),
        (["--engine", "a=http://127.0.0.1:9", "--engine", "a=http://127.0.0.1:8"], "--engine names must differ"),
    ],
)
def test_a_bad_engine_list_is_one_line_and_exit_2(argv, match, capsys):
    from extensible_kv.vllm.coordinator import main

    code = main([*argv, "--limit-gib", "1", "--polls", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and match in err[0], (
        f"{argv}: expected exit 2 and one line {match!r}, got {code}, {err}"
    )
    assert argv[1] in err[0], f"{argv}: expected the value given named, got {err[0]}"


def test_an_interrupt_while_polling_is_one_line_and_exit_130(monkeypatch, capsys):
    from extensible_kv.vllm import coordinator

    def interrupted(self, interval, polls):
        raise KeyboardInterrupt

    monkeypatch.setattr(coordinator.Coordinator, "run", interrupted)
    argv = ["--engine", "a=http://127.0.0.1:9", "--engine", "b=http://127.0.0.1:9", "--limit-gib", "1"]
    assert coordinator.main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "interrupted" in err[0], err


class _Unreadable(Exception):
    def __str__(self):
        raise RuntimeError("its __str__ raises")


@pytest.mark.parametrize(
    "exc,expected",
    [
        (RuntimeError("HTTP 500: \x1b]0;pwned\x07\nnext"), "RuntimeError: HTTP 500: \\x1b]0;pwned\\x07\\nnext"),
        (_Unreadable(), "_Unreadable: <its text could not be read: RuntimeError>"),
        (ValueError("x" * (20 << 20)), "ValueError: " + "x" * 297 + "..."),
    ],
    ids=["control-characters", "unreadable-text", "20-MiB-text"],
)
def test_an_engines_error_is_recorded_escaped_bounded_and_never_breaks_the_poll(exc, expected):
    def state():
        raise exc

    good = FakeEngine("b", 100, 10, 1000, 0)
    coordinator = Coordinator([EngineHandle("a", state, lambda n: {}), good.handle()], Policy(1100 * BPB))
    record = coordinator.poll()
    assert record["errors"] == {"a": expected}, f"poll with engine a raising {type(exc).__name__}: {record['errors']}"


def test_the_coordinator_keeps_a_bounded_log_of_its_newest_polls():
    engines = [FakeEngine("a", 100, 10, 1000, 0), FakeEngine("b", 100, 10, 1000, 0)]
    coordinator = _coordinator(engines, 1100)
    for _ in range(LOG_RECORDS + 50):
        coordinator.poll()
    assert len(coordinator.log) == LOG_RECORDS, f"after {LOG_RECORDS + 50} polls: {len(coordinator.log)} records"


@pytest.mark.parametrize("name", [["x"], "a\x1b[31m", "a\nb", "", None])
def test_an_engine_name_that_is_not_printable_text_is_refused(name):
    with pytest.raises(CoordinatorError, match="non-empty printable text"):
        Coordinator([EngineHandle(name, dict, lambda n: {}), EngineHandle("b", dict, lambda n: {})], Policy(BPB))
    with pytest.raises(CoordinatorError, match="non-empty printable text"):
        ServeEngine(name, "http://127.0.0.1:1")


@pytest.mark.parametrize("url", ["http://h\x1b:1", "http://127.0.0.1:1/x\r\nX-Inj: 1", "http://127.0.0.1:1/a b", ""])
def test_a_url_with_blanks_or_control_characters_is_refused_before_any_call(url):
    with pytest.raises(CoordinatorError, match="without blanks or control characters"):
        ServeEngine("a", url)


def test_a_reply_cut_off_by_the_engine_is_the_typed_reply_error():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def serve():
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"res')
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # reset
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with pytest.raises(ResizeReplyError):
            ServeEngine("a", f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=10).state()
    finally:
        thread.join(10)
        listener.close()


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit], ids=["interrupt", "exit"])
def test_an_interrupt_in_a_growth_keeps_the_record_of_the_shrink_the_poll_applied(exc):
    busy = FakeEngine("busy", 100, 17, 4000, demand=600, running=8, waiting=4)
    idle = FakeEngine("idle", 1800, 17, 4000, demand=0)

    def interrupted(n):
        raise exc()

    coordinator = Coordinator([EngineHandle("busy", busy.state, interrupted), idle.handle()], Policy(2000 * BPB))
    coordinator.policy = Policy(2000 * BPB, idle_polls=1)
    with pytest.raises(exc):
        coordinator.poll()
    assert idle.num_blocks == 17, "the shrink before the interrupted growth was not applied"
    record = coordinator.log[-1] if coordinator.log else {}
    assert record.get("sizes") == {"busy": 100, "idle": 17} and exc.__name__ in record["errors"].get("busy", ""), (
        f"poll interrupted by {exc.__name__} in busy's growth: expected the record of idle's shrink to 17 and the "
        f"interrupt named, got {record}"
    )


def test_an_interrupt_while_an_engines_error_is_read_is_named_in_the_polls_record():
    busy = FakeEngine("busy", 100, 17, 4000, demand=600, running=8, waiting=4)
    idle = FakeEngine("idle", 1800, 17, 4000, demand=0)

    class Unreadable(Exception):
        def __str__(self):
            raise KeyboardInterrupt  # Ctrl-C landing while the error is turned into text

    def refuse(n):
        raise Unreadable()

    coordinator = Coordinator(
        [busy.handle(), EngineHandle("idle", idle.state, refuse)], Policy(2000 * BPB, idle_polls=1)
    )
    with pytest.raises(KeyboardInterrupt):
        coordinator.poll()
    record = coordinator.log[-1] if coordinator.log else {}
    assert "KeyboardInterrupt" in record.get("errors", {}).get("idle", ""), (
        f"an interrupt while idle's error was read: expected it named in the poll's record, got {record}"
    )


@pytest.mark.parametrize("state", [3, "num_blocks", [1, 2]], ids=["int", "str", "list"])
def test_a_state_that_is_no_mapping_is_refused_naming_the_engine(state):
    # wrong: a scalar or a sequence indexed by key: IndexError or TypeError escaped untyped (numpy scalars too)
    np = pytest.importorskip("numpy")
    for shaped in (state, np.int64(3) if state == 3 else np.zeros(3)):
        with pytest.raises(CoordinatorError, match="engine e: its state is not a KV state"):
            EngineLoad.from_state("e", shaped)


def test_an_engine_below_its_floor_is_brought_to_it_even_within_the_dead_band():
    # wrong: 104 is within 5% of 100, so the dead band kept the engine at 100, below its floor of 104
    load = EngineLoad("a", 100, 104, 200, BPB, 0, 0, 0)
    assert plan([load], Policy(10_000 * BPB), {"a": 0}) == {"a": 104}
