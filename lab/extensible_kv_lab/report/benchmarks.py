"""The figures and ratios the commit-path targets ask for, from a pytest-benchmark JSON file of ``bench/``
(``bench-summary`` prints them, the report shows them). Every benchmark of ``bench/`` stores a stable
``extra_info.key`` (``commit/extensible``, ``kv/2seg/fresh``, ...) and its byte counts (``measurements.BenchExtra``).

Time of a benchmark = the median of its rounds, or ``extra_info.subprocess_median_s`` where it measured itself in a
subprocess. GB/s = bytes / seconds / 1e9; ratios of times between benchmarks of different sizes are per byte. A time
must be positive: a file with a time of zero or less (negative, or 0, which no round that ran can take) is refused
by ``Bench.load``, naming the file, the benchmark, the field and the value; a benchmark the file does not hold reads
"not measured".
Targets are judged only for CUDA runs; elsewhere they read ``n/a`` (no claims).
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass
from pathlib import Path

from extensible_kv.boundaries.files import Folder

from ..measurements import BadFile, BenchmarkFile, read
from .numbers import div, sub

# The peers: (benchmark key, name in the report, ratio field of ``summary["peers"]``).
PEERS = (
    ("peer/torch_default", "torch default (cudaMalloc)", "time_vs_torch_default"),
    ("peer/expandable_segments", "torch expandable segments", "time_vs_expandable_segments"),
)
_OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq}  # the comparisons of the targets (``_targets``)


@dataclass(frozen=True)
class Bench:
    """One pytest-benchmark file and its figures (``summarize_entries``)."""

    source: str
    data: BenchmarkFile
    summary: dict

    @classmethod
    def load(cls, path: Path, folder: Folder | None = None) -> Bench:
        data = read(path, BenchmarkFile, folder=folder)
        found = entries(data)
        if not found:
            raise BadFile(f"{path}: no benchmark has an extra_info.key (not a run of bench/)")
        for key, e in found.items():
            if e["seconds"] is not None and e["seconds"] <= 0:
                own = e["extra"]["subprocess_median_s"] is not None
                field = "extra_info.subprocess_median_s" if own else "stats.median"
                raise BadFile(
                    f"{path}: benchmark {key!r} has {field} {json.dumps(e['seconds'])} s; a time must be positive"
                )
        for key, x in ((k, v["extra"]) for k, v in found.items() if k.startswith("scale/")):
            if x["nominal_gib"] is None or x["segments"] is None:
                raise BadFile(f"{path}: benchmark {key!r} needs extra_info.nominal_gib and extra_info.segments")
        return cls(Path(path).name, data, summarize_entries(found))


def summarize(path: str | Path) -> dict:
    return Bench.load(Path(path)).summary


def summarize_data(data: dict) -> dict:
    """The figures of pytest-benchmark JSON as loaded (``bench/conftest.py``); missing benchmarks give ``None``."""
    return summarize_entries(entries(BenchmarkFile.model_validate(data)))


def entries(data: BenchmarkFile) -> dict[str, dict]:
    """Benchmarks by ``extra_info.key``: ``seconds`` (the figure) and ``extra`` (extra_info, ``None`` where absent)."""
    found = {}
    for b in (b for b in data.benchmarks if b.extra_info.key):
        x = b.extra_info
        median = b.stats.median if x.subprocess_median_s is None else x.subprocess_median_s
        found[x.key] = {"seconds": median, "extra": x.model_dump()}
    return found


def seconds_of(e: dict, key: str) -> float | None:
    return e[key]["seconds"] if key in e else None


def bytes_of(e: dict, key: str, field: str = "bytes") -> int | None:
    return e[key]["extra"].get(field) if key in e else None


def _figures(e: dict, key: str, names: str) -> dict:
    """Figures of benchmark ``key`` by name: ``seconds``, ``gbps`` or an ``extra_info`` field; ``None`` if absent."""
    return {
        n: seconds_of(e, key) if n == "seconds" else _rate(e, key) if n == "gbps" else bytes_of(e, key, n)
        for n in names.split()
    }


def _gbps(nbytes: int | None, seconds: float | None) -> float | None:  # decimal GB/s
    return nbytes / seconds / 1e9 if nbytes and seconds else None


def _per_byte(e: dict, key: str) -> float | None:
    return div(seconds_of(e, key), bytes_of(e, key))


def _rate(e: dict, key: str, field: str = "bytes") -> float | None:
    return _gbps(bytes_of(e, key, field), seconds_of(e, key))


def summarize_entries(e: dict[str, dict]) -> dict:
    """The figures, ratios and targets of ``entries``: each section under the name of its function."""
    first = next(iter(e.values()), {"extra": {}})["extra"]
    s = {"keys": sorted(e), **{k: first.get(k) for k in ("driver", "device_type", "granularity", "scale")}}
    s["claims"] = first.get("device_type") == "cuda"
    for section in (_commit, _peers, _calls, _zero, _kv, _access, _graph, _scaling):
        s[section.__name__.removeprefix("_")] = section(e)
    s["peer_rows"] = [
        {"key": key, "name": name, **_figures(e, key, "bytes seconds gbps"), "ours_vs_peer": s["peers"][ratio]}
        for key, name, ratio in PEERS
    ]
    return s | {"targets": _targets(s)}


def _commit(e: dict) -> dict:
    ours, paths = _per_byte(e, "commit/extensible"), ("per_granule", "single_handle", "extensible")
    return {
        "paths": {p: _figures(e, f"commit/{p}", "seconds bytes gbps handles") for p in paths if f"commit/{p}" in e},
        "speedup_vs_per_granule": div(_per_byte(e, "commit/per_granule"), ours),
        "time_vs_single_handle": div(ours, _per_byte(e, "commit/single_handle")),
    }


def _peers(e: dict) -> dict:
    ours = _per_byte(e, "commit/extensible")
    seconds = {key.removeprefix("peer/") + "_s": seconds_of(e, key) for key, _name, _ratio in PEERS}
    return seconds | {ratio: div(ours, _per_byte(e, key)) for key, _name, ratio in PEERS}


def _calls(e: dict) -> dict:
    calls = {k.removeprefix("calls/"): x["extra"].get("calls") for k, x in sorted(e.items()) if k.startswith("calls/")}
    return {k: v for k, v in calls.items() if v}


def _zero(e: dict) -> dict:
    with_zero, without = seconds_of(e, "zero/grow_zero"), seconds_of(e, "zero/grow_nozero")
    implied = sub(with_zero, without)
    zero_gbps = _gbps(bytes_of(e, "zero/grow_zero"), implied) if implied and implied > 0 else None
    return {
        "bytes": bytes_of(e, "zero/grow_zero"),
        "grow_zero_s": with_zero,
        "grow_nozero_s": without,
        "implied_zero_s": implied,
        "zero_gbps": zero_gbps,
        "memset_gbps": _rate(e, "zero/memset"),
        "zero_vs_memset": div(zero_gbps, _rate(e, "zero/memset")),
        "end_to_end_gbps": _rate(e, "zero/grow_zero"),
        "torch_zero_gbps": _rate(e, "zero/torch_zero_"),
        "zero_calls": bytes_of(e, "zero/grow_zero", "zero_calls"),
    }


def _kv(e: dict) -> dict:
    kv = {}
    for key in sorted(k for k in e if k.startswith("kv/")):
        ms = None if e[key]["seconds"] is None else e[key]["seconds"] * 1e3
        kv[key.removeprefix("kv/")] = {"ms": ms, **_figures(e, key, "bytes buffers segments state handles set_access")}
    return kv


def _access(e: dict) -> dict:
    access = {}
    for op in (op for op in ("copy", "kernel") if f"access/{op}/vmm" in e or f"access/{op}/native" in e):
        vmm, native = (_rate(e, f"access/{op}/{m}", "moved_bytes") for m in ("vmm", "native"))
        access[op] = {"vmm_gbps": vmm, "native_gbps": native, "ratio": div(vmm, native)}
    return access


def _graph(e: dict) -> dict:
    before, after = seconds_of(e, "graph/before_growth"), seconds_of(e, "graph/after_growth")
    return {"before_s": before, "after_s": after, "ratio": div(after, before)}


def _scaling(e: dict) -> dict:
    names = "nominal_gib segments bytes handles set_access runs granules seconds gbps"
    rows = [_figures(e, key, names) for key in e if key.startswith("scale/")]
    for r in rows:
        r["us_per_handle"] = div(r["seconds"] and r["seconds"] * 1e6, r["handles"])
    rows.sort(key=lambda r: (r["nominal_gib"], r["segments"]))
    growth = []  # per size: time growth over handle growth, against the fewest segments
    for gib in {r["nominal_gib"] for r in rows}:
        same = [r for r in rows if r["nominal_gib"] == gib]
        base = min(same, key=lambda r: r["segments"])
        others = [r for r in same if r is not base and r["seconds"] is not None and r["handles"]]
        if base["handles"] and base["seconds"]:
            growth += [(r["seconds"] / base["seconds"]) / (r["handles"] / base["handles"]) for r in others]
    handles = {n: {r["handles"] for r in rows if r["segments"] == n} for n in {r["segments"] for r in rows}}
    return {
        "rows": rows,
        "handles_track_runs": all(r["handles"] == r["runs"] for r in rows) if rows else None,
        "handles_independent_of_bytes": all(len(h) == 1 for h in handles.values()) if rows else None,
        "worst_growth_vs_handles": max(growth, default=None),
    }


def _targets(s: dict) -> list[dict]:
    """Each target: (name, the summary figure, comparison, goal); judged only where the run makes claims (CUDA)."""
    sc, claims = s["scaling"], s["claims"]
    ext = s["commit"]["paths"].get("extensible", {})
    rows = [
        ("commit 32 GiB, GB/s (ExtensibleTensor)", ext.get("gbps"), ">=", 5000.0),
        ("commit speedup vs per-granule", s["commit"]["speedup_vs_per_granule"], ">=", 100.0),
        ("commit time / torch default (cudaMalloc)", s["peers"]["time_vs_torch_default"], "<=", 1.0),
        ("commit time / expandable segments", s["peers"]["time_vs_expandable_segments"], "<=", 1.0),
        *[(f"KV growth ms [{label}]", kv["ms"], "<=", 50.0) for label, kv in s["kv"].items()],
        ("zero_new bandwidth / memset", s["zero"]["zero_vs_memset"], ">=", 0.8),
        *[(f"{op} bandwidth vmm / native", a["ratio"], ">=", 0.98) for op, a in s["access"].items()],
        ("graph replay after / before growth", s["graph"]["ratio"], "<=", 1.02),
        ("scaling: time growth / handle growth (worst)", sc["worst_growth_vs_handles"], "<=", 1.0),
        ("scaling: handles == runs", sc["handles_track_runs"], "==", True),
        ("scaling: handles independent of bytes", sc["handles_independent_of_bytes"], "==", True),
    ]
    return [
        {"name": n, "value": v, "op": op, "target": t, "met": None if v is None or not claims else _OPS[op](v, t)}
        for n, v, op, t in rows
    ]
