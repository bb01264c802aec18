"""Models by name through the Hugging Face cache (graph/hub.py), on the real huggingface_hub code path.

No machine here reaches the Hub, so each test lays out a cache directory exactly as the Hub client
writes it (models--ORG--NAME/refs/<branch>, snapshots/<commit>/<file> as relative symlinks into
blobs/<hash>) from tiny random checkpoints, and resolves ids in offline mode, or online against
an endpoint that refuses connections.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from strata import SamplingParams
from strata.errors import ConfigError, ModelLoadError
from strata.graph.hub import HUB_FILES, check_model_dir, hub_cache_dir, is_hub_id, resolve_model

COMMIT_MAIN = "a" * 40
COMMIT_V1 = "b" * 40


def add_snapshot(cache: Path, repo_id: str, commit: str, src: Path, refs: tuple[str, ...] = (),
                 extra: dict[str, bytes] | None = None) -> Path:
    """One commit of `repo_id` in a Hub-layout cache: src's files as blobs, symlinked from the
    snapshot, and refs/<name> holding the commit hash (as huggingface_hub writes them)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    files = {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()} | (extra or {})
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def hub_cache(tmp_path, tiny_models, monkeypatch) -> Path:
    """org/tiny: main = the llama checkpoint (plus a pickle that must never be read), v1 = qwen2's."""
    cache = tmp_path / "hf" / "hub"
    add_snapshot(cache, "org/tiny", COMMIT_MAIN, tiny_models["llama"].path, refs=("main",),
                 extra={"pytorch_model.bin": b"not a pickle: reading it would fail", "training_args.bin": b"x"})
    add_snapshot(cache, "org/tiny", COMMIT_V1, tiny_models["qwen2"].path, refs=("v1",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_ids_and_local_paths():
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("org/name@v1.0")
    for not_id in ("./model", "/abs/model", "name", "a/b/c", "org/name@", "../x/y"):
        assert not is_hub_id(not_id), not_id


def test_cached_main_resolves_to_its_snapshot_and_loads(hub_cache, tiny_models, llm_factory, hf_ref, prompt_of):
    path = resolve_model("org/tiny")
    assert path == hub_cache / "models--org--tiny" / "snapshots" / COMMIT_MAIN
    assert (path / "model.safetensors").is_symlink()  # the Hub layout: snapshot files link into blobs/
    assert (path / "model.safetensors").resolve().parent == hub_cache / "models--org--tiny" / "blobs"
    # the engine reads the safetensors through the symlinks; the pickles beside them are never opened
    llm = llm_factory("org/tiny")
    prompt = prompt_of(3, 12)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_ref(tiny_models["llama"], prompt, 8)


def test_revision_by_branch_tag_or_commit(hub_cache):
    v1 = hub_cache / "models--org--tiny" / "snapshots" / COMMIT_V1
    assert resolve_model("org/tiny@v1") == v1
    assert resolve_model("org/tiny", revision="v1") == v1
    assert check_model_dir("org/tiny", revision=COMMIT_V1) == v1  # a commit hash needs no ref
    assert resolve_model("org/tiny@main") == hub_cache / "models--org--tiny" / "snapshots" / COMMIT_MAIN
    with pytest.raises(ConfigError, match="names revision 'v1' but --revision is 'main'"):
        resolve_model("org/tiny@v1", revision="main")
    with pytest.raises(ModelLoadError, match="org/tiny@v9: not in the Hugging Face cache"):
        resolve_model("org/tiny@v9")


def test_offline_and_not_cached_is_one_line(hub_cache):
    with pytest.raises(ModelLoadError) as e:
        resolve_model("org/missing")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("org/missing: not in the Hugging Face cache " + str(hub_cache))
    assert "HF_HUB_OFFLINE is set" in msg and "--download-dir" in msg


def test_cache_dir_from_hf_home_and_download_dir(tmp_path, monkeypatch, tiny_models):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    add_snapshot(tmp_path / "home" / "hub", "org/tiny", COMMIT_MAIN, tiny_models["llama"].path, refs=("main",))
    assert resolve_model("org/tiny").parent.name == "snapshots"
    other = tmp_path / "dl"
    add_snapshot(other, "org/tiny", COMMIT_V1, tiny_models["qwen2"].path, refs=("main",))
    assert resolve_model("org/tiny", download_dir=str(other)) == other / "models--org--tiny" / "snapshots" / COMMIT_V1


def test_a_local_path_wins_over_a_hub_id(hub_cache, tiny_models, tmp_path, monkeypatch):
    local = tmp_path / "work" / "org" / "tiny"
    shutil.copytree(tiny_models["qwen3"].path, local)
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_model("org/tiny") == Path("org/tiny")


def test_an_incomplete_snapshot_is_refused_offline(hub_cache, tmp_path):
    only_config = tmp_path / "only_config"
    only_config.mkdir()
    (only_config / "config.json").write_text("{}")
    add_snapshot(hub_cache, "org/partial", COMMIT_MAIN, only_config, refs=("main",))
    with pytest.raises(ModelLoadError, match=r"org/partial: the cached snapshot .* has no \*\.safetensors weights"):
        resolve_model("org/partial")


def test_only_safetensors_config_and_tokenizer_files_are_fetched():
    """The allow-list handed to snapshot_download, through huggingface_hub's own filter."""
    from huggingface_hub.utils import filter_repo_objects

    listing = ["model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
               "pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.pth",
               "training_args.bin", "config.json", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "README.md",
               "onnx/model.onnx", "original/consolidated.00.pth", "model.gguf"]
    got = set(filter_repo_objects(listing, allow_patterns=list(HUB_FILES)))
    assert got == {"model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
                   "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "tokenizer.model", "special_tokens_map.json"}


def test_cli_positional_model_and_unreachable_hub(hub_cache, text_model, tmp_path):
    """`strata generate ORG/NAME`: from the cache offline; not cached and the Hub unreachable
    (an endpoint that refuses connections, online mode): one line, exit 2, no traceback."""
    add_snapshot(hub_cache, "org/text", COMMIT_MAIN, text_model.path, refs=("main",))
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1",
           "STRATA_CACHE": str(tmp_path / "strata")}
    cmd = [sys.executable, "-m", "strata", "generate", "org/text", "--prompt", "The quick", "--max-tokens", "3",
           "--dtype", "float32", "--threads", "1", "--ignore-eos"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("The quick") and "3 tokens" in done.stderr
    env = {**env, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
    cmd[4] = "org/not-cached"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("error: org/not-cached is not in the Hugging Face cache " + str(hub_cache))
    assert "could not be downloaded" in lines[0]


def test_positional_and_flag_must_agree():
    from strata.cli import build_parser
    from strata.engine.args import EngineArgs

    args = build_parser().parse_args(["serve", "org/a", "--model", "org/b"])
    with pytest.raises(ConfigError, match="two models given"):
        EngineArgs.from_cli_args(args)
    ea = EngineArgs.from_cli_args(build_parser().parse_args(["serve", "org/a", "--revision", "v2"]))
    assert (ea.model, ea.revision, ea.hub_id()) == ("org/a", "v2", "org/a")
    assert EngineArgs.from_cli_args(build_parser().parse_args(["generate", "org/a"])).model == "org/a"
