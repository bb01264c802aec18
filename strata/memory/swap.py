"""Swap space: a host-memory KV pool, the copies between it and the device cache, and the cost model.

When the device KV pool is exhausted, a preempted sequence can park its blocks in host memory
instead of discarding them; it resumes later without recomputing its prompt. The block copies run
in the runner (the scheduler only decides), swap-out synchronously before the freed device blocks
are reused, swap-in asynchronously one step ahead of the step that needs the blocks (a worker
thread on CPU, a side stream on CUDA). On a CPU-only machine both pools are host memory, but it is
the same code path.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from strata.memory.kv_cache import kv_cache_shape, untouched_zeros
from strata.model_config import ModelConfig

logger = logging.getLogger(__name__)


class HostBlockPool:
    """Host-side blocks in the same layout as the device cache, with their free list (the
    BlockManager is the one that allocates and frees them)."""

    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, pin: bool
    ) -> None:
        shape = kv_cache_shape(cfg, num_blocks, block_size, dtype)
        self.caches = [untouched_zeros(shape, dtype, pin=pin) for _ in range(cfg.num_layers)]
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"host pool: need {n} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extendleft(blocks)  # reused first: their pages are already resident


def _copy(src_caches, dst_caches, src: list[int], dst: list[int], non_blocking: bool) -> None:
    """Whole blocks, as bytes: a quantised cache's scales sit in its blocks' rows and travel with
    them (kernels/kv_quant.py), and index_copy_ has no float8 kernel on CPU."""
    src_idx = torch.tensor(src, device=src_caches[0].device)
    dst_idx = torch.tensor(dst, device=dst_caches[0].device)
    for s, d in zip(src_caches, dst_caches):
        s, d = s.view(torch.uint8), d.view(torch.uint8)
        d.index_copy_(1, dst_idx, s.index_select(1, src_idx).to(d.device, non_blocking=non_blocking))


class KVSwapper:
    """Executes swap copies between the device caches and a HostBlockPool."""

    def __init__(self, device_caches: list[torch.Tensor], host: HostBlockPool) -> None:
        self.device_caches = device_caches
        self.host = host
        self.cuda = device_caches[0].device.type == "cuda"
        self._stream = torch.cuda.Stream(device_caches[0].device) if self.cuda else None
        self._worker = None if self.cuda else ThreadPoolExecutor(1, thread_name_prefix="strata-swap-in")
        self._pending: list[Future | torch.cuda.Event] = []
        self.blocks_out = 0
        self.blocks_in = 0

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks now (they may be reused by this very step)."""
        if not pairs:
            return
        self.wait()  # host blocks being written may have been read by an in-flight swap-in
        _copy(self.device_caches, self.host.caches, [d for d, _ in pairs], [h for _, h in pairs], False)
        self.blocks_out += len(pairs)

    def start_swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Begin copying host blocks to device blocks; `wait()` before their first use."""
        if not pairs:
            return
        src, dst = [h for h, _ in pairs], [d for _, d in pairs]
        if self.cuda:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                _copy(self.host.caches, self.device_caches, src, dst, True)
                event = torch.cuda.Event()
                event.record(self._stream)
            self._pending.append(event)
        else:
            self._pending.append(self._worker.submit(_copy, self.host.caches, self.device_caches, src, dst, False))
        self.blocks_in += len(pairs)

    def wait(self) -> None:
        """Block until every started swap-in has landed."""
        for p in self._pending:
            if isinstance(p, Future):
                p.result()
            else:
                torch.cuda.current_stream().wait_event(p)
        self._pending.clear()

    def close(self) -> None:
        self.wait()
        if self._worker is not None:
            self._worker.shutdown(wait=True)


@dataclass(frozen=True)
class PreemptionCostModel:
    """Swap or recompute, per sequence: bytes over the link vs tokens through the model.

    swap costs 2 x (its KV bytes) / link bandwidth (out now, in later); recompute costs
    tokens / prefill rate, where the prefill rate comes from measured matmul throughput.
    """

    kv_bytes_per_token: int
    link_gbs: float  # host<->device copy bandwidth (on CPU: memcpy, ~half the read bandwidth)
    prefill_tokens_per_s: float

    def swap_seconds(self, tokens: int) -> float:
        return 2 * tokens * self.kv_bytes_per_token / (self.link_gbs * 1e9)

    def recompute_seconds(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def prefer_swap(self, tokens: int) -> bool:
        return self.swap_seconds(tokens) < self.recompute_seconds(tokens)
