"""Paths written: checked before any work, written whole or not at all.

Note [An output is a regular file or a new path, checked first]
    ``os.replace`` of a file written beside the target puts a regular file where the name was, whatever the name
    was: ``validate-backend --json`` given a FIFO or a character device replaced it (as root, ``--json /dev/null``
    replaced ``/dev/null``). And a path that cannot be written was found out only when written, after every rule
    had run (``--summary-json``), or half-way through a report folder. So a command checks each output where it
    parses its arguments, before any work: the path is UTF-8, within the kernel's name limits (a run-folder path of
    3,000 components is one line, not an ENAMETOOLONG traceback), and is either a regular file that can be replaced,
    or a new name whose nearest existing folder can be written. Writing checks the target again, writes a temporary
    file in the same folder and renames it into place, so an interrupted write leaves the old file or none; a new
    output folder is filled under a temporary name and renamed into place whole.

    No output is a symbolic link: not the file, not an output folder (``--out``, ``OUT_DIR``: refused, not
    followed), not a file written in one (report.md, summary.json, a PNG, environment.json). Followed, a link wrote
    where it points (as root, ``--json jl`` with ``jl -> /etc/passwd`` replaced it), so it is refused, naming the
    option, the link and its target. Folders above an output may be links; only the names written are checked, and
    again at write time, in a folder opened once (an output folder with ``O_NOFOLLOW``): the temporary file is made
    with ``O_EXCL | O_NOFOLLOW`` and renamed over the name, and ``rename`` replaces a link swapped in meanwhile::

        out/report.md -> /etc/passwd    before any work: BadOutputPath, exit 2, nothing written
        link swapped in after that      rename(".report.md.<hex>.partial", "report.md") replaces the link itself

    A PNG's name is known once it is drawn: every name is checked before a report's first file is written.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from . import BoundaryError, shown, text
from .files import kind

NAME_MAX = 255  # bytes of one path component (Linux, macOS)
PATH_MAX = 4096  # bytes of a path handed to the kernel, its final NUL included (Linux)


class BadOutputPath(BoundaryError):
    """An output that cannot be written where it was asked for; the message names the option and the path."""


def _limits(path: str, option: str) -> None:
    """``BadOutputPath`` for a path the kernel would refuse as too long (``ENAMETOOLONG``), or that holds a NUL."""
    raw = os.fsencode(path)
    if not raw:
        raise BadOutputPath(f"{option} is empty: name a file or folder")
    if b"\0" in raw:
        raise BadOutputPath(f"{option} {shown(path)} holds a NUL character")
    absolute = os.fsencode(os.path.abspath(path))
    if len(absolute) >= PATH_MAX:
        parts = absolute.count(b"/")
        raise BadOutputPath(
            f"{option} {shown(path)} is {len(absolute):,} bytes long ({parts:,} components) as an absolute path; "
            f"the system takes paths of fewer than {PATH_MAX:,} bytes"
        )
    longest = max(absolute.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        raise BadOutputPath(
            f"{option} {shown(path)} has a component of {len(longest):,} bytes ({shown(longest)}); the system "
            f"takes at most {NAME_MAX}"
        )


def _nearest_folder(path: Path, option: str) -> Path:
    """The nearest existing ancestor of the new path ``path``, which must be a folder this process can write."""
    parent = path.parent
    while True:
        try:
            st = os.stat(parent)
            break
        except FileNotFoundError:
            if parent == parent.parent:
                raise BadOutputPath(f"{option} {shown(path)}: no folder of it exists") from None
            parent = parent.parent
        except OSError as exc:
            raise BadOutputPath(f"{option} {shown(path)}: {shown(parent)} cannot be read ({exc.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise BadOutputPath(f"{option} {shown(path)}: {shown(parent)} is {kind(st.st_mode)}, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BadOutputPath(f"{option} {shown(path)}: folder {shown(parent)} cannot be written")
    return parent


def _not_a_link(path: Path, option: str) -> None:
    """``BadOutputPath`` if ``path`` is a symbolic link, naming where it points: an output is never written through
    one (Note [An output is a regular file or a new path, checked first])."""
    if not os.path.islink(path):
        return
    try:
        points = os.readlink(path)
    except OSError as exc:
        points = f"a target that cannot be read ({exc.strerror})"
    gone = "" if os.path.exists(path) else ", which does not exist"
    raise BadOutputPath(
        f"{option} {shown(path)} is a symbolic link to {shown(points)}{gone}; an output is never written through a "
        "link: give a regular file or a new path"
    )


def output_file(path: str | os.PathLike, *, option: str) -> Path:
    """The file to write for ``option``, checked before any work: a regular file (not a symbolic link) that can be
    replaced, or a new name in a folder that exists or can be made. ``BadOutputPath`` otherwise."""
    raw = text(path, option)
    _limits(raw, option)
    target = Path(raw)
    _not_a_link(target, option)
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        _nearest_folder(Path(os.path.abspath(target)), option)
        return target
    except OSError as exc:  # ENOTDIR (a folder of it is a file), ELOOP, EACCES
        raise BadOutputPath(f"{option} {shown(raw)} cannot be written ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise BadOutputPath(f"{option} {shown(raw)} is {kind(st.st_mode)}; give a regular file or a new path")
    real = Path(os.path.realpath(target))  # only the folders above it can be links
    if not os.access(real.parent, os.W_OK | os.X_OK):
        raise BadOutputPath(f"{option} {shown(raw)}: its folder {shown(real.parent)} cannot be written")
    return real


def output_folder(path: str | os.PathLike, *, option: str, files: Iterable[str] = ()) -> Path:
    """The folder to write for ``option``, checked before any work: an existing folder (not a symbolic link) that can
    be written, whose ``files`` are regular files (not links) where they exist, or a new name whose nearest existing
    folder can be written."""
    raw = text(path, option)
    _limits(raw, option)
    folder = Path(raw)
    _not_a_link(folder, option)
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        _nearest_folder(Path(os.path.abspath(folder)), option)
        for name in files:
            _limits(os.path.join(raw, name), option)
        return folder
    except OSError as exc:
        raise BadOutputPath(f"{option} {shown(raw)} cannot be written ({exc.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise BadOutputPath(f"{option} {shown(raw)} is {kind(st.st_mode)}, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise BadOutputPath(f"{option} {shown(raw)}: the folder cannot be written")
    for name in files:
        output_file(folder / name, option=f"{option} {shown(raw)}: file")
    return folder


def write_file(path: str | os.PathLike, data: bytes, *, option: str = "output") -> Path:
    """``data`` in ``path`` (``output_file`` checked again), whole or not at all: written to a temporary file in the
    same folder, made if needed, and renamed into place; on any error or interrupt the temporary file is removed and
    ``path`` is as it was. A link swapped in for ``path`` after the check is replaced, never written through."""
    target = output_file(path, option=option)
    made = _make_folders(target.parent)
    try:
        where = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _write_at(where, target.name, data, option=option, shown_as=target)
        finally:
            os.close(where)
    except BaseException:
        _remove_folders(made)
        raise
    return target


def write_folder(
    path: str | os.PathLike, files: Mapping[str, bytes], *, option: str = "output", remove: Iterable[str] = ()
) -> Path:
    """``files`` (name -> bytes) in the folder ``path``. A new folder is filled under a temporary name beside it and
    renamed into place whole; in an existing one, opened without following a link, each file is written whole, then
    the files named in ``remove`` that are regular files are removed. Every name is checked (``output_folder``)
    before the first file is written; on any error or interrupt nothing new is left half-written."""
    folder = output_folder(path, option=option, files=files)
    if os.path.lexists(folder):
        try:
            where = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:  # ELOOP: a link swapped in after the check; ENOTDIR: something else
            _not_a_link(folder, option)
            raise BadOutputPath(f"{option} {shown(folder)} cannot be written ({exc.strerror})") from None
        try:
            for name, data in files.items():
                _write_at(where, name, data, option=option, shown_as=folder / name)
            for name in remove:
                try:
                    st = os.lstat(name, dir_fd=where)
                except OSError:
                    continue
                if "/" not in name and stat.S_ISREG(st.st_mode):
                    os.unlink(name, dir_fd=where)
        finally:
            os.close(where)
        return folder
    made = _make_folders(Path(os.path.abspath(folder)).parent)
    partial = None
    try:
        partial = Path(tempfile.mkdtemp(dir=Path(os.path.abspath(folder)).parent, prefix=f".{folder.name}."))
        for name, data in files.items():  # a folder this process just made, mode 0o700: no link can be in it
            (partial / name).write_bytes(data)
        os.chmod(partial, 0o777 & ~_umask())
        os.rename(partial, folder)  # onto a link swapped in meanwhile: ENOTDIR, nothing written through it
    except BaseException:
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        _remove_folders(made)
        raise
    return folder


def _write_at(where: int, name: str, data: bytes, *, option: str, shown_as: Path) -> None:
    """``data`` as ``name`` in the open folder ``where``: a temporary file made there with ``O_EXCL | O_NOFOLLOW``
    (a new name, never an existing file or link), then renamed over ``name``, which replaces a link that is there
    rather than the file it points to; ``BadOutputPath`` if ``name`` is a link or not a regular file now."""
    try:
        st: os.stat_result | None = os.lstat(name, dir_fd=where)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        _not_a_link(shown_as, option)
        raise BadOutputPath(f"{option} {shown(shown_as)} is {kind(st.st_mode)}; give a regular file or a new path")
    mode = stat.S_IMODE(st.st_mode) if st is not None else 0o666 & ~_umask()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        partial = f".{name}.{secrets.token_hex(4)}.partial"
        try:
            fd = os.open(partial, flags, 0o600, dir_fd=where)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "no free temporary name", str(shown_as.parent))
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            os.fchmod(out.fileno(), mode)
        os.replace(partial, name, src_dir_fd=where, dst_dir_fd=where)
    except BaseException:
        try:
            os.unlink(partial, dir_fd=where)
        except OSError:
            pass
        raise


def _make_folders(folder: Path) -> list[Path]:
    """Make ``folder`` and its missing parents; the folders made, innermost first."""
    made = []
    probe = Path(os.path.abspath(folder))
    while not probe.exists():
        made.append(probe)
        probe = probe.parent
    try:
        for new in reversed(made):
            os.mkdir(new)
    except FileExistsError:
        pass
    except BaseException:
        _remove_folders(made)
        raise
    return made


def _remove_folders(made: list[Path]) -> None:
    for folder in made:  # innermost first; a folder someone else filled meanwhile stays
        try:
            os.rmdir(folder)
        except OSError:
            pass


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it, for every thread); 0o022 where the
    system does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022
