"""One run's report: report.md, report.html and summary.json of a ``Run`` (templates/report.md.j2)."""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from ..measurements import ExtensibleFigures
from . import accounting, parity
from .consistency import checks
from .matrix import cell_text, matrix_cells, skip_reasons
from .numbers import number
from .rendering import Figures, html, markdown
from .run import ENVIRONMENT_NAMES, Run
from .serving import serving_rows
from .summary import summary


class Document(NamedTuple):
    markdown: str
    html: str
    summary: dict
    figures: Figures


def segments_text(ext: ExtensibleFigures) -> str:
    """Segments per buffer, summarised (``32 buffers x 1 segment``), never a long list."""
    counts = Counter(ext.segments or [])
    return ", ".join(f"{k} buffer{'s' * (k > 1)} x {n} segment{'s' * (n != 1)}" for n, k in counts.items()) or \
        number(None)


def run_document(run: Run, figures: Figures | None = None) -> Document:
    figures = figures or Figures.available()
    breakdowns = accounting.account(run.cases)
    pairs = accounting.block_pairs(breakdowns)
    context = {"run": run, "environment_names": ENVIRONMENT_NAMES, "matrix": matrix_cells(run.conformance),
               "cell_text": cell_text, "reasons": skip_reasons(run.conformance),
               "odd": [(c.source, t) for c in run.conformance for t in c.data.tests if t.outcome != "passed"],
               "breakdowns": breakdowns, "refused": accounting.refused(run.cases),
               "parity": parity.parity_rows(run.cases), "pairs": pairs, "groups": accounting.groups(breakdowns),
               "a": accounting,
               "segments": segments_text, "consistency": checks(run, breakdowns),
               "serving": serving_rows(run.serving)}
    md = markdown("report.md.j2", context, figures)
    page = html(markdown("report.md.j2", context, figures, inline=True))
    return Document(md, page, summary(run, breakdowns, pairs, context["serving"]), figures)
