"""Sessions for local runs and GPU CI. `nox -l` lists them; `nox -t cpu|cuda|rocm` picks a runner's set.

Every session also runs with `--no-venv` on a machine where nothing can be installed (the packages must already be
importable, e.g. with PYTHONPATH=reference): installs are skipped there, everything else is the same.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

import nox
from nox.command import CommandFailed

nox.needs_version = ">=2025.2.9"
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["lint", "tests", "layouts"]
nox.options.reuse_venv = "yes"

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
TEST_DEPS = nox.project.dependency_groups(PYPROJECT, "test")
PYTEST_NO_TESTS = 5

# Note [torch's CPU build on a machine without a GPU]
#     On Linux PyPI's torch is a CUDA build of several GB, also on a machine without a GPU. There the sessions that
#     install the project (all but layouts and integration, whose vLLM pins its own torch) first install torch from
#     PyTorch's CPU index, about a tenth of that, unless the machine already says where pip finds packages: a
#     constraint file (as .ci/run pins the CPU wheel its CI machine keeps on disk: that machine reaches PyPI only),
#     an index or find-links of its own (PIP_CONSTRAINT, PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS,
#     PIP_NO_INDEX). EXTENSIBLE_KV_TORCH_INDEX names another index for torch; set empty, it turns the step off.
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_INDEX_ENV = "EXTENSIBLE_KV_TORCH_INDEX"
PIP_SOURCES = ("PIP_CONSTRAINT", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX")


def torch_source(environ: Mapping[str, str], gpu: bool) -> tuple[str | None, str]:
    """The index the sessions install torch from before the project (None: torch is left to pip's own
    configuration), and why, in words for the session's log: Note [torch's CPU build on a machine without a GPU]."""
    if TORCH_INDEX_ENV in environ:
        named = environ[TORCH_INDEX_ENV]
        return (named, f"{TORCH_INDEX_ENV} names it") if named else (None, f"{TORCH_INDEX_ENV} is set empty")
    if gpu:
        return None, "this machine has a GPU: pip's own torch, a build with its CUDA libraries"
    sources = [name for name in PIP_SOURCES if environ.get(name)]
    if sources:
        return None, f"this machine names its own pip sources ({', '.join(sources)})"
    return CPU_TORCH_INDEX, f"no GPU here: torch's CPU build ({TORCH_INDEX_ENV}= to leave torch to pip)"


def torch_index(environ: Mapping[str, str], gpu: bool) -> str | None:
    """The index of ``torch_source``."""
    return torch_source(environ, gpu)[0]


def _install(session: nox.Session, *args: str, own_torch: bool = True) -> None:
    """Install into the session's venv (torch's CPU build first where Note [torch's CPU build on a machine without
    a GPU] says so, unless the session's packages pin their own torch); with --no-venv, assume it is all there. The
    log says where torch came from, why, and which build was installed."""
    if session.venv_backend == "none":
        return
    index, why = torch_source(os.environ, GPU_MACHINE) if own_torch else (None, "the packages pin their own torch")
    session.log(f"torch from {index or 'pip'}: {why}")
    if index:
        session.install("--index-url", index, "torch")
    session.install(*args)
    build = session.run(
        "python", "-c", "import torch; print(torch.__version__, 'CUDA', torch.version.cuda)", silent=True, log=False
    )
    session.log(f"torch installed: {str(build).strip()}")


def _extras(*names: str) -> str:
    """``[a,b]`` of the extras ``names`` (each a name or ``[name]``, empty ones left out)."""
    kept = [n.strip("[]") for n in names if n.strip("[]")]
    return f"[{','.join(kept)}]" if kept else ""


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
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "reference"), os.environ.get("PYTHONPATH")]))
    }
    return session.run(python, *args, env=env, **kwargs)


def _pytest(session: nox.Session, *args: str, module: tuple[str, ...] = ("pytest",)) -> None:
    """Run pytest (or ``module``, which ends in a pytest run and exits with its status); a run that collected no
    tests (exit 5) is an error with its own message, never a pass."""
    try:
        _run_python(session, "-m", *module, *args)
    except CommandFailed as exc:
        if getattr(exc, "return_code", None) == PYTEST_NO_TESTS:
            session.error(f"pytest collected no tests (exit {PYTEST_NO_TESTS}) for: {' '.join(args)}")
        raise


GPU_MACHINE = bool(_gpu_extra(None))


# `tests` uses pip (virtualenv): pip honours the machine's own configuration and PIP_* variables (local wheel folders,
# extra indexes, constraints), which .ci/run uses to pin the CPU build of torch its machine keeps on disk; uv reads
# none of it.
@nox.session(venv_backend="virtualenv", tags=["cpu"])
def tests(session: nox.Session) -> None:
    """Rules on host and host-4k, unit and meta tests (the wheel too), bench smoke, integration's CPU parts."""
    _install(session, "-e", ".[conformance,report]", "-e", "./lab", *TEST_DEPS)
    # bench/ runs here as a smoke test (each benchmark once, untimed); `nox -s bench` times them.
    _pytest(
        session,
        "conformance",
        "tests",
        "bench",
        "integration",
        "--driver",
        "host,host-4k",
        "-n",
        "2",
        "--benchmark-disable",
        *session.posargs,
    )


# On a machine without a GPU the main job runs the host driver, installed with pip for the reason given above `tests`.
@nox.session(venv_backend="uv|virtualenv" if GPU_MACHINE else "virtualenv", tags=["cuda", "rocm"])
def conformance(session: nox.Session) -> None:
    """Conformance rules on one driver: `nox -s conformance -- cuda` (default: the best available one), through
    `extensible-kv check-driver` (a pytest-xdist worker: a driver that faults fails that rule and the run goes on)."""
    args = list(session.posargs)
    driver = args.pop(0) if args and not args[0].startswith("-") else None
    _install(session, "-e", f".{_extras('conformance', _gpu_extra(driver))}", *TEST_DEPS)
    if driver is None:
        driver = _run_python(
            session, "-c", "from extensible_kv.drivers import best_available as b; print(b())", silent=True
        ).strip()
    Path("reports/out").mkdir(parents=True, exist_ok=True)
    _pytest(
        session,
        driver,
        f"--summary-json=reports/out/conformance-{driver}.json",
        *args,
        module=("extensible_kv", "check-driver"),
    )


@nox.session(venv_backend="uv|virtualenv", tags=["cpu", "cuda", "rocm"])
def layouts(session: nox.Session) -> None:
    """Segment derivation and the views a KV connector is handed, against vLLM 0.26.0's real attention backends,
    reshape code and connectors (CPU is enough)."""
    _install(session, "-e", ".[vllm]", *TEST_DEPS, own_torch=False)
    session.env["EXTENSIBLE_KV_REQUIRE_VLLM"] = "1"
    _pytest(session, "integration/test_backend_layouts.py", "integration/test_connector_views.py", *session.posargs)


VLLM_RELEASES = ("0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
"""The releases `vllm_versions` reads (reference/extensible_kv/vllm/versions.py holds the table they decide)."""


# Not in the default sessions: each wheel is 240-320 MB (about 2.5 GB together), too much for every CI run.
@nox.session(venv_backend="virtualenv", tags=["vllm-versions"])
def vllm_versions(session: nox.Session) -> None:
    """Each vLLM release's patch points, read from its wheel's source (no import, no GPU), against the version gate;
    then the tensor rules on vLLM 0.34's own ExtensibleTensor over the host driver (`--tensor vllm`). Wheels are
    downloaded once into .nox/vllm-wheels/ (`pip download --no-deps`) and only their .py files unpacked."""
    import zipfile  # noqa: PLC0415

    _install(session, "-e", ".[conformance]", *TEST_DEPS)
    wheels = ROOT / ".nox" / "vllm-wheels"
    sources = ROOT / ".nox" / "vllm-sources"
    wheels.mkdir(parents=True, exist_ok=True)
    for version in VLLM_RELEASES:
        target = sources / version
        if (target / "vllm" / "__init__.py").is_file():
            continue
        found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
        if not found:
            session.run("python", "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"vllm=={version}",
                        "-d", str(wheels))  # fmt: skip
            found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
        with zipfile.ZipFile(found[0]) as wheel:
            wheel.extractall(target, [n for n in wheel.namelist() if n.startswith("vllm/") and n.endswith(".py")])
    session.env["EXTENSIBLE_KV_VLLM_SOURCES"] = str(sources)
    _pytest(session, "tests/unit/test_vllm_versions.py", "tests/unit/test_vllm_driver.py", *session.posargs)
    from conformance.tensors import TENSOR_RULE_FILES  # noqa: PLC0415

    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(sources / "0.34.0"), before]))  # _run_python reads it
    try:
        # Rules vLLM's class fails are findings (reports/runs/*-vllm-native/), not a failure of this session.
        _run_python(
            session, "-m", "pytest", *(f"conformance/{name}" for name in TENSOR_RULE_FILES), "--driver", "host",
            "--tensor", "vllm", "--rule-timeout", "120", "-p", "xdist", "-n", "1", success_codes=[0, 1],
        )  # fmt: skip
    finally:
        os.environ.pop("PYTHONPATH") if before is None else os.environ.__setitem__("PYTHONPATH", before)


@nox.session(venv_backend="virtualenv")
def stress(session: nox.Session) -> None:
    """The stateful rules at stress size: hostile use at 10,000 examples, the protocol model at 2,000 per machine
    (default: host,host-4k; `-- --driver cuda`)."""
    _install(session, "-e", ".[conformance]", *TEST_DEPS)
    session.env["EXTENSIBLE_KV_STATEFUL_EXAMPLES"] = "10000"
    session.env["EXTENSIBLE_KV_PROTOCOL_EXAMPLES"] = "2000"
    _pytest(
        session,
        "conformance/test_stateful_use.py",
        "conformance/test_protocol_model.py",
        "--driver",
        "host,host-4k",
        "-p",
        "no:cacheprovider",
        *session.posargs,
    )


@nox.session(venv_backend="virtualenv")
def mutation(session: nox.Session) -> None:
    """Mutation testing of the reference core (mutmut) against the rules and unit tests; score and survivors in
    reports/mutation.json (`-- --files tensor.py,granules.py` for a subset). Not part of `tests`: it takes long."""
    _install(session, "-e", ".[conformance]", *TEST_DEPS, "mutmut>=3.8")
    _run_python(session, "ci/mutation.py", *session.posargs)


@nox.session(tags=["cuda", "rocm"])
def bench(session: nox.Session) -> None:
    """Commit-path benchmarks on the best available driver; JSON in reports/out/, the summary table at the end."""
    _install(session, "-e", f".{_extras('conformance', _gpu_extra(None))}", *TEST_DEPS)
    Path("reports/out").mkdir(parents=True, exist_ok=True)
    out = "reports/out/bench.json"
    _pytest(session, "bench", "--benchmark-enable", f"--benchmark-json={out}", *session.posargs)


@nox.session(tags=["cuda", "rocm"])
def integration(session: nox.Session) -> None:
    """vLLM 0.26.0 greedy parity, legacy vs extensible KV cache, each case in a fresh process (needs a GPU)."""
    _install(session, "-e", ".[vllm,cuda]", *TEST_DEPS, own_torch=False)
    _pytest(session, "integration/test_greedy_parity.py", *session.posargs)


@nox.session(tags=["cuda", "rocm"])
def matrix(session: nox.Session) -> None:
    """The vLLM parity matrix (``integration/matrix.py``: determinism control, measured peak, block sizes, KV dtypes,
    sliding window, the multimodal encoder cache, speculative decoding, the 8B shape, decode throughput) into
    reports/out/ (cases in integration/, the report reads them as they are), resumably (needs a GPU; about 110 min in
    all). Arguments go to the matrix: `nox -s matrix -- --only qwen --budget-seconds 540` runs a part and can be
    repeated until every case has run."""
    _install(session, "-e", ".[vllm,cuda]", *TEST_DEPS, own_torch=False)
    _run_python(session, "-m", "integration.matrix", str(Path("reports") / "out"), *session.posargs)


@nox.session(venv_backend="uv|virtualenv", tags=["cpu"])
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check with the settings in pyproject.toml (line length 120; the one-line locked
    sections the formatter leaves alone are explained there), then mypy on the runtime package (`[tool.mypy]`: in a
    venv of mypy alone, torch and vLLM are Any). ruff and mypy are pinned: their verdicts change between releases."""
    if session.venv_backend != "none":
        session.install("ruff==0.17.6", "mypy==2.4.1")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")


@nox.session(venv_backend="virtualenv", tags=["cpu", "cuda", "rocm"])
def report(session: nox.Session) -> None:
    """Memory-accounting reports (no GPU needed): every run folder in reports/runs/ into reports/rendered/<run-name>/,
    and the run CI or a GPU job just made in reports/out/ (the conformance, bench and integration sessions write
    there), where it holds JSON, into reports/rendered/latest/. git ignores reports/rendered/: the checkout stays
    clean.

    `nox -s report -- ARGS` passes ARGS to every run's report."""
    _install(session, "-e", ".[report]", *TEST_DEPS)
    runs = sorted(p for p in (ROOT / "reports" / "runs").iterdir() if p.is_dir())
    latest = ROOT / "reports" / "out"
    measured = (
        "conformance-*.json",
        "bench*.json",
        "validate-backend*.json",
        "serving-*.json",
        "integration/**/*.json",
        "sleep/summary.json",
        "connectors/summary.json",
    )
    latest = latest if latest.is_dir() and any(any(latest.glob(p)) for p in measured) else None
    if not runs and latest is None:
        session.error("no run folders under reports/runs/ and no reports/out/")
    for run in runs:
        _run_python(session, "-m", "extensible_kv", "report", str(run.relative_to(ROOT)), *session.posargs)
    if latest is not None:
        _run_python(
            session,
            "-m",
            "extensible_kv",
            "report",
            str(latest.relative_to(ROOT)),
            "--name",
            "latest",
            *session.posargs,
        )
