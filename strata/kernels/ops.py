"""The dispatch points the model's eager modules call for the ops that have a hand-placed CPU
kernel, beside kernels/linear.py for projections: each runs its kernel where the kernel's
preconditions hold (few fp32 CPU rows, the kernel mode's fast paths on) and returns None
otherwise, and the caller runs its torch reference. graph/ and memory/ go through here, so the
CPU kernels themselves are imported only by kernels/ and platform/ (import-linter keeps it).
"""

from __future__ import annotations

import torch

from strata.kernels import cpu_norm, cpu_quant, cpu_quantize, cpu_rope


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rms_norm(x + residual) * weight, x + residual) by the CPU kernel, or None."""
    if cpu_norm.usable(x, weight):
        return cpu_norm.add_rms_norm(x, residual, weight, eps)
    return None


def rope_and_store(qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor,
                   kv_cache: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor | None:
    """Rotated q [T, heads, d] with k and v stored at `slots`, by the CPU kernel, or None."""
    if cpu_rope.usable(qkv, kv_cache):
        return cpu_rope.rope_and_store(qkv, rope, slots, kv_cache, heads, kv_heads)
    return None


def quant_embedding_rows(method: str, qweight: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor,
                         group_size: int) -> torch.Tensor | None:
    """fp32 rows of a quantised (tied) embedding at `ids`, by the CPU kernel, or None."""
    if cpu_quant.usable(scale, qweight):
        return cpu_quant.embedding_rows(method, qweight, scale, ids, group_size)
    return None


def quantize_weight_rows(method: str, w: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                         group_size: int) -> bool:
    """Quantise float rows `w` into `qweight` / `scale` in place by the CPU kernel; False where it
    does not apply (the caller runs the torch twin, quant_formats.quantize_int8 / int4)."""
    if not cpu_quantize.usable(w, qweight):
        return False
    cpu_quantize.quantize_rows(method, w, qweight, scale, group_size)
    return True
