"""bf16 weight storage of an fp32 model (quantization="bf16"): modules, bytes, exactness, dtype auto.

A bf16 weight widens to fp32 exactly, so the narrowed model must equal an fp32 model holding the
bf16-rounded weights: to fp32 summation order on the decode GEMV and on the widened-tile prefill
GEMM. The oneDNN prefill GEMM rounds the activations to bf16 as well; measured on the conftest
tiny models its logits differ from fp32 by RMS 0.002-0.004 and at most 0.02 of the logits' spread
(asserted: RMS <= 0.02, max <= 0.1).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import make_llm, random_prompt
from safetensors.torch import load_file, save_file

from strata.config import EngineConfig
from strata.errors import ConfigError
from strata.graph.loader import load_model
from strata.kernels import cpu_gemm
from strata.memory.bf16_weights import WidenedEmbedding, narrow_model
from strata.memory.planner import weight_bytes
from strata.memory.quant import model_weight_bytes
from strata.model_config import ModelConfig
from strata.platform import cpu_policy

PROJ = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor([ids]), torch.arange(len(ids))[None]))[0]


def _rounded(model) -> None:
    """The fp32 twin: every weight the narrowed model stores in bf16, rounded to bf16 and back."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(p.bfloat16().float())


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # tied embedding / untied with q/k/v bias
def test_modules_bytes_and_exactness(tiny_models, family):
    m = tiny_models[family]
    model = narrow_model(load_model(m.path, torch.float32))
    cpu_gemm.mark(model, "aten", "aten")  # the exact prefill path: widened tiles, fp32 GEMM
    for layer in model.layers:
        for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert mod.weight.dtype == torch.bfloat16
        assert layer.input_layernorm.weight.dtype == torch.float32
    assert isinstance(model.embed_tokens, WidenedEmbedding) and model.embed_tokens.weight.dtype == torch.bfloat16
    assert (model.embed_tokens.weight is model.lm_head.weight) == (family == "llama")
    cfg = ModelConfig.from_file(m.path / "config.json")
    assert model_weight_bytes(model) == weight_bytes(cfg, torch.float32, "bf16")

    twin = load_model(m.path, torch.float32)
    _rounded(twin)
    ids = random_prompt(1, 40, m.vocab_size)
    for n in (1, 5, 40):  # the GEMV (<= 16 rows) and the widened-tile GEMM
        got = _logits(model, ids[:n])
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, _logits(twin, ids[:n]), rtol=1e-4, atol=1e-4)


def test_bf16_prefill_gemm_within_its_stated_tolerance(llama):
    model = narrow_model(load_model(llama.path, torch.float32))
    twin = load_model(llama.path, torch.float32)
    _rounded(twin)
    ids = random_prompt(2, 48, llama.vocab_size)
    ref = _logits(twin, ids)
    assert cpu_gemm.mark(model, "aten", "bf16") == 4 * llama.num_layers + 1
    assert cpu_gemm.path_of(model.lm_head.weight) == "bf16"
    got = _logits(model, ids)
    err = (got - ref) / ref.std()
    assert err.pow(2).mean().sqrt() <= 0.02 and err.abs().max() <= 0.1
    with pytest.raises(ValueError, match="aten, onednn, bf16"):
        cpu_gemm.mark(model, "aten", "int8")


def _bf16_checkpoint(src, dst):
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        save_file({k: v.bfloat16() for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    return dst


def test_engine_greedy_equals_fp32_on_a_bf16_checkpoint(llama, tmp_path):
    """A bf16 checkpoint: bf16 storage computes what fp32 weights would, token for token."""
    path = _bf16_checkpoint(llama.path, tmp_path / "bf16")
    prompts = [random_prompt(s, n, llama.vocab_size) for s, n in ((3, 5), (4, 30), (5, 12))]
    from strata import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    narrow = make_llm(path, dtype="auto", quantization="bf16")
    assert narrow.engine.dtype == torch.float32 and narrow.engine.config.quantization == "bf16"
    assert narrow.engine.config.dtype == "float32"
    cpu_gemm.mark(narrow.engine.model, "aten", "aten")  # exact prefill (the engine marked this machine's fastest)
    wide = make_llm(path, dtype="float32")
    cpu_gemm.mark(wide.engine.model, "aten", "aten")
    got = [o.outputs[0].token_ids for o in narrow.generate(prompts, sp, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in wide.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    assert narrow.engine.plan.weight_bytes < wide.engine.plan.weight_bytes * 0.6


def test_dtype_bfloat16_runs_the_narrow_weight_kernels(llama, tmp_path):
    """--dtype bfloat16 on a CPU (a vLLM habit) is bf16 storage with fp32 activations and a bf16 KV
    cache: the same engine, and the same tokens, as --quantization bf16 --kv-cache-dtype bfloat16
    (before, it ran torch's bf16 GEMV at half the speed)."""
    from strata import SamplingParams
    from strata.kernels import cpu_bf16

    if not cpu_bf16.available():
        pytest.skip("numba not installed: bf16 compute stays torch's")
    path = _bf16_checkpoint(llama.path, tmp_path / "bf16")
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [random_prompt(s, n, llama.vocab_size) for s, n in ((6, 7), (7, 21))]
    habit = make_llm(path, dtype="bfloat16")
    cfg = habit.engine.config
    assert (cfg.dtype, cfg.quantization, cfg.kv_cache_dtype) == ("float32", "bf16", "bfloat16")
    assert habit.engine.kv_caches[0].dtype == torch.bfloat16
    cpu_gemm.mark(habit.engine.model, "aten", "aten")
    narrow = make_llm(path, dtype="float32", quantization="bf16", kv_cache_dtype="bfloat16")
    cpu_gemm.mark(narrow.engine.model, "aten", "aten")
    got = [o.outputs[0].token_ids for o in habit.generate(prompts, sp, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in narrow.generate(prompts, sp, use_tqdm=False)]
    kept = make_llm(path, dtype="bfloat16", kv_cache_dtype="auto", quantization="int8")
    assert (kept.engine.config.dtype, kept.engine.config.quantization) == ("float32", "int8")


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_auto_dtype_with_quantised_weights_keeps_fp32_activations(method):
    """dtype auto + int8/int4 on CPU: fp32 activations (the quantised kernels), whatever the
    profile says of bf16 matmuls; a bf16 compute dtype would route every projection through
    torch's dequantize-and-matmul."""
    from strata.kernels import cpu_bf16
    from strata.platform.cpu import resolve_weight_storage

    if not cpu_bf16.available():
        pytest.skip("numba not installed: no quantised CPU kernels")
    cfg = resolve_weight_storage(EngineConfig(dtype="auto", quantization=method), torch.bfloat16, None)
    assert (cfg.dtype, cfg.quantization) == ("float32", method)


def test_auto_policy_by_measurement():
    from dataclasses import replace

    from strata.hardware.profile import HardwareProfile

    base = HardwareProfile(
        device="cpu", name="synthetic", cores=2, threads=2, isa=[], memory_bytes=2**34, mem_bandwidth_gbs=40.0,
        linear_gbs={"float32": 30.0, "bfloat16": 29.0}, matmul_gflops={"float32": 60.0, "bfloat16": 60.0},
        torch_version=torch.__version__, gemm_gflops={"float32": 200.0, "bfloat16": 900.0},
    )
    use, prefill, why = cpu_policy.bf16_storage(base, torch.bfloat16)
    assert use and prefill == "bf16" and "1.93x tokens/s" in why
    slow_gemm = replace(base, gemm_gflops={"float32": 200.0, "bfloat16": 60.0})  # no bf16 arithmetic (AVX2)
    assert cpu_policy.bf16_storage(slow_gemm, torch.bfloat16)[:2] == (True, "fp32")
    slow_gemv = replace(base, linear_gbs={"float32": 30.0, "bfloat16": 14.0})  # no narrow-reading GEMV
    assert cpu_policy.bf16_storage(slow_gemv, torch.bfloat16)[0] is False
    use, _, why = cpu_policy.bf16_storage(base, torch.float32)  # rounding an fp32 checkpoint: never automatic
    assert not use and "not bf16" in why


def test_config_refuses_contradictions():
    with pytest.raises(ConfigError, match="--dtype float32"):
        EngineConfig(model="x", quantization="bf16", dtype="bfloat16")
    with pytest.raises(ConfigError, match="CPU path"):
        EngineConfig(model="x", quantization="bf16", device="cuda")
    with pytest.raises(ConfigError, match="tensor parallelism"):
        EngineConfig(model="x", quantization="bf16", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="int8, int4 or bf16"):
        EngineConfig(model="x", quantization="fp8")
