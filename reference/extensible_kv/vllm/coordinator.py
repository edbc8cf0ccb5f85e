"""A coordinator for engines that share one GPU: it moves KV memory from idle engines to busy ones within one
memory limit for the card, through each engine's resize (``resize``). A policy, not a scheduler: it reads each
engine's load every ``interval`` seconds and asks for block counts; the engines schedule their own requests.

Two ``vllm serve`` processes on one card (README, "Several engines on one GPU")::

    python -m extensible_kv.vllm.coordinator --limit-gib 40 \\
        --engine a=http://127.0.0.1:8000 --engine b=http://127.0.0.1:8001

``plan`` is the whole policy, a pure function of the engines' loads (``EngineLoad``) and how long each has been
idle; ``Coordinator.poll`` reads, plans and applies through callables, so it runs against fakes as well as against
``ServeEngine`` (the dev-mode ``/collective_rpc`` route, standard library only).

What enters is checked where it enters: a state whose counts are not integers in range or do not agree
(``EngineLoad.from_state``), two engines of one name (``plan``, ``Coordinator``, the command line: one line and
exit 2 naming the option and the value), and an engine's HTTP reply, read whole within ``timeout`` seconds (a
deadline for the whole call, not per read) and at most ``REPLY_LIMIT_BYTES`` long; a reply that breaks either is
that engine's error for the poll (``resize.ResizeTimeout``, ``resize.ResizeReplyError``).

Note [Never over the limit, never flapping]
    Rule: every plan keeps ``sum(blocks_i x bytes_per_block_i) <= limit`` and ``floor_i <= blocks_i <=
    reserved_i``; shrinks are applied before growths, and a growth only where the sizes the engines really have
    then leave room, so the limit holds between the calls too. A busy engine asks for ``used / target_usage``
    blocks (``used`` in blocks, which does not move when the pool does), its whole reservation while requests
    wait, and never less than it asked for at the poll before while it stays busy; an engine shrinks to its floor
    only after ``idle_polls`` polls in a row with nothing running or waiting; a change smaller than ``min_step`` of
    the engine's size is not made (unless the limit needs it).
    Why: usage as a fraction falls when the pool grows, so a policy on fractions would shrink what it just grew;
    blocks in use do not. Whether requests wait depends on the size the limit gave: an engine shrunk below its
    load starts queueing, asks for more, gets it, stops queueing, asks for less, and is shrunk again; held asks
    end that loop (hypothesis found it: 2 -> 3 -> 2 blocks). The idle count and the dead band keep a burst's gap or
    a rounding from resizing.
    Figure: two engines, one busy at 600 used blocks of 800, one idle at 1,400, limit 2,200 blocks: the idle one
    keeps its size for 3 polls, then goes to its floor; the busy one goes to 751 (600 / 0.8 + 1); later polls
    change nothing (``tests/unit/test_coordinator.py``). On an H100, two engines under a load that moved from one
    to the other: 120 polls, never over the limit, the busy engine's TTFT p99 595 -> 110 ms against a fixed split
    (``reports/runs/h100-2026-12-07-share``).
"""

from __future__ import annotations

import http.client
import io
import json
import logging
import math
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..boundaries import number, shown
from ..errors import ExtensibleKVError
from .resize import (
    COUNT_LIMIT,
    KV_STATE,
    RESIZE,
    ResizeReplyError,
    ResizeTimeout,
    checked_reply,
    positive_count,
    short,
    typed,
)

logger = logging.getLogger("extensible_kv.vllm")


class CoordinatorError(ExtensibleKVError, ValueError):
    """The coordinator's configuration cannot hold: a limit below the engines' floors, a bad engine spec."""


@dataclass(frozen=True)
class EngineLoad:
    """What the coordinator reads from one engine (``resize.EngineResize.state``)."""

    name: str
    num_blocks: int
    floor_blocks: int
    reserved_blocks: int
    bytes_per_block: int
    used_blocks: int
    running: int = 0
    waiting: int = 0

    def __post_init__(self) -> None:
        counts = {k: v for k, v in vars(self).items() if k != "name"}
        bad = {k: v for k, v in counts.items() if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**63}
        if bad:
            raise CoordinatorError(f"engine {self.name}: counts must be integers from 0 to 2**63 - 1, got {bad}")
        if self.bytes_per_block == 0 or not 0 < self.floor_blocks <= self.reserved_blocks:
            raise CoordinatorError(
                f"engine {self.name}: needs bytes_per_block > 0 and 0 < floor_blocks <= reserved_blocks, got "
                f"{self.bytes_per_block}, {self.floor_blocks}, {self.reserved_blocks}"
            )
        if not self.used_blocks < self.num_blocks <= self.reserved_blocks:  # the null block is never used
            raise CoordinatorError(
                f"engine {self.name}: needs used_blocks < num_blocks <= reserved_blocks, got used_blocks="
                f"{self.used_blocks}, num_blocks={self.num_blocks}, reserved_blocks={self.reserved_blocks}"
            )

    @classmethod
    def from_state(cls, name: str, state: Mapping) -> EngineLoad:
        """``state`` as a load; ``CoordinatorError`` naming the engine where it is not one (a reply of another
        shape, a count that is not an integer or out of range, counts that disagree: ``free_blocks`` from 0 to
        ``num_blocks - 1``, as the null block is never free; ``num_blocks`` at most ``reserved_blocks``)."""
        try:
            return cls._from_state(name, state)
        except (KeyError, IndexError, TypeError, ValueError, OverflowError) as exc:
            if isinstance(exc, CoordinatorError):
                raise
            raise CoordinatorError(
                f"engine {name}: its state is not a KV state ({type(exc).__name__}: {exc})"
            ) from None

    @classmethod
    def _from_state(cls, name: str, state: Mapping) -> EngineLoad:
        def count(key: str) -> int:
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{key} is {type(value).__name__} {str(value)[:40]!r}, not an integer")
            return value

        num_blocks, free = count("num_blocks"), count("free_blocks")
        if not 0 <= free < num_blocks:
            raise CoordinatorError(
                f"engine {name}: needs 0 <= free_blocks < num_blocks (the null block is never free), got free_blocks="
                f"{short(free, 60)}, num_blocks={short(num_blocks, 60)}"
            )
        return cls(
            name=name,
            num_blocks=num_blocks,
            floor_blocks=count("floor_blocks"),
            reserved_blocks=count("reserved_blocks"),
            bytes_per_block=count("bytes_per_block"),
            used_blocks=num_blocks - 1 - free,
            running=count("running") if "running" in state else 0,
            waiting=count("waiting") if "waiting" in state else 0,
        )

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0


MIN_TARGET_USAGE = 0.01
"""A busy engine asks for ``used / target_usage`` blocks: below 1% it would ask for a hundred times its load."""


@dataclass(frozen=True)
class Policy:
    limit_bytes: int
    target_usage: float = 0.8  # a busy engine asks for used / target_usage blocks
    idle_polls: int = 3  # polls in a row with nothing running or waiting before an engine shrinks to its floor
    min_step: float = 0.05  # changes smaller than this fraction of the engine's size are not made

    def __post_init__(self) -> None:
        def integer(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def real(v: object) -> bool:  # an int too large for a float is finite, and outside every range here
            return isinstance(v, (int, float)) and not isinstance(v, bool) and (isinstance(v, int) or math.isfinite(v))

        if not integer(self.limit_bytes) or not 0 < self.limit_bytes < 2**63:
            raise CoordinatorError(
                f"limit_bytes must be an integer from 1 to 2**63 - 1, got {number(self.limit_bytes)}"
            )
        if not real(self.target_usage) or not MIN_TARGET_USAGE <= self.target_usage <= 1:
            raise CoordinatorError(f"target_usage must be in [{MIN_TARGET_USAGE}, 1], got {number(self.target_usage)}")
        if not integer(self.idle_polls) or self.idle_polls < 1 or not real(self.min_step) or not 0 <= self.min_step < 1:
            raise CoordinatorError(
                f"idle_polls must be an integer >= 1 and min_step in [0, 1), got idle_polls "
                f"{number(self.idle_polls)}, min_step {number(self.min_step)}"
            )


def desired(load: EngineLoad, policy: Policy, idle_for: int, held: int = 0) -> int:
    """The blocks one engine asks for, before the limit; ``held``: what it asked for at the poll before (Note
    [Never over the limit, never flapping])."""
    if load.idle:
        want = load.floor_blocks if idle_for >= policy.idle_polls else load.num_blocks
    else:
        want = load.reserved_blocks if load.waiting else math.ceil(load.used_blocks / policy.target_usage) + 1
        want = max(want, held)
    return min(max(want, load.floor_blocks), load.reserved_blocks)


def allocate(loads: Sequence[EngineLoad], wants: Mapping[str, int], limit_bytes: int) -> dict[str, int]:
    """Every engine's floor, then what it wants above it; scaled down together where the limit cannot hold it all."""
    floors = sum(e.floor_blocks * e.bytes_per_block for e in loads)
    if floors > limit_bytes:
        raise CoordinatorError(
            f"the engines' floors take {floors} bytes, above the limit of {limit_bytes} bytes: "
            + ", ".join(f"{e.name} {e.floor_blocks} x {e.bytes_per_block}" for e in loads)
        )
    extra = {e.name: (wants[e.name] - e.floor_blocks) * e.bytes_per_block for e in loads}
    room, asked = limit_bytes - floors, sum(extra.values())
    if asked <= room:
        return dict(wants)
    return {e.name: e.floor_blocks + extra[e.name] * room // asked // e.bytes_per_block for e in loads}


def plan(
    loads: Sequence[EngineLoad],
    policy: Policy,
    idle_for: Mapping[str, int],
    held: Mapping[str, int] | None = None,
    wants: dict[str, int] | None = None,
) -> dict[str, int]:
    """The block count for every engine: within the limit, at or above each floor, a dead band around each size.
    ``held``: each engine's ask at the poll before; ``wants``, if given, receives this poll's asks. Engines are
    named by their names: two of one name are refused (``CoordinatorError``)."""
    _distinct([e.name for e in loads])
    asks = {e.name: desired(e, policy, idle_for.get(e.name, 0), (held or {}).get(e.name, 0)) for e in loads}
    if wants is not None:
        wants.update(asks)
    wants = asks
    share = allocate(loads, wants, policy.limit_bytes)
    out = {}
    for e in loads:
        target = share[e.name]
        inside = e.floor_blocks <= e.num_blocks <= e.reserved_blocks  # the band never keeps a size out of bounds
        if inside and abs(target - e.num_blocks) < policy.min_step * e.num_blocks:
            target = e.num_blocks
        out[e.name] = target
    if _bytes(loads, out) > policy.limit_bytes:  # an engine kept above its share by the dead band gives it back
        out = {e.name: share[e.name] if out[e.name] > share[e.name] else out[e.name] for e in loads}
    return out


def _check_name(name: object) -> None:
    """``CoordinatorError`` unless ``name`` is non-empty printable text (it keys the plan and every log line)."""
    if not isinstance(name, str) or not name or not name.isprintable():
        raise CoordinatorError(f"an engine's name must be non-empty printable text, got {short(name, 60)}")


def _distinct(names: Sequence[str]) -> None:
    """``CoordinatorError`` naming the first name given twice."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise CoordinatorError(
                f"engine names must differ: {short(name, 60)} is given twice, in {short(list(names))}"
            )
        seen.add(name)


LOG_RECORDS = 1000
"""Poll records a ``Coordinator`` keeps (``log``): the newest, so a coordinator that runs for days holds a bounded
record of its last polls."""
ERROR_CHARS = 300
"""Characters of an engine's error a poll record keeps: its text shown escaped (no control characters) and cut."""


def error_text(exc: BaseException) -> str:
    """``exc`` for a poll record or a log line: its type and its text, escaped and cut to ``ERROR_CHARS``; an
    exception whose text cannot be read is named as such."""
    try:
        text = str(exc)
    except Exception as failed:  # a __str__ that raises
        text = f"<its text could not be read: {type(failed).__name__}>"
    return f"{type(exc).__name__}: {escaped(text)}"


def escaped(text: str, limit: int = ERROR_CHARS) -> str:
    """``text`` on one line with every character that is not printable written as its escape (``\\n``, ``\\x1b``),
    cut to ``limit`` characters: what an engine says reaches the terminal as text, never as control sequences."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[: limit * 4])
    return out if len(out) <= limit else out[: limit - 3] + "..."


def _bytes(loads: Sequence[EngineLoad], blocks: Mapping[str, int]) -> int:
    return sum(blocks[e.name] * e.bytes_per_block for e in loads)


@dataclass
class EngineHandle:
    """How the coordinator reaches one engine: ``state()`` (``resize.kv_state``'s dict) and ``resize(n)``."""

    name: str
    state: Callable[[], Mapping]
    resize: Callable[[int], Mapping]


@dataclass
class Coordinator:
    engines: Sequence[EngineHandle]
    policy: Policy
    idle_for: dict[str, int] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)
    log: deque[dict] = field(default_factory=lambda: deque(maxlen=LOG_RECORDS))  # the newest LOG_RECORDS polls

    def __post_init__(self) -> None:
        self.engines = list(self.engines)
        for h in self.engines:
            _check_name(h.name)
        _distinct([h.name for h in self.engines])

    def poll(self) -> dict:
        """Read every engine, plan, apply: shrinks first, then growths that the engines' real sizes leave room for.
        A refused or failed resize is recorded and that engine keeps its size."""
        loads: list[EngineLoad] = []
        unread: dict[str, str] = {}
        record: dict
        for h in self.engines:
            try:
                loads.append(EngineLoad.from_state(h.name, h.state()))
            except Exception as exc:  # unreachable, not in dev mode, a reply of another shape
                unread[h.name] = error_text(exc)
        if unread:  # the limit is over every engine's size: without one of them, nothing moves this poll
            record = {"time": time.time(), "loads": [vars(e) for e in loads], "targets": {}, "errors": unread}
            record["sizes"] = {e.name: e.num_blocks for e in loads}
            self.log.append(record)
            return record
        for e in loads:
            self.idle_for[e.name] = self.idle_for.get(e.name, 0) + 1 if e.idle else 0
        asks: dict[str, int] = {}
        targets = plan(loads, self.policy, self.idle_for, self.held, asks)
        self.held = {e.name: asks[e.name] for e in loads if not e.idle}
        sizes = {e.name: e.num_blocks for e in loads}
        handles = {h.name: h for h in self.engines}
        record = {"time": time.time(), "loads": [vars(e) for e in loads], "targets": targets, "errors": {}}
        order = sorted(loads, key=lambda e: targets[e.name] - e.num_blocks)  # shrinks first
        try:
            for e in order:
                n = targets[e.name]
                if n == sizes[e.name]:
                    continue
                if n > sizes[e.name] and _bytes(loads, {**sizes, e.name: n}) > self.policy.limit_bytes:
                    record["errors"][e.name] = f"growth to {n} deferred: a shrink before it did not happen"
                    continue
                try:
                    handles[e.name].resize(n)
                except Exception as exc:  # the engine keeps its size; the next poll tries again
                    try:
                        record["errors"][e.name] = error_text(exc)
                    except BaseException as inner:  # an interrupt while the error was read: named, then goes on
                        record["errors"][e.name] = f"{type(inner).__name__} while reading the resize's error"
                        raise
                    continue
                except BaseException as exc:  # an interrupt or an exit: recorded with what this poll applied
                    record["errors"][e.name] = f"{type(exc).__name__} during the resize to {n} blocks"
                    raise
                sizes[e.name] = n
        finally:
            record["sizes"] = sizes
            self.log.append(record)
        return record

    def run(self, interval: float, polls: int | None = None) -> None:
        done = 0
        while polls is None or done < polls:
            record = self.poll()
            logger.info("coordinator: sizes %s errors %s", record["sizes"], record["errors"])
            done += 1
            time.sleep(interval)


def llm_handle(name: str, llm: object) -> EngineHandle:
    """An in-process engine (an offline ``LLM`` or ``LLMEngine``) as the coordinator reaches it."""
    from .resize import kv_state, resize_kv_cache

    return EngineHandle(name, lambda: kv_state(llm), lambda n: resize_kv_cache(llm, n))


# -- vllm serve over HTTP --------------------------------------------------------------------------------------------
REPLY_LIMIT_BYTES = 4 << 20
"""The longest reply body read from an engine (4 MiB): a state is a few hundred bytes and a resize's record a few
KiB (it names each request it preempted); a longer reply is that engine's error for the poll, read no further."""

TIMEOUT_LIMIT = 24 * 3600.0
"""The longest deadline a ``ServeEngine`` call takes, in seconds (a day)."""


class _Deadline:
    """The end of one call, by ``time.monotonic()``: every send and receive of it waits at most until then."""

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds, self.what, self.end = seconds, what, time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left; ``ResizeTimeout`` naming the call once none are."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise ResizeTimeout(f"{self.what}: no whole reply within the deadline of {self.seconds:g} s")
        return left


class _DeadlineReader(io.RawIOBase):
    """A socket's receiving side, each receive waiting at most until the deadline (a trickle cannot stretch it)."""

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._sock.settimeout(self._deadline.left())
        return self._sock.recv_into(buffer)


class _DeadlineSocket:
    """A connected socket as ``http.client`` uses it (``sendall``, ``makefile``, ``close``), bound to a deadline.
    ``close`` leaves the socket open for the reply still being read (``http.client`` closes the connection of an
    HTTP/1.0 reply before reading its body); the call that opened it closes it (``ServeEngine._rpc``)."""

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        self._sock, self._deadline = sock, deadline

    def sendall(self, data: bytes) -> None:
        self._sock.settimeout(self._deadline.left())
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb", *args: object, **kwargs: object) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _DeadlineConnection(http.client.HTTPConnection):
    """A connection whose socket waits, on every send and receive, only for the time left on ``deadline``."""

    deadline: _Deadline
    opened: list[socket.socket]

    def connect(self) -> None:
        super().connect()  # HTTPSConnection's (TLS) where the class below puts it first
        self.opened.append(self.sock)
        self.sock = _DeadlineSocket(self.sock, self.deadline)


class _HTTP(_DeadlineConnection):
    pass


class _HTTPS(_DeadlineConnection, http.client.HTTPSConnection):
    pass


class ServeEngine:
    """A ``vllm serve`` process started with the plugin and ``VLLM_SERVER_DEV_MODE=1``, through its dev-mode
    ``POST /collective_rpc`` route (standard library only). ``timeout``: the deadline of a whole call, in seconds
    (connecting, sending, the reply's headers and body; a name lookup is the resolver's own), above 0 and at most
    ``TIMEOUT_LIMIT``. A call past it raises ``ResizeTimeout``; a reply body over ``REPLY_LIMIT_BYTES``, or one not
    of the call's documented shape (``resize.checked_reply``), raises ``ResizeReplyError``."""

    def __init__(self, name: str, url: str, timeout: float = 120.0) -> None:
        _check_name(name)
        if not isinstance(url, str) or not url or any(c.isspace() or not c.isprintable() for c in url):
            raise CoordinatorError(
                f"engine {short(name, 60)}: the URL must be text without blanks or control characters, got "
                f"{short(url, 120)}"
            )
        real = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
        if not real or not 0 < timeout <= TIMEOUT_LIMIT:  # nan fails here too
            raise CoordinatorError(
                f"engine {name}: timeout must be a number of seconds above 0 and at most {TIMEOUT_LIMIT:g}, got "
                f"{short(timeout, 60)}"
            )
        self.name, self.url, self.timeout = name, url.rstrip("/"), float(timeout)

    def _rpc(self, method: str, *args: int) -> Mapping:
        from urllib.parse import urlsplit

        what = f"{self.name} ({self.url}) {method}"
        deadline = _Deadline(self.timeout, what)
        body = json.dumps({"method": method, "args": [str(a) for a in args]}).encode()
        parts = urlsplit(self.url)
        connection = (_HTTPS if parts.scheme == "https" else _HTTP)(
            parts.hostname or "", parts.port, timeout=deadline.left()
        )
        connection.deadline, connection.opened = deadline, []
        try:
            connection.request("POST", f"{parts.path}/collective_rpc", body, {"Content-Type": "application/json"})
            reply = connection.getresponse()
            data = self._read(reply, what)
        except ResizeTimeout:
            raise
        except TimeoutError as exc:  # the socket's own timeout, set to the time left
            raise ResizeTimeout(f"{what}: no whole reply within the deadline of {self.timeout:g} s") from exc
        except http.client.HTTPException as exc:  # a reply that is no HTTP
            raise ResizeReplyError(f"{what}: the reply is not HTTP ({type(exc).__name__}: {short(str(exc))})") from exc
        except OSError as exc:  # refused, reset, or closed before the whole reply
            raise ResizeReplyError(f"{what}: no whole reply ({error_text(exc)})") from exc
        finally:
            connection.close()
            for sock in connection.opened:
                sock.close()
        if not 200 <= reply.status < 300:
            detail = escaped(data[:1000].decode(errors="replace"))  # no control characters reach a terminal
            raise typed(RuntimeError(f"{self.name} ({self.url}): HTTP {reply.status}: {detail}"))
        try:
            results = json.loads(data)["results"]
        except (ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
            raise ResizeReplyError(
                f"{what}: the reply is not JSON with a results list ({type(exc).__name__}); the reply was {short(data)}"
            ) from None
        try:
            return checked_reply(method, results, *args[:1] if method == RESIZE else ())
        except ResizeReplyError as exc:
            raise ResizeReplyError(f"{self.name} ({self.url}) {exc.args[0]}") from None

    @staticmethod
    def _read(reply: http.client.HTTPResponse, what: str) -> bytes:
        """The reply's body, at most ``REPLY_LIMIT_BYTES`` of it; ``ResizeReplyError`` naming the limit past it."""
        declared = reply.length  # http.client's reading of Content-Length; None where there is none
        if declared is not None and declared > REPLY_LIMIT_BYTES:
            raise ResizeReplyError(
                f"{what}: the reply declares {declared} bytes, over the limit of {REPLY_LIMIT_BYTES} bytes"
            )
        data = reply.read(REPLY_LIMIT_BYTES + 1)
        if len(data) > REPLY_LIMIT_BYTES:
            raise ResizeReplyError(f"{what}: the reply is over the limit of {REPLY_LIMIT_BYTES} bytes")
        return data

    def state(self) -> Mapping:
        return self._rpc(KV_STATE)

    def resize(self, num_blocks: int) -> Mapping:
        return self._rpc(RESIZE, positive_count(num_blocks, "num_blocks"))

    def handle(self) -> EngineHandle:
        return EngineHandle(self.name, self.state, self.resize)


def parse_engine(spec: str) -> ServeEngine:
    """``name=http://host:port`` -> a ServeEngine."""
    from urllib.parse import urlsplit

    name, sep, url = spec.partition("=")
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError for a port that is no number or out of range
    except ValueError:
        parts, port = None, None
    if not sep or not name or parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise CoordinatorError(f"--engine must be name=http://host:port, got {shown(spec)}")
    del port
    return ServeEngine(name, url)


def _limit_bytes(value: str, *, option: str) -> int:
    """``--limit-gib``'s value in bytes: a number of GiB whose bytes are from 1 to 2**63 - 1."""
    from ..boundaries.numbers import BadNumber

    try:
        gib = float(value)
    except (TypeError, ValueError, OverflowError):
        gib = math.nan
    limit = int(gib * 2**30) if math.isfinite(gib) and 0 < gib < COUNT_LIMIT / 2**30 else 0
    if not 0 < limit < COUNT_LIMIT:
        raise BadNumber(
            f"{option} must be a size in GiB from one byte (2**-30) to below 2**33 (2**63 bytes), got {shown(value)}"
        )
    return limit


def _target_usage(value: str, *, option: str) -> float:
    """``--target-usage``'s value: a fraction from ``MIN_TARGET_USAGE`` to 1."""
    from ..boundaries.numbers import BadNumber

    try:
        usage = float(value)
    except (TypeError, ValueError, OverflowError):
        usage = math.nan
    if not MIN_TARGET_USAGE <= usage <= 1:  # nan fails here too
        raise BadNumber(f"{option} must be a fraction from {MIN_TARGET_USAGE:g} to 1, got {shown(value)}")
    return usage


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: bad input is one line on stderr and exit 2, before any engine is called; an interrupt is
    one line and 130."""
    try:
        return _main(argv)
    except (ExtensibleKVError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; every engine keeps the size it had at the last poll", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    from ..__main__ import _Parser  # bad arguments: one line, no usage
    from ..boundaries.numbers import argument, integer, seconds

    parser = _Parser(prog="python -m extensible_kv.vllm.coordinator", description=__doc__.split("\n")[0])
    parser.add_argument("--engine", action="append", required=True, help="name=http://host:port (two or more)")
    gib = argument(_limit_bytes, "--limit-gib")
    parser.add_argument(
        "--limit-gib", dest="limit_bytes", type=gib, required=True, help="KV memory for all engines on the card, GiB"
    )
    interval = argument(seconds, "--interval", limit=24 * 3600.0, off=False)
    parser.add_argument("--interval", type=interval, default=2.0, help="seconds between polls")
    usage = argument(_target_usage, "--target-usage")
    parser.add_argument("--target-usage", type=usage, default=0.8)
    parser.add_argument("--idle-polls", type=argument(integer, "--idle-polls", high=10**6), default=3)
    polls = argument(integer, "--polls", high=10**9)
    parser.add_argument("--polls", type=polls, default=None, help="stop after this many polls (default: never)")
    args = parser.parse_args(argv)
    given = ", ".join(shown(spec) for spec in args.engine)
    if len(args.engine) < 2:
        raise CoordinatorError(f"--engine must be given two or more times (one engine each), got {given}")
    engines = [parse_engine(s) for s in args.engine]
    names = [e.name for e in engines]
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise CoordinatorError(f"--engine names must differ: {shown(twice)} is given twice in {given}")
    policy = Policy(args.limit_bytes, target_usage=args.target_usage, idle_polls=args.idle_polls)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    Coordinator([e.handle() for e in engines], policy).run(args.interval, args.polls)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
