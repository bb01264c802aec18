"""The streaming loader (issue 43, item 1): projections reach their final storage (bf16, int8,
int4) tensor by tensor as the checkpoint is read, bit-identical to converting a loaded model
afterwards, and a load's peak memory is the plan's (final weights + STAGING_BYTES), never a
float copy of the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from strata.demo import random_models as rm
from strata.demo.shapes import SHAPES
from strata.graph import loader
from strata.graph.safetensors_file import SafetensorsFile
from strata.memory.bf16_weights import narrow_model
from strata.memory.quant import quantize_model
from strata.model_config import ModelConfig

STORAGES = [None, "bf16", "int8", "int4"]


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    out.update((n, b) for n, b in model.named_buffers() if "rotary" not in n)
    return out


@pytest.mark.parametrize("storage", STORAGES, ids=lambda s: s or "fp32")
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "phi3", "gemma3"])
def test_streamed_storage_equals_converting_afterwards(tiny_models, family, storage):
    """Tied (llama) and untied (mistral) embeddings, q/k/v biases (qwen2), pre-fused checkpoints
    (phi3), extra norms (gemma3): the same tensors, bit for bit, as load-then-convert."""
    path = tiny_models[family].path
    before = loader.load_model(path, torch.float32, max_positions=64)
    if storage == "bf16":
        narrow_model(before)
    elif storage is not None:
        quantize_model(before, storage, 32)
    streamed = loader.load_model(path, torch.float32, max_positions=64, storage=storage, group_size=32)
    a, b = _state(before), _state(streamed)
    assert a.keys() == b.keys()
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a), \
        [k for k in a if not torch.equal(a[k], b[k])]
    assert type(streamed.embed_tokens) is type(before.embed_tokens)
    ids = torch.tensor([[3, 7, 11, 5]])
    torch.testing.assert_close(streamed.embed_tokens(ids), before.embed_tokens(ids), rtol=0, atol=0)


def test_tied_embedding_stays_one_tensor(tiny_models):
    """A tied bf16 model keeps one bf16 matrix for its embedding and head after streaming."""
    m = loader.load_model(tiny_models["llama"].path, torch.float32, max_positions=64, storage="bf16")
    assert m.lm_head.weight is m.embed_tokens.weight and m.lm_head.weight.dtype == torch.bfloat16


def test_reader_reads_rows_into_the_callers_buffer(tiny_models):
    """read_rows fills the given buffer itself (no other copy), and any row range reads right."""
    from safetensors.torch import load_file

    file = tiny_models["mistral"].path / "model.safetensors"
    ref = load_file(str(file))
    with SafetensorsFile(file) as f:
        assert set(f.names()) == set(ref)
        name = "lm_head.weight"
        out = torch.empty(f.shape(name), dtype=f.dtype(name))
        got = f.read_rows(name, 0, f.shape(name)[0], out=out)
        assert got.data_ptr() == out.data_ptr() and torch.equal(out, ref[name])
        assert torch.equal(f.read_rows(name, 5, 9), ref[name][5:9])


def _one_gb_config() -> dict:
    """A ~0.5B-parameter Llama shape (untied: its fp32 embedding stays fp32 when quantised) whose bf16
    checkpoint is ~1 GB, in ~200 MB shards."""
    return dict(SHAPES["tiny"], hidden_size=1024, intermediate_size=4096, num_hidden_layers=28,
                num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=32000,
                tie_word_embeddings=False, max_position_embeddings=256)


@pytest.fixture(scope="module")
def one_gb_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("big") / "ckpt"
    rm.write_random_checkpoint(out, _one_gb_config(), seed=0, sharded=True, max_shard_bytes=200 << 20)
    return out


# VmHWM, the kernel's high-water mark of this process's RSS (ru_maxrss would not do: it keeps the
# forking parent's across exec, and pytest's is large)
_CHILD = textwrap.dedent("""
    import json, re, sys, psutil, torch
    import torch._dynamo  # imported by any engine before its load (engine/build.import_apart): not the load's
    from strata.graph.loader import load_model
    from strata.memory.quant import model_weight_bytes
    path, storage = sys.argv[1], (sys.argv[2] if sys.argv[2] != "none" else None)
    base = psutil.Process().memory_info().rss
    model = load_model(path, torch.float32, max_positions=256, storage=storage, group_size=64)
    status = open("/proc/self/status").read()
    peak = int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1)) * 1024
    print(json.dumps({"growth": peak - base, "weights": model_weight_bytes(model)}))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc/self/status (VmHWM)")
@pytest.mark.parametrize("storage", ["bf16", "int8", "int4"])
def test_load_peak_stays_within_the_plan(one_gb_checkpoint, storage):
    """RSS high-water mark of a fresh process loading a ~1 GB bf16 checkpoint into fp32 activations
    with `storage` projections: its growth over the process before the load stays within
    load_peak_bytes (final weights + staging) and far below the fp32 model it used to build first."""
    cfg = ModelConfig.from_file(one_gb_checkpoint / "config.json")
    run = subprocess.run([sys.executable, "-c", _CHILD, str(one_gb_checkpoint), storage],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    plan = loader.load_peak_bytes(cfg, torch.float32, 256, storage, 64)
    fp32_model = loader.model_bytes(cfg, torch.float32, 256)
    assert got["weights"] <= loader.model_bytes(cfg, torch.float32, 256, storage, 64)
    assert got["growth"] <= plan, (storage, got, plan)
    assert got["growth"] < got["weights"] + fp32_model // 4, "a float copy of the model was made"


def test_plan_names_the_load_peak_in_the_refusal(one_gb_checkpoint, monkeypatch):
    """Too little memory for int8: refused before allocating, with the int4 fix and its size."""
    import psutil

    cfg = ModelConfig.from_file(one_gb_checkpoint / "config.json")
    need = loader.load_peak_bytes(cfg, torch.float32, 256, "int8", 64)
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=need - 1))
    with pytest.raises(loader.ModelLoadError) as err:
        loader.load_model(one_gb_checkpoint, torch.float32, max_positions=256, storage="int8")
    msg = str(err.value)
    assert f"{need:,} bytes" in msg and "int8 projections" in msg and "--quantization int4" in msg, msg


@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_untied_bf16_embedding_stays_bf16_when_quantised(tiny_models, tmp_path, storage):
    """An untied embedding read from a bf16 checkpoint keeps 2 bytes a weight in an fp32 model
    (exact: bf16 widens to fp32 losslessly), and the plan's weight bytes say so."""
    import shutil

    from safetensors.torch import load_file, save_file

    from strata.memory.bf16_weights import WidenedEmbedding
    from strata.memory.planner import weight_bytes
    from strata.memory.quant import model_weight_bytes

    dst = tmp_path / "bf16"
    shutil.copytree(tiny_models["mistral"].path, dst)
    f = dst / "model.safetensors"
    save_file({k: v.bfloat16() for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    cfg_file = dst / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "torch_dtype": "bfloat16"}))
    m = loader.load_model(dst, torch.float32, max_positions=64, storage=storage, group_size=32)
    assert isinstance(m.embed_tokens, WidenedEmbedding) and m.embed_tokens.weight.dtype == torch.bfloat16
    ids = torch.tensor([[1, 9, 40]])
    want = load_file(f)["model.embed_tokens.weight"].float()[ids]
    assert torch.equal(m.embed_tokens(ids), want)
    cfg = ModelConfig.from_file(cfg_file)
    assert model_weight_bytes(m) == weight_bytes(cfg, torch.float32, storage, 32)
    from conftest import make_llm

    from strata import SamplingParams

    # the same (bf16-valued) weights in an fp32 file keep an fp32 embedding: the same tokens
    wide = tmp_path / "fp32"
    shutil.copytree(dst, wide)
    save_file({k: v.float() for k, v in load_file(f).items()}, wide / "model.safetensors", metadata={"format": "pt"})
    (wide / "config.json").write_text(json.dumps({**json.loads(cfg_file.read_text()), "torch_dtype": "float32"}))
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for path in (dst, wide):
        llm = make_llm(path, dtype="float32", quantization=storage, quantization_group_size=32)
        tokens.append([o.outputs[0].token_ids for o in llm.generate([[3, 5, 7, 11], [2, 8]], sp, use_tqdm=False)])
    assert tokens[0] == tokens[1]
