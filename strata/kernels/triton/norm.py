"""Fused residual add + RMSNorm in Triton, and its torch twin.

Semantics are `graph.layers.RMSNorm.forward(x, residual)`: the residual is added in the model's
dtype (that rounded sum is the new residual and what gets normalised); fp32 normalises as
F.rms_norm; other dtypes normalise in fp32, cast back, then scale by the weight (as HF does).
One program per row, the whole row in registers. (No `from __future__ import annotations` in the
kernel modules: Triton reads the kernels' annotations.)
"""

import torch
import torch.nn.functional as F

from strata.kernels.triton._runtime import check_launchable, next_pow2, tl, triton, use_triton


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch twin: (rms_norm(x + residual) * weight, x + residual); None without a residual."""
    if residual is not None:
        x = x + residual
        residual = x
    if x.dtype == torch.float32:
        out = F.rms_norm(x, (x.shape[-1],), weight, eps)
    else:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * xf.to(x.dtype)
    return out, residual


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps, n_cols,
        stride_x, stride_res, stride_out, stride_res_out,
        HAS_RESIDUAL: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x = x + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
            summed = x.to(res_out_ptr.dtype.element_ty)  # torch adds in the model dtype
            tl.store(res_out_ptr + row * stride_res_out + cols, summed, mask=mask)
            x = summed.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = x * inv
        if ROUND_BEFORE_WEIGHT:
            y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)
else:  # without triton the names exist, and check_launchable explains
    _add_rms_norm_kernel = None


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Triton kernel (CUDA tensors, or any under TRITON_INTERPRET=1); outputs in x's dtype."""
    check_launchable(_add_rms_norm_kernel, x, weight)
    shape, n = x.shape, x.shape[-1]
    x2 = x.reshape(-1, n)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res2 = res_out = None
    if residual is not None:
        res2 = residual.reshape(-1, n)
        res2 = res2 if res2.stride(-1) == 1 else res2.contiguous()
        res_out = torch.empty_like(out)
    rows = x2.shape[0]
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x2, res2 if res2 is not None else x2, weight.contiguous(), out,
            res_out if res_out is not None else out, float(eps), n,
            x2.stride(0), (res2 if res2 is not None else x2).stride(0), out.stride(0), out.stride(0),
            HAS_RESIDUAL=residual is not None, ROUND_BEFORE_WEIGHT=x.dtype != torch.float32,
            BLOCK=next_pow2(n), num_warps=4 if n <= 2048 else 8,
        )
    return out.view(shape), (res_out.view(shape) if res_out is not None else None)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dispatch: the Triton kernel on CUDA when Triton is importable, else the torch twin."""
    if use_triton(x, weight):
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)
