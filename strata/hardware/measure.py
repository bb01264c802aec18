"""The measurements behind `strata hw`: what this machine's memory and Strata's kernels achieve.

DRAM/HBM bandwidth (torch, and an independent numpy figure), the cost of one tiny torch op,
host<->device copies, and the rates of the kernels Strata runs, timed at fixed shapes: batch-1
and batch-16 F.linear through Strata's dispatch, prefill-shaped GEMMs, causal SDPA in the
prefill layout, torch's int8 matmul and Strata's CPU int8/int4 GEMV kernels. probe.py decides
which of these a device gets and caches the resulting HardwareProfile.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F

from strata.config import DTYPES
from strata.errors import ConfigError
from strata.kernels import cpu_gemm, cpu_quant
from strata.kernels.linear import linear

logger = logging.getLogger(__name__)

CPU_LINEAR_SHAPE = (16384, 4096)  # fp32 256 MiB, bf16 128 MiB: well past L3 (even 2 CCDs)
CUDA_LINEAR_SHAPE = (16384, 8192)  # bf16 256 MiB: past a GPU's L2
CUDA_GEMM_SIZE = 8192
MATMUL_BATCH = 16
GEMM_ROWS, GEMM_SHAPE = 512, (2048, 2048)  # CPU prefill-shaped GEMM: 512 prompt rows x a layer weight
# causal SDPA as Strata's prefill calls it: q [kv_heads, group, n, d], K/V expanded over the group
CPU_SDPA_SHAPE, CUDA_SDPA_SHAPE = (2, 4, 512, 64), (8, 4, 4096, 128)
QUANT_LINEAR_SHAPE = (16384, 4096)  # int8 64 MiB (past L3); int4 uses twice the columns (also 64 MiB)
NUMPY_BANDWIDTH_BYTES = 256 * 2**20
HOST_COPY_BYTES = 256 * 2**20


def resolve_device(device: str) -> torch.device:
    """Parse and check a device string; "cuda" becomes "cuda:<current>"."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device={device!r}: not a device string; use 'cpu' or 'cuda:N'") from e
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ConfigError(f"device={device!r}: only 'cpu' and 'cuda[:N]' are supported")
    if not torch.cuda.is_available():
        raise ConfigError(f"device={device!r}: CUDA is not available here; use device='cpu'")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ConfigError(
            f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) present"
        )
    return torch.device("cuda", index)


# ---------------------------------------------------------------- measurements


def _best_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Fastest of `repeats` timed calls after one warm-up (page faults, kernel JIT, allocator)."""
    if device.type == "cuda":
        with torch.cuda.device(device):  # events must record on the stream the kernels run on
            return _best_cuda_seconds(fn, repeats)
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def _best_cuda_seconds(fn: Callable[[], object], repeats: int) -> float:
    """`_best_seconds` on the current CUDA device, timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return max(best, 1e-9)


def measure_mem_bandwidth(
    device: str = "cpu", nbytes: int = 512 * 2**20, repeats: int = 3
) -> float:
    """Memory bandwidth in GB/s (1e9): best of `repeats`.

    CPU: read bandwidth of torch.dot over an fp32 buffer (make `nbytes` much larger than L3): the
    BLAS read loop, as the numpy check uses; torch's own sum reduces ~12% slower on the dev box.
    CUDA: device-to-device copy, counting bytes read plus bytes written.
    """
    if nbytes < 4 or repeats < 1:
        raise ConfigError(f"nbytes={nbytes}, repeats={repeats}: need nbytes >= 4 and repeats >= 1")
    dev = resolve_device(device)
    with torch.inference_mode():
        src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
        moved = src.numel() * 4
        if dev.type == "cuda":
            dst = torch.empty_like(src)
            seconds = _best_seconds(lambda: dst.copy_(src), dev, repeats)
            moved *= 2
        else:
            seconds = _best_seconds(lambda: torch.dot(src, src), dev, repeats)
    return moved / seconds / 1e9


def measure_linear(weight: torch.Tensor, batch: int, repeats: int = 5) -> float:
    """Seconds for one projection with `batch` rows of input (best of `repeats`).

    Measured through Strata's own dispatch (kernels/linear.py), so the figures describe the
    kernels Strata will run (e.g. the numba GEMV for fp32 on CPU), not torch's alone.
    """
    if batch < 1 or repeats < 1:
        raise ConfigError(f"batch={batch}, repeats={repeats}: both must be >= 1")
    with torch.inference_mode():
        x = torch.randn(batch, weight.shape[1], dtype=weight.dtype, device=weight.device)
        return _best_seconds(lambda: linear(x, weight), weight.device, repeats)


def measure_gemm(device: str, dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    """GFLOP/s of an n x n x n matmul."""
    dev = resolve_device(device)
    with torch.inference_mode():
        a = torch.randn(n, n, device=dev).to(dtype)
        b = torch.randn(n, n, device=dev).to(dtype)
        seconds = _best_seconds(lambda: a @ b, dev, repeats)
    return 2 * n**3 / seconds / 1e9


def linear_rates(
    device: torch.device, dtypes: list[str], shape: tuple[int, int]
) -> tuple[dict[str, float], dict[str, float]]:
    """Batch-1 weight GB/s and batch-16 GFLOP/s of F.linear per dtype, on one weight shape."""
    linear_gbs: dict[str, float] = {}
    matmul_gflops: dict[str, float] = {}
    with torch.inference_mode():
        master = torch.randn(*shape, device=device)
        for name in dtypes:
            weight = master if DTYPES[name] == torch.float32 else master.to(DTYPES[name])
            gemv = measure_linear(weight, 1, repeats=5)
            linear_gbs[name] = weight.numel() * weight.element_size() / gemv / 1e9
            batched = measure_linear(weight, MATMUL_BATCH, repeats=3)
            matmul_gflops[name] = 2 * MATMUL_BATCH * weight.numel() / batched / 1e9
            del weight
    return linear_gbs, matmul_gflops


def measure_dispatch_us(device: str = "cpu", calls: int = 2000) -> float:
    """Median host time of one tiny op (torch.add on 1-element tensors), in microseconds.

    What every extra op in a step costs before any arithmetic: framework dispatch on CPU,
    dispatch plus the (host side of a) kernel launch on CUDA.
    """
    if calls < 1:
        raise ConfigError(f"calls={calls}: must be >= 1")
    dev = resolve_device(device)
    times: list[int] = []
    with torch.inference_mode():
        a, b = torch.ones(1, device=dev), torch.ones(1, device=dev)
        for _ in range(min(calls, 100)):
            torch.add(a, b)
        for _ in range(calls):
            t0 = time.perf_counter_ns()
            torch.add(a, b)
            times.append(time.perf_counter_ns() - t0)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    return statistics.median(times) / 1e3


def numpy_bandwidth_meter(
    nbytes: int = NUMPY_BANDWIDTH_BYTES, threads: int = 1
) -> Callable[[], tuple[float, float]]:
    """A function returning (read GB/s, copy GB/s) measured with numpy alone, once per call.

    An independent check on `measure_mem_bandwidth`'s torch figure: read = x.dot(x) over
    `threads` slices in parallel (BLAS, memory-bound; numpy's own sum is not: its pairwise
    summation caps near ~17 GB/s a thread on the dev box); copy = np.copyto over the slices,
    counting bytes read plus bytes written (write-allocate traffic is not counted).
    """
    if nbytes < 4 * threads or threads < 1:
        raise ConfigError(f"nbytes={nbytes}, threads={threads}: need threads >= 1, nbytes >= 4 x threads")
    n = nbytes // 4
    src = np.ones(n, np.float32)
    dst = np.zeros(n, np.float32)  # written once so its pages exist before timing
    step = -(-n // threads)
    starts = list(range(0, n, step))

    def run(pool: ThreadPoolExecutor) -> tuple[float, float]:
        t0 = time.perf_counter()
        list(pool.map(lambda i: src[i : i + step].dot(src[i : i + step]), starts))
        t1 = time.perf_counter()
        list(pool.map(lambda i: np.copyto(dst[i : i + step], src[i : i + step]), starts))
        t2 = time.perf_counter()
        return n * 4 / max(t1 - t0, 1e-9) / 1e9, 2 * n * 4 / max(t2 - t1, 1e-9) / 1e9

    def measure() -> tuple[float, float]:
        with ThreadPoolExecutor(threads) as pool:
            run(pool)  # first touch of the thread pool and the pages
            return run(pool)

    return measure


def measure_host_copy(device: str, nbytes: int = HOST_COPY_BYTES, repeats: int = 5) -> tuple[float, float]:
    """(host->device, device->host) GB/s of pinned-memory copies to/from a CUDA device."""
    dev = resolve_device(device)
    if dev.type != "cuda":
        raise ConfigError(f"device={device!r}: host<->device copies need a CUDA device")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h2d = _best_seconds(lambda: gpu.copy_(host, non_blocking=True), dev, repeats)
    d2h = _best_seconds(lambda: host.copy_(gpu, non_blocking=True), dev, repeats)
    return nbytes / h2d / 1e9, nbytes / d2h / 1e9


def gemm_rates(dtypes: list[str]) -> dict[str, float]:
    """CPU GFLOP/s of a prefill-shaped F.linear (GEMM_ROWS rows) per dtype, via Strata's dispatch
    on an unmarked weight (torch's own GEMM), plus "float32_onednn": the same product by oneDNN's
    fp32 matmul (kernels/cpu_gemm.py), which the engine takes instead where it is faster."""
    n, k = GEMM_SHAPE
    out: dict[str, float] = {}
    flops = 2 * GEMM_ROWS * n * k
    with torch.inference_mode():
        master = torch.randn(n, k)
        for name in dtypes:
            weight = master.to(DTYPES[name])
            out[name] = flops / measure_linear(weight, GEMM_ROWS, repeats=3) / 1e9
        if "float32" in dtypes and cpu_gemm.onednn_available():
            x = torch.randn(GEMM_ROWS, k)
            try:
                cpu_gemm.onednn_linear(x, master)
                out["float32_onednn"] = flops / _best_seconds(lambda: cpu_gemm.onednn_linear(x, master),
                                                              torch.device("cpu"), 3) / 1e9
            except RuntimeError as e:  # a build whose oneDNN refuses the op: aten only
                logger.info("oneDNN fp32 GEMM not measured: %s", e)
    return out


def measure_sdpa(device: str, dtype: torch.dtype, shape: tuple[int, int, int, int], repeats: int = 5) -> float:
    """GFLOP/s of causal scaled_dot_product_attention in Strata's prefill layout (GQA K/V expanded,
    not copied); FLOPs = 2 x heads x head_dim x n x (n + 1): QK^T and PV over the causal half."""
    dev = resolve_device(device)
    kvh, group, n, d = shape
    with torch.inference_mode():
        q = torch.randn(kvh, group, n, d, device=dev).to(dtype)
        k = torch.randn(n, kvh, d, device=dev).to(dtype).transpose(0, 1).unsqueeze(1).expand(-1, group, -1, -1)
        v = torch.randn(n, kvh, d, device=dev).to(dtype).transpose(0, 1).unsqueeze(1).expand(-1, group, -1, -1)
        sec = _best_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), dev, repeats)
    return 2 * kvh * group * d * n * (n + 1) / sec / 1e9


def sdpa_rates(dev: torch.device, dtypes: list[str], shape: tuple[int, int, int, int], repeats: int) -> dict:
    """`measure_sdpa` per dtype; a dtype this build's SDPA rejects is left out (logged)."""
    out = {}
    for name in dtypes:
        try:
            out[name] = measure_sdpa(str(dev), DTYPES[name], shape, repeats)
        except (RuntimeError, NotImplementedError) as e:
            logger.info("SDPA %s not measured on %s: %s", name, dev, e)
    return out


def int8_int8_gemm_gflops() -> float | None:
    """CPU GOP/s of torch._int_mm (int8 x int8 -> int32) at the prefill GEMM shape: the W8A8
    prefill of int8 weights (kernels/cpu_w8a8.py); None where this torch has none."""
    if not hasattr(torch, "_int_mm"):
        return None
    try:
        with torch.inference_mode():
            n, k = GEMM_SHAPE
            a = torch.randint(-127, 128, (GEMM_ROWS, k), dtype=torch.int8)
            w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
            return 2 * GEMM_ROWS * n * k / _best_seconds(lambda: torch._int_mm(a, w.t()), torch.device("cpu"), 3) / 1e9
    except (RuntimeError, NotImplementedError) as e:
        logger.info("int8 x int8 GEMM not measured: %s", e)
        return None


def int8_gemm_gflops(dev: torch.device) -> float | None:
    """GFLOP/s (int ops/s) of torch's own int8 matmul, where this build has one; else None."""
    try:
        with torch.inference_mode():
            if dev.type == "cuda":
                if not hasattr(torch, "_int_mm"):
                    return None
                n = CUDA_GEMM_SIZE
                a = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=dev)
                b = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=dev)
                return 2 * n**3 / _best_seconds(lambda: torch._int_mm(a, b), dev, 5) / 1e9
            fn = getattr(torch, "_weight_int8pack_mm", None)
            if fn is None:
                return None
            n, k = GEMM_SHAPE
            x = torch.randn(GEMM_ROWS, k).to(torch.bfloat16)
            w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
            scale = torch.rand(n).to(torch.bfloat16)
            return 2 * GEMM_ROWS * n * k / _best_seconds(lambda: fn(x, w, scale), dev, 3) / 1e9
    except (RuntimeError, NotImplementedError, TypeError) as e:
        logger.info("int8 GEMM not measured on %s: %s", dev, e)
        return None


def quant_gemv_case(method: str, rows: int, group: int = 64) -> tuple[Callable[[], object], int]:
    """One call of Strata's CPU int8/int4 GEMV kernel on random weights of QUANT_LINEAR_SHAPE (int4
    with twice the input columns) over `rows` input rows, and the weight bytes it reads (scales
    included): what quant_rates times, and plan-accuracy re-times."""
    n, k = QUANT_LINEAR_SHAPE
    if method == "int8":
        cols = k
        w = torch.randint(-127, 128, (n, cols), dtype=torch.int8)
        s = torch.rand(n)
    else:
        cols = 2 * k
        w = torch.randint(0, 256, (n, cols // 2), dtype=torch.uint8)
        s = torch.rand(n, cols // group)
    wn, sn = w.numpy(), s.numpy()
    x = torch.randn(rows, cols)
    return (lambda: cpu_quant.gemv(method, x, wn, sn, group)), wn.nbytes + sn.nbytes


def quant_rates() -> tuple[dict[str, float], dict[str, float]]:
    """Strata's CPU int8/int4 GEMV kernels: batch-1 weight GB/s (scales included) and batch-16
    GFLOP/s, on random weights of QUANT_LINEAR_SHAPE (int4 with twice the input columns)."""
    if not cpu_quant.available():
        return {}, {}
    n, k = QUANT_LINEAR_SHAPE
    gbs: dict[str, float] = {}
    gflops: dict[str, float] = {}
    cpu = torch.device("cpu")
    with torch.inference_mode():
        for method in ("int8", "int4"):
            cols = k if method == "int8" else 2 * k
            for rows in (1, MATMUL_BATCH):
                call, nbytes = quant_gemv_case(method, rows)
                sec = _best_seconds(call, cpu, 3)
                if rows == 1:
                    gbs[method] = nbytes / sec / 1e9
                else:
                    gflops[method] = 2 * rows * n * cols / sec / 1e9
    return gbs, gflops
