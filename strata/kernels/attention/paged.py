"""A step's attention over the paged cache: the KV write, then one leaf that splits the step into
its prefill chunks and its decodes and hands each to the step's backend.

The model calls the two halves itself (`write_kv`, then `attend_cached`), so graph/fusion.py's FX
trace sees the cache write as ops and keeps `attend_cached` as one leaf (torch.fx.wrap in the
model's module). `paged_attention` is the two together.
"""

from __future__ import annotations

import torch

from strata.kernels.attention.common import write_kv
from strata.kernels.attention.metadata import AttentionMetadata
from strata.kernels.attention.registry import resolve_backend
from strata.kernels.dispatch import KERNEL_MODE


def decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
) -> torch.Tensor:
    """The decode rows q [B, heads, d] of a step over the paged cache -> [B, heads * d]."""
    if window is None:  # the call every backend (and the compiled step's strata::paged_decode) knows
        return meta.backend.decode(q, kv_cache, meta.decode_block_tables, meta.decode_context_lens,
                                   meta.decode_mask, scale)
    return meta.backend.decode(q, kv_cache, meta.decode_block_tables, meta.decode_context_lens, meta.decode_mask,
                               scale, window)


def attend_cached(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float, window: int | None = None,
) -> torch.Tensor:
    """Attention of the step's queries once its k/v are in the cache; returns [T, heads * head_dim].
    `window`: the layer's sliding attention window in tokens (None: full causal attention)."""
    backend = meta.backend
    p = meta.num_prefill_tokens
    if p == 0:
        return decode_attention(q, kv_cache, meta, scale, window)
    if window is None:
        parts = [backend.prefill(q, k, v, kv_cache, s, scale) for s in meta.prefills]
    else:
        parts = [backend.prefill(q, k, v, kv_cache, s, scale, window) for s in meta.prefills]
    if p < q.shape[0]:
        parts.append(decode_attention(q[p:], kv_cache, meta, scale, window))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """Write this step's k/v into the cache, then attend; returns [T, heads * head_dim]."""
    write_kv(kv_cache, k, v, meta.slot_mapping)
    return attend_cached(q, k, v, kv_cache, meta, scale)


def fused_decode_usable(qkv: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    """An all-decode step whose backend fuses rotary, cache write and attention for these tensors
    (the cpu backend). Asks the kernel mode first: while graph/fusion.py traces, the fast paths are
    off and the arguments are fx Proxies."""
    return (
        KERNEL_MODE.get().fast_paths and meta.num_prefill_tokens == 0
        and meta.backend.fused_decode_usable(qkv, kv_cache)
    )


def fused_decode_attention(
    qkv: torch.Tensor, rope, kv_cache: torch.Tensor, meta: AttentionMetadata,
    heads: int, kv_heads: int, scale: float, window: int | None = None,
) -> torch.Tensor:
    """Decode from the fused qkv projection: rotate + store, then paged attention (the backend's)."""
    return meta.backend.fused_decode(
        qkv, rope, kv_cache, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
        heads, kv_heads, scale, window,
    )


def triton_usable(device: str) -> bool:
    """Whether the "triton" backend can run: a CUDA device and an importable triton."""
    return resolve_backend("triton").unavailable(device, None) is None
