"""The built-in demo checkpoint: files, weights, caching, and that transformers loads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from strata.demo import model as demo_model
from strata.demo import train_tokenizer
from strata.demo.model import CHECKPOINT_FILES, demo_model_path
from strata.errors import ModelLoadError
from strata.protocol.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def demo_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STRATA_CACHE", str(tmp_path_factory.mktemp("cache")))
        return demo_model_path()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path))
    return tmp_path


def test_checkpoint_files_and_config(demo_path: Path) -> None:
    assert demo_path.name == "demo-v2"
    assert sorted(p.name for p in demo_path.iterdir()) == sorted(CHECKPOINT_FILES)
    config = json.loads((demo_path / "config.json").read_text())
    tok = Tokenizer.from_dir(demo_path)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (384, 1024, 6)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (6, 2, 64)
    assert config["vocab_size"] == tok.vocab_size == 4160 and config["vocab_size"] % 64 == 0
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "bfloat16"
    assert config["bos_token_id"] == tok.bos_token_id
    assert tok.eos_token_id in config["eos_token_id"]
    generation = json.loads((demo_path / "generation_config.json").read_text())
    assert generation["do_sample"] is False and generation["eos_token_id"] == config["eos_token_id"]
    for name in demo_model.PACKAGE_FILES:
        assert (demo_path / name).read_bytes() == resources.files("strata.demo").joinpath(name).read_bytes()


def test_weights_are_the_shipped_trained_ones(demo_path: Path) -> None:
    weights = load_file(demo_path / "model.safetensors")
    config = json.loads((demo_path / "config.json").read_text())
    assert {k: tuple(v.shape) for k, v in weights.items()} == demo_model.weight_shapes(config)
    assert "lm_head.weight" not in weights
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (128, 384)
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    shipped = resources.files("strata.demo").joinpath(demo_model.WEIGHTS_FILE).read_bytes()
    assert (demo_path / "model.safetensors").read_bytes() == shipped
    assert (demo_path / "model.safetensors").stat().st_size <= 25 * 2**20
    # trained, not initialised: the norms have moved away from one
    assert not torch.equal(weights["model.norm.weight"], torch.ones_like(weights["model.norm.weight"]))


def test_demo_model_predicts_held_out_shakespeare(demo_path: Path) -> None:
    """Next-token loss on unseen text far below chance (ln 4160 = 8.3 nats): the weights are trained."""
    from strata.graph.loader import load_model
    from strata.train.data import data_files, tokenize
    from strata.train.model_init import load_tokenizer

    text = data_files([str(train_tokenizer.CORPUS_DIR.parent / "heldout" / "twelfth_night.txt")])
    stream = tokenize(text, load_tokenizer(demo_path), 1, 2, num_workers=0)[:2049]
    model = load_model(demo_path, torch.float32)
    ids = stream[None].long()
    with torch.no_grad():
        logits = model.compute_logits(model(ids[:, :-1], torch.arange(2048)[None]))
    loss = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:]).item()
    assert loss < 5.0, loss  # shipped weights: 4.55 here (the cast list opens the play), 3.69 over both plays


def test_demo_writes_english_words(demo_path: Path) -> None:
    """What `make demo` shows: the generated words are words of the corpus, not gibberish."""
    import re

    from strata.engine.llm import LLM
    from strata.protocol.sampling_params import SamplingParams

    corpus = train_tokenizer.read_corpus(train_tokenizer.CORPUS_DIR)
    vocabulary = set(re.findall(r"[a-z']+", corpus.lower()))
    with LLM(model=str(demo_path), dtype="float32") as llm:
        outs = llm.generate(["To be, or not to be", "My lord, the king"],
                            SamplingParams(max_tokens=48, temperature=0.8, seed=0))
    for out in outs:
        words = re.findall(r"[a-z']+", out.outputs[0].text.lower())
        assert len(words) >= 15, out.outputs[0].text
        known = sum(w in vocabulary for w in words) / len(words)
        assert known >= 0.8, (known, out.outputs[0].text)


def test_reuse_and_determinism(demo_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stamp = (demo_path / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setenv("STRATA_CACHE", str(demo_path.parent))
    assert demo_model_path() == demo_path
    assert (demo_path / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    monkeypatch.setenv("STRATA_CACHE", str(cache))
    fresh = demo_model_path()
    assert fresh == cache / "demo-v2"
    for name in CHECKPOINT_FILES:
        assert (fresh / name).read_bytes() == (demo_path / name).read_bytes(), name


def test_concurrent_callers_get_one_complete_checkpoint(cache: Path) -> None:
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: demo_model_path(), range(4)))
    assert paths == [cache / "demo-v2"] * 4
    assert [p.name for p in cache.iterdir()] == ["demo-v2"]  # no temp dirs left behind
    assert load_file(cache / "demo-v2" / "model.safetensors")["model.norm.weight"].shape == (384,)


def test_incomplete_checkpoint_is_rebuilt(cache: Path) -> None:
    broken = cache / "demo-v2"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    path = demo_model_path()
    assert sorted(p.name for p in path.iterdir()) == sorted(CHECKPOINT_FILES)


def test_unwritable_cache_is_a_model_load_error(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (cache / "file").write_text("")
    monkeypatch.setenv("STRATA_CACHE", str(cache / "file" / "sub"))
    with pytest.raises(ModelLoadError, match="STRATA_CACHE"):
        demo_model_path()


def test_building_does_not_import_transformers(cache: Path) -> None:
    code = (
        "import sys; from strata.demo.model import demo_model_path; demo_model_path(); "
        "bad = [m for m in sys.modules if m.split('.')[0] == 'transformers']; assert not bad, bad"
    )
    repo = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})


def test_transformers_loads_model_and_tokenizer(demo_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(demo_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    weights = load_file(demo_path / "model.safetensors")
    assert torch.equal(model.model.embed_tokens.weight.float(), weights["model.embed_tokens.weight"].float())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    hf_tok = transformers.AutoTokenizer.from_pretrained(demo_path)
    ours = Tokenizer.from_dir(demo_path)
    text = "The café in 東京 serves 3 naïve robots 🤖."
    ids = hf_tok(text)["input_ids"]
    assert ids == ours.encode(text) and ids[0] == ours.bos_token_id
    assert hf_tok.decode(ids, skip_special_tokens=True) == text
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 4160) and torch.isfinite(logits).all()


def test_shipped_tokenizer_is_reproducible() -> None:
    files = train_tokenizer.render(train_tokenizer.CORPUS_DIR)
    for name, text in files.items():
        assert (train_tokenizer.DEMO_DIR / name).read_text(encoding="utf-8") == text, f"rerun train_tokenizer: {name}"
    assert train_tokenizer.main(["--check"]) == 0


def test_corpus_is_the_documented_public_domain_texts() -> None:
    root = train_tokenizer.CORPUS_DIR.parent
    readme = (root / "README.md").read_text(encoding="utf-8")
    assert "public domain" in readme and "CC BY 2.5" in readme
    train, heldout = sorted(root.glob("train/*.txt")), sorted(root.glob("heldout/*.txt"))
    assert len(train) == 40 and len(heldout) == 2
    assert not {p.name for p in train} & {p.name for p in heldout}  # held out means never trained on
    for f in train + heldout:
        assert f"| {f.name} |" in readme, f"{f.name} is not listed with its source in data/shakespeare/README.md"
    assert 4_000_000 <= sum(f.stat().st_size for f in train) <= 6_000_000
