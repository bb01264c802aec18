"""Explicit LLVM vector row dots for the quantised CPU kernels (numba intrinsics).

int4 inner loops are written as generic vector IR (LLVM lowers it to AVX-512, AVX2 or NEON).
numba's auto-vectoriser picks 64 bytes per iteration for a loop of unknown trip count, so a
group's 16-64 bytes ran in its scalar/narrow epilogue: measured 1.5-1.8x slower at group size 64.
Here each group is a loop of 16-byte steps (group sizes are multiples of 32) with separate
accumulators for the two nibbles. The int8 row dot is written the same way (see _i8_dot16).
On CPUs with AVX-512 VNNI, batch-1 int4 runs i4_dot_vnni and int8 GEMVs i8_dot_vnni instead:
integer dot products against the input quantised to int8 (cpu_quant.py says when and why).
bf16_dot reads bf16 weights and widens them exactly in registers (cpu_bf16.py). i4_row /
i4_row_bf16 / i4_row_bf16_lut dequantise an int4 row for the prefill GEMM (fp32, or bf16 bits);
i4_row_int8_lut requantises one to int8 for the W8A8 prefill (cpu_w8a8.py).
Formats: quant_formats.py. Used by cpu_quant.py; import only where numba is available.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from strata.cpuinfo import cpu_model_and_flags


@njit(fastmath=True, cache=True, inline="always")
def f32_dot(a, b):  # pragma: no cover - compiled
    acc = np.float32(0.0)
    for c in range(b.shape[0]):
        acc += a[c] * b[c]
    return acc


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


def _group_scales(builder, sc, g, vf):
    """A group's scale s and 8 * s, splatted: its nibble q dequantises to q * s - 8 * s."""
    sg = builder.load(builder.gep(sc.data, [g], inbounds=True))
    return _splat(builder, sg, vf), _splat(builder, builder.fmul(sg, ir.Constant(ir.FloatType(), 8.0)), vf)


def _dequant(builder, vals, scales):
    sv, off = scales
    return builder.fsub(builder.fmul(vals, sv, flags=_FAST), off, flags=_FAST)


def _round_bf16_bits(builder, vals):
    """<16 x float> -> the bf16 bit patterns <16 x i16>, rounded to nearest even (finite values:
    as torch's .to(torch.bfloat16))."""
    vi32 = ir.VectorType(ir.IntType(32), _VL)
    c16, one, bias = (ir.Constant(vi32, [v] * _VL) for v in (16, 1, 0x7FFF))
    b = builder.bitcast(vals, vi32)
    odd = builder.and_(builder.lshr(b, c16), one)
    return builder.trunc(builder.lshr(builder.add(builder.add(b, bias), odd), c16), ir.VectorType(ir.IntType(16), _VL))


def _vload(builder, data, index, vf):
    return builder.load(
        builder.bitcast(builder.gep(data, [index], inbounds=True), vf.as_pointer()), align=4
    )


_FAST = ("fast",)


def _hsum(builder, vec):
    """Horizontal sum of a <16 x float> (fast-math: any order)."""
    f32, vf = ir.FloatType(), ir.VectorType(ir.FloatType(), _VL)
    reduce = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(f32, [f32, vf]), "llvm.vector.reduce.fadd.v16f32"
    )
    return builder.call(reduce, [ir.Constant(f32, 0.0), vec], fastmath=_FAST)


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
        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), n16, ir.Constant(i64, _VL)) as (
            k,
            _,
        ):
            ptr = builder.bitcast(builder.gep(w.data, [k], inbounds=True), vb.as_pointer())
            wf = builder.sitofp(builder.load(ptr, align=1), vf)
            xv = _vload(builder, x.data, k, vf)
            builder.store(
                builder.fadd(builder.load(acc), builder.fmul(wf, xv, flags=_FAST), flags=_FAST), acc
            )
        return _hsum(builder, builder.load(acc))

    return sig, codegen


@njit(fastmath=True, cache=True, inline="always")
def i8_dot(wr, xj):  # pragma: no cover - compiled
    n = xj.shape[0]
    acc = _i8_dot16(wr, xj)
    for c in range(n - n % 16, n):  # the few columns past the last 16-wide step
        acc += np.float32(wr[c]) * xj[c]
    return acc


@intrinsic
def i4_dot(typingctx, wr, sr, xj, xs8, half):  # pragma: no cover - compiled
    """sum_g sr[g] * (sum_k q * x - xs8[g]) for one packed row; xs8[g] = 8 * sum of x over g."""
    sig = types.float32(wr, sr, xj, xs8, half)

    def codegen(context, builder, signature, args):
        w, sc, x, xs = (
            context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:4], args[:4])
        )
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
            with cgutils.for_range_slice(
                builder, ir.Constant(i64, 0), half_v, ir.Constant(i64, _VL)
            ) as (k, _):
                lo, hi = _unpack16(builder, w.data, builder.add(b0, k), vf, vb)
                xl = _vload(builder, x.data, builder.add(x0, k), vf)
                xh = _vload(builder, x.data, builder.add(builder.add(x0, half_v), k), vf)
                builder.store(
                    builder.fadd(
                        builder.load(acc_lo), builder.fmul(lo, xl, flags=_FAST), flags=_FAST
                    ),
                    acc_lo,
                )
                builder.store(
                    builder.fadd(
                        builder.load(acc_hi), builder.fmul(hi, xh, flags=_FAST), flags=_FAST
                    ),
                    acc_hi,
                )
            sg = builder.load(builder.gep(sc.data, [g], inbounds=True))
            gsum = builder.fadd(builder.load(acc_lo), builder.load(acc_hi), flags=_FAST)
            scaled = builder.fmul(gsum, _splat(builder, sg, vf), flags=_FAST)
            builder.store(builder.fadd(builder.load(row), scaled, flags=_FAST), row)
            xsg = builder.load(builder.gep(xs.data, [g], inbounds=True))
            builder.store(
                builder.fadd(builder.load(offset), builder.fmul(sg, xsg, flags=_FAST), flags=_FAST),
                offset,
            )
        total = _hsum(builder, builder.load(row))
        return builder.fsub(total, builder.load(offset), flags=_FAST)

    return sig, codegen


def _i4_row_loop(context, builder, signature, args, store):
    """The loop of the int4 row dequantisers: per group its scales, per 16 packed bytes the low
    and high nibbles dequantised to <16 x float> and handed to store(vals, out, index)."""
    w, sc, out = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:3], args[:3]))
    half_v = args[3]
    f32, vf, vb, zero = _vec_consts()
    i64 = ir.IntType(64)
    with cgutils.for_range(builder, cgutils.unpack_tuple(builder, sc.shape, 1)[0]) as group:
        b0 = builder.mul(group.index, half_v)
        x0 = builder.add(b0, b0)
        scales = _group_scales(builder, sc, group.index, vf)
        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), half_v, ir.Constant(i64, _VL)) as (k, _):
            lo, hi = _unpack16(builder, w.data, builder.add(b0, k), vf, vb)
            for vals, base in ((lo, x0), (hi, builder.add(x0, half_v))):
                store(_dequant(builder, vals, scales), out, builder.add(base, k))


@intrinsic
def i4_row(typingctx, wr, sr, buf, half):  # pragma: no cover - compiled
    """Dequantise one packed row into buf (fp32): (q - 8) * scale."""
    sig = types.none(wr, sr, buf, half)

    def codegen(context, builder, signature, args):
        def store(vals, out, index):
            ptr = builder.gep(out.data, [index], inbounds=True)
            builder.store(vals, builder.bitcast(ptr, vals.type.as_pointer()), align=4)

        _i4_row_loop(context, builder, signature, args, store)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def i4_row_bf16(typingctx, wr, sr, bits, half):  # pragma: no cover - compiled
    """Dequantise one packed row straight to bf16 bit patterns (uint16): i4_row's (q - 8) * scale,
    rounded to nearest even in the same registers (as cpu_quant._round_bf16 rounds i4_row's fp32
    row), one pass and no fp32 row: qwen-0.5b's matrices 15-18 vs 13-17 G weights/s for the two
    passes on the Zen 4 VM. Where AVX-512 BW is, i4_row_bf16_lut gives the same bits faster."""
    sig = types.none(wr, sr, bits, half)

    def codegen(context, builder, signature, args):
        def store(vals, out, index):
            rounded = _round_bf16_bits(builder, vals)
            ptr = builder.gep(out.data, [index], inbounds=True)
            builder.store(rounded, builder.bitcast(ptr, rounded.type.as_pointer()), align=2)

        _i4_row_loop(context, builder, signature, args, store)
        return context.get_dummy_value()

    return sig, codegen


def has_avx512bw() -> bool:
    return {"avx512f", "avx512bw"} <= cpu_model_and_flags()[1]


@intrinsic
def i4_row_bf16_lut(typingctx, wr, sr, bits, half):  # pragma: no cover - compiled
    """i4_row_bf16 by table lookup (AVX-512 BW only: VPERMW): a nibble has 16 values, so per
    group the 16 dequantised, rounded bf16 values are computed once with i4_row_bf16's own
    arithmetic (the same bits) and each 16 packed bytes (32 weights) become one 32-lane VPERMW
    of their nibbles: ~8 instructions per 32 weights where the arithmetic takes ~25.
    `half` (group / 2) must be a multiple of 16."""
    sig = types.none(wr, sr, bits, half)

    def codegen(context, builder, signature, args):
        w, sc, out = (
            context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:3], args[:3])
        )
        half_v = args[3]
        f32, vf, vb, zero = _vec_consts()
        i16, i32, i64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
        vi16, v32i16 = ir.VectorType(i16, _VL), ir.VectorType(i16, 2 * _VL)
        levels = ir.Constant(vf, [float(v) for v in range(_VL)])
        concat = ir.Constant(ir.VectorType(i32, 2 * _VL), list(range(2 * _VL)))
        lanes = [ir.Constant(ir.VectorType(i32, _VL), list(range(h * _VL, (h + 1) * _VL))) for h in (0, 1)]
        permw = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v32i16, [v32i16, v32i16]), "llvm.x86.avx512.permvar.hi.512"
        )
        with cgutils.for_range(builder, cgutils.unpack_tuple(builder, sc.shape, 1)[0]) as group:
            b0 = builder.mul(group.index, half_v)
            x0 = builder.add(b0, b0)
            table16 = _round_bf16_bits(builder, _dequant(builder, levels, _group_scales(builder, sc, group.index, vf)))
            table = builder.shuffle_vector(table16, table16, concat)  # lanes 16-31 unused
            with cgutils.for_range_slice(
                builder, ir.Constant(i64, 0), half_v, ir.Constant(i64, _VL)
            ) as (k, _):
                ptr = builder.bitcast(builder.gep(w.data, [builder.add(b0, k)], inbounds=True), vb.as_pointer())
                packed = builder.load(ptr, align=1)
                lo = builder.zext(builder.and_(packed, ir.Constant(vb, [15] * _VL)), vi16)
                hi = builder.zext(builder.lshr(packed, ir.Constant(vb, [4] * _VL)), vi16)
                looked = builder.call(permw, [table, builder.shuffle_vector(lo, hi, concat)])
                for h, base in ((0, x0), (1, builder.add(x0, half_v))):
                    vals = builder.shuffle_vector(looked, looked, lanes[h])
                    dst = builder.gep(out.data, [builder.add(base, k)], inbounds=True)
                    builder.store(vals, builder.bitcast(dst, vi16.as_pointer()), align=2)
        return context.get_dummy_value()

    return sig, codegen


def has_ssse3() -> bool:
    return "ssse3" in cpu_model_and_flags()[1]


@intrinsic
def i4_row_int8_lut(typingctx, wr, tables, out, half):  # pragma: no cover - compiled
    """One packed int4 row to int8 by table lookup (SSSE3 PSHUFB, 16 lanes): `tables` [groups, 16]
    holds each group's 16 int8 values (cpu_w8a8._int4_to_int8 computes them), so each 16 packed
    bytes become two PSHUFBs of their low and high nibbles. `half` (group / 2) must be a multiple
    of 16."""
    sig = types.none(wr, tables, out, half)

    def codegen(context, builder, signature, args):
        w, tab, o = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:3], args[:3]))
        half_v = args[3]
        i64 = ir.IntType(64)
        vb = ir.VectorType(ir.IntType(8), _VL)
        low4 = ir.Constant(vb, [15] * _VL)
        pshufb = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vb, [vb, vb]), "llvm.x86.ssse3.pshuf.b.128"
        )
        with cgutils.for_range(builder, cgutils.unpack_tuple(builder, tab.shape, 2)[0]) as group:
            b0 = builder.mul(group.index, half_v)
            x0 = builder.add(b0, b0)
            tptr = builder.gep(tab.data, [builder.mul(group.index, ir.Constant(i64, _VL))], inbounds=True)
            table = builder.load(builder.bitcast(tptr, vb.as_pointer()), align=1)
            with cgutils.for_range_slice(builder, ir.Constant(i64, 0), half_v, ir.Constant(i64, _VL)) as (k, _):
                ptr = builder.bitcast(builder.gep(w.data, [builder.add(b0, k)], inbounds=True), vb.as_pointer())
                packed = builder.load(ptr, align=1)
                lo = builder.and_(packed, low4)
                hi = builder.and_(builder.lshr(packed, ir.Constant(vb, [4] * _VL)), low4)
                for nibbles, base in ((lo, x0), (hi, builder.add(x0, half_v))):
                    dst = builder.gep(o.data, [builder.add(base, k)], inbounds=True)
                    builder.store(builder.call(pshufb, [table, nibbles]), builder.bitcast(dst, vb.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


# --- int4 x int8 with AVX-512 VNNI ------------------------------------------------------------------


def has_avx512_vnni() -> bool:
    return {"avx512f", "avx512bw", "avx512_vnni"} <= cpu_model_and_flags()[1]


@intrinsic
def i4_dot_vnni(typingctx, wr, sr, xq, xf, half):  # pragma: no cover - compiled
    """sum_g sr[g] * xf[g] * sum_k q * xq for one packed row, in integers (VPDPBUSD).

    xq holds the input row quantised to int8 per group with scales xf (cpu_quant._quant_x); the
    -8 offset of the nibbles is subtracted by the caller (8 * sum of xq over each group). Per
    32 packed bytes: the low and high nibbles (columns k and half + k of the group) become one
    64-byte unsigned vector, the two matching 32-byte runs of xq one signed vector, and one
    VPDPBUSD multiplies and sums them into 16 int32 lanes; each group's lanes are converted and
    scaled once. `half` (group / 2) must be a multiple of 32. The old <16 x i32> form of the
    intrinsic is used: LLVM upgrades it where the operands became <64 x i8>.
    """
    sig = types.float32(wr, sr, xq, xf, half)

    def codegen(context, builder, signature, args):
        w, sc, x, xs = (
            context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:4], args[:4])
        )
        half_v = args[4]
        f32, vf, _, zero = _vec_consts()
        i32, i64 = ir.IntType(32), ir.IntType(64)
        vi = ir.VectorType(i32, _VL)
        v32b = ir.VectorType(ir.IntType(8), 32)
        concat = ir.Constant(ir.VectorType(i32, 64), list(range(64)))
        dpbusd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vi, [vi, vi, vi]), "llvm.x86.avx512.vpdpbusd.512"
        )
        row = cgutils.alloca_once_value(builder, zero)
        acc = cgutils.alloca_once_value(builder, ir.Constant(vi, [0] * _VL))

        def load32(data, index):
            ptr = builder.bitcast(builder.gep(data, [index], inbounds=True), v32b.as_pointer())
            return builder.load(ptr, align=1)

        with cgutils.for_range(builder, cgutils.unpack_tuple(builder, sc.shape, 1)[0]) as group:
            g = group.index
            b0 = builder.mul(g, half_v)
            x0 = builder.add(b0, b0)
            builder.store(ir.Constant(vi, [0] * _VL), acc)
            with cgutils.for_range_slice(builder, ir.Constant(i64, 0), half_v, ir.Constant(i64, 32)) as (k, _):
                b = load32(w.data, builder.add(b0, k))
                lo = builder.and_(b, ir.Constant(v32b, [15] * 32))
                hi = builder.lshr(b, ir.Constant(v32b, [4] * 32))
                wv = builder.shuffle_vector(lo, hi, concat)
                xv = builder.shuffle_vector(
                    load32(x.data, builder.add(x0, k)), load32(x.data, builder.add(builder.add(x0, half_v), k)),
                    concat,
                )
                summed = builder.call(dpbusd, [builder.load(acc), builder.bitcast(wv, vi), builder.bitcast(xv, vi)])
                builder.store(summed, acc)
            factor = builder.fmul(
                builder.load(builder.gep(sc.data, [g], inbounds=True)),
                builder.load(builder.gep(xs.data, [g], inbounds=True)),
                flags=_FAST,
            )
            scaled = builder.fmul(builder.sitofp(builder.load(acc), vf), _splat(builder, factor, vf), flags=_FAST)
            builder.store(builder.fadd(builder.load(row), scaled, flags=_FAST), row)
        return _hsum(builder, builder.load(row))

    return sig, codegen


@intrinsic
def i4_dot_vnni_g32(typingctx, wr, sr, xq, xf):  # pragma: no cover - compiled
    """i4_dot_vnni for groups of 32 columns (llama.cpp's Q4_0 blocks, repacked: 16 bytes a group),
    two groups per VPDPBUSD (an odd last group beside a zero one).

    32 packed bytes = groups g and g+1: their low nibbles (each group's columns 0-15) then their
    high nibbles (columns 16-31) make the 64-byte unsigned vector [g lo, g+1 lo, g hi, g+1 hi]; the
    matching 64 bytes of xq are permuted to the same order, so int32 lanes 0-3 and 8-11 sum group
    g and lanes 4-7 and 12-15 group g+1, each lane scaled by its group's sr * xf. The caller
    subtracts the nibbles' -8 offset, as for i4_dot_vnni."""
    sig = types.float32(wr, sr, xq, xf)

    def codegen(context, builder, signature, args):
        w, sc, x, xs = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args))
        f32, vf, _, zero = _vec_consts()
        i32, i64 = ir.IntType(32), ir.IntType(64)
        vi = ir.VectorType(i32, _VL)
        v32b, v64b = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(8), 64)
        concat = ir.Constant(ir.VectorType(i32, 64), list(range(64)))
        x_order = ir.Constant(ir.VectorType(i32, 64), [*range(0, 16), *range(32, 48), *range(16, 32), *range(48, 64)])
        lane_group = ir.Constant(vi, [0, 0, 0, 0, 16, 16, 16, 16, 0, 0, 0, 0, 16, 16, 16, 16])
        dpbusd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vi, [vi, vi, vi]), "llvm.x86.avx512.vpdpbusd.512"
        )
        row = cgutils.alloca_once_value(builder, zero)
        pairs = builder.udiv(cgutils.unpack_tuple(builder, sc.shape, 1)[0], ir.Constant(i64, 2))
        with cgutils.for_range(builder, pairs) as pair:
            p = pair.index
            g = builder.add(p, p)
            b = builder.load(builder.bitcast(builder.gep(w.data, [builder.mul(p, ir.Constant(i64, 32))], inbounds=True),
                                             v32b.as_pointer()), align=1)
            lo = builder.and_(b, ir.Constant(v32b, [15] * 32))
            hi = builder.lshr(b, ir.Constant(v32b, [4] * 32))
            wv = builder.shuffle_vector(lo, hi, concat)
            xraw = builder.load(builder.bitcast(builder.gep(x.data, [builder.mul(p, ir.Constant(i64, 64))], inbounds=True),
                                                v64b.as_pointer()), align=1)
            xv = builder.shuffle_vector(xraw, ir.Constant(v64b, ir.Undefined), x_order)
            summed = builder.call(dpbusd, [ir.Constant(vi, [0] * _VL), builder.bitcast(wv, vi), builder.bitcast(xv, vi)])

            def factor(k):
                gk = builder.add(g, ir.Constant(i64, k))
                return builder.fmul(builder.load(builder.gep(sc.data, [gk], inbounds=True)),
                                    builder.load(builder.gep(xs.data, [gk], inbounds=True)), flags=_FAST)

            scales = builder.shuffle_vector(_splat(builder, factor(0), vf), _splat(builder, factor(1), vf), lane_group)
            scaled = builder.fmul(builder.sitofp(summed, vf), scales, flags=_FAST)
            builder.store(builder.fadd(builder.load(row), scaled, flags=_FAST), row)
        # an odd last group: the same step with a zero group beside it
        ng = cgutils.unpack_tuple(builder, sc.shape, 1)[0]
        with builder.if_then(builder.icmp_unsigned("!=", builder.and_(ng, ir.Constant(i64, 1)), ir.Constant(i64, 0))):
            g = builder.sub(ng, ir.Constant(i64, 1))
            v16b = ir.VectorType(ir.IntType(8), 16)
            b16 = builder.load(builder.bitcast(builder.gep(w.data, [builder.mul(g, ir.Constant(i64, 16))], inbounds=True),
                                               v16b.as_pointer()), align=1)
            b = builder.shuffle_vector(b16, ir.Constant(v16b, [0] * 16), ir.Constant(ir.VectorType(i32, 32), list(range(32))))
            wv = builder.shuffle_vector(builder.and_(b, ir.Constant(v32b, [15] * 32)),
                                        builder.lshr(b, ir.Constant(v32b, [4] * 32)), concat)
            x32 = builder.load(builder.bitcast(builder.gep(x.data, [builder.mul(g, ir.Constant(i64, 32))], inbounds=True),
                                               v32b.as_pointer()), align=1)
            xv = builder.shuffle_vector(builder.shuffle_vector(x32, ir.Constant(v32b, [0] * 32), concat),
                                        ir.Constant(v64b, ir.Undefined), x_order)
            summed = builder.call(dpbusd, [ir.Constant(vi, [0] * _VL), builder.bitcast(wv, vi), builder.bitcast(xv, vi)])
            f = builder.fmul(builder.load(builder.gep(sc.data, [g], inbounds=True)),
                             builder.load(builder.gep(xs.data, [g], inbounds=True)), flags=_FAST)
            scaled = builder.fmul(builder.sitofp(summed, vf), _splat(builder, f, vf), flags=_FAST)
            builder.store(builder.fadd(builder.load(row), scaled, flags=_FAST), row)
        return _hsum(builder, builder.load(row))

    return sig, codegen


# --- bf16 weights, fp32 accumulation -------------------------------------------------------------


_BF16_UNROLL = 4


@intrinsic
def bf16_dot(typingctx, wr, xj):  # pragma: no cover - compiled
    """sum_c bf16(wr[c]) * xj[c] for one row; wr holds bf16 bit patterns as int16, xj is fp32.

    A bf16 is the top half of an fp32, so each weight widens exactly: zero-extend to 32 bits,
    shift left 16, reinterpret as float. Four 16-wide accumulators (64 columns a step) keep enough
    loads in flight when the weights stream from DRAM (two measured slower); the last len % 64
    columns run one at a time in the same form. Generic vector IR: AVX-512, AVX2 or NEON."""
    sig = types.float32(wr, xj)

    def codegen(context, builder, signature, args):
        w, x = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args))
        f32, vf, _, zero = _vec_consts()
        i16, i32, i64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
        vi16 = ir.VectorType(i16, _VL)
        vi32 = ir.VectorType(i32, _VL)
        shift = ir.Constant(vi32, [16] * _VL)
        n = cgutils.unpack_tuple(builder, x.shape, 1)[0]
        n32 = builder.and_(n, ir.Constant(i64, -_BF16_UNROLL * _VL))
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(_BF16_UNROLL)]
        tail = cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0))

        def widened(k):
            ptr = builder.bitcast(builder.gep(w.data, [k], inbounds=True), vi16.as_pointer())
            bits = builder.shl(builder.zext(builder.load(ptr, align=2), vi32), shift)
            return builder.bitcast(bits, vf)

        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), n32, ir.Constant(i64, _BF16_UNROLL * _VL)) as (k, _):
            for u, acc in enumerate(accs):
                kk = builder.add(k, ir.Constant(i64, u * _VL))
                prod = builder.fmul(widened(kk), _vload(builder, x.data, kk, vf), flags=_FAST)
                builder.store(builder.fadd(builder.load(acc), prod, flags=_FAST), acc)
        with cgutils.for_range_slice(builder, n32, n, ir.Constant(i64, 1)) as (k, _):
            bits = builder.zext(builder.load(builder.gep(w.data, [k], inbounds=True)), i32)
            wv = builder.bitcast(builder.shl(bits, ir.Constant(i32, 16)), f32)
            xv = builder.load(builder.gep(x.data, [k], inbounds=True))
            builder.store(builder.fadd(builder.load(tail), builder.fmul(wv, xv, flags=_FAST), flags=_FAST), tail)
        vsum = builder.load(accs[0])
        for acc in accs[1:]:
            vsum = builder.fadd(vsum, builder.load(acc), flags=_FAST)
        total = _hsum(builder, vsum)
        return builder.fadd(total, builder.load(tail), flags=_FAST)

    return sig, codegen


# --- int8 x int8 with AVX-512 VNNI ------------------------------------------------------------------


@intrinsic
def i8_dot_vnni(typingctx, wr, xq, xf):  # pragma: no cover - compiled
    """sum_g xf[g] * sum_k wr[k] * xq[k] over groups of 64 columns, in integers (VPDPBUSD).

    VPDPBUSD multiplies unsigned by signed bytes, and here both sides are signed, so the weight
    goes in as |w| (unsigned; |-128| = 128 fits) and the activation with w's sign moved onto it
    (select(w < 0, -x, x); the activations are in [-127, 127], so negation cannot overflow), the
    way llama.cpp's q8_0 dot does it. One VPDPBUSD per 64-column group into 16 int32 lanes,
    converted and scaled by the group's activation scale; the row's weight scale is the caller's.
    """
    sig = types.float32(wr, xq, xf)

    def codegen(context, builder, signature, args):
        w, x, xs = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args))
        f32, vf, _, zero = _vec_consts()
        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        vi = ir.VectorType(i32, _VL)
        v64b = ir.VectorType(i8, 64)
        zeros = ir.Constant(v64b, [0] * 64)
        dpbusd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vi, [vi, vi, vi]), "llvm.x86.avx512.vpdpbusd.512"
        )
        row = cgutils.alloca_once_value(builder, zero)

        def load64(data, index):
            ptr = builder.bitcast(builder.gep(data, [index], inbounds=True), v64b.as_pointer())
            return builder.load(ptr, align=1)

        with cgutils.for_range(builder, cgutils.unpack_tuple(builder, xs.shape, 1)[0]) as group:
            g = group.index
            k = builder.mul(g, ir.Constant(i64, 64))
            wv = load64(w.data, k)
            xv = load64(x.data, k)
            negative = builder.icmp_signed("<", wv, zeros)
            w_abs = builder.select(negative, builder.sub(zeros, wv), wv)
            x_signed = builder.select(negative, builder.sub(zeros, xv), xv)
            summed = builder.call(
                dpbusd, [ir.Constant(vi, [0] * _VL), builder.bitcast(w_abs, vi), builder.bitcast(x_signed, vi)]
            )
            scale = _splat(builder, builder.load(builder.gep(xs.data, [g], inbounds=True)), vf)
            scaled = builder.fmul(builder.sitofp(summed, vf), scale, flags=_FAST)
            builder.store(builder.fadd(builder.load(row), scaled, flags=_FAST), row)
        return _hsum(builder, builder.load(row))

    return sig, codegen


@intrinsic
def i8_dot_vnni_g32(typingctx, wr, sr, xq, xf):  # pragma: no cover - compiled
    """sum_g sr[g] * xf[g] * sum_k wr[k] * xq[k] over groups of 32 columns (grouped int8: a Q8_0
    block each), two groups per VPDPBUSD (an odd last group beside a zero one).

    The signs as in i8_dot_vnni (|w| unsigned, w's sign moved onto x). int32 lanes 0-7 sum group
    g and lanes 8-15 group g+1; each lane is scaled by its group's sr * xf, as llama.cpp's q8_0 x
    q8_0 dot scales each block's integer sum by the product of the two block scales."""
    sig = types.float32(wr, sr, xq, xf)

    def codegen(context, builder, signature, args):
        w, sc, x, xs = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args))
        f32, vf, _, zero = _vec_consts()
        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        vi = ir.VectorType(i32, _VL)
        v32b, v64b = ir.VectorType(i8, 32), ir.VectorType(i8, 64)
        zeros = ir.Constant(v64b, [0] * 64)
        concat = ir.Constant(ir.VectorType(i32, 64), list(range(64)))
        lane_group = ir.Constant(vi, [0] * 8 + [16] * 8)
        dpbusd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vi, [vi, vi, vi]), "llvm.x86.avx512.vpdpbusd.512"
        )
        row = cgutils.alloca_once_value(builder, zero)

        def factor(gk):
            return builder.fmul(builder.load(builder.gep(sc.data, [gk], inbounds=True)),
                                builder.load(builder.gep(xs.data, [gk], inbounds=True)), flags=_FAST)

        def accumulate(wv, xv, scales):
            negative = builder.icmp_signed("<", wv, zeros)
            w_abs = builder.select(negative, builder.sub(zeros, wv), wv)
            x_signed = builder.select(negative, builder.sub(zeros, xv), xv)
            summed = builder.call(dpbusd, [ir.Constant(vi, [0] * _VL), builder.bitcast(w_abs, vi),
                                           builder.bitcast(x_signed, vi)])
            scaled = builder.fmul(builder.sitofp(summed, vf), scales, flags=_FAST)
            builder.store(builder.fadd(builder.load(row), scaled, flags=_FAST), row)

        def load(data, index, vt):
            return builder.load(builder.bitcast(builder.gep(data, [index], inbounds=True), vt.as_pointer()), align=1)

        ng = cgutils.unpack_tuple(builder, sc.shape, 1)[0]
        with cgutils.for_range(builder, builder.udiv(ng, ir.Constant(i64, 2))) as pair:
            p = pair.index
            g = builder.add(p, p)
            k = builder.mul(p, ir.Constant(i64, 64))
            scales = builder.shuffle_vector(_splat(builder, factor(g), vf),
                                            _splat(builder, factor(builder.add(g, ir.Constant(i64, 1))), vf), lane_group)
            accumulate(load(w.data, k, v64b), load(x.data, k, v64b), scales)
        with builder.if_then(builder.icmp_unsigned("!=", builder.and_(ng, ir.Constant(i64, 1)), ir.Constant(i64, 0))):
            g = builder.sub(ng, ir.Constant(i64, 1))
            k = builder.mul(g, ir.Constant(i64, 32))
            pad = ir.Constant(v32b, [0] * 32)
            wv = builder.shuffle_vector(load(w.data, k, v32b), pad, concat)
            xv = builder.shuffle_vector(load(x.data, k, v32b), pad, concat)
            accumulate(wv, xv, _splat(builder, factor(g), vf))
        return _hsum(builder, builder.load(row))

    return sig, codegen


@intrinsic
def i8_dot_vnni_g16(typingctx, wr, sr, xq, xf):  # pragma: no cover - compiled
    """i8_dot_vnni_g32 for weight groups of 16 columns (a Q6_K file's sub-blocks) against
    activations in groups of 32 (q8_0 blocks): sum_g sr[g] * xf[g // 2] * sum_k wr[k] * xq[k].
    One VPDPBUSD covers four weight groups (four int32 lanes each) and two activation groups; an
    odd last activation group runs beside a zero one."""
    sig = types.float32(wr, sr, xq, xf)

    def codegen(context, builder, signature, args):
        w, sc, x, xs = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args))
        f32, vf, _, zero = _vec_consts()
        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        vi = ir.VectorType(i32, _VL)
        v4f = ir.VectorType(f32, 4)
        v32b, v64b = ir.VectorType(i8, 32), ir.VectorType(i8, 64)
        zeros = ir.Constant(v64b, [0] * 64)
        concat = ir.Constant(ir.VectorType(i32, 64), list(range(64)))
        quads = ir.Constant(vi, [k // 4 for k in range(16)])  # lane -> its weight group of four
        dpbusd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vi, [vi, vi, vi]), "llvm.x86.avx512.vpdpbusd.512"
        )
        row = cgutils.alloca_once_value(builder, zero)

        def xscale(ga):
            return builder.load(builder.gep(xs.data, [ga], inbounds=True))

        def lane_scales(g, ga, pair):
            """Per-lane sr[g + k // 4] * xf[ga + k // 8] (pair: two activation groups, else one)."""
            xf4 = builder.insert_element(ir.Constant(v4f, ir.Undefined), xscale(ga), ir.Constant(i32, 0))
            xf4 = builder.insert_element(xf4, xscale(ga), ir.Constant(i32, 1))
            second = xscale(builder.add(ga, ir.Constant(i64, 1))) if pair else ir.Constant(f32, 0.0)
            xf4 = builder.insert_element(xf4, second, ir.Constant(i32, 2))
            xf4 = builder.insert_element(xf4, second, ir.Constant(i32, 3))
            if pair:
                sr4 = builder.load(builder.bitcast(builder.gep(sc.data, [g], inbounds=True), v4f.as_pointer()), align=4)
            else:  # two weight groups left: no load past the row's scales
                sr4 = ir.Constant(v4f, [0.0] * 4)
                for k in range(2):
                    v = builder.load(builder.gep(sc.data, [builder.add(g, ir.Constant(i64, k))], inbounds=True))
                    sr4 = builder.insert_element(sr4, v, ir.Constant(i32, k))
            both = builder.fmul(sr4, xf4, flags=_FAST)
            return builder.shuffle_vector(both, ir.Constant(v4f, ir.Undefined), quads)

        def accumulate(wv, xv, scales):
            negative = builder.icmp_signed("<", wv, zeros)
            w_abs = builder.select(negative, builder.sub(zeros, wv), wv)
            x_signed = builder.select(negative, builder.sub(zeros, xv), xv)
            summed = builder.call(dpbusd, [ir.Constant(vi, [0] * _VL), builder.bitcast(w_abs, vi),
                                           builder.bitcast(x_signed, vi)])
            scaled = builder.fmul(builder.sitofp(summed, vf), scales, flags=_FAST)
            builder.store(builder.fadd(builder.load(row), scaled, flags=_FAST), row)

        def load(data, index, vt):
            return builder.load(builder.bitcast(builder.gep(data, [index], inbounds=True), vt.as_pointer()), align=1)

        na = cgutils.unpack_tuple(builder, xs.shape, 1)[0]  # activation groups (of 32)
        with cgutils.for_range(builder, builder.udiv(na, ir.Constant(i64, 2))) as pair:
            p = pair.index
            k = builder.mul(p, ir.Constant(i64, 64))
            scales = lane_scales(builder.mul(p, ir.Constant(i64, 4)), builder.add(p, p), True)
            accumulate(load(w.data, k, v64b), load(x.data, k, v64b), scales)
        with builder.if_then(builder.icmp_unsigned("!=", builder.and_(na, ir.Constant(i64, 1)), ir.Constant(i64, 0))):
            ga = builder.sub(na, ir.Constant(i64, 1))
            k = builder.mul(ga, ir.Constant(i64, 32))
            pad = ir.Constant(v32b, [0] * 32)
            wv = builder.shuffle_vector(load(w.data, k, v32b), pad, concat)
            xv = builder.shuffle_vector(load(x.data, k, v32b), pad, concat)
            accumulate(wv, xv, lane_scales(builder.add(ga, ga), ga, False))
        return _hsum(builder, builder.load(row))

    return sig, codegen


# --- group-32 GEMM rows with VNNI: one weight row against four input rows (prefill) --------------

DOT4_ROWS = 4


def _dot4_codegen(packed: bool):
    """The codegen of i8g_dot4_vnni (packed False) and i4g32_dot4_vnni (packed True)."""

    def codegen(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args)]
        w, sc, xv, xl = arrays[:4]
        xoff = arrays[4] if packed else None
        out = arrays[-1]
        f32, vf, _, zero = _vec_consts()
        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        vi = ir.VectorType(i32, _VL)
        v32b, v64b = ir.VectorType(i8, 32), ir.VectorType(i8, 64)
        concat = ir.Constant(ir.VectorType(i32, 64), list(range(64)))
        lanes = [0] * 4 + [16] * 4 + [0] * 4 + [16] * 4 if packed else [0] * 8 + [16] * 8
        lane_group = ir.Constant(vi, lanes)
        dpbusd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vi, [vi, vi, vi]), "llvm.x86.avx512.vpdpbusd.512"
        )
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(DOT4_ROWS)]
        n_in, lane_n = (cgutils.unpack_tuple(builder, a.shape, 2)[1] for a in (xv, xl))
        pairs = builder.udiv(cgutils.unpack_tuple(builder, sc.shape, 1)[0], ir.Constant(i64, 2))

        def load(data, index, vt, align=1):
            return builder.load(builder.bitcast(builder.gep(data, [index], inbounds=True), vt.as_pointer()), align=align)

        with cgutils.for_range(builder, pairs) as pair:
            p = pair.index
            g = builder.add(p, p)
            if packed:  # 32 bytes: the two groups' low then high nibbles, unsigned
                b = load(w.data, builder.mul(p, ir.Constant(i64, 32)), v32b)
                wv = builder.shuffle_vector(builder.and_(b, ir.Constant(v32b, [15] * 32)),
                                            builder.lshr(b, ir.Constant(v32b, [4] * 32)), concat)
                wi = builder.bitcast(wv, vi)
            else:  # 64 signed bytes; the inputs come offset by +128, so subtract 128 * sum(w)
                wi = builder.bitcast(load(w.data, builder.mul(p, ir.Constant(i64, 64)), v64b), vi)
                corr = builder.call(dpbusd, [ir.Constant(vi, [0] * _VL), ir.Constant(vi, [0x80808080 - (1 << 32)] * _VL), wi])
            wsc = builder.shuffle_vector(
                _splat(builder, builder.load(builder.gep(sc.data, [g], inbounds=True)), vf),
                _splat(builder, builder.load(builder.gep(sc.data, [builder.add(g, ir.Constant(i64, 1))], inbounds=True)), vf),
                lane_group)
            k = builder.mul(p, ir.Constant(i64, 64))
            kl = builder.mul(p, ir.Constant(i64, _VL))
            for j, acc in enumerate(accs):
                row = ir.Constant(i64, j)
                x = builder.bitcast(load(xv.data, builder.add(builder.mul(row, n_in), k), v64b), vi)
                lane = builder.add(builder.mul(row, lane_n), kl)
                if packed:  # nibbles unsigned x inputs signed; the -8 offset per group, in lanes
                    dot = builder.sub(builder.call(dpbusd, [ir.Constant(vi, [0] * _VL), wi, x]),
                                      load(xoff.data, lane, vi, 4))
                else:  # inputs unsigned (+128) x weights signed
                    dot = builder.sub(builder.call(dpbusd, [ir.Constant(vi, [0] * _VL), x, wi]), corr)
                scale = builder.fmul(wsc, load(xl.data, lane, vf, 4), flags=_FAST)
                term = builder.fmul(builder.sitofp(dot, vf), scale, flags=_FAST)
                builder.store(builder.fadd(builder.load(acc), term, flags=_FAST), acc)
        for j, acc in enumerate(accs):
            builder.store(_hsum(builder, builder.load(acc)), builder.gep(out.data, [ir.Constant(i64, j)], inbounds=True))
        return context.get_dummy_value()

    return codegen


@intrinsic
def i8g_dot4_vnni(typingctx, wr, sr, xu, xl, out):  # pragma: no cover - compiled
    """out[j] = sum_g sr[g] * xs[j, g] * sum_k wr[k] * xq[j, k] for four input rows j at once
    (grouped int8: groups of 32, an even number of them), one weight load for four VPDPBUSDs.

    xu holds the rows' int8 codes offset by +128 (uint8 [4, n_in]), so VPDPBUSD takes them as its
    unsigned side and the weights as they are: no per-row sign handling; 128 * sum(w) per lane is
    subtracted once per weight step. xl: each row's scales repeated per int32 lane (fp32 [4,
    n_in / 4]: lanes 0-7 group g, 8-15 group g+1). The same sums as i8_dot_vnni_g32, row by row."""
    return types.void(wr, sr, xu, xl, out), _dot4_codegen(False)


@intrinsic
def i4g32_dot4_vnni(typingctx, wr, sr, xp, xl, xoff, out):  # pragma: no cover - compiled
    """out[j] = sum_g sr[g] * xs[j, g] * sum_k (q[k] - 8) * xq[j, k] for four input rows at once
    (int4 group 32, an even number of groups), the nibbles unpacked once for four VPDPBUSDs.

    xp: the rows' int8 codes permuted per 64 columns into the order i4_dot_vnni_g32 builds its x
    vector in (int8 [4, n_in]); xl: each row's scales per int32 lane (lanes 0-3 and 8-11 group g,
    4-7 and 12-15 group g+1); xoff: int32 [4, n_in / 4], 8 * sum of each group's codes in the
    group's first lane (0 elsewhere): the nibbles' -8 offset, subtracted in integers."""
    return types.void(wr, sr, xp, xl, xoff, out), _dot4_codegen(True)
