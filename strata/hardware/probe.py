"""What this machine can do, measured once and cached: `probe()`, and `auto_dtype()` on top of it.

`probe()` measures DRAM bandwidth and the F.linear rates that decide decode (batch-1 weight
streaming) and batched/prefill speed, per dtype, and caches them as JSON so later calls are free.
Schema 3 adds what `strata hw` and `strata plan` read: prefill-shaped GEMM rates, the quantised
kernels' rates, the cost of one tiny torch op, an independent numpy bandwidth figure, and
host<->device copy rates on GPUs. The figures' dataclass is profile.py's HardwareProfile, the
measurements are measure.py's, and `auto_dtype()` (Strata's `dtype="auto"`) applies
dtype_policy.py to this machine's cached profile. `strata bench comm` stores its fitted
collectives model in the same cached profile (save_comm_model; cached_comm_model reads it
without measuring anything), and a re-probe keeps it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import torch

from strata.comm.alpha_beta import CommModel
from strata.config import DTYPES, cache_root
from strata.cpuinfo import cpu_model_and_flags
from strata.hardware import dtype_policy, measure
from strata.hardware.cores import default_threads
from strata.hardware.measure import measure_mem_bandwidth, resolve_device
from strata.hardware.profile import SCHEMA_VERSION, HardwareProfile

# HardwareProfile (profile.py) and measure_mem_bandwidth (measure.py) are reached from here too
__all__ = ["SCHEMA_VERSION", "HardwareProfile", "auto_dtype", "cached_comm_model", "measure_mem_bandwidth",
           "probe", "profile_path", "save_comm_model"]

logger = logging.getLogger(__name__)

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")


# ---------------------------------------------------------------- identity (cheap)


def _cpu_info() -> tuple[str, list[str]]:
    """(model name, ISA flags of interest) from /proc/cpuinfo; generic values where unreadable."""
    name, flags = cpu_model_and_flags()
    return name, [f for f in ISA_FLAGS if f in flags]


def _cache_path(identity: dict[str, Any]) -> Path:
    """$STRATA_CACHE (else ~/.cache/strata)/hw-<hash of what the figures depend on>.json."""
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / f"hw-{key}.json"


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
    extra: dict[str, Any] = {"dispatch_us": measure.measure_dispatch_us(str(dev))}
    if dev.type == "cuda":
        bandwidth = measure.measure_mem_bandwidth(str(dev), nbytes=2**30, repeats=5)
        dtypes = ["float32", "float16"]
        if torch.cuda.is_bf16_supported():
            dtypes.insert(1, "bfloat16")
        linear_gbs, _ = measure.linear_rates(dev, dtypes, measure.CUDA_LINEAR_SHAPE)
        matmul_gflops = {d: measure.measure_gemm(str(dev), DTYPES[d], measure.CUDA_GEMM_SIZE) for d in dtypes}
        extra["gemm_gflops"] = dict(matmul_gflops)
        extra["sdpa_gflops"] = measure.sdpa_rates(dev, dtypes, measure.CUDA_SDPA_SHAPE, 5)
        extra["h2d_gbs"], extra["d2h_gbs"] = measure.measure_host_copy(str(dev))
    else:
        # torch and numpy bandwidth interleaved, best of 3 rounds each: on a shared VM the
        # bandwidth moves within seconds, and the two figures should see the same machine
        meter = measure.numpy_bandwidth_meter(measure.NUMPY_BANDWIDTH_BYTES, max(1, int(identity["threads"])))
        bandwidth = np_read = np_copy = 0.0
        for _ in range(3):
            bandwidth = max(bandwidth, measure.measure_mem_bandwidth("cpu", repeats=2))
            r, c = meter()
            np_read, np_copy = max(np_read, r), max(np_copy, c)
        del meter
        extra.update(numpy_read_gbs=np_read, numpy_copy_gbs=np_copy)
        linear_gbs, matmul_gflops = measure.linear_rates(dev, list(DTYPES), measure.CPU_LINEAR_SHAPE)
        extra["gemm_gflops"] = measure.gemm_rates(list(DTYPES))
        int8_int8 = measure.int8_int8_gemm_gflops()
        if int8_int8 is not None:
            extra["gemm_gflops"]["int8_int8"] = int8_int8
        extra["sdpa_gflops"] = measure.sdpa_rates(dev, list(DTYPES), measure.CPU_SDPA_SHAPE, 3)
        extra["quant_linear_gbs"], extra["quant_matmul_gflops"] = measure.quant_rates()
    int8 = measure.int8_gemm_gflops(dev)
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
    identity = _identity(resolve_device(device))
    path = _cache_path(identity)
    cached = _read_cache(path)
    if cached is not None and not refresh:
        logger.debug("hardware profile from cache %s", path)
        return cached
    profile = _measure(identity)
    if cached is not None and cached.comm_model:  # measured by strata bench comm: keep it
        profile = replace(profile, comm_model=cached.comm_model)
    _write_cache(path, profile)
    return profile


# ---------------------------------------------------------------- the comm model


def profile_path(device: str = "cpu") -> Path:
    """Where this device's profile is cached (probe() reads and writes it)."""
    return _cache_path(_identity(resolve_device(device)))


def cached_comm_model(device: str = "cpu") -> CommModel | None:
    """The fitted collectives model in this device's cached profile; None when there is no cached
    profile or it has none. Measures nothing (Communicator(cost=...) and `strata plan` use it)."""
    cached = _read_cache(profile_path(device))
    return cached.comm() if cached is not None else None


def save_comm_model(device: str, model: CommModel) -> Path:
    """Store `model` in the device's cached profile (probing it first if there is none), merged
    with what it held: fits of (collective, transport, world size) not measured now are kept."""
    profile = probe(device)
    old = profile.comm()
    merged = old.merged(model) if old is not None else model
    path = profile_path(device)
    _write_cache(path, replace(profile, comm_model=merged.to_json()))
    return path


# ---------------------------------------------------------------- dtype="auto"


def auto_dtype(
    device: str, checkpoint_dtype: torch.dtype, profile: HardwareProfile | None = None
) -> torch.dtype:
    """Strata's `dtype="auto"` (dtype_policy.py), from this CPU's probe() when no profile is given."""
    return dtype_policy.auto_dtype(device, checkpoint_dtype, profile, cpu_profile=probe)
