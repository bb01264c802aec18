"""The CPU decode step with one numba call per decoder layer (kernels/cpu_decode_layer.py).

CausalLM's layer loop asks `FusedDecodeStep.start` once per step; for an all-decode step of at
most MAX_ROWS fp32 rows on CPU with the "cpu" attention backend it returns a step whose `run`
takes a layer through one compiled call, or None (then every layer runs eagerly). A layer runs
fused when it is a plain Llama-shaped DecoderLayer (no q/k norms, full rotary, SiLU MLP without a
gate/up bias) whose four projections are single-device Linear (fp32 or bf16 weights) or
QuantLinear (int8 / int4) modules; anything else (Gemma's sandwich norms, tensor-parallel
layers, GeGLU) runs eagerly in the same step, since both keep the (MLP branch, residual)
convention. The per-layer arguments (numpy views of weights, norms, biases, kernel choice) are
built once and rebuilt when a weight's storage moves. STRATA_FUSED_DECODE=0 turns it off (the
eager per-kernel path, e.g. to compare).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from strata.graph.layers import Linear, RMSNorm
from strata.kernels import cpu_decode_layer, cpu_gemv
from strata.kernels.attention import AttentionMetadata
from strata.kernels.cpu_decode_layer import NO_ARRAY, uses_vnni
from strata.kernels.dispatch import KERNEL_MODE

MAX_ROWS = cpu_decode_layer.MAX_ROWS


def enabled() -> bool:
    return os.environ.get("STRATA_FUSED_DECODE", "") not in ("0", "false", "off")


def _projection(m) -> tuple[str, np.ndarray, np.ndarray, np.ndarray, int] | None:
    """(format, weight, scale, bias, group) numpy arrays of a projection module, or None when the
    fused layer has no kernel for it."""
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
        if not m.qweight.is_cpu:
            return None
        w, s = m.kernel_weights()
        return m.method, w, s, b, m.group_size
    return None


def _tensors(layer) -> tuple:
    """(owning dict, name, tensor, storage address) of every parameter and buffer of `layer`."""
    return tuple((d, name, t, t.data_ptr()) for m in layer.modules() for d in (m._parameters, m._buffers)
                 for name, t in d.items() if t is not None)


def _unchanged(tensors: tuple) -> bool:
    """No parameter or buffer was replaced or given new storage (`.data = ...`) since `_tensors`."""
    return all(d.get(name) is t and t.data_ptr() == ptr for d, name, t, ptr in tensors)


def _layer_args(layer, rows: int) -> tuple | None:
    """The layer's own arguments of cpu_decode_layer._layer, or None when it cannot run fused."""
    if not getattr(type(layer), "one_call_decode", False):  # a Llama-shaped layer class says so
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if attn.q_norm is not None or attn.rotary_dim is not None or mlp.act != "silu":
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(n.weight.dtype is not torch.float32 or type(n.eps) is not float for n in norms):
        return None
    parts = [_projection(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(p is None for p in parts) or norms[0].eps != norms[1].eps:
        return None
    (_, wq, sq, bq, gq), (_, wo, so, bo, go), (_, wg, sg, bg, gg), (_, wd, sd, bd, gd) = parts
    if bg.shape[0]:  # the SwiGLU kernels take no bias
        return None
    vnni = [uses_vnni(fmt, w.shape[1] * (2 if fmt == "int4" else 1), rows, g)  # int4: 2 a byte
            for fmt, w, _, _, g in parts]
    return (
        norms[0].weight.detach().numpy(), norms[1].weight.detach().numpy(), np.float32(norms[0].eps),
        wq, sq, bq, gq, vnni[0], wo, so, bo, go, vnni[1], wg, sg, gg, vnni[2], wd, sd, bd, gd, vnni[3],
        attn.heads, attn.kv_heads, np.float32(attn.scale), np.int64(attn.window or 0),
    )


class FusedDecodeStep:
    """One decode step's shared buffers and arguments; `run` takes one layer through it."""

    def __init__(self, model, rows: int, meta: AttentionMetadata) -> None:
        cfg = model.config
        heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        e = np.float32
        q3, attn3 = np.empty((rows, heads, d), e), np.empty((rows, heads, d), e)
        self.out, self.res_out = np.empty((rows, hidden), e), np.empty((rows, hidden), e)
        self.out_t, self.res_t = torch.from_numpy(self.out), torch.from_numpy(self.res_out)
        self.ropes: dict[int, tuple] = {}  # rotary rows by table (Gemma-style local tables differ)
        self.common = (
            np.ascontiguousarray(meta.slot_mapping.numpy()), meta.decode_block_tables.numpy(),
            meta.decode_context_lens.numpy(), cpu_gemv.sync_threads(),
            np.empty((rows, hidden), e), np.empty((rows, (heads + 2 * kv_heads) * d), e), q3, attn3,
            attn3.reshape(rows, heads * d), np.empty((rows, hidden), e), np.empty((rows, inter), e),
            self.out, self.res_out,
        )
        self.rows = rows

    def _rope_arrays(self, rope) -> tuple:
        key = id(rope[0])
        arrays = self.ropes.get(key)
        if arrays is None:
            cos, sin = rope  # [rows, 1, d] rows of the rotary table: contiguous (index_select)
            arrays = tuple(np.ascontiguousarray(t.numpy().reshape(self.rows, -1)) for t in (cos, sin))
            self.ropes[key] = arrays
        return arrays

    @staticmethod
    def start(model, x: torch.Tensor, meta: AttentionMetadata | None, kv_caches) -> FusedDecodeStep | None:
        if not (
            KERNEL_MODE.get().fast_paths and meta is not None and kv_caches is not None
            and meta.num_prefill_tokens == 0 and meta.decode_block_tables is not None
            and meta.backend.name == "cpu" and cpu_decode_layer.available() and enabled()
            and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype is torch.float32 and x.is_cpu
            and not (torch.is_grad_enabled() and x.requires_grad)
        ):
            return None
        cache = kv_caches[0]
        if cache.dtype is not torch.float32 or not cache.is_cpu:
            return None
        return FusedDecodeStep(model, x.shape[0], meta)

    def final_norm(self, norm, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
        """norm(x + residual) on the step's buffers when the last layer ran fused (else None)."""
        if x is not self.out_t or residual is not self.res_t:
            return None
        args = norm.__dict__.get("_fused_decode_norm")
        if args is None or args[0] is not norm.weight or args[1] != norm.weight.data_ptr():
            args = norm.__dict__["_fused_decode_norm"] = (norm.weight, norm.weight.data_ptr(), _norm_args(norm))
        if args[2] is None:
            return None
        hidden = np.empty_like(self.out)
        cpu_decode_layer.final_norm(self.out, self.res_out, *args[2], hidden)
        return torch.from_numpy(hidden)

    def run_all(self, model, x: torch.Tensor, rope, kv_caches) -> tuple | None:
        """(MLP branch, residual) after every layer in one loop over the compiled layer, or None
        when some layer cannot run fused (then `run` takes them one by one)."""
        layers = _cached_stack(model, kv_caches, self.rows)
        if layers is None:
            return None
        cos, sin = self._rope_arrays(rope)
        cpu_decode_layer.decode_layers(x.contiguous().numpy(), layers, (cos, sin) + self.common)
        return self.out_t, self.res_t

    def run(self, layer, x: torch.Tensor, residual: torch.Tensor | None, rope, kv_cache: torch.Tensor):
        """(MLP branch, residual) of `layer`, or None when this layer must run eagerly."""
        own = _cached_args(layer, self.rows)
        if own is None or not kv_cache.is_contiguous() or kv_cache.dtype is not torch.float32:
            return None
        cos, sin = self._rope_arrays(rope)
        # the previous fused layer's outputs are this step's buffers: no Tensor.numpy() (3 aten ops)
        xn = self.out if x is self.out_t else x.contiguous().numpy()
        has_res = residual is not None
        rn = (self.res_out if residual is self.res_t else residual.contiguous().numpy()) if has_res else xn
        step = (cos, sin) + self.common
        kv = layer.__dict__.get("_fused_decode_kv")
        if kv is None or kv[0] is not kv_cache:  # the engine's per-layer cache tensor: views once
            kv = layer.__dict__["_fused_decode_kv"] = (kv_cache, kv_cache[0].numpy(), kv_cache[1].numpy())
        cpu_decode_layer.decode_layer(xn, rn, has_res, kv[1], kv[2], own, step)
        return self.out_t, self.res_t


def _norm_args(norm) -> tuple | None:
    """(weight, eps) of a plain fp32 RMSNorm (not Gemma's 1 + w), else None."""
    if type(norm) is not RMSNorm or norm.weight.dtype is not torch.float32 or type(norm.eps) is not float:
        return None
    return norm.weight.detach().numpy(), np.float32(norm.eps)


def _cached_args(layer, rows: int) -> tuple | None:
    """_layer_args, cached on the layer per row count until a parameter or buffer moves."""
    cache = layer.__dict__.get("_fused_decode_args")
    if cache is None or not _unchanged(cache[0]):
        cache = (_tensors(layer), {})
        layer.__dict__["_fused_decode_args"] = cache
    by_rows = cache[1]
    if rows not in by_rows:
        by_rows[rows] = _layer_args(layer, rows)
    return by_rows[rows]


def _kv_views(kv_cache: torch.Tensor) -> tuple | None:
    """(K, V) numpy views of one layer's fp32 cache tensor, or None when the kernels cannot read it."""
    if not (kv_cache.is_cpu and kv_cache.is_contiguous() and kv_cache.dtype is torch.float32):
        return None
    return kv_cache[0].numpy(), kv_cache[1].numpy()


def _cached_stack(model, kv_caches, rows: int) -> tuple | None:
    """((own, K, V) of every layer) for a step of `rows`, or None when some layer must run on its
    own; cached on the model and checked once per step (every parameter and buffer of every layer
    in place, the same cache tensors): ~0.15 ms a smol-135m step, where `run`'s per-layer checks,
    argument tuples and calls cost several times that."""
    cache = model.__dict__.get("_fused_decode_stack")
    if (cache is None or len(cache[1]) != len(kv_caches) or not all(a is b for a, b in zip(cache[1], kv_caches))
            or not _unchanged(cache[0])):
        tensors = tuple(t for layer in model.layers for t in _tensors(layer))
        cache = (tensors, tuple(kv_caches), {})
        model.__dict__["_fused_decode_stack"] = cache
    by_rows = cache[2]
    if rows not in by_rows:
        stack = []
        for layer, kv in zip(model.layers, kv_caches):
            own, views = _layer_args(layer, rows), _kv_views(kv)
            if own is None or views is None:
                stack = None
                break
            stack.append((own, *views))
        by_rows[rows] = None if stack is None else tuple(stack)
    return by_rows[rows]
