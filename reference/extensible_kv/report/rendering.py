"""Writing a ``Document``: ``report.md`` (PNGs beside it), ``report.html`` (one file, PNGs as data URIs, no external
assets) and ``summary.json`` (the numbers, with ``null`` for what was not measured)."""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

from .document import Bullets, Document, Figure, Paragraph, Section, Table

_BOLD = re.compile(r"\*\*(.+?)\*\*")
_CODE = re.compile(r"`([^`]+)`")


# -- Markdown --------------------------------------------------------------------------------------------------------
def _md_cell(value: str) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _md_block(block: object) -> str:
    if isinstance(block, Paragraph):
        return block.text
    if isinstance(block, Bullets):
        return "\n".join(f"- {item}" for item in block.items)
    if isinstance(block, Table):
        lines = ["| " + " | ".join(_md_cell(c) for c in block.columns) + " |",
                 "|" + "|".join(" --- " for _ in block.columns) + "|"]
        lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in block.rows]
        return "\n".join(lines)
    if isinstance(block, Figure):
        if block.png is None:
            return f"*Figure \"{block.title}\" not drawn: {block.missing}*"
        return f"![{block.title}]({block.name})"
    if isinstance(block, Section):
        return _md_section(block)
    raise TypeError(f"unknown block {type(block).__name__}")


def _md_section(section: Section) -> str:
    parts = ["#" * section.level + " " + section.title]
    parts += [_md_block(b) for b in section.blocks]
    return "\n\n".join(parts)


def markdown(doc: Document) -> str:
    return "\n\n".join([f"# {doc.title}"] + [_md_section(s) for s in doc.sections]) + "\n"


# -- HTML ------------------------------------------------------------------------------------------------------------
_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1250px;
       padding: 0 1em; color: #222; line-height: 1.45; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.86em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.55em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr:nth-child(even) td { background: #fafafa; }
code { background: #f3f3f3; padding: 0 0.2em; border-radius: 3px; }
img { max-width: 100%; border: 1px solid #eee; }
figure { margin: 1em 0; }
figcaption { font-size: 0.9em; color: #555; }
.missing { color: #a33; font-style: italic; }
"""

_NUMBER = re.compile(r"^[+-]?[\d,]+(\.\d+)?( %)?$")


def _inline(text: str) -> str:
    out = html.escape(str(text), quote=True)
    out = _BOLD.sub(r"<strong>\1</strong>", out)
    return _CODE.sub(r"<code>\1</code>", out)


def _html_block(block: object) -> str:
    if isinstance(block, Paragraph):
        return f"<p>{_inline(block.text)}</p>"
    if isinstance(block, Bullets):
        return "<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in block.items) + "</ul>"
    if isinstance(block, Table):
        head = "".join(f"<th>{_inline(c)}</th>" for c in block.columns)
        rows = "".join("<tr>" + "".join(
            f"<td class=\"num\">{_inline(c)}</td>" if _NUMBER.match(str(c)) else f"<td>{_inline(c)}</td>"
            for c in row) + "</tr>" for row in block.rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"
    if isinstance(block, Figure):
        if block.png is None:
            return (f"<p class=\"missing\">Figure &quot;{_inline(block.title)}&quot; not drawn: "
                    f"{_inline(block.missing)}</p>")
        data = base64.b64encode(block.png).decode("ascii")
        return (f"<figure><img alt=\"{html.escape(block.title, quote=True)}\" src=\"data:image/png;base64,{data}\">"
                f"<figcaption>{_inline(block.title)} ({html.escape(block.name)})</figcaption></figure>")
    if isinstance(block, Section):
        return _html_section(block)
    raise TypeError(f"unknown block {type(block).__name__}")


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def _html_section(section: Section) -> str:
    level = min(section.level, 6)
    return (f"<section id=\"{_slug(section.title)}\"><h{level}>{_inline(section.title)}</h{level}>"
            + "\n".join(_html_block(b) for b in section.blocks) + "</section>")


def html_page(doc: Document) -> str:
    toc = "".join(f"<li><a href=\"#{_slug(s.title)}\">{_inline(s.title)}</a></li>" for s in doc.sections)
    body = "\n".join(_html_section(s) for s in doc.sections)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(doc.title)}</title>"
            f"<style>{_CSS}</style></head><body><h1>{_inline(doc.title)}</h1><nav><ul>{toc}</ul></nav>\n{body}\n"
            f"</body></html>\n")


# -- files -----------------------------------------------------------------------------------------------------------
def write(doc: Document, summary: dict, out_dir: str | Path) -> list[Path]:
    """Write the report into ``out_dir``; PNGs an earlier report there listed and this one does not are removed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = [f for f in doc.figures() if f.png is not None]
    names = {f.name for f in figures}
    old_summary = out / "summary.json"
    if old_summary.is_file():
        try:
            old = json.loads(old_summary.read_text()).get("figures", [])
        except (ValueError, AttributeError):
            old = []
        for name in old:
            stale = out / str(name)
            if name not in names and stale.suffix == ".png" and stale.parent == out and stale.is_file():
                stale.unlink()
    written = []
    for f in figures:
        (out / f.name).write_bytes(f.png)
        written.append(out / f.name)
    summary = dict(summary, figures=sorted(names))
    for name, content in (("report.md", markdown(doc)), ("report.html", html_page(doc)),
                          ("summary.json", json.dumps(summary, indent=2, sort_keys=False) + "\n")):
        (out / name).write_text(content)
        written.append(out / name)
    return written
