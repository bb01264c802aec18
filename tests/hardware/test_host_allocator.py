"""glibc's thresholds set by the hardware layer: freed activation-sized blocks are reused instead
of being page-faulted anew, user settings and STRATA_HOST_MALLOC=0 are respected."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import sys

import pytest

from strata.hardware import host_allocator


def _glibc() -> bool:
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").gnu_get_libc_version  # noqa: B018
        return True
    except (OSError, AttributeError):
        return False


MMAPPED = """
import ctypes, ctypes.util, torch
from strata.hardware import host_allocator
host_allocator.keep_freed_memory()

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.mallinfo2.restype = MallInfo2
before = libc.mallinfo2().hblkhd
block = torch.empty(5 << 20)  # a 20 MiB activation, alive
print(libc.mallinfo2().hblkhd - before)
"""


def _mmapped_bytes(env: dict) -> int:
    """Bytes glibc served with their own mmap for one 20 MiB tensor, in a fresh process (as an
    engine's, whose first prefill allocates such blocks)."""
    out = subprocess.run([sys.executable, "-c", MMAPPED], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _glibc(), reason="glibc's mallopt only")
def test_activation_sized_blocks_come_from_the_reusable_heap():
    """An mmap'd block goes back to the kernel when freed, and the next one faults every page in
    afresh (a qwen-0.5b 512-token request: ~200,000 faults); a heap block is reused."""
    env = {k: v for k, v in os.environ.items() if k not in host_allocator.USER_SETTINGS + (host_allocator.ENV,)}
    assert _mmapped_bytes({**env, host_allocator.ENV: "0"}) >= 20 << 20  # glibc's default: an mmap
    assert _mmapped_bytes(env) == 0


def test_set_once_per_process(monkeypatch):
    for k in host_allocator.USER_SETTINGS + (host_allocator.ENV,):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(host_allocator, "_done", None)
    first = host_allocator.keep_freed_memory()
    assert host_allocator.keep_freed_memory() is first
    assert first is _glibc()


@pytest.mark.parametrize("env", [("STRATA_HOST_MALLOC", "0"), ("MALLOC_TRIM_THRESHOLD_", "1000000"),
                                 ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1000000")])
def test_user_settings_are_left_alone(env, monkeypatch):
    monkeypatch.setattr(host_allocator, "_done", None)
    monkeypatch.setenv(*env)
    assert host_allocator.keep_freed_memory() is False
