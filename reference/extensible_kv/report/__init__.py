"""Memory-accounting reports from the measurement files the conformance, integration and benchmark runs write.

    python -m extensible_kv report reports/runs/<run-name> [--out DIR] [--name NAME]
    python -m extensible_kv report reports/out --name latest          # the run CI or a GPU job just made
    python -m extensible_kv report reports/runs/<run-name> --compare reports/runs/<baseline-name>

writes ``report.md``, a self-contained ``report.html``, ``summary.json`` and the PNG plots into
``reports/<run-name>/`` (``reports/<run-name>-vs-<baseline-name>/`` when comparing), relative to the current
folder. Numbers come only from the run's files, read through ``extensible_kv.measurements``; what a run lacks reads
"not measured".

Modules: ``run`` (a run folder), ``benchmarks`` (benchmark figures, ratios, targets; ``bench-summary``),
``accounting`` (memory of the vLLM cases), ``matrix`` (conformance driver x rule), ``glance``, ``consistency``,
``summary`` (summary.json), ``document`` (one run's report), ``comparison`` (two runs with deltas), ``figures``
(matplotlib PNGs), ``numbers`` (the number format) and ``rendering`` (templates/, Markdown, HTML).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..measurements import BadFile
from .run import RunFolderError, load_run

__all__ = ["add_arguments", "main", "register", "register_bench_summary", "run_command"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run folder, e.g. reports/runs/h200-2026-12-02")
    parser.add_argument("--out", default=None,
                        help="output folder (default: reports/<run-name>/, or reports/<run-name>-vs-<baseline>/ "
                             "with --compare)")
    parser.add_argument("--name", default=None, help="the run's name in the report (default: RUN_DIR's basename)")
    parser.add_argument("--compare", metavar="OTHER_RUN_DIR", default=None,
                        help="a baseline run folder: report both side by side, deltas = RUN_DIR - OTHER_RUN_DIR")


def run_command(args: argparse.Namespace) -> int:
    """The ``report`` command on parsed arguments; 2 when a run folder is missing, holds no measurement file or a
    file that cannot be read, or when the output folder cannot be written."""
    try:
        runs = [load_run(args.run_dir, name=args.name)] + ([load_run(args.compare)] if args.compare else [])
    except (RunFolderError, BadFile) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for r in runs:
        if not r.measured:
            print(f"error: no measurement files in {r.path}", file=sys.stderr)
            return 2
    from .rendering import write  # noqa: PLC0415 - matplotlib and the templates load only when a report is made

    if len(runs) == 1:
        from .document import run_document  # noqa: PLC0415

        doc = run_document(runs[0])
    else:
        from .comparison import comparison_document  # noqa: PLC0415

        doc = comparison_document(*runs)
    out = Path(args.out) if args.out else Path("reports") / "-vs-".join(r.name for r in runs)
    try:
        write(out, doc.markdown, doc.html, doc.summary, doc.figures)
    except OSError as exc:
        print(f"error: cannot write the report to {out.as_posix()}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    figures = list(doc.figures.drawn.values())
    undrawn = [f for f in figures if f.png is None]
    print(f"report written to {out.as_posix()}/: report.md, report.html, summary.json, "
          f"{len(figures) - len(undrawn)} PNG" + (f" ({len(undrawn)} figure(s) not drawn: {undrawn[0].missing})"
                                                   if undrawn else ""))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``report`` command to ``python -m extensible_kv``'s subparsers."""
    parser = subparsers.add_parser("report", help="memory-accounting report (Markdown, HTML, PNG, JSON) of a run "
                                                  "folder, or two run folders side by side")
    add_arguments(parser)
    parser.set_defaults(run=run_command)


def _bench_summary(args: argparse.Namespace) -> int:
    import json  # noqa: PLC0415

    from .benchmarks import summarize  # noqa: PLC0415
    from .rendering import bench_tables  # noqa: PLC0415

    try:
        summary = summarize(args.benchmark_json)
    except BadFile as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2) if args.json else bench_tables(summary, Path(args.benchmark_json).name))
    return 0


def register_bench_summary(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bench-summary`` command (``benchmarks``) to ``python -m extensible_kv``'s subparsers."""
    parser = subparsers.add_parser("bench-summary", help="the benchmark figures, ratios and targets of a "
                                                         "pytest-benchmark JSON file of bench/")
    parser.add_argument("benchmark_json", help="a file written by pytest --benchmark-json over bench/")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of tables")
    parser.set_defaults(run=_bench_summary)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m extensible_kv report", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_command(parser.parse_args(argv))
