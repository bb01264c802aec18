"""The one dispatch point for dense projections: a skinny-matmul kernel where it pays, else torch."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from strata.kernels import cpu_gemv, cpu_quant
from strata.kernels.dispatch import KERNEL_MODE


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if cpu_gemv.usable(x, weight):
        return cpu_gemv.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


class QuantWeight(Protocol):
    """What the quantised dispatch reads (memory.quant.QuantLinear provides it)."""

    method: str
    qweight: torch.Tensor
    scale: torch.Tensor
    in_features: int
    group_size: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    def kernel_weights(self) -> tuple:
        """(qweight, scale) as the CPU kernels take them (e.g. cached numpy views)."""
        ...


def quant_linear(x: torch.Tensor, q: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) for a weight-only quantised W (formats in kernels/cpu_quant.py).

    fp32 on CPU: the numba GEMV up to cpu_quant.MAX_ROWS rows, else tile-wise dequantisation
    (numba) and torch's fp32 GEMM. Anything else (other dtypes or devices, autograd) dequantises with the
    torch reference and calls F.linear.
    """
    if x.dim() == 2 and x.shape[0] <= cpu_quant.MAX_ROWS and cpu_quant.usable(x, q.qweight):
        w, s = q.kernel_weights()
        return cpu_quant.gemv(q.method, x, w, s, q.group_size, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if cpu_quant.usable(x2, q.qweight):
        if x2.shape[0] <= cpu_quant.MAX_ROWS:
            w, s = q.kernel_weights()
            out = cpu_quant.gemv(q.method, x2, w, s, q.group_size, bias)
        else:
            w, s = q.kernel_weights()
            out = cpu_quant.matmul(q.method, x2, w, s, q.group_size, bias)
    else:
        out = F.linear(x2, q.dequantize(x.dtype), bias)
    return out.view(*x.shape[:-1], out.shape[-1])


def quant_swiglu(x: torch.Tensor, q: QuantWeight) -> torch.Tensor | None:
    """silu(gate) * up for a quantised [gate; up] weight (no bias), or None where no kernel applies
    (also whenever the kernel mode's fast paths are off, asked before x is looked at: x is an fx
    Proxy while graph/fusion.py traces)."""
    if (
        KERNEL_MODE.get().fast_paths and x.dim() == 2 and x.shape[0] <= cpu_quant.MAX_ROWS
        and cpu_quant.usable(x, q.qweight)
    ):
        w, s = q.kernel_weights()
        return cpu_quant.gemv_swiglu(q.method, x, w, s, q.group_size)
    return None
