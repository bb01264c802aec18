"""Markdown tables of the figures (latency, throughput, serving) and the findings sentences.

Unit-tested in tests/bench/test_peers.py.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from .figures import ratio


def fmt_num(v: Any, digits: int = 3) -> str:
    """Numbers for tables: '-' for missing, 3 significant digits below 100, else whole numbers."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.{digits}g}"
    return str(v)


def fmt_cpu(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}%"


def fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def md_table(headers: list[str], rows: list[list[Any]], left: int = 1) -> str:
    """A GitHub markdown table; the first `left` columns left-aligned, the rest right-aligned."""
    cells = [[c if isinstance(c, str) else fmt_num(c) for c in r] for r in rows]
    align = [":--"] * left + ["--:"] * (len(headers) - left)
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(lines)


# one row per engine/weights; "vs" names the Strata row a peer row is compared with
LATENCY_ROWS = (
    ("strata_fp32", "**Strata**", "fp32", None),
    ("llama_f32", "llama.cpp", "f32 GGUF", "strata_fp32"),
    ("hf_fp32", "transformers", "fp32", "strata_fp32"),
    ("strata_bf16", "**Strata**", "bf16 weights, fp32 activations", None),
    ("llama_bf16", "llama.cpp", "bf16 GGUF", "strata_bf16"),
    ("llama_f16", "llama.cpp", "f16 GGUF", "strata_bf16"),
    ("strata_int8", "**Strata**", "int8 (per row; int8 activations per 64 columns where VNNI)", None),
    ("llama_q8_0", "llama.cpp", "q8_0 GGUF (blocks of 32)", "strata_int8"),
    ("strata_int4", "**Strata**", "int4 (groups of 64, fp32 scales: 4.5 bits/weight; int8 activations where VNNI)", None),
    ("llama_q4_0", "llama.cpp", "q4_0 GGUF (blocks of 32)", "strata_int4"),
)


def _paired_rounds(base: dict | None, peer: dict, key: str) -> list[tuple[float, bool | None]]:
    """(Strata ÷ peer, whether the peer's bracket was steady) for each latency round both rows
    measured (--latency-rounds)."""
    pairs = zip((base or {}).get("round_figures") or [], peer.get("round_figures") or [])
    steady_key = key.replace("_tps", "_steady")
    return [(r, p.get(steady_key)) for b, p in pairs if (r := ratio(b.get(key), p.get(key))) is not None]


WIN_WORST_ROUND = 0.95  # a row is won only if its worst round is at least this (and its median >= 1)


def round_ratios(base: dict | None, peer: dict, key: str) -> list[float]:
    """Every round's Strata ÷ peer ratio, in round order."""
    return [r for r, _ in _paired_rounds(base, peer, key)]


def steady_round_ratios(base: dict | None, peer: dict, key: str) -> list[float]:
    """The ratios of the rounds whose peer runs before and after Strata's agreed (a round that
    straddled a bandwidth switch says which level each engine landed on more than which engine is
    faster): the steady view, shown beside every round's, never instead of it."""
    return [r for r, ok in _paired_rounds(base, peer, key) if ok]


def latency_ratio(base: dict | None, peer: dict, key: str) -> float | None:
    """Strata ÷ peer of a latency figure: the median of every round's own ratio (each round
    brackets Strata's run with the peer's), or with one round the figures' ratio."""
    each = round_ratios(base, peer, key)
    if each:
        return statistics.median(each)
    return ratio(base.get(key), peer.get(key)) if base else None


def row_won(base: dict | None, peer: dict, key: str) -> bool | None:
    """Whether Strata wins the row: median ratio >= 1 and no round below WIN_WORST_ROUND."""
    r = latency_ratio(base, peer, key)
    if r is None:
        return None
    return r >= 1 and min(round_ratios(base, peer, key) or [r]) >= WIN_WORST_ROUND


def _ratio_cell(base: dict | None, peer: dict, key: str) -> str:
    """latency_ratio, and with several rounds every round's ratio and, where some rounds were not
    steady, the steady rounds' median beside them."""
    each, steady = round_ratios(base, peer, key), steady_round_ratios(base, peer, key)
    text = fmt_ratio(latency_ratio(base, peer, key))
    if len(each) > 1:
        text += f" (rounds {', '.join(f'{r:.2f}' for r in each)})"
    if 0 < len(steady) < len(each):
        text += f" [steady {statistics.median(steady):.2f}x, {len(steady)}/{len(each)}]"
    return text


def fmt_gib(n: float | None) -> str:
    """A byte count as GiB for the peak-RSS columns ('-' when not measured)."""
    return "-" if not n else f"{n / 2**30:.2f} GiB"


def has_rss(rows: dict[str, dict]) -> bool:
    """Whether any row of a table carries a measured peak RSS (the column is shown only then)."""
    return any((r or {}).get("peak_rss_bytes") for r in rows.values() if isinstance(r, dict))


def latency_table(shape_res: dict[str, dict]) -> str:
    """Markdown table of one shape's batch-1 figures: rows from LATENCY_ROWS that were measured,
    with a peak RSS column when the run measured it (the process's "Maximum resident set size":
    weights, KV cache, runtime; '-' for the fp32 row, whose process runs transformers too, and a
    llama-bench run given two GGUFs)."""
    rss = has_rss(shape_res)
    rows = []
    for key, engine, weights, vs in LATENCY_ROWS:
        r = shape_res.get(key)
        if not r:
            continue
        base = shape_res.get(vs) if vs else None
        pre, dec = r.get("prefill_tps"), r.get("decode_tps")
        cells = [_ratio_cell(base, r, k) if vs else "" for k in ("prefill_tps", "decode_tps")]
        ms = 1e3 / dec if dec else None
        rows.append([engine, weights, pre, dec, ms, *cells, *([fmt_gib(r.get("peak_rss_bytes"))] if rss else []),
                     fmt_cpu(r.get("others_cpu"))])
    return md_table(["engine", "weights", "prefill tok/s", "decode tok/s", "decode ms/token",
                     "Strata ÷ this, prefill", "Strata ÷ this, decode", *(["peak RSS"] if rss else []),
                     "others' CPU"], rows)


# the depth part's comparisons: (Strata row, peer row, label); the peer of the last is Strata itself
DEPTH_PAIRS = (
    ("strata_bf16", "llama_f16", "bf16 KV vs f16"),
    ("strata_int8", "llama_q8_0", "int8 KV vs q8_0"),
)
DEPTH_GAIN = ("strata_int8", "strata_bf16", "llama_q8_0", "llama_f16")  # int8 ÷ bf16, q8_0 ÷ f16
KV_GAIN_TARGET = 1.4  # Strata's int8 KV ÷ bf16 KV decode at the deepest context (issue 43)


def depth_label(depth: int | str) -> str:
    """4096 -> '4k', 16384 -> '16k', 0 -> '0' (the tables' names of the depths)."""
    d = int(depth)
    return f"{d // 1024}k" if d and d % 1024 == 0 else str(d)


def depth_table(dr: dict) -> str:
    """Markdown table of the depth part: per depth and KV format, Strata's and llama.cpp's decode
    tok/s and the ratio (median of every round's, as the latency table), with peak RSS."""
    rows = []
    by = dr.get("by_depth") or {}
    rss = any(has_rss(v) for v in by.values())
    for dk in sorted(by, key=int):
        res = by[dk]
        for s_key, p_key, label in DEPTH_PAIRS:
            s, p = res.get(s_key), res.get(p_key)
            if not (s or p):
                continue
            cell = _ratio_cell(s, p, "decode_tps") if (s and p) else "-"
            rows.append([f"depth {depth_label(dk)} decode, {label}", (s or {}).get("decode_tps"),
                         (p or {}).get("decode_tps"), cell,
                         *([fmt_gib((s or {}).get("peak_rss_bytes")), fmt_gib((p or {}).get("peak_rss_bytes"))]
                           if rss else []),
                         fmt_cpu(max((x for x in ((s or {}).get("others_cpu"), (p or {}).get("others_cpu"))
                                      if x is not None), default=None))])
    return md_table(["row", "Strata decode tok/s", "llama.cpp decode tok/s", "Strata ÷ llama.cpp",
                     *(["Strata peak RSS", "llama.cpp peak RSS"] if rss else []), "others' CPU"], rows)


def depth_gain_rows(dr: dict) -> list[dict]:
    """Per depth: Strata's int8 KV ÷ bf16 KV decode and llama.cpp's q8_0 ÷ f16 (each the median of
    every round's own ratio), and at the deepest depth whether Strata's meets KV_GAIN_TARGET."""
    by = dr.get("by_depth") or {}
    out = []
    deepest = max(map(int, by), default=None)
    s8, s16, l8, l16 = DEPTH_GAIN
    for dk in sorted(by, key=int):
        res = by[dk]
        g = {"depth": int(dk),
             "strata": latency_ratio(res[s8], res[s16], "decode_tps") if res.get(s8) and res.get(s16) else None,
             "strata_rounds": round_ratios(res[s8], res[s16], "decode_tps") if res.get(s8) and res.get(s16) else [],
             "llama": latency_ratio(res[l8], res[l16], "decode_tps") if res.get(l8) and res.get(l16) else None}
        if int(dk) == deepest and int(dk) > 0 and g["strata"] is not None:
            g["target"] = KV_GAIN_TARGET
            g["met"] = g["strata"] >= KV_GAIN_TARGET
        out.append(g)
    return out


def depth_gain_table(dr: dict) -> str:
    rows = []
    for g in depth_gain_rows(dr):
        each = g["strata_rounds"]
        cell = fmt_ratio(g["strata"]) + (f" (rounds {', '.join(f'{r:.2f}' for r in each)})" if len(each) > 1 else "")
        target = ""
        if "target" in g:
            target = f">= {g['target']:.2f}x: {'met' if g['met'] else '**not met**'}"
        rows.append([f"int8 KV / bf16 KV at {depth_label(g['depth'])}", cell, fmt_ratio(g["llama"]), target])
    return md_table(["row", "Strata int8 ÷ bf16 KV, decode", "llama.cpp q8_0 ÷ f16 KV, decode", "target"], rows)


THROUGHPUT_ROWS = (
    ("strata_offline", "**Strata**", "LLM.generate, continuous batching (`strata bench throughput`)", None),
    ("hf_static", "transformers", "generate, static batches (`--compare hf`)", "strata_offline"),
    ("strata_http", "**Strata**", "`strata serve` + `strata bench serve --request-rate inf`", None),
)
LLAMA_HTTP_HOW = "`llama-server -np N -cb` + `strata bench serve --request-rate inf`"


def throughput_rows(tp: dict[str, Any]) -> list[tuple[str, str, str, str | None, dict]]:
    """(key, engine, how, compared-with key, figures) for every measured throughput row:
    THROUGHPUT_ROWS, then one llama-server row per slot count tried."""
    out = [(k, e, h, vs, tp[k]) for k, e, h, vs in THROUGHPUT_ROWS if tp.get(k)]
    best = (tp.get("llama_http") or {}).get("slots")
    for r in tp.get("llama_http_runs") or ([tp["llama_http"]] if tp.get("llama_http") else []):
        how = LLAMA_HTTP_HOW.replace("-np N", f"-np {r.get('slots', 'N')}")
        if best is not None and r.get("slots") == best and len(tp.get("llama_http_runs") or []) > 1:
            how += " (best slot count; used for serving)"
        out.append((f"llama_http_np{r.get('slots')}", "llama.cpp", how, "strata_http", r))
    return out


def throughput_table(tp: dict[str, Any]) -> str:
    rows = []
    for key, engine, how, vs, r in throughput_rows(tp):
        if key == "hf_static" and r.get("batch_size"):
            how = how.replace("static batches", f"static batches of {r['batch_size']}")
        base = tp.get(vs) if vs else None
        rr = ratio(base.get("output_tps"), r.get("output_tps")) if base else None
        rows.append([engine, how, r.get("requests"), r.get("elapsed_s"), r.get("rps"), r.get("output_tps"),
                     r.get("total_tps"), r.get("short_outputs", "-"), fmt_ratio(rr) if vs else "",
                     fmt_cpu(r.get("others_cpu"))])
    return md_table(["engine", "how", "requests", "elapsed s", "req/s", "output tok/s", "total tok/s",
                     "short outputs", "Strata ÷ this, output tok/s", "others' CPU"], rows)


def serving_table(points: list[dict]) -> str:
    """One row per (rate, engine), plus a Strata ÷ llama.cpp row per rate."""
    rows = []
    for p in points:
        by = {}
        for eng, label in (("strata", "**Strata**"), ("llama", "llama.cpp")):
            r = p.get(eng)
            if not r:
                continue
            by[eng] = r
            good = r.get("goodput")
            rows.append([f"{p['name']} ({p['rate']:g} req/s, {p['num_prompts']} req)", label,
                         f"{r.get('completed')}/{p['num_prompts']}", r.get("rps"), r.get("output_tps"),
                         (r.get("ttft_ms") or {}).get("p50"), (r.get("ttft_ms") or {}).get("p99"),
                         (r.get("tpot_ms") or {}).get("p50"), (r.get("tpot_ms") or {}).get("p99"),
                         (r.get("itl_ms") or {}).get("p99"),
                         good, f"{r.get('good_requests')}/{r.get('completed')}", fmt_cpu(r.get("others_cpu"))])
        if len(by) == 2:
            s, ll = by["strata"], by["llama"]

            def rp(k: str, sub: str | None = None, s: dict = s, ll: dict = ll) -> str:
                a = (s.get(k) or {}).get(sub) if sub else s.get(k)
                b = (ll.get(k) or {}).get(sub) if sub else ll.get(k)
                return fmt_ratio(ratio(a, b))

            rows.append(["", "Strata ÷ llama.cpp", "", rp("rps"), rp("output_tps"), rp("ttft_ms", "p50"),
                         rp("ttft_ms", "p99"), rp("tpot_ms", "p50"), rp("tpot_ms", "p99"), rp("itl_ms", "p99"),
                         rp("goodput"), "", ""])
    return md_table(["offered load", "engine", "done", "req/s", "output tok/s", "TTFT p50 ms",
                     "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "ITL p99 ms", "goodput req/s", "within SLO",
                     "others' CPU"], rows)


def findings(res: dict) -> list[str]:
    """Plain sentences: every comparison, Strata's losses first (rates: < 1x; latencies: > 1x)."""
    losses, wins = [], []

    def add(text: str, r: float | None, higher_better: bool = True, won: bool | None = None) -> None:
        if r is None:
            return
        bad = (r < 1 if higher_better else r > 1) if won is None else not won
        (losses if bad else wins).append(f"{text}: Strata ÷ peer = {r:.2f}x")

    for shape, sr in (res.get("latency") or {}).items():
        for key, engine, weights, vs in LATENCY_ROWS:
            if vs and sr.get(key) and sr.get(vs):
                for k, what in (("prefill_tps", "prefill tok/s"), ("decode_tps", "decode tok/s")):
                    add(f"{shape} batch-1 {what}, {engine} {weights.split(' (')[0]}",
                        latency_ratio(sr[vs], sr[key], k), won=row_won(sr[vs], sr[key], k))
    for shape, dr in (res.get("depth") or {}).items():
        for dk, dres in sorted((dr.get("by_depth") or {}).items(), key=lambda kv: int(kv[0])):
            for s_key, p_key, label in DEPTH_PAIRS:
                if dres.get(s_key) and dres.get(p_key):
                    add(f"{shape} batch-1 decode at depth {depth_label(dk)}, {label}",
                        latency_ratio(dres[s_key], dres[p_key], "decode_tps"),
                        won=row_won(dres[s_key], dres[p_key], "decode_tps"))
        for g in depth_gain_rows(dr):
            if "target" in g:
                text = (f"{shape} int8 KV ÷ bf16 KV decode at depth {depth_label(g['depth'])}: "
                        f"{g['strata']:.2f}x (target >= {g['target']:.2f}x)")
                (wins if g["met"] else losses).append(text)
    for shape, tp in (res.get("throughput") or {}).items():
        for key, engine, _how, vs, r in throughput_rows(tp):
            if vs and tp.get(vs):
                what = f"llama-server -np {r.get('slots')}, HTTP" if key.startswith("llama") else engine
                add(f"{shape} throughput (output tok/s) vs {what}", ratio(tp[vs].get("output_tps"), r.get("output_tps")))
    for shape, sv in (res.get("serving") or {}).items():
        for p in sv.get("points", []):
            s, ll = p.get("strata"), p.get("llama")
            if not (s and ll):
                continue
            tag = f"{shape} serving at {p['rate']:g} req/s ({p['name']})"
            add(f"{tag}, TTFT p50 vs llama.cpp", ratio(s["ttft_ms"].get("p50"), ll["ttft_ms"].get("p50")),
                higher_better=False)
            add(f"{tag}, TPOT p50 vs llama.cpp", ratio(s["tpot_ms"].get("p50"), ll["tpot_ms"].get("p50")),
                higher_better=False)
            add(f"{tag}, ITL p99 vs llama.cpp", ratio((s.get("itl_ms") or {}).get("p99"),
                                                      (ll.get("itl_ms") or {}).get("p99")), higher_better=False)
            add(f"{tag}, goodput vs llama.cpp", ratio(s.get("goodput"), ll.get("goodput")))
    return [f"Strata behind: {t}" for t in losses] + [f"Strata ahead or even: {t}" for t in wins]
