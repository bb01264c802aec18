"""Strata's `dtype="auto"`: the compute dtype that follows from a device's measured profile.

CUDA keeps the checkpoint's dtype (bf16 falls back to fp16 where unsupported); CPU takes the
fastest of fp32/bf16 (fp16 for fp16 checkpoints) by the profile's batch-1 and batched F.linear
rates. probe.auto_dtype applies it to the cached probe() profile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from strata.config import DTYPES
from strata.errors import ConfigError
from strata.hardware.measure import MATMUL_BATCH
from strata.hardware.profile import HardwareProfile

logger = logging.getLogger(__name__)

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


def checkpoint_dtype_name(checkpoint_dtype: torch.dtype) -> str:
    """A checkpoint dtype's short name, refused where Strata has no such dtype."""
    return _dtype_name(_checked_checkpoint_dtype(checkpoint_dtype))
