"""EngineStats: the engine's load and counters, as `LLMEngine.stats()` reports them and the server's
engine process sends them to the front end (with every step, and each second when idle)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """The engine's latest report (sent with every step, and each second when idle)."""

    running: int = 0
    waiting: int = 0
    swapped: int = 0
    kv_usage: float = 0.0
    kv_reserved_bytes: int = 0
    kv_owned_bytes: int = 0
    kv_token_bytes: int = 0
    kv_waste_bytes: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_evictions: int = 0
    steps: int = 0
    stage_seconds: dict = field(default_factory=dict)
    spec_steps: int = 0  # speculative decoding (engine/speculative.SpecStats): sequence-steps verifying
    spec_drafted: int = 0  # a draft, draft tokens, those accepted, tokens those steps produced
    spec_accepted: int = 0
    spec_emitted: int = 0
    prefill_cap: int = 0  # decode-first: prefill tokens a step may take while sequences decode (0: no cap)
    expert_tokens: dict = field(default_factory=dict)  # MoE: {"layer": [tokens each expert received]}
    lora_running: tuple = ()  # LoRA adapters (names) of the running requests / the waiting ones
    lora_waiting: tuple = ()
    max_loras: int = 0  # adapters one batch may hold (0: LoRA off)
