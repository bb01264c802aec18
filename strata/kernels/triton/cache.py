"""KV write into the paged cache by slot mapping, in Triton, and its torch twin.

Semantics are `attention.write_kv`: token t's keys and values [kv_heads, d] land at flat slot
slots[t] (block * block_size + offset) of the layer's cache [2, blocks, block_size, kv_heads, d].
Both skip negative slots (padding tokens, e.g. of a captured CUDA graph's fixed batch). k and v
may be strided views of the fused qkv projection (last dim contiguous); values are cast to the
cache's dtype.
"""

import torch

from strata.kernels.triton._runtime import check_launchable, next_pow2, tl, triton, use_triton


def write_kv_ref(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """The torch twin: attention.write_kv (index_copy_ into the flattened cache), minus padding."""
    kv_heads, head_dim = k.shape[-2:]
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        k, v, slots = k[keep], v[keep], slots[keep]
    kv_cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, v.to(kv_cache.dtype))


if triton is not None:

    @triton.jit
    def _write_kv_kernel(
        k_ptr, v_ptr, slots_ptr, k_cache_ptr, v_cache_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_cblk, stride_ctok, stride_ch,
        BLOCK_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, HEADS_P: tl.constexpr,
        HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        if slot >= 0:
            h = tl.arange(0, HEADS_P)
            d = tl.arange(0, DIM_P)
            mask = (h[:, None] < KV_HEADS) & (d[None, :] < HEAD_DIM)
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            dst = blk * stride_cblk + off * stride_ctok + h[:, None] * stride_ch + d[None, :]
            k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
            v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
            tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
else:  # without triton the names exist, and check_launchable explains
    _write_kv_kernel = None


def write_kv_triton(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """The Triton kernel (CUDA tensors, or any under TRITON_INTERPRET=1)."""
    check_launchable(_write_kv_kernel, kv_cache, k, v, slots)
    _, _, block_size, kv_heads, dim = kv_cache.shape
    assert kv_cache.stride(-1) == 1, "the cache's last dim must be contiguous"
    k2 = k.reshape(-1, kv_heads, dim)
    v2 = v.reshape(-1, kv_heads, dim)
    k2 = k2 if k2.stride(-1) == 1 else k2.contiguous()
    v2 = v2 if v2.stride(-1) == 1 else v2.contiguous()
    tokens = k2.shape[0]
    assert v2.shape[0] == tokens and slots.numel() == tokens, (k.shape, v.shape, slots.shape)
    if tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _write_kv_kernel[(tokens,)](
        k2, v2, slots, k_cache, v_cache,
        k2.stride(0), k2.stride(1), v2.stride(0), v2.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=block_size, KV_HEADS=kv_heads, HEADS_P=next_pow2(kv_heads),
        HEAD_DIM=dim, DIM_P=next_pow2(dim), num_warps=1 if kv_heads * dim <= 1024 else 4,
    )


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Dispatch: the Triton kernel on CUDA when Triton is importable, else the torch twin."""
    if use_triton(kv_cache, k, v):
        write_kv_triton(kv_cache, k, v, slots)
    else:
        write_kv_ref(kv_cache, k, v, slots)
