"""A run folder (``reports/runs/<run>/`` or ``reports/out/``) read through ``extensible_kv.measurements``.

Every file is optional (``INPUTS``, ``{sleep,connectors}/summary.json``, ``environment.json``); ``Run.missing`` names
the inputs a run lacks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
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
# A run's measurement files: (Run field, what they measure, the files); ``Run.missing`` names those a run lacks.
INPUTS = (
    ("conformance", "conformance", "conformance-*.json"),
    ("bench", "benchmarks", "bench*.json"),
    ("cases", "vLLM integration", "integration/**/*.json"),
    ("backends", "backend validation", "validate-backend*.json"),
    ("serving", "serving speed", "serving-*.json"),
)


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

    parts = property(lambda self: (*self.group, *self.settings, self.variant))
    key = property(lambda self: "/".join(self.parts))  # matches cases of two runs

    @property
    def same_case(self) -> tuple:
        """What every run of one case shares: its settings but those of ``NOT_THE_CASE``; a setting that is off
        (``None``, ``False``) counts as absent, so files written before a setting existed still match."""
        spec = {k: v for k, v in self.spec.model_dump(by_alias=True).items() if v is not None and v is not False}
        return tuple(sorted((k, repr(v)) for k, v in spec.items() if k not in NOT_THE_CASE))

    label = property(lambda self: " ".join(self.parts) + (f" ({self.folder})" if self.folder else ""))

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
    environment: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)  # item -> (value, its file)
    features: dict[str, list[dict]] = field(default_factory=dict)  # "sleep mode: pairs" -> rows of a summary.json

    @property
    def missing(self) -> list[str]:
        return [f"{what}: no {files} in the run folder" for name, what, files in INPUTS if not getattr(self, name)]

    @property
    def measured(self) -> bool:
        return bool(self.features) or any(getattr(self, name) for name, _, _ in INPUTS)


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
    )
    envs = [p for p in [folder / "environment.json", *sorted(integration.rglob("environment.json"))] if p.is_file()]
    run.environment = environment(run, [(p.relative_to(folder).as_posix(), read(p, Environment)) for p in envs])
    scripts = {t: folder / n / "summary.json" for n, t in (("sleep", "sleep mode"), ("connectors", "KV connectors"))}
    for title, script in ((t, read(f, ScriptSummary)) for t, f in scripts.items() if f.is_file()):
        for key in (k for k in ("pairs", "cases", "rows") if getattr(script, k)):
            scalar = [{k: v for k, v in r.items() if not isinstance(v, (list, dict))} for r in getattr(script, key)]
            run.features[f"{title}: {key}"] = scalar  # scalar cells only: token lists stay in the files
    return run


def environment(run: Run, files: list[tuple[str, Environment]]) -> dict[str, tuple[str | None, str | None]]:
    """Each item from the first file that records it: ``environment.json`` files, then the benchmark JSON's
    ``machine_info``, then what the measurement files record on the side."""
    found: dict[str, tuple[str, str]] = {}
    files = files + [(b.source, b.data.machine_info.environment) for b in run.bench if b.data.machine_info.environment]
    items = [
        (k, v, src) for src, env in files for k, v in (env.model_dump(exclude={"packages"}) | env.packages).items()
    ]
    for c in run.conformance:
        items.append(("torch", c.data.torch, c.source))
        items += [("granularity", _granularity(d.granularity, d.driver), c.source) for d in c.data.drivers]
    for b in run.bench:
        m, g = b.data.machine_info, _granularity(b.summary["granularity"], b.summary["driver"])
        pairs = (("granularity", g), ("date", b.data.datetime), ("python", m.python_version), ("cpu", m.cpu.brand_raw))
        items += [(k, v, b.source) for k, v in pairs]
    items += [("gpu_memory", c.data.memory.total, f"integration/{c.path}") for c in run.cases if c.data.memory]
    for key, value, source in items:
        if key not in found and value not in (None, ""):
            found[key] = (f"{number(value, 'GiB')} GiB" if key == "gpu_memory" else str(value), source)
    return {k: found.get(k, (None, None)) for k in ENVIRONMENT_NAMES}


def _granularity(granularity: int | None, driver: str | None) -> str | None:
    return granularity and f"{granularity:,} bytes ({driver})"
