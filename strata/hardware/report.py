"""`strata hw`: what this machine is (CPU, caches, NUMA, memory, GPUs, links) and what it measures.

Identity comes from /proc, sysfs, torch.cuda and, when installed, NVML (nvidia-ml-py): the host's
facts are gathered in host_facts.py, the GPUs' in gpu_facts.py; the measured figures come from
`probe.probe()` (cached). This file assembles the report and formats it. Everything here is
import-safe and runs without a GPU; the GPU path is exercised in tests with a fake torch.cuda and
a fake NVML.
"""

from __future__ import annotations

from typing import Any

import torch

from strata.hardware.gpu_facts import gpu_devices
from strata.hardware.host_facts import host_info
from strata.hardware.probe import HardwareProfile, probe
from strata.text_table import fmt_bytes

NVLINK_GBS_PER_LINK = {1: 40.0, 2: 50.0, 3: 50.0, 4: 50.0}  # both directions, GB/s per link


# ---------------------------------------------------------------- the report


def build_report(refresh: bool = False, measure: bool = True) -> dict[str, Any]:
    """Everything `strata hw` shows, as plain data."""
    report: dict[str, Any] = {
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "host": host_info(),
    }
    if measure:
        report["cpu_measured"] = probe("cpu", refresh=refresh).to_json()
    report["gpus"] = gpu_devices(measure=measure, refresh=refresh)
    return report


def _b(n: float) -> str:
    return fmt_bytes(n)


_ORDER = ("float32", "bfloat16", "float16", "int8", "int4")


def _rates(d: dict[str, float], unit: str) -> str:
    keys = sorted(d, key=lambda k: (_ORDER.index(k) if k in _ORDER else len(_ORDER), k))
    return ", ".join(f"{k} {d[k]:,.1f}" for k in keys) + f" {unit}" if d else "-"


def format_report(r: dict[str, Any]) -> str:
    h = r["host"]
    lines = [f"torch {r['torch_version']} (CUDA {r['torch_cuda'] or 'none'})", "", "CPU"]
    lines.append(f"  model        {h['model']}" + (f" ({h['cpu_identity']})" if h.get("cpu_identity") else ""))
    lines.append(
        f"  cores        {h['cores_physical']} physical, {h['cores_logical']} logical; usable by this "
        f"process: {h['cpus_usable']} CPUs = {h['cores_usable']} cores; torch threads {h['torch_threads']}"
    )
    isa = h["isa"]
    lines.append("  ISA          " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in isa.items()))
    caches = h["caches"]
    if caches:
        lines.append("  caches       " + ", ".join(
            f"{k} {_b(c['bytes'])}" + (f" x{c['instances']}" if c["instances"] > 1 else "")
            for k, c in caches.items()
        ))
    lines.append("  NUMA         " + "; ".join(
        f"node {n['node']}: CPUs {n['cpus']}" + (f", {_b(n['memory_bytes'])}" if n["memory_bytes"] else "")
        for n in h["numa_nodes"]
    ))
    lines.append(
        f"  memory       {_b(h['memory_total_bytes'])} total, {_b(h['memory_available_bytes'])} available"
    )
    if "cpu_measured" in r:
        lines += ["", "CPU, measured (cached; --refresh re-measures)"] + _profile_lines(r["cpu_measured"])
    for g in r["gpus"]:
        lines += [""] + _gpu_lines(g)
    if not r["gpus"]:
        lines += ["", "GPUs: none visible to torch (torch.cuda.is_available() is False)"]
    return "\n".join(lines)


def _profile_lines(p: dict[str, Any]) -> list[str]:
    prof = HardwareProfile.from_json(p)
    out = []
    if prof.device == "cpu":
        ratio = prof.mem_bandwidth_gbs / prof.numpy_read_gbs if prof.numpy_read_gbs else float("nan")
        out.append(
            f"  DRAM read    {prof.mem_bandwidth_gbs:.1f} GB/s (torch dot, {prof.threads} threads); "
            f"independent: numpy read {prof.numpy_read_gbs:.1f} GB/s (strata/numpy {ratio:.2f}), "
            f"numpy copy {prof.numpy_copy_gbs:.1f} GB/s (read+write)"
        )
    else:
        out.append(f"  HBM copy     {prof.mem_bandwidth_gbs:.0f} GB/s (device-to-device, read+write)")
        out.append(f"  host copies  H2D {prof.h2d_gbs:.1f} GB/s, D2H {prof.d2h_gbs:.1f} GB/s (pinned)")
    out.append(f"  batch-1 GEMV {_rates(prof.linear_gbs, 'GB/s of weights')} (Strata's kernels)")
    out.append(f"  batch-16     {_rates(prof.matmul_gflops, 'GFLOP/s')}")
    out.append(f"  GEMM         {_rates(prof.gemm_gflops, 'GFLOP/s')}")
    out.append(f"  attention    {_rates(prof.sdpa_gflops, 'GFLOP/s')} (causal SDPA, prefill layout)")
    if prof.quant_linear_gbs:
        out.append(
            f"  quantised    batch-1 {_rates(prof.quant_linear_gbs, 'GB/s')}; "
            f"batch-16 {_rates(prof.quant_matmul_gflops, 'GFLOP/s')}"
        )
    out.append(f"  dispatch     {prof.dispatch_us:.2f} us per tiny torch op (median torch.add, 1 element)")
    return out


def _gpu_lines(g: dict[str, Any]) -> list[str]:
    out = [f"GPU {g['index']}: {g['name']}"]
    out.append(
        f"  memory       {_b(g['memory_bytes'])}; compute capability {g['compute_capability']}, "
        f"{g['sms']} SMs" + (f", L2 {_b(g['l2_bytes'])}" if g.get("l2_bytes") else "")
    )
    arch = g["arch"]
    out.append(f"  kernels      {'ok' if arch['ok'] else 'PROBLEM'}: {arch['how']}")
    if arch["fix"]:
        out.append(f"  fix          {arch['fix']}")
    t = g["tf32"]
    out.append(
        f"  TF32         matmul {'on' if t['matmul_allow_tf32'] else 'off'} "
        f"(torch.backends.cuda.matmul.allow_tf32), cuDNN {'on' if t['cudnn_allow_tf32'] else 'off'}, "
        f"float32_matmul_precision={t['float32_matmul_precision']}"
    )
    if "nvml" in g:
        out.append(f"  NVML         {g['nvml']}")
    clocks = g.get("clocks_mhz") or {}
    if clocks:
        out.append("  clocks       " + ", ".join(
            f"{k} {c.get('current')}/{c.get('max')} MHz (now/max)" for k, c in clocks.items()
        ))
    p = g.get("pcie") or {}
    if p:
        line = (f"  PCIe         gen{p.get('gen_current')} x{p.get('width_current')} now, "
                f"max gen{p.get('gen_max')} x{p.get('width_max')}")
        if p.get("downgraded"):
            line += f"  <-- {p['downgraded']}"
        out.append(line)
    links = g.get("nvlink")
    if links:
        peers: dict[Any, int] = {}
        for link in links:
            peers[link.get("peer_gpu")] = peers.get(link.get("peer_gpu"), 0) + 1
        ver = links[0].get("version")
        total = sum(NVLINK_GBS_PER_LINK.get(link.get("version") or 0, 0.0) for link in links)
        out.append(
            f"  NVLink       {len(links)} active links (v{ver}, ~{total:.0f} GB/s both directions): "
            + ", ".join(f"{n} to GPU {k}" if k is not None else f"{n} to a switch/other" for k, n in peers.items())
        )
    elif links is not None:
        out.append("  NVLink       none active")
    if "measured" in g:
        out += _profile_lines(g["measured"])
        bf16 = g["measured"]["gemm_gflops"].get("bfloat16")
        if bf16:
            out.append(f"  bf16 GEMM    {bf16 / 1e3:.1f} TFLOP/s (8192^3)")
    elif "measured_error" in g:
        out.append(f"  measured     failed: {g['measured_error']}")
    return out
