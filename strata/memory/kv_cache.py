"""The paged KV cache tensors: one [2, num_blocks, block_size, kv_heads, head_dim] per layer."""

from __future__ import annotations

import torch

from strata.model_config import ModelConfig


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """One layer's paged KV tensor: [K|V, block, slot in block, kv head, head dim]."""
    return (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str
) -> list[torch.Tensor]:
    shape = kv_cache_shape(cfg, num_blocks, block_size)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]


def copy_blocks(kv_caches: list[torch.Tensor], copies: list[tuple[int, int]]) -> None:
    """Copy whole blocks src -> dst in every layer (used when forking a partial block)."""
    if not copies:
        return
    src = torch.tensor([s for s, _ in copies], device=kv_caches[0].device)
    dst = torch.tensor([d for _, d in copies], device=kv_caches[0].device)
    for cache in kv_caches:
        cache[:, dst] = cache[:, src]
