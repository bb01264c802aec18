"""Tensor parallelism from outside the model (strata/graph/tensor_parallel.py).

Two real gloo ranks on loopback (tests/graph/tp_ranks.py, started as subprocesses) load every tiny
family, shard it and run the plain causal forward: logits within 1e-4 of the unsharded model
(fp32, and int8 / int4 against the unsharded quantised model), greedy tokens identical, the
embedding bit-identical; also layer 0's MLP on [rows, hidden] (the fused SwiGLU kernels), and a
prefill + decodes over a paged KV cache sized from the shard's config (the "cpu" backend's numba
fused decode, "sdpa", and graph/fusion.py's fused step of the shard).

Cases beyond the families: llama3 and `mqa_bias` have one KV head (< 2 ranks: replicated);
`mqa_bias` is also tied, has q/k/v, o, gate/up and down biases and an odd vocabulary (the last
vocabulary shard padded); four ranks over llama's 2 KV heads put KV head 1 on ranks 2-3. The rank
pair runs once for all cases (the launch is most of the cost); each case is then checked on its
own. The validation errors are checked in this process, on a model that must be left untouched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import _randomise

from strata.errors import ConfigError
from strata.graph.loader import load_model
from strata.graph.tensor_parallel import (
    check_shardable,
    per_rank_config,
    shard_kv_heads,
    shard_model,
    shard_spec,
)
from strata.memory.quant import quantize_model

WORLD = 2
ATOL = 1e-4
RANKS_SCRIPT = Path(__file__).with_name("tp_ranks.py")
LAUNCH_TIMEOUT_S = 100.0  # the whole rank pair; each collective is bounded at 30 s too
FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3")
CASES = (
    [(f, None, 0) for f in (*FAMILIES, "mqa_bias")]
    + [(f, "int8", 0) for f in (*FAMILIES, "mqa_bias")]
    + [(f, "int4", 32) for f in ("llama", "qwen3", "mqa_bias")]
)


def _case_name(family: str, quant: str | None, group: int) -> str:
    return f"{family}-{quant or 'fp32'}{group or ''}"


@pytest.fixture(scope="module")
def mqa_bias_model(tmp_path_factory) -> Path:
    """A tiny tied Llama with one KV head, every bias, and an odd vocabulary (383)."""
    import transformers as tf

    torch.manual_seed(7)
    cfg = tf.LlamaConfig(
        vocab_size=383, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
        rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
    )
    model = tf.LlamaForCausalLM(cfg)
    _randomise(model, 7)
    path = tmp_path_factory.mktemp("tp_models") / "mqa_bias"
    model.float().eval().save_pretrained(path, safe_serialization=True)
    return path


def _reap(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a kill not taken within 10 s
            pass


def run_ranks(cases: list[dict], out: Path, world_size: int = WORLD,
              timeout_s: float = LAUNCH_TIMEOUT_S) -> None:
    """Start the ranks, wait for all (or the first failure, or the deadline), always reap them."""
    from strata.comm.world import free_port

    out.mkdir(parents=True, exist_ok=True)
    (out / "cases.json").write_text(json.dumps(cases))
    port = free_port()
    # int8 GEMVs on a VNNI CPU round their input to int8 per 64 columns, and a row-parallel shard
    # narrower than that falls back to fp32 inputs: TP=N equals TP=1 exactly for the weight-only
    # arithmetic, which the ranks use here (cpu_quant.int8_int8; docs/design-notes.md)
    base = {**os.environ, "STRATA_INT8_FP32_ACTIVATIONS": "1", "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
            "TP_TEST_TIMEOUT_S": "30"}
    procs: list[subprocess.Popen] = []
    logs = [out / f"log.rank{r}.txt" for r in range(world_size)]
    try:
        for r in range(world_size):
            env = {**base, "RANK": str(r), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world_size)}
            with open(logs[r], "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(RANKS_SCRIPT), str(out / "cases.json"), str(out)],
                    env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                ))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.1)
    finally:
        _reap(procs)
    codes = [p.returncode for p in procs]
    if codes != [0] * world_size:
        tails = "\n".join(f"--- rank {r} (exit {c}) ---\n{logs[r].read_text(errors='replace')[-3000:]}"
                          for r, c in enumerate(codes))
        done = sorted(p.name for p in out.glob("*.rank*.json"))
        raise AssertionError(f"tensor-parallel ranks failed (exit codes {codes}; still running after "
                             f"{timeout_s:.0f} s: None; results written: {done}):\n{tails}")


@pytest.fixture(scope="module")
def rank_results(tiny_models, mqa_bias_model, tmp_path_factory):
    """name -> ([per-rank tensors], [per-rank facts]) for every case, from one launch of the ranks."""
    from safetensors.torch import load_file

    paths = {f: str(tiny_models[f].path) for f in FAMILIES} | {"mqa_bias": str(mqa_bias_model)}
    cases = [{"name": _case_name(f, q, g), "path": paths[f], "quant": q, "group_size": g or 64,
              "fuse": q is None} for f, q, g in CASES]
    out = tmp_path_factory.mktemp("tp_out")
    run_ranks(cases, out)
    return {
        c["name"]: ([load_file(str(out / f"{c['name']}.rank{r}.safetensors")) for r in range(WORLD)],
                    [json.loads((out / f"{c['name']}.rank{r}.json").read_text()) for r in range(WORLD)])
        for c in cases
    }


@pytest.mark.parametrize("family,quant,group", CASES, ids=[_case_name(*c) for c in CASES])
def test_sharded_forward_matches_unsharded(rank_results, family, quant, group):
    tensors, facts = rank_results[_case_name(family, quant, group)]
    ref = tensors[0]
    for r in range(WORLD):
        got = tensors[r]
        torch.testing.assert_close(got["tp_logits"], ref["ref_logits"], atol=ATOL, rtol=0)
        assert got["tp_greedy"].tolist() == ref["ref_greedy"].tolist()
        torch.testing.assert_close(got["tp_mlp"], ref["ref_mlp"], atol=ATOL, rtol=0)
        for backend in ("cpu", "sdpa"):  # the paged step: prefill, then decodes
            torch.testing.assert_close(got[f"tp_paged_{backend}"], ref[f"ref_paged_{backend}"], atol=ATOL, rtol=0)
        assert torch.equal(got["tp_embed"], ref["ref_embed"])  # a sum with exact zeros
        if quant is None:  # the fused step (graph/fusion.py) of the shard, on the paged path
            assert facts[r]["fusion_counts"] == facts[r]["fusion_expected"]
            torch.testing.assert_close(got["tp_fused_paged_cpu"], ref["ref_paged_cpu"], atol=ATOL, rtol=0)
    # every rank returns the full logits: the same ones
    assert torch.equal(tensors[0]["tp_logits"], tensors[1]["tp_logits"])


@pytest.mark.parametrize("family", [*FAMILIES, "mqa_bias"])
def test_each_rank_holds_its_share(rank_results, tiny_models, mqa_bias_model, family):
    _, facts = rank_results[_case_name(family, None, 0)]
    path = mqa_bias_model if family == "mqa_bias" else tiny_models[family].path
    from strata.model_config import ModelConfig

    cfg = ModelConfig.from_file(Path(path) / "config.json")
    kv = max(1, cfg.num_kv_heads // WORLD)
    for f in facts:
        assert (f["heads"], f["kv_heads"]) == (cfg.num_heads // WORLD, kv)
        assert (f["config_heads"], f["config_kv_heads"]) == (f["heads"], f["kv_heads"])
        assert f["q_size"] == f["heads"] * cfg.head_dim and f["kv_size"] == kv * cfg.head_dim
        assert f["qkv_out"] == f["q_size"] + 2 * f["kv_size"]
        assert f["intermediate"] == cfg.intermediate_size // WORLD
        assert f["head_rows"] == -(-cfg.vocab_size // WORLD)
        assert f["tied_float"] == cfg.tie_word_embeddings
        assert f["shard_bytes"] < 0.75 * f["full_bytes"]
    for name in (_case_name(family, "int8", 0),):
        for f in rank_results[name][1]:
            assert f["tied_quant"] == cfg.tie_word_embeddings  # the QuantEmbedding reads the shard's head


def test_four_ranks_give_each_its_query_heads_kv_head(tiny_models, tmp_path):
    """llama (4 query heads, 2 KV heads) over 4 ranks: one query head each, and KV head 0 on ranks
    0-1, KV head 1 on ranks 2-3 (replication that picks a head other than the first)."""
    from safetensors.torch import load_file

    cases = [{"name": f"llama4-{q or 'fp32'}", "path": str(tiny_models["llama"].path), "quant": q}
             for q in (None, "int8")]
    run_ranks(cases, tmp_path, world_size=4)
    for c in cases:
        tensors = [load_file(str(tmp_path / f"{c['name']}.rank{r}.safetensors")) for r in range(4)]
        facts = [json.loads((tmp_path / f"{c['name']}.rank{r}.json").read_text()) for r in range(4)]
        assert [(f["heads"], f["kv_heads"], f["intermediate"], f["head_rows"]) for f in facts] == [(1, 1, 32, 96)] * 4
        ref = tensors[0]
        for got in tensors:
            torch.testing.assert_close(got["tp_logits"], ref["ref_logits"], atol=ATOL, rtol=0)
            assert got["tp_greedy"].tolist() == ref["ref_greedy"].tolist()
            for backend in ("cpu", "sdpa"):
                torch.testing.assert_close(got[f"tp_paged_{backend}"], ref[f"ref_paged_{backend}"], atol=ATOL, rtol=0)


# --- in-process: the partition and its errors -------------------------------------------------------


class _Comm:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, t):  # pragma: no cover - never reached: these tests fail before a forward
        raise AssertionError("no collective expected")

    all_gather = all_reduce


@pytest.fixture(scope="module")
def llama_cfg(tiny_models):
    return load_model(tiny_models["llama"].path, torch.float32, "cpu", 64).config


def test_shard_kv_heads():
    assert [shard_kv_heads(8, 4, r, 2) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [shard_kv_heads(8, 2, r, 4) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [shard_kv_heads(4, 1, r, 2) for r in range(2)] == [range(0, 1)] * 2
    # every rank's query heads use the KV heads it holds
    for heads, kv, tp in [(8, 4, 2), (8, 2, 4), (8, 1, 8), (16, 4, 8), (12, 6, 3)]:
        group, per = heads // kv, heads // tp
        for r in range(tp):
            held = shard_kv_heads(heads, kv, r, tp)
            assert {q // group for q in range(r * per, (r + 1) * per)} <= set(held)


def test_per_rank_config(llama_cfg):
    cfg = dataclasses.replace(llama_cfg, num_heads=8, num_kv_heads=2)
    two, four = per_rank_config(cfg, 2), per_rank_config(cfg, 4)
    assert (two.num_heads, two.num_kv_heads, two.intermediate_size) == (4, 1, 64)
    assert (four.num_heads, four.num_kv_heads, four.intermediate_size) == (2, 1, 32)
    assert two.head_dim == cfg.head_dim and two.hidden_size == cfg.hidden_size
    assert two.vocab_size == cfg.vocab_size
    assert per_rank_config(cfg, 1) == cfg
    spec = shard_spec(dataclasses.replace(cfg, vocab_size=383), 1, 2)
    assert (spec.vocab_start, spec.vocab_rows, spec.vocab_real) == (192, 192, 191)


@pytest.mark.parametrize("change,tp,field", [
    (dict(num_heads=6, num_kv_heads=6), 4, "num_attention_heads = 6"),
    (dict(num_heads=12, num_kv_heads=6), 4, "num_key_value_heads = 6"),
    (dict(intermediate_size=130), 4, "intermediate_size = 130"),
])
def test_unshardable_config_is_a_config_error(llama_cfg, change, tp, field):
    cfg = dataclasses.replace(llama_cfg, **change)
    with pytest.raises(ConfigError, match=f"tensor_parallel_size = {tp}: {field}"):
        check_shardable(cfg, tp)
    with pytest.raises(ConfigError, match=field):
        per_rank_config(cfg, tp)


def _snapshot(model) -> dict:
    return {k: (v.data_ptr(), tuple(v.shape)) for k, v in model.state_dict().items()}


def test_int4_group_wider_than_the_shard_is_refused_untouched(tiny_models):
    model = quantize_model(load_model(tiny_models["llama"].path, torch.float32, "cpu", 64), "int4", 64)
    before = _snapshot(model)
    # o_proj has 64 input columns in one group of 64: a 32-column shard is half a group
    with pytest.raises(ConfigError, match=r"layers\.0\.self_attn\.o_proj is int4 with group size 64"):
        shard_model(model, 0, 2, _Comm(0, 2))
    assert _snapshot(model) == before and model.layers[0].self_attn.heads == 4


def test_bad_world_or_comm_is_refused_untouched(tiny_models):
    model = load_model(tiny_models["llama"].path, torch.float32, "cpu", 64)
    before = _snapshot(model)
    with pytest.raises(ConfigError, match="num_attention_heads = 4 is not divisible by 3"):
        shard_model(model, 0, 3, _Comm(0, 3))
    with pytest.raises(ConfigError, match="comm is rank 1 of 2, asked for rank 0 of 2"):
        shard_model(model, 0, 2, _Comm(1, 2))
    with pytest.raises(ConfigError, match="rank = 2: outside tensor_parallel_size = 2"):
        shard_model(model, 2, 2, _Comm(2, 2))
    assert _snapshot(model) == before
    assert shard_model(model, 0, 1, _Comm(0, 1)) is model and _snapshot(model) == before
