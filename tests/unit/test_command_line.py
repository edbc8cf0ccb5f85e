"""The command line's shape: without a command it lists the commands; it names itself as it was started (the
``extensible-kv`` console script or ``python -m extensible_kv``); install hints name the command that installs an
extra the way this copy was installed (from an index, or editable from a checkout)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from extensible_kv import __main__ as cli
from extensible_kv import drivers

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("drivers", "check-driver", "validate-backend", "environment", "report", "bench-summary")


def test_without_a_command_it_lists_every_command_and_exits_2():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "reference"), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-m", "extensible_kv"], capture_output=True, text=True, env=env, timeout=120)
    listed = [c for c in COMMANDS if f"\n    {c}" in proc.stdout]
    got = (proc.returncode, listed, proc.stderr)
    assert got == (2, list(COMMANDS), ""), (
        f"python -m extensible_kv without a command: expected (exit 2, every "
        f"command listed on stdout, nothing on stderr), got {got}\n{proc.stdout}"
    )


@pytest.mark.parametrize(
    ("argv0", "prog"),
    [("/venv/bin/extensible-kv", "extensible-kv"), (cli.__file__, "python -m extensible_kv")],
    ids=["console script", "python -m"],
)
def test_the_help_names_the_command_as_it_was_started(monkeypatch, capsys, argv0, prog):
    monkeypatch.setattr(sys, "argv", [argv0])
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    out = capsys.readouterr().out
    got = (info.value.code, out.splitlines()[0].split(" [")[0] if out else "")
    assert got == (0, f"usage: {prog}"), f"--help started as {argv0}: expected (exit 0, 'usage: {prog}'), got {got}"


@pytest.mark.parametrize(
    ("checkout", "cwd_is_root", "expected"),
    [
        (None, False, "pip install 'extensible-kv[rocm]'"),
        ("root", True, "pip install -e '.[rocm]'"),
        ("root", False, "pip install -e '{root}[rocm]'"),
    ],
    ids=["installed from an index", "checkout, at its root", "checkout, elsewhere"],
)
def test_the_install_hint_follows_how_the_package_was_installed(monkeypatch, tmp_path, checkout, cwd_is_root, expected):
    root = tmp_path / "clone"
    root.mkdir()
    monkeypatch.setattr(drivers, "_checkout", lambda: root if checkout else None)
    monkeypatch.chdir(root if cwd_is_root else tmp_path)
    got = drivers.install_command("rocm")
    assert got == expected.format(root=root), (
        f"install_command('rocm') ({checkout=}, {cwd_is_root=}): expected {expected.format(root=root)!r}, got {got!r}"
    )


def test_a_drivers_probe_reason_ends_with_the_install_command(monkeypatch):
    monkeypatch.setattr(drivers, "_checkout", lambda: None)
    monkeypatch.setitem(
        drivers._REGISTRY,
        "fake-gpu",
        drivers._Entry(
            object,
            lambda: "fake-bindings is not installed; install the 'rocm' extra (pip install -e .[rocm])",
            gpu=True,
            extra="rocm",
        ),
    )
    got = drivers.probe("fake-gpu")
    expected = "fake-bindings is not installed; install the 'rocm' extra (pip install 'extensible-kv[rocm]')"
    assert got == expected, f"probe('fake-gpu') installed from an index: expected {expected!r}, got {got!r}"


INTERRUPTED_AT_IMPORT = """
import sys

class Interrupt:  # Ctrl-C arrives while {module} loads
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, Interrupt())
{start}
"""
STARTS = {
    "console script": "from extensible_kv.__main__ import main\nsys.exit(main(['drivers']))",
    "python -m": "import runpy\nsys.argv = ['extensible_kv', 'drivers']\n"
    "runpy.run_module('extensible_kv', run_name='__main__')",
}


@pytest.mark.parametrize("start", sorted(STARTS))
@pytest.mark.parametrize("module", ["torch", "extensible_kv.drivers"])
def test_an_interrupt_while_the_command_line_starts_is_one_line(start, module):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "reference"), str(ROOT)]))
    code = INTERRUPTED_AT_IMPORT.format(module=module, start=STARTS[start])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    got = (proc.returncode, proc.stderr)
    assert got == (130, "error: interrupted while starting; no command ran\n"), (
        f"{start}, interrupted while {module} loads: expected (exit 130, one line), got {got}"
    )
