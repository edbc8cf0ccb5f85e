"""Tests of ``extensible_kv_lab.report.benchmarks`` (and the ``bench-summary`` command) on a small hand-made
pytest-benchmark JSON (no benchmark runs here).

The fixture's times are powers of two, so every ratio the summary computes has an exact expected value; each
assertion names a number that a wrong formula (an inverted ratio, a stats median where the subprocess median
belongs, a missing per-byte normalisation, a wrong zero subtraction) would not produce.
"""

from __future__ import annotations

import json

import pytest

from extensible_kv_lab.report import benchmarks as S
from extensible_kv_lab.report.rendering import bench_tables

GIB = 1 << 30
B = 32 * GIB  # 2**35


def _bench(key: str, median: float, device_type: str = "cuda", **extra) -> dict:
    """One benchmark as pytest-benchmark writes it (only the fields the summary reads, plus realistic noise)."""
    return {
        "group": key.split("/")[0],
        "name": f"test_x[{key}]",
        "fullname": f"bench/test_x.py::test_x[{key}]",
        "params": None,
        "param": None,
        "options": {"disable_gc": False},
        "extra_info": {
            "key": key,
            "driver": "cuda" if device_type == "cuda" else "host",
            "device_type": device_type,
            "granularity": 2 << 20,
            "scale": 1.0,
            **extra,
        },
        "stats": {
            "min": median / 2,
            "max": median * 2,
            "mean": median * 1.1,
            "median": median,
            "rounds": 5,
            "iterations": 1,
        },
    }


def _fixture(device_type: str = "cuda") -> dict:
    rows = [
        ("commit/per_granule", 1.0, dict(bytes=B, handles=16384)),
        ("commit/single_handle", 2.0**-9, dict(bytes=B, handles=1)),
        ("commit/extensible", 2.0**-8, dict(bytes=B, handles=1)),
        ("peer/torch_default", 2.0**-10, dict(bytes=B)),
        # stats time the whole subprocess (3.5 s); the figure is subprocess_median_s, for half the bytes
        ("peer/expandable_segments", 3.5, dict(bytes=B // 2, subprocess_median_s=2.0**-4)),
        ("zero/grow_zero", 2.0**-6, dict(bytes=B, zero_calls=1)),
        ("zero/grow_nozero", 2.0**-8, dict(bytes=B, zero_calls=0)),
        ("zero/memset", 2.0**-7, dict(bytes=B)),
        ("zero/torch_zero_", 2.0**-7, dict(bytes=B)),
        ("kv/2seg/fresh", 2.0**-6, dict(bytes=100 * GIB, buffers=64, segments=2, state="fresh", handles=128)),
        (
            "kv/1seg/after_release",
            0.125,
            dict(bytes=100 * GIB, buffers=64, segments=1, state="after_release", handles=64),
        ),
        ("access/copy/vmm", 2.0**-8, dict(bytes=8 * GIB, moved_bytes=16 * GIB)),
        ("access/copy/native", 2.0**-8 - 2.0**-14, dict(bytes=8 * GIB, moved_bytes=16 * GIB)),
        ("access/kernel/vmm", 2.0**-8, dict(bytes=8 * GIB, moved_bytes=16 * GIB)),  # its native peer is missing
        ("graph/before_growth", 2.0**-10, dict(bytes=GIB)),
        ("graph/after_growth", 2.0**-10 + 2.0**-15, dict(bytes=GIB)),
        ("scale/32GiB/64seg", 2.0**-3, dict(nominal_gib=32, segments=64, bytes=B, handles=64, runs=64)),
        ("scale/1GiB/1seg", 2.0**-10, dict(nominal_gib=1, segments=1, bytes=GIB, handles=1, runs=1)),
        ("scale/1GiB/64seg", 2.0**-6, dict(nominal_gib=1, segments=64, bytes=GIB, handles=64, runs=64)),
        ("scale/32GiB/1seg", 2.0**-8, dict(nominal_gib=32, segments=1, bytes=B, handles=1, runs=1)),
    ]
    benchmarks = [_bench(key, median, device_type, **extra) for key, median, extra in rows]
    benchmarks.append({"name": "test_other", "extra_info": {}, "stats": {"median": 1.0}})  # not ours: ignored
    return {"machine_info": {}, "commit_info": {}, "benchmarks": benchmarks, "version": "5.2.3"}


@pytest.fixture
def fixture_path(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_fixture()))
    return path


def _target(summary: dict, name: str) -> dict:
    (row,) = [t for t in summary["targets"] if t["name"] == name]
    return row


def test_commit_figures_and_ratios(fixture_path):
    s = S.summarize(fixture_path)
    assert s["driver"] == "cuda" and s["claims"] is True
    paths = s["commit"]["paths"]
    assert paths["extensible"]["gbps"] == pytest.approx(8796.093022208, rel=1e-12)  # 2**35 B / 2**-8 s
    assert paths["per_granule"]["gbps"] == pytest.approx(34.359738368, rel=1e-12)
    assert paths["per_granule"]["handles"] == 16384
    assert s["commit"]["speedup_vs_per_granule"] == 256.0  # per-granule time / ours, not the inverse
    assert s["commit"]["time_vs_single_handle"] == 2.0  # ours / single handle


def test_peer_ratios_use_the_subprocess_figure_per_byte(fixture_path):
    p = S.summarize(fixture_path)["peers"]
    assert p["torch_default_s"] == 2.0**-10
    assert p["time_vs_torch_default"] == 4.0
    assert p["expandable_segments_s"] == 0.0625  # subprocess_median_s, not the 3.5 s stats median
    assert p["time_vs_expandable_segments"] == 0.03125  # (2**-8 / 2**35) / (2**-4 / 2**34)


def test_zero_bandwidth_is_the_difference_of_grow_with_and_without_zero(fixture_path):
    z = S.summarize(fixture_path)["zero"]
    assert z["implied_zero_s"] == 0.01171875  # 2**-6 - 2**-8
    assert z["zero_gbps"] == pytest.approx(2932.031007402667, rel=1e-12)  # 2**43 / 3 / 1e9
    assert z["memset_gbps"] == pytest.approx(4398.046511104, rel=1e-12)
    assert z["zero_vs_memset"] == pytest.approx(2 / 3, rel=1e-12)
    assert z["end_to_end_gbps"] == pytest.approx(2199.023255552, rel=1e-12)
    assert z["torch_zero_gbps"] == pytest.approx(4398.046511104, rel=1e-12)
    assert z["zero_calls"] == 1


def test_kv_access_and_graph(fixture_path):
    s = S.summarize(fixture_path)
    assert s["kv"]["2seg/fresh"]["ms"] == 15.625
    assert s["kv"]["1seg/after_release"]["ms"] == 125.0
    assert s["kv"]["2seg/fresh"]["handles"] == 128
    copy = s["access"]["copy"]
    assert copy["vmm_gbps"] == pytest.approx(4398.046511104, rel=1e-12)  # moved bytes, not bytes
    assert copy["ratio"] == pytest.approx(0.984375, rel=1e-12)  # bandwidth vmm / native = t_native / t_vmm
    assert s["access"]["kernel"]["native_gbps"] is None and s["access"]["kernel"]["ratio"] is None
    assert s["graph"]["ratio"] == 1.03125  # after / before


def test_scaling_curve(fixture_path):
    sc = S.summarize(fixture_path)["scaling"]
    assert [(r["nominal_gib"], r["segments"]) for r in sc["rows"]] == [(1, 1), (1, 64), (32, 1), (32, 64)]
    assert sc["rows"][3]["us_per_handle"] == 1953.125  # 2**-3 s / 64 handles
    assert sc["rows"][2]["gbps"] == pytest.approx(8796.093022208, rel=1e-12)
    assert sc["worst_growth_vs_handles"] == 0.5  # 32 GiB: 16x the time for 64x the handles -> 0.25; 1 GiB -> 0.5
    assert sc["handles_track_runs"] is True and sc["handles_independent_of_bytes"] is True


def test_scaling_flags_handles_that_follow_granules():
    data = _fixture()
    for b in data["benchmarks"]:
        if b["extra_info"].get("key") == "scale/32GiB/64seg":
            b["extra_info"]["handles"] = 16384  # one per granule: not runs, and not the 1 GiB count
    sc = S.summarize_data(data)["scaling"]
    assert sc["handles_track_runs"] is False and sc["handles_independent_of_bytes"] is False


def test_targets_are_judged_on_cuda(fixture_path):
    s = S.summarize(fixture_path)
    expected = {
        "commit 32 GiB, GB/s (ExtensibleTensor)": True,
        "commit speedup vs per-granule": True,
        "commit time / torch default (cudaMalloc)": False,
        "commit time / expandable segments": True,
        "KV growth ms [1seg/after_release]": False,
        "KV growth ms [2seg/fresh]": True,
        "zero_new bandwidth / memset": False,
        "copy bandwidth vmm / native": True,
        "kernel bandwidth vmm / native": None,  # no native figure: no verdict
        "graph replay after / before growth": False,
        "scaling: time growth / handle growth (worst)": True,
        "scaling: handles == runs": True,
        "scaling: handles independent of bytes": True,
    }
    assert {t["name"]: t["met"] for t in s["targets"]} == expected
    assert _target(s, "commit time / torch default (cudaMalloc)")["value"] == 4.0


def test_host_runs_make_no_claims(tmp_path):
    path = tmp_path / "host.json"
    path.write_text(json.dumps(_fixture(device_type="cpu")))
    s = S.summarize(path)
    assert s["claims"] is False and s["driver"] == "host"
    assert s["commit"]["speedup_vs_per_granule"] == 256.0  # figures are still computed
    assert all(t["met"] is None for t in s["targets"])


def test_empty_run_gives_no_figures():
    s = S.summarize_data({"benchmarks": []})
    assert s["keys"] == [] and s["commit"]["paths"] == {} and s["zero"]["zero_gbps"] is None
    assert s["scaling"]["worst_growth_vs_handles"] is None
    assert all(t["value"] is None and t["met"] is None for t in s["targets"])
    tables = bench_tables(s, "empty.json")
    assert "| target | value | goal | met |" in tables and "Figure" not in tables, tables


def test_bench_summary_command_prints_the_table_and_json(fixture_path, capsys):
    from extensible_kv.__main__ import main

    assert main(["bench-summary", str(fixture_path)]) == 0
    out = capsys.readouterr().out
    assert "commit speedup vs per-granule" in out and "256" in out and "NO" in out
    assert main(["bench-summary", str(fixture_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(S.summarize(fixture_path)))


@pytest.mark.parametrize("content", [None, "{not json"], ids=["missing", "not-json"])
def test_bench_summary_command_names_an_unreadable_file(tmp_path, capsys, content):
    from extensible_kv.__main__ import main

    path = tmp_path / "bench.json"
    if content is not None:
        path.write_text(content)
    assert main(["bench-summary", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: {path}: ") and captured.err.count("\n") == 1, captured.err
    assert captured.out == ""
