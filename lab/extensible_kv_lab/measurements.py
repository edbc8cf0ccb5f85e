"""The schema of every measurement file a run writes: one pydantic model per file.

- ``conformance-<driver>.json``: ``ConformanceSummary``, by ``conformance/conftest.py`` (``--summary-json``);
- ``validate-backend-<driver>.json``: ``BackendValidation``, by ``python -m extensible_kv validate-backend --json``;
- ``bench-<driver>.json``: ``BenchmarkFile``, pytest-benchmark over ``bench/`` (``bench/conftest.py`` adds
  ``machine_info.environment``);
- ``integration/**/<case>.json``: ``IntegrationCase``, by ``integration/run_case.py``;
- ``serving-<case>.json``: ``ServingSpeed``, by ``python -m integration.matrix`` (``integration.parity
  .throughput_benchmark``);
- ``environment.json``: ``Environment``, by ``python -m extensible_kv environment OUT`` and beside the files of the
  conformance, bench and integration runs;
- ``reports/runs/current.json``: ``RunsIndex``, by hand: which committed run is current for each case family.

The runtime writes its three (the conformance summary, ``validate-backend --json``, ``environment.json``) as plain
JSON (``extensible_kv.record``), without this package; the lab's scripts write theirs through these models.

Writers build a model and ``write`` it; readers ``read`` a file into its model, and every problem (unreadable, empty,
not JSON, a field of the wrong type) is one ``BadFile`` naming the file and the field path. Types are strict (``"80"``
is not a number), NaN and infinity are refused, every number is bounded (Note [Numbers a device can hold]), and
fields a model does not name are kept as they are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from extensible_kv import record
from extensible_kv.boundaries import files, outputs

# Note [Numbers a device can hold]
# Every number of a file is bounded by what hardware can hold, so a corrupt or hostile file is refused here, naming
# the file and the field, and never reaches a formatter as 10**400 (an OverflowError on its way to a float) or as
# infinity. Bytes and counts are non-negative and below 2**63, signed figures (differences of bytes) within +/-2**63:
# no device addresses more. Block counts are below 2**40, 67,000 times the most any run committed (16.4M blocks,
# tiny-llama-swa fp8 on an H200, h200-matrix-current-2026-12-03). Floats are finite and within +/-2**63, so a unit
# conversion of one stays finite. Fields a model does not name, and ``Any`` fields, are kept as written and bounded
# the same way (``Record``).
LIMIT, BLOCK_LIMIT = 2**63, 2**40
LIMIT_NAMES = {LIMIT: "2**63", BLOCK_LIMIT: "2**40", -LIMIT: "-2**63"}
Int = Annotated[int, Field(gt=-LIMIT, lt=LIMIT)]  # a signed figure: a difference of bytes, an exit status, an id
Count = Annotated[int, Field(ge=0, lt=LIMIT)]  # bytes or a count
Blocks = Annotated[int, Field(ge=0, lt=BLOCK_LIMIT)]  # KV cache blocks
Number = Int | Annotated[float, Field(gt=-LIMIT, lt=LIMIT)]  # kept as written: 32 stays 32, 0.5 stays 0.5
Positive = Annotated[Number, Field(gt=0)]  # a rate or a ratio of rates: a zero or negative one was never measured


def _beyond_limit(value: object, where: str) -> str | None:
    """The path of the first number in ``value`` (JSON as loaded) that is not finite or not within ``LIMIT``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return None if abs(value) < LIMIT else where  # NaN compares false: refused too
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if found := _beyond_limit(item, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}"):
            return found
    return None


class OutOfBounds(ValueError):
    """A number beyond ``LIMIT`` where no field type bounds it; the message starts with its path in the model."""


class Record(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False, populate_by_name=True)

    @model_validator(mode="after")
    def _numbers_within_limit(self) -> Record:
        """The numbers no field type bounds (fields the model does not name, ``Any``) are bounded too."""
        for name, value in {**self.__dict__, **(self.__pydantic_extra__ or {})}.items():
            if (where := _beyond_limit(value, name)) is not None:
                raise OutOfBounds(f"{where} should be a finite number of magnitude less than 2**63")
        return self


# -- conformance-<driver>.json -----------------------------------------------------------------------------------
class DriverResult(Record):
    """One driver's counts and, where it ran, its granularity and the timed commit probe."""

    driver: str
    passed: Count = 0
    failed: Count = 0
    skipped: Count = 0
    granularity: Count | None = None
    commit_gb_per_s: Number | None = None
    commit_bytes: Count | None = None
    unavailable: str | None = None


class RuleOutcome(Record):
    """One rule (test) on one driver; ``reason`` where the run recorded one (skips)."""

    driver: str
    test: str
    outcome: str
    reason: str | None = None


class ConformanceSummary(Record):
    exitstatus: Int | None = None
    torch: str | None = None
    drivers: list[DriverResult] = []
    tests: list[RuleOutcome] = []


# -- validate-backend-<driver>.json ------------------------------------------------------------------------------
class BackendCheckItem(Record):
    name: str
    ok: bool
    detail: str


class BackendResult(Record):
    """One backend under one KV layout (``extensible_kv.backend_check.BackendReport``)."""

    backend: str
    kv_layout: str | None = None
    driver: str = "-"
    shape: list[Count] | None = None
    stride_order: list[Int] | None = None
    block_dim: Int | None = None
    segments: Count | None = None
    page_size_bytes: Int | None = None
    checks: list[BackendCheckItem] = []
    ok: bool


class BackendValidation(Record):
    results: list[BackendResult]


# -- serving-*.json ----------------------------------------------------------------------------------------------
class ServingRun(Record):
    """One mode's throughput run in a serving-speed file (its benchmark's ``extra_info``)."""

    tokens_per_s: Positive
    runs: Count | None = None
    num_seqs: Count | None = None
    num_gpu_blocks: Blocks | None = None
    engine_seconds: Number | None = None
    compiled: bool | None = None  # wrote into vLLM's compile cache at start; None: not recorded
    model: str | None = None
    runner: str | None = None


class ServingBenchmark(Record):
    name: str
    param: Literal["legacy", "extensible"]  # the mode
    extra_info: ServingRun


class ServingRatio(Record):
    """Extensible over legacy (``integration.parity.throughput_benchmark``)."""

    decode_tokens_per_s: Positive  # the median of the window-by-window ratios
    pairs: Count | None = None  # legacy/extensible run pairs (legacy, extensible, extensible, legacy: two)
    decode_window_ratios: list[Positive] | None = None
    decode_range: Annotated[list[Positive], Field(min_length=2, max_length=2)] | None = None  # lowest, highest
    target_decode: Positive
    engine_seconds: Positive | None = None
    engine_seconds_comparable: bool | None = None  # both engines compiled, or both loaded the compile cache
    same_block_count: bool


def start_comparable(legacy_compiled: bool | None, ext_compiled: bool | None) -> bool | None:
    """Whether two engine starts compare like with like: unknown if either engine's compile-cache state is, else
    whether both compiled or both loaded the cache (Note [A start time needs the same compile cache] in
    ``integration/parity.py``)."""
    return None if legacy_compiled is None or ext_compiled is None else legacy_compiled == ext_compiled


class ServingSpeed(Record):
    """``serving-*.json``: a legacy and an extensible throughput run at the same block count, pytest-benchmark
    shaped, with the ratio on top."""

    benchmarks: list[ServingBenchmark]
    ratio: ServingRatio
    datetime: str | None = None

    def mode(self, name: str) -> ServingRun | None:
        return next((b.extra_info for b in self.benchmarks if b.param == name), None)

    @model_validator(mode="after")
    def _start_compared_like_with_like(self) -> ServingSpeed:
        """``engine_seconds_comparable`` is what the two modes' ``compiled`` say (``start_comparable``)."""
        legacy, ext = self.mode("legacy"), self.mode("extensible")
        if legacy and ext:
            expected = start_comparable(legacy.compiled, ext.compiled)
            if self.ratio.engine_seconds_comparable != expected:
                raise ValueError(
                    f"ratio.engine_seconds_comparable is {self.ratio.engine_seconds_comparable}, but "
                    f"compiled is {legacy.compiled} (legacy) and {ext.compiled} (extensible): "
                    f"expected {expected}"
                )
        return self


# -- environment.json --------------------------------------------------------------------------------------------
class Environment(Record):
    """Where a run ran. ``packages``: versions of the optional packages that matter here (cuda-bindings, vllm, ...)."""

    date: str | None = None
    gpu: str | None = None
    gpu_memory: Count | None = None
    gpu_driver: str | None = None
    torch: str | None = None
    cuda: str | None = None
    hip: str | None = None
    python: str | None = None
    platform: str | None = None
    packages: dict[str, str] = {}

    @classmethod
    def collect(cls) -> Environment:
        """This machine, now (``extensible_kv.record.environment``)."""
        return cls.model_validate(record.environment())


# -- bench-<driver>.json (pytest-benchmark) ----------------------------------------------------------------------
class BenchExtra(Record):
    """``extra_info`` of a benchmark of ``bench/``: its stable ``key`` and what it measured."""

    key: str | None = None
    driver: str | None = None
    device_type: str | None = None
    granularity: Count | None = None
    scale: Number | None = None
    state: str | None = None
    nominal_gib: Number | None = None
    subprocess_median_s: Number | None = None
    subprocess_torch: str | None = None
    calls: dict[str, Number] | None = None
    bytes: Count | None = None
    moved_bytes: Count | None = None
    handles: Count | None = None
    set_access: Count | None = None
    granules: Count | None = None
    zero_calls: Count | None = None
    segments: Count | None = None
    runs: Count | None = None
    buffers: Count | None = None


class BenchStats(Record):
    median: Number | None = None


class Benchmark(Record):
    extra_info: BenchExtra = BenchExtra()
    stats: BenchStats = BenchStats()


class Cpu(Record):
    brand_raw: str | None = None


class MachineInfo(Record):
    python_version: str | None = None
    cpu: Cpu = Cpu()
    environment: Environment | None = None  # bench/conftest.py, pytest_benchmark_update_machine_info


class BenchmarkFile(Record):
    benchmarks: list[Benchmark]
    datetime: str | None = None
    machine_info: MachineInfo = MachineInfo()


# -- integration/**/<case>.json ----------------------------------------------------------------------------------
class CaseSpec(Record):
    model: str
    runner: str
    backend: str
    mode: str
    corrupt: bool = False
    gpu_memory_utilization: Number | None = None
    max_model_len: Count | None = None
    speculative: str | None = None  # e.g. "ngram:4"
    multimodal: bool | None = None


class EncoderCacheFigures(Record):
    """``memory.encoder_cache`` of a multimodal case, in bytes (``integration/run_case.py``): the most the model
    runner's encoder cache held during vLLM's profile run and during the case's own generation and peak batch
    (distinct tensor storages), the item count at that moment, one item's bytes, and how many items the cache can
    hold (``encoder_cache_size // tokens per item``)."""

    profiled_bytes: Count | None = None
    held_bytes: Count | None = None
    items_held: Count | None = None
    bytes_per_item: Count | None = None
    capacity_items: Count | None = None
    items_at_peak: Count | None = None


class SpeculativeFigures(Record):
    """``memory.speculative`` of a speculative-decoding case (``integration/parity.py``, ``speculative_figures``): the
    phase in which every one of ``requests`` requests proposes ``k`` drafts (``rows`` logits rows of ``vocab``), in
    bytes where not named."""

    k: Count
    method: str
    requests: Count
    rows: Count
    vocab: Count
    step_peak_allocated: Int | None = None
    step_reserved_growth: Int | None = None
    over_budget_measured: Int | None = None
    widest_steps: Count | None = None


class MeasuredPeak(Record):
    """Memory at the measured peak: a peak-shaped batch run after the final commit (``integration/run_case.py``).
    ``over_budget_measured`` = (init_free - free_at_peak) - requested; ``growth`` holds what torch, non-torch memory
    and the KV cache took since warmup (``before_batch``, ``during_batch``), in bytes."""

    over_budget_measured: Int | None = None  # the larger of the phases' (over_budget_phase says which)
    over_budget_prefill: Int | None = None  # the peak-shaped batch's own, where a speculative phase ran too
    over_budget_phase: str | None = None  # "prefill" or "speculative"
    free_at_peak: Count | None = None
    peak_shaped: bool | None = None
    growth: dict[str, dict[str, Int]] | None = None

    def grown(self, part: str) -> int | None:
        """Bytes ``part`` (``torch_reserved``, ``non_torch`` or ``kv``) took since warmup, up to and through the peak
        batch."""
        return None if self.growth is None else sum(phase.get(part, 0) for phase in self.growth.values())

    @property
    def torch_growth(self) -> int | None:
        return self.grown("torch_reserved")


class CaseMemory(Record):
    """vLLM's profiling figures and the memory after warmup, in bytes (``integration/run_case.py``,
    ``memory_figures``). Older runs lack ``torch_reusable`` and ``cudagraph_memory``."""

    total: Count | None = None
    free_after_warmup: Count | None = None
    init_free: Count | None = None
    requested: Count | None = None
    weights: Count | None = None
    profiled_peak_activation: Count | None = None
    profiled_non_torch: Count | None = None
    cudagraph_estimate: Count | None = None
    available_kv_cache_memory: Count | None = None
    torch_reserved: Count | None = None
    torch_reusable: Count | None = None
    num_gpu_blocks: Blocks | None = None
    cudagraph_memory: Count | None = None
    runner: str | None = None
    peak: MeasuredPeak | None = None  # at the measured peak (integration/parity.py); older runs lack it
    encoder_cache: EncoderCacheFigures | None = None  # multimodal cases
    speculative: SpeculativeFigures | None = None  # speculative-decoding cases


class KVFigures(Record):
    reserved_bytes: Count | None = None
    committed_bytes: Count | None = None
    backed_bytes: Count | None = None
    waste_bytes: Count | None = None
    max_num_blocks: Blocks | None = None
    num_blocks: Blocks | None = None
    granularity: Count | None = None
    buffers: list[dict[str, Any]] = []


class SizingFigures(Record):
    """What the extensible sizing measured (``extensible_kv.vllm``)."""

    blocks: Blocks | None = None
    bytes_per_block: Count | None = None
    non_kv: Int | None = None


class GrowthEvent(Record):
    event: str | None = None
    reason: str | None = None
    from_: Blocks | None = Field(None, alias="from")
    to: Blocks | None = None


class ExtensibleFigures(Record):
    """The extensible KV cache's own report (``extensible_kv_report`` on the worker)."""

    segments: list[Count] | None = None  # per buffer
    kv: KVFigures | None = None
    measured: SizingFigures | None = None
    events: list[GrowthEvent] | None = None
    commit_seconds: Number | None = None


class IntegrationCase(Record):
    case: CaseSpec
    token_ids: list[list[Int]] | None = None
    num_cached_tokens: list[Count | None] | None = None
    corrupted_elements: Count | None = None
    engine_seconds: Number | None = None
    compile_cache_files_written: Count | None = None  # 0: the engine loaded an earlier engine's torch.compile output
    memory: CaseMemory | None = None  # None when vLLM refused the combination
    extensible: ExtensibleFigures | None = None
    refused: str | None = None  # vLLM's reason for refusing the combination


# -- reading and writing -----------------------------------------------------------------------------------------
M = TypeVar("M", bound=BaseModel)


class ScriptSummary(Record):
    """``summary.json`` of a GPU script of the lab (``integration/sleep_mode.py``: ``cases`` and ``pairs``;
    ``integration/connector_run.py``: ``rows``): tables of plain values, shown as they are."""

    cases: list[dict[str, Any]] = []
    pairs: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    components: list[dict[str, Any]] = []  # integration/worst_batch_run.py: per component, batch against load


class CurrentRun(Record):
    family: str
    run: str
    what: str | None = None


class RemovedRun(Record):
    run: str
    last_commit: str
    superseded_by: str | None = None
    showed: str | None = None


class RunsIndex(Record):
    """``reports/runs/current.json``: the current run of each case family, and the runs removed as superseded."""

    families: list[CurrentRun]
    removed: list[RemovedRun] = []


BadFile = files.BadInputFile  # a measurement file that cannot be read or is not in its format: names the file


def write(path: str | Path, model: BaseModel) -> Path:
    """``model`` as indented JSON in ``path`` (its folder made if needed), whole or not at all: written beside it and
    renamed into place, so a write cut short (an interrupt, a killed call) leaves the file as it was, never
    truncated (a resumed matrix reads what is there). ``path`` must be a regular file or a new name
    (``boundaries.outputs``: a FIFO or a device given as output is refused, never replaced)."""
    text = model.model_dump_json(indent=2, by_alias=True) + "\n"
    return outputs.write_file(path, text.encode("utf-8", "backslashreplace"), option="measurement file")


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def read(path: str | Path, model: type[M], *, folder: files.Folder | None = None) -> M:
    """The file at ``path`` as ``model``; ``BadFile`` naming the file and the field path where it is not. The file is
    read through ``boundaries.files`` (a regular file of at most 16 MiB, UTF-8; with ``folder``, inside it and counted
    against its limits)."""
    text = folder.read_text(Path(path)) if folder is not None else files.read_text(path)
    if not text.strip():
        raise BadFile(f"{path}: empty file")
    try:
        json.loads(text, parse_constant=_no_constant)
        return model.model_validate_json(text)
    except ValidationError as exc:
        raise BadFile(f"{path}: {_first_error(exc)}") from None
    except (ValueError, RecursionError) as exc:
        raise BadFile(f"{path}: not valid JSON, truncated or corrupt ({exc})") from None


# pydantic's error types in the words of JSON
_WANTED = {
    "model_type": "an object",
    "dict_type": "an object",
    "model_attributes_type": "an object",
    "list_type": "a list",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
    "greater_than_equal": "a non-negative integer",
    "finite_number": "a finite number",
}
_BRANCHES = ("int", "float", "constrained-int", "constrained-float")  # the branches of a Number (int | float)


def _first_error(exc: ValidationError) -> str:
    errors = exc.errors()
    err = errors[0]
    if err["loc"] and err["loc"][-1] in _BRANCHES:  # the branch that says more than "not an int"
        err = next((e for e in errors if e["loc"][:-1] == err["loc"][:-1] and not e["type"].endswith("_type")), err)
    loc, wanted = list(err["loc"]), _WANTED.get(err["type"])
    if loc and loc[-1] in _BRANCHES:
        loc, wanted = loc[:-1], wanted if err["type"] != "int_type" else "a number"
    bound = {**err.get("ctx", {})}
    if err["type"] in ("less_than", "greater_than"):
        limit = next(iter(bound.values()))
        wanted = f"{err['type'].replace('_', ' ')} {LIMIT_NAMES.get(limit, limit)}"
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "the top level"
    if err["type"] == "missing":
        return f"{where} is missing"
    if err["type"] == "value_error":  # a check across fields (a model validator): its own words say it all
        sep = "." if isinstance(bound.get("error"), OutOfBounds) else ": "
        return f"{where}{sep}{err['msg'].removeprefix('Value error, ')}".removeprefix("the top level" + sep)
    value = err.get("input")
    shown = {list: "a list", dict: "an object", type(None): "null"}.get(type(value))
    if shown is None and isinstance(value, int) and abs(value) >= 10**20:
        shown = f"a number of {len(str(abs(value)))} digits"
    shown = shown or json.dumps(value)[:60]
    return f"{where} should be {wanted}, got {shown}" if wanted else f"{where}: {err['msg']}, got {shown}"
