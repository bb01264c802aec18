"""AttentionMetadata: what attention needs for one step, built once by the runner, shared by all layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kernels.attention.base import AttentionBackend
from strata.kernels.attention.common import PrefillSpan
from strata.kernels.attention.registry import SDPA, get_backend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: flat cache slot (block * block_size + offset) per token
    prefills: list[PrefillSpan]
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] long (padded with block 0)
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool (when backend.uses_decode_mask)
    decode_context_lens: torch.Tensor | None = None  # [B] long, tokens incl. the new one
    # the step's backend (registry.py); a backend name is accepted and resolved to it
    backend: AttentionBackend = SDPA

    def __post_init__(self) -> None:
        if isinstance(self.backend, str):
            self.backend = get_backend(self.backend)
