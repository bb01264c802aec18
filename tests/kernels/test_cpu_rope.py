"""The fused rotary + KV-cache write kernel against its torch twins (apply_rotary + write_kv)."""

import pytest
import torch

from strata.graph.layers import RotaryEmbedding, apply_rotary
from strata.kernels import cpu_rope
from strata.kernels.attention import write_kv

pytestmark = pytest.mark.skipif(not cpu_rope.available(), reason="numba not installed")


@pytest.mark.parametrize("rows, heads, kv_heads, dim", [(1, 9, 3, 64), (5, 4, 1, 32), (16, 14, 2, 64), (2, 3, 3, 8)])
def test_rope_and_store_matches_torch(rows, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(rows * heads + dim)
    block, num_blocks = 4, 12
    rotary = RotaryEmbedding(dim, 256, 10000.0, None)
    positions = torch.randint(0, 256, (rows,), generator=g)
    rope = rotary(positions, torch.float32)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g)
    slots = torch.randperm(num_blocks * block, generator=g)[:rows]
    got_cache = torch.zeros(2, num_blocks, block, kv_heads, dim)
    with torch.inference_mode():
        got_q = cpu_rope.rope_and_store(qkv, rope, slots, got_cache, heads, kv_heads)
    qk = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
    rotated = apply_rotary(qk, rope)
    v = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
    ref_cache = torch.zeros_like(got_cache)
    write_kv(ref_cache, rotated[:, heads:], v, slots)
    torch.testing.assert_close(got_q, rotated[:, :heads], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_cache, ref_cache, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows, heads, kv_heads, dim", [(1, 9, 3, 64), (16, 14, 2, 64), (3, 4, 4, 16)])
def test_rope_and_store_into_a_bf16_cache_rounds_as_torch(rows, heads, kv_heads, dim):
    """kv_cache_dtype=bfloat16: k and v land rounded to nearest even, bit for bit as write_kv's .to()."""
    g = torch.Generator().manual_seed(rows + dim)
    block, num_blocks = 16, 4
    rope = RotaryEmbedding(dim, 256, 10000.0, None)(torch.randint(0, 256, (rows,), generator=g), torch.float32)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g) * 3
    slots = torch.randperm(num_blocks * block, generator=g)[:rows]
    got_cache = torch.zeros(2, num_blocks, block, kv_heads, dim, dtype=torch.bfloat16)
    assert cpu_rope.usable(qkv, got_cache)
    with torch.inference_mode():
        got_q = cpu_rope.rope_and_store(qkv, rope, slots, got_cache, heads, kv_heads)
    rotated = apply_rotary(qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim), rope)
    ref_cache = torch.zeros_like(got_cache)
    write_kv(ref_cache, rotated[:, heads:], qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim), slots)
    torch.testing.assert_close(got_q, rotated[:, :heads], rtol=1e-6, atol=1e-6)
    diff = (got_cache.view(torch.int16).int() - ref_cache.view(torch.int16).int()).abs()
    # the rotation's own fp32 rounding may differ by an ulp, which can move the bf16 rounding by one step
    assert diff.max() <= 1 and (diff == 0).float().mean() > 0.99
