"""`strata serve` through the official openai client: text equals offline greedy output."""

from __future__ import annotations

import concurrent.futures as cf

import openai
import pytest

from strata import SamplingParams

PROMPTS = ["The five layers of an LLM system are", "Once upon a time", "Memory is"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def greedy(offline, prompt: str, max_tokens: int = 24, **kw) -> str:
    out = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw), use_tqdm=False)
    return out[0].outputs[0].text


def test_models_health_ready(server, client):
    assert server.get("/health").status_code == 200
    assert server.get("/ready").status_code == 200
    ids = [m.id for m in client.models.list().data]
    assert ids == ["demo-v2"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_matches_offline(server, client, offline, prompt):
    want = greedy(offline, prompt)
    r = client.completions.create(model="demo-v2", prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "length"
    n_prompt = len(offline.get_tokenizer().encode(prompt))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 24)
    chunks = list(client.completions.create(model="demo-v2", prompt=prompt, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices


def test_chat_uses_chat_template(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a cache?"}]
    want = offline.chat([messages], SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)[0].outputs[0].text
    r = client.chat.completions.create(model="demo-v2", messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == want
    assert r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="demo-v2", messages=messages, max_completion_tokens=20,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


def test_stop_strings_n_seed_echo_and_token_prompts(client, offline):
    text = greedy(offline, PROMPTS[0], 24)
    stop = text[5:8]  # a stop string that appears inside the greedy output
    r = client.completions.create(model="demo-v2", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == text[: text.index(stop)] and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="demo-v2", prompt=PROMPTS[1], max_tokens=8, temperature=1.0, n=2, seed=3)
    again = client.completions.create(model="demo-v2", prompt=PROMPTS[1], max_tokens=8, temperature=1.0, n=2, seed=3)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [c.text for c in again.choices]  # seeded: reproducible
    r = client.completions.create(model="demo-v2", prompt=PROMPTS[2], max_tokens=6, temperature=0, echo=True)
    assert r.choices[0].text == PROMPTS[2] + greedy(offline, PROMPTS[2], 6)
    ids = offline.get_tokenizer().encode(PROMPTS[2])
    r = client.completions.create(model="demo-v2", prompt=ids, max_tokens=6, temperature=0)
    assert r.choices[0].text == greedy(offline, PROMPTS[2], 6)
    r = client.completions.create(model="demo-v2", prompt=PROMPTS[:2], max_tokens=6, temperature=0)
    assert [c.text for c in r.choices] == [greedy(offline, p, 6) for p in PROMPTS[:2]]


def test_logprobs(client):
    r = client.completions.create(model="demo-v2", prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(t) == 3 and max(t.values()) <= 0 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    r = client.chat.completions.create(model="demo-v2", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    # greedy: the chosen token is the most likely one
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


def test_32_concurrent_streams(client, offline):
    prompts = [f"{PROMPTS[i % 3]} {i}" for i in range(32)]
    want = [o.outputs[0].text for o in offline.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)]

    def run(p: str) -> str:
        stream = client.completions.create(model="demo-v2", prompt=p, max_tokens=12, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in stream if c.choices)

    with cf.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(run, prompts))
    assert got == want
