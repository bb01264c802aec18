"""Where CPU work runs: how many physical cores this process may use, and torch's thread count."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import psutil
import torch

from strata.errors import ConfigError

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


def set_compute_threads(n: int | None) -> int:
    """Set torch's intra-op thread count (None: `default_threads()`); returns the value in effect."""
    if n is None:
        n = default_threads()
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(
            f"threads={n!r}: must be a positive integer or None (one per physical core)"
        )
    torch.set_num_threads(n)
    used = torch.get_num_threads()
    logger.debug("torch compute threads set to %d", used)
    return used
