"""The CPU decode step's layer-kind interface (platform/cpu_layers.py): a layer of a kind with no
fused form runs eagerly, that layer only, with a log line naming it, and the step's outputs are
the eager path's; a kind that registers a form runs fused; the model itself stays a plain module
(no state of the step on it)."""

from __future__ import annotations

import logging

import pytest
import torch

from strata import SamplingParams
from strata.graph.models.llama import DecoderLayer
from strata.kernels import cpu_decode_layer
from strata.platform import cpu_layers
from strata.platform.cpu_decode_step import CpuDecodeStep

pytestmark = pytest.mark.skipif(not cpu_decode_layer.available(), reason="numba is not installed")


class OtherLayer(DecoderLayer):
    """A layer kind the platform has not heard of (its forward is DecoderLayer's: the eager reference)."""


def _run(llm, prompts, monkeypatch, fused: bool):
    monkeypatch.setenv("STRATA_FUSED_DECODE", "1" if fused else "0")
    sp = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


@pytest.fixture
def runs(monkeypatch):
    """Per call of the fused loop: the run of each of its layers."""
    calls = []
    real = cpu_decode_layer.decode_layers

    def counting(x, layers, step):
        calls.append([run for run, _ in layers])
        return real(x, layers, step)

    monkeypatch.setattr(cpu_decode_layer, "decode_layers", counting)
    return calls


def _same(a, b) -> None:
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb
        assert max(abs(x - y) for x, y in zip(la, lb)) <= 1e-5


def test_an_unknown_layer_kind_runs_eagerly_alone(tiny_models, llm_factory, prompt_of, monkeypatch, runs, caplog):
    llm = llm_factory(tiny_models["llama"], enable_prefix_caching=False)
    layers = llm.engine.model.layers
    assert len(layers) >= 2
    layers[1].__class__ = OtherLayer  # before the first step: the step's layer table is built then
    prompts = [prompt_of(i, 4 + 5 * i) for i in range(3)]
    with caplog.at_level(logging.INFO, logger="strata.platform.cpu_decode_step"):
        fused = _run(llm, prompts, monkeypatch, True)
    assert runs, "the other layers still run in the fused loop"
    kinds = runs[0]
    assert kinds[1] is not cpu_decode_layer.llama_layer  # the eager one, in its place
    assert all(k is cpu_decode_layer.llama_layer for i, k in enumerate(kinds) if i != 1)
    assert "layers 1 run eagerly (OtherLayer has no fused form)" in caplog.text
    _same(fused, _run(llm, prompts, monkeypatch, False))


def test_a_registered_kind_runs_fused(tiny_models, llm_factory, prompt_of, monkeypatch, runs):
    monkeypatch.setitem(cpu_layers._BUILDERS, OtherLayer, cpu_layers.llama_layer)
    llm = llm_factory(tiny_models["llama"], enable_prefix_caching=False)
    for layer in llm.engine.model.layers:
        layer.__class__ = OtherLayer
    prompts = [prompt_of(10 + i, 3 + 4 * i) for i in range(2)]
    fused = _run(llm, prompts, monkeypatch, True)
    assert runs and all(k is cpu_decode_layer.llama_layer for k in runs[0])
    _same(fused, _run(llm, prompts, monkeypatch, False))


def test_a_model_with_no_fusable_layer_is_left_to_its_forward(tiny_models, llm_factory, prompt_of, monkeypatch,
                                                              runs, caplog):
    llm = llm_factory(tiny_models["phi4mini"], enable_prefix_caching=False)  # partial rotary: no layer fuses
    with caplog.at_level(logging.INFO, logger="strata.platform.cpu_decode_step"):
        _run(llm, [prompt_of(1, 5)], monkeypatch, True)
    assert runs == []
    assert "no layer runs fused (partial rotary)" in caplog.text


def test_the_model_keeps_no_step_state(tiny_models, llm_factory, prompt_of, monkeypatch):
    llm = llm_factory(tiny_models["llama"], enable_prefix_caching=False)
    model = llm.engine.model
    before = set(model.__dict__)
    _run(llm, [prompt_of(2, 6), prompt_of(3, 9)], monkeypatch, True)
    assert set(model.__dict__) == before
    assert isinstance(llm.engine.runner.decode_step, CpuDecodeStep)
    assert not any(isinstance(v, torch.Tensor) for k, v in model.__dict__.items() if k.startswith("_fused"))
