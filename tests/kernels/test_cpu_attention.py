"""The numba paged-decode attention kernel against its torch reference twin."""

import pytest
import torch

from strata.kernels import cpu_attention
from strata.kernels.attention import AttentionMetadata, _decode
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
    expected = _decode(q, cache, ref_meta, scale)
    got = _decode(q, cache, cpu_meta, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
