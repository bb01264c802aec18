"""kv_cache_dtype=int8: the CPU cache kernels (quantise on write, attention over int8 rows and their
scales) against their torch twins (kernels/kv_quant.py + the "torch" backend over the dequantised
cache), and flash-decoding's split against the unsplit kernel."""

import numpy as np
import pytest
import torch

from strata.graph.layers import RotaryEmbedding, apply_rotary
from strata.kernels import cpu_attention, cpu_rope, kv_quant
from strata.kernels.attention import AttentionMetadata, decode_attention, write_kv
from tests.kernels.triton_kernels.triton_cases import paged_cache

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="numba not installed")


def _int8_cache(g, lens, block, kv_heads, dim):
    """A scattered paged cache quantised row by row (kv_quant.quantise), its tables and lengths."""
    cache, table_t, lens_t = paged_cache(g, lens, block, kv_heads, dim, torch.float32)
    cache = cache * torch.rand(cache.shape[:-1] + (1,), generator=g) * 4  # rows of unequal scales
    return kv_quant.quantise(cache, torch.int8), table_t, lens_t


def _metas(table_t, lens_t, block):
    mask = (torch.arange(table_t.shape[1] * block)[None, :] < lens_t[:, None]).view(len(lens_t), 1, 1, -1)
    ref = AttentionMetadata(torch.empty(0), [], 0, table_t, mask, lens_t, backend="torch")
    cpu = AttentionMetadata(torch.empty(0), [], 0, table_t, None, lens_t, backend="cpu")
    return ref, cpu


def test_the_layout_holds_each_rows_scale_and_round_trips():
    x = torch.randn(5, 3, 64) * torch.tensor([0.01, 1.0, 30.0])[None, :, None]
    x[0, 0] = 0  # an all-zero row: scale 0, values 0
    packed = kv_quant.quantise(x, torch.int8)
    assert packed.shape == (5, 3, 68) and packed.dtype == torch.int8
    assert kv_quant.head_dim_of(packed) == 64
    scale = packed[..., 64:].contiguous().view(torch.float32)[..., 0]
    torch.testing.assert_close(scale, x.abs().amax(-1) / 127)
    back = kv_quant.dequantise(packed, torch.float32)
    assert back[0, 0].abs().max() == 0
    # symmetric rounding: at most half a step of each row's scale
    assert ((back - x).abs() <= scale[..., None] / 2 * (1 + 1e-5) + 1e-12).all()
    fp8 = kv_quant.dequantise(kv_quant.quantise(x, torch.float8_e4m3fn), torch.float32)
    torch.testing.assert_close(fp8, x, rtol=0.07, atol=1e-6)  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("rows, heads, kv_heads, dim", [(1, 9, 3, 64), (16, 14, 2, 64), (3, 4, 4, 16), (2, 3, 1, 48)])
def test_rope_and_store_quantises_as_the_torch_twin(rows, heads, kv_heads, dim):
    """The fused rotary + KV write quantises each row bit for bit as write_kv (kv_quant.quantise)."""
    g = torch.Generator().manual_seed(rows + dim)
    block, num_blocks = 16, 4
    rope = RotaryEmbedding(dim, 256, 10000.0, None)(torch.randint(0, 256, (rows,), generator=g), torch.float32)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g) * 3
    slots = torch.randperm(num_blocks * block, generator=g)[:rows]
    got = torch.zeros(2, num_blocks, block, kv_heads, dim + kv_quant.SCALE_BYTES, dtype=torch.int8)
    assert cpu_rope.usable(qkv, got)
    with torch.inference_mode():
        q = cpu_rope.rope_and_store(qkv, rope, slots, got, heads, kv_heads)
    rotated = apply_rotary(qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim), rope)
    ref = torch.zeros_like(got)
    write_kv(ref, rotated[:, heads:], qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim), slots)
    torch.testing.assert_close(q, rotated[:, :heads], rtol=1e-6, atol=1e-6)
    values, scales = (got[..., :dim].int() - ref[..., :dim].int()).abs(), (got[..., dim:], ref[..., dim:])
    # the rotation's own fp32 rounding may differ by an ulp, which can move a value by one step
    assert values.max() <= 1 and (values == 0).float().mean() > 0.99
    torch.testing.assert_close(scales[0].contiguous().view(torch.float32), scales[1].contiguous().view(torch.float32),
                               rtol=1e-6, atol=0)
    v_got, v_ref = got[1].view(torch.uint8), ref[1].view(torch.uint8)
    assert torch.equal(v_got, v_ref)  # v is not rotated: the same floats, the same bytes


@pytest.mark.parametrize(
    "heads, kv_heads, dim, block, lens",
    [
        (4, 4, 16, 16, [1]),
        (9, 3, 64, 16, [37, 5, 16, 100]),  # smol-135m's GQA ratio, partial blocks
        (14, 2, 64, 8, [3, 64]),
        (6, 2, 128, 32, [33, 1, 65]),
        (9, 3, 64, 16, [700]),  # one long sequence: split across threads, parts merged
        (8, 8, 80, 16, [300, 2]),  # 64 columns in registers, then one 16-column step
        (7, 1, 48, 16, [45, 90, 16]),  # 16-key passes plus tails
    ],
)
def test_paged_decode_over_int8_rows_matches_the_torch_twin(heads, kv_heads, dim, block, lens):
    """The kernel converts each int8 row in registers and applies its scale to the dot (K) or the
    weight (V); the torch twin dequantises the gathered blocks: equal within fp32 rounding."""
    g = torch.Generator().manual_seed(sum(lens) + heads + dim)
    cache, table_t, lens_t = _int8_cache(g, lens, block, kv_heads, dim)
    q = torch.randn(len(lens), heads, dim, generator=g)
    assert cpu_attention.usable(q, cache)
    ref_meta, cpu_meta = _metas(table_t, lens_t, block)
    expected = decode_attention(q, kv_quant.dequantise(cache, torch.float32), ref_meta, dim**-0.5)
    torch.testing.assert_close(decode_attention(q, cache, cpu_meta, dim**-0.5), expected, rtol=1e-5, atol=1e-5)
    # the torch backend over the int8 cache itself dequantises what it gathers: the same
    torch.testing.assert_close(decode_attention(q, cache, ref_meta, dim**-0.5), expected, rtol=1e-5, atol=1e-5)


def test_an_int8_cache_with_an_odd_head_dim_falls_back_to_the_dequantised_gather():
    g = torch.Generator().manual_seed(5)
    cache, table_t, lens_t = _int8_cache(g, [20, 7], 8, 2, 24)
    q = torch.randn(2, 4, 24, generator=g)
    assert not cpu_attention.usable(q, cache)
    ref_meta, cpu_meta = _metas(table_t, lens_t, 8)
    torch.testing.assert_close(decode_attention(q, cache, cpu_meta, 0.2),
                               decode_attention(q, kv_quant.dequantise(cache, torch.float32), ref_meta, 0.2),
                               rtol=1e-5, atol=1e-5)


def _unsplit(q, k, v, tables, lens, scale, window):
    """The kernel's own pieces with every sequence in one part: no split, no merge across parts."""
    batch, heads, dim = q.shape
    kv_heads = k.shape[2]
    part_max = np.empty((batch, kv_heads, heads // kv_heads), np.float32)
    part_sum, part_acc = np.empty_like(part_max), np.empty((batch, kv_heads, heads // kv_heads, dim), np.float32)
    for b in range(batch):
        cpu_attention._attend_part(q, k, v, tables, lens, scale, window, 1, b, part_max, part_sum, part_acc)
    out = np.empty_like(q)
    for bh in range(batch * heads):
        cpu_attention._merge_head(bh, 1, part_max, part_sum, part_acc, out)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("lens, window", [([4000], 0), ([2500, 1800], 0), ([3000], 1000), ([1200] * 4, 0), ([16384], 0)])
def test_flash_decoding_split_equals_the_unsplit_kernel(dtype, lens, window):
    """Long contexts at batch 1-4 are cut into parts along the keys (their own max and sum, merged
    by log-sum-exp): the answer equals one part per sequence within fp32 rounding, on 1 thread and
    on every thread bit for bit."""
    import numba

    g = torch.Generator().manual_seed(sum(lens) + window)
    block, kv_heads, heads, dim = 16, 3, 9, 64
    if dtype == torch.int8:
        cache, table_t, lens_t = _int8_cache(g, lens, block, kv_heads, dim)
    else:
        cache, table_t, lens_t = paged_cache(g, lens, block, kv_heads, dim, dtype)
    q = torch.randn(len(lens), heads, dim, generator=g) * 2
    k, v = cpu_attention.cache_views(cache)
    args = (q.numpy(), k, v, table_t.numpy(), lens_t.numpy(), np.float32(dim**-0.5), np.int64(window))
    split = []
    before = numba.get_num_threads()
    try:
        for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(threads)
            out = np.empty_like(q.numpy())
            cpu_attention._paged_decode(*args, out)
            split.append(out)
    finally:
        numba.set_num_threads(before)
    assert all(np.array_equal(s, split[0]) for s in split)
    assert cpu_attention.split_parts(len(lens), max(min(n, window or n) for n in lens), heads, dim) > 1
    np.testing.assert_allclose(split[0], _unsplit(*args), rtol=1e-5, atol=1e-6)
