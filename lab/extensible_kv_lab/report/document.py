"""One run's report: report.md, report.html (templates/report.md.j2) and summary.json of a ``Run``."""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from extensible_kv.boundaries import escaped

from ..measurements import ExtensibleFigures
from . import accounting, verdict
from .accounting import MemoryBreakdown
from .numbers import number
from .rendering import Figures, html, markdown
from .run import ENVIRONMENT_NAMES, Run
from .serving import serving_rows

# The conformance tests that did not pass, listed in the report: a page stays readable (and its Markdown and HTML
# bounded in size, whatever a run folder holds); summary.json lists every one.
ODD_ROWS = 100
# A GPU script's table (``Run.features``): its first rows and columns (every key of those rows, in the order they
# first appear), each cell and heading cut to a length, the rest counted; the file in the run folder holds them all.
FEATURE_ROWS = 200
FEATURE_COLUMNS = 40
FEATURE_CELL_CHARS = 200


class Document(NamedTuple):
    markdown: str
    html: str
    summary: dict
    figures: Figures


# The figures of a case breakdown in summary.json, by name.
CASE_FIGURES = (
    "blocks bytes_per_block commit_seconds total requested before_engine weights activation_peak graph_pools "
    "other_non_kv kv_committed kv_padding kv_source free_after_warmup non_kv_after_warmup non_kv_sizing "
    "non_kv_estimate non_kv_estimate_parts measured_minus_estimate over_budget activation_reusable "
    "activation_headroom over_budget_at_peak over_budget_phase encoder_cache_profiled encoder_cache_held "
    "encoder_cache_items encoder_cache_capacity speculative_rows speculative_step speculative_growth "
    "speculative_over_budget"
).split()


def _case(b: MemoryBreakdown) -> dict:
    c, segments = b.case, b.segments()
    return {
        "path": c.path,
        "key": c.key,
        **c.spec.model_dump(include={"model", "runner", "backend", "mode", "corrupt"}),
        **{name: getattr(b, name) for name in CASE_FIGURES},
        "tokens_match_legacy": b.tokens_match_legacy if c.mode != "legacy" else None,
        "num_cached_tokens": c.data.num_cached_tokens,
        "legacy_partner": b.legacy_partner.path if b.legacy_partner else None,
        "kv_partner": b.kv_partner.path if b.kv_partner else None,
        "segments": None if segments is None else [{"label": s.label, "bytes": s.bytes} for s in segments],
    }


class FeatureTable(NamedTuple):
    columns: list
    rows: list
    rows_left: int
    columns_left: int


def feature_table(rows: list[dict]) -> FeatureTable:
    """What the report shows of a script's table: the first ``FEATURE_ROWS`` rows, the first ``FEATURE_COLUMNS`` of
    the keys those rows have, in the order they first appear, and how many of each were left out."""
    shown = rows[:FEATURE_ROWS]
    keys = list(dict.fromkeys(k for r in shown for k in r))
    return FeatureTable(keys[:FEATURE_COLUMNS], shown, len(rows) - len(shown), max(0, len(keys) - FEATURE_COLUMNS))


def _cell(value: object) -> object:
    """A cell or heading of a script's table: a string with every character that is not printable escaped
    (``\\x1b``: no terminal sequence reaches report.md), cut to ``FEATURE_CELL_CHARS``, ending in ``...``."""
    if not isinstance(value, str):
        return value
    value = escaped(value)
    return value if len(value) <= FEATURE_CELL_CHARS else value[: FEATURE_CELL_CHARS - 3] + "..."


def summary(context: dict) -> dict:
    """summary.json: every figure of the report (its ``context``) as a number (``null``: not measured)."""
    run, (checks, subjects) = context["run"], context["verdict"]
    return {
        "run": run.name,
        "run_folder": run.path.as_posix(),
        "verdict": {
            "mark": verdict.mark(checks),
            "run": verdict.line(checks),
            "families": [
                {"family": name, "mark": verdict.mark(found), "detail": verdict.gist(found)}
                for name, found in context["families"]
            ],
            "cases": {k: verdict.line(v) for k, v in subjects.items()},
        },
        "current_for": run.current_for,
        "environment": {k: {"value": v, "source": s} for k, (v, s) in run.environment.items()},
        "not_measured": list(run.missing),
        "conformance": [
            {
                "source": c.source,
                **c.data.model_dump(include={"exitstatus", "torch", "drivers"}),
                "outcomes": dict(Counter(t.outcome for t in c.data.tests)),
                "not_passed": [t.model_dump() for t in c.data.tests if t.outcome != "passed"],
            }
            for c in run.conformance
        ],
        "bench": [{"source": b.source, "datetime": b.data.datetime, "summary": b.summary} for b in run.bench],
        "integration": {
            "cases": [_case(b) for b in context["breakdowns"]],
            "pairs": [
                {
                    "legacy": p.legacy.case.path,
                    "other": p.other.case.path,
                    "legacy_blocks": p.legacy.blocks,
                    "blocks": p.other.blocks,
                    "delta_blocks": p.delta_blocks,
                    "delta_percent": p.delta_percent,
                    "delta_bytes": p.delta_bytes,
                }
                for p in context["pairs"]
            ],
        },
        "serving": [
            {k: r[k] for k in ("source", "model", "runner")}
            | {mode: r[mode] and r[mode].model_dump() for mode in ("legacy", "extensible")}
            | r["ratio"].model_dump()
            | {"decode_target_met": r["met"], "start_note": r["start_note"]}
            for r in context["serving"]
        ],
        "backend_validation": [
            {
                "source": f.source,
                **r.model_dump(exclude={"checks"}),
                "checks_not_ok": [c.name for c in r.checks if not c.ok],
            }
            for f in run.backends
            for r in f.data.results
        ],
    }


def segments_text(ext: ExtensibleFigures) -> str:
    """Segments per buffer, summarised (``32 buffers x 1 segment``), never a long list."""
    counts = Counter(ext.segments or [])
    parts = [f"{k} buffer{'s' * (k > 1)} x {n} segment{'s' * (n != 1)}" for n, k in counts.items()]
    return ", ".join(parts) or number(None)


def run_document(run: Run, figures: Figures | None = None) -> Document:
    figures = figures or Figures.available()
    breakdowns = accounting.account(run.cases)
    pairs = accounting.block_pairs(breakdowns)
    rows, serving = verdict.parity_rows(run.cases), serving_rows(run.serving)
    judged = verdict.judge(run, breakdowns, rows, serving)
    context = {
        "run": run,
        "environment_names": ENVIRONMENT_NAMES,
        "odd": [(c.source, t) for c in run.conformance for t in c.data.tests if t.outcome != "passed"],
        "odd_rows": ODD_ROWS,
        "feature_table": feature_table,
        "cell": _cell,
        "breakdowns": breakdowns,
        "refused": accounting.refused(run.cases),
        "parity": rows,
        "pairs": pairs,
        "groups": accounting.groups(breakdowns),
        "a": accounting,
        "segments": segments_text,
        "serving": serving,
        "verdict": judged,
        "families": verdict.families(*judged, rows, serving),
        "v": verdict,
    }
    md = markdown("report.md.j2", context, figures)
    page = html(markdown("report.md.j2", context, figures, inline=True))
    return Document(md, page, summary(context), figures)
