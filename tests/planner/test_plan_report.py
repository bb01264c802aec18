"""Plan renderings: the text report, the self-contained HTML page and its SVG charts, the CLI."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest

from strata.planner import charts
from strata.planner.plan import PlanRequest, build_plan
from strata.planner.plan_report import format_html, format_text

VOID = {"meta", "br", "img", "hr", "input", "link"}


class _Balance(HTMLParser):
    """Checks that every non-void tag is closed in order; collects tag names."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.seen: set[str] = set()
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.seen.add(tag)
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.seen.add(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"unexpected </{tag}> with open {self.stack[-3:]}")
        else:
            self.stack.pop()


def _check_html(page: str) -> _Balance:
    parser = _Balance()
    parser.feed(page)
    parser.close()
    assert not parser.errors and not parser.stack, (parser.errors, parser.stack)
    namespaces = ("http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink")  # identifiers, not fetched
    assert "<svg" in page and "http://" not in page.replace(namespaces[0], "").replace(namespaces[1], "")
    start = 0
    while (i := page.find("<svg", start)) >= 0:  # every chart is well-formed XML on its own
        j = page.index("</svg>", i) + len("</svg>")
        ET.fromstring(page[i:j])
        start = j
    return parser


def test_html_is_well_formed_with_svg_charts() -> None:
    plan = build_plan(PlanRequest(model="qwen-0.5b", hardware="L4x2", dtype="bfloat16", max_model_len=4096,
                                  batch=32, price_per_hour=1.6))
    page = format_html(plan)
    parser = _check_html(page)
    assert {"html", "head", "body", "svg", "path", "text", "g"} <= parser.seen  # matplotlib draws paths
    assert page.count("<svg") == 2  # roofline + memory bar
    assert "decode b=1" in page and "prefill 4096" in page and "Tensor parallel" in page


def test_text_report_sections() -> None:
    plan = build_plan(PlanRequest(model="smol-135m", hardware="A10G", dtype="float16", max_model_len=2048,
                                  batch=16, price_per_hour=1.0))
    text = format_text(plan)
    for needle in ("Memory (per device)", "KV cache", "per token", "activations", "max concurrent sequences",
                   "Prefill of a 2048-token prompt", "roofline", "per million output tokens", "A10G"):
        assert needle in text, needle


def test_chart_helpers_escape_and_parse() -> None:
    chart = charts.roofline([("peak <bf16>", 1e14)], [("HBM", 2e12)], [("a&b", 10.0, 1e13), ("zero", 0.0, 0.0)])
    root = ET.fromstring(chart)
    assert root.tag.endswith("svg") and not chart.startswith("<?xml")  # inlinable: no prolog or DOCTYPE
    assert "peak &lt;bf16&gt;" in chart and "a&amp;b" in chart
    assert chart.count("<text") >= 5  # text stays text (selectable, measurable)
    bar = charts.stacked_bar([("weights", 3.0), ("kv", 1.0), ("neg", -1.0)], total=8.0, title="m")
    assert ET.fromstring(bar).tag.endswith("svg") and "weights: 3 (38%)" in bar
    one = charts.distribution([12.5], "TTFT")
    assert "TTFT (1 sample)" in one and "12.5" in one and "requests" not in one  # the sample, not a bar
    many = charts.distribution([float(i) for i in range(20)], "TPOT")
    assert "TPOT (20 samples)" in many and "requests" in many and "p99" in many  # a count axis
    with pytest.raises(ValueError):
        charts.roofline([], [("x", 1.0)], [])


def test_cli_plan_json_and_html(tmp_path, capsys) -> None:
    from strata.cli import main

    html = tmp_path / "plan.html"
    rc = main(["plan", "--model", "tiny", "--hardware", "h100x4", "--dtype", "bfloat16", "--max-model-len", "512",
               "--batch", "8", "--price-per-hour", "10", "--json", "--html", str(html)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"]["name"] == "H100-SXM" and [o["tp"] for o in out["tp_options"]] == [1, 2, 4]
    assert out["memory"]["kv_tokens"] > 0 and out["best"]["cost_per_mtok"] > 0
    _check_html(html.read_text())
    rc = main(["plan", "--model", "tiny", "--hardware", "nope"])
    err = capsys.readouterr().err
    assert rc == 2 and "valid names" in err and "MI300X" in err
