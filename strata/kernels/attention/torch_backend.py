"""The "torch" backend: explicit matmul + softmax in fp32 over gathered K/V, the reference."""

from __future__ import annotations

import torch

from strata.kernels.attention.base import AttentionBackend
from strata.kernels.attention.common import gathered_decode, reference_attend


class TorchBackend(AttentionBackend):
    name = "torch"
    uses_decode_mask = True

    def attend(self, q, k, v, mask, causal, scale) -> torch.Tensor:
        return reference_attend(q, k, v, mask, causal, scale)

    def decode(self, q, kv_cache, block_tables, context_lens, mask, scale, window=None) -> torch.Tensor:
        return gathered_decode(q, kv_cache, block_tables, mask, scale, reference_attend, context_lens, window)
