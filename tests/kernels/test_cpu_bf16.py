"""The bf16-weight GEMV (reads bf16, accumulates fp32) against its torch twin F.linear(x.float(), w.float())."""

import pytest
import torch
import torch.nn.functional as F

from strata.kernels import cpu_bf16
from strata.kernels.dispatch import reference_kernels
from strata.kernels.linear import linear, swiglu

pytestmark = pytest.mark.skipif(cpu_bf16.numba is None, reason="numba not installed")


def _tol(in_f: int) -> dict:
    return dict(rtol=1e-5, atol=2e-7 * in_f + 1e-5)  # fp32 summation order differs from F.linear's


@pytest.mark.parametrize("rows", [1, 2, 7, 9, 14, cpu_bf16.MAX_ROWS])
@pytest.mark.parametrize("shape", [(1, 1), (5, 31), (7, 33), (64, 64), (333, 100), (1024, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(rows, shape, bias):
    g = torch.Generator().manual_seed(rows * 1000 + shape[0] + shape[1])
    out_f, in_f = shape
    w = torch.randn(out_f, in_f, generator=g).bfloat16()
    x = torch.randn(rows, in_f, generator=g)
    b = torch.randn(out_f, generator=g) if bias else None
    with torch.inference_mode():
        assert cpu_bf16.usable(x, w)
        got = cpu_bf16.gemv(x, w, b)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w.float(), b), **_tol(in_f))


@pytest.mark.parametrize("rows", [1, 3, 11, cpu_bf16.MAX_ROWS])
@pytest.mark.parametrize("shape", [(2, 40), (96, 64), (3072, 576)])
def test_swiglu_matches_reference(rows, shape):
    g = torch.Generator().manual_seed(rows + shape[0])
    w = (torch.randn(*shape, generator=g) * 0.1).bfloat16()
    x = torch.randn(rows, shape[1], generator=g)
    gate, up = F.linear(x, w.float()).chunk(2, dim=-1)
    with torch.inference_mode():
        got = cpu_bf16.gemv_swiglu(x, w)
        torch.testing.assert_close(got, F.silu(gate) * up, **_tol(shape[1]))
        torch.testing.assert_close(swiglu(x, w), got)


def test_bf16_inputs_give_bf16_outputs_close_to_torch():
    """A bf16 model's activations: widened once, the result rounded back to bf16 (one rounding,
    where torch's bf16 GEMM rounds its partial sums too)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 320, generator=g).bfloat16()
    x = torch.randn(4, 320, generator=g).bfloat16()
    with torch.inference_mode():
        got = linear(x, w)
    assert got.dtype == torch.bfloat16
    exact = F.linear(x.float(), w.float())
    torch.testing.assert_close(got.float(), exact, rtol=2**-8, atol=1e-6)  # within one bf16 rounding
    assert (F.linear(x, w).float() - exact).abs().max() >= (got.float() - exact).abs().max()


def test_dispatch_falls_back_where_the_kernel_does_not_apply():
    w = torch.randn(48, 64).bfloat16()
    with torch.inference_mode():
        many = torch.randn(cpu_bf16.MAX_ROWS + 1, 64).bfloat16()
        assert not cpu_bf16.usable(many, w)  # prefill: torch's bf16 GEMM
        torch.testing.assert_close(linear(many, w), F.linear(many, w))
        assert swiglu(many, w) is None
        assert not cpu_bf16.usable(torch.randn(2, 64, dtype=torch.float16), w)
        assert not cpu_bf16.usable(torch.randn(2, 64), w.t().contiguous().t())  # a strided weight
        with reference_kernels():
            assert not cpu_bf16.usable(torch.randn(1, 64), w)
    wg = torch.randn(48, 64, requires_grad=True)
    x = torch.randn(1, 64).bfloat16()
    assert not cpu_bf16.usable(x, wg.bfloat16())  # autograd: torch's path, which has a backward
    linear(x, wg.bfloat16()).float().sum().backward()
    assert wg.grad is not None
