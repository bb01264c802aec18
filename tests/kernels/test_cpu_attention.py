"""The numba paged-decode attention kernel against its torch reference twin."""

import pytest
import torch

from strata.kernels import cpu_attention
from strata.kernels.attention import AttentionMetadata, decode_attention
from tests.kernels.triton_kernels.triton_cases import paged_cache

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="numba not installed")


@pytest.mark.parametrize(
    "heads, kv_heads, dim, block, lens",
    [
        (4, 4, 16, 16, [1]),  # MHA, one token
        (9, 3, 64, 16, [37, 5, 16, 100]),  # smol-135m's GQA ratio, partial blocks
        (14, 2, 64, 8, [3, 64]),  # qwen-0.5b's ratio
        (5, 1, 32, 4, [17]),  # MQA, odd head count
        (6, 2, 128, 32, [33, 1, 65]),
        (9, 3, 64, 16, [700]),  # one long sequence: its keys split across threads, parts merged
        (14, 2, 64, 16, [129, 300]),  # two sequences, parts of unequal length
        (4, 2, 24, 8, [150]),  # head_dim not a multiple of 16: the scalar row loops
        (8, 8, 80, 16, [300, 2]),  # 64 columns in registers, then one 16-column step
        (7, 1, 48, 16, [45, 90, 16]),  # 16-column steps only; 16-key passes plus tails
    ],
)
def test_paged_decode_matches_torch(heads, kv_heads, dim, block, lens):
    g = torch.Generator().manual_seed(sum(lens) + heads)
    cache, table_t, lens_t = paged_cache(g, lens, block, kv_heads, dim, torch.float32)  # scattered blocks
    width = table_t.shape[1]
    q = torch.randn(len(lens), heads, dim, generator=g)
    keys = torch.arange(width * block)
    mask = (keys[None, :] < lens_t[:, None]).view(len(lens), 1, 1, -1)
    scale = dim**-0.5
    ref_meta = AttentionMetadata(torch.empty(0), [], 0, table_t, mask, lens_t, backend="torch")
    cpu_meta = AttentionMetadata(torch.empty(0), [], 0, table_t, None, lens_t, backend="cpu")
    expected = decode_attention(q, cache, ref_meta, scale)
    got = decode_attention(q, cache, cpu_meta, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch_lens", [[400], [37, 300], [5, 6, 7], [200] * 9, [30] * 60, [20]])
@pytest.mark.parametrize("window", [0, 7, 100])
def test_paged_decode_splits_long_keys_and_its_bits_ignore_the_thread_count(batch_lens, window):
    """Few long sequences split their keys into parts (merged as flash-decoding does); the answer
    matches a plain softmax, with and without a sliding window, and is bit for bit the same on 1
    thread as on every thread (the adaptive tuner changes the count mid-run). Also one short
    sequence (one part: no parallel region) and 60 short ones (their merge runs in parallel)."""
    import numba
    import numpy as np

    g = torch.Generator().manual_seed(sum(batch_lens) + window)
    block, kv_heads, heads, dim = 16, 3, 9, 64
    cache, table_t, lens_t = paged_cache(g, batch_lens, block, kv_heads, dim, torch.float32)
    q = torch.randn(len(batch_lens), heads, dim, generator=g)
    outs = []
    before = numba.get_num_threads()
    try:
        for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(threads)
            out = np.empty((len(batch_lens), heads, dim), np.float32)
            cpu_attention._paged_decode(
                q.numpy(), cache[0].numpy(), cache[1].numpy(), table_t.numpy(), lens_t.numpy(),
                np.float32(dim**-0.5), np.int64(window), out,
            )
            outs.append(torch.from_numpy(out))
    finally:
        numba.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs)
    for b, n in enumerate(batch_lens):
        first = 0 if window == 0 else max(0, n - window)
        slots = table_t[b, torch.arange(first, n) // block] * block + torch.arange(first, n) % block
        k = cache[0].reshape(-1, kv_heads, dim)[slots].repeat_interleave(heads // kv_heads, dim=1)
        v = cache[1].reshape(-1, kv_heads, dim)[slots].repeat_interleave(heads // kv_heads, dim=1)
        probs = torch.softmax(torch.einsum("hd,thd->ht", q[b], k) * dim**-0.5, dim=-1)
        torch.testing.assert_close(outs[0][b], torch.einsum("ht,thd->hd", probs, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, dim, lens", [(9, 3, 64, [37, 5, 16, 100]), (14, 2, 64, [700]),
                                                        (6, 2, 128, [33, 1, 65]), (8, 8, 80, [300, 2])])
def test_paged_decode_reads_a_bf16_cache_exactly(heads, kv_heads, dim, lens):
    """kv_cache_dtype=bfloat16: the kernel widens the stored bf16 exactly, so it agrees with its
    torch twin run over the same cache widened to fp32."""
    g = torch.Generator().manual_seed(sum(lens) + dim)
    cache, table_t, lens_t = paged_cache(g, lens, 16, kv_heads, dim, torch.float32)
    cache = cache.to(torch.bfloat16)
    q = torch.randn(len(lens), heads, dim, generator=g)
    assert cpu_attention.usable(q, cache)
    width = table_t.shape[1]
    mask = (torch.arange(width * 16)[None, :] < lens_t[:, None]).view(len(lens), 1, 1, -1)
    ref_meta = AttentionMetadata(torch.empty(0), [], 0, table_t, mask, lens_t, backend="torch")
    cpu_meta = AttentionMetadata(torch.empty(0), [], 0, table_t, None, lens_t, backend="cpu")
    expected = decode_attention(q, cache.float(), ref_meta, dim**-0.5)
    torch.testing.assert_close(decode_attention(q, cache, cpu_meta, dim**-0.5), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decode_attention(q, cache, ref_meta, dim**-0.5), expected, rtol=1e-5, atol=1e-5)


def test_a_bf16_cache_with_an_odd_head_dim_falls_back_to_the_widened_gather():
    g = torch.Generator().manual_seed(3)
    cache, table_t, lens_t = paged_cache(g, [20, 7], 8, 2, 24, torch.float32)
    cache = cache.to(torch.bfloat16)
    q = torch.randn(2, 4, 24, generator=g)
    assert not cpu_attention.usable(q, cache)
    mask = (torch.arange(table_t.shape[1] * 8)[None, :] < lens_t[:, None]).view(2, 1, 1, -1)
    ref_meta = AttentionMetadata(torch.empty(0), [], 0, table_t, mask, lens_t, backend="torch")
    cpu_meta = AttentionMetadata(torch.empty(0), [], 0, table_t, None, lens_t, backend="cpu")
    torch.testing.assert_close(decode_attention(q, cache, cpu_meta, 0.2), decode_attention(q, cache.float(), ref_meta, 0.2),
                               rtol=1e-5, atol=1e-5)
