"""The kernel's own records of what a host (mmap/memfd) driver did, read without the driver: ``/proc/self/maps``,
the memfds the process holds, and whether a byte can be read and written, for the model-based rules
(``test_protocol_model.py``)."""

from __future__ import annotations

import bisect
import ctypes
import os
import re
from typing import NamedTuple

from .helpers import MEMFD_NAME, open_memfd_sizes, open_memfd_stats
from .protocol_model import intervals_minus


class _Row(NamedTuple):  # a tuple: thousands are made per read of the maps
    lo: int
    hi: int
    perms: str
    offset: int
    inode: int
    name: str


HEAP_BLOCK = 64 << 20
"""glibc's HEAP_MAX_SIZE on 64-bit machines: the size and alignment of a thread arena's block."""


def _anonymous_rw(r: _Row) -> bool:
    return not r.name and r.inode == 0 and r.perms == "rw-p"


_MAPS_LINE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) ([0-9a-f]+) \S+ (\d+) *(.*)$", re.MULTILINE)


class KernelView:
    """``/proc/self/maps``, read once (or as read before: ``text``)."""

    def __init__(self, text: str | None = None) -> None:
        if text is None:
            text = maps_text()
        self.rows = [
            _Row(int(lo, 16), int(hi, 16), perms, int(offset, 16), int(inode), name.strip())
            for lo, hi, perms, offset, inode, name in _MAPS_LINE.findall(text)
        ]
        self._starts = [r.lo for r in self.rows]

    def row(self, va: int) -> _Row | None:
        i = bisect.bisect_right(self._starts, va) - 1
        return self.rows[i] if i >= 0 and self.rows[i].lo <= va < self.rows[i].hi else None

    def granule(self, va: int) -> tuple[str, int | None, int | None]:
        """``(kind, memfd inode, byte offset in it)`` at ``va``: ``accessible`` or ``mapped`` (a memfd of the driver,
        shared, read-write or no access), ``reserved`` (anonymous, no access), ``nothing``, or what else is there."""
        r = self.row(va)
        if r is None:
            return ("nothing", None, None)
        if MEMFD_NAME in r.name and r.perms in ("rw-s", "---s"):
            return ("accessible" if r.perms == "rw-s" else "mapped", r.inode, r.offset + va - r.lo)
        if not r.name and r.inode == 0 and r.perms == "---p":
            return ("reserved", None, None)
        return (f"{r.perms} {r.name or 'anonymous'}", None, None)

    def reserved_space(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The parts of ``[lo, hi)`` that are anonymous memory without access (reserved address space)."""
        parts = [
            (max(r.lo, lo), min(r.hi, hi))
            for r in self.rows
            if r.lo < hi and lo < r.hi and not r.name and r.inode == 0 and r.perms == "---p"
        ]
        return intervals_minus(parts, [])

    def thread_heaps(self) -> list[tuple[int, int]]:
        """The blocks glibc keeps for the malloc arenas of threads: each ``HEAP_BLOCK`` bytes, aligned to it, opening
        with read-write anonymous memory; the rest is reserved (``---p``) until the arena grows into it, or shrinks
        back. A thread that calls the driver mallocs, so these change beside a call: no driver's doing."""
        blocks = []
        for r, n in zip(self.rows, [*self.rows[1:], None]):
            if not _anonymous_rw(r) or r.lo % HEAP_BLOCK:
                continue
            end = r.lo + HEAP_BLOCK  # the read-write part fills the block, or a reserved part follows up to its end
            if r.hi == end or (n is not None and n.lo == r.hi and n.hi == end and n.perms == "---p" and not n.name):
                blocks.append((r.lo, end))
        return blocks

    def memfd_ranges(self) -> list[tuple[int, int]]:
        return intervals_minus([(r.lo, r.hi) for r in self.rows if MEMFD_NAME in r.name], [])

    def memfds(self) -> dict[int, int]:
        """inode -> bytes of every memfd of the host driver the process holds open or mapped (what the kernel keeps
        for it, whatever the driver's records say; ``helpers.kernel_memfds`` without a second read of the maps)."""
        found = open_memfd_sizes()
        for r in self.rows:
            if MEMFD_NAME in r.name and r.inode not in found:
                try:
                    found[r.inode] = os.stat(f"/proc/self/map_files/{r.lo:x}-{r.hi:x}").st_size
                except OSError:  # map_files unreadable here: the mapped extent is a lower bound
                    found[r.inode] = max(found.get(r.inode, 0), r.offset + r.hi - r.lo)
        return found


def maps_text() -> str:
    """``/proc/self/maps`` as the kernel writes it now."""
    with open("/proc/self/maps") as fh:
        return fh.read()


def open_memfds() -> list[int]:
    """The inode of every memfd of the host driver this process holds a file descriptor of (one entry per fd)."""
    return sorted(st.st_ino for st in open_memfd_stats())


class AccessProbe:
    """Whether the kernel lets this process read and write the byte at an address, without a fork: ``write(2)`` of
    the byte into a pipe and ``read(2)`` of it back into the address fail with EFAULT exactly where touching the
    byte would fault."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        libc = ctypes.CDLL(None, use_errno=True)
        self._write, self._read = libc.write, libc.read
        for fn in (self._write, self._read):
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
            fn.restype = ctypes.c_ssize_t

    def touchable(self, va: int) -> bool:
        if self._write(self._w, va, 1) != 1:
            return False
        if self._read(self._r, va, 1) != 1:  # the same byte back: only writable memory takes it
            os.read(self._r, 1)
            return False
        return True

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)
