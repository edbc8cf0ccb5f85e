"""Run rules on broken drivers, each in a child forked from one process that imported the rules once.

``python -m tests.meta.broken.catch [--all] [--jobs N] [--out FILE] [SPEC ...]`` runs, on every broken driver (or
the drivers ``SPEC`` names, ``module:Class``), the rules its ``caught_by`` names (``--all``: every rule, up to the
first that fails), and writes what each run found as JSON: ``{spec: {"exit": ..., "failed": [rule, ...],
"seconds": ...}}``. A child is a fresh pytest run of one driver (``--hypothesis-profile=extensible-kv-meta``), so
nothing a broken driver leaves behind reaches another one's rules, and a driver that faults ends only its own child
(its rules count as failed). Forking after the imports saves the second or two each fresh interpreter spends
importing torch and the rules.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import conformance
from tests.meta import broken

ROOT = Path(__file__).resolve().parents[3]


def rule_files() -> dict[str, str]:
    """Every rule's name and the file that holds it, relative to the repository root."""
    found = {}
    for file in sorted(Path(conformance.__file__).parent.glob("test_*.py")):
        for line in file.read_text().splitlines():
            if line.startswith("def test_"):
                found[line[4 : line.index("(")]] = str(file.resolve().relative_to(ROOT))
    return found


def resolve(spec: str) -> type:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def failed_rules(report: Path) -> list[str]:
    if not report.exists():
        return []
    cases = ET.parse(report).iter("testcase")
    bad = {c.get("name").split("[")[0] for c in cases if c.find("failure") is not None or c.find("error") is not None}
    return sorted(bad)


def start(spec: str, selection: list[str], report: Path) -> int:
    """Fork a child that runs ``selection`` on the driver ``spec``; return its process id."""
    pid = os.fork()
    if pid:
        return pid
    code = 3
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        args = [*selection, "--driver", spec, "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
        code = int(pytest.main([*args, "--hypothesis-profile=extensible-kv-meta"]))
    finally:
        os._exit(code)


def sweep(specs: list[str], every_rule: bool, jobs: int) -> dict[str, dict]:
    files = rule_files()
    results, running, queue = {}, {}, list(specs)
    with tempfile.TemporaryDirectory() as tmp:
        while queue or running:
            while queue and len(running) < jobs:
                spec = queue.pop(0)
                named = resolve(spec).caught_by
                unknown = [r for r in named if r not in files]
                if unknown:
                    results[spec] = {"exit": None, "failed": [], "seconds": 0.0, "unknown rules": unknown}
                    continue
                selection = [*conformance.rule_paths(), "-x"] if every_rule else [f"{files[r]}::{r}" for r in named]
                report = Path(tmp) / f"{len(results) + len(running)}.xml"
                running[start(spec, selection, report)] = (spec, report, time.monotonic())
            if running:
                pid, status = os.wait()
                spec, report, began = running.pop(pid)
                code = os.waitstatus_to_exitcode(status)
                failed = failed_rules(report) if code >= 0 else ["(the child faulted)"]
                results[spec] = {"exit": code, "failed": failed, "seconds": round(time.monotonic() - began, 2)}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.meta.broken.catch")
    parser.add_argument("specs", nargs="*", help="module:Class of the drivers to run (default: every broken driver)")
    parser.add_argument("--all", action="store_true", help="every rule, not only the driver's caught_by")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, help="write the results here as JSON (default: standard output)")
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    results = sweep(args.specs or list(broken.drivers()), args.all, max(1, args.jobs))
    text = json.dumps(results, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    missed = [s for s, r in results.items() if not r["failed"]]
    for spec in missed:
        print(
            f"not caught: {spec} ({resolve(spec).breaks}), rules run: {'all' if args.all else resolve(spec).caught_by}",
            file=sys.stderr,
        )
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
