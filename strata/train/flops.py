"""FLOPs of one training token (for MFU), from the model's shapes."""

from __future__ import annotations

from strata.model_config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a token's matmuls: everything but the embedding lookup (the LM
    head is a matmul even when tied to the embedding); of an MoE layer, the experts a token uses."""
    return cfg.num_params(active=True) - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2) \
        + cfg.vocab_size * cfg.hidden_size


def train_flops_per_token(cfg: ModelConfig, seq_len: int, lora_params: int | None = None) -> float:
    """6 x matmul parameters (forward 2, backward 4) + causal attention's QK^T and PV: 2 matmuls of
    2 x seq x head_dim FLOPs per head, halved by the mask, x3 for backward (PaLM's accounting).
    `lora_params` (a LoRA run): the frozen base's backward computes the inputs' gradients only, 4 x
    its matmul parameters in all, plus 6 x the adapter's."""
    attention = 6 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
    if lora_params is not None:
        return 4.0 * matmul_params(cfg) + 6.0 * lora_params + attention
    return 6.0 * matmul_params(cfg) + attention
