"""Two runs side by side (before/after a change, one GPU against another): every figure both runs have, with its
delta. The delta is run - baseline; the percentage is the delta over the baseline's magnitude.

Figures are read from each run's summary (the dict written to summary.json), so both runs are described the same
way. A figure one run lacks reads "not measured" there and has no delta.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import accounting
from .document import Document
from .numbers import scaled
from .rendering import Figures, html, markdown
from .run import ENVIRONMENT_NAMES, Run
from .summary import summary


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


def _num(x: object) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return x


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
            out += [Metric(g, f"commit {path}: median", "ms", _num(p.get("seconds"))),
                    Metric(g, f"commit {path}: rate", "GB/s", _num(p.get("gbps")))]
        for p in sm["peer_rows"]:
            out += [Metric(g, f"peer {p['name']}: median", "ms", _num(p.get("seconds"))),
                    Metric(g, f"peer {p['name']}: rate", "GB/s", _num(p.get("gbps")))]
        for label, kv in (sm.get("kv") or {}).items():
            out.append(Metric(g, f"KV growth {label}: median", "ms", _num(kv["ms"] and kv["ms"] / 1e3)))
        z = sm.get("zero") or {}
        if z:
            out += [Metric(g, "zero_new rate", "GB/s", _num(z.get("zero_gbps"))),
                    Metric(g, "memset rate", "GB/s", _num(z.get("memset_gbps")))]
        for op, a in (sm.get("access") or {}).items():
            out += [Metric(g, f"access {op}: vmm", "GB/s", _num(a.get("vmm_gbps"))),
                    Metric(g, f"access {op}: native", "GB/s", _num(a.get("native_gbps")))]
        gr = sm.get("graph") or {}
        if gr:
            out += [Metric(g, "graph replay before growth", "us", _num(gr.get("before_s"))),
                    Metric(g, "graph replay after growth", "us", _num(gr.get("after_s")))]
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
                Metric(g, "KV committed", "GiB", _num(case["kv_committed"])),
                Metric(g, "final commit", "ms", _num(case["commit_seconds"])),
                Metric(g, "non-KV after warmup", "MiB", _num(case["non_kv_after_warmup"])),
                Metric(g, "vLLM non-KV estimate", "MiB", _num(case["non_kv_estimate"])),
                Metric(g, "free after warmup", "MiB", _num(case["free_after_warmup"])),
                Metric(g, "over budget", "MiB", _num(case["over_budget"])),
                Metric(g, "over budget at peak", "MiB", _num(case.get("over_budget_at_peak")))]
    return out


def deltas(run_summary: dict, baseline_summary: dict) -> list[Delta]:
    """Every metric of either run, matched by group and name: run's order first, then the baseline's extras."""
    a = {(m.group, m.name): m for m in metrics(run_summary)}
    b = {(m.group, m.name): m for m in metrics(baseline_summary)}
    keys = list(a) + [k for k in b if k not in a]
    return [Delta(k[0], k[1], (a.get(k) or b.get(k)).unit, a[k].value if k in a else None,
                  b[k].value if k in b else None) for k in keys]


def summary_of(run: Run) -> dict:
    breakdowns = accounting.account(run.cases)
    return summary(run, breakdowns, accounting.block_pairs(breakdowns))


def comparison_document(run: Run, baseline: Run, figures: Figures | None = None) -> Document:
    figures = figures or Figures.available()
    ds = deltas(summary_of(run), summary_of(baseline))
    context = {"run": run, "baseline": baseline, "deltas": ds, "environment_names": ENVIRONMENT_NAMES,
               "groups": list(dict.fromkeys(d.group for d in ds)),
               "blocks": [(d.group.removeprefix("vLLM "), d.run, d.baseline) for d in ds if d.name == "KV blocks"],
               "bench": [r.bench[0].summary if r.bench else None for r in (run, baseline)]}
    md = markdown("comparison.md.j2", context, figures)
    page = html(markdown("comparison.md.j2", context, figures, inline=True))
    return Document(md, page, {
        "run": run.name, "baseline": baseline.name, "run_folder": run.path.as_posix(),
        "baseline_folder": baseline.path.as_posix(),
        "not_measured": {"run": list(run.missing), "baseline": list(baseline.missing)},
        "deltas": [{"group": d.group, "name": d.name, "unit": d.unit, "run": scaled(d.run, d.unit),
                    "baseline": scaled(d.baseline, d.unit), "delta": scaled(d.delta, d.unit),
                    "delta_percent": d.percent} for d in ds]}, figures)
