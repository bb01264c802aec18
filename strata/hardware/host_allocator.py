"""glibc's allocator set to keep freed activation memory for reuse (CPU engines, Linux glibc).

torch's CPU allocator is plain malloc. glibc serves blocks above its mmap threshold (128 KiB to
start, raised on the fly) with fresh mmaps and gives freed heap tops back to the kernel past its
trim threshold, so every prefill step's activations (tens of MiB a layer) are page-faulted and
zeroed anew: a qwen-0.5b 512-token prompt took ~200,000 minor faults (~0.8 GB of fresh pages) per
request on the Zen 4 dev VM, and each decode step faults its logits row. With the mmap threshold
at glibc's maximum (32 MiB) and trimming only past TRIM_BYTES, freed blocks stay in the heap and
the next step reuses them: 2-50 faults per request there, and that prompt's prefill (bf16
weights, LLM.generate, five requests per process, processes run one after the other) took
1,240-1,370 ms from the second request on, against 1,480-1,860 without. The price: the process keeps its peak activation
memory (as a GPU caching allocator does).

Skipped where the C library is not glibc, where the user set MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_ or GLIBC_TUNABLES themselves, and with STRATA_HOST_MALLOC=0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

from strata.settings import SETTINGS

logger = logging.getLogger(__name__)

ENV = "STRATA_HOST_MALLOC"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc malloc.h
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling for it on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_BYTES = 1 << 30
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds once per process; True when they are in effect."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if not SETTINGS.host_malloc or any(k in os.environ for k in USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it (musl, macOS: skip)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))
    logger.debug("glibc malloc: mmap threshold %d MiB, trim threshold %d MiB: %s", MMAP_THRESHOLD_BYTES >> 20,
                 TRIM_BYTES >> 20, "set" if _done else "refused")
    return _done
