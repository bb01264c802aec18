"""The one dispatch point for dense projections: a skinny-matmul kernel where it pays, else torch."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from strata.kernels import cpu_bf16, cpu_gemm, cpu_gemv, cpu_quant
from strata.kernels.dispatch import KERNEL_MODE


def _onednn_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        cpu_gemm.path_of(weight) == "onednn" and KERNEL_MODE.get().fast_paths and x.dtype is torch.float32
        and weight.dtype is torch.float32 and x.is_cpu and weight.is_cpu and weight.is_contiguous()
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Few CPU rows: the numba GEMV for fp32 weights, the narrow-reading one for bf16 weights;
    many fp32 CPU rows: the GEMM path marked on the weight (cpu_gemm.py); everything else (GPUs, autograd)
    F.linear."""
    if cpu_gemv.usable(x, weight):
        return cpu_gemv.gemv(x, weight, bias)
    if _onednn_applies(x, weight):
        return cpu_gemm.onednn_linear(x, weight, bias)
    if cpu_bf16.usable(x, weight):
        return cpu_bf16.gemv(x, weight, bias)
    if weight.dtype is torch.bfloat16 and x.dtype is torch.float32:  # bf16 storage, fp32 activations
        if not (x.is_cpu and weight.is_cpu) or (torch.is_grad_enabled() and x.requires_grad):
            return F.linear(x, weight.float(), bias)  # reference: widen, then fp32
        x2 = x.reshape(-1, x.shape[-1])
        out = cpu_bf16.gemv(x2, weight, bias) if cpu_bf16.usable(x2, weight) else cpu_bf16.matmul(x2, weight, bias)
        return out.view(*x.shape[:-1], out.shape[-1])
    return F.linear(x, weight, bias)


def swiglu(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(x @ gate.T) * (x @ up.T) for a [gate; up] weight (no bias) in one pass over it, or None
    where no fused kernel applies (the caller then runs linear + silu_mul)."""
    if cpu_gemv.usable(x, gate_up):
        return cpu_gemv.gemv_swiglu(x, gate_up)
    if cpu_bf16.usable(x, gate_up):
        return cpu_bf16.gemv_swiglu(x, gate_up)
    return None


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
            out = cpu_quant.matmul(q.method, x2, w, s, q.group_size, bias, cpu_gemm.path_of(q),
                                   cpu_gemm.fallback_of(q))
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
