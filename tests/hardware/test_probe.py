"""Hardware probe: cache, measurements (tiny sizes) and the dtype="auto" policy."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from strata.config import DTYPES
from strata.errors import ConfigError
from strata.hardware import measure as measure_mod
from strata.hardware import probe as probe_mod
from strata.hardware.measure import (
    measure_dispatch_us,
    measure_gemm,
    measure_linear,
    measure_mem_bandwidth,
    numpy_bandwidth_meter,
)
from strata.hardware.placement import default_threads, set_compute_threads
from strata.hardware.probe import HardwareProfile, auto_dtype, probe
from strata.kernels import cpu_quant


def _cpu_profile(linear_gbs: dict[str, float], matmul_gflops: dict[str, float]) -> HardwareProfile:
    return HardwareProfile(
        device="cpu",
        name="synthetic",
        cores=2,
        threads=2,
        isa=["avx2", "fma"],
        memory_bytes=24 * 2**30,
        mem_bandwidth_gbs=32.0,
        linear_gbs=linear_gbs,
        matmul_gflops=matmul_gflops,
        torch_version=torch.__version__,
    )


# Zen 3, AVX2 only (MACHINE.md): bf16 GEMV streams fine, but batched bf16 matmul is slow.
SLOW_BF16 = _cpu_profile(
    {"float32": 25.0, "bfloat16": 18.0, "float16": 18.0},
    {"float32": 55.0, "bfloat16": 20.0, "float16": 20.0},
)
# Zen 4 with AVX512-BF16 (measured): bf16 wins both per token and batched.
FAST_BF16 = replace(
    SLOW_BF16,
    isa=["avx2", "fma", "avx512f", "avx512_bf16"],
    linear_gbs={"float32": 18.5, "bfloat16": 19.0, "float16": 34.0},
    matmul_gflops={"float32": 43.0, "bfloat16": 220.0, "float16": 45.0},
)
CUDA = HardwareProfile(
    device="cuda:0",
    name="synthetic GPU",
    cores=16,
    threads=16,
    isa=["avx2", "fma"],
    memory_bytes=80 * 2**30,
    mem_bandwidth_gbs=3000.0,
    linear_gbs={"float32": 2500.0, "bfloat16": 2600.0, "float16": 2600.0},
    matmul_gflops={"float32": 50_000.0, "bfloat16": 700_000.0, "float16": 700_000.0},
    torch_version=torch.__version__,
)


@pytest.fixture
def tiny_probe(monkeypatch: pytest.MonkeyPatch, tmp_path) -> Iterator[list[int]]:
    """probe() with a private cache dir and tiny measurements; yields a measure-call counter."""
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path))
    monkeypatch.setattr(measure_mod, "CPU_LINEAR_SHAPE", (64, 32))
    monkeypatch.setattr(measure_mod, "CPU_SDPA_SHAPE", (1, 2, 16, 16))
    monkeypatch.setattr(measure_mod, "GEMM_SHAPE", (64, 32))
    monkeypatch.setattr(measure_mod, "GEMM_ROWS", 32)
    monkeypatch.setattr(measure_mod, "QUANT_LINEAR_SHAPE", (64, 64))
    monkeypatch.setattr(measure_mod, "NUMPY_BANDWIDTH_BYTES", 2**20)
    real_bw = measure_mod.measure_mem_bandwidth
    monkeypatch.setattr(
        measure_mod, "measure_mem_bandwidth", lambda device="cpu", **_: real_bw(device, 2**20, 2)
    )
    calls: list[int] = []
    real_measure = probe_mod._measure

    def counting(identity):
        calls.append(1)
        return real_measure(identity)

    monkeypatch.setattr(probe_mod, "_measure", counting)
    yield calls


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_json_round_trip() -> None:
    d = json.loads(json.dumps(FAST_BF16.to_json()))
    assert HardwareProfile.from_json(d) == FAST_BF16
    with pytest.raises(ValueError):
        HardwareProfile.from_json({**d, "schema": 999})
    with pytest.raises(ValueError):
        HardwareProfile.from_json({k: v for k, v in d.items() if k != "linear_gbs"})


def test_probe_caches_and_refreshes(tiny_probe: list[int], tmp_path) -> None:
    first = probe()
    files = list(tmp_path.glob("hw-*.json"))
    assert len(files) == 1 and len(tiny_probe) == 1
    assert first.device == "cpu" and first.cores >= 1 and first.threads == torch.get_num_threads()
    assert set(first.linear_gbs) == set(first.matmul_gflops) == {"float32", "bfloat16", "float16"}
    assert all(v > 0 and math.isfinite(v) for v in first.linear_gbs.values())
    assert first.torch_version == torch.__version__
    assert set(DTYPES) <= set(first.gemm_gflops) and all(v > 0 for v in first.gemm_gflops.values())
    assert first.dispatch_us > 0 and first.numpy_read_gbs > 0 and first.numpy_copy_gbs > 0
    if cpu_quant.available():
        assert set(first.quant_linear_gbs) == set(first.quant_matmul_gflops) == {"int8", "int4"}
    assert first.h2d_gbs == first.d2h_gbs == 0.0  # GPU-only figures

    assert probe() == first and len(tiny_probe) == 1  # served from cache
    probe(refresh=True)
    assert len(tiny_probe) == 2

    files[0].write_text("{not json")
    assert probe().device == "cpu" and len(tiny_probe) == 3  # corrupt cache: re-measured
    assert HardwareProfile.from_json(json.loads(files[0].read_text())).device == "cpu"


def test_probe_key_depends_on_threads(
    tiny_probe: list[int], tmp_path, restore_threads: None
) -> None:
    set_compute_threads(1)
    probe()
    set_compute_threads(2)
    probe()
    assert len(tiny_probe) == 2 and len(list(tmp_path.glob("hw-*.json"))) == 2
    assert not list(tmp_path.glob("*.tmp"))


def test_auto_dtype_cpu_slow_bf16_picks_float32(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="strata.hardware.dtype_policy"):
        assert auto_dtype("cpu", torch.bfloat16, SLOW_BF16) == torch.float32
    assert "55.0 GFLOP/s" in caplog.text and "20.0 GFLOP/s" in caplog.text
    assert auto_dtype("cpu", torch.float32, SLOW_BF16) == torch.float32
    assert auto_dtype("cpu", torch.float16, SLOW_BF16) == torch.float32


def test_auto_dtype_cpu_fast_bf16_picks_bfloat16() -> None:
    assert auto_dtype("cpu", torch.bfloat16, FAST_BF16) == torch.bfloat16
    assert auto_dtype("cpu", torch.float32, FAST_BF16) == torch.bfloat16


def test_auto_dtype_cpu_margin_and_fp16_range() -> None:
    # A narrow dtype barely ahead (within noise) does not displace fp32.
    marginal = replace(
        FAST_BF16,
        linear_gbs={"float32": 20.0, "bfloat16": 10.5},
        matmul_gflops={"float32": 50.0, "bfloat16": 52.0},
    )
    assert auto_dtype("cpu", torch.bfloat16, marginal) == torch.float32
    # fp16 is fastest, but only an fp16 checkpoint may be computed in fp16.
    fp16_fast = replace(
        FAST_BF16, matmul_gflops={"float32": 43.0, "bfloat16": 60.0, "float16": 400.0}
    )
    assert auto_dtype("cpu", torch.float16, fp16_fast) == torch.float16
    assert auto_dtype("cpu", torch.bfloat16, fp16_fast) == torch.bfloat16


def test_auto_dtype_cuda_keeps_checkpoint_dtype() -> None:
    assert auto_dtype("cuda", torch.bfloat16, CUDA) == torch.bfloat16
    assert auto_dtype("cuda:0", torch.float32, CUDA) == torch.float32
    assert auto_dtype("cuda:0", torch.float16, CUDA) == torch.float16
    assert auto_dtype("cuda:0", torch.float64, CUDA) == torch.float32
    no_bf16 = replace(CUDA, matmul_gflops={"float32": 15_000.0, "float16": 120_000.0})
    assert auto_dtype("cuda:0", torch.bfloat16, no_bf16) == torch.float16


def test_auto_dtype_rejects_bad_input() -> None:
    with pytest.raises(ConfigError):
        auto_dtype("cuda:0", torch.bfloat16, SLOW_BF16)  # profile of another device
    with pytest.raises(ConfigError):
        auto_dtype("tpu", torch.bfloat16, SLOW_BF16)
    with pytest.raises(ConfigError):
        auto_dtype("cpu", torch.int8, SLOW_BF16)
    with pytest.raises(ConfigError):
        probe("nonsense")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_probe_cuda_without_gpu_is_config_error() -> None:
    with pytest.raises(ConfigError, match="CUDA is not available"):
        probe("cuda")


def test_measurements_small_sizes() -> None:
    bw = measure_mem_bandwidth("cpu", nbytes=2**20, repeats=2)
    assert bw > 0 and math.isfinite(bw)
    seconds = measure_linear(torch.randn(64, 32), batch=4, repeats=2)
    assert seconds > 0 and math.isfinite(seconds)
    gflops = measure_gemm("cpu", torch.float32, 32, repeats=2)
    assert gflops > 0 and math.isfinite(gflops)
    with pytest.raises(ConfigError):
        measure_mem_bandwidth("cpu", nbytes=0)
    with pytest.raises(ConfigError):
        measure_linear(torch.randn(4, 4), batch=0)
    assert measure_dispatch_us("cpu", calls=50) > 0
    read, copy = numpy_bandwidth_meter(2**20, threads=2)()
    assert read > 0 and copy > 0
    with pytest.raises(ConfigError):
        numpy_bandwidth_meter(0)


def test_placement(restore_threads: None) -> None:
    n = default_threads()
    assert 1 <= n <= len(os.sched_getaffinity(0))
    assert set_compute_threads(1) == 1 == torch.get_num_threads()
    assert set_compute_threads(None) == n
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ConfigError):
            set_compute_threads(bad)  # type: ignore[arg-type]
