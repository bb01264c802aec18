"""The pieces graph/tensor_parallel.py builds a shard from: the modules that hold a collective
(row-parallel projection, vocab-parallel embedding and LM head) and the slicing of float and
quantised (memory/quant.py QuantLinear) weights. Every slice is a fresh contiguous tensor."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from strata.errors import ConfigError
from strata.graph.lora import project
from strata.memory.quant import QuantLinear


class Comm(Protocol):
    """What the sharded model calls (strata.comm.collectives.Communicator provides it)."""

    rank: int
    world_size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor: ...


# --- the modules that hold a collective ------------------------------------------------------------


class RowParallelLinear(nn.Module):
    """A projection over this rank's input columns; partial sums all-reduced, then the bias. A LoRA
    bank (graph/lora.py) sits on `inner`, over the same input columns: its partial delta joins the
    partial sums before the one all-reduce (the delta is linear), and the bias is still added once."""

    def __init__(self, inner: nn.Module, bias: torch.Tensor | None, comm: Comm) -> None:
        super().__init__()
        self.inner = inner  # Linear or QuantLinear without bias
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.comm.all_reduce(project(self.inner, x).contiguous())
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding over token ids [start, start + real_rows): masked lookup, then all-reduce."""

    def __init__(self, inner: nn.Module, start: int, real_rows: int, comm: Comm) -> None:
        super().__init__()
        self.inner = inner  # nn.Embedding or QuantEmbedding over the shard's rows
        self.start, self.real_rows, self.comm = start, real_rows, comm

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.real_rows)
        out = self.inner(local.masked_fill(outside, 0))
        return self.comm.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0).contiguous())


class VocabParallelHead(nn.Module):
    """lm_head over this rank's vocabulary rows; the logits all-gathered to the full vocabulary."""

    def __init__(self, inner: nn.Module, vocab_size: int, comm: Comm) -> None:
        super().__init__()
        self.inner = inner  # Linear or QuantLinear over the shard's rows
        self.vocab_size, self.comm = vocab_size, comm

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = self.comm.all_gather(self.inner(x).contiguous(), dim=-1)
        return full if full.shape[-1] == self.vocab_size else full[..., : self.vocab_size].contiguous()


# --- slicing ---------------------------------------------------------------------------------------


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous().clone(), requires_grad=False)


def _rows(t: torch.Tensor, spans: list[slice]) -> torch.Tensor:
    return torch.cat([t[s] for s in spans])


def _float_linear(cls: type, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    with torch.device("meta"):
        lin = cls(weight.shape[1], weight.shape[0], bias=bias is not None)
    lin.weight = _param(weight)
    lin.bias = None if bias is None else _param(bias)
    return lin


def _quant(q: QuantLinear, qweight, scale, in_features: int, bias) -> QuantLinear:
    out = QuantLinear(q.method, qweight.contiguous().clone(), scale.contiguous().clone(), in_features,
                      q.group_size, None if bias is None else bias.contiguous().clone())
    if q.input_perm is not None and in_features == q.in_features:  # its rows, all its input columns
        out.set_input_perm(q.input_perm.clone())
    return out


def column_parallel(proj: nn.Module, spans: list[slice]) -> nn.Module:
    """The output rows `spans` of a Linear / QuantLinear, fused in that order."""
    bias = None if proj.bias is None else _rows(proj.bias.detach(), spans)
    if isinstance(proj, QuantLinear):
        return _quant(proj, _rows(proj.qweight, spans), _rows(proj.scale, spans), proj.in_features, bias)
    return _float_linear(type(proj), _rows(proj.weight.detach(), spans), bias)


def int4_cols_ok(proj: nn.Module, width: int) -> bool:
    """Whether a column slice of `width` keeps whole groups (int4, grouped int8)."""
    return not (isinstance(proj, QuantLinear) and proj.group_size and width % proj.group_size)


def row_parallel(proj: nn.Module, cols: slice, comm: Comm) -> RowParallelLinear:
    """Input columns `cols` of a Linear / QuantLinear (bias added once, after the all-reduce)."""
    bias = None if proj.bias is None else proj.bias.detach().clone()
    if isinstance(proj, QuantLinear):
        if proj.input_perm is not None:
            raise ConfigError("tensor parallel: a GPTQ act-order (desc_act) checkpoint's row-parallel "
                              "projections gather their input across the whole row; shard a checkpoint "
                              "without act order, or run it on one device")
        width = cols.stop - cols.start
        if proj.method == "int8" and proj.scale.dim() == 1:  # per-row scale: the same for every column slice
            inner = _quant(proj, proj.qweight[:, cols], proj.scale, width, None)
        elif proj.method == "int8":  # grouped: group j is columns [j*g, (j+1)*g)
            g = proj.group_size
            inner = _quant(proj, proj.qweight[:, cols], proj.scale[..., cols.start // g : cols.stop // g], width, None)
        else:  # packed per group (quant_formats.py): group j is bytes [j*g/2, (j+1)*g/2)
            g = proj.group_size
            qcols = slice(cols.start // 2, cols.stop // 2)
            inner = _quant(proj, proj.qweight[:, qcols], proj.scale[..., cols.start // g : cols.stop // g],
                           width, None)
    else:
        inner = _float_linear(type(proj), proj.weight.detach()[:, cols], None)
    return RowParallelLinear(inner, bias, comm)


def pad_rows(t: torch.Tensor, rows: int, fill: int | float = 0) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = torch.full((rows - t.shape[0], *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad])


def vocab_rows(proj: nn.Module, real: slice, rows: int) -> nn.Module:
    """The output rows `real` of an lm_head (Linear / QuantLinear), padded to `rows` (zero weights;
    int8 / int4 codes of 0 with scale 1)."""
    bias = None if proj.bias is None else pad_rows(proj.bias.detach()[real], rows)
    if isinstance(proj, QuantLinear):
        zero = 0 if proj.method == "int8" else 0x88  # int4: nibble 8 is the value 0
        qweight = pad_rows(proj.qweight[real], rows, zero)
        scale = pad_rows(proj.scale[real], rows, 1.0)
        if scale.dim() == 3:  # zero points: 0 in the padding rows too
            scale[proj.scale[real].shape[0]:, 1] = 0.0
        return _quant(proj, qweight, scale, proj.in_features, bias)
    return _float_linear(type(proj), pad_rows(proj.weight.detach()[real], rows), bias)


def float_embedding(weight: torch.Tensor) -> nn.Embedding:
    with torch.device("meta"):
        emb = nn.Embedding(weight.shape[0], weight.shape[1])
    emb.weight = weight if isinstance(weight, nn.Parameter) else _param(weight)
    return emb
