"""Interrupted calls (P-interrupted): every effectful protocol call, interrupted at each line of the driver's own
Python code in turn, is done whole or not at all.

A trace function counts the line events of the files that define the driver's class and its bases, and raises
``Interrupt`` (a ``KeyboardInterrupt``, as a signal handler would) at the n-th, for every n the uninterrupted call
reaches. After each interrupted call the rule settles what it did the way a caller that lost the answer would: the
same call made again must be taken where the call was never made and refused (or, for ``set_access``, taken again)
where it was made, as the executable model says for each state (``ProtocolModel.interrupted``); ``reserve`` and
``create``, whose result never reached the caller, must hold nothing. Then another thread's calls must go through (no
lock left held), every observable must match the model (``ProtocolChecks``: ``mem_info``, ``accessible``, the bytes,
on the host the kernel's maps and memfds), and everything is given back. A driver written in C has no such lines: the
rule then checks each call once, uninterrupted.
"""

from __future__ import annotations

import inspect
import sysconfig
import threading
from pathlib import Path

import pytest

from .helpers import expect
from .kernel_view import KernelView
from .line_trap import Interrupt, LineTrap
from .plugin.selection import retire
from .protocol_checks import learn_setup
from .protocol_machine import ProtocolMachine
from .protocol_model import CallerError, Prediction, ProtocolModel, Refusal, intervals_minus

SCENARIOS = (
    "reserve",
    "create",
    "free",
    "map",
    "set_access",
    "release",
    "free_used",
    "release_mapped",
    "unmap_last",
    "unmap_shared",
)
"""Each call in the states where its paths differ: a reservation fresh or mapped and unmapped again (several kernel
rows), a handle released while mapped or not, the last mapping of a released handle or one of two."""
LOCK_WAIT_S = 30.0
"""How long another thread's reserve and free may take after an interrupted call before the rule says a lock was
left held."""
MAX_LINES = 400
"""Line events of one uninterrupted call past which the rule interrupts only the first ``MAX_LINES``."""


def driver_files(raw: object) -> frozenset[str]:
    """The source files of the driver's class and of every base class outside the standard library."""
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files = set()
    for cls in type(raw).__mro__:
        try:
            path = Path(inspect.getsourcefile(cls) or "").resolve()
        except TypeError:  # a builtin
            continue
        if path.is_file() and stdlib not in path.parents:
            files.add(str(path))
    return frozenset(files)


def prepare(m: ProtocolMachine, scenario: str) -> tuple[str, tuple, int | None]:
    """Make the state ``scenario`` starts from with ``m``'s checked calls; return the call to interrupt as ``(op,
    args in the model's terms, handle key)``."""
    g = m.g
    if scenario == "reserve":
        return "reserve", (3 * g, 4 * g), None
    if scenario == "create":
        return "create", (3 * g,), None
    va = m.do_reserve(4 * g, 2 * g)
    if scenario == "free":
        return "free", (va, 4 * g), None
    if scenario == "free_used":  # granules mapped and unmapped at both ends: the kernel may show several rows
        for at in (va, va + 3 * g):
            key = m.do_create(g)
            m.do_map(at, g, key)
            m.do_release(key)
            m.do_unmap(at, g)
        return "free", (va, 4 * g), None
    key = m.do_create(3 * g)
    if scenario == "release":
        return "release", (key,), key
    off, size = (g, 2 * g) if m.model.offsets and m.model.parts else (0, 3 * g)
    if scenario == "map":
        return "map", (va + g, size, key, off), key
    m.do_map(va + g, size, key, off)
    if scenario == "set_access":
        return "set_access", (va + g, size), None
    if scenario == "release_mapped":
        return "release", (key,), key
    if scenario == "unmap_shared":
        other = m.do_reserve(size, g)
        m.do_map(other, size, key, off)
    m.do_release(key)
    m.do_set_access(va + g, size)
    return "unmap", (va + g, size), None


def driver_args(m: ProtocolMachine, op: str, args: tuple) -> tuple:
    """``args`` with the model's handle key replaced by the driver's handle."""
    if op == "release":
        return (m.objects[args[0]],)
    if op == "map":
        return (*args[:2], m.objects[args[2]], args[3])
    return args


def state_is(m: ProtocolMachine, model: ProtocolModel) -> str | None:
    """Whether every observable matches ``model``: None, or the first that does not."""
    saved, m.model = m.model, model
    try:
        m._check_everything()
    except AssertionError as exc:
        return str(exc)
    finally:
        m.model = saved
    return None


def made_again(done: ProtocolModel, op: str, args: tuple) -> Prediction:
    """What the same call must do once the interrupted call was made: as the model says, or, for the release of
    a handle whose memory that release gave back (a handle no caller may pass again, as its value may name a later
    handle), a refusal: no call came between the two, so the value names that handle still."""
    try:
        return getattr(done.clone(), op)(*args)
    except CallerError:
        why = f"handle {args[0]} was released, and its memory given back, by the interrupted call"
        return Prediction(op, refusal=Refusal(op, "P-release-once", why))


def made_it(m: ProtocolMachine, done: ProtocolModel, op: str, args: tuple, raw_args: tuple, key: int | None) -> None:
    """Take the interrupted call as made: the model after it, and the machine's records of what was made."""
    m.model = done
    m.record_made(op, raw_args, None, key)
    if op == "free":
        m.freed.append(args)


def others_go_through(m: ProtocolMachine, where: str) -> None:
    """Another thread reserves and frees a granule within ``LOCK_WAIT_S``: no lock was left held."""
    g, done = m.g, []

    def other() -> None:
        va = m.raw.reserve(g, g)
        m.raw.free(va, g)
        done.append(True)

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    thread.join(LOCK_WAIT_S)
    m.stuck = not done  # the teardown would wait for the same lock
    expect(
        bool(done), m.driver, f"reserve and free from another thread after {where}", "done", "still waiting (a lock?)"
    )


def interrupted_call(m: ProtocolMachine, scenario: str, files: frozenset[str], n: int) -> int:
    """Prepare ``scenario`` on ``m``, make its call interrupted at line event ``n`` (0: never), settle it, check
    every observable. Returns how many line events the call reached."""
    op, args, key = prepare(m, scenario)
    raw_args = driver_args(m, op, args)
    prediction = getattr(m.model, op)(*args)
    made_key = next(m.keys) if op == "create" else None
    trap = LineTrap(lambda name: str(Path(name).resolve()) in files, n)
    before = KernelView() if m.setup.host and op == "reserve" else None
    try:
        m.call(
            prediction,
            *raw_args,
            key=key if made_key is None else None,
            convert=m.register(made_key) if made_key is not None else None,
            within=lambda: trap,
        )
    except Interrupt:
        pass
    else:
        expect(
            trap.fired is None,
            m.driver,
            f"{op} interrupted at line event {n} ({trap.fired})",
            "the Interrupt coming out of the call",
            "the call returned",
        )
        m.every_observable_matches_the_model()
        return trap.lines
    where = f"{op}{args} interrupted at line event {n} ({trap.fired})"
    if before is not None:  # the range reserve took, if any, never reached the caller (read before any new thread)
        gained = intervals_minus(KernelView().reserved_space(0, 1 << 64), before.reserved_space(0, 1 << 64))
        gained = [(a, b) for a, b in gained if b - a >= args[0]]
        expect(not gained, m.driver, f"{where}: reserved address space the kernel holds since", "none", gained)
    others_go_through(m, where)
    done = m.model.interrupted(op, *args)
    not_made = state_is(m, m.model)
    if not_made is not None:  # not the state of the call never made: it must be that of the call made
        made = state_is(m, done) if done is not None else f"{op} must hold nothing when interrupted"
        expect(
            made is None,
            m.driver,
            f"{where}: the state left",
            "that of the call made or of the call never made",
            f"neither: not made because {not_made}; made because {made}",
        )
    if done is not None:  # settle it: the same call again, taken if it was never made, as the model says if it was
        if_made = made_again(done, op, args)
        if not_made is not None:  # the state is the made call's: the call again must be judged as after it, only
            made_it(m, done, op, args, raw_args, key)
            m.call(if_made, *raw_args, key=key)
        else:  # the state of the call never made, which may be that of the call made as well: either answer
            taken, _ = m.call(getattr(m.model, op)(*args), *raw_args, key=key, or_refused=if_made)
            if not taken:
                made_it(m, done, op, args, raw_args, key)
        if op == "free" and m.setup.host:  # freed either way now: the kernel holds nothing of it (P-free-kernel)
            va, size = args
            left = [(r.lo, r.hi, r.perms) for r in KernelView().rows if r.lo < va + size and va < r.hi]
            expect(not left, m.driver, f"{where}, then free again: what the kernel maps in the range", "nothing", left)
    m.every_observable_matches_the_model()
    return trap.lines


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_call_interrupted_at_any_line_is_done_whole_or_not_at_all(driver, driver_spec, scenario, request):
    """The call of ``scenario`` interrupted at each line event of the driver's code in turn, each time from the same
    state on a fresh machine; settled, checked against the model, everything given back. Checks: P-interrupted,
    P-refusal-unchanged, P-release-returns, P-mem-exact."""
    setup = learn_setup(driver)
    files = driver_files(driver.inner)
    total = 1
    n = 0
    while n <= min(total, MAX_LINES):
        m = ProtocolMachine(setup)
        try:
            lines = interrupted_call(m, scenario, files, n)
        finally:
            if getattr(m, "stuck", False):  # a driver waiting on its own lock can give nothing back, nor run a rule
                why = f"driver {driver_spec!r} left a lock held after an interrupted {scenario} (an earlier rule)"
                retire(request.config, driver_spec, why)
            else:
                m.teardown()
        total = lines if n == 0 else total
        n += 1
