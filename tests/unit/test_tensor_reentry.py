"""Note [Operations never wait on themselves] (``extensible_kv/tensor.py``): user code that a finalizer or a signal
handler runs inside an operation of a tensor, or inside a driver call, is refused with ``BusyError`` when it calls
that tensor again or calls the driver through another tensor, at once and changing nothing; the outer operation
finishes whole. A hang fails the test through SIGALRM (which breaks a lock's wait), not the run."""

from __future__ import annotations

import signal

import pytest

from extensible_kv import ExtensibleTensor
from extensible_kv.drivers.host import HostDriver
from extensible_kv.errors import BusyError

G = 4096
LIMIT_S = 5


class _Hang(AssertionError):
    pass


class _ZeroHook(HostDriver):
    """A host driver that runs ``hook`` inside ``zero`` (inside a growth step: the tensor's lock and a section held)."""

    hook = None

    def zero(self, va: int, size: int) -> None:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        super().zero(va, size)


def _limited(call):
    def alarm(signum, frame):
        raise _Hang(f"no return within {LIMIT_S} s: a wait on a lock this thread holds")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, LIMIT_S, 0.5)
    try:
        return call()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize(
    "who, call, inside",
    [
        ("the growing tensor", lambda t, other: t.resize_per_segment_(4 * G), "an operation of this tensor"),
        ("the growing tensor", lambda t, other: t.stats(), "an operation of this tensor"),
        ("another tensor", lambda t, other: other.close(), "a driver call"),
        ("another tensor", lambda t, other: other.resize_per_segment_(G), "a driver call"),
    ],
)
def test_a_call_made_inside_a_growth_step_is_refused_at_once(who, call, inside):
    driver = _ZeroHook(granularity=G, budget_bytes=1 << 20, name="unit-host")
    t, other = ExtensibleTensor(4 * G, driver=driver), ExtensibleTensor(4 * G, driver=driver)
    seen = []

    def hook():
        before = (other.state, other.bytes_per_segment)
        try:
            call(t, other)
            seen.append("returned")
        except BusyError as exc:
            seen.append(inside in str(exc) and (other.state, other.bytes_per_segment) == before)
        except BaseException as exc:  # judged below
            seen.append(repr(exc))

    driver.hook = hook
    _limited(lambda: t.resize_per_segment_(2 * G))
    assert (seen, t.bytes_per_segment) == ([True], 2 * G), (
        f"unit-host driver: a call of {who} made inside a growth step: expected BusyError naming {inside!r} with "
        f"nothing changed and the step whole at {2 * G} bytes, got {seen} and {t.bytes_per_segment} bytes"
    )
    t.close()
    other.close()
