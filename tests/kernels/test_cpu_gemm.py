"""Prefill GEMM paths marked on weights (kernels/cpu_gemm.py) against torch's fp32 F.linear."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from strata.errors import ConfigError
from strata.hardware.profile import HardwareProfile
from strata.kernels import cpu_gemm, cpu_quant, quant_formats
from strata.kernels.linear import linear
from strata.platform import cpu_policy

needs_onednn = pytest.mark.skipif(not cpu_gemm.onednn_available(), reason="torch built without oneDNN")


def _tol(in_f: int) -> dict:
    return dict(rtol=1e-5, atol=2e-7 * in_f + 1e-5)


@needs_onednn
@pytest.mark.parametrize("shape", [(17, 64), (333, 100), (1024, 576)])
@pytest.mark.parametrize("rows", [17, 40, 130])
def test_onednn_fp32_path_matches_torch(shape, rows):
    g = torch.Generator().manual_seed(rows + shape[0])
    w = nn.Parameter(torch.randn(*shape, generator=g), requires_grad=False)
    b = torch.randn(shape[0], generator=g)
    x = torch.randn(2, rows, shape[1], generator=g)  # any leading shape
    ref = F.linear(x, w, b)
    setattr(w, cpu_gemm.ATTR, "onednn")
    with torch.inference_mode():
        got = linear(x, w, b)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, **_tol(shape[1]))
    xg = torch.randn(20, shape[1], requires_grad=True)  # autograd: torch's path, which has a backward
    linear(xg, w).sum().backward()
    assert xg.grad is not None


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("path", ["aten", "onednn", "bf16"])
def test_quantised_prefill_paths(method, path):
    if path == "onednn" and not cpu_gemm.onednn_available():
        pytest.skip("torch built without oneDNN")
    torch.manual_seed(0)  # a product on a bf16 rounding boundary can round either way: fixed inputs
    w, x, b = torch.randn(300, 256), torch.randn(40, 256), torch.randn(300)
    if method == "int8":
        q, s = quant_formats.quantize_int8(w)
        ref_w = quant_formats.dequantize_int8_ref(q, s)
    else:
        q, s = quant_formats.quantize_int4(w, 64)
        ref_w = quant_formats.dequantize_int4_ref(q, s)
    got = cpu_quant.matmul(method, x, q, s, 64 if method == "int4" else 0, b, path)
    if path == "bf16":  # activations, weights and the product rounded to bf16 (oneDNN's bf16 GEMM)
        ref = F.linear(x.bfloat16().float(), ref_w.bfloat16().float()).bfloat16().float() + b
        torch.testing.assert_close(got, ref, rtol=2**-7, atol=1e-3)
    else:
        torch.testing.assert_close(got, F.linear(x, ref_w, b), **_tol(256))


def test_mark_sets_paths_by_weight_storage():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].weight = nn.Parameter(model[1].weight.detach().bfloat16(), requires_grad=False)
    assert cpu_gemm.path_of(model[0].weight) == "aten"  # unmarked
    path = "onednn" if cpu_gemm.onednn_available() else "aten"
    assert cpu_gemm.mark(model, path, "bf16") == 2
    assert cpu_gemm.path_of(model[0].weight) == path and cpu_gemm.path_of(model[1].weight) == "bf16"
    with pytest.raises(ValueError, match="choose aten, onednn"):
        cpu_gemm.mark(model, "bf16", "aten")


def _profile(gemm: dict) -> HardwareProfile:
    return HardwareProfile(
        device="cpu", name="synthetic", cores=2, threads=2, isa=[], memory_bytes=2**34, mem_bandwidth_gbs=40.0,
        linear_gbs={"float32": 30.0}, matmul_gflops={"float32": 60.0}, torch_version=torch.__version__,
        gemm_gflops=gemm,
    )


def test_prefill_gemm_policy_by_measurement():
    amd = _profile({"float32": 200.0, "float32_onednn": 450.0, "bfloat16": 970.0})
    assert cpu_policy.prefill_gemms(amd)[:2] == ("onednn", "bf16")
    mkl_wins = _profile({"float32": 300.0, "float32_onednn": 290.0, "bfloat16": 310.0})  # no bf16 edge
    assert cpu_policy.prefill_gemms(mkl_wins)[:2] == ("aten", "aten")
    no_onednn = _profile({"float32": 200.0, "bfloat16": 60.0})  # AVX2: slow bf16, no oneDNN figure
    fp32, narrow, why = cpu_policy.prefill_gemms(no_onednn)
    assert (fp32, narrow) == ("aten", "aten") and "fp32 weights aten" in why


@pytest.mark.skipif(not (cpu_quant.available() and hasattr(torch, "_int_mm")), reason="needs numba and torch._int_mm")
def test_int8_prefill_gemm_by_measurement_and_switches(monkeypatch):
    fast = _profile({"float32": 200.0, "float32_onednn": 450.0, "bfloat16": 400.0, "int8_int8": 800.0})
    path, why = cpu_policy.int8_prefill_gemm(fast, "bf16")
    assert path == "bf16" and "STRATA_INT8_PREFILL=w8a8" in why  # opt-in
    monkeypatch.setenv("STRATA_INT8_PREFILL", "w8a8")
    fast = _profile({"float32": 200.0, "float32_onednn": 450.0, "bfloat16": 400.0, "int8_int8": 800.0})
    assert cpu_policy.int8_prefill_gemm(fast, "bf16")[0] == "int8"
    slow = _profile({"float32": 200.0, "bfloat16": 400.0, "int8_int8": 420.0})  # within the margin: not worth it
    assert cpu_policy.int8_prefill_gemm(slow, "bf16")[0] == "bf16"
    assert cpu_policy.int8_prefill_gemm(_profile({"bfloat16": 400.0}), "bf16")[0] == "bf16"  # unmeasured
    for forced in ("aten", "bf16"):
        monkeypatch.setenv("STRATA_PREFILL_GEMM", forced)
        assert cpu_policy.int8_prefill_gemm(fast, forced)[0] == forced
    monkeypatch.delenv("STRATA_PREFILL_GEMM")
    monkeypatch.setenv("STRATA_INT8_FP32_ACTIVATIONS", "1")
    path, why = cpu_policy.int8_prefill_gemm(fast, "bf16")
    assert path == "bf16" and "STRATA_INT8_FP32_ACTIVATIONS" in why


@pytest.mark.skipif(not (cpu_quant.available() and hasattr(torch, "_int_mm")), reason="needs numba and torch._int_mm")
def test_int4_prefill_gemm_is_w8a8_by_default_where_it_measures_faster(monkeypatch):
    from strata.kernels import cpu_simd

    fast = _profile({"float32": 200.0, "float32_onednn": 450.0, "bfloat16": 400.0, "int8_int8": 800.0})
    path, why = cpu_policy.int8_prefill_gemm(fast, "bf16", "int4")
    assert path == ("int8" if cpu_simd.has_ssse3() else "bf16") and "int4" in why
    slow = _profile({"float32": 200.0, "bfloat16": 400.0, "int8_int8": 420.0})
    assert cpu_policy.int8_prefill_gemm(slow, "bf16", "int4")[0] == "bf16"
    for env, value in (("STRATA_INT4_PREFILL", "dequant"), ("STRATA_INT4_FP32_ACTIVATIONS", "1"),
                       ("STRATA_PREFILL_GEMM", "bf16")):
        with monkeypatch.context() as m:
            m.setenv(env, value)
            assert cpu_policy.int8_prefill_gemm(fast, "bf16", "int4")[0] == "bf16"


def test_mark_gives_int8_weights_their_path_and_fallback():
    q8 = nn.Module()
    q8.qweight, q8.method = torch.zeros(4, 4, dtype=torch.int8), "int8"
    q4 = nn.Module()
    q4.qweight, q4.method = torch.zeros(4, 2, dtype=torch.uint8), "int4"
    model = nn.Sequential(q8, q4)
    assert cpu_gemm.mark(model, "aten", "bf16", "int8") == 2
    assert (cpu_gemm.path_of(q8), cpu_gemm.fallback_of(q8)) == ("int8", "bf16")
    assert (cpu_gemm.path_of(q4), cpu_gemm.fallback_of(q4)) == ("bf16", "bf16")
    assert cpu_gemm.mark(model, "aten", "bf16", "bf16", "int8") == 2  # int4 on W8A8, int8 not
    assert (cpu_gemm.path_of(q8), cpu_gemm.path_of(q4), cpu_gemm.fallback_of(q4)) == ("bf16", "int8", "bf16")
    with pytest.raises(ValueError, match="int8 or the narrow path"):
        cpu_gemm.mark(model, "aten", "bf16", "onednn")


def test_prefill_gemm_override(monkeypatch):
    amd = _profile({"float32": 200.0, "float32_onednn": 450.0, "bfloat16": 970.0})
    monkeypatch.setenv("STRATA_PREFILL_GEMM", "aten")  # exact everywhere, whatever was measured
    assert cpu_policy.prefill_gemms(amd)[:2] == ("aten", "aten")
    monkeypatch.setenv("STRATA_PREFILL_GEMM", "bf16")
    assert cpu_policy.prefill_gemms(_profile({"float32": 300.0, "bfloat16": 100.0}))[:2] == ("aten", "bf16")
    monkeypatch.setenv("STRATA_PREFILL_GEMM", "fast")
    with pytest.raises(ConfigError, match="STRATA_PREFILL_GEMM='fast'.*choose auto"):
        cpu_policy.prefill_gemms(amd)


@pytest.mark.parametrize("method,group", [("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128)])
@pytest.mark.parametrize("shape", [(1, 128), (37, 384), (301, 256)])
def test_dequantize_bf16_is_the_reference_rounded(method, group, shape):
    """The bf16 dequantisation is the fp32 reference rounded to bf16: bit for bit for int8, within
    one bf16 step for int4 (its kernel computes q * s - 8 * s, one fp32 rounding apart), and for
    int4 bit for bit the fp32 dequantising kernel's row rounded to bf16 (one pass in registers)."""
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0] + group)) * 3
    if method == "int8":
        q, s = quant_formats.quantize_int8(w)
        ref = quant_formats.dequantize_int8_ref(q, s)
    else:
        q, s = quant_formats.quantize_int4(w, group)
        ref = quant_formats.dequantize_int4_ref(q, s)
    out = torch.empty(*shape, dtype=torch.bfloat16)
    cpu_quant.dequantize_bf16(method, q, s, out, group)
    if method == "int8":
        assert torch.equal(out.view(torch.int16), ref.bfloat16().view(torch.int16))
    else:
        torch.testing.assert_close(out.float(), ref.bfloat16().float(), rtol=2**-7, atol=0)
        assert (out != ref.bfloat16()).float().mean() < 0.01
        fp32 = cpu_quant.dequantize(method, q, s, shape[1], group)
        assert torch.equal(out.view(torch.int16), fp32.bfloat16().view(torch.int16))
        if cpu_quant._AVX512BW:  # the table-lookup kernel ran above; the arithmetic one gives the same bits
            bits = torch.empty(*shape, dtype=torch.int16)
            cpu_quant._int4_dequant_bf16(q.numpy(), s.numpy(), bits.numpy().view("uint16"), group, 2, False)
            assert torch.equal(out.view(torch.int16), bits)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantised_bf16_prefill_tiles_agree_with_one_tile(method, monkeypatch):
    """A weight larger than the bf16 buffer (an LM head) runs tile by tile with the same result."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(333, 128, generator=g), torch.randn(24, 128, generator=g)
    q, s = quant_formats.quantize_int8(w) if method == "int8" else quant_formats.quantize_int4(w, 64)
    whole = cpu_quant.matmul(method, x, q, s, 64, None, "bf16")
    monkeypatch.setattr(cpu_quant, "BF16_TILE_BYTES", 2 * 128 * 50)  # 50-row tiles, the last one short
    tiled = cpu_quant.matmul(method, x, q, s, 64, None, "bf16")
    assert tiled.shape == (24, 333) and tiled.dtype == torch.float32
    assert torch.equal(tiled, whole)
