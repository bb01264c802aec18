"""GGUF tensors into the loader's targets, a few MB of rows at a time (graph/loader.py's GGUF path).

- F32 / F16 / BF16: the rows as they are stored, converted to the target's dtype on the way in.
- Q4_0 into an int4 projection of group size 32: an exact repack, no float step. A Q4_0 block is
  an fp16 scale d and 16 bytes whose low nibbles are its columns 0-15 and high nibbles 16-31,
  value (q - 8) * d: byte for byte Strata's int4 group of 32 (kernels/quant_formats.py), with d
  widened to fp32.
- Q8_0 into a grouped int8 projection (group 32): an fp16 scale and 32 int8 codes a block, the
  codes copied and the scale widened: exact.
- Every other type the `gguf` package can dequantize (Q8_0, Q4_1, Q5_0/1, the K-quants, ...):
  its rows dequantized in numpy (gguf.quants.dequantize, llama.cpp's own formulas) into one
  chunk of fp32 rows, then written like a safetensors chunk (copied, or quantised into the
  target's int8/int4 storage). The float step exists only per chunk, never for the model; for
  an int8 target it is a requantisation (per row), so not bit-exact to the file: noted at load.
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
from strata.graph.gguf_file import GGUFFile, TensorInfo
from strata.graph.gguf_model import unpermute_rows
from strata.graph.pread_file import READ_CHUNK_BYTES
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


def fill(g: GGUFFile, info: TensorInfo, module, attr: str, rows: slice | None, permute_heads: int | None) -> None:
    """Read GGUF tensor `info` into `module.attr` (rows `rows` of a fused weight; None: whole).
    permute_heads: the head count whose q/k row permutation to undo (None: stored in HF order)."""
    check_type(info)
    if len(info.shape) == 1:  # a norm or a bias: whole, in its own dtype
        values = rows_as_float(info, g.read(info, 0, 1)).reshape(-1)
        if permute_heads is not None:
            values = values[torch.from_numpy(unpermute_rows(values.shape[0], permute_heads))]
        param = getattr(module, attr)
        (param if rows is None else param[rows]).copy_(values)
        return
    n = info.shape[0]
    cols = info.shape[-1]
    start = 0 if rows is None else rows.start
    quantised = isinstance(module, QuantLinear) and attr == "weight"
    exact_q4 = quantised and module.method == "int4" and module.group_size == 32 and info.type == T.Q4_0
    exact_q8 = quantised and module.method == "int8" and module.group_size == 32 and info.type == T.Q8_0
    dest = None if quantised else (getattr(module, attr) if rows is None else getattr(module, attr)[rows])
    unit = 1 if permute_heads is None else n // permute_heads  # rows read together: a head's
    step = max(unit, READ_CHUNK_BYTES // (4 * cols) // unit * unit)
    order = None if permute_heads is None else unpermute_rows(unit, 1)
    for a in range(0, n, step):
        b = min(n, a + step)
        raw = g.read(info, a, b)
        if order is not None:  # each head's rows back in HF order
            raw = raw.reshape(-1, unit, raw.shape[1])[:, order].reshape(b - a, -1)
        if exact_q4:
            _q4_0_repack(raw, module.qweight[start + a:start + b], module.scale[start + a:start + b])
        elif exact_q8:
            _q8_0_repack(raw, module.qweight[start + a:start + b], module.scale[start + a:start + b])
        elif quantised:
            module.quantize_rows(start + a, rows_as_float(info, raw).float())
        else:
            dest[a:b].copy_(rows_as_float(info, raw))
