"""`strata bench prefix` end to end on the tiny random model."""

from __future__ import annotations

import json

import pytest

from strata.cli import main


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))


def test_prefix_bench_writes_json(tmp_path, capsys):
    out = tmp_path / "prefix.json"
    rc = main([
        "bench", "prefix", "--random-model", "tiny", "--dtype", "float32", "--threads", "1",
        "--num-prompts", "4", "--prefix-len", "48", "--suffix-len", "4:9", "--output-len", "3",
        "--json", str(out),
    ])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "prefix cache on" in printed and "prefix cache off" in printed and "warm-up" in printed
    data = json.loads(out.read_text())
    on, off = data["cache"], data["no_cache"]
    assert on["prefix_caching"] is True and off["prefix_caching"] is False
    assert on["requests"] == off["requests"] == 4
    assert on["blocks_hit"] == 4 * 3 and on["hit_rate"] == 1.0  # 48 tokens = 3 blocks per request
    assert off["blocks_hit"] == 0 and off["prompt_tokens_computed"] == data["prompt_tokens"]
    assert on["prompt_tokens_computed"] == data["prompt_tokens"] - 4 * 48
    for run in (on, off):
        assert 0 < run["ttft_p50_s"] <= run["ttft_p90_s"] <= run["ttft_max_s"]
    assert set(data["ratio"]) >= {"ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "elapsed_s"}


def test_prefix_bench_refuses_contradicting_flags(capsys):
    assert main(["bench", "prefix", "--random-model", "tiny", "--no-prefix-caching"]) == 2
    assert "--no-prefix-caching" in capsys.readouterr().err
    assert main(["bench", "prefix", "--random-model", "tiny", "--suffix-len", "0:3"]) == 2
    assert "--suffix-len" in capsys.readouterr().err
