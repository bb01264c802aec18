"""Training memory per rank, predicted from the model's shapes: what `strata plan --train` prints
and `strata train --check` compares with the device's memory.

Components (bytes):
  parameters        fp32 master weights, 4 x P
  gradients         fp32, 4 x P (created in backward; DDP keeps them for good, as bucket views)
  optimizer states  AdamW exp_avg + exp_avg_sq, 8 x P
  autocast copies   bf16/fp16: autocast casts each Linear weight once per forward and caches the
                    copy until the autocast region ends; the copies the backward needs stay saved
  activations       what autograd saves for backward, counted op by op from THIS model's forward
                    (graph/models/llama.py, graph/layers.py; see `layer_saved`), per
                    activation-checkpointing mode
  logits + CE       B x L x V: the logits in the compute dtype, their .float() copy, log-softmax
                    (saved), then in backward its gradient and the logits' gradient
  workspace         the gradients flowing through one decoder layer during its backward
  data              the packed token stream (int64)
  runtime baseline  CPU: the peak RSS of a process that imported what `strata train` imports and
                    ran one step of a microscopic model (measured once, in a subprocess); CUDA: the
                    context, which the allocator's peak does not count
  heap retention    CPU only: freed memory glibc keeps resident (see `cpu_heap_slack`)

Not everything is live at once: the predicted peak walks the step's timeline (forward end,
cross-entropy backward, lm_head backward, each decoder layer's backward, optimizer step) and takes
the largest sum. Data parallel: DDP replicates everything and adds ~2 gradient buckets in flight;
FSDP2 divides parameters, gradients and optimizer states by the world size and adds the unsharded
parameters being used (two decoder layers: the current one and the prefetched next, plus the root's
embedding / norm / head, which stay unsharded for the whole step).

LoRA (--lora, `LoRAPlan`): the base is frozen in its storage format ("base weights": fp32, or the
int8 / int4 bytes memory/planner.weight_bytes counts), with no gradients or optimizer states; the
adapter's fp32 parameters, gradients and AdamW states are static; the activations change op by
op (`lora_layer_saved`: no inputs saved for frozen weights, the banks' inputs and shrink outputs
saved instead); a quantized base saves no weight copies but dequantizes one projection at a time
in backward, and its compiled kernels add to the runtime baseline. Checked the same ways
(tests/train/test_train_lora_plan.py) and with `strata plan --train --lora --measure`.

Checked: the saved tensors against torch.autograd.graph.saved_tensors_hooks on tiny models
(tests/analyze/test_train_plan.py: exact for every mode, fp32 and bf16); the live bytes of a
whole step against the torch profiler's CPU allocations (within 1% at the peak); the CPU RSS
with `strata plan --train --measure`. The CUDA variants (fused rms_norm, flash/efficient SDPA)
and the multi-rank figures are arithmetic only, not measured.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

import torch

from strata.errors import ConfigError
from strata.memory.planner import weight_bytes
from strata.model_config import ModelConfig
from strata.train.activation_checkpoint import wrapped_layers
from strata.train.config import ALL_LINEAR, FSDP_LORA, LORA_TARGETS, TrainConfig
from strata.train.fused_loss import chunk_tokens_for, fused_loss_applies

logger = logging.getLogger(__name__)

FP32 = 4
INDEX = 8  # int64 token ids
# documented fallbacks when the baseline cannot be measured here
CPU_BASELINE_BYTES = 470 << 20  # peak RSS of _BASELINE_PROBE: torch 2.13 CPU build, x86-64 Linux
CUDA_CONTEXT_BYTES = 512 << 20  # CUDA context + kernel images: typical, outside the allocator's peak


# ---------------------------------------------------------------- parameters


def layer_params(cfg: ModelConfig) -> int:
    """Parameters of one decoder layer (biases and q/k norms included)."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qkv_out = d * (cfg.num_heads + 2 * cfg.num_kv_heads)
    n = h * qkv_out + cfg.num_heads * d * h + 3 * h * inter + 2 * h
    n += qkv_out if cfg.qkv_bias else 0
    n += h if cfg.o_bias else 0
    n += 2 * inter + h if cfg.mlp_bias else 0
    n += 2 * d if cfg.qk_norm else 0
    return n


def root_params(cfg: ModelConfig) -> int:
    """Parameters outside the decoder layers: embedding, final norm, untied lm_head."""
    emb = cfg.vocab_size * cfg.hidden_size
    return emb * (1 if cfg.tie_word_embeddings else 2) + cfg.hidden_size


def total_params(cfg: ModelConfig) -> int:
    return cfg.num_layers * layer_params(cfg) + root_params(cfg)


def attention_linear_elems(cfg: ModelConfig, biases: bool = True) -> int:
    """Elements of one layer's qkv_proj and o_proj: what autocast casts (biases too, though the
    backward saves only the weights' casts)."""
    h, d = cfg.hidden_size, cfg.head_dim
    qkv_out = d * (cfg.num_heads + 2 * cfg.num_kv_heads)
    n = h * qkv_out + cfg.num_heads * d * h
    return n + (qkv_out * cfg.qkv_bias + h * cfg.o_bias if biases else 0)


def mlp_linear_elems(cfg: ModelConfig, biases: bool = True) -> int:
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return 3 * h * inter + ((2 * inter + h) * cfg.mlp_bias if biases else 0)


def lm_head_elems(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.hidden_size


# ---------------------------------------------------------------- saved activations


def _norm(width: int, fused: bool) -> int:
    """Bytes F.rms_norm (fp32 input) saves per row: input and rstd; the composite version (CPU)
    also saves the normalised input before the weight multiply."""
    return FP32 * width + FP32 + (0 if fused else FP32 * width)


def norm_saved(cfg: ModelConfig, c: int, fused: bool) -> int:
    """A hidden-size RMSNorm in front of a projection: the norm's tensors plus the projection's
    saved input (the fp32 output itself, or autocast's c-byte cast of it)."""
    return _norm(cfg.hidden_size, fused) + c * cfg.hidden_size


def attention_saved(cfg: ModelConfig, c: int, fused: bool) -> dict[str, int]:
    """Bytes per token the attention block saves (from its input norm's output to o_proj)."""
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out: dict[str, int] = {}
    if cfg.qk_norm:
        if c == FP32:  # F.rms_norm on views of the qkv output: that whole storage stays
            out["qkv output (q/k norm input)"] = FP32 * (nh + 2 * nkv) * d
            out["q/k norm"] = (nh + nkv) * (FP32 + (0 if fused else FP32 * d))
            out["q (rotary output)"] = FP32 * nh * d
        else:  # the manual bf16/fp16 path: x.float(), rsqrt, the cast-back normalised x
            out["q/k norm"] = (nh + nkv) * (FP32 * d + FP32 + c * d)
            out["q (autocast cast)"] = c * nh * d
    elif c == FP32:  # q is a view of the rotary output of q and k together
        out["q, k (rotary output)"] = FP32 * (nh + nkv) * d
    else:  # rotary by fp32 cos/sin promotes q to fp32; SDPA's autocast casts it back
        out["q (autocast cast)"] = c * nh * d
    out["k (repeat_interleave for GQA)"] = c * nh * d
    out["v (repeat_interleave for GQA)"] = c * nh * d
    out["attention output (o_proj input)"] = c * nh * d
    out["attention logsumexp"] = FP32 * nh
    return out


def mlp_saved(cfg: ModelConfig, c: int) -> dict[str, int]:
    i = cfg.intermediate_size
    return {"gate_up output": 2 * c * i, "silu(gate)": c * i, "silu(gate) x up (down_proj input)": c * i}


def layer_saved(cfg: ModelConfig, c: int, fused: bool) -> dict[str, int]:
    """Bytes per token one unwrapped decoder layer saves for backward, op by op.

    c is the compute itemsize (4: fp32, 2: bf16/fp16 autocast); the residual stream stays fp32
    under autocast (the embedding is not autocast, and bf16 + fp32 promotes), so the norms see
    fp32 input. `fused`: CUDA's fused rms_norm (saves no normalised copy)."""
    return {"input norm": norm_saved(cfg, c, fused), **attention_saved(cfg, c, fused),
            "post-attention norm": norm_saved(cfg, c, fused), **mlp_saved(cfg, c)}


# ---------------------------------------------------------------- LoRA on a frozen base


@dataclass(frozen=True)
class LoRAPlan:
    """`--lora`: the adapter's shape and the frozen base's storage (strata/train/lora.py)."""

    rank: int = 16
    target_modules: tuple[str, ...] = LORA_TARGETS  # PEFT names, or ("all-linear",)
    dropout: float = 0.0
    quantization: str | None = None  # the base's projections: None (fp32), int8, int4
    group_size: int = 64

    @classmethod
    def of(cls, cfg: TrainConfig) -> LoRAPlan | None:
        """A `strata train` config's adapter (None: full training)."""
        if not cfg.lora:
            return None
        return cls(cfg.lora_rank, tuple(cfg.lora_target_modules), cfg.lora_dropout, cfg.quantization,
                   cfg.quantization_group_size)


# the fused projections in forward order, with the PEFT names each holds
LORA_MODULES = (("qkv", ("q_proj", "k_proj", "v_proj", "qkv_proj")), ("o", ("o_proj",)),
                ("gate_up", ("gate_proj", "up_proj", "gate_up_proj")), ("down", ("down_proj",)))


def lora_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, int, int]]:
    """(segments, in, out) of the projections of `layer` a LoRA can target (an MoE layer: the
    attention only; Phi-3's fused checkpoint names: one segment each)."""
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    fused = cfg.architecture == "Phi3ForCausalLM"
    out = {"qkv": (1 if fused else 3, h, q + 2 * kv), "o": (1, q, h)}
    if not cfg.is_moe_layer(layer):
        out |= {"gate_up": (1 if fused else 2, h, 2 * inter), "down": (1, inter, h)}
    return out


def lora_targets(cfg: ModelConfig, plan: LoRAPlan, layer: int) -> set[str]:
    """The fused projections of `layer` that carry a bank (one of their HF modules targeted)."""
    shapes = lora_shapes(cfg, layer)
    if plan.target_modules == (ALL_LINEAR,):
        return set(shapes)
    return {name for name, peft in LORA_MODULES if name in shapes and set(peft) & set(plan.target_modules)}


def lora_layer_params(cfg: ModelConfig, plan: LoRAPlan, layer: int) -> int:
    """Elements of one layer's banks: A [segments x r, in] and B [out, r] per targeted projection
    (a segment not targeted is zeros, but allocated and computed with)."""
    shapes = lora_shapes(cfg, layer)
    return sum(plan.rank * (segs * n_in + n_out) for name, (segs, n_in, n_out) in shapes.items()
               if name in lora_targets(cfg, plan, layer))


def lora_params(cfg: ModelConfig, plan: LoRAPlan) -> int:
    return sum(lora_layer_params(cfg, plan, i) for i in range(cfg.num_layers))


def _projection_elems(cfg: ModelConfig, layer: int) -> dict[str, int]:
    return {name: n_in * n_out for name, (_, n_in, n_out) in lora_shapes(cfg, layer).items()}


def lora_layer_saved(cfg: ModelConfig, c: int, fused: bool, plan: LoRAPlan, layer: int,
                     live: bool) -> tuple[dict[str, int], list[str]]:
    """Bytes per token one unwrapped decoder layer saves with its base frozen, and the projections
    whose input requires grad (their weight's autocast cast is saved: the input gradient needs it).

    Frozen weights change what autograd keeps: a base projection saves no input (no weight
    gradient), a norm no normalised copy; a bank saves its input (its own autocast cast below
    fp32; in fp32 the tensor itself, shared with attention's saved output for o_proj) and its
    shrink output x A^T [tokens, segments x r]; dropout adds its mask and a new input (`fused`
    stands for CUDA here too: its dropout's mask is bool, CPU's an fp32 noise tensor). `live`:
    the layer's input requires grad: false until the first bank's output (layer 0 before it),
    where nothing is saved at all."""
    h, i, r = cfg.hidden_size, cfg.intermediate_size, plan.rank
    shapes, banks = lora_shapes(cfg, layer), lora_targets(cfg, plan, layer)
    out: dict[str, int] = {}
    needs_w: list[str] = []
    norm = FP32 * h + FP32  # input and rstd; a frozen norm weight needs no normalised copy

    def bank(name: str, shared: bool) -> None:
        """A targeted projection's bank: its input (unless already saved, fp32) and x A^T."""
        segs, n_in, _ = shapes[name]
        x = 0 if shared and c == FP32 and not plan.dropout else c * n_in
        if plan.dropout:  # its mask: CPU's dropout multiplies by an fp32 noise tensor, CUDA's is bool
            x += n_in * (1 if fused else FP32)
        out[f"{name} LoRA input"] = x
        out[f"{name} LoRA x A^T"] = c * segs * r

    if live:
        out["input norm"] = norm
    if "qkv" in banks:
        bank("qkv", False)
    if live:
        needs_w.append("qkv")
    live = live or "qkv" in banks
    if live:
        attn = attention_saved(cfg, c, fused)
        if cfg.qk_norm:  # their frozen weights: no normalised copy either
            nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
            attn["q/k norm"] = (nh + nkv) * (FP32 if c == FP32 else FP32 * d + FP32)
        out.update(attn)
        needs_w.append("o")
    if "o" in banks:
        bank("o", live)  # fp32: the attention output SDPA saved
    live = live or "o" in banks
    if "gate_up" not in shapes:  # an MoE layer: priced as the dense MLP it replaces
        if live:
            out["post-attention norm"] = norm
            out.update({k: v for k, v in mlp_saved(cfg, c).items() if "down_proj" not in k})
        return out, needs_w
    if live:
        out["post-attention norm"] = norm
        needs_w.append("gate_up")
    if "gate_up" in banks:
        bank("gate_up", False)
    live = live or "gate_up" in banks
    if live:
        out["gate_up output"] = 2 * c * i
        out["silu(gate)"] = c * i
        needs_w.append("down")
    if "down" in banks:
        bank("down", False)
    return out, needs_w


def _attention_recomputed(cfg: ModelConfig, c: int, fused: bool) -> int:
    """Bytes per token that checkpointing the attention block recomputes instead of saving: its
    internals and qkv_proj's cast input, less the block input the checkpoint keeps (the fp32
    norm output)."""
    return sum(attention_saved(cfg, c, fused).values()) + c * cfg.hidden_size - FP32 * cfg.hidden_size


@dataclass(frozen=True)
class LayerSaved:
    """One decoder layer: bytes saved at the end of the forward, and what its backward re-creates."""

    activations: int
    weight_copies: int  # autocast casts the backward needs (weights only)
    cached_copies: int  # autocast casts in the cache until the forward ends (biases too)
    recomputed: int = 0  # activations a checkpoint re-creates during this layer's backward
    recomputed_copies: int = 0


@dataclass(frozen=True)
class SavedForBackward:
    """Bytes autograd holds at the end of the forward, parameters themselves not counted."""

    layers: list[LayerSaved]
    final_norm: int  # the final norm's tensors and lm_head's input
    rotary: int  # cos and sin, shared by every layer
    lm_head_copy: int  # autocast's cast of the lm_head weight
    logits: int  # the log-softmax output
    token_ids: int  # the window rows (inputs and targets are views of them) + flattened targets

    @property
    def activations(self) -> int:
        return sum(la.activations for la in self.layers) + self.final_norm + self.rotary

    @property
    def weight_copies(self) -> int:
        return sum(la.weight_copies for la in self.layers) + self.lm_head_copy

    @property
    def total(self) -> int:
        return self.activations + self.weight_copies + self.logits + self.token_ids


def saved_for_backward(cfg: ModelConfig, seq_len: int, micro_batch: int, compute_dtype: torch.dtype,
                       mode: str = "none", every: int = 2, device_type: str = "cpu",
                       loss_chunk_tokens: int = 0, fused_loss: bool = False,
                       lora: LoRAPlan | None = None) -> SavedForBackward:
    """What autograd saves in one forward of the training loss under checkpointing `mode`
    (`lora`: of a LoRA adapter on the frozen base, `lora_saved_for_backward`)."""
    tokens = seq_len * micro_batch
    c = _itemsize(compute_dtype)
    fused = device_type == "cuda"
    h = cfg.hidden_size
    cast = c if c != FP32 else 0  # autocast copies exist only below fp32
    if lora is not None:
        return lora_saved_for_backward(cfg, seq_len, micro_batch, c, mode, every, fused, loss_chunk_tokens,
                                       fused_loss, lora)
    full = tokens * sum(layer_saved(cfg, c, fused).values())
    attn_copies, mlp_copies = cast * attention_linear_elems(cfg, False), cast * mlp_linear_elems(cfg, False)
    cached = cast * (attention_linear_elems(cfg) + mlp_linear_elems(cfg))
    wrapped = set(wrapped_layers(cfg.num_layers, mode, every))
    layers = []
    for i in range(cfg.num_layers):
        if i not in wrapped:
            layers.append(LayerSaved(full, attn_copies + mlp_copies, cached))
        elif mode == "attention":  # the MLP keeps its activations and weight copies
            attn = tokens * _attention_recomputed(cfg, c, fused)
            layers.append(LayerSaved(full - attn, mlp_copies, cached, attn, attn_copies))
        else:  # the checkpoint keeps the layer's inputs: x (the fp32 embedding for layer 0, else
            # the previous MLP output) and the residual (already saved if the previous layer is not)
            x_in = FP32 * h if i == 0 else c * h
            res_in = FP32 * h if i > 0 and (i - 1) in wrapped else 0
            layers.append(LayerSaved(tokens * (x_in + res_in), 0, cached, full, attn_copies + mlp_copies))
    return SavedForBackward(
        layers=layers, final_norm=tokens * norm_saved(cfg, c, fused),
        rotary=tokens * 2 * FP32 * cfg.head_dim,  # fp32: the embedding's dtype decides
        # a chunked loss (--loss-chunk-tokens) checkpoints each chunk: it keeps only its input, a
        # view of the final norm's output counted above
        # the fused loss keeps the gradients it computed instead (FUSED_GRADS in _phases)
        lm_head_copy=cast * lm_head_elems(cfg),
        logits=0 if loss_chunk_tokens or fused_loss else tokens * FP32 * cfg.vocab_size,
        token_ids=INDEX * (micro_batch * (seq_len + 1) + tokens))


def lora_saved_for_backward(cfg: ModelConfig, seq_len: int, micro_batch: int, c: int, mode: str, every: int,
                            fused: bool, loss_chunk_tokens: int, fused_loss: bool,
                            lora: LoRAPlan) -> SavedForBackward:
    """saved_for_backward of a LoRA run: the layers by lora_layer_saved; the autocast casts of
    the frozen weights are not cached (autocast caches leaves that require grad only) but those
    of projections with a live input are saved; a quantized base saves none (lora.py's
    FrozenQuantLinear dequantizes again in backward); the final norm keeps its input and rstd,
    the frozen LM head no input."""
    tokens = seq_len * micro_batch
    h = cfg.hidden_size
    cast = c if c != FP32 else 0
    wrapped = set(wrapped_layers(cfg.num_layers, mode, every))
    layers, live = [], False
    for i in range(cfg.num_layers):
        parts, needs_w = lora_layer_saved(cfg, c, fused, lora, i, live)
        live = live or bool(lora_targets(cfg, lora, i))
        full = tokens * sum(parts.values())
        elems = _projection_elems(cfg, i)
        copies = 0 if lora.quantization else cast * sum(elems[n] for n in needs_w)
        attn_copies = 0 if lora.quantization else cast * sum(elems[n] for n in needs_w if n in ("qkv", "o"))
        # alive at the forward's end: the adapter's casts (cached: leaves that require grad) and
        # the frozen weights' casts a layer not checkpointed saved
        adapter_casts = cast * lora_layer_params(cfg, lora, i)
        if i not in wrapped:
            layers.append(LayerSaved(full, copies, copies + adapter_casts))
        elif mode == "attention":  # the attention block's saved tensors, less the input it keeps
            attn = tokens * max(0, sum(v for k, v in parts.items() if not k.startswith(("input norm", "post-",
                                                                                        "gate_up", "silu", "down")))
                                - FP32 * h)
            layers.append(LayerSaved(full - attn, copies - attn_copies, copies - attn_copies + adapter_casts,
                                     attn, attn_copies))
        else:
            x_in = FP32 * h if i == 0 else c * h
            res_in = FP32 * h if i > 0 and (i - 1) in wrapped else 0
            layers.append(LayerSaved(tokens * (x_in + res_in), 0, adapter_casts, full, copies))
    return SavedForBackward(
        layers=layers, final_norm=tokens * (FP32 * h + FP32),
        rotary=tokens * 2 * FP32 * cfg.head_dim,
        # the unfused loss saves autocast's cast of the frozen head; the fused one casts it itself
        # (its chunk's term in _fused_loss_phases), and a quantized head is dequantized there
        lm_head_copy=0 if lora.quantization or (fused_loss and not loss_chunk_tokens) else cast * lm_head_elems(cfg),
        logits=0 if loss_chunk_tokens or fused_loss else tokens * FP32 * cfg.vocab_size,
        token_ids=INDEX * (micro_batch * (seq_len + 1) + tokens))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


# ---------------------------------------------------------------- the step's timeline

ACTIVATIONS = "activations (saved for backward)"
COPIES = "autocast weight copies"
LOGITS = "logits + cross-entropy"
GRADS = "gradients (fp32)"
FUSED_GRADS = "fused loss: its saved gradients"
WORKSPACE = "backward workspace"
HEAP_SLACK = "allocator retention (CPU heap)"


@dataclass
class TrainMemory:
    """Predicted bytes per rank. `components`: each part's largest size over the step;
    `at_peak`: what is live at the predicted peak (they sum to `peak_bytes`)."""

    model: str
    seq_len: int
    micro_batch_size: int
    dtype: str
    activation_checkpointing: str
    ac_every: int
    world_size: int
    distributed: str
    device_type: str
    params: int
    components: dict[str, int]
    at_peak: dict[str, int]
    peak_phase: str
    peak_bytes: int
    baseline_in_measured_peak: bool  # CPU RSS includes it; CUDA's allocator peak does not
    saved: SavedForBackward
    trainable_params: int | None = None  # the parameters that get gradients (LoRA: the adapter's)
    lora: dict | None = None  # LoRAPlan's fields, for a LoRA run

    @property
    def measurable_peak(self) -> int:
        """The figure `strata train` logs as peak_memory_bytes (RSS on CPU, allocator peak on CUDA)."""
        base = 0 if self.baseline_in_measured_peak else self.components["runtime baseline"]
        return self.peak_bytes - base

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "saved"}
        d["measurable_peak"] = self.measurable_peak
        d["saved_for_backward"] = {"activations": self.saved.activations,
                                   "weight_copies": self.saved.weight_copies,
                                   "logits": self.saved.logits, "token_ids": self.saved.token_ids}
        return d


def _ce_forward(cfg: ModelConfig, tokens: int, c: int) -> int:
    """Logits (compute dtype), their fp32 copy (no copy in fp32), log-softmax: all live at once."""
    v = tokens * cfg.vocab_size
    return c * v + (FP32 * v if c != FP32 else 0) + FP32 * v


def _layer_workspace(cfg: ModelConfig, tokens: int, c: int) -> int:
    """Gradients alive inside one layer's backward beyond its saved tensors: the residual and x
    gradients flowing through, plus the larger of the MLP's (gate and up) and attention's (q, the
    expanded k and v, the output). Fitted to the profiler's count on tiny models (within ~5% where
    the MLP is the wider block, as in every named shape; ~11% for a model narrower than that)."""
    mlp = 2 * cfg.intermediate_size
    attn = 4 * cfg.num_heads * cfg.head_dim
    return tokens * ((FP32 + c) * cfg.hidden_size + c * max(mlp, attn))


def cpu_heap_slack(cfg: ModelConfig, tokens: int) -> int:
    """Freed memory glibc malloc keeps resident on CPU (RSS above the live bytes): tensors under its
    mmap threshold (which grows to 32 MiB as large blocks are freed) come from the heap, and freed
    heap chunks below its top stay mapped. Measured with `strata plan --train --measure`: about one
    decoder layer's fp32 saved tensors plus its backward workspace, the scratch the latest layer
    leaves behind (fp32 whatever the autocast dtype: the norms, rotary and residual stream are;
    fitted on demo and a 4-layer smol-135m shape, fp32 and bf16, none and full checkpointing),
    plus, per layer, a hole the size of one fp32 MLP activation that later allocations do not
    fill: the 30-layer smol-135m shape at 2,048 and 8,192 tokens (fp32, none and full, fused and
    unfused loss) left 1.1-2.6 GiB above the live bytes, 4.7-10.7 KB per token and layer more
    than one layer's scratch, where one fp32 MLP activation is 6 KB. Forcing the threshold down
    (MALLOC_MMAP_THRESHOLD_=128 KiB) makes RSS follow the live bytes but cost 28% of the step in
    page faults, so the slack is priced, not removed."""
    one_layer = tokens * sum(layer_saved(cfg, FP32, fused=False).values()) + _layer_workspace(cfg, tokens, FP32)
    return one_layer + cfg.num_layers * tokens * FP32 * cfg.intermediate_size


def lora_heap_slack(cfg: ModelConfig, tokens: int, c: int, lora: LoRAPlan) -> int:
    """What a LoRA run leaves resident beyond cpu_heap_slack: each banked projection's forward
    makes transients of its output's size (the segments' expand products, their scaling, the
    concatenation, the sum with the base output) between tensors that stay saved, and the holes
    they leave are not refilled: about one compute-dtype output per banked projection, token and
    layer. Fitted with `strata plan --train --lora --measure` on the demo model (512 and 2,048
    tokens, fp32 and bf16, fp32 / int8 / int4 base, none and full checkpointing: RSS ran 6-16%
    above the prediction without it, within 8% with it); held out: smol-135m at 512 tokens +0.9%."""
    outs = sum(n_out for i in range(cfg.num_layers)
               for name, (_, _, n_out) in lora_shapes(cfg, i).items() if name in lora_targets(cfg, lora, i))
    return tokens * c * outs


def _unfused_loss_phases(cfg: ModelConfig, logit_tokens: int, v: int, c: int, copies: int, acts: int,
                         step_copies: int, head_grad: int, grads) -> dict[str, dict[str, int]]:
    """F.cross_entropy over the logits (of every token, or of one --loss-chunk-tokens chunk)."""
    return {
        "forward end (cross-entropy forward)": {COPIES: copies, ACTIVATIONS: acts,
                                                LOGITS: _ce_forward(cfg, logit_tokens, c)},
        "cross-entropy backward": {COPIES: step_copies, ACTIVATIONS: acts, LOGITS: 3 * FP32 * v},
        # the logits' gradient cast to the compute dtype (the fp32 one still alive), then lm_head's
        "lm_head backward": {COPIES: step_copies, ACTIVATIONS: acts,
                             LOGITS: c * v + (FP32 * v if c != FP32 else 0), **grads(head_grad)},
    }


def _fused_loss_phases(cfg: ModelConfig, tokens: int, c: int, copies: int, acts: int, step_copies: int,
                       head_grad: int, grads, lora: LoRAPlan | None = None) -> dict[str, dict[str, int]]:
    """The fused loss (train/fused_loss.py): one chunk's logits at a time (its buffer, the fp32
    view of it and logsumexp's temporary; below fp32 a compute-dtype buffer too), while the hidden
    states' and the head's gradients it computes accumulate; backward scales both (new tensors),
    the head's copy becoming its .grad. A frozen head (LoRA) has no gradient; a quantized one is
    dequantized to fp32 for the loss."""
    v = chunk_tokens_for(cfg.vocab_size, tokens) * cfg.vocab_size
    head = cfg.vocab_size * cfg.hidden_size
    saved = FP32 * tokens * cfg.hidden_size + (0 if lora else FP32 * head)
    # below fp32 the chunk's logits buffer, its fp32 copy, then logsumexp's fp32 temporary or (later)
    # the gradient's cast, not both at once; and the head's cast
    chunk = 2 * FP32 * v + (c * v + c * head if c != FP32 else 0)
    dequantized = FP32 * head if lora is not None and lora.quantization else 0
    return {
        "fused loss forward (one chunk)": {COPIES: copies, ACTIVATIONS: acts, LOGITS: chunk, FUSED_GRADS: saved,
                                           WORKSPACE: dequantized},
        "lm_head backward": {COPIES: step_copies, ACTIVATIONS: acts, FUSED_GRADS: saved,
                             WORKSPACE: FP32 * tokens * cfg.hidden_size, **grads(head_grad)},
    }


def _phases(cfg: ModelConfig, saved: SavedForBackward, tokens: int, c: int, shard: int, cast: bool,
            keep_grads: bool, loss_chunk_tokens: int = 0, fused_loss: bool = False,
            lora: LoRAPlan | None = None) -> dict[str, dict[str, int]]:
    """What each moment of the step holds beyond the static parts. The forward ends with every
    autocast copy still cached; backward walks the layers from the last, freeing each layer's saved
    tensors (and re-creating a checkpointed one's) while the gradients accumulate. LoRA: the
    adapter's gradients are static (priced with the parameters), the frozen base has none; a
    quantized base dequantizes one projection at a time in backward (fp32, and its cast)."""
    logit_tokens = min(tokens, loss_chunk_tokens) if loss_chunk_tokens else tokens  # one chunk at a time
    v = logit_tokens * cfg.vocab_size
    layer_grad, head_grad = FP32 * layer_params(cfg) // shard, FP32 * lm_head_elems(cfg) // shard
    dequant = 0
    if lora is not None:
        layer_grad = head_grad = 0
        if lora.quantization:
            dequant = (FP32 + (c if c != FP32 else 0)) * max(max(_projection_elems(cfg, i).values())
                                                             for i in range(cfg.num_layers))
    k = 1 if cast else 0  # 0: no autocast copies (FSDP)

    def grads(n: int) -> dict[str, int]:
        return {} if keep_grads else {GRADS: n}  # DDP's gradients are static (bucket views)

    all_copies = k * (sum(la.cached_copies for la in saved.layers) + saved.lm_head_copy)
    acts = saved.activations + saved.token_ids
    if fused_loss:
        phases = _fused_loss_phases(cfg, tokens, c, all_copies, acts, k * saved.weight_copies, head_grad, grads,
                                    lora)
    else:
        phases = _unfused_loss_phases(cfg, logit_tokens, v, c, all_copies, acts, k * saved.weight_copies,
                                      head_grad, grads)
        if lora is not None and lora.quantization:  # the head dequantized again for its input's gradient
            phases["lm_head backward"][WORKSPACE] = (FP32 + (c if c != FP32 else 0)) * lm_head_elems(cfg)
    for j in reversed(range(cfg.num_layers)):
        below = saved.layers[: j + 1]
        phases[f"layer {j} backward"] = {
            COPIES: k * (sum(la.weight_copies for la in below) + saved.layers[j].recomputed_copies),
            ACTIVATIONS: sum(la.activations for la in below) + saved.layers[j].recomputed
            + saved.rotary + saved.token_ids,
            WORKSPACE: _layer_workspace(cfg, tokens, c) + dequant,
            # layer j's own gradients appear as its saved tensors go: count the layers above it
            **grads(head_grad + (cfg.num_layers - 1 - j) * layer_grad),
        }
    # The embedding's backward builds its dense [vocab, hidden] gradient (zeros, then index_add).
    # Tied to the LM head, that is summed with the head's contribution (already counted) into a
    # third buffer before it becomes .grad: two embedding-sized transients over every gradient.
    # Untied, the dense gradient is the .grad itself. Measured (an RSS sampler with autograd
    # hooks, smol-135m, 30 layers): +2 x 108 MiB here, the step's peak when the logits are small.
    if lora is not None:  # a frozen embedding: no gradient
        phases["optimizer step"] = {}
        return phases
    emb_grad = FP32 * cfg.vocab_size * cfg.hidden_size // shard
    all_grads = grads(FP32 * total_params(cfg) // shard)
    phases["embedding backward"] = {WORKSPACE: 2 * emb_grad if cfg.tie_word_embeddings else 0, **all_grads}
    phases["optimizer step"] = all_grads
    return phases


def predict_train_memory(cfg: ModelConfig, *, seq_len: int, micro_batch_size: int,
                         compute_dtype: torch.dtype = torch.float32, activation_checkpointing: str = "none",
                         ac_every: int = 2, world_size: int = 1, distributed: str = "ddp",
                         device_type: str = "cpu", ddp_bucket_mb: float = 25.0, data_tokens: int = 0,
                         runtime_baseline_bytes: int | None = None, model_name: str = "",
                         loss_chunk_tokens: int = 0, fused_loss: bool = False,
                         lora: LoRAPlan | None = None) -> TrainMemory:
    """Peak memory of one training rank and its components (see the module docstring); `lora`:
    an adapter on a frozen base (`_lora_static` prices the weights)."""
    c = _itemsize(compute_dtype)
    fused_loss = fused_loss_applies(cfg, fused_loss, loss_chunk_tokens)
    n = max(1, world_size)
    fsdp, ddp = distributed == "fsdp" and n > 1, distributed == "ddp" and n > 1
    if lora is not None and fsdp:
        raise ConfigError(FSDP_LORA)
    shard = n if fsdp else 1
    params = total_params(cfg)
    saved = saved_for_backward(cfg, seq_len, micro_batch_size, compute_dtype, activation_checkpointing,
                               ac_every, device_type, loss_chunk_tokens, fused_loss, lora)
    if runtime_baseline_bytes is None:
        runtime_baseline_bytes = runtime_baseline(device_type)
        if lora is not None and lora.quantization and device_type == "cpu":
            runtime_baseline_bytes += quantization_kernels_bytes(lora.quantization)
    static = {
        "parameters (fp32 master)": FP32 * params // shard,
        "optimizer states (AdamW, 2 x fp32)": 2 * FP32 * params // shard,
        "data (token stream, int64)": INDEX * data_tokens,
        "runtime baseline": runtime_baseline_bytes,
    }
    trainable = params
    if lora is not None:
        trainable = lora_params(cfg, lora)
        static = _lora_static(cfg, lora, trainable, ddp, ddp_bucket_mb) | {
            k: v for k, v in static.items() if k.startswith(("data", "runtime"))}
    elif ddp:  # gradient_as_bucket_view: the gradients are the buckets, allocated once for good
        static[GRADS] = FP32 * params
        static["DDP buckets in flight"] = 2 * int(ddp_bucket_mb * (1 << 20))
    if fsdp:  # the root group stays unsharded all step; two layers are gathered at a time
        static["FSDP unsharded parameters"] = c * (root_params(cfg) + 2 * layer_params(cfg))
    if device_type == "cpu":
        static[HEAP_SLACK] = cpu_heap_slack(cfg, seq_len * micro_batch_size) + (
            0 if lora is None else lora_heap_slack(cfg, seq_len * micro_batch_size, c, lora))
    # FSDP's mixed precision casts the parameters itself: autocast finds nothing to cache
    phases = _phases(cfg, saved, seq_len * micro_batch_size, c, shard, cast=not fsdp,
                     keep_grads=ddp or lora is not None, loss_chunk_tokens=loss_chunk_tokens, fused_loss=fused_loss,
                     lora=lora)
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    peak_phase = max(totals, key=totals.__getitem__)
    at_peak = {**static, **{k: v for k, v in phases[peak_phase].items() if v}}
    components = dict(static)
    for parts in phases.values():
        for k, v in parts.items():
            components[k] = max(components.get(k, 0), v)
    return TrainMemory(
        model=model_name, seq_len=seq_len, micro_batch_size=micro_batch_size, dtype=str(compute_dtype)[6:],
        activation_checkpointing=activation_checkpointing, ac_every=ac_every, world_size=n,
        distributed=distributed, device_type=device_type, params=params, components=components,
        at_peak=at_peak, peak_phase=peak_phase, peak_bytes=sum(at_peak.values()),
        baseline_in_measured_peak=device_type != "cuda", saved=saved, trainable_params=trainable,
        lora=None if lora is None else asdict(lora))


def base_storage(lora: LoRAPlan) -> str:
    return lora.quantization or "fp32"


def _lora_static(cfg: ModelConfig, lora: LoRAPlan, trainable: int, ddp: bool, ddp_bucket_mb: float) -> dict[str, int]:
    """The parts a LoRA run holds all step: the frozen base in its storage format (no gradients,
    no optimizer states), the adapter's fp32 parameters, gradients and AdamW states; DDP's
    buckets are the adapter's gradients (their views), at most two in flight besides."""
    static = {
        f"base weights (frozen, {base_storage(lora)})": weight_bytes(cfg, torch.float32, lora.quantization,
                                                                      lora.group_size),
        "LoRA adapter (fp32)": FP32 * trainable,
        GRADS: FP32 * trainable,
        "optimizer states (AdamW, 2 x fp32)": 2 * FP32 * trainable,
    }
    if ddp:
        static["DDP buckets in flight"] = 2 * min(int(ddp_bucket_mb * (1 << 20)), FP32 * trainable)
    return static


# ---------------------------------------------------------------- the runtime baseline

# A fresh process that imports what `strata train` imports and runs one step of a microscopic model
# through the trainer's own parts, so every lazy import (torch._dynamo, pulled in by the optimizer,
# is ~140 MiB alone) and kernel table is resident; its tensors are a few KiB.
_BASELINE_PROBE = """
import torch, tqdm
import strata.train.cli  # the command's own module (nothing below the CLI imports strata.cli)
from strata.graph.models.llama import CausalLM
from strata.kernels.dispatch import reference_kernels
from strata.model_config import ModelConfig
from strata.train.activation_checkpoint import apply_activation_checkpointing
from strata.train.config import TrainConfig
from strata.train.optim import make_optimizer
from strata.train.metrics import vm_hwm_bytes
from strata.train.trainer import LanguageModelLoss
cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 32,
    "max_position_embeddings": 16, "tie_word_embeddings": True, "torch_dtype": "float32"})
lm = CausalLM(cfg)
apply_activation_checkpointing(lm, "selective", 2)
model = LanguageModelLoss(lm)
opt = make_optimizer(model, TrainConfig())
ids = torch.randint(0, 32, (2, 9))
with reference_kernels():
    for dtype in (torch.float32, torch.bfloat16):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
print(vm_hwm_bytes())  # not ru_maxrss, which a child forked from a bigger process inherits
"""


QUANT_KERNELS_BYTES = 52 << 20  # fallback: what quantizing a base adds to RSS (numba's compiled kernels)
_QUANT_PROBE = """
import sys, torch
import strata.train.cli
from strata.graph.models.llama import CausalLM
from strata.memory.quant import quantize_model
from strata.train.metrics import vm_hwm_bytes
from strata.model_config import ModelConfig
cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64,
    "max_position_embeddings": 16, "tie_word_embeddings": True, "torch_dtype": "float32"})
before = vm_hwm_bytes()
quantize_model(CausalLM(cfg), sys.argv[1], 32)
print(vm_hwm_bytes() - before)
"""


@functools.cache
def quantization_kernels_bytes(method: str) -> int:
    """RSS a LoRA run on a quantized base holds beyond runtime_baseline: quantizing the base at load
    compiles numba's kernels (LLVM's memory stays, ~50 MiB whatever the model's size: measured on
    the tiny, demo and smol-135m shapes). Measured once in a fresh process (~3 s)."""
    try:
        out = subprocess.run([sys.executable, "-c", _QUANT_PROBE, method], capture_output=True, text=True,
                             timeout=120, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return int(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        logger.info("could not measure the quantization kernels (%s); using %d MiB", e, QUANT_KERNELS_BYTES >> 20)
        return QUANT_KERNELS_BYTES


@functools.cache
def runtime_baseline(device_type: str = "cpu") -> int:
    """Bytes a training process holds beyond its tensors. CPU: the peak RSS of _BASELINE_PROBE in a
    fresh process (measured once per process, ~2 s); CUDA: the documented context size (its
    allocator peak, which `strata train` logs, excludes it)."""
    if device_type == "cuda":
        return CUDA_CONTEXT_BYTES
    try:
        out = subprocess.run([sys.executable, "-c", _BASELINE_PROBE], capture_output=True, text=True,
                             timeout=120, check=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        return int(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        logger.info("could not measure the runtime baseline (%s); using %d MiB", e, CPU_BASELINE_BYTES >> 20)
        return CPU_BASELINE_BYTES
