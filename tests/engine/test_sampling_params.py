"""SamplingParams.validate: the checks the offline API and the server share, one table.

Each bad value is a RequestError (a ValueError) naming the field, in `param` and in the message.
Construction never raises (LLM.generate reports the bad request's index), and the limits are the
module's constants.
"""

from __future__ import annotations

import math

import pytest

from strata.errors import RequestError
from strata.protocol.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_N,
    MAX_TOP_K,
    MIN_DIVISOR,
    SamplingParams,
)

VOCAB = 4160
FLOATS = ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"]

BAD = [
    *[(name, {name: v}, "finite number") for name in FLOATS
      for v in (math.nan, math.inf, -math.inf, 10**400, True, "0.5", None)],
    ("temperature", {"temperature": -0.5}, "0 (greedy)"),
    ("temperature", {"temperature": MIN_DIVISOR / 10}, f"{MIN_DIVISOR:g}"),
    ("repetition_penalty", {"repetition_penalty": 0.0}, f"{MIN_DIVISOR:g}"),
    ("repetition_penalty", {"repetition_penalty": 1e-300}, f"{MIN_DIVISOR:g}"),
    ("top_p", {"top_p": 0.0}, "(0, 1]"),
    ("min_p", {"min_p": 1.5}, "[0, 1]"),
    ("presence_penalty", {"presence_penalty": 2.5}, "[-2, 2]"),
    ("n", {"n": True}, "integer"),
    ("n", {"n": 0}, f"<= {MAX_N}"),
    ("n", {"n": MAX_N + 1}, f"<= {MAX_N}"),
    ("n", {"n": 1000}, f"<= {MAX_N}"),
    ("n", {"n": 2.0}, "integer"),
    ("max_tokens", {"max_tokens": True}, "integer"),
    ("max_tokens", {"max_tokens": 0}, ">= 1"),
    ("max_tokens", {"max_tokens": 16.0}, "integer"),
    ("max_tokens", {"max_tokens": 2**63}, "2**63"),
    ("min_tokens", {"min_tokens": False}, "integer"),
    ("min_tokens", {"min_tokens": 2**64, "max_tokens": None}, "2**63"),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 2}, "<= max_tokens"),
    ("top_k", {"top_k": 0}, "-1 (disabled)"),
    ("top_k", {"top_k": True}, "-1 (disabled)"),
    ("top_k", {"top_k": MAX_TOP_K + 1}, "-1 (disabled)"),
    ("seed", {"seed": 2**64}, "64 bits"),
    ("seed", {"seed": INT64_MAX + 1}, "64 bits"),
    ("seed", {"seed": INT64_MIN - 1}, "64 bits"),
    ("seed", {"seed": 10**5000}, "64 bits"),  # too long for str(): the message must still be written
    ("seed", {"seed": True}, "64 bits"),
    ("seed", {"seed": 1.5}, "64 bits"),
    ("logprobs", {"logprobs": -1}, ">= 0"),
    ("logprobs", {"logprobs": True}, ">= 0"),
    ("logprobs", {"logprobs": VOCAB + 1}, "vocabulary size"),
    ("stop", {"stop": [""]}, "non-empty strings"),
    ("stop", {"stop": [5]}, "non-empty strings"),
    ("stop", {"stop": 5}, "non-empty strings"),
    ("stop_token_ids", {"stop_token_ids": [VOCAB]}, "[0, 4160)"),
    ("stop_token_ids", {"stop_token_ids": [-1]}, "[0, 4160)"),
    ("stop_token_ids", {"stop_token_ids": [True]}, "[0, 4160)"),
    ("stop_token_ids", {"stop_token_ids": [2**80]}, "[0, 4160)"),
    ("stop_token_ids", {"stop_token_ids": 7}, "list of token ids"),
    ("ignore_eos", {"ignore_eos": 1}, "true or false"),
    ("skip_special_tokens", {"skip_special_tokens": None}, "true or false"),
    ("include_stop_str_in_output", {"include_stop_str_in_output": "yes"}, "true or false"),
]


@pytest.mark.parametrize(("field", "kwargs", "words"), BAD, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(BAD)])
def test_bad_value_names_the_field(field, kwargs, words):
    params = SamplingParams(**kwargs)  # never raises: the error carries the request index
    with pytest.raises(ValueError) as err:
        params.validate(3, VOCAB)
    assert isinstance(err.value, RequestError) and err.value.param == field
    msg = str(err.value)
    assert msg.startswith(f"request 3: {field} ") and words in msg, msg
    assert len(msg) < 400


GOOD = [
    {}, {"temperature": 0}, {"temperature": 0.0}, {"temperature": MIN_DIVISOR}, {"temperature": 2}, {"top_p": 1},
    {"n": MAX_N}, {"seed": INT64_MAX}, {"seed": INT64_MIN}, {"seed": 0}, {"top_k": -1}, {"top_k": MAX_TOP_K},
    {"max_tokens": None, "min_tokens": 10**6}, {"logprobs": 0}, {"logprobs": VOCAB}, {"stop": "x"},
    {"stop": ("a", "b")}, {"stop": None, "stop_token_ids": None}, {"stop_token_ids": (0, VOCAB - 1)},
    {"presence_penalty": -2, "frequency_penalty": 2}, {"repetition_penalty": 1e6},
]


@pytest.mark.parametrize("kwargs", GOOD, ids=[str(i) for i in range(len(GOOD))])
def test_good_values_pass(kwargs):
    p = SamplingParams(**kwargs)
    p.validate(0, VOCAB)
    assert isinstance(p.stop, list) and isinstance(p.stop_token_ids, list)


def test_without_a_vocabulary_only_the_vocabulary_bounds_are_skipped():
    SamplingParams(logprobs=10**6, stop_token_ids=[10**6]).validate()
    with pytest.raises(RequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[2**63]).validate()
