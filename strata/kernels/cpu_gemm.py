"""Which GEMM multiplies prefill-sized inputs (more rows than the GEMV kernels take) by a weight.

Each weight carries its path as an attribute (`strata_prefill_gemm`: on the Parameter of an
nn.Linear, on a quantised module itself), set once by the engine from the hardware layer's
measurements (`mark`, called at the end of engine/build.py); unmarked weights take "aten". Read
by the dispatch (kernels/linear.py) and the narrow-weight prefill tiles (cpu_bf16.matmul,
cpu_quant.matmul). Paths:

- "aten": F.linear / torch.mm (MKL's sgemm in the standard wheels);
- "onednn": oneDNN's fp32 matmul on the same dense weight, no copy (the GEMM inductor's CPU
  backend calls). Measured on a 2-core AMD Zen 5 at prefill shapes: MKL ~190-220 GFLOP/s, oneDNN
  ~440-470; MKL can win on other CPUs, hence the measurement;
- "bf16" (weights stored narrower than fp32 only: bf16, int8, int4): the activations and the
  weight (or its dequantised tile) rounded to bf16, then oneDNN's bf16 GEMM (AVX512-BF16 / AMX;
  ~976 GFLOP/s on that Zen 5), whose product comes back rounded to bf16 too (torch has no CPU
  bf16 GEMM with an fp32 result), then widened. Otherwise a narrow weight's tiles are widened or dequantised to
  fp32 and multiplied by its fp32 path (exact for bf16 weights).
- "int8" (int8 and int4 weights): W8A8, the activations quantised per row and torch's int8 GEMM
  (an int4 weight requantised to int8 per call; kernels/cpu_w8a8.py says when an input row is
  refused); such weights also carry the path taken instead (`fallback_of`), the one other narrow
  weights take.
"""

from __future__ import annotations

import torch
from torch import nn

ATTR = "strata_prefill_gemm"
FALLBACK_ATTR = "strata_prefill_gemm_fallback"
FP32_PATHS = ("aten", "onednn")
PATHS = (*FP32_PATHS, "bf16")


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def path_of(holder: object) -> str:
    """The marked path of a weight tensor or quantised module ("aten" when unmarked)."""
    return holder.__dict__.get(ATTR, "aten")


def fallback_of(holder: object) -> str:
    """The path an "int8"-marked weight takes for an input the int8 GEMM refuses ("aten" unmarked)."""
    return holder.__dict__.get(FALLBACK_ATTR, "aten")


def mark(model: nn.Module, fp32: str, narrow: str, int8: str | None = None, int4: str | None = None) -> int:
    """Set every projection's path: fp32 weights take `fp32`; weights stored narrow (bf16 Linear
    weights, quantised modules) take `narrow`, which is "bf16" or an fp32 path; int8 / int4
    quantised modules take `int8` / `int4` when given ("int8", falling back to `narrow`, or
    `narrow` itself). Returns the count."""
    if fp32 not in FP32_PATHS or narrow not in PATHS or int8 not in (None, "int8", narrow) \
            or int4 not in (None, "int8", narrow):
        raise ValueError(f"GEMM paths: fp32 {fp32!r} (choose {', '.join(FP32_PATHS)}), narrow {narrow!r} "
                         f"(choose {', '.join(PATHS)}), int8 {int8!r} and int4 {int4!r} (int8 or the narrow path)")
    quantised = {"int8": int8, "int4": int4}
    if "onednn" in (fp32, narrow) and not onednn_available():
        raise ValueError("GEMM path onednn: this torch build has no mkldnn._linear_pointwise")
    count = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            setattr(m.weight, ATTR, fp32 if m.weight.dtype == torch.float32 else narrow)
            count += 1
        elif hasattr(m, "qweight"):
            setattr(m, ATTR, quantised.get(getattr(m, "method", None)) or narrow)
            setattr(m, FALLBACK_ATTR, narrow)
            count += 1
    return count


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) by oneDNN's fp32 matmul on dense CPU tensors; x [..., in]."""
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), weight, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


def tile_mm(x: torch.Tensor, tile: torch.Tensor, path: str) -> torch.Tensor:
    """x [m, in] fp32 @ an fp32 weight tile [rows, in].T by the fp32 `path`."""
    if path == "onednn":
        return onednn_linear(x, tile)
    return torch.mm(x, tile.t())
