"""Memory accounting of the vLLM cases: where each byte of the GPU went, legacy and extensible side by side.

Every figure is derived from the case files alone; the report prints the formulas ("How to read" in
``templates/integration.md.j2``). A figure whose inputs are missing is ``None`` ("not measured"); nothing is ever
filled in with a default.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..vllm.sizing import activation_to_come
from .run import Case

BEFORE = "in use before engine start"
WEIGHTS = "weights"
PEAK = "profiled activation peak"
HEADROOM = "activation peak still to come"
GRAPHS = "CUDA graph pools"
OTHER = "other non-KV"
OTHER_WITH_GRAPHS = "other non-KV (incl. CUDA graph pools)"
KV = "KV committed"
PADDING = "KV granule padding"
FREE = "free after warmup"
UNSPLIT = "KV + other non-KV (KV not measured)"
SEGMENT_ORDER = (BEFORE, WEIGHTS, GRAPHS, OTHER, OTHER_WITH_GRAPHS, UNSPLIT, KV, PADDING, FREE)


@dataclass(frozen=True)
class Segment:
    label: str
    bytes: int | None


@dataclass(frozen=True)
class MemoryBreakdown:
    """One case's memory, each figure in bytes (``None``: not measured)."""

    case: Case
    total: int | None
    init_free: int | None
    free_after_warmup: int | None
    requested: int | None
    weights: int | None
    activation_peak: int | None
    activation_reusable: int | None  # memory.torch_reusable
    graph_pools: int | None
    kv_committed: int | None
    kv_padding: int | None
    kv_source: str  # where kv_committed comes from, in words
    bytes_per_block: int | None
    blocks: int | None
    non_kv_estimate: int | None
    non_kv_estimate_parts: dict[str, int | None]
    non_kv_sizing: int | None  # extensible.measured.non_kv
    commit_seconds: float | None
    legacy_partner: Case | None  # the legacy run a non-legacy run is compared with
    kv_partner: Case | None  # the extensible run a legacy run takes bytes per block from

    @property
    def before_engine(self) -> int | None:
        return _sub(self.total, self.init_free)

    @property
    def kv_bytes(self) -> int | None:
        if self.kv_committed is None:
            return None
        return self.kv_committed + (self.kv_padding or 0)

    @property
    def non_kv_after_warmup(self) -> int | None:
        return _sub(_sub(self.init_free, self.free_after_warmup), self.kv_bytes)

    @property
    def other_non_kv(self) -> int | None:
        rest = _sub(self.non_kv_after_warmup, self.weights)
        return rest if self.graph_pools is None else _sub(rest, self.graph_pools)

    @property
    def activation_headroom(self) -> int | None:
        if self.activation_peak is None or self.activation_reusable is None:
            return None
        return activation_to_come(self.activation_peak, self.activation_reusable)

    @property
    def over_budget(self) -> int | None:
        return _sub(_sub(self.init_free, self.requested), self.free_after_warmup)

    @property
    def over_budget_at_peak(self) -> int | None:
        h = self.activation_headroom
        return None if h is None or self.over_budget is None else self.over_budget + h

    @property
    def measured_minus_estimate(self) -> int | None:
        """Measured non-KV after warmup minus vLLM's estimate (positive: vLLM under-estimated)."""
        return _sub(self.non_kv_after_warmup, self.non_kv_estimate)

    @property
    def tokens_match_legacy(self) -> bool | None:
        p = self.legacy_partner
        if p is None or p.data.token_ids is None or self.case.data.token_ids is None:
            return None
        return p.data.token_ids == self.case.data.token_ids

    def segments(self) -> list[Segment] | None:
        """The stacked bar of resident memory after warmup, bottom to top; ``None`` when the case lacks total,
        init_free or free_after_warmup."""
        if None in (self.total, self.init_free, self.free_after_warmup):
            return None
        out = [Segment(BEFORE, self.before_engine), Segment(WEIGHTS, self.weights)]
        if self.kv_committed is None:
            engine = self.init_free - self.free_after_warmup
            out.append(Segment(UNSPLIT, _sub(engine, self.weights)))
        else:
            if self.graph_pools is not None:
                out.append(Segment(GRAPHS, self.graph_pools))
            out.append(Segment(OTHER if self.graph_pools is not None else OTHER_WITH_GRAPHS, self.other_non_kv))
            out.append(Segment(KV, self.kv_committed))
            if self.kv_padding is not None:
                out.append(Segment(PADDING, self.kv_padding))
        out.append(Segment(FREE, self.free_after_warmup))
        return out


def _sub(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


def _bytes_per_block(case: Case) -> int | None:
    ext = case.data.extensible
    return ext.measured.bytes_per_block if ext and ext.measured else None


def _partner(case: Case, candidates: list[Case]) -> Case | None:
    """The candidate of the same model, runner and backend, from the same subfolder if there is one, else the first
    by path; corrupted runs and entry-point runs only when nothing else is there."""
    same = [c for c in candidates if c.group == case.group and c is not case]
    if not same:
        return None
    return min(same, key=lambda c: (c.folder != case.folder, c.corrupt, c.mode != "extensible" and c.mode != "legacy",
                                    c.path))


def account(cases: list[Case]) -> list[MemoryBreakdown]:
    legacy = [c for c in cases if c.mode == "legacy"]
    sized = [c for c in cases if c.mode != "legacy" and _bytes_per_block(c)]
    out = []
    for case in cases:
        m, ext = case.data.memory, case.data.extensible
        kv = ext.kv if ext and ext.kv else None
        legacy_partner = kv_partner = padding = None
        if case.mode == "legacy":
            kv_partner = _partner(case, sized)
            bpb = _bytes_per_block(kv_partner) if kv_partner else None
            committed = m.num_gpu_blocks * bpb if m.num_gpu_blocks is not None and bpb else None
            source = (f"num_gpu_blocks x {bpb} bytes per block of integration/{kv_partner.path}"
                      if committed is not None else
                      "not measured: no extensible run of the same model, runner and backend")
        else:
            legacy_partner = _partner(case, legacy)
            bpb = _bytes_per_block(case)
            committed = kv.committed_bytes if kv else None
            padding = _sub(kv.backed_bytes, committed) if kv else None
            source = "extensible.kv.committed_bytes" if committed is not None else "not measured"
        out.append(MemoryBreakdown(
            case=case, total=m.total, init_free=m.init_free, free_after_warmup=m.free_after_warmup,
            requested=m.requested, weights=m.weights, activation_peak=m.profiled_peak_activation,
            activation_reusable=m.torch_reusable, graph_pools=m.cudagraph_memory, kv_committed=committed,
            kv_padding=padding, kv_source=source, bytes_per_block=bpb, blocks=m.num_gpu_blocks,
            non_kv_estimate=_sub(m.requested, m.available_kv_cache_memory),
            non_kv_estimate_parts={"weights": m.weights, "activation peak": m.profiled_peak_activation,
                            "non-torch": m.profiled_non_torch, "CUDA graph estimate": m.cudagraph_estimate},
            non_kv_sizing=ext.measured.non_kv if ext and ext.measured else None,
            commit_seconds=ext.commit_seconds if ext else None, legacy_partner=legacy_partner,
            kv_partner=kv_partner))
    return out


@dataclass(frozen=True)
class BlockPair:
    """KV blocks of a non-legacy run against its legacy partner."""

    legacy: MemoryBreakdown
    other: MemoryBreakdown

    @property
    def delta_blocks(self) -> int | None:
        return _sub(self.other.blocks, self.legacy.blocks)

    @property
    def delta_percent(self) -> float | None:
        d = self.delta_blocks
        return d / self.legacy.blocks * 100.0 if d is not None and self.legacy.blocks else None

    @property
    def delta_bytes(self) -> int | None:
        d = self.delta_blocks
        return d * self.other.bytes_per_block if d is not None and self.other.bytes_per_block else None


def block_pairs(breakdowns: list[MemoryBreakdown]) -> list[BlockPair]:
    by_case = {id(b.case): b for b in breakdowns}
    return [BlockPair(by_case[id(b.legacy_partner)], b) for b in breakdowns
            if b.case.mode != "legacy" and b.legacy_partner is not None]


def groups(breakdowns: list[MemoryBreakdown]) -> dict[tuple[str, str, str], list[MemoryBreakdown]]:
    """Breakdowns by (model, runner, backend), legacy first, then by path."""
    out: dict[tuple[str, str, str], list[MemoryBreakdown]] = {}
    for b in sorted(breakdowns, key=lambda b: (b.case.group, b.case.mode != "legacy", b.case.path)):
        out.setdefault(b.case.group, []).append(b)
    return out
