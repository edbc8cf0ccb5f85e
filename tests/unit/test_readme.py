"""The README's snippets work as written on a machine without a GPU: every Python snippet runs on the host driver,
and every ``extensible-kv`` command of a shell snippet names a command and options that exist. A snippet that needs
more says so in its first line (``# needs: ...``) and is only checked for saying it."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
NEEDS = "# needs:"


def _snippets(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall((ROOT / "README.md").read_text()) if lang == language]


def _runnable(language: str) -> list[str]:
    return [body for body in _snippets(language) if not body.startswith(NEEDS)]


def _env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT / "reference"), str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def test_the_readme_has_snippets_that_run_here():
    counts = {lang: len(_runnable(lang)) for lang in ("python", "bash")}
    assert counts["python"] >= 1 and counts["bash"] >= 1, (
        f"README.md: expected runnable python and bash snippets, got {counts}"
    )


@pytest.mark.parametrize("snippet", _runnable("python"), ids=lambda s: s.splitlines()[1][:40])
def test_every_python_snippet_of_the_readme_runs_on_the_host_driver(snippet):
    run = subprocess.run(
        [sys.executable, "-c", snippet], env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert run.returncode == 0, (
        f"README snippet starting {snippet.splitlines()[0]!r}: expected exit 0, got "
        f"{run.returncode}:\n{run.stderr[-2000:]}"
    )


def _commands() -> list[list[str]]:
    found = []
    for body in _snippets("bash"):
        for line in body.splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["extensible-kv"]:
                found.append(words[1:])
    return found


@pytest.mark.parametrize("words", _commands(), ids=lambda w: " ".join(w)[:50])
def test_every_extensible_kv_command_of_the_readme_names_a_command_and_options_that_exist(words):
    command, options = words[0], [w.split("=")[0] for w in words[1:] if w.startswith("--")]
    run = subprocess.run(
        [sys.executable, "-m", "extensible_kv", command, "--help"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    missing = [o for o in options if o not in run.stdout]
    assert run.returncode == 0 and not missing, (
        f"README command 'extensible-kv {' '.join(words)}': expected "
        f"`{command} --help` to exit 0 and list {options}, got exit "
        f"{run.returncode}, missing {missing}:\n{run.stderr[-1000:]}"
    )


def test_every_snippet_that_cannot_run_here_says_what_it_needs():
    for lang in ("python", "bash"):
        for body in _snippets(lang):
            if body.startswith(NEEDS):
                need = body.splitlines()[0][len(NEEDS) :].strip()
                assert need, f"README {lang} snippet {body[:60]!r}: expected what it needs after '{NEEDS}', got nothing"
