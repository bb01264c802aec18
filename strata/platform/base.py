"""What a platform supplies the engine's build: the decode step, the kernel policy and the tuners.

build_engine picks one platform per engine from the device and the hardware profile it was given
(probed once, before the build; bf16 weight storage is decided before, by
platform/cpu.resolve_weight_storage from the same profile) and asks it, in the build's order:

    prepare_model(model)                               kernel marks on the weights (CPU: prefill GEMMs)
    prefill_cap(config, model config)                  the decode-first cap at start-up
    decode_step(model, kv caches, ...)                 graph/decode_step.py's step, or None
    policy(config, threads, ..., workload)             the StepPolicy with its tuners; workload:
                                                       "offline" (LLM.generate), "streaming" (an
                                                       engine driven step by step) or "serving"

The base class is the plain platform every device has: no kernel policy, the torch.compile / CUDA
graph capture where asked, fixed policy values.
"""

from __future__ import annotations

from strata.config import EngineConfig
from strata.graph.capture import build_decode_capture
from strata.graph.decode_step import DecodeStep
from strata.hardware.profile import HardwareProfile
from strata.model_config import ModelConfig
from strata.platform.policy import StepPolicy


class Platform:
    name = "generic"

    def __init__(self, profile: HardwareProfile | None = None) -> None:
        self.profile = profile

    def prepare_model(self, model, config: EngineConfig) -> None:
        """After quantisation and sharding (which replace the weight tensors)."""

    def prefill_cap(self, config: EngineConfig, cfg: ModelConfig) -> int | None:
        return config.max_prefill_tokens_while_decoding

    def decode_step(self, model, forward, kv_caches, blocks, backend, config: EngineConfig,
                    max_model_len: int) -> DecodeStep | None:
        """The decode step under torch.compile and/or CUDA graphs (None when neither is asked)."""
        if not (config.compile or config.cuda_graphs):
            return None
        return build_decode_capture(
            model, forward, kv_caches, backend=backend, scratch_block=blocks.scratch_block,
            block_size=config.block_size, max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
            device=config.device, compile=config.compile, cuda_graphs=config.cuda_graphs,
        )

    def draft_decode_step(self, model, kv_caches, block_size: int) -> DecodeStep | None:
        """A draft model's decode step (its runner captures nothing)."""
        return None

    def policy(self, config: EngineConfig, cfg: ModelConfig, threads: int, *, tensor_parallel: bool,
               speculative: bool, workload: str) -> StepPolicy:
        return StepPolicy(lookahead=config.num_scheduler_steps or 1, prefill_cap=start_up_cap(self, config, cfg, workload))


WORKLOADS = ("offline", "streaming", "serving")


def start_up_cap(platform: Platform, config: EngineConfig, cfg: ModelConfig, workload: str) -> int | None:
    """The decode-first cap an engine starts with. Offline (`LLM.generate`) every prompt is known up
    front and nobody watches tokens stream: no cap unless the user set one, as the cap would only
    shrink the GEMMs (smol-135m fp32, 64 requests, `strata bench throughput`, Zen 4: 117-128 output
    tok/s with the cap vs 138-144 without; vLLM likewise gives its LLM class a larger step budget
    than its server). Streaming and serving: the platform's prefill_cap."""
    if workload == "offline":
        return config.max_prefill_tokens_while_decoding
    return platform.prefill_cap(config, cfg)
