"""The routing overhead of a mixture-of-experts layer, measured on `this` device (cost_model.Routing).

A decode step's MoE layer costs its experts' weight reads and FLOPs (priced like any projection)
plus what no byte or FLOP count sees: the router GEMV, softmax / top-k, the sort of the rows by
expert, and per expert visited the dispatch (gathering its rows, its kernel calls, the weighted
scatter back: graph/moe.py runs expert by expert). The probe times the engine's own MoEBlock at
the model's hidden size, expert count and top_k, stored as the engine stores it, with experts
PROBE_WIDTH wide (their weight stream is then negligible: what is left is the dispatch), for
decode batches of PROBE_BATCHES rows (the median of REPEATS steps each), counts the distinct experts
each batch's random rows picked, and fits seconds = fixed + per_expert x distinct experts (the
median slope from the batch-1 point: a shared VM slowed single points 5-10x in a run).

Where the decode probe (decode_probe.py) times the model's layers, the routing is inside its
times and this is not added; it prices decode where the rates do (a model too large to time).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics

import torch

from strata.graph.moe import MoEBlock
from strata.model_config import ModelConfig
from strata.planner.cost_model import Routing
from strata.planner.decode_probe import store_like_engine
from strata.planner.layer_probe import median_seconds

logger = logging.getLogger(__name__)

PROBE_BATCHES = (1, 4, 16, 64)
PROBE_WIDTH = 32  # expert width: int4's smallest group, so every weight format builds
WARMUP, REPEATS = 3, 15

_CACHE: dict[tuple, Routing] = {}


def fit_routing(experts: list[float], seconds: list[float], source: str) -> Routing:
    """seconds = fixed + per_expert x experts: the slope the median of those from the first point
    to each other one (one step slowed by a neighbour moves one slope, not the fit), both >= 0."""
    x0, y0 = experts[0], seconds[0]
    slopes = [(y - y0) / (x - x0) for x, y in zip(experts[1:], seconds[1:]) if x > x0]
    slope = max(0.0, statistics.median(slopes)) if slopes else 0.0
    return Routing(max(0.0, y0 - slope * x0), slope, source)


@torch.inference_mode()
def _measure(cfg: ModelConfig, dtype: torch.dtype, quantization: str | None, group: int, device: str) -> Routing:
    dev = torch.device(device)
    moe = dataclasses.replace(cfg.moe, intermediate_size=PROBE_WIDTH, shared_intermediate_size=0)
    torch.manual_seed(0)
    with dev:
        block = MoEBlock(cfg.hidden_size, moe, cfg.hidden_act).to(dtype).eval()
    for p in block.parameters():  # N(0, 0.02): unit-variance rows then pick varied experts, as real ones do
        p.normal_(0.0, 0.02)
    block.reset_token_counts(dev)
    store_like_engine(block, quantization, group, device)
    experts, seconds = [], []
    for b in PROBE_BATCHES:
        x = torch.randn(b, cfg.hidden_size, device=dev, dtype=dtype)
        experts.append(float(block.gate(x)[2].unique().numel()))
        seconds.append(median_seconds(lambda x=x: block(x), dev, REPEATS, WARMUP))
    routing = fit_routing(experts, seconds, f"measured here (moe_probe.py: MoEBlock at {cfg.moe.num_experts} "
                          f"experts, top {cfg.moe.top_k}, batches {list(PROBE_BATCHES)})")
    logger.info("moe probe: %s ms at %s distinct experts -> %.1f us a layer + %.1f us an expert",
                [f"{s * 1e3:.3f}" for s in seconds], experts, routing.fixed_s * 1e6, routing.per_expert_s * 1e6)
    return routing


def measure_routing(cfg: ModelConfig, dtype: torch.dtype, quantization: str | None = None, group: int = 64,
                    device: str = "cpu") -> Routing:
    """The routing cost of cfg's MoE layers in the engine's weight format (cached per process)."""
    key = (cfg.hidden_size, cfg.moe.num_experts, cfg.moe.top_k, cfg.hidden_act, dtype, quantization, group, device)
    if key not in _CACHE:
        _CACHE[key] = _measure(cfg, dtype, quantization, group, device)
    return _CACHE[key]
