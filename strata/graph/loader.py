"""HF model directory -> CausalLM: streams safetensors tensor by tensor, fusing q/k/v and gate/up.

The model is built on the `meta` device, converted there to its final weight storage (bf16, int8
or int4 projections: memory/bf16_weights.py, memory/quant.py), and only then given memory, once, in
its final format. Each checkpoint tensor is then read (graph/safetensors_file.py: plain reads, no
whole-file mapping) straight into its destination, or a few MB of rows at a time converted or
quantised on the way in. So the load peak is the final weights plus STAGING_BYTES, never a float
copy of the model (load_peak_bytes; `strata plan` states it). A model that does not fit in the free
memory of the device is refused before anything is allocated (check_weights_fit). Pickle
checkpoints (*.bin, *.pt) are refused: unpickling runs code.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from strata.errors import ModelLoadError
from strata.graph import prequantized
from strata.graph.gguf_file import GGUFFile
from strata.graph.gguf_model import (
    CONFIG_TENSORS,
    NORM_SHIFT,
    PERMUTED_QK,
    expert_names,
    gguf_files,
    gguf_formats,
    hf_name,
)
from strata.graph.gguf_weights import fill as gguf_fill
from strata.graph.hub import check_model_dir
from strata.graph.models.llama import CausalLM
from strata.graph.moe import MoEBlock
from strata.graph.pread_file import READ_CHUNK_BYTES
from strata.graph.safetensors_file import SafetensorsFile
from strata.memory.arena import materialize_in_arena
from strata.memory.bf16_weights import WidenedEmbedding, narrow_model
from strata.memory.planner import free_memory, weight_bytes
from strata.memory.quant import QuantLinear, narrow_untied_embedding, quantize_model
from strata.model_config import ModelConfig
from strata.text_table import fmt_bytes

logger = logging.getLogger(__name__)

_CONVERT_HINT = (
    "Strata loads only safetensors (pickle checkpoints can run code when loaded). Convert it once, "
    "in an environment you trust, with: python -c \"from transformers import AutoModelForCausalLM as M; "
    "M.from_pretrained('{p}').save_pretrained('{p}', safe_serialization=True)\""
)


# What a load holds beyond the final weights: one read chunk, its float copy and the quantiser's
# temporaries (memory/quant.QUANT_CHUNK_ELEMENTS), with room to spare
STAGING_BYTES = 256 << 20


@dataclass
class _Target:
    module: nn.Module
    attr: str  # "weight" or "bias" (or a norm's weight)
    rows: slice | None  # destination rows of a fused weight; None = the whole tensor

    @property
    def param(self) -> torch.Tensor:
        return getattr(self.module, self.attr)

    @property
    def shape(self) -> tuple[int, ...]:
        if isinstance(self.module, QuantLinear) and self.attr == "weight":
            full = (self.module.out_features, self.module.in_features)
        else:
            full = tuple(self.param.shape)
        if self.rows is None:
            return full
        return (self.rows.stop - self.rows.start, *full[1:])


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


def model_bytes(cfg: ModelConfig, dtype: torch.dtype, max_positions: int | None = None,
                storage: str | None = None, group_size: int = 64) -> int:
    """Bytes the loaded model holds: its weights in `dtype` (the projections in `storage`: bf16,
    int8 or int4) plus the rotary cos/sin tables (fp32, graph/layers.py)."""
    positions = max_positions or cfg.max_position_embeddings
    tables = 2 if cfg.rope_local_theta is not None else 1  # Gemma 3: a second table for its local layers
    return weight_bytes(cfg, dtype, storage, group_size) + tables * 2 * positions * 2 * (-(-cfg.rotary_dims // 2)) * 4


def load_peak_bytes(cfg: ModelConfig, dtype: torch.dtype, max_positions: int | None = None,
                    storage: str | None = None, group_size: int = 64) -> int:
    """The most memory a load holds at once: the final model plus the staging of one read chunk."""
    return model_bytes(cfg, dtype, max_positions, storage, group_size) + STAGING_BYTES


def check_weights_fit(
    cfg: ModelConfig, dtype: torch.dtype, device: str, max_positions: int | None, path: Path | str,
    storage: str | None = None, group_size: int = 64,
) -> None:
    """Refuse, before allocating anything, a model that does not fit in the memory available on
    `device`: psutil's available memory on CPU, cudaMemGetInfo's free memory on CUDA."""
    need = load_peak_bytes(cfg, dtype, max_positions, storage, group_size)
    available = free_memory(device)
    if need <= available:
        return
    name = str(dtype).removeprefix("torch.") + (f" with {storage} projections" if storage else "")
    where = f"free memory on {device}" if device.startswith("cuda") else "available CPU memory"
    fixes = []
    if dtype.itemsize > 2 and storage is None:
        fixes.append(f"load in a smaller dtype (--dtype bfloat16 needs "
                     f"{fmt_bytes(load_peak_bytes(cfg, torch.bfloat16, max_positions))})")
    for smaller in {None: ("int8", "int4"), "bf16": ("int8", "int4"), "int8": ("int4",)}.get(storage, ()):
        fixes.append(f"--quantization {smaller} (needs "
                         f"{fmt_bytes(load_peak_bytes(cfg, dtype, max_positions, smaller, group_size))})")
    machine = "a GPU" if device.startswith("cuda") else "a machine"
    fixes += ["use a smaller model", f"run on {machine} with more than {fmt_bytes(need)} free"]
    raise ModelLoadError(
        f"{path}: loading the model needs {fmt_bytes(need)} ({need:,} bytes: {cfg.num_params() / 1e9:.2f}B "
        f"parameters in {name}, plus {fmt_bytes(STAGING_BYTES)} of read staging), but only "
        f"{fmt_bytes(available)} ({available:,} bytes) of {where} is left; refused before allocating. "
        f"Fix: {', '.join(fixes[:-1])} or {fixes[-1]}"
    )


def checkpoint_targets(model: CausalLM, cfg: ModelConfig) -> dict[str, _Target]:
    """HF checkpoint tensor name -> where it lives in our (fused) model (loading fills these
    slices; the training export reads them back out). Works on a model whose projections are
    already in their storage format: a QuantLinear's "weight" is filled by quantising rows."""
    embed = model.embed_tokens
    if not hasattr(embed, "weight"):  # a tied, quantised embedding: the lm_head's rows
        embed = model.lm_head
    t: dict[str, _Target] = {"model.embed_tokens.weight": _Target(embed, "weight", None)}
    t["model.norm.weight"] = _Target(model.norm, "weight", None)
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = _Target(model.lm_head, "weight", None)
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    # Phi-3's checkpoints fuse q/k/v and gate/up already (in our order): whole tensors, not slices
    fused = cfg.architecture == "Phi3ForCausalLM"
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        qkv_rows = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
        if fused:
            t[f"{p}self_attn.qkv_proj.weight"] = _Target(attn.qkv_proj, "weight", None)
            qkv_rows = {}
        for name, rows in qkv_rows.items():
            t[f"{p}self_attn.{name}_proj.weight"] = _Target(attn.qkv_proj, "weight", rows)
            if cfg.qkv_bias:
                t[f"{p}self_attn.{name}_proj.bias"] = _Target(attn.qkv_proj, "bias", rows)
        t[f"{p}self_attn.o_proj.weight"] = _Target(attn.o_proj, "weight", None)
        if cfg.o_bias:
            t[f"{p}self_attn.o_proj.bias"] = _Target(attn.o_proj, "bias", None)
        if cfg.qk_norm:
            t[f"{p}self_attn.q_norm.weight"] = _Target(attn.q_norm, "weight", None)
            t[f"{p}self_attn.k_norm.weight"] = _Target(attn.k_norm, "weight", None)
        if cfg.is_moe_layer(i):  # the MoE layers' MLP tensors (no MLP bias in these families)
            t.update(_moe_targets(layer.mlp, cfg, p))
        else:
            gate_up_rows = {"gate": slice(0, inter), "up": slice(inter, 2 * inter)}
            if fused:
                t[f"{p}mlp.gate_up_proj.weight"] = _Target(mlp.gate_up_proj, "weight", None)
                gate_up_rows = {}
            for name, rows in gate_up_rows.items():
                t[f"{p}mlp.{name}_proj.weight"] = _Target(mlp.gate_up_proj, "weight", rows)
                if cfg.mlp_bias:
                    t[f"{p}mlp.{name}_proj.bias"] = _Target(mlp.gate_up_proj, "bias", rows)
            t[f"{p}mlp.down_proj.weight"] = _Target(mlp.down_proj, "weight", None)
            if cfg.mlp_bias:
                t[f"{p}mlp.down_proj.bias"] = _Target(mlp.down_proj, "bias", None)
        t[f"{p}input_layernorm.weight"] = _Target(layer.input_layernorm, "weight", None)
        t[f"{p}post_attention_layernorm.weight"] = _Target(layer.post_attention_layernorm, "weight", None)
        if cfg.gemma_norms:
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                t[f"{p}{name}.weight"] = _Target(getattr(layer, name), "weight", None)
    return t


def _gated_mlp_targets(mlp: nn.Module, prefix: str, names: tuple[str, str, str]) -> dict[str, _Target]:
    """A GatedMLP's three checkpoint tensors (gate, up, down: the names differ by family)."""
    inter = mlp.intermediate
    gate, up, down = names
    return {f"{prefix}{gate}.weight": _Target(mlp.gate_up_proj, "weight", slice(0, inter)),
            f"{prefix}{up}.weight": _Target(mlp.gate_up_proj, "weight", slice(inter, 2 * inter)),
            f"{prefix}{down}.weight": _Target(mlp.down_proj, "weight", None)}


def _moe_targets(block: nn.Module, cfg: ModelConfig, p: str) -> dict[str, _Target]:
    """An MoE layer's tensors: the router, each expert (Mixtral's block_sparse_moe.experts.E.w1/w3/w2,
    the others' mlp.experts.E.gate_proj/up_proj/down_proj), Qwen2-MoE's shared expert and its gate."""
    mixtral = cfg.architecture == "MixtralForCausalLM"
    base = f"{p}block_sparse_moe." if mixtral else f"{p}mlp."
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    t = {f"{base}gate.weight": _Target(block.gate, "weight", None)}
    for e, expert in enumerate(block.experts):
        t.update(_gated_mlp_targets(expert, f"{base}experts.{e}.", names))
    if block.shared_expert is not None:
        t.update(_gated_mlp_targets(block.shared_expert, f"{base}shared_expert.", names))
        t[f"{base}shared_expert_gate.weight"] = _Target(block.shared_expert_gate, "weight", None)
    return t


def convert_storage(model: CausalLM, storage: str | None, group_size: int, checkpoint_dtype: torch.dtype,
                    formats: dict[str, tuple[str, int]] | None = None) -> None:
    """Put the meta model's projections in their final storage before it gets any memory."""
    if storage == "bf16":
        narrow_model(model)
    elif storage is not None:
        quantize_model(model, storage, group_size, formats)
        embed = model.embed_tokens
        if isinstance(embed, nn.Embedding) and narrow_untied_embedding(checkpoint_dtype, embed.weight.dtype, False):
            weight = nn.Parameter(embed.weight.to(torch.bfloat16), requires_grad=False)
            model.embed_tokens = WidenedEmbedding.over(weight, embed.weight.dtype)


def _fill(f: SafetensorsFile, name: str, target: _Target) -> None:
    """Read tensor `name` into its target: straight into the destination where the dtypes match,
    else READ_CHUNK_BYTES of rows at a time, converted (or quantised) on the way in."""
    shape = f.shape(name)
    n, row = shape[0], math.prod(shape[1:])
    quantised = isinstance(target.module, QuantLinear) and target.attr == "weight"
    if quantised:
        start = 0 if target.rows is None else target.rows.start
        write = lambda a, rows: target.module.quantize_rows(start + a, rows)  # noqa: E731
    else:
        dest = target.param if target.rows is None else target.param[target.rows]
        if dest.device.type == "cpu" and dest.dtype == f.dtype(name) and dest.is_contiguous():
            f.read_rows(name, 0, n, out=dest)
            return
        write = lambda a, rows: dest[a : a + rows.shape[0]].copy_(rows)  # noqa: E731
    step = max(1, READ_CHUNK_BYTES // (4 * row))  # rows whose fp32 copy fits one chunk
    for a in range(0, n, step):
        write(a, f.read_rows(name, a, min(n, a + step)))


def _check_shape(f: SafetensorsFile, name: str, target: _Target) -> None:
    if f.shape(name) != target.shape:
        raise ModelLoadError(
            f"{f.path.name}: tensor {name!r} has shape {list(f.shape(name))}, but config.json "
            f"implies {list(target.shape)}; the checkpoint and config.json disagree"
        )


def _fill_prequantized(files: list[Path], targets: dict[str, _Target], scheme: prequantized.Scheme,
                       loaded: set[str], ignored: list[str]) -> None:
    """The safetensors path for a prequantized checkpoint: a quantized projection's tensors
    (qweight, scales, ...) read together, possibly across shards, and decoded into its module
    (graph/prequantized.py); every other tensor as load_model reads it."""
    opened = [SafetensorsFile(f) for f in files]
    try:
        where = {n: f for f in opened for n in f.names()}
        used: set[str] = set()
        for hf, target in targets.items():
            prefix = hf.removesuffix(".weight")
            if hf.endswith(".weight") and target.attr == "weight" and prequantized.holds(scheme, where, prefix):
                names = [f"{prefix}.{c}" for c in scheme.components() if f"{prefix}.{c}" in where]
                parts = {n.rsplit(".", 1)[1]: where[n].read_rows(n, 0, where[n].shape(n)[0] if where[n].shape(n) else 1)
                         for n in names}
                prequantized.fill_module(scheme, parts, target.module, target.rows, target.shape, hf)
                used.update(names)
                loaded.add(hf)
            elif hf in where:
                _check_shape(where[hf], hf, target)
                _fill(where[hf], hf, target)
                used.add(hf)
                loaded.add(hf)
        ignored.extend(n for n in where if n not in used)
    finally:
        for f in opened:
            f.close()


def _fill_from_gguf(files: list[Path], targets: dict[str, _Target], cfg: ModelConfig, loaded: set[str],
                    ignored: list[str]) -> None:
    """The GGUF path of load_model: llama.cpp tensor names mapped to the targets' HF names."""
    permuted = cfg.architecture in PERMUTED_QK
    experts = cfg.moe.num_experts if cfg.moe is not None else 0
    for file in files:
        with GGUFFile(file) as g:
            for name, info in g.tensors.items():
                stacked = expert_names(name, cfg.architecture, experts)
                if stacked is not None:  # an MoE layer's experts, one slice of the stack each
                    _fill_experts(g, info, stacked, targets, file, loaded)
                    continue
                hf = hf_name(name, cfg.architecture)
                target = targets.get(hf) if hf else None
                if target is None:
                    if name not in CONFIG_TENSORS:  # read into config.json's rope_scaling already
                        ignored.append(name)
                    continue
                vector = len(info.shape) == 1 and target.shape == (1, *info.shape)  # a gate [1, h] stored [h]
                if info.shape != target.shape and not vector:
                    raise ModelLoadError(
                        f"{file.name}: tensor {name!r} has shape {list(info.shape)}, but the GGUF metadata "
                        f"implies {list(target.shape)}; the file is inconsistent"
                    )
                heads = None
                if permuted and hf.endswith(("q_proj.weight", "q_proj.bias")):
                    heads = cfg.num_heads
                elif permuted and hf.endswith(("k_proj.weight", "k_proj.bias")):
                    heads = cfg.num_kv_heads
                shift = NORM_SHIFT.get(cfg.architecture, 0.0) if name.endswith("norm.weight") else 0.0
                gguf_fill(g, info, target.module, target.attr, target.rows, heads, shift)
                loaded.add(hf)


def _fill_experts(g: GGUFFile, info, names: list[str], targets: dict[str, _Target], file: Path,
                  loaded: set[str]) -> None:
    """A 3-D expert tensor [experts, out, in] into each expert's projection rows."""
    for e, hf in enumerate(names):
        target = targets.get(hf)
        if target is None or len(info.shape) != 3 or info.shape[0] != len(names) or info.shape[1:] != target.shape:
            want = [len(names), *target.shape] if target is not None else "an MoE layer's experts"
            raise ModelLoadError(f"{file.name}: tensor {info.name!r} has shape {list(info.shape)}, but the GGUF "
                                 f"metadata implies {want}; the file is inconsistent")
        gguf_fill(g, info, target.module, target.attr, target.rows, None, 0.0, expert=e)
        loaded.add(hf)


def load_model(
    path: str | Path, dtype: torch.dtype, device: str = "cpu", max_positions: int | None = None,
    storage: str | None = None, group_size: int = 64,
) -> CausalLM:
    """Build the model for an HF directory and fill it from its safetensors, streaming.

    storage: the projections' final format (None: `dtype`; "bf16" storage of an fp32 model,
    "int8", "int4" with `group_size`), reached tensor by tensor as the weights are read."""
    path = check_model_dir(path)
    cfg = ModelConfig.from_file(path / "config.json")
    ggufs = gguf_files(path)
    files = ggufs or weight_files(path)
    scheme = None if ggufs else prequantized.scheme_of(json.loads((path / "config.json").read_text()), path)
    fit_storage = storage or (scheme.storage if scheme is not None else None)
    check_weights_fit(cfg, dtype, device, max_positions, path, fit_storage,
                      scheme.group_size if scheme is not None and scheme.group_size in (32, 64, 128) else group_size)
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions)
    model = model.to(dtype)
    model.tie_weights()
    if scheme is not None and scheme.method != "fp8":  # the checkpoint's own layouts, exactly
        if storage not in (None, scheme.storage):
            raise ModelLoadError(f"{path}: the checkpoint is already quantized ({scheme.describe()}); "
                                 f"--quantization {storage} cannot change that: drop it")
        quantize_model(model, scheme.storage, 64, prequantized.layouts(scheme, prequantized.projection_parts(cfg)),
                       only_formats=True)
        logger.info("prequantized checkpoint: %s, held exactly", scheme.describe())
    else:
        formats = gguf_formats(path, cfg.tie_word_embeddings, storage) if ggufs else None
        convert_storage(model, storage, group_size, cfg.torch_dtype, formats)
    if torch.device(device).type == "cpu":
        materialize_in_arena(model)  # shared (tied) tensors stay shared
    else:
        model = model.to_empty(device=device)
        model.tie_weights()
    targets = checkpoint_targets(model, cfg)
    loaded: set[str] = set()
    ignored: list[str] = []
    with torch.no_grad():
        if ggufs:
            _fill_from_gguf(ggufs, targets, cfg, loaded, ignored)
        if scheme is not None:
            _fill_prequantized(files, targets, scheme, loaded, ignored)
        for file in [] if ggufs or scheme else files:
            with SafetensorsFile(file) as f:
                for name in f.names():
                    target = targets.get(name)
                    if target is None:
                        ignored.append(name)
                        continue
                    _check_shape(f, name, target)
                    _fill(f, name, target)
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
    for block in model.modules():
        if isinstance(block, MoEBlock):
            block.reset_token_counts(device)
    model.eval()
    return model
