"""Triton import guard, the CUDA-or-twin dispatch rule, and the interpreter check.

Triton is an optional extra (`pip install strata[triton]`): without it every module here still
imports, `available()` is False and each op runs its torch twin.

Each `*_triton` launcher runs its kernel on CUDA tensors; on CPU tensors it runs only under
Triton's interpreter (TRITON_INTERPRET=1 in the environment before triton is imported: triton's
own standard library, tl.sum, tl.zeros, ..., is decorated at import time, so the switch cannot be
made later in a process). The tests run the interpreted kernels in a child process for that reason.

Interpreter limits found with triton 3.9: arithmetic on bfloat16 values (and a bf16 tl.dot) gives
garbage, while loads, stores and bf16 -> fp32 conversions are right, so the kernels convert every
loaded value to fp32 before any arithmetic and round when storing (or where torch rounds); and its fp32 -> bf16
conversion truncates where GPUs round to nearest even, so interpreted bf16 results may differ from
torch by one bf16 ulp (the GPU tests check those bit-exactly).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the optional extra is absent (or a stray namespace package named "triton")
    triton = None
    tl = None


def available() -> bool:
    """Whether Triton is importable."""
    return triton is not None


def use_triton(*tensors: torch.Tensor) -> bool:
    """The dispatch rule: the Triton kernel when Triton is importable and all tensors are on CUDA."""
    return triton is not None and all(t.is_cuda for t in tensors)


def interpreting(kernel) -> bool:
    """Whether `kernel` (a triton.jit result) runs under the interpreter (TRITON_INTERPRET=1)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_launchable(kernel, *tensors: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("triton is not installed (pip install 'strata[triton]')")
    if not interpreting(kernel) and not all(t.is_cuda for t in tensors):
        raise ValueError(
            "Triton kernels need CUDA tensors; CPU tensors run only under TRITON_INTERPRET=1 "
            "(set before triton is imported). Use the dispatching function to get the torch twin."
        )


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
