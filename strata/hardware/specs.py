"""Datasheet figures of common accelerators, for planning on hardware that is not here.

Every FLOP/s figure is the DENSE peak (NVIDIA datasheets print the 2:4-sparsity figure with an
asterisk, twice the dense one; those are halved here). Tensor-core figures assume FP32
accumulation where the datasheet distinguishes (GeForce parts quote FP16 accumulation twice as
fast). Peaks are what the silicon can issue at boost clock; measured GEMMs reach 60-80% of them
and copies 80-90% of the memory bandwidth, so a plan on a datasheet is an upper bound.

`lookup("h100")` resolves a name case-insensitively through aliases; `parse_hardware("H100x8")`
adds a device count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from strata.errors import ConfigError

# PCIe x16 bandwidth per direction, GB/s (gen3 8 GT/s, gen4 16, gen5 32; 128b/130b coding)
PCIE_X16_GBS = {3: 15.75, 4: 31.5, 5: 63.0}


@dataclass(frozen=True)
class AcceleratorSpec:
    """One accelerator as its datasheet describes it (dense peaks)."""

    name: str
    vendor: str
    memory_gib: float  # as marketed in GB; treated as GiB-sized HBM/GDDR stacks (80 GB = 80 GiB)
    mem_bandwidth_gbs: float  # HBM/GDDR, GB/s (1e9)
    tflops: dict[str, float]  # dense peak per dtype: fp32, tf32, bf16, fp16, fp8, int8 (TOPS)
    pcie_gen: int
    link: str | None  # "NVLink 4", "Infinity Fabric", or None (PCIe only)
    link_gbs: float | None  # per-device aggregate link bandwidth, both directions, GB/s
    source: str  # the datasheet the figures come from
    aliases: tuple[str, ...] = field(default=())
    note: str = ""
    link_max_devices: int | None = None  # devices one link domain joins (None: a whole node)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    @property
    def pcie_gbs(self) -> float:
        """PCIe x16 bandwidth per direction, GB/s."""
        return PCIE_X16_GBS[self.pcie_gen]

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for a torch dtype name (float32 -> fp32, bfloat16 -> bf16, ...)."""
        key = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
        if key not in self.tflops:
            raise ConfigError(f"{self.name}: no {dtype} figure; it has {', '.join(self.tflops)}")
        return self.tflops[key] * 1e12


# Dense peaks throughout (sparsity figures halved); memory bandwidth and links from the same sheets.
SPECS: dict[str, AcceleratorSpec] = {
    s.name: s
    for s in (
        AcceleratorSpec(
            "A100-40GB", "NVIDIA", 40, 1555,
            {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312, "int8": 624},
            4, "NVLink 3", 600, "NVIDIA A100 Tensor Core GPU datasheet (A100 40GB SXM)",
            ("a100-40g", "a100-sxm4-40gb", "a100 40gb"),
        ),
        AcceleratorSpec(
            "A100-80GB", "NVIDIA", 80, 2039,
            {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312, "int8": 624},
            4, "NVLink 3", 600, "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM)",
            ("a100", "a100-80g", "a100-sxm4-80gb", "a100 80gb"),
        ),
        AcceleratorSpec(
            "H100-SXM", "NVIDIA", 80, 3350,
            {"fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979, "int8": 1979},
            5, "NVLink 4", 900, "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM)",
            ("h100", "h100-sxm5", "h100-sxm5-80gb", "h100 80gb hbm3"),
        ),
        AcceleratorSpec(
            "H100-PCIe", "NVIDIA", 80, 2000,
            {"fp32": 51, "tf32": 378, "bf16": 756, "fp16": 756, "fp8": 1513, "int8": 1513},
            5, "NVLink bridge", 600, "NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe)",
            ("h100-pcie-80gb", "h100 pcie"),
            "NVLink only through an optional 2-GPU bridge; otherwise PCIe", 2,
        ),
        AcceleratorSpec(
            "H200", "NVIDIA", 141, 4800,
            {"fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979, "int8": 1979},
            5, "NVLink 4", 900, "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM)",
            ("h200-sxm", "h200-sxm-141gb", "nvidia h200"),
        ),
        AcceleratorSpec(
            "L4", "NVIDIA", 24, 300,
            {"fp32": 30.3, "tf32": 60, "bf16": 121, "fp16": 121, "fp8": 242.5, "int8": 242.5},
            4, None, None, "NVIDIA L4 Tensor Core GPU datasheet",
            ("nvidia l4",),
        ),
        AcceleratorSpec(
            "L40S", "NVIDIA", 48, 864,
            {"fp32": 91.6, "tf32": 183, "bf16": 362, "fp16": 362, "fp8": 733, "int8": 733},
            4, None, None, "NVIDIA L40S GPU datasheet",
            ("nvidia l40s",),
        ),
        AcceleratorSpec(
            "T4", "NVIDIA", 16, 320,
            {"fp32": 8.1, "fp16": 65, "int8": 130},
            3, None, None, "NVIDIA T4 Tensor Core GPU datasheet",
            ("tesla t4", "tesla-t4"),
            "Turing: no bf16 or tf32 tensor cores",
        ),
        AcceleratorSpec(
            "A10G", "NVIDIA", 24, 600,
            {"fp32": 31.2, "tf32": 62.5, "bf16": 125, "fp16": 125, "int8": 250},
            4, None, None, "NVIDIA A10 Tensor Core GPU datasheet (A10G: AWS's GA102 part, no public datasheet)",
            ("a10", "a10g-24gb", "nvidia a10g"),
            "A10G's own peaks are unpublished; these are the A10's (same GA102 die and memory)",
        ),
        AcceleratorSpec(
            "RTX-4090", "NVIDIA", 24, 1008,
            {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3, "int8": 660.6},
            4, None, None, "NVIDIA Ada Lovelace GPU architecture whitepaper (GeForce RTX 4090)",
            ("4090", "rtx4090", "geforce rtx 4090"),
            "tensor figures with FP32 accumulation (FP16 accumulation is 2x)",
        ),
        AcceleratorSpec(
            "MI250X", "AMD", 128, 3277,
            {"fp32": 95.7, "bf16": 383, "fp16": 383, "int8": 383},
            4, "Infinity Fabric", 800, "AMD Instinct MI250X accelerator specifications",
            ("instinct mi250x", "mi250"),
            "two GCDs per package (each 64 GB, 1.6 TB/s); fp32 is the matrix figure",
        ),
        AcceleratorSpec(
            "MI300X", "AMD", 192, 5300,
            {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9, "int8": 2614.9},
            5, "Infinity Fabric", 896, "AMD Instinct MI300X accelerator datasheet",
            ("instinct mi300x", "mi300"),
            "7 Infinity Fabric links x 128 GB/s",
        ),
    )
}


def _norm(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip().lower())


_INDEX: dict[str, str] = {}
for _spec in SPECS.values():
    for _alias in (_spec.name, *_spec.aliases):
        _INDEX[_norm(_alias)] = _spec.name


def names() -> list[str]:
    return list(SPECS)


def lookup(name: str) -> AcceleratorSpec:
    """The spec for `name` (case-insensitive; aliases such as "h100" or "a100" accepted)."""
    key = _norm(name)
    if key in _INDEX:
        return SPECS[_INDEX[key]]
    raise ConfigError(
        f"unknown accelerator {name!r}; valid names: {', '.join(SPECS)} "
        "(case-insensitive; aliases such as 'h100', 'a100', '4090'), or 'this' for this machine"
    )


def parse_hardware(text: str) -> tuple[str, int]:
    """"H100x8" -> ("H100", 8); "this" -> ("this", 1). A full name wins over a count suffix
    ("rtx4090" is one RTX 4090); the name itself is resolved by `lookup`, not here."""
    t = text.strip()
    if not t:
        raise ConfigError("--hardware: empty; expected NAME, NAMExN (e.g. H100x8) or 'this'")
    if _norm(t) in _INDEX or t.lower() == "this":
        return t, 1
    m = re.fullmatch(r"(.+?)\s*[xX*]\s*(\d+)", t)
    if m is None:
        return t, 1
    count = int(m.group(2))
    if count < 1:
        raise ConfigError(f"--hardware {text!r}: device count must be >= 1")
    return m.group(1), count
