"""GGUF K-quant blocks straight into Strata's layouts, in one compiled pass (graph/gguf_weights.py).

The numpy decomposition (graph/gguf_blocks.decompose, the reference twin) builds int8 codes for
every value and then repacks them: ~60 M values/s, so a 1.5B Q4_K_M file spent ~5 s of its
load there (its Q6_K token_embd alone ~2.5 s). These loops read each block once and write the
destination rows directly:

- Q4_K -> int4 group 32 with zero points: per 32-value sub-block the nibbles regrouped into
  quant_formats' byte order (byte k = column k | column k + 16 << 4), scale d * sc and zero
  dmin * m - 8 * scale (the nibble's -8 folded in, as gguf_weights._blocks_into does).
- Q6_K -> int8 grouped by 16: the 6-bit values minus 32, scale d * sc.

The fp16 super-block scales are widened in numpy first (numba has no float16 arithmetic).
"""

from __future__ import annotations

import numpy as np

try:
    from numba import njit, prange
except ImportError:  # pragma: no cover - exercised only where numba is absent
    njit = None


def available() -> bool:
    return njit is not None


def _fp16(raw: np.ndarray, size: int, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of every `size`-byte block, as fp32 [rows, blocks]."""
    blocks = raw.reshape(raw.shape[0], -1, size)
    return np.ascontiguousarray(blocks[:, :, at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def q4_k_into_int4z(raw: np.ndarray, qweight: np.ndarray, scale: np.ndarray) -> None:
    """Q4_K rows (uint8 [rows, blocks * 144]) -> int4 group-32 qweight [rows, cols / 2] and
    scale [rows, 2, cols / 32] (contiguous numpy views of the destination rows)."""
    _q4_k(raw, _fp16(raw, 144, 0), _fp16(raw, 144, 2), qweight, scale)


def q6_k_into_int8g16(raw: np.ndarray, qweight: np.ndarray, scale: np.ndarray) -> None:
    """Q6_K rows (uint8 [rows, blocks * 210]) -> int8 qweight [rows, cols] and scale [rows, cols / 16]."""
    _q6_k(raw, _fp16(raw, 210, 208), qweight, scale)


if njit is not None:

    @njit(parallel=True, cache=True)
    def _q4_k(raw, d, dmin, qweight, scale):  # pragma: no cover - compiled
        rows, nb = d.shape
        for r in prange(rows):
            for b in range(nb):
                blk = raw[r, b * 144:(b + 1) * 144]
                q = blk[4:16]
                qs = blk[16:144]
                for j in range(8):
                    if j < 4:
                        sc = np.int32(q[j] & 63)
                        m = np.int32(q[j + 4] & 63)
                    else:
                        sc = np.int32((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4))
                        m = np.int32((q[j + 4] >> 4) | ((q[j] >> 6) << 4))
                    g = b * 8 + j
                    s = d[r, b] * np.float32(sc)
                    scale[r, 0, g] = s
                    scale[r, 1, g] = dmin[r, b] * np.float32(m) - s * np.float32(8.0)
                    chunk = qs[(j // 2) * 32:(j // 2) * 32 + 32]
                    shift = 4 * (j % 2)
                    out = qweight[r, g * 16:g * 16 + 16]
                    for k in range(16):
                        lo = (chunk[k] >> shift) & 0xF
                        hi = (chunk[k + 16] >> shift) & 0xF
                        out[k] = np.uint8(lo | (hi << 4))

    @njit(parallel=True, cache=True)
    def _q6_k(raw, d, qweight, scale):  # pragma: no cover - compiled
        rows, nb = d.shape
        for r in prange(rows):
            for b in range(nb):
                blk = raw[r, b * 210:(b + 1) * 210]
                for sub in range(16):
                    scale[r, b * 16 + sub] = d[r, b] * np.float32(np.int8(blk[192 + sub]))
                for h in range(2):
                    ql = blk[h * 64:h * 64 + 64]
                    qh = blk[128 + h * 32:128 + h * 32 + 32]
                    for c in range(4):
                        base = b * 256 + h * 128 + c * 32
                        shift_l = 4 * (c // 2)
                        off = (c % 2) * 32
                        for k in range(32):
                            v = ((ql[off + k] >> shift_l) & 0xF) | (((qh[k] >> (2 * c)) & 3) << 4)
                            qweight[r, base + k] = np.int8(np.int32(v) - 32)
