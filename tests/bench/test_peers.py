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


# ----------------------------------------------------------------------------------------------
# the big shapes, peak RSS and the depth rows (issue 43, item 2)


def test_shape_selection_and_the_big_shapes_plans():
    settings, parts, pipeline = _peers("settings"), _peers("parts"), _peers("pipeline")
    assert set(settings.DEFAULT_SHAPES) <= set(settings.ALL_SHAPES)
    assert "llama-3.2-3b" in settings.DEFAULT_SHAPES and "llama-3.1-8b" not in settings.DEFAULT_SHAPES  # opt-in
    assert settings.parse_shapes("qwen-0.5b, llama-3.2-3b,qwen-0.5b") == ["qwen-0.5b", "llama-3.2-3b"]
    with pytest.raises(ValueError, match="llama-9b"):
        settings.parse_shapes("smol-135m,llama-9b")
    assert settings.parse_depths("16k,0,4096,4k") == [0, 4096, 16384]
    with pytest.raises(ValueError):
        settings.parse_depths("-1")
    # GGUFs: the small shapes every type; the 3B bf16 + llama-quantize's q8_0 / q4_0 from it; the 8B
    # q4_0 alone, its bf16 GGUF an intermediate that is deleted
    assert settings.gguf_types("qwen-0.5b") == settings.GGUF_TYPES
    assert settings.gguf_plan("llama-3.2-3b") == (("bf16",), {"q8_0": "bf16", "q4_0": "bf16"}, ())
    assert settings.gguf_plan("llama-3.1-8b") == (("bf16",), {"q4_0": "bf16"}, ("bf16",))
    assert settings.gguf_types("llama-3.1-8b") == ("q4_0",)
    assert "llama-3.1-8b" not in settings.DEPTH_CAPABLE and "qwen-0.5b" in settings.DEPTH_CAPABLE
    # rows per shape: the big ones no fp32 / transformers row, one GGUF per Strata format
    pairs = {s: [(tag, types) for tag, _, types in parts.latency_pairs(s, settings.gguf_types(s))]
             for s in settings.ALL_SHAPES}
    assert pairs["qwen-0.5b"] == [(t, ty) for t, _, ty in parts.LATENCY_PAIRS]
    assert pairs["llama-3.2-3b"] == [("bf16", ("bf16",)), ("int8", ("q8_0",)), ("int4", ("q4_0",))]
    assert pairs["llama-3.1-8b"] == [("int4", ("q4_0",))]
    # the MoE shape: bf16-sharded, yet every format (its fp32 copy fits), f32 + bf16 GGUFs, q8_0 / q4_0 from bf16
    assert "qwen3-moe-2b" in settings.BIG_SHAPES and "qwen3-moe-2b" not in settings.DEFAULT_SHAPES
    assert settings.gguf_plan("qwen3-moe-2b") == (("f32", "bf16"), {"q8_0": "bf16", "q4_0": "bf16"}, ())
    assert pairs["qwen3-moe-2b"] == [("fp32", ("f32",)), ("bf16", ("bf16",)), ("int8", ("q8_0",)), ("int4", ("q4_0",))]
    # the big shapes' own tokens, repetitions and rounds
    args = pipeline.argparse.Namespace(latency_rounds=3, big_latency_rounds=2)
    small, big = parts.latency_plan("qwen-0.5b", settings.FULL, args), parts.latency_plan("llama-3.2-3b", settings.FULL, args)
    assert (small["lat_out"], small["rounds"], small["repeats"]) == (128, 3, settings.STRATA_REPEATS)
    assert (big["lat_out"], big["rounds"], big["bench_reps"], big["repeats"]) == (64, 2, 2, 2)


def test_selection_of_parts_and_shapes_from_the_command_line():
    peers, pipeline = _peers("peers"), _peers("pipeline")
    a = peers.parse_args([])
    parts, lat, depth, load = pipeline.selection(a)
    assert parts == ["latency", "depth", "throughput", "serving"]
    assert lat == ["smol-135m", "qwen-0.5b", "llama-3.2-3b"] and depth == ["qwen-0.5b"] and load == ["smol-135m"]
    assert a.depth_rounds == 1 and a.big_latency_rounds == 2 and a.depth_bracket is False and a.depths is None
    a = peers.parse_args(["--only", "latency", "--shapes", "llama-3.1-8b"])
    assert pipeline.selection(a) == (["latency"], ["llama-3.1-8b"], [], [])
    a = peers.parse_args(["--only", "depth,serving"])
    assert pipeline.selection(a) == (["depth", "serving"], [], ["qwen-0.5b"], ["smol-135m"])
    for bad in (["--shapes", "llama-9b"], ["--depth-shapes", "llama-3.1-8b"], ["--load-shapes", "llama-3.2-3b"],
                ["--depths", "4k,x"], ["--depth-rounds", "0"], ["--only", "depthx"]):
        with pytest.raises(SystemExit):
            peers.parse_args(bad)


def test_peak_rss_of_a_command_is_its_own_not_this_process(tmp_path):
    runner = _peers("runner")
    assert runner.parse_time_rss("Command exited with non-zero status 3\n1504\n") == 1504 * 1024
    assert runner.parse_time_rss("") is None
    ballast = bytearray(200 * 2**20)  # this process: +200 MiB, which a forked child's ru_maxrss would count
    child = "import time; x = bytearray(64 * 2**20); time.sleep(0.5)"  # long enough for psutil's samples too
    rc, peak = runner.run_measured([sys.executable, "-c", child], None, None, 60)
    assert rc == 0 and peak is not None and 64 * 2**20 < peak < 190 * 2**20
    rc, _ = runner.run_measured(["sh", "-c", "exit 3"], None, None, 60)
    assert rc == 3
    import tempfile

    left = set(Path(tempfile.gettempdir()).glob("peers-rss-*"))
    with pytest.raises(runner.subprocess.TimeoutExpired):
        runner.run_measured(["sleep", "30"], None, None, 0.5)
    assert set(Path(tempfile.gettempdir()).glob("peers-rss-*")) <= left  # GNU time's output file removed
    del ballast


def _rss_rows():
    return {
        "strata_int4": {"prefill_tps": 50.0, "decode_tps": 12.0, "peak_rss_bytes": 3 * 2**30,
                        "round_figures": [{"decode_tps": 12.0}, {"decode_tps": 13.0}]},
        "llama_q4_0": {"prefill_tps": 60.0, "decode_tps": 10.0, "peak_rss_bytes": int(2.5 * 2**30),
                       "round_figures": [{"decode_tps": 10.0, "decode_steady": True},
                                         {"decode_tps": 13.0, "decode_steady": True}]},
    }


def test_latency_table_shows_peak_rss_only_when_measured():
    tables, parts = _peers("tables"), _peers("parts")
    sr = _rss_rows()
    t = tables.latency_table(sr).splitlines()
    assert "| peak RSS |" in t[0]
    assert "| 3.00 GiB |" in next(r for r in t if r.startswith("| **Strata** | int4"))
    q4 = next(r for r in t if "q4_0" in r)
    assert "| 2.50 GiB |" in q4 and "1.10x (rounds 1.20, 1.00)" in q4  # median of every round's ratio
    assert "peak RSS" not in tables.latency_table({k: {f: v for f, v in r.items() if f != "peak_rss_bytes"}
                                                   for k, r in sr.items()})
    # across rounds the peak is the highest one, rates the median
    merged = parts.median_rounds([{"strata_int4": {"decode_tps": 10.0, "peak_rss_bytes": 100}},
                                  {"strata_int4": {"decode_tps": 14.0, "peak_rss_bytes": 300}},
                                  {"strata_int4": {"decode_tps": 12.0}}])
    assert merged["strata_int4"]["peak_rss_bytes"] == 300 and merged["strata_int4"]["decode_tps"] == 12.0


def _depth_result():
    """A fake depth part: two rounds at 0 / 4k / 16k; Strata's int8 KV gains with depth."""
    parts = _peers("parts")
    strata = {0: (30.0, 30.5), 4096: (20.0, 21.0), 16384: (10.0, 15.0)}  # bf16 KV, int8 KV
    llama = {0: (28.0, 28.0), 4096: (22.0, 24.0), 16384: (9.0, 12.0)}  # f16 KV, q8_0 KV
    rounds = []
    for r, scale in enumerate((1.0, 1.1)):
        got = {}
        for d in strata:
            got[str(d)] = {
                "strata_bf16": {"decode_tps": strata[d][0] * scale, "peak_rss_bytes": 2**30 + r},
                "strata_int8": {"decode_tps": strata[d][1] * scale * (1.0 if r == 0 else 1.2), "peak_rss_bytes": 2**30},
                "llama_f16": {"decode_tps": llama[d][0], "decode_tps_runs": [llama[d][0]] * 2,
                              "peak_rss_bytes": 2**29},
                "llama_q8_0": {"decode_tps": llama[d][1], "decode_tps_runs": [llama[d][1]] * 2},
            }
        rounds.append(got)
    return {"depths": [0, 4096, 16384], "output_len": 64, "rounds": 2, "llama_flags": ["-fa", "on"],
            "by_depth": {d: parts.median_rounds([g[d] for g in rounds]) for d in ("0", "4096", "16384")}}


def test_depth_tables_ratios_and_the_int8_kv_target():
    tables = _peers("tables")
    dr = _depth_result()
    t = tables.depth_table(dr).splitlines()
    assert t[0].startswith("| row | Strata decode tok/s | llama.cpp decode tok/s | Strata ÷ llama.cpp |")
    assert "Strata peak RSS" in t[0]
    row = next(r for r in t if r.startswith("| depth 16k decode, bf16 KV vs f16"))
    assert f"{(10 / 9 + 11 / 9) / 2:.2f}x (rounds {10 / 9:.2f}, {11 / 9:.2f})" in row  # every round, median
    assert "| 0.50 GiB |" in row and "| 1.00 GiB |" in row
    assert [r.split(" |")[0] for r in t[2:]] == [
        "| depth 0 decode, bf16 KV vs f16", "| depth 0 decode, int8 KV vs q8_0",
        "| depth 4k decode, bf16 KV vs f16", "| depth 4k decode, int8 KV vs q8_0",
        "| depth 16k decode, bf16 KV vs f16", "| depth 16k decode, int8 KV vs q8_0"]
    gains = tables.depth_gain_rows(dr)
    assert [g["depth"] for g in gains] == [0, 4096, 16384]
    deep = gains[-1]
    assert deep["strata_rounds"] == pytest.approx([1.5, 1.8])  # int8 ÷ bf16 per round
    assert deep["strata"] == pytest.approx(1.65) and deep["llama"] == pytest.approx(12 / 9)
    assert deep["met"] is True and "target" not in gains[0] and "target" not in gains[1]
    g = tables.depth_gain_table(dr)
    assert "| int8 KV / bf16 KV at 16k | 1.65x (rounds 1.50, 1.80) | 1.33x | >= 1.40x: met |" in g
    # under the target: said so, and a finding of its own among Strata's losses
    dr["by_depth"]["16384"]["strata_int8"]["round_figures"] = [{"decode_tps": 11.0}, {"decode_tps": 12.0}]
    assert "**not met**" in tables.depth_gain_table(dr)
    f = tables.findings({"depth": {"qwen-0.5b": dr}})
    assert any(x.startswith("Strata behind: qwen-0.5b int8 KV ÷ bf16 KV decode at depth 16k") for x in f)
    assert any("qwen-0.5b batch-1 decode at depth 16k, bf16 KV vs f16" in x for x in f)


def test_markdown_has_the_big_shape_note_and_the_depth_section():
    report = _peers("report")
    res = {"date": "2026-01-01", "workload": {"lat_in": 128, "lat_out": 128},
           "latency": {"llama-3.2-3b": dict(_rss_rows(), workload={"lat_in": 128, "lat_out": 64, "bench_reps": 2,
                                                                 "repeats": 2, "rounds": 2})},
           "depth": {"qwen-0.5b": dict(_depth_result(), model_dir="$PEERS/models/qwen-0.5b-ctx32768")},
           "commands": []}
    md = report.render_markdown(res)
    assert "### llama-3.2-3b" in md and "64 output tokens" in md and "Maximum resident set size" in md
    assert "## Decode at context depth" in md and "$PEERS/models/qwen-0.5b-ctx32768" in md
    assert "int8 KV / bf16 KV at 16k" in md and "-fa on" in md
    assert "--output-len 64 --warmup 1 --repeats 1" in md and "run once, right before Strata's" in md
    res["depth"]["qwen-0.5b"]["llama_bracketed"] = True  # --depth-bracket
    assert "run right before and after Strata's" in report.render_markdown(res)


def test_merge_previous_keeps_the_depth_part_and_big_shapes(tmp_path):
    report = _peers("report")
    prev = {"date": "2026-01-01", "quick": False,
            "latency": {"llama-3.2-3b": {"strata_int4": {}}, "qwen-0.5b": {}},
            "depth": {"qwen-0.5b": {"by_depth": {}}}, "throughput": {}, "serving": {},
            "commands": [{"part": "depth", "cmd": "strata bench latency --model $PEERS/models/qwen-0.5b-ctx32768"},
                         {"part": "latency", "cmd": "llama-bench -m $PEERS/gguf/0.3.36/llama-3.2-3b-q4_0.gguf"}]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(prev))
    new = {"date": "2026-02-02", "quick": False, "parts": ["latency"], "commands": [],
           "latency": {"qwen-0.5b": {}}, "depth": {}, "throughput": {}, "serving": {}}
    report.merge_previous(new, path, ["qwen-0.5b"], [], [])
    assert new["depth"]["qwen-0.5b"]["measured_on"] == "2026-01-01"
    assert new["latency"]["llama-3.2-3b"]["measured_on"] == "2026-01-01"
    parts = sorted(c["part"] for c in new["commands"])
    assert parts == ["depth (from the run of 2026-01-01)", "latency (from the run of 2026-01-01)"]
    # this run measured the depth part: the old one is not kept
    new2 = {"date": "2026-02-02", "quick": False, "parts": ["depth"], "commands": [],
            "latency": {}, "depth": {"qwen-0.5b": {"by_depth": {"0": {}}}}, "throughput": {}, "serving": {}}
    report.merge_previous(new2, path, [], [], ["qwen-0.5b"])
    assert new2["depth"]["qwen-0.5b"]["by_depth"] == {"0": {}}
    assert not any(c["part"].startswith("depth") for c in new2["commands"])
    assert report._names_shape("-m $PEERS/gguf/0.3.36/qwen-0.5b-f32.gguf", "qwen-0.5b")
    assert not report._names_shape("--random-model qwen-0.5bx", "qwen-0.5b")


def test_convert_makes_each_gguf_once_and_deletes_the_8b_intermediate(tmp_path, monkeypatch):
    """convert() with a fake runner: the 8B shape's bf16 GGUF is made, quantised to q4_0 and deleted;
    a second call makes nothing (q4_0 exists, so the 16 GB bf16 GGUF is not converted again)."""
    import types

    import strata.demo.random_models as rm

    conv = _peers("convert")
    monkeypatch.setattr(rm, "random_model_path", lambda shape: tmp_path / f"random-{shape}")
    ran: list[str] = []

    def run(part, name, cmd, timeout=0, env=None, **kw):
        ran.append(name)
        out = Path(cmd[cmd.index("--outfile") + 1]) if "--outfile" in cmd else Path(cmd[2])
        out.write_text(name)
        return ""

    ctx = types.SimpleNamespace(cache=tmp_path, args=types.SimpleNamespace(llama_cpp_python="0.0", threads=2),
                                run=run, python=sys.executable, bin_dir=tmp_path / "bin")
    monkeypatch.setattr(conv, "converter_env", lambda ctx: {})
    got = conv.convert(ctx, tmp_path / "llama.cpp", ["llama-3.1-8b", "llama-3.2-3b"])
    assert ran == ["convert-llama-3.1-8b-bf16", "quantize-llama-3.1-8b-q4_0", "convert-llama-3.2-3b-bf16",
                   "quantize-llama-3.2-3b-q8_0", "quantize-llama-3.2-3b-q4_0"]
    gdir = tmp_path / "gguf" / "0.0"
    assert set(got["llama-3.1-8b"]) == {"q4_0"} and not (gdir / "llama-3.1-8b-bf16.gguf").exists()
    assert set(got["llama-3.2-3b"]) == {"bf16", "q8_0", "q4_0"}
    assert all(p.is_file() for files in got.values() for p in files.values())
    ran.clear()
    assert conv.convert(ctx, tmp_path / "llama.cpp", ["llama-3.1-8b", "llama-3.2-3b"]) == got
    assert ran == []
