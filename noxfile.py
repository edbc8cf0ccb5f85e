"""Sessions for local runs and GPU CI. `nox -l` lists them; `nox -t cpu|cuda|rocm` picks a runner's set.

Every session also runs with `--no-venv` on a machine where nothing can be installed (the packages must already be
importable, e.g. with PYTHONPATH=reference): installs are skipped there, everything else is the same.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import nox
from nox.command import CommandFailed

nox.needs_version = ">=2025.2.9"
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests", "layouts"]
nox.options.reuse_venv = "yes"

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml("pyproject.toml")
TEST_DEPS = nox.project.dependency_groups(PYPROJECT, "test")
PYTEST_NO_TESTS = 5


def _install(session: nox.Session, *args: str) -> None:
    """Install into the session's venv; with --no-venv, assume it is all there already."""
    if session.venv_backend != "none":
        session.install(*args)


def _gpu_extra(driver: str | None) -> str:
    """The extra that brings the bindings of ``driver`` (or of the GPU this machine has)."""
    if driver in ("cuda", "hip"):
        return {"cuda": "[cuda]", "hip": "[rocm]"}[driver]
    if shutil.which("nvidia-smi"):
        return "[cuda]"
    if shutil.which("rocminfo") or shutil.which("amd-smi"):
        return "[rocm]"
    return ""


def _run_python(session: nox.Session, *args: str, **kwargs):
    """Run the session's interpreter with the project (and anything already on PYTHONPATH) importable. With
    --no-venv that is the interpreter running nox: a bare "python" may be absent from PATH, or a different interpreter
    than the one the packages are importable from."""
    python = "python" if session.venv_backend != "none" else sys.executable
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "reference"),
                                                         os.environ.get("PYTHONPATH")]))}
    return session.run(python, *args, env=env, **kwargs)


def _pytest(session: nox.Session, *args: str) -> None:
    """Run pytest; a run that collected no tests (exit 5) is an error with its own message, never a pass."""
    try:
        _run_python(session, "-m", "pytest", *args)
    except CommandFailed as exc:
        if getattr(exc, "return_code", None) == PYTEST_NO_TESTS:
            session.error(f"pytest collected no tests (exit {PYTEST_NO_TESTS}) for: {' '.join(args)}")
        raise


# `tests` uses pip (virtualenv): pip honours the machine's own configuration and PIP_* variables (local wheel folders,
# extra indexes, constraints), which is how a CPU build of torch is chosen on GPU-less machines (README, "Set up and
# run"); uv reads none of it.
@nox.session(venv_backend="virtualenv", tags=["cpu"])
def tests(session: nox.Session) -> None:
    """Unit, meta and conformance tests and the benchmark smoke run on the host driver (no GPU needed)."""
    _install(session, "-e", ".[report]", *TEST_DEPS)
    _pytest(session, "conformance", "bench", "integration", "--driver", "host,host-4k", "-n", "2", *session.posargs)


# On a machine without a GPU the main job runs the host driver, installed with pip for the reason given above `tests`.
GPU_MACHINE = bool(_gpu_extra(None))


@nox.session(venv_backend="uv|virtualenv" if GPU_MACHINE else "virtualenv", tags=["cuda", "rocm"])
def conformance(session: nox.Session) -> None:
    """Conformance rules on one driver: `nox -s conformance -- cuda` (default: the best available one), in a
    pytest-xdist worker so a driver that faults fails that rule and the run goes on."""
    args = list(session.posargs)
    driver = args.pop(0) if args and not args[0].startswith("-") else None
    _install(session, "-e", f".{_gpu_extra(driver)}", *TEST_DEPS)
    if driver is None:
        driver = _run_python(session, "-c", "from extensible_kv.drivers import best_available as b; print(b())",
                             silent=True).strip()
    Path("reports/out").mkdir(parents=True, exist_ok=True)
    _pytest(session, "conformance", "--ignore", "conformance/meta", "--ignore", "conformance/unit",
            "--driver", driver, f"--summary-json=reports/out/conformance-{driver}.json", "-n", "1", *args)


@nox.session(venv_backend="uv|virtualenv", tags=["cpu", "cuda", "rocm"])
def layouts(session: nox.Session) -> None:
    """Segment derivation against vLLM 0.26.0's real attention backends and reshape code (CPU is enough)."""
    _install(session, "-e", ".[vllm]", *TEST_DEPS)
    session.env["EXTENSIBLE_KV_REQUIRE_VLLM"] = "1"
    _pytest(session, "integration/test_backend_layouts.py", *session.posargs)


@nox.session(venv_backend="virtualenv")
def stress(session: nox.Session) -> None:
    """The stateful hostile-use rule at 10,000 examples per driver (default: host,host-4k; `-- --driver cuda`)."""
    _install(session, "-e", ".", *TEST_DEPS)
    session.env["EXTENSIBLE_KV_STATEFUL_EXAMPLES"] = "10000"
    _pytest(session, "conformance/test_stateful_use.py", "--driver", "host,host-4k", "-p", "no:cacheprovider",
            *session.posargs)


@nox.session(venv_backend="virtualenv")
def mutation(session: nox.Session) -> None:
    """Mutation testing of the reference core (mutmut) against the rules and unit tests; score and survivors in
    reports/mutation.json (`-- --files tensor.py,granules.py` for a subset). Not part of `tests`: it takes long."""
    _install(session, "-e", ".", *TEST_DEPS, "mutmut>=3.3")
    _run_python(session, "ci/mutation.py", *session.posargs)


@nox.session(tags=["cuda", "rocm"])
def bench(session: nox.Session) -> None:
    """Commit-path benchmarks on the best available driver; JSON in reports/out/, the summary table at the end."""
    _install(session, "-e", f".{_gpu_extra(None)}", *TEST_DEPS)
    Path("reports/out").mkdir(parents=True, exist_ok=True)
    out = "reports/out/bench.json"
    _pytest(session, "bench", "--benchmark-enable", f"--benchmark-json={out}", *session.posargs)


@nox.session(tags=["cuda", "rocm"])
def integration(session: nox.Session) -> None:
    """vLLM 0.26.0 greedy parity, legacy vs extensible KV cache, each case in a fresh process (needs a GPU)."""
    _install(session, "-e", ".[vllm,cuda]", *TEST_DEPS)
    _pytest(session, "integration/test_greedy_parity.py", *session.posargs)


@nox.session(venv_backend="virtualenv", tags=["cpu", "cuda", "rocm"])
def report(session: nox.Session) -> None:
    """Memory-accounting reports (no GPU needed): every run folder in reports/runs/ into reports/<run-name>/, and the
    run CI or a GPU job just made in reports/out/ (the conformance, bench and integration sessions write there), where
    it holds JSON, into reports/latest/.

    `nox -s report -- --compare reports/runs/<baseline>` passes its arguments to every run's report."""
    _install(session, "-e", ".[report]", *TEST_DEPS)
    runs = sorted(p for p in (ROOT / "reports" / "runs").iterdir() if p.is_dir())
    latest = ROOT / "reports" / "out"
    latest = latest if latest.is_dir() and any(latest.rglob("*.json")) else None
    if not runs and latest is None:
        session.error("no run folders under reports/runs/ and no reports/out/")
    for run in runs:
        _run_python(session, "-m", "extensible_kv", "report", str(run.relative_to(ROOT)), *session.posargs)
    if latest is not None:
        _run_python(session, "-m", "extensible_kv", "report", str(latest.relative_to(ROOT)), "--name", "latest",
                    *session.posargs)
