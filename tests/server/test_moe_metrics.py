"""Per-expert token counts of an MoE model: the metrics layer's counters, a served model's /metrics
(parsed as a scraper does), and the analyzer's load summary."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from strata.analyze.analyze_moe import expert_load, format_lines
from strata.analyze.analyze_serve import expert_counts, scrape
from strata.protocol.stats import EngineStats
from strata.server.metrics import Metrics
from tests.server.serverproc import start_server


def _expert_samples(text: str) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "strata_moe_expert_tokens_total":
                out[(s.labels["layer"], s.labels["expert"])] = s.value
                assert s.labels["model_name"] == "m"
    return out


def test_counters_advance_by_what_changed():
    m = Metrics("m")
    m.on_engine_stats(EngineStats(expert_tokens={"0": [3, 0, 1], "2": [1, 1, 1]}))
    m.on_engine_stats(EngineStats(expert_tokens={"0": [5, 0, 1], "2": [1, 4, 1]}))
    got = _expert_samples(m.render().decode())
    assert got == {("0", "0"): 5, ("0", "2"): 1, ("2", "0"): 1, ("2", "1"): 4, ("2", "2"): 1}


def test_load_summary_names_hot_experts_and_imbalance():
    load = expert_load({0: [90, 5, 5, 0], 1: [25, 25, 25, 25]})
    assert load.layers == 2 and load.tokens == 200 and load.idle == 1
    assert load.imbalance == {"0": 3.6, "1": 1.0}
    assert load.hot[0] == (0, 0, 0.9)
    text = "\n".join(format_lines(load))
    assert "worst 3.60 (layer 0)" in text and "layer 0 expert 0: 90.0%" in text
    assert expert_load({}) is None and format_lines(None) == []


def test_a_served_moe_model_exports_expert_counts(tiny_models, text_model):
    model = tiny_models["qwen3moe"]
    server = start_server("--model", str(model.path), "--tokenizer", str(text_model.path), "--served-model-name",
                          "m", "--max-model-len", "96", "--kv-cache-memory", "1MiB")
    try:
        r = server.post("/v1/completions", json={"model": "m", "prompt": [5, 6, 7, 8, 9], "max_tokens": 4,
                                                 "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        for _ in range(50):  # the engine reports with each step and each second when idle
            if _expert_samples(httpx.get(server.url + "/metrics", timeout=10).text):
                break
            time.sleep(0.2)
        counts = expert_counts(scrape(server.url))
        assert set(counts) == {"0", "1"}
        assert all(sum(c) == (5 + 3) * 3 for c in counts.values())  # prompt + fed-back tokens, top 3 each
    finally:
        server.stop()
