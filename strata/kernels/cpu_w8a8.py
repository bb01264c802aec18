"""W8A8 prefill GEMM for int8 and int4 weights on CPU (path "int8", kernels/cpu_gemm.py; cpu_quant.matmul
calls it).

Many input rows quantised to int8 per row, one integer GEMM (torch._int_mm: oneDNN's u8s8 kernels,
measured ~2x oneDNN's bf16 GEMM on the Zen 4 VM, 2.2x on a Zen 5), the int32 products scaled back
by row scale x weight-row scale. One scale per row is much coarser than the decode kernels'
per-64-column groups where a row has outlier channels, so a row with max|x| > the weight format's
ratio x rms(x) is refused: the caller computes it another way (the decode kernel for up to
MAX_ROWS such rows, else the fallback path), and the integer GEMM runs on the other rows only.
Below the ratio, the rounding noise per element is at most ~ratio / (127 * sqrt(12)) of the row's
rms (random activations: max/rms ~ 3.5-4.5, ~1% relative error of the product measured).

int8 weights (ratio 8: ~1.8% of the rms at most): opt-in, STRATA_INT8_PREFILL=w8a8. It roughly
halves int8 prefill time, but on the tiny random test models it moved greedy agreement with fp32
both ways (llama first tokens 0.94 -> 1.00, qwen2 0.94 -> 0.81 on 16 prompts; 256 prompts: equal),
and its expected error is ~2.5x the default prefill's (~1% against ~0.3% for the bf16 path; the
int8 weights' own rounding ~0.9%), so int8 keeps its accuracy unless asked.

int4 weights (ratio 16: ~3.6% of the rms at most): on by default (STRATA_INT4_PREFILL=dequant turns
it off). Each call requantises the int4 weight to int8 per output row (quant_formats.
requantize_int4_ref: at most half a step of the row's int8 grid added, ~0.8% of the weight measured
on random weights) by table lookup (cpu_simd.i4_row_int8_lut, ~0.2 ms for qwen-0.5b's 4864 x 896
gate on a Zen 5), then the GEMM above. The int4 weights' own rounding is ~9.5% of the product, so
this path's ~1.1% (against ~0.3% for the bf16 dequantise-and-GEMM path) is lost in it, while the
GEMM runs ~2x the rate: llama.cpp's q4_0 prefill multiplies by int8 activations too.
STRATA_INT4_FP32_ACTIVATIONS=1 or STRATA_INT8_FP32_ACTIVATIONS=1 also turn it off.

Reference twins: quant_formats.quantize_activations_ref(x, in_features) for the rows,
requantize_int4_ref for an int4 weight, then dequantise + F.linear.
"""

from __future__ import annotations

import numpy as np
import torch

from strata.errors import ConfigError
from strata.kernels import cpu_gemv
from strata.settings import SETTINGS

try:
    import numba
    from numba import njit, prange

    from strata.kernels.cpu_simd import has_ssse3, i4_row_int8_lut
except ImportError:  # pragma: no cover - exercised only where numba is absent
    numba = None

INT8_PREFILL_MAX_RATIO = 8.0
INT4_PREFILL_MAX_RATIO = 16.0
INT8_PREFILL_ENV = "STRATA_INT8_PREFILL"
INT4_PREFILL_ENV = "STRATA_INT4_PREFILL"
# The int4 weight is requantised into one reused int8 buffer, in tiles of at most this many bytes
# (an LM head); a fresh multi-MB buffer per call would pay its page faults every time.
INT8_TILE_BYTES = 32 << 20
_int8_scratch: list[np.ndarray] = []


def _fp32_activations_asked(method: str) -> bool:
    return SETTINGS.int8_fp32_activations or (method == "int4" and SETTINGS.int4_fp32_activations)


def prefill_enabled(method: str) -> bool:
    """Whether a weight of `method` marked "int8" may run the W8A8 prefill GEMM here: numba and
    torch._int_mm present, int8 activations not switched off, and for int8 weights
    STRATA_INT8_PREFILL=w8a8 asked for it, for int4 weights SSSE3 present and
    STRATA_INT4_PREFILL not "dequant"."""
    if numba is None or not hasattr(torch, "_int_mm") or _fp32_activations_asked(method):
        return False
    if method == "int8":
        return SETTINGS.int8_prefill == "w8a8"
    if SETTINGS.int4_prefill not in ("w8a8", "dequant"):
        raise ConfigError(f"{INT4_PREFILL_ENV}={SETTINGS.int4_prefill!r}: choose w8a8 (int8 activations, "
                          "the default) or dequant (int4 weights dequantised for the narrow weights' GEMM)")
    return method == "int4" and has_ssse3() and SETTINGS.int4_prefill == "w8a8"


def int8_prefill_enabled() -> bool:
    return prefill_enabled("int8")


if numba is not None:

    @njit(parallel=True, fastmath=True, cache=True, boundscheck=False)
    def _quant_per_row(x, xq, xs, ratio):  # pragma: no cover - compiled
        """xq[r] = round(x[r] / xs[r]) (half to even), xs[r] = max|x[r]| / 127 (1 for a zero row),
        ratio[r] = max|x[r]| / rms(x[r]) (0 for a zero row: the W8A8 guard). Separate passes so
        each loop vectorises (measured ~2x one fused loop)."""
        rows, n = x.shape
        for r in prange(rows):
            xr, qr = x[r], xq[r]
            m = np.float32(0.0)
            for c in range(n):
                m = max(m, abs(xr[c]))
            ss = np.float32(0.0)
            for c in range(n):
                ss += xr[c] * xr[c]
            scale = m / np.float32(127.0) if m > 0 else np.float32(1.0)
            inv = np.float32(1.0) / scale
            for c in range(n):
                qr[c] = np.int8(np.rint(xr[c] * inv))
            xs[r] = scale
            ratio[r] = m / np.sqrt(ss / np.float32(n)) if ss > 0 else np.float32(0.0)

    @njit(parallel=True, fastmath=True, cache=True)
    def _scale_products(acc, xs, ws, out):  # pragma: no cover - compiled
        """out[r, c] = acc[r, c] * xs[r] * ws[c]: int32 products back to fp32."""
        for r in prange(acc.shape[0]):
            for c in range(acc.shape[1]):
                out[r, c] = np.float32(acc[r, c]) * (xs[r] * ws[c])

    @njit(parallel=True, fastmath=True, cache=True, boundscheck=False)
    def _int4_to_int8(w, s, out, out_scale, group, threads):  # pragma: no cover - compiled
        """quant_formats.requantize_int4_ref, bit for bit: per row its int8 scale and each group's
        16 int8 values, then the packed nibbles looked up."""
        n_out, ng = s.shape
        per = (n_out + threads - 1) // threads
        for t in prange(threads):
            tables = np.empty((ng, 16), np.int8)
            for r in range(t * per, min(n_out, (t + 1) * per)):
                sr = s[r]
                m = np.float32(0.0)
                for g in range(ng):
                    m = max(m, abs(sr[g]))
                row = m * np.float32(8.0 / 127.0) if m > 0 else np.float32(1.0)
                inv = np.float32(1.0) / row
                out_scale[r] = row
                for g in range(ng):
                    fixed = np.int64(np.rint(sr[g] * inv * np.float32(65536.0)))
                    for q in range(16):
                        tables[g, q] = np.int8(((q - 8) * fixed + 32768) >> 16)
                i4_row_int8_lut(w[r], tables, out[r], group // 2)


def _rows(x: torch.Tensor, max_ratio: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(int8 rows, their scales, indices of the refused rows): the rows W8A8 takes, compacted."""
    rows, n_in = x.shape
    xq = np.empty((rows, n_in), np.int8)
    xs, ratio = np.empty(rows, np.float32), np.empty(rows, np.float32)
    cpu_gemv.sync_threads()
    _quant_per_row(x.numpy(), xq, xs, ratio)
    refused = np.flatnonzero(ratio > max_ratio)
    if refused.size:
        kept = ratio <= max_ratio
        xq, xs = xq[kept], xs[kept]
    return xq, xs, refused


def _product(xq: np.ndarray, xs: np.ndarray, w8: np.ndarray, s8: np.ndarray, out: np.ndarray) -> None:
    if xq.shape[0]:
        _scale_products(torch._int_mm(torch.from_numpy(xq), torch.from_numpy(w8).t()).numpy(), xs, s8, out)


def _scatter(kept_out: np.ndarray, rows: int, refused: np.ndarray) -> torch.Tensor:
    """The kept rows' products back at their rows; refused rows zero (the caller fills them)."""
    if not refused.size:
        return torch.from_numpy(kept_out)
    out = torch.zeros(rows, kept_out.shape[1])
    kept = np.ones(rows, bool)
    kept[refused] = False
    out[torch.from_numpy(kept)] = torch.from_numpy(kept_out)
    return out


def matmul(x: torch.Tensor, w: np.ndarray, s: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W.T by W8A8 for an int8 weight; the indices of the rows with max|x| >
    INT8_PREFILL_MAX_RATIO x their rms, whose output rows the caller computes). Each row is
    decided on its own, and integer products do not depend on the other rows, so a row's numbers
    do not depend on the rest of the batch."""
    xq, xs, refused = _rows(x, INT8_PREFILL_MAX_RATIO)
    out = np.empty((xq.shape[0], w.shape[0]), np.float32)
    _product(xq, xs, w, s, out)
    return _scatter(out, x.shape[0], refused), torch.from_numpy(refused)


def _int8_buffer(elements: int) -> np.ndarray:
    if not _int8_scratch or _int8_scratch[0].size < elements:
        _int8_scratch[:] = [np.empty(elements, np.int8)]
    return _int8_scratch[0]


def requantize_int4(w: np.ndarray, s: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(int8 [rows, in], fp32 scale [rows]) of packed int4 rows: requantize_int4_ref. The int8
    rows live in the reused buffer: valid until the next call."""
    n_out, n_in = w.shape[0], w.shape[1] * 2
    w8 = _int8_buffer(n_out * n_in)[: n_out * n_in].reshape(n_out, n_in)
    s8 = np.empty(n_out, np.float32)
    _int4_to_int8(w, s, w8, s8, group_size, cpu_gemv.sync_threads())
    return w8, s8


def matmul_int4(x: torch.Tensor, w: np.ndarray, s: np.ndarray, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """matmul for a packed int4 weight (quant_formats.py), requantised to int8 per call in tiles
    of at most INT8_TILE_BYTES rows' worth; refuses rows above INT4_PREFILL_MAX_RATIO."""
    xq, xs, refused = _rows(x, INT4_PREFILL_MAX_RATIO)
    n_out, n_in = w.shape[0], x.shape[1]
    out = np.empty((xq.shape[0], n_out), np.float32)
    if xq.shape[0]:
        tile_rows = max(16, min(n_out, INT8_TILE_BYTES // n_in))
        for r0 in range(0, n_out, tile_rows):
            r1 = min(n_out, r0 + tile_rows)
            w8, s8 = requantize_int4(w[r0:r1], s[r0:r1], group_size)
            _product(xq, xs, w8, s8, out[:, r0:r1])
    return _scatter(out, x.shape[0], refused), torch.from_numpy(refused)
