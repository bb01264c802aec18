"""The preemption policy: swap a victim's KV to host memory, or drop it and recompute later."""

from __future__ import annotations

import logging

import torch

from strata.config import EngineConfig
from strata.engine.request import Sequence
from strata.hardware.probe import probe
from strata.memory.planner import MemoryPlan
from strata.memory.swap import PreemptionCostModel
from strata.model_config import ModelConfig

logger = logging.getLogger(__name__)


class SwapPolicy:
    """swap mode always swaps; auto asks a cost model built from the hardware profile on the first
    preemption (probing is not free, and most runs never preempt)."""

    def __init__(self, config: EngineConfig, plan: MemoryPlan, dtype: torch.dtype, cfg: ModelConfig) -> None:
        self.mode = config.preemption_mode
        self.device = config.device
        self.kv_bytes_per_token = plan.kv_bytes_per_token
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.num_params = cfg.num_params()
        self._cost_model: PreemptionCostModel | None = None

    def __call__(self, seq: Sequence) -> bool:
        if self.mode == "swap":
            return True
        if self._cost_model is None:
            self._cost_model = self._build_cost_model()
        return self._cost_model.prefer_swap(seq.num_computed_tokens)

    def _build_cost_model(self) -> PreemptionCostModel:
        """link = host<->device copy rate, compute = measured GEMM rate."""
        hw = probe(self.device)
        gflops = hw.matmul_gflops.get(self.dtype_name) or hw.matmul_gflops.get("float32") or 1.0
        # on CPU both pools are host memory: a copy reads and writes, so about half the bandwidth;
        # on GPUs the host link (PCIe) is not in the profile yet: assume PCIe 4.0 x16 in practice
        link = hw.mem_bandwidth_gbs / 2 if self.device == "cpu" else 25.0
        rate = gflops * 1e9 / (2 * self.num_params)
        model = PreemptionCostModel(self.kv_bytes_per_token, link, rate)
        logger.info("preemption cost model: link %.1f GB/s, recompute %.0f tok/s", link, rate)
        return model
