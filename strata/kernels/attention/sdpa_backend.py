"""The "sdpa" backend: torch.nn.functional.scaled_dot_product_attention over gathered K/V."""

from __future__ import annotations

import torch

from strata.kernels.attention.base import AttentionBackend
from strata.kernels.attention.common import gathered_decode, sdpa_attend


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    uses_decode_mask = True

    def decode(self, q, kv_cache, block_tables, context_lens, mask, scale, window=None) -> torch.Tensor:
        return gathered_decode(q, kv_cache, block_tables, mask, scale, sdpa_attend, context_lens, window)
