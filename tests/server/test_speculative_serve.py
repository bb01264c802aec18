"""`strata serve --speculative-model ngram`: the same greedy text as plain decoding, streamed and not,
with acceptance and tokens per step in /metrics."""

from __future__ import annotations

import json

import httpx
import pytest

from strata import SamplingParams
from tests.server.serverproc import start_server

PROMPT = ("To be, or not to be, that is the question. To be, or not to be, that is the question. "
          "To be, or not to be,")


@pytest.fixture(scope="module")
def spec_server():
    s = start_server("--speculative-model", "ngram", "--num-speculative-tokens", "5")
    yield s
    s.stop()


def test_greedy_text_equals_plain_decoding_and_metrics_count_drafts(spec_server, offline):
    want = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    body = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    r = spec_server.post("/v1/completions", json=body).json()
    assert r["choices"][0]["text"] == want and r["usage"]["completion_tokens"] == 48
    with httpx.stream("POST", spec_server.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as resp:
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in resp.iter_lines()
                       if line.startswith("data: {"))
    assert text == want
    drafted = spec_server.metric("strata_spec_decode_num_draft_tokens_total")
    accepted = spec_server.metric("strata_spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and 0 < accepted <= drafted
    assert spec_server.metric("strata_spec_decode_acceptance_rate") == pytest.approx(accepted / drafted, rel=1e-6)
    assert spec_server.metric("strata_spec_decode_tokens_per_step") > 1.0
