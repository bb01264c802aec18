"""vLLM's names on the offline API: LLM(tensor_parallel_size=..., gpu_memory_utilization=...,
trust_remote_code=False), chat_template (--chat-template FILE|STRING), generation_config."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import make_llm

from strata.engine.llm_kwargs import engine_kwargs
from strata.errors import ConfigError
from strata.protocol.tokenizer import Tokenizer, load_chat_template

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"


def test_vllm_keyword_names_are_translated_or_refused_clearly():
    assert engine_kwargs("m", {"tensor_parallel_size": 1, "dtype": "float32", "seed": 3, "max_model_len": 64,
                               "trust_remote_code": False, "tokenizer": "m"}) == {
        "tensor_parallel_size": 1, "dtype": "float32", "seed": 3, "max_model_len": 64}
    with pytest.raises(ConfigError, match="on a CPU give kv_cache_memory"):
        engine_kwargs("m", {"gpu_memory_utilization": 0.9})
    assert engine_kwargs("m", {"gpu_memory_utilization": 0.8, "device": "cuda"})["memory_fraction"] == 0.8
    with pytest.raises(ConfigError, match="runs no code from a checkpoint"):
        engine_kwargs("m", {"trust_remote_code": True})
    with pytest.raises(ConfigError, match="reads the tokenizer from the model directory"):
        engine_kwargs("m", {"tokenizer": "other"})
    with pytest.raises(ConfigError, match="unknown keyword 'max_num_seq'; did you mean 'max_num_seqs'"):
        engine_kwargs("m", {"max_num_seq": 4})


def test_llm_takes_vllm_names_instead_of_a_type_error(llama):
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        make_llm(llama, gpu_memory_utilization=0.9)
    with make_llm(llama, tensor_parallel_size=1, trust_remote_code=False) as llm:
        assert len(llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids) > 0


def test_chat_template_from_a_file_or_a_string(tmp_path, text_model):
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert load_chat_template(str(f)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ConfigError, match="no such file, and not a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    tok = Tokenizer.from_dir(text_model.path, chat_template=str(f))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n[assistant]"
    with pytest.raises(ConfigError, match="does not compile"):
        Tokenizer.from_dir(text_model.path, chat_template="{% for m in messages %}")


def test_llm_chat_uses_the_template_given(text_model):
    with make_llm(text_model, chat_template=TEMPLATE) as llm:
        out = llm.chat([{"role": "user", "content": "The quick brown fox"}],
                       __import__("strata").SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        assert out[0].prompt == "[user] The quick brown fox\n[assistant]"


def _with_gen(tmp_path, llama, gen: dict):
    path = tmp_path / "model"
    shutil.copytree(llama.path, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **gen}))
    return path


def test_generation_config_auto_vllm_or_a_directory(tmp_path, llama):
    path = _with_gen(tmp_path, llama, {"do_sample": True, "temperature": 0.7, "top_k": 5})
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_p": 0.5}))
    with make_llm(path) as llm:
        assert (llm.get_default_sampling_params().temperature, llm.get_default_sampling_params().top_k) == (0.7, 5)
    with make_llm(path, generation_config="vllm") as llm:  # ignored: SamplingParams' own defaults
        p = llm.get_default_sampling_params()
        assert (p.temperature, p.top_k) == (1.0, -1) and 2 in llm.engine.eos_token_ids  # EOS still read
    with make_llm(path, generation_config=str(other)) as llm:
        p = llm.get_default_sampling_params()
        assert (p.temperature, p.top_p, p.top_k) == (0.3, 0.5, -1)
    with pytest.raises(ConfigError, match="neither 'auto'"):
        make_llm(path, generation_config=str(tmp_path / "nope"))
