"""`strata bench preempt`: an oversubscribed KV cache completes in both modes with outputs unchanged."""

from __future__ import annotations

import json

import pytest

from strata.cli import main


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))


def test_preempt_recompute_and_swap_keep_outputs(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main([
        "bench", "preempt", "--random-model", "tiny", "--dtype", "float32", "--threads", "1",
        "--num-prompts", "5", "--input-len", "48:96", "--output-len", "16", "--kv-fraction", "0.3",
        "--json", str(out),
    ])
    assert rc == 0
    results = json.loads(out.read_text())["results"]
    for mode in ("recompute", "swap"):
        assert results[mode]["identical_to_reference"] is True
        assert results[mode]["preemptions"] > 0
    assert results["swap"]["blocks_swapped_out"] > 0
    assert results["recompute"]["blocks_swapped_out"] == 0
    assert "outputs identical" in capsys.readouterr().out
