"""generation_config.json supplies sampling defaults where a request sets nothing."""

import json
import shutil

from conftest import make_llm


def _with_generation_config(tmp_path, llama, gen: dict):
    path = tmp_path / "model"
    shutil.copytree(llama.path, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **gen}))
    return path


def test_sampling_defaults_come_from_generation_config(tmp_path, llama):
    path = _with_generation_config(
        tmp_path, llama, {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 5}
    )
    llm = make_llm(path)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k) == (0.7, 0.9, 5)
    out = llm.generate([[5, 6, 7]], use_tqdm=False)  # no params: the defaults apply
    assert len(out[0].outputs[0].token_ids) == p.max_tokens or out[0].outputs[0].finish_reason == "stop"


def test_do_sample_false_means_greedy(tmp_path, llama):
    path = _with_generation_config(tmp_path, llama, {"do_sample": False, "temperature": 0.6, "top_k": 0})
    p = make_llm(path).get_default_sampling_params()
    assert p.temperature == 0.0 and p.top_k == -1
