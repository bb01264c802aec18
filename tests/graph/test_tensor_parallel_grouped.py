"""Tensor-parallel shards of grouped int8 projections (a GGUF's Q8_0, memory/quant.py): a row-parallel
shard takes its columns' groups of scales, a column-parallel one its rows', and each shard's
weight is the matching slice of the whole one, exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from strata.graph.tensor_parallel_layers import column_parallel, int4_cols_ok, row_parallel
from strata.memory.quant import QuantLinear


def _grouped(out_f: int, in_f: int) -> QuantLinear:
    lin = nn.Linear(in_f, out_f, bias=False)
    return QuantLinear.from_linear(lin, "int8", 32, grouped_int8=True)


def test_row_parallel_shard_takes_its_columns_groups():
    q = _grouped(48, 256)
    assert q.scale.shape == (48, 8)
    whole = q.dequantize()
    for cols in (slice(0, 128), slice(128, 256), slice(64, 96)):
        shard = row_parallel(q, cols, comm=None).inner
        assert shard.scale.shape == (48, (cols.stop - cols.start) // 32)
        assert torch.equal(shard.dequantize(), whole[:, cols])
    assert int4_cols_ok(q, 64) and not int4_cols_ok(q, 48)  # a shard must keep whole groups


def test_column_parallel_shard_takes_its_rows():
    q = _grouped(96, 128)
    spans = [slice(0, 16), slice(48, 64)]
    shard = column_parallel(q, spans)
    assert torch.equal(shard.dequantize(), torch.cat([q.dequantize()[s] for s in spans]))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_user_quantization_keeps_its_formats(method):
    """--quantization int8 stays per row (group sizes name int4's groups, not int8's)."""
    q = QuantLinear.from_linear(nn.Linear(128, 32, bias=False), method, 64)
    assert q.scale.dim() == (1 if method == "int8" else 2)
