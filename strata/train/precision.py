"""Mixed precision for training: fp32 master weights, autocast for bf16/fp16 compute, and
torch.amp.GradScaler's dynamic loss scaling for fp16 (growth after N clean steps, backoff and a
skipped step on inf/NaN gradients)."""

from __future__ import annotations

import contextlib
import logging

import torch

from strata.config import DTYPES
from strata.errors import ConfigError
from strata.hardware.dtype_policy import train_dtype
from strata.hardware.probe import probe

logger = logging.getLogger(__name__)


def resolve_precision(name: str, device: str) -> tuple[torch.dtype, str]:
    """(compute dtype, why). "auto" asks the hardware layer, which decides by measurement."""
    if name != "auto":
        dtype = DTYPES[name]
        if device.startswith("cuda") and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise ConfigError("--precision bfloat16: this GPU has no bf16; use float16 (loss-scaled) or float32")
        return dtype, "as asked (--precision)"
    return train_dtype(probe(device))


class Precision:
    def __init__(self, dtype: torch.dtype, device: str) -> None:
        self.dtype, self.device_type = dtype, torch.device(device).type
        self.scaler = torch.amp.GradScaler(self.device_type, enabled=dtype == torch.float16)

    @property
    def name(self) -> str:
        return next(k for k, v in DTYPES.items() if v == self.dtype)

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler.is_enabled() else loss

    def loss_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler.is_enabled():
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, grads_finite: bool) -> bool:
        """Apply the update; False when the step was skipped (non-finite gradients)."""
        if not self.scaler.is_enabled():
            if grads_finite:
                optimizer.step()
            return grads_finite
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)  # skips the update itself when unscale_ found inf/NaN
        self.scaler.update()
        return self.scaler.get_scale() >= before

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler.is_enabled() else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler.is_enabled() and state:
            self.scaler.load_state_dict(state)
