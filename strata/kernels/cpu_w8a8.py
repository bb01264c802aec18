"""W8A8 prefill GEMM for int8 weights on CPU (path "int8", kernels/cpu_gemm.py; cpu_quant.matmul calls it).

Many input rows quantised to int8 per row, one integer GEMM (torch._int_mm: oneDNN's u8s8 kernels,
measured ~2x oneDNN's bf16 GEMM on the Zen 4 VM), the int32 products scaled back by row scale x
weight-row scale. One scale per row is much coarser than the decode kernels' per-64-column groups
where a row has outlier channels, so a row with max|x| > INT8_PREFILL_MAX_RATIO x rms(x) is
reported back and recomputed by cpu_quant (the decode kernel for up to MAX_ROWS such rows, else
the fallback path): below it, the rounding noise per element is at most ~8 / (127 * sqrt(12)) ~
1.8% of the row's rms (random activations: max/rms ~ 3.5-4.5, ~1% relative error of the product
measured, against ~0.3% for the bf16 path; the int8 weights' own rounding ~0.9%).

Opt-in, STRATA_INT8_PREFILL=w8a8: it roughly halves int8 prefill time, but on the tiny random test
models it moved greedy agreement with fp32 both ways (llama first tokens 0.94 -> 1.00, qwen2 0.94
-> 0.81 on 16 prompts; 256 prompts: equal), and its expected error is ~2.5x the default prefill's,
so int8 keeps its accuracy unless asked. STRATA_INT8_FP32_ACTIVATIONS=1 turns it off with the
decode kernels' int8 activations.

Reference twin: quant_formats.quantize_activations_ref(x, in_features), then dequantise + F.linear.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from strata.kernels import cpu_gemv

try:
    import numba
    from numba import njit, prange
except ImportError:  # pragma: no cover - exercised only where numba is absent
    numba = None

INT8_PREFILL_MAX_RATIO = 8.0
INT8_PREFILL_ENV = "STRATA_INT8_PREFILL"


def int8_prefill_enabled() -> bool:
    """Whether an int8 weight marked "int8" may run the W8A8 prefill GEMM here (asked for with
    STRATA_INT8_PREFILL=w8a8, numba and torch._int_mm present, int8 activations not switched off)."""
    return (numba is not None and hasattr(torch, "_int_mm")
            and os.environ.get(INT8_PREFILL_ENV, "") == "w8a8"
            and os.environ.get("STRATA_INT8_FP32_ACTIVATIONS", "") in ("", "0"))


if numba is not None:

    @njit(parallel=True, fastmath=True, cache=True)
    def _quant_per_row(x, xq, xs, ratio):  # pragma: no cover - compiled
        """xq[r] = round(x[r] / xs[r]) (half to even), xs[r] = max|x[r]| / 127 (1 for a zero row),
        ratio[r] = max|x[r]| / rms(x[r]) (0 for a zero row: the W8A8 guard)."""
        rows, n = x.shape
        for r in prange(rows):
            m = np.float32(0.0)
            ss = np.float32(0.0)
            for c in range(n):
                v = x[r, c]
                m = max(m, abs(v))
                ss += v * v
            scale = m / np.float32(127.0) if m > 0 else np.float32(1.0)
            inv = np.float32(1.0) / scale
            for c in range(n):
                xq[r, c] = np.int8(np.rint(x[r, c] * inv))
            xs[r] = scale
            ratio[r] = m / np.sqrt(ss / np.float32(n)) if ss > 0 else np.float32(0.0)

    @njit(parallel=True, fastmath=True, cache=True)
    def _scale_products(acc, xs, ws, out):  # pragma: no cover - compiled
        """out[r, c] = acc[r, c] * xs[r] * ws[c]: int32 products back to fp32."""
        for r in prange(acc.shape[0]):
            for c in range(acc.shape[1]):
                out[r, c] = np.float32(acc[r, c]) * (xs[r] * ws[c])


def matmul(x: torch.Tensor, w: np.ndarray, s: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W.T by W8A8: per-row int8 activations, torch._int_mm; the indices of the rows with
    max|x| > INT8_PREFILL_MAX_RATIO x their rms, whose output rows the caller recomputes). Each row
    is decided on its own, so its numbers do not depend on the other rows of the batch."""
    rows, n_in = x.shape
    xq = np.empty((rows, n_in), np.int8)
    xs, ratio = np.empty(rows, np.float32), np.empty(rows, np.float32)
    cpu_gemv.sync_threads()
    _quant_per_row(x.numpy(), xq, xs, ratio)
    acc = torch._int_mm(torch.from_numpy(xq), torch.from_numpy(w).t())
    out = np.empty((rows, w.shape[0]), np.float32)
    _scale_products(acc.numpy(), xs, s, out)
    return torch.from_numpy(out), torch.from_numpy(np.flatnonzero(ratio > INT8_PREFILL_MAX_RATIO))
