"""Expert load of a mixture-of-experts run: hot experts and load imbalance, per layer and overall,
from the engine's per-expert token counts (LLMEngine.expert_token_counts, or the server's
strata_moe_expert_tokens_total). A router that sends most tokens to a few experts makes those
experts' weights the decode step's hot bytes, and under expert parallelism their rank the
straggler; balanced routing reads top_k / num_experts of the experts per token on average."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ExpertLoad:
    layers: int
    experts: int
    tokens: int  # (token, expert) assignments counted, all layers
    imbalance: dict[str, float]  # per layer: busiest expert's tokens / the mean (1.0 = even)
    hot: list[tuple[int, int, float]]  # (layer, expert, share of that layer's assignments), hottest first
    idle: int  # (layer, expert) pairs that received no token

    @property
    def worst(self) -> tuple[str, float]:
        return max(self.imbalance.items(), key=lambda kv: kv[1]) if self.imbalance else ("-", 0.0)


def expert_load(counts: dict, top: int = 5) -> ExpertLoad | None:
    """The load summary of {layer: [tokens per expert]} (keys int or str), None for a dense model
    or a run that routed nothing."""
    rows = {str(k): [int(n) for n in v] for k, v in counts.items() if v}
    total = sum(sum(v) for v in rows.values())
    if not rows or total == 0:
        return None
    imbalance, hot, idle = {}, [], 0
    for layer, v in rows.items():
        s = sum(v)
        if s == 0:
            continue
        imbalance[layer] = max(v) / (s / len(v))
        hot += [(int(layer), e, n / s) for e, n in enumerate(v)]
        idle += sum(1 for n in v if n == 0)
    hot.sort(key=lambda t: -t[2])
    return ExpertLoad(len(rows), max(len(v) for v in rows.values()), total, imbalance, hot[:top], idle)


def format_lines(load: ExpertLoad | None) -> list[str]:
    if load is None:
        return []
    layer, worst = load.worst
    mean = sum(load.imbalance.values()) / len(load.imbalance)
    out = [f"experts: {load.layers} MoE layers x {load.experts} experts, {load.tokens} routed (token, expert) pairs; "
           f"load imbalance (busiest / mean) {mean:.2f} on average, worst {worst:.2f} (layer {layer}); "
           f"{load.idle} experts received no token"]
    out += [f"  hot: layer {la} expert {e}: {share:.1%} of its layer's tokens" for la, e, share in load.hot]
    return out
