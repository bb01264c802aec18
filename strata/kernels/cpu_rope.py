"""Fused rotary embedding + KV-cache write for decode on CPU (numba).

At decode's few rows, rotating q and k and storing k/v into their cache slots is ~15 small torch
ops per layer (slices, cat, neg, mul, add, index_copy). This kernel does it in one pass over the
fused qkv projection output: rotated q comes back, rotated k and v land in the paged cache. Its
reference twin is `graph.layers.apply_rotary` + `attention.write_kv`; tests compare the two.
"""

from __future__ import annotations

import torch

from strata.kernels import cpu_gemv
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

    @njit(cache=True)
    def _rope_store(qkv, cos, sin, slots, k_cache, v_cache, heads, kv_heads, q_out):  # pragma: no cover
        rows = qkv.shape[0]
        dim = cos.shape[1]
        half = dim // 2
        block = k_cache.shape[1]
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
                        k_cache[blk, off, h - heads, d] = r1
                        k_cache[blk, off, h - heads, d + half] = r2
            vbase = (heads + kv_heads) * dim
            for kh in range(kv_heads):
                for d in range(dim):
                    v_cache[blk, off, kh, d] = qkv[t, vbase + kh * dim + d]


def usable(qkv: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Few fp32 CPU rows and a contiguous cache (cpu_gemv.few_fp32_rows asks the kernel mode first)."""
    return cpu_gemv.few_fp32_rows(qkv, kv_cache, MAX_ROWS) and kv_cache.is_contiguous()


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
        slots.numpy(), kv_cache[0].numpy(), kv_cache[1].numpy(), heads, kv_heads, q.numpy(),
    )
    return q
