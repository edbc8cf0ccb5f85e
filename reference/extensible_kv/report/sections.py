"""The report of one run: its ``Document`` (what report.md and report.html show) and its summary (summary.json).

Every number printed comes from the run's files, directly or through a formula named in the report. Where an input
is missing the report says "not measured", and summary.json holds ``null``.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from . import accounting as acc
from . import document as fmt
from .benchmarks import peer_rows, verdict
from .document import Bullets, Document, Figure, Paragraph, Section, Table
from .loading import ENVIRONMENT_NAMES, Bench, Run
from .matrix import cell_text, matrix_cells

NM = fmt.NOT_MEASURED


@dataclass
class Plotter:
    """The figures module, or why it cannot draw (matplotlib missing)."""

    module: object | None
    reason: str | None

    def figure(self, name: str, title: str, draw: str, *args: object) -> Figure:
        if self.module is None:
            return Figure(name, title, None, self.reason)
        return Figure(name, title, getattr(self.module, draw)(*args))


def plotter() -> Plotter:
    try:
        from . import figures  # noqa: PLC0415
    except ImportError as exc:
        return Plotter(None, f"matplotlib is not importable ({exc}); install the 'report' extra")
    return Plotter(figures, None)


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


# -- the report ------------------------------------------------------------------------------------------------------
def build(run: Run, plot: Plotter | None = None) -> tuple[Document, dict]:
    plot = plot or plotter()
    breakdowns = acc.account(run.cases)
    pairs = acc.block_pairs(breakdowns)
    sections = [glance_section(run, breakdowns, pairs), environment_section(run), inputs_section(run),
                conformance_section(run, plot), *bench_sections(run, plot),
                integration_section(run, breakdowns, pairs, plot), backend_section(run),
                consistency_section(run, breakdowns)]
    doc = Document(f"Memory-accounting report: {run.name}", sections)
    return doc, summary(run, breakdowns, pairs)


def glance_section(run: Run, breakdowns: list[acc.MemoryBreakdown], pairs: list[acc.BlockPair]) -> Section:
    items = []
    for c in run.conformance:
        for d in c.drivers:
            items.append(f"Conformance, driver {d.driver} ({c.source}): {fmt.count(d.passed)} passed, "
                         f"{fmt.count(d.failed)} failed, {fmt.count(d.skipped)} skipped"
                         + (f"; unavailable: {d.unavailable}" if d.unavailable else "") + ".")
    if not run.conformance:
        items.append(f"Conformance: {NM}.")
    for b in run.bench:
        ext = _extensible_commit(b)
        targets = [t for t in b.summary.get("targets", []) if t.get("met") is not None]
        items.append(f"Commit ({b.source}): ExtensibleTensor commits {fmt.gib(ext.get('bytes'))} GiB in "
                     f"{fmt.ms(ext.get('seconds'))} ms = {fmt.rate(ext.get('gbps'))} GB/s; targets met: "
                     + (f"{sum(1 for t in targets if t['met'])} of {len(targets)}." if targets else "n/a."))
    if not run.bench:
        items.append(f"Commit benchmarks: {NM}.")
    if breakdowns:
        clean = [b for b in breakdowns if b.case.mode != "legacy" and not b.case.corrupt]
        equal = [b for b in clean if b.tokens_match_legacy]
        corrupt = [b for b in breakdowns if b.case.corrupt]
        compared = [b for b in clean if b.tokens_match_legacy is not None]
        differ = [fmt.yes_no(None if b.tokens_match_legacy is None else not b.tokens_match_legacy) for b in corrupt]
        items.append(f"vLLM: {len(breakdowns)} case file(s); "
                     + (f"greedy tokens equal legacy in {len(equal)} of {len(compared)} uncorrupted non-legacy "
                        f"run(s) with a legacy partner" if compared else "no non-legacy run with a legacy partner")
                     + (f"; the corrupted run(s) differ from legacy: {', '.join(differ)}" if corrupt else "") + ".")
        deltas = [p.delta_bytes for p in pairs if p.delta_bytes is not None]
        if deltas:
            items.append(f"KV committed, extensible - legacy: {fmt.signed_mib(min(deltas))} to "
                         f"{fmt.signed_mib(max(deltas))} MiB over {len(deltas)} pair(s).")
        for mode, label in (("legacy", "legacy runs"), ("other", "extensible and entry-point runs")):
            runs = [b for b in breakdowns if (b.case.mode == "legacy") == (mode == "legacy")]
            for when, values in (("after warmup", [b.over_budget for b in runs]),
                                 ("with the activation peak to come", [b.over_budget_at_peak for b in runs])):
                over = [v for v in values if v is not None]
                if over:
                    span = fmt.signed_mib(min(over)) + ("" if min(over) == max(over) else
                                                        f" to {fmt.signed_mib(max(over))}")
                    items.append(f"Memory beyond gpu_memory_utilization {when}, {label}: {span} MiB"
                                 + (f" ({len(over)} of {len(runs)} run(s) recorded it)." if len(over) < len(runs)
                                    else "."))
    else:
        items.append(f"vLLM integration: {NM}.")
    if run.backend_checks:
        passed = sum(1 for c in run.backend_checks if c.result == "PASS")
        items.append(f"Backend validation: {passed} of {len(run.backend_checks)} backend/layout checks PASS.")
    else:
        items.append(f"Backend validation: {NM}.")
    return Section("At a glance").add(Bullets(items))


def environment_section(run: Run) -> Section:
    rows = [[ENVIRONMENT_NAMES.get(k, k), item.value if item.value is not None else "not recorded", item.source or "-"]
            for k, item in run.environment.items()]
    return Section("Environment").add(
        Paragraph(f"Run folder `{run.path.as_posix()}`. Each item comes from the file named beside it: measurement "
                  "JSON first, then `environment.json`, then the run's README for versions no JSON records."),
        Table(["item", "value", "source"], rows))


def inputs_section(run: Run) -> Section:
    rows = [["conformance", ", ".join(c.source for c in run.conformance) or NM],
            ["benchmarks", ", ".join(b.source for b in run.bench) or NM],
            ["vLLM integration", f"{len(run.cases)} case file(s) under integration/" if run.cases else NM],
            ["backend validation", ", ".join(run.backend_files) or NM]]
    s = Section("Inputs").add(Table(["input", "files"], rows))
    if run.missing:
        s.add(Paragraph("**Not measured in this run:**"), Bullets(run.missing))
    return s


# -- conformance -----------------------------------------------------------------------------------------------------
def conformance_section(run: Run, plot: Plotter) -> Section:
    s = Section("Conformance")
    if not run.conformance:
        return s.add(Paragraph(f"{NM}: no `conformance-*.json` in the run folder."))
    rows = []
    for c in run.conformance:
        for d in c.drivers:
            rows.append([c.source, d.driver, fmt.count(d.passed), fmt.count(d.failed), fmt.count(d.skipped),
                         fmt.count(d.granularity), fmt.rate(d.commit_gb_per_s), fmt.gib(d.commit_bytes),
                         fmt.text(c.exitstatus), d.unavailable or "-"])
    s.add(Paragraph("Counts per driver as the suite recorded them. The commit probe is one timed growth of the probe "
                    "size at the end of the suite (`conformance/conftest.py`), not a benchmark."),
          Table(["file", "driver", "passed", "failed", "skipped", "granularity (bytes)", "commit probe (GB/s)",
                 "probe size (GiB)", "exit status", "unavailable"], rows))
    rules, columns, cells = matrix_cells(run.conformance)
    if rules:
        s.add(plot.figure("conformance-matrix.png", "Conformance matrix: driver x rule", "conformance_matrix",
                          run.conformance))
        reasons = any(t.reason for c in run.conformance for t in c.tests)
        s.add(Paragraph("Each cell counts the rule's tests (its parametrizations) by outcome. " + (
                        "Reasons, where a file records them, are in the table of tests that did not pass."
                        if reasons else "The files record no skip reasons.")),
              Table(["rule"] + columns + (["skip reasons"] if reasons else []),
                    [[r] + [cell_text(cells.get((r, col))) for col in columns]
                     + ([_skip_reasons(run, r)] if reasons else []) for r in rules]))
    odd = [t for c in run.conformance for t in c.tests if t.outcome != "passed"]
    if odd:
        with_reason = any(t.reason for t in odd)
        cols = ["file", "driver", "test", "outcome"] + (["reason"] if with_reason else [])
        s.add(Paragraph("**Tests that did not pass:**"),
              Table(cols, [[t.source, t.driver, t.test, t.outcome] + ([t.reason or "-"] if with_reason else [])
                           for t in odd]))
    else:
        total = sum(len(c.tests) for c in run.conformance)
        s.add(Paragraph(f"All {total} recorded tests passed."))
    return s


def _skip_reasons(run: Run, rule: str) -> str:
    found = dict.fromkeys(f"{t.driver}: {t.reason}" for c in run.conformance for t in c.tests
                          if t.rule == rule and t.outcome == "skipped" and t.reason)
    return "; ".join(found) or "-"


# -- benchmarks ------------------------------------------------------------------------------------------------------
def _extensible_commit(b: Bench) -> dict:
    """The ``commit/extensible`` path of the summary (``{}`` when missing)."""
    return ((b.summary.get("commit") or {}).get("paths") or {}).get("extensible") or {}


def bench_sections(run: Run, plot: Plotter) -> list[Section]:
    if not run.bench:
        return [Section("Commit benchmarks").add(Paragraph(f"{NM}: no `bench-*.json` in the run folder."))]
    return [_bench_section(b, plot, len(run.bench) > 1) for b in run.bench]


def _bench_section(b: Bench, plot: Plotter, several: bool) -> Section:
    s = b.summary
    title = f"Commit benchmarks ({b.source})" if several else "Commit benchmarks"
    sec = Section(title).add(Paragraph(
        f"`{b.source}`: driver {fmt.text(s.get('driver'))} "
        f"({fmt.text(s.get('device_type'))}), granularity {fmt.count(s.get('granularity'))} bytes, scale "
        f"{fmt.text(s.get('scale'))}, taken {fmt.text(b.datetime)}. Time = median of the rounds; "
        "GB/s = bytes / s / 1e9."
        + ("" if s.get("claims") else " Not a GPU run: targets are not judged.")))
    sec.add(plot.figure(f"commit-throughput-{slug(b.source.removesuffix('.json'))}.png",
                        f"Commit throughput vs handle size and vs bytes ({b.source})", "commit_throughput", b))
    paths = (s.get("commit") or {}).get("paths") or {}
    if paths:
        sec.add(Paragraph("**Commit, one growth step (zero_new=False):**"),
                Table(["path", "bytes (GiB)", "median (ms)", "GB/s", "handles"],
                      [[p, fmt.gib(v.get("bytes")), fmt.ms(v.get("seconds")), fmt.rate(v.get("gbps")),
                        fmt.count(v.get("handles"))] for p, v in paths.items()]))
        c = s.get("commit") or {}
        sec.add(Paragraph(f"ExtensibleTensor speedup vs per-granule handles (per byte): "
                          f"{fmt.ratio(c.get('speedup_vs_per_granule'))}; time vs one handle (per byte): "
                          f"{fmt.ratio(c.get('time_vs_single_handle'))}."))
    peers = peer_rows(b)
    if any(p["seconds"] is not None for p in peers):
        sec.add(Paragraph("**Peers (the same bytes through torch's allocators):**"),
                Table(["peer", "bytes (GiB)", "median (ms)", "GB/s", "ExtensibleTensor time / peer time (per byte)"],
                      [[p["name"], fmt.gib(p["bytes"]), fmt.ms(p["seconds"]), fmt.rate(p["gbps"]),
                        fmt.ratio(p["ours_vs_peer"])] for p in peers]))
    kv = s.get("kv") or {}
    if kv:
        sec.add(Paragraph("**KV growth (all buffers in lockstep, one block to the full size):**"),
                Table(["case", "bytes (GiB)", "median (ms)", "buffers", "segments", "handles", "state"],
                      [[label, fmt.gib(v.get("bytes")), fmt.ms(v["ms"] / 1e3 if v.get("ms") is not None else None),
                        fmt.count(v.get("buffers")), fmt.count(v.get("segments")), fmt.count(v.get("handles")),
                        fmt.text(v.get("state"))] for label, v in kv.items()]))
    z = s.get("zero") or {}
    if z.get("bytes"):
        sec.add(Paragraph("**Zeroing:**"), Table(["figure", "value"], [
            ["bytes (GiB)", fmt.gib(z.get("bytes"))], ["grow + zero (ms)", fmt.ms(z.get("grow_zero_s"))],
            ["grow without zero (ms)", fmt.ms(z.get("grow_nozero_s"))],
            ["implied zero_new (ms)", fmt.ms(z.get("implied_zero_s"))],
            ["zero_new (GB/s)", fmt.rate(z.get("zero_gbps"))], ["memset (GB/s)", fmt.rate(z.get("memset_gbps"))],
            ["torch zero_ (GB/s)", fmt.rate(z.get("torch_zero_gbps"))],
            ["end-to-end grow + zero (GB/s)", fmt.rate(z.get("end_to_end_gbps"))],
            ["memset calls", fmt.count(z.get("zero_calls"))]]))
    access = s.get("access") or {}
    if access:
        sec.add(Paragraph("**Access bandwidth, VMM vs native memory:**"),
                Table(["op", "vmm (GB/s)", "native (GB/s)", "vmm / native"],
                      [[op, fmt.rate(a.get("vmm_gbps")), fmt.rate(a.get("native_gbps")), fmt.ratio(a.get("ratio"))]
                       for op, a in access.items()]))
    g = s.get("graph") or {}
    if g.get("before_s") is not None or g.get("after_s") is not None:
        sec.add(Paragraph("**CUDA graph replay:**"),
                Table(["before growth (us)", "after growth (us)", "after / before"],
                      [[fmt.us(g.get("before_s")), fmt.us(g.get("after_s")), fmt.ratio(g.get("ratio"))]]))
    rows = (s.get("scaling") or {}).get("rows") or []
    if rows:
        sec.add(Paragraph("**Scaling (time vs bytes and handles):**"),
                Table(["nominal (GiB)", "segments", "bytes (GiB)", "median (ms)", "GB/s", "handles",
                       "bytes per handle (MiB)", "us per handle"],
                      [[fmt.text(r.get("nominal_gib")), fmt.count(r.get("segments")), fmt.gib(r.get("bytes")),
                        fmt.ms(r.get("seconds")), fmt.rate(r.get("gbps")), fmt.count(r.get("handles")),
                        fmt.mib(r["bytes"] / r["handles"]) if r.get("bytes") and r.get("handles") else NM,
                        fmt.ratio(r.get("us_per_handle"))] for r in rows]))
    targets = s.get("targets") or []
    if targets:
        sec.add(Paragraph("**Targets** (as `python -m extensible_kv bench-summary` judges them):"),
                Table(["target", "value", "goal", "met"],
                      [[t["name"], fmt.ratio(t.get("value")), f"{t['op']} {fmt.ratio(t['target'])}",
                        verdict(t)] for t in targets]))
    return sec


# -- integration -----------------------------------------------------------------------------------------------------
def integration_section(run: Run, breakdowns: list[acc.MemoryBreakdown], pairs: list[acc.BlockPair],
                        plot: Plotter) -> Section:
    s = Section("vLLM integration: memory accounting")
    if not breakdowns:
        return s.add(Paragraph(f"{NM}: no `integration/**/*.json` in the run folder."))
    s.add(Section("How to read", level=3).add(Bullets(acc.HOW_TO_READ)))
    rows = []
    for b in breakdowns:
        c = b.case
        rows.append([c.path, c.model, c.runner, c.backend, c.mode + ("+corrupt" if c.corrupt else ""),
                     fmt.count(b.blocks), fmt.count(b.bytes_per_block), fmt.gib(b.kv_committed),
                     fmt.ms(b.commit_seconds),
                     fmt.mib(b.non_kv_after_warmup), "-" if c.mode == "legacy" else fmt.yes_no(b.tokens_match_legacy),
                     fmt.text(c.num_cached_tokens)])
    s.add(Section("Cases", level=3).add(
        Paragraph("One row per case file. Tokens = legacy compares the greedy token ids with the legacy run of the "
                  "same model, runner and backend (the corrupted run must differ)."),
        Table(["case file", "model", "runner", "backend", "mode", "KV blocks", "bytes per block",
               "KV committed (GiB)", "final commit (ms)", "non-KV after warmup (MiB)", "tokens = legacy",
               "cached tokens"], rows)))
    mem = Section("Memory breakdown", level=3)
    mem.add(Table(["case file", "total", acc.BEFORE, acc.WEIGHTS, acc.GRAPHS, "other non-KV", acc.KV,
                   acc.PADDING, acc.FREE, "requested", "over budget", acc.PEAK, acc.HEADROOM, "over budget at peak"],
                  [[b.case.path, fmt.mib(b.total), fmt.mib(b.before_engine), fmt.mib(b.weights),
                    fmt.mib(b.graph_pools), fmt.mib(b.other_non_kv),
                    fmt.mib(b.kv_committed), "-" if b.case.mode == "legacy" else fmt.mib(b.kv_padding),
                    fmt.mib(b.free_after_warmup), fmt.mib(b.requested), fmt.signed_mib(b.over_budget),
                    fmt.mib(b.activation_peak), fmt.mib(b.activation_headroom), fmt.signed_mib(b.over_budget_at_peak)]
                   for b in breakdowns]))
    mem.add(Paragraph("All columns in MiB. The columns from total to free are resident after warmup; the "
                      "activation peak columns say what the next batch as large as the profiling one adds. " + (
        "CUDA graph pools are not measured in this run (no memory.cudagraph_memory): other non-KV includes them."
        if all(b.graph_pools is None for b in breakdowns) else
        "Where CUDA graph pools are not measured, other non-KV includes them.")))
    kv_sources = sorted({f"{b.case.path}: {b.kv_source}" for b in breakdowns if b.case.mode == "legacy"})
    if kv_sources:
        mem.add(Paragraph("KV committed of the legacy runs:"), Bullets(kv_sources))
    for group, members in acc.groups(breakdowns).items():
        title = " ".join(group)
        mem.add(plot.figure(f"memory-{slug(title)}.png", f"GPU memory, legacy vs extensible: {title}",
                            "memory_stack", title, members))
    s.add(mem)
    est = Section("Profiled non-KV estimate vs measured", level=3)
    est.add(Table(["case file", "vLLM estimate (MiB)", "weights", "activation peak", "non-torch", "CUDA graph estimate",
                   "measured after warmup (MiB)", "measured at sizing (MiB)", "measured - estimate (MiB)"],
                  [[b.case.path, fmt.mib(b.estimate), fmt.mib(b.estimate_parts["weights"]),
                    fmt.mib(b.estimate_parts["activation peak"]), fmt.mib(b.estimate_parts["non-torch"]),
                    fmt.mib(b.estimate_parts["CUDA graph estimate"]), fmt.mib(b.non_kv_after_warmup),
                    "-" if b.case.mode == "legacy" else fmt.mib(b.non_kv_sizing),
                    fmt.signed_mib(b.estimate_vs_measured)] for b in breakdowns]))
    est.add(Paragraph("Estimate parts in MiB. Measured at sizing is extensible.measured.non_kv (legacy runs have no "
                      "such measurement)."))
    est.add(plot.figure("non-kv-estimate.png", "vLLM's profiled non-KV estimate vs the measured non-KV memory",
                        "non_kv_estimate", breakdowns))
    s.add(est)
    blk = Section("KV blocks, legacy vs extensible", level=3)
    if pairs:
        blk.add(Table(["case file", "legacy file", "legacy blocks", "blocks", "difference (blocks)",
                       "difference (% of legacy)", "difference (MiB)"],
                      [[p.other.case.path, p.legacy.case.path, fmt.count(p.legacy.blocks), fmt.count(p.other.blocks),
                        fmt.signed_count(p.delta_blocks), fmt.percent(p.delta_percent), fmt.signed_mib(p.delta_bytes)]
                       for p in pairs]))
        blk.add(plot.figure("kv-blocks.png", "KV blocks, legacy vs extensible", "kv_blocks", pairs))
    else:
        blk.add(Paragraph(f"{NM}: no legacy and extensible runs of the same model, runner and backend."))
    s.add(blk)
    ext = [b for b in breakdowns if b.case.extensible]
    if ext:
        rows = []
        for b in ext:
            e = b.case.extensible
            kv = e.get("kv") or {}
            events = "; ".join(f"{ev.get('reason')}: {ev.get('from')} -> {ev.get('to')}"
                               for ev in e.get("events") or [])
            rows.append([b.case.path, fmt.gib(kv.get("reserved_bytes")), fmt.gib(kv.get("committed_bytes")),
                         fmt.gib(kv.get("backed_bytes")), fmt.mib(kv.get("waste_bytes")),
                         fmt.count(kv.get("max_num_blocks")), fmt.ms(b.commit_seconds), fmt.text(e.get("segments")),
                         events or NM])
        s.add(Section("Extensible KV cache", level=3).add(
            Table(["case file", "reserved (GiB)", "committed (GiB)", "backed (GiB)", "waste (MiB)",
                   "capacity (blocks)", "final commit (ms)", "segments per buffer", "growth steps (blocks)"], rows)))
    return s


# -- backend validation ----------------------------------------------------------------------------------------------
def backend_section(run: Run) -> Section:
    s = Section("Backend validation")
    if not run.backend_files:
        return s.add(Paragraph(f"{NM}: no `validate-backend*.txt` in the run folder."))
    if not run.backend_checks:
        return s.add(Paragraph(f"{NM}: {', '.join(run.backend_files)} hold(s) no `backend ...` stanza."))
    s.add(Paragraph("Parsed from the `backend ...` and `  result` lines of `python -m extensible_kv validate-backend`; "
                    "a failed check is named in the last column."),
          Table(["backend", "layout", "driver", "shape", "stride order", "block dim", "segments", "page (bytes)",
                 "result", "checks not ok"],
                [[c.backend, c.layout, c.driver, c.shape, c.stride_order, fmt.count(c.block_dim),
                  fmt.count(c.segments), fmt.count(c.page_bytes), c.result or "no result line",
                  ", ".join(n for n, st, _ in c.checks if st != "ok") or "-"] for c in run.backend_checks]))
    if run.backend_totals:
        s.add(Bullets(run.backend_totals))
    return s


# -- consistency -----------------------------------------------------------------------------------------------------
def consistency_rows(run: Run, breakdowns: list[acc.MemoryBreakdown]) -> list[tuple[str, bool, str]]:
    """Cross-checks between figures that should agree: (check, agrees, detail)."""
    rows = []
    for b in breakdowns:
        ext = b.case.extensible
        if not ext:
            continue
        kv, measured = ext.get("kv") or {}, ext.get("measured") or {}
        counts = {"memory.num_gpu_blocks": b.blocks, "extensible.kv.num_blocks": kv.get("num_blocks"),
                  "extensible.measured.blocks": measured.get("blocks")}
        known = {k: v for k, v in counts.items() if v is not None}
        rows.append(("block counts agree (memory, kv, measured)", len(set(known.values())) == 1,
                     f"{b.case.path}: " + ", ".join(f"{k} {fmt.count(v)}" for k, v in known.items())))
        if b.blocks is not None and b.bytes_per_block and b.kv_committed is not None:
            expect = b.blocks * b.bytes_per_block
            rows.append(("committed bytes = blocks x bytes per block", expect == b.kv_committed,
                         f"{b.case.path}: {fmt.count(b.kv_committed)} vs {fmt.count(expect)}"))
        if b.non_kv_sizing is not None and b.non_kv_after_warmup is not None:
            rows.append(("non-KV at sizing = non-KV after warmup (nothing allocated after the final commit)",
                         b.non_kv_sizing == b.non_kv_after_warmup,
                         f"{b.case.path}: {fmt.mib(b.non_kv_sizing)} vs {fmt.mib(b.non_kv_after_warmup)} MiB"))
    same: dict[str, list[acc.MemoryBreakdown]] = {}
    for b in breakdowns:
        same.setdefault(case_key(b.case), []).append(b)
    for key, members in same.items():
        if len(members) > 1:
            blocks = {m.case.path: m.blocks for m in members}
            rows.append(("a repeated case gives the same blocks", len(set(blocks.values())) == 1,
                         f"{key}: " + ", ".join(f"{p} {fmt.count(v)}" for p, v in blocks.items())))
    bench_rate = next(((_extensible_commit(b).get("gbps"), b.source) for b in run.bench), None)
    for c in run.conformance:
        for d in c.drivers:
            if bench_rate and bench_rate[0] and d.commit_gb_per_s:
                r = d.commit_gb_per_s / bench_rate[0]
                rows.append(("conformance commit probe within 2x of the benchmark's commit rate", 0.5 <= r <= 2,
                             f"{c.source} {d.driver}: {fmt.rate(d.commit_gb_per_s)} GB/s (one timed growth of "
                             f"{fmt.gib(d.commit_bytes)} GiB) vs {bench_rate[1]} commit/extensible "
                             f"{fmt.rate(bench_rate[0])} GB/s: {r:.2f}x"))
    return rows


def consistency_section(run: Run, breakdowns: list[acc.MemoryBreakdown]) -> Section:
    s = Section("Consistency of the inputs")
    rows = consistency_rows(run, breakdowns)
    if not rows:
        return s.add(Paragraph(f"{NM}: no figures to cross-check."))
    table = []
    for check in dict.fromkeys(r[0] for r in rows):
        mine = [r for r in rows if r[0] == check]
        agree = [r for r in mine if r[1]]
        if agree:
            table.append([check, "ok", f"{len(agree)} of {len(mine)} agree" + ("" if len(agree) < len(mine) or
                                                                               len(mine) > 1 else f": {agree[0][2]}")])
        table += [[check, "differs", r[2]] for r in mine if not r[1]]
    return s.add(Paragraph("Figures that should agree, checked against each other. \"differs\" is not an error of "
                           "the report: it points at the measurements."),
                 Table(["check", "result", "detail"], table))


# -- summary.json ----------------------------------------------------------------------------------------------------
def summary_of(run: Run) -> dict:
    breakdowns = acc.account(run.cases)
    return summary(run, breakdowns, acc.block_pairs(breakdowns))


def summary(run: Run, breakdowns: list[acc.MemoryBreakdown], pairs: list[acc.BlockPair]) -> dict:
    rules, columns, cells = matrix_cells(run.conformance)
    return {
        "run": run.name,
        "run_folder": run.path.as_posix(),
        "environment": {k: {"value": v.value, "source": v.source} for k, v in run.environment.items()},
        "not_measured": list(run.missing),
        "conformance": [{
            "source": c.source, "exitstatus": c.exitstatus, "torch": c.torch,
            "drivers": [{"driver": d.driver, "passed": d.passed, "failed": d.failed, "skipped": d.skipped,
                         "granularity": d.granularity, "commit_gb_per_s": d.commit_gb_per_s,
                         "commit_bytes": d.commit_bytes, "unavailable": d.unavailable} for d in c.drivers],
            "outcomes": dict(Counter(t.outcome for t in c.tests)),
            "not_passed": [{"driver": t.driver, "test": t.test, "outcome": t.outcome, "reason": t.reason}
                           for t in c.tests if t.outcome != "passed"],
        } for c in run.conformance],
        "conformance_matrix": {"columns": columns,
                               "rules": {r: {col: dict(cells[(r, col)]) for col in columns if (r, col) in cells}
                                         for r in rules}},
        "bench": [{"source": b.source, "datetime": b.datetime,
                   "summary": b.summary, "peers": peer_rows(b)} for b in run.bench],
        "integration": {
            "cases": [_case_summary(b) for b in breakdowns],
            "pairs": [{"legacy": p.legacy.case.path, "other": p.other.case.path, "legacy_blocks": p.legacy.blocks,
                       "blocks": p.other.blocks, "delta_blocks": p.delta_blocks, "delta_percent": p.delta_percent,
                       "delta_bytes": p.delta_bytes} for p in pairs],
        },
        "backend_validation": {
            "checks": [{"source": c.source, "backend": c.backend, "layout": c.layout, "driver": c.driver,
                        "shape": c.shape, "stride_order": c.stride_order, "block_dim": c.block_dim,
                        "segments": c.segments, "page_bytes": c.page_bytes, "result": c.result,
                        "checks_not_ok": [n for n, st, _ in c.checks if st != "ok"]} for c in run.backend_checks],
            "totals": list(run.backend_totals),
        },
    }


def _case_summary(b: acc.MemoryBreakdown) -> dict:
    c = b.case
    segs = b.segments()
    return {
        "path": c.path, "key": case_key(c), "model": c.model, "runner": c.runner, "backend": c.backend,
        "mode": c.mode, "corrupt": c.corrupt, "blocks": b.blocks, "bytes_per_block": b.bytes_per_block,
        "commit_seconds": b.commit_seconds, "total": b.total, "requested": b.requested,
        "before_engine": b.before_engine, "weights": b.weights, "activation_peak": b.activation_peak,
        "graph_pools": b.graph_pools, "other_non_kv": b.other_non_kv, "kv_committed": b.kv_committed,
        "kv_padding": b.kv_padding, "kv_source": b.kv_source, "free_after_warmup": b.free_after_warmup,
        "non_kv_after_warmup": b.non_kv_after_warmup, "non_kv_sizing": b.non_kv_sizing,
        "non_kv_estimate": b.estimate, "non_kv_estimate_parts": b.estimate_parts,
        "measured_minus_estimate": b.estimate_vs_measured, "over_budget": b.over_budget,
        "activation_reusable": b.activation_reusable, "activation_headroom": b.activation_headroom,
        "over_budget_at_peak": b.over_budget_at_peak,
        "tokens_match_legacy": b.tokens_match_legacy if c.mode != "legacy" else None,
        "num_cached_tokens": c.num_cached_tokens,
        "legacy_partner": b.legacy_partner.path if b.legacy_partner else None,
        "kv_partner": b.kv_partner.path if b.kv_partner else None,
        "segments": [{"label": s.label, "bytes": s.bytes} for s in segs] if segs is not None else None,
    }


def case_key(case) -> str:
    """How comparison matches cases between runs: model/runner/backend/mode[+corrupt]."""
    return f"{case.model}/{case.runner}/{case.backend}/{case.mode}" + ("+corrupt" if case.corrupt else "")
