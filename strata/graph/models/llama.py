"""The Llama-shaped decoder that Llama, Mistral, Qwen2, Qwen3, Gemma 3 and Phi-3 share.

Family differences are flags on ModelConfig: Qwen2 has q/k/v bias, Qwen3 has per-head q/k RMSNorm
and an explicit head_dim. Gemma 3 adds (1 + w) RMSNorms with a post-norm after attention and after
the MLP (GemmaDecoderLayer), GeGLU, embeddings scaled by sqrt(hidden), its own attention scale,
final logit soft-capping, and sliding-window layers interleaved with global ones, the two kinds with
their own rotary tables. Phi-3 is Llama-shaped (its checkpoint already fuses qkv and gate/up);
Phi-4-mini rotates only part of each head, with longrope scaling. q/k/v and gate/up are single
fused matmuls (the loader fills the slices). A layer with a window attends over its last `window`
tokens in every attention backend (kernels/attention: AttentionMetadata + the layer's window).

With attention metadata the model runs the engine's step over the paged KV cache ([T] flattened
tokens); without it, a plain causal forward over [B, L] (reference checks, training later).

The step's attention is two calls: the KV write (`write_kv`, plain tensor ops that graph/fusion.py
traces and fuses) and `attend_cached`, the step's prefill/decode split over the metadata, which is
a leaf for that tracer (torch.fx.wrap below). Run-time kernel choices (the CPU kernels, the cpu
backend's fused rotary + KV write + decode) ask kernels/dispatch.py's mode first, so the tracer
gets the torch reference paths without patching anything. Forwards hold the trace gate
(graph/trace_gate.py) shared: FX tracing patches torch.nn.Module.__call__ process-wide while it
runs, and so waits for them. The model is a plain module with no state between calls: the
platform's decode step (platform/cpu_decode_step.py on CPU: each Llama-shaped layer as one numba
call) runs all-decode steps beside it, from these same modules and weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.graph.layers import (
    GatedMLP,
    GemmaRMSNorm,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    apply_partial_rotary,
    apply_rotary,
)
from strata.graph.lora import project
from strata.graph.moe import MoEBlock
from strata.graph.trace_gate import TRACE_GATE
from strata.kernels.attention import (
    AttentionMetadata,
    attend_cached,
    fused_decode_attention,
    fused_decode_usable,
    write_kv,
)
from strata.kernels.attention.common import window_mask
from strata.model_config import ModelConfig

torch.fx.wrap("attend_cached")  # one leaf for graph/fusion.py's tracer (its split is Python control flow)


def _norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    return (GemmaRMSNorm if cfg.gemma_norms else RMSNorm)(dim, cfg.rms_norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.scale = cfg.attn_scale or self.head_dim**-0.5
        self.window = cfg.layer_window(layer)  # sliding attention window in tokens; None: full
        # partial rotary (Phi-4-mini): the rotated width, None when all of head_dim turns
        self.rotary_dim = cfg.rotary_dims if cfg.rotary_dims != self.head_dim else None
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        # OLMoE normalises the whole q and k projections, the others each head
        self.qk_norm_whole, self.clip_qkv = cfg.qk_norm_whole, cfg.clip_qkv
        self.q_norm = _norm(cfg, self.q_size if cfg.qk_norm_whole else self.head_dim) if cfg.qk_norm else None
        self.k_norm = _norm(cfg, self.kv_size if cfg.qk_norm_whole else self.head_dim) if cfg.qk_norm else None

    def _rotate(self, x, rope):
        return apply_rotary(x, rope) if self.rotary_dim is None else apply_partial_rotary(x, rope, self.rotary_dim)

    def forward(self, x, rope, meta: AttentionMetadata | None, kv_cache) -> torch.Tensor:
        qkv = project(self.qkv_proj, x)
        if self.qk_norm_whole:  # OLMoE: norm the q and k projections whole, then clamp q, k, v
            qkv = torch.cat((self.q_norm(qkv[..., : self.q_size]),
                             self.k_norm(qkv[..., self.q_size : self.q_size + self.kv_size]),
                             qkv[..., self.q_size + self.kv_size :]), dim=-1)
            if self.clip_qkv is not None:
                qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        per_head_norm = self.q_norm is not None and not self.qk_norm_whole
        if (meta is not None and not per_head_norm and self.rotary_dim is None
                and fused_decode_usable(qkv, kv_cache, meta)):
            if self.window is None:
                out = fused_decode_attention(qkv, rope, kv_cache, meta, self.heads, self.kv_heads, self.scale)
            else:
                out = fused_decode_attention(qkv, rope, kv_cache, meta, self.heads, self.kv_heads, self.scale,
                                             self.window)
            return project(self.o_proj, out)
        lead = qkv.shape[:-1]
        if not per_head_norm and self.rotary_dim is None:
            # q and k are adjacent in the fused output: rotate both in one pass
            qk = qkv[..., : self.q_size + self.kv_size].view(*lead, self.heads + self.kv_heads, self.head_dim)
            qk = apply_rotary(qk, rope)
            q, k = qk[..., : self.heads, :], qk[..., self.heads :, :]
        else:
            q = qkv[..., : self.q_size].view(*lead, self.heads, self.head_dim)
            k = qkv[..., self.q_size : self.q_size + self.kv_size].view(*lead, self.kv_heads, self.head_dim)
            if per_head_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self._rotate(q, rope), self._rotate(k, rope)
        v = qkv[..., self.q_size + self.kv_size :].view(*lead, self.kv_heads, self.head_dim)
        if meta is not None:
            write_kv(kv_cache, k, v, meta.slot_mapping)
            if self.window is None:  # the call graph/fusion.py and the compiled step know
                out = attend_cached(q, k, v, kv_cache, meta, self.scale)
            else:
                out = attend_cached(q, k, v, kv_cache, meta, self.scale, self.window)
        else:
            out = self._causal(q, k, v)
        return project(self.o_proj, out)

    def _causal(self, q, k, v) -> torch.Tensor:
        """Plain causal attention over [B, L, heads, d] (no cache)."""
        b, length = q.shape[:2]
        group = self.heads // self.kv_heads
        q = q.transpose(1, 2)
        k = k.transpose(1, 2).repeat_interleave(group, dim=1)
        v = v.transpose(1, 2).repeat_interleave(group, dim=1)
        if self.window is not None and length > self.window:
            pos = torch.arange(length, device=q.device)
            mask = window_mask(pos, pos, self.window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.transpose(1, 2).reshape(b, length, self.q_size)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act)

    def forward(self, x, residual, rope, meta, kv_cache):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, meta, kv_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class MoEDecoderLayer(DecoderLayer):
    """DecoderLayer whose MLP is the sparse mixture of experts (graph/moe.py)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__(cfg, layer)
        self.mlp = MoEBlock(cfg.hidden_size, cfg.moe, cfg.hidden_act)


class GemmaDecoderLayer(nn.Module):
    """Gemma's layer: (1 + w) norms before and after both attention and the MLP ("sandwich"), the
    residual added after each post-norm. Same calling convention as DecoderLayer: returns (the
    MLP branch, the residual stream before it), which the next layer (or the final norm) adds."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GatedMLP(h, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x, residual, rope, meta, kv_cache):
        if residual is not None:
            x = x + residual
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, meta, kv_cache))
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), x


class CausalLM(nn.Module):
    """Decoder-only LM; `forward` returns final hidden states, `compute_logits` the vocab logits."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        positions = max_positions or cfg.max_position_embeddings
        self.rotary = RotaryEmbedding(cfg.rotary_dims, positions, cfg.rope_theta, cfg.rope_scaling)
        # Gemma 3: the sliding-window layers turn with their own base (plain rotary)
        self.rotary_local = (RotaryEmbedding(cfg.rotary_dims, positions, cfg.rope_local_theta, None)
                             if cfg.rope_local_theta is not None else None)
        self.local_layers = frozenset(i for i in range(cfg.num_layers) if cfg.layer_window(i) is not None)
        # built on `meta` to be loaded (graph/loader.py): no random init, whose first call on meta
        # imports torch's reference ops (~1 s of every load)
        on_meta = torch.empty(0).device.type == "meta"
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size) if on_meta else None)
        def layer_cls(i: int) -> type[nn.Module]:
            return GemmaDecoderLayer if cfg.gemma_norms else MoEDecoderLayer if cfg.is_moe_layer(i) else DecoderLayer

        self.layers = nn.ModuleList(layer_cls(i)(cfg, i) for i in range(cfg.num_layers))
        self.norm = _norm(cfg, cfg.hidden_size)
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
        if self.config.embed_scale is not None:  # Gemma: the scale in the weights' dtype, as transformers
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        residual = None
        rope = self.rotary(positions, x.dtype)
        local = self.rotary_local(positions, x.dtype) if self.rotary_local is not None else rope
        for i, layer in enumerate(self.layers):
            layer_rope = local if i in self.local_layers else rope
            cache = None if kv_caches is None else kv_caches[i]
            x, residual = layer(x, residual, layer_rope, meta, cache)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.cap_logits(self.lm_head(hidden))

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's logits as the model gives them: Gemma's final soft-capping, else as they are
        (a decode step that ran the head itself hands its logits here)."""
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
