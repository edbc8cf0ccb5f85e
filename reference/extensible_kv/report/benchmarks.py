"""The figures and ratios the commit-path targets ask for, from a pytest-benchmark JSON file of ``bench/``.

``python -m extensible_kv bench-summary reports/out/bench-cuda.json [--json]`` prints a table (or the dict as JSON);
the report draws from the same dict. Every benchmark in ``bench/`` stores a stable ``extra_info['key']``
(``commit/extensible``, ``kv/2seg/fresh``, ...) and its byte counts; this module needs nothing else and never runs
anything.

Time of a benchmark = the median of its rounds (``stats.median``), except where the benchmark measured the figure
itself in a subprocess (``extra_info['subprocess_median_s']``, the expandable-segments peer). Rates are decimal:
GB/s = bytes / seconds / 1e9, and 5 TB/s = 5000 GB/s. Ratios of times between benchmarks of different byte counts
are taken per byte. Targets are judged only for CUDA runs; on the host driver they read ``n/a`` (no claims).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .files import COUNT, NUMBER, TEXT, BadFile, Values, read_json

if TYPE_CHECKING:
    from .loading import Bench

CLAIM_DEVICE_TYPES = ("cuda",)

# The peers: (benchmark key, name in the report, ratio field of ``summary["peers"]``).
PEERS = (("peer/torch_default", "torch default (cudaMalloc)", "time_vs_torch_default"),
         ("peer/expandable_segments", "torch expandable segments", "time_vs_expandable_segments"))


# The fields of a pytest-benchmark JSON file that are read here and in the report.
_EXTRA = {"key": TEXT, "subprocess_median_s": NUMBER, "subprocess_torch": TEXT, "calls": Values(NUMBER),
          "nominal_gib": NUMBER}
_EXTRA |= dict.fromkeys(("granularity", "bytes", "moved_bytes", "handles", "set_access", "granules", "zero_calls",
                         "segments", "runs", "buffers"), COUNT)
SHAPE = {"benchmarks": [{"extra_info": _EXTRA, "stats": {"median": NUMBER}}], "datetime": TEXT,
         "machine_info": {"python_version": TEXT, "cpu": {"brand_raw": TEXT}}}


# -- reading ----------------------------------------------------------------------------------------------------
def load(path: str | Path) -> dict:
    """The pytest-benchmark JSON of ``bench/`` in ``path``; ``BadFile`` naming the file and field where it is not."""
    data = read_json(path, SHAPE)
    if "benchmarks" not in data:
        raise BadFile(f"{path}: no 'benchmarks' list (not pytest-benchmark JSON)")
    found = entries(data)
    if not found:
        raise BadFile(f"{path}: no benchmark has an extra_info.key (not a run of bench/)")
    for key, entry in found.items():
        if key.startswith("scale/") and None in (entry["extra"].get("nominal_gib"), entry["extra"].get("segments")):
            raise BadFile(f"{path}: benchmark {key!r} needs extra_info.nominal_gib and extra_info.segments")
    return data


def entries(data: dict) -> dict[str, dict]:
    """Benchmarks by ``extra_info['key']``: ``seconds`` (the figure), ``extra`` (extra_info), ``stats``."""
    out: dict[str, dict] = {}
    for bench in data.get("benchmarks") or []:
        extra = bench.get("extra_info") or {}
        key = extra.get("key")
        if not key:
            continue
        stats = bench.get("stats") or {}
        seconds = extra.get("subprocess_median_s", stats.get("median"))
        out[key] = {"seconds": float(seconds) if seconds is not None else None, "extra": extra, "stats": stats}
    return out


def seconds_of(entries: dict, key: str) -> float | None:
    """The figure (seconds) of benchmark ``key``; ``None`` when it is missing."""
    entry = entries.get(key)
    return entry["seconds"] if entry else None


def bytes_of(entries: dict, key: str, field: str = "bytes") -> int | None:
    """``extra_info[field]`` of benchmark ``key``; ``None`` when it is missing."""
    entry = entries.get(key)
    return entry["extra"].get(field) if entry else None


def _gbps(nbytes: int | None, seconds: float | None) -> float | None:
    if not nbytes or not seconds:
        return None
    return nbytes / seconds / 1e9


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or not b:
        return None
    return a / b


def _per_byte(entries: dict, key: str) -> float | None:
    return _div(seconds_of(entries, key), bytes_of(entries, key))


# -- the figures ------------------------------------------------------------------------------------------------
def summarize(benchmark_json_path: str | Path) -> dict:
    """Read a pytest-benchmark JSON file and compute the target figures and ratios (see ``summarize_data``)."""
    return summarize_data(load(benchmark_json_path))


def summarize_data(data: dict) -> dict:
    """The target figures and ratios from loaded pytest-benchmark JSON; missing benchmarks give ``None``."""
    return summarize_entries(entries(data))


def summarize_entries(e: dict[str, dict]) -> dict:
    """``summarize_data`` on what ``entries`` returned."""
    first = next(iter(e.values()), None)
    device_type = first["extra"].get("device_type") if first else None
    summary = {
        "keys": sorted(e),
        "driver": first["extra"].get("driver") if first else None,
        "device_type": device_type,
        "granularity": first["extra"].get("granularity") if first else None,
        "scale": first["extra"].get("scale") if first else None,
        "claims": device_type in CLAIM_DEVICE_TYPES,
        "commit": _commit(e),
        "peers": _peers(e),
        "calls": {key.split("/", 1)[1]: e[key]["extra"]["calls"] for key in sorted(e)
                  if key.startswith("calls/") and e[key]["extra"].get("calls")},
        "zero": _zero(e),
        "kv": _kv(e),
        "access": _access(e),
        "graph": _graph(e),
        "scaling": _scaling(e),
    }
    summary["targets"] = _targets(summary)
    return summary


def _commit(e: dict) -> dict:
    paths = {}
    for path in ("per_granule", "single_handle", "extensible"):
        key = f"commit/{path}"
        if key in e:
            paths[path] = {"seconds": seconds_of(e, key), "bytes": bytes_of(e, key),
                           "gbps": _gbps(bytes_of(e, key), seconds_of(e, key)),
                           "handles": e[key]["extra"].get("handles")}
    ours = _per_byte(e, "commit/extensible")
    return {
        "paths": paths,
        "speedup_vs_per_granule": _div(_per_byte(e, "commit/per_granule"), ours),
        "time_vs_single_handle": _div(ours, _per_byte(e, "commit/single_handle")),
    }


def _peers(e: dict) -> dict:
    ours = _per_byte(e, "commit/extensible")
    out: dict = {key.removeprefix("peer/") + "_s": seconds_of(e, key) for key, _name, _ratio in PEERS}
    out.update({ratio: _div(ours, _per_byte(e, key)) for key, _name, ratio in PEERS})
    return out


def peer_rows(bench: Bench) -> list[dict]:
    """The peers of ``PEERS`` with their bytes and rate (as every rate here: bytes / s / 1e9) and the ratio of
    ``summary["peers"]``."""
    p = bench.summary.get("peers") or {}
    out = []
    for key, name, ratio in PEERS:
        nbytes, seconds = bytes_of(bench.raw, key), seconds_of(bench.raw, key)
        out.append({"key": key, "name": name, "bytes": nbytes, "seconds": seconds, "gbps": _gbps(nbytes, seconds),
                    "ours_vs_peer": p.get(ratio)})
    return out


def _zero(e: dict) -> dict:
    nbytes = bytes_of(e, "zero/grow_zero")
    with_zero, without = seconds_of(e, "zero/grow_zero"), seconds_of(e, "zero/grow_nozero")
    implied = with_zero - without if with_zero is not None and without is not None else None
    zero_gbps = _gbps(nbytes, implied) if implied and implied > 0 else None
    memset_gbps = _gbps(bytes_of(e, "zero/memset"), seconds_of(e, "zero/memset"))
    return {
        "bytes": nbytes,
        "grow_zero_s": with_zero,
        "grow_nozero_s": without,
        "implied_zero_s": implied,
        "zero_gbps": zero_gbps,
        "memset_gbps": memset_gbps,
        "zero_vs_memset": _div(zero_gbps, memset_gbps),
        "end_to_end_gbps": _gbps(nbytes, with_zero),
        "torch_zero_gbps": _gbps(bytes_of(e, "zero/torch_zero_"), seconds_of(e, "zero/torch_zero_")),
        "zero_calls": e["zero/grow_zero"]["extra"].get("zero_calls") if "zero/grow_zero" in e else None,
    }


def _kv(e: dict) -> dict:
    out = {}
    for key in sorted(k for k in e if k.startswith("kv/")):
        x = e[key]["extra"]
        out[key[len("kv/"):]] = {"ms": e[key]["seconds"] * 1e3 if e[key]["seconds"] is not None else None,
                                 "bytes": x.get("bytes"), "buffers": x.get("buffers"), "segments": x.get("segments"),
                                 "state": x.get("state"), "handles": x.get("handles"),
                                 "set_access": x.get("set_access")}
    return out


def _access(e: dict) -> dict:
    out = {}
    for op in ("copy", "kernel"):
        vmm, native = f"access/{op}/vmm", f"access/{op}/native"
        if vmm not in e and native not in e:
            continue
        vmm_gbps = _gbps(bytes_of(e, vmm, "moved_bytes"), seconds_of(e, vmm))
        native_gbps = _gbps(bytes_of(e, native, "moved_bytes"), seconds_of(e, native))
        out[op] = {"vmm_gbps": vmm_gbps, "native_gbps": native_gbps, "ratio": _div(vmm_gbps, native_gbps)}
    return out


def _graph(e: dict) -> dict:
    before, after = seconds_of(e, "graph/before_growth"), seconds_of(e, "graph/after_growth")
    return {"before_s": before, "after_s": after, "ratio": _div(after, before)}


def _scaling(e: dict) -> dict:
    rows = []
    for key, entry in e.items():
        if not key.startswith("scale/"):
            continue
        x = entry["extra"]
        rows.append({"nominal_gib": x.get("nominal_gib"), "segments": x.get("segments"), "bytes": x.get("bytes"),
                     "handles": x.get("handles"), "set_access": x.get("set_access"), "runs": x.get("runs"),
                     "granules": x.get("granules"), "seconds": entry["seconds"],
                     "gbps": _gbps(x.get("bytes"), entry["seconds"]),
                     "us_per_handle": _div(entry["seconds"] * 1e6 if entry["seconds"] is not None else None,
                                           x.get("handles"))})
    rows.sort(key=lambda r: (r["nominal_gib"], r["segments"]))
    if not rows:
        return {"rows": [], "handles_track_runs": None, "handles_independent_of_bytes": None,
                "worst_growth_vs_handles": None}
    by_segments: dict[int, set] = {}
    for r in rows:
        by_segments.setdefault(r["segments"], set()).add(r["handles"])
    worst = None
    for gib in sorted({r["nominal_gib"] for r in rows}):
        same = [r for r in rows if r["nominal_gib"] == gib]
        base = min(same, key=lambda r: r["segments"])
        for r in same:
            if r is base or not base["handles"] or not base["seconds"] or r["seconds"] is None or not r["handles"]:
                continue
            growth = (r["seconds"] / base["seconds"]) / (r["handles"] / base["handles"])
            worst = growth if worst is None else max(worst, growth)
    return {
        "rows": rows,
        "handles_track_runs": all(r["handles"] == r["runs"] for r in rows),
        "handles_independent_of_bytes": all(len(h) == 1 for h in by_segments.values()),
        "worst_growth_vs_handles": worst,
    }


def _targets(s: dict) -> list[dict]:
    """The targets, each with its value and whether it is met (``None``: no data, or no claims here)."""
    commit_gbps = s["commit"]["paths"].get("extensible", {}).get("gbps")
    rows = [
        ("commit 32 GiB, GB/s (ExtensibleTensor)", commit_gbps, ">=", 5000.0),
        ("commit speedup vs per-granule", s["commit"]["speedup_vs_per_granule"], ">=", 100.0),
        ("commit time / torch default (cudaMalloc)", s["peers"]["time_vs_torch_default"], "<=", 1.0),
        ("commit time / expandable segments", s["peers"]["time_vs_expandable_segments"], "<=", 1.0),
    ]
    rows += [(f"KV growth ms [{label}]", kv["ms"], "<=", 50.0) for label, kv in s["kv"].items()]
    rows.append(("zero_new bandwidth / memset", s["zero"]["zero_vs_memset"], ">=", 0.8))
    rows += [(f"{op} bandwidth vmm / native", a["ratio"], ">=", 0.98) for op, a in s["access"].items()]
    rows.append(("graph replay after / before growth", s["graph"]["ratio"], "<=", 1.02))
    rows.append(("scaling: time growth / handle growth (worst)", s["scaling"]["worst_growth_vs_handles"], "<=", 1.0))
    rows.append(("scaling: handles == runs", s["scaling"]["handles_track_runs"], "==", True))
    rows.append(("scaling: handles independent of bytes", s["scaling"]["handles_independent_of_bytes"], "==", True))
    out = []
    for name, value, op, goal in rows:
        if value is None or not s["claims"]:
            met = None
        elif op == ">=":
            met = value >= goal
        elif op == "<=":
            met = value <= goal
        else:
            met = value == goal
        out.append({"name": name, "value": value, "op": op, "target": goal, "met": met})
    return out


# -- printing ---------------------------------------------------------------------------------------------------
def verdict(target: dict) -> str:
    """A target's ``met`` in words: ``yes``, ``NO`` or ``n/a`` (no data, or no claims)."""
    met = target.get("met")
    return "n/a" if met is None else ("yes" if met else "NO")


def _t(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def _b(nbytes: int | None) -> str:
    if not nbytes:
        return "-"
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.4g} GiB"
    return f"{nbytes / (1 << 20):.4g} MiB"


def _n(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:.{digits}g}"


def format_table(s: dict) -> str:
    """The summary as a plain-text table."""
    lines = [f"extensible-kv benchmarks: driver {s['driver']} ({s['device_type']}), granularity {_b(s['granularity'])}"
             f", scale {s['scale']}" + ("" if s["claims"] else "  [no claims: not a GPU run]")]
    if s["commit"]["paths"]:
        lines.append(f"{'commit (zero_new=False)':<34}{'bytes':>12}{'median':>12}{'GB/s':>10}{'handles':>9}")
        for path, p in s["commit"]["paths"].items():
            lines.append(f"  {path:<32}{_b(p['bytes']):>12}{_t(p['seconds']):>12}{_n(p['gbps']):>10}"
                         f"{_n(p['handles'], 9):>9}")
    if s["kv"]:
        lines.append(f"{'KV growth (lockstep, set-access)':<34}{'bytes':>12}{'median':>12}{'buffers':>10}"
                     f"{'handles':>9}")
        for label, kv in s["kv"].items():
            lines.append(f"  {label:<32}{_b(kv['bytes']):>12}{_t(kv['ms'] / 1e3 if kv['ms'] is not None else None):>12}"
                         f"{_n(kv['buffers']):>10}{_n(kv['handles'], 9):>9}")
    z = s["zero"]
    if z["bytes"]:
        lines.append(f"zeroing {_b(z['bytes'])}: implied zero_new {_t(z['implied_zero_s'])} = {_n(z['zero_gbps'])} "
                     f"GB/s, memset {_n(z['memset_gbps'])} GB/s, torch zero_ {_n(z['torch_zero_gbps'])} GB/s, "
                     f"end-to-end grow+zero {_n(z['end_to_end_gbps'])} GB/s, {_n(z['zero_calls'])} memset call(s)")
    p = s["peers"]
    if p["torch_default_s"] is not None or p["expandable_segments_s"] is not None:
        lines.append(f"peers (32 GiB usable): torch default {_t(p['torch_default_s'])}, expandable segments "
                     f"{_t(p['expandable_segments_s'])}")
    for state, calls in s.get("calls", {}).items():
        lines.append(f"commit calls [{state}]: " + ", ".join(f"{c} {_t(v)}" for c, v in calls.items())
                     + f"; dominant: {max(calls, key=calls.get)}")
    for op, a in s["access"].items():
        lines.append(f"access {op}: vmm {_n(a['vmm_gbps'])} GB/s, native {_n(a['native_gbps'])} GB/s")
    g = s["graph"]
    if g["before_s"] is not None or g["after_s"] is not None:
        lines.append(f"graph replay: before growth {_t(g['before_s'])}, after growth {_t(g['after_s'])}")
    if s["scaling"]["rows"]:
        lines.append(f"{'scaling: nominal':<18}{'segments':>9}{'bytes':>12}{'median':>12}{'GB/s':>10}{'handles':>9}"
                     f"{'us/handle':>11}")
        for r in s["scaling"]["rows"]:
            lines.append(f"  {str(r['nominal_gib']) + ' GiB':<16}{r['segments']:>9}{_b(r['bytes']):>12}"
                         f"{_t(r['seconds']):>12}{_n(r['gbps']):>10}{_n(r['handles'], 9):>9}"
                         f"{_n(r['us_per_handle']):>11}")
    lines.append(f"{'target':<48}{'value':>12}{'goal':>12}{'met':>6}")
    for t in s["targets"]:
        goal = f"{t['op']} {_n(t['target'])}"
        lines.append(f"  {t['name']:<46}{_n(t['value']):>12}{goal:>12}{verdict(t):>6}")
    return "\n".join(lines)


def _command(args: argparse.Namespace) -> int:
    try:
        summary = summarize(args.benchmark_json)
    except BadFile as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2) if args.json else format_table(summary))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bench-summary`` command to ``python -m extensible_kv``'s subparsers."""
    parser = subparsers.add_parser("bench-summary", help="the benchmark figures, ratios and targets of a "
                                                         "pytest-benchmark JSON file of bench/")
    parser.add_argument("benchmark_json", help="a file written by pytest --benchmark-json over bench/")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    parser.set_defaults(run=_command)
