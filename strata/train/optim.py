"""AdamW with decay groups and a warmup + cosine schedule that is a pure function of the step.

Weight decay applies to the 2-D projection matrices only: norms, biases and the (possibly tied)
embedding are excluded, the common choice since GPT-2 / nanoGPT / torchtitan, so the decay
neither pulls norm gains toward zero nor shrinks rare tokens' rows.
"""

from __future__ import annotations

import inspect
import logging
import math

import torch
from torch import nn

from strata.train.config import TrainConfig

logger = logging.getLogger(__name__)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    seen: set[int] = set()
    for _, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """torch's AdamW, fused where this torch build has a fused kernel for the parameters' device
    (CPU since torch 2.4, CUDA), else foreach (the multi-tensor path)."""
    groups = param_groups(model, cfg.weight_decay)
    kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if "fused" in inspect.signature(torch.optim.AdamW).parameters:
        try:
            return torch.optim.AdamW(groups, fused=True, **kw)
        except (RuntimeError, ValueError) as e:
            logger.info("fused AdamW unavailable here (%s); using foreach", e)
    return torch.optim.AdamW(groups, foreach=True, **kw)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup from lr / warmup to lr over warmup_steps, then cosine to lr x min_lr_ratio at
    max_steps (step counts from 0)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
