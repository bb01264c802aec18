"""Expert parallelism: an MoE layer's experts split across the tensor-parallel ranks, tokens sent to
the rank that holds their expert and back with two all-to-alls (vLLM's --enable-expert-parallel).

With tensor-parallel attention every rank holds every token of the step (the o_proj all-reduce
leaves the full hidden rows on each). Rank r of N:

  1. routes all T rows (the fp32 router is replicated and cheap: its counts are then the whole
     step's on every rank), and takes its own slice of the tokens, rows [T r / N, T (r+1) / N);
  2. dispatch: its slice's (token, slot) pairs, sorted by expert id (so by owner: experts are
     split in contiguous ranges), go to the rank owning each expert, the expert id riding along
     as a last column (exact in fp32);
  3. each rank runs each of its experts once over the rows it received (one GEMM per expert);
  4. combine: the results go back along the same counts (the dispatch's send counts are the
     combine's receive counts: no count exchange), are weighted, and summed per token in expert
     order, as the single-rank block sums them; Qwen2-MoE's shared expert runs on the slice;
  5. all-gather of the slices (padded to ceil(T / N) rows) gives every rank the full output again.

Per MoE layer: two all-to-alls of the routed rows and one all-gather of T rows, where TP's dense
MLP has one all-reduce. Each rank stores E / N experts: the memory EP saves. `comm` is duck-typed
(all_to_all, all_gather, rank, world_size): the graph layer does not import strata.comm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.errors import ConfigError
from strata.graph.moe import MoEBlock, grouped_by_expert, route


def expert_range(num_experts: int, rank: int, world_size: int) -> range:
    """The experts rank `rank` holds: a contiguous 1 / world_size of them."""
    if num_experts % world_size:
        raise ConfigError(f"enable_expert_parallel: {num_experts} experts do not split evenly over "
                          f"tensor_parallel_size = {world_size}; use a size dividing {num_experts}")
    per = num_experts // world_size
    return range(rank * per, (rank + 1) * per)


class ExpertParallelMoE(nn.Module):
    """The rank's part of an MoEBlock: the replicated router, its own experts, the shared expert."""

    def __init__(self, block: MoEBlock, rank: int, world_size: int, comm) -> None:
        super().__init__()
        self.owned = expert_range(block.num_experts, rank, world_size)
        self.num_experts, self.top_k = block.num_experts, block.top_k
        self.rank, self.world_size, self.comm = rank, world_size, comm
        self.gate = block.gate
        self.experts = nn.ModuleList(block.experts[e] for e in self.owned)  # the others are dropped
        self.shared_expert, self.shared_expert_gate = block.shared_expert, block.shared_expert_gate
        self.token_counts = block.token_counts
        self.router_logits_sink = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        weights, ids = route(self, rows)
        if not torch.is_grad_enabled() and self.token_counts.device == ids.device:
            self.token_counts += torch.bincount(ids.reshape(-1), minlength=self.num_experts)
        t, n = rows.shape[0], self.world_size
        lo, hi = t * self.rank // n, t * (self.rank + 1) // n
        mine = self._combine(rows[lo:hi], weights[lo:hi], ids[lo:hi])
        if self.shared_expert is not None and hi > lo:  # (a rank's slice may be empty: T < N)
            gate = torch.sigmoid(F.linear(rows[lo:hi], self.shared_expert_gate.weight.to(rows.dtype)))
            mine = mine + gate * self.shared_expert(rows[lo:hi])
        share = -(-t // n)
        padded = torch.zeros(share, rows.shape[1], dtype=rows.dtype, device=rows.device)
        padded[: hi - lo] = mine
        gathered = self.comm.all_gather(padded, dim=0)  # rank j's slice at rows [j * share, ...)
        out = torch.cat([gathered[j * share : j * share + (t * (j + 1) // n - t * j // n)] for j in range(n)])
        return out.reshape(shape)

    def _combine(self, rows: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's slice of tokens through their experts, wherever those live."""
        order, counts = grouped_by_expert(ids, self.num_experts)
        per = len(self.owned)
        send_counts = [sum(counts[r * per : (r + 1) * per]) for r in range(self.world_size)]
        flat_ids = ids.reshape(-1)[order]
        tokens = order // self.top_k
        send = torch.cat((rows.index_select(0, tokens), flat_ids[:, None].to(rows.dtype)), dim=1)
        got, got_counts = self.comm.all_to_all(send, send_counts)
        results = self._run_experts(got)
        back, _ = self.comm.all_to_all(results, got_counts, recv_counts=send_counts)
        out = torch.zeros_like(rows)
        w = weights.reshape(-1)[order].to(rows.dtype)
        out.index_add_(0, tokens, back * w[:, None])  # sorted by expert: each token's sum in expert order
        return out

    def _run_experts(self, got: torch.Tensor) -> torch.Tensor:
        """Each received row through the expert its last column names (one pass per expert)."""
        hidden = got.shape[1] - 1
        rows, expert = got[:, :hidden], got[:, hidden].long()
        out = torch.empty_like(rows)
        for i, e in enumerate(self.owned):
            where = (expert == e).nonzero().reshape(-1)
            if where.numel():
                out[where] = self.experts[i](rows.index_select(0, where))
        return out
