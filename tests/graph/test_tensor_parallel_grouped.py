"""Tensor-parallel shards of grouped int8 projections (a GGUF's Q8_0, memory/quant.py): a row-parallel
shard takes its columns' groups of scales, a column-parallel one its rows', and each shard's
weight is the matching slice of the whole one, exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from strata.graph.tensor_parallel_layers import column_parallel, int4_cols_ok, row_parallel
from strata.memory.quant import QuantLinear

# (method, group, zero points): grouped int8 by 32 (Q8_0) and 16 (Q6_K), with zero points (Q5_K),
# int4 group 32 with zero points (Q4_K)
LAYOUTS = [("int8", 32, False), ("int8", 16, False), ("int8", 32, True), ("int4", 32, True)]


def _grouped(out_f: int, in_f: int, method: str = "int8", group: int = 32, zero: bool = False) -> QuantLinear:
    lin = nn.Linear(in_f, out_f, bias=False)
    q = QuantLinear.from_linear(lin, method, group, grouped_int8=method == "int8", zero=zero)
    if zero:
        q.scale[:, 1].copy_(torch.rand(q.scale[:, 1].shape))
    return q


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_row_parallel_shard_takes_its_columns_groups(layout):
    method, group, zero = layout
    q = _grouped(48, 256, *layout)
    assert q.scale.shape[-1] == 256 // group and (q.scale.dim() == 3) == zero
    whole = q.dequantize()
    for cols in (slice(0, 128), slice(128, 256), slice(64, 96)):
        shard = row_parallel(q, cols, comm=None).inner
        assert shard.scale.shape[-1] == (cols.stop - cols.start) // group and shard.scale.is_contiguous()
        assert torch.equal(shard.dequantize(), whole[:, cols])
    assert int4_cols_ok(q, 64) and not int4_cols_ok(q, 40)  # a shard must keep whole groups


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_column_parallel_shard_takes_its_rows(layout):
    q = _grouped(96, 128, *layout)
    spans = [slice(0, 16), slice(48, 64)]
    shard = column_parallel(q, spans)
    assert torch.equal(shard.dequantize(), torch.cat([q.dequantize()[s] for s in spans]))


def test_padded_vocab_rows_have_no_zero_points():
    """An lm_head padded to a TP multiple: the padding rows are the value 0 in every layout."""
    from strata.graph.tensor_parallel_layers import vocab_rows

    for layout in LAYOUTS:
        padded = vocab_rows(_grouped(30, 64, *layout), slice(0, 30), 32).dequantize()
        assert padded.shape == (32, 64) and torch.equal(padded[30:], torch.zeros(2, 64))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_user_quantization_keeps_its_formats(method):
    """--quantization int8 stays per row (group sizes name int4's groups, not int8's)."""
    q = QuantLinear.from_linear(nn.Linear(128, 32, bias=False), method, 64)
    assert q.scale.dim() == (1 if method == "int8" else 2)
