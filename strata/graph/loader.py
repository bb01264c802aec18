"""HF model directory -> CausalLM: streams safetensors tensor by tensor, fusing q/k/v and gate/up.

The model is built on the `meta` device and materialised empty in its final dtype, so peak memory
is about one copy of the weights; a model whose weights do not fit in the free memory of the device
is refused before anything is allocated (check_weights_fit). Pickle checkpoints (*.bin, *.pt) are
refused: unpickling runs code.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from strata.errors import ModelLoadError
from strata.graph.hub import check_model_dir
from strata.graph.models.llama import CausalLM
from strata.memory.arena import arena_tensors
from strata.memory.planner import free_memory, weight_bytes
from strata.model_config import ModelConfig
from strata.text_table import fmt_bytes

logger = logging.getLogger(__name__)

_CONVERT_HINT = (
    "Strata loads only safetensors (pickle checkpoints can run code when loaded). Convert it once, "
    "in an environment you trust, with: python -c \"from transformers import AutoModelForCausalLM as M; "
    "M.from_pretrained('{p}').save_pretrained('{p}', safe_serialization=True)\""
)


@dataclass
class _Target:
    param: torch.Tensor
    rows: slice | None  # destination rows of a fused weight; None = the whole tensor


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory (single file, sharded with index, or any)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ModelLoadError(f"{index}: cannot read the shard index ({e})") from None
        files = [path / n for n in names]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: shard listed in {index.name} is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for ext in ("*.bin", "*.pt", "*.pth", "*.ckpt") for p in path.glob(ext))
    if pickles:
        raise ModelLoadError(
            f"{path}: found only pickle checkpoint(s) {', '.join(pickles)}. " + _CONVERT_HINT.format(p=path)
        )
    raise ModelLoadError(f"{path}: no model.safetensors (or sharded *.safetensors with an index) found")


def model_bytes(cfg: ModelConfig, dtype: torch.dtype, max_positions: int | None = None) -> int:
    """Bytes the loaded model holds: its weights in `dtype` plus the rotary cos/sin tables (fp32,
    graph/layers.py), which are allocated when the model is built."""
    positions = max_positions or cfg.max_position_embeddings
    tables = 2 if cfg.rope_local_theta is not None else 1  # Gemma 3: a second table for its local layers
    return weight_bytes(cfg, dtype) + tables * 2 * positions * 2 * (-(-cfg.rotary_dims // 2)) * 4


def check_weights_fit(
    cfg: ModelConfig, dtype: torch.dtype, device: str, max_positions: int | None, path: Path | str
) -> None:
    """Refuse, before allocating anything, a model that does not fit in the memory available on
    `device`: psutil's available memory on CPU, cudaMemGetInfo's free memory on CUDA."""
    need = model_bytes(cfg, dtype, max_positions)
    available = free_memory(device)
    if need <= available:
        return
    name = str(dtype).removeprefix("torch.")
    where = f"free memory on {device}" if device.startswith("cuda") else "available CPU memory"
    fixes = []
    if dtype.itemsize > 2:
        fixes.append(f"load in a smaller dtype (--dtype bfloat16 needs "
                     f"{fmt_bytes(model_bytes(cfg, torch.bfloat16, max_positions))})")
    machine = "a GPU" if device.startswith("cuda") else "a machine"
    fixes += ["use a smaller model", f"run on {machine} with more than {fmt_bytes(need)} free"]
    raise ModelLoadError(
        f"{path}: the model needs {fmt_bytes(need)} ({need:,} bytes: {cfg.num_params() / 1e9:.2f}B "
        f"parameters in {name}), but only {fmt_bytes(available)} ({available:,} bytes) of {where} is "
        f"left; refused before allocating. Fix: {', '.join(fixes[:-1])} or {fixes[-1]} (--quantization "
        "int8/int4 does not lower this peak: the weights are loaded in --dtype first, then quantised)"
    )


def checkpoint_targets(model: CausalLM, cfg: ModelConfig) -> dict[str, _Target]:
    """HF checkpoint tensor name -> where it lives in our (fused) model (loading fills these
    slices; the training export reads them back out)."""
    t: dict[str, _Target] = {"model.embed_tokens.weight": _Target(model.embed_tokens.weight, None)}
    t["model.norm.weight"] = _Target(model.norm.weight, None)
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = _Target(model.lm_head.weight, None)
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    # Phi-3's checkpoints fuse q/k/v and gate/up already (in our order): whole tensors, not slices
    fused = cfg.architecture == "Phi3ForCausalLM"
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        qkv_rows = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
        if fused:
            t[f"{p}self_attn.qkv_proj.weight"] = _Target(attn.qkv_proj.weight, None)
            qkv_rows = {}
        for name, rows in qkv_rows.items():
            t[f"{p}self_attn.{name}_proj.weight"] = _Target(attn.qkv_proj.weight, rows)
            if cfg.qkv_bias:
                t[f"{p}self_attn.{name}_proj.bias"] = _Target(attn.qkv_proj.bias, rows)
        t[f"{p}self_attn.o_proj.weight"] = _Target(attn.o_proj.weight, None)
        if cfg.o_bias:
            t[f"{p}self_attn.o_proj.bias"] = _Target(attn.o_proj.bias, None)
        if cfg.qk_norm:
            t[f"{p}self_attn.q_norm.weight"] = _Target(attn.q_norm.weight, None)
            t[f"{p}self_attn.k_norm.weight"] = _Target(attn.k_norm.weight, None)
        gate_up_rows = {"gate": slice(0, inter), "up": slice(inter, 2 * inter)}
        if fused:
            t[f"{p}mlp.gate_up_proj.weight"] = _Target(mlp.gate_up_proj.weight, None)
            gate_up_rows = {}
        for name, rows in gate_up_rows.items():
            t[f"{p}mlp.{name}_proj.weight"] = _Target(mlp.gate_up_proj.weight, rows)
            if cfg.mlp_bias:
                t[f"{p}mlp.{name}_proj.bias"] = _Target(mlp.gate_up_proj.bias, rows)
        t[f"{p}mlp.down_proj.weight"] = _Target(mlp.down_proj.weight, None)
        if cfg.mlp_bias:
            t[f"{p}mlp.down_proj.bias"] = _Target(mlp.down_proj.bias, None)
        t[f"{p}input_layernorm.weight"] = _Target(layer.input_layernorm.weight, None)
        t[f"{p}post_attention_layernorm.weight"] = _Target(layer.post_attention_layernorm.weight, None)
        if cfg.gemma_norms:
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                t[f"{p}{name}.weight"] = _Target(getattr(layer, name).weight, None)
    return t


def materialize_in_arena(model: torch.nn.Module, align: int = 64) -> None:
    """Give every meta parameter CPU storage inside one arena (memory/arena.py: huge pages)."""
    params = list(model.named_parameters())  # tied weights appear once
    storages = arena_tensors([(p.shape, p.dtype) for _, p in params], align)
    for (name, _), storage in zip(params, storages):
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        setattr(module, attr, torch.nn.Parameter(storage, requires_grad=False))


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise ModelLoadError(
            f"{file}: corrupt or truncated safetensors file ({e}); re-download or re-save it"
        ) from None


def load_model(
    path: str | Path, dtype: torch.dtype, device: str = "cpu", max_positions: int | None = None
) -> CausalLM:
    """Build the model for an HF directory and fill it from its safetensors, streaming."""
    path = check_model_dir(path)
    cfg = ModelConfig.from_file(path / "config.json")
    files = weight_files(path)
    check_weights_fit(cfg, dtype, device, max_positions, path)
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions)
    model = model.to(dtype)
    if torch.device(device).type == "cpu":
        materialize_in_arena(model)
    else:
        model = model.to_empty(device=device)
    model.tie_weights()
    targets = checkpoint_targets(model, cfg)
    loaded: set[str] = set()
    ignored: list[str] = []
    with torch.no_grad():
        for file in files:
            with _open(file) as f:
                for name in f.keys():
                    target = targets.get(name)
                    if target is None:
                        ignored.append(name)
                        continue
                    dest = target.param if target.rows is None else target.param[target.rows]
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != tuple(dest.shape):
                        raise ModelLoadError(
                            f"{file.name}: tensor {name!r} has shape {list(shape)}, but config.json "
                            f"implies {list(dest.shape)}; the checkpoint and config.json disagree"
                        )
                    try:
                        tensor = f.get_tensor(name)
                    except Exception as e:
                        raise ModelLoadError(
                            f"{file}: cannot read tensor {name!r} ({e}); the file is corrupt or truncated"
                        ) from None
                    dest.copy_(tensor)
                    loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelLoadError(
            f"{path}: checkpoint is missing tensor(s) {', '.join(missing[:5])}{more} "
            f"in {', '.join(f.name for f in files)}"
        )
    unexpected = [n for n in ignored if not (n == "lm_head.weight" or n.endswith("rotary_emb.inv_freq"))]
    if unexpected:
        logger.warning("ignored %d unexpected tensor(s), e.g. %s", len(unexpected), unexpected[0])
    model.rotary.init_tables(device)
    if model.rotary_local is not None:
        model.rotary_local.init_tables(device)
    model.eval()
    return model
