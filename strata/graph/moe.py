"""The sparse mixture-of-experts MLP of Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

A router (fp32, whatever the weights' storage) scores every expert per token; softmax, top-k and,
with norm_topk_prob, renormalisation over the k picked (transformers' order of operations, so ties
break as torch.topk breaks them there). Each expert is a GatedMLP, so its projections take every
weight storage the dense MLP takes (fp32, bf16, int8, int4, a GGUF's layouts) and their kernels.

Dispatch is grouped by expert, for prefill and decode alike: the (token, slot) pairs are sorted
by expert id, and each expert that received tokens runs once over its rows (one GEMM, or a GEMV
for a decode row), weighted, and added back in expert order. No expert that no token picked is
read; no dense compute over all experts. Qwen2-MoE adds a shared expert on every token, scaled by
sigmoid(shared_expert_gate(x)).

`token_counts` counts the tokens each expert received (prefill and decode; /metrics and the
analyzer read it): a statistic, never read by the forward. `router_logits_sink`: None, or a list
the forward appends each call's router logits [T, E] (fp32, with their graph) to, for the training
losses (strata/train: Switch-style load balancing, router z-loss).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.graph.layers import GatedMLP
from strata.model_config import MoEConfig


class Router(nn.Module):
    """The expert scores: logits = x @ W.T in fp32 (a plain weight, not a projection: never
    narrowed nor quantised), then softmax, top-k and the optional renormalisation."""

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):  # training's bf16 autocast would narrow it
            with torch.autocast(x.device.type, enabled=False):
                return F.linear(x.float(), self.weight.float())
        return F.linear(x.float(), self.weight.float())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits [T, E], weights [T, k] fp32, expert ids [T, k]) for rows x [T, hidden]."""
        logits = self.logits(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights, ids


def route(block, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) of rows [T, hidden] by the block's router, its logits handed to the block's
    router_logits_sink when training set one (MoEBlock and the expert-parallel block alike)."""
    logits, weights, ids = block.gate(rows)
    if block.router_logits_sink is not None:
        block.router_logits_sink.append(logits)
    return weights, ids


def grouped_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """(the flattened (token, slot) positions sorted by expert id, stable; each expert's count)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


class MoEBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's gated shared expert); forward(x) over rows [..., hidden]."""

    def __init__(self, hidden: int, moe: MoEConfig, act: str = "silu") -> None:
        super().__init__()
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.gate = Router(hidden, moe)
        self.experts = nn.ModuleList(GatedMLP(hidden, moe.intermediate_size, False, act)
                                     for _ in range(moe.num_experts))
        self.shared_expert = (GatedMLP(hidden, moe.shared_intermediate_size, False, act)
                              if moe.shared_intermediate_size else None)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if self.shared_expert is not None else None
        self.register_buffer("token_counts", torch.zeros(moe.num_experts, dtype=torch.int64), persistent=False)
        self.router_logits_sink: list[torch.Tensor] | None = None

    def reset_token_counts(self, device: torch.device | str | None = None) -> None:
        """Zero the counters (on `device`: a model materialised from `meta` gets them here)."""
        self.token_counts = torch.zeros(self.num_experts, dtype=torch.int64, device=device or "cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        weights, ids = route(self, rows)
        out = self.routed(rows, weights, ids)
        if self.shared_expert is not None:
            gate = torch.sigmoid(F.linear(rows, self.shared_expert_gate.weight.to(rows.dtype)))
            out = out + gate * self.shared_expert(rows)
        return out.reshape(shape)

    def routed(self, rows: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum over each row's k experts of weight * expert(row): one pass per expert picked."""
        order, counts = grouped_by_expert(ids, self.num_experts)
        if not torch.is_grad_enabled() and self.token_counts.device == ids.device:
            self.token_counts += torch.tensor(counts, dtype=torch.int64, device=ids.device)
        out = torch.zeros_like(rows)
        flat_w = weights.reshape(-1)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pos = order[start : start + n]
            start += n
            tokens = pos // self.top_k
            y = self.experts[e](rows.index_select(0, tokens))
            y = y * flat_w.index_select(0, pos).to(y.dtype)[:, None]
            out.index_add_(0, tokens, y.to(out.dtype))  # training's autocast: bf16 experts, fp32 rows
        return out
