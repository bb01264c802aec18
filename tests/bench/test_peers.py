"""Pure logic of benchmarks/peers (parsing, ratios, rates, tables); builds and runs nothing."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"peers_{name}", ROOT / "benchmarks" / "peers" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def _peers(name: str):
    """benchmarks/peers/<name>.py as benchmarks.peers.<name> (the package's modules import each other)."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    return importlib.import_module(f"benchmarks.peers.{name}")


figures, tables, report = _peers("figures"), _peers("tables"), _peers("report")
convert = _load("convert_gguf")

# trimmed from a real `llama-bench -o json` run (two tests of one model), with a log line before it
BENCH_OUT = "some log line\n" + json.dumps([
    {"build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC", "backends": "CPU",
     "model_filename": "/cache/gguf/0.3.36/smol-135m-f32.gguf", "model_type": "llama ?B all F32",
     "n_threads": 2, "type_k": "f16", "flash_attn": -1, "n_prompt": 128, "n_gen": 0, "n_depth": 0,
     "avg_ns": 100, "stddev_ns": 2, "avg_ts": 1234.5, "stddev_ts": 10.5, "samples_ts": [1224.0, 1245.0]},
    {"build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC",
     "model_filename": "/cache/gguf/0.3.36/smol-135m-f32.gguf", "model_type": "llama ?B all F32",
     "n_threads": 2, "n_prompt": 0, "n_gen": 128, "n_depth": 128,
     "avg_ts": 61.25, "stddev_ts": 0.5, "samples_ts": [60.75, 61.75]},
])


def test_parse_llama_bench_and_pick() -> None:
    rows = figures.parse_llama_bench(BENCH_OUT)
    assert len(rows) == 2
    assert rows[0]["model"] == "smol-135m-f32.gguf" and rows[0]["avg_ts"] == 1234.5
    assert rows[0]["build_commit"] == "0c1e570" and rows[0]["samples_ts"] == [1224.0, 1245.0]
    pp = figures.pick_bench(rows, "smol-135m-f32.gguf", 128, 0, 0)
    tg = figures.pick_bench(rows, "smol-135m-f32.gguf", 0, 128, 128)
    assert pp["n_prompt"] == 128 and tg["avg_ts"] == 61.25
    assert figures.pick_bench(rows, "smol-135m-f32.gguf", 0, 128, 0) is None  # depth matters
    assert figures.pick_bench(rows, "other.gguf", 128, 0, 0) is None
    with pytest.raises(ValueError):
        figures.parse_llama_bench("no json here")


def test_ratio_rates_and_prompt_counts() -> None:
    assert figures.ratio(3.0, 2.0) == 1.5
    assert figures.ratio(None, 2.0) is None and figures.ratio(1.0, 0.0) is None
    assert figures.ratio(math.nan, 1.0) is None
    rates = figures.derive_rates(2.0)
    assert list(rates) == ["low", "near", "over"]
    assert rates == {"low": 0.6, "near": 1.8, "over": 3.0}
    assert rates["low"] < rates["near"] < 2.0 < rates["over"]
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            figures.derive_rates(bad)
    assert figures.prompts_for_rate(0.2, 80, 12, 64) == 16
    assert figures.prompts_for_rate(0.01, 80, 12, 64) == 12  # at least lo
    assert figures.prompts_for_rate(5.0, 80, 12, 64) == 64  # at most hi


def test_latency_table_ratios() -> None:
    sr = {
        "strata_fp32": {"prefill_tps": 1000.0, "decode_tps": 40.0},
        "llama_f32": {"prefill_tps": 2000.0, "decode_tps": 50.0},
        "hf_fp32": {"prefill_tps": 500.0, "decode_tps": 16.0},
        "strata_int8": {"prefill_tps": 900.0, "decode_tps": 90.0},
        "llama_q8_0": {"prefill_tps": 1800.0, "decode_tps": 100.0},
    }
    table = tables.latency_table(sr).splitlines()
    assert table[0].startswith("| engine | weights | prefill tok/s")
    llama = next(r for r in table if r.startswith("| llama.cpp | f32"))
    assert "| 0.50x | 0.80x |" in llama  # Strata ÷ llama.cpp: prefill 1000/2000, decode 40/50
    hf = next(r for r in table if r.startswith("| transformers"))
    assert "| 2.00x | 2.50x |" in hf
    q8 = next(r for r in table if "q8_0" in r)
    assert "| 0.50x | 0.90x |" in q8  # against Strata int8, not fp32
    assert "| 25 |" in table[2]  # decode ms/token = 1000 / 40
    assert not any("f16" in r for r in table)  # not measured, no row


def test_throughput_and_serving_tables() -> None:
    tp = {
        "strata_offline": {"requests": 64, "elapsed_s": 80.0, "rps": 0.8, "output_tps": 115.0, "total_tps": 300.0},
        "hf_static": {"requests": 64, "elapsed_s": 200.0, "rps": 0.32, "output_tps": 46.0, "total_tps": 120.0,
                      "batch_size": 16},
        "strata_http": {"requests": 64, "elapsed_s": 90.0, "rps": 0.71, "output_tps": 100.0, "total_tps": 270.0,
                        "short_outputs": 0},
        "llama_http": {"requests": 64, "elapsed_s": 45.0, "rps": 1.42, "output_tps": 200.0, "total_tps": 540.0,
                       "short_outputs": 0, "slots": 16},
    }
    t = tables.throughput_table(tp)
    assert "static batches of 16" in t and "-np 16" in t
    assert "| 2.50x |" in t  # 115 / 46
    assert "| 0.50x |" in t  # 100 / 200
    runs = [dict(tp["llama_http"]), dict(tp["llama_http"], slots=64, output_tps=80.0)]
    t2 = tables.throughput_table(dict(tp, llama_http_runs=runs)).splitlines()
    np16 = next(r for r in t2 if "-np 16" in r)
    np64 = next(r for r in t2 if "-np 64" in r)
    assert "best slot count" in np16 and "| 0.50x |" in np16
    assert "best slot count" not in np64 and "| 1.25x |" in np64  # 100 / 80
    point = {"name": "low", "rate": 0.2, "num_prompts": 16}
    fig = {"completed": 16, "rps": 0.2, "output_tps": 30.0, "ttft_ms": {"p50": 200.0, "p99": 900.0},
           "tpot_ms": {"p50": 50.0, "p99": 80.0}, "itl_ms": {"p50": 48.0, "p99": 120.0}, "goodput": 0.2,
           "good_requests": 16}
    slow = dict(fig, ttft_ms={"p50": 400.0, "p99": 900.0}, itl_ms={"p50": 50.0, "p99": 360.0}, goodput=0.1,
                good_requests=8)
    s = tables.serving_table([dict(point, strata=slow, llama=fig)])
    assert "ITL p99 ms" in s.splitlines()[0]
    ratio_row = next(r for r in s.splitlines() if "Strata ÷ llama.cpp" in r)
    assert "| 2.00x |" in ratio_row and "| 0.50x |" in ratio_row  # TTFT p50 400/200; goodput 0.1/0.2
    assert "| 3.00x |" in ratio_row  # ITL p99 360/120
    tag = "smol serving at 0.2 req/s (low), ITL p99 vs llama.cpp: Strata ÷ peer = 3.00x"
    assert f"Strata behind: {tag}" in tables.findings({"serving": {"smol": {"points": [
        dict(point, strata=slow, llama=fig)]}}})
    assert "low (0.2 req/s, 16 req)" in s and "16/16" in s


def test_findings_and_markdown() -> None:
    res = {
        "date": "2026-01-01", "workload": {"lat_in": 128, "lat_out": 128},
        "latency": {"smol-135m": {"strata_fp32": {"prefill_tps": 1000.0, "decode_tps": 40.0},
                                  "llama_f32": {"prefill_tps": 2000.0, "decode_tps": 20.0}}},
        "commands": [{"part": "latency", "cmd": "strata bench latency --random-model smol-135m"}],
        "errors": [{"part": "serving smol-135m", "error": "boom"}],
    }
    f = tables.findings(res)
    assert f[0].startswith("Strata behind: smol-135m batch-1 prefill") and "0.50x" in f[0]
    assert any(x.startswith("Strata ahead or even: smol-135m batch-1 decode") and "2.00x" in x for x in f)
    md = report.render_markdown(res)
    assert md.startswith("# Peer benchmarks")
    assert "### smol-135m" in md and "strata bench latency --random-model smol-135m" in md
    assert "serving smol-135m: boom" in md


def test_fmt_and_md_table() -> None:
    assert tables.fmt_num(None) == "-" and tables.fmt_num(math.nan) == "-"
    assert tables.fmt_num(1234.56) == "1,235" and tables.fmt_num(12.345) == "12.3" and tables.fmt_num(7) == "7"
    t = tables.md_table(["a", "b"], [["x", 1.5]]).splitlines()
    assert t == ["| a | b |", "| :-- | --: |", "| x | 1.5 |"]


def test_converter_pre_tokenizer_check() -> None:
    spec = json.loads((ROOT / "strata" / "demo" / "tokenizer.json").read_text(encoding="utf-8"))
    convert.check_gpt2_pre_tokenizer(spec)  # the demo tokenizer (and so the random models') passes
    for bad in ({"pre_tokenizer": {"type": "Metaspace"}}, {"pre_tokenizer": {"type": "ByteLevel", "use_regex": False}},
                {"normalizer": {"type": "NFC"}}):
        with pytest.raises(ValueError):
            convert.check_gpt2_pre_tokenizer({**spec, **bad})


def test_merge_previous_keeps_skipped_parts(tmp_path: Path) -> None:
    prev = {
        "date": "2026-01-01", "quick": False,
        "latency": {"smol-135m": {"strata_fp32": {"decode_tps": 1.0}}, "qwen-0.5b": {"strata_fp32": {}}},
        "throughput": {"smol-135m": {"strata_offline": {"output_tps": 2.0}}}, "serving": {},
        "commands": [{"part": "latency", "cmd": "strata bench latency --random-model qwen-0.5b"},
                     {"part": "latency", "cmd": "strata bench latency --random-model smol-135m"},
                     {"part": "throughput", "cmd": "strata bench throughput --random-model smol-135m"}],
    }
    path = tmp_path / "results.json"
    path.write_text(json.dumps(prev))
    new = {"date": "2026-02-02", "quick": False, "parts": ["latency"], "commands": [],
           "latency": {"smol-135m": {"strata_fp32": {"decode_tps": 3.0}}}, "throughput": {}, "serving": {}}
    report.merge_previous(new, path, ["smol-135m"], [])
    assert new["latency"]["smol-135m"]["strata_fp32"]["decode_tps"] == 3.0  # this run wins
    assert new["latency"]["qwen-0.5b"]["measured_on"] == "2026-01-01"  # kept, dated
    assert new["throughput"]["smol-135m"]["strata_offline"]["output_tps"] == 2.0
    assert new["latency"]["smol-135m"]["measured_on"] == "2026-02-02"
    cmds = [c["cmd"] for c in new["commands"]]
    assert "strata bench latency --random-model qwen-0.5b" in cmds
    assert "strata bench latency --random-model smol-135m" not in cmds  # re-measured: old command dropped
    assert len(new["kept_from_previous"]) == 2
    # neither run names its CPU here: both "?", so nothing is flagged
    assert all("another CPU" not in k for k in new["kept_from_previous"])


def test_merge_previous_names_the_cpu_of_a_carried_over_table(tmp_path: Path) -> None:
    """The dev machines change CPU between sessions: a table kept from a run on another CPU says so."""
    prev = {"date": "2026-01-01", "quick": False, "machine": {"cpu_model": "AMD EPYC", "cpu_note": "family 25 model 17"},
            "latency": {}, "serving": {}, "throughput": {"smol-135m": {"strata_offline": {}}}, "commands": []}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(prev))
    new = {"date": "2026-02-02", "quick": False, "parts": ["latency"], "commands": [],
           "machine": {"cpu_model": "AMD EPYC", "cpu_note": "family 26 model 2"},
           "latency": {"smol-135m": {}}, "throughput": {}, "serving": {}}
    report.merge_previous(new, path, ["smol-135m"], [])
    assert new["throughput"]["smol-135m"]["measured_cpu"] == "AMD EPYC (family 25 model 17)"
    assert new["latency"]["smol-135m"]["measured_cpu"] == "AMD EPYC (family 26 model 2)"
    [kept] = new["kept_from_previous"]
    assert "on AMD EPYC (family 25 model 17), **another CPU than this run's (AMD EPYC (family 26 model 2))**" in kept
    prev["machine"] = new["machine"]  # the same CPU: not flagged
    path.write_text(json.dumps(prev))
    new.update(throughput={}, kept_from_previous=[])
    report.merge_previous(new, path, ["smol-135m"], [])
    assert "another CPU" not in new["kept_from_previous"][0]


@pytest.mark.parametrize("message, signal", [
    ("`llama-bench ...` failed (rc -4); last lines", "SIGILL"),
    ("`llama-bench ...` failed (rc -11); last lines", "SIGSEGV"),  # ggml_backend_amx_mul_mat, a Xeon VM
    ("`sh -c llama-bench` failed (rc 139); last lines", "SIGSEGV"),
    ("`sh -c llama-bench` failed (rc 132); Illegal instruction", "SIGILL"),
    ("`llama-bench ...` failed (rc 1); last lines: error loading model", None),
    ("`llama-bench ...` failed (rc -1); last lines", None),
])
def test_verify_crash_signal_decides_the_no_amx_rebuild(message, signal):
    assert _peers("build")._crash_signal(message) == signal


def test_llama_latency_figure_is_the_mean_of_the_runs_bracketing_strata():
    parts, settings = _peers("parts"), _peers("settings")
    assert parts.bracketed({"avg_ts": 10.0}, {"avg_ts": 14.0}, "avg_ts") == (12.0, [10.0, 14.0])
    assert parts.bracketed(None, {"avg_ts": 14.0}, "avg_ts") == (14.0, [14.0])  # one run failed
    assert parts.bracketed({"avg_ts": None}, None, "avg_ts") == (None, [])
    # every GGUF type the run prepares is bracketed around exactly one Strata format
    paired = [t for _, _, types in parts.LATENCY_PAIRS for t in types]
    assert sorted(paired) == sorted(settings.GGUF_TYPES)


def test_latency_rounds_take_the_median_and_show_every_round():
    parts, tables = _peers("parts"), _peers("tables")
    rounds = [
        {"strata_fp32": {"prefill_tps": 500.0, "decode_tps": 50.0, "others_cpu": 1.0},
         "llama_f32": {"prefill_tps": 400.0, "decode_tps": 55.0, "others_cpu": 0.0}},
        {"strata_fp32": {"prefill_tps": 600.0, "decode_tps": 40.0, "others_cpu": 5.0},
         "llama_f32": {"prefill_tps": 500.0, "decode_tps": 40.0, "others_cpu": None}},
        {"strata_fp32": {"prefill_tps": 550.0, "decode_tps": 60.0, "others_cpu": 2.0}},  # llama's failed
    ]
    merged = parts.median_rounds(rounds)
    s, ll = merged["strata_fp32"], merged["llama_f32"]
    assert (s["prefill_tps"], s["decode_tps"], s["others_cpu"]) == (550.0, 50.0, 5.0)
    assert (ll["prefill_tps"], ll["decode_tps"], ll["others_cpu"]) == (450.0, 47.5, 0.0)
    assert len(s["round_figures"]) == 3 and len(ll["round_figures"]) == 2
    # rounds pair in order; the ratio is the median of the paired rounds' ratios (not the ratio of
    # the medians, which round 3's unpaired Strata figure would move: 50 / 47.5), with every round's
    assert tables.round_ratios(s, ll, "decode_tps") == [50.0 / 55.0, 1.0]
    assert tables.latency_ratio(s, ll, "decode_tps") == (50.0 / 55.0 + 1.0) / 2
    table = tables.latency_table(merged)
    assert f"{(500 / 400 + 600 / 500) / 2:.2f}x (rounds {500 / 400:.2f}, {600 / 500:.2f})" in table
    assert f"{(50 / 55 + 1) / 2:.2f}x (rounds {50 / 55:.2f}, 1.00)" in table
    # one round: the figures as measured, no round figures, no range
    single = parts.median_rounds(rounds[:1])
    assert single["llama_f32"]["decode_tps"] == 55.0 and "round_figures" not in single["llama_f32"]
    assert "(" not in tables.latency_table(single).splitlines()[-1].split("|")[6]


def test_latency_ratio_counts_every_round_and_shows_the_steady_view_beside_it():
    parts, tables = _peers("parts"), _peers("tables")
    assert parts.steady([100.0, 109.0]) is True and parts.steady([99.5, 114.0]) is False
    assert parts.steady([100.0]) is None and parts.steady(None) is None
    rounds = [  # round 2's llama.cpp runs straddled a bandwidth switch (99.5 before, 114 after)
        {"strata_fp32": {"decode_tps": 110.0}, "llama_f32": {"decode_tps": 100.0, "decode_tps_runs": [98.0, 102.0]}},
        {"strata_fp32": {"decode_tps": 86.0}, "llama_f32": {"decode_tps": 106.75, "decode_tps_runs": [99.5, 114.0]}},
        {"strata_fp32": {"decode_tps": 120.0}, "llama_f32": {"decode_tps": 100.0, "decode_tps_runs": [100.0, 100.0]}},
    ]
    merged = parts.median_rounds(rounds)
    s, ll = merged["strata_fp32"], merged["llama_f32"]
    assert [f.get("decode_steady") for f in ll["round_figures"]] == [True, False, True]
    assert tables.round_ratios(s, ll, "decode_tps") == [1.1, 86.0 / 106.75, 1.2]
    assert tables.steady_round_ratios(s, ll, "decode_tps") == [1.1, 1.2]
    assert tables.latency_ratio(s, ll, "decode_tps") == 1.1
    assert f"1.10x (rounds 1.10, {86.0 / 106.75:.2f}, 1.20) [steady 1.15x, 2/3]" in tables.latency_table(merged)
    # a median >= 1 with a round below 0.95x is not a win
    assert tables.row_won(s, ll, "decode_tps") is False
    assert any(f.startswith("Strata behind: ") and "decode tok/s" in f
               for f in tables.findings({"latency": {"smol-135m": merged}}))
    # no steady round at all: every round counts, nothing is marked
    for r in rounds:
        r["llama_f32"]["decode_tps_runs"] = [90.0, 110.0]
    merged = parts.median_rounds(rounds)
    assert tables.round_ratios(merged["strata_fp32"], merged["llama_f32"], "decode_tps") == [1.1, 86.0 / 106.75, 1.2]
    assert "steady" not in tables.latency_table(merged)


def test_a_row_is_won_only_with_its_median_at_1x_and_no_round_below_095x():
    tables = _peers("tables")

    def row(*ratios):  # Strata's figure over a peer at 100 in each round
        return ({"round_figures": [{"decode_tps": 100.0 * r} for r in ratios]},
                {"round_figures": [{"decode_tps": 100.0, "decode_steady": True} for _ in ratios]})

    assert tables.row_won(*row(1.02, 0.96, 1.10), "decode_tps") is True
    assert tables.row_won(*row(1.02, 0.94, 1.10), "decode_tps") is False  # one round under 0.95x
    assert tables.row_won(*row(0.99, 0.98, 1.10), "decode_tps") is False  # median under 1.0x
    assert tables.row_won({"decode_tps": 110.0}, {"decode_tps": 100.0}, "decode_tps") is True  # one round
