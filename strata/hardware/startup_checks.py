"""GPU checks `strata serve` runs at start on CUDA: each a pure function of the facts, with the fix.

- kernel_image: torch's compiled arch list against the device's capability (gpu_facts.arch_check):
  a build without the device's cubins or a lower PTX fails at the first kernel with "no kernel
  image is available for execution on the device".
- pcie_link: the link runs fewer lanes than it has (x8 of x16: a slot, riser or seating fault), or
  the slot caps its generation below the GPU's (nvidia-smi's pcie.link.gen.max < gen.gpumax).
  current < max generation alone is not a fault at start: idle links drop generation to save
  power, so it is reported, not warned about.
- tf32: fp32 matmuls on sm_80+ in full fp32 (torch's default) are several times slower than TF32.

Facts come from nvidia-smi when it is there (the NVIDIA container runtime mounts it), else torch
and /sys; the arch list from torch.cuda.get_arch_list(). Gathering them initialises no CUDA
context in the server process (the engine process owns the GPU). Tests feed fake facts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from strata.hardware.gpu_facts import arch_check

logger = logging.getLogger(__name__)

NVIDIA_SMI_FIELDS = ("index", "name", "compute_cap", "pci.bus_id", "pcie.link.gen.current", "pcie.link.gen.max",
                     "pcie.link.gen.gpumax", "pcie.link.width.current", "pcie.link.width.max")
_GT_S_TO_GEN = {"2.5": 1, "5.0": 2, "8.0": 3, "16.0": 4, "32.0": 5, "64.0": 6}


@dataclass(frozen=True)
class GpuFacts:
    index: int
    name: str
    capability: tuple[int, int]
    pcie: dict = field(default_factory=dict)  # gen_current, gen_max, gen_gpu_max, width_current, width_max


@dataclass(frozen=True)
class GpuCheck:
    check: str  # kernel_image | pcie_link | tf32
    device: str  # the GPU index
    ok: bool
    detail: str
    fix: str | None = None

    def log_line(self) -> str:
        return f"GPU {self.device} {self.check}: {self.detail}" + (f"; fix: {self.fix}" if self.fix else "")


def kernel_image_check(f: GpuFacts, arch_list: list[str]) -> GpuCheck:
    r = arch_check(f.capability, arch_list)
    return GpuCheck("kernel_image", str(f.index), r["ok"], r["how"], r["fix"])


def pcie_check(f: GpuFacts) -> GpuCheck:
    p = f.pcie
    wc, wm = p.get("width_current"), p.get("width_max")
    gc, gm, gg = p.get("gen_current"), p.get("gen_max"), p.get("gen_gpu_max")
    if not (wc and wm) and not (gc and gm):
        return GpuCheck("pcie_link", str(f.index), True, "link not reported (no nvidia-smi, no /sys entry)")
    faults, fixes = [], []
    if wc and wm and wc < wm:
        faults.append(f"running x{wc} of x{wm} lanes")
        fixes.append("reseat the GPU or move it to a full x16 slot (check the riser); host<->GPU copies run at "
                     f"{wc}/{wm} of the bandwidth")
    if gm and gg and gm < gg:
        faults.append(f"the slot caps the link at gen{gm}, the GPU does gen{gg}")
        fixes.append("use a slot (or BIOS setting) of the GPU's PCIe generation")
    link = f"gen{gc} of gen{gm}, x{wc} of x{wm}"
    if faults:
        return GpuCheck("pcie_link", str(f.index), False, f"PCIe link downgraded: {'; '.join(faults)} ({link})",
                        "; ".join(fixes))
    idle = " (below max at idle is normal: links drop generation to save power)" if gc and gm and gc < gm else ""
    return GpuCheck("pcie_link", str(f.index), True, f"PCIe {link}{idle}")


def tf32_check(f: GpuFacts, dtype: str, allow_tf32: bool, float32_matmul_precision: str,
               cublas_override: bool = False) -> GpuCheck:
    dtype = dtype.removeprefix("torch.")
    if dtype != "float32":
        return GpuCheck("tf32", str(f.index), True, f"matmuls run in {dtype}; TF32 does not apply")
    if f.capability < (8, 0):
        return GpuCheck("tf32", str(f.index), True, f"sm_{f.capability[0]}{f.capability[1]} has no TF32 tensor cores")
    setting = (f"torch.backends.cuda.matmul.allow_tf32={allow_tf32}, float32_matmul_precision="
               f"{float32_matmul_precision}, TORCH_ALLOW_TF32_CUBLAS_OVERRIDE={'1' if cublas_override else 'unset'}")
    if allow_tf32 or cublas_override or float32_matmul_precision in ("high", "medium"):
        return GpuCheck("tf32", str(f.index), True, f"fp32 matmuls use TF32 tensor cores ({setting})")
    return GpuCheck("tf32", str(f.index), False,
                    f"fp32 matmuls run in full fp32 on a TF32-capable GPU, several times slower ({setting})",
                    "serve with --dtype bfloat16 (or float16), or set TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 in the "
                    "environment to let fp32 matmuls use TF32 (10-bit mantissa)")


# --- facts ----------------------------------------------------------------------------------------


def _int(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


def parse_nvidia_smi(csv: str, fields: tuple[str, ...] = NVIDIA_SMI_FIELDS) -> list[GpuFacts]:
    """`nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits` -> facts ([N/A] -> unknown)."""
    out = []
    for line in csv.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(fields):
            continue
        row = dict(zip(fields, cells))
        major, _, minor = row["compute_cap"].partition(".")
        if not (major.isdigit() and minor.isdigit()):
            continue
        out.append(GpuFacts(int(row["index"]), row["name"], (int(major), int(minor)), {
            "gen_current": _int(row.get("pcie.link.gen.current")), "gen_max": _int(row.get("pcie.link.gen.max")),
            "gen_gpu_max": _int(row.get("pcie.link.gen.gpumax")),
            "width_current": _int(row.get("pcie.link.width.current")), "width_max": _int(row.get("pcie.link.width.max")),
        }))
    return out


def sysfs_pcie(bus_id: str, root: Path = Path("/sys/bus/pci/devices")) -> dict:
    """The link from /sys (current vs the device's max; the slot's cap is not visible there)."""
    d = root / bus_id.lower()

    def read(name: str) -> str | None:
        with contextlib.suppress(OSError):
            return (d / name).read_text().strip()
        return None

    def gen(text: str | None) -> int | None:
        return _GT_S_TO_GEN.get(text.split()[0]) if text else None

    return {"gen_current": gen(read("current_link_speed")), "gen_max": gen(read("max_link_speed")),
            "width_current": _int(read("current_link_width")), "width_max": _int(read("max_link_width"))}


def _smi(smi: str, fields: tuple[str, ...]) -> subprocess.CompletedProcess:
    return subprocess.run([smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=20)


def gather_facts() -> list[GpuFacts]:
    """Facts of the visible GPUs: nvidia-smi, else torch's device properties and /sys."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            fields = NVIDIA_SMI_FIELDS
            r = _smi(smi, fields)
            if r.returncode != 0:  # an older driver without pcie.link.gen.gpumax: the rest still tells
                fields = tuple(f for f in fields if f != "pcie.link.gen.gpumax")
                r = _smi(smi, fields)
            r.check_returncode()
            facts = parse_nvidia_smi(r.stdout, fields)
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible and all(v.strip().isdigit() for v in visible.split(",")):
                keep = [int(v) for v in visible.split(",")]
                facts = [f for f in facts if f.index in keep]
            if facts:
                return facts
        except (OSError, subprocess.SubprocessError) as e:
            logger.info("nvidia-smi failed (%s); GPU facts from torch", e)
    import torch

    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        bus = getattr(p, "pci_bus_id", None)
        bus_id = (f"{getattr(p, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(p, 'pci_device_id', 0):02x}.0"
                  if bus is not None else None)
        out.append(GpuFacts(i, p.name, (int(p.major), int(p.minor)), sysfs_pcie(bus_id) if bus_id else {}))
    return out


def device_checks(facts: list[GpuFacts], arch_list: list[str]) -> list[GpuCheck]:
    """Before the engine starts: can torch's kernels run here, is every link whole."""
    return [c for f in facts for c in (kernel_image_check(f, arch_list), pcie_check(f))]


def tf32_checks(facts: list[GpuFacts], dtype: str) -> list[GpuCheck]:
    """Once the engine reported its dtype: the TF32 setting it runs with (torch's defaults, as here)."""
    import torch

    allow = bool(torch.backends.cuda.matmul.allow_tf32)
    precision = torch.get_float32_matmul_precision()
    override = os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "") == "1"
    return [tf32_check(f, dtype, allow, precision, override) for f in facts]


def report(checks: list[GpuCheck]) -> None:
    """Warnings (with the fix) for the failed checks; the rest at INFO."""
    for c in checks:
        (logger.info if c.ok else logger.warning)("%s", c.log_line())
