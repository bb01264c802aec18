"""Skinny matmul on CPU against bf16 weights: read the weight narrow, accumulate in fp32.

Batch-1 decode streams every weight once per token, so a bf16 weight read as bf16 halves the
bytes of fp32 and doubles the decode roofline. torch's bf16 GEMV does not get there on CPU
(measured 4.3 GB/s of weights on a Xeon with AMX, against ~25 GB/s DRAM); this kernel widens each
bf16 weight exactly to fp32 in registers (cpu_simd.bf16_dot) and FMAs it with fp32 activations,
slabs of output rows per thread like cpu_gemv. Inputs in bf16 are widened once per call (a few
KB). For more than one input row each weight row is widened once into a per-thread fp32 buffer
and reused for every row.

Above MAX_ROWS (prefill) with fp32 activations (bf16 weight storage, memory/bf16_weights.py),
`matmul` takes the GEMM path marked on the weight (cpu_gemm.py), set by the engine from the
hardware layer's measurement: "bf16" rounds the activations to bf16 and runs oneDNN's bf16 GEMM
(AVX512-BF16 / AMX, several times fp32 where present), "fp32" widens the weight tile by tile into
a small fp32 buffer and runs the fp32 GEMM (exact; the default, and the only sane choice on CPUs
without bf16 arithmetic).

Reference twin: F.linear(x.float(), weight.float()) (tests compare the two); the result differs
from torch's bf16 F.linear only by accumulating in fp32 rather than rounding through bf16.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from strata.kernels import cpu_gemm, cpu_gemv
from strata.kernels.dispatch import KERNEL_MODE, kernel

try:
    import numba
    from numba import njit, prange

    from strata.kernels.cpu_gemv import BLOCK_ROWS, _pair_rows
    from strata.kernels.cpu_simd import bf16_dot, f32_dot
except ImportError:  # pragma: no cover - exercised only where numba is absent
    numba = None

MAX_ROWS = 16


def available() -> bool:
    return numba is not None


if numba is not None:

    @njit(fastmath=True, cache=True, inline="always")
    def _widen(wr, buf):  # pragma: no cover - compiled
        bits = buf.view(np.uint32)
        for c in range(wr.shape[0]):
            bits[c] = np.uint32(np.uint16(wr[c])) << np.uint32(16)

    @njit(parallel=True, fastmath=True, cache=True)
    def _bf16_gemv(w, x, out, threads):  # pragma: no cover - compiled
        n_out, n_in = w.shape
        rows = x.shape[0]
        # even slabs: row pairs start at even rows, so the bits do not depend on the thread count
        per = (n_out + 2 * threads - 1) // (2 * threads) * 2
        for t in prange(threads):
            buf = np.empty(n_in, np.float32)
            buf2 = np.empty(n_in, np.float32)
            paired, end = t * per, min(n_out, (t + 1) * per)
            if rows >= BLOCK_ROWS:  # compute-bound: widen 2 rows, 2 x 4 blocks (cpu_gemv)
                ot = out.T
                while paired + 2 <= end:
                    _widen(w[paired], buf)
                    _widen(w[paired + 1], buf2)
                    _pair_rows(buf, buf2, x, ot[paired], ot[paired + 1], False)
                    paired += 2
            for r in range(paired, end):  # the row the pairs left, or every row
                if rows == 1:
                    out[0, r] = bf16_dot(w[r], x[0])
                else:  # widen once, reuse for every input row
                    _widen(w[r], buf)
                    for j in range(rows):
                        out[j, r] = f32_dot(buf, x[j])

    @njit(parallel=True, fastmath=True, cache=True)
    def _bf16_swiglu(w, x, out, threads):  # pragma: no cover - compiled
        half = w.shape[0] // 2
        n_in = w.shape[1]
        rows = x.shape[0]
        per = (half + threads - 1) // threads
        for t in prange(threads):
            bg = np.empty(n_in, np.float32)
            bu = np.empty(n_in, np.float32)
            for r in range(t * per, min(half, (t + 1) * per)):
                if rows == 1:
                    g = bf16_dot(w[r], x[0])
                    u = bf16_dot(w[r + half], x[0])
                    out[0, r] = g / (np.float32(1.0) + np.exp(-g)) * u
                else:
                    _widen(w[r], bg)
                    _widen(w[r + half], bu)
                    if rows >= BLOCK_ROWS:
                        _pair_rows(bg, bu, x, out.T[r], out.T[r], True)
                        continue
                    for j in range(rows):
                        g = f32_dot(bg, x[j])
                        u = f32_dot(bu, x[j])
                        out[j, r] = g / (np.float32(1.0) + np.exp(-g)) * u


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Few CPU rows (fp32 or bf16) against a contiguous bf16 weight, no autograd, fast paths on."""
    return (
        KERNEL_MODE.get().fast_paths
        and numba is not None
        and weight.dtype is torch.bfloat16
        and x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and (x.dtype is torch.bfloat16 or x.dtype is torch.float32)
        and x.is_cpu
        and weight.is_cpu
        and weight.is_contiguous()
        and not ((x.requires_grad or weight.requires_grad) and torch.is_grad_enabled())
    )


def _bits(weight: torch.Tensor) -> np.ndarray:
    """The weight's bf16 bit patterns as an int16 numpy view (numpy has no bf16)."""
    return weight.view(torch.int16).numpy()


def _rows(x: torch.Tensor) -> np.ndarray:
    return (x if x.dtype is torch.float32 else x.float()).contiguous().numpy()


@kernel("bf16_gemv")
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ weight[out, in].T (+ bias) for a bf16 weight; the result has x's dtype."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    _bf16_gemv(_bits(weight), _rows(x), out.numpy(), cpu_gemv.sync_threads())
    if bias is not None:
        out += bias
    return out if x.dtype is torch.float32 else out.to(x.dtype)


@kernel("bf16_gemv_swiglu")
def gemv_swiglu(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for a bf16 gate_up = [gate; up] (no bias), one pass over it."""
    out = torch.empty(x.shape[0], gate_up.shape[0] // 2, dtype=torch.float32)
    _bf16_swiglu(_bits(gate_up), _rows(x), out.numpy(), cpu_gemv.sync_threads())
    return out if x.dtype is torch.float32 else out.to(x.dtype)


@kernel("bf16_matmul")
def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] fp32 @ a bf16 weight.T (+ bias), fp32 out, for many rows, by the weight's
    cpu_gemm path: oneDNN's bf16 GEMM on the weight as stored, or ~4 MiB tiles widened to fp32 and
    an fp32 GEMM (a fresh whole-weight copy per call would page-fault: cpu_quant.matmul)."""
    x = x.contiguous()
    path = cpu_gemm.path_of(weight)
    if path == "bf16":
        out = F.linear(x.to(torch.bfloat16), weight).float()
    else:
        n_out, n_in = weight.shape
        tile_rows = max(64, min(1024, (4 << 20) // (4 * n_in) // 16 * 16))
        out = torch.empty(x.shape[0], n_out, dtype=torch.float32)
        buf = torch.empty(min(tile_rows, n_out), n_in, dtype=torch.float32)
        for r0 in range(0, n_out, tile_rows):
            r1 = min(n_out, r0 + tile_rows)
            tile = buf[: r1 - r0]
            tile.copy_(weight[r0:r1])
            out[:, r0:r1] = cpu_gemm.tile_mm(x, tile, path)
    if bias is not None:
        out += bias
    return out
