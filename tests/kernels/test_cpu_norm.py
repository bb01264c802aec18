"""The numba fused add + RMSNorm against its torch twin (F.rms_norm after the add)."""

import pytest
import torch
import torch.nn.functional as F

from strata.kernels import cpu_norm

pytestmark = pytest.mark.skipif(not cpu_norm.available(), reason="numba not installed")


@pytest.mark.parametrize("rows", [1, 3, cpu_norm.MAX_ROWS])
@pytest.mark.parametrize("dim", [1, 64, 576, 897])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(rows, dim, with_residual):
    g = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim, generator=g) * 3
    res = torch.randn(rows, dim, generator=g) if with_residual else None
    w = torch.randn(dim, generator=g)
    with torch.inference_mode():
        out, new_res = cpu_norm.add_rms_norm(x, res, w, 1e-6)
    summed = x + res if with_residual else x
    torch.testing.assert_close(out, F.rms_norm(summed, (dim,), w, 1e-6), rtol=1e-5, atol=1e-5)
    if with_residual:
        torch.testing.assert_close(new_res, summed, rtol=0, atol=0)
    else:
        assert new_res is None
