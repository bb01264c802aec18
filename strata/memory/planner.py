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
    of an fp32 model, memory/bf16_weights.py) keeps every 2-D weight, embeddings included, in 2 bytes.
    layouts: memory.quant Layouts by projection module name (a GGUF's or a prequantized checkpoint's
    own: graph/gguf_model.gguf_formats, graph/prequantized.layouts), counted as they are held; a
    module they do not name takes `quantization`'s size, or stays in `dtype`."""
    mats = _named_matrices(cfg)
    float_params = cfg.num_params() - sum(n * k for _, n, k in mats)
    held = 0
    for name, n, k in mats:
        if layouts and name in layouts:
            held += layout_bytes(layouts[name], n, k)
        elif quantization in ("int8", "int4"):
            held += quantized_bytes(quantization, n, k, group_size)
        else:
            held += n * k * (2 if quantization == "bf16" else dtype.itemsize)
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    narrow = quantization == "bf16" or (quantization is not None and narrow_untied_embedding(
        cfg.torch_dtype, dtype, cfg.tie_word_embeddings))
    return (float_params - embed) * dtype.itemsize + embed * (2 if narrow else dtype.itemsize) + held


def _named_matrices(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    out = []
    for i in range(cfg.num_layers):
        out += [(f"layers.{i}.self_attn.qkv_proj", d * (cfg.num_heads + 2 * cfg.num_kv_heads), h),
                (f"layers.{i}.self_attn.o_proj", h, cfg.num_heads * d),
                (f"layers.{i}.mlp.gate_up_proj", 2 * inter, h), (f"layers.{i}.mlp.down_proj", h, inter)]
    return out + [("lm_head", cfg.vocab_size, h)]  # the tied embedding shares it


def streamed_weight_bytes(
    cfg: ModelConfig, dtype: torch.dtype, quantization: str | None = None, group_size: int = 64,
    layouts: dict | None = None,
) -> int:
    """The weight bytes one decode step reads: all of weight_bytes but an untied input embedding,
    of which a step reads one row per sequence (in the bytes it is held in: 2 where bf16 storage or
    quant.narrow_untied_embedding keeps it in bf16)."""
    if cfg.tie_word_embeddings:
        return weight_bytes(cfg, dtype, quantization, group_size, layouts)
    narrow = quantization == "bf16" or (quantization is not None and narrow_untied_embedding(
        cfg.torch_dtype, dtype, False))
    embed = cfg.vocab_size * cfg.hidden_size * (2 if narrow else dtype.itemsize)
    return weight_bytes(cfg, dtype, quantization, group_size, layouts) - embed


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
