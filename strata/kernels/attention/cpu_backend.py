"""The "cpu" backend: decodes through the numba kernel of kernels/cpu_attention.py, which reads K/V
straight from the blocks (context lengths, no padding mask); prefill chunks use SDPA.

All-decode steps with few fp32 rows also fuse rotary, the KV write and attention: one numba pass
(kernels/cpu_rope.py) rotates q and k of the fused qkv projection and stores k and v, then the
paged-decode kernel runs.
"""

from __future__ import annotations

import torch

from strata.kernels import cpu_attention, cpu_rope
from strata.kernels.attention.base import AttentionBackend
from strata.kernels.attention.common import gathered_decode, sdpa_attend


class CpuBackend(AttentionBackend):
    name = "cpu"
    uses_decode_mask = False

    def unavailable(self, device: str, dtype: torch.dtype) -> str | None:
        if str(device) == "cpu" and dtype == torch.float32 and cpu_attention.available():
            return None
        return "needs numba, device cpu and dtype float32"

    def decode(self, q, kv_cache, block_tables, context_lens, mask, scale, window=None) -> torch.Tensor:
        if not cpu_attention.reads_cache(kv_cache):  # e.g. bf16 with an odd head_dim: widened, then SDPA
            return gathered_decode(q, kv_cache, block_tables, None, scale, sdpa_attend, context_lens, window)
        return cpu_attention.paged_decode(q, kv_cache, block_tables, context_lens, scale, window)

    def fused_decode_usable(self, qkv: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        return cpu_rope.usable(qkv, kv_cache)

    def fused_decode(
        self, qkv, rope, kv_cache, slots, block_tables, context_lens, heads, kv_heads, scale, window=None,
    ) -> torch.Tensor:
        q = cpu_rope.rope_and_store(qkv, rope, slots, kv_cache, heads, kv_heads)
        return cpu_attention.paged_decode(q, kv_cache, block_tables, context_lens, scale, window)
