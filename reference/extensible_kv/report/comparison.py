"""Two runs side by side (before/after a change, one GPU against another): every figure both runs have, with its
delta. The delta is run - baseline; the percentage is the delta over the baseline's magnitude.

Figures are read from each run's summary (the dict written to summary.json), so both runs are described the same
way. A figure one run lacks reads "not measured" there and has no delta.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import document as fmt
from .document import Bullets, Document, Paragraph, Section, Table
from .loading import Run
from .sections import ENVIRONMENT_NAMES, Plotter, plotter, summary_of

NM = fmt.NOT_MEASURED

# unit -> (format of a value, format of a delta)
_FORMATS = {
    "count": ("{:,.0f}", "{:+,.0f}"),
    "ms": ("{:,.3f}", "{:+,.3f}"),
    "us": ("{:,.1f}", "{:+,.1f}"),
    "GB/s": ("{:,.2f}", "{:+,.2f}"),
    "MiB": ("{:,.2f}", "{:+,.2f}"),
    "GiB": ("{:,.3f}", "{:+,.3f}"),
    "ratio": ("{:.4g}", "{:+.4g}"),
}


@dataclass(frozen=True)
class Metric:
    group: str
    name: str
    unit: str
    value: float | None


@dataclass(frozen=True)
class Delta:
    group: str
    name: str
    unit: str
    run: float | None
    baseline: float | None

    @property
    def delta(self) -> float | None:
        return None if self.run is None or self.baseline is None else self.run - self.baseline

    @property
    def percent(self) -> float | None:
        d = self.delta
        return d / abs(self.baseline) * 100.0 + 0.0 if d is not None and self.baseline else None

    def row(self) -> list[str]:
        value, signed = _FORMATS[self.unit]
        return [self.name, self.unit, NM if self.baseline is None else value.format(self.baseline),
                NM if self.run is None else value.format(self.run),
                "-" if self.delta is None else signed.format(self.delta),
                "-" if self.percent is None else f"{self.percent:+.2f} %"]


def _num(x: object) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return x


def _scaled(x: object, factor: float) -> float | None:
    v = _num(x)
    return None if v is None else v * factor


def metrics(s: dict) -> list[Metric]:
    """The comparable figures of one run summary, in report order."""
    out: list[Metric] = []
    for c in s.get("conformance", []):
        for d in c["drivers"]:
            g = f"conformance ({d['driver']}, {c['source']})"
            out += [Metric(g, "passed", "count", _num(d["passed"])), Metric(g, "failed", "count", _num(d["failed"])),
                    Metric(g, "skipped", "count", _num(d["skipped"])),
                    Metric(g, "commit probe", "GB/s", _num(d["commit_gb_per_s"]))]
    for b in s.get("bench", []):
        g = f"benchmarks ({b['source']})"
        sm = b["summary"]
        for path, p in (sm.get("commit") or {}).get("paths", {}).items():
            out += [Metric(g, f"commit {path}: median", "ms", _scaled(p.get("seconds"), 1e3)),
                    Metric(g, f"commit {path}: rate", "GB/s", _num(p.get("gbps")))]
        for p in b.get("peers", []):
            out += [Metric(g, f"peer {p['name']}: median", "ms", _scaled(p.get("seconds"), 1e3)),
                    Metric(g, f"peer {p['name']}: rate", "GB/s", _num(p.get("gbps")))]
        for label, kv in (sm.get("kv") or {}).items():
            out.append(Metric(g, f"KV growth {label}: median", "ms", _num(kv.get("ms"))))
        z = sm.get("zero") or {}
        if z:
            out += [Metric(g, "zero_new rate", "GB/s", _num(z.get("zero_gbps"))),
                    Metric(g, "memset rate", "GB/s", _num(z.get("memset_gbps")))]
        for op, a in (sm.get("access") or {}).items():
            out += [Metric(g, f"access {op}: vmm", "GB/s", _num(a.get("vmm_gbps"))),
                    Metric(g, f"access {op}: native", "GB/s", _num(a.get("native_gbps")))]
        gr = sm.get("graph") or {}
        if gr:
            out += [Metric(g, "graph replay before growth", "us", _scaled(gr.get("before_s"), 1e6)),
                    Metric(g, "graph replay after growth", "us", _scaled(gr.get("after_s"), 1e6))]
        for r in (sm.get("scaling") or {}).get("rows", []):
            out.append(Metric(g, f"scaling {r.get('nominal_gib')} GiB / {r.get('segments')} seg: rate", "GB/s",
                              _num(r.get("gbps"))))
        for t in sm.get("targets", []):
            out.append(Metric(g, f"target: {t['name']}", "ratio", _num(t.get("value"))))
    seen: dict[str, int] = {}
    for case in (s.get("integration") or {}).get("cases", []):
        seen[case["key"]] = seen.get(case["key"], 0) + 1
        key = case["key"] + (f" #{seen[case['key']]}" if seen[case["key"]] > 1 else "")
        g = f"vLLM {key}"
        out += [Metric(g, "KV blocks", "count", _num(case["blocks"])),
                Metric(g, "KV committed", "GiB", _scaled(case["kv_committed"], 1 / fmt.GIB)),
                Metric(g, "final commit", "ms", _scaled(case["commit_seconds"], 1e3)),
                Metric(g, "non-KV after warmup", "MiB", _scaled(case["non_kv_after_warmup"], 1 / fmt.MIB)),
                Metric(g, "vLLM non-KV estimate", "MiB", _scaled(case["non_kv_estimate"], 1 / fmt.MIB)),
                Metric(g, "free after warmup", "MiB", _scaled(case["free_after_warmup"], 1 / fmt.MIB)),
                Metric(g, "over budget", "MiB", _scaled(case["over_budget"], 1 / fmt.MIB)),
                Metric(g, "over budget at peak", "MiB", _scaled(case.get("over_budget_at_peak"), 1 / fmt.MIB))]
    return out


def deltas(run_summary: dict, baseline_summary: dict) -> list[Delta]:
    """Every metric of either run, matched by group and name: run's order first, then the baseline's extras."""
    a = {(m.group, m.name): m for m in metrics(run_summary)}
    b = {(m.group, m.name): m for m in metrics(baseline_summary)}
    keys = list(a) + [k for k in b if k not in a]
    return [Delta(k[0], k[1], (a.get(k) or b.get(k)).unit, a[k].value if k in a else None,
                  b[k].value if k in b else None) for k in keys]


def build(run: Run, baseline: Run, plot: Plotter | None = None) -> tuple[Document, dict]:
    plot = plot or plotter()
    rs, bs = summary_of(run), summary_of(baseline)
    ds = deltas(rs, bs)
    title = f"Comparison: {run.name} vs {baseline.name}"
    intro = Section("Runs").add(
        Paragraph(f"**run** = {run.name} (`{run.path.as_posix()}`), **baseline** = {baseline.name} "
                  f"(`{baseline.path.as_posix()}`). Delta = run - baseline; delta % = delta / |baseline| x 100."),
        Table(["item", f"baseline: {baseline.name}", f"run: {run.name}"],
              [[ENVIRONMENT_NAMES.get(k, k), baseline.environment[k].value or "not recorded",
                run.environment[k].value or "not recorded"] for k in run.environment]))
    missing = [f"{run.name}: {m}" for m in run.missing] + [f"{baseline.name}: {m}" for m in baseline.missing]
    if missing:
        intro.add(Paragraph("**Not measured:**"), Bullets(missing))
    sections = [intro]
    order: list[str] = []
    for d in ds:
        if d.group not in order:
            order.append(d.group)
    delta_section = Section("Deltas")
    for g in order:
        delta_section.add(Section(g, level=3).add(Table(
            ["figure", "unit", f"baseline: {baseline.name}", f"run: {run.name}", "delta", "delta %"],
            [d.row() for d in ds if d.group == g])))
    if not ds:
        delta_section.add(Paragraph(f"{NM}: neither run has figures to compare."))
    sections.append(delta_section)
    side = Section("Side by side")
    run_bench = run.bench[0] if run.bench else None
    base_bench = baseline.bench[0] if baseline.bench else None
    if run_bench or base_bench:
        side.add(plot.figure("compare-commit-throughput.png", "Commit throughput in both runs", "compare_commit",
                             run.name, run_bench, baseline.name, base_bench))
    blocks = [(d.group.removeprefix("vLLM "), _int(d.run), _int(d.baseline)) for d in ds if d.name == "KV blocks"]
    if blocks:
        side.add(plot.figure("compare-kv-blocks.png", "KV blocks per vLLM case in both runs", "compare_blocks",
                             run.name, baseline.name, blocks))
    if not side.blocks:
        side.add(Paragraph(f"{NM}: neither run has benchmark or integration files."))
    sections.append(side)
    summary = {
        "run": run.name, "baseline": baseline.name, "run_folder": run.path.as_posix(),
        "baseline_folder": baseline.path.as_posix(),
        "not_measured": {"run": list(run.missing), "baseline": list(baseline.missing)},
        "deltas": [{"group": d.group, "name": d.name, "unit": d.unit, "run": d.run, "baseline": d.baseline,
                    "delta": d.delta, "delta_percent": d.percent} for d in ds],
    }
    return Document(title, sections), summary


def _int(x: float | None) -> int | None:
    return None if x is None else int(x)
