"""Weight quantisation on CPU (numba): the streaming loader's int8 / int4 conversion.

The torch twins (quant_formats.quantize_int8 / quantize_int4) make ~6 full-size temporaries per
chunk (abs, max, divide, round, clamp, cast) and ran ~50-65 M weights/s on the 2-core dev VMs,
so an 8B model spent 2-3 minutes quantising. One pass per row here, rows across threads. The
arithmetic is the twins' operation for operation (fp32 divide by the scale, round half to even,
clamp; no fastmath, which would turn the divide into a reciprocal multiply), so the bytes are
identical (tests/kernels/test_cpu_quantize.py).
"""

from __future__ import annotations

import numpy as np
import torch

from strata.kernels.dispatch import fast_paths

try:
    from numba import njit, prange
except ImportError:  # pragma: no cover - exercised only where numba is absent
    njit = None


def usable(w: torch.Tensor, qweight: torch.Tensor) -> bool:
    """numba present, the kernel mode's fast paths on (kernels/dispatch.py), CPU tensors."""
    return (njit is not None and fast_paths() and w.device.type == "cpu" and qweight.device.type == "cpu"
            and qweight.is_contiguous() and w.is_floating_point())


if njit is not None:

    @njit(parallel=True, cache=True)
    def _int8(w, q, s):  # pragma: no cover - compiled
        n, k = w.shape
        for r in prange(n):
            amax = np.float32(0.0)
            for c in range(k):
                a = abs(w[r, c])
                if a > amax:
                    amax = a
            sc = amax / np.float32(127.0) if amax > 0 else np.float32(1.0)
            s[r] = sc
            for c in range(k):
                v = np.rint(w[r, c] / sc)
                q[r, c] = np.int8(min(max(v, np.float32(-127.0)), np.float32(127.0)))

    @njit(parallel=True, cache=True)
    def _int4(w, group, q, s):  # pragma: no cover - compiled
        n, k = w.shape
        half = group // 2
        for r in prange(n):
            for j in range(k // group):
                base = j * group
                hi = w[r, base]
                lo = hi
                for c in range(base, base + group):
                    x = w[r, c]
                    if x > hi:
                        hi = x
                    if x < lo:
                        lo = x
                ext = hi if hi >= -lo else lo  # the signed value of largest magnitude
                sc = ext / np.float32(-8.0) if ext != 0 else np.float32(1.0)
                s[r, j] = sc
                for c in range(half):
                    a = min(max(np.rint(w[r, base + c] / sc) + np.float32(8.0), np.float32(0.0)), np.float32(15.0))
                    b = min(max(np.rint(w[r, base + half + c] / sc) + np.float32(8.0), np.float32(0.0)),
                            np.float32(15.0))
                    q[r, j * half + c] = np.uint8(a) | (np.uint8(b) << np.uint8(4))


def quantize_rows(method: str, w: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, group_size: int) -> None:
    """Quantise float rows `w` [n, in] into qweight [n, in] int8 / [n, in / 2] uint8 and scale [n] /
    [n, in / group_size] (contiguous CPU tensors, written in place)."""
    x = w.detach().to(torch.float32).contiguous().numpy()
    if method == "int8":
        _int8(x, qweight.numpy(), scale.numpy())
    else:
        _int4(x, group_size, qweight.numpy(), scale.numpy())
