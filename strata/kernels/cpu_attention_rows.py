"""Explicit LLVM vector IR for the CPU decode attention's K and V rows (cpu_attention.py).

numba's own loops over a 64-float row (a dot per query head, an axpy per value row) measured ~55
cycles a row dot on the Zen 4, several times what <16 x float> steps take. Each call covers every
key of a sequence part: keys in passes of 16 (all KV heads of a pass before the next), scores
of 16 keys reduced together, output rows held in registers while value rows go by. Generic vector
IR (AVX-512, AVX2 or NEON). The cache is fp32, bf16 bits or int8 with a scale per row (kv_cache_dtype). Import only where numba is available.
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


def _reduce16(builder, vecs):
    """16 <16 x float> vectors -> one whose lane i is the sum of vecs[i]'s lanes (transpose-add:
    15 shuffle pairs and adds for 16 dots, where a horizontal sum each costs ~8 ops a dot)."""
    i32 = ir.IntType(32)
    level = list(vecs)
    keys = 1  # keys per vector; each key's partial sums fill a run of 16 // keys lanes
    while len(level) > 1:
        run = _VL // keys
        lo = [j * run + i for j in range(keys) for i in range(run // 2)]
        hi = [x + run // 2 for x in lo]
        lo_mask = ir.Constant(ir.VectorType(i32, _VL), lo + [_VL + x for x in lo])
        hi_mask = ir.Constant(ir.VectorType(i32, _VL), hi + [_VL + x for x in hi])
        level = [
            builder.fadd(builder.shuffle_vector(a, b, lo_mask), builder.shuffle_vector(a, b, hi_mask), flags=_FAST)
            for a, b in zip(level[0::2], level[1::2])
        ]
        keys *= 2
    return level[0]


def _c_i64(a) -> bool:
    return isinstance(a, types.Array) and a.dtype == types.int64 and a.layout == "C" and a.ndim == 1


_AHEAD = 1  # prefetch distance in passes: 2 and 4 measured no better on the Zen 4 dev VM
# keys per pass: all KV heads of these keys are read before the next keys (one cache block's rows,
# contiguous), and a pass's value rows stay in L1 while every query head uses them
_BLOCK_KEYS = 16


def _prefetch(builder, data, index):
    """Hint the cache line holding data[index] into every cache level (read)."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0"
    )
    ptr = builder.bitcast(builder.gep(data, [index], inbounds=True), i8p)
    builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])


def _prefetch_keys(builder, data, rows_data, t0, n, stride, row_floats, line):
    """Prefetch the cache rows (every KV head: `row_floats` elements from each key's head-0 row,
    `stride` elements a row, `line` per cache line) of the _BLOCK_KEYS keys of the next pass.
    64 sequences x 400 keys of smol-135m (39 MB, one layer, from DRAM) measured ~12 GB/s without
    it and ~15 with it on the Zen 4 dev VM; a plain numba read of the same scattered blocks 17-22."""
    i64 = ir.IntType(64)
    start = builder.add(t0, ir.Constant(i64, _BLOCK_KEYS * _AHEAD))
    stop = builder.select(builder.icmp_signed("<", builder.add(start, ir.Constant(i64, _BLOCK_KEYS)), n),
                          builder.add(start, ir.Constant(i64, _BLOCK_KEYS)), n)
    with cgutils.for_range_slice(builder, start, stop, ir.Constant(i64, 1)) as (t, _):
        first = builder.mul(builder.load(builder.gep(rows_data, [t], inbounds=True)), stride)
        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), row_floats, ir.Constant(i64, line)) as (c, _):
            _prefetch(builder, data, builder.add(first, c))


def _cache_array(a) -> bool:
    """A KV cache view the row loops read: fp32, bf16 bit patterns as uint16, or int8 rows with
    their fp32 scale after head_dim values (kv_cache_dtype; kernels/kv_quant.py)."""
    return isinstance(a, types.Array) and a.layout == "C" and a.dtype in (types.float32, types.uint16, types.int8)


def _row_loader(cache_type):
    """load(builder, data, index, vf) -> 16 cached floats from `index`: straight for an fp32 cache,
    widened exactly for bf16 bits (a bf16 is the top half of an fp32: zero-extend, shift by 16),
    converted for int8 (the row's scale is applied to the dot or the weight: _scale_loader)."""
    if cache_type.dtype == types.float32:
        return _vload
    if cache_type.dtype == types.int8:
        vi8 = ir.VectorType(ir.IntType(8), _VL)

        def load_int8(builder, data, index, vf):
            ptr = builder.bitcast(builder.gep(data, [index], inbounds=True), vi8.as_pointer())
            return builder.sitofp(builder.load(ptr, align=1), vf)

        return load_int8
    vi16, vi32 = ir.VectorType(ir.IntType(16), _VL), ir.VectorType(ir.IntType(32), _VL)

    def load_bf16(builder, data, index, vf):
        ptr = builder.bitcast(builder.gep(data, [index], inbounds=True), vi16.as_pointer())
        bits = builder.shl(builder.zext(builder.load(ptr, align=2), vi32), ir.Constant(vi32, [16] * _VL))
        return builder.bitcast(bits, vf)

    return load_bf16


def _line(cache_type) -> int:
    """Elements of the cache per 64-byte cache line."""
    return 512 // cache_type.dtype.bitwidth


def _scale_loader(cache_type):
    """None for an unscaled cache; for int8, load(builder, data, index) -> the fp32 scale stored
    (unaligned) at element `index`: a row's scale follows its head_dim values."""
    if cache_type.dtype != types.int8:
        return None

    def load_scale(builder, data, index):
        ptr = builder.bitcast(builder.gep(data, [index], inbounds=True), ir.FloatType().as_pointer())
        return builder.load(ptr, align=1)

    return load_scale


def _c_f32_3d(a) -> bool:
    return _c_f32(a) and a.ndim == 3


@intrinsic
def qk_scores(typingctx, q, q_row, k_cache, rows, scores, scale):  # pragma: no cover - compiled
    """scores[h, g, t] = scale * (q row q_row + h * G + g) . (k_cache row rows[t] + h) for every KV
    head h, query head g < G of its group and key t < n (scores [kv_heads, G, n]; rows count in
    units of head_dim over the C-contiguous arrays flattened, rows[t] is key t's row for head 0).

    Keys go 16 at a time, every KV head of them before the next 16 (their rows are contiguous in
    the cache); per query head one accumulator per key over head_dim in 16-float steps (the query
    chunk loaded once for the 16 keys), then one transpose-add turns the 16 accumulators into 16
    scores. The last n % 16 keys take a horizontal sum each. head_dim % 16 == 0 (caller checks).
    An int8 cache's rows are head_dim + 4 elements apart (the fp32 scale last): each key's dot is
    taken over its int8 values converted in registers, then times its scale."""
    if not (_c_f32(q) and _cache_array(k_cache) and _c_f32_3d(scores) and _c_i64(rows) and _ints(q_row)
            and isinstance(scale, types.Float)):
        return None
    sig = types.none(q, q_row, k_cache, rows, scores, scale)

    def codegen(context, builder, signature, args):
        qa, ka, ra, sa = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 3, 4))
        load_k, load_scale = _row_loader(signature.args[2]), _scale_loader(signature.args[2])
        q_row_v = _i64(context, builder, signature, args, 1)
        scale_s = context.cast(builder, args[5], signature.args[5], types.float32)
        f32, vf, _, zero = _vec_consts()
        scale_v = _splat(builder, scale_s, vf)
        i64 = ir.IntType(64)
        c0, c1, c16 = ir.Constant(i64, 0), ir.Constant(i64, 1), ir.Constant(i64, _VL)
        dim = cgutils.unpack_tuple(builder, qa.shape)[-1]
        stride = cgutils.unpack_tuple(builder, ka.shape)[-1]  # a cache row: dim, or dim + 4 (int8)
        kv_heads, group, n = cgutils.unpack_tuple(builder, sa.shape, 3)
        n16 = builder.and_(n, ir.Constant(i64, -_VL))
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(_VL)]

        def key_base(t, h):
            row = builder.load(builder.gep(ra.data, [t], inbounds=True))
            return builder.mul(builder.add(row, h), stride)

        def q_base(h, g):
            return builder.mul(builder.add(q_row_v, builder.add(builder.mul(h, group), g)), dim)

        def score_index(h, g, t):
            return builder.add(builder.mul(builder.add(builder.mul(h, group), g), n), t)

        row_floats = builder.mul(kv_heads, stride)
        with cgutils.for_range_slice(builder, c0, n16, c16) as (t0, _):
            _prefetch_keys(builder, ka.data, ra.data, t0, n, stride, row_floats, _line(signature.args[2]))
            with cgutils.for_range(builder, kv_heads) as h_loop:
                h = h_loop.index
                bases = [key_base(builder.add(t0, ir.Constant(i64, i)), h) for i in range(_VL)]
                key_scale = scale_v
                if load_scale is not None:  # the 16 keys' scales, once for every query head of the group
                    key_scale = zero
                    for i, base in enumerate(bases):
                        key_scale = builder.insert_element(
                            key_scale, load_scale(builder, ka.data, builder.add(base, dim)), ir.Constant(i64, i))
                    key_scale = builder.fmul(key_scale, scale_v, flags=_FAST)
                with cgutils.for_range(builder, group) as g_loop:
                    g = g_loop.index
                    q0 = q_base(h, g)
                    for acc in accs:
                        builder.store(zero, acc)
                    with cgutils.for_range_slice(builder, c0, dim, c16) as (c, _):
                        qv = _vload(builder, qa.data, builder.add(q0, c), vf)
                        for base, acc in zip(bases, accs):
                            prod = builder.fmul(qv, load_k(builder, ka.data, builder.add(base, c), vf), flags=_FAST)
                            builder.store(builder.fadd(builder.load(acc), prod, flags=_FAST), acc)
                    dots = builder.fmul(_reduce16(builder, [builder.load(a) for a in accs]), key_scale, flags=_FAST)
                    out = builder.gep(sa.data, [score_index(h, g, t0)], inbounds=True)
                    builder.store(dots, builder.bitcast(out, vf.as_pointer()), align=4)
        with cgutils.for_range_slice(builder, n16, n, c1) as (t, _):
            with cgutils.for_range(builder, kv_heads) as h_loop:
                h = h_loop.index
                base = key_base(t, h)
                key_scale = scale_s
                if load_scale is not None:
                    key_scale = builder.fmul(load_scale(builder, ka.data, builder.add(base, dim)), scale_s, flags=_FAST)
                with cgutils.for_range(builder, group) as g_loop:
                    g = g_loop.index
                    q0 = q_base(h, g)
                    builder.store(zero, accs[0])
                    with cgutils.for_range_slice(builder, c0, dim, c16) as (c, _):
                        prod = builder.fmul(_vload(builder, qa.data, builder.add(q0, c), vf),
                                            load_k(builder, ka.data, builder.add(base, c), vf), flags=_FAST)
                        builder.store(builder.fadd(builder.load(accs[0]), prod, flags=_FAST), accs[0])
                    dot = builder.fmul(_hsum(builder, builder.load(accs[0])), key_scale, flags=_FAST)
                    builder.store(dot, builder.gep(sa.data, [score_index(h, g, t)], inbounds=True))
        return context.get_dummy_value()

    return sig, codegen


_PV_UNROLL = 4  # 16-float chunks of an output row held in registers while a pass's keys go by


@intrinsic
def pv_rows(typingctx, scores, v_cache, rows, acc):  # pragma: no cover - compiled
    """acc[h, g] += sum_t scores[h, g, t] * (v_cache row rows[t] + h) for every KV head h, query
    head g < G and key t < n (scores [kv_heads, G, n], acc [kv_heads, G, head_dim]; rows as in
    qk_scores). Keys go _BLOCK_KEYS at a time, every head of them before the next keys; per
    query head, 64 columns of acc stay in registers while the pass's value rows go by (then the
    next 64; a 16-column step for the rest). head_dim % 16 == 0 (caller checks). An int8 cache's
    value rows (head_dim + 4 apart) are converted in registers, their scale folded into the weight."""
    if not (_cache_array(v_cache) and _c_f32_3d(scores) and _c_f32_3d(acc) and _c_i64(rows)):
        return None
    sig = types.none(scores, v_cache, rows, acc)

    def codegen(context, builder, signature, args):
        sa, va, ra, aa = (context.make_array(signature.args[i])(context, builder, args[i]) for i in range(4))
        load_v, load_scale = _row_loader(signature.args[1]), _scale_loader(signature.args[1])
        f32, vf, _, zero = _vec_consts()
        i64 = ir.IntType(64)
        c0, c1 = ir.Constant(i64, 0), ir.Constant(i64, 1)
        kv_heads, group, n = cgutils.unpack_tuple(builder, sa.shape, 3)
        dim = cgutils.unpack_tuple(builder, aa.shape, 3)[2]
        stride = cgutils.unpack_tuple(builder, va.shape)[-1]  # a cache row: dim, or dim + 4 (int8)
        wide = _PV_UNROLL * _VL
        dim_wide = builder.and_(dim, ir.Constant(i64, -wide))
        regs = [cgutils.alloca_once_value(builder, zero) for _ in range(_PV_UNROLL)]
        block = ir.Constant(i64, _BLOCK_KEYS)

        def accumulate(a0, s0, h, c, t0, t1, chunks):
            ptrs = [builder.bitcast(builder.gep(aa.data, [builder.add(a0, ir.Constant(i64, u * _VL))], inbounds=True),
                                    vf.as_pointer()) for u in range(chunks)]
            for ptr, reg in zip(ptrs, regs):
                builder.store(builder.load(ptr, align=4), reg)
            with cgutils.for_range_slice(builder, t0, t1, c1) as (t, _):
                p = builder.load(builder.gep(sa.data, [builder.add(s0, t)], inbounds=True))
                row_start = builder.mul(builder.add(builder.load(builder.gep(ra.data, [t], inbounds=True)), h), stride)
                if load_scale is not None:
                    p = builder.fmul(p, load_scale(builder, va.data, builder.add(row_start, dim)), flags=_FAST)
                p = _splat(builder, p, vf)
                base = builder.add(row_start, c)
                for u, reg in enumerate(regs[:chunks]):
                    v = load_v(builder, va.data, builder.add(base, ir.Constant(i64, u * _VL)), vf)
                    builder.store(builder.fadd(builder.load(reg), builder.fmul(p, v, flags=_FAST), flags=_FAST), reg)
            for ptr, reg in zip(ptrs, regs):
                builder.store(builder.load(reg), ptr, align=4)

        with cgutils.for_range_slice(builder, c0, n, block) as (t0, _):
            t1 = builder.select(builder.icmp_signed("<", builder.add(t0, block), n), builder.add(t0, block), n)
            _prefetch_keys(builder, va.data, ra.data, t0, n, stride, builder.mul(kv_heads, stride),
                           _line(signature.args[1]))
            with cgutils.for_range(builder, kv_heads) as h_loop:
                h = h_loop.index
                with cgutils.for_range(builder, group) as g_loop:
                    hg = builder.add(builder.mul(h, group), g_loop.index)
                    row0, s0 = builder.mul(hg, dim), builder.mul(hg, n)
                    with cgutils.for_range_slice(builder, c0, dim_wide, ir.Constant(i64, wide)) as (c, _):
                        accumulate(builder.add(row0, c), s0, h, c, t0, t1, _PV_UNROLL)
                    with cgutils.for_range_slice(builder, dim_wide, dim, ir.Constant(i64, _VL)) as (c, _):
                        accumulate(builder.add(row0, c), s0, h, c, t0, t1, 1)
        return context.get_dummy_value()

    return sig, codegen
