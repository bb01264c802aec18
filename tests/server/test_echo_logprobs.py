"""/v1/completions with echo and logprobs: the legacy logprobs describe the returned text.

The contract, for every prompt (BOS added by the tokenizer or not, given as text or ids) and both
skip_special_tokens settings: "".join(logprobs.tokens) == choices[0].text, text_offset[i] ==
len("".join(tokens[:i])), and token_logprobs / top_logprobs have one entry per token. A special
token skipped from the text stays as an empty-string token with its logprob (as vLLM); a
character split over byte tokens lands on the token that completes it."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from strata.demo.model import demo_model_path
from strata.protocol.tokenizer import IncrementalDetokenizer, Tokenizer
from strata.server.responses import CompletionLogprobs, prompt_text

# The demo tokenizer adds <|begin_of_text|>, splits é and 🎭 over byte tokens, and parses
# <|eot_id|> written in a prompt as the special token.
PROMPTS = ["Now is the winter", "café naïve 🎭 masks", "A<|eot_id|>B", "  two  spaces\n\nand lines"]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(demo_model_path())


def _check(lp: dict, text: str) -> None:
    tokens = lp["tokens"]
    assert "".join(tokens) == text
    assert lp["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(tokens)


def _fake_logprobs(ids: list[int]) -> list[dict[int, float]]:
    return [{t: -0.5, (t + 1) % 4000: -1.5} for t in ids]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("bos", [True, False])
def test_pieces_join_to_the_text_in_any_split(tok, prompt, bos, skip):
    """Property over splits: a completion's ids fed in deltas of any size (as streamed) still join
    to the text the server returns (echoed prompt + the detokeniser's output)."""
    ids = tok.encode(prompt, add_special_tokens=bos)
    cut = max(1, len(ids) // 3)
    prompt_ids, out_ids = ids[:cut], ids[cut:] + [tok.eos_token_id]

    for step in (1, 2, 5, len(out_ids)):
        w = CompletionLogprobs(tok, prompt_ids, skip)
        parts = [w.prompt(prompt_ids, [None, *_fake_logprobs(prompt_ids[1:])], 2)]
        for i in range(0, len(out_ids), step):
            chunk = out_ids[i:i + step]
            parts.append(w.add(chunk, _fake_logprobs(chunk), 2, final=i + step >= len(out_ids)))
        detok = IncrementalDetokenizer(tok, prompt_ids, skip)
        for t in out_ids:
            detok.add(t)
        detok.flush()
        _check(CompletionLogprobs.merge(parts), prompt_text(tok, prompt_ids, skip) + detok.text)
    if skip and not bos and "<|" not in prompt:
        assert prompt_text(tok, ids, skip) == prompt  # no special token shown: the string sent


def _post(server, body: dict, stream: bool) -> tuple[str, dict]:
    """(text, logprobs) of choice 0, streamed chunks joined."""
    if not stream:
        c = server.post("/v1/completions", json=body).json()["choices"][0]
        return c["text"], c["logprobs"]
    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                text += c["text"]
                for k in lp:
                    lp[k] += (c["logprobs"] or {}).get(k, [])
    return text, lp


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("skip", [True, False])
def test_echo_logprobs_match_the_returned_text(server, tok, skip, stream):
    cases = [PROMPTS[0], PROMPTS[1], PROMPTS[2], tok.encode(PROMPTS[1], add_special_tokens=False)]
    for prompt in cases:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 1.0, "seed": 7, "echo": True, "logprobs": 2,
                "skip_special_tokens": skip, "ignore_eos": True}
        text, lp = _post(server, body, stream)
        _check(lp, text)
        ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
        has_bos, bos = ids[0] == tok.bos_token_id, tok.decode([tok.bos_token_id], skip_special_tokens=False)
        assert text.startswith(bos) == (has_bos and not skip), text  # shown only when specials are
        if has_bos:
            assert lp["tokens"][0] == ("" if skip else bos)  # skipped: an empty token, kept in place
        assert lp["token_logprobs"][0] is None and lp["token_logprobs"][len(ids)] is not None


def test_logprobs_without_echo_index_the_completion(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    r = client.completions.create(model="demo-v2", prompt=PROMPTS[1], max_tokens=16, temperature=1.0, seed=3,
                                  logprobs=1)
    c = r.choices[0]
    _check(c.logprobs.model_dump(), c.text)
    assert len(c.logprobs.tokens) == r.usage.completion_tokens
