"""Triton kernels for the GPU path, each with a torch reference twin of the same signature.

    paged_attention  paged_decode_attention(q, kv_cache, block_tables, context_lens, scale)
    norm             add_rms_norm(x, residual, weight, eps) -> (out, new_residual)
    activation       silu_and_mul(gate_up) -> silu(gate) * up
    rotary           apply_rotary_qk(q, k, rope) -> (q, k) rotated (rotate-half)
    cache            write_kv(kv_cache, k, v, slots) (in place)

For each op, `op` dispatches (Triton on CUDA tensors when Triton is importable, else the twin),
`op_ref` is the twin (the CPU path and the tests' oracle) and `op_triton` launches the kernel.
Triton is optional (`pip install strata[triton]`); this package imports without it. Importing it
imports triton when present, so kernels/attention/triton_backend.py imports it lazily, only when
the "triton" backend decodes.
"""

from strata.kernels.triton._runtime import available, use_triton
from strata.kernels.triton.activation import silu_and_mul, silu_and_mul_ref, silu_and_mul_triton
from strata.kernels.triton.cache import write_kv, write_kv_ref, write_kv_triton
from strata.kernels.triton.norm import add_rms_norm, add_rms_norm_ref, add_rms_norm_triton
from strata.kernels.triton.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)
from strata.kernels.triton.rotary import (
    apply_rotary_qk,
    apply_rotary_qk_ref,
    apply_rotary_qk_triton,
)

__all__ = [
    "available", "use_triton",
    "paged_decode_attention", "paged_decode_attention_ref", "paged_decode_attention_triton",
    "add_rms_norm", "add_rms_norm_ref", "add_rms_norm_triton",
    "silu_and_mul", "silu_and_mul_ref", "silu_and_mul_triton",
    "apply_rotary_qk", "apply_rotary_qk_ref", "apply_rotary_qk_triton",
    "write_kv", "write_kv_ref", "write_kv_triton",
]
