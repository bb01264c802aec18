"""Attention over the paged KV cache: prefill chunks and decodes, behind one backend interface.

    common.py        PrefillSpan, write_kv, gather_kv, the attention math (reference and SDPA)
    base.py          AttentionBackend: the interface every backend implements
    torch_backend.py "torch": explicit matmul + softmax in fp32 (the reference)
    sdpa_backend.py  "sdpa": torch.nn.functional.scaled_dot_product_attention
    cpu_backend.py   "cpu": numba paged decode (kernels/cpu_attention.py) + fused rotary/KV write
    triton_backend.py "triton": the split-K Triton decode kernel on CUDA (imported only when used)
    registry.py      name -> backend; select_backend(choice, device, dtype) (the engine's rules)
    metadata.py      AttentionMetadata (its `backend` is the step's AttentionBackend)
    paged.py         the step: write_kv, then the leaf `attend_cached`; paged_attention = both

KV cache per layer: a tensor [2, num_blocks, block_size, num_kv_heads, head_dim]. Tokens of a
step arrive flattened ([T, heads, head_dim]): prefill chunks first, then one token per decode.
"""

from strata.kernels.attention.base import AttentionBackend
from strata.kernels.attention.common import (
    PrefillSpan,
    gather_kv,
    reference_attend,
    sdpa_attend,
    write_kv,
)
from strata.kernels.attention.metadata import AttentionMetadata
from strata.kernels.attention.paged import (
    attend_cached,
    decode_attention,
    fused_decode_attention,
    fused_decode_usable,
    paged_attention,
    triton_usable,
)
from strata.kernels.attention.registry import BACKENDS, get_backend, resolve_backend, select_backend

__all__ = [
    "AttentionBackend", "AttentionMetadata", "PrefillSpan", "BACKENDS",
    "get_backend", "resolve_backend", "select_backend",
    "write_kv", "gather_kv", "reference_attend", "sdpa_attend",
    "attend_cached", "decode_attention", "paged_attention", "fused_decode_usable", "fused_decode_attention",
    "triton_usable",
]
