"""The HardwareProfile: one device's measured figures, and their JSON form (the probe's cache).

probe.py measures and caches it, dtype_policy.py chooses a compute dtype from it, `strata hw`
and `strata plan` read it. `comm_model` is the collectives' fitted alpha-beta model
(strata/comm/alpha_beta.py) that `strata bench comm` adds to the cached profile; it is optional
in the JSON, so profiles cached before it existed still load (with no comm model).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from strata.comm.alpha_beta import CommModel

SCHEMA_VERSION = 6  # 2: linear rates through Strata's dispatch; 3: + gemm/quant/dispatch/copy figures;
# 4: bf16 batch-1/16 rates through the narrow-reading bf16 GEMV (kernels/cpu_bf16.py); 5: + gemm "float32_onednn";
# 6: + gemm "int8_int8" (CPU: torch._int_mm, the W8A8 prefill GEMM)


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
    comm_model: dict[str, Any] = field(default_factory=dict)  # CommModel.to_json(); {}: not measured

    def to_json(self) -> dict[str, Any]:
        """Plain-data form (JSON-serialisable)."""
        return {"schema": SCHEMA_VERSION, **asdict(self)}

    def comm(self) -> CommModel | None:
        """The fitted collectives model (`strata bench comm`), or None when never measured."""
        return CommModel.from_json(self.comm_model)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HardwareProfile:
        """Inverse of `to_json`; raises ValueError on a wrong schema or missing fields."""
        if d.get("schema", SCHEMA_VERSION) != SCHEMA_VERSION:
            raise ValueError(f"hardware profile schema {d.get('schema')!r} != {SCHEMA_VERSION}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in d and n not in OPTIONAL]
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
            comm_model=_comm_model(d.get("comm_model")),
        )


OPTIONAL = ("comm_model",)  # may be absent from a cached profile


def _comm_model(d: Any) -> dict[str, Any]:
    """The stored model, validated by parsing it (a bad one raises ValueError like any field)."""
    if not d:
        return {}
    if not isinstance(d, dict):
        raise ValueError(f"hardware profile comm_model: expected an object, got {type(d).__name__}")
    CommModel.from_json(d)
    return dict(d)


def _rates(d: dict[str, Any]) -> dict[str, float]:
    return {str(k): float(v) for k, v in d.items()}
