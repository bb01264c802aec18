"""Activation checkpointing applied from outside the model, with torch's checkpoint_wrapper
(torch.utils.checkpoint, non-reentrant): the wrapped module keeps only its inputs and recomputes
its activations during backward, so gradients equal the unwrapped model's.

  none       keep every activation
  full       every decoder layer
  selective  every k-th decoder layer (--ac-every k), the middle ground
  attention  the attention block of every layer (its projections' inputs and the attention
             output are recomputed; the MLP keeps its activations)

The wrapper's state_dict hooks strip its prefix, so checkpoints and exports keep the model's names.
The recomputation runs under the LoRA batch the forward ran under (graph/lora.py's ContextVar,
which backward, run by autograd's engine and on CUDA in its own thread, would not see otherwise).
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

from strata.graph import lora


def _same_adapters():
    """(forward, recompute) contexts: the recomputation sees the forward's LoRA batch."""
    return contextlib.nullcontext(), lora.lora_batch(lora.ACTIVE.get())


def _wrap(module: nn.Module) -> nn.Module:
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=_same_adapters)


def wrapped_layers(num_layers: int, mode: str, every: int) -> list[int]:
    """Indices of the decoder layers `mode` checkpoints (attention mode: the layers whose attention)."""
    if mode == "none":
        return []
    if mode == "selective":
        return [i for i in range(num_layers) if i % every == every - 1]
    return list(range(num_layers))


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 2) -> int:
    """Wrap the model's decoder layers (or their attention) in place; the number wrapped."""
    layers = model.layers
    chosen = wrapped_layers(len(layers), mode, every)
    for i in chosen:
        if mode == "attention":
            layers[i].self_attn = _wrap(layers[i].self_attn)
        else:
            layers[i] = _wrap(layers[i])
    return len(chosen)
