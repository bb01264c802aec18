"""The interface every attention backend implements (one stateless instance per backend, in
registry.py); AttentionMetadata.backend holds the step's backend.

    name               the registry key ("torch", "sdpa", "cpu", "triton"), also what the
                       strata::paged_decode op of graph/fused_ops.py takes (op schemas need primitives)
    uses_decode_mask   whether decode reads AttentionMetadata.decode_mask (the padding mask over the
                       gathered blocks) rather than only the context lengths: the runner and the
                       decode capture build the mask only when it is read
    unavailable(device, dtype)  why the backend cannot run there, or None
    prefill(...)       one prefill chunk (the default: SDPA over the chunk / its gathered context)
    decode(...)        the decode rows over the paged cache
    fused_decode_usable(...) / fused_decode(...)  optional: rotary + KV write + decode in one go
                       from the fused qkv projection (the cpu backend's numba kernels)
"""

from __future__ import annotations

from typing import ClassVar

import torch

from strata.kernels.attention.common import PrefillSpan, gathered_decode, prefill_span, sdpa_attend


class AttentionBackend:
    name: ClassVar[str] = ""
    uses_decode_mask: ClassVar[bool] = False

    def unavailable(self, device: str, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run on `device` with `dtype` (completing "needs ..."), or None."""
        return None

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
        scale: float,
    ) -> torch.Tensor:
        """The attention math on gathered K/V (common.AttendFn): SDPA unless a backend says otherwise."""
        return sdpa_attend(q, k, v, mask, causal, scale)

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, span: PrefillSpan,
        scale: float, window: int | None = None,
    ) -> torch.Tensor:
        """One prefill chunk of the step's flattened q/k/v [T, heads, d] -> [n, heads * d]; `window`:
        the layer's sliding attention window (None: full causal attention)."""
        return prefill_span(q, k, v, kv_cache, span, scale, self.attend, window)

    def decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
        context_lens: torch.Tensor | None, mask: torch.Tensor | None, scale: float, window: int | None = None,
    ) -> torch.Tensor:
        """Decode queries q [B, heads, d] over the paged cache -> [B, heads * d]. `mask` is the
        padding mask when `uses_decode_mask`, else None; `context_lens` counts the new token;
        `window`: attend only to the last `window` tokens (None: all of them)."""
        raise NotImplementedError

    def windowed_decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
        scale: float, window: int,
    ) -> torch.Tensor:
        """Sliding-window decode for a backend whose kernel has no window (triton): the gathered
        path with the window mask, in this backend's attention math."""
        return gathered_decode(q, kv_cache, block_tables, None, scale, self.attend, context_lens, window)

    def fused_decode_usable(self, qkv: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether an all-decode step may run `fused_decode` on these tensors."""
        return False

    def fused_decode(
        self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
        slots: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
        heads: int, kv_heads: int, scale: float, window: int | None = None,
    ) -> torch.Tensor:
        """Rotary of q and k from the fused qkv rows, the KV write at `slots`, then decode."""
        raise NotImplementedError(f"attention backend {self.name!r} has no fused decode")

    def __repr__(self) -> str:
        return f"<attention backend {self.name!r}>"
