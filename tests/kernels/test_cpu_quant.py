"""Weight-only int8/int4 formats and numba kernels against their torch twins (dequantise + F.linear)."""

import os

import pytest
import torch
import torch.nn.functional as F

from strata.errors import ConfigError
from strata.kernels import cpu_quant, cpu_w8a8, quant_formats
from strata.kernels.linear import quant_linear, quant_swiglu

needs_numba = pytest.mark.skipif(not cpu_quant.available(), reason="numba not installed")


class _Q:
    """A minimal stand-in for memory.quant.QuantLinear (what kernels.linear reads)."""

    def __init__(self, w: torch.Tensor, method: str, group_size: int = 64) -> None:
        """method "int8g": grouped int8 (a scale per 32 columns, a GGUF's Q8_0); "int8g16" per 16
        (Q6_K); a "z" suffix ("int8gz", "int8g16z", "int4z": int4 group 32) adds zero points
        (scale [out, 2, groups]: a GGUF's Q4_K / Q5_K / Q4_1 / Q5_1)."""
        zero = method.endswith("z")
        method = method.removesuffix("z")
        grouped = {"int8g": 32, "int8g16": 16}.get(method)
        method = "int8" if grouped else method
        if zero and method == "int4":
            group_size = 32
        self.method, self.in_features = method, w.shape[1]
        self.group_size = quant_formats.int4_group_size(w.shape[1], group_size) if method == "int4" else 0
        if grouped:
            self.group_size = grouped
            self.qweight, self.scale = quant_formats.quantize_int8(w, grouped)
        elif method == "int8":
            self.qweight, self.scale = quant_formats.quantize_int8(w)
        else:
            self.qweight, self.scale = quant_formats.quantize_int4(w, self.group_size)
        if zero:  # zero points of the size a group's minimum has: about its scale times 8
            g = torch.Generator().manual_seed(w.shape[0])
            self.scale = torch.stack([self.scale, self.scale * 8 * torch.rand(self.scale.shape, generator=g)], dim=1)

    def kernel_weights(self):
        return self.qweight, self.scale

    def dequantize(self, dtype=torch.float32):
        if self.method == "int8":
            return quant_formats.dequantize_int8_ref(self.qweight, self.scale, dtype)
        return quant_formats.dequantize_int4_ref(self.qweight, self.scale, dtype)


ALL_METHODS = ["int8", "int8g", "int4", "int8g16", "int8gz", "int8g16z", "int4z"]


def _seen(x: torch.Tensor, q: _Q) -> torch.Tensor:
    """The input the kernel computes with: on a VNNI CPU, int4 batch-1 rounds it to int8 per weight
    group, int8 GEMVs per group of cpu_quant.INT8_ACT_GROUP columns; the group-32 layouts (int4
    group 32, grouped int8) to llama.cpp's q8_0 blocks at any row count."""
    rows = x.reshape(-1, x.shape[-1])
    many = rows.shape[0] > cpu_quant.MAX_ROWS  # the matmul path: q8_0 there only when asked
    q8_0 = q.group_size == 32 and os.environ.get("STRATA_GROUP32_PREFILL") == "q8_0"
    grouped = q.group_size == 32 or (q.method == "int8" and q.group_size == 16)
    if (grouped and (not many or q8_0)
            and (cpu_quant.int8_int8(rows.shape[1], 32) if q.method == "int8"
                 else cpu_quant.int8_activations(rows.shape[0], 32, rows.shape[1]))):
        return quant_formats.quantize_activations_q8_0_ref(rows).view_as(x)
    if q.method == "int4" and not many and cpu_quant.int8_activations(rows.shape[0], q.group_size, rows.shape[1]):
        return quant_formats.quantize_activations_ref(rows, q.group_size).view_as(x)
    if q.method == "int8" and rows.shape[0] <= cpu_quant.MAX_ROWS and cpu_quant.int8_int8(rows.shape[1]):
        return quant_formats.quantize_activations_ref(rows, cpu_quant.INT8_ACT_GROUP).view_as(x)
    return x


def _tol(in_f: int) -> dict:
    # fp32 summation order differs from F.linear's: error ~ eps * sqrt(n) * |x| * |w|
    return dict(rtol=1e-5, atol=2e-7 * in_f + 1e-5)


# --- formats ------------------------------------------------------------------------------------


def test_int8_roundtrip_error_is_half_a_step():
    w = torch.randn(37, 200) * torch.rand(37, 1) * 3
    w[5] = 0.0  # an all-zero row must not divide by zero
    q, s = quant_formats.quantize_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (37,)
    assert int(q.abs().max()) <= 127
    err = (quant_formats.dequantize_int8_ref(q, s) - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-6).all())
    assert bool((q[5] == 0).all())


def test_kernels_refuse_mismatched_shapes():
    q = _Q(torch.randn(8, 64), "int4")
    with pytest.raises(ValueError, match="do not fit"):
        cpu_quant.gemv("int4", torch.randn(1, 32), q.qweight, q.scale, q.group_size)
    q8 = _Q(torch.randn(8, 64), "int8")
    with pytest.raises(ValueError, match="do not fit"):
        cpu_quant.gemv("int8", torch.randn(1, 65), q8.qweight, q8.scale, 0)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_roundtrip_error_is_at_most_a_step(group):
    w = torch.randn(19, 256) * 2
    q, s = quant_formats.quantize_int4(w, group)
    assert q.dtype == torch.uint8 and q.shape == (19, 128) and s.shape == (19, 256 // group)
    deq = quant_formats.dequantize_int4_ref(q, s)
    step = s.abs().repeat_interleave(group, dim=1)
    err = (deq - w).abs()
    # half a step when rounding, one step only where +8 clamps to 7 on the far side of the extreme
    assert bool((err <= step + 1e-6).all())
    assert float(err.mean()) < float(step.mean()) / 3.5
    # the largest-magnitude value of each group is exact
    wg, dg = w.view(19, -1, group), deq.view(19, -1, group)
    idx = wg.abs().argmax(2, keepdim=True)
    torch.testing.assert_close(dg.gather(2, idx), wg.gather(2, idx), rtol=1e-6, atol=1e-6)


def test_int4_nibble_layout():
    # one row, one group of 4 columns: byte k holds column k (low) and column k + 2 (high)
    packed = torch.tensor([[0x9A, 0x0F]], dtype=torch.uint8)  # cols: 0xA, 0xF | 0x9, 0x0
    scale = torch.tensor([[0.5]])
    got = quant_formats.dequantize_int4_ref(packed, scale)
    torch.testing.assert_close(got, torch.tensor([[(10 - 8) * 0.5, (15 - 8) * 0.5, (9 - 8) * 0.5, -4.0]]))
    q, s = quant_formats.quantize_int4(got, 4)
    torch.testing.assert_close(quant_formats.dequantize_int4_ref(q, s), got)


def test_int4_group_size_rule():
    assert quant_formats.int4_group_size(4096, 128) == 128
    assert quant_formats.int4_group_size(576, 128) == 64  # smol-135m's hidden size
    assert quant_formats.int4_group_size(896, 128) == 128
    assert quant_formats.int4_group_size(1536, 32) == 32
    assert quant_formats.int4_group_size(100, 64) is None  # no group of >= 32 divides 100
    with pytest.raises(ValueError, match="divide"):
        quant_formats.quantize_int4(torch.randn(2, 100), 64)


# --- kernels vs torch twins ---------------------------------------------------------------------


@needs_numba
@pytest.mark.parametrize("method", ALL_METHODS)
@pytest.mark.parametrize("rows", [1, 2, 5, 9, 14, cpu_quant.MAX_ROWS])
@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (96, 64), (333, 128), (1024, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(method, rows, shape, bias):
    g = torch.Generator().manual_seed(rows * 1000 + shape[0])
    out_f, in_f = shape
    w = torch.randn(out_f, in_f, generator=g)
    x = torch.randn(rows, in_f, generator=g)
    b = torch.randn(out_f, generator=g) if bias else None
    q = _Q(w, method)
    with torch.inference_mode():
        assert cpu_quant.usable(x, q.qweight)
        got = cpu_quant.gemv(q.method, x, q.qweight, q.scale, q.group_size, b)
    torch.testing.assert_close(got, F.linear(_seen(x, q), q.dequantize(), b), **_tol(in_f))


@needs_numba
@pytest.mark.parametrize("in_f", [1, 15, 17, 70])
def test_int8_columns_past_the_vector_steps(in_f):
    w, x = torch.randn(33, in_f), torch.randn(2, in_f)
    q = _Q(w, "int8")
    with torch.inference_mode():
        torch.testing.assert_close(cpu_quant.gemv("int8", x, q.qweight, q.scale, 0), F.linear(x, q.dequantize()), **_tol(in_f))
        gate, up = F.linear(x, q.dequantize()[:32]).chunk(2, dim=-1)
        got = cpu_quant.gemv_swiglu("int8", x, q.qweight[:32], q.scale[:32], 0)
        torch.testing.assert_close(got, F.silu(gate) * up, **_tol(in_f))


@needs_numba
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3])
def test_int4_group_sizes(group, rows):
    w, x = torch.randn(160, 512), torch.randn(rows, 512)
    q = _Q(w, "int4", group)
    assert q.group_size == group
    with torch.inference_mode():
        got = cpu_quant.gemv("int4", x, q.qweight, q.scale, q.group_size)
    torch.testing.assert_close(got, F.linear(_seen(x, q), q.dequantize()), **_tol(512))


@needs_numba
@pytest.mark.parametrize("method", ALL_METHODS)
@pytest.mark.parametrize("rows", [1, 4, 11, cpu_quant.MAX_ROWS])
@pytest.mark.parametrize("shape", [(2, 64), (96, 64), (3072, 576)])
def test_gemv_swiglu_matches_reference(method, rows, shape):
    g = torch.Generator().manual_seed(rows + shape[0])
    w = torch.randn(*shape, generator=g) * 0.1
    x = torch.randn(rows, shape[1], generator=g)
    q = _Q(w, method)
    gate, up = F.linear(_seen(x, q), q.dequantize()).chunk(2, dim=-1)
    with torch.inference_mode():
        got = cpu_quant.gemv_swiglu(q.method, x, q.qweight, q.scale, q.group_size)
        torch.testing.assert_close(got, F.silu(gate) * up, **_tol(shape[1]))
        torch.testing.assert_close(quant_swiglu(x, q), got)


@needs_numba
@pytest.mark.parametrize("method", ALL_METHODS)
@pytest.mark.parametrize("shape", [(17, 64), (2100, 64), (300, 4096)])  # one tile, several, short tiles
@pytest.mark.parametrize("prefill", ["fast", "q8_0"])
def test_tiled_matmul_matches_reference(method, shape, prefill, monkeypatch):
    """Many rows: dequantise + GEMM; with STRATA_GROUP32_PREFILL=q8_0 a group-32 weight (grouped
    int8) on VNNI runs the q8_0 kernels over row blocks instead, four rows a weight step."""
    monkeypatch.setenv("STRATA_GROUP32_PREFILL", prefill)
    w, x, b = torch.randn(*shape), torch.randn(142, shape[1]), torch.randn(shape[0])
    q = _Q(w, method)
    got = cpu_quant.matmul(q.method, x, q.qweight, q.scale, q.group_size, b)
    assert got.is_contiguous()
    torch.testing.assert_close(got, F.linear(_seen(x, q), q.dequantize(), b), **_tol(shape[1]))


@needs_numba
@pytest.mark.skipif(not cpu_quant.int8_activations(1, 64, 1024), reason="needs AVX-512 VNNI (int4 x int8 kernel)")
@pytest.mark.parametrize("n_in", [32, 96, 160])
def test_int4_group_32_kernel_with_an_odd_group_count(n_in):
    """Group 32 takes two groups a step; a row of an odd group count ends on a single one (a
    tensor-parallel shard's half row can): it equals the twin either way, GEMV and SwiGLU."""
    g = torch.Generator().manual_seed(n_in)
    w, x = torch.randn(70, n_in, generator=g), torch.randn(1, n_in, generator=g)
    q = _Q(w, "int4", 32)
    seen = quant_formats.quantize_activations_q8_0_ref(x)
    with torch.inference_mode():
        torch.testing.assert_close(cpu_quant.gemv("int4", x, q.qweight, q.scale, 32), F.linear(seen, q.dequantize()),
                                   **_tol(n_in))
        gate, up = F.linear(seen, q.dequantize()).chunk(2, dim=1)
        torch.testing.assert_close(cpu_quant.gemv_swiglu("int4", x, q.qweight, q.scale, 32), F.silu(gate) * up,
                                   **_tol(n_in))


@needs_numba
@pytest.mark.skipif(not cpu_quant.int8_activations(1, 64, 1024), reason="needs AVX-512 VNNI (int4 x int8 kernel)")
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_int8_activation_kernel(group, monkeypatch):
    """The VNNI kernel equals its twin (activations rounded per group, then dequantise + F.linear),
    stays within 1% of a row's largest output from the fp32-activation kernel, and the
    environment switch restores the fp32 kernel exactly."""
    g = torch.Generator().manual_seed(group)
    w, x = torch.randn(300, 1024, generator=g), torch.randn(1, 1024, generator=g)
    x[0, :group] = 0.0  # an all-zero group: scale 1, no division by zero
    q = _Q(w, "int4", group)
    seen = quant_formats.quantize_activations_q8_0_ref(x) if group == 32 else quant_formats.quantize_activations_ref(x, group)
    twin = F.linear(seen, q.dequantize())
    exact = F.linear(x, q.dequantize())
    with torch.inference_mode():
        got = cpu_quant.gemv("int4", x, q.qweight, q.scale, group)
        torch.testing.assert_close(got, twin, **_tol(1024))
        assert (got - exact).abs().max() <= 0.01 * exact.abs().max()
        monkeypatch.setenv("STRATA_INT4_FP32_ACTIVATIONS", "1")
        assert not cpu_quant.int8_activations(1, group, 1024)
        torch.testing.assert_close(cpu_quant.gemv("int4", x, q.qweight, q.scale, group), exact, **_tol(1024))
    assert not cpu_quant.int8_activations(2, 64, 1024)  # batch 1 only


@needs_numba
@pytest.mark.skipif(not cpu_quant.int8_int8(64), reason="needs AVX-512 VNNI (int8 x int8 kernel)")
@pytest.mark.parametrize("rows", [1, 3, cpu_quant.MAX_ROWS])
def test_int8_int8_activation_kernel(rows, monkeypatch):
    """The int8 x int8 GEMV equals its twin (activations rounded per 64 columns, then dequantise +
    F.linear), including weights at -128 and an all-zero group; it stays within 1% of the largest
    output of the fp32-activation kernel; the environment switch restores that kernel exactly, and
    widths that are not a multiple of 64 take it too."""
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(300, 1024, generator=g), torch.randn(rows, 1024, generator=g)
    x[:, 64:128] = 0.0
    q = _Q(w, "int8")
    q.qweight[:5, :7] = -128  # |-128| = 128 as the unsigned VPDPBUSD operand
    twin = F.linear(quant_formats.quantize_activations_ref(x, 64), q.dequantize())
    exact = F.linear(x, q.dequantize())
    with torch.inference_mode():
        got = cpu_quant.gemv("int8", x, q.qweight, q.scale, 0)
        torch.testing.assert_close(got, twin, **_tol(1024))
        assert (got - exact).abs().max() <= 0.01 * exact.abs().max()
        gate, up = twin[:, :150], twin[:, 150:]
        swiglu = cpu_quant.gemv_swiglu("int8", x, q.qweight, q.scale, 0)
        torch.testing.assert_close(swiglu, F.silu(gate) * up, rtol=1e-4, atol=1e-3)  # a product of two sums
        monkeypatch.setenv("STRATA_INT8_FP32_ACTIVATIONS", "1")
        assert not cpu_quant.int8_int8(1024)
        torch.testing.assert_close(cpu_quant.gemv("int8", x, q.qweight, q.scale, 0), exact, **_tol(1024))
    monkeypatch.delenv("STRATA_INT8_FP32_ACTIVATIONS")
    assert cpu_quant.int8_int8(1024) and not cpu_quant.int8_int8(96)


needs_int8_prefill = pytest.mark.skipif(not (cpu_quant.available() and hasattr(torch, "_int_mm")),
                                        reason="needs numba and torch._int_mm")


@pytest.fixture
def w8a8(monkeypatch):
    monkeypatch.setenv(cpu_quant.INT8_PREFILL_ENV, "w8a8")
    assert cpu_quant.int8_prefill_enabled()


@needs_int8_prefill
@pytest.mark.parametrize("rows, shape", [(17, (300, 1024)), (40, (77, 200)), (64, (1536, 576)), (129, (5, 33))])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_prefill_matches_its_twin(rows, shape, bias, w8a8):
    """Path "int8": per-row int8 activations x int8 weights in integers equal their twin (the rows
    rounded per row, then dequantise + F.linear), weights at -128 and an all-zero row included,
    and stay within 2% of the largest output of the exact (fp32-activation) product."""
    g = torch.Generator().manual_seed(rows + shape[1])
    w, x = torch.randn(*shape, generator=g), torch.randn(rows, shape[1], generator=g)
    x[3] = 0.0
    b = torch.randn(shape[0], generator=g) if bias else None
    q = _Q(w, "int8")
    q.qweight[:2, :3] = -128
    twin = F.linear(quant_formats.quantize_activations_ref(x, shape[1]), q.dequantize(), b)
    exact = F.linear(x, q.dequantize(), b)
    got = cpu_quant.matmul("int8", x, q.qweight, q.scale, 0, b, "int8", "aten")
    torch.testing.assert_close(got, twin, **_tol(shape[1]))
    assert (got - exact).abs().max() <= 0.02 * exact.abs().max()


@needs_int8_prefill
def test_w8a8_prefill_refuses_outlier_rows_and_obeys_the_switch(w8a8, monkeypatch):
    """A row with max|x| above INT8_PREFILL_MAX_RATIO x its rms is recomputed by the decode kernel
    (a few such rows) or the fallback path (many), bit for bit, and the other rows keep their W8A8
    numbers; STRATA_INT8_FP32_ACTIVATIONS=1 or no STRATA_INT8_PREFILL=w8a8 sends everything down
    the fallback path."""
    _check_w8a8_refusals_and_switches(
        monkeypatch, "int8", 0, 50.0, (("STRATA_INT8_FP32_ACTIVATIONS", "1"), (cpu_quant.INT8_PREFILL_ENV, "")))


def _check_w8a8_refusals_and_switches(monkeypatch, method: str, group: int, spike: float, switches) -> None:
    """Rows with a channel at `spike` x their rms are computed by the decode kernel (a few) or
    the fallback path (many, all), bit for bit, the others keep their W8A8 numbers; each
    (env, value) in `switches` sends everything down the fallback path."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(96, 512, generator=g), torch.randn(40, 512, generator=g)
    q = _Q(w, method)
    w8a8 = cpu_quant.matmul(method, x, q.qweight, q.scale, group, None, "int8", "aten")
    plain = cpu_quant.matmul(method, x, q.qweight, q.scale, group, None, "aten")
    assert not torch.equal(w8a8, plain)
    for spikes in ([7], list(range(0, 40, 2)), list(range(40))):  # one row; more than MAX_ROWS; all
        spiky = x.clone()
        for r in spikes:
            spiky[r, 11] = spike * spiky[r].pow(2).mean().sqrt()
        got = cpu_quant.matmul(method, spiky, q.qweight, q.scale, group, None, "int8", "aten")
        other = cpu_quant.gemv(method, spiky[spikes], q.qweight, q.scale, group) \
            if len(spikes) <= cpu_quant.MAX_ROWS \
            else cpu_quant.matmul(method, spiky[spikes], q.qweight, q.scale, group, None, "aten")
        torch.testing.assert_close(got[spikes], other, rtol=0, atol=0)
        kept = [r for r in range(40) if r not in spikes]
        torch.testing.assert_close(got[kept], w8a8[kept], rtol=0, atol=0)
    for env, value in switches:
        with monkeypatch.context() as m:
            m.setenv(env, value)
            assert not cpu_w8a8.prefill_enabled(method)
            torch.testing.assert_close(cpu_quant.matmul(method, x, q.qweight, q.scale, group, None, "int8", "aten"),
                                       plain, rtol=0, atol=0)


needs_int4_prefill = pytest.mark.skipif(not (cpu_quant.available() and hasattr(torch, "_int_mm")
                                             and cpu_w8a8.prefill_enabled("int4")),
                                        reason="needs numba, torch._int_mm and SSSE3")


@needs_int4_prefill
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("shape", [(1, 128), (37, 384), (301, 256)])
def test_int4_requantised_to_int8_matches_its_twin(group, shape):
    """The per-call int4 -> int8 requantisation is requantize_int4_ref bit for bit (negative group
    scales, an all-zero row included) and stays within half a step of the row's int8 grid of the
    int4 weight."""
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0] + group)) * 3
    w[0, : group // 2] = 0.0
    if shape[0] > 2:
        w[2] = 0.0
    q, s = quant_formats.quantize_int4(w, group)
    w8, s8 = cpu_w8a8.requantize_int4(q.numpy(), s.numpy(), group)
    ref8, refs = quant_formats.requantize_int4_ref(q, s)
    assert torch.equal(torch.from_numpy(w8.copy()), ref8) and torch.equal(torch.from_numpy(s8), refs)
    err = (quant_formats.dequantize_int8_ref(ref8, refs) - quant_formats.dequantize_int4_ref(q, s)).abs()
    assert (err <= refs[:, None] * (0.5 + 1e-3)).all()


@needs_int4_prefill
@pytest.mark.parametrize("rows, shape, group", [(17, (300, 1024), 64), (40, (77, 256), 128), (64, (1536, 576), 64),
                                               (129, (5, 128), 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_w8a8_prefill_matches_its_twin(rows, shape, group, bias):
    """Path "int8" for int4 weights (on by default): per-row int8 activations x the requantised
    int8 weight equal their twin, and stay within 2% of the largest output of the exact int4
    (fp32-activation) product, a small part of the int4 rounding itself."""
    g = torch.Generator().manual_seed(rows + shape[1])
    w, x = torch.randn(*shape, generator=g), torch.randn(rows, shape[1], generator=g)
    x[3] = 0.0
    b = torch.randn(shape[0], generator=g) if bias else None
    q = _Q(w, "int4", group)
    w8, s8 = quant_formats.requantize_int4_ref(q.qweight, q.scale)
    twin = F.linear(quant_formats.quantize_activations_ref(x, shape[1]), quant_formats.dequantize_int8_ref(w8, s8), b)
    exact = F.linear(x, q.dequantize(), b)
    got = cpu_quant.matmul("int4", x, q.qweight, q.scale, q.group_size, b, "int8", "aten")
    torch.testing.assert_close(got, twin, **_tol(shape[1]))
    assert (got - exact).abs().max() <= 0.02 * exact.abs().max()
    if shape[0] > 200:  # the int4 weight's own error, for scale: many times the W8A8 path's
        assert (exact - F.linear(x, w, b)).norm() > 4 * (got - exact).norm()


@needs_int4_prefill
def test_int4_w8a8_prefill_refuses_outlier_rows_and_obeys_the_switches(monkeypatch):
    """A row with max|x| above INT4_PREFILL_MAX_RATIO x its rms is computed by the decode kernel (a
    few) or the fallback path (many), bit for bit, the other rows keep their W8A8 numbers;
    STRATA_INT4_PREFILL=dequant or STRATA_INT4_FP32_ACTIVATIONS=1 sends everything down the
    fallback path, and an unknown STRATA_INT4_PREFILL is refused by name."""
    _check_w8a8_refusals_and_switches(
        monkeypatch, "int4", 64, 30.0, (("STRATA_INT4_FP32_ACTIVATIONS", "1"), (cpu_quant.INT4_PREFILL_ENV, "dequant")))
    x = torch.randn(4, 512)
    q = _Q(torch.randn(96, 512), "int4")
    monkeypatch.setenv(cpu_quant.INT4_PREFILL_ENV, "fast")
    with pytest.raises(ConfigError, match="STRATA_INT4_PREFILL='fast'.*choose w8a8"):
        cpu_quant.matmul("int4", x, q.qweight, q.scale, 64, None, "int8", "aten")


@needs_numba
@pytest.mark.parametrize("method", ALL_METHODS)
def test_numba_dequantize_matches_reference(method):
    w = torch.randn(257, 384)
    q = _Q(w, method)
    got = cpu_quant.dequantize(q.method, q.qweight, q.scale, 384, q.group_size)
    torch.testing.assert_close(got, q.dequantize(), rtol=1e-6, atol=1e-6)
    bf16 = cpu_quant.dequantize_bf16(q.method, q.qweight, q.scale, torch.empty(257, 384, dtype=torch.bfloat16),
                                     q.group_size)
    if method != "int4":  # int8 and the zero-point layouts: bit for bit (cpu_quant.dequantize_bf16)
        assert torch.equal(bf16, q.dequantize().to(torch.bfloat16))
    ids = torch.tensor([0, 256, 7])
    torch.testing.assert_close(cpu_quant.embedding_rows(q.method, q.qweight, q.scale, ids, q.group_size),
                               q.dequantize()[ids], rtol=0, atol=0)


# --- dispatch -----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ALL_METHODS)
def test_dispatch_paths_agree(method):
    w, b = torch.randn(80, 128), torch.randn(80)
    q = _Q(w, method)
    ref_w = q.dequantize()
    with torch.inference_mode():
        for rows in (1, cpu_quant.MAX_ROWS, cpu_quant.MAX_ROWS + 1, 100):  # GEMV, then dequant + GEMM
            x = torch.randn(rows, 128)
            torch.testing.assert_close(quant_linear(x, q, b), F.linear(_seen(x, q), ref_w, b), **_tol(128))
        x3 = torch.randn(2, 7, 128)  # the plain causal forward's [B, L, H]
        assert quant_linear(x3, q).shape == (2, 7, 80)
        torch.testing.assert_close(quant_linear(x3, q), F.linear(_seen(x3, q), ref_w), **_tol(128))
        xb = torch.randn(3, 128, dtype=torch.bfloat16)  # not the kernel's dtype: torch twin
        assert not cpu_quant.usable(xb, q.qweight)
        torch.testing.assert_close(quant_linear(xb, q), F.linear(xb, q.dequantize(torch.bfloat16)))
        assert quant_swiglu(torch.randn(cpu_quant.MAX_ROWS + 1, 128), q) is None
    xg = torch.randn(2, 128, requires_grad=True)  # autograd flows through the torch path
    out = quant_linear(xg, q)
    out.sum().backward()
    torch.testing.assert_close(xg.grad, ref_w.sum(0).expand(2, -1), rtol=1e-5, atol=1e-5)


# --- llama.cpp's q8_0 activations (the group-32 layouts of GGUF files) ----------------------------


def test_q8_0_activation_reference_is_llama_cpps_block():
    """quantize_activations_q8_0_ref rounds as llama.cpp's q8_0 block does: its values equal the
    gguf package's (llama.cpp's formulas in numpy) Q8_0 quantise + dequantise on random rows."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 8)[:, None]
    want = quants.dequantize(quants.quantize(x.numpy(), T.Q8_0), T.Q8_0)
    torch.testing.assert_close(quant_formats.quantize_activations_q8_0_ref(x), torch.from_numpy(want), rtol=0, atol=0)


@needs_numba
def test_q8_0_activation_kernel_equals_its_reference_bit_for_bit():
    """The kernels' q8_0 rounding (cpu_quant._quant_rows at group 32) is the reference's exactly:
    fp16 scales rounded to nearest even, fp16 subnormal scales (tiny blocks), all-zero blocks."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 320, generator=g)
    x[1] *= 1e-4  # scales below fp16's smallest normal
    x[2, 32:64] = 0.0
    x[3] *= 3e3
    xq, xs, off = cpu_quant._quant_rows(x.numpy(), 32)
    got = torch.from_numpy(xq).float().view(6, 10, 32) * torch.from_numpy(xs)[..., None]
    assert torch.equal(got.view(6, 320), quant_formats.quantize_activations_q8_0_ref(x))
    torch.testing.assert_close(torch.from_numpy(off), 8 * torch.from_numpy(xs) * torch.from_numpy(xq).float().view(6, 10, 32).sum(2))


@needs_numba
@pytest.mark.skipif(not cpu_quant.int8_activations(1, 64, 1024), reason="needs AVX-512 VNNI (int4 x int8 kernel)")
@pytest.mark.parametrize("rows", [17, 64, 130])
@pytest.mark.parametrize("n_in", [96, 128, 576])  # 96: an odd group count (the row-by-row kernel)
def test_int4_group_32_q8_0_prefill_equals_its_twin(rows, n_in, monkeypatch):
    """STRATA_GROUP32_PREFILL=q8_0: an int4 group-32 (Q4_0) prefill equals its twin (q8_0
    activations, then dequantise + F.linear), padding rows and all; an unknown value is refused."""
    monkeypatch.setenv("STRATA_GROUP32_PREFILL", "q8_0")
    g = torch.Generator().manual_seed(rows + n_in)
    w, x = torch.randn(70, n_in, generator=g), torch.randn(rows, n_in, generator=g)
    x[5] = 0.0
    q = _Q(w, "int4", 32)
    twin = F.linear(quant_formats.quantize_activations_q8_0_ref(x), q.dequantize())
    torch.testing.assert_close(cpu_quant.matmul("int4", x, q.qweight, q.scale, 32), twin, **_tol(n_in))
    monkeypatch.setenv("STRATA_GROUP32_PREFILL", "exact")
    with pytest.raises(ConfigError, match="STRATA_GROUP32_PREFILL='exact': choose one of fast, q8_0"):
        cpu_quant.matmul("int4", x, q.qweight, q.scale, 32)


@pytest.mark.parametrize("n_in,group", [(48, 16), (96, 16), (128, 16), (96, 32), (128, 32)])
def test_fused_layer_picks_the_eager_int8_activation_rule(n_in, group):
    """The fused decode layer's kernel choice for grouped int8 (by 16 or 32) is the eager
    dispatch's: int8 activations in q8_0 blocks of 32, so only where 32 divides the row (48 does
    not: both take the fp32 kernel)."""
    from strata.kernels.cpu_decode_layer import uses_vnni

    assert uses_vnni("int8", n_in, 1, group) == cpu_quant.int8_int8(n_in, 32)
