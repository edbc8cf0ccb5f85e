"""The report's plots as PNG bytes (matplotlib, Agg canvas, no pyplot state). Every axis names its unit; sizes are
binary (GiB, MiB), rates decimal (GB/s = 1e9 bytes per second)."""

from __future__ import annotations

import io

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator

from . import accounting as acc
from .accounting import BlockPair, MemoryBreakdown
from .numbers import GIB, MIB, number

DPI, SMALL = 110, 7.5
COLORS = {acc.BEFORE: "#9e9e9e", acc.WEIGHTS: "#1f77b4", acc.GRAPHS: "#9467bd", acc.OTHER: "#8c564b",
          acc.OTHER_WITH_GRAPHS: "#c49c94", acc.UNSPLIT: "#bcbd22", acc.KV: "#2ca02c", acc.PADDING: "#98df8a",
          acc.FREE: "#f2f2f2", "legacy": "#7f7f7f", "extensible": "#2ca02c", "peak": "#ff7f0e", "worse": "#d62728"}
SERIES = ["#1f77b4", "#17becf", "#7f7f7f", "#bcbd22", "#8c564b", "#e377c2"]


def _new(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", facecolor="white")
    return buf.getvalue()


def _note(ax, x: float, text: str, y: float = 0.5, **kw) -> None:
    """Text at data x, axes-fraction y (where a bar is missing)."""
    ax.text(x, y, text, ha="center", va="center", fontsize=SMALL, transform=ax.get_xaxis_transform(), **kw)


def _cases_axis(ax, breakdowns: list[MemoryBreakdown]) -> None:
    crowded = len(breakdowns) > 3
    ticks = [b.case.variant.replace("+", "\n+") + (f"\n({b.case.folder})" if b.case.folder else "")
             for b in breakdowns]
    ax.set_xticks(range(len(ticks)), ticks, fontsize=SMALL if crowded else 8, rotation=30 if crowded else 0,
                  ha="right" if crowded else "center", rotation_mode="anchor" if crowded else "default")
    pad = max(3 - len(ticks), 0) / 2
    ax.set_xlim(-0.6 - pad, len(ticks) - 0.4 + pad)


# -- memory of one (model, runner, backend) group ------------------------------------------------------------------
def memory_stack(title: str, breakdowns: list[MemoryBreakdown]) -> bytes:
    """Left: the whole GPU per run (GiB), the activation peak to come hatched on top. Right: memory used beyond
    gpu_memory_utilization's budget (MiB), after warmup and with that peak."""
    fig = _new(12, 5.4)
    whole, budget = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.15, 1]})
    present, peaks = {}, {}
    for x, b in enumerate(breakdowns):
        segs = b.segments()
        if segs is None:
            _note(whole, x, "not measured", rotation=90)
        negative = [s.label for s in segs or [] if s.bytes is not None and s.bytes < 0]
        if negative:  # drawn as zero; the tables give the value
            _note(whole, x, "negative, drawn as 0:\n" + "\n".join(negative), y=0.1, color=COLORS["worse"])
        bottom = used = 0.0
        for s in segs or []:
            present[s.label] = None
            height = max(s.bytes or 0, 0) / GIB
            whole.bar(x, height, bottom=bottom, width=0.6, color=COLORS[s.label], edgecolor="#555555", linewidth=0.5)
            short = {acc.KV: "KV", acc.UNSPLIT: "KV + other", acc.FREE: "free"}.get(s.label)
            if short and s.bytes and s.bytes > 4 * GIB:
                whole.text(x, bottom + height / 2, f"{short}\n{s.bytes / GIB:.2f} GiB", ha="center", va="center",
                           fontsize=SMALL)
            bottom += height
            used = bottom if s.label != acc.FREE else used
        # the activation memory still to come: measured at the peak, or the whole profiled peak as its estimate
        peak, label = ((b.activation_headroom, acc.HEADROOM) if b.activation_headroom is not None else
                       (b.activation_peak, f"{acc.PEAK} (estimate: no measured peak)"))
        if segs and peak:
            whole.bar(x, peak / GIB, bottom=used, width=0.6, facecolor="none", edgecolor=COLORS["peak"], hatch="///")
            peaks[label] = None
        if segs and b.requested is not None:
            whole.hlines(b.requested / GIB, x - 0.4, x + 0.4, colors="black", linestyles="dashed")
        if b.over_budget is None:
            _note(budget, x, "not measured", rotation=90)
        for dx, value, hatch in ((-0.15, b.over_budget, None), (0.15, b.over_budget_at_peak, "///")):
            if value is None and hatch and b.over_budget is not None:
                _note(budget, x + dx, "at peak:\nnot\nmeasured", y=0.9)
            elif value is not None:
                budget.bar(x + dx, value / MIB, width=0.28, color=COLORS["worse" if value > 0 else "extensible"],
                           hatch=hatch, edgecolor="white" if hatch else None)
                budget.text(x + dx, value / MIB, f"{value / MIB:+.1f}", ha="center", fontsize=SMALL,
                            va="bottom" if value >= 0 else "top")
    values = [v / MIB for b in breakdowns for v in (b.over_budget, b.over_budget_at_peak) if v is not None] + [0.0]
    span = max(max(values) - min(values), 1.0)
    budget.set_ylim(min(values) - 0.2 * span, max(values) + 0.2 * span)
    budget.axhline(0, color="black", linewidth=0.8)
    for ax, ylabel, heading in (
            (whole, "GPU memory (GiB)",
             "whole GPU after warmup; hatched: activation peak to come;\ndashed: requested (utilization x total)"),
            (budget, "used beyond the requested budget (MiB)",
             "beyond gpu_memory_utilization (> 0: over): solid after\nwarmup, hatched with the peak to come")):
        _cases_axis(ax, breakdowns)
        ax.set_ylabel(ylabel)
        ax.set_title(heading, fontsize=9)
    handles = [Patch(facecolor=COLORS[k], edgecolor="#555555", label=k) for k in acc.SEGMENT_ORDER if k in present]
    handles += [Patch(facecolor="none", edgecolor=COLORS["peak"], hatch="///", label=k) for k in peaks]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False, bbox_to_anchor=(0.5, -0.1))
    fig.suptitle(f"GPU memory, legacy vs extensible KV cache: {title}", fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return _png(fig)


# -- KV blocks -----------------------------------------------------------------------------------------------------
def kv_blocks_figure(pairs: list[BlockPair]) -> Figure:
    """Left: the blocks of each pair on a linear axis from zero, counts written inside the bars. Right: the
    difference in MiB, its text on the other side of zero. The legend sits below both."""
    fig = _new(12, 1.8 + 0.8 * max(len(pairs), 1))
    left, right = fig.subplots(1, 2, sharey=True)
    h = 0.38
    most = max([b.blocks or 0 for p in pairs for b in (p.legacy, p.other)] + [1])
    for i, p in enumerate(pairs):
        y = len(pairs) - 1 - i
        for dy, b, mode in ((h / 2, p.legacy, "legacy"), (-h / 2, p.other, "extensible")):
            left.barh(y + dy, b.blocks or 0, height=h, color=COLORS[mode])
            inside = (b.blocks or 0) > most / 3  # short bars carry their count beside them
            left.text(b.blocks or 0, y + dy, f" {number(b.blocks)} " if b.blocks is not None else " not measured",
                      va="center", ha="right" if inside else "left", fontsize=SMALL,
                      color="white" if inside else "black")
        d, db = p.delta_blocks, p.delta_bytes
        text = ("not measured" if d is None else f"{d:+,} blocks (bytes per block not measured)" if db is None else
                f"{db / MIB:+,.1f} MiB\n{d:+,} blocks" + ("" if p.delta_percent is None else
                                                          f", {p.delta_percent:+.3f} %"))
        if db is not None:
            right.barh(y, db / MIB, height=h * 1.6, color=COLORS["worse" if db < 0 else "extensible"])
        right.text(0, y, f" {text} ", va="center", fontsize=SMALL, ha="left" if db is None or db < 0 else "right")
    labels = [f"{p.other.case.label}\nvs legacy" + (f" ({p.legacy.case.folder})" if p.legacy.case.folder else "")
              for p in pairs]
    left.set_yticks([len(pairs) - 1 - i for i in range(len(pairs))], labels, fontsize=SMALL)
    left.xaxis.set_major_locator(MaxNLocator(4))
    left.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1e6:g}M" if v >= 1e6 else f"{v:,.0f}"))
    left.set_xlabel("KV cache blocks")
    left.set_title("blocks per run", fontsize=10)
    right.axvline(0, color="black", linewidth=0.8)
    lim = max([abs(p.delta_bytes) / MIB for p in pairs if p.delta_bytes is not None] or [1.0]) or 1.0
    right.set_xlim(-lim * 2.6, lim * 2.6)
    right.xaxis.set_major_locator(MaxNLocator(5, symmetric=True))
    right.set_xlabel("extensible - legacy KV committed (MiB)")
    right.set_title("difference (MiB; blocks and % of legacy)", fontsize=10)
    fig.legend(handles=[Patch(color=COLORS[k], label=k) for k in ("legacy", "extensible")], loc="lower center",
               ncol=2, fontsize=8, frameon=False)
    fig.suptitle("KV cache blocks, legacy vs extensible (same case)", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def kv_blocks(pairs: list[BlockPair]) -> bytes:
    return _png(kv_blocks_figure(pairs))


# -- commit throughput ---------------------------------------------------------------------------------------------
def _size_tick(v: float, _pos: object) -> str:
    return f"{v / GIB:g} GiB" if v >= GIB else f"{v / MIB:g} MiB" if v >= MIB else f"{v / 1024:g} KiB"


def _commit_points(s: dict) -> list[tuple[str, float, float, int | None, str, str]]:
    """(label, bytes, GB/s, handles, marker, color) of the commit paths and the peers of summary ``s``."""
    styles = {"per_granule": ("per-granule handles (baseline)", "v", "#d62728"),
              "single_handle": ("one handle (the driver's limit)", "D", "black"),
              "extensible": ("ExtensibleTensor 32 GiB", "*", "#2ca02c"),
              "peer/torch_default": (None, "s", "#ff7f0e"), "peer/expandable_segments": (None, "P", "#9467bd")}
    out = [(styles[path][0], p["bytes"], p["gbps"], p["handles"], *styles[path][1:])
           for path, p in s["commit"]["paths"].items() if p["gbps"] and p["bytes"]]
    return out + [(f"peer: {p['name']}", p["bytes"], p["gbps"], None, *styles[p["key"]][1:])
                  for p in s["peer_rows"] if p["gbps"] is not None]


def commit_throughput(source: str, s: dict) -> bytes:
    """Left: GB/s against bytes per handle. Right: GB/s against bytes committed, with the peers and the target."""
    rows = [r for r in s["scaling"]["rows"] if r["gbps"] and r["bytes"] and r["handles"]]
    fig = _new(12, 6.4)
    by_handle, by_bytes = fig.subplots(1, 2, sharey=True)
    segs = sorted({r["segments"] for r in rows}) or [0]
    for i, gib in enumerate(sorted({r["nominal_gib"] for r in rows})):
        pts = sorted((r["bytes"] / r["handles"], r["gbps"]) for r in rows if r["nominal_gib"] == gib)
        by_handle.plot(*zip(*pts), "o-", color=SERIES[i % 6], markersize=5,
                       label=f"scaling: {gib} GiB split over {segs[0]}-{segs[-1]} handles")
    for i, n in enumerate(segs if rows else []):
        pts = sorted((r["bytes"], r["gbps"]) for r in rows if r["segments"] == n)
        by_bytes.plot(*zip(*pts), "o-", markersize=5, color=SERIES[i % 6], label=f"scaling: {n} segment(s)")
    for label, nbytes, gbps, handles, marker, color in _commit_points(s):
        style = dict(marker=marker, color=color, markersize=11, markeredgecolor="black", linestyle="none", label=label)
        by_bytes.plot([nbytes], [gbps], **style)
        if handles:
            by_handle.plot([nbytes / handles], [gbps], **style)
    target = next((t for t in s["targets"] if t["name"].startswith("commit 32 GiB, GB/s")), None)
    for ax, xlabel in ((by_handle, "bytes per physical handle"), (by_bytes, "bytes committed in one growth step")):
        if target:
            ax.axhline(target["target"], color="#d62728", linestyle="dashed", linewidth=1,
                       label=f"target {target['op']} {target['target']:g} GB/s (32 GiB commit)")
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel=f"{xlabel} (log scale)")
        ax.xaxis.set_major_formatter(FuncFormatter(_size_tick))
        ax.grid(True, alpha=0.3)
        ax.tick_params(axis="x", labelsize=8, rotation=30)
        ax.legend(fontsize=SMALL, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    by_handle.set_ylabel("commit rate (GB/s = 1e9 bytes/s, log scale)")
    by_handle.set_title("commit rate vs handle size", fontsize=10)
    by_bytes.set_title("commit rate vs bytes, with peers (torch) and limits (one handle)", fontsize=10)
    gran = _size_tick(s["granularity"], None) if s["granularity"] else "not recorded"
    fig.suptitle(f"Commit throughput (zero_new=False), {source}: driver {s['driver']}, granularity {gran}",
                 fontsize=11)
    fig.tight_layout()
    return _png(fig)
