"""Attention over the paged KV cache: prefill chunks and decodes, one dispatch point.

KV cache per layer: a tensor [2, num_blocks, block_size, num_kv_heads, head_dim]. Tokens of a
step arrive flattened ([T, heads, head_dim]): prefill chunks first, then one token per decode.

Backends: "torch" (explicit matmul + softmax in fp32, the reference), "sdpa"
(torch.nn.functional.scaled_dot_product_attention), "cpu" (decodes through the numba kernel in
cpu_attention.py, which reads K/V straight from the blocks; prefill chunks use SDPA) and "triton"
(decodes through the split-K Triton kernel in kernels/triton/paged_attention.py on CUDA, imported
only when used; prefill chunks use SDPA).
Grouped-query attention never copies K/V per query head: the query heads sharing a KV head are
laid out as extra query rows of that KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from strata.kernels import cpu_attention, cpu_rope

BACKENDS = ("torch", "sdpa", "cpu", "triton")


@dataclass
class PrefillSpan:
    """One sequence's prefill chunk: tokens [start, end) of the step, after `context_len` cached."""

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor  # [num_blocks] long, covering context_len + (end - start) tokens
    mask: torch.Tensor | None  # [n, context_len + n] bool, True = attend; None = plain causal


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once by the runner, shared by all layers."""

    slot_mapping: torch.Tensor  # [T] long: flat cache slot (block * block_size + offset) per token
    prefills: list[PrefillSpan]
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] long (padded with block 0)
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool (torch/sdpa only)
    decode_context_lens: torch.Tensor | None = None  # [B] long, tokens incl. the new one
    backend: str = "sdpa"


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store this step's keys and values [T, kv_heads, head_dim] at their cache slots."""
    kv_heads, head_dim = k.shape[-2:]
    kv_cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
    kv_cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, v)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the blocks in `block_table` ([..., nb]) as [..., nb * block_size, kvh, d]."""
    # one gather for K and V; index_select, because advanced indexing is ~100x slower on CPU here
    kv = kv_cache.index_select(1, block_table.reshape(-1))
    shape = (2, *block_table.shape[:-1], -1, *kv.shape[-2:])
    kv = kv.view(shape)
    return kv[0], kv[1]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    causal: bool, scale: float, backend: str,
) -> torch.Tensor:
    """q [..., kvh, rows, d], k/v [..., kvh, L, d], mask broadcastable to [..., kvh, rows, L]."""
    if backend != "torch":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        rows, cols = scores.shape[-2:]
        mask = torch.ones(rows, cols, dtype=torch.bool, device=q.device).tril(cols - rows)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)


def _prefill(q, k, v, kv_cache, span: PrefillSpan, scale: float, backend: str) -> torch.Tensor:
    n = span.end - span.start
    kv_heads = k.shape[1]
    group = q.shape[1] // kv_heads
    qs = q[span.start : span.end].view(n, kv_heads, group, -1).permute(1, 2, 0, 3)
    if span.context_len == 0:
        ks, vs = k[span.start : span.end], v[span.start : span.end]
    else:
        ks, vs = gather_kv(kv_cache, span.block_table)
        ks, vs = ks[: span.context_len + n], vs[: span.context_len + n]
    ks = ks.transpose(0, 1).unsqueeze(1).expand(-1, group, -1, -1)
    vs = vs.transpose(0, 1).unsqueeze(1).expand(-1, group, -1, -1)
    out = attend(qs, ks, vs, span.mask, span.mask is None, scale, backend)  # [kvh, g, n, d]
    return out.permute(2, 0, 1, 3).reshape(n, -1)


def _decode(q, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    if meta.backend == "cpu":
        return cpu_attention.paged_decode(q, kv_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
    if meta.backend == "triton":  # lazy: CPU runs never import triton
        from strata.kernels.triton.paged_attention import paged_decode_attention

        return paged_decode_attention(q, kv_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
    b, heads, head_dim = q.shape
    kv_heads = kv_cache.shape[-2]
    qd = q.view(b, kv_heads, heads // kv_heads, head_dim)
    ks, vs = gather_kv(kv_cache, meta.decode_block_tables)  # [B, L, kvh, d]
    out = attend(qd, ks.transpose(1, 2), vs.transpose(1, 2), meta.decode_mask, False, scale, meta.backend)
    return out.reshape(b, heads * head_dim)


def triton_usable(device: str) -> bool:
    """Whether the "triton" backend can run: a CUDA device and an importable triton."""
    if not str(device).startswith("cuda"):
        return False
    from strata.kernels.triton import available

    return available()


def fused_decode_usable(qkv: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    """All-decode step on the CPU backend: rotary, cache write and attention fuse (see cpu_rope)."""
    return meta.backend == "cpu" and meta.num_prefill_tokens == 0 and cpu_rope.usable(qkv, kv_cache)


def fused_decode_attention(
    qkv: torch.Tensor, rope, kv_cache: torch.Tensor, meta: AttentionMetadata,
    heads: int, kv_heads: int, scale: float,
) -> torch.Tensor:
    """Decode from the fused qkv projection: rotate + store (one kernel), then paged attention."""
    q = cpu_rope.rope_and_store(qkv, rope, meta.slot_mapping, kv_cache, heads, kv_heads)
    return cpu_attention.paged_decode(q, kv_cache, meta.decode_block_tables, meta.decode_context_lens, scale)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """Write this step's k/v into the cache, then attend; returns [T, heads * head_dim]."""
    write_kv(kv_cache, k, v, meta.slot_mapping)
    p = meta.num_prefill_tokens
    if p == 0:
        return _decode(q, kv_cache, meta, scale)
    parts = [_prefill(q, k, v, kv_cache, s, scale, meta.backend) for s in meta.prefills]
    if p < q.shape[0]:
        parts.append(_decode(q[p:], kv_cache, meta, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
