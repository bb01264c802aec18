"""--tokenizer DIR (engine/build.tokenizer_dir): the tokenizer used instead of the model's, refused
when its ids run past the model's vocabulary, and for a GGUF model checked against the file's own
vocabulary (vLLM's advice is to pass the base model's tokenizer with a GGUF)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from strata.demo.model import demo_model_path
from strata.engine.build import open_checkpoint
from strata.errors import ConfigError
from strata.graph.gguf_model import POINTER
from strata.protocol.tokenizer_dir import tokenizer_dir


@pytest.fixture
def gguf_dir(tmp_path):
    """A derived GGUF model directory (its pointer names an existing file) with the demo tokenizer."""
    d = tmp_path / "derived"
    d.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_path() / name, d / name)
    weights = tmp_path / "m.gguf"
    weights.write_bytes(b"GGUF")
    (d / POINTER).write_text(json.dumps({"files": [str(weights)]}))
    return d


def _copy_demo_tokenizer(dest, edit=None):
    dest.mkdir()
    spec = json.loads((demo_model_path() / "tokenizer.json").read_text())
    if edit:
        edit(spec)
    (dest / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copy(demo_model_path() / "tokenizer_config.json", dest / "tokenizer_config.json")
    return dest


def _vocab_size():
    return json.loads((demo_model_path() / "config.json").read_text())["vocab_size"]


def test_the_same_tokenizer_is_accepted_for_a_gguf(gguf_dir, tmp_path):
    other = _copy_demo_tokenizer(tmp_path / "base")
    assert tokenizer_dir(gguf_dir, str(other), _vocab_size()) == other
    assert tokenizer_dir(gguf_dir, None, _vocab_size()) == gguf_dir


def test_another_vocabulary_is_refused_for_a_gguf(gguf_dir, tmp_path):
    def swap(spec):
        vocab = spec["model"]["vocab"]
        by_id = {i: t for t, i in vocab.items()}
        a, b = by_id[300], by_id[301]
        vocab[a], vocab[b] = 301, 300

    other = _copy_demo_tokenizer(tmp_path / "other", swap)
    with pytest.raises(ConfigError, match=r"vocabulary is not the GGUF's .*id 300"):
        tokenizer_dir(gguf_dir, str(other), _vocab_size())


def test_a_different_pre_tokenizer_is_named_in_a_warning(gguf_dir, tmp_path, caplog):
    def whitespace(spec):
        spec["pre_tokenizer"] = {"type": "Whitespace"}

    other = _copy_demo_tokenizer(tmp_path / "ws", whitespace)
    with caplog.at_level(logging.WARNING, logger="strata.protocol.tokenizer_dir"):
        assert tokenizer_dir(gguf_dir, str(other), _vocab_size()) == other
    assert "encodes differently" in caplog.text


def test_ids_past_the_models_vocabulary_and_missing_files_are_refused(gguf_dir, tmp_path):
    other = _copy_demo_tokenizer(tmp_path / "big")
    with pytest.raises(ConfigError, match=r"past the model's 100-token vocabulary"):
        tokenizer_dir(gguf_dir, str(other), 100)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no tokenizer.json there"):
        tokenizer_dir(gguf_dir, str(tmp_path / "empty"), _vocab_size())


def test_the_checkpoint_takes_the_given_tokenizer(tmp_path):
    """open_checkpoint (the engine's): the tokenizer comes from DIR, its chat template included."""
    other = _copy_demo_tokenizer(tmp_path / "t")
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    ckpt = open_checkpoint(None, tokenizer=str(other))
    assert ckpt.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "<<hi>>"
