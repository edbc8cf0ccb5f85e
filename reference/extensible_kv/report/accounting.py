"""Memory accounting of the vLLM cases: where each byte of the GPU went, legacy and extensible side by side.

Every figure is derived from the case files alone, with the formula next to it (``HOW_TO_READ``). A figure whose
inputs are missing is ``None`` ("not measured"); nothing is ever filled in with a default.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..vllm.sizing import activation_to_come
from .loading import Case

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

HOW_TO_READ = [
    f"**{BEFORE}** = total - init_free: the CUDA context and anything else on the GPU before vLLM started.",
    f"**{WEIGHTS}** = memory.weights, **{PEAK}** = memory.profiled_peak_activation (vLLM's profiling run). The "
    "peak is not resident after warmup: it returns with the next batch as large as the profiling one, served first "
    "from torch's unused default-pool cache (memory.torch_reusable).",
    f"**{HEADROOM}** = max(0, profiled activation peak - memory.torch_reusable): what that batch still takes from "
    "free memory; not measured in runs that lack memory.torch_reusable (the plots then draw the whole peak as its "
    "upper bound).",
    f"**{GRAPHS}** = memory.cudagraph_memory (what capture_model returned). Runs that did not record it show it "
    f"as not measured, and the bar merges the graph pools into **{OTHER_WITH_GRAPHS}**.",
    f"**{KV}**: extensible runs: extensible.kv.committed_bytes (blocks x bytes per block). Legacy runs: "
    "memory.num_gpu_blocks x bytes_per_block of the extensible run of the same model, runner and backend "
    "(legacy files do not record bytes per block); not measured where there is no such run.",
    f"**{PADDING}** = extensible.kv.backed_bytes - committed_bytes (granule rounding of the mapped prefix).",
    "**non-KV after warmup** = init_free - free_after_warmup - KV bytes (committed + padding), for both modes. "
    "For extensible runs it is what the sizing measured (extensible.measured.non_kv) when nothing was allocated "
    "after the final commit.",
    f"**{OTHER}** = non-KV after warmup - weights - CUDA graph pools (where measured): torch's activation cache, "
    "non-torch memory (CUDA context growth, NCCL, cuBLAS workspaces), persistent buffers.",
    f"**{FREE}** = memory.free_after_warmup. The stacked segments are what is resident after warmup and add up to "
    "memory.total.",
    "**profiled non-KV estimate** = requested - available_kv_cache_memory (vLLM's own prediction; its parts are "
    "weights, activation peak, non-torch memory and the CUDA graph estimate). **over budget** = "
    "(init_free - requested) - free_after_warmup: memory used beyond gpu_memory_utilization after warmup "
    f"(negative: unused). **over budget at peak** = over budget + {HEADROOM}: the same when the activation peak "
    "comes back.",
]


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
    estimate: int | None
    estimate_parts: dict[str, int | None]
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
    def estimate_vs_measured(self) -> int | None:
        """Measured non-KV after warmup minus vLLM's estimate (positive: vLLM under-estimated)."""
        return _sub(self.non_kv_after_warmup, self.estimate)

    @property
    def tokens_match_legacy(self) -> bool | None:
        p = self.legacy_partner
        if p is None or p.token_ids is None or self.case.token_ids is None:
            return None
        return p.token_ids == self.case.token_ids

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


def _mem(case: Case, key: str) -> int | None:
    v = case.memory.get(key)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _bytes_per_block(case: Case) -> int | None:
    measured = (case.extensible or {}).get("measured") or {}
    v = measured.get("bytes_per_block")
    return int(v) if isinstance(v, int) else None


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
        ext = case.extensible or {}
        kv = ext.get("kv") or {}
        blocks = _mem(case, "num_gpu_blocks")
        legacy_partner = kv_partner = None
        if case.mode == "legacy":
            kv_partner = _partner(case, sized)
            bpb = _bytes_per_block(kv_partner) if kv_partner else None
            committed = blocks * bpb if blocks is not None and bpb else None
            padding = None
            source = (f"num_gpu_blocks x {bpb} bytes per block of integration/{kv_partner.path}"
                      if committed is not None else
                      "not measured: no extensible run of the same model, runner and backend")
        else:
            legacy_partner = _partner(case, legacy)
            bpb = _bytes_per_block(case)
            committed = kv.get("committed_bytes")
            backed = kv.get("backed_bytes")
            padding = backed - committed if isinstance(backed, int) and isinstance(committed, int) else None
            source = "extensible.kv.committed_bytes" if committed is not None else "not measured"
        requested, available = _mem(case, "requested"), _mem(case, "available_kv_cache_memory")
        parts = {"weights": _mem(case, "weights"), "activation peak": _mem(case, "profiled_peak_activation"),
                 "non-torch": _mem(case, "profiled_non_torch"), "CUDA graph estimate": _mem(case, "cudagraph_estimate")}
        measured = ext.get("measured") or {}
        commit = ext.get("commit_seconds")
        out.append(MemoryBreakdown(
            case=case, total=_mem(case, "total"), init_free=_mem(case, "init_free"),
            free_after_warmup=_mem(case, "free_after_warmup"), requested=requested, weights=_mem(case, "weights"),
            activation_peak=_mem(case, "profiled_peak_activation"),
            activation_reusable=_mem(case, "torch_reusable"), graph_pools=_mem(case, "cudagraph_memory"),
            kv_committed=committed if isinstance(committed, int) else None, kv_padding=padding, kv_source=source,
            bytes_per_block=bpb, blocks=blocks, estimate=_sub(requested, available), estimate_parts=parts,
            non_kv_sizing=measured.get("non_kv") if isinstance(measured.get("non_kv"), int) else None,
            commit_seconds=float(commit) if isinstance(commit, (int, float)) else None,
            legacy_partner=legacy_partner, kv_partner=kv_partner))
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
