"""Step capture (graph/capture.py): torch.compile'd decode gives the eager tokens, batches are padded
to buckets with bounded recompiles, and CUDA graphs refuse to start without CUDA."""

from __future__ import annotations

import pytest
import torch

from strata import SamplingParams
from strata.errors import ConfigError
from strata.graph.capture import DecodeCapture, batch_buckets, bucket_for


def _greedy(llm, prompts, lengths):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    assert batch_buckets(128) == [1, 2, 4, *range(8, 129, 8)]
    assert [bucket_for(n, [1, 2, 4, 6]) for n in (1, 2, 3, 5, 6, 7)] == [1, 2, 4, 6, 6, None]


def _count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def test_compiled_step_calls_the_eager_kernels(tiny_model, llm_factory):
    """The CPU decode graph handed to torch.compile calls the kernels the eager decode calls:
    GEMVs, GEMV+SwiGLU, rotary+KV write (where q and k are views of the qkv projection: not Qwen3,
    whose q/k norms come first), paged decode attention, add+RMSNorm; all opaque ops for dynamo."""
    from strata.graph.capture_passes import compiled_step

    llm = llm_factory(tiny_model)
    gm = compiled_step(llm.engine.model, "cpu")
    layers, ops = tiny_model.num_layers, torch.ops.strata
    joint = tiny_model.family != "qwen3"
    assert _count(gm, ops.linear_swiglu.default) == layers
    assert _count(gm, ops.linear.default) == 3 * layers  # qkv, o, down (lm_head runs outside the step)
    assert _count(gm, ops.rope_store.default) == (layers if joint else 0)
    assert _count(gm, ops.rotary_qk.default) == (0 if joint else layers)
    assert _count(gm, ops.kv_write.default) == (0 if joint else layers)
    assert _count(gm, ops.add_rms_norm.default) == 2 * layers
    assert not [n for n in gm.graph.nodes if n.op == "call_module" and "proj" in n.target]


def test_compile_greedy_matches_eager(llama, llm_factory, prompt_of, tmp_path, monkeypatch):
    """Inductor-compiled decode (3 sequences padded to the bucket of 4) == eager, token for token."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # no caches in the repo
    prompts = [prompt_of(30 + i, n) for i, n in enumerate((4, 11, 23))]
    want = _greedy(llm_factory(llama, max_num_seqs=4), prompts, [6, 6, 6])
    llm = llm_factory(llama, max_num_seqs=4, compile=True)
    got = _greedy(llm, prompts, [6, 6, 6])
    assert got == want
    stats = llm.engine.runner.decode_step.stats()
    assert stats["compiles"] == 1 and stats["bucket_hits"] == {4: 5}


def test_buckets_bound_recompiles(llama, llm_factory, prompt_of):
    """Decode batches shrinking 5 -> 1 run padded to buckets 8, 4, 2, 1; outputs stay exact and the
    compilations stay bounded (dynamo's "eager" backend: the capture without code generation):
    batch 1 static, then one graph with the batch marked dynamic, and no global dynamo limit raised."""
    import torch._dynamo

    limits = (torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit)
    prompts = [prompt_of(50 + i, n) for i, n in enumerate((3, 9, 17, 5, 30))]
    lengths = [2, 4, 6, 8, 12]
    want = _greedy(llm_factory(llama, max_num_seqs=8), prompts, lengths)
    llm = llm_factory(llama, max_num_seqs=8, compile=True)
    eng = llm.engine
    eng.runner.decode_step = cap = DecodeCapture(
        eng.runner.decode_step._step, eng.kv_caches, block_size=eng.config.block_size,
        backend=eng.runner.backend, scratch_block=eng.scratch_block, max_num_seqs=8,
        max_model_len=eng.max_model_len, compile=True, cuda_graphs=False, compile_backend="eager",
    )
    cap.warm_up()  # ahead of time: batch 1 and 2, writing only into the scratch block
    warm = cap.compiles
    assert warm >= 1 and cap.stats()["bucket_hits"] == {}
    assert _greedy(llm, prompts, lengths) == want
    stats = cap.stats()
    assert set(stats["bucket_hits"]) == {8, 4, 2, 1}
    assert stats["compiles"] == warm == 2  # batch 1, then one dynamic-batch graph for 2, 4, 8
    assert (torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit) == limits
    eng.check_blocks()  # padded rows wrote only into the scratch block, outside the manager's range


def test_compile_refuses_quantized_weights(llama, llm_factory):
    with pytest.raises(ConfigError, match="--compile.*quantized"):
        llm_factory(llama, compile=True, quantization="int8")


def test_cuda_graphs_need_cuda(llama, llm_factory, capsys):
    with pytest.raises(ConfigError, match=r"cuda_graphs \(--cuda-graphs\).*CUDA"):
        llm_factory(llama, cuda_graphs=True)
    from strata.cli import main

    rc = main(["generate", "--model", str(llama.path), "--prompt", "x", "--cuda-graphs"])
    assert rc == 2
    assert "--cuda-graphs" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graphs_greedy_matches_eager(llama, llm_factory, prompt_of, compile, tmp_path, monkeypatch):
    """Decode replayed from CUDA graphs (batches 3 -> 1, padded to buckets 4, 2, 1) == eager."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    prompts = [prompt_of(70 + i, n) for i, n in enumerate((4, 11, 23))]
    lengths = [3, 5, 8]
    want = _greedy(llm_factory(llama, device="cuda", max_num_seqs=4), prompts, lengths)
    llm = llm_factory(llama, device="cuda", max_num_seqs=4, cuda_graphs=True, compile=compile)
    assert _greedy(llm, prompts, lengths) == want
    stats = llm.engine.runner.decode_step.stats()
    assert stats["graphs"] >= 3 and set(stats["bucket_hits"]) == {4, 2, 1}
