"""The conformance matrix: rules (tests without their parameters) by driver, each cell the outcomes' counts."""

from __future__ import annotations

from collections import Counter

from .run import Conformance, rule


def matrix_cells(conformance: list[Conformance]) -> tuple[list[str], list[str], dict]:
    """Rules (rows), driver columns (``driver`` or ``driver (file)`` when a driver is in several files) and
    ``cells[(rule, column)] = Counter(outcome)``."""
    files_of: dict[str, set[str]] = {}
    for c in conformance:
        for name in {d.driver for d in c.data.drivers} | {t.driver for t in c.data.tests}:
            files_of.setdefault(name, set()).add(c.source)

    def column(driver: str, source: str) -> str:
        return f"{driver} ({source})" if len(files_of[driver]) > 1 else driver

    rules: list[str] = []
    columns: list[str] = []
    cells: dict[tuple[str, str], Counter] = {}
    for c in conformance:
        for driver in [d.driver for d in c.data.drivers] + [t.driver for t in c.data.tests]:
            if column(driver, c.source) not in columns:
                columns.append(column(driver, c.source))
        for t in c.data.tests:
            rules.append(rule(t))
            cells.setdefault((rule(t), column(t.driver, c.source)), Counter())[t.outcome] += 1
    return sorted(set(rules)), columns, cells


def cell_state(counts: Counter | None) -> str:
    if not counts:
        return "none"
    if counts.get("failed"):
        return "fail"
    if counts.get("passed") and counts.get("skipped"):
        return "mixed"
    if counts.get("passed"):
        return "pass"
    return "skip"


def cell_text(counts: Counter | None) -> str:
    if not counts:
        return "-"
    total = sum(counts.values())
    parts = [f"{counts[k]}/{total} {word}" for k, word in (("passed", "pass"), ("failed", "fail"),
                                                         ("skipped", "skip")) if counts.get(k)]
    parts += [f"{n}/{total} {k}" for k, n in counts.items() if k not in ("passed", "failed", "skipped")]
    return ", ".join(parts)


def skip_reasons(conformance: list[Conformance]) -> dict[str, str]:
    """Rule -> "driver: reason; ..." of its skipped tests, where the files record reasons."""
    found: dict[str, dict[str, None]] = {}
    for c in conformance:
        for t in c.data.tests:
            if t.outcome == "skipped" and t.reason:
                found.setdefault(rule(t), {})[f"{t.driver}: {t.reason}"] = None
    return {r: "; ".join(reasons) for r, reasons in found.items()}
