"""bf16 weight storage for an fp32 model (`quantization="bf16"`), applied to a built model from outside.

Batch-1 decode on a CPU streams every weight once per token, so storing the weights in 2 bytes
instead of 4 doubles its roofline; computing in bf16 throughout would not (torch's bf16 ops on
CPU are slow at decode's few rows, and the fp32 kernels for norms, rotary and paged attention
would not apply). So only the 2-D weights narrow: the dense projections and the embedding become
bf16, and everything else (activations, norms, biases, the KV cache) stays fp32. A bf16 weight
widens to fp32 exactly, so for a bf16 checkpoint this is the fp32 model's arithmetic with half its
weight bytes: the decode GEMVs (kernels/cpu_bf16.py) widen in registers, and prefill's many rows
take the GEMM path kernels/linear.py measured fastest (oneDNN bf16, or widened tiles and fp32).

The model files do not know: graph.layers.Linear dispatches on its weight's dtype, and the
embedding becomes a WidenedEmbedding (an nn.Embedding whose lookups come back in fp32). Tied
embeddings stay tied (one bf16 tensor).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from strata.memory.arena import rehome_in_arena

logger = logging.getLogger(__name__)

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


class WidenedEmbedding(nn.Embedding):
    """An embedding stored in bf16 whose looked-up rows are returned in `out_dtype` (exactly)."""

    out_dtype: torch.dtype = torch.float32

    @classmethod
    def over(cls, weight: nn.Parameter, out_dtype: torch.dtype) -> WidenedEmbedding:
        e = cls(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True)
        e.weight = weight  # the same Parameter (a tied lm_head keeps sharing it)
        e.out_dtype = out_dtype
        return e

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).to(self.out_dtype)


def narrow_model(model: nn.Module) -> nn.Module:
    """Store the dense projections and the embedding of an fp32 `model` in bf16, in place."""
    dtype = next(model.parameters()).dtype
    if dtype != torch.float32:
        raise ValueError(f"bf16 weight storage narrows an fp32 model; this one is {dtype} "
                         "(use --dtype float32 with --quantization bf16)")
    embed = getattr(model, "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    tied = isinstance(embed, nn.Embedding) and isinstance(head, nn.Linear) and head.weight is embed.weight
    narrowed = 0
    with torch.no_grad():
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if name in PROJECTIONS and isinstance(child, nn.Linear):
                    child.weight = nn.Parameter(child.weight.detach().to(torch.bfloat16), requires_grad=False)
                    narrowed += 1
        if isinstance(embed, nn.Embedding):
            weight = head.weight if tied else nn.Parameter(embed.weight.detach().to(torch.bfloat16),
                                                            requires_grad=False)
            model.embed_tokens = WidenedEmbedding.over(weight, dtype)
    rehome_in_arena(model)
    logger.info("bf16 weights: %d projections%s stored in bf16; activations, norms and KV cache fp32",
                narrowed, " and the (tied) embedding" if tied else " and the embedding")
    return model
