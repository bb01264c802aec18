"""The mixture-of-experts training terms and their report: the Switch-Transformer load-balancing
loss (as transformers' `load_balancing_loss_func` computes it), ST-MoE's router z-loss, and the
per-expert token histogram (a text one for the run's summary, an SVG beside metrics.jsonl).

The router logits come from MoEBlock.router_logits_sink (graph/moe.py): `RouterLosses.collect()`
hangs a fresh list on every MoE block for one forward and takes them all off when it ends, so
nothing is appended when activation checkpointing recomputes a layer in backward, and no logits
outlive the step. Every row counts: the trainer's packed windows hold no padding, which is
transformers' `attention_mask=None` case (the mask argument is here for parity, for callers that
have padding).

Like transformers, the load-balancing loss pools every MoE layer's rows before it multiplies the
two means (one loss over the layers' concatenated rows, not a mean of per-layer losses), and is not
divided by top_k: an even split scores top_k, everything on k experts scores num_experts.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from strata.graph.moe import MoEBlock
from strata.model_config import MoEConfig

HISTOGRAM_WIDTH = 40  # characters of the longest bar


def load_balancing_loss(gate_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """num_experts x sum_e f_e x P_e over every layer's rows [T, E]: f_e the top-k picks of expert
    e per row, P_e its mean router probability (rows where attention_mask [B, S] is 0 left out)."""
    logits = torch.cat([g.float() for g in gate_logits])
    probs = torch.softmax(logits, dim=-1)
    picked = torch.topk(probs, top_k, dim=-1).indices
    if attention_mask is None:
        weight = probs.new_ones(probs.shape[0])
    else:  # the same [B x S] mask for every layer's rows
        weight = attention_mask.reshape(-1).to(probs).repeat(len(gate_logits))
    total = weight.sum()
    # index_add, not one_hot: no [rows, k, E] tensor
    fraction = probs.new_zeros(num_experts).index_add_(0, picked.reshape(-1), weight.repeat_interleave(top_k))
    prob_sum = (probs * weight[:, None]).sum(0)
    return num_experts * ((fraction / total) * (prob_sum / total)).sum()


def router_z_loss(gate_logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """ST-MoE's z-loss: the mean over every layer's rows of logsumexp(logits)^2 (keeps the router's
    logits small, so its softmax stays out of fp32's rounding trouble)."""
    logits = torch.cat([g.float() for g in gate_logits])
    return torch.logsumexp(logits, dim=-1).square().mean()


@torch.no_grad()
def expert_counts(gate_logits: Sequence[torch.Tensor], top_k: int) -> torch.Tensor:
    """[layers, experts] int64: the tokens each layer's router sent to each expert (its top-k of
    the softmax, as MoEBlock routes)."""
    rows = []
    for g in gate_logits:
        picked = torch.topk(torch.softmax(g.float(), dim=-1), top_k, dim=-1).indices
        rows.append(torch.bincount(picked.reshape(-1), minlength=g.shape[-1]))
    return torch.stack(rows).cpu()


def imbalance(counts: torch.Tensor) -> float:
    """Max over mean expert load, averaged over the MoE layers: 1.0 is an even split, E / top_k
    every token on the same k experts. Per layer, because each layer's busiest expert is what a
    step waits for (the pooled histogram can look even while every layer is lopsided)."""
    counts = counts.double()
    mean = counts.mean(dim=-1)
    ratios = counts.max(dim=-1).values[mean > 0] / mean[mean > 0]
    return float(ratios.mean()) if ratios.numel() else float("nan")


@dataclass
class RouterStats:
    """One forward's MoE terms (detached, for the log)."""

    lm_loss: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    counts: torch.Tensor  # [MoE layers, experts]


class RouterLosses:
    """The MoE blocks of a model and the two coefficients. A plain object, not a Module, so the
    blocks are not registered (and their parameters not counted) a second time."""

    def __init__(self, model: nn.Module, moe: MoEConfig, aux_coef: float, z_coef: float) -> None:
        self.blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]  # layer order
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.aux_coef, self.z_coef = aux_coef, z_coef

    @contextlib.contextmanager
    def collect(self) -> Iterator[list[torch.Tensor]]:
        """Yields a list that holds, once the block ends, each MoE layer's router logits of the
        forward that ran inside it, in layer order."""
        gathered: list[torch.Tensor] = []
        for b in self.blocks:
            b.router_logits_sink = []
        try:
            yield gathered
        finally:
            for b in self.blocks:
                gathered.extend(b.router_logits_sink)
                b.router_logits_sink = None

    def add_to(self, lm_loss: torch.Tensor, gate_logits: list[torch.Tensor]) -> tuple[torch.Tensor, RouterStats]:
        """lm_loss + aux_coef x load balancing + z_coef x z-loss (a zero coefficient adds nothing,
        so the gradients are the plain model's), and the terms for the log."""
        aux = load_balancing_loss(gate_logits, self.num_experts, self.top_k)
        z = router_z_loss(gate_logits)
        total = lm_loss
        if self.aux_coef:
            total = total + self.aux_coef * aux
        if self.z_coef:
            total = total + self.z_coef * z
        stats = RouterStats(lm_loss.detach(), aux.detach(), z.detach(), expert_counts(gate_logits, self.top_k))
        return total, stats


def router_losses(model: nn.Module, moe: MoEConfig | None, aux_coef: float | None,
                  z_coef: float | None) -> RouterLosses | None:
    """The model's RouterLosses (a flag's coefficient over the config's), None for a dense model."""
    if moe is None:
        return None
    aux = moe.router_aux_loss_coef if aux_coef is None else aux_coef
    z = moe.router_z_loss_coef if z_coef is None else z_coef
    return RouterLosses(model, moe, aux, z)


# ---------------------------------------------------------------- the histogram


def text_histogram(start: Sequence[int], end: Sequence[int]) -> str:
    """Per-expert token shares (pooled over the MoE layers) at the run's first and last step, as
    bars side by side."""
    def shares(counts: Sequence[int]) -> list[float]:
        total = sum(counts) or 1
        return [c / total for c in counts]

    a, b = shares(start), shares(end)
    top = max(a + b) or 1.0
    lines = [f"{'expert':>6}  {'first step':<{HISTOGRAM_WIDTH + 7}}  last step"]
    for e, (x, y) in enumerate(zip(a, b)):
        bar_x = "#" * round(x / top * HISTOGRAM_WIDTH)
        bar_y = "#" * round(y / top * HISTOGRAM_WIDTH)
        lines.append(f"{e:>6}  {bar_x:<{HISTOGRAM_WIDTH}} {x:6.1%}  {bar_y:<{HISTOGRAM_WIDTH}} {y:6.1%}")
    return "\n".join(lines)


def plot_histogram(start: torch.Tensor, end: torch.Tensor, path: Path) -> Path:
    """An SVG of each MoE layer's per-expert token share at the first and last step (matplotlib
    without pyplot: no GUI backend, no global state)."""
    import matplotlib
    from matplotlib.backends.backend_svg import FigureCanvasSVG
    from matplotlib.figure import Figure

    layers, experts = start.shape
    cols = min(layers, 4)
    rows = math.ceil(layers / cols)
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "strata", "font.size": 8}):
        fig = Figure(figsize=(2.2 * cols + 1, 1.9 * rows + 0.6), layout="constrained")
        axes = fig.subplots(rows, cols, squeeze=False, sharey=True)
        x = torch.arange(experts).float()
        for i, ax in enumerate(axes.flat):
            if i >= layers:
                ax.set_visible(False)
                continue
            for counts, shift, label, color in ((start, -0.2, "first step", "#bab0ac"),
                                                (end, 0.2, "last step", "#4e79a7")):
                row = counts[i].double()
                ax.bar((x + shift).tolist(), (row / max(1.0, float(row.sum()))).tolist(), width=0.4,
                       label=label, color=color)
            ax.axhline(1 / experts, color="#e15759", linewidth=0.8, linestyle="--", label="even split")
            ax.set_title(f"MoE block {i}")
            ax.set_xlabel("expert")
        axes[0][0].set_ylabel("share of routed tokens")
        fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside lower center", ncols=3)
        path.parent.mkdir(parents=True, exist_ok=True)
        FigureCanvasSVG(fig).print_svg(str(path), metadata={"Date": None, "Creator": None})
    return path
