"""LoRA adapters on the decoder's projections, many in one batch (Punica SGMV / S-LoRA style).

Every targeted projection (q/k/v, o, gate/up, down of the Llama-shaped layers) carries a `LoRABank`
as its child module `lora`: `slots` adapters' A and B stacked, zero-padded to one rank,

    lora_a [slots, segments * rank, in]    lora_b [slots, out, rank]    scale [slots, segments]

where a fused module (qkv, gate/up) has one segment per HF projection it holds (q, k, v), each with
its own rank block of A and its own output rows of B; an adapter that leaves a segment out has
zeros there. y += scale * B_seg (A_seg x) for the rows of each slot: shrink, then expand. A and B
are stored fp32 or bf16 (EngineConfig.lora_dtype) and always computed in fp32.

Which slot each token row uses is the step's `LoRABatch`, set around the forward by `lora_batch`
(a ContextVar, like the kernel thread cap: nothing else in the process sees it): rows grouped by
slot, so a batch mixing adapters (and none) runs two small matmuls per adapter per projection.
No batch set: the banks add nothing (the base model's output, bit for bit).

Training uses the same banks with one slot, its A and B trainable (`LoRABatch.every_row(0)`).
"""

from __future__ import annotations

import contextlib
import math
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.profiler import record_function

from strata.kernels import cpu_lora
from strata.kernels.dispatch import KERNEL_MODE

LORA_RANGE = "strata::lora"  # the profiler range of one bank's deltas (strata analyze attributes it)


@dataclass(frozen=True)
class LoRABatch:
    """The step's rows by adapter slot: `groups` (slot, row indices; None = every row) and
    `token_slots` [rows] int64 (-1: no adapter) for the fused CPU kernels."""

    groups: tuple[tuple[int, torch.Tensor | None], ...]
    token_slots: np.ndarray | None

    @classmethod
    def of(cls, token_slots) -> LoRABatch | None:
        """From each row's slot (-1: none); None when no row has an adapter."""
        slots = np.asarray(token_slots, dtype=np.int64)
        used = np.unique(slots[slots >= 0])
        if not len(used):
            return None
        if len(used) == 1 and (slots == used[0]).all():
            return cls(((int(used[0]), None),), slots)
        groups = tuple((int(s), torch.from_numpy(np.flatnonzero(slots == s))) for s in used)
        return cls(groups, slots)

    @classmethod
    def every_row(cls, slot: int = 0) -> LoRABatch:
        """Every row through one slot (training; a batch of one adapter)."""
        return cls(((slot, None),), None)

    def row_slots(self, rows: int) -> np.ndarray | None:
        """Each of `rows` rows' slot (-1: none), from the groups when token_slots is not given;
        None when token_slots is given for another row count."""
        if self.token_slots is not None:
            return self.token_slots if len(self.token_slots) == rows else None
        slots = np.full(rows, -1, np.int64)
        for slot, idx in self.groups:
            slots[slice(None) if idx is None else idx.numpy()] = slot
        return slots


ACTIVE: ContextVar[LoRABatch | None] = ContextVar("strata_lora_batch", default=None)


@contextlib.contextmanager
def lora_batch(batch: LoRABatch | None):
    """Run the forwards inside with `batch`'s adapters applied (None: none)."""
    token = ACTIVE.set(batch)
    try:
        yield
    finally:
        ACTIVE.reset(token)


class LoRABank(nn.Module):
    """The adapters of one projection module (see the module docstring for the layout)."""

    def __init__(self, in_features: int, segments: list[tuple[int, int]], slots: int, rank: int,
                 trainable: bool = False, dropout: float = 0.0, device=None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.segments, self.slots, self.rank = in_features, tuple(segments), slots, rank
        self.out_features = segments[-1][1]
        self.dropout = dropout
        n = len(segments)
        self.lora_a = nn.Parameter(torch.zeros(slots, n * rank, in_features, device=device, dtype=dtype),
                                   requires_grad=trainable)
        self.lora_b = nn.Parameter(torch.zeros(slots, self.out_features, rank, device=device, dtype=dtype),
                                   requires_grad=trainable)
        self.register_buffer("scale", torch.zeros(slots, n, device=device))
        self._bounds: np.ndarray | None = None  # the segments' column bounds, for the CPU kernel

    def set_slot(self, slot: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """Fill `slot` with an adapter's segments {segment: (A [r, in], B [seg_out, r], scale)};
        segments it leaves out (and ranks below the bank's) are zeros."""
        with torch.no_grad():
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()
            self.scale[slot].zero_()
            for seg, (a, b, scale) in weights.items():
                lo, hi = self.segments[seg]
                r = a.shape[0]
                self.lora_a[slot, seg * self.rank : seg * self.rank + r].copy_(a)
                self.lora_b[slot, lo:hi, :r].copy_(b)
                self.scale[slot, seg] = scale

    def clear_slot(self, slot: int) -> None:
        self.set_slot(slot, {})

    def segment_weights(self, slot: int, seg: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One segment's (A [rank, in], B [seg_out, rank]) of `slot` (views; the export reads them)."""
        lo, hi = self.segments[seg]
        return self.lora_a[slot, seg * self.rank : (seg + 1) * self.rank], self.lora_b[slot, lo:hi]

    def delta(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        """scale * B (A x) of one slot for rows x [n, in] -> [n, out], in fp32 (a bf16 bank widened)."""
        a, b = self.lora_a[slot].float(), self.lora_b[slot].float()
        x = x.float()
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout, True)
        xa = x @ a.t()  # [n, segments * rank]
        r = self.rank
        if len(self.segments) == 1:
            return (xa @ b.t()) * self.scale[slot, 0]
        parts = [(xa[:, s * r : (s + 1) * r] @ b[lo:hi].t()) * self.scale[slot, s]
                 for s, (lo, hi) in enumerate(self.segments)]
        return torch.cat(parts, dim=-1)

    def add(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        """y + each row's adapter delta: a few rows in one kernel call over the bank
        (kernels/cpu_lora.py, where it runs), else rows grouped by slot, one shrink and one expand a slot.
        Under the analyzer's named kernels, one `strata::lora` profiler range (its ops inside)."""
        if KERNEL_MODE.get().named:
            with record_function(LORA_RANGE):
                return self._add(x, y, batch)
        return self._add(x, y, batch)

    def _add(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        lead = y.shape[:-1]
        x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        # the kernel's predicate first: training (grad on) never builds the row slots it would not use
        usable = not (self.dropout and self.training) and cpu_lora.usable(x2, y2, self.lora_a)
        slots = batch.row_slots(len(x2)) if usable else None
        if slots is not None:
            if self._bounds is None:
                self._bounds = cpu_lora.bounds_of(self.segments)
            cpu_lora.add_rows(x2, y2, self.lora_a, self.lora_b, self.scale, self._bounds, slots)
            return y2.view(*lead, y2.shape[-1])
        inplace = not torch.is_grad_enabled()
        for slot, rows in batch.groups:
            if rows is None:
                d = self.delta(x2, slot).to(y2.dtype)
                y2 = y2.add_(d) if inplace else y2 + d
            else:
                d = self.delta(x2.index_select(0, rows), slot).to(y2.dtype)
                y2 = y2.index_add_(0, rows, d) if inplace else y2.index_add(0, rows, d)
        return y2.view(*lead, y2.shape[-1])


def bank_of(m: nn.Module) -> LoRABank | None:
    return m._modules.get("lora")


def project(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """m(x) plus the step's adapters where `m` carries a bank (the decoder's projections call this)."""
    y = m(x)
    bank = m._modules.get("lora")
    if bank is not None:
        batch = ACTIVE.get()
        if batch is not None:
            return bank.add(x, y, batch)
    return y


def active(m: nn.Module) -> bool:
    """Whether `m` has adapters applied in this step (its fused forms that skip `project` step aside)."""
    return m._modules.get("lora") is not None and ACTIVE.get() is not None


def lora_scale(alpha: float, rank: int, rslora: bool) -> float:
    """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank
