"""Every output a command writes x every kind of path that is not a regular file or a new name: refused with one line
naming the option and the path, exit status 2, before any work, and the path left as it was (Note [An output is a
regular file or a new path, checked first]).

The outputs: ``validate-backend --json``, ``environment OUT_DIR``, ``report --out`` and ``check-driver --summary-json``.
The kinds: a character device (a node made in this test's folder where the test runs as root, else a link to
``/dev/null``, refused as a link), a FIFO, a folder where a file goes (a file where a folder goes), a path under a file,
a path of 3,000 components, a component of 300 bytes, a name that is not UTF-8 and a dangling link. A symbolic link
where an output goes, or where a command writes a file in an output folder, is refused too, and one swapped in after the
check is never written through. Cases that read a FIFO or write into one run in a thread and are freed after
``LIMIT_S``, so a regression fails instead of hanging.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from conformance import check_driver
from extensible_kv.__main__ import main
from extensible_kv.boundaries import outputs

GOOD_BACKEND = "tests.unit._factories:KVFirstBackend"
FULL = Path(__file__).resolve().parent / "report_fixtures" / "full"
NOT_UTF8 = os.fsdecode(b"caf\xe9")
LIMIT_S = 60


def _char_device(path: Path) -> str:
    if os.geteuid() == 0:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers, a node of this test's folder
        return "is a character device"
    path.symlink_to("/dev/null")  # refused as a link, which is never written through
    return "is a symbolic link to '/dev/null'"


def _fifo(path: Path) -> str:
    os.mkfifo(path)
    return "is a FIFO"


def _folder(path: Path) -> str:
    path.mkdir()
    return "is a folder"


def _file(path: Path) -> str:
    path.write_text("a file")
    return "is a regular file, not a folder"


def _under_a_file(path: Path) -> str:
    path.parent.write_text("a file")
    return "Not a directory"


def _dangling(path: Path) -> str:
    path.symlink_to(path.parent / "nowhere" / "x")
    return "does not exist"


# output -> (command line with {out}; whether {out} names a folder)
OUTPUTS = {
    "validate-backend --json": (["validate-backend", GOOD_BACKEND, "--driver", "host-4k", "--json", "{out}"], False),
    "environment OUT_DIR": (["environment", "{out}"], True),
    "report --out": (["report", str(FULL), "--out", "{out}"], True),
    "check-driver --summary-json": (["check-driver", "--summary-json", "{out}"], False),
}
KINDS = ["char_device", "fifo", "wrong_kind", "under_a_file", "too_long", "component_too_long", "not_utf8", "dangling"]


def _make(kind: str, tmp_path: Path, folder: bool) -> tuple[str, str]:
    """The output path of ``kind`` and what its refusal says."""
    out = tmp_path / "out"
    if kind == "char_device":
        return str(out), _char_device(out)
    if kind == "fifo":
        return str(out), _fifo(out)
    if kind == "wrong_kind":
        return str(out), (_file(out) if folder else _folder(out))
    if kind == "under_a_file":
        return str(tmp_path / "file" / "out"), _under_a_file(tmp_path / "file" / "out")
    if kind == "too_long":
        return "/".join([str(tmp_path)] + ["a"] * 3000), "3,0"
    if kind == "component_too_long":
        return str(tmp_path / ("x" * 300)), "has a component of 300 bytes"
    if kind == "not_utf8":
        return str(tmp_path / f"out{NOT_UTF8}"), "is not UTF-8 text (byte 0xe9"
    if kind == "dangling":
        return str(out), _dangling(out)
    raise AssertionError(kind)


def _run(argv: list[str]) -> int:
    if argv[0] == "check-driver":  # checked by check_driver before it starts anything
        return check_driver("host", [*argv[1:], "-k", "no_rule_has_this_name", "-p", "no:randomly"])
    return main(argv)


def _state(path: str) -> object:
    """What is at ``path`` now: its kind and, for a regular file, its content."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return exc.errno
    if stat.S_ISREG(st.st_mode):
        return ("file", Path(path).read_bytes())
    return stat.S_IFMT(st.st_mode)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("output", OUTPUTS)
def test_an_output_that_is_not_a_file_or_a_new_path_is_refused_before_any_work(tmp_path, capsys, output, kind):
    argv, folder = OUTPUTS[output]
    path, words = _make(kind, tmp_path, folder)
    before = _state(path)
    args = [a.format(out=path) for a in argv]
    result: list = []
    worker = threading.Thread(target=lambda: result.append(_run(args)), daemon=True)
    worker.start()
    worker.join(LIMIT_S)
    if worker.is_alive() and kind == "fifo":  # a reader for the writer that waits on the FIFO
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        worker.join(LIMIT_S)
    out, err = capsys.readouterr()
    lines = err.splitlines()
    option = output.split()[-1]
    got = {
        "exit": result[0] if result else "still running",
        "lines": len(lines),
        "names option and why": bool(lines) and option in lines[0] and words in lines[0],
        "worked": "passed" in out or "environment.json" in out or "report written" in out,
        "path as it was": _state(path) == before,
        "left in the folder": sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")),
    }
    want = {
        "exit": 2,
        "lines": 1,
        "names option and why": True,
        "worked": False,
        "path as it was": True,
        "left in the folder": [],
    }
    assert got == want, f"{' '.join(args)[:300]}: expected {want}, got {got}\n{out[-500:]}{err[-500:]}"


def test_a_report_folder_interrupted_while_written_leaves_no_folder(tmp_path, monkeypatch):
    """A new output folder appears whole or not at all: cut short after its first file, nothing is left."""
    real = Path.write_bytes
    calls = []

    def first_then_interrupt(self, data):
        calls.append(self.name)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", first_then_interrupt)
    code = main(["report", str(FULL), "--out", str(tmp_path / "deep" / "out")])
    monkeypatch.undo()
    got = (code, calls[:1] != [], sorted(p.name for p in tmp_path.iterdir()))
    assert got == (130, True, []), f"report cut short while written: expected exit 130 and nothing left, got {got}"


# output -> the files the command writes where {out} is: inside the folder, or beside the file
WRITTEN_THERE = {
    "validate-backend --json": [],
    "environment OUT_DIR": ["environment.json"],
    "report --out": ["report.md", "report.html", "summary.json"],
    "check-driver --summary-json": ["environment.json"],
}
LINKS = [(o, None) for o in OUTPUTS] + [(o, name) for o, names in WRITTEN_THERE.items() for name in names]


def _tree(root: Path) -> dict[str, object]:
    """Every path under ``root`` (links not followed) and what is there."""
    found = {}
    for folder, dirs, names in os.walk(root):
        for name in dirs + names:
            path = os.path.join(folder, name)
            found[os.path.relpath(path, root)] = _state(path)
    return found


@pytest.mark.parametrize("output,inside", LINKS, ids=[f"{o}: {n or 'itself'}" for o, n in LINKS])
def test_an_output_that_is_a_symbolic_link_is_refused_before_any_work(tmp_path, capsys, output, inside):
    """A link where an output goes (the output itself, or a file a command writes in its folder or beside it) is
    refused naming the option, the link and where it points: written through, it replaced the file elsewhere."""
    argv, folder = OUTPUTS[output]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / "victim"
    victim.write_text("VICTIM")
    out = tmp_path / "out"
    if inside is None:
        link, points_to = out, (elsewhere if folder else victim)
        path = str(out)
    else:
        out.mkdir()
        link, points_to = out / inside, victim
        path = str(out if folder else out / "summary.json")
    link.symlink_to(points_to)
    before = _tree(tmp_path)
    words = (output.split()[-1], str(link), str(points_to))
    code = _run([a.format(out=path) for a in argv])
    stdout, err = capsys.readouterr()
    lines = err.splitlines()
    got = {
        "exit": code,
        "lines": len(lines),
        "names option, link and target": bool(lines) and all(w in lines[0] for w in words),
        "worked": "passed" in stdout or "environment.json" in stdout or "report written" in stdout,
        "victim": victim.read_text(),
        "nothing written": _tree(tmp_path) == before,
    }
    want = {
        "exit": 2,
        "lines": 1,
        "names option, link and target": True,
        "worked": False,
        "victim": "VICTIM",
        "nothing written": True,
    }
    assert got == want, f"{output} with {link} -> {points_to}: expected {want}, got {got}\n{stdout[-500:]}{err[-500:]}"


def test_a_report_png_that_is_a_symbolic_link_is_refused_before_the_first_file_is_written(tmp_path, capsys):
    """A PNG's name is known once it is drawn: a link there is refused before report.md or any other file is
    written, naming the link and where it points."""
    out = tmp_path / "out"
    assert main(["report", str(FULL), "--out", str(out)]) == 0
    pngs = sorted(p for p in out.iterdir() if p.suffix == ".png")
    assert pngs, f"the report of {FULL} drew no figure"
    victim = tmp_path / "victim"
    victim.write_text("VICTIM")
    pngs[0].unlink()
    pngs[0].symlink_to(victim)
    before = _tree(tmp_path)
    capsys.readouterr()
    code = main(["report", str(FULL), "--out", str(out)])
    _, err = capsys.readouterr()
    lines = err.splitlines()
    got = (code, len(lines), bool(lines) and str(pngs[0]) in lines[0] and str(victim) in lines[0])
    got += (victim.read_text(), _tree(tmp_path) == before)
    assert got == (2, 1, True, "VICTIM", True), f"a PNG of the report that is a link: got {got}\n{err[-500:]}"


@pytest.mark.parametrize("when", ["after the check", "after the temporary file is written"])
def test_a_file_swapped_for_a_link_while_written_is_never_written_through(tmp_path, monkeypatch, when):
    """A link swapped in for an output after the command's check is refused when the file is written; swapped in
    after that, the rename that puts the file in place replaces the link itself, never the file it points to
    (``rename`` does not follow the last component of its target)."""
    victim = tmp_path / "victim"
    victim.write_text("VICTIM")
    target = tmp_path / "out.json"
    target.write_text("old")

    def swap() -> None:
        target.unlink()
        target.symlink_to(victim)

    if when == "after the check":
        checked = outputs.output_file

        def check_then_swap(path, *, option):
            found = checked(path, option=option)
            swap()
            return found

        monkeypatch.setattr(outputs, "output_file", check_then_swap)
        with pytest.raises(outputs.BadOutputPath, match="is a symbolic link to"):
            outputs.write_file(target, b"new", option="--json")
        want = ("VICTIM", True, b"VICTIM")
    else:
        rename = os.replace

        def swap_then_rename(*args, **kwargs):
            swap()
            return rename(*args, **kwargs)

        monkeypatch.setattr(os, "replace", swap_then_rename)
        outputs.write_file(target, b"new", option="--json")
        monkeypatch.undo()
        want = ("VICTIM", False, b"new")
    got = (victim.read_text(), target.is_symlink(), target.read_bytes())
    left = sorted(p.name for p in tmp_path.iterdir())
    assert (got, left) == (want, ["out.json", "victim"]), f"a link swapped in {when}: got {got}, left {left}"


def test_a_folder_swapped_for_a_link_after_the_check_is_not_written_into(tmp_path, monkeypatch):
    """An existing output folder swapped for a link after the check: nothing is written where the link points."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "report.md").write_text("VICTIM")
    out = tmp_path / "out"
    out.mkdir()
    checked = outputs.output_folder

    def check_then_swap(path, *, option, files=()):
        found = checked(path, option=option, files=files)
        out.rmdir()
        out.symlink_to(elsewhere)
        return found

    monkeypatch.setattr(outputs, "output_folder", check_then_swap)
    with pytest.raises(outputs.BadOutputPath, match="symbolic link"):
        outputs.write_folder(out, {"report.md": b"new", "b.png": b"png"}, option="--out")
    got = (sorted(p.name for p in elsewhere.iterdir()), (elsewhere / "report.md").read_text())
    assert got == (["report.md"], "VICTIM"), f"write into a folder swapped for a link: got {got}"
