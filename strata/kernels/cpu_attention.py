"""Paged decode attention on CPU (numba): reads each cached K/V row once, straight from its block.

The torch paths gather every sequence's blocks into a padded copy and then run SDPA over it, so
decode attention moves the KV cache three times; profiled on a 16-request batch, the gather and
SDPA were 65% of step time. This kernel walks the block table instead: per (sequence, part of
its keys), every KV head's scores for its group of query heads, a softmax, then the weighted sum
of V; parts of one sequence are merged by their maxima and sums (flash-decoding). Its reference
twin is the "torch" attention backend's decode (kernels/attention/torch_backend.py); tests compare
the two. It is the "cpu" backend's decode (kernels/attention/cpu_backend.py).
"""

from __future__ import annotations

import numpy as np
import torch

from strata.kernels import cpu_gemv, kv_quant
from strata.kernels.dispatch import KERNEL_MODE, kernel

try:
    import numba
    from numba import njit, prange
except ImportError:  # pragma: no cover
    numba = None


def available() -> bool:
    return numba is not None


if numba is not None:
    from strata.kernels.cpu_attention_rows import pv_rows, qk_scores

    _LOG2E = np.float32(1.4426950408889634)
    _LN2 = np.float32(0.6931471805599453)
    # split a sequence only into parts of at least this much work (keys x query heads x head_dim):
    # 32 keys of smol-135m's 9 heads of 64 (measured on the Zen 4 dev VM, batch 1, 16-4000 keys)
    _SPLIT_MIN_WORK = 32 * 9 * 64
    _SPLIT_ITEMS = 8  # split until (sequences x parts) reaches this many items
    _PARALLEL_MERGE = 1 << 15  # merge (sequences x heads x head_dim) outputs in parallel from this many

    @njit(fastmath=True, cache=True, inline="always")
    def _exp_nonpositive(x, n, bits):  # pragma: no cover - compiled
        """x[:n] = exp(x[:n]) for x <= 0, as 2^k * p(f): two loops LLVM vectorises (a libm expf per
        score cost ~10-20% of decode attention). p is the degree-6 Taylor series of 2^f on
        |f| <= 1/2: relative error < 2e-7, about one fp32 ulp. Below e^-87 the result is 0's
        neighbour (fp32's smallest normal), which no softmax weight notices."""
        for i in range(n):
            y = max(x[i], np.float32(-87.0)) * _LOG2E
            k = np.floor(y + np.float32(0.5))
            f = (y - k) * _LN2
            x[i] = np.float32(1.0) + f * (np.float32(1.0) + f * (np.float32(1 / 2) + f * (np.float32(1 / 6) + f * (
                np.float32(1 / 24) + f * (np.float32(1 / 120) + f * np.float32(1 / 720))))))
            bits[i] = (np.int32(k) + np.int32(127)) << np.int32(23)
        two_k = bits.view(np.float32)
        for i in range(n):
            x[i] *= two_k[i]

    @njit(fastmath=True, cache=True, inline="always")
    def _qk_scalar(q, q_row, k_cache, k_row, scores, t, scale):  # pragma: no cover - compiled
        """qk_scores for one key, for a head_dim that is not a multiple of 16."""
        qf, kf = q.reshape(-1, q.shape[-1]), k_cache.reshape(-1, k_cache.shape[-1])
        for g in range(scores.shape[0]):
            s = np.float32(0.0)
            for d in range(qf.shape[1]):
                s += qf[q_row + g, d] * kf[k_row, d]
            scores[g, t] = s * scale

    @njit(fastmath=True, cache=True, inline="always")
    def _pv_scalar(scores, t, v_cache, v_row, acc):  # pragma: no cover - compiled
        """pv_rows for one key, for a head_dim that is not a multiple of 16."""
        vf = v_cache.reshape(-1, v_cache.shape[-1])
        for g in range(acc.shape[0]):
            p = scores[g, t]
            for d in range(acc.shape[1]):
                acc[g, d] += p * vf[v_row, d]

    @njit(cache=True, inline="always")
    def _key_rows(table, start, stop, block, kv_heads, rows):  # pragma: no cover - compiled
        """rows[t] = the flattened cache row of key start + t for KV head 0 (add the head), walking
        the block table block by block: one lookup per block, not per key; K and V share it."""
        pos = start
        while pos < stop:
            blk, off = table[pos // block], pos % block
            for j in range(min(block - off, stop - pos)):
                rows[pos - start + j] = (blk * block + off + j) * kv_heads
            pos += min(block - off, stop - pos)

    @njit(fastmath=True, cache=True)
    def _attend_part(q, k_cache, v_cache, tables, lens, scale, window, parts, item,
                     part_max, part_sum, part_acc):  # pragma: no cover - compiled
        """Work item `item` = (sequence, part of its keys): every KV head's scores, their softmax
        numerators (max and sum kept per query head) and the unnormalised sum of p * v."""
        heads, dim = q.shape[1], q.shape[2]
        block, kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = heads // kv_heads
        acc = part_acc[item]
        for kh in range(kv_heads):  # explicit loops: under parallel=True np.zeros is a parallel region
            for g in range(group):
                part_sum[item, kh, g] = 0.0
                for d in range(dim):
                    acc[kh, g, d] = 0.0
        b, part = item // parts, item % parts
        first = 0 if window <= 0 else max(0, lens[b] - window)  # sliding window: the last `window` keys
        length = lens[b] - first
        per = -(-length // parts)
        start, stop = first + min(length, part * per), first + min(length, (part + 1) * per)
        n = stop - start
        if n <= 0:
            return
        rows = np.empty(n, np.int64)
        _key_rows(tables[b], start, stop, block, kv_heads, rows)
        scores = np.empty((kv_heads, group, n), np.float32)
        vector = dim % 16 == 0
        if vector:
            qk_scores(q, b * heads, k_cache, rows, scores, scale)
        else:
            for t in range(n):
                for kh in range(kv_heads):
                    _qk_scalar(q, b * heads + kh * group, k_cache, rows[t] + kh, scores[kh], t, scale)
        bits = np.empty(n, np.int32)
        for kh in range(kv_heads):
            for g in range(group):
                sc = scores[kh, g]
                m = sc[0]
                for t in range(1, n):
                    m = max(m, sc[t])
                for t in range(n):
                    sc[t] -= m
                _exp_nonpositive(sc, n, bits)
                total = np.float32(0.0)
                for t in range(n):
                    total += sc[t]
                part_max[item, kh, g] = m
                part_sum[item, kh, g] = total
        if vector:
            pv_rows(scores, v_cache, rows, acc)
        else:
            for t in range(n):
                for kh in range(kv_heads):
                    _pv_scalar(scores[kh], t, v_cache, rows[t] + kh, acc[kh])

    @njit(cache=True)
    def split_parts(batch, longest, heads, dim):  # pragma: no cover - compiled
        """The parts each of `batch` sequences' keys are cut into, for the `longest` one's keys: a
        power of two, at most _SPLIT_ITEMS // batch, each part at least _SPLIT_MIN_WORK. For
        smol-135m's 9 heads of 64 at batch 1: 2 parts from 64 keys, all 8 from 256 (a 16k-32k
        context is 8 parts of 2k-4k keys, spread over every thread)."""
        cap = max(1, min(_SPLIT_ITEMS // batch, longest * heads * dim // _SPLIT_MIN_WORK))
        parts = 1
        while parts * 2 <= cap:
            parts *= 2
        return parts

    @njit(fastmath=True, cache=True)
    def _merge_head(bh, parts, part_max, part_sum, part_acc, out):  # pragma: no cover - compiled
        """out for one (sequence, query head): its parts rescaled to the common max, normalised."""
        heads, dim = out.shape[1], out.shape[2]
        group = heads // part_max.shape[1]
        b, h = bh // heads, bh % heads
        kh, g = h // group, h % group
        m = np.float32(-np.inf)
        for part in range(parts):
            if part_sum[b * parts + part, kh, g] > 0:
                m = max(m, part_max[b * parts + part, kh, g])
        total = np.float32(0.0)
        for d in range(dim):
            out[b, h, d] = 0.0
        for part in range(parts):
            i = b * parts + part
            if part_sum[i, kh, g] > 0:
                w = np.exp(part_max[i, kh, g] - m)
                total += w * part_sum[i, kh, g]
                for d in range(dim):
                    out[b, h, d] += w * part_acc[i, kh, g, d]
        inv = np.float32(1.0) / total
        for d in range(dim):
            out[b, h, d] *= inv

    @njit(parallel=True, fastmath=True, cache=True)
    def _paged_decode(q, k_cache, v_cache, tables, lens, scale, window, out):  # pragma: no cover - compiled
        batch, heads, dim = q.shape
        kv_heads = k_cache.shape[2]
        group = heads // kv_heads
        # Work items are (sequence, part of its keys), every KV head at once, so a thread reads
        # each cache block front to back (one head's rows alone are strided: measured ~2x slower
        # from DRAM). With few sequences, long ones are cut into parts, each with its own max and
        # sum, merged below (flash-decoding); else batch-1 decode would run on one thread. A part
        # keeps at least _SPLIT_MIN_WORK: below that a parallel region costs more than the thread
        # it adds. The part count is a power of two (items split evenly over 1, 2, 4 or 8 threads)
        # and never depends on the thread count, so the result's bits do not either (the adaptive
        # thread tuner changes it mid-run: platform/adaptive_threads.py).
        longest = 0
        for b in range(batch):
            longest = max(longest, lens[b] if window <= 0 else min(lens[b], window))
        parts = split_parts(batch, longest, heads, dim)
        items = batch * parts
        part_max = np.empty((items, kv_heads, group), np.float32)
        part_sum = np.empty((items, kv_heads, group), np.float32)
        part_acc = np.empty((items, kv_heads, group, dim), np.float32)
        if items == 1:  # one sequence, one part: no parallel region (~5 us each on the dev VM)
            _attend_part(q, k_cache, v_cache, tables, lens, scale, window, parts, 0, part_max, part_sum, part_acc)
        else:
            for item in prange(items):
                _attend_part(q, k_cache, v_cache, tables, lens, scale, window, parts, item,
                             part_max, part_sum, part_acc)
        if batch * heads * dim < _PARALLEL_MERGE:
            for bh in range(batch * heads):
                _merge_head(bh, parts, part_max, part_sum, part_acc, out)
        else:
            for bh in prange(batch * heads):
                _merge_head(bh, parts, part_max, part_sum, part_acc, out)


def reads_cache(kv_cache: torch.Tensor) -> bool:
    """A contiguous CPU cache the kernels read: fp32, or bf16 or int8 (kv_cache_dtype; int8 rows end
    in their scale, kernels/kv_quant.py) with a head_dim that is a multiple of 16 (the vector row
    loops widen or convert it; the scalar ones read fp32 only). fp8 is read by the torch path only."""
    if not (kv_cache.is_cpu and kv_cache.is_contiguous()):
        return False
    dt = kv_cache.dtype
    return dt is torch.float32 or (dt in (torch.bfloat16, torch.int8) and kv_quant.head_dim_of(kv_cache) % 16 == 0)


def usable(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (
        KERNEL_MODE.get().fast_paths
        and numba is not None
        and q.device.type == "cpu"
        and q.dtype == torch.float32
        and reads_cache(kv_cache)
    )


def cache_views(kv_cache: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(K, V) numpy views of one layer's cache: fp32 and int8 as they are, bf16 as its bit patterns
    (uint16)."""
    if kv_cache.dtype == torch.bfloat16:
        bits = kv_cache.view(torch.int16).numpy().view(np.uint16)
        return bits[0], bits[1]
    return kv_cache[0].numpy(), kv_cache[1].numpy()


@kernel("paged_decode")
def paged_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
    scale: float, window: int | None = None,
) -> torch.Tensor:
    """q [B, heads, d] over the paged cache [2, blocks, block_size, kv_heads, d] -> [B, heads * d];
    `window`: attend only to each sequence's last `window` tokens (None: all)."""
    q = q.contiguous()
    out = torch.empty_like(q)
    cpu_gemv.sync_threads()
    k_cache, v_cache = cache_views(kv_cache)
    _paged_decode(
        q.numpy(), k_cache, v_cache, block_tables.numpy(),
        context_lens.numpy(), np.float32(scale), np.int64(window or 0), out.numpy(),
    )
    return out.view(q.shape[0], -1)
