"""Explicit LLVM vector IR for the CPU decode attention's K and V rows (cpu_attention.py).

numba's own loops over a 64-float row (a dot per query head, an axpy per value row) measured ~55
cycles a row dot on the Zen 4, several times what <16 x float> steps take: each cached row is
loaded once per 16 columns and reused for every query head of its KV group. Generic vector IR
(AVX-512, AVX2 or NEON). Import only where numba is available.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from strata.kernels.cpu_simd import _FAST, _VL, _hsum, _splat, _vec_consts, _vload


def _c_f32(*arrays) -> bool:
    return all(isinstance(a, types.Array) and a.dtype == types.float32 and a.layout == "C" for a in arrays)


def _ints(*values) -> bool:
    return all(isinstance(v, types.Integer) for v in values)


def _i64(context, builder, signature, args, i):
    return context.cast(builder, args[i], signature.args[i], types.int64)


@intrinsic
def qk_dots(typingctx, q, q_row, k_cache, k_row, scores, t, scale):  # pragma: no cover - compiled
    """scores[g, t] = scale * (q row q_row + g) . (k_cache row k_row) for g < scores.shape[0].

    Rows count in units of head_dim (the last axis) over the C-contiguous arrays flattened, so a
    KV group's query heads and one cached key row are addressed without building views. The key
    row is loaded once per 16 columns and reused by every query head of the group. head_dim must
    be a multiple of 16 (the caller checks)."""
    if not (_c_f32(q, k_cache, scores) and _ints(q_row, k_row, t) and isinstance(scale, types.Float)):
        return None
    sig = types.none(q, q_row, k_cache, k_row, scores, t, scale)

    def codegen(context, builder, signature, args):
        qa, ka, sa = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 4))
        q_row_v, k_row_v, t_v = (_i64(context, builder, signature, args, i) for i in (1, 3, 5))
        scale_v = context.cast(builder, args[6], signature.args[6], types.float32)
        f32, vf, _, zero = _vec_consts()
        i64 = ir.IntType(64)
        dim = cgutils.unpack_tuple(builder, qa.shape)[-1]
        group, width = cgutils.unpack_tuple(builder, sa.shape, 2)
        k0 = builder.mul(k_row_v, dim)
        with cgutils.for_range(builder, group) as g_loop:
            g = g_loop.index
            q0 = builder.mul(builder.add(q_row_v, g), dim)
            acc = cgutils.alloca_once_value(builder, zero)
            with cgutils.for_range_slice(builder, ir.Constant(i64, 0), dim, ir.Constant(i64, _VL)) as (c, _):
                prod = builder.fmul(_vload(builder, qa.data, builder.add(q0, c), vf),
                                    _vload(builder, ka.data, builder.add(k0, c), vf), flags=_FAST)
                builder.store(builder.fadd(builder.load(acc), prod, flags=_FAST), acc)
            dot = builder.fmul(_hsum(builder, builder.load(acc)), scale_v, flags=_FAST)
            builder.store(dot, builder.gep(sa.data, [builder.add(builder.mul(g, width), t_v)], inbounds=True))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def pv_accumulate(typingctx, scores, t, v_cache, v_row, acc):  # pragma: no cover - compiled
    """acc[g] += scores[g, t] * (v_cache row v_row) for g < acc.shape[0] (rows as in qk_dots); the
    value row is loaded once per 16 columns for every query head. head_dim % 16 == 0."""
    if not (_c_f32(scores, v_cache, acc) and _ints(t, v_row)):
        return None
    sig = types.none(scores, t, v_cache, v_row, acc)

    def codegen(context, builder, signature, args):
        sa, va, aa = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 4))
        t_v, v_row_v = (_i64(context, builder, signature, args, i) for i in (1, 3))
        f32, vf, _, _ = _vec_consts()
        i64 = ir.IntType(64)
        group, dim = cgutils.unpack_tuple(builder, aa.shape, 2)
        width = cgutils.unpack_tuple(builder, sa.shape, 2)[1]
        v0 = builder.mul(v_row_v, dim)
        with cgutils.for_range(builder, group) as g_loop:
            g = g_loop.index
            p = builder.load(builder.gep(sa.data, [builder.add(builder.mul(g, width), t_v)], inbounds=True))
            pv = _splat(builder, p, vf)
            a0 = builder.mul(g, dim)
            with cgutils.for_range_slice(builder, ir.Constant(i64, 0), dim, ir.Constant(i64, _VL)) as (c, _):
                ptr = builder.bitcast(builder.gep(aa.data, [builder.add(a0, c)], inbounds=True), vf.as_pointer())
                prod = builder.fmul(pv, _vload(builder, va.data, builder.add(v0, c), vf), flags=_FAST)
                builder.store(builder.fadd(builder.load(ptr, align=4), prod, flags=_FAST), ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen
