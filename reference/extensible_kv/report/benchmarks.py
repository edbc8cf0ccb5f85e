"""The figures and ratios the commit-path targets ask for, from a pytest-benchmark JSON file of ``bench/``
(``bench-summary`` prints them, the report shows them). Every benchmark of ``bench/`` stores a stable
``extra_info.key`` (``commit/extensible``, ``kv/2seg/fresh``, ...) and its byte counts (``measurements.BenchExtra``).

Time of a benchmark = the median of its rounds, or ``extra_info.subprocess_median_s`` where it measured itself in a
subprocess. GB/s = bytes / seconds / 1e9; ratios of times between benchmarks of different sizes are per byte.
Targets are judged only for CUDA runs; elsewhere they read ``n/a`` (no claims).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from pathlib import Path

from ..measurements import BadFile, BenchmarkFile, read

# The peers: (benchmark key, name in the report, ratio field of ``summary["peers"]``).
PEERS = (
    ("peer/torch_default", "torch default (cudaMalloc)", "time_vs_torch_default"),
    ("peer/expandable_segments", "torch expandable segments", "time_vs_expandable_segments"),
)


@dataclass(frozen=True)
class Bench:
    """One pytest-benchmark file and its figures (``summarize_entries``)."""

    source: str
    data: BenchmarkFile
    summary: dict

    @classmethod
    def load(cls, path: Path) -> Bench:
        data = read(path, BenchmarkFile)
        found = entries(data)
        if not found:
            raise BadFile(f"{path}: no benchmark has an extra_info.key (not a run of bench/)")
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
    return {
        b.extra_info.key: {
            "seconds": b.stats.median if b.extra_info.subprocess_median_s is None else b.extra_info.subprocess_median_s,
            "extra": b.extra_info.model_dump(),
        }
        for b in data.benchmarks
        if b.extra_info.key
    }


def seconds_of(e: dict, key: str) -> float | None:
    return e[key]["seconds"] if key in e else None


def bytes_of(e: dict, key: str, field: str = "bytes") -> int | None:
    return e[key]["extra"].get(field) if key in e else None


def summarize_entries(e: dict[str, dict]) -> dict:
    """The figures, ratios and targets of ``entries``."""
    first = next(iter(e.values()), {"extra": {}})["extra"]
    s = {
        "keys": sorted(e),
        **{k: first.get(k) for k in ("driver", "device_type", "granularity", "scale")},
        "claims": first.get("device_type") == "cuda",
        "commit": _commit(e),
        "peers": _peers(e),
        "calls": {
            k.split("/", 1)[1]: e[k]["extra"]["calls"]
            for k in sorted(e)
            if k.startswith("calls/") and e[k]["extra"].get("calls")
        },
        "zero": _zero(e),
        "kv": _kv(e),
        "access": _access(e),
        "graph": _graph(e),
        "scaling": _scaling(e),
    }
    s["peer_rows"] = [
        {
            "key": key,
            "name": name,
            "bytes": bytes_of(e, key),
            "seconds": seconds_of(e, key),
            "gbps": _rate(e, key),
            "ours_vs_peer": s["peers"][ratio],
        }
        for key, name, ratio in PEERS
    ]
    return s | {"targets": _targets(s)}


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _gbps(nbytes: int | None, seconds: float | None) -> float | None:  # decimal GB/s
    return nbytes / seconds / 1e9 if nbytes and seconds else None


def _per_byte(e: dict, key: str) -> float | None:
    return _div(seconds_of(e, key), bytes_of(e, key))


def _rate(e: dict, key: str, field: str = "bytes") -> float | None:
    return _gbps(bytes_of(e, key, field), seconds_of(e, key))


def _commit(e: dict) -> dict:
    ours = _per_byte(e, "commit/extensible")
    return {
        "paths": {
            path: {
                "seconds": seconds_of(e, key),
                "bytes": bytes_of(e, key),
                "gbps": _rate(e, key),
                "handles": bytes_of(e, key, "handles"),
            }
            for path in ("per_granule", "single_handle", "extensible")
            if (key := f"commit/{path}") in e
        },
        "speedup_vs_per_granule": _div(_per_byte(e, "commit/per_granule"), ours),
        "time_vs_single_handle": _div(ours, _per_byte(e, "commit/single_handle")),
    }


def _peers(e: dict) -> dict:
    ours = _per_byte(e, "commit/extensible")
    return {
        **{key.removeprefix("peer/") + "_s": seconds_of(e, key) for key, _name, _ratio in PEERS},
        **{ratio: _div(ours, _per_byte(e, key)) for key, _name, ratio in PEERS},
    }


def _zero(e: dict) -> dict:
    with_zero, without = seconds_of(e, "zero/grow_zero"), seconds_of(e, "zero/grow_nozero")
    implied = with_zero - without if with_zero is not None and without is not None else None
    zero_gbps = _gbps(bytes_of(e, "zero/grow_zero"), implied) if implied and implied > 0 else None
    return {
        "bytes": bytes_of(e, "zero/grow_zero"),
        "grow_zero_s": with_zero,
        "grow_nozero_s": without,
        "implied_zero_s": implied,
        "zero_gbps": zero_gbps,
        "memset_gbps": _rate(e, "zero/memset"),
        "zero_vs_memset": _div(zero_gbps, _rate(e, "zero/memset")),
        "end_to_end_gbps": _rate(e, "zero/grow_zero"),
        "torch_zero_gbps": _rate(e, "zero/torch_zero_"),
        "zero_calls": bytes_of(e, "zero/grow_zero", "zero_calls"),
    }


def _kv(e: dict) -> dict:
    fields = ("bytes", "buffers", "segments", "state", "handles", "set_access")
    return {
        key.removeprefix("kv/"): {
            "ms": e[key]["seconds"] * 1e3 if e[key]["seconds"] is not None else None,
            **{f: e[key]["extra"].get(f) for f in fields},
        }
        for key in sorted(k for k in e if k.startswith("kv/"))
    }


def _access(e: dict) -> dict:
    rates = {
        op: [_rate(e, f"access/{op}/{m}", "moved_bytes") for m in ("vmm", "native")]
        for op in ("copy", "kernel")
        if f"access/{op}/vmm" in e or f"access/{op}/native" in e
    }
    return {
        op: {"vmm_gbps": vmm, "native_gbps": native, "ratio": _div(vmm, native)} for op, (vmm, native) in rates.items()
    }


def _graph(e: dict) -> dict:
    before, after = seconds_of(e, "graph/before_growth"), seconds_of(e, "graph/after_growth")
    return {"before_s": before, "after_s": after, "ratio": _div(after, before)}


def _scaling(e: dict) -> dict:
    fields = ("nominal_gib", "segments", "bytes", "handles", "set_access", "runs", "granules")
    rows = sorted(
        (
            {
                **{f: x["extra"].get(f) for f in fields},
                "seconds": x["seconds"],
                "gbps": _gbps(x["extra"].get("bytes"), x["seconds"]),
                "us_per_handle": _div(x["seconds"] and x["seconds"] * 1e6, x["extra"].get("handles")),
            }
            for key, x in e.items()
            if key.startswith("scale/")
        ),
        key=lambda r: (r["nominal_gib"], r["segments"]),
    )
    growth = []  # per size: time growth over handle growth, against the fewest segments
    for gib in {r["nominal_gib"] for r in rows}:
        base = min((r for r in rows if r["nominal_gib"] == gib), key=lambda r: r["segments"])
        growth += [
            (r["seconds"] / base["seconds"]) / (r["handles"] / base["handles"])
            for r in rows
            if r["nominal_gib"] == gib
            and r is not base
            and base["handles"]
            and base["seconds"]
            and r["seconds"] is not None
            and r["handles"]
        ]
    handles = {n: {r["handles"] for r in rows if r["segments"] == n} for n in {r["segments"] for r in rows}}
    return {
        "rows": rows,
        "handles_track_runs": all(r["handles"] == r["runs"] for r in rows) if rows else None,
        "handles_independent_of_bytes": all(len(h) == 1 for h in handles.values()) if rows else None,
        "worst_growth_vs_handles": max(growth, default=None),
    }


# The targets: (name, the summary figure, comparison, goal); judged only where the run makes claims (CUDA).
_OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq}


def _targets(s: dict) -> list[dict]:
    sc = s["scaling"]
    rows = [
        (
            "commit 32 GiB, GB/s (ExtensibleTensor)",
            s["commit"]["paths"].get("extensible", {}).get("gbps"),
            ">=",
            5000.0,
        ),
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
        {
            "name": name,
            "value": value,
            "op": op,
            "target": goal,
            "met": None if value is None or not s["claims"] else _OPS[op](value, goal),
        }
        for name, value, op, goal in rows
    ]
