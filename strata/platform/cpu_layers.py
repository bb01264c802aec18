"""The layer kinds the CPU decode step runs fused, and the one interface a new kind plugs into.

A layer kind registers, for its module class, a builder

    @fused_layer(MyLayer)
    def my_layer(layer, kv_cache, rows) -> tuple | str:
        ...

that returns the layer's entry `(run, args)` for a decode step of `rows` rows, or a short reason
(str) why this layer cannot run fused (it then runs eagerly, alone: the step's log says which
layer and why). The step calls, for each layer in turn,

    run(x, residual, has_residual, *args, *step)

with numpy fp32 rows: x [rows, hidden] the layer's input (layer 0: the embedding, has_residual
False; later layers: the previous layer's MLP branch and the residual stream), and `step` =
(cos, sin, slots, block tables, context lengths, threads, *scratch buffers, out, res_out); `run`
leaves the layer's MLP branch in `out` and the residual stream in `res_out` (the same
convention as the eager layers' forward(x, residual, ...) -> (mlp, residual)). `run` may be a
numba function (the Llama layer: kernels/cpu_decode_layer.llama_layer) or plain Python; its
arguments are built once per row count and reused every step, so the builder does the checks and
the numpy views. A layer of a class with no builder (an MoE block, say, until it has one) runs
eagerly, with a log line naming its class.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from strata.graph.layers import Linear
from strata.graph.models.llama import DecoderLayer
from strata.kernels import cpu_attention, cpu_decode_layer
from strata.kernels.cpu_decode_layer import NO_ARRAY, uses_vnni

Builder = Callable[[torch.nn.Module, torch.Tensor, int], "tuple | str"]
_BUILDERS: dict[type, Builder] = {}


def fused_layer(cls: type) -> Callable[[Builder], Builder]:
    """Register `builder` as the fused form of layers of exactly class `cls`."""

    def register(builder: Builder) -> Builder:
        _BUILDERS[cls] = builder
        return builder

    return register


def build(layer: torch.nn.Module, kv_cache: torch.Tensor, rows: int) -> tuple | str:
    """The layer's (run, args) for a step of `rows`, or why it runs eagerly."""
    builder = _BUILDERS.get(type(layer))
    if builder is None:
        return f"{type(layer).__name__} has no fused form"
    return builder(layer, kv_cache, rows)


def projection(m) -> tuple[str, np.ndarray, np.ndarray, np.ndarray, int] | None:
    """(format, weight, scale, bias, group) numpy arrays of a projection module, or None when the
    fused kernels have none for it."""
    bias = getattr(m, "bias", None)
    if bias is not None and (bias.dtype is not torch.float32 or not bias.is_contiguous()):
        return None
    b = NO_ARRAY if bias is None else bias.detach().numpy()
    if type(m) is Linear:
        w = m.weight
        if not (w.is_cpu and w.is_contiguous()) or w.requires_grad and torch.is_grad_enabled():
            return None
        if w.dtype is torch.float32:
            return "fp32", w.detach().numpy(), NO_ARRAY, b, 0
        if w.dtype is torch.bfloat16:
            return "bf16", w.detach().view(torch.int16).numpy(), NO_ARRAY, b, 0
        return None
    if getattr(m, "method", None) in ("int8", "int4") and hasattr(m, "kernel_weights"):
        if not m.qweight.is_cpu or getattr(m, "input_perm", None) is not None:  # act order: eager
            return None
        w, s = m.kernel_weights()
        return m.method, w, s, b, m.group_size
    return None


def vnni(p: tuple, rows: int) -> bool:
    """Whether a `projection` runs its int8-activation kernel at `rows` input rows."""
    fmt, w, _, _, group = p
    return uses_vnni(fmt, w.shape[1] * (2 if fmt == "int4" else 1), rows, group)  # int4: 2 a byte


def kv_views(kv_cache: torch.Tensor) -> tuple | None:
    """(K, V) numpy views of one layer's cache tensor (fp32, or a bf16 cache's bit patterns), or None
    when the kernels cannot read it."""
    return cpu_attention.cache_views(kv_cache) if cpu_attention.reads_cache(kv_cache) else None


@fused_layer(DecoderLayer)
def llama_layer(layer: DecoderLayer, kv_cache: torch.Tensor, rows: int) -> tuple | str:
    """Llama, Mistral, Qwen2, Phi-3: norm, qkv (+ bias), rotary + KV write, paged attention, o,
    norm, SwiGLU, down, in one compiled call; fp32, bf16, int8 and int4 projections."""
    attn, mlp = layer.self_attn, layer.mlp
    if attn.q_norm is not None:
        return "q/k norms"
    if attn.rotary_dim is not None:
        return "partial rotary"
    if mlp.act != "silu":
        return f"{mlp.act} MLP"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(n.weight.dtype is not torch.float32 or type(n.eps) is not float for n in norms) or norms[0].eps != norms[1].eps:
        return "norms not plain fp32 with one eps"
    parts = [projection(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(p is None for p in parts):
        return "a projection without a fused kernel (tensor-parallel shard, another weight format, act-order input)"
    (_, wq, sq, bq, gq), (_, wo, so, bo, go), (_, wg, sg, bg, gg), (_, wd, sd, bd, gd) = parts
    if bg.shape[0]:
        return "a gate/up bias (the SwiGLU kernels take none)"
    views = kv_views(kv_cache)
    if views is None:
        return "a KV cache the kernels do not read"
    v = [vnni(p, rows) for p in parts]
    own = (
        norms[0].weight.detach().numpy(), norms[1].weight.detach().numpy(), np.float32(norms[0].eps),
        wq, sq, bq, gq, v[0], wo, so, bo, go, v[1], wg, sg, gg, v[2], wd, sd, bd, gd, v[3],
        attn.heads, attn.kv_heads, np.float32(attn.scale), np.int64(attn.window or 0),
    )
    return cpu_decode_layer.llama_layer, (*views, *own)
