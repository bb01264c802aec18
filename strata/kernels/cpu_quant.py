"""Weight-only int8 / int4 matmul on CPU: the storage formats, numba kernels and torch twins.

Formats (quantised once, at load, from the checkpoint's float weights):

- int8: `qweight` int8 [out, in], `scale` fp32 [out]; symmetric per output channel,
  w ~= qweight * scale with qweight in [-127, 127].
- int4: `qweight` uint8 [out, in / 2], `scale` fp32 [out, in / group_size]; symmetric per group of
  `group_size` input columns, w ~= (q - 8) * scale with q in [0, 15]. Two nibbles per byte, laid
  out per group: byte k of a group of L columns holds column k (low nibble) and column k + L/2
  (high nibble), so a kernel unpacks a run of bytes into two contiguous runs of columns (no
  shuffles). group_size divides the columns (see int4_group_size), so all groups are full.
  As in llama.cpp's q4_0, the scale maps the group's largest-magnitude value to -8 exactly, so
  all 16 levels are used.

Kernels: batch-1 decode is GEMV and reads every weight once, so reading 1 or 0.5 byte per weight
instead of 4 is the whole gain. The numba kernels follow kernels/cpu_gemv.py (contiguous slabs of
output rows per thread, 1-D row views, fastmath) and accumulate in fp32: int8 converts each byte
and FMAs it with x, the per-row scale applied once at the end; int4 unpacks the nibbles (and /
shift on bytes), sums each group against x and scales the group sum, with the -8 offset folded
into a per-call sum of x over each group. The two row dots are explicit vector LLVM IR (see
_i8_dot16 and _i4_dot for why), the loops around them plain numba.
For more than one input row the int4 kernel dequantises each weight row once into a per-thread
fp32 buffer and reuses it for every input row. Above MAX_ROWS rows (prefill, large batches) the
weight is dequantised tile by tile into a small fp32 buffer and torch's fp32 GEMM runs (matmul):
there compute dominates.

torch's own CPU weight-only kernels were measured on the dev box (Zen 4, AVX-512 VNNI/BF16) and
do not pay: `_weight_int8pack_mm` reads 2.4 GB/s of int8 with fp32 activations (6.9 with bf16),
`_weight_int4pack_mm_for_cpu` 0.5 GB/s (4.2 with bf16), and both scale linearly with rows
(no GEMM), against ~27-37 GB/s of int8 and ~20 GB/s of packed int4 (~40 G weights/s, compute-
bound) streamed from DRAM by the kernels here.

Every kernel's reference twin is the torch path: dequantize_*_ref then F.linear.
"""

from __future__ import annotations

import numpy as np
import torch

from strata.kernels import cpu_gemv

try:
    import numba
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - exercised only where numba is absent
    numba = None

MAX_ROWS = 16  # measured like cpu_gemv: above this, dequantise + fp32 GEMM
METHODS = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)


def available() -> bool:
    return numba is not None


# --- formats and torch reference twins ----------------------------------------------------------


def int4_group_size(in_features: int, group_size: int) -> int | None:
    """The group size a layer with `in_features` columns uses: `group_size`, halved until it
    divides the columns (smol-135m's 576 columns take 64 when 128 is asked), never below 32;
    None when no such size divides them (that layer then stays int8)."""
    g = group_size
    while g > 32 and in_features % g:
        g //= 2
    return g if in_features % g == 0 else None


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (any float dtype) -> (int8 [out, in], fp32 scale [out])."""
    w = w.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _int4_perm(in_features: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns held by the low and the high nibbles of the packed bytes, in byte order."""
    half = group_size // 2
    base = torch.arange(0, in_features, group_size)[:, None]
    lo = (base + torch.arange(half)).reshape(-1)
    return lo, lo + half


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (packed uint8 [out, in / 2], fp32 scale [out, in / group_size])."""
    n_out, n_in = w.shape
    if group_size % 2 or n_in % group_size:
        raise ValueError(f"int4: group_size {group_size} must be even and divide in_features {n_in}")
    wg = w.detach().float().view(n_out, n_in // group_size, group_size)
    idx = wg.abs().argmax(dim=2, keepdim=True)
    extreme = wg.gather(2, idx).squeeze(2)  # the signed value of largest magnitude
    scale = torch.where(extreme != 0, extreme / -8.0, torch.ones_like(extreme))
    q = torch.round(wg / scale[..., None]).add_(8).clamp_(0, 15).to(torch.uint8).view(n_out, n_in)
    lo, hi = _int4_perm(n_in, group_size)
    packed = q[:, lo] | (q[:, hi] << 4)
    return packed.contiguous(), scale.contiguous()


def dequantize_int8_ref(qweight: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (qweight.to(torch.float32) * scale[:, None]).to(dtype)


def dequantize_int4_ref(qweight: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The float weight [out, in] that the int4 kernels compute with (any device)."""
    n_out, ng = scale.shape
    packed = qweight.view(n_out, ng, -1)
    q = torch.cat(((packed & 15), (packed >> 4)), dim=2).to(torch.float32)
    return ((q - 8.0) * scale[..., None]).view(n_out, -1).to(dtype)


# --- numba kernels ------------------------------------------------------------------------------

if numba is not None:

    @njit(fastmath=True, cache=True, inline="always")
    def _f32_dot(a, b):  # pragma: no cover - compiled
        acc = np.float32(0.0)
        for c in range(b.shape[0]):
            acc += a[c] * b[c]
        return acc

    # int4 inner loops are written as explicit <16 x float> LLVM IR (generic vector IR: LLVM
    # lowers it to AVX-512, AVX2 or NEON). numba's auto-vectoriser picks 64 bytes per iteration
    # for a loop of unknown trip count, so a group's 16-64 bytes ran in its scalar/narrow
    # epilogue: measured 1.5-1.8x slower at group size 64. Here each group is a loop of 16-byte
    # steps (group sizes are multiples of 32) with separate accumulators for the two nibbles.

    _VL = 16

    def _vec_consts():
        f32 = ir.FloatType()
        vf = ir.VectorType(f32, _VL)
        vb = ir.VectorType(ir.IntType(8), _VL)
        return f32, vf, vb, ir.Constant(vf, [0.0] * _VL)

    def _splat(builder, value, vf):
        v = builder.insert_element(ir.Constant(vf, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
        mask = ir.Constant(ir.VectorType(ir.IntType(32), _VL), [0] * _VL)
        return builder.shuffle_vector(v, ir.Constant(vf, ir.Undefined), mask)

    def _unpack16(builder, wdata, byte_index, vf, vb):
        """16 bytes at wdata[byte_index] -> (low nibbles, high nibbles) as <16 x float>."""
        ptr = builder.bitcast(builder.gep(wdata, [byte_index], inbounds=True), vb.as_pointer())
        b = builder.load(ptr, align=1)
        lo = builder.and_(b, ir.Constant(vb, [15] * _VL))
        hi = builder.lshr(b, ir.Constant(vb, [4] * _VL))
        return builder.uitofp(lo, vf), builder.uitofp(hi, vf)

    def _vload(builder, data, index, vf):
        return builder.load(builder.bitcast(builder.gep(data, [index], inbounds=True), vf.as_pointer()), align=4)

    _FAST = ("fast",)

    @intrinsic
    def _i8_dot16(typingctx, wr, xj):  # pragma: no cover - compiled
        """sum_c wr[c] * xj[c] over the first len - len % 16 columns, in <16 x float> steps.

        One 16-wide accumulator per row: measured ~27-37 GB/s of int8 streamed from DRAM on the
        dev box against ~18-27 for numba's auto-vectorised loop (64 bytes per iteration, four
        accumulators) on the smol-135m / qwen-0.5b shapes."""
        sig = types.float32(wr, xj)

        def codegen(context, builder, signature, args):
            w, x = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args))
            f32, vf, vb, zero = _vec_consts()
            i64 = ir.IntType(64)
            n = cgutils.unpack_tuple(builder, x.shape, 1)[0]
            n16 = builder.and_(n, ir.Constant(i64, -_VL))
            acc = cgutils.alloca_once_value(builder, zero)
            with cgutils.for_range_slice(builder, ir.Constant(i64, 0), n16, ir.Constant(i64, _VL)) as (k, _):
                ptr = builder.bitcast(builder.gep(w.data, [k], inbounds=True), vb.as_pointer())
                wf = builder.sitofp(builder.load(ptr, align=1), vf)
                xv = _vload(builder, x.data, k, vf)
                builder.store(builder.fadd(builder.load(acc), builder.fmul(wf, xv, flags=_FAST), flags=_FAST), acc)
            reduce = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(f32, [f32, vf]), "llvm.vector.reduce.fadd.v16f32"
            )
            return builder.call(reduce, [ir.Constant(f32, 0.0), builder.load(acc)], fastmath=_FAST)

        return sig, codegen

    @njit(fastmath=True, cache=True, inline="always")
    def _i8_dot(wr, xj):  # pragma: no cover - compiled
        n = xj.shape[0]
        acc = _i8_dot16(wr, xj)
        for c in range(n - n % 16, n):  # the few columns past the last 16-wide step
            acc += np.float32(wr[c]) * xj[c]
        return acc


    @intrinsic
    def _i4_dot(typingctx, wr, sr, xj, xs8, half):  # pragma: no cover - compiled
        """sum_g sr[g] * (sum_k q * x - xs8[g]) for one packed row; xs8[g] = 8 * sum of x over g."""
        sig = types.float32(wr, sr, xj, xs8, half)

        def codegen(context, builder, signature, args):
            w, sc, x, xs = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:4], args[:4]))
            half_v = args[4]
            f32, vf, vb, zero = _vec_consts()
            i64 = ir.IntType(64)
            row = cgutils.alloca_once_value(builder, zero)
            offset = cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0))
            acc_lo = cgutils.alloca_once_value(builder, zero)
            acc_hi = cgutils.alloca_once_value(builder, zero)
            with cgutils.for_range(builder, cgutils.unpack_tuple(builder, sc.shape, 1)[0]) as group:
                g = group.index
                b0 = builder.mul(g, half_v)
                x0 = builder.add(b0, b0)
                builder.store(zero, acc_lo)
                builder.store(zero, acc_hi)
                with cgutils.for_range_slice(builder, ir.Constant(i64, 0), half_v, ir.Constant(i64, _VL)) as (k, _):
                    lo, hi = _unpack16(builder, w.data, builder.add(b0, k), vf, vb)
                    xl = _vload(builder, x.data, builder.add(x0, k), vf)
                    xh = _vload(builder, x.data, builder.add(builder.add(x0, half_v), k), vf)
                    builder.store(builder.fadd(builder.load(acc_lo), builder.fmul(lo, xl, flags=_FAST), flags=_FAST), acc_lo)
                    builder.store(builder.fadd(builder.load(acc_hi), builder.fmul(hi, xh, flags=_FAST), flags=_FAST), acc_hi)
                sg = builder.load(builder.gep(sc.data, [g], inbounds=True))
                gsum = builder.fadd(builder.load(acc_lo), builder.load(acc_hi), flags=_FAST)
                scaled = builder.fmul(gsum, _splat(builder, sg, vf), flags=_FAST)
                builder.store(builder.fadd(builder.load(row), scaled, flags=_FAST), row)
                xsg = builder.load(builder.gep(xs.data, [g], inbounds=True))
                builder.store(builder.fadd(builder.load(offset), builder.fmul(sg, xsg, flags=_FAST), flags=_FAST), offset)
            reduce = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(f32, [f32, vf]), "llvm.vector.reduce.fadd.v16f32"
            )
            total = builder.call(reduce, [ir.Constant(f32, 0.0), builder.load(row)], fastmath=_FAST)
            return builder.fsub(total, builder.load(offset), flags=_FAST)

        return sig, codegen

    @intrinsic
    def _i4_row(typingctx, wr, sr, buf, half):  # pragma: no cover - compiled
        """Dequantise one packed row into buf (fp32): (q - 8) * scale."""
        sig = types.none(wr, sr, buf, half)

        def codegen(context, builder, signature, args):
            w, sc, out = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:3], args[:3]))
            half_v = args[3]
            f32, vf, vb, zero = _vec_consts()
            i64 = ir.IntType(64)
            with cgutils.for_range(builder, cgutils.unpack_tuple(builder, sc.shape, 1)[0]) as group:
                g = group.index
                b0 = builder.mul(g, half_v)
                x0 = builder.add(b0, b0)
                sg = builder.load(builder.gep(sc.data, [g], inbounds=True))
                sv = _splat(builder, sg, vf)
                off = _splat(builder, builder.fmul(sg, ir.Constant(f32, 8.0)), vf)
                with cgutils.for_range_slice(builder, ir.Constant(i64, 0), half_v, ir.Constant(i64, _VL)) as (k, _):
                    lo, hi = _unpack16(builder, w.data, builder.add(b0, k), vf, vb)
                    for vals, base in ((lo, x0), (hi, builder.add(x0, half_v))):
                        deq = builder.fsub(builder.fmul(vals, sv, flags=_FAST), off, flags=_FAST)
                        ptr = builder.gep(out.data, [builder.add(base, k)], inbounds=True)
                        builder.store(deq, builder.bitcast(ptr, vf.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

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
                    out[j, r] = _i8_dot(wr, x[j]) * s[r]

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
                    g = _i8_dot(wg, xj) * s[r]
                    u = _i8_dot(wu, xj) * s[r + half_rows]
                    out[j, r] = g / (np.float32(1.0) + np.exp(-g)) * u

    @njit(parallel=True, fastmath=True, cache=True)
    def _int4_gemv(w, s, x, out, group, threads):  # pragma: no cover - compiled
        n_out = w.shape[0]
        rows, n_in = x.shape
        xs8 = _group_sums8(x, group)
        per = (n_out + threads - 1) // threads
        for t in prange(threads):
            buf = np.empty(n_in, np.float32)
            for r in range(t * per, min(n_out, (t + 1) * per)):
                if rows == 1:
                    out[0, r] = _i4_dot(w[r], s[r], x[0], xs8[0], group // 2)
                else:  # unpack once, reuse for every input row
                    _i4_row(w[r], s[r], buf, group // 2)
                    for j in range(rows):
                        out[j, r] = _f32_dot(buf, x[j])

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
                    g = _i4_dot(w[r], s[r], x[0], xs8[0], group // 2)
                    u = _i4_dot(w[r + half_rows], s[r + half_rows], x[0], xs8[0], group // 2)
                    out[0, r] = g / (np.float32(1.0) + np.exp(-g)) * u
                else:
                    _i4_row(w[r], s[r], bg, group // 2)
                    _i4_row(w[r + half_rows], s[r + half_rows], bu, group // 2)
                    for j in range(rows):
                        g = _f32_dot(bg, x[j])
                        u = _f32_dot(bu, x[j])
                        out[j, r] = g / (np.float32(1.0) + np.exp(-g)) * u

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
                _i4_row(w[r], s[r], out[r], group // 2)


# --- entry points -------------------------------------------------------------------------------


def usable(x: torch.Tensor, qweight: torch.Tensor | np.ndarray) -> bool:
    """Whether the numba kernels apply: numba present, fp32 CPU input, no autograd."""
    return (
        numba is not None
        and x.dtype == torch.float32
        and x.is_cpu
        and (isinstance(qweight, np.ndarray) or qweight.is_cpu)
        and not (x.requires_grad and torch.is_grad_enabled())
    )


def _np(t: torch.Tensor | np.ndarray) -> np.ndarray:
    return t if isinstance(t, np.ndarray) else t.numpy()


def _check(method: str, in_features: int, qweight, scale, group_size: int) -> None:
    """The kernels index without bounds checks: shapes must agree (a cheap guard per call)."""
    if method == "int8":
        ok = qweight.shape[1] == in_features and scale.shape[0] == qweight.shape[0]
    else:  # 16-byte steps per group: group_size a multiple of 32
        ok = (group_size % 32 == 0 and 2 * qweight.shape[1] == in_features
              and scale.shape[1] * group_size == in_features and scale.shape[0] == qweight.shape[0])
    if not ok:
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
    threads = cpu_gemv.sync_threads()
    if method == "int8":
        _int8_dequant(_np(qweight), _np(scale), out.numpy(), threads)
    else:
        _int4_dequant(_np(qweight), _np(scale), out.numpy(), group_size, threads)
    return out


def matmul(
    method: str, x: torch.Tensor, qweight: torch.Tensor | np.ndarray, scale: torch.Tensor | np.ndarray,
    group_size: int, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [rows, in] fp32 @ the quantised weight.T (+ bias) for many rows (prefill, big batches).

    Tile-wise: a few hundred weight rows at a time (~4 MiB of fp32) are dequantised into one
    reused buffer and multiplied by torch's fp32 GEMM into the transposed output. Measured on
    the dev box (qwen-0.5b gate/up 9728x896, 128 rows): 13 ms, against 29 ms for dequantising
    the whole weight per call (a fresh 35 MB buffer: page faults) and 17 ms for fp32 F.linear
    on an already-float weight.
    """
    x = x.contiguous()
    w, s = _np(qweight), _np(scale)
    n_out, n_in = w.shape[0], x.shape[1]
    _check(method, n_in, w, s, group_size)
    tile_rows = max(64, min(1024, (4 << 20) // (4 * n_in) // 16 * 16))
    out_t = torch.empty(n_out, x.shape[0], dtype=torch.float32)
    buf = torch.empty(min(tile_rows, n_out), n_in, dtype=torch.float32)
    x_t = x.t()
    threads = cpu_gemv.sync_threads()
    for r0 in range(0, n_out, tile_rows):
        r1 = min(n_out, r0 + tile_rows)
        tile = buf[: r1 - r0]
        if method == "int8":
            _int8_dequant(w[r0:r1], s[r0:r1], tile.numpy(), threads)
        else:
            _int4_dequant(w[r0:r1], s[r0:r1], tile.numpy(), group_size, threads)
        torch.mm(tile, x_t, out=out_t[r0:r1])
    out = out_t.t().contiguous()
    if bias is not None:
        out += bias
    return out


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
    if method == "int8":
        _int8_gemv(w, s, x.numpy(), out, threads)
    else:
        _int4_gemv(w, s, x.numpy(), out, group_size, threads)
    result = torch.from_numpy(out)
    if bias is not None:
        result += bias
    return result


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
    if method == "int8":
        _int8_swiglu(w, s, x.numpy(), out, threads)
    else:
        _int4_swiglu(w, s, x.numpy(), out, group_size, threads)
    return torch.from_numpy(out)
