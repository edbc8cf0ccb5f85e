"""A trace hook that interrupts Python code at its n-th line event, as a signal handler raising there would: the
instrument of the interrupt rules (``test_interrupted_calls.py``) and of the package's own interrupt tests."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


class Interrupt(KeyboardInterrupt):
    """The KeyboardInterrupt the trap raises (so a real Ctrl-C is never mistaken for it)."""


class LineTrap:
    """Counts the line events of frames whose code file ``watched(filename)`` accepts and raises ``Interrupt`` at
    the ``n``-th (``n == 0``: never), recording where in ``fired``. Installed for the calling thread by ``with trap:``
    or ``sys.settrace(trap)``."""

    def __init__(self, watched: Callable[[str], bool], n: int) -> None:
        self.n, self.lines, self.fired = n, 0, None
        self._watched, self._seen = watched, {}
        self._saved = None

    def __call__(self, frame, event, arg):
        name = frame.f_code.co_filename
        if name not in self._seen:
            self._seen[name] = self._watched(name)
        return self._line if self._seen[name] else None

    def _line(self, frame, event, arg):
        if event == "line":
            self.lines += 1
            if self.lines == self.n:
                self.fired = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} ({frame.f_code.co_name})"
                raise Interrupt(self.fired)
        return self._line

    def __enter__(self) -> LineTrap:
        self._saved = sys.gettrace()
        sys.settrace(self)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self._saved)
