"""Paths written: checked before any work, written whole or not at all.

Note [An output is a regular file or a new path, checked first]
    ``os.replace`` of a file written beside the target puts a regular file where the name was, whatever the name
    was: ``validate-backend --json`` given a FIFO or a character device replaced it (as root, ``--json /dev/null``
    replaced ``/dev/null``). And a path that cannot be written was found out only when written, after every rule
    had run (``--summary-json``), or half-way through a report folder. So a command checks each output where it
    parses its arguments, before any work: the path is UTF-8, within the kernel's name limits (a run-folder path of
    3,000 components is one line, not an ENAMETOOLONG traceback), and is either a regular file (links followed) that
    can be replaced, or a new name whose nearest existing folder can be written. Writing checks the target again,
    writes a temporary file in the same folder and renames it into place, so an interrupted write leaves the old
    file or none; a new output folder is filled under a temporary name and renamed into place whole.
"""

from __future__ import annotations

import os
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


def _dangling(path: Path, option: str) -> None:
    """``BadOutputPath`` if ``path`` is a link to nothing (writing would follow it, or replace the link)."""
    if os.path.islink(path):
        raise BadOutputPath(f"{option} {shown(path)} is a link to {shown(os.readlink(path))}, which does not exist")


def output_file(path: str | os.PathLike, *, option: str) -> Path:
    """The file to write for ``option`` (a link to a regular file is followed), checked before any work: a regular
    file that can be replaced, or a new name in a folder that exists or can be made. ``BadOutputPath`` otherwise."""
    raw = text(path, option)
    _limits(raw, option)
    target = Path(raw)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        _dangling(target, option)
        _nearest_folder(Path(os.path.abspath(target)), option)
        return target
    except OSError as exc:  # ENOTDIR (a folder of it is a file), ELOOP, EACCES
        raise BadOutputPath(f"{option} {shown(raw)} cannot be written ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise BadOutputPath(f"{option} {shown(raw)} is {kind(st.st_mode)}; give a regular file or a new path")
    real = Path(os.path.realpath(target))
    if not os.access(real.parent, os.W_OK | os.X_OK):
        raise BadOutputPath(f"{option} {shown(raw)}: its folder {shown(real.parent)} cannot be written")
    return real


def output_folder(path: str | os.PathLike, *, option: str, files: Iterable[str] = ()) -> Path:
    """The folder to write for ``option``, checked before any work: an existing folder that can be written, whose
    ``files`` are regular files where they exist, or a new name whose nearest existing folder can be written."""
    raw = text(path, option)
    _limits(raw, option)
    folder = Path(raw)
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        _dangling(folder, option)
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
    ``path`` is as it was."""
    target = output_file(path, option=option)
    made = _make_folders(target.parent)
    try:
        fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                os.fchmod(out.fileno(), _mode_of(target))
            os.replace(partial, target)
        except BaseException:
            Path(partial).unlink(missing_ok=True)
            raise
    except BaseException:
        _remove_folders(made)
        raise
    return target


def write_folder(
    path: str | os.PathLike, files: Mapping[str, bytes], *, option: str = "output", remove: Iterable[str] = ()
) -> Path:
    """``files`` (name -> bytes) in the folder ``path``. A new folder is filled under a temporary name beside it and
    renamed into place whole; in an existing one each file is written whole (``write_file``), then the files named in
    ``remove`` that are regular files are removed. On any error or interrupt nothing new is left half-written."""
    folder = output_folder(path, option=option, files=files)
    if folder.is_dir():
        for name, data in files.items():
            write_file(folder / name, data, option=option)
        for name in remove:
            stale = folder / name
            if stale.parent == folder and stale.is_file() and not stale.is_symlink():
                stale.unlink()
        return folder
    made = _make_folders(Path(os.path.abspath(folder)).parent)
    partial = None
    try:
        partial = Path(tempfile.mkdtemp(dir=Path(os.path.abspath(folder)).parent, prefix=f".{folder.name}."))
        for name, data in files.items():
            (partial / name).write_bytes(data)
        os.chmod(partial, 0o777 & ~_umask())
        os.rename(partial, folder)
    except BaseException:
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        _remove_folders(made)
        raise
    return folder


def _mode_of(target: Path) -> int:
    """The permissions a file written to ``target`` gets: those of the file it replaces, else the umask's."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        return 0o666 & ~_umask()


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
