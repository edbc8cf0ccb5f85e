"""The memory-accounting report renders fixture runs (report_fixtures/) and every number in it equals the input.

The fixtures are small hand-written files in the formats of ``extensible_kv_lab.measurements``: ``full`` has every
input, ``partial`` lacks the benchmarks, the backend validation and the extensible partner of its one legacy case.
Expected values are computed here from the fixture JSON, never copied from the report. The writers (the conformance
and bench conftests, ``validate-backend --json``, ``environment``) are run here too, and their files read back
through the schema and rendered.
"""

from __future__ import annotations

import argparse
import ast
import base64
import dataclasses
import fnmatch
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from html import unescape
from html.parser import HTMLParser
from pathlib import Path

import pytest
import tomllib
from markdown_it import MarkdownIt

from extensible_kv_lab import report
from extensible_kv_lab.measurements import BackendValidation, BenchmarkFile, ConformanceSummary, Environment, read
from extensible_kv_lab.report import accounting, benchmarks, document, numbers, rendering
from extensible_kv_lab.report.run import load_run

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "report_fixtures"
FULL, PARTIAL = FIXTURES / "full", FIXTURES / "partial"
MIB, GIB = 1 << 20, 1 << 30
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# -- helpers -------------------------------------------------------------------------------------------------------
def report_main(argv: list[str]) -> int:
    """``python -m extensible_kv report ARGV``, through the command's own parser."""
    parser = argparse.ArgumentParser()
    report.register(parser.add_subparsers())
    args = parser.parse_args(["report", *argv])
    return args.run(args)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def case_file(run: Path, rel: str) -> dict:
    return read_json(run / "integration" / rel)


def md_text(cell: str) -> str:
    """A cell as a Markdown renderer shows it: backslash escapes of punctuation undone."""
    return re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", cell)


def md_tables(md: str) -> list[list[dict[str, str]]]:
    """Every Markdown table of ``md`` as a list of rows keyed by column header, each cell as a renderer shows it."""
    tables, lines = [], md.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("| ") and i + 1 < len(lines) and lines[i + 1].startswith("| ---"):
            head = [c.strip() for c in lines[i].strip().strip("|").split(" | ")]
            rule = lines[i + 1].strip().strip("|").split("|")
            # A delimiter row of another width is no table to a Markdown renderer: the lines stay a paragraph.
            assert len(rule) == len(head), f"table {head}: {len(head)} headers, {len(rule)} delimiter cells"
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = [md_text(c.strip()) for c in lines[i].strip().strip("|").split(" | ")]
                rows.append(dict(zip(head, cells)))
                i += 1
            tables.append(rows)
        else:
            i += 1
    return tables


def md_row(md: str, column: str, value: str, *, needs: str | None = None) -> dict[str, str]:
    """The one row, in a table that has ``needs`` as a column, whose ``column`` is ``value``."""
    found = [r for t in md_tables(md) for r in t if r.get(column) == value and (needs is None or needs in r)]
    assert len(found) == 1, f"expected one row with {column} = {value!r} (and a {needs!r} column), got {found}"
    return found[0]


def section(md: str, title: str) -> str:
    """The text of the ``## title`` section, up to the next ``## ``."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", md, re.DOTALL | re.MULTILINE)
    assert m, f"no section {title!r} in the report"
    return m.group(1)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f}"


def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:,.2f}"


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE, "not a PNG"
    return struct.unpack(">II", data[16:24])


def render(run: Path, out: Path, *extra: str) -> tuple[str, dict, str]:
    code = report_main([str(run), "--out", str(out), *extra])
    assert code == 0, f"report exited {code} for {run}"
    return (out / "report.md").read_text(), read_json(out / "summary.json"), (out / "report.html").read_text()


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    md, summary, html = render(FULL, out)
    return out, md, summary, html


@pytest.fixture(scope="module")
def partial(tmp_path_factory):
    out = tmp_path_factory.mktemp("partial")
    md, summary, html = render(PARTIAL, out)
    return out, md, summary, html


# -- conformance ---------------------------------------------------------------------------------------------------
def test_conformance_counts_equal_the_input(full):
    _, md, summary, _ = full
    for name in ("conformance-cuda.json", "conformance-host.json"):
        data = read_json(FULL / name)
        want = data["drivers"][0]
        got = next(c for c in summary["conformance"] if c["source"] == name)["drivers"][0]
        for key in ("passed", "failed", "skipped", "granularity", "commit_gb_per_s", "commit_bytes"):
            assert got[key] == want[key], f"{name}: summary.json {key} = {got[key]}, input {want[key]}"
        row = md_row(md, "file", name, needs="passed")
        assert (row["driver"], row["passed"], row["failed"], row["skipped"]) == (
            want["driver"],
            str(want["passed"]),
            str(want["failed"]),
            str(want["skipped"]),
        ), row
        assert row["commit probe (GB/s)"] == f"{want['commit_gb_per_s']:,.2f}"
        outcomes = {}
        for t in data["tests"]:
            outcomes[t["outcome"]] = outcomes.get(t["outcome"], 0) + 1
        assert next(c for c in summary["conformance"] if c["source"] == name)["outcomes"] == outcomes


# -- benchmarks ----------------------------------------------------------------------------------------------------
def bench_entry(key: str) -> dict:
    for b in read_json(FULL / "bench-cuda.json")["benchmarks"]:
        if b["extra_info"]["key"] == key:
            return b
    raise AssertionError(f"fixture has no benchmark {key}")


def test_commit_benchmark_numbers_equal_the_input(full):
    _, md, summary, _ = full
    paths = summary["bench"][0]["summary"]["commit"]["paths"]
    for path in ("per_granule", "single_handle", "extensible"):
        b = bench_entry(f"commit/{path}")
        seconds, nbytes = b["stats"]["median"], b["extra_info"]["bytes"]
        assert paths[path]["seconds"] == seconds and paths[path]["bytes"] == nbytes
        row = md_row(md, "path", path, needs="GB/s")
        assert row["median (ms)"] == ms(seconds), row
        assert row["GB/s"] == gbps(nbytes, seconds), row
        assert row["handles"] == f"{b['extra_info']['handles']:,}", row
    # the expandable-segments peer takes its subprocess median, not the pytest-benchmark median
    peer = bench_entry("peer/expandable_segments")
    row = md_row(md, "peer", "torch expandable segments")
    assert row["median (ms)"] == ms(peer["extra_info"]["subprocess_median_s"]), row
    assert row["GB/s"] == gbps(peer["extra_info"]["bytes"], peer["extra_info"]["subprocess_median_s"]), row


def test_scaling_and_kv_growth_rows_equal_the_input(full):
    _, md, _, _ = full
    rows = [r for t in md_tables(md) for r in t if "us per handle" in r]
    scale = sorted(
        (b for b in read_json(FULL / "bench-cuda.json")["benchmarks"] if b["extra_info"]["key"].startswith("scale/")),
        key=lambda b: (b["extra_info"]["nominal_gib"], b["extra_info"]["segments"]),
    )
    assert len(rows) == len(scale)
    for row, b in zip(rows, scale):
        x = b["extra_info"]
        assert (row["nominal (GiB)"], row["segments"], row["handles"]) == (
            str(x["nominal_gib"]),
            str(x["segments"]),
            str(x["handles"]),
        ), row
        assert row["median (ms)"] == ms(b["stats"]["median"]) and row["GB/s"] == gbps(x["bytes"], b["stats"]["median"])
        assert row["bytes per handle (MiB)"] == f"{x['bytes'] / x['handles'] / MIB:,.2f}"
    kv = bench_entry("kv/1seg/fresh")
    row = md_row(md, "case", "1seg/fresh", needs="buffers")
    assert row["median (ms)"] == ms(kv["stats"]["median"]) and row["buffers"] == str(kv["extra_info"]["buffers"])


# -- integration ---------------------------------------------------------------------------------------------------
LEGACY = "call1/tiny-llama-v1-FLASH_ATTN-legacy.json"
EXT = "call1/tiny-llama-v1-FLASH_ATTN-extensible.json"
PLUGIN = "call2/tiny-llama-v1-FLASH_ATTN-plugin.json"


def test_case_blocks_and_commit_times_equal_the_input(full):
    _, md, summary, _ = full
    cases = {c["path"]: c for c in summary["integration"]["cases"]}
    assert set(cases) == {LEGACY, EXT, PLUGIN}
    for rel in (LEGACY, EXT, PLUGIN):
        data = case_file(FULL, rel)
        blocks = data["memory"]["num_gpu_blocks"]
        commit = (data["extensible"] or {}).get("commit_seconds")
        assert cases[rel]["blocks"] == blocks and cases[rel]["commit_seconds"] == commit
        row = md_row(md, "case file", rel, needs="KV blocks")
        assert row["KV blocks"] == f"{blocks:,}", row
        assert row["final commit (ms)"] == (ms(commit) if commit is not None else "not measured"), row


def test_memory_segments_follow_the_documented_formulas(full):
    _, md, summary, _ = full
    cases = {c["path"]: c for c in summary["integration"]["cases"]}
    ext, legacy = case_file(FULL, EXT), case_file(FULL, LEGACY)
    bpb = ext["extensible"]["measured"]["bytes_per_block"]
    m = legacy["memory"]
    kv = m["num_gpu_blocks"] * bpb  # legacy KV = its blocks x the extensible partner's bytes per block
    non_kv = m["init_free"] - m["free_after_warmup"] - kv
    c = cases[LEGACY]
    assert c["kv_committed"] == kv and c["kv_partner"] == EXT
    assert c["non_kv_after_warmup"] == non_kv
    assert c["other_non_kv"] == non_kv - m["weights"]  # no cudagraph_memory here; the activation peak is not resident
    assert c["activation_headroom"] is None and c["over_budget_at_peak"] is None  # no measured peak here
    assert c["graph_pools"] is None
    assert c["over_budget"] == m["init_free"] - m["requested"] - m["free_after_warmup"]
    assert c["non_kv_estimate"] == m["requested"] - m["available_kv_cache_memory"]
    assert sum(s["bytes"] for s in c["segments"]) == m["total"]
    e, em = cases[EXT], ext["memory"]
    backed, committed = ext["extensible"]["kv"]["backed_bytes"], ext["extensible"]["kv"]["committed_bytes"]
    assert e["kv_committed"] == committed and e["kv_padding"] == backed - committed
    assert e["graph_pools"] == em["cudagraph_memory"]
    assert e["other_non_kv"] == (
        em["init_free"] - em["free_after_warmup"] - backed - em["weights"] - em["cudagraph_memory"]
    )
    growth = em["peak"]["growth"]  # measured at the peak-shaped batch, never derived from the profiled peak
    headroom = growth["before_batch"]["torch_reserved"] + growth["during_batch"]["torch_reserved"]
    assert e["activation_headroom"] == headroom and headroom > 0
    assert e["over_budget_at_peak"] == em["peak"]["over_budget_measured"]
    assert e["non_kv_sizing"] == ext["extensible"]["measured"]["non_kv"]
    row = md_row(md, "case file", LEGACY, needs="over budget")
    assert row["KV committed"] == f"{kv / MIB:,.2f}" and row["CUDA graph pools"] == "not measured", row
    assert row["over budget"] == f"{c['over_budget'] / MIB:+,.2f}", row
    assert row["torch growth at the measured peak"] == "not measured", row
    row = md_row(md, "case file", EXT, needs="over budget at peak")
    assert row["over budget at peak"] == f"{e['over_budget_at_peak'] / MIB:+,.2f}", row
    assert row["torch growth at the measured peak"] == f"{headroom / MIB:,.2f}", row
    glance = (
        "Memory beyond gpu_memory_utilization at the measured peak, extensible and entry-point "
        f"runs: {e['over_budget_at_peak'] / MIB:+,.2f} MiB (1 of 2 run(s) recorded it)."
    )
    assert glance in md, f"at a glance: expected {glance!r}"


def test_kv_blocks_pair_legacy_and_extensible_across_subfolders(full):
    _, md, summary, _ = full
    legacy_blocks = case_file(FULL, LEGACY)["memory"]["num_gpu_blocks"]
    pairs = {p["other"]: p for p in summary["integration"]["pairs"]}
    assert set(pairs) == {EXT, PLUGIN}
    for rel in (EXT, PLUGIN):
        blocks = case_file(FULL, rel)["memory"]["num_gpu_blocks"]
        p = pairs[rel]
        assert p["legacy"] == LEGACY and p["legacy_blocks"] == legacy_blocks and p["blocks"] == blocks
        assert p["delta_blocks"] == blocks - legacy_blocks
        assert p["delta_bytes"] == (blocks - legacy_blocks) * 16384
        row = md_row(md, "case file", rel, needs="legacy blocks")
        assert row["legacy blocks"] == f"{legacy_blocks:,}" and row["blocks"] == f"{blocks:,}", row
        assert row["difference (blocks)"] == f"{blocks - legacy_blocks:+,}", row
        assert row["difference (% of legacy)"] == f"{(blocks - legacy_blocks) / legacy_blocks * 100:+.3f} %", row


def test_backend_validation_comes_from_the_json(full):
    _, md, summary, _ = full
    data = read_json(FULL / "validate-backend-cuda.json")["results"]
    rows = summary["backend_validation"]
    assert [(r["backend"], r["kv_layout"], r["ok"]) for r in rows] == [
        (r["backend"], r["kv_layout"], r["ok"]) for r in data
    ]
    failed = next(r for r in data if not r["ok"])
    not_ok = [c["name"] for c in failed["checks"] if not c["ok"]]
    assert rows[1]["checks_not_ok"] == not_ok and rows[1]["segments"] == failed["segments"], rows[1]
    row = md_row(md, "backend", failed["backend"], needs="result")
    assert row["result"] == "FAIL" and row["checks not ok"] == ", ".join(not_ok), row
    assert row["shape"] == ", ".join(map(str, failed["shape"])), row
    passed = sum(r["ok"] for r in data)
    line = f"- validate-backend-cuda.json: {passed} of {len(data)} passed; failed: {failed['backend']}/NHD"
    assert line in md, f"expected the line {line!r} in the backend validation section"


def test_environment_names_its_sources(full):
    _, md, summary, _ = full
    env, declared = summary["environment"], read_json(FULL / "environment.json")
    machine = read_json(FULL / "bench-cuda.json")["machine_info"]
    # environment.json first, then the benchmark JSON's machine_info.environment, then the measurement files
    assert env["gpu"] == {"value": declared["gpu"], "source": "environment.json"}, env["gpu"]
    assert env["cuda"] == {"value": machine["environment"]["cuda"], "source": "bench-cuda.json"}, env["cuda"]
    assert env["cuda-bindings"]["value"] == declared["packages"]["cuda-bindings"], env["cuda-bindings"]
    assert env["date"] == {"value": read_json(FULL / "bench-cuda.json")["datetime"], "source": "bench-cuda.json"}
    assert env["granularity"]["source"] == "conformance-cuda.json", env["granularity"]
    assert md_row(md, "item", "GPU driver")["value"] == declared["gpu_driver"]


# -- missing inputs ------------------------------------------------------------------------------------------------
def test_missing_inputs_read_not_measured_and_no_default_numbers(partial):
    _, md, summary, html = partial
    assert summary["bench"] == [] and summary["backend_validation"] == []
    assert any(m.startswith("benchmarks:") for m in summary["not_measured"])
    assert any(m.startswith("backend validation:") for m in summary["not_measured"])
    assert "not measured" in section(md, "Commit benchmarks")
    assert "not measured" in section(md, "Backend validation")
    assert md_row(md, "input", "benchmarks")["files"] == "not measured"
    # the legacy case has no extensible partner: KV and everything derived from it is not measured
    (case,) = summary["integration"]["cases"]
    for key in ("kv_committed", "bytes_per_block", "non_kv_after_warmup", "other_non_kv", "commit_seconds"):
        assert case[key] is None, f"{key}: expected null (not measured), got {case[key]}"
    row = md_row(md, "case file", "call1/tiny-llama-v2-TRITON_ATTN-legacy.json", needs="KV committed")
    assert row["KV committed"] == "not measured" and row["other non-KV"] == "not measured", row
    row = md_row(md, "case file", "call1/tiny-llama-v2-TRITON_ATTN-legacy.json", needs="KV blocks")
    for column in ("bytes per block", "KV committed (GiB)", "final commit (ms)", "non-KV after warmup (MiB)"):
        assert row[column] == "not measured", (column, row)
    assert summary["integration"]["pairs"] == []
    # measured figures of the same file are still there
    lone = case_file(PARTIAL, "call1/tiny-llama-v2-TRITON_ATTN-legacy.json")
    assert case["blocks"] == lone["memory"]["num_gpu_blocks"]
    assert md_row(md, "file", "conformance-cuda.json")["commit probe (GB/s)"] == "not measured"
    # no figure of the full fixture leaks in as a default
    for number in ("671.09", "1.600", "16,384", "1,234.56"):
        assert number not in md, f"{number} appears in a report whose run has no such measurement"
    assert "not measured" in html


@pytest.mark.parametrize(
    "second_legacy,ext_tokens,outcome,deterministic,identical",
    [
        ("same", "same", "identical", "yes", "yes"),
        ("same", "changed", "differs", "yes", "no"),
        ("changed", "same", "baseline nondeterministic", "no", "not measured"),
    ],
)
def test_greedy_parity_names_a_nondeterministic_baseline_with_its_first_difference(
    tmp_path, second_legacy, ext_tokens, outcome, deterministic, identical
):
    run = tmp_path / "run"
    (run / "integration").mkdir(parents=True)
    legacy, ext = case_file(FULL, LEGACY), case_file(FULL, EXT)
    tokens = legacy["token_ids"]
    changed = [list(t) for t in tokens]
    changed[0][3] += 1
    second = dict(legacy, token_ids=changed if second_legacy == "changed" else tokens)
    ext = dict(ext, token_ids=changed if ext_tokens == "changed" else tokens)
    for name, data in (("c-legacy.json", legacy), ("c-legacy-r2.json", second), ("c-extensible.json", ext)):
        (run / "integration" / name).write_text(json.dumps(data))
    md, _, _ = render(run, tmp_path / "out")
    row = md_row(md, "case file", "c-extensible.json", needs="baseline deterministic?")
    got = (row["legacy runs"], row["baseline deterministic?"], row["tokens identical?"], row["outcome"])
    assert got == ("2", deterministic, identical, outcome), f"parity row: expected {outcome}, got {row}"
    if outcome != "identical":
        first = (
            f"prompt 0 first differs at token 3: {tokens[0][3:7]} vs {changed[0][3:7]}"
            if second_legacy == "changed"
            else f"{changed[0][3:7]} vs {tokens[0][3:7]}"
        )
        assert first in row["detail"], f"parity detail: expected the first difference {first!r}, got {row['detail']!r}"


def test_a_refused_combination_is_listed_with_vllms_reason_and_left_out_of_the_accounting(partial):
    _, md, summary, _ = partial
    rel = "call1/tiny-llama-v2-FLEX_ATTENTION-legacy.json"
    reason = case_file(PARTIAL, rel)["refused"]
    listed = section(md, "vLLM integration: memory accounting").split("### Refused combinations", 1)[-1]
    assert f"- {rel}: {reason}\n" in listed.split("###")[0], (
        f"refused case: expected {rel!r} with {reason!r} under Refused combinations, got {listed[:400]!r}"
    )
    assert all(c["path"] != rel for c in summary["integration"]["cases"]), "a refused case has no memory figures"


def test_an_empty_run_folder_is_refused_and_reads_everything_as_not_measured(tmp_path, capsys):
    run = tmp_path / "empty-run"
    run.mkdir()
    assert report_main([str(run), "--out", str(tmp_path / "out")]) == 2
    assert f"no measurement files in {run}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    doc = document.run_document(load_run(run))
    md, summary = doc.markdown, doc.summary
    assert len(summary["not_measured"]) == 5, summary["not_measured"]
    for title in ("Conformance", "Commit benchmarks", "vLLM integration: memory accounting", "Backend validation"):
        assert "not measured" in section(md, title), title
    assert summary["run"] == "empty-run" and not [f for f in doc.figures.drawn.values() if f.png is not None]
    assert not re.search(r"\d\.\d", section(md, "At a glance")), "numbers in a report of an empty run"


def test_a_missing_run_folder_is_an_error_with_exit_2(tmp_path, capsys):
    code = report_main([str(tmp_path / "no-such-run"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "no-such-run" in err and "does not exist" in err, (code, err)
    assert not (tmp_path / "out").exists()


# -- HTML and PNG --------------------------------------------------------------------------------------------------
def test_html_is_self_contained(full):
    out, _, summary, html = full
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html, re.IGNORECASE), "external reference"
    assert "<link" not in html.lower() and "<script" not in html.lower() and "@import" not in html
    assert "url(" not in html
    images = re.findall(r'<img [^>]*src="([^"]+)"', html)
    assert all(src.startswith("data:image/png;base64,") for src in images), images[:3]
    assert len(images) == len(summary["figures"]), "expected one embedded image per PNG written"
    embedded = {base64.b64decode(src.split(",", 1)[1]) for src in images}  # the same PNGs as beside report.md
    assert embedded == {(out / name).read_bytes() for name in summary["figures"]}


def test_png_files_exist_are_referenced_and_non_trivial(full):
    pytest.importorskip("matplotlib", reason="the figures need the 'report' extra (matplotlib)")
    out, md, summary, _ = full
    expected = {"memory-tiny-llama-v1-flash-attn.png", "kv-blocks.png"}
    assert set(summary["figures"]) == expected
    for name in expected:
        data = (out / name).read_bytes()
        width, height = png_size(data)
        assert len(data) > 10_000 and width >= 400 and height >= 200, (name, len(data), width, height)
        assert f"]({name})" in md, f"report.md does not show {name}"


def test_figures_not_drawn_say_why():
    doc = document.run_document(load_run(FULL), rendering.Figures(None, "matplotlib is not importable (test)"))
    assert "not drawn: matplotlib is not importable (test)" in doc.markdown
    assert "![" not in doc.markdown and "<img" not in doc.html


def test_rerendering_removes_stale_pngs(tmp_path):
    pytest.importorskip("matplotlib", reason="the figures need the 'report' extra (matplotlib)")
    out = tmp_path / "out"
    render(FULL, out)
    assert (out / "kv-blocks.png").exists()
    (out / "notes.png").write_bytes(b"not ours")
    render(PARTIAL, out)
    assert not (out / "kv-blocks.png").exists(), "a PNG of the earlier report was left behind"
    assert (out / "notes.png").exists(), "a PNG the report did not write was removed"


@pytest.mark.parametrize(
    "earlier",
    ['{"figures": ["precious.png", "notes.png"]}', '{"figures": 5}', "[" * 100_000 + "]" * 100_000, '"text"'],
    ids=["lists-a-user-png", "not-a-list", "deep", "not-an-object"],
)
def test_a_summary_json_not_of_an_earlier_report_removes_nothing_and_fails_nothing(tmp_path, earlier):
    # wrong: every PNG an earlier summary.json lists removed (a hand-written one deleted the user's precious.png),
    # or a summary.json nested deeply or with figures that are no list ending the report (RecursionError, TypeError)
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text(earlier)
    (out / "precious.png").write_bytes(b"\x89PNG user's")
    render(PARTIAL, out)
    assert (out / "precious.png").read_bytes() == b"\x89PNG user's", "a PNG the report did not draw was removed"
    assert (out / "report.md").exists(), "the report was not written"


# -- plumbing ------------------------------------------------------------------------------------------------------
def test_report_takes_the_benchmark_figures_of_the_bench_summary():
    bench = load_run(FULL).bench[0]
    assert bench.summary == benchmarks.summarize(FULL / "bench-cuda.json")
    ext = bench_entry("commit/extensible")
    assert benchmarks.seconds_of(benchmarks.entries(bench.data), "commit/extensible") == ext["stats"]["median"]
    assert bench.summary["targets"], "the report lost the targets"


def test_legacy_kv_prefers_the_partner_in_the_same_subfolder():
    cases = load_run(FULL).cases
    plugin = next(c for c in cases if c.path == PLUGIN)
    pool = cases + [dataclasses.replace(plugin, path="call1/plugin-copy.json")]
    legacy = next(b for b in accounting.account(pool) if b.case.path == LEGACY)
    assert legacy.kv_partner.path == EXT  # same folder, and mode extensible before the entry-point run
    without_ext = [c for c in cases if c.path != EXT]
    legacy = next(b for b in accounting.account(without_ext) if b.case.path == LEGACY)
    assert legacy.kv_partner.path == PLUGIN  # another subfolder when the same one has none
    assert legacy.kv_committed == legacy.blocks * plugin.data.extensible.measured.bytes_per_block


def test_the_report_package_never_imports_pytest():
    root = Path(report.__file__).parent
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not any(n == "pytest" or n.startswith("pytest.") for n in names), f"{path.name} imports pytest"


def test_name_option_and_default_output_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert report_main([str(PARTIAL), "--name", "renamed"]) == 0
    md = (tmp_path / "reports" / "rendered" / "renamed" / "report.md").read_text()
    assert md.startswith("# Memory-accounting report: renamed\n")


def _files(root: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_the_report_writes_only_into_its_output_folder_which_git_ignores(tmp_path, monkeypatch):
    """A checkout stays clean after rendering: nothing is written beside the measurement files or anywhere else, and
    the default output folder is one the repository ignores."""
    run = tmp_path / "reports" / "runs" / "some-run"
    shutil.copytree(FULL, run)
    monkeypatch.chdir(tmp_path)
    before = _files(tmp_path)
    assert report_main([str(run.relative_to(tmp_path))]) == 0, "report of a copy of the full fixture"
    after = _files(tmp_path)
    out = Path("reports/rendered/some-run")
    written = sorted(p.relative_to(tmp_path).as_posix() for p in after if before.get(p) != after[p])
    outside = [p for p in written if not p.startswith(out.as_posix() + "/")]
    assert written and not outside, f"report {run.name}: expected files only under {out}/, got {outside or written}"
    assert (tmp_path / out / "report.html").is_file(), f"report {run.name}: no report.html in {out}/: {written}"
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *written], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert ignored.stdout.split() == written, (
        f"git check-ignore {written}: expected every rendered file ignored, "
        f"got {ignored.stdout.split()} (exit {ignored.returncode})"
    )


# -- the writers: their files read back through the schema and render ----------------------------------------------
def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}  # a child pytest, not a worker
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "reference"), str(ROOT)])
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    assert proc.returncode == 0, (
        f"{' '.join(args)}: expected exit 0, got {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    )
    return proc


def test_the_writers_files_load_through_the_schema_and_render(tmp_path):
    """A folder as CI or a GPU job leaves it (reports/out/): each writer's file, read back and rendered."""
    import torch

    out = tmp_path / "out"
    _run(
        "-m",
        "pytest",
        "conformance/test_driver_contract.py",
        "-k",
        "granularity_is_a_positive",
        "--driver",
        "host-4k",
        f"--summary-json={out}/conformance-host-4k.json",
        "-p",
        "no:cacheprovider",
        "-q",
    )
    summary = read(out / "conformance-host-4k.json", ConformanceSummary)
    assert summary.torch == torch.__version__ and summary.drivers[0].driver == "host-4k", summary
    assert summary.drivers[0].passed == len(summary.tests) >= 1, summary
    _run(
        "-m",
        "pytest",
        "bench/test_commit.py::test_commit_scaling[1GiB-1seg]",
        "--bench-driver",
        "host-4k",
        "--benchmark-enable",
        f"--benchmark-json={out}/bench-host-4k.json",
        "-p",
        "no:cacheprovider",
        "-q",
    )
    bench = read(out / "bench-host-4k.json", BenchmarkFile)
    machine = bench.machine_info.environment
    assert machine is not None and machine.torch == torch.__version__ and machine.python, bench.machine_info
    _run(
        "-m",
        "extensible_kv",
        "validate-backend",
        "tests.unit._factories:KVFirstBackend",
        "--driver",
        "host-4k",
        "--layout",
        "both",
        "--json",
        str(out / "validate-backend-host-4k.json"),
    )
    results = read(out / "validate-backend-host-4k.json", BackendValidation).results
    assert [(r.kv_layout, r.ok, r.driver) for r in results] == [("NHD", True, "host-4k"), ("HND", True, "host-4k")]
    (out / "environment.json").unlink()
    _run("-m", "extensible_kv", "environment", str(out))
    env = read(out / "environment.json", Environment)
    assert (env.torch, env.cuda) == (torch.__version__, torch.version.cuda), env
    md, rendered, _ = render(out, tmp_path / "latest", "--name", "latest")
    assert rendered["environment"]["torch"] == {"value": torch.__version__, "source": "environment.json"}
    assert md_row(md, "file", "conformance-host-4k.json")["passed"] == str(summary.drivers[0].passed)
    assert [r["kv_layout"] for r in rendered["backend_validation"]] == ["NHD", "HND"]
    assert rendered["bench"][0]["summary"]["scaling"]["rows"][0]["handles"] == 1


def test_the_runs_index_names_every_committed_run_and_every_run_it_names_is_there():
    index = json.loads((ROOT / "reports" / "runs" / "current.json").read_text())
    folders = {p.name for p in (ROOT / "reports" / "runs").iterdir() if p.is_dir()}
    current = {f["run"] for f in index["families"]}
    removed = {r["run"] for r in index["removed"]}
    got = (sorted(folders - current), sorted(current - folders), sorted(removed & folders))
    assert got == ([], [], []), f"(runs current for no family, current runs missing, removed runs still here): {got}"
    logs = sorted(
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "reports" / "runs").rglob("*")
        if p.is_file() and p.suffix not in (".json", ".jsonl", ".md")
    )
    assert not logs, f"expected only READMEs, tables and measurement files in reports/runs, got {logs}"


def test_committed_runs_load_and_render(tmp_path):
    for folder in sorted(p for p in (ROOT / "reports" / "runs").iterdir() if p.is_dir()):
        run = load_run(folder)
        assert run.measured and run.environment["gpu"][0], f"{folder.name}: expected measurements and a GPU name"
        doc = document.run_document(run, rendering.Figures(None, "not drawn in this test"))
        assert "| case file |" in doc.markdown or not run.cases, folder.name
        tables = len(md_tables(doc.markdown))  # each a table in the HTML too, none left a paragraph of pipes
        assert doc.html.count("<table") == tables and "<p>|" not in doc.html, (
            f"{folder.name}: {tables} Markdown tables, {doc.html.count('<table')} HTML tables"
        )


# -- the rendering -------------------------------------------------------------------------------------------------
def _with_outcome(tmp_path: Path, test: str, reason: str) -> Path:
    run = tmp_path / "run"
    shutil.copytree(PARTIAL, run)
    data = read_json(run / "conformance-cuda.json")
    data["tests"].append({"driver": "cuda", "test": test, "outcome": "skipped", "reason": reason})
    (run / "conformance-cuda.json").write_text(json.dumps(data))
    return run


def test_text_from_the_files_stays_text_in_the_html_and_one_cell_in_markdown(tmp_path):
    run = _with_outcome(tmp_path, "conformance/test_x.py::test_<script>alert(1)</script>[cuda]", "a | b")
    md, _, html = render(run, tmp_path / "out")
    assert "<script>" not in html.lower() and "&lt;script&gt;alert(1)&lt;/script&gt;" in html, (
        "expected the test name escaped in report.html"
    )
    row = md_row(md, "outcome", "skipped", needs="reason")
    assert row["reason"] == "a | b", f"expected the reason as one cell 'a | b', got {row}"
    assert "<td>a | b</td>" in html, "expected the reason as one table cell in report.html"


def test_html_has_a_table_of_contents_linking_every_section(full):
    _, md, _, html = full
    titles = re.findall(r"^## (.+)$", md, re.MULTILINE)
    links = re.findall(r'<li><a href="#([^"]+)">([^<]+)</a></li>', html)
    assert [t for _, t in links] == titles, f"expected the sections {titles} in the contents, got {links}"
    assert all(f'id="{anchor}"' in html for anchor, _ in links), "a contents link without its heading"


def test_one_number_format():
    cases = [
        (None, "MiB", False, "not measured"),
        (True, "count", False, "yes"),
        (1234567, "count", False, "1,234,567"),
        (-202, "count", True, "-202"),
        (3 << 20, "MiB", True, "+3.00"),
        (1 << 30, "GiB", False, "1.000"),
        (0.0016, "ms", False, "1.600"),
        (5e-4, "us", False, "500.0"),
        (671.0886, "GB/s", False, "671.09"),
        (0.71428, "ratio", False, "0.7143"),
        (-0.0043, "%", True, "-0.004 %"),
        ("x", "text", False, "x"),
    ]
    for value, unit, signed, want in cases:
        got = numbers.number(value, unit, signed)
        assert got == want, f"number({value!r}, {unit!r}, signed={signed}): expected {want!r}, got {got!r}"


def test_segments_are_summarised_not_listed():
    run = load_run(ROOT / "reports" / "runs" / "h200-2026-12-02-llama8b")
    case = next(c for c in run.cases if c.data.extensible and len(c.data.extensible.segments) > 8)
    n = len(case.data.extensible.segments)
    assert document.segments_text(case.data.extensible) == f"{n} buffers x 1 segment"
    mixed = case.data.extensible.model_copy(update={"segments": [1, 1, 2]})
    assert document.segments_text(mixed) == "2 buffers x 1 segment, 1 buffer x 2 segments"
    md = document.run_document(run, rendering.Figures(None, "not drawn in this test")).markdown
    row = md_row(md, "case file", case.path, needs="segments")
    assert row["segments"] == f"{n} buffers x 1 segment", f"expected the segments summarised, got {row}"


def _overlaps(boxes: list) -> list:
    return [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1 :] if a.overlaps(b)]


def test_kv_blocks_plot_is_readable(tmp_path):
    pytest.importorskip("matplotlib", reason="the figures need the 'report' extra (matplotlib)")
    from extensible_kv_lab.report import figures

    run = load_run(ROOT / "reports" / "runs" / "h200-matrix-current-2026-12-03")
    pairs = accounting.block_pairs(accounting.account(run.cases))
    fig = figures.kv_blocks_figure(pairs)
    renderer = fig.canvas.get_renderer()
    fig.canvas.draw()
    blocks, difference = fig.axes[:2]  # counts from 55k to 16M blocks: only a log axis shows them all
    assert (blocks.get_xscale(), difference.get_xscale()) == ("log", "linear"), (
        f"kv_blocks_figure: expected a log axis of blocks and a linear one of MiB, got {blocks.get_xscale()} and "
        f"{difference.get_xscale()}"
    )
    least = min(b.blocks for p in pairs for b in (p.legacy, p.other) if b.blocks)
    assert blocks.get_xlim()[0] < least, (
        f"kv_blocks_figure: the axis starts at {blocks.get_xlim()[0]}, above the shortest bar ({least} blocks)"
    )
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            labels = [t.get_window_extent(renderer) for t in axis.get_ticklabels() if t.get_visible() and t.get_text()]
            assert not _overlaps(labels), f"{ax.get_title()!r}: overlapping tick labels"
    texts = [t.get_window_extent(renderer) for ax in fig.axes for t in ax.texts if t.get_text().strip()]
    assert len(texts) >= 3 * len(pairs), f"expected two counts and one difference per pair, got {len(texts)} texts"
    for legend in fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]:
        box = legend.get_window_extent(renderer)
        assert not [t for t in texts if box.overlaps(t)], "the legend covers a value label"


# -- the package's shape -------------------------------------------------------------------------------------------
LAB_MODULES = ("report", "measurements", "parity")  # the lab's modules (lab/extensible_kv_lab)


def _imports(path: Path, package: str) -> set[str]:
    """Modules of ``package`` that ``path`` imports, anywhere in it (lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package + "."):
            found.add(node.module.removeprefix(package + ".").split(".")[0])
    return found


def test_the_report_modules_import_no_circle():
    root = Path(report.__file__).parent
    graph = {p.stem: _imports(p, "extensible_kv_lab.report") for p in root.glob("*.py") if p.stem != "__init__"}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                assert nxt != start, f"report.{start} imports itself through report.{nxt}: expected no import circle"
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)


def test_the_runtime_and_the_suite_import_nothing_of_the_lab_but_the_commands_that_need_it():
    """The runtime wheel ships neither the lab nor a module of its own that imports it: only the command line's
    ``report`` and ``bench-summary`` load it, where they are registered."""
    files = sorted((ROOT / "reference" / "extensible_kv").rglob("*.py")) + sorted((ROOT / "conformance").rglob("*.py"))
    found = {}
    for path in files:
        tree = ast.parse(path.read_text())
        names = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        bad = [n for n in names if n.split(".")[0] == "extensible_kv_lab" or n.split(".")[-1] in LAB_MODULES]
        if bad:
            found[path.relative_to(ROOT).as_posix()] = bad
    assert found == {"reference/extensible_kv/__main__.py": ["extensible_kv_lab.report"]}, found
    left = sorted(p.name for p in (ROOT / "reference" / "extensible_kv").iterdir() if p.stem in LAB_MODULES)
    assert not left, f"reference/extensible_kv holds {left}: expected the lab's modules in lab/ only"


@pytest.mark.parametrize("command", ["report", "bench-summary"])
def test_without_the_lab_report_and_bench_summary_say_how_to_install_it_in_one_line(monkeypatch, capsys, command):
    from extensible_kv.__main__ import main

    for name in [n for n in sys.modules if n.split(".")[0] == "extensible_kv_lab"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "extensible_kv_lab", None)  # import extensible_kv_lab: ModuleNotFoundError
    code = main([command, "reports/runs"])
    err = capsys.readouterr().err
    got = (code, len(err.splitlines()), "needs the lab (extensible-kv-lab)" in err, "pip install -e" in err)
    assert got == (2, 1, True, True), f"{command} without the lab: expected (exit 2, one line, the lab, how), got {err}"


def test_the_templates_ship_as_package_data():
    config = tomllib.loads((ROOT / "lab" / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = config.get("extensible_kv_lab.report", [])
    templates = Path(report.__file__).parent / "templates"
    names = sorted(p.relative_to(templates.parent).as_posix() for p in templates.iterdir())
    assert names and all(any(fnmatch.fnmatch(n, g) for g in globs) for n in names), (
        f"expected package-data {globs} to cover {names}"
    )


def test_the_encoder_cache_and_the_speculative_step_are_their_own_lines_measured_against_profiled(tmp_path):
    run = tmp_path / "run"
    (run / "integration").mkdir(parents=True)
    legacy, ext = case_file(FULL, LEGACY), case_file(FULL, EXT)
    mib = 1 << 20
    mm = dict(
        ext,
        memory=dict(
            ext["memory"],
            encoder_cache={
                "profiled_bytes": 8 * 1179648,
                "held_bytes": 28 * 1179648,
                "items_held": 28,
                "bytes_per_item": 1179648,
                "capacity_items": 28,
                "items_at_peak": 28,
            },
        ),
    )
    peak = dict(
        ext["memory"]["peak"],
        over_budget_measured=-3 * mib,
        over_budget_prefill=-20 * mib,
        over_budget_phase="speculative",
    )
    spec = dict(
        ext,
        memory=dict(
            ext["memory"],
            peak=peak,
            speculative={
                "k": 4,
                "method": "ngram",
                "requests": 64,
                "rows": 320,
                "vocab": 151936,
                "step_peak_allocated": 700 * mib + 5,
                "step_reserved_growth": 42 * mib,
                "over_budget_measured": -3 * mib,
                "widest_steps": 2,
            },
        ),
    )
    for name, data in (("c-legacy.json", legacy), ("mm-extensible.json", mm), ("spec-extensible.json", spec)):
        (run / "integration" / name).write_text(json.dumps(data))
    md, summary, _ = render(run, tmp_path / "out")
    part = section(md, "vLLM integration: memory accounting").split("### Memory the profile does not see", 1)[-1]
    tables = md_tables(part.split("### ")[0])
    encoder, speculative = tables[0], tables[1]
    e = mm["memory"]["encoder_cache"]
    expected = {
        "case file": "mm-extensible.json",
        "encoder cache, profiled": f"{e['profiled_bytes'] / mib:,.2f}",
        "encoder cache, measured": f"{e['held_bytes'] / mib:,.2f}",
        "items measured / cache capacity": f"{e['items_held']} / {e['capacity_items']}",
    }
    assert encoder == [expected], f"encoder cache line: expected {[expected]}, got {encoder}"
    s = spec["memory"]["speculative"]
    expected = {
        "case file": "spec-extensible.json",
        "logits rows": f"{s['rows']}",
        "speculative step, measured": f"{s['step_peak_allocated'] / mib:,.2f}",
        "activation peak, profiled": f"{spec['memory']['profiled_peak_activation'] / mib:,.2f}",
        "reserved growth in the step": f"{s['step_reserved_growth'] / mib:,.2f}",
        "over budget in the step": f"{s['over_budget_measured'] / mib:+,.2f}",
        "over budget at peak set by": "speculative",
    }
    assert speculative == [expected], f"speculative line: expected {[expected]}, got {speculative}"
    cases = {c["path"]: c for c in summary["integration"]["cases"]}
    got = (
        cases["mm-extensible.json"]["encoder_cache_held"],
        cases["spec-extensible.json"]["speculative_step"],
        cases["spec-extensible.json"]["over_budget_at_peak"],
        cases["c-legacy.json"]["speculative_rows"],
    )
    assert got == (e["held_bytes"], s["step_peak_allocated"], -3 * mib, None), (
        f"summary.json (encoder cache held, speculative step, over budget at peak, legacy rows): got {got}"
    )


def test_a_cases_key_names_the_settings_it_changes_so_repeats_are_told_from_variants():
    from extensible_kv_lab.measurements import IntegrationCase
    from extensible_kv_lab.report.run import Case

    def key(**settings):
        spec = {"model": "m", "runner": "v1", "backend": "FLASH_ATTN", "mode": "legacy", **settings}
        return Case("c.json", IntegrationCase.model_validate({"case": spec})).key

    got = [
        key(),
        key(kv_cache_dtype="auto", block_size=16, speculative=None),
        key(kv_cache_dtype="fp8"),
        key(speculative="ngram:4", block_size=32),
        key(mode="extensible", corrupt=True),
    ]
    expected = [
        "m/v1/FLASH_ATTN/legacy",
        "m/v1/FLASH_ATTN/legacy",
        "m/v1/FLASH_ATTN/kv_cache_dtype=fp8/legacy",
        "m/v1/FLASH_ATTN/block_size=32/speculative=ngram:4/legacy",
        "m/v1/FLASH_ATTN/extensible+corrupt",
    ]
    assert got == expected, f"Case.key: expected {expected}, got {got}"


def test_runs_of_one_case_pair_across_file_versions_and_never_across_kv_dtypes():
    # A legacy file written before the case recorded ``multimodal`` is the same case as an extensible file that says
    # False; an fp8 run is another case: no token comparison with it, no bytes per block from it.
    from extensible_kv_lab.measurements import IntegrationCase
    from extensible_kv_lab.report.run import Case
    from extensible_kv_lab.report.verdict import parity_rows

    def case(path, mode, bytes_per_block=None, **settings):
        spec = {"model": "m", "runner": "v1", "backend": "FLASH_ATTN", "mode": mode, **settings}
        data = {"case": spec, "token_ids": [[1, 2]], "memory": {"num_gpu_blocks": 100}}
        if bytes_per_block:
            data["extensible"] = {"measured": {"bytes_per_block": bytes_per_block}, "kv": {"committed_bytes": 0}}
        return Case(path, IntegrationCase.model_validate(data))

    legacy = [case("a-legacy.json", "legacy"), case("a-legacy-r2.json", "legacy")]
    cases = [
        *legacy,
        case("a-extensible.json", "extensible", 4096, multimodal=False),
        case("b-extensible.json", "extensible", 2048, kv_cache_dtype="fp8", multimodal=False),
    ]
    rows = {r.case.path: [c.path for c in r.legacy] for r in parity_rows(cases)}
    expected = {"a-extensible.json": ["a-legacy.json", "a-legacy-r2.json"], "b-extensible.json": []}
    assert rows == expected, f"parity_rows legacy runs per case: expected {expected}, got {rows}"
    partners = {
        b.case.path: (b.kv_partner or b.legacy_partner).path
        for b in accounting.account(cases)
        if b.kv_partner or b.legacy_partner
    }
    expected = {
        "a-legacy.json": "a-extensible.json",
        "a-legacy-r2.json": "a-extensible.json",
        "a-extensible.json": "a-legacy.json",
    }  # the first run (-r2 is the second)
    assert partners == expected, f"account partners: expected {expected}, got {partners}"


def serving_file(legacy_rate, ext_rate, windows, legacy_compiled, ext_compiled, legacy_start=51.0, ext_start=21.9):
    """A ``serving-*.json`` as ``integration.parity.throughput_benchmark`` writes it."""

    def bench(mode, rate, start, compiled):
        return {
            "name": f"decode_throughput[{mode}]",
            "param": mode,
            "group": "serve/decode",
            "stats": {"median": 1 / rate},
            "extra_info": {
                "tokens_per_s": rate,
                "num_seqs": 256,
                "num_gpu_blocks": 16384,
                "engine_seconds": start,
                "compiled": compiled,
                "model": "llama-8b-shape",
                "runner": "v1",
            },
        }

    comparable = None if legacy_compiled is None or ext_compiled is None else legacy_compiled == ext_compiled
    return {
        "benchmarks": [
            bench("legacy", legacy_rate, legacy_start, legacy_compiled),
            bench("extensible", ext_rate, ext_start, ext_compiled),
        ],
        "ratio": {
            "decode_tokens_per_s": sorted(windows)[len(windows) // 2],
            "decode_window_ratios": windows,
            "decode_range": [min(windows), max(windows)],
            "target_decode": 0.99,
            "engine_seconds": ext_start / legacy_start,
            "engine_seconds_comparable": comparable,
            "same_block_count": True,
        },
    }


def test_serving_speed_shows_the_paired_decode_ratio_and_a_start_ratio_only_from_the_same_compile_cache(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    files = {
        "serving-a.json": serving_file(21444.2, 21161.3, [0.949, 0.98, 0.987, 0.992, 1.003], True, False),
        "serving-b.json": serving_file(
            20263.4, 21527.0, [0.995, 1.145, 1.032, 1.006, 0.996], False, False, 16.9, 16.71
        ),
        "serving-c.json": serving_file(8000.0, 8000.0, [1.0], None, False, 40.0, 20.0),
    }
    for name, data in files.items():
        (run / name).write_text(json.dumps(data))
    md, summary, _ = render(run, tmp_path / "out")
    rows = md_tables(section(md, "Serving speed"))[0]
    got = [
        (
            r["file"],
            r["decode tokens/s, legacy"],
            r["extensible / legacy"],
            r["window ratios"],
            r["met?"],
            r["engine start s, legacy / extensible"],
            r["start ratio"],
            r["start"],
        )
        for r in rows
    ]
    expected = [
        (
            "serving-a.json",
            "21,444",
            "0.987",
            "0.949 to 1.003 (5 windows)",
            "NO",
            "51.00 / 21.90",
            "-",
            "not comparable: legacy compiled, extensible loaded the compile cache",
        ),
        (
            "serving-b.json",
            "20,263",
            "1.006",
            "0.995 to 1.145 (5 windows)",
            "yes",
            "16.90 / 16.71",
            f"{16.71 / 16.9:.4g}",
            "both loaded the compile cache",
        ),
        (
            "serving-c.json",
            "8,000",
            "1",
            "1 to 1 (1 window)",
            "yes",
            "40.00 / 20.00",
            "-",
            "compile cache not recorded",
        ),
    ]
    assert got == expected, f"serving speed rows: expected {expected}, got {got}"
    glance = [line for line in section(md, "At a glance").splitlines() if line.startswith("- Serving speed")]
    assert glance[0] == (
        "- Serving speed (serving-a.json): decode extensible / legacy 0.987 (target >= 0.99: NOT "
        "met); engine start ratio not shown (not comparable: legacy compiled, extensible loaded the "
        "compile cache)."
    ), glance
    s = {e["source"]: e for e in summary["serving"]}
    assert (
        s["serving-a.json"]["decode_target_met"],
        s["serving-b.json"]["decode_target_met"],
        s["serving-b.json"]["extensible"]["tokens_per_s"],
        s["serving-a.json"]["engine_seconds_comparable"],
    ) == (False, True, 21527.0, False), f"summary.json serving: got {summary['serving']}"


def test_a_run_without_serving_files_reads_serving_speed_not_measured(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "serving-bad.json").write_text(json.dumps({"benchmarks": [], "ratio": {"target_decode": 0.99}}))
    assert report_main([str(run), "--out", str(tmp_path / "out")]) == 2, "a serving file without its ratio is refused"
    (run / "serving-bad.json").unlink()
    (run / "conformance-host.json").write_text(json.dumps({"exitstatus": 0, "drivers": [], "tests": []}))
    md, summary, _ = render(run, tmp_path / "out")
    assert section(md, "Serving speed").strip() == "not measured: no `serving-*.json` in the run folder.", md
    assert "- Serving speed: not measured." in section(md, "At a glance") and summary["serving"] == []


@pytest.mark.parametrize(
    "where,value,field",
    [
        ("legacy rate", -1, "extra_info.tokens_per_s"),
        ("legacy rate", 0, "extra_info.tokens_per_s"),
        ("ratio", -0.5, "ratio.decode_tokens_per_s"),
        ("range", [1.0], "ratio.decode_range"),
        ("windows", [1.0, 0], "ratio.decode_window_ratios[1]"),
        ("mode", "fast", "param"),
        ("start compared", None, "engine_seconds_comparable"),
    ],
)
def test_a_serving_file_with_an_impossible_figure_is_refused_naming_the_field(tmp_path, capsys, where, value, field):
    data = serving_file(21444.2, 21161.3, [0.949, 1.003], True, True)
    target = {
        "legacy rate": (data["benchmarks"][0]["extra_info"], "tokens_per_s"),
        "ratio": (data["ratio"], "decode_tokens_per_s"),
        "range": (data["ratio"], "decode_range"),
        "windows": (data["ratio"], "decode_window_ratios"),
        "mode": (data["benchmarks"][0], "param"),
        "start compared": (data["benchmarks"][0]["extra_info"], "compiled"),
    }[where]  # compared, yet unknown
    target[0][target[1]] = value
    run = tmp_path / "run"
    run.mkdir()
    (run / "serving-x.json").write_text(json.dumps(data))
    assert report_main([str(run), "--out", str(tmp_path / "out")]) == 2, f"serving file with {where} = {value!r}"
    err = capsys.readouterr().err
    assert "serving-x.json" in err and field in err, f"refusal of {where} = {value!r} names the file and {field}: {err}"
    assert not (tmp_path / "out").exists(), "nothing written for a refused run folder"


# -- untrusted files: every string from a file is text, and the page loads nothing from outside ---------------------
HOSTILE = [
    "![x](https://example.invalid/beacon.png)",
    "<img src=https://example.invalid/pixel.png>",
    "<script>alert(1)</script>",
    "$\\undefined{x}$ _a_ *b* [c](d) | e &amp; `f` ~g~",
]
URL_ATTRIBUTES = {"src", "href", "srcset", "poster", "data", "action", "formaction", "background", "xlink:href"}


class Page(HTMLParser):
    """The tags, the attributes that name a URL, and the text of an HTML page."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.tags, self.urls, self.text = [], [], []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.urls += [(tag, k, v or "") for k, v in attrs if k in URL_ATTRIBUTES or "url(" in (v or "")]

    def handle_data(self, data):
        self.text.append(data)


def hostile_run(tmp_path: Path, name: str) -> Path:
    """The full fixture with ``name`` in strings the report shows from its files: the GPU, a test and its skip reason,
    a backend, the model of every vLLM case and of a serving pair."""
    run = tmp_path / "hostile"
    shutil.copytree(FULL, run)

    def edit(rel: str, change) -> None:
        data = read_json(run / rel)
        change(data)
        (run / rel).write_text(json.dumps(data))

    edit("environment.json", lambda d: d.update(gpu=name))
    edit(
        "conformance-cuda.json",
        lambda d: d["tests"].append(
            {"driver": "cuda", "test": f"conformance/test_x.py::test_y[{name}]", "outcome": "skipped", "reason": name}
        ),
    )
    edit("validate-backend-cuda.json", lambda d: d["results"][0].update(backend=name))
    for case in (run / "integration").rglob("*.json"):
        edit(case.relative_to(run).as_posix(), lambda d: d["case"].update(model=name))
    serving = serving_file(20000.0, 20000.0, [1.0], False, False)
    for b in serving["benchmarks"]:
        b["extra_info"]["model"] = name
    (run / "serving-x.json").write_text(json.dumps(serving))
    return run


@pytest.mark.parametrize("name", HOSTILE)
def test_strings_from_the_files_are_text_in_the_markdown_and_the_html(tmp_path, name):
    md, _, page = render(hostile_run(tmp_path, name), tmp_path / "out")
    shown = MarkdownIt("commonmark", {"html": True}).enable("table").render(md)  # as a renderer that passes HTML
    for what, text in (("report.md, rendered with raw HTML allowed", shown), ("report.html", page)):
        p = Page(text)
        images = [v for tag, _, v in p.urls if tag == "img"]
        ours = [v for v in images if v.startswith("data:image/png;base64,") or re.fullmatch(r"[a-z0-9-]+\.png", v)]
        assert images == ours and "script" not in p.tags, (
            f"{what} of a run whose files say {name!r}: expected only the report's own images and no script, got "
            f"images {[v[:60] for v in images if v not in ours]} and tags {sorted(set(p.tags))}"
        )
        assert name in "".join(p.text), f"{what}: expected {name!r} shown as text, not found"


def test_the_html_loads_nothing_from_outside_the_page(tmp_path, full):
    hostile = hostile_run(tmp_path, HOSTILE[0])
    pages = {"full": full[3], "hostile": render(hostile, tmp_path / "out")[2]}
    for what, page in pages.items():
        p = Page(page)
        outside = [
            (tag, k, v[:80])
            for tag, k, v in p.urls
            if not (k == "href" and v.startswith("#")) and not (k == "src" and v.startswith("data:image/png;"))
        ]
        loaders = sorted({"script", "link", "iframe", "object", "embed", "base", "form"} & set(p.tags))
        assert not outside and not loaders, (
            f"report.html of {what}: expected only in-page links and embedded PNGs, got {outside} and tags {loaders}"
        )


def test_a_count_beyond_what_hardware_holds_is_refused_naming_the_file_and_field(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(FULL, run)
    data = case_file(run, EXT)
    data["memory"]["total"] = 10**400
    (run / "integration" / EXT).write_text(json.dumps(data))
    code = report_main([str(run), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and f"{EXT}: memory.total should be less than 2**63" in err, (
        f"report of a case with memory.total = 10**400: expected exit 2 and an error naming the file and field, got "
        f"{code}: {err!r}"
    )
    assert not (tmp_path / "out").exists(), "nothing written for a refused run folder"


# -- the verdict ---------------------------------------------------------------------------------------------------
N_CONFORMANCE_TESTS = len(read_json(FULL / "conformance-cuda.json")["tests"])


def verdict_run(
    tmp_path: Path,
    *,
    tokens_differ=False,
    over_budget=16 * MIB,
    decode=0.99,
    failed_rule=False,
    serving=True,
    legacy_runs=2,
) -> Path:
    """A run that passes every check at its threshold: every rule passed, two legacy runs that agree and an extensible
    run with their tokens, 16 MiB beyond the budget at the measured peak, decode extensible / legacy 0.99. The
    arguments break one check each."""
    run = tmp_path / "run"
    (run / "integration").mkdir(parents=True)
    conformance = read_json(FULL / "conformance-cuda.json")
    for i, t in enumerate(conformance["tests"]):
        t["outcome"] = "failed" if failed_rule and i == 0 else "passed"
    conformance["drivers"][0].update(passed=len(conformance["tests"]) - failed_rule, failed=int(failed_rule), skipped=0)
    conformance["exitstatus"] = int(failed_rule)
    (run / "conformance-cuda.json").write_text(json.dumps(conformance))
    legacy, ext = case_file(FULL, LEGACY), case_file(FULL, EXT)
    tokens = [list(t) for t in legacy["token_ids"]]
    ext["token_ids"] = [[t + 1 for t in tokens[0]], *tokens[1:]] if tokens_differ else tokens
    ext["memory"]["peak"]["over_budget_measured"] = over_budget
    for name, data in (("c-legacy.json", legacy), ("c-legacy-r2.json", legacy), ("c-extensible.json", ext))[
        2 - legacy_runs :
    ]:
        (run / "integration" / name).write_text(json.dumps(data))
    if serving:
        (run / "serving-x.json").write_text(json.dumps(serving_file(20000.0, 20000.0 * decode, [decode], False, False)))
    return run


MARKS = {"pass": "\u2713 pass", "fail": "\u2717 fail", "unknown": "? unknown"}  # as the report writes them


def verdict_lines(md: str) -> tuple[str, dict[str, str]]:
    """The run's verdict (the line under the title, after its mark) and each case's (the Verdict section's table)."""
    lines = md.splitlines()
    assert lines[0].startswith("# ") and lines[1] == "" and lines[2].startswith("**"), lines[:3]
    cases = {r["case"]: r["verdict"] for t in md_tables(section(md, "Verdict")) for r in t if "case" in r}
    return md_text(lines[2].strip("*")).partition(" overall: ")[2], cases


def opening(md: str) -> tuple[str, list[dict[str, str]], list[str]]:
    """What a report opens with: the overall line, the family table's rows, and any other line before the table ends."""
    head = md.split("\n## ", 1)[0].splitlines()
    assert head[0].startswith("# ") and head[1] == "", head[:2]
    tables = md_tables("\n".join(head))
    last = max((i for i, line in enumerate(head) if line.startswith("|")), default=2)
    rest = [line for line in head[3:last] if line and not line.startswith("|")]  # before the marks end
    return md_text(head[2].strip("*")), tables[0] if tables else [], rest


FAMILY_CASES = [
    ({}, {"conformance": "pass", "tiny-llama": "pass", "serving speed": "pass"}, "pass"),
    ({"tokens_differ": True}, {"conformance": "pass", "tiny-llama": "fail", "serving speed": "pass"}, "fail"),
    ({"over_budget": 17 * MIB}, {"conformance": "pass", "tiny-llama": "fail", "serving speed": "pass"}, "fail"),
    ({"decode": 0.98}, {"conformance": "pass", "tiny-llama": "pass", "serving speed": "fail"}, "fail"),
    ({"failed_rule": True}, {"conformance": "fail", "tiny-llama": "pass", "serving speed": "pass"}, "fail"),
    ({"serving": False}, {"conformance": "pass", "tiny-llama": "pass", "serving speed": "unknown"}, "unknown"),
    ({"legacy_runs": 1}, {"conformance": "pass", "tiny-llama": "unknown", "serving speed": "pass"}, "unknown"),
]


@pytest.mark.parametrize(
    "broken,families,overall",
    FAMILY_CASES,
    ids=["passing", "tokens-differ", "over-budget-17MiB", "decode-0.98", "failed-rule", "no-serving", "one-legacy"],
)
def test_the_report_opens_with_a_mark_per_case_family_and_overall_before_any_prose(tmp_path, broken, families, overall):
    md, summary, page = render(verdict_run(tmp_path, **broken), tmp_path / "out")
    line, rows, prose = opening(md)
    got = {
        "overall": line.split(" overall: ")[0],
        "families": {r["case family"]: r["mark"] for r in rows},
        "prose before the first section": prose,
        "summary.json": (summary["verdict"]["mark"], {f["family"]: f["mark"] for f in summary["verdict"]["families"]}),
    }
    marks = {k: MARKS[v] for k, v in families.items()}
    want = {
        "overall": MARKS[overall],
        "families": marks,
        "prose before the first section": [],
        "summary.json": (MARKS[overall], marks),
    }
    assert got == want, f"the opening of a run with {broken or 'every check at its threshold'}: got {got}"
    before = page.split("<h2", 1)[0]  # the HTML page: the same marks, in a table, before its first section
    shown = [unescape(m) for m in re.findall(r"<td>([^<]*)</td>", before)]
    assert [MARKS[overall]] + list(marks.values()) == [
        m for m in [line.split(" overall: ")[0], *shown] if m in MARKS.values()
    ], f"report.html: expected the overall mark and each family's before the first section, got {shown}"


def test_a_committed_run_says_which_run_is_current_for_each_case_family(tmp_path):
    index = json.loads((ROOT / "reports" / "runs" / "current.json").read_text())
    name = "h100-2026-12-05"
    md, summary, _ = render(ROOT / "reports" / "runs" / name, tmp_path / "out")
    rows = md_tables(section(md, "Current runs"))[0]
    got = [(r["case family"], r["current run"]) for r in rows]
    assert got == [(f["family"], f["run"]) for f in index["families"]], got
    mine = [f["family"] for f in index["families"] if f["run"] == name]
    assert summary["current_for"] == mine and [r["case family"] for r in rows if r["this run"] == "yes"] == mine
    _, _, prose = opening(md)
    assert prose == [] and f"current for: {mine[0]}" in md.split("\n## ", 1)[0].replace("\\", ""), md[:600]
    md, summary, _ = render(FULL, tmp_path / "fixture")  # a folder that no index names
    assert summary["current_for"] is None and "Current runs" not in md


@pytest.mark.parametrize(
    "broken,run_line,case_line",
    [
        ({}, "safe to turn on: yes", "safe to turn on: yes"),
        (
            {"tokens_differ": True},
            "safe to turn on: no: greedy tokens differ from legacy",
            "safe to turn on: no: greedy tokens differ from legacy",
        ),
        (
            {"over_budget": 17 * MIB},
            f"safe to turn on: no: {17:+,.2f} MiB beyond the budget at the measured peak",
            f"safe to turn on: no: {17:+,.2f} MiB beyond the budget at the measured peak",
        ),
        (
            {"decode": 0.98},
            "safe to turn on: no: decode extensible / legacy 0.98 is below 0.99",
            "safe to turn on: yes",
        ),
        (
            {"failed_rule": True},
            f"safe to turn on: no: 1 of {N_CONFORMANCE_TESTS} conformance tests failed",
            "safe to turn on: yes",
        ),
        (
            {"serving": False},
            "safe to turn on: unknown: decode extensible / legacy not measured",
            "safe to turn on: yes",
        ),
        (
            {"legacy_runs": 1},
            "safe to turn on: unknown: tokens not compared with a deterministic baseline",
            "safe to turn on: unknown: tokens not compared with a deterministic baseline",
        ),
    ],
    ids=["passing", "tokens-differ", "over-budget-17MiB", "decode-0.98", "failed-rule", "no-serving", "one-legacy"],
)
def test_the_report_starts_with_a_verdict_per_run_and_per_case(tmp_path, broken, run_line, case_line):
    md, summary, page = render(verdict_run(tmp_path, **broken), tmp_path / "out")
    got_run, cases = verdict_lines(md)
    assert got_run.startswith(run_line) and cases["c-extensible.json"].startswith(case_line), (
        f"verdict of a run with {broken or 'every check at its threshold'}: expected {run_line!r} and, for its "
        f"case, {case_line!r}; got {got_run!r} and {cases}"
    )
    assert (summary["verdict"]["run"], summary["verdict"]["cases"]["c-extensible.json"]) == (
        got_run,
        cases["c-extensible.json"],
    ), f"summary.json verdict: got {summary['verdict']}"
    first = re.search(r"</h1>\s*<p><strong>(.*?)</strong></p>", page, re.DOTALL)
    shown = first and unescape(first.group(1)).partition(" overall: ")[2]
    assert shown == got_run, "report.html: expected the verdict under the title"


# -- the plots are readable at the scales that matter --------------------------------------------------------------
def _texts(ax, renderer) -> list:
    return [t.get_window_extent(renderer) for t in ax.texts if t.get_visible() and t.get_text().strip()]


def test_memory_plots_keep_fixed_block_runs_apart_with_no_overlapping_labels_and_one_style_per_series():
    pytest.importorskip("matplotlib", reason="the figures need the 'report' extra (matplotlib)")
    from extensible_kv_lab.report import figures

    groups = accounting.groups(
        accounting.account(load_run(ROOT / "reports" / "runs" / "h200-matrix-current-2026-12-03").cases)
    )
    fixed_seen = 0
    for group, members in groups.items():
        title = " ".join(group)
        fig = figures.memory_stack_figure(title, members)
        renderer = fig.canvas.get_renderer()
        fig.canvas.draw()
        for ax in fig.axes:
            for boxes in (
                _texts(ax, renderer),
                [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_visible() and t.get_text()],
            ):
                assert not _overlaps(boxes), f"memory plot {title}, panel {ax.get_title()!r}: overlapping labels"
        handles = [h for legend in fig.legends for h in legend.legend_handles]
        entries = [
            (
                h.get_label(),
                *((h.get_hatch(), h.get_facecolor()) if hasattr(h, "get_hatch") else (None, h.get_marker())),
            )
            for h in handles
        ]
        styles = [str(style) for _, *style in entries]
        assert len(set(styles)) == len(styles), f"memory plot {title}: legend entries share a style: {entries}"
        hatches = [hatch for _, hatch, _ in entries if hatch]
        assert len(set(hatches)) == len(hatches), f"memory plot {title}: legend entries share a hatch: {entries}"
        budget = [ax for ax in fig.axes if "budget" in ax.get_ylabel()]
        fixed = [b for b in members if getattr(b.case.spec, "num_gpu_blocks_override", None) is not None]
        sized = [b for b in members if b not in fixed]
        for ax, runs in zip(budget, (sized, fixed) if sized else (fixed,)):
            low, high = ax.get_ylim()
            values = [v / MIB for b in runs for v in (b.over_budget, b.over_budget_at_peak) if v is not None]
            assert all(low <= v <= high for v in values), f"memory plot {title}: {values} outside {ax.get_ylabel()}"
        if fixed and sized:
            fixed_seen += 1
            low, high = budget[0].get_ylim()
            far = [b.over_budget / MIB for b in fixed if b.over_budget is not None]
            assert len(budget) == 2 and not any(low <= v <= high for v in far), (
                f"memory plot {title}: expected the runs at a fixed block count ({far} MiB) in a panel of their own, "
                f"got panels {[ax.get_ylabel() for ax in budget]} with the first spanning {low:.0f} to {high:.0f} MiB"
            )
    assert fixed_seen, "expected a group with runs at a fixed block count in h200-matrix-current-2026-12-03"


def test_the_sleep_and_connector_scripts_tables_are_rendered_as_text(tmp_path):
    run = tmp_path / "run"
    (run / "sleep").mkdir(parents=True)
    (run / "connectors").mkdir()
    hostile = "![x](https://example.invalid/beacon.png)"
    (run / "sleep" / "summary.json").write_text(
        json.dumps({"pairs": [{"pair": hostile, "wake_ratio": 0.5, "verdict": "pass"}], "cases": [], "skipped": []})
    )
    (run / "connectors" / "summary.json").write_text(
        json.dumps({"rows": [{"case": "qwen3-v2-example-extensible", "loaded_again": 40, "tokens": [[1, 2]]}]})
    )
    out = tmp_path / "out"
    assert report_main([str(run), "--out", str(out)]) == 0, "report of a run with only the scripts' tables"
    md = (out / "report.md").read_text()
    pairs = md_tables(section(md, "sleep mode: pairs"))[0]
    rows = md_tables(section(md, "KV connectors: rows"))[0]
    got = (pairs[0]["pair"], pairs[0]["wake_ratio"], rows[0]["loaded_again"], "tokens" in rows[0])
    assert got == (hostile, "0.5", "40", False), (
        f"the scripts' tables (pair, wake ratio, loads, a list column): "
        f"expected ({hostile!r}, '0.5', '40', False), got {got}"
    )
    html = (out / "report.html").read_text()
    assert "example.invalid" not in re.sub(r"<code>.*?</code>|>[^<]*<", "", html), (
        "a file string reached the HTML as markup"
    )
    (run / "sleep" / "summary.json").write_text(json.dumps({"pairs": [{"pair": "p", "freed_diff": 10**400}]}))
    assert report_main([str(run), "--out", str(out)]) == 2, "a summary.json with a count of 10**400 is refused"


def test_a_scripts_table_shows_at_most_its_row_limit_and_cuts_long_cells_saying_so(tmp_path):
    from extensible_kv_lab.report import document

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"case": f"c{i}", "over_budget": i, "note": "x" * (5000 if i < 100 else 1)} for i in range(20_000)]
    (run / "worst-batch-summary.json").write_text(json.dumps({"rows": rows}))
    out = tmp_path / "out"
    assert report_main([str(run), "--out", str(out)]) == 0, "report of a run with a 20,000-row worst-batch summary"
    md = (out / "report.md").read_text()
    table = md_tables(section(md, "worst batch: rows"))[0]
    limit = document.FEATURE_ROWS
    got = (len(table), max(len(r["note"]) for r in table), f"{20_000 - limit} more rows" in md)
    assert got == (limit, document.FEATURE_CELL_CHARS, True), (
        f"a 20,000-row table with 5,000-character cells: expected {limit} rows, cells cut to "
        f"{document.FEATURE_CELL_CHARS} characters and the rows left out counted, got {got}"
    )


def test_a_scripts_table_has_the_keys_of_every_row_shown_bounded_and_its_headings_cut(tmp_path):
    from extensible_kv_lab.report import document

    run = tmp_path / "run"
    run.mkdir()
    wide = {f"k{i}": i for i in range(document.FEATURE_COLUMNS + 10)}
    rows = [{"tokens": [1, 2], "t": {"a": 1}}, {"only_in_row2": "seen", "k" * 5000: 1}, wide]
    (run / "resize-summary.json").write_text(json.dumps({"rows": rows}))
    (run / "share-summary.json").write_text(json.dumps({"rows": [{"tokens": [1]}]}))
    out = tmp_path / "out"
    assert report_main([str(run), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    resize = section(md, "resize: rows")
    header = next(line for line in resize.splitlines() if line.startswith("|"))
    got = (
        "seen" in resize,
        len(header) < 40 * (document.FEATURE_CELL_CHARS + 3),
        header.count("|") - 1,
        "10 more columns in the file" in resize or "12 more columns in the file" in resize,
        "No plain values" in section(md, "engines sharing a GPU: rows"),
    )
    assert got == (True, True, document.FEATURE_COLUMNS, True, True), (
        "a table whose first row has only lists, whose second row has a key of its own and a 5,000-character key, "
        f"and a row of {document.FEATURE_COLUMNS + 10} keys: expected the later key's value shown, headings cut, "
        f"{document.FEATURE_COLUMNS} columns and the rest counted, and a row of lists said so; got {got}"
    )


def test_a_scripts_table_counts_what_it_left_out_below_the_table_and_escapes_control_characters(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"case": "\x1b[31mred\x1b[0m", "n": i} for i in range(300)]
    (run / "worst-batch-summary.json").write_text(json.dumps({"rows": rows}))
    out = tmp_path / "out"
    assert report_main([str(run), "--out", str(out)]) == 0
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    got = ("\x1b" in md or "\x1b" in html, "<td>100 more rows in the file.</td>" in html, "100 more rows" in html)
    assert got == (False, False, True), (
        f"a 300-row table of escape sequences: expected no raw ESC and the count outside the table, got {got}"
    )
