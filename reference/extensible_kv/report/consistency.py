"""Cross-checks between figures of a run that should agree. "differs" points at the measurements, not the report."""

from __future__ import annotations

from .accounting import MemoryBreakdown
from .numbers import number
from .run import Run


def checks(run: Run, breakdowns: list[MemoryBreakdown]) -> list[tuple[str, bool, str]]:
    """(check, agrees, detail), one per thing checked."""
    rows = []
    for b in breakdowns:
        ext, path = b.case.data.extensible, b.case.path
        if not ext:
            continue
        counts = {"memory.num_gpu_blocks": b.blocks, "extensible.kv.num_blocks": ext.kv and ext.kv.num_blocks,
                  "extensible.measured.blocks": ext.measured and ext.measured.blocks}
        known = {k: v for k, v in counts.items() if v is not None}
        rows.append(("block counts agree (memory, kv, measured)", len(set(known.values())) == 1,
                     f"{path}: " + ", ".join(f"{k} {number(v)}" for k, v in known.items())))
        if b.blocks is not None and b.bytes_per_block and b.kv_committed is not None:
            expect = b.blocks * b.bytes_per_block
            rows.append(("committed bytes = blocks x bytes per block", expect == b.kv_committed,
                         f"{path}: {number(b.kv_committed)} vs {number(expect)}"))
        if b.non_kv_sizing is not None and b.non_kv_after_warmup is not None:
            rows.append(("non-KV at sizing = non-KV after warmup (nothing allocated after the final commit)",
                         b.non_kv_sizing == b.non_kv_after_warmup,
                         f"{path}: {number(b.non_kv_sizing, 'MiB')} vs {number(b.non_kv_after_warmup, 'MiB')} MiB"))
    same: dict[tuple, list[MemoryBreakdown]] = {}
    for b in breakdowns:  # repeats: every setting the same (Case.same_case), and the same mode and variant
        same.setdefault((b.case.same_case, b.case.variant, bool(getattr(b.case.spec, "batch_invariant", False))),
                        []).append(b)
    for members in same.values():
        if len(members) > 1:
            blocks = {m.case.path: m.blocks for m in members}
            rows.append(("a repeated case gives the same blocks", len(set(blocks.values())) == 1,
                         f"{members[0].case.key}: " + ", ".join(f"{p} {number(v)}" for p, v in blocks.items())))
    rate = next(((b.summary["commit"]["paths"].get("extensible", {}).get("gbps"), b.source) for b in run.bench), None)
    for c in run.conformance:
        for d in c.data.drivers:
            if rate and rate[0] and d.commit_gb_per_s:
                r = d.commit_gb_per_s / rate[0]
                rows.append(("conformance commit probe within 2x of the benchmark's commit rate", 0.5 <= r <= 2,
                             f"{c.source} {d.driver}: {number(d.commit_gb_per_s, 'GB/s')} GB/s (one timed growth of "
                             f"{number(d.commit_bytes, 'GiB')} GiB) vs {rate[1]} commit/extensible "
                             f"{number(rate[0], 'GB/s')} GB/s: {r:.2f}x"))
    return rows
