"""ModelConfig: the parts of an HF config.json that the decoder families need."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from strata.config import DTYPES
from strata.errors import ConfigError, ModelLoadError

# architecture -> family flags; every family is a Llama-shaped decoder with small differences.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
}



@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: torch.dtype
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = d.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: unsupported architecture {arch!r}; Strata supports "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        flags = SUPPORTED_ARCHITECTURES[arch]
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            layers = int(d["num_hidden_layers"])
            inter = int(d["intermediate_size"])
            vocab = int(d["vocab_size"])
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing required field {e.args[0]!r}") from None
        rope = d.get("rope_parameters") or d.get("rope_scaling") or None
        rope_theta = d.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        if rope is not None:
            rope = dict(rope)
            rtype = rope.get("rope_type", rope.get("type", "default"))
            rope["rope_type"] = rtype
            if rtype not in ("default", "linear", "llama3"):
                raise ModelLoadError(
                    f"{source}: rope scaling type {rtype!r} is not supported; "
                    "supported: default, linear, llama3"
                )
            if rtype == "default":
                rope = None
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else (list(eos) if isinstance(eos, list) else [int(eos)])
        sliding = d.get("sliding_window")
        if arch.startswith("Qwen") and not d.get("use_sliding_window", False):
            sliding = None
        dtype_name = d.get("torch_dtype") or d.get("dtype") or "float32"
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            vocab_size=vocab,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=flags["qkv_bias"] or bool(d.get("attention_bias", False)),
            o_bias=bool(d.get("attention_bias", False)) and not arch.startswith("Qwen"),
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=flags["qk_norm"],
            sliding_window=int(sliding) if sliding else None,
            torch_dtype=DTYPES.get(str(dtype_name).replace("torch.", ""), torch.float32),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"{path}: config.json not found; a model directory needs one")
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{path}: cannot parse config.json ({e})") from None
        return cls.from_dict(d, str(path))

    def max_model_len(self, requested: int | None) -> int:
        """The context length an engine (and the planner) uses: `requested`, default the model's
        max_position_embeddings, refused above it, capped to the sliding window (sliding-window
        attention is not implemented; within the window it is exact)."""
        limit = self.max_position_embeddings
        want = requested or limit
        if want > limit:
            raise ConfigError(
                f"max_model_len: {want} exceeds the model's max_position_embeddings ({limit}); "
                f"use max_model_len <= {limit}"
            )
        if self.sliding_window is not None and want > self.sliding_window:
            want = self.sliding_window
        return want

    def num_params(self) -> int:
        """Parameter count implied by the shapes (embeddings counted once when tied)."""
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * d
        layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h
