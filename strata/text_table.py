"""Plain-text tables for reports at every layer (benchmarks, the decode hotspot profile, the analyzer)."""

from __future__ import annotations

import math
import sys
from typing import Any, TextIO


def fmt(v: Any) -> str:
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        return f"{v:.3g}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


def fmt_bytes(n: float) -> str:
    """1536 -> "1.5 KiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def print_table(headers: list[str], rows: list[list[Any]], file: TextIO | None = None) -> None:
    """Right-aligned plain-text table (first column left-aligned), on stdout by default."""
    file = file or sys.stdout
    cells = [headers] + [[fmt(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    print(line(headers), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for r in cells[1:]:
        print(line(r), file=file)
