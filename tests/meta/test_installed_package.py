"""The package as users install it, one fresh venv per profile, run from another folder:

- the runtime (``pip install extensible-kv``): torch and numpy only, and no module of the lab (report, measurement
  schema, parity) or of integration/; pytest is not importable, the command line lists its commands without a
  warning, ``check-driver`` says in one line which extra it needs and ``report`` how to install the lab, install
  hints name the index, not a checkout;
- the suite (``pip install 'extensible-kv[conformance]'``): ``extensible-kv check-driver`` passes the rules on
  ``host-4k`` and fails a broken driver, ``pytest -p extensible_kv_conformance.plugin --pyargs
  extensible_kv_conformance`` runs them, no pytest run of another project loads any plugin of this package
  (``--trace-config``), and a checkout's ``pytest conformance`` runs with nothing but the suite's requirements.

The venvs get no network: the wheel is installed with ``--no-deps --no-index``, and its requirements for the profile
(torch and numpy, plus pytest, hypothesis and pytest-xdist for the suite, and theirs) are the ones this
interpreter already has, linked into a folder the venv puts on its path (torch's CPU build stays the one here);
``pip check`` then proves that they satisfy what the wheel declares.
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

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BUILD_INPUTS = ("pyproject.toml", "README.md", "reference", "conformance")
RULES = (
    "test_zero_sets_exactly_the_range or test_reserve_is_aligned_and_not_accessible or test_segments_grow_in_lockstep"
)
SUMMARY = "extensible-kv conformance summary"
TIMEOUT_S = 600
RUNTIME = {"torch", "numpy"}
SUITE = {"pytest", "hypothesis", "pytest-xdist"}
LAB = ("report", "measurement", "parity", "integration", "extensible_kv_lab")  # in no path of the runtime wheel


def _run(cmd: list, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``cmd`` in ``cwd`` with nothing of this checkout or this pytest run in its environment."""
    clean = {
        k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith(("EXTENSIBLE_KV_", "PYTEST_"))
    }
    return subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env={**clean, **env}, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def _output(proc: subprocess.CompletedProcess) -> str:
    return (proc.stdout + proc.stderr)[-4000:]


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout's build inputs, so that building leaves nothing in the checkout itself."""
    src = tmp_path_factory.mktemp("src")
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
            )
        else:
            shutil.copy2(ROOT / name, src / name)
    return src


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory, checkout: Path) -> Path:
    """The wheel pip builds from the checkout, the way a user's ``pip install`` does (isolated build)."""
    out = tmp_path_factory.mktemp("dist")
    proc = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", out, checkout],
        cwd=checkout,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    wheels = sorted(out.glob("extensible_kv-*.whl"))
    assert proc.returncode == 0 and len(wheels) == 1, (
        f"pip wheel: expected exit 0 and one wheel, got exit {proc.returncode}, {wheels}\n{_output(proc)}"
    )
    return wheels[0]


def _requires(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as zf:
        metadata = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return [
            Requirement(line.split(":", 1)[1].strip())
            for line in zf.read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]


def _needed(requires: list[Requirement], extra: str) -> list[str]:
    """Names of the requirements that apply with ``extra`` ('' for none), markers evaluated here."""
    return [r.name for r in requires if r.marker is None or r.marker.evaluate({"extra": extra})]


def _link_requirements(names: list[str], into: Path) -> list[str]:
    """Symlink each distribution ``names`` requires, transitively, from this interpreter's environment into
    ``into``; return the distribution names linked."""
    into.mkdir()
    linked: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        if _key(name) in linked:
            continue
        dist = importlib.metadata.distribution(name)
        linked[_key(name)] = dist
        tops = {f.parts[0] for f in dist.files or () if f.parts[0] not in ("..", "__pycache__")}
        for top in sorted(tops):
            target = Path(dist.locate_file(top))
            if target.exists() and not (into / top).exists():
                (into / top).symlink_to(target)
        todo += _needed([Requirement(line) for line in dist.requires or ()], "")
    return sorted(linked)


def _venv(base: Path, wheel: Path, extra: str) -> Path:
    """A fresh venv with the wheel installed (not editable) and what it requires with ``extra`` linked in."""
    env = base / "env"
    proc = _run([sys.executable, "-m", "venv", "--without-pip", env], cwd=base)
    assert proc.returncode == 0, f"python -m venv: exit {proc.returncode}\n{_output(proc)}"
    python = env / "bin" / "python"
    _link_requirements(_needed(_requires(wheel), extra), base / "requirements")
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=base)
    (Path(purelib.stdout.strip()) / "requirements.pth").write_text(f"{base / 'requirements'}\n")
    pip = [sys.executable, "-m", "pip", "--python", python]
    proc = _run([*pip, "install", "--no-deps", "--no-index", wheel], cwd=base, PIP_DISABLE_PIP_VERSION_CHECK="1")
    assert proc.returncode == 0, f"pip install {wheel.name}: exit {proc.returncode}\n{_output(proc)}"
    proc = _run([*pip, "check"], cwd=base, PIP_DISABLE_PIP_VERSION_CHECK="1")
    assert proc.returncode == 0, f"pip check: the wheel's requirements are not all met\n{_output(proc)}"
    return env


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """``pip install extensible-kv``."""
    return _venv(tmp_path_factory.mktemp("runtime"), wheel, "")


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """``pip install 'extensible-kv[conformance]'``."""
    return _venv(tmp_path_factory.mktemp("suite"), wheel, "conformance")


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A folder outside the checkout, holding a broken driver a backend team might write."""
    (tmp_path / "broken_vmm.py").write_text(
        textwrap.dedent("""
        from extensible_kv.drivers.host import HostDriver

        class NoZero(HostDriver):
            def zero(self, va, size):  # forgets to zero
                pass

        def make():
            return NoZero(granularity=4096, name="no-zero")
    """)
    )
    return tmp_path


def test_the_wheel_is_the_runtime_with_the_suite_as_an_extra_and_no_pytest_plugin(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    reference = ROOT / "reference"
    want = {
        p.relative_to(reference).as_posix()
        for p in (reference / "extensible_kv").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }  # modules and package data
    want |= {
        f"extensible_kv_conformance/{p.relative_to(ROOT / 'conformance').as_posix()}"
        for p in [*(ROOT / "conformance").glob("*.py"), *(ROOT / "conformance" / "plugin").glob("*.py")]
    }
    tests = sorted(
        n
        for n in names
        if n.startswith(
            ("tests/", "extensible_kv_conformance/unit/", "extensible_kv_conformance/meta/", "conformance/")
        )
    )
    entry_points = next(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith("entry_points.txt"))
    requires = _requires(wheel)
    got = {
        "missing": sorted(want - names),
        "modules of the lab or integration": sorted(n for n in names if any(word in n for word in LAB)),
        "tests of the project": tests,
        "pytest11 entry point": "pytest11" in entry_points,
        "console script": "extensible-kv = extensible_kv.__main__:main" in entry_points,
        "runtime requires": sorted({_key(n) for n in _needed(requires, "")}),
        "conformance adds": sorted({_key(n) for n in _needed(requires, "conformance")} - RUNTIME),
        "link from reference/ to the suite": (ROOT / "reference" / "extensible_kv_conformance").exists(),
    }
    want_got = {
        "missing": [],
        "modules of the lab or integration": [],
        "tests of the project": [],
        "pytest11 entry point": False,
        "console script": True,
        "runtime requires": sorted(RUNTIME),
        "conformance adds": sorted(SUITE),
        "link from reference/ to the suite": False,
    }
    assert got == want_got, f"{wheel.name}: expected {want_got}, got {got}"


def test_the_runtime_alone_has_no_pytest_and_its_commands_say_what_they_need(runtime: Path, elsewhere: Path):
    bin_ = runtime / "bin"
    pytest_import = _run([bin_ / "python", "-c", "import pytest"], cwd=elsewhere)
    listing = _run([bin_ / "python", "-m", "extensible_kv"], cwd=elsewhere)
    usage = _run([bin_ / "extensible-kv", "--help"], cwd=elsewhere)
    drivers = _run([bin_ / "extensible-kv", "drivers"], cwd=elsewhere)
    check = _run([bin_ / "extensible-kv", "check-driver", "host"], cwd=elsewhere)
    report = _run([bin_ / "extensible-kv", "report", "."], cwd=elsewhere)
    got = {
        "import pytest fails": pytest_import.returncode != 0 and "No module named 'pytest'" in pytest_import.stderr,
        "no command: exit, commands listed, stderr": (
            listing.returncode,
            "check-driver" in listing.stdout,
            listing.stderr,
        ),
        "--help names": usage.stdout.split(" [")[0],
        "drivers: exit, host available, hint from the index": (
            drivers.returncode,
            "host       available" in drivers.stdout,
            "(pip install 'extensible-kv[cuda]')" in drivers.stdout and "-e " not in drivers.stdout,
        ),
        "check-driver: exit, stderr lines, names the extra": (
            check.returncode,
            len(check.stderr.splitlines()),
            "pip install 'extensible-kv[conformance]'" in check.stderr,
        ),
        "report: exit, stderr lines, how to install the lab": (
            report.returncode,
            len(report.stderr.splitlines()),
            "pip install ./lab from a checkout" in report.stderr,
        ),
    }
    want = {
        "import pytest fails": True,
        "no command: exit, commands listed, stderr": (2, True, ""),
        "--help names": "usage: extensible-kv",
        "drivers: exit, host available, hint from the index": (0, True, True),
        "check-driver: exit, stderr lines, names the extra": (2, 1, True),
        "report: exit, stderr lines, how to install the lab": (2, 1, True),
    }
    assert got == want, (
        f"the runtime profile: expected {want}, got {got}\n{_output(listing)}\n{_output(drivers)}\n{_output(check)}"
    )


def test_no_pytest_run_of_another_project_loads_a_plugin_of_the_package(suite: Path, elsewhere: Path):
    (elsewhere / "test_theirs.py").write_text("def test_theirs():\n    pass\n")
    proc = _run(
        [suite / "bin" / "python", "-m", "pytest", "--trace-config", "-p", "no:cacheprovider", "test_theirs.py"],
        cwd=elsewhere,
    )
    registered = [line for line in proc.stdout.splitlines() if "registered" in line or line.startswith("PLUGIN")]
    ours = [line for line in registered if "extensible" in line]
    got = (proc.returncode, bool(registered), ours)
    assert got == (0, True, []), (
        f"pytest --trace-config in another project with the suite installed: expected "
        f"(exit 0, plugins listed, none of this package), got {got}\n{_output(proc)}"
    )


def test_check_driver_from_the_installed_package_passes_the_rules_on_host_4k(suite: Path, elsewhere: Path):
    summary = elsewhere / "out" / "conformance-host-4k.json"
    proc = _run(
        [suite / "bin" / "extensible-kv", "check-driver", "host-4k", "-k", RULES, "-v", f"--summary-json={summary}"],
        cwd=elsewhere,
    )
    out = _output(proc)
    got = (
        proc.returncode,
        "3 passed" in out,
        out.count(SUMMARY),
        "site-packages/extensible_kv_conformance/test_driver_contract.py::test_zero_sets_exactly_the_range" in out,
        summary.is_file() and '"passed": 3' in summary.read_text(),
    )
    assert got == (0, True, 1, True, True), (
        f"extensible-kv check-driver host-4k: expected (exit 0, 3 passed, one "
        f"summary, the installed rules, the summary JSON), got {got}\n{out}"
    )


def test_check_driver_from_the_installed_package_fails_a_broken_driver(suite: Path, elsewhere: Path):
    proc = _run(
        [suite / "bin" / "extensible-kv", "check-driver", "broken_vmm:make", "-k", RULES],
        cwd=elsewhere,
        PYTHONPATH=str(elsewhere),
    )
    out = _output(proc)
    got = (proc.returncode, "test_zero_sets_exactly_the_range" in out and "FAILED" in out, "2 passed" in out)
    assert got == (1, True, True), (
        f"extensible-kv check-driver broken_vmm:make: expected (exit 1, the zero rule "
        f"failed, 2 passed), got {got}\n{out}"
    )


def test_pytest_runs_the_installed_rules_from_any_folder_when_named(suite: Path, elsewhere: Path):
    proc = _run(
        [
            suite / "bin" / "python",
            "-m",
            "pytest",
            "-p",
            "extensible_kv_conformance.plugin",
            "--pyargs",
            "extensible_kv_conformance",
            "--driver",
            "host-4k",
            "-k",
            RULES,
            "-p",
            "no:cacheprovider",
            "--strict-markers",
        ],
        cwd=elsewhere,
    )
    out = _output(proc)
    got = (proc.returncode, "3 passed" in out, out.count(SUMMARY), "driver host-4k: available" in out)
    assert got == (0, True, 1, True), (
        f"pytest -p extensible_kv_conformance.plugin --pyargs extensible_kv_conformance --driver host-4k: expected "
        f"(exit 0, 3 passed, one summary, the driver in the header), got {got}\n{out}"
    )


def test_a_checkouts_rules_run_with_plain_pytest_and_only_the_suites_requirements(suite: Path, checkout: Path):
    # The checkout's own pytest settings (pyproject.toml) apply: they must not need pytest-benchmark or anything
    # else the suite does not bring; the rules' conftest registers the checkout's plugin.
    proc = _run(
        [
            suite / "bin" / "python",
            "-m",
            "pytest",
            "conformance",
            "--driver",
            "host-4k",
            "-k",
            RULES,
            "-v",
            "-p",
            "no:cacheprovider",
        ],
        cwd=checkout,
    )
    out = _output(proc)
    got = (
        proc.returncode,
        "3 passed" in out,
        out.count(SUMMARY),
        "conformance/test_driver_contract.py::test_zero_sets_exactly_the_range[host-4k] PASSED" in out,
    )
    assert got == (0, True, 1, True), (
        f"pytest conformance --driver host-4k in a checkout, the suite installed: "
        f"expected (exit 0, 3 passed, one summary, the checkout's rules), got "
        f"{got}\n{out}"
    )
