"""What enters this package from outside, checked where it enters: one module per kind of boundary.

- ``files``: files read (measurement files, run folders): regular files only, bounded in size, UTF-8, and inside the
  folder they were found in;
- ``numbers``: numbers given on a command line (time limits, sizes, counts): finite, in range, before any use;
- ``outputs``: paths written (``--json``, ``--summary-json``, ``--out``, ``environment OUT_DIR``): a regular file or a
  new path, checked before any work, written whole or not at all;
- ``factories``: what a driver factory returned (a driver, judged as an object) and what it left running.

Every refusal is a ``BoundaryError`` (a ``ValueError``) whose message names the value, on one line: a command prints
it as ``error: <message>`` and exits with status 2. Values from outside are shown through ``shown``, so a file name
that is not UTF-8 or holds a newline, or a path of 6,000 characters, cannot break that line.
"""

from __future__ import annotations

import os
import re

from ..errors import ExtensibleKVError

__all__ = ["BoundaryError", "escaped", "named", "number", "shown", "text"]

_ESCAPED_BYTE = re.compile(r"(?<!\\)\\udc([89a-f][0-9a-f])")  # a byte that is not UTF-8, as repr shows it
SHOWN_CHARS = 120  # the most of one value a message shows: its start and its end, the middle elided


class BoundaryError(ExtensibleKVError, ValueError):
    """A value from outside (a file, a number, an output path, a factory's result) refused where it entered; the
    message names the value and why, on one line."""


def escaped(text: str) -> str:
    """``text`` with every character that is not printable escaped as Python writes it (``\\x1b``, ``\\n``,
    ``\\u2028``), nothing else changed and nothing cut: no terminal sequence or line break of its own survives."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``value`` (text, a path or bytes) quoted for a one-line message: bytes that are not UTF-8 as ``\\xff``,
    control characters escaped, and at most ``limit`` characters of it (``...`` in the middle)."""
    if isinstance(value, bytes):
        value = os.fsdecode(value)
    raw = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    body = _ESCAPED_BYTE.sub(r"\\x\1", repr(raw))  # repr escapes what is not printable; a byte reads as \\xff
    if len(body) > limit:
        half = (limit - 5) // 2
        body = f"{body[: half + 1]}...{body[-half - 1 :]}"
    return body


SHOWN_INT_BITS = 64  # an int past this is shown by its size: str() of one past 4,300 digits raises ValueError


def number(value: object) -> str:
    """``value`` as a message shows a number: its ``repr``, except an int of more than 64 bits, shown by its bit
    length (Python refuses to format an int of more than 4,300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > SHOWN_INT_BITS:
        return f"an int of {value.bit_length()} bits"
    return repr(value)


def named(value: str | os.PathLike) -> str:
    """A path as a message names it: as it is where it is printable UTF-8 of at most ``SHOWN_CHARS`` characters
    (``/tmp/run/bench.json: empty file``), else quoted and escaped by ``shown``."""
    raw = os.fspath(value)
    if isinstance(raw, str) and len(raw) <= SHOWN_CHARS and raw.isprintable() and raw == shown(raw)[1:-1]:
        return raw
    return shown(raw)


def text(value: str | os.PathLike, what: str) -> str:
    """``value`` as text if it is UTF-8 (a command line or a file name decoded by Python keeps bytes that are not as
    lone surrogates), else ``BoundaryError`` naming ``what`` and the value."""
    raw = os.fspath(value)
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = raw[exc.start]
        what_char = (
            f"byte 0x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF else f"lone surrogate U+{ord(char):04X}"
        )
        raise BoundaryError(f"{what} {shown(raw)} is not UTF-8 text ({what_char} at character {exc.start})") from None
    return raw
