"""A run folder (``reports/runs/<run>/`` or ``reports/out/``) read through ``extensible_kv.measurements``.

Every file is optional: ``conformance-*.json``, ``bench*.json`` (pytest-benchmark), ``validate-backend*.json``,
``integration/**/*.json`` and ``environment.json`` (top level and beside the cases). What a run lacks is listed in
``Run.missing`` and reads "not measured"; a file that is there but not in its format is a ``BadFile``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..measurements import (BackendValidation, BenchmarkFile, ConformanceSummary, Environment, IntegrationCase,
                            RuleOutcome, read)
from .benchmarks import Bench
from .numbers import number

# The environment items in report order, with their names in the report.
ENVIRONMENT_NAMES = {"gpu": "GPU", "gpu_memory": "GPU memory", "gpu_driver": "GPU driver", "torch": "torch",
                     "cuda": "CUDA", "hip": "HIP", "cuda-bindings": "cuda-bindings", "vllm": "vllm",
                     "granularity": "VMM granularity", "date": "date", "python": "python", "platform": "platform",
                     "cpu": "CPU"}


class RunFolderError(Exception):
    """The run folder does not exist or is not a folder."""


def rule(t: RuleOutcome) -> str:
    """A test without its parameters and folder: ``test_kv_cache.py::test_ensure_blocks_...``."""
    return t.test.split("[", 1)[0].rsplit("/", 1)[-1]


@dataclass(frozen=True)
class Conformance:
    source: str
    data: ConformanceSummary


@dataclass(frozen=True)
class Backends:
    source: str
    data: BackendValidation


@dataclass(frozen=True)
class Case:
    """One vLLM case; ``path`` is relative to the run's ``integration/`` folder."""

    path: str
    data: IntegrationCase

    @property
    def spec(self):
        return self.data.case

    @property
    def group(self) -> tuple[str, str, str]:
        return (self.spec.model, self.spec.runner, self.spec.backend)

    @property
    def folder(self) -> str:
        return self.path.rpartition("/")[0]

    @property
    def mode(self) -> str:
        return self.spec.mode

    @property
    def corrupt(self) -> bool:
        return self.spec.corrupt

    @property
    def variant(self) -> str:
        return self.mode + ("+corrupt" if self.corrupt else "")

    @property
    def key(self) -> str:
        """How a comparison matches cases between runs: model/runner/backend/mode[+corrupt]."""
        return "/".join((*self.group, self.variant))

    @property
    def label(self) -> str:
        """Short and unique within a run: ``tiny-llama v1 FLASH_ATTN extensible+corrupt (call2)``."""
        return " ".join((*self.group, self.variant)) + (f" ({self.folder})" if self.folder else "")


@dataclass
class Run:
    name: str
    path: Path
    conformance: list[Conformance]
    bench: list[Bench]
    cases: list[Case]
    backends: list[Backends]
    environment: dict[str, tuple[str | None, str | None]]  # item -> (value, the file it came from)
    missing: list[str]

    @property
    def measured(self) -> bool:
        return bool(self.conformance or self.bench or self.cases or self.backends)


def load_run(path: str | Path, name: str | None = None) -> Run:
    folder = Path(path)
    if not folder.is_dir():
        raise RunFolderError(f"run folder {str(folder)!r} does not exist or is not a folder")
    integration = folder / "integration"
    case_files = sorted(p for p in integration.rglob("*.json") if p.name != "environment.json")
    run = Run(name or folder.resolve().name, folder,
              [Conformance(p.name, read(p, ConformanceSummary)) for p in sorted(folder.glob("conformance-*.json"))],
              [Bench.load(p) for p in sorted(folder.glob("bench*.json"))],
              [Case(p.relative_to(integration).as_posix(), read(p, IntegrationCase)) for p in case_files],
              [Backends(p.name, read(p, BackendValidation)) for p in sorted(folder.glob("validate-backend*.json"))],
              {}, [])
    for found, what, files in ((run.conformance, "conformance", "conformance-*.json"),
                               (run.bench, "benchmarks", "bench*.json"),
                               (run.cases, "vLLM integration", "integration/**/*.json"),
                               (run.backends, "backend validation", "validate-backend*.json")):
        if not found:
            run.missing.append(f"{what}: no {files} in the run folder")
    envs = [p for p in [folder / "environment.json", *sorted(integration.rglob("environment.json"))] if p.is_file()]
    run.environment = environment(run, [(p.relative_to(folder).as_posix(), read(p, Environment)) for p in envs])
    return run


def environment(run: Run, files: list[tuple[str, Environment]]) -> dict[str, tuple[str | None, str | None]]:
    """Each item from the first file that records it: ``environment.json`` files, then the benchmark JSON's
    ``machine_info``, then what the measurement files record on the side."""
    found: dict[str, tuple[str, str]] = {}

    def put(key: str, value: object, source: str) -> None:
        if key not in found and value not in (None, ""):
            found[key] = (str(value), source)

    files = files + [(b.source, b.data.machine_info.environment) for b in run.bench if b.data.machine_info.environment]
    for source, env in files:
        for key, value in {**env.model_dump(exclude={"packages", "gpu_memory"}), **env.packages}.items():
            put(key, value, source)
        put("gpu_memory", env.gpu_memory and f"{number(env.gpu_memory, 'GiB')} GiB", source)
    for c in run.conformance:
        put("torch", c.data.torch, c.source)
        for d in c.data.drivers:
            put("granularity", d.granularity and f"{d.granularity:,} bytes ({d.driver})", c.source)
    for b in run.bench:
        put("granularity", b.summary["granularity"] and f"{b.summary['granularity']:,} bytes ({b.summary['driver']})",
            b.source)
        put("date", b.data.datetime, b.source)
        put("python", b.data.machine_info.python_version, b.source)
        put("cpu", b.data.machine_info.cpu.brand_raw, b.source)
    for case in run.cases:
        total = case.data.memory.total
        put("gpu_memory", total and f"{number(total, 'GiB')} GiB (memory.total)", f"integration/{case.path}")
    return {k: found.get(k, (None, None)) for k in ENVIRONMENT_NAMES}
