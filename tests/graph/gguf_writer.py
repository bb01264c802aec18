"""Tiny GGUF files for the tests, written from a transformers model with the `gguf` package's writer
the way llama.cpp's convert_hf_to_gguf.py writes them (tensor names, Llama's q/k row permutation,
rope_freqs for llama3 rope scaling), and the reference weights they dequantize to."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "Gemma3ForCausalLM": "gemma3",
        "MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe",
        "OlmoeForCausalLM": "olmoe"}
# Gemma 3's norms (llama.cpp's names; their weights stored as 1 + w, as the converter's norm_shift)
_GEMMA3 = {"post_attention_layernorm.weight": "post_attention_norm.weight",
           "pre_feedforward_layernorm.weight": "ffn_norm.weight",
           "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",  # Phi-3's, fused
    # MoE (transformers >= 5 names): the router, Qwen2-MoE's shared expert and its gate (a vector in
    # llama.cpp's files); the experts' 3-D tensors are split by _expert_tensors
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight", "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def _expert_tensors(hf: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """transformers' stacked experts as llama.cpp's: gate_up [E, 2i, h] -> ffn_gate_exps and
    ffn_up_exps [E, i, h]; down [E, h, i] -> ffn_down_exps."""
    if not hf.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return []
    layer = hf.split(".")[2]
    if hf.endswith("experts.gate_up_proj"):
        half = w.shape[1] // 2
        return [(f"blk.{layer}.ffn_gate_exps.weight", w[:, :half]), (f"blk.{layer}.ffn_up_exps.weight", w[:, half:])]
    return [(f"blk.{layer}.ffn_down_exps.weight", w)]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (q with n_head, k with n_head_kv)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str, arch: str = "llama") -> str | None:
    if arch == "gemma3" and hf.split(".", 3)[-1] in _GEMMA3:
        parts = hf.split(".", 3)
        return f"blk.{parts[2]}.{_GEMMA3[parts[3]]}"
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".", 3)
    return f"blk.{parts[2]}.{_LAYER[parts[3]]}" if parts[3] in _LAYER else None


def _rope(cfg) -> dict:
    """The rope parameters across transformers versions (rope_parameters, or rope_theta + rope_scaling)."""
    params = getattr(cfg, "rope_parameters", None)
    if params:
        return dict(params)
    return dict(getattr(cfg, "rope_scaling", None) or {}, rope_theta=getattr(cfg, "rope_theta", 10000.0))


def _llama3_factors(cfg) -> np.ndarray:
    s = _rope(cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / s["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wl - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out, np.float32)


# fp16 fields (byte offsets) of each K-quant block: d (and dmin) must be finite and small
_K_FP16 = {T.Q4_K: (144, (0, 2)), T.Q5_K: (176, (0, 2)), T.Q6_K: (210, (208,))}


def _random_k_blocks(rows: int, cols: int, kind: T, seed: int) -> np.ndarray:
    """Random K-quant blocks (the gguf package dequantizes K-quants but cannot make them): random
    quants and sub-block scales, with small finite fp16 super-block scales."""
    size, fp16_at = _K_FP16[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for at in fp16_at:
        d = rng.uniform(2e-4, 1e-3, (rows, cols // 256)).astype(np.float16)
        blocks[:, :, at:at + 2] = d.view(np.uint8).reshape(rows, cols // 256, 2)
    return blocks.reshape(rows, -1)


def write_gguf(hf_model, path: Path, matrix_type: T = T.F32, embed_type: T | None = None,
               split: int = 1, types: dict[str, T] | None = None) -> dict[str, torch.Tensor]:
    """Write `hf_model` as a GGUF (2-D projection weights in `matrix_type`, the embedding and
    output in `embed_type` (default: matrix_type), norms and biases F32; `split` > 1 writes
    -0000k-of-0000N parts; `types`: a GGUF tensor name's ending -> its type instead, as
    llama-quantize's mixes give, e.g. {"attn_v.weight": T.Q6_K}). Returns the HF state dict the
    file dequantizes to (the reference)."""
    cfg = hf_model.config
    arch = ARCH[type(hf_model).__name__]
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    tensors: list[tuple[str, np.ndarray, T]] = []
    reference: dict[str, torch.Tensor] = {}
    for hf, p in hf_model.state_dict().items():
        stacked = _expert_tensors(hf, p.detach().float().numpy())
        if stacked:
            backs = []
            for name, w in stacked:
                kind = next((t for end, t in (types or {}).items() if name.endswith(end)), matrix_type)
                rows = w.reshape(-1, w.shape[-1])
                data = (_random_k_blocks(*rows.shape, kind, seed=len(tensors)) if kind in _K_FP16 else rows
                        if kind == T.F32 else rows.astype(np.float16) if kind == T.F16 else gguf.quants.quantize(rows, kind))
                tensors.append((name, data.reshape(*w.shape[:-1], data.shape[-1]), kind))
                backs.append(torch.from_numpy(np.asarray(gguf.quants.dequantize(data, kind), np.float32).reshape(w.shape).copy()))
            reference[hf] = torch.cat(backs, dim=1)
            continue
        name = _gguf_name(hf, arch)
        if name is None or (hf == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        w = p.detach().float().numpy()
        shift = 1.0 if arch == "gemma3" and name.endswith("norm.weight") else 0.0
        w = w + np.float32(shift)
        if arch == "llama" and "q_proj" in hf:
            w = _permute(w, heads)
        elif arch == "llama" and "k_proj" in hf:
            w = _permute(w, kv_heads)
        kind = T.F32
        if name.endswith("ffn_gate_inp_shexp.weight"):
            w = w.reshape(-1)  # llama.cpp's shape: a vector
        if w.ndim == 2 and not name.endswith("ffn_gate_inp.weight"):  # routers stay F32 (as llama-quantize leaves them)
            kind = (embed_type or matrix_type) if name in ("token_embd.weight", "output.weight") else matrix_type
            kind = next((t for end, t in (types or {}).items() if name.endswith(end)), kind)
        if kind in _K_FP16:
            data = _random_k_blocks(*w.shape, kind, seed=len(tensors))
        elif kind == T.BF16:
            data = gguf.quants.quantize(w, kind)
        else:
            data = w if kind == T.F32 else w.astype(np.float16) if kind == T.F16 else gguf.quants.quantize(w, kind)
        tensors.append((name, data, kind))
        back = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, kind), np.float32).reshape(w.shape).copy())
        if arch == "llama" and ("q_proj" in hf or "k_proj" in hf):  # the reference is in HF row order
            h = heads if "q_proj" in hf else kv_heads
            back = back.reshape(h, head_dim // 2, 2, *back.shape[1:]).transpose(1, 2).reshape(back.shape)
        reference[hf] = (back - shift).reshape(p.shape)
    if _rope(cfg).get("rope_type") == "llama3":
        tensors.append(("rope_freqs.weight", _llama3_factors(cfg), T.F32))
    if arch == "phi3" and _rope(cfg).get("long_factor"):  # longrope, as convert_hf_to_gguf.py writes it
        tensors.append(("rope_factors_long.weight", np.array(_rope(cfg)["long_factor"], np.float32), T.F32))
        tensors.append(("rope_factors_short.weight", np.array(_rope(cfg)["short_factor"], np.float32), T.F32))
    parts = [tensors[i::split] for i in range(split)]
    paths = [path] if split == 1 else [path.with_name(f"{path.stem}-{k + 1:05d}-of-{split:05d}.gguf") for k in range(split)]
    for k, (part, out) in enumerate(zip(parts, paths)):
        w = gguf.GGUFWriter(str(out), arch)
        if k == 0:
            w.add_block_count(cfg.num_hidden_layers)
            w.add_context_length(cfg.max_position_embeddings)
            w.add_embedding_length(cfg.hidden_size)
            w.add_feed_forward_length(cfg.intermediate_size)
            w.add_head_count(heads)
            w.add_head_count_kv(kv_heads)
            w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
            rope = _rope(cfg)
            w.add_rope_freq_base(float(rope.get("full_attention", rope)["rope_theta"]))  # Gemma 3: the global layers
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
            w.add_vocab_size(cfg.vocab_size)
            w.add_bos_token_id(cfg.bos_token_id)
            w.add_eos_token_id(cfg.eos_token_id)
            experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
            if experts:
                w.add_expert_count(experts)
                w.add_expert_used_count(cfg.num_experts_per_tok)
                if arch in ("qwen2moe", "qwen3moe"):
                    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
                if arch == "qwen2moe":
                    w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
                if arch == "olmoe" and cfg.clip_qkv:
                    w.add_clamp_kqv(cfg.clip_qkv)
            if arch == "gemma3":
                w.add_sliding_window(cfg.sliding_window)
                if cfg.final_logit_softcapping:
                    w.add_final_logit_softcapping(cfg.final_logit_softcapping)
            if arch == "phi3":
                rope = _rope(cfg)
                w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)
                                                        or 1.0) * head_dim))
                w.add_sliding_window(cfg.sliding_window or 0)
                w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings")
                                                or cfg.original_max_position_embeddings)
        if split > 1:
            w.add_uint16("split.no", k)
            w.add_uint16("split.count", split)
            w.add_int32("split.tensors.count", len(tensors))
        for name, data, kind in part:
            w.add_tensor(name, data, raw_dtype=kind)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return reference
