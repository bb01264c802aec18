"""POST /tokenize, POST /detokenize, GET /version: vLLM's shapes, the generation path's token counts."""

from __future__ import annotations

import pytest

import strata

CHAT = [{"role": "user", "content": "Who is there?"}]


def test_version(server):
    assert server.get("/version").json() == {"version": strata.__version__}


def test_tokenize_prompt_matches_what_a_completion_is_charged(server, offline):
    tok = offline.get_tokenizer()
    r = server.post("/tokenize", json={"prompt": "To be, or not to be"}).json()
    assert r["tokens"] == tok.encode("To be, or not to be") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == offline.engine.max_model_len and r["token_strs"] is None
    done = server.post("/v1/completions", json={"prompt": "To be, or not to be", "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == r["count"]
    bare = server.post("/tokenize", json={"prompt": "To be", "add_special_tokens": False,
                                          "return_token_strs": True}).json()
    assert bare["tokens"] == tok.encode("To be", add_special_tokens=False)
    assert "".join(bare["token_strs"]) == "To be"


def test_tokenize_chat_and_detokenize_round_trip(server, offline):
    r = server.post("/tokenize", json={"messages": CHAT}).json()
    done = server.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == r["count"]
    text = server.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
    assert text == offline.get_tokenizer().decode(r["tokens"])
    assert "Who is there?" in text


@pytest.mark.parametrize("path, body, param, words", [
    ("/tokenize", {}, "prompt", "exactly one"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt", "exactly one"),
    ("/tokenize", {"prompt": 5}, "prompt", "string"),
    ("/tokenize", {"prompt": "a", "typical": 1}, "typical", "unknown field"),
    ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, "add_special_tokens", "template"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens", "token ids"),
    ("/detokenize", {"tokens": [10**9]}, "tokens", "token ids"),
    ("/detokenize", {"tokens": "abc"}, "tokens", "list"),
])
def test_bad_bodies_are_400s(server, path, body, param, words):
    r = server.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_unknown_model_is_a_404(server):
    assert server.post("/tokenize", json={"prompt": "a", "model": "gpt-9"}).status_code == 404


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_gives_the_prompt_tokens_logprobs(server, offline, stream):
    from strata import SamplingParams

    prompt = "Now is the winter of our discontent"
    ids = offline.get_tokenizer().encode(prompt)
    want = offline.generate([ids], SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2),
                            use_tqdm=False)[0]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2, "stream": stream}
    if stream:
        import json

        import httpx

        parts = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    parts.append(json.loads(line[6:])["choices"][0]["logprobs"])
        lp = {k: [x for p in parts if p for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs")}
    else:
        lp = server.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(want.prompt_logprobs[i][ids[i]], abs=1e-4)
        assert len(lp["top_logprobs"][i]) <= 2
    assert lp["token_logprobs"][len(ids)] is not None  # then the completion's own
