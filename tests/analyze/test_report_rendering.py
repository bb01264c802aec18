"""The analyzer's and planner's HTML reports, rendered in headless Chromium: no chart is clipped.

Every text element of every inline <svg> (legend entries, tick labels, titles) must lie inside
its <svg>'s box, as the browser lays it out. The reports are built from a recorded analysis (the
numbers of a real `strata analyze` run on the dev box: eleven time categories, one request) and
from the planner on named hardware, so nothing here depends on this machine's speed.

Chromium comes from Debian's package, installed by `make test` (the Makefile's `browser` step) when
missing and allowed (root, apt present; STRATA_NO_APT=1 forbids it); without it the test is skipped
saying why. The test itself installs nothing.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from strata.analyze.analyze import Action, Analysis, Phase, Verdict
from strata.analyze.analyze_report import format_html as analyze_html
from strata.planner.plan import PlanRequest, build_plan
from strata.planner.plan_report import format_html as plan_html

BROWSERS = ("chromium", "chromium-browser", "google-chrome")

# runs in the page after layout; writes what it measured into the DOM that --dump-dom prints
MEASURE = """<script>
window.addEventListener('load', () => {
  const out = [];
  document.querySelectorAll('svg').forEach((svg, i) => {
    const box = svg.getBoundingClientRect();
    svg.querySelectorAll('text').forEach(t => {
      const r = t.getBoundingClientRect();
      if (r.width === 0 && r.height === 0) return;
      out.push({svg: i, text: t.textContent.trim(), left: r.left - box.left, right: box.right - r.right,
                top: r.top - box.top, bottom: box.bottom - r.bottom,
                legend: !!t.closest('g[id^="legend"]')});
    });
  });
  const pre = document.createElement('pre');
  pre.id = 'strata-boxes';
  pre.textContent = JSON.stringify({svgs: document.querySelectorAll('svg').length, texts: out});
  document.body.appendChild(pre);
});
</script>"""


def _find_browser() -> str | None:
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


@pytest.fixture(scope="module")
def chromium() -> str:
    found = _find_browser()
    if not found:
        pytest.skip("no chromium on PATH: `make test` installs Debian's (apt-get install chromium) where it "
                    "runs as root with apt-get and STRATA_NO_APT is not 1")
    return found


def recorded_analysis(ttft_s: list[float], tpot_s: list[float]) -> Analysis:
    cats = {"gemm": 17.89, "attention": 4.25, "overhead": 1.15, "norm_elementwise": 0.56, "other_ops": 0.34,
            "sample": 0.05, "memory": 0.02, "idle": 0.01, "schedule": 0.01, "tokenize": 0.0001,
            "communication": 0.0}
    phases = [Phase("decode", 63, 23.35, 63, 1.0, 3.5e10, 1.7e10, 1.47, "memory", 0.05, 0.01, 0.91),
              Phase("prefill", 1, 0.91, 16, 16.0, 5.5e8, 3.5e9, 0.07, "compute", 0.02, 0.05, 0.8)]
    return Analysis(
        model="/root/.cache/strata/random-smol-135m-s0", workload={"num_prompts": len(ttft_s)}, wall_s=24.28,
        categories=cats, layers={"compute": 23.0, "CPU pipeline": 1.2}, phases=phases,
        top_ops=[("numba::gemv", 1.79), ("numba::gemv_swiglu", 0.63)],
        requests={"count": len(ttft_s), "mean_tokenize_s": 1e-4, "mean_queue_s": 0.0085, "mean_prefill_s": 0.913,
                  "mean_decode_s": 28.7, "ttft_p50_s": ttft_s[0], "ttft_p99_s": ttft_s[-1],
                  "tpot_p50_s": tpot_s[0] if tpot_s else float("nan"),
                  "tpot_p99_s": tpot_s[-1] if tpot_s else float("nan"), "output_tokens": 64},
        verdict=Verdict("memory bandwidth", "decode is 96% of wall time; the MBU is low because ...",
                        [Action("--quantization int8", "stream a quarter of the bytes", "4.6x")]),
        device={"name": "cpu", "mem_gbs": 32.0, "stream_gbs": 23.2, "few_rows_gflops": 70.1, "gemm_gflops": 216.0,
                "few_rows": 16},
        ttft_s=ttft_s, tpot_s=tpot_s,
    )


def measure(chromium: str, page: str, tmp_path) -> dict:
    path = tmp_path / "page.html"
    path.write_text(page.replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    r = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--window-size=1000,3000", "--virtual-time-budget=5000", "--dump-dom", path.as_uri()],
                       capture_output=True, text=True, timeout=120)
    m = re.search(r'<pre id="strata-boxes">(.*?)</pre>', r.stdout, re.S)
    assert m, f"chromium printed no measurements (rc {r.returncode}):\n{r.stderr[-2000:]}"
    import html

    return json.loads(html.unescape(m.group(1)))


def assert_inside(boxes: dict, want_svgs: int) -> None:
    assert boxes["svgs"] == want_svgs
    texts = boxes["texts"]
    assert any(t["legend"] for t in texts), "no legend text found in the charts"
    outside = [t for t in texts if min(t["left"], t["right"], t["top"], t["bottom"]) < -0.5]
    assert not outside, "\n".join(f"svg {t['svg']}: {t['text']!r} sticks out by "
                                  f"{-min(t['left'], t['right'], t['top'], t['bottom']):.1f}px" for t in outside)


@pytest.mark.parametrize("samples", [1, 40], ids=["one-request", "forty-requests"])
def test_analyze_report_charts_are_not_clipped(chromium, tmp_path, samples):
    ttft = sorted(0.9 + 0.01 * i for i in range(samples))
    tpot = sorted(0.45 + 0.002 * i for i in range(samples))
    page = analyze_html(recorded_analysis(ttft, tpot))
    boxes = measure(chromium, page, tmp_path)
    assert_inside(boxes, want_svgs=5)
    legend = [t["text"] for t in boxes["texts"] if t["legend"]]
    # the two largest segments carry their labels (the old hand-made bar pushed them past 640 px)
    assert any(x.startswith("GEMM: 17.89s") for x in legend) and any(x.startswith("attention: 4.25s") for x in legend)
    assert not any(re.search(r"GFLOP/s.*GFLOP/s", x) for x in legend)  # each figure once
    titles = [t["text"] for t in boxes["texts"]]
    assert f"TTFT ({samples} sample{'s' if samples > 1 else ''})" in titles
    if samples > 1:
        assert "requests" in titles  # a histogram has a count axis


def test_every_segment_of_the_time_split_has_its_own_colour():
    from strata.analyze.analyze import CATEGORY_LABELS
    from strata.planner import charts

    assert len(set(charts.PALETTE)) >= len(CATEGORY_LABELS)


def test_plan_report_charts_are_not_clipped(chromium, tmp_path):
    plan = build_plan(PlanRequest(model="qwen-0.5b", hardware="L4x2", dtype="bfloat16", max_model_len=4096,
                                  batch=32, price_per_hour=1.6))
    boxes = measure(chromium, plan_html(plan), tmp_path)
    assert_inside(boxes, want_svgs=2)
    legend = [t["text"] for t in boxes["texts"] if t["legend"]]
    assert "decode b=1" in legend and any(x.startswith("GEMM bfloat16 121.0 TFLOP/s") for x in legend)
