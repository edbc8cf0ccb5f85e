"""A run folder (``reports/runs/<run>/`` or ``reports/out/``) read through ``extensible_kv.measurements``.

Every file is optional: ``conformance-*.json``, ``bench*.json``, ``validate-backend*.json``, ``integration/**/*.json``,
``serving-*.json``, ``{sleep,connectors}/summary.json``, ``environment.json``. A run's gaps are in ``Run.missing``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..measurements import (
    BackendValidation,
    ConformanceSummary,
    Environment,
    IntegrationCase,
    ScriptSummary,
    ServingSpeed,
    read,
)
from .benchmarks import Bench
from .numbers import number

# The environment items in report order, with their names in the report.
ENVIRONMENT_NAMES = {
    "gpu": "GPU",
    "gpu_memory": "GPU memory",
    "gpu_driver": "GPU driver",
    "torch": "torch",
    "cuda": "CUDA",
    "hip": "HIP",
    "cuda-bindings": "cuda-bindings",
    "vllm": "vllm",
    "granularity": "VMM granularity",
    "date": "date",
    "python": "python",
    "platform": "platform",
    "cpu": "CPU",
}


class RunFolderError(Exception):
    """The run folder does not exist or is not a folder."""


@dataclass(frozen=True)
class Source:
    """A measurement file of the run (its name in the run folder) and what it holds."""

    source: str
    data: ConformanceSummary | BackendValidation | ServingSpeed


NOT_THE_CASE = ("mode", "corrupt", "batch_invariant")  # what differs between the runs of one case


@dataclass(frozen=True)
class Case:
    """One vLLM case; ``path`` is relative to the run's ``integration/`` folder."""

    path: str
    data: IntegrationCase

    spec = property(lambda self: self.data.case)
    mode = property(lambda self: self.spec.mode)
    corrupt = property(lambda self: self.spec.corrupt)
    group = property(lambda self: (self.spec.model, self.spec.runner, self.spec.backend))
    folder = property(lambda self: self.path.rpartition("/")[0])
    # the block count a run was given (the throughput runs): the extensible path did not size it
    fixed_blocks = property(lambda self: getattr(self.spec, "num_gpu_blocks_override", None))
    batch_invariant = property(lambda self: bool(getattr(self.spec, "batch_invariant", False)))
    variant = property(lambda self: self.mode + ("+corrupt" if self.corrupt else ""))
    # the settings that change what a case commits, with their defaults: a case shows those it changes in its key
    SETTINGS = (
        ("kv_cache_dtype", "auto"),
        ("block_size", 16),
        ("speculative", None),
        ("max_num_seqs", 8),
        ("num_gpu_blocks_override", None),
        ("batch_invariant", False),
        ("throughput", False),
    )

    @property
    def settings(self) -> tuple[str, ...]:
        """``name=value`` for each of ``SETTINGS`` the case sets away from its default (older files lack some)."""
        values = ((name, getattr(self.spec, name, default), default) for name, default in self.SETTINGS)
        return tuple(f"{name}={value}" for name, value, default in values if value != default)

    key = property(lambda self: "/".join((*self.group, *self.settings, self.variant)))  # matches cases of two runs

    @property
    def same_case(self) -> tuple:
        """What every run of one case shares: its settings but those of ``NOT_THE_CASE``; a setting that is off
        (``None``, ``False``) counts as absent, so files written before a setting existed still match."""
        spec = self.spec.model_dump(by_alias=True)
        return tuple(
            sorted((k, repr(v)) for k, v in spec.items() if k not in NOT_THE_CASE and v is not None and v is not False)
        )

    label = property(
        lambda self: (
            " ".join((*self.group, *self.settings, self.variant)) + (f" ({self.folder})" if self.folder else "")
        )
    )

    @property
    def run_order(self) -> tuple[str, int]:
        """``x-legacy.json`` before ``x-legacy-r2.json`` (``integration/parity.py`` names repeats ``-rN``)."""
        m = re.search(r"-r(\d+)\.json$", self.path)
        return (self.path[: m.start()] + ".json", int(m.group(1))) if m else (self.path, 1)


@dataclass
class Run:
    name: str
    path: Path
    conformance: list[Source]
    bench: list[Bench]
    cases: list[Case]
    backends: list[Source]
    serving: list[Source]
    environment: dict[str, tuple[str | None, str | None]]  # item -> (value, the file it came from)
    missing: list[str]
    features: dict[str, list[dict]] | None = None  # "sleep mode: pairs" -> rows of the scripts' summary.json

    @property
    def measured(self) -> bool:
        return bool(self.conformance or self.bench or self.cases or self.backends or self.serving or self.features)


def load_run(path: str | Path, name: str | None = None) -> Run:
    folder = Path(path)
    if not folder.is_dir():
        raise RunFolderError(f"run folder {str(folder)!r} does not exist or is not a folder")
    integration = folder / "integration"
    cases = sorted(p for p in integration.rglob("*.json") if p.name != "environment.json")
    run = Run(
        name or folder.resolve().name,
        folder,
        [Source(p.name, read(p, ConformanceSummary)) for p in sorted(folder.glob("conformance-*.json"))],
        [Bench.load(p) for p in sorted(folder.glob("bench*.json"))],
        [Case(p.relative_to(integration).as_posix(), read(p, IntegrationCase)) for p in cases],
        [Source(p.name, read(p, BackendValidation)) for p in sorted(folder.glob("validate-backend*.json"))],
        [Source(p.name, read(p, ServingSpeed)) for p in sorted(folder.glob("serving-*.json"))],
        {},
        [],
    )
    run.missing = [
        f"{what}: no {files} in the run folder"
        for found, what, files in (
            (run.conformance, "conformance", "conformance-*.json"),
            (run.bench, "benchmarks", "bench*.json"),
            (run.cases, "vLLM integration", "integration/**/*.json"),
            (run.backends, "backend validation", "validate-backend*.json"),
            (run.serving, "serving speed", "serving-*.json"),
        )
        if not found
    ]
    envs = [p for p in [folder / "environment.json", *sorted(integration.rglob("environment.json"))] if p.is_file()]
    run.environment = environment(run, [(p.relative_to(folder).as_posix(), read(p, Environment)) for p in envs])
    found = [
        (f"{title}: {key}", getattr(read(folder / name / "summary.json", ScriptSummary), key))
        for name, title in (("sleep", "sleep mode"), ("connectors", "KV connectors"))
        if (folder / name / "summary.json").is_file()
        for key in ("pairs", "cases", "rows")
    ]  # scalar cells only: token lists stay in the files
    run.features = {
        t: [{k: v for k, v in r.items() if not isinstance(v, (list, dict))} for r in rows] for t, rows in found if rows
    }
    return run


def environment(run: Run, files: list[tuple[str, Environment]]) -> dict[str, tuple[str | None, str | None]]:
    """Each item from the first file that records it: ``environment.json`` files, then the benchmark JSON's
    ``machine_info``, then what the measurement files record on the side."""
    found: dict[str, tuple[str, str]] = {}
    files = files + [(b.source, b.data.machine_info.environment) for b in run.bench if b.data.machine_info.environment]
    items = [
        (k, v, source)
        for source, env in files
        for k, v in {**env.model_dump(exclude={"packages"}), **env.packages}.items()
    ]
    items += [("torch", c.data.torch, c.source) for c in run.conformance]
    items += [
        ("granularity", d.granularity and f"{d.granularity:,} bytes ({d.driver})", c.source)
        for c in run.conformance
        for d in c.data.drivers
    ]
    for b in run.bench:
        g, machine = b.summary["granularity"], b.data.machine_info
        items += [
            ("granularity", g and f"{g:,} bytes ({b.summary['driver']})", b.source),
            ("date", b.data.datetime, b.source),
            ("python", machine.python_version, b.source),
            ("cpu", machine.cpu.brand_raw, b.source),
        ]
    items += [("gpu_memory", c.data.memory.total, f"integration/{c.path}") for c in run.cases if c.data.memory]
    for key, value, source in items:
        if key not in found and value not in (None, ""):
            found[key] = (f"{number(value, 'GiB')} GiB" if key == "gpu_memory" else str(value), source)
    return {k: found.get(k, (None, None)) for k in ENVIRONMENT_NAMES}
