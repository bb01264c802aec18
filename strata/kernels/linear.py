"""The one dispatch point for dense projections: a skinny-matmul kernel where it pays, else torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kernels import cpu_gemv


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if cpu_gemv.usable(x, weight):
        return cpu_gemv.gemv(x, weight, bias)
    return F.linear(x, weight, bias)
