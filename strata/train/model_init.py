"""The model to train: the engine's own CausalLM (graph/models), from a named size, a config.json
or an HF checkpoint directory, in fp32 (master weights; autocast narrows the compute).

With --lora the model is a frozen base and must have trained weights: an HF checkpoint directory,
or a named size taken as the checkpoint `strata serve` serves for it (demo: the shipped demo
checkpoint; a random shape: its random-weight checkpoint, as --random-model), optionally held in
int8 / int4 (--quantization, the engine's formats)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
import torch
from torch import nn

from strata.demo.model import demo_config, demo_model_path
from strata.demo.random_models import SHAPES, random_model_path
from strata.demo.train_tokenizer import DEMO_DIR
from strata.errors import ConfigError
from strata.graph.loader import load_model
from strata.graph.models.llama import CausalLM
from strata.graph.moe import Router
from strata.model_config import ModelConfig

logger = logging.getLogger(__name__)

NAMED_SIZES = ("demo", *SHAPES)  # SHAPES has MoE ones too (tiny-moe: a 2-layer Qwen3-MoE)


@dataclass
class ModelSource:
    config: dict[str, Any]  # the config.json the export writes
    weights_dir: Path | None  # an HF checkpoint to start from, else a fresh initialisation
    tokenizer_dir: Path
    base_name: str | None = None  # --lora: the base as the adapter records it (lora.base_name)

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.config, "model config")


def resolve(model: str, tokenizer: str | None, lora: bool = False) -> ModelSource:
    """A named size, a config.json file, or a directory with config.json (+ safetensors to start from).
    `lora`: a frozen base, so trained weights (module docstring)."""
    path = Path(model)
    weights_dir = None
    if lora:
        return _resolve_base(model, tokenizer)
    if model in NAMED_SIZES:
        config = demo_config() if model == "demo" else dict(SHAPES[model])
        default_tok = DEMO_DIR  # the demo tokenizer ships in the package
    elif path.is_file():
        config = _read_json(path)
        default_tok = path.parent if (path.parent / "tokenizer.json").is_file() else DEMO_DIR
    elif path.is_dir() and (path / "config.json").is_file():
        config = _read_json(path / "config.json")
        weights_dir = path if any(path.glob("*.safetensors")) else None
        default_tok = path if (path / "tokenizer.json").is_file() else DEMO_DIR
    else:
        raise ConfigError(
            f"--model {model}: not a named size ({', '.join(NAMED_SIZES)}), a config.json, or a directory "
            "with config.json")
    config = {**config, "torch_dtype": "float32"}
    tok_dir = Path(tokenizer) if tokenizer else default_tok
    if not (tok_dir / "tokenizer.json").is_file():
        raise ConfigError(f"--tokenizer {tok_dir}: no tokenizer.json there")
    vocab = load_tokenizer(tok_dir).get_vocab_size(with_added_tokens=True)
    if model in NAMED_SIZES and vocab > config["vocab_size"]:
        # a named size is an architecture: its embedding grows to cover the tokenizer trained with
        config["vocab_size"] = -(-vocab // 64) * 64
        logger.info("--model %s: vocab_size raised to %d for the tokenizer in %s", model, config["vocab_size"], tok_dir)
    src = ModelSource(config, weights_dir, tok_dir)
    if vocab > src.model_config.vocab_size:
        raise ConfigError(
            f"the tokenizer in {tok_dir} has {vocab} tokens but the model's vocab_size is "
            f"{src.model_config.vocab_size}; give a model whose vocab_size covers it, or another --tokenizer")
    return src


def _resolve_base(model: str, tokenizer: str | None) -> ModelSource:
    named = model in NAMED_SIZES
    path = (demo_model_path() if model == "demo" else random_model_path(model)) if named else Path(model)
    if not (path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))):
        raise ConfigError(
            f"--lora --model {model}: a LoRA base needs trained weights; give an HF checkpoint directory "
            f"(config.json + *.safetensors) or a named size ({', '.join(NAMED_SIZES)})")
    src = resolve(str(path), tokenizer)
    src.base_name = path.name if named else model
    return src


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model {path}: cannot read it as JSON ({e})") from None
    ModelConfig.from_dict(data, str(path))  # validates, with messages naming the field
    return data


def load_tokenizer(tok_dir: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json"))


def init_weights(model: CausalLM, std: float, seed: int) -> None:
    """N(0, std) embeddings, projections and MoE routers, std / sqrt(2 x layers) for the two that
    write into the residual stream (o_proj, down_proj, as GPT-2), zero biases, unit norms; seeded."""
    g = torch.Generator().manual_seed(seed)
    residual_std = std / math.sqrt(2 * max(1, len(model.layers)))
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if module is model.lm_head and model.config.tie_word_embeddings:
                    continue
                s = residual_std if name.endswith(("o_proj", "down_proj")) else std
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) * s)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, Router):  # a plain weight, not a Linear (transformers: N(0, std))
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) * std)
            elif hasattr(module, "eps") and hasattr(module, "weight"):  # RMSNorm
                module.weight.fill_(1.0)


def build_model(src: ModelSource, seed: int, max_positions: int, frozen: bool = False,
                quantization: str | None = None, group_size: int = 64) -> CausalLM:
    """fp32 CausalLM in train mode with every parameter requiring grad; `frozen` (a LoRA base):
    the checkpoint as loaded (projections in `quantization`, if given), no parameter requiring grad."""
    if frozen:
        if src.weights_dir is None:  # resolve(lora=True) never gives one
            raise ConfigError("a frozen base needs a checkpoint directory")
        torch.manual_seed(seed)  # the run's draws (LoRA dropout) repeat, as a fresh model's init does
        model = load_model(src.weights_dir, torch.float32, max_positions=max_positions, storage=quantization,
                           group_size=group_size)
        for p in model.parameters():
            p.requires_grad_(False)
        return model.train()
    if src.weights_dir is not None:
        model = load_model(src.weights_dir, torch.float32, max_positions=max_positions)
        model = _plain_storage(model)
    else:
        torch.manual_seed(seed)
        model = CausalLM(src.model_config, max_positions)
        init_weights(model, float(src.config.get("initializer_range", 0.02)), seed)
    for p in model.parameters():
        p.requires_grad_(True)
    return model.train()


def _plain_storage(model: CausalLM) -> CausalLM:
    """Copy the loaded weights out of the read-mostly weight arena into ordinary tensors (the
    optimizer updates them in place; the arena is sized for inference)."""
    for name, p in list(model.named_parameters()):
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, nn.Parameter(p.detach().clone()))
    model.tie_weights()
    return model
