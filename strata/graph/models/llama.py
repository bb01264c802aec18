"""The Llama-shaped decoder that Llama, Mistral, Qwen2 and Qwen3 share.

Family differences are flags on ModelConfig: Qwen2 has q/k/v bias, Qwen3 has per-head q/k RMSNorm
and an explicit head_dim. q/k/v and gate/up are single fused matmuls (the loader fills the slices).

With attention metadata the model runs the engine's step over the paged KV cache ([T] flattened
tokens); without it, a plain causal forward over [B, L] (reference checks, training later).

The step's attention is two calls: the KV write (`write_kv`, plain tensor ops that graph/fusion.py
traces and fuses) and `attend_cached`, the step's prefill/decode split over the metadata, which is
a leaf for that tracer (torch.fx.wrap below). Run-time kernel choices (the CPU kernels, the cpu
backend's fused rotary + KV write + decode) ask kernels/dispatch.py's mode first, so the tracer
gets the torch reference paths without patching anything. Forwards hold the trace gate
(graph/trace_gate.py) shared: FX tracing patches torch.nn.Module.__call__ process-wide while it
runs, and so waits for them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.graph.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, apply_rotary
from strata.graph.trace_gate import TRACE_GATE
from strata.kernels.attention import (
    AttentionMetadata,
    attend_cached,
    fused_decode_attention,
    fused_decode_usable,
    write_kv,
)
from strata.model_config import ModelConfig

torch.fx.wrap("attend_cached")  # one leaf for graph/fusion.py's tracer (its split is Python control flow)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, rope, meta: AttentionMetadata | None, kv_cache) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if meta is not None and self.q_norm is None and fused_decode_usable(qkv, kv_cache, meta):
            out = fused_decode_attention(qkv, rope, kv_cache, meta, self.heads, self.kv_heads, self.scale)
            return self.o_proj(out)
        lead = qkv.shape[:-1]
        if self.q_norm is None:
            # q and k are adjacent in the fused output: rotate both in one pass
            qk = qkv[..., : self.q_size + self.kv_size].view(*lead, self.heads + self.kv_heads, self.head_dim)
            qk = apply_rotary(qk, rope)
            q, k = qk[..., : self.heads, :], qk[..., self.heads :, :]
        else:
            q = self.q_norm(qkv[..., : self.q_size].view(*lead, self.heads, self.head_dim))
            k = self.k_norm(
                qkv[..., self.q_size : self.q_size + self.kv_size].view(*lead, self.kv_heads, self.head_dim)
            )
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        v = qkv[..., self.q_size + self.kv_size :].view(*lead, self.kv_heads, self.head_dim)
        if meta is not None:
            write_kv(kv_cache, k, v, meta.slot_mapping)
            out = attend_cached(q, k, v, kv_cache, meta, self.scale)
        else:
            out = self._causal(q, k, v)
        return self.o_proj(out)

    def _causal(self, q, k, v) -> torch.Tensor:
        """Plain causal attention over [B, L, heads, d] (no cache)."""
        b, length = q.shape[:2]
        group = self.heads // self.kv_heads
        q = q.transpose(1, 2)
        k = k.transpose(1, 2).repeat_interleave(group, dim=1)
        v = v.transpose(1, 2).repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.transpose(1, 2).reshape(b, length, self.q_size)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x, residual, rope, meta, kv_cache):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, meta, kv_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class CausalLM(nn.Module):
    """Decoder-only LM; `forward` returns final hidden states, `compute_logits` the vocab logits."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (again after materialising from `meta`)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata | None = None,
        kv_caches: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        with TRACE_GATE.shared():  # no FX trace patches module calls while this forward runs
            return self._forward(input_ids, positions, meta, kv_caches)

    def _forward(self, input_ids, positions, meta, kv_caches) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rope, meta, None if kv_caches is None else kv_caches[i])
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
