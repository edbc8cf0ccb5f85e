"""Every output a command writes x every kind of path that is not a regular file or a new name: refused with one line
naming the option and the path, exit status 2, before any work, and the path left as it was (Note [An output is a
regular file or a new path, checked first]).

The outputs: ``validate-backend --json``, ``environment OUT_DIR``, ``report --out`` and ``check-driver
--summary-json``. The kinds: a character device (a node made in this test's folder where the test runs as root, else
a link to ``/dev/null``, so that a command that replaced it replaces the link, never ``/dev/null``), a FIFO, a folder
where a file goes (a file where a folder goes), a path under a file, a path of 3,000 components, a component of 300
bytes, a name that is not UTF-8 and a dangling link. Cases that read a FIFO or write into one run in a thread and are
freed after ``LIMIT_S``, so a regression fails instead of hanging.
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
    path.symlink_to("/dev/null")
    return "is a character device"


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


def test_a_link_to_a_regular_file_is_written_through(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    (tmp_path / "link.json").symlink_to(target)
    written = outputs.write_file(tmp_path / "link.json", b"new", option="--json")
    got = (written == target, target.read_text(), (tmp_path / "link.json").is_symlink())
    assert got == (True, "new", True), f"write through a link to a regular file: expected the file replaced, got {got}"
