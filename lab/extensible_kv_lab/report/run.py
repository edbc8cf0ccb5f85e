"""A run folder (``reports/runs/<run>/`` or ``reports/out/``) read through ``extensible_kv_lab.measurements``.

Every file is optional (``INPUTS``, ``{sleep,connectors}/summary.json``, ``environment.json``); ``Run.missing`` names
the inputs a run lacks.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from extensible_kv.boundaries import BoundaryError, named, shown, text
from extensible_kv.boundaries.files import Folder

from ..measurements import (
    BackendValidation,
    ConformanceSummary,
    Environment,
    IntegrationCase,
    RunsIndex,
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


INDEX = "current.json"  # beside the run folders: which run is current for each case family (RunsIndex)
NAME_CHARS = 200  # the longest run name: a heading and a folder name


class RunFolderError(BoundaryError):
    """The run folder does not exist or is not a folder, or its name or the run's name is not one."""


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
    index: RunsIndex | None = None  # the current.json beside the run folder (reports/runs/), where there is one

    @property
    def current_for(self) -> list[str] | None:
        """The case families the index names this run folder current for; ``None`` without an index."""
        folder = self.path.resolve().name
        return None if self.index is None else [f.family for f in self.index.families if f.run == folder]

    @property
    def missing(self) -> list[str]:
        return [f"{what}: no {files} in the run folder" for name, what, files in INPUTS if not getattr(self, name)]

    @property
    def measured(self) -> bool:
        return bool(self.features) or any(getattr(self, name) for name, _, _ in INPUTS)


def load_run(path: str | Path, name: str | None = None) -> Run:
    """The run folder ``path``, read through ``boundaries.files.Folder`` (Note [A file read is a regular file of bounded
    size]): its names UTF-8, every file regular, bounded and inside it; ``RunFolderError`` or ``BadFile`` otherwise."""
    if name is not None:
        name = run_name(name)
    try:
        text(path, "run folder")
    except BoundaryError as exc:
        raise RunFolderError(str(exc)) from None
    folder = Path(path)
    try:
        is_dir = stat.S_ISDIR(os.stat(folder).st_mode)
    except FileNotFoundError:
        raise RunFolderError(f"run folder {named(folder)} does not exist") from None
    except OSError as exc:  # no such file, a path too long, a folder of it that is a file
        raise RunFolderError(f"run folder {named(folder)} cannot be read ({exc.strerror})") from None
    if not is_dir:
        raise RunFolderError(f"run folder {named(folder)} does not exist or is not a folder")
    found = Folder(folder)

    def files(pattern: str) -> list[Path]:
        return found.glob(pattern)

    def load(p: Path, model):
        return read(p, model, folder=found)

    integration = folder / "integration"
    cases = [p for p in files("integration/*.json") if p.name != "environment.json"]
    run = Run(
        name or run_name(folder.resolve().name),
        folder,
        [Source(p.name, load(p, ConformanceSummary)) for p in files("conformance-*.json")],
        [Bench.load(p, found) for p in files("bench*.json")],
        [Case(p.relative_to(integration).as_posix(), load(p, IntegrationCase)) for p in cases],
        [Source(p.name, load(p, BackendValidation)) for p in files("validate-backend*.json")],
        [Source(p.name, load(p, ServingSpeed)) for p in files("serving-*.json")],
    )
    envs = [*files("environment.json"), *(p for p in files("integration/*.json") if p.name == "environment.json")]
    run.environment = environment(run, [(p.relative_to(folder).as_posix(), load(p, Environment)) for p in envs])
    if (index := folder.resolve().parent / INDEX).is_file():
        run.index = read(index, RunsIndex)
    scripts = {f"{n}/summary.json": t for n, t in (("sleep", "sleep mode"), ("connectors", "KV connectors"))}
    scripts["worst-batch-summary.json"] = "worst batch"  # integration/worst_batch_run.py
    scripts["resize-summary.json"] = "resize"  # integration/resize_run.py
    scripts["share-summary.json"] = "engines sharing a GPU"  # integration/share_run.py
    scripts["decode-pair-summary.json"] = "decode, resized against never resized"  # integration/decode_pair_run.py
    for rel, title in scripts.items():
        for p in files(rel):
            script = load(p, ScriptSummary)
            for key in (k for k in ("pairs", "cases", "rows", "components") if getattr(script, k)):
                scalar = [{k: v for k, v in r.items() if not isinstance(v, (list, dict))} for r in getattr(script, key)]
                run.features[f"{title}: {key}"] = scalar  # scalar cells only: token lists stay in the files
    return run


def run_name(name: str) -> str:
    """``name`` as a run's name (``--name``, or the run folder's): UTF-8 text of one line, at most 200 characters, and
    one path component (the default output folder is ``reports/rendered/<name>``); ``RunFolderError`` otherwise."""
    try:
        text(name, "run name")
    except BoundaryError as exc:
        raise RunFolderError(str(exc)) from None
    if not name or name in (".", "..") or "/" in name or len(name) > NAME_CHARS or not name.isprintable():
        raise RunFolderError(
            f"run name {shown(name)} is not a name: give one line of at most {NAME_CHARS} printable characters, "
            f"without '/', not '.' or '..'"
        )
    return name


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
