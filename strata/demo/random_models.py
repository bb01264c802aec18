"""Random-weight checkpoints of named shapes, written as HF directories by our own code.

Benchmarks need realistic shapes, not trained weights; writing a real HF directory (config.json +
model.safetensors) means Strata and the peers (transformers, llama.cpp) load the same bytes. The
small shapes are one fp32 model.safetensors; the 1-8B shapes (BF16_SHAPES) are written tensor by
tensor as bf16 shards of <= SHARD_BYTES with model.safetensors.index.json, never a whole state
dict in memory (each tensor's values come from a generator seeded by (seed, tensor name)).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from strata.config import cache_root
from strata.demo.random_tokenizer import write_tokenizer
from strata.demo.shapes import BF16_SHAPES, SHAPES
from strata.errors import ConfigError
from strata.model_config import ModelConfig

log = logging.getLogger(__name__)

SHARD_BYTES = 2 * 10**9  # the cap of one bf16 shard (transformers' save_pretrained writes <= 5 GB)
INDEX = "model.safetensors.index.json"
_DRAW_ELEMS = 1 << 24  # fp32 elements drawn at once by random_tensor (64 MB)


def tensor_specs(cfg: dict) -> list[tuple[str, tuple[int, ...], bool]]:
    """(HF name, shape, is_norm) of every tensor of a shape, in checkpoint order, named as
    transformers saves them: Llama / Qwen2 (q/k/v biases) / Qwen3 (q/k norms) and the Qwen MoE
    families (mlp.gate = the router [experts, hidden], mlp.experts.E.gate_proj/up_proj/down_proj,
    Qwen2-MoE's shared expert and its gate). Norms are ones; the rest N(0, 0.02)."""
    m = ModelConfig.from_dict({"torch_dtype": "float32", **cfg})  # the flags and MoE layers, as Strata reads them
    h, vocab, heads, kv, d = m.hidden_size, m.vocab_size, m.num_heads, m.num_kv_heads, m.head_dim
    out = [("model.embed_tokens.weight", (vocab, h), False), ("model.norm.weight", (h,), True)]
    if not m.tie_word_embeddings:
        out.append(("lm_head.weight", (vocab, h), False))
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        for name, rows in (("q", heads * d), ("k", kv * d), ("v", kv * d)):
            out.append((f"{p}self_attn.{name}_proj.weight", (rows, h), False))
            if m.qkv_bias:
                out.append((f"{p}self_attn.{name}_proj.bias", (rows,), False))
        out.append((f"{p}self_attn.o_proj.weight", (h, heads * d), False))
        if m.qk_norm:
            q_rows, k_rows = (heads * d, kv * d) if m.qk_norm_whole else (d, d)
            out += [(f"{p}self_attn.q_norm.weight", (q_rows,), True), (f"{p}self_attn.k_norm.weight", (k_rows,), True)]
        out += _mlp_specs(m, i, f"{p}mlp.")
        out += [(f"{p}input_layernorm.weight", (h,), True), (f"{p}post_attention_layernorm.weight", (h,), True)]
    return out


def _mlp_specs(m: ModelConfig, i: int, p: str) -> list[tuple[str, tuple[int, ...], bool]]:
    """Layer i's MLP: the dense gate/up/down, or the router + each expert (+ a shared expert)."""
    h = m.hidden_size

    def gated(prefix: str, inter: int) -> list[tuple[str, tuple[int, ...], bool]]:
        return [(f"{prefix}gate_proj.weight", (inter, h), False), (f"{prefix}up_proj.weight", (inter, h), False),
                (f"{prefix}down_proj.weight", (h, inter), False)]

    if not m.is_moe_layer(i):
        return gated(p, m.intermediate_size)
    moe = m.moe
    if m.architecture not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"):
        raise ConfigError(f"random checkpoints: no tensor names for {m.architecture}'s experts")
    out = [(f"{p}gate.weight", (moe.num_experts, h), False)]
    for e in range(moe.num_experts):
        out += gated(f"{p}experts.{e}.", moe.intermediate_size)
    if moe.shared_intermediate_size:
        out += gated(f"{p}shared_expert.", moe.shared_intermediate_size)
        out.append((f"{p}shared_expert_gate.weight", (1, h), False))
    return out


def random_state_dict(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named fp32 tensors with N(0, 0.02) linears/embeddings and unit norms, deterministic in
    seed: one generator drawn in checkpoint order (the small shapes' single-file format)."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.ones(shape) if norm else torch.randn(*shape, generator=g) * 0.02
            for name, shape, norm in tensor_specs(cfg)}


def random_tensor(name: str, shape: tuple[int, ...], norm: bool, seed: int,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """One tensor of a sharded checkpoint: ones for a norm, else N(0, 0.02) from a generator seeded
    by (seed, name), so its values depend on neither the write order nor the shard size. Drawn in
    fp32 row blocks of at most _DRAW_ELEMS elements, so the fp32 transient stays small."""
    if norm:
        return torch.ones(shape, dtype=dtype)
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(shape[0], -1)
    step = max(1, _DRAW_ELEMS // flat.shape[1])
    for r in range(0, flat.shape[0], step):
        rows = min(step, flat.shape[0] - r)
        flat[r:r + rows] = torch.randn(rows, flat.shape[1], generator=g) * 0.02
    return out


def plan_shards(cfg: dict, max_shard_bytes: int,
                itemsize: int = 2) -> list[list[tuple[str, tuple[int, ...], bool]]]:
    """The tensors of each shard, in checkpoint order, each shard at most max_shard_bytes (a single
    larger tensor gets a shard of its own, as transformers' save_pretrained does)."""
    shards: list[list] = [[]]
    size = 0
    for spec in tensor_specs(cfg):
        nbytes = math.prod(spec[1]) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def iter_shards(cfg: dict, seed: int,
                max_shard_bytes: int | None = None) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """(file name, tensors) of each bf16 shard in turn (at most max_shard_bytes, default
    SHARD_BYTES), its tensors generated just before it is yielded; the generator keeps no reference
    to an earlier shard's tensors."""
    shards = plan_shards(cfg, SHARD_BYTES if max_shard_bytes is None else max_shard_bytes)
    for i, specs in enumerate(shards, 1):
        yield (f"model-{i:05d}-of-{len(shards):05d}.safetensors",
               {name: random_tensor(name, shape, norm, seed) for name, shape, norm in specs})


def write_sharded(cfg: dict, out: Path, seed: int = 0, max_shard_bytes: int | None = None) -> None:
    """Write cfg's random tensors into `out` as bf16 shards of at most max_shard_bytes each plus
    model.safetensors.index.json, one shard in memory at a time (one log line per shard)."""
    weight_map: dict[str, str] = {}
    total = 0
    for fname, tensors in iter_shards(cfg, seed, max_shard_bytes):
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        total += nbytes
        weight_map.update(dict.fromkeys(tensors, fname))
        del tensors  # before the next shard is generated
        log.info("random checkpoint: wrote %s (%.2f GB)", out / fname, nbytes / 1e9)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2))


def random_model_path(shape: str, seed: int = 0) -> Path:
    """Directory of a random-weight checkpoint of `shape`, created once under the cache dir: one
    fp32 model.safetensors for the small shapes, bf16 shards + index for BF16_SHAPES."""
    if shape not in SHAPES:
        raise ConfigError(f"--random-model: unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    out = cache_root() / f"random-{shape}-s{seed}"
    sharded = shape in BF16_SHAPES
    if (out / (INDEX if sharded else "model.safetensors")).is_file():
        _ensure_tokenizer(out, SHAPES[shape]["vocab_size"])
        return out
    if sharded:
        log.info("random checkpoint: writing %s once (bf16 shards; minutes for the big shapes)", out)
        write_random_checkpoint(out, SHAPES[shape], seed, sharded=True)
    else:
        write_random_checkpoint(out, dict(SHAPES[shape], torch_dtype="float32"), seed, sharded=False)
    return out


def write_random_checkpoint(out: Path, cfg: dict, seed: int = 0, *, sharded: bool,
                            max_shard_bytes: int | None = None) -> None:
    """Write an HF directory of cfg's random weights at `out` atomically (a temporary directory
    renamed into place; a concurrent writer that wins the race keeps its copy). sharded: bf16
    shards via write_sharded (config.json says torch_dtype bfloat16); else one fp32 file."""
    if sharded:
        cfg = dict(cfg, torch_dtype="bfloat16")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        if sharded:
            write_sharded(cfg, tmp, seed, max_shard_bytes)
        else:
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


def _ensure_tokenizer(path: Path, vocab_size: int) -> None:
    """Give the checkpoint a tokenizer covering its vocabulary (serving benchmarks send text), when
    its vocabulary is at least the demo tokenizer's; smaller shapes take token-id prompts only."""
    if (path / "tokenizer.json").is_file():
        return
    try:
        write_tokenizer(path, vocab_size)
    except ValueError:
        pass
