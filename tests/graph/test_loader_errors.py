"""Checkpoints that cannot be loaded fail with ModelLoadError naming the file, tensor or fix; a model
that does not fit in memory is refused before anything is allocated (config.json field errors:
test_config_validation.py)."""

from __future__ import annotations

import json
import pathlib
import pickle
import shutil
import struct

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from strata import LLM
from strata.errors import ModelLoadError
from strata.graph import loader
from strata.graph.loader import load_model
from strata.graph.safetensors_file import SafetensorsFile
from strata.memory.planner import weight_bytes
from strata.model_config import ModelConfig
from strata.text_table import fmt_bytes

TENSOR = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture
def model_copy(tiny_models, tmp_path):
    """A private copy of the tiny Llama checkpoint to break."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_models["llama"].path, dst)
    return dst


def _load(path):
    return load_model(path, torch.float32, "cpu", 64)


def test_good_copy_loads(model_copy, llm_factory):
    assert _load(model_copy) is not None
    llm_factory(model_copy)


def test_unknown_path(tmp_path, llm_factory):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="no-such-model.*does not exist"):
        llm_factory(missing)


def test_path_is_a_file(tmp_path, llm_factory):
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(ModelLoadError, match="not a directory"):
        llm_factory(f)


def test_missing_config(model_copy, llm_factory):
    (model_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        llm_factory(model_copy)


def test_corrupt_config(model_copy, llm_factory):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        llm_factory(model_copy)


class _Boom:
    """Unpickling this creates a marker file: proof that a pickle was (wrongly) loaded."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_pickle_checkpoint_refused_without_unpickling(model_copy, tmp_path, llm_factory):
    (model_copy / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    with open(model_copy / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.embed_tokens.weight": _Boom(str(marker))}, f)
    with pytest.raises(ModelLoadError) as err:
        llm_factory(model_copy)
    msg = str(err.value)
    assert "pytorch_model.bin" in msg
    assert "safetensors" in msg and "onvert" in msg, msg  # tells how to convert
    assert not marker.exists(), "the pickle checkpoint was unpickled"


def test_no_weights_at_all(model_copy, llm_factory):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        llm_factory(model_copy)


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.0001], ids=["half", "most", "header-cut"])
def test_truncated_safetensors_names_file(model_copy, keep, llm_factory):
    f = model_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: max(10, int(len(data) * keep))])
    with pytest.raises(ModelLoadError, match="model.safetensors") as err:
        llm_factory(model_copy)
    assert "truncated" in str(err.value) or "corrupt" in str(err.value)


def _rewrite(path, edit):
    f = path / "model.safetensors"
    sd = load_file(str(f))
    edit(sd)
    save_file(sd, str(f), metadata={"format": "pt"})


def _edit_header(path, edit):
    """Rewrite model.safetensors' JSON header with `edit(header)` applied, the data bytes untouched."""
    f = path / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _by_offset(header):
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


# Each edit breaks one tensor's entry and returns its name (the data bytes stay as they were).
def _as_f16(h):  # the case: F16 claimed over F32-sized bytes
    h[TENSOR]["dtype"] = "F16"
    return TENSOR


def _past_end(h):  # the last tensor moved 16 bytes on, its length kept
    last = _by_offset(h)[-1]
    h[last]["data_offsets"] = [o + 16 for o in h[last]["data_offsets"]]
    return last


def _overlapping(h):  # a tensor moved 4 bytes back over its neighbour, its length kept
    h[TENSOR]["data_offsets"] = [o - 4 for o in h[TENSOR]["data_offsets"]]
    return TENSOR


def _begin_after_end(h):
    h[TENSOR]["data_offsets"] = h[TENSOR]["data_offsets"][::-1]
    return TENSOR


def _negative_begin(h):
    h[TENSOR]["data_offsets"] = [o - (1 << 40) for o in h[TENSOR]["data_offsets"]]
    return TENSOR


@pytest.mark.parametrize("edit, says", [
    (_as_f16, r"F16 .* take \d+ bytes"), (_past_end, r"data section holds bytes \[0, \d+\)"),
    (_overlapping, "overlap"), (_begin_after_end, "is after end"), (_negative_begin, "data section holds"),
], ids=lambda v: v.__name__.strip("_") if callable(v) else "")
def test_header_offsets_checked_before_reading(model_copy, edit, says, monkeypatch):
    broken = []
    _edit_header(model_copy, lambda h: broken.append(edit(h)))
    reads = []
    monkeypatch.setattr(SafetensorsFile, "_read_into", lambda *a: reads.append(a))
    with pytest.raises(ModelLoadError, match=says) as err:
        _load(model_copy)
    msg = str(err.value)
    assert "model.safetensors" in msg and repr(broken[0]) in msg, msg
    assert "corrupt or was edited; re-download or re-convert it" in msg, msg
    assert not reads  # refused from the header alone, before any tensor byte is read


def test_edited_dtype_refused_before_generating(model_copy, llm_factory):
    _edit_header(model_copy, _as_f16)
    with pytest.raises(ModelLoadError, match=TENSOR.replace(".", r"\.")):
        llm_factory(model_copy)


def test_valid_header_with_an_empty_tensor_loads(model_copy):
    """Zero-byte tensors (shape with a 0) share an offset with their neighbour without overlapping."""
    def add_empty(h):
        at = h[TENSOR]["data_offsets"][0]
        h["extra.empty"] = {"dtype": "F32", "shape": [0, 4], "data_offsets": [at, at]}
    _edit_header(model_copy, add_empty)
    with SafetensorsFile(model_copy / "model.safetensors") as f:
        assert f.shape("extra.empty") == (0, 4)
        assert torch.equal(f.read_rows(TENSOR, 0, 2), load_file(str(model_copy / "model.safetensors"))[TENSOR][:2])


def test_missing_tensor_named(model_copy, llm_factory):
    _rewrite(model_copy, lambda sd: sd.pop(TENSOR))
    with pytest.raises(ModelLoadError, match=TENSOR.replace(".", r"\.")):
        llm_factory(model_copy)


def test_missing_untied_lm_head_named(tiny_models, tmp_path, llm_factory):
    dst = tmp_path / "untied"
    shutil.copytree(tiny_models["mistral"].path, dst)
    _rewrite(dst, lambda sd: sd.pop("lm_head.weight"))
    with pytest.raises(ModelLoadError, match=r"lm_head\.weight"):
        llm_factory(dst)


def test_missing_qkv_bias_named(tiny_models, tmp_path, llm_factory):
    dst = tmp_path / "qwen2"
    shutil.copytree(tiny_models["qwen2"].path, dst)
    _rewrite(dst, lambda sd: sd.pop("model.layers.0.self_attn.k_proj.bias"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.k_proj\.bias"):
        llm_factory(dst)


def test_wrong_shape_named(model_copy, llm_factory):
    def edit(sd):
        sd[TENSOR] = torch.zeros(sd[TENSOR].shape[0], sd[TENSOR].shape[1] + 1)

    _rewrite(model_copy, edit)
    with pytest.raises(ModelLoadError, match=TENSOR.replace(".", r"\.")) as err:
        llm_factory(model_copy)
    assert "shape" in str(err.value)


def test_config_disagreeing_with_weights(model_copy, llm_factory):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="shape"):
        llm_factory(model_copy)


def test_unsupported_architecture_lists_supported(model_copy, llm_factory):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as err:
        llm_factory(model_copy)
    msg = str(err.value)
    assert "GPT2LMHeadModel" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg


def test_sharded_checkpoint_with_missing_shard(model_copy, llm_factory):
    index = {"metadata": {}, "weight_map": {TENSOR: "model-00002-of-00002.safetensors"}}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        llm_factory(model_copy)


def test_sharded_checkpoint_loads(model_copy, tiny_models, hf_forward):
    """Split the weights over two shards with an index: same logits as the single file."""
    sd = load_file(str(model_copy / "model.safetensors"))
    (model_copy / "model.safetensors").unlink()
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(model_copy / shard), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(keys, shard)
    (model_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    m = _load(model_copy)
    ids = list(range(3, 23))
    with torch.no_grad():
        got = m.compute_logits(m(torch.tensor([ids]), torch.arange(20)[None]))[0]
    torch.testing.assert_close(got, hf_forward(tiny_models["llama"], ids), atol=1e-4, rtol=0)


# --- a model that does not fit in memory is refused before anything is allocated -------------------

LLAMA2_7B_SHAPES = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=32, head_dim=128, vocab_size=32000, tie_word_embeddings=False)


def _available(monkeypatch, nbytes: int) -> None:
    """psutil reports `nbytes` of available memory (the rest of virtual_memory() is real)."""
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=nbytes))


def test_model_bigger_than_memory_refused_before_allocating(model_copy, monkeypatch):
    """config.json says Llama-2-7B (25 GiB in fp32) over the tiny weights, 1 GiB is available:
    refused with both numbers and the fix, the model never built, RSS not grown."""
    path = model_copy / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **LLAMA2_7B_SHAPES}))
    cfg = ModelConfig.from_file(path)
    need = loader.load_peak_bytes(cfg, torch.float32, 96)
    assert need > 25 * 2**30
    _available(monkeypatch, 2**30)
    built = []
    real_causal_lm = loader.CausalLM
    monkeypatch.setattr(loader, "CausalLM", lambda *a, **k: built.append(a) or real_causal_lm(*a, **k))
    rss = psutil.Process().memory_info().rss
    with pytest.raises(ModelLoadError) as err:
        LLM(model=str(model_copy), dtype="float32", max_model_len=96, kv_cache_memory="1MiB", num_threads=1)
    grown = psutil.Process().memory_info().rss - rss
    msg = str(err.value)
    assert not built, "the model was built before the memory check"
    assert grown < 256 * 2**20, f"RSS grew by {fmt_bytes(grown)} while refusing a {fmt_bytes(need)} model"
    assert str(model_copy) in msg
    assert fmt_bytes(need) in msg and f"{need:,} bytes" in msg, msg  # what the weights need
    assert "1.0 GiB" in msg and f"{2**30:,} bytes" in msg, msg  # what is available
    assert "6.74B parameters in float32" in msg, msg
    assert "--dtype bfloat16" in msg and fmt_bytes(loader.load_peak_bytes(cfg, torch.bfloat16, 96)) in msg, msg
    for smaller in ("int8", "int4"):  # quantising on the way in lowers the peak: offered with its size
        assert f"--quantization {smaller} (needs {fmt_bytes(loader.load_peak_bytes(cfg, torch.float32, 96, smaller))})" in msg, msg
    assert "more than" in msg, msg


def test_memory_check_boundary_uses_available_bytes(model_copy, monkeypatch):
    """The real tiny checkpoint: refused with one byte too few, loaded with exactly enough."""
    cfg = ModelConfig.from_file(model_copy / "config.json")
    need = loader.load_peak_bytes(cfg, torch.float32, 64)
    assert need == weight_bytes(cfg, torch.float32) + 2 * 64 * cfg.head_dim * 4 + loader.STAGING_BYTES
    _available(monkeypatch, need - 1)
    with pytest.raises(ModelLoadError, match=f"needs {fmt_bytes(need)} \\({need:,} bytes") as err:
        _load(model_copy)
    assert f"({need - 1:,} bytes) of available CPU memory" in str(err.value)
    _available(monkeypatch, need)
    assert _load(model_copy) is not None


def test_memory_check_on_cuda_reads_free_device_memory(model_copy, monkeypatch):
    """On CUDA the free memory comes from torch.cuda.mem_get_info (faked: no GPU needed)."""
    cfg = ModelConfig.from_file(model_copy / "config.json")
    need = loader.load_peak_bytes(cfg, torch.bfloat16, 64)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need // 2, 80 * 2**30))
    with pytest.raises(ModelLoadError) as err:
        loader.check_weights_fit(cfg, torch.bfloat16, "cuda:0", 64, model_copy)
    msg = str(err.value)
    assert f"{need:,} bytes" in msg and f"{need // 2:,} bytes) of free memory on cuda:0" in msg, msg
    assert "--dtype bfloat16" not in msg and "a GPU with more than" in msg, msg  # already 16-bit: no smaller dtype
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need, 80 * 2**30))
    loader.check_weights_fit(cfg, torch.bfloat16, "cuda:0", 64, model_copy)
