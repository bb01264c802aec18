"""Checkpoints quantized elsewhere (issue 44, graph/prequantized.py): AWQ, GPTQ (sym / asym,
act order, v1 / v2 zeros), compressed-tensors w4a16 / w8a8 and FP8 load into Strata's layouts
and compute transformers' logits on the weights their own formats dequantize to."""

from __future__ import annotations

import json

import pytest
import torch

from strata.errors import ModelLoadError
from strata.graph.hub import check_model_dir
from strata.graph.loader import load_model
from strata.graph.prequantized import scheme_of
from tests.graph import prequant_writer as pw

ATOL = 1e-4


@pytest.fixture(autouse=True)
def _exact_kernels(monkeypatch):
    # the loader is under test: exact fp32 arithmetic (the int8-activation kernels have their twins)
    monkeypatch.setenv("STRATA_INT4_FP32_ACTIVATIONS", "1")
    monkeypatch.setenv("STRATA_INT8_FP32_ACTIVATIONS", "1")


def _reference_logits(hf, reference: dict, ids: list[int]) -> torch.Tensor:
    saved = {k: v.clone() for k, v in hf.state_dict().items()}
    try:
        state = dict(saved)
        state.update({k: v for k, v in reference.items() if k in state})
        hf.load_state_dict(state)
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0].float()
    finally:
        hf.load_state_dict(saved)


def _logits(path, ids, storage=None) -> torch.Tensor:
    m = load_model(check_model_dir(path), torch.float32, "cpu", 256, storage)
    with torch.no_grad():
        return m.compute_logits(m(torch.tensor([ids]), torch.arange(len(ids))[None])).float()[0], m


WRITERS = {
    "awq": lambda hf, out: pw.write_awq(hf, out),
    "gptq-sym": lambda hf, out: pw.write_gptq(hf, out, sym=True),
    "gptq-asym": lambda hf, out: pw.write_gptq(hf, out, sym=False),
    "gptq-act-order": lambda hf, out: pw.write_gptq(hf, out, sym=False, desc_act=True),
    "gptq-v2": lambda hf, out: pw.write_gptq(hf, out, sym=False, v2=True),
    "ct-w4a16": lambda hf, out: pw.write_compressed_tensors(hf, out, "w4a16", sym=True),
    "ct-w4a16-asym": lambda hf, out: pw.write_compressed_tensors(hf, out, "w4a16", sym=False),
    "ct-w8a8": lambda hf, out: pw.write_compressed_tensors(hf, out, "w8a8"),
    "fp8": lambda hf, out: pw.write_fp8(hf, out),
}


@pytest.mark.parametrize("fmt", list(WRITERS))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prequantized_checkpoints_compute_their_dequantized_weights(tiny_models, tmp_path, prompt_of, fmt, family):
    if fmt.startswith("ct-"):
        pytest.importorskip("compressed_tensors", reason="compressed-tensors (a dev dependency) writes these checkpoints")
    tiny = tiny_models[family]
    out = tmp_path / fmt
    reference = WRITERS[fmt](tiny.hf, out)
    ids = prompt_of(3, 40)
    got, m = _logits(out, ids)
    torch.testing.assert_close(got, _reference_logits(tiny.hf, reference, ids), atol=ATOL, rtol=1e-5)
    down = m.layers[0].mlp.down_proj
    if fmt != "fp8":  # the quantized weights themselves, in Strata's layout: the format's values
        torch.testing.assert_close(down.dequantize(), reference["model.layers.0.mlp.down_proj.weight"],
                                   atol=1e-6, rtol=1e-6)
        assert type(m.lm_head).__name__ == "Linear"  # left unquantized, as the checkpoint has it


def test_act_order_projections_gather_their_input(tiny_models, tmp_path):
    tiny = tiny_models["llama"]
    pw.write_gptq(tiny.hf, tmp_path / "g", sym=False, desc_act=True)
    m = load_model(check_model_dir(tmp_path / "g"), torch.float32, "cpu", 256)
    qkv = m.layers[0].self_attn.qkv_proj
    assert qkv.input_perm is not None and sorted(qkv.input_perm.tolist()) == list(range(qkv.in_features))


def test_a_prequantized_checkpoint_refuses_another_quantization(tiny_models, tmp_path):
    pw.write_awq(tiny_models["llama"].hf, tmp_path / "a")
    with pytest.raises(ModelLoadError, match=r"already quantized \(awq.*drop it"):
        load_model(check_model_dir(tmp_path / "a"), torch.float32, "cpu", 256, "int8")


@pytest.mark.parametrize("config,match", [
    ({"quant_method": "awq", "bits": 3}, "awq bits=3"),
    ({"quant_method": "gptq", "bits": 8}, "gptq bits=8"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float"}}}}, "nvfp4"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"weight_block_size=\[64, 64\]"),
])
def test_unsupported_schemes_are_refused_by_name(config, match):
    with pytest.raises(ModelLoadError, match=match + r".*supported: awq"):
        scheme_of({"quantization_config": config})


def test_llm_serves_an_awq_checkpoint(tiny_models, tmp_path, prompt_of, llm_factory, engine_clean):
    """`LLM(model=AWQ_DIR)`: served in int4 with the checkpoint's zero points; greedy tokens equal
    transformers' on the dequantized weights."""
    from strata import SamplingParams

    tiny = tiny_models["qwen2"]
    out = tmp_path / "awq"
    reference = pw.write_awq(tiny.hf, out)
    pw.copy_tokenizer(tiny.path, out)
    llm = llm_factory(out)
    assert llm.engine.config.quantization == "int4"
    prompt = prompt_of(7, 20)
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    engine_clean(llm)
    ids = list(prompt)
    for _ in range(8):
        ids.append(int(_reference_logits(tiny.hf, reference, ids)[-1].argmax()))
    assert list(got[0].outputs[0].token_ids) == ids[len(prompt):]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"


@pytest.mark.parametrize("fmt", ["awq", "gptq-act-order", "ct-w8a8"])
def test_prequantized_decode_fused_as_eager(tiny_models, tmp_path, prompt_of, llm_factory, engine_clean,
                                             monkeypatch, caplog, fmt):
    """With the int8-activation kernels on, the fused CPU decode layer gives the eager path's
    tokens and logprobs; an act-order layer (its input gathered first) runs eagerly and says so."""
    from strata import SamplingParams

    if fmt.startswith("ct-"):
        pytest.importorskip("compressed_tensors", reason="compressed-tensors (a dev dependency) writes these checkpoints")
    monkeypatch.delenv("STRATA_INT4_FP32_ACTIVATIONS")
    monkeypatch.delenv("STRATA_INT8_FP32_ACTIVATIONS")
    tiny = tiny_models["llama"]
    out = tmp_path / fmt
    WRITERS[fmt](tiny.hf, out)
    pw.copy_tokenizer(tiny.path, out)
    llm = llm_factory(out, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": prompt_of(60 + i, 5 + 7 * i)} for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=10, logprobs=1, ignore_eos=True)
    runs = []
    for fused in ("1", "0"):
        monkeypatch.setenv("STRATA_FUSED_DECODE", fused)
        caplog.clear()
        with caplog.at_level("INFO", logger="strata.platform.cpu_decode_step"):
            outs = llm.generate(prompts, sp, use_tqdm=False)
        if fused == "1":
            eager = "no layer runs fused" in caplog.text or "run eagerly" in caplog.text
            assert eager == (fmt == "gptq-act-order"), caplog.text
        runs.append([(list(o.outputs[0].token_ids),
                      [getattr(lp[t], "logprob", lp[t]) for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                     for o in outs])
    engine_clean(llm)
    for (ta, la), (tb, lb) in zip(*runs):
        assert ta == tb
        assert max(abs(a - b) for a, b in zip(la, lb)) <= 1e-5
