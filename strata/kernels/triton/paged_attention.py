"""Paged decode attention (one query token per sequence) in Triton, and its torch twin.

Shapes follow `strata.kernels.attention`: q [B, heads, d]; the layer's cache
[2, num_blocks, block_size, kv_heads, d]; block_tables [B, max_blocks] (padded with any valid block
id); context_lens [B] (tokens including the new one, whose K/V are already in the cache). Query
head h reads KV head h // (heads // kv_heads), as the engine lays out grouped-query attention.
Returns [B, heads * d] in q's dtype.

The kernel is split-K with an online softmax (flash-decoding): program (b, kv_head, split) takes
the query heads of that KV head (padded to a power of two) and one partition of the sequence's
tokens, walks it in tiles of BLOCK_N tokens, finding each token's row through the block table (so
any block size works, and a tile may span blocks or end in a partial block), and keeps a running
max, sum and weighted V in fp32. With one split it normalises and stores the output directly;
with several, each split stores (max, sum, unnormalised acc) and a second kernel merges them.
The split count comes from max_blocks (host-side shape, no device sync), so it is fixed for a
given table width and therefore CUDA-graph friendly.
"""

import functools
import math

import torch

from strata.kernels.triton._runtime import check_launchable, next_pow2, tl, triton, use_triton

LOG2E = 1.4426950408889634


def paged_decode_attention_ref(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The torch twin: gather each sequence's blocks, mask past its length, softmax in fp32."""
    b, heads, dim = q.shape
    block_size, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = heads // kv_heads
    kv = kv_cache.index_select(1, block_tables.reshape(-1)).view(2, b, -1, kv_heads, dim)
    k = kv[0].transpose(1, 2).float()  # [B, kvh, L, d]
    v = kv[1].transpose(1, 2).float()
    qg = q.view(b, kv_heads, group, dim).float()
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [B, kvh, group, L]
    keys = torch.arange(block_tables.shape[1] * block_size, device=q.device)
    valid = keys[None, :] < context_lens.to(q.device)[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(-1), v)  # [B, kvh, group, d]
    return out.to(q.dtype).reshape(b, heads * dim)


if triton is not None:

    @triton.jit
    def _decode_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
        scale_log2,
        stride_qb, stride_qh,
        stride_kblk, stride_ktok, stride_kh,
        stride_tb,
        stride_ob, stride_oh,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
    ):
        b = tl.program_id(0)
        kh = tl.program_id(1)
        split = tl.program_id(2)
        num_kv_heads = tl.num_programs(1)
        length = tl.load(lens_ptr + b).to(tl.int32)
        start = split * PARTITION
        end = tl.minimum(start + PARTITION, length)

        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, DIM_P)
        n = tl.arange(0, BLOCK_N)
        g_mask = g < GROUP
        d_mask = d < HEAD_DIM
        heads = kh * GROUP + g  # query heads of this KV head
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=g_mask[:, None] & d_mask[None, :], other=0.0,
        ).to(tl.float32)

        m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, DIM_P], tl.float32)
        for t0 in range(start, end, BLOCK_N):
            tok = t0 + n
            t_mask = tok < end
            blk = tl.load(tables_ptr + b * stride_tb + tok // BLOCK_SIZE, mask=t_mask, other=0)
            row = blk.to(tl.int64) * stride_kblk + (tok % BLOCK_SIZE) * stride_ktok + kh * stride_kh
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale_log2  # [GROUP_P, BLOCK_N]
            s = tl.where(t_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile has a valid token
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            v = tl.load(v_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new

        out_mask = g_mask[:, None] & d_mask[None, :]
        if NUM_SPLITS == 1:
            out = acc / l_i[:, None]
            tl.store(
                out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                out.to(out_ptr.dtype.element_ty), mask=out_mask,
            )
        else:
            # partials laid out [B, heads, NUM_SPLITS, ...]; an empty split leaves (-inf, 0, 0)
            slot = (b * num_kv_heads * GROUP + heads) * NUM_SPLITS + split
            tl.store(part_acc_ptr + slot[:, None] * DIM_P + d[None, :], acc, mask=out_mask)
            tl.store(part_ml_ptr + slot * 2, m_i, mask=g_mask)
            tl.store(part_ml_ptr + slot * 2 + 1, l_i, mask=g_mask)

    @triton.jit
    def _merge_kernel(
        part_acc_ptr, part_ml_ptr, out_ptr, stride_ob, stride_oh,
        HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        heads = tl.num_programs(1)
        s = tl.arange(0, SPLITS_P)
        d = tl.arange(0, DIM_P)
        s_mask = s < NUM_SPLITS
        slot = (b * heads + h) * NUM_SPLITS + s
        m = tl.load(part_ml_ptr + slot * 2, mask=s_mask, other=float("-inf"))
        total = tl.load(part_ml_ptr + slot * 2 + 1, mask=s_mask, other=0.0)
        acc = tl.load(part_acc_ptr + slot[:, None] * DIM_P + d[None, :], mask=s_mask[:, None], other=0.0)
        m_max = tl.max(m, axis=0)  # split 0 always holds a token, so this is finite
        w = tl.exp2(m - m_max)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(total * w, axis=0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
else:  # without triton the names exist, and check_launchable explains
    _decode_kernel = None
    _merge_kernel = None


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _tile_tokens(group_p: int, dim_p: int) -> int:
    """Tokens per tile: keep the [group, tokens, dim] product near 2K fp32 values (8 to 64 tokens).

    Register use read with ptxas for sm_90a (bf16, no spills anywhere): [8, 8, 64] 128 registers
    at 4 warps, [1, 16, 128] 108, [2, 16, 64] 127, [16, 8, 128] 166 at 8 warps; 8K-value tiles
    took 207-255 registers ([1, 64, 128] spilled). Not yet timed on a GPU."""
    return max(8, min(64, _floor_pow2(2048 // (group_p * dim_p))))


def _floor_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _partition_tokens(batch: int, kv_heads: int, max_tokens: int, block_n: int, device_sms: int) -> int:
    """Tokens per split: enough (batch x kv_heads x splits) programs to fill the GPU twice over,
    but never partitions smaller than 256 tokens (or one tile)."""
    want_splits = max(1, (2 * device_sms) // max(1, batch * kv_heads))
    part = max(256, -(-max_tokens // want_splits))
    return max(block_n, next_pow2(part))


def paged_decode_attention_triton(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
    scale: float, partition_size: int | None = None,
) -> torch.Tensor:
    """The Triton kernel (CUDA tensors, or any under TRITON_INTERPRET=1); `partition_size` (tokens
    per split, a power of two) overrides the automatic split, e.g. to test the merge on short
    contexts."""
    check_launchable(_decode_kernel, q, kv_cache, block_tables, context_lens)
    b, heads, dim = q.shape
    _, _, block_size, kv_heads, cdim = kv_cache.shape
    assert cdim == dim and heads % kv_heads == 0, (q.shape, kv_cache.shape)
    assert kv_cache.stride(-1) == 1, "the cache's last dim must be contiguous"
    group = heads // kv_heads
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    context_lens = context_lens.contiguous()
    out = torch.empty(b, heads, dim, dtype=q.dtype, device=q.device)
    if b == 0:
        return out.view(0, heads * dim)
    group_p, dim_p = next_pow2(group), next_pow2(dim)
    block_n = _tile_tokens(group_p, dim_p)
    max_tokens = block_tables.shape[1] * block_size
    if partition_size is None:
        sms = 1
        if q.is_cuda:
            sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
        partition_size = _partition_tokens(b, kv_heads, max_tokens, block_n, sms)
    assert partition_size > 0 and partition_size & (partition_size - 1) == 0, partition_size
    block_n = min(block_n, partition_size)
    splits = max(1, math.ceil(max_tokens / partition_size))
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if splits > 1:
        part_acc = torch.empty(b, heads, splits, dim_p, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(b, heads, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _decode_kernel[(b, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_ml,
        float(scale) * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_P=group_p, HEAD_DIM=dim, DIM_P=dim_p,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, PARTITION=partition_size, NUM_SPLITS=splits,
        num_warps=8 if group_p * block_n * dim_p > 4096 else 4,
    )
    if splits > 1:
        _merge_kernel[(b, heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1),
            HEAD_DIM=dim, DIM_P=dim_p, NUM_SPLITS=splits, SPLITS_P=next_pow2(splits),
            num_warps=4,
        )
    return out.view(b, heads * dim)


def paged_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA when Triton is importable, else the torch twin."""
    if use_triton(q, kv_cache):
        return paged_decode_attention_triton(q, kv_cache, block_tables, context_lens, scale)
    return paged_decode_attention_ref(q, kv_cache, block_tables, context_lens, scale)
