"""Test hooks, off unless STRATA_TEST_FAULTS is set: `tokenize_delay=0.05,raise_on=TEXT`.

They plant failures and slowdowns for the server's robustness tests and the analyzer's planted
bottlenecks; parsing costs nothing when the variable is absent.
"""

from __future__ import annotations

import os
from functools import cache


@cache
def faults() -> dict[str, str]:
    spec = os.environ.get("STRATA_TEST_FAULTS", "")
    return dict(item.split("=", 1) for item in spec.split(",") if "=" in item)


def tokenize_delay() -> float:
    return float(faults().get("tokenize_delay", 0.0))


def should_raise(text: str) -> bool:
    marker = faults().get("raise_on")
    return bool(marker) and marker in text
