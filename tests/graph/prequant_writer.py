"""Tiny prequantized checkpoints for the tests, written from a transformers model the way each
format's own packer writes them (AutoAWQ's GEMM packing, AutoGPTQ's, compressed-tensors' own
compressors), with the weights they dequantize to as the reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: word nibble j holds output column order[j]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_groups(w: torch.Tensor, group: int, sym: bool, g_idx: torch.Tensor | None = None):
    """Round-to-nearest 4-bit: (codes [out, in] 0..15, scale fp16 [out, groups], zero [out, groups]
    0..15), w ~ scale * (code - zero); column c in group g_idx[c] (default c // group)."""
    out_f, in_f = w.shape
    ng = in_f // group
    g_idx = torch.arange(in_f) // group if g_idx is None else g_idx
    scale = torch.empty(out_f, ng)
    zero = torch.empty(out_f, ng, dtype=torch.int64)
    for j in range(ng):
        cols = w[:, g_idx == j]
        if sym:
            s = cols.abs().amax(dim=1).clamp(min=1e-6) / 7.5
            z = torch.full((out_f,), 8)
        else:
            lo, hi = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
            s = ((hi - lo) / 15).clamp(min=1e-6)
            z = torch.round(-lo / s).clamp(0, 15).to(torch.int64)
        scale[:, j], zero[:, j] = s, z
    scale = scale.half()
    s_col, z_col = scale.float()[:, g_idx], zero[:, g_idx]
    codes = torch.round(w / s_col + z_col).clamp(0, 15).to(torch.int64)
    return codes, scale, zero, (s_col * (codes - z_col)).float()


def _pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[8k, c] nibbles -> int32 [k, c], row 8i + j at bits 4j (GPTQ qweight)."""
    v = values.to(torch.int64).view(-1, 8, values.shape[1])
    words = sum(v[:, j] << (4 * j) for j in range(8))
    return _int32(words)


def _pack_cols(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[r, 8k] nibbles -> int32 [r, k]: word nibble j = column 8i + order[j]."""
    v = values.to(torch.int64).view(values.shape[0], -1, 8)
    words = sum(v[:, :, order[j]] << (4 * j) for j in range(8))
    return _int32(words)


def _int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _write(hf_model, out: Path, tensors: dict, quantization_config: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    hf_model.config.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    if hf_model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, str(out / "model.safetensors"))


def _projections(state: dict):
    for name, w in state.items():
        parts = name.split(".")
        if len(parts) > 2 and parts[-2] in PROJECTIONS and parts[-1] == "weight":
            yield name.removesuffix(".weight"), w


def write_awq(hf_model, out: Path, group: int = 32) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM layout (zero points on). Returns the dequantized state dict (reference)."""
    state = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
    tensors, reference = dict(state), dict(state)
    for prefix, w in _projections(state):
        codes, scale, zero, back = quantize_groups(w, group, sym=False)
        del tensors[f"{prefix}.weight"]
        tensors[f"{prefix}.qweight"] = _pack_cols(codes.t(), AWQ_PACK_ORDER)  # [in, out / 8]
        tensors[f"{prefix}.qzeros"] = _pack_cols(zero.t(), AWQ_PACK_ORDER)  # [groups, out / 8]
        tensors[f"{prefix}.scales"] = scale.t().contiguous()  # [groups, out]
        reference[f"{prefix}.weight"] = back
    _write(hf_model, out, tensors, {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                    "version": "gemm"})
    return reference


def write_gptq(hf_model, out: Path, group: int = 32, sym: bool = True, desc_act: bool = False,
               v2: bool = False) -> dict[str, torch.Tensor]:
    """AutoGPTQ layout; desc_act: each projection's columns grouped by a random order shared by
    the projections that read one input (as GPTQ's Hessian order is)."""
    state = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
    tensors, reference = dict(state), dict(state)
    orders: dict[tuple, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)
    for prefix, w in _projections(state):
        in_f = w.shape[1]
        g_idx = torch.arange(in_f) // group
        if desc_act:  # q/k/v share an input, as do gate/up
            key = (prefix.rsplit(".", 2)[0], "qkv" if prefix[-6:] in ("q_proj", "k_proj", "v_proj") else
                   "gu" if prefix.endswith(("gate_proj", "up_proj")) else prefix)
            if key not in orders:
                orders[key] = torch.randperm(in_f, generator=gen)
            g_idx = torch.empty(in_f, dtype=torch.int64)
            g_idx[orders[key]] = torch.arange(in_f) // group
        codes, scale, zero, back = quantize_groups(w, group, sym=sym, g_idx=g_idx)
        del tensors[f"{prefix}.weight"]
        tensors[f"{prefix}.qweight"] = _pack_rows(codes.t())  # [in / 8, out]
        tensors[f"{prefix}.qzeros"] = _pack_cols((zero.t() - (0 if v2 else 1)) & 15)  # [groups, out / 8]
        tensors[f"{prefix}.scales"] = scale.t().contiguous()
        tensors[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
        reference[f"{prefix}.weight"] = back
    _write(hf_model, out, tensors, {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym,
                                    "desc_act": desc_act, "checkpoint_format": "gptq_v2" if v2 else "gptq"})
    return reference


def write_compressed_tensors(hf_model, out: Path, kind: str, group: int = 32, sym: bool = True) -> dict[str, torch.Tensor]:
    """compressed-tensors' own quantize + compress (kind "w4a16": pack-quantized int4 by groups;
    "w8a8": int-quantized int8 per channel) and its own decompression as the reference."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    if kind == "w4a16":
        args = QuantizationArgs(num_bits=4, type="int", symmetric=sym, strategy="group", group_size=group)
        fmt = "pack-quantized"
    else:
        args = QuantizationArgs(num_bits=8, type="int", symmetric=sym, strategy="channel")
        fmt = "int-quantized"
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = BaseCompressor.load_from_registry(fmt)
    state = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
    tensors, reference = dict(state), dict(state)
    for prefix, w in _projections(state):
        if kind == "w4a16":
            wg = w.view(w.shape[0], -1, group)
            lo, hi = wg.amin(dim=2), wg.amax(dim=2)
        else:
            lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        scale, zp = calculate_qparams(lo, hi, args)
        module = {"weight": w, "weight_scale": scale.to(torch.float16).float(), "weight_zero_point": zp}
        packed = compressor.compress(dict(module), scheme)
        back = compressor.decompress(dict(packed), scheme)["weight"].float()
        del tensors[f"{prefix}.weight"]
        for k, v in packed.items():
            tensors[f"{prefix}.{k}"] = v
        reference[f"{prefix}.weight"] = back
    _write(hf_model, out, tensors, {
        "quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": args.model_dump(mode="json")}}})
    return reference


def write_fp8(hf_model, out: Path) -> dict[str, torch.Tensor]:
    """A DeepSeek / Qwen FP8 checkpoint: e4m3 weights with fp32 weight_scale_inv per 128x128 block."""
    state = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
    tensors, reference = dict(state), dict(state)
    for prefix, w in _projections(state):
        rb, cb = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
        pad = torch.zeros(rb * 128, cb * 128)
        pad[: w.shape[0], : w.shape[1]] = w
        s = pad.view(rb, 128, cb, 128).abs().amax(dim=(1, 3)).clamp(min=1e-8) / 448.0
        s_full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        q = (w / s_full).to(torch.float8_e4m3fn)
        del tensors[f"{prefix}.weight"]
        tensors[f"{prefix}.weight"] = q
        tensors[f"{prefix}.weight_scale_inv"] = s
        reference[f"{prefix}.weight"] = q.float() * s_full
    _write(hf_model, out, tensors, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]})
    return reference


def copy_tokenizer(src: Path, out: Path) -> None:
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, out / f.name)
