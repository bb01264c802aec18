"""Fused rotary embedding + KV-cache write for decode on CPU (numba).

At decode's few rows, rotating q and k and storing k/v into their cache slots is ~15 small torch
ops per layer (slices, cat, neg, mul, add, index_copy). This kernel does it in one pass over the
fused qkv projection output: rotated q comes back, rotated k and v land in the paged cache. Its
reference twin is `graph.layers.apply_rotary` + `attention.write_kv`; tests compare the two.
"""

from __future__ import annotations

import numpy as np
import torch

from strata.kernels import cpu_attention, cpu_gemv
from strata.kernels.dispatch import kernel

try:
    import numba
    from numba import njit
except ImportError:  # pragma: no cover
    numba = None

MAX_ROWS = 16


def available() -> bool:
    return numba is not None


if numba is not None:
    from numba import types
    from numba.extending import overload

    from strata.kernels import cpu_quant

    def store_row(cache_row, values):
        """cache_row[:] = values, rounded to bf16 (nearest even) for a bf16 cache's uint16 bits,
        quantised for an int8 cache (values, then the scale: kernels/kv_quant.py)."""

    @njit(cache=True, inline="always")
    def _quantise_row(cache_row, values):  # pragma: no cover - compiled
        """kv_quant.quantise's ops, in its order: inv = 127 / absmax, value = rint(x * inv) (half to
        even, as torch.round), scale = absmax / 127 in the row's last 4 bytes."""
        d = values.shape[0]
        m = np.float32(0.0)
        for c in range(d):
            m = max(m, abs(values[c]))
        inv = np.float32(127.0) / m if m > 0 else np.float32(0.0)
        for c in range(d):
            cache_row[c] = np.int8(np.rint(values[c] * inv))
        cache_row[d:].view(np.float32)[0] = m / np.float32(127.0)

    @overload(store_row)
    def _store_row(cache_row, values):
        if cache_row.dtype == types.uint16:
            return lambda cache_row, values: cpu_quant._round_bf16(values, cache_row)
        if cache_row.dtype == types.int8:
            return lambda cache_row, values: _quantise_row(cache_row, values)

        def copy(cache_row, values):
            for c in range(values.shape[0]):
                cache_row[c] = values[c]
        return copy

    @njit(cache=True)
    def _rope_store(qkv, cos, sin, slots, k_cache, v_cache, heads, kv_heads, q_out):  # pragma: no cover
        """k_cache / v_cache: fp32, a bf16 cache's uint16 bit patterns or int8 rows with their scale
        (kv_cache_dtype)."""
        rows = qkv.shape[0]
        dim = cos.shape[1]
        half = dim // 2
        block = k_cache.shape[1]
        row = np.empty(dim, np.float32)
        for t in range(rows):
            blk = slots[t] // block
            off = slots[t] % block
            for h in range(heads + kv_heads):
                base = h * dim
                for d in range(half):
                    x1 = qkv[t, base + d]
                    x2 = qkv[t, base + d + half]
                    r1 = x1 * cos[t, d] + (-x2) * sin[t, d]
                    r2 = x2 * cos[t, d + half] + x1 * sin[t, d + half]
                    if h < heads:
                        q_out[t, h, d] = r1
                        q_out[t, h, d + half] = r2
                    else:
                        row[d] = r1
                        row[d + half] = r2
                if h >= heads:
                    store_row(k_cache[blk, off, h - heads], row)
            vbase = (heads + kv_heads) * dim
            for kh in range(kv_heads):
                for d in range(dim):
                    row[d] = qkv[t, vbase + kh * dim + d]
                store_row(v_cache[blk, off, kh], row)


def usable(qkv: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Few fp32 CPU rows (cpu_gemv.few_fp32_rows asks the kernel mode first) and a cache the decode
    kernel reads (cpu_attention.reads_cache: fp32, or bf16 or int8 from kv_cache_dtype)."""
    return cpu_gemv.few_fp32_rows(qkv, qkv, MAX_ROWS) and cpu_attention.reads_cache(kv_cache)


@kernel("rope_and_store")
def rope_and_store(
    qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor,
    kv_cache: torch.Tensor, heads: int, kv_heads: int,
) -> torch.Tensor:
    """Rotate q and k of the fused qkv rows [T, (heads + 2 kv_heads) * d]; store k, v at `slots`.

    Returns rotated q as [T, heads, d].
    """
    cos, sin = rope
    rows, dim = qkv.shape[0], cos.shape[-1]
    qkv = qkv.contiguous()
    q = torch.empty(rows, heads, dim, dtype=qkv.dtype)
    _rope_store(
        qkv.numpy(), cos.reshape(rows, dim).contiguous().numpy(), sin.reshape(rows, dim).contiguous().numpy(),
        slots.numpy(), *cpu_attention.cache_views(kv_cache), heads, kv_heads, q.numpy(),
    )
    return q
