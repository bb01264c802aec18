"""What this machine can do, measured once and cached, and the compute dtype that follows from it.

`probe()` measures DRAM bandwidth and the F.linear rates that decide decode (batch-1 weight
streaming) and batched/prefill speed, per dtype, and caches them as JSON so later calls are free.
`auto_dtype()` turns those figures into Strata's `dtype="auto"`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import psutil
import torch

from strata.config import DTYPES, cache_root
from strata.errors import ConfigError
from strata.hardware.placement import default_threads

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 2: linear rates measured through Strata's kernel dispatch
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")
CPU_LINEAR_SHAPE = (16384, 4096)  # fp32 256 MiB, bf16 128 MiB: well past L3 (even 2 CCDs)
CUDA_LINEAR_SHAPE = (16384, 8192)  # bf16 256 MiB: past a GPU's L2
CUDA_GEMM_SIZE = 8192
MATMUL_BATCH = 16
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
            linear_gbs={str(k): float(v) for k, v in d["linear_gbs"].items()},
            matmul_gflops={str(k): float(v) for k, v in d["matmul_gflops"].items()},
            torch_version=str(d["torch_version"]),
        )


# ---------------------------------------------------------------- identity (cheap)


def _cpu_info() -> tuple[str, list[str]]:
    """(model name, ISA flags of interest) from /proc/cpuinfo; generic values where unreadable."""
    name, flags = "", set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return name or "unknown-cpu", [f for f in ISA_FLAGS if f in flags]


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

    CPU: read bandwidth of a torch sum over an fp32 buffer (make `nbytes` much larger than L3).
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
            seconds = _best_seconds(src.sum, dev, repeats)
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
    if dev.type == "cuda":
        bandwidth = measure_mem_bandwidth(str(dev), nbytes=2**30, repeats=5)
        dtypes = ["float32", "float16"]
        if torch.cuda.is_bf16_supported():
            dtypes.insert(1, "bfloat16")
        linear_gbs, _ = _linear_rates(dev, dtypes, CUDA_LINEAR_SHAPE)
        matmul_gflops = {d: measure_gemm(str(dev), DTYPES[d], CUDA_GEMM_SIZE) for d in dtypes}
    else:
        bandwidth = measure_mem_bandwidth("cpu")
        linear_gbs, matmul_gflops = _linear_rates(dev, list(DTYPES), CPU_LINEAR_SHAPE)
    fields_ = {k: v for k, v in identity.items() if k != "schema"}
    profile = HardwareProfile(
        **fields_,
        mem_bandwidth_gbs=bandwidth,
        linear_gbs=linear_gbs,
        matmul_gflops=matmul_gflops,
    )
    logger.info(
        "measured %s (%s, %d threads) in %.1f s: bandwidth %.1f GB/s, batch-1 linear GB/s %s, "
        "batched GFLOP/s %s",
        profile.device,
        profile.name,
        profile.threads,
        time.perf_counter() - t0,
        bandwidth,
        _fmt(linear_gbs),
        _fmt(matmul_gflops),
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
