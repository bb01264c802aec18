"""Fused residual add + RMSNorm on CPU (numba) for the few-row decode case.

torch runs RMSNorm as ~6 separate ops (pow, mean, add, rsqrt, mul, mul) plus the residual add;
at decode's 1-16 rows each op is pure dispatch overhead (profiled: ~30 us per norm call, 61 calls
per smol-135m step, ~2 ms of a ~30 ms step). One pass in numba costs a few microseconds. The
reference twin is `graph.layers.RMSNorm`'s torch path; tests compare the two.
"""

from __future__ import annotations

import numpy as np
import torch

from strata.kernels import cpu_gemv
from strata.kernels.dispatch import kernel

try:
    import numba
    from numba import njit
except ImportError:  # pragma: no cover
    numba = None

MAX_ROWS = 16


def available() -> bool:
    return numba is not None


if numba is not None:

    @njit(fastmath=False, cache=True)
    def _add_rms_norm(x, residual, weight, eps, out, res_out, has_residual):  # pragma: no cover
        rows, dim = x.shape
        for r in range(rows):
            ss = np.float32(0.0)
            for c in range(dim):
                v = x[r, c]
                if has_residual:
                    v += residual[r, c]
                    res_out[r, c] = v
                ss += v * v
            scale = np.float32(1.0) / np.sqrt(ss / np.float32(dim) + eps)
            for c in range(dim):
                v = res_out[r, c] if has_residual else x[r, c]
                out[r, c] = v * scale * weight[c]


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Few fp32 CPU rows (cpu_gemv.few_fp32_rows: asks the kernel mode first)."""
    return cpu_gemv.few_fp32_rows(x, weight, MAX_ROWS)


@kernel("add_rms_norm")
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x + residual) * weight, x + residual); the second is None without a residual."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if residual is None:
        _add_rms_norm(x.numpy(), x.numpy(), weight.numpy(), np.float32(eps), out.numpy(), x.numpy(), False)
        return out, None
    res_out = torch.empty_like(x)
    _add_rms_norm(
        x.numpy(), residual.contiguous().numpy(), weight.numpy(), np.float32(eps), out.numpy(),
        res_out.numpy(), True,
    )
    return out, res_out
