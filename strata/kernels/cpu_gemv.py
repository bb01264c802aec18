"""Skinny fp32 matmul on CPU (a few rows x weight), streaming each weight row once.

torch's fp32 GEMV on CPU runs on one thread at ~25-35% of DRAM bandwidth (measured on the dev
box: 11 GB/s vs 62 GB/s read), and batch-1 decode is nothing but GEMVs. This numba kernel splits
weight rows across threads and reads each row once for all input rows: ~40 GB/s there. The torch
reference twin is F.linear; tests compare the two. Without numba everything falls back to torch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from contextvars import ContextVar

import numpy as np
import torch

from strata.kernels.dispatch import KERNEL_MODE, kernel

logger = logging.getLogger(__name__)

try:  # optional: the fallback is torch
    import numba
    from numba import njit, prange
except ImportError:  # pragma: no cover - exercised only where numba is absent
    numba = None

MAX_ROWS = 16  # measured: numba beats torch up to ~16 rows here; above, GEMM is compute-bound
# From this many input rows the kernels block 2 weight rows x 4 input rows (compute-bound there).
# Measured on a Zen 4 (2 cores, cold weights, smol/qwen shapes): at 16 rows 75-83 GFLOP/s blocked
# vs 56-68 one dot at a time (oneDNN's fp32 GEMM 80-86); at 2-4 rows, memory-bound, no gain.
BLOCK_ROWS = 8


def available() -> bool:
    return numba is not None


if numba is not None:

    @njit(fastmath=True, cache=True, inline="always")
    def _dots_2x4(wa, wb, x0, x1, x2, x3):  # pragma: no cover - compiled
        """The 8 dots of 2 weight rows with 4 input rows: each loaded vector feeds 2 or 4 FMAs
        (one dot at a time loads two vectors per FMA: load-bound once rows make it compute-bound)."""
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
        for c in range(x0.shape[0]):
            va = wa[c]
            vb = wb[c]
            v0 = x0[c]
            v1 = x1[c]
            v2 = x2[c]
            v3 = x3[c]
            a0 += va * v0
            a1 += va * v1
            a2 += va * v2
            a3 += va * v3
            b0 += vb * v0
            b1 += vb * v1
            b2 += vb * v2
            b3 += vb * v3
        return a0, a1, a2, a3, b0, b1, b2, b3

    @njit(fastmath=True, cache=True, inline="always")
    def _dots_2x1(wa, wb, xj):  # pragma: no cover - compiled
        a = np.float32(0.0)
        b = np.float32(0.0)
        for c in range(xj.shape[0]):
            a += wa[c] * xj[c]
            b += wb[c] * xj[c]
        return a, b

    @njit(fastmath=True, cache=True, inline="always")
    def _pair_rows(wa, wb, x, oa, ob, swiglu):  # pragma: no cover - compiled
        """For every input row j: (oa[j], ob[j]) = (wa . x_j, wb . x_j), or with `swiglu`
        oa[j] = silu(wa . x_j) * (wb . x_j), 4 input rows at a time."""
        rows = x.shape[0]
        j = 0
        while j < rows:
            if j + 4 <= rows:
                a0, a1, a2, a3, b0, b1, b2, b3 = _dots_2x4(wa, wb, x[j], x[j + 1], x[j + 2], x[j + 3])
                n = 4
            else:
                a0, b0 = _dots_2x1(wa, wb, x[j])
                a1 = a2 = a3 = b1 = b2 = b3 = np.float32(0.0)
                n = 1
            for k, a, b in ((0, a0, b0), (1, a1, b1), (2, a2, b2), (3, a3, b3)):
                if k < n:
                    if swiglu:
                        oa[j + k] = a / (np.float32(1.0) + np.exp(-a)) * b
                    else:
                        oa[j + k] = a
                        ob[j + k] = b
            j += n

    @njit(parallel=True, fastmath=True, cache=True)
    def _gemv_rows(w, x, out, threads):  # pragma: no cover - compiled
        # one contiguous slab of weight rows per thread (measured ~5-10% faster than prange
        # over single rows); each weight row is read once for all input rows
        n_out, n_in = w.shape
        rows = x.shape[0]
        # even slabs: row pairs start at even rows, so the bits do not depend on the thread count
        per = (n_out + 2 * threads - 1) // (2 * threads) * 2
        for t in prange(threads):
            paired, end = t * per, min(n_out, (t + 1) * per)
            if rows >= BLOCK_ROWS:  # compute-bound: 2 weight rows x 4 input rows per pass
                ot = out.T
                while paired + 2 <= end:
                    _pair_rows(w[paired], w[paired + 1], x, ot[paired], ot[paired + 1], False)
                    paired += 2
            for r in range(paired, end):  # the row the pairs left, or every row
                wr = w[r]  # 1-D row views vectorise better than 2-D indexing (measured ~10%)
                for j in range(rows):
                    xj = x[j]
                    acc = np.float32(0.0)
                    for c in range(n_in):
                        acc += wr[c] * xj[c]
                    out[j, r] = acc

    @njit(parallel=True, fastmath=True, cache=True)
    def _gemv_swiglu(w, x, out, threads):  # pragma: no cover - compiled
        # w = [gate; up] stacked by rows; out[j, r] = silu(gate_r . x_j) * (up_r . x_j)
        half = w.shape[0] // 2
        n_in = w.shape[1]
        rows = x.shape[0]
        per = (half + threads - 1) // threads
        ot = out.T
        for t in prange(threads):
            for r in range(t * per, min(half, (t + 1) * per)):
                wg = w[r]
                wu = w[r + half]
                if rows >= BLOCK_ROWS:
                    _pair_rows(wg, wu, x, ot[r], ot[r], True)
                    continue
                for j in range(rows):
                    xj = x[j]
                    g = np.float32(0.0)
                    u = np.float32(0.0)
                    for c in range(n_in):
                        g += wg[c] * xj[c]
                        u += wu[c] * xj[c]
                    out[j, r] = g / (np.float32(1.0) + np.exp(-g)) * u


_numba_threads = threading.local()  # numba's thread count is per calling thread, so is its cache


def forget_numba_threads() -> None:
    """Something set numba's thread count directly (hardware/placement.py): re-read it next call."""
    _numba_threads.value = None


# At most this many threads for the numba kernels in the current context (None: as many as torch's
# pool): the CPU platform's adaptive threads lower it under contention, for the engine's own steps
# only (a ContextVar, set around each step: other engines and threads never inherit it). Results do
# not depend on it: each output row (and each attention item) is one thread's sequential sum.
THREAD_CAP: ContextVar[int | None] = ContextVar("strata_kernel_thread_cap", default=None)


@contextlib.contextmanager
def thread_cap(cap: int | None) -> Iterator[None]:
    """The numba kernels run on at most `cap` threads inside the block (this context only)."""
    token = THREAD_CAP.set(cap)
    try:
        yield
    finally:
        THREAD_CAP.reset(token)


def sync_threads() -> int:
    """Run numba kernels on as many threads as torch's intra-op pool (the placement decision), or
    fewer under the thread cap.

    Called before every kernel (~150 times per decode step): numba.get_num_threads() costs ~2.5 us
    a call here, so the count this thread last set is remembered and only torch's is read."""
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    cap = THREAD_CAP.get()
    if cap is not None:
        threads = max(1, min(threads, cap))
    if getattr(_numba_threads, "value", None) != threads:
        numba.set_num_threads(threads)
        _numba_threads.value = threads
    return threads


@kernel("gemv")
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ weight[out, in].T (+ bias), fp32 CPU tensors; rows <= MAX_ROWS."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    threads = sync_threads()
    _gemv_rows(weight.numpy(), x.numpy(), out.numpy(), threads)
    if bias is not None:
        out += bias
    return out


@kernel("gemv_swiglu")
def gemv_swiglu(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for gate_up = [gate; up] (no bias), one pass over the weight."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], gate_up.shape[0] // 2, dtype=torch.float32)
    _gemv_swiglu(gate_up.numpy(), x.numpy(), out.numpy(), sync_threads())
    return out


def few_fp32_rows(x: torch.Tensor, other: torch.Tensor, max_rows: int) -> bool:
    """The shared precondition of the few-row CPU kernels: numba present, x [rows <= max_rows, n],
    x and `other` (weight or cache) fp32 on CPU, no autograd (the kernels have no backward); and
    the kernel mode's fast paths on (kernels/dispatch.py; asked first: the FX tracer turns them off,
    and then x and `other` are fx Proxies, which must not be inspected)."""
    # ordered cheapest first, and is_cpu rather than .device.type (which builds a device object):
    # this runs ~200 times per decode step
    return (
        KERNEL_MODE.get().fast_paths
        and numba is not None
        and x.dim() == 2
        and x.shape[0] <= max_rows
        and x.dtype is torch.float32
        and other.dtype is torch.float32
        and x.is_cpu
        and other.is_cpu
        and not ((x.requires_grad or other.requires_grad) and torch.is_grad_enabled())
    )


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` applies: few fp32 CPU rows and a contiguous weight."""
    return few_fp32_rows(x, weight, MAX_ROWS) and weight.is_contiguous()
