"""Paged decode attention on CPU (numba): reads each cached K/V row once, straight from its block.

The torch paths gather every sequence's blocks into a padded copy and then run SDPA over it, so
decode attention moves the KV cache three times; profiled on a 16-request batch, the gather and
SDPA were 65% of step time. This kernel walks the block table instead: per (sequence, KV head),
scores for the query heads of that group, a softmax, then the weighted sum of V. Its reference
twin is the "torch" attention backend's decode (kernels/attention/torch_backend.py); tests compare
the two. It is the "cpu" backend's decode (kernels/attention/cpu_backend.py).
"""

from __future__ import annotations

import numpy as np
import torch

from strata.kernels import cpu_gemv
from strata.kernels.dispatch import KERNEL_MODE, kernel

try:
    import numba
    from numba import njit, prange
except ImportError:  # pragma: no cover
    numba = None


def available() -> bool:
    return numba is not None


if numba is not None:

    @njit(parallel=True, fastmath=True, cache=True)
    def _paged_decode(q, k_cache, v_cache, tables, lens, scale, window, out):  # pragma: no cover - compiled
        batch, heads, dim = q.shape
        block = k_cache.shape[1]
        kv_heads = k_cache.shape[2]
        group = heads // kv_heads
        for item in prange(batch * kv_heads):
            b = item // kv_heads
            kh = item % kv_heads
            first = 0 if window <= 0 else max(0, lens[b] - window)  # sliding window: the last `window` keys
            length = lens[b] - first
            h0 = kh * group
            scores = np.empty((group, length), np.float32)
            for t in range(length):
                blk = tables[b, (first + t) // block]
                off = (first + t) % block
                for g in range(group):
                    s = np.float32(0.0)
                    for d in range(dim):
                        s += q[b, h0 + g, d] * k_cache[blk, off, kh, d]
                    scores[g, t] = s * scale
            acc = np.zeros((group, dim), np.float32)
            for g in range(group):
                m = scores[g, 0]
                for t in range(1, length):
                    m = max(m, scores[g, t])
                total = np.float32(0.0)
                for t in range(length):
                    e = np.exp(scores[g, t] - m)
                    scores[g, t] = e
                    total += e
                for t in range(length):
                    scores[g, t] /= total
            for t in range(length):
                blk = tables[b, (first + t) // block]
                off = (first + t) % block
                for g in range(group):
                    p = scores[g, t]
                    for d in range(dim):
                        acc[g, d] += p * v_cache[blk, off, kh, d]
            for g in range(group):
                for d in range(dim):
                    out[b, h0 + g, d] = acc[g, d]


def usable(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (
        KERNEL_MODE.get().fast_paths
        and numba is not None
        and q.device.type == "cpu"
        and q.dtype == torch.float32
        and kv_cache.dtype == torch.float32
        and kv_cache.is_contiguous()
    )


@kernel("paged_decode")
def paged_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
    scale: float, window: int | None = None,
) -> torch.Tensor:
    """q [B, heads, d] over the paged cache [2, blocks, block_size, kv_heads, d] -> [B, heads * d];
    `window`: attend only to each sequence's last `window` tokens (None: all)."""
    q = q.contiguous()
    out = torch.empty_like(q)
    cpu_gemv.sync_threads()
    _paged_decode(
        q.numpy(), kv_cache[0].numpy(), kv_cache[1].numpy(), block_tables.numpy(),
        context_lens.numpy(), np.float32(scale), np.int64(window or 0), out.numpy(),
    )
    return out.view(q.shape[0], -1)
