"""Memory-accounting reports of the measurement files a run wrote (read through ``extensible_kv_lab.measurements``).

    python -m extensible_kv report reports/runs/<run-name> [--out DIR] [--name NAME]
    python -m extensible_kv report reports/out --name latest     # the run CI or a GPU job just made

writes ``report.md``, a self-contained ``report.html``, ``summary.json`` and the PNG plots into
``reports/rendered/<run-name>/``, a folder git ignores: a run folder keeps only its measurement files and README.
The report starts with its verdict (``verdict``); what a run lacks reads "not measured".
``python -m extensible_kv bench-summary FILE [--json]`` prints the benchmark tables of one pytest-benchmark file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from extensible_kv.boundaries import BoundaryError, named, outputs

from .run import load_run, run_name

__all__ = ["RENDERED", "register", "run_command"]
RENDERED = Path("reports") / "rendered"  # the default output folder, in .gitignore


REPORT_FILES = ("report.md", "report.html", "summary.json")  # what a report writes, beside its PNGs


def run_command(args: argparse.Namespace) -> int:
    """The ``report`` command: writes the report and prints the run's verdict; 2 when the run folder is missing,
    holds no measurement file or a file that cannot be read, or when the output folder cannot be written (checked
    before the run is read: Note [An output is a regular file or a new path, checked first])."""
    try:
        name = run_name(args.name) if args.name is not None else None
        out = outputs.output_folder(args.out, option="--out", files=REPORT_FILES) if args.out else None
        run = load_run(args.run_dir, name=name)
        if out is None:
            out = outputs.output_folder(RENDERED / run.name, option="the report folder", files=REPORT_FILES)
    except BoundaryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not run.measured:
        print(f"error: no measurement files in {named(run.path)}", file=sys.stderr)
        return 2
    from .document import run_document  # matplotlib and jinja2 load only for a report
    from .rendering import write

    doc = run_document(run)
    try:
        write(out, doc.markdown, doc.html, doc.summary, doc.figures)
    except (OSError, BoundaryError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        print(f"error: cannot write the report to {named(out)}: {reason}", file=sys.stderr)
        return 2
    undrawn = [f for f in doc.figures.drawn.values() if f.png is None]
    note = f" ({len(undrawn)} figure(s) not drawn: {undrawn[0].missing})" if undrawn else ""
    pngs = len(doc.figures.drawn) - len(undrawn)
    print(f"report written to {out.as_posix()}/: report.md, report.html, summary.json, {pngs} PNG{note}")
    print(f"{run.name}: {doc.summary['verdict']['mark']}: {doc.summary['verdict']['run']}")
    return 0


def _bench_summary(args: argparse.Namespace) -> int:
    from .benchmarks import summarize
    from .rendering import bench_tables

    try:
        summary = summarize(args.benchmark_json)
    except BoundaryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2) if args.json else bench_tables(summary, Path(args.benchmark_json).name))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``report`` and ``bench-summary`` to ``python -m extensible_kv``'s subparsers."""
    parser = subparsers.add_parser(
        "report", help="memory-accounting report (Markdown, HTML, PNG, JSON) of a run folder, with its verdict"
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run folder, e.g. reports/runs/h200-2026-12-02")
    parser.add_argument("--out", help="output folder (default: reports/rendered/<run-name>/)")
    parser.add_argument("--name", help="the run's name in the report (default: RUN_DIR's basename)")
    parser.set_defaults(run=run_command)
    parser = subparsers.add_parser(
        "bench-summary", help="the benchmark figures, ratios and targets of a pytest-benchmark JSON file of bench/"
    )
    parser.add_argument("benchmark_json", help="a file written by pytest --benchmark-json over bench/")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of tables")
    parser.set_defaults(run=_bench_summary)
