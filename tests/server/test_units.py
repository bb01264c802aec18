"""Pieces of the server that need no running server: placement, protocol, the random tokenizer."""

from __future__ import annotations

import pytest

from strata.hardware.cores import server_layout
from strata.protocol.sampling_params import SamplingParams
from strata.protocol.wire import decode, encode, params_from_dict, params_to_dict


def test_layout_without_spare_cores_shares_all_cpus():
    lay = server_layout(None, None, cpus=[0, 1])
    assert lay.compute_cpus is None and lay.tokenizer_workers == 1
    assert server_layout(0, None, cpus=[0, 1]).tokenizer_workers == 0


def test_layout_pins_workers_to_spare_cores():
    lay = server_layout(None, 2, cpus=[0, 1, 2, 3])
    assert lay.compute_threads == 2
    assert set(lay.compute_cpus).isdisjoint(lay.tokenizer_cpus)
    assert lay.tokenizer_workers == 2 and len(lay.tokenizer_cpus) == 2


def test_layout_keeps_a_core_in_eight_for_the_front_end_on_big_machines():
    lay = server_layout(None, None, cpus=list(range(16)))
    assert lay.compute_threads == 14 and lay.tokenizer_workers == 2


def test_protocol_round_trip_is_msgpack_not_pickle():
    params = SamplingParams(n=2, temperature=0.5, stop=["\n"], seed=7, logprobs=3)
    msg = {"op": "add", "id": "r1", "prompt_ids": [1, 2, 3], "params": params_to_dict(params)}
    data = encode(msg)
    assert not data.startswith(b"\x80")  # a pickle stream starts with PROTO
    back = decode(data)
    assert back["prompt_ids"] == [1, 2, 3]
    assert params_from_dict(back["params"]) == params
    with pytest.raises(ValueError, match="msgpack map"):
        decode(encode([1, 2]))


def test_random_model_tokenizer_covers_the_vocabulary(tmp_path):
    from strata.demo.model import demo_model_path
    from strata.demo.random_tokenizer import write_tokenizer
    from strata.protocol.tokenizer import Tokenizer

    write_tokenizer(tmp_path, 5000)
    tok, demo = Tokenizer.from_dir(tmp_path), Tokenizer.from_dir(demo_model_path())
    assert tok.vocab_size == 5000
    text = "The five layers of an LLM system"
    assert tok.encode(text) == demo.encode(text)  # same merges and specials
    assert tok.decode([4999]) == " w4999"  # padded ids decode as words
    assert (tok.bos_token_id, tok.eos_token_id) == (demo.bos_token_id, demo.eos_token_id)
