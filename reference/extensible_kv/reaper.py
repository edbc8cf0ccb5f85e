"""The reaper: where memory of a garbage-collected tensor goes back to its driver.

Note [Finalizers never wait on a driver lock]
    A cyclic-garbage collection can start inside any allocation, including one made while this thread is inside a
    driver call that holds the driver's (non-reentrant) lock. A finalizer that called the driver there would wait
    on the lock its own thread holds, forever. So every driver call this package makes runs inside ``busy()``, and
    so does the host driver's own locked work; a finalizer that fires in a thread that is inside one does not call
    the driver but queues the teardown on that thread, which runs it as soon as its outermost ``busy()`` section
    ends (no lock held, same thread, so the result is as deterministic as a direct call). Outside a section the
    teardown runs at once, as it always did.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_local = threading.local()


def _depth() -> int:
    return getattr(_local, "depth", 0)


@contextmanager
def busy() -> Iterator[None]:
    """Mark this thread as inside a driver call; teardowns queued meanwhile run when the outermost section ends."""
    depth = _depth()
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth
        if depth == 0:
            _drain()


def reap(teardown: Callable[..., None], *args: object) -> None:
    """Run ``teardown(*args)`` now, or, inside a ``busy()`` section of this thread, when that section ends."""
    if _depth():
        pending = getattr(_local, "pending", None)
        if pending is None:
            pending = _local.pending = []
        pending.append((teardown, args))
        return
    teardown(*args)


def _drain() -> None:
    queue = getattr(_local, "pending", None)
    while queue:
        teardown, args = queue.pop(0)
        _local.depth = 1
        try:
            teardown(*args)
        except Exception as exc:  # a finalizer's failure is reported, as the interpreter reports one
            sys.unraisablehook(_Unraisable(exc, teardown))
        finally:
            _local.depth = 0


class _Unraisable:
    """The argument ``sys.unraisablehook`` takes."""

    def __init__(self, exc: BaseException, obj: object) -> None:
        self.exc_type, self.exc_value, self.exc_traceback = type(exc), exc, exc.__traceback__
        self.err_msg = "Exception ignored while returning a collected tensor's memory"
        self.object = obj
