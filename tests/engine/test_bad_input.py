"""Invalid requests are refused by generate() before any work, naming the request index and field."""

from __future__ import annotations

import re

import pytest

from strata import SamplingParams
from strata.errors import CapacityError, ConfigError, RequestError


@pytest.fixture(scope="module")
def llm(tiny_models, llm_factory):
    return llm_factory(tiny_models["llama"], max_model_len=64)


def _assert_nothing_ran(llm, steps_before: int) -> None:
    eng = llm.engine
    assert not eng.has_unfinished()
    assert not eng.scheduler.waiting and not eng.scheduler.running
    assert eng.block_manager.num_free == eng.block_manager.num_blocks
    assert eng.num_steps == steps_before
    eng.check_blocks()


BAD_PARAMS = [
    ("max_tokens", SamplingParams(max_tokens=0)),
    ("max_tokens", SamplingParams(max_tokens=-3)),
    ("temperature", SamplingParams(temperature=-0.5)),
    ("top_p", SamplingParams(top_p=0.0)),
    ("top_p", SamplingParams(top_p=1.5)),
    ("top_k", SamplingParams(top_k=0)),
    ("top_k", SamplingParams(top_k=-2)),
    ("min_p", SamplingParams(min_p=1.5)),
    ("n", SamplingParams(n=0)),
    ("repetition_penalty", SamplingParams(repetition_penalty=0.0)),
    ("presence_penalty", SamplingParams(presence_penalty=3.0)),
    ("min_tokens", SamplingParams(min_tokens=5, max_tokens=2)),
    ("logprobs", SamplingParams(logprobs=-1)),
    ("stop", SamplingParams(stop=[""])),
    ("stop_token_ids", SamplingParams(stop_token_ids=[10**6])),
]


@pytest.mark.parametrize("field,params", BAD_PARAMS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_PARAMS)])
def test_bad_params_rejected_before_work(llm, field, params):
    steps = llm.engine.num_steps
    with pytest.raises(ValueError, match=rf"request 0\b.*{field}") as err:
        llm.generate([5, 6, 7], params, use_tqdm=False)
    assert isinstance(err.value, RequestError)
    _assert_nothing_ran(llm, steps)


def test_bad_request_in_batch_stops_everything(llm):
    """Only request 2 is bad: requests 0 and 1 must not have been queued or run."""
    steps = llm.engine.num_steps
    counter = llm._counter
    good = SamplingParams(temperature=0, max_tokens=4)
    params = [good, good, SamplingParams(top_p=1.5), good]
    with pytest.raises(RequestError, match=r"request 2\b.*top_p"):
        llm.generate([[5, 6], [7, 8, 9], [10, 11], [12]], params, use_tqdm=False)
    _assert_nothing_ran(llm, steps)
    assert llm._counter == counter  # no request id was handed out
    # the engine is still usable afterwards
    outs = llm.generate([[5, 6], [7, 8, 9]], good, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) >= 1 for o in outs)
    _assert_nothing_ran(llm, llm.engine.num_steps)


def test_bad_prompt_in_batch_names_its_index(llm):
    steps = llm.engine.num_steps
    with pytest.raises(RequestError, match=r"request 1\b.*empty"):
        llm.generate([[5, 6], [], [7]], SamplingParams(max_tokens=2), use_tqdm=False)
    _assert_nothing_ran(llm, steps)


@pytest.mark.parametrize(
    "prompt,pattern",
    [
        ([], r"request 0\b.*empty"),
        (list(range(3, 3 + 64)), r"request 0\b.*64 tokens.*max_model_len is 64"),
        (list(range(3, 3 + 100)), r"request 0\b.*100 tokens.*max_model_len"),
        ([5, 10**6], r"request 0\b.*token ids"),
        ([5, -1], r"request 0\b.*token ids"),
    ],
    ids=["empty", "equal-to-max-len", "longer-than-max-len", "id-too-large", "negative-id"],
)
def test_bad_prompts(llm, prompt, pattern):
    steps = llm.engine.num_steps
    with pytest.raises(RequestError, match=pattern):
        llm.generate([prompt] if prompt else [[]], SamplingParams(max_tokens=2), use_tqdm=False)
    _assert_nothing_ran(llm, steps)


def test_text_prompt_without_tokenizer(llm):
    steps = llm.engine.num_steps
    with pytest.raises(RequestError, match="tokenizer"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    _assert_nothing_ran(llm, steps)


def test_mismatched_params_list(llm):
    with pytest.raises(RequestError, match="sampling_params"):
        llm.generate([[5], [6]], [SamplingParams(), SamplingParams(), SamplingParams()], use_tqdm=False)


def test_wrong_prompt_type(llm):
    with pytest.raises(RequestError, match=r"request 1\b"):
        llm.generate([[5], 3.5], SamplingParams(max_tokens=1), use_tqdm=False)


def test_longest_allowed_prompt_runs(llm):
    out = llm.generate(list(range(3, 3 + 63)), SamplingParams(temperature=0, max_tokens=8),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_kv_cache_too_small_is_capacity_error(tiny_models, llm_factory):
    make_llm = llm_factory
    m = tiny_models["llama"]
    per_token = m.kv_bytes_per_token
    with pytest.raises(CapacityError) as err:
        make_llm(m, max_model_len=96, kv_cache_memory=5 * 16 * per_token)  # 6 blocks needed
    msg = str(err.value)
    assert re.search(r"\b5 blocks\b", msg) and re.search(r"\b6 blocks\b", msg), msg
    assert "max_model_len=96" in msg and "80 tokens" in msg
    assert "kv_cache_memory" in msg  # says what to change
    ok = make_llm(m, max_model_len=96, kv_cache_memory=6 * 16 * per_token)
    assert ok.engine.block_manager.num_blocks == 6


def test_duplicate_request_id(llm):
    eng = llm.engine
    eng.add_request("dup", None, [5, 6], SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="dup"):
        eng.add_request("dup", None, [5, 6], SamplingParams(max_tokens=1))
    eng.abort("dup")
    _assert_nothing_ran(llm, eng.num_steps)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_model_len": 1000}, "max_model_len"),  # the model has 256 positions
        ({"max_model_len": 0}, "max_model_len"),
        ({"dtype": "float8"}, "dtype"),
        ({"block_size": 0}, "block_size"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
        ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
        ({"attention_backend": "flash"}, "attention_backend"),
    ],
)
def test_bad_engine_config_names_field(tiny_models, llm_factory, kwargs, field):
    with pytest.raises(ConfigError, match=field):
        llm_factory(tiny_models["llama"], **kwargs)
