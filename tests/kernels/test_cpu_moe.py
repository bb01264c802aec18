"""kernels/cpu_moe.py against its torch twins: the compiled router against graph/moe.Router (top-k
ids, weights, the tie report), the expert dispatch against MoEBlock's grouped forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.graph.moe import MoEBlock
from strata.kernels import cpu_moe
from strata.model_config import MoEConfig

pytestmark = pytest.mark.skipif(not cpu_moe.available(), reason="numba is not installed")


def _block(experts=8, top_k=3, norm=True, hidden=32, inter=24) -> MoEBlock:
    torch.manual_seed(0)
    block = MoEBlock(hidden, MoEConfig(experts, top_k, inter, norm, 0, (True,), 0.0))
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    return block


@pytest.mark.parametrize("norm", [False, True])
def test_route_equals_the_router(norm):
    block = _block(norm=norm)
    h = torch.randn(9, 32)
    ids, w = np.empty((9, 3), np.int64), np.empty((9, 3), np.float32)
    assert not cpu_moe.route(h.numpy(), block.gate.weight.detach().numpy(), 3, norm, ids, w)
    _, want_w, want_ids = block.gate(h)
    assert (ids == want_ids.numpy()).all()
    np.testing.assert_allclose(w, want_w.detach().numpy(), atol=1e-6)


def test_a_tie_at_the_kth_place_is_reported():
    block = _block()
    with torch.no_grad():
        block.gate.weight[5] = 1.0  # experts 5 and 6 score alike, far above the rest, for these rows
        block.gate.weight[6] = 1.0
    h = (torch.rand(4, 32) + 0.5).numpy()
    weight = block.gate.weight.detach().numpy()
    ids, w = np.empty((4, 1), np.int64), np.empty((4, 1), np.float32)
    assert cpu_moe.route(h, weight, 1, True, ids, w)  # k = 1 splits the tied pair: torch decides
    ids, w = np.empty((4, 2), np.int64), np.empty((4, 2), np.float32)
    assert not cpu_moe.route(h, weight, 2, True, ids, w)  # both picked: no tie at the boundary
    assert (np.sort(ids, axis=1) == [5, 6]).all()


def test_experts_equal_the_grouped_block():
    """The compiled dispatch (fp32 experts) against MoEBlock.routed on the same routing."""
    from strata.platform.cpu_layers import _Experts

    block = _block().requires_grad_(False)
    h = torch.randn(5, 32)
    _, weights, ids = block.gate(h)
    want = block.routed(h, weights, ids).detach().numpy()
    lists = _Experts.of(block.experts, 5)
    assert isinstance(lists, tuple), lists
    pairs, n_exp = 5 * 3, 8
    scratch = (np.empty((pairs, 32), np.float32), np.empty((pairs, 24), np.float32), np.empty((pairs, 32), np.float32),
               np.empty(pairs, np.int64), np.empty(pairs, np.float32), np.empty(n_exp, np.int64),
               np.empty(n_exp, np.int64), np.empty(n_exp, np.int64))
    counts = np.zeros(n_exp, np.int64)
    out = np.empty((5, 32), np.float32)
    with torch.no_grad():
        cpu_moe.experts(h.numpy(), ids.numpy(), weights.detach().numpy(), *lists, *scratch, counts, 1, out)
    np.testing.assert_allclose(out, want, atol=1e-5)
    assert counts.sum() == pairs and (counts == np.bincount(ids.reshape(-1).numpy(), minlength=n_exp)).all()
