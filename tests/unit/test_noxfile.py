"""Where the nox sessions take torch from (Note [torch's CPU build on a machine without a GPU] in noxfile.py): on a
machine without a GPU, torch's CPU build whatever pip's configuration (a named index, a constraint that pins a
`+cpu` release, a `+cpu` wheel in pip's find-links, or PyTorch's CPU index with pip's own sources set aside), else a
one-line refusal before anything is installed; with a GPU, pip's own torch."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU = "https://download.pytorch.org/whl/cpu"
TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"
CPU_WHEEL = f"torch-2.13.0+cpu-{TAG}-{TAG}-manylinux_2_28_x86_64.whl"


def _noxfile():
    sys.path.insert(0, str(ROOT))
    try:
        import noxfile
    finally:
        sys.path.remove(str(ROOT))
    return noxfile


# (PIP_* and EXTENSIBLE_KV_* variables, GPU, whether the CPU index answers, the step: "pip" (torch left to pip),
# "index URL [constraints]" (isolated), "wheel NAME", or "refuse"). WHEELS is a folder holding CPU_WHEEL, EMPTY an
# empty one, CUDA one holding only PyPI's CUDA wheel, PIN a constraint file pinning torch==2.13.0+cpu, CI .ci/run's.
CASES = {
    "no GPU, nothing configured": ({}, False, True, f"index {CPU}"),
    "no GPU, nothing configured, offline": ({}, False, False, "refuse"),
    "a GPU": ({}, True, False, "pip"),
    "a GPU and find-links": ({"PIP_FIND_LINKS": "WHEELS"}, True, True, "pip"),
    "find-links holding the CPU wheel": ({"PIP_FIND_LINKS": "WHEELS"}, False, False, f"wheel {CPU_WHEEL}"),
    "find-links as a file URL": ({"PIP_FIND_LINKS": "file://WHEELS"}, False, False, f"wheel {CPU_WHEEL}"),
    "find-links holding no torch (the issue's machine)": ({"PIP_FIND_LINKS": "EMPTY"}, False, True, f"index {CPU}"),
    "find-links holding a CUDA torch only": ({"PIP_FIND_LINKS": "CUDA"}, False, True, f"index {CPU}"),
    "find-links holding no torch, offline": ({"PIP_FIND_LINKS": "EMPTY"}, False, False, "refuse"),
    "a constraint pinning a +cpu torch": ({"PIP_CONSTRAINT": "PIN"}, False, False, "pip"),
    "the CI machine (constraint without +cpu, the wheel in find-links)": (
        {"PIP_CONSTRAINT": "CI", "PIP_FIND_LINKS": "WHEELS"},
        False,
        False,
        f"wheel {CPU_WHEEL}",
    ),
    "a constraint without +cpu and no wheel": ({"PIP_CONSTRAINT": "CI"}, False, True, f"index {CPU} -c CI"),
    "an index of its own": ({"PIP_INDEX_URL": "https://mirror.example/simple"}, False, True, f"index {CPU}"),
    "an index of its own, PyTorch's unreachable": (
        {"PIP_INDEX_URL": "https://m.example/simple"},
        False,
        False,
        "refuse",
    ),
    "an extra index": ({"PIP_EXTRA_INDEX_URL": "https://pypi.org/simple"}, False, True, f"index {CPU}"),
    "no index": ({"PIP_NO_INDEX": "1"}, False, False, "refuse"),
    "an empty variable is no source": ({"PIP_FIND_LINKS": ""}, False, True, f"index {CPU}"),
    "another index named": (
        {"EXTENSIBLE_KV_TORCH_INDEX": "https://mirror.example/cpu"},
        False,
        False,
        "index https://mirror.example/cpu",
    ),
    "named even over a constraint file": (
        {"EXTENSIBLE_KV_TORCH_INDEX": CPU, "PIP_CONSTRAINT": "PIN"},
        False,
        False,
        f"index {CPU} -c PIN",
    ),
    "the step turned off": ({"EXTENSIBLE_KV_TORCH_INDEX": ""}, False, False, "pip"),
}


@pytest.fixture
def places(tmp_path: Path) -> dict[str, str]:
    for name, files in {"WHEELS": [CPU_WHEEL], "EMPTY": [], "CUDA": [CPU_WHEEL.replace("+cpu", "")]}.items():
        (tmp_path / name).mkdir()
        for file in files:
            (tmp_path / name / file).write_bytes(b"")
    (tmp_path / "PIN").write_text("# a pin\ntorch == 2.13.0+cpu  # the CPU build\n")
    (tmp_path / "CI").write_text((ROOT / "ci" / "cpu-constraints.txt").read_text())
    return {name: str(tmp_path / name) for name in ("WHEELS", "EMPTY", "CUDA", "PIN", "CI")}


def _placed(text: str, places: dict[str, str]) -> str:
    for name, path in places.items():
        text = text.replace(name, path)
    return text


def _described(step, places: dict[str, str]) -> str:
    if step.refusal:
        return "refuse"
    if not step.install:
        return "pip"
    if step.install[0] == "--index-url":
        assert step.isolated and step.install[-1] == "torch", f"an index step sets pip's sources aside: {step}"
        constraints = " ".join(step.install[2:-1])
        return f"index {step.install[1]}{' ' + constraints if constraints else ''}"
    return f"wheel {Path(step.install[0]).name}"


@pytest.mark.parametrize(("environ", "gpu", "answers", "expected"), CASES.values(), ids=CASES.keys())
def test_the_sessions_take_torch_s_cpu_build_on_a_machine_without_gpu_whatever_pip_s_configuration(
    environ, gpu, answers, expected, places
):
    environ = {key: _placed(value, places) for key, value in environ.items()}
    asked = []

    def answer(url: str) -> str | None:
        asked.append(url)
        return None if answers else "[Errno -3] Temporary failure in name resolution"

    step = _noxfile().torch_step(environ, gpu, answers=answer)
    got = _described(step, places)
    assert got == _placed(expected, places), (
        f"torch_step({environ}, gpu={gpu}, CPU index answers: {answers}): expected {_placed(expected, places)!r}, "
        f"got {got!r} ({step})"
    )


def test_a_refusal_is_one_line_that_says_what_to_set():
    step = _noxfile().torch_step({}, False, answers=lambda url: "[Errno -3] Temporary failure in name resolution")
    words = ("no GPU here", CPU, "Temporary failure", "EXTENSIBLE_KV_TORCH_INDEX=URL", "PIP_FIND_LINKS")
    assert step.refusal and "\n" not in step.refusal and all(w in step.refusal for w in words), (
        f"offline without a GPU: expected one line naming {words}, got {step.refusal!r}"
    )


def test_of_several_cpu_wheels_the_newest_for_this_python_is_taken(tmp_path):
    for name in (
        CPU_WHEEL,
        CPU_WHEEL.replace("2.13.0", "2.9.1"),
        CPU_WHEEL.replace(TAG, "cp39").replace("2.13.0", "2.14.0"),
    ):
        (tmp_path / name).write_bytes(b"")
    step = _noxfile().torch_step({"PIP_FIND_LINKS": str(tmp_path)}, False, answers=lambda url: None)
    assert step.install == (str(tmp_path / CPU_WHEEL),), f"expected the newest wheel for {TAG}, got {step}"


def test_pip_s_settings_are_read_as_pip_applies_them():
    listed = "\n".join(
        [
            "global.find-links='/opt/wheels'",
            "global.constraint='/etc/xdg/pip/constraints.txt'",
            "install.constraint='/etc/other.txt'",
            "global.cert='/etc/ssl/certs/ca-certificates.crt'",
            ":env:.default-timeout='180'",
        ]
    )
    got = _noxfile().pip_options(listed, {"PIP_FIND_LINKS": "/w", "PIP_EXTRA_INDEX_URL": "", "HOME": "/h"})
    expected = {
        "find-links": "/w",
        "constraint": "/etc/other.txt",
        "cert": "/etc/ssl/certs/ca-certificates.crt",
        "default-timeout": "180",
    }
    assert got == expected, f"pip_options: expected {expected}, got {got}"


@pytest.mark.parametrize(
    ("environ", "gpu", "words"),
    [
        ({}, False, "no GPU here"),
        ({}, True, "has a GPU"),
        ({"PIP_FIND_LINKS": "/nonexistent"}, False, "sources set aside"),
        ({"EXTENSIBLE_KV_TORCH_INDEX": ""}, False, "set empty"),
    ],
    ids=["cpu", "gpu", "find-links", "off"],
)
def test_the_sessions_say_why_they_take_torch_from_where_they_do(environ, gpu, words):
    step = _noxfile().torch_step(environ, gpu, answers=lambda url: None)
    assert words in step.why, f"torch_step({environ}, gpu={gpu}): expected a reason naming {words!r}, got {step.why!r}"


class _Session:
    """What ``_install`` uses of a nox session: the installs it makes (arguments, extra environment), its log, and
    ``pip config list`` and the torch build it asks about."""

    venv_backend = "virtualenv"

    def __init__(self, config_list: str, build: str) -> None:
        self.config_list, self.build = config_list, build
        self.installs: list[tuple[tuple[str, ...], dict]] = []

    def run_install(self, *args: str, **kwargs) -> str:
        return self.config_list if "config" in args else self.build

    def install(self, *args: str, env: dict | None = None) -> None:
        self.installs.append((args, dict(env or {})))

    def log(self, message: str) -> None:
        pass

    def error(self, message: str) -> None:
        raise RuntimeError(message)


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A machine without a GPU whose pip configuration names an empty find-links folder, a cert and a constraint
    file, with no PIP_* variable of its own; PyTorch's CPU index answers unless told otherwise."""
    noxfile = _noxfile()
    for key in [k for k in os.environ if k.startswith(("PIP_", "EXTENSIBLE_KV_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setattr(noxfile, "GPU_MACHINE", False)
    monkeypatch.setattr(noxfile, "_answers", lambda url: None)
    (tmp_path / "c.txt").write_text("torch<=2.14.1\n")
    listed = f"global.find-links='{tmp_path}'\nglobal.cert='/etc/ssl/c.crt'\nglobal.constraint='{tmp_path / 'c.txt'}'\n"
    return noxfile, listed, tmp_path


def test_the_cpu_index_step_sets_pip_s_sources_aside_and_keeps_the_rest(machine):
    noxfile, listed, tmp_path = machine
    session = _Session(listed, "2.13.0+cpu CUDA None")
    noxfile._install(session, "-e", ".")
    (torch_args, env), (project_args, project_env) = session.installs
    expected = ("--index-url", CPU, "-c", str(tmp_path / "c.txt"), "torch")
    assert torch_args == expected and project_args == ("-e", ".") and not project_env, session.installs
    assert env["PIP_CONFIG_FILE"] == os.devnull and env["PIP_CERT"] == "/etc/ssl/c.crt", env
    assert all(env[f"PIP_{n}"] is None for n in ("FIND_LINKS", "EXTRA_INDEX_URL", "INDEX_URL", "CONSTRAINT")), env


def test_a_session_refuses_before_installing_anything_where_no_cpu_build_can_come(machine, monkeypatch):
    noxfile, listed, _ = machine
    monkeypatch.setattr(noxfile, "_answers", lambda url: "[Errno -2] Name or service not known")
    session = _Session(listed, "2.13.0+cpu CUDA None")
    with pytest.raises(RuntimeError, match="no way to torch's CPU build"):
        noxfile._install(session, "-e", ".")
    assert session.installs == [], f"expected no install before the refusal, got {session.installs}"


def test_a_cuda_torch_on_a_machine_without_gpu_stops_the_session(machine):
    noxfile, listed, _ = machine
    session = _Session(listed, "2.14.1+cu130 CUDA 13.0")
    with pytest.raises(RuntimeError, match="yet pip installed torch 2.14.1"):
        noxfile._install(session, "-e", ".")
