"""The decode step's interface: what ModelRunner runs an all-decode step through, whichever
platform built it (platform/cpu.py: the fused CPU layer loop; platform/cuda.py: graph/capture.py's
torch.compile / CUDA-graph step).

The runner calls the step first for every step without prompt tokens; a step it does not run
(too many rows, a prefill, an unfit model) returns None and the model's forward runs instead.
The model stays a plain nn.Module: whatever a step keeps between calls (buffers, argument caches,
the logits its last call computed) lives on the step object.
"""

from __future__ import annotations

import torch

from strata.kernels.attention import AttentionMetadata


class DecodeStep:
    """Base: runs nothing. A platform's step overrides `__call__` and whichever of the others it offers."""

    # whether the step applies the LoRA adapters of the active graph/lora.LoRABatch; a step that
    # does not is skipped (the model's own forward runs) whenever a row of the step has an adapter
    supports_lora = False

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The final hidden states [rows, hidden] of an all-decode step, or None: not a step it runs."""
        return None

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The LM head's logits of `hidden` when the step computed them with it (before any final
        soft-capping: the model applies that), else None (the runner runs the head)."""
        return None

    def next(self, token_ids: list[int]) -> torch.Tensor | None:
        """Multi-step decode: the hidden states of the step right after the last call, every row one
        position on and computing `token_ids`; None when the step cannot continue that way (the
        runner then builds the step's tensors and calls the step again)."""
        return None

    def weights_may_have_changed(self) -> None:
        """The caller held control (a request was added): check cached weight views before the next step."""

    def warm_up(self) -> None:
        """Compile or capture before anything is measured or served."""

    def stats(self) -> dict | None:
        """Counters worth reporting (graph/capture.py: compilations, graphs, batch buckets used)."""
        return None
