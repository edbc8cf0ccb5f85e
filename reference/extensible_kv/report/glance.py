"""The report's first section: one line per input, with the figures that matter most."""

from __future__ import annotations

from .accounting import BlockPair, MemoryBreakdown
from .numbers import NOT_MEASURED, number
from .run import Run


def _span(values: list[int]) -> str:
    low, high = number(min(values), "MiB", True), number(max(values), "MiB", True)
    return low if low == high else f"{low} to {high}"


def glance(run: Run, breakdowns: list[MemoryBreakdown], pairs: list[BlockPair]) -> list[str]:
    items = [f"Conformance, driver {d.driver} ({c.source}): {number(d.passed)} passed, {number(d.failed)} failed, "
             f"{number(d.skipped)} skipped" + (f"; unavailable: {d.unavailable}" if d.unavailable else "") + "."
             for c in run.conformance for d in c.data.drivers] or [f"Conformance: {NOT_MEASURED}."]
    for b in run.bench:
        ext = b.summary["commit"]["paths"].get("extensible", {})
        judged = [t["met"] for t in b.summary["targets"] if t["met"] is not None]
        items.append(f"Commit ({b.source}): ExtensibleTensor commits {number(ext.get('bytes'), 'GiB')} GiB in "
                     f"{number(ext.get('seconds'), 'ms')} ms = {number(ext.get('gbps'), 'GB/s')} GB/s; targets met: "
                     + (f"{sum(judged)} of {len(judged)}." if judged else "n/a."))
    if not run.bench:
        items.append(f"Commit benchmarks: {NOT_MEASURED}.")
    if not breakdowns:
        items.append(f"vLLM integration: {NOT_MEASURED}.")
    else:
        clean = [b for b in breakdowns if b.case.mode != "legacy" and not b.case.corrupt]
        compared = [b for b in clean if b.tokens_match_legacy is not None]
        corrupt = [b for b in breakdowns if b.case.corrupt]
        differ = [number(None if b.tokens_match_legacy is None else not b.tokens_match_legacy) for b in corrupt]
        items.append(f"vLLM: {len(breakdowns)} case file(s); "
                     + (f"greedy tokens equal legacy in {sum(b.tokens_match_legacy for b in compared)} of "
                        f"{len(compared)} uncorrupted non-legacy run(s) with a legacy partner" if compared
                        else "no non-legacy run with a legacy partner")
                     + (f"; the corrupted run(s) differ from legacy: {', '.join(differ)}" if corrupt else "") + ".")
        deltas = [p.delta_bytes for p in pairs if p.delta_bytes is not None]
        if deltas:
            items.append(f"KV committed, extensible - legacy: {_span(deltas)} MiB over {len(deltas)} pair(s).")
        for legacy, label in ((True, "legacy runs"), (False, "extensible and entry-point runs")):
            runs = [b for b in breakdowns if (b.case.mode == "legacy") == legacy]
            for when, values in (("after warmup", [b.over_budget for b in runs]),
                                 ("with the activation peak to come", [b.over_budget_at_peak for b in runs])):
                over = [v for v in values if v is not None]
                if over:
                    items.append(f"Memory beyond gpu_memory_utilization {when}, {label}: {_span(over)} MiB"
                                 + (f" ({len(over)} of {len(runs)} run(s) recorded it)." if len(over) < len(runs)
                                    else "."))
    results = [r for f in run.backends for r in f.data.results]
    items.append(f"Backend validation: {sum(r.ok for r in results)} of {len(results)} backend/layout checks PASS."
                 if run.backends else f"Backend validation: {NOT_MEASURED}.")
    return items
