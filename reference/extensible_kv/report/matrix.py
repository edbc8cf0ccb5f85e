"""The conformance matrix: rules (tests without their parameters) by driver, each cell the outcomes' counts (a table
of the report; a cell where a test failed is in bold)."""

from __future__ import annotations

from collections import Counter

from .run import Source, rule

WORDS = {"passed": "pass", "failed": "fail", "skipped": "skip"}


def matrix_cells(conformance: list[Source]) -> tuple[list[str], list[str], dict[tuple[str, str], Counter]]:
    """Rules (rows), driver columns (``driver``, or ``driver (file)`` when a driver is in several files) and
    ``cells[(rule, column)] = Counter(outcome)``."""
    files_of: dict[str, set[str]] = {}
    for c in conformance:
        for driver in [d.driver for d in c.data.drivers] + [t.driver for t in c.data.tests]:
            files_of.setdefault(driver, set()).add(c.source)
    column = {(d, s): f"{d} ({s})" if len(files_of[d]) > 1 else d for d, sources in files_of.items() for s in sources}
    columns = list(dict.fromkeys(column[(d, c.source)] for c in conformance for d in
                                 [d.driver for d in c.data.drivers] + [t.driver for t in c.data.tests]))
    cells: dict[tuple[str, str], Counter] = {}
    for c in conformance:
        for t in c.data.tests:
            cells.setdefault((rule(t), column[(t.driver, c.source)]), Counter())[t.outcome] += 1
    return sorted({r for r, _ in cells}), columns, cells


def cell_text(counts: Counter | None) -> str:
    """``2/3 pass, 1/3 fail``, in bold where a test failed; ``-`` where the rule did not run."""
    total = sum((counts or {}).values())
    order = [k for k in WORDS if k in (counts or {})] + [k for k in counts or {} if k not in WORDS]
    text = ", ".join(f"{counts[k]}/{total} {WORDS.get(k, k)}" for k in order) or "-"
    return f"**{text}**" if (counts or {}).get("failed") else text


def skip_reasons(conformance: list[Source]) -> dict[str, str]:
    """Rule -> ``driver: reason; ...`` of its skipped tests, where the files record reasons."""
    found: dict[str, dict[str, None]] = {}
    for t in (t for c in conformance for t in c.data.tests if t.outcome == "skipped" and t.reason):
        found.setdefault(rule(t), {})[f"{t.driver}: {t.reason}"] = None
    return {r: "; ".join(reasons) for r, reasons in found.items()}
