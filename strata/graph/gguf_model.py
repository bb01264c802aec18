"""A GGUF model as Strata sees any model: a directory with config.json and a tokenizer.

`gguf_model_dir(path)` parses the file(s) (graph/gguf_file.py: bounds-checked), turns the
metadata into an HF-style config.json and the tokenizer into tokenizer.json +
tokenizer_config.json (protocol/gguf_tokenizer.py), and writes them with `strata_gguf.json`
(which files hold the weights) into a small directory under $STRATA_CACHE/gguf, keyed on the
files' paths, sizes and modification times. Every part of Strata that reads a model directory
(the engine, the server's tokenizer process, tensor-parallel workers, `strata plan`) then works
unchanged; the weights stay in the GGUF and graph/loader.py reads them from there.

Tensor names are llama.cpp's (`blk.N.attn_q.weight`, ...), mapped here to the HF names the
loader's targets use. llama.cpp's converter permutes the rows of Llama's (and Mistral's) q and
k projections for its rotary layout (convert_hf_to_gguf.py, LlamaModel.permute); `unpermute_rows`
gives the row order back. Qwen2/Qwen3 are stored unpermuted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from strata.config import cache_root
from strata.errors import ModelLoadError
from strata.graph.gguf_blocks import BLOCKS, NIBBLE_CODES
from strata.graph.gguf_file import GGUFFile, TensorInfo, split_files
from strata.memory.quant import Layout
from strata.protocol.tokenizer_dir import GGUF_POINTER

logger = logging.getLogger(__name__)

POINTER = GGUF_POINTER  # in a derived directory: the GGUF files that hold its weights
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "gemma3": "Gemma3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}  # llama + experts: Mixtral
# whether llama.cpp renormalises the top-k routing weights (its build_moe_ffn norm_w, fixed per
# architecture: the file carries no norm_topk_prob), which a GGUF load follows
_NORM_TOPK = {"MixtralForCausalLM": True, "Qwen3MoeForCausalLM": True, "Qwen2MoeForCausalLM": False,
              "OlmoeForCausalLM": False}
# architectures whose norm weights the converter stored as 1 + w (Gemma's RMSNorm scales by 1 + w)
NORM_SHIFT = {"Gemma3ForCausalLM": 1.0}
# the (HF) architectures whose q/k rows llama.cpp's converter permutes (its LlamaModel: GGUF "llama")
PERMUTED_QK = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # MoE: the router, Qwen2-MoE's shared expert and its gate (the experts: expert_names)
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight", "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight", "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# an MoE layer's experts, one 3-D tensor [experts, out, in] per projection: (HF name, Mixtral's)
_EXPERTS = {"ffn_gate_exps.weight": ("gate_proj", "w1"), "ffn_up_exps.weight": ("up_proj", "w3"),
            "ffn_down_exps.weight": ("down_proj", "w2")}
# the architectures whose layer tensors differ from Llama's names (by HF architecture)
_LAYER_BY_ARCH = {
    # Phi-3 / Phi-4-mini: q/k/v and gate/up stay fused, as in their HF checkpoints
    "Phi3ForCausalLM": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
    # Gemma 3: a norm after attention and around the MLP (llama.cpp's ffn_norm is its pre-MLP norm)
    "Gemma3ForCausalLM": {"post_attention_norm.weight": "post_attention_layernorm.weight",
                          "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                          "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    "MixtralForCausalLM": {"ffn_gate_inp.weight": "block_sparse_moe.gate.weight"},
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
# tensors the config is made of (read by gguf_model_dir), never weights
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def hf_name(name: str, architecture: str = "LlamaForCausalLM") -> str | None:
    """The HF checkpoint name of a llama.cpp tensor name (None: not one the loader fills)."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        layer = {**_LAYER, **_LAYER_BY_ARCH.get(architecture, {})}
        if parts[2] in layer:
            return f"model.layers.{parts[1]}.{layer[parts[2]]}"
    return None


def expert_names(name: str, architecture: str, experts: int) -> list[str] | None:
    """The HF names of expert 0..experts-1's slices of a 3-D expert tensor (None: not one)."""
    parts = name.split(".", 2)
    if not (len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _EXPERTS):
        return None
    hf, mixtral = _EXPERTS[parts[2]]
    if architecture == "MixtralForCausalLM":
        return [f"model.layers.{parts[1]}.block_sparse_moe.experts.{e}.{mixtral}.weight" for e in range(experts)]
    return [f"model.layers.{parts[1]}.mlp.experts.{e}.{hf}.weight" for e in range(experts)]


def _moe(meta: dict[str, Any], cfg: dict[str, Any], tensors: dict[str, TensorInfo], arch: str, source: str) -> None:
    """An MoE file's fields: expert counts and width, llama.cpp's routing normalisation, the layers
    with no router (Qwen MoE's mlp_only_layers), Qwen2-MoE's shared expert, OLMoE's clamp."""
    a = arch + "."
    experts = _get(meta, a + "expert_count", source)
    name = "MixtralForCausalLM" if arch == "llama" else ARCHITECTURES[arch]
    cfg["architectures"] = [name]
    cfg["num_local_experts" if arch == "llama" else "num_experts"] = experts
    cfg["num_experts_per_tok"] = _get(meta, a + "expert_used_count", source)
    cfg["norm_topk_prob"] = _NORM_TOPK[name]
    if arch in ("qwen2moe", "qwen3moe"):
        cfg["moe_intermediate_size"] = _get(meta, a + "expert_feed_forward_length", source)
        cfg["mlp_only_layers"] = [i for i in range(cfg["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    if arch == "qwen2moe":
        cfg["shared_expert_intermediate_size"] = _get(meta, a + "expert_shared_feed_forward_length", source, int, 0)
        cfg["qkv_bias"] = "blk.0.attn_q.bias" in tensors
    clamp = meta.get(a + "attention.clamp_kqv")
    if arch == "olmoe" and isinstance(clamp, int | float) and clamp > 0:
        cfg["clip_qkv"] = float(clamp)


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation: HF row r is GGUF row order[r]."""
    head_dim = rows // heads
    gguf_order = np.arange(rows).reshape(heads, 2, head_dim // 2).swapaxes(1, 2).reshape(-1)
    # the converter wrote GGUF row i = HF row gguf_order[i]; invert it
    order = np.empty(rows, np.int64)
    order[gguf_order] = np.arange(rows)
    return order


def _get(meta: dict[str, Any], key: str, source: str, kind: type | tuple = int, default: Any = ...) -> Any:
    if key not in meta:
        if default is ...:
            raise ModelLoadError(f"{source}: GGUF metadata has no {key!r}; the file is incomplete "
                                 "(re-convert it with llama.cpp's convert_hf_to_gguf.py)")
        return default
    value = meta[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise ModelLoadError(f"{source}: GGUF metadata {key!r} = {str(value)[:80]!r} is not a {kind}")
    return value


def _llama3_rope(freqs: np.ndarray, theta: float, rotary_dim: int, source: str) -> dict[str, Any]:
    """Llama 3.1's rope_scaling from the per-frequency divisors llama.cpp stores as rope_freqs
    (convert_hf_to_gguf.py computes them from factor, low/high_freq_factor and the original
    context): the common parameter sets are tried and the one that reproduces the tensor kept."""
    inv_freq = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    wavelen = 2 * math.pi / inv_freq
    factor = float(freqs.max())
    candidates = [(low, high, 1 << k) for low, high in ((1.0, 4.0), (1.0, 2.0), (2.0, 4.0)) for k in range(4, 21)]
    for low, high, original in candidates:
        low_wl, high_wl = original / low, original / high
        smooth = (original / wavelen - low) / (high - low)
        want = np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, factor, 1.0 / ((1 - smooth) / factor + smooth)))
        if freqs.shape == want.shape and np.allclose(freqs, want, rtol=1e-4):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": original}
    raise ModelLoadError(f"{source}: the rope_freqs tensor (per-frequency rope divisors) matches no Llama 3 "
                         "rope_scaling Strata knows; load the original safetensors checkpoint instead")


def _phi3(meta: dict[str, Any], cfg: dict[str, Any], factors: dict[str, np.ndarray], source: str) -> None:
    """Phi-3 / Phi-4-mini fields: partial rotary, the sliding window (0: none), longrope factors."""
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    rotary = _get(meta, "phi3.rope.dimension_count", source, int, head_dim)
    if rotary != head_dim:
        cfg["partial_rotary_factor"] = rotary / head_dim
    window = _get(meta, "phi3.attention.sliding_window", source, int, 0)
    cfg["sliding_window"] = window or None
    cfg["original_max_position_embeddings"] = _get(meta, "phi3.rope.scaling.original_context_length", source, int,
                                                   cfg["max_position_embeddings"])
    if factors:
        if set(factors) != {"rope_factors_long.weight", "rope_factors_short.weight"}:
            raise ModelLoadError(f"{source}: GGUF has {', '.join(factors)} but not both longrope factor tensors")
        cfg["rope_scaling"] = {"rope_type": "longrope",
                               "long_factor": [float(str(np.float32(v))) for v in factors["rope_factors_long.weight"]],
                               "short_factor": [float(str(np.float32(v))) for v in factors["rope_factors_short.weight"]]}


def _gemma3(meta: dict[str, Any], cfg: dict[str, Any], source: str) -> None:
    """Gemma 3 fields as llama.cpp reads them: the sliding window (every 6th layer global unless the
    file says), the local layers' rotary base 10000, attention scaled by head_dim^-0.5 but by
    (hidden / heads)^-0.5 in the 62-layer (27B) model, optional final logit soft-capping."""
    cfg["model_type"] = "gemma3_text"
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg["head_dim"] = head_dim
    cfg["sliding_window"] = _get(meta, "gemma3.attention.sliding_window", source, int)
    cfg["sliding_window_pattern"] = _get(meta, "gemma3.attention.sliding_window_pattern", source, int, 6)
    cfg["rope_local_base_freq"] = 10000.0
    wide = cfg["num_hidden_layers"] == 62
    cfg["query_pre_attn_scalar"] = float(cfg["hidden_size"] // cfg["num_attention_heads"] if wide else head_dim)
    cap = _get(meta, "gemma3.final_logit_softcapping", source, (int, float), None)
    cfg["final_logit_softcapping"] = None if cap is None else float(cap)
    cfg["hidden_activation"] = "gelu_pytorch_tanh"


def hf_config(meta: dict[str, Any], tensors: dict[str, TensorInfo], rope_freqs: np.ndarray | None,
              source: str, factors: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """An HF config.json dict for the GGUF metadata (ModelConfig.from_dict then checks it)."""
    arch = _get(meta, "general.architecture", source, str)
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{source}: GGUF architecture {arch!r} is not supported yet; Strata loads GGUF "
                             f"architectures {', '.join(ARCHITECTURES)} (use the safetensors checkpoint "
                             "for others)")
    a = arch + "."
    heads = _get(meta, a + "attention.head_count", source)
    hidden = _get(meta, a + "embedding_length", source)
    vocab = meta.get(a + "vocab_size") or len(meta.get("tokenizer.ggml.tokens") or []) or tensors["token_embd.weight"].shape[0]
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": _get(meta, a + "feed_forward_length", source),
        "num_hidden_layers": _get(meta, a + "block_count", source),
        "num_attention_heads": heads,
        "num_key_value_heads": _get(meta, a + "attention.head_count_kv", source, int, heads),
        # stored as f32: its shortest f32 spelling (1e-05, not 9.999999747378752e-06)
        "rms_norm_eps": float(str(np.float32(_get(meta, a + "attention.layer_norm_rms_epsilon", source, float)))),
        "rope_theta": float(_get(meta, a + "rope.freq_base", source, (int, float), 10000.0)),
        "max_position_embeddings": _get(meta, a + "context_length", source),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
        # the embedding's own float type; a quantised one dequantizes exactly only to fp32
        "torch_dtype": {"F16": "float16", "BF16": "bfloat16"}.get(tensors["token_embd.weight"].type.name, "float32"),
    }
    head_dim = meta.get(a + "attention.key_length")
    if head_dim and head_dim != hidden // heads:
        cfg["head_dim"] = head_dim
    for key, hf in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if isinstance(meta.get(key), int):
            cfg[hf] = meta[key]
    scaling = meta.get(a + "rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(_get(meta, a + "rope.scaling.factor", source, (int, float)))}
    elif scaling == "yarn":
        cfg["rope_scaling"] = {
            "rope_type": "yarn", "factor": float(_get(meta, a + "rope.scaling.factor", source, (int, float))),
            "original_max_position_embeddings": _get(meta, a + "rope.scaling.original_context_length", source),
        }
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"{source}: GGUF rope scaling type {scaling!r} is not supported (linear, yarn)")
    if rope_freqs is not None:
        rotary = meta.get(a + "rope.dimension_count") or cfg.get("head_dim") or hidden // heads
        cfg["rope_scaling"] = _llama3_rope(rope_freqs, cfg["rope_theta"], rotary, source)
    if arch == "phi3":
        _phi3(meta, cfg, factors or {}, source)
    elif arch == "gemma3":
        _gemma3(meta, cfg, source)
    if meta.get(a + "expert_count"):
        _moe(meta, cfg, tensors, arch, source)
    return cfg


# Part of a derived directory's key: bump it when what gguf_model_dir writes changes, so a
# directory written by an older Strata is not reused.
DERIVED_VERSION = 5


def _key(files: list[Path]) -> str:
    h = hashlib.sha256(f"strata-gguf-{DERIVED_VERSION}\0".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:16]


def read_gguf(files: list[Path]) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """Metadata (the first file's) and every tensor of a single or split GGUF model."""
    metadata: dict[str, Any] = {}
    tensors: dict[str, TensorInfo] = {}
    for i, f in enumerate(files):
        with GGUFFile(f) as g:
            if i == 0:
                metadata = g.metadata
            for name, info in g.tensors.items():
                if name in tensors:
                    raise ModelLoadError(f"{f}: tensor {name!r} is also in {tensors[name].path.name}")
                tensors[name] = info
    return metadata, tensors


def find_gguf(directory: Path) -> Path | None:
    """The GGUF model file in a directory with no config.json (the first part of a split); None if
    it has none; more than one model is an error naming them."""
    ggufs = sorted(p for p in directory.glob("*.gguf") if p.is_file())
    models = [p for p in ggufs if "-of-" not in p.name or "-00001-of-" in p.name]
    if not models:
        return None
    if len(models) > 1:
        raise ModelLoadError(f"{directory}: holds {len(models)} GGUF models ({', '.join(p.name for p in models)}); "
                             f"pass --model with the one file to load, or {directory}:TYPE (e.g. :Q4_K_M)")
    return models[0]


def gguf_model_dir(path: Path) -> Path:
    """The derived model directory of a .gguf file (made on first use, reused while the file is
    unchanged)."""
    files = split_files(path)
    out = cache_root() / "gguf" / f"{path.stem.split('-00001-of-')[0]}-{_key(files)}"
    if (out / POINTER).is_file():
        return out
    metadata, tensors = read_gguf(files)
    source = str(path)
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{source}: GGUF has no 'token_embd.weight' tensor; not a complete model")
    vectors = {}
    for name in CONFIG_TENSORS:
        if name in tensors:
            info = tensors[name]
            if info.type.name != "F32" or len(info.shape) != 1:
                raise ModelLoadError(f"{source}: {name} is {info.type.name} {list(info.shape)}, expected a 1-D F32 vector")
            with GGUFFile(info.path) as g:
                vectors[name] = g.read(info, 0, 1).view(np.float32).reshape(-1).astype(np.float64)
    rope_freqs = vectors.pop("rope_freqs.weight", None)
    config = hf_config(metadata, tensors, rope_freqs, source, vectors)
    files_text = {}
    if "tokenizer.ggml.model" in metadata:
        from strata.protocol.gguf_tokenizer import tokenizer_files  # only a GGUF load needs it

        files_text = tokenizer_files(metadata, source)
    else:
        logger.warning("%s: the GGUF has no tokenizer (tokenizer.ggml.model): only token-id prompts will work", source)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for name, text in files_text.items():
        (tmp / name).write_text(text)
    types = Counter(t.type.name for n, t in tensors.items() if n.startswith("blk.") and len(t.shape) >= 2)
    pointer = {"files": [str(f.resolve()) for f in files], "projection_types": dict(types.most_common()),
               "tensor_types": {n: t.type.name for n, t in tensors.items()}}
    (tmp / POINTER).write_text(json.dumps(pointer, indent=2))
    try:
        os.rename(tmp, out)
    except OSError:  # another process made it first
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    logger.info("%s: GGUF %s, %d tensors (%s); config and tokenizer in %s", path.name, metadata.get("general.architecture"),
                len(tensors), ", ".join(sorted({t.type.name for t in tensors.values()})), out)
    return out


def derived_dir(local: Path) -> Path | None:
    """The derived model directory for a .gguf file, or for a directory with no config.json that
    holds one; None for anything else (an ordinary model directory)."""
    if local.is_file() and local.suffix == ".gguf":
        return gguf_model_dir(local)
    if local.is_dir() and not (local / "config.json").is_file():
        found = find_gguf(local)
        return gguf_model_dir(found) if found else None
    return None


def gguf_files(directory: Path) -> list[Path] | None:
    """The GGUF files behind a derived directory, or None for an ordinary model directory."""
    pointer = directory / POINTER
    if not pointer.is_file():
        return None
    files = [Path(f) for f in json.loads(pointer.read_text())["files"]]
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"{directory}: its GGUF file {f} is gone; pass --model the file again")
    return files


# The weight storage a GGUF file's projections are served in when --quantization is not given:
# the Strata storage whose layouts hold the file's tensors exactly (per module by gguf_formats).
_STORAGE = {"Q4_0": ("int4", 32), "Q4_1": ("int4", 32), "Q5_0": ("int8", 0), "Q5_1": ("int8", 0),
            "Q4_K": ("int4", 32), "Q5_K": ("int8", 0), "Q6_K": ("int8", 0), "Q8_0": ("int8", 0),
            "BF16": ("bf16", 0)}  # F16 / F32: as they are (F16 in bf16 would lose 3 mantissa bits)


def default_storage(directory: Path) -> tuple[str | None, int, str]:
    """(quantization, group size, why) for a derived GGUF directory's most common projection type;
    (None, 0, ...) for F32 / F16 weights (served in --dtype)."""
    pointer = json.loads((directory / POINTER).read_text())
    types = pointer.get("projection_types") or {}
    main = max(types, key=types.get) if types else "F32"
    method, group = _STORAGE.get(main, (None, 0))
    exact = main in EXACT
    why = (f"GGUF projections {', '.join(f'{k} x{v}' for k, v in types.items())}: served as "
           f"{method or 'float32'}{f' group {group}' if group else ''}"
           f"{'' if exact else ' (requantised from ' + main + ': close to, not bit-equal to, the file)'}")
    held = [f"{k} -> {describe_layout(_layout({k}, method))}" for k in types
            if method in ("int8", "int4") and _layout({k}, method) is not None]
    if held:
        why += "; held exactly: " + ", ".join(held) + " (a fused module: the layout holding all its tensors)"
    return method, group, why


def describe_layout(layout: Layout) -> str:
    """'int4 group 32 with zero points', 'int8 by 16 columns', 'int8 per row'."""
    method, group, zero = layout
    shape = (f"group {group}" if method == "int4" else f"by {group} columns") if group else "per row"
    return f"{method} {shape}" + (" with zero points" if zero else "")


def _module_of(hf: str, tied: bool) -> str | None:
    """Our (fused) projection module for an HF weight name (graph/loader.checkpoint_targets)."""
    if hf == "lm_head.weight" or (tied and hf == "model.embed_tokens.weight"):
        return "lm_head"
    m = re.fullmatch(r"model\.(layers\.\d+)\.(self_attn|mlp|mlp\.experts\.\d+|mlp\.shared_expert|"
                     r"block_sparse_moe\.experts\.\d+)\.(\w+?)(_proj)?\.weight", hf)
    if not m or (m[4] is None and m[3] not in ("w1", "w2", "w3")):
        return None
    fused = {"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gate_up", "up": "gate_up", "w1": "gate_up",
             "w3": "gate_up", "w2": "down"}.get(m[3], m[3])
    return f"{m[1]}.{m[2].replace('block_sparse_moe', 'mlp')}.{fused}_proj"


EXACT = ("Q4_0", "Q8_0", "Q5_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "BF16", "F16", "F32")  # held bit for bit


def _layout(held: set[str], storage: str) -> Layout | None:
    """The layout a projection holding tensors of types `held` takes under int8 / int4 storage."""
    blocks = [BLOCKS.get(T[h]) if h in T.__members__ else None for h in held]
    if None in blocks:  # a float (or unknown) tensor in it: the storage's own format, requantised
        return Layout("int8", 0) if storage == "int4" else None
    zero = any(b[2] for b in blocks)
    if all(T[h] in NIBBLE_CODES for h in held):  # 16 levels: int4 holds them, at half int8's bytes
        return Layout("int4", 32, zero)
    return Layout("int8", min(b[0] for b in blocks), zero)


def gguf_formats(directory: Path, tied: bool, storage: str | None) -> dict[str, Layout]:
    """The Layout of each projection module whose layout the file decides, under int8 or int4
    storage (memory/quant.quantize_model's `formats`): every quantised block type is held exactly
    (graph/gguf_blocks.py): a module of Q4_0 / Q4_1 / Q4_K tensors in int4 group 32, any other mix
    of block types in grouped int8 (groups of 16 if it holds a Q6_K, else 32), with zero points
    where a type has minima. A fused module (qkv, gate_up) takes the layout that holds all its
    tensors (Q4_K_M's [Q4_K; Q4_K; Q6_K] qkv: int8 group 16 with zero points). Under int4, a
    module holding a float tensor is int8 per row (llama.cpp's mixes keep such tensors wide)."""
    if storage not in ("int8", "int4"):
        return {}
    types = json.loads((directory / POINTER).read_text()).get("tensor_types") or {}
    architecture = (json.loads((directory / "config.json").read_text()).get("architectures") or ["?"])[0]
    kinds: dict[str, set[str]] = {}
    config = json.loads((directory / "config.json").read_text())
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    for name, kind in types.items():
        for hf in expert_names(name, architecture, experts) or [hf_name(name, architecture)]:
            module = _module_of(hf, tied) if hf else None
            if module:
                kinds.setdefault(module, set()).add(kind)
    out = {}
    for module, held in kinds.items():
        layout = _layout(held, storage)
        if layout is not None:
            out[module] = layout
    return out
