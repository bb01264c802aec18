"""Fixtures for the planner tests: a synthetic measured CPU profile and a tiny random checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from strata.demo.random_models import SHAPES, random_state_dict
from strata.hardware.probe import HardwareProfile

# Figures of the order measured on the dev box (Zen 4, 2 cores); synthetic, so tests never probe.
CPU_PROFILE = HardwareProfile(
    device="cpu", name="synthetic CPU", cores=2, threads=2, isa=["avx2", "fma"],
    memory_bytes=24 * 2**30, mem_bandwidth_gbs=40.0,
    linear_gbs={"float32": 32.0, "bfloat16": 18.0, "float16": 12.0},
    matmul_gflops={"float32": 64.0, "bfloat16": 190.0, "float16": 44.0},
    torch_version=torch.__version__,
    gemm_gflops={"float32": 180.0, "bfloat16": 420.0, "float16": 44.0, "int8": 150.0},
    sdpa_gflops={"float32": 70.0, "bfloat16": 60.0, "float16": 20.0},
    quant_linear_gbs={"int8": 30.0, "int4": 14.0},
    quant_matmul_gflops={"int8": 55.0, "int4": 48.0},
    dispatch_us=1.2, numpy_read_gbs=38.0, numpy_copy_gbs=30.0,
)


@pytest.fixture
def cpu_profile() -> HardwareProfile:
    return CPU_PROFILE


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The 'tiny' random shape written as an HF directory (no tokenizer: token-id prompts)."""
    out = tmp_path_factory.mktemp("tiny-ckpt")
    cfg = dict(SHAPES["tiny"], torch_dtype="float32")
    save_file(random_state_dict(cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg))
    return out
