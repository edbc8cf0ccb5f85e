"""Memory accounting of the vLLM cases: where each byte of the GPU went, legacy and extensible side by side.

Every figure is derived from the case files alone; the report prints the formulas ("How to read",
``templates/integration.md.j2``). A figure whose inputs are missing is ``None`` ("not measured"), never a default.
"""

from __future__ import annotations

from dataclasses import dataclass

from .numbers import div, sub
from .run import Case

BEFORE, WEIGHTS, PEAK = "in use before engine start", "weights", "profiled activation peak"
HEADROOM, GRAPHS, OTHER = "torch growth at the measured peak", "CUDA graph pools", "other non-KV"
OTHER_WITH_GRAPHS, KV, PADDING = "other non-KV (incl. CUDA graph pools)", "KV committed", "KV granule padding"
FREE, UNSPLIT = "free after warmup", "KV + other non-KV (KV not measured)"
SEGMENT_ORDER = (BEFORE, WEIGHTS, GRAPHS, OTHER, OTHER_WITH_GRAPHS, UNSPLIT, KV, PADDING, FREE)


def _memory(field: str, part: str | None = None) -> property:
    """A figure of the case's memory (``measurements.CaseMemory``) under its name in the report, or of a ``part`` of it
    (``peak``, ``encoder_cache``, ``speculative``): ``None`` if that part is absent."""
    if part is None:
        return property(lambda self: getattr(self.case.data.memory, field))
    return property(lambda self: getattr(getattr(self.case.data.memory, part, None), field, None))


@dataclass(frozen=True)
class Segment:
    label: str
    bytes: int | None


@dataclass(frozen=True)
class MemoryBreakdown:
    """One case's memory in bytes (``None``: not measured). ``kv_partner``: the extensible run a legacy run takes
    bytes per block from; ``legacy_partner``: the legacy run a non-legacy run is compared with."""

    case: Case
    kv_committed: int | None
    kv_padding: int | None
    kv_source: str  # where kv_committed comes from, in words
    bytes_per_block: int | None
    legacy_partner: Case | None
    kv_partner: Case | None

    total, init_free, free_after_warmup = _memory("total"), _memory("init_free"), _memory("free_after_warmup")
    requested, weights, blocks = _memory("requested"), _memory("weights"), _memory("num_gpu_blocks")
    activation_peak, activation_reusable = _memory("profiled_peak_activation"), _memory("torch_reusable")
    graph_pools = _memory("cudagraph_memory")

    non_kv_estimate = property(lambda self: sub(self.requested, self.case.data.memory.available_kv_cache_memory))
    non_kv_estimate_parts = property(
        lambda self: {
            "weights": self.weights,
            "activation peak": self.activation_peak,
            "non-torch": self.case.data.memory.profiled_non_torch,
            "CUDA graph estimate": self.case.data.memory.cudagraph_estimate,
        }
    )
    non_kv_sizing = property(lambda self: getattr(getattr(self.case.data.extensible, "measured", None), "non_kv", None))
    commit_seconds = property(lambda self: getattr(self.case.data.extensible, "commit_seconds", None))
    before_engine = property(lambda self: sub(self.total, self.init_free))
    over_budget = property(lambda self: sub(sub(self.init_free, self.requested), self.free_after_warmup))
    # measured non-KV after warmup minus vLLM's estimate (positive: vLLM under-estimated)
    measured_minus_estimate = property(lambda self: sub(self.non_kv_after_warmup, self.non_kv_estimate))

    @property
    def non_kv_after_warmup(self) -> int | None:
        kv = None if self.kv_committed is None else self.kv_committed + (self.kv_padding or 0)
        return sub(sub(self.init_free, self.free_after_warmup), kv)

    @property
    def other_non_kv(self) -> int | None:
        rest = sub(self.non_kv_after_warmup, self.weights)
        return rest if self.graph_pools is None else sub(rest, self.graph_pools)

    # measured at a peak-shaped batch after the final commit, never derived from the profiled peak
    activation_headroom, over_budget_at_peak = _memory("torch_growth", "peak"), _memory("over_budget_measured", "peak")
    over_budget_phase = _memory("over_budget_phase", "peak")
    # the memory vLLM's profile does not see: the encoder cache (multimodal) and the widest speculative step
    encoder_cache_profiled = _memory("profiled_bytes", "encoder_cache")
    encoder_cache_held = _memory("held_bytes", "encoder_cache")
    encoder_cache_items = _memory("items_held", "encoder_cache")
    encoder_cache_capacity = _memory("capacity_items", "encoder_cache")
    speculative_step = _memory("step_peak_allocated", "speculative")
    speculative_growth = _memory("step_reserved_growth", "speculative")
    speculative_rows = _memory("rows", "speculative")
    speculative_over_budget = _memory("over_budget_measured", "speculative")

    @property
    def tokens_match_legacy(self) -> bool | None:
        mine, theirs = self.case.data.token_ids, self.legacy_partner and self.legacy_partner.data.token_ids
        return None if mine is None or theirs is None else mine == theirs

    def segments(self) -> list[Segment] | None:
        """The stacked bar of resident memory after warmup, bottom to top; ``None`` when a figure it needs is absent."""
        if None in (self.total, self.init_free, self.free_after_warmup):
            return None
        out = [Segment(BEFORE, self.before_engine), Segment(WEIGHTS, self.weights)]
        if self.kv_committed is None:
            out.append(Segment(UNSPLIT, sub(self.init_free - self.free_after_warmup, self.weights)))
        else:
            out += [Segment(GRAPHS, self.graph_pools)] if self.graph_pools is not None else []
            out.append(Segment(OTHER if self.graph_pools is not None else OTHER_WITH_GRAPHS, self.other_non_kv))
            out += [Segment(KV, self.kv_committed)]
            out += [Segment(PADDING, self.kv_padding)] if self.kv_padding is not None else []
        return out + [Segment(FREE, self.free_after_warmup)]


def _bytes_per_block(case: Case | None) -> int | None:
    ext = case and case.data.extensible
    return ext.measured.bytes_per_block if ext and ext.measured else None


def _partner(case: Case, candidates: list[Case]) -> Case | None:
    """The candidate of the same case (``Case.same_case``), from the same subfolder if there is one, else the first
    run by path (``Case.run_order``); corrupted and entry-point runs only when nothing else is there."""
    same = [c for c in candidates if c.same_case == case.same_case and c is not case]
    return min(
        same,
        key=lambda c: (c.folder != case.folder, c.corrupt, c.mode not in ("extensible", "legacy"), c.run_order),
        default=None,
    )


def refused(cases: list[Case]) -> list[Case]:
    """Cases whose engine vLLM (or the extensible path) refused to build: they have a reason and no memory."""
    return [c for c in cases if c.data.memory is None]


def account(cases: list[Case]) -> list[MemoryBreakdown]:
    """The memory breakdown of every case that built an engine (``refused`` lists the others)."""
    cases = [c for c in cases if c.data.memory is not None]
    legacy = [c for c in cases if c.mode == "legacy"]
    sized = [c for c in cases if c.mode != "legacy" and _bytes_per_block(c)]
    out = []
    for case in cases:
        if case.mode == "legacy":
            partner = _partner(case, sized)
            bpb, blocks = _bytes_per_block(partner), case.data.memory.num_gpu_blocks
            committed = blocks * bpb if blocks is not None and bpb else None
            source = "not measured: no extensible run of the same case"
            if committed is not None:
                source = f"num_gpu_blocks x {bpb} bytes per block of integration/{partner.path}"
            out.append(MemoryBreakdown(case, committed, None, source, bpb, None, partner))
        else:
            kv = case.data.extensible.kv if case.data.extensible else None
            committed, padding = (kv.committed_bytes, sub(kv.backed_bytes, kv.committed_bytes)) if kv else (None, None)
            source = "extensible.kv.committed_bytes" if committed is not None else "not measured"
            partner = _partner(case, legacy)
            out.append(MemoryBreakdown(case, committed, padding, source, _bytes_per_block(case), partner, None))
    return out


@dataclass(frozen=True)
class BlockPair:
    """KV blocks of a non-legacy run against its legacy partner: the difference in blocks, % of legacy and bytes."""

    legacy: MemoryBreakdown
    other: MemoryBreakdown

    delta_blocks = property(lambda self: sub(self.other.blocks, self.legacy.blocks))

    @property
    def delta_percent(self) -> float | None:
        share = div(self.delta_blocks, self.legacy.blocks)
        return None if share is None else share * 100.0

    @property
    def delta_bytes(self) -> int | None:
        per_block = self.other.bytes_per_block
        return None if self.delta_blocks is None or not per_block else self.delta_blocks * per_block


def block_pairs(breakdowns: list[MemoryBreakdown]) -> list[BlockPair]:
    by_case = {id(b.case): b for b in breakdowns}
    return [BlockPair(by_case[id(b.legacy_partner)], b) for b in breakdowns if b.legacy_partner is not None]


RUNS_PER_FIGURE = 4  # the runs one memory figure shows: at its fixed width, each run's labels stay legible


def groups(breakdowns: list[MemoryBreakdown]) -> dict[tuple[str, ...], list[MemoryBreakdown]]:
    """Breakdowns by (model, runner, backend), legacy first, then by path; a group of more than ``RUNS_PER_FIGURE``
    runs in parts of at most that many (its key ends with "part 1 of 3")."""
    found: dict[tuple[str, ...], list[MemoryBreakdown]] = {}
    for b in sorted(breakdowns, key=lambda b: (b.case.group, b.case.mode != "legacy", b.case.path)):
        found.setdefault(b.case.group, []).append(b)
    out = {}
    for group, runs in found.items():
        parts = [runs[i : i + RUNS_PER_FIGURE] for i in range(0, len(runs), RUNS_PER_FIGURE)]
        for n, part in enumerate(parts, 1):
            out[(*group, f"part {n} of {len(parts)}") if len(parts) > 1 else group] = part
    return out
