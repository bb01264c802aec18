"""The CPU platform: the fused decode step, the kernel policy from the hardware profile's
measurements, and the run-time tuners.

    decode step     platform/cpu_decode_step.py: every Llama-shaped layer of an all-decode step in
                    one compiled call (unless --fuse, --compile or CUDA graphs take the step)
    kernel policy   platform/cpu_policy.py: bf16 weight storage and each projection's prefill GEMM,
                    by measurement; the decode-first prefill cap priced at the measured GEMM rate
    tuners          platform/multi_step.py (decode steps per scheduler call), adaptive_threads.py
                    (the decode kernels' thread cap), decode_first.py (the prefill cap, serving only)
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from strata.config import EngineConfig
from strata.kernels import cpu_bf16
from strata.model_config import ModelConfig
from strata.platform import adaptive_threads, cpu_policy, decode_first, multi_step
from strata.platform.base import Platform, start_up_cap
from strata.platform.cpu_decode_step import CpuDecodeStep
from strata.platform.policy import StepPolicy

logger = logging.getLogger(__name__)

# The prefill share of a step while streams decode, priced at the GEMM peak (ITL target 0.25 s).
# 0.15 s was too much: whole-model prefill runs at ~0.68x the GEMM peak (smol-135m on the Xeon VM:
# 855 vs 1,266 tok/s), so 0.15 s priced took ~0.22 s, plus the decode batch: ITL p99 311 ms at the
# near-saturation rate of the peers run.
DECODE_FIRST_STEP_S = 0.10


class CpuPlatform(Platform):
    name = "cpu"

    def prepare_model(self, model, config: EngineConfig) -> None:
        """The prefill GEMM path of every projection, by this machine's measurement
        (kernels/cpu_gemm.py, cpu_policy.prefill_gemms)."""
        count, why = cpu_policy.mark_prefill_gemms(model, self.profile)
        logger.info("prefill GEMMs: %d projections marked (%s)", count, why)

    def prefill_cap(self, config: EngineConfig, cfg: ModelConfig) -> int | None:
        """The scheduler's prefill-token cap while sequences decode: the configured one, else the
        tokens the measured prefill GEMM rate computes in DECODE_FIRST_STEP_S (a multiple of the
        block size, at least 4 blocks: smaller chunks waste the GEMM)."""
        if config.max_prefill_tokens_while_decoding is not None:
            return config.max_prefill_tokens_while_decoding
        prof = self.profile
        fp32, narrow, _ = cpu_policy.prefill_gemms(prof)
        path = narrow if config.quantization is not None else fp32
        gflops = prof.gemm_gflops.get(cpu_policy.GEMM_RATE_KEY[path]) or prof.gemm_gflops.get("float32", 0.0)
        if gflops <= 0:
            return None
        tokens_per_s = gflops * 1e9 / (2 * cfg.num_params())
        blocks = max(4, int(tokens_per_s * DECODE_FIRST_STEP_S) // config.block_size)
        cap = min(config.max_num_batched_tokens, blocks * config.block_size)
        logger.info("decode-first: at most %d prefill tokens a step while sequences decode (measured GEMM %.0f "
                    "GFLOP/s ~ %.0f prefill tok/s x %.2f s)", cap, gflops, tokens_per_s, DECODE_FIRST_STEP_S)
        return cap

    def decode_step(self, model, forward, kv_caches, blocks, backend, config: EngineConfig, max_model_len: int):
        """The capture where --compile / CUDA graphs ask for it; none under --fuse (the FX-fused
        forward is the step); else the fused CPU layer loop."""
        if config.compile or config.cuda_graphs:
            return super().decode_step(model, forward, kv_caches, blocks, backend, config, max_model_len)
        if config.fuse:
            return None
        return CpuDecodeStep(model, kv_caches, config.block_size)

    def draft_decode_step(self, model, kv_caches, block_size: int) -> CpuDecodeStep:
        return CpuDecodeStep(model, kv_caches, block_size)

    def policy(self, config: EngineConfig, cfg: ModelConfig, threads: int, *, tensor_parallel: bool,
               speculative: bool, workload: str) -> StepPolicy:
        policy = StepPolicy(prefill_cap=start_up_cap(self, config, cfg, workload))
        if adaptive_threads.enabled() and not tensor_parallel:
            policy.tuners.append(adaptive_threads.AdaptiveThreads(threads, policy))
        multi_step.add_tuner(policy, config, tensor_parallel, speculative)
        if workload == "serving":
            decode_first.add_tuner(policy, config)
        return policy


def resolve_weight_storage(config: EngineConfig, checkpoint_dtype: torch.dtype, profile) -> EngineConfig:
    """bf16 weight storage with fp32 compute (memory/bf16_weights.py): asked for with
    quantization="bf16" (on any device), or chosen by dtype="auto" on a CPU for a bf16 checkpoint
    when the profile measured it faster (cpu_policy.bf16_storage). On a CPU, dtype="bfloat16" (a
    vLLM user's habit) gets the same narrow-weight kernels: bf16 weights (or the int8/int4 ones
    asked for) with fp32 activations, as exact as bf16 compute and faster (torch's bf16 GEMV at
    decode's few rows is ~2x slower than the kernels reading bf16 into fp32 registers), and a bf16
    KV cache unless another was asked for. Returns the config with dtype and quantization filled in."""
    fast_cpu = config.device == "cpu" and config.tensor_parallel_size == 1 and not config.compile
    if config.dtype == "bfloat16" and fast_cpu and cpu_bf16.available():
        kv = "bfloat16" if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
        logger.info("dtype bfloat16 on CPU: %s weights, fp32 activations, %s KV cache (the narrow-weight kernels; "
                    "bf16 compute would run torch's slower bf16 ops)", config.quantization or "bf16", kv)
        return dataclasses.replace(config, dtype="float32", quantization=config.quantization or "bf16",
                                   kv_cache_dtype=kv)
    if config.dtype == "auto" and config.quantization in ("int8", "int4") and fast_cpu and cpu_bf16.available():
        # the int8/int4 kernels take fp32 activations; a bf16 compute dtype would send every
        # projection through torch's dequantize-and-matmul instead (measured 20x slower at decode)
        logger.info("dtype auto with %s weights on CPU: fp32 activations (the quantised kernels)", config.quantization)
        return dataclasses.replace(config, dtype="float32")
    auto = config.dtype == "auto" and config.quantization is None and fast_cpu
    if not auto and config.quantization != "bf16":
        return config
    if not cpu_bf16.available():
        if config.quantization == "bf16":
            logger.warning("bf16 weights without numba: every projection widens its weight per call (slow)")
        return config
    use, prefill, why = cpu_policy.bf16_storage(profile, torch.bfloat16 if not auto else checkpoint_dtype)
    if auto and not use:
        logger.info("auto dtype: fp32 weights kept (%s)", why)
        return config
    logger.info("%s: bf16 weights, fp32 activations and KV cache; decode reads the weights narrow, "
                "prefill %s (%s)", "auto dtype" if auto else "quantization bf16", prefill, why)
    return dataclasses.replace(config, dtype="float32", quantization="bf16")
