"""The figures and ratios the commit-path targets ask for, from a pytest-benchmark JSON file of ``bench/``.

``python -m extensible_kv bench-summary reports/out/bench-cuda.json [--json]`` prints them (the report's benchmark
tables, or the dict as JSON); the report shows the same dict. Every benchmark in ``bench/`` stores a stable
``extra_info['key']`` (``commit/extensible``, ``kv/2seg/fresh``, ...) and its byte counts
(``extensible_kv.measurements.BenchExtra``); this module needs nothing else and never runs anything.

Time of a benchmark = the median of its rounds (``stats.median``), except where the benchmark measured the figure
itself in a subprocess (``extra_info['subprocess_median_s']``, the expandable-segments peer). Rates are decimal:
GB/s = bytes / seconds / 1e9, and 5 TB/s = 5000 GB/s. Ratios of times between benchmarks of different byte counts
are taken per byte. Targets are judged only for CUDA runs; on the host driver they read ``n/a`` (no claims).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from ..measurements import BadFile, BenchmarkFile, read

CLAIM_DEVICE_TYPES = ("cuda",)

# The peers: (benchmark key, name in the report, ratio field of ``summary["peers"]``).
PEERS = (("peer/torch_default", "torch default (cudaMalloc)", "time_vs_torch_default"),
         ("peer/expandable_segments", "torch expandable segments", "time_vs_expandable_segments"))


@dataclass(frozen=True)
class Bench:
    """One ``bench-*.json`` file and its ``summarize``d figures."""

    source: str
    data: BenchmarkFile
    summary: dict

    @classmethod
    def load(cls, path: Path) -> Bench:
        data = read(path, BenchmarkFile)
        found = entries(data)
        if not found:
            raise BadFile(f"{path}: no benchmark has an extra_info.key (not a run of bench/)")
        for key, entry in found.items():
            if key.startswith("scale/") and None in (entry["extra"].get("nominal_gib"), entry["extra"].get("segments")):
                raise BadFile(f"{path}: benchmark {key!r} needs extra_info.nominal_gib and extra_info.segments")
        return cls(Path(path).name, data, summarize_entries(found))


def summarize(path: str | Path) -> dict:
    """The figures of the pytest-benchmark JSON file at ``path`` (``BadFile`` where it is not one of bench/)."""
    return Bench.load(Path(path)).summary


def summarize_data(data: dict | BenchmarkFile) -> dict:
    """The figures of loaded pytest-benchmark JSON; missing benchmarks give ``None``."""
    return summarize_entries(entries(data if isinstance(data, BenchmarkFile) else BenchmarkFile.model_validate(data)))


def entries(data: BenchmarkFile) -> dict[str, dict]:
    """Benchmarks by ``extra_info.key``: ``seconds`` (the figure) and ``extra`` (extra_info, ``None`` where absent)."""
    out = {}
    for b in data.benchmarks:
        x = b.extra_info
        if x.key:
            seconds = x.subprocess_median_s if x.subprocess_median_s is not None else b.stats.median
            out[x.key] = {"seconds": seconds, "extra": x.model_dump()}
    return out


def seconds_of(e: dict, key: str) -> float | None:
    return e[key]["seconds"] if key in e else None


def bytes_of(e: dict, key: str, field: str = "bytes") -> int | None:
    return e[key]["extra"].get(field) if key in e else None


def peer_rows(e: dict, summary: dict) -> list[dict]:
    """The peers of ``PEERS``: bytes, seconds, rate and ExtensibleTensor time / peer time (per byte)."""
    return [{"key": key, "name": name, "bytes": bytes_of(e, key), "seconds": seconds_of(e, key),
             "gbps": _gbps(bytes_of(e, key), seconds_of(e, key)), "ours_vs_peer": summary["peers"][ratio]}
            for key, name, ratio in PEERS]


def summarize_entries(e: dict[str, dict]) -> dict:
    """The figures, ratios and targets of ``entries``."""
    first = next(iter(e.values()), {"extra": {}})["extra"]
    summary = {"keys": sorted(e), "driver": first.get("driver"), "device_type": first.get("device_type"),
               "granularity": first.get("granularity"), "scale": first.get("scale"),
               "claims": first.get("device_type") in CLAIM_DEVICE_TYPES, "commit": _commit(e), "peers": _peers(e),
               "calls": {k.split("/", 1)[1]: e[k]["extra"]["calls"] for k in sorted(e)
                         if k.startswith("calls/") and e[k]["extra"].get("calls")},
               "zero": _zero(e), "kv": _kv(e), "access": _access(e), "graph": _graph(e), "scaling": _scaling(e)}
    summary["targets"] = _targets(summary)
    summary["peer_rows"] = peer_rows(e, summary)
    return summary


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


def verdict(target: dict) -> str:
    """A target's ``met`` in words: ``yes``, ``NO`` or ``n/a`` (no data, or no claims)."""
    met = target.get("met")
    return "n/a" if met is None else ("yes" if met else "NO")


def _command(args: argparse.Namespace) -> int:
    try:
        summary = summarize(args.benchmark_json)
    except BadFile as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        from .rendering import bench_tables  # noqa: PLC0415

        print(bench_tables(summary, Path(args.benchmark_json).name))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bench-summary`` command to ``python -m extensible_kv``'s subparsers."""
    parser = subparsers.add_parser("bench-summary", help="the benchmark figures, ratios and targets of a "
                                                         "pytest-benchmark JSON file of bench/")
    parser.add_argument("benchmark_json", help="a file written by pytest --benchmark-json over bench/")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of tables")
    parser.set_defaults(run=_command)
