"""This CPU's model name and feature flags from /proc/cpuinfo, read once per process.

Shared by the kernels (which pick an instruction set) and the hardware report/probe, so it
lives below both."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def _first_cpu() -> dict[str, str]:
    """Each key's first value in /proc/cpuinfo: the first processor's, or a file-wide line's where
    the platform puts it elsewhere ({} where unreadable, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


@functools.cache
def cpu_model_and_flags() -> tuple[str, frozenset[str]]:
    """("model name", flags); "unknown-cpu" and no flags where /proc/cpuinfo is unreadable (e.g. macOS)."""
    fields = _first_cpu()
    return fields.get("model name") or "unknown-cpu", frozenset(fields.get("flags", "").split())


# (vendor, family, first model, last model, name): a VM often reports only "AMD EPYC" as the model
# name, and the dev machines change CPU between sessions, so figures name the core by its numbers.
_MICROARCHITECTURES = (
    ("AuthenticAMD", 23, 0x00, 0x2F, "Zen / Zen+"),
    ("AuthenticAMD", 23, 0x30, 0xFF, "Zen 2"),
    ("AuthenticAMD", 25, 0x00, 0x0F, "Zen 3 (Milan)"),
    ("AuthenticAMD", 25, 0x10, 0x1F, "Zen 4 (Genoa)"),
    ("AuthenticAMD", 25, 0x20, 0x5F, "Zen 3"),
    ("AuthenticAMD", 25, 0x60, 0x7F, "Zen 4"),
    ("AuthenticAMD", 25, 0xA0, 0xAF, "Zen 4c (Bergamo / Siena)"),
    ("AuthenticAMD", 26, 0x00, 0x1F, "Zen 5 (Turin)"),
    ("AuthenticAMD", 26, 0x20, 0x7F, "Zen 5"),
    ("GenuineIntel", 6, 0x55, 0x55, "Skylake-SP / Cascade Lake"),
    ("GenuineIntel", 6, 0x6A, 0x6A, "Ice Lake-SP"),
    ("GenuineIntel", 6, 0x8F, 0x8F, "Sapphire Rapids"),
    ("GenuineIntel", 6, 0xAD, 0xAD, "Granite Rapids"),
    ("GenuineIntel", 6, 0xCF, 0xCF, "Emerald Rapids"),
)


def microarchitecture(vendor: str, family: int, model: int) -> str:
    """The core's name for a /proc/cpuinfo vendor_id, cpu family and model ("" where not known)."""
    return next((n for v, f, lo, hi, n in _MICROARCHITECTURES if (v, f) == (vendor, family) and lo <= model <= hi), "")


@functools.cache
def cpu_identity() -> dict[str, object]:
    """Vendor, family, model and the microarchitecture they name ("" where not in the table), from
    /proc/cpuinfo; e.g. {"vendor": "AuthenticAMD", "family": 26, "model": 2, "microarchitecture":
    "Zen 5 (Turin)", "label": "family 26 model 2 = Zen 5 (Turin)"}. Empty values where unreadable."""
    fields = _first_cpu()
    vendor, family, model = fields.get("vendor_id", ""), fields.get("cpu family", ""), fields.get("model", "")
    family = int(family) if family.isdigit() else -1
    model = int(model) if model.isdigit() else -1
    arch = microarchitecture(vendor, family, model)
    label = f"family {family} model {model}" if family >= 0 and model >= 0 else ""
    if label and arch:
        label += f" = {arch}"
    return {"vendor": vendor, "family": family, "model": model, "microarchitecture": arch, "label": label}
