"""Two runs side by side (before/after a change, one GPU against another): every figure both runs have, with its
delta. The delta is run - baseline; the percentage is the delta over the baseline's magnitude.

Figures are read from each run's summary (the dict written to summary.json), so both runs are described the same
way. Values are in their measured unit (bytes, seconds, counts), shown in ``unit``; a figure one run lacks reads
"not measured" there and has no delta.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import accounting
from .document import Document
from .numbers import scaled
from .rendering import Figures, html, markdown
from .run import ENVIRONMENT_NAMES, Run
from .serving import serving_rows
from .summary import summary

Metric = tuple[str, str, str, object]  # group, name, unit, value

CASE_METRICS = (("KV blocks", "count", "blocks"), ("KV committed", "GiB", "kv_committed"),
                ("final commit", "ms", "commit_seconds"), ("non-KV after warmup", "MiB", "non_kv_after_warmup"),
                ("vLLM non-KV estimate", "MiB", "non_kv_estimate"), ("free after warmup", "MiB", "free_after_warmup"),
                ("over budget", "MiB", "over_budget"), ("over budget at peak", "MiB", "over_budget_at_peak"))


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


def _bench_metrics(g: str, s: dict) -> list[Metric]:
    out = [m for path, p in s["commit"]["paths"].items() for m in (
        (g, f"commit {path}: median", "ms", p["seconds"]), (g, f"commit {path}: rate", "GB/s", p["gbps"]))]
    out += [m for p in s["peer_rows"] for m in (
        (g, f"peer {p['name']}: median", "ms", p["seconds"]), (g, f"peer {p['name']}: rate", "GB/s", p["gbps"]))]
    out += [(g, f"KV growth {label}: median", "ms", kv["ms"] and kv["ms"] / 1e3) for label, kv in s["kv"].items()]
    out += [(g, "zero_new rate", "GB/s", s["zero"]["zero_gbps"]), (g, "memset rate", "GB/s", s["zero"]["memset_gbps"])]
    out += [m for op, a in s["access"].items() for m in (
        (g, f"access {op}: vmm", "GB/s", a["vmm_gbps"]), (g, f"access {op}: native", "GB/s", a["native_gbps"]))]
    out += [(g, "graph replay before growth", "us", s["graph"]["before_s"]),
            (g, "graph replay after growth", "us", s["graph"]["after_s"])]
    out += [(g, f"scaling {r['nominal_gib']} GiB / {r['segments']} seg: rate", "GB/s", r["gbps"])
            for r in s["scaling"]["rows"]]
    return out + [(g, f"target: {t['name']}", "ratio", t["value"]) for t in s["targets"]]


def metrics(s: dict) -> list[Metric]:
    """The comparable figures of one run summary, in report order (true/false figures are not compared)."""
    out = [(f"conformance ({d['driver']}, {c['source']})", name, unit, d[field]) for c in s["conformance"]
           for d in c["drivers"] for name, unit, field in (("passed", "count", "passed"), ("failed", "count", "failed"),
                                                          ("skipped", "count", "skipped"),
                                                          ("commit probe", "GB/s", "commit_gb_per_s"))]
    out += [m for b in s["bench"] for m in _bench_metrics(f"benchmarks ({b['source']})", b["summary"])]
    seen: dict[str, int] = {}
    for case in s["integration"]["cases"]:
        seen[case["key"]] = seen.get(case["key"], 0) + 1
        group = f"vLLM {case['key']}" + (f" #{seen[case['key']]}" if seen[case["key"]] > 1 else "")
        out += [(group, name, unit, case[field]) for name, unit, field in CASE_METRICS]
    for e in s["serving"]:
        g, start = f"serving ({e['source']})", e["engine_seconds"] if e["engine_seconds_comparable"] else None
        out += [(g, "decode extensible / legacy", "ratio", e["decode_tokens_per_s"]),
                *((g, f"decode tokens/s, {mode}", "tokens/s", e[mode] and e[mode]["tokens_per_s"])
                  for mode in ("legacy", "extensible")),
                (g, "engine start extensible / legacy (same compile cache)", "ratio", start)]
    return [(g, n, u, None if isinstance(v, bool) else v) for g, n, u, v in out]


def deltas(run_summary: dict, baseline_summary: dict) -> list[Delta]:
    """Every metric of either run, matched by group and name: run's order first, then the baseline's extras."""
    a = {m[:2]: m for m in metrics(run_summary)}
    b = {m[:2]: m for m in metrics(baseline_summary)}
    return [Delta(*k, (a.get(k) or b[k])[2], a[k][3] if k in a else None, b[k][3] if k in b else None)
            for k in list(a) + [k for k in b if k not in a]]


def summary_of(run: Run) -> dict:
    breakdowns = accounting.account(run.cases)
    return summary(run, breakdowns, accounting.block_pairs(breakdowns), serving_rows(run.serving))


def comparison_document(run: Run, baseline: Run, figures: Figures | None = None) -> Document:
    figures = figures or Figures.available()
    ds = deltas(summary_of(run), summary_of(baseline))
    context = {"run": run, "baseline": baseline, "deltas": ds, "environment_names": ENVIRONMENT_NAMES,
               "groups": list(dict.fromkeys(d.group for d in ds))}
    md = markdown("comparison.md.j2", context, figures)
    return Document(md, html(markdown("comparison.md.j2", context, figures, inline=True)), {
        "run": run.name, "baseline": baseline.name, "run_folder": run.path.as_posix(),
        "baseline_folder": baseline.path.as_posix(),
        "not_measured": {"run": list(run.missing), "baseline": list(baseline.missing)},
        "deltas": [{"group": d.group, "name": d.name, "unit": d.unit, "run": scaled(d.run, d.unit),
                    "baseline": scaled(d.baseline, d.unit), "delta": scaled(d.delta, d.unit),
                    "delta_percent": d.percent} for d in ds]}, figures)
