"""Rendering: the Jinja2 templates of ``templates/`` make report.md; markdown-it-py makes report.html of the same
Markdown (PNGs as data URIs, no external assets); summary.json holds the numbers (``null``: not measured)."""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
from markdown_it import MarkdownIt
from markupsafe import Markup
from mdit_py_plugins.anchors import anchors_plugin

from .numbers import NOT_MEASURED, number


@dataclass
class Figure:  # a PNG written beside report.md; ``png`` is ``None`` when it was not drawn, ``missing`` says why
    name: str
    title: str
    png: bytes | None
    missing: str | None = None


@dataclass
class Figures:
    """Draws each figure once with ``module`` (``figures``), or records why it cannot (matplotlib missing)."""

    module: object | None = None
    reason: str | None = None
    drawn: dict[str, Figure] = field(default_factory=dict)

    @classmethod
    def available(cls) -> Figures:
        try:
            from . import figures  # noqa: PLC0415
        except ImportError as exc:
            return cls(None, f"matplotlib is not importable ({exc}); install the 'report' extra")
        return cls(figures)

    def draw(self, name: str, title: str, draw: str, *args: object) -> Figure:
        if name not in self.drawn:
            png = getattr(self.module, draw)(*args) if self.module is not None else None
            self.drawn[name] = Figure(name, title, png, None if png is not None else self.reason)
        return self.drawn[name]


def _cell(value: object) -> str:
    """Every expression's output: ``None`` reads "not measured", an inline ``if`` that did not hold nothing, and a
    table cell stays one cell."""
    if isinstance(value, jinja2.Undefined):
        return ""
    return NOT_MEASURED if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


LOADER = jinja2.PackageLoader("extensible_kv.report", "templates")
TEMPLATES = jinja2.Environment(loader=LOADER, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                               finalize=_cell, autoescape=False)
TEMPLATES.filters.update(slug=_slug, fmt=lambda v, unit="count", signed=False: number(
    None if isinstance(v, jinja2.Undefined) else v, unit, signed))


def markdown(template: str, context: dict, figures: Figures, inline: bool = False) -> str:
    """``template`` rendered; figures link their PNG by name, or (``inline``) carry it as a data URI."""

    def fig(name: str, title: str, draw: str, *args: object) -> str:
        f = figures.draw(name, title, draw, *args)
        if f.png is None:
            return f'*Figure "{f.title}" not drawn: {f.missing}*'
        return f"![{f.title}]({'data:image/png;base64,' + base64.b64encode(f.png).decode() if inline else f.name})"

    text = TEMPLATES.get_template(template).render(context, fig=fig)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def html(markdown_text: str) -> str:
    """A self-contained page of ``markdown_text`` (raw HTML in it shows as text), with a table of contents."""
    md = MarkdownIt("commonmark", {"html": False}).enable("table").use(anchors_plugin, min_level=2, max_level=3)
    tokens = md.parse(markdown_text)
    heads = [(t, tokens[i + 1].content) for i, t in enumerate(tokens) if t.type == "heading_open"]
    page = jinja2.Environment(loader=LOADER, autoescape=True).get_template("page.html.j2")
    return page.render(title=next((text for t, text in heads if t.tag == "h1"), ""),
                       toc=[(t.attrs["id"], text) for t, text in heads if t.tag == "h2"],
                       body=Markup(md.renderer.render(tokens, md.options, {})))


def bench_tables(summary: dict, source: str) -> str:
    """The benchmark tables of the report, for ``bench-summary``."""
    return markdown("bench.md.j2", {"s": summary, "source": source, "tables_only": True}, Figures())


def write(out_dir: str | Path, md: str, page: str, summary: dict, figures: Figures) -> None:
    """Write the report into ``out_dir``; PNGs an earlier report there listed and this one does not are removed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    drawn = {f.name: f.png for f in figures.drawn.values() if f.png is not None}
    try:
        old = json.loads((out / "summary.json").read_text()).get("figures", [])
    except (OSError, ValueError, AttributeError):
        old = []
    for stale in (out / str(name) for name in old if name not in drawn):
        if stale.suffix == ".png" and stale.parent == out and stale.is_file():
            stale.unlink()
    for name, png in drawn.items():
        (out / name).write_bytes(png)
    (out / "report.md").write_text(md)
    (out / "report.html").write_text(page)
    (out / "summary.json").write_text(json.dumps(dict(summary, figures=sorted(drawn)), indent=2) + "\n")
