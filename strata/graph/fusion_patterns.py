"""The fusion patterns of graph/fusion.py: each a torch function written op for op as the model's
code computes it (graph/layers.py, graph/models/llama.py, kernels/attention's write_kv), with its
replacement by one strata:: op (graph/fused_ops.py). fusion.py traces them and rewrites the matches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from strata.graph.fused_ops import rotary_ref
from strata.graph.layers import apply_rotary

ANY_EPS = 0.4242421  # literal wildcard in the norm patterns: the matched eps is carried over


def norm_pattern_fp32(x, residual, weight):
    h = x + residual
    return F.rms_norm(h, (h.shape[-1],), weight, ANY_EPS), h


def norm_pattern_lowp(x, residual, weight):
    h = x + residual
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + ANY_EPS)
    return weight * hf.to(h.dtype), h


def norm_replacement(eps: float) -> Callable:
    def replacement(x, residual, weight):
        out = torch.ops.strata.add_rms_norm.default(x, residual, weight, eps)
        return out[0], out[1]

    return replacement


def silu_pattern(inter: int) -> Callable:
    def pattern(gate_up):  # graph.layers.GatedMLP, op for op
        return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]

    return pattern


def silu_replacement(gate_up):
    return torch.ops.strata.silu_mul.default(gate_up)


def joint_rotary_pattern(heads: int) -> Callable:
    def pattern(qk, cos, sin):  # Attention.forward without q/k norm: rotate q|k in one view, split
        r = apply_rotary(qk, (cos, sin))
        return r[..., :heads, :], r[..., heads:, :]

    return pattern


def joint_rotary_replacement(heads: int) -> Callable:
    def replacement(qk, cos, sin):
        out = torch.ops.strata.rotary_qk.default(qk[..., :heads, :], qk[..., heads:, :], cos, sin)
        return out[0], out[1]

    return replacement


def rotary_pattern(x, cos, sin):
    return apply_rotary(x, (cos, sin))


@torch.fx.wrap
def rotate_one(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """One tensor's rotation: a leaf marking it for _pair_rotaries (left unpaired, it is correct)."""
    return rotary_ref(x, cos, sin)


def rotary_replacement(x, cos, sin):
    return rotate_one(x, cos, sin)


def kv_pattern(kv_cache, k, v, slots):  # attention.write_kv, op for op
    kv_heads, head_dim = k.shape[-2:]
    a = kv_cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
    b = kv_cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, v)
    return a, b


def kv_replacement(kv_cache, k, v, slots):
    done = torch.ops.strata.kv_write.default(kv_cache, k, v, slots)
    return done, done
