"""The report's plots (matplotlib, Agg canvas, no pyplot state), as PNG bytes through ``png``. Every axis names its
unit; sizes are binary (GiB, MiB). Every figure is ``WIDTH`` inches wide at ``DPI`` (900 pixels), so its text is
``SMALL`` points at any page width: report.html shows each at its own size (a narrower page scrolls it, never shrinks
it), and a group of many runs is drawn in parts (``accounting.RUNS_PER_FIGURE``), never as one wider figure."""

from __future__ import annotations

import io
import textwrap

from matplotlib import rc_context
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter

from . import accounting as acc
from .accounting import BlockPair, MemoryBreakdown
from .numbers import GIB, MIB, number

WIDTH, DPI, SMALL = 9.0, 100, 8.0
# The segments' colours in acc.SEGMENT_ORDER; then the modes', the activation peak's and those beyond the budget
COLORS = dict(zip(acc.SEGMENT_ORDER, "#9e9e9e #1f77b4 #9467bd #8c564b #c49c94 #bcbd22 #2ca02c #98df8a #f2f2f2".split()))
COLORS |= {"legacy": "#7f7f7f", "extensible": "#2ca02c", "peak": "#ff7f0e", "over": "#d62728", "under": "#17becf"}
AT_PEAK = "\\\\\\"  # the budget with the peak to come; "///" and "..." are the activation peak's
UNMEASURED = {"marker": "x", "color": "black", "markersize": 6, "linestyle": "none"}


def _new(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def png(draw, *args: object) -> bytes:
    """The PNG of ``draw(*args)``, every string in it literal text: "$...$" in a file's model name is no mathtext."""
    buf = io.BytesIO()
    with rc_context({"text.parse_math": False, "text.usetex": False}):
        draw(*args).savefig(buf, format="png", dpi=DPI, bbox_inches="tight", facecolor="white")
    return buf.getvalue()


def _text(ax, x: float, y: float, text: str, **kw) -> None:
    """Small text at (x, y), centred unless ``kw`` says otherwise."""
    ax.text(x, y, text, **{"ha": "center", "va": "center", "fontsize": SMALL, **kw})


def _note(ax, x: float, text: str, y: float = 0.5, **kw) -> None:
    """Text at data x, axes-fraction y (where a bar is missing)."""
    _text(ax, x, y, text, transform=ax.get_xaxis_transform(), **kw)


def _finish(fig: Figure, title: str, handles: list, ncol: int, bottom: float) -> Figure:
    """The legend below the panels (``bottom``: its share of the height), the title above them."""
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    return fig


def _ticks(runs: list[MemoryBreakdown]) -> list[str]:
    """A label per run: the settings that tell it from the others on its axis, its fixed block count, repeat, mode
    and folder."""
    settings = [[s for s in b.case.settings if not s.startswith("num_gpu_blocks_override")] for b in runs]
    shared = set.intersection(*map(set, settings)) if settings else set()
    ticks = []
    for c, own in zip((b.case for b in runs), settings):
        lines = [s for s in own if s not in shared]
        lines += [f"{c.fixed_blocks:,} blocks fixed"] if c.fixed_blocks else []
        lines += [f"run {c.run_order[1]}"] if c.run_order[1] > 1 else []
        ticks.append("\n".join(lines + [c.variant] + ([f"({c.folder})"] if c.folder else [])))
    return ticks


def _width(runs: list[MemoryBreakdown]) -> float:
    """A panel's share of the figure's width: upright labels of several lines need more than a bar."""
    return max(sum(max(1.0, 0.3 * (t.count("\n") + 1)) for t in _ticks(runs)), 1.5)


def _cases_axis(ax, breakdowns: list[MemoryBreakdown]) -> None:
    """One tick per run (``_ticks``); upright where more than three share the axis or a line is longer than a bar is
    wide."""
    ticks = _ticks(breakdowns)
    crowded = len(ticks) > 3 or max((len(line) for t in ticks for line in t.splitlines()), default=0) > 12
    ax.set_xticks(range(len(ticks)), ticks, fontsize=SMALL, rotation=90 if crowded else 0)
    pad = max(3 - len(ticks), 0) / 2
    ax.set_xlim(-0.6 - pad, len(ticks) - 0.4 + pad)


def _budget_panel(ax, runs: list[MemoryBreakdown], heading: str) -> None:
    """Memory beyond gpu_memory_utilization's budget (MiB) after warmup (solid) and with the peak to come (hatched), the
    value upright above each bar; a cross where the peak was not measured."""
    for x, b in enumerate(runs):
        if b.over_budget is None:
            _note(ax, x, "not measured", rotation=90)
            continue
        for dx, value, hatch in ((-0.15, b.over_budget, None), (0.15, b.over_budget_at_peak, AT_PEAK)):
            if value is None:
                ax.plot([x + dx], [0], **UNMEASURED)
                continue
            color = COLORS["over" if value > 0 else "under"]
            ax.bar(x + dx, value / MIB, width=0.28, color=color, hatch=hatch, edgecolor="white" if hatch else None)
            _text(ax, x + dx, value / MIB, f" {value / MIB:+,.1f} ", va="bottom" if value >= 0 else "top", rotation=90)
    values = [v / MIB for b in runs for v in (b.over_budget, b.over_budget_at_peak) if v is not None] + [0.0]
    span = max(max(values) - min(values), 1.0)
    ax.set_ylim(min(values) - 0.35 * span, max(values) + 0.35 * span)  # room for the upright values
    ax.axhline(0, color="black", linewidth=0.8)
    _cases_axis(ax, runs)
    ax.set_ylabel("used beyond the requested budget (MiB)")
    ax.set_title(heading, fontsize=9)


# -- memory of one (model, runner, backend) group ------------------------------------------------------------------
def memory_stack_figure(title: str, breakdowns: list[MemoryBreakdown]) -> Figure:
    """Left: the whole GPU per run (GiB), the activation peak to come hatched on top. Right: memory used beyond
    gpu_memory_utilization's budget (MiB), after warmup and with that peak: the runs the extensible path sized, and
    apart from them, on their own scale, the runs at a fixed block count (tens of GiB unused)."""
    sized, fixed = [b for b in breakdowns if not b.case.fixed_blocks], [b for b in breakdowns if b.case.fixed_blocks]
    headings = ("beyond gpu_memory_utilization\n(> 0: over)", "runs at a fixed block\ncount (throughput runs)")
    panels = [(runs, heading) for runs, heading in zip((sized, fixed), headings) if runs]
    ratios = [1.15 * _width(breakdowns)] + [_width(runs) for runs, _ in panels]
    fig = _new(WIDTH, 6.2)
    whole, *budgets = fig.subplots(1, 1 + len(panels), gridspec_kw={"width_ratios": ratios})
    present, peaks = {}, {}
    tallest, upright = max([b.total or 0 for b in breakdowns] + [1]) / GIB, 90 if len(breakdowns) > 3 else 0
    for x, b in enumerate(breakdowns):
        segs = b.segments()
        if segs is None:
            _note(whole, x, "not measured", rotation=90)
        negative = [s.label for s in segs or [] if s.bytes is not None and s.bytes < 0]
        if negative:  # drawn as zero; the tables give the value
            _note(whole, x, "negative, drawn as 0:\n" + "\n".join(negative), y=0.1, color=COLORS["over"], rotation=90)
        bottom = used = 0.0
        for s in segs or []:
            present[s.label] = None
            height = max(s.bytes or 0, 0) / GIB
            whole.bar(x, height, bottom=bottom, width=0.6, color=COLORS[s.label], edgecolor="#555555", linewidth=0.5)
            short = {acc.KV: "KV", acc.UNSPLIT: "KV + other", acc.FREE: "free"}.get(s.label)
            if short and height >= 0.12 * tallest:  # labels of adjacent segments stay apart
                _text(whole, x, bottom + height / 2, f"{short}\n{height:.2f} GiB", rotation=upright)
            bottom += height
            used = bottom if s.label != acc.FREE else used
        # the activation memory still to come: measured at the peak, or the whole profiled peak as its estimate
        peak, label, hatch = b.activation_headroom, acc.HEADROOM, "///"
        if peak is None:
            peak, label, hatch = b.activation_peak, f"{acc.PEAK} (estimate: no measured peak)", "..."
        if segs and peak:
            whole.bar(x, peak / GIB, bottom=used, width=0.6, facecolor="none", edgecolor=COLORS["peak"], hatch=hatch)
            peaks[label] = hatch
        if segs and b.requested is not None:
            whole.hlines(b.requested / GIB, x - 0.4, x + 0.4, colors="black", linestyles="dashed")
    _cases_axis(whole, breakdowns)
    whole.set_ylabel("GPU memory (GiB)")
    whole.set_title(
        "whole GPU after warmup; hatched: activation peak to come;\ndashed: requested (utilization x total)", fontsize=9
    )
    for ax, (runs, heading) in zip(budgets, panels):
        _budget_panel(ax, runs, heading)
    handles = [Patch(facecolor=COLORS[k], edgecolor="#555555", label=k) for k in acc.SEGMENT_ORDER if k in present]
    handles += [Patch(facecolor="none", edgecolor=COLORS["peak"], hatch=h, label=k) for k, h in peaks.items()]
    handles += [
        Patch(facecolor=COLORS["over"], label="beyond the budget: over (solid: after warmup)"),
        Patch(facecolor=COLORS["under"], label="beyond the budget: under"),
        Patch(facecolor="white", edgecolor="#555555", hatch=AT_PEAK, label="beyond the budget with the peak"),
        Line2D([], [], label="with the peak: not measured", **UNMEASURED),
    ]
    title = f"GPU memory, legacy vs extensible KV cache: {title}"
    return _finish(fig, title, handles, 3, 0.03 * len(handles) / 3 + 0.02)


# -- KV blocks -----------------------------------------------------------------------------------------------------
def kv_blocks_figure(pairs: list[BlockPair]) -> Figure:
    """Left: the blocks of each pair on a log axis (runs of 55k and of 16M blocks side by side), each count beside
    its bar. Right: the difference in MiB, its text on the other side of zero. The legend sits below both."""
    fig = _new(WIDTH, 1.8 + 0.8 * max(len(pairs), 1))
    left, right = fig.subplots(1, 2, sharey=True)
    h = 0.38
    counts = [b.blocks for p in pairs for b in (p.legacy, p.other) if b.blocks] or [1]
    labels = []
    for i, p in enumerate(pairs):
        y = len(pairs) - 1 - i
        for dy, b, mode in ((h / 2, p.legacy, "legacy"), (-h / 2, p.other, "extensible")):
            left.barh(y + dy, b.blocks or 0, height=h, color=COLORS[mode])
            _text(left, b.blocks or min(counts), y + dy, f" {number(b.blocks)}", ha="left")
        d, db = p.delta_blocks, p.delta_bytes
        text = "not measured" if d is None else f"{d:+,} blocks (bytes per block not measured)"
        if db is not None:  # then d is measured too
            percent = "" if p.delta_percent is None else f", {p.delta_percent:+.3f} %"
            text = f"{db / MIB:+,.1f} MiB\n{d:+,} blocks{percent}"
            right.barh(y, db / MIB, height=h * 1.6, color=COLORS["over" if db < 0 else "extensible"])
        _text(right, 0, y, f" {text} ", ha="left" if db is None or db < 0 else "right")
        folder = f" ({p.legacy.case.folder})" if p.legacy.case.folder else ""
        labels.append("\n".join(textwrap.wrap(p.other.case.label, 36)) + "\nvs legacy" + folder)
    left.set_yticks([len(pairs) - 1 - i for i in range(len(pairs))], labels, fontsize=SMALL)
    left.set_xscale("log")
    left.set_xlim(min(counts) / 3, max(counts) * 40)  # room for the counts beside the longest bars
    left.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1e6:g}M" if v >= 1e6 else f"{v:,.0f}"))
    left.xaxis.set_minor_formatter(NullFormatter())
    left.set_xlabel("KV cache blocks (log scale)")
    left.set_title("blocks per run", fontsize=10)
    right.axvline(0, color="black", linewidth=0.8)
    lim = max([abs(p.delta_bytes) / MIB for p in pairs if p.delta_bytes is not None] or [1.0]) or 1.0
    right.set_xlim(-lim * 2.6, lim * 2.6)
    right.xaxis.set_major_locator(MaxNLocator(5, symmetric=True))
    right.set_xlabel("extensible - legacy KV committed (MiB)")
    right.set_title("difference (MiB; blocks and % of legacy)", fontsize=10)
    handles = [Patch(color=COLORS[k], label=k) for k in ("legacy", "extensible")]
    return _finish(fig, "KV cache blocks, legacy vs extensible (same case)", handles, 2, 0.06)
