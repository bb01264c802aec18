"""`strata hw`'s host facts: CPU model and ISA, caches and NUMA nodes from sysfs, memory.

Read from /proc/cpuinfo, /sys/devices/system/{cpu,node} and psutil; {} or one node where sysfs
is unreadable. report.py renders them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psutil
import torch

from strata.cpuinfo import cpu_identity, cpu_model_and_flags
from strata.hardware.cores import default_threads, usable_cpus

_SYS_CPU = Path("/sys/devices/system/cpu")
_SYS_NODE = Path("/sys/devices/system/node")
ISA_REPORTED = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


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
        "cpu_identity": cpu_identity()["label"],
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
