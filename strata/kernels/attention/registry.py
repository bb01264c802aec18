"""Attention backends by name, and the engine's choice among them (`select_backend`)."""

from __future__ import annotations

import logging

import torch

from strata.errors import ConfigError
from strata.kernels.attention.base import AttentionBackend
from strata.kernels.attention.cpu_backend import CpuBackend
from strata.kernels.attention.sdpa_backend import SdpaBackend
from strata.kernels.attention.torch_backend import TorchBackend
from strata.kernels.attention.triton_backend import TritonBackend

logger = logging.getLogger(__name__)

TORCH, SDPA, CPU, TRITON = TorchBackend(), SdpaBackend(), CpuBackend(), TritonBackend()
_REGISTRY: dict[str, AttentionBackend] = {b.name: b for b in (TORCH, SDPA, CPU, TRITON)}
BACKENDS: tuple[str, ...] = tuple(_REGISTRY)  # ("torch", "sdpa", "cpu", "triton")
_AUTO = (CPU, TRITON)  # auto's preference, first available; else SDPA


def get_backend(name: str) -> AttentionBackend:
    """The backend registered under `name`."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}") from None


def resolve_backend(backend: AttentionBackend | str) -> AttentionBackend:
    """`backend` itself, or the backend registered under that name."""
    return backend if isinstance(backend, AttentionBackend) else get_backend(backend)


def select_backend(choice: str, device: str, dtype: torch.dtype) -> AttentionBackend:
    """The backend for EngineConfig.attention_backend `choice` on `device` with `dtype`.

    auto: the numba paged-decode kernel ("cpu") for fp32 on CPU when numba is present, the Triton
    kernel ("triton") on CUDA when triton is importable, else SDPA. A named backend that cannot run
    there is a ConfigError saying what it needs.
    """
    if choice == "auto":
        backend = next((b for b in _AUTO if b.unavailable(device, dtype) is None), SDPA)
    else:
        if choice not in _REGISTRY:
            raise ConfigError(
                f"attention_backend: unknown {choice!r}; choose auto, {', '.join(BACKENDS[:-1])} or {BACKENDS[-1]}"
            )
        backend = _REGISTRY[choice]
        reason = backend.unavailable(device, dtype)
        if reason is not None:
            raise ConfigError(f"attention_backend: {choice!r} {reason}; use 'auto' or 'sdpa'")
    logger.info("attention backend: %s", backend.name)
    return backend
