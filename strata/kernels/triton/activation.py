"""Fused SiLU(gate) * up in Triton, and its torch twin.

The input is the fused gate/up projection as `graph.layers.GatedMLP` produces it: [..., 2 * I]
with gate = [..., :I] and up = [..., I:]. Output [..., I] in the input's dtype, rounded like torch
(silu in fp32, rounded to the dtype, then the product rounded again).
"""

import torch
import torch.nn.functional as F

from strata.kernels.triton._runtime import check_launchable, next_pow2, tl, triton, use_triton


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """The torch twin: silu(gate) * up, exactly GatedMLP's unfused path."""
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]


if triton is not None:

    @triton.jit
    def _silu_and_mul_kernel(
        x_ptr, out_ptr, inter, stride_x, stride_out, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)
else:  # without triton the names exist, and check_launchable explains
    _silu_and_mul_kernel = None


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """The Triton kernel (CUDA tensors, or any under TRITON_INTERPRET=1)."""
    check_launchable(_silu_and_mul_kernel, gate_up)
    two_i = gate_up.shape[-1]
    assert two_i % 2 == 0, gate_up.shape
    inter = two_i // 2
    x = gate_up.reshape(-1, two_i)
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_pow2(inter))
    if x.shape[0]:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(inter, block))](
            x, out, inter, x.stride(0), out.stride(0), BLOCK=block, num_warps=4,
        )
    return out.view(*gate_up.shape[:-1], inter)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA when Triton is importable, else the torch twin."""
    if use_triton(gate_up):
        return silu_and_mul_triton(gate_up)
    return silu_and_mul_ref(gate_up)
