"""The loader's numba quantiser (kernels/cpu_quantize.py) writes exactly the bytes of its torch
twins (quant_formats.quantize_int8 / quantize_int4), for fp32 and bf16 rows, ties and zeros."""

from __future__ import annotations

import pytest
import torch

from strata.kernels import cpu_quantize, quant_formats
from strata.kernels.dispatch import reference_kernels
from strata.memory.quant import QuantLinear

pytestmark = pytest.mark.skipif(cpu_quantize.njit is None, reason="numba not installed")


def _rows(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0] = 0.0  # an all-zero row: scale 1
    w[1, :8] = torch.tensor([0.5, -0.5, 0.25, -0.25, 0.5, -0.5, 0.1, 0.0])  # |max| ties of both signs
    w[2] = torch.round(w[2] * 64) / 64  # values on the grid: round-half-even decides
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method, group", [("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128)])
def test_kernel_equals_torch_twin(method, group, dtype):
    w = _rows(37, 256, dtype, seed=group)
    if method == "int8":
        want_q, want_s = quant_formats.quantize_int8(w)
        q, s = torch.empty_like(want_q), torch.empty_like(want_s)
    else:
        want_q, want_s = quant_formats.quantize_int4(w, group)
        q, s = torch.empty_like(want_q), torch.empty_like(want_s)
    assert cpu_quantize.usable(w, q)
    cpu_quantize.quantize_rows(method, w, q, s, group)
    assert torch.equal(q, want_q) and torch.equal(s, want_s)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantlinear_rows_same_with_and_without_the_kernel(method):
    """QuantLinear.quantize_rows into a slice of a fused weight: the kernel and the reference path
    (fast paths off) leave identical buffers."""
    w = _rows(48, 128, torch.bfloat16, seed=1)
    got = QuantLinear.empty(method, 96, 128, 64, None, "cpu")
    want = QuantLinear.empty(method, 96, 128, 64, None, "cpu")
    for q in (got, want):
        q.qweight.zero_()
        q.scale.zero_()
    got.quantize_rows(40, w)
    with reference_kernels():
        want.quantize_rows(40, w)
    assert torch.equal(got.qweight, want.qweight) and torch.equal(got.scale, want.scale)
