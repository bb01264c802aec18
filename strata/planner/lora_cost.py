"""What serving LoRA adapters costs: their memory and FLOPs from the model's shapes, and their time
on this machine measured on the decode probe's model (decode_probe.py) with and without adapters.

The engine keeps `max_loras` slots in a bank on every targeted projection (graph/lora.py), each
padded to `max_lora_rank`, so the resident bytes are slots x rank x (in + out) over the
projections, at the banks' dtype. A step reads each adapter its rows use once (the CPU kernel
groups rows by adapter: kernels/cpu_lora.py) and computes 2 x rank x (in + out) FLOPs per
projection per row, a few percent of the base's for the usual ranks; on a small model the bytes
of many distinct adapters weigh more than the FLOPs, so the measured time is what the plan shows.

Targets: every linear of the attention and of a dense MLP (q, k, v, o, gate, up, down); MoE layers'
experts take none (graph/lora_adapter.py), so there only the attention counts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from strata.graph.lora import LoRABatch, lora_batch
from strata.graph.lora_adapter import attach_banks
from strata.model_config import ModelConfig

logger = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def projection_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of every projection an adapter may target, all layers."""
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    out = []
    for i in range(cfg.num_layers):
        out += [(h, q), (h, kv), (h, kv), (q, h)]
        if cfg.moe is None or not cfg.is_moe_layer(i):
            out += [(h, inter), (h, inter), (inter, h)]
    return out


@dataclass(frozen=True)
class LoRACost:
    """One serving configuration's adapter cost; the measured fields are None where not probed."""

    adapters: int  # slots resident (max_loras)
    rank: int  # max_lora_rank: every slot padded to it
    dtype: str  # the banks' storage
    resident_bytes: int  # all slots, every targeted projection (A, B and the scales)
    adapter_bytes: int  # one adapter, read once by each step that uses it
    flops_per_token: int  # one token through one adapter, every targeted projection
    layers: int  # the model's decoder layers (the measured per-layer times scale by it)
    batch: int | None = None  # the measured decode step's rows ...
    spread: int | None = None  # ... round robin over this many adapters
    base_layer_s: float | None = None  # that step per decoder layer without adapters ...
    lora_layer_s: float | None = None  # ... and with them

    @property
    def step_overhead(self) -> float | None:
        """The measured decode step's time with adapters over without, minus one."""
        if self.base_layer_s is None or self.lora_layer_s is None or self.base_layer_s <= 0:
            return None
        return self.lora_layer_s / self.base_layer_s - 1


def plan_lora_dtype(choice: str, dtype: torch.dtype, quantization: str | None) -> str:
    """The banks' dtype the engine picks (graph/lora_adapter.lora_dtype): auto = float32 over fp32
    weights, bfloat16 over narrower ones."""
    if choice != "auto":
        return choice
    return "float32" if quantization is None and dtype == torch.float32 else "bfloat16"


def lora_cost(cfg: ModelConfig, adapters: int, rank: int, dtype: str = "float32") -> LoRACost:
    """The shapes' part of the cost (no measurement)."""
    shapes = projection_shapes(cfg)
    params = sum(rank * (i + o) for i, o in shapes)
    nbytes = params * DTYPE_BYTES[dtype]
    scales = 4 * len(shapes)  # one fp32 scale per slot and projection
    return LoRACost(adapters, rank, dtype, adapters * (nbytes + scales), nbytes, 2 * params, cfg.num_layers)


@torch.inference_mode()
def measure(probe, cost: LoRACost, batch: int, spread: int | None = None, seed: int = 0) -> LoRACost:
    """`cost` with the decode step of `batch` rows, round robin over `spread` of its adapters (all
    by default), timed on the probe's model (decode_probe.DecodeProbe) with random adapters in
    banks and without; the banks are removed again afterwards."""
    spread = max(1, min(spread or cost.adapters, cost.adapters, batch))
    model = probe.model
    sites = attach_banks(model, slots=cost.adapters, rank=cost.rank,
                         dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[cost.dtype])
    banks = {id(s.module): s.module for s in sites.values()}
    try:
        g = torch.Generator().manual_seed(seed)
        for m in banks.values():
            bank = m.lora
            bank.lora_a.copy_(torch.randn(bank.lora_a.shape, generator=g) * 0.02)
            bank.lora_b.copy_(torch.randn(bank.lora_b.shape, generator=g) * 0.02)
            bank.scale.fill_(1.0)
        if probe.step is not None:
            probe.step.weights_may_have_changed()
        inputs = (*probe._step_inputs(batch), probe.kv_caches)
        lora = LoRABatch.of([r % spread for r in range(batch)])

        def with_adapters():
            with lora_batch(lora):
                probe._decode(*inputs)

        base, with_lora = probe._seconds(lambda: probe._decode(*inputs), with_adapters)
    finally:
        for m in banks.values():
            del m.lora
        if probe.step is not None:
            probe.step.weights_may_have_changed()
    logger.info("LoRA probe: batch %d over %d adapters rank %d (%s): %.3f vs %.3f ms a layer", batch,
                spread, cost.rank, cost.dtype, with_lora / probe.layers * 1e3, base / probe.layers * 1e3)
    return LoRACost(**{**cost.__dict__, "batch": batch, "spread": spread, "base_layer_s": base / probe.layers,
                       "lora_layer_s": with_lora / probe.layers})


def format_lines(cost: LoRACost) -> list[str]:
    """The plan's / analysis's LoRA lines."""
    layers = cost.layers
    mib = 2**20
    out = [f"LoRA: {cost.adapters} adapter slot(s) of rank {cost.rank} ({cost.dtype}) on every linear: "
           f"{cost.resident_bytes / mib:.1f} MiB resident, {cost.adapter_bytes / mib:.1f} MiB read per adapter a "
           f"step uses, {cost.flops_per_token / 1e6:.1f} MFLOP per token"]
    if cost.step_overhead is not None:
        out.append(f"  measured: a decode step of {cost.batch} rows over {cost.spread} adapters "
                   f"takes {cost.lora_layer_s * layers * 1e3:.2f} ms vs {cost.base_layer_s * layers * 1e3:.2f} ms "
                   f"without ({cost.step_overhead:+.0%})")
    return out
