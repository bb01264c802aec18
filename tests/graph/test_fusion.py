"""FX fusion passes (graph/fusion.py): the fused step computes what the eager step computes, and
the number of rewrites is what the model's structure implies.

Tolerance: fp32 logits of the fused step equal the eager step's to rtol 1e-5, atol 1e-4 (the
kernels differ in summation order only: the fused rotary and KV write run torch ops where the
eager decode runs the numba rope+store kernel; measured differences are ~2e-6), and greedy tokens
are identical.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from strata import SamplingParams
from strata.graph import fused_ops, fusion
from strata.graph.models.llama import CausalLM
from strata.model_config import ModelConfig

LENGTHS = (5, 40, 19)  # a 40-token prefill (torch paths) next to short ones; decode steps of 3 rows


def _run(llm, prompts: list[list[int]], max_tokens: int):
    """Greedy tokens, and the logits of every step (multi-step decode's later steps included)."""
    runner = llm.engine.runner
    logits: list[torch.Tensor] = []

    def recording(execute):
        def run(*args):
            step_logits, order = execute(*args)
            if step_logits is not None:
                logits.append(step_logits.clone())
            return step_logits, order
        return run

    runner.execute, runner.execute_next = recording(runner.execute), recording(runner.execute_next)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], logits


def test_fused_step_matches_eager(tiny_model, llm_factory, prompt_of):
    prompts = [prompt_of(7 + i, n) for i, n in enumerate(LENGTHS)]
    plain = llm_factory(tiny_model, max_num_seqs=4)
    fused = llm_factory(tiny_model, max_num_seqs=4, fuse=True)
    assert plain.engine.fusion is None and fused.engine.fusion is not None
    assert fused.engine.runner.forward is fused.engine.fusion
    want_tokens, want_logits = _run(plain, prompts, 10)
    got_tokens, got_logits = _run(fused, prompts, 10)
    assert got_tokens == want_tokens
    assert len(got_logits) == len(want_logits) >= 10
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_step_matches_eager_cuda(tiny_models, llm_factory, prompt_of, family):
    """On CUDA the fused ops run their Triton kernels (when triton is installed)."""
    model = tiny_models[family]
    prompts = [prompt_of(7 + i, n) for i, n in enumerate(LENGTHS)]
    want_tokens, want_logits = _run(llm_factory(model, device="cuda", max_num_seqs=4), prompts, 10)
    got_tokens, got_logits = _run(llm_factory(model, device="cuda", max_num_seqs=4, fuse=True), prompts, 10)
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)  # TF32-free fp32, fused reductions


def _op_nodes(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def test_fusion_counts_follow_structure(tiny_model, llm_factory):
    llm = llm_factory(tiny_model, fuse=True)
    layers = tiny_model.num_layers
    fused = llm.engine.fusion
    # add+RMSNorm: every layer's post-attention norm (L), the input norm of layers 1..L-1 (layer 0's
    # input norm has no residual to add) and the final norm (1): (L - 1) + L + 1 = 2L.
    # One SiLU*up, one rotary of q and k, one KV write per layer.
    want = {"add_rms_norm": 2 * layers, "silu_mul": layers, "rotary_qk": layers, "kv_write": layers}
    assert fused.counts == want == fusion.expected_counts(layers)
    gm = fused.graph_module
    ops = torch.ops.strata
    assert _op_nodes(gm, ops.add_rms_norm.default) == 2 * layers
    assert _op_nodes(gm, ops.silu_mul.default) == layers
    assert _op_nodes(gm, ops.rotary_qk.default) == layers
    assert _op_nodes(gm, ops.kv_write.default) == layers
    # nothing of the patterns is left behind: no unfused activation, rotation or cache write
    assert _op_nodes(gm, torch.nn.functional.silu) == 0
    assert _op_nodes(gm, fusion.rotate_one) == 0
    assert not [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "index_copy_"]
    # plain RMSNorms (no residual add): layer 0's input norm, plus Qwen3's per-head q and k norms
    qk_norms = 2 * layers if tiny_model.family == "qwen3" else 0
    assert _op_nodes(gm, torch.nn.functional.rms_norm) == 1 + qk_norms


@pytest.mark.parametrize("layers", [1, 3])
def test_counts_scale_with_layers(tiny_model, layers):
    cfg = dataclasses.replace(ModelConfig.from_file(tiny_model.path / "config.json"), num_layers=layers)
    with torch.device("meta"):  # structure only: fusion never runs the model
        model = CausalLM(cfg)
    assert fusion.fuse_model(model).counts == fusion.expected_counts(layers)


def test_fused_ops_match_references():
    g = torch.Generator().manual_seed(0)
    for rows in (1, 3, 40):  # numba add+RMSNorm for few fp32 rows, the torch path above
        x, res = torch.randn(rows, 64, generator=g), torch.randn(rows, 64, generator=g)
        w = torch.randn(64, generator=g)
        out, new_res = torch.ops.strata.add_rms_norm(x, res, w, 1e-6)
        ref_out, ref_res = fused_ops.add_rms_norm_ref(x, res, w, 1e-6)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new_res, ref_res)
    gate_up = torch.randn(3, 2 * 48, generator=g)
    torch.testing.assert_close(
        torch.ops.strata.silu_mul(gate_up),
        torch.nn.functional.silu(gate_up[:, :48]) * gate_up[:, 48:],
    )
    q, k = torch.randn(3, 4, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    cos, sin = torch.randn(3, 1, 16, generator=g), torch.randn(3, 1, 16, generator=g)
    qr, kr = torch.ops.strata.rotary_qk(q, k, cos, sin)
    torch.testing.assert_close(torch.cat([qr, kr], 1), fused_ops.rotary_ref(torch.cat([q, k], 1), cos, sin))
    cache = torch.zeros(2, 4, 8, 2, 16)
    ref = cache.clone()
    slots = torch.tensor([3, 17, 30])
    torch.ops.strata.kv_write(cache, k, k * 2, slots)
    fused_ops.kv_write_ref(ref, k, k * 2, slots)
    assert torch.equal(cache, ref) and cache.abs().sum() > 0


def test_trace_refuses_value_dependent_control_flow():
    tracer = fusion.StepTracer(torch.float32)

    class Branchy(torch.nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x

    with pytest.raises(torch.fx.proxy.TraceError, match="cannot decide"):
        tracer.trace(Branchy())


def test_print_fusions_cli(text_model, capsys):
    from strata.cli import main

    rc = main(["generate", "--model", str(text_model.path), "--prompt", "The quick", "--max-tokens", "3",
               "--dtype", "float32", "--print-fusions", "--kv-cache-memory", "1MiB", "--max-model-len", "64"])
    err = capsys.readouterr().err
    assert rc == 0
    layers = text_model.num_layers
    for name, n in fusion.expected_counts(layers).items():
        assert f"{name:<13} {n:>4}" in err
    assert "structure implies" not in err


def test_paged_decode_op_takes_the_backend_name():
    """strata::paged_decode (the compiled step's attention) looks its backend up by name: an op
    schema takes primitives, AttentionMetadata.backend is the backend object."""
    from strata.kernels.attention import get_backend
    from tests.kernels.triton_kernels.triton_cases import paged_cache

    g = torch.Generator().manual_seed(2)
    cache, tables, lens = paged_cache(g, [9, 20], 8, 2, 16, torch.float32)
    q = torch.randn(2, 4, 16, generator=g)
    mask = (torch.arange(tables.shape[1] * 8)[None, :] < lens[:, None]).view(2, 1, 1, -1)
    from strata.kernels import cpu_attention

    for name in ("torch", "sdpa", "cpu", "triton"):
        if name == "cpu" and not cpu_attention.available():
            continue
        b = get_backend(name)
        m = mask if b.uses_decode_mask else None
        got = torch.ops.strata.paged_decode(q, cache, tables, lens, m, 0.25, name)
        torch.testing.assert_close(got, b.decode(q, cache, tables, lens, m, 0.25), rtol=0, atol=0)
