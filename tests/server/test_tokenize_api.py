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
