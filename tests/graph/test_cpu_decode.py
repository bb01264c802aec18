"""The fused CPU decode layer (platform/cpu_decode_step.py, kernels/cpu_decode_layer.py) against the eager
per-kernel path it replaces (STRATA_FUSED_DECODE=0): same tokens, same logprobs, for every
family and weight format, and it runs where it should (and only there). The eager path itself is
held to transformers by tests/engine/test_engine_vs_hf.py, which runs with the fused layer on."""

from __future__ import annotations

import pytest

from strata import SamplingParams
from strata.kernels import cpu_decode_layer
from strata.platform import cpu_decode_step as cpu_decode

pytestmark = pytest.mark.skipif(not cpu_decode_layer.available(), reason="numba is not installed")

# Llama-shaped layers (Qwen3: + q/k norms): one call per layer; the MoE families' layers: the
# compiled attention half, the router, the compiled expert dispatch
FUSED = {"llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2moe", "qwen3moe", "olmoe"}
EAGER = {"gemma3": "sandwich norms, GeGLU", "phi4mini": "partial rotary"}


@pytest.fixture
def count_fused(monkeypatch):
    """Rows of every fused layer run: one entry per layer of each fused step."""
    calls = []
    real = cpu_decode_layer.decode_layers

    def counting(x, layers, step):
        calls.extend([x.shape[0]] * len(layers))  # rows of the step, once per layer
        return real(x, layers, step)

    monkeypatch.setattr(cpu_decode.cpu_decode_layer, "decode_layers", counting)
    return calls


def _run(llm, prompts, monkeypatch, fused: bool, max_tokens: int = 12):
    monkeypatch.setenv("STRATA_FUSED_DECODE", "1" if fused else "0")
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def _assert_same(a, b, tol: float) -> None:
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb
        assert max(abs(x - y) for x, y in zip(la, lb)) <= tol


@pytest.mark.parametrize("family", sorted(FUSED | set(EAGER)))
def test_fused_decode_equals_the_eager_path(family, tiny_models, llm_factory, prompt_of, monkeypatch,
                                            count_fused, engine_clean):
    model = tiny_models[family]
    llm = llm_factory(model, enable_prefix_caching=False)
    prompts = [prompt_of(i, 3 + 9 * i) for i in range(4)]  # different lengths, one batch
    fused = _run(llm, prompts, monkeypatch, True)
    runs = len(count_fused)
    eager = _run(llm, prompts, monkeypatch, False)
    assert len(count_fused) == runs  # switched off: no fused call
    _assert_same(fused, eager, 1e-5)
    if family in FUSED:
        assert runs == 11 * model.num_layers  # every decode step, every layer
        assert max(count_fused) == 4
    else:
        assert runs == 0, f"{family} ({EAGER[family]}) must run eagerly"
    engine_clean(llm)


@pytest.mark.parametrize("quantization", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_decode_weight_formats(quantization, threads, tiny_models, llm_factory, prompt_of, monkeypatch,
                                     count_fused):
    llm = llm_factory(tiny_models["qwen2"], quantization=quantization, num_threads=threads,
                      enable_prefix_caching=False)  # qwen2: q/k/v biases too
    prompts = [prompt_of(10 + i, 5 + 4 * i) for i in range(3)] + [prompt_of(20, 1)]
    fused = _run(llm, prompts, monkeypatch, True)
    assert count_fused
    _assert_same(fused, _run(llm, prompts, monkeypatch, False), 1e-5)


@pytest.mark.parametrize("quantization", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("family", ["qwen2moe", "qwen3moe"])
def test_fused_moe_decode_weight_formats(family, quantization, tiny_models, llm_factory, prompt_of, monkeypatch,
                                         count_fused):
    """The experts' dispatch in every weight format (Qwen2-MoE: + the shared expert), 2 threads."""
    llm = llm_factory(tiny_models[family], quantization=quantization, num_threads=2, enable_prefix_caching=False)
    prompts = [prompt_of(30 + i, 4 + 5 * i) for i in range(3)]
    fused = _run(llm, prompts, monkeypatch, True)
    assert count_fused
    _assert_same(fused, _run(llm, prompts, monkeypatch, False), 1e-5)


@pytest.mark.parametrize("quantization", [None, "bf16", "int8", "int4"])
def test_the_lm_head_runs_in_the_final_norms_call(quantization, tiny_models, llm_factory, prompt_of, monkeypatch):
    """Every fused step's logits come from the head run beside the final norm (one compiled
    call), and they are the eager head's (the tokens and logprobs above; here that it ran)."""
    heads = []
    real = cpu_decode_layer.final_norm_head

    def counting(x, residual, weight, eps, hidden, head, threads, logits):
        heads.append(logits.shape)
        return real(x, residual, weight, eps, hidden, head, threads, logits)

    monkeypatch.setattr(cpu_decode.cpu_decode_layer, "final_norm_head", counting)
    model = tiny_models["llama"]
    llm = llm_factory(model, quantization=quantization, enable_prefix_caching=False)
    prompts = [prompt_of(30 + i, 4 + 3 * i) for i in range(3)]
    fused = _run(llm, prompts, monkeypatch, True)
    assert heads == [(3, model.vocab_size)] * 11  # 12 tokens: 11 all-decode steps of 3 rows
    _assert_same(fused, _run(llm, prompts, monkeypatch, False), 1e-5)


def test_steps_above_the_row_limit_run_eagerly(tiny_models, llm_factory, prompt_of, monkeypatch, count_fused):
    rows = cpu_decode.MAX_ROWS + 2
    llm = llm_factory(tiny_models["llama"], max_num_seqs=rows, kv_cache_memory="4MiB", enable_prefix_caching=False)
    prompts = [prompt_of(40 + i, 4 + i % 5) for i in range(rows)]
    fused = _run(llm, prompts, monkeypatch, True, max_tokens=6)
    assert all(r <= cpu_decode.MAX_ROWS for r in count_fused)
    _assert_same(fused, _run(llm, prompts, monkeypatch, False, max_tokens=6), 1e-5)


def test_a_moved_weight_rebuilds_the_layer_arguments(tiny_models, llm_factory, prompt_of, monkeypatch):
    import torch

    llm = llm_factory(tiny_models["llama"], enable_prefix_caching=False)
    prompts = [prompt_of(60, 7)]
    before = _run(llm, prompts, monkeypatch, True)
    layer = llm.engine.model.layers[0]
    head = llm.engine.model.lm_head
    with torch.no_grad():  # new storage, different values: the cached numpy views must not be used
        layer.mlp.down_proj.weight.data = layer.mlp.down_proj.weight.data * 0.5
        head.weight.data = head.weight.data * 0.5  # (the fused head's views too)
    after_fused = _run(llm, prompts, monkeypatch, True)
    after_eager = _run(llm, prompts, monkeypatch, False)
    _assert_same(after_fused, after_eager, 1e-5)
    assert after_fused[0][1] != before[0][1]
