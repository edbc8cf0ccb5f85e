"""Backend validation: does an attention backend's KV cache layout work with lockstep block-prefix commits?

``validate_backend`` derives the layout from the backend's own ``get_kv_cache_shape`` and
``get_kv_cache_stride_order``, builds a KV buffer on a driver, commits a prefix of blocks, writes every committed
block through the backend's own view shape, and checks that

1. the committed blocks' bytes lie inside the committed prefixes (no view reaches uncommitted memory),
2. no byte outside them changed (sentinels in backed-but-uncommitted bytes survive the writes),
3. every committed block reads back what was written,
4. after growth the data survives, the new blocks are zero, and the view's address did not move.

Run it as ``python -m extensible_kv validate-backend NAME|module:Class``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .drivers import Driver, Ledger, resolve
from .errors import ExtensibleKVError
from .kv_cache import ExtensibleKVCacheBuffers, KVBuffer
from .layout import LayoutError, attention_layer, footprint


class BackendLoadError(ExtensibleKVError, ValueError):
    """A backend name or ``module:Class`` spec could not be resolved."""


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class BackendReport:
    backend: str
    kv_layout: str | None
    driver: str = "-"
    shape: tuple[int, ...] | None = None
    stride_order: tuple[int, ...] | None = None
    block_dim: int | None = None
    segments: int | None = None
    page_size_bytes: int | None = None
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def failure(self) -> str:
        """The first check that failed, in words."""
        bad = next((c for c in self.checks if not c.ok), None)
        return f"{bad.name}: {bad.detail}" if bad else "no check ran"

    def add(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append(Check(name, ok, detail))
        return ok

    def lines(self) -> list[str]:
        head = (
            f"backend {self.backend} (layout {self.kv_layout or '-'}) on driver {self.driver}: shape {self.shape}, "
            f"stride order {self.stride_order}, block dim {self.block_dim}, segments {self.segments}, "
            f"page {self.page_size_bytes} bytes"
        )
        width = max(len(c.name) for c in self.checks) if self.checks else 5
        rows = [f"  {c.name:<{width}}  {'ok  ' if c.ok else 'FAIL'}  {c.detail}" for c in self.checks]
        return [head, *rows, f"  {'result':<{width}}  {'PASS' if self.ok else 'FAIL'}"]


def check_spec(spec: str) -> str:
    """``spec`` if it is a backend name or a ``module:Class`` with both parts, else ``BackendLoadError``."""
    module_name, colon, attr = spec.partition(":")
    if not spec or (colon and not (module_name and attr)):
        raise BackendLoadError(f"backend {spec!r} is neither a vLLM backend name nor module:Class")
    return spec


BACKEND_FAULTS = (Exception, SystemExit, GeneratorExit)
"""What a backend's own code may raise that is its failure, reported for that backend while the others are still
checked: ``SystemExit`` too (a backend that calls ``sys.exit`` must not end the run silently, with nothing
reported); a ``KeyboardInterrupt`` is the user's and ends the run."""


def resolve_backend(spec: str) -> type:
    """A vLLM ``AttentionBackendEnum`` name (needs vllm) or ``module:Class``."""
    if ":" in check_spec(spec):
        module_name, _, attr = spec.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except BACKEND_FAULTS as exc:  # the module's own import may fail in any way
            raise BackendLoadError(f"backend {spec!r} could not be loaded: {exc}") from exc
        return cls
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError as exc:
        raise BackendLoadError(
            f"backend name {spec!r} needs vllm (install the 'vllm' extra), or pass module:Class: {exc}"
        ) from exc
    if spec not in AttentionBackendEnum.__members__:
        raise BackendLoadError(
            f"unknown vLLM attention backend {spec!r}; known: {', '.join(sorted(AttentionBackendEnum.__members__))}"
        )
    try:
        return AttentionBackendEnum[spec].get_class()
    except BACKEND_FAULTS as exc:  # a backend module may fail to import on this machine (missing kernels)
        raise BackendLoadError(f"vLLM backend {spec} does not import here: {type(exc).__name__}: {exc}") from exc


@contextmanager
def kv_cache_layout(layout: str | None) -> Iterator[None]:
    """Set vLLM's KV cache layout (NHD/HND) for the block where vllm is importable (backends outside vLLM do
    not read it); restore it after."""
    try:
        from vllm.v1.attention.backends.utils import set_kv_cache_layout
    except ImportError:
        set_kv_cache_layout = None
    if layout is None or set_kv_cache_layout is None:
        yield
        return

    set_kv_cache_layout(layout)
    try:
        yield
    finally:
        set_kv_cache_layout(None)


def _block_values(view: torch.Tensor, block_dim: int, n: int) -> torch.Tensor:
    """Values that differ per block (1..16, exact in every float and int KV dtype), shaped like ``view``."""
    shape = [1] * view.dim()
    shape[block_dim] = n
    vals = (torch.arange(n) % 16 + 1).reshape(shape).expand(*view.shape[:block_dim], n, *view.shape[block_dim + 1 :])
    return vals.to(view.dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes on the CPU: compares every KV dtype, fp8 included, exactly."""
    return t.cpu().contiguous().view(torch.uint8)


def validate_backend(
    backend: type,
    *,
    driver: Driver | str | None = None,
    kv_layout: str | None = None,
    num_kv_heads: int = 4,
    head_size: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    cache_dtype_str: str = "auto",
    max_blocks: int | None = None,
) -> BackendReport:
    """Run the checks of the module docstring; never raises for a backend's fault, reports it instead."""
    name = getattr(backend, "__name__", str(backend))
    report = BackendReport(name, kv_layout)
    try:
        driver = resolve(driver)
    except ExtensibleKVError as exc:
        report.add("driver", False, str(exc))
        return report
    with kv_cache_layout(kv_layout):
        try:
            layer = attention_layer(
                "layer",
                backend,
                block_size=block_size,
                num_kv_heads=num_kv_heads,
                head_size=head_size,
                dtype=dtype,
                cache_dtype_str=cache_dtype_str,
            )
            report.shape, report.stride_order = layer.shape_of(1), layer.stride_order
            report.block_dim = block_dim = layer.block_dim  # each read asks the backend for its shape again
            report.page_size_bytes = page = layer.page_size_bytes()
        except BACKEND_FAULTS as exc:  # the backend's own code: whatever it raises is its failure
            report.add("layout", False, f"{type(exc).__name__}: {exc}")
            return report
    if page <= 0:
        report.add("layout", False, f"shape(num_blocks=1) {report.shape} holds {page} bytes per block")
        return report
    report.add("layout", True, f"shape(num_blocks=1) {report.shape}, stride order {report.stride_order}")
    ledger = Ledger(driver)
    report.driver = driver.name
    g = driver.granularity()
    max_blocks = max_blocks or max(64, math.ceil(4 * g / page) * 2)
    try:
        cache = ExtensibleKVCacheBuffers([KVBuffer("kv", page, (layer,))], max_blocks, driver=ledger)
    except LayoutError as exc:
        report.add("segments", False, str(exc))
        return report
    except ExtensibleKVError as exc:  # the reservation does not fit the driver
        report.add("fits the driver", False, _does_not_fit(driver, page, max_blocks, exc))
        return report
    except BACKEND_FAULTS as exc:  # the views ask the backend for its shape again: whatever it raises is its failure
        report.add("backend", False, f"get_kv_cache_shape raised {type(exc).__name__} building the views: {exc}")
        left = ledger.outstanding()
        report.add("no leaks", not left, f"after the failed construction: {left}")
        return report
    try:
        _exercise(report, cache, block_dim, page, max_blocks, ledger)
    except ExtensibleKVError as exc:  # a commit the driver cannot hold (CommitOutOfMemory) or refuses
        report.add("fits the driver", False, _does_not_fit(driver, page, max_blocks, exc))
    except BACKEND_FAULTS as exc:  # the backend's shape asked again for the views
        report.add("backend", False, f"get_kv_cache_shape raised {type(exc).__name__} during the checks: {exc}")
    finally:
        try:
            cache.close()
        except ExtensibleKVError as exc:
            report.add("close", False, f"{type(exc).__name__}: {exc}")
    left = ledger.outstanding()
    report.add("no leaks", not left, f"after close: {left}")
    return report


def _does_not_fit(driver: Driver, page: int, max_blocks: int, exc: Exception) -> str:
    """One line: the page size, the block count and the driver's limit, and the error that said so."""
    try:
        free, total = driver.mem_info()
        limit = f"{total} bytes ({free} free)"
    except Exception as info_exc:  # the driver's own call; the size error is the finding
        limit = f"unknown (mem_info raised {type(info_exc).__name__})"
    return " ".join(
        f"page {page} bytes x {max_blocks} blocks = {page * max_blocks} bytes reserved; driver "
        f"{driver.name} holds {limit}: {type(exc).__name__}: {exc}".split()
    )


def _exercise(
    report: BackendReport, cache: ExtensibleKVCacheBuffers, block_dim: int, page: int, max_blocks: int, driver: Driver
) -> None:
    t = cache.tensor("kv")
    segs = t.num_segments
    report.segments = segs
    report.add("segments", True, f"{segs} segment(s) of {t.segment_bytes} bytes, {page // segs} bytes per block each")
    n1, n2 = max_blocks // 4 + 1, max_blocks // 2 + 3
    cache.ensure_blocks(n1)
    per_seg = n1 * (page // segs)
    committed = [(k * t.segment_bytes, k * t.segment_bytes + per_seg) for k in range(segs)]
    full = cache.layer_views("layer")[0]
    used = footprint(full, block_dim, n1)
    outside = [(lo, hi) for lo, hi in used if not any(c_lo <= lo and hi <= c_hi for c_lo, c_hi in committed)]
    if not report.add(
        "blocks inside commit",
        not outside,
        f"blocks [0, {n1}) occupy {len(used)} byte range(s); outside the committed prefixes: {outside[:3] or 'none'}",
    ):
        return  # writing would touch uncommitted memory
    # Sentinels in bytes that are backed (same granules) but not committed.
    raw = t.full_view()
    g = t.granularity
    sentinels = []
    for lo, hi in committed:
        end = min(-(-hi // g) * g, lo + t.segment_bytes)  # the rest of the last backed granule, in this segment
        if end > hi:
            raw[hi:end].fill_(0xEE)
            sentinels.append((hi, end))
    view = cache.committed_layer_views("layer")[0]
    values = _block_values(view, block_dim, n1).to(view.device)
    view.copy_(values)
    driver.synchronize()
    touched = sum(int((raw[lo:hi] != 0xEE).sum()) for lo, hi in sentinels)
    report.add(
        "uncommitted untouched",
        touched == 0,
        f"{touched} of {sum(hi - lo for lo, hi in sentinels)} sentinel bytes after the committed prefixes changed",
    )
    same = bool(torch.equal(_bytes(view), _bytes(values)))
    report.add("blocks read back", same, f"{n1} blocks written through view shape {tuple(full.shape)}")
    ptr = full.data_ptr()
    cache.ensure_blocks(n2)
    driver.synchronize()
    grown = cache.committed_layer_views("layer")[0]
    kept = bool(torch.equal(_bytes(grown.narrow(block_dim, 0, n1)), _bytes(values)))
    new_zero = not bool(_bytes(grown.narrow(block_dim, n1, n2 - n1)).any())
    moved = cache.layer_views("layer")[0].data_ptr() != ptr
    report.add(
        "survives growth",
        kept and new_zero and not moved,
        f"grown {n1}->{n2} blocks: old data {'kept' if kept else 'CHANGED'}, new blocks "
        f"{'zero' if new_zero else 'NOT zero'}, address {'moved' if moved else 'stable'}",
    )


def validate_many(specs: list[str], layouts: list[str | None], **kwargs: Any) -> list[BackendReport]:
    """Validate each backend spec under each layout; a spec that does not load is a failed report."""
    reports = []
    for spec in specs:
        for layout in layouts:
            try:
                report = validate_backend(resolve_backend(spec), kv_layout=layout, **kwargs)
            except BackendLoadError as exc:
                report = BackendReport(spec, layout)
                report.add("load", False, str(exc))
            report.backend = spec
            reports.append(report)
    return reports
