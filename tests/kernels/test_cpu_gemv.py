"""The numba skinny-matmul kernel against its torch reference twin (F.linear)."""

import pytest
import torch
import torch.nn.functional as F

from strata.kernels import cpu_gemv
from strata.kernels.linear import linear

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="numba not installed")


@pytest.mark.parametrize("rows", [1, 2, 3, 7, cpu_gemv.BLOCK_ROWS, cpu_gemv.BLOCK_ROWS + 1, 13, cpu_gemv.MAX_ROWS])
@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (96, 64), (333, 129), (1024, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(rows, shape, bias):
    g = torch.Generator().manual_seed(rows * 1000 + shape[0])
    out_f, in_f = shape
    w = torch.randn(out_f, in_f, generator=g)
    x = torch.randn(rows, in_f, generator=g)
    b = torch.randn(out_f, generator=g) if bias else None
    with torch.inference_mode():
        assert cpu_gemv.usable(x, w)
        got = cpu_gemv.gemv(x, w, b)
    # Different fp32 summation order: error grows like eps * sqrt(n) * |x| * |w| ~ 1.2e-7 * n here.
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=2e-7 * in_f + 1e-6)


def test_non_contiguous_input():
    w = torch.randn(40, 32)
    x = torch.randn(3, 64)[:, ::2]
    with torch.inference_mode():
        torch.testing.assert_close(cpu_gemv.gemv(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_dispatch_falls_back_to_torch():
    w = torch.randn(16, 8)
    many = torch.randn(cpu_gemv.MAX_ROWS + 1, 8)
    assert not cpu_gemv.usable(many, w)
    assert not cpu_gemv.usable(torch.randn(2, 8, dtype=torch.bfloat16), w.bfloat16())
    wg = torch.randn(16, 8, requires_grad=True)
    assert not cpu_gemv.usable(torch.randn(1, 8), wg)  # autograd needs torch's op
    out = linear(torch.randn(1, 8), wg)
    assert out.requires_grad
    torch.testing.assert_close(linear(many, w), F.linear(many, w))


@pytest.mark.parametrize("rows", [1, 5, cpu_gemv.BLOCK_ROWS + 1, cpu_gemv.MAX_ROWS])
@pytest.mark.parametrize("shape", [(2, 3), (96, 64), (3072, 576)])
def test_gemv_swiglu_matches_torch(rows, shape):
    g = torch.Generator().manual_seed(rows + shape[0])
    w = torch.randn(*shape, generator=g) * 0.1
    x = torch.randn(rows, shape[1], generator=g)
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    with torch.inference_mode():
        got = cpu_gemv.gemv_swiglu(x, w)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=2e-7 * shape[1] + 1e-6)


@pytest.mark.parametrize("rows", [1, cpu_gemv.BLOCK_ROWS + 1, cpu_gemv.MAX_ROWS])
def test_blocked_kernels_do_not_depend_on_the_thread_count(rows):
    """The adaptive thread tuner changes the numba thread cap mid-run: fp32, bf16 and int4 few-row
    GEMVs must give the same bits on 1 and 2 threads (odd row counts: a pair must not straddle)."""
    import numpy as np

    from strata.kernels import cpu_bf16, cpu_quant, quant_formats

    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(333, 192, generator=g), torch.randn(rows, 192, generator=g)
    wb = w.bfloat16().view(torch.int16).numpy()
    q, s = quant_formats.quantize_int4(w, 64)
    runs = []
    for threads in (1, 2, 3):
        outs = [np.empty((rows, 333), np.float32) for _ in range(3)]
        cpu_gemv._gemv_rows(w.numpy(), x.numpy(), outs[0], threads)
        cpu_bf16._bf16_gemv(wb, x.numpy(), outs[1], threads)
        cpu_quant._int4_gemv(q.numpy(), s.numpy(), x.numpy(), outs[2], 64, threads)
        runs.append(outs)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert np.array_equal(a, b)
