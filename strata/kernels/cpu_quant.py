"""Weight-only int8 / int4 matmul on CPU: numba kernels over the formats in quant_formats.py.

Kernels: batch-1 decode is GEMV and reads every weight once, so reading 1 or 0.5 byte per weight
instead of 4 is the whole gain. The numba kernels follow kernels/cpu_gemv.py (contiguous slabs of
output rows per thread, 1-D row views, fastmath) and accumulate in fp32: int8 converts each byte
and FMAs it with x, the per-row scale applied once at the end; int4 unpacks the nibbles (and /
shift on bytes), sums each group against x and scales the group sum, with the -8 offset folded
into a per-call sum of x over each group. The two row dots are explicit vector LLVM IR
(cpu_simd.py), the loops around them plain numba.
For more than one input row the int4 kernel dequantises each weight row once into a per-thread
fp32 buffer and reuses it for every input row. Above MAX_ROWS rows (prefill, large batches) the
weight is dequantised (to bf16 where the bf16 GEMM was measured faster, else tile by tile to
fp32) and a GEMM runs (matmul): there compute dominates.

torch's own CPU weight-only kernels were measured on the dev box (Zen 4, AVX-512 VNNI/BF16) and
do not pay: `_weight_int8pack_mm` reads 2.4 GB/s of int8 with fp32 activations (6.9 with bf16),
`_weight_int4pack_mm_for_cpu` 0.5 GB/s (4.2 with bf16), and both scale linearly with rows
(no GEMM), against ~27-37 GB/s of int8 and ~20 GB/s of packed int4 (~40 G weights/s, compute-
bound) streamed from DRAM by the kernels here.

int4 with int8 activations (VNNI). On a CPU with AVX-512 VNNI, a batch-1 int4 GEMV with groups
of 64 or 128 quantises its input row to int8 per weight group (symmetric, scale = max|x| / 127,
round half to even: quant_formats.quantize_activations_ref) and multiplies in integers with
VPDPBUSD (cpu_simd.i4_dot_vnni), as llama.cpp's q4_0 x q8_0 does. The fp32 kernel above spends
its time converting nibbles to floats (compute-bound at ~37 G weights/s on the dev box); the
integer one measured ~51 G weights/s on qwen-0.5b's gate/up shape, which puts batch-1 int4 decode
at the DRAM stream rate. The activation rounding adds ~0.5% of a row's largest output to its
error, against the int4 weights' own ~1/15 of a step. STRATA_INT4_FP32_ACTIVATIONS=1 keeps the
fp32 kernel (exact weight-only arithmetic).

Grouped int8 (a scale per 32 columns: a GGUF's Q8_0, exactly) and int4 group 32 (Q4_0) quantise
their activations as llama.cpp's q8_0 blocks (_quant_q8, quant_formats.
quantize_activations_q8_0_ref) at any row count: the _int8g_* kernels (cpu_simd.i8_dot_vnni_g32;
an fp32 loop without VNNI) and, under STRATA_GROUP32_PREFILL=q8_0, the four-row prefill kernels.

Grouped layouts with zero points (scale [out, 2, groups]: a GGUF's Q4_1 / Q5_1 / Q4_K / Q5_K, an
AWQ / GPTQ / compressed-tensors asymmetric int4; quant_formats.py): the symmetric row dot on the
scales, minus zero . (the input row's group sums), per output row in one loop (_int4z_*,
_int8gz_*); grouped int8 by 16 columns (Q6_K) dots four groups per VPDPBUSD (i8_dot_vnni_g16).

Every kernel's reference twin is the torch path: dequantize_*_ref then F.linear (for the VNNI
path, of quantize_activations_ref(x) instead of x).
"""

from __future__ import annotations

import numpy as np
import torch

from strata.errors import ConfigError
from strata.kernels import cpu_gemm, cpu_gemv, cpu_w8a8, quant_formats
from strata.kernels.cpu_w8a8 import (  # noqa: F401
    INT4_PREFILL_ENV,
    INT4_PREFILL_MAX_RATIO,
    INT8_PREFILL_ENV,
    INT8_PREFILL_MAX_RATIO,
    int8_prefill_enabled,
)
from strata.kernels.dispatch import KERNEL_MODE, kernel
from strata.settings import SETTINGS

try:
    import numba
    from numba import njit, prange

    from strata.kernels.cpu_gemv import BLOCK_ROWS, _pair_rows
    from strata.kernels.cpu_simd import (
        f32_dot,
        has_avx512_vnni,
        has_avx512bw,
        i4_dot,
        i4_dot_vnni,
        i4_dot_vnni_g32,
        i4_row,
        i4_row_bf16,
        i4_row_bf16_lut,
        i4g32_dot4_vnni,
        i8_dot,
        i8_dot_vnni,
        i8_dot_vnni_g16,
        i8_dot_vnni_g32,
        i8g_dot4_vnni,
    )
except ImportError:  # pragma: no cover - exercised only where numba is absent
    numba = None

MAX_ROWS = 16  # measured like cpu_gemv: above this, dequantise + fp32 GEMM
PREFILL_ROW_BLOCK = 64  # group-32 prefill: input rows per pass over the weight (their int8 codes stay in L2)


def available() -> bool:
    return numba is not None


_VNNI = numba is not None and has_avx512_vnni()  # the CPU does not change under a process
_AVX512BW = numba is not None and has_avx512bw()  # VPERMW: int4 -> bf16 by table (cpu_simd.i4_row_bf16_lut)


def int8_activations(rows: int, group_size: int, n_in: int) -> bool:
    """Whether an int4 GEMV over `rows` input rows of `n_in` columns runs the int8-activation
    (VNNI) kernel: batch 1 with groups of 64+ columns; any row count with groups of 32 (Q4_0's: the
    activations in llama.cpp's q8_0 blocks, prefill included, so a GGUF computes as llama.cpp
    does). The same for every row length, so a tensor-parallel shard takes the kernel its
    unsharded model does."""
    return (
        _VNNI and (rows == 1 or group_size == 32) and group_size % 32 == 0 and n_in % group_size == 0
        and not SETTINGS.int4_fp32_activations
    )


INT8_ACT_GROUP = 64  # one VPDPBUSD (64 bytes) per activation scale


GROUP32_PREFILLS = ("fast", "q8_0")


def _group32_prefill_q8_0() -> bool:
    choice = SETTINGS.group32_prefill
    if choice not in GROUP32_PREFILLS:
        raise ConfigError(f"STRATA_GROUP32_PREFILL={choice!r}: choose one of {', '.join(GROUP32_PREFILLS)}")
    return choice == "q8_0"


def _group32_int8_activations(method: str, rows: int, n_in: int) -> bool:
    """Whether a group-32 weight (grouped int8, int4 group 32) runs its int8-activation kernel."""
    return int8_int8(n_in, 32) if method == "int8" else int8_activations(rows, 32, n_in)


def int8_int8(n_in: int, group_size: int = 0) -> bool:
    """Whether an int8 GEMV runs the int8-activation (VNNI) kernel: the input rows quantised to
    int8 in groups of INT8_ACT_GROUP columns (STRATA_INT8_FP32_ACTIVATIONS=1 keeps fp32 inputs);
    grouped int8 (group_size 32) in llama.cpp's q8_0 blocks, at any row count."""
    return (
        _VNNI and n_in % (group_size or INT8_ACT_GROUP) == 0
        and not SETTINGS.int8_fp32_activations
    )


# --- numba kernels ------------------------------------------------------------------------------

if numba is not None:

    @njit(cache=True)
    def _group_sums8(x, group):  # pragma: no cover - compiled
        rows, n_in = x.shape
        ng = (n_in + group - 1) // group
        out = np.zeros((rows, ng), np.float32)
        for j in range(rows):
            for c in range(n_in):
                out[j, c // group] += x[j, c]
        return out * np.float32(8.0)

    @njit(parallel=True, fastmath=True, cache=True)
    def _int8_gemv(w, s, x, out, threads):  # pragma: no cover - compiled
        n_out = w.shape[0]
        rows = x.shape[0]
        per = (n_out + threads - 1) // threads
        for t in prange(threads):
            for r in range(t * per, min(n_out, (t + 1) * per)):
                wr = w[r]
                for j in range(rows):
                    out[j, r] = i8_dot(wr, x[j]) * s[r]

    @njit(parallel=True, fastmath=True, cache=True)
    def _int8_swiglu(w, s, x, out, threads):  # pragma: no cover - compiled
        half_rows = w.shape[0] // 2
        rows = x.shape[0]
        per = (half_rows + threads - 1) // threads
        for t in prange(threads):
            for r in range(t * per, min(half_rows, (t + 1) * per)):
                wg = w[r]
                wu = w[r + half_rows]
                for j in range(rows):
                    xj = x[j]
                    g = i8_dot(wg, xj) * s[r]
                    u = i8_dot(wu, xj) * s[r + half_rows]
                    out[j, r] = g / (np.float32(1.0) + np.exp(-g)) * u

    @njit(parallel=True, fastmath=True, cache=True)
    def _int4_gemv(w, s, x, out, group, threads):  # pragma: no cover - compiled
        n_out = w.shape[0]
        rows, n_in = x.shape
        xs8 = _group_sums8(x, group)
        # even slabs: row pairs start at even rows, so the bits do not depend on the thread count
        per = (n_out + 2 * threads - 1) // (2 * threads) * 2
        for t in prange(threads):
            buf = np.empty(n_in, np.float32)
            buf2 = np.empty(n_in, np.float32)
            paired, end = t * per, min(n_out, (t + 1) * per)
            if rows >= BLOCK_ROWS:  # compute-bound: unpack 2 rows, 2 x 4 blocks (cpu_gemv)
                ot = out.T
                while paired + 2 <= end:
                    i4_row(w[paired], s[paired], buf, group // 2)
                    i4_row(w[paired + 1], s[paired + 1], buf2, group // 2)
                    _pair_rows(buf, buf2, x, ot[paired], ot[paired + 1], False)
                    paired += 2
            for r in range(paired, end):  # the row the pairs left, or every row
                if rows == 1:
                    out[0, r] = i4_dot(w[r], s[r], x[0], xs8[0], group // 2)
                else:  # unpack once, reuse for every input row
                    i4_row(w[r], s[r], buf, group // 2)
                    for j in range(rows):
                        out[j, r] = f32_dot(buf, x[j])

    @njit(parallel=True, fastmath=True, cache=True)
    def _int4_swiglu(w, s, x, out, group, threads):  # pragma: no cover - compiled
        half_rows = w.shape[0] // 2
        rows, n_in = x.shape
        xs8 = _group_sums8(x, group)
        per = (half_rows + threads - 1) // threads
        for t in prange(threads):
            bg = np.empty(n_in, np.float32)
            bu = np.empty(n_in, np.float32)
            for r in range(t * per, min(half_rows, (t + 1) * per)):
                if rows == 1:
                    g = i4_dot(w[r], s[r], x[0], xs8[0], group // 2)
                    u = i4_dot(w[r + half_rows], s[r + half_rows], x[0], xs8[0], group // 2)
                    out[0, r] = g / (np.float32(1.0) + np.exp(-g)) * u
                else:
                    i4_row(w[r], s[r], bg, group // 2)
                    i4_row(w[r + half_rows], s[r + half_rows], bu, group // 2)
                    if rows >= BLOCK_ROWS:
                        _pair_rows(bg, bu, x, out.T[r], out.T[r], True)
                        continue
                    for j in range(rows):
                        g = f32_dot(bg, x[j])
                        u = f32_dot(bu, x[j])
                        out[j, r] = g / (np.float32(1.0) + np.exp(-g)) * u

    @njit(cache=True)  # no fastmath: the rounding is llama.cpp's, operation for operation
    def _quant_q8(x, xq, xs):  # pragma: no cover - compiled
        """One input row -> its int8 codes xq and fp32 scales xs per 32 columns, as llama.cpp's
        q8_0 block (quant_formats.quantize_activations_q8_0_ref): d = fp16(max|x| / 127) (round to
        nearest even, fp16 subnormals included), q = rint(x * (127 / max|x|))."""
        ng = x.shape[0] // 32
        for g in range(ng):
            m = np.float32(0.0)
            for c in range(g * 32, g * 32 + 32):
                m = max(m, abs(x[c]))
            inv = np.float32(127.0) / m if m > 0 else np.float32(0.0)
            for c in range(g * 32, g * 32 + 32):
                xq[c] = np.int8(np.rint(x[c] * inv))
            xs[g] = m / np.float32(127.0)
        bits = xs.view(np.uint32)
        for g in range(ng):
            if xs[g] < np.float32(6.103515625e-05):  # an fp16 subnormal: steps of 2^-24
                xs[g] = np.float32(np.rint(xs[g] * np.float32(16777216.0)) * np.float32(5.9604644775390625e-08))
            else:  # keep 10 mantissa bits, rounded to nearest even
                b = bits[g]
                bits[g] = (b + np.uint32(0x0FFF) + ((b >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)

    @njit(cache=True)  # no fastmath: see _quant_q8
    def _quant_x(x, group):  # pragma: no cover - compiled
        """One input row -> (int8 row, per-group scales, per-group 8 * scale * sum of the int8s);
        groups of 32 in llama.cpp's q8_0 blocks (_quant_q8)."""
        n = x.shape[0]
        ng = n // group
        xq = np.empty(n, np.int8)
        xs = np.empty(ng, np.float32)
        off = np.empty(ng, np.float32)
        if group == 32:
            _quant_q8(x, xq, xs)
            for g in range(ng):
                total = 0
                for c in range(g * 32, g * 32 + 32):
                    total += xq[c]
                off[g] = np.float32(8.0) * xs[g] * np.float32(total)
            return xq, xs, off
        for g in range(ng):
            m = np.float32(0.0)
            for c in range(g * group, (g + 1) * group):
                m = max(m, abs(x[c]))
            scale = m / np.float32(127.0) if m > 0 else np.float32(1.0)
            inv = np.float32(1.0) / scale
            total = 0
            for c in range(g * group, (g + 1) * group):
                q = np.int32(np.rint(x[c] * inv))
                xq[c] = q
                total += q
            xs[g] = scale
            off[g] = np.float32(8.0) * scale * np.float32(total)
        return xq, xs, off

    @njit(fastmath=True, cache=True, inline="always")
    def _i4_row_vnni(wr, sr, xq, xs, off, half):  # pragma: no cover - compiled
        o = np.float32(0.0)
        for g in range(sr.shape[0]):  # the nibbles' -8 offset, per group
            o += sr[g] * off[g]
        if half == 16:  # groups of 32: two per VPDPBUSD
            return i4_dot_vnni_g32(wr, sr, xq, xs) - o
        return i4_dot_vnni(wr, sr, xq, xs, half) - o

    @njit(cache=True)  # no fastmath: see _quant_q8
    def _quant_rows(x, group):  # pragma: no cover - compiled
        """_quant_x of every input row: (int8 rows, scales, offsets)."""
        rows, n = x.shape
        xq = np.empty((rows, n), np.int8)
        xs = np.empty((rows, n // group), np.float32)
        off = np.empty((rows, n // group), np.float32)
        for j in range(rows):
            q, sc, o = _quant_x(x[j], group)
            xq[j] = q
            xs[j] = sc
            off[j] = o
        return xq, xs, off

    @njit(parallel=True, fastmath=True, cache=True)
    def _int4_gemv_vnni(w, s, x, out, group, threads):  # pragma: no cover - compiled
        n_out = w.shape[0]
        rows = x.shape[0]
        xq, xs, off = _quant_rows(x, group)
        per = (n_out + threads - 1) // threads
        for t in prange(threads):
            for r in range(t * per, min(n_out, (t + 1) * per)):
                for j in range(rows):
                    out[j, r] = _i4_row_vnni(w[r], s[r], xq[j], xs[j], off[j], group // 2)

    @njit(parallel=True, fastmath=True, cache=True)
    def _int4_swiglu_vnni(w, s, x, out, group, threads):  # pragma: no cover - compiled
        half_rows = w.shape[0] // 2
        rows = x.shape[0]
        xq, xs, off = _quant_rows(x, group)
        per = (half_rows + threads - 1) // threads
        for t in prange(threads):
            for r in range(t * per, min(half_rows, (t + 1) * per)):
                for j in range(rows):
                    g = _i4_row_vnni(w[r], s[r], xq[j], xs[j], off[j], group // 2)
                    u = _i4_row_vnni(w[r + half_rows], s[r + half_rows], xq[j], xs[j], off[j], group // 2)
                    out[j, r] = g / (np.float32(1.0) + np.exp(-g)) * u

    @njit(parallel=True, fastmath=True, cache=True)
    def _int8_gemv_vnni(w, s, x, out, threads):  # pragma: no cover - compiled
        n_out = w.shape[0]
        rows = x.shape[0]
        xq, xs, _ = _quant_rows(x, 64)
        per = (n_out + threads - 1) // threads
        for t in prange(threads):
            for r in range(t * per, min(n_out, (t + 1) * per)):
                wr = w[r]
                for j in range(rows):
                    out[j, r] = i8_dot_vnni(wr, xq[j], xs[j]) * s[r]

    @njit(parallel=True, fastmath=True, cache=True)
    def _int8_swiglu_vnni(w, s, x, out, threads):  # pragma: no cover - compiled
        half_rows = w.shape[0] // 2
        rows = x.shape[0]
        xq, xs, _ = _quant_rows(x, 64)
        per = (half_rows + threads - 1) // threads
        for t in prange(threads):
            for r in range(t * per, min(half_rows, (t + 1) * per)):
                wg = w[r]
                wu = w[r + half_rows]
                for j in range(rows):
                    g = i8_dot_vnni(wg, xq[j], xs[j]) * s[r]
                    u = i8_dot_vnni(wu, xq[j], xs[j]) * s[r + half_rows]
                    out[j, r] = g / (np.float32(1.0) + np.exp(-g)) * u

    # grouped int8 (scale [out, in / 32]: a Q8_0 file's blocks; [out, in / 16]: a Q6_K file's)

    @njit(fastmath=True, cache=True, inline="always")
    def _i8g_dot_vnni(wr, sr, xq, xs):  # pragma: no cover - compiled
        if sr.shape[0] == xs.shape[0]:  # groups of 32, as the activations'
            return i8_dot_vnni_g32(wr, sr, xq, xs)
        return i8_dot_vnni_g16(wr, sr, xq, xs)

    @njit(parallel=True, fastmath=True, cache=True)
    def _int8g_gemv_vnni(w, s, x, out, threads):  # pragma: no cover - compiled
        n_out = w.shape[0]
        rows = x.shape[0]
        xq, xs, _ = _quant_rows(x, 32)
        per = (n_out + threads - 1) // threads
        for t in prange(threads):
            for r in range(t * per, min(n_out, (t + 1) * per)):
                wr = w[r]
                sr = s[r]
                for j in range(rows):
                    out[j, r] = _i8g_dot_vnni(wr, sr, xq[j], xs[j])

    @njit(parallel=True, fastmath=True, cache=True)
    def _int8g_swiglu_vnni(w, s, x, out, threads):  # pragma: no cover - compiled
        half_rows = w.shape[0] // 2
        rows = x.shape[0]
        xq, xs, _ = _quant_rows(x, 32)
        per = (half_rows + threads - 1) // threads
        for t in prange(threads):
            for r in range(t * per, min(half_rows, (t + 1) * per)):
                for j in range(rows):
                    g = _i8g_dot_vnni(w[r], s[r], xq[j], xs[j])
                    u = _i8g_dot_vnni(w[r + half_rows], s[r + half_rows], xq[j], xs[j])
                    out[j, r] = g / (np.float32(1.0) + np.exp(-g)) * u

    @njit(fastmath=True, cache=True, inline="always")
    def _i8g_dot(wr, sr, xj):  # pragma: no cover - compiled
        """sum_g sr[g] * sum_k wr[k] * xj[k] over the groups of columns, in fp32."""
        group = wr.shape[0] // sr.shape[0]
        total = np.float32(0.0)
        for g in range(sr.shape[0]):
            ws = wr[g * group:(g + 1) * group]
            xs = xj[g * group:(g + 1) * group]
            part = np.float32(0.0)
            for k in range(group):
                part += np.float32(ws[k]) * xs[k]
            total += part * sr[g]
        return total

    @njit(parallel=True, fastmath=True, cache=True)
    def _int8g_gemv(w, s, x, out, threads):  # pragma: no cover - compiled
        n_out = w.shape[0]
        rows = x.shape[0]
        per = (n_out + threads - 1) // threads
        for t in prange(threads):
            for r in range(t * per, min(n_out, (t + 1) * per)):
                for j in range(rows):
                    out[j, r] = _i8g_dot(w[r], s[r], x[j])

    @njit(parallel=True, fastmath=True, cache=True)
    def _int8g_swiglu(w, s, x, out, threads):  # pragma: no cover - compiled
        half_rows = w.shape[0] // 2
        rows = x.shape[0]
        per = (half_rows + threads - 1) // threads
        for t in prange(threads):
            for r in range(t * per, min(half_rows, (t + 1) * per)):
                for j in range(rows):
                    g = _i8g_dot(w[r], s[r], x[j])
                    u = _i8g_dot(w[r + half_rows], s[r + half_rows], x[j])
                    out[j, r] = g / (np.float32(1.0) + np.exp(-g)) * u

    # Grouped dequantisation: `z` the zero points ([out, groups]; any [out, groups] array when
    # has_zero is False: the scale itself).

    @njit(fastmath=True, cache=True, inline="always")
    def _sub_zero_row(zr, row, group):  # pragma: no cover - compiled
        for g in range(zr.shape[0]):
            zc = zr[g]
            seg = row[g * group:(g + 1) * group]
            for k in range(group):
                seg[k] -= zc

    @njit(fastmath=True, cache=True, inline="always")
    def _int8g_row(wr, sr, zr, has_zero, row):  # pragma: no cover - compiled
        """row = wr * its group's scale (- its zero): quant_formats.dequantize_int8_ref."""
        # group by group over slices indexed from 0: no division per column and no negative-index
        # check per element, so LLVM vectorises it (measured ~3x the per-column loop)
        group = wr.shape[0] // sr.shape[0]
        for g in range(sr.shape[0]):
            sc = sr[g]
            ws = wr[g * group:(g + 1) * group]
            rs = row[g * group:(g + 1) * group]
            for k in range(group):
                rs[k] = np.float32(ws[k]) * sc
        if has_zero:
            _sub_zero_row(zr, row, wr.shape[0] // sr.shape[0])

    @njit(parallel=True, fastmath=True, cache=True)
    def _int8g_dequant(w, s, z, has_zero, out, threads):  # pragma: no cover - compiled
        n_out = w.shape[0]
        per = (n_out + threads - 1) // threads
        for t in prange(threads):
            for r in range(t * per, min(n_out, (t + 1) * per)):
                _int8g_row(w[r], s[r], z[r], has_zero, out[r])

    @njit(parallel=True, fastmath=True, cache=True)
    def _int8g_dequant_bf16(w, s, z, has_zero, out, threads):  # pragma: no cover - compiled
        n_out, n_in = w.shape
        per = (n_out + threads - 1) // threads
        for t in prange(threads):
            row = np.empty(n_in, np.float32)
            for r in range(t * per, min(n_out, (t + 1) * per)):
                _int8g_row(w[r], s[r], z[r], has_zero, row)
                _round_bf16(row, out[r])

    @njit(cache=True)
    def _int8g_rows(w, s, z, has_zero, ids, out):  # pragma: no cover - compiled
        """Grouped int8 rows as quant_formats.dequantize_int8_ref (q * its group's scale - zero)."""
        for i in range(ids.shape[0]):
            r = ids[i]
            if r < 0 or r >= w.shape[0]:
                return False
            _int8g_row(w[r], s[r], z[r], has_zero, out[i])
        return True

    @njit(parallel=True, fastmath=True, cache=True)
    def _int4z_dequant(w, s, z, out, group, threads):  # pragma: no cover - compiled
        n_out = out.shape[0]
        per = (n_out + threads - 1) // threads
        for t in prange(threads):
            for r in range(t * per, min(n_out, (t + 1) * per)):
                i4_row(w[r], s[r], out[r], group // 2)
                _sub_zero_row(z[r], out[r], group)

    @njit(parallel=True, fastmath=True, cache=True)
    def _int4z_dequant_bf16(w, s, z, out, group, threads):  # pragma: no cover - compiled
        n_out, n_in = out.shape
        per = (n_out + threads - 1) // threads
        for t in prange(threads):
            row = np.empty(n_in, np.float32)
            for r in range(t * per, min(n_out, (t + 1) * per)):
                i4_row(w[r], s[r], row, group // 2)
                _sub_zero_row(z[r], row, group)
                _round_bf16(row, out[r])

    # Zero points (quant_formats: w = s * code - z): the symmetric kernel's result minus
    # sum_g z[r, g] * (the input row's sum over group g); the sums of the q8_0-rounded input
    # where the kernel ran on it (vnni), so the result is the reference's on those activations.

    @njit(cache=True)
    def _zero_sums(x, xq, xs, group, act):  # pragma: no cover - compiled
        """[rows, groups] sums of x over each weight group; act: the activation group the int8
        kernel quantised x in (xq, xs: _quant_rows(x, act)); 0: it ran on fp32 x."""
        rows, n = x.shape
        ng = n // group
        sums = np.zeros((rows, ng), np.float32)
        if act:
            for j in range(rows):
                for g in range(ng):
                    total = 0
                    for c in range(g * group, (g + 1) * group):
                        total += np.int32(xq[j, c])
                    sums[j, g] = xs[j, (g * group) // act] * np.float32(total)
            return sums
        for j in range(rows):
            for g in range(ng):
                total = np.float32(0.0)
                for c in range(g * group, (g + 1) * group):
                    total += x[j, c]
                sums[j, g] = total
        return sums

    @njit(cache=True)
    def _no_quant_rows():  # pragma: no cover - compiled
        """_quant_rows' types, empty: where a kernel runs on fp32 input."""
        return np.empty((0, 0), np.int8), np.empty((0, 0), np.float32), np.empty((0, 0), np.float32)

    @njit(parallel=True, fastmath=True, cache=True)
    def _sub_zero(z, sums, out, threads):  # pragma: no cover - compiled
        n_out, ng = z.shape
        rows = sums.shape[0]
        per = (n_out + threads - 1) // threads
        for t in prange(threads):
            for r in range(t * per, min(n_out, (t + 1) * per)):
                zr = z[r]
                for j in range(rows):
                    acc = np.float32(0.0)
                    for g in range(ng):
                        acc += zr[g] * sums[j, g]
                    out[j, r] -= acc

    # The zero-point kernels take the whole [out, 2, groups] scale: its rows s3[r, 0] / s3[r, 1]
    # are C-contiguous 1-D views, where a s3[:, 0] slice is strided ("A" layout), which measured
    # ~2x slower in these loops. Each output row: the symmetric row dot minus z . group sums.

    @njit(fastmath=True, cache=True, inline="always")
    def _zdot(zr, sums_j):  # pragma: no cover - compiled
        acc = np.float32(0.0)
        for g in range(zr.shape[0]):
            acc += zr[g] * sums_j[g]
        return acc

    @njit(fastmath=True, cache=True, inline="always")
    def _int8gz_row(w, s3, r, xq, xs, x, sums, j, vnni):  # pragma: no cover - compiled
        if vnni:
            return _i8g_dot_vnni(w[r], s3[r, 0], xq[j], xs[j]) - _zdot(s3[r, 1], sums[j])
        return _i8g_dot(w[r], s3[r, 0], x[j]) - _zdot(s3[r, 1], sums[j])

    @njit(parallel=True, fastmath=True, cache=True)
    def _int8gz_gemv(w, s3, x, out, vnni, threads):  # pragma: no cover - compiled
        """Grouped int8 with zero points (scale [out, 2, groups])."""
        n_out = w.shape[0]
        rows = x.shape[0]
        xq, xs, _ = _quant_rows(x, 32) if vnni else _no_quant_rows()
        sums = _zero_sums(x, xq, xs, w.shape[1] // s3.shape[2], 32 if vnni else 0)
        per = (n_out + threads - 1) // threads
        for t in prange(threads):
            for r in range(t * per, min(n_out, (t + 1) * per)):
                for j in range(rows):
                    out[j, r] = _int8gz_row(w, s3, r, xq, xs, x, sums, j, vnni)

    @njit(parallel=True, fastmath=True, cache=True)
    def _int8gz_swiglu(w, s3, x, out, vnni, threads):  # pragma: no cover - compiled
        half_rows = w.shape[0] // 2
        rows = x.shape[0]
        xq, xs, _ = _quant_rows(x, 32) if vnni else _no_quant_rows()
        sums = _zero_sums(x, xq, xs, w.shape[1] // s3.shape[2], 32 if vnni else 0)
        per = (half_rows + threads - 1) // threads
        for t in prange(threads):
            for r in range(t * per, min(half_rows, (t + 1) * per)):
                for j in range(rows):
                    g = _int8gz_row(w, s3, r, xq, xs, x, sums, j, vnni)
                    u = _int8gz_row(w, s3, r + half_rows, xq, xs, x, sums, j, vnni)
                    out[j, r] = g / (np.float32(1.0) + np.exp(-g)) * u

    @njit(fastmath=True, cache=True, inline="always")
    def _int4z_row(w, s3, r, xq, xs, off, x, xs8, buf, sums, j, group, vnni):  # pragma: no cover - compiled
        if vnni:
            dot = _i4_row_vnni(w[r], s3[r, 0], xq[j], xs[j], off[j], group // 2)
        elif x.shape[0] == 1:
            dot = i4_dot(w[r], s3[r, 0], x[0], xs8[0], group // 2)
        else:
            i4_row(w[r], s3[r, 0], buf, group // 2)
            dot = f32_dot(buf, x[j])
        return dot - _zdot(s3[r, 1], sums[j])

    @njit(parallel=True, fastmath=True, cache=True)
    def _int4z_gemv(w, s3, x, out, group, vnni, threads):  # pragma: no cover - compiled
        """int4 with zero points (scale [out, 2, groups])."""
        n_out = w.shape[0]
        rows, n_in = x.shape
        xq, xs, off = _quant_rows(x, group) if vnni else _no_quant_rows()
        xs8 = _group_sums8(x, group) if not vnni and rows == 1 else xs  # i4_dot's, batch 1 in fp32
        sums = _zero_sums(x, xq, xs, group, group if vnni else 0)
        per = (n_out + threads - 1) // threads
        for t in prange(threads):
            buf = np.empty(n_in, np.float32)
            for r in range(t * per, min(n_out, (t + 1) * per)):
                for j in range(rows):
                    out[j, r] = _int4z_row(w, s3, r, xq, xs, off, x, xs8, buf, sums, j, group, vnni)

    @njit(parallel=True, fastmath=True, cache=True)
    def _int4z_swiglu(w, s3, x, out, group, vnni, threads):  # pragma: no cover - compiled
        half_rows = w.shape[0] // 2
        rows, n_in = x.shape
        xq, xs, off = _quant_rows(x, group) if vnni else _no_quant_rows()
        xs8 = _group_sums8(x, group) if not vnni and rows == 1 else xs  # i4_dot's, batch 1 in fp32
        sums = _zero_sums(x, xq, xs, group, group if vnni else 0)
        per = (half_rows + threads - 1) // threads
        for t in prange(threads):
            buf = np.empty(n_in, np.float32)
            for r in range(t * per, min(half_rows, (t + 1) * per)):
                for j in range(rows):
                    g = _int4z_row(w, s3, r, xq, xs, off, x, xs8, buf, sums, j, group, vnni)
                    u = _int4z_row(w, s3, r + half_rows, xq, xs, off, x, xs8, buf, sums, j, group, vnni)
                    out[j, r] = g / (np.float32(1.0) + np.exp(-g)) * u

    @njit(cache=True)
    def _int4z_rows(w, s3, ids, out, group):  # pragma: no cover - compiled
        if not _int4_rows(w, s3[:, 0], ids, out, group):
            return False
        for i in range(ids.shape[0]):
            _sub_zero_row(s3[ids[i], 1], out[i], group)
        return True

    # group-32 prefill: one weight row against four input rows per step (cpu_simd's dot4 kernels)

    @njit(cache=True)
    def _lane_scales(xs, rows_padded, packed):  # pragma: no cover - compiled
        """Per-row group scales repeated per int32 lane of the dot4 kernels (fp32 [rows_padded, n / 4])."""
        rows, ng = xs.shape
        xl = np.zeros((rows_padded, ng * 8), np.float32)
        for j in range(rows):
            for p in range(ng // 2):
                for lane in range(16):
                    half = (lane // 4) % 2 if packed else lane // 8
                    xl[j, p * 16 + lane] = xs[j, 2 * p + half]
        return xl

    @njit(fastmath=True, cache=True)
    def _prep_int8g(x):  # pragma: no cover - compiled
        rows, n = x.shape
        xq, xs, _ = _quant_rows(x, 32)
        padded = (rows + 3) // 4 * 4
        xu = np.full((padded, n), 128, np.uint8)  # +128: a zero input in the padding rows
        for j in range(rows):
            for c in range(n):
                xu[j, c] = np.uint8(np.int32(xq[j, c]) + 128)
        return xu, _lane_scales(xs, padded, False)

    @njit(fastmath=True, cache=True)
    def _prep_int4g32(x):  # pragma: no cover - compiled
        rows, n = x.shape
        xq, xs, _ = _quant_rows(x, 32)
        padded = (rows + 3) // 4 * 4
        xp = np.zeros((padded, n), np.int8)
        xoff = np.zeros((padded, n // 4), np.int32)
        for j in range(rows):
            for p in range(n // 64):
                base = p * 64
                for k in range(16):  # [g cols 0-15, g+1 cols 0-15, g cols 16-31, g+1 cols 16-31]
                    xp[j, base + k] = xq[j, base + k]
                    xp[j, base + 16 + k] = xq[j, base + 32 + k]
                    xp[j, base + 32 + k] = xq[j, base + 16 + k]
                    xp[j, base + 48 + k] = xq[j, base + 48 + k]
                for h in range(2):
                    total = 0
                    for c in range(base + 32 * h, base + 32 * h + 32):
                        total += np.int32(xq[j, c])
                    xoff[j, p * 16 + 4 * h] = 8 * total
        return xp, _lane_scales(xs, padded, True), xoff

    @njit(parallel=True, fastmath=True, cache=True)
    def _int8g_gemm_vnni(w, s, x, out, threads):  # pragma: no cover - compiled
        n_out = w.shape[0]
        rows = x.shape[0]
        xu, xl = _prep_int8g(x)
        per = (n_out + threads - 1) // threads
        for t in prange(threads):
            o4 = np.empty(4, np.float32)
            for r in range(t * per, min(n_out, (t + 1) * per)):
                wr = w[r]
                sr = s[r]
                for j0 in range(0, xu.shape[0], 4):
                    i8g_dot4_vnni(wr, sr, xu[j0:j0 + 4], xl[j0:j0 + 4], o4)
                    for j in range(min(4, rows - j0)):
                        out[j0 + j, r] = o4[j]

    @njit(parallel=True, fastmath=True, cache=True)
    def _int4g32_gemm_vnni(w, s, x, out, threads):  # pragma: no cover - compiled
        n_out = w.shape[0]
        rows = x.shape[0]
        xp, xl, xoff = _prep_int4g32(x)
        per = (n_out + threads - 1) // threads
        for t in prange(threads):
            o4 = np.empty(4, np.float32)
            for r in range(t * per, min(n_out, (t + 1) * per)):
                wr = w[r]
                sr = s[r]
                for j0 in range(0, xp.shape[0], 4):
                    i4g32_dot4_vnni(wr, sr, xp[j0:j0 + 4], xl[j0:j0 + 4], xoff[j0:j0 + 4], o4)
                    for j in range(min(4, rows - j0)):
                        out[j0 + j, r] = o4[j]

    @njit(parallel=True, fastmath=True, cache=True)
    def _int8_dequant(w, s, out, threads):  # pragma: no cover - compiled
        n_out, n_in = w.shape
        per = (n_out + threads - 1) // threads
        for t in prange(threads):
            for r in range(t * per, min(n_out, (t + 1) * per)):
                wr = w[r]
                orow = out[r]
                sc = s[r]
                for c in range(n_in):
                    orow[c] = np.float32(wr[c]) * sc

    @njit(parallel=True, fastmath=True, cache=True)
    def _int4_dequant(w, s, out, group, threads):  # pragma: no cover - compiled
        n_out, n_in = out.shape
        per = (n_out + threads - 1) // threads
        for t in prange(threads):
            for r in range(t * per, min(n_out, (t + 1) * per)):
                i4_row(w[r], s[r], out[r], group // 2)

    @njit(cache=True)
    def _round_bf16(row, out):  # pragma: no cover - compiled
        """out = the bf16 bit patterns of fp32 `row`, rounded to nearest even (as torch's
        .to(torch.bfloat16) rounds finite values; quantised weights are always finite)."""
        u = row.view(np.uint32)
        for c in range(u.shape[0]):
            b = u[c]
            out[c] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

    @njit(parallel=True, fastmath=True, cache=True)
    def _int8_dequant_bf16(w, s, out, threads):  # pragma: no cover - compiled
        n_out, n_in = w.shape
        per = (n_out + threads - 1) // threads
        for t in prange(threads):
            row = np.empty(n_in, np.float32)
            for r in range(t * per, min(n_out, (t + 1) * per)):
                wr = w[r]
                sc = s[r]
                for c in range(n_in):
                    row[c] = np.float32(wr[c]) * sc
                _round_bf16(row, out[r])

    @njit(parallel=True, fastmath=True, cache=True)
    def _int4_dequant_bf16(w, s, out, group, threads, lut):  # pragma: no cover - compiled
        """`lut`: by table lookup (AVX-512 BW only), else by arithmetic; the same bits either way."""
        n_out, n_in = out.shape
        per = (n_out + threads - 1) // threads
        for t in prange(threads):
            for r in range(t * per, min(n_out, (t + 1) * per)):
                if lut:
                    i4_row_bf16_lut(w[r], s[r], out[r], group // 2)
                else:
                    i4_row_bf16(w[r], s[r], out[r], group // 2)

    @njit(cache=True)
    def _int8_rows(w, s, ids, out):  # pragma: no cover - compiled
        """out[i] = rows ids[i] of an int8 weight, dequantised as quant_formats.dequantize_int8_ref
        does (q * scale in fp32); False (nothing written past that row) for an id out of range."""
        for i in range(ids.shape[0]):
            r = ids[i]
            if r < 0 or r >= w.shape[0]:
                return False
            sc = s[r]
            for c in range(w.shape[1]):
                out[i, c] = np.float32(w[r, c]) * sc
        return True

    @njit(cache=True)
    def _int4_rows(w, s, ids, out, group):  # pragma: no cover - compiled
        """int4 rows as quant_formats.dequantize_int4_ref: (q - 8) * scale, each group's low
        nibbles its first half of columns, high nibbles its second."""
        half = group // 2
        for i in range(ids.shape[0]):
            r = ids[i]
            if r < 0 or r >= w.shape[0]:
                return False
            for g in range(s.shape[1]):
                sc = s[r, g]
                for k in range(half):
                    b = w[r, g * half + k]
                    out[i, g * group + k] = (np.float32(b & 15) - np.float32(8.0)) * sc
                    out[i, g * group + half + k] = (np.float32(b >> 4) - np.float32(8.0)) * sc
        return True


# --- entry points -------------------------------------------------------------------------------


def usable(x: torch.Tensor, qweight: torch.Tensor | np.ndarray) -> bool:
    """Whether the numba kernels apply: the kernel mode's fast paths on (kernels/dispatch.py),
    numba present, fp32 CPU input, no autograd."""
    return (
        KERNEL_MODE.get().fast_paths
        and numba is not None
        and x.dtype == torch.float32
        and x.is_cpu
        and (isinstance(qweight, np.ndarray) or qweight.is_cpu)
        and not (x.requires_grad and torch.is_grad_enabled())
    )


def _np(t: torch.Tensor | np.ndarray) -> np.ndarray:
    return t if isinstance(t, np.ndarray) else t.numpy()


def _zero(s: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """(scale [out, groups], zero [out, groups], has_zero) of a grouped scale array; without
    zero points the scale stands in for the zeros (the kernels ignore them)."""
    return (s[:, 0], s[:, 1], True) if s.ndim == 3 else (s, s, False)


def _check(method: str, in_features: int, qweight, scale, group_size: int) -> None:
    """The kernels index without bounds checks: shapes must agree (a cheap guard per call)."""
    zero_ok = len(scale.shape) < 3 or scale.shape[1] == 2
    if method == "int8" and len(scale.shape) >= 2:  # grouped: groups of 16 or 32
        ok = (group_size in quant_formats.INT8_GROUPS and qweight.shape[1] == in_features
              and scale.shape[-1] * group_size == in_features and scale.shape[0] == qweight.shape[0])
    elif method == "int8":
        ok = qweight.shape[1] == in_features and scale.shape[0] == qweight.shape[0]
    else:  # 16-byte steps per group: group_size a multiple of 32
        ok = (group_size % 32 == 0 and 2 * qweight.shape[1] == in_features
              and scale.shape[-1] * group_size == in_features and scale.shape[0] == qweight.shape[0])
    if not (ok and zero_ok):
        raise ValueError(
            f"{method} weight {tuple(qweight.shape)} / scale {tuple(scale.shape)} (group {group_size}) "
            f"do not fit {in_features} input columns"
        )


# The entry points take qweight/scale as CPU tensors or as numpy views of them (QuantLinear
# caches those: at ~13 us of Python per projection call, glue is a visible share of a step).


def dequantize(
    method: str, qweight: torch.Tensor | np.ndarray, scale: torch.Tensor | np.ndarray, in_features: int,
    group_size: int,
) -> torch.Tensor:
    """The fp32 weight [out, in] (numba, parallel) for the GEMM path."""
    _check(method, in_features, qweight, scale, group_size)
    out = torch.empty(qweight.shape[0], in_features, dtype=torch.float32)
    _dequantize_into(method, _np(qweight), _np(scale), out.numpy(), group_size, cpu_gemv.sync_threads())
    return out


def _dequantize_into(method: str, w: np.ndarray, s: np.ndarray, out: np.ndarray, group_size: int, threads: int) -> None:
    if method == "int8" and s.ndim >= 2:
        _int8g_dequant(w, *_zero(s), out, threads)
    elif method == "int8":
        _int8_dequant(w, s, out, threads)
    elif s.ndim == 3:
        _int4z_dequant(w, s[:, 0], s[:, 1], out, group_size, threads)
    else:
        _int4_dequant(w, s, out, group_size, threads)


# One reused buffer for the bf16 path's dequantised weights: a fresh multi-MB tensor per call
# costs its page faults every time (measured ~2x the GEMM on qwen-0.5b's gate/up). Grows to the
# largest weight seen, capped at BF16_TILE_BYTES; only the (single) forward thread uses it.
BF16_TILE_BYTES = 32 << 20
_bf16_scratch: list[torch.Tensor] = []


def _bf16_buffer(elements: int) -> torch.Tensor:
    if not _bf16_scratch or _bf16_scratch[0].numel() < elements:
        _bf16_scratch[:] = [torch.empty(elements, dtype=torch.bfloat16)]
    return _bf16_scratch[0]


def dequantize_bf16(
    method: str, qweight: torch.Tensor | np.ndarray, scale: torch.Tensor | np.ndarray, out: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """Rows of a quantised weight dequantised into `out` [rows, in] bf16, in one pass with no fp32
    copy: dequantize_*_ref(...).to(torch.bfloat16), bit for bit for int8; int4 folds the -8 into
    the scale as the GEMV kernels do (cpu_simd.i4_row), so a value on a bf16 rounding boundary may
    land one bf16 step away (the plain (q - 8) * scale loop is exact but measured ~4x slower)."""
    _check(method, out.shape[1], qweight, scale, group_size)
    bits = out.view(torch.int16).numpy().view(np.uint16)
    threads = cpu_gemv.sync_threads()
    w, s = _np(qweight), _np(scale)
    if method == "int8" and s.ndim >= 2:
        _int8g_dequant_bf16(w, *_zero(s), bits, threads)
    elif method == "int8":
        _int8_dequant_bf16(w, s, bits, threads)
    elif s.ndim == 3:  # with zero points: fp32 row, then rounded (exact, like int8)
        _int4z_dequant_bf16(w, s[:, 0], s[:, 1], bits, group_size, threads)
    else:
        _int4_dequant_bf16(w, s, bits, group_size, threads, _AVX512BW)
    return out


@kernel("quant_matmul")
def matmul(
    method: str, x: torch.Tensor, qweight: torch.Tensor | np.ndarray, scale: torch.Tensor | np.ndarray,
    group_size: int, bias: torch.Tensor | None = None, path: str = "aten", fallback: str = "aten",
) -> torch.Tensor:
    """x [rows, in] fp32 @ the quantised weight.T (+ bias) for many rows (prefill, big batches).

    Path "int8" (int8 and int4 weights, where the hardware layer measured torch's int8 GEMM
    faster): W8A8 (kernels/cpu_w8a8.py); rows it does not take are computed by the GEMV kernel or
    the `fallback` path.

    Path "bf16" (cpu_gemm.py: where the hardware layer measured oneDNN's bf16 GEMM faster): the
    weight is dequantised straight to bf16 into one reused buffer (whole, or in BF16_TILE_BYTES
    tiles for an LM head) and multiplied as a bf16 weight is; the activations round to bf16 too.
    Measured on a Zen 4 (AVX-512 BF16, 128 rows): within ~10% of the same GEMM on a stored bf16
    weight, where dequantising ~4 MiB fp32 tiles, converting each and multiplying tile by tile
    took 1.35-1.45x. Fp32 paths: a few hundred weight rows at a time (~4 MiB of fp32) are
    dequantised into one reused fp32 buffer and multiplied by that fp32 GEMM (exact).
    """
    x = x.contiguous()
    w, s = _np(qweight), _np(scale)
    n_out, n_in = w.shape[0], x.shape[1]
    _check(method, n_in, w, s, group_size)
    # no W8A8 form for grouped int8 (its scales change along a row) or zero points
    w8a8 = path == "int8" and cpu_w8a8.prefill_enabled(method) and s.ndim == (1 if method == "int8" else 2)
    if group_size == 32 and _group32_prefill_q8_0() and _group32_int8_activations(method, x.shape[0], n_in):
        # STRATA_GROUP32_PREFILL=q8_0, a GGUF's Q8_0 / Q4_0 layouts: integer kernels over blocks of
        # rows, so prefill rounds its activations as llama.cpp and decode do. Measured ~2x slower
        # than the bf16 GEMM path on a Xeon (AMX) and no better greedy agreement with llama.cpp
        # (docs/design-notes.md "GGUF files"), hence opt-in.
        out = torch.cat([_group32_rows(method, x[j:j + PREFILL_ROW_BLOCK], w, s)
                         for j in range(0, x.shape[0], PREFILL_ROW_BLOCK)])
        return out if bias is None else out.add_(bias)
    if w8a8:
        out, refused = cpu_w8a8.matmul(x, w, s) if method == "int8" else cpu_w8a8.matmul_int4(x, w, s, group_size)
        if refused.numel():  # rows with outlier channels: the fallback path's numbers, row by row
            out[refused] = matmul(method, x[refused], w, s, group_size, None, fallback) if refused.numel() > MAX_ROWS \
                else gemv(method, x[refused], w, s, group_size)
        return out if bias is None else out.add_(bias)
    if path == "int8":
        path = fallback
    if path == "bf16":
        tile_rows = max(16, min(n_out, BF16_TILE_BYTES // (2 * n_in)))
        buf = _bf16_buffer(tile_rows * n_in)
        x_bf16 = x.to(torch.bfloat16)
        tiles = []
        for r0 in range(0, n_out, tile_rows):
            r1 = min(n_out, r0 + tile_rows)
            tile = buf[: (r1 - r0) * n_in].view(r1 - r0, n_in)
            dequantize_bf16(method, w[r0:r1], s[r0:r1], tile, group_size)
            tiles.append(torch.mm(x_bf16, tile.t()).float())
        out = tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=1)
    else:
        out = torch.empty(x.shape[0], n_out, dtype=torch.float32)
        tile_rows = max(64, min(1024, (4 << 20) // (4 * n_in) // 16 * 16))
        buf = torch.empty(min(tile_rows, n_out), n_in, dtype=torch.float32)
        threads = cpu_gemv.sync_threads()
        for r0 in range(0, n_out, tile_rows):
            r1 = min(n_out, r0 + tile_rows)
            tile = buf[: r1 - r0]
            _dequantize_into(method, w[r0:r1], s[r0:r1], tile.numpy(), group_size, threads)
            out[:, r0:r1] = cpu_gemm.tile_mm(x, tile, path)
    if bias is not None:
        out += bias
    return out


def _group32_rows(method: str, x: torch.Tensor, w: np.ndarray, s: np.ndarray) -> torch.Tensor:
    """x [rows, in] @ a group-32 weight.T with q8_0 activations: four input rows per weight step
    (cpu_simd's dot4 kernels) for an even group count, else the GEMV kernel row by row."""
    if x.shape[1] % 64:
        return gemv(method, x, w, s, 32)
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    kernel = _int8g_gemm_vnni if method == "int8" else _int4g32_gemm_vnni
    xn = x.contiguous().numpy()
    threads = cpu_gemv.sync_threads()
    kernel(w, s[:, 0] if s.ndim == 3 else s, xn, out, threads)
    if s.ndim == 3:
        xq, xs, _ = _quant_rows(xn, 32)
        _sub_zero(s[:, 1], _zero_sums(xn, xq, xs, 32, 32), out, threads)
    return torch.from_numpy(out)


@kernel("quant_gemv")
def gemv(
    method: str, x: torch.Tensor, qweight: torch.Tensor | np.ndarray, scale: torch.Tensor | np.ndarray,
    group_size: int, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [rows <= MAX_ROWS, in] fp32 @ the quantised weight.T (+ bias)."""
    x = x.contiguous()
    w, s = _np(qweight), _np(scale)
    _check(method, x.shape[1], w, s, group_size)
    out = np.empty((x.shape[0], w.shape[0]), np.float32)  # cheaper than torch.empty(...).numpy()
    threads = cpu_gemv.sync_threads()
    if method == "int8" and s.ndim == 3:
        _int8gz_gemv(w, s, x.numpy(), out, int8_int8(x.shape[1], 32), threads)
    elif method == "int8" and s.ndim == 2:
        (_int8g_gemv_vnni if int8_int8(x.shape[1], 32) else _int8g_gemv)(w, s, x.numpy(), out, threads)
    elif method == "int8":
        (_int8_gemv_vnni if int8_int8(x.shape[1]) else _int8_gemv)(w, s, x.numpy(), out, threads)
    elif s.ndim == 3:
        _int4z_gemv(w, s, x.numpy(), out, group_size, int8_activations(x.shape[0], group_size, x.shape[1]), threads)
    elif int8_activations(x.shape[0], group_size, x.shape[1]):
        _int4_gemv_vnni(w, s, x.numpy(), out, group_size, threads)
    else:
        _int4_gemv(w, s, x.numpy(), out, group_size, threads)
    result = torch.from_numpy(out)
    if bias is not None:
        result += bias
    return result


@kernel("quant_gemv_swiglu")
def gemv_swiglu(
    method: str, x: torch.Tensor, qweight: torch.Tensor | np.ndarray, scale: torch.Tensor | np.ndarray,
    group_size: int,
) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for a quantised [gate; up] weight, one pass over it."""
    x = x.contiguous()
    w, s = _np(qweight), _np(scale)
    _check(method, x.shape[1], w, s, group_size)
    out = np.empty((x.shape[0], w.shape[0] // 2), np.float32)
    threads = cpu_gemv.sync_threads()
    if method == "int8" and s.ndim == 3:
        _int8gz_swiglu(w, s, x.numpy(), out, int8_int8(x.shape[1], 32), threads)
    elif method == "int8" and s.ndim == 2:
        (_int8g_swiglu_vnni if int8_int8(x.shape[1], 32) else _int8g_swiglu)(w, s, x.numpy(), out, threads)
    elif method == "int8":
        (_int8_swiglu_vnni if int8_int8(x.shape[1]) else _int8_swiglu)(w, s, x.numpy(), out, threads)
    elif s.ndim == 3:
        _int4z_swiglu(w, s, x.numpy(), out, group_size, int8_activations(x.shape[0], group_size, x.shape[1]), threads)
    elif int8_activations(x.shape[0], group_size, x.shape[1]):
        _int4_swiglu_vnni(w, s, x.numpy(), out, group_size, threads)
    else:
        _int4_swiglu(w, s, x.numpy(), out, group_size, threads)
    return torch.from_numpy(out)


@kernel("quant_embedding")
def embedding_rows(method: str, qweight, scale, ids: torch.Tensor, group_size: int) -> torch.Tensor:
    """The fp32 rows `ids` (any shape, flattened) of a quantised [vocab, hidden] weight: a tied
    embedding's lookup in one call, equal to the reference's index_select + dequantise (~5-10 torch
    ops a decode step, each paying a cold cache after the weights streamed through it)."""
    flat = ids.reshape(-1).to(torch.int64).numpy()
    return torch.from_numpy(embedding_rows_np(method, _np(qweight), _np(scale), flat, group_size))


def embedding_rows_np(method: str, w: np.ndarray, s: np.ndarray, flat: np.ndarray, group_size: int) -> np.ndarray:
    """embedding_rows on numpy arrays: the weight's and scale's, and int64 token ids [n]."""
    n_in = w.shape[1] * (2 if method == "int4" else 1)
    out = np.empty((flat.shape[0], n_in), np.float32)
    if method == "int8" and s.ndim >= 2:
        sc, z, has_zero = _zero(s)
        ok = _int8g_rows(w, sc, z, has_zero, flat, out)
    elif method == "int8":
        ok = _int8_rows(w, s, flat, out)
    elif s.ndim == 3:
        ok = _int4z_rows(w, s, flat, out, group_size)
    else:
        ok = _int4_rows(w, s, flat, out, group_size)
    if not ok:
        raise IndexError(f"token id out of range for an embedding of {w.shape[0]} rows: "
                         f"{flat.min()}..{flat.max()}")
    return out
