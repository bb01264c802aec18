"""Random-weight checkpoints of named shapes, written as HF directories by our own code.

Benchmarks need realistic shapes, not trained weights; writing a real HF directory (config.json +
model.safetensors) means Strata and the peers (transformers, llama.cpp) load the same bytes.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from strata.config import cache_root
from strata.demo.random_tokenizer import write_tokenizer
from strata.demo.shapes import SHAPES
from strata.errors import ConfigError


def random_state_dict(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named tensors with N(0, 0.02) linears/embeddings and unit norms, deterministic in seed."""
    g = torch.Generator().manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    qkv_bias = cfg["architectures"][0] == "Qwen2ForCausalLM"

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    sd = {"model.embed_tokens.weight": rnd(vocab, h), "model.norm.weight": torch.ones(h)}
    if not cfg.get("tie_word_embeddings"):
        sd["lm_head.weight"] = rnd(vocab, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, rows in (("q", heads * d), ("k", kv * d), ("v", kv * d)):
            sd[f"{p}self_attn.{name}_proj.weight"] = rnd(rows, h)
            if qkv_bias:
                sd[f"{p}self_attn.{name}_proj.bias"] = rnd(rows)
        sd[f"{p}self_attn.o_proj.weight"] = rnd(h, heads * d)
        sd[f"{p}mlp.gate_proj.weight"] = rnd(inter, h)
        sd[f"{p}mlp.up_proj.weight"] = rnd(inter, h)
        sd[f"{p}mlp.down_proj.weight"] = rnd(h, inter)
        sd[f"{p}input_layernorm.weight"] = torch.ones(h)
        sd[f"{p}post_attention_layernorm.weight"] = torch.ones(h)
    return sd


def random_model_path(shape: str, seed: int = 0) -> Path:
    """Directory of a random-weight checkpoint of `shape`, created once under the cache dir."""
    if shape not in SHAPES:
        raise ConfigError(f"--random-model: unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    out = cache_root() / f"random-{shape}-s{seed}"
    if (out / "model.safetensors").is_file():
        _ensure_tokenizer(out, SHAPES[shape]["vocab_size"])
        return out
    cfg = dict(SHAPES[shape], torch_dtype="float32")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        save_file(random_state_dict(cfg, seed), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        _ensure_tokenizer(tmp, cfg["vocab_size"])
        try:
            tmp.rename(out)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _ensure_tokenizer(path: Path, vocab_size: int) -> None:
    """Give the checkpoint a tokenizer covering its vocabulary (serving benchmarks send text), when
    its vocabulary is at least the demo tokenizer's; smaller shapes take token-id prompts only."""
    if (path / "tokenizer.json").is_file():
        return
    try:
        write_tokenizer(path, vocab_size)
    except ValueError:
        pass
