"""The layer kinds the CPU decode step runs fused, and the one interface a new kind plugs into.

A layer kind registers, for its module class, a builder

    @fused_layer(MyLayer)
    def my_layer(layer, kv_cache, rows, lora=None) -> tuple | str:
        ...

that returns the layer's entry `(run, args)` for a decode step of `rows` rows, or a short reason
(str) why this layer cannot run fused (it then runs eagerly, alone: the step's log says which
layer and why). `lora` (a `LoRARows`) asks for the form that adds each row's LoRA adapter where
the layer's projections carry banks (graph/lora.py), for the steps where some row has one; a
builder without the parameter is asked only for layers without banks (one with banks then runs
eagerly, which applies them). The step calls, for each layer in turn,

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

import inspect
import weakref
from collections.abc import Callable

import numpy as np
import torch

from strata.graph.layers import Linear, RMSNorm
from strata.graph.lora import LoRABank
from strata.graph.models.llama import DecoderLayer, MoEDecoderLayer
from strata.graph.moe import MoEBlock
from strata.kernels import cpu_attention, cpu_decode_layer, cpu_lora, cpu_moe
from strata.kernels.cpu_decode_layer import NO_ARRAY, uses_vnni

Builder = Callable[..., "tuple | str"]
_BUILDERS: dict[type, Builder] = {}


def fused_layer(cls: type) -> Callable[[Builder], Builder]:
    """Register `builder` as the fused form of layers of exactly class `cls`."""

    def register(builder: Builder) -> Builder:
        _BUILDERS[cls] = builder
        return builder

    return register


def build(layer: torch.nn.Module, kv_cache: torch.Tensor, rows: int, lora: LoRARows | None = None) -> tuple | str:
    """The layer's (run, args) for a step of `rows` (`lora`: with its adapters), or why it runs eagerly."""
    builder = _BUILDERS.get(type(layer))
    if builder is None:
        return f"{type(layer).__name__} has no fused form"
    if lora is None or not has_banks(layer):
        return builder(layer, kv_cache, rows)
    if "lora" not in inspect.signature(builder).parameters:
        return f"LoRA banks on a {type(layer).__name__}, whose fused form takes none"
    return builder(layer, kv_cache, rows, lora=lora)


def has_banks(layer: torch.nn.Module) -> bool:
    """Whether any module of `layer` carries a LoRA bank (graph/lora.py)."""
    return any(m._modules.get("lora") is not None for m in layer.modules())


class LoRARows:
    """One row count's adapter slots, shared by every LoRA layer of the step: `token_slots` [rows]
    int64 (-1: no adapter), which the step fills before each step, `slots` the fewest adapters a bank
    of a fused layer holds (the step checks the token slots against it), and the scratch the layers
    share (they run one after another)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.token_slots = np.full(rows, -1, np.int64)
        self.slots: int | None = None
        self._scratch: dict[tuple[str, int], np.ndarray] = {}

    def scratch(self, kind: str, cols: int) -> np.ndarray:
        """A [rows, cols] fp32 buffer for `kind` ("xa": shrink outputs; "gate_up"), one per width."""
        key = (kind, cols)
        if key not in self._scratch:
            self._scratch[key] = np.empty((self.rows, cols), np.float32)
        return self._scratch[key]


def bank_args(m, lora: LoRARows, out_features: int, in_features: int) -> tuple | None | str:
    """(A, B, scale, segment bounds) numpy views of `m`'s LoRA bank for cpu_lora._lora_add, None when
    `m` has none, or why the kernels cannot apply it (the layer then runs eagerly)."""
    bank = m._modules.get("lora")
    if bank is None:
        return None
    if type(bank) is not LoRABank:
        return f"a LoRA bank of another kind ({type(bank).__name__})"
    a, b, scale = bank.lora_a, bank.lora_b, bank.scale
    if (a.dtype not in (torch.float32, torch.bfloat16) or b.dtype is not a.dtype or scale.dtype is not torch.float32
            or any(not t.is_cpu or not t.is_contiguous() for t in (a, b, scale))):
        return "a LoRA bank not plain fp32 or bf16 on CPU"
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return "a trainable LoRA bank"
    if bank.dropout and bank.training:
        return "LoRA dropout in training mode"
    segs, rank = bank.segments, bank.rank
    slots = a.shape[0]
    if (a.shape != (slots, len(segs) * rank, in_features) or b.shape != (slots, out_features, rank)
            or scale.shape != (slots, len(segs)) or segs[0][0] != 0 or segs[-1][1] != out_features
            or any(hi0 != lo1 for (_, hi0), (lo1, _) in zip(segs, segs[1:]))):
        return "a LoRA bank whose shapes do not fit its projection"
    if slots == 0 or rank == 0:
        return None
    lora.slots = slots if lora.slots is None else min(lora.slots, slots)
    return cpu_lora.bank_arrays(a), cpu_lora.bank_arrays(b), scale.numpy(), cpu_lora.bounds_of(segs)


def _lora_args(lora: LoRARows, modules_parts) -> tuple | None | str:
    """The LoRA layers' arguments for (module, projection) pairs in the kernel's order: (token slots,
    xa scratch, bounds [n, segments + 1], then A, B, scale per module (cpu_lora.NO_BANK: none)), None
    when no module has a bank, or why one cannot run fused."""
    banks = []
    for m, p in modules_parts:
        fmt, w = p[0], p[1]
        got = bank_args(m, lora, w.shape[0], w.shape[1] * (2 if fmt == "int4" else 1))
        if isinstance(got, str):
            return got
        banks.append(got)
    if all(b is None for b in banks):
        return None
    width = max(len(b[3]) for b in banks if b is not None)
    bounds = np.zeros((len(banks), width), np.int64)
    xa = lora.scratch("xa", max(b[0].shape[1] for b in banks if b is not None))
    per = []
    for i, got in enumerate(banks):
        if got is None:
            per += (cpu_lora.NO_BANK, cpu_lora.NO_BANK, cpu_lora.NO_SCALE)
        else:
            bounds[i, : len(got[3])] = got[3]
            per += got[:3]
    return (lora.token_slots, xa, bounds, *per)


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


def _attention_args(layer, kv_cache: torch.Tensor, rows: int) -> tuple | str:
    """The attention half's args (cpu_decode_layer._attend: norms, qkv and o projections, shape,
    q/k norms) and the MLP-norm eps, or why this layer's attention cannot run fused."""
    attn = layer.self_attn
    if attn.rotary_dim is not None:
        return "partial rotary"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    qk = (attn.q_norm, attn.k_norm) if attn.q_norm is not None else ()
    if any(type(n) is not RMSNorm for n in (*norms, *qk)):
        return "norms not plain RMSNorms"
    if (any(n.weight.dtype is not torch.float32 or type(n.eps) is not float for n in (*norms, *qk))
            or any(n.eps != norms[0].eps for n in (*norms, *qk))):
        return "norms not plain fp32 with one eps"
    parts = [projection(m) for m in (attn.qkv_proj, attn.o_proj)]
    if any(p is None for p in parts):
        return "a projection without a fused kernel (tensor-parallel shard, another weight format, act-order input)"
    views = kv_views(kv_cache)
    if views is None:
        return "a KV cache the kernels do not read"
    (_, wq, sq, bq, gq), (_, wo, so, bo, go) = parts
    qn, kn = (n.weight.detach().numpy() for n in qk) if qk else (NO_ARRAY, NO_ARRAY)
    own = (
        norms[0].weight.detach().numpy(), norms[1].weight.detach().numpy(), np.float32(norms[0].eps),
        wq, sq, bq, gq, vnni(parts[0], rows), wo, so, bo, go, vnni(parts[1], rows),
        attn.heads, attn.kv_heads, np.float32(attn.scale), np.int64(attn.window or 0),
        qn, kn, bool(attn.qk_norm_whole), np.float32(attn.clip_qkv or 0.0),
    )
    return views, own


def _mlp_parts(mlp) -> tuple | str:
    """A gated SiLU MLP's (gate_up, down) projections, or why it cannot run fused."""
    if mlp.act != "silu":
        return f"{mlp.act} MLP"
    parts = (projection(mlp.gate_up_proj), projection(mlp.down_proj))
    if any(p is None for p in parts):
        return "a projection without a fused kernel (tensor-parallel shard, another weight format, act-order input)"
    if parts[0][3].shape[0]:
        return "a gate/up bias (the SwiGLU kernels take none)"
    return parts


@fused_layer(DecoderLayer)
def llama_layer(layer: DecoderLayer, kv_cache: torch.Tensor, rows: int, lora: LoRARows | None = None) -> tuple | str:
    """Llama, Mistral, Qwen2, Qwen3, Phi-3: norm, qkv (+ bias, + q/k norms), rotary + KV write,
    paged attention, o, norm, SwiGLU, down, in one compiled call; fp32, bf16, int8 and int4. With
    `lora` and a bank on some projection: the same with each row's adapter added (lora_layer)."""
    attention = _attention_args(layer, kv_cache, rows)
    if isinstance(attention, str):
        return attention
    mlp = _mlp_parts(layer.mlp)
    if isinstance(mlp, str):
        return mlp
    views, own = attention
    (_, wg, sg, _, gg), (_, wd, sd, bd, gd) = mlp
    ffn = (wg, sg, gg, vnni(mlp[0], rows), wd, sd, bd, gd, vnni(mlp[1], rows))
    # _layer's order: norms and the attention projections, the MLP's, then shape and q/k norms
    args = (*views, *own[:13], *ffn, *own[13:])
    if lora is None:
        return cpu_decode_layer.llama_layer, args
    attn, mlp_m = layer.self_attn, layer.mlp
    parts = [projection(m) for m in (attn.qkv_proj, attn.o_proj)] + list(mlp)
    banks = _lora_args(lora, zip((attn.qkv_proj, attn.o_proj, mlp_m.gate_up_proj, mlp_m.down_proj), parts))
    if banks is None:
        return cpu_decode_layer.llama_layer, args
    if isinstance(banks, str):
        return banks
    gate_up = lora.scratch("gate_up", mlp[0][1].shape[0]) if banks[9].shape[0] else np.empty((0, 0), np.float32)
    return cpu_decode_layer.lora_layer, (*args, *banks, gate_up)


class _Experts:
    """An MoE block's experts as the compiled dispatch takes them: typed lists of each expert's
    (weight, scale) per projection, built once per block and weights (a list of 128 experts costs
    ~10 ms to build: not per row count), plus the int8-activation choice by rows."""

    _memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, experts, rows: int) -> tuple | str:
        ptrs = tuple(p.data_ptr() for e in experts for p in e.parameters()) + tuple(
            b.data_ptr() for e in experts for b in e.buffers())
        memo = cls._memo.get(experts)
        if memo is None or memo[0] != ptrs:
            memo = cls._memo[experts] = (ptrs, cls._lists(experts))
        lists = memo[1]
        if isinstance(lists, str):
            return lists
        wgu, sgu, wd, sd, gu_part, d_part = lists
        vgu = np.array([vnni(gu_part, n) for n in range(rows + 1)])
        vd = np.array([vnni(d_part, n) for n in range(rows + 1)])
        return wgu, sgu, gu_part[4], vgu, wd, sd, d_part[4], vd

    @staticmethod
    def _lists(experts) -> tuple | str:
        parts = [_mlp_parts(e) for e in experts]
        bad = next((p for p in parts if isinstance(p, str)), None)
        if bad is not None:
            return bad
        kinds = {(p[0][0], p[0][2].ndim, p[0][4], p[1][0], p[1][2].ndim, p[1][4]) for p in parts}
        if len(kinds) > 1:
            return "experts in different weight formats"
        typed = cpu_moe.typed_list
        return (typed([p[0][1] for p in parts]), typed([p[0][2] for p in parts]),
                typed([p[1][1] for p in parts]), typed([p[1][2] for p in parts]), parts[0][0], parts[0][1])


def _moe_run(x, residual, has_residual, attention, block, router, experts, shared, *step):
    """An MoE layer: the compiled attention half, the compiled router (a tie at the k-th place:
    the block's own Router, so ties break as the eager block breaks them), the routed experts,
    then the shared expert where there is one."""
    cpu_decode_layer.moe_attention(x, residual, has_residual, *attention, *step)
    _moe_mlp(block, router, experts, shared, step)


def _moe_lora_run(x, residual, has_residual, attention, banks, block, router, experts, shared, *step):
    """_moe_run with each row's adapter on the attention projections."""
    cpu_decode_layer.moe_attention_lora(x, residual, has_residual, *attention, *banks, *step)
    _moe_mlp(block, router, experts, shared, step)


def _moe_mlp(block, router, experts, shared, step) -> None:
    h, threads, out = step[6], step[5], step[-2]
    weight, top_k, norm, ids, weights = router
    rows = h.shape[0]
    ids, weights = ids[:rows], weights[:rows]
    if cpu_moe.route(h, weight, top_k, norm, ids, weights):
        _, w, i = block.gate(torch.from_numpy(h))
        ids[:], weights[:] = i.numpy(), w.numpy()
    cpu_moe.experts(h, ids, weights, *experts, threads, out)
    if shared is not None:
        cpu_decode_layer.shared_expert(h, *shared, threads, out)


@fused_layer(MoEDecoderLayer)
def moe_layer(layer: MoEDecoderLayer, kv_cache: torch.Tensor, rows: int, lora: LoRARows | None = None) -> tuple | str:
    """Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE: the attention half compiled as the Llama layer's, the
    routed experts gathered by expert id (only the experts some row picked are read). With `lora`:
    each row's adapter on the attention projections (the experts take none)."""
    attention = _attention_args(layer, kv_cache, rows)
    if isinstance(attention, str):
        return attention
    block = layer.mlp
    if not isinstance(block, MoEBlock):
        return "expert-parallel experts (their all-to-alls run in the eager layer)"
    banks = None
    if lora is not None:
        if has_banks(block):
            return "LoRA banks on MoE experts"
        attn = layer.self_attn
        banks = _lora_args(lora, ((m, projection(m)) for m in (attn.qkv_proj, attn.o_proj)))
        if isinstance(banks, str):
            return banks
    experts = _Experts.of(block.experts, rows)
    if isinstance(experts, str):
        return experts
    gate = block.gate.weight
    if gate.dtype is not torch.float32 or not gate.is_contiguous():
        return "a router weight not plain fp32"
    hidden, inter, pairs, n_exp = gate.shape[1], block.experts[0].intermediate, rows * block.top_k, block.num_experts
    scratch = (np.empty((pairs, hidden), np.float32), np.empty((pairs, inter), np.float32),
               np.empty((pairs, hidden), np.float32), np.empty(pairs, np.int64), np.empty(pairs, np.float32),
               np.empty(n_exp, np.int64), np.empty(n_exp, np.int64), np.empty(n_exp, np.int64))
    router = (gate.detach().numpy(), block.top_k, block.gate.norm_topk_prob,
              np.empty((rows, block.top_k), np.int64), np.empty((rows, block.top_k), np.float32))
    shared = None
    if block.shared_expert is not None:
        parts = _mlp_parts(block.shared_expert)
        gate = block.shared_expert_gate.weight
        if isinstance(parts, str) or gate.dtype is not torch.float32:
            return f"shared expert: {parts if isinstance(parts, str) else 'a gate not fp32'}"
        (_, wg, sg, _, gg), (_, wd, sd, _, gd) = parts
        shared = (wg, sg, gg, vnni(parts[0], rows), wd, sd, gd, vnni(parts[1], rows), gate.detach().numpy()[0],
                  np.empty((rows, block.shared_expert.intermediate), np.float32), np.empty((rows, hidden), np.float32))
    views, own = attention
    counts = block.token_counts.numpy() if block.token_counts.is_cpu else np.zeros(block.num_experts, np.int64)
    rest = (block, router, (*experts, *scratch, counts), shared)
    if banks is None:
        return _moe_run, ((*views, *own), *rest)
    return _moe_lora_run, ((*views, *own), banks, *rest)
