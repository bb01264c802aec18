"""The CPU decode step with its decoder layers in one loop over one compiled layer
(kernels/cpu_decode_layer.py).

CausalLM's forward asks `FusedDecodeStep.start` once per step; for an all-decode step of at most
MAX_ROWS fp32 rows on CPU with the "cpu" attention backend and one rotary table, it returns a
step whose `run` takes every layer through `cpu_decode_layer.decode_layers`, or None. The layers
run fused only when every one is a plain Llama-shaped DecoderLayer (no q/k norms, full rotary,
SiLU MLP without a gate/up bias) whose four projections are single-device Linear (fp32 or bf16
weights) or QuantLinear (int8 / int4) modules; otherwise (Gemma 3, Qwen3's q/k norms, Phi-4-mini's
partial rotary, tensor-parallel shards, GeGLU) every layer runs eagerly. The layers' arguments
(numpy views of weights, norms, biases, KV caches, kernel choice) are built once per model and row
count, and rebuilt when a parameter or buffer is replaced or moved or the caches change: the caches
checked every step, the parameters and buffers on the first step after a request was added
(`recheck_weights`), never per layer. The final norm and the LM head then run in one more compiled
call (`finish`; CausalLM.compute_logits takes its logits), unless the head has no kernel here
(a vocabulary-parallel head runs eagerly). STRATA_FUSED_DECODE=0 turns it off (the eager per-kernel path,
e.g. to compare).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import numpy as np
import torch

from strata.env_switch import switched_off
from strata.graph.layers import Linear, RMSNorm
from strata.kernels import cpu_attention, cpu_decode_layer, cpu_gemv, cpu_quant, cpu_rope
from strata.kernels.attention import AttentionMetadata
from strata.kernels.cpu_decode_layer import NO_ARRAY, uses_vnni
from strata.kernels.dispatch import KERNEL_MODE

MAX_ROWS = cpu_decode_layer.MAX_ROWS


def enabled() -> bool:
    return not switched_off("STRATA_FUSED_DECODE")


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


class _Snapshot:
    """Every parameter and buffer of some modules, as (owning dict, name, tensor, storage address),
    kept column-wise so `unchanged` runs its comparisons in C (map over the columns). It runs on the
    first fused step after a request was added (`recheck_weights`) over ~200-400 tensors: 54 vs 70
    us for a Python loop over the rows (smol-135m int8, warm caches; inside a step, after the
    weights streamed through the caches, ~3-5x that)."""

    def __init__(self, modules) -> None:
        rows = [(d, name, t) for m in modules for d in (m._parameters, m._buffers)
                for name, t in d.items() if t is not None]
        self.dicts, self.names, self.tensors = (tuple(col) for col in zip(*rows)) if rows else ((), (), ())
        self.ptrs = list(map(torch.Tensor.data_ptr, self.tensors))

    def unchanged(self) -> bool:
        """No parameter or buffer was replaced or given new storage (`.data = ...`) since taken."""
        return (all(map(operator.is_, map(dict.get, self.dicts, self.names), self.tensors))
                and list(map(torch.Tensor.data_ptr, self.tensors)) == self.ptrs)


def _vnni(projection: tuple, rows: int) -> bool:
    """Whether a `_projection` runs its int8-activation kernel at `rows` input rows."""
    fmt, w, _, _, group = projection
    return uses_vnni(fmt, w.shape[1] * (2 if fmt == "int4" else 1), rows, group)  # int4: 2 a byte


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
    vnni = [_vnni(p, rows) for p in parts]
    return (
        norms[0].weight.detach().numpy(), norms[1].weight.detach().numpy(), np.float32(norms[0].eps),
        wq, sq, bq, gq, vnni[0], wo, so, bo, go, vnni[1], wg, sg, gg, vnni[2], wd, sd, bd, gd, vnni[3],
        attn.heads, attn.kv_heads, np.float32(attn.scale), np.int64(attn.window or 0),
    )


class FusedDecodeStep:
    """One decode step's shared buffers and arguments; `run` takes every layer through them."""

    def __init__(self, model, rows: int) -> None:
        cfg = model.config
        heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        e = np.float32
        q3, attn3 = np.empty((rows, heads, d), e), np.empty((rows, heads, d), e)
        self.out, self.res_out = np.empty((rows, hidden), e), np.empty((rows, hidden), e)
        self.out_t, self.res_t = torch.from_numpy(self.out), torch.from_numpy(self.res_out)
        self.buffers = (  # scratch and outputs, reused by every step of this row count
            np.empty((rows, hidden), e), np.empty((rows, (heads + 2 * kv_heads) * d), e), q3, attn3,
            attn3.reshape(rows, heads * d), np.empty((rows, hidden), e), np.empty((rows, inter), e),
            self.out, self.res_out,
        )
        self.rows = rows
        self.common: tuple = ()
        self.threads = 1
        # what `next` reuses: the layers' arguments and the rotary tables `run` used, the final
        # norm's and head's arguments and the embedding lookup `finish` took
        self.stack: tuple | None = None
        self.rope: tuple = ()
        self.tail: tuple | None = None
        self.embed: Callable | None = None

    def bind(self, meta: AttentionMetadata) -> FusedDecodeStep:
        """This step's KV slots, block tables, lengths and thread count, before the buffers."""
        self.threads = cpu_gemv.sync_threads()
        self.common = (np.ascontiguousarray(meta.slot_mapping.numpy()), meta.decode_block_tables.numpy(),
                       meta.decode_context_lens.numpy(), self.threads, *self.buffers)
        return self

    @staticmethod
    def start(model, x: torch.Tensor, meta: AttentionMetadata | None, kv_caches) -> FusedDecodeStep | None:
        if not (
            KERNEL_MODE.get().fast_paths and meta is not None and kv_caches is not None
            and meta.num_prefill_tokens == 0 and meta.decode_block_tables is not None
            and meta.backend.name == "cpu" and cpu_decode_layer.available() and enabled()
            and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype is torch.float32 and x.is_cpu
            and not (torch.is_grad_enabled() and x.requires_grad)
            and model.rotary_local is None  # one rotary table for every layer
        ):
            return None
        if not cpu_rope.usable(x, kv_caches[0]):  # fp32 or bf16 (kv_cache_dtype) CPU cache the kernels read
            return None
        # one per model and row count (allocating its ~10 buffers measured 5-10 us a step)
        steps = model.__dict__.setdefault("_fused_decode_steps", {})
        rows = x.shape[0]
        step = steps.get(rows)
        if step is None:
            step = steps[rows] = FusedDecodeStep(model, rows)
        return step.bind(meta)

    def run(self, model, x: torch.Tensor, positions: torch.Tensor, kv_caches) -> tuple | None:
        """(MLP branch, residual) after every layer, or None when some layer cannot run fused
        (then every layer runs eagerly)."""
        self.stack = layers = _cached_stack(model, kv_caches, self.rows)
        if layers is None:
            return None
        self.rope = model.rotary.cos.numpy(), model.rotary.sin.numpy()
        self._layers(x.contiguous().numpy(), positions.numpy())
        return self.out_t, self.res_t

    def _layers(self, x: np.ndarray, positions: np.ndarray) -> None:
        # the rotary table's rows at the step's positions, [rows, head_dim] each (what
        # model.rotary(positions) gives the eager layers, without its torch ops and views)
        cos, sin = self.rope
        cpu_decode_layer.decode_layers(x, self.stack, (cos[positions], sin[positions]) + self.common)

    def next(self, model, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, lens: np.ndarray) -> tuple:
        """(hidden, logits or None) of the decode step right after this one's `run` + `finish` (the
        same sequences, one position on: multi-step decode), from numpy token ids, positions, KV
        slots and context lengths (int64, one per row). Nothing that step checked can have changed
        in between, so its layer, norm and head arguments are reused as they are."""
        self.common = (slots, self.common[1], lens, *self.common[3:])
        self._layers(self.embed(ids), positions)
        return self._tail(*self.tail)

    def finish(self, model, norm, head) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(hidden, logits) after the last layer: norm(MLP branch + residual) on the step's buffers
        and, in the same compiled call, the LM head's logits where the head has a kernel (else, or
        with head None, None: the caller runs the head); None when the norm is not a plain RMSNorm."""
        args = norm.__dict__.get("_fused_decode_norm")
        if args is None or args[0] is not norm.weight or args[1] != norm.weight.data_ptr():
            args = norm.__dict__["_fused_decode_norm"] = (norm.weight, norm.weight.data_ptr(), _norm_args(norm))
        if args[2] is None:
            return None
        self.tail = (args[2], None if head is None else _head_args(head, self.rows))
        self.embed = _embedder(model.embed_tokens)
        return self._tail(*self.tail)

    def _tail(self, norm: tuple, projection: tuple | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = np.empty_like(self.out)
        if projection is None:
            cpu_decode_layer.final_norm(self.out, self.res_out, *norm, hidden)
            return torch.from_numpy(hidden), None
        logits = np.empty((self.rows, projection[0].shape[0]), np.float32)
        cpu_decode_layer.final_norm_head(self.out, self.res_out, *norm, hidden, projection, self.threads, logits)
        return torch.from_numpy(hidden), torch.from_numpy(logits)


def _embedder(embed) -> Callable[[np.ndarray], np.ndarray]:
    """ids [n] int64 -> fp32 rows [n, hidden] of the model's embedding, equal to its forward:
    numpy for an fp32 nn.Embedding, a bf16 one widened (strata.memory.bf16_weights) and a tied
    quantised one (strata.memory.quant); the module itself otherwise. Cached on the module while
    its tensors (and a quantised one's head's) are in place (_Snapshot)."""
    cache = embed.__dict__.get("_fused_decode_embedder")
    if cache is None or not cache[0].unchanged():
        owners = [embed, *getattr(embed, "head", [])]  # QuantEmbedding reads its (unregistered) head
        cache = embed.__dict__["_fused_decode_embedder"] = (_Snapshot(owners), _lookup(embed))
    return cache[1]


def _lookup(embed) -> Callable[[np.ndarray], np.ndarray]:
    kind, w = type(embed).__name__, getattr(embed, "weight", None)
    if kind == "Embedding" and w.dtype is torch.float32 and w.is_cpu and w.is_contiguous():
        return w.detach().numpy().__getitem__
    if kind == "WidenedEmbedding" and embed.out_dtype is torch.float32 and w.is_cpu and w.is_contiguous():
        table = w.detach().view(torch.int16).numpy()  # bf16 bits; widening is exact: bits << 16
        return lambda ids: (table[ids].astype(np.int32) << 16).view(np.float32)
    if kind == "QuantEmbedding" and embed.dtype is torch.float32 and cpu_quant.usable(embed.head[0].scale,
                                                                                      embed.head[0].qweight):
        head = embed.head[0]
        qw, sc = head.qweight.numpy(), head.scale.numpy()
        return lambda ids: cpu_quant.embedding_rows_np(head.method, qw, sc, ids, head.group_size)
    return lambda ids: embed(torch.from_numpy(ids)).contiguous().numpy()


def _head_args(head, rows: int) -> tuple | None:
    """The LM head's (weight, scale, bias, group, vnni) for a step of `rows`, or None when it has
    no kernel here (e.g. a vocabulary-parallel head). Cached on the head; its parameters and
    buffers are compared every step (two or three tensors: ~2 us)."""
    cache = head.__dict__.get("_fused_decode_head")
    if cache is None or not cache[0].unchanged():
        cache = head.__dict__["_fused_decode_head"] = (_Snapshot(head.modules()), {})
    by_rows = cache[1]
    if rows not in by_rows:
        p = _projection(head)
        by_rows[rows] = None if p is None else (*p[1:], _vnni(p, rows))
    return by_rows[rows]


def _norm_args(norm) -> tuple | None:
    """(weight, eps) of a plain fp32 RMSNorm (not Gemma's 1 + w), else None."""
    if type(norm) is not RMSNorm or norm.weight.dtype is not torch.float32 or type(norm.eps) is not float:
        return None
    return norm.weight.detach().numpy(), np.float32(norm.eps)


def _kv_views(kv_cache: torch.Tensor) -> tuple | None:
    """(K, V) numpy views of one layer's cache tensor (fp32, or a bf16 cache's bit patterns), or None
    when the kernels cannot read it."""
    return cpu_attention.cache_views(kv_cache) if cpu_attention.reads_cache(kv_cache) else None


_weights_epoch = 0  # bumped by recheck_weights; a cached stack remembers the epoch it was checked at


def recheck_weights() -> None:
    """Have every model's next fused step check its layers' parameters and buffers again (the
    engine calls this when a request is added: the caller held control and may have changed a
    weight)."""
    global _weights_epoch
    _weights_epoch += 1


def _cached_stack(model, kv_caches, rows: int) -> tuple | None:
    """((own, K, V) of every layer) for a step of `rows`, or None when some layer cannot run fused;
    cached on the model as [snapshot, cache tensors, {rows: stack}, epoch last checked at]. The
    cache tensors are compared every step; the parameters and buffers
    (all in place?) after `recheck_weights` only: that check reads ~300 tensors whose memory the
    step's weight stream evicted from the caches, ~0.16 ms of a 6-8 ms smol-135m int8 step, and
    between two steps of the engine's own loop nothing else runs that could change a weight."""
    cache = model.__dict__.get("_fused_decode_stack")
    if (cache is None or len(cache[1]) != len(kv_caches) or not all(a is b for a, b in zip(cache[1], kv_caches))
            or (cache[3] != _weights_epoch and not cache[0].unchanged())):
        cache = [_Snapshot(m for layer in model.layers for m in layer.modules()), tuple(kv_caches), {}, 0]
        model.__dict__["_fused_decode_stack"] = cache
    cache[3] = _weights_epoch
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
