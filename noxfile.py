"""Sessions for local runs and GPU CI. `nox -l` lists them; `nox -t cpu|cuda|rocm` picks a runner's set.

Every session also runs with `--no-venv` on a machine where nothing can be installed (the packages must already be
importable, e.g. with PYTHONPATH=reference): installs are skipped there, everything else is the same.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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
#     On Linux PyPI's torch is a CUDA build of several GB (2.14.1+cu130 with cuda-bindings: 5.5 GB a venv), also on
#     a machine without a GPU, and pip takes it whenever it is the newest torch that pip's sources offer, whatever
#     else they hold (a local CPU wheel of an older release included). So there the sessions that install the
#     project (not layouts, integration and matrix: vLLM pins its own torch) put torch's CPU build in first, from the
#     first of: (1) EXTENSIBLE_KV_TORCH_INDEX=URL, that index alone (set empty: torch is left to pip, knowingly);
#     (2) a constraint file pip reads that pins torch to a `+cpu` release: pip can take nothing else, so torch is
#     left to it (.ci/run: ci/cpu-constraints.txt, whose wheel lies in that machine's find-links); (3) a `+cpu`
#     torch wheel for this Python in a local folder of pip's find-links: that file; (4) PyTorch's CPU index, pip's
#     own sources set aside (its constraint files kept), once it answers. Where none applies (offline, or a machine
#     that reaches PyPI only) the session stops before installing anything with one line that says what to set.
#     The log names the torch build installed; a CUDA build on a machine without a GPU stops the session.
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_INDEX_ENV = "EXTENSIBLE_KV_TORCH_INDEX"
PIP_SOURCE_OPTIONS = ("index-url", "extra-index-url", "find-links", "no-index", "constraint")
"""pip's options that say where packages come from (set aside for the CPU index); the others (cert, proxy, ...)
are kept."""
PYTHON_TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"


@dataclass(frozen=True)
class TorchStep:
    """Where a session takes torch from before the project (Note [torch's CPU build on a machine without a GPU]):
    ``install`` is the `pip install` arguments of the step (empty: torch is left to pip), ``isolated`` whether pip's
    own sources are set aside for it, ``refusal`` the one line a session stops with instead."""

    install: tuple[str, ...]
    why: str
    isolated: bool = False
    refusal: str | None = None


def pip_options(config_list: str, environ: Mapping[str, str]) -> dict[str, str]:
    """pip's settings as pip applies them: ``pip config list`` lines (``install.`` over ``global.``, a later file
    over an earlier one), then the PIP_* variables over both."""
    found: dict[str, tuple[int, str]] = {}
    for line in config_list.splitlines():
        where, _, rest = line.partition(".")
        name, eq, value = rest.partition("=")
        rank = {"global": 1, "install": 2, ":env:": 3}.get(where)
        if eq and rank and rank >= found.get(name, (0, ""))[0]:
            found[name] = (rank, value.strip().strip("'\""))
    options = {name: value for name, (_, value) in found.items()}
    for key, value in environ.items():
        if key.startswith("PIP_") and value and key != "PIP_CONFIG_FILE":
            options[key[4:].lower().replace("_", "-")] = value
    return options


def _cpu_pin(constraints: str) -> str | None:
    """The ``torch==X+cpu`` line of the constraint files ``constraints`` (pip's whitespace-separated list)."""
    for name in constraints.split():
        try:
            lines = Path(name).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            pin = line.split("#")[0].replace(" ", "")
            if pin.lower().startswith("torch==") and pin.endswith("+cpu"):
                return f"{pin} in {name}"
    return None


def _cpu_wheel(find_links: str, python_tag: str = PYTHON_TAG) -> str | None:
    """The newest `+cpu` torch wheel for ``python_tag`` and this machine in a local folder of ``find_links``."""
    from packaging.version import Version  # nox's own dependency

    wheels = []
    for link in find_links.split():
        folder = Path(link.removeprefix("file://"))
        if folder.is_dir():
            wheels += folder.glob(f"torch-*+cpu-{python_tag}-*{platform.machine()}*.whl")
    return str(max(wheels, key=lambda w: Version(w.name.split("-")[1]))) if wheels else None


def _answers(url: str) -> str | None:
    """None where ``url`` answers, else why not (in a few words)."""
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(f"{url}/torch/", method="HEAD"), timeout=20).close()
    except OSError as exc:
        return str(getattr(exc, "reason", exc))
    return None


def torch_step(
    environ: Mapping[str, str],
    gpu: bool,
    options: Mapping[str, str] | None = None,
    answers: Callable[[str], str | None] | None = None,
) -> TorchStep:
    """The step that puts torch in before the project, for pip's settings ``options`` (``pip_options``; default:
    the PIP_* variables of ``environ``): Note [torch's CPU build on a machine without a GPU]."""
    options = pip_options("", environ) if options is None else options
    if TORCH_INDEX_ENV in environ:
        named = environ[TORCH_INDEX_ENV]
        if not named:
            return TorchStep((), f"{TORCH_INDEX_ENV} is set empty: torch is left to pip")
        return TorchStep(
            ("--index-url", named, *_constraint_args(options), "torch"), f"{TORCH_INDEX_ENV} names it", True
        )
    if gpu:
        return TorchStep((), "this machine has a GPU: pip's own torch, a build with its CUDA libraries")
    pin = _cpu_pin(options.get("constraint", ""))
    if pin:
        return TorchStep((), f"no GPU here; pip can take only torch's CPU build ({pin})")
    wheel = _cpu_wheel(options.get("find-links", ""))
    if wheel:
        return TorchStep((wheel,), "no GPU here: the CPU build in pip's find-links")
    reason = (answers or _answers)(CPU_TORCH_INDEX)
    if reason is None:
        why = f"no GPU here: torch's CPU build from {CPU_TORCH_INDEX}, pip's own sources set aside"
        return TorchStep(("--index-url", CPU_TORCH_INDEX, *_constraint_args(options), "torch"), why, True)
    return TorchStep(
        (),
        "",
        refusal=f"no GPU here and no way to torch's CPU build: {CPU_TORCH_INDEX} does not answer ({reason}), no "
        f"constraint pins torch==X+cpu, no +cpu torch wheel for {PYTHON_TAG} in pip's find-links; set "
        f"{TORCH_INDEX_ENV}=URL (an index with CPU builds), or put a torch +cpu wheel in PIP_FIND_LINKS, or "
        f"{TORCH_INDEX_ENV}= to let pip take its own torch (a CUDA build of several GB)",
    )


def _constraint_args(options: Mapping[str, str]) -> list[str]:
    """``-c FILE`` for each constraint file pip reads: a step that sets pip's sources aside keeps its pins."""
    return [arg for name in options.get("constraint", "").split() for arg in ("-c", name)]


def _install(session: nox.Session, *args: str, own_torch: bool = True) -> None:
    """Install into the session's venv (torch's CPU build first where Note [torch's CPU build on a machine without
    a GPU] says so, unless the session's packages pin their own torch); with --no-venv, assume it is all there. The
    log says where torch came from, why, and which build was installed."""
    if session.venv_backend == "none":
        return
    step, listed = TorchStep((), "the packages pin their own torch"), ""
    if own_torch:
        if session.venv_backend != "uv":  # uv reads no pip configuration
            listed = str(session.run_install("python", "-m", "pip", "config", "list", silent=True, log=False) or "")
        step = torch_step(os.environ, GPU_MACHINE, pip_options(listed, os.environ))
        if step.refusal:
            session.error(step.refusal)
    session.log(f"torch: {step.why}")
    if step.install:
        env: dict[str, str | None] = {}
        if step.isolated:  # no configuration file, no PIP_* variable naming a source; the rest (cert, proxy) kept
            env = {_pip_variable(k): v for k, v in pip_options(listed, {}).items() if k not in PIP_SOURCE_OPTIONS}
            env.update({_pip_variable(k): None for k in PIP_SOURCE_OPTIONS}, PIP_CONFIG_FILE=os.devnull)
        session.install(*step.install, env=env)
    session.install(*args)
    build = session.run_install(  # run_install: also with --install-only
        "python", "-c", "import torch; print(torch.__version__, 'CUDA', torch.version.cuda)", silent=True, log=False
    )
    session.log(f"torch installed: {str(build).strip()}")
    if own_torch and not GPU_MACHINE and TORCH_INDEX_ENV not in os.environ and "CUDA None" not in str(build):
        session.error(f"no GPU here, yet pip installed torch {str(build).strip()} ({step.why})")


def _pip_variable(option: str) -> str:
    """The PIP_* variable of pip's option ``option``."""
    return "PIP_" + option.upper().replace("-", "_")


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
        best = _run_python(
            session, "-c", "from extensible_kv.drivers import best_available as b; print(b())", silent=True
        )
        if best is None:  # --install-only: nothing runs
            return
        driver = best.strip()
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
    reshape code and connectors, and a running engine's resize against its real block pool and scheduler (CPU is
    enough)."""
    _install(session, "-e", ".[vllm]", *TEST_DEPS, own_torch=False)
    session.env["EXTENSIBLE_KV_REQUIRE_VLLM"] = "1"
    _pytest(
        session,
        "integration/test_backend_layouts.py",
        "integration/test_connector_views.py",
        "tests/unit/test_vllm_resize.py",
        *session.posargs,
    )


VLLM_RELEASES = ("0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
"""The releases `vllm_versions` reads (reference/extensible_kv/vllm/versions.py holds the table they decide)."""


# Not in the default sessions: each wheel is 240-320 MB (about 2.5 GB together), too much for every CI run.
@nox.session(venv_backend="virtualenv", tags=["vllm-versions"])
def vllm_versions(session: nox.Session) -> None:
    """Each vLLM release's patch points, read from its wheel's source (no import, no GPU), against the version gate;
    then the tensor rules on vLLM 0.34's own ExtensibleTensor over the host driver (`--tensor vllm`). Wheels are
    downloaded once into .nox/vllm-wheels/ (`pip download --no-deps`) and only their .py files unpacked."""
    import zipfile

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
    from conformance.tensors import TENSOR_RULE_FILES

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


@nox.session(venv_backend="virtualenv", tags=["broken-sweep"])
def broken_sweep(session: nox.Session) -> None:
    """Every rule on every broken driver of tests/meta/broken, each driver in a fresh child up to its first failed
    rule; fails naming each driver no rule caught. Not part of `tests` (which runs each driver's own rules): it takes
    minutes a driver. `-- --jobs N`: children at once; `-- tests.meta.broken.map:DoubleMap`: only that driver."""
    _install(session, "-e", ".[conformance]", *TEST_DEPS)
    _run_python(session, "-m", "tests.meta.broken.catch", "--all", *session.posargs)


# pip without a GPU: Note [torch's CPU build on a machine without a GPU] reads pip's configuration.
@nox.session(venv_backend="uv|virtualenv" if GPU_MACHINE else "virtualenv", tags=["cuda", "rocm"])
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
    _install(session, "-e", ".[report]", "-e", "./lab", *TEST_DEPS)
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
