"""GGUF tensors into the loader's targets, a few MB of rows at a time (graph/loader.py's GGUF path).

- F32 / F16 / BF16: the rows as they are stored, converted to the target's dtype on the way in.
- Q4_0 into an int4 projection of group size 32: an exact repack, no float step. A Q4_0 block is
  an fp16 scale d and 16 bytes whose low nibbles are its columns 0-15 and high nibbles 16-31,
  value (q - 8) * d: byte for byte Strata's int4 group of 32 (kernels/quant_formats.py), with d
  widened to fp32.
- Q8_0 into a grouped int8 projection (group 32): an fp16 scale and 32 int8 codes a block, the
  codes copied and the scale widened: exact.
- Every other block type (Q5_0, Q4_1, Q5_1, Q4_K, Q5_K, Q6_K) into the grouped layout that holds
  it (graph/gguf_blocks.py: codes, scales and zero points, bit for bit): int8 grouped by 32 or 16
  (Q6_K), with zero points for the minima types; int4 group 32 for the nibble types.
- Into any other target (float storage, or a layout the file's type does not fit): the rows
  dequantized in numpy (gguf.quants.dequantize, llama.cpp's own formulas) one chunk of fp32 rows
  at a time, then written like a safetensors chunk (copied, or quantised into the target's
  int8/int4 storage). The float step exists only per chunk, never for the model.
- Refused by name: types with no dequantizer here.

llama.cpp's converter stored Llama's q/k rows permuted (graph/gguf_model.unpermute_rows): those
are read a whole number of heads at a time and put back in HF order.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from strata.errors import ModelLoadError
from strata.graph.gguf_blocks import BLOCKS, NIBBLE_CODES, decompose
from strata.graph.gguf_file import GGUFFile, TensorInfo
from strata.graph.gguf_model import unpermute_rows
from strata.graph.pread_file import READ_CHUNK_BYTES
from strata.kernels import cpu_gguf
from strata.memory.quant import QuantLinear

_FLOATS = {T.F32: (np.float32, torch.float32), T.F16: (np.float16, torch.float16), T.BF16: (np.int16, torch.bfloat16)}


def rows_as_float(info: TensorInfo, raw: np.ndarray) -> torch.Tensor:
    """Raw rows (uint8 [rows, row_bytes]) of a tensor -> float rows [rows, cols] (its own float
    dtype for F32/F16/BF16, else fp32 dequantized)."""
    cols = info.shape[-1]
    if info.type in _FLOATS:
        np_t, torch_t = _FLOATS[info.type]
        return torch.from_numpy(raw.view(np_t).reshape(-1, cols)).view(torch_t)
    values = quants.dequantize(raw, info.type)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(-1, cols))


# The types a GGUF load takes: the floats, Q4_0 (exact repack) and the quantised types the model
# files people run are made of (Q4_K_M / Q5_K_M: Q4_K, Q5_K, Q6_K). IQ*, Q2_K, Q3_K and the
# ternary / fp4 types are refused by name: dequantizing them at load would give a model no more
# accurate than those formats and none of their speed.
SUPPORTED = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K)


def supported_types() -> list[str]:
    return [t.name for t in SUPPORTED]


def check_type(info: TensorInfo) -> None:
    if info.type not in SUPPORTED:
        raise ModelLoadError(f"{info.path}: tensor {info.name!r} is {info.type.name}, which Strata cannot read; "
                             f"supported: {', '.join(supported_types())}")


def _q8_0_repack(raw: np.ndarray, qweight: torch.Tensor, scale: torch.Tensor) -> None:
    """Q8_0 rows (uint8 [rows, blocks * 34]) -> grouped int8 qweight [rows, cols] and scale
    [rows, cols / 32]: each block's fp16 scale widened, its 32 int8 codes as they are."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 34)
    scale.copy_(torch.from_numpy(np.ascontiguousarray(blocks[:, :, :2]).view(np.float16).reshape(rows, -1).astype(np.float32)))
    qweight.copy_(torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(rows, -1)))


def _q4_0_repack(raw: np.ndarray, qweight: torch.Tensor, scale: torch.Tensor) -> None:
    """Q4_0 rows (uint8 [rows, blocks * 18]) -> int4 group-32 qweight [rows, cols / 2] and scale."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 18)
    scale.copy_(torch.from_numpy(np.ascontiguousarray(blocks[:, :, :2]).view(np.float16).reshape(rows, -1).astype(np.float32)))
    qweight.copy_(torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:]).reshape(rows, -1)))


def exact_into(kind: T, module) -> bool:
    """Whether a QuantLinear's layout holds tensor type `kind` exactly (gguf_blocks)."""
    if kind not in BLOCKS or not isinstance(module, QuantLinear):
        return False
    group, _, zero = BLOCKS[kind]
    if zero and module.scale.dim() != 3:
        return False
    if module.method == "int8":
        return module.scale.dim() >= 2 and group % module.group_size == 0
    return kind in NIBBLE_CODES and module.group_size == 32


def _blocks_into(kind: T, raw: np.ndarray, module: QuantLinear, rows: slice) -> None:
    """Rows of raw blocks into `module`'s grouped storage, exactly (exact_into holds). The two
    K-quant layouts a Q4_K_M file is mostly made of by one compiled pass (kernels/cpu_gguf.py,
    equal to this function's numpy path, its twin)."""
    zero_layout = module.scale.dim() == 3
    if cpu_gguf.available() and module.qweight.is_cpu:
        if kind == T.Q4_K and module.method == "int4" and zero_layout:
            return cpu_gguf.q4_k_into_int4z(raw, module.qweight[rows].numpy(), module.scale[rows].numpy())
        if kind == T.Q6_K and module.method == "int8" and module.group_size == 16 and not zero_layout:
            return cpu_gguf.q6_k_into_int8g16(raw, module.qweight[rows].numpy(), module.scale[rows].numpy())
    _blocks_into_np(kind, raw, module, rows)


def _blocks_into_np(kind: T, raw: np.ndarray, module: QuantLinear, rows: slice) -> None:
    codes, scale, zero, group = decompose(kind, raw)
    if module.method == "int8":
        module.qweight[rows].copy_(torch.from_numpy(codes))
    else:  # nibble = code - lo; s * code - z = s * (nibble - 8) - (z - s * (lo + 8))
        lo = -8 if kind == T.Q4_0 else 0
        nib = (codes.astype(np.int16) - lo).astype(np.uint8).reshape(codes.shape[0], -1, 2, 16)
        module.qweight[rows].copy_(torch.from_numpy((nib[:, :, 0] | (nib[:, :, 1] << 4)).reshape(codes.shape[0], -1)))
        if lo + 8:
            zero = (np.zeros_like(scale) if zero is None else zero) - scale * np.float32(lo + 8)
    rep = group // module.group_size  # a Q8_0 / Q4_K group of 32 in a layout of 16: twice
    scale = np.repeat(scale, rep, axis=1) if rep > 1 else scale
    if module.scale.dim() == 3:
        module.scale[rows, 0].copy_(torch.from_numpy(scale))
        if zero is None:
            module.scale[rows, 1].zero_()
        else:
            module.scale[rows, 1].copy_(torch.from_numpy(np.repeat(zero, rep, axis=1) if rep > 1 else zero))
    else:
        module.scale[rows].copy_(torch.from_numpy(scale))


def fill(g: GGUFFile, info: TensorInfo, module, attr: str, rows: slice | None, permute_heads: int | None,
         shift: float = 0.0, expert: int | None = None) -> None:
    """Read GGUF tensor `info` into `module.attr` (rows `rows` of a fused weight; None: whole).
    permute_heads: the head count whose q/k row permutation to undo (None: stored in HF order).
    shift: subtracted from a 1-D tensor (Gemma's norms, stored by the converter as 1 + w).
    expert: read that expert's [out, in] slice of a 3-D expert tensor [experts, out, in]."""
    check_type(info)
    if len(info.shape) == 1:  # a norm or a bias: whole, in its own dtype
        values = rows_as_float(info, g.read(info, 0, 1)).reshape(-1)
        if shift:
            values = values.float() - shift
        if permute_heads is not None:
            values = values[torch.from_numpy(unpermute_rows(values.shape[0], permute_heads))]
        param = getattr(module, attr)
        (param if rows is None else param[rows]).copy_(values)
        return
    n = info.shape[-2]
    first = 0 if expert is None else expert * n  # the source rows: an expert's slice of the stack
    cols = info.shape[-1]
    start = 0 if rows is None else rows.start
    quantised = isinstance(module, QuantLinear) and attr == "weight"
    exact = quantised and exact_into(info.type, module)
    plain = exact and module.scale.dim() == 2 and module.group_size == 32  # byte-copy repacks
    exact_q4 = plain and module.method == "int4" and info.type == T.Q4_0
    exact_q8 = plain and module.method == "int8" and info.type == T.Q8_0
    dest = None if quantised else (getattr(module, attr) if rows is None else getattr(module, attr)[rows])
    unit = 1 if permute_heads is None else n // permute_heads  # rows read together: a head's
    step = max(unit, READ_CHUNK_BYTES // (4 * cols) // unit * unit)
    order = None if permute_heads is None else unpermute_rows(unit, 1)
    for a in range(0, n, step):
        b = min(n, a + step)
        raw = g.read(info, first + a, first + b)
        if order is not None:  # each head's rows back in HF order
            raw = raw.reshape(-1, unit, raw.shape[1])[:, order].reshape(b - a, -1)
        if exact_q4:
            _q4_0_repack(raw, module.qweight[start + a:start + b], module.scale[start + a:start + b])
        elif exact_q8:
            _q8_0_repack(raw, module.qweight[start + a:start + b], module.scale[start + a:start + b])
        elif exact:
            _blocks_into(info.type, raw, module, slice(start + a, start + b))
        elif quantised:
            module.quantize_rows(start + a, rows_as_float(info, raw).float())
        else:
            dest[a:b].copy_(rows_as_float(info, raw))
