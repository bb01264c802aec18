"""GGUF quantised blocks as (codes, scales, zeros): the exact form Strata's grouped layouts hold.

Every block type here dequantises, in llama.cpp's own formulas (ggml-quants.c, and the `gguf`
package's numpy twins), to `scale * code - zero` per group of columns, with integer codes:

| type | group | code | scale | zero |
|---|---|---|---|---|
| Q8_0 | 32 | the int8 as stored | d | - |
| Q4_0 | 32 | nibble - 8 | d | - |
| Q5_0 | 32 | 5-bit value - 16 | d | - |
| Q4_1 | 32 | nibble | d | -m |
| Q5_1 | 32 | 5-bit value | d | -m |
| Q4_K | 32 | nibble | d * sc (6-bit) | dmin * m (6-bit) |
| Q5_K | 32 | 5-bit value | d * sc | dmin * m |
| Q6_K | 16 | 6-bit value - 32 | d * sc (int8) | - |

d / dmin / m are fp16; their products with 6- or 8-bit integers are exact in fp32, so each
(scale, zero) pair is the file's to the bit. `decompose` returns them for rows of raw blocks;
graph/gguf_weights.py writes them into int8 (any type) or int4 (codes within 16 levels) storage.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

# type -> (group of columns, block bytes, has zero points)
BLOCKS = {
    T.Q8_0: (32, 34, False), T.Q4_0: (32, 18, False), T.Q5_0: (32, 22, False), T.Q4_1: (32, 20, True),
    T.Q5_1: (32, 24, True), T.Q4_K: (32, 144, True), T.Q5_K: (32, 176, True), T.Q6_K: (16, 210, False),
}
NIBBLE_CODES = (T.Q4_0, T.Q4_1, T.Q4_K)  # codes within 16 levels: int4 storage holds them
K_BLOCK = 256  # columns per K-quant super-block


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """16 bytes a block -> 32 values: low nibbles first, then high (Q4_0/Q4_1/Q5_0/Q5_1 order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """4 bytes (a little-endian uint32) a block -> bit k of it for each of the 32 values."""
    bits = np.ascontiguousarray(qh).view(np.uint32)
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant's 12 scale bytes -> (sc, m) [blocks, 8] 6-bit integers (ggml get_scale_min_k4)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def decompose(kind: T, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """Raw rows (uint8 [rows, row_bytes]) -> (codes int8 [rows, cols], scale fp32 [rows, groups],
    zero fp32 [rows, groups] or None, group): dequantised = scale * code - zero (module docstring)."""
    group, size, _ = BLOCKS[kind]
    rows = raw.shape[0]
    b = raw.reshape(-1, size)  # one block a row
    zero = None
    if kind == T.Q8_0:
        scale, codes = _f16(b[:, :2]), b[:, 2:].view(np.int8)
    elif kind == T.Q4_0:
        scale, codes = _f16(b[:, :2]), _nibbles32(b[:, 2:]).astype(np.int8) - 8
    elif kind == T.Q5_0:
        scale = _f16(b[:, :2])
        codes = (_nibbles32(b[:, 6:]) | (_high_bits32(b[:, 2:6]) << 4)).astype(np.int8) - 16
    elif kind == T.Q4_1:
        scale, zero = _f16(b[:, :2]), -_f16(b[:, 2:4])
        codes = _nibbles32(b[:, 4:]).astype(np.int8)
    elif kind == T.Q5_1:
        scale, zero = _f16(b[:, :2]), -_f16(b[:, 2:4])
        codes = (_nibbles32(b[:, 8:]) | (_high_bits32(b[:, 4:8]) << 4)).astype(np.int8)
    elif kind in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, mn = _k_scales(b[:, 4:16])
        scale, zero = d * sc, dmin * mn  # [blocks, 8]: exact (11-bit times 6-bit)
        qs = b[:, -128:].reshape(-1, 4, 32)  # 4 chunks of 64 values: low nibbles 32, then high 32
        low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
        if kind == T.Q5_K:  # bit i of qh[k]: the fifth bit of sub-block i's value k
            qh = b[:, 16:48]
            low = low | (((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
        codes = low.astype(np.int8)
    elif kind == T.Q6_K:
        ql = b[:, :128].reshape(-1, 2, 64)  # 2 halves of 128 values
        qh = b[:, 128:192].reshape(-1, 2, 32)
        sc = b[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(b[:, 208:210])
        low = np.stack([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 2, 4, 32)  # [.., 4 x 32 values]
        high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)  # [.., 2, 4, 32]
        codes = ((low | (high << 4)).astype(np.int8) - 32).reshape(-1, 256)
        scale = d * sc  # [blocks, 16]
    else:
        raise KeyError(kind)
    cols = codes.size // rows
    return (np.ascontiguousarray(codes.reshape(rows, cols)), scale.reshape(rows, cols // group),
            None if zero is None else zero.reshape(rows, cols // group), group)
