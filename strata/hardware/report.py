"""`strata hw`: what this machine is (CPU, caches, NUMA, memory, GPUs, links) and what it measures.

Identity comes from /proc, sysfs, torch.cuda and, when installed, NVML (nvidia-ml-py); the
measured figures come from `probe.probe()` (cached). Everything here is import-safe and runs
without a GPU; the GPU path is exercised in tests with a fake torch.cuda and a fake NVML.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import psutil
import torch

from strata.cpuinfo import cpu_model_and_flags
from strata.hardware.placement import default_threads, usable_cpus
from strata.hardware.probe import HardwareProfile, probe

logger = logging.getLogger(__name__)

_SYS_CPU = Path("/sys/devices/system/cpu")
_SYS_NODE = Path("/sys/devices/system/node")
ISA_REPORTED = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
NVLINK_GBS_PER_LINK = {1: 40.0, 2: 50.0, 3: 50.0, 4: 50.0}  # both directions, GB/s per link


# ---------------------------------------------------------------- host


def _size_bytes(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in "KMG" else text
    return int(digits) * mult


def cpu_caches(cpus: list[int] | None = None, root: Path = _SYS_CPU) -> dict[str, dict[str, int]]:
    """{"L1d": {"bytes": per instance, "instances": n}, "L1i", "L2", "L3"} from sysfs, over the
    given CPUs (default: those this process may use); {} where sysfs is unreadable."""
    cpus = usable_cpus() if cpus is None else cpus
    found: dict[str, tuple[int, set[str]]] = {}
    for cpu in cpus:
        base = root / f"cpu{cpu}" / "cache"
        try:
            entries = sorted(base.glob("index*"))
        except OSError:
            continue
        for idx in entries:
            try:
                level = (idx / "level").read_text().strip()
                kind = (idx / "type").read_text().strip()
                size = _size_bytes((idx / "size").read_text())
                shared = (idx / "shared_cpu_list").read_text().strip()
            except (OSError, ValueError):
                continue
            label = f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")
            _, groups = found.setdefault(label, (size, set()))
            groups.add(shared)
    return {k: {"bytes": size, "instances": len(groups)} for k, (size, groups) in sorted(found.items())}


def numa_nodes(root: Path = _SYS_NODE) -> list[dict[str, Any]]:
    """[{"node": 0, "cpus": "0-1", "memory_bytes": ...}]; one node (all CPUs) where sysfs lacks them."""
    nodes = []
    for d in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = (d / "cpulist").read_text().strip()
        except OSError:
            continue
        mem = 0
        try:
            for line in (d / "meminfo").read_text().splitlines():
                if "MemTotal:" in line:
                    mem = int(line.split()[-2]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        nodes.append({"node": int(d.name[4:]), "cpus": cpus, "memory_bytes": mem})
    return nodes or [{"node": 0, "cpus": f"0-{(os.cpu_count() or 1) - 1}", "memory_bytes": 0}]


def host_info() -> dict[str, Any]:
    name, flags = cpu_model_and_flags()
    vm = psutil.virtual_memory()
    return {
        "model": name,
        "cores_physical": psutil.cpu_count(logical=False) or 0,
        "cores_logical": psutil.cpu_count(logical=True) or 0,
        "cpus_usable": len(usable_cpus()),
        "cores_usable": default_threads(),
        "torch_threads": torch.get_num_threads(),
        "isa": {f: f in flags for f in ISA_REPORTED},
        "caches": cpu_caches(),
        "numa_nodes": numa_nodes(),
        "memory_total_bytes": int(vm.total),
        "memory_available_bytes": int(vm.available),
    }


# ---------------------------------------------------------------- GPUs


def _load_nvml() -> Any | None:
    """pynvml (from nvidia-ml-py), initialised; None if absent or no driver."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        return pynvml
    except Exception as e:  # ImportError, or NVMLError when no driver is loaded
        logger.debug("NVML unavailable: %s", e)
        return None


def arch_check(capability: tuple[int, int], arch_list: list[str]) -> dict[str, Any]:
    """Can this torch build run kernels on a device of `capability`?

    Exact sm_XY cubins run; cubins of the same major and a lower minor run too (binary
    compatibility within a major); PTX (compute_XY) of a lower or equal capability is JIT-compiled
    at first use; anything else fails with "no kernel image is available for execution".
    """
    major, minor = capability
    want = f"sm_{major}{minor}"
    sms = [a for a in arch_list if a.startswith("sm_")]
    ptx = [a for a in arch_list if a.startswith("compute_")]

    def cc(a: str) -> tuple[int, int] | None:
        digits = "".join(ch for ch in a.split("_", 1)[1] if ch.isdigit())
        return (int(digits[:-1]), int(digits[-1])) if len(digits) >= 2 else None

    if want in sms:
        return {"ok": True, "how": f"{want} cubins in this build", "fix": None}
    same_major = [a for a in sms if (c := cc(a)) and not a.endswith("a") and c[0] == major and c[1] < minor]
    if same_major:
        return {"ok": True, "how": f"{same_major[-1]} cubins (binary-compatible with {want})", "fix": None}
    jit = [a for a in ptx if (c := cc(a)) and c <= (major, minor)]
    if jit:
        return {"ok": True, "how": f"PTX {jit[-1]} JIT-compiled for {want} (slow first start)", "fix": None}
    return {
        "ok": False,
        "how": f"no kernel image for {want}: this torch build has {', '.join(arch_list) or 'none'}",
        "fix": f"install a torch build compiled for {want} (e.g. a newer CUDA wheel from "
        "https://download.pytorch.org/whl/ whose arch list includes it)",
    }


def _tf32() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        }


def _pci_bus_id(props: Any) -> str | None:
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    return f"{getattr(props, 'pci_domain_id', 0):08x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"


def _bdf(bus_id: str) -> str:
    return bus_id.lower().split(":", 1)[-1]


def _nvml_call(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:  # NVMLError_NotSupported and friends: the field is simply absent
        return None


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _nvml_details(nvml: Any, index: int, bus_id: str | None) -> dict[str, Any]:
    """Clocks, PCIe link (current vs max) and NVLink links of one GPU from NVML."""
    handle = None
    if bus_id is not None and hasattr(nvml, "nvmlDeviceGetHandleByPciBusId"):
        handle = _nvml_call(nvml.nvmlDeviceGetHandleByPciBusId, bus_id)
    if handle is None:  # by index: matches torch's order unless CUDA_VISIBLE_DEVICES reorders
        handle = _nvml_call(nvml.nvmlDeviceGetHandleByIndex, index)
    if handle is None:
        return {}
    out: dict[str, Any] = {"clocks_mhz": {}, "pcie": {}, "nvlink": []}
    for label, const in (("sm", "NVML_CLOCK_SM"), ("memory", "NVML_CLOCK_MEM")):
        c = getattr(nvml, const, None)
        if c is not None:
            out["clocks_mhz"][label] = {
                "current": _nvml_call(nvml.nvmlDeviceGetClockInfo, handle, c),
                "max": _nvml_call(nvml.nvmlDeviceGetMaxClockInfo, handle, c),
            }
    pcie = {
        "gen_current": _nvml_call(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
        "gen_max": _nvml_call(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
        "width_current": _nvml_call(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
        "width_max": _nvml_call(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
    }
    if hasattr(nvml, "nvmlDeviceGetGpuMaxPcieLinkGeneration"):
        pcie["gen_gpu_max"] = _nvml_call(nvml.nvmlDeviceGetGpuMaxPcieLinkGeneration, handle)
    pcie["downgraded"] = pcie_downgrade(pcie)
    out["pcie"] = pcie
    max_links = getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)
    remote_fn = getattr(nvml, "nvmlDeviceGetNvLinkRemotePciInfo_v2", None) or getattr(
        nvml, "nvmlDeviceGetNvLinkRemotePciInfo", None
    )
    for link in range(max_links):
        state = _nvml_call(nvml.nvmlDeviceGetNvLinkState, handle, link)
        if state is None:
            if link == 0:
                break  # no NVLink on this device
            continue
        if not state:
            continue
        remote = _nvml_call(remote_fn, handle, link) if remote_fn else None
        out["nvlink"].append({
            "link": link,
            "version": _nvml_call(nvml.nvmlDeviceGetNvLinkVersion, handle, link),
            "remote_bus_id": _text(remote.busId).lower() if remote is not None else None,
        })
    return out


def pcie_downgrade(pcie: dict[str, Any]) -> str | None:
    """A readable warning when the link runs narrower or slower than it can, else None."""
    notes = []
    wc, wm = pcie.get("width_current"), pcie.get("width_max")
    if wc and wm and wc < wm:
        notes.append(f"running x{wc} of x{wm}")
    gc, gm = pcie.get("gen_current"), pcie.get("gen_max")
    if gc and gm and gc < gm:
        notes.append(f"gen{gc} of gen{gm} (links drop generation at idle: check under load)")
    return "; ".join(notes) or None


def gpu_devices(measure: bool = True, refresh: bool = False) -> list[dict[str, Any]]:
    """One dict per visible CUDA device: identity, arch check, NVML details and (with `measure`)
    the probe's measured figures. [] without CUDA."""
    if not torch.cuda.is_available():
        return []
    nvml = _load_nvml()
    arch_list = list(torch.cuda.get_arch_list())
    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        cap = (int(props.major), int(props.minor))
        d: dict[str, Any] = {
            "index": i,
            "name": props.name,
            "memory_bytes": int(props.total_memory),
            "compute_capability": f"{cap[0]}.{cap[1]}",
            "sms": int(getattr(props, "multi_processor_count", 0)),
            "l2_bytes": int(getattr(props, "L2_cache_size", 0) or 0),
            "pci_bus_id": _pci_bus_id(props),
            "arch": arch_check(cap, arch_list),
            "tf32": _tf32(),
        }
        if nvml is not None:
            d.update(_nvml_details(nvml, i, d["pci_bus_id"]))
        else:
            d["nvml"] = "not available (pip install nvidia-ml-py for clocks, PCIe link and NVLink)"
        if measure and d["arch"]["ok"]:
            try:
                d["measured"] = probe(f"cuda:{i}", refresh=refresh).to_json()
            except RuntimeError as e:
                d["measured_error"] = str(e)
        devices.append(d)
    # match NVLink peers by bus:device.function (NVML pads the PCI domain to 4 or 8 digits)
    by_bus = {_bdf(d["pci_bus_id"]): d["index"] for d in devices if d.get("pci_bus_id")}
    for d in devices:
        for link in d.get("nvlink", []):
            rb = link.get("remote_bus_id")
            link["peer_gpu"] = by_bus.get(_bdf(rb)) if rb else None
    return devices


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
    from strata.text_table import fmt_bytes

    return fmt_bytes(n)


_ORDER = ("float32", "bfloat16", "float16", "int8", "int4")


def _rates(d: dict[str, float], unit: str) -> str:
    keys = sorted(d, key=lambda k: (_ORDER.index(k) if k in _ORDER else len(_ORDER), k))
    return ", ".join(f"{k} {d[k]:,.1f}" for k in keys) + f" {unit}" if d else "-"


def format_report(r: dict[str, Any]) -> str:
    h = r["host"]
    lines = [f"torch {r['torch_version']} (CUDA {r['torch_cuda'] or 'none'})", "", "CPU"]
    lines.append(f"  model        {h['model']}")
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
