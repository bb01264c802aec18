"""The HTML reports' charts, drawn by matplotlib (SVG backend) and inlined as <svg> elements.

Shared by `strata plan --html` and `strata analyze --html`. matplotlib lays out ticks, labels and
legends itself (constrained layout, legends outside the axes), so nothing is placed by hand and no
label runs past the picture's edge. Text stays text (svg.fonttype none: selectable, small, and a
test can measure every label in a browser). Figures are built without pyplot: no global state,
no GUI backend, safe in a server process.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable, Sequence

# Tableau 10 and two more: the time split has 11 categories, and no two may share a colour
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f",
           "#ff9da7", "#bab0ac", "#17becf", "#bcbd22", "#3b2a8c")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
STYLE = {"svg.fonttype": "none", "svg.hashsalt": "strata", "font.family": ["DejaVu Sans", "sans-serif"],
         "font.size": 9, "axes.titlesize": 10, "axes.titleweight": "bold"}
WIDTH_IN = 7.0  # 672 px at 96 dpi: the reports' column
FEW_SAMPLES = 8  # below this, a distribution is drawn as its samples, not as a histogram


def _figure(height_in: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(WIDTH_IN, height_in), layout="constrained")


def _to_svg(fig, title: str) -> str:
    """The figure as one <svg> element (no XML prolog or DOCTYPE), with an accessible title."""
    import matplotlib
    from matplotlib.backends.backend_svg import FigureCanvasSVG

    buf = io.StringIO()
    with matplotlib.rc_context(STYLE):
        FigureCanvasSVG(fig).print_svg(buf, metadata={"Date": None, "Creator": None})
    text = buf.getvalue()
    svg = re.sub(r"\s*<metadata>.*?</metadata>", "", text[text.index("<svg"):], count=1, flags=re.S)  # RDF
    from html import escape

    return re.sub(r"(<svg\b[^>]*>)", lambda m: f'{m.group(1)}<title>{escape(title)}</title>', svg, count=1)


def _draw(height_in: float, title: str, paint: Callable) -> str:
    import matplotlib

    with matplotlib.rc_context(STYLE):
        fig = _figure(height_in)
        paint(fig)
        return _to_svg(fig, title)


def _legend(fig, handles: list, labels: list[str], max_cols: int = 3) -> None:
    """A legend under the axes with as many columns as fit the figure's width (constrained layout
    makes room below, but never narrows a legend that is too wide: measure and drop columns)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    for ncols in range(max(1, min(max_cols, len(labels))), 0, -1):
        legend = fig.legend(handles, labels, loc="outside lower center", ncols=ncols, frameon=False)
        canvas.draw()
        box = legend.get_window_extent(canvas.get_renderer())
        if ncols == 1 or (box.x0 >= 2 and box.x1 <= fig.bbox.width - 2):
            return
        legend.remove()


def fmt_si(v: float, unit: str = "") -> str:
    """1e12 -> "1T"; with a unit, 989.5e12 -> "989.5 TFLOP/s"."""
    sep = " " if unit else ""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.4g}{sep}{prefix}{unit}"
    return f"{v:.4g}{sep}{unit}"


def roofline(ceilings: Sequence[tuple[str, float]], bandwidths: Sequence[tuple[str, float]],
             points: Sequence[tuple[str, float, float]], title: str = "Roofline") -> str:
    """Attainable FLOP/s vs arithmetic intensity (FLOP/byte), log-log.

    ceilings: (label, FLOP/s) compute roofs; bandwidths: (label, bytes/s) memory roofs, each drawn
    as min(roof, intensity x bandwidth) against the highest compute roof; points: (label,
    intensity, achieved FLOP/s). Labels are shown as given (callers put the figure in them once).
    """
    if not ceilings or not bandwidths:
        raise ValueError("a roofline needs at least one compute ceiling and one bandwidth")
    shown = [(label, x, y) for label, x, y in points if x > 0 and y > 0]
    top = max(c for _, c in ceilings)
    xs = [x for _, x, _ in shown] + [top / b for _, b in bandwidths] + [min(c for _, c in ceilings) / max(
        b for _, b in bandwidths)]
    x_lo, x_hi = 10 ** math.floor(math.log10(min(xs) / 2)), 10 ** math.ceil(math.log10(max(xs) * 2))

    def paint(fig) -> None:
        import numpy as np
        from matplotlib.ticker import FuncFormatter

        ax = fig.add_subplot()
        grid = np.geomspace(x_lo, x_hi, 256)
        for i, (label, roof) in enumerate(sorted(ceilings, key=lambda c: -c[1])):
            ax.axhline(roof, color="#333", lw=1.2, ls="-" if i == 0 else "--", label=label)
        for i, (label, bw) in enumerate(bandwidths):
            ax.plot(grid, np.minimum(grid * bw, top), color="#777", lw=1.2, ls="-" if i == 0 else ":",
                    label=label)
        for i, (label, x, y) in enumerate(shown):
            ax.scatter([x], [y], s=36, zorder=3, color=PALETTE[i % len(PALETTE)],
                       marker=MARKERS[(i // len(PALETTE)) % len(MARKERS)], label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(x_lo, x_hi)
        ys = [y for _, _, y in shown] + [x_lo * min(b for _, b in bandwidths)]
        ax.set_ylim(10 ** math.floor(math.log10(min(ys) / 2)), 10 ** math.ceil(math.log10(top * 2)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_si(v)))
        ax.set_xlabel("arithmetic intensity (FLOP/byte)")
        ax.set_ylabel("attainable FLOP/s")
        ax.set_title(title)
        ax.grid(True, which="major", color="#eee")
        _legend(fig, *ax.get_legend_handles_labels())

    rows = -(-(len(ceilings) + len(bandwidths) + len(shown)) // 3)
    return _draw(3.8 + 0.2 * rows, title, paint)


def stacked_bar(segments: Sequence[tuple[str, float]], total: float | None = None, title: str = "",
                fmt: Callable[[float], str] | None = None) -> str:
    """One horizontal bar split into segments (values >= 0) scaled to `total` (default their sum);
    the legend under it names each segment with its value and share, largest first."""
    fmt = fmt or (lambda v: f"{v:g}")
    vals = [(label, max(0.0, v)) for label, v in segments]
    total = total or sum(v for _, v in vals) or 1.0

    def paint(fig) -> None:
        ax = fig.add_subplot()
        left = 0.0
        for i, (label, v) in enumerate(vals):
            ax.barh([0], [v], left=left, height=0.6, color=PALETTE[i % len(PALETTE)], edgecolor="white",
                    label=f"{label}: {fmt(v)} ({v / total:.0%})")
            left += v
        ax.set_xlim(0, total)
        ax.set_yticks([])
        ax.set_title(title)
        for side in ("left", "right", "top"):
            ax.spines[side].set_visible(False)
        ax.xaxis.set_major_formatter(_value_formatter(fmt))
        handles, labels = ax.get_legend_handles_labels()
        order = sorted(range(len(vals)), key=lambda i: -vals[i][1])
        _legend(fig, [handles[i] for i in order], [labels[i] for i in order])

    return _draw(1.5 + 0.22 * -(-len(vals) // 3), title or "bar", paint)


def _value_formatter(fmt: Callable[[float], str]):
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: fmt(v) if v > 0 else "0")


def distribution(values: Sequence[float], title: str, unit: str = "ms") -> str:
    """Latencies as a histogram with a count axis; a handful of samples are drawn one by one
    (a histogram of one value is a bar that says nothing)."""
    vals = sorted(v for v in values if math.isfinite(v))

    def paint(fig) -> None:
        ax = fig.add_subplot()
        ax.set_title(f"{title} ({len(vals)} sample{'s' if len(vals) != 1 else ''})")
        ax.set_xlabel(unit)
        if not vals:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
        elif len(vals) < FEW_SAMPLES:
            ax.scatter(vals, [0] * len(vals), s=40, color=PALETTE[0], zorder=3)
            for v in vals:
                ax.annotate(f"{v:.1f}", (v, 0), xytext=(0, 8), textcoords="offset points", ha="center")
            lo, hi = vals[0], vals[-1]
            pad = (hi - lo) * 0.15 or max(abs(lo) * 0.1, 1.0)
            ax.set_xlim(lo - pad, hi + pad)
            ax.set_ylim(-1, 2)
            ax.set_yticks([])
            for side in ("left", "right", "top"):
                ax.spines[side].set_visible(False)
        else:
            ax.hist(vals, bins=min(30, max(5, int(math.sqrt(len(vals))) * 2)), color=PALETTE[0], edgecolor="white")
            ax.set_ylabel("requests")
            p50, p99 = vals[len(vals) // 2], vals[min(len(vals) - 1, math.ceil(0.99 * len(vals)) - 1)]
            for q, v, ls in (("p50", p50, "--"), ("p99", p99, ":")):
                ax.axvline(v, color="#333", ls=ls, lw=1, label=f"{q} {v:.1f} {unit}")
            _legend(fig, *ax.get_legend_handles_labels(), max_cols=2)

    return _draw(2.2, title, paint)
