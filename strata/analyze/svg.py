"""Small inline-SVG charts (no external assets): a log-log roofline and a horizontal stacked bar.

Shared by `strata plan --html` and the later `strata analyze` report; every function returns one
self-contained <svg> element as a string.
"""

from __future__ import annotations

import math
from html import escape

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f")
FONT = 'font-family="sans-serif" font-size="11"'


def _fmt_si(v: float, unit: str = "") -> str:
    """1e12 -> "1T"; with a unit, 989.5e12 -> "989.5 TFLOP/s"."""
    sep = " " if unit else ""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.4g}{sep}{prefix}{unit}"
    return f"{v:.4g}{sep}{unit}"


def roofline(
    ceilings: list[tuple[str, float]],
    bandwidths: list[tuple[str, float]],
    points: list[tuple[str, float, float]],
    width: int = 640,
    height: int = 400,
    title: str = "Roofline",
) -> str:
    """Attainable FLOP/s vs arithmetic intensity (FLOP/byte), log-log.

    ceilings: (label, FLOP/s) compute roofs; bandwidths: (label, bytes/s) memory roofs, each drawn
    as min(roof, intensity x bandwidth) against the highest compute roof; points: (label,
    intensity, achieved FLOP/s).
    """
    if not ceilings or not bandwidths:
        raise ValueError("a roofline needs at least one compute ceiling and one bandwidth")
    top = max(c for _, c in ceilings)
    ridge_hi = max(top / b for _, b in bandwidths)
    xs = [p[1] for p in points if p[1] > 0] + [ridge_hi, min(c for _, c in ceilings) / max(b for _, b in bandwidths)]
    x_lo = 10 ** math.floor(math.log10(min(xs) / 2))
    x_hi = 10 ** math.ceil(math.log10(max(xs) * 2))
    ys = [p[2] for p in points if p[2] > 0] + [x_lo * min(b for _, b in bandwidths), top]
    y_lo = 10 ** math.floor(math.log10(min(ys) / 2))
    y_hi = 10 ** math.ceil(math.log10(top * 2))
    ml, mr, mt, mb = 64, 16, 28, 44
    pw, ph = width - ml - mr, height - mt - mb

    def px(x: float) -> float:
        return ml + pw * (math.log10(x) - math.log10(x_lo)) / (math.log10(x_hi) - math.log10(x_lo))

    def py(y: float) -> float:
        return mt + ph * (1 - (math.log10(y) - math.log10(y_lo)) / (math.log10(y_hi) - math.log10(y_lo)))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img">',
           f'<title>{escape(title)}</title>',
           f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>',
           f'<text x="{ml}" y="16" {FONT} font-weight="bold">{escape(title)}</text>']
    for e in range(int(math.log10(x_lo)), int(math.log10(x_hi)) + 1):
        x = px(10**e)
        out.append(f'<line x1="{x:.1f}" y1="{mt}" x2="{x:.1f}" y2="{mt + ph}" stroke="#eee"/>')
        out.append(f'<text x="{x:.1f}" y="{mt + ph + 14}" {FONT} text-anchor="middle">{_fmt_si(10**e)}</text>')
    for e in range(int(math.log10(y_lo)), int(math.log10(y_hi)) + 1):
        y = py(10**e)
        out.append(f'<line x1="{ml}" y1="{y:.1f}" x2="{ml + pw}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{ml - 4}" y="{y + 4:.1f}" {FONT} text-anchor="end">{_fmt_si(10**e)}</text>')
    out.append(f'<text x="{ml + pw / 2}" y="{height - 8}" {FONT} text-anchor="middle">'
               'arithmetic intensity (FLOP/byte)</text>')
    out.append(f'<text x="14" y="{mt + ph / 2}" {FONT} text-anchor="middle" '
               f'transform="rotate(-90 14 {mt + ph / 2})">attainable FLOP/s</text>')
    for i, (label, roof) in enumerate(sorted(ceilings, key=lambda c: -c[1])):
        y = py(roof)
        out.append(f'<line x1="{ml}" y1="{y:.1f}" x2="{ml + pw}" y2="{y:.1f}" stroke="#333" '
                   f'stroke-dasharray="{"none" if i == 0 else "4 3"}"/>')
        out.append(f'<text x="{ml + 4}" y="{y - 4:.1f}" {FONT}>'
                   f'{escape(label)} {_fmt_si(roof, "FLOP/s")}</text>')
    for i, (label, bw) in enumerate(bandwidths):
        x_ridge = top / bw
        x0, x1 = x_lo, min(x_ridge, x_hi)
        out.append(f'<line x1="{px(x0):.1f}" y1="{py(x0 * bw):.1f}" x2="{px(x1):.1f}" y2="{py(x1 * bw):.1f}" '
                   f'stroke="#333" stroke-dasharray="{"none" if i == 0 else "4 3"}"/>')
        # labels staggered along their lines (and the odd ones under theirs) so they never collide
        xl = x_lo * (x1 / x_lo) ** (0.08 + 0.45 * (i % 2))
        lx, ly = px(xl) + 4, py(xl * bw) + (14 if i % 2 else -6)
        out.append(f'<text x="{lx:.1f}" y="{ly:.1f}" {FONT} '
                   f'transform="rotate({-_slope_deg(px, py, x_lo, x_hi, bw):.1f} {lx:.1f} {ly:.1f})">'
                   f'{escape(label)} {_fmt_si(bw, "B/s")}</text>')
    # points carry a short number; a legend in the lower-right corner names them (inline labels of
    # batch 1, 2, 4, ... collide on log axes)
    shown = [(label, x, y) for label, x, y in points if x > 0 and y > 0]
    for i, (label, x, y) in enumerate(shown):
        color = PALETTE[i % len(PALETTE)]
        out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="4" fill="{color}"><title>{escape(label)}: '
                   f'{x:.3g} FLOP/B, {_fmt_si(y, "FLOP/s")}</title></circle>')
        out.append(f'<text x="{px(x):.1f}" y="{py(y) - 7:.1f}" {FONT} text-anchor="middle" fill="{color}">'
                   f'{i + 1}</text>')
    if shown:
        row = 14
        lw = 12 + 6.5 * max(len(label) + 4 for label, _, _ in shown)
        lx, ly = ml + pw - lw - 6, mt + ph - row * len(shown) - 10
        out.append(f'<rect x="{lx:.1f}" y="{ly:.1f}" width="{lw:.1f}" height="{row * len(shown) + 6}" '
                   'fill="white" stroke="#ccc"/>')
        for i, (label, _, _) in enumerate(shown):
            color = PALETTE[i % len(PALETTE)]
            y = ly + row * (i + 1)
            out.append(f'<circle cx="{lx + 8:.1f}" cy="{y - 4:.1f}" r="3.5" fill="{color}"/>')
            out.append(f'<text x="{lx + 16:.1f}" y="{y:.1f}" {FONT}>{i + 1}  {escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _slope_deg(px, py, x_lo: float, x_hi: float, bw: float) -> float:
    """On-screen angle of a bandwidth line (the same for every bw on log-log axes)."""
    dx = px(x_hi) - px(x_lo)
    dy = py(x_lo * bw) - py(x_hi * bw)
    return math.degrees(math.atan2(dy, dx))


def stacked_bar(
    segments: list[tuple[str, float]], total: float | None = None, width: int = 640, height: int = 76,
    title: str = "", fmt=None,
) -> str:
    """One horizontal bar split into labelled segments (values >= 0), scaled to `total` (default
    their sum); a legend row under the bar."""
    fmt = fmt or (lambda v: f"{v:g}")
    vals = [(label, max(0.0, v)) for label, v in segments]
    total = total or sum(v for _, v in vals) or 1.0
    ml, bar_y, bar_h = 8, 22, 22
    pw = width - 2 * ml
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img">', f'<title>{escape(title)}</title>',
           f'<text x="{ml}" y="14" {FONT} font-weight="bold">{escape(title)}</text>',
           f'<rect x="{ml}" y="{bar_y}" width="{pw}" height="{bar_h}" fill="#f4f4f4" stroke="#999"/>']
    x = float(ml)
    legend_x = float(ml)
    for i, (label, v) in enumerate(vals):
        w = pw * min(v, total) / total
        color = PALETTE[i % len(PALETTE)]
        if w > 0:
            out.append(f'<rect x="{x:.1f}" y="{bar_y}" width="{w:.1f}" height="{bar_h}" fill="{color}">'
                       f'<title>{escape(label)}: {escape(fmt(v))}</title></rect>')
        x += w
        text = f"{label} {fmt(v)}"
        out.append(f'<rect x="{legend_x:.1f}" y="{bar_y + bar_h + 10}" width="10" height="10" fill="{color}"/>')
        out.append(f'<text x="{legend_x + 14:.1f}" y="{bar_y + bar_h + 19}" {FONT}>{escape(text)}</text>')
        legend_x += 14 + 6.2 * len(text) + 12
    out.append("</svg>")
    return "\n".join(out)
