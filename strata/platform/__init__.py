"""The platform room: everything that makes a device fast, chosen once per engine.

`select_platform(device, profile)` returns the CPU platform (platform/cpu.py: the fused decode
step, the kernel policy from the measured profile, the run-time tuners) or the GPU one
(platform/cuda.py: capture, no host tuners). build_engine asks it for the pieces listed in
platform/base.py. Nothing outside this package and kernels/ imports the CPU kernels directly
(import-linter keeps it, with the exceptions pyproject.toml names and says why).
"""

from __future__ import annotations

from strata.hardware.profile import HardwareProfile
from strata.platform.base import Platform
from strata.platform.cpu import CpuPlatform
from strata.platform.cuda import CudaPlatform


def select_platform(device: str, profile: HardwareProfile | None) -> Platform:
    return CpuPlatform(profile) if device == "cpu" else CudaPlatform(profile)
