"""The pieces every attention backend shares: prefill spans, the KV-cache write and gather, the math.

KV cache per layer: a tensor [2, num_blocks, block_size, num_kv_heads, head_dim] (a quantised
cache's rows carry their scale too: kernels/kv_quant.py). Tokens of a step arrive flattened ([T, heads, head_dim]): prefill chunks first, then one token per decode.
Grouped-query attention never copies K/V per query head: the query heads sharing a KV head are
laid out as extra query rows of that KV head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from strata.kernels import kv_quant

# attend(q, k, v, mask, causal, scale): q [..., kvh, rows, d], k/v [..., kvh, L, d], mask
# broadcastable to [..., kvh, rows, L] (True = attend) or None
AttendFn = Callable[..., torch.Tensor]


@dataclass
class PrefillSpan:
    """One sequence's prefill chunk: tokens [start, end) of the step, after `context_len` cached."""

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor  # [num_blocks] long, covering context_len + (end - start) tokens
    mask: torch.Tensor | None  # [n, context_len + n] bool, True = attend; None = plain causal


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store this step's keys and values [T, kv_heads, head_dim] at their cache slots, rounded to
    the cache's dtype where it is narrower, quantised where it is int8 / fp8 (kv_cache_dtype,
    kernels/kv_quant.py; the check is skipped while graph/fusion.py traces, so the traced ops stay
    the pattern it replaces, whose op calls this at run time: EngineConfig refuses --fuse and
    --compile with a quantised cache)."""
    kv_heads, head_dim = k.shape[-2:]
    if not isinstance(k, torch.fx.Proxy) and k.dtype != kv_cache.dtype:
        if kv_quant.is_quantised(kv_cache.dtype):  # int8 / fp8: values and scales, copied as bytes
            width = head_dim + kv_quant.SCALE_BYTES  # (index_copy_ has no float8 kernel on CPU)
            for i, x in ((0, k), (1, v)):
                rows = kv_quant.quantise(x, kv_cache.dtype).view(torch.uint8)
                kv_cache[i].view(torch.uint8).view(-1, kv_heads, width).index_copy_(0, slots, rows)
            return
        k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    kv_cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
    kv_cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, v)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the blocks in `block_table` ([..., nb]) as [..., nb * block_size, kvh, d]."""
    # one gather for K and V; index_select, because advanced indexing is ~100x slower on CPU here
    kv = kv_cache.index_select(1, block_table.reshape(-1))
    shape = (2, *block_table.shape[:-1], -1, *kv.shape[-2:])
    kv = kv.view(shape)
    return kv[0], kv[1]


def sdpa_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float,
) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention (see AttendFn for the shapes)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def reference_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float,
) -> torch.Tensor:
    """The reference math: explicit matmul + softmax in fp32, cast back to q's dtype."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        rows, cols = scores.shape[-2:]
        mask = torch.ones(rows, cols, dtype=torch.bool, device=q.device).tril(cols - rows)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)


def window_mask(positions: torch.Tensor, keys: torch.Tensor, window: int) -> torch.Tensor:
    """[rows, L] bool: key j is visible to the query at position p iff p - window < j <= p (a
    sliding window of `window` tokens, the query's own included, as transformers masks it)."""
    return (keys[None, :] <= positions[:, None]) & (keys[None, :] > positions[:, None] - window)


def prefill_span(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, span: PrefillSpan,
    scale: float, attend: AttendFn, window: int | None = None,
) -> torch.Tensor:
    """One prefill chunk: its queries over its own new k/v (fresh prompt) or over the cached context
    plus the chunk (gathered from the blocks); returns [n, heads * head_dim]. With a sliding
    `window`, each query sees only the last `window` keys up to itself (keys no query of the chunk
    can see are not attended over at all)."""
    n = span.end - span.start
    kv_heads = k.shape[1]
    group = q.shape[1] // kv_heads
    qs = q[span.start : span.end].view(n, kv_heads, group, -1).permute(1, 2, 0, 3)
    if span.context_len == 0 and not kv_quant.is_quantised(kv_cache.dtype):
        ks, vs = k[span.start : span.end], v[span.start : span.end]
    else:  # a quantised cache is read back even for a fresh prompt: every query sees the K/V decode sees
        ks, vs = gather_kv(kv_cache, span.block_table)
        ks, vs = kv_quant.widen(ks[: span.context_len + n], q.dtype), kv_quant.widen(vs[: span.context_len + n], q.dtype)
    mask = span.mask
    if window is not None and span.context_len + n > window:
        first = max(0, span.context_len - window + 1)  # the oldest key the chunk's first query sees
        positions = torch.arange(span.context_len, span.context_len + n, device=q.device)
        mask = window_mask(positions, torch.arange(first, span.context_len + n, device=q.device), window)
        ks, vs = ks[first:], vs[first:]
    ks = ks.transpose(0, 1).unsqueeze(1).expand(-1, group, -1, -1)
    vs = vs.transpose(0, 1).unsqueeze(1).expand(-1, group, -1, -1)
    out = attend(qs, ks, vs, mask, mask is None, scale)  # [kvh, g, n, d]
    return out.permute(2, 0, 1, 3).reshape(n, -1)


def gathered_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, mask: torch.Tensor | None,
    scale: float, attend: AttendFn, context_lens: torch.Tensor | None = None, window: int | None = None,
) -> torch.Tensor:
    """Decode by gathering every sequence's blocks into a padded copy and attending over it with
    the padding mask [B, 1, 1, max_blocks * block_size] (built from `context_lens` when None);
    a sliding `window` also masks the keys older than the last `window`. Returns [B, heads * head_dim]."""
    b, heads, head_dim = q.shape
    kv_heads = kv_cache.shape[-2]
    qd = q.view(b, kv_heads, heads // kv_heads, head_dim)
    ks, vs = gather_kv(kv_cache, block_tables)  # [B, L, kvh, d]
    # a narrower cache (kv_cache_dtype) is widened once gathered, a quantised one dequantised
    ks, vs = kv_quant.widen(ks, q.dtype), kv_quant.widen(vs, q.dtype)
    if window is not None or mask is None:
        keys = torch.arange(ks.shape[1], device=q.device)
        mask = (window_mask(context_lens - 1, keys, window) if window is not None
                else keys[None, :] < context_lens[:, None]).view(b, 1, 1, -1)
    out = attend(qd, ks.transpose(1, 2), vs.transpose(1, 2), mask, False, scale)
    return out.reshape(b, heads * head_dim)
