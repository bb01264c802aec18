"""Fused rotary embedding of q and k in Triton, and its torch twin.

The engine's convention (`graph.layers.RotaryEmbedding` / `apply_rotary`): rotate-half (neox
style, as HF Llama; not interleaved), with cos/sin looked up once per step as [..., T, 1, head_dim]
whose two halves repeat the same frequencies. For x = [x1, x2] (halves of the head dim):
    out = [x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2]
One launch rotates every head of q and k for all tokens (program = token x head); q and k may be
strided views of the fused qkv projection (last dim contiguous). Returns new contiguous tensors.
The kernel computes in fp32 and rounds once; the twin rounds after each torch op, so in
bf16/fp16 they agree to the dtype's rounding, not bit for bit.
"""

import torch

from strata.kernels.triton._runtime import check_launchable, next_pow2, tl, triton, use_triton


def apply_rotary_qk_ref(
    q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin: graph.layers.apply_rotary on q [..., T, H, d] and k [..., T, KVH, d]."""
    cos, sin = rope
    half = q.shape[-1] // 2

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    return rotate(q), rotate(k)


if triton is not None:

    @triton.jit
    def _rotary_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
        NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, HALF_P)
        mask = d < HALF
        if h < NUM_Q_HEADS:
            src = q_ptr + t * stride_qt + h * stride_qh
            dst = q_out_ptr + (t * NUM_Q_HEADS + h) * (2 * HALF)
        else:
            src = k_ptr + t * stride_kt + (h - NUM_Q_HEADS) * stride_kh
            dst = k_out_ptr + (t * NUM_KV_HEADS + h - NUM_Q_HEADS) * (2 * HALF)
        x1 = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + d, mask=mask, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + t * stride_ct + d, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + t * stride_ct + HALF + d, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + t * stride_st + d, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + t * stride_st + HALF + d, mask=mask, other=0.0).to(tl.float32)
        out_ty = q_out_ptr.dtype.element_ty
        tl.store(dst + d, (x1 * c1 - x2 * s1).to(out_ty), mask=mask)
        tl.store(dst + HALF + d, (x2 * c2 + x1 * s2).to(out_ty), mask=mask)
else:  # without triton the names exist, and check_launchable explains
    _rotary_kernel = None


def _rows(x: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    x = x.reshape(-1, heads, dim)
    return x if x.stride(-1) == 1 else x.contiguous()


def apply_rotary_qk_triton(
    q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel (CUDA tensors, or any under TRITON_INTERPRET=1)."""
    check_launchable(_rotary_kernel, q, k)
    cos, sin = rope
    heads, dim = q.shape[-2:]
    kv_heads = k.shape[-2]
    assert dim % 2 == 0 and k.shape[-1] == dim and q.dtype == k.dtype, (q.shape, k.shape)
    q2, k2 = _rows(q, heads, dim), _rows(k, kv_heads, dim)
    cos2, sin2 = _rows(cos, 1, dim).view(-1, dim), _rows(sin, 1, dim).view(-1, dim)
    tokens = q2.shape[0]
    assert k2.shape[0] == tokens and cos2.shape[0] == tokens, (q.shape, k.shape, cos.shape)
    q_out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(tokens, kv_heads, dim, dtype=k.dtype, device=k.device)
    if tokens:
        _rotary_kernel[(tokens, heads + kv_heads)](
            q2, k2, cos2, sin2, q_out, k_out,
            q2.stride(0), q2.stride(1), k2.stride(0), k2.stride(1), cos2.stride(0), sin2.stride(0),
            NUM_Q_HEADS=heads, NUM_KV_HEADS=kv_heads, HALF=dim // 2, HALF_P=next_pow2(dim // 2),
            num_warps=1 if dim <= 128 else 2,
        )
    return q_out.view(q.shape), k_out.view(k.shape)


def apply_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: the Triton kernel on CUDA when Triton is importable, else the torch twin."""
    if use_triton(q, k, rope[0]):
        return apply_rotary_qk_triton(q, k, rope)
    return apply_rotary_qk_ref(q, k, rope)
