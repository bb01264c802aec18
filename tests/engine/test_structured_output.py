"""Structured output (engine/grammar.py): every output is in its grammar; other rows are untouched."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from conftest import make_llm, make_tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from structured_schemas import object_schemas, schemas

from strata import SamplingParams
from strata.demo.random_tokenizer import write_tokenizer
from strata.errors import RequestError
from strata.protocol.sampling_params import StructuredOutput
from strata.protocol.structured import close_objects

DEMO_VOCAB = 4160  # the demo tokenizer's: a byte-level BPE that can spell any JSON


@pytest.fixture(scope="module")
def json_llm(tmp_path_factory):
    """A tiny random Llama with the demo's byte-level tokenizer."""
    model = make_tiny_model("llama", tmp_path_factory.mktemp("structured") / "m", seed=3, vocab_size=DEMO_VOCAB)
    write_tokenizer(model.path, DEMO_VOCAB)
    llm = make_llm(model, max_model_len=256, kv_cache_memory="16MiB", max_num_seqs=64)
    yield llm
    llm.close()


def _run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


@settings(max_examples=1)
@given(st.lists(st.one_of(object_schemas, schemas), min_size=200, max_size=200))
def test_200_random_schemas_all_validate_at_temperature_1(json_llm, drawn):
    params = [SamplingParams(temperature=1.0, max_tokens=248, seed=i, structured=StructuredOutput(json=s))
              for i, s in enumerate(drawn)]
    outs = _run(json_llm, ["Answer in JSON:"] * len(drawn), params)
    for schema, out in zip(drawn, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)


def test_constrained_rows_leave_the_others_alone(json_llm):
    """Greedy unconstrained requests get the same tokens with constrained ones beside them."""
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["The quick brown", "Stop strings end", "A paged cache"]
    alone = [o.outputs[0].token_ids for o in _run(json_llm, prompts, [plain] * 3)]
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
    mixed_params = [plain, SamplingParams(temperature=1.0, seed=1, max_tokens=50, structured=StructuredOutput(json=schema)),
                    plain, SamplingParams(temperature=0.0, max_tokens=50, structured=StructuredOutput(regex="[0-9]{4}")),
                    plain]
    mixed = _run(json_llm, [prompts[0], "x", prompts[1], "y", prompts[2]], mixed_params)
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    assert re.fullmatch("[0-9]{4}", mixed[3].outputs[0].text)
    assert json.loads(mixed[1].outputs[0].text)["a"] in range(10)


def test_choice_regex_json_object_and_lark(json_llm):
    choices = ["yes", "no", "not sure"]
    kinds = [StructuredOutput(choice=choices), StructuredOutput(regex=r"[a-c]{2}-\d{2}"),
             StructuredOutput(json_object=True), StructuredOutput(grammar='start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]/')]
    outs = _run(json_llm, ["q"] * 4, [SamplingParams(temperature=1.0, seed=7, max_tokens=300, structured=k)
                                      for k in kinds])
    texts = [o.outputs[0].text for o in outs]
    assert texts[0] in choices
    assert re.fullmatch(r"[a-c]{2}-\d{2}", texts[1])
    assert isinstance(json.loads(texts[2]), dict)
    assert re.fullmatch(r"\([0-9](\+[0-9])*\)", texts[3])
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_n_greater_than_one_and_preemption(tmp_path_factory):
    """Each of n completions follows its own matcher; a preempted sequence keeps its grammar state."""
    model = make_tiny_model("llama", tmp_path_factory.mktemp("structured_small") / "m", seed=4, vocab_size=DEMO_VOCAB)
    write_tokenizer(model.path, DEMO_VOCAB)
    # room for 256 tokens: 8 requests x n=2 of ~40-100 tokens each preempt each other
    llm = make_llm(model, max_model_len=256, kv_cache_memory=model.kv_bytes_for(256), max_num_seqs=16)
    try:
        schema = {"type": "array", "items": {"type": "string", "minLength": 30, "maxLength": 40},
                  "minItems": 3, "maxItems": 3}
        params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=200, structured=StructuredOutput(json=schema))
        outs = _run(llm, ["go"] * 8, params)
        assert sum(o.num_preemptions for o in outs) > 0  # the test exercised preemption
        for o in outs:
            for c in o.outputs:
                jsonschema.validate(json.loads(c.text), schema)
    finally:
        llm.close()


@pytest.mark.parametrize("bad, words", [
    (StructuredOutput(json={"type": "object", "properties": {"a": {"type": "foo"}}}), "Invalid type: foo"),
    (StructuredOutput(json={"not": {"type": "string"}}), "not"),
    (StructuredOutput(json="{not json"), "not valid JSON"),
    (StructuredOutput(regex="[a-z"), "regex"),
    (StructuredOutput(grammar="start: undefined_rule"), "grammar"),
    (StructuredOutput(), "exactly one"),
    (StructuredOutput(regex="a", choice=["b"]), "exactly one"),
    (StructuredOutput(choice=[]), "non-empty"),
    ({"jsonn": {}}, "StructuredOutput"),
])
def test_bad_structured_output_is_a_clear_error(json_llm, bad, words):
    with pytest.raises(RequestError, match=re.escape(words)):
        _run(json_llm, ["q"], SamplingParams(max_tokens=4, structured=bad))
    assert not json_llm.engine.has_unfinished()


def test_structured_needs_a_tokenizer(tiny_models):
    llm = make_llm(tiny_models["llama"])  # token-id checkpoint: no tokenizer.json
    try:
        with pytest.raises(RequestError, match="tokenizer"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, structured=StructuredOutput(regex="a")),
                         use_tqdm=False)
    finally:
        llm.close()


def test_close_objects_only_closes_object_schemas():
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {}}},
                                               "items": {"type": "array", "items": {"type": "object"}}},
              "$defs": {"d": {"properties": {"y": {"type": "integer"}}}}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert set(closed["properties"]) == {"properties", "items"}  # property names left alone
    assert closed["properties"]["items"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["items"]
    assert close_objects({"type": "object", "additionalProperties": True}) == {"type": "object", "additionalProperties": True}


@settings(max_examples=1)
@given(st.lists(object_schemas, min_size=40, max_size=40))
def test_speculative_decoding_keeps_structured_output_exact(json_llm, schemas):
    """Verify rows are masked by the grammar after their draft prefix: greedy outputs equal those
    without speculation, and every sampled one still validates."""
    from strata.engine import speculative

    spec_llm = make_llm(json_llm.engine.model_path, max_model_len=256, kv_cache_memory="16MiB", max_num_seqs=64,
                        speculative_model="ngram", num_speculative_tokens=4, prompt_lookup_min=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(speculative, "MIN_SAMPLES", 10**9)  # never pause: exercise the verify path
        _spec_checks(json_llm, spec_llm, schemas)


def _spec_checks(json_llm, spec_llm, schemas):
    # plus one whose output repeats itself, so that some drafts are right whatever the model
    schemas = [*schemas, {"type": "array", "items": {"const": "to be or not"}, "minItems": 12, "maxItems": 12}]
    try:
        greedy = [SamplingParams(temperature=0.0, max_tokens=200, structured=StructuredOutput(json=s)) for s in schemas]
        want = [o.outputs[0].token_ids for o in _run(json_llm, ["JSON:"] * len(schemas), greedy)]
        got = [o.outputs[0].token_ids for o in _run(spec_llm, ["JSON:"] * len(schemas), greedy)]
        assert got == want
        sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=248, structured=StructuredOutput(json=s))
                   for i, s in enumerate(schemas)]
        for schema, out in zip(schemas, _run(spec_llm, ["JSON:"] * len(schemas), sampled)):
            assert out.outputs[0].finish_reason == "stop"
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
        stats = spec_llm.engine.scheduler.speculator.stats
        assert stats.drafted > 0 and stats.accepted > 0
    finally:
        spec_llm.close()
