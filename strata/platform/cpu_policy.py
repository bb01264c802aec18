"""The CPU platform's kernel policy: which prefill GEMM each projection takes and whether a bf16
checkpoint keeps bf16 weights, decided from the hardware profile's measurements (never from a
fixed table: a kernel that wins on one CPU loses on the next).

hardware/dtype_policy.py picks the compute dtype; this picks among the CPU kernels for it.
"""

from __future__ import annotations

import torch

from strata.errors import ConfigError
from strata.hardware.dtype_policy import SWITCH_MARGIN, checkpoint_dtype_name
from strata.hardware.profile import HardwareProfile
from strata.kernels import cpu_gemm, cpu_w8a8
from strata.settings import SETTINGS

PREFILL_GEMM_ENV = "STRATA_PREFILL_GEMM"  # auto (by measurement) | aten | onednn | bf16 (strata/settings.py)


def bf16_storage(profile: HardwareProfile, checkpoint_dtype: torch.dtype) -> tuple[bool, str, str]:
    """CPU `dtype="auto"`, first question: keep a bf16 checkpoint's weights in bf16 and compute in
    fp32 (memory/bf16_weights.py)? Returns (use it, the prefill GEMM path for kernels/cpu_bf16.py,
    why).

    Only for bf16 checkpoints: their weights widen to fp32 exactly, so this is the fp32 model with
    half the weight bytes (nothing rounded that the checkpoint did not already round). Chosen when
    the measured bf16 batch-1 GEMV streams tokens SWITCH_MARGIN faster than fp32's (2 bytes a
    weight against 4). Prefill takes the bf16 GEMM (activations rounded to bf16, oneDNN) only
    where the measured prefill-shaped GEMM beats fp32's by SWITCH_MARGIN, else widened tiles and
    the fp32 GEMM (exact)."""
    if checkpoint_dtype != torch.bfloat16:
        return False, "fp32", f"checkpoint is {checkpoint_dtype_name(checkpoint_dtype)}, not bf16"
    fp32_gbs, bf16_gbs = profile.linear_gbs.get("float32", 0.0), profile.linear_gbs.get("bfloat16", 0.0)
    if fp32_gbs <= 0 or bf16_gbs <= 0:
        return False, "fp32", "the hardware profile has no batch-1 rates for fp32 and bf16"
    decode_x = (bf16_gbs / 2) / (fp32_gbs / 4)
    _, narrow, gemm_why = prefill_gemms(profile)
    prefill = "bf16" if narrow == "bf16" else "fp32"
    why = (f"batch-1 GEMV bf16 {bf16_gbs:.1f} vs fp32 {fp32_gbs:.1f} GB/s of weights ({decode_x:.2f}x tokens/s); "
           f"{gemm_why}")
    return decode_x >= SWITCH_MARGIN, prefill, why


GEMM_RATE_KEY = {"aten": "float32", "onednn": "float32_onednn", "bf16": "bfloat16"}  # path -> gemm_gflops key


def prefill_gemms(profile: HardwareProfile) -> tuple[str, str, str]:
    """CPU prefill GEMM paths (kernels/cpu_gemm.py) by measurement: (fp32 weights' path, narrow
    weights' path, why). fp32: oneDNN where its measured fp32 GEMM beats torch's (MKL) by
    SWITCH_MARGIN, else aten. Narrow (bf16 / int8 / int4 weights): bf16 where the measured bf16
    GEMM beats the chosen fp32 one by SWITCH_MARGIN (activations then round to bf16), else the
    fp32 path on widened / dequantised tiles. STRATA_PREFILL_GEMM=aten|onednn puts every weight on
    that fp32 path (exact: no bf16 rounding anywhere); =bf16 forces the bf16 path for narrow weights."""
    forced = SETTINGS.prefill_gemm
    if forced not in ("auto", "aten", "onednn", "bf16"):
        raise ConfigError(f"{PREFILL_GEMM_ENV}={forced!r}: choose auto, aten, onednn (every weight on that "
                          "fp32 GEMM, exact) or bf16 (narrow weights through the bf16 GEMM)")
    aten, onednn, bf16 = (profile.gemm_gflops.get(GEMM_RATE_KEY[p], 0.0) for p in ("aten", "onednn", "bf16"))
    fp32 = "onednn" if onednn >= SWITCH_MARGIN * aten and onednn > 0 else "aten"
    best = max(aten, onednn) if fp32 == "onednn" else aten
    narrow = "bf16" if best > 0 and bf16 >= SWITCH_MARGIN * best else fp32
    if forced in ("aten", "onednn"):
        fp32 = narrow = forced
    elif forced == "bf16":
        narrow = "bf16"
    why = (f"prefill GEMM fp32 {aten:.0f} (torch) / {onednn:.0f} (oneDNN), bf16 {bf16:.0f} GFLOP/s -> "
           f"fp32 weights {fp32}, narrow weights {narrow}"
           + (f" ({PREFILL_GEMM_ENV}={forced})" if forced != "auto" else ""))
    return fp32, narrow, why


def int8_prefill_gemm(profile: HardwareProfile, narrow: str, method: str = "int8") -> tuple[str, str]:
    """The prefill GEMM of `method` (int8 or int4) weights: "int8" (W8A8, kernels/cpu_w8a8.py;
    `narrow` for inputs it does not take) where cpu_w8a8.prefill_enabled allows it (int8: asked for
    with STRATA_INT8_PREFILL=w8a8; int4: by default) and torch's measured int8 GEMM beats the
    `narrow` path's rate by SWITCH_MARGIN, unless STRATA_PREFILL_GEMM is set; else `narrow`.
    Returns (path, why)."""
    int8 = profile.gemm_gflops.get("int8_int8", 0.0)
    other = profile.gemm_gflops.get(GEMM_RATE_KEY[narrow], 0.0)
    forced = SETTINGS.prefill_gemm
    if forced != "auto":
        return narrow, f"{method} weights: W8A8 prefill off ({PREFILL_GEMM_ENV}={forced} names the narrow weights' GEMM)"
    if not cpu_w8a8.prefill_enabled(method):
        asked = (f"{cpu_w8a8.INT8_PREFILL_ENV}=w8a8 asks for it; " if method == "int8" else
                 f"{cpu_w8a8.INT4_PREFILL_ENV}=dequant, STRATA_INT4_FP32_ACTIVATIONS=1 or no SSSE3 turn it off; ")
        return narrow, (f"{method} weights: W8A8 prefill off ({asked}"
                        "needs numba and torch._int_mm, and no STRATA_INT8_FP32_ACTIVATIONS=1)")
    path = "int8" if int8 > 0 and other > 0 and int8 >= SWITCH_MARGIN * other else narrow
    return path, f"int8 x int8 GEMM {int8:.0f} GOP/s vs {narrow} {other:.0f} -> {method} weights' prefill {path}"


def mark_prefill_gemms(model, profile: HardwareProfile) -> tuple[int, str]:
    """Mark every projection of `model` with the prefill GEMM path `prefill_gemms` picks (kernels/
    cpu_gemm.py), falling back to aten where this torch build lacks oneDNN's linear; int8 and int4
    weights take `int8_prefill_gemm`'s. Returns (projections marked, why)."""
    fp32, narrow, why = prefill_gemms(profile)
    if not cpu_gemm.onednn_available():
        fp32, narrow = "aten", "aten" if narrow == "onednn" else narrow
    int8, int8_why = int8_prefill_gemm(profile, narrow, "int8")
    int4, int4_why = int8_prefill_gemm(profile, narrow, "int4")
    return cpu_gemm.mark(model, fp32, narrow, int8, int4), f"{why}; {int8_why}; {int4_why}"
