"""Rendering: the Jinja2 templates of ``templates/`` make report.md; markdown-it-py makes report.html of the same
Markdown (PNGs as data URIs, no external assets); summary.json holds the numbers (``null``: not measured).

Every value a template prints is escaped as Markdown text at one place, the environment's ``finalize``: strings from
the measurement files are untrusted (a model name may read ``![x](https://...)`` or ``<script>``) and show as written.
Only ``Markdown`` strings, which the report's own code builds from escaped parts (a figure), pass as they are.
"""

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

from extensible_kv.boundaries import BoundaryError, files, outputs

from .numbers import NOT_MEASURED, number


@dataclass
class Figure:  # a PNG written beside report.md; ``png`` is ``None`` when it was not drawn, ``missing`` says why
    name: str
    title: str
    png: bytes | None
    missing: str | None = None


@dataclass
class Figures:
    """Draws each figure once with ``module`` (``figures``: ``draw`` names a function there that returns a matplotlib
    figure), or records why it cannot (matplotlib missing)."""

    module: object | None = None
    reason: str | None = None
    drawn: dict[str, Figure] = field(default_factory=dict)

    @classmethod
    def available(cls) -> Figures:
        try:
            from . import figures
        except ImportError as exc:
            return cls(None, f"matplotlib is not importable ({exc}); install the 'report' extra")
        return cls(figures)

    def draw(self, name: str, title: str, draw: str, *args: object) -> Figure:
        if name not in self.drawn:
            png = self.module.png(getattr(self.module, draw), *args) if self.module is not None else None
            self.drawn[name] = Figure(name, title, png, None if png is not None else self.reason)
        return self.drawn[name]


class Markdown(str):
    """Markdown the report's code wrote, from escaped parts: printed as it is."""


# What Markdown (CommonMark, and GitHub's tables, strikethrough and math) reads as markup anywhere in a line: links and
# images, raw HTML and entities, emphasis, code, table cells; "_" only where it can start or end emphasis.
_INLINE = re.compile(r"[\\`*\[\]<&|~$]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
_BLOCK = re.compile(r"^(#{1,6}(?=\s|$)|>|[-+](?=\s)|\d{1,9}[.)](?=\s|$))")  # a heading, quote or list at a line start


def text(value: object) -> str:
    """``value`` as Markdown that shows it as written, on one line."""
    line = _INLINE.sub(lambda m: "\\" + m.group(0), " ".join(str(value).splitlines()))
    return _BLOCK.sub(lambda m: m.group(0)[:-1] + "\\" + m.group(0)[-1], line)


def _cell(value: object) -> str:
    """Every expression's output: ``None`` reads "not measured", an inline ``if`` that did not hold nothing, and any
    other value is text (``text``), one table cell; ``Markdown`` stays as it is."""
    if isinstance(value, jinja2.Undefined):
        return ""
    return NOT_MEASURED if value is None else value if isinstance(value, Markdown) else text(value)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


LOADER = jinja2.PackageLoader("extensible_kv_lab.report", "templates")
TEMPLATES = jinja2.Environment(
    loader=LOADER, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, finalize=_cell, autoescape=False
)
TEMPLATES.filters.update(
    slug=_slug,
    fmt=lambda v, unit="count", signed=False: number(None if isinstance(v, jinja2.Undefined) else v, unit, signed),
)


def markdown(template: str, context: dict, figures: Figures, inline: bool = False) -> str:
    """``template`` rendered; figures link their PNG by name, or (``inline``) carry it as a data URI."""

    def fig(name: str, title: str, draw: str, *args: object) -> Markdown:
        f = figures.draw(name, title, draw, *args)
        if f.png is None:
            return Markdown(f'*Figure "{text(f.title)}" not drawn: {text(f.missing)}*')
        src = "data:image/png;base64," + base64.b64encode(f.png).decode() if inline else f.name
        return Markdown(f"![{text(f.title)}]({src})")

    page = TEMPLATES.get_template(template).render(context, fig=fig)
    return re.sub(r"\n{3,}", "\n\n", page).strip() + "\n"


def html(markdown_text: str) -> str:
    """A self-contained page of ``markdown_text`` (raw HTML in it shows as text), with a table of contents."""
    md = MarkdownIt("commonmark", {"html": False}).enable("table").use(anchors_plugin, min_level=2, max_level=3)
    tokens = md.parse(markdown_text)
    heads = [
        (t, "".join(c.content for c in tokens[i + 1].children or []))
        for i, t in enumerate(tokens)
        if t.type == "heading_open"
    ]
    page = jinja2.Environment(loader=LOADER, autoescape=True).get_template("page.html.j2")
    return page.render(
        title=next((text for t, text in heads if t.tag == "h1"), ""),
        toc=[(t.attrs["id"], text) for t, text in heads if t.tag == "h2"],
        body=Markup(md.renderer.render(tokens, md.options, {})),
    )


def bench_tables(summary: dict, source: str) -> str:
    """The benchmark tables of the report, for ``bench-summary``."""
    return markdown("bench.md.j2", {"s": summary, "source": source}, Figures())


OWN_FIGURE = re.compile(r"(memory-[a-z0-9-]+|kv-blocks)\.png")
"""The names of the PNGs the report draws (``fig`` in the templates): the only files a later report removes as
stale, whatever an earlier ``summary.json`` in the folder lists."""


def write(out_dir: str | Path, md: str, page: str, summary: dict, figures: Figures) -> Path:
    """Write the report into ``out_dir`` (``boundaries.outputs.write_folder``): a new folder appears whole, and in an
    existing one each file is replaced whole; PNGs an earlier report there listed and this one does not are removed.
    Every file is encoded before the first is written."""
    out = Path(out_dir)
    drawn = {f.name: f.png for f in figures.drawn.values() if f.png is not None}
    try:
        old = json.loads(files.read_text(out / "summary.json")).get("figures", [])
    except (BoundaryError, ValueError, AttributeError, RecursionError):  # not an earlier report's: nothing is stale
        old = []
    old = old if isinstance(old, list) else []
    stale = [name for name in old if isinstance(name, str) and OWN_FIGURE.fullmatch(name) and name not in drawn]
    contents = {
        **drawn,
        "report.md": md.encode("utf-8", "backslashreplace"),
        "report.html": page.encode("utf-8", "backslashreplace"),
        "summary.json": (json.dumps(dict(summary, figures=sorted(drawn)), indent=2) + "\n").encode(),
    }
    return outputs.write_folder(out, contents, option="--out", remove=[n for n in stale if "/" not in n])
