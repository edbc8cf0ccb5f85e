"""Files read from outside: a run folder's measurement files, a benchmark file named on the command line.

Note [A file read is a regular file of bounded size]
    A name in a run folder can be a link to ``/dev/zero`` (read forever: ``MemoryError``), a FIFO (``open`` waits for
    a writer that never comes), a device, a folder, or a link out of the folder; a file can be 94 MiB of JSON whose
    models take 5.5 GiB. So every file is opened with ``O_NONBLOCK`` (a FIFO opens at once) and judged by
    ``fstat`` of what was opened, not of the name (nothing can be swapped in between): a regular file only, of at
    most ``FILE_LIMIT`` bytes, read up to one byte past it (a file that grows, or a ``/proc`` file that says 0, is
    still bounded), and decoded as UTF-8 or refused. A folder is walked without following links, each file found
    must resolve inside it, and a run folder holds at most ``FOLDER_FILES`` files of ``FOLDER_LIMIT`` bytes in all.
    The limits are far above any real run: the largest run folder of ``reports/runs`` is 1.4 MB in 413 files, its
    largest file 92 KB (16 MiB is 180 times that); a report of a 15 MiB conformance file of 140,000 failed rules
    takes 5.6 s and 530 MB, where 94 MiB of 10**6 failed rules took 5.5 GiB and more than 300 s.
"""

from __future__ import annotations

import fnmatch
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import BoundaryError, named, text

MIB = 1 << 20
FILE_LIMIT = 16 * MIB  # one measurement file
FOLDER_LIMIT = 32 * MIB  # every file of one run folder together
FOLDER_FILES = 10_000  # files of one run folder

_KINDS = {
    stat.S_IFDIR: "a folder",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFLNK: "a link",
}


class BadInputFile(BoundaryError):
    """A file that cannot be read as input: not a regular file, too large, not UTF-8, outside its folder, or
    unreadable; the message starts with the file's name."""


def kind(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) is, in words."""
    return "a regular file" if stat.S_ISREG(mode) else _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def size_text(nbytes: int) -> str:
    return f"{nbytes / MIB:.1f} MiB" if nbytes >= MIB else f"{nbytes:,} bytes"


def read_bytes(path: str | os.PathLike, *, limit: int = FILE_LIMIT, within: str | os.PathLike | None = None) -> bytes:
    """The bytes of the regular file ``path``, of at most ``limit`` bytes; with ``within``, ``path`` (its links
    resolved) must lie inside that folder. ``BadInputFile`` otherwise (Note [A file read is a regular file of bounded
    size])."""
    text(path, "file name")
    name = f"{named(path)} (a link to {named(os.path.realpath(path))})" if os.path.islink(path) else named(path)
    if within is not None:
        inside(path, within)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise BadInputFile(f"{name}: cannot be read ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadInputFile(f"{name} is {kind(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise BadInputFile(
                f"{name} is {size_text(st.st_size)}, more than the {size_text(limit)} a file read here may hold"
            )
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(limit + 1 - total, MIB))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise BadInputFile(f"{name}: cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if total > limit:
        raise BadInputFile(f"{name} holds more than the {size_text(limit)} a file read here may hold")
    return b"".join(chunks)


def read_text(path: str | os.PathLike, *, limit: int = FILE_LIMIT, within: str | os.PathLike | None = None) -> str:
    """``read_bytes`` decoded as UTF-8; ``BadInputFile`` naming the first byte that is not."""
    return _decoded(path, read_bytes(path, limit=limit, within=within))


def _decoded(path: str | os.PathLike, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInputFile(
            f"{named(path)} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})"
        ) from None


def inside(path: str | os.PathLike, folder: str | os.PathLike) -> Path:
    """``path`` with its links resolved, if that lies inside ``folder`` (resolved too); else ``BadInputFile``."""
    real, root = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    if real != root and root not in real.parents:
        raise BadInputFile(f"{named(path)} is a link to {named(real)}, outside the folder {named(folder)}")
    return real


@dataclass
class Folder:
    """A folder read from outside (a run folder): its files are listed once, without following links to folders,
    each named in UTF-8 and at most ``FOLDER_FILES`` of them; reading them counts their bytes against
    ``FOLDER_LIMIT``."""

    path: Path
    limit: int = field(default_factory=lambda: FOLDER_LIMIT)  # bytes of all files read (the limit when built)
    files_limit: int = field(default_factory=lambda: FOLDER_FILES)  # files and folders below it
    read: int = 0  # bytes read so far

    def __post_init__(self) -> None:
        self.path = Path(text(self.path, "folder name"))
        self._files: list[str] | None = None
        self._entries = 0  # files and folders seen

    def files(self) -> list[str]:
        """Every file and folder below the folder, as POSIX paths relative to it, sorted; links to folders are not
        followed (a folder or a link that a pattern matches is then refused as not a regular file where it is
        read)."""
        if self._files is None:
            found: list[str] = []
            for rel in self._walk():
                found.append(rel)
                self._entries += 1
                if self._entries > self.files_limit:
                    raise BadInputFile(
                        f"folder {named(self.path)} holds more than {self.files_limit:,} files and folders; a run "
                        f"folder holds measurement files only"
                    )
            self._files = sorted(found, key=lambda rel: rel.split("/"))  # as sorted Paths are
        return self._files

    def _walk(self) -> Iterator[str]:
        """The relative path of every entry below the folder; a link to a folder is listed, never walked into."""

        def fail(exc: OSError) -> None:
            raise BadInputFile(f"folder {named(exc.filename or self.path)}: cannot be read ({exc.strerror or exc})")

        for top, dirs, names in os.walk(self.path, onerror=fail, followlinks=False):
            dirs.sort()
            for name in [*names, *dirs]:
                rel = os.path.relpath(os.path.join(top, name), self.path).replace(os.sep, "/")
                text(rel, f"a name in folder {named(self.path)}:")
                yield rel

    def glob(self, pattern: str) -> list[Path]:
        """The files whose relative path matches ``pattern`` (``fnmatch``: ``*`` matches ``/`` too; a pattern without
        ``/`` matches files directly in the folder)."""
        flat = "/" not in pattern
        return [
            self.path / rel
            for rel in self.files()
            if fnmatch.fnmatchcase(rel, pattern) and (not flat or "/" not in rel)
        ]

    def read_text(self, path: Path) -> str:
        """The file ``path`` of this folder (``read_text`` inside it), its bytes counted against the folder's limit."""
        data = read_bytes(path, within=self.path)
        self.read += len(data)
        if self.read > self.limit:
            raise BadInputFile(
                f"folder {named(self.path)} holds more than the {size_text(self.limit)} of files a run folder may "
                f"hold (reached at {named(os.path.relpath(path, self.path))})"
            )
        return _decoded(path, data)
