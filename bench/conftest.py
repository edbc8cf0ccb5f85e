"""Driver, sizes, rounds and cleanup for the benchmarks in ``bench/``.

Options:

- ``--bench-driver SPEC``: the driver to benchmark (a registered name or ``module:factory``); default: the best
  available one (``cuda`` on a working GPU, else ``host``). Without it the first driver of ``--driver`` is used (the
  conformance suite's option: its plugin is loaded here when it is not installed). A driver that cannot run here skips
  every benchmark with its probe's reason (unless
  ``EXTENSIBLE_KV_REQUIRE_GPU=1``, which makes a run without a GPU driver fail).
- ``--bench-scale X``: multiplies every size. On a GPU sizes are the published ones (32 GiB, 100 GiB, ...) times X. On a
  CPU driver they are scaled down automatically (32 GiB -> 64 MiB, 100 GiB -> 128 MiB, 64 KV buffers -> 8) so the
  host run is a quick smoke test; X then multiplies those.
- ``--bench-settle S``: seconds to wait before a "fresh" round, after the previous round's memory was released
  (default 1 s on a GPU, 0 on the host). The cost of a commit depends on what was freed just before it (earlier
  H200 runs saw 15 ms vs 95-190 ms for the same KV growth), so "fresh" rounds wait and ``after_release`` rounds do not.

Sizes are always multiples of ``driver.granularity()``. Every benchmark records what it measured in
``benchmark.extra_info`` under a stable ``key`` that ``extensible_kv_lab.report.benchmarks`` reads; at the end of a run
with benchmarks
enabled the summary table is printed.
"""

from __future__ import annotations

import gc
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from conformance import load_plugin
from extensible_kv import drivers
from extensible_kv.errors import DriverLoadError, DriverUnavailable

from ._vmm import close_quietly

REQUIRE_GPU_ENV = "EXTENSIBLE_KV_REQUIRE_GPU"
HOST_REASON = "host driver: semantics only, no GPU peers"

MIB, GIB = 1 << 20, 1 << 30
# Nominal sizes (GiB on a GPU) -> bytes on a CPU driver: small enough for a 2-core CI runner, large enough that
# every shape (64 segments, K/V split) still has whole granules.
HOST_BYTES = {1: 8 * MIB, 8: 32 * MIB, 32: 64 * MIB, 100: 128 * MIB}
GPU_KV_BUFFERS, HOST_KV_BUFFERS = 64, 8
FREE_MARGIN = {True: 1 * GIB, False: 64 * MIB}  # keep this much device memory free (GPU, host)

_SPEC = pytest.StashKey[str]()
_NOTHING_SAVED = "Not saving anything"
_BENCH_WARNING = "pytest_benchmark.logger.PytestBenchmarkWarning"


# -- options --------------------------------------------------------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("extensible-kv-bench", "extensible-kv benchmarks (bench/)")
    group.addoption(
        "--bench-driver",
        action="store",
        default=None,
        help="driver to benchmark: a registered name (cuda, host, host-4k) or module:factory; "
        "default: the best available driver",
    )
    group.addoption(
        "--bench-scale",
        action="store",
        type=float,
        default=None,
        help="multiply every benchmark size (default 1.0; CPU drivers are scaled down automatically)",
    )
    group.addoption(
        "--bench-settle",
        action="store",
        type=float,
        default=None,
        help="seconds to wait after a release before a 'fresh' round (default: 1 on GPUs, 0 on the host)",
    )


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    load_plugin(pluginmanager)  # --driver


def pytest_configure(config: pytest.Config) -> None:
    # pyproject turns warnings into errors; pytest-benchmark warns at session end when --benchmark-json is given but
    # every benchmark was skipped (no usable driver), which would end the run in an internal error, not in skips.
    # Its session-end hook runs outside pytest's per-hook warning filters on some pytest versions and inside them on
    # others, so the exemption goes into both the ini filters and the filters active now.
    config.addinivalue_line("filterwarnings", f"default:{_NOTHING_SAVED}:{_BENCH_WARNING}")
    try:
        from pytest_benchmark.logger import PytestBenchmarkWarning
    except ImportError:
        pass
    else:
        warnings.filterwarnings("default", message=_NOTHING_SAVED, category=PytestBenchmarkWarning)
    spec = config.getoption("--bench-driver")
    if not spec:
        raw = config.getoption("driver", default=None)
        specs = [s.strip() for s in raw.split(",") if s.strip()] if raw else []
        spec = specs[0] if specs else drivers.best_available()
    config.stash[_SPEC] = spec


def pytest_report_header(config: pytest.Config) -> list[str]:
    spec = config.stash.get(_SPEC, None)
    if spec is None:
        return []
    try:
        reason = drivers.probe(spec) if ":" not in spec else None
    except DriverLoadError as exc:
        reason = str(exc)
    scale = config.getoption("--bench-scale")
    return [
        f"bench: driver {spec} ({'available' if reason is None else 'unavailable: ' + reason}), "
        f"scale {scale if scale is not None else 'default'}"
    ]


# -- the environment every benchmark gets ---------------------------------------------------------------------------
@dataclass
class BenchEnv:
    """The driver under benchmark and the run's sizes, rounds and settle time."""

    driver: object
    spec: str
    scale: float
    settle_s: float
    full_scale: bool = field(init=False)
    granularity: int = field(init=False)

    def __post_init__(self) -> None:
        self.full_scale = self.driver.device.type != "cpu"
        self.granularity = self.driver.granularity()

    @property
    def is_cuda(self) -> bool:
        return self.driver.device.type == "cuda"

    @property
    def kv_buffers(self) -> int:
        return GPU_KV_BUFFERS if self.full_scale else HOST_KV_BUFFERS

    def nbytes(self, gib: int, multiple: int = 1) -> int:
        """The benchmark size for a nominal ``gib`` GiB: scaled, then rounded down to whole granules (and
        ``multiple``), never below one unit."""
        unit = math.lcm(self.granularity, multiple)
        raw = gib * GIB if self.full_scale else HOST_BYTES.get(gib, gib * 2 * MIB)
        return max(unit, int(raw * self.scale) // unit * unit)

    def rounds(self, gpu: int, host: int) -> int:
        return gpu if self.full_scale else host

    def require_gpu(self) -> None:
        if not self.is_cuda:
            pytest.skip(
                HOST_REASON
                if self.driver.device.type == "cpu"
                else f"{self.spec} runs on {self.driver.device.type}: no CUDA peers"
            )

    def release_cached(self) -> None:
        """Drop garbage and return torch's cached device blocks, so the next allocation really allocates."""
        gc.collect()
        if self.is_cuda:
            torch.cuda.synchronize(self.driver.device)
            torch.cuda.empty_cache()

    def require_free(self, nbytes: int) -> None:
        """Skip unless ``nbytes`` (plus a margin) are free on the device, after freeing everything cached."""
        self.release_cached()
        free, total = self.driver.mem_info()
        margin = FREE_MARGIN[self.full_scale]
        if free < nbytes + margin:
            pytest.skip(
                f"needs {nbytes / GIB:.2f} GiB (+{margin / GIB:.2f} GiB margin) free on "
                f"{self.driver.device}; {free / GIB:.2f} GiB of {total / GIB:.2f} GiB are free"
            )

    def settle(self) -> None:
        """Let the device settle after a release: what a 'fresh' round starts from."""
        self.driver.synchronize()
        if self.settle_s > 0:
            time.sleep(self.settle_s)

    def info(self, key: str, **extra: object) -> dict:
        """The common ``extra_info`` of a benchmark: its summary key, the driver and the run's scale."""
        return {
            "key": key,
            "driver": self.driver.name,
            "device": str(self.driver.device),
            "device_type": self.driver.device.type,
            "granularity": self.granularity,
            "scale": self.scale,
            "settle_s": self.settle_s,
            **extra,
        }


@pytest.fixture(scope="session")
def bench_env(pytestconfig: pytest.Config) -> BenchEnv:
    """The driver to benchmark; skips every benchmark (with the probe's reason) when it cannot run here."""
    spec = pytestconfig.stash[_SPEC]
    try:
        driver = drivers.get_driver(spec)
    except (DriverUnavailable, DriverLoadError) as exc:
        if os.environ.get(REQUIRE_GPU_ENV) == "1":
            pytest.fail(f"{REQUIRE_GPU_ENV}=1 but the benchmark driver {spec!r} cannot run: {exc}", pytrace=False)
        pytest.skip(f"benchmark driver {spec!r} cannot run here: {exc}")
    if os.environ.get(REQUIRE_GPU_ENV) == "1" and driver.device.type == "cpu":
        pytest.fail(f"{REQUIRE_GPU_ENV}=1 but the benchmark driver {spec!r} runs on the CPU", pytrace=False)
    full_scale = driver.device.type != "cpu"
    scale = pytestconfig.getoption("--bench-scale")
    settle = pytestconfig.getoption("--bench-settle")
    env = BenchEnv(
        driver, spec, 1.0 if scale is None else scale, (1.0 if full_scale else 0.0) if settle is None else settle
    )
    _warm(driver)
    return env


def _warm(driver) -> None:
    """One granule through every driver call, so no benchmark pays first-call costs (symbol lookup, context)."""
    g = driver.granularity()
    va = driver.reserve(g, g)
    try:
        handle = driver.create(g)
        try:
            driver.map(va, g, handle, 0)
        finally:
            driver.release(handle)
        driver.set_access(va, g)
        driver.zero(va, g)
        driver.synchronize()
        driver.unmap(va, g)
    finally:
        driver.free(va, g)


class Keeper:
    """What a benchmark made that must be released: closeables (tensors, raw commits) and torch tensors.

    ``close_all()`` runs in the setup of the next round (so rounds never overlap in memory) and at teardown.
    """

    def __init__(self, env: BenchEnv | None) -> None:
        self.env = env
        self.items: list[object] = []

    def keep(self, obj):
        self.items.append(obj)
        return obj

    def close_all(self) -> None:
        while self.items:
            obj = self.items.pop()
            if callable(getattr(obj, "close", None)):
                close_quietly(obj)
            del obj  # torch tensors: dropping the last reference frees them
        if self.env is not None and self.env.is_cuda:
            torch.cuda.synchronize(self.env.driver.device)
            torch.cuda.empty_cache()


@pytest.fixture
def keeper(bench_env: BenchEnv):
    k = Keeper(bench_env)
    yield k
    k.close_all()
    bench_env.release_cached()


# -- end of run: where it ran, and the summary table ----------------------------------------------------------------
def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    """The GPU, its driver and the torch/CUDA versions go into the JSON's ``machine_info.environment``, and into
    ``environment.json`` beside ``--benchmark-json`` (``extensible_kv.record.environment``)."""
    from extensible_kv import record

    env = record.environment()
    machine_info["environment"] = env
    out = config.getoption("benchmark_json", default=None)
    if out:
        record.write(Path(str(out)).resolve().parent / "environment.json", env)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    session = getattr(config, "_benchmarksession", None)  # pytest-benchmark's session (no public accessor)
    benchmarks = getattr(session, "benchmarks", None) if session is not None else None
    if not benchmarks:
        return
    try:
        from extensible_kv_lab.report.benchmarks import summarize_data
        from extensible_kv_lab.report.rendering import bench_tables
    except ModuleNotFoundError as exc:  # the lab (pip install ./lab) draws the table; the JSON is written without it
        terminalreporter.write_line(f"extensible-kv benchmark summary: not shown ({exc.name} is not installed)")
        return
    try:
        data = {"benchmarks": [b.as_dict(include_data=False) for b in benchmarks if not b.has_error]}
        summary = summarize_data(data)
        table = bench_tables(summary, "this run") if summary["keys"] else None
    except Exception as exc:  # the summary must never turn a finished benchmark run into an internal error
        terminalreporter.write_line(f"extensible-kv benchmark summary failed: {type(exc).__name__}: {exc}")
        return
    if table:
        terminalreporter.section("extensible-kv benchmark summary")
        for line in table.splitlines():
            terminalreporter.write_line(line)
