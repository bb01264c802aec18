"""The "triton" backend: decodes through the split-K Triton kernel of
kernels/triton/paged_attention.py on CUDA (its torch twin elsewhere), imported only when used, so
CPU runs never import triton; reads context lengths, no padding mask. Prefill chunks use SDPA."""

from __future__ import annotations

import torch

from strata.kernels import kv_quant
from strata.kernels.attention.base import AttentionBackend
from strata.kernels.attention.common import gathered_decode


class TritonBackend(AttentionBackend):
    name = "triton"
    uses_decode_mask = False

    def unavailable(self, device: str, dtype: torch.dtype | None = None) -> str | None:
        reason = "needs a CUDA device and triton (pip install 'strata[triton]')"
        if not str(device).startswith("cuda"):
            return reason
        from strata.kernels.triton import (
            available,  # reason: triton is optional; imported only for a CUDA device
        )

        return None if available() else reason

    def decode(self, q, kv_cache, block_tables, context_lens, mask, scale, window=None) -> torch.Tensor:
        if window is not None:  # the split-K kernel has no window: the gathered path masks it
            return self.windowed_decode(q, kv_cache, block_tables, context_lens, scale, window)
        if kv_quant.is_quantised(kv_cache.dtype):  # nor scales (fp8): the gathered blocks, dequantised
            return gathered_decode(q, kv_cache, block_tables, None, scale, self.attend, context_lens)
        from strata.kernels.triton.paged_attention import (
            paged_decode_attention,  # reason: triton is optional
        )

        return paged_decode_attention(q, kv_cache, block_tables, context_lens, scale)
