"""The reaper: where the memory of a garbage-collected tensor goes back to its driver, and the sections inside which
it must not.

Note [Finalizers never wait on a driver lock]
    A cyclic-garbage collection can start inside any allocation, including one made while this thread is inside a
    driver call that holds the driver's (non-reentrant) lock. A finalizer that called the driver there would wait on
    the lock its own thread holds, forever. So every driver call this package makes runs inside ``busy()``, and so
    does the host driver's own locked work; a sweep started in a thread that is inside one returns at once and the
    memory waits, still owned, for the next sweep. Outside a section the sweep runs at once, as a teardown always did.

Note [A put-off sweep is never lost]
    A sweep put off inside a section is counted (``_put_off``), and the count it has covered is kept (``_swept``).
    The next sweep outside a section covers it: the one that ends the growth, construction or ``close()`` that was
    running, and in any case the end of the next garbage collection that runs outside a section (a ``gc.callbacks``
    hook), whatever the section was (a view, a query, a rollback, another teardown) and whether or not that
    collection found garbage. A sweep repeats while sweeps were put off during it (an owner that died inside one of
    its own teardowns). An interrupted sweep leaves the count uncovered, so the next collection picks it up.

Note [A failed teardown is owed to the next full collection]
    The put-off count covers sweeps that never ran, not teardowns that ran and did not finish. A tensor collected
    outside any section is swept at once by its finalizer; when its teardown failed there (the driver refused a
    call, or an interrupt landed in it), nothing was put off, so the count said "covered", and the record, owner
    gone, kept its reservation until some tensor operation swept again: a collection alone never came back to it,
    and a leak check counting after ``gc.collect()`` saw one reservation more than live tensors. So a sweep marks
    the reaper ``_owed`` before its first teardown and, after a whole pass, leaves it set only if a gone owner's
    record is still owned; the end of the next full collection (generation 2, what ``gc.collect()`` runs) sweeps
    while it is set. Only full collections: a driver that keeps failing is asked again once per full collection,
    not at every young one, and the failure is still reported once. Figure: a tensor whose ``unmap`` failed once
    in its finalizer's sweep still held its reservation after ``gc.collect()`` (2 of 2 cases); now that collection
    returns it (``tests/unit/test_reaper.py``, a driver's refusal and an interrupt).

Note [Memory is owned from before it exists]
    A record of memory to give back is in one table (``own``) from before its first native effect until its
    teardown has returned everything (``disown``). A tensor's finalizer carries no record: it only starts a
    ``sweep``, which tears down every record whose owner is gone. So a finalizer interrupted at its first line (the
    interpreter swallows the exception, and a finalizer never runs twice), or a teardown interrupted halfway, loses
    nothing: the record stays in the table, owned, and the next sweep returns the rest.

Note [Locked sections are one line]
    ``busy()`` is this thread's RLock: its recursion count is the section depth, and C code takes and gives it back,
    so an exception landing anywhere leaves the depth right (the generator-based manager this replaced, interrupted
    as it resumed to exit, kept its lock and its count). A C-level ``with`` is not enough on its own: CPython (3.10
    and later) reports the exit of a ``with`` block as a new line event on the ``with`` line, outside the block's
    handler, so a trace hook (or a debugger) raising there leaves the lock held. Every section that holds a lock is
    therefore one line, ``with lock: return work()``: the exit is on the line already running, and an exception
    inside ``work`` leaves through the handler. A signal handler runs only where the interpreter checks for pending
    calls (after a call returns, at a loop's backward jump, at a function's start), which on this line is after the
    lock's C ``__exit__`` has run.

Note [A finalizer never waits on a lock its thread may hold]
    A finalizer (a user's ``__del__``, a weakref callback) or a signal handler runs inside whatever its thread was
    doing, also inside a driver's locked section. Code that can run there never waits on a lock: a sweep is put
    off (above), and a driver refuses a call from a thread that is already inside one of its calls, at once, with
    ``DriverError`` naming the call, changing nothing (``drivers/host.py``, Note [A call never waits on its own
    thread]). An owner whose ``close()`` finds its thread inside a section (``inside_section()``) hands its memory
    to the next sweep with ``defer(record)`` instead of calling the driver. Nested calls are not run instead: one
    would run while the outer call's records are half changed (a generator over the driver's mappings sees them
    change size). Nor is the collector turned off in sections: ``gc.disable`` is process-wide, a second thread
    turns it back on, and a signal handler runs all the same. Figure: a ``__del__`` calling ``close()``, collected
    inside the host driver's ``_reserve``, hung (killed after 5 s) before this rule; now its ``close()`` raises
    ``DriverError`` at once and the next collection returns the memory (``tests/unit/test_finalizer_reentry.py``).

Note [What a forked child inherits]
    ``fork`` copies the calling thread only: locks that other threads of the parent held stay held in the child,
    by threads that do not exist there, and records those threads were changing stay half changed. So a child
    uses nothing of the parent's: every driver call and every ``Ledger`` operation checks the process first,
    before any lock, and refuses with ``DriverError`` naming the call and both processes (``mem_info`` and
    ``granularity`` included: the parent's numbers are not the child's); records of the parent's memory are
    dropped by the child's first sweep, never torn down (the parent still uses that memory); and every lock made
    with ``process_lock()`` is unlocked again in the child (``os.register_at_fork``), so what still reads such an
    object there never waits. Figure: children forked while a thread released 16,384 mappings hung in
    ``mem_info()`` 3 of 3 times (killed after 5 s), and one forked after it returned the parent's
    ``(1073741824, 1073741824)``; now each raises ``DriverError`` at once (``tests/unit/test_fork_inheritance.py``).
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import traceback
import weakref
from collections.abc import Callable
from types import TracebackType

from .errors import ExtensibleKVError

_process_locks: weakref.WeakSet = weakref.WeakSet()  # unlocked again in a forked child


def process_lock(reentrant: bool = False) -> threading.Lock | threading.RLock:
    """A new ``threading.Lock`` (``RLock`` when ``reentrant``) that a forked child finds unlocked, whichever thread of
    the parent held it at the fork (Note [What a forked child inherits]); in the parent it is an ordinary lock."""
    lock = threading.RLock() if reentrant else threading.Lock()
    _process_locks.add(lock)
    return lock


def _after_fork_in_child() -> None:
    for lock in list(_process_locks):  # no thread of the child holds any of them
        lock._at_fork_reinit()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

_local = threading.local()
_owned: dict[int, Owned] = {}
_sweeping = process_lock()
_put_off = 0  # sweeps put off inside a section: Note [A put-off sweep is never lost]
_swept = 0  # the value of ``_put_off`` the last whole sweep covered
_owed = False  # a gone owner's record outlived a sweep: Note [A failed teardown is owed to the next full collection]
_exiting = False  # Note [Nothing is unmapped at interpreter exit] in ``tensor``


def busy() -> threading.RLock:
    """This thread's section lock: ``with busy():`` marks the thread as inside a driver call (Note [Finalizers never
    wait on a driver lock]). Taken and given back in C, so no exception leaves it wrong (Note [Locked sections are
    one line])."""
    section = getattr(_local, "section", None)
    if section is None:
        section = _local.section = threading.RLock()
    return section


def inside_section() -> bool:
    """Whether this thread is inside a ``busy()`` section."""
    section = getattr(_local, "section", None)
    return section is not None and section._is_owned()


class Owned:
    """A record of memory to give back (Note [Memory is owned from before it exists]): ``owner`` is a weak reference
    to the object that uses it, ``pid`` the process that made it (a forked child owns nothing of it). Subclasses
    define ``teardown``, which returns everything the record holds and, after an exception, picks up where it
    stopped."""

    def __init__(self, owner: object) -> None:
        self.owner: Callable[[], object | None] = weakref.ref(owner)  # ``defer`` puts ``_gone`` here
        self.pid = os.getpid()
        self.reported = False

    def teardown(self) -> None:
        raise NotImplementedError


def own(record: Owned) -> None:
    _owned[id(record)] = record


def disown(record: Owned) -> None:
    _owned.pop(id(record), None)


def _gone() -> None:
    return None


def defer(record: Owned) -> None:
    """Hand ``record`` to the next sweep outside a section, as if its owner were gone: for an owner whose ``close()``
    runs inside a section (a finalizer or a signal handler inside a driver call, Note [A finalizer never waits on a
    lock its thread may hold]), which must not call the driver there. The record stays owned until that sweep has
    torn it down, and the sweep is counted as put off, so the end of the next collection covers it (Note [A put-off
    sweep is never lost])."""
    global _put_off
    own(record)
    record.owner = _gone
    _put_off += 1


def sweep() -> None:
    """Tear down every owned record whose owner is gone, unless this thread is inside a section (then a later
    sweep does: Note [A put-off sweep is never lost]). A teardown the driver fails (``ExtensibleKVError``) is
    reported once through ``sys.unraisablehook`` (``_report``: written to stderr where the hook takes only the
    interpreter's own type), as the interpreter reports a failed finalizer, and retried by later
    sweeps; any other exception (an interrupt) leaves the record owned and propagates."""
    global _put_off
    if not _owned:
        return
    if inside_section():
        _put_off += 1
        return
    with busy(), _sweeping: return _sweep_locked()  # one line: Note [Locked sections are one line]  # fmt: skip


def _sweep_locked() -> None:
    global _swept, _owed
    _owed = True  # until a whole pass says otherwise: Note [A failed teardown is owed to the next full collection]
    covers, left = None, False
    while covers != _put_off:  # again while sweeps were put off during this one
        covers = _put_off
        left = _sweep_once()
    _swept, _owed = covers, left  # only after a whole pass: an interrupted one leaves both for the next collection


def _after_collection(phase: str, info: dict) -> None:
    """``gc.callbacks``: at the end of a collection outside a section, the sweeps put off since the last whole sweep
    (Note [A put-off sweep is never lost]) and, at the end of a full one, the teardowns that did not finish (Note [A
    failed teardown is owed to the next full collection]). Inside a section (a sweep's own teardown included) it
    does nothing: what it would cover is still uncovered, and counting it as a put-off sweep made a sweep whose
    allocations start full collections (``gc.set_threshold(1, 1, 1)``) repeat forever."""
    if phase != "stop" or _exiting or inside_section():  # what it would cover inside a section stays uncovered
        return
    if _swept != _put_off or (_owed and info.get("generation") == 2):
        sweep()


def _at_exit() -> None:
    global _exiting
    _exiting = True


gc.callbacks.append(_after_collection)
atexit.register(_at_exit)


def _sweep_once() -> bool:
    """One pass over the owned records; whether a gone owner's record is still owned after it (a failed teardown)."""
    pid = os.getpid()
    left = False
    for record in list(_owned.values()):
        if record.pid != pid:  # Note [Forked children] in ``tensor``: the parent's memory is the parent's to return
            disown(record)
        elif record.owner() is None:
            try:
                record.teardown()
            except ExtensibleKVError as exc:  # the driver's failure; anything else (an interrupt) propagates
                left = True
                if not record.reported:
                    record.reported = True
                    _report(exc, record)
            else:
                disown(record)
    return left


def _report(exc: BaseException, record: object) -> None:
    """``exc`` through ``sys.unraisablehook`` where it takes an object of the hook's fields (pytest's, a user's),
    else written to stderr as the interpreter's own hook writes it (that one takes only the interpreter's type, and
    raising there would come out of whatever call ran the sweep)."""
    args = _Unraisable(exc, record)
    hook = sys.unraisablehook
    if hook is not sys.__unraisablehook__:
        try:
            hook(args)
            return
        except Exception:  # a hook that does not take it: written below instead
            pass
    try:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        sys.stderr.write(f"{args.err_msg}: {record!r}\n{text}")
    except Exception:  # no stderr to write to: the record stays owned and is retried; nothing else to do
        pass


class _Unraisable:
    """The argument ``sys.unraisablehook`` takes."""

    exc_type: type[BaseException]
    exc_value: BaseException | None
    exc_traceback: TracebackType | None
    err_msg: str | None

    def __init__(self, exc: BaseException, obj: object) -> None:
        self.exc_type, self.exc_value, self.exc_traceback = type(exc), exc, exc.__traceback__
        self.err_msg = "Exception ignored while returning a collected tensor's memory"
        self.object = obj
