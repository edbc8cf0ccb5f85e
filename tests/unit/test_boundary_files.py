"""Every file a command reads x every kind of file that is not a measurement file: refused with one line naming the
file, exit status 2, nothing written (Note [A file read is a regular file of bounded size]).

The table is the class, not a list of known cases: each file-taking argument (the run folder of ``report`` and each
measurement file it reads, the file of ``bench-summary``) is tried with each hostile kind (a FIFO, a link to
``/dev/zero``, a character device, a folder, a link out of the folder, a dangling link, a name that is not UTF-8, a
file past the size limit, a file that is not UTF-8, an unreadable file). The commands run in this process through
``main``; a case that blocks (a FIFO opened for reading waits for a writer) fails after ``LIMIT_S`` instead of hanging:
the FIFO is then opened for writing here, which lets the command go on.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from extensible_kv.__main__ import main
from extensible_kv.boundaries import files

ROOT = Path(__file__).resolve().parents[2]
FULL = Path(__file__).resolve().parent / "report_fixtures" / "full"
LIMIT_S = 30

REPORT = ["report", "{tmp}/run", "--out", "{tmp}/out"]
# A file a command reads: (command line, the file's path under {tmp}; "{file}" in the command line is that path as
# made, which a kind may rename). "run" holds a copy of the full fixture run.
READ = {
    "report conformance-*.json": (REPORT, "run/conformance-host.json"),
    "report bench*.json": (REPORT, "run/bench-cuda.json"),
    "report validate-backend*.json": (REPORT, "run/validate-backend-cuda.json"),
    "report serving-*.json": (REPORT, "run/serving-x.json"),
    "report environment.json": (REPORT, "run/environment.json"),
    "report integration/**/*.json": (REPORT, "run/integration/call9/x.json"),
    "report sleep/summary.json": (REPORT, "run/sleep/summary.json"),
    "report connectors/summary.json": (REPORT, "run/connectors/summary.json"),
    "bench-summary FILE": (["bench-summary", "{file}"], "run/bench-cuda.json"),
}
NOT_UTF8 = os.fsdecode(b"caf\xe9")  # a name that is not UTF-8, as Python hands it on


def _fifo(path: Path) -> tuple[Path, str]:
    os.mkfifo(path)
    return path, "is a FIFO, not a regular file"


def _dev_zero(path: Path) -> tuple[Path, str]:
    path.symlink_to("/dev/zero")
    return path, "a link to /dev/zero"


def _char_device(path: Path) -> tuple[Path, str]:
    if os.geteuid() != 0:
        path.symlink_to("/dev/urandom")
        return path, "a link to /dev/urandom"
    os.mknod(path, 0o644 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers, a node of this test's folder
    return path, "is a character device, not a regular file"


def _folder(path: Path) -> tuple[Path, str]:
    path.mkdir()
    (path / "x.json").write_text("{}")
    return path, "is a folder, not a regular file"


def _outside(path: Path) -> tuple[Path, str]:
    outside = next(p for p in path.parents if p.name == "run").parent / "outside.json"
    shutil.copy(FULL / "environment.json", outside)
    path.symlink_to(outside)
    return path, "outside the folder"


def _dangling(path: Path) -> tuple[Path, str]:
    path.symlink_to(path.parent / "no-such-file.json")
    return path, "cannot be read (No such file or directory)"


def _not_utf8_name(path: Path) -> tuple[Path, str]:
    named = path.with_name(path.stem + NOT_UTF8 + path.suffix)
    shutil.copy(FULL / "environment.json", named)
    return named, "is not UTF-8 text (byte 0xe9"


def _huge(path: Path) -> tuple[Path, str]:
    with path.open("wb") as out:
        out.truncate(files.FILE_LIMIT + 1)  # sparse: no disk taken
    return path, f"more than the {files.FILE_LIMIT >> 20}.0 MiB"


def _not_utf8_text(path: Path) -> tuple[Path, str]:
    path.write_bytes(b'{"gpu": "caf\xe9"}')
    return path, "is not UTF-8 text (byte 0xe9 at offset 12)"


def _unreadable(path: Path) -> tuple[Path, str]:
    shutil.copy(FULL / "environment.json", path)
    path.chmod(0)
    return path, "cannot be read (Permission denied)"


KINDS = {
    "fifo": _fifo,
    "dev_zero_link": _dev_zero,
    "char_device": _char_device,
    "folder": _folder,
    "link_outside": _outside,
    "dangling_link": _dangling,
    "name_not_utf8": _not_utf8_name,
    "huge": _huge,
    "text_not_utf8": _not_utf8_text,
    "unreadable": _unreadable,
}


def _cases():
    for arg, (argv, rel) in READ.items():
        for kind, make in KINDS.items():
            if arg == "bench-summary FILE" and kind == "link_outside":
                continue  # a file named on the command line may be a link to anywhere: there is no folder to stay in
            yield pytest.param(argv, rel, make, id=f"{arg}-{kind}")


def _run_in_thread(argv: list[str], capsys, unblock: Path | None) -> tuple[int | None, str, str]:
    """``main(argv)`` within ``LIMIT_S``; past it, a FIFO at ``unblock`` is opened for writing so the command can end,
    and the code is None."""
    result: list = []

    def target():
        try:
            result.append(main(argv))
        except BaseException as exc:  # reported below as what escaped
            result.append(exc)

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(LIMIT_S)
    if worker.is_alive():
        if unblock is not None:
            fd = os.open(unblock, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        worker.join(LIMIT_S)
        captured = capsys.readouterr()
        return None, captured.out, captured.err
    captured = capsys.readouterr()
    if isinstance(result[0], BaseException):
        raise AssertionError(f"main({argv}) raised {type(result[0]).__name__}: {result[0]}") from result[0]
    return result[0], captured.out, captured.err


@pytest.mark.parametrize(("argv", "rel", "make"), list(_cases()))
def test_a_file_that_is_not_a_measurement_file_is_refused_in_one_line(tmp_path, capsys, argv, rel, make):
    if make is _unreadable and os.geteuid() == 0:
        pytest.skip("root reads a file of mode 000")
    shutil.copytree(FULL, tmp_path / "run")
    target = tmp_path / rel
    if target.exists():
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    made, words = make(target)
    args = [a.format(tmp=tmp_path, file=made) for a in argv]
    code, out, err = _run_in_thread(args, capsys, made if stat.S_ISFIFO(os.lstat(made).st_mode) else None)
    lines = err.splitlines()
    got = {
        "exit": code,
        "lines": len(lines),
        "names the file and why": bool(lines) and target.stem in lines[0] and words in lines[0],
        "wrote": sorted(p.name for p in (tmp_path / "out").glob("*")),
    }
    want = {"exit": 2, "lines": 1, "names the file and why": True, "wrote": []}
    assert got == want, f"extensible-kv {' '.join(args)}, {rel} {make.__name__[1:]}: expected {want}, got {got}\n{err}"


def _run_folder_as(kind: str, tmp_path: Path) -> tuple[str, str]:
    """A run folder argument of ``kind``: (the argument, what the refusal says)."""
    run = tmp_path / "run"
    if kind == "fifo":
        os.mkfifo(run)
        return str(run), "is not a folder"
    if kind == "dev_zero_link":
        run.symlink_to("/dev/zero")
        return str(run), "is not a folder"
    if kind == "regular_file":
        run.write_text("{}")
        return str(run), "is not a folder"
    if kind == "dangling_link":
        run.symlink_to(tmp_path / "nowhere")
        return str(run), "does not exist"
    if kind == "name_not_utf8":
        named = tmp_path / f"run{NOT_UTF8}"
        shutil.copytree(FULL, named)
        return str(named), "runcaf\\xe9' is not UTF-8 text"
    if kind == "too_long":
        return "/".join([str(tmp_path)] + ["a"] * 3000), "File name too long"
    raise AssertionError(kind)


RUN_FOLDER_KINDS = ["fifo", "dev_zero_link", "regular_file", "dangling_link", "name_not_utf8", "too_long"]


@pytest.mark.parametrize("kind", RUN_FOLDER_KINDS)
def test_a_run_folder_that_is_not_one_is_refused_in_one_line(tmp_path, capsys, kind):
    run, words = _run_folder_as(kind, tmp_path)
    code, out, err = _run_in_thread(["report", run, "--out", str(tmp_path / "out")], capsys, None)
    lines = err.splitlines()
    got = {"exit": code, "lines": len(lines), "says why": bool(lines) and words in lines[0]}
    got["wrote"] = (tmp_path / "out").exists()
    want = {"exit": 2, "lines": 1, "says why": True, "wrote": False}
    assert got == want, f"report RUN_DIR {kind}: expected {want}, got {got}\n{err[:500]}"


def test_a_fifo_run_file_is_refused_at_the_command_line_not_waited_on(tmp_path):
    """The same through a real command line: one line, exit 2, within seconds (it used to wait forever)."""
    shutil.copytree(FULL, tmp_path / "run")
    (tmp_path / "run" / "bench-cuda.json").unlink()
    os.mkfifo(tmp_path / "run" / "bench-cuda.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "reference"), str(ROOT)]))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "extensible_kv", "report", str(tmp_path / "run"), "--out", str(tmp_path / "out")],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("report of a run folder holding a FIFO: still waiting after 120 s")
    got = (proc.returncode, proc.stderr.count("\n"), "is a FIFO, not a regular file" in proc.stderr)
    assert got == (2, 1, True), f"report with a FIFO: expected exit 2 and one line naming it, got {got}\n{proc.stderr}"


def test_a_run_folder_past_its_total_size_is_refused_naming_the_limit(tmp_path, monkeypatch, capsys):
    shutil.copytree(FULL, tmp_path / "run")
    monkeypatch.setattr(files, "FOLDER_LIMIT", 4096)
    code = main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    got = (code, err.count("\n"), "of files a run folder may hold" in err, (tmp_path / "out").exists())
    assert got == (2, 1, True, False), f"report of a run folder past 4 KiB in all: expected a refusal, got {got}\n{err}"


def test_a_run_folder_of_too_many_files_is_refused(tmp_path, monkeypatch, capsys):
    shutil.copytree(FULL, tmp_path / "run")
    monkeypatch.setattr(files, "FOLDER_FILES", 5)
    code = main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    got = (code, err.count("\n"), "holds more than 5 files and folders" in err)
    assert got == (2, 1, True), f"report of a run folder of more than 5 entries: expected a refusal, got {got}\n{err}"
