"""What this machine can do, measured once and cached, and the compute dtype that follows from it.

`probe()` measures DRAM bandwidth and the F.linear rates that decide decode (batch-1 weight
streaming) and batched/prefill speed, per dtype, and caches them as JSON so later calls are free.
`auto_dtype()` turns those figures into Strata's `dtype="auto"`. Schema 3 adds what `strata hw`
and `strata plan` read: prefill-shaped GEMM rates, the quantised kernels' rates, the cost of one
tiny torch op, an independent numpy bandwidth figure, and host<->device copy rates on GPUs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
import torch.nn.functional as F

from strata.config import DTYPES, cache_root
from strata.cpuinfo import cpu_model_and_flags
from strata.errors import ConfigError
from strata.hardware.placement import default_threads

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 3  # 2: linear rates through Strata's dispatch; 3: + gemm/quant/dispatch/copy figures
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")
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
SWITCH_MARGIN = 1.1  # a narrow dtype must beat fp32 by this much on every measure to be chosen


@dataclass(frozen=True)
class HardwareProfile:
    """Measured capabilities of one device, as seen by this process."""

    device: str  # "cpu" or "cuda:0"
    name: str  # CPU model name or GPU name
    cores: int  # physical CPU cores usable by this process
    threads: int  # torch.get_num_threads() when measured
    isa: list[str]  # subset of ISA_FLAGS present on the host CPU
    memory_bytes: int  # total RAM, or GPU memory
    mem_bandwidth_gbs: float  # DRAM read (CPU) or device-to-device copy (GPU) bandwidth, GB/s
    linear_gbs: dict[str, float]  # batch-1 F.linear weight bytes streamed per second, GB/s
    matmul_gflops: dict[str, float]  # batch-16 F.linear (CPU) or square GEMM (GPU), GFLOP/s
    torch_version: str
    # CPU: GEMM_ROWS x GEMM_SHAPE F.linear through Strata's dispatch (prefill); GPU: square GEMM.
    # "int8": torch's own int8 kernel where it has one (CPU: _weight_int8pack_mm, bf16
    # activations; GPU: _int_mm), informational: Strata's CPU int8 path is quant_* below.
    gemm_gflops: dict[str, float] = field(default_factory=dict)
    sdpa_gflops: dict[str, float] = field(default_factory=dict)  # causal prefill attention (SDPA_SHAPE)
    quant_linear_gbs: dict[str, float] = field(default_factory=dict)  # CPU int8/int4 batch-1, GB/s
    quant_matmul_gflops: dict[str, float] = field(default_factory=dict)  # ... batch-16, GFLOP/s
    dispatch_us: float = 0.0  # median host time of torch.add on 1-element tensors, microseconds
    numpy_read_gbs: float = 0.0  # independent check of mem_bandwidth_gbs: numpy dot, same threads
    numpy_copy_gbs: float = 0.0  # numpy copyto, (read + write bytes) / time
    h2d_gbs: float = 0.0  # GPU: pinned host -> device copy, GB/s (0 on CPU)
    d2h_gbs: float = 0.0  # GPU: device -> pinned host copy, GB/s

    def to_json(self) -> dict[str, Any]:
        """Plain-data form (JSON-serialisable)."""
        return {"schema": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HardwareProfile:
        """Inverse of `to_json`; raises ValueError on a wrong schema or missing fields."""
        if d.get("schema", SCHEMA_VERSION) != SCHEMA_VERSION:
            raise ValueError(f"hardware profile schema {d.get('schema')!r} != {SCHEMA_VERSION}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in d]
        if missing:
            raise ValueError(f"hardware profile lacks fields {missing}")
        return cls(
            device=str(d["device"]),
            name=str(d["name"]),
            cores=int(d["cores"]),
            threads=int(d["threads"]),
            isa=[str(x) for x in d["isa"]],
            memory_bytes=int(d["memory_bytes"]),
            mem_bandwidth_gbs=float(d["mem_bandwidth_gbs"]),
            linear_gbs=_rates(d["linear_gbs"]),
            matmul_gflops=_rates(d["matmul_gflops"]),
            torch_version=str(d["torch_version"]),
            gemm_gflops=_rates(d["gemm_gflops"]),
            sdpa_gflops=_rates(d["sdpa_gflops"]),
            quant_linear_gbs=_rates(d["quant_linear_gbs"]),
            quant_matmul_gflops=_rates(d["quant_matmul_gflops"]),
            dispatch_us=float(d["dispatch_us"]),
            numpy_read_gbs=float(d["numpy_read_gbs"]),
            numpy_copy_gbs=float(d["numpy_copy_gbs"]),
            h2d_gbs=float(d["h2d_gbs"]),
            d2h_gbs=float(d["d2h_gbs"]),
        )


def _rates(d: dict[str, Any]) -> dict[str, float]:
    return {str(k): float(v) for k, v in d.items()}


# ---------------------------------------------------------------- identity (cheap)


def _cpu_info() -> tuple[str, list[str]]:
    """(model name, ISA flags of interest) from /proc/cpuinfo; generic values where unreadable."""
    name, flags = cpu_model_and_flags()
    return name, [f for f in ISA_FLAGS if f in flags]


def _resolve_device(device: str) -> torch.device:
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


def _cache_path(identity: dict[str, Any]) -> Path:
    """$STRATA_CACHE (else ~/.cache/strata)/hw-<hash of what the figures depend on>.json."""
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / f"hw-{key}.json"


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
    dev = _resolve_device(device)
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
    from strata.kernels.linear import linear

    if batch < 1 or repeats < 1:
        raise ConfigError(f"batch={batch}, repeats={repeats}: both must be >= 1")
    with torch.inference_mode():
        x = torch.randn(batch, weight.shape[1], dtype=weight.dtype, device=weight.device)
        return _best_seconds(lambda: linear(x, weight), weight.device, repeats)


def measure_gemm(device: str, dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    """GFLOP/s of an n x n x n matmul."""
    dev = _resolve_device(device)
    with torch.inference_mode():
        a = torch.randn(n, n, device=dev).to(dtype)
        b = torch.randn(n, n, device=dev).to(dtype)
        seconds = _best_seconds(lambda: a @ b, dev, repeats)
    return 2 * n**3 / seconds / 1e9


def _linear_rates(
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
    dev = _resolve_device(device)
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
    dev = _resolve_device(device)
    if dev.type != "cuda":
        raise ConfigError(f"device={device!r}: host<->device copies need a CUDA device")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h2d = _best_seconds(lambda: gpu.copy_(host, non_blocking=True), dev, repeats)
    d2h = _best_seconds(lambda: host.copy_(gpu, non_blocking=True), dev, repeats)
    return nbytes / h2d / 1e9, nbytes / d2h / 1e9


def _gemm_rates(dtypes: list[str]) -> dict[str, float]:
    """CPU GFLOP/s of a prefill-shaped F.linear (GEMM_ROWS rows) per dtype, via Strata's dispatch."""
    n, k = GEMM_SHAPE
    out: dict[str, float] = {}
    with torch.inference_mode():
        master = torch.randn(n, k)
        for name in dtypes:
            weight = master.to(DTYPES[name])
            out[name] = 2 * GEMM_ROWS * n * k / measure_linear(weight, GEMM_ROWS, repeats=3) / 1e9
    return out


def measure_sdpa(device: str, dtype: torch.dtype, shape: tuple[int, int, int, int], repeats: int = 5) -> float:
    """GFLOP/s of causal scaled_dot_product_attention in Strata's prefill layout (GQA K/V expanded,
    not copied); FLOPs = 2 x heads x head_dim x n x (n + 1): QK^T and PV over the causal half."""
    dev = _resolve_device(device)
    kvh, group, n, d = shape
    with torch.inference_mode():
        q = torch.randn(kvh, group, n, d, device=dev).to(dtype)
        k = torch.randn(n, kvh, d, device=dev).to(dtype).transpose(0, 1).unsqueeze(1).expand(-1, group, -1, -1)
        v = torch.randn(n, kvh, d, device=dev).to(dtype).transpose(0, 1).unsqueeze(1).expand(-1, group, -1, -1)
        sec = _best_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), dev, repeats)
    return 2 * kvh * group * d * n * (n + 1) / sec / 1e9


def _sdpa_rates(dev: torch.device, dtypes: list[str], shape: tuple[int, int, int, int], repeats: int) -> dict:
    """`measure_sdpa` per dtype; a dtype this build's SDPA rejects is left out (logged)."""
    out = {}
    for name in dtypes:
        try:
            out[name] = measure_sdpa(str(dev), DTYPES[name], shape, repeats)
        except (RuntimeError, NotImplementedError) as e:
            logger.info("SDPA %s not measured on %s: %s", name, dev, e)
    return out


def _int8_gemm_gflops(dev: torch.device) -> float | None:
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


def _quant_rates() -> tuple[dict[str, float], dict[str, float]]:
    """Strata's CPU int8/int4 GEMV kernels: batch-1 weight GB/s (scales included) and batch-16
    GFLOP/s, on random weights of QUANT_LINEAR_SHAPE (int4 with twice the input columns)."""
    from strata.kernels import cpu_quant

    if not cpu_quant.available():
        return {}, {}
    n, k = QUANT_LINEAR_SHAPE
    group = 64
    gbs: dict[str, float] = {}
    gflops: dict[str, float] = {}
    cpu = torch.device("cpu")
    with torch.inference_mode():
        for method in ("int8", "int4"):
            if method == "int8":
                cols = k
                w = torch.randint(-127, 128, (n, cols), dtype=torch.int8)
                s = torch.rand(n)
            else:
                cols = 2 * k
                w = torch.randint(0, 256, (n, cols // 2), dtype=torch.uint8)
                s = torch.rand(n, cols // group)
            wn, sn = w.numpy(), s.numpy()
            nbytes = wn.nbytes + sn.nbytes
            for rows in (1, MATMUL_BATCH):
                x = torch.randn(rows, cols)
                sec = _best_seconds(lambda x=x, m=method, w=wn, s=sn: cpu_quant.gemv(m, x, w, s, group), cpu, 3)
                if rows == 1:
                    gbs[method] = nbytes / sec / 1e9
                else:
                    gflops[method] = 2 * rows * n * cols / sec / 1e9
    return gbs, gflops


# ---------------------------------------------------------------- probe


def _identity(dev: torch.device) -> dict[str, Any]:
    """What the measured figures depend on; hashed into the cache key."""
    cpu_name, isa = _cpu_info()
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        name, memory = props.name, int(props.total_memory)
    else:
        name, memory = cpu_name, int(psutil.virtual_memory().total)
    return {
        "schema": SCHEMA_VERSION,
        "device": str(dev),
        "name": name,
        "cores": default_threads(),
        "threads": torch.get_num_threads(),
        "isa": isa,
        "memory_bytes": memory,
        "torch_version": torch.__version__,
    }


def _measure(identity: dict[str, Any]) -> HardwareProfile:
    dev = torch.device(identity["device"])
    t0 = time.perf_counter()
    extra: dict[str, Any] = {"dispatch_us": measure_dispatch_us(str(dev))}
    if dev.type == "cuda":
        bandwidth = measure_mem_bandwidth(str(dev), nbytes=2**30, repeats=5)
        dtypes = ["float32", "float16"]
        if torch.cuda.is_bf16_supported():
            dtypes.insert(1, "bfloat16")
        linear_gbs, _ = _linear_rates(dev, dtypes, CUDA_LINEAR_SHAPE)
        matmul_gflops = {d: measure_gemm(str(dev), DTYPES[d], CUDA_GEMM_SIZE) for d in dtypes}
        extra["gemm_gflops"] = dict(matmul_gflops)
        extra["sdpa_gflops"] = _sdpa_rates(dev, dtypes, CUDA_SDPA_SHAPE, 5)
        extra["h2d_gbs"], extra["d2h_gbs"] = measure_host_copy(str(dev))
    else:
        # torch and numpy bandwidth interleaved, best of 3 rounds each: on a shared VM the
        # bandwidth moves within seconds, and the two figures should see the same machine
        meter = numpy_bandwidth_meter(NUMPY_BANDWIDTH_BYTES, max(1, int(identity["threads"])))
        bandwidth = np_read = np_copy = 0.0
        for _ in range(3):
            bandwidth = max(bandwidth, measure_mem_bandwidth("cpu", repeats=2))
            r, c = meter()
            np_read, np_copy = max(np_read, r), max(np_copy, c)
        del meter
        extra.update(numpy_read_gbs=np_read, numpy_copy_gbs=np_copy)
        linear_gbs, matmul_gflops = _linear_rates(dev, list(DTYPES), CPU_LINEAR_SHAPE)
        extra["gemm_gflops"] = _gemm_rates(list(DTYPES))
        extra["sdpa_gflops"] = _sdpa_rates(dev, list(DTYPES), CPU_SDPA_SHAPE, 3)
        extra["quant_linear_gbs"], extra["quant_matmul_gflops"] = _quant_rates()
    int8 = _int8_gemm_gflops(dev)
    if int8 is not None:
        extra["gemm_gflops"]["int8"] = int8
    fields_ = {k: v for k, v in identity.items() if k != "schema"}
    profile = HardwareProfile(
        **fields_,
        mem_bandwidth_gbs=bandwidth,
        linear_gbs=linear_gbs,
        matmul_gflops=matmul_gflops,
        **extra,
    )
    logger.info(
        "measured %s (%s, %d threads) in %.1f s: bandwidth %.1f GB/s, batch-1 linear GB/s %s, "
        "batched GFLOP/s %s, GEMM GFLOP/s %s",
        profile.device,
        profile.name,
        profile.threads,
        time.perf_counter() - t0,
        bandwidth,
        _fmt(linear_gbs),
        _fmt(matmul_gflops),
        _fmt(profile.gemm_gflops),
    )
    return profile


def _fmt(rates: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.1f}" for k, v in rates.items())


def _read_cache(path: Path) -> HardwareProfile | None:
    try:
        return HardwareProfile.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        logger.warning("ignoring unreadable hardware cache %s (%s); re-measuring", path, e)
        return None


def _write_cache(path: Path, profile: HardwareProfile) -> None:
    """Atomic write (temp file + rename) so concurrent probes never read half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(profile.to_json(), indent=2, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not cache hardware profile at %s: %s", path, e)


def probe(device: str = "cpu", refresh: bool = False) -> HardwareProfile:
    """The device's measured profile: read from cache, or measured (~seconds) and cached.

    The cache key covers device, name, ISA, memory, usable cores, torch version and thread
    count, so changing any of them re-measures; `refresh=True` always re-measures.
    """
    identity = _identity(_resolve_device(device))
    path = _cache_path(identity)
    if not refresh:
        cached = _read_cache(path)
        if cached is not None:
            logger.debug("hardware profile from cache %s", path)
            return cached
    profile = _measure(identity)
    _write_cache(path, profile)
    return profile


# ---------------------------------------------------------------- dtype="auto"


def _checked_checkpoint_dtype(checkpoint_dtype: torch.dtype) -> torch.dtype:
    if checkpoint_dtype == torch.float64:
        return torch.float32
    if checkpoint_dtype not in DTYPES.values():
        raise ConfigError(
            f"checkpoint dtype {checkpoint_dtype} has no automatic compute dtype; "
            "pass dtype='float32', 'bfloat16' or 'float16' explicitly"
        )
    return checkpoint_dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def _auto_cuda(checkpoint: torch.dtype, profile: HardwareProfile | None) -> torch.dtype:
    if checkpoint != torch.bfloat16:
        return checkpoint
    if profile is not None:
        supported = profile.matmul_gflops.get("bfloat16", 0.0) > 0
    else:
        supported = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if supported:
        return torch.bfloat16
    logger.warning("bf16 checkpoint on a GPU without bf16 support: computing in float16")
    return torch.float16


def _auto_cpu(checkpoint: torch.dtype, profile: HardwareProfile) -> torch.dtype:
    """Fastest dtype by measurement: a narrow dtype must win on both decode and batched work."""
    ref_decode = profile.linear_gbs.get("float32", 0.0) / 4
    ref_batched = profile.matmul_gflops.get("float32", 0.0)
    if ref_decode <= 0 or ref_batched <= 0:
        logger.info("auto dtype: profile has no float32 figures; using float32")
        return torch.float32
    # fp16 cannot hold the range of a bf16/fp32 checkpoint, so it is only a candidate for fp16 ones.
    candidates = ["bfloat16"] + (["float16"] if checkpoint == torch.float16 else [])
    best, best_score = "float32", 1.0
    notes = [
        f"float32: batch-1 {profile.linear_gbs['float32']:.1f} GB/s, "
        f"batch-{MATMUL_BATCH} {ref_batched:.1f} GFLOP/s"
    ]
    for name in candidates:
        gbs = profile.linear_gbs.get(name, 0.0)
        gflops = profile.matmul_gflops.get(name, 0.0)
        itemsize = DTYPES[name].itemsize
        decode_x = gbs / itemsize / ref_decode
        batched_x = gflops / ref_batched
        score = min(decode_x, batched_x)
        notes.append(
            f"{name}: batch-1 {gbs:.1f} GB/s ({decode_x:.2f}x fp32 per token), "
            f"batch-{MATMUL_BATCH} {gflops:.1f} GFLOP/s ({batched_x:.2f}x)"
        )
        if score >= SWITCH_MARGIN and score > best_score:
            best, best_score = name, score
    logger.info(
        "auto dtype on %s (%s, isa %s): %s; checkpoint %s -> %s",
        profile.device,
        profile.name,
        "+".join(profile.isa) or "none",
        "; ".join(notes),
        _dtype_name(checkpoint),
        best,
    )
    return DTYPES[best]


def auto_dtype(
    device: str, checkpoint_dtype: torch.dtype, profile: HardwareProfile | None = None
) -> torch.dtype:
    """Strata's `dtype="auto"`.

    CUDA: the checkpoint's dtype (bf16 falls back to fp16 where unsupported; fp32 stays fp32).
    CPU: the fastest of fp32/bf16 (and fp16 for fp16 checkpoints) by the profile's measured
    batch-1 and batched F.linear rates; narrow dtypes whose batched matmul is slow (CPUs without
    AVX512-BF16/AMX) lose to fp32.
    """
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r}: only 'cpu' and 'cuda[:N]' are supported")
    if profile is not None and torch.device(profile.device).type != kind:
        raise ConfigError(f"profile is for {profile.device!r}, not device={device!r}")
    checkpoint = _checked_checkpoint_dtype(checkpoint_dtype)
    if kind == "cuda":
        return _auto_cuda(checkpoint, profile)
    return _auto_cpu(checkpoint, profile if profile is not None else probe("cpu"))
