"""Bad input to ``python -m extensible_kv``: one line on stderr naming the problem, a non-zero exit, no traceback.

Each row is run in a subprocess, so a crash shows as it is. ``files`` are written into a fresh folder first
(``{tmp}`` in the arguments); a row with exit 0 is a correct input that must pass, its words are looked for on
stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GOOD = "tests.unit._factories:KVFirstBackend"
RAISING = "tests.unit.test_cli_bad_input:RaisingBackend"
EMPTY = "tests.unit.test_cli_bad_input:EmptyBackend"
EXITING = "tests.unit.test_cli_bad_input:ExitingBackend"


class RaisingBackend:
    """A backend whose shape function fails, as a vLLM backend does where its kernels are missing."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        raise RuntimeError("no kernels for this head size")


class ExitingBackend:
    """A backend whose shape function calls ``sys.exit``: its failure, reported, never the end of the run."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        raise SystemExit(3)


class EmptyBackend:
    """A backend whose blocks hold no bytes."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (2, num_blocks, 0, num_kv_heads, head_size)


def _bench(extra: dict, stats: dict | None = None) -> str:
    return json.dumps({"benchmarks": [{"name": "b", "extra_info": extra, "stats": stats or {"median": 0.5}}]})


CASE = '{"case": {"model": "m", "runner": "v1", "backend": "FLASH_ATTN", "mode": "legacy"}, "memory": %s}'
BACKENDS = '{"results": [{"backend": "B", "ok": true, "checks": %s}]}'
VALID = {"run/validate-backend.json": BACKENDS % "[]"}  # one valid measurement file

ROWS = {
    # report: a run folder with one bad file is refused, naming the file
    "report_truncated_json": (
        {"run/conformance-cuda.json": '{"exitstatus": 0, "drivers": [{"driver": "cu'},
        ("report", "{tmp}/run", "--out", "{tmp}/out"),
        2,
        ("conformance-cuda.json", "not valid JSON"),
    ),
    "report_empty_json": (
        {"run/bench-cuda.json": ""},
        ("report", "{tmp}/run", "--out", "{tmp}/out"),
        2,
        ("bench-cuda.json", "empty"),
    ),
    "report_json_list": (
        {"run/integration/call1/case.json": "[1, 2]"},
        ("report", "{tmp}/run", "--out", "{tmp}/out"),
        2,
        ("case.json", "object", "list"),
    ),
    "report_wrong_field": (
        {"run/conformance-host.json": '{"drivers": 5}'},
        ("report", "{tmp}/run", "--out", "{tmp}/out"),
        2,
        ("conformance-host.json", "drivers"),
    ),
    "report_wrong_nested_field": (
        {"run/integration/case.json": CASE % '{"total": "80 GB"}'},
        ("report", "{tmp}/run", "--out", "{tmp}/out"),
        2,
        ("case.json", "memory.total", "integer", '"80 GB"'),
    ),
    "report_bench_wrong_field": (
        {"run/bench-cuda.json": _bench({"key": "commit/extensible", "bytes": "1 GiB"})},
        ("report", "{tmp}/run", "--out", "{tmp}/out"),
        2,
        ("bench-cuda.json", "extra_info.bytes", "integer", '"1 GiB"'),
    ),
    "report_backends_wrong_field": (
        {"run/validate-backend-cuda.json": BACKENDS % '[{"name": "layout", "ok": "yes"}]'},
        ("report", "{tmp}/run", "--out", "{tmp}/out"),
        2,
        ("validate-backend-cuda.json", "results[0].checks[0].ok", "true or false"),
    ),
    "report_environment_wrong_field": (
        VALID | {"run/environment.json": '{"gpu_memory": -1}'},
        ("report", "{tmp}/run", "--out", "{tmp}/out"),
        2,
        ("environment.json", "gpu_memory", "non-negative integer", "-1"),
    ),
    "report_case_missing_field": (
        {"run/integration/case.json": '{"case": {"model": "m"}, "memory": {}}'},
        ("report", "{tmp}/run", "--out", "{tmp}/out"),
        2,
        ("case.json", "case.runner is missing"),
    ),
    "report_out_is_a_file": (
        VALID | {"taken": ""},
        ("report", "{tmp}/run", "--out", "{tmp}/taken"),
        2,
        ("--out", "taken", "is a regular file, not a folder"),
    ),
    "report_no_measurements": ({}, ("report", "/etc", "--out", "{tmp}/out"), 2, ("no measurement files in /etc",)),
    # check-driver: the driver is required, and a spec that names no driver is one line (nothing imported here)
    "check_driver_without_a_driver": ({}, ("check-driver",), 2, ("check-driver", "required: driver")),
    "check_driver_no_such_module": (
        {},
        ("check-driver", "nosuchpkg:factory"),
        2,
        ("'nosuchpkg:factory'", "no module named 'nosuchpkg'"),
    ),
    "check_driver_spec_syntax": (
        {},
        ("check-driver", "no such:factory"),
        2,
        ("'no such:factory'", "neither a registered driver name nor"),
    ),
    "check_driver_unknown_name": ({}, ("check-driver", "nope"), 2, ("unknown driver 'nope'", "host-4k")),
    "check_driver_no_such_factory": (
        {},
        ("check-driver", "tests.unit._factories:nothing"),
        2,
        ("tests.unit._factories has no callable 'nothing'",),
    ),
    # validate-backend: sizes are positive ints, backend specs well formed, a failing backend does not stop the rest
    "block_size_zero": ({}, ("validate-backend", GOOD, "--block-size", "0"), 2, ("--block-size", "'0'", "positive")),
    "num_kv_heads_negative": (
        {},
        ("validate-backend", GOOD, "--num-kv-heads", "-1"),
        2,
        ("--num-kv-heads", "'-1'", "positive"),
    ),
    "head_size_zero": ({}, ("validate-backend", GOOD, "--head-size", "0"), 2, ("--head-size", "'0'", "positive")),
    "spec_without_module": ({}, ("validate-backend", ":Flash"), 2, ("':Flash'", "module:Class")),
    "spec_without_class": (
        {},
        ("validate-backend", "tests.unit._factories:"),
        2,
        ("'tests.unit._factories:'", "module:Class"),
    ),
    "backend_shape_raises": (
        {},
        ("validate-backend", RAISING, GOOD, "--driver", "host-4k"),
        1,
        ("1 of 2 failed", "RaisingBackend/NHD", "RuntimeError: no kernels for this head size"),
    ),
    "backend_shape_exits": (
        {},
        ("validate-backend", EXITING, GOOD, "--driver", "host-4k"),
        1,
        ("1 of 2 failed", "ExitingBackend/NHD", "SystemExit: 3"),
    ),
    "validate_backend_unknown_driver": (
        {},
        ("validate-backend", GOOD, "--driver", "cud"),
        2,
        ("unknown driver 'cud'", "host-4k"),
    ),
    "backend_shape_empty": (
        {},
        ("validate-backend", EMPTY, GOOD, "--driver", "host-4k"),
        1,
        ("1 of 2 failed", "EmptyBackend/NHD", "0 bytes per block"),
    ),
    # validate-backend: a page the driver cannot hold is a failed check naming page, blocks and the driver's limit
    "backend_page_exceeds_the_driver": (
        {},
        ("validate-backend", GOOD, "--driver", "host", "--num-kv-heads", "64", "--head-size", "65536"),
        1,
        ("page 268435456 bytes x 64 blocks", "driver host holds 1073741824 bytes", "CommitOutOfMemory"),
    ),
    "backend_page_exceeds_the_address_space": (
        {},
        ("validate-backend", GOOD, "--driver", "host", "--num-kv-heads", "100000", "--head-size", "1000000000000"),
        1,
        ("page 6400000000000000000 bytes x 64 blocks", "driver host holds 1073741824 bytes", "InvalidSizeError"),
    ),
    "backend_json_unwritable": (
        {"taken": ""},
        ("validate-backend", GOOD, "--driver", "host-4k", "--json", "{tmp}/taken/vb.json"),
        2,
        ("--json", "taken/vb.json", "cannot be written (Not a directory)"),
    ),
    "backend_json_written": (
        {},
        ("validate-backend", GOOD, "--driver", "host-4k", "--json", "{tmp}/vb.json"),
        0,
        ("1 of 1 passed",),
    ),
    # environment: one line when the folder cannot be written
    "environment_unwritable": ({"taken": ""}, ("environment", "{tmp}/taken"), 2, ("OUT_DIR", "taken", "not a folder")),
    # fp8 KV caches are a normal setting: a correct backend passes
    "fp8_e4m3": (
        {},
        ("validate-backend", GOOD, "--driver", "host-4k", "--dtype", "float8_e4m3fn"),
        0,
        ("1 of 1 passed",),
    ),
    "fp8_e5m2": (
        {},
        ("validate-backend", GOOD, "--driver", "host-4k", "--dtype", "float8_e5m2"),
        0,
        ("1 of 1 passed",),
    ),
    "fp8_cache_dtype": (
        {},
        (
            "validate-backend",
            GOOD,
            "--driver",
            "host-4k",
            "--cache-dtype",
            "fp8",
            "--dtype",
            "float8_e4m3fn",
            "--layout",
            "both",
        ),
        0,
        ("2 of 2 passed",),
    ),
    # bench-summary: valid JSON of the wrong shape is refused, naming the file and the field
    "bench_json_list": ({"bench.json": "[]"}, ("bench-summary", "{tmp}/bench.json"), 2, ("bench.json", "object")),
    "bench_no_benchmarks": (
        {"bench.json": '{"machine_info": {}}'},
        ("bench-summary", "{tmp}/bench.json"),
        2,
        ("bench.json", "benchmarks"),
    ),
    "bench_no_keys": (
        {"bench.json": _bench({"driver": "cuda"})},
        ("bench-summary", "{tmp}/bench.json"),
        2,
        ("bench.json", "extra_info.key"),
    ),
    "bench_extra_info_list": (
        {"bench.json": '{"benchmarks": [{"extra_info": [1]}]}'},
        ("bench-summary", "{tmp}/bench.json"),
        2,
        ("bench.json", "benchmarks[0].extra_info"),
    ),
    "bench_median_text": (
        {"bench.json": _bench({"key": "commit/extensible"}, {"median": "fast"})},
        ("bench-summary", "{tmp}/bench.json"),
        2,
        ("bench.json", "stats.median", "number"),
    ),
    # bench-summary: a time must be positive; the refusal names the file, the benchmark, the field and the value
    "bench_time_must_be_positive_negative_median": (
        {"bench.json": _bench({"key": "commit/extensible"}, {"median": -1.0})},
        ("bench-summary", "{tmp}/bench.json"),
        2,
        ("bench.json", "'commit/extensible'", "stats.median", "-1.0", "positive"),
    ),
    "bench_time_must_be_positive_zero_median": (
        {"bench.json": _bench({"key": "commit/extensible"}, {"median": 0})},
        ("bench-summary", "{tmp}/bench.json"),
        2,
        ("bench.json", "'commit/extensible'", "stats.median", " 0 ", "positive"),
    ),
    "bench_time_must_be_positive_negative_subprocess_median": (
        {"bench.json": _bench({"key": "kv/2seg/fresh", "subprocess_median_s": -0.25})},
        ("bench-summary", "{tmp}/bench.json", "--json"),
        2,
        ("bench.json", "'kv/2seg/fresh'", "extra_info.subprocess_median_s", "-0.25", "positive"),
    ),
    "report_bench_time_must_be_positive": (
        {"run/bench-cuda.json": _bench({"key": "commit/extensible"}, {"median": -1.0})},
        ("report", "{tmp}/run", "--out", "{tmp}/out"),
        2,
        ("bench-cuda.json", "'commit/extensible'", "stats.median", "-1.0", "positive"),
    ),
}


@pytest.mark.parametrize("files,args,code,words", ROWS.values(), ids=ROWS.keys())
def test_cli_answers_bad_input_with_one_line(tmp_path, files, args, code, words):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    argv = [a.format(tmp=tmp_path) for a in args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "reference"), str(ROOT)]))
    proc = subprocess.run(
        [sys.executable, "-m", "extensible_kv", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    shown = (
        f"python -m extensible_kv {' '.join(argv)}: exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    )
    assert "Traceback" not in proc.stdout + proc.stderr, shown
    assert proc.returncode == code, shown
    if code == 0:
        assert not proc.stderr and all(w in proc.stdout for w in words), shown
        return
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), shown
    assert not (tmp_path / "out").exists(), f"{shown}\na refused report wrote {tmp_path / 'out'}"
