"""Every Triton kernel compiles for a Hopper GPU (sm_90), on this machine, without a GPU.

The interpreter runs kernels as numpy and does not type-check them as the compiler does (loop
bounds of mixed int types, pointers that differ between branches, layouts that do not exist), so
each kernel is also taken through Triton's real pipeline, down to a cubin with the bundled ptxas.
Uses triton.compile with an ASTSource (a lower-level API than launching, stable across 3.3+).
"""

from __future__ import annotations

import inspect
import os

import pytest

pytest.importorskip("triton.language")

import triton  # noqa: E402

from strata.kernels.triton import activation, cache, norm, paged_attention, rotary  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1: the kernels are interpreted, not compiled", allow_module_level=True)
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    _params = inspect.signature(ASTSource).parameters
    if "constexprs" not in _params:
        raise ImportError("ASTSource without constexprs (triton < 3.3)")
except ImportError as e:
    pytest.skip(f"this triton's compile API differs: {e}", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")  # triton 3.9's notice
HOPPER = GPUTarget("cuda", 90, 32)
B16 = "*bf16"
I32 = "i32"


def _compile(kernel, types: dict, consts: dict, num_warps: int = 4):
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: ("constexpr" if n in consts else types[n]) for n in names}
    constexprs = {(i,): consts[n] for i, n in enumerate(names) if n in consts}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=HOPPER, options={"num_warps": num_warps})
    assert compiled.asm.get("cubin"), "no cubin"


def _decode_types(dt: str) -> dict:
    p = "*" + dt
    return dict(q_ptr=p, k_ptr=p, v_ptr=p, tables_ptr="*i64", lens_ptr="*i64", out_ptr=p,
                part_acc_ptr="*fp32", part_ml_ptr="*fp32", scale_log2="fp32",
                stride_qb=I32, stride_qh=I32, stride_kblk=I32, stride_ktok=I32, stride_kh=I32,
                stride_tb=I32, stride_ob=I32, stride_oh=I32)


@pytest.mark.parametrize(
    "dt, group, group_p, dim, dim_p, block_n, splits",
    [("bf16", 7, 8, 64, 64, 8, 1), ("bf16", 7, 8, 64, 64, 8, 4), ("fp32", 1, 1, 80, 128, 16, 1),
     ("fp16", 3, 4, 64, 64, 8, 2)],
)
def test_paged_decode_compiles(dt, group, group_p, dim, dim_p, block_n, splits):
    _compile(paged_attention._decode_kernel, _decode_types(dt),
             dict(GROUP=group, GROUP_P=group_p, HEAD_DIM=dim, DIM_P=dim_p, BLOCK_SIZE=16,
                  BLOCK_N=block_n, PARTITION=256, NUM_SPLITS=splits))
    if splits > 1:
        _compile(paged_attention._merge_kernel,
                 dict(part_acc_ptr="*fp32", part_ml_ptr="*fp32", out_ptr="*" + dt, stride_ob=I32, stride_oh=I32),
                 dict(HEAD_DIM=dim, DIM_P=dim_p, NUM_SPLITS=splits, SPLITS_P=triton.next_power_of_2(splits)))


@pytest.mark.parametrize("residual", [True, False])
def test_norm_compiles(residual):
    _compile(norm._add_rms_norm_kernel,
             dict(x_ptr=B16, res_ptr=B16, w_ptr=B16, out_ptr=B16, res_out_ptr=B16, eps="fp32", n_cols=I32,
                  stride_x=I32, stride_res=I32, stride_out=I32, stride_res_out=I32),
             dict(HAS_RESIDUAL=residual, ROUND_BEFORE_WEIGHT=True, BLOCK=1024))


def test_silu_rotary_write_kv_compile():
    _compile(activation._silu_and_mul_kernel,
             dict(x_ptr=B16, out_ptr=B16, inter=I32, stride_x=I32, stride_out=I32), dict(BLOCK=1024))
    _compile(rotary._rotary_kernel,
             dict(q_ptr=B16, k_ptr=B16, cos_ptr=B16, sin_ptr=B16, q_out_ptr=B16, k_out_ptr=B16,
                  stride_qt=I32, stride_qh=I32, stride_kt=I32, stride_kh=I32, stride_ct=I32, stride_st=I32),
             dict(NUM_Q_HEADS=14, NUM_KV_HEADS=2, HALF=32, HALF_P=32), num_warps=1)
    _compile(cache._write_kv_kernel,
             dict(k_ptr=B16, v_ptr=B16, slots_ptr="*i64", k_cache_ptr=B16, v_cache_ptr=B16,
                  stride_kt=I32, stride_kh=I32, stride_vt=I32, stride_vh=I32,
                  stride_cblk=I32, stride_ctok=I32, stride_ch=I32),
             dict(BLOCK_SIZE=16, KV_HEADS=3, HEADS_P=4, HEAD_DIM=64, DIM_P=64), num_warps=1)
