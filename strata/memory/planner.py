"""The memory formula: weights + KV bytes per token decide how many tokens and sequences fit."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

from strata.errors import CapacityError
from strata.kernels import kv_quant
from strata.memory.quant import layout_bytes, narrow_untied_embedding, quantized_bytes
from strata.model_config import ModelConfig
from strata.text_table import fmt_bytes

logger = logging.getLogger(__name__)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element; an int8 / fp8 cache adds each
    (token, KV head) row's fp32 scale: head_dim 64 takes 68 bytes a row, bf16 128."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * kv_quant.row_width(dtype, cfg.head_dim) * dtype.itemsize


def weight_bytes(
    cfg: ModelConfig, dtype: torch.dtype, quantization: str | None = None, group_size: int = 64,
    layouts: dict | None = None,
) -> int:
    """Bytes of the weights as held in memory; with `quantization` ("int8" | "int4") the dense
    projections (q/k/v, o, gate/up, down, lm_head) take their quantised size (memory/quant.py),
    everything else (norms, biases, an untied embedding) stays in `dtype`, but for an untied bf16
    embedding of an fp32 model, kept in bf16 (quant.narrow_untied_embedding). "bf16" (bf16 storage
    of an fp32 model, memory/bf16_weights.py) keeps every projection, embeddings included, in 2 bytes.
    An MoE layer's experts are projections like the dense ones, every one of them held (all are
    stored, whichever a token picks); its router (and Qwen2-MoE's shared-expert gate) is a float
    parameter in `dtype`, never narrowed nor quantised (graph/moe.py).
    layouts: memory.quant Layouts by projection module name (a GGUF's or a prequantized checkpoint's
    own: graph/gguf_model.gguf_formats, graph/prequantized.layouts), counted as they are held; a
    module they do not name takes `quantization`'s size, or stays in `dtype`."""
    mats = _named_matrices(cfg)
    float_params = cfg.num_params() - sum(n * k for _, n, k in mats)
    held = sum(_matrix_bytes(name, n, k, dtype, quantization, group_size, layouts) for name, n, k in mats)
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    narrow = quantization == "bf16" or (quantization is not None and narrow_untied_embedding(
        cfg.torch_dtype, dtype, cfg.tie_word_embeddings))
    return (float_params - embed) * dtype.itemsize + embed * (2 if narrow else dtype.itemsize) + held


def expert_weight_bytes(
    cfg: ModelConfig, dtype: torch.dtype, quantization: str | None = None, group_size: int = 64,
    layouts: dict | None = None,
) -> int:
    """Bytes of the routed experts' projections as held (every expert of every MoE layer; 0 for a
    dense model): the part of weight_bytes a decode step reads only for the experts its tokens
    pick. The router and a shared expert are read by every token: not counted here."""
    return sum(_matrix_bytes(name, n, k, dtype, quantization, group_size, layouts)
               for name, n, k in _named_matrices(cfg) if ".mlp.experts." in name)


def _matrix_bytes(name: str, n: int, k: int, dtype: torch.dtype, quantization: str | None, group_size: int,
                  layouts: dict | None) -> int:
    """One projection [n, k] as held: the file's own layout, the quantised size, bf16, or dtype."""
    if layouts and name in layouts:
        return layout_bytes(layouts[name], n, k)
    if quantization in ("int8", "int4"):
        return quantized_bytes(quantization, n, k, group_size)
    return n * k * (2 if quantization == "bf16" else dtype.itemsize)


def _named_matrices(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(module name, rows, columns) of every projection the engine quantises or narrows (the
    PROJECTIONS of memory/quant.py): an MoE layer's are its experts' (and shared expert's) gate/up
    and down; its router (never narrowed nor quantised) stays a float parameter."""
    h, d = cfg.hidden_size, cfg.head_dim
    out = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        out += [(f"{p}self_attn.qkv_proj", d * (cfg.num_heads + 2 * cfg.num_kv_heads), h),
                (f"{p}self_attn.o_proj", h, cfg.num_heads * d)]
        if not cfg.is_moe_layer(i):
            out += _mlp_matrices(f"{p}mlp.", cfg.intermediate_size, h)
            continue
        moe = cfg.moe
        for e in range(moe.num_experts):
            out += _mlp_matrices(f"{p}mlp.experts.{e}.", moe.intermediate_size, h)
        if moe.shared_intermediate_size:
            out += _mlp_matrices(f"{p}mlp.shared_expert.", moe.shared_intermediate_size, h)
    return out + [("lm_head", cfg.vocab_size, h)]  # the tied embedding shares it


def _mlp_matrices(prefix: str, inter: int, h: int) -> list[tuple[str, int, int]]:
    return [(f"{prefix}gate_up_proj", 2 * inter, h), (f"{prefix}down_proj", h, inter)]


def streamed_weight_bytes(
    cfg: ModelConfig, dtype: torch.dtype, quantization: str | None = None, group_size: int = 64,
    layouts: dict | None = None, tokens: int | None = None,
) -> int:
    """The weight bytes one decode step reads: all of weight_bytes but an untied input embedding,
    of which a step reads one row per sequence (in the bytes it is held in: 2 where bf16 storage or
    quant.narrow_untied_embedding keeps it in bf16). An MoE model's step of `tokens` tokens reads
    only the experts they pick: expected_experts(E, k, tokens) of each MoE layer's E (tokens None:
    every expert, the most a step can read)."""
    held = weight_bytes(cfg, dtype, quantization, group_size, layouts)
    if tokens is not None and cfg.moe is not None:
        unread = 1 - expected_experts(cfg.moe.num_experts, cfg.moe.top_k, tokens) / cfg.moe.num_experts
        held -= round(unread * expert_weight_bytes(cfg, dtype, quantization, group_size, layouts))
    if cfg.tie_word_embeddings:
        return held
    narrow = quantization == "bf16" or (quantization is not None and narrow_untied_embedding(
        cfg.torch_dtype, dtype, False))
    return held - cfg.vocab_size * cfg.hidden_size * (2 if narrow else dtype.itemsize)


def expected_experts(num_experts: int, top_k: int, tokens: float) -> float:
    """Distinct experts a batch of `tokens` tokens touches in one MoE layer, expected, when each token
    picks top_k of num_experts uniformly: an expert is missed by one token with probability
    1 - k/E, by all of them with (1 - k/E)^tokens, so E * (1 - (1 - k/E)^tokens) are read (k at one
    token, -> E as the batch grows). Real routers are skewed, which reads fewer; uniform is the
    planner's assumption (and what random weights give)."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def check_fits(what: str, flag: str, nbytes: int, device: str, default: str) -> None:
    """A size the user asked for must fit in the memory available now (the engine's start-up
    check; the planner prices other machines and does not call it)."""
    free = free_memory(device)
    if nbytes > free:
        kind = "device" if device.startswith("cuda") else "host"
        raise CapacityError(
            f"{what}: {fmt_bytes(nbytes)} asked, but only {fmt_bytes(free)} of {kind} memory is available; "
            f"lower {flag}, or leave it unset ({default})"
        )


def free_memory(device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    return int(psutil.virtual_memory().available)


@dataclass(frozen=True)
class MemoryPlan:
    weight_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    max_model_len: int
    quantization: str | None = None

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.kv_bytes_per_token

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_len_sequences(self) -> float:
        return self.tokens / self.max_model_len

    def summary(self) -> str:
        quant = f" ({self.quantization})" if self.quantization else ""
        return (
            f"weights {fmt_bytes(self.weight_bytes)}{quant}; KV {fmt_bytes(self.kv_bytes_per_token)}/token; "
            f"KV cache {fmt_bytes(self.kv_cache_bytes)} = {self.num_blocks} blocks x {self.block_size} "
            f"= {self.tokens} tokens = {self.max_len_sequences:.1f} sequences of max_model_len "
            f"{self.max_model_len}"
        )


def plan_memory(
    cfg: ModelConfig,
    dtype: torch.dtype,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    kv_cache_memory: int | None,
    memory_fraction: float,
    device: str,
    quantization: str | None = None,
    group_size: int = 64,
    kv_dtype: torch.dtype | None = None,
    weights: int | None = None,
) -> MemoryPlan:
    """Size the paged KV cache; error at start if one max_model_len sequence cannot fit.

    With an explicit `kv_cache_memory` that many bytes are used. Otherwise a fraction of free
    memory, capped at what `max_num_seqs` sequences of `max_model_len` could ever use. Free
    memory is measured after the model is loaded (and quantised), so smaller weights leave more
    of it to the KV cache; `quantization` only changes the weight bytes the plan reports.
    `kv_dtype`: the cache's storage dtype when it is not the model's `dtype` (kv_cache_dtype).
    `weights`: the loaded model's weight bytes, reported instead of the estimate.
    """
    per_token = kv_bytes_per_token(cfg, kv_dtype or dtype)
    per_block = per_token * block_size
    if kv_cache_memory is not None:
        budget, source = kv_cache_memory, "kv_cache_memory"
    else:
        free = free_memory(device)
        ceiling = max_num_seqs * (-(-max_model_len // block_size)) * per_block
        budget = min(int(free * memory_fraction), ceiling)
        source = f"{memory_fraction:.0%} of {fmt_bytes(free)} free"
    num_blocks = budget // per_block
    need_blocks = -(-max_model_len // block_size)
    if num_blocks < need_blocks:
        raise CapacityError(
            f"the KV cache ({fmt_bytes(budget)} from {source}) holds {num_blocks} blocks = "
            f"{num_blocks * block_size} tokens, but one sequence of max_model_len={max_model_len} "
            f"needs {need_blocks} blocks ({fmt_bytes(need_blocks * per_block)} at "
            f"{fmt_bytes(per_token)}/token); raise kv_cache_memory or lower max_model_len"
        )
    plan = MemoryPlan(
        weight_bytes(cfg, dtype, quantization, group_size) if weights is None else weights, per_token, block_size,
        int(num_blocks),
        max_model_len, quantization,
    )
    logger.info("memory plan: %s", plan.summary())
    return plan
