"""`strata bench structured` and `strata bench spec` end to end on the demo model (small lengths)."""

from __future__ import annotations

import json

from strata.cli import main


def test_bench_structured_writes_its_figures(tmp_path, capsys):
    out = tmp_path / "s.json"
    rc = main(["bench", "structured", "--dtype", "float32", "--threads", "1", "--batch-sizes", "1,2",
               "--input-len", "4", "--output-len", "6", "--repeats", "1", "--schemas", "2",
               "--engines", "llguidance", "--json", str(out)])
    assert rc == 0
    assert "overhead" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [r["batch"] for r in data["overhead"]] == [1, 2]
    assert all(r["tpot_plain_ms"] > 0 and r["tpot_constrained_ms"] > 0 for r in data["overhead"])
    assert data["compile"]["schemas"] == 2 and data["compile"]["compile_ms_median"] > 0
    assert data["engines"][0]["engine"] == "llguidance" and data["engines"][0]["mask_us_mean"] > 0


def test_bench_spec_reports_identical_tokens(tmp_path, capsys):
    out = tmp_path / "sp.json"
    rc = main(["bench", "spec", "--dtype", "float32", "--threads", "1", "--input-len", "48", "--echo-len", "8",
               "--output-len", "12", "--prompts", "1", "--repeats", "1", "--json", str(out)])
    assert rc == 0
    assert "speedup" in capsys.readouterr().out
    data = json.loads(out.read_text())
    for name in ("repetitive", "random"):
        w = data["workloads"][name]
        assert w["identical_tokens"] and w["decode_tok_s_off"] > 0 and w["decode_tok_s_on"] > 0
    assert main(["bench", "spec", "--echo-len", "0"]) == 2  # a bad flag is a one-line error
