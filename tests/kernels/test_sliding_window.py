"""Sliding-window attention in every CPU attention backend against a brute-force reference.

A query at position p sees keys p - window < j <= p (transformers' sliding_window_overlay); decode
rows of several lengths (shorter than, equal to and longer than the window, across block edges),
and prefill chunks with and without cached context.
"""

import pytest
import torch

from strata.kernels import cpu_attention
from strata.kernels.attention import AttentionMetadata, PrefillSpan, attend_cached, write_kv
from tests.kernels.triton_kernels.triton_cases import paged_cache

BACKENDS = ["torch", "sdpa"] + (["cpu"] if cpu_attention.available() else [])


def _brute(q, k, v, positions, window, scale):
    """q [n, h, d] at `positions`, k/v [L, kvh, d] for positions 0..L-1 -> [n, h * d]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = []
    for i, p in enumerate(positions.tolist()):
        lo = max(0, p - window + 1)
        s = torch.einsum("hd,lhd->hl", q[i], k[lo : p + 1]) * scale
        out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), v[lo : p + 1]).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_windowed_decode(backend, window):
    g = torch.Generator().manual_seed(window)
    lens, block, kv_heads, heads, dim = [3, 16, 17, 40, 61], 8, 2, 6, 16
    cache, tables, lens_t = paged_cache(g, lens, block, kv_heads, dim, torch.float32)
    q = torch.randn(len(lens), heads, dim, generator=g)
    keys = torch.arange(tables.shape[1] * block)
    pad = (keys[None, :] < lens_t[:, None]).view(len(lens), 1, 1, -1)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), [], 0, tables, pad, lens_t, backend=backend)
    got = attend_cached(q, None, None, cache, meta, 0.25, window)
    for b, n in enumerate(lens):
        slots = tables[b, torch.arange(n) // block] * block + torch.arange(n) % block
        k = cache[0].view(-1, kv_heads, dim)[slots]
        v = cache[1].view(-1, kv_heads, dim)[slots]
        ref = _brute(q[b : b + 1], k, v, torch.tensor([n - 1]), window, 0.25)
        torch.testing.assert_close(got[b : b + 1], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("context", [0, 9, 30])
def test_windowed_prefill_chunk(backend, context):
    """A 12-token chunk after `context` cached tokens, window 7: one span, keys from the cache."""
    g = torch.Generator().manual_seed(context)
    block, kv_heads, heads, dim, n, window = 4, 1, 2, 8, 12, 7
    total = context + n
    blocks = -(-total // block)
    cache = torch.zeros(2, blocks + 3, block, kv_heads, dim)
    table = torch.randperm(blocks + 3, generator=g)[:blocks]
    k_all, v_all = torch.randn(total, kv_heads, dim, generator=g), torch.randn(total, kv_heads, dim, generator=g)
    pos = torch.arange(total)
    slots = table[pos // block] * block + pos % block
    write_kv(cache, k_all[:context], v_all[:context], slots[:context])  # the cached context
    q = torch.randn(n, heads, dim, generator=g)
    k, v = k_all[context:], v_all[context:]
    write_kv(cache, k, v, slots[context:])
    mask = None if context == 0 else (torch.arange(total)[None, :] <= pos[context:, None])
    span = PrefillSpan(0, n, context, table, mask)
    meta = AttentionMetadata(slots[context:], [span], n, None, None, None, backend=backend)
    got = attend_cached(q, k, v, cache, meta, 0.5, window)
    torch.testing.assert_close(got, _brute(q, k_all, v_all, pos[context:], window, 0.5), rtol=1e-5, atol=1e-5)
