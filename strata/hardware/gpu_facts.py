"""`strata hw`'s GPU facts: identity, the torch build's arch check, TF32, NVML clocks and links.

One dict per visible CUDA device from torch.cuda and, when installed, NVML (nvidia-ml-py): clocks,
the PCIe link (current vs max, with a downgrade warning) and NVLink links matched to their peer
GPUs; with `measure`, the probe's measured figures of each device whose kernels can run.
Import-safe without a GPU; tests use a fake torch.cuda and a fake NVML.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

from strata.hardware.probe import probe

logger = logging.getLogger(__name__)


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
