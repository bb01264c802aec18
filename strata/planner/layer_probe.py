"""Measured prefill kernel times of one decoder layer at the model's own shapes (`this` device).

The roofline prices a prefill as FLOPs at one GEMM rate plus attention at one SDPA rate. On the
dev CPU that misses by ~25%: the model's GEMMs (K = 576..896) run ~12% under the 512-cube rate
`strata hw` measures, its attention heads (head_dim 64, GQA) ~25% under the probe's SDPA shape,
and the elementwise work between them (two residual add + RMSNorm, rotary on q and k, SiLU * up)
costs ~10% of the layer and appears in no FLOP count. So for `this` device the planner times
the pieces of one layer, built from Strata's own modules with random weights, at the prompt
length it predicts: the projections (GEMM), causal attention, and the whole layer; the
elementwise share is whole layer minus the two. The prediction composes these per-layer times
with the layer count, chunking and the lm_head read; nothing of the model itself is run. An MoE
model's layer is its MoE layer, the router seeded so the prompt's rows spread over the experts;
its "projections" are attention's plus the whole MoE block (expert GEMMs, routing, dispatch).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass

import torch

from strata.graph.layers import RotaryEmbedding
from strata.graph.models.llama import DecoderLayer, MoEDecoderLayer
from strata.graph.moe import MoEBlock
from strata.kernels.attention import AttentionMetadata, PrefillSpan, resolve_backend
from strata.model_config import ModelConfig
from strata.planner.decode_probe import init_routers, store_like_engine

logger = logging.getLogger(__name__)

# weight bytes the timed layers must span, so that every timed call streams its weights from
# DRAM as in the full model instead of finding them in the last-level cache
SPAN_BYTES = 96 * 2**20
MAX_COPIES = 4
REPEATS = 7
# prompts longer than this are timed at this many tokens and scaled (projections linearly,
# attention by its causal FLOPs): the GEMMs are at full rate well before 512 rows
PROBE_MAX_TOKENS = 512


@dataclass(frozen=True)
class LayerTimes:
    """Seconds of one decoder layer's prefill over `tokens` prompt tokens (no prior context)."""

    tokens: int
    gemm_s: float  # qkv, o, gate_up and down projections
    attention_s: float  # causal attention core (SDPA), GQA expansion included
    elementwise_s: float  # the rest of the layer: norms, residual adds, rotary, SiLU * up

    @property
    def layer_s(self) -> float:
        return self.gemm_s + self.attention_s + self.elementwise_s

    def scaled(self, layer_s: float) -> LayerTimes:
        """The same split, scaled to a whole-layer time measured another way."""
        r = layer_s / self.layer_s if self.layer_s > 0 else 1.0
        return LayerTimes(self.tokens, self.gemm_s * r, self.attention_s * r, self.elementwise_s * r)


_CACHE: dict[tuple, LayerTimes] = {}


def median_seconds(fn, device: torch.device, repeats: int = REPEATS, warmup: int = 0) -> float:
    """Median of `repeats` calls after `warmup` untimed ones: a prefill runs each layer once, so
    the typical call is the figure, not the luckiest one."""
    times = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure(cfg: ModelConfig, dtype: torch.dtype, tokens: int, device: str, quantization: str | None = None,
             group: int = 64) -> LayerTimes:
    dev = torch.device(device)
    torch.manual_seed(0)
    block = 16
    blocks = -(-tokens // block)
    with torch.inference_mode():
        # an MoE model's layer is one of its MoE layers (the router seeded: varied experts per row)
        layer_cls = MoEDecoderLayer if cfg.moe is not None and any(cfg.moe.sparse) else DecoderLayer

        def build() -> DecoderLayer:  # stored as the engine stores it: arena, bf16 / int8 / int4, GEMM marks
            layer = layer_cls(cfg).to(device=dev, dtype=dtype)
            init_routers(layer)
            store_like_engine(layer, quantization, group, device)
            return layer

        first = build()
        per_layer = sum(p.numel() * p.element_size() for p in [*first.parameters(), *first.buffers()])
        copies = max(1, min(MAX_COPIES, math.ceil(SPAN_BYTES / max(per_layer, 1))))
        layers = [first] + [build() for _ in range(copies - 1)]
        caches = [torch.zeros(2, blocks, block, cfg.num_kv_heads, cfg.head_dim, device=dev, dtype=dtype)
                  for _ in range(copies)]
        # the engine's own prefill step: flat [T, hidden] tokens, paged cache write, SDPA
        span = PrefillSpan(0, tokens, 0, torch.arange(blocks, device=dev), None)
        meta = AttentionMetadata(slot_mapping=torch.arange(tokens, device=dev), prefills=[span],
                                 num_prefill_tokens=tokens, decode_block_tables=None, decode_mask=None,
                                 backend="sdpa")
        rope = _rotary(cfg, tokens, dev)(torch.arange(tokens, device=dev), dtype)
        x = torch.randn(tokens, cfg.hidden_size, device=dev, dtype=dtype)
        residual = torch.randn_like(x)
        x_q = torch.randn(tokens, cfg.num_heads * cfg.head_dim, device=dev, dtype=dtype)
        x_i = torch.randn(tokens, cfg.intermediate_size, device=dev, dtype=dtype)
        q = torch.randn(tokens, cfg.num_heads, cfg.head_dim, device=dev, dtype=dtype)
        kv = torch.randn(tokens, cfg.num_kv_heads, cfg.head_dim, device=dev, dtype=dtype)
        turn = iter(range(10**9))

        def whole() -> None:
            i = next(turn) % copies
            layers[i](x, residual, rope, meta, caches[i])

        def projections() -> None:
            layer = layers[next(turn) % copies]
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj(x)
            attn.o_proj(x_q)
            if isinstance(mlp, MoEBlock):  # the whole block: its expert GEMMs with their routing and dispatch
                mlp(x)
                return
            mlp.gate_up_proj(x)
            mlp.down_proj(x_i)

        scale = cfg.head_dim**-0.5
        for _ in range(copies):
            whole()  # warm-up: first-call costs (allocator, kernel selection, numba)
        whole_s = median_seconds(whole, dev)
        gemm_s = median_seconds(projections, dev)
        sdpa = resolve_backend("sdpa")
        attn_s = median_seconds(lambda: sdpa.prefill(q, kv, kv, caches[0], span, scale), dev)
    elementwise = max(0.0, whole_s - gemm_s - attn_s)
    times = LayerTimes(tokens, gemm_s, attn_s, elementwise)
    logger.info("layer probe %s %s at %d tokens: gemm %.2f ms, attention %.2f ms, elementwise %.2f ms",
                cfg.architecture, str(dtype).replace("torch.", ""), tokens,
                gemm_s * 1e3, attn_s * 1e3, elementwise * 1e3)
    return times


def _rotary(cfg: ModelConfig, tokens: int, dev: torch.device):
    return RotaryEmbedding(cfg.head_dim, max(tokens, 1), cfg.rope_theta, cfg.rope_scaling).to(dev)


def probe_seconds(layer_gemm_s: float) -> float:
    """Rough cost of measure_prefill_layer for a layer whose projections take `layer_gemm_s`:
    warm-ups plus REPEATS whole layers plus REPEATS projection sets."""
    return layer_gemm_s * (MAX_COPIES + 2 * REPEATS)


def measure_prefill_layer(cfg: ModelConfig, dtype: torch.dtype, tokens: int, device: str = "cpu",
                          quantization: str | None = None, group: int = 64) -> LayerTimes:
    """Per-layer prefill times over `tokens` tokens with the weights stored as the engine stores
    them for `quantization` (cached per shape for this process)."""
    if tokens < 1:
        raise ValueError(f"tokens={tokens}: must be >= 1")
    key = (repr(cfg), dtype, tokens, device, quantization, group)  # ModelConfig holds dicts: not hashable
    if key not in _CACHE:
        _CACHE[key] = _measure(cfg, dtype, tokens, device, quantization, group)
    return _CACHE[key]
