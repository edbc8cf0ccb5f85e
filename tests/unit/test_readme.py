"""The README's snippets work as written on a machine without a GPU: every Python snippet runs (on the host driver;
one that needs vLLM against the stand-in of ``tests/unit/standins/vllm``, which records its calls), and every shell
snippet names commands that exist: ``extensible-kv`` commands and options, nox sessions and tags, the project's own
environment variables. A snippet that needs more than this machine has says so in its first line (``# needs: ...``)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STANDINS = Path(__file__).resolve().parent / "standins"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
NEEDS = "# needs:"
PROGRAMS = {"python3", "extensible-kv", "pytest", "vllm", "grep", "export", "curl"}
"""The programs the README's shell snippets may run: Python's, this package's entry point, pytest, vLLM's."""


def _snippets(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall((ROOT / "README.md").read_text()) if lang == language]


def _needs(body: str) -> str | None:
    return body.splitlines()[0][len(NEEDS) :].strip() if body.startswith(NEEDS) else None


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT / "reference"), str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def test_the_readme_has_snippets_of_both_kinds_and_one_for_vllm():
    python = _snippets("python")
    counts = {lang: len(_snippets(lang)) for lang in ("python", "bash")}
    assert counts["python"] >= 2 and counts["bash"] >= 2 and any("vLLM" in (_needs(s) or "") for s in python), (
        f"README.md: expected python and bash snippets, a python one needing vLLM among them, got {counts}"
    )


@pytest.mark.parametrize("snippet", _snippets("python"), ids=lambda s: s.splitlines()[1][:40])
def test_every_python_snippet_of_the_readme_runs(snippet, tmp_path):
    """On the host driver; a snippet that needs vLLM runs against the stand-in, and must have built an engine and
    generated with it. Any other need has no stand-in: every Python snippet runs here."""
    need = _needs(snippet)
    assert need is None or "vLLM" in need, f"README python snippet needs {need!r}: only vLLM has a stand-in here"
    calls = tmp_path / "calls.json"
    env = _env()
    if need is not None:
        env = _env(EXTENSIBLE_KV_STANDIN_VLLM_CALLS=str(calls))
        env["PYTHONPATH"] = os.pathsep.join([str(STANDINS), env["PYTHONPATH"]])
    run = subprocess.run(
        [sys.executable, "-c", snippet], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert run.returncode == 0, (
        f"README snippet starting {snippet.splitlines()[0]!r}: expected exit 0, got "
        f"{run.returncode}:\n{run.stderr[-2000:]}"
    )
    if need is not None:
        made = [c["call"] for c in json.loads(calls.read_text())] if calls.exists() else []
        assert "LLM" in made and {"LLM.generate", "LLM.collective_rpc"} & set(made), (
            f"README vLLM snippet: expected it to build an LLM and use it, the stand-in recorded {made}"
        )


def _commands() -> list[tuple[str, list[str]]]:
    """Every command of the shell snippets: (the snippet's need, or "", its words without leading VAR=value)."""
    found = []
    for body in _snippets("bash"):
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            command: list[str] = []
            for word in [*words, "&&"]:
                if word in ("&&", "||", "|", ";"):
                    if command:
                        found.append((_needs(body) or "", command))
                    command = []
                else:
                    command.append(word)
    return found


def _variables() -> list[str]:
    return sorted({m for body in _snippets("bash") for m in re.findall(r"\b(EXTENSIBLE_KV_\w+)=", body)})


def _program(words: list[str]) -> list[str]:
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        words = words[1:]
    return words


@pytest.mark.parametrize("words", [w for _, w in _commands()], ids=lambda w: " ".join(w)[:50])
def test_every_command_of_the_readme_runs_a_program_it_may(words):
    words = _program(words)
    assert words and words[0] in PROGRAMS, f"README command {' '.join(words)!r}: expected one of {sorted(PROGRAMS)}"
    if words[:2] == ["python3", "-m"]:
        module = words[2]
        ours = module.startswith("extensible_kv.") and (ROOT / "reference" / f"{module.replace('.', '/')}.py").exists()
        assert module in ("pip", "nox", "extensible_kv", "pytest") or ours, (
            f"README command {' '.join(words)!r}: module?"
        )


def _nox_commands() -> list[list[str]]:
    found = []
    for _, words in _commands():
        words = _program(words)
        if words[:3] == ["python3", "-m", "nox"]:
            found.append(words[3:])
        elif words[:1] == ["nox"]:
            found.append(words[1:])
    return found


@pytest.mark.parametrize("args", _nox_commands(), ids=lambda a: " ".join(a)[:50])
def test_every_nox_command_of_the_readme_names_sessions_and_tags_that_exist(args):
    sys.path.insert(0, str(ROOT))
    try:
        from nox import registry

        import noxfile  # noqa: F401 - registers the sessions
    finally:
        sys.path.remove(str(ROOT))
    sessions = registry.get()
    tags = {tag for func in sessions.values() for tag in getattr(func, "tags", [])}
    args = args[: args.index("--")] if "--" in args else args
    named, kind = [], None
    for word in args:
        if word in ("-s", "--session", "--sessions", "-t", "--tags"):
            kind = "tag" if word in ("-t", "--tags") else "session"
        elif not word.startswith("-") and kind:
            named.append((kind, word))
    missing = [n for k, n in named if n not in (tags if k == "tag" else sessions)]
    assert named and not missing, (
        f"README `nox {' '.join(args)}`: expected sessions {sorted(sessions)} or tags {sorted(tags)}, "
        f"got unknown {missing} (named: {named})"
    )


@pytest.mark.parametrize("name", _variables())
def test_every_variable_the_readme_sets_is_one_the_project_reads(name):
    sources = [*ROOT.glob("reference/extensible_kv/**/*.py"), ROOT / "noxfile.py", *ROOT.glob("integration/*.py")]
    assert any(name in path.read_text() for path in sources), f"README sets {name}, which no source file reads"


def _extensible_kv_commands() -> list[list[str]]:
    found = []
    for _, words in _commands():
        words = _program(words)
        if words[:1] == ["extensible-kv"]:
            found.append(words[1:])
        elif words[:3] == ["python3", "-m", "extensible_kv"]:
            found.append(words[3:])
    return found


@pytest.mark.parametrize("words", _extensible_kv_commands(), ids=lambda w: " ".join(w)[:50])
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


def test_the_entry_point_the_readme_runs_is_the_one_pyproject_installs():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'extensible-kv = "extensible_kv.__main__:main"' in text, "pyproject.toml: expected the extensible-kv script"


def test_every_snippet_that_cannot_run_here_says_what_it_needs():
    for lang in ("python", "bash"):
        for body in _snippets(lang):
            if body.startswith(NEEDS):
                assert _needs(body), f"README {lang} snippet {body[:60]!r}: expected what it needs after '{NEEDS}'"


def test_the_log_line_the_readme_quotes_is_the_one_the_patch_logs_and_its_logging_config_shows_it():
    readme = (ROOT / "README.md").read_text()
    source = (ROOT / "reference" / "extensible_kv" / "vllm" / "patches.py").read_text()
    logged = re.search(r'logger\.info\("(extensible KV cache: [^"]*)"', source)
    config = re.search(r"VLLM_LOGGING_CONFIG_PATH=(\S+)", readme)
    assert logged and config, "expected patches.py's 'extensible KV cache: ...' line and a logging config in README"
    quoted = logged.group(1).replace("%d", "N", 1).replace("%d", "M", 1).split(" (")[0]
    assert quoted in " ".join(readme.split()), f"README: expected it to quote {quoted!r}"
    show = (
        "import json, logging, logging.config, sys; logging.config.dictConfig(json.load(open(sys.argv[1]))); "
        f"logging.getLogger('extensible_kv.vllm').info({logged.group(1)!r}, 10, 8, [8])"
    )
    run = subprocess.run([sys.executable, "-c", show, config.group(1)], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0 and "extensible KV cache: 10 blocks reserved, 8 committed" in run.stdout, (
        f"{config.group(1)}: expected it to print the extensible_kv.vllm INFO line, got exit {run.returncode}, "
        f"{run.stdout!r} {run.stderr[-500:]!r}"
    )


def test_ci_runs_the_test_command_of_the_readme():
    commands = [" ".join(w) for _, w in _commands() if w[:3] == ["python3", "-m", "nox"] and "tests" in w]
    script = (ROOT / ".ci" / "run").read_text()
    assert commands and all(f"python3 -m pip install 'nox[uv]' && {c}" in script for c in commands), (
        f".ci/run: expected it to run the README's test command {commands}"
    )
