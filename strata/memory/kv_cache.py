"""The paged KV cache tensors: one [2, num_blocks, block_size, kv_heads, head_dim] per layer
(head_dim + 4 for an int8 / fp8 cache: each row's fp32 scale, kernels/kv_quant.py).

On CPU the tensors live in anonymous memory maps: the kernel hands out zero pages only when they
are first written, so a reservation costs resident memory only as far as blocks are used
(torch.zeros writes every byte at start: a 5.6 GiB default cache was 5.6 GiB of RSS). Not
calloc: glibc may serve a large calloc from heap it must clear first (seen after a process had
loaded and freed bigger models), and a map is returned to the kernel the moment it is freed.
"""

from __future__ import annotations

import mmap

import numpy as np
import torch

from strata.kernels import kv_quant
from strata.model_config import ModelConfig

# Private, not mmap's default MAP_SHARED: shared anonymous memory is shmem, whose first-touch faults
# cost ~1.3x a private page's (measured on the Zen 4 dev VM: 216-236 vs 161 ms to first write 234 MiB
# in 12 KiB blocks), and a KV block's pages are first touched in the middle of a step. No
# MADV_HUGEPAGE: where THP defrag is "madvise", each 2 MiB fault compacts memory first (1.3 s for
# the same 234 MiB there), a stall inside a step; shmem never got huge pages anyway.
# (0 where the platform has no such flags, e.g. Windows: its default mapping is used there.)
_PRIVATE_ANONYMOUS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int,
                   dtype: torch.dtype | None = None) -> tuple[int, ...]:
    """One layer's paged KV tensor: [K|V, block, slot in block, kv head, head dim]; a quantised
    `dtype` (int8 / fp8) widens the last dimension by each row's scale (kernels/kv_quant.py), so the
    scales live in the blocks they belong to."""
    width = cfg.head_dim if dtype is None else kv_quant.row_width(dtype, cfg.head_dim)
    return (2, num_blocks, block_size, cfg.num_kv_heads, width)


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str
) -> list[torch.Tensor]:
    shape = kv_cache_shape(cfg, num_blocks, block_size, dtype)
    return [untouched_zeros(shape, dtype, device) for _ in range(cfg.num_layers)]


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu",
                    pin: bool = False) -> torch.Tensor:
    """A zero tensor whose CPU pages become resident only when written (an anonymous map, which
    the tensor keeps alive). Pinned or device memory is allocated (and zeroed) by torch as usual."""
    if pin or torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=_PRIVATE_ANONYMOUS) if _PRIVATE_ANONYMOUS else mmap.mmap(-1, nbytes)
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)


def copy_blocks(kv_caches: list[torch.Tensor], copies: list[tuple[int, int]]) -> None:
    """Copy whole blocks src -> dst in every layer (used when forking a partial block), as bytes: a
    quantised cache's scales are in its blocks' rows, and every dtype has byte copies."""
    if not copies:
        return
    src = torch.tensor([s for s, _ in copies], device=kv_caches[0].device)
    dst = torch.tensor([d for _, d in copies], device=kv_caches[0].device)
    for cache in kv_caches:
        cache = cache.view(torch.uint8)
        cache[:, dst] = cache[:, src]
