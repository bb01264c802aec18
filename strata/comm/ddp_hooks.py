"""Gradient compression for DistributedDataParallel: each gradient bucket is cast to 16 bits for
the all-reduce and back to fp32 after (half the bytes on the wire, the same trade as the
inference all-reduce's --comm-dtype).

The hook is the algorithm of torch's default_hooks.fp16_compress_hook / bf16_compress_hook,
written once for any dtype because torch's bf16 hook refuses gloo (it requires NCCL), and
training on CPU runs on gloo.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _compress_hook(dtype: torch.dtype) -> Callable:
    def hook(process_group, bucket):  # unannotated: DDP checks annotations, and these would be strings
        group = process_group if process_group is not None else dist.group.WORLD
        compressed = bucket.buffer().to(dtype).div_(group.size())  # divide first: fp16 cannot overflow
        fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(f: torch.futures.Future) -> torch.Tensor:
            out = bucket.buffer()
            out.copy_(f.value()[0])
            return out

        return fut.then(decompress)

    return hook


def compression_hook(comm_dtype: str) -> Callable | None:
    """The DDP comm hook for `comm_dtype` ("none": DDP's default fp32 all-reduce)."""
    return None if comm_dtype == "none" else _compress_hook(DTYPES[comm_dtype])
