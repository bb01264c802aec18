"""The accelerator spec table: lookup, aliases, errors, and the figures' invariants."""

from __future__ import annotations

import pytest

from strata.errors import ConfigError
from strata.hardware.specs import SPECS, lookup, parse_hardware

REQUIRED = ("A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "L4", "L40S", "T4", "A10G",
            "RTX-4090", "MI250X", "MI300X")


def test_table_has_the_required_entries() -> None:
    assert set(REQUIRED) <= set(SPECS)
    for s in SPECS.values():
        assert s.source and s.memory_gib > 0 and s.mem_bandwidth_gbs > 0 and s.pcie_gen in (3, 4, 5)
        assert "fp32" in s.tflops and ("bf16" in s.tflops or "fp16" in s.tflops)
        assert all(v > 0 for v in s.tflops.values())
        assert s.tflops.get("fp16", 0) >= s.tflops["fp32"]


def test_dense_figures() -> None:
    # dense = half the datasheet's sparsity figure: H100 SXM bf16 1,979 sparse -> 989.5
    assert lookup("H100-SXM").tflops["bf16"] == pytest.approx(989.5)
    assert lookup("a100-80gb").tflops["bf16"] == 312
    assert lookup("A100-80GB").mem_bandwidth_gbs == 2039 and lookup("A100-40GB").mem_bandwidth_gbs == 1555
    assert lookup("H200").memory_gib == 141 and lookup("H200").mem_bandwidth_gbs == 4800
    assert lookup("H100").peak_flops("bfloat16") == pytest.approx(989.5e12)


@pytest.mark.parametrize("name,want", [
    ("h100", "H100-SXM"), ("H100 SXM", "H100-SXM"), ("h100-pcie", "H100-PCIe"), ("a100", "A100-80GB"),
    ("rtx4090", "RTX-4090"), ("4090", "RTX-4090"), ("mi300x", "MI300X"), ("Tesla T4", "T4"), ("l40s", "L40S"),
])
def test_lookup_aliases(name: str, want: str) -> None:
    assert lookup(name).name == want


def test_lookup_error_lists_valid_names() -> None:
    with pytest.raises(ConfigError) as e:
        lookup("B200")
    for name in REQUIRED:
        assert name in str(e.value)
    with pytest.raises(ConfigError, match="no int4"):
        lookup("L4").peak_flops("int4")


def test_parse_hardware() -> None:
    assert parse_hardware("H100x8") == ("H100", 8)
    assert parse_hardware("h100 x 2") == ("h100", 2)
    assert parse_hardware("this") == ("this", 1)
    assert parse_hardware("rtx4090") == ("rtx4090", 1)  # a full name beats a count suffix
    assert parse_hardware("mi300xx8") == ("mi300x", 8)
    assert parse_hardware("L4") == ("L4", 1)
    with pytest.raises(ConfigError):
        parse_hardware("  ")
    with pytest.raises(ConfigError):
        parse_hardware("h100x0")
