"""How many CPUs and physical cores this process may use, and how the server lays its processes on
them. No torch here: the server's front end reads it (hardware/placement.py sets the threads)."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

_SYS_CPU = Path("/sys/devices/system/cpu")
_CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cpus() -> list[int]:
    """Logical CPU ids this process may run on (its affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _physical_cores(cpus: list[int]) -> int | None:
    """Distinct (package, core) pairs among `cpus`, from sysfs topology; None if unreadable."""
    cores: set[tuple[str, str]] = set()
    try:
        for cpu in cpus:
            topo = _SYS_CPU / f"cpu{cpu}" / "topology"
            package = (topo / "physical_package_id").read_text().strip()
            core = (topo / "core_id").read_text().strip()
            cores.add((package, core))
    except OSError:
        return None
    return len(cores) or None


def _cgroup_cpu_limit() -> int | None:
    """CPUs allowed by a cgroup v2 quota (`cpu.max`), rounded up; None when unlimited or absent."""
    try:
        quota, period = _CGROUP_CPU_MAX.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, math.ceil(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def default_threads() -> int:
    """Physical cores usable by this process (affinity, SMT siblings and cgroup quota applied); >= 1.

    Compute threads beyond physical cores share FPUs and only add contention.
    """
    cpus = usable_cpus()
    cores = _physical_cores(cpus)
    if cores is None:
        physical = psutil.cpu_count(logical=False) or len(cpus)
        logical = psutil.cpu_count(logical=True) or len(cpus)
        smt = max(1, logical // physical)
        cores = max(1, len(cpus) // smt)
    limit = _cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, limit)
    return max(1, cores)


@dataclass
class ServerLayout:
    """Where the server's processes run: the engine's compute threads and the tokenizer workers."""

    compute_threads: int
    tokenizer_workers: int
    compute_cpus: list[int] | None  # None: not pinned (no spare cores to separate them)
    tokenizer_cpus: list[int] | None

    def describe(self) -> str:
        if self.compute_cpus is None:
            return (f"{self.compute_threads} compute threads and {self.tokenizer_workers} tokenizer worker(s) "
                    "share all CPUs (no spare cores)")
        return (f"compute: {self.compute_threads} threads on CPUs {self.compute_cpus}; "
                f"{self.tokenizer_workers} tokenizer worker(s) on CPUs {self.tokenizer_cpus}")


def core_groups(cpus: list[int]) -> list[list[int]]:
    """Logical CPUs grouped by physical core (each CPU alone if the topology is unreadable)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for cpu in cpus:
        topo = _SYS_CPU / f"cpu{cpu}" / "topology"
        try:
            key = ((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip())
        except OSError:
            key = ("?", str(cpu))
        groups.setdefault(key, []).append(cpu)
    return list(groups.values())


def server_layout(tokenizer_workers: int | None, compute_threads: int | None,
                  cpus: list[int] | None = None) -> ServerLayout:
    """Split the usable cores between compute and tokenisation.

    Without --threads, machines with 8+ physical cores keep one core in eight for the front end
    and tokenizer workers (batch-1 decode is bandwidth-bound, so compute loses little); smaller
    machines give every core to compute and run one unpinned worker. Spare cores, when there are
    any, get the workers (one per core, up to 4, unless --tokenizer-workers says otherwise) and
    the compute threads stay off them.
    """
    cores = core_groups(cpus if cpus is not None else usable_cpus())
    if compute_threads is None:
        compute_threads = len(cores) - len(cores) // 8 if len(cores) >= 8 else len(cores)
    spare = cores[compute_threads:]
    if not spare:
        workers = 1 if tokenizer_workers is None else tokenizer_workers
        return ServerLayout(compute_threads, workers, None, None)
    workers = min(len(spare), 4) if tokenizer_workers is None else tokenizer_workers
    compute_cpus = sorted(c for core in cores[:compute_threads] for c in core)
    spare_cpus = sorted(c for core in spare for c in core)
    return ServerLayout(compute_threads, workers, compute_cpus, spare_cpus)
