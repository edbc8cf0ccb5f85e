"""The report's plots as PNG bytes (matplotlib, Agg canvas, no pyplot state). Every axis names its unit.

Sizes are binary (GiB = 2**30 bytes, MiB = 2**20 bytes); rates are decimal (GB/s = 1e9 bytes per second), as in
``benchmarks``.
"""

from __future__ import annotations

import io
from collections import Counter

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator

from . import accounting as acc
from .accounting import BlockPair, MemoryBreakdown
from .matrix import cell_state, cell_text, matrix_cells
from .run import Conformance

DPI = 110
GIB, MIB = float(1 << 30), float(1 << 20)

SEGMENT_COLORS = {
    acc.BEFORE: "#9e9e9e", acc.WEIGHTS: "#1f77b4", acc.GRAPHS: "#9467bd",
    acc.OTHER: "#8c564b", acc.OTHER_WITH_GRAPHS: "#c49c94", acc.UNSPLIT: "#bcbd22", acc.KV: "#2ca02c",
    acc.PADDING: "#98df8a", acc.FREE: "#f2f2f2",
}
PEAK_COLOR = "#ff7f0e"
PEER_STYLES = {"peer/torch_default": ("s", "#ff7f0e"), "peer/expandable_segments": ("P", "#9467bd")}  # marker, color
ESTIMATE_COLORS = {"weights": "#1f77b4", "activation peak": "#ff7f0e", "non-torch": "#17becf",
                   "CUDA graph estimate": "#e377c2"}


def _new(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", facecolor="white")
    return buf.getvalue()


def _case_tick(b: MemoryBreakdown) -> str:
    mode = b.case.variant.replace("+", "\n+")
    return f"{mode}\n({b.case.folder})" if b.case.folder else mode


def _ticks(ax, xs: list[int], breakdowns: list[MemoryBreakdown]) -> None:
    crowded = len(xs) > 3
    ax.set_xticks(xs, [_case_tick(b) for b in breakdowns], fontsize=7.5 if crowded else 8,
                  rotation=30 if crowded else 0, ha="right" if crowded else "center",
                  rotation_mode="anchor" if crowded else "default")


def _peak_box(b: MemoryBreakdown) -> tuple[int | None, str]:
    """The activation memory still to come, drawn hatched above what is resident: the measured headroom, or the whole
    profiled peak as its upper bound where torch's reusable cache was not recorded."""
    if b.activation_headroom is not None:
        return b.activation_headroom, acc.HEADROOM
    return b.activation_peak, f"{acc.PEAK} (upper bound of what is still to come)"


def _draw_peak(ax, x: float, bottom: float, height: float) -> None:
    ax.bar(x, height, bottom=bottom, width=0.6, facecolor="none", edgecolor=PEAK_COLOR, hatch="///", linewidth=1.0)


# -- memory of one (model, runner, backend) group --------------------------------------------------------------------
def memory_stack(title: str, breakdowns: list[MemoryBreakdown]) -> bytes:
    """Left: the whole GPU per run (GiB). Middle: the non-KV part magnified (MiB). Right: memory used beyond
    gpu_memory_utilization's budget (MiB)."""
    fig = _new(14, 5.4)
    left, right, budget = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1.1, 1, 0.95]})
    xs = list(range(len(breakdowns)))
    present: list[str] = []
    peak_labels: list[str] = []
    for x, b in zip(xs, breakdowns):
        segs = b.segments()
        if segs is None:
            left.text(x, 0.5, "not measured", rotation=90, ha="center", va="bottom",
                      transform=left.get_xaxis_transform())
            continue
        bottom = 0.0
        negative = [s.label for s in segs if s.bytes is not None and s.bytes < 0]
        if negative:  # drawn as zero; the tables give the value
            left.text(x, 0.02, "negative, drawn as 0:\n" + "\n".join(negative), ha="center", va="bottom", fontsize=7,
                      color="#d62728", transform=left.get_xaxis_transform())
        used = 0.0
        for s in segs:
            height = max(s.bytes or 0, 0) / GIB
            left.bar(x, height, bottom=bottom, width=0.6, color=SEGMENT_COLORS[s.label], edgecolor="#555555",
                     linewidth=0.5)
            if s.label in (acc.KV, acc.UNSPLIT, acc.FREE) and s.bytes and s.bytes / GIB > 4:
                short = {acc.KV: "KV", acc.UNSPLIT: "KV + other", acc.FREE: "free"}[s.label]
                left.text(x, bottom + height / 2, f"{short}\n{s.bytes / GIB:.2f} GiB", ha="center", va="center",
                          fontsize=7.5)
            bottom += height
            if s.label != acc.FREE:
                used = bottom
            if s.label not in present:
                present.append(s.label)
        peak, label = _peak_box(b)
        if peak:
            _draw_peak(left, x, used, peak / GIB)
            if label not in peak_labels:
                peak_labels.append(label)
        if b.requested is not None:
            left.hlines(b.requested / GIB, x - 0.4, x + 0.4, colors="black", linestyles="dashed", linewidth=1.2)
    _ticks(left, xs, breakdowns)
    left.set_ylabel("GPU memory (GiB)")
    left.set_title("whole GPU after warmup; hatched: activation peak to come;\ndashed: requested (utilization x total)",
                   fontsize=9)
    pad = max(3 - len(xs), 0) / 2
    left.set_xlim(-0.6 - pad, len(xs) - 0.4 + pad)

    non_kv = [acc.WEIGHTS, acc.GRAPHS, acc.OTHER, acc.OTHER_WITH_GRAPHS]
    drawn, highest = 0, 0.0
    for x, b in zip(xs, breakdowns):
        segs = {s.label: s.bytes for s in (b.segments() or [])}
        if not any(k in segs for k in (acc.OTHER, acc.OTHER_WITH_GRAPHS)):
            right.text(x, 0.5, "not measured:\nKV bytes unknown, so\nnon-KV is not separable", ha="center",
                       va="center", fontsize=8, transform=right.get_xaxis_transform())
            continue
        drawn += 1
        bottom = 0.0
        for label in non_kv:
            if label not in segs:
                continue
            height = max(segs[label] or 0, 0) / MIB
            right.bar(x, height, bottom=bottom, width=0.6, color=SEGMENT_COLORS[label], edgecolor="#555555",
                      linewidth=0.5)
            bottom += height
        right.text(x, bottom / 2, f"resident\n{bottom:.1f}", ha="center", va="center", fontsize=7.5, color="white")
        peak, _ = _peak_box(b)
        top = bottom
        if peak:
            _draw_peak(right, x, bottom, peak / MIB)
            top += peak / MIB
            right.text(x, top, f"+{peak / MIB:.1f}", ha="center", va="bottom", fontsize=7.5)
        if b.non_kv_estimate is not None:
            right.hlines(b.non_kv_estimate / MIB, x - 0.4, x + 0.4, colors="black", linestyles="dotted", linewidth=1.5)
        highest = max(highest, top, b.non_kv_estimate / MIB if b.non_kv_estimate is not None else 0.0)
    _ticks(right, xs, breakdowns)
    right.set_ylabel("non-KV memory (MiB)")
    right.set_title("non-KV part magnified: resident after warmup, hatched:\nactivation peak to come; dotted: vLLM's "
                    "profiled estimate", fontsize=9)
    right.set_xlim(-0.6 - pad, len(xs) - 0.4 + pad)
    if drawn:
        right.set_ylim(0, highest * 1.1)
    else:
        right.set_yticks([])

    for x, b in zip(xs, breakdowns):
        over, at_peak = b.over_budget, b.over_budget_at_peak
        if over is None:
            budget.text(x, 0.5, "not measured", rotation=90, ha="center", va="center", fontsize=8,
                        transform=budget.get_xaxis_transform())
            continue
        for dx, value, hatch in ((-0.15, over, None), (0.15, at_peak, "///")):
            if value is None:
                budget.text(x + dx, 0.02, "at peak:\nnot measured" if hatch else "", ha="center", va="bottom",
                            fontsize=7, transform=budget.get_xaxis_transform())
                continue
            budget.bar(x + dx, value / MIB, width=0.28, color="#d62728" if value > 0 else "#2ca02c", hatch=hatch,
                       edgecolor="white" if hatch else None)
            budget.text(x + dx, value / MIB, f"{value / MIB:+.1f}", ha="center",
                        va="bottom" if value >= 0 else "top", fontsize=7.5)
    budget.axhline(0, color="black", linewidth=0.8)
    values = [v / MIB for b in breakdowns for v in (b.over_budget, b.over_budget_at_peak) if v is not None] + [0.0]
    span = max(max(values) - min(values), 1.0)
    budget.set_ylim(min(values) - 0.2 * span, max(values) + 0.2 * span)
    _ticks(budget, xs, breakdowns)
    budget.set_xlim(-0.6 - pad, len(xs) - 0.4 + pad)
    budget.set_ylabel("used beyond the requested budget (MiB)")
    budget.set_title("beyond gpu_memory_utilization (> 0: over): solid after\nwarmup, hatched with the activation peak "
                     "to come", fontsize=9)

    handles = [Patch(facecolor=SEGMENT_COLORS[k], edgecolor="#555555", label=k) for k in acc.SEGMENT_ORDER
               if k in present]
    handles += [Patch(facecolor="none", edgecolor=PEAK_COLOR, hatch="///", label=k) for k in peak_labels]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False, bbox_to_anchor=(0.5, -0.08))
    fig.suptitle(f"GPU memory, legacy vs extensible KV cache: {title}", fontsize=11)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return _png(fig)


# -- vLLM's non-KV estimate against the measurement -------------------------------------------------------------------
def non_kv_estimate(breakdowns: list[MemoryBreakdown]) -> bytes:
    rows = [b for b in breakdowns if b.non_kv_estimate is not None or b.non_kv_after_warmup is not None]
    fig = _new(11, 1.0 + 0.55 * max(len(rows), 1))
    ax = fig.subplots()
    h = 0.38
    for i, b in enumerate(rows):
        y = len(rows) - 1 - i
        if b.non_kv_estimate is not None:
            left = 0.0
            for name, color in ESTIMATE_COLORS.items():
                v = (b.non_kv_estimate_parts.get(name) or 0) / MIB
                ax.barh(y + h / 2, v, left=left, height=h, color=color, hatch="//", edgecolor="white", linewidth=0)
                left += v
            other = b.non_kv_estimate / MIB - left  # anything in the estimate that its recorded parts do not cover
            if abs(other) > 1e-6:
                ax.barh(y + h / 2, other, left=left, height=h, color="#cccccc", hatch="//", edgecolor="white")
            ax.text(b.non_kv_estimate / MIB, y + h / 2, f" {b.non_kv_estimate / MIB:.1f}", va="center", fontsize=7.5)
        else:
            ax.text(0, y + h / 2, " estimate not measured", va="center", fontsize=7.5)
        segs = {s.label: s.bytes for s in (b.segments() or [])}
        if b.non_kv_after_warmup is not None:
            left = 0.0
            for label in (acc.WEIGHTS, acc.GRAPHS, acc.OTHER, acc.OTHER_WITH_GRAPHS):
                if label in segs:
                    v = (segs[label] or 0) / MIB
                    ax.barh(y - h / 2, v, left=left, height=h, color=SEGMENT_COLORS[label], edgecolor="white",
                            linewidth=0.5)
                    left += v
            ax.text(b.non_kv_after_warmup / MIB, y - h / 2, f" {b.non_kv_after_warmup / MIB:.1f}", va="center",
                    fontsize=7.5)
        else:
            ax.text(0, y - h / 2, " measured: not measured (KV bytes unknown)", va="center", fontsize=7.5)
    ax.set_yticks([len(rows) - 1 - i for i in range(len(rows))], [b.case.label for b in rows], fontsize=8)
    ax.set_xlabel("non-KV memory (MiB)")
    ax.set_title("vLLM's profiled non-KV estimate (upper bar of each case, hatched) vs non-KV resident after "
                 "warmup (lower bar, solid)", fontsize=10)
    ax.margins(x=0.12)
    handles = [Patch(facecolor=c, hatch="//", edgecolor="white", label=f"estimate: {k}")
               for k, c in ESTIMATE_COLORS.items()]
    handles += [Patch(facecolor=SEGMENT_COLORS[k], label=f"measured: {k}")
                for k in (acc.WEIGHTS, acc.GRAPHS, acc.OTHER, acc.OTHER_WITH_GRAPHS)
                if any(k in {s.label for s in (b.segments() or [])} for b in rows)]
    ax.legend(handles=handles, fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return _png(fig)


# -- KV blocks -------------------------------------------------------------------------------------------------------
LEGACY_COLOR, EXTENSIBLE_COLOR = "#7f7f7f", "#2ca02c"


def _blocks_tick(v: float, _pos: object) -> str:
    return f"{v / 1e6:g}M" if abs(v) >= 1e6 else f"{v:,.0f}"


def kv_blocks_figure(pairs: list[BlockPair]) -> Figure:
    """Left: the blocks of each pair on a linear axis from zero, counts written inside the bars. Right: the
    difference in MiB, its text on the other side of zero. The legend sits below both."""
    fig = _new(12, 1.8 + 0.8 * max(len(pairs), 1))
    left, right = fig.subplots(1, 2, sharey=True)
    h = 0.38
    for i, p in enumerate(pairs):
        y = len(pairs) - 1 - i
        for dy, b, color in ((h / 2, p.legacy, LEGACY_COLOR), (-h / 2, p.other, EXTENSIBLE_COLOR)):
            if b.blocks is None:
                left.text(0.01, y + dy, "not measured", va="center", fontsize=7.5, transform=left.get_yaxis_transform())
                continue
            left.barh(y + dy, b.blocks, height=h, color=color)
            left.text(b.blocks, y + dy, f"{b.blocks:,} ", va="center", ha="right", fontsize=7.5, color="white")
        d, db = p.delta_blocks, p.delta_bytes
        text = ("not measured" if d is None else f"{d:+,} blocks (bytes per block not measured)" if db is None else
                f"{db / MIB:+,.1f} MiB\n{d:+,} blocks" + ("" if p.delta_percent is None else
                                                           f", {p.delta_percent:+.3f} %"))
        if db is not None:
            right.barh(y, db / MIB, height=h * 1.6, color="#d62728" if db < 0 else EXTENSIBLE_COLOR)
        right.text(0, y, f" {text} ", va="center", fontsize=7.5, ha="left" if db is None or db < 0 else "right")
    labels = [f"{p.other.case.label}\nvs legacy" + (f" ({p.legacy.case.folder})" if p.legacy.case.folder else "")
              for p in pairs]
    left.set_yticks([len(pairs) - 1 - i for i in range(len(pairs))], labels, fontsize=7.5)
    left.xaxis.set_major_locator(MaxNLocator(4))
    left.xaxis.set_major_formatter(FuncFormatter(_blocks_tick))
    left.set_xlabel("KV cache blocks")
    left.set_title("blocks per run", fontsize=10)
    right.axvline(0, color="black", linewidth=0.8)
    lim = max([abs(p.delta_bytes) / MIB for p in pairs if p.delta_bytes is not None] or [1.0]) or 1.0
    right.set_xlim(-lim * 2.6, lim * 2.6)
    right.xaxis.set_major_locator(MaxNLocator(5, symmetric=True))
    right.set_xlabel("extensible - legacy KV committed (MiB)")
    right.set_title("difference (MiB; blocks and % of legacy)", fontsize=10)
    fig.legend(handles=[Patch(color=LEGACY_COLOR, label="legacy"), Patch(color=EXTENSIBLE_COLOR, label="extensible")],
               loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle("KV cache blocks, legacy vs extensible (same model, runner and backend)", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def kv_blocks(pairs: list[BlockPair]) -> bytes:
    return _png(kv_blocks_figure(pairs))


# -- commit throughput -----------------------------------------------------------------------------------------------
def _gib_formatter(v: float, _pos: object) -> str:
    if v >= GIB:
        return f"{v / GIB:g} GiB"
    if v >= MIB:
        return f"{v / MIB:g} MiB"
    return f"{v / 1024:g} KiB"


def _commit_points(s: dict) -> list[tuple[str, float, float, int | None, str, str]]:
    """(label, bytes, GB/s, handles, marker, color) of the commit paths and the peers of summary ``s``."""
    out = []
    styles = {"per_granule": ("per-granule handles (baseline)", "v", "#d62728"),
              "single_handle": ("one handle (the driver's limit)", "D", "black"),
              "extensible": ("ExtensibleTensor 32 GiB", "*", "#2ca02c")}
    for path, p in (s.get("commit") or {}).get("paths", {}).items():
        if p.get("gbps") and p.get("bytes"):
            label, marker, color = styles.get(path, (path, "o", "grey"))
            out.append((label, float(p["bytes"]), float(p["gbps"]), p.get("handles"), marker, color))
    for p in s["peer_rows"]:
        if p["gbps"] is not None:  # bytes and seconds both recorded
            marker, color = PEER_STYLES.get(p["key"], ("o", "grey"))
            out.append((f"peer: {p['name']}", float(p["bytes"]), p["gbps"], None, marker, color))
    return out


SERIES_COLORS = ["#1f77b4", "#17becf", "#7f7f7f", "#bcbd22", "#8c564b", "#e377c2"]


def commit_throughput(source: str, s: dict) -> bytes:
    """Left: GB/s against bytes per handle. Right: GB/s against bytes committed, with the peers and the target."""
    rows = [r for r in (s.get("scaling") or {}).get("rows", []) if r.get("gbps") and r.get("bytes")]
    fig = _new(12, 6.4)
    by_handle, by_bytes = fig.subplots(1, 2, sharey=True)
    sizes = sorted({r["nominal_gib"] for r in rows})
    segs = sorted({r["segments"] for r in rows})
    for i, gib in enumerate(sizes):
        pts = sorted((r["bytes"] / r["handles"], r["gbps"]) for r in rows if r["nominal_gib"] == gib and r["handles"])
        by_handle.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=SERIES_COLORS[i % len(SERIES_COLORS)],
                       markersize=5, label=f"scaling: {gib} GiB split over {min(segs)}-{max(segs)} handles")
    for i, n in enumerate(segs):
        pts = sorted((r["bytes"], r["gbps"]) for r in rows if r["segments"] == n)
        by_bytes.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=5, linestyle="-",
                      color=SERIES_COLORS[i % len(SERIES_COLORS)], label=f"scaling: {n} segment(s) = {n} handle(s)")
    for label, nbytes, gbps, handles, marker, color in _commit_points(s):
        style = dict(marker=marker, color=color, markersize=11, markeredgecolor="black", linestyle="none",
                     label=label)
        by_bytes.plot([nbytes], [gbps], **style)
        if handles:
            by_handle.plot([nbytes / handles], [gbps], **style)
    target = next((t for t in s.get("targets", []) if t.get("name", "").startswith("commit 32 GiB, GB/s")), None)
    for ax in (by_handle, by_bytes):
        if target and target.get("target"):
            ax.axhline(target["target"], color="#d62728", linestyle="dashed", linewidth=1,
                       label=f"target {target['op']} {target['target']:g} GB/s (32 GiB commit)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(_gib_formatter))
        ax.grid(True, which="major", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8, rotation=30)
        ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    by_handle.set_xlabel("bytes per physical handle (log scale)")
    by_handle.set_ylabel("commit rate (GB/s = 1e9 bytes/s, log scale)")
    by_handle.set_title("commit rate vs handle size", fontsize=10)
    by_bytes.set_xlabel("bytes committed in one growth step (log scale)")
    by_bytes.set_title("commit rate vs bytes, with peers (torch) and limits (one handle)", fontsize=10)
    gran = _gib_formatter(s["granularity"], None) if s.get("granularity") else "not recorded"
    fig.suptitle(f"Commit throughput (zero_new=False), {source}: driver {s.get('driver')}, granularity {gran}",
                 fontsize=11)
    fig.tight_layout()
    return _png(fig)


# -- conformance matrix ----------------------------------------------------------------------------------------------
MATRIX_COLORS = {"pass": "#a1d99b", "fail": "#fc9272", "skip": "#d9d9d9", "mixed": "#fee391", "none": "white"}


def conformance_matrix(conformance: list[Conformance]) -> bytes:
    rules, columns, cells = matrix_cells(conformance)
    fig = _new(3.2 + 2.2 * max(len(columns), 1) + 3.5, 1.3 + 0.26 * max(len(rules), 1))
    ax = fig.subplots()
    for i, rule in enumerate(rules):
        for j, col in enumerate(columns):
            counts = cells.get((rule, col))
            ax.add_patch(_rect(j, i, MATRIX_COLORS[cell_state(counts)]))
            ax.text(j + 0.5, i + 0.5, cell_text(counts), ha="center", va="center",
                    fontsize=7.5)
    ax.set_xlim(0, max(len(columns), 1))
    ax.set_ylim(max(len(rules), 1), 0)
    heads = []
    for col in columns:
        total = sum((cells[(r, col)] for r in rules if (r, col) in cells), Counter())
        heads.append(f"{col}\n{total.get('passed', 0)} passed, {total.get('failed', 0)} failed, "
                     f"{total.get('skipped', 0)} skipped")
    ax.set_xticks([j + 0.5 for j in range(len(columns))], heads, fontsize=9)
    ax.xaxis.tick_top()
    ax.set_yticks([i + 0.5 for i in range(len(rules))], rules, fontsize=7.5)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    handles = [Patch(facecolor=MATRIX_COLORS[k], edgecolor="#888888", label=label) for k, label in
               (("pass", "all passed"), ("fail", "any failed"), ("skip", "all skipped"),
                ("mixed", "passed and skipped"), ("none", "not run"))]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False,
              title="cell: tests of the rule (parametrizations)", title_fontsize=8)
    ax.set_title("Conformance: driver x rule (counts are test parametrizations)", fontsize=11, pad=22)
    fig.tight_layout()
    return _png(fig)


def _rect(x: float, y: float, color: str):
    from matplotlib.patches import Rectangle  # noqa: PLC0415

    return Rectangle((x, y), 1, 1, facecolor=color, edgecolor="white", linewidth=1.5)


# -- comparison ------------------------------------------------------------------------------------------------------
def compare_commit(a_name: str, a: dict | None, b_name: str, b: dict | None) -> bytes:
    """Commit rate against bytes for both runs: the run solid and filled, the baseline dashed and hollow."""
    fig = _new(10, 5.2)
    ax = fig.subplots()
    segs = sorted({r["segments"] for bench in (a, b) if bench is not None
                   for r in bench["scaling"]["rows"]})
    colors = {n: SERIES_COLORS[i % len(SERIES_COLORS)] for i, n in enumerate(segs)}
    for name, bench, style in ((a_name, a, "-"), (b_name, b, "--")):
        if bench is None:
            continue
        rows = [r for r in bench["scaling"]["rows"] if r.get("gbps") and r.get("bytes")]
        for n in sorted({r["segments"] for r in rows}):
            pts = sorted((r["bytes"], r["gbps"]) for r in rows if r["segments"] == n)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=5, linestyle=style,
                    color=colors[n], markerfacecolor=colors[n] if style == "-" else "white",
                    label=f"{name}: scaling, {n} segment(s)")
        for label, nbytes, gbps, _h, marker, color in _commit_points(bench):
            ax.plot([nbytes], [gbps], marker=marker, linestyle="none", markersize=10, color=color,
                    markeredgecolor="black" if style == "-" else color,
                    markerfacecolor=color if style == "-" else "white", label=f"{name}: {label}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(_gib_formatter))
    ax.set_xlabel("bytes committed in one growth step (log scale)")
    ax.set_ylabel("commit rate (GB/s = 1e9 bytes/s, log scale)")
    ax.set_title(f"Commit throughput: {a_name} (solid, filled) vs {b_name} (dashed, hollow)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return _png(fig)


def compare_blocks(a_name: str, b_name: str, rows: list[tuple[str, int | None, int | None]]) -> bytes:
    """KV blocks per case, run against baseline: the difference in % of the baseline, with both counts written
    out. ``rows`` = (case key, blocks in the run, blocks in the baseline)."""
    fig = _new(11, 1.3 + 0.42 * max(len(rows), 1))
    ax = fig.subplots()
    where = ax.get_yaxis_transform()  # x in axes fraction, y in data
    for i, (key, va, vb) in enumerate(rows):
        y = len(rows) - 1 - i
        if va is None or vb is None or not vb:
            ax.text(1.01, y, f"{_count(vb)} -> {_count(va)} blocks: no delta", va="center", fontsize=7.5,
                    transform=where)
            continue
        pct = (va - vb) / vb * 100.0
        ax.barh(y, pct, height=0.6, color="#d62728" if pct < 0 else "#2ca02c")
        ax.text(1.01, y, f"{vb:,} -> {va:,} blocks ({va - vb:+,}, {pct:+.3f} %)", va="center", fontsize=7.5,
                transform=where)
    ax.set_yticks([len(rows) - 1 - i for i in range(len(rows))], [r[0] for r in rows], fontsize=7.5)
    ax.axvline(0, color="black", linewidth=0.8)
    lim = max([abs((va - vb) / vb * 100.0) for _k, va, vb in rows if va is not None and vb] or [1.0]) or 1.0
    ax.set_xlim(-lim * 1.3, lim * 1.3)
    ax.set_xlabel(f"KV blocks, {a_name} - {b_name} (% of {b_name})")
    ax.set_title(f"KV cache blocks per vLLM case: {a_name} vs {b_name} (text: baseline -> run)", fontsize=10)
    fig.tight_layout()
    return _png(fig)


def _count(n: int | None) -> str:
    return "not measured" if n is None else f"{n:,}"
