"""The random-weight checkpoints: the named shapes' configs, and the bf16 sharded writer of the big
shapes (run here on tiny configs; the 2-16 GB checkpoints themselves are never written by tests)."""

from __future__ import annotations

import json
import math
import weakref

import pytest
import torch
from safetensors import safe_open

from strata import LLM, SamplingParams
from strata.demo import random_models as rm
from strata.demo.shapes import BF16_SHAPES, SHAPES
from strata.model_config import ModelConfig

# tiny Llama (untied: lm_head is a tensor of its own) and tiny Qwen2 (q/k/v biases), big-style
TINY_BF16 = dict(SHAPES["tiny"], tie_word_embeddings=False, torch_dtype="bfloat16")
TINY_QWEN = dict(SHAPES["qwen-0.5b"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512, bos_token_id=1,
                 eos_token_id=2, torch_dtype="bfloat16")
CAP = 300_000  # bytes: above tiny's largest tensor (embedding 1024 x 128 bf16 = 262 kB), so ~5 shards


def _read(path) -> dict[str, torch.Tensor]:
    index = json.loads((path / rm.INDEX).read_text())
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / fname), "pt") as f:
            out |= {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    return out


def test_every_named_shape_parses_and_has_its_real_size():
    for name, shape in SHAPES.items():
        cfg = ModelConfig.from_dict(dict({"torch_dtype": "float32"} | shape), name)
        assert cfg.vocab_size == shape["vocab_size"]
    assert BF16_SHAPES == {"llama-3.2-1b", "qwen2.5-1.5b", "llama-3.2-3b", "qwen2.5-7b", "llama-3.1-8b", "qwen3-moe-2b"}
    # parameter counts of the HF checkpoints (their safetensors totals: 1.24B, 1.54B, 3.21B, 7.62B, 8.03B)
    params = {"llama-3.2-1b": 1_235_814_400, "qwen2.5-1.5b": 1_543_714_304, "llama-3.2-3b": 3_212_749_824,
              "qwen2.5-7b": 7_615_616_512, "llama-3.1-8b": 8_030_261_248}
    for name, n in params.items():
        assert sum(math.prod(s) for _, s, _ in rm.tensor_specs(SHAPES[name])) == n, name
    for name in ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b"):
        rope = ModelConfig.from_dict(SHAPES[name]).rope_scaling
        assert rope["rope_type"] == "llama3" and rope["original_max_position_embeddings"] == 8192
    assert ModelConfig.from_dict(SHAPES["qwen2.5-7b"]).rope_scaling is None


@pytest.mark.parametrize(("cfg", "cap"), [(TINY_BF16, CAP), (TINY_QWEN, 20_000)], ids=["llama", "qwen2"])
def test_sharded_writer_index_covers_every_tensor_and_keeps_the_cap(tmp_path, cfg, cap):
    rm.write_random_checkpoint(tmp_path / "m", cfg, seed=0, sharded=True, max_shard_bytes=cap)
    path = tmp_path / "m"
    index = json.loads((path / rm.INDEX).read_text())
    specs = {name: shape for name, shape, _ in rm.tensor_specs(cfg)}
    assert set(index["weight_map"]) == set(specs)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files == sorted(p.name for p in path.glob("*.safetensors"))
    total = 0
    for fname in files:
        with safe_open(str(path / fname), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        assert nbytes <= cap or len(tensors) == 1  # a tensor over the cap gets a shard of its own
        assert all(t.dtype == torch.bfloat16 for t in tensors.values())
        assert all(index["weight_map"][k] == fname and tuple(t.shape) == specs[k] for k, t in tensors.items())
        total += nbytes
    assert index["metadata"]["total_size"] == total == 2 * sum(math.prod(s) for s in specs.values())
    written = json.loads((path / "config.json").read_text())
    assert written["torch_dtype"] == "bfloat16"
    assert ModelConfig.from_dict(written).vocab_size == cfg["vocab_size"]
    assert not list(tmp_path.glob(".m-*"))  # the temporary directory was renamed into place


def test_values_depend_on_seed_and_name_not_on_shard_size(tmp_path):
    rm.write_random_checkpoint(tmp_path / "small", TINY_QWEN, 5, sharded=True, max_shard_bytes=20_000)
    rm.write_random_checkpoint(tmp_path / "big", TINY_QWEN, 5, sharded=True, max_shard_bytes=100_000_000)
    a, b = _read(tmp_path / "small"), _read(tmp_path / "big")
    assert len(set(json.loads((tmp_path / "big" / rm.INDEX).read_text())["weight_map"].values())) == 1
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    w = a["model.layers.1.mlp.up_proj.weight"].float()
    assert abs(w.std().item() - 0.02) < 0.002
    assert torch.equal(a["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert not torch.equal(w, a["model.layers.0.mlp.up_proj.weight"].float())  # per-name streams
    other = rm.random_tensor("model.layers.1.mlp.up_proj.weight", tuple(w.shape), False, seed=6)
    assert not torch.equal(other.float(), w)
    # drawn in row blocks from one stream: deterministic, and no block repeats another
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rm, "_DRAW_ELEMS", 40 * 7)
        x = rm.random_tensor("x", (30, 40), False, seed=1)
        assert torch.equal(x, rm.random_tensor("x", (30, 40), False, seed=1))
        assert not torch.equal(x[:7], x[7:14])

def test_writer_holds_one_shard_at_a_time(tmp_path, monkeypatch):
    """By construction: when a shard's tensors are generated, and when it is saved, every earlier
    shard's tensors are already freed (neither the writer nor the shard generator keeps a reference)."""
    saved_refs: list[list[weakref.ref]] = []
    real_save, real_tensor = rm.save_file, rm.random_tensor

    def earlier_shards_freed():
        assert all(r() is None for refs in saved_refs for r in refs), "an earlier shard is still held"

    def random_tensor(*args, **kwargs):
        earlier_shards_freed()
        return real_tensor(*args, **kwargs)

    def save_file(tensors, filename, metadata=None):
        earlier_shards_freed()
        real_save(tensors, filename, metadata=metadata)
        saved_refs.append([weakref.ref(t) for t in tensors.values()])

    monkeypatch.setattr(rm, "save_file", save_file)
    monkeypatch.setattr(rm, "random_tensor", random_tensor)
    out = tmp_path / "m"
    out.mkdir()
    rm.write_sharded(TINY_BF16, out, seed=0, max_shard_bytes=CAP)
    assert len(saved_refs) >= 4
    earlier_shards_freed()


def test_sharded_checkpoint_loads_and_generates(tmp_path, monkeypatch, caplog):
    """random_model_path writes a BF16_SHAPES entry as bf16 shards once (a log line per shard), and
    Strata loads and runs it."""
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path))
    monkeypatch.setitem(rm.SHAPES, "tiny-bf16", TINY_BF16)
    monkeypatch.setattr(rm, "BF16_SHAPES", rm.BF16_SHAPES | {"tiny-bf16"})
    monkeypatch.setattr(rm, "SHARD_BYTES", CAP)
    with caplog.at_level("INFO", logger=rm.__name__):
        path = rm.random_model_path("tiny-bf16", seed=0)
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (path / "model.safetensors").exists()
    assert sum("random checkpoint: wrote" in r.getMessage() for r in caplog.records) == len(shards)
    mtimes = [p.stat().st_mtime_ns for p in shards]
    assert rm.random_model_path("tiny-bf16", seed=0) == path  # cached: not written again
    assert [p.stat().st_mtime_ns for p in shards] == mtimes
    llm = LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory="8MiB")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": [5, 17, 300, 9]}], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.close()


def test_moe_shapes_count_total_and_active():
    """The MoE shapes' sizes as documented in demo/shapes.py: every expert stored, top_k read."""
    counts = {"qwen3-moe-2b": (2_033_635_328, 334_942_208), "qwen3-moe-0.2b": (184_236_032, 52_115_456),
              "tiny-moe": (625_408, 330_496)}
    for name, (total, active) in counts.items():
        cfg = ModelConfig.from_dict(dict({"torch_dtype": "float32"} | SHAPES[name]), name)
        assert cfg.moe is not None and all(cfg.moe.sparse)
        assert (cfg.num_params(), cfg.num_params(active=True)) == (total, active), name
        assert sum(math.prod(s) for _, s, _ in rm.tensor_specs(SHAPES[name])) == total
    assert 4 * counts["qwen3-moe-2b"][0] < 24 * 2**30  # fp32 fits the peers' 24 GiB machine


def test_moe_tensor_names_are_transformers_own():
    names = {n: s for n, s, _ in rm.tensor_specs(SHAPES["tiny-moe"])}
    p = "model.layers.1."
    assert names[f"{p}mlp.gate.weight"] == (8, 128)  # the router [experts, hidden]
    assert names[f"{p}mlp.experts.7.gate_proj.weight"] == (64, 128)
    assert names[f"{p}mlp.experts.7.down_proj.weight"] == (128, 64)
    assert names[f"{p}self_attn.q_norm.weight"] == (32,)
    assert not any(".mlp.gate_proj." in n or "lm_head" in n for n in names)  # no dense MLP; tied
    qwen2moe = dict(SHAPES["tiny-moe"], architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                    shared_expert_intermediate_size=96, mlp_only_layers=[0])
    specs = {n: s for n, s, _ in rm.tensor_specs(qwen2moe)}
    assert specs["model.layers.1.mlp.shared_expert.up_proj.weight"] == (96, 128)
    assert specs["model.layers.1.mlp.shared_expert_gate.weight"] == (1, 128)
    assert specs["model.layers.0.mlp.gate_proj.weight"] == (128, 128)  # mlp_only_layers: dense
    assert "model.layers.1.self_attn.q_proj.bias" in specs


def test_moe_checkpoint_sharded_bf16(tmp_path):
    """The MoE tensors go through the same bf16 shard writer (no whole-model copy) and load."""
    cfg = dict(SHAPES["tiny-moe"], torch_dtype="bfloat16")
    rm.write_random_checkpoint(tmp_path / "m", cfg, seed=0, sharded=True, max_shard_bytes=100_000)
    index = json.loads((tmp_path / "m" / rm.INDEX).read_text())
    assert set(index["weight_map"]) == {n for n, _, _ in rm.tensor_specs(cfg)}
    assert len(set(index["weight_map"].values())) > 1
    w = _read(tmp_path / "m")["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert w.dtype == torch.bfloat16 and abs(w.float().std().item() - 0.02) < 0.004


def test_tiny_moe_random_checkpoint_matches_transformers(tmp_path, monkeypatch):
    """tiny-moe's random checkpoint (random_model_path, as --random-model writes it) loads in
    Strata and in transformers; the engine's logits (prefill and paged decode) match within 1e-4."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path))
    path = rm.random_model_path("tiny-moe", seed=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory="4MiB", num_threads=1)
    records = []
    original = llm.engine.sampler

    def sampler(logits, seqs, *rest):
        records.extend((list(s.token_ids), row.detach().clone()) for row, s in zip(logits, seqs))
        return original(logits, seqs, *rest)

    llm.engine.sampler = sampler
    try:
        prompts = [{"prompt_token_ids": [5, 17, 300, 9, 44, 812, 3, 77]}, {"prompt_token_ids": [900, 12, 64]}]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    finally:
        llm.close()
    assert len(records) == 8
    with torch.no_grad():
        for ids, row in records:
            ref = hf(torch.tensor([ids])).logits[0, -1].float()
            torch.testing.assert_close(row.float(), ref, atol=1e-4, rtol=0)
