"""Where CPU work runs: torch's (and numba's) thread count for this process or rank, and a rank's
cores (hardware/cores.py counts them)."""

from __future__ import annotations

import logging
import os

import torch

from strata.errors import ConfigError
from strata.hardware.cores import core_groups, default_threads, usable_cpus
from strata.kernels import cpu_gemv

logger = logging.getLogger(__name__)


def set_compute_threads(n: int | None) -> int:
    """Set torch's intra-op thread count (None: `default_threads()`); returns the value in effect."""
    if n is None:
        n = default_threads()
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(
            f"threads={n!r}: must be a positive integer or None (one per physical core)"
        )
    _launch_numba_pool(n)
    torch.set_num_threads(n)
    used = torch.get_num_threads()
    logger.debug("torch compute threads set to %d", used)
    return used


def _launch_numba_pool(n: int) -> None:
    """Start numba's thread pool now, before torch's count is set: with the OpenMP threading layer
    the pool's launch sets the OpenMP thread count (which torch shares and reads) to numba's
    NUMBA_NUM_THREADS, so a later first kernel would silently undo `n` (measured: a rank pinned to
    one core then ran 2 threads there and its GEMVs took 30x longer)."""
    try:
        import numba
    except ImportError:
        return
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    cpu_gemv.forget_numba_threads()  # its per-thread memo of numba's count is stale now


def rank_placement(local_rank: int, local_world_size: int, threads: int | None = None) -> tuple[int, list[int]]:
    """Compute threads and CPUs for one of `local_world_size` ranks on this host: the usable CPUs
    split into equal runs of whole cores, one run per rank, so ranks never share a core; the
    process is pinned to its run (Linux). Returns (threads, cpus)."""
    cpus = usable_cpus()
    groups = core_groups(cpus)  # CPUs of one physical core together
    per = max(1, len(groups) // local_world_size)
    mine = groups[(local_rank * per) % len(groups):][:per] or groups[:1]
    my_cpus = sorted(c for g in mine for c in g)
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, my_cpus)
        except OSError as e:  # a restricted container: keep running unpinned
            logger.info("rank %d: could not pin to CPUs %s (%s)", local_rank, my_cpus, e)
    n = set_compute_threads(threads if threads is not None else len(mine))
    return n, my_cpus
