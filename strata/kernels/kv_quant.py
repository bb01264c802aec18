"""A quantised KV cache (kv_cache_dtype int8 | fp8): its layout and its torch reference twin.

Each (token, KV head) row of K and of V is stored as head_dim 1-byte values followed by that
row's fp32 scale (SCALE_BYTES more elements of the 1-byte dtype): symmetric, scale = absmax / QMAX,
value = round(x / scale). So one layer's cache is still one tensor
[2, num_blocks, block_size, kv_heads, head_dim + SCALE_BYTES], and everything that moves blocks
by id (fork copies, swap to and from the host pool, prefix-cache sharing, the scratch block) moves
the scales with them without knowing they are there: the scale tensor is the same tensor's last
columns, indexed by the same block ids.

int8 is the CPU kernels' format (kernels/cpu_rope.py quantises on write, cpu_attention.py reads
the int8 rows and scales in its dot-product loops). fp8 (float8_e4m3fn) is read only through
these torch functions: the gathered blocks dequantised (kernels/attention/common.py), on CPU and
CUDA alike. `quantise` / `dequantise` are also the twins the CPU kernels are tested against.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one fp32 scale per row, in elements of the 1-byte storage dtype
# the largest stored magnitude: int8's (symmetric: -128 unused), float8_e4m3fn's largest finite
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def is_quantised(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of one cached (token, KV head) row: head_dim, plus the scale's for a quantised cache."""
    return head_dim + SCALE_BYTES if is_quantised(dtype) else head_dim


def head_dim_of(kv_cache: torch.Tensor) -> int:
    """The head_dim a cache tensor holds (its last dimension less the scale's columns)."""
    return kv_cache.shape[-1] - (SCALE_BYTES if is_quantised(kv_cache.dtype) else 0)


def quantise(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows x [..., head_dim] -> packed [..., head_dim + SCALE_BYTES] of `dtype`: the values, then
    the row's fp32 scale's bytes. Computed in fp32: inv = QMAX / absmax, value = round(x * inv)
    (half to even; cpu_rope's store does the same ops, so the twins agree bit for bit)."""
    qmax = QMAX[dtype]
    x = x.float()
    absmax = x.abs().amax(-1, keepdim=True)
    scale = absmax / qmax
    inv = torch.where(absmax > 0, qmax / absmax, torch.zeros_like(absmax))  # an all-zero row stays 0
    y = x * inv
    if dtype == torch.int8:
        values = y.round().clamp(-qmax, qmax).to(torch.int8).view(torch.uint8)
    else:
        values = y.clamp(-qmax, qmax).to(dtype).view(torch.uint8)
    return torch.cat([values, scale.view(torch.uint8)], dim=-1).view(dtype)


def dequantise(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed rows [..., head_dim + SCALE_BYTES] -> values * scale [..., head_dim] in `dtype`."""
    d = packed.shape[-1] - SCALE_BYTES
    scale = packed[..., d:].contiguous().view(torch.float32)
    return (packed[..., :d].float() * scale).to(dtype)


def widen(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows as `dtype`: dequantised where the cache is quantised, else cast."""
    return dequantise(kv, dtype) if is_quantised(kv.dtype) else kv.to(dtype)
