"""The fused ops the FX passes of graph/fusion.py rewrite to, and the kernel wrappers of the captured step.

Each is a `torch.library.custom_op` in the "strata" namespace. Its default implementation is the
torch reference (`*_ref`, the test oracle), except add_rms_norm, which runs the numba kernel of
kernels/cpu_norm.py where it applies (few fp32 CPU rows), exactly as the eager model does. GPU
kernels plug in through `register_gpu_kernels()`, which registers the Triton functions of
`strata.kernels.triton` (when importable) as the ops' CUDA kernels.

More ops make the kernels that the compiled decode step calls opaque to torch.compile
(graph/capture_passes.py): strata::linear (kernels/linear.py dispatch: the numba GEMV on CPU),
strata::paged_decode (decode attention over the paged cache by the backend its `backend` string
names, looked up in kernels/attention/registry.py: op schemas take primitives, not the backend
object; the Triton kernel on CUDA when registered), and on CPU the eager step's two other
hand-fused kernels, strata::linear_swiglu (GEMV with SwiGLU epilogue) and strata::rope_store
(rotary + KV write).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from strata.graph.layers import apply_rotary
from strata.kernels import attention as attn
from strata.kernels import ops
from strata.kernels.linear import linear as dispatch
from strata.kernels.linear import swiglu

logger = logging.getLogger(__name__)


def add_rms_norm_ref(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual): graph.layers.RMSNorm's torch path, op for op."""
    h = x + residual
    if h.dtype == torch.float32:
        return F.rms_norm(h, (h.shape[-1],), weight, eps), h
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hf.to(h.dtype), h


def silu_mul_ref(gate_up: Tensor) -> Tensor:
    """SiLU(gate) * up for gate_up = [..., 2I] = [gate | up]: graph.layers.GatedMLP's torch path."""
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]


def rotary_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return apply_rotary(x, (cos, sin))


def rotary_qk_ref(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return apply_rotary(q, (cos, sin)), apply_rotary(k, (cos, sin))


def kv_write_ref(kv_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor) -> None:
    attn.write_kv(kv_cache, k, v, slots)


@torch.library.custom_op("strata::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Residual add + RMSNorm: (normed, x + residual)."""
    fast = ops.add_rms_norm(x, residual, weight, eps)  # the eager model's CPU kernel for few fp32 rows
    if fast is not None:
        return fast
    return add_rms_norm_ref(x, residual, weight, eps)


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("strata::silu_mul", mutates_args=())
def silu_mul(gate_up: Tensor) -> Tensor:
    """SiLU(gate) * up of the fused gate/up projection [..., 2I] -> [..., I]."""
    return silu_mul_ref(gate_up)


@silu_mul.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.custom_op("strata::rotary_qk", mutates_args=())
def rotary_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate-half rotary of q [T, h, d] and k [T, kvh, d] with cos/sin [T, 1, d], in one op."""
    return rotary_qk_ref(q, k, cos, sin)


@rotary_qk.register_fake
def _(q, k, cos, sin):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)


@torch.library.custom_op("strata::kv_write", mutates_args=("kv_cache",))
def kv_write(kv_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor) -> None:
    """Store k and v [T, kvh, d] at their flat slots of the paged cache [2, blocks, bs, kvh, d]."""
    kv_write_ref(kv_cache, k, v, slots)


@kv_write.register_fake
def _(kv_cache, k, v, slots):
    return None


# The two kernel wrappers that make a captured step opaque to dynamo are declared with the
# lower-level torch.library API: a call costs ~5 us of dispatch here against ~9 us for a
# torch.library.custom_op (measured, inference mode), and there are 8 such calls per layer.
_KERNELS = torch.library.Library("strata", "FRAGMENT")  # kept alive: it owns the registrations
_KERNELS.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_KERNELS.define(
    "paged_decode(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor context_lens, Tensor? mask, "
    "float scale, str backend) -> Tensor"
)
_KERNELS.define("linear_swiglu(Tensor x, Tensor gate_up_weight) -> Tensor")
_KERNELS.define(
    "rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) kv_cache, Tensor slots, int heads, "
    "int kv_heads) -> Tensor"
)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """strata::linear: x @ weight.T (+ bias) through kernels/linear.py (numba GEMV, few fp32 CPU rows)."""
    return dispatch(x, weight, bias)


def paged_decode(
    q: Tensor, kv_cache: Tensor, block_tables: Tensor, context_lens: Tensor, mask: Tensor | None,
    scale: float, backend: str,
) -> Tensor:
    """strata::paged_decode: decode attention of q [B, heads, d] over the paged cache -> [B, heads * d],
    by the attention backend registered under the name `backend`."""
    return attn.get_backend(backend).decode(q, kv_cache, block_tables, context_lens, mask, scale)


def linear_swiglu(x: Tensor, gate_up_weight: Tensor) -> Tensor:
    """strata::linear_swiglu: silu(x @ gate.T) * (x @ up.T) for a [gate; up] weight (no bias): the
    numba GEMV with its SwiGLU epilogue for few CPU rows (fp32 or bf16 weights), else linear then
    silu_mul_ref."""

    fused = swiglu(x, gate_up_weight)
    return fused if fused is not None else silu_mul_ref(dispatch(x, gate_up_weight, None))


def rope_store(qkv: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, slots: Tensor, heads: int, kv_heads: int) -> Tensor:
    """strata::rope_store: rotate q and k of the fused qkv rows [T, (h + 2 kvh) * d], store k and v at
    `slots`, return rotated q [T, h, d]: the numba kernel of kernels/cpu_rope.py for few fp32 CPU
    rows, else rotary_qk_ref + write_kv."""
    fast = ops.rope_and_store(qkv, (cos, sin), slots, kv_cache, heads, kv_heads)
    if fast is not None:
        return fast
    dim = cos.shape[-1]
    rows = qkv.view(*qkv.shape[:-1], heads + 2 * kv_heads, dim)
    q, k = rotary_qk_ref(rows[..., :heads, :], rows[..., heads : heads + kv_heads, :], cos, sin)
    attn.write_kv(kv_cache, k, rows[..., heads + kv_heads :, :], slots)
    return q


_KERNELS.impl("linear", linear, "CompositeExplicitAutograd")
_KERNELS.impl("paged_decode", paged_decode, "CompositeExplicitAutograd")
_KERNELS.impl("linear_swiglu", linear_swiglu, "CompositeExplicitAutograd")
_KERNELS.impl("rope_store", rope_store, "CompositeExplicitAutograd")


@torch.library.register_fake("strata::linear")
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.register_fake("strata::paged_decode")
def _(q, kv_cache, block_tables, context_lens, mask, scale, backend):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


@torch.library.register_fake("strata::linear_swiglu")
def _(x, gate_up_weight):
    return x.new_empty(*x.shape[:-1], gate_up_weight.shape[0] // 2)


@torch.library.register_fake("strata::rope_store")
def _(qkv, cos, sin, kv_cache, slots, heads, kv_heads):
    return qkv.new_empty(*qkv.shape[:-1], heads, cos.shape[-1])


OPS = {"add_rms_norm": add_rms_norm, "silu_mul": silu_mul, "rotary_qk": rotary_qk, "kv_write": kv_write}


def _triton_kernels(tk) -> dict[str, Callable]:
    """The ops' CUDA kernels from strata.kernels.triton (whose functions take the same tensors)."""
    return {
        "add_rms_norm": lambda x, residual, weight, eps: tk.add_rms_norm(x, residual, weight, eps),
        "silu_mul": lambda gate_up: tk.silu_and_mul(gate_up),
        "rotary_qk": lambda q, k, cos, sin: tk.apply_rotary_qk(q, k, (cos, sin)),
        "kv_write": lambda kv_cache, k, v, slots: tk.write_kv(kv_cache, k, v, slots),
        "paged_decode": lambda q, kv_cache, block_tables, context_lens, mask, scale, backend: (
            tk.paged_decode_attention(q, kv_cache, block_tables, context_lens, scale)
        ),
    }


def register_gpu_kernels() -> list[str]:
    """Register the Triton kernels of strata.kernels.triton as the fused ops' CUDA kernels.

    This is the one place a GPU implementation plugs in (torch.library's per-device kernel
    registration): without triton, or without that package, every op runs its torch reference
    on CUDA too. Returns the names registered.
    """
    try:
        from strata.kernels import (
            triton as tk,  # reason: optional GPU kernels (triton need not be installed)
        )
    except ImportError as e:
        logger.debug("no strata.kernels.triton (%s); the fused ops run their torch references on CUDA", e)
        return []
    if not tk.available():
        return []
    done = []
    for name, fn in _triton_kernels(tk).items():
        if name in OPS:
            OPS[name].register_kernel("cuda")(fn)
        else:
            _KERNELS.impl(name, fn, "CUDA")
        done.append(name)
    logger.info("fused ops: Triton CUDA kernels registered for %s", ", ".join(done))
    return done
