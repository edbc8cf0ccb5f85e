"""A run folder read into plain dataclasses. Nothing here computes a figure; a value the files lack is ``None``.

A run folder (``reports/runs/<run-name>/``) holds what the GPU stages wrote:

- ``conformance-*.json``: the conformance summary (``conformance/conftest.py``, ``--summary-json``);
- ``bench-*.json``: pytest-benchmark JSON of ``bench/``, summarised by ``benchmarks``;
- ``integration/**/*.json``: one vLLM case each (``integration/run_case.py``);
- ``validate-backend*.txt``: the output of ``python -m extensible_kv validate-backend``;
- ``README.md`` (versions the JSON does not record) and, in later runs, ``environment.json``.

Every file is optional. What is missing is listed in ``Run.missing`` and shows up as "not measured". A file that
is there but cannot be read, or is not in its format, is a ``files.BadFile`` naming the file and the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .benchmarks import bytes_of, entries, seconds_of, summarize_entries
from .benchmarks import load as load_benchmarks
from .files import COUNT, NUMBER, TEXT, read_json, read_text

# Keys of ``memory`` in an integration case; any of them may be absent (older runs lack ``cudagraph_memory`` and
# ``torch_reusable``).
MEMORY_KEYS = ("total", "free_after_warmup", "init_free", "requested", "weights", "profiled_peak_activation",
               "profiled_non_torch", "cudagraph_estimate", "available_kv_cache_memory", "torch_reserved",
               "torch_reusable", "num_gpu_blocks", "cudagraph_memory")

# The fields of each file that the report reads, with their types (``files``).
CONFORMANCE_SHAPE = {
    "exitstatus": NUMBER, "torch": TEXT,
    "drivers": [{"driver": TEXT, "passed": COUNT, "failed": COUNT, "skipped": COUNT, "granularity": COUNT,
                 "commit_gb_per_s": NUMBER, "commit_bytes": COUNT, "unavailable": TEXT}],
    "tests": [{"driver": TEXT, "test": TEXT, "outcome": TEXT, "reason": TEXT}]}
CASE_SHAPE = {
    "case": {"model": TEXT, "runner": TEXT, "backend": TEXT, "mode": TEXT, "gpu_memory_utilization": NUMBER,
             "max_model_len": COUNT},
    "token_ids": list, "num_cached_tokens": list, "corrupted_elements": COUNT, "engine_seconds": NUMBER,
    "memory": dict.fromkeys(MEMORY_KEYS, COUNT) | {"runner": TEXT},
    "extensible": {"kv": dict.fromkeys(("reserved_bytes", "committed_bytes", "backed_bytes", "waste_bytes",
                                        "max_num_blocks", "num_blocks"), COUNT),
                   "measured": {"blocks": COUNT, "bytes_per_block": COUNT, "non_kv": NUMBER},
                   "events": [dict], "commit_seconds": NUMBER}}


@dataclass(frozen=True)
class ConformanceDriver:
    """One row of ``drivers`` in a conformance summary."""

    source: str
    driver: str
    passed: int | None
    failed: int | None
    skipped: int | None
    granularity: int | None
    commit_gb_per_s: float | None
    commit_bytes: int | None
    unavailable: str | None


@dataclass(frozen=True)
class ConformanceTest:
    """One rule run on one driver. ``reason`` only where the JSON carries one."""

    source: str
    driver: str
    test: str
    outcome: str
    reason: str | None = None

    @property
    def rule(self) -> str:
        """The test without its parameters: ``test_kv_cache.py::test_ensure_blocks_...``."""
        name = self.test.split("[", 1)[0]
        return name.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class Conformance:
    """One ``conformance-*.json`` file."""

    source: str
    exitstatus: int | None
    torch: str | None
    drivers: list[ConformanceDriver]
    tests: list[ConformanceTest]


@dataclass(frozen=True)
class Bench:
    """One ``bench-*.json`` file: ``summary`` is ``benchmarks.summarize_entries``'s dict, ``raw`` the entries by
    ``extra_info['key']`` (``benchmarks.entries``)."""

    source: str
    summary: dict
    raw: dict[str, dict]
    datetime: str | None
    machine_info: dict = field(default_factory=dict)

    def bytes_of(self, key: str) -> int | None:
        return bytes_of(self.raw, key)

    def seconds_of(self, key: str) -> float | None:
        return seconds_of(self.raw, key)


@dataclass(frozen=True)
class Case:
    """One vLLM case (``integration/run_case.py``). ``memory`` has every key of ``MEMORY_KEYS`` (``None`` where the
    file lacks it); ``extensible`` is ``None`` for legacy runs."""

    path: str  # relative to the run's integration/ folder, e.g. "call1/tiny-llama-v1-FLASH_ATTN-legacy.json"
    model: str
    runner: str
    backend: str
    mode: str
    corrupt: bool
    gpu_memory_utilization: float | None
    max_model_len: int | None
    token_ids: list | None
    num_cached_tokens: list | None
    corrupted_elements: int | None
    engine_seconds: float | None
    memory: dict[str, Any]
    extensible: dict | None

    @property
    def group(self) -> tuple[str, str, str]:
        return (self.model, self.runner, self.backend)

    @property
    def folder(self) -> str:
        return self.path.rsplit("/", 1)[0] if "/" in self.path else ""

    @property
    def label(self) -> str:
        """Short and unique within a run: ``tiny-llama v1 FLASH_ATTN extensible+corrupt (call2)``."""
        mode = self.mode + ("+corrupt" if self.corrupt else "")
        where = f" ({self.folder})" if self.folder else ""
        return f"{self.model} {self.runner} {self.backend} {mode}{where}"


@dataclass(frozen=True)
class BackendCheck:
    """One ``backend ... result`` stanza of ``validate-backend`` output."""

    source: str
    backend: str
    layout: str
    driver: str
    shape: str
    stride_order: str
    block_dim: int | None
    segments: int | None
    page_bytes: int | None
    result: str | None
    checks: list[tuple[str, str, str]] = field(default_factory=list)  # (check, ok/FAIL, detail)


@dataclass(frozen=True)
class EnvironmentItem:
    value: str | None
    source: str | None  # the file it came from


@dataclass
class Run:
    name: str
    path: Path
    environment: dict[str, EnvironmentItem]
    conformance: list[Conformance]
    bench: list[Bench]
    cases: list[Case]
    backend_checks: list[BackendCheck]
    backend_totals: list[str]
    backend_files: list[str]
    missing: list[str]  # what is not measured in this run, in words

    @property
    def measured(self) -> bool:
        """Whether the folder holds any measurement file."""
        return bool(self.conformance or self.bench or self.cases or self.backend_files)


class RunFolderError(Exception):
    """The run folder does not exist or is not a folder."""


# -- reading ---------------------------------------------------------------------------------------------------------
def load_run(path: str | Path, name: str | None = None) -> Run:
    folder = Path(path)
    if not folder.is_dir():
        raise RunFolderError(f"run folder {str(folder)!r} does not exist or is not a folder")
    missing: list[str] = []
    conformance = [_conformance(p) for p in sorted(folder.glob("conformance-*.json"))]
    if not conformance:
        missing.append("conformance: no conformance-*.json in the run folder")
    bench = [_bench(p) for p in sorted(folder.glob("bench-*.json"))]
    if not bench:
        missing.append("benchmarks: no bench-*.json in the run folder")
    integration = folder / "integration"
    cases = [_case(p, integration) for p in sorted(integration.rglob("*.json"))] if integration.is_dir() else []
    if not cases:
        missing.append("vLLM integration: no integration/**/*.json in the run folder")
    checks: list[BackendCheck] = []
    totals: list[str] = []
    backend_files = sorted(folder.glob("validate-backend*.txt"))
    for p in backend_files:
        c, t = _backend_checks(p)
        checks += c
        totals += t
    if not backend_files:
        missing.append("backend validation: no validate-backend*.txt in the run folder")
    run = Run(name=name or folder.resolve().name, path=folder, environment={}, conformance=conformance, bench=bench,
              cases=cases, backend_checks=checks, backend_totals=totals,
              backend_files=[p.name for p in backend_files], missing=missing)
    run.environment = _environment(run)
    return run


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _conformance(path: Path) -> Conformance:
    data = read_json(path, CONFORMANCE_SHAPE)
    drivers = [ConformanceDriver(source=path.name, driver=str(d.get("driver")), passed=_int(d.get("passed")),
                                 failed=_int(d.get("failed")), skipped=_int(d.get("skipped")),
                                 granularity=_int(d.get("granularity")),
                                 commit_gb_per_s=_float(d.get("commit_gb_per_s")),
                                 commit_bytes=_int(d.get("commit_bytes")), unavailable=d.get("unavailable"))
               for d in data.get("drivers") or []]
    tests = [ConformanceTest(source=path.name, driver=str(t.get("driver")), test=str(t.get("test")),
                             outcome=str(t.get("outcome")), reason=t.get("reason") or None)
             for t in data.get("tests") or []]
    return Conformance(source=path.name, exitstatus=_int(data.get("exitstatus")), torch=data.get("torch"),
                       drivers=drivers, tests=tests)


def _bench(path: Path) -> Bench:
    data = load_benchmarks(path)
    raw = entries(data)
    return Bench(source=path.name, summary=summarize_entries(raw), raw=raw, datetime=data.get("datetime"),
                 machine_info=data.get("machine_info") or {})


def _case(path: Path, root: Path) -> Case:
    data = read_json(path, CASE_SHAPE)
    c = data.get("case") or {}
    memory = data.get("memory") or {}
    return Case(path=path.relative_to(root).as_posix(), model=str(c.get("model")), runner=str(c.get("runner")),
                backend=str(c.get("backend")), mode=str(c.get("mode")), corrupt=bool(c.get("corrupt")),
                gpu_memory_utilization=_float(c.get("gpu_memory_utilization")),
                max_model_len=_int(c.get("max_model_len")), token_ids=data.get("token_ids"),
                num_cached_tokens=data.get("num_cached_tokens"),
                corrupted_elements=_int(data.get("corrupted_elements")),
                engine_seconds=_float(data.get("engine_seconds")),
                memory={k: memory.get(k) for k in MEMORY_KEYS} | {"runner": memory.get("runner")},
                extensible=data.get("extensible"))


_BACKEND = re.compile(r"^backend (?P<backend>\S+) \(layout (?P<layout>\w+)\) on driver (?P<driver>\S+): "
                      r"shape (?P<shape>\([^)]*\)), stride order (?P<stride>\([^)]*\)), block dim (?P<dim>\d+), "
                      r"segments (?P<segments>\d+), page (?P<page>\d+) bytes")
_CHECK = re.compile(r"^  (?P<name>\S.*?)\s{2,}(?P<status>\S+)\s{2,}(?P<detail>.*)$")
_RESULT = re.compile(r"^  result\s+(?P<result>\S+)")
_TOTAL = re.compile(r"^\d+ of \d+ passed")


def _backend_checks(path: Path) -> tuple[list[BackendCheck], list[str]]:
    """Stanzas opened by ``backend ...`` and closed by ``  result ...``; ``N of M passed`` lines as totals."""
    checks: list[BackendCheck] = []
    totals: list[str] = []
    head: dict | None = None
    items: list[tuple[str, str, str]] = []
    for line in read_text(path).splitlines():
        m = _BACKEND.match(line)
        if m:
            if head is not None:  # a stanza without a result line
                checks.append(_backend_check(path.name, head, items, None))
            head, items = m.groupdict(), []
            continue
        if head is None:
            if line.startswith("backend "):  # a header in a format this parser does not know
                head, items = {"backend": line[len("backend "):].split(" ", 1)[0]}, []
            elif _TOTAL.match(line):
                totals.append(line.strip())
            continue
        r = _RESULT.match(line)
        if r:
            checks.append(_backend_check(path.name, head, items, r.group("result")))
            head, items = None, []
            continue
        c = _CHECK.match(line)
        if c:
            items.append((c.group("name"), c.group("status"), c.group("detail")))
        elif _TOTAL.match(line):
            totals.append(line.strip())
    if head is not None:
        checks.append(_backend_check(path.name, head, items, None))
    return checks, totals


def _backend_check(source: str, head: dict, items: list, result: str | None) -> BackendCheck:
    return BackendCheck(source=source, backend=head.get("backend", "?"), layout=head.get("layout", "?"),
                        driver=head.get("driver", "?"), shape=head.get("shape", "?"),
                        stride_order=head.get("stride", "?"), block_dim=_int_or_none(head.get("dim")),
                        segments=_int_or_none(head.get("segments")), page_bytes=_int_or_none(head.get("page")),
                        result=result, checks=list(items))


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


# -- environment -----------------------------------------------------------------------------------------------------
# The environment items in report order, each with its name in the report.
ENVIRONMENT_NAMES = {"gpu": "GPU", "gpu_memory": "GPU memory (memory.total)", "nvidia_driver": "GPU driver",
                     "torch": "torch", "cuda_bindings": "cuda-bindings", "vllm": "vllm",
                     "granularity": "VMM granularity", "date": "date", "python": "python", "cpu": "CPU"}
ENVIRONMENT_KEYS = tuple(ENVIRONMENT_NAMES)

_README_PATTERNS = {
    "gpu": re.compile(r"\b((?:NVIDIA|AMD)\s+[A-Za-z0-9][\w-]*)"),
    "nvidia_driver": re.compile(r"\bdriver\s+(\d+(?:\.\d+)+)"),
    "torch": re.compile(r"\btorch\s+(\d[\w.+-]*\w)"),
    "cuda_bindings": re.compile(r"\bcuda-bindings\s+(\d[\w.]*\w)"),
    "vllm": re.compile(r"\bvllm\s+(\d[\w.]*\w)"),
    "date": re.compile(r"\b(\d{4}-\d{2}-\d{2})\b"),
}


def _environment(run: Run) -> dict[str, EnvironmentItem]:
    """Each item from the first file that records it: ``environment.json``, then the measurement files, then the
    run's README (versions only)."""
    env: dict[str, EnvironmentItem] = {}

    def put(key: str, value: Any, source: str) -> None:
        if key not in env and value not in (None, ""):
            env[key] = EnvironmentItem(str(value), source)

    explicit = run.path / "environment.json"
    if explicit.is_file():
        data = read_json(explicit, dict)
        for key in ENVIRONMENT_KEYS:
            put(key, data.get(key), explicit.name)
    for c in run.conformance:
        put("torch", c.torch, c.source)
        for d in c.drivers:
            if d.granularity:
                put("granularity", f"{d.granularity} bytes ({d.driver})", c.source)
    for b in run.bench:
        if b.summary.get("granularity"):
            put("granularity", f"{b.summary['granularity']} bytes ({b.summary.get('driver')})", b.source)
        put("date", b.datetime, b.source)
        for entry in b.raw.values():
            put("torch", entry["extra"].get("subprocess_torch"), b.source)
    for case in run.cases:
        total = case.memory.get("total")
        if total:
            put("gpu_memory", f"{total} bytes ({total / 2**30:.1f} GiB)", f"integration/{case.path}")
    readme = run.path / "README.md"
    if readme.is_file():
        text = read_text(readme)
        for key, pattern in _README_PATTERNS.items():
            m = pattern.search(text)
            if m:
                put(key, m.group(1), readme.name)
    for b in run.bench:
        put("python", b.machine_info.get("python_version"), b.source)
        put("cpu", (b.machine_info.get("cpu") or {}).get("brand_raw"), b.source)
    return {k: env.get(k, EnvironmentItem(None, None)) for k in ENVIRONMENT_KEYS}
