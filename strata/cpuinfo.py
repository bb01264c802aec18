"""This CPU's model name and feature flags from /proc/cpuinfo, read once per process.

Shared by the kernels (which pick an instruction set) and the hardware report/probe, so it
lives below both."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_model_and_flags() -> tuple[str, frozenset[str]]:
    """("model name", flags); "unknown-cpu" and no flags where /proc/cpuinfo is unreadable (e.g. macOS)."""
    name, flags = "", frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return name or "unknown-cpu", flags
