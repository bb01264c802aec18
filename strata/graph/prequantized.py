"""Checkpoints quantized by someone else: AWQ, GPTQ, compressed-tensors, FP8 (issue 44).

config.json's `quantization_config` names the scheme (`scheme_of`); each quantized projection
then arrives as several tensors beside (or instead of) `X.weight`, which `decode` turns into
Strata's layouts (kernels/quant_formats.py) with no float step where the values fit:

- int4 (AWQ, GPTQ, compressed-tensors pack-quantized w4a16): codes n in 0..15, a scale per group
  of columns and an integer zero point Z per group, w = s * (n - Z) (symmetric: Z = 8). Strata's
  int4 holds exactly this: the nibble n, the scale, and (asymmetric) the zero point s * (Z - 8) in
  the [out, 2, groups] scale (fp16 scale times a small integer: exact in fp32). A channel-wise
  scale is repeated per group of 128 columns (exact).
  - AWQ (`quant_method: awq`, GEMM version): qweight int32 [in, out / 8] packing 8 output columns
    a word in the order 0 2 4 6 1 3 5 7, qzeros int32 [groups, out / 8] the same way, scales
    [groups, out].
  - GPTQ (`quant_method: gptq`): qweight int32 [in / 8, out] packing 8 input rows a word,
    qzeros int32 [groups, out / 8] (stored minus one in the original `gptq` checkpoint format,
    as they are in `gptq_v2`), scales [groups, out], g_idx [in]. With desc_act the groups are
    not runs of columns: the columns are reordered so they are (`perm`), and the projection
    gathers its input by the same order (QuantLinear.input_perm).
  - compressed-tensors `pack-quantized`: weight_packed int32 [out, in / 8] (column k of a word
    at bits 4k, stored plus 8), weight_scale [out, groups], weight_zero_point int32 packed along
    the output rows (asymmetric only), weight_shape.
- int8 (compressed-tensors `int-quantized`, w8a8): weight int8 [out, in] with a per-channel,
  per-tensor or per-group scale: Strata's int8 per row, or grouped by 32 (a larger group's scale
  repeated), exactly. The activations are quantised dynamically by Strata's own kernels; a
  checkpoint's static input scales are not used (logged).
- FP8 e4m3 (`quant_method: fp8` with 128x128 `weight_scale_inv` blocks, or compressed-tensors
  `float-quantized` per-tensor / per-channel `weight_scale`): dequantized row by row (fp8 times
  its scale, in fp32) into the storage the engine serves it in (bf16 on CPU unless asked).

Anything else (other bit widths, MXFP4 / NVFP4, Marlin-packed or exllama-v2 files, activation
orders we cannot place) is refused by name with the supported list.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

from strata.errors import ModelLoadError

logger = logging.getLogger(__name__)

SUPPORTED = ("awq (4-bit, gemm)", "gptq (4-bit, desc_act or not, sym or asym)",
             "compressed-tensors pack-quantized (4-bit) / int-quantized (8-bit) / float-quantized (fp8)",
             "fp8 (e4m3, 128x128 weight_scale_inv blocks)")
AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # nibble position of output column k % 8 in an AWQ word
CHANNEL_GROUP = 128  # a per-channel int4 scale is held as groups of this many columns


@dataclass(frozen=True)
class Scheme:
    """One checkpoint's quantization, as far as loading it needs."""

    method: str  # "awq" | "gptq" | "ct-int4" | "ct-int8" | "fp8"
    group_size: int  # columns per scale; 0: per output channel (or per tensor)
    symmetric: bool = True
    gptq_v1: bool = True  # GPTQ zeros stored minus one
    ignore: tuple[str, ...] = ()  # module names / "re:" patterns left unquantized

    @property
    def storage(self) -> str:
        """The Strata storage its quantized projections take (fp8: the float path)."""
        return {"ct-int8": "int8", "fp8": "bf16"}.get(self.method, "int4")

    def components(self) -> tuple[str, ...]:
        """Tensor name suffixes (after `module.`) a quantized projection arrives as."""
        if self.method in ("awq", "gptq"):
            return ("qweight", "qzeros", "scales", "g_idx")
        if self.method == "ct-int4":
            return ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
        if self.method == "ct-int8":
            return ("weight", "weight_scale", "weight_zero_point")
        return ("weight", "weight_scale", "weight_scale_inv")

    def describe(self) -> str:
        group = f"group {self.group_size}" if self.group_size else "per channel"
        return f"{self.method} ({group}, {'symmetric' if self.symmetric else 'with zero points'})"


def _refuse(path, why: str) -> ModelLoadError:
    where = f"{path}: " if path else ""
    return ModelLoadError(f"{where}config.json quantization_config: {why}; supported: {'; '.join(SUPPORTED)}")


def scheme_of(config: dict, path=None) -> Scheme | None:
    """The Scheme of a config.json (None: not quantized), refusing what we cannot load exactly."""
    q = config.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, dict):
        raise _refuse(path, f"expected an object, got {type(q).__name__}")
    method = str(q.get("quant_method", "")).lower()
    if method == "awq":
        if q.get("bits", 4) != 4 or str(q.get("version", "gemm")).lower() != "gemm":
            raise _refuse(path, f"awq bits={q.get('bits')} version={q.get('version')!r}")
        return Scheme("awq", int(q.get("group_size", 128)), symmetric=not q.get("zero_point", True),
                      ignore=tuple(q.get("modules_to_not_convert") or ()))
    if method == "gptq":
        fmt = str(q.get("checkpoint_format", "gptq")).lower()
        if q.get("bits", 4) != 4 or fmt not in ("gptq", "gptq_v2"):
            raise _refuse(path, f"gptq bits={q.get('bits')} checkpoint_format={fmt!r}")
        group = int(q.get("group_size", 128))
        return Scheme("gptq", 0 if group == -1 else group, symmetric=bool(q.get("sym", True)), gptq_v1=fmt == "gptq")
    if method == "fp8":
        block, fmt = q.get("weight_block_size"), q.get("fmt", "e4m3")
        if fmt != "e4m3" or (block is not None and list(block) != [128, 128]):
            raise _refuse(path, f"fp8 fmt={fmt!r} weight_block_size={block}")
        return Scheme("fp8", 128 if block else 0, ignore=tuple(q.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        return _compressed_tensors(q, path)
    raise _refuse(path, f"quant_method {method or '(none)'!r}")


def _compressed_tensors(q: dict, path) -> Scheme:
    fmt = q.get("format")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse(path, f"compressed-tensors with {len(groups)} config_groups (one scheme for every Linear is supported)")
    (group,) = groups.values()
    w = group.get("weights") or {}
    bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy", "tensor")
    sym = bool(w.get("symmetric", True))
    size = int(w.get("group_size") or 0) if strategy == "group" else 0
    ignore = tuple(q.get("ignore") or ())
    if fmt == "pack-quantized" and bits == 4 and kind == "int" and strategy in ("group", "channel"):
        if w.get("actorder") not in (None, "group", "static", False):
            raise _refuse(path, f"compressed-tensors actorder {w.get('actorder')!r}")
        return Scheme("ct-int4", size, symmetric=sym, ignore=ignore)
    if fmt in ("int-quantized", "naive-quantized") and bits == 8 and kind == "int" and strategy in ("channel", "tensor", "group"):
        if size and size % 32:
            raise _refuse(path, f"int8 group_size {size} (a multiple of 32 is supported)")
        return Scheme("ct-int8", size, symmetric=sym, ignore=ignore)
    if fmt in ("float-quantized", "naive-quantized") and bits == 8 and kind == "float" and strategy in ("tensor", "channel", "block"):
        block = w.get("block_structure")
        if strategy == "block" and list(block or ()) != [128, 128]:
            raise _refuse(path, f"fp8 block_structure {block}")
        return Scheme("fp8", 128 if strategy == "block" else 0, ignore=ignore)
    raise _refuse(path, f"compressed-tensors format {fmt!r} with {bits}-bit {kind} weights, strategy {strategy!r}")


def is_ignored(scheme: Scheme, module: str) -> bool:
    """Whether the checkpoint left HF module `module` (e.g. "lm_head") unquantized."""
    for pattern in scheme.ignore:
        if pattern.startswith("re:") and re.fullmatch(pattern[3:], module):
            return True
        if module == pattern or module.endswith("." + pattern) or pattern == module.rsplit(".", 1)[-1]:
            return True
    return False


def int4_group(scheme: Scheme, in_features: int) -> int:
    """The Strata int4 group a projection of `in_features` columns takes under `scheme`."""
    if scheme.group_size:
        return scheme.group_size
    for g in (CHANNEL_GROUP, 64, 32):
        if in_features % g == 0:
            return g
    raise ModelLoadError(f"per-channel int4 over {in_features} columns: no group of 32/64/128 divides them")


# --- unpacking ------------------------------------------------------------------------------------


def _nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their 8 nibbles (bits 4k = nibble k) spread along `dim`, as int16 0..15."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    if dim == 1:
        n = (w[:, :, None] >> shifts) & 15  # [r, c, 8] -> [r, 8c]
        return n.reshape(w.shape[0], -1).to(torch.int16)
    n = (w[:, None, :] >> shifts[None, :, None]) & 15  # [r, 8, c] -> [8r, c]
    return n.reshape(-1, w.shape[1]).to(torch.int16)


@dataclass
class Int4:
    """A projection's weight in Strata's terms before packing: nibbles n [out, in] (0..15),
    scale [out, groups] fp32, integer zero points Z [out, groups] (None: 8), input column order."""

    n: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    perm: torch.Tensor | None = None


def _awq(t: dict, scheme: Scheme) -> Int4:
    order = torch.tensor(AWQ_ORDER)

    def columns(words):  # [r, out / 8] words -> [r, out] in output-column order
        n = _nibbles(words, 1).view(words.shape[0], -1, 8)
        return n[:, :, order].reshape(words.shape[0], -1)

    n = columns(t["qweight"]).t()
    zero = None if scheme.symmetric else columns(t["qzeros"]).t()
    return Int4(n, t["scales"].float().t(), zero)


def _gptq(t: dict, scheme: Scheme, in_features: int) -> Int4:
    n = _nibbles(t["qweight"], 0)[:in_features].t()  # [out, in]
    scale = t["scales"].float().t()  # [out, groups]
    zero = None
    if not scheme.symmetric or "qzeros" in t:
        z = _nibbles(t["qzeros"], 1)[:, :n.shape[0]].t()
        if scheme.gptq_v1:
            z = (z + 1) & 15
        zero = None if scheme.symmetric and bool((z == 8).all()) else z
    perm = _act_order(t.get("g_idx"), in_features, scale.shape[1], "gptq g_idx")
    return Int4(n if perm is None else n[:, perm], scale, zero, perm)


def _act_order(g_idx: torch.Tensor | None, in_features: int, groups: int, what: str) -> torch.Tensor | None:
    """The column order that makes an act-order checkpoint's groups runs (argsort of its g_idx),
    or None where the groups already are (g_idx = column // group size, or none given)."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64)
    runs = torch.arange(in_features) // (in_features // groups)
    if torch.equal(g_idx, runs):
        return None
    perm = torch.argsort(g_idx, stable=True)  # each group's columns together
    if not torch.equal(g_idx[perm], runs):
        raise ModelLoadError(f"{what}: the groups do not hold group_size columns each; cannot place them")
    return perm


def _ct_int4(t: dict, scheme: Scheme, out_features: int, in_features: int) -> Int4:
    n = _nibbles(t["weight_packed"], 1)[:, :in_features]
    scale = t["weight_scale"].float().reshape(out_features, -1)
    zero = None
    if not scheme.symmetric:
        zero = _nibbles(t["weight_zero_point"], 0)[:out_features]
    perm = _act_order(t.get("weight_g_idx"), in_features, scale.shape[1], "compressed-tensors weight_g_idx")
    return Int4(n if perm is None else n[:, perm], scale, zero, perm)


def decode_int4(scheme: Scheme, t: dict, out_features: int, in_features: int) -> Int4:
    if scheme.method == "awq":
        q = _awq(t, scheme)
    elif scheme.method == "gptq":
        q = _gptq(t, scheme, in_features)
    else:
        q = _ct_int4(t, scheme, out_features, in_features)
    if tuple(q.n.shape) != (out_features, in_features):
        raise ModelLoadError(f"{scheme.method}: unpacked weight {tuple(q.n.shape)}, config.json implies "
                             f"{(out_features, in_features)}")
    g = int4_group(scheme, in_features)
    rep = in_features // g // q.scale.shape[1]  # per channel: one scale repeated per group
    if rep > 1:
        q.scale = q.scale.repeat_interleave(rep, dim=1)
        q.zero = None if q.zero is None else q.zero.repeat_interleave(rep, dim=1)
    return q


def pack_int4(q: Int4, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight uint8 [out, in / 2], scale) in quant_formats' int4 layout: per group byte k holds
    column k (low nibble) and k + group / 2 (high); scale [out, groups] or, with zero points,
    [out, 2, groups] holding s and s * (Z - 8)."""
    out_f, in_f = q.n.shape
    n = q.n.to(torch.uint8).view(out_f, in_f // group, 2, group // 2)
    packed = (n[:, :, 0] | (n[:, :, 1] << 4)).reshape(out_f, in_f // 2)
    if q.zero is None:
        return packed.contiguous(), q.scale.contiguous()
    zero = q.scale * (q.zero.to(torch.float32) - 8.0)
    return packed.contiguous(), torch.stack([q.scale, zero], dim=1).contiguous()


def decode_int8(scheme: Scheme, t: dict, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight int8 [out, in], scale) for Strata's int8: per row ([out]) for a channel / tensor
    scale of a symmetric checkpoint, else grouped by 32 ([out, in / 32], or [out, 2, in / 32]
    with zero points s * Z), the checkpoint's scales repeated per 32 columns."""
    w = t["weight"]
    if w.dtype != torch.int8:
        raise ModelLoadError(f"int8 checkpoint: weight is {w.dtype}, expected int8")
    s = t["weight_scale"].float()
    s = s.reshape(1, 1).expand(out_features, 1) if s.numel() == 1 else s.reshape(out_features, -1)
    zp = t.get("weight_zero_point")
    if scheme.symmetric and s.shape[1] == 1:
        return w, s[:, 0].contiguous()
    rep = in_features // 32 // s.shape[1]
    s = s.repeat_interleave(rep, dim=1)
    if scheme.symmetric or zp is None:
        return w, s.contiguous()
    zp = zp.float().reshape(1, 1).expand(out_features, 1) if zp.numel() == 1 else zp.float().reshape(out_features, -1)
    zero = s * zp.repeat_interleave(in_features // 32 // zp.shape[1], dim=1)
    return w, torch.stack([s, zero], dim=1).contiguous()


def decode_fp8(scheme: Scheme, t: dict, rows: slice) -> torch.Tensor:
    """Float rows `rows` of an FP8 weight: e4m3 values times their scale, in fp32."""
    w = t["weight"][rows].to(torch.float32)
    if "weight_scale_inv" in t:  # 128x128 blocks: the blocks these rows fall in, widened
        first = rows.start // 128
        s = t["weight_scale_inv"].float()[first:(rows.stop - 1) // 128 + 1]
        s = s.repeat_interleave(128, dim=0)[rows.start - 128 * first:][: w.shape[0]]
        return w * s.repeat_interleave(128, dim=1)[:, : w.shape[1]]
    s = t["weight_scale"].float()
    if s.numel() == 1:
        return w * s.reshape(())
    return w * s.reshape(-1, 1)[rows]


# --- into the model -------------------------------------------------------------------------------

MAIN = {"awq": "qweight", "gptq": "qweight", "ct-int4": "weight_packed", "ct-int8": "weight", "fp8": "weight"}


def holds(scheme: Scheme, names, prefix: str) -> bool:
    """Whether the checkpoint stores projection `prefix` quantized (its scheme's tensors, not a
    plain float weight: an ignored module keeps `prefix.weight` alone)."""
    if scheme.method in ("ct-int8", "fp8"):
        return f"{prefix}.weight_scale" in names or f"{prefix}.weight_scale_inv" in names
    return f"{prefix}.{MAIN[scheme.method]}" in names


def fill_module(scheme: Scheme, parts: dict[str, torch.Tensor], module, rows: slice | None,
                shape: tuple[int, int], name: str) -> None:
    """Write one checkpoint projection's decoded weight into `module` (rows `rows` of a fused
    one). int4 / int8 schemes into the QuantLinear the loader built for them (their layouts, so
    a plain copy); FP8 into float weights (or, under --quantization int8 / int4, quantized)."""
    from strata.memory.quant import QuantLinear

    out_f, in_f = shape
    start = 0 if rows is None else rows.start
    span = slice(start, start + out_f)
    if scheme.method == "fp8":
        step = max(1, (16 << 20) // (4 * in_f))
        for a in range(0, out_f, step):
            chunk = decode_fp8(scheme, parts, slice(a, min(out_f, a + step)))
            if isinstance(module, QuantLinear):
                module.quantize_rows(start + a, chunk)
            else:
                module.weight[start + a:start + a + chunk.shape[0]].copy_(chunk)
        return
    if not isinstance(module, QuantLinear):
        raise ModelLoadError(f"{name}: stored {scheme.describe()}, but its module is not quantized here")
    if scheme.method == "ct-int8":
        qweight, scale = decode_int8(scheme, parts, out_f, in_f)
        perm = None
    else:
        q = decode_int4(scheme, parts, out_f, in_f)
        qweight, scale = pack_int4(q, module.group_size)
        perm = q.perm
    if tuple(scale.shape[1:]) != tuple(module.scale.shape[1:]) or qweight.shape[1] != module.qweight.shape[1]:
        raise ModelLoadError(f"{name}: {scheme.describe()} decodes to scale {tuple(scale.shape)}, but its module "
                             f"holds {tuple(module.scale.shape)}; the checkpoint and config.json disagree")
    module.qweight[span].copy_(qweight)
    module.scale[span].copy_(scale)
    if perm is not None:  # q / k / v (gate / up) share an input, so an order: the same for all
        if module.input_perm is not None and not torch.equal(module.input_perm, perm):
            raise ModelLoadError(f"{name}: act-order column order differs from the other projections fused "
                                 "with it (they share one input); this checkpoint cannot be loaded fused")
        module.set_input_perm(perm)


def projection_parts(cfg) -> dict[str, tuple[str, int]]:
    """Our projection module name -> (the HF module of one of its parts, its input width)."""
    hidden, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    out = {}
    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        out[f"{p}.self_attn.qkv_proj"] = (f"model.{p}.self_attn.q_proj", hidden)
        out[f"{p}.self_attn.o_proj"] = (f"model.{p}.self_attn.o_proj", q)
        out[f"{p}.mlp.gate_up_proj"] = (f"model.{p}.mlp.gate_proj", hidden)
        out[f"{p}.mlp.down_proj"] = (f"model.{p}.mlp.down_proj", cfg.intermediate_size)
    return out


def layouts(scheme: Scheme, modules: dict[str, tuple[str, int]]) -> dict:
    """memory.quant Layouts for the quantized projections: `modules` maps our module name to (the
    HF name of one of its parts, its input width); the ignored ones stay float."""
    from strata.memory.quant import Layout

    out = {}
    for name, (hf, in_f) in modules.items():
        if is_ignored(scheme, hf):
            continue
        if scheme.method == "ct-int8":
            per_row = scheme.symmetric and not scheme.group_size
            out[name] = Layout("int8", 0 if per_row else 32, not scheme.symmetric)
        elif scheme.method != "fp8":
            out[name] = Layout("int4", int4_group(scheme, in_f), not scheme.symmetric)
    return out
