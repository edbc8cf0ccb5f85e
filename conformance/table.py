"""The summary table of a conformance run: one row per driver (rules passed, failed and skipped, granularity, commit
throughput), as the plugin prints it at the end of a run and as ``check_driver`` prints it for a driver that could
not be built, where no rule ran."""

from __future__ import annotations

TITLE = "extensible-kv conformance summary"
FIELDS = ("driver", "passed", "failed", "skipped", "granularity", "commit_gb_per_s", "commit_bytes", "unavailable")
ALL = "all"  # the failed count of a driver that could not be built: every rule fails without running


def row(driver: str, **values: object) -> dict:
    """A table row with every field, the counts 0 and the rest ``None`` unless given."""
    base = {
        "driver": driver,
        "passed": 0,
        "failed": 0,
        "skipped": 0,
        "granularity": None,
        "commit_gb_per_s": None,
        "commit_bytes": None,
        "unavailable": None,
    }
    unknown = set(values) - set(FIELDS)
    if unknown:
        raise ValueError(f"summary row for {driver}: unknown fields {sorted(unknown)}; known: {FIELDS}")
    return {**base, **values}


def lines(rows: list[dict]) -> list[str]:
    """The table's header and one line per row (no title)."""
    out = [f"{'driver':<24} {'passed':>6} {'failed':>6} {'skipped':>7} {'granularity':>12} {'commit GB/s':>12}"]
    for r in rows:
        gran = f"{r['granularity'] >> 10} KiB" if r["granularity"] else "-"
        rate = f"{r['commit_gb_per_s']:.1f}" if r["commit_gb_per_s"] is not None else "-"
        out.append(
            f"{r['driver']:<24} {r['passed']:>6} {r['failed']:>6} {r['skipped']:>7} {gran:>12} {rate:>12}"
            + (f"   ({r['unavailable']})" if r["unavailable"] else "")
        )
    return out


def section(title: str = TITLE, width: int = 80) -> str:
    """A section line as pytest's terminal writes one: ``===== title =====``."""
    fill = max(width - len(title) - 2, 2)
    return f"{'=' * (fill // 2)} {title} {'=' * (fill - fill // 2)}"
