"""Strata's `dtype="auto"`: the compute dtype that follows from a device's measured profile.

CUDA keeps the checkpoint's dtype (bf16 falls back to fp16 where unsupported); CPU takes the
fastest of fp32/bf16 (fp16 for fp16 checkpoints) by the profile's batch-1 and batched F.linear
rates. probe.auto_dtype applies it to the cached probe() profile.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from strata.config import DTYPES
from strata.errors import ConfigError
from strata.hardware.measure import MATMUL_BATCH
from strata.hardware.profile import HardwareProfile

logger = logging.getLogger(__name__)

PREFILL_GEMM_ENV = "STRATA_PREFILL_GEMM"  # auto (by measurement) | aten | onednn | bf16
SWITCH_MARGIN = 1.1  # a narrow dtype must beat fp32 by this much on every measure to be chosen


def _checked_checkpoint_dtype(checkpoint_dtype: torch.dtype) -> torch.dtype:
    if checkpoint_dtype == torch.float64:
        return torch.float32
    if checkpoint_dtype not in DTYPES.values():
        raise ConfigError(
            f"checkpoint dtype {checkpoint_dtype} has no automatic compute dtype; "
            "pass dtype='float32', 'bfloat16' or 'float16' explicitly"
        )
    return checkpoint_dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def _auto_cuda(checkpoint: torch.dtype, profile: HardwareProfile | None) -> torch.dtype:
    if checkpoint != torch.bfloat16:
        return checkpoint
    if profile is not None:
        supported = profile.matmul_gflops.get("bfloat16", 0.0) > 0
    else:
        supported = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if supported:
        return torch.bfloat16
    logger.warning("bf16 checkpoint on a GPU without bf16 support: computing in float16")
    return torch.float16


def _auto_cpu(checkpoint: torch.dtype, profile: HardwareProfile) -> torch.dtype:
    """Fastest dtype by measurement: a narrow dtype must win on both decode and batched work."""
    ref_decode = profile.linear_gbs.get("float32", 0.0) / 4
    ref_batched = profile.matmul_gflops.get("float32", 0.0)
    if ref_decode <= 0 or ref_batched <= 0:
        logger.info("auto dtype: profile has no float32 figures; using float32")
        return torch.float32
    # fp16 cannot hold the range of a bf16/fp32 checkpoint, so it is only a candidate for fp16 ones.
    candidates = ["bfloat16"] + (["float16"] if checkpoint == torch.float16 else [])
    best, best_score = "float32", 1.0
    notes = [
        f"float32: batch-1 {profile.linear_gbs['float32']:.1f} GB/s, "
        f"batch-{MATMUL_BATCH} {ref_batched:.1f} GFLOP/s"
    ]
    for name in candidates:
        gbs = profile.linear_gbs.get(name, 0.0)
        gflops = profile.matmul_gflops.get(name, 0.0)
        itemsize = DTYPES[name].itemsize
        decode_x = gbs / itemsize / ref_decode
        batched_x = gflops / ref_batched
        score = min(decode_x, batched_x)
        notes.append(
            f"{name}: batch-1 {gbs:.1f} GB/s ({decode_x:.2f}x fp32 per token), "
            f"batch-{MATMUL_BATCH} {gflops:.1f} GFLOP/s ({batched_x:.2f}x)"
        )
        if score >= SWITCH_MARGIN and score > best_score:
            best, best_score = name, score
    logger.info(
        "auto dtype on %s (%s, isa %s): %s; checkpoint %s -> %s",
        profile.device,
        profile.name,
        "+".join(profile.isa) or "none",
        "; ".join(notes),
        _dtype_name(checkpoint),
        best,
    )
    return DTYPES[best]


def auto_dtype(
    device: str, checkpoint_dtype: torch.dtype, profile: HardwareProfile | None = None,
    cpu_profile: Callable[[str], HardwareProfile] | None = None,
) -> torch.dtype:
    """Strata's `dtype="auto"`.

    CUDA: the checkpoint's dtype (bf16 falls back to fp16 where unsupported; fp32 stays fp32).
    CPU: the fastest of fp32/bf16 (and fp16 for fp16 checkpoints) by the profile's measured
    batch-1 and batched F.linear rates; narrow dtypes whose batched matmul is slow (CPUs without
    AVX512-BF16/AMX) lose to fp32. Without `profile`, a CPU's comes from `cpu_profile("cpu")`
    (probe.auto_dtype passes probe.probe: the cached measurement).
    """
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r}: only 'cpu' and 'cuda[:N]' are supported")
    if profile is not None and torch.device(profile.device).type != kind:
        raise ConfigError(f"profile is for {profile.device!r}, not device={device!r}")
    checkpoint = _checked_checkpoint_dtype(checkpoint_dtype)
    if kind == "cuda":
        return _auto_cuda(checkpoint, profile)
    if profile is None:
        if cpu_profile is None:
            raise ConfigError("auto dtype on CPU needs a measured profile; use strata.hardware.probe.auto_dtype")
        profile = cpu_profile("cpu")
    return _auto_cpu(checkpoint, profile)


def train_dtype(profile: HardwareProfile) -> tuple[torch.dtype, str]:
    """`strata train --precision auto`: the autocast dtype (fp32 = no autocast) and why.

    CUDA: bf16 where the device has it, else fp16 (with loss scaling). CPU: bf16 only when the
    measured prefill-shaped GEMM (what forward and backward run) beats fp32 by SWITCH_MARGIN: it
    does through AMX or AVX-512 BF16 on some CPUs and loses on others (AVX2 without native bf16)."""
    if profile.device.startswith("cuda"):
        if profile.matmul_gflops.get("bfloat16", 0.0) > 0:
            return torch.bfloat16, "CUDA device with bf16"
        return torch.float16, "CUDA device without bf16: fp16 with dynamic loss scaling"
    fp32 = profile.gemm_gflops.get("float32", 0.0)
    bf16 = profile.gemm_gflops.get("bfloat16", 0.0)
    if fp32 <= 0 or bf16 <= 0:
        return torch.float32, "the hardware profile has no GEMM rates for fp32 and bf16"
    ratio = bf16 / fp32
    why = f"measured GEMM bf16 {bf16:.0f} vs fp32 {fp32:.0f} GFLOP/s ({ratio:.2f}x)"
    if ratio >= SWITCH_MARGIN:
        return torch.bfloat16, why
    return torch.float32, why + f", under the {SWITCH_MARGIN}x needed to switch"


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
        return False, "fp32", f"checkpoint is {_dtype_name(_checked_checkpoint_dtype(checkpoint_dtype))}, not bf16"
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
    forced = os.environ.get(PREFILL_GEMM_ENV, "auto") or "auto"
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
    from strata.kernels import cpu_w8a8

    int8 = profile.gemm_gflops.get("int8_int8", 0.0)
    other = profile.gemm_gflops.get(GEMM_RATE_KEY[narrow], 0.0)
    forced = os.environ.get(PREFILL_GEMM_ENV, "auto") or "auto"
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
    from strata.kernels import cpu_gemm

    fp32, narrow, why = prefill_gemms(profile)
    if not cpu_gemm.onednn_available():
        fp32, narrow = "aten", "aten" if narrow == "onednn" else narrow
    int8, int8_why = int8_prefill_gemm(profile, narrow, "int8")
    int4, int4_why = int8_prefill_gemm(profile, narrow, "int4")
    return cpu_gemm.mark(model, fp32, narrow, int8, int4), f"{why}; {int8_why}; {int4_why}"
