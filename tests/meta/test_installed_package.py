"""The suite as an installed product: the wheel holds the reference package and the rules, and none of the project's
own tests; installed (not editable) into a fresh venv and run from another folder, ``extensible-kv check-driver`` and
``pytest --pyargs extensible_kv_conformance`` pass the rules on ``host-4k`` and fail a broken driver; a checkout's
rules run beside the installed plugin with its hooks once; and the build leaves no metadata on a checkout's path.

The venv gets no network: the wheel is installed with ``--no-deps --no-index``, and its requirements (torch, pytest,
hypothesis, pytest-xdist and theirs) are the ones this interpreter already has, linked into a folder the venv puts on
its path; ``pip check`` then proves that they satisfy what the wheel declares.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from conformance import rule_paths

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BUILD_INPUTS = ("pyproject.toml", "README.md", "reference", "conformance")
RULES = ("test_zero_sets_exactly_the_range or test_reserve_is_aligned_and_not_accessible or "
         "test_segments_grow_in_lockstep")
SUMMARY = "extensible-kv conformance summary"
TIMEOUT_S = 600


def _run(cmd: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``cmd`` in ``cwd`` with nothing of this checkout or this pytest run in its environment."""
    clean = {k: v for k, v in os.environ.items()
             if k != "PYTHONPATH" and not k.startswith(("EXTENSIBLE_KV_", "PYTEST_"))}
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env={**clean, **env}, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def _output(proc: subprocess.CompletedProcess) -> str:
    return (proc.stdout + proc.stderr)[-4000:]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout's build inputs, so that building leaves nothing in the checkout itself."""
    src = tmp_path_factory.mktemp("src")
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, src / name)
    return src


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory, checkout: Path) -> Path:
    """The wheel pip builds from the checkout, the way a user's ``pip install`` does (isolated build)."""
    out = tmp_path_factory.mktemp("dist")
    proc = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", out, checkout], cwd=checkout,
                PIP_DISABLE_PIP_VERSION_CHECK="1")
    wheels = sorted(out.glob("extensible_kv-*.whl"))
    assert proc.returncode == 0 and len(wheels) == 1, \
        f"pip wheel: expected exit 0 and one wheel, got exit {proc.returncode}, {wheels}\n{_output(proc)}"
    return wheels[0]


def _requirements(dist: importlib.metadata.Distribution) -> list[str]:
    """Names of what ``dist`` requires, extras left out, markers evaluated here."""
    names = []
    for line in dist.requires or ():
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.append(req.name)
    return names


def _link_requirements(names: list[str], into: Path) -> list[str]:
    """Symlink each distribution ``names`` requires, transitively, from this interpreter's environment into
    ``into``; return the distribution names linked."""
    into.mkdir()
    linked: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in linked:
            continue
        dist = importlib.metadata.distribution(name)
        linked[key] = dist
        tops = {f.parts[0] for f in dist.files or () if f.parts[0] not in ("..", "__pycache__")}
        for top in sorted(tops):
            target = Path(dist.locate_file(top))
            if target.exists() and not (into / top).exists():
                (into / top).symlink_to(target)
        todo += _requirements(dist)
    return sorted(linked)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """A fresh venv with the wheel installed (not editable) and its requirements linked in."""
    base = tmp_path_factory.mktemp("venv")
    env = base / "env"
    proc = _run([sys.executable, "-m", "venv", "--without-pip", env], cwd=base)
    assert proc.returncode == 0, f"python -m venv: exit {proc.returncode}\n{_output(proc)}"
    python = env / "bin" / "python"
    with zipfile.ZipFile(wheel) as zf:
        metadata = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        requires = [Requirement(line.split(":", 1)[1].strip()) for line in zf.read(metadata).decode().splitlines()
                    if line.startswith("Requires-Dist:")]
    names = [r.name for r in requires if r.marker is None or r.marker.evaluate({"extra": ""})]
    # numpy too, which the wheel does not need: torch warns on import without it, and the checkout's ini
    # (filterwarnings = error) would make that warning an error where a checkout's rules run in this venv.
    _link_requirements([*names, "numpy"], base / "requirements")
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=base)
    (Path(purelib.stdout.strip()) / "requirements.pth").write_text(f"{base / 'requirements'}\n")
    pip = [sys.executable, "-m", "pip", "--python", python]
    proc = _run([*pip, "install", "--no-deps", "--no-index", wheel], cwd=base, PIP_DISABLE_PIP_VERSION_CHECK="1")
    assert proc.returncode == 0, f"pip install {wheel.name}: exit {proc.returncode}\n{_output(proc)}"
    proc = _run([*pip, "check"], cwd=base, PIP_DISABLE_PIP_VERSION_CHECK="1")
    assert proc.returncode == 0, f"pip check: the wheel's requirements are not all met\n{_output(proc)}"
    return env


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A folder outside the checkout, holding a broken driver a backend team might write."""
    (tmp_path / "broken_vmm.py").write_text(textwrap.dedent("""
        from extensible_kv.drivers.host import HostDriver

        class NoZero(HostDriver):
            def zero(self, va, size):  # forgets to zero
                pass

        def make():
            return NoZero(granularity=4096, name="no-zero")
    """))
    return tmp_path


def test_the_wheel_holds_the_reference_and_the_rules_and_no_tests_of_the_project(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    reference = ROOT / "reference"
    want = {p.relative_to(reference).as_posix() for p in (reference / "extensible_kv").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}  # modules and package data (the report's templates)
    want |= {f"extensible_kv_conformance/{p.relative_to(ROOT / 'conformance').as_posix()}"
             for p in [*(ROOT / "conformance").glob("*.py"), *(ROOT / "conformance" / "plugin").glob("*.py")]}
    missing = sorted(want - names)
    tests = sorted(n for n in names if n.startswith(("tests/", "extensible_kv_conformance/unit/",
                                                     "extensible_kv_conformance/meta/", "conformance/")))
    entry_points = next(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith("entry_points.txt"))
    got = {"missing": missing, "tests of the project": tests,
           "pytest11 entry point": "extensible_kv_conformance = extensible_kv_conformance.plugin" in entry_points,
           "console script": "extensible-kv = extensible_kv.__main__:main" in entry_points}
    want_got = {"missing": [], "tests of the project": [], "pytest11 entry point": True, "console script": True}
    assert got == want_got, f"{wheel.name}: expected {want_got}, got {got}"


def test_check_driver_from_the_installed_package_passes_the_rules_on_host_4k(venv: Path, elsewhere: Path):
    summary = elsewhere / "out" / "conformance-host-4k.json"
    proc = _run([venv / "bin" / "extensible-kv", "check-driver", "host-4k", "-k", RULES, "-v",
                 f"--summary-json={summary}"], cwd=elsewhere)
    out = _output(proc)
    got = (proc.returncode, "3 passed" in out, out.count(SUMMARY),
           "site-packages/extensible_kv_conformance/test_driver_contract.py::test_zero_sets_exactly_the_range" in out,
           summary.is_file() and '"passed": 3' in summary.read_text())
    assert got == (0, True, 1, True, True), f"extensible-kv check-driver host-4k: expected (exit 0, 3 passed, one " \
                                            f"summary, the installed rules, the summary JSON), got {got}\n{out}"


def test_check_driver_from_the_installed_package_fails_a_broken_driver(venv: Path, elsewhere: Path):
    proc = _run([venv / "bin" / "extensible-kv", "check-driver", "broken_vmm:make", "-k", RULES], cwd=elsewhere,
                PYTHONPATH=str(elsewhere))
    out = _output(proc)
    got = (proc.returncode, "test_zero_sets_exactly_the_range" in out and "FAILED" in out, "2 passed" in out)
    assert got == (1, True, True), f"extensible-kv check-driver broken_vmm:make: expected (exit 1, the zero rule " \
                                   f"failed, 2 passed), got {got}\n{out}"


def test_the_pytest_plugin_runs_the_installed_rules_from_any_folder(venv: Path, elsewhere: Path):
    proc = _run([venv / "bin" / "python", "-m", "pytest", "--pyargs", "extensible_kv_conformance", "--driver",
                 "host-4k", "-k", RULES, "-p", "no:cacheprovider", "--strict-markers"], cwd=elsewhere)
    out = _output(proc)
    got = (proc.returncode, "3 passed" in out, out.count(SUMMARY), "driver host-4k: available" in out)
    assert got == (0, True, 1, True), \
        f"pytest --pyargs extensible_kv_conformance --driver host-4k: expected (exit 0, 3 passed, one summary, the " \
        f"driver in the header), got {got}\n{out}"


def test_a_checkouts_rules_beside_the_installed_plugin_run_once(venv: Path, elsewhere: Path):
    # The checkout's conftest finds the installed plugin registered and leaves it at that: one set of hooks.
    proc = _run([venv / "bin" / "python", "-m", "pytest", *rule_paths(), "--driver", "host-4k", "-k", RULES, "-v",
                 "-p", "no:cacheprovider", "-o", "addopts="], cwd=elsewhere)
    out = _output(proc)
    got = (proc.returncode, "3 passed" in out, out.count(SUMMARY),
           "conformance/test_driver_contract.py::test_zero_sets_exactly_the_range[host-4k] PASSED" in out)
    assert got == (0, True, 1, True), f"pytest {' '.join(rule_paths())} with the package installed: expected (exit 0, " \
                                      f"3 passed, one summary, the checkout's rules), got {got}\n{out}"


def test_a_built_checkout_runs_its_rules_with_the_builds_metadata_on_its_path(checkout: Path, wheel: Path):
    # A build leaves its metadata, pytest11 entry point included, in reference/: on the PYTHONPATH of a checkout's
    # runs (reference:.), where the entry point's extensible_kv_conformance must resolve (reference/ links it to
    # conformance/) and the rules' conftest must leave the plugin it loads at that.
    metadata = sorted(p.name for p in (checkout / "reference").glob("*.egg-info"))
    proc = _run([sys.executable, "-m", "pytest", "conformance", "--driver", "host-4k",
                 "-k", RULES, "-p", "no:cacheprovider"], cwd=checkout,
                PYTHONPATH=os.pathsep.join([str(checkout / "reference"), str(checkout)]))
    out = _output(proc)
    got = (metadata, proc.returncode, "3 passed" in out, out.count(SUMMARY))
    assert got == (["extensible_kv.egg-info"], 0, True, 1), \
        f"pytest conformance in a built checkout: expected (the build's metadata in reference/, exit 0, 3 passed, " \
        f"one summary), got {got}\n{out}"
