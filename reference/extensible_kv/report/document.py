"""The report as a tree of plain blocks (sections, paragraphs, lists, tables, figures), rendered to Markdown and to
HTML by ``rendering``, and the number formats both share.

Text may use two inline marks, ``**bold**`` and ``\\`code\\```; everything else is literal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NOT_MEASURED = "not measured"
GIB, MIB = 1 << 30, 1 << 20


@dataclass
class Paragraph:
    text: str


@dataclass
class Bullets:
    items: list[str]


@dataclass
class Table:
    columns: list[str]
    rows: list[list[str]]


@dataclass
class Figure:
    """A PNG written next to report.md as ``name`` and embedded in report.html; ``png`` is ``None`` when it was not
    drawn, ``missing`` says why."""

    name: str
    title: str
    png: bytes | None
    missing: str | None = None


@dataclass
class Section:
    title: str
    blocks: list = field(default_factory=list)
    level: int = 2

    def add(self, *blocks: object) -> Section:
        self.blocks.extend(blocks)
        return self


@dataclass
class Document:
    title: str
    sections: list[Section]

    def figures(self) -> list[Figure]:
        """Every figure, nested sections included, in reading order."""
        out: list[Figure] = []

        def walk(blocks: list) -> None:
            for b in blocks:
                if isinstance(b, Figure):
                    out.append(b)
                elif isinstance(b, Section):
                    walk(b.blocks)

        walk(self.sections)
        return out


# -- number formats --------------------------------------------------------------------------------------------------
def count(n: int | None) -> str:
    return NOT_MEASURED if n is None else f"{n:,}"


def signed_count(n: int | None) -> str:
    return NOT_MEASURED if n is None else f"{n:+,}"


def gib(n: int | float | None) -> str:
    return NOT_MEASURED if n is None else f"{n / GIB:,.3f}"


def mib(n: int | float | None) -> str:
    return NOT_MEASURED if n is None else f"{n / MIB:,.2f}"


def signed_mib(n: int | float | None) -> str:
    return NOT_MEASURED if n is None else f"{n / MIB:+,.2f}"


def ms(seconds: float | None) -> str:
    return NOT_MEASURED if seconds is None else f"{seconds * 1e3:,.3f}"


def us(seconds: float | None) -> str:
    return NOT_MEASURED if seconds is None else f"{seconds * 1e6:,.1f}"


def rate(gbps: float | None) -> str:
    return NOT_MEASURED if gbps is None else f"{gbps:,.2f}"


def ratio(x: float | None) -> str:
    if x is None:
        return NOT_MEASURED
    if isinstance(x, bool):
        return "yes" if x else "no"
    return f"{x:.4g}"


def percent(x: float | None) -> str:
    return NOT_MEASURED if x is None else f"{x:+.3f} %"


def text(x: object) -> str:
    return NOT_MEASURED if x is None else str(x)


def yes_no(x: bool | None) -> str:
    return NOT_MEASURED if x is None else ("yes" if x else "no")
